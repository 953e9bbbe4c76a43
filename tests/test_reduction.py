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


def golden_cases(name):
    import json
    import os

    from conftest import GOLDEN

    with open(os.path.join(GOLDEN, name)) as fh:
        return json.load(fh)


def mismatches(cases, threads=None):
    """The (rows, depth, output) of golden cases whose qgcli sums differ from TensorFlow's, bit for bit.

    ``threads``: TF's intra-op thread count to tell qgcli (``QGCLI_TF_THREADS``); default: each case's own.
    """
    import os
    import sys

    from conftest import GOLDEN
    from qgcli import ops

    sys.path.insert(0, GOLDEN)
    from make_golden_reduction import make_inputs

    wrong = []
    saved = os.environ.get("QGCLI_TF_THREADS")
    try:
        for case in cases:
            os.environ["QGCLI_TF_THREADS"] = str(threads or case.get("intra_op_threads", 2))
            n, d = case["rows"], case["depth"]
            g, x = make_inputs(n, d)
            if d == 1:
                _, dmin, dmax = ops.fake_quant_with_min_max_vars_gradient(g, x, -1.0, 1.0)
            else:
                _, dmin, dmax = ops.fake_quant_with_min_max_vars_per_channel_gradient(g, x, -np.ones(d), np.ones(d))
            for name, got in (("backprop_wrt_min", dmin), ("backprop_wrt_max", dmax)):
                if np.asarray(got, f32).reshape(-1).view(np.uint32).tolist() != case[name]:
                    wrong.append((n, d, name))
    finally:
        os.environ["QGCLI_TF_THREADS"] = saved if saved is not None else "2"
    return wrong


def test_sharded_reductions_match_tensorflow():
    """Large gradients whose min/max sums TF's thread pool shards (golden sums from make_golden_reduction.py)."""
    golden = golden_cases("reduction.json")
    assert golden["intra_op_threads"] == 2  # the golden sums were made with 2 intra-op threads
    cases = golden["cases"]
    assert mismatches(cases) == []
    assert sum(case["rows"] > 50150 for case in cases) >= 4


@pytest.mark.parametrize("kind, wrong_cost", [("flat", 4.0), ("flat", 4.1), ("flat", 4.2), ("chip", 4.5),
                                              ("chip", 4.75)])
def test_the_golden_sums_pin_the_cost_constants(monkeypatch, kind, wrong_cost):
    """Eigen's cost per value decides where a reduction is first split over two threads; the golden sizes on
    both sides of that point (49,800 ... 52,499 flat; 44,799 / 44,801 rows per channel) fail for a wrong one."""
    from qgcli.ops import reduction

    near = [c for c in golden_cases("reduction.json")["cases"] if c["rows"] < 53000]
    monkeypatch.setitem(reduction.COST_PER_VALUE, kind, wrong_cost)
    reduction._plan.cache_clear()
    try:
        assert mismatches(near) != []
    finally:
        reduction._plan.cache_clear()


def test_other_thread_counts_match_tensorflow():
    """TF run with 1, 4 and 8 intra-op threads (reduction_threads.json): qgcli gives TF's bits when told the
    count with QGCLI_TF_THREADS, and the cases depend on it (the 2-thread answer differs for most of them)."""
    golden = golden_cases("reduction_threads.json")
    cases = golden["cases"]
    assert golden["tensorflow_version"].startswith("2.21")
    assert sorted({c["intra_op_threads"] for c in cases}) == [1, 4, 8]
    assert mismatches(cases) == []
    for threads in (1, 4, 8):
        own = [c for c in cases if c["intra_op_threads"] == threads]
        assert len(mismatches(own, threads=2)) >= 4, threads


def test_tf_threads_default_to_the_cpu_count(monkeypatch):
    from qgcli.ops import reduction

    monkeypatch.delenv("QGCLI_TF_THREADS")
    assert reduction.tf_threads() == reduction.cpu_count()
    monkeypatch.setenv("QGCLI_TF_THREADS", "8")
    assert reduction.tf_threads() == 8
