"""Run files on a real dask.distributed cluster (issue 20): every output bit for bit the local run's."""
import json
import os
import time

import h5py
import numpy as np
import pytest

distributed = pytest.importorskip("distributed")

from test_runfile import make_run  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    """A LocalCluster of 2 worker processes (1 thread each), started once for this module."""
    import logging

    started = time.monotonic()
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                                  silence_logs=logging.ERROR) as c:
        assert time.monotonic() - started < 20
        yield c.scheduler_address


@pytest.fixture(scope="module")
def run_path(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dask")
    path = folder / "run.h5"
    make_run(path, steps=("step_1", "step_2"), bad=True)
    return str(path)


def _walk(f):
    items = {}
    f.visititems(lambda name, node: items.__setitem__(name, node))
    return items


def _same_h5(a, b):
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        na, nb = _walk(fa), _walk(fb)
        assert sorted(na) == sorted(nb) and na
        for name, node in na.items():
            other = nb[name]
            assert sorted(node.attrs) == sorted(other.attrs), name
            for key in node.attrs:
                assert np.array_equal(np.asarray(node.attrs[key]), np.asarray(other.attrs[key])), (name, key)
            if isinstance(node, h5py.Dataset):
                assert node.dtype == other.dtype and node.shape == other.shape, name
                assert node[()].tobytes() == other[()].tobytes(), name
    with open(a, "rb") as fa, open(b, "rb") as fb:  # and the files themselves, byte for byte
        assert fa.read() == fb.read()


def _summary(result):
    assert result.exit_code == 0, result.output
    s = json.loads(result.stdout)
    s.pop("output")
    return s


def _same_summary(local, remote, workers=2):
    cluster = remote.pop("cluster")
    assert cluster["workers"] == workers and cluster["tasks"] == remote["ran"]
    assert remote == local


CASES = [
    ("fakequant-grad", ()),
    ("fakequant", ()),
    ("fakequant-grad", ("--estimator", "lsq", "--num-bits", "3")),
    ("bn-grad", ("--all-outputs",)),
]


@pytest.mark.parametrize("command,extra", CASES, ids=lambda v: " ".join(v) if isinstance(v, tuple) else v)
def test_h5_outputs_are_the_local_runs_bit_for_bit(cli, cluster, run_path, tmp_path, command, extra):
    local, remote = tmp_path / "local.h5", tmp_path / "remote.h5"
    args = (command, run_path, "--skip-invalid", "--json", *extra)
    a = _summary(cli(*args, "-o", local))
    b = _summary(cli(*args, "-o", remote, "--scheduler", cluster))
    _same_summary(a, b)
    assert a["ran"] >= 2
    _same_h5(local, remote)


@pytest.mark.parametrize("suffix", [".npz", "/", ".safetensors"])
def test_other_outputs_are_the_local_runs_bit_for_bit(cli, cluster, run_path, tmp_path, suffix):
    if suffix == ".safetensors":
        pytest.importorskip("safetensors")
    local, remote = str(tmp_path / "local") + suffix, str(tmp_path / "remote") + suffix
    args = ("fakequant-grad", run_path, "--skip-invalid", "--json")
    _same_summary(_summary(cli(*args, "-o", local)), _summary(cli(*args, "-o", remote, "--scheduler", cluster)))
    if suffix == "/":
        files = sorted(os.path.relpath(os.path.join(d, f), local) for d, _, fs in os.walk(local) for f in fs)
        assert files == sorted(os.path.relpath(os.path.join(d, f), remote) for d, _, fs in os.walk(remote) for f in fs)
        assert files
        for rel in files:
            with open(os.path.join(local, rel), "rb") as fa, open(os.path.join(remote, rel), "rb") as fb:
                assert fa.read() == fb.read(), rel
    else:
        with open(local, "rb") as fa, open(remote, "rb") as fb:
            assert fa.read() == fb.read()


def test_a_refused_group_refuses_the_run_as_locally_and_writes_nothing(cli, cluster, run_path, tmp_path):
    local, remote = tmp_path / "local.h5", tmp_path / "remote.h5"
    a = cli("fakequant-grad", run_path, "-o", local)
    b = cli("fakequant-grad", run_path, "-o", remote, "--scheduler", cluster)
    assert a.exit_code == b.exit_code != 0
    assert a.output == b.output
    assert not local.exists() and not remote.exists()


def test_local_n_starts_a_cluster_for_the_command(cli, run_path, tmp_path):
    local, remote = tmp_path / "local.h5", tmp_path / "remote.h5"
    args = ("fakequant-grad", f"{run_path}:step_1", "--json")
    a = _summary(cli(*args, "-o", local))
    b = _summary(cli(*args, "-o", remote, "--scheduler", "local:1"))
    _same_summary(a, b, workers=1)
    _same_h5(local, remote)


def test_refusals(cli, cluster, run_path, tmp_path, monkeypatch):
    from qgcli import executors_dask

    out = tmp_path / "out.h5"
    r = cli("fakequant-grad", run_path, "--skip-invalid", "-o", out, "--scheduler", cluster, "--memory-limit", "1G")
    assert r.exit_code != 0 and "--memory-limit" in r.output
    with h5py.File(tmp_path / "one.h5", "w") as f:
        f["inputs"] = np.zeros(3, np.float32)
    r = cli("fakequant", tmp_path / "one.h5", "--min", "-1", "--max", "1", "-o", out, "--scheduler", cluster)
    assert r.exit_code != 0 and "--scheduler" in r.output and "run file" in r.output
    monkeypatch.setattr(executors_dask, "CONNECT_TIMEOUT_S", 1)
    started = time.monotonic()
    r = cli("fakequant", run_path, "--skip-invalid", "-o", out, "--scheduler", "tcp://127.0.0.1:9")
    assert time.monotonic() - started < 10
    assert r.exit_code != 0 and "no Dask scheduler answered at tcp://127.0.0.1:9" in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not out.exists()
