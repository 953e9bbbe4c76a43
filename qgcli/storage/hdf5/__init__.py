"""HDF5 below h5py: walking files safely (:mod:`~.walk`, :mod:`~.guard`), contiguous reads (:mod:`~.contiguous`),
compressed chunks (:mod:`~.chunks`) and many small writes (:mod:`~.small`)."""
