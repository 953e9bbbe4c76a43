"""Where a job runs: in memory, or streamed over HDF5 row blocks when its inputs exceed the memory limit.

:func:`execute` opens the job's operands, decides before anything is loaded, hands the job to the runner of
its family (:mod:`qgcli.families`) and writes what the runner gives back with the job's output options, the
same way in every mode: ``--compression`` for every .h5 output, ``--plot`` where the runner draws one, and a
``--memory-limit`` below the inputs either honoured (streaming) or refused, never ignored.  An executor over
every group of a run file, or over a Dask cluster, is one more function of this shape.
"""
from qgcli.errors import OptionError
from qgcli.jobs import RunFileJob


def runner_for(job):
    """The module of the job's family (:mod:`qgcli.families.registry`)."""
    from qgcli.families import registry

    return registry.of(job)


def execute(job):
    """Run ``job`` in memory or streamed; returns its summary (a JSON-safe dict)."""
    from qgcli.storage.operands import Operands

    job = with_default_scheduler(job)
    if isinstance(job, RunFileJob):  # every group of a run file (qgcli.execution.runfile)
        from qgcli.execution.runfile import execute_run

        if job.output.scheduler is not None:  # ... on a Dask cluster (qgcli.execution.cluster)
            from qgcli.execution.cluster import execute_on_cluster

            return execute_on_cluster(job, runner_for=runner_for)

        return execute_run(job, runner_for=runner_for, memory_plan=memory_plan)
    runner = runner_for(job)
    operands = Operands.of(job.operands, literal_ok=runner.LITERAL_OK)
    try:
        from qgcli.storage import zarr_store

        blocks = None
        locations = zarr_store.locations(operands, job.large_operands)
        if locations is not None:  # Zarr tensors: in row blocks (here or on a cluster) where they must be
            from qgcli.execution import zarr_blocks

            blocks = zarr_blocks.plan_for(job, operands, runner, locations)
        if blocks is not None:
            if job.output.scheduler is not None:
                from qgcli.execution.cluster import execute_blocks_on_cluster

                return execute_blocks_on_cluster(job, blocks)
            return blocks.execute()
        if job.output.scheduler is not None:
            raise OptionError("runs the groups of a run file, or Zarr tensors, on a Dask cluster; this "
                                     "bundle runs here (drop --scheduler)", param_hint="'--scheduler'")
        if not hasattr(runner, "stream"):
            from qgcli.families import registry

            plan = memory_plan(job, operands, streams=False, mode=registry.mode(job))
        elif job.output.device != "cpu":
            plan = memory_plan(job, operands, streams=False, mode=f"--device {job.output.device}")
        else:
            plan = memory_plan(job, operands, streams=True)
        if plan is not None:
            return run_streamed(runner, job, operands, *plan)
        return run_in_memory(runner, job, operands)
    finally:
        operands.close()


def default_scheduler():
    """Dask's own ``DASK_SCHEDULER_ADDRESS`` setting: the scheduler of the work that can run on a cluster (run
    files, Zarr tensors in blocks, ``report`` and ``verify`` of run files) when ``--scheduler`` is absent."""
    import os

    return os.environ.get("DASK_SCHEDULER_ADDRESS") or None


def with_default_scheduler(job):
    """``job`` with :func:`default_scheduler` where it has no --scheduler and can use one: a run file, or
    large operands in Zarr stores (a bundle of .h5/.npz files runs here as always)."""
    from qgcli.storage import io
    from qgcli.storage import zarr_store

    address = default_scheduler()
    if address is None or job.output.scheduler is not None:
        return job
    if not isinstance(job, RunFileJob):
        from qgcli.families import registry

        if not registry.computes_in_blocks(job):  # only they run Zarr tensors on a cluster
            return job
        specs = job.operands.as_dict()
        texts = [specs.get(name) or job.operands.bundle for name in getattr(job, "large_operands", ())]
        if not texts or not all(t and zarr_store.is_zarr(io.parse_spec(t).path or "") for t in texts):
            return job
    return job._replace(output=job.output._replace(scheduler=address))


def run_in_memory(runner, job, operands):
    """Load, compute, write the outputs (and the figure); returns the summary."""
    from qgcli.storage.outputs import check_figure_output, save_checked, write_outputs

    out = job.output
    result = runner.compute(job, operands)
    if out.plot:  # refuse a bad figure path before any output is written
        check_figure_output(out.plot, inputs=operands.input_paths(), force=out.force, option="--plot")
    write_outputs(result.outputs, out.destination, operands=operands, force=out.force, attrs=result.attrs,
                  compression=out.compression)
    if out.plot:
        check_figure_output(out.plot, inputs=operands.input_paths(), force=out.force, option="--plot")
        save_checked(result.figure(), out.plot, 100)
        result.summary["figure"] = out.plot  # said in the summary's "wrote" lines (stderr) and its JSON
    return result.summary


def run_streamed(runner, job, operands, datasets, budget):
    """Stream the large operands block by block into a temporary .h5 renamed over the output."""
    from qgcli.storage.outputs import write_streamed

    out = job.output
    if out.plot:
        raise OptionError("cannot draw a figure of a tensor streamed from disk; drop --plot or raise "
                                 "--memory-limit", param_hint="'--plot'")
    plan = runner.stream(job, operands, datasets, budget)
    small = write_streamed(out.destination, operands, out.force, plan.attrs, plan.compute, quiet=out.quiet,
                           total_bytes=plan.total_bytes, compression=out.compression)
    return plan.summarise(small)


def memory_plan(job, operands, *, streams, mode=None):
    """``(datasets, budget)`` when the job's large operands must be streamed, else None (work in memory).

    A job that cannot stream (``mode`` says why: its family, or the GPU) is refused when an explicit
    ``--memory-limit`` is below what its HDF5 inputs need; without the option it works in memory as always.
    """
    import os
    import shutil

    from qgcli.storage import io
    from qgcli.errors import OperandError, OutputError, QgcliError

    limit, output = job.output.memory_limit, job.output.destination
    if not streams and limit is None:
        return None
    measured = _measure(operands, job.large_operands, limit)
    if measured is None:
        return None
    datasets, budget, need = measured
    if not streams:
        raise QgcliError(f"the inputs need about {_size(need)}, more than {_size(budget)}, and {mode} cannot stream "
                         "them from disk (only TensorFlow's fake-quant ops and bn-grad stream, on the CPU); raise "
                         "--memory-limit or drop it", operand="--memory-limit")
    for name, ds in datasets.items():
        declared, stored = int(ds.size) * ds.dtype.itemsize, ds.id.get_storage_size()
        if ds.compression is None and stored < declared // 2:
            # A file can declare terabytes and store nothing: reading it would stream fill values for hours.
            raise OperandError(f"declares {declared / 2**30:.1f} GiB but stores {stored / 2**30:.3f} GiB; "
                               "refusing to stream unwritten data", operand=name)
    if output == "-" or io.output_kind(output) != "h5":
        raise OutputError(f"the inputs need about {need / 2**30:.1f} GiB, more than --memory-limit "
                          f"({budget / 2**30:.1f} GiB); streaming writes .h5 outputs only", operand="--output")
    out_bytes = int(datasets["x" if "x" in datasets else "inputs"].size) * 4
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(output))).free
    if free < out_bytes:
        raise OutputError(f"needs {out_bytes / 2**30:.1f} GiB but its file system has {free / 2**30:.1f} GiB free",
                          operand="--output")
    return datasets, budget


def _measure(operands, names, limit):
    """``(datasets, budget, bytes needed)`` when every named operand is an HDF5 dataset and together they
    need more than the limit; else None."""
    from qgcli.execution import streaming

    budget = streaming.parse_memory_limit(limit)
    datasets = {}
    for name in names:
        ds = operands.dataset(name)
        if ds is None:
            return None
        datasets[name] = ds
    # inputs as read plus float32 working copies and outputs of the same size
    need = sum(int(ds.size) * max(ds.dtype.itemsize, 4) for ds in datasets.values()) * 2
    if need <= budget:
        return None
    return datasets, budget, need


def _size(n):
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
