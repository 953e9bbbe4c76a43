"""Run files in figures: ``plot layers`` (bars per layer, layer x step heat maps), one figure per layer
(``plot staircase|ste|hist|channels RUN -o DIR/``, ``--layer``), and ``report`` over several run files."""
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import ROOT, SAMPLES
from test_runfile import make_run

PNG = b"\x89PNG\r\n\x1a\n"


def _head(path):
    with open(path, "rb") as fh:
        return fh.read(8)


@pytest.fixture
def two_steps(tmp_path):
    path = tmp_path / "run.h5"
    make_run(path, steps=("step_1", "step_2"))
    return str(path)


def _report(cli, *targets):
    r = cli("report", *targets, "--json", "-q")
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


# --- plot layers -------------------------------------------------------------------------------------------

def test_plot_layers_bars_are_the_report_numbers(cli, two_steps, tmp_path):
    from qgcli.report import plots
    from qgcli.report.layers import DEFAULT_PERCENTILES, latest_per_layer, report_layers, trends, worst_first

    doc = _report(cli, two_steps)
    rows, _ = report_layers([two_steps], percentiles=DEFAULT_PERCENTILES)
    steps, trend = trends(rows)
    assert steps == ["step_1", "step_2"]
    shown = worst_first(latest_per_layer(rows))
    for r in shown:
        r["label"] = r["layer"]
    fig = plots.layers(shown, steps=steps, trends=trend)
    ax_blocked, ax_sqnr = fig.axes[0], fig.axes[1]
    bars = {int(round(p.get_y() + p.get_height() / 2)): p.get_width() for p in ax_blocked.patches
            if p.get_gid() == "gradient_blocked"}
    by_path = {r["path"]: r for r in doc["layers"]}
    assert [t.get_text() for t in ax_blocked.get_yticklabels()] == [r["layer"] for r in shown]
    for i, r in enumerate(shown):
        assert r["step"] == "step_2"
        assert bars[i] == pytest.approx(100 * by_path[r["path"]]["gradient_blocked"], rel=1e-12)
    sqnr = [p.get_width() for p in ax_sqnr.patches if p.get_gid() == "sqnr_db"]
    assert sqnr == pytest.approx([by_path[r["path"]]["sqnr_db"] for r in shown], rel=1e-12)
    heat = {a.get_images()[0].get_gid(): a.get_images()[0].get_array() for a in fig.axes if a.get_images()}
    for i, r in enumerate(shown):
        for j, step in enumerate(steps):
            expected = by_path[f"{step}/{r['layer']}"]
            assert heat["trend_gradient_blocked"][i, j] == pytest.approx(100 * expected["gradient_blocked"])
            assert heat["trend_sqnr_db"][i, j] == pytest.approx(expected["sqnr_db"])
    # worst first: the blocked share never grows down the bars
    widths = [bars[i] for i in range(len(shown))]
    assert widths == sorted(widths, reverse=True)

    out = tmp_path / "layers.png"
    r = cli("plot", "layers", two_steps, "-o", out, "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)
    assert out.read_bytes()[:8] == PNG and s["layers"] == len(shown) and s["steps"] == steps
    assert [d["path"] for d in s["drawn"]] == [r["path"] for r in shown]
    assert [d["gradient_blocked"] for d in s["drawn"]] == [by_path[r["path"]]["gradient_blocked"] for r in shown]


def test_plot_layers_200_layers_labels_fit_and_figure_grows():
    from qgcli.report import plots

    rows = [{"path": f"model/encoder/block_{i:03d}/attention/output_projection/weight_quant", "layer": None,
             "gradient_blocked": (i % 17) / 40, "clipped": 0.1, "sqnr_db": 10 + i % 23, "suggested_sqnr_db": None}
            for i in range(200)]
    rows[7]["gradient_blocked"], rows[9]["sqnr_db"] = None, None  # no gradients; no error at all
    fig = plots.layers(rows)
    fig.set_dpi(30)  # the same layout in inches, fewer pixels to draw
    w, h = fig.get_size_inches()
    assert h >= 200 * plots.LAYER_ROW_INCHES
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    labels = fig.axes[0].get_yticklabels()
    assert len(labels) == 200
    for t in labels + [fig._suptitle]:
        e = t.get_window_extent(renderer)
        assert e.x0 >= box.x0 - 0.5 and e.x1 <= box.x1 + 0.5 and e.y0 >= box.y0 - 0.5 and e.y1 <= box.y1 + 0.5
    assert [p.get_width() for p in fig.axes[0].patches if p.get_gid() == "clipped"] == [pytest.approx(10.0)]
    assert len([p for p in fig.axes[1].patches if p.get_gid() == "sqnr_db"]) == 199
    small = plots.layers(rows[:5])
    assert small.get_size_inches()[1] < h


def test_plot_layers_to_stdout_and_refusals(cli, two_steps, tmp_path):
    r = cli("plot", "layers", f"{two_steps}:step_1", "-o", "-", "--format", "svg", "-q")
    assert r.exit_code == 0, r.output
    assert r.stdout_bytes.lstrip().startswith(b"<?xml") and b"<svg" in r.stdout_bytes
    r = cli("plot", "layers", os.path.join(SAMPLES, "batch_norm.h5"), "-o", tmp_path / "x.png")
    assert r.exit_code == 2 and "no quantizer to plot" in r.output
    r = cli("plot", "layers", two_steps, "-o", tmp_path / "x.png", "--json", "-o", "-")
    assert r.exit_code == 2


# --- one figure per layer ----------------------------------------------------------------------------------

def test_one_figure_per_layer_named_by_group_path(cli, tmp_path):
    path = tmp_path / "run.h5"
    make_run(path)
    with h5py.File(path, "a") as f:  # a name a file system would read otherwise
        f.copy(f["step_1/net/act"], "step_1/a:b")
    out = tmp_path / "figs"
    r = cli("plot", "staircase", path, "-o", f"{out}/", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)
    from qgcli.report.layer_figures import workers

    assert s["figures"] == 5 and s["workers"] == workers(5)
    drawn = {d["path"]: d["file"] for d in s["layers"]}
    assert set(drawn) == {"step_1/net/block/conv/weight_quant", "step_1/net/act", "step_1/net/logits", "step_1/a:b",
                          "step_1/head/torch_act"}  # PyTorch's group on its own grid
    assert drawn["step_1/net/act"] == str(out / "step_1" / "net" / "act.png")
    assert drawn["step_1/a:b"] == str(out / "step_1" / "a_b.png")
    for file in drawn.values():
        assert _head(file) == PNG
    index = json.loads((out / "index.json").read_text())
    assert {e["name"]: e["path"] for e in index["files"]}["step_1/a:b"] == "step_1/a_b.png"
    assert {d["path"] for d in s["skipped"]} == {"step_1/net/bn"}
    # an existing, non-empty folder needs --force
    r = cli("plot", "staircase", path, "-o", f"{out}/")
    assert r.exit_code == 2 and "--force" in r.output
    # channels: the per-channel groups only
    r = cli("plot", "channels", path, "-o", f"{tmp_path}/ch/", "--json")
    assert r.exit_code == 0, r.output
    assert [d["path"] for d in json.loads(r.output)["layers"]] == ["step_1/net/block/conv/weight_quant"]


def test_layer_figure_is_the_single_bundle_figure(cli, tmp_path):
    from qgcli.report import layer_figures
    from qgcli.report import plots

    path = tmp_path / "run.h5"
    arrays = make_run(path)["step_1"]
    (task,), _ = layer_figures.plan(str(path), "ste", layer="step_1/net/block/conv/weight_quant")
    fig = layer_figures.draw(task)
    w, hi = arrays["w"], arrays["hi"]
    ref = plots.ste(w, -hi, hi, gradients=arrays["g"], num_bits=4, narrow_range=True, variant="per-channel")
    got = {l.get_gid(): l.get_ydata() for a in fig.axes for l in a.get_lines() if l.get_gid()}
    want = {l.get_gid(): l.get_ydata() for a in ref.axes for l in a.get_lines() if l.get_gid()}
    assert set(got) == set(want) and "backprops" in got
    for gid in want:
        np.testing.assert_array_equal(got[gid], want[gid])
    # --layer to a file, and to stdout
    r = cli("plot", "hist", path, "--layer", "step_1/net/act", "-o", tmp_path / "act.png", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["path"] == "step_1/net/act" and (tmp_path / "act.png").read_bytes()[:8] == PNG
    r = cli("plot", "staircase", f"{path}:step_1", "--layer", "net/logits", "-o", "-", "-q")
    assert r.exit_code == 0 and r.stdout_bytes[:8] == PNG
    for args, words in ((("--layer", "step_1/net/bn", "-o", tmp_path / "bn.png"), "not one of the fake-quant ops"),
                        (("--layer", "nope", "-o", tmp_path / "n.png"), "nope"),
                        (("-o", tmp_path / "all.png"), "-o DIR/")):
        r = cli("plot", "staircase", path, *args)
        assert r.exit_code == 2 and words in r.output, r.output
    r = cli("plot", "staircase", os.path.join(SAMPLES, "notebook.h5"), "--layer", "x", "-o", tmp_path / "n.png")
    assert r.exit_code == 2 and "needs a run file" in r.output


def test_per_layer_figures_in_worker_processes_subprocess(tmp_path):
    """The sample's six TF groups and two PyTorch groups (on PyTorch's grid) through the process pool, as a
    user runs it."""
    out = tmp_path / "figs"
    env = {**os.environ, "QGCLI_NO_PROGRESS": "1"}
    proc = subprocess.run([sys.executable, "-m", "qgcli", "plot", "ste", os.path.join(SAMPLES, "run.h5"),
                           "-o", f"{out}/", "--json"], capture_output=True, cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    s = json.loads(proc.stdout)
    assert s["figures"] == 8 and s["workers"] == (0 if len(os.sched_getaffinity(0)) < 2 else
                                                  min(8, len(os.sched_getaffinity(0))))
    assert sum(d["op"].startswith("torch.") for d in s["layers"]) == 2
    for d in s["layers"]:
        assert _head(d["file"]) == PNG
    assert not (out / "index.json").exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".qgcli-")]


# --- report over several run files -----------------------------------------------------------------------

def test_report_over_several_files_each_a_step(cli, tmp_path):
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    make_run(a, steps=("s",), seed=1)
    make_run(b, steps=("s",), seed=2)
    with h5py.File(a, "a") as f:  # plain layer paths: each file is a step
        f.move("s/net", "net")
    with h5py.File(b, "a") as f:
        f.move("s/net", "net")
    doc = _report(cli, a, b)
    assert doc["run_files"] == [str(a), str(b)]
    assert doc["steps"] == sorted([str(a), str(b)])
    assert set(doc["trends"]) >= {"net/act", "net/logits", "net/block/conv/weight_quant"}
    single = {r["layer"]: r for r in _report(cli, b)["layers"]}
    point = {p["step"]: p for p in doc["trends"]["net/act"]}[str(b)]
    assert point["gradient_blocked"] == single["net/act"]["gradient_blocked"]
    r = cli("report", a, os.path.join(SAMPLES, "notebook.h5"))
    assert r.exit_code == 2 and "not a run file" in r.output
    r = cli("report", a, b, "--layer", "net/act")
    assert r.exit_code == 2 and "one run file" in r.output
    r = cli("report", a, b, "--csv", "-q")
    assert r.exit_code == 0 and len(r.output.strip().splitlines()) == 1 + len(doc["layers"])


def test_a_quantize_v2_group_draws_the_round_trip(cli, tmp_path):
    """QuantizeV2 groups (the notebook's tf.quantize + tf.dequantize) are drawn as plot ste draws
    --variant quantize-dequantize on the same operands and attributes."""
    import shutil

    from qgcli.report import layer_figures, plots

    path = tmp_path / "run.h5"
    shutil.copy(os.path.join(SAMPLES, "run.h5"), path)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 32)).astype(np.float32)
    with h5py.File(path, "a") as f:
        g = f.create_group("step_000100/head/qv2")
        g.attrs.update(op="QuantizeV2", T="qint8", mode="SCALED")
        g["inputs"], g["min"], g["max"] = x, np.float32(-2), np.float32(2)
    (task,), _ = layer_figures.plan(str(path), "ste", layer="step_000100/head/qv2")
    fig = layer_figures.draw(task)
    ref = plots.ste(x, np.float32(-2), np.float32(2), variant="quantize-dequantize",
                    quantize=dict(dtype="qint8", mode="SCALED", round_mode="HALF_AWAY_FROM_ZERO",
                                  ensure_minimum_range=0.01))
    got = {l.get_gid(): l.get_ydata() for a in fig.axes for l in a.get_lines() if l.get_gid()}
    want = {l.get_gid(): l.get_ydata() for a in ref.axes for l in a.get_lines() if l.get_gid()}
    assert set(got) == set(want) and "mask" in got
    for gid in want:
        np.testing.assert_array_equal(got[gid], want[gid])
    r = cli("plot", "staircase", path, "-o", f"{tmp_path}/figs/", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)
    assert s["figures"] == 9 and {d["path"] for d in s["skipped"]} == {
        "step_000100/backbone/conv1/bn", "step_000200/backbone/conv1/bn"}
