"""qgcli.collector: the garbage collector paused over bulk work, and restored as it was."""
import gc

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from qgcli import collector
from qgcli.cli import main


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()  # as it was, whatever the test left


def test_paused_restores_the_state_it_found(collector_on):
    with collector.paused():
        assert not gc.isenabled()
        with collector.paused():  # nested
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner pause leaves the outer one paused
    assert gc.isenabled()
    with pytest.raises(KeyError), collector.paused():
        raise KeyError("x")
    assert gc.isenabled()  # restored on the way out of an error too
    with collector.paused(when=False):
        assert gc.isenabled()  # left alone (a Dask cluster's threads share the process)
    gc.disable()
    with collector.paused():
        pass
    assert not gc.isenabled()  # paused before: stays paused


def _collections_during(args):
    """How many collections ran while the command ran in this process (its imports made beforehand)."""
    runner = CliRunner()
    assert runner.invoke(main, args).exit_code == 0  # the command's modules imported
    starts = []

    def count(phase, info):
        if phase == "start":
            starts.append(info["generation"])

    gc.collect()
    gc.callbacks.append(count)
    try:
        r = runner.invoke(main, args)
    finally:
        gc.callbacks.remove(count)
    assert r.exit_code == 0, r.output
    assert gc.isenabled()
    return len(starts)


def test_a_listing_and_a_run_file_run_without_collections(tmp_path, collector_on):
    """inspect, report and fakequant-grad over 300 groups: thousands of containers made, no collection in
    the loop (without the pause, the collector ran every 700 of them: 8 to 22 passes here)."""
    path = tmp_path / "run.h5"
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        for i in range(300):
            g = f.create_group(f"g{i:04d}")
            g.attrs["op"] = "FakeQuantWithMinMaxArgs"
            g["inputs"] = rng.standard_normal(2).astype(np.float32)
            g["gradients"] = rng.standard_normal(2).astype(np.float32)
    for args in (["inspect", str(path), "--json"], ["report", str(path), "--json", "-q"],
                 ["fakequant-grad", str(path), "-o", str(tmp_path / "out.h5"), "--force", "-q", "--json"]):
        # a few around the command itself (click's parsing, the runner's capture), none per group
        assert _collections_during(args) <= 3, args
