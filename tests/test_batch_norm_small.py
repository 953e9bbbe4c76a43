"""bn-grad's small call (issue 42): a float32 tensor of one chunk runs as one compiled call (``qg_bn_grad``)
behind a plan cached per shape and attributes. It must give the general path's bits on every shape, layout
and mode, and refuse what the general path refuses, with the same message and nothing written."""
import numpy as np
import pytest

from qgcli.errors import OperandError
from qgcli.ops import batch_norm as bn
from qgcli.ops import native

pytestmark = pytest.mark.skipif(native.library() is None, reason="the compiled kernels are not built")

FORMATS = {"NHWC": False, "NCHW": True, "NDHWC": False, "NCDHW": True}


def _operands(shape, channels_first, seed, nan=False, inv_std=False):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape, dtype=np.float32) * 3 + 0.5).astype(np.float32)
    dy = rng.standard_normal(shape, dtype=np.float32)
    c = shape[1] if channels_first else shape[-1]
    scale = rng.uniform(0.5, 1.5, c).astype(np.float32)
    mean = rng.standard_normal(c).astype(np.float32)
    var = rng.uniform(0.0, 4.0, c).astype(np.float32)
    if inv_std:
        var = (1.0 / np.sqrt(var + 1e-3)).astype(np.float32)
    if nan:
        x.flat[rng.integers(0, x.size, 3)] = np.nan
        dy.flat[rng.integers(0, dy.size, 2)] = np.inf
        var[rng.integers(0, c)] = np.nan
    return dy, x, scale, mean, var


def _general(dy, x, scale, mean, var, **attrs):
    # Per-channel operands as Python lists: not float32 arrays, so the small call steps aside and the
    # general path (float64 -> float32, the same values) computes the result.
    lists = [v.tolist() for v in (scale, mean, var)]
    assert bn._small_call(dy, x, *lists, attrs.get("epsilon", 1e-4), attrs.get("data_format", "NHWC"),
                          attrs.get("is_training", True), attrs.get("variance_kind", "variance"), None) is None
    return bn.fused_batch_norm_grad(dy, x, *lists, **attrs)


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and a.view(np.uint32).tobytes() == b.view(np.uint32).tobytes()


def _shapes():
    for fmt, first in FORMATS.items():
        rank = 5 if "D" in fmt else 4
        for c in (1, 2, 3, 7, 15, 16, 17, 33, 64):
            spatial = (3, 2, 5)[: rank - 2]
            yield fmt, ((2, c) + spatial) if first else ((2,) + spatial + (c,))
        yield fmt, (1,) * rank  # one value per channel


@pytest.mark.parametrize("version", ["v1", "v2", "v3"])
@pytest.mark.parametrize("is_training", [True, False])
@pytest.mark.parametrize("variance_kind", ["variance", "inv-std"])
def test_the_small_call_gives_the_general_paths_bits(version, is_training, variance_kind):
    spec = bn.VERSIONS[version]
    for i, (fmt, shape) in enumerate(_shapes()):
        if fmt not in spec.data_formats:
            continue
        for nan in (False, True):
            dy, x, scale, mean, var = _operands(shape, FORMATS[fmt], i, nan=nan, inv_std=variance_kind == "inv-std")
            attrs = dict(epsilon=1e-3, data_format=fmt, is_training=is_training, variance_kind=variance_kind)
            small = bn._small_call(dy, x, scale, mean, var, 1e-3, fmt, is_training, variance_kind, None)
            assert small is not None, (fmt, shape)
            via_op = bn.fused_batch_norm_grad(dy, x, scale, mean, var,
                                              **(dict(reserve_space_3=var) if spec.takes_reserve_space_3 else {}),
                                              **attrs)
            general = _general(dy, x, scale, mean, var, **attrs)
            for got, op_got, want in zip(small, via_op, general):
                assert _same_bits(got, want), (fmt, shape, nan)
                assert _same_bits(op_got, want), (fmt, shape, nan)


@pytest.mark.parametrize("fmt", ["NHWC", "NCHW"])
def test_near_the_one_chunk_threshold(fmt):
    first = FORMATS[fmt]
    c = 24
    a = (1 << 20) // (c * 4)  # the most rows of one chunk at 4 values per row and channel
    for rows, one_chunk in ((a, True), (a + 1, False)):
        shape = (rows, c, 2, 2) if first else (rows, 2, 2, c)
        acb = bn.acb_shape(shape, first)
        assert (len(bn._native_chunks(acb)) == 1) == one_chunk
        dy, x, scale, mean, var = _operands(shape, first, rows)
        small = bn._small_call(dy, x, scale, mean, var, 1e-4, fmt, True, "variance", None)
        assert (small is not None) == one_chunk
        if one_chunk:
            general = _general(dy, x, scale, mean, var, data_format=fmt)
            assert all(_same_bits(s, g) for s, g in zip(small, general))


def test_in_place_and_out_arrays():
    dy, x, scale, mean, var = _operands((3, 4, 5, 16), False, 7)
    want = _general(dy, x, scale, mean, var)
    out = np.full(dy.shape, 9.0, np.float32)
    got = bn.fused_batch_norm_grad(dy, x, scale, mean, var, out=out)
    assert got[0] is out and _same_bits(out, want[0])
    inplace = dy.copy()
    got = bn.fused_batch_norm_grad(inplace, x, scale, mean, var, out=inplace)
    assert got[0] is inplace and _same_bits(inplace, want[0]) and _same_bits(got[1], want[1])


@pytest.mark.parametrize("variance_kind, bad", [("variance", -1.0), ("inv-std", 0.0), ("inv-std", -2.0)])
def test_a_bad_variance_is_refused_as_before_with_nothing_written(variance_kind, bad):
    dy, x, scale, mean, var = _operands((2, 3, 3, 8), False, 3)
    var[5] = bad
    before = dy.copy()
    assert bn._small_call(dy, x, scale, mean, var, 1e-4, "NHWC", True, variance_kind, dy) is None
    with pytest.raises(OperandError, match="at channel 5") as err:
        bn.fused_batch_norm_grad(dy, x, scale, mean, var, variance_kind=variance_kind, out=dy)
    assert err.value.operand == "reserve_space_2" and dy.tobytes() == before.tobytes()


def test_bad_attributes_and_out_keep_the_general_paths_errors():
    dy, x, scale, mean, var = _operands((2, 3, 3, 8), False, 4)
    with pytest.raises(Exception, match="unknown data format"):
        bn.fused_batch_norm_grad(dy, x, scale, mean, var, data_format="NWHC")
    with pytest.raises(Exception, match="finite number"):
        bn.fused_batch_norm_grad(dy, x, scale, mean, var, epsilon=-1.0)
    with pytest.raises(Exception, match="unknown kind"):
        bn.fused_batch_norm_grad(dy, x, scale, mean, var, variance_kind="std")
    var[0] = -1.0  # reserve_space_2 is checked before out, as on the general path
    with pytest.raises(OperandError) as err:
        bn.fused_batch_norm_grad(dy, x, scale, mean, var, out=np.empty((1,), np.float32))
    assert err.value.operand == "reserve_space_2"


def test_edited_statistics_and_new_shapes_are_not_stale():
    dy, x, scale, mean, var = _operands((2, 3, 3, 8), False, 5)
    first = bn.fused_batch_norm_grad(dy, x, scale, mean, var)
    var[2] *= 4
    again = bn.fused_batch_norm_grad(dy, x, scale, mean, var)
    assert _same_bits(again[0], _general(dy, x, scale, mean, var)[0]) and not _same_bits(again[0], first[0])
    dy2, x2, scale2, mean2, var2 = _operands((2, 3, 8, 3), False, 6)  # same size, 3 channels
    assert _same_bits(bn.fused_batch_norm_grad(dy2, x2, scale2, mean2, var2)[1],
                      _general(dy2, x2, scale2, mean2, var2)[1])


def test_read_only_operands_take_the_small_call():
    dy, x, scale, mean, var = _operands((2, 3, 3, 16), False, 8)
    for a in (dy, x, scale, mean, var):
        a.flags.writeable = False
    small = bn._small_call(dy, x, scale, mean, var, 1e-4, "NHWC", True, "variance", None)
    assert small is not None
    assert all(_same_bits(s, g) for s, g in zip(small, _general(dy, x, scale, mean, var)))
