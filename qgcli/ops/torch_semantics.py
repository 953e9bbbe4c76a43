"""PyTorch's fake-quantize ops and their gradients, as PyTorch 2.13's x86-64 CPU kernels compute them.

PyTorch takes the grid as ``(scale, zero_point, quant_min, quant_max)`` directly: there is no nudging.
Where TensorFlow clamps the float input to nudged bounds and rounds ``floor(v + 0.5)``, PyTorch rounds
first (``nearbyint``: half to even) and tests the *rounded integer* against ``[quant_min, quant_max]``
(inclusive), so an element up to half a step outside the range still passes its gradient
(peers.md §1b, pytorch/pytorch#38600).

Operation by operation, in float32 (``inv_scale = 1.0f / scale``)::

    per tensor (integer zero point z):       q = z + nearbyint(x * inv_scale)            (float, not cast)
    per channel, integer zero point:         q = (int64)(z + nearbyint(x * inv_scale))
    per channel, float zero point:           q = lrintf(z + x * inv_scale)               (z added first)
    output = (clamp(q, quant_min, quant_max) - z) * scale;   mask = quant_min <= q <= quant_max
    straight-through gradient:               dx = dy * mask

The learnable ops (``torch._fake_quantize_learnable_per_{tensor,channel}_affine``, LSQ as PyTorch
implements it) take a float zero point, round it (per tensor: ``nearbyint`` in the forward but
``(int64)(z + 0.5)`` in the backward, pytorch/pytorch#52038; per channel: ``round`` = half to even in
both) and give, per element, with ``q = nearbyint(z + x * inv_scale)`` and ``x_fq = (clamp(q) - z) * s``::

    quant_min <= q <= quant_max:  dx = dy,  dscale = dy * (x_fq - x) * inv_scale * grad_factor,  dz = 0
    q < quant_min:                dx = 0,   dscale = dy * (quant_min - z) * grad_factor,  dz = -dy * s * grad_factor
    q > quant_max:                dx = 0,   dscale = dy * (quant_max - z) * grad_factor,  dz = -dy * s * grad_factor

summed over the tensor (per tensor) or over all axes but ``axis`` (per channel).

Details reproduced because they change bits: PyTorch's AVX2/AVX-512 kernels (what any x86-64 CPU of the
last decade runs) fuse ``z + x * inv_scale`` and ``x_fq - x`` into single-rounding multiply-adds;
``fma=False`` gives the non-FMA ``ATEN_CPU_CAPABILITY=default`` kernels instead.  A cast of NaN, an
infinity or a value beyond int64 to an integer gives INT64_MIN on x86, so in the per-channel kernels and
the learnable backward such elements count as *below* the grid (per-tensor forward: NaN -> quant_min,
+inf -> quant_max).  A float zero point given to the per-tensor op is truncated toward zero, as PyTorch's
``zero_point.item().toInt()`` does (pytorch/pytorch#167465).  The summed scale / zero-point gradients are
accumulated in float64 and rounded once, so they agree with PyTorch to float32 summation error, not bit for
bit (PyTorch's own order depends on its vectorisation and thread count).

What PyTorch computes without complaint but cannot mean (scale <= 0, NaN or infinite, ``1/scale``
overflowing) is refused with an :class:`~qgcli.errors.OperandError`, as are the cases PyTorch refuses
(``quant_min > quant_max``, an integer zero point outside the grid, learnable gradients with a grid that
does not contain 0).
"""
import numpy as np

from qgcli.backend import array_module, to_numpy
from qgcli.errors import OperandError
from qgcli.ops import fake_quant as fq
from qgcli.ops.estimators import Quantized
from qgcli.ops.fake_quant import _normalise_axis, _quiet, as_float32

_F32 = np.float32
_F64 = np.float64
_INT64_MIN = float(-(2**63))
_TWO63 = float(2**63)
_QUANT_LIMIT = 2**24  # grid integers stay exact in float32 below this


# --- validation ---------------------------------------------------------------------------------------

def check_quant_range(quant_min, quant_max):
    """``(quant_min, quant_max)`` as ints; PyTorch refuses ``quant_min > quant_max``."""
    out = []
    for name, value in (("quant_min", quant_min), ("quant_max", quant_max)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise OperandError(f"must be an integer, got {value!r}", operand=name)
        if not -_QUANT_LIMIT <= int(value) <= _QUANT_LIMIT:
            raise OperandError(f"{value} is outside [-2**24, 2**24]", operand=name)
        out.append(int(value))
    if out[0] > out[1]:
        raise OperandError(f"{out[0]} is above quant_max {out[1]} (PyTorch: `quant_min` should be less than or "
                           "equal to `quant_max`)", operand="quant_min")
    return out[0], out[1]


def _check_scale(scale, rank):
    s = np.asarray(to_numpy(scale))
    if s.dtype.kind not in "fiu" and s.dtype.name != "bfloat16":
        raise OperandError(f"dtype {s.dtype} is not a real number type", operand="scale")
    if s.ndim != rank:
        raise OperandError(f"must be rank {rank} but is rank {s.ndim} (shape {list(s.shape)})", operand="scale")
    if rank and s.dtype.name not in ("float32", "bfloat16"):
        # PyTorch's per-tensor ops take any float scale as a double; its per-channel kernels refuse the others.
        found = {"float64": "Double", "float16": "Half"}.get(s.dtype.name, s.dtype.name)
        raise OperandError(f"is {s.dtype}: PyTorch's per-channel fake quant refuses it (Scale must be Float or "
                           f"BFloat16, found {found}); store the scale as float32", operand="scale")
    s32 = s.astype(_F32)
    with np.errstate(all="ignore"):
        inv = _F32(1) / s32
    bad = ~(np.isfinite(s32) & (s32 > 0) & np.isfinite(inv))
    if bad.any():
        i = int(np.argmax(bad.reshape(-1)))
        at = f" at channel {i}" if rank else ""
        raise OperandError(f"is {float(s32.reshape(-1)[i])!r}{at}; a scale must be positive and finite, with a finite "
                           "1/scale (PyTorch would return meaningless values)", operand="scale")
    return s32


def _check_zero_point(zero_point, scale, quant_min, quant_max, *, integer_check):
    z = np.asarray(to_numpy(zero_point))
    if z.dtype.kind not in "fiu" and z.dtype.name != "bfloat16":
        raise OperandError(f"dtype {z.dtype} is not a real number type", operand="zero_point")
    if z.shape != scale.shape:
        raise OperandError(f"shape {list(z.shape)} differs from scale shape {list(scale.shape)}", operand="zero_point")
    is_int = z.dtype.kind in "iu"
    if not is_int:
        zf = z.astype(_F32)
        if not np.isfinite(zf).all():
            raise OperandError("must be finite", operand="zero_point")
        return zf, False
    if integer_check:
        outside = (z < quant_min) | (z > quant_max)
        if outside.any():
            i = int(np.argmax(outside.reshape(-1)))
            raise OperandError(f"{int(z.reshape(-1)[i])} is outside [quant_min, quant_max] = [{quant_min}, {quant_max}] "
                               "(PyTorch: `zero_point` must be between `quant_min` and `quant_max`)",
                               operand="zero_point")
    return z.astype(_F64).astype(_F32), True


def _check_learnable_range(quant_min, quant_max):
    if not quant_min <= 0 <= quant_max:
        raise OperandError(f"PyTorch's learnable fake-quant gradients need quant_min <= 0 <= quant_max, got "
                           f"[{quant_min}, {quant_max}]", operand="quant_min")


def _channel_params(x, arrays, axis, xp):
    """Reshape per-channel parameters to broadcast along ``axis`` of ``x``; check their length."""
    depth = x.shape[axis]
    shape = [1] * x.ndim
    shape[axis] = depth
    out = []
    for name, a in arrays:
        if a.shape[0] != depth:
            raise OperandError(f"has {a.shape[0]} entries but inputs have {depth} channels on axis {axis}",
                               operand=name)
        out.append(xp.asarray(a).reshape(shape))
    return out


def _inputs(inputs, gradients=None):
    xp = array_module(inputs, gradients) if gradients is not None else array_module(inputs)
    x = as_float32(inputs, "inputs", xp)
    if gradients is None:
        return xp, x, None
    g = as_float32(gradients, "gradients", xp)
    if g.shape != x.shape:
        raise OperandError(f"shape {list(g.shape)} differs from inputs shape {list(x.shape)}", operand="gradients")
    return xp, x, g


# --- arithmetic helpers (any array module) ------------------------------------------------------------

def fma32(a, b, c, xp=None):
    """``a * b + c`` rounded once to float32, as an FMA instruction gives it.

    The product of two float32 values is exact in float64; the sum is rounded to odd (TwoSum error term)
    so that the final rounding to float32 is correct, not a double rounding.

    >>> float(fma32(np.float32(1 + 2**-12), np.float32(1 + 2**-12), np.float32(-1)))
    0.0004883408546447754
    """
    xp = xp or array_module(a, b, c)
    with _quiet(xp):
        p = xp.asarray(a, dtype=_F64) * xp.asarray(b, dtype=_F64)
        c64 = xp.asarray(c, dtype=_F64)
        s = p + c64
        bb = s - p
        err = (p - (s - bb)) + (c64 - bb)
        odd = (s.view(xp.int64) & 1) == 1
        fix = (err != 0) & xp.isfinite(err) & ~odd
        if bool(fix.any()):
            s = xp.where(fix, xp.nextafter(s, xp.where(err > 0, xp.inf, -xp.inf)), s)
        return s.astype(_F32)


def _x86_int64(v, xp):
    """The value of ``(int64_t)v`` / ``lrintf`` on x86-64 for an already-rounded float: NaN, infinities and
    out-of-range values become INT64_MIN (the 'integer indefinite'); returned as float64."""
    v64 = v.astype(_F64)
    with _quiet(xp):
        ok = xp.isfinite(v64) & (v64 >= -_TWO63) & (v64 < _TWO63)
    return xp.where(ok, v64, _INT64_MIN)


def _scaled_product(a, b, xp):
    return xp.multiply(a, b, dtype=_F32)


# --- forward kernels ----------------------------------------------------------------------------------

def _per_tensor_q(x, inv, z, xp):
    """PyTorch's per-tensor ``qval_f = z + nearbyint(x * inv_scale)``, kept in float32 (no integer cast)."""
    with _quiet(xp):
        return xp.add(_F32(z), xp.rint(xp.multiply(x, inv, dtype=_F32)), dtype=_F32)


def _per_channel_q(x, inv, z, z_is_int, xp, fma):
    """PyTorch's per-channel integer ``qval`` (as float64): the int and the float zero-point kernels."""
    with _quiet(xp):
        if z_is_int:
            t = xp.add(z, xp.rint(xp.multiply(x, inv, dtype=_F32)), dtype=_F32)
        else:
            t = xp.rint(fma32(x, inv, z, xp) if fma else xp.add(z, xp.multiply(x, inv, dtype=_F32), dtype=_F32))
    return _x86_int64(t, xp)


def _dequantize(q, z, s, quant_min, quant_max, xp):
    """``(clamp(q, quant_min, quant_max) - z) * s`` computed exactly in float64, rounded once to float32
    (what both the float and the double code paths of PyTorch's kernels amount to)."""
    with _quiet(xp):
        c = xp.fmin(xp.fmax(q.astype(_F64), float(quant_min)), float(quant_max))
        return ((c - xp.asarray(z, dtype=_F64)) * xp.asarray(s, dtype=_F64)).astype(_F32)


def _mask(q, quant_min, quant_max):
    return (q >= quant_min) & (q <= quant_max)


def _per_tensor_zero_point(z32, z_is_int):
    # PyTorch's tensor-qparams path reads a float zero point with .toInt(): truncation toward zero.
    return float(z32) if z_is_int else float(np.trunc(z32))


def _forward_per_tensor(x, scale, zero_point, quant_min, quant_max, xp):
    quant_min, quant_max = check_quant_range(quant_min, quant_max)
    s = _check_scale(scale, 0)
    z32, z_is_int = _check_zero_point(zero_point, s, quant_min, quant_max, integer_check=True)
    z = _per_tensor_zero_point(z32, z_is_int)
    inv = _F32(1) / s
    q = _per_tensor_q(x, inv, z, xp)
    return _dequantize(q, _F64(z), s, quant_min, quant_max, xp), _mask(q, quant_min, quant_max)


def _forward_per_channel(x, scale, zero_point, axis, quant_min, quant_max, xp, fma):
    quant_min, quant_max = check_quant_range(quant_min, quant_max)
    axis = _normalise_axis(axis, x.ndim)
    s = _check_scale(scale, 1)
    z32, z_is_int = _check_zero_point(zero_point, s, quant_min, quant_max, integer_check=True)
    s_b, z_b = _channel_params(x, (("scale", s), ("zero_point", z32)), axis, xp)
    inv_b = _F32(1) / s_b
    q = _per_channel_q(x, inv_b, z_b, z_is_int, xp, fma)
    return _dequantize(q, z_b, s_b, quant_min, quant_max, xp), _mask(q, quant_min, quant_max)


# --- the public ops -----------------------------------------------------------------------------------

def fake_quantize_per_tensor_affine(inputs, scale, zero_point, quant_min, quant_max):
    """``torch.fake_quantize_per_tensor_affine``: round half to even, clamp on the integer grid.

    ``scale`` and ``zero_point`` are scalars (0-d); an integer ``zero_point`` must lie in the grid.

    >>> fake_quantize_per_tensor_affine(np.array([0.5, 1.5, 2.5, 300.0], np.float32), 1.0, 0, -128, 127)
    array([  0.,   2.,   2., 127.], dtype=float32)
    """
    xp, x, _ = _inputs(inputs)
    return _forward_per_tensor(x, scale, np.asarray(zero_point), quant_min, quant_max, xp)[0]


def fake_quantize_per_tensor_affine_gradient(gradients, inputs, scale, zero_point, quant_min, quant_max):
    """The straight-through gradient of ``fake_quantize_per_tensor_affine``: ``gradients * mask``, the mask
    testing the rounded integer ``quant_min <= z + nearbyint(x / scale) <= quant_max``.

    >>> fake_quantize_per_tensor_affine_gradient(np.ones(3, np.float32), np.array([-0.4, -0.6, 3.4], np.float32),
    ...                                          1.0, 0, 0, 3)
    array([1., 0., 1.], dtype=float32)
    """
    xp, x, g = _inputs(inputs, gradients)
    mask = _forward_per_tensor(x, scale, np.asarray(zero_point), quant_min, quant_max, xp)[1]
    with _quiet(xp):
        return xp.multiply(g, mask, dtype=_F32)


def fake_quantize_per_channel_affine(inputs, scale, zero_point, axis, quant_min, quant_max, *, fma=True):
    """``torch.fake_quantize_per_channel_affine``: one ``(scale, zero_point)`` per entry of ``axis``.

    An integer ``zero_point`` is added after rounding; a float one before (``lrintf(z + x / s)``).

    >>> fake_quantize_per_channel_affine(np.array([[0.5, 0.5], [1.5, 1.5]], np.float32),
    ...                                  np.array([1.0, 0.5], np.float32), np.array([0, 1], np.int32), 1, 0, 255)
    array([[0. , 0.5],
           [2. , 1.5]], dtype=float32)
    """
    xp, x, _ = _inputs(inputs)
    return _forward_per_channel(x, scale, zero_point, axis, quant_min, quant_max, xp, fma)[0]


def fake_quantize_per_channel_affine_gradient(gradients, inputs, scale, zero_point, axis, quant_min, quant_max, *,
                                              fma=True):
    """The straight-through gradient of ``fake_quantize_per_channel_affine``: ``gradients * mask``."""
    xp, x, g = _inputs(inputs, gradients)
    mask = _forward_per_channel(x, scale, zero_point, axis, quant_min, quant_max, xp, fma)[1]
    with _quiet(xp):
        return xp.multiply(g, mask, dtype=_F32)


def _learnable_zero_point_forward(zero_point, quant_min, quant_max):
    z = np.asarray(to_numpy(zero_point)).astype(_F32)
    if not np.isfinite(z).all():
        raise OperandError("must be finite", operand="zero_point")
    return np.clip(np.rint(z), quant_min, quant_max).astype(np.int32)


def fake_quantize_learnable_per_tensor_affine(inputs, scale, zero_point, quant_min, quant_max, grad_factor=1.0):
    """Forward of ``torch._fake_quantize_learnable_per_tensor_affine``: the float ``zero_point`` is rounded
    with ``nearbyint`` and clamped to the grid, then ``fake_quantize_per_tensor_affine``."""
    quant_min, quant_max = check_quant_range(quant_min, quant_max)
    z = _learnable_zero_point_forward(zero_point, quant_min, quant_max)
    return fake_quantize_per_tensor_affine(inputs, np.asarray(to_numpy(scale)).reshape(()), z.reshape(()),
                                           quant_min, quant_max)


def fake_quantize_learnable_per_channel_affine(inputs, scale, zero_point, axis, quant_min, quant_max,
                                               grad_factor=1.0, *, fma=True):
    """Forward of ``torch._fake_quantize_learnable_per_channel_affine``: ``zero_point.round()`` (half to
    even) clamped to the grid, as int32, then ``fake_quantize_per_channel_affine``."""
    quant_min, quant_max = check_quant_range(quant_min, quant_max)
    z = _learnable_zero_point_forward(zero_point, quant_min, quant_max)
    return fake_quantize_per_channel_affine(inputs, scale, z, axis, quant_min, quant_max, fma=fma)


def _learnable_elements(g, x, s, inv, z, dscale_small, dscale_big, q, quant_min, quant_max, grad_factor, fma, xp):
    """PyTorch's per-element learnable gradients (dx, dscale, dzero_point), float32, in its operation order."""
    gf = _F32(grad_factor)
    inside = _mask(q, quant_min, quant_max)
    below = q < quant_min
    with _quiet(xp):
        dx = xp.multiply(g, inside, dtype=_F32)
        c = xp.fmin(xp.fmax(q, float(quant_min)), float(quant_max))
        steps = (c - z.astype(_F64)).astype(_F32)  # (clamp(q) - z), exact on the grid
        resid = fma32(steps, s, -x, xp) if fma else xp.subtract(xp.multiply(steps, s, dtype=_F32), x, dtype=_F32)
        ds_in = xp.multiply(xp.multiply(xp.multiply(g, resid, dtype=_F32), inv, dtype=_F32), gf, dtype=_F32)
        ds_out = xp.multiply(xp.multiply(g, xp.where(below, dscale_small, dscale_big), dtype=_F32), gf, dtype=_F32)
        dz_out = xp.multiply(xp.multiply(-g, s, dtype=_F32), gf, dtype=_F32)
        dscale = xp.where(inside, ds_in, ds_out)
        dzero = xp.where(inside, _F32(0), dz_out)
    return dx, dscale, dzero


def _sum_to(a, shape, axis, xp):
    """Sum in float64 over all axes (per tensor) or all axes but ``axis``; round once to float32."""
    with _quiet(xp):
        if axis is None:
            return xp.asarray(a.sum(dtype=_F64)).astype(_F32).reshape(shape)
        axes = tuple(i for i in range(a.ndim) if i != axis)
        return a.sum(axis=axes, dtype=_F64).astype(_F32).reshape(shape)


def fake_quantize_learnable_per_tensor_affine_gradient(gradients, inputs, scale, zero_point, quant_min, quant_max,
                                                       grad_factor=1.0, *, fma=True):
    """Backward of ``torch._fake_quantize_learnable_per_tensor_affine`` (LSQ as PyTorch implements it).

    Returns ``(backprops_wrt_input, backprop_wrt_scale, backprop_wrt_zero_point)``; the last two have the
    shape of ``scale`` (0-d or ``[1]``).  The backward reads the zero point as ``(int64)(z + 0.5)`` clamped
    to the grid, not as the forward's ``nearbyint(z)`` (pytorch/pytorch#52038).

    >>> dx, ds, dz = fake_quantize_learnable_per_tensor_affine_gradient(
    ...     np.ones(3, np.float32), np.array([0.25, -9.0, 9.0], np.float32), 1.0, 0.0, -4, 3)
    >>> dx.tolist(), float(ds), float(dz)
    ([1.0, 0.0, 0.0], -1.25, -2.0)
    """
    xp, x, g = _inputs(inputs, gradients)
    quant_min, quant_max = check_quant_range(quant_min, quant_max)
    _check_learnable_range(quant_min, quant_max)
    s_raw = np.asarray(to_numpy(scale))
    if s_raw.size != 1 or s_raw.ndim > 1:
        raise OperandError(f"must hold one value for the per-tensor op, got shape {list(s_raw.shape)}", operand="scale")
    s = _check_scale(s_raw.reshape(()), 0)
    z_raw = np.asarray(to_numpy(zero_point)).astype(_F32)
    if z_raw.size != 1:
        raise OperandError(f"must hold one value for the per-tensor op, got shape {list(z_raw.shape)}",
                           operand="zero_point")
    if not np.isfinite(z_raw).all():
        raise OperandError("must be finite", operand="zero_point")
    with np.errstate(all="ignore"):
        zp = np.trunc(np.clip(z_raw.reshape(()) + _F32(0.5), _F32(quant_min), _F32(quant_max)))
    inv = _F32(1) / s
    with _quiet(xp):
        t = fma32(x, inv, _F32(zp), xp) if fma else xp.add(_F32(zp), xp.multiply(x, inv, dtype=_F32), dtype=_F32)
    q = _x86_int64(xp.rint(t), xp)
    # Scalars, not 0-d arrays: CuPy takes NumPy scalars as operands but not NumPy arrays.
    dx, ds, dz = _learnable_elements(g, x, _F32(s), inv, _F32(zp), _F32(quant_min - zp), _F32(quant_max - zp),
                                     q, quant_min, quant_max, grad_factor, fma, xp)
    return dx, _sum_to(ds, s_raw.shape, None, xp), _sum_to(dz, s_raw.shape, None, xp)


def fake_quantize_learnable_per_channel_affine_gradient(gradients, inputs, scale, zero_point, axis, quant_min,
                                                        quant_max, grad_factor=1.0, *, fma=True):
    """Backward of ``torch._fake_quantize_learnable_per_channel_affine``.

    Returns ``(backprops_wrt_input, backprop_wrt_scale, backprop_wrt_zero_point)``, the latter two with one
    entry per channel.  The zero point is ``round(z)`` (half to even) clamped to the grid.
    """
    xp, x, g = _inputs(inputs, gradients)
    quant_min, quant_max = check_quant_range(quant_min, quant_max)
    _check_learnable_range(quant_min, quant_max)
    axis = _normalise_axis(axis, x.ndim)
    s = _check_scale(scale, 1)
    z_raw = np.asarray(to_numpy(zero_point)).astype(_F32)
    if z_raw.shape != s.shape:
        raise OperandError(f"shape {list(z_raw.shape)} differs from scale shape {list(s.shape)}", operand="zero_point")
    if not np.isfinite(z_raw).all():
        raise OperandError("must be finite", operand="zero_point")
    zr = np.clip(np.rint(z_raw), _F32(quant_min), _F32(quant_max)).astype(_F32)
    s_b, z_b = _channel_params(x, (("scale", s), ("zero_point", zr)), axis, xp)
    inv_b = _F32(1) / s_b
    with _quiet(xp):
        t = fma32(x, inv_b, z_b, xp) if fma else xp.add(z_b, xp.multiply(x, inv_b, dtype=_F32), dtype=_F32)
        small = xp.subtract(_F32(quant_min), z_b, dtype=_F32)
        big = xp.subtract(_F32(quant_max), z_b, dtype=_F32)
    q = _x86_int64(xp.rint(t), xp)
    dx, ds, dz = _learnable_elements(g, x, s_b, inv_b, z_b, small, big, q, quant_min, quant_max, grad_factor, fma, xp)
    return dx, _sum_to(ds, s.shape, axis, xp), _sum_to(dz, s.shape, axis, xp)


# --- PyTorch's own choice of grid for a range -------------------------------------------------------------

def observer_qparams(min, max, quant_min, quant_max, *, symmetric=False):
    """``(scale, zero_point)`` as ``torch.ao.quantization.MinMaxObserver`` (affine) derives them from a range.

    PyTorch widens the range to contain 0 (``min -> min(min, 0)``, ``max -> max(max, 0)``) where TensorFlow
    shifts it; ``scale = max(width / (quant_max - quant_min), eps)``; the zero point is
    ``quant_min - round(min / scale)`` (half to even) clamped to the grid.  Scalars or 1-d arrays.
    ``symmetric`` (``per_tensor_symmetric`` / ``per_channel_symmetric``): ``scale = max(max(-min, max) /
    ((quant_max - quant_min) / 2), eps)``, the zero point 0 for a signed grid, ``(quant_min + quant_max) // 2``
    for an unsigned one (an observer given its quant range).

    >>> s, z = observer_qparams(-6.0, 6.0, 0, 255)
    >>> float(s), int(z)
    (0.0470588244497776, 128)
    """
    quant_min, quant_max = check_quant_range(quant_min, quant_max)
    mn = np.asarray(to_numpy(min)).astype(_F32)
    mx = np.asarray(to_numpy(max)).astype(_F32)
    with np.errstate(all="ignore"):
        neg = np.minimum(mn, _F32(0))
        pos = np.maximum(mx, _F32(0))
        if symmetric:
            scale = (np.maximum(-neg, pos) / _F32((quant_max - quant_min) / 2)).astype(_F32)
            scale = np.maximum(scale, np.finfo(_F32).eps).astype(_F32)
            return scale, np.full(scale.shape, 0 if quant_min < 0 else (quant_min + quant_max) // 2, np.int32)
        scale = ((pos - neg) / _F32(quant_max - quant_min)).astype(_F32)
        scale = np.maximum(scale, np.finfo(_F32).eps).astype(_F32)
        zp = quant_min - np.rint((neg / scale).astype(_F32)).astype(np.int64)
    return scale, np.clip(zp, quant_min, quant_max).astype(np.int32)


# --- the view estimators work on --------------------------------------------------------------------------

def quantized_view(inputs, scale, zero_point, quant_min, quant_max, *, axis=None, learnable=False, fma=True):
    """What an estimator needs about PyTorch's forward (:class:`qgcli.ops.estimators.Quantized`).

    ``axis=None`` with 0-d ``scale`` is per tensor, else per channel along ``axis`` (moved last in the
    view).  ``learnable`` follows the learnable op's backward (float zero point rounded as it rounds it);
    otherwise the plain op (integer or float zero point).
    """
    xp, x, _ = _inputs(inputs)
    quant_min, quant_max = check_quant_range(quant_min, quant_max)
    per_channel = axis is not None
    if per_channel:
        axis = _normalise_axis(axis, x.ndim)
        x = xp.moveaxis(x, axis, -1)
        s = _check_scale(scale, 1)
    else:
        s = _check_scale(np.asarray(to_numpy(scale)).reshape(()) if np.size(to_numpy(scale)) == 1 else scale, 0)
    z_raw = np.asarray(to_numpy(zero_point))
    if z_raw.size != s.size:
        raise OperandError(f"shape {list(z_raw.shape)} differs from scale shape {list(s.shape)}", operand="zero_point")
    z_raw = z_raw.reshape(s.shape)
    if learnable:
        _check_learnable_range(quant_min, quant_max)
        zf = z_raw.astype(_F32)
        if not np.isfinite(zf).all():
            raise OperandError("must be finite", operand="zero_point")
        with np.errstate(all="ignore"):
            if per_channel:
                z = np.clip(np.rint(zf), _F32(quant_min), _F32(quant_max)).astype(_F32)
            else:
                z = np.trunc(np.clip(zf + _F32(0.5), _F32(quant_min), _F32(quant_max))).astype(_F32)
        z_is_int = True
        fused = fma
    else:
        z, z_is_int = _check_zero_point(z_raw, s, quant_min, quant_max, integer_check=True)
        if not per_channel:
            z = np.asarray(_per_tensor_zero_point(z, z_is_int), _F32)
        fused = fma
    s_d, z_d = xp.asarray(s), xp.asarray(z)
    inv = _F32(1) / s_d
    with _quiet(xp):
        if learnable:
            t = fma32(x, inv, z_d, xp) if fused else xp.add(z_d, xp.multiply(x, inv, dtype=_F32), dtype=_F32)
            q = _x86_int64(xp.rint(t), xp)
        elif per_channel:
            q = _per_channel_q(x, inv, z_d, z_is_int, xp, fused)
        else:
            q = _per_tensor_q(x, inv, float(z), xp).astype(_F64)
        c = xp.fmin(xp.fmax(q, float(quant_min)), float(quant_max))
        steps = (c - z_d.astype(_F64)).astype(_F32)
        resid = fma32(steps, s_d, -x, xp) if (learnable and fused) else xp.subtract(
            xp.multiply(steps, s_d, dtype=_F32), x, dtype=_F32)
        outputs = ((c - z_d.astype(_F64)) * s_d.astype(_F64)).astype(_F32)
        lo = ((float(quant_min) - z.astype(_F64)) * s.astype(_F64)).astype(_F32)
        hi = ((float(quant_max) - z.astype(_F64)) * s.astype(_F64)).astype(_F32)
    return Quantized(
        inputs=x, outputs=outputs, residual=resid,
        inside=_mask(q, quant_min, quant_max), below=q < quant_min, above=q > quant_max,
        scale=s_d, inv_scale=inv, zero_point=z_d, quant_min=quant_min, quant_max=quant_max,
        lo=xp.asarray(lo), hi=xp.asarray(hi), axis=axis if per_channel else None, flush=False,
        semantics="torch",
    )


# --- TensorFlow and PyTorch on the same tensor ------------------------------------------------------------

#: Why a forward value differs between the frameworks (``forward_reason`` codes).
FORWARD_REASONS = {
    0: "same",
    1: "grid",           # the two grids differ (nudged vs widened range, zero-point rounding)
    2: "tie",            # same grid; x/scale is exactly k + 0.5: TF rounds half up, PyTorch half to even
    3: "arithmetic",     # same grid; TF rounds (clamp(x) - nudged_min)/scale, PyTorch x * (1/scale)
    4: "nonfinite",      # NaN/inf input: TF propagates NaN, PyTorch returns a grid edge
}
#: Why a gradient mask differs (``mask_reason`` codes).
MASK_REASONS = {
    0: "same",
    1: "grid",           # the two grids differ
    2: "rounded",        # same grid; TF tests the float input against the nudged bounds, PyTorch the
                         # rounded integer, so up to half a step outside the range passes in PyTorch
}


def _grid_reasons(grid, scale, zero_point):
    """Per channel: why PyTorch's observer grid differs from TensorFlow's nudged grid (empty: same)."""
    reasons = []
    mn, mx = np.atleast_1d(grid.min), np.atleast_1d(grid.max)
    zf = np.atleast_1d(grid.zero_point_from_min).astype(_F64)
    for c in range(mn.size):
        why = []
        same = (np.atleast_1d(grid.scale)[c] == np.atleast_1d(scale)[c]
                and np.atleast_1d(grid.zero_point)[c] == np.atleast_1d(zero_point)[c])
        if not same:
            if mn[c] > 0 or mx[c] < 0:
                why.append("nudging: the range does not contain 0; TensorFlow shifts it, PyTorch widens it to 0")
            if np.atleast_1d(grid.scale)[c] != np.atleast_1d(scale)[c] and not why:
                why.append("scale: computed differently (PyTorch clamps it to float32 eps)")
            if abs(zf[c] - np.floor(zf[c]) - 0.5) == 0:
                why.append(f"zero-point tie: {zf[c]:g} rounds half away from zero in TensorFlow, half to even in "
                           "PyTorch")
            if not why:
                why.append("zero point: TensorFlow rounds quant_min - min/scale, PyTorch quant_min - round(min/scale)")
        reasons.append(why)
    return reasons


def compare_with_tensorflow(inputs, min, max, *, num_bits=8, narrow_range=False, axis=None, gradients=None,
                            fma=True):
    """The same tensor under TensorFlow's and PyTorch's fake-quant conventions, each deriving its grid from
    ``[min, max]`` as it would: TF nudges (``FakeQuantWithMinMaxVars`` / ``PerChannel``), PyTorch takes
    :func:`observer_qparams` and runs ``fake_quantize_per_{tensor,channel}_affine`` on the same integer grid
    ``[quant_min, quant_max]``.  Per-channel when ``min`` is 1-d (``axis`` default -1, TF's convention).

    Returns a dict of arrays (original layout): ``outputs_tf``, ``outputs_torch``, ``mask_tf``,
    ``mask_torch`` (uint8), ``forward_reason``, ``mask_reason`` (int8 codes of :data:`FORWARD_REASONS`,
    :data:`MASK_REASONS`), and with ``gradients`` ``backprops_wrt_input_tf`` / ``_torch``; plus
    ``"grids"``: TF's grid, PyTorch's ``(scale, zero_point)`` and the per-channel reasons they differ.
    """

    xp = array_module(inputs)
    x = as_float32(inputs, "inputs", xp)
    per_channel = np.ndim(to_numpy(min)) == 1
    quant_min, quant_max = fq.quant_range(num_bits, narrow_range)
    attrs = dict(num_bits=num_bits, narrow_range=narrow_range)
    g = None if gradients is None else as_float32(gradients, "gradients", xp)
    if g is not None and g.shape != x.shape:
        raise OperandError(f"shape {list(g.shape)} differs from inputs shape {list(x.shape)}", operand="gradients")
    tf_grad = None
    if per_channel:
        axis = _normalise_axis(-1 if axis is None else axis, x.ndim)
        if g is None:
            tf_out = fq.fake_quant_with_min_max_vars_per_channel(x, min, max, axis=axis, **attrs)
        else:  # TensorFlow's forward and gradient in one pass
            tf_out, tf_grad = fq.fake_quant_with_min_max_vars_per_channel_and_gradient(g, x, min, max, axis=axis,
                                                                                     **attrs)[:2]
        grid, _ = fq._prepare_per_channel(x, min, max, num_bits, narrow_range, axis, xp)
        xl = xp.moveaxis(x, axis, -1)
    else:
        if g is None:
            tf_out = fq.fake_quant_with_min_max_vars(x, min, max, **attrs)
        else:
            tf_out, tf_grad = fq.fake_quant_with_min_max_vars_and_gradient(g, x, min, max, **attrs)[:2]
        grid = fq._prepare_per_tensor(x, min, max, num_bits, narrow_range, xp)
        xl = x
    tf_mask = fq._masks(xl, grid, xp)[0]
    if per_channel:
        tf_mask = xp.moveaxis(tf_mask, -1, axis)
    scale, zero_point = observer_qparams(grid.min, grid.max, quant_min, quant_max)
    if per_channel:
        pt_out, pt_mask = _forward_per_channel(x, scale, zero_point, axis, quant_min, quant_max, xp, fma)
        shape = [1] * x.ndim
        shape[axis] = -1
        same_grid = xp.asarray((scale == grid.scale) & (zero_point == grid.zero_point)).reshape(shape)
        inv = xp.asarray(_F32(1) / scale).reshape(shape)
    else:
        pt_out, pt_mask = _forward_per_tensor(x, scale.reshape(()), zero_point.reshape(()), quant_min, quant_max, xp)
        same_grid = bool(scale == grid.scale and zero_point == grid.zero_point)
        inv = _F32(1) / scale.reshape(())
    with _quiet(xp):
        fwd_differs = ~((tf_out == pt_out) | (xp.isnan(tf_out) & xp.isnan(pt_out)))
        t = xp.multiply(x, inv, dtype=_F32)
        tie = xp.isfinite(t) & (t - xp.floor(t) == _F32(0.5))
        finite = xp.isfinite(x)
    fwd_reason = xp.where(~fwd_differs, 0, xp.where(~finite, 4, xp.where(~xp.asarray(same_grid), 1,
                                                                          xp.where(tie, 2, 3)))).astype(xp.int8)
    mask_differs = tf_mask != pt_mask
    mask_reason = xp.where(~mask_differs, 0, xp.where(~xp.asarray(same_grid), 1, 2)).astype(xp.int8)
    out = {
        "outputs_tf": tf_out, "outputs_torch": pt_out,
        "mask_tf": tf_mask.astype(xp.uint8), "mask_torch": pt_mask.astype(xp.uint8),
        "forward_reason": fwd_reason, "mask_reason": mask_reason,
    }
    if g is not None:
        with _quiet(xp):
            out["backprops_wrt_input_tf"] = tf_grad
            out["backprops_wrt_input_torch"] = xp.multiply(g, pt_mask, dtype=_F32)
    out["grids"] = {
        "per_channel": per_channel, "axis": axis if per_channel else None,
        "quant_min": quant_min, "quant_max": quant_max, "tf": grid,
        "torch_scale": scale, "torch_zero_point": zero_point,
        "reasons": _grid_reasons(grid, scale, zero_point),
    }
    return out


# --- qgcli report on PyTorch's grid -----------------------------------------------------------------------

class ReportGrid:
    """PyTorch's grid of one fake quant as the per-channel report (:func:`qgcli.ops.analysis.channel_report`)
    sees it: ``scale`` and ``zero_point`` (0-d per tensor, one per channel), the integer range, and the float
    range the grid spans, ``min = nudged_min = (quant_min - zero_point) * scale`` and ``max = nudged_max =
    (quant_max - zero_point) * scale`` (what clips lies outside it)."""

    def __init__(self, scale, zero_point, quant_min, quant_max):
        self.scale = np.asarray(scale, _F32)
        self.zero_point = np.asarray(zero_point)
        self.quant_min, self.quant_max = check_quant_range(quant_min, quant_max)
        z = self.zero_point.astype(_F64)
        self.min = self.nudged_min = ((self.quant_min - z) * self.scale.astype(_F64)).astype(_F32)
        self.max = self.nudged_max = ((self.quant_max - z) * self.scale.astype(_F64)).astype(_F32)

    def view(self, xb):
        """:func:`quantized_view` of a ``[rows, channels]`` block (one column per tensor)."""
        if self.scale.ndim:
            return quantized_view(xb, self.scale, self.zero_point, self.quant_min, self.quant_max, axis=-1)
        return quantized_view(xb, self.scale, self.zero_point, self.quant_min, self.quant_max)


def report_ops(quant_min, quant_max, *, symmetric):
    """``(forward, grid_for, masks)`` of PyTorch's fake quant for :func:`qgcli.ops.analysis.channel_report`:
    ``forward(xb, lo, hi, grid=None)`` on a ``[rows, channels]`` block (on ``grid``, else on the observer's
    qparams of ``[lo, hi]``), ``grid_for(lo, hi)`` that grid, ``masks(xb, grid)`` (inside, below, above)."""
    def grid_for(lo, hi):
        lo, hi = np.asarray(lo), np.asarray(hi)
        if lo.size == 1:
            lo, hi = lo.reshape(()), hi.reshape(())
        return ReportGrid(*observer_qparams(lo, hi, quant_min, quant_max, symmetric=symmetric), quant_min, quant_max)

    def forward(xb, lo, hi, grid=None):
        return (grid or grid_for(lo, hi)).view(xb).outputs

    def masks(xb, grid):
        v = grid.view(xb)
        return v.inside, v.below, v.above

    return forward, grid_for, masks
