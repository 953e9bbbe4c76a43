#!/usr/bin/env python3
"""Generate ``tests/golden/quantize.h5``: golden cases for TensorFlow's QuantizeV2 + Dequantize round trip.

The outputs come from a REAL TensorFlow (2.21, CPU, eager, through the public ``tf.quantization.quantize`` /
``tf.quantization.dequantize`` the tutorial notebook uses).  TensorFlow is not a dependency of qgcli; only this
generator imports it.  Regenerate with:

    python3 -m venv /tmp/tfvenv
    /tmp/tfvenv/bin/pip install tensorflow-cpu==2.21.0 h5py numpy
    /tmp/tfvenv/bin/python tests/golden/make_golden_quantize.py

``TF_ENABLE_ONEDNN_OPTS=0`` is forced: on CPUs where TensorFlow turns oneDNN on by default (recent Intel
parts) it would swap in ``_MklQuantizeV2`` for SCALED + HALF_TO_EVEN and quint8 MIN_FIRST, which rounds and
ranges differently; on the CPUs where it is off by default (AMD, older Intel) the results are the same as with
the variable unset.  Deterministic (fixed seed).

Layout: one group per case.  Attributes: ``op`` ("QuantizeDequantize" for the round trip, "Dequantize" for
Dequantize alone), ``dtype`` (quint8/qint8/quint16/qint16/qint32), ``mode``, ``round_mode``, ``narrow_range``,
``axis`` (-1 = none), ``ensure_minimum_range``, ``description``; ``error`` and ``error_type`` when TensorFlow
refused (then only the operands are stored).  Datasets: ``inputs`` (float32; for Dequantize the integers),
``min``, ``max`` (float32), and the outputs ``quantized`` (natural NumPy integer dtype), ``output_min``,
``output_max``, ``outputs`` (float32).
"""
import os
import platform
import re

os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import h5py  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

f32 = np.float32
SEED = 20250610
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "quantize.h5")
GENERATOR = "tests/golden/make_golden_quantize.py"

TYPES = {  # name: (tf dtype, numpy dtype, min, max)
    "quint8": (tf.quint8, np.uint8, 0, 255),
    "qint8": (tf.qint8, np.int8, -128, 127),
    "quint16": (tf.quint16, np.uint16, 0, 65535),
    "qint16": (tf.qint16, np.int16, -32768, 32767),
    "qint32": (tf.qint32, np.int32, -(2**31), 2**31 - 1),
}
BITCAST = {"quint8": tf.uint8, "qint8": tf.int8, "quint16": tf.uint16, "qint16": tf.int16, "qint32": tf.int32}
COMBOS = [("MIN_COMBINED", "HALF_AWAY_FROM_ZERO"), ("MIN_FIRST", "HALF_AWAY_FROM_ZERO"),
          ("SCALED", "HALF_AWAY_FROM_ZERO"), ("SCALED", "HALF_TO_EVEN")]
# (label, min, max): symmetric, asymmetric, not containing 0 (both sides), tiny (ensure_minimum_range acts),
# degenerate, large; the notebook's [-6, 6] first.
RANGES = [
    ("notebook", -6.0, 6.0),
    ("asym", -1.3, 5.7),
    ("pos", 0.5, 3.0),
    ("neg", -4.0, -0.25),
    ("tiny", 0.001, 0.002),
    ("tinysym", -1e-4, 1e-4),
    ("zero", 0.0, 0.0),
    ("eq", 2.0, 2.0),
    ("large", -1000.0, 3000.0),
    ("odd", -0.7, 0.3),
]


def adjusted_range(mn, mx, tname, mode, narrow, emr):
    """A float64 sketch of QuantizeV2's range (only used to place inputs on ties and ends; TF gives the truth)."""
    _, _, tmin, tmax = TYPES[tname]
    lo = min(0.0, mn)
    hi = max(0.0, max(mx, lo + max(1.0, abs(mn), abs(mx)) * emr))
    if mode == "SCALED":
        mo = tmin + (1 if narrow else 0)
        s1 = mo / lo if mo * lo > 0 else 3.4e38
        s2 = tmax / hi if tmax * hi > 0 else 3.4e38
        s = min(s1, s2)
        return mo / s, tmax / s, s
    levels = (tmax - tmin) if mode == "MIN_COMBINED" else 2.0 ** (8 * np.dtype(TYPES[tname][1]).itemsize) - 1
    return lo, hi, levels / (hi - lo) if hi > lo else 0.0


def neighbours(v, n=2):
    v = f32(v)
    out = [v]
    up = down = v
    for _ in range(n):
        up, down = np.nextafter(up, f32(np.inf)), np.nextafter(down, f32(-np.inf))
        out += [up, down]
    return out


def interesting_inputs(rng, mn, mx, tname, mode, narrow, emr, n_random=40, n_ties=12):
    lo, hi, scale = adjusted_range(mn, mx, tname, mode, narrow, emr)
    vals = []
    for v in (mn, mx, lo, hi, 0.0, -0.0):
        vals += neighbours(v)
    vals += [f32(1e-40), f32(-1e-40), f32(np.nan), f32(np.inf), f32(-np.inf)]
    width = hi - lo
    vals += list((lo - 0.25 * width - 1.0, hi + 0.25 * width + 1.0, 2 * lo - 1.0, 2 * hi + 1.0))
    if scale > 0 and np.isfinite(scale):
        _, _, tmin, tmax = TYPES[tname]
        n_levels = int(min(tmax - tmin, 1 << 20))
        ks = rng.integers(0, max(n_levels, 1), n_ties)
        ks = np.concatenate([ks, [0, 1, max(n_levels - 1, 0)]])
        for k in ks:
            if mode == "SCALED":
                centre = (tmin + float(k) + 0.5) / scale     # x * scale = k + 0.5
            elif mode == "MIN_FIRST":
                centre = (np.round(lo * scale) + float(k) + 0.5) / scale
            else:
                centre = lo + (float(k) + 0.5) / scale       # (x - lo) * scale = k + 0.5
            vals += neighbours(centre, 1)
            vals.append(f32(lo + float(k) / scale) if mode != "SCALED" else f32((tmin + float(k)) / scale))
    span = max(width, 1e-3)
    vals += list(rng.uniform(lo - 0.1 * span, hi + 0.1 * span, n_random).astype(f32))
    return np.array(vals, dtype=f32)


def clean_error(e):
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    msg = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", msg)
    msg = re.sub(r"\s*\[Op:\w+\].*$", "", msg)
    return type(e).__name__, msg.strip()


def run_round_trip(x, mn, mx, tname, mode, rmode, narrow, axis, emr):
    T = TYPES[tname][0]
    kw = dict(mode=mode, round_mode=rmode, narrow_range=narrow)
    if axis != -1:
        kw["axis"] = axis
    if emr != 0.01:
        kw["ensure_minimum_range"] = emr
    try:
        q, a, b = tf.quantization.quantize(tf.constant(x), tf.constant(mn), tf.constant(mx), T, **kw)
        dkw = dict(mode=mode, narrow_range=narrow)
        if axis != -1:
            dkw["axis"] = axis
        d = tf.quantization.dequantize(q, a, b, **dkw)
        return {"quantized": tf.bitcast(q, BITCAST[tname]).numpy(), "output_min": a.numpy(),
                "output_max": b.numpy(), "outputs": d.numpy()}
    except (tf.errors.OpError, ValueError) as e:
        return clean_error(e)


def run_dequantize(q, mn, mx, tname, mode, narrow, axis):
    T = TYPES[tname][0]
    kw = dict(mode=mode, narrow_range=narrow)
    if axis != -1:
        kw["axis"] = axis
    try:
        qt = tf.bitcast(tf.constant(q), T)
        d = tf.quantization.dequantize(qt, tf.constant(mn), tf.constant(mx), **kw)
        return {"outputs": d.numpy()}
    except (tf.errors.OpError, ValueError) as e:
        return clean_error(e)


CASES = []


def add(op, description, tname, mode, rmode, narrow, axis, emr, arrays):
    CASES.append(dict(op=op, description=description, dtype=tname, mode=mode, round_mode=rmode,
                      narrow_range=bool(narrow), axis=int(axis), ensure_minimum_range=f32(emr), arrays=arrays))


def build_grid(rng):
    """Every (type, mode, round mode, narrow_range) on every range, inputs on ties and ends."""
    for tname in TYPES:
        for mode, rmode in COMBOS:
            for narrow in (False, True):
                for label, mn, mx in RANGES:
                    x = interesting_inputs(rng, mn, mx, tname, mode, narrow, 0.01)
                    add("QuantizeDequantize", f"grid:{label}", tname, mode, rmode, narrow, -1, 0.01,
                        {"inputs": x, "min": f32(mn), "max": f32(mx)})


def build_ensure_minimum_range(rng):
    for tname in ("quint8", "qint8", "qint32"):
        for mode, rmode in COMBOS:
            for emr, mn, mx in ((0.0, 0.001, 0.002), (0.0, -3e-5, 2e-5), (0.1, -0.2, 0.3), (1e-6, 0.0, 1e-7),
                                (0.5, -6.0, 6.0), (0.0, 0.0, 0.0), (0.0, -2.0, -1.0)):
                x = interesting_inputs(rng, mn, mx, tname, mode, False, emr)
                add("QuantizeDequantize", f"emr:{emr}", tname, mode, rmode, False, -1, emr,
                    {"inputs": x, "min": f32(mn), "max": f32(mx)})


def build_per_axis(rng):
    for tname in TYPES:
        for mode, rmode in COMBOS:
            if mode == "MIN_FIRST":
                continue
            for narrow in (False, True):
                for shape, axis in (((3, 5, 4), 1), ((6, 4), 1), ((4, 3, 2), 0), ((2, 3, 7), 2)):
                    depth = shape[axis]
                    kinds = [(-6.0, 6.0), (0.5, 3.0), (-4.0, -0.25), (-1.3, 5.7), (0.0, 0.0), (1e-3, 2e-3),
                             (-1000.0, 3000.0)]
                    pick = [kinds[(i + rng.integers(0, len(kinds))) % len(kinds)] for i in range(depth)]
                    mn = np.array([p[0] for p in pick], f32)
                    mx = np.array([p[1] for p in pick], f32)
                    x = rng.uniform(-8, 8, shape).astype(f32)
                    # place each slice's range ends into it
                    xm = np.moveaxis(x, axis, 0)
                    for c in range(depth):
                        flat = xm[c].reshape(-1)
                        flat[:4] = [mn[c], mx[c], 0.0, (mn[c] + mx[c]) / 2]
                        xm[c] = flat.reshape(xm[c].shape)
                    x = np.ascontiguousarray(np.moveaxis(xm, 0, axis))
                    add("QuantizeDequantize", f"axis:{shape}:{axis}", tname, mode, rmode, narrow, axis, 0.01,
                        {"inputs": x, "min": mn, "max": mx})
    # one slice on the axis: TensorFlow takes the per-tensor path (MIN_FIRST allowed, scalar output range)
    x = rng.uniform(-2, 2, (5, 1)).astype(f32)
    for mode, rmode in COMBOS:
        add("QuantizeDequantize", "axis:one-slice", "quint8", mode, rmode, False, 1, 0.01,
            {"inputs": x, "min": np.array([-1.0], f32), "max": np.array([1.0], f32)})


def build_notebook():
    np.random.seed(1515)
    x = np.sort(3 * np.random.randn(1000).astype(np.float32)).reshape([1, 1000])
    add("QuantizeDequantize", "notebook: tf.quantize(x, -6, 6, tf.quint8) + tf.dequantize", "quint8",
        "MIN_COMBINED", "HALF_AWAY_FROM_ZERO", False, -1, 0.01, {"inputs": x, "min": f32(-6), "max": f32(6)})
    for tname in ("qint8", "quint16", "qint32"):
        for mode, rmode in COMBOS:
            add("QuantizeDequantize", "notebook-data", tname, mode, rmode, False, -1, 0.01,
                {"inputs": x, "min": f32(-6), "max": f32(6)})


def build_dequantize(rng):
    """Dequantize alone, on arbitrary integers and ranges (not only QuantizeV2's output range)."""
    for tname, (_, npt, tmin, tmax) in TYPES.items():
        ints = np.concatenate([[tmin, tmin + 1, -1 if tmin < 0 else 1, 0, tmax - 1, tmax],
                               rng.integers(tmin, tmax, 40, endpoint=True)]).astype(npt)
        for mode in ("MIN_COMBINED", "MIN_FIRST", "SCALED"):
            for narrow in (False, True):
                for mn, mx in ((-6.0, 6.0), (-1.3, 5.7), (0.5, 3.0), (-2.0, -2.0), (-7.25, 0.0)):
                    add("Dequantize", "dequantize", tname, mode, "HALF_AWAY_FROM_ZERO", narrow, -1, 0.01,
                        {"inputs": ints, "min": f32(mn), "max": f32(mx)})
        q2 = rng.integers(tmin, tmax, (3, 4), endpoint=True).astype(npt)
        q2[0, :] = [tmin, tmax, tmax - 1, 0]  # the top of qint32 rounds to 2**31 as a float
        for mode in ("MIN_COMBINED", "SCALED"):
            add("Dequantize", "dequantize:axis", tname, mode, "HALF_AWAY_FROM_ZERO", False, 1, 0.01,
                {"inputs": q2, "min": np.array([-1, -2, 0.5, -3], f32), "max": np.array([1, 0.5, 3, -1], f32)})


def build_nan_packets(rng):
    """NaN inputs: Eigen's packet conversion to qint8/qint16 saturates (type minimum), its scalar tail gives 0;
    the HALF_TO_EVEN kernel only vectorises whole blocks of 32."""
    for tname in ("qint8", "qint16", "quint8", "qint32"):
        for mode, rmode in COMBOS:
            for n in (47, 70):
                x = rng.uniform(-8, 8, n).astype(f32)
                x[[0, 7, 8, 31, 32, 39, 40, n - 9, n - 1]] = np.nan
                add("QuantizeDequantize", f"nan-packets:{n}", tname, mode, rmode, False, -1, 0.01,
                    {"inputs": x, "min": f32(-6), "max": f32(6)})
            if mode != "MIN_FIRST":
                x = rng.uniform(-8, 8, (5, 9)).astype(f32)
                x[:, [0, 8]] = np.nan
                add("QuantizeDequantize", "nan-per-axis", tname, mode, rmode, False, 0, 0.01,
                    {"inputs": x, "min": np.full(5, -6, f32), "max": np.full(5, 6, f32)})


def build_errors(rng):
    x = rng.uniform(-3, 3, (3, 4)).astype(f32)
    for mode in ("MIN_COMBINED", "MIN_FIRST"):
        add("QuantizeDequantize", "error:half-to-even-needs-scaled", "quint8", mode, "HALF_TO_EVEN", False, -1,
            0.01, {"inputs": x, "min": f32(-1), "max": f32(1)})
    for tname in ("quint8", "qint32"):
        add("QuantizeDequantize", "error:min>max", tname, "MIN_COMBINED", "HALF_AWAY_FROM_ZERO", False, -1, 0.01,
            {"inputs": x, "min": f32(1), "max": f32(-1)})
    add("QuantizeDequantize", "error:min>max per axis", "qint8", "SCALED", "HALF_AWAY_FROM_ZERO", False, 1, 0.01,
        {"inputs": x, "min": np.array([-1, 2, -3, -4], f32), "max": np.array([1, 1, 3, 4], f32)})
    add("QuantizeDequantize", "error:min-first-per-axis", "quint8", "MIN_FIRST", "HALF_AWAY_FROM_ZERO", False, 1,
        0.01, {"inputs": x, "min": np.full(4, -1, f32), "max": np.full(4, 1, f32)})
    add("QuantizeDequantize", "error:axis-size", "quint8", "MIN_COMBINED", "HALF_AWAY_FROM_ZERO", False, 1, 0.01,
        {"inputs": x, "min": np.full(3, -1, f32), "max": np.full(3, 1, f32)})
    add("QuantizeDequantize", "error:axis-range", "quint8", "MIN_COMBINED", "HALF_AWAY_FROM_ZERO", False, 2, 0.01,
        {"inputs": x, "min": np.full(4, -1, f32), "max": np.full(4, 1, f32)})
    add("QuantizeDequantize", "error:vector-range-without-axis", "qint8", "SCALED", "HALF_AWAY_FROM_ZERO", False,
        -1, 0.01, {"inputs": x, "min": np.array([-1, -2], f32), "max": np.array([1, 2], f32)})
    add("QuantizeDequantize", "error:range-rank-2", "quint8", "MIN_COMBINED", "HALF_AWAY_FROM_ZERO", False, 1,
        0.01, {"inputs": x, "min": np.full((1, 4), -1, f32), "max": np.full((1, 4), 1, f32)})
    # TF accepts these and answers garbage (NaN outputs, or silently treats NaN as 0): qgcli refuses them.
    for mn, mx in ((-1.0, np.inf), (np.nan, 1.0), (-np.inf, 1.0), (-1.0, np.nan)):
        add("QuantizeDequantize", "tf-garbage:non-finite range", "quint8", "MIN_COMBINED", "HALF_AWAY_FROM_ZERO",
            False, -1, 0.01, {"inputs": x, "min": f32(mn), "max": f32(mx)})


def write_ds(g, name, arr):
    arr = np.asarray(arr)
    kw = dict(compression="gzip", compression_opts=4, shuffle=True) if arr.size > 4096 else {}
    g.create_dataset(name, data=arr, **kw)


def main():
    rng = np.random.default_rng(SEED)
    build_notebook()
    build_grid(rng)
    build_ensure_minimum_range(rng)
    build_per_axis(rng)
    build_dequantize(rng)
    build_nan_packets(rng)
    build_errors(rng)
    tmp = OUT + ".tmp"
    n_err = 0
    with h5py.File(tmp, "w", libver="latest") as f:  # compact groups: a smaller file
        f.attrs["tensorflow_version"] = tf.__version__
        f.attrs["generator"] = GENERATOR
        f.attrs["seed"] = SEED
        f.attrs["numpy_version"] = np.__version__
        f.attrs["cpu"] = platform.processor() or platform.machine()
        f.attrs["TF_ENABLE_ONEDNN_OPTS"] = os.environ["TF_ENABLE_ONEDNN_OPTS"]
        f.attrs["format"] = "one group per case; see the generator's docstring"
        for i, c in enumerate(CASES):
            a = c["arrays"]
            if c["op"] == "Dequantize":
                res = run_dequantize(a["inputs"], a["min"], a["max"], c["dtype"], c["mode"], c["narrow_range"],
                                     c["axis"])
            else:
                res = run_round_trip(a["inputs"], a["min"], a["max"], c["dtype"], c["mode"], c["round_mode"],
                                     c["narrow_range"], c["axis"], float(c["ensure_minimum_range"]))
            narrow = "_narrow" if c["narrow_range"] else ""
            name = f"{i:04d}_{c['op']}_{c['dtype']}_{c['mode']}_{c['round_mode']}{narrow}"
            g = f.create_group(name)
            for k in ("op", "description", "dtype", "mode", "round_mode", "narrow_range", "axis",
                      "ensure_minimum_range"):
                g.attrs[k] = c[k]
            for k, v in a.items():
                write_ds(g, k, v)
            if isinstance(res, tuple):
                g.attrs["error_type"], g.attrs["error"] = res
                n_err += 1
            else:
                for k, v in res.items():
                    write_ds(g, k, v)
    os.replace(tmp, OUT)
    print(f"wrote {len(CASES)} cases ({n_err} refused by TensorFlow) to {OUT}")


if __name__ == "__main__":
    main()
