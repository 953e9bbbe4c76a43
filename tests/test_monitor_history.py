"""The history file (qgcli.monitor.history): its schema read without qgcli, recognition by content, and a
writer killed with SIGKILL at random moments leaves every completed sample readable."""
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
from contextlib import closing

import pytest

from qgcli.errors import FileFormatError, OutputError
from qgcli.monitor.history import NAMES, HistoryWriter, is_history, read_history


def _write(path, steps, layers=3):
    w = HistoryWriter(path, meta={"framework": "test", "every": 1})
    ids = [w.layer_id(f"layer{i}", "fake_quant", "weight", "FakeQuantize", {"quant_min": -128}) for i in range(layers)]
    for step in steps:
        w.add_sample(step, {lid: {"clip_low": 0.1 * lid, "dy_norm": step, "scale_min": float("nan")} for lid in ids})
    w.close()


def test_schema_reads_with_sqlite_alone(tmp_path):
    path = tmp_path / "any.name"
    _write(path, [1, 10, 20])
    with closing(sqlite3.connect(path)) as db:
        assert dict(db.execute("select key, value from meta"))["format"] == "qgcli-history"
        rows = db.execute("select stats.step, layers.path, clip_low, dy_norm, scale_min from stats "
                          "join layers on layers.id = stats.layer_id order by step, path").fetchall()
        columns = [c[1] for c in db.execute("pragma table_info(stats)")]
    assert rows[0] == (1, "layer0", 0.1, 1.0, None)  # NaN is stored as NULL
    assert len(rows) == 9
    assert columns == ["step", "layer_id", *NAMES]


def test_read_back(tmp_path):
    path = tmp_path / "h"
    _write(path, [1, 10])
    h = read_history(path)
    assert h.steps == [1, 10] and [layer["path"] for layer in h.layers] == ["layer0", "layer1", "layer2"]
    assert h.layers[0]["info"] == {"quant_min": -128} and h.meta["every"] == "1"
    s = h.series("layer1")
    assert s["steps"] == [1, 10] and s["dy_norm"] == [1.0, 10.0] and s["clip_low"] == [0.2, 0.2]  # ids count from 1


def test_recognised_by_content(tmp_path):
    other = tmp_path / "plain.sqlite"
    with closing(sqlite3.connect(other)) as db:
        db.execute("create table meta(key, value)")
    text = tmp_path / "history.qgh"
    text.write_text("not a database")
    assert not is_history(other) and not is_history(text) and not is_history(tmp_path / "missing")
    with pytest.raises(FileFormatError, match="not a qgcli history"):
        read_history(other)


def test_existing_file_refused(tmp_path):
    path = tmp_path / "h"
    _write(path, [1])
    with pytest.raises(OutputError, match="exists"):
        HistoryWriter(path)
    HistoryWriter(path, overwrite=True).close()
    assert read_history(path).steps == []


_WRITER = textwrap.dedent("""
    import sys
    from qgcli.monitor.history import HistoryWriter
    w = HistoryWriter(sys.argv[1])
    ids = [w.layer_id(f"layer{i}", "fake_quant", "weight", "M", {}) for i in range(100)]
    step = 0
    while True:
        step += 1
        w.add_sample(step, {lid: {n: step + lid for n in ("clip_low", "dy_norm", "blocked")} for lid in ids})
        print(step, flush=True)
""")


def test_sigkill_keeps_every_completed_sample(tmp_path):
    rng = random.Random(37)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    for attempt in range(4):
        path = tmp_path / f"killed{attempt}"
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True, env=env)
        done = 0
        want = rng.randint(5, 60)
        while done < want:
            done = int(proc.stdout.readline())
            if done == 3:  # a reader while the writer runs
                assert read_history(path).steps[:3] == [1, 2, 3]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        h = read_history(path)
        assert h.steps[:done] == list(range(1, done + 1))  # every sample the writer reported, maybe one more
        assert len(h.steps) in (done, done + 1)
        with closing(sqlite3.connect(path)) as db:
            counts = db.execute("select step, count(*), min(dy_norm - layer_id) from stats group by step").fetchall()
        assert counts == [(s, 100, float(s)) for s in h.steps]  # whole samples only
