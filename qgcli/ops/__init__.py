"""Pure math: arrays in, arrays out (NumPy or CuPy, picked from the arguments). No I/O here."""
from qgcli.ops.batch_norm import (
    VarianceConvention,
    detect_variance_convention,
    fused_batch_norm_grad,
)
from qgcli.ops.fake_quant import (
    Grid,
    fake_quant_with_min_max_args,
    fake_quant_with_min_max_args_gradient,
    fake_quant_with_min_max_vars,
    fake_quant_with_min_max_vars_gradient,
    fake_quant_with_min_max_vars_per_channel,
    fake_quant_with_min_max_vars_per_channel_gradient,
    nudge,
    quant_range,
)
from qgcli.ops.quantize_and_dequantize import (
    quantize_and_dequantize_v2,
    quantize_and_dequantize_v3,
    quantize_and_dequantize_v4,
    quantize_and_dequantize_v4_grad,
)
from qgcli.ops.torchao_semantics import (
    float8_fake_quantize,
    float8_fake_quantize_config,
    float8_fake_quantize_gradient,
    intx_fake_quantize,
    intx_fake_quantize_config,
    intx_fake_quantize_gradient,
)
from qgcli.ops.quantize import (
    QuantizeDequantizeResult,
    dequantize,
    quantize_dequantize,
    quantize_dequantize_gradient,
    quantize_v2,
)

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
]
