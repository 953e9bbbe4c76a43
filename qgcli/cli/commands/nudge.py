"""``qgcli nudge``: TensorFlow's grid for a range explained (scale, zero point, nudged bounds), PyTorch's
observer choice for the same range beside it, and warnings.  Only click is imported at module level.
"""
import click

from qgcli.cli.options import QDQ_VARIANTS
from qgcli.report.summaries import emit, json_safe, stderr_console, stdout_console


def explain_grid(mn, mx, *, num_bits=8, narrow_range=False):
    """TF's grid for ``[mn, mx]`` (scalars or 1-d), PyTorch's observer grid beside it, and warnings.

    Returns a JSON-ready dict: ``grid`` (lists for per-channel), ``torch`` and ``warnings`` (each with
    ``channel``, ``kind`` and ``message``); kinds: ``zero-not-in-range``, ``reversed``, ``empty``,
    ``passthrough``, ``zero-point-tie``, ``zero-point-clamped``.
    """
    import numpy as np

    from qgcli.errors import OperandError
    from qgcli.ops import fake_quant, torch_semantics as ts

    for name, value in (("min", mn), ("max", mx)):
        dtype = np.asarray(value).dtype
        if dtype.kind not in "fiu" and dtype.name != "bfloat16":
            raise OperandError(f"dtype {dtype} is not a real number type", operand=name)
    mn32 = np.asarray(mn).astype(np.float32)
    mx32 = np.asarray(mx).astype(np.float32)
    for name, a in (("min", mn32), ("max", mx32)):
        if a.ndim > 1:
            raise OperandError(f"must be a scalar or 1-d (one per channel), got shape {list(a.shape)}", operand=name)
        if not np.isfinite(a).all():
            raise OperandError("must be finite", operand=name)
    if mn32.shape != mx32.shape:
        raise OperandError(f"shape {list(mn32.shape)} differs from max shape {list(mx32.shape)}", operand="min")
    grid = fake_quant.nudge(mn32, mx32, num_bits=num_bits, narrow_range=narrow_range)
    per_channel = mn32.ndim == 1
    qmin, qmax = grid.quant_min, grid.quant_max
    t_scale, t_zp = ts.observer_qparams(mn32, mx32, qmin, qmax)

    def plain(a, kind=float):
        a = np.asarray(a)
        return [kind(v) for v in a.tolist()] if a.ndim else kind(a)

    warnings = []
    flat = lambda a: np.atleast_1d(np.asarray(a))  # noqa: E731
    for c in range(flat(mn32).size):
        lo, hi = float(flat(mn32)[c]), float(flat(mx32)[c])
        where = c if per_channel else None
        zf = float(flat(grid.zero_point_from_min)[c])
        nlo, nhi = float(flat(grid.nudged_min)[c]), float(flat(grid.nudged_max)[c])

        def warn(kind, message, where=where):
            warnings.append({"channel": where, "kind": kind, "message": message})

        if lo == hi == 0:
            warn("passthrough", "min == max == 0: TensorFlow's forward gives zeros and the gradient passes through")
            continue
        if lo > hi:
            warn("reversed", f"min {lo:g} > max {hi:g}: TensorFlow returns meaningless values (qgcli fakequant "
                             "refuses the range)")
            continue
        if lo == hi:
            warn("empty", f"min == max == {lo:g}: an empty range; TensorFlow returns meaningless values (qgcli "
                          "fakequant refuses it)")
            continue
        if lo > 0 or hi < 0:
            warn("zero-not-in-range", f"[{lo:g}, {hi:g}] does not contain 0: TensorFlow shifts it to "
                                      f"[{nlo:g}, {nhi:g}] so that 0 is a grid point (tensorflow/tensorflow#16995); "
                                      "PyTorch's observers widen it to 0 instead")
        if zf - np.floor(zf) == 0.5 and qmin <= zf <= qmax:
            away, even = int(np.floor(zf + 0.5)), int(np.rint(zf))
            other = (f"gives {even}, one step of range shift" if even != away else f"gives the same {even} here")
            warn("zero-point-tie", f"zero point from min {zf:g} is exactly on a tie: TensorFlow (eager) rounds half "
                                   f"away from zero to {away}; half to even (XLA before tensorflow/tensorflow#117965, "
                                   f"PyTorch) {other}")
        if zf < qmin or zf > qmax:
            edge = qmin if zf < qmin else qmax
            warn("zero-point-clamped", f"zero point from min {zf:g} lies outside [{qmin}, {qmax}]: clamped to the "
                                       f"grid edge {edge}")
    return {
        "num_bits": grid.num_bits, "narrow_range": grid.narrow_range, "quant_min": qmin, "quant_max": qmax,
        "levels": qmax - qmin + 1, "per_channel": per_channel,
        "grid": {
            "min": plain(grid.min), "max": plain(grid.max), "scale": plain(grid.scale),
            "inv_scale": plain(grid.inv_scale), "zero_point_from_min": plain(grid.zero_point_from_min),
            "zero_point": plain(grid.zero_point, int), "nudged_min": plain(grid.nudged_min),
            "nudged_max": plain(grid.nudged_max),
        },
        "torch": {"scale": plain(t_scale), "zero_point": plain(t_zp, int),
                  "same_grid": plain((t_scale == grid.scale) & (t_zp == grid.zero_point), bool)},
        "warnings": warnings,
        "_grid": grid,
    }


_NUDGE_COLS = None


def _nudge_cols():
    global _NUDGE_COLS
    if _NUDGE_COLS is None:
        from qgcli.report.tables import Col

        # Priority: 0 always shown, higher numbers dropped first to fit the terminal (qgcli.report.tables).
        _NUDGE_COLS = (
            Col("", justify="left", priority=0), Col("min", priority=1), Col("max", priority=1),
            Col("scale", priority=0), Col("inv_scale", priority=3),
            Col("zero_point_from_min", priority=3), Col("zero_point", priority=0),
            Col("nudged_min", priority=0), Col("nudged_max", priority=0),
            Col("torch scale", help="MinMaxObserver's scale and zero point for the same range", priority=2),
            Col("torch zp", help="MinMaxObserver's scale and zero point for the same range", priority=2),
        )
    return _NUDGE_COLS


def _render_nudge(console, doc, notes=None):
    """The grid (``console``: stdout) and the warnings and ``wrote`` line (``notes``: stderr; default
    ``console``)."""
    from qgcli.report.tables import print_items, print_table
    from qgcli.report.text import printable_doc

    doc = printable_doc(doc)
    g = doc["grid"]
    print_items(console, f"[bold]TensorFlow grid[/] num_bits={doc['num_bits']}"
                f"{' narrow_range' if doc['narrow_range'] else ''}: integers \\[{doc['quant_min']}, "
                f"{doc['quant_max']}], {doc['levels']} levels")
    keys = ("min", "max", "scale", "inv_scale", "zero_point_from_min", "zero_point", "nudged_min", "nudged_max")
    channels = list(range(len(g["min"]))) if doc["per_channel"] else [None]
    rows = []
    for c in channels:
        pick = (lambda v: v[c]) if c is not None else (lambda v: v)  # noqa: E731
        rows.append([f"ch {c}" if c is not None else "range",
                     *(f"{pick(g[k]):.9g}" if isinstance(pick(g[k]), float) else str(pick(g[k])) for k in keys),
                     f"{pick(doc['torch']['scale']):.9g}", str(pick(doc["torch"]["zero_point"]))])
    print_table(console, _nudge_cols(), rows)
    print_items(console, "scale = (max - min) / (quant_max - quant_min); zero point = round_half_away(quant_min - "
                "min/scale) clamped to [quant_min, quant_max]; nudged = (quant_min|quant_max - zero_point) * scale. "
                "torch: MinMaxObserver's choice for the same range.", markup=False)
    _render_notes(notes or console, doc, "channel")


def _render_notes(console, doc, unit):
    """Warnings (or "no warnings") and the ``wrote`` line: notes, on stderr beside the result on stdout."""
    from rich.markup import escape

    from qgcli.report.tables import print_items

    for w in doc["warnings"]:
        where = f"{unit} {w['channel']}: " if w["channel"] is not None else ""
        print_items(console, f"[yellow]warning:[/] {escape(where + w['message'])}")
    if not doc["warnings"]:
        print_items(console, "no warnings")
    if doc.get("output") and doc["output"] != "-":
        print_items(console, f"wrote {', '.join(doc['written'])} to {escape(doc['output'])}")


def _render_qdq(console, doc, notes=None):
    """``--variant quantize-and-dequantize-v*``: ComputeQuantizationRange's grid, one line per range."""
    from qgcli.report.tables import print_items
    from qgcli.report.text import markup, printable_doc

    doc = printable_doc(doc)
    g = doc["grid"]
    print_items(console, f"[bold]{markup(doc['op'])} grid[/] num_bits={doc['num_bits']} "
                f"signed_input={str(doc['signed_input']).lower()}{' narrow_range' if doc['narrow_range'] else ''}: "
                f"integers [{doc['quant_min']}, {doc['quant_max']}], {doc['levels']} levels")
    rows = range(len(g["lo"])) if doc["per_channel"] else [None]
    for c in rows:
        pick = (lambda v: v[c]) if c is not None else (lambda v: v)  # noqa: E731
        print_items(console, f"{'range' if c is None else f'slice {c}'}: [{pick(g['input_min']):.7g}, "
                f"{pick(g['input_max']):.7g}] -> grid [{pick(g['lo']):.7g}, {pick(g['hi']):.7g}], "
                f"step {pick(g['step']):.7g} (scale {pick(g['scale']):.7g} levels per unit), "
                f"decided by {pick(g['decided_by'])}", markup=False)
    print_items(console, "each bound proposes a scale, quant_min/input_min and quant_max/input_max (where positive); the "
                "smaller wins and the other side is moved onto the grid: step = bound / quant bound, "
                "output = round(clamp(x, lo, hi) * scale) * step (range_given).", markup=False)
    _render_notes(notes or console, doc, "slice")


_NUDGE_EPILOG = """\b
Examples:
  qgcli nudge --min -6 --max 6 --num-bits 2
  qgcli nudge --min 0.1 --max 5 --json
  qgcli nudge --min -1,-2,0.5 --max 1,2,3 -o grid.h5     # scale, zero_point, ... per channel
  qgcli nudge samples/per_channel.h5
  qgcli nudge --variant quantize-and-dequantize-v4 --min -2 --max 2.5 --num-bits 4   # the symmetric grid
"""


@click.command("nudge", epilog=_NUDGE_EPILOG, short_help="Explain TensorFlow's nudged grid for a range, with warnings.")
@click.argument("bundle", required=False, metavar="[BUNDLE]")
@click.option("--min", "min_", metavar="SPEC", help="Range minimum: a number, a list (per channel) or a tensor SPEC.")
@click.option("--max", "max_", metavar="SPEC", help="Range maximum, like --min.")
@click.option("--num-bits", type=int, default=8, show_default=True, help="Bit width, 2..16.")
@click.option("--narrow-range", is_flag=True, help="Use the grid [1, 2^num_bits - 1].")
@click.option("--variant", type=click.Choice(["fake-quant", *QDQ_VARIANTS]), default="fake-quant", show_default=True,
              help="fake-quant: FakeQuantWithMinMax*'s nudged grid; quantize-and-dequantize-v4/-v3/-v2: the grid "
                   "QuantizeAndDequantize builds (scale from the bound that allows the coarser step).")
@click.option("--signed-input/--no-signed-input", "signed_input", default=None,
              help="Signed grid [default: signed, as TF] (--variant quantize-and-dequantize-v*).")
@click.option("-o", "--output", "output", metavar="OUT", default=None,
              help="Also write the grid (scale, inv_scale, zero_point int32, zero_point_from_min, nudged_min, "
                   "nudged_max) as .h5/.npz/DIR/ or - (usable as --scale/--zero-point of --semantics torch).")
@click.option("--force", is_flag=True, help="Replace an existing output file.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")
def nudge(bundle, min_, max_, num_bits, narrow_range, variant, signed_input, output, force, as_json):
    """Explain TensorFlow's grid for [MIN, MAX]: scale, inv_scale, the zero point from min and rounded, the
    nudged bounds, the number of levels, and PyTorch's observer choice for the same range.

    Warns when the range does not contain 0, min >= max, the zero point sits exactly on a .5 tie, or it
    is clamped to the grid edge. Scalars or per-channel lists; MIN/MAX may also come from BUNDLE.
    The explanation goes to stdout (a table, or JSON with --json); warnings and the wrote line to stderr.
    """
    import numpy as np

    from qgcli.storage.operands import Operands
    from qgcli.storage.outputs import write_outputs

    if variant != "fake-quant":
        return _nudge_qdq(bundle, min_, max_, num_bits, narrow_range, variant, signed_input, output, force, as_json)
    if signed_input is not None:
        raise click.BadParameter("only applies to --variant quantize-and-dequantize-v4/-v3/-v2",
                                 param_hint="'--signed-input'")
    operands = Operands(bundle, {"min": min_, "max": max_}, literal_ok=("min", "max"))
    try:
        doc = explain_grid(operands.get("min"), operands.get("max"), num_bits=num_bits, narrow_range=narrow_range)
        grid = doc.pop("_grid")
        doc = {"command": "nudge", **doc, "output": output}
        if output is not None:
            if as_json and output == "-":
                raise click.UsageError("--json and -o - both want stdout; write the grid to a file or drop --json")
            arrays = {"scale": grid.scale, "inv_scale": grid.inv_scale,
                      "zero_point": grid.zero_point.astype(np.int32), "zero_point_from_min": grid.zero_point_from_min,
                      "nudged_min": grid.nudged_min, "nudged_max": grid.nudged_max}
            doc["written"] = list(arrays)
            write_outputs(arrays, output, operands=operands, force=force,
                          attrs={"op": "Nudge", "num_bits": num_bits, "narrow_range": narrow_range,
                                 "quant_min": grid.quant_min, "quant_max": grid.quant_max})
    finally:
        operands.close()
    if as_json:
        emit(json_safe(doc), as_json=True, quiet=False, render=None)
        return
    if output == "-":
        emit(json_safe(doc), as_json=False, quiet=False, render=_render_nudge)  # the table to stderr
        return
    _render_nudge(stdout_console(), json_safe(doc), notes=stderr_console())


def _nudge_qdq(bundle, min_, max_, num_bits, narrow_range, variant, signed_input, output, force, as_json):
    """``--variant quantize-and-dequantize-v*``: the grid of :func:`qgcli.ops.quantize_and_dequantize.explain_grid`."""
    from qgcli.families.qdq import nudge_doc

    doc, arrays, attrs, operands = nudge_doc(bundle, min_, max_, num_bits=num_bits, narrow_range=narrow_range,
                                             variant=variant, signed_input=signed_input)
    doc["output"] = output
    try:
        if output is not None:
            from qgcli.storage.outputs import write_outputs

            if as_json and output == "-":
                raise click.UsageError("--json and -o - both want stdout; write the grid to a file or drop --json")
            doc["written"] = list(arrays)
            write_outputs(arrays, output, operands=operands, force=force, attrs=attrs)
    finally:
        operands.close()
    if as_json:
        emit(json_safe(doc), as_json=True, quiet=False, render=None)
    elif output == "-":
        emit(json_safe(doc), as_json=False, quiet=False, render=_render_qdq)
    else:
        _render_qdq(stdout_console(), json_safe(doc), notes=stderr_console())
