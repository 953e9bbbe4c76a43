"""A history's per-layer series and its events: the sample where something changed for the worse.

:func:`trend` is ``qgcli trend --json``'s document: ``layers[]`` (``path``, ``kind``, ``role``, ``steps`` and one
list per statistic of :data:`qgcli.monitor.history.STATS`, None where not measured) and ``events[]`` (``step``,
``layer``, ``kind``, ``message``), in step order.  Event kinds and what raises them (consecutive samples):

- ``blocked_jump``: the share of upstream gradient the mask blocks rises by at least 0.25, to at least 0.3;
- ``clipping_jump``: the clipped share (below + above) rises by at least 0.2, to at least 0.25;
- ``scale_negative``: the smallest scale is zero or negative; ``min_gt_max``: range_min > range_max;
- ``range_collapse``: the largest scale falls below 1 % of the largest median scale sampled before it;
- ``gradient_zero``: a layer that takes part in autograd gets an all-zero (or no) upstream gradient;
- ``oscillation``: at least :data:`OSCILLATION_SHARE` of a weight quantizer's weights oscillate;
- ``nan``: NaN or Inf in the inputs or the upstream gradient;
- ``fake_quant_disabled``: fake quant switched off (or off from the first sample).

Each kind is reported once per layer per onset (again only after it went away).
"""
from qgcli.monitor.history import NAMES

OSCILLATION_SHARE = 0.05
COLLAPSE_RATIO = 0.01


def printable(text):
    """``text`` with control characters (from a layer name) shown as ``?``: one line on a terminal."""
    return "".join(c if c.isprintable() else "?" for c in str(text))


def trend(history):
    """The ``trend --json`` document of a :class:`qgcli.monitor.history.History`."""
    layers = []
    for layer in history.layers:
        s = history.series(layer["path"])
        layers.append({"path": layer["path"], "kind": layer["kind"], "role": layer["role"],
                       "module": layer["module"], "steps": s["steps"], **{n: s[n] for n in NAMES}})
    return {"steps": history.steps, "meta": dict(history.meta), "layers": layers, "events": events(history)}


def _value(row, name):
    return row.get(name)


def conditions(row, earlier):
    """``{event kind: message}`` of what holds at one sample ``row`` of a layer (``earlier``: its rows before)."""
    found = {}
    prev = earlier[-1] if earlier else None

    def rise(name, by, to):
        now = row.get(name)
        before = prev.get(name) if prev else None
        return now is not None and before is not None and now - before >= by and now >= to

    if rise("blocked", 0.25, 0.3):
        found["blocked_jump"] = f"blocked gradient {prev['blocked']:.0%} -> {row['blocked']:.0%}"
    clip = _sum(row, "clip_low", "clip_high")
    clip_before = _sum(prev, "clip_low", "clip_high") if prev else None
    if clip is not None and clip_before is not None and clip - clip_before >= 0.2 and clip >= 0.25:
        found["clipping_jump"] = f"clipped {clip_before:.0%} -> {clip:.0%}"
    smin, smax = row.get("scale_min"), row.get("scale_max")
    if smin is not None and smin <= 0:
        found["scale_negative"] = f"scale {smin:.4g} (<= 0)"
    lo, hi = row.get("range_min"), row.get("range_max")
    if lo is not None and hi is not None and lo > hi:
        found["min_gt_max"] = f"range min {lo:.4g} > max {hi:.4g}"
    before = [r.get("scale_median") for r in earlier if r.get("scale_median") is not None]
    if smax is not None and smax > 0 and before and smax < COLLAPSE_RATIO * max(before):
        found["range_collapse"] = f"scale {smax:.4g}, from {max(before):.4g} (below {COLLAPSE_RATIO:.0%} of it)"
    if gradient_missing(row):
        found["gradient_zero"] = ("no upstream gradient reached it" if row.get("dy_norm") is None
                                  else "upstream gradient all zero")
    osc = row.get("oscillating")
    if osc is not None and osc >= OSCILLATION_SHARE:
        found["oscillation"] = f"{osc:.0%} of weights oscillate (largest frequency {row.get('oscillation_max') or 0:.3g})"
    nans = (row.get("nan_inputs") or 0) + (row.get("nan_grads") or 0)
    if nans:
        found["nan"] = (f"{int(row.get('nan_inputs') or 0)} NaN/Inf inputs, {int(row.get('nan_grads') or 0)} "
                        "NaN/Inf upstream gradient elements")
    if row.get("fake_quant_enabled") == 0:
        found["fake_quant_disabled"] = "fake quant disabled"
    return found


def gradient_missing(row):
    """A layer in autograd whose upstream gradient is absent or all zero at this sample."""
    if row.get("needs_grad") != 1 or row.get("fake_quant_enabled") == 0:
        return False
    dy = row.get("dy_norm")
    return dy is None or dy == 0 or row.get("dy_zero") == 1


def _sum(row, *names):
    values = [row.get(n) for n in names]
    return None if any(v is None for v in values) else sum(values)


def rows_of(history, path):
    """The layer's samples as ``[(step, {stat: value})]``."""
    s = history.series(path)
    return [(step, {n: s[n][i] for n in NAMES}) for i, step in enumerate(s["steps"])]


def events(history):
    out = []
    for layer in history.layers:
        rows = rows_of(history, layer["path"])
        active = set()
        for i, (step, row) in enumerate(rows):
            now = conditions(row, [r for _, r in rows[:i]])
            for kind, message in now.items():
                if kind not in active:
                    out.append({"step": step, "layer": layer["path"], "kind": kind, "message": message})
            active = set(now)
    order = {layer["path"]: i for i, layer in enumerate(history.layers)}
    return sorted(out, key=lambda e: (e["step"], order[e["layer"]]))
