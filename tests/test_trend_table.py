"""The report's trend table (blocked gradient by step, a run file with several steps) follows the rules of the
other tables: fitted to an 80-column terminal (the steps that do not fit left out and named), every step with
``--wide`` (one record per block when too wide), the steps named with ``--columns``, every column on full
lines when redirected."""
import json
import subprocess
import sys

import pytest

from terminal import run_on_terminal
from test_runfile import make_run
from test_terminal_tables import ANSI, _env, _sections

STEPS = tuple(f"step_{i:06d}" for i in range(100, 900, 100))  # 8 step columns: about 110 characters wide

DRIVER = """
import sys
from qgcli.cli import main
run = sys.argv[1]
for name, args in (("default", ["report", run]), ("wide", ["report", run, "--wide"]),
                   ("columns", ["report", run, "--columns", "step_000300,blocked"])):
    print("=== " + name, flush=True)
    try:
        main(args, prog_name="qgcli", standalone_mode=False)
    except SystemExit:
        pass
    sys.stdout.flush(); sys.stderr.flush()
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("trend") / "run.h5"
    make_run(path, steps=STEPS)
    doc = json.loads(subprocess.run([sys.executable, "-m", "qgcli", "report", str(path), "--json"],
                                    capture_output=True, text=True, env=_env(), check=True).stdout)
    return str(path), doc


def _pct(v):
    from qgcli.cli.commands.report import _pct

    return _pct(v)


def _trend(lines):
    return lines[lines.index("blocked gradient by step") + 1:]


def test_trend_table_on_80_columns(run, tmp_path):
    path, doc = run
    code, data = run_on_terminal([sys.executable, "-c", DRIVER, path], width=80, cwd=tmp_path, env=_env())
    assert code == 0
    sections = _sections(ANSI.sub("", data.decode().replace("\r\n", "\n")))
    for name, lines in sections.items():
        for line in lines:
            assert len(line) <= 80 and "…" not in line, (name, line)
    # default: the steps that fit (first and last kept), the others named with the way to see them
    trend = _trend(sections["default"])
    header = trend[0].split()
    assert header[0] == "layer" and STEPS[0] in header and STEPS[-1] in header and len(header) < len(STEPS) + 1
    note = " ".join(ln for ln in trend if "not shown" in ln or ln.startswith("step_") or "--wide" in ln)
    assert "not shown to fit 80 columns" in note and "--wide" in note
    for step in STEPS:
        assert step in header or step in note, step
    # --wide: every step of every layer, one record per block
    wide = _trend(sections["wide"])
    for layer, points in doc["trends"].items():
        block = wide[wide.index(layer) + 1:wide.index(layer) + 1 + len(STEPS)]
        assert [ln.split() for ln in block] == [[p["step"], _pct(p["gradient_blocked"])] for p in points], block
    # --columns: the steps named in the trend table, the report's columns in the layer table
    columns = sections["columns"]
    assert columns[0].split() == ["layer", "blocked"]
    trend = _trend(columns)
    assert trend[0].split() == ["layer", "step_000300"]
    assert not any("not shown" in ln for ln in trend)


def test_trend_table_redirected_has_every_step_on_full_lines(run, cli):
    path, doc = run
    r = subprocess.run([sys.executable, "-m", "qgcli", "report", path], capture_output=True, text=True, env=_env())
    assert r.returncode == 0, r.stderr
    trend = _trend(r.stdout.splitlines())
    assert trend[0].split() == ["layer", *STEPS]
    for layer, points in doc["trends"].items():
        (row,) = [ln.split() for ln in trend if ln.split()[:1] == [layer]]
        assert row[1:] == [_pct(p["gradient_blocked"]) for p in points]
    r = cli("report", path, "--columns", "nope")
    assert r.exit_code == 2 and "no column 'nope'" in r.output and "step_000800" in r.output and "blocked" in r.output
