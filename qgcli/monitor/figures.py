"""``qgcli plot trend``: a history as figures, matplotlib ``Figure`` objects (no pyplot).

Three layer x step heat maps (blocked gradient share, clipped share, share of oscillating weights) over the
curves of the worst layers (the largest blocked share at any sample) for blocked gradient and upstream
gradient norm.  Events (:mod:`qgcli.monitor.trends`) are marked x on the heat map they belong to.
"""

import numpy as np

HEATMAPS = (("blocked", "blocked gradient share"), ("clip", "clipped share"),
            ("oscillating", "oscillating weights share"))
#: the events each heat map marks (x)
MARKS = {"blocked": ("blocked_jump", "gradient_zero"), "clip": ("clipping_jump", "range_collapse", "scale_negative",
                                                                "min_gt_max"),
         "oscillating": ("oscillation",)}


def _matrix(doc, name):
    steps = doc["steps"]
    column = {s: i for i, s in enumerate(steps)}
    m = np.full((len(doc["layers"]), len(steps)), np.nan)
    for r, layer in enumerate(doc["layers"]):
        for step, i in zip(layer["steps"], range(len(layer["steps"]))):
            if name == "clip":
                lo, hi = layer["clip_low"][i], layer["clip_high"][i]
                v = None if lo is None else lo + (hi or 0)
            else:
                v = layer[name][i]
            if v is not None:
                m[r, column[step]] = v
    return m


def trend_figure(doc, *, worst=4, width=10.0, height=None, title=None):
    """The figure of a ``trend`` document (:func:`qgcli.monitor.trends.trend`)."""
    from matplotlib.figure import Figure

    layers, steps = doc["layers"], doc["steps"]
    rows = max(len(layers), 1)
    height = height or min(4 + 0.18 * rows * len(HEATMAPS) + 3, 40)
    fig = Figure(figsize=(width, height), layout="constrained")
    grid = fig.add_gridspec(len(HEATMAPS) + 1, 2, height_ratios=[max(rows, 3)] * len(HEATMAPS) + [8])
    names = [layer["path"] for layer in layers]
    extent = (0.5, len(steps) + 0.5, rows - 0.5, -0.5)
    for k, (name, label) in enumerate(HEATMAPS):
        ax = fig.add_subplot(grid[k, :])
        image = ax.imshow(np.ma.masked_invalid(_matrix(doc, name)), aspect="auto", vmin=0, vmax=1, cmap="magma",
                          interpolation="nearest", extent=extent)
        fig.colorbar(image, ax=ax, pad=0.01, fraction=0.03)
        ax.set_title(label, fontsize=9, loc="left")
        ax.set_yticks(range(len(names)), names, fontsize=6)
        ticks = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), 10)).round().astype(int)) if steps else []
        ax.set_xticks([t + 1 for t in ticks], [str(steps[t]) for t in ticks], fontsize=7)
        for e in doc["events"]:
            if e["kind"] in MARKS[name] and e["layer"] in names and e["step"] in steps:
                ax.plot(steps.index(e["step"]) + 1, names.index(e["layer"]), marker="x", color="cyan", ms=4)
    blocked = [max((v for v in layer["blocked"] if v is not None), default=-1) for layer in layers]
    chosen = [layers[i] for i in np.argsort(blocked)[::-1][:worst] if blocked[i] >= 0]
    for col, (name, label, log) in enumerate((("blocked", "blocked gradient share, worst layers", False),
                                              ("dy_norm", "upstream gradient norm, worst layers", True))):
        ax = fig.add_subplot(grid[len(HEATMAPS), col])
        for layer in chosen:
            xs = [s for s, v in zip(layer["steps"], layer[name]) if v is not None and (not log or v > 0)]
            ys = [v for v in layer[name] if v is not None and (not log or v > 0)]
            ax.plot(xs, ys, marker=".", label=layer["path"])
        if log and any(ax.lines):
            ax.set_yscale("log")
        ax.set_title(label, fontsize=9, loc="left")
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        if chosen and col == 0:
            ax.legend(fontsize=6)
    fig.suptitle(title or f"trend: {len(layers)} layers, {len(steps)} samples", fontsize=10)
    return fig
