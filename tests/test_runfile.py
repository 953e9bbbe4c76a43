"""Run files (issue 18): every group of a command's kind, outputs at the same group paths, per-layer reports."""
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from qgcli import ops
from qgcli.ops import torch_semantics as ts

from conftest import ROOT


def _layer(f, path, op, attrs=None, **datasets):
    g = f.require_group(path)
    if op is not None:
        g.attrs["op"] = op
    for k, v in (attrs or {}).items():
        g.attrs[k] = v
    for k, v in datasets.items():
        g.create_dataset(k, data=v)


def make_run(path, *, steps=("step_1",), bad=False, seed=0):
    rng = np.random.default_rng(seed)
    arrays = {}
    with h5py.File(path, "w") as f:
        for step in steps:
            w = rng.standard_normal((3, 4, 6)).astype(np.float32)
            hi = np.abs(w).max(axis=(0, 1)).astype(np.float32) * 0.6
            g = (rng.standard_normal(w.shape) * 0.1).astype(np.float32)
            _layer(f, f"{step}/net/block/conv/weight_quant", "FakeQuantWithMinMaxVarsPerChannel",
                   {"num_bits": 4, "narrow_range": True}, inputs=w, min=-hi, max=hi, gradients=g)
            a = (rng.standard_normal((5, 7)) * 2).astype(np.float32)
            ga = rng.standard_normal(a.shape).astype(np.float32)
            _layer(f, f"{step}/net/act", "FakeQuantWithMinMaxVars", {"num_bits": 4},
                   inputs=a, min=np.float32(-2.5), max=np.float32(2.0), gradients=ga)
            _layer(f, f"{step}/net/logits", "FakeQuantWithMinMaxArgs", {"min": -3.0, "max": 3.0, "num_bits": 8},
                   inputs=a * 2, gradients=ga)
            _layer(f, f"{step}/head/torch_act", "fake_quantize_per_tensor_affine", {"quant_min": 0, "quant_max": 15},
                   inputs=a, scale=np.float32(0.3), zero_point=np.int32(7), gradients=ga)
            x = rng.standard_normal((2, 3, 3, 4)).astype(np.float32)
            dy = rng.standard_normal(x.shape).astype(np.float32)
            x64 = x.astype(np.float64)
            _layer(f, f"{step}/net/bn", "FusedBatchNormV3", {"epsilon": 1e-3, "data_format": "NHWC",
                                                             "is_training": True},
                   y_backprop=dy, x=x, scale=np.linspace(0.5, 1.5, 4).astype(np.float32),
                   reserve_space_1=x64.mean(axis=(0, 1, 2)).astype(np.float32),
                   reserve_space_2=x64.var(axis=(0, 1, 2)).astype(np.float32))
            arrays[step] = dict(w=w, hi=hi, g=g, a=a, ga=ga, x=x, dy=dy)
        if bad:
            _layer(f, "broken/no_max", "FakeQuantWithMinMaxVars", inputs=np.zeros(3, np.float32),
                   min=np.float32(-1), gradients=np.zeros(3, np.float32))
            _layer(f, "broken/bad_bits", "FakeQuantWithMinMaxVars", {"num_bits": 40}, inputs=np.zeros(3, np.float32),
                   min=np.float32(-1), max=np.float32(1), gradients=np.zeros(3, np.float32))
    return arrays


@pytest.fixture
def run_file(tmp_path):
    path = tmp_path / "run.h5"
    return str(path), make_run(path)


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(a, b, equal_nan=True)


def test_fakequant_grad_runs_every_group_bit_for_bit(cli, run_file, tmp_path):
    path, arrays = run_file
    out = tmp_path / "out.h5"
    r = cli("fakequant-grad", path, "-o", out, "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert (s["groups"], s["ran"], s["skipped_other_kind"], s["skipped_invalid"]) == (5, 4, 1, 0)
    assert s["other_kind"] == [{"path": "step_1/net/bn", "op": "FusedBatchNormV3"}]
    a = arrays["step_1"]
    with h5py.File(out) as f:
        grp = f["step_1/net/block/conv/weight_quant"]
        dx, dmin, dmax = ops.fake_quant_with_min_max_vars_per_channel_gradient(
            a["g"], a["w"], -a["hi"], a["hi"], num_bits=4, narrow_range=True)
        _same(grp["backprops_wrt_input"][()], dx)
        _same(grp["backprop_wrt_min"][()], dmin)
        _same(grp["backprop_wrt_max"][()], dmax)
        assert grp.attrs["op"] == "FakeQuantWithMinMaxVarsPerChannelGradient" and grp.attrs["num_bits"] == 4
        res = ops.fake_quant_with_min_max_vars_gradient(a["ga"], a["a"], np.float32(-2.5), np.float32(2.0), num_bits=4)
        _same(f["step_1/net/act/backprops_wrt_input"][()], res[0])
        _same(f["step_1/net/act/backprop_wrt_max"][()], res[2])
        _same(f["step_1/net/logits/backprops"][()],
              ops.fake_quant_with_min_max_args_gradient(a["ga"], a["a"] * 2, -3.0, 3.0, num_bits=8))
        _same(f["step_1/head/torch_act/backprops_wrt_input"][()],
              ts.fake_quantize_per_tensor_affine_gradient(a["ga"], a["a"], np.float32(0.3), np.int32(7), 0, 15))
        assert "step_1/net/bn" not in f


def test_single_bundle_and_group_run_agree(cli, run_file, tmp_path):
    """A group run alone (as a bundle file of its own) and within the run file: the same bytes."""
    path, arrays = run_file
    a = arrays["step_1"]
    bundle = tmp_path / "bundle.h5"
    with h5py.File(bundle, "w") as f:
        for k, v in dict(inputs=a["w"], min=-a["hi"], max=a["hi"], gradients=a["g"]).items():
            f[k] = v
    assert cli("fakequant-grad", bundle, "--num-bits", 4, "--narrow-range", "-o", tmp_path / "one.h5").exit_code == 0
    r = cli("fakequant-grad", f"{path}:step_1/net/block", "-o", tmp_path / "group.npz", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["ran"] == 1 and s["run_file"].endswith(":step_1/net/block")
    with np.load(tmp_path / "group.npz") as z:
        npz = {k: z[k] for k in z.files}
    assert sorted(npz) == [f"step_1/net/block/conv/weight_quant/{n}" for n in
                                 ("backprop_wrt_max", "backprop_wrt_min", "backprops_wrt_input")]
    with h5py.File(tmp_path / "one.h5") as f:
        for name in ("backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max"):
            _same(npz[f"step_1/net/block/conv/weight_quant/{name}"], f[name][()])


def test_bn_grad_runs_batch_norm_groups_and_writes_a_folder_per_group(cli, run_file, tmp_path):
    path, arrays = run_file
    out = tmp_path / "dir"
    r = cli("bn-grad", path, "-o", f"{out}/", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert (s["ran"], s["skipped_other_kind"]) == (1, 4)
    a = arrays["step_1"]
    with h5py.File(path) as f:
        g = f["step_1/net/bn"]
        expected = ops.fused_batch_norm_grad(a["dy"], a["x"], g["scale"][()], g["reserve_space_1"][()],
                                             g["reserve_space_2"][()], epsilon=1e-3, data_format="NHWC")
    for name, value in zip(("x_backprop", "scale_backprop", "offset_backprop"), expected):
        _same(np.load(out / "step_1" / "net" / "bn" / f"{name}.npy"), value)
    assert s["layers"][0]["attributes"]["epsilon"] == 1e-3


def test_explicit_options_override_group_attributes_defaults_do_not(cli, run_file, tmp_path):
    path, arrays = run_file
    r = cli("fakequant", f"{path}:step_1/net/act", "-o", tmp_path / "a.h5", "--json")
    assert json.loads(r.stdout)["overrides"] == {}
    with h5py.File(tmp_path / "a.h5") as f:
        assert f["step_1/net/act"].attrs["num_bits"] == 4  # the group's, not the option's default 8
    r = cli("fakequant", f"{path}:step_1/net/act", "--num-bits", 8, "-o", tmp_path / "b.h5", "--json")
    s = json.loads(r.stdout)
    assert s["overrides"]["num_bits"]["option"] == "--num-bits"
    assert s["overrides"]["num_bits"]["groups"] == [{"path": "step_1/net/act", "group_value": 4}]
    assert any("--num-bits 8" in n for n in s["notes"])
    a = arrays["step_1"]
    with h5py.File(tmp_path / "b.h5") as f:
        _same(f["step_1/net/act/outputs"][()],
              ops.fake_quant_with_min_max_vars(a["a"], np.float32(-2.5), np.float32(2.0), num_bits=8))
    r = cli("bn-grad", path, "--epsilon", 0.5, "-o", tmp_path / "bn.h5")
    assert r.exit_code == 0 and "--epsilon 0.5" in r.stderr and "overrides" in r.stderr


def test_forward_only_groups_are_skipped_by_gradient_commands_and_named(cli, run_file, tmp_path):
    """Issue 36 item 1: a group without its upstream gradient (the model's first quantizer, whose input needs
    none; keep="forward") is valid: fakequant-grad and bn-grad leave it out by default and say so (count and
    names); fakequant and report use it.  A group missing its gradient *and* broken otherwise stays invalid."""
    path, arrays = run_file
    with h5py.File(path, "a") as f:
        del f["step_1/net/act/gradients"], f["step_1/net/bn/y_backprop"]
    r = cli("fakequant-grad", path, "-o", tmp_path / "g.h5", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["ran"] == 3 and s["skipped_invalid"] == 0 and s["skipped_forward_only"] == 1
    assert s["forward_only"] == [{"path": "step_1/net/act", "op": "FakeQuantWithMinMaxVars"}]
    assert any(n.startswith("skipped 1 forward-only group") and n.endswith(": step_1/net/act") for n in s["notes"])
    with h5py.File(tmp_path / "g.h5") as f:
        assert "step_1/net/act" not in f and list(f["step_1/net/logits"]) == ["backprops"]
    r = cli("fakequant-grad", path, "-o", tmp_path / "g2.h5")
    assert r.exit_code == 0 and "1 forward-only skipped" in r.stderr and "step_1/net/act" in r.stderr
    # the forward command runs it, and report reads it (its upstream gradient absent)
    r = cli("fakequant", path, "-o", tmp_path / "f.h5", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["ran"] == 4
    rows = {row["path"]: row for row in json.loads(cli("report", path, "--json").stdout)["layers"]}
    assert rows["step_1/net/act"]["upstream_gradient"] == "absent" and rows["step_1/net/act"]["sqnr_db"] > 0
    # bn-grad: the only batch norm is forward only: nothing to run, said
    r = cli("bn-grad", path, "-o", tmp_path / "bn.h5")
    assert r.exit_code == 2 and "1 forward-only group, without y_backprop, skipped" in r.stderr
    assert not (tmp_path / "bn.h5").exists()
    with h5py.File(path, "a") as f:
        f["step_1/net/act"].attrs["num_bits"] = 40
    r = cli("fakequant-grad", path, "-o", tmp_path / "g3.h5")
    assert r.exit_code == 2 and "step_1/net/act: missing operand gradients" in r.stderr


def test_invalid_groups_refuse_the_run_or_are_skipped(cli, tmp_path):
    path = tmp_path / "run.h5"
    make_run(path, bad=True)
    out = tmp_path / "out.h5"
    r = cli("fakequant-grad", path, "-o", out)
    assert r.exit_code == 2 and not out.exists()
    assert "2 of 6 groups" in r.stderr and "broken/no_max: missing operand max" in r.stderr
    assert "broken/bad_bits: attribute num_bits=40 is not in 2..16" in r.stderr
    r = cli("fakequant-grad", path, "-o", out, "--skip-invalid", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["ran"] == 4 and s["skipped_invalid"] == 2
    assert {i["path"] for i in s["invalid"]} == {"broken/no_max", "broken/bad_bits"}
    # the batch norm alone is valid: bn-grad does not look at fake-quant groups' problems
    assert cli("bn-grad", path, "-o", tmp_path / "bn.npz").exit_code == 0
    with np.load(tmp_path / "bn.npz") as z:
        assert z.files[0].startswith("step_1/net/bn/")


def test_run_file_refusals(cli, run_file, tmp_path):
    path, _ = run_file
    r = cli("fakequant-grad", path, "--variant", "vars", "-o", tmp_path / "o.h5")
    assert r.exit_code == 2 and "--variant" in r.stderr
    r = cli("fakequant-grad", f"{path}:nothing/here", "-o", tmp_path / "o.h5")
    assert r.exit_code == 2 and "nothing/here" in r.stderr
    r = cli("fakequant-grad", f"{path}:step_1", "--inputs", f"{path}:step_1/net/act/inputs", "-o", tmp_path / "o.h5")
    assert r.exit_code == 2 and "--inputs" in r.stderr


def test_several_steps_report_layers_worst_first(cli, tmp_path):
    path = tmp_path / "run.h5"
    make_run(path, steps=("step_000100", "step_000200"))
    r = cli("report", path, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["steps"] == ["step_000100", "step_000200"]
    assert len(doc["layers"]) == 8 and {s["reason"] for s in doc["skipped"]} == {"not a quantizer"}
    for row in doc["layers"]:
        for key in ("path", "op", "shape", "clipped", "gradient_blocked", "sqnr_db", "suggested_sqnr_db",
                    "worst_channel"):
            assert key in row
    blocked = [r["gradient_blocked"] for r in doc["layers"]]
    assert blocked == sorted(blocked, reverse=True)
    per_channel = [r for r in doc["layers"] if r["op"] == "FakeQuantWithMinMaxVarsPerChannel"]
    assert all(isinstance(r["worst_channel"], int) for r in per_channel)
    assert sorted(doc["trends"]) == ["head/torch_act", "net/act", "net/block/conv/weight_quant", "net/logits"]
    # the same numbers as today's report of the group as a bundle
    with h5py.File(path) as f:
        g = f["step_000100/net/act"]
        from qgcli.ops.analysis import channel_report

        rep = channel_report(g["inputs"][()], g["min"][()], g["max"][()], g["gradients"][()], num_bits=4,
                             variant="vars")
    row = next(r for r in doc["layers"] if r["path"] == "step_000100/net/act")
    assert row["gradient_blocked"] == rep.total["gradient_blocked"] and row["sqnr_db"] == rep.total["sqnr_db"]
    table = cli("report", path)
    assert table.exit_code == 0 and "blocked gradient by step" in table.stdout
    csv = cli("report", path, "--csv", "-q")
    assert csv.exit_code == 0 and csv.stdout.splitlines()[0].startswith("path,step,layer,op")
    assert len(csv.stdout.splitlines()) == 9
    one = cli("report", path, "--layer", "step_000100/net/block/conv/weight_quant", "--json")
    assert one.exit_code == 0, one.output
    doc1 = json.loads(one.stdout)
    assert doc1["per_channel"] and doc1["channels"] == 6 and doc1["attributes"]["num_bits"] == 4


def test_inspect_shows_the_layers(cli, run_file):
    path, _ = run_file
    r = cli("inspect", path)
    assert r.exit_code == 0, r.output
    assert "step_1/net/block/conv/weight_quant" in r.stdout and "FusedBatchNormV3" in r.stdout
    doc = json.loads(cli("inspect", path, "--json").stdout)
    layers = doc["files"][0]["layers"] if "files" in doc else doc["layers"]
    assert {l["path"] for l in layers} >= {"step_1/net/act", "step_1/net/bn"}


def test_plain_bundles_are_not_run_files(tmp_path):
    from qgcli.storage.runfile import is_run_file

    with h5py.File(tmp_path / "b.h5", "w") as f:
        f["inputs"] = np.zeros(3, np.float32)
        f["layer1/x"] = np.zeros(3, np.float32)
    assert not is_run_file(str(tmp_path / "b.h5"))
    assert is_run_file(str(tmp_path / "b.h5") + ":layer1")
    assert not is_run_file("-") and not is_run_file(str(tmp_path / "b.npz"))


def test_subprocess_run_on_the_sample(tmp_path):
    sample = os.path.join(ROOT, "samples", "run.h5")
    out = tmp_path / "grads.h5"
    proc = subprocess.run([sys.executable, "-m", "qgcli", "fakequant-grad", sample, "-o", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "8 of 10 groups ran" in proc.stderr
    with h5py.File(out) as f:
        assert "step_000200/head/act_quant/backprops_wrt_input" in f


def _peak_rss_mib(argv):
    """Peak RSS of one qgcli run and whatever it starts, measured by a fresh process that waits for it (so
    that an earlier test's memory does not count)."""
    code = ("import resource, subprocess, sys\n"
            "r = subprocess.run([sys.executable, '-m', 'qgcli', *sys.argv[1:]])\n"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024, file=sys.stderr)\n"
            "sys.exit(r.returncode)")
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return int(r.stderr.strip().splitlines()[-1])


def test_large_group_streams_under_memory_limit_like_a_bundle(tmp_path):
    """Issue 18: a large group of a run file streams under --memory-limit exactly as the same operands as
    one bundle: the same bits, and memory bounded by the limit rather than the data."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((128, 256, 256)) * 2).astype(np.float32)  # 32 MiB per operand
    g = rng.standard_normal(x.shape).astype(np.float32)
    run, bundle = tmp_path / "run.h5", tmp_path / "bundle.h5"
    with h5py.File(run, "w") as f:
        _layer(f, "step_0/big", "FakeQuantWithMinMaxArgs", {"min": -3.0, "max": 3.0}, inputs=x, gradients=g)
        _layer(f, "step_0/small", "FakeQuantWithMinMaxArgs", {"min": -3.0, "max": 3.0},
               inputs=x[0, :4], gradients=g[0, :4])
    with h5py.File(bundle, "w") as f:
        f["inputs"], f["gradients"] = x, g
    del x, g
    streamed = _peak_rss_mib(["fakequant-grad", str(run), "-o", str(tmp_path / "run_out.h5"), "--memory-limit", "8M",
                              "-q"])
    single = _peak_rss_mib(["fakequant-grad", str(bundle), "--variant", "args", "--min", "-3", "--max", "3", "-o",
                            str(tmp_path / "bundle_out.h5"), "--memory-limit", "8M", "-q"])
    in_memory = _peak_rss_mib(["fakequant-grad", str(run), "-o", str(tmp_path / "mem_out.h5"), "-q"])
    with h5py.File(tmp_path / "run_out.h5", "r") as a, h5py.File(tmp_path / "bundle_out.h5", "r") as b, \
            h5py.File(tmp_path / "mem_out.h5", "r") as m:
        assert set(a["step_0/big"]) == set(b) and set(a["step_0/big"])
        for name in b:
            want = b[name][()]
            assert np.array_equal(a["step_0/big"][name][()], want) and np.array_equal(m["step_0/big"][name][()], want)
            assert a["step_0/big"][name].dtype == want.dtype
    # In memory the run holds both operands and the output (96 MiB); streamed, a few 8 MiB blocks.
    assert streamed < in_memory - 40, (streamed, single, in_memory)
    assert streamed < single + 24, (streamed, single)


def test_group_operands_found_by_discovery_read_as_the_checked_read(tmp_path):
    """A layer's datasets are read in one low-level call each (their path known from the walk); every kind
    of dataset gives what the checked read gives, and what that read refuses is still refused."""
    from qgcli.storage import io as qio
    from qgcli.storage import runfile
    from qgcli.errors import FileFormatError
    from qgcli.storage.operands import GroupView

    rng = np.random.default_rng(5)
    path = tmp_path / "run.h5"
    with h5py.File(path, "w") as f:
        g = f.create_group("step_0/läyer")
        g.attrs["op"] = "FakeQuantWithMinMaxVars"
        g["big_endian"] = rng.standard_normal((3, 4)).astype(">f4")
        g["scalar"] = np.float32(1.5)
        g["bf16"] = np.arange(4, dtype=np.uint16)
        g["bf16"].attrs["dtype"] = "bfloat16"
        g["large"] = rng.standard_normal(300_000).astype(np.float32)  # over the one-call read's size
        g.create_dataset("gzip", data=rng.standard_normal((20, 20)), chunks=(5, 5), compression="gzip")
        g.create_dataset("external", shape=(4,), dtype="f4", external=[(str(tmp_path / "raw.bin"), 0, 16)])
    container = qio.Container.open(str(path))
    try:
        (layer,) = runfile.discover(container._opened())
        fast = GroupView(container, layer.path, known=layer.datasets)
        checked = GroupView(container, layer.path)
        for name in ("big_endian", "scalar", "bf16", "large", "gzip"):
            assert fast.has(name)
            a, b = fast.read(name), checked.read(name)
            assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(a, b)
        # the small plain ones took the one-call read; bfloat16 tags and large ones the checked read
        assert set(fast._checked) == {"bf16", "large"}
        with pytest.raises(FileFormatError, match="external file"):
            fast.read("external")
    finally:
        container.close()


def test_discovery_reads_the_small_datasets_of_a_run_within_its_budget(tmp_path, monkeypatch):
    """discover(prefetch=N) reads each op group's small plain datasets while its walk has them open, as the
    run would read them (big-endian, a scalar, an enum's integers), until N bytes are held; a group's read
    takes them once, then reads the file again; what the one-call read leaves (bfloat16 tags, over 1 MiB, an
    external file) is not read there.  prefetch=0, the default, reads nothing."""
    from qgcli.storage import io as qio
    from qgcli.storage import runfile
    from qgcli.storage.operands import GroupView

    rng = np.random.default_rng(6)
    path = tmp_path / "run.h5"
    with h5py.File(path, "w") as f:
        for i in range(3):
            g = f.create_group(f"step_0/layer_{i}")
            g.attrs["op"] = "FakeQuantWithMinMaxVars"
            g["inputs"] = rng.standard_normal((4, 8)).astype(np.float32)  # 128 bytes
            g["big_endian"] = rng.standard_normal(3).astype(">f8")
            g["scalar"] = np.float32(1.5)
            g["enum"] = np.arange(3, dtype=h5py.enum_dtype({"a": 0, "b": 1, "c": 2}, basetype="i1"))
            g["bf16"] = np.arange(4, dtype=np.uint16)
            g["bf16"].attrs["dtype"] = "bfloat16"
            g["large"] = np.zeros(300_000, np.float32)
            g.create_dataset("external", shape=(4,), dtype="f4", external=[(str(tmp_path / "raw.bin"), 0, 16)])
        f.create_group("no_op")["inputs"] = np.zeros(2, np.float32)
    small = ("big_endian", "enum", "inputs", "scalar")
    container = qio.Container.open(str(path))
    try:
        assert all(layer.arrays == {} for layer in runfile.discover(container._opened()))
        # 24 + 3 + 128 + 4 bytes a group, in name order: a budget of 200 runs out inside the second group (the
        # read that crosses it is kept); the group without op (a layer by its inputs) is not read ahead
        layers = runfile.discover(container._opened(), prefetch=200)
        assert [layer.path for layer in layers] == ["no_op", "step_0/layer_0", "step_0/layer_1", "step_0/layer_2"]
        assert [sorted(layer.arrays) for layer in layers] == [[], list(small), ["big_endian", "enum", "inputs"], []]
        checked = GroupView(container, layers[1].path)
        for name in small:
            want = checked.read(name)
            view = GroupView(container, layers[1].path, known=layers[1].datasets, arrays=layers[1].arrays)
            got = view.read(name)
            assert got.dtype == want.dtype and got.shape == want.shape and got.flags.writeable, name
            np.testing.assert_array_equal(got, want)
            again = view.read(name)  # handed out once: the next read is the file's
            assert again is not got
            np.testing.assert_array_equal(again, want)
        assert layers[1].arrays == {}
    finally:
        container.close()


def test_an_exact_group_shows_its_sqnr_as_inf_not_as_missing(cli, tmp_path):
    """A quantizer whose inputs lie on its grid has no error: SQNR inf in the table, ``exact`` in --json
    (JSON has no infinity, so ``sqnr_db`` is null there, as for a group with nothing to measure)."""
    path = tmp_path / "run.h5"
    on_grid = (np.arange(-8, 8, dtype=np.float32) / 8).reshape(4, 4)  # multiples of TF's nudged scale 1/128
    fp4 = np.tile(np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32), 4).reshape(1, 32)  # MX scale 1
    with h5py.File(path, "w") as f:
        _layer(f, "tf_exact", "FakeQuantWithMinMaxVars", {"num_bits": 8}, inputs=on_grid, min=np.float32(-1),
               max=np.float32(127 / 128), gradients=np.ones_like(on_grid))
        _layer(f, "tf_lossy", "FakeQuantWithMinMaxVars", {"num_bits": 8}, inputs=on_grid * 1.3 + 0.01,
               min=np.float32(-1), max=np.float32(1), gradients=np.ones_like(on_grid))
        _layer(f, "mx_exact", "mx", {"format": "mxfp4", "block_size": 32, "axis": -1, "scale_mode": "floor"},
               inputs=fp4, gradients=np.ones_like(fp4))
    r = cli("report", path, "--json")
    assert r.exit_code == 0, r.output
    rows = {row["path"]: row for row in json.loads(r.stdout)["layers"]}
    assert rows["tf_exact"]["exact"] and rows["tf_exact"]["sqnr_db"] is None
    assert rows["mx_exact"]["exact"] and rows["mx_exact"]["sqnr_db"] is None
    assert not rows["tf_lossy"]["exact"] and rows["tf_lossy"]["sqnr_db"] > 0
    table = cli("report", path, "--wide")
    assert table.exit_code == 0, table.output
    sqnr = {line.split()[0]: line.split()[7] for line in table.stdout.splitlines() if line.split()[:1] in
            (["tf_exact"], ["mx_exact"], ["tf_lossy"])}
    assert sqnr["tf_exact"] == sqnr["mx_exact"] == "inf" and sqnr["tf_lossy"] == f"{rows['tf_lossy']['sqnr_db']:.1f}"
