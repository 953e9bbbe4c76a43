"""Formats and names (#41 item 5): safetensors' float8 and BF16 tensors read through ml_dtypes (the packed 4- and
6-bit ones refused in one line), a FIFO or device named as an input refused at once, names from a file drawn in
figures without control characters (no raw ESC/BEL on stderr, also through matplotlib's "Glyph missing"
warnings), and one rule for a closed stdout pipe: exit 141, nothing printed, whatever was being written."""
import json
import os
import struct
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import ROOT

ml_dtypes = pytest.importorskip("ml_dtypes")
f32 = np.float32
EVIL = "\x1b]0;pwned\x07"


def write_safetensors(path, tensors):
    """A safetensors file written by hand (the package's NumPy writer cannot make float8): name -> (dtype
    string, shape, raw bytes)."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return str(path)


def refused_by_an_old_package(path, dtype, run):
    """Whether the installed safetensors is too old to open a header with ``dtype`` (the CI floor, 0.4): then
    qgcli must refuse the file in one line naming the dtype, and ``run()`` (the command's output) is checked."""
    from safetensors import safe_open

    try:
        safe_open(str(path), framework="np")
        return False
    except Exception:  # noqa: BLE001 - the package's header error for a dtype it does not know
        output = run()
        assert output.count("\n") == 1 and dtype in output and "pip install -U safetensors" in output, output
        return True


SMALL_FLOATS = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
                "F8_E8M0": "float8_e8m0fnu", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz"}


def _error_line(call):
    from qgcli.errors import QgcliError

    try:
        call()
    except QgcliError as exc:
        return str(exc) + "\n"
    raise AssertionError("not refused")


@pytest.mark.parametrize("dtype", sorted(SMALL_FLOATS))
def test_safetensors_small_floats_read_through_ml_dtypes(tmp_path, dtype):
    pytest.importorskip("safetensors")
    from qgcli.storage import io

    kind = getattr(ml_dtypes, SMALL_FLOATS[dtype])
    values = np.linspace(0.25 if dtype == "F8_E8M0" else -3, 3, 24).reshape(2, 3, 4).astype(kind)  # E8M0: no sign
    path = write_safetensors(tmp_path / "t.safetensors", {"x": (dtype, values.shape, values.tobytes()),
                                                          "y": ("F32", (2,), np.ones(2, f32).tobytes())})
    if refused_by_an_old_package(path, dtype, lambda: _error_line(lambda: io.load_spec(io.parse_spec(f"{path}:x")))):
        return
    got = io.load_spec(io.parse_spec(f"{path}:x"))
    assert got.dtype == values.dtype and got.shape == values.shape and got.tobytes() == values.tobytes()
    np.testing.assert_array_equal(io.load_spec(io.parse_spec(f"{path}:y")), np.ones(2, f32))


def test_bf16_safetensors_compute_as_bf16_hdf5_does(cli, tmp_path):
    pytest.importorskip("safetensors")
    x = np.linspace(-2, 2, 12).astype(ml_dtypes.bfloat16)
    st = write_safetensors(tmp_path / "b.safetensors", {
        "inputs": ("BF16", (12,), x.tobytes()), "gradients": ("F32", (12,), np.ones(12, f32).tobytes()),
        "min": ("F32", (), f32(-1).tobytes()), "max": ("F32", (), f32(1).tobytes())})
    h5 = tmp_path / "b.h5"
    with h5py.File(h5, "w") as f:
        f["inputs"] = x.view(np.uint16)
        f["inputs"].attrs["dtype"] = "bfloat16"  # qgcli's bfloat16 tag
        f["gradients"], f["min"], f["max"] = np.ones(12, f32), f32(-1), f32(1)
    for source, out in ((st, "s.npz"), (h5, "h.npz")):
        result = cli("fakequant-grad", source, "-o", tmp_path / out, "-q")
        assert result.exit_code == 0, result.output
    with np.load(tmp_path / "s.npz") as a, np.load(tmp_path / "h.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        for k in a.files:
            assert a[k].tobytes() == b[k].tobytes(), k


@pytest.mark.parametrize("dtype,nbytes", [("F4", 2), ("F6_E2M3", 3), ("F6_E3M2", 3)])
def test_packed_sub_byte_safetensors_are_refused_in_one_line(cli, tmp_path, dtype, nbytes):
    pytest.importorskip("safetensors")
    path = write_safetensors(tmp_path / "p.safetensors", {"x": (dtype, (4,), b"\x12" * nbytes)})
    if refused_by_an_old_package(path, dtype, lambda: cli("inspect", path).output):
        return
    result = cli("fakequant", "--inputs", f"{path}:x", "--min", "-1", "--max", "1", "-o", tmp_path / "o.npy")
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert dtype in result.output and "packed" in result.output and "internal" not in result.output
    inspected = cli("inspect", path)
    assert inspected.exit_code == 0 and "packed" in inspected.output


@pytest.mark.parametrize("command", [["inspect"], ["report"], ["fakequant-grad", "-o", "o.h5"],
                                     ["plot", "hist", "-o", "h.png"]])
def test_a_fifo_named_as_input_is_refused_at_once(tmp_path, command):
    fifo = tmp_path / "in.h5"
    os.mkfifo(fifo)
    args = [command[0], *command[1:2], str(fifo), *command[2:]] if command[0] == "plot" else \
        [command[0], str(fifo), *command[1:]]
    proc = subprocess.run([sys.executable, "-m", "qgcli", *args], cwd=tmp_path, capture_output=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    err = proc.stderr.decode()
    assert proc.returncode == 2 and err.count("\n") == 1 and "is a FIFO" in err, err
    assert sorted(os.listdir(tmp_path)) == ["in.h5"]


def test_a_fifo_inside_a_zarr_store_is_not_read(cli, tmp_path):
    zarr = pytest.importorskip("zarr")
    group = zarr.create_group(str(tmp_path / "s.zarr"), zarr_format=3)
    group.create_array("x", data=np.ones((2, 2), f32), compressors=None)
    chunk = tmp_path / "s.zarr" / "x" / "c" / "0" / "0"
    os.unlink(chunk)
    os.mkfifo(chunk)
    store = tmp_path / "s.zarr"
    result = cli("fakequant", "--inputs", f"{store}:x", "--min", "-1", "--max", "1", "-o", tmp_path / "o.npy")
    assert result.exit_code == 2 and "not a regular file" in result.output, result.output


# --- names drawn in figures --------------------------------------------------------------------------------

@pytest.fixture
def evil_run(tmp_path):
    path = tmp_path / "run.h5"
    with h5py.File(path, "w") as f:
        for name in ("ok", EVIL):
            g = f.create_group(name)
            g.attrs["op"] = "FakeQuantWithMinMaxVars"
            g["inputs"], g["gradients"] = np.linspace(-2, 2, 64, dtype=f32), np.ones(64, f32)
            g["min"], g["max"] = f32(-1), f32(1)
    return str(path)


@pytest.mark.parametrize("args", [["plot", "staircase", "RUN", "-q", "-o", "figs/"],
                                  ["plot", "layers", "RUN", "-q", "-o", "l.png"],
                                  ["report", "RUN", "-q", "--html", "r.html"]])
def test_names_drawn_in_figures_put_no_control_character_on_stderr(evil_run, tmp_path, args):
    args = [evil_run if a == "RUN" else a for a in args]
    proc = subprocess.run([sys.executable, "-m", "qgcli", *args], cwd=tmp_path, capture_output=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"\x1b" not in proc.stderr and b"\x07" not in proc.stderr and b"Glyph" not in proc.stderr, proc.stderr


def test_every_text_of_a_figure_is_made_printable():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import io
    import warnings

    import matplotlib.pyplot as plt

    from qgcli.storage.figures import drawn_printable

    fig, ax = plt.subplots()
    ax.set_title(f"layer {EVIL}\nsecond line")
    ax.set_yticks([0, 1], ["ok", EVIL])
    ax.bar(["a", f"b{EVIL}"], [1, 2])
    ax.legend([EVIL])
    drawn_printable(fig)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a "Glyph 27 missing" warning would fail here
        fig.savefig(io.BytesIO(), format="png")
    texts = [t.get_text() for t in fig.findobj(matplotlib.text.Text)]
    assert not any("\x1b" in t or "\x07" in t for t in texts)
    assert "layer \\x1b]0;pwned\\x07\nsecond line" in texts
    plt.close(fig)


# --- a closed stdout pipe: one rule ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def big_bundle(tmp_path_factory):
    """Outputs of 3 x 4 MiB: far more than a pipe holds, so the writer meets the closed pipe."""
    path = tmp_path_factory.mktemp("pipe") / "big.h5"
    with h5py.File(path, "w") as f:
        f["inputs"] = np.random.default_rng(0).standard_normal((256, 4096), dtype=f32)
        f["gradients"], f["min"], f["max"] = np.ones((256, 4096), f32), f32(-1), f32(1)
        for i in range(2000):  # a long inspect listing
            f[f"extra/d{i}"] = np.arange(3.0)
    return str(path)


# A reader that takes one byte then goes: only for outputs larger than a pipe holds (a small output is
# written whole before the reader leaves, and that run rightly succeeds).
CLOSED_PIPE_CASES = [(["fakequant-grad", "BIG", "-o", "-", "-q"], "reads-one-byte"),  # an -o - stream
                     (["inspect", "BIG"], "reads-one-byte"),  # a table printed through rich
                     (["plot", "hist", "BIG", "-o", "-", "-q"], "closed-at-once"),  # a figure
                     (["report", "BIG", "--json"], "closed-at-once")]  # JSON


@pytest.mark.parametrize("args,reader", CLOSED_PIPE_CASES)
def test_a_closed_stdout_pipe_is_exit_141_and_silent(big_bundle, args, reader):
    args = [big_bundle if a == "BIG" else a for a in args]
    proc = subprocess.Popen([sys.executable, "-m", "qgcli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=ROOT))
    if reader == "reads-one-byte":
        assert proc.stdout.read(1)
    proc.stdout.close()
    err = proc.stderr.read()
    proc.stderr.close()
    code = proc.wait(timeout=300)
    assert code == 141 and b"Traceback" not in err and b"Error" not in err, (code, err)
