"""MX, NVFP4 and ONNX QuantizeLinear/DequantizeLinear against golden cases from real torchao 0.18 (torch 2.13
CPU), onnx's ReferenceEvaluator and onnxruntime (tests/golden/make_golden_formats.py): every case bit for bit
(NaN matched with NaN), the refusals refused, the NVFP4 all-NaN warning, the straight-through and masked
gradients.  torch and onnx are never imported here: everything comes from tests/golden/formats.h5.
"""
import os
import re

import h5py
import ml_dtypes
import numpy as np
import pytest

from qgcli import ops
from qgcli.errors import OperandError
from qgcli.ops import mx, nvfp4, onnx_quantize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden", "formats.h5")


def _load():
    out = {}
    with h5py.File(GOLDEN, "r") as f:
        for group in f:
            out[group] = {name: ({k: g[k][()] for k in g}, dict(g.attrs)) for name, g in f[group].items()}
        out["attrs"] = dict(f.attrs)
    return out


G = _load()


def _attr(a):
    return a.decode() if isinstance(a, bytes) else a


def same_bits(got, want):
    """Bit for bit (floats: NaN matches any NaN, everything else by its bits, so -0 differs from +0)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return False
    got, want = got.reshape(-1), want.reshape(-1)  # NumPy 1.24 cannot view a 0-d array as another dtype
    got, want = (a.view(np.uint8) if a.dtype.kind not in "fiub" else a for a in (got, want))  # ml_dtypes: bytes
    if got.shape != want.shape:
        return False
    if got.dtype.kind == "f" or want.dtype.kind == "f":
        got, want = got.astype(np.float32), want.astype(np.float32)
        nan = np.isnan(got)
        if not np.array_equal(nan, np.isnan(want)):
            return False
        return np.array_equal(np.where(nan, 0, got).view(np.uint32), np.where(nan, 0, want).view(np.uint32))
    return np.array_equal(got.astype(np.int64), want.astype(np.int64))


def where_differ(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    bad = ~((got == want) | (np.isnan(got) & np.isnan(want)))
    return np.argwhere(bad)[:5].tolist()


def test_file_records_its_sources():
    a = G["attrs"]
    assert str(a["torchao_version"]).startswith("0.18") and str(a["torch_version"]).startswith("2.13")
    assert os.path.getsize(GOLDEN) < 5e6


# --- MX ---------------------------------------------------------------------------------------------------

@pytest.fixture(params=["one run", "runs of 1-3 blocks"])
def chunking(request, monkeypatch):
    """Each case once in one run of blocks and once cut into runs of a few blocks (the thread-pool path)."""
    if request.param != "one run":
        monkeypatch.setattr(mx, "CHUNK_ELEMENTS", 40)
        monkeypatch.setattr(onnx_quantize, "CHUNK_ELEMENTS", 12)


@pytest.mark.parametrize("name", sorted(G["mx"]))
def test_mx_case(name, chunking):
    data, attrs = G["mx"][name]
    fmt = _attr(attrs["format"])
    r = mx.mx_fake_quantize(data["inputs"], format=fmt, block_size=int(attrs["block_size"]),
                            axis=int(attrs["axis"]), scale_mode=_attr(attrs["scale_mode"]))
    assert r.outputs.dtype == np.float32 and r.scales.dtype == np.uint8
    assert same_bits(r.outputs, data["outputs"]), where_differ(r.outputs, data["outputs"])
    assert same_bits(r.scales, data["scales"]), where_differ(r.scales, data["scales"])
    q = np.asarray(r.quantized)
    if fmt.startswith("mxfp8"):
        assert q.dtype.name == fmt_dtype(fmt)
        q = q.view(np.uint8)
    want = data["quantized"]
    if _attr(attrs["scale_mode"]) == "rceil":
        # x * r with both NaN (a NaN element of a NaN block): which NaN torch's multiply returns depends on its
        # kernel path, and its bits reach the code; qgcli takes the scale's NaN.  Only those elements are exempt.
        axis, bs = int(attrs["axis"]), int(attrs["block_size"])
        nan_block = np.repeat(data["scales"] == 255, bs, axis=axis)
        exempt = np.isnan(data["inputs"]) & nan_block
        q, want = np.where(exempt, 0, q), np.where(exempt, 0, want)
    else:
        assert "qdata_packed" not in data or same_bits(nvfp4.pack_fp4(np.moveaxis(q, int(attrs["axis"]), -1)),
                                                       data["qdata_packed"])
    assert same_bits(q, want), where_differ(q, want)


def fmt_dtype(fmt):
    return {"mxfp8-e4m3": "float8_e4m3fn", "mxfp8-e5m2": "float8_e5m2"}[fmt]


def test_mx_covers_every_format_mode_and_kind():
    seen = {(_attr(a["format"]), _attr(a["scale_mode"])) for _, a in G["mx"].values()}
    assert seen == {(f, m) for f in mx.FORMATS for m in mx.SCALE_MODES}
    kinds = {_attr(a["data"]) for _, a in G["mx"].values()}
    assert {"zero_blocks", "subnormal", "code0", "saturating", "nan", "inf", "near_pow2", "ties"} <= kinds
    assert {int(a["block_size"]) for _, a in G["mx"].values()} >= {3, 4, 16, 32, 64}
    assert {_attr(a["source"]) for _, a in G["mx"].values()} == {"torchao", "torch-port"}


@pytest.mark.parametrize("name", sorted(G["mx_refusals"]))
def test_mx_refuses_what_torchao_refuses(name):
    data, attrs = G["mx_refusals"][name]
    assert _attr(attrs["error"]).startswith("AssertionError")
    with pytest.raises(OperandError) as info:
        mx.mx_fake_quantize(data["inputs"], format=_attr(attrs["format"]), block_size=int(attrs["block_size"]),
                            axis=int(attrs["axis"]), scale_mode=_attr(attrs["scale_mode"]))
    message = str(info.value)
    assert "\n" not in message and message.startswith("inputs: ")
    assert ("not a multiple of the block size" in message) or ("odd length" in message)


def test_mx_code0_block_comes_back_halved():
    """torchao quantizes a code-0 block with 2^-126 and dequantizes it with 2^-127 (documented)."""
    x = np.full((1, 32), 2.0**-120, np.float32)
    r = mx.mx_fake_quantize(x, format="mxfp8-e4m3")
    assert r.scales[0, 0] == 0
    assert r.outputs[0, 0] == np.float32(2.0**-121)


def test_mx_inf_block_is_not_nan():
    x = np.ones((1, 32), np.float32)
    x[0, 3] = np.inf
    r = mx.mx_fake_quantize(x, format="mxfp8-e4m3")
    assert r.scales[0, 0] == 255 - 8 and np.isposinf(r.outputs[0, 3]) and r.outputs[0, 0] == 0


@pytest.mark.parametrize("bad, match", [
    (dict(format="mxfp3"), "format: 'mxfp3' is not one of"),
    (dict(scale_mode="round"), "scale_mode: 'round' is not one of"),
    (dict(block_size=0), "block_size: block size 0 must be a positive integer"),
    (dict(axis=2), "axis: axis 2 is out of range"),
])
def test_mx_refuses_bad_options(bad, match):
    with pytest.raises(OperandError, match=match):
        mx.mx_fake_quantize(np.zeros((2, 32), np.float32), **bad)
    with pytest.raises(OperandError, match="dtype int32 is not a real floating type"):
        mx.mx_fake_quantize(np.zeros((2, 32), np.int32))


def test_mx_gradient_is_the_identity():
    g = np.array([[np.nan, -0.0, 1e-42, -np.inf] * 8], np.float32)
    out = mx.mx_fake_quantize_gradient(g, np.zeros_like(g), format="mxfp4", scale_mode="rceil")
    assert out is not g and out.dtype == np.float32 and same_bits(out, g)
    with pytest.raises(OperandError, match="not a multiple"):
        mx.mx_fake_quantize_gradient(np.zeros((2, 48), np.float32), block_size=32)
    with pytest.raises(OperandError, match="differs from inputs shape"):
        mx.mx_fake_quantize_gradient(np.zeros((2, 32), np.float32), np.zeros((1, 32), np.float32))


def test_mx_bfloat16_inputs_are_their_float32_values():
    x = np.random.default_rng(0).standard_normal((2, 64)).astype(ml_dtypes.bfloat16)
    a = mx.mx_fake_quantize(x, format="mxfp6-e3m2")
    b = mx.mx_fake_quantize(x.astype(np.float32), format="mxfp6-e3m2")
    assert same_bits(a.outputs, b.outputs)


# --- NVFP4 ------------------------------------------------------------------------------------------------

def _nvfp4(data, attrs):
    return nvfp4.nvfp4_fake_quantize(data["inputs"], per_tensor_scale=bool(attrs["per_tensor_scale"]),
                                     axis=int(attrs["axis"]))


def _introduced_nan(data):
    return np.isnan(data["outputs"]) & ~np.isnan(data["inputs"])


@pytest.mark.parametrize("name", sorted(G["nvfp4"]))
def test_nvfp4_case(name, chunking):
    data, attrs = G["nvfp4"][name]
    if attrs["per_tensor_scale"] and _introduced_nan(data).any():
        every = "(every output is NaN)" if attrs["all_nan"] else "elements whose input is not NaN;"
        with pytest.warns(RuntimeWarning, match=f"gives NaN for .* {re.escape(every)}"):
            r = _nvfp4(data, attrs)
    else:
        r = _nvfp4(data, attrs)
    assert same_bits(r.outputs, data["outputs"]), where_differ(r.outputs, data["outputs"])
    assert r.block_scales.dtype.name == "float8_e4m3fn"
    assert same_bits(r.block_scales.view(np.uint8), data["block_scales"])
    q, want = r.quantized, data["quantized"]
    # x * r with both NaN: torch's kernel path decides which NaN (and so which code) comes out (see test_mx_case)
    blocks = np.repeat(np.isnan(data["block_scales"].view(ml_dtypes.float8_e4m3fn).astype(np.float32)), 16,
                       axis=int(attrs["axis"]))
    exempt = np.isnan(data["inputs"]) & (blocks | np.isnan(data.get("tensor_scale", np.float32(0))))
    q, want = np.where(exempt, 0, q), np.where(exempt, 0, want)
    assert same_bits(q, want), where_differ(q, want)
    if "tensor_scale" in data:
        assert r.tensor_scale.dtype == np.float32 and same_bits(r.tensor_scale, data["tensor_scale"])
    else:
        assert r.tensor_scale is None


def test_nvfp4_all_nan_cases_are_the_documented_ones():
    nan_cases = sorted(n for n, (_, a) in G["nvfp4"].items() if a["all_nan"])
    assert nan_cases == ["all_zero_pts1", "inf_pts1", "nan_pts1", "neg_zero_pts1", "specials_pts1"]
    partly = sorted(n for n, (d, a) in G["nvfp4"].items() if _introduced_nan(d).any() and not a["all_nan"])
    # a NaN element makes its whole block NaN without the per-tensor scale (the tiny-amax cases, 1 / t = Inf,
    # have no exact zeros, so no 0 * Inf)
    assert partly == ["nan_pts0", "specials_pts0"]


def test_nvfp4_warns_only_with_the_per_tensor_scale():
    x = np.zeros((2, 16), np.float32)
    with pytest.warns(RuntimeWarning, match=r"scale 0.0 .* gives NaN for 32 of 32 .*\(every output is NaN\)"):
        assert np.isnan(nvfp4.nvfp4_fake_quantize(x).outputs).all()
    r = nvfp4.nvfp4_fake_quantize(x, per_tensor_scale=False)  # filterwarnings=error: no warning here
    assert same_bits(r.outputs, x) and r.block_scales.view(np.uint8)[0, 0] == 0x08  # 2^-6


@pytest.mark.parametrize("name", sorted(G["nvfp4_refusals"]))
def test_nvfp4_refusals(name):
    data, attrs = G["nvfp4_refusals"][name]
    x = data["inputs"]
    assert _attr(attrs["error"]).startswith("AssertionError")
    if x.shape[-1] % 16:
        with pytest.raises(OperandError, match="not a multiple of the NVFP4 block size 16"):
            nvfp4.nvfp4_fake_quantize(x)
    else:  # torchao takes rank 2 and 3 only; qgcli takes any rank: the same as the 2-D view
        r = nvfp4.nvfp4_fake_quantize(x)
        flat = nvfp4.nvfp4_fake_quantize(x.reshape(-1, x.shape[-1]))
        assert same_bits(r.outputs, flat.outputs.reshape(x.shape))


def test_nvfp4_gradient_is_the_identity():
    g = np.arange(32, dtype=np.float32).reshape(2, 16)
    out = nvfp4.nvfp4_fake_quantize_gradient(g, g)
    assert out is not g and same_bits(out, g)
    with pytest.raises(OperandError, match="not a multiple of the NVFP4 block size"):
        nvfp4.nvfp4_fake_quantize_gradient(np.zeros((2, 24), np.float32))


# --- ONNX -------------------------------------------------------------------------------------------------

def _onnx_args(data, attrs):
    dtype = _attr(attrs["dtype"])
    kw = dict(dtype=dtype, axis=int(attrs["axis"]), block_size=int(attrs["block_size"]),
              saturate=bool(attrs["saturate"]))
    return (data["x"], data["y_scale"], data.get("y_zero_point")), kw


def _scaled(data, attrs):
    """x / y_scale as both implementations compute it (float32), broadcast like x."""
    from qgcli.ops.onnx_quantize import _qparams

    _, sb, zb = _qparams(np, data["x"].shape, data["y_scale"], data.get("y_zero_point"), _attr(attrs["dtype"]),
                         int(attrs["axis"]), int(attrs["block_size"]))
    with np.errstate(all="ignore"):
        return np.broadcast_to(data["x"] / sb, data["x"].shape), zb


def _codes(q, dtype):
    q = np.asarray(q)
    return q.view(np.uint8) if dtype.startswith("float") else q


@pytest.mark.parametrize("name", sorted(G["onnx"]))
def test_onnx_case(name, chunking):
    data, attrs = G["onnx"][name]
    args, kw = _onnx_args(data, attrs)
    dtype = kw["dtype"]
    r = onnx_quantize.onnx_fake_quantize(*args, **kw)
    assert r.outputs.dtype == np.float32
    q = _codes(r.quantized, dtype)
    want_q, want_y = data["quantized"], data["outputs"]
    if dtype in onnx_quantize.INTEGER_TYPES:
        # the reference's rint(v).astype(int32) is undefined for NaN, Inf and beyond int32: there qgcli
        # saturates as onnxruntime does
        v, _ = _scaled(data, attrs)
        undefined = ~np.isfinite(v) | (np.abs(np.rint(v)) >= 2.0**31)
        assert np.any(undefined) == (_attr(attrs["data"]) == "specials")
        assert "ort_error" not in attrs
        want_q = np.where(undefined, data["ort_quantized"], want_q)
        want_y = np.where(undefined, data["ort_outputs"], want_y)
        assert q.dtype == onnx_quantize.INTEGER_TYPES[dtype][0]
    assert same_bits(q, want_q), where_differ(q, want_q)
    assert same_bits(r.outputs, want_y), where_differ(r.outputs, want_y)
    assert same_bits(onnx_quantize.quantize_linear(*args, **kw), r.quantized)
    kw.pop("saturate")
    assert same_bits(onnx_quantize.dequantize_linear(r.quantized, args[1], args[2], **kw), r.outputs)


def _ort_disagreement(data, attrs):
    """Where onnxruntime may differ from the reference (documented in qgcli.ops.onnx_quantize)."""
    dtype = _attr(attrs["dtype"])
    v, _ = _scaled(data, attrs)
    a = np.abs(v)
    if dtype in onnx_quantize.INTEGER_TYPES:
        return ~np.isfinite(v) | (np.abs(np.rint(v)) >= 2.0**31)
    if dtype == "float8e4m3fn" and not attrs["saturate"]:
        return (a >= 480) & (a < 496)
    if dtype == "float8e5m2" and not attrs["saturate"]:
        return (a >= 61440) & (a < 65536)
    return np.zeros(v.shape, bool)


@pytest.mark.parametrize("name", sorted(n for n, (_, a) in G["onnx"].items() if "ort_error" not in a))
def test_onnx_case_against_onnxruntime(name):
    """qgcli equals onnxruntime's CPU kernels except in the documented float8 no-saturation ranges."""
    data, attrs = G["onnx"][name]
    args, kw = _onnx_args(data, attrs)
    r = onnx_quantize.onnx_fake_quantize(*args, **kw)
    q = np.asarray(r.quantized).astype(np.float32) if kw["dtype"].startswith("float") else r.quantized
    dtype = kw["dtype"]
    allowed = _ort_disagreement(data, attrs) if dtype.startswith("float") else np.zeros(q.shape, bool)
    ok_q = (np.asarray(q, np.float64) == data["ort_quantized"]) | (np.isnan(np.asarray(q, np.float64))
                                                                    & np.isnan(data["ort_quantized"]))
    ok_y = same_elementwise(r.outputs, data["ort_outputs"])
    assert np.all(ok_q | allowed), where_differ(q, data["ort_quantized"])
    assert np.all(ok_y | allowed), where_differ(r.outputs, data["ort_outputs"])
    if allowed.any():  # the documented disagreement is real: onnxruntime differs on every such element
        assert not np.any(ok_y & allowed)


def same_elementwise(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    nan = np.isnan(a) & np.isnan(b)
    return nan | (a.view(np.uint32) == b.view(np.uint32))


def test_onnx_cases_cover_every_dtype_mode_and_onnxruntime():
    cases = G["onnx"].values()
    assert {_attr(a["dtype"]) for _, a in cases} == set(onnx_quantize.DTYPES)
    assert {_attr(a["mode"]) for _, a in cases} == {"per-tensor", "per-axis", "blocked"}
    partial = [a for d, a in cases if int(a["block_size"]) and d["x"].shape[int(a["axis"])] % int(a["block_size"])]
    assert partial
    assert {_attr(a["dtype"]) for _, a in cases if "ort_error" in a} == {"float4e2m1"}
    assert {bool(a["saturate"]) for _, a in cases if _attr(a["dtype"]).startswith("float8")} == {True, False}


@pytest.mark.parametrize("name", sorted(G["onnx_refusals"]))
def test_onnx_refusals(name):
    data, attrs = G["onnx_refusals"][name]
    zp = data.get("y_zero_point")
    if zp is not None:
        zp = zp.view(ml_dtypes.float8_e4m3fn)
    # the reference accepts a blocked scale with more blocks than needed; ONNX says ceil(n / block_size)
    assert (_attr(attrs["error"]) == "none") == (name == "blocked_too_many_blocks")
    with pytest.raises(OperandError) as info:
        onnx_quantize.onnx_fake_quantize(data["x"], data["y_scale"], zp, dtype=_attr(attrs["dtype"]),
                                         axis=int(attrs["axis"]), block_size=int(attrs["block_size"]))
    assert "\n" not in str(info.value)


def test_onnx_masked_gradient_passes_exactly_the_unsaturated_elements():
    """For every integer golden case: the mask is where the reference's code is the unclipped rounded value."""
    checked = 0
    for name, (data, attrs) in G["onnx"].items():
        dtype = _attr(attrs["dtype"])
        if dtype not in onnx_quantize.INTEGER_TYPES:
            continue
        args, kw = _onnx_args(data, attrs)
        rng = np.random.default_rng(len(name))
        g = rng.standard_normal(data["x"].shape).astype(np.float32)
        dx = onnx_quantize.onnx_fake_quantize_gradient(g, *args, **kw, estimator="masked")
        v, zb = _scaled(data, attrs)
        with np.errstate(all="ignore"):
            w = np.rint(v) + (0 if zb is None else zb)
        _, lo, hi = onnx_quantize.INTEGER_TYPES[dtype]
        inside = np.isfinite(w) & (data["quantized"].astype(np.float64) == w)
        assert np.array_equal(inside, (w >= lo) & (w <= hi)), name
        assert same_bits(dx, np.where(inside, g, np.float32(0))), name
        assert not np.signbit(dx[~inside]).any()
        assert same_bits(onnx_quantize.onnx_fake_quantize_gradient(g, *args, **kw), g)
        checked += 1
    assert checked > 100


def test_onnx_masked_gradient_is_for_integer_types_only():
    x = np.zeros(4, np.float32)
    with pytest.raises(OperandError, match="estimator: the masked estimator is for the integer types"):
        onnx_quantize.onnx_fake_quantize_gradient(x, x, np.float32(1), dtype="float8e4m3fn", estimator="masked")
    with pytest.raises(OperandError, match="estimator: 'clip' is not one of ste, masked"):
        onnx_quantize.onnx_fake_quantize_gradient(x, x, np.float32(1), estimator="clip")


@pytest.mark.parametrize("kw, match", [
    (dict(dtype="int3"), "dtype: 'int3' is not one of"),
    (dict(y_zero_point=np.uint8(3), dtype="int4"), "y_zero_point: values must be integers in \\[-8, 7\\]"),
    (dict(block_size=-1), "block_size: -1 must be an integer >= 0"),
])
def test_onnx_refuses_bad_options(kw, match):
    zp = kw.pop("y_zero_point", None)
    if zp is not None:
        zp = np.uint8(200)
    with pytest.raises(OperandError, match=match):
        onnx_quantize.onnx_fake_quantize(np.zeros((2, 3), np.float32), np.float32(1), zp, **kw)
    with pytest.raises(OperandError, match="x: dtype float64"):
        onnx_quantize.quantize_linear(np.zeros(3), np.float32(1))


def test_onnx_quantized_types():
    x = np.linspace(-9, 9, 12, dtype=np.float32)
    want = {"uint8": "uint8", "int8": "int8", "uint16": "uint16", "int16": "int16", "uint4": "uint8",
            "int4": "int8", "float8e4m3fn": "float8_e4m3fn", "float8e5m2": "float8_e5m2",
            "float4e2m1": "float4_e2m1fn"}
    for dtype, name in want.items():
        assert onnx_quantize.quantize_linear(x, np.float32(0.5), dtype=dtype).dtype.name == name


def test_fast_codes_equal_torchao_bit_operations():
    """ml_dtypes' casts (the fast path) equal torchao's _f32_to_floatx_unpacked on non-NaN float32 values: in
    2^-12 .. 2^17, every top-11-bit mantissa with low bits 0, 1 and 0xFFF (the ties and their neighbours), and
    half a million random patterns up to Inf (fp8 within +-F)."""
    from qgcli.ops import _small_floats as sf

    rng = np.random.default_rng(5)
    exps = np.arange(127 - 12, 127 + 17, dtype=np.uint32) << 23
    mant = (np.arange(1 << 11, dtype=np.uint32) << 12)[:, None] + np.array([0, 1, 0xFFF], np.uint32)
    bits = np.concatenate([(exps[:, None] + mant.reshape(1, -1)).reshape(-1),
                           rng.integers(0, 0x7F800001, 1 << 19, dtype=np.uint32)])
    v = np.concatenate([bits, bits | np.uint32(0x80000000)]).view(np.float32)
    for (e, m), fmax in [((4, 3), 448.0), ((5, 2), 57344.0), ((2, 3), None), ((3, 2), None), ((2, 1), None)]:
        w = np.clip(v, -fmax, fmax) if fmax else v
        fast = sf.fast_codes(w, e, m)
        if fast is not None:
            assert np.array_equal(fast, sf.f32_to_floatx(w, e, m)), (e, m)


def test_public_names():
    for name in ("mx_fake_quantize", "mx_fake_quantize_gradient", "nvfp4_fake_quantize",
                 "nvfp4_fake_quantize_gradient", "quantize_linear", "dequantize_linear", "onnx_fake_quantize",
                 "onnx_fake_quantize_gradient"):
        assert name in ops.__all__ and callable(getattr(ops, name))
