"""``qgcli fakequant`` and ``qgcli fakequant-grad``: fake quant on saved tensors, in four families.

TensorFlow's fake-quant ops (the default), TensorFlow's grid with another gradient estimator
(``--estimator``), PyTorch's op (``--semantics torch``) and TensorFlow's QuantizeV2 + Dequantize round trip
(``--variant quantize-dequantize``).  The options are parsed once into a :class:`qgcli.FakeQuantJob`,
checked for the family they choose, executed by :func:`qgcli.execution.dispatch.execute` and the summary rendered
here.  Only click is imported at module level.
"""
import click

from qgcli.report.tables import print_items
from qgcli.cli.options import (
    QD_VARIANT,
    QDQ_VARIANTS,
    bundle_argument,
    estimator_options,
    fake_quant_attribute_options,
    operand_group,
    output_options,
    qdq_options,
    quantize_options,
    refuse_quantize_options,
    run_file_job,
    semantics_options,
    skip_invalid_option,
    spec_option,
    torchao_options,
)
from qgcli.report.summaries import emit, percent, render_closing_lines

_RANGE_HELP = "scalar (vars/args) or one per channel."
_QDQ_SPECS = (
    spec_option("input", "QuantizeAndDequantize's 'input' (--variant quantize-and-dequantize-v*; --inputs too)."),
    spec_option("input_min", "QuantizeAndDequantize's 'input_min': a scalar, or one per slice with --axis."),
    spec_option("input_max", "QuantizeAndDequantize's 'input_max': like input_min."),
)


def build_job(command, *, with_gradients, operands, attributes, quantize, semantics, estimator, output, qdq=None,
              torchao=None):
    """The job the options describe: its family chosen, every option checked against that family."""
    from qgcli.jobs import ESTIMATOR, TF, TORCH, FakeQuantJob, OperandSpecs, TorchaoOptions
    from qgcli.families import torchao as torchao_runner

    torchao = torchao or TorchaoOptions()
    if semantics.semantics == "torchao":
        _refuse_qdq_options(operands, qdq)
        return torchao_runner.build_job(command, with_gradients=with_gradients, operands=operands,
                                        attributes=attributes, quantize=quantize, semantics=semantics,
                                        estimator=estimator, output=output, torchao=torchao)
    torchao_runner.refuse_outside(torchao, quantize.dtype)
    if attributes.variant in QDQ_VARIANTS:
        from qgcli.families.qdq import build_job as qdq_job

        return qdq_job(command, with_gradients, operands, attributes, quantize, semantics, estimator, output, qdq)
    _refuse_qdq_options(operands, qdq)
    if attributes.variant == QD_VARIANT:
        return _quantize_dequantize_job(command, with_gradients, operands, attributes, quantize, semantics,
                                        estimator, output)
    refuse_quantize_options(quantize)
    est = None
    if estimator.estimator is not None:  # the estimators' module (6 ms) only where one is named
        from qgcli.ops.estimators import parse_estimator

        est = parse_estimator(estimator.estimator)
    common = dict(command=command, with_gradients=with_gradients, operands=operands, output=output,
                  num_bits=attributes.num_bits, narrow_range=attributes.narrow_range, variant=attributes.variant,
                  axis=attributes.axis, estimator=est, grad_factor=estimator.grad_factor)
    if semantics.semantics == "tf":
        for option, value in semantics.torch_given().items():
            if value is not None:
                raise click.BadParameter("only applies to --semantics torch", param_hint=f"'{option}'")
        _check_grad_factor(estimator, est)
        if est is None or est.name == "ste":
            return FakeQuantJob(family=TF, **common)
        if output.plot:
            raise click.BadParameter(f"draws TensorFlow's STE only; for --estimator {est.text} use "
                                     "'qgcli plot estimators'", param_hint="'--plot'")
        return FakeQuantJob(family=ESTIMATOR, **common)
    _check_grad_factor(estimator, est)
    for name in ("min", "max"):
        if operands.get(name) is not None:
            raise click.BadParameter("is TensorFlow's operand; with --semantics torch give --scale and --zero-point "
                                     "(qgcli nudge -o writes TensorFlow's grid as scale/zero_point)",
                                     param_hint=f"'--{name}'")
    if attributes.variant is not None:
        raise click.BadParameter("chooses a TensorFlow op; PyTorch's op follows the shape of scale",
                                 param_hint="'--variant'")
    if output.plot:
        raise click.BadParameter("draws TensorFlow's STE only; use 'qgcli plot estimators --semantics torch'",
                                 param_hint="'--plot'")
    from qgcli.ops import fake_quant, torch_semantics

    default_min, default_max = fake_quant.quant_range(attributes.num_bits, attributes.narrow_range)
    quant_min, quant_max = torch_semantics.check_quant_range(
        default_min if semantics.quant_min is None else semantics.quant_min,
        default_max if semantics.quant_max is None else semantics.quant_max)
    specs = dict(inputs=operands.get("inputs"), scale=semantics.scale, zero_point=semantics.zero_point)
    if with_gradients:
        specs["gradients"] = operands.get("gradients")
    common["operands"] = OperandSpecs.of(operands.bundle, **specs)
    return FakeQuantJob(family=TORCH, quant_min=quant_min, quant_max=quant_max, **common)


def _quantize_dequantize_job(command, with_gradients, operands, attributes, quantize, semantics, estimator, output):
    from qgcli.jobs import QUANTIZE_DEQUANTIZE, FakeQuantJob

    refused = {"--semantics": semantics.semantics, **semantics.torch_given()}
    for option, value in refused.items():
        if value not in (None, False, "tf"):
            raise click.BadParameter(f"does not apply to --variant {QD_VARIANT} (TensorFlow's QuantizeV2 + "
                                     "Dequantize)", param_hint=f"'{option}'")
    if attributes.num_bits_given:
        raise click.BadParameter(f"the bit width of --variant {QD_VARIANT} comes from --dtype",
                                 param_hint="'--num-bits'")
    est = None
    if with_gradients:
        from qgcli.ops.estimators import parse_estimator

        est = parse_estimator(estimator.estimator) if estimator.estimator is not None else None
        _check_grad_factor(estimator, est)
        if output.plot and est is not None and est.name != "ste":
            raise click.BadParameter(f"draws the STE only; for --estimator {est.text} use 'qgcli plot estimators "
                                     f"--variant {QD_VARIANT}'", param_hint="'--plot'")
    return FakeQuantJob(command=command, family=QUANTIZE_DEQUANTIZE, with_gradients=with_gradients,
                             operands=operands, output=output, narrow_range=attributes.narrow_range,
                             variant=QD_VARIANT, axis=attributes.axis, quantize=quantize.resolved(), estimator=est,
                             grad_factor=estimator.grad_factor)


def _refuse_qdq_options(operands, qdq):
    """Other variants: QuantizeAndDequantize's operand names and attributes do not apply."""
    for name in ("input", "input_min", "input_max"):
        if operands.get(name) is not None:
            raise click.BadParameter("is QuantizeAndDequantize's operand; give --variant quantize-and-dequantize-v4 "
                                     "(or -v3/-v2), or use --inputs/--min/--max", param_hint=f"'--{name.replace('_', '-')}'")
    for option, value in (("--signed-input", getattr(qdq, "signed_input", None)),
                          ("--range-given", getattr(qdq, "range_given", None))):
        if value is not None:
            raise click.BadParameter("only applies to --variant quantize-and-dequantize-v4/-v3/-v2",
                                     param_hint=f"'{option}'")


def _no_estimator():
    from qgcli.jobs import EstimatorOptions

    return EstimatorOptions()


def _check_grad_factor(estimator, est):
    if estimator.grad_factor is not None and (est is None or est.name != "lsq"):
        raise click.BadParameter("only applies to --estimator lsq", param_hint="'--grad-factor'")


def run(job):
    """Execute the job and print its summary."""
    from qgcli.execution.dispatch import execute

    summary = execute(job)
    emit(summary, as_json=job.output.as_json, quiet=job.output.quiet, render=_renderer(job.family),
         output=job.output.destination)


def _run_file(job):
    """A run file: every fake-quant group through :func:`qgcli.execution.dispatch.execute`, one summary for all."""
    from qgcli.execution.dispatch import execute
    from qgcli.execution.runfile import render_run

    emit(execute(job), as_json=job.output.as_json, quiet=job.output.quiet, render=render_run,
         output=job.output.destination)


# --- rendering the summaries ------------------------------------------------------------------------------

def render_summary(console, s):
    from rich.markup import escape

    from qgcli.report.tables import Col, print_table

    stats, grid = s["statistics"], s["grid"]
    shapes = ", ".join(f"{k} {tuple(v['shape'])} {v['dtype']}" for k, v in s["inputs"].items())
    print_items(console, f"[bold]{s['op']}[/] num_bits={grid['num_bits']} narrow_range={grid['narrow_range']}  {escape(shapes)}")
    keys = ("min", "max", "nudged_min", "nudged_max", "scale", "zero_point")
    cols = (Col("", "left", priority=0), Col("min", priority=2), Col("max", priority=2), Col("nudged_min", priority=0),
            Col("nudged_max", priority=0), Col("scale", priority=1), Col("zero_point", priority=1))
    if isinstance(grid["min"], list):
        worst = _worst_channels(stats, len(grid["min"]))
        channels = range(len(grid["min"])) if worst is None else worst[1]
        rows = [[f"ch {c}", *(_fmt(grid[k][c]) for k in keys)] for c in channels[:8]]
        if worst is not None:
            name, _, share = worst
            cols = (Col("worst first", "left", priority=0), *cols[1:], Col(name, priority=0))
            rows = [row + [percent(share[c])] for row, c in zip(rows, channels)]
        if len(grid["min"]) > 8:
            rows.append([f"... {len(grid['min']) - 8} more"] + [""] * (len(cols) - 1))
    else:
        rows = [["range", *(_fmt(grid[k]) for k in keys)]]
    print_table(console, cols, rows, hint="--json for every value")
    if stats is not None:
        line = f"clipped below {percent(stats['clipped_below'])}, above {percent(stats['clipped_above'])}"
        if "gradient_blocked" in stats:
            line += f"; gradient mass blocked by the STE mask {percent(stats['gradient_blocked'])}"
        print_items(console, line)
    render_closing_lines(console, s)


def _worst_channels(stats, depth):
    """``(column name, channels worst first, share per channel)``: by the share of gradient mass the STE mask
    blocks, or without gradients by the share clipped; None without per-channel statistics.  Ties keep the
    channel order."""
    if stats is None:
        return None
    if stats.get("channel_gradient_blocked") is not None:
        name, share = "blocked", stats["channel_gradient_blocked"]
    elif stats.get("channel_clipped_below") is not None and stats.get("channel_clipped_above") is not None:
        name = "clipped"
        share = [b + a for b, a in zip(stats["channel_clipped_below"], stats["channel_clipped_above"])]
    else:
        return None
    if len(share) != depth:
        return None
    return name, sorted(range(depth), key=lambda c: -(share[c] if share[c] is not None else -1.0)), share


def _fmt(v):
    if v is None:
        return "nan"
    return f"{v:.7g}" if isinstance(v, float) else str(v)


def _render_estimator(console, s):
    render_summary(console, s)
    est_ = s["estimator"]
    extra = f", grad_factor {est_['grad_factor']:.7g}" if "grad_factor" in est_ else ""
    print_items(console, f"estimator {est_['estimator']}{extra} (TensorFlow's grid; outputs "
                  f"{', '.join(s['outputs'])}); it blocks {percent(s['statistics']['estimator_blocked'])} "
                  "of the gradient mass")


def _render_torch(console, s):
    grid = s["grid"]
    scale, zp = grid["scale"], grid["zero_point"]
    if isinstance(scale, list):
        shown = ", ".join(f"{a:.6g}/{b:g}" for a, b in list(zip(scale, zp))[:6])
        more = f" ... ({len(scale)} channels, axis {grid['axis']})" if len(scale) > 6 else f" (axis {grid['axis']})"
        params = f"scale/zero_point {shown}{more}"
    else:
        params = f"scale {scale:.7g}, zero_point {zp:g}"
    print_items(console, f"[bold]{s['op']}[/] quant_min={grid['quant_min']} quant_max={grid['quant_max']}  {params}",
                  soft_wrap=True)
    stats = s["statistics"]
    line = f"clipped below {percent(stats['clipped_below'])}, above {percent(stats['clipped_above'])} (rounded integer)"
    if "gradient_blocked" in stats:
        line += (f"; gradient mass blocked by the mask {percent(stats['gradient_blocked'])}, by the estimator "
                 f"{percent(stats['estimator_blocked'])}")
    print_items(console, line)
    est = s.get("estimator")
    if est:
        extra = f", grad_factor {est['grad_factor']:.7g}" if "grad_factor" in est else ""
        print_items(console, f"estimator {est['estimator']}{extra}")
    render_closing_lines(console, s)


def _render_quantize_dequantize(console, s):
    from rich.markup import escape

    from qgcli.report.tables import Col, print_table

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


def _renderer(family):
    from qgcli.jobs import ESTIMATOR, QUANTIZE_AND_DEQUANTIZE, QUANTIZE_DEQUANTIZE, TF, TORCH, TORCHAO

    if family == QUANTIZE_AND_DEQUANTIZE:
        from qgcli.families.qdq import render

        return render
    if family == TORCHAO:
        from qgcli.families.torchao import render

        return render
    return {TF: render_summary, ESTIMATOR: _render_estimator, TORCH: _render_torch,
            QUANTIZE_DEQUANTIZE: _render_quantize_dequantize}[family]


# --- the commands -----------------------------------------------------------------------------------------

_FQ_EPILOG = """\b
Examples:
  qgcli fakequant samples/notebook.h5 --num-bits 2 -o out.h5
  qgcli fakequant --inputs x.npy --min -6 --max 6 -o out.npz
  qgcli fakequant act.h5 --inputs act.h5:layer1/x --min -1,-2,-3 --max 1,2,3 -o out/
  qgcli fakequant samples/notebook.h5 --variant quantize-dequantize --dtype quint8 -o qdq.h5
"""

_FQG_EPILOG = """\b
Examples:
  qgcli fakequant-grad samples/per_channel.h5 -o grads.h5
  qgcli fakequant-grad samples/notebook.h5 --num-bits 2 -o - | qgcli inspect -
  qgcli fakequant-grad --gradients g.npy --inputs x.npy --min -6 --max 6 -o grads.npz --json
  qgcli fakequant-grad samples/notebook.h5 --variant quantize-dequantize --estimator scaled:0.9 -o g.h5
"""


@click.command("fakequant", epilog=_FQ_EPILOG, short_help="TF fake-quant forward (Args/Vars/PerChannel), bit-exact.")
@operand_group(
    bundle_argument(),
    spec_option("inputs", "Tensor to fake-quantize (TF operand 'inputs')."),
    spec_option("min", "Range minimum: " + _RANGE_HELP),
    spec_option("max", "Range maximum: " + _RANGE_HELP),
    *_QDQ_SPECS,
)
@fake_quant_attribute_options
@quantize_options
@qdq_options
@semantics_options
@torchao_options
@output_options()
@skip_invalid_option
def fakequant(operands, attributes, quantize, qdq, semantics, torchao, output, skip_invalid):
    """Run FakeQuantWithMinMax{Args,Vars,VarsPerChannel} as TensorFlow 2.21 does, bit for bit.

    Operands come from BUNDLE (an .h5/.npz whose datasets are named inputs, min, max) or from the
    options, which override the bundle. Writes the output 'outputs'. With --semantics torch: PyTorch's
    fake_quantize_per_{tensor,channel}_affine on the operands inputs, scale, zero_point. With
    --variant quantize-dequantize: the notebook's tf.quantize + tf.dequantize (QuantizeV2 + Dequantize, --dtype,
    --mode, --round-mode), writing outputs, quantized, output_min, output_max.
    BUNDLE may be a run file (groups with an 'op' attribute, see docs/whole-models.md, or
    run.h5:GROUP): every fake-quant group runs, outputs at the same group paths.
    """
    job = run_file_job("fakequant", operands, output, skip_invalid=skip_invalid)
    if job is not None:
        return _run_file(job)
    run(build_job("fakequant", with_gradients=False, operands=operands, attributes=attributes, quantize=quantize,
                  semantics=semantics, estimator=_no_estimator(), output=output, qdq=qdq, torchao=torchao))


@click.command("fakequant-grad", epilog=_FQG_EPILOG, short_help="TF fake-quant gradients (STE masks, min/max sums).")
@operand_group(
    bundle_argument(),
    spec_option("gradients", "Upstream gradient (TF operand 'gradients')."),
    spec_option("inputs", "Forward inputs (TF operand 'inputs')."),
    spec_option("min", "Range minimum: " + _RANGE_HELP),
    spec_option("max", "Range maximum: " + _RANGE_HELP),
    *_QDQ_SPECS,
)
@fake_quant_attribute_options
@quantize_options
@qdq_options
@semantics_options
@torchao_options
@estimator_options
@output_options(plot=True)
@skip_invalid_option
def fakequant_grad(operands, attributes, quantize, qdq, semantics, torchao, estimator, output, skip_invalid):
    """Run FakeQuantWithMinMax{Args,Vars,VarsPerChannel}Gradient as TensorFlow 2.21 does.

    Writes backprops_wrt_input, backprop_wrt_min, backprop_wrt_max (Args: backprops). The summary
    gives the nudged range, the clipped shares and the share of gradient mass the STE mask blocks.
    --estimator picks another backward pass (backprops_wrt_input plus backprop_wrt_scale/_zero_point
    for lsq, backprop_wrt_alpha for pact); --semantics torch runs PyTorch's op (lsq: its learnable op).
    --variant quantize-dequantize: the estimator over QuantizeV2's adjusted range [output_min, output_max] of
    the notebook's round trip (its custom gradient 0.9 * dy is --estimator scaled:0.9).
    BUNDLE may be a run file (see docs/whole-models.md): every fake-quant group runs.
    """
    job = run_file_job("fakequant-grad", operands, output, skip_invalid=skip_invalid, estimator=estimator)
    if job is not None:
        return _run_file(job)
    run(build_job("fakequant-grad", with_gradients=True, operands=operands, attributes=attributes,
                  quantize=quantize, semantics=semantics, estimator=estimator, output=output, qdq=qdq,
                  torchao=torchao))
