"""Make samples/run.h5: a small run file (seeded, deterministic), the layout of README's "Whole models".

    python samples/make_run.py          # rewrites samples/run.h5 in place

Two training steps of a toy model, each with five layers:

- ``backbone/conv1/weight_quant``: TF per-channel weights [3, 3, 8, 16] (narrow range), three channels
  calibrated far too narrow;
- ``backbone/conv1/act_quant``: TF per-tensor activations [4, 8, 8, 16] with a tight range;
- ``backbone/conv1/bn``: a FusedBatchNormV3 layer (NHWC, epsilon 1e-3, training);
- ``head/act_quant``: PyTorch's fake_quantize_per_tensor_affine (scale, int32 zero point);
- ``head/logits_quant``: FakeQuantWithMinMaxArgs (min/max as attributes).

The second step's ranges are recalibrated, so the report shows how clipping changes across steps.
"""
import os

import h5py
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def layer(f, path, op, attrs=None, **datasets):
    g = f.require_group(path)
    g.attrs["op"] = op
    for key, value in (attrs or {}).items():
        g.attrs[key] = value
    for key, value in datasets.items():
        g.create_dataset(key, data=value)


def step(f, name, rng, calibration):
    w = (rng.standard_normal((3, 3, 8, 16)) * np.linspace(0.05, 0.4, 16)).astype(np.float32)
    w_hi = np.abs(w).max(axis=(0, 1, 2)).astype(np.float32)
    for c in (2, 9, 13):
        w_hi[c] *= calibration  # these channels clip
    layer(f, f"{name}/backbone/conv1/weight_quant", "FakeQuantWithMinMaxVarsPerChannel",
          {"num_bits": 8, "narrow_range": True, "axis": -1},
          inputs=w, min=-w_hi, max=w_hi, gradients=(rng.standard_normal(w.shape) * 1e-3).astype(np.float32))
    a = np.maximum(rng.standard_normal((4, 8, 8, 16)) * 1.5, 0).astype(np.float32)
    layer(f, f"{name}/backbone/conv1/act_quant", "FakeQuantWithMinMaxVars", {"num_bits": 8, "narrow_range": False},
          inputs=a, min=np.float32(0.0), max=np.float32(3.0 * calibration + 1.0),
          gradients=(rng.standard_normal(a.shape) * 1e-2).astype(np.float32))
    x = (rng.standard_normal((4, 8, 8, 16)) * np.linspace(0.5, 2.0, 16) + 0.3).astype(np.float32)
    x64 = x.astype(np.float64)
    layer(f, f"{name}/backbone/conv1/bn", "FusedBatchNormV3",
          {"epsilon": 1e-3, "data_format": "NHWC", "is_training": True},
          y_backprop=(rng.standard_normal(x.shape) * 0.05).astype(np.float32), x=x,
          scale=np.linspace(0.8, 1.2, 16).astype(np.float32),
          reserve_space_1=x64.mean(axis=(0, 1, 2)).astype(np.float32),
          reserve_space_2=x64.var(axis=(0, 1, 2)).astype(np.float32))
    h = (rng.standard_normal((8, 32)) * 2.0).astype(np.float32)
    layer(f, f"{name}/head/act_quant", "fake_quantize_per_tensor_affine", {"quant_min": 0, "quant_max": 255},
          inputs=h, scale=np.float32(8.0 * calibration / 255), zero_point=np.int32(128),
          gradients=(rng.standard_normal(h.shape) * 1e-2).astype(np.float32))
    z = (rng.standard_normal((8, 10)) * 4.0).astype(np.float32)
    layer(f, f"{name}/head/logits_quant", "FakeQuantWithMinMaxArgs",
          {"min": -6.0, "max": 6.0, "num_bits": 8, "narrow_range": False},
          inputs=z, gradients=(rng.standard_normal(z.shape) * 1e-2).astype(np.float32))


def main(path=os.path.join(HERE, "run.h5")):
    rng = np.random.default_rng(18)
    with h5py.File(path, "w") as f:
        f.attrs["description"] = "qgcli sample run file: two steps of a toy model (seed 18)"
        step(f, "step_000100", rng, calibration=0.5)
        step(f, "step_000200", rng, calibration=0.8)
    print("wrote", path)


if __name__ == "__main__":
    main()
