"""TensorFlow 2.21's own outputs (tf_semantics.md §1.8, run on a real TF) reproduced bit for bit."""
import math

import numpy as np
import pytest

from qgcli import ops
from qgcli.errors import OperandError, QgcliError

f32 = np.float32


def bits(a):
    return np.asarray(a, f32).view(np.uint32)


def assert_bitwise(got, want):
    np.testing.assert_array_equal(bits(got), bits(np.asarray(want, f32)))


def test_zero_point_tie_rounds_away_from_zero(xp):
    # 4 bits on [-0.5, 2.5]: zero point 2.5 -> 3, nudged range [-0.6, 2.4] (XLA would give [-0.4, 2.6]).
    out = ops.fake_quant_with_min_max_vars(xp.asarray([2.579, -0.6, 2.6], f32), -0.5, 2.5, num_bits=4)
    assert_bitwise(_np(out), [2.4000000953674316, -0.6000000238418579, 2.4000000953674316])


def test_element_ties_round_toward_plus_infinity(xp):
    out = ops.fake_quant_with_min_max_args(xp.asarray([-0.75, -0.25, 0.25], f32), -1.0, 0.5, num_bits=2)
    assert_bitwise(_np(out), [-0.5, 0.0, 0.5])


def test_vars_divides_where_args_multiplies(xp):
    x = xp.asarray([-0.15508615970611572], f32)
    mn, mx = -2.4014430046081543, 0.5279601812362671
    assert_bitwise(_np(ops.fake_quant_with_min_max_args(x, mn, mx)), [-0.1493421345949173])
    assert_bitwise(_np(ops.fake_quant_with_min_max_vars(x, mn, mx)), [-0.16082999110221863])
    pc = ops.fake_quant_with_min_max_vars_per_channel(x[None], xp.asarray([mn], f32), xp.asarray([mx], f32))
    assert_bitwise(_np(pc), [[-0.1493421345949173]])


def test_zero_maps_to_exact_zero(xp):
    assert_bitwise(_np(ops.fake_quant_with_min_max_vars(xp.asarray([0.0], f32), -25.0, 20.0)), [0.0])


def test_gradient_masks_use_nudged_bounds(xp):
    g = xp.asarray([1, 2, 3, 4, 5], f32)
    x = xp.asarray([-0.05, 0.0, 63.7, 63.75, 63.76], f32)
    dx, dmin, dmax = ops.fake_quant_with_min_max_vars_gradient(g, x, -0.1, 63.65)
    assert_bitwise(_np(dx), [0, 2, 3, 4, 0])
    assert float(dmin) == 1.0 and float(dmax) == 5.0
    assert _np(dmin).shape == () and _np(dmax).shape == ()


def test_zero_range_passes_through(xp):
    out = ops.fake_quant_with_min_max_vars(xp.asarray([-1.0, 0.5, np.nan], f32), 0.0, 0.0)
    assert_bitwise(_np(out), [0, 0, 0])
    dx, dmin, dmax = ops.fake_quant_with_min_max_vars_gradient(
        xp.asarray([1, 2, 3], f32), xp.asarray([-1, 0.5, 9], f32), 0.0, 0.0)
    assert_bitwise(_np(dx), [1, 2, 3])
    assert float(dmin) == 0 and float(dmax) == 0


def test_subnormals_behave_as_zero(xp):
    dx = ops.fake_quant_with_min_max_args_gradient(xp.ones(2, f32), xp.asarray([1e-45, -1e-45], f32), -1.0, 0.0)
    assert_bitwise(_np(dx), [1, 1])
    # max = 1e-39 is subnormal, so the range is 0..0: zeros, even for NaN.
    assert_bitwise(_np(ops.fake_quant_with_min_max_vars(xp.asarray([0.5, np.nan], f32), 0.0, 1e-39)), [0, 0])


def test_nan_and_inf_inputs(xp):
    out = ops.fake_quant_with_min_max_args(xp.asarray([np.nan, np.inf, -np.inf], f32), -1.0, 1.0)
    got = _np(out)
    assert np.isnan(got[0])
    assert_bitwise(got[1:], [1.003921627998352, -0.9960784912109375])
    dx = ops.fake_quant_with_min_max_args_gradient(xp.ones(3, f32), xp.asarray([np.nan, np.inf, -np.inf], f32), -1.0, 1.0)
    assert_bitwise(_np(dx), [0, 0, 0])


def test_nan_and_inf_in_gradient_sums(xp):
    x = xp.asarray([-10, -7, 0, 7, 10, np.nan, np.inf, -np.inf], f32)
    g = -xp.arange(1, 9, dtype=f32)
    dx, dmin, dmax = ops.fake_quant_with_min_max_vars_gradient(g, x, -6.0, 6.0)
    assert_bitwise(_np(dx), [-0.0, -0.0, -3, -0.0, -0.0, -0.0, -0.0, -0.0])
    assert float(dmin) == -11 and float(dmax) == -16


def test_ranges_not_containing_zero_are_shifted(xp):
    assert_bitwise(_np(ops.fake_quant_with_min_max_args(xp.asarray([123.0], f32), 12.0, 123.0)), [111.0])
    out = ops.fake_quant_with_min_max_args(xp.asarray([-2, -1.2, -0.3, 1], f32), -1.5, -0.5, num_bits=2)
    assert_bitwise(_np(out), [-1.0, -1.0, -0.3333333432674408, 0.0])


def test_op_documentation_examples(xp):
    out = ops.fake_quant_with_min_max_args(xp.asarray([10.03, -10.23, 3.0], f32), -5.0, 5.0, num_bits=16)
    assert_bitwise(_np(out), [4.9999237060546875, -5.0000762939453125, 3.0000762939453125])
    out = ops.fake_quant_with_min_max_vars(xp.asarray([[1.2, -0.3, 0.7], [2.1, 0.5, -1.0]], f32), -0.5, 0.8)
    assert_bitwise(_np(out), [[0.8003920912742615, -0.30078428983688354, 0.6984313130378723],
                              [0.8003920912742615, 0.49960780143737793, -0.49960780143737793]])


def tf_grid(mn, mx, num_bits):
    """TF's nudge (tf_semantics.md §1.3) in float32 scalars: (scale, inv_scale, nudged_min, nudged_max)."""
    F = np.float32
    qmin, qmax = F(0), F(2**num_bits - 1)
    scale = F(F(mx - mn) / F(qmax - qmin))
    inv_scale = F(F(qmax - qmin) / F(mx - mn))
    zp_from_min = F(qmin - F(mn / scale))
    # std::round (ties away from zero) of a value >= 0, in float64 where v + 0.5 is exact
    zp = qmin if zp_from_min < qmin else qmax if zp_from_min > qmax else F(math.floor(float(zp_from_min) + 0.5))
    return scale, inv_scale, F(F(qmin - zp) * scale), F(F(qmax - zp) * scale)


def per_channel_reference(x, mn, mx, num_bits, *, divide=False):
    """TF's per-channel forward of one channel's values (§1.4), every operation a float32 NumPy ufunc:
    independent of qgcli's kernels.  ``divide=True`` is the Vars formula (``/ scale``), for contrast."""
    F = np.float32
    scale, inv_scale, nudged_min, nudged_max = tf_grid(mn, mx, num_bits)
    quant_zero = F(np.floor(F(F(-nudged_min) * inv_scale) + F(0.5)))
    shifted = np.subtract(np.maximum(np.minimum(np.asarray(x, F), nudged_max), nudged_min), nudged_min, dtype=F)
    t = np.divide(shifted, scale, dtype=F) if divide else np.multiply(shifted, inv_scale, dtype=F)
    return np.multiply(np.floor(np.add(np.subtract(t, quant_zero, dtype=F), F(0.5), dtype=F)), scale, dtype=F)


def test_per_channel_any_rank(xp):
    """Rank 5, five channels with five different grids: every element equals TF's arithmetic with its own
    channel's range (a wrong channel, axis, grid or formula changes values, not the shape)."""
    num_bits, shape = 4, (2, 3, 2, 5, 5)  # 60 values per channel
    mn = np.array([-1.0, -0.5, 0.3, -3.0, -0.1], f32)  # symmetric, zero-point tie, positive, negative, small
    mx = np.array([1.0, 2.5, 2.0, -0.2, 0.1], f32)
    rng = np.random.default_rng(5)
    width = mx - mn
    x = (mn - 0.3 * width + rng.random(shape) * 1.6 * width).astype(f32)
    for c in range(5):  # the 15 half steps of each nudged grid and their neighbours: "* inv_scale" matters there
        scale, _, nudged_min, _ = tf_grid(mn[c], mx[c], num_bits)
        ties = (nudged_min + (np.arange(15) + 0.5) * np.float64(scale)).astype(f32)
        up, down = np.nextafter(ties, f32(np.inf)), np.nextafter(ties, f32(-np.inf))
        x.reshape(-1, 5)[:45, c] = np.concatenate([ties, up, down])
    out = _np(ops.fake_quant_with_min_max_vars_per_channel(xp.asarray(x), mn, mx, num_bits=num_bits))
    assert out.shape == shape
    want = np.stack([per_channel_reference(x[..., c], mn[c], mx[c], num_bits) for c in range(5)], axis=-1)
    assert_bitwise(out, want)
    for c in range(5):  # the inputs tell the formulas apart, and reach several levels of every grid
        assert (per_channel_reference(x[..., c], mn[c], mx[c], num_bits, divide=True) != want[..., c]).any()
        assert len(np.unique(want[..., c])) >= 8


def test_notebook_two_bit_levels(xp):
    np.random.seed(1515)
    x = np.sort(3 * np.random.randn(1000).astype(f32)).reshape([1, 1000])
    out = _np(ops.fake_quant_with_min_max_vars(xp.asarray(x), -6.0, 6.0, num_bits=2))
    assert sorted(set(out.ravel().tolist())) == [-8.0, -4.0, 0.0, 4.0]


# --- errors: TF's own refusals, and qgcli's where TF returns garbage -------------------------------

@pytest.mark.parametrize("num_bits", [0, 1, 17, 2.5, True])
def test_num_bits_out_of_range(num_bits):
    with pytest.raises(QgcliError, match="num_bits"):
        ops.fake_quant_with_min_max_vars(np.zeros(3, f32), -1.0, 1.0, num_bits=num_bits)


def test_args_min_must_be_below_max():
    with pytest.raises(OperandError, match="min has to be smaller than max"):
        ops.fake_quant_with_min_max_args(np.zeros(1, f32), 1.0, 1.0)


@pytest.mark.parametrize("mn, mx", [(1.0, -1.0), (1.0, 1.0), (-1.0, -1.0), (np.nan, 1.0), (-1.0, np.inf)])
def test_vars_refuses_what_tf_answers_with_garbage(mn, mx):
    with pytest.raises(OperandError):
        ops.fake_quant_with_min_max_vars(np.zeros(3, f32), mn, mx)
    with pytest.raises(OperandError):
        ops.fake_quant_with_min_max_vars_gradient(np.zeros(3, f32), np.zeros(3, f32), mn, mx)


def test_vars_min_must_be_scalar():
    with pytest.raises(OperandError, match="min: must be rank 0 but is rank 1"):
        ops.fake_quant_with_min_max_vars(np.zeros(3, f32), [0.0], 1.0)


def test_per_channel_size_mismatch_names_operand():
    with pytest.raises(OperandError, match="^min: has 2 entries but inputs have 1 channels"):
        ops.fake_quant_with_min_max_vars_per_channel(np.ones([2, 1], f32), [0.0, 0.1], [1.0])


def test_per_channel_refuses_scalar_input():
    # TF aborts the whole process here (an open upstream bug); qgcli says why.
    with pytest.raises(OperandError, match="rank >= 1"):
        ops.fake_quant_with_min_max_vars_per_channel(np.float32(0.0), [0.0], [1.0])


def test_per_channel_reversed_channel_is_named():
    with pytest.raises(OperandError, match="at channel 1"):
        ops.fake_quant_with_min_max_vars_per_channel(np.ones([2, 2], f32), [-1.0, 2.0], [1.0, 1.0])


def test_gradient_shape_mismatch():
    with pytest.raises(OperandError, match="^gradients: shape"):
        ops.fake_quant_with_min_max_vars_gradient(np.ones(2, f32), np.ones([1, 2], f32), 0.0, 1.0)


@pytest.mark.parametrize("dtype", [np.int32, np.complex64, np.bool_, object])
def test_non_float_inputs_refused(dtype):
    with pytest.raises(OperandError, match="inputs: dtype"):
        ops.fake_quant_with_min_max_vars(np.zeros(3, dtype), -1.0, 1.0)


def test_float16_and_float64_inputs_are_computed_in_float32():
    x = np.linspace(-7, 7, 101)
    want = ops.fake_quant_with_min_max_vars(x.astype(f32), -6.0, 6.0)
    for dtype in (np.float16, np.float64):
        xd = x.astype(dtype)
        got = ops.fake_quant_with_min_max_vars(xd, -6.0, 6.0)
        assert got.dtype == f32
        assert_bitwise(got, ops.fake_quant_with_min_max_vars(xd.astype(f32), -6.0, 6.0))
    assert want.dtype == f32


def test_per_channel_axis_extension(xp):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 3, 4)).astype(f32)
    g = rng.standard_normal(x.shape).astype(f32)
    mn, mx = -rng.uniform(0.1, 2, 5).astype(f32), rng.uniform(0.1, 2, 5).astype(f32)
    moved = np.moveaxis(x, 1, -1)
    want = np.moveaxis(ops.fake_quant_with_min_max_vars_per_channel(moved, mn, mx), -1, 1)
    got = ops.fake_quant_with_min_max_vars_per_channel(xp.asarray(x), mn, mx, axis=1)
    assert_bitwise(_np(got), want)
    dx_w, dmin_w, dmax_w = ops.fake_quant_with_min_max_vars_per_channel_gradient(np.moveaxis(g, 1, -1), moved, mn, mx)
    dx, dmin, dmax = ops.fake_quant_with_min_max_vars_per_channel_gradient(xp.asarray(g), xp.asarray(x), mn, mx, axis=1)
    assert_bitwise(_np(dx), np.moveaxis(dx_w, -1, 1))
    assert_bitwise(_np(dmin), dmin_w)
    assert_bitwise(_np(dmax), dmax_w)


def test_non_contiguous_and_big_endian_inputs():
    rng = np.random.default_rng(4)
    base = rng.standard_normal((6, 8)).astype(f32)
    want = ops.fake_quant_with_min_max_vars(np.ascontiguousarray(base.T), -1.0, 1.0)
    assert_bitwise(ops.fake_quant_with_min_max_vars(base.T, -1.0, 1.0), want)
    assert_bitwise(ops.fake_quant_with_min_max_vars(np.asfortranarray(base.T), -1.0, 1.0), want)
    assert_bitwise(ops.fake_quant_with_min_max_vars(base.T.astype(">f4"), -1.0, 1.0), want)


def _np(a):
    from qgcli.backend import to_numpy

    return to_numpy(a)
