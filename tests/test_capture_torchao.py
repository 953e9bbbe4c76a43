"""qgcli.capture.torch on a real torchao QAT model (torchao.quantization.qat, one training step on data made
here): int4 per-group weights with int8 per-token activations, and float8 per row. Every quantizer is in the
run file with its config as attributes, `qgcli verify` passes (forward, scale and zero point bit for bit, the
input gradient within 1e-5 of its largest value), and `fakequant`, `fakequant-grad` and `report` over the run
file give per group exactly what `--semantics torchao` gives for one bundle; configs qgcli does not reproduce
are skipped with their reason.  Those tests skip without torchao; the run-file rules for torchao groups
(verify's tolerances, attributes checked, options refused) are tested on hand-written run files everywhere."""
import json
import os
import warnings

import h5py
import numpy as np
import pytest

from conftest import SAMPLES
from qgcli.capture.runfile_writer import RunFileWriter
from qgcli.ops import torchao_semantics as ts
from qgcli.storage.hdf5.digests import digests_of

try:
    import torch
    import torchao
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig,
                                      Int8DynamicActivationIntxWeightConfig, quantize_)
    from torchao.quantization import qat
    from torchao.quantization.granularity import PerGroup, PerRow
except ImportError:
    torch = None

needs_torchao = pytest.mark.skipif(torch is None, reason="needs torch and torchao (pip install 'qgcli[torch,torchao]')")
nn = torch.nn if torch is not None else None
EXPECTED = ["2/activation_fake_quantizer", "2/weight_fake_quantizer", "4/activation_fake_quantizer",
            "4/weight_fake_quantizer"]


def _model():
    """A plain layer first (so that every quantizer's input needs a gradient), then int4 per group of 32
    weights + int8 per-token activations, then float8 per row, as torchao's QATConfig prepares them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        int4 = Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(32))
        quantize_(model, qat.QATConfig(int4, step="prepare"), filter_fn=lambda m, fqn: fqn == "2")
        fp8 = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
        quantize_(model, qat.QATConfig(fp8, step="prepare"), filter_fn=lambda m, fqn: fqn == "4")
    return model


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if torch is None:
        pytest.skip("needs torch and torchao (pip install 'qgcli[torch,torchao]')")
    from qgcli.capture.torch import capture

    model = _model()
    x, y = torch.randn(2, 4, 16), torch.randint(0, 8, (8,))  # (batch, tokens, features), as an LLM's
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = str(tmp_path_factory.mktemp("torchao") / "run.h5")
    with capture(model, path) as cap:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x).reshape(8, 8), y).backward()
        opt.step()
    return path, cap


def test_every_torchao_quantizer_is_captured_with_its_config(run):
    path, cap = run
    assert cap.groups == EXPECTED and cap.skipped == {}
    with h5py.File(path) as f:
        w = f["2/weight_fake_quantizer"]
        assert dict(w.attrs) == {
            "op": "torchao.IntxFakeQuantizer", "dtype": "int4", "granularity": "per-group:32", "group_size": 32,
            "mapping_type": "symmetric", "scale_precision": "float32", "zero_point_precision": "int32",
            "zero_point_domain": "int", "is_dynamic": True, "framework": "torchao", "module": "IntxFakeQuantizer",
            "torchao_version": torchao.__version__}
        assert w["reference/scale"].shape == (32, 2) and w["reference/zero_point"].dtype == "int32"
        a = f["2/activation_fake_quantizer"]
        assert (a.attrs["dtype"], a.attrs["granularity"], a.attrs["mapping_type"]) == ("int8", "per-token",
                                                                                       "asymmetric")
        assert a["inputs"].shape == a["gradients"].shape == (2, 4, 64) and a["reference/scale"].size == 8
        for name in EXPECTED[2:]:
            g = f[name]
            assert (g.attrs["op"], g.attrs["dtype"], g.attrs["granularity"]) == (
                "torchao.Float8FakeQuantizer", "float8_e4m3fn", "per-row")
            assert set(g["reference"]) == {"backprops_wrt_input", "scale"} and set(digests_of(f, name)) == {"outputs"}


def test_verify_passes(run, cli):
    r = cli("verify", run[0], "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert (doc["verified"], doc["failed"]) == (4, 0)
    for layer in doc["layers"]:
        out = layer["outputs"]
        assert out["outputs"]["identical"] and out["scale"]["identical"], layer
        assert out["zero_point"]["identical"] if "zero_point" in out else "Float8" in layer["op"]
        assert out["backprops_wrt_input"]["rel"] <= 1e-5
        if "Intx" in layer["op"]:  # no scale path: torch's rounding of (dy * s) * (1/s), bit for bit
            assert layer["status"] == "identical"


def _single_bundle_options(attrs):
    opts = ["--semantics", "torchao", "--dtype", attrs["dtype"], "--granularity", attrs["granularity"]]
    for key in ("mapping_type", "scale_precision", "zero_point_precision", "zero_point_domain"):
        if key in attrs:
            opts += ["--" + key.replace("_", "-"), attrs[key]]
    return opts


def test_run_file_groups_equal_single_bundles(run, cli, tmp_path):
    path = run[0]
    for command in ("fakequant", "fakequant-grad"):
        r = cli(command, path, "-o", tmp_path / f"{command}.h5")
        assert r.exit_code == 0, r.output
    r = cli("report", path, "--json")
    assert r.exit_code == 0, r.output
    rows = {row["path"]: row for row in json.loads(r.stdout)["layers"]}
    assert sorted(rows) == EXPECTED
    with h5py.File(path) as f, h5py.File(tmp_path / "fakequant.h5") as fwd, \
            h5py.File(tmp_path / "fakequant-grad.h5") as grad:
        for name in EXPECTED:
            bundle = tmp_path / (name.replace("/", "_") + ".npz")
            np.savez(bundle, inputs=f[name]["inputs"][()], gradients=f[name]["gradients"][()])
            opts = _single_bundle_options(dict(f[name].attrs))
            for command, out in (("fakequant", fwd), ("fakequant-grad", grad)):
                single = tmp_path / f"{command}-{name.replace('/', '_')}.npz"
                r = cli(command, bundle, *opts, "-o", single)
                assert r.exit_code == 0, r.output
                with np.load(single) as s:
                    assert sorted(s.files) == sorted(out[name])
                    for key in s.files:
                        assert np.array_equal(s[key], out[name][key][()]), (name, command, key)
            r = cli("report", bundle, *opts, "--json")
            assert r.exit_code == 0, r.output
            total = json.loads(r.stdout)["total"]
            row = rows[name]
            assert row["clipped"] == total["clipped"] and row["gradient_blocked"] == total["gradient_blocked"]
            for key in ("straight_through", "scale_path", "rounding"):
                assert row[key] == pytest.approx(total["split"][key], rel=1e-12, abs=1e-15), (name, key)
            assert (row["scale_path"] > 0) == ("Float8" in row["op"])


@needs_torchao
def test_every_config_field_is_recorded_and_verifies(tmp_path, cli):
    from torchao.quantization.granularity import PerTensor
    from torchao.quantization.quant_primitives import ZeroPointDomain

    from qgcli.capture.torch import capture

    c, f = qat.IntxFakeQuantizeConfig, qat.Float8FakeQuantizeConfig
    quantizers = nn.ModuleDict({
        "uint4_channel": qat.IntxFakeQuantizer(c(torch.uint4, "per_channel", is_symmetric=False,
                                                 scale_precision=torch.bfloat16)),
        "int2_group": qat.IntxFakeQuantizer(c(torch.int2, group_size=16, scale_precision=torch.float16,
                                              zero_point_precision=torch.float16)),
        "int8_token": qat.IntxFakeQuantizer(c(torch.int8, "per_token", is_symmetric=False, eps=1e-3)),
        "float_domain": qat.IntxFakeQuantizer(c(torch.int4, group_size=32, is_symmetric=False,
                                                zero_point_domain=ZeroPointDomain.FLOAT)),
        "e5m2": qat.Float8FakeQuantizer(f(torch.float8_e5m2, PerTensor())),
        "e4m3_bounded": qat.Float8FakeQuantizer(f(torch.float8_e4m3fn, PerRow(), hp_value_lb=1e-3, hp_value_ub=1.0)),
    })
    torch.manual_seed(1)
    x = (torch.randn(4, 64) * 2).requires_grad_()
    path = tmp_path / "configs.h5"
    with capture(quantizers, str(path)) as cap:
        sum((q(x) * torch.randn(4, 64)).sum() for q in quantizers.values()).backward()
    assert cap.groups == list(quantizers) and cap.skipped == {}
    with h5py.File(path) as h:
        a = {name: dict(h[name].attrs) for name in quantizers}
    assert (a["uint4_channel"]["granularity"], a["uint4_channel"]["scale_precision"]) == ("per-channel", "bfloat16")
    assert a["int2_group"]["zero_point_precision"] == "float16" and a["int8_token"]["eps"] == 1e-3
    assert a["float_domain"]["zero_point_domain"] == "float" and a["e5m2"]["granularity"] == "per-tensor"
    assert (a["e4m3_bounded"]["hp_value_lb"], a["e4m3_bounded"]["hp_value_ub"]) == (1e-3, 1.0)
    r = cli("verify", path, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["passed"] == len(quantizers)


@needs_torchao
def test_configs_qgcli_does_not_reproduce_are_skipped(tmp_path, cli):
    from qgcli.capture.torch import capture

    c = qat.IntxFakeQuantizeConfig
    quantizers = nn.ModuleDict({
        "kept": qat.IntxFakeQuantizer(c(torch.int8, "per_token", is_symmetric=False)),
        "static": qat.IntxFakeQuantizer(c(torch.int4, group_size=8, is_dynamic=False)),
        "fp64_scale": qat.IntxFakeQuantizer(c(torch.int4, group_size=8, scale_precision=torch.float64)),
        "fnuz": qat.Float8FakeQuantizer(qat.Float8FakeQuantizeConfig(dtype=torch.float8_e4m3fnuz)),
        "bf16": qat.Float8FakeQuantizer(qat.Float8FakeQuantizeConfig()),
        "off": qat.IntxFakeQuantizer(c(torch.int8, "per_channel")),
    })
    quantizers["off"].enabled = False
    x = torch.randn(4, 16, requires_grad=True)
    path = tmp_path / "run.h5"
    with capture(quantizers, str(path)) as cap:
        total = sum(q(x.to(torch.bfloat16) if name == "bf16" else x).float().sum()
                    for name, q in quantizers.items())
        total.backward()
    assert cap.groups == ["kept"]
    assert cap.skipped == {
        "static": "torchao config not reproduced by qgcli: is_dynamic=False: qgcli computes torchao's dynamic "
                  "qparams only",
        "fp64_scale": "torchao config not reproduced by qgcli: scale_precision: 'float64' is not one of float32, "
                      "bfloat16, float16",
        "fnuz": "torchao config not reproduced by qgcli: dtype: 'float8_e4m3fnuz' is not float8_e4m3fn or "
                "float8_e5m2",
        "bf16": "inputs are bfloat16: qgcli reproduces torchao's float32 path only",
        "off": "fake quant disabled"}
    r = cli("verify", path)
    assert r.exit_code == 0, r.output


@needs_torchao
def test_nvfp4_qat_layer_is_listed_as_not_recorded(tmp_path):
    from torchao.prototype.qat import NVFP4FakeQuantizeConfig, NVFP4FakeQuantizedLinear

    from qgcli.capture.torch import capture

    nvfp4 = NVFP4FakeQuantizeConfig()
    model = nn.Sequential(NVFP4FakeQuantizedLinear(16, 32, activation_config=nvfp4, weight_config=nvfp4))
    with capture(model, str(tmp_path / "run.h5")) as cap:
        pass  # NVFP4's forward needs a Blackwell GPU: the layer is listed before any forward
    assert cap.groups == [] and cap.skipped == {
        "0": "NVFP4FakeQuantizedLinear: torchao's NVFP4 QAT forward needs a Blackwell GPU (an fp4 scaled mm); "
             "qgcli captures no NVFP4 layer: write its groups (op = \"nvfp4\") from your own hooks"}


@needs_torchao
def test_mx_qat_layers_are_captured_and_verified(tmp_path, cli):
    """torchao's MXFakeQuantizedLinear (prototype MX QAT, runs on the CPU): its input and weight quantizers as
    ``op = "mx"`` groups; verify reproduces torchao's to_mx outputs and scales bit for bit; the gradients are the
    ones torchao's backward hands on (the layer input's gradient and the weight's)."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.qat.mx import MXFakeQuantizeConfig, MXFakeQuantizedLinear

    from qgcli.capture.torch import capture

    torch.manual_seed(0)
    fp4 = MXFakeQuantizeConfig()  # mxfp4, blocks of 32, rceil: torchao's defaults
    fp8 = MXFakeQuantizeConfig(dtype=torch.float8_e4m3fn, scaling_mode=ScaleCalculationMode.FLOOR)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), MXFakeQuantizedLinear.from_linear(nn.Linear(64, 32), fp4, fp4),
                          nn.ReLU(), MXFakeQuantizedLinear.from_linear(nn.Linear(32, 8), fp8, fp8))
    seen = {}

    def keep_gradient(module, args, out):  # the gradient reaching the MX layer's input
        out.register_hook(lambda g: seen.update(dx=g.clone()))

    model[1].register_forward_hook(keep_gradient)
    path = str(tmp_path / "run.h5")
    with capture(model, path) as cap:
        model(torch.randn(2, 4, 16)).square().mean().backward()
    assert cap.groups == EXPECTED and cap.skipped == {}
    with h5py.File(path, "r") as f:
        a = dict(f["2/weight_fake_quantizer"].attrs)
        assert (a["op"], a["format"], a["block_size"], a["scale_mode"]) == ("mx", "mxfp4", 32, "rceil")
        assert dict(f["4/activation_fake_quantizer"].attrs)["format"] == "mxfp8-e4m3"
        assert f["2/activation_fake_quantizer/inputs"].shape == (8, 64)  # as torchao quantizes it
        g_act = f["2/activation_fake_quantizer/gradients"][()]
        g_w = f["2/weight_fake_quantizer/gradients"][()]
    assert np.array_equal(g_act, seen["dx"].reshape(8, 64).numpy())  # what reached the layer's input
    assert np.array_equal(g_w, model[2].weight.grad.numpy())
    r = cli("verify", path, "--json")
    assert r.exit_code == 0, r.output
    assert {row["path"]: row["status"] for row in json.loads(r.stdout)["layers"]} == dict.fromkeys(EXPECTED,
                                                                                                   "identical")
    r = cli("fakequant-grad", path, "-o", tmp_path / "g.h5", "--quiet")
    assert r.exit_code == 0, r.output
    with h5py.File(tmp_path / "g.h5", "r") as f:
        assert np.array_equal(f["2/weight_fake_quantizer/backprops_wrt_input"][()], g_w)


# --- torchao groups without torchao: run files written by hand (every CI run) ----------------------------

CONFIGS = {"w": ts.intx_fake_quantize_config("int4", "per-group:32"),
           "a": ts.intx_fake_quantize_config("int8", "per-token", "asymmetric"),
           "f": ts.float8_fake_quantize_config("float8_e5m2", "per-tensor")}


def _hand_written(path, tamper=None, attrs=None):
    """A run file of torchao groups whose references are qgcli's own results (``tamper``: group -> reference
    name whose first element is moved one float32 ulp)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    dy = rng.standard_normal((4, 64)).astype(np.float32)
    with RunFileWriter(str(path)) as w:
        for name, c in CONFIGS.items():
            res = ts.fake_quantize(x, c, dy)
            ref = {"outputs": res.outputs, "backprops_wrt_input": res.backprops_wrt_input, "scale": res.scale,
                   "zero_point": res.zero_point}
            if tamper and name in tamper:
                a = np.array(ref[tamper[name]], dtype=np.float32)
                a.flat[0] = np.nextafter(a.flat[0], np.float32(np.inf))
                ref[tamper[name]] = a
            given = {k: v for k, v in c.attributes().items() if v is not None}
            w.add(f"layer/{name}", c.op, {"inputs": x, "gradients": dy}, {**given, **(attrs or {}).get(name, {})},
                  ref)


def test_verify_takes_torchao_outputs_and_qparams_bitwise_and_the_gradient_within_rtol(tmp_path, cli):
    _hand_written(tmp_path / "ok.h5", tamper={"f": "backprops_wrt_input"})
    r = cli("verify", tmp_path / "ok.h5", "--json")
    assert r.exit_code == 0, r.output
    rows = {row["path"]: row for row in json.loads(r.stdout)["layers"]}
    assert rows["layer/f"]["status"] == "within-rtol" and rows["layer/f"]["outputs"]["backprops_wrt_input"][
        "max_ulps"] == 1
    assert rows["layer/w"]["status"] == rows["layer/a"]["status"] == "identical"
    for name, ref in (("w", "scale"), ("a", "zero_point"), ("f", "outputs")):
        _hand_written(tmp_path / f"{name}.h5", tamper={name: ref})
        r = cli("verify", tmp_path / f"{name}.h5", "--json")
        assert r.exit_code == 1, r.output
        row = {row["path"]: row for row in json.loads(r.stdout)["layers"]}[f"layer/{name}"]
        assert row["status"] == "differs" and not row["outputs"][ref]["passed"], row


def test_a_torchao_group_runs_its_own_config(tmp_path, cli):
    path = tmp_path / "run.h5"
    _hand_written(path)
    r = cli("fakequant-grad", path, "-o", tmp_path / "out.h5")
    assert r.exit_code == 0, r.output
    with h5py.File(tmp_path / "out.h5") as out, h5py.File(path) as f:
        for name, c in CONFIGS.items():
            res = ts.fake_quantize(f[f"layer/{name}/inputs"][()], c, f[f"layer/{name}/gradients"][()])
            assert np.array_equal(out[f"layer/{name}/backprops_wrt_input"][()], res.backprops_wrt_input)
            assert out[f"layer/{name}"].attrs["op"] == c.op
    r = cli("fakequant", path, "--num-bits", "4", "-o", tmp_path / "nb.h5")
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.output
    assert "--num-bits does not apply to a torchao group" in r.stderr and not (tmp_path / "nb.h5").exists()


@pytest.mark.parametrize("option", [("--granularity", "per-token"), ("--eps", "1e-3"), ("--hp-value-ub", "4"),
                                    ("--dtype", "int4"), ("--dtype", "float8_e5m2")])
@pytest.mark.parametrize("command", ["fakequant", "fakequant-grad"])
def test_torchao_options_are_refused_with_a_run_file(tmp_path, cli, command, option):
    """A torchao group's config is its attributes: torchao's options would change nothing, so they are refused."""
    path = tmp_path / "run.h5"
    _hand_written(path)
    r = cli(command, path, *option, "-o", tmp_path / "out.h5")
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.output
    assert f"'{option[0]}'" in r.stderr and "carry their config as attributes" in r.stderr
    assert not (tmp_path / "out.h5").exists()


def test_torchao_group_attributes_are_checked_before_anything_runs(tmp_path, cli):
    path = tmp_path / "bad.h5"
    _hand_written(path, attrs={"w": {"granularity": "per-row"}, "a": {"is_dynamic": False}})
    r = cli("fakequant", path, "-o", tmp_path / "out.h5")
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.output
    assert "layer/w: attribute granularity: torchao's IntxFakeQuantizeConfig supports per-group:G" in r.stderr
    assert "layer/a: attribute is_dynamic: False: qgcli computes torchao's dynamic qparams only" in r.stderr
    assert not (tmp_path / "out.h5").exists()
    r = cli("report", path, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [row["path"] for row in doc["layers"]] == ["layer/f"]
    assert {s["path"] for s in doc["skipped"]} == {"layer/w", "layer/a"}


def test_report_table_shows_the_torchao_gradient_split(tmp_path, cli):
    """The text report of a run file with torchao groups adds their split (straight through / scale path),
    the numbers of --json; a run file without torchao groups has no such columns."""
    path = tmp_path / "run.h5"
    _hand_written(path)
    doc = json.loads(cli("report", path, "--json").stdout)
    r = cli("report", path, "--wide")
    assert r.exit_code == 0, r.output
    header = r.stdout.splitlines()[0].split()
    assert header[-2:] == ["st", "scale"]
    for layer in doc["layers"]:
        line = next(line for line in r.stdout.splitlines() if line.startswith(layer["path"] + " "))
        assert line.split()[-2:] == [f"{100 * layer['straight_through']:.1f}%", f"{100 * layer['scale_path']:.1f}%"]
    plain = cli("report", os.path.join(SAMPLES, "run.h5"), "--wide")
    assert plain.exit_code == 0 and "scale" not in plain.stdout.splitlines()[0].split()


@pytest.mark.parametrize("option", [("--semantics", "torchao"), ("--dtype", "int4"), ("--granularity", "per-token")])
def test_report_of_a_run_file_refuses_torchao_options(tmp_path, cli, option):
    path = tmp_path / "run.h5"
    _hand_written(path)
    r = cli("report", path, *option)
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1 and f"'{option[0]}'" in r.stderr, r.output
    assert "run file" in r.stderr
