"""Small calls pay validation, nudging and kernel tables once per range and attribute set (issue 42).

The caches must never change a result: a range edited in place, a new range, a bad range and the NumPy
kernels all give what a fresh computation gives."""
import numpy as np
import pytest

from qgcli import ops
from qgcli.errors import OperandError
from qgcli.ops import fake_quant as fq


def _data(shape=(4, 5, 3), seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape, dtype=np.float32) * 4, rng.standard_normal(shape, dtype=np.float32))


def test_a_repeated_range_reuses_one_read_only_grid():
    x, _ = _data()
    lo, hi = np.array([-1.0, -2.0, -3.0], np.float32), np.array([1.0, 2.0, 3.0], np.float32)
    first, _ = fq._prepare_per_channel(x, lo, hi, 8, False, -1, np)
    again, _ = fq._prepare_per_channel(x, lo.copy(), hi.copy(), 8, False, -1, np)
    assert again is first
    assert not first.scale.flags.writeable and not first.forward_kernel[2].flags.writeable
    other, _ = fq._prepare_per_channel(x, lo, hi, 4, False, -1, np)  # another attribute set: another grid
    assert other is not first and float(other.scale[0]) != float(first.scale[0])


def test_a_range_edited_in_place_is_a_new_range():
    x, g = _data()
    lo, hi = np.array([-1.0, -2.0, -3.0], np.float32), np.array([1.0, 2.0, 3.0], np.float32)
    before = ops.fake_quant_with_min_max_vars_per_channel(x, lo, hi)
    lo[1], hi[1] = -0.5, 0.25
    after = ops.fake_quant_with_min_max_vars_per_channel(x, lo, hi)
    fresh = fq._quantize(x, fq.nudge(lo, hi), False, np)
    assert after.tobytes() == fresh.tobytes() and after.tobytes() != before.tobytes()
    dx, dmin, dmax = ops.fake_quant_with_min_max_vars_per_channel_gradient(g, x, lo, hi)
    mask = (x >= fq.nudge(lo, hi).nudged_min) & (x <= fq.nudge(lo, hi).nudged_max)
    assert np.array_equal(dx, g * mask)


@pytest.mark.parametrize("bad", [(np.float32(np.nan), 1.0), (2.0, 1.0), (1.0, 1.0)])
def test_a_bad_range_is_refused_every_time(bad):
    x, _ = _data()
    for _ in range(2):  # nothing is cached by a refusal
        with pytest.raises(OperandError):
            ops.fake_quant_with_min_max_vars(x, *bad)


def test_attributes_are_checked_before_they_become_a_key():
    x, _ = _data()
    ops.fake_quant_with_min_max_vars(x, -1.0, 1.0, num_bits=8)
    with pytest.raises(Exception, match="integer"):
        ops.fake_quant_with_min_max_vars(x, -1.0, 1.0, num_bits=8.0)


def test_many_channels_are_not_cached_but_equal(monkeypatch):
    x, g = _data((3, fq._CACHED_CHANNELS + 1))
    lo = np.full(x.shape[-1], -1.0, np.float32)
    hi = np.linspace(0.5, 3.0, x.shape[-1], dtype=np.float32)
    first, _ = fq._prepare_per_channel(x, lo, hi, 8, False, -1, np)
    assert fq._prepare_per_channel(x, lo, hi, 8, False, -1, np)[0] is not first
    out = ops.fake_quant_with_min_max_vars_per_channel(x, lo, hi)
    monkeypatch.setenv("QGCLI_NATIVE", "0")
    assert ops.fake_quant_with_min_max_vars_per_channel(x, lo, hi).tobytes() == out.tobytes()


@pytest.mark.parametrize("n,kind", [(9000, "flat"), (100_352, "flat"), (50_151, "flat"), (44_801, "chip"),
                                    (300_000, "chip")])
def test_compiled_tree_adds_as_numpy_does(n, kind, monkeypatch):
    from qgcli.ops import native, reduction

    if native.library() is None:
        pytest.skip("the compiled kernels are not built")
    p = reduction.plan(n, kind=kind)
    sums = (np.random.default_rng(n).standard_normal((len(p.leaves), 3)) * 1e3).astype(np.float32)
    sums[0, 0], sums[-1, 1] = np.inf, -0.0
    compiled = reduction.combine(p, sums, np)
    monkeypatch.setenv("QGCLI_NATIVE", "0")
    assert compiled.tobytes() == reduction.combine(p, sums, np).tobytes()
