"""``qgcli plot hist`` and ``qgcli plot channels`` of a block-format tensor (MX, NVFP4, ONNX QuantizeLinear),
per block, as matplotlib Figures.

Each function takes a block view (:class:`qgcli.families.block_formats.BlockView`, made by the family's
``block_view``: the command asks the family registry, nothing here names a family) and returns a Figure on an
Agg canvas with ``fig.qgcli_summary``, as :mod:`qgcli.report.plots` does.

- :func:`hist`: the inputs in the units of their element grid (each divided by its block's scale, plus the zero
  point), binned, with the grid's values, the region beyond its largest value (saturated) and the one that
  rounds to zero (flushed) shaded; below, the blocks' dynamic range in bits (log2 max|x| - log2 of the smallest
  nonzero |x|) against the format's own (log2 of its largest over its smallest positive value).
- :func:`channels`: per block (in the order of the scales, block axis last), the SQNR, the share of nonzero
  inputs flushed to zero and the dynamic range in bits; blocks whose scale saturates marked.  Above
  :data:`MAX_BLOCKS` blocks, each point is a run of consecutive blocks, drawn with its worst value.
"""
import numpy as np

from qgcli.errors import OperandError
from qgcli.report.plots import (
    _PANEL_LEGEND,
    _channel_axis,
    _channel_series,
    _figure_legend,
    _pad_ylim,
    _points_note,
    _wrapped,
    C_BACKPROPS,
    C_CLIP,
    C_MASK,
    C_OUTPUTS,
    DEFAULT_MAX_POINTS,
    LINE_LEVELS,
    new_figure,
    RUG_LEVELS,
    subsample,
)
from qgcli.report.summaries import percent
from qgcli.report.text import counted

#: Above this many blocks, plot channels draws runs of consecutive blocks (each its worst value).
MAX_BLOCKS = 2048
C_FLUSH = "tab:blue"


def _format_range_bits(levels):
    """log2 of the grid's largest magnitude over its smallest positive one (None for a grid without both)."""
    mag = np.abs(levels[np.isfinite(levels)])
    pos = mag[mag > 0]
    return float(np.log2(pos.max() / pos.min())) if pos.size > 1 else None


def _flush_width(levels):
    """Half the smallest positive value of a grid symmetric about 0 (what rounds to 0), else None."""
    if levels.size < 3 or levels[0] != -levels[-1] or not (levels == 0).any():
        return None
    return float(levels[levels > 0].min()) / 2


def _by_block(view, values):
    """``values`` (shaped like the view's tensor) as ``[blocks, block size]``, in the order of the scales."""
    u = np.asarray(values)
    u = u if view.axis is None else np.moveaxis(u, view.axis, -1)
    return u.reshape(-1, view.block_size)


def _block_values(view, block, values=None):
    """The inputs (in grid units) of block ``block`` of the view (or ``values``, shaped like them)."""
    n = view.stats["blocks"]
    if not 0 <= block < n:
        raise OperandError(f"block {block} is out of range: the tensor has {counted(n, 'block', thousands=True)} "
                           f"(0..{n - 1}, in the order of the scales, block axis last)", operand="--channel")
    return _by_block(view, view.u if values is None else values)[block]


def _summary_note(view):
    st = view.stats
    sqnr = st["sqnr_db"]
    parts = [f"{counted(st['blocks'], 'block', thousands=True)} of {st['block_size']:,}",
             f"flushed to zero {percent(st['flushed'])} of the nonzero inputs"]
    if st.get("saturated_scale_blocks") is not None:
        parts.append(f"scale saturated in {percent(st['saturated_scale_blocks'])} of the blocks")
    parts.append("SQNR exact" if sqnr == float("inf") else f"SQNR {sqnr:.2f} dB")
    return "; ".join(parts)


def hist(view, *, bins=100, log=False, channel=None, title=None, width=6.4, height=None):
    """Histogram of the inputs in their element grid's units, per block (``channel``: block K only), and of the
    blocks' dynamic range against the format's.

    >>> from qgcli.families.block_formats import block_view
    >>> x = np.array([[0.01, 1.0, 2.0, 6.5]], np.float32)
    >>> v = block_view("demo", "demo", "x", x, np.array([[0.0, 1.0, 2.0, 6.0]], np.float32), x,
    ...                [-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6], 2, 1)
    >>> s = hist(v, bins=8).qgcli_summary
    >>> s["beyond_grid"], s["in_flush_zone"], s["format_range_bits"]
    (0.25, 0.25, 3.584962500721156)
    """
    u = view.u.reshape(-1) if channel is None else _block_values(view, int(channel))
    levels = view.levels
    finite = u[np.isfinite(u)]
    g_lo, g_hi = float(levels.min()), float(levels.max())
    fz = _flush_width(levels)
    many = channel is None and view.stats["blocks"] > 1
    fig = new_figure(width, height if height is not None else (6.6 if many else 4.8))
    axes = fig.subplots(2, 1, height_ratios=(3, 2)) if many else [fig.add_subplot()]
    ax = axes[0]
    span = [float(finite.min()), float(finite.max())] if finite.size else []
    lo, hi = min(span + [g_lo]), max(span + [g_hi])
    pad = 0.04 * (hi - lo) if hi > lo else 1.0
    lo, hi = lo - pad, hi + pad
    rng = (float(finite.min()), float(finite.max())) if finite.size else (g_lo, g_hi)
    if rng[0] == rng[1]:
        rng = (rng[0] - 0.5, rng[1] + 0.5)
    counts, edges = np.histogram(finite, bins=bins, range=rng)
    handles = [ax.stairs(counts, edges, fill=True, color=C_OUTPUTS, alpha=0.75, gid="counts", label="inputs",
                         baseline=0.5 if log else 0)]
    ax.set_xlim(lo, hi)
    n = max(1, finite.size)
    beyond = float(((finite < g_lo) | (finite > g_hi)).sum()) / n if finite.size else 0.0
    handles.append(ax.axvspan(lo, g_lo, color=C_CLIP, alpha=0.12, lw=0, gid="saturated_region",
                              label=f"beyond the grid (saturates): {percent(beyond)}"))
    ax.axvspan(g_hi, hi, color=C_CLIP, alpha=0.12, lw=0, gid="saturated_region")
    flush = None
    if fz is not None:
        flush = float(((np.abs(finite) <= fz) & (finite != 0)).sum()) / n if finite.size else 0.0
        handles.append(ax.axvspan(-fz, fz, color=C_FLUSH, alpha=0.15, lw=0, gid="flush_region",
                                  label=f"rounds to zero: {percent(flush)}"))
    if levels.size <= LINE_LEVELS:
        for k, level in enumerate(levels):
            h = ax.axvline(float(level), color="0.2", ls=(0, (1, 3)), lw=0.8, gid="level",
                           label="element values" if k == 0 else "_nolegend_")
            handles += [h] if k == 0 else []
    elif levels.size <= RUG_LEVELS:
        handles.append(ax.vlines(levels, 0, 0.025, transform=ax.get_xaxis_transform(), color="0.2", lw=0.5,
                                 gid="level", label="element values"))
    ax.set_xlabel(view.unit)
    ax.set_ylabel("count" + (" (log)" if log else ""))
    if log:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.5)
    fmt_bits = _format_range_bits(levels)
    wider = None
    if many:
        ax = axes[1]
        dyn = view.per_block["dynamic_range_bits"]
        dyn = dyn[np.isfinite(dyn)]
        if dyn.size:
            d_lo, d_hi = float(dyn.min()), float(dyn.max())
            c, e = np.histogram(dyn, bins=min(bins, 50), range=(d_lo, d_hi if d_hi > d_lo else d_lo + 1))
            ax.stairs(c, e, fill=True, color="0.55", gid="dynamic_range", label="blocks")
        wider = float((dyn > fmt_bits).sum()) / dyn.size if dyn.size and fmt_bits is not None else 0.0
        if fmt_bits is not None:
            ax.axvline(fmt_bits, color=C_CLIP, lw=1.2, gid="format_range",
                       label=f"the format's range, {fmt_bits:.1f} bits ({percent(wider)} of the blocks wider)")
        ax.set_xlabel("block dynamic range (bits): log2 max|x| - log2 min nonzero |x|")
        ax.set_ylabel("blocks")
        ax.legend(**_PANEL_LEGEND)
        ax.grid(True, alpha=0.5)
    dropped = u.size - finite.size
    note = (f"{counted(finite.size, 'value', thousands=True)}, {counted(bins, 'bin')}"
            + (f"; {dropped:,} NaN/inf not binned" if dropped else "") + "\n" + _summary_note(view))
    _figure_legend(fig, handles, note)
    where = "" if channel is None else f", block {int(channel)}"
    axes[0].set_title(_wrapped(fig, title if title is not None else f"{view.title}{where}", 9), fontsize=9)
    st = view.stats
    fig.qgcli_summary = {"plot": "hist", "op": view.op, "elements": int(u.size), "points": int(finite.size),
                         "bins": int(bins), "channel": channel, "blocks": st["blocks"], "block_size": st["block_size"],
                         "flushed": st["flushed"], "saturated_scale_blocks": st.get("saturated_scale_blocks"),
                         "sqnr_db": st["sqnr_db"], "beyond_grid": beyond, "in_flush_zone": flush,
                         "format_range_bits": fmt_bits, "wider_than_format": wider if many else None}
    return fig


def _runs(values, k, worst):
    """``values`` in runs of ``k`` consecutive blocks, each run its ``worst`` (np.nanmin / np.nanmax) value."""
    n = values.size
    pad = (-n) % k
    v = np.concatenate([values.astype(np.float64), np.full(pad, np.nan)]).reshape(-1, k)
    with np.errstate(all="ignore"):
        all_nan = np.isnan(v).all(axis=1)
        out = worst(np.where(np.isnan(v), np.inf if worst is np.nanmin else -np.inf, v), axis=1)
    return np.where(all_nan, np.nan, out)


def channels(view, *, title=None, width=8.0, height=None):
    """Per block: SQNR (dB), share flushed to zero (%), dynamic range (bits, with the format's); blocks whose
    scale saturates marked.

    >>> from qgcli.families.block_formats import block_view
    >>> x = np.array([[1.0, 2.0, 0.01, 4.0]], np.float32)
    >>> v = block_view("demo", "demo", "x", x, np.array([[1.0, 2.0, 0.0, 4.0]], np.float32), x,
    ...                [-4, -2, -1, 0, 1, 2, 4], 2, 1)
    >>> s = channels(v).qgcli_summary
    >>> s["channels"], s["flushed"], s["worst_block"]
    (2, [0.0, 0.5], 1)
    """
    pb = view.per_block
    n = view.stats["blocks"]
    k = max(1, -(-n // MAX_BLOCKS))
    with np.errstate(all="ignore"):
        sqnr = np.where(np.isinf(pb["sqnr_db"]), np.nan, pb["sqnr_db"])
    exact = int(np.isinf(pb["sqnr_db"]).sum())
    series = {"sqnr_db": _runs(sqnr, k, np.nanmin), "flushed": 100 * _runs(pb["flushed"], k, np.nanmax),
              "dynamic_range_bits": _runs(pb["dynamic_range_bits"], k, np.nanmax)}
    sat = pb.get("saturated")
    sat_runs = None if sat is None else _runs(np.asarray(sat, np.float64), k, np.nanmax) > 0
    depth = series["sqnr_db"].size
    fig = new_figure(width, height if height is not None else 1.0 + 2.4 * 3)
    axes = fig.subplots(3, 1, sharex=True)
    ax = axes[0]
    _channel_series(ax, series["sqnr_db"], color=C_OUTPUTS, label="SQNR per block" + (
        f" ({exact:,} exact, not drawn)" if exact else ""), gid="sqnr")
    if np.isfinite(view.stats["sqnr_db"]):
        ax.axhline(view.stats["sqnr_db"], color="k", lw=0.8, ls="--", gid="sqnr_overall",
                   label=f"overall {view.stats['sqnr_db']:.2f} dB")
    _pad_ylim(ax, series["sqnr_db"], [0.0])
    ax.set_ylabel("SQNR (dB)")
    ax.legend(**_PANEL_LEGEND)
    ax.grid(True, axis="y", alpha=0.5)
    ax = axes[1]
    _channel_series(ax, series["flushed"], color=C_FLUSH, label="nonzero inputs flushed to zero", gid="flushed")
    ax.set_ylim(0, max(1.0, float(np.nanmax(series["flushed"])) if np.isfinite(series["flushed"]).any() else 1.0)
                * 1.1)
    ax.set_ylabel("flushed (%)")
    ax.legend(**_PANEL_LEGEND)
    ax.grid(True, axis="y", alpha=0.5)
    ax = axes[2]
    _channel_series(ax, series["dynamic_range_bits"], color="0.45", label="dynamic range", gid="dynamic_range")
    fmt_bits = _format_range_bits(view.levels)
    if fmt_bits is not None:
        ax.axhline(fmt_bits, color=C_CLIP, lw=1.0, gid="format_range", label=f"the format's: {fmt_bits:.1f} bits")
    _pad_ylim(ax, series["dynamic_range_bits"], [0.0] + ([fmt_bits] if fmt_bits is not None else []))
    ax.set_ylabel("range (bits)")
    ax.grid(True, axis="y", alpha=0.5)
    if sat_runs is not None and sat_runs.any():
        where = np.flatnonzero(sat_runs)
        for a in axes:
            a.plot(where, np.full(where.size, 1.0), transform=a.get_xaxis_transform(), ls="none", marker="v",
                   ms=4, color=C_CLIP, gid="saturated_scale", clip_on=False,
                   label="scale saturated" if a is axes[2] else "_nolegend_")
    ax.legend(**_PANEL_LEGEND)
    label = "block" if k == 1 else f"run of {k:,} blocks (worst of each)"
    _channel_axis(axes[-1], depth, f"{label}, in the order of the scales (block axis last)")
    text = title if title is not None else f"{view.title}\n{_summary_note(view)}"
    fig.suptitle(_wrapped(fig, text, 10), fontsize=10)
    order = np.lexsort((np.arange(n), pb["sqnr_db"]))
    fig.qgcli_summary = {"plot": "channels", "op": view.op, "channels": int(n), "points": int(depth),
                         "blocks_per_point": int(k), "elements": int(view.x.size),
                         "sqnr_db": [float(v) for v in pb["sqnr_db"]] if n <= MAX_BLOCKS else None,
                         "flushed": [float(v) for v in pb["flushed"]] if n <= MAX_BLOCKS else None,
                         "saturated_scale_blocks": view.stats.get("saturated_scale_blocks"),
                         "worst_block": int(order[0]) if n else None, "format_range_bits": fmt_bits}
    return fig


# --- plot staircase / plot ste: the element grid's step function ---------------------------------------------

#: How far (relative) an input in grid units may lie from a step edge and still take the level on the edge's
#: other side: the op divides in float32 (NVFP4 multiplies by a float32 reciprocal), the view in float64.
EDGE_SLACK = 2.0 ** -20
#: The most steps drawn: every level of int16 (a step 1 wide reads as a line at that zoom, and is exact).
MAX_STEPS = 1 << 17


def element_step(levels, u, yu):
    """``(xs, ys)``: the element grid's step function (round to the nearest of ``levels``, saturating at both
    ends) over the finite range of ``u``, drawn with vertical edges at the midpoints of the levels, when every
    finite input ``u`` (in grid units) has its output ``yu`` (the element value of the op's code) on it, to the
    float rounding at an edge; None when one has not (the op does something else there: NaN or inf outputs of
    a non-saturating cast, a scale that is NaN) or more than :data:`STEP_EDGES` steps would be drawn.

    >>> xs, ys = element_step(np.array([-1.0, 0.0, 1.0]), np.array([-2.0, 0.2, 0.7]), np.array([-1.0, 0.0, 1.0]))
    >>> xs.tolist(), ys.tolist()
    ([-2.0, -0.5, -0.5, 0.5, 0.5, 0.7], [-1.0, -1.0, 0.0, 0.0, 1.0, 1.0])
    """
    levels = np.unique(np.asarray(levels, np.float64))
    u, yu = np.asarray(u, np.float64).reshape(-1), np.asarray(yu, np.float64).reshape(-1)
    finite = np.isfinite(u) & np.isfinite(yu)  # a NaN or inf output is on no grid: said, not drawn
    if not finite.any() or levels.size == 0:
        return None
    u, yu = u[finite], yu[finite]
    edges = (levels[:-1] + levels[1:]) / 2
    at = np.searchsorted(edges, u, side="left")  # levels[at]: the nearest level (the lower one on an edge)
    on = yu == levels[at]
    if not on.all():  # off by one level only beside an edge, where the op's float rounding decides
        if not edges.size:
            return None
        k = np.flatnonzero(~on)
        a, v, w = at[k], u[k], yu[k]

        def across(edge_at, level_at, exists):
            edge = edges[np.clip(edge_at, 0, edges.size - 1)]
            return exists & (w == levels[np.clip(level_at, 0, levels.size - 1)]) & (
                np.abs(v - edge) <= EDGE_SLACK * np.maximum(1.0, np.abs(edge)))

        if not (across(a, a + 1, a < edges.size) | across(a - 1, a - 1, a > 0)).all():
            return None
    lo, hi = float(u.min()), float(u.max())
    first, last = int(at[u.argmin()]), int(at[u.argmax()])
    if last - first > MAX_STEPS:
        return None
    xs, ys = [], []
    for i in range(first, last + 1):
        a = lo if i == first else float(edges[i - 1])
        b = hi if i == last else float(edges[i])
        xs += [a, b]
        ys += [float(levels[i])] * 2
    return np.array(xs), np.array(ys)


def _grid_inputs(view):
    """The inputs in grid units (``view.u``), where an input the op returns unchanged has no finite value there
    (a zero in an all-zero block: 0 / 0) taken as its output's (``view.yu``): it is that level."""
    with np.errstate(invalid="ignore"):
        same = ~np.isfinite(view.u) & np.isfinite(view.yu) & (view.x == view.y)
    return np.where(same, view.yu, view.u)


def _block_view_arrays(view, channel, *arrays):
    """The view's arrays flattened, or those of block ``channel`` (in the order of the scales)."""
    if channel is None:
        return [None if a is None else np.asarray(a).reshape(-1) for a in arrays]
    return [None if a is None else _block_values(view, int(channel), a) for a in arrays]


def _element_staircase_axes(ax, view, u, yu, max_points):
    """Outputs against inputs in the element grid's units on ``ax``: the op's outputs as points, the element
    grid's step function under them where every point is on it (:func:`element_step`), its levels dotted.
    Returns ``(indices drawn, legend handles, points note, step drawn)``."""
    idx = subsample(u, yu, max_points=max_points)
    step = element_step(view.levels, u, yu)
    label = f"outputs ({view.op}), in grid units"
    (line,) = ax.plot(u[idx], yu[idx], ls="none", marker="+", color=C_OUTPUTS, gid="outputs",
                      label=label if step is None else "_nolegend_")
    if step is not None:
        (line,) = ax.plot(*step, ls="-", lw=1.0, color=C_OUTPUTS, gid="outputs_step", label=label)
    handles = [line]
    finite = u[np.isfinite(u)]
    if finite.size:
        shown = view.levels[(view.levels >= min(0.0, float(yu[idx].min()) if idx.size else 0.0))
                            & (view.levels <= max(0.0, float(yu[idx].max()) if idx.size else 0.0))]
        if 0 < shown.size <= LINE_LEVELS:
            for k, level in enumerate(shown):
                h = ax.axhline(float(level), color=C_OUTPUTS, ls=(0, (1, 3)), lw=0.9, alpha=0.7, gid="level",
                               label="element values" if k == 0 else "_nolegend_")
                handles += [h] if k == 0 else []
    ax.axhline(0, color="k", lw=1.2)
    ax.axvline(0, color="k", lw=1.2)
    ax.grid(True)
    ax.set_xlabel(f"inputs: {view.unit}")
    ax.set_ylabel("outputs, in the same units")
    note = _points_note(idx.size, u.size, u.size - finite.size)
    off = int((np.isfinite(u) & ~np.isfinite(yu)).sum())
    if off:
        note += f"; {off:,} NaN/inf outputs (off the grid) not drawn"
    if step is None and finite.size:
        note += "; outputs off the element grid: no step drawn"
    return idx, handles, note, step is not None


def _block_title(view, what, channel):
    where = "" if channel is None else f", block {int(channel)}"
    every = "" if channel is not None or view.stats["blocks"] <= 1 else " (every block on its element grid)"
    return f"{what}{where}{every}\n{view.title}"


def chosen_blocks(view, channel=None):
    """``[(block, why)]``: the blocks whose staircase :func:`staircase` draws in the data's own units: block
    ``channel``; else the block with the largest finite ``|x|`` and the one with the worst SQNR (one entry when
    they are the same block; no worst block when every block is exact).

    >>> from qgcli.families.block_formats import block_view
    >>> x = np.array([[0.1, 0.3, 2.0, 6.5]], np.float32)
    >>> v = block_view("demo", "demo", "x", x, np.array([[0.0, 0.5, 2.0, 6.0]], np.float32), x,
    ...                [0, 0.5, 1, 2, 4, 6], 2, 1, scale=1.0)
    >>> chosen_blocks(v)
    [(1, 'largest |x|: 6.5'), (0, 'worst SQNR: 3.01 dB')]
    """
    if channel is not None or view.stats["blocks"] == 1:
        return [(0 if channel is None else int(channel), "")]
    with np.errstate(invalid="ignore"):
        mag = np.abs(_by_block(view, view.x).astype(np.float64))
    mag = np.where(np.isfinite(mag), mag, -1.0).max(axis=1)
    sqnr = np.asarray(view.per_block["sqnr_db"], np.float64)
    out = []
    if mag.size and mag.max() >= 0:
        out.append([int(mag.argmax()), [f"largest |x|: {mag.max():.4g}"]])
    scored = np.where(np.isnan(sqnr), np.inf, sqnr)
    if scored.size and np.isfinite(scored.min()):
        worst = int(scored.argmin())
        why = f"worst SQNR: {scored[worst]:.2f} dB"
        if out and out[0][0] == worst:
            out[0][1].append(why)
        else:
            out.append([worst, [why]])
    return [(b, ", ".join(why)) for b, why in out]


def _block_affine(view, block):
    """``(scale, zero)`` of block ``block`` when the whole block has one finite positive scale, else None (a
    tensor drawn as one block with a scale per channel, a NaN scale)."""
    if view.scale is None:
        return None
    s, z = _block_values(view, block, view.scale), _block_values(view, block, view.zero)
    if not s.size or not (s == s[0]).all() or not (z == z[0]).all() or not (np.isfinite(s[0]) and s[0] > 0):
        return None
    return float(s[0]), float(z[0])


def _data_units_axes(ax, view, block, why, max_points):
    """Block ``block``'s staircase in the data's own units on ``ax``: its inputs and the op's outputs as points,
    the element grid's step function times the block's scale (the zero point subtracted first) under them.
    Returns ``(a summary of what was drawn, legend handles)``."""
    scale, zero = _block_affine(view, block)
    x, y = (np.asarray(_block_values(view, block, a), np.float64) for a in (view.x, view.y))
    u, yu = (_block_values(view, block, a) for a in (_grid_inputs(view), view.yu))
    idx = subsample(x, y, max_points=max_points)
    step = element_step(view.levels, u, yu)
    (points,) = ax.plot(x[idx], y[idx], ls="none", marker="+", ms=5, color=C_OUTPUTS, gid="block_outputs",
                        label="the block's inputs -> outputs")
    handles = [points]
    if step is not None:
        xs, ys = ((v - zero) * scale for v in step)
        (line,) = ax.plot(xs, ys, ls="-", lw=1.0, color="0.35", gid="block_step", zorder=1,
                          label="element values x the block's scale")
        handles.append(line)
    ax.axhline(0, color="k", lw=0.8)
    ax.axvline(0, color="k", lw=0.8)
    ax.grid(True, alpha=0.5)
    ax.set_xlabel("inputs", fontsize=8)
    ax.tick_params(labelsize=7)
    head = ("the tensor" if view.stats["blocks"] == 1 else f"block {block}") + ", in the data's units"
    tail = f"\nscale {scale:.4g}" + (f", zero point {zero:g}" if zero else "")
    ax.set_title(head + (f"\n{why}" if why else "") + tail, fontsize=8)
    return {"block": block, "why": why, "scale": scale, "zero": zero, "points": int(idx.size),
            "step_drawn": step is not None}, handles


def staircase(view, *, channel=None, max_points=DEFAULT_MAX_POINTS, title=None, width=6.4, height=None):
    """The quantization staircase of a block format, in its element grid's units (each input divided by its
    block's scale, plus the zero point: every block on one grid), ``channel``: block K only.  The op's outputs
    are points; the element grid's exact step function is drawn under them when every point is on it.  Below,
    in the data's own units, the blocks of :func:`chosen_blocks` (the one with the largest ``|x|`` and the worst
    by SQNR, or block K): their inputs and outputs as points over the element values times the block's scale."""
    u, yu = _block_view_arrays(view, channel, _grid_inputs(view), view.yu)
    blocks = [(b, why) for b, why in chosen_blocks(view, channel) if _block_affine(view, b) is not None]
    fig = new_figure(width, height if height is not None else (8.2 if blocks else 4.8))
    rows = fig.add_gridspec(2 if blocks else 1, 1, height_ratios=[3, 2] if blocks else [1], hspace=0.35)
    ax = fig.add_subplot(rows[0])
    idx, handles, note, step = _element_staircase_axes(ax, view, u, yu, max_points)
    drawn = []
    if blocks:
        cells = rows[1].subgridspec(1, len(blocks), wspace=0.3)
        for k, (block, why) in enumerate(blocks):
            a = fig.add_subplot(cells[k])
            done, more = _data_units_axes(a, view, block, why, max_points)
            drawn.append(done)
            if k == 0:
                a.set_ylabel("outputs", fontsize=8)
                handles += more
    _figure_legend(fig, handles, note + "\n" + _summary_note(view))
    ax.set_title(_wrapped(fig, title if title is not None else _block_title(view, "Quantization staircase",
                                                                             channel), 9), fontsize=9)
    fig.qgcli_summary = {**_step_summary("staircase", view, channel, u, idx, step), "data_units": drawn}
    return fig


def ste(view, *, gradients=None, channel=None, max_points=DEFAULT_MAX_POINTS, title=None, width=6.4, height=None):
    """The staircase (:func:`staircase`) and, on a panel of its own below, the op's gradient function (its
    gradient fed with ones: the identity of torchao's MX / NVFP4 QAT and ModelOpt's QuantizeLinear, or the
    masked STE); with ``gradients``, ``backprops_wrt_input`` on a third panel; the x axis shared."""
    if view.gradient is None:
        raise OperandError(f"{view.op}: no gradient to draw", operand="BUNDLE")
    x = np.asarray(view.x, np.float32)
    mask = np.asarray(view.gradient(np.ones_like(x)), np.float32)
    bp = None if gradients is None else np.asarray(view.gradient(np.asarray(gradients, np.float32)), np.float32)
    u, yu, mask, bp = _block_view_arrays(view, channel, _grid_inputs(view), view.yu, mask, bp)
    fig = new_figure(width, height if height is not None else (7.6 if bp is not None else 4.8))
    grid_spec = fig.add_gridspec(3 if bp is not None else 2, 1, height_ratios=[3, 1, 2] if bp is not None else [3, 1])
    ax = fig.add_subplot(grid_spec[0])
    idx, handles, note, step = _element_staircase_axes(ax, view, u, yu, max_points)
    ax.set_xlabel("")
    ax.tick_params(axis="x", labelbottom=False)
    ax2 = fig.add_subplot(grid_spec[1], sharex=ax)
    finite = np.isfinite(u)
    values = np.unique(mask[finite])
    constant = values.size == 1
    label = "gradient function" + (" (the identity)" if constant and values[0] == 1 else " (masked STE)")
    (mask_line,) = ax2.plot(u[idx], mask[idx], ls="none", marker=".", ms=2, color=C_MASK, gid="mask",
                            label=label if not constant else "_nolegend_")
    if constant and finite.any():  # one value on every element (checked): a line over the plotted range
        (mask_line,) = ax2.plot([float(u[finite].min()), float(u[finite].max())], [float(values[0])] * 2, ls="-",
                                lw=1.5, color=C_MASK, gid="mask_step", label=label)
    ax2.set_ylabel("gradient\nfunction", color="r")
    ax2.set_ylim(-0.15, 1.15)
    ax2.set_yticks([0.0, 1.0])
    ax2.grid(True, axis="x")
    ax2.set_xlabel(f"inputs: {view.unit}")
    handles.insert(1, mask_line)
    if bp is not None:
        ax2.set_xlabel("")
        ax2.tick_params(axis="x", labelbottom=False)
        ax3 = fig.add_subplot(grid_spec[2], sharex=ax)
        (bp_line,) = ax3.plot(u[idx], bp[idx], ls="none", color=C_BACKPROPS, marker="x", ms=3, gid="backprops",
                              label="backprops_wrt_input")
        ax3.set_ylabel("backprops_wrt_input", color=C_BACKPROPS)
        ax3.set_xlabel(f"inputs: {view.unit}")
        ax3.axhline(0, color="k", lw=1.0)
        ax3.grid(True)
        handles.insert(2, bp_line)
    _figure_legend(fig, handles, note + "\n" + _summary_note(view))
    ax.set_title(_wrapped(fig, title if title is not None else _block_title(view, "Straight-through estimator",
                                                                             channel), 9), fontsize=9)
    fig.qgcli_summary = {**_step_summary("ste", view, channel, u, idx, step), "backprops": bp is not None,
                         "mask_drawn": "line" if constant else "points",
                         "mask_values": [float(v) for v in values]}
    return fig


def _step_summary(kind, view, channel, u, idx, step):
    st = view.stats
    return {"plot": kind, "op": view.op, "elements": int(u.size), "points": int(idx.size), "channel": channel,
            "blocks": st["blocks"], "block_size": st["block_size"], "unit": view.unit,
            "step_drawn": bool(step), "sqnr_db": st["sqnr_db"]}
