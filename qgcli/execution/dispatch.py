"""Where a job runs: in memory, in blocks (HDF5 or Zarr), over the groups of a run file, on a cluster.

:func:`execute` opens the job's operands, decides before anything is loaded, hands the job to the runner of
its family (:mod:`qgcli.families`) and writes what the runner gives back with the job's output options, the
same way in every place: ``--compression`` for every .h5 output, ``--plot`` where the runner draws one, and a
``--memory-limit`` below the inputs either honoured (blocks) or refused, never ignored.
"""
import os

from qgcli.errors import OptionError
from qgcli.execution import memory
from qgcli.execution.cluster import Cluster
from qgcli.families import registry
from qgcli.jobs import RunFileJob, large_operands_in
from qgcli.storage.operands import Operands


def runner_for(job):
    """The module of the job's family (:mod:`qgcli.families.registry`)."""
    return registry.of(job)


def execute(job):
    """Run ``job`` where it belongs; returns its summary (a JSON-safe dict).

    The places, chosen here and nowhere else: every group of a run file (:mod:`qgcli.execution.runfile`),
    here or on a cluster; Zarr tensors in blocks (:mod:`qgcli.execution.blocks.zarr`), here or on a cluster;
    HDF5 tensors over the memory limit streamed in blocks (:mod:`qgcli.execution.blocks`); else in memory
    (:mod:`qgcli.execution.memory`, which also holds the rule that decides).
    """
    job = with_default_scheduler(job)
    scheduler = job.output.scheduler
    if isinstance(job, RunFileJob):  # every group of a run file (qgcli.execution.runfile)
        if scheduler is not None:
            from qgcli.execution.cluster import execute_on_cluster

            return execute_on_cluster(job, cluster(scheduler), runner_for=runner_for)
        from qgcli import collector
        from qgcli.execution.runfile import execute_run

        with collector.paused():  # thousands of groups' small objects, no cycles (qgcli.collector)
            return execute_run(job, runner_for=runner_for, memory_plan=memory.plan)
    runner = runner_for(job)
    operands = Operands.of(job.operands, literal_ok=runner.LITERAL_OK)
    try:
        from qgcli.storage import zarr_store

        blocks = None
        locations = zarr_store.locations(operands, large_operands_in(job, operands))
        if locations is not None:  # Zarr tensors: in row blocks (here or on a cluster) where they must be
            from qgcli.execution.blocks import zarr as zarr_blocks

            blocks = zarr_blocks.plan_for(job, operands, runner, locations)
        if blocks is not None:
            if scheduler is not None:
                from qgcli.execution.cluster import execute_blocks_on_cluster

                return execute_blocks_on_cluster(job, blocks, cluster(scheduler))
            return blocks.execute()
        if scheduler is not None:
            raise OptionError("runs the groups of a run file, or Zarr tensors, on a Dask cluster; this "
                              "bundle runs here (drop --scheduler)", param_hint="'--scheduler'")
        if not hasattr(runner, "block_setup"):
            from qgcli.families import registry

            plan = memory.plan(job, operands, streams=False, mode=registry.mode(job))
        elif job.output.device != "cpu":
            plan = memory.plan(job, operands, streams=False, mode=f"--device {job.output.device}")
        else:
            plan = memory.plan(job, operands, streams=True)
        if plan is not None:
            from qgcli.execution.blocks import run_streamed

            return run_streamed(runner, job, operands, *plan)
        return memory.run_in_memory(runner, job, operands)
    finally:
        operands.close()


def cluster(address):
    """The cluster at a ``--scheduler`` address (:class:`qgcli.execution.cluster.Cluster`, not yet entered):
    Dask's.  Another kind of cluster is one module with the same methods and one line here."""
    return Cluster(address)


def default_scheduler():
    """Dask's own ``DASK_SCHEDULER_ADDRESS`` setting: the scheduler of the work that can run on a cluster (run
    files, Zarr tensors in blocks, ``report`` and ``verify`` of run files) when ``--scheduler`` is absent."""
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
