"""qgcli.monitor.torch on small torchao QAT models (range learning: static scales that are parameters), tens of
steps with each planted fault, and `qgcli doctor --json` names the layer, the kind and the step; the torchao
monitor is passive too (bit-for-bit the same weights)."""
import json
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

from click.testing import CliRunner  # noqa: E402

from qgcli.cli import main  # noqa: E402
from qgcli.monitor.history import read_history  # noqa: E402
from qgcli.monitor.torch import monitor  # noqa: E402
from test_monitor_torch import _null, _ZeroGrad  # noqa: E402

nn = torch.nn
pytestmark = pytest.mark.filterwarnings("ignore")

ACT, WEIGHT = "2.activation_fake_quantizer", "2.weight_fake_quantizer"
UPSTREAM = "0.weight_fake_quantizer"


def _net(dynamic=False):
    """Linear -> Tanh -> Linear, int8 per-token activations and int8 per-channel weights; static, learned
    ranges (``initialize_fake_quantizers``), or the scales computed from each input (``dynamic``)."""
    from torchao.quantization import qat, quantize_

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        learn = {"is_dynamic": dynamic, "range_learning": not dynamic}
        weights = qat.IntxFakeQuantizeConfig(torch.int8, "per_channel", is_symmetric=True, **learn)
        acts = qat.IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False, **learn,
                                          zero_point_precision=torch.float32)
        quantize_(model, qat.QATConfig(activation_config=acts, weight_config=weights, step="prepare"))
        if not dynamic:
            qat.initialize_fake_quantizers(model, (torch.randn(8, 16),))
    return model


def _train(model, path, steps=14, every=4, plant=None, leave_out=(), use_monitor=True):
    left_out = {id(p) for p in leave_out}
    named = [(n, p) for n, p in model.named_parameters() if id(p) not in left_out]
    # an unscaled LSQ gradient is large next to a scale: a small learning rate for the ranges, or they go negative
    is_range = [n.endswith(("scale", "zero_point")) for n, _ in named]
    opt = torch.optim.SGD([{"params": [p for (_, p), r in zip(named, is_range) if not r]},
                           {"params": [p for (_, p), r in zip(named, is_range) if r], "lr": 1e-7}], lr=0.01)
    g = torch.Generator().manual_seed(1)
    with monitor(model, path, every=every, optimizer=opt) if use_monitor else _null():
        for step in range(1, steps + 1):
            if plant:
                plant(step, model)
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return model


def _doctor(path):
    result = CliRunner().invoke(main, ["doctor", str(path), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["findings"]


def _only(findings, kind):
    """``[(layer, step)]`` of the findings of ``kind``."""
    return [(f["layer"], f["step"]) for f in findings if f["kind"] == kind]


def _errors(findings):
    return [(f["kind"], f["layer"], f["step"]) for f in findings if f["severity"] == "error"]


def test_healthy_static_and_dynamic_and_passive(tmp_path):
    _train(_net(), tmp_path / "static")
    h = read_history(tmp_path / "static")
    assert h.steps == [1, 4, 8, 12]
    assert [layer["path"] for layer in h.layers] == ["0.activation_fake_quantizer", UPSTREAM, ACT, WEIGHT]
    s = h.series(WEIGHT)
    assert all(v > 0 for v in s["scale_grad_norm"]) and s["in_optimizer"] == [1, 1, 1, 1]
    assert all(v < 1e-3 for v in s["ste_error"]) and all(v < 1e-3 for v in h.series(ACT)["ste_error"])
    assert s["scale_median"][0] != s["scale_median"][-1]  # the learned scale moves
    assert _errors(_doctor(tmp_path / "static")) == []
    # dynamic scales pass gradient to each block's min and max too: compared on the other elements
    _train(_net(dynamic=True), tmp_path / "dynamic")
    d = read_history(tmp_path / "dynamic")
    assert all(v < 1e-3 for v in d.series(WEIGHT)["ste_error"]) and d.series(WEIGHT)["scale_grad_norm"] == [None] * 4
    assert _errors(_doctor(tmp_path / "dynamic")) == []
    # a dynamic input quantizer of data needs no gradient and never gets one, by design: not a finding
    assert d.series("0.activation_fake_quantizer")["needs_grad"] == [0] * 4
    plain = _train(_net(), None, use_monitor=False).state_dict()
    watched = _train(_net(), tmp_path / "every1", every=1).state_dict()
    assert list(plain) == list(watched) and all(torch.equal(plain[k], watched[k]) for k in plain)


def test_ste_broken(tmp_path):
    def plant(step, model):
        if step == 6:
            m = model[2].activation_fake_quantizer
            forward = m.forward
            m.forward = lambda x: _ZeroGrad.apply(forward(x))

    _train(_net(), tmp_path / "h", plant=plant)
    findings = _doctor(tmp_path / "h")
    assert _only(findings, "ste_broken") == [(ACT, 8)]
    assert (UPSTREAM, 8) in _only(findings, "no_gradient")


def test_range_not_learning(tmp_path):
    model = _net()
    _train(model, tmp_path / "h", leave_out=[model[2].weight_fake_quantizer.scale])
    findings = _doctor(tmp_path / "h")
    assert _only(findings, "range_not_learning") == [(WEIGHT, 1)]
    assert "optimizer" in [f for f in findings if f["kind"] == "range_not_learning"][0]["evidence"]


def test_no_gradient_upstream_of_a_quantizer_clipping_everything(tmp_path):
    def plant(step, model):
        if step >= 6:  # forced every step: the learned scale would otherwise grow back
            with torch.no_grad():
                model[2].activation_fake_quantizer.scale.fill_(1e-12)

    _train(_net(), tmp_path / "h", plant=plant)
    findings = _doctor(tmp_path / "h")
    # the input quantizer's learned range gets no gradient either (its output needs one, for the scale)
    assert _only(findings, "no_gradient") == [("0.activation_fake_quantizer", 8), (UPSTREAM, 8)]
    assert all(f"downstream cause: {ACT} passes no gradient" in f["evidence"]
               for f in findings if f["kind"] == "no_gradient")
    assert _only(findings, "ste_broken") == []


def test_range_collapse(tmp_path):
    def plant(step, model):
        with torch.no_grad():
            model[2].weight_fake_quantizer.scale.mul_(0.5)

    _train(_net(), tmp_path / "h", plant=plant)
    findings = _doctor(tmp_path / "h")
    assert _only(findings, "range_collapse") == [(WEIGHT, 8)]  # below 1 % of the median scale sampled before


def test_fake_quant_disabled_mid_run(tmp_path):
    def plant(step, model):
        if step == 6:
            for m in model.modules():
                if hasattr(m, "enabled"):
                    m.enabled = False

    _train(_net(), tmp_path / "h", plant=plant)
    findings = _doctor(tmp_path / "h")
    assert _only(findings, "fake_quant_disabled") == [("0.activation_fake_quantizer", 8), (UPSTREAM, 8), (ACT, 8),
                                                       (WEIGHT, 8)]
    assert _errors(findings) == []


def test_oscillation(tmp_path):
    """Weights just above a rounding boundary of a frozen int8 grid (scale 0.1), pulled to the boundary with a
    learning rate that makes them cross it at every step."""
    from torchao.quantization.qat import IntxFakeQuantizeConfig, IntxFakeQuantizer

    class Weights(nn.Module):
        def __init__(self):
            super().__init__()
            config = IntxFakeQuantizeConfig(torch.int8, "per_channel", is_symmetric=True, is_dynamic=False)
            self.fq = IntxFakeQuantizer(config)
            self.fq.scale = torch.full((2, 1), 0.1)
            self.fq.zero_point = torch.zeros(2, 1, dtype=torch.int32)
            self.target = ((torch.arange(-8, 8, dtype=torch.float32) + 0.5) * 0.1).reshape(2, 8)
            self.weight = nn.Parameter(self.target + 0.001)

        def forward(self):
            return self.fq(self.weight)

    model = Weights()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with monitor(model, tmp_path / "h", every=5, optimizer=opt):
        for _ in range(20):
            opt.zero_grad()
            ((model() - model.target) ** 2).sum().backward()
            opt.step()
    findings = _doctor(tmp_path / "h")
    assert _only(findings, "oscillation") == [("fq", 5)]
    assert _errors(findings) == []
    s = read_history(tmp_path / "h").series("fq")
    assert s["oscillating"] == [0, 1, 1, 1, 1] and s["ste_error"][0] < 1e-6
