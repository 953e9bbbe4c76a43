"""From a training step to a run file: capture helpers for PyTorch and TensorFlow/Keras.

:mod:`qgcli.capture.runfile_writer` writes run files (the layout in docs/formats.md, "Run files") from NumPy
arrays and needs no framework.  :mod:`qgcli.capture.torch` records one training step of a model (its
fake-quantize and batch-norm modules); :mod:`qgcli.capture.tensorflow` one ``tf.GradientTape`` step (every
``tf.quantization.fake_quant_*`` and fused batch-norm call, as tfmot QAT models make them).  Each imports
its framework only when called, and a missing framework is one error line
(:class:`qgcli.errors.QgcliError`).  Nothing here is imported by ``import qgcli``.

A run file by hand, one fake-quant layer at step 100 with the framework's result beside it (what the
capture helpers write for every module they hook), then read back as ``qgcli verify`` reads it:

>>> import os, tempfile
>>> import h5py, numpy as np
>>> from qgcli import ops
>>> from qgcli.capture.runfile_writer import RunFileWriter
>>> path = os.path.join(tempfile.mkdtemp(), "run.h5")
>>> writer = RunFileWriter(path, step=100)
>>> x = np.linspace(-1, 1, 8, dtype=np.float32)
>>> writer.add("head.act_quant", "FakeQuantWithMinMaxArgs", {"inputs": x}, {"min": -0.5, "max": 0.5},
...            reference={"outputs": ops.fake_quant_with_min_max_args(x, -0.5, 0.5)})
'head/act_quant'
>>> writer.close()
>>> with h5py.File(path, "r") as f:
...     group = f["step_000100/head/act_quant"]
...     str(group.attrs["op"]), sorted(group), sorted(group["reference"])
('FakeQuantWithMinMaxArgs', ['inputs', 'reference'], ['outputs'])
"""
