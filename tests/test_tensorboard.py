"""report --tensorboard: event files read back with TensorBoard's own EventAccumulator."""
import json
import os

import pytest
from clirunner import make_runner

from qgcli.cli import main

pytest.importorskip("tensorboardX")
event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

RUN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "samples", "run.h5")


def _load(logdir):
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_report_events_read_back(tmp_path):
    logdir = tmp_path / "tb"
    r = make_runner().invoke(main, ["report", RUN, "--tensorboard", str(logdir), "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    acc = _load(logdir)
    tags = acc.Tags()["scalars"]
    for row in doc["layers"]:
        events = acc.Scalars(f"gradient_blocked/{row['layer']}")
        by_step = {e.step: e.value for e in events}
        assert by_step[int(row["step"].split("_")[1])] == pytest.approx(row["gradient_blocked"], rel=1e-6)
    assert {"aggregate/worst_5_gradient_blocked", "aggregate/share_flagged", "aggregate/median_sqnr_db"} <= set(tags)
    flagged = [e.value for e in acc.Scalars("aggregate/share_flagged")]
    per_step = {}
    for row in doc["layers"]:
        per_step.setdefault(row["step"], []).append(row["flagged"])
    assert flagged == pytest.approx([sum(v) / len(v) for _, v in sorted(per_step.items())])
    assert [h.step for h in acc.Histograms("distribution/gradient_blocked")] == [100, 200]


def test_tensorboard_refusals(tmp_path):
    per_channel = os.path.join(os.path.dirname(RUN), "per_channel.h5")
    r = make_runner().invoke(main, ["report", per_channel, "--tensorboard", str(tmp_path / "tb")], prog_name="qgcli")
    assert r.exit_code == 2 and "--tensorboard" in r.output and not (tmp_path / "tb").exists()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = make_runner().invoke(main, ["report", RUN, "--tensorboard", str(blocker / "tb"), "-q"])
    assert r.exit_code == 2 and "cannot write" in r.output
