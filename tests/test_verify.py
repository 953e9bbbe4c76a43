"""qgcli.capture.runfile_writer and `qgcli verify`, framework-free: references made with qgcli's own ops
(so verify must pass bit for bit) and perturbed ones (so it must fail, worst first, exit 1)."""
import json
import os

import h5py
import numpy as np
import pytest

from qgcli import ops
from qgcli.capture.runfile_writer import RunFileWriter, clean_path, step_group
from qgcli.cli import main
from qgcli.report.verify import compare


def _write(path, *, perturb=None, step=None, references=True):
    rng = np.random.default_rng(19)
    w = RunFileWriter(path, step=step, references=references)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    g = rng.standard_normal((4, 6)).astype(np.float32)
    lo, hi = np.float32(-1.0), np.float32(0.8)
    dx, dmin, dmax = ops.fake_quant_with_min_max_vars_gradient(g, x, lo, hi, num_bits=8, narrow_range=False)
    out = ops.fake_quant_with_min_max_vars(x, lo, hi, num_bits=8, narrow_range=False)
    if perturb == "fq":
        out = out.copy()
        out[1, 2] = np.nextafter(out[1, 2], np.float32(10))
    w.add("net.act_quant", "FakeQuantWithMinMaxVars", {"inputs": x, "min": lo, "max": hi, "gradients": g},
          {"num_bits": 8, "narrow_range": False},
          {"outputs": out, "backprops_wrt_input": dx, "backprop_wrt_min": dmin, "backprop_wrt_max": dmax})
    xb = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    dy = rng.standard_normal(xb.shape).astype(np.float32)
    scale = np.float32([0.5, 1.0, 2.0])
    mean = xb.mean(axis=(0, 2, 3), dtype=np.float64).astype(np.float32)
    inv = (1 / np.sqrt(xb.var(axis=(0, 2, 3), dtype=np.float64) + 1e-5)).astype(np.float32)
    bx, bs, bo = ops.fused_batch_norm_grad(dy, xb, scale, mean, inv, epsilon=1e-5, data_format="NCHW",
                                          is_training=True, variance_kind="inv-std")[:3]
    if perturb == "bn":
        bx = bx * np.float32(1.001)
    w.add("net/bn", "FusedBatchNormV3", {"y_backprop": dy, "x": xb, "scale": scale, "reserve_space_1": mean,
                                         "reserve_space_2": inv},
          {"epsilon": 1e-5, "data_format": "NCHW", "is_training": True, "variance_kind": "inv-std"},
          {"x_backprop": bx, "scale_backprop": bs, "offset_backprop": bo})
    w.add("net/act_quant", "FakeQuantWithMinMaxArgs", {"inputs": x, "gradients": g},
          {"min": -0.5, "max": 0.5, "num_bits": 4, "narrow_range": True},
          {"outputs": ops.fake_quant_with_min_max_args(x, min=-0.5, max=0.5, num_bits=4, narrow_range=True)})
    w.close()
    return w


def test_writer_layout_and_names(tmp_path):
    path = str(tmp_path / "run.h5")
    w = _write(path, step=3)
    assert list(w.groups) == ["net/act_quant", "net/bn", "net/act_quant_1"]
    with h5py.File(path) as f:
        g = f["step_000003/net/act_quant"]
        assert g.attrs["op"] == "FakeQuantWithMinMaxVars" and set(g) == {"inputs", "min", "max", "gradients",
                                                                          "reference"}
        assert set(g["reference"]) == {"outputs", "backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max"}
    _write(path, step=4)  # a second step is added to the same file
    with h5py.File(path) as f:
        assert sorted(f) == ["step_000003", "step_000004"]
    with pytest.raises(FileExistsError):
        _write(path, step=4)
    with pytest.raises(FileExistsError):
        RunFileWriter(path)
    assert clean_path("features.0.weight_fake_quant") == "features/0/weight_fake_quant"
    assert clean_path("model/conv/FakeQuant:0") == "model/conv/FakeQuant"
    assert step_group(12) == "step_000012" and step_group("epoch_2") == "epoch_2"


def test_writer_is_atomic(tmp_path):
    path = str(tmp_path / "run.h5")
    with pytest.raises(RuntimeError):
        with RunFileWriter(path) as w:
            w.add("a", "FakeQuantWithMinMaxArgs", {"inputs": np.zeros(3, np.float32)})
            raise RuntimeError("the training step failed")
    assert os.listdir(tmp_path) == []


def test_verify_passes_on_own_references(tmp_path, runner):
    path = str(tmp_path / "run.h5")
    _write(path)
    r = runner.invoke(main, ["verify", path, "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["verified"] == 3 and doc["failed"] == 0
    by_path = {layer["path"]: layer for layer in doc["layers"]}
    fq = by_path["net/act_quant"]
    assert fq["outputs"]["outputs"]["identical"] and fq["outputs"]["backprops_wrt_input"]["rule"] == "bitwise"
    assert by_path["net/bn"]["status"] in ("identical", "within-rtol")
    r = runner.invoke(main, ["verify", path])
    assert r.exit_code == 0 and "3 of 3 layers pass" in r.stdout


@pytest.mark.parametrize("perturb, bad", [("fq", "net/act_quant"), ("bn", "net/bn")])
def test_verify_fails_worst_first(tmp_path, perturb, bad, runner):
    path = str(tmp_path / "run.h5")
    _write(path, perturb=perturb)
    r = runner.invoke(main, ["verify", path, "--json"])
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert doc["layers"][0]["path"] == bad and not doc["layers"][0]["passed"]
    assert doc["failed"] == 1
    if perturb == "fq":
        assert doc["layers"][0]["max_ulps"] == 1
    assert "1 of 3 layers differ" in r.stderr
    # a looser rtol lets the batch norm pass; a fake-quant output must stay bit-identical
    r = runner.invoke(main, ["verify", path, "--rtol", "0.01"])
    assert r.exit_code == (1 if perturb == "fq" else 0)


def test_verify_without_references(tmp_path, runner):
    path = str(tmp_path / "run.h5")
    _write(path, references=False)
    r = runner.invoke(main, ["verify", path])
    assert r.exit_code == 2 and "reference/" in r.stderr
    r = runner.invoke(main, ["verify", str(tmp_path / "missing.h5")])
    assert r.exit_code == 2


def test_compare_counts_ulps():
    a = np.float32([1.0, 2.0, -1e-45])
    b = np.float32([1.0, np.nextafter(np.float32(2.0), np.float32(0.0)), 1e-45])
    c = compare(a, b)
    assert not c["identical"] and c["max_ulps"] == 2 and c["mismatches"] == 2


def _cancelling_batch_norm(path, *, offset_error):
    """A batch norm after a quantizer: the upstream gradient of each channel sums to about zero, so the
    framework's float32 offset_backprop (summed in its own order) is relatively far from the exact sum."""
    rng = np.random.default_rng(23)
    x = rng.standard_normal((8, 16, 16, 4)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    dy -= dy.mean(axis=(0, 1, 2), dtype=np.float64).astype(np.float32)  # sums cancel to ~1e-5 of the terms
    scale = np.float32([0.5, 1.0, 2.0, 1.5])
    mean = x.mean(axis=(0, 1, 2), dtype=np.float64).astype(np.float32)
    var = x.var(axis=(0, 1, 2), dtype=np.float64).astype(np.float32)
    bx, bs, bo = ops.fused_batch_norm_grad(dy, x, scale, mean, var, epsilon=1e-3, data_format="NHWC")[:3]
    # the framework's order: one running float32 sum per channel, as a naive kernel adds
    theirs = np.zeros(4, np.float32)
    for row in dy.reshape(-1, 4):
        theirs += row
    assert abs(theirs - bo).max() / abs(bo).max() > 1e-3  # relatively far: rtol alone would fail it
    w = RunFileWriter(path)
    w.add("net/bn", "FusedBatchNormV3", {"y_backprop": dy, "x": x, "scale": scale, "reserve_space_1": mean,
                                         "reserve_space_2": var},
          {"epsilon": 1e-3, "data_format": "NHWC", "is_training": True},
          {"x_backprop": bx, "scale_backprop": bs, "offset_backprop": theirs + np.float32(offset_error)})
    w.close()


def test_verify_holds_batch_norm_sums_to_float32s_summation_bound(tmp_path):
    from clirunner import make_runner

    path = str(tmp_path / "bn.h5")
    _cancelling_batch_norm(path, offset_error=0.0)
    r = make_runner().invoke(main, ["verify", path, "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)["layers"][0]["outputs"]["offset_backprop"]
    assert out["passed"] and out["rel"] > 1e-5 and out["max_abs"] <= out["bound"]
    # a real error (one term's worth: a term left out or counted twice) is above what float32's summation allows
    path2 = str(tmp_path / "bn_wrong.h5")
    _cancelling_batch_norm(path2, offset_error=1.0)
    r = make_runner().invoke(main, ["verify", path2, "--json"])
    assert r.exit_code == 1
    out = json.loads(r.stdout)["layers"][0]["outputs"]["offset_backprop"]
    assert not out["passed"] and out["max_abs"] > out["bound"]


@pytest.mark.parametrize("perturb, rule", [("fq", "bitwise"), ("bn", "rtol 0.01")])
def test_verify_shows_the_bound_each_count_was_held_to(tmp_path, perturb, rule, runner):
    # issue 40, item 5: "max ulps 1383" for a passing batch norm read as alarming without its bound
    path = str(tmp_path / "run.h5")
    _write(path, perturb=perturb)
    r = runner.invoke(main, ["verify", path, "--rtol", "0.01"])
    lines = r.stdout.splitlines()
    header = next(ln for ln in lines if ln.lstrip().startswith("layer"))
    assert "max ulps" in header and "held to" in header
    bad = "net/act_quant" if perturb == "fq" else "net/bn"
    row = next(ln for ln in lines if ln.startswith(bad + " "))
    assert rule in row, row
