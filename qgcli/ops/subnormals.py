"""x86 TensorFlow's flush-to-zero, as plain operators (NumPy arrays, CuPy arrays and float32 scalars alike).

Its own module because both the op definitions (:mod:`qgcli.ops.fake_quant`) and the blocked executor
(:mod:`qgcli.ops.blocked`), which the op definitions call, need it.
"""
import numpy as np

TINY = np.finfo(np.float32).tiny  # smallest normal float32, 2**-126


def flush_subnormals(a):
    """``a`` (float32) with subnormals replaced by zeros of the same sign, as x86 FTZ/DAZ does.

    A product with the mask (True -> 1.0, False -> 0.0): subnormals become signed zeros, everything else,
    NaN included, is unchanged.  Operators only, so it works on NumPy/CuPy arrays and float32 scalars.
    """
    return a * (abs(a) >= TINY)
