"""torchao's QAT fake quantizers (``--semantics torchao``) against golden cases made with real torchao 0.18.0 on
torch 2.13.0 CPU (tests/golden/make_golden_torchao.py): forward, scale and zero point bit for bit, the input
gradient within 1e-5 of its largest value; torchao's refusals refused; the library, the CLI and a subprocess.
"""
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from qgcli.errors import OperandError
from qgcli.ops import torchao_semantics as ts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden", "torchao.h5")


def _load():
    with h5py.File(GOLDEN, "r") as f:
        cases = {name: ({k: g[k][()] for k in g}, dict(g.attrs)) for name, g in f["cases"].items()}
        refusals = {name: ({"inputs": g["inputs"][()]}, dict(g.attrs)) for name, g in f["refusals"].items()}
        versions = dict(f.attrs)
    return cases, refusals, versions


CASES, REFUSALS, VERSIONS = _load()


def _opt(attrs, key):
    v = attrs.get(key, "none")
    return None if isinstance(v, str) and v == "none" else v


def config_of(attrs):
    if attrs["family"] == "intx":
        return ts.intx_fake_quantize_config(attrs["dtype"], attrs["granularity"], attrs["mapping"],
                                            attrs.get("scale_precision", "float32"),
                                            attrs.get("zero_point_precision", "int32"),
                                            attrs.get("zero_point_domain", "int"), _opt(attrs, "eps"))
    return ts.float8_fake_quantize_config(attrs["dtype"], attrs["granularity"], _opt(attrs, "hp_value_lb"),
                                          _opt(attrs, "hp_value_ub"))


def cli_options(attrs):
    opts = ["--semantics", "torchao", "--dtype", attrs["dtype"], "--granularity", attrs["granularity"]]
    if attrs["family"] == "intx":
        opts += ["--mapping-type", attrs["mapping"]]
        for key in ("scale_precision", "zero_point_precision", "zero_point_domain", "eps"):
            if _opt(attrs, key) is not None:
                opts += ["--" + key.replace("_", "-"), str(attrs[key])]
    else:
        for key in ("hp_value_lb", "hp_value_ub"):
            if _opt(attrs, key) is not None:
                opts += ["--" + key.replace("_", "-"), repr(float(attrs[key]))]
    return opts


def assert_bitwise(actual, expected):
    a = np.asarray(actual, np.float32)
    e = np.asarray(expected, np.float32)
    assert a.shape == e.shape
    both_nan = np.isnan(a) & np.isnan(e)
    differ = ~both_nan & (a.view(np.uint32) != e.view(np.uint32))
    assert not differ.any(), (np.argwhere(differ)[:5], a[differ][:5], e[differ][:5])


def assert_gradient(actual, expected):
    a, e = np.asarray(actual), np.asarray(expected)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(e))
    np.testing.assert_array_equal(np.isinf(a), np.isinf(e))
    fin = np.isfinite(e)
    if fin.any():
        scale = np.abs(e[fin]).max()
        assert np.abs(a[fin] - e[fin]).max() <= 1e-5 * scale


def test_golden_file_records_the_versions():
    assert VERSIONS["torchao"] == "0.18.0" and VERSIONS["torch"].startswith("2.13.0")
    families = {a["family"] for _, a in CASES.values()}
    assert families == {"intx", "float8"}
    dtypes = {a["dtype"] for _, a in CASES.values()}
    assert set(ts.INT_DTYPES) | set(ts.FLOAT8_DTYPES) <= dtypes


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_case(name, xp):
    data, attrs = CASES[name]
    config = config_of(attrs)
    x, g = xp.asarray(data["inputs"]), xp.asarray(data["gradients"])
    res = ts.fake_quantize(x, config, g)
    to_np = (lambda a: a.get()) if xp is not np else np.asarray
    assert_bitwise(to_np(res.outputs), data["outputs"])
    assert_bitwise(to_np(res.scale), data["scale"])
    if "zero_point" in data:
        assert_bitwise(to_np(res.zero_point), data["zero_point"].astype(np.float32))
    assert_gradient(to_np(res.backprops_wrt_input), data["backprops_wrt_input"])
    # the split adds up to the gradient, and the integer quantizers have no scale path
    with np.errstate(invalid="ignore"):
        total = to_np(res.straight_through).astype(np.float64) + to_np(res.scale_path) + to_np(res.rounding)
    fin = np.isfinite(total)
    np.testing.assert_allclose(total[fin], to_np(res.backprops_wrt_input)[fin], rtol=1e-6, atol=1e-30)
    if attrs["family"] == "intx":
        assert not to_np(res.scale_path).any()
        np.testing.assert_array_equal(ts.fake_quantize(x, config).outputs, res.outputs)


def test_forward_only_functions_match(xp):
    data, attrs = CASES["int4_g32_sym"]
    c = config_of(attrs)
    res = ts.intx_fake_quantize(data["inputs"], c)
    assert res.backprops_wrt_input is None
    assert_bitwise(res.outputs, data["outputs"])
    scale, zp = ts.choose_qparams(data["inputs"], c)
    assert_bitwise(scale, data["scale"])
    data, attrs = CASES["e4m3_row_normal"]
    res = ts.float8_fake_quantize_gradient(data["gradients"], data["inputs"], config_of(attrs))
    assert_bitwise(res.outputs, data["outputs"])
    assert res.zero_point is None and np.abs(res.scale_path).sum() > 0


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_torchao_refusals_are_refused(name):
    data, attrs = REFUSALS[name]
    assert attrs["error"] != "none"
    with pytest.raises(OperandError):
        config = config_of({**attrs, "family": attrs["family"]})
        ts.fake_quantize(data["inputs"], config)


def test_scale_path_reaches_only_the_block_extremes():
    data, attrs = CASES["e4m3_row_extremes"]
    res = ts.fake_quantize(data["inputs"], config_of(attrs), data["gradients"])
    x = data["inputs"]
    hit = np.abs(x) == np.abs(x).max(axis=1, keepdims=True)
    assert not res.scale_path[~hit].any() and res.scale_path[hit].any()


# --- CLI ---------------------------------------------------------------------------------------------------

@pytest.fixture
def bundle(tmp_path):
    def make(name):
        data, attrs = CASES[name]
        path = tmp_path / f"{name}.npz"
        np.savez(path, inputs=data["inputs"], gradients=data["gradients"])
        return path, data, attrs
    return make


@pytest.mark.parametrize("name", ["int4_g32_sym", "int8_token_asym", "uint4_g32_asym_heavy", "int4_channel_asym",
                                  "int4_g32_asym_scale_bfloat16", "e4m3_row_heavy", "e5m2_tensor_lb_ub"])
def test_cli_matches_the_golden_case(cli, bundle, tmp_path, name):
    path, data, attrs = bundle(name)
    r = cli("fakequant-grad", path, *cli_options(attrs), "-o", tmp_path / "g.npz", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    with np.load(tmp_path / "g.npz") as out:
        assert_gradient(out["backprops_wrt_input"], data["backprops_wrt_input"])
        assert_bitwise(out["scale"].astype(np.float32), data["scale"])
        if "zero_point" in data:
            assert out["zero_point"].dtype == (np.int32 if data["zero_point"].dtype == np.int32 else np.float32)
            assert_bitwise(out["zero_point"].astype(np.float32), data["zero_point"].astype(np.float32))
    split = doc["statistics"]["split"]
    assert abs(sum(split.values()) - 1) < 1e-9
    assert doc["op"] == ("torchao.IntxFakeQuantizer" if attrs["family"] == "intx" else "torchao.Float8FakeQuantizer")
    if attrs["family"] == "intx":
        assert split["scale_path"] == 0
    elif name == "e5m2_tensor_lb_ub":  # max|x| above hp_value_ub: the clamp cuts the scale path
        assert split["scale_path"] == 0 and split["rounding"] > 0
    else:
        assert split["scale_path"] > 0
    assert len(doc["statistics"]["top_scale_path_blocks"]) <= 5
    r = cli("fakequant", path, *cli_options(attrs), "-o", tmp_path / "y.npz", "-q")
    assert r.exit_code == 0, r.output
    with np.load(tmp_path / "y.npz") as out:
        assert_bitwise(out["outputs"], data["outputs"])
        assert set(out.files) == ({"outputs", "scale", "zero_point"} if "zero_point" in data else {"outputs", "scale"})


def test_cli_summary_on_stderr(cli, bundle, tmp_path):
    path, _, attrs = bundle("e4m3_row_normal")
    r = cli("fakequant-grad", path, *cli_options(attrs), "-o", tmp_path / "g.h5")
    assert r.exit_code == 0, r.output
    assert "straight-through" in r.stderr and "scale path" in r.stderr and "largest scale-path share" in r.stderr
    with h5py.File(tmp_path / "g.h5", "r") as f:
        assert f["backprops_wrt_input"].attrs["op"] == "torchao.Float8FakeQuantizer"


@pytest.mark.parametrize("argv, option, words", [
    (["--dtype", "int8", "--granularity", "per-token"], "--mapping-type", "symmetric per-token"),
    (["--dtype", "int4", "--granularity", "per-tensor"], "--granularity", "PerTensor"),
    (["--dtype", "int4"], "--granularity", "needs a granularity"),
    (["--granularity", "per-row"], "--dtype", "needs the quantized dtype"),
    (["--dtype", "float8_e4m3fn", "--granularity", "per-token"], "--granularity", "PerRow or PerTensor"),
    (["--dtype", "float8_e4m3fn", "--mapping-type", "asymmetric"], "--mapping-type", "IntxFakeQuantizeConfig"),
    (["--dtype", "int4", "--granularity", "per-group:32", "--hp-value-ub", "1"], "--hp-value-ub", "Float8"),
    (["--dtype", "int4", "--granularity", "per-group:32", "--zero-point-domain", "none"], "--zero-point-domain",
     "NONE"),
    (["--dtype", "int4", "--granularity", "per-group:48"], "inputs", "multiple of the group size"),
    (["--dtype", "int4", "--granularity", "per-group:32", "--num-bits", "4"], "--num-bits", "torchao"),
    (["--dtype", "int4", "--granularity", "per-group:32", "--scale", "1"], "--scale", "torch"),
    (["--dtype", "int4", "--granularity", "per-group:32", "--estimator", "lsq"], "--estimator", "autograd"),
    (["--dtype", "int4", "--granularity", "per-group:32", "--plot", "f.png"], "--plot", "STE only"),
])
def test_cli_refusals(cli, bundle, tmp_path, argv, option, words):
    path, _, _ = bundle("int4_g32_sym")
    r = cli("fakequant-grad", path, "--semantics", "torchao", *argv, "-o", tmp_path / "g.npz")
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1 and "Traceback" not in r.output
    assert option in r.stderr and words in r.stderr, r.stderr
    assert not (tmp_path / "g.npz").exists()


def test_torchao_options_are_refused_elsewhere(cli, bundle, tmp_path):
    path, _, _ = bundle("int4_g32_sym")
    r = cli("fakequant-grad", path, "--min", "-1", "--max", "1", "--granularity", "per-token", "-o", tmp_path / "g.npz")
    assert r.exit_code == 2 and "--granularity" in r.stderr and "--semantics torchao" in r.stderr
    r = cli("fakequant", path, "--min", "-1", "--max", "1", "--dtype", "int4", "-o", tmp_path / "g.npz")
    assert r.exit_code == 2 and "--dtype" in r.stderr and "torchao" in r.stderr


def test_report_per_block(cli, bundle):
    path, data, attrs = bundle("e4m3_row_heavy")
    r = cli("report", path, *cli_options(attrs), "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["semantics"] == "torchao" and doc["blocks"] == 4 and len(doc["rows"]) == 4
    shares = [row["scale_path"] for row in doc["rows"]]
    assert shares == sorted(shares, reverse=True) and shares[0] > 0
    for row in doc["rows"]:
        assert abs(row["straight_through"] + row["scale_path"] + row["rounding"] - 1) < 1e-9
    r = cli("report", path, *cli_options(attrs), "--top", "2")
    assert r.exit_code == 0 and "scale path" in r.stdout and "Verdict" in r.stdout
    r = cli("report", "--inputs", f"{path}:inputs", "--semantics", "torchao", "--dtype", "int4", "--granularity",
            "per-group:16", "--csv")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[0].startswith("block,index,scale,zero_point,clipped")
    assert len(r.stdout.splitlines()) == 1 + 16
    r = cli("report", path, "--semantics", "torchao", "--dtype", "int4", "--granularity", "per-group:16", "--min", "1")
    assert r.exit_code == 2 and "--min" in r.stderr


def test_subprocess(tmp_path):
    data, attrs = CASES["int4_g32_asym_heavy"]
    path = tmp_path / "b.npz"
    np.savez(path, inputs=data["inputs"], gradients=data["gradients"])
    proc = subprocess.run([sys.executable, "-m", "qgcli", "fakequant", str(path), *cli_options(attrs), "-o",
                           str(tmp_path / "o.npz"), "--json"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["blocks"]["scale_shape"] == [4, 2]
    with np.load(tmp_path / "o.npz") as out:
        assert_bitwise(out["outputs"], data["outputs"])


@pytest.mark.parametrize("granularity", [1234, None, 3.5, ("per-group", 32), b"per-row"])
def test_a_granularity_that_is_not_text_is_refused_naming_it(granularity):
    for make in (lambda: ts.intx_fake_quantize_config("int4", granularity),
                 lambda: ts.float8_fake_quantize_config("float8_e4m3fn", granularity)):
        with pytest.raises(OperandError, match="^granularity: .* is not per-group:G"):
            make()


# --- the verdict weighs the share of exactly-zero input gradient -------------------------------------------

def _torchao_float8_gradient(x, g):
    """Real torchao's Float8FakeQuantizer (float8_e4m3fn per row): its input gradient for upstream ``g``."""
    torch = pytest.importorskip("torch")
    qat = pytest.importorskip("torchao.quantization.qat")
    from torchao.quantization.granularity import PerRow
    from torchao.quantization.qat.fake_quantizer import Float8FakeQuantizer

    q = Float8FakeQuantizer(qat.Float8FakeQuantizeConfig(torch.float8_e4m3fn, PerRow()))
    xt = torch.tensor(x, requires_grad=True)
    q(xt).backward(torch.tensor(g))
    return xt.grad.numpy()


@pytest.mark.parametrize("dy_size, mostly_zero", [(1e-4, True), (100.0, False)])
def test_float8_verdict_weighs_the_share_of_zero_gradient(cli, tmp_path, dy_size, mostly_zero):
    # A weight's gradient of 1e-4 times a per-row scale of ~0.005 is under 2^-10: float8_e4m3fn's backward
    # rounds it to 0 (the issue: 248 of 256 weight gradients exactly zero and a verdict "OK").
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 16)).astype(np.float32)
    g = (rng.standard_normal((16, 16)) * dy_size).astype(np.float32)
    dx = _torchao_float8_gradient(x, g)
    share = float(((dx == 0) & (g != 0)).sum()) / int((g != 0).sum())
    assert (share > 0.5) is mostly_zero and (share > 0.9 if mostly_zero else share < 0.1)  # the case is what it says
    path = tmp_path / "b.npz"
    np.savez(path, inputs=x, gradients=g)
    opts = ["--semantics", "torchao", "--dtype", "float8_e4m3fn"]

    r = cli("fakequant-grad", path, *opts, "-o", tmp_path / "dx.npz", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    st = doc["statistics"]
    assert st["zero_gradient"] == share and st["nonzero_upstream_elements"] == int((g != 0).sum())
    with np.load(tmp_path / "dx.npz") as out:
        assert_gradient(out["backprops_wrt_input"], dx)
    said = [n for n in doc["notes"] if "input gradient of exactly 0" in n]
    assert bool(said) is mostly_zero
    if mostly_zero:
        assert f"{st['zero_gradient_elements']} of the {st['nonzero_upstream_elements']} elements" in said[0]
        assert "2^-10 rounds to 0" in said[0]
        r = cli("fakequant-grad", path, *opts, "-o", tmp_path / "q.npz", "--quiet")
        assert r.exit_code == 0 and r.stderr == ""
        r = cli("fakequant-grad", path, *opts, "-o", tmp_path / "s.npz")
        assert "input gradient of exactly 0" in r.stderr

    r = cli("report", path, *opts, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["total"]["zero_gradient"] == share
    assert doc["verdict"].startswith("Verdict: not OK, the input gradient is exactly 0") is mostly_zero
    assert ("not OK" in doc["verdict"]) is mostly_zero
    r = cli("report", path, *opts)
    assert r.exit_code == 0 and ("Verdict: not OK" in r.stdout) is mostly_zero


def test_run_file_verdict_weighs_the_share_of_zero_gradient(cli, tmp_path):
    # `qgcli report RUN` over a torchao float8 group whose gradient is mostly exactly 0: not "OK", flagged,
    # the share in --json (a hand-written run file; the data's gradient checked against real torchao).
    from qgcli.capture.runfile_writer import RunFileWriter

    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 32)).astype(np.float32)
    small, large = (rng.standard_normal((8, 32)) * s for s in (1e-4, 100.0))
    c = ts.float8_fake_quantize_config("float8_e4m3fn", "per-row")
    attrs = {k: v for k, v in c.attributes().items() if v is not None}
    path, shares = tmp_path / "run.h5", {}
    with RunFileWriter(str(path)) as w:
        for name, g in (("w_small", small), ("w_large", large)):
            g = g.astype(np.float32)
            dx = _torchao_float8_gradient(x, g)
            w.add(name, c.op, {"inputs": x, "gradients": g}, attrs)
            shares[name] = float(((dx == 0) & (g != 0)).sum()) / int((g != 0).sum())
    r = cli("report", path, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    rows = {row["path"]: row for row in doc["layers"]}
    assert rows["w_small"]["zero_gradient"] == shares["w_small"] > 0.9 and rows["w_small"]["flagged"]
    assert rows["w_large"]["zero_gradient"] == shares["w_large"] < 0.05 and not rows["w_large"]["flagged"]
    assert doc["verdict"].startswith("Verdict: not OK, 1 layer gets an input gradient of exactly 0")
    assert f"w_small {100 * shares['w_small']:.1f}%" in doc["verdict"] and "w_large" not in doc["verdict"]
    r = cli("report", path, "--json", "--fail-on", "any")
    assert r.exit_code != 0
