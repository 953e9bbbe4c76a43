"""ONNX ``QuantizeLinear`` / ``DequantizeLinear`` (opset 21 and later; float4e2m1 from opset 23) as
``onnx.reference.ReferenceEvaluator`` computes them (onnx 1.23, ``onnx/reference/ops/op_quantize_linear.py``,
``op_dequantize_linear.py``), float32 ``x`` and ``y_scale``.

Scale and zero point: per tensor when ``y_scale`` has one element; per axis when it is 1-D of length
``x.shape[axis]``; blocked (``block_size > 0``) when it has ``x``'s rank and ``ceil(x.shape[axis] / block_size)``
along ``axis`` (the last block may be partial, as in ONNX: element ``i`` uses scale ``i // block_size``)::

    QuantizeLinear, integer types:  q = saturate(round_half_even(x / y_scale) + y_zero_point)   (float32 x / s)
    QuantizeLinear, float8:         q = cast(clip(x / y_scale, -F, F))   (saturate=1: F = 448 / 57344)
                                    q = cast(x / y_scale)                (saturate=0)
    QuantizeLinear, float4e2m1:     q = cast(x / y_scale)                (no Inf/NaN: the cast saturates)
    DequantizeLinear:               y = (float32(q) - y_zero_point) * y_scale

``cast``: round to nearest, ties to even, as ml_dtypes casts (which the reference uses).  Integer ranges:
uint8 [0, 255], int8 [-128, 127], uint16 [0, 65535], int16 [-32768, 32767], uint4 [0, 15], int4 [-8, 7].

Notes:

* **NaN, Inf and overflow into integer types saturate** (onnxruntime's CPU kernels): NaN -> qmin, +Inf and
  values beyond qmax -> qmax, -Inf -> qmin.  The reference's ``np.rint(x).astype(np.int32)`` is undefined
  there (on x86 it gives INT32_MIN, so the reference returns qmin for NaN, +-Inf and anything beyond int32,
  +Inf included); the two agree wherever ``|x / y_scale| < 2^31``.
* **float8 without saturation: onnxruntime disagrees with the reference; qgcli follows the reference.**
  e4m3fn: values in [480, 496) after scaling are 448 in onnxruntime and NaN in the reference (ml_dtypes
  rounds everything at or above 464 past the largest finite value to NaN); e5m2: values in [61440, 65536)
  are NaN in onnxruntime and Inf in the reference.  With ``saturate=1`` (the default) they agree.
* **float4e2m1**: onnxruntime 1.32 has no CPU kernel; the reference's ml_dtypes cast turns NaN into -0
  (code 0x8) and -NaN into +0, Inf into 6.  The reference adds a float4 zero point in QuantizeLinear but
  ignores it in DequantizeLinear; qgcli refuses nonzero zero points for the float types (ONNX requires 0).
* ``quantized`` comes in the narrowest NumPy type: uint8/int8/uint16/int16, uint4 as uint8, int4 as int8,
  float8 as ``ml_dtypes.float8_e4m3fn`` / ``float8_e5m2``, float4e2m1 as ``ml_dtypes.float4_e2m1fn`` (one code
  per byte; ONNX packs two per byte on disk).  The float types need NumPy (ml_dtypes); the integer types also
  run on CuPy.

Gradients (:func:`onnx_fake_quantize_gradient`): ``estimator="ste"`` (default) is the identity, the
straight-through estimator of ModelOpt (``pass_through_bwd=True``) and torchao; ``estimator="masked"`` (integer
types) zeroes the gradient, as +0, where the rounded value saturated: it passes where
``qmin <= round(x / y_scale) + y_zero_point <= qmax`` (ModelOpt ``pass_through_bwd=False``; onnxruntime
training's ``FakeQuant`` gradient mask).  NaN ``x`` is outside (gradient 0).

>>> import numpy as np
>>> r = onnx_fake_quantize(np.array([-1.0, 0.26, 0.5, 300.0], np.float32), np.float32(0.25), np.uint8(128))
>>> r.outputs, r.quantized
(array([-1.  ,  0.25,  0.5 , 31.75], dtype=float32), array([124, 129, 130, 255], dtype=uint8))
"""
from typing import NamedTuple

import numpy as np

from qgcli.backend import array_module
from qgcli.errors import OperandError
from qgcli.ops import blocked, native
from qgcli.ops.out_array import check_outs, deliver

_F32 = np.float32
#: dtype -> (NumPy storage type, qmin, qmax) for the integer types
INTEGER_TYPES = {
    "uint8": (np.uint8, 0, 255),
    "int8": (np.int8, -128, 127),
    "uint16": (np.uint16, 0, 65535),
    "int16": (np.int16, -32768, 32767),
    "uint4": (np.uint8, 0, 15),
    "int4": (np.int8, -8, 7),
}
#: dtype -> (ml_dtypes type name, largest finite value)
FLOAT_TYPES = {
    "float8e4m3fn": ("float8_e4m3fn", 448.0),
    "float8e5m2": ("float8_e5m2", 57344.0),
    "float4e2m1": ("float4_e2m1fn", 6.0),
}
DTYPES = tuple(INTEGER_TYPES) + tuple(FLOAT_TYPES)
#: elements per run of rows in onnx_fake_quantize on NumPy (its chain of operations stays in cache)
CHUNK_ELEMENTS = 1 << 16
ESTIMATORS = ("ste", "masked")


class OnnxFakeQuantResult(NamedTuple):
    """``outputs``: DequantizeLinear(QuantizeLinear(x)) as float32; ``quantized``: QuantizeLinear(x)."""

    outputs: object
    quantized: object


def _dtype(dtype):
    d = str(dtype).lower().replace("_", "")
    if d not in DTYPES:
        raise OperandError(f"{dtype!r} is not one of {', '.join(DTYPES)}", operand="dtype")
    return d


def _float32(a, name, xp):
    a = xp.asarray(a)
    if a.dtype.kind != "f":
        raise OperandError(f"dtype {a.dtype} is not a floating type", operand=name)
    return a.astype(_F32, copy=False)


def _broadcast(value, shape, axis, block_size, name, xp, expand=True):
    """``value`` (scale or zero point) reshaped to broadcast against ``x`` (the reference's ``reshape_input``),
    or repeated along ``axis`` for blocked quantization (``expand``; else checked and left one per block)."""
    if value.ndim == 0 or value.size == 1:
        return value.reshape(())
    if not block_size:
        if value.ndim != 1 or value.shape[0] != shape[axis]:
            raise OperandError(f"shape {list(value.shape)} is neither one value nor 1-D of length {shape[axis]} "
                               f"(x.shape[{axis}]) for per-axis quantization", operand=name)
        dims = [1] * len(shape)
        dims[axis] = value.shape[0]
        return value.reshape(dims)
    blocks = -(-shape[axis] // block_size)
    expected = tuple(blocks if i == axis else n for i, n in enumerate(shape))
    if tuple(value.shape) != expected:
        raise OperandError(f"shape {list(value.shape)} does not fit blocked quantization of x {list(shape)} along "
                           f"axis {axis} with block_size {block_size}: expected {list(expected)}", operand=name)
    if not expand:
        return value
    return xp.repeat(value, block_size, axis=axis)[(slice(None),) * axis + (slice(0, shape[axis]),)]


def _prepare(x, y_scale, y_zero_point, dtype, axis, block_size, expand=True):
    xp = array_module(x, y_scale) if y_zero_point is None else array_module(x, y_scale, y_zero_point)
    x = xp.asarray(x)
    if x.dtype != _F32:
        raise OperandError(f"dtype {x.dtype}: qgcli's QuantizeLinear takes float32 x (ONNX computes float16 and "
                           "bfloat16 inputs in their own precision)", operand="x")
    d, sb, zb = _qparams(xp, tuple(x.shape), y_scale, y_zero_point, dtype, axis, block_size, expand)
    return xp, x, d, sb, zb


def _qparams(xp, shape, y_scale, y_zero_point, dtype, axis, block_size, expand=True):
    """``(dtype, scale, zero point)`` broadcastable against an ``x`` of ``shape`` (zero point None: 0); blocked
    ones one per block unless ``expand``."""
    d = _dtype(dtype)
    s = _float32(y_scale, "y_scale", xp)
    if isinstance(block_size, bool) or int(block_size) != block_size or block_size < 0:
        raise OperandError(f"{block_size!r} must be an integer >= 0", operand="block_size")
    block_size = int(block_size)
    per_tensor = s.ndim == 0 or s.size == 1
    if not per_tensor or block_size:
        if len(shape) == 0:
            raise OperandError("a scalar x takes a single y_scale", operand="y_scale")
        if not -len(shape) <= axis < len(shape):
            raise OperandError(f"axis {axis} is out of range for x of shape {list(shape)}", operand="axis")
        axis %= len(shape)
    sb = _broadcast(s, shape, axis, 0 if per_tensor else block_size, "y_scale", xp, expand)
    zb = None
    if y_zero_point is not None:
        z = xp.asarray(y_zero_point)
        if tuple(z.shape) != tuple(s.shape):
            raise OperandError(f"shape {list(z.shape)} differs from y_scale's {list(s.shape)}",
                               operand="y_zero_point")
        zf = z.astype(np.float64)
        if d in FLOAT_TYPES:
            if bool(xp.any(zf != 0)):
                raise OperandError(f"{d} takes no zero point (ONNX: it must be 0)", operand="y_zero_point")
        else:
            _, lo, hi = INTEGER_TYPES[d]
            if bool(xp.any((zf != xp.rint(zf)) | (zf < lo) | (zf > hi))):
                raise OperandError(f"values must be integers in [{lo}, {hi}] for {d}", operand="y_zero_point")
            zb = _broadcast(zf.astype(_F32), shape, axis, 0 if per_tensor else block_size, "y_zero_point", xp,
                            expand)
    return d, sb, zb


def _quantize(xp, x, d, sb, zb, saturate):
    with np.errstate(all="ignore"):
        v = x / sb
        if d in INTEGER_TYPES:
            store, lo, hi = INTEGER_TYPES[d]
            v = xp.rint(v)
            if zb is not None:
                v = v + zb
            q = xp.where(xp.isnan(v), _F32(lo), xp.clip(v, _F32(lo), _F32(hi)))
            return v, q.astype(store)
        if xp is not np:
            raise OperandError(f"{d} needs NumPy (its casts go through ml_dtypes); pass NumPy arrays",
                               operand="dtype")
        import ml_dtypes

        name, fmax = FLOAT_TYPES[d]
        if saturate and d != "float4e2m1":
            v = np.clip(v, _F32(-fmax), _F32(fmax))
        return v, np.asarray(v).astype(getattr(ml_dtypes, name))


def quantize_linear(x, y_scale, y_zero_point=None, *, dtype="uint8", axis=1, block_size=0, saturate=True):
    """ONNX ``QuantizeLinear`` (opset 21+): ``x`` float32, ``y_scale`` one value, 1-D per ``axis`` or blocked.

    >>> import numpy as np
    >>> quantize_linear(np.array([[1.0, -2.5], [3.0, 9.0]], np.float32), np.array([0.5, 2.0], np.float32),
    ...                 dtype="int8", axis=0)
    array([[ 2, -5],
           [ 2,  4]], dtype=int8)
    """
    xp, x, d, sb, zb = _prepare(x, y_scale, y_zero_point, dtype, axis, block_size)
    return _quantize(xp, x, d, sb, zb, saturate)[1]


def dequantize_linear(x, x_scale, x_zero_point=None, *, dtype="uint8", axis=1, block_size=0):
    """ONNX ``DequantizeLinear`` (opset 21+) of codes ``x`` of type ``dtype`` (stored as
    :func:`quantize_linear` returns them): ``(float32(x) - x_zero_point) * x_scale``, float32.

    >>> import numpy as np
    >>> dequantize_linear(np.array([0, 7, 255], np.uint8), np.float32(0.5), np.uint8(7))
    array([ -3.5,   0. , 124. ], dtype=float32)
    """
    xp = array_module(x, x_scale)
    q = xp.asarray(x)
    d, sb, zb = _qparams(xp, tuple(q.shape), x_scale, x_zero_point, dtype, axis, block_size)
    if d in INTEGER_TYPES:
        store, lo, hi = INTEGER_TYPES[d]
        if q.dtype.kind not in "iu" or bool(xp.any((q < lo) | (q > hi))):
            raise OperandError(f"codes must be integers in [{lo}, {hi}] for {d}", operand="x")
    return _dequantize(xp, q, d, sb, zb)


def _dequantize(xp, q, d, sb, zb):
    with np.errstate(all="ignore"):
        if d in FLOAT_TYPES:
            dq = np.asarray(q).astype(_F32) if xp is np else q.astype(_F32)
        else:
            dq = q.astype(_F32)
            if zb is not None:
                dq = dq - zb
        return (dq * sb).astype(_F32, copy=False)


def broadcast_qparams(shape, y_scale, y_zero_point=None, *, dtype="uint8", axis=1, block_size=0):
    """``(scale, zero point)`` as QuantizeLinear applies them to an ``x`` of ``shape``: float32 arrays that
    broadcast against it (blocked: repeated along ``axis``); the zero point 0 where none is given."""
    _, sb, zb = _qparams(np, tuple(shape), y_scale, y_zero_point, dtype, axis, block_size)
    return sb, (np.zeros((), _F32) if zb is None else zb)


def grid_values(dtype):
    """The values QuantizeLinear's output type ``dtype`` holds, sorted (float64): the integers qmin..qmax, or
    every finite value of the float type.

    >>> grid_values("float4e2m1")[7:].tolist()
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    """
    d = _dtype(dtype)
    if d in INTEGER_TYPES:
        _, lo, hi = INTEGER_TYPES[d]
        return np.arange(lo, hi + 1, dtype=np.float64)
    import ml_dtypes

    name, _ = FLOAT_TYPES[d]
    codes = np.arange(256 if name.startswith("float8") else 16, dtype=np.uint8)
    values = codes.view(getattr(ml_dtypes, name)).astype(np.float64)
    return np.unique(values[np.isfinite(values)]) + 0.0  # -0 as 0


def onnx_fake_quantize(x, y_scale, y_zero_point=None, *, dtype="uint8", axis=1, block_size=0, saturate=True,
                       out=None):
    """``DequantizeLinear(QuantizeLinear(x))`` with the same scale, zero point, axis and block size: an
    :class:`OnnxFakeQuantResult` ``(outputs, quantized)``.  ``out``: arrays to write them into (an earlier
    result of the same shapes, or ``(outputs, quantized)`` with None for a new array), as
    :func:`qgcli.ops.mx.mx_fake_quantize` takes them.

    >>> import numpy as np
    >>> onnx_fake_quantize(np.array([1.0, 500.0], np.float32), np.float32(1.0), dtype="float8e4m3fn").outputs
    array([  1., 448.], dtype=float32)
    """
    xp, xa, d, sb, zb = _prepare(x, y_scale, y_zero_point, dtype, axis, block_size, expand=False)
    outs = check_outs(out, xp, {"outputs": (xa.shape, _F32), "quantized": (xa.shape, _result_dtype(d, xp))},
                      [a for a in (xa, sb, zb) if a is not None])
    done = _native(xp, xa, d, sb, zb, axis, block_size, saturate, outs)
    if done is None:
        if block_size and sb.ndim:
            xp, xa, d, sb, zb = _prepare(x, y_scale, y_zero_point, dtype, axis, block_size)
        if xp is np and xa.ndim and xa.shape[0] > 1 and xa.size > CHUNK_ELEMENTS:
            done = _chunked(xa, d, sb, zb, saturate)
        else:
            _, q = _quantize(xp, xa, d, sb, zb, saturate)
            done = OnnxFakeQuantResult(_dequantize(xp, q, d, sb, zb), q)
    return OnnxFakeQuantResult(deliver(done.outputs, outs["outputs"]), deliver(done.quantized, outs["quantized"]))


def _result_dtype(d, xp):
    """``quantized``'s dtype for QuantizeLinear's type ``d``: the integer storage type, or ml_dtypes' type."""
    if d in INTEGER_TYPES:
        return INTEGER_TYPES[d][0]
    if xp is not np:
        raise OperandError(f"{d} needs NumPy (its casts go through ml_dtypes); pass NumPy arrays", operand="dtype")
    import ml_dtypes

    return getattr(ml_dtypes, FLOAT_TYPES[d][0])


#: the compiled kernel's kind (qg_onnx_q: QG_ONNX_*) of a float type, saturating and not
_KERNEL_FLOATS = {("float8e4m3fn", True): 2, ("float8e5m2", True): 3, ("float8e4m3fn", False): 4,
                  ("float8e5m2", False): 5, ("float4e2m1", True): 6, ("float4e2m1", False): 6}


def _layout(shape, sb, axis, block_size):
    """qg_onnx_q's view of x (rows, n, inner, tail, row_len) and of its scales (s_rstride, s_jstride, jdiv, vec)
    for a per-tensor, per-axis or (compact) blocked scale ``sb``."""
    size = int(np.prod(shape))
    if sb.ndim == 0:
        inner = shape[-1] if shape else 1
        return size // inner, 1, inner, inner, inner, 0, 0, 1, 0
    axis %= len(shape)
    length, inner = shape[axis], int(np.prod(shape[axis + 1:]))
    rows = size // (length * inner)
    if block_size:
        blocks = sb.shape[axis]
        if inner == 1:  # block j of each row is span j, with one scale
            return rows, blocks, block_size, length - (blocks - 1) * block_size, length, blocks, 1, 1, 0
        return rows, length, inner, inner, length * inner, blocks * inner, inner, block_size, 1
    if inner == 1:  # the last axis: one span per row, a scale per element
        return rows, 1, length, length, length, 0, 0, 1, 1
    return rows, length, inner, inner, length * inner, 0, 1, 1, 0


def _native(xp, xa, d, sb, zb, axis, block_size, saturate, outs=None):
    """:func:`onnx_fake_quantize` in the compiled kernel (the same float32 operations as :func:`_quantize` and
    :func:`_dequantize`, the same codes as ml_dtypes' casts), over runs of rows on the thread pool; None where
    it does not apply (CuPy, not built, an empty x) or met what only the NumPy path does (NaN into a float
    type, or past its largest value without saturation).  ``outs``: :func:`onnx_fake_quantize`'s checked
    ``out`` arrays, written in place where given."""
    lib = native.for_arrays(xp, xa, sb, zb)
    if lib is None or xa.size == 0:
        return None
    rows, n, inner, tail, row_len, s_rstride, s_jstride, jdiv, vec = _layout(xa.shape, sb, axis, block_size)
    s = np.ascontiguousarray(sb, _F32)
    z = None if zb is None else np.ascontiguousarray(np.broadcast_to(zb, sb.shape), _F32)
    if d in INTEGER_TYPES:
        store, lo, hi = INTEGER_TYPES[d]
        kind = 0 if np.dtype(store).itemsize == 1 else 1
    else:
        store, lo, hi, kind = np.uint8, 0, 0, _KERNEL_FLOATS[d, bool(saturate)]
    outs = outs or {}
    q = np.empty(xa.shape, store) if outs.get("quantized") is None else outs["quantized"].view(store)
    y = np.empty(xa.shape, _F32) if outs.get("outputs") is None else outs["outputs"]
    x_at, y_at, s_at = native.address(xa, _F32), native.address(y, _F32), native.address(s, _F32)
    q_at = q.__array_interface__["data"][0]
    z_at = None if z is None else native.address(z, _F32)
    step = max(1, CHUNK_ELEMENTS * 8 // row_len)

    def one(start):
        at = start * row_len
        return lib.qg_onnx_q(x_at + 4 * at, q_at + q.itemsize * at, y_at + 4 * at, min(step, rows - start), n,
                             inner, tail, row_len, s_at + 4 * start * s_rstride,
                             None if z_at is None else z_at + 4 * start * s_rstride, s_rstride, s_jstride, jdiv,
                             vec, _F32(lo), _F32(hi), kind)

    if any(blocked._map(one, range(0, rows, step))):
        return None
    if d in FLOAT_TYPES:
        import ml_dtypes

        q = q.view(getattr(ml_dtypes, FLOAT_TYPES[d][0]))
    return OnnxFakeQuantResult(y, q)


def _chunked(xa, d, sb, zb, saturate):
    """:func:`onnx_fake_quantize` over runs of leading rows on the thread pool (NumPy): the same operations."""
    n = xa.shape[0]
    rows = max(1, CHUNK_ELEMENTS // max(1, xa.size // n))

    def part(a, sl):
        return a[sl] if a is not None and a.ndim == xa.ndim and a.shape[0] == n else a

    first = _quantize(np, xa[:1], d, part(sb, slice(0, 1)), part(zb, slice(0, 1)), saturate)[1]
    q = np.empty(xa.shape, first.dtype)
    y = np.empty(xa.shape, _F32)

    def one(start):
        sl = slice(start, min(start + rows, n))
        s_, z_ = part(sb, sl), part(zb, sl)
        q[sl] = _quantize(np, xa[sl], d, s_, z_, saturate)[1]
        y[sl] = _dequantize(np, q[sl], d, s_, z_)

    blocked._map(one, range(0, n, rows))
    return OnnxFakeQuantResult(y, q)


def onnx_fake_quantize_gradient(gradients, x, y_scale, y_zero_point=None, *, dtype="uint8", axis=1, block_size=0,
                                saturate=True, estimator="ste"):
    """Input gradient of :func:`onnx_fake_quantize`: ``estimator="ste"`` gives ``gradients`` unchanged (a new
    float32 array); ``"masked"`` (integer dtypes) gives ``where(qmin <= round(x / y_scale) + zp <= qmax,
    gradients, +0)``.

    >>> import numpy as np
    >>> onnx_fake_quantize_gradient(np.ones(3, np.float32), np.array([-1.0, 0.5, 99.0], np.float32),
    ...                             np.float32(0.5), dtype="int4", estimator="masked")
    array([1., 1., 0.], dtype=float32)
    """
    xp, xa, d, sb, zb = _prepare(x, y_scale, y_zero_point, dtype, axis, block_size)
    g = _float32(gradients, "gradients", xp)
    if tuple(g.shape) != tuple(xa.shape):
        raise OperandError(f"shape {list(g.shape)} differs from x's {list(xa.shape)}", operand="gradients")
    if estimator not in ESTIMATORS:
        raise OperandError(f"{estimator!r} is not one of {', '.join(ESTIMATORS)}", operand="estimator")
    if estimator == "ste":
        return g.astype(_F32, copy=True)
    if d not in INTEGER_TYPES:
        raise OperandError(f"the masked estimator is for the integer types, not {d}", operand="estimator")
    _, lo, hi = INTEGER_TYPES[d]
    with np.errstate(all="ignore"):
        v = xp.rint(xa / sb)
        if zb is not None:
            v = v + zb
        inside = (v >= _F32(lo)) & (v <= _F32(hi))
    return xp.where(inside, g, _F32(0)).astype(_F32, copy=False)
