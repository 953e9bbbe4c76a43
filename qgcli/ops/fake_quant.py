"""TensorFlow's FakeQuantWithMinMax{Args,Vars,VarsPerChannel} ops and gradients, bit-exact with TF 2.21 (CPU).

The arithmetic follows ``fake_quant_ops_functor.h`` operation by operation in float32
(tf_semantics.md §1): the range is *nudged* so that 0.0 is a grid point, values are clamped to the nudged
range, shifted, scaled (Vars divides by ``scale``, Args and PerChannel multiply by a separately rounded
``inv_scale``) and rounded with ``floor(v + 0.5)``; gradient masks use the nudged bounds, inclusive.

TensorFlow's CPU threads run with flush-to-zero and denormals-are-zero.  We reproduce that without a
per-element pass where it cannot matter: subnormal inputs only change a comparison against a bound that
is exactly 0 (the mask bounds below move by one subnormal instead), or the forward value when the grid
step itself is tiny (then the clamped values are flushed explicitly).  Gradients are flushed, since a
subnormal gradient is passed through as zero by TensorFlow.

Where TensorFlow silently returns garbage (Vars with ``min > max``, ``min == max != 0``, NaN or infinite
bounds) these functions refuse with an :class:`~qgcli.errors.OperandError`; ``min == max == 0`` keeps
TensorFlow's meaning (forward gives zeros, gradient passes through).
"""
import contextlib
import functools
from dataclasses import dataclass

import numpy as np

from qgcli.backend import array_module, to_numpy
from qgcli.errors import OperandError, QgcliError
from qgcli.ops import cuda, native
from qgcli.ops.out_array import check_out, deliver
from qgcli.ops.subnormals import TINY as _TINY, flush_subnormals

_F32 = np.float32
_MAX_SUBNORMAL = np.nextafter(_TINY, _F32(0))
# Below this grid step a subnormal input can reach a different grid point than the zero TF reads.
_FLUSH_SCALE = _F32(2.0**-100)


def infer_variant(variant, min_value, *, without_min="args"):
    """The TensorFlow op for a run: an explicit ``variant`` wins; else ``min`` of rank >= 1 -> per-channel,
    rank 0 -> vars (the notebook's op); no ``min`` at all -> ``without_min``.  The commands take
    FakeQuantWithMinMaxArgs there (its range is an attribute, -6..6 by default); the plots pass "vars".

    >>> infer_variant(None, np.zeros(3)), infer_variant(None, 1.5), infer_variant(None, None)
    ('per-channel', 'vars', 'args')
    """
    if variant is not None:
        return variant
    if min_value is None:
        return without_min
    ndim = getattr(min_value, "ndim", None)  # NumPy or CuPy: no copy to the host
    return "per-channel" if (np.ndim(min_value) if ndim is None else ndim) >= 1 else "vars"


def quant_range(num_bits=8, narrow_range=False):
    """``(quant_min, quant_max)`` of TF's grid: ``(1 if narrow_range else 0, 2**num_bits - 1)``."""
    if isinstance(num_bits, bool) or not isinstance(num_bits, (int, np.integer)):
        raise QgcliError(f"must be an integer, got {num_bits!r}", operand="num_bits")
    if not 2 <= num_bits <= 16:
        raise QgcliError(f"must be between 2 and 16, inclusive, got {num_bits}", operand="num_bits")
    return (1 if narrow_range else 0), (1 << int(num_bits)) - 1


def _quiet(xp):
    return np.errstate(all="ignore") if xp is np else contextlib.nullcontext()


@dataclass(frozen=True)
class Grid:
    """A nudged quantization grid, on the host, as float32 NumPy arrays.

    Per-tensor grids hold 0-d arrays, per-channel grids 1-d arrays (one entry per channel).
    ``zero_point`` is the nudged integer zero point; ``zero_point_from_min`` the unrounded value
    ``quant_min - min / scale``; ``passthrough`` marks ``min == max == 0`` (TF's special case);
    ``mask_lo``/``mask_hi`` are the gradient mask's bounds (see :meth:`mask_bounds`).
    """

    min: np.ndarray
    max: np.ndarray
    num_bits: int
    narrow_range: bool
    quant_min: int
    quant_max: int
    scale: np.ndarray
    inv_scale: np.ndarray
    zero_point_from_min: np.ndarray
    zero_point: np.ndarray
    nudged_min: np.ndarray
    nudged_max: np.ndarray
    quant_zero: np.ndarray
    mask_lo: np.ndarray
    mask_hi: np.ndarray
    passthrough: np.ndarray

    @property
    def per_channel(self):
        return self.min.ndim == 1

    def mask_bounds(self):
        """Bounds for ``lo <= x <= hi`` that equal TF's DAZ comparison ``nudged_min <= flush(x) <= nudged_max``:
        a bound of 0 moves out by one subnormal, so subnormal inputs count as the 0 TF reads."""
        return self.mask_lo, self.mask_hi

    def needs_flush(self):
        usable = ~self.passthrough
        return bool(np.any((self.scale[usable] < _FLUSH_SCALE) if self.per_channel else (usable and self.scale < _FLUSH_SCALE)))

    @functools.cached_property
    def forward_kernel(self):
        """What the blocked forward kernel takes of this grid, derived once per grid (a cached grid serves
        every call with its range): ``(parameters, flush, the compiled kernel's table of them)``; the
        passthrough mask is None where no channel is 0..0."""
        from qgcli.ops import blocked

        passthrough = self.passthrough if self.passthrough.any() else None
        params = (self.nudged_min, self.nudged_max, self.scale, self.inv_scale, self.quant_zero, passthrough)
        return params, self.needs_flush(), _frozen(blocked._table(params, self._depth))

    @functools.cached_property
    def gradient_kernel(self):
        """The gradient's ``(mask bounds lo, hi, passthrough or None)`` and their compiled table, once per grid."""
        from qgcli.ops import blocked

        bounds = (self.mask_lo, self.mask_hi, self.passthrough if self.passthrough.any() else None)
        return bounds, _frozen(blocked._table(bounds, self._depth))

    @property
    def _depth(self):
        return self.min.size if self.per_channel else 1


def _frozen(a):
    a.setflags(write=False)
    return a


def nudge(min, max, *, num_bits=8, narrow_range=False):
    """TensorFlow's ``Nudge()``: the grid for a raw range, scalar or per channel (float32, FTZ/DAZ).

    >>> g = nudge(-6.0, 6.0, num_bits=2)
    >>> float(g.nudged_min), float(g.nudged_max), float(g.scale), int(g.zero_point)
    (-8.0, 4.0, 4.0, 2)
    """
    quant_min, quant_max = quant_range(num_bits, narrow_range)
    mn, mx = (np.asarray(to_numpy(v), _F32, order="C") for v in (min, max))
    lib = native.library() if mn.shape == mx.shape else None
    if lib is not None:
        fields = np.empty((len(_NUDGED),) + mn.shape, _F32)
        address = native.address
        lib.qg_nudge(address(mn, _F32), address(mx, _F32), mn.size, quant_min, quant_max, address(fields, _F32))
    else:
        fields = np.stack(np.broadcast_arrays(*_nudge_numpy(mn, mx, quant_min, quant_max)))
    grid = {name: fields[i, ...] for i, name in enumerate(_NUDGED)}  # [i, ...]: 0-d arrays, not scalars
    return Grid(num_bits=int(num_bits), narrow_range=bool(narrow_range), quant_min=quant_min, quant_max=quant_max,
                passthrough=np.asarray((grid["min"] == 0) & (grid["max"] == 0)), **grid)


# The Grid fields nudge() computes, in the order of the compiled qg_nudge's output rows.
_NUDGED = ("min", "max", "scale", "inv_scale", "zero_point_from_min", "zero_point", "nudged_min", "nudged_max",
           "quant_zero", "mask_lo", "mask_hi")


def _nudge_numpy(mn, mx, quant_min, quant_max):
    """The fields of :data:`_NUDGED` for float32 ranges ``mn``/``mx`` (0-d or 1-d), with NumPy."""
    # 0-d ranges become float32 scalars: their operators cost a tenth of a 0-d array's ufunc calls, and
    # float32 scalar arithmetic rounds exactly as float32 array arithmetic does.
    mn, mx = flush_subnormals(mn[()]), flush_subnormals(mx[()])
    qmin, qmax = _F32(quant_min), _F32(quant_max)
    levels = _F32(qmax - qmin)
    with np.errstate(all="ignore"):
        width = flush_subnormals(mx - mn)
        scale = flush_subnormals(width / levels)
        inv_scale = flush_subnormals(levels / width)
        zp_from_min = flush_subnormals(qmin - flush_subnormals(mn / scale))
        # std::round on a value >= quant_min >= 0: half away from zero is floor(v + 0.5), exact in float64;
        # clamping the rounded value equals TF's clamp-then-round, since quant_min/max are integers.
        rounded = np.floor(np.float64(0.5) + zp_from_min)
        zero_point = np.minimum(np.maximum(rounded, quant_min), quant_max)
        zero_point = np.where(zero_point == zero_point, zero_point, 0.0).astype(_F32)  # NaN -> 0, as TF
        nudged_min = flush_subnormals((qmin - zero_point) * scale)
        nudged_max = flush_subnormals((qmax - zero_point) * scale)
        quant_zero = np.floor(flush_subnormals(flush_subnormals(-nudged_min * inv_scale) + _F32(0.5)))
        mask_lo = np.where(nudged_min == 0, -_MAX_SUBNORMAL, nudged_min)
        mask_hi = np.where(nudged_max == 0, _MAX_SUBNORMAL, nudged_max)
    values = (mn, mx, scale, inv_scale, zp_from_min, zero_point, nudged_min, nudged_max, quant_zero, mask_lo, mask_hi)
    return [np.asarray(v, _F32) for v in values]


# --- validation -------------------------------------------------------------------------------------

def as_float32(a, operand, xp):
    """``a`` as a float32 array of ``xp``; any real floating dtype is accepted (TF computes in float32)."""
    a = xp.asarray(a)
    if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
        raise OperandError(f"dtype {a.dtype} is not a real floating type", operand=operand)
    return a.astype(_F32, copy=False)


def _check_same_shape(gradients, inputs):
    if gradients.shape != inputs.shape:
        raise OperandError(
            f"shape {list(gradients.shape)} differs from inputs shape {list(inputs.shape)}", operand="gradients"
        )


def _range_operand(value, name, rank, xp):
    arr = np.asarray(to_numpy(value))
    if arr.dtype.kind not in "fiu" and arr.dtype.name != "bfloat16":
        raise OperandError(f"dtype {arr.dtype} is not a real number type", operand=name)
    if arr.ndim != rank:
        raise OperandError(f"must be rank {rank} but is rank {arr.ndim} (shape {list(arr.shape)})", operand=name)
    return arr.astype(_F32)


def _check_ranges(grid):
    """Refuse the ranges TF accepts but answers with garbage (non-finite, reversed, empty but not 0..0)."""
    if np.all(np.isfinite(grid.min) & np.isfinite(grid.max) & ((grid.min < grid.max) | grid.passthrough)):
        return  # the usual case, in one test; what follows only finds what to say
    mn, mx = np.atleast_1d(grid.min), np.atleast_1d(grid.max)
    for name, values in (("min", mn), ("max", mx)):
        bad = ~np.isfinite(values)
        if bad.any():
            i = int(np.argmax(bad))
            at = f" at channel {i}" if grid.per_channel else ""
            raise OperandError(f"is {float(values[i])}{at}; the range must be finite", operand=name)
    reversed_ = (mn > mx) | ((mn == mx) & ~np.atleast_1d(grid.passthrough))
    if reversed_.any():
        i = int(np.argmax(reversed_))
        at = f" at channel {i}" if grid.per_channel else ""
        raise OperandError(
            f"{float(mn[i]):g} is not below max {float(mx[i]):g}{at}; TensorFlow would return meaningless values "
            "(only min == max == 0 is allowed: it passes zeros forward and gradients through)",
            operand="min",
        )


def _channel_last(a, axis):
    if axis in (-1, a.ndim - 1):
        return a
    return array_module(a).moveaxis(a, axis, -1)


def _normalise_axis(axis, ndim):
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise OperandError(f"must be an integer, got {axis!r}", operand="axis")
    if ndim < 1:
        raise OperandError("per-channel quantization needs inputs of rank >= 1, got a scalar", operand="inputs")
    if not -ndim <= axis < ndim:
        raise OperandError(f"{axis} is out of range for inputs of rank {ndim}", operand="axis")
    return int(axis) % ndim


def _prepare_per_tensor(inputs, min, max, num_bits, narrow_range, xp):
    return _checked_grid(_range_operand(min, "min", 0, xp), _range_operand(max, "max", 0, xp), num_bits,
                         narrow_range)


# Ranges of up to this many channels have their checked grid cached (32 grids of 1024 channels: ~3 MB).
_CACHED_CHANNELS = 1024


def _checked_grid(mn, mx, num_bits, narrow_range):
    """The grid of float32 ranges ``mn``/``mx`` (same shape), nudged and checked by :func:`_check_ranges`
    once per range and attribute set: a repeated call (a layer's fixed range, the same op on many tensors)
    takes the grid it got before, read-only, with its kernel tables (:attr:`Grid.forward_kernel`, :attr:`Grid.gradient_kernel`)."""
    quant_range(num_bits, narrow_range)  # validated before they become a cache key
    if mn.size > _CACHED_CHANNELS:
        grid = nudge(mn, mx, num_bits=num_bits, narrow_range=narrow_range)
        _check_ranges(grid)
        return grid
    return _cached_grid(mn.tobytes(), mx.tobytes(), mn.shape, int(num_bits), bool(narrow_range))


@functools.lru_cache(maxsize=32)
def _cached_grid(mn_bytes, mx_bytes, shape, num_bits, narrow_range):
    mn, mx = (np.frombuffer(b, _F32).reshape(shape) for b in (mn_bytes, mx_bytes))
    grid = nudge(mn, mx, num_bits=num_bits, narrow_range=narrow_range)
    _check_ranges(grid)  # raises: nothing is cached
    return _read_only(grid)


def _read_only(grid):
    for value in vars(grid).values():
        if isinstance(value, np.ndarray):
            value.setflags(write=False)
    return grid


def _prepare_per_channel(inputs, min, max, num_bits, narrow_range, axis, xp):
    axis = _normalise_axis(axis, inputs.ndim)
    mn = _range_operand(min, "min", 1, xp)
    mx = _range_operand(max, "max", 1, xp)
    depth = inputs.shape[axis]
    if depth == 0:
        # TF returns an empty result here; every summary, report and plot would divide by zero channels.
        raise OperandError(f"have no channels (axis {axis} has length 0); per-channel quantization needs one or more",
                           operand="inputs")
    for name, arr in (("min", mn), ("max", mx)):
        if arr.shape[0] != depth:
            raise OperandError(
                f"has {arr.shape[0]} entries but inputs have {depth} channels on axis {axis}", operand=name
            )
    return _checked_grid(mn, mx, num_bits, narrow_range), axis


# --- element-wise work: blocked NumPy kernels on the CPU, fused CUDA kernels on CuPy arrays ------------

def _quantize(x, grid, divide, xp, out=None):
    """Forward fake quantization of float32 ``x`` (channels on the last axis for per-channel grids), into
    ``out`` (checked by :func:`_check_forward_out`) when given."""
    depth = x.shape[-1] if grid.per_channel else 1
    x2 = xp.ascontiguousarray(x).reshape(-1, depth)
    if xp is np:
        from qgcli.ops import blocked

        params, flush, table = grid.forward_kernel
        rows_out = None if out is None else out.reshape(x2.shape)
        return deliver(blocked.quantize(x2, params, divide, flush, table=table, out=rows_out).reshape(x.shape), out)

    return deliver(cuda.quantize(x2, grid, divide, grid.needs_flush()).reshape(x.shape), out)


def _masks(x, grid, xp):
    """Boolean masks (inside, below, above) of the nudged range; all False on min == max == 0 channels."""
    lo, hi = (xp.asarray(b) for b in grid.mask_bounds())
    below = x < lo
    above = x > hi
    inside = (x >= lo) & (x <= hi)
    if grid.passthrough.any():
        keep = xp.asarray(~grid.passthrough)
        inside &= keep
        below &= keep
        above &= keep
    return inside, below, above


def _backprops(gradients, x, grid, xp, *, reduce, out=None):
    """``backprops_wrt_input`` (into ``out``, checked by :func:`_check_out`, when given) and, with ``reduce``,
    the min/max sums."""
    depth = x.shape[-1] if grid.per_channel else 1
    g2 = xp.ascontiguousarray(gradients).reshape(-1, depth)
    x2 = xp.ascontiguousarray(x).reshape(-1, depth)
    kind = "chip" if grid.per_channel else "flat"
    if xp is np:
        from qgcli.ops import blocked

        bounds, table = grid.gradient_kernel
        rows_out = None if out is None else out.reshape(g2.shape)
        res = blocked.backprops(g2, x2, *bounds, reduce=reduce, kind=kind, out=rows_out, table=table)
    else:
        from qgcli.ops import cuda

        res = cuda.backprops(g2, x2, grid, reduce=reduce, kind=kind)
    dx, dmin, dmax = res if reduce else (res, None, None)
    dx = deliver(dx.reshape(x.shape), out)
    if not reduce:
        return dx
    if not grid.per_channel:
        dmin, dmax = dmin.reshape(()), dmax.reshape(())
    return dx, dmin, dmax


def _fused(gradients, x, grid, divide, xp, *, reduce, out=None, outputs_out=None):
    """The forward and the gradient of ``x`` (channels last) in one pass over ``x`` and ``gradients``:
    ``(outputs, dx)`` or, with ``reduce``, ``(outputs, dx, dmin, dmax)``; each the bits of :func:`_quantize`
    and :func:`_backprops`, which CuPy arrays run one after the other."""
    if xp is not np:
        outputs = _quantize(x, grid, divide, xp, outputs_out)
        res = _backprops(gradients, x, grid, xp, reduce=reduce, out=out)
        return (outputs, *res) if reduce else (outputs, res)
    from qgcli.ops import blocked

    depth = x.shape[-1] if grid.per_channel else 1
    g2 = np.ascontiguousarray(gradients).reshape(-1, depth)
    x2 = np.ascontiguousarray(x).reshape(-1, depth)
    params, flush, forward_table = grid.forward_kernel
    bounds, bounds_table = grid.gradient_kernel
    res = blocked.fused(g2, x2, params, divide, flush, bounds, reduce=reduce, kind="chip" if grid.per_channel else "flat",
                        out=None if out is None else out.reshape(g2.shape), tables=(forward_table, bounds_table),
                        outputs_out=None if outputs_out is None else outputs_out.reshape(x2.shape))
    outputs, dx = deliver(res[0].reshape(x.shape), outputs_out), deliver(res[1].reshape(x.shape), out)
    if not reduce:
        return outputs, dx
    dmin, dmax = res[2:]
    if not grid.per_channel:
        dmin, dmax = dmin.reshape(()), dmax.reshape(())
    return outputs, dx, dmin, dmax


def _gradient_operands(gradients, inputs, out):
    """``(xp, gradients, inputs, out)`` checked as every gradient op checks them, in TensorFlow's order."""
    xp = array_module(gradients, inputs)
    g, x = as_float32(gradients, "gradients", xp), as_float32(inputs, "inputs", xp)
    _check_same_shape(g, x)
    return xp, g, x, _check_out(out, g, x, xp)


def _fused_operands(gradients, inputs, out, outputs_out):
    """:func:`_gradient_operands` and the fused ops' ``outputs_out``: checked as the forward's ``out`` but sharing
    memory with none of ``inputs``, ``gradients`` and ``out`` (the fused kernel reads both operands to the end)."""
    xp, g, x, out = _gradient_operands(gradients, inputs, out)
    outputs_out = check_out(outputs_out, xp, shape=x.shape, dtype=_F32, reused=None, reused_name=None,
                            others=(g, x, out), operand="outputs_out")
    return xp, g, x, out, outputs_out


def _check_out(out, gradients, inputs, xp):
    return check_out(out, xp, shape=inputs.shape, dtype=_F32, reused=gradients, reused_name="gradients",
                     others=(inputs,))


def _forward_operands(inputs, out):
    """``(xp, inputs, out)`` checked as every forward op checks them: ``out`` may be ``inputs`` itself (float32,
    C order: the outputs overwrite them) or an array sharing no memory with them."""
    xp = array_module(inputs)
    x = as_float32(inputs, "inputs", xp)
    return xp, x, check_out(out, xp, shape=x.shape, dtype=_F32, reused=x, reused_name="inputs", others=())


# --- the six TensorFlow ops ------------------------------------------------------------------------

def _args_grid(min, max, num_bits, narrow_range):
    # TF attributes are 32-bit floats, compared under DAZ (so [-1e-40, 0] is an empty range).
    mn, mx = (flush_subnormals(np.asarray(v, _F32))[()] for v in (min, max))
    if not (np.isfinite(mn) and np.isfinite(mx)):
        raise OperandError(f"the range [{float(mn):g}, {float(mx):g}] must be finite", operand="min")
    if not mn < mx:
        raise OperandError(f"min has to be smaller than max, was: {float(mn):g} >= {float(mx):g}", operand="min")
    quant_range(num_bits, narrow_range)  # validated before they become a cache key
    return _attribute_grid(float(mn), float(mx), int(num_bits), bool(narrow_range))


@functools.lru_cache(maxsize=64)
def _attribute_grid(mn, mx, num_bits, narrow_range):
    """Args ranges are attributes, fixed when TF builds the op, and so is their grid: nudge them once
    (a third of a small tensor's time).  The shared grid's arrays are made read-only."""
    return _read_only(nudge(_F32(mn), _F32(mx), num_bits=num_bits, narrow_range=narrow_range))


def fake_quant_with_min_max_args(inputs, min=-6.0, max=6.0, *, num_bits=8, narrow_range=False, out=None):
    """TensorFlow's ``FakeQuantWithMinMaxArgs``: fake-quantize ``inputs`` on the nudged grid of [min, max].

    ``out``: a writeable C-contiguous float32 array shaped as ``inputs`` (same device) to write the outputs
    into; it is returned.  It may be ``inputs`` itself, which is then overwritten, or a buffer kept from call
    to call (a fresh tensor-sized result costs its page faults on every call); otherwise it must share no
    memory with ``inputs``.  The same for every forward op.

    >>> fake_quant_with_min_max_args(np.array([-0.75, -0.25, 0.25], np.float32), -1.0, 0.5, num_bits=2)
    array([-0.5,  0. ,  0.5], dtype=float32)
    >>> x = np.array([-0.75, -0.25, 0.25], np.float32)
    >>> fake_quant_with_min_max_args(x, -1.0, 0.5, num_bits=2, out=x) is x, x
    (True, array([-0.5,  0. ,  0.5], dtype=float32))
    """
    xp, x, out = _forward_operands(inputs, out)
    return _quantize(x, _args_grid(min, max, num_bits, narrow_range), False, xp, out)


def fake_quant_with_min_max_args_gradient(gradients, inputs, min=-6.0, max=6.0, *, num_bits=8, narrow_range=False,
                                          out=None):
    """TensorFlow's ``FakeQuantWithMinMaxArgsGradient``: ``backprops = gradients * (nudged_min <= inputs <= nudged_max)``.

    ``out``: where to write the backprops (returned), as in :func:`fake_quant_with_min_max_vars_gradient`.
    """
    xp, g, x, out = _gradient_operands(gradients, inputs, out)
    return _backprops(g, x, _args_grid(min, max, num_bits, narrow_range), xp, reduce=False, out=out)


def fake_quant_with_min_max_vars(inputs, min, max, *, num_bits=8, narrow_range=False, out=None):
    """TensorFlow's ``FakeQuantWithMinMaxVars``: like Args with scalar tensors ``min``/``max``; divides by ``scale``.
    ``out``: as in :func:`fake_quant_with_min_max_args`.

    >>> fake_quant_with_min_max_vars(np.array([-6.0, -1.0, 1.0, 6.0], np.float32), -6.0, 6.0, num_bits=2)
    array([-4.,  0.,  0.,  4.], dtype=float32)
    """
    xp, x, out = _forward_operands(inputs, out)
    grid = _prepare_per_tensor(x, min, max, num_bits, narrow_range, xp)
    return _quantize(x, grid, True, xp, out)


def fake_quant_with_min_max_vars_gradient(gradients, inputs, min, max, *, num_bits=8, narrow_range=False, out=None):
    """TensorFlow's ``FakeQuantWithMinMaxVarsGradient``.

    Returns ``(backprops_wrt_input, backprop_wrt_min, backprop_wrt_max)``: the gradient masked to the nudged
    range (inclusive) and the sums of the gradient below and above it (0-d float32 arrays).

    ``out``: a writeable C-contiguous float32 array shaped as ``inputs`` (same device) to write
    ``backprops_wrt_input`` into; it is returned.  It may be ``gradients`` itself, which is then overwritten
    (no second tensor-sized array: the CLI does this with the gradients it read); otherwise it must share
    no memory with either operand.

    >>> g = np.ones(3, np.float32)
    >>> dx, _, dmax = fake_quant_with_min_max_vars_gradient(g, np.array([0.0, 1.0, 9.0], np.float32), -6.0, 6.0, out=g)
    >>> dx is g, g, float(dmax)
    (True, array([1., 1., 0.], dtype=float32), 1.0)
    """
    xp, g, x, out = _gradient_operands(gradients, inputs, out)
    grid = _prepare_per_tensor(x, min, max, num_bits, narrow_range, xp)
    return _backprops(g, x, grid, xp, reduce=True, out=out)


def fake_quant_with_min_max_vars_per_channel(inputs, min, max, *, num_bits=8, narrow_range=False, axis=-1,
                                             out=None):
    """TensorFlow's ``FakeQuantWithMinMaxVarsPerChannel``: one grid per channel of ``axis`` (TF: the last axis).

    ``min``/``max`` have one entry per channel; any input rank >= 1 works, as TF's kernel.  ``out``: as in
    :func:`fake_quant_with_min_max_args`.
    """
    xp, x, out = _forward_operands(inputs, out)
    grid, axis = _prepare_per_channel(x, min, max, num_bits, narrow_range, axis, xp)
    if axis == x.ndim - 1:
        return _quantize(x, grid, False, xp, out)
    y = _quantize(_channel_last(x, axis), grid, False, xp)
    return deliver(xp.ascontiguousarray(xp.moveaxis(y, -1, axis)), out)


def fake_quant_with_min_max_vars_per_channel_gradient(
    gradients, inputs, min, max, *, num_bits=8, narrow_range=False, axis=-1, out=None
):
    """TensorFlow's ``FakeQuantWithMinMaxVarsPerChannelGradient``.

    Returns ``(backprops_wrt_input, backprop_wrt_min, backprop_wrt_max)``, the latter two with one entry per
    channel.  ``out``: as in :func:`fake_quant_with_min_max_vars_gradient`.
    """
    xp, g, x, out = _gradient_operands(gradients, inputs, out)
    grid, axis = _prepare_per_channel(x, min, max, num_bits, narrow_range, axis, xp)
    if axis == x.ndim - 1:
        return _backprops(g, x, grid, xp, reduce=True, out=out)
    dx, dmin, dmax = _backprops(_channel_last(g, axis), _channel_last(x, axis), grid, xp, reduce=True)
    return deliver(xp.ascontiguousarray(xp.moveaxis(dx, -1, axis)), out), dmin, dmax


# --- forward and gradient in one pass ------------------------------------------------------------------
# What a training step's fake-quant node computes (and what verify, compare-semantics, the capture checks and
# the monitor's reference need): the op's outputs and its gradient of the same inputs.  One pass reads
# ``inputs`` and ``gradients`` once and writes both, where the two ops would read ``inputs`` twice; every
# output is the bits the two ops give.

def fake_quant_with_min_max_args_and_gradient(gradients, inputs, min=-6.0, max=6.0, *, num_bits=8,
                                              narrow_range=False, out=None, outputs_out=None):
    """:func:`fake_quant_with_min_max_args` and :func:`fake_quant_with_min_max_args_gradient` in one pass:
    ``(outputs, backprops)``.  ``out``: where the backprops go, as in the gradient op; ``outputs_out``: where the
    outputs go, a writeable C-contiguous float32 array shaped as ``inputs`` that shares no memory with
    ``inputs``, ``gradients`` or ``out`` (a buffer kept from call to call: no page faults of a fresh one).

    >>> g, x = np.ones(3, np.float32), np.array([-0.75, -0.25, 0.25], np.float32)
    >>> fake_quant_with_min_max_args_and_gradient(g, x, -1.0, 0.5, num_bits=2)
    (array([-0.5,  0. ,  0.5], dtype=float32), array([1., 1., 1.], dtype=float32))
    """
    xp, g, x, out, outputs_out = _fused_operands(gradients, inputs, out, outputs_out)
    return _fused(g, x, _args_grid(min, max, num_bits, narrow_range), False, xp, reduce=False, out=out,
                  outputs_out=outputs_out)


def fake_quant_with_min_max_vars_and_gradient(gradients, inputs, min, max, *, num_bits=8, narrow_range=False,
                                              out=None, outputs_out=None):
    """:func:`fake_quant_with_min_max_vars` and :func:`fake_quant_with_min_max_vars_gradient` in one pass:
    ``(outputs, backprops_wrt_input, backprop_wrt_min, backprop_wrt_max)``.  ``out``: as in the gradient op;
    ``outputs_out``: as in :func:`fake_quant_with_min_max_args_and_gradient`.

    >>> x = np.array([-7.0, -6.0, -1.0, 1.0, 6.0], np.float32)
    >>> y, dx, dmin, dmax = fake_quant_with_min_max_vars_and_gradient(np.ones_like(x), x, -6.0, 6.0, num_bits=2)
    >>> y.tolist(), dx.tolist(), float(dmin), float(dmax)
    ([-8.0, -4.0, 0.0, 0.0, 4.0], [1.0, 1.0, 1.0, 1.0, 0.0], 0.0, 1.0)
    """
    xp, g, x, out, outputs_out = _fused_operands(gradients, inputs, out, outputs_out)
    grid = _prepare_per_tensor(x, min, max, num_bits, narrow_range, xp)
    return _fused(g, x, grid, True, xp, reduce=True, out=out, outputs_out=outputs_out)


def fake_quant_with_min_max_vars_per_channel_and_gradient(gradients, inputs, min, max, *, num_bits=8,
                                                          narrow_range=False, axis=-1, out=None, outputs_out=None):
    """:func:`fake_quant_with_min_max_vars_per_channel` and its gradient in one pass: ``(outputs,
    backprops_wrt_input, backprop_wrt_min, backprop_wrt_max)``, the last two per channel.  ``out``: as in
    the gradient op; ``outputs_out``: as in :func:`fake_quant_with_min_max_args_and_gradient`."""
    xp, g, x, out, outputs_out = _fused_operands(gradients, inputs, out, outputs_out)
    grid, axis = _prepare_per_channel(x, min, max, num_bits, narrow_range, axis, xp)
    if axis == x.ndim - 1:
        return _fused(g, x, grid, False, xp, reduce=True, out=out, outputs_out=outputs_out)
    y, dx, dmin, dmax = _fused(_channel_last(g, axis), _channel_last(x, axis), grid, False, xp, reduce=True)
    back = lambda a: xp.ascontiguousarray(xp.moveaxis(a, -1, axis))  # noqa: E731
    return deliver(back(y), outputs_out), deliver(back(dx), out), dmin, dmax
