"""``qgcli nudge`` (the grid explainer) and ``qgcli compare-semantics`` (TensorFlow vs PyTorch on one tensor)."""
import json
import os

import h5py
import numpy as np
import pytest

from qgcli import ops
from qgcli.ops import torch_semantics as ts

from conftest import SAMPLES

F32 = np.float32
NOTEBOOK = os.path.join(SAMPLES, "notebook.h5")
PER_CHANNEL = os.path.join(SAMPLES, "per_channel.h5")


def nudge_json(cli, *args):
    r = cli("nudge", *args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_nudge_explains_the_notebook_grid(cli):
    doc = nudge_json(cli, "--min", "-6", "--max", "6", "--num-bits", "2")
    g = doc["grid"]
    assert (doc["quant_min"], doc["quant_max"], doc["levels"]) == (0, 3, 4)
    assert (g["scale"], g["inv_scale"], g["zero_point_from_min"], g["zero_point"]) == (4.0, 0.25, 1.5, 2)
    assert (g["nudged_min"], g["nudged_max"]) == (-8.0, 4.0)
    assert doc["torch"] == {"scale": 4.0, "zero_point": 2, "same_grid": True}
    # 1.5 is a tie, but half away from zero and half to even agree on 2
    assert [w["kind"] for w in doc["warnings"]] == ["zero-point-tie"]
    assert "gives the same 2" in doc["warnings"][0]["message"]


def test_nudge_human_output_goes_to_stdout(cli):
    r = cli("nudge", "--min", "-6", "--max", "6", "--num-bits", "2")
    assert r.exit_code == 0
    assert "TensorFlow grid num_bits=2: integers [0, 3], 4 levels" in r.stdout
    assert "clamped to [quant_min, quant_max]" in r.stdout  # not eaten as markup


@pytest.mark.parametrize("lo, hi, kinds, needle", [
    (0.1, 5.0, ["zero-not-in-range", "zero-point-clamped"], "TensorFlow shifts it to [0, 4.9"),
    (-5.0, -0.1, ["zero-not-in-range", "zero-point-clamped"], "clamped to the grid edge 255"),
    (1.0, 0.5, ["reversed"], "min 1 > max 0.5"),
    (2.0, 2.0, ["empty"], "min == max == 2"),
    (0.0, 0.0, ["passthrough"], "gradient passes through"),
    (-0.5, 2.5, ["zero-point-tie"], "rounds half away from zero to 1; half to even"),  # with num_bits 2
    (-1.0, 1.0, [], None),  # 127.49999: close to a tie but not on it
])
def test_nudge_warnings(cli, lo, hi, kinds, needle):
    bits = ["--num-bits", "2"] if (lo, hi) == (-0.5, 2.5) else []
    doc = nudge_json(cli, "--min", repr(lo), "--max", repr(hi), *bits)
    assert [w["kind"] for w in doc["warnings"]] == kinds
    if needle:
        assert any(needle in w["message"] for w in doc["warnings"]), doc["warnings"]


def test_nudge_per_channel_and_output_feeds_torch_semantics(cli, tmp_path):
    out = tmp_path / "grid.h5"
    doc = nudge_json(cli, "--min", "-0.5,0.1,-3", "--max", "2.5,5,-1", "--num-bits", "2", "-o", out)
    assert doc["per_channel"] and doc["grid"]["zero_point"] == [1, 0, 3]
    assert {(w["channel"], w["kind"]) for w in doc["warnings"]} == {
        (0, "zero-point-tie"), (1, "zero-not-in-range"), (1, "zero-point-clamped"), (2, "zero-not-in-range"),
        (2, "zero-point-clamped")}
    with h5py.File(out) as f:
        assert f["zero_point"].dtype == np.int32
        grid = ops.nudge(np.array([-0.5, 0.1, -3], F32), np.array([2.5, 5, -1], F32), num_bits=2)
        np.testing.assert_array_equal(f["scale"][()], grid.scale)
        np.testing.assert_array_equal(f["nudged_min"][()], grid.nudged_min)
        assert f["scale"].attrs["quant_max"] == 3
    # TensorFlow's grid under PyTorch's op: the same levels, PyTorch's rounding
    x = np.linspace(-3, 5, 48, dtype=F32).reshape(16, 3)
    np.save(tmp_path / "x.npy", x)
    r = cli("fakequant", "--inputs", tmp_path / "x.npy", "--semantics", "torch", "--scale", f"{out}:scale",
            "--zero-point", f"{out}:zero_point", "--quant-max", "3", "-o", tmp_path / "pt.npz")
    assert r.exit_code == 0, r.output
    with np.load(tmp_path / "pt.npz") as z:
        pt = z["outputs"]
    tf = ops.fake_quant_with_min_max_vars_per_channel(x, [-0.5, 0.1, -3], [2.5, 5, -1], num_bits=2)
    for c in range(3):
        levels = ((np.arange(4) - grid.zero_point[c]) * grid.scale[c]).astype(F32)
        for out in (pt[:, c], tf[:, c]):
            assert np.isclose(out[:, None], levels[None, :], rtol=1e-6, atol=0).any(axis=1).all()


@pytest.mark.parametrize("args, message", [
    (["--min", "nan", "--max", "1"], "Error: min: must be finite"),
    (["--min", "-1,-2", "--max", "1"], "Error: min: shape [2] differs from max shape []"),
    (["--min", "-1"], "Error: max: missing operand"),
    (["--min", "-1", "--max", "1", "--num-bits", "1"], "num_bits: must be between 2 and 16"),
])
def test_nudge_errors(cli, args, message):
    r = cli("nudge", *args)
    assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1


def test_nudge_reads_a_bundle(cli):
    doc = nudge_json(cli, PER_CHANNEL)
    with h5py.File(PER_CHANNEL) as f:
        assert len(doc["grid"]["min"]) == f["min"].shape[0]


# --- compare-semantics ----------------------------------------------------------------------------------

def compare_json(cli, *args):
    r = cli("compare-semantics", *args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_compare_on_the_notebook_sample(cli):
    doc = compare_json(cli, NOTEBOOK, "--num-bits", "2")
    with h5py.File(NOTEBOOK) as f:
        x, g = f["inputs"][()], f["gradients"][()]
    # an independent count: TF's op vs PyTorch's op on the observer's grid (the same one here)
    tf = ops.fake_quant_with_min_max_vars(x, -6.0, 6.0, num_bits=2)
    pt = ts.fake_quantize_per_tensor_affine(x, 4.0, 2, 0, 3)
    tf_mask = ops.fake_quant_with_min_max_vars_gradient(np.ones_like(x), x, -6.0, 6.0, num_bits=2)[0] != 0
    pt_mask = ts.fake_quantize_per_tensor_affine_gradient(np.ones_like(x), x, 4.0, 2, 0, 3) != 0
    assert doc["forward"]["differ"] == int((tf != pt).sum())
    assert doc["mask"]["differ"] == int((tf_mask != pt_mask).sum()) > 0
    assert doc["mask"]["reasons"] == {"rounded": doc["mask"]["differ"]}
    assert doc["mask"]["torch_only"] == doc["mask"]["differ"] and doc["mask"]["tf_only"] == 0
    first = np.argwhere(tf_mask != pt_mask)[:10].tolist()
    assert doc["mask"]["first"] == first
    blocked = np.abs(g[tf_mask != pt_mask].astype(np.float64)).sum() / np.abs(g[tf_mask].astype(np.float64)).sum()
    assert doc["gradient"]["mass_on_differing_mask"] == pytest.approx(blocked)
    assert doc["grids"]["differ"] == [False]


def test_compare_finds_ties_and_explains_them(cli, tmp_path):
    x = np.linspace(-8, 8, 33).astype(F32)
    np.save(tmp_path / "x.npy", x)
    doc = compare_json(cli, "--inputs", tmp_path / "x.npy", "--min", "-6", "--max", "6", "--num-bits", "2")
    assert doc["forward"]["reasons"] == {"tie": 2}
    assert doc["forward"]["first"] == [[x.tolist().index(-6.0)], [x.tolist().index(2.0)]]
    r = cli("compare-semantics", "--inputs", tmp_path / "x.npy", "--min", "-6", "--max", "6", "--num-bits", "2")
    assert "TF rounds half up (floor(v + 0.5)), PyTorch half to even" in r.output


def test_compare_explains_nudging_per_channel_and_writes_arrays(cli, tmp_path):
    out = tmp_path / "diff.h5"
    doc = compare_json(cli, PER_CHANNEL, "-o", out)
    with h5py.File(PER_CHANNEL) as f:
        mn, mx = f["min"][()], f["max"][()]
    shifted = [c for c in range(mn.size) if mn[c] > 0 or mx[c] < 0]
    assert [r["channel"] for r in doc["grids"]["reasons"]] == shifted
    assert all("nudging" in r["reasons"][0] for r in doc["grids"]["reasons"])
    with h5py.File(out) as f:
        assert sorted(f) == ["backprops_wrt_input_tf", "backprops_wrt_input_torch", "forward_reason", "mask_reason",
                             "mask_tf", "mask_torch", "outputs_tf", "outputs_torch"]
        reasons = f["forward_reason"][()]
        assert int((reasons != 0).sum()) == doc["forward"]["differ"]
        assert "2=tie" in f["forward_reason"].attrs["forward_reason_codes"]
        assert ((reasons == 1) == ((reasons != 0) & np.isin(np.arange(mn.size), shifted)[None, None, None, :])).all()


def test_compare_errors(cli, tmp_path):
    r = cli("compare-semantics", NOTEBOOK, "--axis", "0")
    assert r.exit_code == 2 and "'--axis': only applies to per-channel" in r.output
    r = cli("compare-semantics", "--inputs", NOTEBOOK + ":inputs", "--min", "1", "--max", "-1")
    assert r.exit_code == 2 and "min: 1" in r.output and "is not below max" in r.output
