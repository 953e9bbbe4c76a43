"""From a training step to a run file: capture helpers (PyTorch today; TensorFlow to come).

:mod:`qgcli.capture.runfile_writer` writes run files (the layout of README's "Whole models") from NumPy
arrays and needs no framework.  :mod:`qgcli.capture.torch` records one training step of a model; it imports
torch only when called, and a missing torch is one error line (:class:`qgcli.errors.QgcliError`).  Nothing
here is imported by ``import qgcli``.
"""
