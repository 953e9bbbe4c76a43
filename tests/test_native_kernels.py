"""The compiled kernels (qgcli/ops/_kernels.c) against the NumPy kernels: the same bits on every path.

TF's golden cases run under every kernel build (the ``kernels`` fixture); these add shapes the golden file
has few of: leaf and shard boundaries of the Eigen plan, many channels, min == max == 0 channels, the
subnormal-flush forward, and the thread count.
"""
import shutil
import sysconfig
import warnings

import numpy as np
import pytest

from qgcli import ops
from qgcli.ops import native

f32 = np.float32


def test_kernels_are_built_where_a_compiler_exists():
    # pip builds them with the C compiler Python was built with; a silent fallback would only be slower.
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) here")
    assert native.library() is not None, "qgcli/ops/_kernels.c was not built (pip install -e . rebuilds it)"


def test_environment_switch(monkeypatch):
    monkeypatch.setenv("QGCLI_NATIVE", "0")
    assert native.library() is None and native.variant() == "numpy"
    monkeypatch.setenv("QGCLI_NATIVE", "baseline")
    assert native.variant() in ("baseline", "numpy")


@pytest.mark.skipif(native.library() is None, reason="the compiled kernels are not built here")
def test_a_stale_build_is_not_called(monkeypatch):
    # A build of an older C file (an editable install not rebuilt) would be called with wrong arguments.
    monkeypatch.setattr(native, "ABI_VERSION", native.ABI_VERSION + 1)
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_chosen", {})
    assert native.library() is None and native.variant() == "numpy"


def hostile(rng, shape, scale=2.0):
    """Normal values with NaN, +-inf, signed zeros, subnormals and values on the nudged bounds mixed in."""
    x = (rng.standard_normal(shape) * scale).astype(f32)
    flat = x.reshape(-1)
    if not flat.size:
        return x
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, 3e-39, -1.5, 1.0, 2.5, -2.0], f32)
    picks = rng.integers(0, flat.size, size=max(1, flat.size // 50))
    flat[picks] = rng.choice(specials, size=picks.size)
    return x


def same_bits(a, b):
    a, b = np.asarray(a, f32), np.asarray(b, f32)
    assert a.shape == b.shape
    nan = np.isnan(a)
    assert np.array_equal(nan, np.isnan(b))  # NaN signs are not part of TF's semantics
    assert np.array_equal(a.view(np.uint32)[~nan], b.view(np.uint32)[~nan])


def both(monkeypatch, fn):
    monkeypatch.setenv("QGCLI_NATIVE", "0")
    want = fn()
    monkeypatch.setenv("QGCLI_NATIVE", "")
    got = fn()
    return got, want


needs_kernels = pytest.mark.skipif(native.library() is None, reason="the compiled kernels are not built here")


@needs_kernels
@pytest.mark.parametrize("n", [1, 31, 33, 8191, 8192, 8193, 16_391, 50_150, 50_151, 50_152, 131_075])
def test_per_tensor_gradient_at_leaf_and_shard_boundaries(monkeypatch, n):
    rng = np.random.default_rng(n)
    g, x = hostile(rng, n), hostile(rng, n)
    for lo_hi in ((-1.5, 1.0), (0.0, 2.5), (-2.0, 0.0), (0.0, 0.0)):
        got, want = both(monkeypatch, lambda: ops.fake_quant_with_min_max_vars_gradient(g, x, *lo_hi))
        for a, b in zip(got, want):
            same_bits(a, b)


@needs_kernels
@pytest.mark.parametrize("rows, depth", [(44_800, 3), (44_801, 3), (8193, 64), (300, 1), (7, 3000)])
def test_per_channel_gradient_and_forward(monkeypatch, rows, depth):
    rng = np.random.default_rng(rows + depth)
    g, x = hostile(rng, (rows, depth)), hostile(rng, (rows, depth))
    mn = -rng.uniform(0.5, 2, depth).astype(f32)
    mx = rng.uniform(0.5, 2, depth).astype(f32)
    mn[::5], mx[::5] = 0.0, 0.0  # TF's min == max == 0: forward zeros, gradient copied
    mn[1::7] = 0.0  # ranges starting at 0
    for bits, narrow in ((8, False), (2, True), (16, False)):
        kw = dict(num_bits=bits, narrow_range=narrow)
        got, want = both(monkeypatch, lambda: ops.fake_quant_with_min_max_vars_per_channel_gradient(g, x, mn, mx, **kw))
        for a, b in zip(got, want):
            same_bits(a, b)
        got, want = both(monkeypatch, lambda: ops.fake_quant_with_min_max_vars_per_channel(x, mn, mx, **kw))
        same_bits(got, want)


@needs_kernels
@pytest.mark.parametrize("lo_hi", [(-6.0, 6.0), (-1e-30, 1e-30), (0.25, 3.0), (-7.0, -0.5)])
def test_per_tensor_forward_and_args_gradient(monkeypatch, lo_hi):
    # (-1e-30, 1e-30): a grid step this small makes the forward flush subnormal clamped values, as TF.
    rng = np.random.default_rng(3)
    x, g = hostile(rng, (3, 4099), scale=lo_hi[1] * 2), hostile(rng, (3, 4099))
    for bits in (2, 8, 16):
        for fn in (lambda: ops.fake_quant_with_min_max_vars(x, *lo_hi, num_bits=bits),
                   lambda: ops.fake_quant_with_min_max_args(x, *lo_hi, num_bits=bits),
                   lambda: ops.fake_quant_with_min_max_args_gradient(g, x, *lo_hi, num_bits=bits)):
            got, want = both(monkeypatch, fn)
            same_bits(got, want)


@needs_kernels
def test_thread_count_does_not_change_bits(monkeypatch):
    rng = np.random.default_rng(5)
    g, x = hostile(rng, (8, 8, 40, 24)), hostile(rng, (8, 8, 40, 24))
    mn, mx = np.full(24, -1.0, f32), np.full(24, 1.5, f32)
    results = []
    for threads in ("1", "2", "5"):
        monkeypatch.setenv("QGCLI_THREADS", threads)
        results.append(ops.fake_quant_with_min_max_vars_per_channel_gradient(g, x, mn, mx)
                       + (ops.fused_batch_norm_grad(g, x, np.ones(24, f32), mn, mx + 2)[0],))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            same_bits(a, b)


@needs_kernels
@pytest.mark.parametrize("fmt, shape", [("NHWC", (4, 33, 17, 40)), ("NCHW", (3, 6, 50, 70)), ("NCDHW", (1, 3, 4, 5, 1001))])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_matches_the_numpy_path(monkeypatch, fmt, shape, training):
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(shape) * 3 + 1).astype(f32)
    dy = rng.standard_normal(shape).astype(f32)
    c = shape[1] if fmt[1] == "C" else shape[-1]
    axes = tuple(i for i in range(len(shape)) if i != (1 if fmt[1] == "C" else len(shape) - 1))
    mean, var = x.mean(axis=axes, dtype=np.float64).astype(f32), x.var(axis=axes, dtype=np.float64).astype(f32)
    scale = rng.uniform(0.5, 2, c).astype(f32)
    got, want = both(monkeypatch, lambda: ops.fused_batch_norm_grad(dy, x, scale, mean, var, epsilon=1e-3,
                                                                    data_format=fmt, is_training=training))
    # Both sum in float64, in different orders: the float32 results may differ in the last bit only.
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == f32
        assert np.max(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))) <= 1


@needs_kernels
@pytest.mark.parametrize("shape, per_channel", [((4099, 3), True), ((20_003,), False), ((5, 1), True), ((7,), False),
                                                ((0, 4), True), ((0,), False)])
def test_clip_statistics_match_the_numpy_path(monkeypatch, shape, per_channel):
    from qgcli.ops.analysis import clip_statistics
    from qgcli.ops.fake_quant import nudge

    rng = np.random.default_rng(len(shape) + shape[0])
    x, g = hostile(rng, shape), hostile(rng, shape)
    depth = shape[-1]
    if per_channel:
        mn, mx = -rng.uniform(0.5, 2, depth).astype(f32), rng.uniform(0.5, 2, depth).astype(f32)
        mn[0] = mx[0] = 0.0  # a min == max == 0 channel clips nothing
        grid = nudge(mn, mx)
    else:
        grid = nudge(f32(-1.5), f32(1.0))
    for grads in (g, None):
        got, want = both(monkeypatch, lambda: clip_statistics(x, grid, grads))
        assert got.keys() == want.keys()
        for key in want:  # counts exactly; float64 masses summed in another order
            np.testing.assert_allclose(got[key], want[key], rtol=1e-12, atol=0, err_msg=key)


@needs_kernels
@pytest.mark.parametrize("num_bits, narrow", [(2, False), (2, True), (8, False), (8, True), (16, False), (16, True)])
def test_nudge_matches_the_numpy_path(monkeypatch, num_bits, narrow):
    from qgcli.ops.fake_quant import _NUDGED, nudge

    rng = np.random.default_rng(num_bits + narrow)
    special = np.array([0, -0.0, 1e-40, -1e-40, 1e-38, -3e-39, 1e-30, 1e30, 3e38, -3e38, np.inf, -np.inf, np.nan,
                        1, -1, 0.5, -6, 6], f32)
    # Ordinary ranges, ranges from subnormal to huge widths, and every pair of special values.
    lo = np.concatenate([rng.uniform(-10, 0, 500), -np.exp(rng.uniform(-90, 88, 500)),
                         np.repeat(special, special.size)]).astype(f32)
    hi = np.concatenate([rng.uniform(0, 10, 500), np.exp(rng.uniform(-90, 88, 500)),
                         np.tile(special, special.size)]).astype(f32)
    with np.errstate(all="ignore"):
        got, want = both(monkeypatch, lambda: nudge(lo, hi, num_bits=num_bits, narrow_range=narrow))
        scalars = [both(monkeypatch, lambda: nudge(lo[i], hi[i], num_bits=num_bits, narrow_range=narrow))
                   for i in range(0, lo.size, 97)]
    for a, b in [(got, want)] + scalars:
        assert np.array_equal(a.passthrough, b.passthrough)
        for field in _NUDGED:
            assert np.shape(getattr(a, field)) == np.shape(getattr(b, field))
            same_bits(getattr(a, field), getattr(b, field))


def format_inputs(rng, blocks, size, nan):
    """Blocks at scales from subnormal to huge, with zero blocks, Inf and (``nan``) NaN elements, ties on the
    element grids and maxima just above powers of two (rceil's log2)."""
    x = (rng.standard_normal((blocks, size)) * np.exp2(rng.integers(-140, 120, (blocks, 1)))).astype(f32)
    x[::7] = 0
    x[3::11, 0] = np.exp2(rng.integers(-120, 120, x[3::11, 0].shape)).astype(f32) * f32(1 + 2.0**-20)
    x[5::13] = rng.choice(np.array([0.25, 0.75, 1.25, 2.5, 5.0, 3.5, -0.75, 448, 480, 57344], f32), x[5::13].shape)
    flat = x.reshape(-1)
    flat[rng.integers(0, flat.size, flat.size // 300)] = rng.choice(np.array([np.inf, -np.inf], f32))
    if nan:
        flat[rng.integers(0, flat.size, 3)] = np.nan
    return x


def same_format_result(got, want):
    for a, b in zip(got, want):
        if a is None:
            assert b is None
            continue
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.kind == "f" and a.dtype.itemsize == 4:
            same_bits(a, b)
        else:
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8))


@needs_kernels
@pytest.mark.parametrize("nan", [False, True])
@pytest.mark.parametrize("size", [32, 3, 16, 64])  # 32: compiled as a constant; 64: runs of 32 (AVX2 loops)
def test_mx_matches_the_numpy_path(monkeypatch, size, nan):
    from qgcli.ops import mx

    rng = np.random.default_rng(size + nan)
    x = format_inputs(rng, 4000, size, nan)
    for fmt in mx.FORMATS:
        for mode in mx.SCALE_MODES:
            if fmt == "mxfp4" and size % 2:
                continue
            with np.errstate(all="ignore"):
                got, want = both(monkeypatch, lambda: mx.mx_fake_quantize(x, format=fmt, block_size=size,
                                                                          scale_mode=mode))
            same_format_result(got, want)


@needs_kernels
@pytest.mark.parametrize("nan", [False, True])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_nvfp4_matches_the_numpy_path(monkeypatch, per_tensor, nan):
    from qgcli.ops import nvfp4

    rng = np.random.default_rng(per_tensor + 2 * nan)
    x = format_inputs(rng, 4001, 16, nan)  # the last group of 64 blocks is odd: the AVX2 loop's pairs and one alone
    if per_tensor:
        x[np.isinf(x)] = 1e30  # an Inf makes the whole tensor NaN (the NumPy path's business)
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the per-tensor scale's NaN warning, raised on both paths
        got, want = both(monkeypatch, lambda: nvfp4.nvfp4_fake_quantize(x, per_tensor_scale=per_tensor))
    same_format_result(got, want)


@needs_kernels
@pytest.mark.parametrize("special", [None, np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("at", [0, 3_999, 40_015])  # 40,016 elements: two runs of 20,008
def test_nvfp4_tensor_amax_split_over_the_pool(monkeypatch, special, at):
    """The per-tensor amax pass runs in pieces on the thread pool (AMAX_RUN made small here): the tensor scale is
    the one pass's and NumPy's, wherever the largest value, an Inf or a NaN lies."""
    from qgcli.ops import nvfp4

    monkeypatch.setattr(nvfp4, "AMAX_RUN", 1000)
    monkeypatch.setenv("QGCLI_THREADS", "2")
    x = np.random.default_rng(at).standard_normal((2_501, 16)).astype(f32)
    x.reshape(-1)[at] = 7.5 if special is None else special
    got, want = both(monkeypatch, lambda: nvfp4._tensor_scale(x, np))
    same_bits(np.asarray(got), np.asarray(want))


@needs_kernels
@pytest.mark.parametrize("dtype", ["uint8", "int8", "uint16", "int16", "uint4", "int4"])
@pytest.mark.parametrize("axis", [None, 0, 1, 2])
def test_onnx_integer_matches_the_numpy_path(monkeypatch, dtype, axis):
    """QuantizeLinear + DequantizeLinear per tensor and per axis: the compiled kernel gives the NumPy path's
    codes and outputs, on NaN/Inf, signed zeros, subnormals, exact half steps and overflowing values."""
    from qgcli.ops import onnx_quantize

    rng = np.random.default_rng(len(dtype) + (axis or 0))
    x = hostile(rng, (6, 40, 70), scale=4.0)
    x.reshape(-1)[:8] = np.array([0.5, -0.5, 1.5, -2.5, 1e30, -1e30, 7.5, -7.5], f32) * f32(0.25)  # ties
    store, lo, hi = onnx_quantize.INTEGER_TYPES[dtype]
    n = 1 if axis is None else x.shape[axis]
    scale = rng.uniform(0.01, 0.5, n).astype(f32)
    scale[0] = 0.25
    zp = rng.integers(lo, hi + 1, n).astype(store)
    if axis is None:
        scale, zp = scale.reshape(()), zp.reshape(())
    for z in (zp, None):
        got, want = both(monkeypatch, lambda: onnx_quantize.onnx_fake_quantize(x, scale, z, dtype=dtype,
                                                                               axis=axis or 0))
        assert got.quantized.dtype == want.quantized.dtype and np.array_equal(got.quantized, want.quantized)
        same_bits(got.outputs, want.outputs)


def float_grid_inputs(rng, shape, dtype):
    """Every value of the float type, the midpoints between neighbours (ties), values just off them, random
    values from far below its smallest subnormal to past its largest value, signed zeros; no NaN or Inf."""
    import ml_dtypes

    from qgcli.ops import onnx_quantize

    name, fmax = onnx_quantize.FLOAT_TYPES[dtype]
    grid = np.arange(256 if name.startswith("float8") else 16, dtype=np.uint8).view(getattr(ml_dtypes, name))
    grid = np.unique(grid.astype(np.float64)[np.isfinite(grid.astype(np.float64))])
    mids = (grid[1:] + grid[:-1]) / 2
    special = np.concatenate([grid, mids, np.nextafter(mids.astype(f32), f32(np.inf)),
                              np.nextafter(mids.astype(f32), f32(-np.inf)), [0.0, -0.0, fmax * 1.03, -fmax * 1.06]])
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-24, 18, shape))).astype(f32)
    flat = x.reshape(-1)
    flat[:special.size] = special.astype(f32)
    return x


def _count_native(monkeypatch):
    from qgcli.ops import onnx_quantize

    ran, real = [], onnx_quantize._native
    monkeypatch.setattr(onnx_quantize, "_native", lambda *a: ran.append(real(*a) is not None) or real(*a))
    return ran


@needs_kernels
@pytest.mark.parametrize("dtype", ["uint8", "int16", "int4", "float8e4m3fn", "float8e5m2", "float4e2m1"])
@pytest.mark.parametrize("mode", ["tensor", "axis 0", "axis 2", "blocked 0", "blocked 2"])
def test_onnx_matches_the_numpy_path(monkeypatch, dtype, mode):
    """qg_onnx_q for every scale layout (per tensor, per axis, blocked with a partial last block, along the
    first and the last axis) and the float types: the NumPy path's (ml_dtypes') codes and outputs, bit for bit,
    on every grid value, tie and overflow; with NaN and Inf the float types fall back to the NumPy path."""
    from qgcli.ops import onnx_quantize

    rng = np.random.default_rng(len(dtype) + len(mode))
    shape = (6, 40, 70)
    integer = dtype in onnx_quantize.INTEGER_TYPES
    x = hostile(rng, shape, scale=4.0) if integer else float_grid_inputs(rng, shape, dtype)
    kind, _, axis = mode.partition(" ")
    axis = int(axis or 0)
    block = 32 if kind == "blocked" else 0
    n = {"tensor": 1, "axis": shape[axis]}.get(kind)
    sshape = () if kind == "tensor" else (n,) if kind == "axis" else tuple(
        -(-k // block) if i == axis else k for i, k in enumerate(shape))
    scale = rng.uniform(0.01, 0.5, sshape).astype(f32) if integer else np.exp2(
        rng.integers(-3, 3, sshape)).astype(f32)
    zps = [None]
    if integer:
        store, lo, hi = onnx_quantize.INTEGER_TYPES[dtype]
        zps.append(rng.integers(lo, hi + 1, sshape).astype(store))
    sats = [True] if dtype == "float4e2m1" or integer else [True, False]
    for z in zps:
        for saturate in sats:
            for specials in (False, True):
                xs = x.copy()
                if not saturate:  # past half a step above the largest value only NumPy (ml_dtypes) goes
                    sb, _ = onnx_quantize.broadcast_qparams(shape, scale, dtype=dtype, axis=axis, block_size=block)
                    limit = f32({"float8e4m3fn": 464, "float8e5m2": 61440}[dtype])
                    xs[np.abs(xs / sb) >= limit] = 0
                    xs.reshape(-1)[-1] = -np.nextafter(limit, f32(0)) * sb.reshape(-1)[-1]  # F, not NaN or Inf
                    at_limit = xs.copy()
                    at_limit.reshape(-1)[-1] = limit * sb.reshape(-1)[-1]
                    assert onnx_quantize._native(np, at_limit, dtype, scale, None, axis, block, False) is None
                if specials:
                    xs.reshape(-1)[rng.integers(0, x.size, 9)] = np.array([np.nan, np.inf, -np.inf] * 3, f32)
                ran = _count_native(monkeypatch)
                with np.errstate(all="ignore"):
                    got, want = both(monkeypatch, lambda: onnx_quantize.onnx_fake_quantize(
                        xs, scale, z, dtype=dtype, axis=axis, block_size=block, saturate=saturate))
                # the kernel ran (and was not redone) wherever there is nothing only NumPy does
                assert ran[-1] == (integer or not specials)
                assert got.quantized.dtype == want.quantized.dtype
                assert np.array_equal(got.quantized.view(np.uint8), want.quantized.view(np.uint8))
                same_bits(got.outputs, want.outputs)


@needs_kernels
@pytest.mark.parametrize("threads", ["1", "2"])
def test_block_size_does_not_change_bits(monkeypatch, threads):
    # The compiled kernels take blocks sized to the tensor (blocked.native_block): a few per worker, up to
    # NATIVE_BLOCK_MAX values. Small limits cut the same tensor into many blocks (leaf blocks of one leaf, rows
    # of a channel row each): the same bits as the blocks of the default sizes.
    from qgcli.ops import blocked

    monkeypatch.setenv("QGCLI_THREADS", threads)
    rng = np.random.default_rng(8)
    shape = (7, 61, 200, 13)  # 1.1 M values: the per-tensor gradient's plan has 136 leaves
    g, x = hostile(rng, shape), hostile(rng, shape)
    mn, mx = np.linspace(-3, -0.5, 13).astype(f32), np.linspace(0.5, 3, 13).astype(f32)
    mn[4] = mx[4] = 0  # a 0..0 channel

    def run():
        return (ops.fake_quant_with_min_max_vars(x, -2.5, 2.0), ops.fake_quant_with_min_max_vars_per_channel(x, mn, mx),
                ops.fake_quant_with_min_max_args_gradient(g, x, -2.5, 2.0),
                *ops.fake_quant_with_min_max_vars_gradient(g, x, -2.5, 2.0),
                *ops.fake_quant_with_min_max_vars_per_channel_and_gradient(g, x, mn, mx),
                *ops.fake_quant_with_min_max_args_and_gradient(g, x, -2.5, 2.0))

    default = [blocked.native_block(x.size)]
    want = run()
    monkeypatch.setattr(blocked, "BLOCK_ELEMENTS", 4096)
    monkeypatch.setattr(blocked, "NATIVE_BLOCK_MAX", 4096)
    assert blocked.native_block(x.size) == 4096 < default[0]
    for a, b in zip(run(), want):
        same_bits(a, b)


@needs_kernels
@pytest.mark.parametrize("depth", [8, 13, 40])
@pytest.mark.parametrize("zero_channel", [False, True])
@pytest.mark.parametrize("tiny", [False, True])
def test_per_channel_rows_eight_channels_at_a_time(monkeypatch, depth, zero_channel, tiny):
    # The AVX2 row of the per-channel leaves (qg_row_avx2) takes 8 channels a step and the C loop the rest;
    # without a 0..0 channel it drops the passthrough blend, and a grid step below 2**-100 makes the forward
    # flush (fake_quant._FLUSH_SCALE). The fused op and the gradient against the NumPy kernels, leaf and
    # packet tails included (8227 rows: one leaf of 8192 and one of 35).
    from qgcli.ops.fake_quant import nudge

    rng = np.random.default_rng(depth)
    g, x = hostile(rng, (8227, depth)), hostile(rng, (8227, depth))
    g[~np.isfinite(g)] = 1.0  # a NaN or inf gradient makes its channel's sums NaN: finite ones compare the sums
    mn, mx = -rng.uniform(0.5, 2, depth).astype(f32), rng.uniform(0.5, 2, depth).astype(f32)
    if tiny:
        # a grid step of about 1.25e-38: a subnormal input is up to 0.94 of a step, which flushing it to 0 rounds away
        mn[depth - 1], mx[depth - 1] = -1.6e-36, 1.6e-36
        x[:, depth - 1] *= f32(1e-36)
        x[::5, depth - 1] = np.resize(np.array([1.1e-38, -1.1e-38, 6e-39, -1.2e-38, 1e-45], f32), x[::5].shape[0])
    if zero_channel:
        mn[2] = mx[2] = 0.0
    grid = nudge(mn, mx)
    x[3::11] = grid.mask_lo  # values on the mask's bounds: inside, neither below nor above
    x[4::11] = grid.mask_hi
    got, want = both(monkeypatch, lambda: ops.fake_quant_with_min_max_vars_per_channel_and_gradient(g, x, mn, mx))
    got_g, want_g = both(monkeypatch, lambda: ops.fake_quant_with_min_max_vars_per_channel_gradient(g, x, mn, mx))
    for a, b in zip(got + got_g, want + want_g):
        same_bits(a, b)
    assert not np.isnan(got_g[1]).any()
