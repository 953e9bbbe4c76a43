"""The op families, one module each, listed in :mod:`qgcli.families.registry` (imported on first use): each
says its run-file ops, operands and attributes, how its job is built from the commands' options and from a
run-file group, how it validates a group, how it computes in memory (and, where it can, in blocks), and how
its summary is rendered.  The executors (:mod:`qgcli.execution.dispatch`) decide where a job runs.

- :mod:`~qgcli.families.tf_fake_quant`: TensorFlow's FakeQuantWithMinMax{Args,Vars,VarsPerChannel}(Gradient),
  in memory or streamed;
- :mod:`~qgcli.families.estimators`: TensorFlow's grid with another gradient estimator;
- :mod:`~qgcli.families.torch`: PyTorch's fake_quantize_per_{tensor,channel}_affine (and LSQ's learnable op);
- :mod:`~qgcli.families.quantize_v2`: TensorFlow's QuantizeV2 + Dequantize round trip;
- :mod:`~qgcli.families.qdq`: TensorFlow's QuantizeAndDequantizeV2/V3/V4 (+ V4Grad);
- :mod:`~qgcli.families.torchao`: torchao's QAT fake quantizers;
- :mod:`~qgcli.families.batch_norm`: FusedBatchNormGrad (V1/V2/V3), in memory or streamed.

A runner module has ``LITERAL_OK`` (operands that may be literals), ``compute(job, operands) -> Result`` and,
where it computes in blocks (:mod:`qgcli.execution.blocks`), ``block_setup`` and ``block_summary``.

:mod:`~qgcli.families.groups` turns a run file's groups (:mod:`qgcli.storage.runfile`) into layers of these
families and their jobs; :mod:`~qgcli.families.common` holds the option checks several families share.
See docs/op-families.md.
"""
