"""qgcli.monitor.torch on small PyTorch QAT models (torch.ao eager, torchao): tens of steps with planted
faults, and `qgcli doctor --json` names the layer, the kind and the step; the monitor is passive (bit-for-bit
the same weights), steps count from 1, and `trend` reads the history."""
import json
import warnings

import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from qgcli.cli import main  # noqa: E402
from qgcli.monitor.history import HALF, read_history  # noqa: E402
from qgcli.monitor.torch import monitor  # noqa: E402

nn = torch.nn
pytestmark = pytest.mark.filterwarnings("ignore")


class _ZeroGrad(torch.autograd.Function):
    """Identity forward, zeros backward: a quantizer whose backward was broken."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return torch.zeros_like(dy)


def _net():
    import torch.ao.quantization as tq

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.quant = tq.QuantStub()
            self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
            self.bn1 = nn.BatchNorm2d(8)
            self.relu1 = nn.ReLU(inplace=True)
            self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
            self.relu2 = nn.ReLU()
            self.flat = nn.Flatten()
            self.fc = nn.Linear(8 * 8 * 8, 4)
            self.dequant = tq.DeQuantStub()

        def forward(self, x):
            x = self.relu1(self.bn1(self.conv1(self.quant(x))))
            return self.dequant(self.fc(self.flat(self.relu2(self.conv2(x)))))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = Net()
        model.qconfig = tq.get_default_qat_qconfig("x86")
        model.train()
        tq.prepare_qat(model, inplace=True)
    return model


def _data(steps):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(steps)]


def _train(model, path, steps=14, every=4, plant=None, params=None, lr=0.05, use_monitor=True):
    opt = torch.optim.SGD(model.parameters() if params is None else params, lr=lr)
    ctx = monitor(model, path, every=every, optimizer=opt) if use_monitor else _null()
    with ctx:
        for step, (x, y) in enumerate(_data(steps), start=1):
            if plant:
                plant(step, model)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return model


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _doctor(path, *extra):
    result = CliRunner().invoke(main, ["doctor", str(path), "--json", *extra])
    assert result.exit_code in (0, 3), result.output
    return json.loads(result.output)["findings"]


def _first(findings, kind, layer):
    got = [f for f in findings if f["kind"] == kind and f["layer"] == layer]
    assert got, f"no {kind} on {layer}: {[(f['kind'], f['layer'], f['step']) for f in findings]}"
    return got[0]


def test_healthy_run_has_no_error_and_steps_count_from_one(tmp_path):
    path = tmp_path / "healthy.anything"
    _train(_net(), path, steps=12, every=5, lr=0.01)
    h = read_history(path)
    assert h.steps == [1, 5, 10]  # every=5
    paths = [layer["path"] for layer in h.layers]
    assert paths[:4] == ["quant.activation_post_process", "conv1.weight_fake_quant", "conv1.activation_post_process",
                         "bn1.batch_norm"]  # forward order
    roles = {layer["path"]: layer["role"] for layer in h.layers}
    assert roles["conv2.weight_fake_quant"] == "weight" and roles["fc.activation_post_process"] == "activation"
    findings = _doctor(path)
    assert [f for f in findings if f["severity"] == "error"] == []
    # the input quantizer of data needs no gradient: no finding
    assert not [f for f in findings if f["layer"] == "quant.activation_post_process"]
    s = h.series("conv2.weight_fake_quant")
    assert all(v == 0 for v in s["ste_error"]) and all(v > 0 for v in s["dy_norm"])
    assert s["fake_quant_enabled"] == [1, 1, 1] and s["scale_min"][0] > 0


def test_passive_bit_for_bit(tmp_path):
    plain = _train(_net(), None, steps=6, use_monitor=False)
    watched = _train(_net(), tmp_path / "h", steps=6, every=1)
    a, b = plain.state_dict(), watched.state_dict()
    assert list(a) == list(b)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


def test_steps_counted_by_mon_step(tmp_path):
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with monitor(model, tmp_path / "h", every=3) as mon:
        for x, y in _data(7):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            mon.step()
        with torch.no_grad():
            model(x)  # an evaluation pass after the last step is not a sample
    assert read_history(tmp_path / "h").steps == [1, 3, 6] and mon.step_count == 7


def test_ste_broken(tmp_path):
    def plant(step, model):
        if step == 6:
            m = model.conv2.activation_post_process
            forward = m.forward
            m.forward = lambda x: _ZeroGrad.apply(forward(x))

    _train(_net(), tmp_path / "h", plant=plant)
    findings = _doctor(tmp_path / "h")
    f = _first(findings, "ste_broken", "conv2.activation_post_process")
    assert f["step"] == 8 and f["severity"] == "error"
    upstream = _first(findings, "no_gradient", "conv1.weight_fake_quant")
    assert upstream["step"] == 8 and "conv2.activation_post_process" in upstream["evidence"]


def _clip_everything(m):
    """A quantizer whose scale is 1e-12: every input is clipped (the fused quantizer would compute its scale from
    the observer's range, which always holds zero, so it becomes a plain fake quant on its own buffers)."""
    m.disable_observer()
    m.scale.fill_(1e-12)
    m.zero_point.fill_(0)
    m.forward = lambda x: torch.fake_quantize_per_tensor_affine(x, m.scale, m.zero_point, m.quant_min, m.quant_max)


def test_no_gradient_upstream_of_a_quantizer_clipping_everything(tmp_path):
    def plant(step, model):
        if step == 6:
            _clip_everything(model.conv2.activation_post_process)

    _train(_net(), tmp_path / "h", plant=plant)
    findings = _doctor(tmp_path / "h")
    f = _first(findings, "no_gradient", "bn1.batch_norm")
    assert f["step"] == 8 and "downstream cause: conv2.activation_post_process" in f["evidence"]
    assert _first(findings, "no_gradient", "conv1.weight_fake_quant")["step"] == 8
    assert not [f for f in findings if f["kind"] == "ste_broken"]
    events = json.loads(CliRunner().invoke(main, ["trend", str(tmp_path / "h"), "--json"]).output)["events"]
    assert {"step": 8, "layer": "conv2.activation_post_process", "kind": "clipping_jump"}.items() <= {
        k: v for e in events if e["kind"] == "clipping_jump" for k, v in e.items()}.items()


def test_fake_quant_disabled_mid_run(tmp_path):
    import torch.ao.quantization as tq

    def plant(step, model):
        if step == 6:
            model.apply(tq.disable_fake_quant)

    _train(_net(), tmp_path / "h", plant=plant)
    findings = _doctor(tmp_path / "h")
    f = _first(findings, "fake_quant_disabled", "conv1.weight_fake_quant")
    assert f["step"] == 8 and f["severity"] == "warning"
    assert not [f for f in findings if f["severity"] == "error"]


def _lsq_net(scale=0.05):
    from torch.ao.quantization import MovingAverageMinMaxObserver
    from torch.ao.quantization._learnable_fake_quantize import _LearnableFakeQuantize

    torch.manual_seed(0)
    fq = _LearnableFakeQuantize(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255, scale=scale,
                                zero_point=0.0, use_grad_scaling=True, dtype=torch.quint8)
    fq.enable_param_learning()
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), fq, nn.Linear(16, 4))


def _train_lsq(model, path, steps=20, every=5, plant=None, leave_out_scale=False):
    fq = model[2]
    params = [p for p in model.parameters() if not (leave_out_scale and p is fq.scale)]
    opt = torch.optim.SGD(params, lr=0.01)
    g = torch.Generator().manual_seed(2)
    with monitor(model, path, every=every, optimizer=opt):
        for step in range(1, steps + 1):
            if plant:
                plant(step, model)
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()


def test_range_not_learning(tmp_path):
    _train_lsq(_lsq_net(), tmp_path / "left_out", leave_out_scale=True)
    f = _first(_doctor(tmp_path / "left_out"), "range_not_learning", "2")
    assert f["step"] == 1 and "optimizer" in f["evidence"]
    _train_lsq(_lsq_net(), tmp_path / "in")
    h = read_history(tmp_path / "in")
    assert h.series("2")["in_optimizer"][0] == 1 and h.series("2")["scale_grad_norm"][0] > 0
    assert not [f for f in _doctor(tmp_path / "in") if f["kind"] == "range_not_learning"]


def test_range_collapse(tmp_path):
    def plant(step, model):
        with torch.no_grad():
            model[2].scale.mul_(0.5)

    _train_lsq(_lsq_net(), tmp_path / "h", plant=plant)
    f = _first(_doctor(tmp_path / "h"), "range_collapse", "2")
    assert f["step"] == 10 and f["severity"] == "error"


def test_oscillation(tmp_path):
    """Weights just above a rounding boundary, pulled toward it with a learning rate that makes them cross it
    each step: every weight oscillates."""
    from torch.ao.quantization import FakeQuantize, MinMaxObserver

    class Weights(nn.Module):
        def __init__(self):
            super().__init__()
            self.fq = FakeQuantize(observer=MinMaxObserver, quant_min=-128, quant_max=127, dtype=torch.qint8,
                                   qscheme=torch.per_tensor_symmetric)
            self.fq.scale.fill_(0.1)
            self.fq.zero_point.zero_()
            self.fq.disable_observer()
            k = torch.arange(-8, 8, dtype=torch.float32)
            self.target = (k + 0.5) * 0.1
            self.weight = nn.Parameter(self.target + 0.001)

        def forward(self):
            return self.fq(self.weight)

    def run(path, every):
        model = Weights()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with monitor(model, path, every=every, optimizer=opt):
            for _ in range(20):
                opt.zero_grad()
                ((model() - model.target) ** 2).sum().backward()
                opt.step()
        return read_history(path).series("fq")

    s = run(tmp_path / "h", 5)
    f = _first(_doctor(tmp_path / "h"), "oscillation", "fq")
    assert f["step"] == 5 and f["severity"] == "warning"
    assert s["oscillating"][-1] == 1 and s["codes_changed"][-1] == 1  # 5 steps between samples: all moved
    # counted at every step, not at samples: the frequency at step 5 is 1 - 0.99^3 (flips at steps 3, 4, 5)
    assert s["oscillation_max"][1] == pytest.approx(1 - 0.99 ** 3, rel=1e-5 + 2 ** -11)  # float16 in the history
    every_step = run(tmp_path / "every1", 1)
    # (the same up to float rounding: the frequency's decay is applied lazily, at each sample)
    assert [every_step["oscillation_max"][i - 1] for i in s["steps"]] == pytest.approx(s["oscillation_max"], rel=2 ** -10)


def test_oscillation_kernel_matches_torch_ops(tmp_path, monkeypatch):
    """On the CPU the compiled kernel tracks oscillation in one pass; it gives the bits of the torch ops that run
    elsewhere (QGCLI_NATIVE=0 here): the per-channel weight quantizers of an eager QAT net trained with a
    learning rate that moves their codes."""
    from qgcli.monitor import torch as monitor_torch
    from qgcli.ops.native import library

    if library() is None:
        pytest.skip("the compiled kernels are not built")
    model = _net()
    weight = model.conv2.weight_fake_quant
    weight(model.conv2.weight)  # its observer sets the scales
    layer = monitor_torch._Layer("w", weight, "fake_quant", "torch.ao")
    qparams = monitor_torch._qparams(torch, layer, weight, model.conv2.weight)
    assert qparams[4] == 0 and monitor_torch._oscillation_kernel(torch, model.conv2.weight.detach(), qparams)

    def run(native):
        monkeypatch.setenv("QGCLI_NATIVE", native)
        _train(_net(), tmp_path / f"h{native}", steps=16, every=3, lr=2.0)
        h = read_history(tmp_path / f"h{native}")
        return {p: h.series(p) for p in ("conv1.weight_fake_quant", "conv2.weight_fake_quant", "fc.weight_fake_quant")}

    compiled, ops = run("1"), run("0")
    for path, s in compiled.items():
        for name in ("codes_changed", "oscillating", "oscillation_max"):
            assert s[name] == ops[path][name], (path, name)
    assert max(v for s in compiled.values() for v in s["codes_changed"]) > 0.1
    assert max(v for s in compiled.values() for v in s["oscillation_max"]) > 0


def test_a_nan_weight_makes_no_oscillation_move(tmp_path, monkeypatch):
    """A NaN weight keeps its last integer code (no move, no flip, not counted as changed), in the compiled
    kernel and in the torch ops alike: weights that move by about a grid step each step, some of them NaN on
    some steps."""
    from qgcli.monitor import torch as monitor_torch
    from qgcli.ops.native import library

    if library() is None:
        pytest.skip("the compiled kernels are not built")
    model = _net()
    weight = model.conv2.weight_fake_quant
    w0 = model.conv2.weight.detach().clone()
    weight(w0)  # its observer sets the scales
    g = torch.Generator().manual_seed(3)
    steps = []
    for t in range(9):
        w = w0 + 0.02 * torch.randn(w0.shape, generator=g)
        w.view(-1)[torch.randperm(w.numel(), generator=g)[:40]] = float("nan")
        steps.append(w)

    def run(native):
        monkeypatch.setenv("QGCLI_NATIVE", native)
        layer = monitor_torch._Layer("w", weight, "fake_quant", "torch.ao")
        qparams = monitor_torch._qparams(torch, layer, weight, w0)
        stats, codes = [], []
        with monitor_torch.monitor(_net(), tmp_path / f"h{native}") as mon:
            for t, w in enumerate(steps):
                layer.stats = {}
                mon._track_oscillation(layer, w, None, qparams, sampling=t % 3 == 2)
                stats.append({k: float(v) for k, v in layer.stats.items()})
                codes.append(layer.osc["last"].clone())
        return codes, stats

    (codes, compiled), (ops_codes, ops) = run("1"), run("0")
    assert all(torch.equal(a, b) for a, b in zip(codes, ops_codes))
    assert compiled == [pytest.approx(s, rel=1e-6) for s in ops]  # the torch ops give float32 shares
    assert max(s["codes_changed"] for s in compiled if s) > 0.1
    for t in range(1, len(steps)):  # where a weight is NaN its code is the step before's
        nan = torch.isnan(steps[t])
        assert torch.equal(codes[t][nan], codes[t - 1][nan])
        assert not torch.equal(codes[t][~nan], codes[t - 1][~nan])


def _torchao_block():
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization import qat
    from torchao.quantization.granularity import PerGroup

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))
    quantize_(model, qat.QATConfig(config, step="prepare"), filter_fn=lambda m, fqn: fqn in ("2", "4"))
    return model


def test_sample_statistics_kernel_matches_torch_ops(tmp_path, monkeypatch):
    """On the CPU a sample's statistics come from one compiled pass per tensor (forward, upstream and input
    gradient); the history holds the values of the torch ops that run elsewhere (QGCLI_NATIVE=0 here), to
    float32 precision (the compiled sums are doubles, the torch ops' float32): every statistic of every layer
    of an eager QAT net (per-channel weights, clipped activations, batch norm) and of a torchao model (dynamic
    per-token activations, whose blocks' extremes are left out of the STE check; int4 groups), and of the
    torchao model with a NaN weight (the compiled pass sees a non-finite sum and the torch ops take over)."""
    from qgcli.monitor import torch as monitor_torch
    from qgcli.ops.native import library

    pytest.importorskip("torchao")
    if library() is None:
        pytest.skip("the compiled kernels are not built")
    ran = []
    kernel = monitor_torch.Monitor._forward_kernel
    monkeypatch.setattr(monitor_torch.Monitor, "_forward_kernel",
                        lambda self, *a: ran.append(kernel(self, *a)) or ran[-1])

    def run(native, name):
        monkeypatch.setenv("QGCLI_NATIVE", native)
        ran.clear()
        path = tmp_path / f"{name}{native}"
        if name == "eager":
            _train(_net(), path, steps=9, every=4, lr=0.5)
        else:  # "nan": a NaN weight from step 3, which the compiled passes see and leave to the torch ops
            model, g = _torchao_block(), torch.Generator().manual_seed(3)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            with monitor(model, path, every=1 if name == "nan" else 2, optimizer=opt):
                for step in range(1, 6):
                    if name == "nan" and step == 3:
                        model[2].weight.data[0, 5] = float("nan")
                    x, y = torch.randn(3, 5, 16, generator=g), torch.randint(0, 8, (15,), generator=g)
                    opt.zero_grad()
                    nn.functional.cross_entropy(model(x).reshape(15, 8), y).backward()
                    opt.step()
        h = read_history(path)
        return {layer["path"]: h.series(layer["path"]) for layer in h.layers}

    for name in ("eager", "torchao", "nan"):
        compiled = run("1", name)
        assert ran and (all(ran) or name == "nan"), name  # the kernel ran at every quantizer of every sample
        fell_back = not all(ran)
        ops = run("0", name)
        assert not any(ran) and compiled.keys() == ops.keys()
        for path, series in compiled.items():
            assert series.keys() == ops[path].keys(), path
            for stat, values in series.items():
                if name == "nan" and stat in ("codes_changed", "oscillating", "oscillation_max"):
                    continue  # qg_oscillation keeps a NaN weight's last code; torch's cast of NaN has none
                want = ops[path][stat]
                assert [v is None for v in values] == [v is None for v in want], (name, path, stat)
                # a float16 statistic in the history: float32 values 2e-6 apart may round one float16 step apart
                rel = 2 ** -10 if stat in HALF else 2e-6
                assert [v for v in values if v is not None] == pytest.approx(
                    [v for v in want if v is not None], rel=rel, abs=1e-7, nan_ok=True), (name, path, stat)

        def seen(stat):
            return [v for s in compiled.values() for v in s.get(stat, []) if v is not None]

        if name == "nan":
            assert max(seen("nan_inputs")) > 0 and fell_back
            continue
        if name == "eager":
            assert max(seen("clip_high")) > 0 and max(seen("blocked")) > 0
        assert max(seen("dx_norm")) > 0 and seen("ste_error") and seen("sqnr_db")


def test_history_grows_by_a_few_bytes_per_layer_and_sample_whatever_the_batch(tmp_path):
    """A real monitored run sampled at every step: the history grows by under 50 bytes per layer and sample
    (about 35 measured; so under 5 KiB per sample per 100 layers), and not with the batch size."""
    def grown(batch, steps):
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(1)
        path = tmp_path / f"h{batch}_{steps}"
        with monitor(model, path, every=1, optimizer=opt):
            for _ in range(steps):
                x, y = torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 4, (batch,), generator=g)
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
        return _sample_bytes(path), len(read_history(path).layers)

    per_sample, layers = grown(4, 40)
    assert layers == 9 and 10 < per_sample / layers < 50, per_sample / layers
    assert abs(grown(64, 40)[0] - per_sample) <= 0.1 * per_sample  # sixteen times the batch: rows of the same size


def _sample_bytes(path):
    """history.sample_bytes in a fresh process: it reads SQLite's dbstat table, which Python's sqlite3 has but
    not once TensorFlow's own SQLite is loaded (another test of this session may have imported TensorFlow)."""
    import os
    import subprocess
    import sys

    import qgcli

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (os.path.dirname(os.path.dirname(qgcli.__file__)), os.environ.get("PYTHONPATH")) if p))
    code = "import sys; from qgcli.monitor.history import sample_bytes; print(sample_bytes(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return float(done.stdout)


def test_symmetric_zero_point_reset_every_call_is_no_finding(tmp_path):
    """A learnable symmetric quantizer's zero point is a parameter that its forward resets to 0: it never
    changes, by design, and is no range_not_learning (its scale learns)."""
    from torch.ao.quantization import MovingAverageMinMaxObserver
    from torch.ao.quantization._learnable_fake_quantize import _LearnableFakeQuantize

    torch.manual_seed(0)
    fq = _LearnableFakeQuantize(observer=MovingAverageMinMaxObserver, quant_min=-128, quant_max=127, scale=0.05,
                                zero_point=0.0, use_grad_scaling=True, dtype=torch.qint8,
                                qscheme=torch.per_tensor_symmetric)
    fq.enable_param_learning()
    _train_lsq(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), fq, nn.Linear(16, 4)), tmp_path / "h")
    s = read_history(tmp_path / "h").series("2")
    assert s["zero_point_min"] == s["zero_point_max"] == [0] * 5 and s["scale_median"][0] != s["scale_median"][-1]
    assert s["in_optimizer"] == [1] * 5 and all(v > 0 for v in s["scale_grad_norm"])
    assert [f for f in _doctor(tmp_path / "h") if f["severity"] == "error"] == []


def test_batch_norm_running_against_batch_statistics(tmp_path):
    """bn_mean_shift and bn_var_ratio against the running statistics before the step's update (exact at step
    1: running mean 0, variance 1), and they jump when the inputs' statistics change."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    g = torch.Generator().manual_seed(3)
    data = [torch.randn(16, 3, generator=g) + 1 for _ in range(12)]
    with torch.no_grad():
        h = model[0](data[0])
    eps = model[1].eps
    mean_shift = (h.mean(0).abs() / (1 + eps) ** 0.5).mean().item()
    var_ratio = ((h.var(0, unbiased=False) + eps) / (1 + eps)).log().abs().mean().item()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with monitor(model, tmp_path / "h", every=2, optimizer=opt):
        for step, x in enumerate(data, start=1):
            opt.zero_grad()
            model(x * 20 if step == 12 else x).square().mean().backward()  # the inputs change at step 12
            opt.step()
    s = read_history(tmp_path / "h").series("1")
    assert s["steps"] == [1, 2, 4, 6, 8, 10, 12]
    assert s["bn_mean_shift"][0] == pytest.approx(mean_shift, rel=1e-5)
    assert s["bn_var_ratio"][0] == pytest.approx(var_ratio, rel=1e-5 + 2 ** -11)  # float16 in the history
    # 20 times the inputs: the batch variance 400 times the running one (log 400 = 6)
    assert s["bn_var_ratio"][-1] > max(s["bn_var_ratio"][:-1]) + 2 and all(v > 0 for v in s["dy_norm"])
    assert s["bn_mean_shift"][-1] > 5 * max(s["bn_mean_shift"][:-1])


def test_torchao_model(tmp_path):
    pytest.importorskip("torchao")
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization import qat
    from torchao.quantization.granularity import PerGroup

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))
    quantize_(model, qat.QATConfig(config, step="prepare"), filter_fn=lambda m, fqn: fqn == "2")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with monitor(model, tmp_path / "h", every=2, optimizer=opt):
        for _ in range(4):
            x, y = torch.randn(2, 4, 16), torch.randint(0, 8, (8,))
            opt.zero_grad()
            nn.functional.cross_entropy(model(x).reshape(8, 8), y).backward()
            opt.step()
    h = read_history(tmp_path / "h")
    assert {layer["path"]: layer["role"] for layer in h.layers} == {
        "2.activation_fake_quantizer": "activation", "2.weight_fake_quantizer": "weight"}
    w = h.series("2.weight_fake_quantizer")
    assert w["steps"] == [1, 2, 4] and all(v > 0 for v in w["dy_norm"]) and all(v > 0 for v in w["dx_norm"])
    assert w["clip_low"][0] == 0 and w["scale_min"][0] > 0 and w["codes_changed"][1] is not None
    assert not [f for f in _doctor(tmp_path / "h") if f["severity"] == "error"]


def test_trend_table_fits_80_columns_and_fail_on(tmp_path):
    def plant(step, model):
        if step == 6:
            _clip_everything(model.conv2.activation_post_process)

    _train(_net(), tmp_path / "h", plant=plant)
    result = CliRunner().invoke(main, ["trend", str(tmp_path / "h")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[1].split()[:3] == ["layer", "role", "clip"] and max(map(len, lines[1:])) <= 80
    assert "values at step 12" in lines[0]
    doc = json.loads(CliRunner().invoke(main, ["trend", str(tmp_path / "h"), "--json"]).output)
    layer = doc["layers"][1]
    assert layer["path"] == "conv1.weight_fake_quant" and layer["steps"] == [1, 4, 8, 12]
    assert len(layer["blocked"]) == 4 and {"step", "layer", "kind", "message"} == set(doc["events"][0])
    assert CliRunner().invoke(main, ["doctor", str(tmp_path / "h"), "--fail-on", "error"]).exit_code == 3
    result = CliRunner().invoke(main, ["doctor", str(tmp_path / "h")])
    assert result.exit_code == 0 and "error: no_gradient at step 8: conv1.weight_fake_quant" in result.output
    result = CliRunner().invoke(main, ["trend", str(tmp_path / "h"), "--step", "7"])
    assert result.exit_code == 2 and "no sample at step 7" in result.output
    result = CliRunner().invoke(main, ["plot", "trend", str(tmp_path / "h"), "-o", str(tmp_path / "trend.png")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "trend.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = CliRunner().invoke(main, ["plot", "trend", str(tmp_path / "h"), "-o", str(tmp_path / "trend.png")])
    assert again.exit_code == 2 and "exists; use --force" in again.output


def test_doctor_on_a_run_file(tmp_path):
    from qgcli.capture.torch import capture

    from torch.ao.quantization import FakeQuantize, MovingAverageMinMaxObserver

    model = _net()
    never_ran = FakeQuantize(observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=127)
    never_ran.disable_observer()  # scale 1, zero point 0: FakeQuantize's defaults
    model.conv2.activation_post_process = never_ran
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = _data(1)[0]
    with capture(model, str(tmp_path / "run.h5"), step=7):
        nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    findings = _doctor(tmp_path / "run.h5")
    assert [(f["kind"], f["layer"], f["step"]) for f in findings] == [
        ("observer_default", "conv2/activation_post_process", 7)]
    result = CliRunner().invoke(main, ["doctor", str(tmp_path / "nothing.txt")])
    assert result.exit_code == 2


def _steps_read(accumulator, logdir, tag, want, deadline=30.0):
    """The steps of ``tag`` a reader of ``logdir`` sees, read again until they are ``want`` or ``deadline``
    seconds have passed: tensorboardX's writer hands events to a thread of its own, and its flush() writes out
    what that thread has written, not what is still queued for it, so a read right after a sample often comes
    before the sample's events are in the file; the thread puts them there within about a second
    (qgcli.report.tensorboard.SampleEvents)."""
    import time

    end = time.monotonic() + deadline
    while True:
        acc = accumulator.EventAccumulator(str(logdir))
        acc.Reload()
        got = [e.step for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []
        if got == want or time.monotonic() > end:
            return got
        time.sleep(0.05)


def test_live_tensorboard_events_equal_trends(tmp_path):
    """monitor(..., tensorboard=LOGDIR) writes each sample as it is taken: the same scalars `trend --tensorboard`
    writes from the finished history, read back with TensorBoard's EventAccumulator."""
    pytest.importorskip("tensorboardX")
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

    def plant(step, model):
        if step == 6:
            _clip_everything(model.conv2.activation_post_process)

    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    live = tmp_path / "live"
    with monitor(model, tmp_path / "h", every=4, optimizer=opt, tensorboard=live):
        for step, (x, y) in enumerate(_data(9), start=1):
            plant(step, model)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if step == 4:  # written as it goes: a reader sees steps 1 and 4 before the run ends
                assert _steps_read(accumulator, live, "aggregate/worst_5_gradient_blocked", [1, 4]) == [1, 4]
    result = CliRunner().invoke(main, ["trend", str(tmp_path / "h"), "--tensorboard", str(tmp_path / "after"), "--json"])
    assert result.exit_code == 0, result.output

    def scalars(logdir):
        acc = accumulator.EventAccumulator(str(logdir), size_guidance={"scalars": 0})
        acc.Reload()
        return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}

    got, want = scalars(live), scalars(tmp_path / "after")
    assert got == want and "gradient_blocked/conv2.activation_post_process" in got
    assert [v for _, v in got["aggregate/share_with_events"]][-1] > 0  # the clipping layer's jump at step 8


_TRAINER = """
import sys, warnings
warnings.simplefilter("ignore")
import torch
from qgcli.monitor.torch import monitor
sys.path.insert(0, sys.argv[2])
from test_monitor_torch import _net, _data
model = _net()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = _data(1)[0]
with monitor(model, sys.argv[1], every=1, optimizer=opt) as mon:
    while True:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        print(mon.step_count, flush=True)
"""


@pytest.mark.slow  # a training process per kill: ~30 s on 2 busy cores
@pytest.mark.skipif(__import__("os").environ.get("QGCLI_LONG", "") in ("", "0"), reason="set QGCLI_LONG=1")
def test_sigkill_of_a_training_process(tmp_path):
    """A monitored training loop (every=1) SIGKILLed at a random step: every sample it completed is there,
    whole, and the history reads back (while it ran, too)."""
    import os
    import random
    import signal
    import subprocess
    import sys

    rng = random.Random(37)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    tests = os.path.dirname(os.path.abspath(__file__))
    for attempt in range(2):
        path = tmp_path / f"killed{attempt}"
        proc = subprocess.Popen([sys.executable, "-c", _TRAINER, str(path), tests], stdout=subprocess.PIPE,
                                text=True, env=env)
        want, done = rng.randint(4, 12), 0
        while done < want:
            done = int(proc.stdout.readline())
            if done == 2:
                assert read_history(path).steps[:2] == [1, 2]  # read while it trains
        time_to_die = rng.random() * 0.05
        __import__("time").sleep(time_to_die)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        h = read_history(path)
        # every sample it reported, and the ones it completed between our last read and the kill (it does not
        # wait for us: with its short steps, several), with no gap
        assert len(h.steps) >= done and h.steps == list(range(1, len(h.steps) + 1))
        for layer in h.layers:  # every sample whole: each layer in each
            assert h.series(layer["path"])["steps"] == h.steps
