"""Outputs under concurrency and crashes (#41): two runs writing the same new output (one says ``wrote``, the
other fails in one line), ``-o isdir.h5`` on a directory, a .safetensors output on a full disk, and ``--force``
over a store or a directory that leaves the old one or the new one at the name at every instant, even when
the process is SIGKILLed inside the commit (what a killed commit leaves is put back or removed by the next
run).  Real files, real processes, real renames; ``QGCLI_LONG=1`` runs 20 concurrent trials per output kind
(``QGCLI_RACES``) instead of 1."""
import os
import resource
import signal
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

from conftest import ROOT

LONG = os.environ.get("QGCLI_LONG", "") not in ("", "0")
RACES = int(os.environ.get("QGCLI_RACES", "20")) if LONG else 1
f32 = np.float32


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """A 2 MiB FakeQuantWithMinMaxVars bundle: big enough that both racers pass their checks before either
    commits."""
    rng = np.random.default_rng(3)
    path = str(tmp_path_factory.mktemp("races") / "in.h5")
    with h5py.File(path, "w") as f:
        f["inputs"] = rng.standard_normal((128, 4096), dtype=f32)
        f["gradients"] = rng.standard_normal((128, 4096), dtype=f32)
        f["min"], f["max"] = f32(-1.5), f32(2.0)
    return path


def qgcli(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "qgcli", *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kw)


def leftovers(folder):
    return [n for n in os.listdir(folder) if n.startswith(".qgcli-")]


def said_wrote(stderr):
    return any(line.startswith("wrote ") for line in stderr.splitlines())


def race(bundle, target):
    """Two runs started together writing the same new ``target``: their (exit code, stderr) pairs."""
    procs = [qgcli("fakequant-grad", bundle, "-o", target) for _ in range(2)]
    return [(p.wait(timeout=300), p.communicate()[1].decode()) for p in procs]


@pytest.mark.parametrize("kind", ["h5", "zarr", "dir"])
def test_two_runs_writing_the_same_new_output_never_both_say_wrote(bundle, tmp_path, kind):
    if kind == "zarr":
        pytest.importorskip("zarr")
    tally = {"race lost at the commit": 0, "refused at the check": 0}
    for trial in range(RACES):
        work = tmp_path / str(trial)
        work.mkdir()
        target = f"{work}/" + {"h5": "out.h5", "zarr": "out.zarr", "dir": "out/"}[kind]
        results = race(bundle, target)
        winners = [err for code, err in results if code == 0]
        losers = [err for code, err in results if code != 0]
        assert len(winners) == 1 and said_wrote(winners[0]), results
        assert len(losers) == 1 and not said_wrote(losers[0]), results
        code = [c for c, _ in results if c != 0][0]
        assert code == 2 and losers[0].count("\n") == 1 and losers[0].startswith("Error: --output:"), results
        tally["race lost at the commit" if "appeared" in losers[0] else "refused at the check"] += 1
        assert leftovers(work) == []
        if kind == "h5":
            with h5py.File(target, "r") as f:
                assert sorted(f) == ["backprop_wrt_max", "backprop_wrt_min", "backprops_wrt_input"]
        elif kind == "dir":
            assert sorted(os.listdir(target)) == ["backprop_wrt_max.npy", "backprop_wrt_min.npy",
                                                  "backprops_wrt_input.npy"]
    print(f"\n{kind}: {RACES} trials, one 'wrote' each: {tally}")


@pytest.mark.parametrize("name", ["isdir.h5", "isdir.npz", "isdir.npy", "isdir.safetensors"])
def test_an_output_file_name_that_is_a_directory_is_refused(cli, bundle, tmp_path, name):
    folder = tmp_path / name
    folder.mkdir()
    for force in ([], ["--force"]):
        result = cli("fakequant", bundle, "-o", folder, *force)
        assert result.exit_code == 2 and "is a directory" in result.output, result.output
        assert result.output.count("\n") == 1
    assert os.listdir(folder) == []


def test_a_safetensors_output_on_a_full_disk_is_one_line(bundle, tmp_path):
    pytest.importorskip("safetensors")
    limit = 1 << 20  # the outputs are 2 MiB: RLIMIT_FSIZE makes the write past 1 MiB fail (EFBIG)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    proc = qgcli("fakequant-grad", bundle, "-o", tmp_path / "o.safetensors", env=env,
                 preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    out, err = proc.communicate(timeout=300)
    err = err.decode()
    assert proc.returncode == 1 and err.count("\n") == 1, err
    assert err.startswith("Error: cannot write") and "File too large" in err and "internal" not in err, err
    assert os.listdir(tmp_path) == []


# --- the commit itself, in the library: a name that appeared is never replaced --------------------------

@pytest.fixture(params=["renameat2", "fallback"])
def renames(request, monkeypatch):
    """Each commit through renameat2(2) and through the documented fallback (link, or check and rename)."""
    from qgcli.storage import atomic

    if request.param == "fallback":
        monkeypatch.setattr(atomic, "_renameat2", [None])
    elif sys.platform != "linux":
        pytest.skip("renameat2 is Linux's")
    return request.param


def test_a_file_that_appeared_during_the_write_is_left_as_it_is(tmp_path, renames):
    from qgcli.errors import OutputError
    from qgcli.storage import atomic

    dest = tmp_path / "out.h5"
    with pytest.raises(OutputError, match="appeared"):
        with atomic.staging(str(dest)) as tmp:
            with open(tmp, "wb") as fh:
                fh.write(b"mine")
            dest.write_bytes(b"theirs")  # another process committed first
    assert dest.read_bytes() == b"theirs" and os.listdir(tmp_path) == ["out.h5"]
    with atomic.staging(str(dest)) as tmp:  # it existed when this write began: --force replaces it
        with open(tmp, "wb") as fh:
            fh.write(b"mine")
    assert dest.read_bytes() == b"mine" and os.listdir(tmp_path) == ["out.h5"]


def test_a_directory_that_appeared_during_the_write_is_left_as_it_is(tmp_path, renames):
    from qgcli.errors import OutputError
    from qgcli.storage import atomic

    staging = atomic.new_temp_dir(str(tmp_path), [])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "theirs").write_text("x")
    with pytest.raises(OutputError, match="appeared"):
        atomic.commit_directory(staging, str(tmp_path / "out"), replace=False)
    assert os.listdir(tmp_path / "out") == ["theirs"]
    atomic.discard_directory(staging)
    assert os.listdir(tmp_path) == ["out"]


def test_force_over_a_directory_swaps_it_and_keeps_its_other_files(tmp_path, renames):
    from qgcli.storage import atomic

    old = tmp_path / "out"
    (old / "sub").mkdir(parents=True)
    (old / "a.npy").write_text("old a")
    (old / "keep.txt").write_text("kept")
    (old / "sub" / "deep.txt").write_text("deep")
    os.symlink("keep.txt", old / "link")
    os.chmod(old, 0o750)
    staging = atomic.new_temp_dir(str(tmp_path), [])
    with open(os.path.join(staging, "a.npy"), "w") as fh:
        fh.write("new a")
    atomic.commit_directory(staging, str(old), replace=True, merge=True)
    assert (old / "a.npy").read_text() == "new a" and (old / "keep.txt").read_text() == "kept"
    assert (old / "sub" / "deep.txt").read_text() == "deep" and os.readlink(old / "link") == "keep.txt"
    assert os.stat(old).st_mode & 0o777 == 0o750 and os.listdir(tmp_path) == ["out"]


# --- SIGKILL inside the commit of --force: the name always holds a whole store; the next run tidies -----

KILLED_COMMIT = textwrap.dedent("""
    import os, signal, sys
    from qgcli.storage import atomic
    staging, dest, where, fallback = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
    if fallback:
        atomic._renameat2.append(None)
    die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    if where == "before-removing-the-old":
        atomic.shutil.rmtree = die
    else:  # between the two renames of the fallback
        real, calls = os.rename, []
        def rename(src, dst):
            calls.append(src)
            if len(calls) == 2:
                die()
            return real(src, dst)
        atomic.os.rename = rename
    atomic.hold(staging)
    atomic.commit_directory(staging, dest, replace=True)
""")


@pytest.mark.parametrize("where,fallback", [("before-removing-the-old", False), ("before-removing-the-old", True),
                                            ("between-the-renames", True)])
def test_sigkill_inside_a_forced_commit_leaves_a_whole_directory_and_the_next_run_tidies(tmp_path, where,
                                                                                          fallback):
    from qgcli.storage import atomic

    if not fallback and not atomic.exchange(str(tmp_path), str(tmp_path)):
        pytest.skip("this file system cannot swap two names (renameat2 RENAME_EXCHANGE)")
    dest = tmp_path / "out.zarr"
    dest.mkdir()
    (dest / "zarr.json").write_text("old")
    staging = tmp_path / ".qgcli-0123456789abcdef.tmp.zarr"
    staging.mkdir()
    (staging / "zarr.json").write_text("new")
    proc = subprocess.run([sys.executable, "-c", KILLED_COMMIT, staging, dest, where, "1" if fallback else "0"],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    left = sorted(n for n in os.listdir(tmp_path) if n.startswith(".qgcli-"))
    if where == "between-the-renames":  # the only moment a name is missing: the old store waits aside
        assert not dest.exists() and len(left) == 2 and ".old~out.zarr" in left[1]  # and the new one, unused
        assert atomic.sweep(str(tmp_path)) == ["out.zarr"]
        assert (dest / "zarr.json").read_text() == "old"
    else:
        assert (dest / "zarr.json").read_text() == "new" and len(left) == 1
        assert atomic.sweep(str(tmp_path)) == []
        assert (dest / "zarr.json").read_text() == "new"
    assert os.listdir(tmp_path) == ["out.zarr"]


def test_sweep_leaves_the_directories_of_a_live_run_alone(tmp_path):
    from qgcli.storage import atomic

    made = []
    live = atomic.new_temp_dir(str(tmp_path), made)
    dead = tmp_path / ".qgcli-fedcba9876543210.tmpdir"
    dead.mkdir()
    (tmp_path / ".qgcli-0000000000000000.tmp").write_text("a file: never swept")
    atomic.sweep(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(live), ".qgcli-0000000000000000.tmp"])
    atomic.discard_directory(live)


@pytest.mark.parametrize("kind", ["zarr", "dir"])
def test_the_next_run_puts_back_a_store_a_killed_run_left_aside(cli, bundle, tmp_path, kind):
    """What a run killed between the fallback's two renames leaves (the old output aside, none at the name):
    the next qgcli run writing there restores it first, then refuses to replace it without --force."""
    if kind == "zarr":
        pytest.importorskip("zarr")
    name = "out.zarr" if kind == "zarr" else "out"
    target = str(tmp_path / name) + ("" if kind == "zarr" else "/")
    assert cli("fakequant-grad", bundle, "-o", target, "-q").exit_code == 0
    aside = tmp_path / f".qgcli-0123456789abcdef.old~{name}"
    os.rename(tmp_path / name, aside)
    result = cli("fakequant-grad", bundle, "-o", target, "--force", "-q")
    assert result.exit_code == 0, result.output
    assert sorted(os.listdir(tmp_path)) == [name]


# --- the long campaign: SIGKILL at random moments of a --force replacement --------------------------------

@pytest.mark.slow
@pytest.mark.skipif(not LONG, reason="long campaign: QGCLI_LONG=1")
@pytest.mark.parametrize("kind", ["zarr", "dir"])
def test_sigkill_campaign_over_forced_replacements(bundle, tmp_path, kind):
    import random
    import time

    if kind == "zarr":
        pytest.importorskip("zarr")
    name = "out.zarr" if kind == "zarr" else "out"
    target = str(tmp_path / name) + ("" if kind == "zarr" else "/")
    first = qgcli("fakequant-grad", bundle, "-o", target, "-q")
    assert first.wait(timeout=300) == 0
    first.communicate()
    rng = random.Random(int(os.environ.get("QGCLI_SEED", "41")))
    for trial in range(RACES):
        proc = qgcli("fakequant-grad", bundle, "-o", target, "--force", "-q")
        time.sleep(rng.uniform(0.3, 3.0))
        proc.kill()
        proc.communicate()
        assert os.path.isdir(tmp_path / name), f"trial {trial}: no {name} at all"
        if kind == "zarr":  # a whole store, old or new: every array reads
            import zarr

            group = zarr.open_group(str(tmp_path / name), mode="r")
            assert sorted(n for n, _ in group.members()) == sorted(OUTPUTS), trial
            for _, node in group.members():
                node[...]
        else:
            assert sorted(os.listdir(tmp_path / name)) == sorted(f"{n}.npy" for n in OUTPUTS), trial
            for n in OUTPUTS:
                np.load(tmp_path / name / f"{n}.npy")
        nxt = qgcli("fakequant-grad", bundle, "-o", target, "--force", "-q")  # tidies, then replaces
        assert nxt.wait(timeout=300) == 0
        nxt.communicate()
        assert sorted(os.listdir(tmp_path)) == [name]
    print(f"\n{kind}: {RACES} SIGKILLs during --force; the name held a whole output every time")


OUTPUTS = ("backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max")
