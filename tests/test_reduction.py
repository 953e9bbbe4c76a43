"""The vectorised Eigen-order sum equals a literal, loop-by-loop transcription of Eigen's reduction."""
import numpy as np
import pytest

from qgcli.ops.reduction import eigen_column_sums

f32 = np.float32


def eigen_sum_reference(a, first=0):
    """Eigen's InnerMostDimReducer (AVX, 8 lanes, 4 accumulators, tree split above 8192), scalar loops."""
    a = np.asarray(a, f32).ravel()
    P, n = 8, len(a)
    if n > P * 1024:
        split = P * (-(-(first + (-(-n // 2))) // P))
        nl = min(split - first, n)
        acc = f32(f32(0) + eigen_sum_reference(a[:nl], first))
        return f32(acc + eigen_sum_reference(a[nl:], split)) if nl < n else acc
    p = [np.zeros(P, f32) for _ in range(4)]
    start = 0
    if n >= 4 * P:
        v4 = n // (4 * P) * (4 * P)
        for j in range(0, v4, 4 * P):
            for k in range(4):
                p[k] = (p[k] + a[j + k * P : j + (k + 1) * P]).astype(f32)
        p[0] = (((p[0] + p[1]).astype(f32) + p[2]).astype(f32) + p[3]).astype(f32)
        start = v4
    vs = n // P * P
    for j in range(start, vs, P):
        p[0] = (p[0] + a[j : j + P]).astype(f32)
    acc = f32(0)
    for j in range(vs, n):
        acc = f32(acc + a[j])
    b = (p[0][:4] + p[0][4:]).astype(f32)
    return f32(acc + f32(f32(b[0] + b[2]) + f32(b[1] + b[3])))


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 31, 32, 33, 100, 1000, 8192, 8193, 20001, 40000, 70007])
def test_matches_reference_bitwise(n):
    rng = np.random.default_rng(n)
    a = (rng.standard_normal((n, 3)) * np.exp(rng.uniform(-8, 8, (n, 3)))).astype(f32)
    got = eigen_column_sums(a, np, threads=1)
    want = np.array([eigen_sum_reference(a[:, c]) for c in range(3)], f32)
    assert got.dtype == f32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_order_matters_so_the_test_can_fail():
    # Values whose float32 sum depends on the order: the emulation must not be a plain np.sum.
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((5000, 1)) * np.exp(rng.uniform(-10, 10, (5000, 1)))).astype(f32)
    naive = np.float32(0)
    for v in a[:, 0]:
        naive = np.float32(naive + v)
    assert eigen_column_sums(a, np, threads=1)[0] != naive


def test_sharded_reductions_match_tensorflow(monkeypatch):
    """Large gradients whose min/max sums TF's thread pool shards (golden sums from make_golden_reduction.py)."""
    import json
    import os
    import sys

    from conftest import GOLDEN
    from qgcli import ops

    sys.path.insert(0, GOLDEN)
    from make_golden_reduction import make_inputs

    monkeypatch.setenv("QGCLI_TF_THREADS", "2")  # the golden sums were made with 2 intra-op threads
    with open(os.path.join(GOLDEN, "reduction.json")) as fh:
        cases = json.load(fh)["cases"]
    sharded = 0
    for case in cases:
        n, d = case["rows"], case["depth"]
        g, x = make_inputs(n, d)
        if d == 1:
            _, dmin, dmax = ops.fake_quant_with_min_max_vars_gradient(g, x, -1.0, 1.0)
        else:
            _, dmin, dmax = ops.fake_quant_with_min_max_vars_per_channel_gradient(g, x, -np.ones(d), np.ones(d))
        for name, got in (("backprop_wrt_min", dmin), ("backprop_wrt_max", dmax)):
            want = np.array(case[name], np.uint32)
            assert np.asarray(got, f32).reshape(-1).view(np.uint32).tolist() == want.tolist(), (n, d, name)
        sharded += n > 50150
    assert sharded >= 4
