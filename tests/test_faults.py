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


_started = []


def _default_signals(then=None):
    """In the child before exec: Ctrl-C, SIGTERM and SIGHUP at their defaults whatever this test run inherited
    (a shell ignores SIGINT in commands it runs in the background, and qgcli rightly keeps an ignored signal
    ignored), then ``then``."""
    def preexec():
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        if then is not None:
            then()
    return preexec


def start(args, preexec_fn=None, **kw):
    proc = subprocess.Popen([sys.executable, "-m", "qgcli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=_default_signals(preexec_fn), **kw)
    _started.append(proc)
    return proc


@pytest.fixture(autouse=True)
def reap():
    """Whatever a test asserted, every process it started is ended and waited for, its pipes closed."""
    yield
    while _started:
        proc = _started.pop()
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _threads(pid):
    """The names of a process's threads (empty once it has ended)."""
    names = []
    for task in glob.glob(f"/proc/{pid}/task/*/comm"):
        try:
            with open(task) as fh:
                names.append(fh.read().strip())
        except OSError:
            pass
    return names


def _catches(pid, sig):
    """Whether the process has a handler installed for ``sig`` (/proc's SigCgt mask)."""
    with open(f"/proc/{pid}/status") as fh:
        mask = next(int(line.split()[1], 16) for line in fh if line.startswith("SigCgt:"))
    return bool(mask >> (sig - 1) & 1)


PHASES = {  # phase -> test on a running Run: the process's own state, read from outside
    # qgcli's handlers are in place (Python catches SIGTERM only once qgcli.signals.install ran): before
    # that a signal meets Python's own start-up, not qgcli
    "started": lambda run: _catches(run.proc.pid, signal.SIGTERM),
    "compute": lambda run: "qgcli-pool" in _threads(run.proc.pid),  # the kernels' thread pool has started
    "write": lambda run: bool(temps(run.workdir)),  # between the temporary file's creation and its rename
}


def wait_for_phase(run, phase, timeout=60):
    end = time.monotonic() + timeout
    while run.proc.poll() is None and not _seen(run, phase):
        assert time.monotonic() < end, f"{run.kind}: never seen in phase {phase}"
        time.sleep(0.0002)


def _seen(run, phase):
    try:
        return PHASES[phase](run)
    except (OSError, StopIteration):  # a file renamed or removed, or the process gone, while looked at
        return False


def signal_in_phase(run, sig, phase, timeout=60):
    """Stop ``run`` (SIGSTOP) as soon as it is seen in ``phase``, check it still is, send ``sig`` and let it
    go on: the signal lands at that point.  False when the run ended before it was seen there."""
    end = time.monotonic() + timeout
    while run.proc.poll() is None:
        assert time.monotonic() < end, f"{run.kind}: never seen in phase {phase}"
        if _seen(run, phase):
            run.proc.send_signal(signal.SIGSTOP)
            try:
                if run.proc.poll() is None and _seen(run, phase):
                    run.proc.send_signal(sig)
                    run.sent = time.monotonic()
                    return True
            finally:
                run.proc.send_signal(signal.SIGCONT)
        time.sleep(0.0002)
    return False


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

def kill_trial(bundle, want, work, kind, moment, rng, duration):
    """One run SIGKILLed while its output is written (``moment="write"``; tried again when a run ends first) or
    at a random moment of ``duration`` ("timed"); returns (kind, moment, state, temporaries left, killed)."""
    command, name, options = FORMATS[kind]
    for _ in range(5):
        work.mkdir()
        run = Run([command, bundle, *options, "-o", os.path.join(str(work), name), "-q"], work,
                  os.path.join(str(work), name), kind)
        if moment == "timed":
            wait_for_phase(run, "started")
            run.signal_at = time.monotonic() + rng.uniform(0, duration)
            signal_all([run], signal.SIGKILL)
            break
        if signal_in_phase(run, signal.SIGKILL, "write"):
            break
        run.finish()
        shutil.rmtree(work)
    else:
        pytest.fail(f"{kind}: 5 runs ended before their output was seen")
    run.finish()
    assert run.proc.returncode in (-signal.SIGKILL, 0), run.proc.returncode
    left = temps(run.workdir)
    for t in left:
        assert os.path.basename(t).startswith(".qgcli-") and t.endswith((".tmp", ".tmpdir")), t
    if os.path.exists(run.target):
        assert_complete(run.target, run.kind, want[run.kind])  # a partial output fails here
        state = "complete"
    else:
        state = "absent"
    shutil.rmtree(run.workdir)
    return kind, moment, state, len(left), run.proc.returncode == -signal.SIGKILL


def kill_campaign(big, tmp_path, kills, seed, duration, moments):
    bundle, want = big
    rng = random.Random(seed)
    return [kill_trial(bundle, want, tmp_path / f"k{i}", list(FORMATS)[i % len(FORMATS)], rng.choice(moments),
                       rng, duration) for i in range(kills)]


def test_sigkill_never_leaves_a_partial_output(big, tmp_path):
    """Six kills (one per output kind), each while the temporary output is seen: every one lands
    mid-write, and none leaves a partial output under the final name."""
    results = kill_campaign(big, tmp_path, kills=6, seed=20261129, duration=None, moments=["write"])
    assert [killed for *_, killed in results] == [True] * 6, results


@pytest.mark.slow
@pytest.mark.skipif(not LONG, reason="long campaign: set QGCLI_LONG=1")
def test_sigkill_campaign(big, tmp_path):
    seed = int(os.environ.get("QGCLI_SEED", time.time_ns() % 2**31))
    kills = int(os.environ.get("QGCLI_KILLS", 60))
    bundle, _ = big
    t0 = time.monotonic()  # a clean run sets the window of the timed kills
    assert Run(["fakequant-grad", bundle, "-o", str(tmp_path / "clean.h5"), "-q"], tmp_path, None).finish()[0] == 0
    duration = time.monotonic() - t0
    os.remove(tmp_path / "clean.h5")
    results = kill_campaign(big, tmp_path, kills, seed, duration, moments=["timed", "write"])
    writes = [killed for _, moment, *_, killed in results if moment == "write"]
    assert sum(writes) >= 0.9 * len(writes), f"only {sum(writes)} of {len(writes)} write-time kills landed"
    tally = {}
    for kind, moment, state, left, killed in results:
        key = (kind, moment, "killed" if killed else "finished", state, "temporaries left" if left else "clean")
        tally[key] = tally.get(key, 0) + 1
    print(f"\nSIGKILL campaign: seed {seed}, {kills} kills, run time {duration:.2f} s")
    for key, n in sorted(tally.items()):
        print("  " + " ".join(f"{part:16}" for part in key) + f" {n}")


# --- a full disk: RLIMIT_FSIZE makes every write past the limit fail with EFBIG ---------------------------

def _limit(nbytes):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))


# Under the limit Python's own bytecode cache must not be written: its write stops short without an error,
# and the truncated .pyc ("marshal data too short") then broke every later import of that module.
NO_BYTECODE = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")


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
        runs[kind] = Run(args, tmp_path / kind, args[-1], kind, env=NO_BYTECODE,
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

SIGNAL_PLAN = [("h5", signal.SIGINT), ("npz", signal.SIGTERM), ("dir", signal.SIGINT), ("npy", signal.SIGHUP),
               ("h5-streamed", signal.SIGINT), ("h5-streamed", signal.SIGTERM), ("h5-gzip", signal.SIGTERM)]


def signal_trial(bundle, work, kind, sig, phase, attempts=5):
    """One run of ``kind`` signalled in ``phase`` (tried again, up to ``attempts`` runs, when a run ends
    before it is seen there); asserts the promise: one line, exit 128 + signal, nothing left."""
    command, name, options = FORMATS[kind]
    for _ in range(attempts):
        work.mkdir()
        run = Run([command, bundle, *options, "-o", os.path.join(str(work), name)], work,
                  os.path.join(str(work), name), kind)
        if signal_in_phase(run, sig, phase):
            break
        run.finish()
        shutil.rmtree(work)
    else:
        pytest.fail(f"{kind}: {attempts} runs ended before they were seen in phase {phase}")
    code, out, err = run.finish()
    says = expected_line(sig)
    assert code == 128 + sig, (kind, sig.name, phase, code, err)
    assert err.count("\n") == 1 and err.startswith(says), (kind, sig.name, phase, err)
    assert out == b""
    assert os.listdir(run.workdir) == [], (kind, sig.name, phase, os.listdir(run.workdir))
    shutil.rmtree(work)


def expected_line(sig):
    return "Error: interrupted" if sig == signal.SIGINT else f"Error: terminated by {sig.name}"


@pytest.mark.parametrize("kind, sig", SIGNAL_PLAN, ids=[f"{k}-{s.name}" for k, s in SIGNAL_PLAN])
def test_signals_while_writing(big, tmp_path, kind, sig):
    signal_trial(big[0], tmp_path / "w", kind, sig, "write")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_signals_while_computing(big, tmp_path, sig):
    """The signal lands while the compiled kernels run on the thread pool: the pool finishes its running
    blocks before the arrays they write are freed (no SIGSEGV), then one line and exit 128 + signal."""
    signal_trial(big[0], tmp_path / "c", "h5", sig, "compute")


@pytest.mark.slow
@pytest.mark.skipif(not LONG, reason="long campaign: set QGCLI_LONG=1")
def test_signal_campaign(big, tmp_path):
    """``QGCLI_SIGNALS`` (default 200) SIGINT/SIGTERM trials spread over loading, computing and writing
    (a random moment of a clean run's duration, or the moment a phase is seen), then as many into a
    streamed HDF5 write; every one ends with exit 130/143 and nothing left."""
    seed = int(os.environ.get("QGCLI_SEED", time.time_ns() % 2**31))
    trials = int(os.environ.get("QGCLI_SIGNALS", 200))
    rng = random.Random(seed)
    bundle, _ = big
    t0 = time.monotonic()
    assert Run(["fakequant-grad", bundle, "-o", str(tmp_path / "clean.h5"), "-q"], tmp_path, None).finish()[0] == 0
    duration = time.monotonic() - t0
    os.remove(tmp_path / "clean.h5")
    tally = {}
    for i in range(trials):
        sig = rng.choice([signal.SIGINT, signal.SIGTERM])
        how = rng.choice(["timed", "compute", "write"])
        # A streamed run computes block by block on the main thread: no kernel pool to be seen in.
        kind = rng.choice([k for k in FORMATS if not (how == "compute" and k == "h5-streamed")])
        work = tmp_path / f"t{i}"
        if how != "timed":
            signal_trial(bundle, work, kind, sig, how)
            outcome = "signalled"
        else:
            work.mkdir()
            command, name, options = FORMATS[kind]
            run = Run([command, bundle, *options, "-o", os.path.join(str(work), name), "-q"], work, None, kind)
            wait_for_phase(run, "started")
            run.signal_at = time.monotonic() + rng.uniform(0, duration)
            signal_all([run], sig)
            code, out, err = run.finish()
            if code == 0:
                outcome = "finished first"
            else:
                assert code == 128 + sig and err.count("\n") == 1 and err.startswith(expected_line(sig)), err
                left = os.listdir(work)
                assert [p for p in left if p.startswith(".qgcli-")] == [], left
                outcome = "signalled"
                if left:  # the signal came after the rename: the output is there, and complete
                    assert_complete(os.path.join(str(work), name), kind, big[1][kind])
                    outcome = "signalled, output complete"
            shutil.rmtree(work)
        key = (how, kind, sig.name, outcome)
        tally[key] = tally.get(key, 0) + 1
    for i in range(trials):
        sig = rng.choice([signal.SIGINT, signal.SIGTERM])
        signal_trial(bundle, tmp_path / f"s{i}", "h5-streamed", sig, "write")
        tally[("write", "h5-streamed", sig.name, "signalled")] = tally.get(("write", "h5-streamed", sig.name, "signalled"), 0) + 1
    print(f"\nsignal campaign: seed {seed}, {trials} spread trials + {trials} streamed-write trials, "
          f"clean run {duration:.2f} s")
    for key, n in sorted(tally.items()):
        print("  " + " ".join(f"{part:14}" for part in key) + f" {n}")


def test_a_signal_ends_a_stuck_hdf5_read(tmp_path):
    """HDF5 spins for ever reading this damaged file's variable-length attribute (h5py holds the GIL): the
    read runs on a worker thread, so SIGTERM still ends inspect at once, and without it inspect gives up
    with a one-line error after qgcli.storage.hdf5.guard.SECONDS."""
    damaged = os.path.join(ROOT, "tests", "fuzz_regressions", "h5_vlen_attribute_read_hangs.h5")
    run = Run(["inspect", damaged], tmp_path, None)
    end = time.monotonic() + 30
    while "qgcli-hdf5" not in _threads(run.proc.pid):  # the guarded read has started
        assert run.proc.poll() is None and time.monotonic() < end, run.finish()
        time.sleep(0.005)
    run.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    code, out, err = run.finish(timeout=10)
    assert time.monotonic() - sent < 2.0
    assert code == 143 and err.count("\n") == 1 and err.startswith("Error: terminated by SIGTERM"), (code, err)


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
    from qgcli import signals
    from qgcli.storage import io

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


def test_an_error_a_signal_caused_is_reported_as_the_signal(capsys):
    """A signal raised inside a class body under construction (as during an import: numpy's finfo) reaches
    the CLI wrapped in another exception (Python 3.11: RuntimeError "Error calling __set_name__"); it is
    still 'terminated by SIGTERM', exit 143, not an internal error (seen in the signal campaign)."""
    import click

    from qgcli import cli, signals

    @click.group(cls=cli.QgcliGroup)
    def group():
        pass

    @group.command()
    def work():
        class Descriptor:
            def __set_name__(self, owner, name):
                signals._handler(signal.SIGTERM, None)  # what SIGTERM does when it lands here

        type("Built", (), {"field": Descriptor()})

    with pytest.raises(SystemExit) as exit_:
        group.main(["work"], prog_name="qgcli")
    assert exit_.value.code == 143
    assert capsys.readouterr().err == "Error: terminated by SIGTERM; no output was left half-written\n"
