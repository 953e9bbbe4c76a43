"""Shell pipelines through real pipes: figures on stdout, HDF5 bundles on stdin."""
import io
import os
import pty
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import ROOT, SAMPLES

NOTEBOOK = os.path.join(SAMPLES, "notebook.h5")
PER_CHANNEL = os.path.join(SAMPLES, "per_channel.h5")
SIGNATURES = {"png": b"\x89PNG\r\n\x1a\n", "svg": b"<?xml", "pdf": b"%PDF-"}


def qgcli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "qgcli", *map(str, args)], cwd=ROOT, input=stdin,
                          capture_output=True, timeout=120)


@pytest.mark.parametrize("fmt", ["png", "svg", "pdf"])
def test_a_figure_goes_to_stdout(fmt):
    args = ["plot", "staircase", NOTEBOOK, "--num-bits", "2", "-o", "-"] + (["--format", fmt] if fmt != "png" else [])
    r = qgcli(*args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(SIGNATURES[fmt])
    assert r.stderr.decode().startswith("wrote stdout (")  # notes on stderr, nothing else on stdout
    if fmt == "png":
        import matplotlib.image

        assert matplotlib.image.imread(io.BytesIO(r.stdout), format="png").shape[:2] == (480, 640)


def test_format_overrides_the_extension(tmp_path):
    out = tmp_path / "figure.dat"
    r = qgcli("plot", "hist", NOTEBOOK, "-o", out, "--format", "svg")
    assert r.returncode == 0, r.stderr
    assert out.read_bytes().startswith(SIGNATURES["svg"])


def test_json_and_a_figure_on_stdout_are_refused_before_any_work():
    r = qgcli("plot", "hist", NOTEBOOK, "-o", "-", "--json")
    assert r.returncode == 2 and r.stdout == b""
    assert r.stderr.decode().startswith("Error: --json and -o - both want stdout")


def test_a_figure_is_not_written_to_a_terminal():
    leader, follower = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "qgcli", "plot", "hist", NOTEBOOK, "-o", "-"], cwd=ROOT,
                                stdout=follower, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        os.close(follower)
        follower = None
        _, err = proc.communicate(timeout=120)
    finally:
        if follower is not None:
            os.close(follower)
        os.close(leader)
    assert proc.returncode == 2
    assert err.decode().startswith("Error: --output: refusing to write a binary figure to a terminal")


def test_an_hdf5_bundle_through_stdin_equals_the_file(tmp_path):
    by_pipe, by_name = tmp_path / "pipe.h5", tmp_path / "name.h5"
    with open(PER_CHANNEL, "rb") as fh:
        data = fh.read()
    assert qgcli("fakequant-grad", "-", "-o", by_pipe, "-q", stdin=data).returncode == 0
    assert qgcli("fakequant-grad", PER_CHANNEL, "-o", by_name, "-q").returncode == 0
    with h5py.File(by_pipe, "r") as a, h5py.File(by_name, "r") as b:
        assert sorted(a) == sorted(b) == ["backprop_wrt_max", "backprop_wrt_min", "backprops_wrt_input"]
        for key in b:
            np.testing.assert_array_equal(a[key][()], b[key][()])
    r = qgcli("inspect", "-", "--json", stdin=data)
    assert r.returncode == 0, r.stderr
    with open(NOTEBOOK, "rb") as fh:
        r2 = qgcli("plot", "ste", "-", "--num-bits", "2", "-o", "-", stdin=fh.read())
    assert r2.returncode == 0 and r2.stdout.startswith(SIGNATURES["png"]), r2.stderr


def test_a_key_of_an_hdf5_stream():
    from qgcli.storage import io as qio

    with open(PER_CHANNEL, "rb") as fh:
        stdin = qio.Stdin(io.BytesIO(fh.read()))
    with h5py.File(PER_CHANNEL, "r") as f:
        want = f["inputs"][()]
    np.testing.assert_array_equal(qio.load_spec(qio.parse_spec("-:inputs"), stdin), want)


def test_a_stream_over_the_memory_limit_is_refused_without_reading_it_all():
    from qgcli.storage import io as qio
    from qgcli.errors import FileFormatError

    stream = io.BytesIO(b"\x89HDF\r\n\x1a\n" + bytes(5000))
    with pytest.raises(FileFormatError, match="stdin holds more than"):
        qio.Stdin(stream, limit=1000).read()
    assert stream.tell() <= 1001


def _readme_pipelines():
    with open(os.path.join(ROOT, "docs", "guarantees.md")) as fh:  # the README's Pipelines section moved there
        text = fh.read()
    block = text.split("## Pipelines", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


@pytest.mark.parametrize("line", _readme_pipelines())
def test_the_readme_pipelines_run_as_written(line, tmp_path):
    """Each line of the README's Pipelines block, through a real shell in ``tmp_path`` (``qgcli`` is this
    checkout's ``python -m qgcli``; ``samples/`` is linked in)."""
    import shlex

    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    shim = tmp_path / "qgcli"
    shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m qgcli \"$@\"\n")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    shim.chmod(0o755)
    os.symlink(os.path.join(ROOT, "samples"), tmp_path / "samples")
    r = subprocess.run(["bash", "-o", "pipefail", "-c", line], cwd=tmp_path, env=env, capture_output=True,
                       timeout=120)
    assert r.returncode == 0, (line, r.stderr.decode())
    if line.endswith("/"):  # a folder of figures, one per layer
        pngs = list((tmp_path / line.rsplit(" ", 1)[1]).rglob("*.png"))
        assert len(pngs) > 1 and all(p.read_bytes().startswith(SIGNATURES["png"]) for p in pngs), line
    elif ">" in line:
        written = tmp_path / line.rsplit(">", 1)[1].strip()
        fmt = written.suffix[1:]
        assert written.read_bytes().startswith(SIGNATURES[fmt]), line
    else:
        assert b"channels" in r.stdout, r.stdout
