"""Large contiguous HDF5 datasets read on the pool (qgcli/storage/hdf5/contiguous.py): h5py's bytes, or h5py itself.

Real files: a contiguous dataset past the size threshold (odd length, user block, every thread count),
and the layouts that must go to h5py (chunked, compressed, big-endian, unallocated, small).
"""
import h5py
import numpy as np
import pytest

from qgcli.storage.hdf5 import contiguous as h5_contiguous
from qgcli.storage import io
from qgcli.errors import FileFormatError

BIG = h5_contiguous.MIN_BYTES // 4 + 12_345  # float32 values: past the threshold, not a whole piece


def read_both(path, key):
    with h5py.File(path, "r") as f:
        want = f[key][()]
        got = h5_contiguous.read(f[key], key)
    return got, want


@pytest.mark.parametrize("threads", ["1", "2", "3"])
@pytest.mark.parametrize("userblock", [0, 512])
def test_a_contiguous_dataset_reads_as_h5py_reads_it(tmp_path, monkeypatch, threads, userblock):
    monkeypatch.setenv("QGCLI_THREADS", threads)
    rng = np.random.default_rng(userblock)
    a = rng.standard_normal((BIG // 3 + 1, 3)).astype(np.float32)
    with h5py.File(tmp_path / "b.h5", "w", userblock_size=userblock) as f:
        f["small"] = np.arange(7, dtype=np.float32)  # its data comes first in the file
        f["a"] = a
    got, want = read_both(tmp_path / "b.h5", "a")
    assert got is not None and got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes() == a.tobytes()
    if userblock:
        return  # qgcli's own file checks look for HDF5's signature at byte 0
    container = io.Container.open(str(tmp_path / "b.h5"), None)
    try:
        assert container.read("a").tobytes() == a.tobytes()  # the path qgcli's commands take
    finally:
        container.close()


@pytest.mark.parametrize("dtype", [np.int16, np.uint8, np.float64])
def test_other_number_types(tmp_path, dtype):
    a = (np.arange(h5_contiguous.MIN_BYTES // np.dtype(dtype).itemsize + 3) % 251).astype(dtype)
    with h5py.File(tmp_path / "b.h5", "w") as f:
        f["a"] = a
    got, want = read_both(tmp_path / "b.h5", "a")
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


@pytest.mark.parametrize("layout", ["chunked", "gzip", "big-endian", "unallocated", "small"])
def test_other_layouts_are_left_to_h5py(tmp_path, layout):
    n = BIG if layout != "small" else 1000
    a = np.arange(n, dtype=np.float32)
    with h5py.File(tmp_path / "b.h5", "w") as f:
        if layout == "chunked":
            f.create_dataset("a", data=a, chunks=(1 << 16,))
        elif layout == "gzip":
            f.create_dataset("a", data=a, compression="gzip", compression_opts=1)
        elif layout == "big-endian":
            f.create_dataset("a", data=a.astype(">f4"))
        elif layout == "unallocated":
            f.create_dataset("a", shape=a.shape, dtype=np.float32)
        else:
            f["a"] = a
    got, want = read_both(tmp_path / "b.h5", "a")
    assert got is None
    container = io.Container.open(str(tmp_path / "b.h5"), None)
    try:
        assert np.array_equal(container.read("a"), want)
    finally:
        container.close()


def test_a_file_cut_inside_the_data_is_refused(tmp_path):
    with h5py.File(tmp_path / "b.h5", "w") as f:
        f["a"] = np.ones(BIG, np.float32)
    size = (tmp_path / "b.h5").stat().st_size
    with open(tmp_path / "b.h5", "r+b") as fh:
        fh.truncate(size - 4096)
    with pytest.raises(FileFormatError, match="b.h5"):  # HDF5 notices at open, or the read does
        container = io.Container.open(str(tmp_path / "b.h5"), None)
        try:
            container.read("a")
        finally:
            container.close()
