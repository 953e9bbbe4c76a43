"""OCP Microscaling (MX v1.0) fake quantization, as torchao 0.18's ``torchao.prototype.mx_formats`` computes it
(``to_mx`` then ``to_dtype``, eager, CPU).  Pure NumPy/CuPy; torch is never imported.

Formats (element type, ``emax`` = exponent of its largest power of two, ``F`` = its largest value):

=============  ==================  ======  ========  ==========================================
format         element             emax    F         codes returned as
=============  ==================  ======  ========  ==========================================
mxfp8-e4m3     float8 e4m3fn       8       448       ``ml_dtypes.float8_e4m3fn``
mxfp8-e5m2     float8 e5m2         15      57344     ``ml_dtypes.float8_e5m2``
mxfp6-e2m3     fp6 e2m3            2       7.5       uint8, sign in bit 5
mxfp6-e3m2     fp6 e3m2            4       28        uint8, sign in bit 5
mxfp4          fp4 e2m1            2       6         uint8, one code per element (unpacked), sign in bit 3
mxint8         int8, scale 2^-6    0       127/64    int8 (OCP spec; torchao 0.18 has no MX int8)
=============  ==================  ======  ========  ==========================================

Blocks of ``block_size`` consecutive elements along ``axis``; per block, with ``a = max|x|`` (NaN if the
block holds one) and ``e(a)`` the unbiased exponent field of the float32 ``a`` (-127 for zero and
subnormals, 128 for Inf/NaN)::

    floor:  k = e(a) - emax
    ceil:   k = e(a) + [mantissa bits of a != 0] - emax
    even:   k = e(a') - emax,  a' = a with its float32 mantissa rounded to the element's mantissa bits
            (bits + 2^(22 - mbits), then the mantissa cleared)
    code  = clamp(k, -127, 128) + 127      (E8M0, uint8; 255 where a is NaN)
    q     = elem(x / max(2^(code - 127), 2^-126))       [fp8: x / s clamped to +-F first]
    rceil:  d = a / F;  code = clamp(ceil(log2_f32(d)), -127, 127) + 127 (255 if d is NaN, 254 if Inf)
            q = elem(clamp(x * r, -F, F)),  r = 2^(127 - code), 1 for code 0, d for code 255
    y     = value(q) * 2^(code - 127)      (NaN for code 255)

``elem``: round to nearest, ties to even, saturating (fp6/fp4: torchao's ``_f32_to_floatx_unpacked``).

Where torchao and the OCP spec differ, qgcli follows torchao:

* **Scale code 0 comes back halved.**  A block whose code clamps to 0 (``2^-127``, e.g. e4m3 blocks with
  ``a < 2^-118``) is *quantized* with the scale ``2^-126`` (torchao clamps the float scale to the smallest
  normal float32) but *dequantized* with ``2^-127``: every value of the block comes back at half its size.
  The spec uses ``2^-127`` both ways.  (rceil instead quantizes such blocks with a reciprocal of 1.)
* **rceil takes the ceiling of a float32 log2.**  ``d = a / F`` is rounded to float32, then ``log2`` is rounded
  to float32 before ``ceil``: for ``d`` just above a power of two ``2^k`` (within about ``2^(k-24)*|k|``) the
  rounded log2 is exactly ``k`` and the scale is ``2^k`` instead of ``2^(k+1)``, so the block saturates
  slightly (values up to ``d * 2^-k * F`` are clamped to F).  The spec's cuBLAS recipe rounds up exactly.
  qgcli computes the log2 in float64 and rounds it to float32 (see docs/formats-mx.md for how this
  was checked against torch's vectorised and scalar log2).
* **NaN and Inf.**  A block holding a NaN gets code 255 (the E8M0 NaN) and dequantizes to all NaN.  A block
  holding an Inf (no NaN) is *not* NaN: floor/ceil/even give it the finite code ``255 - emax`` (the Inf
  element saturates to ``F`` and dequantizes to ``F * 2^(128 - emax)``, which overflows to Inf in float32;
  the other elements of the block flush to 0; mxint8, with ``emax = 0``, gets 255 and so a NaN block);
  rceil gives code 254.  The spec leaves Inf/NaN scales to the
  implementation ("X is NaN" for a NaN input).  The element codes of NaN blocks are whatever torchao's
  bit tricks give (reproduced, including fp4's pair packing, which lets a NaN element's stray high bits
  leak into its neighbour's nibble).
* **Saturation.**  With floor (the spec's rule) the largest element can exceed F after scaling (e.g. e4m3:
  ``a / 2^floor(log2 a) * 2^8`` is up to 511.9 > 448): torchao clamps to ``+-F`` before the cast (fp8) or its
  fp6/fp4 cast saturates; the spec also clamps ("normal numbers that exceed ... are clamped").  Inf elements
  saturate the same way.
* **Block sizes.**  torchao blocks only the last dimension, and refuses a block size that does not divide it
  (``AssertionError: the last dimension ... must be divisible by block_size``); qgcli refuses it too
  (:class:`~qgcli.errors.OperandError`), along any ``axis`` (other axes are moved last, as a user would
  before calling torchao).  mxfp4 also needs an even axis length (torchao packs two codes per byte).

mxint8 (OCP v1.0 section 5.3.3 / 6.3, implemented from the spec, no torchao reference): elements are int8
``q`` meaning ``q * 2^-6``; ``q = clamp(round_half_even(64 * x / s), -127, 127)`` with the same scale rules
(``emax = 0``, ``F = 127/64``, mantissa bits 6 for ``even``).  qgcli clamps symmetrically to ``+-127``, the
spec's "max normal" ``+-1 63/64``, so code -128 (-2.0) is never produced; NaN elements give code 0 (their
block is NaN anyway), Inf elements +-127.

Gradient: torchao's MX QAT passes the upstream gradient straight through the dequantized values
(``_MXQuantizedForwardFakeQuantizedBackward.backward`` multiplies ``grad_output`` by the dequantized tensors:
no mask, no scale path), so :func:`mx_fake_quantize_gradient` is the identity.

>>> import numpy as np
>>> x = np.array([[0.3, -1.7, 5.0, 0.02]], np.float32)
>>> r = mx_fake_quantize(x, format="mxfp4", block_size=4)
>>> r.outputs, r.scales, r.quantized
(array([[ 0.5, -1.5,  4. ,  0. ]], dtype=float32), array([[127]], dtype=uint8), array([[ 1, 11,  6,  0]], dtype=uint8))
"""
from typing import NamedTuple

import numpy as np

from qgcli.backend import array_module
from qgcli.errors import OperandError
from qgcli.ops import _small_floats as sf, blocked, native
from qgcli.ops.out_array import as_bytes, check_outs, deliver

_F32 = np.float32
SCALE_MODES = ("floor", "rceil", "ceil", "even")
#: elements per run of blocks on the thread pool (the chain of operations stays in cache)
CHUNK_ELEMENTS = 1 << 15
#: the compiled kernels' runs are this many times longer: one pass and no temporaries (the run, its codes and
#: outputs still fit in L2), and fewer trips through the pool
NATIVE_RUNS = 8


class _Format(NamedTuple):
    kind: str        # "fp8", "fpx", "int8"
    ebits: int
    mbits: int
    emax: int        # torchao's *_MAX_POW2
    max_pos: float   # largest element value F
    float8: str = None


FORMATS = {
    "mxfp8-e4m3": _Format("fp8", 4, 3, 8, 448.0, "float8_e4m3fn"),
    "mxfp8-e5m2": _Format("fp8", 5, 2, 15, 57344.0, "float8_e5m2"),
    "mxfp6-e2m3": _Format("fpx", 2, 3, 2, 7.5),
    "mxfp6-e3m2": _Format("fpx", 3, 2, 4, 28.0),
    "mxfp4": _Format("fpx", 2, 1, 2, 6.0),
    "mxint8": _Format("int8", 0, 6, 0, 127.0 / 64.0),
}
_TABLES = {}
#: format -> its number in the compiled kernels (qg_mx_blocks' fmt: this order) and the scale modes' numbers
_KERNEL_FORMATS = {f: i for i, f in enumerate(FORMATS.values())}
_KERNEL_MODES = {m: i for i, m in enumerate(SCALE_MODES)}


class MXResult(NamedTuple):
    """``outputs`` (float32, the dequantized values), ``scales`` (uint8 E8M0 codes, shaped like the inputs with
    the block axis divided by the block size) and ``quantized`` (the element codes, shaped like the inputs)."""

    outputs: object
    scales: object
    quantized: object


def _format(format):
    f = FORMATS.get(str(format).lower())
    if f is None:
        raise OperandError(f"{format!r} is not one of {', '.join(FORMATS)}", operand="format")
    return f


def _table(fmt):
    key = fmt.float8 or (fmt.ebits, fmt.mbits)
    if key not in _TABLES:
        _TABLES[key] = sf.float8_table(fmt.float8) if fmt.float8 else sf.floatx_to_f32_table(fmt.ebits, fmt.mbits)
    return _TABLES[key]


def check_blocks(shape, axis, block_size, *, operand="inputs", what="block size"):
    """The normalised axis; refuses what torchao refuses (one-line :class:`OperandError`)."""
    if len(shape) == 0:
        raise OperandError("a scalar has no axis to block; give a tensor of rank >= 1", operand=operand)
    if not -len(shape) <= axis < len(shape):
        raise OperandError(f"axis {axis} is out of range for shape {list(shape)}", operand="axis")
    axis %= len(shape)
    if isinstance(block_size, bool) or int(block_size) != block_size or block_size < 1:
        raise OperandError(f"{what} {block_size!r} must be a positive integer", operand="block_size")
    if shape[axis] % block_size:
        raise OperandError(f"axis {axis} of shape {list(shape)} has length {shape[axis]}, not a multiple of the "
                           f"{what} {block_size} (torchao refuses: the last dimension must be divisible by "
                           "block_size)", operand=operand)
    return axis


def _inputs(inputs, name="inputs"):
    xp = array_module(inputs)
    x = xp.asarray(inputs)
    if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
        raise OperandError(f"dtype {x.dtype} is not a real floating type", operand=name)
    if x.dtype.itemsize > 4:
        raise OperandError(f"dtype {x.dtype}: torchao's MX/NVFP4 casts take float32 or bfloat16", operand=name)
    return xp, x.astype(_F32, copy=False)


def _exponent_field(a):
    return ((a.view(np.int32) >> 23) & 0xFF) - 127


def ceil_log2_f32(d, xp=np):
    """``ceil(log2(d))`` with the log2 rounded to float32 first (torch's float32 ``log2``), as float64."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return xp.ceil(xp.log2(d.astype(np.float64)).astype(_F32).astype(np.float64))


def _pow2_f32(n, xp):
    """float32 ``2^n`` for integer arrays ``n`` in [-149, 127]."""
    return xp.ldexp(xp.ones(n.shape, _F32), n.astype(np.int32))


def scale_codes(amax, fmt, scale_mode, xp=np):
    """E8M0 codes (uint8) from the blocks' float32 ``amax`` (floor / ceil / even modes)."""
    a = amax
    if scale_mode == "even":
        bits = a.view(np.int32)
        rounded = ((bits + np.int32(1 << (23 - fmt.mbits - 1))) & np.int32(-(1 << 23))).view(_F32)
        a = xp.where(xp.isnan(amax), amax, rounded)
    e = _exponent_field(a)
    if scale_mode == "ceil":
        e = e + ((a.view(np.int32) & 0x7FFFFF) > 0)
    k = xp.clip(e - fmt.emax, -127, 128)
    return xp.where(xp.isnan(a), np.uint8(255), (k + 127).astype(np.uint8))


def _rceil(amax, fmt, xp):
    with np.errstate(invalid="ignore"):
        d = amax / _F32(fmt.max_pos)
    k = xp.clip(ceil_log2_f32(d, xp), -127, 127)
    with np.errstate(invalid="ignore"):
        code = xp.where(xp.isnan(d), np.uint8(255),
                        xp.where(xp.isinf(d), np.uint8(254), (xp.nan_to_num(k) + 127).astype(np.uint8)))
    n = 127 - code.astype(np.int32)
    r = xp.where(code == 255, d, xp.where(code == 0, _F32(1), _pow2_f32(xp.clip(n, -127, 127), xp)))
    return code, r.astype(_F32)


def _clamp(v, bound, xp):
    # torch.clamp keeps NaN; np.clip does too
    return xp.clip(v, _F32(-bound), _F32(bound))


def _element_codes(v, fmt, xp, has_nan=True):
    if fmt.kind != "int8" and xp is np and not has_nan:
        q = sf.fast_codes(v, fmt.ebits, fmt.mbits)  # fp8: v is clamped to +-F here
        if q is not None:
            return q
    if fmt.kind == "fp8":
        return sf.float8_codes(v, fmt.float8, xp)
    if fmt.kind == "fpx":
        return sf.f32_to_floatx(v, fmt.ebits, fmt.mbits, xp)
    q = xp.rint(v * _F32(64))
    q = xp.where(xp.isnan(q), _F32(0), xp.clip(q, _F32(-127), _F32(127)))
    return q.astype(np.int8)


def _fp4_pack_roundtrip(codes, xp):
    """The per-element codes after torchao's ``pack_uint4`` then ``unpack_uint4`` (pairs along the flat
    order): a code's bits above the nibble (a NaN's) leak into the next code's nibble."""
    flat = codes.reshape(-1)
    lo, hi = flat[0::2], flat[1::2]
    packed = lo | (hi << 4)
    out = xp.empty_like(flat)
    out[0::2] = packed & np.uint8(0xF)
    out[1::2] = packed >> 4
    return out.reshape(codes.shape)


def _quantize_blocks(xb, fmt, scale_mode, xp):
    """(codes, scale codes, outputs) for ``xb`` of shape (blocks, block size)."""
    with np.errstate(invalid="ignore", over="ignore"):
        # max|x| on the bits (a NaN's bits propagate, as in torch.amax(dim=-1); NaN sorts above Inf)
        amax = (xb.view(np.int32) & np.int32(0x7FFFFFFF)).max(axis=1, keepdims=True).view(_F32)
        has_nan = bool(xp.isnan(amax).any())  # only blocks with a NaN amax produce NaN elements
        if scale_mode == "rceil":
            code, r = _rceil(amax, fmt, xp)
            v = _clamp(sf.times_scale(xb, r, xp), fmt.max_pos, xp)
        else:
            code = scale_codes(amax, fmt, scale_mode, xp)
            s = xp.maximum((code.astype(np.int32) << 23).view(_F32), _F32(2.0**-126))
            v = xb / s
            if fmt.kind != "fpx":
                v = _clamp(v, fmt.max_pos, xp)
        q = _element_codes(v, fmt, xp, has_nan)
        if fmt.kind == "fpx" and fmt.ebits + fmt.mbits == 3:
            q = _fp4_pack_roundtrip(q, xp)
        values = (q.astype(_F32) * _F32(2.0**-6)) if fmt.kind == "int8" else xp.take(xp.asarray(_table(fmt)), q)
        s_out = xp.where(code == 255, _F32(np.nan), _pow2_f32(code.astype(np.int32) - 127, xp))
        y = values * s_out
        if has_nan:  # NaN * NaN: the first operand's NaN, as torch's multiply gives it (NumPy's SIMD loops may
            y = xp.where(xp.isnan(values), values, y)  # take either one, by the arrays' alignment)
    return q, code, y


def _run(x, fmt, block_size, axis, scale_mode, xp, out=None):
    axis = check_blocks(x.shape, axis, block_size)
    if fmt.kind == "fpx" and fmt.ebits + fmt.mbits == 3 and x.shape[axis] % 2:
        raise OperandError(f"axis {axis} has odd length {x.shape[axis]}: torchao packs two fp4 codes per byte "
                           "along it (pack_uint4 asserts an even last dimension)", operand="inputs")
    if scale_mode not in SCALE_MODES:
        raise OperandError(f"{scale_mode!r} is not one of {', '.join(SCALE_MODES)}", operand="scale_mode")
    moved = axis != x.ndim - 1
    scale_shape = x.shape[:axis] + (x.shape[axis] // block_size,) + x.shape[axis + 1:]
    outs = check_outs(out, xp, {"outputs": (x.shape, _F32), "scales": (scale_shape, np.uint8),
                                "quantized": (x.shape, _result_q_dtype(fmt, xp))}, (x,))
    xm = xp.ascontiguousarray(xp.moveaxis(x, axis, -1)) if moved else xp.ascontiguousarray(x)
    xb = xm.reshape(-1, block_size)
    if xb.shape[0] == 0:
        q, code, y = (xp.zeros(xb.shape, _q_dtype(fmt)), xp.zeros((0, 1), np.uint8), xp.zeros(xb.shape, _F32))
    elif xp is np:
        # the kernels write straight into the caller's arrays where the blocks lie along the last axis
        into = (as_bytes(outs["quantized"]), outs["scales"], outs["outputs"]) if not moved else (None,) * 3
        q, code, y = _chunked(xb, fmt, scale_mode, into)
    else:
        q, code, y = _quantize_blocks(xb, fmt, scale_mode, xp)
    moved_scales = xm.shape[:-1] + (xm.shape[-1] // block_size,)
    y, q, code = y.reshape(xm.shape), q.reshape(xm.shape), code.reshape(moved_scales)
    if moved:
        y, q, code = (xp.ascontiguousarray(xp.moveaxis(a, -1, axis)) for a in (y, q, code))
    if fmt.float8 and xp is np:
        import ml_dtypes

        q = q.view(getattr(ml_dtypes, fmt.float8))
    return MXResult(deliver(y, outs["outputs"]), deliver(code, outs["scales"]), deliver(q, outs["quantized"]))


def _q_dtype(fmt):
    return np.int8 if fmt.kind == "int8" else np.uint8


def _result_q_dtype(fmt, xp):
    """The dtype of ``quantized`` as the op returns it (float8 through ml_dtypes on NumPy)."""
    if fmt.float8 and xp is np:
        import ml_dtypes

        return getattr(ml_dtypes, fmt.float8)
    return _q_dtype(fmt)


def _chunked(xb, fmt, scale_mode, into=(None, None, None)):
    """:func:`_quantize_blocks` over cache-sized runs of blocks, on the thread pool (NumPy), each run in one
    call of the compiled kernels where they are built (the same bits; a run with a NaN block is redone in
    NumPy, whose bit tricks give its NaN codes).  ``into``: arrays to write the codes (as bytes), the scale
    codes and the outputs into, each C-contiguous with as many elements (None: a new array)."""
    nb, bs = xb.shape
    q = np.empty(xb.shape, _q_dtype(fmt)) if into[0] is None else into[0].view(_q_dtype(fmt)).reshape(xb.shape)
    code = np.empty((nb, 1), np.uint8) if into[1] is None else into[1].reshape(nb, 1)
    y = np.empty(xb.shape, _F32) if into[2] is None else into[2].reshape(xb.shape)
    lib = native.library()
    step = max(1, CHUNK_ELEMENTS * (NATIVE_RUNS if lib is not None else 1) // bs)
    if fmt.kind == "fpx" and fmt.ebits + fmt.mbits == 3 and bs % 2:
        step += step % 2  # fp4 pairs must not straddle two runs
    if lib is not None:
        x_at, q_at, code_at, y_at = (native.address(a, a.dtype) for a in (xb, q, code, y))
        kernel_format, kernel_mode = _KERNEL_FORMATS[fmt], _KERNEL_MODES[scale_mode]

    def one(start):
        stop = min(start + step, nb)
        if lib is not None and not lib.qg_mx_blocks(x_at + 4 * start * bs, q_at + start * bs, code_at + start,
                                                    y_at + 4 * start * bs, stop - start, bs, kernel_format,
                                                    kernel_mode):
            return
        q[start:stop], code[start:stop], y[start:stop] = _quantize_blocks(xb[start:stop], fmt, scale_mode, np)

    blocked._map(one, range(0, nb, step))
    return q, code, y


def element_values(format):
    """The finite values an element of ``format`` can take, sorted (float64): the grid onto which a block's
    inputs divided by its scale are rounded.

    >>> element_values("mxfp4")[7:].tolist()
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    """
    fmt = _format(format)
    if fmt.kind == "int8":
        return np.arange(-127, 128) / 64.0
    with np.errstate(invalid="ignore"):
        table = np.asarray(_table(fmt), np.float64)[: 256 if fmt.float8 else 1 << (1 + fmt.ebits + fmt.mbits)]
    return np.unique(table[np.isfinite(table) & (np.abs(table) <= fmt.max_pos)]) + 0.0  # -0 as 0


def mx_fake_quantize(inputs, *, format="mxfp8-e4m3", block_size=32, axis=-1, scale_mode="floor", out=None):
    """MX fake quantization of ``inputs`` (float32 or bfloat16): torchao 0.18's ``to_mx(inputs, elem_dtype,
    block_size, scaling_mode)`` followed by ``to_dtype(..., torch.float32)`` along ``axis``.

    Returns an :class:`MXResult` ``(outputs, scales, quantized)``: float32 dequantized values, the uint8 E8M0
    codes (block axis divided by ``block_size``), the element codes (float8 through ml_dtypes on NumPy,
    fp6/fp4 as uint8 codes one per element, int8 for mxint8).  ``out``: arrays to write them into (an earlier
    result of the same shapes, or ``(outputs, scales, quantized)`` with None for a new array), so that a
    caller quantizing tensor after tensor reuses its buffers: no fresh pages to fault in (a fresh 103 MB
    array costs about as much as copying it); the result holds those arrays.

    >>> import numpy as np
    >>> r = mx_fake_quantize(np.array([1.0, 3.0, 100.0, -500.0], np.float32), block_size=4)
    >>> r.outputs, r.scales
    (array([   1.,    3.,   96., -448.], dtype=float32), array([127], dtype=uint8))
    """
    fmt = _format(format)
    xp, x = _inputs(inputs)
    return _run(x, fmt, block_size, axis, str(scale_mode).lower(), xp, out)


def mx_fake_quantize_gradient(gradients, inputs=None, *, format="mxfp8-e4m3", block_size=32, axis=-1,
                              scale_mode="floor"):
    """The input gradient of MX fake quantization: the upstream ``gradients`` unchanged, as a new float32 array
    (torchao's MX QAT straight-through estimator).  With ``inputs`` the options are checked as the forward
    checks them and the shapes must match.

    >>> import numpy as np
    >>> mx_fake_quantize_gradient(np.array([0.5, -1.0], np.float32), block_size=2)
    array([ 0.5, -1. ], dtype=float32)
    """
    xp, g = _inputs(gradients, "gradients")
    _format(format)
    if str(scale_mode).lower() not in SCALE_MODES:
        raise OperandError(f"{scale_mode!r} is not one of {', '.join(SCALE_MODES)}", operand="scale_mode")
    if inputs is not None:
        x = xp.asarray(inputs)
        if tuple(x.shape) != tuple(g.shape):
            raise OperandError(f"shape {list(g.shape)} differs from inputs shape {list(x.shape)}",
                               operand="gradients")
        check_blocks(x.shape, axis, block_size)
    else:
        check_blocks(g.shape, axis, block_size, operand="gradients")
    return g.astype(_F32, copy=True)
