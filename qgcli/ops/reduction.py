"""Float32 sums in the order TensorFlow's CPU kernels use, so reductions match bit for bit.

TensorFlow's fake-quant gradients reduce ``g * mask`` with Eigen's full reduction (AVX build,
tf_semantics.md §1.5):

* ``InnerMostDimReducer``: eight-lane packets, four packet accumulators over blocks of 32 values, whole
  packets left over added to the first accumulator, a scalar tail; vectors longer than 8 * 1024 values are
  split recursively at a packet-aligned midpoint (absolute index), the halves added left to right;
* ``FullReducer<ThreadPoolDevice>``: when Eigen's cost model grants more than one thread, the vector is
  cut into ``floor(n / threads)``-sized shards, each reduced as above, and the shard sums are added to the
  sum of the leftover tail in shard order.

The reduction is planned once as a list of *leaves* (runs of at most 8192 values) and the order in which
to combine the leaf sums.  Leaves are summed in batches: consecutive leaves of equal length form one
``[leaves, length, columns]`` view, so a 25-million-element vector costs a few dozen NumPy calls, and
columns (channels) are vectorised too.  Callers may compute leaf sums block by block and combine them at
the end (see :func:`combine`), which keeps the working set small.
"""
import functools
import os
from dataclasses import dataclass

import numpy as np

from qgcli.ops import native

PACKET = 8  # float32 lanes of an AVX packet
LEAF = PACKET * 1024  # Eigen's kLeafSize, in values
# TensorCostModel<ThreadPoolDevice>: threads = (n * cost - startup) / per_thread + 0.9, capped.
_STARTUP_CYCLES = 100_000.0
_PER_THREAD_CYCLES = 100_000.0
# Cost per value of (gradients * mask).sum() in Eigen's model, pinned against TF 2.21 with 2 threads: a flat
# vector is sharded from 50,151 values on, a per-channel (strided chip) column from 44,801 rows on.
COST_PER_VALUE = {"flat": 4.1875, "chip": 4.6875}


def tf_threads():
    """Intra-op threads TensorFlow would use here: its default is the machine's CPU count."""
    value = os.environ.get("QGCLI_TF_THREADS")
    return max(1, int(value)) if value else cpu_count()


@functools.lru_cache(maxsize=None)
def cpu_count():
    """``os.cpu_count()``, read once: glibc reads /sys for it on every call (~20 us here, per op call)."""
    return os.cpu_count() or 1


def eigen_threads(n, cost, max_threads):
    threads = (n * cost - _STARTUP_CYCLES) / _PER_THREAD_CYCLES + 0.9
    return int(min(max_threads, max(1, int(threads))))


@dataclass(frozen=True)
class Plan:
    """Leaves ``(start, length)`` in order and the Eigen order of adding their sums, compiled into a few
    vectorised steps (see :func:`combine`)."""

    leaves: tuple
    sharded: bool  # Eigen's FullReducer cut the vector into shards (added to the tail's sum in order)
    levels: tuple = ()  # ((nodes, lefts, rights), ...) by height: node = (0 + left) + right
    roots: tuple = ()  # (tail or None, shard roots...) when sharded; (root,) otherwise


def plan(n, *, kind="flat", threads=None):
    """Plan the Eigen-order reduction of ``n`` values (``kind``: "flat" vector or strided "chip")."""
    return _plan(int(n), kind, tf_threads() if threads is None else threads)


@functools.lru_cache(maxsize=32)  # a 25-million-value plan has thousands of leaves: build it once
def _plan(n, kind, threads):
    """One walk of Eigen's trees: leaves in memory order, and each tree node (height, left, right) once its
    halves are known.  A child is named by a reference: leaf i is i, node k is -2 - k, a missing right half
    -1 (the zero row of :func:`combine`).  (Building a nested recipe and walking it again took twice as
    long: 7 ms for a 25.7 M-value vector, paid by every process that reduces one.)"""
    leaves, nodes = [], []

    def tree(first, count):
        if count <= LEAF:
            leaves.append((first, count))
            return len(leaves) - 1, 0
        split = PACKET * -(-(first + -(-count // 2)) // PACKET)
        n_left = min(split - first, count)
        left, h_left = tree(first, n_left)
        right, h_right = tree(split, count - n_left) if n_left < count else (-1, 0)
        nodes.append((max(h_left, h_right) + 1, left, right))
        return -1 - len(nodes), nodes[-1][0]

    used = eigen_threads(n, COST_PER_VALUE[kind], threads) if n else 1
    if used == 1:
        roots = (tree(0, n)[0],)
    else:
        block = int(np.floor(np.float32(n) / np.float32(used)))  # Eigen computes this in float
        n_blocks = n // block
        shards = [tree(i * block, block)[0] for i in range(n_blocks)]
        # Eigen reduces the leftover tail before adding the shards to it, so it comes last in memory order
        # but first in the sum.
        tail = tree(n_blocks * block, n - n_blocks * block)[0] if n_blocks * block < n else None
        roots = (tail, *shards)
    n_leaves = len(leaves)

    def index(refs):  # references as rows of combine's values: leaf sums, then nodes, then the zero row
        return np.where(refs >= -1, refs, n_leaves - 2 - refs)

    levels = []
    if nodes:
        heights, lefts, rights = (np.array(column, np.intp) for column in zip(*nodes))
        lefts, rights = index(lefts), index(rights)
        for height in np.unique(heights):
            members = np.flatnonzero(heights == height)
            levels.append((n_leaves + members, lefts[members], rights[members]))
    roots = tuple(None if r is None else int(index(r)) for r in roots)
    return Plan(tuple(leaves), used > 1, tuple(levels), roots)


def combine(plan, sums, xp):
    """Add leaf sums (``[leaves, columns]``, float32) in the plan's order; returns ``[columns]``."""
    f32 = xp.float32
    n_leaves, columns = sums.shape
    n_nodes = sum(len(level[0]) for level in plan.levels)
    values = xp.zeros((n_leaves + n_nodes + 1, columns), f32)
    values[:n_leaves] = sums
    lib = native.for_arrays(xp, values)
    if lib is not None and plan.levels:  # the tree in one compiled call: the same adds in the same order
        steps = _steps(plan)
        lib.qg_combine(native.address(values, f32), columns, native.address(steps, np.int64), len(steps))
    else:
        for targets, lefts, rights in plan.levels:
            values[targets] = (f32(0) + values[lefts]) + values[rights]
    if not plan.sharded:
        return values[plan.roots[0]]
    tail, *shards = plan.roots
    acc = values[tail] if tail is not None else xp.zeros(columns, f32)
    for root in shards:
        acc = acc + values[root]
    return acc


_STEPS = {}  # id(plan) -> (plan, its steps): plans are few and cached (_plan), so this stays small


def _steps(plan):
    """The plan's tree as rows (target, left, right) in height order, as qg_combine takes them (once per plan)."""
    entry = _STEPS.get(id(plan))
    if entry is None or entry[0] is not plan:
        steps = np.concatenate([np.stack(level, axis=1) for level in plan.levels]).astype(np.int64)
        # a missing right half is row -1, the zero row, to NumPy: its index for C
        steps[steps < 0] = len(plan.leaves) + len(steps)
        steps.setflags(write=False)
        if len(_STEPS) > 64:
            _STEPS.clear()
        entry = _STEPS[id(plan)] = (plan, np.ascontiguousarray(steps))
    return entry[1]


def leaf_sums(a, leaves, xp):
    """Eigen packet sums of ``a`` ([rows, columns], float32) over each leaf ``(start, length)``.

    ``leaves`` are consecutive and must tile ``a`` from its first row; returns ``[len(leaves), columns]``.
    """
    out = []
    i = 0
    while i < len(leaves):
        start, length = leaves[i]
        j = i
        while j + 1 < len(leaves) and leaves[j + 1][1] == length:
            j += 1
        count = j - i + 1
        base = start - leaves[0][0]
        view = a[base : base + count * length].reshape(count, length, a.shape[1])
        out.append(_batched_leaf_sum(view, xp))
        i = j + 1
    return xp.concatenate(out, axis=0) if len(out) > 1 else out[0]


def _batched_leaf_sum(a, xp):
    """Eigen's packet reduction of ``a[k, :, c]`` for every leaf k and column c (``a``: [leaves, n, columns])."""
    m, n, d = a.shape
    f32 = xp.float32
    p0 = xp.zeros((m, PACKET, d), f32)
    start = 0
    if n >= 4 * PACKET:
        v4 = n // (4 * PACKET) * (4 * PACKET)
        body = a[:, :v4].reshape(m, v4 // (4 * PACKET), 4, PACKET, d)
        if m > 1 and 4 * PACKET * d < 1024:
            # Few channels: put the block index outermost so each step adds m * 32 * d contiguous values
            # (a copy in cache, but NumPy's inner loop is then long enough to run at full speed).
            body = xp.ascontiguousarray(body.transpose(1, 0, 2, 3, 4))
            acc = xp.add.reduce(body, axis=0, initial=f32(0))
        else:
            acc = xp.add.reduce(body, axis=1, initial=f32(0))
        # Either way whole slabs are added one after another: Eigen's sequential accumulator order, lane
        # by lane (NumPy's pairwise summation applies only along the innermost, reduced axis).
        p0 = ((acc[:, 0] + acc[:, 1]) + acc[:, 2]) + acc[:, 3]
        start = v4
    whole = n // PACKET * PACKET
    for j in range(start, whole, PACKET):
        p0 = p0 + a[:, j : j + PACKET]
    tail = xp.zeros((m, d), f32)
    for j in range(whole, n):
        tail = tail + a[:, j]
    half = p0[:, :4] + p0[:, 4:]
    return tail + ((half[:, 0] + half[:, 2]) + (half[:, 1] + half[:, 3]))


def eigen_column_sums(a, xp, *, kind="flat", threads=None):
    """Sum each column of the float32 matrix ``a`` ([n, d]) as Eigen's full reduction would.

    Returns a float32 vector of length ``d``.
    """
    p = plan(a.shape[0], kind=kind, threads=threads)
    if not p.leaves or a.shape[0] == 0:
        return xp.zeros(a.shape[1], xp.float32)
    return combine(p, leaf_sums(a, p.leaves, xp), xp).astype(xp.float32, copy=False)
