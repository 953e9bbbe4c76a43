"""``qgcli report``: per channel (or per tensor), what a fake-quant range does to the data and to its gradient.

The result goes to stdout: a rich table (plain text when stdout is not a terminal), one JSON document with
``--json``, CSV with ``--csv``; progress and notes go to stderr.  The JSON layout is documented in
docs/formats.md ("JSON output of inspect and report"); keys are always present, in a fixed order, with ``null`` where a value
does not exist (never NaN).
"""
import click

from qgcli.cli.options import (
    ONNX_DTYPES,
    QDQ_VARIANTS,
    TORCHAO_DTYPES,
    attribute_group,
    block_format_options,
    bundle_argument,
    given,
    hdf5_bound_options,
    narrow_range_option,
    num_bits_option,
    opt,
    option_group,
    refuse_missing_bundle,
    run_file_target,
    spec_option,
    scheduler_option,
    torchao_options,
    typed_overrides,
)
from qgcli.report.summaries import dump_json, nonfinite_notes, number, stdout_console
from qgcli.report.text import counted
from qgcli.cli.options import fail_on_option, gate, refuse_conditions, table_options, table_out_options

REPORT_SCHEMA = 1
_TABLE_ROWS = 20  # rows a terminal table shows without --top
BLOCK_SEMANTICS = ("mx", "nvfp4", "onnx")  # --semantics reported per block (qgcli.families.block_formats)
# A SPEC is free text (file, file:key, -, literal); click.Path only so that shells complete file names.
_SPEC = click.Path(allow_dash=True)


def _report_operands(bundles, specs):
    """``(OperandSpecs of the first BUNDLE and the options, every BUNDLE)``: several are run files' steps."""
    from qgcli.jobs import OperandSpecs

    first = bundles[0] if bundles else None
    return OperandSpecs.of(first, **{name.rstrip("_"): text for name, text in specs.items()}), tuple(bundles)


def _parse_percentiles(ctx, param, value):
    from qgcli.storage.io import parse_literal

    values = parse_literal(value) if value else None
    if values is None or values.size == 0:
        raise click.BadParameter(f"expected comma-separated numbers, got {value!r}")
    values = [float(v) for v in values.reshape(-1)]
    for v in values:
        if not 50.0 <= v <= 100.0:
            raise click.BadParameter(f"{v:g} is not between 50 and 100 (p picks the range [P(100-p), P(p)])")
    return tuple(values)


def _qdq_flags(signed_input=None, range_given=None):
    from qgcli.jobs import QdqAttributes

    return QdqAttributes(signed_input, range_given)


def _flag_metric(report):
    return "gradient_blocked" if report.has_gradients else "clipped"


def verdict(report, threshold):
    """One line: which channels clip, how much gradient they lose, and what the suggested ranges give."""
    col, total = report.columns, report.total
    metric = _flag_metric(report)
    what = "of their gradient mass" if report.has_gradients else "of their values"
    order = report.order("worst")
    flagged = [c for c in order if col[metric][c] > threshold]
    sqnr, sug = total["sqnr_db"], total["suggested_sqnr_db"]
    gain = ""
    if sqnr is not None and sug is not None and sug > sqnr + 0.5:
        gain = f"; the suggested range{'s' if report.per_channel else ''} would raise the SQNR from " \
               f"{sqnr:.1f} to {sug:.1f} dB"
        if report.has_gradients and total["gradient_mass"] and total["suggested_gradient_blocked"] is not None:
            gain += f" and block {100 * total['suggested_gradient_blocked']:.1f}% of the gradient mass"
    blocked = (f"; {100 * total['gradient_blocked']:.1f}% of all gradient mass is blocked by the STE mask"
               if report.has_gradients else "")
    thr = f"{100 * threshold:g}%"
    if report.has_gradients and not total["gradient_mass"]:
        blocked = "; the gradient is zero everywhere, so no gradient mass can be blocked"
    if not report.per_channel:
        v = col[metric][0]
        share = f"{100 * v:.1f}%"
        clip = (f"{100 * col['clipped_below'][0]:.1f}% of values clip below the nudged range, "
                f"{100 * col['clipped_above'][0]:.1f}% above")
        if flagged:
            lost = "loses " + share + " of its gradient mass" if report.has_gradients else "clips " + share
            return f"Verdict: the tensor {lost} (more than {thr}): {clip}{gain}."
        lost = "loses " + share + " of its gradient mass" if report.has_gradients else "clips " + share
        return f"Verdict: OK, the tensor {lost}, not more than {thr} ({clip}){gain}."
    if flagged:
        names = ", ".join(f"ch {c} {100 * col[metric][c]:.1f}%" for c in flagged[:3])
        more = f" and {len(flagged) - 3} more" if len(flagged) > 3 else ""
        verb = "lose more than" if report.has_gradients else "clip more than"
        return (f"Verdict: {len(flagged)} of {report.channels} channels {verb} {thr} {what} "
                f"({names}{more}){blocked}{gain}.")
    worst = order[0] if order else None
    worst_text = f" (worst: ch {worst}, {100 * col[metric][worst]:.1f}%)" if worst is not None else ""
    verb = "loses more than" if report.has_gradients else "clips more than"
    what = "of its gradient mass" if report.has_gradients else "of its values"
    return f"Verdict: OK, no channel {verb} {thr} {what}{worst_text}{blocked}{gain}."


def build_report_doc(report, *, op, attrs, inputs, threshold, sort, top, notes):
    from qgcli import __version__
    from qgcli.ops.analysis import TOTAL_KEYS

    order = report.order(sort)
    metric = _flag_metric(report)
    flagged = [c for c in report.order("worst") if report.columns[metric][c] > threshold]
    shown = order if top is None else order[:top]
    rows = []
    for c in shown:
        row = report.row(c)
        row["flagged"] = c in flagged
        rows.append(row)
    return {
        "command": "report",
        "schema": REPORT_SCHEMA,
        "qgcli_version": __version__,
        "op": op,
        "variant": report.variant,
        "attributes": attrs,
        "inputs": inputs,
        "per_channel": report.per_channel,
        "channels": report.channels,
        "has_gradients": report.has_gradients,
        "percentiles": list(report.percentiles),
        "threshold": threshold,
        "sort": sort,
        "top": top,
        "total": {k: report.total[k] for k in TOTAL_KEYS},
        "flagged": flagged if report.per_channel else [None] * len(flagged),
        "rows": rows,
        "verdict": verdict(report, threshold),
        "notes": notes,
    }


def _pct(v):
    return "-" if v is None else f"{100 * v:.1f}%"


def _qparams(scale, zero_point):
    if scale is None or zero_point is None:
        return "-"
    return f"{scale:.3g}/{zero_point}"


def _span(lo, hi):
    if lo is None or hi is None:
        return "-"
    return f"{lo:.3g}..{hi:.3g}"


_PRIMED = "with the suggested range"
# Priority: 0 always shown, higher numbers dropped first to fit the terminal (qgcli.report.tables).
_REPORT_COLS = None


def _report_cols():
    global _REPORT_COLS
    if _REPORT_COLS is None:
        from qgcli.report.tables import Col

        _REPORT_COLS = (
            # ranked by what a reader needs to judge the range and a new one: the data, the nudged range (the
            # range asked for is nearly equal to it, and goes first), what clips, the SQNR now and with the
            # suggested range
            Col("ch", priority=0, prefix=True), Col("data", help="the channel's finite data range", priority=1),
            Col("range", priority=4), Col("nudged", priority=0),
            Col("clip<", help="values below/above the nudged range", priority=1),
            Col("clip>", help="values below/above the nudged range", priority=1),
            Col("blocked", help="gradient mass the STE mask zeroes", priority=0),
            Col("d/dmin", help="backprop_wrt_min/max", priority=4), Col("d/dmax", help="backprop_wrt_min/max", priority=4),
            Col("SQNR", help="dB", priority=1), Col("suggested", help="the suggested range [P(100-p), P(p)]", priority=2),
            Col("p", help="its percentile", priority=3), Col("SQNR'", help=_PRIMED, priority=1),
            Col("blocked'", help=_PRIMED, priority=3),
        )
    return _REPORT_COLS


def render_report(console, doc, limited):
    from rich.markup import escape

    from qgcli.report.tables import print_items, print_table
    from qgcli.report.text import printable_doc

    doc = printable_doc(doc)  # dtypes and messages from the files: no control characters
    a, t = doc["attributes"], doc["total"]
    src = [f"{k} {v['shape']} {v['dtype']}" for k, v in doc["inputs"].items() if k in ("inputs", "gradients")]
    axis = f" axis={a['axis']}" if a.get("axis") is not None else ""
    torch = doc["variant"] == "torch"  # PyTorch's grid: its ranges said in scale/zero point
    grid = (f"quant_min={a['quant_min']} quant_max={a['quant_max']} qscheme={escape(str(a['qscheme']))}" if torch else
            f"num_bits={a['num_bits']} narrow_range={a['narrow_range']}")
    print_items(console, f"[bold]{doc['op']}[/] {grid}{axis}  {escape(', '.join(src))}")
    rows = [["all" if r["channel"] is None else str(r["channel"]), _span(r["data_min"], r["data_max"]),
             _qparams(r["scale"], r["zero_point"]) if torch else _span(r["min"], r["max"]),
             _span(r["nudged_min"], r["nudged_max"]), _pct(r["clipped_below"]),
             _pct(r["clipped_above"]), _pct(r["gradient_blocked"]), number(r["backprop_wrt_min"], 3),
             number(r["backprop_wrt_max"], 3), _db(r["sqnr_db"], r["mse"]),
             _qparams(r["suggested_scale"], r["suggested_zero_point"]) if torch else
             _span(r["suggested_min"], r["suggested_max"]), number(r["suggested_percentile"], 5),
             _db(r["suggested_sqnr_db"], r["suggested_mse"]), _pct(r["suggested_gradient_blocked"])]
            for r in doc["rows"]]
    print_table(console, _report_cols(), rows, styles=["red" if r["flagged"] else None for r in doc["rows"]],
                choice=True)
    if torch:
        print_items(console, "range, suggested: PyTorch's scale/zero_point (suggested: as its observer picks them for "
                    "[P(100-p), P(p)]); nudged: the range the grid spans; blocked: gradient mass PyTorch's mask zeroes")
    if limited:
        print_items(console, f"... {counted(doc['channels'] - len(doc['rows']), 'more channel')} (--top K to show more, "
                    "--json or --csv for all)")
    if doc["per_channel"]:
        total = f"all {counted(doc['channels'], 'channel')}: "
    else:
        total = "whole tensor: "
    total += f"clipped {_pct(t['clipped_below'])} below, {_pct(t['clipped_above'])} above"
    if doc["has_gradients"]:
        total += f"; gradient mass blocked {_pct(t['gradient_blocked'])}"
    total += (f"; SQNR {_db(t['sqnr_db'], t['mse'])} dB, with the suggested "
              f"range{'s' if doc['per_channel'] else ''} {_db(t['suggested_sqnr_db'], t['suggested_mse'])} dB")
    print_items(console, escape(total))
    print_items(console, f"[bold]{escape(doc['verdict'])}[/]")


def _print_notes(notes):
    """Notes on stderr, lines broken between words on a terminal (full lines off it)."""
    from qgcli.report.summaries import stderr_console
    from qgcli.report.tables import print_items
    from qgcli.report.text import markup

    console = stderr_console()
    for note in notes:
        print_items(console, f"note: {markup(note)}")


def _db(v, mse=None):
    if v is None:
        return "inf" if mse == 0 else "-"
    return f"{v:.1f}"


def _on_stdout(tables):
    """Whether --csv or --parquet takes stdout (the table's place)."""
    return "-" in tables[:2]


def _write_tables(tables, rows, keys, *, inputs):
    """--csv / --parquet: ``rows`` of the --json document (qgcli.report.table_out)."""
    from qgcli.report import table_out

    csv_out, parquet, force = tables
    table_out.write(rows, keys, csv=csv_out, parquet=parquet, force=force, inputs=inputs)


_REPORT_EPILOG = """\b
Examples:
  qgcli report samples/per_channel.h5
  qgcli report samples/per_channel.h5 --top 3 --json | jq '.rows[] | {channel, gradient_blocked}'
  qgcli report samples/notebook.h5 --num-bits 2 --csv > report.csv
  qgcli report --inputs act.npy --gradients grad.npy --min -1,-2 --max 1,2 --sort sqnr
  qgcli report --inputs w.npy --semantics mx --mx-format mxfp4 --top 5   # per block (also nvfp4, onnx)
"""


@click.command("report", epilog=_REPORT_EPILOG, short_help="Per-channel clipping, blocked gradient, SQNR, ranges.")
@option_group(
    "operands", lambda bundle=(), **specs: _report_operands(bundle, specs),
    bundle_argument(type=_SPEC, nargs=-1),
    spec_option("gradients", "Upstream gradient (optional: without it no gradient columns).", type=_SPEC),
    spec_option("inputs", "Forward inputs (TF operand 'inputs').", type=_SPEC),
    spec_option("min", "Range minimum: scalar (vars/args) or one per channel.", type=_SPEC),
    spec_option("max", "Range maximum: scalar (vars/args) or one per channel.", type=_SPEC),
    spec_option("x", "ONNX QuantizeLinear's 'x' (--semantics onnx; --inputs too).", type=_SPEC),
    spec_option("y_scale", "ONNX QuantizeLinear's 'y_scale' (--semantics onnx).", type=_SPEC),
    spec_option("y_zero_point", "ONNX QuantizeLinear's 'y_zero_point' (--semantics onnx).", type=_SPEC),
)
@attribute_group(
    num_bits_option(),
    narrow_range_option(),
    opt("--variant", type=click.Choice(["args", "vars", "per-channel", *QDQ_VARIANTS]), default=None,
        help="TF op family; default: per-channel when min/max are vectors, else vars. "
             "quantize-and-dequantize-v4/-v3/-v2: TF's QuantizeAndDequantize (--signed-input, "
             "--range-given, --round-mode; --axis K: one range per slice, -1 per tensor)."),
    opt("--axis", type=int, default=None, help="Channel axis for the per-channel variant (TF: -1)."),
)
@option_group(
    "qdq", lambda round_mode=None, **flags: (_qdq_flags(**flags), round_mode),
    opt("--signed-input/--no-signed-input", "signed_input", default=None,
        help="Signed grid [default: signed] (--variant quantize-and-dequantize-v*)."),
    opt("--range-given/--no-range-given", "range_given", default=None,
        help="Clamp to --min/--max instead of the data's range [default: not given; V3: given] "
             "(--variant quantize-and-dequantize-v*)."),
    opt("--round-mode", type=click.Choice(["HALF_TO_EVEN", "HALF_UP"]), default=None,
        help="Rounding [default: HALF_TO_EVEN] (--variant quantize-and-dequantize-v4/-v2)."),
)
@click.option("--top", type=click.IntRange(min=1), default=None, metavar="K", help="Show the K worst channels only.")
@click.option("--sort", "sort", type=click.Choice(["worst", "blocked", "clipped", "sqnr", "gain", "channel"]),
              default="worst", show_default=True,
              help="Row order: worst = most gradient mass blocked (most clipped without gradients), then lowest SQNR.")
@click.option("--threshold", type=click.FloatRange(0.0, 1.0), default=0.05, show_default=True,
              help="Flag channels losing more than this share of gradient mass (of values without gradients); "
                   "--semantics mx / nvfp4: blocks flushing or clipping this share more than the format does to a "
                   "Gaussian block.")
@click.option("--percentiles", default="100,99.99,99.9,99.5,99,98,95", show_default=True,
              callback=_parse_percentiles, metavar="P,...",
              help="Percentiles searched for the suggested range [P(100-p), P(p)]; the best SQNR wins.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout (see docs/formats.md).")
@table_out_options()
@click.option("--html", "html", metavar="FILE", default=None,
              help="Also write one self-contained HTML page: the verdict, the sortable table, the figures and "
                   "each layer's details (no network needed to open it).")
@click.option("--force", is_flag=True, help="Replace an existing --html, --csv, --parquet or --ranges-out FILE.")
@click.option("--range-method", "range_method", type=click.Choice(["percentile", "mse", "kl"]), default="percentile",
              show_default=True,
              help="How the suggested range is found: percentile (the best of --percentiles), mse (alpha*[min,max] "
                   "with the least quantization error), kl (TensorRT's entropy calibration); see "
                   "docs/inspect-report.md.")
@click.option("--ranges-out", "ranges_out", metavar="FILE.h5", default=None,
              help="Run files: write each quantizer's suggested range at its group path, in its own parameters "
                   "(TensorFlow min/max, PyTorch and torchao scale/zero_point), for fakequant-grad RUN --ranges "
                   "FILE.h5.")
@click.option("--tensorboard", "tensorboard", metavar="LOGDIR", default=None,
              help="Run files: also write TensorBoard event files under LOGDIR (scalars per layer and statistic at "
                   "the file's step numbers, aggregate curves; pip install 'qgcli[tensorboard]').")
@click.option("--baseline", "baseline", metavar="FILE", default=None,
              help="Compare with FILE, a run file (or a history, for a history's report) as qgcli diff FILE "
                   "BUNDLE does: the change of each layer beside its values in --html, a baseline section in "
                   "--json, the comparison's verdict after the table.")
@fail_on_option("report", also="trend")
@click.option("-q", "--quiet", is_flag=True, help="No progress or notes on stderr.")
@table_options
@click.option("--device", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True,
              help="Compute with NumPy (cpu) or CuPy (gpu).")
@click.option("--layer", "layer", metavar="PATH", default=None,
              help="Run file: the per-channel report of the group PATH (default: one row per quantizer).")
@click.option("--semantics", type=click.Choice(["tf", "torchao", *BLOCK_SEMANTICS]), default="tf", show_default=True,
              help="tf: TensorFlow's fake quant on --min/--max; torchao: torchao's QAT quantizer (--dtype, "
                   "--granularity ...), one row per block, the gradient split into straight-through and scale path; "
                   "mx, nvfp4, onnx: the block format (options as fakequant's), one row per block: flushed to "
                   "zero, clipped, saturated scale, dynamic range, SQNR.")
@click.option("--dtype", type=click.Choice(tuple(dict.fromkeys(TORCHAO_DTYPES + ONNX_DTYPES))), default=None,
              help="torchao's dtype (--semantics torchao); QuantizeLinear's output type (--semantics onnx) [default: "
                   "uint8, or the zero point's].")
@torchao_options
@block_format_options
@hdf5_bound_options
@scheduler_option()
def report(operands, attributes, qdq, top, sort, threshold, percentiles, as_json, csv_out, parquet, html, force,
           range_method,
           ranges_out, tensorboard, baseline, fail_on, quiet, device, layer, semantics, dtype, torchao, formats,
           scheduler):
    """Per channel (or per tensor): what a fake-quant range does to the data and to its gradient.

    Data range against the raw and nudged range, shares clipped below/above, the share of upstream
    gradient mass the STE mask blocks (sum|g|*(1-mask) / sum|g|), backprop_wrt_min/max from TensorFlow's
    op, the forward error (MSE, SQNR in dB) and a suggested percentile range with the SQNR it gives.
    Worst channels first, then a one-line verdict. Operands as for fakequant-grad: a BUNDLE and/or options.
    """
    from qgcli.storage.operands import Operands, to_device
    from qgcli.report.progress import Progress
    from qgcli.families.tf_fake_quant import TF_OPS, load_fake_quant_operands
    from qgcli.report.summaries import describe_arrays

    from qgcli.report import table_out

    operands, bundles = operands
    table_out.check(csv_out, parquet, force=force, inputs=bundles, as_json=as_json)  # before the work
    tables = (csv_out, parquet, force)  # the table's files (qgcli.report.table_out); "-": stdout
    if len(bundles) == 1 and _is_history(bundles[0]):  # a history from qgcli.monitor: its table, as trend shows it
        if ranges_out is not None or range_method != "percentile":
            raise click.BadParameter("applies to quantizers' data (a run file or a bundle), not a history",
                                     param_hint="'--ranges-out'" if ranges_out is not None else "'--range-method'")
        return _report_history(bundles[0], operands, layer, scheduler, semantics, dtype, torchao, as_json, tables,
                               html, force, tensorboard, fail_on, quiet, baseline)
    refuse_conditions(fail_on)
    if semantics in BLOCK_SEMANTICS:
        return _report_blocks(operands, bundles, attributes, qdq, semantics, dtype, torchao, formats, top, sort,
                              threshold, as_json, tables, quiet, device, layer, fail_on,
                              {"--html": html, "--ranges-out": ranges_out, "--tensorboard": tensorboard,
                               "--baseline": baseline, "--scheduler": scheduler})
    _refuse_block_options(operands, formats, semantics)
    if attributes.variant not in QDQ_VARIANTS:
        for option, value in (("--signed-input", qdq[0].signed_input), ("--range-given", qdq[0].range_given),
                              ("--round-mode", qdq[1])):
            if value is not None:
                raise click.BadParameter("only applies to --variant quantize-and-dequantize-v4/-v3/-v2",
                                         param_hint=f"'{option}'")
    if scheduler is not None and (semantics == "torchao" or dtype is not None or torchao.given() or layer is not None):
        raise click.BadParameter("reports the layers of a run file on a Dask cluster, one row per quantizer; this "
                                 "report runs here (drop --scheduler)", param_hint="'--scheduler'")
    if baseline is not None:
        _check_baseline(baseline, history=False)
    if semantics == "torchao" or dtype is not None or torchao.given():
        if dtype is not None and dtype not in TORCHAO_DTYPES:
            raise click.BadParameter(f"{dtype} is a QuantizeLinear type: it applies to --semantics onnx",
                                     param_hint="'--dtype'")
        run_file_target(operands)  # a run file's torchao groups carry their config: refuses these options
        if ranges_out is not None or range_method != "percentile" or baseline is not None:
            raise click.BadParameter("does not apply to --semantics torchao (torchao's quantizer picks its scale)",
                                     param_hint="'--ranges-out'" if ranges_out is not None else
                                     "'--range-method'" if baseline is None else "'--baseline'")
        return _report_torchao(operands, bundles, attributes, semantics, dtype, torchao, top, sort, threshold,
                               as_json, tables, quiet, device, layer)
    if len(bundles) > 1:  # several run files: each a step (or its step groups)
        targets = [run_file_target(operands.__class__(b, operands.specs)) for b in bundles]
        for bundle, target in zip(bundles, targets):
            if target is None:
                raise click.BadParameter(f"{bundle} is not a run file; several BUNDLEs must each be one",
                                         param_hint="'BUNDLE'")
        for option, value in (("--layer", layer), ("--ranges-out", ranges_out)):
            if value is not None:
                raise click.BadParameter("takes one run file as BUNDLE", param_hint=f"'{option}'")
        return _report_layers(targets, typed_overrides(), percentiles, threshold, top, as_json, tables, quiet,
                              device, scheduler, html=(html, force), fail_on=fail_on, tensorboard=tensorboard,
                              range_method=range_method, baseline=baseline)
    target = run_file_target(operands)
    if target is not None and layer is None:
        return _report_layers([target], typed_overrides(), percentiles, threshold, top, as_json, tables, quiet,
                              device, scheduler, html=(html, force), fail_on=fail_on, tensorboard=tensorboard,
                              range_method=range_method, ranges_out=ranges_out, baseline=baseline)
    if ranges_out is not None:
        refuse_missing_bundle(operands.bundle)
        raise click.BadParameter("writes the ranges of a run file's quantizers at their group paths; for one "
                                 "tensor, --json gives suggested_min/suggested_max", param_hint="'--ranges-out'")
    if scheduler is not None:
        raise click.BadParameter("reports the layers of a run file on a Dask cluster, one row per quantizer; this "
                                 "report runs here (drop --scheduler)", param_hint="'--scheduler'")
    if baseline is not None:
        raise click.BadParameter("compares the layers of a run file or a history (two bundles: qgcli diff A B)",
                                 param_hint="'--baseline'")
    if tensorboard is not None:
        raise click.BadParameter("writes the layers of run files (a bundle has no steps to plot)",
                                 param_hint="'--tensorboard'")
    if layer is not None:
        if target is None:
            refuse_missing_bundle(operands.bundle)
            raise click.BadParameter("needs a run file as BUNDLE (groups holding quantizers' operands)",
                                     param_hint="'--layer'")
        from qgcli.report.layers import layer_operands, layer_report
        from qgcli.storage.runfile import split_target

        found = layer_report(target, layer, typed_overrides(), percentiles=percentiles, threshold=threshold,
                             sort=sort, top=top, device=device)
        if found is not None:  # PyTorch's and torchao's groups
            return _report_family_layer(*found, threshold=threshold, sort=sort, top=top, as_json=as_json,
                                        tables=tables, quiet=quiet, html=html, force=force, fail_on=fail_on,
                                        inputs=[split_target(target)[0]])
        operands, attributes = layer_operands(target, layer, typed_overrides())
    else:
        operands = Operands.of(operands, literal_ok=("min", "max"))
    num_bits, narrow_range, variant, axis = attributes.num_bits, attributes.narrow_range, attributes.variant, attributes.axis
    notes = []
    qdq_attrs = None
    with Progress("reading operands", total=None, quiet=quiet) as progress:
        try:
            if variant in QDQ_VARIANTS:
                from qgcli.families.qdq import load_operands

                x_raw, mn, mx, qdq_attrs = load_operands(operands, variant, qdq[0], qdq[1], axis)
            else:
                _, x_raw, mn, mx, variant = load_fake_quant_operands(operands, variant, with_gradients=False)
            progress.update(description="reading gradients")
            g_raw = operands.get("gradients", required=False)
        finally:
            operands.close()
        if axis is not None and variant not in ("per-channel", *QDQ_VARIANTS):
            raise click.BadParameter("only applies to --variant per-channel", param_hint="'--axis'")
        for name, value in (("inputs", x_raw), ("gradients", g_raw)):
            if value is not None and str(value.dtype) != "float32":
                notes.append(f"{name} is {value.dtype}; computed in float32 as TensorFlow does")
        xp, (g_dev, x_dev) = to_device([g_raw, x_raw], device)
        notes += nonfinite_notes({"inputs": x_dev, "gradients": g_dev}, xp)
        from qgcli.ops.analysis import channel_report

        steps = 5 + len(percentiles)
        progress.update(total=steps, completed=0)

        def on_step(text):
            progress.update(description=text)
            progress.advance()

        result = channel_report(x_dev, mn, mx, g_dev, num_bits=num_bits, narrow_range=narrow_range,
                                variant=variant, axis=-1 if axis is None else axis, percentiles=percentiles,
                                range_method=range_method,
                                on_step=on_step, **({"qdq": qdq_attrs} if qdq_attrs is not None else {}))
    attrs = {"num_bits": num_bits, "narrow_range": narrow_range,
             "axis": (-1 if axis is None else axis) if variant in ("per-channel", *QDQ_VARIANTS) else None,
             **(qdq_attrs or {})}
    if qdq_attrs is not None:
        from qgcli.families.qdq import OPS, report_notes

        notes += report_notes(variant, result)
    else:
        from qgcli.families.tf_fake_quant import range_warnings

        notes += range_warnings(result.grid)
    raw = {"inputs": x_raw, "gradients": g_raw, "min": mn, "max": mx}
    described = describe_arrays({k: v for k, v in raw.items() if v is not None and hasattr(v, "dtype")})
    for k, v in described.items():
        v["source"] = operands.sources.get(k, "default" if variant == "args" and k in ("min", "max") else None)
    limited = top is None and not as_json and not _on_stdout(tables) and result.channels > _TABLE_ROWS
    doc = build_report_doc(result, op=TF_OPS[variant] if qdq_attrs is None else OPS[variant], attrs=attrs, inputs=described, threshold=threshold,
                           sort=sort, top=_TABLE_ROWS if limited else top, notes=notes)
    if not quiet:
        _print_notes(notes)
    _show_report(doc, limited, as_json=as_json, tables=tables, quiet=quiet, html=html, force=force,
                 inputs=list(operands.input_paths()), fail_on=fail_on)


def _show_report(doc, limited, *, as_json, tables, quiet, html, force, inputs, fail_on):
    """A per-channel report: --html, then JSON, CSV or the table, then the --fail-on gate."""
    if html is not None:
        _write_html(html, force, doc, inputs=inputs)
    from qgcli.ops.analysis import ROW_KEYS

    _write_tables(tables, doc["rows"], list(ROW_KEYS) + ["flagged"], inputs=inputs)
    if as_json:
        dump_json(doc)
    elif _on_stdout(tables):
        if not quiet:
            click.echo(doc["verdict"], err=True)
    else:
        render_report(stdout_console(), doc, limited)
    gate(doc, fail_on)


def _is_history(bundle):
    import os

    from qgcli.monitor.history import is_history

    return bundle != "-" and os.path.isfile(bundle) and is_history(bundle)


def _check_baseline(baseline, *, history):
    """Stop (exit 2, one line) unless ``--baseline`` names what the report is of: a history, or a run file."""
    import os

    if not (os.path.exists(baseline) or os.path.exists(baseline.split(":")[0])):
        raise click.BadParameter(f"no such file: {baseline}", param_hint="'--baseline'")
    if _is_history(baseline) != history:
        raise click.BadParameter(f"{baseline} is {'not ' if history else ''}a history and the report is of "
                                 f"{'a history' if history else 'a run file'}: compare like with like",
                                 param_hint="'--baseline'")


def _report_history(history, operands, layer, scheduler, semantics, dtype, torchao, as_json, tables, html, force,
                    tensorboard, fail_on, quiet, baseline=None):
    """``report HISTORY``: the history's per-layer table, events, page and events files (``qgcli trend``)."""
    from qgcli.cli.history_view import show_history

    given_options = [name for name, value in (("--layer", layer), ("--scheduler", scheduler),
                                              ("--dtype", dtype)) if value]
    given_options += [f"--{name.replace('_', '-')}" for name in ("gradients", "inputs", "min", "max")
                      if operands.get(name) is not None]
    if semantics != "tf" or torchao.given():
        given_options.append("--semantics")
    if given_options:
        raise click.BadParameter(f"does not apply to a history ({history} was written by qgcli.monitor)",
                                 param_hint=f"'{given_options[0]}'")
    if getattr(fail_on, "text", None):  # the conditions a history offers (trend's)
        from qgcli.errors import OptionError
        from qgcli.report.gates import parse

        try:
            fail_on = parse(fail_on.text, "trend")
        except OptionError as exc:
            raise click.BadParameter(exc.message.replace("of trend", "of a history"), param_hint="'--fail-on'") from None
    if baseline is not None:
        _check_baseline(baseline, history=True)
    show_history(history, as_json=as_json, html=html, force=force, tensorboard=tensorboard, fail_on=fail_on,
                 quiet=quiet, baseline=baseline, tables=tables[:2])


def _report_family_layer(kind, found, *, threshold, sort, top, as_json, tables, quiet, html, force, fail_on, inputs):
    """``report RUN --layer PATH`` of a PyTorch group (the per-channel report on its own grid) or a torchao
    group (its per-block report)."""
    if kind == "blocks":
        if html is not None:
            raise click.BadParameter("is not written for a per-block report", param_hint="'--html'")
        if found["semantics"] in BLOCK_SEMANTICS:
            return _show_blocks(found, top, as_json, tables, quiet, inputs=inputs, fail_on=fail_on)
        return _show_torchao(found, top, as_json, tables, quiet, inputs=inputs)
    result, op, attrs, described = found
    limited = top is None and not as_json and not _on_stdout(tables) and result.channels > _TABLE_ROWS
    doc = build_report_doc(result, op=op, attrs=attrs, inputs=described, threshold=threshold, sort=sort,
                           top=_TABLE_ROWS if limited else top, notes=[])
    _show_report(doc, limited, as_json=as_json, tables=tables, quiet=quiet, html=html, force=force, inputs=inputs,
                 fail_on=fail_on)


def _report_torchao(operands, bundles, attributes, semantics, dtype, torchao, top, sort, threshold, as_json, tables,
                    quiet, device, layer):
    """``--semantics torchao``: one row per block of torchao's quantizer (qgcli.families.torchao)."""
    from qgcli.families import torchao as runner

    if semantics != "torchao":
        runner.refuse_outside(torchao, dtype)
    for option, value in (("--num-bits", given("num_bits")), ("--narrow-range", attributes.narrow_range),
                          ("--variant", attributes.variant is not None), ("--axis", attributes.axis is not None),
                          ("--layer", layer is not None), ("--min", operands.get("min") is not None),
                          ("--max", operands.get("max") is not None), ("--sort", sort in ("sqnr", "gain"))):
        if value:
            raise click.BadParameter("does not apply to --semantics torchao", param_hint=f"'{option}'")
    if len(bundles) > 1:
        raise click.BadParameter("--semantics torchao reports one tensor: give one BUNDLE", param_hint="'BUNDLE'")
    config = runner.build_config(dtype, torchao)
    doc = runner.report_doc(operands, config, threshold=threshold, sort="block" if sort == "channel" else sort,
                            top=top, device=device)
    _show_torchao(doc, top, as_json, tables, quiet, inputs=list(bundles))


def _refuse_block_options(operands, formats, semantics):
    """--semantics tf / torchao: the block formats' options and operands do not apply."""
    for option, value in (*formats.given().items(), ("--x", operands.get("x")),
                          ("--y-scale", operands.get("y_scale")), ("--y-zero-point", operands.get("y_zero_point"))):
        if value is not None:
            raise click.BadParameter(f"only applies to --semantics mx / nvfp4 / onnx, not {semantics}",
                                     param_hint=f"'{option}'")


def _report_blocks(operands, bundles, attributes, qdq, semantics, dtype, torchao, formats, top, sort, threshold,
                   as_json, tables, quiet, device, layer, fail_on, others):
    """``--semantics mx / nvfp4 / onnx``: one row per block of one tensor, as a run-file group of the same
    tensor is reported (the family's ``report_analysis``, qgcli.families.block_formats.report_doc)."""
    from qgcli.families import block_formats, registry
    from qgcli.jobs import EstimatorOptions, FakeQuantOptions, OutputOptions, QuantizeAttributes, SemanticsOptions
    from qgcli.storage.operands import Operands

    for option, value in (*others.items(), ("--layer", layer), ("--range-method", given("range_method") or None),
                          ("--percentiles", given("percentiles") or None), ("--device", device != "cpu" or None),
                          ("--gradients", operands.get("gradients"))):
        if value is not None:
            why = ("the identity STE of these formats passes every gradient (fakequant-grad --estimator masked-ste "
                   "gives ONNX's mask)" if option == "--gradients" else "computes on the CPU"
                   if option == "--device" else "is for TensorFlow's and PyTorch's ranges, or run files")
            raise click.BadParameter(f"does not apply to --semantics {semantics}: {why}", param_hint=f"'{option}'")
    if len(bundles) > 1:
        raise click.BadParameter(f"--semantics {semantics} reports one tensor: give one BUNDLE", param_hint="'BUNDLE'")
    if run_file_target(operands) is not None:
        raise click.BadParameter("a run file's groups name their format: report them without --semantics",
                                 param_hint="'--semantics'")
    job = registry.job_from_options(FakeQuantOptions(
        "report", False, operands, attributes, QuantizeAttributes(dtype=dtype, round_mode=qdq[1]),
        SemanticsOptions(semantics), EstimatorOptions(), OutputOptions(None, quiet=True), qdq=qdq[0], torchao=torchao,
        formats=formats))
    family = registry.of(job)
    doc = block_formats.report_doc_of(family.report_analysis, job.formats,
                                      Operands.of(job.operands, literal_ok=family.LITERAL_OK), semantics=semantics,
                                      threshold=threshold, sort=sort, top=top)
    _show_blocks(doc, top, as_json, tables, quiet, inputs=list(bundles), fail_on=fail_on)


def _show_blocks(doc, top, as_json, tables, quiet, *, inputs, fail_on):
    """A block format's per-block report (``--semantics mx / nvfp4 / onnx``, or a run file's group with
    ``--layer``), as :func:`_show_per_block` shows it, then the --fail-on gate."""
    from qgcli.families import block_formats

    _show_per_block(block_formats, doc, top, as_json, tables, quiet, inputs=inputs)
    gate(doc, fail_on)


def _show_torchao(doc, top, as_json, tables, quiet, *, inputs):
    """A torchao per-block report (``--semantics torchao``, or a run file's torchao group)."""
    from qgcli.families import torchao as runner

    _show_per_block(runner, doc, top, as_json, tables, quiet, inputs=inputs)


def _show_per_block(family, doc, top, as_json, tables, quiet, *, inputs):
    """A per-block report of ``family`` (its ``ROW_KEYS`` and ``render_report``): notes, then JSON, CSV or the
    table."""
    if not quiet:
        _print_notes(doc["notes"])
    _write_tables(tables, doc["rows"], family.ROW_KEYS, inputs=inputs)
    if as_json:
        dump_json(doc)
    elif _on_stdout(tables):
        if not quiet:
            click.echo(doc["verdict"], err=True)
    else:
        limited = top is None and len(doc["rows"]) > _TABLE_ROWS
        family.render_report(stdout_console(), dict(doc, notes=[]), _TABLE_ROWS if limited else None)


# --- run files: one row per quantizer ----------------------------------------------------------------------


def _report_layers(targets, options, percentiles, threshold, top, as_json, tables, quiet, device, scheduler=None,
                   html=(None, False), fail_on=(), tensorboard=None, range_method="percentile", ranges_out=None,
                   baseline=None):
    import contextlib

    from qgcli.report.layers import LAYER_KEYS, layers_document, report_layers
    from qgcli.report.progress import Progress

    from qgcli.execution.dispatch import cluster as cluster_at, default_scheduler

    scheduler = scheduler or default_scheduler()
    if ranges_out is not None:  # checked before the work, as every output is
        from qgcli.storage.outputs import check_figure_output
        from qgcli.storage.runfile import split_target

        check_figure_output(ranges_out, inputs=[split_target(targets[0])[0]], force=html[1], option="--ranges-out",
                            format="hdf5")
    cluster = None
    with contextlib.ExitStack() as stack:
        if scheduler is not None:  # the layers' rows computed on a Dask cluster (qgcli.execution.cluster)
            cluster = stack.enter_context(cluster_at(scheduler))
        else:  # thousands of rows' small objects, no cycles (qgcli.collector)
            from qgcli import collector

            stack.enter_context(collector.paused())
        with Progress("reading layers", total=None, quiet=quiet) as progress:
            rows, skipped = report_layers(targets, options=options, percentiles=percentiles, device=device,
                                          on_layer=lambda name: progress.update(description=f"layer {name}"),
                                          cluster=cluster, range_method=range_method)
        described = cluster.describe() if cluster is not None else None
    doc = layers_document(targets, rows, skipped, threshold=threshold, percentiles=percentiles, top=top,
                          cluster=described)
    if baseline is not None:  # the baseline reported as this run is, then compared: qgcli diff BASELINE RUN
        from qgcli.report.diff import baseline_section, diff
        from qgcli.report.layers import run_file_document

        with Progress("reading the baseline", total=None, quiet=quiet):
            before = run_file_document([baseline], options=options, percentiles=percentiles, threshold=threshold,
                                       device=device, range_method=range_method)
        doc["baseline"] = baseline_section(baseline, diff(before, doc))
    if html[0] is not None:
        _write_layers_html(html, doc, targets, options, percentiles, quiet)
    if ranges_out is not None:
        _write_ranges(ranges_out, targets[0], options, percentiles, range_method, quiet)
    if tensorboard is not None:
        from qgcli.report.tensorboard import write_report

        write_report(tensorboard, doc)
        if not quiet:
            click.echo(f"wrote TensorBoard events to {tensorboard}", err=True)
    from qgcli.storage.runfile import split_target

    _write_tables(tables, doc["layers"], list(LAYER_KEYS) + ["flagged"],
                  inputs=[split_target(t)[0] for t in targets])
    if as_json:
        dump_json(doc)
    elif _on_stdout(tables):
        if not quiet:
            click.echo(doc["verdict"], err=True)
    else:
        _render_layers(stdout_console(), doc, top)
        if baseline is not None:
            from qgcli.report.text import printable

            click.echo(printable(f"Against the baseline {baseline}: {doc['baseline']['verdict']}"))
    gate(doc, fail_on)


def _write_ranges(dest, target, options, percentiles, method, quiet):
    from qgcli.report import ranges_out
    from qgcli.report.progress import Progress

    with Progress("suggested ranges", total=None, quiet=quiet):
        written, skipped = ranges_out.suggested_ranges(target, options=options, percentiles=percentiles,
                                                       method=method)
    ranges_out.write(dest, written, skipped, source=target, method=method)
    if not quiet:
        click.echo(f"wrote the {method} ranges of {counted(len(written), 'quantizer')} to {dest}"
                   + (f" ({counted(len(skipped), 'group')} without range parameters skipped)" if skipped else ""),
                   err=True)


def _write_html(dest, force, doc, *, inputs, figures=(), details=None):
    from qgcli.report import html

    html.write(dest, html.page(doc, figures=figures, details=details), force=force, inputs=inputs)


def _write_layers_html(html, doc, targets, options, percentiles, quiet):
    """The page of a run-file report: the per-layer figure of ``plot layers`` and each layer's details."""
    from qgcli.report import plots
    from qgcli.report.layer_details import layer_details
    from qgcli.report.progress import Progress
    from qgcli.storage.outputs import check_figure_output
    from qgcli.storage.runfile import split_target

    dest, force = html
    files = [split_target(t)[0] for t in targets]
    check_figure_output(dest, inputs=files, force=force, option="--html", format="html")  # before the work
    with Progress("details for the page", total=None, quiet=quiet):
        details = layer_details(list(targets), doc["layers"], options=options, percentiles=percentiles)
    figures = [("Gradient mass blocked and SQNR per layer", plots.layers(doc["layers"][:60], steps=doc["steps"],
                                                                          trends=doc["trends"]))] if doc["layers"] else []
    _write_html(dest, force, doc, inputs=files, figures=figures, details=details)


_LAYER_COLS = None


def _layer_cols():
    global _LAYER_COLS
    if _LAYER_COLS is None:
        from qgcli.report.tables import Col

        # Priority: 0 always shown, higher numbers dropped first to fit the terminal (qgcli.report.tables).
        _LAYER_COLS = (
            Col("layer", justify="left", priority=0, shorten=True), Col("op", justify="left", priority=3),
            Col("shape", priority=3), Col("bits", priority=3), Col("clip<", priority=1), Col("clip>", priority=1),
            Col("blocked", help="gradient mass the mask zeroes (TensorFlow's STE, PyTorch's mask for PyTorch "
                                "groups); no grad: an all-zero upstream gradient", priority=0),
            Col("SQNR", help="dB", priority=1), Col("SQNR'", help=_PRIMED, priority=1),
            Col("worst ch", help="the channel losing most", priority=2),
        )
    return _LAYER_COLS


def _torchao_cols():
    """The columns torchao groups add: the split of their input gradient (``report --semantics torchao``)."""
    from qgcli.report.tables import Col

    return (Col("st", help="torchao: share of the input gradient's mass passed straight through", priority=2),
            Col("scale", help="torchao: share through the scale (qparams inside autograd)", priority=2))


def _render_layers(console, doc, top):
    from qgcli.report.tables import Col, print_items, print_table
    from qgcli.report.text import markup, printable_doc

    doc = printable_doc(doc)
    shown = doc["layers"] if top is not None else doc["layers"][:_TABLE_ROWS * 2]
    rows = []
    for r in shown:
        worst_share = (r["worst_channel_gradient_blocked"] if r["worst_channel_gradient_blocked"] is not None
                       else r["worst_channel_clipped"])
        worst = "-" if r["worst_channel"] is None else f"{r['worst_channel']} ({_pct(worst_share)})"
        blocked = {"zero": "no grad", "absent": "-"}.get(r.get("upstream_gradient"), _pct(r["gradient_blocked"]))
        rows.append([r["path"], r["op"] or "", "x".join(map(str, r["shape"])), str(r["num_bits"]),
                     _pct(r["clipped_below"]), _pct(r["clipped_above"]), blocked,
                     _db(r["sqnr_db"], 0 if r["exact"] else None), _db(r["suggested_sqnr_db"]), worst])
    cols = _layer_cols()
    if any(r.get("scale_path") is not None for r in shown):  # torchao groups: their gradient split too
        cols += _torchao_cols()
        for row, r in zip(rows, shown):
            row += [_pct(r.get("straight_through")), _pct(r.get("scale_path"))]
    print_table(console, cols, rows, styles=["red" if r["flagged"] else None for r in shown], choice=True,
                choice_others=doc["steps"] if doc["trends"] else ())
    if len(shown) < len(doc["layers"]):
        print_items(console, f"... {counted(len(doc['layers']) - len(shown), 'more layer')} (--top K, --json or --csv for all)")
    if doc["trends"]:
        steps = doc["steps"]
        cols = (Col("layer", justify="left", priority=0),
                *(Col(step, priority=1 if n in (0, len(steps) - 1) else 2) for n, step in enumerate(steps)))
        trend = []
        for name, points in doc["trends"].items():
            by_step = {p["step"]: p for p in points}
            trend.append([name, *(_pct((by_step.get(s) or {}).get("gradient_blocked")) for s in steps)])
        # Columns are steps: --wide shows them all, --columns STEP,... the steps named (the report's column
        # names given there are the layer table's).
        print_table(console, cols, trend, title="blocked gradient by step", hint="--wide, --columns STEP,... or --json",
                    choice=True, choice_others=[c.name for c in _layer_cols() + _torchao_cols()])
    for r in shown:  # block formats (MX, NVFP4, blocked QuantizeLinear): what their blocks do
        if r.get("flushed") is None:
            continue
        parts = [f"flushed to zero {_pct(r['flushed'])} of the nonzero inputs"]
        if r.get("saturated_scale_blocks") is not None:
            parts.append(f"scale saturated in {_pct(r['saturated_scale_blocks'])} of the blocks")
        if r.get("dynamic_range_bits_max") is not None:
            parts.append(f"block dynamic range median {r['dynamic_range_bits_median']:.1f}, largest "
                         f"{r['dynamic_range_bits_max']:.1f} bits")
        if r.get("worst_channel_sqnr_db") is not None:
            parts.append(f"worst block {r['worst_channel']} at {r['worst_channel_sqnr_db']:.1f} dB")
        print_items(console, f"{markup(r['path'])}: " + "; ".join(parts))
    for item in doc["skipped"]:
        print_items(console, f"[dim]not reported: {markup(item['path'])} ({markup(item['op'] or 'no op')}): "
                    f"{markup(item['reason'])}[/]")
    print_items(console, f"[bold]{markup(doc['verdict'])}[/]")
