"""qgcli.storage.hdf5.small makes the objects h5py's high-level calls make: the two files come out byte for byte equal."""
import h5py
import numpy as np
import pytest

from qgcli.storage.hdf5.small import SmallWriter

ATTRS = {"qgcli_version": "1.0", "op": "FakeQuantWithMinMaxVarsPerChannelGradient", "num_bits": 8,
         "narrow_range": False, "min": -0.5, "unicode": "µ-law", "vector": np.arange(3, dtype=np.int16)}


def arrays(rng):
    return {"backprops_wrt_input": rng.standard_normal((4, 6)).astype(np.float32),
            "backprop_wrt_min": rng.standard_normal(6).astype(np.float64),
            "counts": np.arange(5, dtype=">i4"), "mask": np.array([True, False]),
            "scalar": np.array(2.5, dtype=np.float32), "empty": np.zeros((0, 3), np.float32)}


def high_level(f, path, data, attrs):
    grp = f.require_group(path)
    for name, array in data.items():
        grp.create_dataset(name, data=array)
    for key, value in attrs.items():
        grp.attrs[key] = value


def low_level(f, path, data, attrs):
    writer = SmallWriter(f)
    gid = writer.group(path)
    grp = h5py.Group(gid)
    for name, array in data.items():
        if not writer.dataset(gid, name, array):
            grp.create_dataset(name, data=array)  # the caller's own call, as the run-file writer does
    writer.attributes(gid, attrs)


@pytest.mark.parametrize("paths", [["a/b/c"], ["x", "x/y"], ["/"], ["step_0/läyer 1", "step_0/läyer 2"]])
def test_same_file_bytes_as_h5py_high_level_calls(tmp_path, paths):
    rng = np.random.default_rng(0)
    content = [(p, arrays(rng)) for p in paths]
    files = {}
    for way, write in (("high", high_level), ("low", low_level)):
        files[way] = tmp_path / f"{way}.h5"
        with h5py.File(files[way], "w") as f:
            for path, data in content:
                write(f, path, data, ATTRS)
    with h5py.File(files["low"], "r") as f:  # what the low-level path was asked for is there
        grp = f[paths[-1]]
        np.testing.assert_array_equal(grp["backprops_wrt_input"][()], content[-1][1]["backprops_wrt_input"])
        assert grp.attrs["op"] == ATTRS["op"] and grp.attrs["narrow_range"] == np.False_
        assert grp["counts"].dtype == np.dtype(">i4") and grp["empty"].shape == (0, 3)
    assert files["low"].read_bytes() == files["high"].read_bytes()


def test_existing_attributes_are_replaced(tmp_path):
    with h5py.File(tmp_path / "f.h5", "w") as f:
        writer = SmallWriter(f)
        gid = writer.group("g")
        writer.attributes(gid, {"op": "a", "num_bits": 8})
        writer.attributes(gid, {"op": "b"})
        assert dict(f["g"].attrs) == {"op": "b", "num_bits": 8}
        assert writer.group("g") == gid  # an existing group is opened, not refused


def test_a_new_groups_attributes_take_no_lookup_but_a_bytes_key_still_replaces(tmp_path):
    """A group just made has no attributes to replace (no lookup per attribute); a bytes key spelling a str
    key's name, in the same call, still replaces it as ``attrs[key] = value`` would."""
    with h5py.File(tmp_path / "f.h5", "w") as f:
        writer = SmallWriter(f)
        gid = writer.group("g")
        writer.attributes(gid, {"op": "a", "num_bits": 8, b"op": "b"})
        assert dict(f["g"].attrs) == {"op": "b", "num_bits": 8}


def test_attributed_groups_hold_what_groups_made_one_by_one_hold(tmp_path):
    """attributed() copies a template group (made once per set of attributes, in memory): the copies hold the same
    attributes, of the same types, as a group made by child() and attributes(); 1 and True make two templates;
    a value no template can key (an array) makes the group one by one."""
    scalars = {k: v for k, v in ATTRS.items() if k != "vector"}
    with h5py.File(tmp_path / "f.h5", "w") as f:
        writer = SmallWriter(f)
        root = writer.group("/")
        for i in range(3):
            writer.attributed(root, f"copied/{i}", scalars)  # parents made, as child() makes them
        writer.attributes(writer.child(root, "made"), scalars, new=True)
        writer.attributed(root, "int", {"v": 1})
        writer.attributed(root, "bool", {"v": True})
        writer.attributed(root, "array", ATTRS)
        assert len(writer._made) == 3
        writer.close()
    with h5py.File(tmp_path / "f.h5", "r") as f:
        want = {k: (type(v), v) for k, v in f["made"].attrs.items()}
        assert want["op"] == (str, ATTRS["op"]) and set(want) == set(scalars)
        for i in range(3):
            assert {k: (type(v), v) for k, v in f[f"copied/{i}"].attrs.items()} == want
        assert type(f["int"].attrs["v"]) is np.int64 and type(f["bool"].attrs["v"]) is np.bool_
        assert f["array"].attrs["vector"].tolist() == [0, 1, 2] and f["array"].attrs["unicode"] == "µ-law"
