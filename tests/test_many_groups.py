"""The walks over many groups (issue 27): low-level opens and batched attribute reads give what h5py's
high-level lookups give, object for object, and a broken attribute table spoils its own entry only; each
object is opened once whatever the depth; files nested deeper, or holding more groups, than the bounds are
refused at once (exit 2, one line, nothing written); the bounds are options and environment variables."""
import json
import time

import h5py
import numpy as np
import pytest

from qgcli.storage.hdf5 import walk as h5walk
from qgcli.storage import h5
from qgcli.storage import runfile
from qgcli.cli.commands import inspect as inspect_cmd


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
            a, b = h5.h5_open(f.id, name.encode()), f[name]
            assert type(a) is type(b) and a.id == b.id
        assert h5.h5_open(f.id, b"bf")._readonly and f["bf"]._readonly


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
            assert g["attributes"] == {k: inspect_cmd._plain(v) for k, v in h5.read_attributes(f[g["path"]]).items()}
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
        monkeypatch.setattr(h5, "read_attributes_many", broken)
        assert [plain for plain, _ in inspect_cmd._attributes_many(objs)] == \
            [{"<unreadable>": "OSError: a damaged attribute table"}] * 2
        monkeypatch.undo()
        assert [plain for plain, _ in inspect_cmd._attributes_many(objs)] == want


def _nested(path, depth, *, layer=True):
    """``depth`` groups nested one inside the other, a FakeQuantWithMinMaxArgs layer at the bottom."""
    with h5py.File(path, "w") as f:
        gid = f.id
        for _ in range(depth):
            gid = h5py.h5g.create(gid, b"g")
        g = h5py.Group(gid)
        if layer:
            g.attrs["op"] = "FakeQuantWithMinMaxArgs"
        g["inputs"] = np.array([0.5, -7.0], np.float32)
        g["gradients"] = np.ones(2, np.float32)


def _flat(path, groups):
    with h5py.File(path, "w") as f:
        for i in range(groups):
            g = f.create_group(f"g{i:04d}")
            g.attrs["op"] = "FakeQuantWithMinMaxArgs"
            g["inputs"] = np.array([i, -i], np.float32)
            g["gradients"] = np.ones(2, np.float32)


def test_documented_bounds(cli):
    assert (h5walk.MAX_DEPTH, h5walk.MAX_GROUPS) == (512, 10_000_000)
    for command in ("inspect", "report", "fakequant-grad", "bn-grad", "fakequant"):
        text = cli(command, "--help").output
        assert "--max-depth" in text and "QGCLI_MAX_DEPTH" in text and "--max-groups" in text, command


@pytest.mark.parametrize("command", ["inspect", "report", "fakequant-grad", "fakequant"])
def test_deep_file_refused_before_any_work(tmp_path, cli, command):
    path = tmp_path / "deep.h5"
    _nested(path, 40)
    out = tmp_path / "out.h5"
    argv = [command, str(path), "--max-depth", "20"] + (["-o", str(out)] if command.startswith("fakequant") else [])
    h5walk.OPENS[0] = 0
    r = cli(*argv)
    assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
    assert "deeper than 20 levels" in r.output and "--max-depth" in r.output and "Traceback" not in r.output
    assert h5walk.OPENS[0] <= 21  # the walk stopped where the bound was passed: no group below, no dataset
    assert not out.exists()
    assert cli(*[a for a in argv if a not in ("--max-depth", "20")], "--max-depth", "50").exit_code == 0


def test_many_groups_refused_by_environment(tmp_path, runner, monkeypatch):
    from qgcli.cli import main

    path = tmp_path / "flat.h5"
    _flat(path, 60)
    monkeypatch.setenv("QGCLI_MAX_GROUPS", "10")
    h5walk.OPENS[0] = 0
    r = runner.invoke(main, ["inspect", str(path), "--json"])
    assert r.exit_code == 2 and "more than 10 groups" in r.output and "QGCLI_MAX_GROUPS" in r.output
    assert h5walk.OPENS[0] <= 11 * 3  # ten groups and their datasets, then the eleventh: nothing more
    r = runner.invoke(main, ["inspect", str(path), "--json", "--max-groups", "60"])
    assert r.exit_code == 0, r.output
    monkeypatch.delenv("QGCLI_MAX_GROUPS")
    assert runner.invoke(main, ["inspect", str(path), "--json"]).exit_code == 0  # back to the default


def test_deep_file_refused_quickly_in_a_subprocess(tmp_path):
    """Past the default bound: refused in about the time of the start-up, whatever lies below."""
    import subprocess
    import sys

    path = tmp_path / "deep.h5"
    _nested(path, 3000)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "qgcli", "inspect", str(path)], capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "deeper than 512 levels" in r.stderr
    assert time.perf_counter() - t < 60  # generous: the old full-path walk took minutes here


@pytest.mark.parametrize("depth", [100, 400])
def test_each_object_opened_once_whatever_the_depth(tmp_path, cli, depth):
    """Linear in the groups: the walk opens every object once, relative to its parent (never a full path
    from the root, which made a deep file quadratic), and inspect and report walk the file once."""
    path = tmp_path / "deep.h5"
    _nested(path, depth)
    h5walk.OPENS[0] = 0
    r = cli("inspect", str(path), "--json")
    assert r.exit_code == 0, r.output
    assert h5walk.OPENS[0] == depth + 2  # the groups, inputs, gradients
    doc = json.loads(r.output)["files"][0]
    assert len(doc["groups"]) == depth + 1 and [t["name"].count("/") for t in doc["tensors"]] == [depth] * 2
    assert [lay["path"] for lay in doc["layers"]] == ["/".join(["g"] * depth)]
    h5walk.OPENS[0] = 0
    assert cli("report", str(path), "--json").exit_code == 0
    assert h5walk.OPENS[0] <= 2 * (depth + 2)  # the probe for a run file (groups only), then the one walk


def test_attribute_batches_cover_the_file(tmp_path):
    """More objects than one attribute batch: every group's attributes and layers as h5py gives them."""
    path = tmp_path / "flat.h5"
    n = inspect_cmd.ATTRIBUTE_BATCH + 40
    _flat(path, n)
    layers = []
    groups, datasets, _ = inspect_cmd._h5_structure(str(path), layers=layers)
    assert len(groups) == n + 1 and len(datasets) == 2 * n
    assert all(g["attributes"] == {"op": "FakeQuantWithMinMaxArgs"} for g in groups[1:])
    assert [lay.path for lay in layers] == [f"g{i:04d}" for i in range(n)]
    with h5py.File(path, "r") as f:
        assert [lay.path for lay in runfile.discover(f)] == [lay.path for lay in layers]


def test_json_written_in_blocks():
    """The listing of many groups reaches stdout in a few large writes (json.dump wrote every token)."""
    import io as _io
    import sys

    from qgcli.report.summaries import dump_json

    class Counting(_io.StringIO):
        writes = 0

        def write(self, text):
            Counting.writes += 1
            return super().write(text)

    doc = {"files": [{"tensors": [{"name": f"g{i}", "shape": [2], "min": 0.5} for i in range(5000)]}]}
    saved, sys.stdout = sys.stdout, Counting()
    try:
        dump_json(doc)
        text = sys.stdout.getvalue()
    finally:
        sys.stdout = saved
    assert text == json.dumps(doc, indent=2) + "\n"
    assert Counting.writes < 20


def test_run_summaries_kept_only_where_shown(tmp_path, cli, monkeypatch):
    """Without --json only the table's rows keep their whole summary (memory must not grow with the groups);
    with --json every group has it, and the text still counts every group."""
    from qgcli.execution import dispatch as executors
    from qgcli.execution import runfile as executors_runfile
    from qgcli.jobs import OutputOptions, RunFileJob

    monkeypatch.setattr(executors_runfile, "TABLE_ROWS", 3)
    path = tmp_path / "run.h5"
    with h5py.File(path, "w") as f:
        for i in range(7):
            g = f.create_group(f"q{i}")
            g.attrs["op"] = "FakeQuantWithMinMaxArgs"
            g["inputs"] = np.linspace(-8, 8, 5, dtype=np.float32)
            g["gradients"] = np.ones(5, np.float32)
    full = json.loads(cli("fakequant-grad", path, "-o", tmp_path / "a.h5", "--json").stdout)["layers"]
    assert [layer["statistics"]["clipped_below"] for layer in full] == [0.2] * 7
    short = executors.execute(RunFileJob("fakequant-grad", str(path), OutputOptions(str(tmp_path / "b.h5"))))["layers"]
    assert [layer["path"] for layer in short] == [f"q{i}" for i in range(7)]
    assert short[:3] == full[:3]
    assert all(set(layer) == {"path", "op", "group_op", "family", "overrides"} for layer in short[3:])
    text = cli("fakequant-grad", path, "-o", tmp_path / "c.h5")
    assert text.exit_code == 0 and "... 4 more groups (--json for all)" in text.stderr
    assert "wrote 7 groups" in text.stderr



def test_groups_past_the_table_skip_their_summary(tmp_path, cli, monkeypatch):
    """A group whose summary nobody sees (past the table without --json, or any group under --quiet) runs as
    under --quiet: no statistics, no summary built; its outputs are the same bits whatever is shown."""
    from qgcli.execution import runfile as executors_runfile
    from qgcli.families import tf_fake_quant

    monkeypatch.setattr(executors_runfile, "TABLE_ROWS", 3)
    built = []
    real = tf_fake_quant.build_summary
    monkeypatch.setattr(tf_fake_quant, "build_summary", lambda *a, **k: built.append(1) or real(*a, **k))
    path = tmp_path / "run.h5"
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        for i in range(7):
            g = f.create_group(f"q{i}")
            g.attrs["op"] = "FakeQuantWithMinMaxVarsPerChannel"
            g["inputs"] = rng.standard_normal((5, 4)).astype(np.float32) * 3
            g["min"], g["max"] = -np.ones(4, np.float32), np.full(4, 0.5, np.float32)
            g["gradients"] = rng.standard_normal((5, 4)).astype(np.float32)
    counts = {}
    for name, extra in (("json", ["--json"]), ("table", []), ("quiet", ["-q"])):
        built.clear()
        r = cli("fakequant-grad", path, "-o", tmp_path / f"{name}.h5", *extra)
        assert r.exit_code == 0, r.output
        counts[name] = len(built)
    assert counts == {"json": 7, "table": 3, "quiet": 0}
    with h5py.File(tmp_path / "json.h5", "r") as a, h5py.File(tmp_path / "table.h5", "r") as b, \
            h5py.File(tmp_path / "quiet.h5", "r") as c:
        for i in range(7):
            for key in ("backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max"):
                want = a[f"q{i}/{key}"][()]
                assert want.tobytes() == b[f"q{i}/{key}"][()].tobytes() == c[f"q{i}/{key}"][()].tobytes()
            assert dict(a[f"q{i}"].attrs) == dict(b[f"q{i}"].attrs) == dict(c[f"q{i}"].attrs)


def test_discovered_groups_read_as_the_checked_read(tmp_path):
    """A run file's groups and datasets, found by discovery's walk (hard links only), are opened by their path
    in one call: the arrays are the checked read's, bit for bit, and a path that no longer opens falls back
    to the checked lookup and its error."""
    from qgcli.errors import FileFormatError
    from qgcli.storage import io
    from qgcli.storage.operands import Operands

    path = tmp_path / "m.h5"
    _file(path)
    with h5py.File(path, "a") as f:  # a group name that is not UTF-8, and a layer at the root's first level
        g = f.create_group(b"caf\xe9/wq")
        g.attrs["op"] = "FakeQuantWithMinMaxVarsPerChannel"
        g["inputs"] = np.float32([[1.5, -2.25]])
        g["min"], g["max"] = np.float32([-1, -1]), np.float32([1, 1])
    container = io.Container.open(str(path))
    try:
        layers = runfile.discover(container._opened(), label=str(path))
        assert len(layers) == 31
        for layer in layers:
            fast = Operands.in_group(container, str(path), layer.path, known=layer.datasets)
            slow = Operands.in_group(container, str(path), layer.path)
            for name in ("inputs", "min", "max"):
                a, b = fast.get(name), slow.get(name)
                assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
            fast.close()
            slow.close()
        assert h5.open_walked(container._opened(), "step_0/nothing") is None
        gone = Operands.in_group(container, str(path), "step_0/layer_0/wq",
                                 known={**layers[0].datasets, "gradients": ((2, 4), "float32")})
        with pytest.raises(Exception, match="gradients"):
            gone.get("gradients")
        with pytest.raises(FileFormatError):
            h5.resolve(container._opened(), "step_0/nothing", "m.h5")
    finally:
        container.close()
