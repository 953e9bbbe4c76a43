"""bn-grad on Zarr tensors in row blocks, in two passes (here, or as tasks on a Dask cluster).

Pass 1 gives the per-channel float64 sums ``sum(dy)`` and ``sum(dy * (x - mean))``; pass 2 writes
``x_backprop`` chunk by chunk from the coefficients.  In memory (:func:`qgcli.ops.batch_norm._channel_sums`)
the sums are cut into *units* (the compiled kernels' chunks of [A, C, B], or NumPy's blocks) whose partial
sums are added in order; here each unit is summed by the block in which it starts (reading on into the
next chunk when it straddles one), with the same function on the same values, and the client adds the
partials in the same order.  So the sums, and with them every output, are the in-memory run's bit for bit
(``x_backprop`` is element-wise once the coefficients are known).
"""
import time
from dataclasses import dataclass

import numpy as np

from qgcli.execution.block_runs import arrays_of, check_destination, here, timing


@dataclass(frozen=True)
class Work:
    sources: dict  # "x", "y_backprop" -> (store, key)
    output: str  # the temporary output store
    name: str  # its x_backprop array
    shape: tuple
    channels_first: bool
    mean: np.ndarray
    coefs: object = None  # pass 2: qgcli.ops.batch_norm.Coefficients
    out_dtype: np.dtype = None


@dataclass(frozen=True)
class Block:
    items: tuple  # [first, last) items of the first axis this block writes (pass 2)
    units: tuple  # ((a0, a1), (b0, b1) or None): the sum units that start in this block (pass 1)


def _acb(shape, channels_first):
    from qgcli.ops import batch_norm as bn

    return bn._acb_shape(shape, channels_first)


def _a_per_item(work):
    """Rows of A per item of the first axis ([A, C, B]: channels-last A is N*H*W, channels-first N)."""
    return 1 if work.channels_first else int(np.prod(work.shape[1:-1], dtype=np.int64))


def _read(arrays, name, i0, i1):
    from qgcli.ops import batch_norm as bn
    from qgcli.storage.zarr_store import as_tagged

    node = arrays[name]
    return np.ascontiguousarray(bn._data_operand(as_tagged(node, np.asarray(node[i0:i1])), name, np))


def units(shape, channels_first, dtype):
    """The units of :func:`qgcli.ops.batch_norm._channel_sums` on a tensor of this shape and dtype, in the
    order their sums are added: ``((a0, a1), (b0, b1) or None)``."""
    from qgcli.ops import batch_norm as bn
    from qgcli.ops import native

    acb = _acb(shape, channels_first)
    probe = np.empty((1,), dtype)
    if native.for_arrays(np, probe) is not None:  # the compiled kernels run when the data are float32
        return [((s.start, s.stop), None) for s in bn._native_chunks(acb)]
    out = []
    for a, b in bn._blocks(acb, np):
        a1 = min(a.stop, acb[0])
        out.append(((a.start, a1), None if b == slice(None) else (b.start, min(b.stop, acb[2]))))
    return out


def sums_block(work, block):
    """Pass 1, on a worker or here: the partial sums ``[units, 2, channels]`` of the units starting here."""
    from qgcli.ops import batch_norm as bn

    started = time.perf_counter()
    arrays, _ = arrays_of(work)
    per = _a_per_item(work)
    i0 = block.items[0]
    end = max(a1 for (_, a1), _ in block.units)
    i1 = -(-end // per)
    dy, x = _read(arrays, "y_backprop", i0, i1), _read(arrays, "x", i0, i1)
    read = time.perf_counter()
    acb = _acb(x.shape, work.channels_first)
    dy3, x3 = dy.reshape(acb), x.reshape(acb)
    parts = []
    with np.errstate(all="ignore"):
        for (a0, a1), b in block.units:
            rows = slice(a0 - i0 * per, a1 - i0 * per)
            cols = slice(None) if b is None else slice(*b)
            dyu, xu = dy3[rows, :, cols], x3[rows, :, cols]
            parts.append(np.stack(bn._channel_sums(dyu, xu, work.mean, dyu.shape, np)))
    done = time.perf_counter()
    return {"parts": np.stack(parts), "seconds": {"read": read - started, "compute": done - read, "write": 0.0}}


def dx_block(work, block):
    """Pass 2: this block's chunk of ``x_backprop``, written into the output store."""
    from qgcli.ops import batch_norm as bn

    started = time.perf_counter()
    arrays, out = arrays_of(work)
    i0, i1 = block.items
    dy, x = _read(arrays, "y_backprop", i0, i1), _read(arrays, "x", i0, i1)
    read = time.perf_counter()
    acb = _acb(x.shape, work.channels_first)
    dx = np.empty(x.shape, work.out_dtype)
    with np.errstate(all="ignore"):
        bn.x_backprop_blocks(dy.reshape(acb), x.reshape(acb), dx.reshape(acb), acb, work.coefs, np)
    computed = time.perf_counter()
    out[i0:i1] = dx.view(np.uint16) if dx.dtype.name == "bfloat16" else dx
    return {"seconds": {"read": read - started, "compute": computed - read, "write": time.perf_counter() - computed}}


class BatchNormBlockRun:
    """bn-grad on Zarr arrays, two passes of blocks (:meth:`execute`, as :class:`qgcli.execution.zarr_blocks.BlockRun`)."""

    def __init__(self, job, operands, runner, sources, arrays, budget):
        self.job, self.operands, self.runner = job, operands, runner
        self.sources, self.arrays, self.budget = sources, arrays, budget

    def execute(self, compute_all=None):
        import bisect
        import dataclasses

        from qgcli.storage import provenance, zarr_store
        from qgcli.errors import OperandError
        from qgcli.ops import batch_norm as bn
        from qgcli.families.batch_norm import dtype_of

        job, out = self.job, self.job.output
        compute_all = compute_all or here
        check_destination(job, self.operands)
        setup = self.runner.block_setup(job, self.operands, self.arrays)
        x, dy = self.arrays["x"], self.arrays["y_backprop"]
        small_in = setup["small_in"]
        rank, channels_first = bn._check_format(setup["data_format"])
        eps = bn._check_epsilon(job.epsilon)
        for name, node in (("x", x), ("y_backprop", dy)):
            if not (bn._is_float(node.dtype) or dtype_of(node).name == "bfloat16"):
                raise OperandError(f"dtype {node.dtype} is not a floating type (TF takes float32, float16 or "
                                   "bfloat16)", operand=name)
        bn._check_rank(x, setup["data_format"], rank)
        if tuple(dy.shape) != tuple(x.shape):
            raise OperandError(f"shape {list(dy.shape)} differs from x shape {list(x.shape)}", operand="y_backprop")
        shape = tuple(x.shape)
        channels = shape[1] if channels_first else shape[-1]
        scale = bn._channel_operand(small_in["scale"], "scale", channels, setup["data_format"])
        mean = bn._channel_operand(small_in["reserve_space_1"], "reserve_space_1", channels, setup["data_format"])
        var = bn._channel_operand(small_in["reserve_space_2"], "reserve_space_2", channels, setup["data_format"])
        bn._check_variance(var, job.variance_kind)
        data_dtype = dtype_of(x)
        compute_dtype = np.dtype(np.float32) if data_dtype.itemsize > 4 else data_dtype
        out_dtype = compute_dtype
        per_item_bytes = max(1, int(np.prod(shape[1:], dtype=np.int64)) * 4)
        cap = max(1, min(zarr_store.CHUNK_BYTES, self.budget // 16) // per_item_bytes)
        items = max(1, min(int(x.chunks[0]), cap))
        work = Work(self.sources, "", "x_backprop", shape, channels_first, mean)
        per = _a_per_item(work)
        plan = units(shape, channels_first, compute_dtype)
        starts = [a0 for (a0, _), _ in plan]
        blocks = []
        for i0 in range(0, shape[0], items):
            i1 = min(shape[0], i0 + items)
            lo, hi = bisect.bisect_left(starts, i0 * per), bisect.bisect_left(starts, i1 * per)
            blocks.append(Block((i0, i1), tuple(plan[lo:hi])))
        attrs = provenance.attributes(setup["attrs"])
        acb = _acb(shape, channels_first)
        n = acb[0] * acb[2]
        with zarr_store.staged(out.destination) as stage:
            stage.group.attrs.update(zarr_store.json_attrs(attrs))
            zarr_store.create_array(stage.group, "x_backprop", shape, out_dtype, attrs=attrs,
                                    compression=out.compression, chunks=(items, *shape[1:]))
            work = dataclasses.replace(work, output=stage.path)
            started = time.perf_counter()
            first = compute_all(sums_block, work, [b for b in blocks if b.units])
            total = np.zeros((2, channels), np.float64)
            for result in first:
                for part in result["parts"]:
                    total += part  # in unit order, from zero: as _channel_sums adds them
            coefs = bn.gradient_coefficients(total[0], total[1], n, scale, mean, var, eps, job.is_training,
                                             job.variance_kind)
            second = compute_all(dx_block, dataclasses.replace(work, coefs=coefs, out_dtype=out_dtype), blocks)
            elapsed = time.perf_counter() - started
            small = {"scale_backprop": np.asarray(coefs.scale_backprop), "offset_backprop": np.asarray(coefs.offset_backprop)}
            if job.all_outputs:
                small.update(bn.placeholder_outputs(job.version))
            for key, value in small.items():
                zarr_store.put(stage.group, key, value, attrs=attrs, compression=out.compression)
        summary = self.runner.block_summary(job, self.operands, self.arrays, setup, small, [
            f"computed in two passes of {len(blocks)} blocks of {items} rows of the first axis; x_backprop norms "
            "are not computed in this mode"])
        summary["blocks"] = {**timing(first + second, items, elapsed), "count": len(blocks), "passes": 2}
        return summary
