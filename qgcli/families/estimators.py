"""TensorFlow's grid with a gradient estimator other than its STE (``fakequant-grad --estimator``).

The forward grid is TensorFlow's (Args, Vars or VarsPerChannel); the backward pass is the estimator's
(:mod:`qgcli.ops.estimators`).  The summary is the TensorFlow runner's plus the estimator's details and the
gradient mass it blocks.
"""
from qgcli.errors import OptionError

from qgcli.families import tf_fake_quant
from qgcli.families.registry import FAKE_QUANT
from qgcli.jobs import Result
from qgcli.ops import estimators
from qgcli.ops.analysis import blocked_by, clip_statistics
from qgcli.ops.fake_quant import _args_grid, as_float32, nudge
from qgcli.report.tables import print_items
from qgcli.storage.operands import to_device
from qgcli.families.tf_fake_quant import TF_OPS, build_summary, load_fake_quant_operands
from qgcli.report.summaries import json_safe, percent

#: Its jobs are built by TensorFlow's family (:mod:`qgcli.families.tf_fake_quant`) when --estimator names
#: an estimator; a run file's groups are TensorFlow's ops.
NAME, KIND = tf_fake_quant.ESTIMATOR, FAKE_QUANT
LITERAL_OK = ("min", "max")


def compute(job, operands):
    est, grad_factor, axis = job.estimator, job.grad_factor, job.axis
    num_bits, narrow_range = job.num_bits, job.narrow_range
    gradients, inputs, mn, mx, variant = load_fake_quant_operands(operands, job.variant, with_gradients=True)
    if variant not in TF_OPS:
        raise OptionError(f"--estimator {est.text} works on the fake-quant ops ({', '.join(TF_OPS)})",
                                 param_hint="'--variant'")
    if axis is not None and variant != "per-channel":
        raise OptionError("only applies to --variant per-channel", param_hint="'--axis'")
    xp, (gradients, inputs) = to_device([gradients, inputs], job.output.device)
    view = estimators.tf_view(inputs, mn, mx, num_bits=num_bits, narrow_range=narrow_range, variant=variant,
                              axis=-1 if axis is None else axis)
    gf = None
    if est.name == "lsq":
        gf = estimators.lsq_grad_factor(view) if grad_factor in (None, "auto") else float(grad_factor)
    outputs, details = estimators.apply_estimator(est, gradients, view, grad_factor=gf)
    op = TF_OPS[variant] + "Gradient"
    attrs = {"op": op, "variant": variant, "num_bits": num_bits, "narrow_range": narrow_range,
             "estimator": est.text, "grad_factor": details.get("grad_factor")}
    if variant == "per-channel":
        attrs["axis"] = -1 if axis is None else axis
        grid = nudge(mn, mx, num_bits=num_bits, narrow_range=narrow_range)
    elif variant == "args":
        attrs.update(min=float(mn), max=float(mx))
        grid = _args_grid(float(mn), float(mx), num_bits, narrow_range)
    else:
        grid = nudge(mn, mx, num_bits=num_bits, narrow_range=narrow_range)
    g = as_float32(gradients, "gradients", xp)
    if view.axis is not None:
        g = xp.moveaxis(g, view.axis, -1)
    raw = {"gradients": gradients, "inputs": inputs, "min": mn, "max": mx}
    summary = build_summary(job.command, op, variant, operands, raw, outputs, grid,
                            clip_statistics(view.inputs, grid, g), attrs, job.output.destination)
    summary["estimator"] = json_safe(details)
    summary["statistics"]["estimator_blocked"] = blocked_by(gradients, outputs["backprops_wrt_input"])
    return Result(outputs, attrs, summary)


def mode(job):
    return f"--estimator {job.estimator.text}"


def render(console, s):
    tf_fake_quant.render(console, s)
    est_ = s["estimator"]
    extra = f", grad_factor {est_['grad_factor']:.7g}" if "grad_factor" in est_ else ""
    print_items(console, f"estimator {est_['estimator']}{extra} (TensorFlow's grid; outputs "
                  f"{', '.join(s['outputs'])}); it blocks {percent(s['statistics']['estimator_blocked'])} "
                  "of the gradient mass")
