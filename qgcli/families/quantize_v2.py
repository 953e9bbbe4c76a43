"""TensorFlow's QuantizeV2 + Dequantize round trip (``--variant quantize-dequantize``), the tutorial
notebook's own fake quant, and its gradient.

The forward writes ``outputs`` (dequantized float32), ``quantized`` (the integers, in the natural NumPy dtype
of ``--dtype``), ``output_min`` and ``output_max``; the gradient is an estimator over the adjusted range
``[output_min, output_max]`` (default: the clipped straight-through estimator; the notebook's ``0.9 * dy``
is ``--estimator scaled:0.9``).
"""
import numpy as np

from qgcli.backend import to_numpy
from qgcli.errors import OptionError

from qgcli.families.common import check_grad_factor, parse_estimator, QD_VARIANT as VARIANT
from qgcli.families.groups import fake_quant_basics
from qgcli.families.registry import FAKE_QUANT
from qgcli.jobs import FakeQuantJob, QuantizeAttributes, Result
from qgcli.ops import quantize as q
from qgcli.ops.estimators import apply_estimator, lsq_grad_factor
from qgcli.report.tables import Col, print_items, print_table
from qgcli.storage.operands import to_device
from qgcli.report.summaries import describe_arrays, fmt_value as _fmt, json_safe, percent, render_closing_lines
from qgcli.report.text import counted

NAME, KIND = "quantize-dequantize", FAKE_QUANT
OP = "QuantizeV2+Dequantize"
LITERAL_OK = ("min", "max")
RUN_FILE_OPS = {"QuantizeV2": None}
GROUP_OPERANDS = {None: (("inputs", "min", "max"), ("gradients",))}
#: ``report`` gives no per-layer rows of these groups yet.
REPORT_SKIP = "QuantizeV2 groups are not reported yet"


def attributes(job):
    """QuantizeV2's attributes of the job, in the order they are reported and written."""
    q = job.quantize
    return {"dtype": q["dtype"].lower(), "mode": q["mode"].upper(), "round_mode": q["round_mode"].upper(),
            "narrow_range": bool(job.narrow_range), "ensure_minimum_range": float(q["ensure_minimum_range"])}


def compute(job, operands):
    with_gradients, axis, est = job.with_gradients, job.axis, job.estimator
    attrs = attributes(job)
    gradients = operands.get("gradients") if with_gradients else None
    inputs = operands.get("inputs")
    mn, mx = operands.get("min"), operands.get("max")
    if axis is None and (np.size(mn) > 1 or np.size(mx) > 1):
        raise OptionError(f"min/max have {max(np.size(mn), np.size(mx))} entries: give --axis K for one "
                                 "range per slice of axis K (QuantizeV2's axis)", param_hint="'--axis'")
    xp, (gradients, inputs) = to_device([gradients, inputs], job.output.device)
    outputs, summary = _compute(job.command, operands, gradients, inputs, mn, mx, attrs, axis, est,
                                job.grad_factor, xp, job.output.destination)
    op = OP + ("Gradient" if with_gradients else "")
    file_attrs = {"op": op, "variant": VARIANT, **attrs, "axis": axis}
    if est is not None:
        file_attrs["estimator"] = est.text
        file_attrs["grad_factor"] = summary.get("estimator", {}).get("grad_factor")

    def figure():
        from qgcli.report import plots

        return plots.ste(inputs, mn, mx, gradients=gradients, variant=VARIANT, narrow_range=job.narrow_range,
                         axis=-1 if axis is None else axis,
                         quantize={k: attrs[k] for k in ("dtype", "mode", "round_mode", "ensure_minimum_range")})

    return Result(outputs, file_attrs, summary, figure)


def _compute(command, operands, gradients, inputs, mn, mx, attrs, axis, est, grad_factor, xp, output):
    kw = dict(dtype=attrs["dtype"], mode=attrs["mode"], round_mode=attrs["round_mode"],
              narrow_range=attrs["narrow_range"], axis=axis, ensure_minimum_range=attrs["ensure_minimum_range"])
    details = None
    x = q.as_float32(inputs, "inputs", xp)
    if gradients is None:
        result = q.quantize_dequantize(x, mn, mx, **kw)
        outputs = result.as_dict()
    elif est is None or est.name == "ste":
        result = q.quantize_dequantize(x, mn, mx, **kw)
        lo, hi = q.range_bounds(result.output_min, result.output_max, x.ndim, axis, xp)
        # The clipped STE over the adjusted range; other estimators run on quantize_dequantize_view.
        outputs = q.quantize_dequantize_backprops(gradients, x, lo, hi)
        if est is not None:
            details = {"estimator": est.text, "name": est.name}
    else:
        view, result = q.quantize_dequantize_view(x, mn, mx, **kw)
        gf = None
        if est.name == "lsq":
            gf = lsq_grad_factor(view) if grad_factor in (None, "auto") else float(grad_factor)
        outputs, details = apply_estimator(est, gradients, view, grad_factor=gf)
    summary = build_summary(command, operands, {"gradients": gradients, "inputs": inputs, "min": mn, "max": mx},
                            x, gradients, result, attrs, axis, outputs, output, xp)
    if details is not None:
        summary["estimator"] = json_safe(details)
    return outputs, summary


def build_summary(command, operands, raw, x, gradients, result, attrs, axis, outputs, output, xp):
    """The summary dict (JSON-safe): attributes, ranges, clipped shares, gradient mass blocked, notes."""
    mn, mx = q._slice_ranges(raw["min"], raw["max"], x.shape, q._normalise_axis(axis, x.ndim))
    grid = q.round_trip_grid(mn, mx, dtype=attrs["dtype"], mode=attrs["mode"], round_mode=attrs["round_mode"],
                             narrow_range=attrs["narrow_range"], ensure_minimum_range=attrs["ensure_minimum_range"])
    lo, hi = q.range_bounds(result.output_min, result.output_max, x.ndim, axis, xp)
    inside = q.range_mask(x, lo, hi, xp)
    n = int(x.size)
    nan = int(xp.isnan(x).sum())
    below = int((x < lo).sum()) if n else 0
    above = int((x > hi).sum()) if n else 0
    stats = {"elements": n, "clipped_below": below / n if n else 0.0, "clipped_above": above / n if n else 0.0,
             "nan": nan / n if n else 0.0}
    if gradients is not None:
        mag = xp.abs(q.as_float32(gradients, "gradients", xp).astype(np.float64))
        mag = xp.where(xp.isfinite(mag), mag, 0.0)
        total = float(mag.sum())
        stats["gradient_blocked"] = float(xp.where(inside, 0.0, mag).sum()) / total if total else 0.0
    notes = []
    for name in ("inputs", "gradients"):
        dtype = getattr(raw.get(name), "dtype", None)
        if dtype is not None and str(dtype) != "float32":
            notes.append(f"{name} is {dtype}; computed in float32 as TensorFlow does")
    quantized = to_numpy(result.quantized)
    if attrs["dtype"] == "qint32" and attrs["mode"] != "MIN_FIRST":
        # The bottom of the range legitimately gives -2**31; above the middle it is TF's wrap.
        middle = (to_numpy(lo).astype(np.float64) + to_numpy(hi)) / 2
        wrapped = int(np.count_nonzero((quantized == np.iinfo(np.int32).min) & (to_numpy(x) > middle)))
        if wrapped:
            notes.append(f"{counted(wrapped, 'input')} at the top of the range quantized to -2147483648: TensorFlow's qint32 "
                         "cast wraps there, and qgcli reproduces it")
    if nan:
        notes.append(f"{nan} NaN inputs: quantized as TensorFlow's x86 casts do (0, or the type's minimum in whole "
                     "packets), never clipped, and their gradient is 0")

    def plain(a):
        a = np.asarray(to_numpy(a), np.float64)
        return a.tolist()

    return json_safe({
        "command": command,
        "op": OP + ("Gradient" if gradients is not None else ""),
        "variant": VARIANT,
        "attributes": {**attrs, "axis": axis},
        "inputs": {k: {**describe_arrays({k: v})[k],
                       **({"source": operands.sources[k]} if k in operands.sources else {})}
                   for k, v in raw.items() if v is not None},
        "range": {"min": plain(grid.min), "max": plain(grid.max), "output_min": plain(result.output_min),
                  "output_max": plain(result.output_max), "step": plain(grid.scale),
                  "levels": grid.quant_max - grid.quant_min + 1,
                  "quantized_min": int(quantized.min()) if quantized.size else None,
                  "quantized_max": int(quantized.max()) if quantized.size else None},
        "statistics": stats,
        "outputs": describe_arrays(outputs),
        "output": output,
        "notes": notes,
    })


# --- the job: from the commands' options, from a run-file group --------------------------------------------

def claims(o):
    return o.attributes.variant == VARIANT and o.semantics.semantics != "torchao"


def job_from_options(o):
    semantics, attributes, estimator = o.semantics, o.attributes, o.estimator
    refused = {"--semantics": semantics.semantics, **semantics.torch_given()}
    for option, value in refused.items():
        if value not in (None, False, "tf"):
            raise OptionError(f"does not apply to --variant {VARIANT} (TensorFlow's QuantizeV2 + "
                              "Dequantize)", param_hint=f"'{option}'")
    if attributes.num_bits_given:
        raise OptionError(f"the bit width of --variant {VARIANT} comes from --dtype", param_hint="'--num-bits'")
    est = None
    if o.with_gradients:
        est = parse_estimator(estimator)
        check_grad_factor(estimator, est)
        if o.output.plot and est is not None and est.name != "ste":
            raise OptionError(f"draws the STE only; for --estimator {est.text} use 'qgcli plot estimators "
                              f"--variant {VARIANT}'", param_hint="'--plot'")
    return FakeQuantJob(command=o.command, family=NAME, with_gradients=o.with_gradients, operands=o.operands,
                        output=o.output, narrow_range=attributes.narrow_range, variant=VARIANT,
                        axis=attributes.axis, quantize=o.quantize.resolved(), estimator=est,
                        grad_factor=estimator.grad_factor)


def job_from_group(run, layer, operand_specs, output, pick):
    """QuantizeV2's attributes (a group from TensorFlow names its dtype ``T``); the STE is the default."""
    common, narrow_range, axis = fake_quant_basics(run, operand_specs, output, pick)
    a = layer.attrs
    if "dtype" not in a and "T" in a:
        layer.attrs = {**a, "dtype": a["T"]}
    dtype = pick("dtype", None)
    emr = pick("ensure_minimum_range", None)
    quantize = QuantizeAttributes(dtype=None if dtype is None else str(dtype).lower().replace("dt_", ""),
                                  mode=pick("mode", None), round_mode=pick("round_mode", None),
                                  ensure_minimum_range=None if emr is None else float(emr))
    est = run.estimator
    if est is not None and est.name == "ste":
        common["estimator"] = None
    return FakeQuantJob(family=NAME, narrow_range=narrow_range, variant=VARIANT, axis=axis,
                        quantize=quantize.resolved(), **common)


def mode(job):
    return f"--variant {VARIANT}"


#: What ``qgcli plot RUN -o DIR/`` draws of a QuantizeV2 group: the round trip, as ``--variant
#: quantize-dequantize`` (:mod:`qgcli.report.layer_figures`).
PLOT_KINDS = ("staircase", "ste")


def plot_setup(attr):
    """The group's dtype (``dtype``, or TensorFlow's ``T``), mode, round mode, ensure_minimum_range (TensorFlow's
    defaults where absent), narrow range and axis; ``attr(name, default)`` as in :func:`job_from_group`."""
    dtype = attr("dtype", attr("T", None))
    emr = attr("ensure_minimum_range", None)
    quantize = QuantizeAttributes(dtype=None if dtype is None else str(dtype).lower().replace("dt_", ""),
                                  mode=attr("mode", None), round_mode=attr("round_mode", None),
                                  ensure_minimum_range=None if emr is None else float(emr)).resolved()
    axis = attr("axis", None)
    return {"quantize": quantize, "narrow_range": bool(attr("narrow_range", False)),
            "axis": -1 if axis is None else int(axis)}


def plot_operands(operands, setup):
    """``(inputs, min, max, keyword arguments)`` of ``plots.staircase``/``ste`` for a group."""
    return (operands.get("inputs"), operands.get("min"), operands.get("max"),
            {"variant": VARIANT, "quantize": setup["quantize"], "narrow_range": setup["narrow_range"],
             "axis": setup["axis"]})


# --- the summary on stderr ------------------------------------------------------------------------------

def render(console, s):
    from rich.markup import escape

    a, r, stats = s["attributes"], s["range"], s["statistics"]
    shapes = ", ".join(f"{k} {tuple(v['shape'])} {v['dtype']}" for k, v in s["inputs"].items())
    rounding = f" round_mode={a['round_mode']}" if a["mode"] == "SCALED" else ""
    print_items(console, f"[bold]{s['op']}[/] dtype={a['dtype']} mode={a['mode']}{rounding} narrow_range={a['narrow_range']} "
                  f"ensure_minimum_range={a['ensure_minimum_range']:g}  {escape(shapes)}")
    keys = ("min", "max", "output_min", "output_max", "step")
    if isinstance(r["min"], list):
        rows = [[f"slice {c}", *(_fmt(r[k][c]) for k in keys)] for c in range(min(len(r["min"]), 8))]
        if len(r["min"]) > 8:
            rows.append([f"... {len(r['min']) - 8} more", "", "", "", "", ""])
    else:
        rows = [["range", *(_fmt(r[k]) for k in keys)]]
    cols = (Col("", "left", priority=0), Col("min", priority=2), Col("max", priority=2), Col("output_min", priority=0),
            Col("output_max", priority=0), Col("step", priority=1))
    print_table(console, cols, rows, hint="--json for every value")
    line = (f"{r['levels']} levels; quantized values {r['quantized_min']}..{r['quantized_max']}; clipped below "
            f"{percent(stats['clipped_below'])}, above {percent(stats['clipped_above'])}")
    if "gradient_blocked" in stats:
        line += f"; gradient mass blocked by the STE mask {percent(stats['gradient_blocked'])}"
    print_items(console, line)
    if "estimator" in s:
        est = s["estimator"]
        extra = f", grad_factor {est['grad_factor']:.7g}" if est.get("grad_factor") is not None else ""
        print_items(console, escape(f"estimator {est['estimator']}{extra} over the adjusted range [output_min, output_max]"))
    render_closing_lines(console, s)
