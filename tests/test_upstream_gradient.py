"""Layers that receive no gradient are not reported healthy: ``upstream_gradient`` on every row, "no grad" in the
table, and a verdict that names the quantizer clipping everything when the file shows it."""
import json

import h5py
import numpy as np
from clirunner import make_runner

from qgcli.cli import main


def _starved_run(path):
    """step_000001: conv/act_quant gets an all-zero gradient because head/logits_quant clips every value;
    input_quant is forward-only (no gradients)."""
    rng = np.random.default_rng(3)
    with h5py.File(path, "w") as f:
        def group(name, x, g, lo, hi):
            grp = f.create_group(f"step_000001/{name}")
            grp.attrs["op"] = "FakeQuantWithMinMaxVars"
            grp["inputs"], grp["min"], grp["max"] = x, np.float32(lo), np.float32(hi)
            if g is not None:
                grp["gradients"] = g
        x = rng.standard_normal((4, 32)).astype(np.float32)
        group("input_quant", x, None, -3, 3)
        group("conv/act_quant", x, np.zeros_like(x), -1, 1)
        group("head/logits_quant", (x + 20).astype(np.float32), rng.standard_normal(x.shape).astype(np.float32),
              -1, 1)


def test_upstream_gradient_is_reported(tmp_path):
    run = str(tmp_path / "run.h5")
    _starved_run(run)
    r = make_runner().invoke(main, ["report", run, "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    by_layer = {row["layer"]: row for row in doc["layers"]}
    assert {k: v["upstream_gradient"] for k, v in by_layer.items()} == {
        "input_quant": "absent", "conv/act_quant": "zero", "head/logits_quant": "present"}
    assert by_layer["conv/act_quant"]["gradient_blocked"] is None  # a share of no gradient mass means nothing
    assert by_layer["head/logits_quant"]["clipped"] == 1.0
    assert doc["verdict"].startswith(
        "Verdict: no gradient reaches 1 layer: step_000001/head/logits_quant clips 100%; ")
    r = make_runner().invoke(main, ["report", run])
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("step_000001/conv/act_quant")][0]
    assert "no grad" in line
    r = make_runner().invoke(main, ["report", run, "--fail-on", "no-gradient", "-q"])
    assert r.exit_code == 3 and "step_000001/conv/act_quant" in r.stderr and "input_quant" in r.stderr


def test_healthy_layers_say_present(tmp_path):
    import os

    run = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "samples", "run.h5")
    doc = json.loads(make_runner().invoke(main, ["report", run, "--json"]).stdout)
    assert {row["upstream_gradient"] for row in doc["layers"]} == {"present"}
    assert not doc["verdict"].startswith("Verdict: no gradient")
