"""Float32 sums in the order TensorFlow's CPU kernels use, so reductions match bit for bit.

TensorFlow's fake-quant gradients reduce ``g * mask`` with Eigen's full reduction (AVX build): eight-lane
packets, four packet accumulators over blocks of 32 values, a recursive split of vectors longer than
8 * 1024 values at a packet-aligned midpoint (tf_semantics.md §1.5).  We emulate that order exactly while
vectorising across columns, so a per-channel reduction of ``[n, d]`` values costs a handful of NumPy calls
per 8192-row leaf, whatever ``d``.
"""

PACKET = 8  # float32 lanes of an AVX packet
LEAF = PACKET * 1024  # Eigen's kLeafSize, in values


def _leaf_sum(a, xp):
    """Eigen's packet reduction of each column of ``a`` (at most ``LEAF`` rows)."""
    n, d = a.shape
    f32 = xp.float32
    p0 = xp.zeros((PACKET, d), f32)
    start = 0
    if n >= 4 * PACKET:
        v4 = n // (4 * PACKET) * (4 * PACKET)
        body = a[:v4].reshape(v4 // (4 * PACKET), 4, PACKET, d)
        # Reducing over the outermost axis adds whole slabs one after another: the same sequential
        # order as Eigen's four accumulators, each lane on its own; start from +0.0 as Eigen does.
        acc = xp.add.reduce(body, axis=0, initial=f32(0))
        p0 = ((acc[0] + acc[1]) + acc[2]) + acc[3]
        start = v4
    whole = n // PACKET * PACKET
    for j in range(start, whole, PACKET):
        p0 = p0 + a[j : j + PACKET]
    tail = xp.zeros(d, f32)
    for j in range(whole, n):
        tail = tail + a[j]
    half = p0[:4] + p0[4:]
    return tail + ((half[0] + half[2]) + (half[1] + half[3]))


def _tree_sum(a, first, xp):
    n = a.shape[0]
    if n <= LEAF:
        return _leaf_sum(a, xp)
    split = PACKET * -(-(first + -(-n // 2)) // PACKET)
    n_left = min(split - first, n)
    acc = xp.float32(0) + _tree_sum(a[:n_left], first, xp)
    if n_left < n:
        acc = acc + _tree_sum(a[n_left:], split, xp)
    return acc


def eigen_column_sums(a, xp):
    """Sum each column of the float32 matrix ``a`` ([n, d]) as Eigen's full reduction would.

    Returns a float32 vector of length ``d``.
    """
    return _tree_sum(a, 0, xp).astype(xp.float32, copy=False)
