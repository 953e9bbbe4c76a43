"""The fakequant / fakequant-grad commands through click's CliRunner and a real subprocess."""
import hashlib
import io
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from qgcli import ops

from conftest import ROOT, SAMPLES

NOTEBOOK = os.path.join(SAMPLES, "notebook.h5")
PER_CHANNEL = os.path.join(SAMPLES, "per_channel.h5")
f32 = np.float32


def read_h5(path):
    with h5py.File(path, "r") as f:
        return {k: f[k][()] for k in f}, dict(f.attrs)


def load_npz(path):
    with np.load(path) as data:
        return dict(data)


def digest(path):
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


@pytest.fixture
def bundle(tmp_path):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 4, 5)).astype(f32) * 2
    g = rng.standard_normal((3, 4, 5)).astype(f32)
    path = tmp_path / "bundle.h5"
    with h5py.File(path, "w") as f:
        f["inputs"], f["gradients"] = x, g
        f["min"], f["max"] = f32(-1.5), f32(2.0)
        f["min_pc"], f["max_pc"] = -np.linspace(0.5, 2, 5).astype(f32), np.linspace(1, 3, 5).astype(f32)
    return path, x, g


def test_notebook_levels_through_the_cli(cli, tmp_path):
    out = tmp_path / "out.h5"
    r = cli("fakequant", NOTEBOOK, "--num-bits", "2", "-o", out)
    assert r.exit_code == 0, r.output
    data, attrs = read_h5(out)
    assert sorted(np.unique(data["outputs"]).tolist()) == [-8.0, -4.0, 0.0, 4.0]
    assert attrs["op"] == "FakeQuantWithMinMaxVars" and attrs["num_bits"] == 2 and "qgcli_version" in attrs
    with h5py.File(out, "r") as f:
        assert f["outputs"].attrs["op"] == "FakeQuantWithMinMaxVars"
    assert "nudged" in r.stderr and "-8" in r.stderr


def test_gradient_outputs_match_the_library(cli, bundle, tmp_path):
    path, x, g = bundle
    out = tmp_path / "g.h5"
    r = cli("fakequant-grad", path, "-o", out, "--num-bits", "4", "--narrow-range")
    assert r.exit_code == 0, r.output
    data, attrs = read_h5(out)
    want = ops.fake_quant_with_min_max_vars_gradient(g, x, -1.5, 2.0, num_bits=4, narrow_range=True)
    for name, w in zip(("backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max"), want):
        np.testing.assert_array_equal(data[name], w)
    assert attrs["op"] == "FakeQuantWithMinMaxVarsGradient" and bool(attrs["narrow_range"])


def test_per_channel_inferred_from_vector_range(cli, bundle, tmp_path):
    path, x, g = bundle
    out = tmp_path / "pc.npz"
    r = cli("fakequant-grad", path, "--min", f"{path}:min_pc", "--max", f"{path}:max_pc", "-o", out)
    assert r.exit_code == 0, r.output
    got = load_npz(out)
    mn, mx = -np.linspace(0.5, 2, 5).astype(f32), np.linspace(1, 3, 5).astype(f32)
    dx, dmin, dmax = ops.fake_quant_with_min_max_vars_per_channel_gradient(g, x, mn, mx)
    np.testing.assert_array_equal(got["backprops_wrt_input"], dx)
    np.testing.assert_array_equal(got["backprop_wrt_min"], dmin)


def test_literal_lists_and_axis(cli, bundle, tmp_path):
    path, x, _ = bundle
    out = tmp_path / "o.npz"
    r = cli("fakequant", "--inputs", f"{path}:inputs", "--min", "-1,-2,-3,-4", "--max", "1,2,3,4",
            "--axis", "1", "-o", out)
    assert r.exit_code == 0, r.output
    want = ops.fake_quant_with_min_max_vars_per_channel(x, [-1, -2, -3, -4], [1, 2, 3, 4], axis=1)
    np.testing.assert_array_equal(load_npz(out)["outputs"], want)


def test_variant_args_uses_args_arithmetic(cli, tmp_path):
    x = np.array([-0.15508615970611572], f32)
    np.save(tmp_path / "x.npy", x)
    for variant, want in (("args", -0.1493421345949173), ("vars", -0.16082999110221863)):
        out = tmp_path / f"{variant}.npz"
        r = cli("fakequant", "--inputs", tmp_path / "x.npy", "--min", "-2.4014430046081543",
                "--max", "0.5279601812362671", "--variant", variant, "-o", out)
        assert r.exit_code == 0, r.output
        assert load_npz(out)["outputs"][0] == f32(want)


def test_args_defaults_to_minus_six_six(cli, tmp_path):
    np.save(tmp_path / "x.npy", np.array([-7.0, 5.9], f32))
    r = cli("fakequant", "--inputs", tmp_path / "x.npy", "--variant", "args", "-o", tmp_path / "o.npz")
    assert r.exit_code == 0, r.output
    np.testing.assert_array_equal(load_npz(tmp_path / "o.npz")["outputs"],
                                  ops.fake_quant_with_min_max_args(np.array([-7.0, 5.9], f32)))


def test_option_overrides_bundle(cli, bundle, tmp_path):
    path, x, _ = bundle
    r = cli("fakequant", path, "--max", "6", "-o", tmp_path / "o.npz")
    assert r.exit_code == 0
    np.testing.assert_array_equal(load_npz(tmp_path / "o.npz")["outputs"], ops.fake_quant_with_min_max_vars(x, -1.5, 6.0))


def test_output_directory_and_stdout(cli, bundle, tmp_path):
    path, x, g = bundle
    r = cli("fakequant-grad", path, "-o", str(tmp_path / "outdir") + "/")
    assert r.exit_code == 0, r.output
    assert sorted(os.listdir(tmp_path / "outdir")) == ["backprop_wrt_max.npy", "backprop_wrt_min.npy",
                                                       "backprops_wrt_input.npy"]
    r = cli("fakequant-grad", path, "-o", "-", "-q")
    assert r.exit_code == 0 and r.stderr == ""
    data = load_npz(io.BytesIO(r.stdout_bytes))
    np.testing.assert_array_equal(data["backprops_wrt_input"], np.load(tmp_path / "outdir" / "backprops_wrt_input.npy"))


def test_stdin_bundle_and_operand(cli, bundle, tmp_path):
    path, x, g = bundle
    buf = io.BytesIO()
    np.savez(buf, inputs=x, min=f32(-1.5), max=f32(2.0))
    r = cli("fakequant", "-", "-o", tmp_path / "a.npz", input=buf.getvalue())
    assert r.exit_code == 0, r.output
    buf = io.BytesIO()
    np.save(buf, x)
    r = cli("fakequant", "--inputs", "-", "--min", "-1.5", "--max", "2", "-o", tmp_path / "b.npz", input=buf.getvalue())
    assert r.exit_code == 0, r.output
    np.testing.assert_array_equal(load_npz(tmp_path / "a.npz")["outputs"], load_npz(tmp_path / "b.npz")["outputs"])


def test_json_summary(cli, tmp_path):
    r = cli("fakequant-grad", PER_CHANNEL, "-o", tmp_path / "g.h5", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["op"] == "FakeQuantWithMinMaxVarsPerChannelGradient" and s["variant"] == "per-channel"
    assert len(s["grid"]["nudged_min"]) == 16 and s["inputs"]["inputs"]["shape"] == [4, 8, 8, 16]
    assert 0 < s["statistics"]["gradient_blocked"] < 1
    assert set(s["outputs"]) == {"backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max"}
    # The share of blocked gradient mass, recomputed here from the masks.
    with h5py.File(PER_CHANNEL, "r") as f:
        x, g, mn, mx = (f[k][()] for k in ("inputs", "gradients", "min", "max"))
    grid = ops.nudge(mn, mx)
    inside = (x >= grid.nudged_min) & (x <= grid.nudged_max)
    want = np.abs(g[~inside].astype(np.float64)).sum() / np.abs(g.astype(np.float64)).sum()
    assert s["statistics"]["gradient_blocked"] == pytest.approx(want, rel=1e-12)


def test_quiet_prints_nothing(cli, tmp_path):
    r = cli("fakequant", NOTEBOOK, "-o", tmp_path / "o.h5", "-q")
    assert r.exit_code == 0 and r.stdout == "" and r.stderr == ""


def test_float64_inputs_are_noted(cli, tmp_path):
    np.save(tmp_path / "x.npy", np.linspace(-3, 3, 11))
    r = cli("fakequant", "--inputs", tmp_path / "x.npy", "--min", "-1", "--max", "1", "-o", tmp_path / "o.npz")
    assert r.exit_code == 0 and "float64" in r.stderr and "float32" in r.stderr


# --- bad input: one line naming the operand, exit 2, nothing written, inputs untouched ------------------

def _bad_files(tmp_path, x):
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "c.npy", x.astype(np.complex64))
    np.save(tmp_path / "i.npy", x.astype(np.int32))
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(tmp_path / "m2.npy", np.zeros((2, 2), f32))
    raw = (tmp_path / "x.npy").read_bytes()
    (tmp_path / "trunc.npy").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "fake.h5").write_bytes(b"this is not hdf5")
    (tmp_path / "empty.npz").write_bytes(b"")


X, G, R = ["--inputs", "{t}/x.npy"], ["--gradients", "{t}/g.npy"], ["--min", "-1", "--max", "1"]
BAD = [
    (["--inputs", "{t}/missing.npy", *G, *R], "inputs", "no such file"),
    (["--inputs", "{t}/fake.h5:inputs", *G, *R], "inputs", "not an h5 file"),
    (["--inputs", "{t}/trunc.npy", *G, *R], "inputs", "cannot read"),
    (["--inputs", "{t}/obj.npy", *G, *R], "inputs", "pickled"),
    (["--inputs", "{t}/c.npy", *G, *R], "inputs", "dtype complex64"),
    (["--inputs", "{t}/i.npy", *G, *R], "inputs", "dtype int32"),
    (["--inputs", "{t}/empty.npz:x", *G, *R], "inputs", "empty"),
    ([*X, "--gradients", "{t}/m2.npy", *R], "gradients", "shape"),
    ([*X, *G, "--min", "-1,-2", "--max", "1,2"], "min", "channels"),
    ([*X, *G, "--min", "{t}/m2.npy", "--max", "1"], "min", "rank"),
    ([*X, *G, "--min", "-1", "--max", "1,2,3,4,5,6"], "max", "rank 0"),
    ([*X, *G, *R, "--num-bits", "17"], "num_bits", "between 2 and 16"),
    ([*X, *G, "--min", "nan", "--max", "1"], "min", "finite"),
    ([*X, *G, "--min", "2", "--max", "1"], "min", "not below max"),
    ([*X, *G, "--min", "1", "--max", "1"], "min", "not below max"),
    ([*G, *R], "inputs", "missing operand"),
    ([*X, *G, "--max", "1"], "min", "missing operand"),
    (["{bundle}", "--inputs", "{bundle}:nokey"], "inputs", "no dataset 'nokey'"),
    (["{t}/missing.h5"], "BUNDLE", "no such file"),
    ([*X, *G, *R, "--variant", "vars", "--axis", "0"], "--axis", "per-channel"),
    ([*X, *G, *R, "--device", "gpu"], "--device", "CuPy"),
]


@pytest.mark.parametrize("args, operand, message", BAD)
def test_bad_input_is_one_clean_line(cli, tmp_path, bundle, args, operand, message):
    path, x, g = bundle
    _bad_files(tmp_path, x.reshape(-1)[:6])
    np.save(tmp_path / "g.npy", g.reshape(-1)[:6])
    args = [a.format(t=tmp_path, bundle=path) for a in args]
    if "--device" in args:
        try:
            import cupy  # noqa: F401
            pytest.skip("CuPy is installed here")
        except ImportError:
            pass
    before = {p: digest(tmp_path / p) for p in os.listdir(tmp_path) if os.path.isfile(tmp_path / p)}
    out = tmp_path / "out.h5"
    r = cli("fakequant-grad", *args, "-o", out)
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    assert operand in lines[0] and message in lines[0], lines[0]
    assert "Traceback" not in r.output
    assert not out.exists()
    after = {p: digest(tmp_path / p) for p in before}
    assert after == before


def test_existing_output_needs_force(cli, tmp_path):
    out = tmp_path / "o.h5"
    out.write_bytes(b"precious")
    r = cli("fakequant", NOTEBOOK, "-o", out)
    assert r.exit_code == 2 and "--force" in r.stderr and out.read_bytes() == b"precious"
    r = cli("fakequant", NOTEBOOK, "-o", out, "--force")
    assert r.exit_code == 0 and read_h5(out)[0]["outputs"].shape == (1, 1000)


def test_output_that_is_an_input_is_refused_even_with_force(cli, tmp_path, bundle):
    path, _, _ = bundle
    before = digest(path)
    r = cli("fakequant", path, "-o", path, "--force")
    assert r.exit_code == 2 and "input" in r.stderr and digest(path) == before


def test_output_in_missing_directory(cli, tmp_path):
    r = cli("fakequant", NOTEBOOK, "-o", tmp_path / "nope" / "o.h5")
    assert r.exit_code == 2 and "does not exist" in r.stderr


def test_json_and_stdout_data_conflict(cli, tmp_path):
    r = cli("fakequant", NOTEBOOK, "-o", "-", "--json")
    assert r.exit_code == 2 and "stdout" in r.stderr


def test_help_shows_examples(cli):
    for args in ([], ["fakequant"], ["fakequant-grad"]):
        r = cli(*args, "--help")
        assert r.exit_code == 0 and "Examples:" in r.output


def test_installed_entry_point_in_a_subprocess(tmp_path):
    out = tmp_path / "g.h5"
    proc = subprocess.run([sys.executable, "-m", "qgcli", "fakequant-grad", PER_CHANNEL, "-o", str(out), "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["outputs"]["backprops_wrt_input"]["shape"] == [4, 8, 8, 16]
    bad = subprocess.run([sys.executable, "-m", "qgcli", "fakequant", "--inputs", "nope.npy", "--min", "0",
                          "--max", "1", "-o", str(tmp_path / "x.h5")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_light_imports():
    code = ("import sys, qgcli.ops; from qgcli.cli import main; "
            "heavy = [m for m in ('h5py', 'matplotlib', 'cupy', 'rich') if m in sys.modules]; print(heavy)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr
    code = ("import sys; from click.testing import CliRunner; from qgcli.cli import main; "
            "r = CliRunner().invoke(main, ['--help']); assert r.exit_code == 0; "
            "print([m for m in ('numpy', 'h5py', 'matplotlib', 'cupy') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "[]", proc.stdout + proc.stderr


class _DeviceArray:
    """A stand-in for a CuPy array: shape and dtype on the device, ``get()`` copies to the host (counted)."""

    __module__ = "cupy._core.core"
    copies = 0

    def __init__(self, array):
        self._array = array
        self.shape, self.dtype = array.shape, array.dtype

    def get(self):
        type(self).copies += 1
        return self._array


def test_summaries_read_shapes_without_copying_device_arrays():
    from qgcli.report.summaries import describe_arrays

    _DeviceArray.copies = 0
    arrays = {"a": _DeviceArray(np.zeros((2, 3), np.float32)), "b": _DeviceArray(np.zeros(4, np.float16)), "c": 1.5}
    assert describe_arrays(arrays) == {"a": {"shape": [2, 3], "dtype": "float32"},
                                       "b": {"shape": [4], "dtype": "float16"}, "c": {"shape": [], "dtype": "float64"}}
    assert _DeviceArray.copies == 0
