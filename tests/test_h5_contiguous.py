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


@pytest.mark.parametrize("userblock", [0, 512])
def test_small_plain_datasets_stored_as_is_read_at_their_offset(tmp_path, monkeypatch, userblock):
    """read_plain_dataset(..., fd) reads a dataset whose type stores its dtype as is (h5.stored_as; a run file's
    small operands, discovery's read-ahead) as bytes at its offset, a big-endian one read as big-endian too; a
    type h5py converts (an enum read as its integers), a compact or chunked layout, or no descriptor, are read
    by HDF5 as before, with the same values."""
    import os

    from qgcli.storage import h5

    rng = np.random.default_rng(3)
    path = tmp_path / "small.h5"
    with h5py.File(path, "w", userblock_size=userblock) as f:
        f["native"] = rng.standard_normal((5, 7)).astype(np.float32)
        f["int16"] = np.arange(-3, 4, dtype=np.int16)
        f["big_endian"] = rng.standard_normal(6).astype(">f8")
        f.create_dataset("enum", data=np.array([0, 1, 1], np.int8), dtype=h5py.enum_dtype({"a": 0, "b": 1}))
        f.create_dataset("compact", data=np.arange(4.0), dcpl=_compact())
        f.create_dataset("chunked", data=np.arange(10.0), chunks=(4,))
        f["last"] = rng.standard_normal(300).astype(np.float32)  # its data end the file
    reads = []
    real = os.preadv
    monkeypatch.setattr(h5.os, "preadv", lambda *a: reads.append(1) or real(*a))
    as_is = {"native", "int16", "big_endian", "compact", "chunked", "last"}  # (compact, chunked: no offset)
    with h5py.File(path, "r") as f:
        fd = h5.file_descriptor(f)
        assert fd >= 0
        for name in ("native", "int16", "big_endian", "enum", "compact", "chunked", "last"):
            ds = f[name]
            dtype, stored = h5.stored_as(ds.id)
            assert stored == (name in as_is) and dtype == ds.dtype, name
            read_as = np.dtype(str(dtype))  # as discovery reads it: an enum as its integers
            for descriptor in (fd, -1):
                del reads[:]
                got = h5.read_plain_dataset(ds.id, ds.shape, read_as, descriptor if stored else -1)
                np.testing.assert_array_equal(got, ds[()].astype(read_as))
                assert got.dtype == read_as and got.shape == ds.shape, name
                assert len(reads) == (descriptor >= 0 and name in ("native", "int16", "big_endian", "last")), name
    with h5py.File(path, "r", driver="core") as f:
        assert h5.file_descriptor(f) == -1


def _compact():
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.COMPACT)
    return dcpl
