"""qgcli.monitor.keras on a small tf_keras + TF Model Optimization QAT model: model.fit with the callback, a
custom tf.function loop with mon.step() (nothing forced eager), a planted fault found by `qgcli doctor`, and
the monitor is passive (the same weights, bit for bit)."""
import contextlib
import functools
import json
import os

import pytest

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
tf = pytest.importorskip("tensorflow")
tfmot = pytest.importorskip("tensorflow_model_optimization")
np = pytest.importorskip("numpy")

from click.testing import CliRunner  # noqa: E402

from qgcli.cli import main  # noqa: E402
from qgcli.monitor.history import read_history  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


def _model():
    tf.keras.backend.clear_session()  # layer names from 0 again
    tf.keras.utils.set_random_seed(0)
    base = tf.keras.Sequential([tf.keras.layers.Conv2D(4, 3, input_shape=(8, 8, 3)),
                                tf.keras.layers.BatchNormalization(), tf.keras.layers.ReLU(),
                                tf.keras.layers.Flatten(), tf.keras.layers.Dense(4)])
    model = tfmot.quantization.keras.quantize_model(base)
    model.compile(tf.keras.optimizers.SGD(0.05), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _data():
    rng = np.random.RandomState(0)
    return rng.randn(48, 8, 8, 3).astype("float32"), rng.randint(0, 4, 48)


def _doctor(path):
    result = CliRunner().invoke(main, ["doctor", str(path), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["findings"]


@pytest.mark.slow  # two fits, traced twice: ~35 s on 2 busy cores
@pytest.mark.skipif(os.environ.get("QGCLI_LONG", "") in ("", "0"), reason="two fits, ~35 s: set QGCLI_LONG=1")
def test_fit_and_passive(tmp_path):
    from qgcli.monitor.keras import Monitor

    x, y = _data()
    plain = _model()
    plain.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    watched = _model()
    watched.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False, callbacks=[Monitor(tmp_path / "h", every=4)])
    assert all(np.array_equal(a, b) for a, b in zip(plain.get_weights(), watched.get_weights()))
    h = read_history(tmp_path / "h")
    assert h.steps == [1, 4, 8, 12] and h.meta["framework"] == "tensorflow"
    roles = {layer["path"]: layer["role"] for layer in h.layers}
    weight = [p for p, r in roles.items() if r == "weight" and "conv" in p]
    assert weight, roles
    s = h.series(weight[0])
    assert s["scale_min"][0] > 0 and all(v > 0 for v in s["dy_norm"]) and s["ste_error"] == [0, 0, 0, 0]
    assert s["codes_changed"][0] == 0 and s["oscillating"][-1] is not None
    assert [f for f in _doctor(tmp_path / "h") if f["severity"] == "error"] == []


def test_tf_function_loop_and_a_range_made_negative(tmp_path):
    from qgcli.monitor.keras import monitor

    x, y = _data()
    model = _model()
    step = _steps(model, 0.01)
    ranges = [v for v in model.get_layer("quant_dense").weights if "post_activation_m" in v.name]
    assert len(ranges) == 2, [v.name for v in model.get_layer("quant_dense").weights]
    with monitor(tmp_path / "h", every=3, tensorboard=tmp_path / "tb") as mon:
        for i in range(6):
            if i == 4:  # before step 5: the dense layer's output range turned inside out (min > max)
                low, high = sorted(ranges, key=lambda v: v.name.endswith("max"))
                low.assign(5.0)
                high.assign(-5.0)
            step(x[8 * i:8 * i + 8], y[8 * i:8 * i + 8])
            mon.step()
    assert not tf.config.functions_run_eagerly()
    h = read_history(tmp_path / "h")
    assert h.steps == [1, 3, 6]
    findings = [f for f in _doctor(tmp_path / "h") if f["kind"] == "range_collapse"]
    assert [(f["layer"], f["step"]) for f in findings] == [("sequential/quant_dense/MovingAvgQuantize", 6)], findings
    # the events written live (tensorboard=): each layer's samples, as the history holds them
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    pytest.importorskip("tensorboardX")
    acc = accumulator.EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    s = h.series(weight_layer := [la["path"] for la in h.layers if la["role"] == "weight"][0])
    got = acc.Scalars(f"scale_median/{weight_layer}")
    assert [e.step for e in got] == [1, 3, 6] and [e.value for e in got] == pytest.approx(s["scale_median"], rel=1e-6)
    assert [e.value for e in acc.Scalars("aggregate/share_with_events")][-1] > 0  # min > max at step 6


def _steps(model, lr):
    """A custom training step as a ``tf.function``: forward, tf.GradientTape, apply_gradients."""
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = tf.keras.optimizers.SGD(lr)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            value = loss(yb, model(xb, training=True))
        grads = tape.gradient(value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    return step


def test_passive_fit_and_tf_function_loop(tmp_path):
    """A monitored run's weights (kernels, quantizer ranges, batch-norm statistics) equal an unmonitored run's bit
    for bit: model.fit with the callback (sampling and plain steps) and a custom tf.function loop with the
    context (a tf.cond per statistic)."""
    from qgcli.monitor.keras import Monitor, monitor

    x, y = _data()
    x, y = x[:24], y[:24]
    runs = {}
    for watched in (False, True):
        model = _model()
        callbacks = [Monitor(tmp_path / "fit", every=2)] if watched else []
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False, callbacks=callbacks)
        runs["fit", watched] = model.get_weights()
        model = _model()
        step = _steps(model, 0.05)
        with contextlib.ExitStack() as stack:
            mon = stack.enter_context(monitor(tmp_path / "loop", every=2)) if watched else None
            for i in range(3):
                step(x[8 * i:8 * i + 8], y[8 * i:8 * i + 8])
                if mon:
                    mon.step()
        runs["loop", watched] = model.get_weights()
    for kind in ("fit", "loop"):
        plain, watched = runs[kind, False], runs[kind, True]
        assert len(plain) == len(watched) > 8
        assert all(a.tobytes() == b.tobytes() for a, b in zip(plain, watched)), kind
        h = read_history(tmp_path / kind)
        assert h.steps == [1, 2], kind
        roles = {la["role"] for la in h.layers}
        assert roles == {"weight", "activation", "batch_norm"}, (kind, roles)
        for layer in h.layers:  # every layer sampled at both steps; a weight's upstream gradient seen
            s = h.series(layer["path"])
            name = {"batch_norm": "bn_mean_shift", "weight": "dy_norm", "activation": "scale_max"}[layer["role"]]
            assert all(v > 0 for v in s[name]), (layer["path"], s)
    assert runs["fit", False][0].tobytes() != _model().get_weights()[0].tobytes()  # the runs trained


def test_batch_norm_running_against_batch_statistics(tmp_path, monkeypatch):
    """A MobileNetV2-like conv-bn-relu6 / depthwise-bn-relu6 model after tfmot's quantize_model (its batch norms
    kept as quant_batch_normalization layers): bn_mean_shift and bn_var_ratio against the running statistics
    before the step's update, computed in NumPy from each batch norm's input, and they jump when the inputs'
    statistics change (20 times the inputs at step 8)."""
    from qgcli.monitor.keras import monitor

    tf.keras.backend.clear_session()
    tf.keras.utils.set_random_seed(0)
    layers = tf.keras.layers
    base = tf.keras.Sequential([layers.Conv2D(4, 3, padding="same", input_shape=(8, 8, 3)),
                                layers.BatchNormalization(), layers.ReLU(6.0),
                                layers.DepthwiseConv2D(3, padding="same"), layers.BatchNormalization(),
                                layers.ReLU(6.0), layers.GlobalAveragePooling2D(), layers.Dense(4)])
    model = tfmot.quantization.keras.quantize_model(base)
    bns = [la.layer for la in model.layers if isinstance(getattr(la, "layer", None), layers.BatchNormalization)]
    assert len(bns) == 2
    seen = []  # each batch norm's input, in call order
    original = tf.compat.v1.nn.fused_batch_norm

    @functools.wraps(original)
    def recorder(x, *args, **kwargs):
        seen.append(np.asarray(x, np.float64))
        return original(x, *args, **kwargs)

    monkeypatch.setattr(tf.compat.v1.nn, "fused_batch_norm", recorder)
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = tf.keras.optimizers.SGD(0.01)
    x, y = _data()
    want = {0: [], 1: []}
    with monitor(tmp_path / "h", every=2) as mon:
        for step in range(1, 9):  # eager: each batch norm's input read back here
            before = [(bn.moving_mean.numpy().astype(np.float64), bn.moving_variance.numpy().astype(np.float64))
                      for bn in bns]
            del seen[:]
            xb = x[:8] * (20 if step == 8 else 1)
            with tf.GradientTape() as tape:
                value = loss(y[:8], model(xb, training=True))
            grads = tape.gradient(value, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            mon.step()
            assert len(seen) == 2
            if step in (1, 2, 4, 6, 8):
                for i, (bn, h, (rm, rv)) in enumerate(zip(bns, seen, before)):
                    mean, var = h.mean((0, 1, 2)), h.var((0, 1, 2))
                    want[i].append((np.mean(np.abs(mean - rm) / np.sqrt(rv + bn.epsilon)),
                                    np.mean(np.abs(np.log((var + bn.epsilon) / (rv + bn.epsilon))))))
    h = read_history(tmp_path / "h")
    paths = [la["path"] for la in h.layers if la["role"] == "batch_norm"]
    assert len(paths) == 2 and all("quant_batch_normalization" in p for p in paths), paths
    for i, path in enumerate(paths):
        s = h.series(path)
        assert s["steps"] == [1, 2, 4, 6, 8]
        assert s["bn_mean_shift"] == pytest.approx([w[0] for w in want[i]], rel=1e-4)
        assert s["bn_var_ratio"] == pytest.approx([w[1] for w in want[i]], rel=1e-4 + 2 ** -11)  # float16
        assert s["nan_inputs"] == [0] * 5
    first = h.series(paths[0])  # 20 times the inputs: the batch variance about 400 times the running one
    assert first["bn_var_ratio"][-1] > max(first["bn_var_ratio"][:-1]) + 2


@pytest.mark.parametrize("native", ["", "0"], ids=["kernels", "numpy"])
def test_sample_statistics_equal_numpy_from_the_tensors(tmp_path, monkeypatch, native):
    """Each fake quant's sample (clipping, scale and range, SQNR, NaN counts, the upstream and input gradients'
    norms, zero share, blocked mass, STE error, the weights' codes and oscillation) equals the statistic computed
    here in float64 NumPy from the tensors TensorFlow passed (recorded in eager steps), TensorFlow's own op
    giving the nudged range and its gradient op the STE mask: with the compiled kernels and with NumPy."""
    from qgcli.monitor.keras import monitor
    from qgcli.monitor.history import HALF

    monkeypatch.setenv("QGCLI_NATIVE", native)
    calls = []  # per step, each fake quant's tensors in call order
    originals = {}

    def recorder(attr):
        original = originals[attr] = getattr(tf.quantization, attr)

        def record(inputs, min, max, num_bits=8, narrow_range=False, name=None):  # noqa: A002
            if not tf.executing_eagerly():  # the model being built
                return original(inputs, min, max, num_bits=num_bits, narrow_range=narrow_range, name=name)
            rec = {"attr": attr, "x": np.array(inputs), "lo": np.array(min), "hi": np.array(max), "bits": num_bits,
                   "narrow": narrow_range}

            @tf.custom_gradient
            def seen_dx(t):
                return tf.identity(t), lambda dx: rec.__setitem__("dx", dx.numpy()) or dx

            y = original(seen_dx(inputs), min, max, num_bits=num_bits, narrow_range=narrow_range, name=name)
            rec["y"] = y.numpy()

            @tf.custom_gradient
            def seen_dy(t):
                return tf.identity(t), lambda dy: rec.__setitem__("dy", dy.numpy()) or dy

            calls[-1].append(rec)
            return seen_dy(y)

        return record

    for attr in ("fake_quant_with_min_max_vars", "fake_quant_with_min_max_vars_per_channel"):
        monkeypatch.setattr(tf.quantization, attr, recorder(attr))
    model = _model()
    loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = tf.keras.optimizers.SGD(0.5)  # large steps: weight codes move
    x, y = _data()
    with monitor(tmp_path / "h", every=2, momentum=0.3, threshold=0.1) as mon:
        for step in range(5):
            calls.append([])
            with tf.GradientTape() as tape:
                value = loss(y[8 * step:8 * step + 8], model(x[8 * step:8 * step + 8], training=True))
            grads = tape.gradient(value, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            mon.step()
    h = read_history(tmp_path / "h")
    assert h.steps == [1, 2, 4]
    paths = [la["path"] for la in h.layers if la["role"] != "batch_norm"]
    roles = {la["path"]: la["role"] for la in h.layers}
    assert len(paths) == len(calls[0]) >= 4 and set(roles.values()) == {"weight", "activation", "batch_norm"}
    want = {path: {} for path in paths}
    osc = {}
    for step, recs in enumerate(calls, 1):
        for path, r in zip(paths, recs):
            x64, y64 = r["x"].astype(np.float64), r["y"].astype(np.float64)
            op = originals[r["attr"]]
            big = np.broadcast_to(np.float32(1e30), r["lo"].shape or (1,))
            ends = op(np.stack([-big, big]), r["lo"], r["hi"], num_bits=r["bits"], narrow_range=r["narrow"]).numpy()
            nmin, nmax = ends[0].astype(np.float64), ends[1].astype(np.float64)
            qmin, qmax = int(r["narrow"]), 2 ** r["bits"] - 1
            scale = (nmax - nmin) / (qmax - qmin)
            gradient = getattr(tf.quantization, r["attr"] + "_gradient")
            inside = gradient(np.ones_like(r["x"]), r["x"], r["lo"], r["hi"], num_bits=r["bits"],
                              narrow_range=r["narrow"])[0].numpy().astype(np.float64)
            stats = {"clip_low": np.mean(x64 < nmin), "clip_high": np.mean(x64 > nmax),
                     "scale_min": scale.min(), "scale_max": scale.max(), "scale_median": np.sort(scale.ravel())[
                         scale.size // 2], "zero_point_min": np.min(np.round(qmin - nmin / scale)),
                     "zero_point_max": np.max(np.round(qmin - nmin / scale)), "range_min": r["lo"].min(),
                     "range_max": r["hi"].max(), "nan_inputs": 0.0, "fake_quant_enabled": 1.0,
                     "sqnr_db": 10 * np.log10(np.sum(x64 ** 2) / np.sum((x64 - y64) ** 2))}
            assert np.array_equal(inside == 0, (x64 < nmin) | (x64 > nmax))
            if "dy" in r:
                dy = r["dy"].astype(np.float64)
                stats.update(dy_norm=np.linalg.norm(dy), dy_zero=np.mean(dy == 0), nan_grads=0.0, needs_grad=1.0,
                             blocked=np.sum(np.abs(dy) * (1 - inside)) / np.sum(np.abs(dy)))
            if "dx" in r:
                dx, dy = r["dx"].astype(np.float64), r["dy"].astype(np.float64)
                stats.update(dx_norm=np.linalg.norm(dx),
                             ste_error=np.sum(np.abs(dx - dy * inside)) / np.sum(np.abs(dy * inside)))
            if roles[path] == "weight":
                codes = np.floor((np.clip(x64, nmin, nmax) - nmin) / scale + 0.5)
                s = osc.setdefault(path, {"codes": codes, "direction": np.zeros_like(codes), "frequency":
                                          np.zeros_like(codes), "sample": codes})
                if step > 1:
                    move = np.sign(codes - s["codes"])
                    s["frequency"] = s["frequency"] * 0.7 + 0.3 * (move * s["direction"] < 0)
                    s["direction"] = np.where(move != 0, move, s["direction"])
                    s["codes"] = codes
                if step in h.steps:
                    stats.update(codes_changed=np.mean(codes != s["sample"]),
                                 oscillating=np.mean(s["frequency"] > 0.1), oscillation_max=s["frequency"].max())
                    s["sample"] = codes
            if step in h.steps:
                want[path][step] = stats
    moved = 0
    for path in paths:
        got = h.series(path)
        for name in set().union(*(w.keys() for w in want[path].values())):
            expected = [want[path][step].get(name) for step in got["steps"]]
            tolerance = 2 ** -10 if name in HALF else 1e-5
            assert got[name] == pytest.approx(expected, rel=tolerance, abs=1e-7), (path, name)
        moved += sum(v for v in got.get("codes_changed") or [] if v)
    assert moved > 0  # the oscillation statistics were tested on moving codes


def test_xla_compiled_model_refused_before_any_file(tmp_path):
    """The host callbacks cannot run inside XLA: a model compiled with jit_compile=True gets a one-line error at
    fit, and no history is created."""
    from qgcli.errors import UsageProblem
    from qgcli.monitor.keras import Monitor

    model = _model()
    model.compile(tf.keras.optimizers.SGD(0.05), "mse", jit_compile=True)
    x, y = _data()
    with pytest.raises(UsageProblem, match="jit_compile=False"):
        model.fit(x[:8], np.eye(4, dtype="float32")[y[:8]], verbose=0, callbacks=[Monitor(tmp_path / "h")])
    assert not (tmp_path / "h").exists()


def test_a_fit_that_raises_leaves_the_model_and_tensorflow_as_they_were(tmp_path):
    """model.fit calls no on_train_end when a step raises: the monitor closes its history and undoes its wrapping
    then, so that the next fit of the same model, with a new monitor, is monitored (it was not: tf.quantization
    still held the first monitor's ops) and the first history ends at the last step that completed."""
    from qgcli.monitor.keras import Monitor

    x, y = _data()
    model = _model()

    def batches(fail_at):
        for i in range(6):
            if i == fail_at:
                raise RuntimeError("a bad batch")
            yield x[8 * i:8 * i + 8], y[8 * i:8 * i + 8]

    with pytest.raises(Exception, match="a bad batch"):
        model.fit(batches(3), steps_per_epoch=6, verbose=0, callbacks=[Monitor(tmp_path / "h1", every=1)])
    assert read_history(tmp_path / "h1").steps == [1, 2, 3]
    assert "train_step" not in vars(model) and model.train_function is None
    assert not getattr(tf.quantization.fake_quant_with_min_max_vars, "_qgcli_monitor", False)
    model.fit(batches(None), steps_per_epoch=6, verbose=0, callbacks=[Monitor(tmp_path / "h2", every=2)])
    h2 = read_history(tmp_path / "h2")
    assert h2.steps == [1, 2, 4, 6] and len(h2.layers) == len(read_history(tmp_path / "h1").layers) > 0


def host_calls(monkeypatch):
    """The monitor's host callbacks as they run, and the weight quantizers whose oscillation they update: two
    lists, emptied by the caller after each step."""
    from qgcli.monitor import keras as monitor_keras

    calls, updated = [], []
    callback, oscillation = monitor_keras._Watch._callback, monitor_keras._Watch._oscillation

    def counted_callback(self, method, *args):
        def run(*given):
            calls.append(method.__name__)
            return method(*given)

        return callback(self, run, *args)

    @functools.wraps(oscillation)
    def recorded_oscillation(self, name, *args):
        updated.append(name)
        return oscillation(self, name, *args)

    monkeypatch.setattr(monitor_keras._Watch, "_callback", counted_callback)
    monkeypatch.setattr(monitor_keras._Watch, "_oscillation", recorded_oscillation)
    return calls, updated


def fit_per_step(model, x, y, path, every, calls, updated, extra=(), **fit):
    """``model.fit`` with the monitor (and the ``extra`` callbacks after it); each step's host callbacks and
    updated weight quantizers (sorted)."""
    from qgcli.monitor.keras import Monitor

    steps = []

    class Steps(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            steps.append((sorted(calls), sorted(updated)))
            del calls[:], updated[:]

    model.fit(x, y, verbose=0, shuffle=False, callbacks=[Monitor(path, every=every), *extra, Steps()],
              **fit)
    return steps


def test_gathered_host_callbacks_of_fit_steps(tmp_path, monkeypatch):
    """Between samples model.fit's step makes one host callback for its two weight quantizers (not one each), a
    sampling step two (the forward's, then the gradients': not one per site), and the history and the weights
    equal those of a run with one callback per site, bit for bit."""
    from qgcli.monitor import keras as monitor_keras

    calls, updated = host_calls(monkeypatch)
    x, y = _data()
    runs = {}
    for gathered in (True, False):
        if not gathered:
            monkeypatch.setattr(monitor_keras._Watch, "gathering", lambda self: contextlib.nullcontext())
        model = _model()
        path = tmp_path / f"h{gathered}"
        steps = fit_per_step(model, x, y, path, 3, calls, updated, batch_size=8, epochs=1)
        runs[gathered] = steps, read_history(path), model.get_weights()
    steps, h, weights = runs[True]
    assert h.steps == [1, 3, 6] and len(steps) == 6
    weight_layers = sorted(la["path"] for la in h.layers if la["role"] == "weight")
    assert len(weight_layers) == 2
    for step in (2, 4, 5):  # between samples
        assert steps[step - 1] == (["_oscillations"], weight_layers), step
        assert runs[False][0][step - 1] == (["_oscillation"] * 2, weight_layers), step
    for step in (1, 3, 6):  # sampling steps: the same statistics' calls, in two host callbacks
        gathered_calls, own_calls = steps[step - 1][0], runs[False][0][step - 1][0]
        assert gathered_calls.count("_calls") == 2 and "_calls" not in own_calls, step
        assert [c for c in gathered_calls if c != "_calls"] == own_calls and len(own_calls) > 10, step
    _, other, other_weights = runs[False]
    assert [la["path"] for la in h.layers] == [la["path"] for la in other.layers]
    for layer in h.layers:
        got, want = h.series(layer["path"]), other.series(layer["path"])
        assert got.keys() == want.keys()
        for name in got:
            assert np.array_equal(np.array(got[name], float), np.array(want[name], float), equal_nan=True), name
    assert all(a.tobytes() == b.tobytes() for a, b in zip(weights, other_weights))
    assert any(v for v in h.series(weight_layers[0])["codes_changed"][1:])  # the codes moved between samples
