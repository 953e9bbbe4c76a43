"""``qgcli bn-grad``: TensorFlow's FusedBatchNormGrad (V1/V2/V3) on saved tensors.

The options become a :class:`qgcli.jobs.BatchNormJob`, run by :func:`qgcli.execution.dispatch.execute` (in memory,
or streamed in two passes when the HDF5 inputs exceed ``--memory-limit``); the family renders the summary.
"""
import click

from qgcli.cli.options import (
    bundle_argument,
    operand_group,
    output_options,
    run_file_job,
    skip_invalid_option,
    spec_option,
)
from qgcli.report.summaries import emit


def _epsilon(ctx, param, value):
    import math

    if value is not None and (not math.isfinite(value) or value < 0):
        raise click.BadParameter(f"must be a finite number >= 0, got {value!r}")
    return value


_EPILOG = """\b
Examples:
  qgcli bn-grad samples/batch_norm.h5 -o grads.h5
  qgcli bn-grad samples/batch_norm.h5 --variance-kind auto -o grads.npz --json
  qgcli bn-grad --y-backprop dy.npy --x x.npy --scale 1,1,1 --reserve-space-1 m.npy \\
      --reserve-space-2 v.npy --epsilon 1e-3 --data-format NCHW -o out/
  qgcli bn-grad run.h5 --no-is-training --version v2 --all-outputs -o grads.h5
"""


@click.command("bn-grad", epilog=_EPILOG, short_help="TF FusedBatchNormGrad V1/V2/V3 (batch-norm gradients).")
@operand_group(
    bundle_argument(),
    spec_option("y_backprop", "Upstream gradient dL/dy (TF operand 'y_backprop')."),
    spec_option("x", "Forward input (TF operand 'x')."),
    spec_option("scale", "gamma, one per channel (a literal like 1,1,1 works)."),
    spec_option("reserve_space_1", "Batch mean (training) or population mean (inference)."),
    spec_option("reserve_space_2", "Batch variance (training; see --variance-kind) or population variance (inference)."),
    spec_option("reserve_space_3", "V3 only; ignored, as on TensorFlow's CPU."),
)
@click.option("--epsilon", type=float, default=1e-4, show_default=True, callback=_epsilon,
              help="Added to the variance (TF's op default; Keras layers use 1e-3).")
@click.option("--data-format", type=click.Choice(["NHWC", "NCHW", "NDHWC", "NCDHW"]), default=None,
              help="Layout of x [default: NHWC for 4-D x, NDHWC for 5-D].")
@click.option("--is-training/--no-is-training", default=True, show_default=True,
              help="Batch statistics (training) or population statistics (inference).")
@click.option("--variance-kind", type=click.Choice(["variance", "inv-std", "auto"]), default="variance",
              show_default=True,
              help="What reserve_space_2 holds: the variance (TF CPU), 1/sqrt(var + eps) (cuDNN), or auto: "
                   "recompute the statistics from x and find out (training only).")
@click.option("--version", type=click.Choice(["v1", "v2", "v3"]), default="v3", show_default=True,
              help="FusedBatchNormGrad, ...V2 or ...V3: dtype rules and placeholder outputs.")
@click.option("--all-outputs", is_flag=True,
              help="Also write TF's unused placeholder outputs (reserve_space_3/4, V3: 4/5), shaped [0].")
@output_options()
@skip_invalid_option
def bn_grad(operands, epsilon, data_format, is_training, variance_kind, version, all_outputs, output, skip_invalid):
    """Run TensorFlow's FusedBatchNormGrad{,V2,V3}: gradients of batch normalisation.

    Operands come from BUNDLE (an .h5/.npz with datasets y_backprop, x, scale, reserve_space_1,
    reserve_space_2) or from the options, which override the bundle. Writes x_backprop,
    scale_backprop and offset_backprop, within float32 rounding of TensorFlow 2.21. The summary
    gives per-channel norms of the three and the statistics convention applied.
    """
    from qgcli.execution.dispatch import execute
    from qgcli.jobs import BatchNormJob

    run = run_file_job("bn-grad", operands, output, skip_invalid=skip_invalid, all_outputs=all_outputs)
    if run is not None:  # a run file: every FusedBatchNorm group, outputs at the same group paths
        from qgcli.execution.runfile import render_run

        emit(execute(run), as_json=output.as_json, quiet=output.quiet, render=render_run, output=output.destination)
        return
    job = BatchNormJob(operands, output, epsilon=epsilon, data_format=data_format, is_training=is_training,
                       variance_kind=variance_kind, version=version, all_outputs=all_outputs)
    from qgcli.families import registry

    emit(execute(job), as_json=output.as_json, quiet=output.quiet, render=registry.of(job).render,
         output=output.destination)
