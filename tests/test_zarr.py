"""Zarr stores (formats 2 and 3, paths and fsspec URLs) as inputs and outputs, and Zarr tensors computed in
row blocks (here; the cluster's run is in test_dask.py): every output bit for bit the in-memory run's."""
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

f32 = np.float32


def make_store(path, fmt, shape=(3000, 7, 8), chunks=100, seed=0):
    """A bundle store: gradients/inputs (chunked along the first axis), per-channel and per-tensor ranges."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 2).astype(f32)
    x.reshape(-1)[:3] = (np.nan, -0.0, 1e-40)  # a NaN, a signed zero, a subnormal
    g = (rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, shape))).astype(f32)
    group = zarr.create_group(str(path), zarr_format=fmt)
    group.create_array("inputs", data=x, chunks=(chunks, *shape[1:]))
    group.create_array("gradients", data=g, chunks=(chunks + 28, *shape[1:]))  # chunks that differ
    group.create_array("min", data=-rng.uniform(0.5, 2, shape[-1]).astype(f32))
    group.create_array("max", data=rng.uniform(0.5, 2, shape[-1]).astype(f32))
    group.create_array("tensor_min", data=np.array(-1.5, f32))
    group.create_array("tensor_max", data=np.array(1.0, f32))
    return str(path)


def arrays_of(path):
    """name -> array of every array in a store (or .h5 file)."""
    if str(path).endswith(".h5"):
        out = {}
        with h5py.File(path, "r") as f:
            f.visititems(lambda n, o: out.__setitem__(n, o[()]) if isinstance(o, h5py.Dataset) else None)
        return out
    group = zarr.open_group(str(path), mode="r")
    return {name: node[...] for name, node in group.members(max_depth=None) if isinstance(node, zarr.Array)}


def same_bits(a, b):
    a, b = arrays_of(a), arrays_of(b)
    assert sorted(a) == sorted(b) and a
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name


def ok(result):
    assert result.exit_code == 0, result.output
    return result


def refused(result, *words, code=2):
    assert result.exit_code == code, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), result.output
    return lines[0]


def no_leftovers(folder):
    assert not [n for n in os.listdir(folder) if n.startswith(".qgcli-")]


def per_tensor(store):
    return ("--inputs", f"{store}:inputs", "--gradients", f"{store}:gradients", "--min", f"{store}:tensor_min",
            "--max", f"{store}:tensor_max")


@pytest.fixture(scope="module", params=[2, 3], ids=["zarr-v2", "zarr-v3"])
def store(request, tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("zarr") / "in.zarr", request.param)


def test_zarr_inputs_give_the_h5_inputs_results_and_zarr_outputs_hold_them(cli, store, tmp_path):
    h5 = tmp_path / "in.h5"
    with h5py.File(h5, "w") as f:
        for name, value in arrays_of(store).items():
            f[name] = value
    ok(cli("fakequant-grad", h5, "-o", tmp_path / "want.h5", "-q"))
    ok(cli("fakequant-grad", store, "-o", tmp_path / "bundle.h5", "-q"))
    ok(cli("fakequant-grad", f"file://{store}", "-o", f"file://{tmp_path}/url.zarr", "-q"))
    ok(cli("fakequant-grad", store, "-o", tmp_path / "blocks.zarr", "--memory-limit", "1M", "-q"))
    same_bits(tmp_path / "want.h5", tmp_path / "bundle.h5")
    same_bits(tmp_path / "want.h5", tmp_path / "url.zarr")
    same_bits(tmp_path / "want.h5", tmp_path / "blocks.zarr")
    out = zarr.open_group(str(tmp_path / "url.zarr"), mode="r")
    assert out.metadata.zarr_format == 3
    for node in (out, out["backprops_wrt_input"]):  # provenance as in .h5: on the root and on each array
        assert node.attrs["op"] == "FakeQuantWithMinMaxVarsPerChannelGradient" and node.attrs["num_bits"] == 8
    ok(cli("fakequant", "--inputs", f"{store}:inputs", "--min", "-1", "--max", "2", "-o", tmp_path / "fwd.zarr/",
           "--compression", "gzip", "-q"))
    ok(cli("fakequant", "--inputs", f"{h5}:inputs", "--min", "-1", "--max", "2", "-o", tmp_path / "fwd.npz", "-q"))
    with np.load(tmp_path / "fwd.npz") as want:
        assert zarr.open_array(str(tmp_path / "fwd.zarr"), path="outputs", mode="r")[...].tobytes() == \
            want["outputs"].tobytes()
    no_leftovers(tmp_path)


def test_format_2_outputs_under_zarrs_own_setting(store3, tmp_path):
    """ZARR_DEFAULT_ZARR_FORMAT=2 (zarr's own setting) makes the outputs Zarr format 2, in memory and in
    blocks, compressed or not, with the same bits as format 3.  From a format-3 store only: the outputs' format
    is the setting's, not the input's (both input formats are read in the other tests of this module), and each
    run is a fresh process (zarr reads the setting at import)."""
    store = store3
    env = {**os.environ, "ZARR_DEFAULT_ZARR_FORMAT": "2"}
    runs = {"v3.zarr": (), "v2.zarr": (), "v2-blocks.zarr": ("--memory-limit", "1M"),
            "v2-gzip.zarr": ("--compression", "gzip")}
    for name, extra in runs.items():
        subprocess.run([sys.executable, "-m", "qgcli", "fakequant-grad", store, "-o", str(tmp_path / name), "-q",
                        *extra], env=env if name.startswith("v2") else None, check=True, capture_output=True)
    assert zarr.open_group(str(tmp_path / "v3.zarr"), mode="r").metadata.zarr_format == 3
    for name in runs:
        if name.startswith("v2"):
            assert os.path.exists(tmp_path / name / ".zgroup")
            assert zarr.open_group(str(tmp_path / name), mode="r").metadata.zarr_format == 2
            same_bits(tmp_path / "v3.zarr", tmp_path / name)
    with open(tmp_path / "v2-gzip.zarr" / "backprops_wrt_input" / ".zarray") as fh:
        assert json.load(fh)["compressor"]["id"] == "gzip"


KERNELS = pytest.mark.parametrize("native", ["", "0"], ids=["compiled-kernels", "numpy-kernels"])


@pytest.fixture(scope="module")
def store3(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("zarr3") / "in.zarr", 3)


@KERNELS
@pytest.mark.parametrize("case", ["per-channel", "per-tensor", "args", "forward"])
def test_blocks_give_the_in_memory_bits(cli, store3, tmp_path, monkeypatch, case, native):
    monkeypatch.setenv("QGCLI_NATIVE", native)
    monkeypatch.setenv("QGCLI_TF_THREADS", "3")  # Eigen shards the per-tensor sum: three shards and a tail
    store = store3
    command, args = "fakequant-grad", (store,)
    if case == "per-tensor":
        args = per_tensor(store)
    elif case == "args":
        args = ("--inputs", f"{store}:inputs", "--gradients", f"{store}:gradients", "--variant", "args")
    elif case == "forward":
        command, args = "fakequant", ("--inputs", f"{store}:inputs", "--min", f"{store}:min", "--max", f"{store}:max")
    ok(cli(command, *args, "-o", tmp_path / "memory.zarr", "-q"))
    r = ok(cli(command, *args, "-o", tmp_path / "blocks.zarr", "--memory-limit", "1M", "--json"))
    s = json.loads(r.stdout)
    assert s["blocks"]["count"] == 30 and s["blocks"]["items"] == 100  # the input's chunks: leaves straddle them
    same_bits(tmp_path / "memory.zarr", tmp_path / "blocks.zarr")
    (big,) = [name for name, o in s["outputs"].items() if len(o["shape"]) == 3]
    assert zarr.open_group(str(tmp_path / "blocks.zarr"), mode="r")[big].chunks[0] == 100


def test_refusals_name_the_operand_and_write_nothing(cli, store, tmp_path):
    out = tmp_path / "out.zarr"
    refused(cli("fakequant-grad", "--inputs", f"{store}:nope", "--gradients", f"{store}:gradients", "--min",
                f"{store}:min", "--max", f"{store}:max", "-o", out), "inputs", "has no array 'nope'")
    refused(cli("fakequant-grad", tmp_path / "absent.zarr", "-o", out), "no such Zarr store")
    bad = zarr.create_group(str(tmp_path / "bad.zarr"))
    bad.create_array("inputs", data=np.zeros((40, 3), np.int32))
    bad.create_array("gradients", data=np.zeros((41, 3), f32))
    refused(cli("fakequant", "--inputs", f"{tmp_path}/bad.zarr:inputs", "--min", "-1", "--max", "1", "-o", out),
            "inputs", "int32")
    refused(cli("fakequant-grad", "--inputs", f"{store}:inputs", "--gradients", f"{tmp_path}/bad.zarr:gradients",
                "--min", "-1", "--max", "1", "-o", out), "gradients", "shape")
    refused(cli("fakequant-grad", "--inputs", f"{store}:inputs", "--gradients", f"{tmp_path}/bad.zarr:gradients",
                "--min", "-1", "--max", "1", "-o", out, "--memory-limit", "1M"), "gradients", "shape")
    refused(cli("fakequant-grad", store, "-o", tmp_path / "out.h5", "--memory-limit", "1M"), "--output", ".zarr")
    refused(cli("fakequant-grad", store, "-o", store, "--force"), "is also an input")
    refused(cli("fakequant-grad", store, "-o", out, "--compression", "lzf"), "--compression", "gzip")
    assert not out.exists() and not (tmp_path / "out.h5").exists()
    ok(cli("fakequant-grad", store, "-o", out, "-q"))
    refused(cli("fakequant-grad", store, "-o", out, "-q"), "exists; use --force")
    ok(cli("fakequant-grad", store, "-o", out, "-q", "--force", "--variant", "per-channel", "--num-bits", "4"))
    assert zarr.open_group(str(out), mode="r").attrs["num_bits"] == 4
    os.mkdir(tmp_path / "plain.zarr")
    refused(cli("fakequant-grad", store, "-o", tmp_path / "plain.zarr", "--force"), "not a Zarr store")
    refused(cli("fakequant-grad", "s3://bucket/in.zarr", "-o", out, "--force"), "s3")
    no_leftovers(tmp_path)


def test_damaged_and_hostile_stores_are_one_line_refusals(cli, tmp_path):
    strings = zarr.create_group(str(tmp_path / "strings.zarr"), zarr_format=2)
    strings.create_array("inputs", data=np.array(["a", "bb", "ccc"]))
    damaged = zarr.create_group(str(tmp_path / "damaged.zarr"))
    damaged.create_array("inputs", data=np.ones(4, f32))
    (tmp_path / "damaged.zarr" / "inputs" / "zarr.json").write_text("{not json")
    (tmp_path / "root.zarr").mkdir()
    (tmp_path / "root.zarr" / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"')
    out = tmp_path / "out.zarr"
    rng = ("--min", "-1", "--max", "1", "-o", out)
    refused(cli("fakequant", "--inputs", f"{tmp_path}/strings.zarr:inputs", *rng), "inputs", "not numbers")
    refused(cli("fakequant", "--inputs", f"{tmp_path}/damaged.zarr:inputs", *rng), "inputs", "cannot open 'inputs'")
    refused(cli("fakequant", tmp_path / "root.zarr", *rng), "BUNDLE", "cannot open as a Zarr store")
    assert not out.exists()
    no_leftovers(tmp_path)


def test_an_fsspec_url_reads_and_writes_through_fsspec(cli, tmp_path):
    """memory:// takes the code path of s3:// and gs:// (fsspec's store, a move instead of a rename)."""
    fsspec = pytest.importorskip("fsspec")
    make_store("memory://qgcli-test/in.zarr", 3, shape=(400, 5), chunks=64)
    try:
        ok(cli("fakequant-grad", "memory://qgcli-test/in.zarr", "-o", "memory://qgcli-test/out.zarr", "-q"))
        ok(cli("fakequant-grad", "memory://qgcli-test/in.zarr", "-o", "memory://qgcli-test/blocks.zarr", "-q",
               "--memory-limit", "1M"))
        refused(cli("fakequant-grad", "memory://qgcli-test/in.zarr", "-o", "memory://qgcli-test/out.zarr"), "exists")
        got = zarr.open_group("memory://qgcli-test/out.zarr", mode="r")
        ok(cli("fakequant-grad", "memory://qgcli-test/in.zarr", "-o", tmp_path / "want.zarr", "-q"))
        want = arrays_of(tmp_path / "want.zarr")
        for name in want:
            assert got[name][...].tobytes() == want[name].tobytes(), name
            assert zarr.open_group("memory://qgcli-test/blocks.zarr", mode="r")[name][...].tobytes() == \
                want[name].tobytes()
        assert sorted(fsspec.filesystem("memory").ls("/qgcli-test", detail=False)) == \
            ["/qgcli-test/blocks.zarr", "/qgcli-test/in.zarr", "/qgcli-test/out.zarr"]
    finally:
        fsspec.filesystem("memory").rm("/qgcli-test", recursive=True)


def test_a_run_file_writes_a_store_with_the_h5_outputs_layout(cli, tmp_path):
    from test_runfile import make_run

    make_run(tmp_path / "run.h5", steps=("step_1", "step_2"), bad=True)
    ok(cli("fakequant-grad", tmp_path / "run.h5", "--skip-invalid", "-o", tmp_path / "run.zarr", "-q"))
    ok(cli("fakequant-grad", tmp_path / "run.h5", "--skip-invalid", "-o", tmp_path / "want.h5", "-q"))
    same_bits(tmp_path / "want.h5", tmp_path / "run.zarr")
    with h5py.File(tmp_path / "want.h5", "r") as f:
        groups = []
        f.visititems(lambda n, o: groups.append((n, dict(o.attrs))) if isinstance(o, h5py.Group) and o.attrs else None)
    stored = zarr.open_group(str(tmp_path / "run.zarr"), mode="r")
    assert groups
    for name, attrs in groups:
        assert stored[name].attrs.asdict() == {k: v.item() if hasattr(v, "item") else v for k, v in attrs.items()}
    r = cli("fakequant-grad", tmp_path / "run.h5", "-o", tmp_path / "failed.zarr")  # a refused group: nothing
    assert r.exit_code != 0 and not (tmp_path / "failed.zarr").exists()
    r = cli("fakequant-grad", tmp_path / "run.h5", "-o", tmp_path / "run.zarr", "--force")  # fails half-way
    assert r.exit_code != 0
    same_bits(tmp_path / "want.h5", tmp_path / "run.zarr")  # the old store, untouched
    no_leftovers(tmp_path)


def test_without_zarr_paths_nothing_of_zarr_or_dask_is_imported(tmp_path):
    path = tmp_path / "in.npz"
    np.savez(path, inputs=np.linspace(-2, 2, 50, dtype=f32))
    code = ("import sys\nfrom qgcli.cli import main\n"
            f"main(['fakequant', {str(path)!r}, '--min', '-1', '--max', '1', '-o', {str(tmp_path / 'o.h5')!r}, '-q'],"
            " standalone_mode=False)\n"
            "print([m for m in ('zarr', 'dask', 'distributed', 'fsspec') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def make_bn_store(path, shape, channels_first=False, dtype=f32, seed=3):
    rng = np.random.default_rng(seed)
    group = zarr.create_group(str(path), zarr_format=3)
    x = (rng.standard_normal(shape) * 2 + 1).astype(dtype)
    x.reshape(-1)[:2] = (np.nan, np.inf)
    group.create_array("x", data=x, chunks=(3, *shape[1:]))
    group.create_array("y_backprop", data=rng.standard_normal(shape).astype(dtype), chunks=(5, *shape[1:]))
    channels = shape[1] if channels_first else shape[-1]
    group.create_array("scale", data=rng.uniform(0.5, 2, channels).astype(f32))
    group.create_array("reserve_space_1", data=rng.standard_normal(channels).astype(f32))
    group.create_array("reserve_space_2", data=rng.uniform(0.5, 2, channels).astype(f32))
    return str(path)


@pytest.mark.parametrize("shape, data_format, dtype", [((120, 9, 7, 24), "NHWC", f32), ((20, 24, 90, 70), "NCHW", f32),
                                                       ((120, 9, 7, 24), "NHWC", np.float16)],
                         ids=["NHWC", "NCHW-wide", "NHWC-float16"])
@KERNELS
def test_bn_grad_blocks_give_the_in_memory_bits(cli, tmp_path, monkeypatch, shape, data_format, dtype, native):
    """The float64 channel sums are added unit by unit as in memory: the same bits, not just close ones
    (the units are the compiled kernels' chunks, or the NumPy kernels' blocks: both are checked)."""
    monkeypatch.setenv("QGCLI_NATIVE", native)
    store = make_bn_store(tmp_path / "bn.zarr", shape, data_format == "NCHW", dtype)
    args = ("bn-grad", store, "--data-format", data_format, "--all-outputs", "-q")
    ok(cli(*args, "-o", tmp_path / "memory.zarr"))
    s = json.loads(ok(cli(*args, "-o", tmp_path / "blocks.zarr", "--memory-limit", "1M", "--json")).stdout)
    assert s["blocks"]["passes"] == 2 and s["blocks"]["count"] >= -(-shape[0] // 3)  # chunks of 3 or fewer
    same_bits(tmp_path / "memory.zarr", tmp_path / "blocks.zarr")
