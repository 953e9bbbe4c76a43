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


def objects(path):
    """Every object of an HDF5 file as h5py reads it (benchmarks/same_outputs.py's ``--h5-content`` comparison:
    path, kind, shape, dtype, bytes, layout, filters, fill value, attributes with their types)."""
    import importlib.util
    import os
    import sys

    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    sys.path.insert(0, here)  # same_outputs imports its neighbour weight_runs
    try:
        spec = importlib.util.spec_from_file_location("same_outputs", os.path.join(here, "same_outputs.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(here)
    return module.h5_objects(path)


@pytest.mark.parametrize("paths", [["a/b/c"], ["x", "x/y", "x/z"], ["g1", "g2"], ["step_0/läyer 1", "step_0/läyer 2"]])
def test_layers_written_at_offsets_hold_what_h5py_high_level_calls_make(tmp_path, paths):
    """A run file's output group made by layer() (a template copy, its parents made) with its arrays by
    written_at() (allocated, bytes written at the offset) holds the objects h5py's calls make; what
    written_at() does not take (big-endian, empty) goes to h5py's call, and a path that exists (a parent
    made for a group before it) or the root is left to the caller."""
    rng = np.random.default_rng(1)
    scalars = {k: v for k, v in ATTRS.items() if k != "vector"}
    content = [(p, arrays(rng)) for p in paths]
    with h5py.File(tmp_path / "high.h5", "w") as f:
        for path, data in content:
            high_level(f, path, data, scalars)
    taken = []
    with h5py.File(tmp_path / "low.h5", "w") as f:
        writer = SmallWriter(f)
        for path, data in content:
            gid = writer.layer(path, scalars)
            assert gid is not None
            for name, array in data.items():
                if writer.written_at(gid, name, array):
                    taken.append(name)
                else:
                    h5py.Group(gid).create_dataset(name, data=array)
        assert writer.layer(paths[0], scalars) is None and writer.layer("/", scalars) is None
        writer.close()
    assert set(taken) == {"backprops_wrt_input", "backprop_wrt_min", "mask", "scalar"}
    assert objects(tmp_path / "low.h5") == objects(tmp_path / "high.h5")
    with h5py.File(tmp_path / "low.h5", "r") as low:
        assert low[paths[-1]]["scalar"].shape == ()
        assert low[paths[-1]]["backprops_wrt_input"].id.get_create_plist().get_fill_time() == h5py.h5d.FILL_TIME_NEVER


def test_written_at_leaves_other_drivers_and_strided_arrays_to_h5py(tmp_path):
    with h5py.File(tmp_path / "f.h5", "w") as f:
        writer = SmallWriter(f)
        gid = writer.group("g")
        assert not writer.written_at(gid, "strided", np.arange(10.0)[::2])
        assert writer.written_at(gid, "plain", np.arange(10.0)[::2].copy())
        assert list(f["g"]) == ["plain"] and f["g/plain"][()].tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]
    with h5py.File("in-memory", "w", driver="core", backing_store=False) as f:
        writer = SmallWriter(f)
        assert not writer.written_at(writer.group("g"), "x", np.ones(3))  # no file descriptor to write at


def test_repeated_attributes_make_a_template_from_their_second_group(tmp_path):
    """layer() copies a template only for attributes met before: a run file whose outputs' attributes differ
    from group to group (an Args layer's own range) would pay a template for each copy."""
    with h5py.File(tmp_path / "f.h5", "w") as f:
        writer = SmallWriter(f)
        writer.layer("a/one", {"op": "x", "min": -1.0})
        assert writer._made == {}
        writer.layer("a/two", {"op": "x", "min": -2.0})
        writer.layer("b/three", {"op": "x", "min": -1.0})
        writer.layer("b/four", {"op": "x", "min": -1.0})
        assert len(writer._made) == 1
        writer.close()
    with h5py.File(tmp_path / "f.h5", "r") as f:
        assert [f[p].attrs["min"] for p in ("a/one", "a/two", "b/three", "b/four")] == [-1.0, -2.0, -1.0, -1.0]


def test_layers_written_from_templates_hold_what_h5py_high_level_calls_make(tmp_path, monkeypatch):
    """layer_written() copies a template holding the group's attributes and its datasets, each array written
    into the template first: the same objects and bytes as h5py's calls.  A template is for one set of
    attributes, dataset names, shapes and dtypes, made when the set is met a second time: a group whose arrays
    differ in shape, dtype or name (or whose attributes differ) never takes another's template."""
    from qgcli.storage.hdf5 import small

    monkeypatch.setattr(small, "MAX_FILLED_TEMPLATES", 3)
    rng = np.random.default_rng(2)
    scalars = {k: v for k, v in ATTRS.items() if k != "vector"}
    kinds = [((4, 6), np.float32, "w"), ((6, 4), np.float32, "w"), ((4, 6), np.float64, "w"), ((4, 6), np.float32, "v"),
             ((4, 6), np.float32, "w", 4)]
    content, expected = [], []
    for i in range(15):
        shape, dtype, name, *bits = kinds[i % len(kinds)]
        attrs = dict(scalars, num_bits=bits[0]) if bits else scalars
        data = {name: rng.standard_normal(shape).astype(dtype), "mask": rng.standard_normal(shape[-1]) > 0,
                "scalar": np.array(i, np.int64)}
        content.append((f"step_0/layer_{i // 2}/q{i}", data, attrs))
        expected.append(i >= len(kinds) and i % len(kinds) < 3)  # from the second meeting, 3 templates at most
    with h5py.File(tmp_path / "high.h5", "w") as f:
        for path, data, attrs in content:
            high_level(f, path, data, attrs)
    with h5py.File(tmp_path / "low.h5", "w") as f:
        writer = SmallWriter(f)
        for (path, data, attrs), templated in zip(content, expected):
            assert writer.layer_written(path, attrs, data) == templated, path
            if not templated:  # as the run-file writer goes on
                gid = writer.layer(path, attrs)
                for name, array in data.items():
                    assert writer.written_at(gid, name, array)
        assert len(writer._filled) == 3
        big = {"w": np.zeros(small.TEMPLATE_DATA_BYTES // 4 + 1, np.float32)}
        assert not writer.layer_written(content[0][0], content[0][2], content[0][1])  # it exists: nothing made
        for _ in range(2):
            assert not writer.layer_written("big", scalars, big)  # over the bytes a template holds
            assert not writer.layer_written("other", scalars, {"x": np.arange(3, dtype=">i4")})  # h5py's call
        assert not writer.layer_written("/", scalars, content[0][1])
        writer.close()
    assert objects(tmp_path / "low.h5") == objects(tmp_path / "high.h5")
    with h5py.File(tmp_path / "low.h5", "r") as low:
        assert "big" not in low and "other" not in low
        for path, data, _ in content:
            for name, array in data.items():
                assert low[path][name].dtype == array.dtype and np.array_equal(low[path][name][()], array)
        assert low[content[-1][0]][next(iter(content[-1][1]))].id.get_create_plist().get_fill_time() == \
            h5py.h5d.FILL_TIME_NEVER
