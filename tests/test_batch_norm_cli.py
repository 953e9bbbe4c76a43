"""``qgcli bn-grad`` through click's CliRunner (and once as a real subprocess)."""
import json
import os
import subprocess
import sys

import h5py
import ml_dtypes
import numpy as np
import pytest

from qgcli import ops

from conftest import ROOT, SAMPLES

SAMPLE = os.path.join(SAMPLES, "batch_norm.h5")
f32 = np.float32
OUTPUTS = ["offset_backprop", "scale_backprop", "x_backprop"]


def read_h5(path):
    with h5py.File(path, "r") as f:
        return {k: f[k][()] for k in f}, dict(f.attrs)


def sample(name):
    with h5py.File(SAMPLE, "r") as f:
        return f[name][()]


def library(**kwargs):
    args = [sample(k) for k in ("y_backprop", "x", "scale", "reserve_space_1", "reserve_space_2")]
    return dict(zip(("x_backprop", "scale_backprop", "offset_backprop"), ops.fused_batch_norm_grad(*args, **kwargs)))


def one_line_error(result, *words):
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.output
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


def test_sample_bundle_through_the_cli(cli, tmp_path):
    out = tmp_path / "g.h5"
    r = cli("bn-grad", SAMPLE, "-o", out)
    assert r.exit_code == 0, r.output
    data, attrs = read_h5(out)
    assert sorted(data) == OUTPUTS
    for k, v in library().items():
        np.testing.assert_array_equal(data[k], v)
    assert attrs["op"] == "FusedBatchNormGradV3" and attrs["data_format"] == "NHWC" and bool(attrs["is_training"])
    assert attrs["epsilon"] == pytest.approx(1e-4) and attrs["variance_kind"] == "variance" and "qgcli_version" in attrs
    with h5py.File(out, "r") as f:
        assert f["x_backprop"].attrs["op"] == "FusedBatchNormGradV3"
    # the summary on stderr: the op, the convention, the per-channel table
    assert "FusedBatchNormGradV3" in r.stderr and "biased batch variance" in r.stderr
    assert "|x_backprop|" in r.stderr and "ch 0" in r.stderr and "... 4 more" in r.stderr and "L2 norm" in r.stderr


def test_json_summary(cli, tmp_path):
    r = cli("bn-grad", SAMPLE, "-o", tmp_path / "g.npz", "--json", "--epsilon", "1e-3")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["command"] == "bn-grad" and s["op"] == "FusedBatchNormGradV3" and s["channels"] == 12
    assert s["attributes"]["epsilon"] == 1e-3 and s["attributes"]["data_format"] == "NHWC"
    assert s["convention"]["variance_kind"] == "variance" and "biased" in s["convention"]["description"]
    want = library(epsilon=1e-3)
    assert s["per_channel"]["scale_backprop"] == [float(v) for v in want["scale_backprop"]]
    assert s["per_channel"]["offset_backprop"] == [float(v) for v in want["offset_backprop"]]
    norms = np.sqrt((want["x_backprop"].astype(np.float64) ** 2).sum(axis=(0, 1, 2)))
    np.testing.assert_allclose(s["per_channel"]["x_backprop_norm"], norms, rtol=1e-12)
    assert s["inputs"]["x"]["shape"] == [8, 6, 6, 12] and s["inputs"]["x"]["source"].endswith("batch_norm.h5:x")
    assert s["outputs"]["x_backprop"] == {"shape": [8, 6, 6, 12], "dtype": "float32"}
    assert r.stderr == ""
    with np.load(tmp_path / "g.npz") as got:
        np.testing.assert_array_equal(got["x_backprop"], want["x_backprop"])


def test_options_override_the_bundle_and_literals_work(cli, tmp_path):
    out = tmp_path / "g.h5"
    r = cli("bn-grad", SAMPLE, "--scale", "2", "--reserve-space-1", f"{SAMPLE}:moving_mean",
            "--reserve-space-2", f"{SAMPLE}:moving_variance", "--no-is-training", "-o", out, "-q")
    assert r.exit_code == 0, r.output
    assert r.stderr == ""
    data, attrs = read_h5(out)
    want = ops.fused_batch_norm_grad(sample("y_backprop"), sample("x"), 2.0, sample("moving_mean"),
                                     sample("moving_variance"), is_training=False)
    for k, v in zip(("x_backprop", "scale_backprop", "offset_backprop"), want):
        np.testing.assert_array_equal(data[k], v)
    assert not bool(attrs["is_training"])


def test_all_operands_from_npy_files_and_a_directory_output(cli, tmp_path):
    names = ("y_backprop", "x", "scale", "reserve_space_1", "reserve_space_2")
    nchw = {k: sample(k) for k in names}
    nchw["x"], nchw["y_backprop"] = (np.ascontiguousarray(np.moveaxis(nchw[k], -1, 1)) for k in ("x", "y_backprop"))
    args = []
    for k, v in nchw.items():
        np.save(tmp_path / f"{k}.npy", v)
        args += ["--" + k.replace("_", "-"), tmp_path / f"{k}.npy"]
    r = cli("bn-grad", *args, "--data-format", "NCHW", "-o", f"{tmp_path}/out/")
    assert r.exit_code == 0, r.output
    got = np.load(tmp_path / "out" / "x_backprop.npy")
    np.testing.assert_array_equal(np.moveaxis(got, 1, -1), library()["x_backprop"])
    assert sorted(os.listdir(tmp_path / "out")) == [k + ".npy" for k in OUTPUTS]


@pytest.mark.parametrize("source,kind", [("reserve_space_2", "biased-variance"), ("inv_std", "inv-std"),
                                         ("batch_variance", "unbiased-variance")])
def test_variance_kind_auto_on_each_convention(cli, tmp_path, source, kind):
    out = tmp_path / "g.h5"
    r = cli("bn-grad", SAMPLE, "--reserve-space-2", f"{SAMPLE}:{source}", "--variance-kind", "auto", "-o", out,
            "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["convention"]["kind"] == kind and s["attributes"]["variance_convention"] == kind
    assert s["convention"]["n"] == 288
    data, attrs = read_h5(out)
    want = library()
    for k in ("x_backprop", "scale_backprop", "offset_backprop"):
        np.testing.assert_allclose(data[k], want[k], rtol=2e-6, atol=1e-7 * np.abs(want[k]).max())
    assert attrs["variance_convention"] == kind


def test_variance_kind_auto_summary_names_the_convention(cli, tmp_path):
    r = cli("bn-grad", SAMPLE, "--reserve-space-2", f"{SAMPLE}:inv_std", "--variance-kind", "auto",
            "-o", tmp_path / "g.h5")
    assert r.exit_code == 0, r.output
    assert "cuDNN's saved inverse standard deviation" in " ".join(r.stderr.split())


def test_explicit_inv_std(cli, tmp_path):
    out = tmp_path / "g.h5"
    r = cli("bn-grad", SAMPLE, "--reserve-space-2", f"{SAMPLE}:inv_std", "--variance-kind", "inv-std", "-o", out)
    assert r.exit_code == 0, r.output
    data, attrs = read_h5(out)
    np.testing.assert_allclose(data["x_backprop"], library()["x_backprop"], rtol=2e-6, atol=1e-8)
    assert attrs["variance_kind"] == "inv-std" and "inverse std" in r.stderr


def test_auto_refuses_statistics_that_fit_nothing(cli, tmp_path):
    out = tmp_path / "g.h5"
    r = cli("bn-grad", SAMPLE, "--reserve-space-2", f"{SAMPLE}:moving_variance", "--variance-kind", "auto", "-o", out)
    one_line_error(r, "reserve_space_2: matches none of")
    assert not out.exists()
    r = cli("bn-grad", SAMPLE, "--reserve-space-1", f"{SAMPLE}:moving_mean", "--variance-kind", "auto", "-o", out)
    one_line_error(r, "reserve_space_1: is not the batch mean of x")
    r = cli("bn-grad", SAMPLE, "--variance-kind", "auto", "--no-is-training", "-o", out)
    one_line_error(r, "--variance-kind auto", "needs --is-training")
    assert not out.exists()


@pytest.mark.parametrize("version,names", [("v1", ["reserve_space_3", "reserve_space_4"]),
                                           ("v2", ["reserve_space_3", "reserve_space_4"]),
                                           ("v3", ["reserve_space_4", "reserve_space_5"])])
def test_all_outputs_per_version(cli, tmp_path, version, names):
    out = tmp_path / "g.h5"
    r = cli("bn-grad", SAMPLE, "--version", version, "--all-outputs", "-o", out, "--json")
    assert r.exit_code == 0, r.output
    data, attrs = read_h5(out)
    assert sorted(data) == sorted(OUTPUTS + names)
    assert all(data[n].shape == (0,) and data[n].dtype == f32 for n in names)
    assert attrs["op"] == {"v1": "FusedBatchNormGrad", "v2": "FusedBatchNormGradV2", "v3": "FusedBatchNormGradV3"}[version]
    assert sorted(json.loads(r.stdout)["outputs"]) == sorted(OUTPUTS + names)
    r = cli("bn-grad", SAMPLE, "--version", version, "-o", tmp_path / "plain.h5")
    assert sorted(read_h5(tmp_path / "plain.h5")[0]) == OUTPUTS


def write_bundle(path, **arrays):
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            if v.dtype == ml_dtypes.bfloat16:
                f.create_dataset(k, data=v.view(np.uint16)).attrs["dtype"] = "bfloat16"
            else:
                f[k] = v


def small(shape=(2, 3, 2, 4), dtype=f32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(dtype)
    c = shape[-1]
    x64 = x.astype(np.float64)
    axes = tuple(range(x.ndim - 1))
    return dict(y_backprop=rng.standard_normal(shape).astype(dtype), x=x, scale=np.ones(c, f32),
                reserve_space_1=x64.mean(axes).astype(f32), reserve_space_2=x64.var(axes).astype(f32))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_half_precision_round_trip(cli, tmp_path, dtype):
    arrays = small(dtype=dtype)
    write_bundle(tmp_path / "b.h5", **arrays)
    out = tmp_path / "g.h5"
    r = cli("bn-grad", tmp_path / "b.h5", "-o", out, "--json")
    assert r.exit_code == 0, r.output
    with h5py.File(out, "r") as f:
        if dtype == ml_dtypes.bfloat16:
            assert f["x_backprop"].dtype == np.uint16 and f["x_backprop"].attrs["dtype"] == "bfloat16"
    from qgcli.storage.io import Container

    with Container.open(str(out)) as c:
        got = c.read("x_backprop")
    want = ops.fused_batch_norm_grad(*arrays.values())
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got.astype(f32), want[0].astype(f32))
    assert json.loads(r.stdout)["outputs"]["x_backprop"]["dtype"] == np.dtype(dtype).name
    r = cli("bn-grad", tmp_path / "b.h5", "--version", "v1", "-o", tmp_path / "v1.h5")
    one_line_error(r, f"x: dtype {np.dtype(dtype).name} needs FusedBatchNormGradV2 or V3")


def test_five_d_picks_ndhwc_and_v2_refuses_it(cli, tmp_path):
    arrays = small(shape=(2, 2, 3, 2, 5))
    write_bundle(tmp_path / "b.h5", **arrays)
    r = cli("bn-grad", tmp_path / "b.h5", "-o", tmp_path / "g.h5", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["attributes"]["data_format"] == "NDHWC"
    r = cli("bn-grad", tmp_path / "b.h5", "--version", "v2", "--data-format", "NCDHW", "-o", tmp_path / "v2.h5")
    one_line_error(r, "data_format: NCDHW needs FusedBatchNormGradV3")


def test_inference_nchw_is_computed_with_a_note(cli, tmp_path):
    arrays = small()
    for k in ("x", "y_backprop"):
        arrays[k] = np.ascontiguousarray(np.moveaxis(arrays[k], -1, 1))
    write_bundle(tmp_path / "b.h5", **arrays)
    r = cli("bn-grad", tmp_path / "b.h5", "--data-format", "NCHW", "--no-is-training", "-o", tmp_path / "g.h5")
    assert r.exit_code == 0, r.output
    assert "refuses NCHW with is_training=False" in " ".join(r.stderr.split())


def test_reserve_space_3(cli, tmp_path):
    arrays = small()
    write_bundle(tmp_path / "b.h5", **arrays, reserve_space_3=np.ones((5, 5), f32))
    r = cli("bn-grad", tmp_path / "b.h5", "-o", tmp_path / "a.h5")
    assert r.exit_code == 0 and "reserve_space_3 is ignored" in r.stderr
    r = cli("bn-grad", tmp_path / "b.h5", "--version", "v2", "-o", tmp_path / "b2.h5")
    assert r.exit_code == 0 and "v2 has no such input" in r.stderr
    r = cli("bn-grad", tmp_path / "b.h5", "--version", "v1", "--reserve-space-3", "0", "-o", tmp_path / "c.h5")
    one_line_error(r, "--reserve-space-3", "only --version v3")
    assert not (tmp_path / "c.h5").exists()


def test_float64_statistics_get_a_note(cli, tmp_path):
    arrays = small()
    arrays["scale"] = arrays["scale"].astype(np.float64)
    write_bundle(tmp_path / "b.h5", **arrays)
    r = cli("bn-grad", tmp_path / "b.h5", "-o", tmp_path / "g.h5")
    assert r.exit_code == 0 and "scale is float64; rounded to float32" in r.stderr


def test_non_finite_outputs_are_reported(cli, tmp_path):
    arrays = small()
    arrays["x"][..., 1] = 2.0
    arrays["reserve_space_1"][1], arrays["reserve_space_2"][1] = 2.0, 0.0
    write_bundle(tmp_path / "b.h5", **arrays)
    r = cli("bn-grad", tmp_path / "b.h5", "--epsilon", "0", "-o", tmp_path / "g.h5", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert any("x_backprop has 12 non-finite values" in n for n in s["notes"])
    assert s["per_channel"]["scale_backprop"][1] is None  # NaN is not JSON


@pytest.mark.parametrize("change,args,words", [
    ({"scale": np.ones(3, f32)}, [], ["scale: has 3 entries but x has 4 channels"]),
    ({"reserve_space_1": np.ones(2, f32)}, [], ["reserve_space_1: has 2 entries but x has 4 channels"]),
    ({"reserve_space_2": np.ones(5, f32)}, [], ["reserve_space_2: has 5 entries"]),
    ({"x": np.ones((3, 4), f32), "y_backprop": np.ones((3, 4), f32)}, [], ["x: must be 4- or 5-dimensional"]),
    ({"y_backprop": np.ones((1, 3, 2, 4), f32)}, [], ["y_backprop: shape [1, 3, 2, 4] differs from x shape"]),
    ({"reserve_space_2": np.array([1, -1, 1, 1], f32)}, [], ["reserve_space_2: negative variance -1.0 at channel 1"]),
    ({"x": np.ones((2, 3, 2, 4), np.int16)}, [], ["x: dtype int16 is not a floating type"]),
    ({}, ["--epsilon", "-0.001"], ["'--epsilon'", "must be a finite number >= 0"]),
    ({}, ["--epsilon", "nan"], ["'--epsilon'", "must be a finite number >= 0"]),
    ({}, ["--data-format", "NHCW"], ["'--data-format'", "NHCW"]),
    ({}, ["--variance-kind", "std"], ["'--variance-kind'"]),
    ({}, ["--version", "v4"], ["'--version'"]),
    ({}, ["--scale", "1,2"], ["scale: has 2 entries but x has 4 channels"]),
    ({}, ["--reserve-space-2", "missing.npy"], ["reserve_space_2: no such file: missing.npy"]),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(cli, tmp_path, change, args, words):
    arrays = {**small(), **change}
    write_bundle(tmp_path / "b.h5", **arrays)
    out = tmp_path / "g.h5"
    r = cli("bn-grad", tmp_path / "b.h5", *args, "-o", out)
    one_line_error(r, *words)
    assert not out.exists()


def test_missing_operand(cli, tmp_path):
    arrays = small()
    del arrays["reserve_space_2"]
    write_bundle(tmp_path / "b.h5", **arrays)
    r = cli("bn-grad", tmp_path / "b.h5", "-o", tmp_path / "g.h5")
    one_line_error(r, "reserve_space_2: missing operand: give --reserve-space-2 SPEC", "has no dataset")
    r = cli("bn-grad", "--x", tmp_path / "b.h5", "-o", tmp_path / "g.h5")
    one_line_error(r, "y_backprop: missing operand: give --y-backprop SPEC")


def test_output_rules(cli, tmp_path):
    out = tmp_path / "g.h5"
    assert cli("bn-grad", SAMPLE, "-o", out).exit_code == 0
    before = out.read_bytes()
    one_line_error(cli("bn-grad", SAMPLE, "-o", out), "exists; use --force")
    assert out.read_bytes() == before
    assert cli("bn-grad", SAMPLE, "-o", out, "--force", "--epsilon", "0.1").exit_code == 0
    assert out.read_bytes() != before
    one_line_error(cli("bn-grad", SAMPLE, "-o", "-", "--json"), "--json and -o - both want stdout")


def test_npz_on_stdout_and_bundle_on_stdin(tmp_path):
    # A real pipeline: the sample as an npz stream on stdin, the result as npz on stdout.
    buf = tmp_path / "in.npz"
    with h5py.File(SAMPLE, "r") as f:
        np.savez(buf, **{k: f[k][()] for k in ("y_backprop", "x", "scale", "reserve_space_1", "reserve_space_2")})
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.run([sys.executable, "-m", "qgcli", "bn-grad", "-", "-o", "-", "-q"], input=buf.read_bytes(),
                       capture_output=True, cwd=str(tmp_path), env=env, timeout=120)
    assert p.returncode == 0, p.stderr.decode()
    import io

    with np.load(io.BytesIO(p.stdout)) as got:
        np.testing.assert_array_equal(got["x_backprop"], library()["x_backprop"])


def test_help_lists_every_option(cli):
    r = cli("bn-grad", "--help")
    assert r.exit_code == 0
    for opt in ("--y-backprop", "--x", "--scale", "--reserve-space-1", "--reserve-space-2", "--reserve-space-3",
                "--epsilon", "--data-format", "--is-training", "--variance-kind", "--version", "--all-outputs",
                "--json", "--device", "samples/batch_norm.h5"):
        assert opt in r.output, opt
