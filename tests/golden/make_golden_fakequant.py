#!/usr/bin/env python3
"""Generate ``tests/golden/fake_quant.h5``: golden cases for TensorFlow's six fake-quant ops.

The outputs come from a REAL TensorFlow (2.21, CPU, eager ``tf.raw_ops``).  TensorFlow is not a
dependency of qgcli; only this generator imports it.  Regenerate with (see README.md):

    python3 -m venv /tmp/tfvenv
    /tmp/tfvenv/bin/pip install tensorflow-cpu==2.21.0 h5py numpy ml_dtypes
    /tmp/tfvenv/bin/python tests/golden/make_golden_fakequant.py

The script is deterministic (fixed seed); the file layout is described in README.md.
"""
import os
import re
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import h5py  # noqa: E402
import tensorflow as tf  # noqa: E402

f32 = np.float32
RAW = tf.raw_ops
SEED = 20250521
INTRA_OP_THREADS = 2          # the reduction order of large sums may depend on the thread count
HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "fake_quant.h5")
GENERATOR = "tests/golden/make_golden_fakequant.py"

ARGS, ARGS_G = "FakeQuantWithMinMaxArgs", "FakeQuantWithMinMaxArgsGradient"
VARS, VARS_G = "FakeQuantWithMinMaxVars", "FakeQuantWithMinMaxVarsGradient"
PC, PC_G = "FakeQuantWithMinMaxVarsPerChannel", "FakeQuantWithMinMaxVarsPerChannelGradient"
ALL_OPS = (ARGS, ARGS_G, VARS, VARS_G, PC, PC_G)
SHORT = {ARGS: "args", ARGS_G: "args_grad", VARS: "vars", VARS_G: "vars_grad", PC: "pc", PC_G: "pc_grad"}
GRAD_OPS = (ARGS_G, VARS_G, PC_G)
VG_OUTS = ("backprops_wrt_input", "backprop_wrt_min", "backprop_wrt_max")

# ----------------------------------------------------------------------------------------------
# TensorFlow's own unit tests, tensorflow/core/kernels/fake_quant_ops_test.cc (QuantOpsTest),
# transcribed from the research notes (tf_semantics.md section 3.1).  A trailing True marks the
# tests that compare exactly (atol = rtol = 0).
# A/C: (name, num_bits, narrow, min, max, inputs[2,3], expected)
# B/D: (name, num_bits, narrow, min, max, inputs[2,3], dx mask[, min mask, max mask])
# E:   (name, num_bits, narrow, min[d], max[d], shape, inputs, expected)
# F:   (name, num_bits, narrow, min[d], max[d], shape, inputs, dx mask, dmin sources, dmax sources)
# ----------------------------------------------------------------------------------------------
UT_A = [
    ("WithArgsSymmetricRangeZeroInput_RegularRange", 8, False, -10, 10, [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], True),
    ("WithArgsSymmetricRangeZeroInput_NarrowRange", 8, True, -10, 10, [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], True),
    ("WithArgsNoNudging_RegularRange", 8, False, -10, 53.75, [-10.1, -10, -9.9, -9.75, 53.75, 53.8], [-10, -10, -10, -9.75, 53.75, 53.75]),
    ("WithArgsNoNudging_NarrowRange", 8, True, -10, 53.5, [-10.1, -10, -9.9, -9.75, 53.5, 53.6], [-10, -10, -10, -9.75, 53.5, 53.5]),
    ("WithArgsNudgedDown_RegularRange", 8, False, -0.1, 63.65, [-0.1, 0, 0.1, 0.25, 63.75, 63.8], [0, 0, 0, 0.25, 63.75, 63.75]),
    ("WithArgsNudgedDown_NarrowRange", 8, True, -0.1, 63.4, [-0.1, 0, 0.1, 0.25, 63.5, 63.6], [0, 0, 0, 0.25, 63.5, 63.5]),
    ("WithArgsNudgedUp_RegularRange", 8, False, -0.1275, 63.6225, [-0.26, -0.25, -0.24, 0, 63.5, 63.6], [-0.25, -0.25, -0.25, 0, 63.5, 63.5]),
    ("WithArgsNudgedUp_NarrowRange", 8, True, -0.1275, 63.3725, [-0.26, -0.25, -0.24, 0, 63.25, 63.3], [-0.25, -0.25, -0.25, 0, 63.25, 63.25]),
    ("WithArgsNudgedZeroIs255_RegularRange", 8, False, -63.65, 0.1, [-63.8, -63.75, -63.7, -63.5, 0, 0.1], [-63.75, -63.75, -63.75, -63.5, 0, 0]),
    ("WithArgsNudgedZeroIs255_NarrowRange", 8, True, -63.4, 0.1, [-63.6, -63.5, -63.4, -63.25, 0, 0.1], [-63.5, -63.5, -63.5, -63.25, 0, 0]),
    ("WithArgsNoNudging_4Bits_RegularRange", 4, False, -6, 1.5, [-6.1, -6, -5.9, -5.5, 1.5, 1.6], [-6, -6, -6, -5.5, 1.5, 1.5]),
    ("WithArgsNoNudging_4Bits_NarrowRange", 4, True, -6, 1, [-6.1, -6, -5.9, -5.5, 1, 1.1], [-6, -6, -6, -5.5, 1, 1]),
    ("WithArgsNudgedDown_4Bits_RegularRange", 4, False, -0.1, 7.4, [-0.1, 0, 0.1, 0.5, 7.5, 7.6], [0, 0, 0, 0.5, 7.5, 7.5]),
    ("WithArgsNudgedDown_4Bits_NarrowRange", 4, True, -0.1, 6.9, [-0.1, 0, 0.1, 0.5, 7, 7.1], [0, 0, 0, 0.5, 7, 7]),
    ("WithArgsNudgedUp_4Bits_RegularRange", 4, False, -0.4, 7.1, [-0.6, -0.5, -0.24, 0, 7, 7.1], [-0.5, -0.5, -0, 0, 7, 7]),
    ("WithArgsNudgedUp_4Bits_NarrowRange", 4, True, -0.4, 6.6, [-0.6, -0.5, -0.24, 0, 6.5, 6.6], [-0.5, -0.5, 0, 0, 6.5, 6.5]),
    ("WithArgsNudgedZeroIs15_4Bits_RegularRange", 4, False, -7.3, 0.2, [-7.6, -7.5, -7.4, -7.2, 0, 0.1], [-7.5, -7.5, -7.5, -7, 0, 0]),
    ("WithArgsNudgedZeroIs15_4Bits_NarrowRange", 4, True, -6.8, 0.2, [-7.1, -7, -6.9, -6.7, 0, 0.1], [-7, -7, -7, -6.5, 0, 0]),
    ("WithArgsNoNudging_2Bits_RegularRange", 2, False, -1, 0.5, [-1.1, -1, -0.9, -0.3, 0.1, 0.6], [-1, -1, -1, -0.5, 0, 0.5]),
    ("WithArgsNoNudging_2Bits_NarrowRange", 2, True, -1, 0, [-1.1, -1, -0.9, -0.3, 0, 0.1], [-1, -1, -1, -0.5, 0, 0]),
    ("WithArgsNudgedDown_2Bits_RegularRange", 2, False, -0.1, 1.4, [-0.2, 0.1, 0.7, 1, 1.3, 1.6], [0, 0, 0.5, 1, 1.5, 1.5]),
    ("WithArgsNudgedDown_2Bits_NarrowRange", 2, True, -0.1, 0.9, [-0.1, 0.1, 0.7, 0.9, 1, 1.1], [-0, 0, 0.5, 1, 1, 1]),
    ("WithArgsNudgedUp_2Bits_RegularRange", 2, False, -0.4, 1.1, [-0.6, -0.5, -0.24, 0, 1, 1.1], [-0.5, -0.5, 0, 0, 1, 1]),
    ("WithArgsNudgedUp_2Bits_NarrowRange", 2, True, -0.4, 0.6, [-0.6, -0.5, -0.24, 0, 0.5, 0.6], [-0.5, -0.5, -0, 0, 0.5, 0.5]),
]
UT_B = [
    ("WithArgsGradient_RegularRange", 8, False, -0.125, 63.625, [-0.26, -0.25, -0.24, 0, 63.5, 63.6], [0, 1, 1, 1, 1, 0]),
    ("WithArgsGradient_NarrowRange", 8, True, -0.125, 63.375, [-0.26, -0.25, -0.24, 0, 63.25, 63.3], [0, 1, 1, 1, 1, 0]),
    ("WithArgsGradient_4Bits_RegularRange", 4, False, -0.4, 7.1, [-0.6, -0.5, -0.4, 0, 7, 7.1], [0, 1, 1, 1, 1, 0]),
    ("WithArgsGradient_4Bits_NarrowRange", 4, True, -0.4, 6.6, [-0.6, -0.5, -0.4, 0, 6.5, 6.6], [0, 1, 1, 1, 1, 0]),
]
UT_C = [
    ("WithVars_ZeroMinAndMax", 8, False, 0, 0, [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]),
    ("WithVarsSymmetricRangeZeroInput_RegularRange", 8, False, -10, 10, [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], True),
    ("WithVarsSymmetricRangeZeroInput_NarrowRange", 8, True, -10, 10, [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], True),
    ("WithVarsNoNudging_RegularRange", 8, False, -10, 53.75, [-10.1, -10, -9.9, -9.75, 53.75, 53.8], [-10, -10, -10, -9.75, 53.75, 53.75]),
    ("WithVarsNoNudging_NarrowRange", 8, True, -10, 53.5, [-10.1, -10, -9.9, -9.75, 53.5, 53.6], [-10, -10, -10, -9.75, 53.5, 53.5]),
    ("WithVarsNudgedDown_RegularRange", 8, False, -0.1, 63.65, [-0.1, 0, 0.1, 0.25, 63.75, 63.8], [-0, 0, 0, 0.25, 63.75, 63.75]),
    ("WithVarsNudgedDown_NarrowRange", 8, True, -0.1, 63.4, [-0.1, 0, 0.1, 0.25, 63.5, 63.6], [-0, 0, 0, 0.25, 63.5, 63.5]),
    ("WithVarsNudgedUp_RegularRange", 8, False, -0.125, 63.625, [-0.26, -0.25, -0.24, 0, 63.5, 63.6], [-0.25, -0.25, -0.25, 0, 63.5, 63.5]),
    ("WithVarsNudgedUp_NarrowRange", 8, True, -0.125, 63.375, [-0.26, -0.25, -0.24, 0, 63.25, 63.3], [-0.25, -0.25, -0.25, 0, 63.25, 63.25]),
    ("WithVarsNudgedZeroIs255_RegularRange", 8, False, -63.65, 0.1, [-63.8, -63.75, -63.7, -63.5, 0, 0.1], [-63.75, -63.75, -63.75, -63.5, 0, 0]),
    ("WithVarsNudgedZeroIs255_NarrowRange", 8, True, -63.4, 0.1, [-63.6, -63.5, -63.4, -63.25, 0, 0.1], [-63.5, -63.5, -63.5, -63.25, 0, 0]),
    ("WithVarsNoNudging_4Bits_RegularRange", 4, False, -6, 1.5, [-6.1, -6, -5.9, -5.5, 1.5, 1.6], [-6, -6, -6, -5.5, 1.5, 1.5]),
    ("WithVarsNoNudging_4Bits_NarrowRange", 4, True, -6, 1, [-6.1, -6, -5.9, -5.5, 1, 1.1], [-6, -6, -6, -5.5, 1, 1]),
    ("WithVarsNudgedDown_4Bits_RegularRange", 4, False, -0.1, 7.4, [-0.1, 0, 0.1, 0.5, 7.5, 7.6], [-0, 0, 0, 0.5, 7.5, 7.5]),
    ("WithVarsNudgedDown_4Bits_NarrowRange", 4, True, -0.1, 6.9, [-0.1, 0, 0.1, 0.5, 7, 7.1], [-0, 0, 0, 0.5, 7, 7]),
    ("WithVarsNudgedUp_4Bits_RegularRange", 4, False, -0.4, 7.1, [-0.6, -0.5, -0.24, 0, 7, 7.1], [-0.5, -0.5, -0, 0, 7, 7]),
    ("WithVarsNudgedUp_4Bits_NarrowRange", 4, True, -0.4, 6.6, [-0.6, -0.5, -0.24, 0, 6.5, 6.6], [-0.5, -0.5, -0, 0, 6.5, 6.5]),
    ("WithVarsNudgedZero15_4Bits_RegularRange", 4, False, -7.3, 0.2, [-7.6, -7.5, -7.4, -7.2, 0, 0.1], [-7.5, -7.5, -7.5, -7, 0, 0]),
    ("WithVarsNudgedZero15_4Bits_NarrowRange", 4, True, -6.8, 0.2, [-7.1, -7, -6.9, -6.5, 0, 0.1], [-7, -7, -7, -6.5, 0, 0]),
]
UT_D = [
    ("WithVarsGradient_ZeroMinAndMax", 8, False, 0, 0, [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]),
    ("WithVarsGradient_RegularRange", 8, False, -0.125, 63.625, [-0.26, -0.25, -0.24, 0, 63.5, 63.6], [0, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1]),
    ("WithVarsGradient_NarrowRange", 8, True, -0.125, 63.375, [-0.26, -0.25, -0.24, 0, 63.25, 63.3], [0, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1]),
    ("WithVarsGradient_4Bits_RegularRange", 4, False, -0.4, 7.1, [-0.6, -0.5, -0.4, 0, 7, 7.1], [0, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1]),
    ("WithVarsGradient_4Bits_NarrowRange", 4, True, -0.4, 6.6, [-0.6, -0.5, -0.4, 0, 6.5, 6.6], [0, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1]),
]
UT_E = [
    ("WithVarsPerChannel_ZeroMinAndMax", 8, False, [0, 0, 0, 0], [0, 0, 0, 0], [4], [0, 0, 0, 0], [0, 0, 0, 0]),
    ("WithVarsPerChannelSymmetricRangeZeroInput_RegularRange", 8, False, [-10, -10, -10, -10], [10, 10, 10, 10], [4], [0, 0, 0, 0], [0, 0, 0, 0], True),
    ("WithVarsPerChannelSymmetricRangeZeroInput_NarrowRange", 8, True, [-10, -10, -10, -10], [10, 10, 10, 10], [4], [0, 0, 0, 0], [0, 0, 0, 0], True),
    ("WithVarsPerChannelDim1NudgedDown_RegularRange", 8, False, [-0.1, -0.1, -0.1, -0.1], [63.65, 63.65, 63.65, 63.65], [4], [-0.1, 0, 63.75, 63.8], [0, 0, 63.75, 63.75]),
    ("WithVarsPerChannelDim1NudgedDown_NarrowRange", 8, True, [-0.1, -0.1, -0.1, -0.1], [63.4, 63.4, 63.4, 63.4], [4], [-0.1, 0, 63.5, 63.6], [0, 0, 63.5, 63.5]),
    ("WithVarsPerChannelDim1NudgedUp_RegularRange", 8, False, [-0.125, -0.125, -0.125, -0.125], [63.625, 63.625, 63.625, 63.625], [4], [-0.26, -0.25, -0.24, 63.6], [-0.25, -0.25, -0.25, 63.5]),
    ("WithVarsPerChannelDim1NudgedUp_NarrowRange", 8, True, [-0.125, -0.125, -0.125, -0.125], [63.375, 63.375, 63.375, 63.375], [4], [-0.26, -0.25, -0.24, 63.3], [-0.25, -0.25, -0.25, 63.25]),
    ("WithVarsPerChannelDim2NudgedDown_RegularRange", 8, False, [-0.1, -0.1, -0.1], [63.65, 63.65, 63.65], [2, 3], [-0.1, 0, 0.1, 0.25, 63.75, 63.8], [-0, 0, 0, 0.25, 63.75, 63.75]),
    ("WithVarsPerChannelDim2NudgedDown_NarrowRange", 8, True, [-0.1, -0.1, -0.1], [63.4, 63.4, 63.4], [2, 3], [-0.1, 0, 0.1, 0.25, 63.5, 63.6], [0, 0, 0, 0.25, 63.5, 63.5]),
    ("WithVarsPerChannelDim2NudgedUp_RegularRange", 8, False, [-0.125, -0.125, -0.125], [63.625, 63.625, 63.625], [2, 3], [-0.26, -0.25, -0.24, 0, 63.5, 63.6], [-0.25, -0.25, -0.25, 0, 63.5, 63.5]),
    ("WithVarsPerChannelDim2NudgedUp_NarrowRange", 8, True, [-0.125, -0.125, -0.125], [63.375, 63.375, 63.375], [2, 3], [-0.26, -0.25, -0.24, 0, 63.25, 63.3], [-0.25, -0.25, -0.25, 0, 63.25, 63.25]),
    ("WithVarsPerChannelDim4NudgedDown_RegularRange", 8, False, [-0.1, -0.1, -0.1, -0.1], [63.65, 63.65, 63.65, 63.65], [1, 2, 3, 4], [-0.1, 0, 0.1, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.25, 63, 63.25, 63.5, 63.7, 63.75, 63.8, 63.9, 100, 100, 100, 100, 1000], [0, 0, 0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.25, 63, 63.25, 63.5, 63.75, 63.75, 63.75, 63.75, 63.75, 63.75, 63.75, 63.75, 63.75]),
    ("WithVarsPerChannelDim4NudgedDown_NarrowRange", 8, True, [-0.1, -0.1, -0.1, -0.1], [63.4, 63.4, 63.4, 63.4], [1, 2, 3, 4], [-0.1, 0, 0.1, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.25, 63, 63.25, 63.3, 63.4, 63.5, 63.6, 63.7, 100, 100, 100, 100, 1000], [0, 0, 0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.25, 63, 63.25, 63.25, 63.5, 63.5, 63.5, 63.5, 63.5, 63.5, 63.5, 63.5, 63.5]),
    ("WithVarsPerChannelDim4NudgedUp_RegularRange", 8, False, [-0.125, -0.125, -0.125, -0.125], [63.625, 63.625, 63.625, 63.625], [1, 2, 3, 4], [-0.3, -0.25, -0.2, 0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 63, 63.25, 63.4, 63.5, 63.6, 63.7, 100, 100, 100, 100, 100, 1000], [-0.25, -0.25, -0.25, 0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 63, 63.25, 63.5, 63.5, 63.5, 63.5, 63.5, 63.5, 63.5, 63.5, 63.5, 63.5]),
    ("WithVarsPerChannelDim4NudgedUp_NarrowRange", 8, True, [-0.125, -0.125, -0.125, -0.125], [63.375, 63.375, 63.375, 63.375], [1, 2, 3, 4], [-0.3, -0.25, -0.2, 0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 63, 63.2, 63.25, 63.3, 63.4, 63.5, 100, 100, 100, 100, 100, 1000], [-0.25, -0.25, -0.25, 0, 0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 63, 63.25, 63.25, 63.25, 63.25, 63.25, 63.25, 63.25, 63.25, 63.25, 63.25, 63.25]),
    ("WithVarsPerChannelDim1NudgedDown_4Bits_RegularRange", 4, False, [-0.1, -0.1, -0.1, -0.1], [7.4, 7.4, 7.4, 7.4], [4], [-0.1, 0, 7.5, 7.6], [0, 0, 7.5, 7.5]),
    ("WithVarsPerChannelDim1NudgedDown_4Bits_NarrowRange", 4, True, [-0.1, -0.1, -0.1, -0.1], [6.9, 6.9, 6.9, 6.9], [4], [-0.1, 0, 7, 7.1], [0, 0, 7, 7]),
    ("WithVarsPerChannelDim1NudgedUp_4Bits_RegularRange", 4, False, [-0.4, -0.4, -0.4, -0.4], [7.1, 7.1, 7.1, 7.1], [4], [-0.6, -0.5, 7, 7.1], [-0.5, -0.5, 7, 7]),
    ("WithVarsPerChannelDim1NudgedUp_4Bits_NarrowRange", 4, True, [-0.4, -0.4, -0.4, -0.4], [6.6, 6.6, 6.6, 6.6], [4], [-0.6, -0.5, 6.5, 6.6], [-0.5, -0.5, 6.5, 6.5]),
    ("WithVarsPerChannelDim2NudgedDown_4Bits_RegularRange", 4, False, [-0.1, -0.1, -0.1], [7.4, 7.4, 7.4], [2, 3], [-0.1, 0, 0.1, 0.5, 7.5, 7.6], [0, 0, 0, 0.5, 7.5, 7.5]),
    ("WithVarsPerChannelDim2NudgedDown_4Bits_NarrowRange", 4, True, [-0.1, -0.1, -0.1], [6.9, 6.9, 6.9], [2, 3], [-0.1, 0, 0.1, 0.5, 7, 7.1], [0, 0, 0, 0.5, 7, 7]),
    ("WithVarsPerChannelDim2NudgedUp_4Bits_RegularRange", 4, False, [-0.4, -0.4, -0.4], [7.1, 7.1, 7.1], [2, 3], [-0.51, -0.5, -0.24, 0, 7, 7.1], [-0.5, -0.5, 0, 0, 7, 7]),
    ("WithVarsPerChannelDim2NudgedUp_4Bits_NarrowRange", 4, True, [-0.4, -0.4, -0.4], [6.6, 6.6, 6.6], [2, 3], [-0.6, -0.5, -0.24, 0, 6.5, 6.6], [-0.5, -0.5, 0, 0, 6.5, 6.5]),
    ("WithVarsPerChannelDim4NudgedDown_4Bits_RegularRange", 4, False, [-0.1, -0.1, -0.1, -0.1], [7.4, 7.4, 7.4, 7.4], [1, 2, 3, 4], [-0.1, 0, 0.1, 0.5, 1, 1.5, 1.5, 2, 2.5, 3, 3.5, 4, 6, 6.5, 7, 7.4, 7.5, 7.7, 7.8, 100, 100, 100, 100, 1000], [0, 0, 0, 0.5, 1, 1.5, 1.5, 2, 2.5, 3, 3.5, 4, 6, 6.5, 7, 7.5, 7.5, 7.5, 7.5, 7.5, 7.5, 7.5, 7.5, 7.5]),
    ("WithVarsPerChannelDim4NudgedDown_4Bits_NarrowRange", 4, True, [-0.1, -0.1, -0.1, -0.1], [6.9, 6.9, 6.9, 6.9], [1, 2, 3, 4], [-0.1, 0, 0.1, 0.5, 1, 1.5, 1.5, 2, 2.5, 3, 3.5, 4, 6, 6.5, 6.8, 6.9, 7, 7.1, 7.2, 100, 100, 100, 100, 1000], [0, 0, 0, 0.5, 1, 1.5, 1.5, 2, 2.5, 3, 3.5, 4, 6, 6.5, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]),
    ("WithVarsPerChannelDim4NudgedUp_4Bits_RegularRange", 4, False, [-0.4, -0.4, -0.4, -0.4], [7.1, 7.1, 7.1, 7.1], [1, 2, 3, 4], [-0.6, -0.5, -0.4, 0, 0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 6, 6.5, 6.9, 7, 7.1, 7.7, 100, 100, 100, 100, 100, 1000], [-0.5, -0.5, -0.5, 0, 0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 6, 6.5, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]),
    ("WithVarsPerChannelDim4NudgedUp_4Bits_NarrowRange", 4, True, [-0.4, -0.4, -0.4, -0.4], [6.6, 6.6, 6.6, 6.6], [1, 2, 3, 4], [-0.6, -0.5, -0.4, 0, 0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 5.5, 6, 6.4, 6.5, 6.6, 6.7, 100, 100, 100, 100, 100, 1000], [-0.5, -0.5, -0.5, 0, 0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 5.5, 6, 6.5, 6.5, 6.5, 6.5, 6.5, 6.5, 6.5, 6.5, 6.5, 6.5]),
]
_D4 = [[0, 4, 8, 12, 16, 20], [], [], []]
_D4X = [[], [], [], [3, 7, 11, 15, 19, 23]]
_M4 = [0, 1, 1, 0] * 6
UT_F = [
    ("WithVarsPerChannelDim1GradientNudgedDown_ZeroMinAndMax", 8, False, [0, 0, 0, 0], [0, 0, 0, 0], [4], [0, 0, 0, 0], [1, 1, 1, 1], [[], [], [], []], [[], [], [], []]),
    ("WithVarsPerChannelDim1GradientNudgedDown_RegularRange", 8, False, [-0.1] * 4, [63.65] * 4, [4], [-0.1, 0, 63.75, 63.8], [0, 1, 1, 0], [[0], [], [], []], [[], [], [], [3]]),
    ("WithVarsPerChannelDim1GradientNudgedDown_NarrowRange", 8, True, [-0.1] * 4, [63.4] * 4, [4], [-0.1, 0, 63.5, 63.6], [0, 1, 1, 0], [[0], [], [], []], [[], [], [], [3]]),
    ("WithVarsPerChannelDim1GradientNudgedUp_RegularRange", 8, False, [-0.125] * 4, [63.625] * 4, [4], [-0.3, -0.25, 63.5, 63.6], [0, 1, 1, 0], [[0], [], [], []], [[], [], [], [3]]),
    ("WithVarsPerChannelDim1GradientNudgedUp_NarrowRange", 8, True, [-0.125] * 4, [63.375] * 4, [4], [-0.3, -0.25, 63.25, 63.3], [0, 1, 1, 0], [[0], [], [], []], [[], [], [], [3]]),
    ("WithVarsPerChannelDim2GradientNudgedDown_RegularRange", 8, False, [-0.1] * 3, [63.65] * 3, [2, 3], [-0.1, 0, 0.1, 0.25, 63.75, 63.8], [0, 1, 1, 1, 1, 0], [[0], [], []], [[], [], [5]]),
    ("WithVarsPerChannelDim2GradientNudgedDown_NarrowRange", 8, True, [-0.1] * 3, [63.4] * 3, [2, 3], [-0.1, 0, 0.1, 0.25, 63.5, 63.6], [0, 1, 1, 1, 1, 0], [[0], [], []], [[], [], [5]]),
    ("WithVarsPerChannelDim2GradientNudgedUp_RegularRange", 8, False, [-0.125] * 3, [63.625] * 3, [2, 3], [-0.3, -0.25, -0.2, 0, 63.5, 63.6], [0, 1, 1, 1, 1, 0], [[0], [], []], [[], [], [5]]),
    ("WithVarsPerChannelDim2GradientNudgedUp_NarrowRange", 8, True, [-0.125] * 3, [63.375] * 3, [2, 3], [-0.3, -0.25, -0.2, 0, 63.25, 63.3], [0, 1, 1, 1, 1, 0], [[0], [], []], [[], [], [5]]),
    ("WithVarsPerChannelDim4GradientNudgedDown_RegularRange", 8, False, [-0.1] * 4, [63.65] * 4, [1, 2, 3, 4], [-0.1, 0, 63.75, 63.8] * 6, _M4, _D4, _D4X),
    ("WithVarsPerChannelDim4GradientNudgedDown_NarrowRange", 8, True, [-0.1] * 4, [63.4] * 4, [1, 2, 3, 4], [-0.1, 0, 63.5, 63.6] * 6, _M4, _D4, _D4X),
    ("WithVarsPerChannelDim4GradientNudgedUp_RegularRange", 8, False, [-0.125] * 4, [63.625] * 4, [1, 2, 3, 4], [-0.3, -0.25, 63.5, 63.6] * 6, _M4, _D4, _D4X),
    ("WithVarsPerChannelDim4GradientNudgedUp_NarrowRange", 8, True, [-0.125] * 4, [63.375] * 4, [1, 2, 3, 4], [-0.3, -0.25, 63.25, 63.3] * 6, _M4, _D4, _D4X),
    ("WithVarsPerChannelDim1GradientNudgedDown_4Bits_RegularRange", 4, False, [-0.1] * 4, [7.4] * 4, [4], [-0.1, 0, 7.5, 7.6], [0, 1, 1, 0], [[0], [], [], []], [[], [], [], [3]]),
    ("WithVarsPerChannelDim1GradientNudgedDown_4Bits_NarrowRange", 4, True, [-0.1] * 4, [6.9] * 4, [4], [-0.1, 0, 7, 7.1], [0, 1, 1, 0], [[0], [], [], []], [[], [], [], [3]]),
    ("WithVarsPerChannelDim1GradientNudgedUp_4Bits_RegularRange", 4, False, [-0.4] * 4, [7.1] * 4, [4], [-0.6, -0.5, 7, 7.1], [0, 1, 1, 0], [[0], [], [], []], [[], [], [], [3]]),
    ("WithVarsPerChannelDim1GradientNudgedUp_4Bits_NarrowRange", 4, True, [-0.4] * 4, [6.6] * 4, [4], [-0.6, -0.5, 6.5, 6.6], [0, 1, 1, 0], [[0], [], [], []], [[], [], [], [3]]),
    ("WithVarsPerChannelDim2GradientNudgedDown_4Bits_RegularRange", 4, False, [-0.1] * 3, [7.4] * 3, [2, 3], [-0.1, 0, 0.1, 0.5, 7.5, 7.6], [0, 1, 1, 1, 1, 0], [[0], [], []], [[], [], [5]]),
    ("WithVarsPerChannelDim2GradientNudgedDown_4Bits_NarrowRange", 4, True, [-0.1] * 3, [6.9] * 3, [2, 3], [-0.1, 0, 0.1, 0.5, 7, 7.1], [0, 1, 1, 1, 1, 0], [[0], [], []], [[], [], [5]]),
    ("WithVarsPerChannelDim2GradientNudgedUp_4Bits_RegularRange", 4, False, [-0.4] * 3, [7.1] * 3, [2, 3], [-0.6, -0.5, -0.4, 0, 7, 7.1], [0, 1, 1, 1, 1, 0], [[0], [], []], [[], [], [5]]),
    ("WithVarsPerChannelDim2GradientNudgedUp_4Bits_NarrowRange", 4, True, [-0.4] * 3, [6.6] * 3, [2, 3], [-0.6, -0.5, -0.4, 0, 6.5, 6.6], [0, 1, 1, 1, 1, 0], [[0], [], []], [[], [], [5]]),
    ("WithVarsPerChannelDim4GradientNudgedDown_4Bits_RegularRange", 4, False, [-0.1] * 4, [7.4] * 4, [1, 2, 3, 4], [-0.1, 0, 7.5, 7.6] * 6, _M4, _D4, _D4X),
    ("WithVarsPerChannelDim4GradientNudgedDown_4Bits_NarrowRange", 4, True, [-0.1] * 4, [6.9] * 4, [1, 2, 3, 4], [-0.1, 0, 7, 7.1] * 6, _M4, _D4, _D4X),
    ("WithVarsPerChannelDim4GradientNudgedUp_4Bits_RegularRange", 4, False, [-0.4] * 4, [7.1] * 4, [1, 2, 3, 4], [-0.6, -0.5, 7, 7.1] * 6, _M4, _D4, _D4X),
    ("WithVarsPerChannelDim4GradientNudgedUp_4Bits_NarrowRange", 4, True, [-0.4] * 4, [6.6] * 4, [1, 2, 3, 4], [-0.6, -0.5, 6.5, 6.6] * 6, _M4, _D4, _D4X),
]

# tensorflow/compiler/tests/fake_quant_ops_test.py: _TestOp(min, max, num_bits, narrow_range,
# expected_nudged_min, expected_nudged_max, expected_step)  (section 3.2), plus the two cases
# proposed in the review threads of PRs #117965 / #124718 (zero point exactly on a .5 tie).
XLA_PARAMS = [
    ("with8BitsNoScalingNoNudging", 0.0, 255.0, 8, False, 0.0, 255.0, 1.0),
    ("with8BitsScalingAndNudgingDown", 0.5, 128.0, 8, False, 0.0, 127.5, 0.5),
    ("with8BitsScalingAndNudgingUp", -128.0, -0.5, 8, False, -127.5, 0.0, 0.5),
    ("with8BitsScalingAndNudgingBetween", -0.1, 127.4, 8, False, 0.0, 127.5, 0.5),
    ("with8BitsNarrowRangeNoScalingNoNudging", 0.0, 254.0, 8, True, 0.0, 254.0, 1.0),
    ("with8BitsNarrowRangeScalingAndNudgingDown", 0.1, 127.1, 8, True, 0.0, 127.0, 0.5),
    ("with8BitsNarrowRangeScalingAndNudgingUp", -127.1, -0.1, 8, True, -127.0, 0.0, 0.5),
    ("with8BitsNarrowRangeScalingAndNudgingBetween", -0.1, 126.9, 8, True, 0.0, 127.0, 0.5),
    ("with7BitsNoScalingNoNudging", 0.0, 127.0, 7, False, 0.0, 127.0, 1.0),
    ("with7BitsScalingAndNudgingDown", 0.5, 64.0, 7, False, 0.0, 63.5, 0.5),
    ("with7BitsScalingAndNudgingUp", -64.0, -0.5, 7, False, -63.5, 0.0, 0.5),
    ("with7BitsScalingAndNudgingBetween", -0.1, 63.4, 7, False, 0.0, 63.5, 0.5),
    ("with7BitsNarrowRangeNoScalingNoNudging", 0.0, 126.0, 7, True, 0.0, 126.0, 1.0),
    ("with7BitsNarrowRangeScalingAndNudgingDown", 0.1, 63.1, 7, True, 0.0, 63.0, 0.5),
    ("with7BitsNarrowRangeScalingAndNudgingUp", -63.1, -0.1, 7, True, -63.0, 0.0, 0.5),
    ("with7BitsNarrowRangeScalingAndNudgingBetween", -0.1, 62.9, 7, True, 0.0, 63.0, 0.5),
]
XLA_EXTRA = [
    ("with8BitsRoundingHalfWayZeroPoint", -1.0, 509.0, 8, False, -2.0, 508.0, 2.0),
    # [-0.75, 0.75]: zero_point_from_min = 127.5 -> 128 (ties away); nudged range from the kernel formula
    ("with8BitsSymmetricHalfWayZeroPoint_m075_075", -0.75, 0.75, 8, False, None, None, None),
]

SPECIALS = [0.0, -0.0, np.nan, np.inf, -np.inf, 1e-40, -1e-40, 1.4e-45, -1.4e-45,
            3.0e38, -3.0e38, 1e20, -1e20]

_TINY = f32(2.0) ** -126


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def _fz(v):
    v = f32(v)
    return f32(np.copysign(f32(0), v)) if abs(v) < _TINY else v


def nudge(mn, mx, num_bits, narrow):
    """float32 Nudge() of fake_quant_ops_functor.h (research notes section 1.3).

    Used only to PLACE inputs on interesting points (nudged bounds, grid points, half steps);
    the golden values themselves always come from TensorFlow.  Returns None for degenerate ranges."""
    qmin = 1 if narrow else 0
    qmax = (1 << num_bits) - 1
    mn, mx = _fz(mn), _fz(mx)
    with np.errstate(all="ignore"):
        scale = f32(f32(mx - mn) / f32(qmax - qmin))
        zpf = f32(f32(qmin) - f32(mn / scale))
    if not (np.isfinite(scale) and np.isfinite(zpf)) or scale <= 0:
        return None
    if zpf < qmin:
        zp = qmin
    elif zpf > qmax:
        zp = qmax
    else:
        zp = int(np.floor(np.float64(zpf) + 0.5))
    nmin = f32(f32(qmin - zp) * scale)
    nmax = f32(f32(qmax - zp) * scale)
    return dict(qmin=qmin, qmax=qmax, scale=scale, zpf=zpf, zp=zp, nmin=nmin, nmax=nmax)


def _up(v):
    return np.nextafter(f32(v), f32(np.inf))


def _dn(v):
    return np.nextafter(f32(v), f32(-np.inf))


def interesting_values(nd, rng, n_grid=6):
    """Nudged bounds and their float32 neighbours, exact grid points, half steps (and neighbours)."""
    if nd is None:
        return []
    vals = []
    for b in (nd["nmin"], nd["nmax"]):
        vals += [b, _up(b), _dn(b)]
    s = nd["scale"]
    s64 = np.float64(s)
    nmin64 = np.float64(nd["nmin"])
    qs = {nd["qmin"], nd["qmax"], nd["zp"], min(nd["zp"] + 1, nd["qmax"]), max(nd["zp"] - 1, nd["qmin"])}
    qs |= set(rng.integers(nd["qmin"], nd["qmax"] + 1, size=n_grid).tolist())
    with np.errstate(all="ignore"):
        for q in sorted(qs):
            k = q - nd["zp"]
            g1 = f32(f32(k) * s)                                   # the value TF outputs for grid point q
            g2 = f32(nmin64 + (q - nd["qmin"]) * s64)              # nudged_min + q*scale (rounded once)
            vals += [g1, _up(g1), _dn(g1), g2]
            if q < nd["qmax"]:
                h1 = f32((k + 0.5) * s64)                          # half step, rounded once
                h2 = f32(nmin64 + (q - nd["qmin"] + 0.5) * s64)
                h3 = f32((np.float64(g1) + np.float64(f32(f32(k + 1) * s))) / 2.0)  # midpoint of 2 outputs
                vals += [h1, _up(h1), _dn(h1), h2, _up(h2), _dn(h2), h3]
    return [f32(v) for v in vals if np.isfinite(v)]


def rand_shape(rng, rank, lo, hi, last=None):
    """Random shape of the given rank with lo <= prod(shape) <= hi (last dim fixed if given)."""
    for _ in range(10000):
        if last is None:
            maxd = max(2, int(round(hi ** (1.0 / rank))) * 2)
            dims = [int(rng.integers(1, maxd + 1)) for _ in range(rank)]
        else:
            if rank == 1:
                return [last]
            rows_hi = max(1, hi // last)
            rows_lo = max(1, -(-lo // last))
            maxd = max(2, int(round(rows_hi ** (1.0 / (rank - 1)))) * 2)
            dims = [int(rng.integers(1, maxd + 1)) for _ in range(rank - 1)] + [last]
            p = int(np.prod(dims[:-1]))
            if rows_lo <= p <= max(rows_hi, rows_lo):
                return dims
            continue
        if lo <= int(np.prod(dims)) <= hi:
            return dims
    raise RuntimeError("no shape found")


def fill_inputs(rng, shape, nds, mins, maxs, frac=0.6, specials=True):
    """Random normal inputs scaled to the range(s), with interesting values overwritten into a random
    subset of positions.  nds/mins/maxs are per channel (last axis) lists; a single entry = whole tensor."""
    x = np.empty(shape, f32)
    flat_rows = x.reshape(-1, len(nds))      # a view: per channel = last axis (or the whole tensor)
    rows = flat_rows.shape[0]
    for c, (nd, mn, mx) in enumerate(zip(nds, mins, maxs)):
        mn64, mx64 = np.float64(mn), np.float64(mx)
        if np.isfinite(mn64) and np.isfinite(mx64) and mx64 > mn64:
            mid, half = (mn64 + mx64) / 2, (mx64 - mn64) / 2
        else:
            mid, half = 0.0, max(1.0, abs(mn64) if np.isfinite(mn64) else 1.0)
        col = (mid + 1.3 * half * rng.standard_normal(rows)).astype(f32)
        cand = interesting_values(nd, rng)
        if specials:
            cand += [f32(v) for v in SPECIALS]
        if cand and rows:
            k = min(len(cand), max(1, int(round(rows * frac))))
            pos = rng.choice(rows, size=k, replace=False)
            pick = rng.choice(len(cand), size=k, replace=len(cand) < k)
            col[pos] = np.array(cand, f32)[pick]
        flat_rows[:, c] = col
    return x


def rand_grad(rng, shape, extra_specials=False):
    g = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-2, 2)).astype(f32)
    if extra_specials and g.size:
        n = g.size
        k = max(1, n // 20)
        idx = rng.choice(n, size=min(n, k), replace=False)
        g.flat[idx] = f32(rng.choice([1e-40, -1e-40, 1.4e-45, -0.0], size=len(idx)))
    return g


def clean_error(e):
    msg = str(e)
    msg = re.sub(r"^\{\{function_node [^}]*\}\}\s*", "", msg)
    msg = re.sub(r"\s*\[Op:[^\]]*\](\s*name:\s*\S*)?\s*$", "", msg)
    return msg.strip()


# ----------------------------------------------------------------------------------------------
# case container and TF runner
# ----------------------------------------------------------------------------------------------
CASES = []
_COUNTERS = {}


def add(family, op, num_bits, narrow, description, arrays, amin=None, amax=None, check=None):
    n = _COUNTERS.get(family, 0)
    _COUNTERS[family] = n + 1
    c = dict(name="%s_%04d" % (family, n), op=op, num_bits=int(num_bits), narrow_range=int(bool(narrow)),
             description=description, arrays={k: np.asarray(v, f32) for k, v in arrays.items()},
             check=check)
    if op in (ARGS, ARGS_G):
        c["min"], c["max"] = f32(amin), f32(amax)
    CASES.append(c)
    return c


def run_case(c):
    op, a = c["op"], c["arrays"]
    kw = dict(num_bits=c["num_bits"], narrow_range=bool(c["narrow_range"]))
    if op in (ARGS, ARGS_G):
        kw.update(min=float(c["min"]), max=float(c["max"]))
    if op in (PC, PC_G):
        # a rank-0 input aborts the whole process in eager mode (TF bug #117842); never run it
        assert a["inputs"].ndim >= 1, c["name"]
    fn = getattr(RAW, op)
    try:
        if op == ARGS:
            res = {"outputs": fn(inputs=a["inputs"], **kw)}
        elif op == ARGS_G:
            res = {"backprops": fn(gradients=a["gradients"], inputs=a["inputs"], **kw)}
        elif op in (VARS, PC):
            res = {"outputs": fn(inputs=a["inputs"], min=a["min"], max=a["max"], **kw)}
        else:
            t = fn(gradients=a["gradients"], inputs=a["inputs"], min=a["min"], max=a["max"], **kw)
            res = dict(zip(VG_OUTS, t))
        return {k: np.asarray(v.numpy()) for k, v in res.items()}, None
    except (tf.errors.OpError, ValueError, TypeError) as e:
        return None, (type(e).__name__, clean_error(e))


# ----------------------------------------------------------------------------------------------
# case builders
# ----------------------------------------------------------------------------------------------
def build_unit_tests(rng):
    for (name, bits, nar, mn, mx, inp, exp, *ex) in UT_A:
        add("unit_args", ARGS, bits, nar, "tf unit test QuantOpsTest." + name, {"inputs": np.reshape(inp, (2, 3))},
            mn, mx, check=dict(outputs=(np.reshape(exp, (2, 3)), bool(ex))))
    for (name, bits, nar, mn, mx, inp, mask) in UT_B:
        g = rand_grad(rng, (2, 3))
        add("unit_args_grad", ARGS_G, bits, nar, "tf unit test QuantOpsTest." + name + " (random upstream gradient)",
            {"gradients": g, "inputs": np.reshape(inp, (2, 3))}, mn, mx,
            check=dict(backprops=(g * np.reshape(mask, (2, 3)).astype(f32), False)))
    for (name, bits, nar, mn, mx, inp, exp, *ex) in UT_C:
        add("unit_vars", VARS, bits, nar, "tf unit test QuantOpsTest." + name,
            {"inputs": np.reshape(inp, (2, 3)), "min": mn, "max": mx},
            check=dict(outputs=(np.reshape(exp, (2, 3)), bool(ex))))
    for (name, bits, nar, mn, mx, inp, m_in, m_min, m_max) in UT_D:
        g = rand_grad(rng, (2, 3))
        add("unit_vars_grad", VARS_G, bits, nar, "tf unit test QuantOpsTest." + name + " (random upstream gradient)",
            {"gradients": g, "inputs": np.reshape(inp, (2, 3)), "min": mn, "max": mx},
            check=dict(backprops_wrt_input=(g * np.reshape(m_in, (2, 3)).astype(f32), False),
                       backprop_wrt_min=(np.sum(g.ravel() * np.array(m_min, f32)), False),
                       backprop_wrt_max=(np.sum(g.ravel() * np.array(m_max, f32)), False)))
    for (name, bits, nar, mn, mx, shape, inp, exp, *ex) in UT_E:
        add("unit_pc", PC, bits, nar, "tf unit test QuantOpsTest." + name,
            {"inputs": np.reshape(inp, shape), "min": mn, "max": mx},
            check=dict(outputs=(np.reshape(exp, shape), bool(ex))))
    for (name, bits, nar, mn, mx, shape, inp, m_in, s_min, s_max) in UT_F:
        g = rand_grad(rng, shape)
        gf = g.ravel()
        add("unit_pc_grad", PC_G, bits, nar, "tf unit test QuantOpsTest." + name + " (random upstream gradient)",
            {"gradients": g, "inputs": np.reshape(inp, shape), "min": mn, "max": mx},
            check=dict(backprops_wrt_input=(g * np.reshape(m_in, shape).astype(f32), False),
                       backprop_wrt_min=(np.array([np.sum(gf[i]) if i else 0 for i in s_min], f32), False),
                       backprop_wrt_max=(np.array([np.sum(gf[i]) if i else 0 for i in s_max], f32), False)))


def _xla_inputs(nmin, nmax, step):
    nmin, nmax, step = np.float64(nmin), np.float64(nmax), np.float64(step)
    x = [nmin - step, nmin - 0.01, nmin, nmin + 0.01, nmin + step - 0.01, nmin + step,
         nmin + step + 0.01, nmax - 0.01, nmax, nmax + 0.01, nmax + step]
    exp = [nmin] * 4 + [nmin + step] * 3 + [nmax] * 4
    return np.array(x, f32), np.array(exp, f32)


def build_xla_tests():
    g = np.arange(1, 12, dtype=f32)
    dx_exp = np.array([0, 0, 3, 4, 5, 6, 7, 8, 9, 0, 0], f32)
    params = []
    for p in XLA_PARAMS + XLA_EXTRA:
        name, mn, mx, bits, nar, enmin, enmax, step = p
        extra = p in XLA_EXTRA
        if enmin is None:
            nd = nudge(mn, mx, bits, nar)
            enmin, enmax, step = float(nd["nmin"]), float(nd["nmax"]), float(nd["scale"])
        x, exp = _xla_inputs(enmin, enmax, step)
        params.append((name, mn, mx, bits, nar, x, exp, extra))
        tag = ("proposed XLA test (PR #117965/#124718 review) " if extra else
               "tf XLA test fake_quant_ops_test.py testOp_") + name + " run through the regular CPU kernel"
        chk_f = None if extra else dict(outputs=(exp, "xla"))
        chk_g = None if extra else dict(backprops=(dx_exp * 1, "xla"))
        add("xla_args", ARGS, bits, nar, tag, {"inputs": x}, mn, mx, check=chk_f)
        add("xla_args_grad", ARGS_G, bits, nar, tag + " (g = 1..11)", {"gradients": g, "inputs": x}, mn, mx,
            check=chk_g)
        add("xla_vars", VARS, bits, nar, tag, {"inputs": x, "min": mn, "max": mx}, check=chk_f)
        add("xla_vars_grad", VARS_G, bits, nar, tag + " (g = 1..11)",
            {"gradients": g, "inputs": x, "min": mn, "max": mx},
            check=None if extra else dict(backprops_wrt_input=(dx_exp, "xla"), backprop_wrt_min=(f32(3), "xla"),
                                          backprop_wrt_max=(f32(21), "xla")))
    # the same parametrisations as channels of the per-channel ops, grouped by (num_bits, narrow)
    groups = {}
    for p in params[:len(XLA_PARAMS)]:
        groups.setdefault((p[3], p[4]), []).append(p)
    for (bits, nar), ps in sorted(groups.items()):
        x = np.stack([p[5] for p in ps], axis=1)
        exp = np.stack([p[6] for p in ps], axis=1)
        mins = [p[1] for p in ps]
        maxs = [p[2] for p in ps]
        desc = "tf XLA test parametrisations (%s) as channels of the per-channel op" % ", ".join(p[0] for p in ps)
        add("xla_pc", PC, bits, nar, desc, {"inputs": x, "min": mins, "max": maxs}, check=dict(outputs=(exp, "xla")))
        gg = np.tile(g[:, None], (1, len(ps)))
        add("xla_pc_grad", PC_G, bits, nar, desc + " (g = 1..11 per channel)",
            {"gradients": gg, "inputs": x, "min": mins, "max": maxs},
            check=dict(backprops_wrt_input=(np.tile(dx_exp[:, None], (1, len(ps))), "xla"),
                       backprop_wrt_min=(np.full(len(ps), 3, f32), "xla"),
                       backprop_wrt_max=(np.full(len(ps), 21, f32), "xla")))


def build_experiments():
    """Cases C1-C13 of the research notes (section 1.8) and the quirk examples of sections 1.3-1.6."""
    nan, inf = np.nan, np.inf
    add("exp_vars", VARS, 4, False, "experiment C1: zero point 2.5 on a .5 tie, 4 bits [-0.5, 2.5] (ties away -> 3)",
        {"inputs": [2.579, -0.6, 2.6], "min": -0.5, "max": 2.5})
    add("exp_args", ARGS, 4, False, "experiment C1 (Args): zero point 2.5 on a .5 tie, 4 bits [-0.5, 2.5]",
        {"inputs": [2.579, -0.6, 2.6]}, -0.5, 2.5)
    add("exp_args", ARGS, 2, False, "experiment C2: element ties round toward +inf, 2 bits [-1, 0.5]",
        {"inputs": [-0.75, -0.25, 0.25]}, -1.0, 0.5)
    x3 = [-0.15508615970611572]
    mn3, mx3 = -2.4014430046081543, 0.5279601812362671
    add("exp_args", ARGS, 8, False, "experiment C3: exact half step where Args (* inv_scale) and Vars (/ scale) differ",
        {"inputs": x3}, mn3, mx3)
    add("exp_vars", VARS, 8, False, "experiment C3: exact half step where Args (* inv_scale) and Vars (/ scale) differ",
        {"inputs": x3, "min": mn3, "max": mx3})
    add("exp_pc", PC, 8, False, "experiment C3: exact half step where Args (* inv_scale) and Vars (/ scale) differ",
        {"inputs": [x3], "min": [mn3], "max": [mx3]})
    add("exp_vars", VARS, 8, False, "experiment C4: input 0 maps to exactly 0 ([-25, 20])",
        {"inputs": [0.0], "min": -25.0, "max": 20.0})
    add("exp_vars_grad", VARS_G, 8, False, "experiment C5: gradient masks use the nudged range (nudged [0, 63.75])",
        {"gradients": [1, 2, 3, 4, 5], "inputs": [-0.05, 0.0, 63.7, 63.75, 63.76], "min": -0.1, "max": 63.65})
    add("exp_vars", VARS, 8, False, "experiment C6: min == max == 0 gives zeros, also for NaN input",
        {"inputs": [-1.0, 0.5, nan], "min": 0.0, "max": 0.0})
    add("exp_vars_grad", VARS_G, 8, False, "experiment C6: min == max == 0 passes the gradient through",
        {"gradients": [1, 2, 3], "inputs": [-1.0, 0.5, 9.0], "min": 0.0, "max": 0.0})
    add("exp_args_grad", ARGS_G, 8, False, "experiment C7: denormal inputs count as 0 in the masks (DAZ)",
        {"gradients": [1, 1], "inputs": [1e-45, -1e-45]}, -1.0, 0.0)
    add("exp_vars", VARS, 8, False, "experiment C7: max = 1e-39 is denormal -> treated as min == max == 0",
        {"inputs": [0.5, nan], "min": 0.0, "max": 1e-39})
    add("exp_args", ARGS, 8, False, "experiment C10: NaN propagates, +-inf clamp to the nudged bounds",
        {"inputs": [nan, inf, -inf]}, -1.0, 1.0)
    add("exp_args_grad", ARGS_G, 8, False, "experiment C10: NaN and +-inf inputs get zero gradient",
        {"gradients": [1, 1, 1], "inputs": [nan, inf, -inf]}, -1.0, 1.0)
    add("exp_args", ARGS, 8, False, "experiment C11: range not containing 0 (min > 0) is shifted, [12, 123]",
        {"inputs": [123.0]}, 12.0, 123.0)
    add("exp_args", ARGS, 2, False, "experiment C11: range not containing 0 (max < 0) is shifted, [-1.5, -0.5]",
        {"inputs": [-2.0, -1.2, -0.3, 1.0]}, -1.5, -0.5)
    add("exp_args", ARGS, 16, False, "experiment C12: op documentation example (16 bits, [-5, 5])",
        {"inputs": [10.03, -10.23, 3.0]}, -5.0, 5.0)
    add("exp_vars", VARS, 8, False, "experiment C12: op documentation example ([-0.5, 0.8])",
        {"inputs": [[1.2, -0.3, 0.7], [2.1, 0.5, -1.0]], "min": -0.5, "max": 0.8})
    add("exp_pc", PC, 8, False, "experiment C13: rank-5 per-channel input",
        {"inputs": np.zeros([1, 1, 1, 2, 3], f32) + f32(0.3), "min": [-1.0] * 3, "max": [1.0] * 3})
    add("exp_vars_grad", VARS_G, 8, False, "section 1.5: NaN/inf inputs in the Vars gradient, negative g (-0.0 outputs)",
        {"gradients": [-1, -2, -3, -4, -5, -6, -7, -8], "inputs": [-10, -7, 0, 7, 10, nan, inf, -inf],
         "min": -6.0, "max": 6.0})
    add("exp_vars", VARS, 8, False, "section 3.2 review-thread case: Vars(linspace(-0.8, 0.8, 5), -0.75, 0.75), zero point 127.5 -> 128",
        {"inputs": np.linspace(-0.8, 0.8, 5), "min": -0.75, "max": 0.75})
    add("exp_vars", VARS, 8, False, "zero point 127.5 on a tie: 8 bits [-1, 1] on [-1, 0, 1] (model-optimization #858)",
        {"inputs": [-1.0, 0.0, 1.0], "min": -1.0, "max": 1.0})
    add("exp_args", ARGS, 8, False, "zero point 127.5 on a tie: 8 bits [-1, 1] on [-1, 0, 1]",
        {"inputs": [-1.0, 0.0, 1.0]}, -1.0, 1.0)
    add("exp_vars", VARS, 8, False, "min = -1e-40 (denormal, flushed) with max = 1: nudged as [0, 1]",
        {"inputs": [-1.0, -1e-40, 0.0, 0.3, 1.0, nan], "min": -1e-40, "max": 1.0})
    add("exp_vars_grad", VARS_G, 8, False, "max = 1e-40 (denormal, flushed) with min = -1: nudged as [-1, 0]",
        {"gradients": [1, 2, 3, 4, 5, 6], "inputs": [-1.0, -1e-40, 0.0, 0.3, 1.0, nan], "min": -1.0, "max": 1e-40})
    add("exp_vars_grad", VARS_G, 8, False, "min = -1e-40, max = 1e-40: both denormal -> treated as min == max == 0",
        {"gradients": [1, 2, 3, 4, 5, 6], "inputs": [-1.0, -1e-40, 0.0, 0.3, 1.0, nan], "min": -1e-40, "max": 1e-40})
    add("exp_pc_grad", PC_G, 8, False, "per-channel: one channel min == max == 0 (pass-through), one denormal-zero, one normal",
        {"gradients": np.arange(1, 13, dtype=f32).reshape(4, 3),
         "inputs": [[-2.0, 0.5, -3.0], [0.1, nan, 0.0], [5.0, 1e-40, 2.0], [-0.0, -5.0, 1.01]],
         "min": [0.0, -1e-40, -1.0], "max": [0.0, 1e-40, 1.0]})


def build_garbage():
    """Vars / per-channel ranges TF accepts but for which it computes garbage (min > max, min == max != 0,
    NaN / infinite bounds).  qgcli refuses these; description starts with 'tf-garbage:'."""
    nan, inf = np.nan, np.inf
    x = np.array([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0], f32)
    g = np.arange(1, 8, dtype=f32)
    ranges = [
        (1.0, -1.0, 2, "min > max (experiment C9)"), (3.0, 2.0, 8, "min > max, both positive"),
        (0.5, -0.25, 4, "min > max"), (1.0, 1.0, 8, "min == max != 0 (experiment C9)"),
        (-1.0, -1.0, 8, "min == max != 0"), (0.25, 0.25, 3, "min == max != 0"),
        (nan, 1.0, 8, "NaN min"), (-1.0, nan, 8, "NaN max"), (-inf, 1.0, 8, "min = -inf"),
        (-1.0, inf, 8, "max = +inf"), (-inf, inf, 8, "min = -inf, max = +inf"),
    ]
    for mn, mx, bits, what in ranges:
        add("garbage_vars", VARS, bits, False, "tf-garbage: Vars with %s" % what, {"inputs": x, "min": mn, "max": mx})
        add("garbage_vars_grad", VARS_G, bits, False, "tf-garbage: VarsGradient with %s" % what,
            {"gradients": g, "inputs": x, "min": mn, "max": mx})
    xp = np.stack([x, x[::-1], x * 3], axis=1)
    gp = np.stack([g, -g, g * 0.5], axis=1)
    for mn, mx, bits, what in [(1.0, -1.0, 2, "min > max"), (2.0, 2.0, 8, "min == max != 0"),
                               (nan, 1.0, 8, "NaN min"), (-inf, 1.0, 8, "min = -inf")]:
        add("garbage_pc", PC, bits, True, "tf-garbage: PerChannel, channel 1 has %s (others valid)" % what,
            {"inputs": xp, "min": [-1.0, mn, 0.0], "max": [1.0, mx, 0.0]})
        add("garbage_pc_grad", PC_G, bits, True, "tf-garbage: PerChannelGradient, channel 1 has %s (others valid)" % what,
            {"gradients": gp, "inputs": xp, "min": [-1.0, mn, 0.0], "max": [1.0, mx, 0.0]})


def build_errors():
    x = np.array([[-1.0, 0.0, 0.5], [1.0, 2.0, -3.0]], f32)
    g = np.ones_like(x)
    pcm = dict(min=[-1.0, -1.0, -1.0], max=[1.0, 1.0, 1.0])
    for bits in (0, 1, 17):
        add("error_args", ARGS, bits, False, "num_bits = %d out of [2, 16]" % bits, {"inputs": x}, -1.0, 1.0)
        add("error_args_grad", ARGS_G, bits, False, "num_bits = %d out of [2, 16]" % bits,
            {"gradients": g, "inputs": x}, -1.0, 1.0)
        add("error_vars", VARS, bits, False, "num_bits = %d out of [2, 16]" % bits, {"inputs": x, "min": -1.0, "max": 1.0})
        add("error_vars_grad", VARS_G, bits, False, "num_bits = %d out of [2, 16]" % bits,
            {"gradients": g, "inputs": x, "min": -1.0, "max": 1.0})
        add("error_pc", PC, bits, False, "num_bits = %d out of [2, 16]" % bits, {"inputs": x, **pcm})
        add("error_pc_grad", PC_G, bits, False, "num_bits = %d out of [2, 16]" % bits, {"gradients": g, "inputs": x, **pcm})
    for mn, mx, what in [(1.0, 1.0, "min == max"), (2.0, 1.0, "min > max"), (0.0, 0.0, "min == max == 0"),
                         (np.nan, 1.0, "NaN min"), (-1.0, np.nan, "NaN max"),
                         (-1e-40, 0.0, "min = -1e-40 < max = 0, but equal after flushing denormals")]:
        add("error_args", ARGS, 8, False, "Args attrs with %s are rejected" % what, {"inputs": x}, mn, mx)
        add("error_args_grad", ARGS_G, 8, False, "ArgsGradient attrs with %s are rejected" % what,
            {"gradients": g, "inputs": x}, mn, mx)
    # shape validation (research notes sections 1.2 / 3.3; experiment C8)
    col = np.array([[1.0], [2.0], [4.0]], f32)
    add("error_vars", VARS, 8, False, "experiment C8c: min of rank 1", {"inputs": [0.0], "min": [0.0], "max": 1.0})
    add("error_vars", VARS, 8, False, "quantization_ops_test: max of rank 2", {"inputs": col, "min": 0.0, "max": col})
    add("error_vars_grad", VARS_G, 8, False, "quantization_ops_test: min/max of rank 2",
        {"gradients": col, "inputs": col, "min": col, "max": col})
    add("error_vars_grad", VARS_G, 8, False, "experiment C8e: gradients and inputs of different shapes",
        {"gradients": [1.0, 2.0], "inputs": [[1.0, 2.0]], "min": 0.0, "max": 1.0})
    add("error_args_grad", ARGS_G, 8, False, "experiment C8f: gradients and inputs of different shapes",
        {"gradients": [1.0, 2.0], "inputs": [[1.0, 2.0]]}, -6.0, 6.0)
    add("error_pc", PC, 8, False, "experiment C8d: len(min) != last dim",
        {"inputs": [[1.0], [2.0]], "min": [0.0, 0.1], "max": [1.0]})
    add("error_pc", PC, 8, False, "quantization_ops_test: len(max) != last dim",
        {"inputs": col, "min": [0.0], "max": [1.0, 1.1]})
    add("error_pc", PC, 8, False, "quantization_ops_test: min of rank 2", {"inputs": col, "min": [[0.0]], "max": [1.0]})
    add("error_pc_grad", PC_G, 8, False, "quantization_ops_test: len(min) != last dim",
        {"gradients": col, "inputs": col, "min": [0.0, 0.1], "max": [1.0]})
    add("error_pc_grad", PC_G, 8, False, "quantization_ops_test: max of rank 2",
        {"gradients": col, "inputs": col, "min": [1.0], "max": [[1.0]]})
    add("error_pc_grad", PC_G, 8, False, "gradients and inputs of different shapes",
        {"gradients": [[1.0, 2.0]], "inputs": [[1.0], [2.0]], "min": [0.0], "max": [1.0]})


RANGE_KINDS = ["sym", "asym0", "pos", "neg", "tiny", "huge", "tie", "zero", "edge0", "rand", "denorm"]


def rand_range(rng, kind, bits, narrow, allow_zero=True):
    """Return (min, max, words) for a range kind.  Args ops never get a zero/denormal-zero range."""
    u = rng.uniform
    if kind == "zero" and not allow_zero:
        kind = "tie"
    if kind == "sym":
        a = 10 ** u(-2, 2)
        return f32(-a), f32(a), "symmetric [-a, a]"
    if kind == "asym0":
        a = 10 ** u(-2, 2)
        return f32(-a * u(0.01, 1)), f32(a * u(0.01, 1)), "asymmetric, containing 0"
    if kind == "pos":
        a = 10 ** u(-2, 2)
        lo = a * u(0.01, 2)
        return f32(lo), f32(lo + a * u(0.1, 3)), "all positive (nudged to contain 0)"
    if kind == "neg":
        a = 10 ** u(-2, 2)
        hi = -a * u(0.01, 2)
        return f32(hi - a * u(0.1, 3)), f32(hi), "all negative (nudged to contain 0)"
    if kind == "tiny":
        w = 10 ** u(-6, -3)
        r = rng.integers(3)
        if r == 0:
            lo = -w * u(0, 1)
            words = "tiny width %.1e containing 0" % w
        elif r == 1:
            lo = u(-2, 2)
            words = "tiny width %.1e away from 0" % w
        else:
            lo = -w * u(0.3, 0.7) * 1e-3
            words = "tiny width %.1e, min close to 0" % w
        return f32(lo), f32(lo + w), words
    if kind == "huge":
        w = 10 ** u(4, 7)
        r = rng.integers(3)
        lo = [-w * u(0, 1), -w / 2, u(-1e7, 1e7)][r]
        return f32(lo), f32(lo + w), "huge width %.1e" % w
    if kind == "tie":
        qmin = 1 if narrow else 0
        qmax = (1 << bits) - 1
        s = f32(2.0) ** int(rng.integers(-12, 5))
        k = int(rng.integers(qmin, qmax))           # zero_point_from_min = k + 0.5
        mn = f32((qmin - k - 0.5) * np.float64(s))
        mx = f32(np.float64(mn) + (qmax - qmin) * np.float64(s))
        return mn, mx, "zero point exactly on a .5 tie (zp_from_min = %d.5)" % k
    if kind == "zero":
        return f32(0), f32(0), "min == max == 0"
    if kind == "edge0":
        a = 10 ** u(-2, 2)
        if rng.integers(2):
            return f32(0), f32(a), "min exactly 0"
        return f32(-a), f32(0), "max exactly 0"
    if kind == "denorm":
        r = rng.integers(4 if allow_zero else 2)
        if r == 0:
            return f32(-1e-40), f32(10 ** u(-2, 2)), "min denormal (flushed to 0)"
        if r == 1:
            return f32(-(10 ** u(-2, 2))), f32(1.4e-45), "max denormal (flushed to 0)"
        if r == 2:
            return f32(0), f32(1e-39), "min 0, max denormal: treated as min == max == 0"
        return f32(-1e-40), f32(1e-41), "both denormal: treated as min == max == 0"
    # rand
    a, b = sorted(rng.standard_normal(2) * 10 ** u(-1, 2))
    if a == b:
        b = a + 1
    return f32(a), f32(b), "random"


def describe_nd(nd):
    if nd is None:
        return "degenerate nudge"
    return "nudged [%r, %r], zp %d (zp_from_min %r)" % (float(nd["nmin"]), float(nd["nmax"]), nd["zp"], float(nd["zpf"]))


def build_random(rng, per_op=125):
    pc_dims = [1, 2, 3, 7, 16, 64, 512]
    for op in ALL_OPS:
        is_args = op in (ARGS, ARGS_G)
        combos = [(b, n) for b in range(2, 17) for n in (False, True)]
        extra = [(int(rng.integers(2, 17)), bool(rng.integers(2))) for _ in range(per_op - len(combos))]
        for i, (bits, nar) in enumerate(combos + extra):
            rank = 1 + i % 5
            kind = RANGE_KINDS[i % len(RANGE_KINDS)] if i < len(combos) else RANGE_KINDS[int(rng.integers(len(RANGE_KINDS)))]
            if is_args and kind == "zero":
                kind = "tie"
            nonfinite_g = op in GRAD_OPS and rng.random() < 0.06
            denorm_g = op in GRAD_OPS and rng.random() < 0.25
            if op in (PC, PC_G):
                d = pc_dims[i % len(pc_dims)] if i < len(combos) else pc_dims[int(rng.integers(len(pc_dims)))]
                if d >= 512:
                    shape = [1] * (rank - 1) + [d]
                elif d >= 64:
                    shape = rand_shape(rng, rank, d, 3 * d, last=d)
                else:
                    shape = rand_shape(rng, rank, max(d, 24), 192, last=d)
                mins, maxs, kinds = [], [], []
                for c in range(d):
                    k = kind if (c == 0 or rng.random() < 0.5) else RANGE_KINDS[int(rng.integers(len(RANGE_KINDS)))]
                    mn, mx, _ = rand_range(rng, k, bits, nar)
                    mins.append(mn)
                    maxs.append(mx)
                    kinds.append(k)
                nds = [nudge(a, b, bits, nar) for a, b in zip(mins, maxs)]
                x = fill_inputs(rng, shape, nds, mins, maxs)
                kc = {k: kinds.count(k) for k in sorted(set(kinds))}
                desc = ("random %s: %d channels, shape %s, range kinds per channel %s; inputs normal + nudged bounds "
                        "and neighbours, grid points, half steps, specials" % (op, d, shape, kc))
                arrays = {"inputs": x, "min": mins, "max": maxs}
            else:
                mn, mx, words = rand_range(rng, kind, bits, nar, allow_zero=not is_args)
                nd = nudge(mn, mx, bits, nar)
                shape = rand_shape(rng, rank, 24, 192)
                x = fill_inputs(rng, shape, [nd], [mn], [mx])
                desc = ("random %s: range %s [%r, %r], %s; shape %s; inputs normal + nudged bounds and neighbours, "
                        "grid points, half steps, specials" % (op, words, float(mn), float(mx), describe_nd(nd), shape))
                arrays = {"inputs": x}
                if not is_args:
                    arrays.update(min=mn, max=mx)
            if op in GRAD_OPS:
                gr = rand_grad(rng, shape, extra_specials=denorm_g)
                if denorm_g:
                    desc += "; upstream gradient has denormals / -0.0"
                if nonfinite_g:
                    idx = rng.choice(gr.size, size=min(gr.size, 3), replace=False)
                    gr.flat[idx] = np.array([np.nan, np.inf, -np.inf], f32)[: len(idx)]
                    desc += "; upstream gradient has NaN/+inf/-inf"
                arrays["gradients"] = gr
            if is_args:
                add("rand_" + SHORT[op], op, bits, nar, desc, arrays, mn, mx)
            else:
                add("rand_" + SHORT[op], op, bits, nar, desc, arrays)


def _big_inputs(rng, n_rows, nds, mins, maxs):
    """Large inputs drawn from a small pool of values (interesting points + random values) so the file
    compresses well; the upstream gradient has bfloat16-representable values (8 significant bits) with
    log-uniform magnitudes, so the float32 sums are inexact and their order matters."""
    d = len(nds)
    x = np.empty((n_rows, d), f32)
    for c in range(d):
        pool = interesting_values(nds[c], rng, n_grid=20)
        mid = (np.float64(mins[c]) + np.float64(maxs[c])) / 2
        half = (np.float64(maxs[c]) - np.float64(mins[c])) / 2
        pool += list((mid + 1.3 * half * rng.standard_normal(40)).astype(f32))
        pool += [f32(v) for v in SPECIALS]
        x[:, c] = np.array(pool, f32)[rng.integers(0, len(pool), size=n_rows)]
    mag = 10.0 ** rng.uniform(-4, 1, size=(n_rows, d))
    g = (rng.choice([-1.0, 1.0], size=(n_rows, d)) * mag).astype(f32)
    g = (g.view(np.uint32) & np.uint32(0xFFFF0000)).view(f32)
    return x, g


def build_big(rng):
    for n, bits, nar, mn, mx in [(8192, 8, False, -1.0, 1.0), (8193, 8, False, -0.7, 1.3), (20000, 4, True, -1.5, 2.0),
                                 (100000, 8, False, -2.0, 2.5)]:
        nd = nudge(mn, mx, bits, nar)
        x, g = _big_inputs(rng, n, [nd], [mn], [mx])
        add("big_vars_grad", VARS_G, bits, nar,
            "large VarsGradient, %d elements: backprop_wrt_min/max reduction order (Eigen tree split above 8192)" % n,
            {"gradients": g[:, 0], "inputs": x[:, 0], "min": mn, "max": mx})
    for shape, bits, nar in [((40000, 3), 8, False), ((9000, 5), 6, True), ((8193, 2), 8, False)]:
        d = shape[1]
        mins, maxs = [], []
        for c in range(d):
            mn, mx, _ = rand_range(rng, ["sym", "asym0", "tiny", "tie", "huge", "pos", "neg"][c % 7], bits, nar)
            mins.append(mn)
            maxs.append(mx)
        nds = [nudge(a, b, bits, nar) for a, b in zip(mins, maxs)]
        x, g = _big_inputs(rng, shape[0], nds, mins, maxs)
        add("big_pc_grad", PC_G, bits, nar,
            "large PerChannelGradient %s: per-channel backprop_wrt_min/max reduction order (strided, tree split)"
            % (list(shape),), {"gradients": g, "inputs": x, "min": mins, "max": maxs})
    # a large Vars forward and per-channel forward for good measure
    nd = nudge(-3.0, 5.0, 8, False)
    x, _ = _big_inputs(rng, 5000, [nd], [-3.0], [5.0])
    add("big_vars", VARS, 8, False, "large Vars forward, 5000 elements", {"inputs": x[:, 0], "min": -3.0, "max": 5.0})


# ----------------------------------------------------------------------------------------------
# sanity checks against the expectations of TF's own tests
# ----------------------------------------------------------------------------------------------
def check_expectations(c, res):
    if not c.get("check") or res is None:
        return True
    ok = True
    for k, (exp, mode) in c["check"].items():
        got = np.asarray(res[k], np.float64)
        exp = np.asarray(exp, np.float64)
        if mode == "xla":
            atol, rtol = 1e-5, 1e-3
        elif mode is True:
            atol = rtol = 0.0
        else:
            atol = rtol = 5 * float(np.finfo(f32).eps)
        if got.shape != exp.shape or not np.all(np.abs(got - exp) <= atol + rtol * np.abs(exp)):
            print("  EXPECTATION MISMATCH %s %s: got %s expected %s" % (c["name"], k, got.ravel()[:8], exp.ravel()[:8]))
            ok = False
    return ok


# ----------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------
def write_ds(g, name, arr):
    arr = np.asarray(arr)
    if arr.size >= 4096:
        g.create_dataset(name, data=arr, compression="gzip", compression_opts=9, shuffle=True, chunks=True,
                         track_times=False)
    else:
        g.create_dataset(name, data=arr, track_times=False)


def open_h5_deterministic(path):
    """A new HDF5 file (libver latest) whose bytes depend only on the content: no object timestamps."""
    fcpl = h5py.h5p.create(h5py.h5p.FILE_CREATE)
    fcpl.set_obj_track_times(False)
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
    return h5py.File(h5py.h5f.create(path.encode(), h5py.h5f.ACC_TRUNC, fcpl=fcpl, fapl=fapl))


def new_group(parent, name):
    gcpl = h5py.h5p.create(h5py.h5p.GROUP_CREATE)
    gcpl.set_obj_track_times(False)
    return h5py.Group(h5py.h5g.create(parent.id, name.encode(), gcpl=gcpl))


def main():
    tf.config.threading.set_intra_op_parallelism_threads(INTRA_OP_THREADS)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rng = np.random.default_rng(SEED)
    build_unit_tests(rng)
    build_xla_tests()
    build_experiments()
    build_garbage()
    build_errors()
    build_random(rng)
    build_big(rng)

    t0 = time.time()
    tmp = OUT + ".tmp"
    stats = {}
    n_bad = 0
    with open_h5_deterministic(tmp) as f:
        f.attrs["tensorflow_version"] = tf.__version__
        f.attrs["generator"] = GENERATOR
        f.attrs["seed"] = SEED
        f.attrs["intra_op_parallelism_threads"] = INTRA_OP_THREADS
        f.attrs["numpy_version"] = np.__version__
        f.attrs["cpu"] = _cpu_name()
        f.attrs["format"] = "one group per case; see tests/golden/README.md"
        for c in CASES:
            res, err = run_case(c)
            if not check_expectations(c, res):
                n_bad += 1
            g = new_group(f, c["name"])
            g.attrs["op"] = c["op"]
            g.attrs["num_bits"] = c["num_bits"]
            g.attrs["narrow_range"] = c["narrow_range"]
            g.attrs["description"] = c["description"]
            if c["op"] in (ARGS, ARGS_G):
                g.attrs["min"] = f32(c["min"])
                g.attrs["max"] = f32(c["max"])
            for k in ("gradients", "inputs", "min", "max"):
                if k in c["arrays"]:
                    write_ds(g, k, c["arrays"][k])
            if err is not None:
                g.attrs["error"] = err[1]
                g.attrs["error_type"] = err[0]
            else:
                for k, v in res.items():
                    assert v.dtype == np.float32, (c["name"], k, v.dtype)
                    write_ds(g, k, v)
            key = (c["op"], "error" if err else ("tf-garbage" if c["description"].startswith("tf-garbage:") else "ok"))
            stats[key] = stats.get(key, 0) + 1
    os.replace(tmp, OUT)
    print("wrote %s: %d cases, %.1f KiB, %.1f s" % (OUT, len(CASES), os.path.getsize(OUT) / 1024, time.time() - t0))
    for op in ALL_OPS:
        print("  %-45s ok %4d  tf-garbage %3d  error %3d" % (op, stats.get((op, "ok"), 0),
                                                          stats.get((op, "tf-garbage"), 0), stats.get((op, "error"), 0)))
    fams = {}
    for c in CASES:
        fam = c["name"].rsplit("_", 1)[0]
        fams[fam] = fams.get(fam, 0) + 1
    print("  families:", ", ".join("%s=%d" % kv for kv in sorted(fams.items())))
    if n_bad:
        print("WARNING: %d cases differ from the expectations of TF's own tests" % n_bad)
        return 1
    return 0


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
