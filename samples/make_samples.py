"""Make the small sample tensors used by the README and the tests (seeded, deterministic).

    python samples/make_samples.py          # rewrites samples/*.h5 in place
"""
import os

import h5py
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def write(name, attrs=None, **datasets):
    path = os.path.join(HERE, name)
    with h5py.File(path, "w") as f:
        for key, value in (attrs or {}).items():
            f.attrs[key] = value
        for key, value in datasets.items():
            f.create_dataset(key, data=value)
    print("wrote", path)


def notebook():
    """The tutorial notebook's data: x = sort(3 * randn(1000)) as float32 [1, 1000], range [-6, 6].

    As in the notebook, the upstream gradient fed to FakeQuantWithMinMaxVarsGradient is the forward
    output itself (2 bits: the levels -8, -4, 0, 4).
    """
    from qgcli.ops import fake_quant_with_min_max_vars

    np.random.seed(1515)
    x = np.sort(3 * np.random.randn(1000).astype(np.float32)).reshape([1, 1000])
    mn, mx = np.float32(-6.0), np.float32(6.0)
    gradients = fake_quant_with_min_max_vars(x, mn, mx, num_bits=2)
    write("notebook.h5", {"description": "04_Custom_Gradients notebook data, seed 1515"},
          inputs=x, min=mn, max=mx, gradients=gradients)


def per_channel():
    """Activations [b, h, w, d] = [4, 8, 8, 16] with per-channel ranges; some channels clip hard."""
    rng = np.random.default_rng(2024)
    b, h, w, d = 4, 8, 8, 16
    spread = np.linspace(0.2, 3.0, d).astype(np.float32)
    x = (rng.standard_normal((b, h, w, d)) * spread + np.linspace(-0.5, 0.5, d)).astype(np.float32)
    lo = np.percentile(x, 1.0, axis=(0, 1, 2)).astype(np.float32)
    hi = np.percentile(x, 99.0, axis=(0, 1, 2)).astype(np.float32)
    # Channels 3, 7 and 12 got a range calibrated on other data: far too narrow, they clip a lot.
    for c in (3, 7, 12):
        lo[c], hi[c] = lo[c] / 4, hi[c] / 4
    gradients = (rng.standard_normal((b, h, w, d)) * 0.01).astype(np.float32)
    write("per_channel.h5", {"description": "per-channel activations [4, 8, 8, 16] with gradients"},
          inputs=x, min=lo, max=hi, gradients=gradients)


def batch_norm():
    """A batch-norm layer's saved tensors, NHWC [8, 6, 6, 12], as TF's CPU forward leaves them (epsilon 1e-4).

    ``reserve_space_1/2`` are the batch mean and *biased* variance (TF's CPU convention); ``inv_std`` is
    what a cuDNN forward saves instead (1/sqrt(var + 1e-4)), ``batch_variance`` the Bessel-corrected
    output; ``moving_mean``/``moving_variance`` are population statistics for ``--no-is-training``.
    """
    rng = np.random.default_rng(3)
    n, h, w, c = 8, 6, 6, 12
    x = (rng.standard_normal((n, h, w, c)) * np.linspace(0.3, 2.5, c) + np.linspace(-1.0, 2.0, c))
    x = x.astype(np.float32)
    y_backprop = (rng.standard_normal((n, h, w, c)) * 0.05).astype(np.float32)
    x64 = x.astype(np.float64)
    mean = x64.mean(axis=(0, 1, 2))
    var = x64.var(axis=(0, 1, 2))
    count = n * h * w
    write("batch_norm.h5", {"description": "batch-norm layer tensors [8, 6, 6, 12] NHWC, epsilon 1e-4", "epsilon": 1e-4,
                            "data_format": "NHWC"},
          y_backprop=y_backprop, x=x, scale=np.linspace(0.5, 1.5, c).astype(np.float32),
          reserve_space_1=mean.astype(np.float32), reserve_space_2=var.astype(np.float32),
          inv_std=(1.0 / np.sqrt(var + np.float32(1e-4))).astype(np.float32),
          batch_variance=(var * count / (count - 1)).astype(np.float32),
          moving_mean=(mean + rng.normal(0, 0.05, c)).astype(np.float32),
          moving_variance=(var * rng.uniform(0.9, 1.1, c)).astype(np.float32))


if __name__ == "__main__":
    notebook()
    per_channel()
    batch_norm()
