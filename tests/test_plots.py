"""Plots: the figures' data equal the ops' outputs, marks and labels are right, files render headless.

Figures are inspected through their matplotlib objects (Line2D data, patches, texts) and the written
files through their bytes (PNG size and pixels via Pillow, which matplotlib depends on).
"""
import io
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from qgcli import ops
from qgcli.report import plots
from qgcli.errors import OperandError, OutputError

from conftest import ROOT, SAMPLES

NOTEBOOK = os.path.join(SAMPLES, "notebook.h5")
PER_CHANNEL = os.path.join(SAMPLES, "per_channel.h5")


def _read(path):
    with h5py.File(path, "r") as f:
        return {k: f[k][()] for k in f}


@pytest.fixture(scope="module")
def nb():
    return _read(NOTEBOOK)


@pytest.fixture(scope="module")
def pc():
    return _read(PER_CHANNEL)


def by_gid(ax, gid):
    return [a for a in ax.get_children() if a.get_gid() == gid]


def text(fig, gid):
    """The one Text with ``gid`` anywhere in ``fig`` (legend titles and entries included)."""
    (found,) = fig.findobj(lambda a: a.get_gid() == gid and hasattr(a, "get_text"))
    return found.get_text()


def line(ax, gid):
    (found,) = [ln for ln in ax.get_lines() if ln.get_gid() == gid]
    return found


def bits(a):
    """float32 bit patterns, so that -0.0 != 0.0 and NaN == NaN in comparisons."""
    return np.asarray(a, np.float32).view(np.uint32)


def png_pixels(path):
    from PIL import Image

    with Image.open(path) as im:
        return im.size, np.asarray(im.convert("RGB"))


def assert_not_blank(pixels):
    assert pixels.std() > 10, "the image is (nearly) one colour"
    assert (pixels < 100).any(), "no dark pixels: nothing drawn"


# --- the notebook's figures ---------------------------------------------------------------------------

def test_staircase_is_the_op_with_marks_and_labels(nb):
    fig = plots.staircase(nb["inputs"], nb["min"], nb["max"], num_bits=2)
    ax = fig.axes[0]
    out = line(ax, "outputs")
    xs, ys = out.get_xdata(), out.get_ydata()
    assert xs.size == 1000 and np.all(np.diff(xs) >= 0)
    np.testing.assert_array_equal(np.sort(nb["inputs"].reshape(-1)), xs)
    expected = ops.fake_quant_with_min_max_vars(xs, nb["min"], nb["max"], num_bits=2)
    np.testing.assert_array_equal(bits(ys), bits(expected))
    # The data as points, and under them the op's own step function (issue 40, item 4): never a line through
    # the points, which slants between levels.
    assert out.get_marker() == "+" and out.get_linestyle() == "None"
    step = line(ax, "outputs_step")
    sx, sy = step.get_xdata(), step.get_ydata()
    assert step.get_linestyle() == "-" and np.all(np.diff(sx) >= 0)
    assert sx[0] == min(xs[0], -8.0) and sx[-1] == max(xs[-1], 4.0)
    # horizontal runs on the levels, vertical edges where the op changes value: the op at both ends of a run
    np.testing.assert_array_equal(sy[::2], sy[1::2])
    assert set(sy.tolist()) == {-8.0, -4.0, 0.0, 4.0}
    np.testing.assert_array_equal(ops.fake_quant_with_min_max_vars(np.float32(sx[::2]), nb["min"], nb["max"],
                                                                   num_bits=2), sy[::2])
    edges = sx[2::2]  # each the first float32 with the next level: one ulp below it is still on the step before
    below = ops.fake_quant_with_min_max_vars(np.nextafter(np.float32(edges), np.float32(-np.inf)), nb["min"],
                                             nb["max"], num_bits=2)
    np.testing.assert_array_equal(below, sy[1:-1:2])
    # The notebook's levels -8, -4, 0, 4, marked and on the y ticks; they are exactly what the op outputs.
    levels = sorted(ln.get_ydata()[0] for ln in by_gid(ax, "level"))
    assert levels == [-8.0, -4.0, 0.0, 4.0]
    assert sorted(set(np.unique(ys).tolist())) == levels
    assert list(ax.get_yticks()) == levels
    assert sorted(ln.get_xdata()[0] for ln in by_gid(ax, "raw_bound")) == [-6.0, 6.0]
    assert sorted(ln.get_xdata()[0] for ln in by_gid(ax, "nudged_bound")) == [-8.0, 4.0]
    assert ax.get_xlabel() == "floating point (inputs)"
    assert ax.get_ylabel() == "de-quantized (outputs)"
    title = ax.get_title()
    assert "num_bits=2" in title and "[-6, 6] nudged to [-8, 4]" in title and "4 levels" in title
    assert text(fig, "points") == "1,000 points"
    # Axes through 0, as in the notebook.
    assert any(ln.get_ydata()[0] == 0 and ln.get_color() == "k" for ln in ax.get_lines()[1:])
    assert fig.qgcli_summary["grid"]["nudged_min"] == -8.0


def test_ste_mask_is_tf_gradient_function_and_backprops_the_gradient_op(nb):
    x, mn, mx, g = nb["inputs"], nb["min"], nb["max"], nb["gradients"]
    fig = plots.ste(x, mn, mx, gradients=g, num_bits=2)
    ax, ax2 = fig.axes[:2]
    xs = line(ax, "outputs").get_xdata()
    order = np.argsort(x.reshape(-1), kind="stable")
    mask = line(ax2, "mask")
    expected_mask = ops.fake_quant_with_min_max_vars_gradient(np.ones_like(x), x, mn, mx, num_bits=2)[0]
    np.testing.assert_array_equal(bits(mask.get_ydata()), bits(expected_mask.reshape(-1)[order]))
    np.testing.assert_array_equal(mask.get_xdata(), xs)
    assert mask.get_color() == "red"
    assert ax2.get_ylabel() == "gradient\nfunction" and ax2.yaxis.label.get_color() == "r"
    # the mask on a panel of its own (issue 40, item 4): on a twin axis its 0 and 1 fell on level lines
    assert ax2 is not ax and ax2.get_shared_x_axes().joined(ax, ax2) and list(ax2.get_yticks()) == [0.0, 1.0]
    # backprops on a panel of their own below (the notebook overlays them on the staircase), brown 'x' markers.
    bp = line(fig.axes[2], "backprops")
    expected_bp = ops.fake_quant_with_min_max_vars_gradient(g, x, mn, mx, num_bits=2)[0]
    np.testing.assert_array_equal(bits(bp.get_ydata()), bits(expected_bp.reshape(-1)[order]))
    assert bp.get_color() == "brown" and bp.get_marker() == "x"
    assert fig.qgcli_summary["backprops_axis"] == "own" and fig.axes[2].get_shared_x_axes().joined(ax, fig.axes[2])
    # The mask drops to 0 outside the nudged range [-8, 4], inclusive.
    inside = (xs >= -8) & (xs <= 4)
    assert np.all(mask.get_ydata()[inside] == 1) and np.all(mask.get_ydata()[~inside] == 0)


def test_ste_without_gradients_has_no_backprops(nb):
    fig = plots.ste(nb["inputs"], nb["min"], nb["max"], num_bits=2)
    assert not any(ln.get_gid() == "backprops" for a in fig.axes for ln in a.get_lines())
    assert len(fig.axes) == 2


def test_backprops_of_another_scale_get_their_own_axis(nb):
    x = nb["inputs"]
    g = np.full_like(x, 1e-3)
    fig = plots.ste(x, -6.0, 6.0, gradients=g, num_bits=2)
    assert fig.qgcli_summary["backprops_axis"] == "own"
    ax3 = fig.axes[2]
    bp = line(ax3, "backprops")
    assert ax3.get_ylabel() == "backprops_wrt_input"
    assert set(np.unique(bp.get_ydata()).tolist()) == {0.0, np.float32(1e-3)}


def test_args_variant_uses_the_args_op():
    # A half-step where Args (multiply by inv_scale) and Vars (divide by scale) differ, per the README.
    x = np.linspace(-1.0, 1.0, 2001, dtype=np.float32)
    fig = plots.staircase(x, -0.9, 0.7, num_bits=3, variant="args")
    out = line(fig.axes[0], "outputs")
    np.testing.assert_array_equal(bits(out.get_ydata()),
                                  bits(ops.fake_quant_with_min_max_args(out.get_xdata(), -0.9, 0.7, num_bits=3)))
    step = line(fig.axes[0], "outputs_step")
    assert "FakeQuantWithMinMaxArgs" in step.get_label()
    np.testing.assert_array_equal(bits(step.get_ydata()[::2]), bits(ops.fake_quant_with_min_max_args(
        np.float32(step.get_xdata()[::2]), -0.9, 0.7, num_bits=3)))  # each run's start


def test_narrow_range_levels():
    fig = plots.staircase(np.linspace(-10, 10, 101, dtype=np.float32), -6.0, 6.0, num_bits=2, narrow_range=True)
    levels = sorted(ln.get_ydata()[0] for ln in by_gid(fig.axes[0], "level"))
    assert levels == plots.grid_levels(ops.nudge(-6.0, 6.0, num_bits=2, narrow_range=True)).tolist()
    assert len(levels) == 3 and "narrow range" in fig.axes[0].get_title()


def test_per_channel_channel_selection_matches_the_per_channel_op(pc):
    x, mn, mx, g = pc["inputs"], pc["min"], pc["max"], pc["gradients"]
    k = 3
    fig = plots.ste(x, mn, mx, gradients=g, channel=k, num_bits=3)
    ax = fig.axes[0]
    out = line(ax, "outputs")
    xs = out.get_xdata()
    np.testing.assert_array_equal(xs, np.sort(x[..., k].reshape(-1)))
    # The same op on channel k alone, as a one-channel tensor.
    expected = ops.fake_quant_with_min_max_vars_per_channel(xs.reshape(-1, 1), mn[k:k + 1], mx[k:k + 1], num_bits=3)
    np.testing.assert_array_equal(bits(out.get_ydata()), bits(expected.reshape(-1)))
    grid = ops.nudge(mn[k], mx[k], num_bits=3)
    assert sorted(ln.get_xdata()[0] for ln in by_gid(ax, "nudged_bound")) == sorted(
        [float(grid.nudged_min), float(grid.nudged_max)])
    assert len(by_gid(ax, "level")) == 8
    assert "channel 3" in ax.get_title()
    order = np.argsort(x[..., k].reshape(-1), kind="stable")
    dx = ops.fake_quant_with_min_max_vars_per_channel_gradient(g, x, mn, mx, num_bits=3)[0][..., k].reshape(-1)
    np.testing.assert_array_equal(bits(line(fig.axes[-1], "backprops").get_ydata()), bits(dx[order]))


def test_per_channel_flattened_and_other_axis(pc):
    x, mn, mx = pc["inputs"], pc["min"], pc["max"]
    fig = plots.staircase(x, mn, mx, max_points=5000)
    ax = fig.axes[0]
    out = line(ax, "outputs")
    assert out.get_linestyle() == "None" and out.get_xdata().size == x.size
    assert not by_gid(ax, "level") and not by_gid(ax, "nudged_bound")
    assert "16 per-channel grids, flattened" in ax.get_title()
    # Channels on axis 0: the same numbers as channels last.
    moved = np.ascontiguousarray(np.moveaxis(x, -1, 0))
    a = line(plots.staircase(moved, mn, mx, axis=0, channel=5).axes[0], "outputs")
    b = line(plots.staircase(x, mn, mx, channel=5).axes[0], "outputs")
    np.testing.assert_array_equal(bits(a.get_ydata()), bits(b.get_ydata()))


def test_channel_of_a_per_tensor_grid(nb):
    x = nb["inputs"].reshape(10, 100)
    fig = plots.staircase(x, -6.0, 6.0, num_bits=2, axis=0, channel=9)
    xs = line(fig.axes[0], "outputs").get_xdata()
    np.testing.assert_array_equal(xs, np.sort(x[9]))
    assert "channel 9" in fig.axes[0].get_title()


def test_bad_channel_and_operands(pc):
    x, mn, mx = pc["inputs"], pc["min"], pc["max"]
    with pytest.raises(OperandError, match="--channel: 16 is out of range for 16 channels"):
        plots.staircase(x, mn, mx, channel=16)
    with pytest.raises(OperandError, match="^min: has 3 entries"):
        plots.ste(x, mn[:3], mx[:3])
    with pytest.raises(OperandError, match="^gradients: shape"):
        plots.ste(x, mn, mx, gradients=np.zeros(3, np.float32))
    with pytest.raises(OperandError, match="^min:.*not below max"):
        plots.staircase(x[..., 0], 1.0, -1.0)
    with pytest.raises(OperandError, match="^min: plot channels needs one min/max per channel"):
        plots.channels(x, -1.0, 1.0)


def test_subsample_is_deterministic_and_keeps_every_step():
    rng = np.random.default_rng(7)
    x = (rng.standard_normal(50_000) * 3).astype(np.float32)
    x[::1000] = np.nan
    fig = plots.ste(x, -6.0, 6.0, num_bits=3, max_points=500)
    out = line(fig.axes[0], "outputs")
    xs, ys = out.get_xdata(), out.get_ydata()
    again = line(plots.ste(x, -6.0, 6.0, num_bits=3, max_points=500).axes[0], "outputs").get_xdata()
    np.testing.assert_array_equal(xs, again)
    finite = x[np.isfinite(x)]
    assert xs[0] == finite.min() and xs[-1] == finite.max() and np.all(np.diff(xs) >= 0)
    assert 500 <= xs.size <= 500 + 4 * 8
    np.testing.assert_array_equal(bits(ys), bits(ops.fake_quant_with_min_max_vars(xs, -6.0, 6.0, num_bits=3)))
    # Both sides of each of the 7 steps are drawn: every step is vertical, as in the full tensor.
    full = ops.fake_quant_with_min_max_vars(np.sort(finite), -6.0, 6.0, num_bits=3)
    for level in np.unique(full):
        on = np.sort(finite)[full == level]
        assert on.min() in xs and on.max() in xs
    note = text(fig, "points")
    assert note == f"{xs.size:,} of 50,000 points (deterministic subsample); 50 NaN/inf not drawn"
    assert fig.qgcli_summary["points"] == xs.size


def test_presample_of_a_large_tensor_keeps_the_extremes(monkeypatch):
    monkeypatch.setattr(plots, "PRESAMPLE", 2000)
    x = np.random.default_rng(3).standard_normal(20_000).astype(np.float32)
    idx = plots.subsample(x, max_points=100)
    assert x[idx[0]] == x.min() and x[idx[-1]] == x.max() and idx.size <= 100
    np.testing.assert_array_equal(idx, plots.subsample(x, max_points=100))


def test_hist_counts_shading_and_clipped_shares(nb):
    x = nb["inputs"]
    fig = plots.hist(x, nb["min"], nb["max"], num_bits=2, bins=40)
    ax = fig.axes[0]
    (counts,) = by_gid(ax, "counts")
    values = counts.get_data().values
    np.testing.assert_array_equal(values, np.histogram(x.astype(np.float64), bins=40)[0])
    assert values.sum() == 1000
    # Clipped shares from the op: the gradient op's backprop_wrt_min/max with unit gradients count them.
    _, below, above = ops.fake_quant_with_min_max_vars_gradient(np.ones_like(x), x, nb["min"], nb["max"], num_bits=2)
    assert text(fig, "clipped_below") == f"below nudged_min: {float(below) / 10:.2f}% ({int(below)})"
    assert text(fig, "clipped_above") == f"above nudged_max: {float(above) / 10:.2f}% ({int(above)})"
    # axvspan draws a Rectangle on matplotlib >= 3.9, a Polygon before: read the x extent from the patch's path.
    spans = sorted((xs.min(), xs.max()) for xs in (p.get_patch_transform().transform(p.get_path().vertices)[:, 0]
                                                  for p in by_gid(ax, "clip_region")))
    assert len(spans) == 2
    (_, left_end), (right_start, _) = spans
    assert left_end == pytest.approx(-8.0) and right_start == pytest.approx(4.0)
    assert sorted(ln.get_xdata()[0] for ln in by_gid(ax, "level")) == [-8.0, -4.0, 0.0, 4.0]
    assert fig.qgcli_summary["clipped_above"] == float(above) / 1000
    log = plots.hist(x, nb["min"], nb["max"], num_bits=2, log=True).axes[0]
    assert log.get_yscale() == "log" and log.get_ylabel() == "count (log)"


def test_hist_of_nonfinite_and_one_channel(pc):
    x = pc["inputs"].copy()
    x[0, 0, 0, :] = np.nan
    x[0, 0, 1, 2] = np.inf
    fig = plots.hist(x, pc["min"], pc["max"], channel=2, bins=10)
    ax = fig.axes[0]
    assert text(fig, "points") == "254 values, 10 bins; 2 NaN/inf not binned"
    assert by_gid(ax, "counts")[0].get_data().values.sum() == 254
    assert fig.qgcli_summary["clipped_above"] > 0  # +inf is clipped above


def _series(ax, gid):
    """Per-channel values drawn as bars (heights, bottoms) or as one step patch (values, baseline)."""
    bars = [p for p in ax.patches if p.get_gid() == gid and hasattr(p, "get_height")]
    if bars:
        return np.array([p.get_y() + p.get_height() for p in bars]), np.array([p.get_y() for p in bars])
    (step,) = [p for p in ax.patches if p.get_gid() == gid]
    data = step.get_data()
    return np.asarray(data.values), None if data.baseline is None else np.asarray(data.baseline)


@pytest.mark.parametrize("depth", [1, 16, 1024])
def test_channels_panels_are_the_ops_numbers(depth):
    rng = np.random.default_rng(depth)
    x = (rng.standard_normal((3, 40, depth)) * np.linspace(0.5, 2, depth)).astype(np.float32)
    mn = np.percentile(x, 3, axis=(0, 1)).astype(np.float32)
    mx = np.percentile(x, 95, axis=(0, 1)).astype(np.float32)
    g = rng.standard_normal(x.shape).astype(np.float32)
    fig = plots.channels(x, mn, mx, gradients=g, num_bits=4)
    ranges, clipped, grads = fig.axes
    grid = ops.nudge(mn, mx, num_bits=4)
    top, bottom = _series(ranges, "nudged_range")
    np.testing.assert_array_equal(top, grid.nudged_max.astype(np.float64))
    np.testing.assert_array_equal(bottom, grid.nudged_min.astype(np.float64))
    hi, lo = _series(ranges, "data_range")
    np.testing.assert_array_equal(hi, x.max(axis=(0, 1)).astype(np.float64))
    np.testing.assert_array_equal(lo, x.min(axis=(0, 1)).astype(np.float64))
    # Clipped shares: unit gradients make backprop_wrt_min/max count the clipped elements per channel.
    _, n_below, n_above = ops.fake_quant_with_min_max_vars_per_channel_gradient(np.ones_like(x), x, mn, mx, num_bits=4)
    np.testing.assert_allclose(_series(clipped, "clipped_above")[0], 100 * n_above.astype(np.float64) / 120, rtol=1e-14)
    np.testing.assert_allclose(_series(clipped, "clipped_below")[0], -100 * n_below.astype(np.float64) / 120, rtol=1e-14)
    _, dmin, dmax = ops.fake_quant_with_min_max_vars_per_channel_gradient(g, x, mn, mx, num_bits=4)
    np.testing.assert_array_equal(_series(grads, "backprop_wrt_min")[0], dmin.astype(np.float64))
    np.testing.assert_array_equal(_series(grads, "backprop_wrt_max")[0], dmax.astype(np.float64))
    assert grads.get_xlabel() == "channel (axis -1)" and clipped.get_ylabel() == "clipped (%)"
    # Figure.get_suptitle is matplotlib >= 3.8; before, the suptitle Text is only Figure._suptitle.
    title = fig.get_suptitle() if hasattr(fig, "get_suptitle") else fig._suptitle.get_text()
    assert title.startswith(f"FakeQuantWithMinMaxVarsPerChannel: {depth:,} channel")
    assert ranges.get_xlim() == (-0.6, depth - 0.4)


def test_channels_without_gradients_and_vectors(pc):
    fig = plots.channels(pc["inputs"], pc["min"], pc["max"])
    assert len(fig.axes) == 2 and fig.qgcli_summary["backprops"] is False
    fig = plots.channel_vectors({"scale_backprop": np.arange(5.0), "offset_backprop": -np.arange(5.0)})
    assert [a.get_ylabel() for a in fig.axes] == ["scale_backprop", "offset_backprop"]
    np.testing.assert_array_equal(_series(fig.axes[1], "offset_backprop")[0], -np.arange(5.0))
    with pytest.raises(OperandError, match="^scale_backprop: must be one value per channel"):
        plots.channel_vectors({"scale_backprop": np.zeros((2, 2))})


def test_plots_take_the_inputs_array_module(xp, nb, monkeypatch):
    """CuPy against NumPy.  On NumPy (no GPU) the NumPy kernels (``QGCLI_NATIVE=0``) against the compiled ones:
    not the same run twice."""
    from qgcli.ops import native

    monkeypatch.delenv("QGCLI_NATIVE", raising=False)
    if xp is np and native.library() is None:
        pytest.skip("the compiled kernels are not built here: the NumPy run would be compared with itself")
    ref = plots.ste(nb["inputs"], nb["min"], nb["max"], gradients=nb["gradients"], num_bits=2)
    if xp is np:
        monkeypatch.setenv("QGCLI_NATIVE", "0")
    x, g = xp.asarray(nb["inputs"]), xp.asarray(nb["gradients"])
    fig = plots.ste(x, nb["min"], nb["max"], gradients=g, num_bits=2)
    for gid, axis in (("outputs", 0), ("mask", 1), ("backprops", 2)):
        np.testing.assert_array_equal(bits(line(fig.axes[axis], gid).get_ydata()),
                                      bits(line(ref.axes[axis], gid).get_ydata()))


# --- files ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, fmt, magic", [
    (kind, "png", b"\x89PNG") for kind in ("staircase", "ste", "hist", "channels")
] + [("ste", "svg", b"<?xml"), ("hist", "svg", b"<?xml"), ("staircase", "pdf", b"%PDF"), ("ste", "pdf", b"%PDF")])
def test_every_plot_renders_to_every_format(tmp_path, pc, kind, fmt, magic):
    args = (pc["inputs"], pc["min"], pc["max"])
    if kind == "channels":
        fig = plots.channels(*args, gradients=pc["gradients"], width=5, height=5)
    else:
        fig = getattr(plots, kind)(*args, channel=1, width=4, height=3)
    path = tmp_path / f"f.{fmt}"
    assert plots.save_figure(fig, str(path), dpi=50) == fmt
    assert path.read_bytes().startswith(magic)
    assert os.listdir(tmp_path) == [path.name]  # the temporary file was renamed, not left behind
    if fmt == "png":
        size, pixels = png_pixels(path)
        assert size == ((250, 250) if kind == "channels" else (200, 150))
        assert_not_blank(pixels)


def test_save_is_reproducible_and_refuses_unknown_formats(tmp_path, nb):
    fig = plots.staircase(nb["inputs"][:, ::10], -6.0, 6.0, num_bits=2, width=3, height=2)
    for fmt in ("svg", "pdf"):  # PNG carries no date anyway
        a, b = tmp_path / f"a.{fmt}", tmp_path / f"b.{fmt}"
        plots.save_figure(fig, str(a))
        plots.save_figure(fig, str(b))
        assert a.read_bytes() == b.read_bytes(), fmt
    with pytest.raises(OutputError, match=r"^--output: cannot tell the figure format from '\.jpg'"):
        plots.save_figure(fig, str(tmp_path / "x.jpg"))
    assert not (tmp_path / "x.jpg").exists()


def test_plots_use_no_pyplot_and_the_command_module_no_matplotlib():
    code = ("import sys, qgcli.cli, qgcli.cli.commands.plot; assert 'matplotlib' not in sys.modules; "
            "import qgcli.report.plots; assert 'matplotlib.pyplot' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# --- the CLI -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, size", [
    (["staircase", NOTEBOOK, "--num-bits", "2"], (640, 480)),
    (["ste", NOTEBOOK, "--num-bits", "2"], (640, 480)),
    (["ste", NOTEBOOK, "--num-bits", "2"], (640, 480)),
    (["ste", NOTEBOOK, "--num-bits", "2", "--gradients", NOTEBOOK + ":gradients"], (640, 760)),  # two panels
    (["hist", NOTEBOOK, "--num-bits", "2", "--log", "--bins", "30"], (640, 480)),
    (["channels", PER_CHANNEL], (800, 820)),
    (["staircase", PER_CHANNEL, "--channel", "3", "--width", "3", "--height", "2", "--dpi", "80"], (240, 160)),
    # 1 + 2.4 * 3 panels = 8.2 in is 819.9999999999999 px, and 3.336 in 333.6 px: the PNG has the pixels that qgcli
    # reports (the size times the dpi, rounded) on every matplotlib, not Agg's truncation of the product.
    (["channels", PER_CHANNEL, "--width", "3.336"], (334, 820)),
])
def test_cli_plots_write_pngs_of_the_requested_size(cli, tmp_path, argv, size):
    out = tmp_path / "fig.png"
    result = cli("plot", *argv, "-o", out)
    assert result.exit_code == 0, result.output
    got, pixels = png_pixels(out)
    assert got == size
    assert_not_blank(pixels)
    assert result.stderr.startswith(f"wrote {out} (png, {size[0]}x{size[1]} px)")


def test_cli_json_summary_and_literals(cli, tmp_path):
    import json

    x = np.linspace(-10, 10, 9, dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    result = cli("plot", "ste", "--inputs", tmp_path / "x.npy", "--min", "-6", "--max", "6", "--num-bits", "2",
                 "-o", tmp_path / "s.svg", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["format"] == "svg" and summary["size_px"] is None and summary["points"] == 9
    assert summary["op"] == "FakeQuantWithMinMaxVars" and summary["grid"]["nudged_max"] == 4.0
    assert (tmp_path / "s.svg").read_bytes().startswith(b"<?xml")


def test_cli_channels_of_bn_grad_and_fakequant_grad_outputs(cli, tmp_path):
    bn = tmp_path / "bn.h5"
    with h5py.File(bn, "w") as f:
        f["scale_backprop"] = np.linspace(-1, 1, 7, dtype=np.float32)
        f["offset_backprop"] = np.arange(7, dtype=np.float32)
        f["x_backprop"] = np.zeros((2, 7), np.float32)
    result = cli("plot", "channels", bn, "-o", tmp_path / "bn.png")
    assert result.exit_code == 0, result.output
    assert "channels of scale_backprop, offset_backprop, 7 channels" in result.stderr
    grads = tmp_path / "g.h5"
    assert cli("fakequant-grad", PER_CHANNEL, "-o", grads).exit_code == 0
    result = cli("plot", "channels", grads, "-o", tmp_path / "g.png")
    assert result.exit_code == 0, result.output
    assert "backprop_wrt_min, backprop_wrt_max, 16 channels" in result.stderr


@pytest.mark.parametrize("argv, message", [
    (["staircase", NOTEBOOK, "-o", "{tmp}/f.jpg"],
     "Error: --output: cannot tell the figure format from '.jpg' in {tmp}/f.jpg; use .png, .svg or .pdf"),
    (["staircase", NOTEBOOK, "-o", ""],
     "Error: --output: a figure needs a file name ending in .png, .svg or .pdf, or - for stdout"),
    (["staircase", NOTEBOOK, "-o", "{tmp}/exists.png"], "Error: --output: {tmp}/exists.png exists; use --force to replace it"),
    (["staircase", NOTEBOOK, "-o", "{tmp}/no/f.png"], "Error: --output: directory {tmp}/no does not exist"),
    (["staircase", PER_CHANNEL, "--channel", "16", "-o", "{tmp}/f.png"],
     "Error: --channel: 16 is out of range for 16 channels"),
    (["staircase", NOTEBOOK, "--axis", "0", "-o", "{tmp}/f.png"],
     "Error: Invalid value for '--axis': only applies to per-channel min/max or with --channel"),
    (["ste", "--inputs", NOTEBOOK + ":inputs", "-o", "{tmp}/f.png"], "Error: min: missing operand: give --min SPEC"),
    (["ste", NOTEBOOK, "--gradients", NOTEBOOK + ":nope", "-o", "{tmp}/f.png"], "Error: gradients: "),
    (["hist", NOTEBOOK, "--min", "3", "--max", "-3", "-o", "{tmp}/f.png"], "Error: min: "),
    (["ste", NOTEBOOK, "--dpi", "1200", "--width", "20", "-o", "{tmp}/f.png"],
     "Error: Invalid value for '--dpi': 20 x 7.6 in at 1200 dpi exceeds 20000 pixels per side"),
    (["channels", NOTEBOOK, "-o", "{tmp}/f.png"], "Error: min: plot channels needs one min/max per channel"),
    (["channels", NOTEBOOK, "--variant", "vars", "-o", "{tmp}/f.png"],
     "Error: Invalid value for '--variant': plot channels draws per-channel ops only"),
    (["channels", "--min", "1,2", "-o", "{tmp}/f.png"], "Error: inputs: nothing to plot per channel"),
    (["staircase", NOTEBOOK, "--num-bits", "1", "-o", "{tmp}/f.png"], "Error: num_bits: must be between 2 and 16"),
])
def test_cli_errors_are_one_line_exit_2_and_write_nothing(cli, tmp_path, argv, message):
    tmp = str(tmp_path)
    (tmp_path / "exists.png").write_bytes(b"keep")
    result = cli("plot", *[a.replace("{tmp}", tmp) for a in argv])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(message.replace("{tmp}", tmp)), result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["exists.png"]
    assert (tmp_path / "exists.png").read_bytes() == b"keep"


def test_cli_force_replaces_a_figure(cli, tmp_path):
    out = tmp_path / "f.pdf"
    out.write_bytes(b"old")
    result = cli("plot", "hist", NOTEBOOK, "-o", out, "--force", "-q")
    assert result.exit_code == 0 and result.stderr == ""
    assert out.read_bytes().startswith(b"%PDF")


# --- fakequant-grad --plot -----------------------------------------------------------------------------

def test_fakequant_grad_plot_writes_numbers_and_picture(cli, tmp_path):
    out, fig = tmp_path / "g.h5", tmp_path / "ste.png"
    result = cli("fakequant-grad", NOTEBOOK, "--num-bits", "2", "-o", out, "--plot", fig)
    assert result.exit_code == 0, result.output
    with h5py.File(out, "r") as f:
        assert set(f) == {"backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max"}
    size, pixels = png_pixels(fig)
    assert size == (640, 760)  # the STE figure with its backprops panel
    assert_not_blank(pixels)
    # The same picture as `qgcli plot ste --gradients`, pixel for pixel.
    ref = tmp_path / "ref.png"
    assert cli("plot", "ste", NOTEBOOK, "--num-bits", "2", "--gradients", NOTEBOOK + ":gradients",
               "-o", ref).exit_code == 0
    np.testing.assert_array_equal(png_pixels(ref)[1], pixels)


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_fakequant_grad_plot_per_channel_and_args(cli, tmp_path, device):
    if device == "gpu":
        pytest.importorskip("cupy")
    result = cli("fakequant-grad", PER_CHANNEL, "-o", tmp_path / "g.npz", "--plot", tmp_path / "pc.png",
                 "--device", device)
    assert result.exit_code == 0, result.output
    assert_not_blank(png_pixels(tmp_path / "pc.png")[1])
    result = cli("fakequant-grad", NOTEBOOK, "--variant", "args", "--num-bits", "3", "-o", tmp_path / "a.h5",
                 "--plot", tmp_path / "a.pdf", "--device", device)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "a.pdf").read_bytes().startswith(b"%PDF")


@pytest.mark.parametrize("plot, message", [
    ("exists.png", "Error: --plot: {tmp}/exists.png exists; use --force to replace it"),
    ("f.gif", "Error: --plot: cannot tell the figure format from '.gif'"),
    ("no/f.png", "Error: --plot: directory {tmp}/no does not exist"),
])
def test_fakequant_grad_bad_plot_path_writes_no_output(cli, tmp_path, plot, message):
    tmp = str(tmp_path)
    (tmp_path / "exists.png").write_bytes(b"keep")
    result = cli("fakequant-grad", NOTEBOOK, "-o", tmp_path / "g.h5", "--plot", f"{tmp}/{plot}")
    assert result.exit_code == 2
    assert result.stderr.startswith(message.replace("{tmp}", tmp)), result.stderr
    assert sorted(os.listdir(tmp_path)) == ["exists.png"]


def test_fakequant_grad_plot_never_overwrites_an_input(cli, tmp_path):
    # A figure name that is a link to an input is refused, even with --force.
    x = tmp_path / "x.npy"
    np.save(x, np.linspace(-8, 8, 33, dtype=np.float32))
    link = tmp_path / "link.png"
    link.symlink_to(x)
    before = x.read_bytes()
    result = cli("fakequant-grad", "--inputs", x, "--gradients", x, "--min", "-6", "--max", "6",
                 "-o", tmp_path / "out.npz", "--plot", link, "--force")
    assert result.exit_code == 2
    assert result.stderr == f"Error: --plot: {link} is also an input; qgcli never overwrites its inputs\n"
    assert x.read_bytes() == before and not (tmp_path / "out.npz").exists()
    result = cli("plot", "ste", "--inputs", x, "--min", "-6", "--max", "6", "-o", link, "--force")
    assert result.exit_code == 2 and "is also an input" in result.stderr


# --- the figures of docs/plots.md ---------------------------------------------------------------------

def _doc_figures():
    """The PNG names docs/make_figures.sh writes (docs/NAME.png)."""
    import re

    with open(os.path.join(ROOT, "docs", "make_figures.sh"), encoding="utf-8") as fh:
        return sorted(set(re.findall(r"docs/([\w.-]+\.png)", fh.read())))


def test_make_figures_writes_the_figures_the_page_shows():
    names = _doc_figures()
    assert {"notebook_staircase.png", "notebook_ste.png", "notebook_ste_backprop.png", "per_channel.png"} <= set(names)
    with open(os.path.join(ROOT, "docs", "plots.md"), encoding="utf-8") as fh:
        page = fh.read()
    for name in names:
        assert f"]({name})" in page, name  # embedded by a path relative to docs/


@pytest.mark.parametrize("name", _doc_figures())
def test_the_committed_figures_are_drawn(name):
    size, pixels = png_pixels(os.path.join(ROOT, "docs", name))
    assert size[0] >= 600
    assert_not_blank(pixels)


def test_buffer_rendering_needs_no_display():
    # A figure renders into memory with the Agg canvas it was built on; no backend switch, no pyplot.
    fig = plots.staircase(np.linspace(-1, 1, 11, dtype=np.float32), -1.0, 1.0)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    assert buf.getvalue().startswith(b"\x89PNG")
    assert type(fig.canvas).__name__ == "FigureCanvasAgg"


def test_staircase_of_an_outlier_and_a_coarse_channel_is_the_step_function():
    # issue 40, item 4: a line through the points drew a diagonal from the last level to an outlier, and a
    # 3-bit channel slanted between levels; the step function is flat on every level, vertical between.
    x = np.array([[0.17, -0.4], [0.2, 0.1], [1.5, 0.33], [0.0, 0.9]], np.float32)
    mn, mx = np.float32([0.0, -1.0]), np.float32([0.75, 1.0])
    for channel in (0, 1):
        fig = plots.staircase(x, mn, mx, num_bits=3, channel=channel)
        step = line(fig.axes[0], "outputs_step")
        sx, sy = step.get_xdata(), step.get_ydata()
        np.testing.assert_array_equal(sy[::2], sy[1::2])  # horizontal runs
        np.testing.assert_array_equal(sx[1:-1:2], sx[2::2])  # joined by vertical edges
        grid = plots.channel_grid(ops.nudge(mn, mx, num_bits=3), channel)
        np.testing.assert_array_equal(sy[::2], ops.fake_quant_with_min_max_vars(
            np.float32(sx[::2]), grid.min, grid.max, num_bits=3))
        assert set(sy.tolist()) <= set(plots.grid_levels(grid).tolist())
