"""From a training step to a run file: capture helpers for PyTorch and TensorFlow/Keras.

:mod:`qgcli.capture.runfile_writer` writes run files (the layout of README's "Whole models") from NumPy
arrays and needs no framework.  :mod:`qgcli.capture.torch` records one training step of a model (its
fake-quantize and batch-norm modules); :mod:`qgcli.capture.tensorflow` one ``tf.GradientTape`` step (every
``tf.quantization.fake_quant_*`` and fused batch-norm call, as tfmot QAT models make them).  Each imports
its framework only when called, and a missing framework is one error line
(:class:`qgcli.errors.QgcliError`).  Nothing here is imported by ``import qgcli``.
"""
