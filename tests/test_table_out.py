"""--csv FILE and --parquet FILE on every command whose --json holds a table (qgcli.report.table_out): the
files, read back with csv and pyarrow (and pandas where installed), hold the --json document's rows."""
import csv
import io
import json
import os
import sys

import pytest

import history_samples
from test_verify import _write as write_verified_run

SAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, "samples")
RUN = os.path.join(SAMPLES, "run.h5")
PER_CHANNEL = os.path.join(SAMPLES, "per_channel.h5")


def flat(record, prefix=""):
    out = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tables")
    verified = str(d / "verified.h5")
    write_verified_run(verified)
    return {"run": RUN, "verified": verified, "a": history_samples.write(d / "a.qgh"),
            "b": history_samples.write(d / "b.qgh", worse=1.5)}


# command line (FILES keys in braces), the --json document's rows
CASES = {
    "report-run": (["report", "{run}"], lambda doc: doc["layers"]),
    "report-tensor": (["report", PER_CHANNEL], lambda doc: doc["rows"]),
    "report-history": (["report", "{a}"], None),
    "trend": (["trend", "{a}", "--step", "20"], None),
    "verify": (["verify", "{verified}"], lambda doc: doc["layers"]),
    "doctor": (["doctor", "{a}"], lambda doc: doc["findings"]),
    "diff": (["diff", "{a}", "{b}"], lambda doc: doc["rows"]),
    "inspect": (["inspect", "{run}", PER_CHANNEL],
                lambda doc: [{"file": f["file"], **t} for f in doc["files"] for t in f["tensors"]]),
}


def _history_rows(doc, step):
    from qgcli.report.history_table import KEYS, last_samples

    return [{k: r[k] for k in KEYS} for r in last_samples(doc, step)]


def _expected(name, args, doc):
    if CASES[name][1] is not None:
        rows = CASES[name][1](doc)
    else:
        rows = _history_rows(doc, 20 if "--step" in args else None)
    return [flat(r) for r in rows]


def _same_cell(text, value):
    if value is None:
        return text == ""
    if isinstance(value, bool):
        return text == str(value).lower()
    if isinstance(value, (int, float)):
        return float(text) == value
    if isinstance(value, list):
        return text == ("x".join(map(str, value)) if value and all(type(v) is int for v in value)
                        else json.dumps(value))
    return text == str(value)


@pytest.mark.parametrize("name", sorted(CASES))
def test_csv_and_parquet_hold_the_json_rows(name, files, tmp_path, cli):
    pq = pytest.importorskip("pyarrow.parquet")
    args = [a.format(**files) for a in CASES[name][0]]
    r = cli(*args, "--json")
    assert r.exit_code == 0, r.output
    rows = _expected(name, args, json.loads(r.stdout))
    assert rows, "each case has rows to compare"
    c, p = tmp_path / "t.csv", tmp_path / "t.parquet"
    r = cli(*args, "--csv", c, "--parquet", p)
    assert r.exit_code == 0, r.output
    assert r.stdout.strip(), "with FILEs the table (or text) is still printed"
    got = list(csv.DictReader(io.StringIO(c.read_text())))
    assert len(got) == len(rows)
    for text_row, want in zip(got, rows):
        assert set(want) <= set(text_row), set(want) - set(text_row)
        for k, v in want.items():
            assert _same_cell(text_row[k], v), (k, text_row[k], v)
    table = pq.read_table(p)
    assert table.num_rows == len(rows)
    for typed, want in zip(table.to_pylist(), rows):
        for k, v in want.items():
            if isinstance(v, list) and not all(isinstance(i, (int, float, str)) for i in v):
                assert json.loads(typed[k]) == v  # no common type: JSON text
            else:
                assert typed[k] == v, (k, typed[k], v)
    try:
        import pandas
    except ImportError:
        return
    assert len(pandas.read_parquet(p)) == len(pandas.read_csv(c)) == len(rows)


def test_csv_on_stdout_replaces_the_table(files, cli):
    for args in (["trend", files["a"], "--csv"], ["diff", files["a"], files["b"], "--csv", "-"],
                 ["report", PER_CHANNEL, "--csv"]):
        r = cli(*args)
        assert r.exit_code == 0, r.output
        rows = list(csv.DictReader(io.StringIO(r.stdout)))
        assert rows and list(rows[0])[0] in ("path", "channel"), r.stdout[:200]


def test_parquet_on_stdout(files, runner, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "qgcli", "trend", files["a"], "--parquet", "-"],
                          capture_output=True, check=True)
    assert pq.read_table(io.BytesIO(proc.stdout)).column("path").to_pylist()[0] == "conv2.act"


@pytest.mark.parametrize("args, message", [
    (["--json", "--csv", "-"], "--json and --csv both want stdout"),
    (["--csv", "-", "--parquet", "-"], "--csv and --parquet both want stdout"),
    (["--csv", "{exists}"], "exists; use --force"),
    (["--csv", "{input}"], "is also an input"),
    (["--csv", "{missing}/t.csv"], "does not exist"),
])
def test_refused_in_one_line_before_the_work(args, message, files, cli, tmp_path):
    exists = tmp_path / "old.csv"
    exists.write_text("old")
    for command in (["trend", files["a"]], ["diff", files["a"], files["b"]], ["inspect", files["run"]]):
        r = cli(*command, *[a.format(exists=exists, missing=tmp_path / "nowhere", input=command[1]) for a in args])
        assert r.exit_code == 2 and message in r.stderr, (command, r.output)
        assert "Traceback" not in r.output and r.stdout == ""
    assert exists.read_text() == "old" and not (tmp_path / "nowhere").exists()
    assert not (tmp_path / "t.parquet").exists()


def test_force_replaces(files, cli, tmp_path):
    out = tmp_path / "t.csv"
    out.write_text("old")
    r = cli("doctor", files["a"], "--csv", out, "--force")
    assert r.exit_code == 0, r.output
    assert out.read_text().startswith("kind,severity,layer,step,evidence,advice\n")


def test_parquet_without_pyarrow_is_refused_naming_the_extra(files, cli, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow raises ImportError, as where it is absent
    out = tmp_path / "t.parquet"
    r = cli("trend", files["a"], "--parquet", out, "--csv", tmp_path / "t.csv")
    assert r.exit_code == 2, r.output
    assert r.stderr.strip().splitlines() == ["Error: --parquet: needs pyarrow: pip install 'qgcli[parquet]'"]
    assert not out.exists() and not (tmp_path / "t.csv").exists()
