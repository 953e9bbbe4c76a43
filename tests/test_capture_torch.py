"""qgcli.capture.torch on real PyTorch QAT models (torch.ao.quantization): a few training steps on data made
here, one step captured; every quantizer and batch norm is in the run file, `qgcli verify` passes (fake quant
bit-identical, batch norm within 1e-5) and the file feeds `report` and `plot layers`."""
import json
import warnings

import h5py
import pytest

torch = pytest.importorskip("torch")

from qgcli.capture.torch import capture  # noqa: E402
from qgcli.cli import main  # noqa: E402
from qgcli.storage.hdf5.digests import digests_of

nn = torch.nn


def _quiet():
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning)


def _net(tq):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant = tq.QuantStub()
            self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
            self.bn1 = nn.BatchNorm2d(8)
            self.relu1 = nn.ReLU(inplace=True)  # in place after a hooked module
            self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
            self.bn2 = nn.BatchNorm2d(8)
            self.relu2 = nn.ReLU()
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.flat = nn.Flatten()
            self.fc = nn.Linear(8, 4)
            self.bn3 = nn.BatchNorm1d(4)
            self.dequant = tq.DeQuantStub()

        def forward(self, x):
            x = self.quant(x)
            x = self.relu1(self.bn1(self.conv1(x)))
            x = self.relu2(self.bn2(self.conv2(x)))
            return self.dequant(self.bn3(self.fc(self.flat(self.pool(x)))))

    return Net()


def _train(model, steps=3, before_step=None):
    torch.manual_seed(1)
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 4, (16,))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i in range(steps):
        if before_step:
            before_step(i)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return x, y, opt


def _step(model, x, y, opt):
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


EXPECTED = ["quant/activation_post_process", "conv1/weight_fake_quant", "conv1/activation_post_process",
            "bn1/activation_post_process", "bn1/batch_norm", "conv2/weight_fake_quant",
            "conv2/activation_post_process", "bn2/activation_post_process", "bn2/batch_norm",
            "fc/weight_fake_quant", "fc/activation_post_process", "bn3"]


@pytest.fixture(scope="module")
def x86_run(tmp_path_factory):
    _quiet()
    import torch.ao.quantization as tq

    torch.manual_seed(0)
    model = _net(tq).train()
    model.qconfig = tq.get_default_qat_qconfig("x86")
    tq.prepare_qat(model, inplace=True)
    x, y, opt = _train(model)
    path = str(tmp_path_factory.mktemp("torch") / "run.h5")
    with capture(model, path, step=3) as cap:
        _step(model, x, y, opt)
    with capture(model, path, step=4):
        _step(model, x, y, opt)
    quantizers = [n for n, m in model.named_modules() if isinstance(m, tq.FakeQuantizeBase)]
    return path, cap, quantizers


def test_every_quantizer_and_batch_norm_is_captured(x86_run):
    path, cap, quantizers = x86_run
    assert len(quantizers) == 9
    assert cap.groups == EXPECTED and cap.skipped == {}
    with h5py.File(path) as f:
        assert sorted(f) == ["step_000003", "step_000004"]
        w = f["step_000003/conv1/weight_fake_quant"]
        assert w.attrs["op"] == "fake_quantize_per_channel_affine" and w.attrs["axis"] == 0
        assert (w.attrs["quant_min"], w.attrs["quant_max"]) == (-128, 127)
        assert w["zero_point"].dtype == "int32" and w["scale"].shape == (8,)
        a = f["step_000003/conv1/activation_post_process"]
        assert a.attrs["op"] == "fake_quantize_per_tensor_affine" and a["scale"].shape == ()
        assert "gradients" in a and "backprops_wrt_input" in digests_of(f, a.name)
        # the model's input needs no gradient: its quantizer is forward only
        assert "gradients" not in f["step_000003/quant/activation_post_process"]
        bn = f["step_000003/bn1/batch_norm"]
        assert bn.attrs["variance_kind"] == "inv-std" and bn.attrs["data_format"] == "NCHW"
        assert f["step_000003/bn3/x"].shape == (16, 4, 1, 1)


def test_verify_and_report(x86_run, tmp_path, runner):
    path = x86_run[0]
    r = runner.invoke(main, ["verify", path, "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["verified"] == 2 * len(EXPECTED) and doc["failed"] == 0
    for layer in doc["layers"]:
        if layer["kind"] == "fake-quant":
            assert layer["status"] == "identical", layer
        else:
            assert layer["rel"] <= 1e-5
    r = runner.invoke(main, ["report", path, "--json"])
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["layers"]) == 2 * 9
    r = runner.invoke(main, ["plot", "layers", path, "-o", str(tmp_path / "layers.png")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(main, ["bn-grad", f"{path}:step_000003", "-o", str(tmp_path / "bn.h5")])
    assert r.exit_code == 0, r.output


def test_lsq_model(tmp_path, runner):
    _quiet()
    import torch.ao.quantization as tq
    from torch.ao.quantization._learnable_fake_quantize import _LearnableFakeQuantize as LSQ

    common = dict(observer=tq.MovingAverageMinMaxObserver, reduce_range=False, use_grad_scaling=True)
    torch.manual_seed(0)
    model = _net(tq).train()
    model.qconfig = tq.QConfig(
        activation=LSQ.with_args(quant_min=0, quant_max=255, dtype=torch.quint8, qscheme=torch.per_tensor_affine,
                                 **common),
        weight=LSQ.with_args(quant_min=-128, quant_max=127, dtype=torch.qint8, qscheme=torch.per_tensor_symmetric,
                             **common))
    tq.prepare_qat(model, inplace=True)
    model.conv2.weight_fake_quant = LSQ(observer=tq.MovingAveragePerChannelMinMaxObserver, quant_min=-128,
                                        quant_max=127, dtype=torch.qint8, qscheme=torch.per_channel_symmetric,
                                        ch_axis=0, channel_len=8, use_grad_scaling=True)

    def learn(i):  # calibrate two steps, then learn the ranges
        if i == 2:
            for m in model.modules():
                if isinstance(m, LSQ):
                    m.enable_param_learning()

    x, y, opt = _train(model, before_step=learn)
    path = str(tmp_path / "lsq.h5")
    with capture(model, path) as cap:
        _step(model, x, y, opt)
    assert cap.groups == EXPECTED
    with h5py.File(path) as f:
        g = f["conv2/weight_fake_quant"]
        assert g.attrs["estimator"] == "lsq" and g.attrs["op"] == "fake_quantize_per_channel_affine"
        assert {"backprop_wrt_scale", "backprop_wrt_zero_point"} <= set(g["reference"])
    r = runner.invoke(main, ["verify", path, "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["verified"] == len(EXPECTED)
    for layer in doc["layers"]:
        if layer["kind"] == "fake-quant":  # element-wise bit for bit; LSQ's scale gradient a sum
            assert layer["outputs"]["outputs"]["identical"] and layer["outputs"]["backprops_wrt_input"]["identical"]


def test_a_failed_step_writes_nothing(tmp_path):
    model = nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2)).train()
    path = tmp_path / "run.h5"
    with pytest.raises(RuntimeError):
        with capture(model, str(path)):
            model(torch.randn(2, 1, 3, 3)).sum().backward()
            raise RuntimeError("diverged")
    assert not path.exists()
    model.eval()
    with capture(model, str(path)) as cap:
        model(torch.randn(2, 1, 3, 3)).sum().backward()
    assert cap.groups == [] and "eval mode" in cap.skipped["1"] and not path.exists()
