"""Reading and writing tensors: one module per container format, HDF5's helpers under :mod:`qgcli.storage.hdf5`,
operand SPECs (:mod:`~qgcli.storage.operands`), atomic outputs (:mod:`~qgcli.storage.outputs`) and run-file
discovery (:mod:`~qgcli.storage.runfile`)."""
