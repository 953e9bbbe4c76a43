"""The documented snippet (docs/inspect-report.md) loads `report RUN --ranges-out`'s min/max into a real tfmot
QAT model's quantizer variables (tf_keras; skipped without TensorFlow and tfmot)."""
import os
import re

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf_keras, as tfmot needs; before TF's import
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import h5py  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

tf = pytest.importorskip("tensorflow")
pytest.importorskip("tf_keras")
tfmot = pytest.importorskip("tensorflow_model_optimization")

from clirunner import make_runner  # noqa: E402

from qgcli.capture.tensorflow import capture  # noqa: E402
from qgcli.cli import main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_documented_snippet_loads_into_a_tfmot_model(tmp_path, monkeypatch):
    keras = tf.keras
    if not keras.__name__.startswith("tf_keras"):
        pytest.skip("tf.keras is not tf_keras (TensorFlow was imported before TF_USE_LEGACY_KERAS=1)")
    keras.backend.clear_session()  # layer names without the _N suffixes earlier tests' models leave
    tf.random.set_seed(0)
    model = tfmot.quantization.keras.quantize_model(keras.Sequential(
        [keras.layers.Input((8,)), keras.layers.Dense(6, activation="relu", name="fc1"),
         keras.layers.Dense(3, name="fc")], name="sequential"))
    x = tf.constant(np.random.default_rng(0).standard_normal((16, 8)) * 3, tf.float32)
    with capture(str(tmp_path / "run.h5"), step=3), tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x, training=True) ** 2)
    tape.gradient(loss, model.trainable_variables)
    r = make_runner().invoke(main, ["report", str(tmp_path / "run.h5"), "--ranges-out", str(tmp_path / "ranges.h5"),
                                    "--range-method", "mse", "-q"])
    assert r.exit_code == 0, r.output
    with open(os.path.join(ROOT, "docs", "inspect-report.md"), encoding="utf-8") as fh:
        snippet = re.search(r"<!-- ranges into tfmot -->\n<!-- example: no-run -->\n```python\n(.*?)```", fh.read(),
                            re.S).group(1)
    before = {v.name: v.numpy() for v in model.weights}
    monkeypatch.chdir(tmp_path)
    exec(snippet, {"model": model, "h5py": h5py, "__name__": "snippet"})  # noqa: S102
    loaded = 0
    with h5py.File(tmp_path / "ranges.h5", "r") as f:
        groups = {name: f[name] for name in _groups(f)}
        assert len(groups) == 5
        for v in model.weights:
            layer, var = v.name[:-2].split("/")[-2:]
            if not var.endswith(("_min", "_max")):
                continue
            op = "LastValueQuant" if var.startswith("kernel") else \
                "AllValuesQuantize" if layer == "quantize_layer" else "MovingAvgQuantize"
            g = groups[f"step_000003/sequential/{layer}/{op}"]  # every quantizer variable has its group
            assert np.array_equal(v.numpy(), g[var[-3:]][()]), v.name
            loaded += 1
    assert loaded == 2 * 5  # the input, fc1's kernel and post-activation (relu), fc's kernel and output
    assert any(not np.array_equal(before[v.name], v.numpy()) for v in model.weights if v.name.endswith("min:0"))
    assert np.isfinite(model(x, training=False).numpy()).all()  # the model runs on the loaded ranges


def _groups(f):
    out = []
    f.visititems(lambda name, obj: out.append(name) if isinstance(obj, h5py.Group) and "min" in obj else None)
    return out
