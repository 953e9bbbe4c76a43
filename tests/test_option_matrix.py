"""Every mode x every output option: the option is applied as documented, or refused (exit 2, one line
naming the option and the mode).  Never silently dropped.

Modes: TensorFlow's fake quant (per tensor, per channel, Args), each other gradient estimator on TensorFlow's
grid, ``--variant quantize-dequantize``, ``--semantics torch`` (forward and gradient), ``--semantics torchao``
and ``bn-grad``.
Options: ``--compression gzip|lzf``, ``--memory-limit`` below the data with .h5 and .npz outputs (and above
it), ``--device``, ``-o -``, ``--json`` (and both), ``--plot``.
"""
import io
import json

import h5py
import numpy as np
import pytest

SHAPE = (64, 16, 16, 16)  # 1 MiB of float32 per operand: above the smallest --memory-limit (1M)
CHANNELS = ",".join(f"{v:g}" for v in np.linspace(0.5, 3, SHAPE[-1]))
NEG_CHANNELS = ",".join(f"{-v:g}" for v in np.linspace(0.5, 3, SHAPE[-1]))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("matrix")
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(SHAPE) * 2).astype(np.float32)
    g = rng.standard_normal(SHAPE).astype(np.float32)
    with h5py.File(d / "fq.h5", "w") as f:
        f["inputs"], f["gradients"] = x, g
    with h5py.File(d / "bn.h5", "w") as f:
        f["x"], f["y_backprop"] = x, g
        f["scale"] = np.linspace(0.5, 1.5, SHAPE[-1]).astype(np.float32)
        f["reserve_space_1"] = x.mean(axis=(0, 1, 2))
        f["reserve_space_2"] = x.var(axis=(0, 1, 2))
    return d


# name -> (argv before the output options, the mode's words in messages (None: streams), its outputs, --plot)
MODES = {
    "tf-per-tensor": (["fakequant-grad", "{d}/fq.h5", "--min", "-1", "--max", "1"], None,
                      {"backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max"}, True),
    "tf-per-channel": (["fakequant-grad", "{d}/fq.h5", "--min", NEG_CHANNELS, "--max", CHANNELS], None,
                       {"backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max"}, True),
    "tf-args": (["fakequant-grad", "{d}/fq.h5", "--variant", "args", "--min", "-1", "--max", "1"], None,
                {"backprops"}, True),
    "tf-forward": (["fakequant", "{d}/fq.h5", "--min", "-1", "--max", "1"], None, {"outputs"}, None),
    **{f"estimator-{name}": (["fakequant-grad", "{d}/fq.h5", "--min", "-1", "--max", "1", "--estimator", name],
                             f"--estimator {name}", None, False)
       for name in ("identity", "scaled:0.9", "lsq", "pact", "ewgs:1")},
    "quantize-dequantize": (["fakequant-grad", "{d}/fq.h5", "--min", "-1", "--max", "1", "--variant",
                             "quantize-dequantize"], "--variant quantize-dequantize", {"backprops_wrt_input"}, True),
    "quantize-dequantize-forward": (["fakequant", "{d}/fq.h5", "--min", "-1", "--max", "1", "--variant",
                                     "quantize-dequantize"], "--variant quantize-dequantize",
                                    {"outputs", "quantized", "output_min", "output_max"}, None),
    "torch": (["fakequant-grad", "{d}/fq.h5", "--semantics", "torch", "--scale", "0.05", "--zero-point", "128"],
              "--semantics torch", {"backprops_wrt_input"}, False),
    "torch-forward": (["fakequant", "{d}/fq.h5", "--semantics", "torch", "--scale", "0.05", "--zero-point", "128"],
                      "--semantics torch", {"outputs"}, None),
    "torchao": (["fakequant-grad", "{d}/fq.h5", "--semantics", "torchao", "--dtype", "int8", "--granularity",
                 "per-token", "--mapping-type", "asymmetric"], "--semantics torchao",
                {"backprops_wrt_input", "scale", "zero_point"}, False),
    "torchao-float8-forward": (["fakequant", "{d}/fq.h5", "--semantics", "torchao", "--dtype", "float8_e4m3fn"],
                               "--semantics torchao", {"outputs", "scale"}, None),
    "bn-grad": (["bn-grad", "{d}/bn.h5"], None, {"x_backprop", "scale_backprop", "offset_backprop"}, None),
    "qdq-v4": (["fakequant-grad", "{d}/fq.h5", "--input-min", "-1", "--input-max", "1", "--variant",
                "quantize-and-dequantize-v4"], "--variant quantize-and-dequantize-v4",
               {"input_backprop", "input_min_backprop", "input_max_backprop"}, True),
    "qdq-v3-forward": (["fakequant", "{d}/fq.h5", "--input-min", "-1", "--input-max", "1", "--variant",
                        "quantize-and-dequantize-v3"], "--variant quantize-and-dequantize-v3", {"output"}, None),
}
STREAMING = [m for m, (_, words, _, _) in MODES.items() if words is None]
IN_MEMORY_ONLY = [m for m in MODES if m not in STREAMING]


def run(cli, data, mode, *options):
    argv = [a.replace("{d}", str(data)) for a in MODES[mode][0]]
    return cli(*argv, *options)


def ok(r):
    assert r.exit_code == 0, r.output
    return r


def refused(r, *words):
    """Exit 2 with one line on stderr that names every word (the option, the mode)."""
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1, r.stderr
    for word in words:
        assert word in r.stderr, (word, r.stderr)
    assert "Traceback" not in r.output
    return r.stderr


def datasets(path):
    with h5py.File(path, "r") as f:
        return {name: (f[name].compression, f[name].ndim, f[name].size) for name in f}


# --- --compression ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("compression", ["gzip", "lzf"])
@pytest.mark.parametrize("mode", list(MODES))
def test_compression_applies_to_every_h5_output(cli, data, tmp_path, mode, compression):
    out = tmp_path / "o.h5"
    ok(run(cli, data, mode, "-o", out, "--compression", compression, "-q"))
    found = datasets(out)
    expected = MODES[mode][2]
    if expected is not None:
        assert set(found) == expected
    # Every dataset with elements is chunked and compressed; HDF5 cannot compress a scalar.
    assert all(c == compression for c, ndim, size in found.values() if ndim and size), found
    assert any(ndim and size for _, ndim, size in found.values())


@pytest.mark.parametrize("compression", ["gzip", "lzf"])
@pytest.mark.parametrize("mode", list(MODES))
def test_compression_does_not_change_the_values(cli, data, tmp_path, mode, compression):
    plain, packed = tmp_path / "p.h5", tmp_path / "c.h5"
    ok(run(cli, data, mode, "-o", plain, "-q"))
    ok(run(cli, data, mode, "-o", packed, "--compression", compression, "-q"))
    with h5py.File(plain, "r") as a, h5py.File(packed, "r") as b:
        assert set(a) == set(b)
        for name in a:
            np.testing.assert_array_equal(a[name][()], b[name][()])
            assert a[name].compression is None


@pytest.mark.parametrize("mode", ["tf-per-tensor", "quantize-dequantize", "torch", "estimator-pact", "bn-grad"])
def test_compression_leaves_other_outputs_as_documented(cli, data, tmp_path, mode):
    # "Compress HDF5 outputs": an .npz / a directory of .npy is written as without the option, in every mode.
    ok(run(cli, data, mode, "-o", tmp_path / "o.npz", "--compression", "gzip", "-q"))
    ok(run(cli, data, mode, "-o", tmp_path / "plain.npz", "-q"))
    with np.load(tmp_path / "o.npz") as a, np.load(tmp_path / "plain.npz") as b:
        assert sorted(a.files) == sorted(b.files)


# --- --memory-limit ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", STREAMING)
def test_memory_limit_below_the_data_streams_into_h5(cli, data, tmp_path, mode):
    streamed, memory = tmp_path / "s.h5", tmp_path / "m.h5"
    r = ok(run(cli, data, mode, "-o", streamed, "--memory-limit", "1M", "--compression", "gzip", "--json"))
    assert any("streamed from disk" in note for note in json.loads(r.stdout)["notes"])
    ok(run(cli, data, mode, "-o", memory, "-q"))
    found = datasets(streamed)
    assert set(found) == set(datasets(memory)) == MODES[mode][2]
    assert all(c == "gzip" for c, ndim, size in found.values() if ndim and size), found


@pytest.mark.parametrize("mode", STREAMING)
def test_memory_limit_below_the_data_refuses_an_npz_output_when_streaming(cli, data, tmp_path, mode):
    r = run(cli, data, mode, "-o", tmp_path / "o.npz", "--memory-limit", "1M")
    refused(r, "--memory-limit", "--output", "streaming writes .h5 outputs only")
    assert not (tmp_path / "o.npz").exists()


@pytest.mark.parametrize("suffix", [".h5", ".npz"])
@pytest.mark.parametrize("mode", IN_MEMORY_ONLY)
def test_memory_limit_below_the_data_is_refused_where_the_mode_cannot_stream(cli, data, tmp_path, mode, suffix):
    out = tmp_path / ("o" + suffix)
    message = refused(run(cli, data, mode, "-o", out, "--memory-limit", "1M"), "--memory-limit", MODES[mode][1],
                      "cannot stream")
    assert message.startswith("Error: --memory-limit: ")
    assert not out.exists()


@pytest.mark.parametrize("mode", list(MODES))
def test_memory_limit_above_the_data_is_honoured_in_memory(cli, data, tmp_path, mode):
    r = ok(run(cli, data, mode, "-o", tmp_path / "o.npz", "--memory-limit", "1G", "--json"))
    assert not any("streamed" in note for note in json.loads(r.stdout)["notes"])


@pytest.mark.parametrize("mode", ["tf-per-channel", "quantize-dequantize", "torch", "bn-grad"])
def test_an_unreadable_memory_limit_is_refused_in_every_mode(cli, data, tmp_path, mode):
    refused(run(cli, data, mode, "-o", tmp_path / "o.h5", "--memory-limit", "lots"), "--memory-limit",
            "cannot read 'lots'")


# --- --device ---------------------------------------------------------------------------------------------

def _have_gpu():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.mark.parametrize("mode", list(MODES))
def test_device(cli, data, tmp_path, mode):
    ok(run(cli, data, mode, "-o", tmp_path / "cpu.npz", "--device", "cpu", "-q"))
    if _have_gpu():
        ok(run(cli, data, mode, "-o", tmp_path / "gpu.npz", "--device", "gpu", "-q"))
        return
    refused(run(cli, data, mode, "-o", tmp_path / "gpu.npz", "--device", "gpu"), "--device", "CuPy")
    assert not (tmp_path / "gpu.npz").exists()


@pytest.mark.parametrize("mode", ["tf-per-channel", "quantize-dequantize", "bn-grad"])
def test_a_memory_limit_on_the_gpu_is_refused_when_it_cannot_be_honoured(cli, data, tmp_path, mode):
    # The GPU path loads whole tensors on the host: a limit below them cannot be kept.
    refused(run(cli, data, mode, "-o", tmp_path / "o.h5", "--device", "gpu", "--memory-limit", "1M"),
            "--memory-limit", "--device gpu" if MODES[mode][1] is None else MODES[mode][1])


# --- -o -, --json -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", list(MODES))
def test_stdout_output_is_an_npz_of_the_outputs(cli, data, mode):
    r = ok(run(cli, data, mode, "-o", "-", "-q"))
    with np.load(io.BytesIO(r.stdout_bytes)) as npz:
        names = set(npz.files)
    expected = MODES[mode][2]
    assert names == expected if expected is not None else "backprops_wrt_input" in names


@pytest.mark.parametrize("mode", list(MODES))
def test_json_summary_on_stdout(cli, data, tmp_path, mode):
    r = ok(run(cli, data, mode, "-o", tmp_path / "o.npz", "--json"))
    doc = json.loads(r.stdout)
    assert doc["command"] == MODES[mode][0][0] and doc["output"] == str(tmp_path / "o.npz")
    assert r.stderr == ""


@pytest.mark.parametrize("mode", list(MODES))
def test_json_and_stdout_output_are_refused_before_any_work(cli, data, mode):
    r = run(cli, data, mode, "-o", "-", "--json")
    refused(r, "--json and -o - both want stdout")
    assert r.stdout_bytes == b""


# --- --plot -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [m for m, spec in MODES.items() if spec[3] is not None])
def test_plot_draws_or_is_refused(cli, data, tmp_path, mode):
    fig = tmp_path / "fig.png"
    r = run(cli, data, mode, "-o", tmp_path / "o.h5", "--plot", fig, "-q")
    if MODES[mode][3]:
        ok(r)
        assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        refused(r, "--plot", "STE only")
        assert not fig.exists() and not (tmp_path / "o.h5").exists()


@pytest.mark.parametrize("mode", ["tf-per-tensor", "tf-per-channel"])
def test_plot_is_refused_when_streaming(cli, data, tmp_path, mode):
    refused(run(cli, data, mode, "-o", tmp_path / "o.h5", "--plot", tmp_path / "f.png", "--memory-limit", "1M"),
            "--plot", "streamed from disk")


@pytest.mark.parametrize("mode", [m for m, spec in MODES.items() if spec[3] is None])
def test_plot_is_no_option_of_the_forward_ops_and_bn_grad(cli, data, tmp_path, mode):
    refused(run(cli, data, mode, "-o", tmp_path / "o.h5", "--plot", tmp_path / "f.png"), "--plot")
