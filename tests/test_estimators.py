"""Gradient estimators (qgcli.ops.estimators): each against its formula on hand-computed cases, against a
reference implementation where one exists (PyTorch's learnable op for LSQ, a port of the EWGS reference code),
hypothesis properties, and ``fakequant-grad --estimator`` on the CLI.
"""
import json
import math
import os

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qgcli import ops
from qgcli.errors import QgcliError
from qgcli.ops import estimators as est
from qgcli.ops import torch_semantics as ts

from conftest import GOLDEN, SAMPLES

F32 = np.float32
NOTEBOOK = os.path.join(SAMPLES, "notebook.h5")
PER_CHANNEL = os.path.join(SAMPLES, "per_channel.h5")


def bits(a):
    return np.ascontiguousarray(np.asarray(a, F32)).view(np.uint32)


# --- parsing --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("ste", est.Estimator("ste", "ste")),
    ("identity", est.Estimator("identity", "identity")),
    ("scaled:0.9", est.Estimator("scaled", "scaled:0.9", gain=0.9, leak=0.9)),
    ("scaled:1,0", est.Estimator("scaled", "scaled:1,0", gain=1.0, leak=0.0)),
    ("Scaled: 2 , -0.5", est.Estimator("scaled", "Scaled: 2 , -0.5", gain=2.0, leak=-0.5)),
    ("lsq", est.Estimator("lsq", "lsq")),
    ("pact", est.Estimator("pact", "pact")),
    ("ewgs:0.001", est.Estimator("ewgs", "ewgs:0.001", delta=0.001)),
])
def test_parse(text, expected):
    assert est.parse_estimator(text) == expected


@pytest.mark.parametrize("text, message", [
    ("", "is empty"), ("bogus", "unknown estimator 'bogus'"), ("ste:1", "ste takes no parameters"),
    ("lsq:2", "lsq takes no parameters"), ("scaled", "write scaled:G or scaled:G,E"),
    ("scaled:", "write scaled:G"), ("scaled:1,2,3", "write scaled:G"), ("scaled:x", "the gain G must be a number"),
    ("scaled:1,nan", "must be finite"), ("ewgs", "write ewgs:DELTA"), ("ewgs:-1", "DELTA must be >= 0"),
    ("ewgs:inf", "must be finite"),
])
def test_parse_errors_name_the_option(text, message):
    with pytest.raises(QgcliError) as info:
        est.parse_estimator(text)
    assert str(info.value).startswith("--estimator: ") and message in str(info.value)


# --- hand-computed cases on a small TF grid ---------------------------------------------------------------
# num_bits=2, [min, max] = [-0.5, 2.5]: scale 1, zero point 0.5 -> 1 (half away), nudged [-1, 2],
# levels -1, 0, 1, 2; quant_min 0, quant_max 3.

X = np.array([-3.0, -1.0, -0.75, 0.25, 0.5, 1.75, 2.0, 2.2, 9.0], F32)
DY = np.array([1.0, 2.0, -1.0, 4.0, 1.0, -2.0, 3.0, 5.0, 7.0], F32)
INSIDE = np.array([0, 1, 1, 1, 1, 1, 1, 0, 0], bool)


def grid_view(x=X):
    return est.tf_view(x, -0.5, 2.5, num_bits=2)


def test_the_hand_grid():
    v = grid_view()
    assert (float(v.scale), float(v.zero_point), float(v.lo), float(v.hi)) == (1.0, 1.0, -1.0, 2.0)
    np.testing.assert_array_equal(v.inside, INSIDE)
    np.testing.assert_array_equal(v.outputs, [-1, -1, -1, 0, 1, 2, 2, 2, 2])


def test_ste_hand():
    np.testing.assert_array_equal(est.straight_through(DY, grid_view()), DY * INSIDE)


def test_identity_hand():
    np.testing.assert_array_equal(est.identity(DY, grid_view()), DY)


def test_scaled_hand():
    np.testing.assert_array_equal(est.scaled(DY, grid_view(), 0.5, 0.25), DY * np.where(INSIDE, 0.5, 0.25))
    np.testing.assert_array_equal(est.scaled(DY, grid_view(), 0.9), DY * F32(0.9))  # the notebook's leaky STE


def test_lsq_hand():
    # inside: (x_hat - x)/s: -1 -> 0, -0.75 -> -0.25, 0.25 -> -0.25, 0.5 -> 0.5 (TF rounds the half up), 1.75 -> 0.25,
    # 2 -> 0; below (n - z) = -1, above (p - z) = 2; dz = -dy*s outside.
    dx, ds, dz = est.lsq(DY, grid_view(), grad_factor=1.0)
    np.testing.assert_array_equal(dx, DY * INSIDE)
    terms = [1 * -1, 2 * 0, -1 * -0.25, 4 * -0.25, 1 * 0.5, -2 * 0.25, 3 * 0, 5 * 2, 7 * 2]
    assert float(ds) == sum(terms)
    assert float(dz) == -(1 + 5 + 7)
    _, ds_half, dz_half = est.lsq(DY, grid_view(), grad_factor=0.5)
    assert float(ds_half) == sum(terms) / 2 and float(dz_half) == -13 / 2


def test_lsq_default_grad_factor_on_tf_grid():
    v = grid_view()
    assert est.lsq_grad_factor(v) == pytest.approx(1 / math.sqrt(9 * 3))
    _, ds, _ = est.lsq(DY, v)
    _, ds1, _ = est.lsq(DY, v, grad_factor=1 / math.sqrt(27))
    assert float(ds) == float(ds1)
    pc = est.tf_view(np.zeros((5, 4), F32), [-1.0] * 4, [1.0] * 4, num_bits=8, variant="per-channel")
    assert est.lsq_grad_factor(pc) == pytest.approx(1 / math.sqrt(5 * 255))  # N per channel, Q_P = quant_max


def test_pact_hand():
    dx, da = est.pact(DY, grid_view())
    # alpha = nudged max 2: x = 2 counts as clipped (PACT: x >= alpha)
    np.testing.assert_array_equal(dx, DY * np.array([0, 1, 1, 1, 1, 1, 0, 0, 0]))
    assert float(da) == 3 + 5 + 7


def test_ewgs_hand():
    delta = 2.0
    dx = est.ewgs(DY, grid_view(), delta)
    diff = (X - np.array([-1, -1, -1, 0, 1, 2, 2, 2, 2], F32)) / 3  # (x - x_hat) / (hi - lo)
    expected = np.where(INSIDE, DY * (1 + delta * np.sign(DY) * diff), 0)
    np.testing.assert_allclose(dx, expected, rtol=1e-6)
    assert dx[3] == F32(4 * (1 + 2 * (0.25 / 3)))


def ewgs_reference(x, dy, lo, hi, levels, delta):
    """cvlab-yonsei/EWGS ``EWGS_discretizer`` after the clamp, ported to NumPy (float64)."""
    x_n = np.clip((x.astype(np.float64) - lo) / (hi - lo), 0, 1)
    x_q = np.round(x_n * (levels - 1)) / (levels - 1)
    scale = 1 + delta * np.sign(dy) * (x_n - x_q)
    return dy * scale * ((x >= lo) & (x <= hi))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1.5, 2.5, width=32), min_size=1, max_size=40), st.floats(0, 5))
def test_ewgs_matches_the_reference_code(values, delta):
    x = np.array(values, F32)
    rng = np.random.default_rng(len(values))
    dy = rng.standard_normal(x.size).astype(F32)
    got = est.ewgs(dy, grid_view(x), delta)
    # the reference rounds x_n half to even; compare away from exact half steps (TF rounds those up)
    frac = (x.astype(np.float64) + 1) % 1
    keep = np.abs(frac - 0.5) > 1e-3
    want = ewgs_reference(x, dy.astype(np.float64), -1.0, 2.0, 4, delta)
    np.testing.assert_allclose(got[keep], want[keep], rtol=1e-5, atol=1e-6)


def test_lsq_matches_pytorch_learnable_ops():
    """On PyTorch's grid the view-based LSQ is PyTorch's learnable op (golden cases from torch 2.13)."""
    checked = 0
    with h5py.File(os.path.join(GOLDEN, "torch.h5"), "r") as f:
        for name in f:
            a = dict(f[name].attrs)
            if a["op"] not in ("_fake_quantize_learnable_per_tensor_affine",
                               "_fake_quantize_learnable_per_channel_affine") or "error" in a:
                continue
            d = {k: f[name][k][()] for k in f[name]}
            view = ts.quantized_view(d["inputs"], d["scale"], d["zero_point"], int(a["quant_min"]), int(a["quant_max"]),
                                     axis=int(a["axis"]) if "axis" in a else None, learnable=True,
                                     fma=a["cpu_capability"] != "DEFAULT")
            dx, ds, dz = est.lsq(d["gradients"], view, float(a["grad_factor"]))
            np.testing.assert_array_equal(bits(dx), bits(d["backprops_wrt_input"]))
            expected = np.asarray(d["backprop_wrt_scale"], np.float64).reshape(np.shape(ds))
            with np.errstate(invalid="ignore"):
                scale_sum = np.abs(d["gradients"][np.isfinite(d["gradients"])]).sum() * 1e-5 * 256
            ok = np.isclose(ds, expected, rtol=1e-5, atol=scale_sum) | (np.isnan(ds) & np.isnan(expected))
            assert ok.all(), name
            checked += 1
    assert checked >= 150


def test_tf_flushes_subnormal_gradients_except_identity():
    v = grid_view(np.array([0.0, 0.5], F32))
    dy = np.array([1e-40, -1e-41], F32)
    assert (est.scaled(dy, v, 1.0, 1.0) == 0).all()
    assert (est.straight_through(dy, v) == 0).all()
    np.testing.assert_array_equal(bits(est.identity(dy, v)), bits(dy))
    assert (est.scaled(np.array([2e-38, 2e-38], F32), v, 0.1) == 0).all()  # a subnormal product is flushed too


def test_per_channel_estimators_keep_the_layout():
    rng = np.random.default_rng(3)
    x = rng.normal(0, 2, (3, 5, 4)).astype(F32)
    dy = rng.normal(0, 1, x.shape).astype(F32)
    mn, mx = np.array([-1, -2, -3, -0.5], F32), np.array([1, 2, 3, 4], F32)
    v = est.tf_view(x, mn, mx, variant="per-channel", axis=-1)
    tf_dx, _, _ = ops.fake_quant_with_min_max_vars_per_channel_gradient(dy, x, mn, mx)
    np.testing.assert_array_equal(bits(est.straight_through(dy, v)), bits(tf_dx))
    xt, dyt = np.moveaxis(x, -1, 1).copy(), np.moveaxis(dy, -1, 1).copy()
    vt = est.tf_view(xt, mn, mx, variant="per-channel", axis=1)
    dx, ds, dz = est.lsq(dyt, vt, 1.0)
    dx_last, ds_last, dz_last = est.lsq(dy, v, 1.0)
    np.testing.assert_array_equal(dx, np.moveaxis(dx_last, -1, 1))
    np.testing.assert_array_equal(ds, ds_last)
    assert ds.shape == (4,) and dz.shape == (4,)
    _, da = est.pact(dy, v)
    expected = [(dy[..., c] * (x[..., c] >= v.hi[c])).sum(dtype=np.float64) for c in range(4)]
    np.testing.assert_allclose(da, expected, rtol=1e-6)


def test_apply_estimator_outputs_and_refusals():
    v = grid_view()
    outs, details = est.apply_estimator("lsq", DY, v)
    assert list(outs) == ["backprops_wrt_input", "backprop_wrt_scale", "backprop_wrt_zero_point"]
    assert details["grad_factor"] == pytest.approx(1 / math.sqrt(27))
    assert list(est.apply_estimator("pact", DY, v)[0]) == ["backprops_wrt_input", "backprop_wrt_alpha"]
    with pytest.raises(QgcliError, match="^--grad-factor: only applies to --estimator lsq"):
        est.apply_estimator("ste", DY, v, grad_factor=2.0)
    passthrough = est.tf_view(X, 0.0, 0.0)
    with pytest.raises(QgcliError, match="no step size"):
        est.apply_estimator("lsq", DY, passthrough)
    np.testing.assert_array_equal(est.apply_estimator("ste", DY, passthrough)[0]["backprops_wrt_input"], DY)


# --- properties ----------------------------------------------------------------------------------------

values = st.lists(st.floats(-20, 20, width=32) | st.sampled_from([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-41]),
                  min_size=1, max_size=64)
ranges = st.tuples(st.floats(-8, -0.01), st.floats(0.01, 8))


def _gradients(n, seed):
    g = np.random.default_rng(seed).standard_normal(n).astype(F32)
    g[::7] = -g[::7]
    return g


@settings(max_examples=80, deadline=None)
@given(values, ranges, st.integers(2, 8), st.booleans())
def test_scaled_1_0_is_ste(xs, rng_, num_bits, torch_view):
    x = np.array(xs, F32)
    dy = _gradients(x.size, len(xs))
    if torch_view:
        s, z = ts.observer_qparams(rng_[0], rng_[1], 0, (1 << num_bits) - 1)
        v = ts.quantized_view(x, s.reshape(()), z.reshape(()), 0, (1 << num_bits) - 1)
    else:
        v = est.tf_view(x, rng_[0], rng_[1], num_bits=num_bits)
    np.testing.assert_array_equal(bits(est.scaled(dy, v, 1, 0)), bits(est.straight_through(dy, v)))
    np.testing.assert_array_equal(bits(est.ewgs(dy, v, 0.0)), bits(est.straight_through(dy, v)))


@settings(max_examples=60, deadline=None)
@given(values, ranges, st.booleans())
def test_identity_returns_the_upstream_gradient(xs, rng_, torch_view):
    x = np.array(xs, F32)
    dy = _gradients(x.size, 1)
    dy[0] = np.nan
    v = (ts.quantized_view(x, np.float32(0.1), np.int32(3), 0, 255) if torch_view
         else est.tf_view(x, rng_[0], rng_[1]))
    np.testing.assert_array_equal(bits(est.identity(dy, v)), bits(dy))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(-30, 30, width=32), min_size=1, max_size=64), ranges, st.integers(2, 8))
def test_lsq_vanishes_on_grid_points_inside_the_range(xs, rng_, num_bits):
    """Inputs that are TF's own forward outputs sit on grid points inside the range: x_hat = x, so both
    range gradients are exactly zero there (and the input gradient passes)."""
    x0 = np.array(xs, F32)
    on_grid = ops.fake_quant_with_min_max_vars(x0, rng_[0], rng_[1], num_bits=num_bits)
    v = est.tf_view(on_grid, rng_[0], rng_[1], num_bits=num_bits)
    assert v.inside.all()
    dy = _gradients(on_grid.size, 2)
    dx, ds, dz = est.lsq(dy, v, 1.0)
    assert float(ds) == 0.0 and float(dz) == 0.0
    np.testing.assert_array_equal(dx, dy)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-128, 127), min_size=1, max_size=64), st.sampled_from([0.1, 0.25, 1 / 3, 0.0235]),
       st.integers(-20, 20))
def test_lsq_on_pytorch_grid_points_is_float32_rounding_only(ks, scale, zero_point):
    """On PyTorch's grid the fused multiply-add leaves the rounding error of x_hat itself: at most half an
    ulp of x_hat per element, times |dy|/s -- never a systematic gradient."""
    s = F32(scale)
    k = np.clip(np.array(ks), -128 - zero_point, 127 - zero_point)
    x = ((k.astype(np.float64)) * np.float64(s)).astype(F32)  # grid points, as PyTorch's forward outputs them
    v = ts.quantized_view(x, s, F32(zero_point), -128, 127, learnable=True)
    assert v.inside.all()
    dy = np.ones(x.size, F32)
    _, ds, dz = est.lsq(dy, v, 1.0)
    bound = np.sum(np.spacing(np.abs(x)) / 2 / s) * 1.01 + 1e-30
    assert abs(float(ds)) <= bound and float(dz) == 0.0


# --- CLI ----------------------------------------------------------------------------------------------

def _read(path):
    with h5py.File(path, "r") as f:
        return {k: f[k][()] for k in f}, dict(f[next(iter(f))].attrs)


@pytest.mark.parametrize("estimator, names", [
    ("identity", ["backprops_wrt_input"]),
    ("scaled:0.9", ["backprops_wrt_input"]),
    ("lsq", ["backprop_wrt_scale", "backprop_wrt_zero_point", "backprops_wrt_input"]),
    ("pact", ["backprop_wrt_alpha", "backprops_wrt_input"]),
    ("ewgs:0.5", ["backprops_wrt_input"]),
])
def test_cli_estimators_on_the_notebook_sample(cli, tmp_path, estimator, names):
    out = tmp_path / "g.h5"
    r = cli("fakequant-grad", NOTEBOOK, "--num-bits", "2", "--estimator", estimator, "-o", out, "--json")
    assert r.exit_code == 0, r.output
    data, attrs = _read(out)
    assert sorted(data) == names and attrs["estimator"] == estimator
    with h5py.File(NOTEBOOK, "r") as f:
        x, g, mn, mx = f["inputs"][()], f["gradients"][()], f["min"][()], f["max"][()]
    v = est.tf_view(x, mn, mx, num_bits=2)
    expected, _ = est.apply_estimator(estimator, g, v)
    for k in names:
        np.testing.assert_array_equal(bits(data[k]), bits(expected[k]))
    if estimator == "scaled:0.9":  # the notebook's leaky gradient: 0.9 * dy everywhere
        np.testing.assert_array_equal(data["backprops_wrt_input"], (F32(0.9) * g).astype(F32))
    assert '"estimator"' in r.output


def test_cli_summary_says_what_the_estimator_blocks(cli, tmp_path):
    # The STE mask blocks the notebook's clipped quarter; a leaky estimator blocks nothing, LSQ's input
    # gradient is masked like the STE's, and under PyTorch's grid scaled:1,0 is the STE, identity nothing.
    with h5py.File(NOTEBOOK, "r") as f:
        x, g = f["inputs"][()], f["gradients"][()]
    np.savez(tmp_path / "t.npz", inputs=x, gradients=g, scale=np.float32(0.05), zero_point=np.int32(128))
    runs = [(NOTEBOOK, ["--num-bits", "2"], "scaled:0.9,0.1", 0.0), (NOTEBOOK, ["--num-bits", "2"], "lsq", "mask"),
            (tmp_path / "t.npz", ["--semantics", "torch"], "scaled:1,0", "mask"),
            (tmp_path / "t.npz", ["--semantics", "torch"], "identity", 0.0)]
    for bundle, args, estimator, want in runs:
        r = cli("fakequant-grad", bundle, *args, "--estimator", estimator, "-o", tmp_path / "g.npz", "--force",
                "--json")
        assert r.exit_code == 0, r.output
        stats = json.loads(r.stdout)["statistics"]
        assert stats["gradient_blocked"] > 0.05
        assert stats["estimator_blocked"] == pytest.approx(stats["gradient_blocked"] if want == "mask" else want,
                                                           rel=1e-12, abs=0)
        r = cli("fakequant-grad", bundle, *args, "--estimator", estimator, "-o", tmp_path / "g.npz", "--force")
        assert f"{100 * stats['estimator_blocked']:.2f}%" in " ".join(r.stderr.split())


def test_cli_ste_estimator_is_the_tensorflow_op(cli, tmp_path):
    r1 = cli("fakequant-grad", PER_CHANNEL, "-o", tmp_path / "a.h5")
    r2 = cli("fakequant-grad", PER_CHANNEL, "--estimator", "ste", "-o", tmp_path / "b.h5")
    assert r1.exit_code == r2.exit_code == 0
    a, _ = _read(tmp_path / "a.h5")
    b, _ = _read(tmp_path / "b.h5")
    assert sorted(a) == sorted(b) == ["backprop_wrt_max", "backprop_wrt_min", "backprops_wrt_input"]
    for k in a:
        np.testing.assert_array_equal(bits(a[k]), bits(b[k]))


def test_cli_lsq_grad_factor_and_per_channel(cli, tmp_path):
    r = cli("fakequant-grad", PER_CHANNEL, "--estimator", "lsq", "--grad-factor", "1", "-o", tmp_path / "a.h5")
    assert r.exit_code == 0, r.output
    a, attrs = _read(tmp_path / "a.h5")
    assert a["backprop_wrt_scale"].shape == (16,) and attrs["grad_factor"] == 1.0
    r = cli("fakequant-grad", PER_CHANNEL, "--estimator", "lsq", "-o", tmp_path / "b.h5")
    b, attrs = _read(tmp_path / "b.h5")
    assert attrs["grad_factor"] == pytest.approx(1 / math.sqrt(4 * 8 * 8 * 255))
    np.testing.assert_allclose(b["backprop_wrt_scale"], a["backprop_wrt_scale"] * attrs["grad_factor"], rtol=1e-6)


@pytest.mark.parametrize("args, message", [
    (["--estimator", "bogus"], "Error: --estimator: unknown estimator 'bogus'"),
    (["--estimator", "ewgs"], "Error: --estimator: write ewgs:DELTA"),
    (["--grad-factor", "2"], "'--grad-factor': only applies to --estimator lsq"),
    (["--estimator", "pact", "--grad-factor", "2"], "'--grad-factor': only applies to --estimator lsq"),
    (["--estimator", "lsq", "--grad-factor", "x"], "'--grad-factor': 'x' is not a number or 'auto'"),
    (["--estimator", "lsq", "--plot", "f.png"], "'--plot': draws TensorFlow's STE only"),
])
def test_cli_estimator_errors(cli, tmp_path, args, message):
    out = tmp_path / "o.h5"
    r = cli("fakequant-grad", NOTEBOOK, "-o", out, *args)
    assert r.exit_code == 2, r.output
    assert message in r.output and len(r.output.strip().splitlines()) == 1
    assert not out.exists()


def test_cli_torch_semantics_with_other_estimators(cli, tmp_path):
    with h5py.File(NOTEBOOK, "r") as f:
        x, g = f["inputs"][()], f["gradients"][()]
    np.savez(tmp_path / "b.npz", inputs=x, gradients=g, scale=np.float32(0.05), zero_point=np.int32(128))
    for estimator in ("pact", "scaled:1,0", "ewgs:1", "lsq"):
        r = cli("fakequant-grad", tmp_path / "b.npz", "--semantics", "torch", "--estimator", estimator,
                "-o", tmp_path / f"{estimator.replace(':', '_')}.npz")
        assert r.exit_code == 0, r.output
    ste = ts.fake_quantize_per_tensor_affine_gradient(g, x, 0.05, 128, 0, 255)
    with np.load(tmp_path / "scaled_1,0.npz") as scaled:
        np.testing.assert_array_equal(scaled["backprops_wrt_input"], ste)
    with np.load(tmp_path / "lsq.npz") as z:
        lsq = dict(z)
    dx, ds, dz = ts.fake_quantize_learnable_per_tensor_affine_gradient(g, x, np.float32(0.05), np.float32(128), 0, 255)
    np.testing.assert_array_equal(lsq["backprops_wrt_input"], dx)
    assert lsq["backprop_wrt_scale"] == ds and lsq["backprop_wrt_zero_point"] == dz


# --- qgcli plot estimators ----------------------------------------------------------------------------------

def test_plot_estimators_draws_each_gradient_function():
    from qgcli.report import plots

    x = np.linspace(-10, 10, 81).astype(F32)
    dy = np.cos(x).astype(F32)
    fig = plots.estimators(x, -6.0, 6.0, gradients=dy, num_bits=2, names=("ste", "scaled:0.5,0.25", "pact", "lsq"))
    lines = {ln.get_gid(): ln for a in fig.axes for ln in a.get_lines() if ln.get_gid()}
    v = est.tf_view(x, -6.0, 6.0, num_bits=2)
    order = np.argsort(x, kind="stable")
    ones = np.ones_like(x)
    for name in ("ste", "scaled:0.5,0.25", "pact", "lsq"):
        np.testing.assert_array_equal(lines[f"estimator:{name}"].get_ydata(),
                                      est.apply_estimator(name, ones, v)[0]["backprops_wrt_input"][order])
        np.testing.assert_array_equal(lines[f"backprops:{name}"].get_ydata(),
                                      est.apply_estimator(name, dy, v)[0]["backprops_wrt_input"][order])
    s = fig.qgcli_summary
    assert s["estimators"] == ["ste", "scaled:0.5,0.25", "pact", "lsq"] and s["points"] == 81
    assert s["cosine_vs_ste"]["ste"] == pytest.approx(1.0) and s["cosine_vs_ste"]["scaled:0.5,0.25"] < 1
    _, ds, dz = est.lsq(dy, v)
    assert s["range_gradients"]["lsq"] == {"backprop_wrt_scale": float(ds), "backprop_wrt_zero_point": float(dz)}


def test_cli_plot_estimators(cli, tmp_path):
    out = tmp_path / "est.png"
    r = cli("plot", "estimators", NOTEBOOK, "--num-bits", "2", "-e", "ste", "-e", "ewgs:2", "-o", out, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["estimators"] == ["ste", "ewgs:2"] and doc["size_px"] == [720, 760]  # two panels: the bundle's gradients
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    r = cli("plot", "estimators", PER_CHANNEL, "--channel", "2", "-o", tmp_path / "pc.svg", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["estimators"] == ["ste", "identity", "scaled:0.9", "pact", "ewgs:1"]
    with h5py.File(NOTEBOOK, "r") as f:
        np.savez(tmp_path / "b.npz", inputs=f["inputs"][()], gradients=f["gradients"][()])
    r = cli("plot", "estimators", tmp_path / "b.npz", "--semantics", "torch", "--scale", "0.05", "--zero-point", "128",
            "-e", "lsq", "-e", "ste", "-o", tmp_path / "pt.pdf", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["op"] == "PyTorch"


@pytest.mark.parametrize("args, message", [
    (["-e", "bogus"], "Error: --estimator: unknown estimator 'bogus'"),
    (["--scale", "0.1"], "'--scale': only applies to --semantics torch"),
    (["--semantics", "torch", "--scale", "0.1", "--zero-point", "0", "--min", "-1"], "'--min': applies to --semantics tf"),
    (["--channel", "1", "--axis", "0"], "--channel: 1 is out of range for 1 channels"),
])
def test_cli_plot_estimators_errors(cli, tmp_path, args, message):
    out = tmp_path / "e.png"
    r = cli("plot", "estimators", NOTEBOOK, "-o", out, *args)
    assert r.exit_code == 2, r.output
    assert message in r.output and not out.exists()


def test_estimators_on_any_array_module(xp, monkeypatch):
    """CuPy against NumPy.  On NumPy (no GPU) the NumPy kernels (``QGCLI_NATIVE=0``) against the compiled ones:
    not the same run twice."""
    from qgcli.backend import to_numpy
    from qgcli.ops import native

    monkeypatch.delenv("QGCLI_NATIVE", raising=False)
    if xp is np and native.library() is None:
        pytest.skip("the compiled kernels are not built here: the NumPy run would be compared with itself")
    rng = np.random.default_rng(11)
    x = rng.normal(0, 3, (6, 5)).astype(F32)
    dy = rng.normal(0, 1, x.shape).astype(F32)
    views = {
        "tf": lambda a: est.tf_view(a, -4.0, 3.0, num_bits=3),
        "tf-pc": lambda a: est.tf_view(a, [-1.0] * 5, [1.0, 2.0, 3.0, 4.0, 5.0], variant="per-channel"),
        "torch": lambda a: ts.quantized_view(a, np.float32(0.1), np.int32(3), -8, 7),
        "torch-lsq": lambda a: ts.quantized_view(a, np.full(6, 0.2, F32), np.arange(6, dtype=F32) - 3, -8, 7, axis=0,
                                                 learnable=True),
    }
    for label, make in views.items():
        for name in ("ste", "identity", "scaled:0.9,0.1", "lsq", "pact", "ewgs:1"):
            monkeypatch.delenv("QGCLI_NATIVE", raising=False)
            want, _ = est.apply_estimator(name, dy, make(x))
            if xp is np:
                monkeypatch.setenv("QGCLI_NATIVE", "0")
            got, _ = est.apply_estimator(name, xp.asarray(dy), make(xp.asarray(x)))
            for k in want:
                np.testing.assert_array_equal(bits(to_numpy(got[k])), bits(want[k]), err_msg=f"{label} {name} {k}")
