"""``qgcli plot``: the tutorial notebook's figures (staircase, STE) from saved tensors, histograms,
per-channel views and gradient estimators overlaid.

Only click is imported at module level: matplotlib (through :mod:`qgcli.report.plots`) is imported when a
figure is drawn, so ``qgcli --help`` stays fast.  (``fakequant-grad --plot FIG`` draws through its runner.)
"""
import click

from qgcli.cli.options import (
    block_format_options,
    QD_VARIANT,
    QDQ_VARIANTS,
    attribute_group,
    bundle_argument,
    device_option,
    force_option,
    json_option,
    narrow_range_option,
    num_bits_option,
    operand_group,
    opt,
    option_group,
    qdq_options,
    quantize_options,
    quiet_option,
    refuse_missing_bundle,
    refuse_quantize_options,
    run_file_target,
    semantics_options,
    spec_option,
    typed_overrides,
)
from qgcli.report.summaries import emit, json_safe
from qgcli.report.text import counted

# Variants the plots can draw; qgcli.report.plots.run_variant maps each to its ops.
PLOT_VARIANTS = ("args", "vars", "per-channel")
# staircase, ste and estimators also draw TF's QuantizeV2 + Dequantize round trip (the notebook's own fake quant).
MAX_PIXELS = 20000  # per side: a typo in --dpi should not allocate gigabytes
_TALLEST = 8.2  # default height of the tallest figure (three per-channel panels)


# --- options ------------------------------------------------------------------------------------------

def _figure(**values):
    from qgcli.jobs import FigureOptions

    return FigureOptions(**values)


def _operand_options(*, gradients_help=None, channel=True, variants=PLOT_VARIANTS, blocks=False):
    """BUNDLE, --inputs, (--gradients), --min, --max as ``operands``; --num-bits, --narrow-range, --variant,
    --axis as ``attributes``; (--channel)."""
    def decorate(f):
        if channel:
            f = click.option("--channel", type=int, default=None, metavar="K",
                             help="Draw channel K of the channel axis (--axis, default the last) only; "
                                  "otherwise all elements, flattened.")(f)
        f = attribute_group(
            num_bits_option(),
            narrow_range_option(),
            opt("--variant", type=click.Choice(variants), default=None,
                help="TF op family; default: per-channel when min/max are vectors, else vars." + (
                    f" {QD_VARIANT}: the notebook's tf.quantize + tf.dequantize (--dtype, --mode...)."
                    if QD_VARIANT in variants else "") + (
                    " quantize-and-dequantize-v4/-v3/-v2: TF's QuantizeAndDequantize (--signed-input, "
                    "--range-given, --round-mode; --axis K per slice)." if QDQ_VARIANTS[0] in variants
                    else "")),
            opt("--axis", type=int, default=None,
                help="Channel axis (TF: the last axis, -1) for per-channel min/max and --channel."),
        )(f)
        specs = [bundle_argument(), spec_option("inputs", "Forward inputs (TF operand 'inputs').")]
        if gradients_help:
            specs.append(spec_option("gradients", gradients_help))
        specs += [spec_option("min", "Range minimum: scalar or one per channel."),
                  spec_option("max", "Range maximum: scalar or one per channel.")]
        if blocks:
            specs += [spec_option("x", "ONNX QuantizeLinear's 'x' (--semantics onnx; --inputs too)."),
                      spec_option("y_scale", "ONNX QuantizeLinear's 'y_scale' (--semantics onnx)."),
                      spec_option("y_zero_point", "ONNX QuantizeLinear's 'y_zero_point' (--semantics onnx).")]
        return operand_group(*specs)(f)

    return decorate


def _figure_options(width, height, height_default="1 + 2.4 per panel"):
    """-o FIG, --force, --dpi, --title, --width, --height, --json, --quiet, --device as ``figure``."""
    return option_group(
        "figure", _figure,
        opt("-o", "--output", "destination", metavar="FIG", required=True,
            help="Figure file, or - for stdout; the format follows the extension: .png, .svg or .pdf."),
        opt("--format", "format", type=click.Choice(["png", "svg", "pdf"]), default=None,
            help="Figure format, over the extension  [default: from FIG; png on stdout]"),
        force_option("Replace an existing figure file."),
        opt("--dpi", type=click.IntRange(10, 1200), default=100, show_default=True,
            help="Pixels per inch (PNG size = width x height x dpi)."),
        opt("--title", default=None, help="Replace the title (the default names the op and grid)."),
        opt("--width", type=click.FloatRange(1, 50), default=width, show_default=True,
            help="Figure width in inches."),
        opt("--height", type=click.FloatRange(1, 50), default=height, show_default=height is not None,
            help="Figure height in inches." + ("" if height is not None else
                                               f"  [default: {height_default}]")),
        json_option(),
        quiet_option(),
        device_option(),
    )


# --- running a plot -----------------------------------------------------------------------------------

def _check_pixels(width, height, dpi):
    if max(width, height) * dpi > MAX_PIXELS:
        raise click.BadParameter(f"{width:g} x {height:g} in at {dpi} dpi exceeds {MAX_PIXELS} pixels per side",
                                 param_hint="'--dpi'")


def _load_range(operands, variant, axis, channel):
    """(inputs, min, max, variant) by fakequant's rules; --axis only where a channel axis is meant."""
    from qgcli.families.tf_fake_quant import load_fake_quant_operands

    _, inputs, mn, mx, variant = load_fake_quant_operands(operands, variant, with_gradients=False)
    if axis is not None and variant not in ("per-channel", QD_VARIANT) and channel is None:
        raise click.BadParameter("only applies to per-channel min/max or with --channel", param_hint="'--axis'")
    return inputs, mn, mx, variant


def _run(command, specs, figure, draw, *, literal_ok=("min", "max"), tallest=_TALLEST, per_layer=None, layer=None):
    """Shared flow: resolve operands, check the figure path, draw on the device's arrays, save, report.
    ``per_layer=(kind, plot options)``: a run file as BUNDLE draws one figure per group (or ``layer``)."""
    from qgcli.storage.operands import Operands, to_device
    from qgcli.storage.outputs import check_figure_output, save_checked

    f = figure
    if per_layer is not None:
        target = run_file_target(specs)
        if layer is not None and target is None:
            refuse_missing_bundle(specs.bundle)
            raise click.BadParameter("needs a run file as BUNDLE (groups holding quantizers' operands)",
                                     param_hint="'--layer'")
        if target is not None:
            return _run_layers(command, target, f, per_layer, layer)
    _check_pixels(f.width, f.height or tallest, f.dpi)
    if f.as_json and f.destination == "-":
        raise click.UsageError("--json and -o - both want stdout; write the figure to a file or drop --json")
    operands = Operands.of(specs, literal_ok=literal_ok)
    try:
        check_figure_output(f.destination, inputs=operands.input_paths(), force=f.force, format=f.format)
        fig = draw(operands, lambda *arrays: to_device(arrays, f.device)[1])
        fmt = save_checked(fig, f.destination, f.dpi, format=f.format)
    finally:
        operands.close()
    w, h = (float(v) for v in fig.get_size_inches())
    size = [int(round(w * f.dpi)), int(round(h * f.dpi))]
    summary = json_safe({"command": command, "output": f.destination, "format": fmt,
                         "size_px": size if fmt == "png" else None, "size_in": [w, h], "dpi": f.dpi,
                         **fig.qgcli_summary})
    emit(summary, as_json=f.as_json, quiet=f.quiet, render=_render, output=f.destination)


def _run_layers(command, target, f, per_layer, layer):
    """A run file: one figure per group into ``-o DIR/`` (worker processes), or the group ``--layer`` to FIG."""
    import os
    import time

    from qgcli.report import layer_figures
    from qgcli.storage.outputs import check_figure_output, save_checked
    from qgcli.report.progress import Progress

    kind, options = per_layer
    options = dict(options)
    quantize = options.pop("quantize", None)
    if quantize is not None:
        refuse_quantize_options(quantize)
    _check_pixels(f.width, f.height or _TALLEST, f.dpi)
    tasks, skipped = layer_figures.plan(target, kind, typed_overrides(), plot_options=options, layer=layer)
    file = tasks[0].file if tasks else target
    if layer is not None:
        if f.as_json and f.destination == "-":
            raise click.UsageError("--json and -o - both want stdout; write the figure to a file or drop --json")
        check_figure_output(f.destination, inputs=[file], force=f.force, format=f.format)
        fig = layer_figures.draw(tasks[0])
        fmt = save_checked(fig, f.destination, f.dpi, format=f.format)
        w, h = (float(v) for v in fig.get_size_inches())
        summary = json_safe({"command": command, "output": f.destination, "format": fmt,
                             "size_px": [int(round(w * f.dpi)), int(round(h * f.dpi))] if fmt == "png" else None,
                             "size_in": [w, h], "dpi": f.dpi, **fig.qgcli_summary})
        emit(summary, as_json=f.as_json, quiet=f.quiet, render=_render, output=f.destination)
        return
    dest = f.destination
    if not (dest.endswith("/") or os.path.isdir(dest)):
        raise click.BadParameter("a run file holds one figure per group: give a folder (-o DIR/) or one group "
                                 "(--layer PATH)", param_hint="'--output'")
    if not tasks:
        from qgcli.errors import QgcliError

        reasons = "; ".join(f"{s['path']}: {s['reason']}" for s in skipped[:5]) or "no groups"
        raise QgcliError(f"{file}: no group plot {kind} can draw ({reasons})", operand="BUNDLE")
    from qgcli.storage import io

    io.check_output(dest.rstrip("/") + "/", inputs=[file], force=f.force)
    fmt = f.format or "png"
    start = time.perf_counter()
    with Progress(f"plot {kind}", total=len(tasks), quiet=f.quiet) as progress:
        try:
            figures, index, used = layer_figures.write_all(tasks, dest, dpi=f.dpi, fmt=fmt, force=f.force,
                                                           on_done=lambda task: progress.advance())
        except layer_figures.WorkerFailed as exc:
            raise click.ClickException(str(exc)) from None
        except OSError as exc:
            raise click.ClickException(f"cannot write {dest}: {exc.strerror or exc}") from None
    seconds = time.perf_counter() - start
    summary = json_safe({"command": command, "run_file": target, "output": dest, "format": fmt, "dpi": f.dpi,
                         "figures": len(figures), "workers": used, "seconds": round(seconds, 3), "index": index,
                         "layers": [{"path": s["path"], "file": s["file"], "op": s.get("op"),
                                     "group_op": s.get("group_op"), "size_in": s["size_in"]} for s in figures],
                         "skipped": skipped})
    emit(summary, as_json=f.as_json, quiet=f.quiet, render=_render_layers, output=dest)


def _render_layers(console, s):
    console.print(f"wrote {counted(s['figures'], 'figure')} ({s['format']}) to {s['output']} in {s['seconds']:.1f} s "
                  f"({counted(s['workers'] or 1, 'process', 'processes')})"
                  + (f"; names changed, see {s['index']}" if s["index"] else ""), soft_wrap=True, markup=False)
    for item in s["skipped"]:
        console.print(f"not drawn: {item['path']} ({item['op'] or 'no op'}): {item['reason']}", soft_wrap=True,
                      markup=False)


def _render(console, s):
    what = s.get("outputs_op") or s.get("op") or ", ".join(s.get("vectors", []))
    size = f"{s['size_px'][0]}x{s['size_px'][1]} px" if s["size_px"] else f"{s['size_in'][0]:g}x{s['size_in'][1]:g} in"
    detail = (counted(s['channels'], 'channel') if s["plot"] == "channels"
              else f"{s['points']:,} of {s['elements']:,} points" if s["plot"] != "hist"
              else f"{counted(s['points'], 'value', thousands=True)} in {counted(s['bins'], 'bin')}")
    where = "stdout" if s["output"] == "-" else s["output"]
    console.print(f"wrote {where} ({s['format']}, {size}): {s['plot']} of {what}, {detail}", soft_wrap=True,
                  markup=False)  # the path and the operand names are the user's: no markup in them
    for name, other in s.get("coincide") or ():
        console.print(f"note: estimator {name} coincides with {other} on the plotted range (drawn over it, "
                      "with markers)", soft_wrap=True, markup=False)


_PLOT_HELP = """Draw the tutorial notebook's figures and per-channel views from saved tensors.

Operands come from BUNDLE (an .h5/.npz with datasets named inputs, min, max, gradients) or from
--inputs/--min/--max/--gradients SPEC options, as for fakequant. Every number drawn comes from the
TensorFlow-exact ops; the figure is written headless to FIG (.png, .svg or .pdf, from the extension).
"""

_PLOT_EPILOG = """\b
Examples (the notebook's three figures, then a per-channel view):
  qgcli plot staircase samples/notebook.h5 --num-bits 2 -o staircase.png
  qgcli plot ste samples/notebook.h5 --num-bits 2 -o ste.png
  qgcli plot ste samples/notebook.h5 --num-bits 2 --gradients samples/notebook.h5:gradients -o ste_backprop.png
  qgcli plot channels samples/per_channel.h5 -o channels.png
"""


@click.group("plot", help=_PLOT_HELP, epilog=_PLOT_EPILOG,
             short_help="Figures: quantization staircase, STE, histogram, per-channel views.")
def plot():
    pass


@plot.command("trend", epilog="""\b
Examples:
  qgcli plot trend run.qgh -o trend.png
""")
@click.argument("history", metavar="HISTORY", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", "destination", metavar="FIG", required=True,
              help="Figure file; the format follows the extension: .png, .svg or .pdf.")
@force_option("Replace an existing figure file.")
@click.option("--dpi", type=click.IntRange(10, 1200), default=100, show_default=True, help="Pixels per inch.")
@click.option("--worst", type=click.IntRange(1, 20), default=4, show_default=True,
              help="How many of the worst layers (largest blocked gradient share) get curves.")
def trend(history, destination, force, dpi, worst):
    """Layer x step heat maps of a history (blocked gradient, clipping, oscillation) and the worst layers' curves."""
    from qgcli.monitor.figures import trend_figure
    from qgcli.monitor.history import read_history
    from qgcli.monitor.trends import trend as trend_of
    from qgcli.report.plots import save_figure
    from qgcli.storage.outputs import check_figure_output

    check_figure_output(destination, inputs=[history], force=force)
    save_figure(trend_figure(trend_of(read_history(history)), worst=worst), destination, dpi=dpi)


_LAYER = click.option("--layer", "layer", metavar="PATH", default=None,
                       help="Run file: draw the group PATH only (default: one figure per group into -o DIR/).")

_MAX_POINTS = click.option("--max-points", type=click.IntRange(10, 10_000_000), default=4000, show_default=True,
                           help="Largest number of points a line plot draws (a deterministic subsample of the "
                                "sorted inputs, keeping every step edge; the figure says how many).")


def _view_kwargs(attributes, variant, channel, figure, quantize=None, qdq_attrs=None):
    a, f = attributes, figure
    extra = {"quantize": qdq_attrs} if qdq_attrs is not None else _quantize_kwargs(variant, quantize)
    return dict(num_bits=a.num_bits, narrow_range=a.narrow_range, variant=variant,
                axis=-1 if a.axis is None else a.axis, channel=channel, title=f.title, width=f.width,
                height=f.height, **extra)


def _load_staircase(operands, attributes, channel, quantize, qdq):
    """(inputs, min, max, variant, QuantizeAndDequantize attrs or None) for staircase and ste."""
    if attributes.variant in QDQ_VARIANTS:
        from qgcli.families.qdq import plot_operands

        x, mn, mx, attrs = plot_operands(operands, attributes.variant, qdq, quantize, attributes.axis, channel)
        return x, mn, mx, attributes.variant, attrs
    x, mn, mx, var = _load_range(operands, attributes.variant, attributes.axis, channel)
    return x, mn, mx, var, None


def _refuse_qdq_options(attributes, qdq):
    """--signed-input/--range-given only with --variant quantize-and-dequantize-v* (checked before any file)."""
    if attributes.variant in QDQ_VARIANTS:
        return
    for option, value in (("--signed-input", qdq.signed_input), ("--range-given", qdq.range_given)):
        if value is not None:
            raise click.BadParameter("only applies to --variant quantize-and-dequantize-v4/-v3/-v2",
                                     param_hint=f"'{option}'")


def _layer_options(figure, quantize, **options):
    """The plot options of one figure per layer (a run file's groups are TensorFlow fake quant: the QuantizeV2
    options do not apply)."""
    return {**options, "title": figure.title, "width": figure.width, "height": figure.height, "quantize": quantize}


def _quantize_kwargs(variant, quantize):
    """``{"quantize": attrs}`` for the round trip; the QuantizeV2 options are refused for other variants."""
    if variant != QD_VARIANT:
        if quantize is not None:
            refuse_quantize_options(quantize)
        return {}
    from qgcli.jobs import QuantizeAttributes

    return {"quantize": (quantize or QuantizeAttributes()).resolved()}


# --- block formats: plot hist / channels per block ----------------------------------------------------------

BLOCK_SEMANTICS = ("tf", "mx", "nvfp4", "onnx")


def _block_options(f, dtype=True):
    """--semantics (tf, or a block format), the block formats' options and --dtype (--semantics onnx; where the
    command has no --dtype of its own)."""
    if dtype:
        f = click.option("--dtype", default=None, metavar="TYPE",
                         help="QuantizeLinear's output type (--semantics onnx) [default: uint8, or the zero point's].")(f)
    f = block_format_options(f)
    return click.option("--semantics", type=click.Choice(BLOCK_SEMANTICS), default="tf", show_default=True,
                        help="tf: TensorFlow's fake quant on min/max; mx, nvfp4, onnx: the block format, drawn per "
                             "block (as 'qgcli fakequant --semantics ...' computes it; --channel K: block K).")(f)


def _block_options_of_quantize(f):
    """:func:`_block_options` for the commands whose --dtype is already there (--variant quantize-dequantize's)."""
    return _block_options(f, dtype=False)


def _refuse_block_options(operands, formats, dtype):
    """--semantics tf: the block formats' options and operands do not apply."""
    for option, value in (*formats.given().items(), ("--dtype", dtype), ("--x", operands.get("x")),
                          ("--y-scale", operands.get("y_scale")), ("--y-zero-point", operands.get("y_zero_point"))):
        if value is not None:
            raise click.BadParameter("only applies to --semantics mx / nvfp4 / onnx", param_hint=f"'{option}'")


def _block_run(command, operands, attributes, semantics, formats, dtype, figure, layer, draw_view,
               with_gradients=False):
    """plot hist / channels of a block format: the family that claims --semantics builds the job (options
    checked as fakequant checks them) and its view of the tensor per block; ``draw_view(view)`` draws it."""
    from qgcli.families import registry
    from qgcli.jobs import EstimatorOptions, FakeQuantOptions, OutputOptions, QuantizeAttributes, SemanticsOptions

    if layer is not None or run_file_target(operands) is not None:  # (a run file with --semantics is refused)
        raise click.BadParameter("a run file's groups name their format: draw them without --semantics",
                                 param_hint="'--semantics'")
    job = registry.job_from_options(FakeQuantOptions(
        command, with_gradients, operands, attributes, QuantizeAttributes(dtype=dtype), SemanticsOptions(semantics),
        EstimatorOptions(), OutputOptions(None, quiet=True), formats=formats))
    family = registry.of(job)
    _run(command, job.operands, figure, lambda loaded, on_device: draw_view(family.block_view(job.formats, loaded),
                                                                            loaded), literal_ok=family.LITERAL_OK)


def _block_staircase(command, operands, attributes, semantics, formats, quantize, qdq, channel, max_points, layer,
                     figure):
    """plot staircase / ste --semantics mx / nvfp4 / onnx: the element grid's staircase (and for ste the op's
    gradient function), every block on one grid (--channel K: block K); --dtype is QuantizeLinear's type."""
    from qgcli.report import block_plots

    _refuse_qdq_options(attributes, qdq)
    for option, value in quantize.given().items():
        if option != "--dtype" and value is not None:
            raise click.BadParameter(f"does not apply to --semantics {semantics}", param_hint=f"'{option}'")
    common = dict(channel=channel, max_points=max_points, title=figure.title, width=figure.width,
                  **({} if figure.height is None else {"height": figure.height}))

    def draw(view, loaded):
        import numpy as np

        if command == "plot ste":
            g = loaded.get("gradients") if operands.get("gradients") is not None else None
            return block_plots.ste(view, gradients=None if g is None else np.asarray(g), **common)
        return block_plots.staircase(view, **common)

    _block_run(command, operands, attributes, semantics, formats, quantize.dtype, figure, layer, draw,
               with_gradients=command == "plot ste" and operands.get("gradients") is not None)


@plot.command("staircase", epilog="""\b
Example:
  qgcli plot staircase samples/notebook.h5 --num-bits 2 -o staircase.png
  qgcli plot staircase samples/per_channel.h5 --channel 3 -o ch3.svg
  qgcli plot staircase samples/notebook.h5 --variant quantize-dequantize --dtype quint8 -o roundtrip.png
  qgcli plot staircase --inputs x.npy --min -2 --max 2.5 --num-bits 4 --variant quantize-and-dequantize-v4 \\
      --range-given -o qdq.png
""")
@_operand_options(variants=PLOT_VARIANTS + (QD_VARIANT,) + QDQ_VARIANTS, blocks=True)
@quantize_options
@qdq_options
@_block_options_of_quantize
@_MAX_POINTS
@_LAYER
@_figure_options(6.4, None, "4.8; 8.2 for a block format, its blocks in the data's units below")
def staircase(operands, attributes, channel, quantize, qdq, semantics, formats, max_points, layer, figure):
    """Inputs vs fake-quantized outputs: the quantization staircase.

    Axes through 0, grid, the raw (dashed) and nudged (dotted) bounds and the quantization levels
    marked; the title gives num_bits and the nudged range. With --semantics mx / nvfp4 / onnx, the block
    format's element grid: each input divided by its block's scale (plus the zero point) against its output in
    the same units, every block on one grid, the grid's step function under them; below, in the data's own
    units, the block with the largest |x| and the worst block by SQNR (--channel K: block K), their element
    values times the block's scale.
    """
    if semantics != "tf":
        return _block_staircase("plot staircase", operands, attributes, semantics, formats, quantize, qdq, channel,
                                max_points, layer, figure)
    _refuse_block_options(operands, formats, None)
    def draw(operands, on_device):
        from qgcli.report import plots

        x, mn, mx, var, qdq_attrs = _load_staircase(operands, attributes, channel, quantize, qdq)
        (x,) = on_device(x)
        return plots.staircase(x, mn, mx, max_points=max_points,
                               **_view_kwargs(attributes, var, channel, figure._replace(height=figure.height or 4.8),
                                              quantize, qdq_attrs))

    _refuse_qdq_options(attributes, qdq)
    _run("plot staircase", operands, figure, draw, layer=layer,
         per_layer=("staircase", _layer_options(figure, quantize, channel=channel, max_points=max_points)))


@plot.command("ste", epilog="""\b
Examples:
  qgcli plot ste samples/notebook.h5 --num-bits 2 -o ste.png
  qgcli plot ste samples/notebook.h5 --num-bits 2 --gradients samples/notebook.h5:gradients -o ste_backprop.png
  qgcli plot ste samples/notebook.h5 --variant quantize-dequantize --dtype qint8 --mode SCALED -o qdq_ste.png
""")
@_operand_options(gradients_help="Upstream gradient: also draw backprops_wrt_input (brown), as the notebook does. "
                                 "Only taken from this option, never from the bundle.",
                  variants=PLOT_VARIANTS + (QD_VARIANT,) + QDQ_VARIANTS, blocks=True)
@quantize_options
@qdq_options
@_block_options_of_quantize
@_MAX_POINTS
@_LAYER
@_figure_options(6.4, None, "4.8; 7.6 with --gradients")
def ste(operands, attributes, channel, quantize, qdq, semantics, formats, max_points, layer, figure):
    """The staircase plus the STE gradient function (TF's mask) on a red panel below.

    With --gradients, also the back-propagated gradient backprops_wrt_input in brown. With --semantics mx /
    nvfp4 / onnx, the block format's staircase on its element grid (as plot staircase) and the op's own
    gradient function (the identity; ONNX: --estimator is not taken here).
    """
    if semantics != "tf":
        return _block_staircase("plot ste", operands, attributes, semantics, formats, quantize, qdq, channel,
                                max_points, layer, figure)
    _refuse_block_options(operands, formats, None)
    def draw(loaded, on_device):
        from qgcli.report import plots

        x, mn, mx, var, qdq_attrs = _load_staircase(loaded, attributes, channel, quantize, qdq)
        g = loaded.get("gradients") if operands.get("gradients") is not None else None
        x, g = on_device(x, g)
        return plots.ste(x, mn, mx, gradients=g, max_points=max_points,
                         **_view_kwargs(attributes, var, channel, figure, quantize, qdq_attrs))

    _refuse_qdq_options(attributes, qdq)
    _run("plot ste", operands, figure, draw, layer=layer, tallest=7.6,
         per_layer=("ste", _layer_options(figure, quantize, channel=channel, max_points=max_points)))


@plot.command("hist", epilog="""\b
Examples:
  qgcli plot hist samples/notebook.h5 --num-bits 2 -o hist.png
  qgcli plot hist samples/per_channel.h5 --channel 7 --log -o ch7.pdf
""")
@_operand_options(blocks=True)
@click.option("--bins", type=click.IntRange(1, 100_000), default=100, show_default=True, help="Histogram bins.")
@click.option("--log", "log_scale", is_flag=True, help="Logarithmic count axis.")
@_block_options
@_LAYER
@_figure_options(6.4, None, "4.8; 6.6 per block")
def hist(operands, attributes, channel, bins, log_scale, semantics, formats, dtype, layer, figure):
    """Histogram of all inputs with the quantization grid, clip regions shaded, clipped shares annotated.

    With --semantics mx / nvfp4 / onnx, per block: the inputs divided by their block's scale against the
    element grid (saturated and flushed regions shaded), and the blocks' dynamic range against the format's.
    """
    if semantics != "tf":
        from qgcli.report import block_plots

        return _block_run("plot hist", operands, attributes, semantics, formats, dtype, figure, layer,
                          lambda view, _: block_plots.hist(view, bins=bins, log=log_scale, channel=channel,
                                                        title=figure.title, width=figure.width, height=figure.height))
    _refuse_block_options(operands, formats, dtype)

    def draw(operands, on_device):
        from qgcli.report import plots

        x, mn, mx, var = _load_range(operands, attributes.variant, attributes.axis, channel)
        (x,) = on_device(x)
        return plots.hist(x, mn, mx, bins=bins, log=log_scale,
                          **_view_kwargs(attributes, var, channel, figure._replace(height=figure.height or 4.8)))

    _run("plot hist", operands.only("inputs", "min", "max"), figure, draw, layer=layer,
         per_layer=("hist", _layer_options(figure, None, channel=channel, bins=bins, log=log_scale)))


VECTOR_NAMES = ("backprop_wrt_min", "backprop_wrt_max", "scale_backprop", "offset_backprop")


@plot.command("channels", epilog="""\b
Examples:
  qgcli plot channels samples/per_channel.h5 -o channels.png
  qgcli fakequant-grad samples/per_channel.h5 -o grads.h5 && qgcli plot channels grads.h5 -o g.png
  qgcli bn-grad samples/batch_norm.h5 -o bn.h5 && qgcli plot channels bn.h5 -o bn.png
""")
@_operand_options(gradients_help="Upstream gradient for the backprop_wrt_min/max panel (default: the bundle's "
                                 "'gradients', if any).", channel=False, blocks=True)
@click.option("--scale-backprop", metavar="SPEC", help="bn-grad output 'scale_backprop' (one per channel).")
@click.option("--offset-backprop", metavar="SPEC", help="bn-grad output 'offset_backprop' (one per channel).")
@_block_options
@_LAYER
@_figure_options(8.0, None)
def channels(operands, attributes, scale_backprop, offset_backprop, semantics, formats, dtype, layer, figure):
    """Per-channel view: data range vs nudged range, share clipped low/high, backprop_wrt_min/max.

    With per-channel inputs/min/max (FakeQuantWithMinMaxVarsPerChannel), draws per channel the data
    range against the nudged range, the shares clipped below and above, and, when gradients are given
    (or in the bundle), backprop_wrt_min/max. Without inputs, draws the per-channel vectors found:
    backprop_wrt_min/max (fakequant-grad outputs), scale_backprop/offset_backprop (bn-grad outputs).
    Readable from 1 to 1024+ channels (bars up to 64, a step outline above). With --semantics mx / nvfp4 /
    onnx, per block: SQNR, the share of nonzero inputs flushed to zero, the dynamic range in bits against the
    format's, blocks whose scale saturates marked.
    """
    if semantics != "tf":
        from qgcli.report import block_plots

        for option, value in (("--scale-backprop", scale_backprop), ("--offset-backprop", offset_backprop)):
            if value is not None:
                raise click.BadParameter(f"does not apply to --semantics {semantics}", param_hint=f"'{option}'")
        return _block_run("plot channels", operands, attributes, semantics, formats, dtype, figure, layer,
                          lambda view, _: block_plots.channels(view, title=figure.title, width=figure.width,
                                                            height=figure.height))
    _refuse_block_options(operands, formats, dtype)
    specs = operands.only("inputs", "gradients", "min", "max", scale_backprop=scale_backprop,
                          offset_backprop=offset_backprop)
    a = attributes

    def draw(operands, on_device):
        from qgcli.report import plots

        if a.variant not in (None, "per-channel"):
            raise click.BadParameter("plot channels draws per-channel ops only", param_hint="'--variant'")
        if operands.has("inputs"):
            x, mn, mx, _ = _load_range(operands, "per-channel", a.axis, None)
            g = operands.get("gradients", required=False)
            x, g = on_device(x, g)
            return plots.channels(x, mn, mx, gradients=g, num_bits=a.num_bits, narrow_range=a.narrow_range,
                                  axis=-1 if a.axis is None else a.axis, title=figure.title, width=figure.width,
                                  height=figure.height)
        vectors = {name: operands.get(name) for name in VECTOR_NAMES if operands.has(name)}
        if not vectors:
            from qgcli.errors import OperandError

            raise OperandError("nothing to plot per channel: give inputs with per-channel min/max (fake quant), or "
                               "a file with backprop_wrt_min/max or scale_backprop/offset_backprop", operand="inputs")
        return plots.channel_vectors(vectors, title=figure.title, width=figure.width, height=figure.height)

    per_layer = None if scale_backprop or offset_backprop else ("channels", _layer_options(figure, None))
    _run("plot channels", specs, figure, draw, layer=layer, per_layer=per_layer)


# --- plot estimators: several gradient estimators overlaid on the staircase --------------------------------

@plot.command("estimators", epilog="""\b
Examples:
  qgcli plot estimators samples/notebook.h5 --num-bits 2 -o estimators.png
  qgcli plot estimators samples/notebook.h5 --num-bits 2 -e ste -e scaled:0.9 -e ewgs:2 -e pact -o est.svg
  qgcli plot estimators samples/per_channel.h5 --channel 3 -e ste -e lsq -e pact -o ch3.png
  qgcli plot estimators --inputs x.npy --gradients g.npy --semantics torch --scale 0.05 --zero-point 128 -o pt.png
  qgcli plot estimators samples/notebook.h5 --variant quantize-dequantize --dtype quint8 -e scaled:0.9 -o nb5.png
""")
@_operand_options(gradients_help="Upstream gradient (also read from the bundle): adds a panel with each "
                                 "estimator's backprops_wrt_input, its cosine similarity to the STE's and its range "
                                 "gradients.", variants=PLOT_VARIANTS + (QD_VARIANT,))
@quantize_options
@semantics_options
@click.option("-e", "--estimator", "estimator_names", metavar="NAME[:PARAMS]", multiple=True,
              help="An estimator to draw (repeat the option): ste, identity, scaled:G[,E], lsq, pact, ewgs:DELTA. "
                   "Default: ste, identity, scaled:0.9, pact, ewgs:1.")
@_MAX_POINTS
@_figure_options(7.2, None, "4.8; 7.6 with gradients")
def estimators(operands, attributes, channel, quantize, semantics, estimator_names, max_points, figure):
    """The staircase with several gradient estimators' gradient functions overlaid.

    Top: inputs vs outputs and, on a twin axis, each estimator's gradient function (its input gradient
    for an upstream gradient of ones). With gradients (--gradients or in the bundle): a second panel
    with each estimator's backprops_wrt_input. --semantics torch draws PyTorch's fake_quantize on
    --scale/--zero-point instead of TensorFlow's nudged min/max grid.
    """
    import numpy as np

    from qgcli.report import plots
    from qgcli.ops.estimators import parse_estimator
    from qgcli.ops.fake_quant import quant_range
    from qgcli.families.torch import torch_layout, zero_point_from_literal

    a, s = attributes, semantics
    names = [parse_estimator(e) for e in estimator_names] or list(plots.DEFAULT_ESTIMATORS)
    specs = operands.only("inputs", "gradients", "min", "max", scale=s.scale, zero_point=s.zero_point)

    def draw(loaded, on_device):
        common = dict(names=names, channel=channel, max_points=max_points, title=figure.title, width=figure.width,
                      height=figure.height, num_bits=a.num_bits, narrow_range=a.narrow_range)
        if s.semantics == "torch":
            for option, value in (("--min", operands.get("min")), ("--max", operands.get("max")),
                                  ("--variant", a.variant), *quantize.given().items()):
                if value is not None:
                    raise click.BadParameter("applies to --semantics tf only", param_hint=f"'{option}'")
            x = loaded.get("inputs")
            g = loaded.get("gradients", required=False)
            sc = np.asarray(loaded.get("scale"))
            z = np.asarray(zero_point_from_literal(s.zero_point, loaded.get("zero_point")))
            channel_axis, _ = torch_layout(sc.shape, np.shape(x), a.axis)
            if channel_axis is None:
                sc, z = sc.reshape(()), z.reshape(())
            qmin, qmax = quant_range(a.num_bits, a.narrow_range)
            x, g = on_device(x, g)
            return plots.estimators(x, gradients=g, semantics="torch", scale=sc, zero_point=z,
                                    quant_min=qmin if s.quant_min is None else s.quant_min,
                                    quant_max=qmax if s.quant_max is None else s.quant_max,
                                    axis=channel_axis if channel_axis is not None else a.axis, **common)
        for option, value in s.torch_given().items():
            if value is not None:
                raise click.BadParameter("only applies to --semantics torch", param_hint=f"'{option}'")
        x, mn, mx, var = _load_range(loaded, a.variant, a.axis, channel)
        g = loaded.get("gradients", required=False)
        x, g = on_device(x, g)
        return plots.estimators(x, mn, mx, gradients=g, semantics="tf", variant=var, axis=a.axis, **common,
                                **_quantize_kwargs(var, quantize))

    _run("plot estimators", specs, figure, draw, literal_ok=("min", "max", "scale", "zero_point"), tallest=7.6)


# --- plot layers: every quantizer of one or more run files -------------------------------------------------

@plot.command("layers", epilog="""\b
Examples:
  qgcli plot layers samples/run.h5 -o layers.png
  qgcli plot layers runs/*.h5 --top 50 -o worst50.svg
  qgcli plot layers samples/run.h5:step_000200 -o - | display
""")
@click.argument("runs", nargs=-1, required=True, metavar="RUN...")
@attribute_group(
    num_bits_option(),
    narrow_range_option(),
    opt("--axis", type=int, default=None, help="Channel axis of the per-channel groups (over the groups')."),
)
@click.option("--top", type=click.IntRange(min=1), default=None, metavar="K", help="Draw the K worst layers only.")
@_figure_options(None, None)
def layers(runs, attributes, top, figure):
    """Per layer of run files: bars of the gradient mass the mask blocks and of the SQNR, worst first.

    The numbers are qgcli report's per-layer rows (TensorFlow's STE mask, PyTorch's for PyTorch groups).
    With several steps (step_* groups, or several RUN files, each a step) also a layer x step heat map of
    each, and the bars show each layer's latest step. The figure grows with the layer count (200 layers:
    about 36 inches at 7-point labels); --width/--height override.
    """
    from qgcli.report import plots
    from qgcli.storage import runfile
    from qgcli.report.layers import DEFAULT_PERCENTILES, latest_per_layer, report_layers, trends, worst_first
    from qgcli.storage.outputs import check_figure_output, save_checked
    from qgcli.report.progress import Progress

    f = figure
    if f.as_json and f.destination == "-":
        raise click.UsageError("--json and -o - both want stdout; write the figure to a file or drop --json")
    files = [t[0] for t in map(runfile.split_target, runs) if t is not None]
    check_figure_output(f.destination, inputs=files, force=f.force, format=f.format)
    with Progress("reading layers", total=None, quiet=f.quiet) as progress:
        rows, skipped = report_layers(list(runs), options=typed_overrides(), percentiles=DEFAULT_PERCENTILES,
                                      device=f.device, on_layer=lambda name: progress.update(description=name))
    if not rows:
        from qgcli.errors import QgcliError

        raise QgcliError(f"no quantizer to plot in {', '.join(runs)}", operand="RUN")
    steps, trend = trends(rows)
    shown = worst_first(latest_per_layer(rows) if trend else rows)
    if top is not None:
        shown = shown[:top]
    for row in shown:
        row["label"] = row["layer"] if trend else row["path"]
    fig = plots.layers(shown, steps=steps, trends=trend, title=f.title, width=f.width, height=f.height)
    w, h = (float(v) for v in fig.get_size_inches())
    _check_pixels(w, h, f.dpi)
    fmt = save_checked(fig, f.destination, f.dpi, format=f.format)
    summary = json_safe({"command": "plot layers", "output": f.destination, "format": fmt,
                         "size_px": [int(round(w * f.dpi)), int(round(h * f.dpi))] if fmt == "png" else None,
                         "size_in": [w, h], "dpi": f.dpi, "run_files": list(runs), **fig.qgcli_summary,
                         "drawn": [{"path": r["path"], "gradient_blocked": r["gradient_blocked"],
                                    "clipped": r["clipped"], "sqnr_db": r["sqnr_db"]} for r in shown],
                         "skipped": skipped})
    emit(summary, as_json=f.as_json, quiet=f.quiet, render=_render_layer_bars, output=f.destination)


def _render_layer_bars(console, s):
    where = "stdout" if s["output"] == "-" else s["output"]
    size = f"{s['size_px'][0]}x{s['size_px'][1]} px" if s["size_px"] else f"{s['size_in'][0]:g}x{s['size_in'][1]:g} in"
    steps = f" over {counted(len(s['steps']), 'step')}" if s["steps"] else ""
    console.print(f"wrote {where} ({s['format']}, {size}): {counted(s['layers'], 'layer')}{steps}, worst {s['worst']}",
                  soft_wrap=True, markup=False)
    if s["skipped"]:
        console.print(f"not drawn: {counted(len(s['skipped']), 'group')} (no quantizer or not valid; --json lists them)",
                      soft_wrap=True, markup=False)
