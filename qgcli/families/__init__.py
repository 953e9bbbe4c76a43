"""Runners, one per op family: each takes a job (:mod:`qgcli.jobs`) and its opened operands and returns
named outputs plus a summary; the executors (:mod:`qgcli.execution.dispatch`) decide where that happens.

- :mod:`~qgcli.families.tf_fake_quant`: TensorFlow's FakeQuantWithMinMax{Args,Vars,VarsPerChannel}(Gradient),
  in memory or streamed;
- :mod:`~qgcli.families.estimators`: TensorFlow's grid with another gradient estimator;
- :mod:`~qgcli.families.torch`: PyTorch's fake_quantize_per_{tensor,channel}_affine (and LSQ's learnable op);
- :mod:`~qgcli.families.quantize_v2`: TensorFlow's QuantizeV2 + Dequantize round trip;
- :mod:`~qgcli.families.batch_norm`: FusedBatchNormGrad (V1/V2/V3), in memory or streamed.

A runner module has ``LITERAL_OK`` (operands that may be literals), ``compute(job, operands) -> Result`` and,
where it computes in blocks (:mod:`qgcli.execution.blocks`), ``block_setup`` and ``block_summary``.
"""
