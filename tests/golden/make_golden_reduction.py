"""Golden sums for large fake-quant gradients, where Eigen shards the reduction across threads.

Run with a real TensorFlow 2.21 (2 intra-op threads, as on the 2-core machines this project targets):

    /tmp/tfvenv/bin/python tests/golden/make_golden_reduction.py   # writes tests/golden/reduction.json

Inputs are not stored: they come from exact integer formulas (:func:`make_inputs`, shared with the test),
so only TensorFlow's backprop_wrt_min/max are kept, as float32 bit patterns.
"""
import json
import os

import numpy as np

FLAT_SIZES = [8193, 50149, 50151, 65537, 100003, 262147, 1000001]
CHANNEL_SHAPES = [(44799, 4), (44801, 4), (65537, 16), (100003, 3), (20001, 64)]


def make_inputs(n, depth=1):
    """Deterministic float32 (gradients, inputs) of shape [n, depth] with a wide dynamic range.

    Integer hashing then exact scaling by powers of two: identical on every platform.
    """
    i = np.arange(n * depth, dtype=np.uint64)
    h = (i * np.uint64(2654435761)) % np.uint64(2**32)
    unit = h.astype(np.float64) / 2.0**32 - 0.5  # exact in float64, rounded once to float32 below
    g = np.ldexp(unit, ((i * np.uint64(7)) % np.uint64(24)).astype(np.int64) - 12).astype(np.float32)
    x = (((i * np.uint64(40503)) % np.uint64(7)).astype(np.float32) - 3.0)  # -3..3 against the range [-1, 1]
    shape = (n,) if depth == 1 else (n, depth)
    return g.reshape(shape), x.reshape(shape)


def main():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(2)
    bits = lambda a: np.asarray(a, np.float32).reshape(-1).view(np.uint32).tolist()
    cases = []
    for n in FLAT_SIZES:
        g, x = make_inputs(n)
        _, dmin, dmax = tf.raw_ops.FakeQuantWithMinMaxVarsGradient(gradients=g, inputs=x, min=-1.0, max=1.0)
        cases.append({"op": "FakeQuantWithMinMaxVarsGradient", "rows": n, "depth": 1,
                      "backprop_wrt_min": bits(dmin), "backprop_wrt_max": bits(dmax)})
    for n, d in CHANNEL_SHAPES:
        g, x = make_inputs(n, d)
        mn, mx = -np.ones(d, np.float32), np.ones(d, np.float32)
        _, dmin, dmax = tf.raw_ops.FakeQuantWithMinMaxVarsPerChannelGradient(gradients=g, inputs=x, min=mn, max=mx)
        cases.append({"op": "FakeQuantWithMinMaxVarsPerChannelGradient", "rows": n, "depth": d,
                      "backprop_wrt_min": bits(dmin), "backprop_wrt_max": bits(dmax)})
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reduction.json")
    with open(path, "w") as fh:
        json.dump({"tensorflow_version": tf.__version__, "intra_op_threads": 2, "cases": cases}, fh, indent=1)
    print("wrote", path, len(cases), "cases")


if __name__ == "__main__":
    main()
