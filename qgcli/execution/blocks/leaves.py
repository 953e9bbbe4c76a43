"""The leaf reduction of TensorFlow's fake-quant gradients over blocks, written once for every block source.

``backprop_wrt_min/max`` keep Eigen's summation order however the rows are cut: the rows are planned once as
the leaves of TensorFlow's reduction tree (:func:`qgcli.ops.reduction.plan`), each leaf is summed whole with
the in-memory kernel (:func:`qgcli.ops.blocked.backprop_rows`) by the block it is given to, and the leaf sums
are added along the plan at the end (:func:`finish`): bit for bit the in-memory result, whatever the block
size, the order the blocks run in and the number of workers.

Two ways to hand the leaves to blocks: a source read in order (HDF5) re-cuts its rows into whole leaves as
they come (:class:`LeafCutter`); blocks computed independently (Zarr tasks) each take the leaves that start
in them and read on into the next block where a leaf straddles one (:func:`assign`).
"""
import bisect

import numpy as np

from qgcli.ops import blocked, reduction


def plan(rows, kind):
    """The reduction plan of ``rows`` rows, or None where the op has no min/max sums (``kind`` None)."""
    return None if kind is None else reduction.plan(rows, kind=kind)


def gradient_rows(g, x, bounds, leaves=(), *, split=0, out=None):
    """``(dx, (below, above) leaf sums or None)`` of rows ``g``, ``x``: the first ``split`` rows finish a leaf
    summed elsewhere (no sums), ``leaves`` (absolute ``(row, length)``) start at row ``split``.  ``out`` may be
    ``g`` (the backprops overwrite it) when ``split`` is 0."""
    if not leaves:
        return blocked.backprop_rows(g, x, *bounds, out=out)[0], None
    if not split:
        dx, below, above = blocked.backprop_rows(g, x, *bounds, leaves=leaves, out=out)
        return dx, (below, above)
    head = blocked.backprop_rows(g[:split], x[:split], *bounds)[0]
    tail, below, above = blocked.backprop_rows(g[split:], x[split:], *bounds, leaves=leaves)
    return np.concatenate([head, tail]), (below, above)


def finish(plan, sums, passthrough, kind):
    """``{"backprop_wrt_min", "backprop_wrt_max"}`` from the blocks' leaf sums (``(below, above)`` pairs, in
    plan order), added along the plan."""
    below = np.concatenate([s[0] for s in sums])
    above = np.concatenate([s[1] for s in sums])
    dmin, dmax = blocked.finish_sums(plan, below, above, passthrough)
    if kind == "flat":
        dmin, dmax = dmin.reshape(()), dmax.reshape(())
    return {"backprop_wrt_min": dmin, "backprop_wrt_max": dmax}


class LeafCutter:
    """Collects rows as they are read and hands them out again as whole leaves of a reduction plan."""

    def __init__(self, leaves, depth):
        self.leaves = list(leaves)
        self.next = 0
        self.depth = depth
        self.pending = []  # arrays of rows not yet part of a complete leaf, per operand

    def push(self, *arrays):
        joined = bool(self.pending) and len(self.pending[0]) > 0  # rows left over: joined in fresh arrays
        if joined:
            arrays = [np.concatenate([p, a]) for p, a in zip(self.pending, arrays)]
        take, count = 0, 0
        while self.next + count < len(self.leaves) and take + self.leaves[self.next + count][1] <= len(arrays[0]):
            take += self.leaves[self.next + count][1]
            count += 1
        # What no whole leaf takes outlives this block's read buffer (the next read overwrites it): a copy,
        # unless it already lies in arrays of its own.
        self.pending = [a[take:] if joined else a[take:].copy() for a in arrays]
        if not count:
            return None
        leaves = tuple(self.leaves[self.next:self.next + count])
        self.next += count
        return [a[:take] for a in arrays], leaves


def assign(shape, depth, items_per_block, plan):
    """``[((first item, last item), leaves starting there)]``: the blocks of a tensor, ``items_per_block``
    first-axis items each, with the plan's leaves (None: no sums) given to the block in which each starts."""
    per_item = int(np.prod(shape[1:], dtype=np.int64)) // max(depth, 1)
    starts = [leaf[0] for leaf in plan.leaves] if plan is not None else []
    blocks = []
    for i0 in range(0, shape[0], items_per_block):
        i1 = min(shape[0], i0 + items_per_block)
        a, b = bisect.bisect_left(starts, i0 * per_item), bisect.bisect_left(starts, i1 * per_item)
        blocks.append(((i0, i1), tuple(plan.leaves[a:b]) if plan is not None else ()))
    return blocks
