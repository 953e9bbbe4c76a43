"""``qgcli report`` and ``qgcli.ops.analysis.channel_report``: numbers checked against direct computation."""
import csv
import io
import json
import math
import os

import h5py
import numpy as np
import pytest

from qgcli import ops
from qgcli.ops.analysis import (
    DEFAULT_PERCENTILES,
    ROW_KEYS,
    TOTAL_KEYS,
    channel_report,
    clip_statistics,
    column_percentiles,
    sqnr_db,
)

from conftest import SAMPLES

NOTEBOOK = os.path.join(SAMPLES, "notebook.h5")
PER_CHANNEL = os.path.join(SAMPLES, "per_channel.h5")
f32 = np.float32

REPORT_KEYS = ["command", "schema", "qgcli_version", "op", "variant", "attributes", "inputs", "per_channel",
               "channels", "has_gradients", "percentiles", "threshold", "sort", "top", "total", "flagged", "rows",
               "verdict", "notes"]

# Two channels on a 2-bit grid whose nudged numbers are exact and easy to derive by hand:
#   [-1.5, 1.5]:   scale 3/3 = 1,   zero point round(0 + 1.5) = 2 -> nudged [-2, 1]
#   [-0.75, 0.75]: scale 1.5/3 = .5, zero point round(0 + 1.5) = 2 -> nudged [-1, 0.5]
X = np.array([[-3.0, -1.2], [-2.0, -0.3], [-0.4, 0.1], [0.3, 0.5], [1.0, 0.7], [2.5, 0.2]], f32)
G = np.array([[1.0, 2.0], [-2.0, 1.0], [3.0, -1.0], [0.5, 1.0], [-1.0, 3.0], [4.0, -0.5]], f32)
MIN, MAX = np.array([-1.5, -0.75], f32), np.array([1.5, 0.75], f32)
NUDGED_MIN, NUDGED_MAX, SCALE = np.array([-2.0, -1.0]), np.array([1.0, 0.5]), np.array([1.0, 0.5])


def direct(x, g, nmin, nmax, scale):
    """Every report number for one channel, straight from the definitions, in float64."""
    x, g = np.asarray(x, np.float64), np.asarray(g, np.float64)
    inside = (x >= nmin) & (x <= nmax)
    q = np.floor((np.clip(x, nmin, nmax) - nmin) / scale + 0.5) * scale + nmin  # no ties in the data above
    err = q - x
    return {
        "data_min": x.min(), "data_max": x.max(),
        "clipped_below": np.mean(x < nmin), "clipped_above": np.mean(x > nmax),
        "gradient_mass": np.abs(g).sum(),
        "gradient_blocked": np.sum(np.abs(g) * (1 - inside)) / np.sum(np.abs(g)),
        "backprop_wrt_min": g[x < nmin].sum(), "backprop_wrt_max": g[x > nmax].sum(),
        "mse": np.mean(err**2), "sqnr_db": 10 * np.log10(np.sum(x**2) / np.sum(err**2)),
    }


def test_hand_made_per_channel_numbers_match_direct_computation():
    r = channel_report(X, MIN, MAX, G, num_bits=2)
    assert r.variant == "per-channel" and r.channels == 2 and r.has_gradients
    for c in range(2):
        row = r.row(c)
        assert (row["nudged_min"], row["nudged_max"], row["scale"]) == (NUDGED_MIN[c], NUDGED_MAX[c], SCALE[c])
        assert row["zero_point"] == 2 and row["channel"] == c and row["elements"] == 6
        expect = direct(X[:, c], G[:, c], NUDGED_MIN[c], NUDGED_MAX[c], SCALE[c])
        for key, value in expect.items():
            assert row[key] == pytest.approx(value, rel=1e-6, abs=1e-12), (c, key)
        assert row["clipped"] == pytest.approx(row["clipped_below"] + row["clipped_above"])
    # By hand: channel 0 clips -3 below and 2.5 above; |g| blocked (1 + 4) of 11.5.
    assert r.row(0)["clipped_below"] == pytest.approx(1 / 6) and r.row(0)["clipped_above"] == pytest.approx(1 / 6)
    assert r.row(0)["gradient_blocked"] == pytest.approx(5 / 11.5)
    assert (r.row(0)["backprop_wrt_min"], r.row(0)["backprop_wrt_max"]) == (1.0, 4.0)
    # Channel 1 clips -1.2 below and 0.7 above: blocked (2 + 3) of 8.5.
    assert r.row(1)["gradient_blocked"] == pytest.approx(5 / 8.5)
    assert (r.row(1)["backprop_wrt_min"], r.row(1)["backprop_wrt_max"]) == (2.0, 3.0)
    # Whole-tensor numbers pool the channels.
    assert r.total["gradient_blocked"] == pytest.approx(10 / 20)
    assert r.total["clipped"] == pytest.approx(4 / 12)
    assert r.total["gradient_mass"] == pytest.approx(20.0)


def test_backprops_are_tensorflows_op_outputs():
    r = channel_report(X, MIN, MAX, G, num_bits=2)
    _, dmin, dmax = ops.fake_quant_with_min_max_vars_per_channel_gradient(G, X, MIN, MAX, num_bits=2)
    assert r.columns["backprop_wrt_min"].tolist() == dmin.astype(np.float64).tolist()
    assert r.columns["backprop_wrt_max"].tolist() == dmax.astype(np.float64).tolist()


def test_forward_error_uses_tensorflows_forward():
    r = channel_report(X, MIN, MAX, G, num_bits=2)
    q = ops.fake_quant_with_min_max_vars_per_channel(X, MIN, MAX, num_bits=2).astype(np.float64)
    err = ((q - X) ** 2).sum(axis=0)
    assert r.columns["mse"] == pytest.approx(err / 6, rel=1e-12)
    assert r.columns["sqnr_db"] == pytest.approx(10 * np.log10((X.astype(np.float64) ** 2).sum(axis=0) / err))


def test_suggested_range_is_the_best_sqnr_percentile_candidate():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((400, 3)) * [1.0, 2.0, 0.5] + [0.0, 1.0, -0.2]).astype(f32)
    x[0, 0] = 9.0  # an outlier: a clipped range should beat the full range at 4 bits
    mn, mx = np.array([-1, -1, -1], f32), np.array([1, 1, 1], f32)
    r = channel_report(x, mn, mx, num_bits=4)
    signal = (x.astype(np.float64) ** 2).sum(axis=0)
    best = np.full(3, -np.inf)
    picked = [None] * 3
    # The candidates are NumPy's 'linear' percentiles of the float32 data, interpolated in float64 as qgcli does.
    # Not np.percentile(x) on the float32 array: NumPy 2.x before 2.4 (2.2 is the newest on Python 3.10) computes
    # q / 100 and the interpolation index in the input's float32, which moves P(99.9) of column 0 by 7.5e-5.
    x64 = x.astype(np.float64)
    for p in DEFAULT_PERCENTILES:
        lo = np.minimum(np.percentile(x64, 100 - p, axis=0), 0).astype(f32)
        hi = np.maximum(np.percentile(x64, p, axis=0), 0).astype(f32)
        q = ops.fake_quant_with_min_max_vars_per_channel(x, lo, hi, num_bits=4).astype(np.float64)
        db = 10 * np.log10(signal / ((q - x) ** 2).sum(axis=0))
        for c in range(3):
            if db[c] > best[c] + 1e-9:
                best[c], picked[c] = db[c], (p, lo[c], hi[c])
    for c in range(3):
        row = r.row(c)
        assert row["suggested_percentile"] == picked[c][0]
        # NumPy owns the last float64 digit of its interpolation (the order of its lerp's operations), and that digit
        # can round the float32 bound either way: one float32 ulp, no more.
        for key, want in (("suggested_min", picked[c][1]), ("suggested_max", picked[c][2])):
            assert abs(f32(row[key]) - want) <= np.spacing(abs(want)), (key, row[key], want)
        assert row["suggested_sqnr_db"] == pytest.approx(best[c], rel=1e-6)
    assert r.row(0)["suggested_percentile"] < 100  # the outlier is clipped away
    assert r.row(0)["suggested_sqnr_db"] > r.row(0)["sqnr_db"]
    assert r.row(0)["gradient_blocked"] is None and r.total["gradient_blocked"] is None


def test_blocked_mass_agrees_with_the_fakequant_summary():
    with h5py.File(PER_CHANNEL, "r") as f:
        x, g, mn, mx = (f[k][()] for k in ("inputs", "gradients", "min", "max"))
    r = channel_report(x, mn, mx, g)
    stats = clip_statistics(x, ops.nudge(mn, mx), g)
    assert r.columns["gradient_blocked"].tolist() == pytest.approx(stats["channel_gradient_blocked"], rel=1e-12)
    assert r.total["gradient_blocked"] == pytest.approx(stats["gradient_blocked"], rel=1e-12)
    assert r.total["clipped_below"] == pytest.approx(stats["clipped_below"])
    # The sample's three badly calibrated channels come first.
    assert set(r.order("worst")[:3]) == {3, 7, 12}


def test_per_tensor_notebook_against_direct_computation():
    with h5py.File(NOTEBOOK, "r") as f:
        x, g, mn, mx = (f[k][()] for k in ("inputs", "gradients", "min", "max"))
    r = channel_report(x, mn, mx, g, num_bits=2)
    assert r.variant == "vars" and r.channels == 1
    row = r.row(0)
    assert row["channel"] is None and (row["nudged_min"], row["nudged_max"], row["scale"]) == (-8.0, 4.0, 4.0)
    expect = direct(x.ravel(), g.ravel(), -8.0, 4.0, 4.0)
    for key, value in expect.items():
        assert row[key] == pytest.approx(value, rel=1e-6), key
    for key in ("clipped_below", "gradient_blocked", "mse", "sqnr_db"):
        assert r.total[key] == pytest.approx(row[key])


def test_args_variant_has_no_range_gradients():
    r = channel_report(X[:, 0], -1.5, 1.5, G[:, 0], num_bits=2, variant="args")
    assert r.variant == "args"
    assert r.row(0)["backprop_wrt_min"] is None and r.row(0)["backprop_wrt_max"] is None
    assert r.row(0)["gradient_blocked"] == pytest.approx(5 / 11.5)


def test_non_finite_values_are_counted_and_left_out_of_the_error():
    x = X.copy()
    x[0, 0], x[1, 1] = np.nan, np.inf
    r = channel_report(x, MIN, MAX, G, num_bits=2)
    assert r.columns["nonfinite"].tolist() == [1, 1]
    for c, keep in ((0, slice(1, None)), (1, [0, 2, 3, 4, 5])):
        e = direct(x[keep, c], G[keep, c], NUDGED_MIN[c], NUDGED_MAX[c], SCALE[c])
        assert r.row(c)["mse"] == pytest.approx(e["mse"], rel=1e-6)
        assert r.row(c)["sqnr_db"] == pytest.approx(e["sqnr_db"], rel=1e-6)
        assert r.row(c)["data_min"] == e["data_min"] and r.row(c)["data_max"] == e["data_max"]
    # NaN is neither clipped nor inside the range: its gradient is blocked, as TensorFlow's mask does.
    assert r.row(0)["clipped_below"] == pytest.approx(0.0)
    assert r.row(0)["gradient_blocked"] == pytest.approx((1 + 4) / 11.5)
    # +inf clips above, and is blocked too.
    assert r.row(1)["clipped_above"] == pytest.approx(2 / 6)


def test_zero_gradient_and_constant_channel():
    x = np.zeros((5, 2), f32)
    x[:, 1] = [0.1, 0.2, -0.3, 0.0, 0.4]
    r = channel_report(x, [-1, -1], [1, 1], np.zeros_like(x))
    assert r.row(0)["gradient_blocked"] == 0.0 and r.total["gradient_mass"] == 0.0
    assert r.row(0)["mse"] == 0.0 and r.row(0)["sqnr_db"] is None  # exact: infinite SQNR
    assert r.columns["sqnr_db"][0] == np.inf
    assert (r.row(0)["suggested_min"], r.row(0)["suggested_max"]) == (0.0, 0.0)


def test_column_percentiles_match_numpy():
    rng = np.random.default_rng(11)
    a = rng.standard_normal((37, 5)).astype(f32)
    a[rng.random(a.shape) < 0.2] = np.nan
    a[:, 4] = np.nan
    counts = np.isfinite(a).sum(axis=0)
    s = np.sort(a, axis=0)
    for q in (0.0, 0.01, 1.0, 12.5, 50.0, 99.0, 99.99, 100.0):
        got = column_percentiles(s, counts, q)
        for c in range(4):
            col = a[np.isfinite(a[:, c]), c].astype(np.float64)
            assert got[c] == pytest.approx(np.percentile(col, q), rel=1e-12, abs=1e-15)
        assert math.isnan(got[4])


def test_sqnr_edge_cases():
    assert sqnr_db(100.0, 1.0) == pytest.approx(20.0)
    assert sqnr_db(1.0, 0.0) == np.inf and sqnr_db(0.0, 0.0) == np.inf
    assert sqnr_db(0.0, 1.0) == -np.inf
    assert np.isnan(sqnr_db(np.nan, 1.0))


def test_order_keys():
    r = channel_report(X, MIN, MAX, G, num_bits=2)
    assert r.order("channel") == [0, 1]
    assert r.order("worst") == [1, 0]  # 5/8.5 blocked beats 5/11.5
    assert r.order("sqnr")[0] == int(np.argmin(r.columns["sqnr_db"]))
    with pytest.raises(ValueError, match="sort"):
        r.order("nope")


def _order_one_key_per_channel(r, by):
    """ChannelReport.order as it was written first: a Python sort key per channel (the reference)."""
    col = r.columns

    def down(v):
        return -v if np.isfinite(v) or v == np.inf else np.inf

    def up(v):
        return v if not np.isnan(v) else np.inf

    keys = {"worst": lambda c: (down(col["gradient_blocked"][c] if r.has_gradients else col["clipped"][c]),
                                up(col["sqnr_db"][c]), c),
            "blocked": lambda c: (down(col["gradient_blocked"][c]), c),
            "clipped": lambda c: (down(col["clipped"][c]), c),
            "sqnr": lambda c: (up(col["sqnr_db"][c]), c),
            "gain": lambda c: (down(col["suggested_sqnr_db"][c] - col["sqnr_db"][c]), c),
            "channel": lambda c: (c,)}
    with np.errstate(invalid="ignore"):
        return sorted(range(r.channels), key=keys[by])


@pytest.mark.parametrize("has_gradients", [True, False])
def test_order_is_the_per_channel_sort_on_nan_infinities_signed_zeros_and_ties(has_gradients):
    """The vectorised order gives what a Python key per channel gives, on columns drawn from few values
    (ties everywhere) with NaN, both infinities and both zeros."""
    import dataclasses

    r = channel_report(X, MIN, MAX, G, num_bits=2)
    rng = np.random.default_rng(7)
    pool = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 0.25, 0.5, 0.5, -3.0, 41.0])
    for _ in range(200):
        n = int(rng.integers(0, 40))
        cols = {k: rng.choice(pool, n) for k in r.columns}
        cols["channel"] = np.arange(n, dtype=np.float64)
        drawn = dataclasses.replace(r, columns=cols, has_gradients=has_gradients)
        for by in ("worst", "blocked", "clipped", "sqnr", "gain", "channel"):
            got = drawn.order(by)
            assert got == _order_one_key_per_channel(drawn, by), (by, cols)
            assert all(type(c) is int for c in got)


def test_report_on_the_array_module(xp, monkeypatch):
    """CuPy against NumPy.  On NumPy (no GPU) the NumPy kernels (``QGCLI_NATIVE=0``) against the compiled ones:
    not the same run twice."""
    from qgcli.ops import native

    monkeypatch.delenv("QGCLI_NATIVE", raising=False)
    if xp is np and native.library() is None:
        pytest.skip("the compiled kernels are not built here: the NumPy run would be compared with itself")
    with h5py.File(PER_CHANNEL, "r") as f:
        x, g, mn, mx = (f[k][()] for k in ("inputs", "gradients", "min", "max"))
    ref = channel_report(x, mn, mx, g)
    if xp is np:
        monkeypatch.setenv("QGCLI_NATIVE", "0")
    got = channel_report(xp.asarray(x), mn, mx, xp.asarray(g))
    for key in ROW_KEYS:
        np.testing.assert_allclose(got.columns[key], ref.columns[key], rtol=1e-9, err_msg=key)


# --- the CLI -----------------------------------------------------------------------------------------

def run_json(cli, *args):
    r = cli("report", *args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_cli_json_schema_and_numbers(cli):
    doc = run_json(cli, PER_CHANNEL)
    assert list(doc) == REPORT_KEYS
    assert doc["command"] == "report" and doc["op"] == "FakeQuantWithMinMaxVarsPerChannel"
    assert doc["channels"] == 16 and doc["per_channel"] and doc["has_gradients"] and doc["top"] is None
    assert list(doc["total"]) == list(TOTAL_KEYS)
    assert len(doc["rows"]) == 16 and all(list(row) == list(ROW_KEYS) + ["flagged"] for row in doc["rows"])
    assert doc["inputs"]["inputs"]["source"] == f"{PER_CHANNEL}:inputs"
    assert doc["flagged"][:3] and set(doc["flagged"]) == {3, 7, 12}
    assert [row["channel"] for row in doc["rows"][:3]] == doc["flagged"]
    assert doc["verdict"].startswith("Verdict: 3 of 16 channels lose more than 5%")
    with h5py.File(PER_CHANNEL, "r") as f:
        x, g, mn, mx = (f[k][()] for k in ("inputs", "gradients", "min", "max"))
    r = channel_report(x, mn, mx, g)
    for row in doc["rows"]:
        c = row["channel"]
        assert row["gradient_blocked"] == r.columns["gradient_blocked"][c]
        assert row["flagged"] == (row["gradient_blocked"] > 0.05)
    blocked = doc["rows"][0]
    grid = ops.nudge(mn, mx)
    c = blocked["channel"]
    e = direct(x[..., c].ravel(), g[..., c].ravel(), float(grid.nudged_min[c]), float(grid.nudged_max[c]),
               float(grid.scale[c]))
    assert blocked["gradient_blocked"] == pytest.approx(e["gradient_blocked"], rel=1e-9)


def test_cli_top_sort_threshold_and_percentiles(cli):
    doc = run_json(cli, PER_CHANNEL, "--top", "2", "--sort", "channel", "--threshold", "0.5",
                   "--percentiles", "100,99")
    assert [row["channel"] for row in doc["rows"]] == [0, 1] and doc["top"] == 2
    assert doc["percentiles"] == [100.0, 99.0] and doc["threshold"] == 0.5
    assert set(doc["flagged"]) == {3, 7, 12}  # all three lose more than half their gradient mass
    assert all(row["suggested_percentile"] in (100.0, 99.0) for row in doc["rows"])


def test_cli_csv_matches_json(cli):
    doc = run_json(cli, PER_CHANNEL)
    r = cli("report", PER_CHANNEL, "--csv")
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(io.StringIO(r.stdout)))
    assert list(rows[0]) == list(ROW_KEYS) + ["flagged"] and len(rows) == 16
    for got, want in zip(rows, doc["rows"]):
        assert int(got["channel"]) == want["channel"]
        assert float(got["sqnr_db"]) == want["sqnr_db"] and float(got["gradient_blocked"]) == want["gradient_blocked"]
        assert got["flagged"] == str(want["flagged"]).lower()
    assert "Verdict:" in r.stderr and "Verdict" not in r.stdout


def test_cli_table_and_verdict(cli):
    r = cli("report", PER_CHANNEL)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert "FakeQuantWithMinMaxVarsPerChannel" in lines[0]
    assert lines[-1].startswith("Verdict: 3 of 16 channels") and "ch 3 59.0%" in lines[-1]
    first = lines[2].split()  # header, then the worst channel
    assert first[0] in ("3", "7", "12") and "\x1b" not in r.stdout


def test_cli_per_tensor_without_gradients_and_options(cli, tmp_path):
    x = tmp_path / "x.npy"
    np.save(x, X[:, 0].astype(np.float64))
    doc = run_json(cli, "--inputs", x, "--min", "-1.5", "--max", "1.5", "--num-bits", "2")
    assert doc["variant"] == "vars" and not doc["has_gradients"] and doc["flagged"] == [None]
    row = doc["rows"][0]
    assert row["channel"] is None and row["gradient_blocked"] is None and row["backprop_wrt_min"] is None
    assert row["clipped"] == pytest.approx(2 / 6)
    assert doc["notes"] == ["inputs is float64; computed in float32 as TensorFlow does"]
    assert "clips 33.3%" in doc["verdict"]


def test_cli_nan_input_gives_valid_json(cli, tmp_path):
    path = tmp_path / "b.npz"
    x = X.copy()
    x[:, 1] = np.nan
    np.savez(path, inputs=x, gradients=G, min=MIN, max=MAX)
    r = cli("report", path, "--json", "--num-bits", "2")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    row = [row for row in doc["rows"] if row["channel"] == 1][0]
    assert row["data_min"] is None and row["mse"] is None and row["nonfinite"] == 6
    assert row["gradient_blocked"] == 1.0


def test_cli_reads_the_bundle_from_stdin(cli):
    buf = io.BytesIO()
    np.savez(buf, inputs=X, gradients=G, min=MIN, max=MAX)
    r = cli("report", "-", "--json", "--num-bits", "2", input=buf.getvalue())
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["total"]["gradient_blocked"] == pytest.approx(0.5)


@pytest.mark.parametrize("args, message", [
    (["--json", "--csv"], "--json and --csv both want stdout"),
    (["--top", "0"], "--top"),
    (["--percentiles", "100,40"], "40 is not between 50 and 100"),
    (["--percentiles", "abc"], "comma-separated numbers"),
    (["--min", "-1,-2"], "min: has 2 entries but inputs have 16 channels"),
    (["--axis", "0", "--variant", "vars", "--min", "-1", "--max", "1"], "--axis"),
    (["--threshold", "2"], "--threshold"),
])
def test_cli_errors_are_one_line_exit_2(cli, args, message):
    r = cli("report", PER_CHANNEL, *args)
    assert r.exit_code == 2, r.output
    assert r.stdout == ""
    assert message in r.stderr and "Traceback" not in r.stderr


def test_cli_missing_operand(cli, tmp_path):
    path = tmp_path / "b.npz"
    np.savez(path, inputs=X)
    r = cli("report", path)
    assert r.exit_code == 2 and "min: missing operand" in r.stderr


def test_cli_ok_verdicts(cli):
    doc = run_json(cli, NOTEBOOK, "--threshold", "0.3")
    assert doc["flagged"] == [] and doc["rows"][0]["flagged"] is False
    assert doc["verdict"].startswith("Verdict: OK, the tensor loses 13.1% of its gradient mass, not more than 30%")
    doc = run_json(cli, PER_CHANNEL, "--threshold", "0.9")
    assert doc["flagged"] == []
    assert doc["verdict"].startswith("Verdict: OK, no channel loses more than 90% of its gradient mass (worst: ch 3,")


def test_report_reads_each_dataset_of_a_group_once(tmp_path, cli, monkeypatch):
    """The row, the analysis and the range loader share one read of each dataset (handed out read-only), and
    the rows are those of a read per request."""
    from qgcli.report import layers
    from qgcli.storage import operands

    path = tmp_path / "run.h5"
    rng = np.random.default_rng(1)
    with h5py.File(path, "w") as f:
        for i, op in enumerate(("FakeQuantWithMinMaxVarsPerChannel", "FakeQuantWithMinMaxVars")):
            g = f.create_group(f"l{i}")
            g.attrs["op"] = op
            g["inputs"] = rng.standard_normal((6, 3)).astype(np.float32) * 2
            shape = (3,) if i == 0 else ()
            g["min"], g["max"] = np.full(shape, -1.5, np.float32), np.full(shape, 1.25, np.float32)
            g["gradients"] = rng.standard_normal((6, 3)).astype(np.float32)
    reads = []
    real = operands.GroupView.read
    monkeypatch.setattr(operands.GroupView, "read", lambda self, name: reads.append((self._group, name)) or
                        real(self, name))
    once = cli("report", path, "--json")
    assert once.exit_code == 0, once.output
    assert sorted(reads) == sorted({(g, n) for g in ("l0", "l1") for n in ("inputs", "min", "max", "gradients")})
    monkeypatch.setattr(layers, "_ReadOnce", lambda operands: operands)  # each request read again
    again = cli("report", path, "--json")
    assert json.loads(once.stdout)["layers"] == json.loads(again.stdout)["layers"]
    assert len(reads) == 8 + 12
