"""The seeded run file the run-file benchmarks share: groups of per-channel fake-quant weights.

Each group ``step_0/block_BBB/layer_L/weight_quant`` is one FakeQuantWithMinMaxVarsPerChannel layer (8 bits)
holding a ``side`` x ``side`` float32 ``inputs``, its ``gradients`` and a range of 0.8x each channel's largest
magnitude.
"""
import h5py
import numpy as np


def make_weight_run(path, groups, *, side=64, seed=0):
    """Write the run file; returns each group's ``(gradients, inputs, min, max)``."""
    rng = np.random.default_rng(seed)
    arrays = []
    with h5py.File(path, "w") as f:
        for i in range(groups):
            w = rng.standard_normal((side, side)).astype(np.float32)
            hi = np.abs(w).max(axis=0).astype(np.float32) * 0.8
            gradients = (rng.standard_normal(w.shape) * 1e-2).astype(np.float32)
            g = f.create_group(f"step_0/block_{i // 10:03d}/layer_{i % 10}/weight_quant")
            g.attrs["op"] = "FakeQuantWithMinMaxVarsPerChannel"
            g.attrs["num_bits"] = 8
            for k, v in dict(inputs=w, min=-hi, max=hi, gradients=gradients).items():
                g[k] = v
            arrays.append((gradients, w, -hi, hi))
    return arrays
