"""Golden sums for large fake-quant gradients, where Eigen shards the reduction across threads.

Run with a real TensorFlow 2.21:

    /tmp/tfvenv/bin/python tests/golden/make_golden_reduction.py   # writes reduction.json, reduction_threads.json

``reduction.json``: TF with 2 intra-op threads (as on the 2-core machines this project targets).  The flat
sizes around 50,150 values bracket the point where Eigen's cost model starts to shard a flat vector over two
threads (``COST_PER_VALUE["flat"]`` in ``qgcli/ops/reduction.py``): 49,800 and 50,100 are summed in one piece,
50,500 / 51,000 / 52,499 in two, and their bits differ between the two orders, so a wrong cost constant
(4.0, 4.1 or 4.2 instead of 4.1875) fails the test.  (50,149 / 50,151 give the same bits either way.)

``reduction_threads.json``: the same inputs reduced by TF with 1, 4 and 8 intra-op threads, each in its own
process (``tf.config.threading.set_intra_op_parallelism_threads`` must come before TF's first op); qgcli
reproduces them when told TF's thread count with ``QGCLI_TF_THREADS``.

Inputs are not stored: they come from exact integer formulas (:func:`make_inputs`, shared with the test),
so only TensorFlow's backprop_wrt_min/max are kept, as float32 bit patterns.
"""
import json
import os
import subprocess
import sys

import numpy as np

FLAT_SIZES = [8193, 49800, 50100, 50149, 50151, 50500, 51000, 52499, 65537, 100003, 262147, 1000001]
CHANNEL_SHAPES = [(44799, 4), (44801, 4), (65537, 16), (100003, 3), (20001, 64)]
# Other thread counts: sizes where 1, 2, 3, 4 ... 8 shards are used (flat: (n * 4.1875 - 1e5) / 1e5 + 0.9).
THREAD_COUNTS = [1, 4, 8]
THREAD_FLAT_SIZES = [20001, 65537, 100003, 150001, 262147, 1000001]
THREAD_CHANNEL_SHAPES = [(44801, 4), (100003, 3), (200003, 2)]
HERE = os.path.dirname(os.path.abspath(__file__))


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


def tf_cases(threads, flat_sizes, channel_shapes):
    """Run TF (imported here, in this process) with ``threads`` intra-op threads on every size."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    bits = lambda a: np.asarray(a, np.float32).reshape(-1).view(np.uint32).tolist()
    cases = []
    for n in flat_sizes:
        g, x = make_inputs(n)
        _, dmin, dmax = tf.raw_ops.FakeQuantWithMinMaxVarsGradient(gradients=g, inputs=x, min=-1.0, max=1.0)
        cases.append({"op": "FakeQuantWithMinMaxVarsGradient", "rows": n, "depth": 1,
                      "backprop_wrt_min": bits(dmin), "backprop_wrt_max": bits(dmax)})
    for n, d in channel_shapes:
        g, x = make_inputs(n, d)
        mn, mx = -np.ones(d, np.float32), np.ones(d, np.float32)
        _, dmin, dmax = tf.raw_ops.FakeQuantWithMinMaxVarsPerChannelGradient(gradients=g, inputs=x, min=mn, max=mx)
        cases.append({"op": "FakeQuantWithMinMaxVarsPerChannelGradient", "rows": n, "depth": d,
                      "backprop_wrt_min": bits(dmin), "backprop_wrt_max": bits(dmax)})
    return tf.__version__, cases


def worker(threads):
    version, cases = tf_cases(threads, THREAD_FLAT_SIZES, THREAD_CHANNEL_SHAPES)
    for case in cases:
        case["intra_op_threads"] = threads
    json.dump({"tensorflow_version": version, "cases": cases}, sys.stdout)


def main():
    runs = []
    for threads in THREAD_COUNTS:  # before this process imports TF; each count needs a fresh TF
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", str(threads)],
                             check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out))
    version, cases = tf_cases(2, FLAT_SIZES, CHANNEL_SHAPES)
    assert all(run["tensorflow_version"] == version for run in runs)
    path = os.path.join(HERE, "reduction.json")
    with open(path, "w") as fh:
        json.dump({"tensorflow_version": version, "intra_op_threads": 2, "cases": cases}, fh, indent=1)
    print("wrote", path, len(cases), "cases")
    path = os.path.join(HERE, "reduction_threads.json")
    cases = [case for run in runs for case in run["cases"]]
    with open(path, "w") as fh:
        json.dump({"tensorflow_version": version, "intra_op_threads": THREAD_COUNTS, "cases": cases}, fh, indent=1)
    print("wrote", path, len(cases), "cases")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]))
    else:
        main()
