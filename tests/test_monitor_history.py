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
from pathlib import Path

import pytest

from qgcli.errors import FileFormatError, OutputError
from qgcli.monitor.history import NAMES, HistoryWriter, is_history, read_history


def _write(path, steps, layers=3):
    w = HistoryWriter(path, meta={"framework": "test", "every": 1})
    ids = [w.layer_id(f"layer{i}", "fake_quant", "weight", "FakeQuantize", {"quant_min": -128}) for i in range(layers)]
    for step in steps:
        w.add_sample(step, {lid: {"clip_low": 0.1 * lid, "dy_norm": step, "scale_min": float("nan")} for lid in ids})
    w.close()


def test_schema_reads_with_sqlite_and_numpy_alone(tmp_path):
    """The recipe of the module docstring and docs/monitor.md: a sample's table from sqlite3, zlib and NumPy."""
    import zlib

    import numpy as np

    path = tmp_path / "any.name"
    _write(path, [1, 10, 20])
    with closing(sqlite3.connect(path)) as db:
        assert dict(db.execute("select key, value from meta"))["format"] == "qgcli-history"
        columns = db.execute("select name, dtype from columns order by position").fetchall()
        samples = {step: np.frombuffer(zlib.decompress(stats), [(name, dtype, layers) for name, dtype in columns])[0]
                   for step, layers, stats in db.execute("select step, layers, stats from samples")}
        ids = dict(db.execute("select path, id from layers"))
    assert [name for name, _ in columns] == ["sampled", *NAMES] and sorted(samples) == [1, 10, 20]
    s, row = samples[10], ids["layer1"] - 1  # row i: layer id i + 1
    assert s["sampled"].tolist() == [1, 1, 1]
    assert s["clip_low"].dtype == np.float16 and s["dy_norm"].dtype == np.float32
    assert float(s["clip_low"][row]) == float(np.float16(0.1 * ids["layer1"])) != 0.1 * ids["layer1"]  # float16
    assert s["dy_norm"][row] == 10.0 and np.isnan(s["scale_min"][row])  # NaN: no value


def test_read_back(tmp_path):
    path = tmp_path / "h"
    _write(path, [1, 10])
    h = read_history(path)
    assert h.steps == [1, 10] and [layer["path"] for layer in h.layers] == ["layer0", "layer1", "layer2"]
    assert h.layers[0]["info"] == {"quant_min": -128} and h.meta["every"] == "1"
    s = h.series("layer1")
    assert s["steps"] == [1, 10] and s["dy_norm"] == [1.0, 10.0] and s["clip_low"] == pytest.approx([0.2, 0.2], rel=2 ** -11)  # ids count from 1


def test_a_sample_of_no_layer(tmp_path):
    w = HistoryWriter(tmp_path / "h")
    w.add_sample(1, {})
    w.layer_id("q", "fake_quant", "weight", "M", {})
    w.add_sample(2, {1: {"dy_norm": 2.0}})
    w.close()
    h = read_history(tmp_path / "h")
    assert h.steps == [1, 2] and h.series("q")["steps"] == [2] and h.series("q")["dy_norm"] == [2.0]


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
        assert len(h.layers) == 100
        for layer in h.layers:  # whole samples only
            s = h.series(layer["path"])
            assert s["steps"] == h.steps and s["dy_norm"] == [step + layer["id"] for step in h.steps]


def test_precision_float32_and_float16_columns(tmp_path):
    """The float32 statistics read back as float32 rounds them; the float16 ones (shares, flags, SQNR) to
    nearest float16, except that nothing becomes 0, +-1 or infinite that was not (a share of 0.9999 is not all)."""
    import math

    import numpy as np

    from qgcli.monitor.history import HALF

    rng = random.Random(5)
    values = [0.0, 1.0, -1.0, 0.5, 0.99999, 1.00001, 2.0 ** 24 - 1, 1e-12, 1e-30, 1e-50, 1e6, 1e30, 1e40, math.inf,
              -math.inf]
    values += [rng.uniform(-1, 1) * 10 ** rng.uniform(-12, 20) for _ in range(300)]
    path = tmp_path / "h"
    w = HistoryWriter(path)
    lid = w.layer_id("q", "fake_quant", "activation", "M", {})
    for step, v in enumerate(values, start=1):
        w.add_sample(step, {lid: {"dy_norm": v, "dy_zero": v, "sqnr_db": v}})
    w.close()
    s = read_history(path).series("q")
    assert "dy_norm" not in HALF and {"dy_zero", "sqnr_db"} <= HALF
    for v, f32, f16, sqnr in zip(values, s["dy_norm"], s["dy_zero"], s["sqnr_db"]):
        assert f16 == sqnr
        if math.isinf(v) or v == 0:
            assert f32 == f16 == v
            continue
        assert f32 != 0 and f16 != 0 and math.isfinite(f32) and math.isfinite(f16)  # never 0, never infinite
        if 1.2e-38 < abs(v) < 3.4e38:
            assert f32 == float(np.float32(v))  # float32's rounding
        if 6.2e-5 < abs(v) < 65504:
            assert f16 == float(np.float16(v)) and abs(f16 - v) <= abs(v) * 2 ** -11 or v in (0.99999, 1.00001)
        elif abs(v) <= 6.1e-5:
            assert abs(f16 - v) <= 2 ** -25 or f16 == math.copysign(2 ** -24, v)  # subnormal, or the smallest
        else:
            assert f16 == math.copysign(65504, v)  # the largest finite float16
    assert s["dy_zero"][values.index(0.99999)] == 1 - 2 ** -11 and s["dy_zero"][values.index(1.00001)] == 1 + 2 ** -10


def test_history_grows_by_a_few_kib_per_sample_per_100_layers(tmp_path):
    """A ResNet-like mix of 100 layers (quantized weights per channel, activations per tensor, batch norms), every
    statistic random (no exact zeros or repeats, which real runs have: 3 KiB measured on ResNet-18's): at most
    3.5 KiB more file per sample, whatever the batch size (nothing depends on it).  Schema version 2: 7.6 KiB."""
    rng = random.Random(1)
    path = tmp_path / "h"
    w = HistoryWriter(path)
    roles = ["weight"] * 25 + ["activation"] * 50 + ["batch_norm"] * 25
    ids = [w.layer_id(f"l{i}", "fake_quant", role, "M", {}) for i, role in enumerate(roles)]

    def stats(role):
        u = rng.random
        out = {"dy_norm": u(), "dx_norm": u(), "dy_zero": 0.0, "nan_inputs": 0, "nan_grads": 0, "needs_grad": 1}
        if role == "batch_norm":
            return {**out, "bn_mean_shift": u(), "bn_var_ratio": u()}
        scale = u() / 100
        out.update(clip_low=u() / 100, clip_high=u() / 100, blocked=u() / 50, ste_error=0.0, sqnr_db=30 + 10 * u(),
                   fake_quant_enabled=1, observer_enabled=1)
        if role == "weight":
            return {**out, "scale_min": scale / 2, "scale_median": scale, "scale_max": 2 * scale, "zero_point_min": 0,
                    "zero_point_max": 0, "range_min": -256 * scale, "range_max": 254 * scale, "codes_changed": u(),
                    "oscillating": u() / 10, "oscillation_max": u() / 5}
        return {**out, "scale_min": scale, "scale_median": scale, "scale_max": scale, "zero_point_min": 64,
                "zero_point_max": 64, "range_min": -64 * scale, "range_max": 63 * scale}

    w.add_sample(1, {lid: stats(role) for lid, role in zip(ids, roles)})
    w._db.execute("PRAGMA wal_checkpoint")
    start = os.path.getsize(path)
    for step in range(2, 202):
        w.add_sample(step, {lid: stats(role) for lid, role in zip(ids, roles)})
    w._db.execute("PRAGMA wal_checkpoint")
    per_sample = (os.path.getsize(path) - start) / 200
    w.close()
    assert 1024 < per_sample <= 3.5 * 1024, per_sample


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
    with pytest.raises(FileFormatError, match="history schema version 9, this qgcli reads versions 1, 2, 3"):
        read_history(tmp_path / "v9")
    result = CliRunner().invoke(main, ["trend", str(tmp_path / "v9")])
    assert result.exit_code == 2 and "schema version 9" in result.output and "Traceback" not in result.output


GOLDEN_V2 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "history_v2.qgh")


def test_version_2_file_still_read_by_every_command(tmp_path):
    """tests/golden/history_v2.qgh was written by qgcli's HistoryWriter at schema version 2 (commit 1c7d627, before
    the compressed samples): history_samples' three layers over four samples and a layer ``odd`` with values out of
    version 2's integer codes (stored as REALs), then VACUUMed to 1 KiB pages.  It reads back to float32
    precision, and trend, doctor, plot trend and the HTML page run on it, leaving it untouched."""
    import hashlib
    import json
    import math

    import numpy as np
    from click.testing import CliRunner

    import history_samples
    from qgcli.cli import main

    before = hashlib.sha256(Path(GOLDEN_V2).read_bytes()).hexdigest()
    h = read_history(GOLDEN_V2)
    assert h.meta["version"] == "2" and h.steps == list(history_samples.STEPS)
    for path, _ in history_samples.LAYERS:
        s = h.series(path)
        for i, step in enumerate(h.steps):
            want = history_samples.stats(path, step)
            assert {n: s[n][i] for n in NAMES if s[n][i] is not None} == {
                n: float(np.float32(v)) for n, v in want.items()}
    odd = h.series("odd")
    assert odd["dy_norm"] == [1e-20 * step for step in h.steps]  # below the codes' range: the REAL itself
    assert odd["dx_norm"] == [math.inf] * 4 and odd["sqnr_db"] == [-math.inf] * 4 and odd["range_min"] == [-1e30] * 4
    assert odd["scale_min"] == odd["scale_max"] == [float(np.float32(0.1))] * 4 and odd["zero_point_max"] == [-3.0] * 4
    assert odd["blocked"] == [None] * 4
    runner = CliRunner()
    trend = runner.invoke(main, ["trend", GOLDEN_V2, "--json"])
    assert trend.exit_code == 0, trend.output
    events = {(e["step"], e["layer"], e["kind"]) for e in json.loads(trend.output)["events"]}
    assert {(20, "conv2.act", "blocked_jump"), (30, "fc.weight", "nan")} <= events
    doctor = runner.invoke(main, ["doctor", GOLDEN_V2, "--json"])
    assert doctor.exit_code == 0, doctor.output
    assert {(f["kind"], f["layer"], f["step"]) for f in json.loads(doctor.output)["findings"]} >= {
        ("nan", "fc.weight", 30)}
    for args in (["plot", "trend", GOLDEN_V2, "-o", str(tmp_path / "t.png")],
                 ["trend", GOLDEN_V2, "--html", str(tmp_path / "t.html")]):
        result = runner.invoke(main, args)
        assert result.exit_code == 0, result.output
    assert (tmp_path / "t.png").stat().st_size > 1000 and "conv2.act" in (tmp_path / "t.html").read_text()
    assert hashlib.sha256(Path(GOLDEN_V2).read_bytes()).hexdigest() == before
