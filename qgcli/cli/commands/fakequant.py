"""``qgcli fakequant`` and ``qgcli fakequant-grad``: fake quant on saved tensors, in every fake-quant family.

TensorFlow's fake-quant ops (the default), TensorFlow's grid with another gradient estimator
(``--estimator``), PyTorch's op (``--semantics torch``), torchao's (``--semantics torchao``) and TensorFlow's
QuantizeV2 + Dequantize / QuantizeAndDequantize round trips (``--variant``).  The options are parsed once into a :class:`qgcli.FakeQuantJob`,
built and checked by the family they choose (:mod:`qgcli.families.registry`), executed by
:func:`qgcli.execution.dispatch.execute` and the summary rendered by the family.  Only click is imported at
module level.
"""
import click

from qgcli.cli.options import (
    block_format_options,
    bundle_argument,
    estimator_options,
    fake_quant_attribute_options,
    operand_group,
    output_options,
    qdq_options,
    quantize_options,
    ranges_option,
    run_file_job,
    semantics_options,
    skip_invalid_option,
    spec_option,
    torchao_options,
)
from qgcli.report.summaries import emit

_RANGE_HELP = "scalar (vars/args) or one per channel."
_QDQ_SPECS = (
    spec_option("input", "QuantizeAndDequantize's 'input' (--variant quantize-and-dequantize-v*; --inputs too)."),
    spec_option("input_min", "QuantizeAndDequantize's 'input_min': a scalar, or one per slice with --axis."),
    spec_option("input_max", "QuantizeAndDequantize's 'input_max': like input_min."),
    spec_option("x", "ONNX QuantizeLinear's 'x' (--semantics onnx; --inputs too)."),
    spec_option("y_scale", "ONNX QuantizeLinear's 'y_scale' (--semantics onnx): one value, one per --axis slice, "
                           "or blocked (x's rank, --block-size)."),
    spec_option("y_zero_point", "ONNX QuantizeLinear's 'y_zero_point' (--semantics onnx), shaped like y_scale "
                                "[default: 0]."),
)


def build_job(command, *, with_gradients, operands, attributes, quantize, semantics, estimator, output, qdq=None,
              torchao=None, formats=None):
    """The job the options describe: the family they choose builds it, every option checked against it
    (:func:`qgcli.families.registry.job_from_options`)."""
    from qgcli.families import registry
    from qgcli.jobs import BlockFormatOptions, FakeQuantOptions, TorchaoOptions

    return registry.job_from_options(FakeQuantOptions(
        command, with_gradients, operands, attributes, quantize, semantics, estimator, output, qdq,
        torchao or TorchaoOptions(), formats or BlockFormatOptions()))


def _no_estimator():
    from qgcli.jobs import EstimatorOptions

    return EstimatorOptions()


def run(job):
    """Execute the job and print its summary."""
    from qgcli.execution.dispatch import execute

    from qgcli.families import registry

    summary = execute(job)
    emit(summary, as_json=job.output.as_json, quiet=job.output.quiet, render=registry.of(job).render,
         output=job.output.destination)


def _run_file(job):
    """A run file: every fake-quant group through :func:`qgcli.execution.dispatch.execute`, one summary for all."""
    from qgcli.execution.dispatch import execute
    from qgcli.execution.runfile import render_run

    emit(execute(job), as_json=job.output.as_json, quiet=job.output.quiet, render=render_run,
         output=job.output.destination)


# --- the commands -----------------------------------------------------------------------------------------

_FQ_EPILOG = """\b
Examples:
  qgcli fakequant samples/notebook.h5 --num-bits 2 -o out.h5
  qgcli fakequant --inputs x.npy --min -6 --max 6 -o out.npz
  qgcli fakequant act.h5 --inputs act.h5:layer1/x --min -1,-2,-3 --max 1,2,3 -o out/
  qgcli fakequant samples/notebook.h5 --variant quantize-dequantize --dtype quint8 -o qdq.h5
  qgcli fakequant w.h5 --semantics mx --mx-format mxfp4 --scale-mode rceil -o mx.h5
  qgcli fakequant --inputs x.npy --semantics onnx --y-scale 0.02 --dtype int8 -o q.npz
"""

_FQG_EPILOG = """\b
Examples:
  qgcli fakequant-grad samples/per_channel.h5 -o grads.h5
  qgcli fakequant-grad samples/notebook.h5 --num-bits 2 -o - | qgcli inspect -
  qgcli fakequant-grad --gradients g.npy --inputs x.npy --min -6 --max 6 -o grads.npz --json
  qgcli fakequant-grad samples/notebook.h5 --variant quantize-dequantize --estimator scaled:0.9 -o g.h5
"""


@click.command("fakequant", epilog=_FQ_EPILOG, short_help="Fake quant, bit for bit: TF (Args/Vars/PerChannel, QDQ, "
               "QuantizeV2), PyTorch, torchao, MX, NVFP4, ONNX.")
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
@block_format_options
@output_options()
@skip_invalid_option
def fakequant(operands, attributes, quantize, qdq, semantics, torchao, formats, output, skip_invalid):
    """Run FakeQuantWithMinMax{Args,Vars,VarsPerChannel} as TensorFlow 2.21 does, bit for bit.

    Operands come from BUNDLE (an .h5/.npz whose datasets are named inputs, min, max) or from the
    options, which override the bundle. Writes the output 'outputs'. With --semantics torch: PyTorch's
    fake_quantize_per_{tensor,channel}_affine on the operands inputs, scale, zero_point. With
    --variant quantize-dequantize: the notebook's tf.quantize + tf.dequantize (QuantizeV2 + Dequantize, --dtype,
    --mode, --round-mode), writing outputs, quantized, output_min, output_max. With --semantics mx / nvfp4 / onnx:
    the block formats (torchao's to_mx, NVFP4Tensor, ONNX QuantizeLinear + DequantizeLinear; see
    docs/formats-mx-nvfp4-onnx.md), writing outputs, the scales and the quantized codes.
    BUNDLE may be a run file (groups with an 'op' attribute, see docs/whole-models.md, or
    run.h5:GROUP): every fake-quant group runs, outputs at the same group paths.
    """
    job = run_file_job("fakequant", operands, output, skip_invalid=skip_invalid)
    if job is not None:
        return _run_file(job)
    run(build_job("fakequant", with_gradients=False, operands=operands, attributes=attributes, quantize=quantize,
                  semantics=semantics, estimator=_no_estimator(), output=output, qdq=qdq, torchao=torchao,
                  formats=formats))


@click.command("fakequant-grad", epilog=_FQG_EPILOG,
               short_help="Fake-quant gradients (STE masks, range sums, estimators): "
                          "TF, QDQ, QuantizeV2, PyTorch, torchao, MX, NVFP4, ONNX.")
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
@block_format_options
@estimator_options
@output_options(plot=True)
@skip_invalid_option
@ranges_option
def fakequant_grad(operands, attributes, quantize, qdq, semantics, torchao, formats, estimator, output,
                   skip_invalid, ranges):
    """Run FakeQuantWithMinMax{Args,Vars,VarsPerChannel}Gradient as TensorFlow 2.21 does.

    Writes backprops_wrt_input, backprop_wrt_min, backprop_wrt_max (Args: backprops). The summary
    gives the nudged range, the clipped shares and the share of gradient mass the STE mask blocks.
    --estimator picks another backward pass (backprops_wrt_input plus backprop_wrt_scale/_zero_point
    for lsq, backprop_wrt_alpha for pact); --semantics torch runs PyTorch's op (lsq: its learnable op).
    --variant quantize-dequantize: the estimator over QuantizeV2's adjusted range [output_min, output_max] of
    the notebook's round trip (its custom gradient 0.9 * dy is --estimator scaled:0.9).
    --semantics mx / nvfp4 / onnx: the identity STE of their QAT (--estimator masked-ste: onnx integer types).
    BUNDLE may be a run file (see docs/whole-models.md): every fake-quant group runs.
    """
    job = run_file_job("fakequant-grad", operands, output, skip_invalid=skip_invalid, estimator=estimator,
                       ranges=ranges)
    if job is not None:
        return _run_file(job)
    run(build_job("fakequant-grad", with_gradients=True, operands=operands, attributes=attributes,
                  quantize=quantize, semantics=semantics, estimator=estimator, output=output, qdq=qdq,
                  torchao=torchao, formats=formats))
