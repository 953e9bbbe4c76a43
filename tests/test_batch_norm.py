"""qgcli.ops.batch_norm: FusedBatchNormGrad against finite differences, TF's own test vectors, and its rules."""
import ml_dtypes
import numpy as np
import pytest

from qgcli.errors import OperandError, QgcliError
from qgcli.ops import batch_norm as bn
from qgcli.ops import detect_variance_convention, fused_batch_norm_grad

f32, f64 = np.float32, np.float64
BF16 = ml_dtypes.bfloat16
FORMATS = {"NHWC": (2, 3, 4, 5), "NCHW": (2, 5, 3, 4), "NDHWC": (2, 2, 3, 2, 5), "NCDHW": (2, 5, 2, 3, 2)}


def channel_axis(fmt):
    return 1 if fmt in ("NCHW", "NCDHW") else -1


def reduce_axes(ndim, fmt):
    return (0,) + tuple(range(2, ndim)) if channel_axis(fmt) == 1 else tuple(range(ndim - 1))


def per_channel(v, ndim, fmt):
    shape = [1] * ndim
    shape[channel_axis(fmt)] = -1
    return np.asarray(v, f64).reshape(shape)


def forward64(x, scale, offset, eps, fmt, mean=None, var=None):
    """Batch normalisation in float64; batch statistics (biased variance) unless ``mean``/``var`` are given."""
    axes = reduce_axes(x.ndim, fmt)
    if mean is None:
        mean = x.mean(axis=axes, keepdims=True)
        var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    else:
        mean, var = per_channel(mean, x.ndim, fmt), per_channel(var, x.ndim, fmt)
    return per_channel(scale, x.ndim, fmt) * (x - mean) / np.sqrt(var + eps) + per_channel(offset, x.ndim, fmt)


def data(fmt, seed=0, dtype=f32):
    rng = np.random.default_rng(seed)
    shape = FORMATS[fmt]
    c = shape[channel_axis(fmt)]
    x = (rng.standard_normal(shape) * per_channel(rng.uniform(0.3, 3, c), len(shape), fmt)
         + per_channel(rng.uniform(-2, 2, c), len(shape), fmt)).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    scale = rng.uniform(-2, 2, c).astype(f32)
    return x, dy, scale


def batch_stats(x, fmt):
    axes = reduce_axes(x.ndim, fmt)
    x64 = np.asarray(x, f64)
    return x64.mean(axis=axes).astype(f32), x64.var(axis=axes).astype(f32)


def relerr(a, b):
    a, b = np.asarray(a, f64), np.asarray(b, f64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


# --- an independent check: central differences of a float64 forward ----------------------------------------

def numeric_grads(x, dy, scale, offset, eps, fmt, mean=None, var=None, h=1e-6):
    """d(sum(dy * y))/d(x, scale, offset) by central differences, everything in float64."""
    x, dy = np.asarray(x, f64), np.asarray(dy, f64)
    scale, offset = np.asarray(scale, f64), np.asarray(offset, f64)

    def loss(xx, ss, oo):
        return float((dy * forward64(xx, ss, oo, eps, fmt, mean, var)).sum())

    dx = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        xp_, xm = x.copy(), x.copy()
        xp_[i] += h
        xm[i] -= h
        dx[i] = (loss(xp_, scale, offset) - loss(xm, scale, offset)) / (2 * h)
    ds, do = np.zeros_like(scale), np.zeros_like(offset)
    for c in range(scale.size):
        e = np.zeros_like(scale)
        e[c] = h
        ds[c] = (loss(x, scale + e, offset) - loss(x, scale - e, offset)) / (2 * h)
        do[c] = (loss(x, scale, offset + e) - loss(x, scale, offset - e)) / (2 * h)
    return dx, ds, do


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("is_training", [True, False])
def test_matches_finite_differences_of_a_float64_forward(fmt, is_training):
    x, dy, scale = data(fmt, seed=1)
    eps = 1e-3
    offset = np.linspace(-1, 1, scale.size)
    if is_training:
        # Reserve spaces as the CPU forward saves them: batch mean and biased variance (float32).
        mean, var = batch_stats(x, fmt)
        fd = numeric_grads(x, dy, scale, offset, f64(f32(eps)), fmt)
    else:
        rng = np.random.default_rng(5)
        mean = rng.uniform(-1, 1, scale.size).astype(f32)
        var = rng.uniform(0.2, 2, scale.size).astype(f32)
        fd = numeric_grads(x, dy, scale, offset, f64(f32(eps)), fmt, mean=mean, var=var)
    got = fused_batch_norm_grad(dy, x, scale, mean, var, epsilon=eps, data_format=fmt, is_training=is_training)
    for name, g, want in zip(("x_backprop", "scale_backprop", "offset_backprop"), got, fd):
        # The float32 statistics and central differences (h = 1e-6) leave ~1e-7 relative.
        assert relerr(g, want) < 2e-6, name
    assert got[0].shape == x.shape and got[0].dtype == f32
    assert got[1].dtype == got[2].dtype == f32 and got[1].shape == (scale.size,)


# --- TF's own test vectors (tf_semantics.md §3.5, §3.6, §2.11(b)) ---------------------------------------------

def test_tf_unit_test_fused_batch_norm_grad_simple():
    dy = np.array([2, 2, 9, 9, -4, -4, 5, 5, 8, 8, 7, 7], f32).reshape(1, 1, 6, 2)
    x = np.array([1, 1, 7, 7, 4, 4, -3, -3, -11, -11, 13, 13], f32).reshape(1, 1, 6, 2)
    dx, ds, do = fused_batch_norm_grad(dy, x, np.array([4, 4], f32), np.array([1.833, 1.833], f32),
                                       np.array([57.472, 57.472], f32), epsilon=0.001)
    # TF 2.21 oneDNN and Eigen outputs (§2.11(b)): we lie within their rounding of each other.
    onednn = [-1.3349913358688354, 2.4730801582336426, -4.443424224853516, 0.1714448779821396,
              1.6014323234558105, 1.532496452331543]
    eigen = [-1.334991216659546, 2.4730801582336426, -4.443424224853516, 0.17144493758678436,
             1.6014323234558105, 1.5324965715408325]
    for c in range(2):
        assert relerr(dx[0, 0, :, c], onednn) < 1e-6 and relerr(dx[0, 0, :, c], eigen) < 1e-6
    assert relerr(ds, [-1.6476519107818604] * 2) < 1e-6 and relerr(ds, [-1.6476526260375977] * 2) < 1.5e-6
    assert do.tolist() == [27.0, 27.0]
    # Both TF kernels sum in float32; ours is the float32 nearest the exact value.
    want = exact(dy, x, [4, 4], np.array([1.833, 1.833], f32), np.array([57.472, 57.472], f32), 0.001, "NHWC", True)
    assert np.abs(ds - want[1]).max() <= np.spacing(f32(1.65)) / 2
    # The unit test's own expectations, at its tolerance 0.01.
    np.testing.assert_allclose(dx[0, 0, :, 0], [-1.34, 2.47, -4.44, 0.17, 1.60, 1.53], atol=0.01)
    np.testing.assert_allclose(ds, [-1.6488, -1.6488], atol=0.01)


GRADGRAD_X = np.array([0.417022, 0.7203245, 0.000114374816, 0.30233258, 0.14675589, 0.09233859, 0.18626021,
                       0.34556073, 0.39676747, 0.53881675, 0.41919452, 0.6852195, 0.20445225, 0.87811744,
                       0.027387593, 0.6704675, 0.4173048, 0.55868983, 0.14038694, 0.19810149, 0.8007446,
                       0.9682616, 0.31342417, 0.6923226], f32).reshape(2, 3, 2, 2)
GRADGRAD_DY = np.array([0.87638915, 0.89460665, 0.08504421, 0.039054785, 0.16983043, 0.8781425, 0.09834684,
                        0.42110762, 0.95788956, 0.5331653, 0.6918771, 0.31551564, 0.6865009, 0.83462566,
                        0.018288277, 0.7501443, 0.9888611, 0.74816567, 0.280444, 0.78927934, 0.103226006,
                        0.44789353, 0.9085955, 0.29361415], f32).reshape(2, 3, 2, 2)
GRADGRAD_SCALE = np.array([0.28777534, 0.13002858], f32)


def test_tf_grad_grad_config2_training():
    mean, var = batch_stats(GRADGRAD_X, "NHWC")
    dx, ds, do = fused_batch_norm_grad(GRADGRAD_DY, GRADGRAD_X, GRADGRAD_SCALE, mean, var, epsilon=0.001)
    tf_dx = [0.41417828, 0.1593736, -0.29990032, -0.2720438, -0.30943227, 0.14507778, -0.4390435, -0.08077796,
             0.54103893, -0.022933045, 0.16383043, -0.13024077, 0.33777767, 0.13093668, -0.41282398, 0.086727895,
             0.56542546, 0.08465884, -0.15507571, 0.10171027, -0.95094174, -0.06137718, 0.5449667, -0.14111258]
    assert relerr(dx.ravel(), tf_dx) < 1e-6
    assert relerr(ds, [1.6061727, -0.06045512]) < 1e-5  # TF's statistics differ from ours in the last bit
    assert relerr(do, [5.865293, 6.9453154]) < 1e-6


def test_tf_grad_grad_config2_inference():
    dx, ds, do = fused_batch_norm_grad(GRADGRAD_DY, GRADGRAD_X, GRADGRAD_SCALE, np.array([0.21162811, 0.26554665], f32),
                                       np.array([0.49157315, 0.053362545], f32), epsilon=0.001, is_training=False)
    tf_dx = [0.35934797, 0.49890867, 0.034870885, 0.021780265, 0.06963598, 0.48972684, 0.040325392, 0.23484538,
             0.39276576, 0.29733825, 0.28369206, 0.17595832, 0.28148764, 0.46545818, 0.0074987863, 0.4183442,
             0.4054651, 0.41724074, 0.11499113, 0.44016922, 0.04232601, 0.24978349, 0.37255362, 0.1637442]
    assert relerr(dx.ravel(), tf_dx) < 1e-6
    assert relerr(ds, [1.1368372, 8.531307]) < 1e-6
    assert relerr(do, [5.865293, 6.9453154]) < 1e-6


def test_n_equals_one_gives_zero_x_backprop():
    # §2.8: x = [1,2,3] as [1,1,1,3], batch variance 0, eps 0.001.
    x = np.array([1, 2, 3], f32).reshape(1, 1, 1, 3)
    dy = np.array([0.5, -1, 2], f32).reshape(1, 1, 1, 3)
    dx, ds, do = fused_batch_norm_grad(dy, x, np.ones(3, f32), x.ravel(), np.zeros(3, f32), epsilon=0.001)
    assert dx.ravel().tolist() == [0, 0, 0] and ds.tolist() == [0, 0, 0] and do.tolist() == [0.5, -1, 2]


# --- accuracy: every output the float32 nearest the exact value ---------------------------------------------

def exact(dy, x, scale, mean, var, eps, fmt, is_training):
    axes = reduce_axes(x.ndim, fmt)
    dy, x = np.asarray(dy, f64), np.asarray(x, f64)
    inv = 1 / np.sqrt(per_channel(var, x.ndim, fmt) + f64(f32(eps)))
    xc = x - per_channel(mean, x.ndim, fmt)
    n = x.size // x.shape[channel_axis(fmt)]
    sdy, sdyxc = dy.sum(axes, keepdims=True), (dy * xc).sum(axes, keepdims=True)
    sc = per_channel(scale, x.ndim, fmt)
    dx = sc * inv * (dy - sdy / n - xc * inv**2 * sdyxc / n) if is_training else dy * sc * inv
    return dx, (sdyxc * inv).ravel(), sdy.ravel()


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("is_training", [True, False])
def test_outputs_are_correctly_rounded(fmt, is_training):
    x, dy, scale = data(fmt, seed=2)
    mean, var = batch_stats(x, fmt)
    got = fused_batch_norm_grad(dy, x, scale, mean, var, epsilon=1e-4, data_format=fmt, is_training=is_training)
    for g, want in zip(got, exact(dy, x, scale, mean, var, 1e-4, fmt, is_training)):
        half_ulp = np.spacing(np.abs(want).astype(f32)).astype(f64) / 2
        assert np.all(np.abs(g.astype(f64) - want) <= half_ulp * 1.001 + 1e-12 * np.abs(want).max())


def test_large_sums_keep_their_digits():
    # 262,144 values per channel: a float32 running sum would be off by ~1e-4 relative; ours by <= 1 ulp.
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 64, 64, 2)) + 3).astype(f32)
    dy = (rng.standard_normal(x.shape) + 0.01).astype(f32)
    mean, var = batch_stats(x, "NHWC")
    _, ds, do = fused_batch_norm_grad(dy, x, [1, 1], mean, var)
    _, ds64, do64 = exact(dy, x, [1, 1], mean, var, 1e-4, "NHWC", True)
    assert relerr(do, do64) < 1.2e-7 and relerr(ds, ds64) < 1.2e-7


def test_float16_and_bfloat16_round_once_to_the_input_dtype():
    for dtype in (np.float16, BF16):
        x, dy, scale = data("NHWC", seed=4, dtype=dtype)
        mean, var = batch_stats(x, "NHWC")
        dx, ds, do = fused_batch_norm_grad(dy, x, scale, mean, var)
        assert dx.dtype == np.dtype(dtype) and ds.dtype == do.dtype == f32
        want, ds64, _ = exact(dy, x, scale, mean, var, 1e-4, "NHWC", True)
        assert relerr(ds, ds64) < 1e-6
        # x_backprop is the nearest value of the dtype: no neighbour is closer.
        got = dx.astype(f64)
        finfo = ml_dtypes.finfo(dtype)
        step = np.abs(got) * float(finfo.eps) + float(finfo.smallest_subnormal)
        assert np.all(np.abs(got - want) <= step / 2 * 1.0001)
        # ... and equals what the float32 computation gives for the widened inputs, except at ties.
        dx32, _, _ = fused_batch_norm_grad(dy.astype(f32), x.astype(f32), scale, mean, var)
        assert np.mean(dx32.astype(dtype) == dx) > 0.99


def test_round_once_avoids_double_rounding():
    # 1 + 2**-8 + 2**-30 lies just above the bfloat16 tie 1 + 2**-8: float32 first would round it to the tie
    # and then to even (1.0); the right answer is 1 + 2**-7.
    g = np.array([1 + 2.0**-8 + 2.0**-30, -(1 + 2.0**-8 + 2.0**-30), 1 + 2.0**-8, 0.0, 3.5])
    got = bn._round_once(g, BF16, np).astype(f64)
    assert got.tolist() == [1 + 2.0**-7, -(1 + 2.0**-7), 1.0, 0.0, 3.5]
    h = np.array([1 + 2.0**-11 + 2.0**-40])  # the same for float16
    assert bn._round_once(h, np.float16, np).astype(f64).tolist() == [1 + 2.0**-10]


# --- layouts ----------------------------------------------------------------------------------------------

def test_channels_first_equals_transposed_channels_last():
    x, dy, scale = data("NHWC", seed=6)
    mean, var = batch_stats(x, "NHWC")
    for is_training in (True, False):
        last = fused_batch_norm_grad(dy, x, scale, mean, var, is_training=is_training)
        first = fused_batch_norm_grad(np.moveaxis(dy, -1, 1), np.moveaxis(x, -1, 1), scale, mean, var,
                                      data_format="NCHW", is_training=is_training)
        np.testing.assert_array_equal(np.moveaxis(first[0], 1, -1), last[0])
        np.testing.assert_array_equal(first[1], last[1])
        np.testing.assert_array_equal(first[2], last[2])


def test_five_d_equals_the_four_d_reshape():
    x, dy, scale = data("NDHWC", seed=7)
    mean, var = batch_stats(x, "NDHWC")
    five = fused_batch_norm_grad(dy, x, scale, mean, var, data_format="NDHWC")
    shape4 = (x.shape[0], x.shape[1], x.shape[2] * x.shape[3], x.shape[4])
    four = fused_batch_norm_grad(dy.reshape(shape4), x.reshape(shape4), scale, mean, var)
    np.testing.assert_array_equal(five[0].reshape(shape4), four[0])
    np.testing.assert_array_equal(five[1], four[1])
    # TF's Eigen kernel also takes a 5-D tensor labelled NHWC (channels last), and so do we.
    np.testing.assert_array_equal(fused_batch_norm_grad(dy, x, scale, mean, var, data_format="NHWC")[0], five[0])


def test_non_contiguous_inputs():
    x, dy, scale = data("NHWC", seed=8)
    mean, var = batch_stats(x, "NHWC")
    want = fused_batch_norm_grad(dy, x, scale, mean, var)
    xt, dyt = np.asfortranarray(x), dy[..., ::-1][..., ::-1]
    got = fused_batch_norm_grad(dyt, xt, scale, mean, var)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("fmt,shape", [("NHWC", (6, 50, 40, 7)), ("NCHW", (3, 9, 70, 80)), ("NCHW", (5, 3, 2, 2))])
def test_blocking_does_not_change_results(kernels, monkeypatch, fmt, shape):
    rng = np.random.default_rng(9)
    x = rng.standard_normal(shape).astype(f32)
    dy = rng.standard_normal(shape).astype(f32)
    c = shape[channel_axis(fmt)]
    scale = np.ones(c, f32)
    mean, var = batch_stats(x, fmt)
    want = exact(dy, x, scale, mean, var, 1e-4, fmt, True)
    got = {}
    for block in (1 << 16, 64, 10**9):  # several blocks, tiny blocks splitting the spatial axis, one block
        monkeypatch.setattr(bn, "_BLOCK", block)
        got[block] = fused_batch_norm_grad(dy, x, scale, mean, var, data_format=fmt)
    for block, g in got.items():
        np.testing.assert_array_equal(g[0], got[10**9][0])
        assert relerr(g[1], want[1]) < 1.2e-7 and relerr(g[2], want[2]) < 1.2e-7


# --- special values -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,shape", [("NHWC", (0, 3, 3, 4)), ("NCHW", (2, 4, 0, 3)), ("NDHWC", (1, 2, 0, 2, 4))])
@pytest.mark.parametrize("is_training", [True, False])
def test_empty_batch_gives_zero_sums(fmt, shape, is_training):
    x = np.zeros(shape, np.float16)
    dx, ds, do = fused_batch_norm_grad(x, x, np.ones(4, f32), np.zeros(4, f32), np.ones(4, f32), data_format=fmt,
                                       is_training=is_training)
    assert dx.shape == shape and dx.dtype == np.float16
    assert ds.tolist() == [0.0] * 4 and do.tolist() == [0.0] * 4


def test_zero_epsilon_with_a_constant_channel_gives_nan_as_tf():
    x, dy, scale = data("NHWC", seed=10)
    x[..., 1] = 2.5
    mean, var = batch_stats(x, "NHWC")
    dx, ds, do = fused_batch_norm_grad(dy, x, scale, mean, var, epsilon=0.0)
    assert np.isnan(dx[..., 1]).all() and np.isnan(ds[1]) and np.isfinite(do).all()
    assert np.isfinite(dx[..., 0]).all()


def test_constant_channel_with_epsilon_is_finite():
    x, dy, scale = data("NHWC", seed=11)
    x[..., 2] = -1.25
    mean, var = batch_stats(x, "NHWC")
    assert var[2] == 0
    dx, ds, do = fused_batch_norm_grad(dy, x, scale, mean, var, epsilon=1e-5)
    want = exact(dy, x, scale, mean, var, 1e-5, "NHWC", True)
    assert relerr(dx, want[0]) < 1e-7 and ds[2] == 0


def test_inverse_std_convention_gives_the_same_gradients():
    x, dy, scale = data("NCHW", seed=12)
    mean, var = batch_stats(x, "NCHW")
    inv_std = (1 / np.sqrt(var.astype(f64) + f64(f32(1e-3)))).astype(f32)
    a = fused_batch_norm_grad(dy, x, scale, mean, var, epsilon=1e-3, data_format="NCHW")
    b = fused_batch_norm_grad(dy, x, scale, mean, inv_std, epsilon=0.5, data_format="NCHW", variance_kind="inv-std")
    for u, v in zip(a, b):
        assert relerr(u, v) < 3e-7


def test_scalar_statistics_are_broadcast_and_python_lists_accepted():
    x, dy, _ = data("NHWC", seed=13)
    c = x.shape[-1]
    a = fused_batch_norm_grad(dy, x, 1.5, 0.25, 2.0, is_training=False)
    b = fused_batch_norm_grad(dy, x, [1.5] * c, np.full(c, 0.25, f32), np.full(c, 2, f64), is_training=False)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


def test_float64_inputs_are_computed_as_float32():
    x, dy, scale = data("NHWC", seed=14)
    mean, var = batch_stats(x, "NHWC")
    a = fused_batch_norm_grad(dy.astype(f64), x.astype(f64), scale, mean, var)
    b = fused_batch_norm_grad(dy, x, scale, mean, var)
    assert a[0].dtype == f32
    np.testing.assert_array_equal(a[0], b[0])


def test_reserve_space_3_is_ignored():
    x, dy, scale = data("NHWC", seed=15)
    mean, var = batch_stats(x, "NHWC")
    a = fused_batch_norm_grad(dy, x, scale, mean, var, np.ones((5, 5), f32))
    b = fused_batch_norm_grad(dy, x, scale, mean, var)
    np.testing.assert_array_equal(a[0], b[0])


def test_runs_on_the_array_module_of_its_inputs(xp):
    x, dy, scale = data("NCHW", seed=16)
    mean, var = batch_stats(x, "NCHW")
    got = fused_batch_norm_grad(xp.asarray(dy), xp.asarray(x), scale, mean, var, data_format="NCHW")
    assert all(isinstance(g, xp.ndarray) for g in got)
    want = exact(dy, x, scale, mean, var, 1e-4, "NCHW", True)
    from qgcli.backend import to_numpy

    for g, w in zip(got, want):
        assert relerr(to_numpy(g), w) < 1.2e-7


# --- bad input --------------------------------------------------------------------------------------------

def _good():
    x, dy, scale = data("NHWC", seed=17)
    mean, var = batch_stats(x, "NHWC")
    return dict(y_backprop=dy, x=x, scale=scale, reserve_space_1=mean, reserve_space_2=var)


@pytest.mark.parametrize("change,operand,words", [
    ({"scale": np.ones(4, f32)}, "scale", "has 4 entries but x has 5 channels"),
    ({"reserve_space_1": np.ones(6, f32)}, "reserve_space_1", "has 6 entries but x has 5 channels"),
    ({"reserve_space_2": np.ones(3, f32)}, "reserve_space_2", "has 3 entries but x has 5 channels"),
    ({"scale": np.ones((1, 5), f32)}, "scale", "must be 1-dimensional"),
    ({"x": np.ones((2, 3, 5), f32), "y_backprop": np.ones((2, 3, 5), f32)}, "x", "4- or 5-dimensional"),
    ({"x": np.ones((1, 2, 2, 2, 2, 5), f32), "y_backprop": np.ones((1, 2, 2, 2, 2, 5), f32)}, "x", "rank 6"),
    ({"y_backprop": np.ones((1, 3, 4, 5), f32)}, "y_backprop", "differs from x shape"),
    ({"reserve_space_2": np.array([1, 1, -0.5, 1, 1], f32)}, "reserve_space_2", "negative variance -0.5 at channel 2"),
    ({"x": np.ones((2, 3, 4, 5), np.int32)}, "x", "dtype int32 is not a floating type"),
    ({"y_backprop": np.ones((2, 3, 4, 5), bool)}, "y_backprop", "dtype bool is not a floating type"),
    ({"scale": np.ones(5, np.int64)}, "scale", "dtype int64 is not a floating type"),
])
def test_bad_operands_name_the_operand(change, operand, words):
    args = {**_good(), **change}
    with pytest.raises(OperandError) as info:
        fused_batch_norm_grad(**args)
    assert str(info.value).startswith(f"{operand}: ") and words in str(info.value)


@pytest.mark.parametrize("kwargs,words", [
    ({"epsilon": -1e-3}, "epsilon: must be a finite number >= 0"),
    ({"epsilon": float("nan")}, "epsilon: must be a finite number >= 0"),
    ({"epsilon": 1e39}, "epsilon: must be a finite number >= 0"),
    ({"epsilon": "small"}, "epsilon: must be a number"),
    ({"data_format": "NHCW"}, "data_format: unknown data format 'NHCW'"),
    ({"variance_kind": "std"}, "variance_kind: unknown kind 'std'"),
])
def test_bad_attributes(kwargs, words):
    with pytest.raises(QgcliError, match=words):
        fused_batch_norm_grad(**_good(), **kwargs)


def test_inverse_std_must_be_positive():
    args = _good()
    args["reserve_space_2"] = np.array([1, 0, 1, 1, 1], f32)
    with pytest.raises(OperandError, match="reserve_space_2: an inverse standard deviation must be > 0, got 0.0 at channel 1"):
        fused_batch_norm_grad(**args, variance_kind="inv-std")


# --- versions and placeholder outputs -------------------------------------------------------------------------

def test_version_rules():
    assert bn.batch_norm_grad_version("v1", x_dtype="float32", data_format="NCHW").op == "FusedBatchNormGrad"
    assert bn.batch_norm_grad_version("V3", x_dtype="bfloat16", data_format="NCDHW", reserve_space_3=True).op == \
        "FusedBatchNormGradV3"
    with pytest.raises(OperandError, match="x: dtype float16 needs FusedBatchNormGradV2 or V3"):
        bn.batch_norm_grad_version("v1", x_dtype=np.dtype(np.float16))
    with pytest.raises(OperandError, match="y_backprop: dtype bfloat16 needs FusedBatchNormGradV2 or V3"):
        bn.batch_norm_grad_version("v1", x_dtype="float32", y_backprop_dtype=np.dtype(BF16))
    with pytest.raises(QgcliError, match="data_format: NDHWC needs FusedBatchNormGradV3"):
        bn.batch_norm_grad_version("v2", data_format="NDHWC")
    with pytest.raises(OperandError, match="reserve_space_3: only FusedBatchNormGradV3 has this input"):
        bn.batch_norm_grad_version("v1", reserve_space_3=True)
    with pytest.raises(QgcliError, match="version: unknown version 'v4'"):
        bn.batch_norm_grad_version("v4")


def test_placeholder_outputs_are_eigen_shaped():
    for version, names in (("v1", ["reserve_space_3", "reserve_space_4"]), ("v2", ["reserve_space_3", "reserve_space_4"]),
                           ("v3", ["reserve_space_4", "reserve_space_5"])):
        out = bn.placeholder_outputs(version)
        assert sorted(out) == names
        assert all(a.shape == (0,) and a.dtype == f32 for a in out.values())


def test_channel_norms():
    a = np.arange(24, dtype=f32).reshape(1, 2, 3, 4)
    want = np.sqrt((a.astype(f64) ** 2).sum(axis=(0, 1, 2)))
    np.testing.assert_allclose(bn.channel_norms(a), want, rtol=1e-15)
    np.testing.assert_allclose(bn.channel_norms(np.moveaxis(a, -1, 1), "NCHW"), want, rtol=1e-15)


# --- which convention reserve_space_2 holds ---------------------------------------------------------------------

@pytest.fixture
def stats():
    rng = np.random.default_rng(20)
    x = (rng.standard_normal((4, 5, 5, 6)) * np.linspace(0.2, 3, 6) + np.linspace(-3, 5, 6)).astype(f32)
    x64 = x.astype(f64)
    n = x.size // 6
    mean = x64.mean(axis=(0, 1, 2))
    var = x64.var(axis=(0, 1, 2))
    return x, mean.astype(f32), var, n


@pytest.mark.parametrize("kind", ["biased-variance", "unbiased-variance", "inv-std", "inv-variance"])
def test_detects_each_convention(stats, kind):
    x, mean, var, n = stats
    eps = 1e-3
    saved = {"biased-variance": var, "unbiased-variance": var * n / (n - 1),
             "inv-std": 1 / np.sqrt(var + eps), "inv-variance": 1 / (var + eps)}[kind].astype(f32)
    found = detect_variance_convention(x, mean, saved, epsilon=eps)
    assert found.kind == kind and found.n == n
    assert found.mismatch[kind] <= 1 and all(v > 1 for k, v in found.mismatch.items() if k != kind)
    # The converted statistics give the gradient of the biased-variance convention.
    dy = np.random.default_rng(21).standard_normal(x.shape).astype(f32)
    want = fused_batch_norm_grad(dy, x, np.ones(6, f32), mean, var.astype(f32), epsilon=eps)
    got = fused_batch_norm_grad(dy, x, np.ones(6, f32), mean, found.reserve_space_2, epsilon=eps,
                                variance_kind=found.variance_kind)
    for u, v in zip(got, want):
        assert relerr(u, v) < 1e-6
    assert ("rescaled" in found.description) == (kind == "unbiased-variance")


def test_detection_in_channels_first_layouts(stats):
    x, mean, var, n = stats
    found = detect_variance_convention(np.moveaxis(x, -1, 1), mean, var.astype(f32), data_format="NCHW")
    assert found.kind == "biased-variance"
    x5 = x.reshape(4, 5, 5, 1, 6).transpose(0, 4, 1, 2, 3)
    assert detect_variance_convention(x5, mean, var.astype(f32), data_format="NCDHW").kind == "biased-variance"


def test_large_batches_make_biased_and_unbiased_indistinguishable():
    rng = np.random.default_rng(22)
    x = rng.standard_normal((64, 32, 32, 2)).astype(f32)
    mean, var = batch_stats(x, "NHWC")
    found = detect_variance_convention(x, mean, var)
    assert found.kind == "biased-variance" and found.also_fits == ("unbiased-variance",)
    assert "too close to tell apart" in found.description


def test_wrong_mean_is_refused(stats):
    x, mean, var, n = stats
    with pytest.raises(OperandError, match=r"reserve_space_1: is not the batch mean of x \(channel 3"):
        detect_variance_convention(x, mean + np.array([0, 0, 0, 1, 0, 0], f32), var.astype(f32))


def test_no_convention_fits(stats):
    x, mean, var, n = stats
    with pytest.raises(OperandError, match="reserve_space_2: matches none of") as info:
        detect_variance_convention(x, mean, (var * 1.5).astype(f32))
    assert "--variance-kind" in str(info.value)


def test_inverse_std_with_another_epsilon_gets_a_hint(stats):
    x, mean, var, n = stats
    saved = (1 / np.sqrt(var + 0.01)).astype(f32)
    with pytest.raises(OperandError, match=r"it fits 1/sqrt\(var \+ epsilon\) with epsilon = 0.01 rather than 0.0001"):
        detect_variance_convention(x, mean, saved, epsilon=1e-4)


def test_detection_needs_values(stats):
    with pytest.raises(OperandError, match="x: is empty"):
        detect_variance_convention(np.zeros((0, 2, 2, 3), f32), np.zeros(3, f32), np.ones(3, f32))


def test_detection_on_low_precision_inputs():
    rng = np.random.default_rng(23)
    x = (rng.standard_normal((8, 4, 4, 3)) * 2 + 1).astype(BF16)
    mean, var = batch_stats(x, "NHWC")
    assert detect_variance_convention(x, mean, var).kind == "biased-variance"


def test_widened_bfloat16_rounds_once_like_the_direct_computation():
    """The GPU path (CuPy has no bfloat16) widens to float32, computes, and narrows: with x_backprop
    rounded to odd in float32 that equals the direct bfloat16 computation bit for bit; rounding to nearest
    in float32 first would round twice (the old GPU path: elements differ)."""
    import ml_dtypes

    from qgcli.ops import batch_norm as bn

    bf16 = ml_dtypes.bfloat16
    rng = np.random.default_rng(16)
    x = (rng.standard_normal((32, 8, 8, 64)) * 2 + 0.5).astype(bf16)
    dy = rng.standard_normal(x.shape).astype(bf16)
    x32, dy32 = x.astype(np.float32), dy.astype(np.float32)
    scale = rng.uniform(0.5, 2, 64).astype(np.float32)
    mean = x32.mean(axis=(0, 1, 2))
    var = x32.var(axis=(0, 1, 2))
    direct = bn.fused_batch_norm_grad(dy, x, scale, mean, var)[0]
    widened = bn.fused_batch_norm_grad_to_odd(dy32, x32, scale, mean, var)[0].astype(bf16)
    np.testing.assert_array_equal(widened.view(np.uint16), direct.view(np.uint16))
    twice = bn.fused_batch_norm_grad(dy32, x32, scale, mean, var)[0].astype(bf16)
    assert np.count_nonzero(twice.view(np.uint16) != direct.view(np.uint16)) > 0
