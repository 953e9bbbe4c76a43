"""One figure per layer of a run file (``qgcli plot staircase|ste|hist|channels RUN -o DIR/``).

:func:`plan` lists the groups a plot can draw (TensorFlow fake-quant groups; the groups of a family with
``plot_data``, PyTorch's and torchao's, on their own framework's grid; QuantizeV2's round trip for
staircase and ste; block formats per block, their staircase and ste on the element grid; ``channels``:
the per-channel ones) as picklable :class:`LayerFigure` tasks, with each group's attributes unless an option
was typed, and the groups it cannot draw with the reason.  :func:`draw` draws one (in this process);
:func:`write_all` draws them all into ``DIR/``, on worker processes (``spawn``/``forkserver``, never a plain fork of this
possibly threaded process) when there are enough, and names each file after its group path through
:func:`qgcli.storage.paths.group_file_paths` (``index.json`` beside them when a name had to change).  The figures
go to a hidden staging folder first, so ``DIR`` gets every figure or none.
"""
import multiprocessing
import os
import signal
import sys
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Optional, Tuple

from qgcli.errors import FileFormatError, OutputError, QgcliError
from qgcli.families import groups, registry
from qgcli.families.tf_fake_quant import load_fake_quant_operands
from qgcli.report.layers import _attr, plain
from qgcli.signals import raise_pending
from qgcli.storage import runfile
from qgcli.storage.figures import save_figure
from qgcli.storage.operands import Operands
from qgcli.storage.paths import group_file_paths

#: Plots that draw one layer, and the layers they take.
KINDS = ("staircase", "ste", "hist", "channels")
#: Below this many figures the worker processes' start-up (about a second) costs more than it saves.
MIN_PARALLEL = 4


class WorkerFailed(RuntimeError):
    """A worker process died (a runtime failure, not bad input)."""


@dataclass(frozen=True)
class LayerFigure:
    """One figure to draw: the group, its attributes as resolved, and the plot's own keyword arguments."""

    file: str
    path: str  # the group's path in the file
    op: Optional[str]
    kind: str
    variant: str
    num_bits: int
    narrow_range: bool
    axis: int
    literals: Tuple[Tuple[str, str], ...] = ()
    options: Tuple[Tuple[str, object], ...] = ()  # max_points, channel, bins, log, title, width, height
    family: Optional[str] = None  # a block format's (drawn per block), a family drawn on its own grid, or None
    formats: Tuple[Tuple[str, object], ...] = ()  # the block format's attributes, from the group
    setup: Tuple[Tuple[str, object], ...] = ()  # a family on its own grid: its plot_setup (attributes resolved)


def plan(target, kind, options=None, *, plot_options=(), layer=None):
    """``(tasks, skipped)`` for the run file ``target`` (``run.h5`` or ``run.h5:group``): a
    :class:`LayerFigure` per group ``kind`` can draw, and ``{"path", "op", "reason"}`` for the others.
    ``options``: attribute options typed on the command line (they override the groups' attributes);
    ``layer``: only the group of that path (relative to ``target``), an error when it cannot be drawn."""
    from qgcli.storage import io

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    options = dict(options or {})
    split = runfile.split_target(target)
    if split is None:
        raise QgcliError(f"{target} is not an HDF5 run file", operand="BUNDLE")
    file, group = split
    if layer is not None:
        group = "/".join(p for p in ((group or ""), layer.strip("/")) if p)
    try:
        container = io.Container.open(file)
    except FileFormatError as exc:
        raise QgcliError(str(exc), operand="BUNDLE") from None
    try:
        found = groups.discover(container._opened(), group, label=file)
    finally:
        container.close()
    if layer is not None:
        found = [l for l in found if l.path == group]
        if not found:
            raise QgcliError(f"{file}: {group!r} is not a group holding a quantizer's operands", operand="--layer")
    tasks, skipped = [], []
    for l in found:
        reason = _why_not(l, kind) or groups.validate(l, "report")
        if reason is not None:
            if layer is not None:
                raise QgcliError(f"{l.path}: {reason}", operand="--layer")
            skipped.append({"path": l.path, "op": l.op, "reason": reason})
            continue
        family = registry.of(l)
        if hasattr(family, "block_view"):
            tasks.append(LayerFigure(file=file, path=l.path, op=l.op, kind=kind, variant="", num_bits=0,
                                     narrow_range=False, axis=-1, options=tuple(dict(plot_options).items()),
                                     family=l.family, formats=tuple(family.group_formats(l.attrs).items())))
            continue
        if hasattr(family, "plot_data"):  # another framework's grid, computed by its family at draw time
            tasks.append(LayerFigure(file=file, path=l.path, op=l.op, kind=kind, variant="", num_bits=0,
                                     narrow_range=False, axis=-1, options=tuple(dict(plot_options).items()),
                                     family=l.family,
                                     formats=tuple({**{k: plain(v) for k, v in l.attrs.items()}, **options}.items())))
            continue
        if hasattr(family, "plot_setup"):  # a family drawn on its own grid (PyTorch's, QuantizeV2's)
            tasks.append(LayerFigure(
                file=file, path=l.path, op=l.op, kind=kind, variant="", num_bits=8, narrow_range=False, axis=-1,
                literals=tuple(groups.literal_specs(l).items()), options=tuple(dict(plot_options).items()),
                family=family.NAME, setup=tuple(family.plot_setup(lambda name, default: _attr(
                    l, options, name, default)).items())))
            continue
        variant = l.variant or "vars"
        tasks.append(LayerFigure(
            file=file, path=l.path, op=l.op, kind=kind, variant=variant,
            num_bits=int(_attr(l, options, "num_bits", 8)), narrow_range=bool(_attr(l, options, "narrow_range", False)),
            axis=int(_attr(l, options, "axis", -1)) if variant == "per-channel" or options.get("axis") is not None
            else -1,
            literals=tuple(groups.literal_specs(l).items()), options=tuple(dict(plot_options).items())))
    return tasks, skipped


def _why_not(layer, kind):
    if layer.error is not None:
        return layer.error
    if hasattr(registry.of(layer), "block_view"):  # every kind, on the element grid (per block)
        return None
    if hasattr(registry.of(layer), "plot_data"):
        return registry.of(layer).plot_problem(layer, kind)
    kinds = getattr(registry.of(layer), "PLOT_KINDS", None)
    if kinds is not None:  # a family drawn on its own grid: staircase and ste
        return None if kind in kinds else (f"plot {kind} draws TensorFlow's fake-quant grids; {layer.op} groups: "
                                           f"plot {' / '.join(kinds)}")
    if not getattr(registry.of(layer), "CHANNEL_ANALYSIS", False):
        if layer.kind == registry.FAKE_QUANT:
            return f"plot {kind} does not draw {layer.op} groups yet (report, fakequant and fakequant-grad run them)"
        return (f"{layer.op or 'this group'} is not one of the fake-quant ops plot {kind} draws (TensorFlow's, "
                "PyTorch's, QuantizeV2)")
    if kind == "channels" and layer.variant != "per-channel":
        return "plot channels draws per-channel groups only"
    return None


_CONTAINERS = {}  # file -> open io.Container, kept open in a worker process for its next figures
_IN_WORKER = []


def _container(file):
    from qgcli.storage import io

    if not _IN_WORKER:  # this process: opened per figure, so that a file changed meanwhile is read afresh
        return io.Container.open(file)
    container = _CONTAINERS.get(file)
    if container is None:
        container = _CONTAINERS[file] = io.Container.open(file)
    return container


def draw(task):
    """The Figure of one :class:`LayerFigure` (exactly what ``qgcli plot KIND`` draws for the group as one
    bundle, with its gradients where the plot draws them); its title names the group unless one was given."""
    from qgcli.report import plots

    container = _container(task.file)
    family = None if task.family is None else registry.family(task.family)
    if hasattr(family, "plot_data"):
        return _draw_level_grid(task, container)
    if hasattr(family, "block_view"):
        return _draw_blocks(task, container)
    literal_ok = getattr(family, "LITERAL_OK", ("min", "max"))
    operands = Operands.in_group(container, task.file, task.path, dict(task.literals), literal_ok=literal_ok)
    try:
        if family is not None:
            x, mn, mx, own = family.plot_operands(operands, dict(task.setup))
        else:
            _, x, mn, mx, variant = load_fake_quant_operands(operands, task.variant, with_gradients=False)
            own = {"variant": variant}
        g = operands.get("gradients", required=False) if task.kind in ("ste", "channels") else None
    finally:
        operands.close()
        if not _IN_WORKER:
            container.close()
    kw = dict(task.options)
    common = dict(num_bits=task.num_bits, narrow_range=task.narrow_range, axis=task.axis, title=kw.get("title"))
    # Only the sizes given: each plot has its own default height (None would reach matplotlib as a size).
    common.update({k: kw[k] for k in ("width", "height") if kw.get(k) is not None})
    if task.kind == "channels":
        fig = plots.channels(x, mn, mx, gradients=g, **common)
    else:
        common.update(channel=kw.get("channel"), **own)
        if task.kind == "hist":
            fig = plots.hist(x, mn, mx, bins=kw.get("bins", 100), log=kw.get("log", False), **common)
        elif task.kind == "ste":
            fig = plots.ste(x, mn, mx, gradients=g, max_points=kw.get("max_points", plots.DEFAULT_MAX_POINTS),
                            **common)
        else:
            fig = plots.staircase(x, mn, mx, max_points=kw.get("max_points", plots.DEFAULT_MAX_POINTS), **common)
    if kw.get("title") is None:
        fig.suptitle(task.path, fontsize=8)
    fig.qgcli_summary = {**fig.qgcli_summary, "path": task.path, "group_op": task.op}
    return fig


def _draw_level_grid(task, container):
    """The Figure of a group on its own framework's integer grid (PyTorch's scale/zero_point, torchao's blocks):
    the numbers from the family's :func:`plot_data`, drawn by the same plots as TensorFlow's."""
    from qgcli.report import plots

    family = registry.family(task.family)
    attrs = dict(task.formats)  # the group's attributes, the options typed over them
    operands = Operands.in_group(container, task.file, task.path, {}, literal_ok=family.LITERAL_OK)
    try:
        d = family.plot_data(attrs, operands, with_gradients=task.kind in ("ste", "channels"))
    finally:
        operands.close()
        if not _IN_WORKER:
            container.close()
    data = plots.level_data(d.pop("op"), plots.LevelGrid(**d.pop("grid")), **d)
    kw = dict(task.options)
    common = dict(title=kw.get("title"), **{k: kw[k] for k in ("width", "height") if kw.get(k) is not None})
    if task.kind == "channels":
        fig = plots.level_channels(data, **common)
    elif task.kind == "hist":
        fig = plots.hist(None, data=data, bins=kw.get("bins", 100), log=kw.get("log", False),
                         channel=kw.get("channel"), **common)
    else:
        draw = plots.ste if task.kind == "ste" else plots.staircase
        fig = draw(None, data=data, channel=kw.get("channel"),
                   max_points=kw.get("max_points", plots.DEFAULT_MAX_POINTS), **common)
    if kw.get("title") is None:
        fig.suptitle(task.path, fontsize=8)
    fig.qgcli_summary = {**fig.qgcli_summary, "path": task.path, "group_op": task.op}
    return fig


def _draw_blocks(task, container):
    """The Figure of a block-format group, per block (:mod:`qgcli.report.block_plots`)."""
    import numpy as np

    from qgcli.report import block_plots

    family = registry.family(task.family)
    operands = Operands.in_group(container, task.file, task.path, {}, literal_ok=family.LITERAL_OK)
    try:
        view = family.block_view(dict(task.formats), operands)
        g = operands.get("gradients", required=False) if task.kind == "ste" else None
    finally:
        operands.close()
        if not _IN_WORKER:
            container.close()
    kw = dict(task.options)
    sizes = {k: kw[k] for k in ("width", "height") if kw.get(k) is not None}
    if task.kind == "hist":
        fig = block_plots.hist(view, bins=kw.get("bins", 100), log=kw.get("log", False), channel=kw.get("channel"),
                               title=kw.get("title"), **sizes)
    elif task.kind in ("staircase", "ste"):
        common = dict(channel=kw.get("channel"), max_points=kw.get("max_points", block_plots.DEFAULT_MAX_POINTS),
                      title=kw.get("title"), **sizes)
        fig = (block_plots.ste(view, gradients=None if g is None else np.asarray(g), **common) if task.kind == "ste"
               else block_plots.staircase(view, **common))
    else:
        fig = block_plots.channels(view, title=kw.get("title"), **sizes)
    if kw.get("title") is None:
        own = getattr(fig, "_suptitle", None)  # channels' own title (the format, the block statistics) below
        fig.suptitle(task.path + (f"\n{own.get_text()}" if own is not None else ""), fontsize=8)
    fig.qgcli_summary = {**fig.qgcli_summary, "path": task.path, "group_op": task.op}
    return fig


def _draw_to(task, target, dpi, fmt):
    """Worker: draw ``task`` and save it to ``target``; its summary (plain data, so it crosses processes)."""
    fig = draw(task)
    save_figure(fig, target, dpi=dpi, format=fmt)
    w, h = (float(v) for v in fig.get_size_inches())
    return {**fig.qgcli_summary, "size_in": [w, h]}


def _worker_init():
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent answers Ctrl-C and ends the workers
    _IN_WORKER.append(True)


def workers(n, jobs=None):
    """Worker processes for ``n`` figures: ``jobs`` or every core this process may use, none below
    :data:`MIN_PARALLEL` figures."""
    if jobs is None:
        try:
            jobs = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            jobs = os.cpu_count() or 1
    return 0 if n < MIN_PARALLEL or jobs < 2 else min(jobs, n)


def write_all(tasks, directory, *, dpi=100, fmt="png", force=False, jobs=None, on_done=None):
    """Draw every task into ``directory`` (one file per group, named by :func:`qgcli.storage.paths.group_file_paths`);
    returns ``(summaries in task order, index.json path or None, workers used)``."""
    from qgcli.storage import atomic
    from qgcli.storage import directory as directory_format

    layout = group_file_paths([t.path for t in tasks], suffix="." + fmt)
    directory = os.path.abspath(directory.rstrip("/") or directory)
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise OutputError(f"{directory} is a file, not a directory", operand="--output")
    if os.path.isdir(directory) and os.listdir(directory) and not force:
        raise OutputError(f"{directory} exists and is not empty; use --force to write into it", operand="--output")
    if os.path.islink(directory) and os.path.isdir(directory):
        directory = os.path.realpath(directory)  # the directory a link names is replaced, not the link
    existed = os.path.isdir(directory)
    made = []
    staging = atomic.new_temp_dir(os.path.dirname(directory), made)
    try:
        targets = [layout.target(staging, t.path) for t in tasks]
        for target in targets:
            os.makedirs(os.path.dirname(target), exist_ok=True)
        n = workers(len(tasks), jobs)
        summaries = _draw_all(tasks, targets, dpi, fmt, n, on_done)
        index = directory_format.write_index(staging, layout)
        for rel in [layout[t.path] for t in tasks] + ([os.path.basename(index)] if index else []):
            old = os.path.join(directory, *rel.split("/"))
            if existed and os.path.isdir(old) and not os.path.islink(old):
                raise OutputError(f"{old} is a directory", operand="--output")
        if not existed:
            os.chmod(staging, 0o777 & ~atomic.umask())
        # One step: a new DIR only if still absent; an existing one (empty, or --force) swapped with the new,
        # which keeps its other files.
        atomic.commit_directory(staging, directory, replace=force, merge=True)
        made.clear()
        for s, t in zip(summaries, tasks):
            s["file"] = os.path.join(directory, *layout[t.path].split("/"))
        return summaries, (os.path.join(directory, os.path.basename(index)) if index else None), n
    finally:
        for tmpdir in made:
            atomic.discard_directory(tmpdir)


def _named(task, call):
    """``call()``; a QgcliError from it names the group."""
    try:
        return call()
    except QgcliError as exc:
        raise QgcliError(f"{task.path}: {exc}; no figure was written") from None


class _main_module_hidden:
    """The workers need nothing from ``__main__``: hide it while they start, so that a spawned worker does not
    re-run the caller's script (a library caller without ``if __name__ == "__main__"``, ``python -`` or
    ``python -c``, whose "script" cannot be found)."""

    def __enter__(self):
        self.main = sys.modules.get("__main__")
        self.saved = {k: self.main.__dict__[k] for k in ("__spec__", "__file__") if k in self.main.__dict__}
        for key in self.saved:
            setattr(self.main, key, None) if key == "__spec__" else delattr(self.main, key)

    def __exit__(self, *exc):
        for key, value in self.saved.items():
            setattr(self.main, key, value)


def _draw_all(tasks, targets, dpi, fmt, n, on_done):
    if n == 0:
        out = []
        for task, target in zip(tasks, targets):
            raise_pending()
            out.append(_named(task, lambda: _draw_to(task, target, dpi, fmt)))
            if on_done is not None:
                on_done(task)
        return out

    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    pool = ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context(method),
                               initializer=_worker_init)
    done_all = False
    try:
        with _main_module_hidden():  # the workers start on the first submit
            futures = {pool.submit(_draw_to, task, target, dpi, fmt): i
                       for i, (task, target) in enumerate(zip(tasks, targets))}
        out = [None] * len(tasks)
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
            raise_pending()
            for future in done:
                i = futures[future]
                try:
                    out[i] = _named(tasks[i], future.result)
                except BrokenProcessPool:
                    raise_pending()  # killed by the signal this process got too: that one ends the command
                    raise WorkerFailed("a worker process drawing the figures ended unexpectedly (killed, or out "
                                       "of memory); no figure was written") from None
                if on_done is not None:
                    on_done(tasks[i])
        done_all = True
        return out
    finally:
        if not done_all:  # an error or a signal: stop the workers now, not after their queue
            for process in list(getattr(pool, "_processes", {}).values()):
                process.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
