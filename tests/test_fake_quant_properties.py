"""Invariants of TF's fake quantization, checked on random ranges and tensors (hypothesis)."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from qgcli import ops

f32 = np.float32

finite = st.floats(-1e4, 1e4, allow_nan=False, width=32)
ranges = st.tuples(st.floats(-1e3, 1e3, width=32), st.floats(0.0009765625, 1024.0, width=32)).map(
    lambda t: (f32(t[0]), f32(t[0]) + f32(t[1]))).filter(lambda r: r[0] < r[1])
attrs = st.tuples(st.integers(2, 16), st.booleans())
tensors = st.lists(finite, min_size=1, max_size=64).map(lambda v: np.array(v, f32))


@settings(max_examples=200, deadline=None)
@given(ranges, attrs, tensors)
def test_outputs_on_the_grid_inside_the_nudged_range(rng, at, x):
    (mn, mx), (bits, narrow) = rng, at
    grid = ops.nudge(mn, mx, num_bits=bits, narrow_range=narrow)
    for out in (ops.fake_quant_with_min_max_vars(x, mn, mx, num_bits=bits, narrow_range=narrow),
                ops.fake_quant_with_min_max_args(x, mn, mx, num_bits=bits, narrow_range=narrow)):
        assert out.dtype == f32 and out.shape == x.shape
        # k * scale with an integer k in [quant_min - zp, quant_max - zp]
        k = out.astype(np.float64) / np.float64(grid.scale)
        assert np.allclose(k, np.round(k), atol=1e-3)
        lo, hi = float(grid.nudged_min), float(grid.nudged_max)
        tol = 1e-5 * max(abs(lo), abs(hi), 1e-30)
        assert np.all(out >= lo - tol) and np.all(out <= hi + tol)


@settings(max_examples=200, deadline=None)
@given(ranges, attrs, tensors)
def test_idempotent_and_zero_maps_to_zero(rng, at, x):
    (mn, mx), (bits, narrow) = rng, at
    once = ops.fake_quant_with_min_max_vars(x, mn, mx, num_bits=bits, narrow_range=narrow)
    twice = ops.fake_quant_with_min_max_vars(once, mn, mx, num_bits=bits, narrow_range=narrow)
    np.testing.assert_array_equal(once, twice)
    zero = ops.fake_quant_with_min_max_vars(np.zeros(3, f32), mn, mx, num_bits=bits, narrow_range=narrow)
    assert np.all(zero == 0)


@settings(max_examples=200, deadline=None)
@given(ranges, attrs, tensors, st.integers(0, 2**32 - 1))
def test_gradient_is_a_01_mask_and_sums_split_the_rest(rng, at, x, seed):
    (mn, mx), (bits, narrow) = rng, at
    g = np.random.default_rng(seed).standard_normal(x.shape).astype(f32)
    dx, dmin, dmax = ops.fake_quant_with_min_max_vars_gradient(g, x, mn, mx, num_bits=bits, narrow_range=narrow)
    mask = dx / np.where(g == 0, 1, g)
    assert set(np.unique(mask[g != 0]).tolist()) <= {0.0, 1.0}
    grid = ops.nudge(mn, mx, num_bits=bits, narrow_range=narrow)
    xz = ops.fake_quant.flush_subnormals(x)  # TF compares under denormals-are-zero
    below, above = xz < grid.nudged_min, xz > grid.nudged_max
    np.testing.assert_array_equal(dx == g, ~(below | above) | (g == 0))
    assert np.isclose(dmin, g[below].sum(dtype=np.float64), rtol=1e-5, atol=1e-5)
    assert np.isclose(dmax, g[above].sum(dtype=np.float64), rtol=1e-5, atol=1e-5)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), attrs, st.integers(0, 2**32 - 1))
def test_per_channel_equals_vars_arithmetic_of_args_per_channel(rows, depth, at, seed):
    bits, narrow = at
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, depth)) * 3).astype(f32)
    mn = -rng.uniform(0.01, 4, depth).astype(f32)
    mx = rng.uniform(0.01, 4, depth).astype(f32)
    pc = ops.fake_quant_with_min_max_vars_per_channel(x, mn, mx, num_bits=bits, narrow_range=narrow)
    for c in range(depth):  # PerChannel multiplies by inv_scale, like Args, channel by channel
        want = ops.fake_quant_with_min_max_args(x[:, c], mn[c], mx[c], num_bits=bits, narrow_range=narrow)
        np.testing.assert_array_equal(pc[:, c], want)
