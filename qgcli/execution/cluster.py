"""The cluster: work computed as tasks on a ``dask.distributed`` cluster (``--scheduler``), through one
interface, :class:`Cluster`.

Three kinds of work use it, all with the same client, task keys, error handling and ``cluster`` summary entry:

- the groups of a run file (:func:`execute_on_cluster`): the client does what the run-file executor
  (:mod:`qgcli.execution.runfile`) does (discovers and checks every group, nothing read, and writes every
  output, in the same order and layout), except that each group's ``runner.compute`` runs as one task on a
  worker: the worker opens the run file itself (the client ships no tensors, only the job and the group's
  path: the file must be readable at the same path on every worker, a shared file system), builds the
  group's job with :func:`qgcli.families.groups.job_from_group`, computes it whole with the same runner and
  kernels, and returns the Result's arrays.  So the outputs are bit for bit those of a local run by
  construction: the same function on the same bytes, and pickling keeps every bit.  HDF5 has a single
  writer: the client, as the results arrive, in group order.  At most ``2 x`` the cluster's threads of
  groups are in flight, so the workers do not hold every result at once.  A group is computed whole on one
  worker (no streaming): an explicit ``--memory-limit`` is refused;
- the blocks of Zarr tensors (:func:`execute_blocks_on_cluster`, :mod:`qgcli.execution.blocks.zarr`): the
  workers read their rows from the input stores and write their chunks of the output store themselves;
- the per-layer rows of ``report`` and ``verify`` (:meth:`Cluster.map_layers`).

Another kind of cluster (Ray, say) is one module with a class of :class:`Cluster`'s methods and one line in
:func:`qgcli.execution.dispatch.cluster`.  Nothing of Dask is imported unless ``--scheduler`` is given.
"""
import logging
import os
import re
import time

from qgcli.backend import to_numpy
from qgcli.errors import OptionError, QgcliError, RuntimeFailure
from qgcli.execution import runfile as rf
from qgcli.execution.runfile import execute_run
from qgcli.jobs import Result

_LOCAL = re.compile(r"^local(?::(\d+))?$")
#: How long the client waits for a scheduler to answer.
CONNECT_TIMEOUT_S = 10


class Cluster:
    """``with Cluster(address) as cluster``: a Dask client of the scheduler at ``address`` (or of a local
    cluster started for this command, ``local`` / ``local:N``), closed at the end.

    :meth:`map` runs ``function`` over items and gives the results in order; :meth:`submit` and
    :meth:`result` run tasks one at a time (a window of them in flight); :meth:`describe` is the summary's
    ``cluster`` entry (scheduler, workers, tasks, seconds waited for results)."""

    def __init__(self, address):
        self.address = address
        self.tasks, self.waited, self.workers = 0, 0.0, 0
        self.client = self.cluster = None

    def __enter__(self):
        self.client, self.cluster = connect(self.address)
        return self

    def __exit__(self, *exc):
        self.client.close()
        if self.cluster is not None:
            self.cluster.close()

    def threads(self):
        """The worker threads of the cluster now (and its worker count, for :meth:`describe`)."""
        workers = self.client.scheduler_info().get("workers", {})
        self.workers = len(workers)
        return sum(int(w.get("nthreads", 1)) for w in workers.values())

    def map(self, function, items, *shared, settle=False):
        """``function(*shared, item)`` of every item, on the workers, in order.  On an error (or a signal)
        the tasks are cancelled; with ``settle``, the call waits (a few seconds at most) until none still
        runs, for tasks that write where the caller is about to clean up."""
        items = list(items)
        self.threads()
        started = time.perf_counter()
        keys = [f"qgcli-{getattr(function, '__name__', 'task')}-{time.monotonic_ns()}-{i}" for i in range(len(items))]
        futures = self.client.map(function, *[[s] * len(items) for s in shared], items, pure=False, key=keys)
        self.tasks += len(items)
        try:
            return _gathered(self.client, futures)
        except BaseException:
            self.client.cancel(futures)
            if settle:
                _drain(self.client, set(keys))  # a block still running would write into the store being removed
            raise
        finally:
            self.waited += time.perf_counter() - started

    def map_layers(self, function, path, layers, *args):
        """``function(container, handle, path, layer, *args)`` of each layer of the run file at ``path``, each
        worker opening the file itself (a Layer holds nothing open); for ``report`` and ``verify``, whose
        per-layer results are small rows."""
        return self.map(_on_layer, layers, function, path, args)

    def submit(self, function, *args, key):
        """One task, ``function(*args)``: its future."""
        self.tasks += 1
        return self.client.submit(function, *args, pure=False, key=f"{key}-{self.tasks}")

    def result(self, future):
        """A submitted task's result, waited for."""
        started = time.perf_counter()
        try:
            return _gathered(self.client, future)
        finally:
            self.waited += time.perf_counter() - started

    def cancel(self, futures):
        if futures:
            self.client.cancel(futures)

    def describe(self):
        return {"scheduler": self.client.scheduler.address, "workers": self.workers, "tasks": self.tasks,
                "wait_s": round(self.waited, 6)}


def connect(scheduler):
    """``(client, cluster or None)``: a Client of the scheduler at ``scheduler``, or of a LocalCluster of N
    worker processes started for this command (``local`` / ``local:N``; N defaults to the CPU count, at most 4)."""
    try:
        import distributed
    except ImportError:
        raise QgcliError("needs Dask: pip install 'qgcli[dask]'", operand="--scheduler") from None

    local = _LOCAL.match(scheduler.strip())
    if local:
        n = int(local.group(1)) if local.group(1) else min(4, os.cpu_count() or 1)
        if n < 1:
            raise OptionError("local:N needs N >= 1 workers", param_hint="'--scheduler'")
        cluster = distributed.LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                                           dashboard_address=":0", silence_logs=logging.ERROR)
        try:
            return distributed.Client(cluster), cluster
        except BaseException:
            cluster.close()
            raise
    try:
        return distributed.Client(scheduler, timeout=f"{CONNECT_TIMEOUT_S}s"), None
    except (OSError, TimeoutError, ValueError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        # exit 1, not 2: the address may be right and the scheduler down (a runtime failure, not bad input)
        raise RuntimeFailure(f"--scheduler: no Dask scheduler answered at {scheduler} within "
                             f"{CONNECT_TIMEOUT_S} s ({reason})") from None


def _drain(client, keys, timeout=10.0):
    """Wait (at most ``timeout`` s) until no worker still runs one of ``keys`` (cancelled tasks that had
    started run to their end)."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and keys & {k for ks in client.processing().values() for k in ks}:
            time.sleep(0.05)
    except (OSError, TimeoutError):
        pass  # the scheduler is gone: nothing runs there any more


def _gathered(client, futures):
    """The futures' results in order; a task that killed its workers more often than Dask allows is a
    one-line error (exit 1: nothing was written)."""
    import distributed

    try:
        return client.gather(futures)
    except distributed.KilledWorker as exc:
        raise RuntimeFailure(f"a task failed on every worker it was given ({exc.args[0] if exc.args else ''}); "
                             "nothing was written") from None


def _on_layer(function, path, args, layer):
    """On a worker: ``function`` of one layer of the run file at ``path``, opened here."""
    from qgcli.storage import io

    container = io.Container.open(path)
    try:
        return function(container, container._opened(), path, layer, *args)
    finally:
        container.close()


# --- the work that runs on a cluster -------------------------------------------------------------------

def execute_on_cluster(job, cluster, *, runner_for):
    """Run a :class:`qgcli.jobs.RunFileJob` with its groups on ``cluster`` (a :class:`Cluster`, not yet
    entered); returns the run-file summary with a ``cluster`` entry (scheduler address, workers, tasks)."""
    if job.output.memory_limit is not None:
        raise OptionError("each group is computed whole on one worker under --scheduler; drop "
                          "--memory-limit (the workers' own memory limits apply)", param_hint="'--memory-limit'")
    with cluster:
        remote = GroupTasks(cluster, runner_for)
        try:
            summary = execute_run(job, runner_for=runner_for, memory_plan=_no_streaming, remote=remote)
        finally:
            remote.cancel()
        summary["cluster"] = cluster.describe()
        return summary


def execute_blocks_on_cluster(job, blocks, cluster):
    """Run a :class:`qgcli.execution.blocks.zarr.BlockRun` with one task per block on ``cluster``: the workers
    read their rows from the input stores and write their chunks of the output store themselves; the client
    adds the partial sums and renames the store into place."""
    if job.output.memory_limit is not None:
        raise OptionError("blocks are sized by the Zarr chunks under --scheduler; drop --memory-limit "
                          "(the workers' own memory limits apply)", param_hint="'--memory-limit'")
    with cluster:
        summary = blocks.execute(lambda function, work, parts: cluster.map(function, parts, work, settle=True))
        summary["cluster"] = cluster.describe()
        return summary


def _no_streaming(job, operands, *, streams, mode=None):
    return None


class GroupTasks:
    """The ``remote`` of :func:`qgcli.execution.runfile.execute_run`: one task per group, a bounded window of
    them in flight, results handed back in the order the writer asks for them."""

    def __init__(self, cluster, runner_for):
        self.cluster, self.runner_for = cluster, runner_for
        self.window = max(2, 2 * cluster.threads())
        self._pending, self._futures = [], {}

    def start(self, job, path, layers):
        self.job, self.path = job, path
        self._pending = list(layers)
        self._pending.reverse()
        self._fill()

    def _submit(self, layer):
        return self.cluster.submit(compute_group, self.job, self.path, layer, self.runner_for,
                                   key=f"qgcli-group-{layer.path}")

    def _fill(self):
        while self._pending and len(self._futures) < self.window:
            layer = self._pending.pop()
            self._futures[layer.path] = self._submit(layer)

    def result(self, layer):
        """The group's Result (outputs as NumPy arrays, no figure); a group the runner refused raises the
        runner's message as a QgcliError (the run-file executor reports it as for a local run)."""
        future = self._futures.pop(layer.path, None)
        if future is None:
            self._pending = [l for l in self._pending if l.path != layer.path]
            future = self._submit(layer)
        self._fill()
        got = self.cluster.result(future)
        if "error" in got:
            raise QgcliError(got["error"])
        return Result(got["outputs"], got["attrs"], got["summary"])

    def cancel(self):
        """Drop the tasks no writer asked for (a run stopped by an error)."""
        futures = list(self._futures.values())
        self._futures, self._pending = {}, []
        self.cluster.cancel(futures)


def compute_group(job, path, layer, runner_for):
    """On a worker: one group's outputs, computed whole with its runner exactly as a local run does.

    Returns ``{"outputs", "attrs", "summary"}`` (NumPy arrays), or ``{"error": text}`` when the runner
    refuses the group (the text the local run-file executor would show)."""
    from qgcli.storage import io

    rf._TOOLS.setdefault("runner_for", runner_for)
    container = io.Container.open(path)
    try:
        try:
            group_job, runner, operands, _ = rf._prepared(job, container, path, layer)
        except rf._errors() as exc:
            return {"error": rf._failure(layer, exc)}
        try:
            result = runner.compute(group_job, operands)
        except rf._errors() as exc:
            return {"error": rf._failure(layer, exc)}
        finally:
            operands.close()
    finally:
        container.close()
    return {"outputs": {k: to_numpy(v) for k, v in result.outputs.items()}, "attrs": result.attrs,
            "summary": result.summary}
