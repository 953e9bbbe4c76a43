"""`qgcli trend` events and `qgcli doctor` findings on histories written sample by sample (no framework needed):
each event kind at the step it starts, once per onset; each finding kind with its severity and its fields."""
import json

import pytest
from click.testing import CliRunner

from qgcli.cli import main
from qgcli.monitor.history import HistoryWriter

HEALTHY = {"clip_low": 0.01, "clip_high": 0.01, "blocked": 0.02, "dy_norm": 1.0, "dx_norm": 1.0, "dy_zero": 0.0,
           "ste_error": 0.0, "scale_min": 0.1, "scale_median": 0.1, "scale_max": 0.1, "zero_point_min": 0,
           "zero_point_max": 0, "range_min": -12.8, "range_max": 12.7, "nan_inputs": 0, "nan_grads": 0,
           "fake_quant_enabled": 1, "needs_grad": 1, "oscillating": 0.0, "oscillation_max": 0.0}

#: layer -> (the step its fault starts, what changes from then on, the event kind, the doctor's kind)
FAULTS = {
    "blocked": (20, {"blocked": 0.6}, "blocked_jump", None),
    "clipping": (20, {"clip_low": 0.3, "clip_high": 0.1}, "clipping_jump", None),
    "negative": (30, {"scale_min": -0.01}, "scale_negative", "range_collapse"),
    "inverted": (30, {"range_min": 1.0, "range_max": -1.0}, "min_gt_max", "range_collapse"),
    "collapse": (40, {"scale_min": 5e-4, "scale_median": 5e-4, "scale_max": 5e-4}, "range_collapse",
                 "range_collapse"),
    "zero_grad": (20, {"dy_norm": 0.0, "dy_zero": 1.0, "dx_norm": 0.0}, "gradient_zero", "no_gradient"),
    "no_grad": (30, {"dy_norm": None, "dy_zero": None, "dx_norm": None}, "gradient_zero", "no_gradient"),
    "oscillating": (30, {"oscillating": 0.2, "oscillation_max": 0.1}, "oscillation", "oscillation"),
    "nan": (40, {"nan_grads": 3}, "nan", "nan"),
    "off": (20, {"fake_quant_enabled": 0}, "fake_quant_disabled", "fake_quant_disabled"),
    "ste": (30, {"ste_error": 1.0, "dx_norm": 0.0}, None, "ste_broken"),
    "default": (1, {"scale_min": 1.0, "scale_median": 1.0, "scale_max": 1.0}, None, "observer_default"),
    # not findings: an input quantizer of data never gets a gradient (it needs none)
    "input": (1, {"needs_grad": 0, "dy_norm": None, "dy_zero": None, "dx_norm": None}, None, None),
}
STEPS = [1, 10, 20, 30, 40, 50]


def _history(path, recover=()):
    """The FAULTS from their step on (``recover``: layers whose fault goes away at step 50)."""
    w = HistoryWriter(path, meta={"framework": "test", "every": 10, "threshold": 0.02, "momentum": 0.01})
    ids = {name: w.layer_id(name, "fake_quant", "activation", "M", {}) for name in FAULTS}
    for step in STEPS:
        rows = {}
        for name, (start, change, _, _) in FAULTS.items():
            faulty = step >= start and not (name in recover and step == 50)
            rows[ids[name]] = {**HEALTHY, **(change if faulty else {})}
        w.add_sample(step, rows)
    w.close()


def test_every_event_kind_at_its_onset(tmp_path):
    _history(tmp_path / "h", recover=("nan", "off"))
    result = CliRunner().invoke(main, ["trend", str(tmp_path / "h"), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    events = [(e["step"], e["layer"], e["kind"]) for e in doc["events"]]
    expected = sorted((start, name, event) for name, (start, _, event, _) in FAULTS.items() if event)
    # a jump is an event once (the next sample is no new jump); a state is one event per onset
    assert sorted(events) == expected, events
    assert all(set(e) == {"step", "layer", "kind", "message"} and e["message"] for e in doc["events"])
    assert [e["step"] for e in doc["events"]] == sorted(e["step"] for e in doc["events"])
    layer = doc["layers"][0]
    assert layer["path"] == "blocked" and layer["steps"] == STEPS and layer["blocked"] == pytest.approx([0.02] * 2 + [0.6] * 4, rel=2 ** -11)  # float16


def test_a_fault_that_returns_is_a_new_event(tmp_path):
    path = tmp_path / "h"
    w = HistoryWriter(path, meta={"every": 1})
    lid = w.layer_id("q", "fake_quant", "activation", "M", {})
    for step, nans in zip(range(1, 7), [0, 2, 2, 0, 5, 0]):
        w.add_sample(step, {lid: {**HEALTHY, "nan_inputs": nans}})
    w.close()
    doc = json.loads(CliRunner().invoke(main, ["trend", str(path), "--json"]).output)
    assert [(e["step"], e["kind"]) for e in doc["events"]] == [(2, "nan"), (5, "nan")]


def test_every_finding_kind_with_its_severity(tmp_path):
    _history(tmp_path / "h")
    result = CliRunner().invoke(main, ["doctor", str(tmp_path / "h"), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["kind"] == "history"
    got = {(f["layer"], f["kind"]): f for f in doc["findings"]}
    expected = {(name, kind): start for name, (start, _, _, kind) in FAULTS.items() if kind}
    assert {k: f["step"] for k, f in got.items()} == expected
    errors = {"ste_broken", "no_gradient", "range_collapse", "range_not_learning", "nan"}
    for f in doc["findings"]:
        assert set(f) == {"kind", "severity", "layer", "step", "evidence", "advice"}
        assert f["severity"] == ("error" if f["kind"] in errors else "warning") and f["evidence"] and f["advice"]
    assert doc["errors"] == sum(f["severity"] == "error" for f in doc["findings"]) == 7
    assert CliRunner().invoke(main, ["doctor", str(tmp_path / "h"), "--fail-on", "error"]).exit_code == 3
    # warnings only: --fail-on error passes, --fail-on warning does not
    only = tmp_path / "warnings"
    w = HistoryWriter(only, meta={"every": 10})
    lid = w.layer_id("q", "fake_quant", "weight", "M", {})
    for step in STEPS:
        w.add_sample(step, {lid: {**HEALTHY, "oscillating": 0.3 if step >= 20 else 0.0}})
    w.close()
    assert CliRunner().invoke(main, ["doctor", str(only), "--fail-on", "error"]).exit_code == 0
    assert CliRunner().invoke(main, ["doctor", str(only), "--fail-on", "warning"]).exit_code == 3
