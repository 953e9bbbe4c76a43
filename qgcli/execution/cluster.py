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
import concurrent.futures
import logging
import os
import re
import threading
import time

from qgcli.backend import to_numpy
from qgcli.errors import OptionError, QgcliError, RuntimeFailure
from qgcli.execution import runfile as rf
from qgcli.execution.runfile import execute_run
from qgcli.jobs import Result
from qgcli.signals import raise_pending

_LOCAL = re.compile(r"^local(?::(\d+))?$")
#: How long the client waits for a scheduler to answer: to connect (the whole handshake: a listener that
#: accepts and never answers fails too) and, mid-run, to a probe of the cluster.
CONNECT_TIMEOUT_S = 10
#: How long a run waits while the cluster has no worker at all (the last one died and none joined): the
#: work it lost cannot be retried anywhere, so the run fails.
NO_WORKER_TIMEOUT_S = 10
#: ``QGCLI_DASK_TIMEOUT=SECONDS`` sets both.
TIMEOUT_ENV = "QGCLI_DASK_TIMEOUT"
#: How often a wait looks at signals (a SIGTERM ends it within this), and how often it probes the cluster.
_POLL_S, _PROBE_S = 0.05, 0.5
#: How long the clean-up after a failure or a signal waits for the scheduler (cancelling, closing).
_CLEANUP_S = 0.5
#: Dask's loggers: their tracebacks (a lost scheduler, a dead worker) never reach the user's stderr.
_LOGGERS = ("distributed", "tornado", "asyncio", "bokeh")


def timeout_s(default):
    """``default`` seconds, or ``QGCLI_DASK_TIMEOUT`` where it is set (a positive number)."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise OptionError(f"{TIMEOUT_ENV}={text!r}: needs a number of seconds above 0", param_hint="'--scheduler'")
    return value


class Cluster:
    """``with Cluster(address) as cluster``: a Dask client of the scheduler at ``address`` (or of a local
    cluster started for this command, ``local`` / ``local:N``), closed at the end.

    :meth:`map` runs ``function`` over items and gives the results in order; :meth:`submit` and
    :meth:`result` run tasks one at a time (a window of them in flight); :meth:`describe` is the summary's
    ``cluster`` entry (scheduler, workers, tasks, seconds waited for results).

    Every wait is bounded and watched (:meth:`_waited`): a signal ends it within :data:`_POLL_S`, a scheduler
    that is lost or stops answering for :data:`CONNECT_TIMEOUT_S`, or a cluster left without any worker for
    :data:`NO_WORKER_TIMEOUT_S`, ends it with one line (exit 1).  A worker lost while others remain costs
    nothing: Dask gives its tasks to the others (a task that kills 3 workers fails the run)."""

    def __init__(self, address):
        self.address = address
        self.tasks, self.waited, self.workers = 0, 0.0, 0
        self.client = self.cluster = None
        self._logs = None

    def __enter__(self):
        self._logs = _silence_dask()
        try:
            self.client, self.cluster = connect(self.address)
        except BaseException:
            self._restore_logs()
            raise
        return self

    def __exit__(self, *exc):
        try:
            _closed(self.client, _CLEANUP_S if exc[0] is not None else timeout_s(CONNECT_TIMEOUT_S))
            if self.cluster is not None:
                self.cluster.close()
        finally:
            self._restore_logs()

    def _restore_logs(self):
        from qgcli.signals import cli_handlers_installed

        if self._logs is not None and not cli_handlers_installed():  # the CLI keeps them silent to its exit
            for logger, level in self._logs:
                logger.setLevel(level)
        self._logs = None

    def threads(self):
        """The worker threads of the cluster now (and its worker count, for :meth:`describe`)."""
        workers = self._waited(self._on_loop(self.client.scheduler.ncores()), "the cluster's workers")
        self.workers = len(workers)
        return sum(int(n) for n in workers.values())

    def map(self, function, items, *shared, settle=False):
        """``function(*shared, item)`` of every item, on the workers, in order.  On an error (or a signal)
        the tasks are cancelled; with ``settle``, the call waits (a few seconds at most; at most
        :data:`_CLEANUP_S` after a signal) until none still runs, for tasks that write where the caller is
        about to clean up."""
        items = list(items)
        self.threads()
        started = time.perf_counter()
        keys = [f"qgcli-{getattr(function, '__name__', 'task')}-{time.monotonic_ns()}-{i}" for i in range(len(items))]
        futures = self.client.map(function, *[[s] * len(items) for s in shared], items, pure=False, key=keys)
        self.tasks += len(items)
        try:
            return self._gathered(futures)
        except BaseException:
            self.cancel(futures)
            if settle:  # a block still running would write into the store being removed
                from qgcli.signals import pending

                self._drain(set(keys), _CLEANUP_S if pending() is not None else 10.0)
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
            return self._gathered(future)
        finally:
            self.waited += time.perf_counter() - started

    def cancel(self, futures):
        """Cancel ``futures`` on the scheduler, waiting :data:`_CLEANUP_S` at most (a lost scheduler has
        nothing left to cancel)."""
        if futures and self.client.status == "running":
            try:
                self._on_loop(self.client.cancel(futures, asynchronous=True)).result(timeout=_CLEANUP_S)
            except Exception:  # noqa: BLE001 - best effort: the run is failing already
                pass

    def describe(self):
        return {"scheduler": self.client.scheduler.address, "workers": self.workers, "tasks": self.tasks,
                "wait_s": round(self.waited, 6)}

    # --- waiting, bounded and watched -----------------------------------------------------------------

    def _on_loop(self, coroutine):
        """A coroutine of the client run on its event loop: a concurrent future to wait for here."""
        import asyncio

        return asyncio.run_coroutine_threadsafe(coroutine, self.client.loop.asyncio_loop)

    def _gathered(self, futures):
        """The futures' results (in order, for a list), gathered on the client's loop and waited for by
        :meth:`_waited`; a task that killed its workers more often than Dask allows is a one-line error."""
        import distributed

        try:
            return self._waited(self._on_loop(self.client.gather(futures, asynchronous=True)), "the results")
        except distributed.KilledWorker as exc:
            raise RuntimeFailure(f"a task failed on every worker it was given ({exc.args[0] if exc.args else ''}); "
                                 "nothing was written") from None

    def _waited(self, future, what):
        """``future``'s result (a concurrent future of the client's loop), waited for in short steps: a
        pending signal is raised between two (:func:`qgcli.signals.raise_pending`: the wait may run while
        an HDF5 output is open, where signals are only recorded), and the cluster is probed every
        :data:`_PROBE_S` (:class:`_Probe`)."""
        import asyncio

        probe = _Probe(self, what)
        try:
            while True:
                raise_pending()
                try:
                    return future.result(timeout=_POLL_S)
                except concurrent.futures.TimeoutError:
                    probe.check()
                except (concurrent.futures.CancelledError, asyncio.CancelledError, OSError) as exc:
                    if self.client.status != "running":
                        raise self.lost() from None
                    if isinstance(exc, OSError):
                        raise
                    raise RuntimeFailure(f"--scheduler: the tasks were cancelled on the cluster at {self.address} "
                                         "(by another client?); nothing was written") from None
        finally:
            if not future.done():
                future.cancel()
            probe.close()

    def lost(self):
        """The error of a scheduler that went away (exit 1)."""
        return RuntimeFailure(f"--scheduler: lost the connection to the Dask scheduler at {self.address}; "
                              "nothing was written")

    def _drain(self, keys, timeout):
        """Wait (at most ``timeout`` s) until no worker still runs one of ``keys`` (cancelled tasks that had
        started run to their end)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.client.status == "running":
            try:
                processing = self._on_loop(self.client.scheduler.processing()).result(
                    timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - a scheduler gone or too slow: nothing more to wait for
                return
            if not keys & {k for ks in processing.values() for k in ks}:
                return
            time.sleep(_POLL_S)


class _Probe:
    """The health of a cluster while a wait runs: every :data:`_PROBE_S` it asks the scheduler for its
    workers (without blocking the wait); raises a one-line :class:`RuntimeFailure` when the scheduler is
    lost, has not answered for :data:`CONNECT_TIMEOUT_S`, or has had no worker for :data:`NO_WORKER_TIMEOUT_S`."""

    def __init__(self, cluster, what):
        self.cluster, self.what = cluster, what
        self.asked = self.answered = time.monotonic()
        self.workerless = None
        self.pending = None
        self.answer_s, self.worker_s = timeout_s(CONNECT_TIMEOUT_S), timeout_s(NO_WORKER_TIMEOUT_S)

    def check(self):
        now = time.monotonic()
        if self.cluster.client.status not in ("running", "connecting"):
            raise self.cluster.lost()
        if self.pending is None:
            if now - self.asked >= _PROBE_S:
                self.asked = now
                self.pending = self.cluster._on_loop(self.cluster.client.scheduler.ncores())
        elif self.pending.done():
            probe, self.pending = self.pending, None
            try:
                workers = probe.result()
            except Exception:  # noqa: BLE001 - the scheduler cannot be reached
                raise self.cluster.lost() from None
            self.answered = now
            if workers:
                self.workerless = None
            elif self.workerless is None:
                self.workerless = now
        if now - self.answered > self.answer_s:
            raise RuntimeFailure(f"--scheduler: the Dask scheduler at {self.cluster.address} has not answered for "
                                 f"{self.answer_s:g} s while waiting for {self.what}; nothing was written")
        if self.workerless is not None and now - self.workerless > self.worker_s:
            raise RuntimeFailure(f"--scheduler: the Dask cluster at {self.cluster.address} has had no worker for "
                                 f"{self.worker_s:g} s (the last one was lost), so its work cannot finish; "
                                 "nothing was written")

    def close(self):
        if self.pending is not None and not self.pending.done():
            self.pending.cancel()


def _silence_dask():
    """Silence Dask's loggers, each of them (their tracebacks would reach the user's stderr); returns what to
    restore.  ``QGCLI_DEBUG=1`` keeps them."""
    if os.environ.get("QGCLI_DEBUG"):
        return []
    try:
        import distributed  # noqa: F401 - its modules make their loggers at import
    except ImportError:
        return []
    names = [n for n in list(logging.root.manager.loggerDict) if n.split(".")[0] in _LOGGERS]
    saved = []
    for name in sorted(set(names) | set(_LOGGERS)):
        logger = logging.getLogger(name)
        saved.append((logger, logger.level))
        logger.setLevel(logging.CRITICAL + 1)
    return saved


def _closed(client, timeout):
    """Close ``client``, waiting ``timeout`` s at most (a lost scheduler is not waited for)."""
    if client is None:
        return
    try:
        client.close(timeout=timeout if client.status == "running" else min(timeout, _CLEANUP_S))
    except Exception:  # noqa: BLE001 - closing is best effort: the process ends anyway
        pass


def connect(scheduler):
    """``(client, cluster or None)``: a Client of the scheduler at ``scheduler``, or of a LocalCluster of N
    worker processes started for this command (``local`` / ``local:N``; N defaults to the CPU count, at most 4).

    A remote scheduler must complete Dask's handshake within :data:`CONNECT_TIMEOUT_S` (Dask's own timeout
    does not cover a listener that accepts and never answers): the client is made on a helper thread, waited
    for here (a signal still ends the wait at once), and abandoned when the time is up."""
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
            return distributed.Client(cluster, set_as_default=False), cluster
        except BaseException:
            cluster.close()
            raise
    limit = timeout_s(CONNECT_TIMEOUT_S)
    made = concurrent.futures.Future()

    def make():
        try:
            client = distributed.Client(scheduler, timeout=f"{limit}s", set_as_default=False)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            if made.set_running_or_notify_cancel():
                made.set_exception(exc)
            return
        if made.set_running_or_notify_cancel():
            made.set_result(client)
        else:  # too late: nobody waits for it any more
            _closed(client, _CLEANUP_S)

    threading.Thread(target=make, name="qgcli-dask-connect", daemon=True).start()
    deadline = time.monotonic() + limit
    try:
        while True:
            raise_pending()
            try:
                return made.result(timeout=min(_POLL_S, max(0.0, deadline - time.monotonic()))), None
            except concurrent.futures.TimeoutError:
                if time.monotonic() < deadline or not made.cancel():  # not cancelled: made just now
                    continue
                reason = "it did not complete Dask's handshake"
            except (OSError, TimeoutError, ValueError) as exc:
                reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            break
    except BaseException:
        made.cancel()
        raise
    # exit 1, not 2: the address may be right and the scheduler down (a runtime failure, not bad input)
    raise RuntimeFailure(f"--scheduler: no Dask scheduler answered at {scheduler} within "
                         f"{limit:g} s ({reason})") from None


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
