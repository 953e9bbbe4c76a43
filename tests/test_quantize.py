"""TensorFlow's QuantizeV2 + Dequantize round trip (the notebook's own fake quant): golden cases from a real
TensorFlow 2.21 (tests/golden/make_golden_quantize.py), hand-computed cases, properties, the gradient path and
the CLI (``fakequant`` / ``fakequant-grad --variant quantize-dequantize``)."""
import collections
import json
import os
import sys

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qgcli.errors import QgcliError
from qgcli.ops import quantize as q

from conftest import GOLDEN, SAMPLES

PATH = os.path.join(GOLDEN, "quantize.h5")
NOTEBOOK = os.path.join(SAMPLES, "notebook.h5")
f32 = np.float32


def load_cases():
    with h5py.File(PATH, "r") as f:
        return [(name, dict(f[name].attrs), {k: f[name][k][()] for k in f[name]}) for name in f]


CASES = load_cases()


def run_case(attrs, data, xp=np):
    axis = None if int(attrs["axis"]) == -1 else int(attrs["axis"])
    if attrs["op"] == "Dequantize":
        out = q.dequantize(xp.asarray(data["inputs"]), data["min"], data["max"], mode=attrs["mode"],
                           narrow_range=bool(attrs["narrow_range"]), axis=axis, dtype=attrs["dtype"])
        return {"outputs": out}
    r = q.quantize_dequantize(xp.asarray(data["inputs"]), data["min"], data["max"], dtype=attrs["dtype"],
                              mode=attrs["mode"], round_mode=attrs["round_mode"],
                              narrow_range=bool(attrs["narrow_range"]), axis=axis,
                              ensure_minimum_range=float(attrs["ensure_minimum_range"]))
    return r.as_dict()


def refused(attrs):
    return "error" in attrs or str(attrs["description"]).startswith("tf-garbage:")


def assert_matches(got, data, what):
    from qgcli.backend import to_numpy

    for name, value in got.items():
        value, want = np.asarray(to_numpy(value)), data[name]
        assert value.shape == want.shape and value.dtype == want.dtype, f"{what}: {name} {value.dtype}{value.shape}"
        if want.dtype.kind == "f":  # bit for bit, signed zeros included; a NaN matches any NaN
            nan = np.isnan(want)
            np.testing.assert_array_equal(np.isnan(value), nan, err_msg=f"{what}: {name} NaN positions")
            np.testing.assert_array_equal(value[~nan].view(np.uint32), want[~nan].view(np.uint32),
                                          err_msg=f"{what}: {name}")
        else:
            np.testing.assert_array_equal(value, want, err_msg=f"{what}: {name}")


# --- golden cases from TensorFlow ---------------------------------------------------------------------------

def test_the_golden_file_covers_every_combination():
    seen = collections.Counter()
    for _, a, _ in CASES:
        if a["op"] == "QuantizeDequantize" and not refused(a):
            seen[(a["dtype"], a["mode"], a["round_mode"], bool(a["narrow_range"]))] += 1
    combos = [(t, m, r, n) for t in q.QTYPES for m, r in (("MIN_COMBINED", "HALF_AWAY_FROM_ZERO"),
                                                         ("MIN_FIRST", "HALF_AWAY_FROM_ZERO"),
                                                         ("SCALED", "HALF_AWAY_FROM_ZERO"),
                                                         ("SCALED", "HALF_TO_EVEN")) for n in (False, True)]
    assert all(seen[c] >= 10 for c in combos), {c: seen[c] for c in combos if seen[c] < 10}
    assert len(CASES) >= 800 and sum(refused(a) for _, a, _ in CASES) >= 14
    with h5py.File(PATH, "r") as f:
        assert f.attrs["tensorflow_version"].startswith("2.21") and f.attrs["TF_ENABLE_ONEDNN_OPTS"] == "0"


@pytest.mark.parametrize("name, attrs, data", CASES, ids=[c[0] for c in CASES])
def test_matches_tensorflow(name, attrs, data):
    if refused(attrs):
        with pytest.raises(QgcliError) as info:
            run_case(attrs, data)
        if "error" in attrs and attrs["error_type"] != "UnimplementedError":
            # TensorFlow's own reason is in the message (qgcli may add what the values were).
            tf_reason = str(attrs["error"]).split(", but min_range dims")[0]
            assert tf_reason.rstrip(".") in str(info.value) or "but given axis value" in tf_reason
        return
    assert_matches(run_case(attrs, data), data, name)


# NumPy runs every case in test_matches_tensorflow: only the GPU parameter is left (it skips without a GPU).
@pytest.mark.parametrize("xp", [pytest.param("cupy", marks=pytest.mark.gpu)], indirect=True)
def test_golden_cases_on_the_gpu(xp):
    for name, attrs, data in CASES:
        if not refused(attrs):
            assert_matches(run_case(attrs, data, xp), data, name)


# --- the random campaign: TensorFlow's answers stored as digests (tests/golden/make_golden_quantize_campaign.py)

LONG = os.environ.get("QGCLI_LONG", "") not in ("", "0")


def check_campaign(n_round_trips, n_dequantize):
    """qgcli against TensorFlow on the first cases of the campaign; returns the indices that differ."""
    sys.path.insert(0, GOLDEN)
    import make_golden_quantize_campaign as campaign

    with np.load(campaign.OUT) as npz:  # closed at once: an open NpzFile warns when collected
        stored = {k: npz[k] for k in npz.files}
    assert str(stored["tensorflow_version"]).startswith("2.21")
    wrong = []
    for what, draw, n in (("round_trip", campaign.draw_round_trip, n_round_trips),
                          ("dequantize", campaign.draw_dequantize, n_dequantize)):
        table = stored[what]
        assert len(table) >= n
        for i in range(n):
            x, mn, mx, attrs = draw(i)
            assert campaign.digest(x, mn, mx) == table[i, 0], f"{what} {i}: inputs differ (NumPy's random stream?)"
            if what == "round_trip":
                r = q.quantize_dequantize(x, mn, mx, **attrs).as_dict()
                got = campaign.digest(*(np.asarray(r[k]) for k in campaign.OUTPUT_KEYS))
            else:
                got = campaign.digest(np.asarray(q.dequantize(x, mn, mx, **attrs)))
            if got != table[i, 1]:
                wrong.append((what, i))
    return wrong


def test_random_campaign_sample():
    assert check_campaign(400, 200) == []


@pytest.mark.slow
@pytest.mark.skipif(not LONG, reason="long campaign: set QGCLI_LONG=1")
def test_random_campaign_in_full():
    """The README's 15,000 random round trips and 7,000 random Dequantize cases (~12 s)."""
    assert check_campaign(15_000, 7_000) == []


# --- hand-computed cases -----------------------------------------------------------------------------------

def test_the_notebook_round_trip_has_256_levels_that_miss_zero():
    """tf.quantize(x, -6, 6, tf.quint8) + tf.dequantize: levels -6 + k * 12/255; 0 lands on k = 128 -> 0.0235."""
    x = np.linspace(-8, 8, 4001, dtype=f32)
    r = q.quantize_dequantize(x, -6.0, 6.0, dtype="quint8")
    assert r.quantized.dtype == np.uint8 and np.unique(r.quantized).size == 256
    assert float(r.output_min) == -6.0 and float(r.output_max) == 6.0
    k = r.quantized.astype(np.float32)
    np.testing.assert_array_equal(r.outputs, k * (f32(12) / f32(255)) + f32(-6))
    zero = q.quantize_dequantize(np.zeros(1, f32), -6.0, 6.0)
    assert zero.quantized.tolist() == [128] and zero.outputs[0] == f32(128) * (f32(12) / f32(255)) + f32(-6) != 0


@pytest.mark.parametrize("dtype, npt, levels", [("quint8", np.uint8, 256), ("qint8", np.int8, 256),
                                                ("quint16", np.uint16, 65536), ("qint16", np.int16, 65536),
                                                ("qint32", np.int32, 2**32)])
def test_quantized_has_the_natural_numpy_dtype(dtype, npt, levels):
    r = q.quantize_dequantize(np.array([-7.0, -6.0, 0.0, 5.9, 6.0], f32), -6.0, 6.0, dtype=dtype)
    assert r.quantized.dtype == npt and r.outputs.dtype == np.float32
    assert r.output_min.dtype == np.float32 and r.output_min.shape == ()
    assert int(r.quantized[0]) == np.iinfo(npt).min == int(r.quantized[1])
    assert q.round_trip_grid(-6.0, 6.0, dtype=dtype).quant_max + 1 == levels


def test_scaled_makes_the_range_symmetric_in_the_integer_domain():
    # qint8 SCALED on [-6, 6]: scale = min(-128 / -6, 127 / 6) = 127/6; output_min = -128 / scale.
    r = q.quantize_dequantize(np.array([-6.0, -1.0, 0.0, 6.0], f32), -6.0, 6.0, dtype="qint8", mode="SCALED")
    assert float(r.output_max) == 6.0 and float(r.output_min) == float(f32(-128) / (f32(127) / f32(6)))
    assert r.quantized.tolist() == [-127, -21, 0, 127]
    narrow = q.quantize_dequantize(np.array([-7.0], f32), -6.0, 6.0, dtype="qint8", mode="SCALED", narrow_range=True)
    assert narrow.quantized.tolist() == [-127] and float(narrow.output_min) == -6.0


def test_rounding_ties_follow_the_round_mode():
    # quint8 SCALED on [0, 255]: scale 1, so x is the integer before rounding.
    x = np.array([0.5, 1.5, 2.5, 253.5], f32)
    away = q.quantize_v2(x, 0.0, 255.0, dtype="quint8", mode="SCALED")[0]
    even = q.quantize_v2(x, 0.0, 255.0, dtype="quint8", mode="SCALED", round_mode="HALF_TO_EVEN")[0]
    assert away.tolist() == [1, 2, 3, 254] and even.tolist() == [0, 2, 2, 254]


def test_ensure_minimum_range_widens_tiny_ranges():
    r = q.quantize_dequantize(np.array([0.0015], f32), 0.001, 0.002)
    assert float(r.output_min) == 0.0 and float(r.output_max) == float(f32(0.01))  # max(1, ...) * 0.01
    r0 = q.quantize_dequantize(np.array([0.0015], f32), 0.001, 0.002, ensure_minimum_range=0.0)
    assert float(r0.output_max) == float(f32(0.002))
    assert q.quantize_dequantize(np.array([1.0], f32), 0.0, 0.0).output_max == f32(0.01)


def test_range_not_containing_zero_is_extended_to_zero():
    r = q.quantize_dequantize(np.array([-5.0, -1.0], f32), -4.0, -0.25)
    assert float(r.output_min) == -4.0 and float(r.output_max) == 0.0
    assert r.quantized.tolist() == [0, 191]


def test_qint32_wraps_at_the_top_as_tensorflow_does():
    # (max - min) * 2**32/range - 2**31 rounds to 2**31, which TF's lrint-based cast wraps to -2**31.
    r = q.quantize_dequantize(np.array([5.0, 6.0, 7.0], f32), -6.0, 6.0, dtype="qint32")
    assert r.quantized.tolist()[1:] == [-(2**31), -(2**31)] and r.outputs[1] == -6.0
    s = q.quantize_v2(np.array([6.0], f32), -6.0, 6.0, dtype="qint32", mode="SCALED")[0]
    assert s.tolist() == [-(2**31)]
    first = q.quantize_v2(np.array([6.0], f32), -6.0, 6.0, dtype="qint32", mode="MIN_FIRST")[0]
    assert first.tolist() == [2147483520]  # MIN_FIRST clamps below 2**31 instead


def test_nan_inputs_follow_eigens_packets():
    x = np.full(19, np.nan, f32)
    a = q.quantize_v2(x, -6.0, 6.0, dtype="qint8")[0]  # packets of 8 saturate, the 3-element tail gives 0
    assert a.tolist() == [-128] * 16 + [0] * 3
    e = q.quantize_v2(np.full(40, np.nan, f32), -6.0, 6.0, dtype="qint16", mode="SCALED",
                      round_mode="HALF_TO_EVEN")[0]
    assert e.tolist() == [-32768] * 32 + [0] * 8
    assert q.quantize_v2(x, -6.0, 6.0, dtype="quint8")[0].tolist() == [0] * 19
    assert q.quantize_v2(x.reshape(1, 19), [-6.0], [6.0], dtype="qint8", axis=0)[0].tolist() == [[-128] * 16 + [0] * 3]
    assert q.quantize_v2(np.full((2, 9), np.nan, f32), [-6, -6], [6, 6], dtype="qint8", axis=0)[0].max() == 0


def test_per_axis_ranges_broadcast_along_the_axis():
    x = np.array([[[-1.0, 3.0]], [[-1.0, 3.0]], [[-1.0, 3.0]]], f32)  # shape (3, 1, 2), axis 0
    r = q.quantize_dequantize(x, [-1.0, 0.0, -4.0], [1.0, 2.0, 4.0], dtype="qint8", mode="SCALED", axis=0)
    assert r.output_min.shape == (3,) and r.quantized.shape == x.shape
    for c in range(3):
        one = q.quantize_dequantize(x[c], [-1.0, 0.0, -4.0][c], [1.0, 2.0, 4.0][c], dtype="qint8", mode="SCALED")
        np.testing.assert_array_equal(r.quantized[c], one.quantized)
        np.testing.assert_array_equal(r.outputs[c], one.outputs)
    neg = q.quantize_dequantize(x, [-1.0, 0.0, -4.0], [1.0, 2.0, 4.0], dtype="qint8", mode="SCALED", axis=-3)
    np.testing.assert_array_equal(neg.quantized, r.quantized)


def test_dequantize_alone_reads_the_type_from_the_integers():
    qv, lo, hi = q.quantize_v2(np.array([-1.0, 0.5], f32), -1.0, 1.0, dtype="qint16", mode="MIN_FIRST")
    np.testing.assert_array_equal(q.dequantize(qv, lo, hi, mode="MIN_FIRST"),
                                  q.quantize_dequantize(np.array([-1.0, 0.5], f32), -1.0, 1.0, dtype="qint16",
                                                        mode="MIN_FIRST").outputs)
    assert q.qtype_of(np.int16).name == "qint16" and q.qtype_of("QUINT8").name == "quint8"
    with pytest.raises(QgcliError, match="dtype"):
        q.qtype_of("int8")
    with pytest.raises(QgcliError, match="integer"):
        q.dequantize(np.zeros(3, f32), 0.0, 1.0, dtype="quint8")
    with pytest.raises(QgcliError, match="quantized: has values outside quint8's range"):
        q.dequantize(np.array([0, 256]), 0.0, 1.0, dtype="quint8")
    assert q.dequantize(np.array([0, 255], np.int64), 0.0, 1.0, dtype="quint8").tolist() == [0.0, 1.0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="MIN_COMBINED", round_mode="HALF_TO_EVEN"),
     "round_mode: Round mode 'HALF_TO_EVEN' only supported for mode 'SCALED', but mode is 'MIN_COMBINED'."),
    (dict(mode="MIN_FIRST", round_mode="HALF_TO_EVEN"), "but mode is 'MIN_FIRST'"),
    (dict(mode="FOO"), "mode: 'FOO' is not one of"),
    (dict(round_mode="UP"), "round_mode: 'UP' is not one of"),
    (dict(dtype="qint4"), "dtype: 'qint4' is not a quantized type"),
    (dict(min_range=1.0, max_range=-1.0), "max: -1.0 is below min 1.0; input_max_range must be larger"),
    (dict(min_range=np.nan), "min: is nan; the range must be finite"),
    (dict(max_range=np.inf), "max: is inf; the range must be finite"),
    (dict(min_range=[-1.0, -2.0], max_range=[1.0, 2.0]), "If axis is not specified, min_range must contain a single"),
    (dict(axis=2), "axis: Axis is on a zero-based index"),
    (dict(axis=1, min_range=[-1.0] * 3, max_range=[1.0] * 3), "min_range is a 1-D tensor of size 3"),
    (dict(axis=1, min_range=[-1.0] * 4, max_range=[1.0] * 4, mode="MIN_FIRST"),
     "MIN_FIRST mode is not implemented for Quantize with axis != -1."),
    (dict(axis=1, min_range=[-1.0, 2.0, -1.0, -1.0], max_range=[1.0] * 4), "at slice 1"),
    (dict(ensure_minimum_range=np.inf), "ensure_minimum_range: must be finite"),
    (dict(inputs=np.zeros(3, np.int32)), "inputs: dtype int32 is not a real floating type"),
])
def test_refusals_name_the_operand_and_give_tensorflows_reason(kwargs, match):
    args = dict(inputs=np.zeros((3, 4), f32), min_range=-1.0, max_range=1.0)
    args.update(kwargs)
    x, mn, mx = args.pop("inputs"), args.pop("min_range"), args.pop("max_range")
    with pytest.raises(QgcliError) as info:
        q.quantize_dequantize(x, mn, mx, **args)
    assert match in str(info.value)


# --- properties ------------------------------------------------------------------------------------------------

COMBOS = [(t, m, r) for t in q.QTYPES for m, r in (("MIN_COMBINED", "HALF_AWAY_FROM_ZERO"),
                                                    ("MIN_FIRST", "HALF_AWAY_FROM_ZERO"),
                                                    ("SCALED", "HALF_AWAY_FROM_ZERO"), ("SCALED", "HALF_TO_EVEN"))]
finite = st.floats(-1e4, 1e4, width=32, allow_subnormal=False)


@settings(max_examples=60, deadline=None)
@given(combo=st.sampled_from(COMBOS), lo=finite, width=st.floats(0, 1e4, width=32), narrow=st.booleans(),
       xs=st.lists(st.floats(-2e4, 2e4, width=32), min_size=1, max_size=40))
def test_round_trip_is_monotone_and_stays_on_the_type(combo, lo, width, narrow, xs):
    dtype, mode, rmode = combo
    hi = float(f32(lo) + f32(width))
    x = np.sort(np.array(xs, f32))
    r = q.quantize_dequantize(x, lo, hi, dtype=dtype, mode=mode, round_mode=rmode, narrow_range=narrow)
    info = np.iinfo(q.QTYPES[dtype].numpy_dtype)
    assert r.quantized.dtype == q.QTYPES[dtype].numpy_dtype
    assert float(r.output_min) <= 0 or (mode == "SCALED" and narrow and dtype.startswith("qu"))
    mid = (float(r.output_min) + float(r.output_max)) / 2
    top = (dtype == "qint32") & (mode != "MIN_FIRST") & (r.quantized == info.min) & (x > mid)  # TF's wrap
    keep = ~top
    assert np.all(np.diff(r.quantized[keep].astype(np.int64)) >= 0)
    assert np.all(np.diff(r.outputs[keep]) >= 0)
    if mode == "SCALED":  # Dequantize multiplies the integers by one step
        step = q.round_trip_grid(lo, hi, dtype=dtype, mode=mode, narrow_range=narrow).scale
        want = np.where(top, f32(-(2.0**31)), r.quantized.astype(f32)) * step
        np.testing.assert_array_equal(r.outputs, want.astype(f32))


# --- the gradient path ------------------------------------------------------------------------------------------

def test_gradient_is_the_ste_over_the_adjusted_range():
    x = np.array([-7.0, -6.0, 0.0, 3.0, 6.0, 6.5, np.nan], f32)
    g = np.array([1.0, 2.0, -3.0, 4.0, 5.0, 6.0, 7.0], f32)
    np.testing.assert_array_equal(q.quantize_dequantize_gradient(g, x, -6.0, 6.0), [0, 2, -3, 4, 5, 0, 0])
    r = q.quantize_dequantize(x, 0.5, 3.0)  # the range is extended to [0, 3]
    lo, hi = q.range_bounds(r.output_min, r.output_max, x.ndim, None)
    out = q.quantize_dequantize_backprops(g, x, lo, hi)
    np.testing.assert_array_equal(out["backprops_wrt_input"], [0, 0, -3, 4, 0, 0, 0])
    # a subnormal input compares as zero (TF's DAZ), so it is inside [0, max]
    assert q.quantize_dequantize_gradient(np.ones(1, f32), np.array([-1e-40], f32), 0.0, 1.0).tolist() == [1.0]


def test_gradient_per_axis_uses_each_slices_range():
    x = np.array([[-1.5, 1.5], [1.5, -1.5]], f32)  # column 0 on [-1, 2], column 1 on [-2, 1]
    r = q.quantize_dequantize(x, [-1.0, -2.0], [2.0, 1.0], axis=1)
    g = q.quantize_dequantize_gradient(np.ones_like(x), x, r.output_min, r.output_max, axis=1)
    np.testing.assert_array_equal(g, [[0, 0], [1, 1]])


def test_estimators_run_on_the_round_trip_view():
    from qgcli.ops.estimators import apply_estimator

    rng = np.random.default_rng(3)
    x = (rng.standard_normal(500) * 4).astype(f32)
    g = rng.standard_normal(500).astype(f32)
    view, r = q.quantize_dequantize_view(x, -6.0, 6.0)
    # the notebook's custom gradient, 0.9 * tf.identity(dy): one float32 product everywhere
    leaky = apply_estimator("scaled:0.9", g, view)[0]["backprops_wrt_input"]
    np.testing.assert_array_equal(leaky, f32(0.9) * g)
    ste = apply_estimator("ste", g, view)[0]["backprops_wrt_input"]
    np.testing.assert_array_equal(ste, q.quantize_dequantize_gradient(g, x, r.output_min, r.output_max))
    # LSQ: where an input sits on a level inside the range, its step-size gradient vanishes
    on_grid = r.outputs[(r.quantized > 0) & (r.quantized < 255)][:5]
    v2, _ = q.quantize_dequantize_view(on_grid, -6.0, 6.0)
    out, details = apply_estimator("lsq", np.ones_like(on_grid), v2, grad_factor=1.0)
    assert abs(float(out["backprop_wrt_scale"])) < 1e-5 and details["grad_factor"] == 1.0
    np.testing.assert_array_equal(view.restore(view.outputs), r.outputs)


def test_round_trip_grid_levels_are_the_outputs():
    for dtype, mode in (("quint8", "MIN_COMBINED"), ("qint8", "MIN_FIRST"), ("qint8", "SCALED")):
        grid = q.round_trip_grid(-1.3, 5.7, dtype=dtype, mode=mode)
        r = q.quantize_dequantize(np.linspace(-2, 6, 3001, dtype=f32), -1.3, 5.7, dtype=dtype, mode=mode)
        levels = (np.arange(grid.quant_min, grid.quant_max + 1) - grid.quant_zero) * grid.scale
        assert np.abs(r.outputs[:, None] - levels[None, :]).min(axis=1).max() < 1e-6
        assert "adjusted to" in grid.words() and dtype in grid.words()


# --- the CLI ---------------------------------------------------------------------------------------------------

def read_h5(path):
    with h5py.File(path, "r") as f:
        return {k: f[k][()] for k in f}, {k: dict(f[k].attrs) for k in f}


@pytest.mark.parametrize("dtype, npt", [("quint8", np.uint8), ("qint8", np.int8), ("quint16", np.uint16),
                                        ("qint16", np.int16), ("qint32", np.int32)])
def test_cli_forward_writes_the_four_outputs(cli, tmp_path, dtype, npt):
    out = tmp_path / "out.h5"
    r = cli("fakequant", NOTEBOOK, "--variant", "quantize-dequantize", "--dtype", dtype, "--mode", "scaled",
            "--round-mode", "half_to_even", "-o", out)
    assert r.exit_code == 0, r.output
    data, attrs = read_h5(out)
    assert set(data) == {"outputs", "quantized", "output_min", "output_max"}
    assert data["quantized"].dtype == npt and data["outputs"].dtype == np.float32
    with h5py.File(NOTEBOOK, "r") as f:
        want = q.quantize_dequantize(f["inputs"][()], f["min"][()], f["max"][()], dtype=dtype, mode="SCALED",
                                     round_mode="HALF_TO_EVEN")
    assert_matches(want.as_dict(), data, "cli")
    assert attrs["outputs"]["op"] == "QuantizeV2+Dequantize" and attrs["outputs"]["mode"] == "SCALED"
    assert "QuantizeV2+Dequantize" in r.stderr and "output_min" in r.stderr


def test_cli_matches_a_golden_case_through_a_bundle(cli, tmp_path):
    name, attrs, data = next(c for c in CASES if c[1]["description"] == "grid:asym" and c[1]["dtype"] == "qint16"
                             and c[1]["mode"] == "MIN_FIRST")
    bundle = tmp_path / "b.h5"
    with h5py.File(bundle, "w") as f:
        for k in ("inputs", "min", "max"):
            f[k] = data[k]
    out = tmp_path / "out.npz"
    r = cli("fakequant", bundle, "-o", out, "--variant", "quantize-dequantize", "--dtype", "qint16", "--mode",
            "MIN_FIRST", "--narrow-range" if attrs["narrow_range"] else "--quiet")
    assert r.exit_code == 0, r.output
    with np.load(out) as got:
        assert_matches(dict(got), data, name)


def test_cli_json_summary(cli, tmp_path):
    r = cli("fakequant", NOTEBOOK, "--variant", "quantize-dequantize", "-o", tmp_path / "o.h5", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["op"] == "QuantizeV2+Dequantize" and s["attributes"]["dtype"] == "quint8"
    assert s["range"]["output_min"] == -6.0 and s["range"]["levels"] == 256
    assert s["outputs"]["quantized"]["dtype"] == "uint8"
    assert 0 < s["statistics"]["clipped_below"] < 0.1


def test_cli_per_axis(cli, tmp_path):
    x = np.arange(24, dtype=f32).reshape(2, 3, 4) / 4 - 3
    np.save(tmp_path / "x.npy", x)
    out = tmp_path / "o.h5"
    r = cli("fakequant", "--inputs", tmp_path / "x.npy", "--min", "-1,-2,0.5", "--max", "1,2,3", "--axis", "1",
            "--variant", "quantize-dequantize", "--dtype", "qint8", "--mode", "SCALED", "-o", out)
    assert r.exit_code == 0, r.output
    data, _ = read_h5(out)
    want = q.quantize_dequantize(x, [-1, -2, 0.5], [1, 2, 3], dtype="qint8", mode="SCALED", axis=1)
    assert_matches(want.as_dict(), data, "per-axis")
    assert data["output_min"].shape == (3,)


def test_cli_gradient_default_ste_and_the_notebooks_estimator(cli, tmp_path):
    with h5py.File(NOTEBOOK, "r") as f:
        x, g = f["inputs"][()], f["gradients"][()]
    r = cli("fakequant-grad", NOTEBOOK, "--variant", "quantize-dequantize", "-o", tmp_path / "ste.h5")
    assert r.exit_code == 0, r.output
    ste, attrs = read_h5(tmp_path / "ste.h5")
    assert set(ste) == {"backprops_wrt_input"}
    np.testing.assert_array_equal(ste["backprops_wrt_input"], g * ((x >= -6) & (x <= 6)))
    assert "gradient mass blocked" in " ".join(r.stderr.split())  # rich wraps at the terminal width
    r = cli("fakequant-grad", NOTEBOOK, "--variant", "quantize-dequantize", "--dtype", "quint8",
            "--estimator", "scaled:0.9", "-o", tmp_path / "leaky.h5")
    assert r.exit_code == 0, r.output
    leaky, attrs = read_h5(tmp_path / "leaky.h5")
    np.testing.assert_array_equal(leaky["backprops_wrt_input"], f32(0.9) * g)
    assert attrs["backprops_wrt_input"]["estimator"] == "scaled:0.9"
    assert "[output_min, output_max]" in " ".join(r.stderr.split())
    r = cli("fakequant-grad", NOTEBOOK, "--variant", "quantize-dequantize", "--estimator", "lsq", "-o",
            tmp_path / "lsq.h5", "--json")
    assert r.exit_code == 0, r.output
    assert set(read_h5(tmp_path / "lsq.h5")[0]) == {"backprops_wrt_input", "backprop_wrt_scale",
                                                     "backprop_wrt_zero_point"}
    assert json.loads(r.stdout)["estimator"]["grad_factor"] > 0


@pytest.mark.parametrize("args, message", [
    (("--variant", "quantize-dequantize", "--mode", "MIN_COMBINED", "--round-mode", "HALF_TO_EVEN"),
     "Error: round_mode: Round mode 'HALF_TO_EVEN' only supported for mode 'SCALED', but mode is 'MIN_COMBINED'."),
    (("--variant", "quantize-dequantize", "--num-bits", "4"), "'--num-bits': the bit width of --variant"),
    (("--dtype", "qint8"), "'--dtype': only applies to --variant quantize-dequantize"),
    (("--variant", "vars", "--mode", "SCALED"), "'--mode': only applies to --variant quantize-dequantize"),
    (("--variant", "quantize-dequantize", "--semantics", "torch"), "'--semantics': does not apply to --variant"),
    (("--variant", "quantize-dequantize", "--min", "1", "--max", "-1"), "input_max_range must be larger"),
    (("--variant", "quantize-dequantize", "--min", "-1,-2", "--max", "1,2"), "give --axis K"),
    (("--variant", "quantize-dequantize", "--axis", "5"), "Error: axis: Axis is on a zero-based index"),
    (("--variant", "quantize-dequantize", "--dtype", "int8"), "'--dtype'"),
])
def test_cli_refusals_exit_2_without_output(cli, tmp_path, args, message):
    out = tmp_path / "o.h5"
    r = cli("fakequant", NOTEBOOK, *args, "-o", out)
    assert r.exit_code == 2, r.output
    assert message in " ".join(r.stderr.split()) and "Traceback" not in r.output
    assert not out.exists()


def test_cli_gradient_refusals(cli, tmp_path):
    out = tmp_path / "o.h5"
    r = cli("fakequant-grad", NOTEBOOK, "--variant", "quantize-dequantize", "--grad-factor", "2", "-o", out)
    assert r.exit_code == 2 and "only applies to --estimator lsq" in " ".join(r.stderr.split())
    r = cli("fakequant-grad", NOTEBOOK, "--variant", "quantize-dequantize", "--estimator", "pact", "--plot",
            tmp_path / "f.png", "-o", out)
    assert r.exit_code == 2 and "plot estimators" in " ".join(r.stderr.split())
    assert not out.exists()


# --- plots: the notebook's fourth and fifth figures -------------------------------------------------------------

def test_plot_staircase_draws_the_round_trip(cli, tmp_path):
    from qgcli.report import plots

    with h5py.File(NOTEBOOK, "r") as f:
        x = f["inputs"][()]
    fig = plots.staircase(x, -6.0, 6.0, variant="quantize-dequantize", quantize=dict(dtype="quint8"))
    line = next(l for l in fig.axes[0].get_lines() if l.get_gid() == "outputs")
    want = q.quantize_dequantize(x, -6.0, 6.0)
    order = np.argsort(x.reshape(-1), kind="stable")
    np.testing.assert_array_equal(line.get_ydata(), want.outputs.reshape(-1)[order])
    assert fig.qgcli_summary["op"] == "QuantizeV2+Dequantize" and fig.qgcli_summary["grid"]["levels"] == 256
    assert "adjusted to [-6, 6]" in fig.axes[0].get_title()
    out = tmp_path / "nb4.png"
    r = cli("plot", "staircase", NOTEBOOK, "--variant", "quantize-dequantize", "--dtype", "quint8", "-o", out)
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_ste_and_the_notebooks_leaky_gradient(cli, tmp_path):
    from qgcli.report import plots

    x = np.linspace(-8, 8, 101, dtype=f32)
    fig = plots.ste(x, -6.0, 6.0, variant="quantize-dequantize", quantize=dict(dtype="qint8", mode="SCALED"))
    mask = next(l for l in fig.axes[1].get_lines() if l.get_gid() == "mask")
    r = q.quantize_dequantize(x, -6.0, 6.0, dtype="qint8", mode="SCALED")
    np.testing.assert_array_equal(mask.get_ydata(), ((x >= r.output_min) & (x <= r.output_max)).astype(f32))
    fig5 = plots.estimators(x, f32(-6), f32(6), names=("scaled:0.9",), variant="quantize-dequantize",
                            quantize=dict(dtype="quint8"))
    leaky = next(l for l in fig5.axes[1].get_lines() if l.get_gid() == "estimator:scaled:0.9")
    np.testing.assert_array_equal(leaky.get_ydata(), np.full(x.size, f32(0.9)))
    out = tmp_path / "nb5.png"
    r = cli("plot", "estimators", "--inputs", f"{NOTEBOOK}:inputs", "--min", "-6", "--max", "6", "--variant",
            "quantize-dequantize", "--dtype", "quint8", "-e", "scaled:0.9", "-o", out)
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = cli("fakequant-grad", NOTEBOOK, "--variant", "quantize-dequantize", "--plot", tmp_path / "ste.png",
            "-o", tmp_path / "g.h5")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "ste.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_refuses_quantize_options_for_other_variants(cli, tmp_path):
    r = cli("plot", "ste", NOTEBOOK, "--num-bits", "2", "--mode", "SCALED", "-o", tmp_path / "f.png")
    assert r.exit_code == 2 and "only applies to --variant quantize-dequantize" in " ".join(r.stderr.split())
    assert not (tmp_path / "f.png").exists()


def test_large_tensors_run_in_blocks_with_the_same_results():
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(300_003) * 4).astype(f32)  # above two blocks: the threaded block path
    for dtype, mode, rmode in (("qint8", "MIN_COMBINED", "HALF_AWAY_FROM_ZERO"), ("qint16", "SCALED", "HALF_TO_EVEN"),
                               ("quint8", "MIN_FIRST", "HALF_AWAY_FROM_ZERO")):
        whole = q.quantize_dequantize(x, -1.3, 5.7, dtype=dtype, mode=mode, round_mode=rmode)
        parts = [q.quantize_dequantize(x[i:i + 70_000], -1.3, 5.7, dtype=dtype, mode=mode, round_mode=rmode)
                 for i in range(0, x.size, 70_000)]
        np.testing.assert_array_equal(whole.quantized, np.concatenate([p.quantized for p in parts]))
        np.testing.assert_array_equal(whole.outputs, np.concatenate([p.outputs for p in parts]))
    # NaN keeps Eigen's packet rule at its global position: whole packets up to 300000, scalar tail after.
    y = x.copy()
    at = [0, 131_071, 131_072, 299_999, 300_000, 300_002]
    y[at] = np.nan
    got = q.quantize_v2(y, -6.0, 6.0, dtype="qint8")[0][at].tolist()
    assert got == [-128, -128, -128, -128, 0, 0]
