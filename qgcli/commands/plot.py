"""``qgcli plot``: the tutorial notebook's figures (staircase, STE) from saved tensors, histograms and
per-channel views; also the ``--plot FIG`` of ``qgcli fakequant-grad``.

Only click is imported at module level: matplotlib (through :mod:`qgcli.plots`) is imported when a
figure is drawn, so ``qgcli --help`` stays fast.
"""
import os

import click

from qgcli.commands._common import Operands, emit, json_safe, report_options
from qgcli.commands.quantize_dequantize import quantize_options

# Variants the plots can draw; qgcli.plots.run_variant maps each to its ops.
PLOT_VARIANTS = ("args", "vars", "per-channel")
# staircase, ste and estimators also draw TF's QuantizeV2 + Dequantize round trip (the notebook's own fake quant).
QD_VARIANT = "quantize-dequantize"
FIGURE_SUFFIXES = (".png", ".svg", ".pdf")
MAX_PIXELS = 20000  # per side: a typo in --dpi should not allocate gigabytes
_TALLEST = 8.2  # default height of the tallest figure (three per-channel panels)


def check_figure_output(dest, *, inputs=(), force=False, option="--output"):
    """Refuse a figure path that has no .png/.svg/.pdf suffix, is an input, exists without ``force``,
    is a directory or lies in a missing or read-only directory (the rules of ``qgcli.io.check_output``)."""
    from qgcli.errors import OutputError

    if dest == "-" or not dest:
        raise OutputError("a figure needs a file name ending in .png, .svg or .pdf", operand=option)
    if not dest.lower().endswith(FIGURE_SUFFIXES):
        ext = os.path.splitext(dest)[1] or "no extension"
        raise OutputError(f"cannot tell the figure format from {ext!r} in {dest}; use .png, .svg or .pdf",
                          operand=option)
    for source in inputs:
        if source and os.path.exists(source) and os.path.exists(dest) and _same_file(source, dest):
            raise OutputError(f"{dest} is also an input; qgcli never overwrites its inputs", operand=option)
    if os.path.isdir(dest):
        raise OutputError(f"{dest} is a directory", operand=option)
    parent = os.path.dirname(os.path.abspath(dest))
    if not os.path.isdir(parent):
        raise OutputError(f"directory {parent} does not exist", operand=option)
    if os.path.exists(dest) and not force:
        raise OutputError(f"{dest} exists; use --force to replace it", operand=option)
    if not os.access(parent, os.W_OK):
        raise OutputError(f"directory {parent} is not writable", operand=option)


def _same_file(a, b):
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def save_checked(fig, dest, dpi):
    """Save ``fig`` (checked path) atomically; a failing disk is a runtime error (exit 1)."""
    from qgcli.plots import save_figure

    try:
        return save_figure(fig, dest, dpi=dpi)
    except OSError as exc:
        raise click.ClickException(f"cannot write {dest}: {exc.strerror or exc}") from None


def write_ste_plot_for(plot, *, inputs, gradients, mn, mx, variant, num_bits, narrow_range, axis, force, operands,
                       dpi=100):
    """The STE figure of one ``fakequant-grad`` run (staircase, mask, backprops) to ``plot``.

    ``inputs``/``gradients`` are NumPy or CuPy arrays, ``mn``/``mx`` the raw min/max arrays; per-channel
    data is drawn flattened (``qgcli plot ste --channel K`` draws one channel).
    """
    check_figure_output(plot, inputs=operands.input_paths(), force=force, option="--plot")
    from qgcli import plots

    fig = plots.ste(inputs, mn, mx, gradients=gradients, variant=variant, num_bits=num_bits,
                    narrow_range=narrow_range, axis=-1 if axis is None else axis)
    return save_checked(fig, plot, dpi)


# --- options ------------------------------------------------------------------------------------------

def _operand_options(*, gradients_help=None, channel=True, range_=True, variants=PLOT_VARIANTS):
    def decorate(f):
        if channel:
            f = click.option("--channel", type=int, default=None, metavar="K",
                             help="Draw channel K of the channel axis (--axis, default the last) only; "
                                  "otherwise all elements, flattened.")(f)
        if range_:
            f = click.option("--axis", type=int, default=None,
                             help="Channel axis (TF: the last axis, -1) for per-channel min/max and --channel.")(f)
            f = click.option("--variant", type=click.Choice(variants), default=None,
                             help="TF op family; default: per-channel when min/max are vectors, else vars." + (
                                 f" {QD_VARIANT}: the notebook's tf.quantize + tf.dequantize (--dtype, --mode...)."
                                 if QD_VARIANT in variants else ""))(f)
            f = click.option("--narrow-range", is_flag=True, help="Use the grid [1, 2^num_bits - 1].")(f)
            f = click.option("--num-bits", type=int, default=8, show_default=True, help="Bit width, 2..16.")(f)
            f = click.option("--max", "max_", metavar="SPEC", help="Range maximum: scalar or one per channel.")(f)
            f = click.option("--min", "min_", metavar="SPEC", help="Range minimum: scalar or one per channel.")(f)
        if gradients_help:
            f = click.option("--gradients", metavar="SPEC", help=gradients_help)(f)
        f = click.option("--inputs", metavar="SPEC", help="Forward inputs (TF operand 'inputs').")(f)
        return click.argument("bundle", required=False, metavar="[BUNDLE]")(f)

    return decorate


def _figure_options(width, height):
    def decorate(f):
        f = click.option("--height", type=click.FloatRange(1, 50), default=height, show_default=height is not None,
                         help="Figure height in inches." + ("" if height is not None else
                                                            "  [default: 1 + 2.4 per panel]"))(f)
        f = click.option("--width", type=click.FloatRange(1, 50), default=width, show_default=True,
                         help="Figure width in inches.")(f)
        f = click.option("--title", default=None, help="Replace the title (the default names the op and grid).")(f)
        f = click.option("--dpi", type=click.IntRange(10, 1200), default=100, show_default=True,
                         help="Pixels per inch (PNG size = width x height x dpi).")(f)
        f = click.option("--force", is_flag=True, help="Replace an existing figure file.")(f)
        return click.option("-o", "--output", "output", metavar="FIG", required=True,
                            help="Figure file; the format follows the extension: .png, .svg or .pdf.")(f)

    return decorate


# --- running a plot -----------------------------------------------------------------------------------

def _check_pixels(width, height, dpi):
    if max(width, height) * dpi > MAX_PIXELS:
        raise click.BadParameter(f"{width:g} x {height:g} in at {dpi} dpi exceeds {MAX_PIXELS} pixels per side",
                                 param_hint="'--dpi'")


def _load_range(operands, variant, axis, channel):
    """(inputs, min, max, variant) by fakequant's rules; --axis only where a channel axis is meant."""
    from qgcli.commands.fakequant import load_fake_quant_operands

    _, inputs, mn, mx, variant = load_fake_quant_operands(operands, variant, with_gradients=False)
    if axis is not None and variant not in ("per-channel", QD_VARIANT) and channel is None:
        raise click.BadParameter("only applies to per-channel min/max or with --channel", param_hint="'--axis'")
    return inputs, mn, mx, variant


def _run(command, bundle, specs, *, output, force, dpi, width, height, as_json, quiet, device, draw):
    """Shared flow: resolve operands, check the figure path, draw on the device's arrays, save, report."""
    from qgcli.commands._common import to_device

    _check_pixels(width, height or _TALLEST, dpi)
    operands = Operands(bundle, specs, literal_ok=("min", "max"))
    try:
        check_figure_output(output, inputs=operands.input_paths(), force=force)
        fig = draw(operands, lambda *arrays: to_device(arrays, device)[1])
        fmt = save_checked(fig, output, dpi)
    finally:
        operands.close()
    w, h = (float(v) for v in fig.get_size_inches())
    size = [int(round(w * dpi)), int(round(h * dpi))]
    summary = json_safe({"command": command, "output": output, "format": fmt, "size_px": size if fmt == "png" else None,
                         "size_in": [w, h], "dpi": dpi, **fig.qgcli_summary})
    emit(summary, as_json=as_json, quiet=quiet, render=_render, output=output)


def _render(console, s):
    what = s.get("op") or ", ".join(s.get("vectors", []))
    size = f"{s['size_px'][0]}x{s['size_px'][1]} px" if s["size_px"] else f"{s['size_in'][0]:g}x{s['size_in'][1]:g} in"
    detail = (f"{s['channels']} channels" if s["plot"] == "channels"
              else f"{s['points']:,} of {s['elements']:,} points" if s["plot"] != "hist"
              else f"{s['points']:,} values in {s['bins']} bins")
    console.print(f"wrote {s['output']} ({s['format']}, {size}): {s['plot']} of {what}, {detail}", soft_wrap=True)


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


_MAX_POINTS = click.option("--max-points", type=click.IntRange(10, 10_000_000), default=4000, show_default=True,
                           help="Largest number of points a line plot draws (a deterministic subsample of the "
                                "sorted inputs, keeping every step edge; the figure says how many).")


def _view_kwargs(num_bits, narrow_range, variant, axis, channel, title, width, height, quantize=None):
    return dict(num_bits=num_bits, narrow_range=narrow_range, variant=variant, axis=-1 if axis is None else axis,
                channel=channel, title=title, width=width, height=height, **_quantize_kwargs(variant, quantize))


def _quantize_kwargs(variant, given):
    """``{"quantize": attrs}`` for the round trip; the QuantizeV2 options are refused for other variants."""
    from qgcli.commands.quantize_dequantize import refuse_quantize_options

    given = {k: v for k, v in (given or {}).items()}
    if variant != QD_VARIANT:
        refuse_quantize_options(**given)
        return {}
    defaults = {"dtype": "quint8", "mode": "MIN_COMBINED", "round_mode": "HALF_AWAY_FROM_ZERO",
                "ensure_minimum_range": 0.01}
    return {"quantize": {k: defaults[k] if given.get(k) is None else given[k] for k in defaults}}


@plot.command("staircase", epilog="""\b
Example:
  qgcli plot staircase samples/notebook.h5 --num-bits 2 -o staircase.png
  qgcli plot staircase samples/per_channel.h5 --channel 3 -o ch3.svg
  qgcli plot staircase samples/notebook.h5 --variant quantize-dequantize --dtype quint8 -o roundtrip.png
""")
@_operand_options(variants=PLOT_VARIANTS + (QD_VARIANT,))
@quantize_options
@_MAX_POINTS
@_figure_options(6.4, 4.8)
@report_options
def staircase(bundle, inputs, min_, max_, num_bits, narrow_range, variant, axis, channel, max_points, output, force,
              dpi, title, width, height, as_json, quiet, device, dtype, mode, round_mode, ensure_minimum_range):
    """Inputs vs fake-quantized outputs: the quantization staircase.

    Axes through 0, grid, the raw (dashed) and nudged (dotted) bounds and the quantization levels
    marked; the title gives num_bits and the nudged range.
    """
    def draw(operands, on_device):
        from qgcli import plots

        x, mn, mx, var = _load_range(operands, variant, axis, channel)
        (x,) = on_device(x)
        return plots.staircase(x, mn, mx, max_points=max_points,
                               **_view_kwargs(num_bits, narrow_range, var, axis, channel, title, width, height,
                                              qd_options))

    qd_options = dict(dtype=dtype, mode=mode, round_mode=round_mode, ensure_minimum_range=ensure_minimum_range)

    _run("plot staircase", bundle, {"inputs": inputs, "min": min_, "max": max_}, output=output, force=force, dpi=dpi,
         width=width, height=height, as_json=as_json, quiet=quiet, device=device, draw=draw)


@plot.command("ste", epilog="""\b
Examples:
  qgcli plot ste samples/notebook.h5 --num-bits 2 -o ste.png
  qgcli plot ste samples/notebook.h5 --num-bits 2 --gradients samples/notebook.h5:gradients -o ste_backprop.png
  qgcli plot ste samples/notebook.h5 --variant quantize-dequantize --dtype qint8 --mode SCALED -o qdq_ste.png
""")
@_operand_options(gradients_help="Upstream gradient: also draw backprops_wrt_input (brown), as the notebook does. "
                                 "Only taken from this option, never from the bundle.",
                  variants=PLOT_VARIANTS + (QD_VARIANT,))
@quantize_options
@_MAX_POINTS
@_figure_options(6.4, 4.8)
@report_options
def ste(bundle, inputs, gradients, min_, max_, num_bits, narrow_range, variant, axis, channel, max_points, output,
        force, dpi, title, width, height, as_json, quiet, device, dtype, mode, round_mode, ensure_minimum_range):
    """The staircase plus the STE gradient function (TF's mask) on a red twin axis.

    With --gradients, also the back-propagated gradient backprops_wrt_input in brown.
    """
    def draw(operands, on_device):
        from qgcli import plots

        x, mn, mx, var = _load_range(operands, variant, axis, channel)
        g = operands.get("gradients") if gradients is not None else None
        x, g = on_device(x, g)
        return plots.ste(x, mn, mx, gradients=g, max_points=max_points,
                         **_view_kwargs(num_bits, narrow_range, var, axis, channel, title, width, height,
                                        qd_options))

    qd_options = dict(dtype=dtype, mode=mode, round_mode=round_mode, ensure_minimum_range=ensure_minimum_range)

    _run("plot ste", bundle, {"inputs": inputs, "gradients": gradients, "min": min_, "max": max_}, output=output,
         force=force, dpi=dpi, width=width, height=height, as_json=as_json, quiet=quiet, device=device, draw=draw)


@plot.command("hist", epilog="""\b
Examples:
  qgcli plot hist samples/notebook.h5 --num-bits 2 -o hist.png
  qgcli plot hist samples/per_channel.h5 --channel 7 --log -o ch7.pdf
""")
@_operand_options()
@click.option("--bins", type=click.IntRange(1, 100_000), default=100, show_default=True, help="Histogram bins.")
@click.option("--log", "log_scale", is_flag=True, help="Logarithmic count axis.")
@_figure_options(6.4, 4.8)
@report_options
def hist(bundle, inputs, min_, max_, num_bits, narrow_range, variant, axis, channel, bins, log_scale, output, force,
         dpi, title, width, height, as_json, quiet, device):
    """Histogram of all inputs with the quantization grid, clip regions shaded, clipped shares annotated."""
    def draw(operands, on_device):
        from qgcli import plots

        x, mn, mx, var = _load_range(operands, variant, axis, channel)
        (x,) = on_device(x)
        return plots.hist(x, mn, mx, bins=bins, log=log_scale,
                          **_view_kwargs(num_bits, narrow_range, var, axis, channel, title, width, height))

    _run("plot hist", bundle, {"inputs": inputs, "min": min_, "max": max_}, output=output, force=force, dpi=dpi,
         width=width, height=height, as_json=as_json, quiet=quiet, device=device, draw=draw)


VECTOR_NAMES = ("backprop_wrt_min", "backprop_wrt_max", "scale_backprop", "offset_backprop")


@plot.command("channels", epilog="""\b
Examples:
  qgcli plot channels samples/per_channel.h5 -o channels.png
  qgcli fakequant-grad samples/per_channel.h5 -o grads.h5 && qgcli plot channels grads.h5 -o g.png
  qgcli bn-grad samples/batch_norm.h5 -o bn.h5 && qgcli plot channels bn.h5 -o bn.png
""")
@_operand_options(gradients_help="Upstream gradient for the backprop_wrt_min/max panel (default: the bundle's "
                                 "'gradients', if any).", channel=False)
@click.option("--scale-backprop", metavar="SPEC", help="bn-grad output 'scale_backprop' (one per channel).")
@click.option("--offset-backprop", metavar="SPEC", help="bn-grad output 'offset_backprop' (one per channel).")
@_figure_options(8.0, None)
@report_options
def channels(bundle, inputs, gradients, min_, max_, num_bits, narrow_range, variant, axis, scale_backprop,
             offset_backprop, output, force, dpi, title, width, height, as_json, quiet, device):
    """Per-channel view: data range vs nudged range, share clipped low/high, backprop_wrt_min/max.

    With per-channel inputs/min/max (FakeQuantWithMinMaxVarsPerChannel), draws per channel the data
    range against the nudged range, the shares clipped below and above, and, when gradients are given
    (or in the bundle), backprop_wrt_min/max. Without inputs, draws the per-channel vectors found:
    backprop_wrt_min/max (fakequant-grad outputs), scale_backprop/offset_backprop (bn-grad outputs).
    Readable from 1 to 1024+ channels (bars up to 64, a step outline above).
    """
    specs = {"inputs": inputs, "gradients": gradients, "min": min_, "max": max_,
             "scale_backprop": scale_backprop, "offset_backprop": offset_backprop}

    def draw(operands, on_device):
        from qgcli import plots

        if variant not in (None, "per-channel"):
            raise click.BadParameter("plot channels draws per-channel ops only", param_hint="'--variant'")
        if operands.has("inputs"):
            x, mn, mx, _ = _load_range(operands, "per-channel", axis, None)
            g = operands.get("gradients", required=False)
            x, g = on_device(x, g)
            return plots.channels(x, mn, mx, gradients=g, num_bits=num_bits, narrow_range=narrow_range,
                                  axis=-1 if axis is None else axis, title=title, width=width, height=height)
        vectors = {name: operands.get(name) for name in VECTOR_NAMES if operands.has(name)}
        if not vectors:
            from qgcli.errors import OperandError

            raise OperandError("nothing to plot per channel: give inputs with per-channel min/max (fake quant), or "
                               "a file with backprop_wrt_min/max or scale_backprop/offset_backprop", operand="inputs")
        return plots.channel_vectors(vectors, title=title, width=width, height=height)

    _run("plot channels", bundle, specs, output=output, force=force, dpi=dpi, width=width, height=height,
         as_json=as_json, quiet=quiet, device=device, draw=draw)


# --- plot estimators: several gradient estimators overlaid on the staircase --------------------------------

from qgcli.commands.nudge import semantics_options  # noqa: E402  (click only, like this module)


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
@_figure_options(7.2, None)
@report_options
def estimators(bundle, inputs, gradients, min_, max_, num_bits, narrow_range, variant, axis, channel, semantics, scale,
               zero_point, quant_min, quant_max, estimator_names, max_points, output, force, dpi, title, width, height,
               as_json, quiet, device, dtype, mode, round_mode, ensure_minimum_range):
    """The staircase with several gradient estimators' gradient functions overlaid.

    Top: inputs vs outputs and, on a twin axis, each estimator's gradient function (its input gradient
    for an upstream gradient of ones). With gradients (--gradients or in the bundle): a second panel
    with each estimator's backprops_wrt_input. --semantics torch draws PyTorch's fake_quantize on
    --scale/--zero-point instead of TensorFlow's nudged min/max grid.
    """
    import numpy as np

    from qgcli import plots
    from qgcli.commands._common import to_device
    from qgcli.commands.nudge import _zero_point_from_literal, torch_layout
    from qgcli.ops.estimators import parse_estimator
    from qgcli.ops.fake_quant import quant_range

    names = [parse_estimator(e) for e in estimator_names] or list(plots.DEFAULT_ESTIMATORS)
    _check_pixels(width, height or 7.6, dpi)
    specs = {"inputs": inputs, "gradients": gradients, "min": min_, "max": max_, "scale": scale,
             "zero_point": zero_point}
    operands = Operands(bundle, specs, literal_ok=("min", "max", "scale", "zero_point"))
    try:
        check_figure_output(output, inputs=operands.input_paths(), force=force)
        common = dict(names=names, channel=channel, max_points=max_points, title=title, width=width, height=height,
                      num_bits=num_bits, narrow_range=narrow_range)
        if semantics == "torch":
            for option, value in (("--min", min_), ("--max", max_), ("--variant", variant), ("--dtype", dtype),
                                  ("--mode", mode), ("--round-mode", round_mode),
                                  ("--ensure-minimum-range", ensure_minimum_range)):
                if value is not None:
                    raise click.BadParameter("applies to --semantics tf only", param_hint=f"'{option}'")
            x = operands.get("inputs")
            g = operands.get("gradients", required=False)
            s = np.asarray(operands.get("scale"))
            z = np.asarray(_zero_point_from_literal(zero_point, operands.get("zero_point")))
            channel_axis, _ = torch_layout(s.shape, np.shape(x), axis)
            if channel_axis is None:
                s, z = s.reshape(()), z.reshape(())
            qmin, qmax = quant_range(num_bits, narrow_range)
            x, g = to_device([x, g], device)[1]
            fig = plots.estimators(x, gradients=g, semantics="torch", scale=s, zero_point=z,
                                   quant_min=qmin if quant_min is None else quant_min,
                                   quant_max=qmax if quant_max is None else quant_max,
                                   axis=channel_axis if channel_axis is not None else axis, **common)
        else:
            for option, value in (("--scale", scale), ("--zero-point", zero_point), ("--quant-min", quant_min),
                                  ("--quant-max", quant_max)):
                if value is not None:
                    raise click.BadParameter("only applies to --semantics torch", param_hint=f"'{option}'")
            x, mn, mx, var = _load_range(operands, variant, axis, channel)
            g = operands.get("gradients", required=False)
            x, g = to_device([x, g], device)[1]
            fig = plots.estimators(x, mn, mx, gradients=g, semantics="tf", variant=var, axis=axis, **common,
                                   **_quantize_kwargs(var, dict(dtype=dtype, mode=mode, round_mode=round_mode,
                                                                ensure_minimum_range=ensure_minimum_range)))
        fmt = save_checked(fig, output, dpi)
    finally:
        operands.close()
    w, h = (float(v) for v in fig.get_size_inches())
    size = [int(round(w * dpi)), int(round(h * dpi))]
    summary = json_safe({"command": "plot estimators", "output": output, "format": fmt,
                         "size_px": size if fmt == "png" else None, "size_in": [w, h], "dpi": dpi,
                         **fig.qgcli_summary})
    emit(summary, as_json=as_json, quiet=quiet, render=_render, output=output)
