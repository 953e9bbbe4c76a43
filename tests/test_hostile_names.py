"""Hostile names (issue 26): nothing from a file drives the terminal, nothing from a file leaves ``-o DIR/``.

- Every command that prints names runs on a real pseudo-terminal with a file whose dataset, group, link and
  attribute names and attribute values (and the file's own path) hold terminal control sequences, rich
  markup and other C0/C1 controls; no control byte of the file reaches the terminal: the only escape
  sequences in the output are rich's own colours (``ESC [ params m``).
- :mod:`qgcli.storage.paths`: ``..``, ``../../x``, ``a\\..\\b``, ``con``, escape sequences, a 300-character name and
  names that sanitise alike all land inside ``DIR``, and ``index.json`` maps back to the exact names.
- HDF5 outputs keep the exact names.
"""
import json
import os
import re
import subprocess
import sys

import h5py
import numpy as np
import pytest

from hostile import CONTROLS, ESCAPES, EVIL, MARKUP, RAW_SEQUENCES, make_hostile_names
from qgcli.storage.paths import INDEX_NAME, MAX_COMPONENT_BYTES, group_file_paths, safe_component
from qgcli.report.text import markup, one_line, printable, printable_doc
from terminal import run_on_terminal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SGR = re.compile(rb"\x1b\[[0-9;]*m")
# A file's own path may hold anything but "/" and NUL.
EVIL_STEM = ESCAPES + "[red]path" + CONTROLS


# --- the text helper ---------------------------------------------------------------------------------------

def test_printable_escapes_what_repr_escapes_and_keeps_the_rest():
    assert printable(ESCAPES) == r"\x1b]0;pwned\x07\x1b[2J\x1b[31m"
    assert printable("\x7f\x85\x9b\u2028\u202e\udcff\t\n") == r"\x7f\x85\x9b\u2028\u202e\udcff\t\n"
    for plain in ("gradients", "a\\..\\b", "layer 1/conv", "é ü 中文", MARKUP, ""):
        assert printable(plain) == plain
    assert printable(b"a\x1b\xff") == r"a\x1b\xff" and printable(3) == "3"
    assert printable(printable(EVIL)) == printable(EVIL) and printable(EVIL).isprintable()
    assert markup(MARKUP) == r"\[red]markup\[/red]"
    assert one_line("no\n  such\tdataset \x1b[2J\r\n") == r"no such dataset \x1b[2J"
    doc = printable_doc({EVIL: [EVIL, (EVIL, 1.5)], "n": None, "x": 2})
    assert doc == {printable(EVIL): [printable(EVIL), (printable(EVIL), 1.5)], "n": None, "x": 2}
    clean = {"tensors": [{"name": "a", "shape": [2]}], "files": ("x.h5",)}
    mixed = {"clean": clean["tensors"], "evil": [EVIL]}
    assert printable_doc(clean) is clean  # nothing to escape: not copied
    assert printable_doc(mixed)["clean"] is clean["tensors"] and printable_doc(mixed)["evil"] == [printable(EVIL)]


# --- a real terminal ---------------------------------------------------------------------------------------

def run_on_pty(args, cwd, env=None, timeout=60):
    """Run ``python -m qgcli ARGS`` with stdout and stderr on a pseudo-terminal (200x50); (exit code, bytes seen)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "COLUMNS", "LINES")}
    environ.update({"TERM": "xterm-256color", "QGCLI_NO_PROGRESS": "1", "PYTHONPATH": ROOT}, **(env or {}))
    return run_on_terminal([sys.executable, "-m", "qgcli", *args], width=200, cwd=cwd, env=environ, timeout=timeout)


def assert_terminal_safe(out, *, progress=False):
    """No control byte from the file: none of its sequences, and every ESC starts an SGR colour (or, with a
    progress bar, a CSI cursor sequence of rich's own); no other C0/C1 control but CR and LF."""
    for seq in RAW_SEQUENCES:
        assert seq not in out, (seq, out)
    rest = re.sub(rb"\x1b\[\??[0-9;]*[ABCDKhlm]", b"", out) if progress else SGR.sub(b"", out)
    bad = sorted({b for b in rest if (b < 0x20 and b not in b"\r\n") or b == 0x7f})
    assert not bad, (bad, out)
    text = rest.decode("utf-8")  # strict: a raw 8-bit C1 byte would not decode
    assert not [c for c in text if 0x80 <= ord(c) <= 0x9f], out


@pytest.fixture(scope="module")
def evil(tmp_path_factory):
    d = tmp_path_factory.mktemp("evil")
    path = d / (EVIL_STEM + ".h5")
    make_hostile_names(str(path))
    return d, path.name


def _commands(name):
    out = EVIL_STEM + "out"
    return {
        "inspect": ["inspect", name],
        "inspect-no-stats": ["inspect", name, "--no-stats"],
        "inspect-missing-key": ["inspect", f"{name}:{EVIL}nothing"],
        "report": ["report", name],
        "report-dataset": ["report", "--inputs", f"{name}:{EVIL}tensor", "--min", "-1", "--max", "1"],
        "fakequant-missing": ["fakequant", "--inputs", f"{name}:{EVIL}missing", "--min", "-1", "--max", "1",
                              "-o", out + ".npz"],
        "fakequant-strings": ["fakequant", "--inputs", f"{name}:{EVIL}strings", "--min", "-1", "--max", "1",
                              "-o", out + ".npz"],
        "fakequant-grad": ["fakequant-grad", name, "-o", out + "_fq/"],
        "fakequant-grad-exists": ["fakequant-grad", name, "-o", name],
        "bn-grad": ["bn-grad", name, "-o", out + "_bn.h5"],
        "nudge": ["nudge", name, "-o", out + "_nudge.npz"],
        "compare-semantics": ["compare-semantics", name],
        "plot": ["plot", "staircase", name, "-o", out + ".png"],
        "external-link": ["fakequant", "--inputs", f"{name}:{EVIL}external", "--min", "-1", "--max", "1",
                          "-o", out + "2.npz"],
    }


COMMANDS = list(_commands("f.h5"))


@pytest.mark.parametrize("which", COMMANDS)
def test_no_control_byte_from_a_file_reaches_the_terminal(evil, which):
    d, name = evil
    args = _commands(name)[which]
    code, out = run_on_pty(args, cwd=str(d))
    assert code in (0, 1, 2), out
    assert b"Traceback" not in out and b"internal error" not in out, out
    assert_terminal_safe(out)
    if which.startswith("inspect") and code == 0:
        text = SGR.sub(b"", out).decode()
        assert printable(ESCAPES) in text and MARKUP in text  # shown escaped, markup printed as it is
    if code:
        lines = [ln for ln in SGR.sub(b"", out).decode().splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("Error: "), out


def test_progress_bar_descriptions_are_plain_text(evil):
    d, name = evil
    code, out = run_on_pty(["inspect", name], cwd=str(d), env={"QGCLI_NO_PROGRESS": "0", "QGCLI_PROGRESS_DELAY": "0"})
    assert code == 0, out
    assert_terminal_safe(out, progress=True)


def test_text_output_on_a_pipe_is_escaped_and_json_keeps_exact_names(evil):
    d, name = evil
    env = dict(os.environ, PYTHONPATH=ROOT)
    r = subprocess.run([sys.executable, "-m", "qgcli", "inspect", name], cwd=str(d), capture_output=True, timeout=60,
                       env=env)
    assert r.returncode == 0 and b"\x1b" not in r.stdout and printable(EVIL).encode() in r.stdout, r.stdout
    r = subprocess.run([sys.executable, "-m", "qgcli", "inspect", name, "--json"], cwd=str(d), capture_output=True,
                       timeout=60, env=env)
    (entry,) = json.loads(r.stdout)["files"]
    assert entry["file"] == name and entry["attributes"][EVIL] == EVIL
    assert {EVIL + "tensor", EVIL + "group/" + EVIL + "inner"} <= {t["name"] for t in entry["tensors"]}
    assert {lk["path"] for lk in entry["links"]} == {EVIL + "soft", EVIL + "external"}


def test_names_that_form_markup_only_together_print_as_they_are(tmp_path):
    """A group "[" whose attribute is "]": each escaped alone is no tag, but "[" + "/  (" + "]" is one (the long
    fuzz campaign found it); so is a link "[/x" to "]".  The lines print the names as they are."""
    from click.testing import CliRunner

    from qgcli.cli import main

    path = tmp_path / "tags.h5"
    with h5py.File(path, "w") as f:
        f["inputs"] = np.zeros(3, np.float32)
        f.create_group("[").attrs["]"] = "0"
        f["[/x"] = h5py.SoftLink("/]")
        f.attrs["[a"] = "]"
    r = CliRunner().invoke(main, ["inspect", str(path)])
    assert r.exit_code == 0, r.output
    assert "group [/  (]=0)" in r.output and "soft link [/x -> /] (not followed)" in r.output
    assert "[a: ]" in r.output


# --- file-system paths -------------------------------------------------------------------------------------

HOSTILE_PATHS = ["outputs", "..", ".", "../../x", "/abs/olute", "a\\..\\b", "con", "NUL.txt", "com1", EVIL,
                 "n" * 300, "é" * 200, "a:b", "a?b", "Case", "case", "x", "x.npy/y", INDEX_NAME, ".hidden", "trail. ",
                 "g/..", "g/../../..", "\udcff\udcfe"]


def _inside(root, path):
    root = os.path.realpath(root)
    return os.path.commonpath([root, os.path.realpath(path)]) == root


def test_safe_component_rules():
    for name in HOSTILE_PATHS + ["", "\x00", "a/b", "aux .npy", "lpt\u00b9"]:
        for suffix in ("", ".npy"):
            c = safe_component(name, suffix=suffix)
            assert c.endswith(suffix) and c.isprintable() and c not in ("", ".", "..")
            assert not set(c) & set('/\\<>:"|?*') and not c.startswith(".") and not c.endswith((".", " "))
            assert c.split(".")[0].rstrip().casefold() not in ("con", "nul", "aux", "com1", "lpt\u00b9")
            assert len(c.encode("utf-8")) <= MAX_COMPONENT_BYTES
    long = safe_component("n" * 300, suffix=".npy")
    assert long == safe_component("n" * 300, suffix=".npy") != safe_component("n" * 299 + "m", suffix=".npy")
    assert safe_component("layer_1.conv") == "layer_1.conv"  # ordinary names stay as they are


def test_group_file_paths_is_injective_case_insensitively_and_independent_of_order():
    layout = group_file_paths(HOSTILE_PATHS, suffix=".npy")
    keys = [p.casefold() for p in layout.values()]
    assert len(set(keys)) == len(keys) == len(HOSTILE_PATHS)
    assert INDEX_NAME not in keys
    folders = {"/".join(p.split("/")[:i]).casefold() for p in layout.values() for i in range(1, p.count("/") + 1)}
    assert not folders & set(keys)  # no file where another name needs a folder
    assert dict(group_file_paths(list(reversed(HOSTILE_PATHS)), suffix=".npy")) == dict(layout)
    assert layout["outputs"] == "outputs.npy" and layout["a:b"] == "a_b.npy"
    assert layout.changed and {c["name"] for c in layout.collisions} >= {"a?b", "case", "x"}
    assert all(isinstance(n, str) for n in layout.notes())
    assert not group_file_paths(["outputs", "backprop_wrt_min"], suffix=".npy").changed


def test_dir_output_stays_inside_dir_and_the_index_maps_back(tmp_path):
    from qgcli.storage import io

    arrays = {name: np.full(2, i, np.float32) for i, name in enumerate(HOSTILE_PATHS)}
    for existing in (False, True):
        dest = tmp_path / f"out{existing:d}"
        if existing:
            dest.mkdir()
        io.check_output(str(dest) + "/", names=list(arrays))
        io.save_outputs(arrays, str(dest) + "/")
        written = [os.path.join(folder, f) for folder, _, files in os.walk(dest) for f in files]
        assert all(_inside(dest, p) for p in written)
        assert not [p for p in os.listdir(tmp_path) if p not in ("out0", "out1")]  # nothing beside DIR
        with open(dest / INDEX_NAME, encoding="ascii") as fh:
            index = json.load(fh)
        assert len(written) == len(arrays) + 1
        assert [e["name"] for e in index["files"]] == HOSTILE_PATHS  # exact names, surrogates included
        for entry in index["files"]:
            np.testing.assert_array_equal(np.load(dest / entry["path"]), arrays[entry["name"]])
        assert {c["name"] for c in index["collisions"]} >= {"a?b", "case"}


def test_run_file_dir_output_takes_the_same_names_as_single_outputs(cli, tmp_path):
    """A run file's ``-o DIR/`` (one folder per group) goes through the same writer, and the same sanitiser,
    as a single command's: every file inside DIR, ``index.json`` mapping ``group/output`` back."""
    groups = ["con", "a:b", "a_b", "..x", "\x1b]0;t\x07g", "ok"]
    rng = np.random.default_rng(0)
    run = tmp_path / "run.h5"
    with h5py.File(run, "w") as f:
        for name in groups:
            g = f.create_group(name)
            g.attrs["op"] = "FakeQuantWithMinMaxVars"
            g.create_dataset("inputs", data=rng.standard_normal((3, 4)).astype(np.float32))
            g.create_dataset("gradients", data=rng.standard_normal((3, 4)).astype(np.float32))
            g.create_dataset("min", data=np.float32(-1))
            g.create_dataset("max", data=np.float32(1))
    for existing in (False, True):
        dest = tmp_path / f"out{existing:d}"
        if existing:
            dest.mkdir()
        r = cli("fakequant-grad", run, "-o", f"{dest}/", "-q")
        assert r.exit_code == 0, r.output
        written = [os.path.join(folder, f) for folder, _, files in os.walk(dest) for f in files]
        assert all(_inside(dest, p) for p in written) and len(written) == 3 * len(groups) + 1
        with open(dest / INDEX_NAME, encoding="ascii") as fh:
            index = json.load(fh)
        names = {e["name"]: e["path"] for e in index["files"]}
        assert sorted(names) == sorted(f"{g}/{o}" for g in groups
                                       for o in ("backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max"))
        assert names["ok/backprop_wrt_min"] == "ok/backprop_wrt_min.npy" and names["con/backprop_wrt_min"].startswith("_con/")
        with h5py.File(run, "r") as f:
            want = f["a:b"]["inputs"][()]
        got = np.load(dest / names["a:b/backprops_wrt_input"])
        assert got.shape == want.shape
        assert not [p for p in os.listdir(tmp_path) if p.startswith(".qgcli-")]  # no staging left behind


def test_dir_output_with_plain_names_writes_no_index(tmp_path):
    from qgcli.storage import io

    io.save_outputs({"outputs": np.zeros(2)}, str(tmp_path / "d") + "/")
    assert os.listdir(tmp_path / "d") == ["outputs.npy"]


def test_hdf5_and_npz_outputs_keep_the_exact_names(tmp_path):
    from qgcli.storage import io

    names = [EVIL.replace("/", "|"), "..", "a\\..\\b", "con", "n" * 300, "g/../x"]
    arrays = {n: np.arange(3, dtype=np.float32) + i for i, n in enumerate(names)}
    io.save_outputs(arrays, str(tmp_path / "o.h5"), attrs={"note": EVIL})
    with h5py.File(tmp_path / "o.h5", "r") as f:
        for name, value in arrays.items():  # HDF5 takes ".." as a plain link name
            np.testing.assert_array_equal(f[name][()], value)
            assert f[name].attrs["note"] == EVIL
        assert ".." in f and "n" * 300 in f["/"] and "a\\..\\b" in f["/"] and ".." in f["g"]
    assert os.listdir(tmp_path) == ["o.h5"]


# --- names longer than a path may be (#40) --------------------------------------------------------------------

DEEP = "step_000100/" + "/".join(f"s{i:02d}" + "d" * 200 for i in range(22))  # about 4.5 KB: past PATH_MAX


def test_over_long_group_paths_are_shortened_uniquely_and_mapped_back():
    from qgcli.storage.paths import MAX_PATH_BYTES

    names = [DEEP + "/outputs", DEEP + "/backprops", DEEP[:-1] + "e/outputs", "step_000100/short/outputs"]
    layout = group_file_paths(names, suffix=".npy")
    assert all(len(p.encode()) <= MAX_PATH_BYTES for p in layout.values())
    assert len({p.casefold() for p in layout.values()}) == len(names)
    assert layout["step_000100/short/outputs"] == "step_000100/short/outputs.npy" and layout.changed
    assert layout[DEEP + "/outputs"].startswith("step_000100/s00d") and "~" in layout[DEEP + "/outputs"]
    assert {f["name"]: f["path"] for f in layout.index()["files"]} == dict(layout)
    assert dict(group_file_paths(list(reversed(names)), suffix=".npy")) == dict(layout)


@pytest.mark.parametrize("command", [["fakequant"], ["plot", "ste"]])
def test_run_file_with_an_over_long_group_path_writes_per_group_outputs(tmp_path, command):
    src = os.path.join(ROOT, "samples", "run.h5")
    with h5py.File(src, "r") as s, h5py.File(tmp_path / "deep.h5", "w") as f:
        s.copy("step_000100/head/logits_quant", f, DEEP)
    env = dict(os.environ, PYTHONPATH=ROOT, QGCLI_NO_PROGRESS="1")
    r = subprocess.run([sys.executable, "-m", "qgcli", *command, "deep.h5", "-o", "out/"], cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    with open(tmp_path / "out" / INDEX_NAME) as fh:
        (entry,) = json.load(fh)["files"]
    assert entry["name"].startswith(DEEP) and os.path.isfile(tmp_path / "out" / entry["path"])
