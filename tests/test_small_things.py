"""Small things a newcomer notices (issue 40, item 8): counts with the right number, no columns of dashes, a
quantizer without gradients not ranked above those with, the worst channels in the per-channel summary."""
import json
import os
import re

import h5py
import numpy as np
import pytest

from conftest import ROOT

RUN = os.path.join(ROOT, "samples", "run.h5")
PER_CHANNEL = os.path.join(ROOT, "samples", "per_channel.h5")


def test_counted_says_one_thing_in_the_singular():
    from qgcli.report.text import counted

    assert [counted(n, "group") for n in (0, 1, 2)] == ["0 groups", "1 group", "2 groups"]
    assert counted(1, "process", "processes") == "1 process" and counted(3, "process", "processes") == "3 processes"
    assert counted(1234567, "value", thousands=True) == "1,234,567 values"


def _one_group_run(path, *, with_gradients=True, other=True):
    rng = np.random.default_rng(4)
    with h5py.File(path, "w") as f:
        g = f.create_group("step_1/act")
        g.attrs["op"] = "FakeQuantWithMinMaxVars"
        g["inputs"] = rng.standard_normal((5, 7)).astype(np.float32)
        g["min"], g["max"] = np.float32(-1), np.float32(1)
        if with_gradients:
            g["gradients"] = rng.standard_normal((5, 7)).astype(np.float32)
        if other:  # one group that is not a quantizer: "not drawn: 1 group"
            b = f.create_group("step_1/loose")
            b["inputs"] = np.zeros(3, np.float32)
    return str(path)


def test_one_group_and_one_layer_in_the_singular(cli, tmp_path):
    run = _one_group_run(tmp_path / "run.h5")
    r = cli("fakequant-grad", run, "-o", tmp_path / "out.h5", "--skip-invalid")
    assert r.exit_code == 0, r.output
    assert "wrote 1 group to" in r.stderr and "1 groups" not in r.output
    r = cli("plot", "layers", run, "-o", tmp_path / "layers.png")
    assert r.exit_code == 0, r.output
    assert ": 1 layer, worst" in r.output and "not drawn: 1 group (" in r.output, r.output
    r = cli("inspect", _one_group_run(tmp_path / "one.h5", other=False), "--no-stats")
    assert r.exit_code == 0 and "1 layer (run file)" in r.stdout, r.output


def test_inspect_no_stats_prints_no_columns_of_dashes(cli):
    r = cli("inspect", RUN, "--no-stats")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    header = next(ln for ln in lines if ln.startswith("name "))
    assert header.split() == ["name", "shape", "dtype", "size"]
    rows = [ln.split() for ln in lines[lines.index(header) + 1:] if ln.startswith("step_")]
    assert len(rows) == 38 and not any("-" in row for row in rows)
    # with statistics, every column as before
    r = cli("inspect", RUN)
    assert next(ln for ln in r.stdout.splitlines() if ln.startswith("name ")).split()[3:5] == ["min", "max"]
    # a --columns choice still names statistics (shown as dashes: asked for)
    r = cli("inspect", RUN, "--no-stats", "--columns", "shape,nan")
    assert r.exit_code == 0, r.output


def test_report_ranks_quantizers_with_gradients_first(cli, tmp_path):
    path = tmp_path / "mixed.h5"
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        for name, scale, grads in (("clips_most_no_grads", 5.0, False), ("loses_little", 1.2, True),
                                   ("loses_more", 2.0, True)):
            g = f.create_group(name)
            g.attrs["op"] = "FakeQuantWithMinMaxVars"
            g["inputs"] = (rng.standard_normal(400) * scale).astype(np.float32)
            g["min"], g["max"] = np.float32(-1), np.float32(1)
            if grads:
                g["gradients"] = rng.standard_normal(400).astype(np.float32)
    r = cli("report", path, "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["layers"]
    assert [row["path"] for row in rows] == ["loses_more", "loses_little", "clips_most_no_grads"]
    assert rows[2]["clipped"] > rows[0]["gradient_blocked"]  # it would have come first on its share clipped


def test_per_channel_summary_lists_the_worst_channels(cli, tmp_path):
    r = cli("fakequant-grad", PER_CHANNEL, "-o", tmp_path / "g.h5", "--json")
    blocked = json.loads(r.stdout)["statistics"]["channel_gradient_blocked"]
    worst = sorted(range(len(blocked)), key=lambda c: -blocked[c])[:8]
    r = cli("fakequant-grad", PER_CHANNEL, "-o", tmp_path / "g2.h5")
    assert r.exit_code == 0, r.output
    lines = r.stderr.splitlines()
    header = next(ln for ln in lines if ln.startswith("worst first"))
    assert header.split()[-1] == "blocked"
    shown = [int(ln.split()[1]) for ln in lines if ln.startswith("ch ")]
    assert shown == worst and shown != list(range(8))
    assert "... 8 more" in r.stderr
    # without gradients (the forward op) by the share clipped
    r = cli("fakequant", "--inputs", f"{PER_CHANNEL}:inputs", "--axis", "0", "--min", "-4,-3,-2,-1", "--max",
            "4,3,2,1", "-o", tmp_path / "f.h5")
    lines = r.stderr.splitlines()
    assert next(ln for ln in lines if ln.startswith("worst first")).split()[-1] == "clipped"
    assert [int(ln.split()[1]) for ln in lines if ln.startswith("ch ")] == [3, 2, 1, 0]


def test_the_readme_tour_runs_in_a_scratch_directory_and_says_where_kernels_come_from():
    # The tour wrote its 15 outputs into the checkout; it now starts in a scratch directory with a copy of
    # samples/ (as the docs test runs it), and says what `python -` from the checkout imports.
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    before_tour = readme[:readme.index("## A tour")]
    setup = re.search(r"```sh\n(mkdir -p (\S+) && cp -r samples \2/ && cd \2)\n```", before_tour)
    assert setup, "no scratch-directory setup before the tour"
    assert "build_ext --inplace" in before_tour and "compiled kernels" in before_tour
    tour = readme[readme.index("## A tour"):readme.index("## Guarantees")]
    for written in re.findall(r"-o (\S+)", tour):  # every output of the tour lands in the scratch directory
        assert not written.startswith(("/", "..", "samples")), written


def _run_qgcli(args, *, package_root, cwd, native=None):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("QGCLI_NATIVE", "PYTHONPATH")}
    env["PYTHONPATH"] = str(package_root)
    if native is not None:
        env["QGCLI_NATIVE"] = native
    return subprocess.run([sys.executable, "-m", "qgcli", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)


def test_ops_on_the_numpy_fallback_say_so_once_and_how_to_build_the_kernels(tmp_path):
    """A copy of the package without the compiled kernels (as an install without a C compiler leaves it): a
    command that runs ops says once, on stderr, that they ran on the NumPy kernels and how to build the compiled
    ones; QGCLI_NATIVE=0 (a deliberate choice) and an install with the kernels say nothing; --version names them."""
    import shutil

    shutil.copytree(os.path.join(ROOT, "qgcli"), tmp_path / "bare" / "qgcli",
                    ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    bare, built = tmp_path / "bare", ROOT
    version = _run_qgcli(["--version"], package_root=built, cwd=tmp_path)
    has_kernels = "kernels: compiled C (" in version.stdout  # built in this checkout for this Python
    args = ["fakequant-grad", os.path.join(ROOT, "samples", "notebook.h5")]
    outputs = {}
    runs = [("bare", bare, None), ("chosen", bare, "0")] + ([("built", built, None)] if has_kernels else [])
    for name, root, native in runs:
        r = _run_qgcli([*args, "-o", tmp_path / f"{name}.h5"], package_root=root, cwd=tmp_path, native=native)
        assert r.returncode == 0, r.stderr
        with h5py.File(tmp_path / f"{name}.h5", "r") as f:
            outputs[name] = {k: f[k][()] for k in f}
        notes = [ln for ln in r.stderr.splitlines() if "compiled kernels" in ln]
        if name == "bare":
            assert len(notes) == 1, r.stderr
            assert notes[0].startswith("note: the compiled kernels are not built")
            for said in ("NumPy kernels: the same bits, only slower", "python setup.py build_ext --inplace",
                         "reinstall", "C compiler", "QGCLI_NATIVE=0"):
                assert said in notes[0], said
        else:
            assert notes == [], (name, r.stderr)
    for key, value in outputs.get("built", {}).items():  # the note's promise: the same bits
        assert outputs["bare"][key].tobytes() == value.tobytes(), key
    r = _run_qgcli(["--version"], package_root=bare, cwd=tmp_path)
    assert r.returncode == 0 and "kernels: NumPy (the compiled kernels are not built" in r.stdout, r.stdout
    assert version.returncode == 0 and version.stdout.startswith("qgcli, version ") and "kernels: " in version.stdout
