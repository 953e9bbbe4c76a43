#!/usr/bin/env python
"""TensorFlow doing what one qgcli command does: load an HDF5 bundle, run the op, save the outputs as HDF5.

The baseline that ``bench_cli.sh`` times against ``qgcli fakequant-grad`` and ``qgcli bn-grad``; run it
with an interpreter that has TensorFlow and h5py (e.g. a throwaway venv)::

    python benchmarks/tf_load_op_save.py fakequant-grad BUNDLE.h5 OUT.h5 [--num-bits 8]
    python benchmarks/tf_load_op_save.py bn-grad BUNDLE.h5 OUT.h5 [--epsilon 1e-3]

Datasets are read and written under TensorFlow's operand and output names, as qgcli does; rank-1
``min``/``max`` select the per-channel op, scalars the per-tensor (Vars) one.  The outputs are plain
(uncompressed, unchunked) datasets.  Intra-op threads: the CPU count, TensorFlow's own default.
"""
import argparse
import os
import sys


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["fakequant-grad", "bn-grad"])
    p.add_argument("bundle")
    p.add_argument("output")
    p.add_argument("--num-bits", type=int, default=8)
    p.add_argument("--epsilon", type=float, default=1e-4)  # qgcli bn-grad's default
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args(argv)

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import h5py
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    raw = tf.raw_ops
    with h5py.File(args.bundle, "r") as f:
        d = {k: f[k][()] for k in f.keys()}
    if args.command == "fakequant-grad":
        mn, mx = np.asarray(d["min"], np.float32), np.asarray(d["max"], np.float32)
        op = raw.FakeQuantWithMinMaxVarsPerChannelGradient if mn.ndim == 1 else raw.FakeQuantWithMinMaxVarsGradient
        out = op(gradients=d["gradients"], inputs=d["inputs"], min=mn, max=mx, num_bits=args.num_bits)
        names = ["backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max"]
    else:
        out = raw.FusedBatchNormGradV3(
            y_backprop=d["y_backprop"], x=d["x"], scale=d["scale"], reserve_space_1=d["reserve_space_1"],
            reserve_space_2=d["reserve_space_2"], reserve_space_3=tf.zeros([0], tf.float32),
            epsilon=args.epsilon, data_format="NHWC", is_training=True)[:3]
        names = ["x_backprop", "scale_backprop", "offset_backprop"]
    with h5py.File(args.output, "w") as f:
        for name, t in zip(names, out):
            f.create_dataset(name, data=t.numpy())
    return 0


if __name__ == "__main__":
    sys.exit(main())
