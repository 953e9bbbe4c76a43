"""qgcli diff A B: two reports compared row by row, worst changes first."""
import json
import os
import shutil

import h5py
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
