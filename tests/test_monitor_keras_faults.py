"""qgcli.monitor.keras with each planted fault, on one tf_keras + TF Model Optimization QAT model trained in a
custom tf.function loop for 12 steps (traced once, nothing eager): six independent branches, each with its own
fault, and `qgcli doctor --json` names the layer, the kind and the step of each."""
import json
import re

import pytest
from click.testing import CliRunner

from qgcli.cli import main
from qgcli.monitor.history import read_history
from test_monitor_keras import fit_per_step, host_calls, np, tf, tfmot  # TensorFlow set up for tf_keras (or skipped)

pytestmark = pytest.mark.filterwarnings("ignore")
quantizers = tfmot.quantization.keras.quantizers


class Fixed(quantizers.Quantizer):
    """8-bit fake quant on a range held in variables: set by hand (not trainable), learned (``trainable``), or
    behind a switch variable (``switch``: a tf.cond skips the fake quant when it is 0)."""

    def __init__(self, low, high, trainable=False, switch=False):
        self.low, self.high, self.trainable, self.switch = low, high, trainable, switch

    def build(self, tensor_shape, name, layer):
        def var(suffix, value):
            return layer.add_weight(f"{name}_{suffix}", initializer=tf.keras.initializers.Constant(value),
                                    trainable=self.trainable and suffix in ("min", "max"))

        return {"min": var("min", self.low), "max": var("max", self.high), "on": var("on", 1.0)}

    def __call__(self, inputs, training, weights, **kwargs):
        def fake_quant():  # looked up at call time: the monitor's wrapper while it is on
            return tf.quantization.fake_quant_with_min_max_vars(inputs, weights["min"], weights["max"], num_bits=8)

        if self.switch:
            return tf.cond(weights["on"] > 0, fake_quant, lambda: tf.identity(inputs))
        return fake_quant()

    def get_config(self):
        return {"low": self.low, "high": self.high, "trainable": self.trainable, "switch": self.switch}


class Config(tfmot.quantization.keras.QuantizeConfig):
    """A Dense layer's kernel quantizer and output quantizer (either may be None)."""

    def __init__(self, kernel=None, output=None):
        self.kernel, self.output = kernel, output

    def get_weights_and_quantizers(self, layer):
        return [(layer.kernel, self.kernel)] if self.kernel else []

    def get_activations_and_quantizers(self, layer):
        return []

    def set_quantize_weights(self, layer, quantize_weights):
        if self.kernel:
            layer.kernel = quantize_weights[0]

    def set_quantize_activations(self, layer, quantize_activations):
        pass

    def get_output_quantizers(self, layer):
        return [self.output] if self.output else []

    def get_config(self):  # quantize_apply clones the model through its config
        return {k: q.get_config() if q else None for k, q in (("kernel", self.kernel), ("output", self.output))}

    @classmethod
    def from_config(cls, config):
        return cls(**{k: Fixed(**c) if c else None for k, c in config.items()})


GRID = (-12.8, 12.7)  # 8 bits over this range: scale 0.1, zero point 128 exactly
BOUNDARY = ((np.arange(-8, 8) + 0.5) * 0.1).astype("float32")  # rounding boundaries of that grid


def _model():
    tf.keras.backend.clear_session()
    tf.keras.utils.set_random_seed(0)
    annotate = tfmot.quantization.keras.quantize_annotate_layer
    dense = tf.keras.layers.Dense
    x = tf.keras.Input((8,), name="x")
    eye = tf.keras.Input((16,), name="eye")

    def weights():
        return Fixed(-4.0, 4.0)

    branches = {
        # a downstream output quantizer whose backward is broken at step 5 (the test patches the op)
        "ste": [annotate(dense(8, name="ste_a"), Config(kernel=weights())),
                annotate(dense(4, name="ste_b"), Config(output=Fixed(-6.0, 6.0)))],
        # a downstream output quantizer forced to clip everything from step 5
        "clip": [annotate(dense(8, name="clip_a"), Config(kernel=weights())),
                 annotate(dense(4, name="clip_b"), Config(output=Fixed(-6.0, 6.0)))],
        # a learnable range whose gradient is taken but never applied (narrow: it clips, so it has one)
        "learn": [annotate(dense(4, name="learn"), Config(output=Fixed(-0.5, 0.5, trainable=True)))],
        # a range halved before every step (small outputs: it never clips them all, so it is no candidate for
        # the downstream cause of the other branches' missing gradient, which is told by forward order alone)
        "collapse": [annotate(dense(4, name="collapse", kernel_initializer=tf.keras.initializers.RandomNormal(
            stddev=1e-3)), Config(output=Fixed(-6.0, 6.0)))],
        # fake quant switched off before step 5
        "off": [annotate(dense(4, name="off"), Config(output=Fixed(-6.0, 6.0, switch=True)))],
    }
    outputs = []
    for layers in branches.values():
        h = x
        for layer in layers:
            h = layer(h)
        outputs.append(h)
    # weights just above rounding boundaries, pulled to them: they cross at every step
    start = np.tile(BOUNDARY + 0.001, (16, 1))
    outputs.append(annotate(dense(16, use_bias=False, name="osc", kernel_initializer=tf.keras.initializers.Constant(
        start)), Config(kernel=Fixed(*GRID)))(eye))
    annotated = tf.keras.Model([x, eye], outputs)
    with tfmot.quantization.keras.quantize_scope({"Fixed": Fixed, "Config": Config}):
        return tfmot.quantization.keras.quantize_apply(annotated)


def _variable(model, layer, part):
    found = [v for v in model.get_layer(layer).weights if v.name.split("/")[-1].split(":")[0].endswith(part)]
    assert len(found) == 1, [v.name for v in model.get_layer(layer).weights]
    return found[0]


def test_planted_faults_found_at_their_layer_and_step(tmp_path, monkeypatch):
    from qgcli.monitor.keras import monitor

    broken = tf.Variable(False, trainable=False)
    original = tf.quantization.fake_quant_with_min_max_vars

    def fake_quant(inputs, min, max, num_bits=8, narrow_range=False, name=None):  # noqa: A002
        y = original(inputs, min, max, num_bits=num_bits, narrow_range=narrow_range, name=name)
        if "quant_ste_b" not in tf.get_current_name_scope():
            return y

        @tf.custom_gradient
        def zero_backward(t):
            return tf.identity(t), lambda dy: tf.where(broken, tf.zeros_like(dy), dy)

        return zero_backward(y)

    monkeypatch.setattr(tf.quantization, "fake_quant_with_min_max_vars", fake_quant)  # the framework's op, broken
    model = _model()
    rng = np.random.RandomState(0)
    x = rng.randn(8, 8).astype("float32")
    eye = np.eye(16, dtype="float32")
    targets = [rng.randn(8, o.shape[-1]).astype("float32") for o in model.outputs[:-1]]
    targets.append(np.tile(BOUNDARY, (16, 1)))
    learned = [_variable(model, "quant_learn", p).ref() for p in ("min", "max")]
    variables = model.trainable_variables
    assert len([v for v in variables if v.ref() in learned]) == 2
    opt = tf.keras.optimizers.SGD(0.05)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            outs = model([x, eye], training=True)
            loss = tf.add_n([tf.reduce_mean(tf.square(o - t)) for o, t in zip(outs[:-1], targets)])
            loss += tf.reduce_sum(tf.square(outs[-1] - targets[-1]))  # the oscillating weights' pull
        grads = tape.gradient(loss, variables)
        # the learnable range is left out when the gradients are applied
        opt.apply_gradients([(g, v) for g, v in zip(grads, variables) if v.ref() not in learned and g is not None])

    clip = [_variable(model, "quant_clip_b", p) for p in ("min", "max")]
    collapse = [_variable(model, "quant_collapse", p) for p in ("min", "max")]
    switch = _variable(model, "quant_off", "on")
    with monitor(tmp_path / "h", every=3) as mon:
        for i in range(1, 13):
            if i == 5:
                broken.assign(True)
                switch.assign(0.0)
            if i >= 5:  # forced every step (the moving range would not stay)
                clip[0].assign(0.0)
                clip[1].assign(1e-6)
            for v in collapse:
                v.assign(v * 0.5)
            step()
            mon.step()
    assert not tf.config.functions_run_eagerly()
    h = read_history(tmp_path / "h")
    assert h.steps == [1, 3, 6, 9, 12]
    paths = [layer["path"] for layer in h.layers]

    roles = {lay["path"]: lay["role"] for lay in h.layers}

    def layer(name, role):  # named by the call's name scope: model/quant_<layer>[_n][/...]
        found = [p for p in paths if re.match(rf"model/quant_{name}(_\d+)?(/|$)", p) and roles[p] == role]
        assert len(found) == 1, (name, role, paths)
        return found[0]

    result = CliRunner().invoke(main, ["doctor", str(tmp_path / "h"), "--json"])
    assert result.exit_code == 0, result.output
    findings = {(f["kind"], f["layer"]): f for f in json.loads(result.output)["findings"]}
    got = {key: f["step"] for key, f in findings.items()}
    expected = {
        ("ste_broken", layer("ste_b", "activation")): 6,
        ("no_gradient", layer("ste_a", "weight")): 6,
        ("no_gradient", layer("clip_a", "weight")): 6,
        ("range_not_learning", layer("learn", "activation")): 3,
        ("range_collapse", layer("collapse", "activation")): 9,
        ("range_collapse", layer("clip_b", "activation")): 6,  # forced to clip everything by a range of 1e-6
        ("fake_quant_disabled", layer("off", "activation")): 6,
        ("oscillation", layer("osc", "weight")): 6,  # f = 1 - 0.99^4 > 0.02 after flips at steps 3 to 6
    }
    assert {k: got.get(k) for k in expected} == expected, got
    assert set(got) == set(expected), sorted(set(got) - set(expected))  # nothing else
    cause = findings[("no_gradient", layer("clip_a", "weight"))]["evidence"]
    assert f"downstream cause: {layer('clip_b', 'activation')} passes no gradient" in cause
    assert findings[("oscillation", layer("osc", "weight"))]["severity"] == "warning"
    assert all(f["severity"] == "error" for (kind, _), f in findings.items()
               if kind not in ("oscillation", "fake_quant_disabled"))


def test_weight_quantizer_in_a_cond_branch_keeps_its_own_callback(tmp_path, monkeypatch):
    """Between samples the weight quantizers of model.fit's step share one host callback, but for one in a
    tf.cond branch: its own callback, which runs only when the branch is taken (its codes not updated once it is
    switched off)."""
    calls, updated = host_calls(monkeypatch)
    tf.keras.backend.clear_session()
    tf.keras.utils.set_random_seed(0)
    annotate = tfmot.quantization.keras.quantize_annotate_layer
    dense = tf.keras.layers.Dense
    inputs = tf.keras.Input((8,))
    h = inputs
    for name, switch in (("first", False), ("switched", True), ("last", False)):
        h = annotate(dense(8, name=name), Config(kernel=Fixed(-4.0, 4.0, switch=switch)))(h)
    with tfmot.quantization.keras.quantize_scope({"Fixed": Fixed, "Config": Config}):
        model = tfmot.quantization.keras.quantize_apply(tf.keras.Model(inputs, h))
    model.compile(tf.keras.optimizers.SGD(0.05), "mse")
    switch = _variable(model, "quant_switched", "on")

    class SwitchOff(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:  # after step 4
                switch.assign(0.0)

    rng = np.random.RandomState(0)
    x, y = rng.randn(48, 8).astype("float32"), rng.randn(48, 8).astype("float32")
    steps = fit_per_step(model, x, y, tmp_path / "h", 3, calls, updated, batch_size=8, epochs=1,
                         extra=[SwitchOff()])
    names = sorted(steps[1][1])
    assert len(names) == 3 and "switched" in names[2], names
    for step in (2, 4):
        assert steps[step - 1] == (["_oscillation", "_oscillations"], names), step
    assert steps[4] == (["_oscillations"], names[:2])  # step 5: the branch not taken

def test_ste_mask_matches_the_kernel_in_a_graph():
    """The monitor's STE mask (and its clipping shares) is TensorFlow's gradient mask, symmetric ranges included
    (zero point from min x.5, where a graph's reciprocal multiplication moved it by one: a false ste_broken),
    with the compiled kernels and with NumPy."""
    from qgcli.monitor import keras_stats
    from qgcli.ops import native

    low, high = tf.Variable(-0.75), tf.Variable(0.75)
    x = tf.constant(np.linspace(-4, 4, 40001, dtype="float32"))

    @tf.function
    def gradient():
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.quantization.fake_quant_with_min_max_vars(x, low, high)
        return y, tape.gradient(y, x)

    rng = np.random.RandomState(0)
    for r in [3.0, 1.5, 0.75, 0.375, *rng.uniform(0.1, 3, 8)]:
        for a in (-r, -r / 3):
            low.assign(a)
            high.assign(r)
            y, grad = (t.numpy() for t in gradient())
            grid = keras_stats.grid(low.numpy(), high.numpy(), 8, False)
            for choice in ("", "0"):
                with pytest.MonkeyPatch.context() as patch:
                    patch.setenv("QGCLI_NATIVE", choice)
                    mask = np.full(x.shape, 7, np.int8)
                    stats = keras_stats.forward(x.numpy(), y, grid, mask)
                    assert (native.library() is None) == (choice == "0")
                assert np.array_equal(mask == 0, grad == 1), (a, r, choice)
                below, above = (np.mean((grad == 0) & (x.numpy() < 0)), np.mean((grad == 0) & (x.numpy() > 0)))
                assert (stats["clip_low"], stats["clip_high"]) == pytest.approx((below, above), abs=1e-12)
