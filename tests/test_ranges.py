"""Ranges people act on: `report RUN --ranges-out ranges.h5 --range-method percentile|mse|kl` writes every
quantizer's suggested range in its own parameters (TensorFlow min/max, PyTorch scale/zero_point as torch.ao's
observers compute them), `fakequant-grad RUN --ranges ranges.h5` applies them, and the documented snippet loads
them into a torch.ao model."""
import json
import os
import re

import h5py
import numpy as np
import pytest
from clirunner import make_runner

from qgcli.cli import main
from qgcli.ops import ranges
from qgcli.ops.analysis import channel_report
from qgcli.ops.fake_quant import fake_quant_with_min_max_vars

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, "samples", "run.h5")
PER_TENSOR = ("step_000100/backbone/conv1/act_quant", "step_000100/head/logits_quant")
PER_CHANNEL = "step_000100/backbone/conv1/weight_quant"
TORCH_GROUP = "step_000100/head/act_quant"


def _cli(*args):
    return make_runner().invoke(main, [str(a) for a in args], prog_name="qgcli")


def _error(x, lo, hi, num_bits=8):
    q = fake_quant_with_min_max_vars(x, np.float32(lo), np.float32(hi), num_bits=num_bits)
    return float(np.sum((np.asarray(q, np.float64) - x.astype(np.float64)) ** 2))


def test_mse_picks_the_least_error_of_its_candidates():
    rng = np.random.default_rng(3)
    x = rng.standard_normal(4000).astype(np.float32)
    x[:4] = [9.0, -7.5, 8.0, 12.0]  # outliers a max range would pay for
    r = channel_report(x, np.float32(-1), np.float32(1), num_bits=4, range_method="mse")
    lo, hi = r.row(0)["suggested_min"], r.row(0)["suggested_max"]
    errors = [_error(x, k / 100 * x.min(), k / 100 * x.max(), 4) for k in range(1, 101)]
    assert _error(x, lo, hi, 4) == pytest.approx(min(errors), rel=1e-12)
    assert hi < x.max() / 2  # it clips the outliers
    assert r.row(0)["suggested_mse"] * x.size == pytest.approx(min(errors), rel=1e-9)
    assert r.row(0)["suggested_percentile"] is None  # no percentile behind it


def test_kl_is_tensorrts_entropy_calibration():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(200000), [25.0] * 20, [-30.0] * 5]).astype(np.float32)
    amax = ranges.kl_amax(x)
    assert 2.5 < amax < 5.0  # the outliers are left out, the body kept
    edges = np.histogram(np.abs(x.astype(np.float64)), bins=2048, range=(0, 30.0))[1]
    assert amax in edges  # an upper bin edge, as TensorRT's calibrator returns it
    r = channel_report(x, np.float32(-1), np.float32(1), range_method="kl")
    assert r.row(0)["suggested_min"] == np.float32(-amax) and r.row(0)["suggested_max"] == np.float32(amax)
    relu = np.abs(x)  # no negatives: [0, amax]
    r = channel_report(relu, np.float32(0), np.float32(1), range_method="kl")
    assert r.row(0)["suggested_min"] == 0 and r.row(0)["suggested_max"] > 0


def _write_ranges(dest, method, target=RUN):
    r = _cli("report", target, "--ranges-out", dest, "--range-method", method, "--json")
    assert r.exit_code == 0, r.output
    return str(dest), json.loads(r.stdout), r.stderr


#: The KL search costs about 0.15 s of CPU per channel (2048 bins, 1921 candidate ranges): the quick run writes
#: the KL ranges of one step's head (a per-tensor TF and a torch group); the whole file's (38 channels) is slow.
KL_HEAD = f"{RUN}:step_000100/head"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = {}
    for method in ranges.METHODS:
        dest = tmp_path_factory.mktemp(method) / "ranges.h5"
        out[method] = _write_ranges(dest, method, KL_HEAD if method == "kl" else RUN)
    return out


def _check_written(dest, doc, method, stderr=None):
    """The file holds report's suggested range of each quantizer, at its group path, in its own parameters."""
    rows = {row["path"]: row for row in doc["layers"]}
    whole = PER_CHANNEL in rows
    if stderr is not None:
        assert (f"wrote the {method} ranges of 8 quantizers to {dest} (2 groups without" in stderr if whole else
                f"wrote the {method} ranges of 2 quantizers to {dest}" in stderr)
    with h5py.File(dest, "r") as f:
        assert f.attrs["format"] == "qgcli-ranges" and f.attrs["range_method"] == method
        for path in PER_TENSOR if whole else PER_TENSOR[1:]:
            g = f[path]
            assert g["min"].shape == () and g["min"].dtype == np.float32
            assert float(g["min"][()]) == np.float32(rows[path]["suggested_min"])
            assert float(g["max"][()]) == np.float32(rows[path]["suggested_max"])
        assert ("scale" in f[TORCH_GROUP]) and (PER_CHANNEL in f) == whole
        if not whole:
            return
        per_channel = f[PER_CHANNEL]
        lo, hi = per_channel["min"][()], per_channel["max"][()]
        assert per_channel.attrs["op"] == "FakeQuantWithMinMaxVarsPerChannel"
    layer = json.loads(_cli("report", RUN, "--layer", PER_CHANNEL, "--range-method", method, "--json",
                            "--sort", "channel").stdout)
    assert lo.tolist() == [np.float32(r["suggested_min"]) for r in layer["rows"]]
    assert hi.tolist() == [np.float32(r["suggested_max"]) for r in layer["rows"]]
    assert [e["path"] for e in json.loads(_attrs(dest)["skipped"])] == ["step_000100/backbone/conv1/bn",
                                                                        "step_000200/backbone/conv1/bn"]


@pytest.mark.parametrize("method", ranges.METHODS)
def test_tf_ranges_are_reports_suggested_ranges(written, method):
    dest, doc, stderr = written[method]
    _check_written(dest, doc, method, stderr)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("QGCLI_LONG", "") in ("", "0"), reason="38 KL searches: set QGCLI_LONG=1")
def test_kl_ranges_of_the_whole_run_file(tmp_path):
    dest, doc, stderr = _write_ranges(tmp_path / "ranges.h5", "kl")
    _check_written(dest, doc, "kl", stderr)


def _attrs(dest):
    with h5py.File(dest, "r") as f:
        return dict(f.attrs)


def test_torch_qparams_are_torch_ao_observers():
    torch = pytest.importorskip("torch")
    from torch.ao.quantization.observer import MinMaxObserver, PerChannelMinMaxObserver

    from qgcli.report.ranges_out import torch_qparams

    rng = np.random.default_rng(7)
    for quant_min, quant_max, dtype in ((0, 255, torch.quint8), (-128, 127, torch.qint8), (0, 15, torch.quint8)):
        lo = (-rng.exponential(2.0, 64)).astype(np.float32)
        hi = rng.exponential(2.0, 64).astype(np.float32)
        lo[:3], hi[:3] = [0.0, 0.5, -1e-9], [0.0, 0.5, 1e-9]  # degenerate ranges: eps, a range beside 0
        obs = PerChannelMinMaxObserver(ch_axis=0, dtype=dtype, quant_min=quant_min, quant_max=quant_max,
                                       qscheme=torch.per_channel_affine)
        obs.min_val, obs.max_val = torch.from_numpy(lo), torch.from_numpy(hi)
        want_s, want_z = obs.calculate_qparams()
        s, z = torch_qparams(lo, hi, quant_min, quant_max)
        assert s.tolist() == want_s.numpy().tolist() and z.tolist() == want_z.numpy().tolist()
        one = MinMaxObserver(dtype=dtype, quant_min=quant_min, quant_max=quant_max)
        one.min_val, one.max_val = torch.tensor(lo[5]), torch.tensor(hi[5])
        want_s, want_z = one.calculate_qparams()
        s, z = torch_qparams(lo[5], hi[5], quant_min, quant_max)
        assert float(s) == float(want_s) and int(z) == int(want_z)


def test_torch_group_ranges_least_error_under_torchs_quantizer(written):
    torch = pytest.importorskip("torch")
    dest = written["mse"][0]
    with h5py.File(RUN, "r") as run, h5py.File(dest, "r") as f:
        x = torch.from_numpy(run[TORCH_GROUP]["inputs"][()])
        g = f[TORCH_GROUP]
        scale, zp = float(g["scale"][()]), int(g["zero_point"][()])
        assert g["zero_point"].dtype == np.int32 and (g.attrs["quant_min"], g.attrs["quant_max"]) == (0, 255)

    def error(s, z):
        return float(((torch.fake_quantize_per_tensor_affine(x, s, z, 0, 255) - x) ** 2).sum())

    from qgcli.report.ranges_out import torch_qparams

    lo, hi = float(x.min()), float(x.max())
    def qparams(a, b):
        s, z = torch_qparams(a, b, 0, 255)
        return float(s), int(z)

    errors = [error(*qparams(k / 100 * lo, k / 100 * hi)) for k in range(1, 101)]
    assert error(scale, zp) == pytest.approx(min(errors), rel=1e-6)
    assert error(scale, zp) <= error(*qparams(lo, hi))


def test_fakequant_grad_applies_the_ranges(written, tmp_path):
    dest, doc, _ = written["percentile"]
    with_ranges, plain = tmp_path / "with.h5", tmp_path / "plain.h5"
    r = _cli("fakequant-grad", RUN, "--ranges", dest, "-o", with_ranges)
    assert r.exit_code == 0, r.output
    assert _cli("fakequant-grad", RUN, "-o", plain).exit_code == 0
    for path, flags in ((PER_TENSOR[0], ()), (PER_CHANNEL, ("--variant", "per-channel", "--narrow-range"))):
        one = tmp_path / (path.replace("/", "_") + ".h5")
        r = _cli("fakequant-grad", "--inputs", f"{RUN}:{path}/inputs", "--gradients", f"{RUN}:{path}/gradients",
                 "--min", f"{dest}:{path}/min", "--max", f"{dest}:{path}/max", *flags, "-o", one)
        assert r.exit_code == 0, r.output
        with h5py.File(with_ranges, "r") as a, h5py.File(one, "r") as b, h5py.File(plain, "r") as c:
            for name in b:  # the group run with the ranges given by hand: the same bits
                if isinstance(b[name], h5py.Dataset):
                    assert np.array_equal(a[path][name][()], b[name][()], equal_nan=True), (path, name)
            assert not all(np.array_equal(a[path][n][()], c[path][n][()]) for n in b if isinstance(b[n], h5py.Dataset))
    # the effect seen in one command: the blocked gradient mass drops to what report suggested
    rows = {row["path"]: row for row in doc["layers"]}
    worst = PER_TENSOR[1]
    with h5py.File(with_ranges, "r") as a, h5py.File(RUN, "r") as run:
        grad = np.abs(run[worst]["gradients"][()].astype(np.float64))
        passed = np.abs(a[worst]["backprops"][()].astype(np.float64))
    assert rows[worst]["gradient_blocked"] > 0.05 and 1 - passed.sum() / grad.sum() < rows[worst]["gradient_blocked"]


def test_refusals(written, tmp_path):
    dest = written["percentile"][0]
    per_channel = os.path.join(ROOT, "samples", "per_channel.h5")
    r = _cli("report", per_channel, "--ranges-out", tmp_path / "x.h5")
    assert r.exit_code == 2 and "'--ranges-out'" in r.stderr and not (tmp_path / "x.h5").exists()
    r = _cli("report", RUN, "--ranges-out", dest)
    assert r.exit_code == 2 and "exists; use --force" in r.stderr and r.stdout == ""
    r = _cli("report", RUN, "--ranges-out", RUN, "--force")
    assert r.exit_code == 2 and "is also an input" in r.stderr
    r = _cli("fakequant-grad", per_channel, "--ranges", dest, "-o", tmp_path / "y.h5")
    assert r.exit_code == 2 and "'--ranges'" in r.stderr and not (tmp_path / "y.h5").exists()
    r = _cli("fakequant-grad", RUN, "--ranges", RUN, "-o", tmp_path / "y.h5")
    assert r.exit_code == 2 and "is not a ranges file" in r.stderr and not (tmp_path / "y.h5").exists()
    r = _cli("report", RUN, "--range-method", "median")
    assert r.exit_code == 2 and "'median' is not one of 'percentile', 'mse', 'kl'" in r.stderr


def test_documented_snippet_loads_into_a_torch_ao_model(tmp_path, monkeypatch):
    """The three lines of docs/inspect-report.md, run on a torch.ao QAT model captured with qgcli.capture."""
    torch = pytest.importorskip("torch")
    import warnings

    import torch.ao.quantization as tq

    from qgcli.capture.torch import capture

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                                    torch.nn.Linear(4 * 6 * 6, 3))
        model.qconfig = tq.get_default_qat_qconfig("x86")
        model.train()
        tq.prepare_qat(model, inplace=True)
        x = torch.randn(8, 3, 8, 8) * 3
        with capture(model, str(tmp_path / "run.h5"), step=1):
            model(x).sum().backward()
    r = _cli("report", tmp_path / "run.h5", "--ranges-out", tmp_path / "ranges.h5", "--range-method", "mse", "-q")
    assert r.exit_code == 0, r.output
    with open(os.path.join(ROOT, "docs", "inspect-report.md"), encoding="utf-8") as fh:
        text = fh.read()
    snippet = re.search(r"<!-- ranges into torch.ao -->\n<!-- example: no-run -->\n```python\n(.*?)```", text,
                        re.S).group(1)
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(snippet, {"model": model, "torch": torch, "h5py": h5py, "__name__": "snippet"})  # noqa: S102
    loaded = 0
    with h5py.File(tmp_path / "ranges.h5", "r") as f:
        for name, m in model.named_modules():
            key = "step_000001/" + name.replace(".", "/")
            if key in f and "scale" in f[key]:
                assert m.scale.numpy().tolist() == np.atleast_1d(f[key]["scale"][()]).tolist()
                assert m.zero_point.numpy().tolist() == np.atleast_1d(f[key]["zero_point"][()]).tolist()
                loaded += 1
    assert loaded >= 2  # the conv's weight quantizer and an activation quantizer at least
    model.apply(tq.disable_observer)
    y = model(x)  # the model runs on the loaded ranges
    assert torch.isfinite(y).all()


# --- torchao: an IntxFakeQuantizer's own scale / zero_point ---------------------------------------------------

@pytest.fixture(scope="module")
def torchao_run(tmp_path_factory):
    """One captured torchao QAT model (int4 weights per group of 32, int8 per-token activations, float8 per
    row), shared by the torchao tests (tests/test_capture_torchao.py's model)."""
    pytest.importorskip("torchao")
    import test_capture_torchao as tct

    from qgcli.capture.torch import capture

    torch = tct.torch
    model = tct._model()
    path = str(tmp_path_factory.mktemp("torchao") / "run.h5")
    with capture(model, path):
        torch.nn.functional.cross_entropy(model(torch.randn(2, 4, 16)).reshape(8, 8),
                                          torch.randint(0, 8, (8,))).backward()
    dest = tmp_path_factory.mktemp("torchao_ranges") / "ranges.h5"
    r = _cli("report", path, "--ranges-out", dest, "--range-method", "mse", "-q")
    assert r.exit_code == 0, r.output
    return model, path, str(dest)


def _static(quantizer, scale, zero_point):
    """torchao's IntxFakeQuantizer with its scale / zero_point set (not recomputed from the data)."""
    import copy
    import dataclasses

    import torch

    fq = copy.deepcopy(quantizer)
    fq.config = dataclasses.replace(fq.config, is_dynamic=False)
    fq.scale, fq.zero_point = torch.from_numpy(scale), torch.from_numpy(zero_point)
    return fq


def test_torchao_groups_get_their_quantizers_own_qparams(torchao_run, tmp_path):
    import torch

    model, run, dest = torchao_run
    with h5py.File(dest, "r") as f, h5py.File(run, "r") as r:
        assert sorted(json.loads(f.attrs["skipped"])[i]["path"] for i in range(2)) == [
            "4/activation_fake_quantizer", "4/weight_fake_quantizer"]  # float8: no range to write
        for name, quantizer in (("2/weight_fake_quantizer", model[2].weight_fake_quantizer),
                                ("2/activation_fake_quantizer", model[2].activation_fake_quantizer)):
            g = f[name]
            assert g.attrs["op"] == "torchao.IntxFakeQuantizer" and g.attrs["range_method"] == "mse"
            scale, zp = g["scale"][()], g["zero_point"][()]
            assert scale.shape == r[name]["reference/scale"].shape and zp.dtype == np.int32
            x = torch.from_numpy(r[name]["inputs"][()])
            own = float(((quantizer(x) - x) ** 2).sum())  # torchao's dynamic qparams: the data's whole range
            fq = _static(quantizer, scale, zp)
            assert float(((fq(x) - x) ** 2).sum()) <= own  # mse: never worse than the range of the data
            if "weight" in name:
                assert not np.array_equal(scale, r[name]["reference/scale"][()])  # some group clips outliers
            # the loaded quantizer's gradient is what fakequant-grad --ranges computes, bit for bit
            out = tmp_path / f"{name.replace('/', '_')}.h5"
            res = _cli("fakequant-grad", f"{run}:{name}", "--ranges", dest, "-o", out, "-q")
            assert res.exit_code == 0, res.output
            xg = x.clone().requires_grad_(True)
            fq(xg).backward(torch.from_numpy(r[name]["gradients"][()]))
            with h5py.File(out, "r") as o:
                got = o[name]["backprops_wrt_input"][()] if name in o else o["backprops_wrt_input"][()]
                assert np.array_equal(got, xg.grad.numpy())
                stored = o[name] if name in o else o
                assert np.array_equal(stored["scale"][()], scale) and np.array_equal(stored["zero_point"][()], zp)
