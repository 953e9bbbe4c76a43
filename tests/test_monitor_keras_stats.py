"""qgcli.monitor.keras_stats (the Keras monitor's host statistics, no TensorFlow needed): the compiled kernels give
the NumPy path's figures, per tensor (one range spread over runs, with a tail) and per channel, NaN included."""
import math

import numpy as np
import pytest

from qgcli.monitor import keras_stats
from qgcli.ops import native

pytestmark = pytest.mark.skipif(native.variant() == "numpy", reason="the compiled kernels are not built")


def _both(monkeypatch, fn):
    """``fn()`` with the compiled kernels, then with NumPy (``QGCLI_NATIVE=0``)."""
    out = []
    for choice in ("", "0"):
        monkeypatch.setenv("QGCLI_NATIVE", choice)
        assert (native.library() is None) == (choice == "0")
        out.append(fn())
    monkeypatch.delenv("QGCLI_NATIVE")
    return out


def _close(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-12, abs=1e-300, nan_ok=True), k


@pytest.mark.parametrize("shape,channels", [((3, 1000), 0), ((5, 7, 16), 16), ((2051,), 0)])
def test_site_statistics_kernels_equal_numpy(monkeypatch, shape, channels):
    rng = np.random.RandomState(1)
    x = (rng.randn(*shape) * 2).astype(np.float32)
    x.reshape(-1)[::97] = 0.0
    lo = (rng.uniform(-3, -1, channels) if channels else np.array(-2.5)).astype(np.float32)
    hi = (rng.uniform(1, 3, channels) if channels else np.array(1.5)).astype(np.float32)
    grid = keras_stats.grid(lo, hi, 8, False)
    y = np.clip(np.round(x * 10) / 10, grid.nudged_min, grid.nudged_max).astype(np.float32)
    dy = rng.randn(*shape).astype(np.float32)
    dy.reshape(-1)[::5] = 0.0
    dx = (dy * (rng.rand(*shape) > 0.3)).astype(np.float32)

    def sample():
        mask = np.full(shape, 9, np.int8)
        forward = keras_stats.forward(x, y, grid, mask)
        upstream, blocked = keras_stats.upstream(dy, mask)
        downstream = keras_stats.downstream(dx, dy, mask, blocked)
        return mask, {**forward, **upstream, **downstream}

    (mask, fast), (mask_np, slow) = _both(monkeypatch, sample)
    assert np.array_equal(mask, mask_np) and set(np.unique(mask)) == {0, 1}
    _close(fast, slow)
    inside = (x >= grid.mask_lo) & (x <= grid.mask_hi)
    assert np.array_equal(mask == 0, inside)
    d64 = dy.astype(np.float64)
    assert fast["blocked"] == pytest.approx(np.abs(d64)[~inside].sum() / np.abs(d64).sum(), rel=1e-12)
    reference = np.where(inside, d64, 0.0)
    assert fast["ste_error"] == pytest.approx(np.abs(dx - reference).sum() / np.abs(reference).sum(), rel=1e-12)

    x[(0,) * len(shape)] = np.nan  # NaN: the NumPy path's rules, counted
    dy[(0,) * len(shape)] = np.inf
    (_, fast), (_, slow) = _both(monkeypatch, sample)
    _close(fast, slow)
    assert fast["nan_inputs"] == 1 and fast["nan_grads"] == 1 and math.isnan(fast["sqnr_db"])


def test_oscillation_and_batch_norm_kernels_equal_numpy(monkeypatch):
    rng = np.random.RandomState(2)
    start = rng.uniform(-1, 1, (6, 4, 8)).astype(np.float32)
    steps = [start + (rng.randn(*start.shape) * 0.02).astype(np.float32) * (i % 2 * 2 - 1) for i in range(7)]
    steps[3].reshape(-1)[:3] = np.nan  # NaN weights keep their codes

    def run(per_channel):
        osc, taken = keras_stats.Oscillation(), []
        for i, w in enumerate(steps):
            lo, hi = (w.reshape(-1, 8).min(0), w.reshape(-1, 8).max(0)) if per_channel else (np.array(-1.0),
                                                                                                 np.array(1.0))
            osc.update(w, keras_stats.grid(np.nan_to_num(lo).astype(np.float32),
                                           np.nan_to_num(hi).astype(np.float32), 4, True), 0.2)
            if i % 3 == 0:
                taken.append(osc.take(0.1))
        return osc.last.copy(), osc.direction.copy(), osc.frequency.copy(), taken

    for per_channel in (False, True):
        fast, slow = _both(monkeypatch, lambda: run(per_channel))
        for a, b in zip(fast[:3], slow[:3]):
            assert a.tobytes() == b.tobytes()
        assert fast[3] == slow[3] and any(t["codes_changed"] > 0 for t in fast[3][1:])
        assert fast[2].max() > 0.1

    x = (rng.randn(4, 5, 3, 6) * 3 + 1).astype(np.float32)
    mean, var = rng.randn(6).astype(np.float32), rng.uniform(0.5, 2, 6).astype(np.float32)
    for fmt, channels in (("NHWC", 6), ("NCHW", 5)):
        m, v = mean[:channels], var[:channels]
        fast, slow = _both(monkeypatch, lambda: keras_stats.batch_norm(x, m, v, fmt, 1e-3))
        _close(fast, slow)
        axes = (0, 1, 2) if fmt == "NHWC" else (0, 2, 3)
        x64 = x.astype(np.float64)
        bm, bv = x64.mean(axes), x64.var(axes)
        m, v = m.astype(np.float64), v.astype(np.float64)
        assert fast["bn_mean_shift"] == pytest.approx(np.mean(np.abs(bm - m) / np.sqrt(v + 1e-3)), rel=1e-9)
        assert fast["bn_var_ratio"] == pytest.approx(np.mean(np.abs(np.log((bv + 1e-3) / (v + 1e-3)))), rel=1e-9)
