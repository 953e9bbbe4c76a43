"""Per-layer reports over run files: one row per quantizer, worst first, and each layer across steps.

For every fake-quant group of one or more run files (:mod:`qgcli.storage.runfile`): the shares clipped below and
above, the share of gradient mass the mask blocks (TensorFlow's STE mask on the nudged range; PyTorch's
mask for PyTorch groups), the SQNR, the suggested percentile range and its SQNR, and the worst channel of a
per-channel op, from :func:`qgcli.ops.analysis.channel_report` exactly as ``qgcli report`` gives them for
one bundle.  Groups under a first-level group named like ``step_000300`` are one layer at several steps.
"""
import difflib
import re

import numpy as np

from qgcli import __version__
from qgcli.errors import OptionError, QgcliError
from qgcli.families import groups, registry
from qgcli.families.groups import literal_specs, plain
from qgcli.families.tf_fake_quant import load_fake_quant_operands, TF_OPS
from qgcli.jobs import FakeQuantAttributes
from qgcli.ops.analysis import channel_report
from qgcli.storage import runfile
from qgcli.storage.operands import GroupView, Operands, to_device
from qgcli.report.summaries import describe_arrays, ZERO_GRADIENT_LIMIT

#: Keys of one layer row, in the order JSON and CSV give them.
LAYER_KEYS = ("path", "step", "layer", "op", "family", "shape", "num_bits", "channels", "clipped_below",
              "clipped_above", "clipped", "gradient_blocked", "sqnr_db", "suggested_min", "suggested_max",
              "suggested_sqnr_db", "suggested_scale", "suggested_zero_point", "worst_channel",
              "worst_channel_gradient_blocked", "worst_channel_clipped", "straight_through", "scale_path", "rounding",
              "upstream_gradient", "flushed", "saturated_scale_blocks", "dynamic_range_bits_median",
              "dynamic_range_bits_max", "worst_channel_sqnr_db", "zero_gradient", "exact")

#: The percentiles ``qgcli report`` searches for a suggested range by default.
DEFAULT_PERCENTILES = (100.0, 99.99, 99.9, 99.5, 99.0, 98.0, 95.0)

_STEP = re.compile(r"^(step|epoch|iter|iteration)[_-]?\d+$", re.IGNORECASE)


def split_step(path):
    """``(step, layer path)``: the first component when it names a step (``step_000300``), else None."""
    head, _, rest = path.partition("/")
    if rest and _STEP.match(head):
        return head, rest
    return None, path


def report_layers(targets, *, options=(), percentiles, device="cpu", on_layer=None, cluster=None,
                  range_method="percentile"):
    """Rows (dicts of :data:`LAYER_KEYS`) for every fake-quant group of ``targets`` (``run.h5`` or
    ``run.h5:group``), the groups skipped (``{"path", "op", "reason"}``) and the overrides applied.
    ``cluster``: an entered :class:`qgcli.execution.cluster.Cluster` that computes the rows on its workers."""
    rows, skipped = [], []
    for target in targets:
        path, group, container = runfile.open_target(target, operand="BUNDLE",
                                                     not_a_run_file=f"{target} is not an HDF5 run file")
        prefix = path if len(targets) > 1 else None
        order, todo = [], []  # order: each layer's name and its skip reason, or None (a row, from todo)
        try:
            for layer in groups.discover(container._opened(), group, label=path,
                                         prefetch=0 if cluster is not None else runfile.PREFETCH_BYTES):
                name = layer.path if prefix is None else f"{prefix}:{layer.path}"
                skip = getattr(registry.of(layer), "REPORT_SKIP", None) if layer.family else None
                if layer.family is None or skip:  # an unknown op (its error), or a family report skips
                    reason = layer.error or skip
                else:
                    reason = groups.validate(layer, "report")
                order.append((name, layer, reason))
                if reason is None:
                    todo.append((name, layer))
                else:
                    layer.arrays = {}  # read ahead by discovery, for a layer without a row
            if cluster is None:
                results = []
                for name, layer in todo:
                    if on_layer is not None:
                        on_layer(name)
                    results.append(layer_row(container, None, path, layer, dict(options), percentiles, device,
                                             range_method))
            else:
                results = cluster.map_layers(layer_row, path, [layer for _, layer in todo], dict(options),
                                             percentiles, device, range_method)
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


def layer_row(container, handle, path, layer, options, percentiles, device, range_method="percentile"):
    """The report row of one layer of the open run file, or ``{"error": reason}`` (the layer is skipped)."""
    operands = Operands.in_group(container, path, layer.path, literal_specs(layer), literal_ok=("min", "max"),
                                 known=layer.datasets, arrays=layer.arrays)
    try:
        return _row(layer, _ReadOnce(operands), options, percentiles, device, range_method)
    except (QgcliError, ValueError) as exc:
        return {"error": str(exc)}
    finally:
        operands.close()
        layer.arrays = {}  # what the row did not read of what discovery read ahead


class _ReadOnce:
    """A row's operands, each array read once (the row, the family's analysis and the range loader each ask
    for ``inputs`` and ``gradients``: two HDF5 reads in six were repeats) and handed out read-only, so that
    no reader changes what the next one gets; everything else is the Operands' own."""

    def __init__(self, operands):
        self._operands, self._arrays = operands, {}

    def get(self, name, *, required=True):
        array = self._arrays.get(name)
        if array is None:
            array = self._operands.get(name, required=required)
            if isinstance(array, np.ndarray):
                array.setflags(write=False)
                self._arrays[name] = array
        return array

    def __getattr__(self, attr):
        return getattr(self._operands, attr)


def _attr(layer, options, name, default):
    if name in options:
        return options[name]
    return plain(layer.attrs[name]) if name in layer.attrs else default


def _row(layer, operands, options, percentiles, device, range_method="percentile"):
    """The layer's row; ``upstream_gradient`` says whether a gradient reached it, and where none did (all zero)
    its blocked shares are None: a share of no gradient mass means nothing."""
    row = _family_row(layer, operands, options, percentiles, device, range_method)
    row["upstream_gradient"] = upstream_gradient(operands.get("gradients", required=False))
    if row["upstream_gradient"] != "present":
        row["gradient_blocked"] = None
        if row.get("worst_channel_gradient_blocked") is not None:
            row["worst_channel_gradient_blocked"] = None
    return row


def upstream_gradient(gradients):
    """``"absent"`` (no gradients in the group), ``"zero"`` (every value 0: nothing reached the layer, e.g. a
    quantizer downstream clips everything) or ``"present"``."""
    if gradients is None:
        return "absent"
    g = np.asarray(gradients)
    return "present" if bool(np.any(g != 0)) else "zero"


def _family_row(layer, operands, options, percentiles, device, range_method="percentile"):
    # ONNX QuantizeLinear groups may name their tensor x
    inputs = operands.get("x") if not operands.has("inputs") and operands.has("x") else operands.get("inputs")
    gradients = operands.get("gradients", required=False)
    num_bits = int(_attr(layer, options, "num_bits", 8))
    narrow_range = bool(_attr(layer, options, "narrow_range", False))
    row = {"op": layer.op, "family": layer.family, "shape": list(np.shape(inputs)), "num_bits": num_bits}

    fam = registry.of(layer)
    attr = lambda name, default: _attr(layer, options, name, default)  # noqa: E731
    if hasattr(fam, "channel_report"):  # PyTorch's groups: the per-channel analysis on their own grid
        report, _ = fam.channel_report(layer, operands, inputs, gradients, attr, num_bits, narrow_range,
                                       percentiles=percentiles, device=device)
        return _channel_row(report, row)
    report_row = getattr(fam, "report_row", None)
    if report_row is not None:  # the family's own quantizer (torchao's, the block formats')
        return {**row, **report_row(layer, operands, inputs, gradients, attr, num_bits, narrow_range, device)}
    # TensorFlow's fake-quant groups: its grid's per-channel analysis

    _, _, mn, mx, variant = load_fake_quant_operands(operands, layer.variant, with_gradients=False)
    axis = int(_attr(layer, options, "axis", -1)) if variant == "per-channel" else -1
    xp, (g, x) = to_device([gradients, inputs], device)
    report = channel_report(x, mn, mx, g, num_bits=num_bits, narrow_range=narrow_range, variant=variant, axis=axis,
                            percentiles=percentiles, range_method=range_method)
    return _channel_row(report, dict(row, op=layer.op or TF_OPS[variant]))


def _channel_row(report, row):
    """``row`` completed from a :class:`qgcli.ops.analysis.ChannelReport`: totals, and the worst channel of a
    per-channel op or the suggested range of a per-tensor one."""
    t = report.total
    row.update(channels=report.channels, clipped_below=t["clipped_below"],
               clipped_above=t["clipped_above"], clipped=t["clipped"], gradient_blocked=t["gradient_blocked"],
               sqnr_db=t["sqnr_db"], suggested_sqnr_db=t["suggested_sqnr_db"], exact=t["mse"] == 0)
    if report.per_channel:
        worst = report.order("worst")[0] if report.channels else None
        if worst is not None:
            w = report.row(worst)
            row.update(worst_channel=worst, worst_channel_gradient_blocked=w["gradient_blocked"],
                       worst_channel_clipped=w["clipped"])
    else:
        r = report.row(0)
        row.update(suggested_min=r["suggested_min"], suggested_max=r["suggested_max"],
                   suggested_scale=r["suggested_scale"], suggested_zero_point=r["suggested_zero_point"])
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
    paths = [l.path for l in runfile.discover(handle, label=file) if l.op is not None]
    close = difflib.get_close_matches(full, paths, n=5, cutoff=0.6)
    if close:
        return f"{file} has no layer {full!r}; the closest: {', '.join(close)}"
    shown = ", ".join(paths[:10]) + (f" and {len(paths) - 10} more (qgcli inspect lists them)" if len(paths) > 10 else "")
    return f"{file} has no layer {full!r}; its layers: {shown or 'none'}"


def layer_analysis(layer):
    """How ``report --layer`` and the per-layer plots analyse a classified group: ``"tf"`` (TensorFlow's grid),
    ``"torch"`` (PyTorch's grid: its family's ``channel_report``), ``"blocks"`` (its family's per-block
    report: torchao's quantizers) or None (no per-channel report: batch norm, ...)."""
    if layer.family is None:
        return None
    fam = registry.of(layer)
    if getattr(fam, "CHANNEL_ANALYSIS", False):
        return "tf"
    if hasattr(fam, "channel_report"):
        return "torch"
    if hasattr(fam, "layer_report_doc"):
        return "blocks"
    return None


def layer_group(target, path):
    """``(Operands, layer)`` of the quantizer group ``path`` of the run file ``target`` (``report --layer``,
    the per-layer plots): its datasets open (close the Operands), the classified layer; a QgcliError naming
    --layer for a path that is no such group, or a group without a per-channel report."""
    from qgcli.storage import io

    file, group = runfile.split_target(target)
    full = "/".join(p for p in ((group or ""), path.strip("/")) if p)
    container = io.Container.open(file)
    try:
        if full and full not in container._opened():
            raise QgcliError(_no_such_layer(container._opened(), file, full), operand="--layer")
        (layer,) = [l for l in groups.discover(container._opened(), full, label=file) if l.path == full] or [None]
        if layer is None:
            raise QgcliError(f"{file}: {full!r} is not a group holding a quantizer's operands", operand="--layer")
        if layer_analysis(layer) is None or groups.validate(layer, "report") is not None:
            why = layer.error or f"{layer.op} has no per-channel report (a quantizer of TensorFlow, PyTorch or torchao has)"
            raise QgcliError(f"{full}: {why}", operand="--layer")
    except BaseException:
        container.close()
        raise
    operands = Operands.in_group(container, file, full, groups.literal_specs(layer), literal_ok=("min", "max"))
    operands._bundle_container = GroupView(container, full, owns=True)
    return operands, layer


def layer_operands(target, path, options):
    """``(Operands, FakeQuantAttributes)`` of one TF fake-quant group of a run file (``report --layer``):
    the group's datasets, its attributes unless typed on the command line."""
    operands, layer = layer_group(target, path)
    if layer_analysis(layer) != "tf":
        operands.close()
        raise QgcliError(f"{layer.path}: {layer.op} is not one of TensorFlow's fake-quant ops", operand="--layer")
    attributes = FakeQuantAttributes(num_bits=int(_attr(layer, options, "num_bits", 8)),
                                     narrow_range=bool(_attr(layer, options, "narrow_range", False)),
                                     variant=layer.variant,
                                     axis=(int(_attr(layer, options, "axis", -1))
                                           if layer.variant == "per-channel" else None))
    return operands, attributes


def layer_report(target, path, options, *, percentiles, threshold, sort, top, device):
    """``report --layer`` of a PyTorch or torchao group: ``("channels", (ChannelReport, op, attributes,
    inputs described))`` on PyTorch's grid, or ``("blocks", document)`` of torchao's per-block report; None
    for a TensorFlow group (the command's own path reads those)."""
    operands, layer = layer_group(target, path)
    kind = layer_analysis(layer)
    fam = registry.of(layer)
    if kind == "tf":
        operands.close()
        return None
    if kind == "blocks":
        if sort in ("sqnr", "gain") and not hasattr(fam, "report_analysis"):  # torchao's
            operands.close()
            raise OptionError(f"{layer.op} reports no SQNR per block; use worst, blocked, clipped or channel",
                              param_hint="'--sort'")
        return "blocks", fam.layer_report_doc(layer, operands, threshold=threshold, top=top, device=device,
                                              sort="block" if sort == "channel" else sort)
    try:
        inputs = operands.get("inputs")
        gradients = operands.get("gradients", required=False)
        num_bits = int(_attr(layer, options, "num_bits", 8))
        narrow_range = bool(_attr(layer, options, "narrow_range", False))
        report, attrs = fam.channel_report(layer, operands, inputs, gradients,
                                           lambda name, default: _attr(layer, options, name, default), num_bits,
                                           narrow_range, percentiles=percentiles, device=device)
        described = describe_arrays({k: v for k, v in (("inputs", inputs), ("gradients", gradients))
                                     if v is not None})
    finally:
        operands.close()
    return "channels", (report, layer.op, {"num_bits": num_bits, "narrow_range": narrow_range, **attrs}, described)


#: The schema number of a run-file report's JSON document (``report RUN --json``).
LAYERS_SCHEMA = 1


def run_file_document(targets, *, options=(), percentiles=DEFAULT_PERCENTILES, threshold=0.05, device="cpu",
                      range_method="percentile"):
    """``qgcli report RUN --json``'s document of run files ``targets``, computed here (no cluster, no progress)."""
    rows, skipped = report_layers(targets, options=options, percentiles=percentiles, device=device,
                                  range_method=range_method)
    return layers_document(targets, rows, skipped, threshold=threshold, percentiles=percentiles)


def layers_document(targets, rows, skipped, *, threshold, percentiles, top=None, cluster=None):
    """The ``report --json`` document of run files ``targets`` from :func:`report_layers`' ``rows`` and
    ``skipped``: the rows worst first and flagged above ``threshold``, the trends, the verdict."""
    rows = worst_first(rows)
    for row in rows:
        metric = row["gradient_blocked"] if row["gradient_blocked"] is not None else row["clipped"]
        row["flagged"] = bool(metric is not None and metric > threshold) or _mostly_zero(row)
    steps, trend = trends(rows)
    return {"command": "report", "schema": LAYERS_SCHEMA, "qgcli_version": __version__, "run_files": list(targets),
            "threshold": threshold, "percentiles": list(percentiles), "steps": steps,
            "layers": rows if top is None else rows[:top], "trends": trend, "skipped": skipped,
            "verdict": layers_verdict(rows, threshold), **({"cluster": cluster} if cluster else {})}


def layers_verdict(rows, threshold):
    flagged = [r for r in rows if r["flagged"]]
    if not rows:
        return "Verdict: no quantizer to report."
    starved = _no_gradient_clause(rows)
    if starved:
        rest = layers_verdict([r for r in rows if r.get("upstream_gradient") != "zero"], threshold)
        return f"Verdict: {starved}; " + rest[len("Verdict: "):]
    zero = [r for r in rows if _mostly_zero(r)]
    if zero:
        rest = layers_verdict([r for r in rows if not _mostly_zero(r)], threshold)[len("Verdict: "):]
        names = ", ".join(f"{r['path']} {100 * r['zero_gradient']:.1f}%" for r in zero[:3])
        more = f" and {len(zero) - 3} more" if len(zero) > 3 else ""
        noun = "layer gets" if len(zero) == 1 else "layers get"
        rest = "otherwise " + rest[len("OK, "):] if rest.startswith("OK, ") else rest
        return (f"Verdict: not OK, {len(zero)} {noun} an input gradient of exactly 0 at more than "
                f"{100 * ZERO_GRADIENT_LIMIT:g}% of the elements whose dy is not: {names}{more}; {rest}")
    if not flagged:
        return f"Verdict: OK, no layer loses more than {100 * threshold:g}% of its gradient mass."
    names = ", ".join(f"{r['path']} {100 * (r['gradient_blocked'] if r['gradient_blocked'] is not None else r['clipped']):.1f}%"
                      for r in flagged[:3])
    more = f" and {len(flagged) - 3} more" if len(flagged) > 3 else ""
    return (f"Verdict: {len(flagged)} of {len(rows)} layers lose more than {100 * threshold:g}% of their gradient "
            f"mass (or clip more, without gradients): {names}{more}.")


def _mostly_zero(row):
    """A row (torchao's groups) whose input gradient is exactly 0 where dy is not above ZERO_GRADIENT_LIMIT."""
    return (row.get("zero_gradient") or 0.0) > ZERO_GRADIENT_LIMIT


def _no_gradient_clause(rows):
    """"no gradient reaches N layers: PATH clips 100%" when some layers get an all-zero upstream gradient (the
    cause named where a quantizer of the same step clips all but a thousandth of its values), else None."""
    starved = [r for r in rows if r.get("upstream_gradient") == "zero"]
    if not starved:
        return None
    steps = {r["step"] for r in starved}
    causes = [r for r in rows if r.get("upstream_gradient") != "zero" and r["step"] in steps
              and r["clipped"] is not None and r["clipped"] >= 0.999]
    noun = "layer" if len(starved) == 1 else "layers"
    cause = ", ".join(f"{r['path']} clips {100 * r['clipped']:.0f}%" for r in causes[:3])
    return f"no gradient reaches {len(starved)} {noun}" + (f": {cause}" if cause else "")
