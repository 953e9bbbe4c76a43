"""Per-layer reports over run files: one row per quantizer, worst first, and each layer across steps.

For every fake-quant group of one or more run files (:mod:`qgcli.storage.runfile`): the shares clipped below and
above, the share of gradient mass the mask blocks (TensorFlow's STE mask on the nudged range; PyTorch's
mask for PyTorch groups), the SQNR, the suggested percentile range and its SQNR, and the worst channel of a
per-channel op, from :func:`qgcli.ops.analysis.channel_report` exactly as ``qgcli report`` gives them for
one bundle.  Groups under a first-level group named like ``step_000300`` are one layer at several steps.
"""
import re

#: Keys of one layer row, in the order JSON and CSV give them.
LAYER_KEYS = ("path", "step", "layer", "op", "family", "shape", "num_bits", "channels", "clipped_below",
              "clipped_above", "clipped", "gradient_blocked", "sqnr_db", "suggested_min", "suggested_max",
              "suggested_sqnr_db", "worst_channel", "worst_channel_gradient_blocked", "worst_channel_clipped",
              "straight_through", "scale_path", "rounding")

#: The percentiles ``qgcli report`` searches for a suggested range by default.
DEFAULT_PERCENTILES = (100.0, 99.99, 99.9, 99.5, 99.0, 98.0, 95.0)

_STEP = re.compile(r"^(step|epoch|iter|iteration)[_-]?\d+$", re.IGNORECASE)


def split_step(path):
    """``(step, layer path)``: the first component when it names a step (``step_000300``), else None."""
    head, _, rest = path.partition("/")
    if rest and _STEP.match(head):
        return head, rest
    return None, path


def report_layers(targets, *, options=(), percentiles, device="cpu", on_layer=None, cluster=None):
    """Rows (dicts of :data:`LAYER_KEYS`) for every fake-quant group of ``targets`` (``run.h5`` or
    ``run.h5:group``), the groups skipped (``{"path", "op", "reason"}``) and the overrides applied.
    ``cluster``: a :class:`qgcli.execution.cluster.LayerMap` that computes the rows on its workers."""
    from qgcli.storage import runfile

    rows, skipped = [], []
    for target in targets:
        path, group, container = runfile.open_target(target, operand="BUNDLE",
                                                     not_a_run_file=f"{target} is not an HDF5 run file")
        prefix = path if len(targets) > 1 else None
        order, todo = [], []  # order: each layer's name and its skip reason, or None (a row, from todo)
        try:
            for layer in runfile.discover(container._opened(), group, label=path):
                name = layer.path if prefix is None else f"{prefix}:{layer.path}"
                if layer.kind != runfile.FAKE_QUANT or layer.family == "quantize-dequantize":
                    reason = layer.error or ("not a quantizer" if layer.kind == runfile.BATCH_NORM else
                                             "QuantizeV2 groups are not reported yet")
                else:
                    reason = runfile.validate(layer, "report")
                order.append((name, layer, reason))
                if reason is None:
                    todo.append((name, layer))
            if cluster is None:
                results = []
                for name, layer in todo:
                    if on_layer is not None:
                        on_layer(name)
                    results.append(layer_row(container, None, path, layer, dict(options), percentiles, device))
            else:
                results = cluster.map(layer_row, path, [layer for _, layer in todo], dict(options), percentiles,
                                      device)
            computed = iter(results)
            for name, layer, reason in order:  # in discovery order, as the layers were found
                row = {"error": reason} if reason is not None else next(computed)
                if "error" in row:
                    skipped.append({"path": name, "op": layer.op, "reason": row["error"]})
                    continue
                step, rest = split_step(layer.path)
                if prefix is not None and step is None:
                    step, rest = path, layer.path  # several files: each file is a step
                row.update(path=name, step=step, layer=rest)
                rows.append({k: row.get(k) for k in LAYER_KEYS})
        finally:
            container.close()
    return rows, skipped


def layer_row(container, handle, path, layer, options, percentiles, device):
    """The report row of one layer of the open run file, or ``{"error": reason}`` (the layer is skipped)."""
    from qgcli.errors import QgcliError
    from qgcli.storage.operands import Operands

    operands = Operands.in_group(container, path, layer.path, _literal_specs(layer), literal_ok=("min", "max"),
                                 known=layer.datasets)
    try:
        return _row(layer, operands, options, percentiles, device)
    except (QgcliError, ValueError) as exc:
        return {"error": str(exc)}
    finally:
        operands.close()


def _literal_specs(layer):
    if layer.family == "tf" and layer.variant == "args":
        return {"min": repr(float(layer.attrs.get("min", -6.0))), "max": repr(float(layer.attrs.get("max", 6.0)))}
    return {}


def _attr(layer, options, name, default):
    from qgcli.storage.runfile import _plain

    if name in options:
        return options[name]
    return _plain(layer.attrs[name]) if name in layer.attrs else default


def _row(layer, operands, options, percentiles, device):
    import numpy as np

    from qgcli.storage.operands import to_device

    inputs = operands.get("inputs")
    gradients = operands.get("gradients", required=False)
    num_bits = int(_attr(layer, options, "num_bits", 8))
    narrow_range = bool(_attr(layer, options, "narrow_range", False))
    row = {"op": layer.op, "family": layer.family, "shape": list(np.shape(inputs)), "num_bits": num_bits}
    if layer.family == "torch":
        return {**row, **_torch_row(layer, operands, inputs, gradients, options, num_bits, narrow_range)}
    if layer.family == "torchao":
        return {**row, **_torchao_row(layer, inputs, gradients, device)}
    from qgcli.ops.analysis import channel_report
    from qgcli.families.tf_fake_quant import TF_OPS, load_fake_quant_operands

    _, _, mn, mx, variant = load_fake_quant_operands(operands, layer.variant, with_gradients=False)
    axis = int(_attr(layer, options, "axis", -1)) if variant == "per-channel" else -1
    xp, (g, x) = to_device([gradients, inputs], device)
    report = channel_report(x, mn, mx, g, num_bits=num_bits, narrow_range=narrow_range, variant=variant, axis=axis,
                            percentiles=percentiles)
    t = report.total
    row.update(op=layer.op or TF_OPS[variant], channels=report.channels, clipped_below=t["clipped_below"],
               clipped_above=t["clipped_above"], clipped=t["clipped"], gradient_blocked=t["gradient_blocked"],
               sqnr_db=t["sqnr_db"], suggested_sqnr_db=t["suggested_sqnr_db"])
    if report.per_channel:
        worst = report.order("worst")[0] if report.channels else None
        if worst is not None:
            w = report.row(worst)
            row.update(worst_channel=worst, worst_channel_gradient_blocked=w["gradient_blocked"],
                       worst_channel_clipped=w["clipped"])
    else:
        r = report.row(0)
        row.update(suggested_min=r["suggested_min"], suggested_max=r["suggested_max"])
    return row


def _torch_row(layer, operands, inputs, gradients, options, num_bits, narrow_range):
    """PyTorch's own masks and forward error (no suggested range: PyTorch's observers pick the grid)."""
    import numpy as np

    from qgcli.ops import fake_quant, torch_semantics as ts
    from qgcli.ops.analysis import sqnr_db
    from qgcli.families.torch import torch_layout

    lo, hi = fake_quant.quant_range(num_bits, narrow_range)
    quant_min, quant_max = ts.check_quant_range(int(_attr(layer, options, "quant_min", lo)),
                                                int(_attr(layer, options, "quant_max", hi)))
    scale = np.asarray(operands.get("scale"))
    zero_point = np.asarray(operands.get("zero_point"))
    axis_attr = _attr(layer, options, "axis", None)
    axis, _ = torch_layout(scale.shape, np.shape(inputs), None if axis_attr is None else int(axis_attr))
    if axis is None:
        scale = scale.reshape(())
        zero_point = zero_point.reshape(())
    view = ts.quantized_view(inputs, scale, zero_point, quant_min, quant_max, axis=axis)
    n = int(view.inputs.size)
    x = np.asarray(view.inputs, np.float64)
    fin = np.isfinite(x)
    err = np.where(fin, np.asarray(view.outputs, np.float64) - x, 0.0)
    signal = float(np.sum(np.where(fin, x, 0.0) ** 2))
    row = {"channels": int(scale.size) if axis is not None else 1,
           "clipped_below": float(view.below.sum()) / n if n else 0.0,
           "clipped_above": float(view.above.sum()) / n if n else 0.0,
           "sqnr_db": float(sqnr_db(signal, float(np.sum(err * err))))}
    row["clipped"] = row["clipped_below"] + row["clipped_above"]
    if gradients is not None:
        g = np.asarray(gradients, np.float64)
        if axis is not None:
            g = np.moveaxis(g, axis, -1)
        mag = np.where(np.isfinite(g), np.abs(g), 0.0)
        total = float(mag.sum())
        row["gradient_blocked"] = float(np.where(view.inside, 0.0, mag).sum()) / total if total else 0.0
    if not np.isfinite(row["sqnr_db"]):
        row["sqnr_db"] = None
    return row


def _torchao_row(layer, inputs, gradients, device):
    """torchao's own quantizer (the group's config): clipped shares, the gradient mass its mask blocks, and the
    split of the input gradient (straight-through / scale path / rounding, as ``report --semantics torchao``
    gives it over one tensor); worst channel: the block whose mask blocks most of its gradient."""
    import numpy as np

    from qgcli.backend import to_numpy
    from qgcli.storage.operands import to_device
    from qgcli.ops import torchao_semantics as ts
    from qgcli.ops.analysis import sqnr_db
    from qgcli.families.torchao import config_from_attributes

    config = config_from_attributes(layer.attrs)
    xp, (g, x) = to_device([gradients, inputs], device)
    res = ts.fake_quantize(x, config, g)
    nb, length = res.blocks
    n = nb * length
    x = to_numpy(x).astype(np.float64).reshape(nb, length)
    y = to_numpy(res.outputs).astype(np.float64).reshape(nb, length)
    clipped = ~to_numpy(res.inside).reshape(nb, length)
    fin = np.isfinite(x)
    err = np.where(fin & np.isfinite(y), y - x, 0.0)
    bits = 8 if isinstance(config, ts.Float8FakeQuantizeConfig) else ts.bit_width(config.dtype)
    row = {"num_bits": bits, "channels": nb, "clipped_below": float((clipped & (x < y)).sum()) / n,
           "clipped_above": float((clipped & (x > y)).sum()) / n,
           "sqnr_db": float(sqnr_db(float(np.sum(np.where(fin, x, 0.0) ** 2)), float(np.sum(err * err))))}
    row["clipped"] = row["clipped_below"] + row["clipped_above"]
    if not np.isfinite(row["sqnr_db"]):
        row["sqnr_db"] = None
    if gradients is None:
        return row
    b = {k: to_numpy(v) for k, v in ts.block_statistics(res, xp).items() if k != "elements"}
    mag = np.abs(to_numpy(g).astype(np.float64)).reshape(nb, length)
    mag = np.where(np.isfinite(mag), mag, 0.0)
    blocked = np.where(clipped, mag, 0.0).sum(axis=1)
    per_block = np.divide(blocked, mag.sum(axis=1), out=np.zeros(nb), where=mag.sum(axis=1) > 0)
    total = float(mag.sum())
    mass = sum(float(b[k].sum()) for k in ("straight_through", "scale_path", "rounding"))
    worst = int(np.argmax(per_block))
    row.update(gradient_blocked=float(blocked.sum()) / total if total else 0.0, worst_channel=worst,
               worst_channel_gradient_blocked=float(per_block[worst]),
               worst_channel_clipped=float(clipped[worst].sum()) / length,
               **{k: float(b[k].sum()) / mass if mass else 0.0 for k in ("straight_through", "scale_path", "rounding")})
    return row


def worst_first(rows):
    """Rows ordered worst first: most gradient mass blocked, then lowest SQNR; the quantizers without gradients
    after all those with, by their share clipped (a share of values is no measure of gradient lost, so it
    cannot outrank one)."""
    def key(r):
        no_gradients = r["gradient_blocked"] is None
        metric = r["clipped"] if no_gradients else r["gradient_blocked"]
        sqnr = r["sqnr_db"] if r["sqnr_db"] is not None else float("inf")
        return (no_gradients, -(metric or 0.0), sqnr, r["path"])

    return sorted(rows, key=key)


def trends(rows):
    """Each layer across steps (when there are several): layer -> [{step, gradient_blocked, sqnr_db, clipped}]."""
    steps = sorted({r["step"] for r in rows if r["step"] is not None})
    if len(steps) < 2:
        return steps, {}
    out = {}
    for r in sorted(rows, key=lambda r: (r["layer"], str(r["step"]))):
        out.setdefault(r["layer"], []).append({"step": r["step"], "gradient_blocked": r["gradient_blocked"],
                                               "clipped": r["clipped"], "sqnr_db": r["sqnr_db"]})
    return steps, out


def latest_per_layer(rows):
    """One row per layer: its latest step's (steps ordered as :func:`trends` orders them), in first-seen order."""
    latest = {}
    for r in rows:
        seen = latest.get(r["layer"])
        if seen is None or str(r["step"]) > str(seen["step"]):
            latest[r["layer"]] = r
    return list(latest.values())


def _no_such_layer(handle, file, full):
    """The message for a ``--layer`` that names nothing in the run file: the closest layer paths (a typo,
    most often), else the first layers, so that the user sees what to type."""
    import difflib

    from qgcli.storage import runfile

    paths = [l.path for l in runfile.discover(handle, label=file) if l.op is not None]
    close = difflib.get_close_matches(full, paths, n=5, cutoff=0.6)
    if close:
        return f"{file} has no layer {full!r}; the closest: {', '.join(close)}"
    shown = ", ".join(paths[:10]) + (f" and {len(paths) - 10} more (qgcli inspect lists them)" if len(paths) > 10 else "")
    return f"{file} has no layer {full!r}; its layers: {shown or 'none'}"


def layer_operands(target, path, options):
    """``(Operands, FakeQuantAttributes)`` of one TF fake-quant group of a run file (``report --layer``):
    the group's datasets, its attributes unless typed on the command line."""
    from qgcli.storage import io
    from qgcli.storage import runfile
    from qgcli.errors import QgcliError
    from qgcli.jobs import FakeQuantAttributes
    from qgcli.storage.operands import GroupView, Operands

    file, group = runfile.split_target(target)
    full = "/".join(p for p in ((group or ""), path.strip("/")) if p)
    container = io.Container.open(file)
    try:
        if full and full not in container._opened():
            raise QgcliError(_no_such_layer(container._opened(), file, full), operand="--layer")
        (layer,) = [l for l in runfile.discover(container._opened(), full, label=file) if l.path == full] or [None]
        if layer is None:
            raise QgcliError(f"{file}: {full!r} is not a group holding a quantizer's operands", operand="--layer")
        if layer.family != "tf" or runfile.validate(layer, "report") is not None:
            why = layer.error or f"{layer.op} is not one of TensorFlow's fake-quant ops"
            raise QgcliError(f"{full}: {why}", operand="--layer")
    except BaseException:
        container.close()
        raise
    operands = Operands.in_group(container, file, full, _literal_specs(layer), literal_ok=("min", "max"))
    operands._bundle_container = GroupView(container, full, owns=True)
    attributes = FakeQuantAttributes(num_bits=int(_attr(layer, options, "num_bits", 8)),
                                     narrow_range=bool(_attr(layer, options, "narrow_range", False)),
                                     variant=layer.variant,
                                     axis=(int(_attr(layer, options, "axis", -1))
                                           if layer.variant == "per-channel" else None))
    return operands, attributes
