"""--memory-limit below .npy, stored .npz members and .safetensors inputs streams them (issue 41, item 3).

They are plain bytes at a known offset of their file (:mod:`qgcli.storage.flat`): the block executor reads
row blocks of them with os.preadv, never the whole tensor.  Each trial runs the real command in a subprocess
with 64 MiB tensors and ``--memory-limit 16M``, measures its own peak RSS (``VmHWM``, see
``test_declared_sizes.LAUNCH``) and compares every output bit for bit with the in-memory run of the same
command.  A compressed .npz member cannot be streamed: still refused in one line (tests/test_declared_sizes.py)."""
import io
import json
import os
import struct
import zipfile

import h5py
import numpy as np
import pytest

from test_declared_sizes import MIB, qgcli

#: Peak RSS a streamed run may add to the same command's on a tiny input: the limit, and as much again
#: for the reused read buffers, the read-ahead and the output's chunk writer, all sized from it.
LIMIT_MB = 16


def _save_stored_npz(path, **arrays):
    """np.savez's layout (stored members, zip64 local headers) through the same zipfile calls."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for key, value in arrays.items():
            with zf.open(key + ".npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asarray(value), allow_pickle=False)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """64 MiB float32 tensors as .npy, in a stored .npz and in a .safetensors file, and tiny ones as .npy."""
    folder = tmp_path_factory.mktemp("flat")
    rng = np.random.default_rng(41)
    x = rng.standard_normal((4096, 8, 8, 64), dtype=np.float32) * 1.5  # NHWC, 16 Mi values, 64 KiB an item
    g = rng.standard_normal(x.shape, dtype=np.float32)
    x.reshape(-1)[::997] = np.nan  # NaNs and values on the grid's edges go through the kernels too
    np.save(folder / "x.npy", x)
    np.save(folder / "g.npy", g)
    np.save(folder / "tiny_x.npy", x[:1, :1])
    np.save(folder / "tiny_g.npy", g[:1, :1])
    np.save(folder / "mean.npy", np.nanmean(x, axis=(0, 1, 2)))
    np.save(folder / "var.npy", np.nanvar(x, axis=(0, 1, 2)) + 0.5)
    _save_stored_npz(folder / "stored.npz", inputs=x, gradients=g, min=np.float32(-1.25), max=np.float32(2.5))
    try:
        from safetensors.numpy import save_file

        save_file({"inputs": x, "gradients": g}, str(folder / "t.safetensors"))
    except ImportError:
        pass
    return folder


def _outputs(path):
    with h5py.File(path, "r") as f:
        return {name: f[name][()] for name in f}


def _same_bits(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].shape == b[name].shape and a[name].dtype == b[name].dtype, name
        assert a[name].tobytes() == b[name].tobytes(), name


def _run(folder, out, *args, limit=None):
    code, _, lines, rss, _ = qgcli(*args, "-o", out, "-q", *(("--memory-limit", limit) if limit else ()), cwd=folder)
    assert code == 0, lines
    return rss


#: command -> (its options, the operands of the in-memory run (.npy), of the streamed runs by format, of the
#: baseline run on a tiny input)
CASES = {
    "fakequant-grad": (
        ("--min", "-1.25", "--max", "2.5"),
        ("--inputs", "x.npy", "--gradients", "g.npy"),
        {"npy": ("--inputs", "x.npy", "--gradients", "g.npy"), "npz": ("stored.npz",),
         "safetensors": ("t.safetensors",)},
        ("--inputs", "tiny_x.npy", "--gradients", "tiny_g.npy")),
    "fakequant": (
        ("--min", "-1.25", "--max", "2.5"),
        ("--inputs", "x.npy"),
        {"npz": ("--inputs", "stored.npz:inputs"), "safetensors": ("--inputs", "t.safetensors:inputs")},
        ("--inputs", "tiny_x.npy")),
    "bn-grad": (
        ("--scale", ",".join(["1.5"] * 64), "--reserve-space-1", "mean.npy", "--reserve-space-2", "var.npy"),
        ("--x", "x.npy", "--y-backprop", "g.npy"),
        {"npy": ("--x", "x.npy", "--y-backprop", "g.npy"), "npz": ("--x", "stored.npz:inputs", "--y-backprop",
                                                                  "stored.npz:gradients"),
         "safetensors": ("--x", "t.safetensors:inputs", "--y-backprop", "t.safetensors:gradients")},
        ("--x", "tiny_x.npy", "--y-backprop", "tiny_g.npy")),
}


@pytest.mark.parametrize("command", list(CASES))
def test_flat_inputs_over_the_limit_stream_with_the_in_memory_bits(folder, command):
    options, in_memory, streamed, tiny = CASES[command]
    base = _run(folder, f"{command}-tiny.h5", command, *options, *tiny)
    memory = _run(folder, f"{command}-memory.h5", command, *options, *in_memory)
    # in memory: a whole 64 MiB tensor more (fakequant writes its outputs over the inputs it read, so one tensor
    # may be all; the RSS of the tiny run's start-up varies by a few MiB), above what streaming may use
    assert memory > base + 56, (base, memory)
    expected = _outputs(folder / f"{command}-memory.h5")
    for fmt, args in streamed.items():
        if fmt == "safetensors" and not (folder / "t.safetensors").exists():
            continue  # safetensors is not installed
        out = f"{command}-{fmt}.h5"
        rss = _run(folder, out, command, *options, *args, limit=f"{LIMIT_MB}M")
        print(f"{command} {fmt}: peak RSS {rss:.0f} MiB streamed, {memory:.0f} MiB in memory, {base:.0f} MiB on a "
              "tiny input")
        assert rss < base + 2 * LIMIT_MB, (fmt, base, rss, memory)
        _same_bits(_outputs(folder / out), expected)


def test_a_per_channel_gradient_streams_from_npy_with_the_in_memory_bits(folder):
    channels = ("--min", ",".join(["-1"] * 64), "--max", ",".join(["1.5"] * 64))
    args = ("fakequant-grad", "--inputs", "x.npy", "--gradients", "g.npy", *channels)
    memory = _run(folder, "chip-memory.h5", *args)
    rss = _run(folder, "chip-streamed.h5", *args, limit=f"{LIMIT_MB}M")
    _same_bits(_outputs(folder / "chip-streamed.h5"), _outputs(folder / "chip-memory.h5"))
    assert rss < memory - 64, (rss, memory)


# --- what is plain bytes, and where -------------------------------------------------------------------

def _flat(path, key=None):
    from qgcli.storage import io as qio

    with qio.Container.open(str(path)) as container:
        return container.flat(key)


@pytest.mark.parametrize("zip64", [False, True])
def test_a_stored_member_is_found_at_its_offset(tmp_path, zip64):
    values = np.arange(3 * 5, dtype=np.float64).reshape(3, 5)
    with zipfile.ZipFile(tmp_path / "a.npz", "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("pad.npy", b"\0" * 1000)  # the member does not start the archive
        with zf.open("v.npy", "w", force_zip64=zip64) as member:
            np.lib.format.write_array(member, values)
    tensor = _flat(tmp_path / "a.npz", "v")
    try:
        assert tensor.shape == (3, 5) and tensor.dtype == np.float64
        assert tensor[()].tobytes() == values.tobytes()
    finally:
        tensor.close()


def test_what_is_not_plain_bytes_is_not_streamed(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.save(tmp_path / "f.npy", np.asfortranarray(x))
    np.save(tmp_path / "be.npy", x.astype(">f4"))
    np.savez_compressed(tmp_path / "c.npz", inputs=x)
    assert _flat(tmp_path / "f.npy") is None
    assert _flat(tmp_path / "be.npy") is None
    assert _flat(tmp_path / "c.npz", "inputs") is None
    np.save(tmp_path / "ok.npy", x)
    tensor = _flat(tmp_path / "ok.npy")
    assert tensor[()].tobytes() == x.tobytes()
    tensor.close()


def test_a_safetensors_tensor_is_found_at_its_header_offsets(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    a, b = np.arange(7, dtype=np.float16), np.arange(6, dtype=np.int32).reshape(2, 3)
    st.save_file({"a": a, "b": b}, str(tmp_path / "t.safetensors"))
    for key, value in (("a", a), ("b", b)):
        tensor = _flat(tmp_path / "t.safetensors", key)
        assert tensor.shape == value.shape and tensor[()].tobytes() == value.tobytes()
        tensor.close()


def test_a_truncated_npy_over_the_limit_is_one_line(tmp_path):
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (64 * MIB,)})
    (tmp_path / "t.npy").write_bytes(header.getvalue() + b"\0" * 4096)
    code, _, lines, _, _ = qgcli("fakequant-grad", "--inputs", "t.npy", "--gradients", "t.npy", "--min", "-1",
                                   "--max", "1", "-o", "out.h5", "--memory-limit", "16M", cwd=tmp_path)
    assert code == 2 and len(lines) == 1 and "truncated" in lines[0], lines
    assert not os.path.exists(tmp_path / "out.h5")


def test_a_member_whose_npy_header_outruns_its_zip_entry_is_truncated(tmp_path):
    values = np.zeros(1024, np.float32)
    buf = io.BytesIO()
    _save_stored_npz(buf, inputs=values, pad=np.zeros(4096, np.uint8))
    raw = bytearray(buf.getvalue())
    at = raw.find(b"(1024,)")
    raw[at:at + 7] = b"(2048,)"  # the .npy header now promises 8 KiB inside a 4 KiB entry; the file goes on
    (tmp_path / "b.npz").write_bytes(bytes(raw))
    from qgcli.errors import FileFormatError

    with pytest.raises(FileFormatError, match="truncated"):
        _flat(tmp_path / "b.npz", "inputs")


def test_bf16_safetensors_stream_as_the_tagged_hdf5_bfloat16_runs_in_memory(tmp_path, cli):
    """BF16 is streamed as its uint16 codes tagged bfloat16, as qgcli keeps bfloat16 in HDF5: bn-grad over the
    limit from a .safetensors file gives the bits of bn-grad in memory on the tagged .h5 of the same codes."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    pytest.importorskip("safetensors")
    rng = np.random.default_rng(7)
    x, dy = (rng.standard_normal((2048, 8, 8, 32), dtype=np.float32).astype(ml_dtypes.bfloat16) for _ in range(2))
    stats = {"scale": np.full(32, 0.75, np.float32), "reserve_space_1": x.astype(np.float32).mean((0, 1, 2)),
             "reserve_space_2": x.astype(np.float32).var((0, 1, 2))}
    with h5py.File(tmp_path / "bf.h5", "w") as f:
        for name, value in (("x", x), ("y_backprop", dy)):
            f.create_dataset(name, data=value.view(np.uint16)).attrs["dtype"] = "bfloat16"
        for name, value in stats.items():
            f[name] = value
            np.save(tmp_path / f"{name}.npy", value)
    header = json.dumps({"x": {"dtype": "BF16", "shape": list(x.shape), "data_offsets": [0, x.nbytes]},
                         "y_backprop": {"dtype": "BF16", "shape": list(dy.shape),
                                        "data_offsets": [x.nbytes, 2 * x.nbytes]}}).encode()
    (tmp_path / "bf.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + x.tobytes() + dy.tobytes())
    r = cli("bn-grad", tmp_path / "bf.h5", "-o", tmp_path / "memory.h5", "-q")
    assert r.exit_code == 0, r.output
    r = cli("bn-grad", "--x", f"{tmp_path}/bf.safetensors:x", "--y-backprop", f"{tmp_path}/bf.safetensors:y_backprop",
            *(a for name in stats for a in (f"--{name.replace('_', '-')}", tmp_path / f"{name}.npy")),
            "-o", tmp_path / "streamed.h5", "-q", "--memory-limit", "2M", "--json")
    assert r.exit_code == 0, r.output
    assert "streamed from disk" in r.output
    _same_bits(_outputs(tmp_path / "streamed.h5"), _outputs(tmp_path / "memory.h5"))
    with h5py.File(tmp_path / "streamed.h5") as f:
        assert f["x_backprop"].attrs["dtype"] == "bfloat16"


def test_a_streamed_npy_needs_an_h5_output(folder):
    code, _, lines, rss, _ = qgcli("fakequant-grad", "--inputs", "x.npy", "--gradients", "g.npy", "--min", "-1",
                                   "--max", "1", "-o", "refused.npz", "--memory-limit", "16M", cwd=folder)
    assert code == 2 and lines == ["Error: --output: the inputs need about 256.0 MiB, more than --memory-limit "
                                   "(16.0 MiB); streaming writes .h5 outputs only"], lines
    assert not os.path.exists(folder / "refused.npz") and rss < 100
