"""Pure math: arrays in, arrays out (NumPy or CuPy, picked from the arguments). No I/O here.

The public names are imported on first use (PEP 562), so that a command imports only the ops it runs.

TensorFlow's ops under their names in snake_case (``FakeQuantWithMinMaxVars`` is
:func:`fake_quant_with_min_max_vars`), with TensorFlow's operand names as arguments and its outputs, in its
order, as results; torchao's quantizers under their config names.  The notebook's 2-bit fake quant on
[-6, 6], which TensorFlow nudges to [-8, 4] so that 0 is a level, and its gradient (the STE mask and the
sums below and above the range):

>>> import numpy as np
>>> from qgcli import ops
>>> x = np.array([-7.0, -6.0, -1.0, 1.0, 6.0], np.float32)
>>> ops.fake_quant_with_min_max_vars(x, -6.0, 6.0, num_bits=2)
array([-8., -4.,  0.,  0.,  4.], dtype=float32)
>>> dx, dmin, dmax = ops.fake_quant_with_min_max_vars_gradient(np.ones_like(x), x, -6.0, 6.0, num_bits=2)
>>> dx.tolist(), float(dmin), float(dmax)
([1.0, 1.0, 1.0, 1.0, 0.0], 0.0, 1.0)
"""
import importlib

#: public name -> the module of qgcli.ops that defines it
_EXPORTS = {
    "VarianceConvention": "batch_norm",
    "detect_variance_convention": "batch_norm",
    "fused_batch_norm_grad": "batch_norm",
    "Grid": "fake_quant",
    "fake_quant_with_min_max_args": "fake_quant",
    "fake_quant_with_min_max_args_gradient": "fake_quant",
    "fake_quant_with_min_max_vars": "fake_quant",
    "fake_quant_with_min_max_vars_gradient": "fake_quant",
    "fake_quant_with_min_max_vars_per_channel": "fake_quant",
    "fake_quant_with_min_max_vars_per_channel_gradient": "fake_quant",
    "fake_quant_with_min_max_args_and_gradient": "fake_quant",
    "fake_quant_with_min_max_vars_and_gradient": "fake_quant",
    "fake_quant_with_min_max_vars_per_channel_and_gradient": "fake_quant",
    "nudge": "fake_quant",
    "quant_range": "fake_quant",
    "quantize_and_dequantize_v2": "quantize_and_dequantize",
    "quantize_and_dequantize_v3": "quantize_and_dequantize",
    "quantize_and_dequantize_v4": "quantize_and_dequantize",
    "quantize_and_dequantize_v4_grad": "quantize_and_dequantize",
    "float8_fake_quantize": "torchao_semantics",
    "float8_fake_quantize_config": "torchao_semantics",
    "float8_fake_quantize_gradient": "torchao_semantics",
    "intx_fake_quantize": "torchao_semantics",
    "intx_fake_quantize_config": "torchao_semantics",
    "intx_fake_quantize_gradient": "torchao_semantics",
    "QuantizeDequantizeResult": "quantize",
    "dequantize": "quantize",
    "quantize_dequantize": "quantize",
    "quantize_dequantize_gradient": "quantize",
    "quantize_v2": "quantize",
    "MXResult": "mx",
    "mx_fake_quantize": "mx",
    "mx_fake_quantize_gradient": "mx",
    "NVFP4Result": "nvfp4",
    "nvfp4_fake_quantize": "nvfp4",
    "nvfp4_fake_quantize_gradient": "nvfp4",
    "OnnxFakeQuantResult": "onnx_quantize",
    "quantize_linear": "onnx_quantize",
    "dequantize_linear": "onnx_quantize",
    "onnx_fake_quantize": "onnx_quantize",
    "onnx_fake_quantize_gradient": "onnx_quantize",
}


__all__ = [
    "Grid",
    "VarianceConvention",
    "detect_variance_convention",
    "fake_quant_with_min_max_args",
    "fake_quant_with_min_max_args_gradient",
    "fake_quant_with_min_max_vars",
    "fake_quant_with_min_max_vars_gradient",
    "fake_quant_with_min_max_vars_per_channel",
    "fake_quant_with_min_max_vars_per_channel_gradient",
    "fake_quant_with_min_max_args_and_gradient",
    "fake_quant_with_min_max_vars_and_gradient",
    "fake_quant_with_min_max_vars_per_channel_and_gradient",
    "fused_batch_norm_grad",
    "nudge",
    "quant_range",
    "QuantizeDequantizeResult",
    "dequantize",
    "quantize_dequantize",
    "quantize_dequantize_gradient",
    "quantize_v2",
    "quantize_and_dequantize_v2",
    "quantize_and_dequantize_v3",
    "quantize_and_dequantize_v4",
    "quantize_and_dequantize_v4_grad",
    "intx_fake_quantize_config",
    "intx_fake_quantize",
    "intx_fake_quantize_gradient",
    "float8_fake_quantize_config",
    "float8_fake_quantize",
    "float8_fake_quantize_gradient",
    "MXResult",
    "mx_fake_quantize",
    "mx_fake_quantize_gradient",
    "NVFP4Result",
    "nvfp4_fake_quantize",
    "nvfp4_fake_quantize_gradient",
    "OnnxFakeQuantResult",
    "quantize_linear",
    "dequantize_linear",
    "onnx_fake_quantize",
    "onnx_fake_quantize_gradient",
]


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'qgcli.ops' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"qgcli.ops.{module}"), name)
    globals()[name] = value  # looked up once
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
