"""What an HTML report shows when a layer's section is opened: a histogram of its inputs against its range,
and its per-channel table (the rows ``qgcli report --layer`` gives), kept small enough for hundreds of layers.
"""

import numpy as np

from qgcli.errors import QgcliError
from qgcli.families.tf_fake_quant import load_fake_quant_operands
from qgcli.ops.analysis import channel_report
from qgcli.report.html import CHANNEL_COLUMNS
from qgcli.report.layers import layer_operands

#: Bins of each layer's input histogram, and the channels kept per layer (worst first).
BINS = 48
CHANNELS = 64


def layer_details(targets, rows, *, options=(), percentiles, channels=CHANNELS):
    """``{row path: details}`` for the report ``rows`` of run files ``targets`` (one target per file, as
    :func:`qgcli.report.layers.report_layers` takes them); a layer whose operands cannot be read gets a note."""
    details = {}
    several = len(targets) > 1
    for row in rows:
        target, path = (row["path"].split(":", 1) if several else (targets[0], row["path"]))
        try:
            details[row["path"]] = _details(target, path, row, dict(options), percentiles, channels)
        except (QgcliError, ValueError) as exc:
            details[row["path"]] = {"note": str(exc)}
    return details


def _details(target, path, row, options, percentiles, channels):
    try:  # TensorFlow's fake-quant groups: the per-channel analysis of ``report --layer``
        operands, attributes = layer_operands(target, path, options)
    except QgcliError:
        return {"hist": _histogram(_inputs(target, path), None),
                "note": f"{row.get('op')}: the histogram of its inputs; per-channel rows are given for "
                        "TensorFlow's fake-quant groups"}

    try:
        _, x, mn, mx, variant = load_fake_quant_operands(operands, attributes.variant, with_gradients=False)
        g = operands.get("gradients", required=False)
    finally:
        operands.close()
    axis = -1 if attributes.axis is None else attributes.axis
    report = channel_report(np.asarray(x), mn, mx, g, num_bits=attributes.num_bits,
                            narrow_range=attributes.narrow_range, variant=variant, axis=axis,
                            percentiles=percentiles)
    order = report.order("worst")
    keys = [k for k, _, _ in CHANNEL_COLUMNS]
    table = [{k: report.row(i).get(k) for k in keys} for i in order[:channels]]
    worst = report.row(order[0]) if len(order) else None
    data = np.asarray(x, np.float64)
    if report.per_channel and worst is not None:  # the worst channel's values against its own range
        data = np.moveaxis(data, axis, -1)[..., order[0]]
    rng = None if worst is None else (worst["nudged_min"], worst["nudged_max"])
    out = {"hist": _histogram(data, rng), "channels": table, "columns": [list(c) for c in CHANNEL_COLUMNS]}
    if report.per_channel:
        out["note"] = (f"channel {order[0]} (the worst of {report.channels}) against its nudged range; "
                       f"the {min(channels, report.channels)} worst channels below")
    return out


def _inputs(target, path):
    from qgcli.storage import io, runfile

    file, group = runfile.split_target(target)
    full = "/".join(p for p in ((group or ""), path.strip("/")) if p)
    container = io.Container.open(file)
    try:
        return container.read(f"{full}/inputs")
    finally:
        container.close()


def _histogram(values, rng):
    x = np.asarray(values, np.float64).ravel()
    x = x[np.isfinite(x)]
    if not x.size:
        return None
    lo, hi = float(x.min()), float(x.max())
    if rng is not None:
        lo, hi = min(lo, float(rng[0])), max(hi, float(rng[1]))
    if hi <= lo:
        hi = lo + 1.0
    counts, edges = np.histogram(x, bins=BINS, range=(lo, hi))
    return {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts],
            "range": None if rng is None else [float(rng[0]), float(rng[1])]}
