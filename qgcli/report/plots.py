"""The tutorial notebook's figures (staircase, STE, histogram) and per-channel views, as matplotlib Figures.

Every function returns a :class:`matplotlib.figure.Figure` on an Agg canvas: no pyplot, no global state, no
display needed.  :func:`save_figure` (from :mod:`qgcli.storage.figures`) writes one atomically, in the format
its file name asks for (.png, .svg, .pdf).  Every number drawn comes from :mod:`qgcli.ops`: the forward values
from the fake-quant op, the gradient function (TF's STE mask) from the gradient op fed with ones, exactly as
``tf.gradients(outputs, inputs)`` does in the notebook, the back-propagated gradient from the gradient op fed
with the user's gradients, bounds and levels from :func:`qgcli.ops.nudge`.

Each figure carries ``fig.qgcli_summary``, a dict of plain numbers (points drawn, elements, op, grid) that
the CLI prints.  Artists that tests and users may want to find carry a ``gid`` (``"outputs"``, ``"mask"``,
``"backprops"``, ``"raw_bound"``, ``"nudged_bound"``, ``"level"``, ...).

>>> import numpy as np
>>> fig = staircase(np.linspace(-10, 10, 201, dtype=np.float32), -6.0, 6.0, num_bits=2)
>>> fig.qgcli_summary["points"], fig.qgcli_summary["grid"]["nudged_min"]
(201, -8.0)
"""
import textwrap
from dataclasses import dataclass, fields, replace

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from qgcli import ops
from qgcli.backend import array_module, to_numpy
from qgcli.errors import OperandError, QgcliError
from qgcli.ops import estimators as est, torch_semantics as ts
from qgcli.ops.analysis import clip_statistics, grid_summary
from qgcli.ops.fake_quant import as_float32, Grid, infer_variant
from qgcli.storage.figures import figure_format, save_figure  # noqa: F401 (written by storage; documented here)
from qgcli.report.text import counted

DEFAULT_MAX_POINTS = 4000
# Line plots sort their points; above this many elements they first draw a seeded random subset.
PRESAMPLE = 1_000_000
# Level lines are drawn when few enough to tell apart; a rug on the histogram up to RUG_LEVELS.
LINE_LEVELS = 32
TICK_LEVELS = 9
RUG_LEVELS = 256
# Up to this many channels the per-channel panels use separate bars; above it, one step outline.
BAR_CHANNELS = 64

TF_OPS = {
    "args": "FakeQuantWithMinMaxArgs",
    "vars": "FakeQuantWithMinMaxVars",
    "per-channel": "FakeQuantWithMinMaxVarsPerChannel",
}
C_OUTPUTS, C_MASK, C_BACKPROPS = "C0", "red", "brown"
C_RAW, C_NUDGED, C_CLIP = "0.35", "tab:green", "tab:red"
# Per-channel panels: the legend sits above the panel, where no channel's bar can be.
_PANEL_LEGEND = dict(loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7, ncols=2, frameon=False,
                     borderaxespad=0.1)


# --- numbers: the one place that maps a variant to qgcli.ops calls ----------------------------------------

@dataclass
class FakeQuantData:
    """The op's results as NumPy arrays, channel axis last (per-channel), plus the nudged grid."""

    variant: str
    op: str
    grid: object  # qgcli.ops.Grid
    x: np.ndarray
    outputs: np.ndarray
    mask: np.ndarray
    backprops: np.ndarray | None
    # (lo, hi): where the op's gradient mask is 1, inclusive (0-d or one per channel, channel last); None when
    # the variant has no such range.  Only used to draw the mask's step edges exactly (checked against ``mask``).
    mask_range: tuple | None = None
    # Grids whose clipping is not "outside [nudged_min, nudged_max]" (PyTorch tests the rounded integer): the
    # op's own (below, above) masks, shaped as ``x``; and the upstream gradient, for per-channel blocked shares.
    clipped: tuple | None = None
    gradients: np.ndarray | None = None


@dataclass
class LevelGrid:
    """An integer grid of another framework in :class:`qgcli.ops.Grid`'s vocabulary, for the plots: level
    ``q`` in ``[quant_min, quant_max]`` is the value ``(q - zero_level) * scale`` (PyTorch: ``zero_level`` is
    the zero point; torchao's float-domain zero point ``z``: ``mid - z / scale``).  ``min = nudged_min`` and
    ``max = nudged_max`` are the ends of that range, ``scale`` and ``zero_level`` 0-d or one per slice (channel,
    block).  ``words`` names the framework's parameters."""

    scale: np.ndarray
    zero_level: np.ndarray
    quant_min: int
    quant_max: int
    label: str  # e.g. "torch.fake_quantize_per_tensor_affine"
    slices: str = "channel"
    num_bits: int = 0
    narrow_range: bool = False
    bounds_label: str = "grid range (quant_min/max)"
    raw_bounds = False  # no raw range besides the grid's own

    def __post_init__(self):
        self.scale = np.asarray(self.scale, np.float32)
        self.zero_level = np.asarray(self.zero_level, np.float64)
        s = self.scale.astype(np.float64)
        self.nudged_min = self.min = ((self.quant_min - self.zero_level) * s).astype(np.float32)
        self.nudged_max = self.max = ((self.quant_max - self.zero_level) * s).astype(np.float32)
        self.quant_zero = self.zero_level - self.quant_min
        self.passthrough = np.zeros(self.scale.shape, bool)
        self.num_bits = self.num_bits or int(np.ceil(np.log2(self.quant_max - self.quant_min + 1)))

    @property
    def per_channel(self):
        return self.scale.ndim == 1

    @property
    def forward(self):
        """PyTorch's per-tensor op on this one grid (a channel's, for a per-channel op: the same arithmetic), for
        the exact staircase (:func:`_exact_staircase`, which checks it against the data's outputs before drawing
        it); no such attribute for torchao's grids or several grids at once."""
        if self.per_channel or not self.label.startswith("torch.fake_quantize_per_"):
            raise AttributeError("forward")
        return lambda v: ts.fake_quantize_per_tensor_affine(v, self.scale, self.zero_level, self.quant_min,
                                                            self.quant_max)

    def summary(self):
        plain = lambda a: np.asarray(a, np.float64).tolist()  # noqa: E731
        return {"op": self.label, "quant_min": self.quant_min, "quant_max": self.quant_max, "scale": plain(self.scale),
                "zero_point": plain(self.zero_level), "min": plain(self.min), "max": plain(self.max)}

    def words(self):
        if self.per_channel:
            return f"{self.label}: {self.scale.size} {self.slices} grids, [{self.quant_min}, {self.quant_max}]"
        return (f"{self.label}: scale {_fmt(self.scale)}, zero point {_fmt(self.zero_level)}, "
                f"[{self.quant_min}, {self.quant_max}] -> [{_fmt(self.min)}, {_fmt(self.max)}], "
                f"{self.quant_max - self.quant_min + 1} levels")


def level_data(op, grid, x, outputs, mask, *, backprops=None, gradients=None, below=None, above=None,
               mask_range=None):
    """:class:`FakeQuantData` of another framework's fake quant, computed by its family: ``grid`` a
    :class:`LevelGrid`, the arrays NumPy, channels (blocks) last when the grid has one per slice."""
    clipped = None if below is None else (np.asarray(below, bool), np.asarray(above, bool))
    return FakeQuantData("grid", op, grid, *(np.asarray(a, np.float32) for a in (x, outputs, mask)),
                         None if backprops is None else np.asarray(backprops, np.float32), mask_range, clipped,
                         None if gradients is None else np.asarray(gradients, np.float32))


def run_variant(variant, inputs, min, max, *, gradients=None, num_bits=8, narrow_range=False, axis=-1, quantize=None):
    """Forward outputs, the STE gradient function and (with ``gradients``) ``backprops_wrt_input``.

    This is the variant dispatch of every plot: add a variant here and all plots draw it.  The mask is
    the gradient op fed with ones, i.e. ``tf.gradients(outputs, inputs)``; ``backprops`` is the gradient
    op fed with ``gradients``.  Runs on the inputs' array module (NumPy or CuPy); returns NumPy arrays.
    ``quantize-dequantize`` (TF's QuantizeV2 + Dequantize round trip, :mod:`qgcli.ops.quantize`) takes its
    attributes from ``quantize`` (dtype, mode, round_mode, ensure_minimum_range); its mask is the STE over
    the adjusted range [output_min, output_max] and its grid a :class:`qgcli.ops.quantize.RoundTripGrid`.
    ``quantize-and-dequantize-v4|-v3|-v2`` (TF's QuantizeAndDequantize) takes ``signed_input``, ``range_given``
    and ``round_mode`` from ``quantize``; ``axis=-1`` is per tensor there, as in TF; its mask is V4Grad's (the
    given range) or, for V2/V3, the pass-through gradient TF registers; its grid a
    :class:`qgcli.ops.quantize_and_dequantize.PlotGrid`.

    >>> d = run_variant("vars", np.array([-9.0, 1.0, 5.0], np.float32), -6.0, 6.0, num_bits=2)
    >>> d.outputs.tolist(), d.mask.tolist()
    ([-8.0, 0.0, 4.0], [0.0, 1.0, 0.0])
    """
    xp = array_module(inputs, gradients)
    x = as_float32(inputs, "inputs", xp)
    g = None if gradients is None else as_float32(gradients, "gradients", xp)
    if g is not None and g.shape != x.shape:
        raise OperandError(f"shape {list(g.shape)} differs from inputs shape {list(x.shape)}", operand="gradients")
    ones = xp.ones_like(x)
    attrs = dict(num_bits=num_bits, narrow_range=narrow_range)
    if variant == "args":
        lo, hi = (_scalar(v, name) for v, name in ((min, "min"), (max, "max")))
        # the forward and the mask (the gradient of ones) in one pass
        outputs, mask = ops.fake_quant_with_min_max_args_and_gradient(ones, x, lo, hi, **attrs)
        backprops = None if g is None else ops.fake_quant_with_min_max_args_gradient(g, x, lo, hi, **attrs)
        grid = ops.nudge(np.float32(lo), np.float32(hi), **attrs)
        mask_range = _nudged_range(grid)
    elif variant == "vars":
        outputs, mask = ops.fake_quant_with_min_max_vars_and_gradient(ones, x, min, max, **attrs)[:2]
        backprops = None if g is None else ops.fake_quant_with_min_max_vars_gradient(g, x, min, max, **attrs)[0]
        grid = ops.nudge(min, max, **attrs)
        mask_range = _nudged_range(grid)
    elif variant == "per-channel":
        pc = dict(attrs, axis=axis)
        outputs, mask = ops.fake_quant_with_min_max_vars_per_channel_and_gradient(ones, x, min, max, **pc)[:2]
        backprops = None if g is None else ops.fake_quant_with_min_max_vars_per_channel_gradient(g, x, min, max, **pc)[0]
        grid = ops.nudge(min, max, **attrs)
        mask_range = _nudged_range(grid)
        x, outputs, mask = (xp.moveaxis(a, axis, -1) for a in (x, outputs, mask))
        backprops = None if backprops is None else xp.moveaxis(backprops, axis, -1)
    elif variant == "quantize-dequantize":
        from qgcli.ops import quantize as qdq

        qaxis = None if np.ndim(to_numpy(min)) == 0 and np.ndim(to_numpy(max)) == 0 else axis
        res, grid = qdq.plot_data(x, min, max, narrow_range=narrow_range, axis=qaxis, **(quantize or {}))
        lo, hi = qdq.range_bounds(res.output_min, res.output_max, x.ndim, qaxis, xp)
        outputs = res.outputs
        mask_range = tuple(np.asarray(to_numpy(b), np.float32) for b in (res.output_min, res.output_max))
        mask = qdq.quantize_dequantize_backprops(ones, x, lo, hi)["backprops_wrt_input"]
        backprops = None if g is None else qdq.quantize_dequantize_backprops(g, x, lo, hi)["backprops_wrt_input"]
        if grid.per_channel:
            x, outputs, mask = (xp.moveaxis(a, qaxis, -1) for a in (x, outputs, mask))
            backprops = None if backprops is None else xp.moveaxis(backprops, qaxis, -1)
    elif variant.startswith("quantize-and-dequantize-v"):
        from qgcli.ops import quantize_and_dequantize as qad

        q = dict(quantize or {})
        qaxis = None if axis is None or axis == -1 else axis
        outputs, mask, backprops, grid, qaxis = qad.plot_data(
            x, 0.0 if min is None else min, 0.0 if max is None else max, g, version=variant.rsplit("-", 1)[1],
            num_bits=num_bits, narrow_range=narrow_range, axis=qaxis, **q)
        if qaxis is not None:
            x, outputs, mask = (xp.moveaxis(a, qaxis, -1) for a in (x, outputs, mask))
            backprops = None if backprops is None else xp.moveaxis(backprops, qaxis, -1)
        op = grid.op
        # V4Grad masks on the range given; V2/V3 register a pass-through gradient (ones everywhere).
        given = tuple(np.asarray(to_numpy(b), np.float32) for b in (grid.min, grid.max))
        mask_range = given if variant.endswith("v4") else (np.float32(-np.inf), np.float32(np.inf))
    else:
        raise QgcliError(f"unknown variant {variant!r} (use {', '.join(TF_OPS)}, quantize-dequantize, "
                         "quantize-and-dequantize-v4/-v3/-v2)", operand="--variant")
    op = TF_OPS.get(variant, op if variant.startswith("quantize-and-dequantize-v") else "QuantizeV2+Dequantize")
    return FakeQuantData(variant, op, grid, to_numpy(x), to_numpy(outputs), to_numpy(mask),
                         None if backprops is None else to_numpy(backprops), mask_range)


def _nudged_range(grid):
    """TF's fake-quant gradient: 1 on the nudged range, inclusive; everywhere where min == max == 0."""
    passthrough = np.asarray(grid.passthrough, bool)
    lo = np.where(passthrough, -np.inf, np.asarray(grid.nudged_min, np.float32)).astype(np.float32)
    hi = np.where(passthrough, np.inf, np.asarray(grid.nudged_max, np.float32)).astype(np.float32)
    return lo, hi


def _scalar(value, name):
    value = np.asarray(to_numpy(value))
    if value.ndim != 0:
        raise OperandError(f"must be a scalar for the args variant, got shape {list(value.shape)}", operand=name)
    return float(value)


def grid_levels(grid):
    """The values the forward op can output on a per-tensor ``grid``, ascending (float32).

    The op computes ``floor((clamp(x) - nudged_min) * inv_scale - quant_zero + 0.5) * scale``; the floor
    lies in ``[-quant_zero, quant_max - quant_min - quant_zero]``.

    >>> from qgcli.ops import nudge
    >>> grid_levels(nudge(-6.0, 6.0, num_bits=2)).tolist()
    [-8.0, -4.0, 0.0, 4.0]
    """
    if grid.passthrough:
        return np.zeros(1, np.float32)
    steps = np.arange(grid.quant_max - grid.quant_min + 1, dtype=np.float32)
    return (steps - np.float32(grid.quant_zero)) * np.float32(grid.scale)


def channel_grid(grid, k):
    """The per-tensor grid of channel ``k`` of a per-channel ``grid``."""
    return replace(grid, **{f.name: np.asarray(np.asarray(getattr(grid, f.name))[k])
                            for f in fields(grid) if isinstance(getattr(grid, f.name), np.ndarray)})


@dataclass
class _View:
    """What a staircase-like plot draws: flat float32 arrays and, when one grid applies, that grid."""

    data: FakeQuantData
    x: np.ndarray
    outputs: np.ndarray
    mask: np.ndarray
    backprops: np.ndarray | None
    grid: object | None
    channel: int | None
    channels: int | None
    mask_range: tuple | None  # (lo, hi) floats of the one grid drawn, else None
    clipped: tuple | None = None  # the op's own (below, above) masks, flat, where the data carries them


def _select(data, channel):
    """Channel ``channel`` (last axis) of ``data``, or everything flattened."""
    per_channel = data.variant == "per-channel" or bool(data.grid.per_channel)
    depth = data.x.shape[-1] if data.x.ndim else None
    if channel is not None:
        if data.x.ndim == 0:
            raise OperandError("is a scalar; there is no channel to select", operand="--channel")
        if not -depth <= channel < depth:
            raise OperandError(f"{channel} is out of range for {depth} channels", operand="--channel")
        channel %= depth
        pick = lambda a: None if a is None else np.ascontiguousarray(a[..., channel]).reshape(-1)  # noqa: E731
        grid = channel_grid(data.grid, channel) if per_channel else data.grid
    else:
        pick = lambda a: None if a is None else a.reshape(-1)  # noqa: E731
        grid = None if per_channel else data.grid
    mask_range = None
    if grid is not None and data.mask_range is not None:
        ends = [np.asarray(b) for b in data.mask_range]
        if all(b.ndim == 0 for b in ends):
            mask_range = tuple(float(b) for b in ends)
        elif channel is not None:
            mask_range = tuple(float(b[channel]) for b in ends)
    clipped = None if data.clipped is None else tuple(pick(a) for a in data.clipped)
    return _View(data, pick(data.x), pick(data.outputs), pick(data.mask), pick(data.backprops), grid, channel,
                 depth if per_channel else None, mask_range, clipped)


# --- subsampling ---------------------------------------------------------------------------------------

def subsample(x, *keys, max_points=DEFAULT_MAX_POINTS):
    """Indices of at most about ``max_points`` elements of 1-d ``x``, in ascending ``x`` order.

    Deterministic: evenly spaced ranks of the sorted finite values (first and last included), plus both
    neighbours of every change in each of ``keys`` while there are no more than ``max_points`` changes,
    so a staircase keeps its vertical steps.  Above ``PRESAMPLE`` elements a seeded random subset of that
    size (drawn with repeats, so a little smaller; non-finite draws dropped), plus the extremes, is sorted
    instead of the whole tensor.

    >>> subsample(np.array([3.0, np.nan, 1.0, 2.0], np.float32)).tolist()
    [2, 3, 0]
    """
    is_finite = np.isfinite(x)
    count = int(np.count_nonzero(is_finite))
    if count > PRESAMPLE:
        # Boolean masks, not index sets: set unions (sorting) or gathers of every index cost seconds.
        keep = np.zeros(x.size, bool)
        keep[np.random.default_rng(0).integers(0, x.size, PRESAMPLE)] = True  # repeats just merge
        keep &= is_finite
        values = x if count == x.size else np.where(is_finite, x, np.nan)
        keep[[int(np.nanargmin(values)), int(np.nanargmax(values))]] = True
        finite = np.flatnonzero(keep)
    else:
        finite = np.flatnonzero(is_finite)
    order = finite[np.argsort(x[finite], kind="stable")]
    if order.size <= max_points:
        return order
    keep = np.zeros(order.size, bool)
    keep[np.linspace(0, order.size - 1, max_points).round().astype(np.int64)] = True
    for key in keys:
        values = key[order]
        change = np.flatnonzero(values[1:] != values[:-1])
        if 0 < change.size <= max_points:
            keep[change] = keep[change + 1] = True
    return order[keep]


# --- figures -------------------------------------------------------------------------------------------

def new_figure(width, height, *, dpi=100):
    """A Figure on an Agg canvas, constrained layout (keeps the requested size, unlike a tight bbox)."""
    fig = Figure(figsize=(width, height), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _fmt(v):
    return f"{float(v):.5g}"


def _grid_words(grid):
    if hasattr(grid, "words"):  # qgcli.ops.quantize.RoundTripGrid describes itself
        return grid.words()
    levels = grid.quant_max - grid.quant_min + 1
    return (f"num_bits={grid.num_bits}{', narrow range' if grid.narrow_range else ''}: "
            f"[{_fmt(grid.min)}, {_fmt(grid.max)}] nudged to [{_fmt(grid.nudged_min)}, {_fmt(grid.nudged_max)}], "
            f"{levels} levels, step {_fmt(grid.scale)}")


def _title(view, what):
    where = ""
    if view.channel is not None:
        where = f", channel {view.channel}"
    if view.grid is None:
        bits = f"num_bits={view.data.grid.num_bits}{', narrow range' if view.data.grid.narrow_range else ''}"
        slices = getattr(view.data.grid, "slices", "channel")
        return f"{what}{where}\n{bits}, {view.channels} per-{slices} grids, flattened (--channel K for one)"
    return f"{what}{where}\n{_grid_words(view.grid)}"


def _grid_dict(grid):
    if grid is not None and hasattr(grid, "summary"):
        return grid.summary()
    return None if grid is None else grid_summary(grid)


def _points_note(shown, total, dropped):
    """How many points a line plot draws (the title of its legend, gid ``"points"``)."""
    text = f"{shown:,} points" if shown == total else f"{shown:,} of {total:,} points (deterministic subsample)"
    if dropped:
        text += f"; {dropped:,} NaN/inf not drawn"
    return text


def _figure_legend(fig, handles, note, *, text_gids=None):
    """One opaque legend below the axes, where no data can be (constrained layout makes room for it), titled
    with ``note``; its columns as many as the figure's width holds.  ``text_gids``: label -> gid of its text."""
    labels = [h.get_label() for h in handles]
    longest = max([len(t) for t in labels] + [1])
    # 7-point DejaVu Sans: about 3.9 px per character at 100 dpi, plus the handle and the padding.
    per_column = longest * 0.039 + 0.55
    ncols = int(max(1, min(len(handles), (fig.get_figwidth() - 0.3) // per_column)))
    legend = fig.legend(handles=handles, loc="outside lower center", ncols=ncols, fontsize=7, framealpha=1.0,
                        title=note, title_fontsize=7)
    legend.get_title().set_gid("points")
    for text in legend.get_texts():
        gid = (text_gids or {}).get(text.get_text())
        if gid is not None:
            text.set_gid(gid)
    return legend


def _step(x, f, lo, hi):
    """``(xs, ys)`` drawing ``f`` as a step function with vertical edges exactly at ``lo`` and ``hi``, when it is
    one: a constant below ``lo``, one on ``[lo, hi]`` (inclusive) and one above ``hi`` on every finite element of
    ``x`` (checked here, so the line drawn is the op's values whatever the sampling); else None."""
    x, f = np.asarray(x), np.asarray(f)
    finite = np.isfinite(x)
    if not finite.any():
        return None
    # Masked reductions, no copies: a figure of 10^8 elements checks its step in a few passes.
    below_part, above_part = x < lo, x > hi  # NaN in neither
    parts = (below_part, finite & ~below_part & ~above_part, above_part)
    values = []
    for part in parts:
        if not part.any():
            values.append(None)
            continue
        least, most = f.min(where=part, initial=np.inf), f.max(where=part, initial=-np.inf)
        if least != most or not np.isfinite(least):
            return None
        values.append(float(least))
    below, inside, above = values
    if inside is None:  # no element on the range: its value there is not known
        return None
    left, right = float(x.min(where=finite, initial=np.inf)), float(x.max(where=finite, initial=-np.inf))
    pieces = [(left, lo, below), (left if below is None else lo, right if above is None else hi, inside),
              (hi, right, above)]
    merged = []  # (start, end, value), equal neighbours joined: no edge where the value does not change
    for a, b, v in (p for p in pieces if p[2] is not None):
        if merged and merged[-1][2] == v:
            merged[-1] = (merged[-1][0], b, v)
        else:
            merged.append((a, b, v))
    return (np.array([end for a, b, _ in merged for end in (a, b)]),
            np.array([v for _, _, v in merged for _ in (0, 1)]))


#: Step edges sampled one by one up to this many (8-bit grids have 255); finer grids are sampled evenly.
STEP_EDGES = 4096
#: Float32 neighbours sampled on each side of an edge: the op's float32 arithmetic may move it a few ulps.
EDGE_ULPS = 8


def _exact_staircase(view, xs, ys):
    """``(xs, ys)`` of the forward op's exact step function over the plotted range (the inputs' finite range
    and the nudged bounds), for TensorFlow's fake-quant variants: the op itself evaluated densely, each step
    edge sampled to the float32 ulp on both sides, joined with vertical edges only where its value changes.
    None for other grids, or if the op so evaluated disagrees with the data's outputs ``ys`` at ``xs`` (so
    what is drawn is the op's function, or nothing)."""
    grid, variant = view.grid, view.data.variant
    finite = np.isfinite(xs)
    if not finite.any():
        return None
    attrs = dict(num_bits=int(grid.num_bits), narrow_range=bool(grid.narrow_range))
    if hasattr(grid, "forward"):  # a grid that evaluates its own op (PyTorch's)
        forward = grid.forward
    elif not isinstance(grid, Grid) or variant not in TF_OPS:
        return None
    elif variant == "args":  # Args multiplies by 1/scale, Vars and PerChannel divide: the edges differ by ulps
        def forward(v):
            return ops.fake_quant_with_min_max_args(v, float(grid.min), float(grid.max), **attrs)
    else:
        def forward(v):
            return ops.fake_quant_with_min_max_vars(v, grid.min, grid.max, **attrs)
    if not np.array_equal(forward(xs[finite]), ys[finite]):
        return None
    nudged = [float(grid.nudged_min), float(grid.nudged_max)]
    lo, hi = min(float(xs[finite].min()), *nudged), max(float(xs[finite].max()), *nudged)
    samples = [np.linspace(lo, hi, 2049, dtype=np.float32), np.float32([lo, hi])]
    steps = int(grid.quant_max) - int(grid.quant_min)
    if not grid.passthrough and 0 < steps <= STEP_EDGES:
        edges = np.float32(nudged[0] + (np.arange(steps) + 0.5) * float(grid.scale))
        edges = edges[(edges >= lo) & (edges <= hi)]
        around = [edges]
        for direction in (-np.inf, np.inf):
            near = edges
            for _ in range(EDGE_ULPS):
                near = np.nextafter(near, np.float32(direction))
                around.append(near)
        samples.append(np.concatenate(around))
    x = np.unique(np.concatenate(samples))
    x = x[(x >= np.float32(lo)) & (x <= np.float32(hi))]
    y = forward(x)
    change = np.flatnonzero(y[1:] != y[:-1]) + 1  # the first sample of each new value: the edge, to an ulp
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [x.size - 1]])
    path_x = np.stack([x[starts], x[ends]], axis=1).reshape(-1)
    path_y = np.repeat(y[starts], 2)
    return path_x, path_y


def _mark_bounds(ax, grid, orientation="v"):
    """Raw bounds dashed grey, nudged bounds dotted green (vertical lines on the x axis)."""
    line = ax.axvline if orientation == "v" else ax.axhline
    handles = []
    for k, value in enumerate((grid.min, grid.max) if getattr(grid, "raw_bounds", True) else ()):
        h = line(float(value), color=C_RAW, ls="--", lw=1.0, gid="raw_bound",
                 label="raw min/max" if k == 0 else "_nolegend_")
        handles.append(h)
    for k, value in enumerate((grid.nudged_min, grid.nudged_max)):
        h = line(float(value), color=C_NUDGED, ls=":", lw=1.6, gid="nudged_bound",
                 label=getattr(grid, "bounds_label", "nudged min/max") if k == 0 else "_nolegend_")
        handles.append(h)
    return tuple(handles[::2])


def _staircase_axes(ax, view, max_points):
    """The notebook's first figure on ``ax``; returns (indices drawn, legend handles, points note)."""
    total = view.x.size
    keys = [view.outputs, view.mask] + ([view.backprops] if view.backprops is not None else [])
    idx = subsample(view.x, *keys, max_points=max_points)
    xs = view.x[idx]
    one_grid = view.grid is not None
    # The data as points; with one grid the op's own step function under them (never a line joining the
    # points: it would slant between levels).  Several grids flattened: points only.
    curve = _exact_staircase(view, xs, view.outputs[idx]) if one_grid else None
    label = f"outputs ({view.data.op})"
    (line,) = ax.plot(xs, view.outputs[idx], ls="none", marker="+", color=C_OUTPUTS, gid="outputs",
                      label=label if curve is None else "_nolegend_")
    if curve is not None:
        (line,) = ax.plot(*curve, ls="-", lw=1.0, color=C_OUTPUTS, gid="outputs_step", label=label)
    handles = [line]
    ax.set_xlabel("floating point (inputs)")
    ax.set_ylabel("de-quantized (outputs)")
    ax.axhline(y=0, color="k", lw=1.2)
    ax.axvline(x=0, color="k", lw=1.2)
    ax.grid(True)
    if one_grid:
        handles += _mark_bounds(ax, view.grid)
        few = view.grid.quant_max - view.grid.quant_min < LINE_LEVELS  # 16/32-bit types: no level array
        levels = grid_levels(view.grid) if few else np.zeros(0, np.float32)
        if 0 < levels.size <= LINE_LEVELS:
            for k, level in enumerate(levels):
                h = ax.axhline(float(level), color=C_OUTPUTS, ls=(0, (1, 3)), lw=0.9, alpha=0.7, gid="level",
                               label=f"{levels.size} levels" if k == 0 else "_nolegend_")
                if k == 0:
                    handles.append(h)
        if 0 < levels.size <= TICK_LEVELS:
            ax.set_yticks([float(v) for v in levels])
    return idx, handles, _points_note(idx.size, total, total - int(np.isfinite(view.x).sum()))


def _summary(kind, view, idx, **extra):
    return {"plot": kind, "op": view.data.op, "variant": view.data.variant, "elements": int(view.x.size),
            "points": int(idx.size), "channel": view.channel, "grid": _grid_dict(view.grid), **extra}


def _view(inputs, min, max, gradients, variant, num_bits, narrow_range, axis, channel, quantize=None, data=None):
    if data is not None:  # another framework's fake quant, computed by its family (level_data)
        return _select(data, channel)
    variant = infer_variant(variant, min, without_min="vars")
    axis = -1 if axis is None else axis
    data = run_variant(variant, inputs, min, max, gradients=gradients, num_bits=num_bits,
                       narrow_range=narrow_range, axis=axis, quantize=quantize)
    if channel is not None and not data.grid.per_channel and data.x.ndim:
        # A per-tensor grid still lets one look at one channel's values: move that axis last.
        if isinstance(axis, bool) or not -data.x.ndim <= axis < data.x.ndim:
            raise OperandError(f"{axis} is out of range for inputs of rank {data.x.ndim}", operand="axis")
        move = lambda a: None if a is None else np.moveaxis(a, axis, -1)  # noqa: E731
        data = FakeQuantData(data.variant, data.op, data.grid, move(data.x), move(data.outputs), move(data.mask),
                             move(data.backprops))
    return _select(data, channel)


def staircase(inputs, min=-6.0, max=6.0, *, num_bits=8, narrow_range=False, variant=None, axis=-1, channel=None,
              max_points=DEFAULT_MAX_POINTS, title=None, width=6.4, height=4.8, quantize=None, data=None):
    """The quantization staircase: inputs vs fake-quantized outputs (the notebook's first figure).

    Axes through 0, grid, the raw (dashed) and nudged (dotted) bounds and the quantization levels marked.
    ``variant``: "args", "vars" or "per-channel" (default: per-channel for vector ``min``, else vars);
    ``channel`` selects one channel of ``axis``, else all elements are drawn flattened.
    ``variant="quantize-dequantize"`` draws the notebook's tf.quantize + tf.dequantize round trip, with
    ``quantize=dict(dtype=..., mode=..., round_mode=..., ensure_minimum_range=...)``.  ``torch=dict(scale=...,
    zero_point=..., quant_min=..., quant_max=..., axis=None)`` draws PyTorch's op instead (min, max unused).

    >>> fig = staircase(np.array([-9.0, -1.0, 5.0], np.float32), -6.0, 6.0, num_bits=2)
    >>> fig.axes[0].get_lines()[0].get_ydata().tolist()
    [-8.0, 0.0, 4.0]
    """
    view = _view(inputs, min, max, None, variant, num_bits, narrow_range, axis, channel, quantize, data)
    fig = new_figure(width, height)
    ax = fig.add_subplot()
    idx, handles, note = _staircase_axes(ax, view, max_points)
    _figure_legend(fig, handles, note)
    ax.set_title(_wrapped(fig, title if title is not None else _title(view, "Quantization staircase"), 9), fontsize=9)
    fig.qgcli_summary = _summary("staircase", view, idx)
    return fig


def ste(inputs, min=-6.0, max=6.0, *, gradients=None, num_bits=8, narrow_range=False, variant=None, axis=-1,
        channel=None, max_points=DEFAULT_MAX_POINTS, title=None, width=6.4, height=None, quantize=None, data=None):
    """The staircase plus the STE gradient function on a red panel of its own below, sharing the x axis (the
    notebook's second figure; on a twin axis its 0 and 1 would fall on level lines and hide them).

    The gradient function is drawn as the step it is, its edges exactly on the range where the op's mask is
    1 (inclusive: TF's nudged bounds), after checking every element's mask against it; the op's values at the
    inputs drawn are the red dots (gid ``"mask"``).  With ``gradients``, ``backprops_wrt_input`` in brown (the
    notebook's third figure) on a third panel, sharing the x axis.  ``height``: 4.8 inches, 7.6
    with ``gradients``.  ``torch``: PyTorch's op, as in :func:`staircase` (its mask drawn as points).

    >>> fig = ste(np.array([-9.0, -1.0, 5.0], np.float32), -6.0, 6.0, num_bits=2)
    >>> fig.axes[1].get_lines()[0].get_ydata().tolist()
    [0.0, 1.0, 0.0]
    >>> step = fig.axes[1].get_lines()[1]
    >>> step.get_gid(), step.get_xdata().tolist()
    ('mask_step', [-9.0, -8.0, -8.0, 4.0, 4.0, 5.0])
    """
    view = _view(inputs, min, max, gradients, variant, num_bits, narrow_range, axis, channel, quantize, data)
    with_bp = view.backprops is not None
    fig = new_figure(width, height if height is not None else (7.6 if with_bp else 4.8))
    grid_spec = fig.add_gridspec(3 if with_bp else 2, 1, height_ratios=[3, 1, 2] if with_bp else [3, 1])
    ax = fig.add_subplot(grid_spec[0])
    idx, handles, note = _staircase_axes(ax, view, max_points)
    ax.set_ylabel("quantized (outputs)")
    ax.set_xlabel("")
    ax.tick_params(axis="x", labelbottom=False)
    xs = view.x[idx]
    ax2 = fig.add_subplot(grid_spec[1], sharex=ax)
    step = None if view.mask_range is None else _step(view.x, view.mask, *view.mask_range)
    label = "gradient function (STE mask)"
    # The op's mask at the points drawn; joined only where there is no step to draw (it would ramp).
    (mask_line,) = ax2.plot(xs, view.mask[idx], ls="-" if view.grid is not None and step is None else "none",
                            marker="." if step is not None or view.grid is None else None, ms=2,
                            color=C_MASK, gid="mask", label=label if step is None else "_nolegend_")
    if step is not None:
        (mask_line,) = ax2.plot(*step, ls="-", lw=1.5, color=C_MASK, gid="mask_step", label=label)
    ax2.set_ylabel("gradient\nfunction", color="r")  # two lines: the panel is short
    ax2.set_ylim(-0.15, 1.15)
    ax2.set_yticks([0.0, 1.0])
    ax2.grid(True, axis="x")
    if view.grid is not None:
        for value in (view.grid.nudged_min, view.grid.nudged_max):
            ax2.axvline(float(value), color=C_NUDGED, ls=":", lw=1.6, gid="nudged_bound:mask")
    ax2.set_xlabel("floating point (inputs)")
    handles.insert(1, mask_line)
    if with_bp:
        ax2.set_xlabel("")
        ax2.tick_params(axis="x", labelbottom=False)
        ax3 = fig.add_subplot(grid_spec[2], sharex=ax)
        # Points only: an upstream gradient joined in x order would be a zigzag.
        (bp_line,) = ax3.plot(xs, view.backprops[idx], ls="none", color=C_BACKPROPS, marker="x", ms=3,
                              gid="backprops", label="backprops_wrt_input")
        ax3.set_ylabel("backprops_wrt_input", color=C_BACKPROPS)
        ax3.set_xlabel("floating point (inputs)")
        ax3.axhline(0, color="k", lw=1.0)
        ax3.axvline(0, color="k", lw=1.0)
        ax3.grid(True)
        if view.grid is not None:
            for value in (view.grid.nudged_min, view.grid.nudged_max):
                ax3.axvline(float(value), color=C_NUDGED, ls=":", lw=1.6, gid="nudged_bound:backprops")
        handles.insert(2, bp_line)
    _figure_legend(fig, handles, note)
    ax.set_title(_wrapped(fig, title if title is not None else _title(view, "Straight-through estimator"), 9), fontsize=9)
    fig.qgcli_summary = _summary("ste", view, idx, backprops=with_bp, backprops_axis="own" if with_bp else None,
                                 mask_drawn="step" if step is not None else "points")
    return fig


def _pixels_per_step(fig, step, span):
    """About how many pixels apart two levels are on an axis spanning ``span`` (90% of the width)."""
    return float(step) / span * 0.9 * fig.get_figwidth() * fig.dpi if span > 0 else 0.0


def hist(inputs, min=-6.0, max=6.0, *, num_bits=8, narrow_range=False, variant=None, axis=-1, channel=None,
         bins=100, log=False, title=None, width=6.4, height=4.8, data=None):
    """Histogram of all inputs with the quantization grid, the clip regions shaded, the clipped shares.

    The shares are counted with the op's mask (inclusive, on the nudged bounds); NaN and infinities are
    not binned but counted in the note.

    >>> fig = hist(np.array([-9.0, -1.0, 1.0, 5.0], np.float32), -6.0, 6.0, num_bits=2, bins=4)
    >>> fig.qgcli_summary["clipped_below"], fig.qgcli_summary["clipped_above"]
    (0.25, 0.25)
    """

    view = _view(inputs, min, max, None, variant, num_bits, narrow_range, axis, channel, data=data)
    data = view.data
    if view.clipped is not None:  # the op's own masks (PyTorch clips the rounded integer, not the float)
        n = view.x.size
        stats = {"elements": n, **{k: int(np.count_nonzero(m)) / n if n else 0.0
                                   for k, m in zip(("clipped_below", "clipped_above"), view.clipped)}}
    elif view.grid is not None:
        stats = clip_statistics(view.x, view.grid)
    else:  # all channels flattened: each counted against its own grid
        stats = clip_statistics(data.x.reshape(-1, data.x.shape[-1]), data.grid)
    fig = new_figure(width, height)
    ax = fig.add_subplot()
    finite = view.x[np.isfinite(view.x)]
    bounds = [] if view.grid is None else [float(view.grid.min), float(view.grid.max),
                                           float(view.grid.nudged_min), float(view.grid.nudged_max)]
    span = [float(finite.min()), float(finite.max())] if finite.size else []
    lo, hi = (min_(span + bounds), max_(span + bounds)) if span + bounds else (-1.0, 1.0)
    pad = 0.04 * (hi - lo) if hi > lo else 1.0
    lo, hi = lo - pad, hi + pad
    data_range = (float(finite.min()), float(finite.max())) if finite.size else (lo, hi)
    if data_range[0] == data_range[1]:
        data_range = (data_range[0] - 0.5, data_range[1] + 0.5)
    counts, edges = np.histogram(finite.astype(np.float64), bins=bins, range=data_range)
    handles = [ax.stairs(counts, edges, fill=True, color=C_OUTPUTS, alpha=0.75, gid="counts", label="inputs",
                         baseline=0.5 if log else 0)]
    ax.set_xlim(lo, hi)
    below, above = stats["clipped_below"], stats["clipped_above"]
    n = stats["elements"]
    # The clipped shares label the shaded regions in the legend (no text over the bars).
    shares = (f"below nudged_min: {100 * below:.2f}% ({round(below * n):,})",
              f"above nudged_max: {100 * above:.2f}% ({round(above * n):,})")
    if view.grid is not None:
        grid = view.grid
        handles += _mark_bounds(ax, grid)
        levels = grid_levels(grid)
        if levels.size <= LINE_LEVELS:
            for k, level in enumerate(levels):
                h = ax.axvline(float(level), color="0.2", ls=(0, (1, 3)), lw=0.8, gid="level",
                               label="levels" if k == 0 else "_nolegend_")
                handles += [h] if k == 0 else []
        elif levels.size <= RUG_LEVELS and _pixels_per_step(fig, grid.scale, hi - lo) >= 3:
            handles.append(ax.vlines(levels.astype(np.float64), 0, 0.025, transform=ax.get_xaxis_transform(),
                                     color="0.2", lw=0.5, gid="level", label="levels"))
        handles.append(ax.axvspan(lo, float(grid.nudged_min), color=C_CLIP, alpha=0.12, lw=0, gid="clip_region",
                                  label=shares[0]))
        handles.append(ax.axvspan(float(grid.nudged_max), hi, color=C_CLIP, alpha=0.12, lw=0, gid="clip_region",
                                  label=shares[1]))
    else:  # one grid per channel: no region to shade, the shares still counted against each channel's grid
        from matplotlib.patches import Patch

        handles += [Patch(color=C_CLIP, alpha=0.12, label=f"{t} (each channel's grid)") for t in shares]
    ax.set_xlabel("floating point (inputs)")
    ax.set_ylabel("count" + (" (log)" if log else ""))
    if log:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.5)
    dropped = view.x.size - finite.size
    note = f"{counted(finite.size, 'value', thousands=True)}, {counted(bins, 'bin')}" + (f"; {dropped:,} NaN/inf not binned" if dropped else "")
    _figure_legend(fig, handles, note, text_gids={h.get_label(): gid for h, gid in
                                                  zip(handles[-2:], ("clipped_below", "clipped_above"))})
    ax.set_title(_wrapped(fig, title if title is not None else _title(view, "Inputs and quantization grid"), 9), fontsize=9)
    fig.qgcli_summary = {"plot": "hist", "op": data.op, "variant": data.variant, "elements": int(view.x.size),
                         "points": int(finite.size), "bins": int(bins), "channel": view.channel,
                         "clipped_below": below, "clipped_above": above, "grid": _grid_dict(view.grid)}
    return fig


min_, max_ = min, max  # the plotting functions shadow the builtins with TF's operand names


# --- per-channel views ----------------------------------------------------------------------------------

def _channel_series(ax, values, *, color, label, gid, bottom=None, offset=0.0, width=0.8, fill=True, alpha=1.0):
    """One value per channel: bars up to BAR_CHANNELS channels, one step outline above (1024 stay readable)."""
    values = np.asarray(values, np.float64)
    depth = values.size
    base = np.zeros(depth) if bottom is None else np.asarray(bottom, np.float64)
    if depth <= BAR_CHANNELS:
        artist = ax.bar(np.arange(depth) + offset, values - base, width=width, bottom=base, color=color if fill else "none",
                        edgecolor=color, alpha=alpha, label=label, gid=gid, lw=0 if fill else 1.4)
        for patch in artist.patches:
            patch.set_gid(gid)
        return artist
    edges = np.arange(depth + 1) - 0.5
    # With a bottom the outline closes over both ends (a range); without, an unfilled series is one line.
    baseline = base if bottom is not None or fill else None
    return ax.stairs(values, edges, baseline=baseline, fill=fill, color=color, alpha=alpha,
                     label=label, gid=gid, lw=1.0)


def _pad_ylim(ax, *arrays):
    """y limits around the finite values with a 6% margin (bars with a bottom stick to their ends)."""
    values = np.concatenate([np.asarray(a, np.float64).reshape(-1) for a in arrays])
    values = values[np.isfinite(values)]
    if not values.size:
        return
    lo, hi = float(values.min()), float(values.max())
    pad = 0.06 * (hi - lo) if hi > lo else 0.5
    ax.set_ylim(lo - pad, hi + pad)


def _wrapped(fig, text, fontsize):
    """``text`` with each line wrapped to the figure's width (DejaVu Sans: about 0.5 em per character)."""
    chars = max(20, int(fig.get_figwidth() * 72 / (0.52 * fontsize)))
    return "\n".join(textwrap.fill(line, chars) for line in text.split("\n"))


def _channel_axis(ax, depth, label):
    ax.set_xlim(-0.6, depth - 0.4)
    from matplotlib.ticker import MaxNLocator

    if depth <= 32:
        ax.set_xticks(range(depth))
        if depth > 16:
            ax.tick_params(axis="x", labelsize=7)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=16, integer=True))
    ax.set_xlabel(label)


def _range_and_clip_panels(axes, data_lo, data_hi, grid, range_label, below, above, clip_labels):
    """The first two per-channel panels: each channel's data range against the grid's [nudged_min,
    nudged_max]; the shares clipped below (down) and above (up), in percent."""
    ax = axes[0]
    _channel_series(ax, data_hi, bottom=data_lo, color="0.55", alpha=0.8, label="data range (finite)", gid="data_range")
    _channel_series(ax, grid.nudged_max, bottom=grid.nudged_min, color=C_NUDGED, fill=False,
                    label=range_label, gid="nudged_range")
    ax.axhline(0, color="k", lw=0.8)
    _pad_ylim(ax, data_lo, data_hi, grid.nudged_min, grid.nudged_max)
    ax.set_ylabel("value")
    ax.legend(**_PANEL_LEGEND)
    ax.grid(True, axis="y", alpha=0.5)
    ax = axes[1]
    below, above = 100 * np.asarray(below), 100 * np.asarray(above)
    _channel_series(ax, above, color=C_CLIP, label=clip_labels[1], gid="clipped_above")
    _channel_series(ax, -below, color="tab:blue", label=clip_labels[0], gid="clipped_below")
    ax.axhline(0, color="k", lw=0.8)
    top = float(np.max(np.concatenate([above, below, [1.0]])))
    ax.set_ylim(-1.1 * top, 1.1 * top)
    ax.yaxis.set_major_formatter(lambda v, _: f"{abs(v):g}")
    ax.set_ylabel("clipped (%)")
    ax.legend(**_PANEL_LEGEND)
    ax.grid(True, axis="y", alpha=0.5)


def channels(inputs, min, max, *, gradients=None, num_bits=8, narrow_range=False, axis=-1, title=None,
             width=8.0, height=None):
    """Per-channel view of FakeQuantWithMinMaxVarsPerChannel: ranges, clipped shares, min/max gradients.

    Panels: the finite data range (grey) against the nudged range (outline) per channel; the share of
    each channel clipped below (down) and above (up) the nudged range; with ``gradients``,
    ``backprop_wrt_min`` and ``backprop_wrt_max`` per channel, from the gradient op.

    >>> x = np.array([[-2.0, 0.5], [0.5, 3.0]], np.float32)
    >>> fig = channels(x, np.array([-1.0, -1.0], np.float32), np.array([1.0, 1.0], np.float32))
    >>> fig.qgcli_summary["clipped_below"], fig.qgcli_summary["clipped_above"]
    ([0.5, 0.0], [0.0, 0.5])
    """

    if np.ndim(to_numpy(min)) != 1:
        raise OperandError(f"plot channels needs one min/max per channel (a vector), got shape "
                           f"{list(np.shape(to_numpy(min)))}", operand="min")
    xp = array_module(inputs, gradients)
    x = as_float32(inputs, "inputs", xp)
    g = xp.ones_like(x) if gradients is None else gradients
    # The gradient op validates min/max/axis/shapes and gives backprop_wrt_min/max per channel.
    _, dmin, dmax = ops.fake_quant_with_min_max_vars_per_channel_gradient(
        g, x, min, max, num_bits=num_bits, narrow_range=narrow_range, axis=axis)
    grid = ops.nudge(min, max, num_bits=num_bits, narrow_range=narrow_range)
    xc = to_numpy(xp.moveaxis(x, axis, -1))
    depth = xc.shape[-1]
    rows = xc.reshape(-1, depth)
    stats = clip_statistics(rows, grid)
    with np.errstate(invalid="ignore"):
        finite = np.where(np.isfinite(rows), rows, np.nan)
    if rows.shape[0]:
        data_lo, data_hi = np.fmin.reduce(finite, axis=0), np.fmax.reduce(finite, axis=0)
    else:
        data_lo = data_hi = np.full(depth, np.nan, np.float32)
    panels = 3 if gradients is not None else 2
    fig = new_figure(width, height if height is not None else 1.0 + 2.4 * panels)
    axes = fig.subplots(panels, 1, sharex=True)
    _range_and_clip_panels(axes, data_lo, data_hi, grid, "nudged [min, max]", stats["channel_clipped_below"],
                           stats["channel_clipped_above"], ("below nudged min", "above nudged max"))
    if gradients is not None:
        ax = axes[2]
        dmin_np, dmax_np = to_numpy(dmin), to_numpy(dmax)
        bars = depth <= BAR_CHANNELS
        _channel_series(ax, dmin_np, color="tab:blue", label="backprop_wrt_min", gid="backprop_wrt_min",
                        offset=-0.2 if bars else 0.0, width=0.4, fill=bars)
        _channel_series(ax, dmax_np, color=C_CLIP, label="backprop_wrt_max", gid="backprop_wrt_max",
                        offset=0.2 if bars else 0.0, width=0.4, fill=bars)
        ax.axhline(0, color="k", lw=0.8)
        ax.set_ylabel("sum of gradients")
        ax.legend(**_PANEL_LEGEND)
        ax.grid(True, axis="y", alpha=0.5)
    _channel_axis(axes[-1], depth, f"channel (axis {axis})")
    bits = f"num_bits={num_bits}{', narrow range' if narrow_range else ''}"
    fig.suptitle(_wrapped(fig, title if title is not None else
                          f"FakeQuantWithMinMaxVarsPerChannel: {counted(depth, 'channel', thousands=True)} x {rows.shape[0]:,} values, "
                          f"{bits}",
                          10), fontsize=10)
    fig.qgcli_summary = {"plot": "channels", "op": "FakeQuantWithMinMaxVarsPerChannel", "channels": int(depth),
                         "elements": int(rows.size), "points": int(depth),
                         "clipped_below": stats["channel_clipped_below"],
                         "clipped_above": stats["channel_clipped_above"], "grid": _grid_dict(grid),
                         "backprops": gradients is not None}
    return fig


def level_channels(data, *, title=None, width=8.0, height=None):
    """Per-channel (per-block) view of another framework's fake quant (:func:`level_data`, a grid per slice):
    the data range against the grid's range, the shares the op itself clips below and above, and, with the
    upstream gradient, the share of its mass the op's gradient blocks (``1 - sum|backprops| / sum|gradients|``
    per slice, from the framework's own gradient)."""
    grid = data.grid
    if not grid.per_channel:
        raise OperandError("plot channels draws a grid per channel (or block); this one is per tensor",
                           operand="inputs")
    depth = data.x.shape[-1]
    rows = data.x.reshape(-1, depth)
    with np.errstate(invalid="ignore"):
        finite = np.where(np.isfinite(rows), rows, np.nan)
        data_lo, data_hi = np.fmin.reduce(finite, axis=0), np.fmax.reduce(finite, axis=0)
    n = rows.shape[0]
    below, above = (m.reshape(-1, depth).sum(axis=0) / n for m in data.clipped)
    blocked = None
    if data.gradients is not None and data.backprops is not None:
        def mass(a):
            return np.nan_to_num(np.abs(a.reshape(-1, depth).astype(np.float64)), posinf=0.0).sum(axis=0)
        total = mass(data.gradients)
        with np.errstate(invalid="ignore", divide="ignore"):
            blocked = np.where(total > 0, 1.0 - mass(data.backprops) / total, 0.0)
    panels = 3 if blocked is not None else 2
    fig = new_figure(width, height if height is not None else 1.0 + 2.4 * panels)
    axes = fig.subplots(panels, 1, sharex=True)
    _range_and_clip_panels(axes, data_lo, data_hi, grid, grid.bounds_label, below, above,
                           ("clipped below", "clipped above"))
    if blocked is not None:
        ax = axes[2]
        _channel_series(ax, 100 * blocked, color=C_BACKPROPS, label="gradient mass blocked", gid="gradient_blocked")
        ax.set_ylim(0, 105)
        ax.set_ylabel("blocked (%)")
        ax.legend(**_PANEL_LEGEND)
        ax.grid(True, axis="y", alpha=0.5)
    _channel_axis(axes[-1], depth, grid.slices)
    fig.suptitle(_wrapped(fig, title if title is not None else
                          f"{data.op}: {counted(depth, grid.slices, thousands=True)} x {n:,} values, "
                          f"[{grid.quant_min}, {grid.quant_max}]", 10), fontsize=10)
    fig.qgcli_summary = {"plot": "channels", "op": data.op, "channels": int(depth), "elements": int(rows.size),
                         "points": int(depth), "clipped_below": below.tolist(), "clipped_above": above.tolist(),
                         "gradient_blocked": None if blocked is None else blocked.tolist(),
                         "grid": grid.summary(), "backprops": blocked is not None}
    return fig


def channel_vectors(vectors, *, title=None, width=8.0, height=None):
    """One panel per per-channel vector (e.g. ``scale_backprop`` / ``offset_backprop`` of ``bn-grad``).

    >>> fig = channel_vectors({"scale_backprop": np.array([1.0, -2.0], np.float32)})
    >>> [float(p.get_height()) for p in fig.axes[0].patches]
    [1.0, -2.0]
    """
    if not vectors:
        raise QgcliError("no per-channel vector to plot")
    arrays = {}
    for name, value in vectors.items():
        value = np.asarray(to_numpy(value))
        if value.ndim != 1:
            raise OperandError(f"must be one value per channel (rank 1), got shape {list(value.shape)}", operand=name)
        if value.dtype.kind not in "fiu" and value.dtype.name != "bfloat16":
            raise OperandError(f"dtype {value.dtype} is not a real number type", operand=name)
        arrays[name] = value.astype(np.float64)
    fig = new_figure(width, height if height is not None else 1.0 + 2.4 * len(arrays))
    axes = np.atleast_1d(fig.subplots(len(arrays), 1, sharex=True))
    colors = ["tab:blue", "tab:red", "tab:purple", "tab:olive"]
    for k, (ax, (name, value)) in enumerate(zip(axes, arrays.items())):
        _channel_series(ax, value, color=colors[k % len(colors)], label=name, gid=name)
        ax.axhline(0, color="k", lw=0.8)
        ax.set_ylabel(name)
        ax.grid(True, axis="y", alpha=0.5)
    depth = max(v.size for v in arrays.values())
    _channel_axis(axes[-1], depth, "channel")
    fig.suptitle(_wrapped(fig, title if title is not None else f"{', '.join(arrays)} per channel ({counted(depth, 'channel', thousands=True)})",
                          10), fontsize=10)
    fig.qgcli_summary = {"plot": "channels", "vectors": list(arrays), "channels": int(depth), "points": int(depth)}
    return fig


# --- estimators overlaid (qgcli plot estimators) -----------------------------------------------------------

#: The estimators drawn when none are named.
DEFAULT_ESTIMATORS = ("ste", "identity", "scaled:0.9", "pact", "ewgs:1")
_EST_STYLES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))


def _estimator_view(inputs, min, max, *, semantics, scale, zero_point, quant_min, quant_max, num_bits, narrow_range,
                    variant, axis, learnable=False, quantize=None):
    """The :class:`qgcli.ops.estimators.Quantized` view of ``inputs`` under TF's or PyTorch's semantics."""

    if variant == "quantize-dequantize":  # the round trip, over QuantizeV2's adjusted range
        from qgcli.ops.quantize import quantize_dequantize_view

        per_tensor = np.ndim(to_numpy(min)) == 0 and np.ndim(to_numpy(max)) == 0
        return quantize_dequantize_view(inputs, min, max, narrow_range=narrow_range,
                                        axis=None if per_tensor else (-1 if axis is None else axis),
                                        **(quantize or {}))[0]
    if semantics == "torch":
        return ts.quantized_view(inputs, scale, zero_point, quant_min, quant_max, axis=axis, learnable=learnable)
    return est.tf_view(inputs, min, max, num_bits=num_bits, narrow_range=narrow_range,
                       variant=infer_variant(variant, min, without_min="vars"), axis=-1 if axis is None else axis)


def _estimator_outputs_op(semantics, variant, min, per_channel):
    """The op whose outputs an estimators figure draws."""
    if semantics == "torch":
        return f"torch.fake_quantize_per_{'channel' if per_channel else 'tensor'}_affine"
    if variant == "quantize-dequantize":
        return "QuantizeV2+Dequantize"
    return TF_OPS[infer_variant(variant, min, without_min="vars")]


def _coinciding(funcs):
    """``{name: earlier name}`` for each gradient function equal (bit for bit, NaN as NaN) to an earlier one."""
    names, same = list(funcs), {}
    for j, name in enumerate(names):
        for other in names[:j]:
            if other not in same and np.array_equal(funcs[name], funcs[other], equal_nan=True):
                same[name] = other
                break
    return same


def estimators(inputs, min=None, max=None, *, gradients=None, names=DEFAULT_ESTIMATORS, semantics="tf", scale=None,
               zero_point=None, quant_min=0, quant_max=255, num_bits=8, narrow_range=False, variant=None, axis=None,
               channel=None, max_points=DEFAULT_MAX_POINTS, title=None, width=7.2, height=None, quantize=None):
    """The staircase with several gradient estimators' gradient functions overlaid (peers.md §6.5).

    Top panel: inputs vs fake-quantized outputs and, on a twin axis, each estimator's gradient function
    ``d outputs / d inputs`` (its input gradient for an upstream gradient of ones).  With ``gradients``, a
    second panel draws each estimator's ``backprops_wrt_input`` for that upstream gradient, labelled with its
    cosine similarity to the STE's and its range gradients (LSQ's scale / zero point, PACT's alpha).
    ``semantics`` "tf" takes ``min``/``max`` (TF's nudged grid), "torch" ``scale``/``zero_point``/
    ``quant_min``/``quant_max`` (``axis``: the channel axis of a 1-d scale).  ``channel`` picks one channel
    (of the channel axis, or of ``axis`` for a per-tensor grid); otherwise everything is drawn flattened.

    >>> fig = estimators(np.array([-9.0, -1.0, 0.5, 5.0], np.float32), -6.0, 6.0, num_bits=2,
    ...                  names=("ste", "identity"))
    >>> [line.get_ydata().tolist() for line in fig.axes[1].get_lines() if line.get_gid().startswith("estimator:")]
    [[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]]
    """

    parsed = [est.parse_estimator(n) if isinstance(n, str) else n for n in names]
    if not parsed:
        raise QgcliError("name at least one estimator", operand="--estimator")
    x = np.asarray(to_numpy(inputs))
    common = dict(semantics=semantics, scale=scale, zero_point=zero_point, quant_min=quant_min, quant_max=quant_max,
                  num_bits=num_bits, narrow_range=narrow_range, variant=variant, axis=axis, quantize=quantize)
    view = _estimator_view(x, min, max, **common)
    learnable_view = (_estimator_view(x, min, max, learnable=True, **common)
                      if semantics == "torch" and any(p.name == "lsq" for p in parsed) else None)
    ones = np.ones(x.shape, np.float32)
    g = None if gradients is None else np.asarray(to_numpy(gradients))
    functions, backprops, extras = {}, {}, {}
    for p in parsed:
        v = learnable_view if (p.name == "lsq" and learnable_view is not None) else view
        functions[p.text] = est.apply_estimator(p, ones, v)[0]["backprops_wrt_input"]
        if g is not None:
            outs, _ = est.apply_estimator(p, g, v)
            backprops[p.text] = outs.pop("backprops_wrt_input")
            extras[p.text] = {k: to_numpy(a).astype(np.float64).tolist() for k, a in outs.items()}

    # Everything channel-last (the view's layout), then one channel or all of it flattened.
    channel_axis = view.axis if view.axis is not None else (None if channel is None else (-1 if axis is None else axis))
    if channel_axis is not None and x.ndim and not -x.ndim <= channel_axis < x.ndim:
        raise OperandError(f"{channel_axis} is out of range for inputs of rank {x.ndim}", operand="axis")
    last = (lambda a: np.moveaxis(np.asarray(to_numpy(a)), channel_axis, -1)) if channel_axis is not None else (
        lambda a: np.asarray(to_numpy(a)))  # noqa: E731
    xs_all = last(x).astype(np.float32)
    if channel is not None:
        if x.ndim == 0:
            raise OperandError("is a scalar; there is no channel to select", operand="--channel")
        depth = xs_all.shape[-1]
        if not -depth <= channel < depth:
            raise OperandError(f"{channel} is out of range for {depth} channels", operand="--channel")
        channel %= depth
        pick = lambda a: np.ascontiguousarray(last(a)[..., channel]).reshape(-1)  # noqa: E731
    else:
        pick = lambda a: last(a).reshape(-1)  # noqa: E731
    xf, outf = pick(x).astype(np.float32), pick(view.restore(view.outputs))
    if channel is not None and view.axis is not None:  # range gradients of the channel drawn
        extras = {k: {n: v[channel] for n, v in e.items()} for k, e in extras.items()}
    funcs = {k: pick(v) for k, v in functions.items()}
    bps = {k: pick(v) for k, v in backprops.items()}
    one_grid = view.axis is None or channel is not None
    idx = subsample(xf, outf, *funcs.values(), max_points=max_points)
    xs = xf[idx]

    fig = new_figure(width, height if height is not None else (7.6 if g is not None else 4.8))
    axes = fig.subplots(2 if g is not None else 1, 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    outputs_op = _estimator_outputs_op(semantics, variant, min, view.axis is not None)
    (line,) = ax.plot(xs, outf[idx], ls="-" if one_grid else "none", marker="+", color=C_OUTPUTS, gid="outputs",
                      label=f"outputs ({outputs_op})")
    handles = [line]
    bounds = None
    ax.set_ylabel("de-quantized (outputs)")
    ax.axhline(0, color="k", lw=1.0)
    ax.axvline(0, color="k", lw=1.0)
    ax.grid(True)
    if one_grid:
        lo, hi = (np.atleast_1d(to_numpy(b)) for b in (view.lo, view.hi))
        k = 0 if view.axis is None else channel
        bounds = (float(lo[k]), float(hi[k]))
        for j, bound in enumerate((lo[k], hi[k])):
            h = ax.axvline(float(bound), color=C_NUDGED, ls=":", lw=1.4, gid="grid_bound",
                           label=("grid min/max" if semantics != "tf" else "output_min/max (adjusted)"
                                  if variant == "quantize-dequantize" else "nudged min/max") if j == 0 else "_nolegend_")
            if j == 0:
                handles.append(h)
    ax2 = ax.twinx()
    ax2.set_ylabel("gradient function (dy = 1)")
    n = len(funcs)
    same = _coinciding(funcs)
    for j, (name, f) in enumerate(funcs.items()):
        # Thick-to-thin, each its own dash pattern, so that estimators that coincide all stay visible; one that
        # coincides with an earlier one also gets sparse markers of its own shape and says so in the legend.
        style = dict(ls=_EST_STYLES[j % len(_EST_STYLES)], lw=1.0 + 1.6 * (n - 1 - j) / ((n - 1) or 1),
                     color=f"C{(j + 1) % 10}", zorder=2 + j)
        label = f"{name} (= {same[name]} here)" if name in same else name
        step = _step(xf, f, *bounds) if bounds is not None else None
        # The values at the points drawn; joined only where there is no exact step to draw (a join would ramp).
        points = dict(marker="." if step is not None or not one_grid else None, ms=2)
        if name in same:
            every = max_(1, idx.size // 12)
            points = dict(marker="os^vD<>"[j % 7], ms=5, mfc="none", markevery=(every * j // n, every))
        joined = one_grid and step is None
        (h,) = ax2.plot(xs, f[idx], **{**style, **points, "ls": style["ls"] if joined else "none"},
                        gid=f"estimator:{name}", label=label if step is None else "_nolegend_")
        if step is not None:
            (h,) = ax2.plot(*step, gid=f"estimator_step:{name}", label=label, **style)
        if name in same:  # the legend shows its dash pattern and its markers
            from matplotlib.lines import Line2D

            h = Line2D([], [], **{**style, **points, "markevery": None}, label=label)
        handles.append(h)
    finite = np.concatenate([f[idx][np.isfinite(f[idx])] for f in funcs.values()] + [np.zeros(1)])
    # (min and max are this function's range operands)
    top = float(np.maximum(1.0, finite.max()))
    ax2.set_ylim(float(np.minimum(0.0, finite.min())) - 0.05 * top, 1.08 * top)
    note = _points_note(idx.size, xf.size, xf.size - int(np.isfinite(xf).sum()))
    if same:
        note += "\n" + "; ".join(f"{k} coincides with {v} on the plotted range" for k, v in same.items())
    cosines = {}
    if g is not None:
        ax3 = axes[1]
        ref = bps.get("ste")
        if ref is None:
            ref = pick(est.apply_estimator("ste", g, view)[0]["backprops_wrt_input"])
        ref64 = np.where(np.isfinite(ref), ref, 0).astype(np.float64)
        for j, (name, b) in enumerate(bps.items()):
            b64 = np.where(np.isfinite(b), b, 0).astype(np.float64)
            denom = float(np.linalg.norm(b64) * np.linalg.norm(ref64))
            cosines[name] = float(b64 @ ref64 / denom) if denom else None
            extra = "; ".join(f"{k.replace('backprop_wrt_', 'd')}={_fmt(np.sum(v))}" for k, v in extras[name].items())
            label = f"{name} (cos vs ste {cosines[name]:.4f})" if cosines[name] is not None else name
            (h,) = ax3.plot(xs, b[idx], ls="none", marker="ox+^vsd"[j % 7], ms=3, mfc="none",
                            color=f"C{(j + 1) % 10}", gid=f"backprops:{name}",
                            label="backprops " + label + (f"; {extra}" if extra else ""))
            handles.append(h)
        ax3.set_ylabel("backprops_wrt_input")
        ax3.axhline(0, color="k", lw=1.0)
        ax3.grid(True)
        ax3.set_xlabel("floating point (inputs)")
    else:
        ax.set_xlabel("floating point (inputs)")
    _figure_legend(fig, handles, note)
    where = f", channel {channel}" if channel is not None else ""
    if title is None:
        if semantics == "torch":
            title = f"Gradient estimators{where}\nPyTorch fake_quantize, quant_min={quant_min}, quant_max={quant_max}"
        else:
            grid = view_grid = None
            try:
                from qgcli.ops import nudge as _nudge

                if variant == "quantize-dequantize":
                    from qgcli.ops.quantize import round_trip_grid

                    view_grid = round_trip_grid(min, max, narrow_range=narrow_range, **(quantize or {}))
                else:
                    view_grid = _nudge(min, max, num_bits=num_bits, narrow_range=narrow_range)
                grid = channel_grid(view_grid, channel) if (view_grid.per_channel and channel is not None) else view_grid
            except QgcliError:
                grid = None
            words = _grid_words(grid) if grid is not None and not grid.per_channel else (
                f"num_bits={num_bits}, {np.size(to_numpy(min))} per-channel grids, flattened (--channel K for one)")
            title = f"Gradient estimators{where}\n{words}"
    ax.set_title(_wrapped(fig, title, 9), fontsize=9)
    fig.qgcli_summary = {
        "plot": "estimators", "op": "TensorFlow" if semantics == "tf" else "PyTorch", "semantics": semantics,
        "outputs_op": outputs_op, "coincide": [[k, v] for k, v in same.items()],
        "estimators": [p.text for p in parsed], "elements": int(xf.size), "points": int(idx.size),
        "channel": channel, "cosine_vs_ste": cosines or None, "range_gradients": extras or None,
    }
    return fig


# --- every layer of a run file (qgcli plot layers) -----------------------------------------------------------

#: Height of one layer's row of bars (inches): 200 layers fit a 36-inch figure, labels at 7 pt.
LAYER_ROW_INCHES = 0.17
#: Longest layer label drawn whole; longer ones keep both ends around an ellipsis.
LAYER_LABEL_CHARS = 90
_LABEL_INCHES_PER_CHAR = 0.05  # DejaVu Sans at 7 pt: about 0.52 em per character, with a margin


def _elided(text, limit=LAYER_LABEL_CHARS):
    text = str(text)
    if len(text) <= limit:
        return text
    head = (limit - 1) // 2
    return text[:head] + "\u2026" + text[len(text) - (limit - 1 - head):]


def _percent_or_nan(v):
    return np.nan if v is None else 100.0 * float(v)


def layers(rows, *, steps=(), trends=None, title=None, width=None, height=None):
    """Per-layer bars of the gradient mass the mask blocks and of the SQNR, one row per layer in the order
    given (worst first: :func:`qgcli.report.layers.worst_first`), and with several steps a layer x step heat
    map of each.

    ``rows`` are :func:`qgcli.report.layers.report_layers` rows (``label`` or ``path``, ``layer``,
    ``gradient_blocked``, ``clipped``, ``sqnr_db``, ``suggested_sqnr_db``); ``steps`` and ``trends`` are
    :func:`qgcli.report.layers.trends`' results (heat-map rows are looked up by ``row["layer"]``).  The
    figure grows with the layer count (:data:`LAYER_ROW_INCHES` per layer) and is as wide as its longest
    label needs, so no label is cut.  A layer without gradients is drawn by its clipped share (grey bars,
    gid ``"clipped"``); the others carry gid ``"gradient_blocked"`` (bar length in percent), the SQNR bars
    ``"sqnr_db"``, the suggested range's SQNR marks ``"suggested_sqnr_db"``, the heat maps
    ``"trend_gradient_blocked"`` (percent) and ``"trend_sqnr_db"``.  Bar ``i`` is centred on y = ``i``.

    >>> fig = layers([{"path": "a", "gradient_blocked": 0.5, "clipped": 0.1, "sqnr_db": 20.0},
    ...               {"path": "b", "gradient_blocked": None, "clipped": 0.2, "sqnr_db": 30.0}])
    >>> [float(p.get_width()) for p in fig.axes[0].patches if p.get_gid() == "gradient_blocked"]
    [50.0]
    """
    rows = list(rows)
    if not rows:
        raise QgcliError("no layer to plot")
    n = len(rows)
    heat = bool(trends) and len(steps) >= 2
    labels = [_elided(r.get("label") or r["path"]) for r in rows]
    label_in = 0.35 + _LABEL_INCHES_PER_CHAR * max(len(t) for t in labels)
    bar_in, heat_in = 2.6, (max(1.6, 0.28 * len(steps) + 0.6) if heat else 0.0)
    if width is None:
        width = label_in + 2 * bar_in + 2 * heat_in + 0.4
    if height is None:
        height = max(3.0, 1.7 + LAYER_ROW_INCHES * n)
    fig = new_figure(width, height)
    ratios = [bar_in, bar_in] + ([heat_in, heat_in] if heat else [])
    axes = fig.subplots(1, len(ratios), sharey=True, gridspec_kw={"width_ratios": ratios})
    y = np.arange(n)
    small = dict(fontsize=7)

    blocked = np.array([_percent_or_nan(r.get("gradient_blocked")) for r in rows])
    clipped = np.array([_percent_or_nan(r.get("clipped")) for r in rows])
    has_grad = np.isfinite(blocked)
    ax = axes[0]
    if has_grad.any():
        ax.barh(y[has_grad], blocked[has_grad], height=0.75, color=C_CLIP, gid="gradient_blocked",
                label="gradient mass blocked")
    if (~has_grad).any():
        ax.barh(y[~has_grad], np.nan_to_num(clipped[~has_grad]), height=0.75, color="0.6", gid="clipped",
                label="clipped (no gradients)")
    ax.set_xlim(0, max(1.0, float(np.nanmax(np.where(has_grad, blocked, clipped), initial=0.0))) * 1.08)
    ax.set_title("gradient mass blocked (%)" + ("\ngrey: clipped (no gradients)" if (~has_grad).any() else ""),
                 **small)
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_ylim(n - 0.5, -0.5)  # worst at the top

    sqnr = np.array([np.nan if r.get("sqnr_db") is None else float(r["sqnr_db"]) for r in rows])
    suggested = np.array([np.nan if r.get("suggested_sqnr_db") is None else float(r["suggested_sqnr_db"])
                          for r in rows])
    ax = axes[1]
    ok = np.isfinite(sqnr)
    ax.barh(y[ok], sqnr[ok], height=0.75, color=C_OUTPUTS, gid="sqnr_db", label="SQNR")
    if np.isfinite(suggested).any():
        ax.plot(suggested, y, linestyle="none", marker="|", markersize=7, color="k", gid="suggested_sqnr_db",
                label="with the suggested range")
    for i in np.flatnonzero(~ok):
        ax.text(0, i, " no error", va="center", fontsize=6, color="0.4", gid="sqnr_inf")
    ax.set_title("SQNR (dB)" + ("\n| with the suggested range" if np.isfinite(suggested).any() else ""), **small)
    finite = np.concatenate([sqnr[ok], suggested[np.isfinite(suggested)], [0.0]])
    lo, hi = float(finite.min()), float(finite.max())
    ax.set_xlim(min(0.0, lo * 1.08), max(1.0, hi * 1.08))
    for ax in axes[:2]:
        ax.grid(axis="x", alpha=0.3)
        ax.tick_params(axis="x", labelsize=7, top=True, labeltop=n > 40)
        ax.tick_params(axis="y", length=0)

    if heat:
        steps = list(steps)
        column = {s: j for j, s in enumerate(steps)}
        grids = {"gradient_blocked": np.full((n, len(steps)), np.nan), "sqnr_db": np.full((n, len(steps)), np.nan)}
        for i, r in enumerate(rows):
            for point in trends.get(r.get("layer"), ()):
                j = column.get(point["step"])
                if j is None:
                    continue
                b = point.get("gradient_blocked")
                grids["gradient_blocked"][i, j] = _percent_or_nan(b if b is not None else point.get("clipped"))
                if point.get("sqnr_db") is not None:
                    grids["sqnr_db"][i, j] = float(point["sqnr_db"])
        for ax, (key, what, cmap, vmin, vmax) in zip(axes[2:], (
                ("gradient_blocked", "blocked by step (%)", "Reds", 0.0, None),
                ("sqnr_db", "SQNR by step (dB)", "viridis", None, None))):
            data = grids[key]
            im = ax.imshow(data, aspect="auto", cmap=cmap, interpolation="nearest", vmin=vmin, vmax=vmax,
                           extent=(-0.5, len(steps) - 0.5, n - 0.5, -0.5))
            im.set_gid("trend_" + key)
            ax.set_title(what, **small)
            ax.set_xticks(range(len(steps)), [_elided(s, 24) for s in steps], rotation=90, fontsize=6)
            if len(steps) > 24:
                from matplotlib.ticker import MaxNLocator

                ax.xaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))
            ax.tick_params(axis="x", top=True, labeltop=n > 40)
            ax.tick_params(axis="y", length=0)
            cbar = fig.colorbar(im, ax=ax, location="bottom", fraction=min(0.1, 0.3 / height), aspect=15, pad=0.01)
            cbar.ax.tick_params(labelsize=6)
    what = f"{counted(n, 'layer', thousands=True)}, worst first" + (f", {len(steps)} steps" if heat else "")
    fig.suptitle(_wrapped(fig, title if title is not None else f"Blocked gradient mass and SQNR per layer: {what}",
                          9), fontsize=9)
    worst = rows[0]
    fig.qgcli_summary = {"plot": "layers", "layers": n, "steps": steps if heat else [],
                         "worst": worst.get("label") or worst["path"],
                         "worst_gradient_blocked": worst.get("gradient_blocked")}
    return fig
