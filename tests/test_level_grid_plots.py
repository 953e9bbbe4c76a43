"""``qgcli plot ste|hist|channels|staircase`` of PyTorch and torchao groups (#36 item 4): each drawn on its own
framework's grid (PyTorch's scale/zero_point and quant_min/quant_max, torchao's per-block scale from the data),
chosen through the family registry.  Fresh captures of tiny real models (torch.ao eager QAT, torchao QAT); the
numbers drawn are checked against torch's own forward and autograd on the stored inputs, not just the files."""
import json
import warnings

import h5py
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from test_block_plots import png_size  # noqa: E402

STEP = "step_000000"


def _quiet():
    for category in (DeprecationWarning, UserWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category)


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory):
    """A QuantStub -> Linear(16, 12) -> DeQuantStub under eager torch.ao QAT (fbgemm: per-channel symmetric
    qint8 weights, quint8 activations on [0, 127]); the Linear's output quantizer frozen on a narrow grid
    (scale 0.02, zero point 64: both sides clip) so that the mask has two edges.  One captured step."""
    _quiet()
    import torch.ao.quantization as tq

    from qgcli.capture.torch import capture

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.quant, self.fc, self.dequant = tq.QuantStub(), torch.nn.Linear(16, 12), tq.DeQuantStub()

        def forward(self, x):
            return self.dequant(self.fc(self.quant(x)))

    torch.manual_seed(0)
    model = Model()
    model.qconfig = tq.get_default_qat_qconfig("fbgemm")
    tq.prepare_qat(model.train(), inplace=True)
    model(torch.randn(64, 16))  # the observers see data once
    model.apply(tq.disable_observer)
    fq = model.fc.activation_post_process  # fused: its qparams follow its observer's min/max even when frozen
    fq.activation_post_process.min_val.fill_(-1.28)
    fq.activation_post_process.max_val.fill_(1.26)
    fq.scale.fill_(0.02)
    fq.zero_point.fill_(64)
    path = str(tmp_path_factory.mktemp("torch") / "run.h5")
    with capture(model, path) as cap:
        with cap.step(0):
            model(torch.randn(64, 16)).square().sum().backward()
    return path, model


def _figure(path, kind, layer, **options):
    """The Figure ``qgcli plot KIND RUN --layer LAYER`` draws (in this process, to read its artists)."""
    from qgcli.report import layer_figures

    tasks, _ = layer_figures.plan(path, kind, plot_options=options, layer=f"{STEP}/{layer}")
    return layer_figures.draw(tasks[0])


def _group(path, layer):
    with h5py.File(path) as f:
        g = f[f"{STEP}/{layer}"]
        return {k: v[()] for k, v in g.items() if isinstance(v, h5py.Dataset)}, dict(g.attrs)


def _torch_grad(x, g, scale, zero_point, qmin, qmax, axis=None):
    """torch's own forward and input gradient of the stored operands."""
    t = torch.tensor(x, requires_grad=True)
    if axis is None:
        y = torch.fake_quantize_per_tensor_affine(t, float(scale), int(zero_point), qmin, qmax)
    else:
        y = torch.fake_quantize_per_channel_affine(t, torch.tensor(scale), torch.tensor(zero_point, dtype=torch.int32),
                                                   axis, qmin, qmax)
    y.backward(torch.tensor(g))
    return y.detach().numpy(), t.grad.numpy()


def _line(fig, gid):
    return next(line for ax in fig.axes for line in ax.get_lines() if line.get_gid() == gid)


def _pairs_drawn_are_the_ops(xs, ys, x, y):
    """Every drawn point (xs[i], ys[i]) is a pair (x[j], y[j]) of the op's values."""
    by_x = {}
    for a, b in zip(x.reshape(-1).tolist(), y.reshape(-1).tolist()):
        by_x.setdefault(a, set()).add(b)
    assert len(xs) > 0
    assert all(b in by_x.get(a, ()) for a, b in zip(np.asarray(xs).tolist(), np.asarray(ys).tolist()))


def test_torch_ste_draws_torch_own_mask_and_edges(torch_run):
    path, _ = torch_run
    d, a = _group(path, "fc/activation_post_process")
    qmin, qmax = int(a["quant_min"]), int(a["quant_max"])
    y, grad = _torch_grad(d["inputs"], d["gradients"], d["scale"], d["zero_point"], qmin, qmax)
    _, mask = _torch_grad(d["inputs"], np.ones_like(d["inputs"]), d["scale"], d["zero_point"], qmin, qmax)
    assert 0 < mask.mean() < 1 and (d["inputs"] < 0).any()  # clipped on both sides: a real test of the edges
    fig = _figure(path, "ste", "fc/activation_post_process")
    s = fig.qgcli_summary
    assert s["op"] == "torch.fake_quantize_per_tensor_affine" and s["mask_drawn"] == "step"
    assert s["grid"]["scale"] == pytest.approx(0.02, rel=1e-5) and s["grid"]["zero_point"] == 64
    outputs, points, bp = _line(fig, "outputs"), _line(fig, "mask"), _line(fig, "backprops")
    _pairs_drawn_are_the_ops(outputs.get_xdata(), outputs.get_ydata(), d["inputs"], y)
    _pairs_drawn_are_the_ops(points.get_xdata(), points.get_ydata(), d["inputs"], mask)
    _pairs_drawn_are_the_ops(bp.get_xdata(), bp.get_ydata(), d["inputs"], grad)
    # The step's edges are the last floats torch lets through: 1 at each edge, 0 one float32 beyond.
    xs = np.asarray(_line(fig, "mask_step").get_xdata(), np.float32)
    lo, hi = xs[1], xs[-2]
    beyond = np.float32([np.nextafter(lo, np.float32(-np.inf)), lo, hi, np.nextafter(hi, np.float32(np.inf))])
    _, at = _torch_grad(beyond, np.ones(4, np.float32), d["scale"], d["zero_point"], qmin, qmax)
    assert at.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert lo < (qmin - 64) * 0.02 < hi  # half a step outside the grid's range: PyTorch tests the rounded integer


def test_torch_per_channel_weight_channel_and_channels(torch_run):
    path, model = torch_run
    d, a = _group(path, "fc/weight_fake_quant")
    qmin, qmax, axis = int(a["quant_min"]), int(a["quant_max"]), int(a["axis"])
    _, mask = _torch_grad(d["inputs"], np.ones_like(d["inputs"]), d["scale"], d["zero_point"], qmin, qmax, axis)
    fig = _figure(path, "ste", "fc/weight_fake_quant", channel=3)
    points = _line(fig, "mask")
    _pairs_drawn_are_the_ops(points.get_xdata(), points.get_ydata(), d["inputs"][3], mask[3])
    assert fig.qgcli_summary["channel"] == 3 and fig.qgcli_summary["grid"]["scale"] == pytest.approx(
        float(d["scale"][3]))
    # plot channels: per channel the share torch clips (its mask on the rounded integer), the grid's range
    fig = _figure(path, "channels", "fc/weight_fake_quant")
    s = fig.qgcli_summary
    assert s["channels"] == 12 and s["op"] == "torch.fake_quantize_per_channel_affine"
    clipped = 1 - mask.reshape(12, -1).mean(axis=1)
    np.testing.assert_array_equal(np.add(s["clipped_below"], s["clipped_above"]), clipped)
    np.testing.assert_allclose(s["grid"]["min"], (qmin - d["zero_point"]) * d["scale"], rtol=1e-6)


def test_torch_hist_shares_are_torch_clipping(torch_run, cli, tmp_path):
    path, _ = torch_run
    d, a = _group(path, "fc/activation_post_process")
    x = d["inputs"]
    q = np.rint(x / np.float32(d["scale"])) + int(d["zero_point"])  # the integer torch clips
    r = cli("plot", "hist", path, "--layer", f"{STEP}/fc/activation_post_process", "-o", tmp_path / "h.png", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["clipped_below"] == pytest.approx((q < int(a["quant_min"])).mean())
    assert s["clipped_above"] == pytest.approx((q > int(a["quant_max"])).mean())
    assert s["clipped_below"] > 0 and s["clipped_above"] > 0
    png_size(tmp_path / "h.png")


def test_plot_ste_of_a_run_draws_the_torch_groups(torch_run, cli, tmp_path):
    path, _ = torch_run
    r = cli("plot", "ste", path, "-o", f"{tmp_path}/figs/", "--json")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert sorted(l["path"].split("/", 1)[1] for l in s["layers"]) == [
        "fc/activation_post_process", "fc/weight_fake_quant", "quant/activation_post_process"]
    assert s["skipped"] == []
    for layer in s["layers"]:
        png_size(layer["file"])
    r = cli("plot", "channels", path, "--layer", f"{STEP}/quant/activation_post_process", "-o", tmp_path / "c.png")
    assert r.exit_code == 2 and "per tensor" in r.output and not (tmp_path / "c.png").exists()


@pytest.fixture(scope="module")
def torchao_run(tmp_path_factory):
    """Linear(64, 16) -> ReLU -> Linear(16, 4) under torchao QAT (int4 weights per group of 16, int8 per-token
    activations), one captured step; the model kept to run torchao's own quantizers on the stored inputs."""
    pytest.importorskip("torchao")
    _quiet()
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    from torchao.quantization.qat import QATConfig

    from qgcli.capture.torch import capture

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    config = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(16))
    quantize_(model, QATConfig(config, step="prepare"), filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear))
    path = str(tmp_path_factory.mktemp("torchao") / "run.h5")
    with capture(model, path) as cap:
        with cap.step(0):
            model(torch.randn(8, 64)).square().sum().backward()
    return path, model


def _torchao_grad(quantizer, x, g):
    t = torch.tensor(x, requires_grad=True)
    y = quantizer(t)
    y.backward(torch.tensor(g))
    return y.detach().numpy(), t.grad.numpy()


def test_torchao_ste_per_block_is_torchao_own(torchao_run, cli, tmp_path):
    path, model = torchao_run
    d, _ = _group(path, "0/weight_fake_quantizer")
    x = d["inputs"]
    y, mask = _torchao_grad(model[0].weight_fake_quantizer, x, np.ones_like(x))
    blocks = lambda a: a.reshape(-1, 16)  # noqa: E731 (per group of 16 along the rows)
    fig = _figure(path, "ste", "0/weight_fake_quantizer", channel=5)
    s = fig.qgcli_summary
    assert s["op"] == "torchao.IntxFakeQuantizer" and s["channel"] == 5 and s["points"] == 16
    outputs, points = _line(fig, "outputs"), _line(fig, "mask")
    _pairs_drawn_are_the_ops(outputs.get_xdata(), outputs.get_ydata(), blocks(x)[5], blocks(y)[5])
    _pairs_drawn_are_the_ops(points.get_xdata(), points.get_ydata(), blocks(x)[5], blocks(mask)[5])
    # block 5's grid: torchao's symmetric int4 scale from the block's own data, levels (q - 0) * scale
    assert s["grid"]["scale"] == pytest.approx(float(np.abs(blocks(x)[5]).max() / 7.5), rel=1e-6)
    levels = sorted(set(blocks(y)[5].tolist()))
    assert all(abs(v / s["grid"]["scale"] - round(v / s["grid"]["scale"])) < 1e-4 for v in levels)
    # plot channels: per block, the share torchao's gradient zeroes, above (x beyond the top level)
    fig = _figure(path, "channels", "0/weight_fake_quantizer")
    s = fig.qgcli_summary
    assert s["channels"] == blocks(x).shape[0] == 64
    np.testing.assert_array_equal(s["clipped_above"], ((blocks(mask) == 0) & (blocks(x) > blocks(y))).mean(axis=1))
    assert max(s["clipped_above"]) > 0  # symmetric int4: the largest value of a block clips to 7 * scale
    r = cli("plot", "hist", path, "--layer", f"{STEP}/2/activation_fake_quantizer", "-o", tmp_path / "a.png", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["op"] == "torchao.IntxFakeQuantizer"
    png_size(tmp_path / "a.png")


@pytest.mark.parametrize("layer, channel", [("fc/activation_post_process", None), ("fc/weight_fake_quant", 3)])
def test_torch_staircase_draws_torch_own_step_function(torch_run, layer, channel):
    # The staircase of a PyTorch group draws the op's exact step function under the points (#40 item 4), each
    # step's value what torch itself outputs at the step's ends.
    path, _ = torch_run
    d, a = _group(path, layer)
    qmin, qmax = int(a["quant_min"]), int(a["quant_max"])
    scale, zp = (d["scale"], d["zero_point"]) if channel is None else (d["scale"][channel], d["zero_point"][channel])
    fig = _figure(path, "staircase", layer, channel=channel)
    step = _line(fig, "outputs_step")
    xs, ys = np.asarray(step.get_xdata(), np.float32), np.asarray(step.get_ydata(), np.float32)
    assert len(set(ys.tolist())) > 2
    starts, ends, values = xs[0::2], xs[1::2], ys[0::2]
    y, _ = _torch_grad(starts, np.ones_like(starts), scale, zp, qmin, qmax)
    np.testing.assert_array_equal(y, values)  # each step's value: torch's own at its first float
    before = np.nextafter(ends[:-1], np.float32(-np.inf))  # the last float of each step (its edge: the next's)
    y, _ = _torch_grad(before, np.ones_like(before), scale, zp, qmin, qmax)
    np.testing.assert_array_equal(y, values[:-1])
    np.testing.assert_array_equal(ends[:-1], starts[1:])
    x = d["inputs"] if channel is None else d["inputs"][channel]
    assert xs.min() <= x.min() and xs.max() >= x.max()
