"""Odd but valid tensors work, through the CLI and the library (issue 9).

Fortran-order and non-contiguous arrays, big-endian files, float64/float16 inputs (computed in float32
as TensorFlow would after a cast, and said in the summary), huge channel counts, a single channel, one
element, zero-size tensors, and NaN/Inf/subnormal values with TensorFlow's confirmed behaviour
(``/work/shared/research/tf_semantics.md``: NaN stays NaN and blocks the gradient, +/-inf clamp to the
nudged bounds and count in backprop_wrt_max/min, subnormals act as zero).
"""
import io
import json

import h5py
import numpy as np
import pytest

from qgcli import ops

f32 = np.float32
RNG = np.random.default_rng(99)


def load_npz(data):
    with np.load(io.BytesIO(data) if isinstance(data, bytes) else data, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def run(cli, *args, input=None):
    """Run a command writing npz to stdout; returns the arrays."""
    r = cli(*args, "-o", "-", "-q", input=input)
    assert r.exit_code == 0, r.output
    return load_npz(r.stdout_bytes)


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    a, b = np.ascontiguousarray(a).reshape(-1), np.ascontiguousarray(b).reshape(-1)
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def pc_args(t, x, g, mn, mx, prefix):
    for name, arr in (("x", x), ("g", g), ("mn", mn), ("mx", mx)):
        np.save(t / f"{prefix}{name}.npy", arr)
    return ["--inputs", t / f"{prefix}x.npy", "--gradients", t / f"{prefix}g.npy", "--min", t / f"{prefix}mn.npy",
            "--max", t / f"{prefix}mx.npy"]


# --- memory layout and byte order ------------------------------------------------------------------------

def test_fortran_order_and_big_endian_files_give_the_same_bits(cli, tmp_path):
    x = RNG.standard_normal((6, 5, 4)).astype(f32) * 2
    g = RNG.standard_normal((6, 5, 4)).astype(f32)
    mn, mx = -np.linspace(0.5, 2, 4).astype(f32), np.linspace(1, 3, 4).astype(f32)
    want = run(cli, "fakequant-grad", *pc_args(tmp_path, x, g, mn, mx, "c_"))
    fortran = run(cli, "fakequant-grad", *pc_args(tmp_path, np.asfortranarray(x), np.asfortranarray(g), mn, mx, "f_"))
    big = run(cli, "fakequant-grad", *pc_args(tmp_path, x.astype(">f4"), g.astype(">f4"), mn.astype(">f4"),
                                               mx.astype(">f4"), "b_"))
    assert np.load(tmp_path / "f_x.npy").flags.f_contiguous and np.load(tmp_path / "b_x.npy").dtype == ">f4"
    for got in (fortran, big):
        assert set(got) == set(want)
        for k in want:
            same_bits(got[k], want[k])  # native float32 out, whatever came in
    lib = ops.fake_quant_with_min_max_vars_per_channel_gradient(g, x, mn, mx)
    for k, v in zip(("backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max"), lib):
        same_bits(want[k], v)


def test_big_endian_hdf5_dataset(cli, tmp_path):
    x = RNG.standard_normal((3, 7)).astype(f32)
    with h5py.File(tmp_path / "be.h5", "w") as f:
        f.create_dataset("inputs", data=x, dtype=">f4")
        f.create_dataset("min", data=-1.0, dtype=">f8")
        f.create_dataset("max", data=1.5, dtype=">f8")
    got = run(cli, "fakequant", tmp_path / "be.h5")
    same_bits(got["outputs"], ops.fake_quant_with_min_max_vars(x, -1.0, 1.5))


def _views(a, xp):
    """Non-contiguous arrays on ``xp``'s device equal to ``a`` (3-d), with a contiguous copy of each."""
    a = xp.asarray(a)
    big = xp.repeat(a, 2, axis=1)
    views = [big[:, ::2], xp.asfortranarray(a), a[::-1][::-1], xp.swapaxes(xp.ascontiguousarray(xp.swapaxes(a, 0, 1)),
                                                                             0, 1)]
    assert not any(v.flags.c_contiguous for v in views[:2] + views[3:])
    return [(v, xp.ascontiguousarray(v)) for v in views]


def test_non_contiguous_views_in_every_fake_quant_op(xp):
    x = RNG.standard_normal((5, 6, 4)).astype(f32) * 2
    g = RNG.standard_normal((5, 6, 4)).astype(f32)
    mn, mx = -np.linspace(0.5, 2, 4).astype(f32), np.linspace(1, 3, 4).astype(f32)
    for (xv, xc), (gv, gc) in zip(_views(x, xp), _views(g, xp)):
        pairs = [
            (ops.fake_quant_with_min_max_args(xv, -1.5, 2.0), ops.fake_quant_with_min_max_args(xc, -1.5, 2.0)),
            (ops.fake_quant_with_min_max_args_gradient(gv, xv, -1.5, 2.0),
             ops.fake_quant_with_min_max_args_gradient(gc, xc, -1.5, 2.0)),
            (ops.fake_quant_with_min_max_vars(xv, -1.5, 2.0), ops.fake_quant_with_min_max_vars(xc, -1.5, 2.0)),
            (ops.fake_quant_with_min_max_vars_per_channel(xv, mn, mx),
             ops.fake_quant_with_min_max_vars_per_channel(xc, mn, mx)),
            *zip(ops.fake_quant_with_min_max_vars_gradient(gv, xv, -1.5, 2.0),
                 ops.fake_quant_with_min_max_vars_gradient(gc, xc, -1.5, 2.0)),
            *zip(ops.fake_quant_with_min_max_vars_per_channel_gradient(gv, xv, mn, mx),
                 ops.fake_quant_with_min_max_vars_per_channel_gradient(gc, xc, mn, mx)),
        ]
        for got, want in pairs:
            same_bits(_host(got), _host(want))


def _host(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def test_non_contiguous_views_in_batch_norm_grad(xp):
    x = RNG.standard_normal((2, 3, 5, 4)).astype(f32)
    dy = RNG.standard_normal((2, 3, 5, 4)).astype(f32)
    scale, mean = np.linspace(0.5, 2, 4).astype(f32), x.mean(axis=(0, 1, 2))
    var = x.var(axis=(0, 1, 2))
    wide = xp.repeat(xp.asarray(x), 2, axis=2)[:, :, ::2]  # made on the device: still non-contiguous there
    dy_f = xp.asfortranarray(xp.asarray(dy))
    assert not wide.flags.c_contiguous and not dy_f.flags.c_contiguous
    got = ops.fused_batch_norm_grad(dy_f, wide, scale, mean, var)
    want = ops.fused_batch_norm_grad(xp.asarray(dy), xp.asarray(x), scale, mean, var)
    for a, b in zip(got, want):
        same_bits(_host(a), _host(b))


# --- dtypes: computed in float32, as TensorFlow would after a cast -----------------------------------

@pytest.mark.parametrize("dtype", [np.float64, np.float16, ">f8"])
def test_other_float_dtypes_are_computed_in_float32_and_said(cli, tmp_path, dtype):
    x = RNG.standard_normal((4, 9)) * 3
    g = RNG.standard_normal((4, 9))
    np.save(tmp_path / "x.npy", x.astype(dtype))
    np.save(tmp_path / "g.npy", g.astype(dtype))
    r = cli("fakequant-grad", "--inputs", tmp_path / "x.npy", "--gradients", tmp_path / "g.npy", "--min", "-2.5",
            "--max", "3", "-o", tmp_path / "o.npz", "--json")
    assert r.exit_code == 0, r.output
    notes = " ".join(json.loads(r.stdout)["notes"])
    name = str(np.dtype(dtype))
    assert f"inputs is {name}" in notes and f"gradients is {name}" in notes and "float32" in notes, notes
    got = load_npz(tmp_path / "o.npz")
    x32, g32 = x.astype(dtype).astype(f32), g.astype(dtype).astype(f32)
    for k, v in zip(("backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max"),
                    ops.fake_quant_with_min_max_vars_gradient(g32, x32, -2.5, 3.0)):
        same_bits(got[k], v)
    r = cli("fakequant", "--inputs", tmp_path / "x.npy", "--min", "-2.5", "--max", "3", "-o", tmp_path / "f.npz")
    assert r.exit_code == 0 and name in r.stderr and "float32" in r.stderr
    same_bits(load_npz(tmp_path / "f.npz")["outputs"], ops.fake_quant_with_min_max_vars(x32, -2.5, 3.0))


def test_bn_grad_float64_is_computed_in_float32_and_said(cli, tmp_path):
    x = RNG.standard_normal((2, 3, 3, 4))
    dy = RNG.standard_normal((2, 3, 3, 4))
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "dy.npy", dy)
    args = ["bn-grad", "--y-backprop", tmp_path / "dy.npy", "--x", tmp_path / "x.npy", "--scale", "1,2,3,4",
            "--reserve-space-1", "0,0,0,0", "--reserve-space-2", "1,1,1,1"]
    r = cli(*args, "-o", tmp_path / "o.npz", "--json")
    assert r.exit_code == 0, r.output
    notes = " ".join(json.loads(r.stdout)["notes"])
    assert "x is float64" in notes and "float32" in notes
    got = load_npz(tmp_path / "o.npz")
    want = ops.fused_batch_norm_grad(dy.astype(f32), x.astype(f32), np.array([1, 2, 3, 4], f32), np.zeros(4, f32),
                                     np.ones(4, f32))
    for k, v in zip(("x_backprop", "scale_backprop", "offset_backprop"), want):
        same_bits(got[k], v)


# --- channel counts, one element, zero size ---------------------------------------------------------------

def test_huge_channel_count(cli, tmp_path):
    channels = 50_000
    x = RNG.standard_normal((3, channels)).astype(f32) * 2
    g = RNG.standard_normal((3, channels)).astype(f32)
    mn = -RNG.uniform(0.5, 3, channels).astype(f32)
    mx = RNG.uniform(0.5, 3, channels).astype(f32)
    args = pc_args(tmp_path, x, g, mn, mx, "")
    r = cli("fakequant-grad", *args, "-o", tmp_path / "o.npz")
    assert r.exit_code == 0, r.output
    assert len(r.stderr.splitlines()) < 30 and "more" in r.stderr  # a summary, not 50k rows
    got = load_npz(tmp_path / "o.npz")
    assert got["backprop_wrt_min"].shape == (channels,)
    for c in (0, 1, 12345, channels - 1):  # each channel is its own per-tensor op
        dx, dmin, dmax = ops.fake_quant_with_min_max_vars_gradient(g[:, c], x[:, c], mn[c], mx[c])
        same_bits(got["backprops_wrt_input"][:, c], dx)
        np.testing.assert_allclose([got["backprop_wrt_min"][c], got["backprop_wrt_max"][c]], [dmin, dmax], rtol=1e-6)
    r = cli("report", *args, "--top", "3", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert len(doc["rows"]) == 3


def test_single_channel_equals_the_per_tensor_op(cli, tmp_path):
    x = RNG.standard_normal((40, 1)).astype(f32) * 2
    g = RNG.standard_normal((40, 1)).astype(f32)
    got = run(cli, "fakequant-grad", *pc_args(tmp_path, x, g, np.array([-1.2], f32), np.array([0.9], f32), ""))
    dx, dmin, dmax = ops.fake_quant_with_min_max_vars_gradient(g, x, np.float32(-1.2), np.float32(0.9))
    same_bits(got["backprops_wrt_input"], dx)
    assert got["backprop_wrt_min"].shape == (1,)
    np.testing.assert_allclose([got["backprop_wrt_min"][0], got["backprop_wrt_max"][0]], [dmin, dmax], rtol=1e-6)


@pytest.mark.parametrize("shape", [(), (1,), (1, 1, 1, 1)])
def test_one_element_everywhere(cli, tmp_path, shape):
    x = np.full(shape, 0.3, f32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "g.npy", np.ones(shape, f32))
    fq = ["--inputs", tmp_path / "x.npy", "--min", "-1", "--max", "1"]
    out = run(cli, "fakequant-grad", *fq, "--gradients", tmp_path / "g.npy")
    same_bits(out["backprops_wrt_input"], np.ones(shape, f32))
    same_bits(run(cli, "fakequant", *fq)["outputs"], ops.fake_quant_with_min_max_vars(x, -1.0, 1.0))
    for args in (["report", *fq, "--json"], ["compare-semantics", *fq, "--json"], ["inspect", tmp_path / "x.npy"],
                 ["plot", "staircase", *fq, "-o", tmp_path / "s.png", "--force"]):
        r = cli(*args)
        assert r.exit_code == 0, (args, r.output)
    if len(shape) == 4:  # batch norm over a single value per channel (N*H*W = 1)
        r = cli("bn-grad", "--y-backprop", tmp_path / "g.npy", "--x", tmp_path / "x.npy", "--scale", "1",
                "--reserve-space-1", "0.3", "--reserve-space-2", "0", "-o", tmp_path / "bn.npz")
        assert r.exit_code == 0, r.output


@pytest.mark.parametrize("shape", [(0,), (0, 4), (3, 0, 2)])
def test_zero_size_tensors_give_empty_outputs(cli, tmp_path, shape):
    """TensorFlow accepts empty tensors and returns empty results; so does qgcli (per-tensor ranges, or
    per-channel ranges with at least one channel)."""
    np.save(tmp_path / "x.npy", np.zeros(shape, f32))
    fq = ["--inputs", tmp_path / "x.npy", "--gradients", tmp_path / "x.npy"]
    got = run(cli, "fakequant-grad", *fq, "--min", "-1", "--max", "1")
    assert got["backprops_wrt_input"].shape == shape and got["backprop_wrt_min"].shape == ()
    if shape[-1]:
        lo, hi = ",".join(["-1"] * shape[-1]), ",".join(["1"] * shape[-1])
        got = run(cli, "fakequant-grad", *fq, "--min", lo, "--max", hi)
        same_bits(got["backprop_wrt_min"], np.zeros(shape[-1], f32))
    else:
        r = cli("fakequant-grad", *fq, "--min", tmp_path / "x.npy", "--max", tmp_path / "x.npy", "--axis", "-1",
                "--variant", "per-channel", "-o", tmp_path / "o.npz")
        assert r.exit_code == 2 and "no channels" in r.stderr
    r = cli("inspect", tmp_path / "x.npy", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["files"][0]["tensors"][0]["size"] == 0


# --- NaN, infinities, subnormals: TensorFlow's behaviour ---------------------------------------------

SPECIAL = np.array([np.nan, np.inf, -np.inf, 1e-45, -1e-45, 0.5, -0.0], f32)


def test_nan_inf_subnormal_forward_and_gradient(cli, tmp_path):
    np.save(tmp_path / "x.npy", SPECIAL)
    np.save(tmp_path / "g.npy", np.ones_like(SPECIAL))
    fq = ["--inputs", tmp_path / "x.npy", "--min", "-1", "--max", "1"]
    grid = ops.nudge(np.float32(-1), np.float32(1))
    out = run(cli, "fakequant", *fq)["outputs"]
    assert np.isnan(out[0])  # NaN stays NaN
    assert out[1] == grid.nudged_max and out[2] == grid.nudged_min  # +/-inf clamp to the nudged bounds
    assert out[3] == 0 and out[4] == 0  # subnormals are zero (DAZ)
    grads = run(cli, "fakequant-grad", *fq, "--gradients", tmp_path / "g.npy")
    same_bits(grads["backprops_wrt_input"], np.array([0, 0, 0, 1, 1, 1, 1], f32))  # NaN and +/-inf blocked
    assert grads["backprop_wrt_min"] == 1 and grads["backprop_wrt_max"] == 1  # -inf below, +inf above, NaN nowhere
    # TF's confirmed answers (tf_semantics.md, C10): Args forward of [nan, inf, -inf] on [-1, 1]
    np.save(tmp_path / "c10.npy", SPECIAL[:3])
    c10 = run(cli, "fakequant", "--inputs", tmp_path / "c10.npy", "--min", "-1", "--max", "1", "--variant", "args")
    same_bits(c10["outputs"][1:], np.array([1.003921627998352, -0.9960784912109375], f32))
    # ArgsGradient([1, 1], [1e-45, -1e-45], min=-1, max=0) -> [1, 1]: subnormals sit inside [-1, 0]
    np.save(tmp_path / "sub.npy", SPECIAL[3:5])
    np.save(tmp_path / "g2.npy", np.ones(2, f32))
    sub = run(cli, "fakequant-grad", "--inputs", tmp_path / "sub.npy", "--gradients", tmp_path / "g2.npy",
              "--min", "-1", "--max", "0", "--variant", "args")
    same_bits(sub["backprops"], np.ones(2, f32))


def test_nan_and_inf_data_give_strict_json_everywhere(cli, tmp_path):
    x = np.concatenate([SPECIAL, RNG.standard_normal(20).astype(f32)]).reshape(3, 9)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "g.npy", np.where(np.isfinite(x), 1, np.nan).astype(f32))
    fq = ["--inputs", tmp_path / "x.npy", "--gradients", tmp_path / "g.npy", "--min", "-1", "--max", "1"]
    for args in (["fakequant-grad", *fq, "-o", tmp_path / "o.h5", "--force"], ["report", *fq],
                 ["compare-semantics", *fq], ["inspect", tmp_path / "x.npy", tmp_path / "g.npy"],
                 ["nudge", "--min", "-1", "--max", "1"]):
        r = cli(*args, "--json")
        assert r.exit_code == 0, (args, r.output)
        json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"{args[0]}: {c} is not JSON"))
    r = cli("plot", "ste", *fq, "-o", tmp_path / "ste.png")
    assert r.exit_code == 0, r.output
