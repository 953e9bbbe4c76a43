"""The guarded HDF5 reads (qgcli.storage.hdf5.guard) call HDF5 past h5py's lock: nothing else may call HDF5 meanwhile."""
import gc
import threading

import h5py
import numpy as np
import pytest
from h5py._objects import phil

from qgcli.storage.hdf5 import guard


def _lock_free_elsewhere():
    """Whether a thread other than the caller could take h5py's lock now."""
    got = []
    thread = threading.Thread(target=lambda: got.append(phil.acquire(False) and (phil.release() or True)))
    thread.start()
    thread.join()
    return got[0]


def test_no_other_hdf5_call_runs_while_a_guarded_read_does():
    seen = {}

    def call():  # on the guard's worker thread, where the ctypes read runs
        seen["lock free elsewhere"] = _lock_free_elsewhere()
        seen["collector on"] = gc.isenabled()
        return 7

    assert guard._run(call, lambda: "?") == 7
    assert seen == {"lock free elsewhere": False, "collector on": False}
    assert gc.isenabled() and _lock_free_elsewhere()  # both given back


def test_a_failed_guarded_call_releases_the_lock_and_restores_the_collector():
    def call():
        raise ValueError("no such attribute")

    gc.disable()
    try:
        with pytest.raises(ValueError, match="no such attribute"):
            guard._run(call, lambda: "?")
        assert not gc.isenabled()  # left as the caller had it
    finally:
        gc.enable()
    with pytest.raises(ValueError):
        guard._run(call, lambda: "?")
    assert gc.isenabled()


def test_guarded_string_attributes_read_alongside_h5py_on_other_threads(tmp_path):
    """Threads reading with h5py while the main thread reads string attributes through the guard: each read
    gives its value (they take turns on h5py's lock)."""
    path = tmp_path / "a.h5"
    with h5py.File(path, "w") as f:
        for i in range(40):
            f.attrs[f"s{i}"] = f"value {i}"
        f["x"] = np.arange(1000.0)
    stop, errors = threading.Event(), []

    def reader():
        with h5py.File(path, "r") as f:
            while not stop.is_set():
                if f["x"][10] != 10.0:
                    errors.append("bad read")

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        with h5py.File(path, "r") as f:
            for _ in range(20):
                attrs = [h5py.h5a.open(f.id, f"s{i}".encode()) for i in range(40)]
                values = guard.read_string_attributes(attrs, str(path))
                if values[0] is None:
                    pytest.skip("this platform's HDF5 library cannot be reached through ctypes")
                assert values == [f"value {i}" for i in range(40)]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
