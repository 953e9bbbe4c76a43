"""qgcli.storage.hdf5.types.dtype_of (also qgcli.storage.h5.dtype_of): h5py's dtype of a dataset's or attribute's HDF5 type, converted once per distinct
type; a type that differs in any property (size, byte order, an enum's members, a string's length or character
set: HDF5's own comparison leaves a variable-length string's out) never takes another's dtype."""
import h5py
import numpy as np

from qgcli.storage import h5
from qgcli.storage.hdf5 import types

TYPES = {
    "f4": np.float32, "f8": np.float64, "f4 big-endian": ">f4", "i1": np.int8, "u1": np.uint8, "bool": np.bool_,
    "enum": h5py.enum_dtype({"a": 0, "b": 1}, basetype="i1"), "enum other members": h5py.enum_dtype({"a": 0, "c": 2},
                                                                                                    basetype="i1"),
    "str utf-8": h5py.string_dtype("utf-8"), "str ascii": h5py.string_dtype("ascii"), "S3": "S3", "S4": "S4",
    "compound": np.dtype([("x", np.float32), ("y", np.int16)]),
}


def write(path):
    with h5py.File(path, "w") as f:
        for name, dtype in TYPES.items():
            f.create_dataset(name, shape=(2,), dtype=dtype)
            f.attrs.create(name, np.zeros((), dtype=np.dtype(dtype)) if np.dtype(dtype).kind != "O" else "x",
                           dtype=dtype)
        named = f["named"] = np.dtype(np.float32)  # a committed type
        f.create_dataset("committed", shape=(2,), dtype=named)


def test_dtype_of_gives_h5pys_dtype_for_each_type_across_files(tmp_path, monkeypatch):
    monkeypatch.setattr(types, "_TYPES_MET", [])
    for i in range(2):  # the second file's types hit the first's, which was closed meanwhile
        write(tmp_path / f"{i}.h5")
        with h5py.File(tmp_path / f"{i}.h5", "r") as f:
            for name in list(TYPES) + ["committed"]:
                ds = f[name]
                got = h5.dtype_of(ds.id)
                assert got == ds.dtype and got.str == ds.dtype.str, name
                assert h5py.check_enum_dtype(got) == h5py.check_enum_dtype(ds.dtype), name
                string = h5py.check_string_dtype(ds.dtype)
                assert (string and string.encoding) == (h5py.check_string_dtype(got) and
                                                         h5py.check_string_dtype(got).encoding), name
                if name in TYPES:
                    attr = h5py.h5a.open(f.id, name.encode())
                    assert h5.dtype_of(attr) == attr.dtype and h5.dtype_of(attr).str == attr.dtype.str, name
        # the committed float32 is equal to the plain one; a compound is converted each time
        assert len(types._TYPES_MET) == len(TYPES) - 1


def test_dtype_of_keeps_a_bounded_number_of_types(tmp_path, monkeypatch):
    monkeypatch.setattr(types, "_TYPES_MET", [])
    monkeypatch.setattr(types, "MAX_TYPES_MET", 3)
    write(tmp_path / "f.h5")
    with h5py.File(tmp_path / "f.h5", "r") as f:
        for name in TYPES:
            assert h5.dtype_of(f[name].id) == f[name].dtype
    assert len(types._TYPES_MET) == 3 and [entry[2] for entry in types._TYPES_MET] == [np.float32, np.float64, ">f4"]
