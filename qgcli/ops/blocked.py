"""Blocked, multi-threaded CPU execution of the fake-quant element-wise pipeline (NumPy only).

The ops are memory-bound. Running TensorFlow's chain of float32 operations over the whole tensor would
stream it through memory once per operation and allocate full-size temporaries; instead each block of
rows goes through the whole chain while it sits in cache, writing straight into the preallocated output,
and blocks run on a small thread pool (NumPy releases the GIL inside ufuncs).  Arithmetic and its order
are exactly those of :mod:`qgcli.ops.fake_quant`'s array-module path, so results are bit-identical.
Where the compiled kernels are built (:mod:`qgcli.ops.native`) each block is one C call instead of a
chain of ufuncs: the same arithmetic in one pass.

Gradient blocks are aligned with the leaves of the Eigen reduction plan (:mod:`qgcli.ops.reduction`), so
``backprop_wrt_min/max`` come from leaf sums computed block by block and combined at the end: no
full-size ``g * mask`` temporary ever exists.
"""
import functools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from qgcli.ops import native, reduction
from qgcli.ops.subnormals import flush_subnormals
from qgcli.signals import deferred

_F32 = np.float32
BLOCK_ELEMENTS = 1 << 17  # 512 KiB of float32 per operand: the chain stays in L2/L3
# The compiled kernels make one pass per block and keep nothing in cache between blocks: their blocks only share
# the work among the threads, and each costs a call and (on the pool) a hand-over of some 10-50 us of CPU, which
# 196 blocks of BLOCK_ELEMENTS made a quarter of a 103 MB forward op on two threads.
NATIVE_BLOCK_MAX = 1 << 22  # 16 MiB of float32 per operand
_pools = {}  # name: ThreadPoolExecutor
_pool_lock = threading.Lock()


def workers():
    value = os.environ.get("QGCLI_THREADS")
    return max(1, int(value)) if value else min(reduction.cpu_count(), 8)


def name_this_thread(name):
    """Give the calling thread an OS-level name (Linux; ``top -H`` and /proc show it, and the fault tests
    watch for it); Python's thread names stay inside Python."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError, TypeError):
        pass


def submit(fn, items, *, pool="qgcli-pool"):
    """Futures of ``fn(item)`` for every item, on the thread pool named ``pool`` (run here, and done, where
    pools have one worker).  Whoever stops waiting for them early (an exception) must :func:`abandon` them.
    Work that runs behind the caller's back (compressing a block while the next is read and computed) has
    a pool of its own, so that the kernels' blocks do not queue behind it."""
    items = list(items)
    if workers() == 1:
        return [_run_here(fn, item) for item in items]
    futures = []
    try:
        # A signal inside submit() could leave a worker started but unknown to the pool (the interpreter
        # then waits for it for ever at exit) or submitted blocks nobody waits for: it waits until all are in.
        with deferred():
            with _pool_lock:
                if pool not in _pools or _pools[pool]._max_workers != workers():
                    _pools[pool] = ThreadPoolExecutor(max_workers=workers(), thread_name_prefix=pool,
                                                      initializer=name_this_thread, initargs=(pool,))
            executor = _pools[pool]
            for item in items:
                futures.append(executor.submit(fn, item))
    except BaseException:
        abandon(futures)
        raise
    return futures


def _run_here(fn, item):
    future = Future()
    try:
        future.set_result(fn(item))
    except Exception as error:
        future.set_exception(error)
    return future


def abandon(futures):
    """Ctrl-C (or a failed block) while blocks run: the compiled kernels write through raw addresses into
    arrays the caller frees as it unwinds, so cancel what has not started and wait for the rest."""
    for future in futures:
        future.cancel()
    _wait_out(futures)


def _map(fn, items):
    """``[fn(item) for item in items]`` on the thread pool."""
    items = list(items)
    if len(items) <= 1 or workers() == 1:
        return [fn(item) for item in items]
    futures = submit(fn, items)
    try:
        return [future.result() for future in futures]
    except BaseException:
        abandon(futures)
        raise


def _wait_out(futures):
    while True:
        try:
            wait(futures)
            return
        except BaseException:  # a second Ctrl-C: the first is already on its way out
            continue


_local = threading.local()


def _scratch(name, shape, dtype):
    """A per-thread reusable buffer: fresh large allocations cost page faults on every block."""
    size = int(np.prod(shape))
    key = (name, np.dtype(dtype).str)
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    buf = buffers.get(key)
    if buf is None or buf.size < size:
        buf = buffers[key] = np.empty(max(size, BLOCK_ELEMENTS), dtype)
    return buf[:size].reshape(shape)


def _row_ranges(rows, row_elements, block=BLOCK_ELEMENTS):
    step = max(1, block // max(1, row_elements))
    return [(r, min(r + step, rows)) for r in range(0, rows, step)]


def native_block(elements):
    """Values per block of a compiled kernel over ``elements`` values: about four blocks per worker (so the
    threads finish together), each at least BLOCK_ELEMENTS and at most NATIVE_BLOCK_MAX."""
    return min(NATIVE_BLOCK_MAX, max(BLOCK_ELEMENTS, elements // (4 * workers())))


def _native_row_ranges(rows, depth):
    return _row_ranges(rows, depth, native_block(rows * depth))


def _has_subnormal(a):
    """Whether ``a`` (float32) holds a nonzero value below the smallest normal float32."""
    magnitude = np.abs(a)
    small = magnitude < np.finfo(np.float32).tiny
    # Most gradients have no zeros and no subnormals: one cheap test; zeros need a second look.
    return bool(small.any()) and bool(np.any(small & (magnitude != 0)))


def quantize(x2, params, divide, flush, *, table=None, out=None):
    """Fake-quantize ``x2`` ([rows, channels] float32, C-contiguous) with per-channel or scalar params.

    ``params``: nudged_min, nudged_max, scale, inv_scale, quant_zero, passthrough (broadcastable on the
    last axis); ``table``: :func:`_table` of them, where the caller keeps it; ``out``: where the outputs go
    (shaped as ``x2``, C order; it may be ``x2`` itself), or None for a new array.  Returns ``out``.
    """
    nmin, nmax, scale, inv, qz, passthrough = params
    out = np.empty_like(x2) if out is None else out
    lib = native.library()
    if lib is not None:
        rows, depth = x2.shape
        if table is None:
            table = _table(params, depth)
        x_at, out_at, table_at = (native.address(a, _F32) for a in (x2, out, table))

        def run_native(rng):
            r0, r1 = rng
            offset = 4 * r0 * depth
            lib.qg_quantize(x_at + offset, out_at + offset, r1 - r0, depth, table_at, int(divide), int(flush))

        _map(run_native, _native_row_ranges(rows, depth))
        return out

    def run(rng):
        r0, r1 = rng
        xb, ob = x2[r0:r1], out[r0:r1]
        with np.errstate(all="ignore"):
            np.minimum(xb, nmax, out=ob)
            np.maximum(ob, nmin, out=ob)
            if flush:
                np.copyto(ob, flush_subnormals(ob))
            np.subtract(ob, nmin, out=ob)
            if divide:
                np.divide(ob, scale, out=ob)
            else:
                np.multiply(ob, inv, out=ob)
            np.subtract(ob, qz, out=ob)
            np.add(ob, _F32(0.5), out=ob)
            np.floor(ob, out=ob)
            np.multiply(ob, scale, out=ob)
            if passthrough is not None:
                np.copyto(ob, _F32(0), where=passthrough)

    _map(run, _row_ranges(x2.shape[0], x2.shape[1]))
    return out


def backprops(g2, x2, lo, hi, passthrough, *, reduce, kind, out=None, table=None):
    """``g * inside`` and, with ``reduce``, Eigen-order column sums of ``g * below`` and ``g * above``.

    ``g2``/``x2``: [rows, channels] float32, C-contiguous; ``lo``/``hi``: DAZ-adjusted mask bounds;
    ``passthrough``: boolean per channel (min == max == 0) or None; ``out``: where ``g * inside`` goes
    (shaped as ``g2``; it may be ``g2`` itself), or None for a new array; ``table``: :func:`_table` of
    ``(lo, hi, passthrough)``, where the caller keeps it.
    """
    rows, depth = x2.shape
    if rows == 0:
        dx = np.empty_like(g2) if out is None else out
        return (dx, np.zeros(depth, _F32), np.zeros(depth, _F32)) if reduce else dx
    if not reduce:
        return backprop_rows(g2, x2, lo, hi, passthrough, out=out, table=table)[0]
    p = reduction.plan(rows, kind=kind)
    dx, sums_min, sums_max = backprop_rows(g2, x2, lo, hi, passthrough, leaves=p.leaves, out=out, table=table)
    return (dx, *finish_sums(p, sums_min, sums_max, passthrough))


def fused(g2, x2, params, divide, flush, bounds, *, reduce, kind, out=None, tables=(None, None), outputs_out=None):
    """The forward (:func:`quantize`) and the gradient (:func:`backprops`) of the same rows in one pass over
    ``x2`` and ``g2``: ``(outputs, dx)``, with ``reduce`` ``(outputs, dx, dmin, dmax)``, each the bits the two
    give apart.  ``bounds``: ``(lo, hi, passthrough)``; ``tables``: :func:`_table` of ``params`` and of
    ``bounds`` where the caller keeps them; ``out``: as :func:`backprops` takes it; ``outputs_out``: where the
    forward's outputs go (shaped as ``x2``, sharing no memory with the other arrays), or None for a new array."""
    rows, depth = x2.shape
    lib = native.library()
    if lib is None or rows == 0:  # the NumPy kernels: the two passes (the same bits)
        outputs = quantize(x2, params, divide, flush, table=tables[0], out=outputs_out)
        res = backprops(g2, x2, *bounds, reduce=reduce, kind=kind, out=out, table=tables[1])
        return (outputs, *res) if reduce else (outputs, res)
    forward_table, bounds_table = (_table(v, depth) if t is None else t for v, t in zip((params, bounds), tables))
    outputs = np.empty_like(x2) if outputs_out is None else outputs_out
    dx = np.empty_like(g2) if out is None else out
    g_at, x_at, dx_at, out_at, p_at, b_at = (native.address(a, _F32)
                                             for a in (g2, x2, dx, outputs, forward_table, bounds_table))
    modes = int(divide), int(flush)
    if not reduce:
        def run(rng):
            offset = 4 * rng[0] * depth
            lib.qg_fused(g_at + offset, x_at + offset, dx_at + offset, out_at + offset, rng[1] - rng[0], depth,
                         p_at, b_at, *modes)

        _map(run, _native_row_ranges(rows, depth))
        return outputs, dx
    p = reduction.plan(rows, kind=kind)

    def run_leaves(block):
        r0, lengths, lengths_at = block
        offset = 4 * r0 * depth
        sums = np.empty((2, len(lengths), depth), _F32)
        if lib.qg_fused_leaves(g_at + offset, x_at + offset, dx_at + offset, out_at + offset, depth, len(lengths),
                               lengths_at, p_at, b_at, native.address(sums, _F32), *modes):
            raise MemoryError("no memory for the per-channel sums of a gradient block")
        return sums

    parts = _map(run_leaves, _native_leaf_blocks(p.leaves, depth, native_block(rows * depth)))
    sums = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    return (outputs, dx, *finish_sums(p, sums[0], sums[1], bounds[2]))


def finish_sums(plan, sums_min, sums_max, passthrough):
    """Add leaf sums along the plan; min == max == 0 channels get 0, as TF writes."""
    depth = sums_min.shape[1]
    both = reduction.combine(plan, np.concatenate([sums_min, sums_max], axis=1), np).astype(_F32, copy=False)
    dmin, dmax = both[:depth], both[depth:]
    if passthrough is not None:  # a NaN gradient times a 0 mask would not give TF's 0
        dmin, dmax = np.where(passthrough, _F32(0), dmin), np.where(passthrough, _F32(0), dmax)
    return dmin, dmax


def backprop_rows(g2, x2, lo, hi, passthrough, *, leaves=None, out=None, table=None):
    """``(dx, leaf sums below, leaf sums above)`` for these rows; ``leaves`` (absolute ``(start, length)``,
    tiling exactly these rows) or None for ``dx`` alone; ``dx`` is ``out`` (which may be ``g2``) if given."""
    rows, depth = x2.shape
    dx = np.empty_like(g2) if out is None else out
    lib = native.library()
    if lib is not None:
        if table is None:
            table = _table((lo, hi, passthrough), depth)
        return _backprop_rows_native(lib, g2, x2, dx, table, leaves)
    in_place = np.may_share_memory(dx, g2)
    keep = None if passthrough is None else ~passthrough
    if leaves:
        first = leaves[0][0]
        blocks = [(r0 - first, r1 - first, lv) for r0, r1, lv in _leaf_blocks(leaves, depth)]
    else:
        blocks = [(r0, r1, ()) for r0, r1 in _row_ranges(rows, depth)]

    def run(block):
        r0, r1, block_leaves = block
        g_raw, xb, db = g2[r0:r1], x2[r0:r1], dx[r0:r1]
        if in_place:  # the block's gradients, kept while its backprops overwrite them
            copy = _scratch("gradients", g_raw.shape, _F32)
            np.copyto(copy, g_raw)
            g_raw = copy
        gb = flush_subnormals(g_raw) if _has_subnormal(g_raw) else g_raw
        # Masks are computed straight into float32 (1.0 / 0.0): a float*float product is 3x faster than
        # float*bool, and no separate cast pass is needed.
        weight = np.greater_equal(xb, lo, out=_scratch("weight", xb.shape, _F32))
        upper = np.less_equal(xb, hi, out=_scratch("upper", xb.shape, _F32))
        np.multiply(weight, upper, out=weight)
        if keep is not None:
            np.multiply(weight, keep, out=weight)
        with np.errstate(all="ignore"):
            np.multiply(gb, weight, out=db)  # a product, as TF: g * 0 keeps -0.0 and NaN
            if passthrough is not None:
                np.copyto(db, g_raw, where=passthrough)  # TF copies these gradients untouched
            if not block_leaves:
                return None
            product = _scratch("product", gb.shape, _F32)
            sums = []
            for compare, bound in ((np.less, lo), (np.greater, hi)):
                compare(xb, bound, out=weight)
                if keep is not None:
                    np.multiply(weight, keep, out=weight)
                np.multiply(gb, weight, out=product)
                sums.append(reduction.leaf_sums(product, block_leaves, np))
        return sums

    results = _map(run, blocks)
    if not leaves:
        return dx, None, None
    return dx, np.concatenate([r[0] for r in results]), np.concatenate([r[1] for r in results])


def _table(values, depth):
    """Per-tensor (0-d) or per-channel parameters as the rows of one float32 [len(values), depth] array
    (None: a row of zeros), as the compiled kernels take them."""
    table = np.empty((len(values), depth), _F32)
    for row, value in zip(table, values):
        row[...] = 0 if value is None else value
    return table


def _backprop_rows_native(lib, g2, x2, dx, bounds, leaves):
    rows, depth = x2.shape
    g_at, x_at, dx_at, bounds_at = (native.address(a, _F32) for a in (g2, x2, dx, bounds))
    if not leaves:
        def run_dx(rng):
            r0, r1 = rng
            offset = 4 * r0 * depth
            lib.qg_backprop(g_at + offset, x_at + offset, dx_at + offset, r1 - r0, depth, bounds_at)

        _map(run_dx, _native_row_ranges(rows, depth))
        return dx, None, None
    first = leaves[0][0]

    def run(block):
        r0, lengths, lengths_at = block
        offset = 4 * (r0 - first) * depth
        sums = np.empty((2, len(lengths), depth), _F32)
        if lib.qg_backprop_leaves(g_at + offset, x_at + offset, dx_at + offset, depth, len(lengths),
                                  lengths_at, bounds_at, native.address(sums, _F32)):
            raise MemoryError("no memory for the per-channel sums of a gradient block")
        return sums

    parts = _map(run, _native_leaf_blocks(tuple(leaves), depth, native_block(rows * depth)))
    sums = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
    return dx, sums[0], sums[1]


@functools.lru_cache(maxsize=32)
def _native_leaf_blocks(leaves, depth, block):
    """:func:`_leaf_blocks` of about ``block`` values as the compiled kernel takes them, once per set of leaves:
    ``(row0, lengths, the lengths' address)`` (the cache keeps each read-only lengths array alive)."""
    blocks = []
    for r0, _, block_leaves in _leaf_blocks(leaves, depth, block):
        lengths = np.array([length for _, length in block_leaves], np.int64)
        lengths.setflags(write=False)
        blocks.append((r0, lengths, lengths.__array_interface__["data"][0]))
    return tuple(blocks)


def _leaf_blocks(leaves, depth, block=BLOCK_ELEMENTS):
    """Group consecutive leaves into blocks of about ``block`` values: ``(row0, row1, leaves)``."""
    blocks, current, size = [], [], 0
    for leaf in leaves:
        current.append(leaf)
        size += leaf[1] * depth
        if size >= block:
            blocks.append(current)
            current, size = [], 0
    if current:
        blocks.append(current)
    return [(b[0][0], b[-1][0] + b[-1][1], tuple(b)) for b in blocks]
