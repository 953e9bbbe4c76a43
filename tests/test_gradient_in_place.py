"""Gradients written into the upstream gradient's own buffer (``out=``), as the CLI does with what it read.

In place must give the bits of out of place on every kernel build, including the tails of the Eigen leaves,
min == max == 0 channels (gradients copied), NaN/inf and subnormal gradients; without ``out`` no operand is
written; an ``out`` that would corrupt an operand is refused.
"""
import re

import h5py
import numpy as np
import pytest

from qgcli import ops
from qgcli.backend import to_numpy
from qgcli.errors import OperandError
from qgcli.families.tf_fake_quant import run_fake_quant

f32 = np.float32


def hostile(rng, shape):
    x = (rng.standard_normal(shape) * 2).astype(f32)
    flat = x.reshape(-1)
    if flat.size:
        specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, -1.5, 1.0, 2.5], f32)
        picks = rng.integers(0, flat.size, size=max(1, flat.size // 40))
        flat[picks] = rng.choice(specials, size=picks.size)
    return x


def ranges(rng, depth):
    mn, mx = -rng.uniform(0.5, 2, depth).astype(f32), rng.uniform(0.5, 2, depth).astype(f32)
    mn[::5] = mx[::5] = 0.0  # min == max == 0: the gradient passes through untouched
    return mn, mx


def in_and_out_of_place(op, g, *args, **kw):
    """The op's results out of place, into a separate array, and into a copy of ``g`` (checked to be that copy)."""
    want = op(g, *args, **kw)
    separate = np.empty_like(g)
    into_separate = op(g, *args, out=separate, **kw)
    own = g.copy()
    in_place = op(own, *args, out=own, **kw)
    first = (lambda r: r) if isinstance(want, np.ndarray) else (lambda r: r[0])
    assert first(into_separate) is separate and first(in_place) is own
    return want, into_separate, in_place


def assert_same_bits(*results):
    """The same bits, NaN signs aside: they are not part of TF's semantics, and NumPy 1.x's float32 adds
    choose between two NaNs by the memory alignment of their operands (the sums of NaN gradients then
    differ from call to call, in place or not)."""
    as_tuple = [(r,) if isinstance(r, np.ndarray) else tuple(r) for r in results]
    for other in as_tuple[1:]:
        for a, b in zip(as_tuple[0], other):
            assert a.shape == b.shape and a.dtype == b.dtype
            a, b = a.reshape(-1), b.reshape(-1)
            nan = np.isnan(a)
            assert np.array_equal(nan, np.isnan(b))
            assert a[~nan].tobytes() == b[~nan].tobytes()


@pytest.mark.parametrize("n", [0, 1, 31, 33, 8193, 50_151, 131_075])  # leaf tails, shards, several blocks
def test_per_tensor_gradient_in_place(kernels, n):
    rng = np.random.default_rng(n)
    g, x = hostile(rng, n), hostile(rng, n)
    for lo, hi in ((-1.5, 1.0), (0.0, 2.5), (0.0, 0.0)):
        assert_same_bits(*in_and_out_of_place(ops.fake_quant_with_min_max_vars_gradient, g, x, lo, hi, num_bits=4))
        if lo < hi:
            assert_same_bits(*in_and_out_of_place(ops.fake_quant_with_min_max_args_gradient, g, x, lo, hi))


@pytest.mark.parametrize("shape", [(44_801, 3), (8193, 64), (7, 3000), (2, 3, 5, 16), (0, 4)])
def test_per_channel_gradient_in_place(kernels, shape):
    rng = np.random.default_rng(sum(shape))
    g, x = hostile(rng, shape), hostile(rng, shape)
    mn, mx = ranges(rng, shape[-1])
    for bits, narrow in ((8, False), (2, True), (16, False)):
        results = in_and_out_of_place(ops.fake_quant_with_min_max_vars_per_channel_gradient, g, x, mn, mx,
                                      num_bits=bits, narrow_range=narrow)
        assert_same_bits(*results)


def test_per_channel_on_another_axis_writes_out_too(kernels):
    rng = np.random.default_rng(1)
    g, x = hostile(rng, (6, 40, 9)), hostile(rng, (6, 40, 9))
    mn, mx = ranges(rng, 6)
    results = in_and_out_of_place(ops.fake_quant_with_min_max_vars_per_channel_gradient, g, x, mn, mx, axis=0)
    assert_same_bits(*results)


@pytest.mark.parametrize("fmt, shape", [("NHWC", (4, 9, 17, 40)), ("NCHW", (3, 6, 50, 70)),
                                        ("NCDHW", (1, 3, 4, 5, 1001))])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_x_backprop_in_place(kernels, fmt, shape, training):
    rng = np.random.default_rng(len(shape))
    x = (rng.standard_normal(shape) * 3 + 1).astype(f32)
    dy = hostile(rng, shape)
    c = shape[1] if fmt[1] == "C" else shape[-1]
    mean, var = rng.standard_normal(c).astype(f32), rng.uniform(0.5, 2, c).astype(f32)
    scale = rng.uniform(0.5, 2, c).astype(f32)
    kw = dict(epsilon=1e-3, data_format=fmt, is_training=training)
    assert_same_bits(*in_and_out_of_place(ops.fused_batch_norm_grad, dy, x, scale, mean, var, **kw))


def test_batch_norm_float16_in_place():
    rng = np.random.default_rng(2)
    x, dy = (rng.standard_normal((2, 5, 7, 8)).astype(np.float16) for _ in range(2))
    ones, zeros = np.ones(8, f32), np.zeros(8, f32)
    assert_same_bits(*in_and_out_of_place(ops.fused_batch_norm_grad, dy, x, ones, zeros, ones))


def test_without_out_no_operand_is_written(kernels):
    rng = np.random.default_rng(3)
    g, x = hostile(rng, (300, 8)), hostile(rng, (300, 8))
    mn, mx = ranges(rng, 8)
    before = [a.copy() for a in (g, x, mn, mx)]
    ops.fake_quant_with_min_max_vars_per_channel_gradient(g, x, mn, mx)
    ops.fake_quant_with_min_max_vars_gradient(g, x, -1.0, 1.0)
    ops.fake_quant_with_min_max_args_gradient(g, x, -1.0, 1.0)
    ops.fused_batch_norm_grad(g.reshape(3, 10, 10, 8), x.reshape(3, 10, 10, 8), mx, mn, mx)
    assert_same_bits(before, (g, x, mn, mx))


def test_an_out_that_would_corrupt_an_operand_is_refused():
    rng = np.random.default_rng(4)
    g, x = hostile(rng, (10, 8)), hostile(rng, (10, 8))
    op = ops.fake_quant_with_min_max_vars_gradient
    read_only = np.empty_like(g)
    read_only.setflags(write=False)
    cases = {
        "shares memory with an input": x,
        "C-contiguous float32": np.empty((8, 10), f32).T,
        "of shape [10, 8]": np.empty((80,), f32),
        "writeable": read_only,
    }
    before = g.copy()
    for message, out in cases.items():
        with pytest.raises(OperandError, match=re.escape(message)) as err:
            op(g, x, -1.0, 1.0, out=out)
        assert err.value.operand == "out"
    shifted = np.empty(81, f32)
    with pytest.raises(OperandError, match="overlaps gradients"):
        op(shifted[:80].reshape(10, 8), x, -1.0, 1.0, out=shifted[1:].reshape(10, 8))
    with pytest.raises(OperandError, match="float32"):
        op(g, x, -1.0, 1.0, out=np.empty((10, 8)))
    with pytest.raises(OperandError, match="only y_backprop itself"):
        ops.fused_batch_norm_grad(g.reshape(1, 2, 5, 8), x.reshape(1, 2, 5, 8), np.ones(8, f32),
                                  np.zeros(8, f32), np.ones(8, f32), out=x.reshape(1, 2, 5, 8))
    assert g.tobytes() == before.tobytes()


@pytest.mark.parametrize("variant", ["args", "vars", "per-channel"])
def test_the_command_reuses_its_gradients_and_keeps_the_statistics(variant):
    rng = np.random.default_rng(5)
    g, x = hostile(rng, (200, 16)), hostile(rng, (200, 16))
    mn, mx = ranges(rng, 16) if variant == "per-channel" else (f32(-1.0), f32(1.5))
    kw = dict(num_bits=8, narrow_range=False, axis=None, xp=np)
    kept = g.copy()
    want, _, want_stats = run_fake_quant(variant, kept, x, mn, mx, overwrite=False, **kw)
    assert kept.tobytes() == g.tobytes()
    got, _, got_stats = run_fake_quant(variant, g, x, mn, mx, overwrite=True, **kw)
    big = "backprops" if variant == "args" else "backprops_wrt_input"
    assert np.shares_memory(got[big], g)  # the gradients' buffer took the backprops
    assert got_stats == want_stats and got_stats["gradient_blocked"] > 0  # taken from the gradients, before
    assert_same_bits(tuple(want.values()), tuple(got.values()))


def test_read_only_or_shared_gradients_are_not_overwritten():
    rng = np.random.default_rng(6)
    x = hostile(rng, (50, 4))
    read_only = hostile(rng, (50, 4))
    read_only.setflags(write=False)
    out, _, _ = run_fake_quant("vars", read_only, x, f32(-1), f32(1), num_bits=8, narrow_range=False, axis=None,
                               xp=np, overwrite=True)
    assert not np.shares_memory(out["backprops_wrt_input"], read_only)
    out, _, _ = run_fake_quant("vars", x, x, f32(-1), f32(1), num_bits=8, narrow_range=False, axis=None, xp=np,
                               overwrite=True)
    assert not np.shares_memory(out["backprops_wrt_input"], x)


@pytest.mark.parametrize("variant", ["args", "vars", "per-channel"])
def test_the_forward_writes_over_its_own_inputs(variant):
    # fakequant in memory: the outputs take the buffer of the inputs it read (no fresh tensor-sized array), the
    # same bits; the +-inf counts of the summary's note are taken first, the inputs read-only stay untouched.
    rng = np.random.default_rng(10)
    x = hostile(rng, (300, 16))
    mn, mx = ranges(rng, 16) if variant == "per-channel" else (f32(-1.0), f32(1.5))
    kw = dict(num_bits=8, narrow_range=False, axis=None, xp=np)
    want, _, want_stats = run_fake_quant(variant, None, x.copy(), mn, mx, overwrite=False, **kw)
    own, infinities = x.copy(), {}
    got, _, got_stats = run_fake_quant(variant, None, own, mn, mx, overwrite=True, infinities=infinities, **kw)
    assert got["outputs"] is own and got_stats == want_stats
    assert infinities["inputs"] == (np.count_nonzero(x == np.inf), np.count_nonzero(x == -np.inf)) != (0, 0)
    assert_same_bits(want["outputs"], got["outputs"])
    kept = x.copy()
    kept.setflags(write=False)
    got, _, _ = run_fake_quant(variant, None, kept, mn, mx, overwrite=True, **kw)
    assert not np.shares_memory(got["outputs"], kept) and kept.tobytes() == x.tobytes()


def test_cli_forward_writes_the_outputs_and_counts_the_infinities_first(cli, tmp_path):
    # fakequant (no --plot: nothing draws the inputs afterwards) writes its outputs over the inputs it read; the
    # summary's note still counts the +-inf they held, and the input file is untouched.
    import json

    rng = np.random.default_rng(11)
    x = hostile(rng, (4, 6, 6, 8))
    mn, mx = ranges(rng, 8)
    with h5py.File(tmp_path / "b.h5", "w") as f:
        f["inputs"], f["min"], f["max"] = x, mn, mx
    r = cli("fakequant", tmp_path / "b.h5", "-o", tmp_path / "o.h5", "--json")
    assert r.exit_code == 0, r.output
    pos, neg, nan = (int(np.count_nonzero(v)) for v in (x == np.inf, x == -np.inf, np.isnan(x)))
    assert pos and neg and f"({nan} NaN, {pos} +inf, {neg} -inf of {x.size} elements)" in " ".join(
        json.loads(r.stdout)["notes"])
    want = ops.fake_quant_with_min_max_vars_per_channel(x, mn, mx)
    with h5py.File(tmp_path / "o.h5", "r") as a, h5py.File(tmp_path / "b.h5", "r") as b:
        assert a["outputs"][()].tobytes() == want.tobytes() and b["inputs"][()].tobytes() == x.tobytes()


def test_cli_outputs_and_summary_with_and_without_a_figure(cli, tmp_path):
    # --plot keeps the gradients for the figure (no reuse); both runs must write the same file and summary.
    import json

    rng = np.random.default_rng(7)
    x, g = hostile(rng, (4, 6, 6, 8)), hostile(rng, (4, 6, 6, 8))
    mn, mx = ranges(rng, 8)
    with h5py.File(tmp_path / "b.h5", "w") as f:
        f["inputs"], f["gradients"], f["min"], f["max"] = x, g, mn, mx
    summaries = []
    for name, extra in (("plain", ()), ("plotted", ("--plot", tmp_path / "f.png"))):
        r = cli("fakequant-grad", tmp_path / "b.h5", "-o", tmp_path / f"{name}.h5", "--json", *extra)
        assert r.exit_code == 0, r.output
        summaries.append({k: v for k, v in json.loads(r.stdout).items() if k not in ("output", "figure")})
    assert summaries[0] == summaries[1]
    with h5py.File(tmp_path / "plain.h5", "r") as a, h5py.File(tmp_path / "plotted.h5", "r") as b:
        assert sorted(a) == sorted(b)
        for k in a:
            assert a[k][()].tobytes() == b[k][()].tobytes()
    want = ops.fake_quant_with_min_max_vars_per_channel_gradient(g, x, mn, mx)[0]
    with h5py.File(tmp_path / "plain.h5", "r") as a:
        assert a["backprops_wrt_input"][()].tobytes() == want.tobytes()


def test_out_on_the_device_of_the_operands(xp):
    rng = np.random.default_rng(8)
    g, x = (xp.asarray(hostile(rng, (64, 8))) for _ in range(2))
    mn, mx = ranges(rng, 8)
    want = ops.fake_quant_with_min_max_vars_per_channel_gradient(g, x, mn, mx)
    own = g.copy()
    got = ops.fake_quant_with_min_max_vars_per_channel_gradient(own, x, mn, mx, out=own)
    assert got[0] is own
    assert_same_bits(tuple(to_numpy(a) for a in want), tuple(to_numpy(a) for a in got))


@pytest.mark.parametrize("command", ["fakequant-grad", "bn-grad"])
def test_work_only_the_summary_needs_is_skipped_when_nobody_sees_it(tmp_path, command):
    from qgcli.execution import dispatch as executors
    from qgcli.families.tf_fake_quant import NAME as TF
    from qgcli.jobs import BatchNormJob, FakeQuantJob, OperandSpecs, OutputOptions

    rng = np.random.default_rng(9)
    path = tmp_path / "b.h5"
    with h5py.File(path, "w") as f:
        if command == "bn-grad":
            f["y_backprop"], f["x"] = rng.standard_normal((2, 2, 5, 5, 8)).astype(f32)  # finite: norms > 0
            f["scale"], f["reserve_space_1"], f["reserve_space_2"] = np.ones(8, f32), np.zeros(8, f32), np.ones(8, f32)
        else:
            f["gradients"], f["inputs"] = hostile(rng, (40, 8)), hostile(rng, (40, 8))
            f["min"], f["max"] = ranges(rng, 8)
    summaries, files = [], []
    for shown in (dict(quiet=True), dict(quiet=True, as_json=True), dict()):
        out = OutputOptions(str(tmp_path / f"o{len(files)}.h5"), **shown)
        specs = OperandSpecs(str(path), ())
        job = (BatchNormJob(specs, out) if command == "bn-grad" else
               FakeQuantJob(command, TF, True, specs, out))
        summaries.append(executors.execute(job))
        with h5py.File(out.destination, "r") as f:
            files.append({k: f[k][()].tobytes() for k in f})
    assert files[0] == files[1] == files[2]
    quiet, as_json, rendered = summaries
    if command == "bn-grad":
        assert quiet["norms"]["x_backprop"] is None and quiet["per_channel"]["x_backprop_norm"] is None
        assert as_json["norms"] == rendered["norms"] and as_json["norms"]["x_backprop"] > 0
    else:
        assert quiet == {"op": "FakeQuantWithMinMaxVarsPerChannelGradient"}  # no summary built at all
        assert as_json["statistics"] == rendered["statistics"] and 0 < as_json["statistics"]["gradient_blocked"] < 1
