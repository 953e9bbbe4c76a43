"""qgcli.capture.runfile_writer as a step runs: groups go to the file as they come, steps are linked in whole
(a SIGKILL during an append leaves the earlier steps readable), appending copies nothing, each tensor is
stored once (bit-for-bit references as digests that `qgcli verify` checks), and the options that choose
what to keep (layers=, keep=, compression=)."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import h5py
import numpy as np
import pytest

from qgcli import ops
from qgcli.capture.runfile_writer import RunFileWriter, digest
from qgcli.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fake_quant(w, name, x, g, *, digest=True, weight=False):
    lo, hi = np.float32(-1.0), np.float32(0.8)
    dx, dmin, dmax = ops.fake_quant_with_min_max_vars_gradient(g, x, lo, hi, num_bits=8, narrow_range=False)
    out = ops.fake_quant_with_min_max_vars(x, lo, hi, num_bits=8, narrow_range=False)
    return w.add(name, "FakeQuantWithMinMaxVars", {"inputs": x, "min": lo, "max": hi, "gradients": g},
                 {"num_bits": 8, "narrow_range": False},
                 {"outputs": out, "backprops_wrt_input": dx, "backprop_wrt_min": dmin, "backprop_wrt_max": dmax},
                 digest=("outputs", "backprops_wrt_input") if digest else (), weight=weight)


def _arrays(seed, shape=(64, 256)):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)


def test_digests_store_each_tensor_once_and_verify_checks_them(tmp_path, runner):
    path = str(tmp_path / "run.h5")
    x, g = _arrays(0)
    with RunFileWriter(path, step=1) as w:
        _fake_quant(w, "net.act", x, g)
        _fake_quant(w, "net.out", g, x)
    with h5py.File(path) as f:  # one table per step, not a dataset (and 3 attributes) per digest
        table = f["step_000001/qgcli_digests"]
        assert table.attrs["digest"] == "sha256" and table.shape == (4,)
        rows = {(r["group"].decode(), r["name"].decode()): r for r in table[()]}
        assert sorted(rows) == [("net/act", "backprops_wrt_input"), ("net/act", "outputs"),
                                ("net/out", "backprops_wrt_input"), ("net/out", "outputs")]
        out = ops.fake_quant_with_min_max_vars(g, np.float32(-1.0), np.float32(0.8), num_bits=8, narrow_range=False)
        row = rows["net/out", "outputs"]
        assert bytes(row["sha256"]) == bytes(digest(out)) and tuple(row["shape"]) == g.shape
        assert row["dtype"].decode() == "<f4"
        ref = f["step_000001/net/act/reference"]
        assert sorted(ref) == ["backprop_wrt_max", "backprop_wrt_min"] and ref["backprop_wrt_min"].shape == ()
    assert os.path.getsize(path) < 1.1 * 2 * (x.nbytes + g.nbytes) + 20_000
    r = runner.invoke(main, ["verify", path, "--json"])
    assert r.exit_code == 0, r.output
    layers = json.loads(r.stdout)["layers"]
    assert [la["status"] for la in layers] == ["identical"] * 2
    assert all(la["outputs"][k]["digest"] == "sha256" for la in layers for k in ("outputs", "backprops_wrt_input"))
    with h5py.File(path, "a") as f:  # a digest that differs by one bit fails its layer, and only it
        table = f["step_000001/qgcli_digests"]
        rows = table[()]
        i = [n for n, r in enumerate(rows) if (r["group"], r["name"]) == (b"net/out", b"outputs")][0]
        rows[i]["sha256"][0] ^= 1
        table[i] = rows[i]
    r = runner.invoke(main, ["verify", path, "--json"])
    assert r.exit_code == 1
    failed = [la for la in json.loads(r.stdout)["layers"] if not la["passed"]]
    assert [la["path"] for la in failed] == ["step_000001/net/out"]
    assert "SHA-256" in failed[0]["outputs"]["outputs"]["error"]


def test_verify_reads_the_digests_of_files_written_before_the_table(tmp_path, runner):
    """Run files written before the digest table kept each digest as a 32-byte dataset in reference/, with
    attributes digest, shape and dtype (as an older capture wrote them, by h5py's own calls)."""
    path = str(tmp_path / "run.h5")
    x, g = _arrays(5)
    lo, hi = np.float32(-1.0), np.float32(0.8)
    dx, dmin, dmax = ops.fake_quant_with_min_max_vars_gradient(g, x, lo, hi, num_bits=8, narrow_range=False)
    out = ops.fake_quant_with_min_max_vars(x, lo, hi, num_bits=8, narrow_range=False)
    with h5py.File(path, "w") as f:
        grp = f.create_group("step_000001/net/act")
        grp.attrs.update({"op": "FakeQuantWithMinMaxVars", "num_bits": 8, "narrow_range": False})
        for k, v in {"inputs": x, "min": lo, "max": hi, "gradients": g}.items():
            grp[k] = v
        ref = grp.create_group("reference")
        ref["backprop_wrt_min"], ref["backprop_wrt_max"] = dmin, dmax
        for k, v in {"outputs": out, "backprops_wrt_input": dx}.items():
            d = ref.create_dataset(k, data=digest(v))
            d.attrs.update({"digest": "sha256", "shape": np.asarray(v.shape, np.int64), "dtype": v.dtype.str})
    r = runner.invoke(main, ["verify", path, "--json"])
    assert r.exit_code == 0, r.output
    layer = json.loads(r.stdout)["layers"][0]
    assert layer["status"] == "identical" and layer["outputs"]["backprops_wrt_input"]["digest"] == "sha256"
    with h5py.File(path, "a") as f:
        d = f["step_000001/net/act/reference/outputs"]
        d[0] = d[0] ^ 1
    r = runner.invoke(main, ["verify", path, "--json"])
    assert r.exit_code == 1
    assert "SHA-256" in json.loads(r.stdout)["layers"][0]["outputs"]["outputs"]["error"]


def test_steps_append_without_copying(tmp_path):
    path = str(tmp_path / "run.h5")
    x, g = _arrays(1, (256, 1024))
    w = RunFileWriter(path, step=0)
    sizes = []
    for step in range(4):
        w.begin_step(step)
        _fake_quant(w, "a", x, g)
        _fake_quant(w, "b", g, x)
        w.commit_step()
        sizes.append(os.path.getsize(path))
    w.close()
    growth = np.diff(sizes)
    assert growth.max() < 1.05 * growth.min() and growth.min() < 1.1 * 4 * x.nbytes
    with h5py.File(path) as f:
        assert sorted(f) == [f"step_00000{i}" for i in range(4)]
        assert np.array_equal(f["step_000003/b/inputs"][()], g)
    with pytest.raises(FileExistsError):  # a step already in the file is refused, before any group
        RunFileWriter(path, step=3)
    w = RunFileWriter(path, step=5)
    with pytest.raises(FileExistsError):
        w.begin_step(2)
    w.discard()


def test_a_failed_step_leaves_the_file_as_it_was(tmp_path):
    path = str(tmp_path / "run.h5")
    x, g = _arrays(2)
    with RunFileWriter(path, step=1) as w:
        _fake_quant(w, "a", x, g)
    with pytest.raises(RuntimeError):
        with RunFileWriter(path, step=2) as w:
            _fake_quant(w, "a", x, g)
            raise RuntimeError("diverged")
    with h5py.File(path) as f:
        assert list(f) == ["step_000001"]
    assert sorted(os.listdir(tmp_path)) == ["run.h5"]


_APPEND = """
import sys, numpy as np
from qgcli.capture.runfile_writer import RunFileWriter, digest
w = RunFileWriter(sys.argv[1], step=2)
rng = np.random.default_rng(0)
for i in range(10000):
    w.add(f"layer{i}/act", "FakeQuantWithMinMaxArgs", {"inputs": rng.standard_normal(1 << 18).astype("f4")})
    if i == 3:
        print("writing", flush=True)
"""


@pytest.mark.parametrize("delay", [0.0, 0.2, 0.6])
def test_a_kill_during_an_append_leaves_the_earlier_steps(tmp_path, delay):
    path = str(tmp_path / "run.h5")
    x, g = _arrays(3)
    with RunFileWriter(path, step=1) as w:
        _fake_quant(w, "a", x, g)
        _fake_quant(w, "b", g, x)
    env = dict(os.environ, PYTHONPATH=ROOT)
    child = subprocess.Popen([sys.executable, "-c", _APPEND, path], stdout=subprocess.PIPE, env=env, cwd=ROOT)
    assert child.stdout.readline().strip() == b"writing"
    time.sleep(delay)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    child.stdout.close()
    assert os.path.getsize(path) > 4 * x.nbytes  # the child did write into the file
    with h5py.File(path) as f:
        assert list(f) == ["step_000001"]
        assert np.array_equal(f["step_000001/a/inputs"][()], x) and np.array_equal(f["step_000001/b/inputs"][()], g)
    with RunFileWriter(path, step=2) as w:  # and the file takes the step again
        _fake_quant(w, "a", x, g)
    with h5py.File(path) as f:
        assert list(f) == ["step_000001", "step_000002"]


def test_layers_keep_and_compression(tmp_path):
    x, g = _arrays(4)
    x = np.round(x * 4) / 4  # a few levels: compresses
    path = str(tmp_path / "run.h5")
    with RunFileWriter(path, layers=["conv*/weight*", "fc/*"], compression="gzip") as w:
        assert _fake_quant(w, "conv1.weight_q", x, g, weight=True) == "conv1/weight_q"
        assert _fake_quant(w, "conv1.act_q", x, g) is None
        assert _fake_quant(w, "fc.act_q", x, g) == "fc/act_q"
    with h5py.File(path) as f:
        assert sorted(f) == ["conv1", "fc", "qgcli_digests"] and list(f["conv1"]) == ["weight_q"]
        assert f["fc/act_q/inputs"].compression == "gzip"
        assert f["fc/act_q/inputs"].id.get_storage_size() < x.nbytes / 2
    path = str(tmp_path / "forward.h5")
    with RunFileWriter(path, keep="forward") as w:
        _fake_quant(w, "a", x, g)
    with h5py.File(path) as f:
        assert set(f["a"]) == {"inputs", "min", "max"}  # no gradient, nor its reference; outputs as a digest:
        assert [(r["group"], r["name"]) for r in f["qgcli_digests"][()]] == [(b"a", b"outputs")]
    path = str(tmp_path / "weights.h5")
    with RunFileWriter(path, keep="weights") as w:
        _fake_quant(w, "a", x, g)
        _fake_quant(w, "w", x, g, weight=True)
    with h5py.File(path) as f:
        assert list(f) == ["qgcli_digests", "w"]
    with pytest.raises(ValueError):
        RunFileWriter(str(tmp_path / "x.h5"), keep="some")


def test_names_below_a_group_take_a_suffix_at_its_level(tmp_path):
    w = RunFileWriter(str(tmp_path / "run.h5"))
    x, g = _arrays(5, (4, 4))
    assert _fake_quant(w, "a", x, g) == "a"
    assert _fake_quant(w, "a/b", x, g) == "a_1/b"  # a layer holds no layer
    assert _fake_quant(w, "a/b", x, g) == "a_2/b"
    assert _fake_quant(w, "c/d", x, g) == "c/d" and _fake_quant(w, "c", x, g) == "c_1"
    w.close()


_HEAP = """
import ctypes, os, sys
import numpy as np
from qgcli.capture.runfile_writer import RunFileWriter, digest

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20

big = np.ones(16 << 18, np.float32)  # 16 MB, mmapped; freed, it raises glibc's mmap threshold to its size
del big
kept, freed = [], []
for i in range(40):  # 8 MB copies now come from the heap; one in ten stays (a live tensor), pinning the rest
    (kept if i % 10 == 9 else freed).append(np.ones(1 << 21, np.float32))
freed.clear()
before = rss()
with RunFileWriter(sys.argv[1], step=0) as w:
    w.add("layer", "FakeQuantWithMinMaxVars", {"inputs": np.zeros(8, np.float32), "min": np.float32(-1),
                                                "max": np.float32(1)})
print(before, rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.uname().machine not in ("x86_64", "aarch64"),
                    reason="glibc's heap on Linux")
def test_a_committed_step_hands_freed_heap_memory_back(tmp_path):
    """The copies capture writes are freed at once, but glibc keeps freed heap pages below a live block: each
    step's commit hands them back (malloc_trim), so the process does not grow step after step (a captured
    ResNet-18 step grew the peak RSS by 340 MB, 19x its largest group, before)."""
    proc = subprocess.run([sys.executable, "-c", _HEAP, str(tmp_path / "run.h5")], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    before, after = map(int, proc.stdout.split())
    assert before - after > 200, (before, after)  # 36 freed 8 MB copies: 288 MB held, then handed back


def test_a_steps_small_datasets_take_few_pwrites(tmp_path, monkeypatch):
    """A step's small datasets lie mostly one after the other in the file (HDF5's blocks of metadata made large
    enough not to come between them) and go out in few ``pwrite`` calls, step after step: 6 or 7 for these 320
    datasets (with HDF5's 2 KiB blocks 190, with 16 KiB blocks 163 from the third step on; before the gathering,
    one per dataset)."""
    calls = []
    pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda *a: (calls.append(1), pwrite(*a))[1])
    x, g = _arrays(2, (16, 64))  # 4 KiB each: written by the caller, not the ring
    path = str(tmp_path / "run.h5")
    with RunFileWriter(path, step=0) as w:
        for step in range(3):
            w.begin_step(step)
            calls.clear()
            for n in range(40):
                _fake_quant(w, f"layer{n}.act", x, g, digest=False)  # 8 datasets each
            w.commit_step()
            assert len(calls) <= 40 * 8 / 10, (step, len(calls))
    with h5py.File(path) as f:
        assert np.array_equal(f["step_000002/layer39/act/gradients"][()], g)


def test_adjacent_small_arrays_are_written_in_one_pwrite(tmp_path, monkeypatch):
    """Small arrays (written by the caller) that follow one another in the file go out in one ``pwrite`` at the
    next write elsewhere or the wait (a MobileNetV2 step's 1,100 small datasets made as many calls); the bytes
    land where they belong, and a gathered write that fails fails the wait."""
    from qgcli.capture import background_writes
    from qgcli.capture.background_writes import BackgroundWrites

    calls = []  # (offset, bytes) of each pwrite
    pwrite_all = background_writes.pwrite_all
    monkeypatch.setattr(background_writes, "pwrite_all", lambda fd, data, offset: (
        calls.append((offset, np.asarray(data).nbytes)), pwrite_all(fd, data, offset))[1])
    rng = np.random.default_rng(0)
    places = [(0, 5), (5, 3), (8, 8), (30, 4), (34, 2)]  # (offset, bytes): two runs of adjacent arrays
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for _, n in places]
    path = tmp_path / "raw.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        writes = BackgroundWrites(fd, capacity=64, inline_below=16)
        for (offset, _), a in zip(places, arrays):
            writes.write(a, offset)
        assert calls == [(0, 16)]  # the first run, written when the second began
        writes.wait()
        assert calls == [(0, 16), (30, 6)]
        data = np.fromfile(path, dtype=np.uint8)
        for (offset, n), a in zip(places, arrays):
            assert np.array_equal(data[offset:offset + n], a)
        writes.close()
    finally:
        os.close(fd)
    bad = BackgroundWrites(-1, capacity=64, inline_below=16)
    bad.write(np.ones(4, np.uint8), 0)  # gathered: nothing written yet
    with pytest.raises(OSError):
        bad.wait()
    bad.close()


@pytest.mark.parametrize("slice_bytes", [None, 5, 16])
def test_background_writes_wrap_the_ring_in_order_and_report_a_failed_write(tmp_path, slice_bytes, monkeypatch):
    """The bytes of each array reach their offset whatever the ring's state: sizes that wrap the ring with room
    left at its end, an array as large as the ring, larger ones (through the ring in slices, their digests
    hashed slice by slice), slices of 2 (an eighth of the ring), 5 and 16 bytes; only the small array is written
    by the caller's thread; a write that fails fails the next write and every wait, and stays failed."""
    from qgcli.capture import background_writes
    from qgcli.capture.background_writes import BackgroundWrites, sha256

    writers = []  # (thread, bytes) of each pwrite
    pwrite_all = background_writes.pwrite_all
    monkeypatch.setattr(background_writes, "pwrite_all", lambda fd, data, offset: (
        writers.append((threading.current_thread(), np.asarray(data).nbytes)), pwrite_all(fd, data, offset))[1])

    rng = np.random.default_rng(0)
    sizes = [5, 12, 3, 16, 1, 9, 7, 16, 20, 2, 11, 15, 4]  # bytes, against a 16-byte ring
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    expected = [a.copy() for a in arrays]
    path = tmp_path / "raw.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        writes = BackgroundWrites(fd, capacity=16, inline_below=2, slice_bytes=slice_bytes)  # 1 byte: the caller's
        offsets, offset, digests = [], 0, []
        for a in arrays:
            offsets.append(offset)
            digests.append(np.zeros(32, np.uint8))
            writes.write(a, offset, digest_into=digests[-1])
            a[:] = 0  # the caller may change its array at once: the bytes were copied
            offset += a.nbytes
        writes.wait()
        assert [n for thread, n in writers if thread is threading.current_thread()] == [1]
        assert max(n for _, n in writers) == (slice_bytes or 2)
        data = np.fromfile(path, dtype=np.uint8)
        for start, want, got in zip(offsets, expected, digests):
            assert np.array_equal(data[start:start + want.nbytes], want)
            assert np.array_equal(got, sha256(want))
        writes.close()
        bad = BackgroundWrites(-1, capacity=16, inline_below=0)
        bad.write(np.ones(4, np.uint8), 0)
        for _ in range(2):
            with pytest.raises(OSError):
                bad.wait()
        with pytest.raises(OSError):
            bad.write(np.ones(4, np.uint8), 0)
        bad.close()
    finally:
        os.close(fd)
