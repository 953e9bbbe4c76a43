"""--fail-on: a CI gate on report and verify (exit 3 after printing, the conditions that held on stderr)."""
import json
import os

import pytest
from clirunner import make_runner

from qgcli.cli import main
from qgcli.report import gates

SAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "samples")
RUN, PER_CHANNEL = os.path.join(SAMPLES, "run.h5"), os.path.join(SAMPLES, "per_channel.h5")


def _cli(*args):
    return make_runner().invoke(main, list(args), prog_name="qgcli")


def test_report_gate_holds_after_printing():
    r = _cli("report", RUN, "--fail-on", "blocked>10%", "--json")
    assert r.exit_code == 3
    doc = json.loads(r.stdout)  # the result is printed whole first
    held = [row["path"] for row in doc["layers"] if row["gradient_blocked"] and row["gradient_blocked"] > 0.1]
    assert len(held) == 3
    assert r.stderr.strip() == ("fail-on blocked>10%: " + ", ".join(
        f"{p} ({100 * row['gradient_blocked']:.1f}%)" for p, row in
        zip(held, [x for x in doc["layers"] if x["path"] in held])))


def test_report_gate_that_does_not_hold_exits_0():
    assert _cli("report", RUN, "--fail-on", "blocked>50%,sqnr<1", "-q").exit_code == 0
    assert _cli("report", RUN, "-q").exit_code == 0


@pytest.mark.parametrize("condition, held", [
    ("any", ["ch 3", "ch 12", "ch 7"]), ("sqnr<5", ["ch 3 (4.4", "ch 12 (4.3", "ch 7 (4.09"]),
    ("blocked>=59%", ["ch 3 (59.0%)"])])
def test_report_gate_on_channels(condition, held):
    r = _cli("report", PER_CHANNEL, "--fail-on", condition, "-q")
    assert r.exit_code == 3
    line = r.stderr.strip()
    assert line.startswith(f"fail-on {condition}: ") and all(h in line for h in held)


@pytest.mark.parametrize("condition, message", [
    ("nope", "'nope' is not a condition of report; use any, no-gradient, "),
    ("sqnr>5%", "sqnr is not a share: write sqnr>5"),
    (",", "name at least one condition")])
def test_bad_conditions_stop_before_any_work(condition, message):
    r = _cli("report", RUN, "--fail-on", condition)
    assert r.exit_code == 2 and message in r.stderr and "(see 'qgcli report --help')" in r.stderr
    assert r.stdout == ""


def test_verify_gate(tmp_path):
    from test_verify import _write

    path = str(tmp_path / "run.h5")
    _write(path)
    assert _cli("verify", path, "--fail-on", "any").exit_code == 0
    r = _cli("verify", path, "--fail-on", "ulps>0")
    assert r.exit_code == 0  # every layer bit-identical or within its bound: 0 ulps is not above 0
    bad = str(tmp_path / "bad.h5")
    _write(bad, perturb="fq")
    r = _cli("verify", bad, "--fail-on", "ulps>0", "--json")
    assert r.exit_code == 3 and r.stderr.startswith("fail-on ulps>0: net/act_quant (1)")


def test_doctest_examples():
    doc = {"command": "verify", "layers": [{"path": "a", "passed": False, "status": "differs", "max_ulps": 3}]}
    assert gates.failures(doc, gates.parse("differs,ulps>2", "verify")) == ["differs: a", "ulps>2: a (3)"]
