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
    assert cluster["workers"] == workers and cluster["tasks"] == remote["ran"] and cluster["wait_s"] >= 0
    assert cluster["scheduler"].startswith("tcp://")
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
    from qgcli.execution import cluster as executors_dask

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
    assert r.exit_code == 1 and "no Dask scheduler answered at tcp://127.0.0.1:9" in r.output
    assert len(r.output.strip().splitlines()) == 1
    assert not out.exists()


def test_report_and_verify_on_the_cluster_give_the_local_documents(cli, cluster, run_path, tmp_path):
    from test_verify import _write

    a = _summary_doc(cli("report", run_path, "--json"))
    b = _summary_doc(cli("report", run_path, "--json", "--scheduler", cluster))
    described = b.pop("cluster")
    assert described["scheduler"] == cluster and described["workers"] == 2
    assert len(a["layers"]) <= described["tasks"] <= len(a["layers"]) + len(a["skipped"])  # a task per quantizer
    assert a == b and a["layers"]
    for perturb, code in ((None, 0), ("fq", 1)):
        path = tmp_path / f"captured-{perturb}.h5"
        _write(str(path), perturb=perturb)
        local, remote = cli("verify", path, "--json"), cli("verify", path, "--json", "--scheduler", cluster)
        assert local.exit_code == remote.exit_code == code, remote.output
        doc = json.loads(remote.stdout)
        assert doc.pop("cluster")["tasks"] == doc["groups"] == 3
        assert doc == json.loads(local.stdout)
    r = cli("report", run_path, "--layer", "step_1/conv1/weight_quant", "--scheduler", cluster)
    assert r.exit_code == 2 and "--scheduler" in r.output


def _summary_doc(result):
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# --- Zarr tensors in row blocks on the cluster (the workers read and write the stores themselves) -----------

@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    from test_zarr import make_store

    return make_store(tmp_path_factory.mktemp("dask-zarr") / "big.zarr", 3, shape=(3000, 7, 8), chunks=100)


def _same_store(a, b):
    """Two stores file for file, byte for byte (same chunking, same codecs: the same bits)."""
    files = sorted(os.path.relpath(os.path.join(d, f), a) for d, _, fs in os.walk(a) for f in fs)
    assert files == sorted(os.path.relpath(os.path.join(d, f), b) for d, _, fs in os.walk(b) for f in fs)
    assert len(files) > 30
    for rel in files:
        with open(os.path.join(a, rel), "rb") as fa, open(os.path.join(b, rel), "rb") as fb:
            assert fa.read() == fb.read(), rel


@pytest.mark.parametrize("per_tensor", [False, True], ids=["per-channel", "per-tensor"])
def test_a_zarr_tensor_on_the_cluster_is_the_local_runs_bit_for_bit(cli, cluster, big_store, tmp_path, per_tensor,
                                                                    monkeypatch):
    from test_zarr import per_tensor as per_tensor_args, same_bits

    monkeypatch.setenv("QGCLI_TF_THREADS", "3")  # the client plans the sums: shards, as TF on 3 cores
    args = per_tensor_args(big_store) if per_tensor else (big_store,)
    assert cli("fakequant-grad", *args, "-o", tmp_path / "memory.zarr", "-q").exit_code == 0
    local = cli("fakequant-grad", *args, "-o", tmp_path / "local.zarr", "--memory-limit", "1M", "-q")
    assert local.exit_code == 0, local.output
    r = cli("fakequant-grad", *args, "-o", tmp_path / "remote.zarr", "--scheduler", cluster, "--json")
    s = json.loads(r.stdout)
    assert s["cluster"].pop("wait_s") > 0 and s["blocks"]["count"] == 30
    assert s["cluster"] == {"scheduler": cluster, "workers": 2, "tasks": 30}
    same_bits(tmp_path / "memory.zarr", tmp_path / "remote.zarr")
    _same_store(tmp_path / "local.zarr", tmp_path / "remote.zarr")


def test_bn_grad_of_a_zarr_tensor_on_the_cluster_is_the_local_runs_bit_for_bit(cli, cluster, tmp_path):
    from test_zarr import make_bn_store, same_bits

    store = make_bn_store(tmp_path / "bn.zarr", (80, 9, 7, 24))  # 2 MiB of operands: above 1M
    args = ("bn-grad", store, "--all-outputs", "-q")
    assert cli(*args, "-o", tmp_path / "memory.zarr").exit_code == 0
    assert cli(*args, "-o", tmp_path / "local.zarr", "--memory-limit", "1M").exit_code == 0
    r = cli(*args, "-o", tmp_path / "remote.zarr", "--scheduler", cluster, "--json")
    s = json.loads(r.stdout)
    assert s["blocks"]["passes"] == 2 and s["cluster"]["workers"] == 2
    assert s["cluster"]["tasks"] > s["blocks"]["count"]  # the sums pass, then the x_backprop pass
    same_bits(tmp_path / "memory.zarr", tmp_path / "remote.zarr")
    _same_store(tmp_path / "local.zarr", tmp_path / "remote.zarr")


@pytest.mark.parametrize("options", [("--semantics", "nvfp4"), ("--semantics", "mx", "--axis", "0")],
                         ids=["nvfp4-two-passes", "mx-axis0"])
def test_a_block_format_on_the_cluster_is_the_in_memory_run_bit_for_bit(cli, cluster, tmp_path, options):
    """NVFP4's amax pass, then its encode pass, as tasks (issue 38); MX's blocks along the first axis whole."""
    import zarr

    from test_zarr import same_bits

    rng = np.random.default_rng(38)
    x = rng.standard_normal((1024, 64)).astype(np.float32) * np.exp2(rng.integers(-6, 6, (1024, 1)))
    store = tmp_path / "x.zarr"
    zarr.open_group(str(store), mode="w").create_array("inputs", data=x.astype(np.float32), chunks=(100, 64))
    assert cli("fakequant", store, *options, "-o", tmp_path / "memory.zarr", "-q").exit_code == 0
    r = cli("fakequant", store, *options, "-o", tmp_path / "remote.zarr", "--scheduler", cluster, "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    two = options[1] == "nvfp4"
    assert s["cluster"]["workers"] == 2 and s["cluster"]["tasks"] == s["blocks"]["count"] * (2 if two else 1)
    same_bits(tmp_path / "memory.zarr", tmp_path / "remote.zarr")


def _wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _address(info):
    try:
        return json.loads(info.read_text())["address"]
    except (OSError, ValueError, KeyError):
        return None  # not written yet, or half-written


@pytest.fixture(scope="module")
def cli_cluster(tmp_path_factory):
    """A scheduler and two workers started with the ``dask scheduler`` / ``dask worker`` commands (no nanny:
    a killed worker stays dead); yields (address, worker processes)."""
    import signal
    import subprocess
    import sys

    folder = tmp_path_factory.mktemp("dask-cli")
    info = folder / "scheduler.json"
    dask_cli = [os.path.join(os.path.dirname(sys.executable), "dask")]
    log = open(folder / "log.txt", "wb")
    # The workers unpickle qgcli's functions: they must import the qgcli under test, not an installed one.
    import qgcli

    parent = os.path.dirname(os.path.dirname(os.path.abspath(qgcli.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (parent, os.environ.get("PYTHONPATH")) if p))
    procs = [subprocess.Popen([*dask_cli, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                               "--scheduler-file", str(info)], stdout=log, stderr=log, env=env)]
    try:
        _wait_for(lambda: _address(info), 30, "the scheduler file")
        workers = [subprocess.Popen([*dask_cli, "worker", "--scheduler-file", str(info), "--nthreads", "1",
                                     "--no-nanny", "--no-dashboard", "--host", "127.0.0.1"], stdout=log, stderr=log,
                                    env=env)
                   for _ in range(2)]
        procs += workers
        address = _address(info)
        with distributed.Client(address, timeout="30s") as client:
            client.wait_for_workers(2, timeout=30)
        yield address, workers
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in reversed(procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def test_the_dask_commands_cluster_gives_the_local_bits(cli, cli_cluster, run_path, big_store, tmp_path):
    from test_zarr import same_bits

    address, _ = cli_cluster
    args = ("fakequant-grad", run_path, "--skip-invalid", "--json")
    a = _summary(cli(*args, "-o", tmp_path / "local.h5"))
    _same_summary(a, _summary(cli(*args, "-o", tmp_path / "remote.h5", "--scheduler", address)))
    _same_h5(tmp_path / "local.h5", tmp_path / "remote.h5")
    assert cli("fakequant-grad", big_store, "-o", tmp_path / "local.zarr", "-q").exit_code == 0
    r = cli("fakequant-grad", big_store, "-o", tmp_path / "remote.zarr", "-q", "--scheduler", address)
    assert r.exit_code == 0, r.output
    same_bits(tmp_path / "local.zarr", tmp_path / "remote.zarr")


def test_a_worker_killed_mid_run_leaves_the_output_complete_and_identical(cli, cli_cluster, tmp_path):
    """Runs last in this module: it kills one of the command-line cluster's workers for good."""
    import glob
    import signal
    import subprocess
    import sys

    from test_zarr import make_store

    address, workers = cli_cluster
    store = make_store(tmp_path / "in.zarr", 3, shape=(2000, 32, 16), chunks=10)  # 200 blocks
    assert cli("fakequant-grad", store, "-o", tmp_path / "local.zarr", "-q", "--memory-limit", "4M").exit_code == 0
    out = tmp_path / "remote.zarr"
    proc = subprocess.Popen([sys.executable, "-m", "qgcli", "fakequant-grad", store, "-o", str(out), "-q",
                             "--scheduler", address], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        chunks = lambda: glob.glob(str(tmp_path / ".qgcli-*.tmp.zarr/backprops_wrt_input/c/*"))  # noqa: E731
        _wait_for(lambda: len(chunks()) >= 20 or proc.poll() is not None, 60, "the first chunks")
        assert proc.poll() is None, "the run ended before a worker could be killed"
        workers[0].send_signal(signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    workers[0].wait(timeout=10)
    assert proc.returncode == 0, stderr.decode()
    _same_store(tmp_path / "local.zarr", out)
    assert not glob.glob(str(tmp_path / ".qgcli-*"))


def test_dask_scheduler_address_is_the_default_where_a_cluster_applies(cli, cluster, run_path, big_store, tmp_path,
                                                                       monkeypatch):
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", cluster)
    r = cli("fakequant-grad", f"{run_path}:step_1", "-o", tmp_path / "run.h5", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["cluster"]["scheduler"] == cluster
    r = cli("fakequant-grad", big_store, "-o", tmp_path / "big.zarr", "--json", "-q")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["cluster"]["workers"] == 2
    with h5py.File(tmp_path / "one.h5", "w") as f:  # a bundle of an .h5 file: runs here, not refused
        f["inputs"] = np.zeros(3, np.float32)
    r = cli("fakequant", tmp_path / "one.h5", "--min", "-1", "--max", "1", "-o", tmp_path / "one-out.h5", "--json")
    assert r.exit_code == 0, r.output
    assert "cluster" not in json.loads(r.stdout)
    r = cli("report", run_path, "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["cluster"]["scheduler"] == cluster
