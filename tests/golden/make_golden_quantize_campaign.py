#!/usr/bin/env python3
"""Generate ``tests/golden/quantize_campaign.npz``: TensorFlow's answers for 15,000 random QuantizeV2 +
Dequantize round trips and 7,000 random Dequantize cases, stored as digests.

The cases are drawn by :func:`draw_round_trip` / :func:`draw_dequantize` from ``np.random.default_rng((SEED,
index))`` (no TensorFlow needed, so the test draws the same cases); only 32-bit BLAKE2b digests of each
case's inputs and of TensorFlow's outputs are stored (``quantize.h5`` keeps full arrays for 839 hand-picked
cases).  A failing case is redrawn with its index and compared in full by hand.  Regenerate (~1 min) with:

    python3 -m venv /tmp/tfvenv
    /tmp/tfvenv/bin/pip install tensorflow-cpu==2.21.0 h5py numpy
    /tmp/tfvenv/bin/python tests/golden/make_golden_quantize_campaign.py

``TF_ENABLE_ONEDNN_OPTS=0`` as in ``make_golden_quantize.py``.  Inputs are at most 120 elements, far below
the ~20,000 where TensorFlow's NaN handling depends on its thread split.  Layout: ``round_trip`` and
``dequantize``, uint32 ``[cases, 2]`` (input digest, output digest; output digest 0 where TF refused).
"""
import hashlib
import os

import numpy as np

f32 = np.float32
SEED = 20250611
N_ROUND_TRIPS = 15_000
N_DEQUANTIZE = 7_000
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "quantize_campaign.npz")
TYPES = {"quint8": (np.uint8, 0, 255), "qint8": (np.int8, -128, 127), "quint16": (np.uint16, 0, 65535),
         "qint16": (np.int16, -32768, 32767), "qint32": (np.int32, -(2**31), 2**31 - 1)}
COMBOS = [("MIN_COMBINED", "HALF_AWAY_FROM_ZERO"), ("MIN_FIRST", "HALF_AWAY_FROM_ZERO"),
          ("SCALED", "HALF_AWAY_FROM_ZERO"), ("SCALED", "HALF_TO_EVEN")]
OUTPUT_KEYS = ("quantized", "output_min", "output_max", "outputs")


def digest(*arrays):
    """32-bit BLAKE2b of the arrays' dtypes, shapes and bytes (bit for bit: -0.0 differs from 0.0)."""
    h = hashlib.blake2b(digest_size=4)
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return int.from_bytes(h.digest(), "little")


def _range(rng):
    kind = rng.integers(0, 9)
    m = float(10.0 ** rng.uniform(-4, 4))
    if kind == 0:
        return -m, m
    if kind == 1:
        return -m * rng.uniform(0, 1), m * rng.uniform(0, 1)
    if kind == 2:  # all positive
        lo = m * rng.uniform(0, 1)
        return lo, lo + m * rng.uniform(1e-3, 1)
    if kind == 3:  # all negative
        hi = -m * rng.uniform(0, 1)
        return hi - m * rng.uniform(1e-3, 1), hi
    if kind == 4:  # tiny: ensure_minimum_range widens it
        lo = rng.uniform(-1, 1) * 1e-3
        return lo, lo + float(10.0 ** rng.uniform(-7, -3))
    if kind == 5:  # min or max exactly 0
        return (0.0, m) if rng.integers(0, 2) else (-m, 0.0)
    if kind == 6:  # equal ends
        v = rng.choice([0.0, m, -m])
        return v, v
    if kind == 7:  # the notebook's
        return -6.0, 6.0
    return -m * rng.uniform(0, 2), m * rng.uniform(0, 2)


def _inputs(rng, mn, mx, shape, tname):
    """Random values around the range, QuantizeV2's grid points and half steps (a float64 sketch of its
    scale) with their float32 neighbours, and special values."""
    _, tmin, tmax = TYPES[tname]
    lo, hi = min(0.0, mn), max(0.0, mx)
    width = max(hi - lo, 1e-3)
    n = int(np.prod(shape))
    x = rng.uniform(lo - 0.2 * width, hi + 0.2 * width, n)
    levels = min(tmax - tmin, 1 << 20)
    pick = rng.random(n)
    k = rng.integers(0, levels + 1, n) + np.where(pick < 0.5, 0.5, 0.0)
    x = np.where(pick < 0.6, lo + k * (hi - lo) / (tmax - tmin), x).astype(f32)
    step = rng.integers(-2, 3, n).astype(np.int64)  # float32 neighbours
    x = np.where(rng.random(n) < 0.3, np.nextafter(x, np.where(step > 0, f32(np.inf), f32(-np.inf))), x)
    specials = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, 1e-40, -1e-40, mn, mx, 3e38, -3e38], f32)
    where = rng.random(n) < 0.06
    x[where] = specials[rng.integers(0, len(specials), int(where.sum()))]
    return x.astype(f32).reshape(shape)


def draw_round_trip(index):
    """Case ``index``: ``(x, min, max, attrs)`` with ``attrs`` the keywords of ``qgcli.ops.quantize_dequantize``."""
    rng = np.random.default_rng((SEED, index))
    tname = list(TYPES)[rng.integers(0, 5)]
    mode, round_mode = COMBOS[rng.integers(0, 4)]
    narrow = bool(rng.integers(0, 2))
    emr = float(rng.choice([0.01, 0.01, 0.01, 0.01, 0.0, 1e-3, 0.5]))
    if mode != "MIN_FIRST" and rng.random() < 0.2:
        axis = int(rng.integers(0, 2))
        shape = (int(rng.integers(1, 6)), int(rng.integers(1, 20)))
        ranges = [_range(rng) for _ in range(shape[axis])]
        mn, mx = (np.array(r, f32) for r in zip(*ranges))
        parts = [_inputs(rng, float(a), float(b), (shape[1 - axis],), tname) for a, b in ranges]
        x = np.stack(parts, axis=axis)
    else:
        axis = None
        mn, mx = (f32(v) for v in _range(rng))
        x = _inputs(rng, float(mn), float(mx), (int(rng.integers(1, 121)),), tname)
    attrs = dict(dtype=tname, mode=mode, round_mode=round_mode, narrow_range=narrow, axis=axis,
                 ensure_minimum_range=emr)
    return x, mn, mx, attrs


def draw_dequantize(index):
    """Case ``index``: ``(q, min, max, attrs)`` with ``attrs`` the keywords of ``qgcli.ops.dequantize``."""
    rng = np.random.default_rng((SEED, N_ROUND_TRIPS + index))
    tname = list(TYPES)[rng.integers(0, 5)]
    npt, tmin, tmax = TYPES[tname]
    mode = ("MIN_COMBINED", "MIN_FIRST", "SCALED")[rng.integers(0, 3)]
    narrow = bool(rng.integers(0, 2))
    axis = int(rng.integers(0, 2)) if mode != "MIN_FIRST" and rng.random() < 0.2 else None
    shape = (int(rng.integers(1, 6)), int(rng.integers(1, 20))) if axis is not None else (int(rng.integers(1, 121)),)
    q = rng.integers(tmin, tmax, shape, endpoint=True, dtype=np.int64)
    ends = rng.random(shape) < 0.1
    q[ends] = rng.choice([tmin, tmin + 1, 0, tmax - 1, tmax], int(ends.sum()))
    q = q.astype(npt)
    if axis is None:
        mn, mx = (f32(v) for v in _range(rng))
    else:
        mn, mx = (np.array(r, f32) for r in zip(*[_range(rng) for _ in range(shape[axis])]))
    return q, mn, mx, dict(dtype=tname, mode=mode, narrow_range=narrow, axis=axis)


def main():
    os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import make_golden_quantize as golden  # imports TensorFlow

    round_trips = np.zeros((N_ROUND_TRIPS, 2), np.uint32)
    for i in range(N_ROUND_TRIPS):
        x, mn, mx, a = draw_round_trip(i)
        res = golden.run_round_trip(x, mn, mx, a["dtype"], a["mode"], a["round_mode"], a["narrow_range"],
                                    -1 if a["axis"] is None else a["axis"], a["ensure_minimum_range"])
        out = 0 if isinstance(res, tuple) else digest(*(res[k] for k in OUTPUT_KEYS))
        round_trips[i] = digest(x, mn, mx), out
    dequantize = np.zeros((N_DEQUANTIZE, 2), np.uint32)
    for i in range(N_DEQUANTIZE):
        q, mn, mx, a = draw_dequantize(i)
        res = golden.run_dequantize(q, mn, mx, a["dtype"], a["mode"], a["narrow_range"],
                                    -1 if a["axis"] is None else a["axis"])
        dequantize[i] = digest(q, mn, mx), 0 if isinstance(res, tuple) else digest(res["outputs"])
    np.savez(OUT, round_trip=round_trips, dequantize=dequantize,
             tensorflow_version=np.array(golden.tf.__version__), seed=np.array(SEED))
    print("wrote", OUT, "refused by TF:", int((round_trips[:, 1] == 0).sum()), int((dequantize[:, 1] == 0).sum()))


if __name__ == "__main__":
    main()
