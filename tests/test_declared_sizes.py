"""Files that declare more than they hold (issue 41): never-written HDF5 chunks, a metadata-only Zarr store,
an .npz whose zip header lies, --memory-limit on every input format, SIGTERM during a long read.

Each trial runs the real command in a subprocess and measures its peak RSS from the kernel
(``os.wait4``'s rusage of that one child), so a regression that allocates what the file declares fails
here even where the machine has the memory to survive it."""
import io
import json
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time
import zipfile

import h5py
import numpy as np
import pytest

#: Peak RSS a refused or trivial command stays under (Python, NumPy, h5py, rich, matplotlib for plot).
SMALL_MB = 400
MIB = 1 << 20


def _env():
    import qgcli

    parent = os.path.dirname(os.path.dirname(os.path.abspath(qgcli.__file__)))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (parent, os.environ.get("PYTHONPATH")) if p),
                QGCLI_NO_PROGRESS="1")


#: ``python -c LAUNCH ARGS`` runs qgcli's CLI as ``python -m qgcli ARGS`` does, then writes the process's own peak
#: resident size (kB, ``VmHWM``) where QGCLI_TEST_PEAK says, however the CLI ends.  ``os.wait4``'s ``ru_maxrss``
#: of a child starts from the parent's resident size at the fork (Linux carries it across ``exec``): under a
#: pytest process that holds TensorFlow it would read the parent, not the command.
LAUNCH = """
import os, sys
try:
    from qgcli.cli import main
    main(args=sys.argv[1:], prog_name="qgcli")
finally:
    with open("/proc/self/status") as status:
        peak = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    with open(os.environ["QGCLI_TEST_PEAK"], "w") as out:
        out.write(peak)
"""


def qgcli(*args, cwd, term_after=None, address_space=None, timeout=120):
    """Run ``qgcli ARGS``: ``(exit code, stdout, stderr lines, peak RSS in MiB, seconds from SIGTERM to the
    end or None)``.  ``term_after``: send SIGTERM after that many seconds; ``address_space``: RLIMIT_AS in bytes.
    The peak is the child's own where /proc tells it (:data:`LAUNCH`), else ``os.wait4``'s."""
    def limit():
        if address_space is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))

    peak = os.path.join(str(cwd), f".peak-{os.getpid()}")
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, *map(str, args)], cwd=cwd,
                            env=dict(_env(), QGCLI_TEST_PEAK=peak),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limit)
    got = {}
    readers = [threading.Thread(target=lambda k, f: got.__setitem__(k, f.read()), args=(k, f))
               for k, f in (("out", proc.stdout), ("err", proc.stderr))]
    for r in readers:
        r.start()
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    sent = None
    try:
        if term_after is not None:
            time.sleep(term_after)
            sent = time.monotonic()
            os.kill(proc.pid, signal.SIGTERM)  # the child is not reaped before wait4 below
        _, status, usage = os.wait4(proc.pid, 0)
        ended = time.monotonic()
    finally:
        killer.cancel()
    for r in readers:
        r.join()
    proc.stdout.close()
    proc.stderr.close()
    proc.returncode = code = os.waitstatus_to_exitcode(status)
    assert code != -signal.SIGKILL, f"killed after {timeout} s"
    rss = usage.ru_maxrss / 1024
    if os.path.exists(peak):
        with open(peak) as fh:
            rss = int(fh.read()) / 1024
        os.remove(peak)
    return (code, got["out"].decode(), got["err"].decode().strip().splitlines(), rss,
            None if sent is None else ended - sent)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The campaign's files: HDF5 and Zarr declaring 2 x 512 MiB and holding none of it."""
    folder = tmp_path_factory.mktemp("declared")
    n = 512 * MIB // 4
    with h5py.File(folder / "sparse.h5", "w") as f:
        for name in ("inputs", "gradients"):
            f.create_dataset(name, shape=(n,), dtype="f4", chunks=(MIB,))
        f["min"], f["max"] = np.float32(-1), np.float32(1)
    assert os.path.getsize(folder / "sparse.h5") < 8192
    zarr = pytest.importorskip("zarr") if sys.version_info >= (3, 11) else None
    if zarr is not None:
        group = zarr.create_group(str(folder / "empty.zarr"), zarr_format=3)
        for name in ("inputs", "gradients"):
            group.create_array(name, shape=(n // 256, 256), chunks=(4096, 256), dtype="f4")
        group.create_array("min", data=np.float32(-1))
        group.create_array("max", data=np.float32(1))
    return folder


@pytest.mark.parametrize("command", [("report",), ("fakequant", "-o", "out.h5"), ("fakequant-grad", "-o", "out.h5"),
                                     ("plot", "hist", "-o", "hist.png")], ids=lambda c: c[0] if len(c) < 4 else "plot")
def test_never_written_hdf5_chunks_are_refused_without_allocating_them(files, command):
    sub, rest = (command[:2], command[2:]) if command[0] == "plot" else (command[:1], command[1:])
    code, _, lines, rss, _ = qgcli(*sub, "sparse.h5", *rest, cwd=files)
    assert code == 2 and len(lines) == 1, lines
    assert re.search(r"'(inputs|gradients)' declares 512.0 MiB but HDF5 holds 0 of its 128 chunks: 512.0 MiB were "
                     r"never written \(they would read as the fill value\)", lines[0]), lines
    assert rss < SMALL_MB, rss  # 2.6-3.2 GB before
    assert not [p for p in os.listdir(files) if p.startswith((".qgcli", "out", "hist"))]


def test_inspect_lists_never_written_tensors_with_the_reason(files):
    code, out, lines, rss, _ = qgcli("inspect", "sparse.h5", "--json", cwd=files)
    assert code == 0, lines
    tensors = {t["name"]: t for t in json.loads(out)["files"][0]["tensors"]}
    assert tensors["inputs"]["shape"] == [512 * MIB // 4] and "never written" in tensors["inputs"]["error"]
    assert tensors["min"]["error"] is None and tensors["min"]["min"] == -1
    assert rss < SMALL_MB, rss  # 685 MB before


def test_sigterm_ends_inspect_of_a_file_declaring_4_gib_within_a_second(tmp_path):
    with h5py.File(tmp_path / "huge.h5", "w") as f:
        f.create_dataset("inputs", shape=(1 << 30,), dtype="f4", chunks=(MIB,))
    code, _, lines, rss, after = qgcli("inspect", "huge.h5", cwd=tmp_path, term_after=0.5)
    assert after < 1.0 and code in (0, 143), (code, lines)  # it may be done before the signal: 14.8 s before
    assert rss < SMALL_MB


def test_unwritten_data_under_the_bound_reads_as_the_fill_value(cli, tmp_path):
    from qgcli.storage import io
    from qgcli.storage.sparse import UNWRITTEN_BYTES

    n = (UNWRITTEN_BYTES + 8 * MIB) // 4  # over the bound, but only the part never written counts
    with h5py.File(tmp_path / "part.h5", "w") as f:
        ds = f.create_dataset("inputs", shape=(n,), dtype="f4", chunks=(MIB // 4,), fillvalue=0.5)
        ds[:16 * MIB // 4] = 1.0  # 16 MiB written, UNWRITTEN_BYTES - 8 MiB not
    with io.Container.open(str(tmp_path / "part.h5")) as c:
        data = c.read("inputs")
    assert data[0] == 1.0 and data[-1] == 0.5 and data.shape == (n,)
    with h5py.File(tmp_path / "part.h5", "a") as f:
        f.create_dataset("more", shape=(n + 8 * MIB,), dtype="f4", chunks=(MIB // 4,))
        f["more"][:16 * MIB // 4] = 1.0  # unwritten: UNWRITTEN_BYTES + 24 MiB
    r = cli("inspect", tmp_path / "part.h5", "--json")
    errors = {t["name"]: t["error"] for t in json.loads(r.stdout)["files"][0]["tensors"]}
    assert errors["inputs"] is None and "never written" in errors["more"]


def test_a_metadata_only_zarr_store_is_refused_without_allocating(files):
    if not (files / "empty.zarr").exists():
        pytest.skip("zarr 3 needs Python 3.11")
    for args in (("report", "empty.zarr"), ("fakequant-grad", "empty.zarr", "-o", "out.h5"),
                 ("fakequant-grad", "empty.zarr", "-o", "out.zarr")):
        code, _, lines, rss, _ = qgcli(*args, cwd=files)
        assert code == 2 and len(lines) == 1, (args, lines)
        assert "declares 512.0 MiB but the store holds 0 of its 128 chunks" in lines[0]
        assert rss < SMALL_MB, (args, rss)  # 1.1 GB before
    code, out, lines, rss, _ = qgcli("inspect", "empty.zarr", "--json", cwd=files)
    assert code == 0 and rss < SMALL_MB
    assert "never written" in {t["name"]: t["error"] for t in json.loads(out)["files"][0]["tensors"]}["inputs"]


# --- --memory-limit on every input format ------------------------------------------------------------

@pytest.fixture(scope="module")
def big_inputs(tmp_path_factory):
    """256 MiB tensors in a 0.3 MB .npz (deflated zeros) and a 64 MiB .npy."""
    folder = tmp_path_factory.mktemp("memory-limit")
    zeros = np.zeros(64 * MIB, np.float32)
    np.savez_compressed(folder / "big.npz", inputs=zeros, gradients=zeros)
    np.save(folder / "big.npy", zeros[:16 * MIB])
    return folder


@pytest.mark.parametrize("args", [("big.npz",), ("--inputs", "big.npz:inputs", "--gradients", "big.npy")],
                         ids=["npz", "npz+npy"])
def test_memory_limit_holds_for_every_input_format(big_inputs, args):
    # A compressed member is inflated in order, never in blocks: refused.  (.npy, stored .npz members and
    # .safetensors stream: tests/test_flat_streaming.py.)
    code, _, lines, rss, _ = qgcli("fakequant-grad", *args, "--min", "-1", "--max", "1", "-o", "out.h5",
                                   "--memory-limit", "16M", cwd=big_inputs)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("Error: --memory-limit: the inputs need about ") and "more than 16.0 MiB" in lines[0]
    assert "big.npz:inputs) cannot be streamed from disk (a compressed .npz member" in lines[0], lines
    assert rss < SMALL_MB, rss  # 2.1 GB for a 1 GiB tensor before
    assert not os.path.exists(big_inputs / "out.h5")


def test_a_memory_limit_that_fits_still_runs(cli, big_inputs, tmp_path):
    r = cli("fakequant-grad", "--inputs", big_inputs / "big.npy", "--gradients", big_inputs / "big.npy",
            "--min", "-1", "--max", "1", "-o", tmp_path / "out.npz", "--memory-limit", "2G", "-q")
    assert r.exit_code == 0, r.output


# --- an .npz whose zip header lies --------------------------------------------------------------------

def _lying_npz(path, *, stored=False):
    """An .npz of ~200 bytes whose member's .npy header and zip sizes both promise ~4 GB."""
    n = (2**32 - 4096) // 4
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (n,)})
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED) as z:
        z.writestr("inputs.npy", header.getvalue() + b"\0" * 100)
    raw = bytearray(buf.getvalue())
    size = len(header.getvalue()) + 4 * n
    for signature, offset in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):  # the uncompressed size, both headers
        i = raw.find(signature)
        struct.pack_into("<I", raw, i + offset, size)
    path.write_bytes(bytes(raw))
    assert len(raw) < 400
    return path


@pytest.mark.parametrize("stored", [False, True], ids=["deflated", "stored"])
def test_an_npz_promising_4_gb_is_corrupt_not_out_of_memory(tmp_path, stored):
    _lying_npz(tmp_path / "lie.npz", stored=stored)
    # Under a 1.5 GB address space NumPy's 4 GB allocation failed: "out of memory", exit 1, before.
    code, _, lines, rss, _ = qgcli("fakequant", "lie.npz", "--min", "-1", "--max", "1", "-o", "out.h5",
                                   cwd=tmp_path, address_space=1536 * MIB)
    assert code == 2 and len(lines) == 1, lines
    assert "lie.npz: key 'inputs': corrupt or truncated: its zip entry promises 4294963" in lines[0]
    assert rss < SMALL_MB


def test_an_npz_member_beyond_its_archive_is_truncated(tmp_path):
    np.savez(tmp_path / "ok.npz", inputs=np.arange(1000, dtype=np.float32))
    data = (tmp_path / "ok.npz").read_bytes()
    cut = data.find(b"PK\x01\x02")  # keep the central directory, drop the end of the member's data
    (tmp_path / "cut.npz").write_bytes(data[:200] + data[cut:])
    from qgcli.storage import io
    from qgcli.errors import FileFormatError

    with pytest.raises(FileFormatError, match="corrupt|truncated|cannot be read"):
        with io.Container.open(str(tmp_path / "cut.npz")) as c:
            c.read("inputs")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("QGCLI_LONG", "") in ("", "0"), reason="long campaign: set QGCLI_LONG=1")
def test_sigterm_ends_a_long_read_of_written_chunks_within_a_second(tmp_path):
    rng = np.random.default_rng(0)
    with h5py.File(tmp_path / "gz.h5", "w") as f:
        ds = f.create_dataset("inputs", shape=(1 << 28,), dtype="f4", chunks=(MIB,), compression="gzip")
        block = rng.standard_normal(1 << 22).astype(np.float32)
        for i in range(0, 1 << 28, 1 << 22):
            ds[i:i + (1 << 22)] = block
    for command in ("inspect", "report"):
        code, _, lines, _, after = qgcli(command, "gz.h5", cwd=tmp_path, term_after=3)
        assert code == 143 and lines == ["Error: terminated by SIGTERM; no output was left half-written"]
        assert after < 1.0, (command, after)  # 6.4 s before
