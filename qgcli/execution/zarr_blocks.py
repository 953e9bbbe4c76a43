"""A Zarr tensor computed in row blocks: here block after block, or as tasks on a Dask cluster.

TensorFlow's fake-quant ops (forward and gradient) over Zarr arrays larger than the memory budget, or any
size under ``--scheduler``.  A block is one chunk of the output along the first axis (the input's own
chunking, at most ~16 MiB of rows), so each block writes whole output chunks and no two share one: the
workers write them straight into the output store (a temporary store renamed into place by the client at
the end; a task run twice, after a worker died, writes the same bytes again).  Every block opens the input
stores itself: only the block's coordinates travel, never a tensor.

``backprop_wrt_min/max`` keep Eigen's summation order as the streaming executor does
(:mod:`qgcli.execution.streaming`): the rows are planned once, on the client, as the leaves of TensorFlow's reduction
tree (:func:`qgcli.ops.reduction.plan`); each leaf is summed by the block in which it starts (reading on
into the next chunk when it straddles one) with the same kernel (:func:`qgcli.ops.blocked.backprop_rows`),
and the client adds the leaf sums along the plan (:func:`qgcli.ops.blocked.finish_sums`): bit for bit the
in-memory result, whatever the block size and the number of workers.
"""
import time
from dataclasses import dataclass

from qgcli.errors import OptionError
import numpy as np

from qgcli.execution import block_runs

_F32 = np.float32


@dataclass(frozen=True)
class Work:
    """What every block of one run shares (small: shipped with each task)."""

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
    returns ``{"sums": (below, above) leaf sums or None, "seconds": {"read", "compute", "write"}}``."""
    from qgcli.ops import blocked

    started = time.perf_counter()
    per_item = int(np.prod(work.shape[1:], dtype=np.int64)) // max(work.depth, 1)
    i0, i1 = block.items
    r0, r1 = i0 * per_item, i1 * per_item
    end = r1 if not block.leaves else max(r1, block.leaves[-1][0] + block.leaves[-1][1])
    last = -(-end // per_item) if per_item else i1
    arrays, out = block_runs.arrays_of(work)

    def rows(name):
        return np.ascontiguousarray(arrays[name][i0:last], dtype=_F32).reshape(-1, work.depth)

    x = rows("inputs")
    g = rows("gradients") if work.gradient else None
    read = time.perf_counter()
    sums = None
    if not work.gradient:
        dx = blocked.quantize(x, work.bounds, work.divide, work.flush)
    elif not block.leaves:  # no sums, or every row here belongs to a leaf that started in an earlier block
        dx = blocked.backprop_rows(g, x, *work.bounds)[0]
    else:
        split = block.leaves[0][0] - r0  # rows before it finish a leaf of an earlier block
        head = blocked.backprop_rows(g[:split], x[:split], *work.bounds)[0]
        tail, below, above = blocked.backprop_rows(g[split:], x[split:], *work.bounds, leaves=block.leaves)
        dx, sums = np.concatenate([head, tail]), (below, above)
    computed = time.perf_counter()
    out[i0:i1] = dx[: r1 - r0].reshape((i1 - i0, *work.shape[1:]))
    written = time.perf_counter()
    return {"sums": sums, "seconds": {"read": read - started, "compute": computed - read, "write": written - computed}}


def blocks_of(shape, depth, items_per_block, plan):
    """The blocks of a tensor: ``items_per_block`` first-axis items each, with the plan's leaves (None: no
    sums) given to the block in which each starts."""
    import bisect

    per_item = int(np.prod(shape[1:], dtype=np.int64)) // max(depth, 1)
    starts = [leaf[0] for leaf in plan.leaves] if plan is not None else []
    blocks = []
    for i0 in range(0, shape[0], items_per_block):
        i1 = min(shape[0], i0 + items_per_block)
        a, b = bisect.bisect_left(starts, i0 * per_item), bisect.bisect_left(starts, i1 * per_item)
        blocks.append(Block((i0, i1), tuple(plan.leaves[a:b]) if plan is not None else ()))
    return blocks


class BlockRun:
    """A job whose large operands are Zarr arrays, computed block by block (:meth:`execute`)."""

    def __init__(self, job, operands, runner, sources, arrays, budget):
        self.job, self.operands, self.runner = job, operands, runner
        self.sources, self.arrays, self.budget = sources, arrays, budget

    def execute(self, compute_all=None):
        """Check the output, plan the blocks, compute them (``compute_all(function, work, blocks)`` -> the
        results of ``function(work, block)`` in order; default: one after another here), add the leaf sums,
        write; returns the summary."""
        from qgcli.storage import provenance, zarr_store
        from qgcli.ops import blocked, reduction

        job, out = self.job, self.job.output
        block_runs.check_destination(job, self.operands)
        setup = self.runner.block_setup(job, self.operands, self.arrays)
        x = self.arrays["inputs"]
        shape, kind, grid = tuple(x.shape), setup["kind"], setup["grid"]
        depth = shape[-1] if kind == "chip" else 1
        rows = int(np.prod(shape, dtype=np.int64)) // max(depth, 1)
        per_item_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * 4)
        cap = max(1, min(zarr_store.CHUNK_BYTES, self.budget // 16) // per_item_bytes)
        items = max(1, min(int(x.chunks[0]), cap))
        passthrough = grid.passthrough if grid.passthrough.any() else None
        gradient = job.with_gradients
        plan = reduction.plan(rows, kind=kind) if gradient and kind is not None else None
        if gradient:
            lo, hi = grid.mask_bounds()
            bounds, divide, flush = (lo, hi, passthrough), False, False
        else:
            params = [getattr(grid, n) for n in ("nudged_min", "nudged_max", "scale", "inv_scale", "quant_zero")]
            bounds, divide, flush = (*params, passthrough), setup["divide"], grid.needs_flush()
        attrs = provenance.attributes(setup["attrs"])
        name = self.runner.big_output(job, setup["variant"])
        blocks = blocks_of(shape, depth, items, plan)
        small = {}
        with zarr_store.staged(out.destination) as stage:
            stage.group.attrs.update(zarr_store.json_attrs(attrs))
            zarr_store.create_array(stage.group, name, shape, _F32, attrs=attrs, compression=out.compression,
                                    chunks=(items, *shape[1:]))
            work = Work(self.sources, stage.path, name, shape, depth, gradient, bounds, divide, flush)
            started = time.perf_counter()
            results = (compute_all or block_runs.here)(compute_block, work, blocks)
            elapsed = time.perf_counter() - started
            if plan is not None:
                below = np.concatenate([r["sums"][0] for r in results if r["sums"] is not None])
                above = np.concatenate([r["sums"][1] for r in results if r["sums"] is not None])
                dmin, dmax = blocked.finish_sums(plan, below, above, passthrough)
                if kind == "flat":
                    dmin, dmax = dmin.reshape(()), dmax.reshape(())
                small = {"backprop_wrt_min": dmin, "backprop_wrt_max": dmax}
            for key, value in small.items():
                zarr_store.put(stage.group, key, value, attrs=attrs, compression=out.compression)
        summary = self.runner.block_summary(job, self.operands, self.arrays, setup, small, [
            f"computed in {len(blocks)} blocks of {items} rows of the first axis; clipping statistics are not "
            "computed in this mode"])
        summary["blocks"] = block_runs.timing(results, items, elapsed)
        return summary


def plan_for(job, operands, runner, locations):
    """A :class:`BlockRun` when the job's large operands, all Zarr arrays (``locations``:
    :func:`qgcli.storage.zarr_store.locations`), must be computed in blocks (``--scheduler``, or more than the memory
    budget); None otherwise (the job runs as before)."""
    from qgcli.execution import streaming
    from qgcli.storage import zarr_store
    from qgcli.errors import FileFormatError, OperandError
    from qgcli.jobs import BATCH_NORM

    budget = streaming.parse_memory_limit(job.output.memory_limit)
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
    need = sum(int(a.size) * max(a.dtype.itemsize, 4) for a in arrays.values()) * 2
    if job.output.scheduler is None and need <= budget:
        return None
    if not hasattr(runner, "block_setup"):
        raise OptionError(f"computes TensorFlow's fake-quant ops and bn-grad on Zarr tensors in blocks; "
                                 f"{job.mode} reads its Zarr operands whole (drop --scheduler, or raise "
                                 "--memory-limit)",
                                 param_hint="'--scheduler'" if job.output.scheduler else "'--memory-limit'")
    if job.output.device != "cpu":
        raise OptionError("a tensor computed in blocks runs on the CPU", param_hint="'--device'")
    first = arrays[job.large_operands[-1]]
    if not first.shape or not first.size:
        return None  # nothing to cut into blocks
    if job.family == BATCH_NORM:
        from qgcli.execution.zarr_batch_norm import BatchNormBlockRun

        return BatchNormBlockRun(job, operands, runner, sources, arrays, budget)
    return BlockRun(job, operands, runner, sources, arrays, budget)
