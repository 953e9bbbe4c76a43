"""The fused forward + gradient ops (issue 42): one pass, the bits of the forward op and the gradient op apart,
on the compiled kernels and on NumPy's, with ``out=`` and on any channel axis."""
import numpy as np
import pytest

from qgcli import ops
from qgcli.errors import OperandError

F32 = np.float32


def _salted(shape, seed):
    """Seeded values with NaN, infinities, signed zeros, subnormals and values on the grid's edges."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 4).astype(F32)
    g = rng.standard_normal(shape).astype(F32)
    flat_x, flat_g = x.reshape(-1), g.reshape(-1)
    specials = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-40, -1e-40, 6.0, -6.0, 4.0], F32)
    k = min(flat_x.size, specials.size)
    picks = rng.choice(flat_x.size, k, replace=False)
    flat_x[picks] = specials[:k]
    flat_g[rng.choice(flat_g.size, k, replace=False)] = specials[::-1][:k]
    return g, x


def _bits(a):
    """The bits of ``a`` with every NaN as one NaN: a NaN's sign in a sum is whichever NaN operand the compiler
    put first (the golden tests' rule too: TF's NaN signs are not part of its semantics)."""
    a = np.array(a, F32)
    a[np.isnan(a)] = np.nan
    return a.tobytes()


def _same(fused, parts):
    assert len(fused) == len(parts)
    for a, b in zip(fused, parts):
        assert np.asarray(a).shape == np.asarray(b).shape and _bits(a) == _bits(b)


# shapes: one leaf, several leaves, a sharded Eigen plan (more than 50,151 values), per-channel rows
SHAPES = [(7,), (3, 5, 11), (70_001,), (600, 130)]


@pytest.mark.parametrize("native", ["", "0"])
@pytest.mark.parametrize("shape", SHAPES)
def test_vars_and_args_fused_equal_the_two_ops(shape, native, monkeypatch):
    monkeypatch.setenv("QGCLI_NATIVE", native)
    g, x = _salted(shape, 1)
    for lo, hi, bits in ((-6.0, 6.0, 8), (-1.0, 0.5, 2), (0.0, 0.0, 8), (-1e-30, 1e-30, 4), (0.25, 3.0, 8)):
        parts = (ops.fake_quant_with_min_max_vars(x, lo, hi, num_bits=bits),
                 *ops.fake_quant_with_min_max_vars_gradient(g, x, lo, hi, num_bits=bits))
        _same(ops.fake_quant_with_min_max_vars_and_gradient(g, x, lo, hi, num_bits=bits), parts)
        if lo < hi:
            parts = (ops.fake_quant_with_min_max_args(x, lo, hi, num_bits=bits, narrow_range=True),
                     ops.fake_quant_with_min_max_args_gradient(g, x, lo, hi, num_bits=bits, narrow_range=True))
            _same(ops.fake_quant_with_min_max_args_and_gradient(g, x, lo, hi, num_bits=bits, narrow_range=True),
                  parts)


@pytest.mark.parametrize("native", ["", "0"])
@pytest.mark.parametrize("shape,axis", [((3, 5, 11), -1), ((600, 130), -1), ((4, 9, 6), 1), ((40_000, 3), -1)])
def test_per_channel_fused_equals_the_two_ops(shape, axis, native, monkeypatch):
    monkeypatch.setenv("QGCLI_NATIVE", native)
    g, x = _salted(shape, 2)
    depth = shape[axis]
    rng = np.random.default_rng(3)
    lo = (-rng.uniform(0.5, 6, depth)).astype(F32)
    hi = rng.uniform(0.5, 6, depth).astype(F32)
    lo[0] = hi[0] = 0.0  # a passthrough channel
    if depth > 2:
        lo[1], hi[1] = -1e-30, 1e-30  # a grid step that needs the flush
    kw = dict(num_bits=5, axis=axis)
    parts = (ops.fake_quant_with_min_max_vars_per_channel(x, lo, hi, **kw),
             *ops.fake_quant_with_min_max_vars_per_channel_gradient(g, x, lo, hi, **kw))
    _same(ops.fake_quant_with_min_max_vars_per_channel_and_gradient(g, x, lo, hi, **kw), parts)


def test_out_may_be_the_gradients():
    g, x = _salted((50, 64), 4)
    lo, hi = np.full(64, -2.0, F32), np.full(64, 3.0, F32)
    expected = (ops.fake_quant_with_min_max_vars_per_channel(x, lo, hi),
                *ops.fake_quant_with_min_max_vars_per_channel_gradient(g, x, lo, hi))
    y, dx, dmin, dmax = ops.fake_quant_with_min_max_vars_per_channel_and_gradient(g, x, lo, hi, out=g)
    assert dx is g
    _same((y, dx, dmin, dmax), expected)
    g2, x2 = _salted((300,), 5)
    want = ops.fake_quant_with_min_max_args_gradient(g2, x2)
    y2, dx2 = ops.fake_quant_with_min_max_args_and_gradient(g2, x2, out=g2)
    assert dx2 is g2 and _bits(dx2) == _bits(want)


FORWARDS = [
    (ops.fake_quant_with_min_max_args, lambda depth: (-1.0, 0.5), {"num_bits": 3}),
    (ops.fake_quant_with_min_max_vars, lambda depth: (F32(-6.0), F32(4.0)), {"num_bits": 8}),
    (ops.fake_quant_with_min_max_vars_per_channel,
     lambda depth: (np.linspace(-3, 0, depth, dtype=F32), np.linspace(0, 5, depth, dtype=F32)), {"num_bits": 4}),
]


@pytest.mark.parametrize("native", ["", "0"])
@pytest.mark.parametrize("op,ranges,kw", FORWARDS)
def test_forward_out_takes_the_outputs_in_place_or_in_a_kept_buffer(op, ranges, kw, native, monkeypatch):
    """``out=`` on the forward ops (issue 42): the inputs' own buffer, or a buffer kept from call to call, at
    every length of 1..33 values (the vector body and its scalar tail) and at unaligned addresses; the bits
    of the op without ``out``."""
    monkeypatch.setenv("QGCLI_NATIVE", native)
    for n in range(1, 34):
        shape = (n, 3) if op is ops.fake_quant_with_min_max_vars_per_channel else (n,)
        _, x = _salted(shape, n)
        lo, hi = ranges(shape[-1])
        want = op(x, lo, hi, **kw)
        for offset in (0, 1, 3):  # a C-contiguous view of a larger buffer: 4 or 12 bytes past a 32-byte line
            kept = np.full(x.size + offset, 7.0, F32)[offset:].reshape(shape)
            got = op(x, lo, hi, out=kept, **kw)
            assert got is kept and _bits(got) == _bits(want)
            inputs = np.zeros(x.size + offset, F32)[offset:].reshape(shape)
            inputs[...] = x
            got = op(inputs, lo, hi, out=inputs, **kw)
            assert got is inputs and _bits(got) == _bits(want)


def test_forward_out_on_another_channel_axis_and_its_refusals():
    _, x = _salted((4, 9, 6), 6)
    lo, hi = np.full(9, -2.0, F32), np.full(9, 3.0, F32)
    want = ops.fake_quant_with_min_max_vars_per_channel(x, lo, hi, axis=1)
    mine = x.copy()
    assert ops.fake_quant_with_min_max_vars_per_channel(mine, lo, hi, axis=1, out=mine) is mine
    assert _bits(mine) == _bits(want)
    for bad in (x[:1], x.astype(np.float64), np.asfortranarray(x), x.reshape(-1)[1:].copy()):
        kept = x.copy()
        with pytest.raises(OperandError) as err:
            ops.fake_quant_with_min_max_vars_per_channel(kept, lo, hi, axis=1, out=bad)
        assert err.value.operand == "out" and _bits(kept) == _bits(x)
    big = np.zeros(x.size + 1, F32)
    inputs = big[:-1].reshape(x.shape)
    inputs[...] = x
    with pytest.raises(OperandError, match="overlaps inputs") as err:
        ops.fake_quant_with_min_max_args(inputs, out=big[1:].reshape(x.shape))
    assert err.value.operand == "out" and _bits(inputs) == _bits(x)
    read_only = np.zeros_like(x)
    read_only.setflags(write=False)
    with pytest.raises(OperandError, match="writeable"):
        ops.fake_quant_with_min_max_vars(x, -1.0, 1.0, out=read_only)
    with pytest.raises(OperandError, match="writeable"):  # float64 inputs: their float32 copy is not theirs
        ops.fake_quant_with_min_max_vars(x.astype(np.float64), -1.0, 1.0, out=x.astype(np.float64))


@pytest.mark.parametrize("native", ["", "0"])
@pytest.mark.parametrize("axis", [-1, 0])
def test_fused_outputs_out_takes_the_forward_outputs(axis, native, monkeypatch):
    """``outputs_out=`` (issue 42): the fused ops write their forward outputs into a kept buffer, the bits of
    the plain call, beside ``out=`` the gradients or a kept backprops buffer; any overlap is refused."""
    monkeypatch.setenv("QGCLI_NATIVE", native)
    g, x = _salted((33, 5), 8)
    lo, hi = np.linspace(-3, -1, x.shape[axis], dtype=F32), np.linspace(1, 4, x.shape[axis], dtype=F32)
    calls = [
        (ops.fake_quant_with_min_max_vars_per_channel_and_gradient, (lo, hi), {"axis": axis, "num_bits": 5}),
        (ops.fake_quant_with_min_max_vars_and_gradient, (F32(-2.0), F32(3.0)), {"num_bits": 4}),
        (ops.fake_quant_with_min_max_args_and_gradient, (-2.0, 3.0), {"narrow_range": True}),
    ]
    for op, ranges, kw in calls:
        want = op(g, x, *ranges, **kw)
        y_kept = np.full_like(x, 9.0)
        got = op(g, x, *ranges, outputs_out=y_kept, **kw)
        assert got[0] is y_kept
        _same(got, want)
        mine_g, y_kept = g.copy(), np.full_like(x, 9.0)
        got = op(mine_g, x, *ranges, out=mine_g, outputs_out=y_kept, **kw)
        assert got[0] is y_kept and got[1] is mine_g
        _same(got, want)
        kept_dx = np.zeros_like(x)
        for bad in (x, g, kept_dx, x.reshape(-1)[:0], np.zeros((33, 5), np.float64)):
            before = [a.copy() for a in (g, x)]
            with pytest.raises(OperandError) as err:
                op(g, x, *ranges, out=kept_dx, outputs_out=bad, **kw)
            assert err.value.operand == "outputs_out"
            assert _bits(g) == _bits(before[0]) and _bits(x) == _bits(before[1])


def test_bad_operands_are_refused_as_the_gradient_op_refuses_them():
    x = np.zeros((2, 3), F32)
    with pytest.raises(OperandError, match="differs from inputs shape"):
        ops.fake_quant_with_min_max_vars_and_gradient(np.zeros(3, F32), x, -1.0, 1.0)
    with pytest.raises(OperandError) as err:
        ops.fake_quant_with_min_max_vars_per_channel_and_gradient(x, x, np.zeros(2, F32), np.ones(2, F32))
    assert err.value.operand == "min"
    with pytest.raises(OperandError) as err:
        ops.fake_quant_with_min_max_args_and_gradient(x, x, out=x[:1])
    assert err.value.operand == "out"


def test_verify_and_compare_semantics_take_one_fused_pass(tmp_path, monkeypatch):
    """Where both the forward and the gradient are needed the fused op runs: with the forward op alone made
    to fail, verify still passes a layer whose reference holds both, and compare-semantics still answers."""
    from click.testing import CliRunner

    from qgcli.capture.runfile_writer import RunFileWriter
    from qgcli.cli import main
    from qgcli.ops import torch_semantics

    g, x = _salted((6, 8), 6)
    x[np.isnan(x)] = 0.5
    lo, hi = np.float32(-1.0), np.float32(0.8)
    reference = dict(zip(("outputs", "backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max"),
                         (ops.fake_quant_with_min_max_vars(x, lo, hi),
                          *ops.fake_quant_with_min_max_vars_gradient(g, x, lo, hi))))
    path = str(tmp_path / "run.h5")
    with RunFileWriter(path) as w:
        w.add("net/q", "FakeQuantWithMinMaxVars", {"inputs": x, "min": lo, "max": hi, "gradients": g},
              {"num_bits": 8, "narrow_range": False}, reference)

    def refused(*args, **kwargs):
        raise AssertionError("the forward op ran on its own")

    monkeypatch.setattr(ops, "fake_quant_with_min_max_vars", refused)
    monkeypatch.setattr("qgcli.ops.fake_quant.fake_quant_with_min_max_vars", refused)
    r = CliRunner().invoke(main, ["verify", path])
    assert r.exit_code == 0 and "1 of 1 layers pass" in r.stdout, r.output
    both = torch_semantics.compare_with_tensorflow(x, lo, hi, gradients=g)
    assert _bits(both["outputs_tf"]) == _bits(reference["outputs"])
    assert _bits(both["backprops_wrt_input_tf"]) == _bits(reference["backprops_wrt_input"])
