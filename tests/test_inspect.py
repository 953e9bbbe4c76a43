"""``qgcli inspect``: listings and statistics of .npy/.npz/.h5 files, stdin pipelines, progress on stderr."""
import io
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from qgcli import ops
from qgcli.report.progress import Progress, progress_enabled

from checkout import checkout_env
from conftest import ROOT, SAMPLES

PER_CHANNEL = os.path.join(SAMPLES, "per_channel.h5")
FILE_KEYS = ["file", "format", "size_bytes", "key", "attributes", "groups", "links", "tensors", "layers"]
TENSOR_KEYS = ["name", "shape", "dtype", "size", "nbytes", "min", "max", "mean", "std", "nan", "inf", "zeros",
               "attributes", "error"]
QGCLI = [sys.executable, "-m", "qgcli"]


def direct_stats(a):
    a = np.asarray(a)
    finite = a[np.isfinite(a)].astype(np.float64)
    return {"min": finite.min(), "max": finite.max(), "mean": finite.mean(), "std": finite.std(),
            "nan": int(np.isnan(a).sum()), "inf": int(np.isinf(a).sum()), "zeros": int((a == 0).sum())}


def check_stats(entry, a):
    for key, value in direct_stats(a).items():
        assert entry[key] == pytest.approx(value, rel=1e-9, abs=1e-12), (entry["name"], key)


def inspect_json(cli, *args, input=None):
    r = cli("inspect", *args, "--json", input=input)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert list(doc) == ["command", "schema", "qgcli_version", "files"] and doc["command"] == "inspect"
    for f in doc["files"]:
        assert list(f) == FILE_KEYS
        assert all(list(t) == TENSOR_KEYS for t in f["tensors"])
    return doc


def test_h5_sample_listing_and_statistics(cli):
    doc = inspect_json(cli, PER_CHANNEL)
    (f,) = doc["files"]
    assert f["format"] == "h5" and f["size_bytes"] == os.path.getsize(PER_CHANNEL) and f["key"] is None
    assert f["attributes"] == {"description": "per-channel activations [4, 8, 8, 16] with gradients"}
    assert [t["name"] for t in f["tensors"]] == ["gradients", "inputs", "max", "min"]
    with h5py.File(PER_CHANNEL, "r") as h:
        for t in f["tensors"]:
            a = h[t["name"]][()]
            assert t["shape"] == list(a.shape) and t["dtype"] == "float32"
            assert t["size"] == a.size and t["nbytes"] == a.nbytes and t["error"] is None
            check_stats(t, a)


def test_npz_with_special_values_and_dtypes(cli, tmp_path):
    path = tmp_path / "mixed.npz"
    floats = np.array([np.nan, np.inf, -np.inf, 0.0, 1.5, -2.5], np.float64)
    np.savez(path, floats=floats, ints=np.array([[3, 0], [-7, 9]], np.int16), flags=np.array([True, False, True]),
             text=np.array(["a", "bc"]), half=np.array([0.5, 0.25], np.float16), empty=np.zeros((0, 3), np.float32),
             nothing_finite=np.array([np.nan, np.inf]), objects=np.array([{"x": 1}], dtype=object))
    tensors = {t["name"]: t for t in inspect_json(cli, path)["files"][0]["tensors"]}
    check_stats(tensors["floats"], floats)
    assert (tensors["floats"]["nan"], tensors["floats"]["inf"]) == (1, 2)
    ints = tensors["ints"]
    assert (ints["min"], ints["max"], ints["zeros"], ints["nan"]) == (-7, 9, 1, 0) and isinstance(ints["min"], int)
    assert ints["mean"] == pytest.approx(1.25) and ints["dtype"] == "int16" and ints["nbytes"] == 8
    assert tensors["flags"]["mean"] == pytest.approx(2 / 3) and tensors["flags"]["zeros"] == 1
    assert tensors["text"]["min"] is None and tensors["text"]["nan"] is None and tensors["text"]["error"] is None
    assert tensors["half"]["dtype"] == "float16" and tensors["half"]["mean"] == pytest.approx(0.375)
    assert tensors["empty"]["shape"] == [0, 3] and tensors["empty"]["min"] is None and tensors["empty"]["zeros"] == 0
    assert tensors["nothing_finite"]["mean"] is None and tensors["nothing_finite"]["nan"] == 1
    # A pickled object array is never loaded: its header is shown and the error recorded, the rest still listed.
    obj = tensors["objects"]
    assert obj["dtype"] == "object" and obj["shape"] == [1] and "pickled" in obj["error"]


def test_npy_and_key_selection(cli, tmp_path):
    path = tmp_path / "a.npy"
    a = np.arange(12, dtype=np.float32).reshape(3, 4) - 5
    np.save(path, a)
    (f,) = inspect_json(cli, path)["files"]
    assert f["format"] == "npy" and len(f["tensors"]) == 1 and f["tensors"][0]["name"] == ""
    check_stats(f["tensors"][0], a)
    doc = inspect_json(cli, f"{PER_CHANNEL}:min")
    assert [t["name"] for t in doc["files"][0]["tensors"]] == ["min"] and doc["files"][0]["key"] == "min"


def test_h5_groups_attributes_and_links_are_listed_never_followed(cli, tmp_path):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["secret"] = np.arange(5.0)
    path = tmp_path / "tree.h5"
    with h5py.File(path, "w") as f:
        f.attrs["run"] = np.bytes_("exp-7")  # fixed-length: read
        f.attrs["user"] = "someone"  # h5py's variable-length str: read by a worker with a time limit
        layer = f.create_group("layer1")
        layer.attrs["bits"] = np.int64(4)
        layer.attrs["scales"] = np.array([0.5, 0.25])
        layer["x"] = np.ones((2, 2), np.float32)
        layer["x"].attrs["note"] = np.bytes_(b"bytes attribute")
        layer["loop"] = layer  # a hard-link cycle: must not walk forever
        f["outside"] = h5py.ExternalLink(str(other), "/secret")
        f["alias"] = h5py.SoftLink("/layer1/x")
        f["raw_bf16"] = np.array([0x3F80, 0xC000], np.uint16)  # 1.0, -2.0 as bfloat16 bits
        f["raw_bf16"].attrs["dtype"] = "bfloat16"
    (f,) = inspect_json(cli, path)["files"]
    root = {"run": "exp-7", "user": "someone"}
    assert f["attributes"] == root
    assert {g["path"]: g["attributes"] for g in f["groups"]} == {"/": root,
                                                                 "layer1": {"bits": 4, "scales": [0.5, 0.25]}}
    links = {lk["path"]: lk for lk in f["links"]}
    assert links["outside"]["kind"] == "external" and links["outside"]["target"] == f"{other}:/secret"
    assert links["alias"] == {"path": "alias", "kind": "soft", "target": "/layer1/x"}
    assert links["layer1/loop"]["kind"] == "hard" and links["layer1/loop"]["target"] == "layer1"
    names = [t["name"] for t in f["tensors"]]
    assert names == ["layer1/x", "raw_bf16"]  # nothing read through the external or soft link
    x = f["tensors"][0]
    assert x["attributes"] == {"note": "bytes attribute"} and x["mean"] == 1.0
    bf16 = f["tensors"][1]
    assert bf16["dtype"] == "bfloat16" and (bf16["min"], bf16["max"]) == (-2.0, 1.0) and bf16["nbytes"] == 4
    r = cli("inspect", path)
    assert r.exit_code == 0, r.output
    assert "external link outside" in r.stdout and "not followed" in r.stdout and "run: exp-7" in r.stdout
    doc = inspect_json(cli, f"{path}:layer1")
    assert [t["name"] for t in doc["files"][0]["tensors"]] == ["layer1/x"]


def test_qgcli_provenance_is_shown_plainly(cli, tmp_path):
    out = tmp_path / "grads.h5"
    assert cli("fakequant-grad", PER_CHANNEL, "-o", out, "-q").exit_code == 0
    r = cli("inspect", out)
    assert r.exit_code == 0, r.output
    line = [ln for ln in r.stdout.splitlines() if "written by qgcli" in ln][0]
    assert "FakeQuantWithMinMaxVarsPerChannelGradient" in line and "num_bits=8" in line and "axis=-1" in line
    assert "backprops_wrt_input" in r.stdout
    (f,) = inspect_json(cli, out)["files"]
    assert f["attributes"]["op"] == "FakeQuantWithMinMaxVarsPerChannelGradient"
    assert all(t["attributes"]["op"] == f["attributes"]["op"] for t in f["tensors"])


@pytest.mark.parametrize("stats", [True, False])
def test_a_captured_steps_digest_table_is_listed_as_such(cli, tmp_path, stats):
    """capture's digest table (one row per result verify compares) is listed as "sha256 digests", with no
    statistics and no "not a tensor" note: not as a compound dtype qgcli cannot read."""
    from qgcli.storage.hdf5 import digests

    path = tmp_path / "run.h5"
    with h5py.File(path, "w") as f:
        step = f.create_group("step_000001")
        digests.write_table(step, [("layer/q", "outputs", (4,), "<f4", np.arange(32, dtype=np.uint8)),
                                   ("layer/q", "backprops_wrt_input", (4,), "<f4", np.zeros(32, np.uint8))])
        step["layer/q/inputs"] = np.ones(4, np.float32)
    args = [path] + ([] if stats else ["--no-stats"])
    (f,) = inspect_json(cli, *args)["files"]
    (table,) = [t for t in f["tensors"] if t["name"] == "step_000001/qgcli_digests"]
    assert table["dtype"] == "sha256 digests" and table["shape"] == [2] and table["error"] is None
    assert table["min"] is None and table["attributes"] == {"digest": "sha256"}
    r = cli("inspect", *args)
    assert r.exit_code == 0 and "not a tensor" not in r.output and "names" not in r.output, r.output
    assert "sha256 digests" in r.stdout


def test_no_stats_reads_no_data(cli):
    (f,) = inspect_json(cli, PER_CHANNEL, "--no-stats")["files"]
    t = f["tensors"][1]
    assert t["name"] == "inputs" and t["shape"] == [4, 8, 8, 16] and t["nbytes"] == 16384
    assert all(t[k] is None for k in ("min", "max", "mean", "std", "nan", "inf", "zeros"))


def test_stdin_npz_and_npy_through_clirunner(cli):
    buf = io.BytesIO()
    np.savez(buf, a=np.array([1.0, -1.0]), b=np.zeros(3, np.int8))
    (f,) = inspect_json(cli, "-", input=buf.getvalue())["files"]
    assert f["file"] == "-" and f["format"] == "npz" and f["size_bytes"] == len(buf.getvalue())
    assert [t["name"] for t in f["tensors"]] == ["a", "b"] and f["tensors"][1]["zeros"] == 3
    buf = io.BytesIO()
    np.save(buf, np.full((2, 2), 7.0, np.float32))
    (f,) = inspect_json(cli, "-", input=buf.getvalue())["files"]
    assert f["format"] == "npy" and f["tensors"][0]["mean"] == 7.0


@pytest.mark.parametrize("args, stdin, message", [
    (["missing.h5"], None, "FILE: no such file: missing.h5"),
    (["-"], b"", "stdin is empty"),
    (["-"], b"hello", "stdin is not an .npy, .npz or .h5 stream"),
    (["-", "-"], None, "stdin (-) can be read only once"),
    ([f"{PER_CHANNEL}:nope"], None, "has no tensor or group 'nope'"),
    (["notes.txt"], None, "unknown file type"),
])
def test_errors_are_one_line_exit_2(cli, args, stdin, message):
    r = cli("inspect", *args, input=stdin)
    assert r.exit_code == 2, r.output
    assert message in r.stderr and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1


def test_text_file_named_h5_is_refused(cli, tmp_path):
    path = tmp_path / "fake.h5"
    path.write_text("not hdf5")
    r = cli("inspect", path)
    assert r.exit_code == 2 and "is not an h5 file" in r.stderr


# --- real processes ----------------------------------------------------------------------------------

def test_pipeline_fakequant_grad_into_inspect_json():
    """`qgcli fakequant-grad samples/per_channel.h5 -o - | qgcli inspect - --json` with two real processes."""
    env = dict(os.environ, QGCLI_NO_PROGRESS="")
    producer = subprocess.Popen(QGCLI + ["fakequant-grad", PER_CHANNEL, "-o", "-"], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    consumer = subprocess.Popen(QGCLI + ["inspect", "-", "--json"], cwd=ROOT, env=env, stdin=producer.stdout,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    producer.stdout.close()  # the consumer owns the read end now
    out, err = consumer.communicate(timeout=120)
    _, perr = producer.communicate(timeout=120)
    assert producer.returncode == 0, perr.decode()
    assert consumer.returncode == 0, err.decode()
    assert err == b""  # stderr is a pipe: no progress, no notes
    doc = json.loads(out)
    (f,) = doc["files"]
    assert f["file"] == "-" and f["format"] == "npz"
    tensors = {t["name"]: t for t in f["tensors"]}
    assert list(tensors) == ["backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max"]
    with h5py.File(PER_CHANNEL, "r") as h:
        x, g, mn, mx = (h[k][()] for k in ("inputs", "gradients", "min", "max"))
    dx, dmin, dmax = ops.fake_quant_with_min_max_vars_per_channel_gradient(g, x, mn, mx)
    for name, a in (("backprops_wrt_input", dx), ("backprop_wrt_min", dmin), ("backprop_wrt_max", dmax)):
        check_stats(tensors[name], a)
        assert tensors[name]["shape"] == list(a.shape)
    # Gradient elements zeroed by the STE mask show up as zeros (the sample's gradient has none of its own).
    assert tensors["backprops_wrt_input"]["zeros"] == int((dx == 0).sum()) > 0


def test_table_on_a_pipe_is_plain_text():
    r = subprocess.run(QGCLI + ["inspect", PER_CHANNEL], cwd=ROOT, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    text = r.stdout.decode()
    assert "\x1b[" not in text and r.stderr == b""
    row = [ln for ln in text.splitlines() if ln.startswith("inputs ")][0].split()
    assert row[1:5] == ["[4,", "8,", "8,", "16]"] and row[5] == "float32"


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
@pytest.mark.parametrize("quiet", [False, True])
def test_progress_shows_on_a_terminal_stderr_only(quiet):
    import pty  # noqa: F401 - POSIX only, like os.openpty

    master, slave = os.openpty()
    env = checkout_env(dict(os.environ, QGCLI_PROGRESS_DELAY="0"))
    env.pop("QGCLI_NO_PROGRESS", None)
    cmd = QGCLI + ["report", PER_CHANNEL, "--json"] + (["--quiet"] if quiet else [])
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO once the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    out, _ = proc.communicate(timeout=120)
    os.close(master)
    assert proc.returncode == 0
    json.loads(out)  # stdout stays one clean JSON document
    if quiet:
        assert seen == b""
    else:
        assert b"reading operands" in seen or b"suggested range" in seen


def test_progress_helper():
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=100)
    with Progress("crunching", total=4, enabled=True, delay=0, console=console) as p:
        p.advance(2)
        p.update(description="still crunching")
        p.advance(2)
    assert p.shown and p.completed == 4 and "crunching" in buf.getvalue()
    # Short work under the delay never draws anything.
    buf = io.StringIO()
    with Progress("quick", total=1, enabled=True, delay=30, console=Console(file=buf, force_terminal=True)) as p:
        p.advance()
    assert not p.shown and buf.getvalue() == ""
    assert not progress_enabled(quiet=True)
    assert not progress_enabled(stream=io.StringIO())


def test_h5_odd_datasets_do_not_stop_the_listing(cli, tmp_path):
    other = tmp_path / "source.h5"
    with h5py.File(other, "w") as f:
        f["data"] = np.arange(4.0)
    path = tmp_path / "odd.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("empty", data=h5py.Empty("f4"))
        f["record"] = np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")])
        f["cplx"] = np.array([1 + 2j, np.nan])
        f["label"] = "hello"
        f["named_type"] = np.dtype("f4")
        f.attrs["big"] = np.arange(100)
        f.attrs["not_a_number"] = np.nan
        layout = h5py.VirtualLayout(shape=(4,), dtype="f8")
        layout[:] = h5py.VirtualSource(str(other), "data", shape=(4,))
        f.create_virtual_dataset("virtual", layout)
    (f,) = inspect_json(cli, path)["files"]
    assert f["attributes"] == {"big": "<array int64 [100]>", "not_a_number": None}
    t = {t["name"]: t for t in f["tensors"]}
    assert t["empty"]["shape"] is None and t["empty"]["dtype"] == "float32" and t["empty"]["error"] is None
    assert t["record"]["min"] is None and t["record"]["shape"] == [1]
    assert (t["cplx"]["nan"], t["cplx"]["zeros"], t["cplx"]["min"]) == (1, 0, None)
    # variable-length strings are listed, not read (a damaged global heap can hang HDF5's read)
    assert t["label"]["dtype"] == "object" and "variable-length strings" in t["label"]["error"]
    assert "virtual dataset reading" in t["virtual"]["error"] and t["virtual"]["min"] is None
    assert {"path": "named_type", "kind": "datatype", "target": "float32"} in f["links"]


def test_small_plain_datasets_read_in_one_call_as_the_checked_read(cli, tmp_path):
    from qgcli.storage import h5

    rng = np.random.default_rng(3)
    path = tmp_path / "plain.h5"
    with h5py.File(path, "w") as f:
        f["big_endian"] = rng.standard_normal((3, 4)).astype(">f4")
        f["int8"] = rng.integers(-5, 5, 7).astype(np.int8)
        f["half"] = np.array([1, np.nan, np.inf, 0], np.float16)
        f["scalar"] = np.float64(3.5)
        f.create_dataset("gzip", data=rng.standard_normal((20, 20)), chunks=(5, 5), compression="gzip")
        f.create_dataset("fill_only", shape=(4,), dtype="f4", fillvalue=2.5)
        f["uint32"] = np.arange(5, dtype=">u4")
        f.create_dataset("external", shape=(4,), dtype="f4", external=[(str(tmp_path / "raw.bin"), 0, 16)])
        f["external"][...] = 1.0  # its data written (outside the file)
        layout = h5py.VirtualLayout(shape=(7,), dtype=np.int8)
        layout[:] = h5py.VirtualSource(".", "int8", shape=(7,))
        f.create_virtual_dataset("virtual", layout)
    with h5py.File(path, "r") as f:
        for name in ("big_endian", "int8", "half", "scalar", "gzip", "fill_only", "uint32"):
            ds = f[name]
            fast = h5.read_plain_dataset(ds.id, ds.shape, ds.dtype)
            checked = h5.read_dataset_node(h5.checked_dataset(ds, name, "x"), name, "x")
            assert fast is not None and fast.dtype == checked.dtype and fast.shape == checked.shape, name
            np.testing.assert_array_equal(fast, checked)
        for name in ("external", "virtual"):  # data outside the file (virtual: maybe): left to the checked read
            ds = f[name]
            assert h5.read_plain_dataset(ds.id, ds.shape, ds.dtype) is None, name
    t = {t["name"]: t for t in inspect_json(cli, path)["files"][0]["tensors"]}
    assert "external file" in t["external"]["error"] and t["external"]["min"] is None
    assert t["big_endian"]["dtype"] == ">f4" and t["fill_only"]["min"] == t["fill_only"]["max"] == 2.5
    with h5py.File(path, "r") as f:
        check_stats(t["half"], f["half"][()])
        check_stats(t["gzip"], f["gzip"][()])


# --- every format the tool reads (the storage registry, qgcli.storage.formats) ----------------------------

def test_inspect_lists_a_safetensors_file_with_its_metadata(cli, tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(7)
    arrays = {"inputs": rng.standard_normal((3, 4)).astype(np.float32), "scale": np.arange(4, dtype=np.int32)}
    path = tmp_path / "t.safetensors"
    st.save_file(arrays, str(path), metadata={"qgcli_version": "0.1.0", "op": "FakeQuantWithMinMaxVars"})
    (f,) = inspect_json(cli, path)["files"]
    assert list(f) == FILE_KEYS
    assert f["format"] == "safetensors" and f["size_bytes"] == os.path.getsize(path)
    assert f["attributes"] == {"op": "FakeQuantWithMinMaxVars", "qgcli_version": "0.1.0"}
    assert f["groups"] == f["links"] == f["layers"] == []
    by_name = {t["name"]: t for t in f["tensors"]}
    assert sorted(by_name) == ["inputs", "scale"]
    for name, a in arrays.items():
        assert list(by_name[name]) == TENSOR_KEYS
        assert by_name[name]["shape"] == list(a.shape) and by_name[name]["dtype"] == str(a.dtype)
        check_stats(by_name[name], a)
    (one,) = inspect_json(cli, f"{path}:scale")["files"][0]["tensors"]
    assert one["name"] == "scale" and one["max"] == 3
    r = cli("inspect", path)
    assert r.exit_code == 0, r.output
    assert "safetensors, " in r.stdout and "written by qgcli 0.1.0: FakeQuantWithMinMaxVars" in r.stdout


def test_inspect_reads_what_qgcli_writes_in_every_output_format(cli, tmp_path):
    """An output of each format qgcli writes to a file lists the same tensors with the same statistics."""
    pytest.importorskip("safetensors")
    bundle = os.path.join(SAMPLES, "notebook.h5")
    seen = {}
    for suffix in (".h5", ".npz", ".safetensors"):
        out = tmp_path / f"out{suffix}"
        r = cli("fakequant-grad", bundle, "--num-bits", "2", "-o", out, "-q")
        assert r.exit_code == 0, r.output
        (f,) = inspect_json(cli, out)["files"]
        seen[suffix] = {t["name"]: (t["shape"], t["dtype"], t["min"], t["max"], t["zeros"]) for t in f["tensors"]}
    assert seen[".npz"] == seen[".h5"] and len(seen[".h5"]) == 3
    # safetensors keeps a 0-d tensor as shape [1] (its writer's rule, unchanged); the values are the same
    assert {k: v[1:] for k, v in seen[".safetensors"].items()} == {k: v[1:] for k, v in seen[".h5"].items()}


def test_inspect_lists_a_zarr_store_and_a_root_array(cli, tmp_path):
    zarr = pytest.importorskip("zarr")
    out = tmp_path / "out.zarr"
    r = cli("fakequant-grad", os.path.join(SAMPLES, "notebook.h5"), "--num-bits", "2", "-o", out, "-q")
    assert r.exit_code == 0, r.output
    (f,) = inspect_json(cli, out)["files"]
    assert f["format"] == "zarr" and f["size_bytes"] > 0
    assert f["attributes"]["qgcli_version"] and f["attributes"]["num_bits"] == 2
    assert sorted(t["name"] for t in f["tensors"]) == ["backprop_wrt_max", "backprop_wrt_min", "backprops_wrt_input"]
    assert all(t["error"] is None and t["min"] is not None for t in f["tensors"])
    r = cli("inspect", out)
    assert r.exit_code == 0 and "Zarr, " in r.stdout, r.output

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    root = zarr.create_array(store=str(tmp_path / "one.zarr"), shape=a.shape, dtype=a.dtype)
    root[...] = a
    (t,) = inspect_json(cli, tmp_path / "one.zarr")["files"][0]["tensors"]
    assert t["name"] == "" and t["shape"] == [3, 4] and t["max"] == 11


def test_the_registry_chooses_formats_by_suffix_and_magic_bytes():
    from qgcli.storage import formats

    for path, name in (("a.npy", "npy"), ("A.NPZ", "npz"), ("a.h5", "h5"), ("a.hdf5", "h5"),
                       ("a.safetensors", "safetensors"), ("a.zarr", "zarr"), ("a.zarr/", "zarr"),
                       ("s3://b/a.zarr", "zarr")):
        assert formats.for_input(path).name == name, path
    for dest, name in (("-", "stdout"), ("d/", "dir"), ("o.zarr/", "zarr"), ("o.h5", "h5")):
        assert formats.for_output(dest).name == name, dest
    assert formats.sniff(b"\x93NUMPY\x01\x00").name == "npy"
    assert formats.sniff(b"PK\x03\x04").name == "npz"
    assert formats.sniff(b"\x89HDF\r\n\x1a\n").name == "h5"
    assert formats.sniff(b"\x08\x00\x00\x00\x00\x00\x00\x00") is None  # safetensors has no magic: never sniffed
    assert formats.head_fits(formats.get("safetensors"), b"\x08\x00\x00\x00\x00\x00\x00\x00")
    assert not formats.head_fits(formats.get("safetensors"), b"PK\x03\x04\x00\x00\x00\x00")
    with pytest.raises(Exception, match="unknown file type"):
        formats.for_input("a.txt")


def _tiny_cases():
    """Arrays of at most TINY values, of every plain dtype, with the values that steer the statistics."""
    rng = np.random.default_rng(42)
    special = [0.0, -0.0, np.nan, np.inf, -np.inf, 1e-45, 6.5e4, 3.4e38, 1.7e308, -1.7e308, 1.0, -2.5]
    floats = [np.float16, np.float32, np.float64, np.dtype(">f4")]
    ints = [np.int8, np.uint8, np.int16, np.int32, np.uint32, np.int64, np.uint64, np.dtype(">i8")]
    shapes = [(0,), (), (1,), (2,), (3,), (2, 3), (7,), (1, 7, 1)]
    for shape in shapes:
        for dtype in floats:
            with np.errstate(over="ignore"):
                for _ in range(5):
                    yield (rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 6, size=shape)).astype(dtype)
                for _ in range(20):  # special values in every position
                    yield np.asarray(rng.choice(special, size=shape)).astype(dtype)
        for dtype in ints:
            info = np.iinfo(dtype)
            yield rng.integers(info.min, info.max, size=shape, dtype=np.dtype(dtype).newbyteorder("="), endpoint=True).astype(dtype)
            yield rng.integers(-1, 2, size=shape).astype(dtype)  # zeros
        yield rng.integers(0, 2, size=shape).astype(bool)


def test_tiny_array_statistics_are_the_general_paths_bit_for_bit(monkeypatch):
    from qgcli.cli.commands import inspect as inspect_cmd

    cases = list(_tiny_cases())
    fast = [inspect_cmd.tensor_stats(a) for a in cases]
    taken = sum(inspect_cmd._tiny_stats(a) is not None for a in cases)
    monkeypatch.setattr(inspect_cmd, "TINY", -1)  # every array through the general path
    for a, got in zip(cases, fast):
        want = inspect_cmd.tensor_stats(a)
        assert json.dumps(got) == json.dumps(want) and [type(v) for v in got.values()] == [
            type(v) for v in want.values()], (a.dtype, a.tolist(), got, want)
    assert len(cases) > 900 and taken > 0.8 * len(cases)  # the tiny path did answer (both signed zeros: not)
    monkeypatch.undo()
    assert inspect_cmd.tensor_stats(np.ones(2, np.complex64))["min"] is None  # complex: counts only, as before


def test_small_reads_of_enum_and_plain_integers_keep_their_own_types(tmp_path):
    """The one-call reads make HDF5's memory type once per dtype; an HDF5 enum's dtype (int8 with h5py's
    metadata) equals plain int8 for NumPy, so each must still read as h5py reads it, whichever comes first."""
    from qgcli.storage import h5

    colour = h5py.enum_dtype({"RED": 0, "GREEN": 1, "BLUE": 2}, basetype="i1")
    path = tmp_path / "enum.h5"
    with h5py.File(path, "w") as f:
        f["plain"] = np.array([0, 7, -3], np.int8)
        f.create_dataset("enum", data=np.array([0, 2, 1], np.int8), dtype=colour)
        f.attrs.create("e", 2, dtype=colour)
        f.attrs["i"] = np.int8(7)
    with h5py.File(path, "r") as f:
        for order in (("plain", "enum"), ("enum", "plain")):
            for name in order:
                ds = f[name]
                fast = h5.read_plain_dataset(ds.id, ds.shape, ds.dtype)
                assert fast.dtype == ds.dtype and fast.tolist() == ds[()].tolist(), name
        assert h5.read_attributes(f) == dict(f.attrs) == {"e": 2, "i": 7}
