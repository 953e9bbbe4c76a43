"""Faults while qgcli writes: SIGKILL at random points, a full disk (RLIMIT_FSIZE), Ctrl-C, SIGTERM.

Every test runs the real CLI in subprocesses (``python -m qgcli``) on a large bundle and checks the
promise of the atomic writers: the final output path is absent (or the old file, untouched) or complete
and equal to the library's result; after a catchable signal or a write error no temporary file is left;
after SIGKILL, which nothing can catch, at most hidden ``.qgcli-*.tmp`` files (``.tmpdir`` for a new
``DIR/``) remain, never a partial output under the final name.

Processes run four at a time to keep CI short.  CI kills 6 runs writing 8 MiB outputs (one of each
output kind: .h5, .h5 streamed block by block, .h5 gzip-compressed, .npz, DIR/, .npy); ``QGCLI_LONG=1``
runs the campaign (60 kills by default, ``QGCLI_KILLS``; 64 MiB outputs) and prints its tally:
``QGCLI_LONG=1 pytest -m slow -s tests/test_faults.py``.
"""
import glob
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from conftest import ROOT

LONG = os.environ.get("QGCLI_LONG", "") not in ("", "0")
TEMP_GLOB = ".qgcli-*.tmp*"  # files .tmp, new output directories .tmpdir
FORMATS = {  # kind -> (command, output name, options)
    "h5": ("fakequant-grad", "out.h5", []),
    "npz": ("fakequant-grad", "out.npz", []),
    "dir": ("fakequant-grad", "outdir/", []),
    "npy": ("fakequant", "out.npy", []),
    "h5-streamed": ("fakequant-grad", "out.h5", ["--memory-limit", "1M"]),  # written block by block
    "h5-gzip": ("fakequant-grad", "out.h5", ["--compression", "gzip"]),  # chunked: HDF5's chunk path
}


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A bundle (8 MiB tensors; 64 MiB with QGCLI_LONG) and each output kind's arrays from the library."""
    from qgcli import ops

    rows = (64 if LONG else 8) * (1 << 20) // (4 * 4096)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((rows, 4096), dtype=np.float32) * 3
    g = rng.standard_normal((rows, 4096), dtype=np.float32)
    mn, mx = np.float32(-2.5), np.float32(4.0)
    path = str(tmp_path_factory.mktemp("faults") / "big.h5")
    with h5py.File(path, "w") as f:
        f["inputs"], f["gradients"], f["min"], f["max"] = x, g, mn, mx
    grads = dict(zip(("backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max"),
                     ops.fake_quant_with_min_max_vars_gradient(g, x, mn, mx)))
    want = {"h5": grads, "npz": grads, "dir": grads, "h5-streamed": grads, "h5-gzip": grads,
            "npy": {"outputs": ops.fake_quant_with_min_max_vars(x, mn, mx)}}
    return path, want


def start(args, **kw):
    return subprocess.Popen([sys.executable, "-m", "qgcli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kw)


def temps(directory):
    """qgcli's temporary files and directories in ``directory`` and in its (non-temporary) subdirectories."""
    found = glob.glob(os.path.join(directory, TEMP_GLOB))
    for name in os.listdir(directory):
        sub = os.path.join(directory, name)
        if os.path.isdir(sub) and sub not in found:
            found += glob.glob(os.path.join(sub, TEMP_GLOB))
    return found


def read_output(path, kind):
    """The arrays of a written output (raises if it is not a complete, readable file)."""
    if kind.startswith("h5"):
        with h5py.File(path, "r") as f:
            return {k: f[k][()] for k in f}
    if kind == "npz":
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    if kind == "npy":
        return {"outputs": np.load(path, allow_pickle=False)}
    return {name[:-4]: np.load(os.path.join(path, name), allow_pickle=False) for name in os.listdir(path)
            if name.endswith(".npy")}


def assert_complete(path, kind, want):
    got = read_output(path, kind)
    assert set(got) == set(want), f"{path}: {sorted(got)} instead of {sorted(want)}"
    for k, v in got.items():
        np.testing.assert_array_equal(v, want[k], err_msg=f"{path}: {k}")


class Run:
    """One qgcli process writing into its own directory, with a moment (or event) at which to signal it."""

    def __init__(self, args, workdir, target, kind=None, **kw):
        self.workdir, self.target, self.kind = str(workdir), target, kind
        self.t0 = time.monotonic()
        self.proc = start(args, **kw)
        self.signal_at = None  # monotonic time, or "write": when a temporary file appears
        self.delay = 0.0
        self.sent = None

    def poll_and_signal(self, sig):
        if self.sent is not None or self.proc.poll() is not None:
            return True
        now = time.monotonic()
        if self.signal_at == "write":
            if temps(self.workdir):
                self.signal_at = now + self.delay
            return False
        if self.signal_at is not None and now >= self.signal_at:
            self.proc.send_signal(sig)
            self.sent = now
            return True
        return False

    def finish(self, timeout=300):
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err.decode()


def signal_all(runs, sig, timeout=120):
    end = time.monotonic() + timeout
    while not all([r.poll_and_signal(sig) for r in runs]):
        assert time.monotonic() < end, "a run never reached its signal point"
        time.sleep(0.0005)
    return [r.finish() for r in runs]


# --- SIGKILL at random points ----------------------------------------------------------------------

def kill_batch(bundle, want, tmp_path, first, count, rng, duration):
    """``count`` runs killed at random moments; returns one (kind, state, temporaries left) per run."""
    runs = []
    for i in range(first, first + count):
        kind = list(FORMATS)[i % len(FORMATS)]
        command, name, options = FORMATS[kind]
        work = tmp_path / f"k{i}"
        work.mkdir()
        run = Run([command, bundle, *options, "-o", os.path.join(str(work), name), "-q"], work,
                  os.path.join(str(work), name), kind)
        if rng.random() < 0.5:  # anywhere in the run ...
            run.signal_at = run.t0 + rng.uniform(0, duration)
        else:  # ... or while the output is being written
            run.signal_at, run.delay = "write", rng.uniform(0, 0.05)
        runs.append(run)
    signal_all(runs, signal.SIGKILL)
    results = []
    for run in runs:
        assert run.proc.returncode in (-signal.SIGKILL, 0), run.proc.returncode
        left = temps(run.workdir)
        for t in left:
            assert os.path.basename(t).startswith(".qgcli-") and t.endswith((".tmp", ".tmpdir")), t
        if os.path.exists(run.target):
            assert_complete(run.target, run.kind, want[run.kind])  # a partial output fails here
            state = "complete"
        else:
            state = "absent"
        results.append((run.kind, state, len(left)))
        shutil.rmtree(run.workdir)
    return results


def kill_campaign(big, tmp_path, kills, seed, duration):
    bundle, want = big
    rng = random.Random(seed)
    results = []
    for first in range(0, kills, 4):
        results += kill_batch(bundle, want, tmp_path, first, min(4, kills - first), rng, duration)
    return results


def test_sigkill_never_leaves_a_partial_output(big, tmp_path):
    results = kill_campaign(big, tmp_path, kills=6, seed=20261129, duration=2.0)
    assert len(results) == 6


@pytest.mark.slow
@pytest.mark.skipif(not LONG, reason="long campaign: set QGCLI_LONG=1")
def test_sigkill_campaign(big, tmp_path):
    seed = int(os.environ.get("QGCLI_SEED", time.time_ns() % 2**31))
    kills = int(os.environ.get("QGCLI_KILLS", 60))
    bundle, _ = big
    t0 = time.monotonic()  # a clean run, four at once as in the campaign, sets the time window
    clean = [Run(["fakequant-grad", bundle, "-o", str(tmp_path / f"clean{i}.h5"), "-q"], tmp_path, None)
             for i in range(4)]
    assert all(r.finish()[0] == 0 for r in clean)
    duration = time.monotonic() - t0
    results = kill_campaign(big, tmp_path, kills, seed, duration)
    tally = {}
    for kind, state, left in results:
        key = (kind, state, "temporaries left" if left else "clean")
        tally[key] = tally.get(key, 0) + 1
    print(f"\nSIGKILL campaign: seed {seed}, {kills} kills, run time {duration:.2f} s")
    for (kind, state, temp), n in sorted(tally.items()):
        print(f"  {kind:4} {state:9} {temp:17} {n}")


# --- a full disk: RLIMIT_FSIZE makes every write past the limit fail with EFBIG ---------------------------

def _limit(nbytes):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))


def test_disk_full_is_a_clean_error(big, tmp_path):
    """Every output kind (and a figure) past a file-size limit: exit 1, one line, nothing left."""
    bundle, _ = big
    cases = {kind: [cmd, bundle, *options, "-o", os.path.join(str(tmp_path / kind), name)]
             for kind, (cmd, name, options) in FORMATS.items()}
    cases["png"] = ["plot", "hist", bundle, "--dpi", "200", "-o", str(tmp_path / "png" / "h.png")]
    old = tmp_path / "npz" / "out.npz"  # the .npz run replaces an existing file (--force)
    (tmp_path / "npz").mkdir()
    np.savez(old, backprops_wrt_input=np.arange(3.0))
    old_bytes = old.read_bytes()
    cases["npz"].insert(1, "--force")
    runs = {}
    for kind, args in cases.items():
        (tmp_path / kind).mkdir(exist_ok=True)
        runs[kind] = Run(args, tmp_path / kind, args[-1], kind,
                         preexec_fn=_limit(16 << 10 if kind == "png" else 1 << 20))  # outputs: 8 MiB, ~60 KiB
    before = os.stat(bundle).st_mtime_ns, os.path.getsize(bundle)
    for kind, run in runs.items():
        code, out, err = run.finish()
        assert code == 1, (kind, err)
        assert err.count("\n") == 1 and err.startswith("Error: cannot write") and "File too large" in err, (kind, err)
        assert out == b""
        assert temps(run.workdir) == [], kind
        if kind == "npz":
            assert old.read_bytes() == old_bytes and os.listdir(run.workdir) == ["out.npz"]  # old file untouched
        else:
            assert os.listdir(run.workdir) == [], (kind, os.listdir(run.workdir))
    assert (os.stat(bundle).st_mtime_ns, os.path.getsize(bundle)) == before


# --- Ctrl-C and SIGTERM: one line, exit 128 + signal, temporary files removed -----------------------------

def test_signals_while_writing(big, tmp_path):
    bundle, _ = big
    plan = [("h5", signal.SIGINT), ("npz", signal.SIGTERM), ("dir", signal.SIGINT), ("npy", signal.SIGHUP),
            ("h5-streamed", signal.SIGINT), ("h5-gzip", signal.SIGTERM)]
    runs = []
    for i, (kind, sig) in enumerate(plan):
        command, name, options = FORMATS[kind]
        work = tmp_path / f"s{i}"
        work.mkdir()
        run = Run([command, bundle, *options, "-o", os.path.join(str(work), name)], work,
                  os.path.join(str(work), name), kind)
        run.signal_at, run.sig = "write", sig
        runs.append(run)
    end = time.monotonic() + 120
    while not all([r.poll_and_signal(r.sig) for r in runs]):
        assert time.monotonic() < end
        time.sleep(0.0005)
    for run in runs:
        code, out, err = run.finish()
        assert run.sent is not None, f"{run.kind}: the run ended before it began writing"
        says = "Error: interrupted" if run.sig == signal.SIGINT else f"Error: terminated by {run.sig.name}"
        assert code == 128 + run.sig, (run.kind, run.sig, err)
        assert err.count("\n") == 1 and err.startswith(says), err
        assert out == b""
        assert os.listdir(run.workdir) == [], (run.kind, run.sig, os.listdir(run.workdir))


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc to see the command start")
def test_ctrl_c_while_computing(big, tmp_path):
    """Ctrl-C after the command has started (NumPy, imported only by commands, is mapped) and before any
    write: one line, exit 130, nothing written."""
    bundle, _ = big
    run = Run(["fakequant-grad", bundle, "-o", str(tmp_path / "out.h5")], tmp_path, None)
    end = time.monotonic() + 60
    while time.monotonic() < end and run.proc.poll() is None:
        with open(f"/proc/{run.proc.pid}/maps") as fh:
            if "_multiarray_umath" in fh.read():
                break
        time.sleep(0.002)
    run.proc.send_signal(signal.SIGINT)
    code, out, err = run.finish()
    if code == 0:
        pytest.skip("the run finished before the signal")
    assert code == 130, err
    assert err.count("\n") == 1 and err.startswith("Error: interrupted"), err
    assert os.listdir(tmp_path) == []


def test_ignored_sigterm_stays_ignored(big, tmp_path):
    """Under ``nohup``-style SIG_IGN qgcli does not reinstate SIGTERM: the run completes."""
    bundle, want = big
    target = str(tmp_path / "out.h5")
    run = Run(["fakequant-grad", bundle, "-o", target, "-q"], tmp_path, target,
              preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN))
    run.signal_at = "write"
    signal_all([run], signal.SIGTERM)
    code, _, err = run.finish()
    assert code == 0 and run.sent is not None, err
    assert_complete(target, "h5", want["h5"])


def test_a_swallowed_signal_still_stops_the_output(tmp_path):
    """Python drops an exception raised in a ``__del__`` (h5py frees objects there): the signal handler
    records the signal, and the writer refuses to rename the finished file into place."""
    from qgcli import io, signals

    restore = signals.install()
    try:
        class Victim:
            def __del__(self):
                signals._handler(signal.SIGINT, None)  # what Ctrl-C does when it lands in a __del__

        Victim()  # the Terminated raised in __del__ is swallowed (and not printed)
        assert signals.pending() == signal.SIGINT
        for dest in ("o.npz", "o.h5", "d/"):
            with pytest.raises(signals.Terminated):
                io.save_outputs({"a": np.zeros(3, np.float32)}, os.path.join(str(tmp_path), dest))
        assert os.listdir(tmp_path) == []
    finally:
        restore()
    assert signals.pending() is None
    io.save_outputs({"a": np.zeros(3, np.float32)}, str(tmp_path / "o.npz"))  # outside the CLI: no effect
    assert os.listdir(tmp_path) == ["o.npz"]
