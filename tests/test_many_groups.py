"""The walks over many groups (issue 27): low-level opens and batched attribute reads give what h5py's
high-level lookups give, object for object, and a broken attribute table spoils its own entry only."""
import h5py
import numpy as np

from qgcli import io, runfile
from qgcli.commands import inspect as inspect_cmd


def _file(path):
    with h5py.File(path, "w") as f:
        for i in range(30):
            g = f.create_group(f"step_{i // 10}/layer_{i % 10}/wq")
            g.attrs["op"] = "FakeQuantWithMinMaxVarsPerChannel"
            g.attrs["num_bits"] = 8
            g["inputs"] = np.arange(8, dtype=np.float32).reshape(2, 4)
            g["min"] = -np.ones(4, np.float32)
            g["max"] = np.ones(4, np.float32)
        f["bf"] = np.zeros(3, np.uint16)
        f["bf"].attrs["dtype"] = "bfloat16"
        f["soft"] = h5py.SoftLink("/step_0")
        f["ext"] = h5py.ExternalLink("other.h5", "/x")
        f["again"] = f["step_1"]  # a second hard link to a group
        f["step_0/layer_0/wq/alias"] = h5py.SoftLink("inputs")  # not an operand: soft


def test_h5_open_is_group_getitem(tmp_path):
    path = tmp_path / "m.h5"
    _file(path)
    with h5py.File(path, "r") as f:
        for name in ("step_0", "step_0/layer_1/wq/inputs", "bf"):
            a, b = io.h5_open(f.id, name.encode()), f[name]
            assert type(a) is type(b) and a.id == b.id
        assert io.h5_open(f.id, b"bf")._readonly and f["bf"]._readonly


def test_structure_matches_high_level_walk(tmp_path):
    path = tmp_path / "m.h5"
    _file(path)
    groups, datasets, links = inspect_cmd._h5_structure(str(path))
    with h5py.File(path, "r") as f:
        names = []
        f.visititems_links(lambda n, link: names.append((n, type(link).__name__)))
        want_ds = [n for n, k in names if k == "HardLink" and isinstance(f[n], h5py.Dataset)]
        assert [d["path"] for d in datasets] == want_ds
        assert datasets[[d["path"] for d in datasets].index("bf")]["dtype"] == "bfloat16"
        for g in groups[1:]:
            assert g["attributes"] == {k: inspect_cmd._plain(v) for k, v in io.read_attributes(f[g["path"]]).items()}
    kinds = {lk["path"]: (lk["kind"], lk["target"]) for lk in links}
    assert kinds["soft"] == ("soft", "/step_0") and kinds["ext"] == ("external", "other.h5:/x")
    assert kinds["step_1"] == ("hard", "again")  # "again" comes first by name
    layers = runfile.discover(h5py.File(path, "r"))
    assert len(layers) == 30 and all(set(l.datasets) == {"inputs", "min", "max"} for l in layers)


def test_attributes_batch_falls_back_object_by_object(monkeypatch, tmp_path):
    path = tmp_path / "m.h5"
    _file(path)

    def broken(objs):
        raise OSError("a damaged attribute table")

    with h5py.File(path, "r") as f:
        objs = [f["step_0/layer_0/wq"], f["step_0"]]
        want = [inspect_cmd._attributes(o) for o in objs]
        monkeypatch.setattr(io, "read_attributes_many", broken)
        assert inspect_cmd._attributes_many(objs) == [{"<unreadable>": "OSError: a damaged attribute table"}] * 2
        monkeypatch.undo()
        assert inspect_cmd._attributes_many(objs) == want
