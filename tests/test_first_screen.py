"""`qgcli` with no arguments shows the help as click lays it out, never flattened into one error line (issue 40,
item 1).  Click 8.2+ signals it with NoArgsIsHelpError, a UsageError (help on stderr, exit 2); click 8.1 prints
the help on stdout and exits 0.  The expectations follow the installed click, so the run on the floor
constraints (.ci/constraints-floor.txt) checks the old convention and the newest release the new one."""
import os
import re
import subprocess
import sys

from pathlib import Path

import click
import pytest

from terminal import run_on_terminal

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
NEW_CLICK = hasattr(click.exceptions, "NoArgsIsHelpError")
EXIT = 2 if NEW_CLICK else 0


def _env():
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR")}
    env["TERM"] = "xterm-256color"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _check_help(text, usage, width=None):
    lines = text.splitlines()
    assert lines[0] == usage, lines[:3]
    assert "Error:" not in text and len(lines) > 8
    if width is not None:
        assert all(len(ln) <= width for ln in lines), [ln for ln in lines if len(ln) > width]


@pytest.mark.parametrize("args, usage", [((), "Usage: qgcli [OPTIONS] COMMAND [ARGS]..."),
                                         (("plot",), "Usage: qgcli plot [OPTIONS] COMMAND [ARGS]...")])
def test_no_arguments_show_the_help_on_a_terminal(args, usage, tmp_path):
    code, data = run_on_terminal([sys.executable, "-m", "qgcli", *args], width=80, cwd=tmp_path, env=_env())
    assert code == EXIT
    text = ANSI.sub("", data.decode().replace("\r\n", "\n"))
    # The top-level help fits 80 columns; plot's keeps one long example line, as click prints \b blocks.
    _check_help(text, usage, width=80 if not args else None)
    assert "Commands:" in text


def test_no_arguments_show_the_help_on_pipes(tmp_path):
    r = subprocess.run([sys.executable, "-m", "qgcli"], capture_output=True, text=True, env=_env(), cwd=tmp_path)
    assert r.returncode == EXIT
    shown, other = (r.stderr, r.stdout) if NEW_CLICK else (r.stdout, r.stderr)
    assert other == ""
    _check_help(shown, "Usage: qgcli [OPTIONS] COMMAND [ARGS]...")
    for command in ("fakequant-grad", "bn-grad", "report", "verify"):
        assert re.search(rf"^  {command} ", shown, re.M), shown
