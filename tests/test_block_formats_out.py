"""``out=`` of the block-format ops (MX, NVFP4, ONNX QuantizeLinear): the results written into the caller's
arrays, the same bits as fresh ones, with the compiled kernels and without, along the last axis (where the
kernels write in place) and another (copied in); bad ``out`` arrays refused in one line naming ``out``."""
import numpy as np
import pytest

from qgcli.errors import OperandError
from qgcli.ops import mx, nvfp4, onnx_quantize

X = np.random.default_rng(38).standard_normal((3, 32, 64)).astype(np.float32)
X[0, 0, :5] = [np.inf, -0.0, 1e-40, 3e38, -7.0]  # an Inf block, a signed zero, a subnormal, a huge value
X[1, 2, 7] = np.nan  # a NaN block: the kernels hand its run back to the NumPy path, which writes in place too

CALLS = {
    "mx e4m3 floor": lambda x, **k: mx.mx_fake_quantize(x, **k),
    "mx fp4 rceil": lambda x, **k: mx.mx_fake_quantize(x, format="mxfp4", scale_mode="rceil", **k),
    "mx int8 even": lambda x, **k: mx.mx_fake_quantize(x, format="mxint8", scale_mode="even", **k),
    "nvfp4": lambda x, **k: nvfp4.nvfp4_fake_quantize(x, per_tensor_scale=False, **k),
    "onnx uint8": lambda x, **k: onnx_quantize.onnx_fake_quantize(x, np.float32(0.02), np.uint8(128),
                                                                  axis=1, **k),
    "onnx int16": lambda x, **k: onnx_quantize.onnx_fake_quantize(x, np.float32(0.001), dtype="int16", **k),
    "onnx e4m3": lambda x, **k: onnx_quantize.onnx_fake_quantize(x, np.float32(0.02), dtype="float8e4m3fn", **k),
}


def arrays(result):
    return [a for a in result if a is not None and np.ndim(a) > 0]


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("axis", [-1, 1])
@pytest.mark.parametrize("name", list(CALLS))
def test_out_holds_the_fresh_results(monkeypatch, name, axis, native):
    monkeypatch.setenv("QGCLI_NATIVE", native)
    call = CALLS[name]
    kwargs = {} if name.startswith("onnx") else {"axis": axis}
    with np.errstate(all="ignore"):
        want = call(X, **kwargs)
        buffers = call(-X[:, ::-1].copy(), **kwargs)  # an earlier result: other values, the same shapes
        got = call(X, out=buffers, **kwargs)
    for g, b, w in zip(arrays(got), arrays(buffers), arrays(want)):
        assert g is b  # written in place, returned
        same_bits(g, w)


def test_out_entries_may_be_none():
    first = mx.mx_fake_quantize(X)
    codes = np.zeros(X.shape, first.quantized.dtype)
    got = mx.mx_fake_quantize(X, out=(None, None, codes))
    assert got.quantized is codes and got.outputs is not first.outputs
    same_bits(got.quantized, first.quantized)
    same_bits(got.outputs, first.outputs)


@pytest.mark.parametrize("bad, message", [
    (lambda r: (r.outputs[..., ::2], None, None), "C-contiguous float32"),
    (lambda r: (r.outputs.astype(np.float64), None, None), "float32"),
    (lambda r: (None, np.zeros(3, np.uint8), None), "scales must be a writeable"),
    (lambda r: (None, None, r.quantized.view(np.uint8)), "quantized must be"),
    (lambda r: (X, None, None), "shares memory with an input"),
    (lambda r: (r.outputs, r.outputs.view(np.uint8)[:, :, :2], None), "must be"),
    (lambda r: (r.outputs, None), "holds 2 entries"),
    (lambda r: r.outputs, "earlier result or a sequence"),
])
def test_bad_out_is_refused(bad, message):
    r = mx.mx_fake_quantize(X)
    before = X.copy()
    with pytest.raises(OperandError, match=message) as info:
        mx.mx_fake_quantize(X, out=bad(r))
    assert info.value.operand == "out"
    assert np.array_equal(X, before, equal_nan=True)


def test_read_only_out_is_refused():
    r = nvfp4.nvfp4_fake_quantize(X, per_tensor_scale=False)
    r.outputs.setflags(write=False)
    with pytest.raises(OperandError, match="outputs must be a writeable"):
        nvfp4.nvfp4_fake_quantize(X, per_tensor_scale=False, out=r)


def test_outputs_sharing_memory_are_refused():
    outputs = np.empty(X.shape, np.float32)
    codes = outputs.view(np.int8).reshape(-1)[:X.size].reshape(X.shape)  # the first quarter of outputs' bytes
    with pytest.raises(OperandError, match="another output"):
        mx.mx_fake_quantize(X, format="mxint8", out=(outputs, None, codes))
