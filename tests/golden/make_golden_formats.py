#!/usr/bin/env python3
"""Generate ``tests/golden/formats.h5``: golden cases for MX (OCP microscaling), NVFP4 and ONNX
QuantizeLinear/DequantizeLinear from REAL torchao 0.18 (torch 2.13 CPU), onnx's ReferenceEvaluator and
onnxruntime's CPU kernels.  None of them is a qgcli dependency; run this in a throwaway venv::

    python3 -m venv /tmp/fmtvenv
    /tmp/fmtvenv/bin/pip install torch==2.13.0 torchao==0.18.0 onnx onnxruntime ml_dtypes h5py numpy
    /tmp/fmtvenv/bin/python tests/golden/make_golden_formats.py

Layout (every array small; file attributes name the versions, the seed and the CPU):

``mx/<name>``
    ``inputs`` (float32), torchao's ``outputs`` (``to_dtype(..., torch.float32)``), ``scales`` (E8M0 bytes, uint8,
    shaped like the inputs with the block axis divided by the block size), ``quantized`` (the element codes as
    uint8 bytes, one per element: float8 bytes, fp6 codes, fp4 codes *unpacked* from torchao's packed bytes,
    low nibble = even element; int8 for mxint8) and, for fp4, ``qdata_packed`` (torchao's packed bytes, in its
    layout: the block axis moved last).  Attributes: ``format``, ``block_size``, ``axis`` (other axes than the
    last are moved last before calling torchao, which blocks only the last dimension), ``scale_mode``, ``data``
    (the kind of input), ``source`` (``torchao`` or, for mxint8, which torchao 0.18 lacks,
    ``torch-port`` -- see :func:`mxint8_port`).
``mx_refusals/<name>``
    ``inputs`` and the attributes above, ``error``: what torchao raised.
``nvfp4/<name>``
    ``inputs``, ``outputs`` (``NVFP4Tensor.to_nvfp4(x, per_tensor_scale=...).dequantize(torch.float32)``),
    ``block_scales`` (float8 e4m3fn bytes as uint8), ``tensor_scale`` (0-d float32; absent without the
    per-tensor scale), ``quantized`` (fp4 codes unpacked from torchao's packed bytes), ``qdata_packed``.
    Attributes ``per_tensor_scale`` (0/1: ``per_tensor_amax_to_scale(max|x|)`` or None), ``axis``, ``data``,
    ``all_nan`` (torchao's outputs are all NaN although the input is not).
``nvfp4_refusals/<name>``
    as mx_refusals.
``onnx/<name>``
    ``x``, ``y_scale``, ``y_zero_point`` (when given; 4-bit as int8/uint8), the reference's ``quantized``
    (integer types in their storage type, uint4 -> uint8, int4 -> int8; float8/float4 as their uint8 bytes) and
    ``outputs`` (DequantizeLinear(QuantizeLinear(x)), float32); onnxruntime's ``ort_quantized`` (float types
    through a Cast to float32, 4-bit through a Cast to int8/uint8) and ``ort_outputs``, or the attribute
    ``ort_error``.  Attributes: ``dtype``, ``axis``, ``block_size``, ``saturate``, ``opset``, ``mode``
    (per-tensor, per-axis, blocked), ``data``.
``onnx_refusals/<name>``
    what the reference refuses: ``x``, ``y_scale`` (and ``y_zero_point``), attributes as above and ``error``.

The reference's integer cast of NaN/Inf/out-of-int32 values is undefined (x86: INT32_MIN -> qmin); the cases
keep them (qgcli follows onnxruntime there, and the test compares those elements with onnxruntime).
"""
import os
import platform
import sys
import warnings

import h5py
import ml_dtypes
import numpy as np
import torch

warnings.filterwarnings("ignore")
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torchao  # noqa: E402
from onnx import TensorProto as TP  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2  # noqa: E402
from torchao.prototype.mx_formats.kernels import unpack_uint4  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx  # noqa: E402
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale  # noqa: E402

f32 = np.float32
SEED = 20261202
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "formats.h5")
GENERATOR = "tests/golden/make_golden_formats.py"

MX_ELEM = {"mxfp8-e4m3": torch.float8_e4m3fn, "mxfp8-e5m2": torch.float8_e5m2, "mxfp6-e2m3": DTYPE_FP6_E2M3,
           "mxfp6-e3m2": DTYPE_FP6_E3M2, "mxfp4": torch.float4_e2m1fn_x2}
MX_MAX = {"mxfp8-e4m3": 448.0, "mxfp8-e5m2": 57344.0, "mxfp6-e2m3": 7.5, "mxfp6-e3m2": 28.0, "mxfp4": 6.0,
          "mxint8": 127 / 64}
MODES = ["floor", "rceil", "ceil", "even"]


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------
def blocks_of(rng, nblocks, bs, kind, fmax=448.0):
    """(nblocks, bs) float32 values of one kind (each block its own flavour where that matters)."""
    n = nblocks * bs
    if kind == "normal":
        x = rng.standard_normal(n)
    elif kind == "heavy":
        x = rng.standard_t(1.5, n)
    elif kind == "wide":  # every block a different magnitude, over the whole float32 range
        x = rng.standard_normal(n) * np.exp2(rng.integers(-140, 126, nblocks).repeat(bs))
    elif kind == "zero_blocks":
        x = rng.standard_normal(n).reshape(nblocks, bs)
        x[0] = 0.0
        x[1 % nblocks] = -0.0
        x = x.reshape(-1)
    elif kind == "subnormal":  # blocks entirely subnormal, or with a subnormal amax, or mixed
        x = rng.standard_normal(n).reshape(nblocks, bs) * 1e-39
        x[0] *= 1e-5
        x[-1, :bs // 2] = rng.standard_normal(bs // 2) * 1e-20
        x = x.reshape(-1)
    elif kind == "code0":  # amax around 2^-127 .. 2^-110: the E8M0 code clamps to 0 (halved blocks)
        x = rng.standard_normal(n) * np.exp2(rng.integers(-128, -108, nblocks).repeat(bs))
    elif kind == "saturating":  # amax just below the next power of two (floor: the element saturates), huge
        x = rng.standard_normal(n).reshape(nblocks, bs)
        for b in range(nblocks):
            k = int(rng.integers(-20, 20)) if b % 3 else 127
            top = np.float32(np.nextafter(np.float32(2.0 ** (k + 1)), np.float32(0)))
            x[b] = x[b] / np.abs(x[b]).max() * float(top) * 0.75
            x[b, rng.integers(bs)] = top * (1 if b % 2 else -1)
        x = x.reshape(-1)
    elif kind == "near_pow2":  # amax / F just above or below a power of two: rceil's float32 log2
        x = rng.standard_normal(n).reshape(nblocks, bs) * 0.5
        for b in range(nblocks):
            k = int(rng.integers(-30, 30))
            off = int(rng.integers(-3, 40))
            base = np.float32(fmax * 2.0**k).view(np.int32)
            x[b, int(rng.integers(bs))] = np.int32(base + off).view(np.float32) * (1 if b % 2 else -1)
            x[b] *= 1.0  # keep float64 here; rounded to float32 below
        x = x.reshape(-1)
    elif kind == "ties":  # exact midpoints of the element grid (scale 1 blocks)
        grid = rng.integers(-64, 64, n) / 16.0
        x = grid + (1 / 32.0) * rng.choice([-1, 1], n)
        x = x.reshape(nblocks, bs)
        x[:, 0] = 4.0 * rng.choice([-1, 1], nblocks)  # fixes amax (floor scale 2^(2 - emax))
        x = x.reshape(-1)
    elif kind == "nan":
        x = rng.standard_normal(n)
        idx = rng.choice(n, max(2, nblocks // 2), replace=False)
        x[idx] = np.nan
        x[idx[0]] = -np.nan
    elif kind == "inf":
        x = rng.standard_normal(n)
        idx = rng.choice(n, max(2, nblocks // 2), replace=False)
        x[idx] = np.inf
        x[idx[1::2]] = -np.inf
    elif kind == "specials":  # everything at once
        x = rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, nblocks).repeat(bs))
        sp = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-40, 1.4e-45, -1e-42, 2.0**-120,
                       2.0**-126, 65504.0, 1e20])
        idx = rng.choice(n, min(n, 3 * len(sp)), replace=False)
        x[idx] = rng.choice(sp, idx.size)
    else:
        raise ValueError(kind)
    return np.asarray(x, np.float64).astype(f32).reshape(nblocks, bs)


MX_KINDS = ["normal", "heavy", "wide", "zero_blocks", "subnormal", "code0", "saturating", "near_pow2", "ties",
            "nan", "inf", "specials"]


# ----------------------------------------------------------------------------------------------
# MX
# ----------------------------------------------------------------------------------------------
def mxint8_port(x, bs, mode):
    """MX int8 as torchao's ``to_mx`` would compute it if it had an int8 element (it does not in 0.18): its
    scale code of each mode (target_max_pow2 = 0, max_pos = 127/64, 6 mantissa bits for ``even``), in torch,
    then the OCP INT8 element: clamp(round_half_even(64 * x / s), -127, 127); NaN -> 0.  Dequantized as
    ``q * 2^-6 * 2^(code - 127)`` (NaN for code 255)."""
    t = torch.from_numpy(x).reshape(*x.shape[:-1], x.shape[-1] // bs, bs)
    max_abs = torch.amax(torch.abs(t), -1).unsqueeze(-1)
    max_pos = 127 / 64
    if mode == "rceil":
        descale = max_abs / max_pos
        e = torch.where(torch.isnan(descale), 255, torch.where(torch.isinf(descale), 254, (
            torch.clamp(torch.ceil(torch.log2(descale)), min=-127, max=127) + 127).to(torch.uint8)))
        r = torch.where(e == 255, descale, torch.where(e == 254, 2**-127, torch.where(
            e == 0, 1.0, torch.exp2(127 - e.to(torch.float32)))))
        v = torch.clamp(t * r, -max_pos, max_pos)
    else:
        if mode == "even":
            nan_mask = torch.isnan(max_abs)
            m = max_abs.view(torch.int32)
            m = (m + (1 << (23 - 6 - 1))) & (((1 << 9) - 1) << 23)
            max_abs = m.view(torch.float32)
            max_abs[nan_mask] = float("nan")
        mi = max_abs.view(torch.int32)
        p = ((mi >> 23) & 0xFF) - 127
        if mode == "ceil":
            p = p + ((mi & 0x7FFFFF) > 0)
        k = torch.clamp(p, -127, 128)
        e = torch.where(torch.isnan(max_abs), 255, (k + 127).to(torch.uint8))
        s = torch.clamp((e.to(torch.int32) << 23).view(torch.float32), min=2**-126)
        v = torch.clamp(t / s, -max_pos, max_pos)
    q = torch.round(v * 64)
    q = torch.where(torch.isnan(q), 0.0, torch.clamp(q, -127, 127)).to(torch.int8)
    sf = torch.where(e != 255, torch.pow(torch.full_like(e, 2.0, dtype=torch.float32), e.to(torch.int16) - 127),
                     float("nan"))
    y = (q.to(torch.float32) * 2**-6) * sf
    return (y.reshape(x.shape).numpy(), e.squeeze(-1).to(torch.uint8).numpy(),
            q.reshape(x.shape).numpy())


def run_mx(x, fmt, bs, mode, axis):
    """torchao's to_mx + to_dtype along ``axis`` (moved last); arrays in qgcli's layout."""
    xm = np.ascontiguousarray(np.moveaxis(x, axis, -1))
    extra = {}
    if fmt == "mxint8":
        y, s, q = mxint8_port(xm, bs, mode)
    else:
        elem = MX_ELEM[fmt]
        scale, data = to_mx(torch.from_numpy(xm), elem, bs, ScaleCalculationMode(mode))
        y = to_dtype(data, scale, elem, bs, torch.float32).numpy()
        s = scale.view(torch.uint8).numpy()
        raw = data.view(torch.uint8)
        if fmt == "mxfp4":
            extra["qdata_packed"] = raw.numpy().copy()
            raw = unpack_uint4(raw)
        q = raw.numpy()
    back = lambda a: np.ascontiguousarray(np.moveaxis(a, -1, axis))  # noqa: E731
    return dict(outputs=back(y), scales=back(s), quantized=back(q), **extra)


def mx_cases(rng):
    cases, refusals = [], []
    formats = list(MX_MAX)
    for fmt in formats:
        for mode in MODES:
            for kind in MX_KINDS:
                x = blocks_of(rng, 4, 32, kind, MX_MAX[fmt]).reshape(2, 64)
                cases.append((f"{fmt}_{mode}_{kind}", x, fmt, 32, mode, -1, kind))
            # other block sizes and axes
            x = blocks_of(rng, 6, 16, "specials").reshape(2, 48)
            cases.append((f"{fmt}_{mode}_bs16", x, fmt, 16, mode, -1, "specials"))
            x = blocks_of(rng, 16, 4, "wide").reshape(2, 2, 16)
            cases.append((f"{fmt}_{mode}_bs4_3d", x, fmt, 4, mode, -1, "wide"))
            x = blocks_of(rng, 8, 3, "nan").reshape(4, 6)  # odd blocks: fp4 pairs straddle two blocks
            cases.append((f"{fmt}_{mode}_bs3_nan", x, fmt, 3, mode, -1, "nan"))
            x = blocks_of(rng, 2, 32, "specials").reshape(2, 32).T.copy()  # (32, 2), blocks along axis 0
            cases.append((f"{fmt}_{mode}_axis0", x, fmt, 32, mode, 0, "specials"))
            x = blocks_of(rng, 3, 64, "normal").reshape(3, 64)
            cases.append((f"{fmt}_{mode}_bs64", x, fmt, 64, mode, -1, "normal"))
        # refusals: block size not dividing the last dimension; fp4 with an odd last dimension
        x = blocks_of(rng, 1, 48, "normal").reshape(1, 48)
        refusals.append((f"{fmt}_bs32_of_48", x, fmt, 32, "floor", -1))
        if fmt == "mxfp4":
            refusals.append((f"{fmt}_bs3_of_3", blocks_of(rng, 2, 3, "normal"), fmt, 3, "floor", -1))
    out = []
    for name, x, fmt, bs, mode, axis, kind in cases:
        with np.errstate(all="ignore"):
            data = run_mx(x, fmt, bs, mode, axis)
        out.append((name, dict(format=fmt, block_size=bs, scale_mode=mode, axis=axis, data=kind,
                               source="torch-port" if fmt == "mxint8" else "torchao"), dict(inputs=x, **data)))
    refused = []
    for name, x, fmt, bs, mode, axis in refusals:
        try:
            if fmt == "mxint8":  # what torchao's to_mx asserts first, for any element type
                assert x.shape[-1] % bs == 0, (
                    f"the last dimension of shape {torch.Size(x.shape)} must be divisible by block_size {bs}")
            else:
                run_mx(x, fmt, bs, mode, axis)
            error = "none"
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        refused.append((name, dict(format=fmt, block_size=bs, scale_mode=mode, axis=axis, error=error),
                        dict(inputs=x)))
    return out, refused


# ----------------------------------------------------------------------------------------------
# NVFP4
# ----------------------------------------------------------------------------------------------
def run_nvfp4(x, per_tensor, axis=-1):
    xm = np.ascontiguousarray(np.moveaxis(x, axis, -1))
    t = torch.from_numpy(xm)
    ts = per_tensor_amax_to_scale(torch.max(torch.abs(t))) if per_tensor else None
    n = NVFP4Tensor.to_nvfp4(t, per_tensor_scale=ts)
    y = n.dequantize(torch.float32).numpy()
    raw = n.qdata.view(torch.uint8)
    q = unpack_uint4(raw).numpy()
    back = lambda a: np.ascontiguousarray(np.moveaxis(a, -1, axis))  # noqa: E731
    out = dict(outputs=back(y), block_scales=back(n.scale.view(torch.uint8).numpy()), quantized=back(q),
               qdata_packed=raw.numpy().copy())
    if ts is not None:
        out["tensor_scale"] = ts.numpy().astype(f32)
    return out


def nvfp4_cases(rng):
    specs = []
    for kind in ["normal", "heavy", "wide", "zero_blocks", "subnormal", "saturating", "ties", "nan", "inf",
                 "specials"]:
        specs.append((kind, blocks_of(rng, 8, 16, kind).reshape(4, 32), -1))
    specs.append(("all_zero", np.zeros((2, 32), f32), -1))
    specs.append(("neg_zero", np.full((2, 16), -0.0, f32), -1))
    specs.append(("tiny_1e-36", (rng.standard_normal((2, 32)) * 1e-36).astype(f32), -1))
    specs.append(("tiny_1e-39", (rng.standard_normal((2, 32)) * 1e-39).astype(f32), -1))
    specs.append(("huge", (rng.standard_normal((2, 32)) * 1e38).astype(f32), -1))
    specs.append(("block_scale_clamps", (rng.standard_normal((2, 32)) * np.array([1e5, 1e-5]).repeat(16)
                                         ).astype(f32), -1))
    x = rng.standard_normal((4, 32)) * np.exp2(rng.integers(-12, 12, (4, 2))).repeat(16, axis=1)
    specs.append(("spread_blocks", x.astype(f32), -1))
    specs.append(("3d", rng.standard_normal((2, 3, 32)).astype(f32), -1))
    specs.append(("axis0", rng.standard_normal((32, 3)).astype(f32), 0))
    out = []
    for kind, x, axis in specs:
        for per_tensor in (1, 0):
            with np.errstate(all="ignore"):
                data = run_nvfp4(x, bool(per_tensor), axis)
            all_nan = bool(np.isnan(data["outputs"]).all() and not np.isnan(x).all())
            out.append((f"{kind}_pts{per_tensor}", dict(per_tensor_scale=per_tensor, axis=axis, data=kind,
                                                         all_nan=all_nan), dict(inputs=x, **data)))
    refused = []
    for name, x in [("last_dim_24", rng.standard_normal((2, 24)).astype(f32)),
                    ("rank1", rng.standard_normal(32).astype(f32)),
                    ("rank4", rng.standard_normal((1, 2, 2, 16)).astype(f32))]:
        try:
            run_nvfp4(x, True)
            error = "none"
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        refused.append((name, dict(per_tensor_scale=1, axis=-1, error=error), dict(inputs=x)))
    return out, refused


# ----------------------------------------------------------------------------------------------
# ONNX
# ----------------------------------------------------------------------------------------------
ONNX_TYPES = {  # dtype: (TensorProto type, storage, qmin, qmax / float max)
    "uint8": (TP.UINT8, np.uint8, 0, 255), "int8": (TP.INT8, np.int8, -128, 127),
    "uint16": (TP.UINT16, np.uint16, 0, 65535), "int16": (TP.INT16, np.int16, -32768, 32767),
    "uint4": (TP.UINT4, np.uint8, 0, 15), "int4": (TP.INT4, np.int8, -8, 7),
    "float8e4m3fn": (TP.FLOAT8E4M3FN, ml_dtypes.float8_e4m3fn, None, 448.0),
    "float8e5m2": (TP.FLOAT8E5M2, ml_dtypes.float8_e5m2, None, 57344.0),
    "float4e2m1": (TP.FLOAT4E2M1, ml_dtypes.float4_e2m1fn, None, 6.0),
}
ML_INT = {"uint4": ml_dtypes.uint4, "int4": ml_dtypes.int4}


def onnx_model(dtype, scale, zp, axis, block_size, saturate, opset):
    qt = ONNX_TYPES[dtype][0]
    attrs = {"axis": axis}
    if block_size:
        attrs["block_size"] = block_size
    qattrs = dict(attrs)
    if dtype.startswith("float8"):
        qattrs["saturate"] = saturate
    inits = [numpy_helper.from_array(np.asarray(scale, f32), "s")]
    ins = ["x", "s"]
    if zp is not None:
        inits.append(helper.make_tensor("z", qt, list(np.shape(zp)), np.asarray(zp).reshape(-1).tolist()))
        ins.append("z")
    else:
        qattrs["output_dtype"] = qt
    nodes = [helper.make_node("QuantizeLinear", ins, ["q"], **qattrs),
             helper.make_node("DequantizeLinear", ["q"] + ins[1:], ["y"], **attrs)]
    cast_to = {"int4": TP.INT8, "uint4": TP.UINT8}.get(dtype, TP.FLOAT if dtype.startswith("float") else None)
    if cast_to is not None:
        nodes.append(helper.make_node("Cast", ["q"], ["qc"], to=cast_to))
    outs = [helper.make_tensor_value_info("y", TP.FLOAT, None),
            helper.make_tensor_value_info("qc" if cast_to is not None else "q", cast_to or qt, None)]
    g = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TP.FLOAT, None)], outs,
                          initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=11)


def reference_qdq(dtype, x, scale, zp, axis, block_size, saturate, opset):
    """The reference evaluator on QuantizeLinear then DequantizeLinear (uncast q)."""
    qt = ONNX_TYPES[dtype][0]
    attrs = {"axis": axis}
    if block_size:
        attrs["block_size"] = block_size
    qattrs = dict(attrs)
    if dtype.startswith("float8"):
        qattrs["saturate"] = saturate
    inits = [numpy_helper.from_array(np.asarray(scale, f32), "s")]
    ins = ["x", "s"]
    if zp is not None:
        inits.append(helper.make_tensor("z", qt, list(np.shape(zp)), np.asarray(zp).reshape(-1).tolist()))
        ins.append("z")
    else:
        qattrs["output_dtype"] = qt
    nodes = [helper.make_node("QuantizeLinear", ins, ["q"], **qattrs),
             helper.make_node("DequantizeLinear", ["q"] + ins[1:], ["y"], **attrs)]
    outs = [helper.make_tensor_value_info("y", TP.FLOAT, None), helper.make_tensor_value_info("q", qt, None)]
    g = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TP.FLOAT, None)], outs,
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=11)
    with np.errstate(all="ignore"):
        y, q = ReferenceEvaluator(m).run(None, {"x": x})
    storage = ONNX_TYPES[dtype][1]
    if dtype in ML_INT:
        q = q.astype(storage)
    elif dtype.startswith("float"):
        q = q.view(np.uint8)
    return np.asarray(y, f32), np.asarray(q)


def onnx_inputs(rng, shape, dtype, kind, scale_b):
    """x shaped ``shape`` whose x / scale covers the quantized range and beyond (``scale_b``: the scale
    broadcast to x)."""
    _, _, qmin, qmax = ONNX_TYPES[dtype]
    if qmin is None:
        qmin, qmax = -qmax, qmax
    width = qmax - qmin
    if kind == "range":
        u = rng.uniform(qmin - 0.2 * width, qmax + 0.2 * width, shape)
    elif kind == "ties":
        u = rng.integers(int(max(qmin, -300)) - 3, int(min(qmax, 300)) + 3, shape) + 0.5
        if dtype.startswith("float"):  # midpoints of the float grid: 1 + odd/16 etc.
            u = rng.integers(-64, 64, shape) / 8.0 + rng.choice([-1, 1], shape) / 16.0
    elif kind == "specials":
        u = rng.uniform(qmin - 0.2 * width, qmax + 0.2 * width, shape)
        flat = u.reshape(-1)
        sp = np.array([np.nan, np.inf, -np.inf, 1e10, -1e10, 3e9, -3e9, 2.0**31, 0.0, -0.0, 1e-42, 2.5, -2.5,
                       470.0, 479.0, 480.0, 488.0, 495.9, 496.0, 500.0, 61000.0, 61440.0, 63000.0, 65535.0, 65536.0,
                       70000.0, 7.0, 5.5, -5.5, 0.75, 0.25])
        idx = rng.choice(flat.size, min(flat.size, sp.size), replace=False)
        flat[idx] = sp[: idx.size]
        return (u.astype(f32) * scale_b).astype(f32)  # multiples of the scale: v = x / s lands on them
    else:
        raise ValueError(kind)
    return (u * scale_b).astype(f32)


def onnx_cases(rng):
    from onnx.reference.ops._quant_utils import reshape_input

    out = []
    shape = (3, 8, 5)
    for dtype in ONNX_TYPES:
        opset = 23 if dtype == "float4e2m1" else 21
        is_int = not dtype.startswith("float")
        storage, qmin, qmax = ONNX_TYPES[dtype][1], ONNX_TYPES[dtype][2], ONNX_TYPES[dtype][3]
        sats = [1, 0] if dtype.startswith("float8") else [1]
        modes = [("per-tensor", 1, 0), ("per-axis", 1, 0), ("per-axis", 0, 0), ("per-axis", -1, 0),
                 ("blocked", 1, 4), ("blocked", 1, 3), ("blocked", -1, 2), ("blocked", 0, 2)]
        for mode, axis, bs in modes:
            ax = axis % len(shape)
            if mode == "per-tensor":
                sshape = ()
            elif mode == "per-axis":
                sshape = (shape[ax],)
            else:
                sshape = tuple(-(-shape[ax] // bs) if i == ax else n for i, n in enumerate(shape))
            for zp_given in ([0, 1] if is_int else [0]):
                for sat in sats:
                    for kind in ["range", "ties", "specials"]:
                        if kind == "range":
                            scale = (np.exp2(rng.integers(-8, 4, sshape)) * rng.uniform(0.5, 1.5, sshape))
                        else:  # powers of two: x / s is exact, the ties and specials land where meant
                            scale = np.exp2(rng.integers(-4, 3, sshape))
                        scale = np.asarray(scale, f32)
                        zp = rng.integers(qmin, qmax + 1, sshape).astype(storage) if zp_given else None
                        sb = np.broadcast_to(reshape_input(scale, shape, ax, bs or None), shape)
                        x = onnx_inputs(rng, shape, dtype, kind, sb)
                        if zp is not None and kind != "specials":
                            x = (x + reshape_input(zp.astype(f32), shape, ax, bs or None) * 0).astype(f32)
                        name = f"{dtype}_{mode}{'' if mode == 'per-tensor' else f'_axis{axis}'}" \
                               f"{f'_bs{bs}' if bs else ''}{'_zp' if zp is not None else ''}" \
                               f"{'' if not dtype.startswith('float8') else f'_sat{sat}'}_{kind}"
                        attrs = dict(dtype=dtype, axis=axis, block_size=bs, saturate=sat, opset=opset, mode=mode,
                                     data=kind)
                        data = dict(x=x, y_scale=scale)
                        if zp is not None:
                            data["y_zero_point"] = zp
                        y, q = reference_qdq(dtype, x, scale, None if zp is None else ml_int(zp, dtype), axis, bs,
                                             sat, opset)
                        data["quantized"], data["outputs"] = q, y
                        try:
                            m = onnx_model(dtype, scale, None if zp is None else ml_int(zp, dtype), axis, bs, sat,
                                           opset)
                            sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
                            oy, oq = sess.run(None, {"x": x})
                            data["ort_outputs"], data["ort_quantized"] = np.asarray(oy, f32), np.asarray(oq)
                        except Exception as e:
                            attrs["ort_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                        out.append((name, attrs, data))
    # the 1-element-scale per-tensor form, an x of rank 1, a scalar x
    for name, x, scale in [("uint8_scale_1d_size1", rng.uniform(-3, 3, 7).astype(f32), np.array([0.05], f32)),
                           ("int8_rank1_axis0", rng.uniform(-3, 3, 6).astype(f32), rng.uniform(0.01, 0.1, 6)),
                           ("uint8_scalar_x", np.array(1.337, f32), np.array(0.01, f32))]:
        dtype = name.split("_")[0]
        scale = np.asarray(scale, f32)
        y, q = reference_qdq(dtype, x, scale, None, 0, 0, 1, 21)
        attrs = dict(dtype=dtype, axis=0, block_size=0, saturate=1, opset=21,
                     mode="per-axis" if scale.size > 1 else "per-tensor", data="range")
        data = dict(x=x, y_scale=scale, quantized=q, outputs=y)
        m = onnx_model(dtype, scale, None, 0, 0, 1, 21)
        oy, oq = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
        data["ort_outputs"], data["ort_quantized"] = np.asarray(oy, f32), np.asarray(oq)
        out.append((name, attrs, data))
    refused = []
    x = rng.uniform(-1, 1, shape).astype(f32)
    for name, dtype, scale, axis, bs, zp in [
            ("per_axis_wrong_length", "uint8", np.full(4, 0.1, f32), 1, 0, None),
            ("blocked_too_few_blocks", "int8", np.full((3, 1, 5), 0.1, f32), 1, 4, None),
            ("blocked_too_many_blocks", "int8", np.full((3, 3, 5), 0.1, f32), 1, 4, None),
            ("blocked_wrong_rank", "int8", np.full((2,), 0.1, f32), 1, 4, None),
            ("axis_out_of_range", "uint8", np.full(5, 0.1, f32), 3, 0, None),
            ("float8_nonzero_zero_point", "float8e4m3fn", np.array(0.1, f32), 1, 0,
             np.array(1.0, f32).astype(ml_dtypes.float8_e4m3fn))]:
        try:
            reference_qdq(dtype, x, scale, zp, axis, bs, 1, 21)
            error = "none"
        except Exception as e:
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        data = dict(x=x, y_scale=scale)
        if zp is not None:
            data["y_zero_point"] = zp.view(np.uint8)
        refused.append((name, dict(dtype=dtype, axis=axis, block_size=bs, saturate=1, opset=21, error=error), data))
    return out, refused


def ml_int(zp, dtype):
    return zp.astype(ML_INT[dtype]) if dtype in ML_INT else zp


# ----------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------
def open_h5_deterministic(path):
    """A new HDF5 file (HDF5 1.10 format, readable by older h5py builds) whose bytes depend only on the content:
    no object timestamps."""
    fcpl = h5py.h5p.create(h5py.h5p.FILE_CREATE)
    fcpl.set_obj_track_times(False)
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_V110, h5py.h5f.LIBVER_V110)
    return h5py.File(h5py.h5f.create(path.encode(), h5py.h5f.ACC_TRUNC, fcpl=fcpl, fapl=fapl))


def new_group(parent, name):
    gcpl = h5py.h5p.create(h5py.h5p.GROUP_CREATE)
    gcpl.set_obj_track_times(False)
    return h5py.Group(h5py.h5g.create(parent.id, name.encode(), gcpl=gcpl))


def write_group(parent, name, attrs, data):
    g = new_group(parent, name)
    for k, v in attrs.items():
        g.attrs[k] = v
    for k, v in data.items():
        v = np.asarray(v)
        if v.dtype.kind == "V" or v.dtype.name.startswith(("float8", "float4", "int4", "uint4")):
            raise TypeError(f"{name}/{k}: store {v.dtype} as its bytes")
        g.create_dataset(k, data=v, track_times=False)


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main():
    torch.set_num_threads(1)
    rng = np.random.default_rng(SEED)
    mx, mx_refused = mx_cases(rng)
    nv, nv_refused = nvfp4_cases(rng)
    ox, ox_refused = onnx_cases(rng)
    tmp = OUT + ".tmp"
    with open_h5_deterministic(tmp) as f:
        for k, v in {"torch_version": torch.__version__, "torchao_version": torchao.__version__,
                     "onnx_version": onnx.__version__, "onnxruntime_version": ort.__version__,
                     "ml_dtypes_version": ml_dtypes.__version__, "numpy_version": np.__version__,
                     "generator": GENERATOR, "seed": SEED, "cpu": cpu_name(),
                     "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}.items():
            f.attrs[k] = str(v) if isinstance(v, str) else v
        for group, items in [("mx", mx), ("mx_refusals", mx_refused), ("nvfp4", nv), ("nvfp4_refusals", nv_refused),
                             ("onnx", ox), ("onnx_refusals", ox_refused)]:
            top = new_group(f, group)
            for name, attrs, data in items:
                write_group(top, name, attrs, data)
    os.replace(tmp, OUT)
    print(f"wrote {OUT}: mx {len(mx)} + {len(mx_refused)} refusals, nvfp4 {len(nv)} + {len(nv_refused)}, "
          f"onnx {len(ox)} + {len(ox_refused)} ({os.path.getsize(OUT) / 1e6:.2f} MB)", file=sys.stderr)
    print("  onnxruntime errors:", sum("ort_error" in a for _, a, _ in ox), file=sys.stderr)
    print("  nvfp4 all-NaN cases:", [n for n, a, _ in nv if a["all_nan"]], file=sys.stderr)
    for name, attrs, _ in mx_refused + nv_refused + ox_refused:
        print(f"  refused {name}: {attrs['error'][:120]}", file=sys.stderr)


if __name__ == "__main__":
    main()
