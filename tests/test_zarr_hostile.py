"""Hostile Zarr stores (#41): nothing is read from outside a store, through any symbolic link (a chunk file, an
array's directory), for local stores and fsspec stores on the local disk; a zero chunk shape, an output inside
an input store and a group name Zarr cannot hold are one-line refusals, never an internal error."""
import json
import os

import h5py
import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

f32 = np.float32
SECRET = np.full((3, 4), 7.0, f32)  # what the outside file holds: it must never be read as a tensor


def make_store(path, fmt=3):
    """A FakeQuantWithMinMaxVars bundle, stored raw (no codec), so that any file's bytes would read as data."""
    group = zarr.create_group(str(path), zarr_format=fmt)
    group.create_array("inputs", data=np.linspace(-2, 2, 12, dtype=f32).reshape(3, 4), chunks=(3, 4),
                       compressors=None)
    group.create_array("gradients", data=np.ones((3, 4), f32), chunks=(3, 4), compressors=None)
    group.create_array("min", data=np.array(-1, f32), compressors=None)
    group.create_array("max", data=np.array(1, f32), compressors=None)
    return str(path)


def chunk_file(store, fmt, name="inputs"):
    return os.path.join(store, name, "c", "0", "0") if fmt == 3 else os.path.join(store, name, "0.0")


def refused(result, *words, code=2):
    assert result.exit_code == code, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), result.output
    assert "internal error" not in lines[0] and "Traceback" not in result.output
    return lines[0]


@pytest.fixture(params=[2, 3], ids=["zarr-v2", "zarr-v3"])
def fmt(request):
    return request.param


@pytest.fixture(params=["path", "local-url"])
def address(request):
    """How the store is named: a plain path (zarr's LocalStore) or an fsspec URL on the local disk."""
    return (lambda p: str(p)) if request.param == "path" else (lambda p: f"local://{os.path.abspath(p)}")


def test_a_chunk_linked_outside_the_store_is_never_read(cli, tmp_path, fmt, address):
    store = make_store(tmp_path / "s.zarr", fmt)
    secret = tmp_path / "elsewhere" / "secret.bin"
    secret.parent.mkdir()
    secret.write_bytes(SECRET.tobytes())  # exactly a chunk's bytes: read through the link, it is a valid chunk
    chunk = chunk_file(store, fmt)
    assert os.path.getsize(chunk) == SECRET.nbytes
    os.unlink(chunk)
    os.symlink(secret, chunk)
    name = address(store)
    assert cli("report", address(make_store(tmp_path / "plain.zarr", fmt))).exit_code == 0  # the same, unlinked
    refused(cli("report", name), "outside the store", "inputs")
    out = tmp_path / "o.h5"
    refused(cli("fakequant-grad", name, "-o", out), "outside the store")
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if n.startswith(".qgcli-")]
    inspected = cli("inspect", name)  # the other tensors are listed; this one is said not to be read
    row = [line for line in inspected.output.splitlines() if line.startswith("inputs ")]
    assert inspected.exit_code == 0 and "unknown" in row[0] and "outside the store" in inspected.output


def test_an_array_directory_linked_outside_the_store_is_never_read(cli, tmp_path, fmt, address):
    elsewhere = make_store(tmp_path / "elsewhere.zarr", fmt)
    store = make_store(tmp_path / "s.zarr", fmt)
    import shutil

    shutil.rmtree(os.path.join(store, "gradients"))
    os.symlink(os.path.join(elsewhere, "gradients"), os.path.join(store, "gradients"))
    name = address(store)
    refused(cli("fakequant-grad", name, "-o", tmp_path / "o.h5"), "outside the store", "gradients")
    refused(cli("inspect", name), "outside the store")
    assert not (tmp_path / "o.h5").exists()


def test_links_inside_the_store_and_a_linked_store_are_read(cli, tmp_path, fmt):
    """The rule is where a path resolves, not whether it is a link: a store named through a link, and a chunk
    linked to another file of the same store, read as before."""
    store = make_store(tmp_path / "real.zarr", fmt)
    spare = os.path.join(store, "spare.bin")
    os.rename(chunk_file(store, fmt, "gradients"), spare)
    os.symlink(spare, chunk_file(store, fmt, "gradients"))
    os.symlink(store, tmp_path / "link.zarr")
    result = cli("fakequant-grad", tmp_path / "link.zarr", "-o", tmp_path / "o.h5", "-q")
    assert result.exit_code == 0, result.output
    with h5py.File(tmp_path / "o.h5", "r") as f:
        assert f["backprops_wrt_input"].shape == (3, 4)


@pytest.mark.parametrize("chunks", [[0, 4], [3, 0]])
def test_a_zero_chunk_shape_is_refused_in_one_line(cli, tmp_path, fmt, chunks):
    store = make_store(tmp_path / "s.zarr", fmt)
    meta = os.path.join(store, "inputs", "zarr.json" if fmt == 3 else ".zarray")
    with open(meta) as fh:
        doc = json.load(fh)
    if fmt == 3:
        doc["chunk_grid"]["configuration"]["chunk_shape"] = chunks
    else:
        doc["chunks"] = chunks
    with open(meta, "w") as fh:
        json.dump(doc, fh)
    refused(cli("report", store), "chunk shape", "at least 1")
    refused(cli("fakequant-grad", store, "-o", tmp_path / "o.zarr"), "chunk shape")
    result = cli("inspect", store)
    assert "chunk shape" in result.output and "internal error" not in result.output
    assert not (tmp_path / "o.zarr").exists()


@pytest.mark.parametrize("target", ["x.h5", "x.npz", "sub.zarr", "inputs/x.npy", "d/", "inputs/"])
def test_an_output_inside_an_input_store_is_refused(cli, tmp_path, target):
    store = make_store(tmp_path / "s.zarr")
    before = sorted(os.path.relpath(os.path.join(d, f), store) for d, _, fs in os.walk(store) for f in fs)
    refused(cli("fakequant-grad", store, "-o", os.path.join(store, target), "--force"), "inside the input")
    os.symlink(store, tmp_path / "alias")  # also when the store is reached through a link
    refused(cli("fakequant-grad", store, "-o", f"{tmp_path}/alias/{target}"), "inside the input")
    after = sorted(os.path.relpath(os.path.join(d, f), store) for d, _, fs in os.walk(store) for f in fs)
    assert after == before


def test_a_figure_inside_an_input_store_is_refused(cli, tmp_path):
    store = make_store(tmp_path / "s.zarr")
    refused(cli("plot", "hist", store, "-o", os.path.join(store, "h.png")), "inside the input")
    assert not os.path.exists(os.path.join(store, "h.png"))


def test_a_group_zarr_cannot_name_is_refused_before_any_work(cli, tmp_path):
    run = tmp_path / "run.h5"
    with h5py.File(run, "w") as f:
        for name in ("ok", ".."):  # HDF5 takes '..' as a plain name
            g = f.create_group(name)
            g.attrs["op"] = "FakeQuantWithMinMaxVars"
            g["inputs"], g["gradients"] = np.linspace(-2, 2, 6, dtype=f32), np.ones(6, f32)
            g["min"], g["max"] = f32(-1), f32(1)
    refused(cli("fakequant-grad", run, "-o", tmp_path / "out.zarr"), "'..'", "Zarr")
    assert sorted(os.listdir(tmp_path)) == ["run.h5"]
    result = cli("fakequant-grad", run, "-o", tmp_path / "out.h5", "-q")  # .h5 keeps every name
    assert result.exit_code == 0, result.output
