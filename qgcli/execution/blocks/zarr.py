"""The Zarr block source: a tensor computed in independent row blocks, here one after another or as tasks on a
Dask cluster (:mod:`qgcli.execution.cluster`).

A block is one chunk of the output along the first axis (the input's own chunking, at most ~16 MiB of
rows), so each block writes whole output chunks and no two share one: the workers write them straight into
the output store (a temporary store renamed into place by the client at the end; a task run twice, after a
worker died, writes the same bytes again).  Every block opens the input stores itself: only the block's
coordinates travel, never a tensor.  The math is the block driver's, as for HDF5: the leaf reduction
(:mod:`qgcli.execution.blocks.leaves`; each block sums the leaves that start in it, reading on into the next
chunk where one straddles it) and the two passes of bn-grad (:mod:`qgcli.execution.blocks.two_pass`; each
block sums the units that start in it).  The client adds the partial sums in plan order: bit for bit the
in-memory result, whatever the block size and the number of workers.

A block's ``work`` (a frozen dataclass, small: shipped with each task) names its inputs (``sources``:
operand -> (store, key)), the temporary output store (``output``) and its large array (``name``).
"""
import bisect
import dataclasses
import threading
import time
from dataclasses import dataclass

import numpy as np

from qgcli.errors import FileFormatError, OperandError, OptionError, OutputError
from qgcli.execution import memory
from qgcli.execution.blocks import leaves as leaf_reduction
from qgcli.execution.blocks import two_pass
from qgcli.jobs import large_operands_in
from qgcli.ops import batch_norm as bn, blocked
from qgcli.ops.analysis import add_nonfinite
from qgcli.report.text import counted
from qgcli.signals import raise_pending

_F32 = np.float32


# --- opening the stores (on a worker, or here) ----------------------------------------------------------

def open_array(source, *, mode="r"):
    """A zarr Array opened by its own metadata (the client checked it; a worker lists no group)."""
    import zarr

    from qgcli.storage.zarr_store import open_store

    path, key = source
    return zarr.open_array(store=open_store(path, read_only=mode == "r"), path=key or "", mode=mode)


_opened = {}  # this process's arrays of the run in progress, by its temporary output store (unique per run)
_opened_lock = threading.Lock()


def arrays_of(work):
    """The input arrays and the output array of ``work``, opened once per process and run: opening reads
    the array's metadata, which costs as much as reading a small chunk."""
    with _opened_lock:
        if _opened.get("run") != work.output:
            _opened.clear()
            _opened["inputs"] = {n: open_array(s) for n, s in work.sources.items()}
            _opened["output"] = open_array((work.output, work.name), mode="r+")
            _opened["run"] = work.output
        return _opened["inputs"], _opened["output"]


def _seconds(started, read, computed, written=None):
    return {"read": read - started, "compute": computed - read,
            "write": 0.0 if written is None else written - computed}


# --- the leaf reduction (fake-quant ops) ------------------------------------------------------------------

@dataclass(frozen=True)
class Work:
    """What every block of one fake-quant run shares."""

    sources: dict  # operand name -> (store path or URL, array key)
    output: str  # the temporary output store
    name: str  # its large array
    shape: tuple
    depth: int  # values per row: channels ("chip"), else 1
    gradient: bool
    bounds: tuple  # gradient: (lo, hi, passthrough); forward: (*grid params, passthrough)
    divide: bool = False
    flush: bool = False


@dataclass(frozen=True)
class Block:
    items: tuple  # [first, last) items of the first axis that this block writes
    leaves: tuple  # the reduction leaves (absolute (row, length)) that start in this block


def compute_block(work, block):
    """One block, on a worker or here: reads its rows from the input stores, writes its chunk of the output,
    returns ``{"sums": (below, above) leaf sums or None, "nonfinite": its inputs' [NaN, +inf, -inf],
    "seconds": {"read", "compute", "write"}}``."""
    started = time.perf_counter()
    per_item = int(np.prod(work.shape[1:], dtype=np.int64)) // max(work.depth, 1)
    i0, i1 = block.items
    r0, r1 = i0 * per_item, i1 * per_item
    end = r1 if not block.leaves else max(r1, block.leaves[-1][0] + block.leaves[-1][1])
    last = -(-end // per_item) if per_item else i1
    arrays, out = arrays_of(work)

    def rows(name):
        return np.ascontiguousarray(arrays[name][i0:last], dtype=_F32).reshape(-1, work.depth)

    x = rows("inputs")
    g = rows("gradients") if work.gradient else None
    read = time.perf_counter()
    nonfinite = add_nonfinite([0, 0, 0], x[: r1 - r0])  # this block's rows only, not those read on into the next
    sums = None
    if not work.gradient:
        # into the rows read (this block's own array): no second block-sized array to fault in
        dx = blocked.quantize(x, work.bounds, work.divide, work.flush, out=x if x.flags.writeable else None)
    else:  # rows before the first leaf starting here finish a leaf of an earlier block
        split = block.leaves[0][0] - r0 if block.leaves else 0
        dx, sums = leaf_reduction.gradient_rows(g, x, work.bounds, block.leaves, split=split)
    computed = time.perf_counter()
    out[i0:i1] = dx[: r1 - r0].reshape((i1 - i0, *work.shape[1:]))
    return {"sums": sums, "nonfinite": nonfinite, "seconds": _seconds(started, read, computed, time.perf_counter())}


def _leaf_run(setup, arrays, x, items):
    """``(dtype of the large output, run, note)`` of a fake-quant run in blocks of ``items`` first-axis items
    of ``x``: ``run(compute_all, sources, output store)`` -> ``(small outputs, block results, summary counts)``."""
    shape, kind, grid = tuple(x.shape), setup["kind"], setup["grid"]
    depth = shape[-1] if kind == "chip" else 1
    rows = int(np.prod(shape, dtype=np.int64)) // max(depth, 1)
    passthrough = grid.passthrough if grid.passthrough.any() else None
    gradient = setup["gradient"]
    plan = leaf_reduction.plan(rows, kind) if gradient else None
    if gradient:
        lo, hi = grid.mask_bounds()
        bounds, divide, flush = (lo, hi, passthrough), False, False
    else:
        params = [getattr(grid, n) for n in ("nudged_min", "nudged_max", "scale", "inv_scale", "quant_zero")]
        bounds, divide, flush = (*params, passthrough), setup["divide"], grid.needs_flush()
    blocks = [Block(*b) for b in leaf_reduction.assign(shape, depth, items, plan)]

    def run(compute_all, sources, output):
        work = Work(sources, output, setup["output"], shape, depth, gradient, bounds, divide, flush)
        results = compute_all(compute_block, work, blocks)
        sums = [r["sums"] for r in results if r["sums"] is not None]
        small = leaf_reduction.finish(plan, sums, passthrough, kind) if plan is not None else {}
        setup["nonfinite"] = [sum(r["nonfinite"][i] for r in results) for i in range(3)]
        return small, results, {}

    note = f"computed in {counted(len(blocks), 'block')} of {counted(items, 'row')} of the first axis"
    return _F32, run, note


# --- the two passes (bn-grad) ---------------------------------------------------------------------------

@dataclass(frozen=True)
class PassWork:
    """What every block of one bn-grad run shares."""

    sources: dict  # "x", "y_backprop" -> (store, key)
    output: str  # the temporary output store
    name: str  # its x_backprop array
    shape: tuple
    channels_first: bool
    mean: np.ndarray
    coefs: object = None  # pass 2: qgcli.ops.batch_norm.Coefficients
    out_dtype: np.dtype = None


@dataclass(frozen=True)
class PassBlock:
    items: tuple  # [first, last) items of the first axis this block writes (pass 2)
    units: tuple  # ((a0, a1), (b0, b1) or None): the sum units that start in this block (pass 1)


def _a_per_item(shape, channels_first):
    """Rows of A per item of the first axis ([A, C, B]: channels-last A is N*H*W, channels-first N)."""
    return 1 if channels_first else int(np.prod(shape[1:-1], dtype=np.int64))


def _read(arrays, name, i0, i1):
    from qgcli.storage.zarr_store import as_tagged

    node = arrays[name]
    return np.ascontiguousarray(bn.data_operand(as_tagged(node, np.asarray(node[i0:i1])), name, np))


def sums_block(work, block):
    """Pass 1, on a worker or here: the partial sums ``[units, 2, channels]`` of the units starting here."""
    started = time.perf_counter()
    arrays, _ = arrays_of(work)
    per = _a_per_item(work.shape, work.channels_first)
    i0 = block.items[0]
    end = max(a1 for (_, a1), _ in block.units)
    i1 = -(-end // per)
    dy, x = _read(arrays, "y_backprop", i0, i1), _read(arrays, "x", i0, i1)
    read = time.perf_counter()
    dy3, x3 = two_pass.as_acb(work.channels_first, dy, x)
    parts = []
    for (a0, a1), b in block.units:
        rows = slice(a0 - i0 * per, a1 - i0 * per)
        cols = slice(None) if b is None else slice(*b)
        parts.append(two_pass.sums(dy3[rows, :, cols], x3[rows, :, cols], work.mean))
    return {"parts": np.stack(parts), "seconds": _seconds(started, read, time.perf_counter())}


def dx_block(work, block):
    """Pass 2: this block's chunk of ``x_backprop``, written into the output store; returns
    ``{"nonfinite": its [NaN, +inf, -inf], "seconds": ...}``."""
    started = time.perf_counter()
    arrays, out = arrays_of(work)
    i0, i1 = block.items
    dy, x = _read(arrays, "y_backprop", i0, i1), _read(arrays, "x", i0, i1)
    read = time.perf_counter()
    dx = np.empty(x.shape, work.out_dtype)
    two_pass.x_backprop(dy, x, dx, work.coefs, work.channels_first)
    computed = time.perf_counter()
    out[i0:i1] = dx.view(np.uint16) if dx.dtype.name == "bfloat16" else dx
    return {"nonfinite": add_nonfinite([0, 0, 0], dx), "seconds": _seconds(started, read, computed,
                                                                           time.perf_counter())}


def _two_pass_run(setup, arrays, x, items):
    """As :func:`_leaf_run`, for bn-grad: pass 1 sums the units, pass 2 writes x_backprop."""
    checked = two_pass.checked(arrays["y_backprop"], x, setup["small_in"], epsilon=setup["epsilon"],
                               data_format=setup["data_format"], variance_kind=setup["variance_kind"])
    shape, channels_first = tuple(x.shape), checked.channels_first
    out_dtype = two_pass.output_dtype(x)
    acb = bn.acb_shape(shape, channels_first)
    per = _a_per_item(shape, channels_first)
    plan = bn.sum_units(acb, out_dtype)
    starts = [a0 for (a0, _), _ in plan]
    blocks = []
    for i0 in range(0, shape[0], items):
        i1 = min(shape[0], i0 + items)
        lo, hi = bisect.bisect_left(starts, i0 * per), bisect.bisect_left(starts, i1 * per)
        blocks.append(PassBlock((i0, i1), tuple(plan[lo:hi])))
    n = two_pass.values_per_channel(shape, channels_first)

    def run(compute_all, sources, output):
        work = PassWork(sources, output, "x_backprop", shape, channels_first, checked.mean)
        first = compute_all(sums_block, work, [b for b in blocks if b.units])
        total = np.zeros((2, checked.channels), np.float64)
        for result in first:
            for part in result["parts"]:
                two_pass.add(total, part)  # in unit order, from zero: as channel_sums adds them
        coefs = two_pass.coefficients(total, n, checked, is_training=setup["is_training"],
                                      variance_kind=setup["variance_kind"])
        second = compute_all(dx_block, dataclasses.replace(work, coefs=coefs, out_dtype=out_dtype), blocks)
        small = {**two_pass.small_outputs(coefs, n, checked.channels), **setup["extra_outputs"]}
        setup["nonfinite"] = [sum(r["nonfinite"][i] for r in second) for i in range(3)]
        return small, first + second, {"count": len(blocks), "passes": 2}

    note = f"computed in two passes of {counted(len(blocks), 'block')} of {counted(items, 'row')} of the first axis"
    return out_dtype, run, note


# --- the block formats (qgcli.families.block_rows) ----------------------------------------------------------

@dataclass(frozen=True)
class RowWork:
    """What every row block of one block-format run shares: the plan (``RowPlan``) with the inputs' sources."""

    sources: dict
    output: str  # the temporary output store
    name: str  # its first large array (the others: the plan's outputs)
    plan: object


def _rows_read(arrays, name, i0, i1):
    from qgcli.storage.zarr_store import as_tagged

    node = arrays[name]
    return np.asarray(as_tagged(node, np.asarray(node[i0:i1])))


def amax_block(work, block):
    """NVFP4's first pass, on a worker or here: ``max |x|`` of this block's rows."""
    started = time.perf_counter()
    arrays, _ = arrays_of(work)
    x = _rows_read(arrays, work.plan.x_name, *block.items)
    read = time.perf_counter()
    return {"amax": work.plan.amax(x), "seconds": _seconds(started, read, time.perf_counter())}


def row_block(work, block):
    """One row block of a block format, on a worker or here: every large output's rows written into its array."""
    started = time.perf_counter()
    plan = work.plan
    arrays, _ = arrays_of(work)
    with _opened_lock:
        outs = _opened.setdefault("outputs", {})
        for name in plan.outputs:
            if name not in outs:
                outs[name] = open_array((work.output, name), mode="r+")
    i0, i1 = block.items
    x = _rows_read(arrays, plan.x_name, i0, i1) if plan.needs_x else None
    g = _rows_read(arrays, "gradients", i0, i1) if plan.gradient else None
    read = time.perf_counter()
    blocks, _, counts = plan.compute(x, g, i0, i1)
    computed = time.perf_counter()
    for name, a in blocks.items():
        lo, hi = plan.output_rows(name, i0, i1)
        outs[name][lo:hi] = plan.stored(name, a)
    return {"counts": counts, "seconds": _seconds(started, read, computed, time.perf_counter())}


def _rows_run(setup, arrays, x, items):
    """As :func:`_leaf_run`, for the block formats: a row block per chunk of rows (a multiple of the block size
    along the first axis), NVFP4's amax pass first where it needs one."""
    plan0 = setup["plan"]
    shape = tuple(x.shape)
    blocks = [Block((i0, min(shape[0], i0 + items)), ()) for i0 in range(0, shape[0], items)]

    def run(compute_all, sources, output):
        plan, first = plan0, []
        if plan.amax_pass:
            first = compute_all(amax_block, RowWork(sources, output, setup["output"], plan), blocks)
            plan = plan.with_amax([r["amax"] for r in first])
        results = compute_all(row_block, RowWork(sources, output, setup["output"], plan), blocks)
        for r in results:
            for key, n in r["counts"].items():
                setup["counts"][key] = setup["counts"].get(key, 0) + n
        counts = {"count": len(blocks), "passes": 2} if first else {}
        return plan.small_outputs(), first + results, counts

    passes = "two passes of " if plan0.amax_pass else ""
    note = f"computed in {passes}{counted(len(blocks), 'block')} of {counted(items, 'row')} of the first axis"
    return _F32, run, note


# --- the run ---------------------------------------------------------------------------------------------

_RUNS = {"leaves": _leaf_run, "two-pass": _two_pass_run, "rows": _rows_run}


class BlockRun:
    """A job whose large operands are Zarr arrays, computed block by block (:meth:`execute`)."""

    def __init__(self, job, operands, runner, sources, arrays, budget):
        self.job, self.operands, self.runner = job, operands, runner
        self.sources, self.arrays, self.budget = sources, arrays, budget

    def execute(self, compute_all=None):
        """Check the output, plan the blocks, compute them (``compute_all(function, work, blocks)`` -> the
        results of ``function(work, block)`` in order; default: one after another here), add the partial
        sums, write; returns the summary."""
        from qgcli.storage import provenance, zarr_store

        job, out = self.job, self.job.output
        check_destination(job, self.operands)
        setup = self.runner.block_setup(job, self.operands, self.arrays)
        big = self.arrays[large_operands_in(job, self.operands)[-1]]
        shape = tuple(big.shape)
        per_item_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * 4)
        cap = max(1, min(zarr_store.CHUNK_BYTES, self.budget // 16) // per_item_bytes)
        items = max(1, min(int(big.chunks[0]), cap))
        plan = setup.get("plan")
        if plan is not None:  # a block format: whole quantization blocks along the first axis
            from qgcli.families.block_rows import check_rows_fit, row_bytes

            # as from HDF5 (blocks.hdf5.row_blocks): the block's outputs kept while they compress
            check_rows_fit(plan, self.budget, row_bytes(plan, "gradients" in self.arrays) *
                           (3 if out.compression else 2))
            items = -(-items // plan.align) * plan.align
        dtype, run, note = _RUNS[setup["blocks"]](setup, self.arrays, big, items)
        attrs = provenance.attributes(setup["attrs"])
        with zarr_store.staged(out.destination) as stage:
            stage.group.attrs.update(zarr_store.json_attrs(attrs))
            outputs = {setup["output"]: (shape, dtype, 1)} if plan is None else plan.outputs
            for name, (oshape, odtype, div) in outputs.items():  # each block writes whole chunks of each
                zarr_store.create_array(stage.group, name, oshape, np.dtype(odtype), attrs=attrs,
                                        compression=out.compression, chunks=(max(1, items // div), *oshape[1:]))
            started = time.perf_counter()
            small, results, counts = run(compute_all or here, self.sources, stage.path)
            elapsed = time.perf_counter() - started
            for key, value in small.items():
                zarr_store.put(stage.group, key, value, attrs=attrs, compression=out.compression)
        summary = self.runner.block_summary(job, self.operands, self.arrays, setup, small, [
            f"{note}; {setup['not_computed']} are not computed in this mode"])
        summary["blocks"] = {**timing(results, items, elapsed), **counts}
        return summary


def plan_for(job, operands, runner, locations):
    """A :class:`BlockRun` when the job's large operands, all Zarr arrays (``locations``:
    :func:`qgcli.storage.zarr_store.locations`), must be computed in blocks (``--scheduler``, or more than the
    memory budget by :mod:`qgcli.execution.memory`'s rule); None otherwise (the job runs as before)."""
    from qgcli.storage import zarr_store

    budget = memory.parse_memory_limit(job.output.memory_limit)
    arrays, sources = {}, {}
    for name, (path, key) in locations.items():
        try:
            container = zarr_store.ZarrContainer.open(path)
            if key is None and container.has(name):
                key = name
            arrays[name] = container.array(key)
        except FileFormatError as exc:
            raise OperandError(str(exc), operand=name) from None
        sources[name] = (path, key)
        operands.sources.setdefault(name, f"{path}:{key}" if key else path)
    if job.output.scheduler is None and memory.need(memory.sizes(arrays.values())) <= budget:
        return None
    if not hasattr(runner, "block_setup"):
        raise OptionError(f"computes TensorFlow's fake-quant ops, bn-grad and the block formats on Zarr tensors in "
                          f"blocks; {runner.mode(job)} reads its Zarr operands whole (drop --scheduler, or raise "
                          "--memory-limit)",
                          param_hint="'--scheduler'" if job.output.scheduler else "'--memory-limit'")
    if job.output.device != "cpu":
        raise OptionError("a tensor computed in blocks runs on the CPU", param_hint="'--device'")
    first = arrays[large_operands_in(job, operands)[-1]]
    if not first.shape or not first.size:
        return None  # nothing to cut into blocks
    return BlockRun(job, operands, runner, sources, arrays, budget)


def check_destination(job, operands):
    """Refuse what a run in blocks cannot write (a figure, any output but a Zarr store) before any work."""
    from qgcli.storage import io
    from qgcli.storage import zarr_store

    out = job.output
    if out.plot:
        raise OptionError("cannot draw a figure of a tensor computed in blocks; drop --plot", param_hint="'--plot'")
    if out.destination == "-" or io.output_kind(out.destination) != "zarr":
        raise OutputError("a tensor computed in blocks is written chunk by chunk into a Zarr store: "
                          "use -o OUT.zarr", operand="--output")
    io.check_output(out.destination, inputs=operands.input_paths(), force=out.force)
    zarr_store.codecs(out.compression)


def timing(results, items, elapsed):
    """The summary's ``blocks``: how many, their rows, the wall time and the seconds the blocks spent
    reading, computing and writing (summed over blocks: worker time)."""
    seconds = {k: round(sum(r["seconds"][k] for r in results), 6) for k in ("read", "compute", "write")}
    return {"count": len(results), "items": items, "wall_s": round(elapsed, 6), "seconds": seconds}


def here(function, work, blocks):
    """``function(work, block)`` for each block, one after another in this process."""
    results = []
    for block in blocks:
        raise_pending()
        results.append(function(work, block))
    return results
