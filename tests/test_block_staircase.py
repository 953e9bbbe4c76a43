"""``qgcli plot staircase`` / ``plot ste`` of MX, NVFP4 and ONNX QuantizeLinear groups (#40 items 4 and 10): one
figure per quantizer, in the element grid's units (each input divided by its block's scale, plus the zero
point), the element grid's exact step function under the op's outputs, the gradient function on a panel of its
own.  The numbers drawn are checked against torchao's and the onnx reference's own outputs and codes, stored in
tests/golden/formats.h5, not against qgcli's."""
import json

import h5py
import numpy as np
import pytest

from qgcli.ops.mx import element_values
from qgcli.ops.onnx_quantize import grid_values
from test_block_formats_cli import MX, NVFP4, ONNX
from test_block_plots import png_size

#: One golden case of each kind: per block (MX fp4 / fp8, NVFP4 with and without the per-tensor scale),
#: QuantizeLinear per tensor, per block with zero points, and a float8 grid that does not saturate (NaN beyond).
CASES = [("mx", "mxfp4_even_normal"), ("mx", "mxfp8-e4m3_floor_normal"), ("nvfp4", "heavy_pts0"),
         ("nvfp4", "heavy_pts1"), ("onnx", "uint8_per-tensor_range"), ("onnx", "int4_blocked_axis-1_bs2_zp_range"),
         ("onnx", "float8e4m3fn_blocked_axis-1_bs2_sat0_range")]
_FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _write(path):
    rng = np.random.default_rng(7)
    with h5py.File(path, "w") as f:
        for family, name in CASES:
            data, a = {"mx": MX, "nvfp4": NVFP4, "onnx": ONNX}[family][name]
            g = f.create_group(f"{family}/{name}")
            if family == "mx":
                g.attrs.update(op="mx", format=a["format"], block_size=int(a["block_size"]), axis=int(a["axis"]),
                               scale_mode=a["scale_mode"])
                g["inputs"] = data["inputs"]
            elif family == "nvfp4":
                g.attrs.update(op="nvfp4", axis=int(a["axis"]), per_tensor_scale=bool(a["per_tensor_scale"]))
                g["inputs"] = data["inputs"]
            else:
                g.attrs.update(op="QuantizeLinear", dtype=a["dtype"], axis=int(a["axis"]),
                               block_size=int(a["block_size"]), saturate=bool(a["saturate"]))
                for k in ("x", "y_scale", "y_zero_point"):
                    if k in data:
                        g[k] = data[k]
            shape = data["x" if family == "onnx" else "inputs"].shape
            g["gradients"] = rng.standard_normal(shape).astype(np.float32)
    return str(path)


def _reference(family, name):
    """The element grid and the outputs in its units, from the framework's own results (golden file)."""
    data, a = {"mx": MX, "nvfp4": NVFP4, "onnx": ONNX}[family][name]
    if family == "mx":
        scales = np.exp2(np.repeat(data["scales"].astype(np.float64) - 127, int(a["block_size"]), axis=int(a["axis"])))
        return element_values(a["format"]), data["outputs"] / scales
    if family == "nvfp4":
        q = data["quantized"]
        return np.concatenate([-_FP4[::-1], _FP4]), np.where(q & 8, -1.0, 1.0) * _FP4[q & 7]
    q = data["quantized"]
    if a["dtype"].startswith("float8"):  # stored as the float8 bytes
        q = q.view(getattr(__import__("ml_dtypes"), a["dtype"].replace("float8", "float8_")))
    return grid_values(a["dtype"]), q.astype(np.float64)


def _line(fig, gid):
    return next((line for ax in fig.axes for line in ax.get_lines() if line.get_gid() == gid), None)


def _on_step(xs, ys, u, y):
    """``y`` is the step's value at ``u`` (either side's on a vertical edge)."""
    values = {float(ys[i]) for i in range(0, len(xs), 2) if xs[i] <= u <= xs[i + 1]}
    return y in values


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("blocks") / "run.h5")


@pytest.mark.parametrize("kind", ["staircase", "ste"])
@pytest.mark.parametrize("family, name", CASES)
def test_every_drawn_value_is_the_frameworks(run, kind, family, name):
    from qgcli.report import layer_figures

    tasks, skipped = layer_figures.plan(run, kind, layer=f"{family}/{name}")
    assert skipped == [] and len(tasks) == 1
    fig = layer_figures.draw(tasks[0])
    s = fig.qgcli_summary
    assert s["plot"] == kind and s["step_drawn"], s
    levels, yu = _reference(family, name)
    points, step = _line(fig, "outputs"), _line(fig, "outputs_step")
    xs, ys = np.asarray(step.get_xdata()), np.asarray(step.get_ydata())
    assert set(ys.tolist()) <= set(levels.tolist())  # every step value is a value of the op's grid
    assert np.all(np.diff(xs) >= 0) and len(set(ys.tolist())) > 1
    px, py = np.asarray(points.get_xdata()), np.asarray(points.get_ydata())
    produced = set(yu[np.isfinite(yu)].tolist())
    assert len(px) > 0 and set(py[np.isfinite(py)].tolist()) <= produced  # each point an output of the op
    assert all(_on_step(xs, ys, u, y) for u, y in zip(px.tolist(), py.tolist()) if np.isfinite(y))
    if kind == "ste":  # the identity of torchao's MX / NVFP4 QAT and ModelOpt's QuantizeLinear, on its own axis
        mask, mask_step = _line(fig, "mask"), _line(fig, "mask_step")
        assert s["mask_drawn"] == "line" and s["mask_values"] == [1.0] and s["backprops"]
        assert set(np.asarray(mask_step.get_ydata()).tolist()) == {1.0}
        assert mask.axes is not points.axes and _line(fig, "backprops").axes not in (mask.axes, points.axes)


def test_plot_ste_of_a_run_writes_one_figure_per_quantizer(run, cli, tmp_path):
    r = cli("plot", "ste", run, "-o", f"{tmp_path}/figs/", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["skipped"] == []
    assert sorted(layer["path"] for layer in s["layers"]) == sorted(f"{f}/{n}" for f, n in CASES)
    for layer in s["layers"]:
        png_size(layer["file"])
    r = cli("plot", "staircase", run, "--layer", "mx/mxfp4_even_normal", "--channel", "1", "-o",
            tmp_path / "block1.png", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["channel"] == 1 and png_size(tmp_path / "block1.png")


@pytest.mark.parametrize("semantics, operands", [
    ("mx", ("--inputs", "x.npy", "--mx-format", "mxfp4", "--block-size", "16")),
    ("nvfp4", ("--inputs", "x.npy")),
    ("onnx", ("--x", "x.npy", "--y-scale", "0.02", "--y-zero-point", "z.npy", "--dtype", "uint8"))])
def test_plot_ste_and_staircase_of_a_plain_tensor_with_semantics(cli, tmp_path, monkeypatch, semantics, operands):
    monkeypatch.chdir(tmp_path)
    x = np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32)
    np.save("x.npy", x)
    np.save("g.npy", np.random.default_rng(3).standard_normal(x.shape).astype(np.float32))
    np.save("z.npy", np.uint8(128))
    for kind, extra in (("staircase", ()), ("ste", ("--gradients", "g.npy"))):
        r = cli("plot", kind, *operands, *extra, "--semantics", semantics, "-o", f"{kind}.png", "--json")
        assert r.exit_code == 0, r.output
        s = json.loads(r.stdout)
        assert s["plot"] == kind and s["step_drawn"] and s["elements"] == x.size, s
        if kind == "ste":
            assert s["backprops"] and s["mask_values"] == [1.0]
        png_size(tmp_path / f"{kind}.png")
    r = cli("plot", "staircase", *operands, "--semantics", semantics, "--mode", "SCALED", "-o", "bad.png")
    assert r.exit_code == 2 and "--mode" in r.stderr and not (tmp_path / "bad.png").exists()
    r = cli("plot", "staircase", "--inputs", "x.npy", "--mx-format", "mxfp4", "-o", "bad.png")
    assert r.exit_code == 2 and "--semantics mx" in r.stderr and not (tmp_path / "bad.png").exists()


def _lines(fig, gid):
    return [line for ax in fig.axes for line in ax.get_lines() if line.get_gid() == gid]


def _blocks_of(a, axis, block_size):
    return np.moveaxis(np.asarray(a, np.float64), axis, -1).reshape(-1, block_size)


@pytest.mark.parametrize("family, name", CASES)
def test_staircase_draws_the_telling_blocks_in_the_datas_units(run, family, name):
    """Below the element grid, the block with the largest |x| and the worst block by SQNR (one block when they are
    the same), in the data's own units: the framework's inputs and outputs of that block as points, on the
    element values times the block's scale.  A tensor quantized as one block with one scale: that block; a scale
    per channel inside one drawn block (a blocked QuantizeLinear whose last block is partial): none."""
    from qgcli.report import layer_figures

    (task,), _ = layer_figures.plan(run, "staircase", layer=f"{family}/{name}")
    fig = layer_figures.draw(task)
    drawn = fig.qgcli_summary["data_units"]
    data, a = {"mx": MX, "nvfp4": NVFP4, "onnx": ONNX}[family][name]
    x, y = data["x" if family == "onnx" else "inputs"], data["outputs"]
    if family == "onnx":
        if a["mode"] != "per-tensor":  # blocks of 2 over an axis of 5: said, not "per axis"
            assert drawn == [] and _lines(fig, "block_outputs") == []
            assert x.shape[int(a["axis"])] % int(a["block_size"])
            assert "blocks of 2 along axis -1, the last one partial" in " ".join(fig.axes[0].get_title().split())
            return
        axis, size = -1, x.size
    else:
        axis, size = int(a["axis"]), int(a["block_size"]) if family == "mx" else 16
    xb, yb = _blocks_of(x, axis, size), _blocks_of(y, axis, size)
    with np.errstate(all="ignore"):
        amax = int(np.where(np.isfinite(xb), np.abs(xb), -1).max(axis=1).argmax())
        sqnr = 10 * np.log10((xb ** 2).sum(axis=1) / ((xb - yb) ** 2).sum(axis=1))
    sqnr = np.where(np.isnan(sqnr), np.inf, sqnr)
    expected = [amax] + ([int(sqnr.argmin())] if np.isfinite(sqnr.min()) and sqnr.argmin() != amax else [])
    assert [d["block"] for d in drawn] == expected, drawn
    if len(xb) > 1:
        assert "largest |x|" in drawn[0]["why"] and "worst SQNR" in drawn[-1]["why"]
    points, steps = _lines(fig, "block_outputs"), _lines(fig, "block_step")
    assert len(points) == len(steps) == len(expected)
    for d, p, step in zip(drawn, points, steps):
        title = p.axes.get_title()
        assert (f"block {d['block']}" in title or len(xb) == 1) and (d["why"].split(",")[0] in title)
        pairs = set(zip(xb[d["block"]].tolist(), yb[d["block"]].tolist()))
        px, py = np.asarray(p.get_xdata()), np.asarray(p.get_ydata())
        assert len(px) and set(zip(px.tolist(), py.tolist())) <= pairs  # the framework's own pairs
        xs, ys = np.asarray(step.get_xdata()), np.asarray(step.get_ydata())
        assert np.all(np.diff(xs) >= 0) and len(set(ys.tolist())) > 1
        for u, v in zip(px.tolist(), py.tolist()):  # each output on the step (float32 op, float64 line)
            tol = 1e-6 * max(1.0, abs(u))
            at = [ys[i] for i in range(0, len(xs), 2) if xs[i] - tol <= u <= xs[i + 1] + tol]
            assert any(abs(w - v) <= 1e-6 * max(1.0, abs(v)) for w in at), (u, v, at)
