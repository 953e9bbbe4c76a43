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
    _wrapped,
    C_CLIP,
    C_OUTPUTS,
    LINE_LEVELS,
    new_figure,
    RUG_LEVELS,
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


def _block_values(view, block):
    """The inputs (in grid units) of block ``block`` of the view."""
    n = view.stats["blocks"]
    if not 0 <= block < n:
        raise OperandError(f"block {block} is out of range: the tensor has {counted(n, 'block', thousands=True)} "
                           f"(0..{n - 1}, in the order of the scales, block axis last)", operand="--channel")
    u = view.u if view.axis is None else np.moveaxis(view.u, view.axis, -1)
    return u.reshape(-1, view.block_size)[block]


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
