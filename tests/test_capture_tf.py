"""qgcli.capture.tensorflow on a real TF Model Optimization QAT model (tf_keras) and on hand-written code
calling the ops: a few training steps on data made here, one step captured; every quantizer and batch norm
is in the run file, `qgcli verify` passes (fake quant bit-identical with TF's kernels, batch norm within
1e-5) and the file feeds `report` and `plot layers`."""
import json
import threading
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf.keras is tf_keras, as tfmot needs; before TF's import
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import h5py  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

tf = pytest.importorskip("tensorflow")
pytest.importorskip("tf_keras")

from qgcli.capture.tensorflow import capture  # noqa: E402
from qgcli.cli import main  # noqa: E402
from qgcli.storage.hdf5.digests import digests_of  # noqa: E402

EXPECTED = ["sequential/quantize_layer/AllValuesQuantize", "sequential/quant_conv/LastValueQuant",
            "sequential/quant_bn", "sequential/quant_relu/MovingAvgQuantize", "sequential/quant_fc/LastValueQuant",
            "sequential/quant_fc/MovingAvgQuantize"]


def _step(model, opt, x, y):
    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))


@pytest.fixture(scope="module")
def qat_run(tmp_path_factory):
    tfmot = pytest.importorskip("tensorflow_model_optimization")
    keras = tf.keras
    if not keras.__name__.startswith("tf_keras"):
        pytest.skip("tf.keras is not tf_keras (TensorFlow was imported before TF_USE_LEGACY_KERAS=1)")
    tf.random.set_seed(0)
    layers = keras.layers
    model = keras.Sequential([layers.Input((6, 6, 2)), layers.Conv2D(4, 3, name="conv"),
                              layers.BatchNormalization(name="bn"), layers.ReLU(name="relu"), layers.Flatten(),
                              layers.Dense(3, name="fc")], name="sequential")
    q = tfmot.quantization.keras.quantize_model(model)
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((8, 6, 6, 2)), tf.float32)
    y = tf.constant(rng.integers(0, 3, 8))
    opt = keras.optimizers.SGD(0.05)
    for _ in range(3):
        _step(q, opt, x, y)
    path = str(tmp_path_factory.mktemp("tf") / "run.h5")
    with capture(path, step=3) as cap:
        _step(q, opt, x, y)
    step = tf.function(_step)  # a tf.function step runs eagerly inside the block
    with capture(path, step=4) as cap4:
        step(q, opt, x, y)
    return path, cap, cap4


def test_every_quantizer_and_batch_norm_is_captured(qat_run):
    path, cap, cap4 = qat_run
    assert cap.groups == EXPECTED and cap.skipped == {}
    assert cap4.groups == EXPECTED
    with h5py.File(path) as f:
        assert sorted(f) == ["step_000003", "step_000004"]
        s = f["step_000003"]
        w = s["sequential/quant_conv/LastValueQuant"]
        assert w.attrs["op"] == "FakeQuantWithMinMaxVarsPerChannel" and w["min"].shape == (4,)
        assert w.attrs["num_bits"] == 8 and w.attrs["narrow_range"]
        a = s["sequential/quant_relu/MovingAvgQuantize"]
        assert a.attrs["op"] == "FakeQuantWithMinMaxVars" and a["min"].shape == ()
        kept = set(a["reference"]) | set(digests_of(f, a.name))  # backprops_wrt_input: a digest
        assert "gradients" in a and {"backprops_wrt_input", "backprop_wrt_min"} <= kept
        bn = s["sequential/quant_bn"]
        assert bn.attrs["op"] == "FusedBatchNormV3" and bn.attrs["data_format"] == "NHWC"
        assert bn["x"].shape == (8, 4, 4, 4) and bn.attrs["variance_kind"] == "variance"
        assert "note" not in bn.attrs and "note" not in a.attrs


def test_verify_and_report(qat_run, tmp_path, runner):
    path = qat_run[0]
    r = runner.invoke(main, ["verify", path, "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["verified"] == 2 * len(EXPECTED) and doc["failed"] == 0
    for layer in doc["layers"]:
        if layer["kind"] == "fake-quant":
            assert layer["outputs"]["outputs"]["identical"], layer
            if "backprops_wrt_input" in layer["outputs"]:
                assert layer["outputs"]["backprops_wrt_input"]["identical"], layer
        else:
            assert layer["rel"] <= 1e-5
    r = runner.invoke(main, ["report", path, "--json"])
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["layers"]) == 2 * 5
    r = runner.invoke(main, ["plot", "layers", path, "-o", str(tmp_path / "layers.png")])
    assert r.exit_code == 0, r.output


def test_hand_written_ops(tmp_path, runner):
    rng = np.random.default_rng(1)
    x = tf.Variable(rng.standard_normal((4, 3, 3, 5)).astype(np.float32))
    lo, hi = tf.Variable(-1.0), tf.Variable(1.5)
    clo, chi = tf.Variable(-np.ones(5, np.float32)), tf.Variable(np.full(5, 0.5, np.float32))
    gamma, beta = tf.Variable(np.ones(5, np.float32) * 1.5), tf.Variable(np.zeros(5, np.float32))
    path = str(tmp_path / "ops.h5")
    with capture(path) as cap:
        with tf.GradientTape() as tape:
            with tf.name_scope("block"):
                a = tf.quantization.fake_quant_with_min_max_args(x, min=-2.0, max=2.0, num_bits=4,
                                                                 name="act")
                b = tf.quantization.fake_quant_with_min_max_vars(a, lo, hi, narrow_range=True)
                c = tf.quantization.fake_quant_with_min_max_vars_per_channel(b, clo, chi, name="w")
                y, _, _ = tf.compat.v1.nn.fused_batch_norm(c * 2.0, gamma, beta, epsilon=1e-3)
                _ = tf.compat.v1.nn.fused_batch_norm(c, gamma, beta, mean=beta, variance=gamma, is_training=False)
            loss = tf.reduce_sum(y * tf.constant(rng.standard_normal(y.shape).astype(np.float32)))
        tape.gradient(loss, [x, lo, hi, clo, chi, gamma, beta])
    # named by name scope and the name= argument; a scope that holds named calls gets leaves for the others
    assert cap.groups == ["block/act", "block/fake_quant", "block/w", "block/batch_norm"], cap.groups
    assert list(cap.skipped) == ["block"] and "inference" in cap.skipped["block"]
    with h5py.File(path) as f:
        assert f["block/batch_norm"].attrs["op"] == "FusedBatchNormV3" and f["block/w"]["min"].shape == (5,)
        g = f["block/act"]
        assert (g.attrs["min"], g.attrs["max"], g.attrs["num_bits"]) == (-2.0, 2.0, 4)
        assert "min" not in g and "gradients" in g
    r = runner.invoke(main, ["verify", path, "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["verified"] == 4 and doc["failed"] == 0
    for layer in doc["layers"]:
        if layer["kind"] == "fake-quant":
            grad = "backprops" if layer["op"] == "FakeQuantWithMinMaxArgs" else "backprops_wrt_input"
            assert layer["outputs"]["outputs"]["identical"] and layer["outputs"][grad]["identical"], layer


def test_a_failed_step_writes_nothing_and_restores_tf(tmp_path):
    original = tf.quantization.fake_quant_with_min_max_vars
    path = tmp_path / "run.h5"
    with pytest.raises(RuntimeError):
        with capture(str(path)):
            tf.quantization.fake_quant_with_min_max_vars(tf.ones(3), -1.0, 1.0)
            raise RuntimeError("diverged")
    assert not path.exists()
    assert tf.quantization.fake_quant_with_min_max_vars is original and not tf.config.functions_run_eagerly()


def _converted_frames():
    """The AutoGraph ``converted_call`` frames on the calling thread's Python stack."""
    import sys

    frame, found = sys._getframe(1), 0
    while frame is not None:
        code = frame.f_code
        found += code.co_name == "converted_call" and "autograph" in code.co_filename
        frame = frame.f_back
    return found


@pytest.mark.parametrize("plain", [True, False], ids=["left-unconverted", "converted-control"])
def test_the_recording_callbacks_run_unconverted_by_autograph(tmp_path, monkeypatch, plain):
    """tf.function converts the code of its step with AutoGraph, and code that it converts converts what it calls:
    a wrapper converted so would run every callback of every captured step through ``converted_call`` (most of
    a MobileNetV2 step's callback time before the wrappers were marked ``do_not_convert``).  The callbacks look
    at their own Python stack as they write; the control (the wrappers not marked) shows that the look sees
    conversion where there is some."""
    import qgcli.capture.runfile_writer as writer
    import qgcli.capture.tensorflow as captf

    if not plain:
        monkeypatch.setattr(captf, "_plain_python", lambda tf, wrapper: wrapper)
    seen = []
    put = writer.Group.put

    def watched(self, operands):
        seen.append(_converted_frames())
        return put(self, operands)

    monkeypatch.setattr(writer.Group, "put", watched)
    x = tf.constant(np.linspace(-2, 2, 24, dtype=np.float32).reshape(4, 6))
    lo, hi = tf.Variable(-1.0), tf.Variable(1.0)
    gamma, beta = tf.Variable(np.ones(6, np.float32)), tf.Variable(np.zeros(6, np.float32))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            q = tf.quantization.fake_quant_with_min_max_vars(x, lo, hi)
            if tf.reduce_sum(q) > -100.0:  # control flow on a tensor: AutoGraph converts this body
                q = q * 2.0
            y, _, _ = tf.compat.v1.nn.fused_batch_norm(tf.reshape(q, (4, 1, 1, 6)), gamma, beta)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, [x, lo, hi, gamma, beta])

    with capture(str(tmp_path / "run.h5"), step=0) as cap:
        step(x)
    assert sorted(cap.groups) == ["batch_norm", "fake_quant"]
    assert len(seen) == 4  # each group's forward operands and upstream gradient
    if plain:
        assert seen == [0, 0, 0, 0]
    else:
        assert min(seen) > 0


def test_a_traced_step_does_not_wait_for_its_forward_callbacks(tmp_path):
    """Inside a tf.function the rest of the step runs while a tap's callback writes (automatic control
    dependencies run the taps, in order, and the function returns once they are done): here a forward callback
    waits until an op downstream of the fake quant's output has run, which it could not if the output waited
    for the callback (the step then hung until the callback gave up)."""
    downstream_ran = threading.Event()
    waited = []
    x = tf.constant(np.linspace(-2, 2, 24, dtype=np.float32))

    def downstream(v):
        downstream_ran.set()
        return v

    @tf.function
    def step(x):
        q = tf.quantization.fake_quant_with_min_max_args(x, min=-1.0, max=1.0)
        return tf.reduce_sum(tf.numpy_function(downstream, [q], tf.float32, stateful=False))

    path = str(tmp_path / "run.h5")
    with capture(path, step=0) as cap:
        open_group = cap.writer.open_group

        def slow_open(*args, **kwargs):  # the forward callback, before it writes anything
            waited.append(downstream_ran.wait(timeout=20))
            return open_group(*args, **kwargs)

        cap.writer.open_group = slow_open
        total = float(step(x))
    assert waited == [True]
    assert total == pytest.approx(float(tf.reduce_sum(tf.quantization.fake_quant_with_min_max_args(x, -1.0, 1.0))))
    with h5py.File(path) as f:  # the step's commit waited for the callback's writes
        np.testing.assert_array_equal(f["step_000000/fake_quant/inputs"][()], x.numpy())


def _ops_of_type(concrete, op_type):
    """The ops of ``op_type`` in a traced function's graph and in every function it calls (the tf.cond branches)."""
    graph = concrete.graph.as_graph_def()
    nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
    return sum(n.op == op_type for n in nodes)


def test_a_traced_batch_norm_is_not_rerun_for_its_taps(tmp_path, runner):
    """Traced, a batch norm's taps store the reserve spaces of the step's own FusedBatchNormV3 (what its gradient
    reads) and give them to the reference gradient kernel: no rerun of the op on x (two per batch norm before,
    one in the forward tap, one in the backward); two taps (two tf.conds), not three (the input-gradient check,
    eager only); verify still passes."""
    rng = np.random.default_rng(2)
    x = tf.constant(rng.standard_normal((4, 3, 3, 5)).astype(np.float32))
    gamma, beta = tf.Variable(np.full(5, 1.5, np.float32)), tf.Variable(np.zeros(5, np.float32))
    w = tf.constant(rng.standard_normal((4, 3, 3, 5)).astype(np.float32))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y, _, _ = tf.compat.v1.nn.fused_batch_norm(x, gamma, beta, epsilon=1e-3)
            loss = tf.reduce_sum(y * w)
        return tape.gradient(loss, [x, gamma, beta])

    path = str(tmp_path / "run.h5")
    with capture(path, step=0) as cap:
        step(x)
    assert cap.groups == ["batch_norm"]
    concrete = step.get_concrete_function(x)
    assert _ops_of_type(concrete, "FusedBatchNormV3") == 1
    assert _ops_of_type(concrete, "If") + _ops_of_type(concrete, "StatelessIf") == 2
    r = runner.invoke(main, ["verify", path, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["failed"] == 0
    with h5py.File(path) as f:
        assert "note" not in f["step_000000/batch_norm"].attrs


def test_a_traced_forward_under_an_eager_tape_records_its_gradients(tmp_path, runner):
    """The backward of a tf.function called under an eager GradientTape is a graph TensorFlow builds without
    automatic control dependencies: there the backward taps stay control dependencies of the gradient (else
    nothing would run them) and the group gets its upstream gradient and reference gradients."""
    x = tf.constant(np.linspace(-2, 2, 24, dtype=np.float32).reshape(4, 6))
    lo, hi = tf.Variable(-1.0), tf.Variable(1.0)

    @tf.function
    def forward(x):
        return tf.quantization.fake_quant_with_min_max_vars(x, lo, hi)

    path = str(tmp_path / "run.h5")
    with capture(path, step=0) as cap:
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(forward(x) * tf.range(24, dtype=tf.float32)[:, None][:4])
        tape.gradient(loss, [x, lo, hi])
    assert cap.groups == ["fake_quant"]
    with h5py.File(path) as f:
        g = f["step_000000/fake_quant"]
        assert "gradients" in g and {"backprop_wrt_min", "backprop_wrt_max"} <= set(g["reference"])
    r = runner.invoke(main, ["verify", path, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["failed"] == 0
