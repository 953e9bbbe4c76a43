"""Capture on real architectures (tests/capture_models.py), a few CPU training steps on small inputs: a ResNet-18
in eager torch.ao QAT and through FX prepare_qat_fx, a Llama-style decoder under torchao QAT, a tf_keras
MobileNetV2 under tfmot inside model.fit (a compiled train function, not eager).  Each run file holds one group
per quantizer call and batch norm, and every per-layer command takes it."""
import json
import os
import re
import warnings

import h5py
import pytest

from qgcli.cli import main
from qgcli.storage.hdf5.digests import digests_of

HERE = os.path.dirname(os.path.abspath(__file__))


def _quiet():
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def _commands_pass(runner, path, tmp_path, *, bn=True, forward_only=()):
    """Every per-layer command exits 0 on the fresh run file, without --skip-invalid: the gradient commands
    leave out the forward-only groups (the model's first quantizer) and name them; returns verify's document."""
    out = tmp_path / "out"
    out.mkdir()
    commands = [["fakequant-grad", path, "-o", str(out / "fq.h5"), "--json"],
                ["report", path, "--json"], ["plot", "layers", path, "-o", str(out / "layers.png")],
                ["inspect", path]]
    if bn:
        commands.append(["bn-grad", path, "-o", str(out / "bn.h5"), "--json"])
    for args in commands:
        r = runner.invoke(main, args)
        assert r.exit_code == 0, (args, r.output)
        if args[0] in ("fakequant-grad", "bn-grad"):
            doc = json.loads(r.stdout)
            assert doc["skipped_invalid"] == 0
            assert [g["path"] for g in doc["forward_only"]] == (list(forward_only) if args[0] == "fakequant-grad"
                                                                 else [])
    r = runner.invoke(main, ["verify", path, "--json"])
    doc = json.loads(r.stdout)
    return r.exit_code, doc


def _torch_steps(model, make_batch, path, *, steps=2, captured=(1,), **options):
    import torch

    from qgcli.capture.torch import capture

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with capture(model, path, steps=captured, **options) as cap:
        for i in range(steps):
            x, y = make_batch(i)
            with cap.step(i):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, model_classes(model)), y.reshape(-1))
                loss.backward()
                opt.step()
    return cap


def model_classes(model):
    return getattr(model, "classes", None) or 10


def _images(torch, batch=4, size=16):
    def make(i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 10, (batch,), generator=g)
    return make


def _counts(torch, model):
    from torch.ao.quantization import FakeQuantizeBase

    fq = [m for m in model.modules() if isinstance(m, FakeQuantizeBase)]
    bn = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    return fq, bn


def test_resnet18_eager_qat(tmp_path, runner):
    torch = pytest.importorskip("torch")
    _quiet()
    from capture_models import eager_qat_resnet18

    model = eager_qat_resnet18(width=16)
    path = str(tmp_path / "resnet.h5")
    cap = _torch_steps(model, _images(torch), path)
    fq, bn = _counts(torch, model)
    assert (len(fq), len(bn)) == (51, 20)  # 21 weights, 30 activations (stub, conv outputs, skip adds); 20 BNs
    assert len(cap.groups) == len(fq) + len(bn) and cap.skipped == {}
    with h5py.File(path) as f:
        assert list(f) == ["step_000001"]
        assert "layer2/0/skip/activation_post_process" in f["step_000001"]
    code, doc = _commands_pass(runner, path, tmp_path, forward_only=["step_000001/quant/activation_post_process"])
    assert code == 0 and doc["failed"] == 0 and doc["verified"] == len(cap.groups), doc
    # PyTorch's groups read as TensorFlow's: per-channel rows with their worst channel and SQNR', report --layer
    rows = {r["layer"]: r for r in json.loads(runner.invoke(main, ["report", path, "--json"]).stdout)["layers"]}
    weight = rows["layer2/0/conv1/weight_fake_quant"]
    assert weight["channels"] == 32 and weight["worst_channel"] is not None and weight["suggested_sqnr_db"] > 0
    act = rows["layer2/0/conv1/activation_post_process"]
    assert act["suggested_scale"] > 0 and act["suggested_zero_point"] is not None
    r = runner.invoke(main, ["report", path, "--layer", "step_000001/layer2/0/conv1/weight_fake_quant", "--json"])
    assert r.exit_code == 0, r.output
    layer = json.loads(r.stdout)
    assert layer["variant"] == "torch" and layer["per_channel"] and layer["channels"] == 32
    assert layer["attributes"]["qscheme"] == "per_channel_symmetric"
    assert all(row["suggested_scale"] > 0 and row["suggested_zero_point"] == 0 for row in layer["rows"])
    r = runner.invoke(main, ["report", path, "--layer", "step_000001/layer2/0/conv1/activation_post_process"])
    assert r.exit_code == 0 and "scale/zero_point" in r.output, r.output


def test_resnet18_planted_clipping_starves_every_upstream_layer(tmp_path, runner):
    """A downstream quantizer that clips everything (the logits' FakeQuantize frozen on a grid of float32's
    smallest scale around 0): every layer upstream gets an all-zero gradient, and report says so on each of
    them (``upstream_gradient: "zero"``, no blocked share) and names the clipping layer in the verdict."""
    torch = pytest.importorskip("torch")
    _quiet()
    from capture_models import eager_qat_resnet18

    model = eager_qat_resnet18(width=8)
    model(torch.randn(2, 3, 16, 16))  # the observers see data once
    logits = model.fc.activation_post_process  # fused: its qparams follow its observer's min/max when frozen
    logits.disable_observer()
    logits.activation_post_process.min_val.fill_(-1e-9)
    logits.activation_post_process.max_val.fill_(1e-9)  # scale: float32's eps, the floor of torch's observer
    path = str(tmp_path / "resnet.h5")
    _torch_steps(model, _images(torch, batch=2), path, steps=1, captured=(0,))
    r = runner.invoke(main, ["report", path, "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    rows = {row["layer"]: row for row in doc["layers"]}
    cause = rows.pop("fc/activation_post_process")
    assert cause["upstream_gradient"] == "present" and cause["clipped"] == 1.0
    assert rows.pop("quant/activation_post_process")["upstream_gradient"] == "absent"  # the input needs none
    assert len(rows) == 49 and {row["upstream_gradient"] for row in rows.values()} == {"zero"}
    assert all(row["gradient_blocked"] is None for row in rows.values())
    assert doc["verdict"].startswith(
        "Verdict: no gradient reaches 49 layers: step_000000/fc/activation_post_process clips 100%"), doc["verdict"]


def test_resnet18_fx_names_each_observer_by_its_node(tmp_path, runner):
    torch = pytest.importorskip("torch")
    _quiet()
    from capture_models import fx_qat_resnet18

    model = fx_qat_resnet18(width=16, size=16)
    path = str(tmp_path / "fx.h5")
    cap = _torch_steps(model, _images(torch), path)
    from torch.ao.quantization import FakeQuantizeBase

    fq, bn = _counts(torch, model)
    observer_calls = [n for n in model.graph.nodes if n.op == "call_module"
                      and isinstance(model.get_submodule(n.target), FakeQuantizeBase)]
    weights = [n for n, m in model.named_modules() if n.endswith("weight_fake_quant")]
    assert len(cap.groups) == len(observer_calls) + len(weights) + len(bn) and cap.skipped == {}
    assert not [g for g in cap.groups if re.search(r"activation_post_process_\d+", g)], cap.groups
    assert "x/activation_post_process" in cap.groups and "fc/activation_post_process" in cap.groups
    with h5py.File(path) as f:
        g = f["step_000001/layer1/0/relu/activation_post_process"]
        assert re.fullmatch(r"activation_post_process_\d+", g.attrs["observer"])
    code, doc = _commands_pass(runner, path, tmp_path, forward_only=["step_000001/x/activation_post_process"])
    assert code == 0 and doc["failed"] == 0, [r for r in doc["layers"] if not r["passed"]]


def test_llama_decoder_torchao_qat(tmp_path, runner):
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchao")
    _quiet()
    from capture_models import llama

    model = llama()
    model.classes = 128
    path = str(tmp_path / "llama.h5")

    def tokens(i):
        g = torch.Generator().manual_seed(i)
        t = torch.randint(0, 128, (2, 17), generator=g)
        return t[:, :-1], t[:, 1:]

    cap = _torch_steps(model, tokens, path)
    linears = [m for m in model.modules() if type(m).__name__ == "FakeQuantizedLinear"]
    assert len(linears) == 4 * 7 + 1 and len(cap.groups) == 2 * len(linears), cap.skipped
    with h5py.File(path) as f:
        w = f["step_000001/layers/0/q/weight_fake_quantizer"]
        assert w.attrs["granularity"] == "per-group:32" and w.attrs["dtype"] == "int4"
        assert f["step_000001/layers/0/q/activation_fake_quantizer"].attrs["granularity"] == "per-token"
    code, doc = _commands_pass(runner, path, tmp_path, bn=False)
    assert code == 0 and doc["failed"] == 0, [r for r in doc["layers"] if not r["passed"]]
    r = runner.invoke(main, ["report", path, "--layer", "step_000001/layers/0/q/weight_fake_quantizer", "--json"])
    assert r.exit_code == 0, r.output
    layer = json.loads(r.stdout)  # torchao's per-block report on the group's own config
    assert layer["semantics"] == "torchao" and layer["blocks"] == 64 * 64 // 32 and layer["block_size"] == 32


def test_torch_options_choose_what_to_keep(tmp_path):
    torch = pytest.importorskip("torch")
    _quiet()
    from capture_models import eager_qat_resnet18

    model = eager_qat_resnet18(width=8)
    path = str(tmp_path / "w.h5")
    cap = _torch_steps(model, _images(torch, 2, 8), path, steps=5, captured=None, every=2, keep="weights",
                       layers=["layer1/*", "fc/*"], compression="gzip")
    with h5py.File(path) as f:
        assert list(f) == ["step_000000", "step_000002", "step_000004"]
        groups = []
        f["step_000004"].visititems(lambda n, o: groups.append(n) if "op" in o.attrs else None)
        assert sorted(groups) == sorted(cap.groups) and all(g.endswith("weight_fake_quant") for g in groups)
        assert len(groups) == 5 and f["step_000004/fc/weight_fake_quant/inputs"].compression == "gzip"
    path = str(tmp_path / "forward.h5")
    _torch_steps(model, _images(torch, 2, 8), path, keep="forward")
    with h5py.File(path) as f:
        s = f["step_000001"]
        assert "gradients" not in s["conv1/activation_post_process"] and "y_backprop" not in s["conv1/bn"]
        assert "reference" not in s["conv1/activation_post_process"]  # its one reference, outputs, is a digest
        assert set(digests_of(f, "step_000001/conv1/activation_post_process")) == {"outputs"}


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("QGCLI_LONG"), reason="tfmot's quantize_model and the trace of MobileNetV2 "
                    "take minutes on a shared CPU: set QGCLI_LONG=1")
def test_mobilenet_v2_in_model_fit(tmp_path, runner):
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    tf = pytest.importorskip("tensorflow")
    pytest.importorskip("tf_keras")
    pytest.importorskip("tensorflow_model_optimization")
    if not tf.keras.__name__.startswith("tf_keras"):
        pytest.skip("tf.keras is not tf_keras (TensorFlow was imported before TF_USE_LEGACY_KERAS=1)")
    import numpy as np

    from capture_models import mobilenet_v2, tfmot_quantizer_calls
    from qgcli.capture.tensorflow import capture

    tf.keras.backend.clear_session()
    model = mobilenet_v2(size=32)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 32, 32, 3)).astype("float32"), rng.integers(0, 10, 8)
    path = str(tmp_path / "mnv2.h5")
    with capture(path, steps=[1]) as cap:
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[cap.keras_callback()])
    assert not tf.config.functions_run_eagerly()
    bn = [layer for layer in model.layers if type(getattr(layer, "layer", layer)).__name__ == "BatchNormalization"]
    assert len(bn) == 52
    assert len(cap.groups) == tfmot_quantizer_calls(model) + len(bn), (len(cap.groups), cap.skipped)
    with h5py.File(path) as f:
        assert list(f) == ["step_000001"]
    # the input QuantizeLayer sees inputs that need no gradient: its group is forward-only
    code, doc = _commands_pass(runner, path, tmp_path,
                               forward_only=["step_000001/mobilenetv2_0/35_32/quantize_layer/AllValuesQuantize"])
    failed = [r for r in doc["layers"] if not r["passed"]]
    # every batch norm passes, offset_backprop too (within float32's summation bound where TF's sum is the one off)
    assert code == 0 and not failed, failed
    assert all(r["status"] == "identical" for r in doc["layers"] if r["kind"] == "fake-quant")


def test_tf_model_fit_in_graph_mode_every_n_steps(tmp_path, runner, request):
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    tf = pytest.importorskip("tensorflow")
    pytest.importorskip("tf_keras")
    tfmot = pytest.importorskip("tensorflow_model_optimization")
    if not tf.keras.__name__.startswith("tf_keras"):
        pytest.skip("tf.keras is not tf_keras (TensorFlow was imported before TF_USE_LEGACY_KERAS=1)")
    import numpy as np

    from qgcli.capture.tensorflow import capture

    keras = tf.keras
    layers = keras.layers
    keras.backend.clear_session()  # layer names (quantize_layer, not quantize_layer_3) as in a fresh process
    request.addfinalizer(keras.backend.clear_session)
    tf.random.set_seed(0)
    model = tfmot.quantization.keras.quantize_model(keras.Sequential(
        [layers.Input((6, 6, 2)), layers.Conv2D(4, 3, name="conv"), layers.BatchNormalization(name="bn"),
         layers.ReLU(name="relu"), layers.Flatten(), layers.Dense(3, name="fc")], name="sequential"))
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, 6, 6, 2)).astype("float32"), rng.integers(0, 3, 16)
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)  # 4 steps, compiled before the capture
    path = str(tmp_path / "fit.h5")
    with capture(path, every=3) as cap:
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[cap.keras_callback()])  # steps 4..7
    assert not tf.config.functions_run_eagerly()
    expected = ["sequential/quantize_layer/AllValuesQuantize", "sequential/quant_conv/LastValueQuant",
                "sequential/quant_bn", "sequential/quant_relu/MovingAvgQuantize",
                "sequential/quant_fc/LastValueQuant", "sequential/quant_fc/MovingAvgQuantize"]
    assert cap.groups == expected and cap.skipped == {}
    with h5py.File(path) as f:
        assert list(f) == ["step_000006"]
        assert "gradients" in f["step_000006/sequential/quant_relu/MovingAvgQuantize"]
    r = runner.invoke(main, ["verify", path, "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["verified"] == len(expected) and doc["failed"] == 0
    r = runner.invoke(main, ["report", path, "--layer", "step_000006/sequential/quant_conv/LastValueQuant", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["channels"] == 4
    path = str(tmp_path / "weights.h5")
    # the train function traced with the taps records into whichever capture runs: here the block is the step
    with capture(path, keep="weights", step=9) as cap:
        model.fit(x[:4], y[:4], batch_size=4, epochs=1, verbose=0)
    assert cap.groups == ["sequential/quant_conv/LastValueQuant", "sequential/quant_fc/LastValueQuant"]
    with h5py.File(path) as f:
        assert list(f) == ["step_000009"]
