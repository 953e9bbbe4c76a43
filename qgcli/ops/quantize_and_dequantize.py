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
    >>> [round(v, 4) for v in quantize_and_dequantize_v4(x, -2.0, 2.5, num_bits=4, range_given=True).tolist()]
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


def explain_grid(input_min, input_max, *, signed_input=True, num_bits=8, narrow_range=False):
    """What ``ComputeQuantizationRange`` builds for a given range (``qgcli nudge --variant
    quantize-and-dequantize-v*``): a JSON-ready dict, plus ``"_grid"`` (the :class:`QdqGrid`).

    ``input_min``/``input_max`` scalars (per tensor) or 1-d (one per slice of an axis).  Per range: the
    scale (levels per unit), the step, which bound decided it, the representable interval ``[lo, hi]``; and
    warnings (``channel``, ``kind``, ``message``) of kinds ``outside-range`` (outputs can fall outside
    ``[input_min, input_max]``: the grid reaches beyond it), ``reversed`` (min > max), ``empty`` (min == max),
    ``zero-not-in-range`` (unsigned with a negative bound, signed with a range beside 0).

    >>> d = explain_grid(-2.0, 2.5, num_bits=4)
    >>> d["grid"]["decided_by"], round(d["grid"]["lo"], 4), d["warnings"][0]["kind"]
    ('input_max', -2.8571, 'outside-range')
    """
    check_attributes(signed_input=signed_input, num_bits=num_bits)
    mn, mx = _range_array(input_min, "input_min"), _range_array(input_max, "input_max")
    for name, a in (("input_min", mn), ("input_max", mx)):
        if a.ndim > 1:
            raise OperandError(f"must be a scalar or 1-d (one per slice), got shape {list(a.shape)}", operand=name)
        if np.isnan(a).any():
            raise OperandError("must not be NaN", operand=name)
    if mn.shape != mx.shape:
        raise OperandError(f"shape {list(mn.shape)} differs from input_max shape {list(mx.shape)}",
                           operand="input_min")
    grid = quantization_grid(mn, mx, signed_input=signed_input, num_bits=int(num_bits), narrow_range=narrow_range)
    per_slice = mn.ndim == 1
    warnings = []
    flat = np.atleast_1d
    for c in range(flat(mn).size):
        lo, hi = float(flat(mn)[c]), float(flat(mx)[c])
        glo, ghi = float(flat(grid.lo)[c]), float(flat(grid.hi)[c])
        step = float(flat(grid.step)[c])

        def warn(kind, message, where=c if per_slice else None):
            warnings.append({"channel": where, "kind": kind, "message": message})

        if lo > hi:
            warn("reversed", f"input_min {lo:g} > input_max {hi:g}: TensorFlow refuses it per tensor with "
                             "range_given, accepts it per axis (V3) and builds the grid from the positive side alone")
            continue
        if lo == hi:
            warn("empty", f"input_min == input_max == {lo:g}: an empty range; the grid is "
                          f"[{glo:g}, {ghi:g}] (step {step:g})")
            continue
        if glo < lo or ghi > hi:
            side = (f"below input_min down to {glo:.7g}" if glo < lo else "") + (
                " and " if glo < lo and ghi > hi else "") + (f"above input_max up to {ghi:.7g}" if ghi > hi else "")
            by = "input_min" if bool(flat(grid.from_min)[c]) else "input_max"
            example = ""
            if glo < lo:
                probe = lo - (lo - glo) * 1.5
                example = f" (x = {probe:.4g} gives {glo:.4g})"
            elif ghi > hi:
                probe = hi + (ghi - hi) * 1.5
                example = f" (x = {probe:.4g} gives {ghi:.4g})"
            warn("outside-range", f"outputs can fall outside [{lo:g}, {hi:g}]: the scale is decided by {by}, so "
                                  f"the grid [{glo:.7g}, {ghi:.7g}] reaches {side}{example}; with range_given "
                                  "V4Grad still masks the gradient on [input_min, input_max]")
        if signed_input and (lo > 0 or hi < 0):
            warn("zero-not-in-range", f"[{lo:g}, {hi:g}] does not contain 0: the signed grid is symmetric around 0 "
                                      f"and covers [{glo:.7g}, {ghi:.7g}]")
        if not signed_input and lo < 0:
            warn("zero-not-in-range", f"signed_input=false with input_min {lo:g} < 0: the unsigned grid starts at "
                                      "0, negative values clamp to 0 (with range_given)")

    def plain(a, kind=float):
        a = np.asarray(a)
        return [kind(v) for v in a.tolist()] if a.ndim else kind(a)

    return {
        "num_bits": int(num_bits), "signed_input": bool(signed_input), "narrow_range": bool(narrow_range),
        "quant_min": grid.quant_min, "quant_max": grid.quant_max, "levels": grid.quant_max - grid.quant_min + 1,
        "per_channel": per_slice,
        "grid": {"input_min": plain(grid.min), "input_max": plain(grid.max), "scale": plain(grid.scale),
                 "step": plain(grid.step), "decided_by": plain(np.where(grid.from_min, "input_min", "input_max"), str),
                 "lo": plain(grid.lo), "hi": plain(grid.hi)},
        "warnings": warnings,
        "_grid": grid,
    }


# --- plots: the grid in the vocabulary of qgcli.ops.Grid ---------------------------------------------------

@dataclass(frozen=True)
class PlotGrid:
    """A :class:`QdqGrid` as :mod:`qgcli.report.plots` draws grids (the duck type of :class:`qgcli.ops.Grid`).

    ``min``/``max`` the range the grid was built from (given or from the data), ``nudged_min``/``nudged_max``
    the grid's ends ``lo``/``hi``, ``scale`` the step, ``quant_zero = -quant_min`` (level ``k`` is
    ``(k - quant_zero) * step``).  Host float32 arrays, 0-d or one per slice.
    """

    min: np.ndarray
    max: np.ndarray
    nudged_min: np.ndarray
    nudged_max: np.ndarray
    scale: np.ndarray
    inv_scale: np.ndarray
    zero_point: np.ndarray
    quant_zero: np.ndarray
    passthrough: np.ndarray
    decided_by_min: np.ndarray
    num_bits: int
    narrow_range: bool
    quant_min: int
    quant_max: int
    op: str = "QuantizeAndDequantizeV4"
    signed_input: bool = True
    range_given: bool = False
    round_mode: str = "HALF_TO_EVEN"

    bounds_label = "grid ends [lo, hi]"

    @property
    def per_channel(self):
        return np.asarray(self.min).ndim == 1

    def summary(self):
        def plain(a):
            return np.asarray(a, np.float64).tolist()
        return {"op": self.op, "num_bits": self.num_bits, "signed_input": self.signed_input,
                "range_given": self.range_given, "round_mode": self.round_mode, "narrow_range": self.narrow_range,
                "quant_min": self.quant_min, "quant_max": self.quant_max, "min": plain(self.min),
                "max": plain(self.max), "lo": plain(self.nudged_min), "hi": plain(self.nudged_max),
                "step": plain(self.scale), "decided_by": np.where(self.decided_by_min, "input_min",
                                                                 "input_max").tolist()}

    def words(self):
        def fmt(v):
            v = np.asarray(v)
            return f"{float(v):.5g}" if v.ndim == 0 else f"{v.size} slices"
        source = "given" if self.range_given else "from the data"
        by = ("input_min" if bool(self.decided_by_min) else "input_max") if np.ndim(self.decided_by_min) == 0 else "-"
        return (f"num_bits={self.num_bits}, {'signed' if self.signed_input else 'unsigned'}"
                f"{', narrow range' if self.narrow_range else ''}, {self.round_mode}: range {source} "
                f"[{fmt(self.min)}, {fmt(self.max)}] -> grid [{fmt(self.nudged_min)}, {fmt(self.nudged_max)}], "
                f"step {fmt(self.scale)} (decided by {by})")


def plot_grid(grid, *, num_bits, narrow_range, op, signed_input, range_given, round_mode):
    """The :class:`PlotGrid` of a :class:`QdqGrid`."""
    zero = np.zeros(np.shape(grid.step), _F32)
    return PlotGrid(grid.min, grid.max, grid.lo, grid.hi, grid.step, grid.scale, zero,
                    np.full(np.shape(grid.step), -grid.quant_min, _F32), np.zeros(np.shape(grid.step), bool),
                    np.asarray(grid.from_min), int(num_bits), bool(narrow_range), grid.quant_min, grid.quant_max,
                    op, bool(signed_input), bool(range_given), round_mode)


def plot_data(x, input_min, input_max, gradients=None, *, version="v4", signed_input=True, range_given=False,
              round_mode="HALF_TO_EVEN", num_bits=8, narrow_range=False, axis=None):
    """What the plots draw: ``(outputs, mask, backprops, grid, axis)``.

    ``mask`` is TensorFlow's gradient fed with ones: ``QuantizeAndDequantizeV4Grad`` (on the given
    ``[input_min, input_max]``) for V4, the pass-through gradient TF registers for V2/V3 (ones);
    ``backprops`` the same fed with ``gradients``.  ``grid`` a :class:`PlotGrid`, ``axis`` None (per tensor)
    or the slice axis.
    """
    xp = array_module(x)
    x32, grid, axis = prepare(x, input_min, input_max, signed_input=signed_input, num_bits=num_bits,
                              range_given=range_given, round_mode=round_mode, narrow_range=narrow_range, axis=axis,
                              version=version)
    out = forward(x32, grid, range_given=range_given, round_mode=round_mode, axis=axis, xp=xp)
    g = None if gradients is None else as_float32(gradients, "gradients", xp)
    if g is not None and g.shape != x32.shape:
        raise OperandError(f"shape {list(g.shape)} differs from input shape {list(x32.shape)}", operand="gradients")
    if version == "v4":
        mask = quantize_and_dequantize_v4_grad(xp.ones_like(x32), x32, input_min, input_max, axis=axis)[0]
        backprops = None if g is None else quantize_and_dequantize_v4_grad(g, x32, input_min, input_max,
                                                                            axis=axis)[0]
    else:
        mask, backprops = xp.ones_like(x32), g
    op = f"QuantizeAndDequantize{version.upper()}"
    pg = plot_grid(grid, num_bits=num_bits, narrow_range=narrow_range, op=op, signed_input=signed_input,
                   range_given=range_given, round_mode=round_mode)
    return out, mask, backprops, pg, axis


# --- qgcli report: the hooks of qgcli.ops.analysis.channel_report ------------------------------------------

def report_masks(x, grid, version, xp, given=None):
    """``(inside, below, above)`` on a channels-last block: ``inside`` TensorFlow's gradient mask (V4Grad: the
    given ``[min, max]``; V2/V3: pass-through, all True), ``below``/``above`` outside the grid's
    ends ``[lo, hi]`` (where a given range clamps).  ``given``: V4Grad's ``(input_min, input_max)``, by default
    the range the grid was built from."""
    xf = _fz(x)
    lo, hi = xp.asarray(_fz(grid.nudged_min)), xp.asarray(_fz(grid.nudged_max))
    with _quiet(xp):
        below, above = xf < lo, xf > hi
        if version == "v4":
            mn, mx = (grid.min, grid.max) if given is None else given
            inside = (xf >= xp.asarray(_fz(mn))) & (xf <= xp.asarray(_fz(mx)))
        else:
            inside = xp.ones(xf.shape, bool)
    return inside, below, above


def report_ops(*, version, signed_input, range_given, round_mode, num_bits, narrow_range):
    """``(run_forward(xb, lo, hi, given=True), grid_for(lo, hi))`` on channels-last blocks (lo/hi 1-d per column)."""
    op = f"QuantizeAndDequantize{version.upper()}"

    def grid_for(lo, hi):
        lo, hi = np.asarray(lo, _F32), np.asarray(hi, _F32)
        if lo.size == 1:
            lo, hi = lo.reshape(()), hi.reshape(())
        g = quantization_grid(lo, hi, signed_input=signed_input, num_bits=num_bits, narrow_range=narrow_range)
        return plot_grid(g, num_bits=num_bits, narrow_range=narrow_range, op=op, signed_input=signed_input,
                         range_given=range_given, round_mode=round_mode)

    def run_forward(xb, lo, hi, given=True):
        lo, hi = np.asarray(lo, _F32), np.asarray(hi, _F32)
        if lo.size == 1:
            lo, hi = lo.reshape(()), hi.reshape(())
        g = quantization_grid(lo, hi, signed_input=signed_input, num_bits=num_bits, narrow_range=narrow_range)
        return forward(xb, g, range_given=given, round_mode=round_mode, axis=None, xp=array_module(xb))

    return run_forward, grid_for


def estimator_refusal(name, grid, input_min, input_max, *, range_given):
    """Why ``--estimator name`` has no meaning on this run's grid (None when it has one).

    The mask-based estimators (ste, identity, scaled, ewgs) use V4Grad's mask on the given range and carry
    over.  PACT learns the clip level ``alpha``, LSQ the step with values clamped to the grid's ends: on this
    grid they mean what they say only when the range is given and the grid ends where the given range ends
    (PACT: ``hi == input_max``; LSQ: ``lo == input_min`` and ``hi == input_max``).  Otherwise the forward
    clamps elsewhere (or, without ``range_given``, takes its range from the data) and qgcli refuses them.
    """
    if name not in ("pact", "lsq"):
        return None
    if not range_given:
        return (f"{name} learns the clipping range, but without --range-given the grid comes from the "
                "data, not from input_min/input_max; add --range-given")
    mn, mx = np.asarray(input_min, _F32), np.asarray(input_max, _F32)
    top = np.asarray(grid.hi) == _fz(mx)
    bottom = np.asarray(grid.lo) == _fz(mn)
    if name == "pact" and not top.all():
        return ("pact takes alpha = input_max as the clip level, but the scale is decided by input_min "
                "and the grid reaches above input_max (qgcli nudge --variant quantize-and-dequantize-v4 shows it)")
    if name == "lsq" and not (top & bottom).all():
        return ("lsq needs the grid to end where the given range ends (its gradients assume values "
                "outside [input_min, input_max] clamp there), but this grid reaches outside it (qgcli nudge "
                "--variant quantize-and-dequantize-v4 shows it)")
    return None
