"""Tables fit the terminal and no number or name is ever cut (issue 15, item 1).

Each width runs one real process on a pseudo-terminal whose size is set with TIOCSWINSZ (COLUMNS unset, so
rich reads the size from the terminal as it would for a person), and once with stdout/stderr on pipes.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from terminal import run_on_terminal

ROOT = Path(__file__).resolve().parents[1]
PER_CHANNEL = ROOT / "samples" / "per_channel.h5"
# The per-channel summary's eight worst channels of the sample, by the gradient mass the mask blocks (its JSON's
# channel_gradient_blocked: 59.0%, 56.9%, 56.7%, 4.0%, ...).
WORST_8 = [3, 12, 7, 5, 1, 4, 15, 13]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")

# Both commands in one process per width (start-up is most of the cost).
DRIVER = """
import sys
from qgcli.cli import main
for args in (["report", sys.argv[1], "--top", "4"], ["report", sys.argv[1], "--top", "2", "--wide"],
             ["inspect", sys.argv[1]], ["fakequant-grad", sys.argv[1], "-o", sys.argv[2]]):
    print("=== " + " ".join(a for a in args if a not in sys.argv[1:] and a != "-o"), flush=True)
    try:
        main(args, prog_name="qgcli", standalone_mode=False)
    except SystemExit:
        pass
    sys.stdout.flush(); sys.stderr.flush()
"""


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR")}
    env["TERM"] = "xterm-256color"
    env["QGCLI_NO_PROGRESS"] = "1"  # a slow run (a loaded CI machine) would draw its progress line into the table
    # The processes run in tmp_path: without this they would import whichever qgcli the venv has installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _run_pty(width, tmp_path):
    return _terminal_text([sys.executable, "-c", DRIVER, str(PER_CHANNEL), str(tmp_path / f"g{width}.h5")],
                          width, tmp_path)


def _terminal_text(argv, width, tmp_path):
    code, data = run_on_terminal(argv, width=width, cwd=tmp_path, env=_env())
    assert code == 0
    return ANSI.sub("", data.decode().replace("\r\n", "\n"))


def _sections(text):
    out, name = {}, None
    for line in text.splitlines():
        if line.startswith("=== "):
            name = line[4:]
            out[name] = []
        elif name is not None:
            out[name].append(line)
    return out


def _report_numbers():
    from qgcli.cli.commands.report import _db, _pct, _span

    import json

    r = subprocess.run([sys.executable, "-m", "qgcli", "report", str(PER_CHANNEL), "--top", "4", "--json"],
                       capture_output=True, text=True, env=_env(), check=True)
    doc = json.loads(r.stdout)
    return [(str(row["channel"]), _span(row["nudged_min"], row["nudged_max"]), _pct(row["gradient_blocked"]),
             _db(row["sqnr_db"], row["mse"]), _span(row["suggested_min"], row["suggested_max"]))
            for row in doc["rows"]]


@pytest.fixture(scope="module")
def numbers():
    return _report_numbers()


def _check(sections, numbers, width):
    for name, lines in sections.items():
        for line in lines:
            assert "…" not in line, (name, line)
            if width is not None:
                assert len(line) <= width, (width, name, line)
    report = sections["report --top 4"]
    table = [ln.split() for ln in report]
    for channel, *cells in numbers:
        row = [t for t in table if t and t[0] == channel]
        assert row, (channel, report)
        for cell in cells:
            assert cell in row[0], (channel, cell, row[0])
    # The --wide report, in blocks or in one table: every value of every column whole.
    wide = "\n".join(sections["report --top 2 --wide"])
    for label in ("d/dmin", "d/dmax", "blocked'", "SQNR'"):
        assert label in wide
    inspect = sections["inspect"]
    for name, shape in (("gradients", "[4, 8, 8, 16]"), ("inputs", "[4, 8, 8, 16]"), ("max", "[16]"),
                        ("min", "[16]")):
        assert any(ln.startswith(name + " ") and shape in ln and "float32" in ln for ln in inspect), inspect
    fq = "\n".join(sections["fakequant-grad"])
    if not fq:  # on pipes the summary went to stderr (checked there)
        return
    for c in WORST_8:  # the summary lists the channels losing most gradient mass (issue 40, item 8)
        assert f"ch {c} " in fq
    assert "gradients (4, 8, 8, 16) float32" in fq and "wrote backprops_wrt_input" in fq


@pytest.mark.parametrize("width", [80, 100, 120])
def test_terminal_tables_fit_and_are_never_cut(width, tmp_path, numbers):
    sections = _sections(_run_pty(width, tmp_path))
    _check(sections, numbers, width)
    report = "\n".join(sections["report --top 4"])
    if width < 130:  # the full report table is about 130 columns: some columns left out, and said so
        assert f"not shown to fit {width} columns" in report and "--wide" in report


def test_pipes_print_every_column_on_full_lines(tmp_path, numbers):
    r = subprocess.run([sys.executable, "-c", DRIVER, str(PER_CHANNEL), str(tmp_path / "g.h5")],
                       capture_output=True, text=True, env=dict(_env(), COLUMNS="40"), cwd=tmp_path, check=True)
    sections = _sections(r.stdout)
    _check(sections, numbers, None)
    assert "\x1b" not in r.stdout + r.stderr
    report = sections["report --top 4"]
    header = [ln for ln in report if ln.lstrip().startswith("ch ")][0].split()
    assert header == ["ch", "data", "range", "nudged", "clip<", "clip>", "blocked", "d/dmin", "d/dmax", "SQNR",
                      "suggested", "p", "SQNR'", "blocked'"]
    assert not any("not shown" in ln for ln in report)
    # The summary on stderr (a log file): one line each, never wrapped at the 40 columns COLUMNS claims.
    err = r.stderr.splitlines()
    assert any(ln.startswith("FakeQuantWithMinMaxVarsPerChannelGradient") and "max (16,) float32" in ln for ln in err)
    rows = [ln.split() for ln in err if ln.startswith("ch ")]
    assert [int(r[1]) for r in rows] == WORST_8 and all(len(r) == 9 for r in rows)
    assert any(ln.split()[:2] == ["worst", "first"] and ln.split()[-1] == "blocked" for ln in err)


def test_columns_choice_and_unknown_names(cli):
    r = cli("report", str(PER_CHANNEL), "--top", "2", "--columns", "blocked,p")
    assert r.exit_code == 0, r.output
    header = [ln for ln in r.stdout.splitlines() if ln.lstrip().startswith("ch ")][0].split()
    assert header == ["ch", "blocked", "p"]
    r = cli("report", str(PER_CHANNEL), "--columns", "nope")
    assert r.exit_code == 2 and "no column 'nope'" in r.output and "blocked" in r.output
    r = cli("inspect", str(PER_CHANNEL), "--columns", "shape,nan")
    assert r.exit_code == 0, r.output
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("name")][0].split() == ["name", "shape", "nan"]


def test_print_items_breaks_between_items_only():
    import io

    from rich.console import Console

    from qgcli.report.tables import print_items

    buf = io.StringIO()
    console = Console(file=buf, width=40, force_terminal=True, no_color=True, highlight=False)
    print_items(console, "op num_bits=8  gradients (1, 1000) float32, inputs (1, 1000) float32, min (1,) float32")
    lines = buf.getvalue().splitlines()
    assert all(len(ln) <= 40 for ln in lines)
    text = "\n".join(lines)
    for item in ("gradients (1, 1000) float32", "inputs (1, 1000) float32", "min (1,) float32"):
        assert item in text, lines
    assert np.all([ln == ln.rstrip() for ln in lines])


def test_print_lines_writes_what_print_items_writes():
    import io

    from rich.console import Console

    from qgcli.report.tables import print_items, print_lines

    lines = ["  group /a/", "  group /[red]x[/]/  (op: FakeQuant; num_bits: 8)", "", "  wide \u4e2d\u6587 "
             + "y" * 60, "  trailing  "] * 900  # past a block of 4,096 lines
    # on a terminal, or with a tab (rich expands it): rich's, line by line
    for terminal, some in ((False, lines), (False, lines[:5] + ["tab\there"]), (True, lines[:6])):
        out = []
        for write in (lambda c: [print_items(c, ln, markup=False) for ln in some], lambda c: print_lines(c, some)):
            buf = io.StringIO()
            write(Console(file=buf, width=40, force_terminal=terminal, no_color=True, highlight=False, emoji=False))
            out.append(buf.getvalue())
        assert out[0] == out[1] and out[0].count("\n") >= len(some)


# nudge, compare-semantics, the layer report of a run file (and its trend table), torchao's block report.
NOTEBOOK = ROOT / "samples" / "notebook.h5"
RUN = ROOT / "samples" / "run.h5"
MORE_DRIVER = """
import sys
from qgcli.cli import main
per_channel, notebook, run, out = sys.argv[1:5]
for name, args in (
        ("nudge", ["nudge", "--min", "-1,-2,0.5,-0.125", "--max", "1,2,3,0.3", "-o", out + "/grid.h5"]),
        ("compare-semantics", ["compare-semantics", per_channel, "-o", out + "/cmp.h5"]),
        ("layers", ["report", run]),
        ("torchao", ["report", notebook, "--semantics", "torchao", "--dtype", "int4", "--granularity",
                     "per-group:40", "--top", "3"])):
    print("=== " + name, flush=True)
    try:
        main(args, prog_name="qgcli", standalone_mode=False)
    except SystemExit:
        pass
    sys.stdout.flush(); sys.stderr.flush()
"""


def _run_more_pty(width, tmp_path):
    return _terminal_text([sys.executable, "-c", MORE_DRIVER, str(PER_CHANNEL), str(NOTEBOOK), str(RUN),
                           str(tmp_path)], width, tmp_path)


def _json(*args):
    import json

    r = subprocess.run([sys.executable, "-m", "qgcli", *map(str, args), "--json"], capture_output=True, text=True,
                       env=_env(), check=True)
    return json.loads(r.stdout)


def test_more_tables_fit_80_columns_and_are_never_cut(tmp_path):
    width = 80
    sections = _sections(_run_more_pty(width, tmp_path))
    assert set(sections) == {"nudge", "compare-semantics", "layers", "torchao"}
    for name, lines in sections.items():
        assert lines, name
        for line in lines:
            assert "…" not in line, (name, line)
            assert len(line) <= width, (name, line)
    text = {name: "\n".join(lines) for name, lines in sections.items()}
    words = {name: {w for ln in lines for w in ln.replace(",", " ").split()} for name, lines in sections.items()}
    # nudge: every channel's scale, zero point and nudged bounds whole
    doc = _json("nudge", "--min", "-1,-2,0.5,-0.125", "--max", "1,2,3,0.3")
    g = doc["grid"]
    for c in range(4):
        assert f"ch {c}" in text["nudge"]
        for key in ("scale", "nudged_min", "nudged_max"):
            assert f"{g[key][c]:.9g}" in words["nudge"], (key, c, text["nudge"])
    assert "wrote scale" in text["nudge"] and "does not contain 0" in text["nudge"]
    # compare-semantics: the index list is never broken inside an index
    cmp_text = text["compare-semantics"]
    for index in ("[0, 0, 2, 10]", "[0, 1, 3, 14]", "[1, 4, 2, 2]"):
        assert index in cmp_text.replace("\n", " ") and any(index in ln for ln in sections["compare-semantics"])
    assert "wrote outputs_tf" in cmp_text
    # the layer report and its trend table: every layer name whole, the blocked share of each
    doc = _json("report", RUN)
    for row in doc["layers"][:5]:
        line = [ln for ln in sections["layers"] if ln.startswith(row["path"] + " ") or ln == row["path"]]
        assert line, (row["path"], text["layers"])
    assert "blocked gradient by step" in text["layers"]
    for name in doc["trends"]:
        assert any(ln.split() and ln.split()[0] == name for ln in sections["layers"]), (name, text["layers"])
    # torchao's block report
    assert "block" in text["torchao"] and "blocked" in text["torchao"] and "Verdict" in text["torchao"]


def test_plain_tables_are_the_lines_rich_prints():
    """Off a terminal a table is written as plain text in blocks; its bytes are what rich prints of the same
    laid-out lines (wide characters, every justification, styled Text cells, None and numbers)."""
    import io

    from rich.console import Console
    from rich.text import Text

    from qgcli.report import tables
    from qgcli.report.summaries import _PLAIN_WIDTH

    cols = [tables.Col("name", justify="left", priority=0), tables.Col("n"), tables.Col("mid", justify="center"),
            tables.Col("note", justify="left")]
    rows = [["a", 1, "x", None], ["长名字", 22.5, Text("styled", style="red"), "µ ünï"], ["", -3, "", "end"]]
    rows += [[f"g{i}", i, "·" * (i % 5), "z" * (i % 3)] for i in range(5000)]  # more than one block
    buf = io.StringIO()
    console = Console(file=buf, highlight=False, emoji=False, width=_PLAIN_WIDTH, no_color=True)
    assert tables.plain(console)
    tables.print_table(console, cols, rows, legend=False)
    cells = [[tables._text(c) for c in r] for r in rows]
    widths = [max([len(c.name)] + [r[i].cell_len for r in cells]) for i, c in enumerate(cols)]
    expected = io.StringIO()
    reference = Console(file=expected, highlight=False, emoji=False, width=_PLAIN_WIDTH, no_color=True)
    shown = list(range(len(cols)))
    for line in [[Text(c.name, style="bold") for c in cols]] + cells:
        reference.print(tables._line(cols, shown, widths, line, None), soft_wrap=True, crop=False)
    assert buf.getvalue() == expected.getvalue()
    assert buf.getvalue().splitlines()[2].startswith("长名字  22.5")
