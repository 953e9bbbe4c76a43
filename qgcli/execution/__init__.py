"""Where a job runs: in memory, in blocks (HDF5 or Zarr), over the groups of a run file, on a Dask cluster.
:func:`qgcli.execution.dispatch.execute` chooses."""
