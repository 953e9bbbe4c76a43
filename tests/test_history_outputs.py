"""A history (qgcli.monitor's file) as people act on it: `trend` and `doctor` with --fail-on (exit 3 after
printing), `trend --tensorboard` read back with TensorBoard's EventAccumulator, `trend`/`report`/`doctor --html`
pages, and `report HISTORY` as trend shows it."""
import json

import pytest
from clirunner import make_runner

import history_samples
from qgcli.cli import main


def _cli(*args):
    return make_runner().invoke(main, [str(a) for a in args], prog_name="qgcli")


@pytest.fixture
def history(tmp_path):
    return history_samples.write(tmp_path / "run.qgh")


@pytest.mark.parametrize("command", ["trend", "report"])
@pytest.mark.parametrize("condition, code, line", [
    ("blocked>20%", 3, "fail-on blocked>20%: conv2.act (60.0%)"),
    ("nan", 3, "fail-on nan: fc.weight"),
    ("blocked-jump,sqnr<10", 3, "fail-on blocked-jump: conv2.act"),
    ("any", 3, "fail-on any: conv2.act, conv2.act, fc.weight"),
    ("blocked>70%,gradient_zero,oscillation", 0, "")])
def test_trend_gate_after_the_table(history, command, condition, code, line):
    r = _cli(command, history, "--fail-on", condition, "--json")
    assert r.exit_code == code, r.output
    doc = json.loads(r.stdout)  # printed whole first
    assert doc["command"] == "trend" and len(doc["layers"]) == 3
    assert r.stderr.strip().splitlines()[:1] == ([line] if line else [])


def test_trend_gate_refusals(history):
    r = _cli("trend", history, "--fail-on", "below>3%")
    assert r.exit_code == 2 and "'below>3%' is not a condition of trend" in r.stderr and r.stdout == ""
    r = _cli("report", history, "--fail-on", "below>3%")
    assert r.exit_code == 2 and "is not a condition of a history" in r.stderr and r.stdout == ""
    r = _cli("report", history, "--layer", "conv2.act")
    assert r.exit_code == 2 and "'--layer': does not apply to a history" in r.stderr


@pytest.mark.parametrize("condition, code", [("error", 3), ("nan", 3), ("warning", 3), ("no_gradient", 0),
                                             ("ste-broken,oscillation", 0)])
def test_doctor_gate(history, condition, code):
    r = _cli("doctor", history, "--fail-on", condition)
    assert r.exit_code == code, r.output
    assert r.stdout.startswith("doctor ") and ("error: nan at step 30: fc.weight" in r.stdout)
    assert (r.stderr.strip() == f"fail-on {condition}: fc.weight") == (code == 3)


def test_gate_kinds_are_the_monitors_kinds():
    import inspect
    import re

    from qgcli.monitor import doctor, trends
    from qgcli.report import gates

    assert gates.DOCTOR_KINDS == doctor.KINDS
    raised = set(re.findall(r'found\["([a-z_]+)"\]', inspect.getsource(trends.conditions)))
    assert raised == set(gates.TREND_KINDS)


def test_trend_tensorboard_read_back(history, tmp_path):
    pytest.importorskip("tensorboardX")
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from qgcli.monitor.history import read_history

    logdir = tmp_path / "tb"
    r = _cli("trend", history, "--tensorboard", logdir, "--json")
    assert r.exit_code == 0, r.output
    assert r.stderr.strip() == f"wrote TensorBoard events to {logdir}"
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    h = read_history(history)
    for layer in h.layers:
        s = h.series(layer["path"])
        got = acc.Scalars(f"gradient_blocked/{layer['path']}")
        assert [e.step for e in got] == s["steps"]
        assert [e.value for e in got] == pytest.approx(s["blocked"], rel=1e-6)
        clipped = [e.value for e in acc.Scalars(f"clipped/{layer['path']}")]
        assert clipped == pytest.approx([a + b for a, b in zip(s["clip_low"], s["clip_high"])], rel=1e-6)
    # the share of layers where an event's condition holds: conv2.act's jump at 20, fc.weight's NaN at 30
    assert [e.value for e in acc.Scalars("aggregate/share_with_events")] == pytest.approx([0, 0, 1 / 3, 1 / 3])
    worst = [e.value for e in acc.Scalars("aggregate/worst_5_gradient_blocked")]
    assert worst[2] == pytest.approx((0.6 + 0.02 + 0.02) / 3, rel=2 ** -11)  # float16 shares
    assert [x.step for x in acc.Histograms("distribution/gradient_blocked")] == list(history_samples.STEPS)


def test_history_pages(history, tmp_path):
    page = tmp_path / "trend.html"
    r = _cli("report", history, "--html", page, "-q")
    assert r.exit_code == 0, r.output
    text = page.read_text()
    assert "3 events in 2 of 3 layers over 4 samples (steps 1..30)" in text
    assert "data:image/png;base64," in text and 'data-layer="conv2.act"' in text
    assert "blocked_jump" in text and "http://" not in text.replace("http://www.w3.org/2000/svg", "")
    again = _cli("trend", history, "--html", page)
    assert again.exit_code == 2 and "exists; use --force" in again.stderr and again.stdout == ""
    doctor_page = tmp_path / "doctor.html"
    r = _cli("doctor", history, "--html", doctor_page)
    assert r.exit_code == 0, r.output
    assert "fc.weight" in doctor_page.read_text() and "NaN or Inf" in doctor_page.read_text()
    r = _cli("doctor", history, "--html", history, "--force")
    assert r.exit_code == 2 and "is also an input" in r.stderr
