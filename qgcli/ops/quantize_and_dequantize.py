"""TensorFlow's ``QuantizeAndDequantizeV2/V3/V4`` and ``QuantizeAndDequantizeV4Grad``, bit for bit.

``tf.quantization.quantize_and_dequantize_v2`` runs ``QuantizeAndDequantizeV4`` forward and
``QuantizeAndDequantizeV4Grad`` backward; ``tf.quantization.quantize_and_dequantize`` runs V2 and V3 takes
``num_bits`` as a tensor; both register a pass-through gradient.  V2 and V4 share one kernel, V3 always rounds
half to even.  This module follows TensorFlow 2.21's CPU kernels (``quantize_and_dequantize_op.{h,cc}``)
operation by operation in float32, with x86 flush-to-zero:

* **The grid** (``ComputeQuantizationRange``): ``[qmin, qmax]`` is ``[-2^(b-1) (+1 if narrow), 2^(b-1) - 1]``
  signed, ``[0, 2^b - 1]`` unsigned.  Each side proposes a scale (levels per unit) ``qmin / min`` and
  ``qmax / max`` where that quotient is positive, else ``FLT_MAX``; the smaller one wins and the other bound is
  moved onto the grid: ``max = qmax * (min / qmin)`` when the minimum decides, else ``min = qmin * (max / qmax)``.
  So with ``signed_input`` the grid is symmetric around 0 and can reach below ``input_min`` (4 bits,
  ``[-2, 2.5]``: the step is ``2.5 / 7`` and ``-3`` maps to ``-8 * 2.5 / 7 = -2.857``).
* **The forward**: ``round(clamp(x, lo, hi) * scale) * (1 / scale)`` with ``range_given`` (``1 / scale`` is
  computed as ``bound / qbound``, not as a reciprocal), ``round(x * scale) * (1 / scale)`` without (no clamp:
  the range comes from the data).  ``HALF_TO_EVEN`` is ``rint``; ``HALF_UP`` is ``floor(v + 0.5)`` in float32,
  so ``0.49999997`` rounds up to 1, as in TensorFlow.
* **The range from the data** (``range_given=False``): min/max over the tensor (or per slice of ``axis``).
  Eigen's reductions skip NaN except in one place: the last element its scalar loop reads.  Per tensor that is
  the last element when the size is not a multiple of 8 (the AVX packet).  A NaN there makes the range, and every output of the tensor, NaN.  Verified per tensor up to 1024
  elements; larger tensors split Eigen's reduction into blocks and per-slice reductions run Eigen's packet
  reducer, where a NaN can also narrow the range: qgcli refuses NaN data there rather than guess.
* **The gradient** (``QuantizeAndDequantizeV4Grad``): ``gradients * 1{input_min <= input <= input_max}`` on the
  *given* range (not the grid: values the forward maps onto the extended grid still get 0), a product, so an
  infinite gradient outside the range gives NaN; ``input_min_backprop``/``input_max_backprop`` are zeros of
  ``input_min``'s shape.

``axis=-1`` means per tensor, as in TensorFlow (``None`` too); ``axis=k >= 0`` one range per slice of axis k.
"""
from dataclasses import dataclass

import numpy as np

from qgcli.backend import array_module, to_numpy
from qgcli.errors import OperandError, QgcliError
from qgcli.ops.fake_quant import _quiet, as_float32
from qgcli.ops.subnormals import flush_subnormals as _fz

_F32 = np.float32
_FLT_MAX = np.finfo(np.float32).max
ROUND_MODES = ("HALF_TO_EVEN", "HALF_UP")
VERSIONS = ("v2", "v3", "v4")


@dataclass(frozen=True)
class QdqGrid:
    """The grid of one run, on the host: float32 0-d (per tensor) or 1-d (per slice) arrays.

    ``min``/``max`` the range it was built from (given or from the data), ``lo``/``hi`` the grid's ends,
    ``scale`` levels per unit, ``step`` = TF's ``inverse_scale``, ``from_min`` True where the minimum decided.
    """

    min: np.ndarray
    max: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    scale: np.ndarray
    step: np.ndarray
    from_min: np.ndarray
    quant_min: int
    quant_max: int


def quant_bounds(signed_input, num_bits, narrow_range):
    """``(qmin, qmax)``, the integer range of ``ComputeQuantizationRange``."""
    if signed_input:
        return (-(1 << (num_bits - 1)) + (1 if narrow_range else 0), (1 << (num_bits - 1)) - 1)
    return 0, (1 << num_bits) - 1


def check_attributes(*, signed_input=True, num_bits=8, round_mode="HALF_TO_EVEN", version="v4"):
    """TensorFlow's attribute checks, in its words (a :class:`QgcliError`)."""
    if version not in VERSIONS:
        raise QgcliError(f"unknown version {version!r}; expected one of {', '.join(VERSIONS)}", operand="version")
    limit = 62 if signed_input else 63
    if isinstance(num_bits, bool) or int(num_bits) != num_bits or not 0 < int(num_bits) < limit:
        raise QgcliError(f"{num_bits} is out of range: TensorFlow accepts 1..{limit - 1} with "
                         f"signed_input={str(bool(signed_input)).lower()}", operand="num_bits")
    if round_mode not in ROUND_MODES:
        raise QgcliError(f"must be HALF_TO_EVEN or HALF_UP, not {round_mode!r}", operand="round_mode")
    if version == "v3" and round_mode != "HALF_TO_EVEN":
        raise QgcliError("QuantizeAndDequantizeV3 has no round_mode: it always rounds HALF_TO_EVEN",
                         operand="round_mode")


def normalise_axis(axis, ndim, version="v4"):
    """``None`` (per tensor) or the slice axis, checked as TensorFlow checks it."""
    if axis is None or axis == -1:
        return None
    axis = int(axis)
    if axis < -1:
        if version == "v3":
            raise QgcliError(f"{axis}: TensorFlow 2.21's QuantizeAndDequantizeV3 aborts the process on a negative "
                             "axis other than -1 (-1 means per tensor); give the axis as 0..rank-1", operand="axis")
        raise QgcliError(f"must be at least -1 (-1 means per tensor), found {axis}", operand="axis")
    if axis >= ndim:
        raise QgcliError(f"{axis} is out of range for input of rank {ndim}", operand="axis")
    return axis


def _range_array(value, name):
    arr = np.asarray(to_numpy(value))
    if arr.dtype.kind not in "fiu" and arr.dtype.name != "bfloat16":
        raise OperandError(f"dtype {arr.dtype} is not a real number type", operand=name)
    return arr.astype(_F32)


def given_range(input_min, input_max, shape, axis, *, check_order=True):
    """The given ``input_min``/``input_max`` as float32 host arrays, checked as the forward kernel does."""
    mn, mx = _range_array(input_min, "input_min"), _range_array(input_max, "input_max")
    if axis is None:
        for name, a in (("input_min", mn), ("input_max", mx)):
            if a.ndim != 0:
                raise OperandError(f"must be a scalar without an axis (shape {list(a.shape)}); give --axis K for "
                                   "one range per slice of axis K", operand=name)
        if check_order and not mn <= mx:
            raise OperandError(f"invalid range: input_min {mn:g} > input_max {mx:g} (or NaN)", operand="input_min")
        return mn, mx
    depth = shape[axis]
    for name, a in (("input_min", mn), ("input_max", mx)):
        if a.ndim != 1:
            raise OperandError(f"must be rank 1 with axis {axis} (shape {list(a.shape)})", operand=name)
        if a.shape[0] != depth:
            raise OperandError(f"has {a.shape[0]} entries, expected {depth} (dim {axis} of the input)", operand=name)
    if np.isnan(mn).any() or np.isnan(mx).any():
        raise OperandError("NaN in a per-slice range: TensorFlow accepts it but its clamp then depends on Eigen's "
                           "packet order; qgcli refuses", operand="input_min" if np.isnan(mn).any() else "input_max")
    return mn, mx


#: Per tensor, the NaN rule of :func:`data_range` is verified up to this size (Eigen splits larger reductions).
NAN_RANGE_LIMIT = 1024
_NAN_REFUSAL = ("NaN in the data with range_given=false: TensorFlow's range then depends on where Eigen's reduction "
                "meets the NaN (ignored, NaN, or a narrower range), which qgcli reproduces only per tensor up to "
                f"{NAN_RANGE_LIMIT} elements; give the range (--range-given) or drop the NaNs")


def data_range(x, axis, xp):
    """min/max of the data as Eigen reduces them (see the module notes on NaN)."""
    if axis is None:
        flat = x.reshape(-1)
        with _quiet(xp):
            nan = xp.isnan(flat)
            mn = xp.where(nan, _F32(np.inf), flat).min() if flat.size else _F32(np.inf)
            mx = xp.where(nan, _F32(-np.inf), flat).max() if flat.size else _F32(-np.inf)
        mn, mx = np.asarray(to_numpy(mn), _F32), np.asarray(to_numpy(mx), _F32)
        if flat.size > NAN_RANGE_LIMIT and bool(to_numpy(nan.any())):
            raise OperandError(_NAN_REFUSAL + f" for a tensor of more than {NAN_RANGE_LIMIT} elements",
                               operand="input")
        if flat.size % 8 and bool(to_numpy(nan[-1])):
            mn, mx = np.asarray(np.nan, _F32), np.asarray(np.nan, _F32)
        return mn, mx
    depth = x.shape[axis]
    x3 = x.reshape(int(np.prod(x.shape[:axis], dtype=np.int64)), depth, -1) if x.size else None
    if x3 is None:
        return np.full(depth, np.inf, _F32), np.full(depth, -np.inf, _F32)
    nan = xp.isnan(x3)
    if bool(to_numpy(nan.any())):
        raise OperandError(_NAN_REFUSAL + " per slice of an axis", operand="input")
    mn = to_numpy(xp.where(nan, _F32(np.inf), x3).min(axis=(0, 2))).astype(_F32)
    mx = to_numpy(xp.where(nan, _F32(-np.inf), x3).max(axis=(0, 2))).astype(_F32)
    last = to_numpy(nan[-1, :, -1])
    mn[last], mx[last] = np.nan, np.nan
    return mn, mx


def quantization_grid(input_min, input_max, *, signed_input=True, num_bits=8, narrow_range=False):
    """``ComputeQuantizationRange`` on host float32 arrays (0-d or 1-d): a :class:`QdqGrid`."""
    qmin, qmax = quant_bounds(signed_input, num_bits, narrow_range)
    fmin, fmax = _F32(qmin), _F32(qmax)  # int64 -> float, rounded to nearest as C++ converts
    mn, mx = _fz(np.asarray(input_min, _F32)), _fz(np.asarray(input_max, _F32))
    with np.errstate(all="ignore"):
        side_min = np.where(_fz(fmin * mn) > 0, _fz(fmin / mn), _FLT_MAX).astype(_F32)
        side_max = np.where(_fz(fmax * mx) > 0, _fz(fmax / mx), _FLT_MAX).astype(_F32)
        from_min = side_min < side_max
        scale = np.where(from_min, side_min, side_max).astype(_F32)
        step = _fz(np.where(from_min, mn / fmin, mx / fmax).astype(_F32))
        hi = np.where(from_min, _fz(fmax * step), mx).astype(_F32)
        lo = np.where(from_min, mn, _fz(fmin * step)).astype(_F32)
    return QdqGrid(mn, mx, lo, hi, scale, step, from_min, qmin, qmax)


def _shaped(a, ndim, axis, xp):
    a = xp.asarray(a)
    return a if axis is None else a.reshape((-1,) + (1,) * (ndim - axis - 1))


def _round(v, round_mode, xp):
    if round_mode == "HALF_TO_EVEN":
        return xp.rint(v)
    return xp.floor(xp.add(v, _F32(0.5), dtype=_F32))


def forward(x, grid, *, range_given, round_mode, axis, xp):
    """The kernel's ``(Clamp)ScaleAndRound`` over a float32 array ``x`` with a computed grid."""
    x = _fz(x)
    scale, step = _shaped(grid.scale, x.ndim, axis, xp), _shaped(grid.step, x.ndim, axis, xp)
    with _quiet(xp):
        if range_given:
            # Eigen's cwiseMin/cwiseMax: std::min/max order, so ties (0 vs -0) and NaN keep x.
            hi, lo = _shaped(grid.hi, x.ndim, axis, xp), _shaped(grid.lo, x.ndim, axis, xp)
            x = xp.where(hi < x, hi, x)
            x = xp.where(x < lo, lo, x)
        v = _fz(xp.multiply(x, scale, dtype=_F32))
        return _fz(xp.multiply(_round(v, round_mode, xp), step, dtype=_F32))


def prepare(input, input_min, input_max, *, signed_input=True, num_bits=8, range_given=False,
            round_mode="HALF_TO_EVEN", narrow_range=False, axis=None, version="v4"):
    """Checks and the grid: ``(x, grid, axis)`` with ``x`` float32 on ``input``'s array module."""
    check_attributes(signed_input=signed_input, num_bits=num_bits, round_mode=round_mode, version=version)
    xp = array_module(input)
    x = as_float32(input, "input", xp)
    axis = normalise_axis(axis, x.ndim, version)
    if range_given and axis is not None and version != "v3":
        raise QgcliError(f"TensorFlow 2.21's QuantizeAndDequantize{version.upper()} kernel refuses every per-axis "
                         "range with range_given ('input_min must be a scalar'); QuantizeAndDequantizeV3 accepts it "
                         "(always HALF_TO_EVEN)", operand="axis")
    if range_given:
        mn, mx = given_range(input_min, input_max, x.shape, axis)
    else:
        mn, mx = data_range(_fz(x), axis, xp)
    grid = quantization_grid(mn, mx, signed_input=signed_input, num_bits=int(num_bits), narrow_range=narrow_range)
    return x, grid, axis


def quantize_and_dequantize_v4(input, input_min, input_max, *, signed_input=True, num_bits=8, range_given=False,
                               round_mode="HALF_TO_EVEN", narrow_range=False, axis=None):
    """TensorFlow's ``QuantizeAndDequantizeV4`` (= V2; V3 is ``round_mode="HALF_TO_EVEN"``): the ``output``.

    ``input_min``/``input_max`` are used only with ``range_given`` (scalars, or one per slice of ``axis``).

    >>> import numpy as np
    >>> x = np.array([-3.0, -2.0, 0.0, 1.0, 2.5, 3.0], np.float32)
    >>> quantize_and_dequantize_v4(x, -2.0, 2.5, num_bits=4, range_given=True).round(4).tolist()
    [-2.8571, -2.1429, 0.0, 1.0714, 2.5, 2.5]
    """
    return _run("v4", input, input_min, input_max, signed_input, num_bits, range_given, round_mode, narrow_range,
                axis)


def quantize_and_dequantize_v2(input, input_min, input_max, *, signed_input=True, num_bits=8, range_given=False,
                               round_mode="HALF_TO_EVEN", narrow_range=False, axis=None):
    """TensorFlow's ``QuantizeAndDequantizeV2`` (the kernel V4 shares; its gradient in TF passes through)."""
    return _run("v2", input, input_min, input_max, signed_input, num_bits, range_given, round_mode, narrow_range,
                axis)


def quantize_and_dequantize_v3(input, input_min, input_max, num_bits=8, *, signed_input=True, range_given=True,
                               narrow_range=False, axis=None):
    """TensorFlow's ``QuantizeAndDequantizeV3``: ``num_bits`` an operand, always HALF_TO_EVEN, and the one
    version of TF 2.21 that runs a per-axis ``range_given``."""
    return _run("v3", input, input_min, input_max, signed_input, num_bits, range_given, "HALF_TO_EVEN", narrow_range,
                axis)


def _run(version, input, input_min, input_max, signed_input, num_bits, range_given, round_mode, narrow_range, axis):
    xp = array_module(input)
    x, grid, axis = prepare(input, input_min, input_max, signed_input=signed_input, num_bits=num_bits,
                            range_given=range_given, round_mode=round_mode, narrow_range=narrow_range, axis=axis,
                            version=version)
    return forward(x, grid, range_given=range_given, round_mode=round_mode, axis=axis, xp=xp)


def grad_bounds(input_min, input_max, shape, axis):
    """The gradient op's ``input_min``/``input_max`` (float32 host arrays), checked as TensorFlow checks them."""
    mn, mx = _range_array(input_min, "input_min"), _range_array(input_max, "input_max")
    for name, a in (("input_min", mn), ("input_max", mx)):
        if a.ndim > 1:
            raise OperandError(f"must be a scalar or a vector, not rank {a.ndim}", operand=name)
        if axis is None and a.ndim != 0:
            raise OperandError(f"must be a scalar without an axis (shape {list(a.shape)})", operand=name)
        if axis is not None and (a.ndim != 1 or a.shape[0] != shape[axis]):
            raise OperandError(f"has shape {list(a.shape)}, expected [{shape[axis]}] (dim {axis} of the input)",
                               operand=name)
    return mn, mx


def grad_mask(x, mn, mx, axis, xp):
    """TensorFlow's ``in_range``: ``input_min <= x <= input_max`` on the given bounds (flushed), as a bool array."""
    x = _fz(x)
    lo, hi = _shaped(_fz(mn), x.ndim, axis, xp), _shaped(_fz(mx), x.ndim, axis, xp)
    with _quiet(xp):
        return (x >= lo) & (x <= hi)


def quantize_and_dequantize_v4_grad(gradients, input, input_min, input_max, *, axis=None):
    """TensorFlow's ``QuantizeAndDequantizeV4Grad``: ``(input_backprop, input_min_backprop, input_max_backprop)``.

    >>> import numpy as np
    >>> g = np.ones(4, np.float32); x = np.array([-3.0, -2.0, 2.5, 3.0], np.float32)
    >>> [a.tolist() for a in quantize_and_dequantize_v4_grad(g, x, -2.0, 2.5)]
    [[0.0, 1.0, 1.0, 0.0], 0.0, 0.0]
    """
    xp = array_module(input)
    x = as_float32(input, "input", xp)
    axis = normalise_axis(axis, x.ndim)
    g = as_float32(gradients, "gradients", xp)
    if g.shape != x.shape:
        raise OperandError(f"shape {list(g.shape)} differs from input shape {list(x.shape)}", operand="gradients")
    mn, mx = grad_bounds(input_min, input_max, x.shape, axis)
    mask = grad_mask(x, mn, mx, axis, xp)
    with _quiet(xp):
        backprop = _fz(xp.multiply(g, mask.astype(_F32), dtype=_F32))
    return backprop, xp.zeros(mn.shape, _F32), xp.zeros(mn.shape, _F32)
