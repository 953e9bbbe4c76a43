"""qgcli.run: any command from Python, as the command line runs it, raising qgcli's own errors."""
import ast
import pathlib

import numpy as np
import pytest
from clirunner import make_runner

import qgcli
from qgcli.cli import main
from qgcli.errors import OptionError, QgcliError, UsageProblem

ROOT = pathlib.Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"


def test_run_writes_what_the_command_line_writes(tmp_path):
    summary = qgcli.run("fakequant-grad", str(SAMPLES / "per_channel.h5"), output=str(tmp_path / "api.h5"))
    r = make_runner().invoke(main, ["fakequant-grad", str(SAMPLES / "per_channel.h5"), "-o", str(tmp_path / "cli.h5"),
                                  "--json"])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "api.h5").read_bytes() == (tmp_path / "cli.h5").read_bytes()
    import json

    cli_doc = json.loads(r.stdout)
    cli_doc["output"] = summary["output"]
    assert summary == cli_doc


def test_run_files_and_reports(tmp_path):
    run = qgcli.run("fakequant-grad", str(SAMPLES / "run.h5"), output=str(tmp_path / "g.h5"))
    assert run["ran"] == len(run["layers"]) > 1
    report = qgcli.run("report", str(SAMPLES / "run.h5"), top=2)
    assert report["verdict"].startswith("Verdict:")


def test_options_map_to_the_command_line(tmp_path):
    x = np.array([-7.0, -6.0, -1.0, 1.0, 6.0], np.float32)
    np.savez(tmp_path / "b.npz", inputs=x, gradients=np.ones_like(x))
    s = qgcli.run("fakequant-grad", str(tmp_path / "b.npz"), min=-6, max=6.0, num_bits=2, narrow_range=False,
                  output=str(tmp_path / "o.npz"), compression=None)
    assert s["grid"]["nudged_min"] == -8.0 and s["attributes"]["narrow_range"] is False
    s = qgcli.run("fakequant-grad", str(tmp_path / "b.npz"), min=-6, max=6, narrow_range=True, num_bits=2,
                  output=str(tmp_path / "o.npz"), force=True)
    assert s["attributes"]["narrow_range"] is True
    per_channel = np.ones((2, 3), np.float32)
    np.savez(tmp_path / "c.npz", inputs=per_channel, gradients=per_channel)
    s = qgcli.run("fakequant-grad", str(tmp_path / "c.npz"), min=[-1, -2, -3], max=(1, 2, 3), variant="per-channel",
                  output=str(tmp_path / "c_out.npz"))
    assert s["variant"] == "per-channel"


def test_errors_are_qgclis_own(tmp_path):
    with pytest.raises(OptionError, match=r"^Invalid value for '--axis': only applies to --variant per-channel$"):
        qgcli.run("fakequant-grad", str(SAMPLES / "notebook.h5"), axis=3, output=str(tmp_path / "a.h5"))
    with pytest.raises(OptionError, match="not an option of 'qgcli fakequant-grad'; it takes axis, "):
        qgcli.run("fakequant-grad", str(SAMPLES / "notebook.h5"), bits=2)
    with pytest.raises(OptionError, match="not an option"):
        qgcli.run("fakequant-grad", str(SAMPLES / "notebook.h5"), json=True)  # the document is the result
    with pytest.raises(UsageProblem, match="no qgcli command 'fakequant-gard'"):
        qgcli.run("fakequant-gard")
    with pytest.raises(QgcliError, match="no such file"):
        qgcli.run("fakequant-grad", str(tmp_path / "missing.h5"), output=str(tmp_path / "b.h5"))
    with pytest.raises(UsageProblem):  # click's own usage error (an option's value), worded as qgcli's
        qgcli.run("fakequant-grad", str(SAMPLES / "notebook.h5"), num_bits="many", output=str(tmp_path / "c.h5"))
    assert not (tmp_path / "a.h5").exists() and not (tmp_path / "c.h5").exists()


def test_no_module_below_the_cli_imports_click():
    found = []
    for path in sorted((ROOT / "qgcli").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("qgcli/cli/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{rel}:{node.lineno}" for n in names if n == "click" or n.startswith("click.")]
    assert found == []
