"""A small history written with qgcli's own HistoryWriter (no framework needed): three layers over four samples,
with a blocked-gradient jump on ``conv2.act`` at step 20 and NaN gradients on ``fc.weight`` at step 30."""
from qgcli.monitor.history import HistoryWriter

STEPS = (1, 10, 20, 30)
LAYERS = (("conv1.weight", "weight"), ("conv2.act", "activation"), ("fc.weight", "weight"))


def stats(path, step, *, worse=1.0):
    """The statistics of layer ``path`` at ``step`` (``worse`` scales the blocked and clipped shares)."""
    blocked = {"conv1.weight": 0.01 * step / 10, "conv2.act": 0.05 if step < 20 else 0.6,
               "fc.weight": 0.02}[path] * worse
    return {"blocked": min(blocked, 1.0), "clip_low": 0.5 * min(blocked, 1.0), "clip_high": 0.01,
            "dy_norm": 1.0 + step / 100, "dx_norm": 0.9, "scale_median": 0.05, "scale_min": 0.04,
            "scale_max": 0.06, "sqnr_db": 30.0 - 10 * blocked, "needs_grad": 1, "fake_quant_enabled": 1,
            "nan_grads": 3 if (path == "fc.weight" and step == 30) else 0}


def write(path, *, worse=1.0, steps=STEPS):
    w = HistoryWriter(str(path), meta={"framework": "test", "every": 10})
    ids = {p: w.layer_id(p, "fake_quant", role, "FakeQuantize", {"quant_min": -128, "quant_max": 127})
           for p, role in LAYERS}
    for step in steps:
        w.add_sample(step, {lid: stats(p, step, worse=worse) for p, lid in ids.items()})
    w.close()
    return str(path)
