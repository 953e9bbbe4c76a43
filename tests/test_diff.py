"""qgcli diff A B: two reports compared row by row, worst changes first."""
import json
import os
import shutil

import h5py
import pytest
import numpy as np
from clirunner import make_runner

from qgcli.cli import main
from qgcli.report.diff import diff

SAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "samples")


def _cli(*args):
    return make_runner().invoke(main, list(args), prog_name="qgcli")


def test_diff_of_two_run_files_names_the_layer_made_worse(tmp_path):
    a, b = tmp_path / "a.h5", tmp_path / "b.h5"
    shutil.copy(os.path.join(SAMPLES, "run.h5"), a)
    shutil.copy(a, b)
    with h5py.File(b, "r+") as f:  # B narrows one activation range: more clipping, more gradient blocked
        g = f["step_000200/backbone/conv1/act_quant"]
        g["min"][()], g["max"][()] = np.float32(-0.2), np.float32(0.2)
    r = _cli("diff", str(a), str(b), "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    worst = doc["rows"][0]
    assert worst["path"] == "step_000200/backbone/conv1/act_quant" and worst["score"] > 0
    assert worst["change"]["gradient_blocked"] > 0.1 and worst["change"]["sqnr_db"] < 0
    assert doc["worse"] == 1 and doc["unchanged"] == len(doc["rows"]) - 1 and doc["better"] == 0
    assert doc["verdict"].startswith("Verdict: 1 of 8 rows worse, 0 better; worst: step_000200/backbone/conv1/act_quant "
                                     "blocked +")
    r = _cli("diff", str(a), str(b))
    assert r.stdout.splitlines()[1].startswith("step_000200/backbone/conv1/act_quant")
    assert _cli("diff", str(a), str(b), "--fail-on", "blocked>10%", "--json").exit_code == 3
    assert _cli("diff", str(a), str(a), "--fail-on", "any").exit_code == 0


def test_diff_matches_steps_by_layer_and_takes_bundles():
    run = os.path.join(SAMPLES, "run.h5")
    doc = json.loads(_cli("diff", f"{run}:step_000100", f"{run}:step_000200", "--json").stdout)
    assert {r["path"] for r in doc["rows"]} == {"backbone/conv1/weight_quant", "backbone/conv1/act_quant",
                                                "head/act_quant", "head/logits_quant"}
    pc = os.path.join(SAMPLES, "per_channel.h5")
    doc = json.loads(_cli("diff", pc, pc, "--json").stdout)  # a bundle is one layer, at its root
    assert [r["path"] for r in doc["rows"]] == ["/"] and doc["unchanged"] == 1
    r = _cli("diff", pc, os.path.join(SAMPLES, "missing.h5"))
    assert r.exit_code == 2 and "missing.h5" in r.output and r.output.count("\n") == 1


def test_bundles_by_channel():
    a = {"rows": [{"channel": 0, "gradient_blocked": 0.1}, {"channel": 1, "gradient_blocked": 0.2}]}
    b = {"rows": [{"channel": 0, "gradient_blocked": 0.1}, {"channel": 1, "gradient_blocked": 0.5}]}
    d = diff(a, b)
    assert [r["path"] for r in d["rows"]] == ["ch 1", "ch 0"] and d["worse"] == 1


def test_rows_on_one_side_only():
    d = diff({"layers": [{"path": "x", "gradient_blocked": 0.1}, {"path": "y"}]},
             {"layers": [{"path": "x", "gradient_blocked": 0.1}, {"path": "z"}]})
    assert d["only_in_a"] == ["y"] and d["only_in_b"] == ["z"] and d["unchanged"] == 1
    assert d["verdict"] == "Verdict: 0 of 1 row worse, 0 better; 1 only in A, 1 only in B."


# --- two histories of the training monitor ---------------------------------------------------------------------

def _history(path, **kw):
    import history_samples

    return history_samples.write(path, **kw)


def test_diff_of_two_histories_at_the_last_common_step(tmp_path):
    import history_samples

    a = _history(tmp_path / "a.qgh")
    b = _history(tmp_path / "b.qgh", worse=2.0, steps=(1, 10, 20, 30, 40))  # B ran longer: 30 is the last common
    r = _cli("diff", a, b, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["kind"] == "histories" and doc["step"] == 30 and doc["steps"] == [30, 30]
    expected = {p: history_samples.stats(p, 30, worse=2.0)["blocked"] - history_samples.stats(p, 30)["blocked"]
                for p, _ in history_samples.LAYERS}
    assert [r["path"] for r in doc["rows"]] == sorted(expected, key=lambda p: -expected[p])  # worst first
    for row in doc["rows"]:
        assert row["change"]["gradient_blocked"] == pytest.approx(expected[row["path"]], abs=2 ** -10)  # float16
        assert row["a"]["dy_norm"] == pytest.approx(history_samples.stats(row["path"], 30)["dy_norm"])
        assert row["change"]["sqnr_db"] < 0 and row["score"] > 0 and row["upstream_gradient"] == ["present"] * 2
    assert doc["worse"] == 3 and doc["verdict"].startswith("Verdict: 3 of 3 rows worse, 0 better; worst: conv2.act "
                                                           "blocked +40.0 points")
    at10 = json.loads(_cli("diff", a, b, "--json", "--step", "10").stdout)
    assert at10["step"] == 10 and {r["path"]: r["b"]["gradient_blocked"] for r in at10["rows"]} == pytest.approx(
        {p: history_samples.stats(p, 10, worse=2.0)["blocked"] for p, _ in history_samples.LAYERS}, rel=2 ** -11)
    r = _cli("diff", a, b, "--step", "40")
    assert r.exit_code == 2 and "step 40 is not sampled by both histories" in r.output and r.output.count("\n") == 1
    text = _cli("diff", a, b).stdout.splitlines()
    assert text[0] == "histories compared at step 30" and text[2].startswith("conv2.act ")
    r = _cli("diff", a, b, "--fail-on", "blocked>10%", "--json")
    assert r.exit_code == 3 and "fail-on blocked>10%: conv2.act (40.0%)" in r.stderr
    assert _cli("diff", a, _history(tmp_path / "same.qgh"), "--fail-on", "any").exit_code == 0


def test_a_layer_that_lost_its_gradient_is_the_worst_change(tmp_path):
    import history_samples
    from qgcli.monitor.history import HistoryWriter

    a = _history(tmp_path / "a.qgh", worse=1.5)
    w = HistoryWriter(str(tmp_path / "b.qgh"))
    ids = {p: w.layer_id(p, "fake_quant", role, "FakeQuantize", {}) for p, role in history_samples.LAYERS}
    for step in history_samples.STEPS:  # B: fc.weight gets no gradient at step 30, the rest as A was
        w.add_sample(step, {lid: dict(history_samples.stats(p, step, worse=1.5),
                                      **({"dy_norm": 0.0, "blocked": None} if p == "fc.weight" and step == 30 else {}))
                            for p, lid in ids.items()})
    w.close()
    doc = json.loads(_cli("diff", a, str(tmp_path / "b.qgh"), "--json").stdout)
    assert doc["rows"][0]["path"] == "fc.weight" and doc["rows"][0]["upstream_gradient"] == ["present", "zero"]
    assert doc["worse"] == 1 and doc["unchanged"] == 2 and "fc.weight lost its gradient" in doc["verdict"]
    r = _cli("diff", a, str(tmp_path / "b.qgh"), "--fail-on", "no-gradient")
    assert r.exit_code == 3 and "fail-on no-gradient: fc.weight" in r.stderr
    assert _cli("diff", str(tmp_path / "b.qgh"), a, "--fail-on", "no-gradient").exit_code == 0  # regained: better


def test_histories_without_a_common_step_compare_their_last_samples(tmp_path):
    doc = json.loads(_cli("diff", _history(tmp_path / "a.qgh", steps=(1, 10)),
                          _history(tmp_path / "b.qgh", steps=(5, 15)), "--json").stdout)
    assert doc["step"] is None and doc["steps"] == [10, 15] and len(doc["rows"]) == 3


def test_a_history_against_a_run_file_is_refused_in_one_line(tmp_path):
    h, run = _history(tmp_path / "h.qgh"), os.path.join(SAMPLES, "run.h5")
    for args, said in (((h, run), f"{run} is not a history and A ({h}) is"),
                       ((run, h), f"{h} is a history and A ({run}) is not"),
                       ((h, str(tmp_path / "missing.h5")), "no such file")):
        r = _cli("diff", *args)
        assert r.exit_code == 2 and said in r.output and r.output.count("\n") == 1 and "Traceback" not in r.output
    r = _cli("diff", run, run, "--step", "3")
    assert r.exit_code == 2 and "applies to two histories" in r.output


def test_two_histories_written_by_the_torch_monitor(tmp_path):
    """Real histories: a torch.ao QAT model trained twice, the second time with a learning rate 20 times higher."""
    pytest.importorskip("torch")
    from test_monitor_torch import _net, _train

    _train(_net(), str(tmp_path / "a.qgh"), steps=4, every=2)
    _train(_net(), str(tmp_path / "b.qgh"), steps=4, every=2, lr=1.0)
    doc = json.loads(_cli("diff", str(tmp_path / "a.qgh"), str(tmp_path / "b.qgh"), "--json").stdout)
    assert doc["step"] == 4 and len(doc["rows"]) >= 4 and not doc["only_in_a"] and not doc["only_in_b"]
    weights = [r for r in doc["rows"] if r["path"].endswith("weight_fake_quant")]
    assert weights and all(r["a"]["range_max"] is not None and r["change"]["scale_median"] is not None
                           for r in weights)
    assert any(r["change"]["dy_norm"] for r in doc["rows"])  # the runs differ: the gradients' norms changed
    scores = [r["score"] for r in doc["rows"]]
    assert scores == sorted(scores, reverse=True)


# --- report A --baseline B: the same comparison in the report's JSON (the page: tests/test_html_report.py) ---

def _narrowed(tmp_path):
    """samples/run.h5 with one activation range narrowed (more clipping, more gradient blocked)."""
    b = tmp_path / "b.h5"
    shutil.copy(os.path.join(SAMPLES, "run.h5"), b)
    with h5py.File(b, "r+") as f:
        g = f["step_000200/backbone/conv1/act_quant"]
        g["min"][()], g["max"][()] = np.float32(-0.2), np.float32(0.2)
    return str(b)


def test_report_with_a_baseline_has_the_diff_in_its_json(tmp_path):
    a, b = os.path.join(SAMPLES, "run.h5"), _narrowed(tmp_path)
    r = _cli("report", b, "--baseline", a, "--json", "-q")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    expected = json.loads(_cli("diff", a, b, "--json").stdout)
    assert doc["baseline"]["file"] == a and doc["baseline"]["rows"] == expected["rows"]
    assert doc["baseline"]["verdict"] == expected["verdict"] and "command" not in doc["baseline"]
    assert doc["layers"] == json.loads(_cli("report", b, "--json", "-q").stdout)["layers"]  # the report unchanged
    text = _cli("report", b, "--baseline", a, "-q").stdout.splitlines()
    assert text[-1] == f"Against the baseline {a}: {expected['verdict']}"


def test_report_of_a_history_with_a_baseline(tmp_path):
    a = _history(tmp_path / "a.qgh")
    b = _history(tmp_path / "b.qgh", worse=2.0, steps=(1, 10, 20, 30, 40))
    doc = json.loads(_cli("report", b, "--baseline", a, "--json").stdout)
    expected = json.loads(_cli("diff", a, b, "--json").stdout)
    assert doc["baseline"]["step"] == 30 and doc["baseline"]["rows"] == expected["rows"]
    assert doc["command"] == "trend" and len(doc["steps"]) == 5
    lines = _cli("report", b, "--baseline", a).stdout.splitlines()
    assert lines[-1].startswith(f"Against the baseline {a} at step 30: Verdict: 3 of 3 rows worse")


def test_a_baseline_of_another_kind_is_refused_before_any_output(tmp_path):
    h, run = _history(tmp_path / "h.qgh"), os.path.join(SAMPLES, "run.h5")
    page = tmp_path / "p.html"
    for args, said in (((run, "--baseline", h), f"{h} is a history and the report is of a run file"),
                       ((h, "--baseline", run), f"{run} is not a history and the report is of a history"),
                       ((run, "--baseline", str(tmp_path / "none.h5")), "no such file"),
                       ((os.path.join(SAMPLES, "per_channel.h5"), "--baseline", run), "qgcli diff A B")):
        r = _cli("report", *args, "--html", str(page))
        assert r.exit_code == 2 and said in r.output and r.output.count("\n") == 1, r.output
        assert "--baseline" in r.output and not page.exists()
