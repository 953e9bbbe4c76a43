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
    assert rows[0] == (1, "layer0", pytest.approx(0.1, rel=1e-7), 1.0, None)  # NaN is stored as NULL
    assert rows[0][2] != 0.1  # float32 precision
    assert len(rows) == 9
    assert columns == ["step", "layer_id", *NAMES]


def test_read_back(tmp_path):
    path = tmp_path / "h"
    _write(path, [1, 10])
    h = read_history(path)
    assert h.steps == [1, 10] and [layer["path"] for layer in h.layers] == ["layer0", "layer1", "layer2"]
    assert h.layers[0]["info"] == {"quant_min": -128} and h.meta["every"] == "1"
    s = h.series("layer1")
    assert s["steps"] == [1, 10] and s["dy_norm"] == [1.0, 10.0] and s["clip_low"] == pytest.approx([0.2, 0.2], rel=1e-7)  # ids count from 1


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
        # every sample the writer reported, and the ones it wrote between our last read and the kill (it does not
        # wait for us: on a loaded machine that is a few), with no gap
        assert len(h.steps) >= done and h.steps == list(range(1, len(h.steps) + 1))
        with closing(sqlite3.connect(path)) as db:
            counts = db.execute("select step, count(*), min(dy_norm - layer_id) from stats group by step").fetchall()
        assert counts == [(s, 100, float(s)) for s in h.steps]  # whole samples only


def test_compact_codes_read_as_float32_by_the_view(tmp_path):
    """stat_codes holds float32-precision codes; the documented ``stats`` view (plain SQLite integer arithmetic)
    decodes them to what read_history gives, over the whole range (tiny, huge, infinite values as REALs)."""
    import math
    import struct

    from qgcli.monitor.history import decode, encode

    rng = random.Random(5)
    values = [0.0, 1.0, -1.0, 0.5, 2.0 ** 24 - 1, 2.0 ** 24 + 2, 1e-12, 1e-20, 1e30, math.inf, -math.inf]
    values += [rng.uniform(-1, 1) * 10 ** rng.uniform(-12, 20) for _ in range(300)]
    path = tmp_path / "h"
    w = HistoryWriter(path)
    lid = w.layer_id("q", "fake_quant", "activation", "M", {})
    for step, v in enumerate(values, start=1):
        w.add_sample(step, {lid: {"dy_norm": v, "scale_median": v, "scale_min": v, "scale_max": 2 * v}})
    w.close()
    with closing(sqlite3.connect(path)) as db:
        viewed = db.execute("select dy_norm, scale_min, scale_max, typeof(dy_norm) from stats order by step").fetchall()
        stored = db.execute("select dy_norm, scale_min from stat_codes order by step").fetchall()
    s = read_history(path).series("q")
    for v, (dy, smin, smax, kind), (code, shared), got in zip(values, viewed, stored, s["dy_norm"]):
        assert dy == smin == got == decode(encode(v)) and smax == decode(encode(2 * v)) and kind == "real"
        assert shared is None  # equal to the median: stored once
        if 1e-9 < abs(v) < 1e25:
            assert isinstance(code, int) and abs(code) < 2 ** 31  # at most 4 bytes in SQLite's record
            assert got == struct.unpack("f", struct.pack("f", v))[0]  # float32's rounding
        elif abs(v) < 1e-15 and v:
            assert code == v  # out of the codes' range: the REAL itself


def _write_version_1(path, version="1"):
    """A history as qgcli wrote it before the compact rows (schema version 1: stats a table of REALs)."""
    with closing(sqlite3.connect(path)) as db, db:
        db.execute("CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT)")
        db.execute("CREATE TABLE layers(id INTEGER PRIMARY KEY, path TEXT UNIQUE, kind TEXT, role TEXT, module TEXT, "
                   "info TEXT)")
        db.execute("CREATE TABLE samples(step INTEGER PRIMARY KEY, time REAL, ranks INTEGER)")
        db.execute(f"CREATE TABLE stats(step INTEGER, layer_id INTEGER, {', '.join(f'{n} REAL' for n in NAMES)})")
        db.executemany("INSERT INTO meta VALUES (?, ?)", [("format", "qgcli-history"), ("version", version)])
        db.execute("INSERT INTO layers VALUES (1, 'q', 'fake_quant', 'activation', 'M', '{}')")
        for step in (1, 10):
            db.execute("INSERT INTO samples VALUES (?, 0, 1)", (step,))
            db.execute("INSERT INTO stats (step, layer_id, blocked, dy_norm) VALUES (?, 1, 0.1, ?)", (step, step / 3))


def test_version_1_still_read_and_a_newer_version_refused(tmp_path):
    from click.testing import CliRunner

    from qgcli.cli import main

    _write_version_1(tmp_path / "v1")
    s = read_history(tmp_path / "v1").series("q")
    assert s["steps"] == [1, 10] and s["blocked"] == [0.1, 0.1] and s["dy_norm"] == [1 / 3, 10 / 3]
    assert CliRunner().invoke(main, ["trend", str(tmp_path / "v1")]).exit_code == 0
    _write_version_1(tmp_path / "v9", version="9")
    with pytest.raises(FileFormatError, match="history schema version 9, this qgcli reads versions 1, 2"):
        read_history(tmp_path / "v9")
    result = CliRunner().invoke(main, ["trend", str(tmp_path / "v9")])
    assert result.exit_code == 2 and "schema version 9" in result.output and "Traceback" not in result.output
