"""QuantizeAndDequantizeV2/V3/V4 beyond the op (issue 17): ``qgcli nudge --variant quantize-and-dequantize-v*``,
``plot staircase|ste``, ``fakequant-grad --plot``, ``report`` and every ``--estimator`` on this grid.

The op itself is pinned bit for bit against TensorFlow 2.21 in test_qdq.py; here the numbers each view shows
are checked against the op (and against the golden file for the issue's example).
"""
import json
import os

import h5py
import numpy as np
import pytest

from qgcli.ops import estimators as est
from qgcli.ops import quantize_and_dequantize as qdq

F32 = np.float32
GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "qdq.h5")
V4 = ("--variant", "quantize-and-dequantize-v4")


def bits(a):
    return np.ascontiguousarray(np.asarray(a, F32)).view(np.uint32)


def _json(r):
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _issue_case():
    with h5py.File(GOLDEN, "r") as f:
        g = f["case_0000"]
        assert g.attrs["description"].startswith("issue example")
        return {k: g[k][()] for k in g}


# --- nudge ----------------------------------------------------------------------------------------------

def test_nudge_issue_example_text_and_json(cli):
    r = cli("nudge", *V4, "--min", "-2", "--max", "2.5", "--num-bits", "4")
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    assert "decided by input_max" in text and "grid [-2.857143, 2.5]" in text
    assert "warning: outputs can fall outside [-2, 2.5]" in " ".join(r.stderr.split())  # a note: stderr (issue 15)
    doc = _json(cli("nudge", *V4, "--min", "-2", "--max", "2.5", "--num-bits", "4", "--json"))
    g = doc["grid"]
    assert (doc["op"], doc["quant_min"], doc["quant_max"], g["decided_by"]) == ("QuantizeAndDequantizeV4", -8, 7,
                                                                               "input_max")
    assert F32(g["step"]) == F32(2.5) / F32(7) and F32(g["scale"]) == F32(7) / F32(2.5)
    # the grid's lower end is what TensorFlow returned for -3 (golden case)
    case = _issue_case()
    assert case["input"][0] == -3 and bits(g["lo"]) == bits(case["output"][0])
    assert [w["kind"] for w in doc["warnings"]] == ["outside-range"]


def test_nudge_per_slice_unsigned_and_written_grid(cli, tmp_path):
    doc = _json(cli("nudge", "--variant", "quantize-and-dequantize-v3", "--min", "-1,0.5,0,2", "--max", "1,3,3,1",
                    "--no-signed-input", "--num-bits", "3", "--json"))
    assert doc["per_channel"] and doc["quant_min"] == 0 and doc["quant_max"] == 7
    assert doc["grid"]["lo"] == [0.0, 0.0, 0.0, 0.0]
    kinds = {(w["channel"], w["kind"]) for w in doc["warnings"]}
    assert kinds == {(0, "zero-not-in-range"), (1, "outside-range"), (3, "reversed")}  # slice 2: [0, 3] exact
    r = cli("nudge", *V4, "--min", "-3", "--max", "2", "--num-bits", "4", "-o", tmp_path / "g.npz")
    assert r.exit_code == 0, r.output
    grid = qdq.quantization_grid(F32(-3), F32(2), num_bits=4)
    with np.load(tmp_path / "g.npz") as f:
        assert set(f) == {"scale", "step", "lo", "hi", "decided_by_min"}
        assert bits(f["hi"]) == bits(grid.hi) and f["decided_by_min"] == 1 and f["lo"] == -3


@pytest.mark.parametrize("args, words", [
    (["--min", "-1", "--max", "1", "--signed-input"], "only applies to --variant quantize-and-dequantize"),
    ([*V4, "--min", "-1", "--max", "1", "--num-bits", "62"], "1..61"),
    ([*V4, "--min", "nan", "--max", "1"], "NaN"),
    ([*V4, "--min", "-1,-1", "--max", "1"], "differs"),
    ([*V4, "--max", "1"], "give --min"),
])
def test_nudge_refusals(cli, args, words):
    r = cli("nudge", *args)
    assert r.exit_code == 2, r.output
    assert words in r.output and "Traceback" not in r.output


# --- plots ----------------------------------------------------------------------------------------------

def _lines(fig, gid):
    return [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_gid() == gid]


def test_plot_functions_draw_the_op():
    from qgcli.report import plots

    x = np.linspace(-4, 4, 81, dtype=F32)
    g = np.linspace(1, 2, 81, dtype=F32)
    attrs = dict(signed_input=True, range_given=True, round_mode="HALF_UP")
    fig = plots.ste(x, -2.0, 2.5, gradients=g, num_bits=4, variant="quantize-and-dequantize-v4", quantize=attrs)
    out = qdq.quantize_and_dequantize_v4(x, -2.0, 2.5, num_bits=4, range_given=True, round_mode="HALF_UP")
    mask = qdq.quantize_and_dequantize_v4_grad(np.ones_like(x), x, -2.0, 2.5)[0]
    order = np.argsort(x, kind="stable")
    assert bits(_lines(fig, "outputs")[0].get_ydata()).tolist() == bits(out[order]).tolist()
    assert _lines(fig, "mask")[0].get_ydata().tolist() == mask[order].tolist()
    assert bits(_lines(fig, "backprops")[0].get_ydata()).tolist() == bits((g * mask)[order]).tolist()
    s = fig.qgcli_summary
    assert s["op"] == "QuantizeAndDequantizeV4" and s["grid"]["decided_by"] == "input_max"
    assert [ln.get_xdata()[0] for ln in _lines(fig, "nudged_bound")] == [F32(-8) * (F32(2.5) / F32(7)), F32(2.5)]
    assert len(_lines(fig, "level")) == 16
    # V2: TensorFlow's pass-through gradient; per slice with --channel
    x2 = np.linspace(-3, 3, 24, dtype=F32).reshape(4, 6)
    fig = plots.ste(x2, np.full(6, -1, F32), np.full(6, 2, F32), num_bits=3, variant="quantize-and-dequantize-v3",
                    axis=1, channel=4, quantize=dict(signed_input=False, range_given=True, round_mode="HALF_TO_EVEN"))
    assert set(_lines(fig, "mask")[0].get_ydata().tolist()) == {1.0}
    col = qdq.quantize_and_dequantize_v3(x2, np.full(6, -1, F32), np.full(6, 2, F32), 3, signed_input=False,
                                         axis=1)[:, 4]
    assert sorted(_lines(fig, "outputs")[0].get_ydata().tolist()) == sorted(col.tolist())
    assert fig.qgcli_summary["channel"] == 4 and fig.qgcli_summary["grid"]["lo"] == 0.0


def test_cli_plot_staircase_ste_and_fakequant_grad_plot(cli, tmp_path):
    np.save(tmp_path / "x.npy", np.linspace(-4, 4, 41, dtype=F32))
    np.save(tmp_path / "g.npy", np.ones(41, F32))
    x = ("--inputs", tmp_path / "x.npy")
    doc = _json(cli("plot", "staircase", *x, "--min", "-2", "--max", "2.5", "--num-bits", "4", *V4, "--range-given",
                    "-o", tmp_path / "s.png", "--json"))
    assert doc["op"] == "QuantizeAndDequantizeV4" and doc["grid"]["range_given"] and doc["grid"]["hi"] == 2.5
    doc = _json(cli("plot", "ste", *x, "--gradients", tmp_path / "g.npy", "--num-bits", "4", "--variant",
                    "quantize-and-dequantize-v2", "--round-mode", "HALF_UP", "-o", tmp_path / "t.svg", "--json"))
    assert doc["backprops"] and doc["grid"]["min"] == -4 and doc["grid"]["round_mode"] == "HALF_UP"
    assert (tmp_path / "t.svg").stat().st_size > 0
    r = cli("fakequant-grad", *V4, *x, "--gradients", tmp_path / "g.npy", "--input-min", "-2", "--input-max", "2.5",
            "--range-given", "-o", tmp_path / "o.npz", "--plot", tmp_path / "f.png", "-q")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, words", [
    (["plot", "ste", *V4, "--num-bits", "4"], "needs the range"),
    (["plot", "staircase", "--min", "-1", "--max", "1", "--range-given"], "only applies to --variant"),
    (["plot", "staircase", "--variant", "quantize-and-dequantize-v3", "--min", "-1", "--max", "1", "--round-mode",
      "HALF_UP"], "HALF_TO_EVEN only"),
    (["plot", "staircase", *V4, "--min", "-1", "--max", "1", "--dtype", "qint8"], "QuantizeV2's"),
    (["fakequant-grad", *V4, "--gradients", "{x}", "--input-min", "-1", "--input-max", "1", "--estimator",
      "scaled:0.9", "--plot", "{d}/p.png"], "no figure for --estimator scaled:0.9"),
])
def test_cli_plot_refusals(cli, tmp_path, args, words):
    np.save(tmp_path / "x.npy", np.linspace(-4, 4, 9, dtype=F32))
    args = [str(a).format(x=tmp_path / "x.npy", d=tmp_path) for a in args]
    if args[0] == "plot":
        args += ["--inputs", str(tmp_path / "x.npy"), "-o", str(tmp_path / "p.png")]
    else:
        args += ["--input", str(tmp_path / "x.npy"), "-o", str(tmp_path / "o.npz")]
    r = cli(*args)
    assert r.exit_code == 2, r.output
    assert words in r.output and "Traceback" not in r.output


# --- report ---------------------------------------------------------------------------------------------

def test_report_on_the_issue_example(cli, tmp_path):
    x = np.linspace(-4, 4, 101, dtype=F32)
    g = np.linspace(1, 2, 101, dtype=F32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "g.npy", g)
    doc = _json(cli("report", "--inputs", tmp_path / "x.npy", "--gradients", tmp_path / "g.npy", "--min", "-2",
                    "--max", "2.5", "--num-bits", "4", *V4, "--range-given", "--json", "-q"))
    assert doc["op"] == "QuantizeAndDequantizeV4" and doc["attributes"]["range_given"] is True
    row = doc["rows"][0]
    grid = qdq.quantization_grid(F32(-2), F32(2.5), num_bits=4)
    assert bits(row["nudged_min"]) == bits(grid.lo) and row["nudged_max"] == 2.5
    assert row["clipped_below"] == np.count_nonzero(x < grid.lo) / x.size
    assert row["clipped_above"] == np.count_nonzero(x > F32(2.5)) / x.size  # the grid ends at input_max
    mask = qdq.quantize_and_dequantize_v4_grad(np.ones_like(x), x, -2.0, 2.5)[0]
    blocked = float(np.abs(g.astype(np.float64))[mask == 0].sum() / np.abs(g.astype(np.float64)).sum())
    assert row["gradient_blocked"] == pytest.approx(blocked, rel=1e-12)
    assert row["backprop_wrt_min"] == row["backprop_wrt_max"] == 0.0
    out = qdq.quantize_and_dequantize_v4(x, -2.0, 2.5, num_bits=4, range_given=True).astype(np.float64)
    assert row["mse"] == pytest.approx(float(((out - x) ** 2).mean()), rel=1e-12)


def test_report_per_slice_v2_v3_and_refusals(cli, tmp_path):
    x = np.linspace(-3, 3, 60, dtype=F32).reshape(5, 12).T.copy()  # [12, 5], slices along axis 1
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "g.npy", np.ones_like(x))
    base = ("report", "--inputs", tmp_path / "x.npy", "--gradients", tmp_path / "g.npy", "--json", "-q")
    doc = _json(cli(*base, "--variant", "quantize-and-dequantize-v3", "--axis", "1", "--min", "-1,-1,-2,-2,-3",
                    "--max", "1,2,2,3,3", "--num-bits", "3"))
    assert doc["per_channel"] and doc["channels"] == 5
    assert all(r["gradient_blocked"] == 0.0 for r in doc["rows"])  # V3's pass-through gradient
    assert any("pass-through" in n for n in doc["notes"])
    doc = _json(cli(*base, "--variant", "quantize-and-dequantize-v2", "--num-bits", "5"))  # range from the data
    assert doc["rows"][0]["min"] == -3 and doc["rows"][0]["clipped"] == 0.0
    r = cli(*base, "--min", "-1", "--max", "1", "--range-given")
    assert r.exit_code == 2 and "only applies to --variant quantize-and-dequantize" in r.output
    r = cli(*base, *V4, "--num-bits", "4")
    assert r.exit_code == 2 and "needs the range" in r.output


# --- estimators on this grid ------------------------------------------------------------------------------

def _grad(cli, tmp_path, x, g, lo, hi, estimator, *extra):
    np.save(tmp_path / "x.npy", np.asarray(x, F32))
    np.save(tmp_path / "g.npy", np.asarray(g, F32))
    out = tmp_path / f"o_{estimator.replace(':', '_').replace(',', '_')}.npz"
    r = cli("fakequant-grad", *V4, "--input", tmp_path / "x.npy", "--gradients", tmp_path / "g.npy",
            "--input-min", lo, "--input-max", hi, "-o", out, "--force", "-q", "--estimator", estimator, *extra)
    if r.exit_code != 0:
        return r, None
    with np.load(out) as f:
        return r, {k: f[k] for k in f}


X = np.array([-3.0, -2.5, -2.0, -0.3, 0.0, 0.2, 1.1, 2.5, 2.6, np.nan], F32)
G = np.array([1.0, 2.0, -1.0, 0.5, 3.0, -2.0, 1.5, 1.0, 4.0, 1.0], F32)


def test_mask_estimators_follow_v4grad(cli, tmp_path):
    mask = qdq.quantize_and_dequantize_v4_grad(np.ones_like(X), X, -2.0, 2.5)[0]
    tf_grad = qdq.quantize_and_dequantize_v4_grad(G, X, -2.0, 2.5)[0]
    _, o = _grad(cli, tmp_path, X, G, "-2", "2.5", "ste", "--range-given", "--num-bits", "4")
    assert set(o) == {"input_backprop", "input_min_backprop", "input_max_backprop"}
    assert bits(o["input_backprop"]).tolist() == bits(tf_grad).tolist()
    _, o = _grad(cli, tmp_path, X, G, "-2", "2.5", "identity", "--range-given", "--num-bits", "4")
    assert bits(o["backprops_wrt_input"]).tolist() == bits(G).tolist()
    _, o = _grad(cli, tmp_path, X, G, "-2", "2.5", "scaled:0.9", "--range-given", "--num-bits", "4")
    assert bits(o["backprops_wrt_input"]).tolist() == bits(G * F32(0.9)).tolist()  # the leak defaults to the gain
    _, o = _grad(cli, tmp_path, X, G, "-2", "2.5", "scaled:0.5,0.25", "--range-given", "--num-bits", "4")
    assert o["backprops_wrt_input"].tolist() == (G * np.where(mask == 1, F32(0.5), F32(0.25))).tolist()
    # EWGS: delta 0 is the STE; delta 1 scales by the rounding error over the given range's width
    _, o = _grad(cli, tmp_path, X, G, "-2", "2.5", "ewgs:0", "--range-given", "--num-bits", "4")
    assert bits(o["backprops_wrt_input"]).tolist() == bits(tf_grad).tolist()
    _, o = _grad(cli, tmp_path, X, G, "-2", "2.5", "ewgs:1", "--range-given", "--num-bits", "4")
    out = qdq.quantize_and_dequantize_v4(X, -2.0, 2.5, num_bits=4, range_given=True)
    with np.errstate(invalid="ignore"):
        diff = np.where(mask == 1, (X - out) / F32(4.5), F32(0)).astype(F32)
        want = G * (F32(1) + np.sign(G) * diff) * mask
    assert o["backprops_wrt_input"] == pytest.approx(want, rel=1e-6, abs=1e-7, nan_ok=True)
    # without --range-given the mask estimators still mask on the given range, as V4Grad does
    _, o = _grad(cli, tmp_path, X[:-1], G[:-1], "-2", "2.5", "scaled:2,0")
    assert o["backprops_wrt_input"].tolist() == (G[:-1] * F32(2) * mask[:-1]).tolist()


def test_pact_and_lsq_where_the_grid_ends_at_the_range(cli, tmp_path):
    # unsigned [0, 3]: the grid is exactly [0, 3], PACT's ReLU range with alpha = 3
    x = np.array([-1.0, 0.5, 2.9, 3.0, 4.0], F32)
    g = np.array([1.0, 2.0, 3.0, 4.0, 5.0], F32)
    _, o = _grad(cli, tmp_path, x, g, "0", "3", "pact", "--range-given", "--no-signed-input", "--num-bits", "2")
    assert o["backprops_wrt_input"].tolist() == [0.0, 2.0, 3.0, 0.0, 0.0]
    assert float(o["backprop_wrt_alpha"]) == 9.0
    # signed [-8, 7] at 4 bits: step 1, the grid is the range; LSQ by hand with grad factor 1
    x = np.array([-9.0, -8.0, -3.0, 0.0, 2.0, 7.0, 9.5], F32)
    _, o = _grad(cli, tmp_path, x, np.ones_like(x), "-8", "7", "lsq", "--range-given", "--num-bits", "4",
                 "--grad-factor", "1")
    assert o["backprops_wrt_input"].tolist() == [0, 1, 1, 1, 1, 1, 0]
    assert float(o["backprop_wrt_scale"]) == -8.0 + 7.0  # below: (qmin - 0), above: (qmax - 0); grid points: 0
    assert float(o["backprop_wrt_zero_point"]) == -2.0
    # and the same as the estimators module on the view qgcli builds
    grid = qdq.quantization_grid(F32(-8), F32(7), num_bits=4)
    assert float(grid.step) == 1.0


@pytest.mark.parametrize("lo, hi, estimator, extra, words", [
    ("-2", "2.5", "lsq", ("--range-given", "--num-bits", "4"), "grid reaches outside"),
    ("-3", "2", "pact", ("--range-given", "--num-bits", "4"), "decided by input_min"),
    ("-3", "2", "lsq", ("--num-bits", "4"), "without --range-given"),
    ("0", "3", "pact", ("--no-signed-input",), "without --range-given"),
])
def test_pact_and_lsq_refused_where_their_meaning_does_not_transfer(cli, tmp_path, lo, hi, estimator, extra, words):
    r, _ = _grad(cli, tmp_path, X[:-1], G[:-1], lo, hi, estimator, *extra)
    assert r.exit_code == 2, r.output
    assert words in " ".join(r.output.split()) and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


def test_estimator_refusal_library():
    grid = qdq.quantization_grid(F32(-2), F32(2.5), num_bits=4)
    assert qdq.estimator_refusal("pact", grid, -2.0, 2.5, range_given=True) is None  # the top is input_max
    assert "lsq" in qdq.estimator_refusal("lsq", grid, -2.0, 2.5, range_given=True)
    for name in ("ste", "identity", "scaled", "ewgs"):
        assert qdq.estimator_refusal(name, grid, -2.0, 2.5, range_given=False) is None
    assert est.parse_estimator("ewgs:1").name == "ewgs"


def test_nudge_reads_the_range_from_a_bundle(cli, tmp_path):
    for names in (("input_min", "input_max"), ("min", "max")):
        with h5py.File(tmp_path / "b.h5", "w") as f:
            f[names[0]], f[names[1]] = F32(-3), F32(2)
        doc = _json(cli("nudge", tmp_path / "b.h5", *V4, "--num-bits", "4", "--json"))
        assert doc["grid"]["decided_by"] == "input_min" and doc["grid"]["hi"] == 2.625
