"""The HDF5 block source: tensors larger than the memory budget streamed block by block, in order, into an .h5.

Blocks of the first axis are read from the input datasets (into reused buffers, one block ahead where the
data lie as plain bytes: a contiguous HDF5 dataset, or an .npy file, a stored .npz member or a .safetensors
tensor, :mod:`qgcli.storage.flat`, which stream here the same way), computed with the same kernels as the
in-memory path and written straight into the output dataset (whole chunk rows, compressed on a thread
pool), so peak memory is a few blocks whatever the tensor's size.  The math is the block driver's (:mod:`qgcli.execution.blocks.leaves`,
:mod:`qgcli.execution.blocks.two_pass`); this module reads and writes.
"""
import numpy as np

from qgcli.errors import RuntimeFailure
from qgcli.execution.blocks import leaves as leaf_reduction
from qgcli.execution.blocks import two_pass
from qgcli.ops import blocked
from qgcli.ops.analysis import add_nonfinite
from qgcli.ops.blocked import submit
from qgcli.report.progress import Progress
from qgcli.signals import raise_pending
from qgcli.storage.hdf5 import chunks as h5_chunks, contiguous as h5_contiguous
from qgcli.storage.io import tagged_bfloat16

_F32 = np.float32


def block_items(dataset_shape, itemsize, budget, copies):
    """How many first-axis items to read at once so ``copies`` block-sized arrays fit in a slice of ``budget``."""
    per_item = max(1, int(np.prod(dataset_shape[1:], dtype=np.int64)) * itemsize)
    return max(1, min(int(dataset_shape[0]), budget // (8 * copies * per_item)))


class _Output:
    """A streamed output dataset and the first-axis block length that fits it: a compressed output is
    written in whole chunk rows (each chunk compressed once, on the thread pool: :mod:`qgcli.storage.hdf5.chunks`),
    so the block is a multiple of the chunk's first extent, chosen together with the chunk shape."""

    def __init__(self, out, name, shape, dtype, attrs, compression, *, step, budget, copies, work_itemsize):
        shape = tuple(shape)
        chunks = None
        if compression and shape and int(np.prod(shape)):
            chunks = h5_chunks.chunk_shape(shape, np.dtype(dtype).itemsize)  # as in memory
            per_item = int(np.prod(shape[1:], dtype=np.int64)) * work_itemsize
            if chunks[0] * per_item * copies > budget:  # a chunk row would not fit: one item per chunk row
                chunks = (1,) + chunks[1:]
            step = max(chunks[0], step // chunks[0] * chunks[0])
        self.ds = h5_chunks.create(out, name, shape, dtype, compression, chunks=chunks)
        for key, value in attrs.items():
            self.ds.attrs[key] = value
        self.step = step
        self.align = chunks[0] if chunks else 1
        self._writer = h5_chunks.ChunkWriter(self.ds) if chunks else None

    @property
    def keeps_blocks(self):
        """Whether a block written is still being read (compressed) after :meth:`write` returns, until the
        next write returns: then the caller reads the next block into another buffer."""
        return self._writer is not None

    def write(self, start, block):
        """Items ``[start, start + len(block))``; ``start`` a multiple of ``align``."""
        if self._writer is not None:
            self._writer.write_rows(start, block)
        else:
            self.ds[start:start + len(block)] = block

    def finish(self):
        """Write what is still being compressed."""
        if self._writer is not None:
            self._writer.flush()


class _Reader:
    """First-axis blocks ``[start, stop)`` of an HDF5 dataset, read in order into reused buffers of ``step``
    items taken in turn: a block stays valid for ``buffers`` reads (2 for blocks an output keeps while it
    compresses them).  A fresh array per block cost its page faults on every read: malloc maps blocks of
    32 MiB and more afresh and unmaps them when they are freed.

    A dataset stored as plain bytes (:func:`qgcli.storage.hdf5.contiguous.extent`) is read one block ahead, with
    ``os.preadv`` on a thread of its own, while the caller computes and writes this one; anything else
    h5py reads when asked."""

    def __init__(self, ds, step, *, buffers=1):
        self.ds, self.rows = ds, ds.shape[0]
        self.where = _extent(ds) if ds.size else None
        self.what = f"dataset {ds.name!r}"  # the thread reading ahead must not call HDF5 (not thread-safe)
        shape = (min(step, ds.shape[0]),) + tuple(ds.shape[1:])
        self.buffers = [np.empty(shape, ds.dtype) for _ in range(buffers + (self.where is not None))]
        self.ahead = None  # (start, stop, future of the buffer) of the block being read ahead

    def __call__(self, start, stop):
        stop = min(stop, self.rows)
        if self.ahead is not None and self.ahead[:2] == (start, stop):
            buf = self.ahead[2].result()
        else:
            self._drop_ahead()
            buf = self._read(start, stop, self.buffers[0])
        self.buffers.append(self.buffers.pop(0))
        self.ahead = None
        if self.where is not None and stop < self.rows:
            self._read_ahead(stop, min(stop + (stop - start), self.rows))
        return buf[:stop - start]

    def _read(self, start, stop, buf):
        if self.where is None:
            self.ds.read_direct(buf, np.s_[start:stop], np.s_[:stop - start])
        else:
            from qgcli.storage.hdf5 import contiguous as h5_contiguous

            item = buf[0].nbytes
            data = memoryview(buf.reshape(-1).view(np.uint8))[:(stop - start) * item]
            h5_contiguous.read_bytes(self.where, start * item, data, self.what)
        return buf

    def _read_ahead(self, start, stop):
        buf = self.buffers[0]
        future, = submit(lambda _: self._read(start, stop, buf), [None], pool="qgcli-read")
        self.ahead = (start, stop, future)

    def _drop_ahead(self):
        if self.ahead is not None:
            from qgcli.ops.blocked import abandon

            abandon([self.ahead[2]])
            self.ahead = None


def _extent(ds):
    """Where the bytes of ``ds`` lie: an HDF5 dataset's (None where h5py must read it), or those of a file that
    holds the tensor as plain bytes (:class:`qgcli.storage.flat.FlatTensor`: always)."""
    return ds.extent() if hasattr(ds, "extent") else h5_contiguous.extent(ds)


def _rows(block, depth):
    return np.ascontiguousarray(block, dtype=_F32).reshape(-1, depth)


def fake_quant_gradient(gradients, inputs, grid, out, *, kind, attrs, compression, budget, progress=None,
                        nonfinite=None):
    """Stream a Vars/PerChannel/Args gradient from HDF5 datasets into the open HDF5 file ``out``.

    ``kind``: "flat" (per tensor) or "chip" (per channel, channels on the last axis); ``None`` for the
    Args op (no min/max sums).  Returns ``{"backprop_wrt_min": ..., "backprop_wrt_max": ...}`` (or {}).
    ``nonfinite``: a list of three ints that takes the inputs' NaN, +inf and -inf counts
    (:func:`qgcli.ops.analysis.add_nonfinite`), block by block as they are read.
    """
    nonfinite = [0, 0, 0] if nonfinite is None else nonfinite
    shape = tuple(inputs.shape)
    depth = shape[-1] if kind == "chip" else 1
    rows = int(np.prod(shape, dtype=np.int64)) // max(depth, 1)
    name = "backprops" if kind is None else "backprops_wrt_input"
    lo, hi = grid.mask_bounds()
    passthrough = grid.passthrough if grid.passthrough.any() else None
    bounds = (lo, hi, passthrough)
    step = block_items(shape, 4, budget, copies=6) if shape else 1
    dx_out = _Output(out, name, shape, _F32, attrs, compression, step=step, budget=budget, copies=6,
                     work_itemsize=4)
    step = dx_out.step
    if not shape:
        g, x = _rows(gradients[()], depth), _rows(inputs[()], depth)
        add_nonfinite(nonfinite, x)
        dx_out.ds[()] = leaf_reduction.gradient_rows(g, x, bounds)[0].reshape(())
        _tick(progress, g.nbytes * 2)
        return {}
    read_g = _Reader(gradients, step, buffers=2 if dx_out.keeps_blocks else 1)  # the backprops go into g
    read_x = _Reader(inputs, step)
    if kind is None:
        for i in range(0, shape[0], step):
            g, x = _rows(read_g(i, i + step), depth), _rows(read_x(i, i + step), depth)
            add_nonfinite(nonfinite, x)
            dx = leaf_reduction.gradient_rows(g, x, bounds, out=g)[0]  # the block read is ours to overwrite
            dx_out.write(i, dx.reshape((-1,) + shape[1:]))
            _tick(progress, g.nbytes * 2)
        dx_out.finish()
        return {}
    plan = leaf_reduction.plan(rows, kind)
    cutter = leaf_reduction.LeafCutter(plan.leaves, depth)
    sums, dx_pending, written = [], [], 0
    per_item = rows // shape[0] if shape[0] else 0
    for i in range(0, shape[0], step):
        x = _rows(read_x(i, i + step), depth)
        add_nonfinite(nonfinite, x)
        ready = cutter.push(_rows(read_g(i, i + step), depth), x)
        if ready is None:
            continue
        (g, x), leaves = ready
        # g holds rows read for this call (or joined from them): the gradient may overwrite them.
        dx, leaf_sums = leaf_reduction.gradient_rows(g, x, bounds, leaves, out=g)
        sums.append(leaf_sums)
        dx_pending.append(dx)
        written = _flush_rows(dx_out, dx_pending, written, per_item, final=False)
        _tick(progress, g.nbytes * 2)
    written = _flush_rows(dx_out, dx_pending, written, per_item, final=True)
    dx_out.finish()
    return leaf_reduction.finish(plan, sums, passthrough, kind)


def _flush_rows(output, pending, written, per_item, *, final):
    """Write whole first-axis items (whole chunk rows, unless ``final``) from the pending dx rows into
    ``output``; keep the remainder."""
    if not pending:
        return written
    rows = np.concatenate(pending) if len(pending) > 1 else pending[0]
    items = len(rows) // per_item if per_item else 0
    if final:
        assert items * per_item == len(rows)
    else:
        items -= items % output.align
    if items:
        output.write(written, rows[:items * per_item].reshape((items,) + output.ds.shape[1:]))
    pending[:] = [rows[items * per_item:].copy()] if items * per_item < len(rows) else []  # (see LeafCutter)
    return written + items


def fake_quant_forward(inputs, grid, divide, out, *, per_channel, attrs, compression, budget, progress=None,
                       nonfinite=None):
    """Stream a fake-quant forward from an HDF5 dataset into ``out['outputs']`` (``nonfinite``: as for
    :func:`fake_quant_gradient`)."""
    nonfinite = [0, 0, 0] if nonfinite is None else nonfinite
    shape = tuple(inputs.shape)
    depth = shape[-1] if per_channel else 1
    params = [getattr(grid, n) for n in ("nudged_min", "nudged_max", "scale", "inv_scale", "quant_zero")]
    passthrough = grid.passthrough if grid.passthrough.any() else None
    step = block_items(shape, 4, budget, copies=3) if shape else 1
    output = _Output(out, "outputs", shape, _F32, attrs, compression, step=step, budget=budget, copies=3,
                     work_itemsize=4)
    # the outputs go into the block read (ours, not needed once written): no fresh block to fault in per read
    read = _Reader(inputs, output.step, buffers=2 if output.keeps_blocks else 1) if shape else None
    for i in range(0, shape[0] if shape else 1, output.step):
        x = _rows(read(i, i + output.step) if shape else inputs[()], depth)
        add_nonfinite(nonfinite, x)  # counted before the block is overwritten by its outputs
        y = blocked.quantize(x, (*params, passthrough), divide, grid.needs_flush(),
                             out=x if shape and x.flags.writeable else None)
        if shape:
            output.write(i, y.reshape((-1,) + shape[1:]))
        else:
            output.ds[()] = y.reshape(())
        _tick(progress, x.nbytes)
    output.finish()


def _tick(progress, nbytes):
    """A block is done: HDF5 is between calls, so a signal deferred meanwhile (qgcli.signals) stops the
    run here."""
    raise_pending()
    if progress is not None:
        progress(nbytes)


def _read_float(read, start, stop):
    """A block of an HDF5 dataset (from its :class:`_Reader`), bfloat16 restored from its uint16 storage."""
    block = read(start, stop)
    if tagged_bfloat16(read.ds) and block.dtype == np.uint16:
        import ml_dtypes

        block = block.view(ml_dtypes.bfloat16)
    return block


def batch_norm_gradient(y_backprop, x, scale, reserve_space_1, reserve_space_2, out, *, epsilon, data_format,
                        is_training, variance_kind, attrs, compression, budget, progress=None, nonfinite=None):
    """FusedBatchNormGrad streamed from HDF5 datasets; ``x_backprop`` goes into ``out``.

    Training takes two passes: the per-channel float64 sums, then ``x_backprop`` block by block.  Inference
    takes one (its ``x_backprop`` does not depend on the sums).  Returns the per-channel outputs.
    ``nonfinite``: a list of three ints that takes ``x_backprop``'s NaN, +inf and -inf counts, block by block
    as it is written (:func:`qgcli.ops.analysis.add_nonfinite`).
    """
    nonfinite = [0, 0, 0] if nonfinite is None else nonfinite
    small_in = {"scale": scale, "reserve_space_1": reserve_space_1, "reserve_space_2": reserve_space_2}
    checked = two_pass.checked(y_backprop, x, small_in, epsilon=epsilon, data_format=data_format,
                               variance_kind=variance_kind)
    shape, channels, channels_first = tuple(x.shape), checked.channels, checked.channels_first
    out_dtype = two_pass.output_dtype(x)
    n = int(np.prod(shape, dtype=np.int64)) // max(channels, 1)
    storage = np.uint16 if out_dtype.name == "bfloat16" else out_dtype
    step = block_items(shape, 8, budget, copies=6)
    output = _Output(out, "x_backprop", shape, storage, attrs, compression, step=step, budget=budget, copies=6,
                     work_itemsize=8)
    if out_dtype.name == "bfloat16":
        output.ds.attrs["dtype"] = "bfloat16"
    sums = np.zeros((2, channels), np.float64)  # sum(dy), sum(dy * (x - mean)), added block by block in order

    def coefficients():
        return two_pass.coefficients(sums, n, checked, is_training=is_training, variance_kind=variance_kind)

    if is_training:  # x_backprop needs the sums over the whole tensor: a pass of their own first
        read_dy, read_x = _Reader(y_backprop, step), _Reader(x, step)
        for i in range(0, shape[0], step):
            dy_b, x_b = _read_float(read_dy, i, i + step), _read_float(read_x, i, i + step)
            two_pass.add(sums, two_pass.sums(*two_pass.as_acb(channels_first, dy_b, x_b), checked.mean))
            _tick(progress, dy_b.nbytes + x_b.nbytes)
    coefs = coefficients()  # inference: x_backprop = dy * scale / sqrt(var + eps), whatever the sums
    if not is_training or output.step != step or output.keeps_blocks:
        read_dy = _Reader(y_backprop, output.step, buffers=2 if output.keeps_blocks else 1)  # x_backprop: in dy
        read_x = _Reader(x, output.step)
    for i in range(0, shape[0], output.step):  # element-wise: any blocks
        dy_b, x_b = _read_float(read_dy, i, i + output.step), _read_float(read_x, i, i + output.step)
        if not is_training:  # the one pass: the sums before x_backprop overwrites dy
            two_pass.add(sums, two_pass.sums(*two_pass.as_acb(channels_first, dy_b, x_b), checked.mean))
        # dy_b is this block's read buffer, not needed once the block is written: x_backprop may overwrite it.
        dx_b = dy_b if dy_b.dtype == out_dtype and dy_b.flags.writeable else np.empty(dy_b.shape, out_dtype)
        if n:
            two_pass.x_backprop(dy_b, x_b, dx_b, coefs, channels_first)
        add_nonfinite(nonfinite, dx_b)
        output.write(i, dx_b.view(np.uint16) if out_dtype.name == "bfloat16" else dx_b)
        _tick(progress, dy_b.nbytes + x_b.nbytes)
    output.finish()
    if not is_training:
        coefs = coefficients()
    return two_pass.small_outputs(coefs, n, channels)


def row_blocks(datasets, setup, out, *, compression, budget, progress=None):
    """A block format streamed from HDF5 datasets (or flat files) into the open HDF5 file ``out``, row block by
    row block (:mod:`qgcli.families.block_rows`: ``setup["plan"]``): every large output written as its rows
    are computed, into reused buffers (the op's result of the previous block of as many rows is the ``out`` of
    the next); NVFP4's per-tensor scale from a first pass over the blocks.  Returns the small outputs; the
    counts the blocks return are added into ``setup["counts"]``."""
    plan = setup["plan"]
    x_ds, g_ds = datasets[plan.x_name], datasets.get("gradients")
    shape = tuple(x_ds.shape)
    per_item = int(np.prod(shape[1:], dtype=np.int64))
    from qgcli.families.block_rows import check_rows_fit
    from qgcli.families.block_rows import row_bytes as bytes_of_row

    row_bytes = bytes_of_row(plan, g_ds is not None)
    copies = 3 if compression else 2  # outputs kept while they compress, and the block read ahead
    check_rows_fit(plan, budget, row_bytes * copies)
    step = max(1, int(budget // (8 * copies * max(row_bytes, 1))))
    step = min(shape[0], max(plan.align, step // plan.align * plan.align))
    writers, chunks0 = {}, 1
    if compression:  # whole chunk rows of every output: chunks of as many input rows each
        chunks0 = h5_chunks.chunk_shape(shape, 4)[0]  # as in memory, unless a chunk row would not fit
        chunks0 = 1 if chunks0 * row_bytes * copies > budget else chunks0
        chunks0 = -(-chunks0 // plan.align) * plan.align
        step = max(chunks0, step // chunks0 * chunks0)
    for name, (oshape, dtype, div) in plan.outputs.items():
        chunks = None
        if compression and int(np.prod(oshape)):
            chunks = (max(1, chunks0 // div),) + h5_chunks.chunk_shape(oshape, np.dtype(dtype).itemsize)[1:]
        ds = h5_chunks.create(out, name, oshape, dtype, compression, chunks=chunks)
        for key, value in setup["attrs"].items():
            ds.attrs[key] = value
        writers[name] = h5_chunks.ChunkWriter(ds) if chunks else None
    if plan.amax_pass:  # NVFP4: the whole tensor's amax first
        read = _Reader(x_ds, step)
        amaxes = []
        for i in range(0, shape[0], step):
            x = _read_float(read, i, i + step)
            amaxes.append(plan.amax(x))
            _tick(progress, x.nbytes)
        plan = plan.with_amax(amaxes)
        read = x = None  # its buffers freed before the encode pass's reader takes its own
    read_x = _Reader(x_ds, step) if plan.needs_x else None
    read_g = _Reader(g_ds, step) if g_ds is not None else None
    reuse = [None, None]  # the op's results of the last blocks, whose arrays the next blocks of that size take
    counts = setup["counts"]
    for k, i in enumerate(range(0, shape[0], step)):
        stop = min(i + step, shape[0])
        x = _read_float(read_x, i, stop) if read_x is not None else None
        g = _read_float(read_g, i, stop) if read_g is not None else None
        slot = k % 2 if compression else 0  # a compressed block is read until the next write returns
        prev = reuse[slot]
        blocks, reuse[slot], found = plan.compute(x, g, i, stop, out=prev if prev is not None and len(
            prev[0]) == stop - i else None)
        for key, n in found.items():
            counts[key] = counts.get(key, 0) + n
        for name, a in blocks.items():
            a = plan.stored(name, a)
            lo, _ = plan.output_rows(name, i, stop)
            if writers[name] is not None:
                writers[name].write_rows(lo, a)
            else:
                out[name][lo:lo + len(a)] = a
        _tick(progress, (stop - i) * per_item * 4 * ((x is not None) + (g is not None)))
    for writer in writers.values():
        if writer is not None:
            writer.flush()
    return plan.small_outputs()


def write_streamed(output, operands, force, attrs, compute, *, quiet, total_bytes, compression=None):
    """Check the target, then run ``compute(h5file, progress)`` into a temporary .h5 renamed over ``output``.

    ``compute`` returns the small outputs (name -> array) to store beside the streamed ones, compressed as
    in memory (every dataset with elements).
    """
    from qgcli.storage import atomic, h5, io, provenance

    io.check_output(output, inputs=operands.input_paths(), force=force)
    attrs = provenance.attributes(attrs)
    small = {}

    def write(path):
        with h5.open_for_writing(path) as out, Progress("streaming", total=total_bytes, unit="bytes", quiet=quiet) as bar:
            for key, value in attrs.items():
                out.attrs[key] = value
            small.update(compute(out, bar.advance))
            for name, value in small.items():
                value = np.asarray(value)
                options = {"compression": compression, "chunks": True} if compression and value.ndim and value.size else {}
                ds = out.create_dataset(name, data=value, **options)
                for key, v in attrs.items():
                    ds.attrs[key] = v

    try:
        atomic.atomic_write(output, write)
    except OSError as exc:
        raise RuntimeFailure(f"cannot write {output}: {exc.strerror or exc}") from None
    return small
