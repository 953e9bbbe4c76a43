"""NVFP4 fake quantization as torchao 0.18 computes it: ``NVFP4Tensor.to_nvfp4(x, per_tensor_scale=...)``
followed by ``.dequantize(torch.float32)`` (``torchao/prototype/mx_formats/nvfp4_tensor.py``, eager, CPU,
``use_triton_kernel=False``).  Pure NumPy/CuPy; torch is never imported.

Blocks of 16 consecutive elements along ``axis`` (torchao: the last dimension, which must be a multiple of 16),
fp4 e2m1 elements (largest value 6), float8 e4m3fn block scales, and (``per_tensor_scale=True``, torchao's
``NVFP4FakeQuantizeConfig(use_per_tensor_scale=True)`` default) a float32 per-tensor scale from the tensor's
amax.  Every step is one float32 operation, in torchao's order (``b = max|block|``, ``c8`` = round to e4m3fn,
ties to even; ``clamp`` keeps NaN)::

    per-tensor:   t  = max|x| / 2688                         (2688 = 448 * 6: per_tensor_amax_to_scale)
                  s8 = c8(clamp((b / 6) / t, 2^-6, 448));    r = (1 / t) / s8
                  y  = fp4(clamp(x * r, -6, 6)) * (t * s8)
    block only:   s8 = c8(clamp(b / 6, 2^-6, 448));          r = 1 / s8
                  y  = fp4(clamp(x * r, -6, 6)) * s8

(``fp4``: round to the e2m1 grid, nearest, ties to even: torchao's ``f32_to_f4_unpacked``.)  The reciprocal
is taken first and multiplied, as torchao does to match its Triton kernel: it is not the same as dividing
by the scale (one more rounding).

With the per-tensor scale on, torchao turns the whole tensor into NaN when ``t`` is 0, NaN or Inf: an
all-zero tensor (``0 / 0`` block scales), one holding a NaN, or one holding an Inf (``t = Inf``: every element
is ``0 * Inf``); when ``t`` is so small that ``1 / t`` overflows (amax below about ``7.9e-36``) its zeros
become NaN (``0 * Inf``).  qgcli follows it and emits a :class:`RuntimeWarning` saying how many outputs became
NaN.  Without the per-tensor scale an all-zero block gets the smallest scale ``2^-6`` and comes back as zeros;
a block holding a NaN comes back all NaN (its scale is NaN), without a warning.

``quantized``: the fp4 codes *unpacked*, one uint8 per element (the code in the low nibble, sign in bit 3),
shaped like the inputs; torchao stores them packed two per byte along the last dimension, element ``2i`` in
the low nibble (:func:`pack_fp4` gives that layout).  Codes of NaN elements are what torchao's bit tricks give
(after its pack/unpack round trip).

Gradient: torchao's NVFP4 QAT (``_NVFP4QuantizedForwardFakeQuantizedBackward.backward``) multiplies the
upstream gradient by the dequantized tensors: the straight-through identity, :func:`nvfp4_fake_quantize_gradient`.

>>> import numpy as np
>>> x = np.linspace(-3, 3, 16, dtype=np.float32).reshape(1, 16)
>>> r = nvfp4_fake_quantize(x)
>>> r.outputs[0, :6], r.tensor_scale
(array([-3. , -3. , -2. , -2. , -1.5, -1. ], dtype=float32), array(0.00111607, dtype=float32))
>>> r.block_scales.view(np.uint8), r.quantized[0, :6]
(array([[126]], dtype=uint8), array([15, 15, 14, 14, 13, 12], dtype=uint8))
"""
import warnings
from typing import NamedTuple

import numpy as np

from qgcli.errors import OperandError
from qgcli.ops import _small_floats as sf, blocked, native
from qgcli.ops import mx
from qgcli.ops.mx import _fp4_pack_roundtrip, _inputs, check_blocks
from qgcli.ops.out_array import as_bytes, check_outs, deliver

_F32 = np.float32
BLOCK_SIZE = 16
#: the per-tensor amax pass splits a tensor over the thread pool in runs of at least this many elements
AMAX_RUN = 1 << 20
_E4M3_EPS = _F32(2.0**-6)  # torch.finfo(torch.float8_e4m3fn).tiny
_FP4_TABLE = sf.floatx_to_f32_table(2, 1)
_E4M3_TABLE = None


class NVFP4Result(NamedTuple):
    """``outputs`` (float32), ``block_scales`` (float8 e4m3fn, ml_dtypes on NumPy; uint8 bytes on CuPy; block
    axis divided by 16), ``tensor_scale`` (0-d float32, or None without the per-tensor scale) and
    ``quantized`` (uint8 fp4 codes, unpacked, shaped like the inputs)."""

    outputs: object
    block_scales: object
    tensor_scale: object
    quantized: object


def _e4m3_table():
    global _E4M3_TABLE
    if _E4M3_TABLE is None:
        _E4M3_TABLE = sf.float8_table("float8_e4m3fn")
    return _E4M3_TABLE


def pack_fp4(codes, axis=-1):
    """torchao's packed layout of unpacked fp4 ``codes``: two per byte along ``axis``, element ``2i`` in the
    low nibble (the axis length must be even)."""
    c = np.moveaxis(np.asarray(codes, np.uint8), axis, -1)
    if c.shape[-1] % 2:
        raise OperandError(f"axis length {c.shape[-1]} is odd: fp4 codes pack in pairs", operand="quantized")
    packed = (c[..., 0::2] & 0xF) | (c[..., 1::2] << 4)
    return np.moveaxis(packed, -1, axis)


def _tensor_scale(x, xp):
    return tensor_scale_of(tensor_amax(x, xp), xp)


def tensor_scale_of(amax, xp=np):
    """The per-tensor scale of a tensor's ``amax`` (:func:`tensor_amax`): ``amax / 2688`` in float32, 0-d."""
    with np.errstate(invalid="ignore"):
        return xp.asarray(xp.asarray(amax, _F32) / _F32(448.0 * 6.0), dtype=_F32).reshape(())


def combined_amax(amaxes):
    """The amax of a tensor from those of its parts (:func:`tensor_amax` of each): the largest, NaN where one is
    (torch's max), so a tensor streamed in blocks gets the per-tensor scale of the whole."""
    with np.errstate(invalid="ignore"):
        return sf.nan_as_torch_max(np.max(np.asarray(amaxes, _F32))) if len(amaxes) else _F32(0)


def tensor_amax(x, xp=np):
    """``max |x|`` as torch's ``max(abs(x))`` gives it (NaN as torch's all-ones NaN), float32; 0 for an empty
    tensor."""
    x = xp.asarray(x)
    lib = native.for_arrays(xp, x) if x.size and x.dtype == _F32 else None
    with np.errstate(invalid="ignore"):
        if lib is not None:  # one pass, no |x| temporary: max |x| on the bits (the same value, NaN aside)
            at, n = native.address(x, _F32), x.size
            step = max(AMAX_RUN, -(-n // blocked.workers()))  # a run per thread: the pass is a read of the tensor
            bits = blocked._map(lambda start: lib.qg_amax_bits(at + 4 * start, min(step, n - start)),
                                range(0, n, step))
            amax = sf.nan_as_torch_max(np.array(max(bits), np.uint32).view(_F32))  # NaN's bits sort above Inf's
        else:
            amax = sf.nan_as_torch_max(xp.max(xp.abs(x)), xp) if x.size else _F32(0)
        return xp.asarray(amax, _F32).reshape(())


def nvfp4_fake_quantize(inputs, *, per_tensor_scale=True, axis=-1, out=None, tensor_scale=None, warn=True):
    """NVFP4 fake quantization of ``inputs`` (float32 or bfloat16): torchao 0.18's
    ``NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(max|x|)).dequantize(torch.float32)``
    (``per_tensor_scale=False``: no per-tensor scale), blocks of 16 along ``axis``.

    Returns an :class:`NVFP4Result` ``(outputs, block_scales, tensor_scale, quantized)``.  ``out``: arrays to write
    ``outputs``, ``block_scales`` and ``quantized`` into (an earlier result of the same shapes, or a sequence of
    those three, None for a new array), as :func:`qgcli.ops.mx.mx_fake_quantize` takes them.  ``tensor_scale``:
    the per-tensor scale of the whole tensor when ``inputs`` is a part of it (blocks of a tensor streamed from
    disk, :func:`tensor_scale_of` of their :func:`combined_amax`) instead of the part's own.  Warns
    (``RuntimeWarning``) where torchao's per-tensor scale makes every output NaN, unless ``warn`` is false (a
    block of a tensor whose caller counts the NaN itself: no process-wide warning filter to change on a thread).

    >>> import numpy as np
    >>> r = nvfp4_fake_quantize(np.full((1, 16), 0.7, np.float32), per_tensor_scale=False)
    >>> float(r.outputs[0, 0]), int(r.quantized[0, 0])
    (0.703125, 7)
    """
    xp, x = _inputs(inputs)
    axis = check_blocks(x.shape, axis, BLOCK_SIZE, what="NVFP4 block size")
    moved = axis != x.ndim - 1
    scale_shape = x.shape[:axis] + (x.shape[axis] // BLOCK_SIZE,) + x.shape[axis + 1:]
    outs = check_outs(out, xp, {"outputs": (x.shape, _F32), "block_scales": (scale_shape, _scale_dtype(xp)),
                                "quantized": (x.shape, np.uint8)}, (x,))
    xm = xp.ascontiguousarray(xp.moveaxis(x, axis, -1)) if moved else xp.ascontiguousarray(x)
    xb = xm.reshape(-1, BLOCK_SIZE)
    t = None if not per_tensor_scale else _tensor_scale(x, xp) if tensor_scale is None else \
        xp.asarray(tensor_scale, _F32).reshape(())
    inv_t = None
    if t is not None:
        with np.errstate(all="ignore"):
            inv_t = (_F32(1) / t).astype(_F32)
    if xp is np and xb.shape[0] > 1:
        # the kernels write straight into the caller's arrays where the blocks lie along the last axis
        into = (outs["quantized"], as_bytes(outs["block_scales"]), outs["outputs"]) if not moved else (None,) * 3
        q, s8, y = _chunked(xb, t, inv_t, into)
    else:
        q, s8, y = _quantize_blocks(xb, t, inv_t, xp)
    if warn and t is not None and not (bool(xp.isfinite(t)) and bool(t > 0) and bool(xp.isfinite(inv_t))):
        introduced = int(xp.count_nonzero(xp.isnan(y) & ~xp.isnan(xb)))
        if introduced:
            warnings.warn(f"NVFP4 per-tensor scale {float(t)!r} (tensor amax / 2688) is zero, NaN, infinite or too "
                          f"small to invert: torchao's to_nvfp4(...).dequantize() gives NaN for {introduced} of "
                          f"{y.size} elements whose input is not NaN"
                          f"{' (every output is NaN)' if bool(xp.isnan(y).all()) else ''}; qgcli does the same "
                          "(per_tensor_scale=False avoids it)", RuntimeWarning, stacklevel=2)
    moved_scales = xm.shape[:-1] + (xm.shape[-1] // BLOCK_SIZE,)
    y, q, s8 = y.reshape(xm.shape), q.reshape(xm.shape), s8.reshape(moved_scales)
    if moved:
        y, q, s8 = (xp.ascontiguousarray(xp.moveaxis(a, -1, axis)) for a in (y, q, s8))
    s8 = s8.view(_scale_dtype(xp))
    return NVFP4Result(deliver(y.astype(_F32, copy=False), outs["outputs"]), deliver(s8, outs["block_scales"]), t,
                       deliver(q, outs["quantized"]))


def _scale_dtype(xp):
    """``block_scales``' dtype as the op returns it: float8 e4m3fn through ml_dtypes on NumPy, bytes on CuPy."""
    if xp is not np:
        return np.uint8
    import ml_dtypes

    return ml_dtypes.float8_e4m3fn


def _quantize_blocks(xb, t, inv_t, xp):
    """(codes, e4m3 scale bytes, outputs) of blocks ``xb`` (blocks, 16), in torchao's float32 steps."""
    with np.errstate(all="ignore"):
        bmax = (xb.view(np.int32) & np.int32(0x7FFFFFFF)).max(axis=1, keepdims=True).view(_F32) if xb.size \
            else xp.zeros((0, 1), _F32)
        bscale = bmax / _F32(6)
        if t is not None:
            bscale = bscale / t
        s8 = sf.float8_codes(xp.clip(bscale, _E4M3_EPS, _F32(448)), "float8_e4m3fn", xp)
        s32 = xp.take(xp.asarray(_e4m3_table()), s8)
        r = (inv_t / s32) if t is not None else (_F32(1) / s32) * _F32(1)
        v = xp.clip(sf.times_scale(xb, r, xp), _F32(-6), _F32(6))
        q = sf.fast_codes(v, 2, 1) if xp is np and not bool(xp.isnan(r).any()) else None
        if q is None:  # NaN elements: torchao's bit operations, and its pack/unpack round trip
            q = _fp4_pack_roundtrip(sf.f32_to_floatx(v, 2, 1, xp), xp)
        y = xp.take(xp.asarray(_FP4_TABLE), q) * ((t * s32) if t is not None else s32)
    return q, s8, y


def _chunked(xb, t, inv_t, into=(None, None, None)):
    """:func:`_quantize_blocks` over cache-sized runs of blocks on the thread pool (NumPy), each run in one
    call of the compiled kernels where they are built and the per-tensor scale is usable (the same bits; a
    run with a NaN block or an infinite reciprocal scale is redone in NumPy).  ``into``: arrays for the codes,
    the scale bytes and the outputs (C order, as many elements; None: a new array)."""
    nb = xb.shape[0]
    q = np.empty(xb.shape, np.uint8) if into[0] is None else into[0].reshape(xb.shape)
    s8 = np.empty((nb, 1), np.uint8) if into[1] is None else into[1].reshape(nb, 1)
    y = np.empty(xb.shape, _F32) if into[2] is None else into[2].reshape(xb.shape)
    lib = native.library()
    if t is not None and not (np.isfinite(t) and t > 0 and np.isfinite(inv_t)):
        lib = None  # every output NaN, or its zeros: the NumPy path's business
    step = max(1, mx.CHUNK_ELEMENTS * (mx.NATIVE_RUNS if lib is not None else 1) // BLOCK_SIZE)
    if lib is not None:
        x_at, q_at, s8_at, y_at = (native.address(a, a.dtype) for a in (xb, q, s8, y))
        scales = (1, float(t), float(inv_t)) if t is not None else (0, 1.0, 1.0)

    def one(start):
        stop = min(start + step, nb)
        if lib is not None and not lib.qg_nvfp4_blocks(x_at + 4 * start * BLOCK_SIZE, q_at + start * BLOCK_SIZE,
                                                       s8_at + start, y_at + 4 * start * BLOCK_SIZE, stop - start,
                                                       *scales):
            return
        q[start:stop], s8[start:stop], y[start:stop] = _quantize_blocks(xb[start:stop], t, inv_t, np)

    blocked._map(one, range(0, nb, step))
    return q, s8, y


def nvfp4_fake_quantize_gradient(gradients, inputs=None, *, per_tensor_scale=True, axis=-1):
    """The input gradient of NVFP4 fake quantization: the upstream ``gradients`` unchanged, as a new float32
    array (torchao's NVFP4 QAT straight-through estimator); with ``inputs`` the shapes must match.

    >>> import numpy as np
    >>> nvfp4_fake_quantize_gradient(np.ones((1, 16), np.float32)).shape
    (1, 16)
    """
    xp, g = _inputs(gradients, "gradients")
    shape = g.shape
    if inputs is not None:
        x = xp.asarray(inputs)
        if tuple(x.shape) != tuple(shape):
            raise OperandError(f"shape {list(shape)} differs from inputs shape {list(x.shape)}",
                               operand="gradients")
    check_blocks(shape, axis, BLOCK_SIZE, operand="inputs" if inputs is not None else "gradients",
                 what="NVFP4 block size")
    return g.astype(_F32, copy=True)
