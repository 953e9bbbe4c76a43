"""Plots that show the truth: the STE mask drawn as the step it is, estimators that coincide told apart and
named, the op named in the legend, and no figure with text, legends and data drawn over each other.

The collision check renders each figure on its Agg canvas and compares display boxes
(``get_window_extent``): no two drawn texts overlap, and no legend overlaps a text outside it or the data
area of any axes (legends sit outside the data, so none can hide a line).
"""
import os

import numpy as np
import pytest
from matplotlib.text import Text

from qgcli import ops
from qgcli.report import plots

from conftest import SAMPLES
from test_plots import NOTEBOOK, nb, pc  # noqa: F401  (the bundles, read once per module, as fixtures)

RUN = os.path.join(SAMPLES, "run.h5")
F32 = np.float32


def _lines(fig, gid):
    return [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_gid() == gid]


def _legend_texts(fig):
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


# --- item 7: the STE mask is a step with its edges exactly on the bounds ------------------------------------

@pytest.mark.parametrize("num_bits, lo, hi, narrow", [
    (2, -6.0, 6.0, False),   # the notebook's: nudged to [-8, 4]
    (8, 1.3, 5.7, False),    # a range not containing zero (nudged to include it)
    (4, -3.1, -0.7, True),   # all negative, narrow range
    (3, -0.37, 2.9, True),
    (16, -1.0, 1.0, False),
])
def test_ste_mask_step_edges_are_the_nudged_bounds(num_bits, lo, hi, narrow):
    grid = ops.nudge(F32(lo), F32(hi), num_bits=num_bits, narrow_range=narrow)
    nlo, nhi = float(grid.nudged_min), float(grid.nudged_max)
    width = nhi - nlo
    # Coarse samples that straddle the bounds (joining them would ramp), then the bounds themselves (inclusive).
    coarse = np.linspace(nlo - 0.77 * width, nhi + 0.61 * width, 9, dtype=F32)
    for x in (coarse, np.concatenate([coarse, np.array([nlo, nhi], F32)])):
        fig = plots.ste(x, F32(lo), F32(hi), num_bits=num_bits, narrow_range=narrow)
        (step,) = _lines(fig, "mask_step")
        left, right = float(x.min()), float(x.max())
        assert step.get_xdata().tolist() == [left, nlo, nlo, nhi, nhi, right]
        assert step.get_ydata().tolist() == [0, 0, 1, 1, 0, 0]
        assert step.get_linestyle() == "-" and fig.qgcli_summary["mask_drawn"] == "step"
        # The op's own values at the inputs are drawn too, as points (never joined into a ramp).
        (points,) = _lines(fig, "mask")
        assert points.get_linestyle() == "None"
        mask = ops.fake_quant_with_min_max_vars_gradient(np.ones_like(x), x, F32(lo), F32(hi), num_bits=num_bits,
                                                          narrow_range=narrow)[0]
        assert points.get_ydata().tolist() == mask[np.argsort(x, kind="stable")].tolist()
        on_bounds = np.isin(points.get_xdata(), [nlo, nhi])
        assert np.all(points.get_ydata()[on_bounds] == 1)


def test_mask_step_of_other_variants_and_where_there_is_none(pc):
    x = np.linspace(-9, 9, 13, dtype=F32)
    # QuantizeV2 + Dequantize: the adjusted range [output_min, output_max].
    fig = plots.ste(x, -6.0, 6.0, variant="quantize-dequantize", quantize=dict(dtype="qint8", mode="SCALED"))
    g = fig.qgcli_summary["grid"]
    (step,) = _lines(fig, "mask_step")
    assert step.get_xdata().tolist()[1:5] == [g["output_min"], g["output_min"], g["output_max"], g["output_max"]]
    # QuantizeAndDequantizeV4: V4Grad masks on the range given, not on the grid's ends.
    fig = plots.ste(x, -2.0, 2.5, num_bits=4, variant="quantize-and-dequantize-v4",
                    quantize=dict(signed_input=True, range_given=True, round_mode="HALF_UP"))
    (step,) = _lines(fig, "mask_step")
    assert step.get_xdata().tolist()[1:5] == [-2.0, -2.0, 2.5, 2.5]
    # V3: pass-through, one flat line over the data.
    fig = plots.ste(x, -2.0, 2.5, num_bits=4, variant="quantize-and-dequantize-v3",
                    quantize=dict(signed_input=True, range_given=True, round_mode="HALF_TO_EVEN"))
    (step,) = _lines(fig, "mask_step")
    assert step.get_xdata().tolist() == [-9.0, 9.0] and step.get_ydata().tolist() == [1.0, 1.0]
    # One channel of a per-channel op: that channel's nudged bounds; all channels flattened: points only.
    k = 3
    fig = plots.ste(pc["inputs"], pc["min"], pc["max"], channel=k)
    grid = ops.nudge(pc["min"], pc["max"])
    (step,) = _lines(fig, "mask_step")
    assert step.get_xdata().tolist()[1:5] == [float(grid.nudged_min[k])] * 2 + [float(grid.nudged_max[k])] * 2
    fig = plots.ste(pc["inputs"], pc["min"], pc["max"])
    assert not _lines(fig, "mask_step") and fig.qgcli_summary["mask_drawn"] == "points"


def test_estimators_draw_steps_at_the_bounds_too(nb):
    fig = plots.estimators(nb["inputs"], nb["min"], nb["max"], num_bits=2, names=("ste", "scaled:0.5,0.25"))
    for name, inside, outside in (("ste", 1.0, 0.0), ("scaled:0.5,0.25", 0.5, 0.25)):
        (step,) = _lines(fig, f"estimator_step:{name}")
        assert step.get_xdata().tolist()[1:5] == [-8.0, -8.0, 4.0, 4.0]
        assert step.get_ydata().tolist() == [outside, outside, inside, inside, outside, outside]


# --- item 8: coinciding estimators, the op named -----------------------------------------------------------

def test_coinciding_estimators_are_told_apart_and_noted(cli, nb, tmp_path):
    fig = plots.estimators(nb["inputs"], nb["min"], nb["max"], num_bits=2, names=("ste", "pact", "identity"))
    assert fig.qgcli_summary["coincide"] == [["pact", "ste"]]
    (ste,) = _lines(fig, "estimator_step:ste")
    (pact,) = _lines(fig, "estimator_step:pact")
    np.testing.assert_array_equal(ste.get_xydata(), pact.get_xydata())
    assert ste.get_linestyle() != pact.get_linestyle() and ste.get_linewidth() > pact.get_linewidth()
    assert pact.get_zorder() > ste.get_zorder()
    (pact_points,) = _lines(fig, "estimator:pact")
    assert pact_points.get_marker() not in (None, "None", ".", "")  # sparse markers of its own shape
    assert "pact (= ste here)" in _legend_texts(fig)
    assert "pact coincides with ste on the plotted range" in fig.legends[0].get_title().get_text()
    # Estimators that differ are not called equal.
    assert "identity" in _legend_texts(fig) and "(= " not in "".join(t for t in _legend_texts(fig) if "identity" in t)
    r = cli("plot", "estimators", NOTEBOOK, "--num-bits", "2", "-e", "ste", "-e", "pact", "-o", tmp_path / "e.png")
    assert r.exit_code == 0, r.output
    assert r.stdout == ""
    assert "note: estimator pact coincides with ste on the plotted range" in r.stderr
    r = cli("plot", "estimators", NOTEBOOK, "--num-bits", "2", "-e", "ste", "-e", "identity", "-o", tmp_path / "f.png")
    assert r.exit_code == 0 and "coincides" not in r.stderr


@pytest.mark.parametrize("kwargs, op", [
    (dict(variant="vars"), "FakeQuantWithMinMaxVars"),
    (dict(variant="args"), "FakeQuantWithMinMaxArgs"),
    (dict(variant="quantize-dequantize", quantize=dict(dtype="quint8")), "QuantizeV2+Dequantize"),
    (dict(semantics="torch", scale=F32(0.05), zero_point=np.int32(128)), "torch.fake_quantize_per_tensor_affine"),
])
def test_estimators_legend_names_the_op_drawn(kwargs, op):
    x = np.linspace(-8, 8, 41, dtype=F32)
    rng = {} if kwargs.get("semantics") == "torch" else dict(min=F32(-6), max=F32(6))
    fig = plots.estimators(x, names=("ste",), **rng, **kwargs)
    assert f"outputs ({op})" in _legend_texts(fig)
    assert fig.qgcli_summary["outputs_op"] == op


@pytest.mark.parametrize("variant, quantize, op", [
    ("vars", None, "FakeQuantWithMinMaxVars"),
    ("quantize-dequantize", dict(dtype="qint8", mode="SCALED"), "QuantizeV2+Dequantize"),
    ("quantize-and-dequantize-v4", dict(signed_input=True, range_given=True, round_mode="HALF_UP"),
     "QuantizeAndDequantizeV4"),
    ("quantize-and-dequantize-v2", dict(signed_input=True, range_given=True, round_mode="HALF_UP"),
     "QuantizeAndDequantizeV2"),
])
def test_staircase_and_ste_legends_name_the_op_drawn(variant, quantize, op):
    x = np.linspace(-8, 8, 41, dtype=F32)
    for draw in (plots.staircase, plots.ste):
        fig = draw(x, F32(-6), F32(6), variant=variant, quantize=quantize, num_bits=4)
        assert f"outputs ({op})" in _legend_texts(fig)


# --- item 9: nothing drawn over anything else ---------------------------------------------------------------

def _layer_rows():
    from qgcli.report.layers import DEFAULT_PERCENTILES, latest_per_layer, report_layers, trends, worst_first

    rows, _ = report_layers([RUN], percentiles=DEFAULT_PERCENTILES)
    steps, trend = trends(rows)
    shown = worst_first(latest_per_layer(rows))
    for r in shown:
        r["label"] = r["layer"]
    return shown, steps, trend


def _one_layer_figure():
    from qgcli.report import layer_figures

    tasks, _ = layer_figures.plan(RUN, "ste")
    return layer_figures.draw(tasks[0])


FIGURES = {
    "staircase": lambda nb, pc: plots.staircase(nb["inputs"], nb["min"], nb["max"], num_bits=2),
    "staircase 8 bits": lambda nb, pc: plots.staircase(nb["inputs"], nb["min"], nb["max"]),
    "ste": lambda nb, pc: plots.ste(nb["inputs"], nb["min"], nb["max"], num_bits=2),
    "ste --gradients": lambda nb, pc: plots.ste(nb["inputs"], nb["min"], nb["max"], gradients=nb["gradients"],
                                                num_bits=2),
    "ste per-channel flattened": lambda nb, pc: plots.ste(pc["inputs"], pc["min"], pc["max"]),
    "ste quantize-dequantize": lambda nb, pc: plots.ste(nb["inputs"], -6.0, 6.0, variant="quantize-dequantize",
                                                        quantize=dict(dtype="quint8")),
    "hist": lambda nb, pc: plots.hist(nb["inputs"], nb["min"], nb["max"], num_bits=2),
    "hist --log": lambda nb, pc: plots.hist(nb["inputs"], nb["min"], nb["max"], num_bits=2, log=True),
    "hist per-channel": lambda nb, pc: plots.hist(pc["inputs"], pc["min"], pc["max"]),
    "channels": lambda nb, pc: plots.channels(pc["inputs"], pc["min"], pc["max"], gradients=pc["gradients"]),
    "channel vectors": lambda nb, pc: plots.channel_vectors({"scale_backprop": np.arange(5.0),
                                                             "offset_backprop": -np.arange(5.0)}),
    "estimators": lambda nb, pc: plots.estimators(nb["inputs"], nb["min"], nb["max"], num_bits=2),
    "estimators --gradients": lambda nb, pc: plots.estimators(nb["inputs"], nb["min"], nb["max"], num_bits=2,
                                                              gradients=nb["gradients"]),
    "estimators torch": lambda nb, pc: plots.estimators(nb["inputs"], semantics="torch", scale=F32(0.05),
                                                        zero_point=np.int32(128), names=("ste", "lsq", "pact")),
    "layers": lambda nb, pc: plots.layers(*_layer_rows()[:1], steps=_layer_rows()[1], trends=_layer_rows()[2]),
    "one layer of a run file": lambda nb, pc: _one_layer_figure(),
}


def _drawn_texts(fig):
    """The texts drawn on ``fig``: visible, not empty, tick labels inside their axis' view only."""
    hidden = set()
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            slack = 1e-9 * max(abs(lo), abs(hi), 1.0)
            for ticks, locs in ((axis.get_major_ticks(), axis.get_majorticklocs()),
                                (axis.get_minor_ticks(), axis.get_minorticklocs())):
                for tick, loc in zip(ticks, locs):
                    if not lo - slack <= loc <= hi + slack:
                        hidden.update((id(tick.label1), id(tick.label2)))

    return [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip() and id(t) not in hidden
            and (t.axes is None or t.axes.get_visible())]


def _overlap(a, b, tolerance=0.5):
    """True when boxes ``a`` and ``b`` share more than ``tolerance`` pixels in both directions."""
    return (min(a.x1, b.x1) - max(a.x0, b.x0) > tolerance) and (min(a.y1, b.y1) - max(a.y0, b.y0) > tolerance)


def _data_under(ax, box):
    """The gids of the data artists of ``ax`` (lines, bars, histograms, shaded regions: those with a gid) that
    pass through display box ``box``."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    found = set()
    inner = np.stack(np.meshgrid(np.linspace(box.x0, box.x1, 9), np.linspace(box.y0, box.y1, 5)), -1).reshape(-1, 2)
    for artist in ax.get_children():
        if not artist.get_gid() or not artist.get_visible():
            continue
        if isinstance(artist, Line2D) and artist.get_linestyle() not in ("None", "", " "):
            xy = artist.get_transform().transform(np.column_stack(artist.get_data()).astype(float))
            # every segment densified, so that a long vertical line counts where it crosses the box
            t = np.linspace(0, 1, 64)[:, None, None]
            pts = (xy[:-1] * (1 - t) + xy[1:] * t).reshape(-1, 2) if len(xy) > 1 else xy
            if np.any((pts[:, 0] > box.x0) & (pts[:, 0] < box.x1) & (pts[:, 1] > box.y0) & (pts[:, 1] < box.y1)):
                found.add(artist.get_gid())
        elif isinstance(artist, Line2D):  # markers only
            xy = artist.get_transform().transform(np.column_stack(artist.get_data()).astype(float))
            if np.any((xy[:, 0] > box.x0) & (xy[:, 0] < box.x1) & (xy[:, 1] > box.y0) & (xy[:, 1] < box.y1)):
                found.add(artist.get_gid())
        elif isinstance(artist, Patch):
            path = artist.get_path().transformed(artist.get_transform())
            if path.contains_points(inner).any():
                found.add(artist.get_gid())
    return found


def collisions(fig):
    """Every pair of things drawn over each other on ``fig``, in words."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    texts = _drawn_texts(fig)
    boxes = [(t, t.get_window_extent(renderer)) for t in texts]
    found = []
    for i, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[i + 1:]:
            if _overlap(box_a, box_b):
                found.append(f"text {a.get_text()!r} over text {b.get_text()!r}")
    for ax in fig.axes:  # notes inside an axes must not sit on its data
        for t in ax.texts:
            if t in texts:
                under = _data_under(ax, t.get_window_extent(renderer))
                found += [f"text {t.get_text()!r} over {gid}" for gid in sorted(under)]
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    for legend in legends:
        box = legend.get_window_extent(renderer)
        own = {id(t) for t in legend.findobj(Text)}
        for t, tbox in boxes:
            if id(t) not in own and _overlap(box, tbox):
                found.append(f"legend over text {t.get_text()!r}")
        for ax in fig.axes:
            if _overlap(box, ax.bbox):
                found.append(f"legend {[t.get_text() for t in legend.get_texts()][:2]} over the data of an axes")
    return found


@pytest.mark.parametrize("kind", list(FIGURES))
def test_nothing_is_drawn_over_anything_else(kind, nb, pc):
    fig = FIGURES[kind](nb, pc)
    assert collisions(fig) == []


def test_the_collision_check_catches_a_legend_on_the_data_and_texts_on_texts(nb):
    # The layout this file guards against: a see-through legend inside the axes, a note over the bars.
    fig = plots.hist(nb["inputs"], nb["min"], nb["max"], num_bits=2)
    ax = fig.axes[0]
    ax.legend(loc="center left")
    ax.text(0.5, 0.5, "over", transform=ax.transAxes)
    ax.text(0.5, 0.5, "again", transform=ax.transAxes)
    ax.text(-8.2, 30, "on the bound", fontsize=8)
    ax.text(0.995, 0.01, "on the bars", transform=ax.transAxes, ha="right", va="bottom")
    found = collisions(fig)
    assert any("over the data" in f for f in found) and any("'over' over text 'again'" in f for f in found)
    assert "text 'on the bound' over nudged_bound" in found and "text 'on the bars' over counts" in found


def test_ste_backprops_have_their_own_axes(nb):
    fig = plots.ste(nb["inputs"], nb["min"], nb["max"], gradients=nb["gradients"], num_bits=2)
    (outputs,) = _lines(fig, "outputs")
    (backprops,) = _lines(fig, "backprops")
    assert backprops.axes is not outputs.axes and backprops.axes.get_shared_x_axes().joined(backprops.axes,
                                                                                            outputs.axes)
    assert backprops.axes.get_ylabel() == "backprops_wrt_input"
    assert fig.legends[0].get_frame().get_alpha() in (None, 1.0)  # opaque
