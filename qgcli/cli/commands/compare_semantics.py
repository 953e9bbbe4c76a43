"""``qgcli compare-semantics``: one tensor under TensorFlow's and PyTorch's fake quant (with ``--with``, also
torchao's and ONNX QuantizeLinear), and where and why they disagree (grid, tie rounding, float arithmetic, mask on the float vs the rounded value).
Only click is imported at module level.
"""
import click

from qgcli.cli.options import bundle_argument, operand_group, report_options, spec_option
from qgcli.report.summaries import emit, json_safe, percent
from qgcli.report.text import counted


def _first_indices(mask, k):
    import numpy as np

    from qgcli.backend import to_numpy

    flat = np.flatnonzero(to_numpy(mask).reshape(-1))[:k]
    return [list(map(int, np.unravel_index(i, mask.shape))) for i in flat] if mask.ndim else [[] for _ in flat]


def summarise_comparison(result, first=10):
    """Counts, shares, first indices and reasons from :func:`qgcli.ops.torch_semantics.compare_with_tensorflow`."""
    import numpy as np

    from qgcli.backend import to_numpy
    from qgcli.ops.torch_semantics import FORWARD_REASONS, MASK_REASONS

    n = int(result["outputs_tf"].size)
    grids = result["grids"]
    doc = {"elements": n}
    for part, key, reasons in (("forward", "forward_reason", FORWARD_REASONS), ("mask", "mask_reason", MASK_REASONS)):
        codes = to_numpy(result[key])
        counts = np.bincount(codes.reshape(-1), minlength=len(reasons))
        differ = int(n - counts[0])
        doc[part] = {"differ": differ, "share": differ / n if n else 0.0,
                     "first": _first_indices(codes != 0, first),
                     "reasons": {reasons[c]: int(counts[c]) for c in range(1, len(reasons)) if counts[c]}}
    mtf, mpt = to_numpy(result["mask_tf"]).astype(bool), to_numpy(result["mask_torch"]).astype(bool)
    doc["mask"]["tf_only"] = int((mtf & ~mpt).sum())
    doc["mask"]["torch_only"] = int((~mtf & mpt).sum())
    if "backprops_wrt_input_tf" in result:
        # Only the gradients' magnitudes matter here; NaN/inf upstream values count as 0.
        g_tf = to_numpy(result["backprops_wrt_input_tf"]).astype(np.float64)
        g_pt = to_numpy(result["backprops_wrt_input_torch"]).astype(np.float64)
        with np.errstate(all="ignore"):
            mag = np.where(mtf, np.abs(g_tf), np.abs(g_pt))
            mag = np.where(np.isfinite(mag), mag, 0.0)
        total_tf = float(np.where(np.isfinite(g_tf), np.abs(g_tf), 0).sum())
        moved = float(np.where(mtf != mpt, mag, 0.0).sum())
        doc["gradient"] = {"mass_on_differing_mask": moved / total_tf if total_tf else 0.0}
    tf = grids["tf"]

    def plain(a, kind=float):
        a = np.asarray(a)
        return [kind(v) for v in a.tolist()] if a.ndim else kind(a)

    doc["grids"] = {
        "per_channel": grids["per_channel"], "axis": grids["axis"], "quant_min": grids["quant_min"],
        "quant_max": grids["quant_max"],
        "tf": {"scale": plain(tf.scale), "zero_point": plain(tf.zero_point, int), "nudged_min": plain(tf.nudged_min),
               "nudged_max": plain(tf.nudged_max)},
        "torch": {"scale": plain(grids["torch_scale"]), "zero_point": plain(grids["torch_zero_point"], int)},
        "differ": [bool(r) for r in grids["reasons"]],
        "reasons": [{"channel": c if grids["per_channel"] else None, "reasons": r}
                    for c, r in enumerate(grids["reasons"]) if r],
    }
    return doc


_WHY = {
    "grid": "the grids differ (see above)",
    "tie": "x/scale exactly on a half step: TF rounds half up (floor(v + 0.5)), PyTorch half to even",
    "arithmetic": "TF rounds (clamp(x) - nudged_min)/scale, PyTorch x*(1/scale): different float rounding next "
                  "to a half step",
    "nonfinite": "NaN/inf input: TF propagates NaN, PyTorch returns a grid edge",
    "rounded": "TF masks the float input on the nudged bounds, PyTorch the rounded integer: up to half a step "
               "outside the range still passes in PyTorch",
}


def _render_compare(console, s):
    """The report (``s`` already through :func:`qgcli.report.text.printable_doc`): lines broken between items only."""
    from rich.markup import escape

    from qgcli.report.tables import print_items

    grids = s["grids"]
    print_items(console, f"[bold]TensorFlow vs PyTorch[/] on {counted(s['elements'], 'element', thousands=True)}, integers "
                f"\\[{grids['quant_min']}, {grids['quant_max']}]"
                + (f", per channel on axis {grids['axis']}" if grids["per_channel"] else ""))
    tf, pt = grids["tf"], grids["torch"]
    if grids["per_channel"]:
        same = sum(1 for d in grids["differ"] if not d)
        print_items(console, f"grids: {same} of {len(grids['differ'])} channels identical (scale and zero point)")
    else:
        print_items(console, f"grid TF: scale {tf['scale']:.7g}, zero point {tf['zero_point']} (nudged "
                    f"[{tf['nudged_min']:.7g}, {tf['nudged_max']:.7g}]); PyTorch: scale {pt['scale']:.7g}, "
                    f"zero point {pt['zero_point']}", markup=False)
    for r in grids["reasons"][:8]:
        where = f"channel {r['channel']}: " if r["channel"] is not None else ""
        for why in r["reasons"]:
            print_items(console, f"  {escape(where + why)}")
    for part, label in (("forward", "forward values"), ("mask", "gradient masks")):
        d = s[part]
        print_items(console, escape(f"{label} differ at {counted(d['differ'], 'element', thousands=True)} ({percent(d['share'])})"
                                    + (f"; first {', '.join(map(str, d['first'][:5]))}" if d["first"] else "")))
        for reason, count in d["reasons"].items():
            print_items(console, f"  {count:,} {reason}: {escape(_WHY[reason])}")
    m = s["mask"]
    if m["differ"]:
        print_items(console, f"  pass in TF only: {m['tf_only']:,}; in PyTorch only: {m['torch_only']:,}")
    if "gradient" in s:
        print_items(console, "upstream gradient mass where the masks differ: "
                    f"{percent(s['gradient']['mass_on_differing_mask'])}")


def _render_wrote(console, s):
    """The note that ends a run with ``-o FILE``: on stderr, as every command's ``wrote`` line."""
    from rich.markup import escape

    from qgcli.report.tables import print_items

    if s.get("output") and s["output"] != "-":
        print_items(console, f"wrote {', '.join(s['written'])} to {escape(s['output'])}")


def _frameworks(text):
    """The --with list (None: the TensorFlow-vs-PyTorch report)."""
    if text is None:
        return None
    from qgcli.ops.cross_semantics import FRAMEWORKS

    chosen = [t.strip().lower() for t in text.split(",") if t.strip()]
    bad = [t for t in chosen if t not in FRAMEWORKS]
    if bad or len(chosen) < 2 or len(set(chosen)) != len(chosen):
        raise click.BadParameter(f"{text!r}: name two or more of {', '.join(FRAMEWORKS)}, each once",
                                 param_hint="'--with'")
    return None if chosen == ["tf", "torch"] else tuple(chosen)


_REASON_WHY = {
    "nonfinite": "NaN/Inf input: TF propagates NaN, the others give a grid edge",
    "grid": "the scales or zero points differ",
    "range": "outside the other's integer range (narrow range, or ONNX's type)",
    "tie": "x/scale exactly on a half step: TF rounds half up, PyTorch, torchao and ONNX half to even",
    "zero point": "TF adds the zero point before rounding ((x - nudged_min) in float32), the others after",
    "arithmetic": "x * (1/scale) (PyTorch, torchao) against x / scale (ONNX), each rounded to float32",
}


def _compare_integers(operands, x, mn, mx, chosen, num_bits, narrow_range, axis, first, output, force, as_json,
                      quiet):
    """compare-semantics --with: the integers of each framework (qgcli.ops.cross_semantics)."""
    from qgcli.errors import QgcliError
    from qgcli.ops.cross_semantics import REASONS, compare
    from qgcli.storage.outputs import write_outputs

    try:
        doc, arrays = compare(x, mn, mx, frameworks=chosen, num_bits=num_bits, narrow_range=narrow_range, axis=axis,
                              first=first)
    except QgcliError as exc:
        if exc.operand == "--with":
            raise click.BadParameter(str(exc).split(": ", 1)[-1], param_hint="'--with'") from None
        raise
    doc = {"command": "compare-semantics", "with": list(chosen), **doc, "output": output}
    if output is not None:
        doc["written"] = list(arrays)
        write_outputs(arrays, output, operands=operands, force=force, attrs={
            "op": "compare-semantics", "with": ",".join(chosen), "num_bits": num_bits, "narrow_range": narrow_range,
            "reason_codes": ", ".join(f"{i}={r}" for i, r in enumerate(REASONS))})
    _show(doc, _render_integers, as_json=as_json, quiet=quiet, output=output)


def _render_integers(console, s):
    from rich.markup import escape

    from qgcli.report.tables import print_items

    names = {"tf": "TensorFlow", "torch": "PyTorch", "onnx": "ONNX QuantizeLinear", "torchao": "torchao"}
    print_items(console, f"[bold]{' vs '.join(names[f] for f in s['with'])}[/] on "
                f"{counted(s['elements'], 'element', thousands=True)}, {s['num_bits']} bits")
    for f, d in s["frameworks"].items():
        scale = d["scale"] if not isinstance(d["scale"], list) else f"{len(d['scale'])} channels"
        grid = f" (the grid of {d['grid_of']}, {d['dtype']})" if f == "onnx" else ""
        err = d["max_abs_error_steps_inside"]
        print_items(console, escape(f"{f}: scale {scale if isinstance(scale, str) else f'{scale:.7g}'}, zero point "
                                    f"{d['zero_point'] if not isinstance(d['zero_point'], list) else '...'}, integers "
                                    f"[{d['quant_min']}, {d['quant_max']}]{grid}; error inside the range up to "
                                    f"{'-' if err is None else f'{err:.4g}'} steps"))
    for p in s["pairs"]:
        print_items(console, escape(f"{p['a']} vs {p['b']}: integers differ at "
                                    f"{counted(p['differ'], 'element', thousands=True)} ({percent(p['share'])}), by "
                                    f"at most {p['max_integer_difference']}"
                                    + (f"; first {', '.join(map(str, p['first'][:5]))}" if p["first"] else "")))
        for reason, count in p["reasons"].items():
            print_items(console, f"  {count:,} {reason}: {escape(_REASON_WHY[reason])}")


_COMPARE_EPILOG = """\b
Examples:
  qgcli compare-semantics samples/notebook.h5 --num-bits 2
  qgcli compare-semantics samples/per_channel.h5 --json | jq .mask
  qgcli compare-semantics --inputs x.npy --min 0.1 --max 5 -o diff.h5
  qgcli compare-semantics samples/notebook.h5 --with tf,torch,onnx --json
  qgcli compare-semantics samples/notebook.h5 --with tf,torchao,onnx
"""


@click.command("compare-semantics", epilog=_COMPARE_EPILOG,
               short_help="Where TF, PyTorch, torchao and ONNX fake quant disagree on a tensor, and why.")
@operand_group(
    bundle_argument(),
    spec_option("inputs", "The tensor (operand 'inputs')."),
    spec_option("gradients", "Optional upstream gradient: also the gradient mass affected."),
    spec_option("min", "Range minimum: scalar or one per channel."),
    spec_option("max", "Range maximum: scalar or one per channel."),
)
@click.option("--num-bits", type=int, default=8, show_default=True, help="Bit width, 2..16.")
@click.option("--narrow-range", is_flag=True, help="Use the grid [1, 2^num_bits - 1] (both frameworks).")
@click.option("--axis", type=int, default=None, help="Channel axis for per-channel min/max (default -1, TF's).")
@click.option("--with", "frameworks", metavar="FW,FW[,...]", default=None,
              help="Compare these on the integers they give: tf, torch, onnx (QuantizeLinear with the grid of the "
                   "first of tf/torch/torchao named, the deployed kernel), torchao (its QAT IntxFakeQuantizer, "
                   "uint<num_bits> asymmetric, the range as its block's min/max). Default: tf,torch (the full "
                   "report below).")
@click.option("--first", type=click.IntRange(0, 1000), default=10, show_default=True,
              help="How many differing indices to list.")
@click.option("-o", "--output", "output", metavar="OUT", default=None,
              help="Also write outputs_tf/_torch, mask_tf/_torch, forward_reason, mask_reason (and "
                   "backprops_wrt_input_tf/_torch with gradients).")
@click.option("--force", is_flag=True, help="Replace an existing output file.")
@report_options
def compare_semantics(operands, num_bits, narrow_range, axis, frameworks, first, output, force, as_json, quiet,
                      device):
    """Run one tensor through TensorFlow's FakeQuantWithMinMaxVars(PerChannel) and PyTorch's
    fake_quantize_per_{tensor,channel}_affine, each deriving its grid from MIN/MAX as it would (TF
    nudges the range; PyTorch's MinMaxObserver widens it to 0 and rounds the zero point half to even),
    and report where forward values and gradient masks disagree: counts, shares, first indices and why
    (grid, tie rounding, float arithmetic, mask on the float vs the rounded value). --with adds torchao's
    QAT fake quant and ONNX QuantizeLinear and compares any of the four on the integers they give.
    """
    from qgcli.storage.operands import Operands, to_device
    from qgcli.ops.torch_semantics import FORWARD_REASONS, MASK_REASONS, compare_with_tensorflow
    from qgcli.storage.outputs import write_outputs

    specs = operands
    operands = Operands.of(specs, literal_ok=("min", "max"))
    try:
        x = operands.get("inputs")
        g = (operands.get("gradients", required=False)
             if (specs.get("gradients") is not None or specs.bundle is not None) else None)
        mn, mx = operands.get("min"), operands.get("max")
        import numpy as np

        if axis is not None and np.ndim(mn) != 1:
            raise click.BadParameter("only applies to per-channel (1-d) min/max", param_hint="'--axis'")
        chosen = _frameworks(frameworks)
        if chosen is not None:
            return _compare_integers(operands, x, mn, mx, chosen, num_bits, narrow_range, axis, first, output, force,
                                     as_json, quiet)
        xp, (g, x) = to_device([g, x], device)
        result = compare_with_tensorflow(x, mn, mx, num_bits=num_bits, narrow_range=narrow_range, axis=axis,
                                         gradients=g)
        doc = {"command": "compare-semantics", **summarise_comparison(result, first), "output": output}
        if output is not None:
            arrays = {k: v for k, v in result.items() if k != "grids"}
            doc["written"] = list(arrays)
            write_outputs(arrays, output, operands=operands, force=force, attrs={
                "op": "compare-semantics", "num_bits": num_bits, "narrow_range": narrow_range,
                "forward_reason_codes": ", ".join(f"{k}={v}" for k, v in FORWARD_REASONS.items()),
                "mask_reason_codes": ", ".join(f"{k}={v}" for k, v in MASK_REASONS.items())})
    finally:
        operands.close()
    _show(doc, _render_compare, as_json=as_json, quiet=quiet, output=output)


def _show(doc, render, *, as_json, quiet, output):
    """The report is the result: stdout (stderr when -o - puts the data on stdout); "wrote" is a note: stderr."""
    if as_json or output == "-":
        emit(json_safe(doc), as_json=as_json, quiet=quiet, render=render, output=output)
        return
    from qgcli.report.summaries import stderr_console, stdout_console
    from qgcli.report.text import printable_doc

    shown = printable_doc(json_safe(doc))
    render(stdout_console(), shown)
    if not quiet:
        _render_wrote(stderr_console(), shown)
