"""``qgcli fakequant / fakequant-grad --semantics mx|nvfp4|onnx`` and run-file groups ``op = mx / nvfp4 /
QuantizeLinear``, through the real CLI, against the golden cases of torchao 0.18 and the onnx reference
(tests/golden/formats.h5, written by tests/golden/make_golden_formats.py): every golden case runs as a group of one
run file, bit for bit; single bundles through the options; the bad combinations exit 2 in one line, writing nothing.
"""
import json
import os

import h5py
import numpy as np
import pytest

from qgcli.ops import onnx_quantize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden", "formats.h5")


def _attr(a):
    return a.decode() if isinstance(a, bytes) else a


def _golden(group):
    with h5py.File(GOLDEN, "r") as f:
        return {name: ({k: g[k][()] for k in g}, {k: _attr(v) for k, v in g.attrs.items()})
                for name, g in f[group].items()}


MX, NVFP4, ONNX = _golden("mx"), _golden("nvfp4"), _golden("onnx")


def load_npz(path):
    """Every array of an .npz, the file closed (an open NpzFile left to the collector is a ResourceWarning)."""
    with np.load(path) as f:
        return {name: f[name] for name in f.files}


def same_bits(got, want, exempt=None):
    """Bit for bit; floats: NaN matches NaN, -0 differs from +0; ``exempt`` elements are not compared."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    if exempt is not None:
        got, want = np.where(exempt, 0, got).astype(got.dtype), np.where(exempt, 0, want).astype(want.dtype)
    if got.dtype.kind == "f" or want.dtype.kind == "f":
        # 1-d float32 before the view: NumPy 1.24 widens np.where on 0-d operands, and cannot view a 0-d array
        got, want = got.astype(np.float32).reshape(-1), want.astype(np.float32).reshape(-1)
        nan = np.isnan(got)

        def bits(a):
            return np.where(nan, np.float32(0), a).astype(np.float32).view(np.uint32)

        return bool(np.array_equal(nan, np.isnan(want)) and np.array_equal(bits(got), bits(want)))
    return bool(np.array_equal(got.astype(np.int64), want.astype(np.int64)))


def _read(path):
    with h5py.File(path, "r") as f:
        out = {}

        def visit(name, node):
            if isinstance(node, h5py.Dataset):
                out[name] = node[()]
        f.visititems(visit)
        attrs = {name: {k: _attr(v) for k, v in f[name].attrs.items()} for name in f if isinstance(f[name], h5py.Group)}
        return out, attrs


# --- every golden case as a run-file group ------------------------------------------------------------------

def _write_run(path, grad=False):
    """A run file with one group per golden case (op and attributes as the families read them)."""
    rng = np.random.default_rng(3)
    with h5py.File(path, "w") as f:
        for name, (data, a) in MX.items():
            g = f.create_group(f"mx/{name}")
            g.attrs.update(op="mx", format=a["format"], block_size=int(a["block_size"]), axis=int(a["axis"]),
                           scale_mode=a["scale_mode"])
            g["inputs"] = data["inputs"]
            if grad:
                g["gradients"] = rng.standard_normal(data["inputs"].shape).astype(np.float32)
        for name, (data, a) in NVFP4.items():
            g = f.create_group(f"nvfp4/{name}")
            g.attrs.update(op="nvfp4", axis=int(a["axis"]), per_tensor_scale=bool(a["per_tensor_scale"]))
            g["inputs"] = data["inputs"]
            if grad:
                g["gradients"] = rng.standard_normal(data["inputs"].shape).astype(np.float32)
        for name, (data, a) in ONNX.items():
            g = f.create_group(f"onnx/{name}")
            g.attrs.update(op="QuantizeLinear", dtype=a["dtype"], axis=int(a["axis"]),
                           block_size=int(a["block_size"]), saturate=bool(a["saturate"]))
            for k in ("x", "y_scale", "y_zero_point"):
                if k in data:
                    g[k] = data[k]
            if grad:
                g["gradients"] = rng.standard_normal(data["x"].shape).astype(np.float32)


@pytest.fixture(scope="module")
def golden_run(tmp_path_factory):
    """Every golden case through ``qgcli fakequant RUN.h5`` once (a subprocess: the real CLI, its warnings)."""
    import subprocess
    import sys

    d = tmp_path_factory.mktemp("golden_run")
    run, out = d / "run.h5", d / "out.h5"
    _write_run(run)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "qgcli", "fakequant", str(run), "-o", str(out), "--json"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    with h5py.File(out, "r") as f:
        got = {}
        for fam in ("mx", "nvfp4", "onnx"):
            for name, g in f[fam].items():
                got[f"{fam}/{name}"] = ({k: g[k][()] for k in g}, {k: _attr(v) for k, v in g.attrs.items()})
    return got, json.loads(p.stdout)


def test_golden_run_file_runs_every_group(golden_run):
    got, summary = golden_run
    assert len(got) == len(MX) + len(NVFP4) + len(ONNX)
    assert summary["command"] == "fakequant"


@pytest.mark.parametrize("name", sorted(MX))
def test_mx_group_matches_torchao(golden_run, name):
    data, a = MX[name]
    out, attrs = golden_run[0][f"mx/{name}"]
    assert attrs["op"] == "mx" and attrs["format"] == a["format"] and attrs["scale_mode"] == a["scale_mode"]
    assert same_bits(out["outputs"], data["outputs"])
    assert same_bits(out["scales"], data["scales"])
    q, want = out["quantized"], data["quantized"]
    if a["format"].startswith("mxfp8"):
        assert attrs["quantized_dtype"] == {"mxfp8-e4m3": "float8_e4m3fn", "mxfp8-e5m2": "float8_e5m2"}[a["format"]]
    exempt = None
    if a["scale_mode"] == "rceil":  # a NaN element of a NaN block: torch's kernel path picks the NaN (see the ops test)
        exempt = np.isnan(data["inputs"]) & np.repeat(data["scales"] == 255, int(a["block_size"]), axis=int(a["axis"]))
    assert same_bits(q, want, exempt)


@pytest.mark.parametrize("name", sorted(NVFP4))
def test_nvfp4_group_matches_torchao(golden_run, name):
    import ml_dtypes

    data, a = NVFP4[name]
    out, attrs = golden_run[0][f"nvfp4/{name}"]
    assert attrs["block_scales_dtype"] == "float8_e4m3fn"
    assert same_bits(out["outputs"], data["outputs"])
    assert same_bits(out["block_scales"], data["block_scales"])
    assert ("tensor_scale" in out) == ("tensor_scale" in data)
    if "tensor_scale" in data:
        assert same_bits(out["tensor_scale"], data["tensor_scale"])
    blocks = np.repeat(np.isnan(data["block_scales"].view(ml_dtypes.float8_e4m3fn).astype(np.float32)), 16,
                       axis=int(a["axis"]))
    exempt = np.isnan(data["inputs"]) & (blocks | np.isnan(data.get("tensor_scale", np.float32(0))))
    assert same_bits(out["quantized"], data["quantized"], exempt)


@pytest.mark.parametrize("name", sorted(ONNX))
def test_onnx_group_matches_the_reference(golden_run, name):
    data, a = ONNX[name]
    out, attrs = golden_run[0][f"onnx/{name}"]
    want_q, want_y = data["quantized"], data["outputs"]
    if a["dtype"] in onnx_quantize.INTEGER_TYPES:  # undefined in the reference: onnxruntime's saturation
        from qgcli.ops.onnx_quantize import _qparams

        _, sb, _ = _qparams(np, data["x"].shape, data["y_scale"], data.get("y_zero_point"), a["dtype"],
                            int(a["axis"]), int(a["block_size"]))
        with np.errstate(all="ignore"):
            v = np.broadcast_to(data["x"] / sb, data["x"].shape)
        undefined = ~np.isfinite(v) | (np.abs(np.rint(v)) >= 2.0**31)
        want_q = np.where(undefined, data["ort_quantized"], want_q)
        want_y = np.where(undefined, data["ort_outputs"], want_y)
        assert out["quantized"].dtype == onnx_quantize.INTEGER_TYPES[a["dtype"]][0]
    else:
        assert out["quantized"].dtype == np.uint8 and attrs["quantized_dtype"].startswith("float")
    assert same_bits(out["quantized"], want_q)
    assert same_bits(out["outputs"], want_y)


def test_golden_run_file_gradients(tmp_path, runner):
    """fakequant-grad over the same run file: the identity STE on every group; masked-ste refused there."""
    from qgcli.cli import main

    run, out = tmp_path / "run.h5", tmp_path / "grad.h5"
    _write_run(run, grad=True)
    r = runner.invoke(main, ["fakequant-grad", str(run), "-o", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    got, _ = _read(out)
    with h5py.File(run, "r") as f:
        for fam in ("mx", "nvfp4", "onnx"):
            for name in f[fam]:
                g = f[f"{fam}/{name}/gradients"][()]
                assert np.array_equal(got[f"{fam}/{name}/backprops_wrt_input"].view(np.uint32), g.view(np.uint32))


# --- single bundles through the options -------------------------------------------------------------------------

def _bundle(path, **arrays):
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            f[k] = v
    return str(path)


@pytest.mark.parametrize("name", ["mxfp4_floor_specials", "mxfp8-e4m3_rceil_near_pow2", "mxfp6-e3m2_even_axis0",
                                  "mxint8_ceil_code0", "mxfp8-e5m2_floor_bs4_3d"])
def test_fakequant_semantics_mx_options(cli, tmp_path, name):
    data, a = MX[name]
    b = _bundle(tmp_path / "b.h5", inputs=data["inputs"])
    out = tmp_path / "out.h5"
    r = cli("fakequant", b, "--semantics", "mx", "--mx-format", a["format"], "--block-size", a["block_size"],
            "--axis", a["axis"], "--scale-mode", a["scale_mode"], "-o", out, "--json")
    assert r.exit_code == 0, r.output
    got, _ = _read(out)
    assert same_bits(got["outputs"], data["outputs"]) and same_bits(got["scales"], data["scales"])
    s = json.loads(r.stdout)
    assert s["semantics"] == "mx" and s["statistics"]["blocks"] == data["scales"].size


def test_mx_defaults_are_e4m3_floor_32_last_axis(cli, tmp_path):
    data, _ = MX["mxfp8-e4m3_floor_normal"]
    b = _bundle(tmp_path / "b.h5", inputs=data["inputs"])
    r = cli("fakequant", b, "--semantics", "mx", "-o", tmp_path / "o.npz")
    assert r.exit_code == 0, r.output
    got = load_npz(tmp_path / "o.npz")
    assert same_bits(got["outputs"], data["outputs"])


@pytest.mark.parametrize("name", ["all_zero_pts0", "3d_pts1", "axis0_pts1"])
def test_fakequant_semantics_nvfp4_options(cli, tmp_path, name):
    data, a = NVFP4[name]
    b = _bundle(tmp_path / "b.h5", inputs=data["inputs"])
    out = tmp_path / "out.h5"
    extra = [] if a["per_tensor_scale"] else ["--no-per-tensor-scale"]
    r = cli("fakequant", b, "--semantics", "nvfp4", "--axis", a["axis"], *extra, "-o", out)
    assert r.exit_code == 0, r.output
    got, _ = _read(out)
    assert same_bits(got["outputs"], data["outputs"]) and same_bits(got["block_scales"], data["block_scales"])


def test_nvfp4_all_zero_with_per_tensor_scale_is_nan_and_said(cli, tmp_path):
    data, a = NVFP4["all_zero_pts1"]
    assert a["all_nan"]
    b = _bundle(tmp_path / "b.h5", inputs=data["inputs"])
    r = cli("fakequant", b, "--semantics", "nvfp4", "-o", tmp_path / "o.h5", "--json")
    assert r.exit_code == 0, r.output
    notes = " ".join(json.loads(r.stdout)["notes"])
    assert "every output is NaN" in notes and "per_tensor_scale" in notes
    got, _ = _read(tmp_path / "o.h5")
    assert np.isnan(got["outputs"]).all()


def _onnx_case(kind):
    """The first golden ONNX case of dtype/mode ``kind`` with a zero point (integer types)."""
    for name, (data, a) in sorted(ONNX.items()):
        if f"{a['dtype']}/{a['mode']}" == kind and ("y_zero_point" in data or a["dtype"].startswith("float")) \
                and a["data"] != "specials":
            return data, a
    raise LookupError(kind)


@pytest.mark.parametrize("kind", ["uint8/per-tensor", "int4/per-axis", "int16/blocked", "float8e4m3fn/blocked",
                                  "float4e2m1/per-axis", "uint4/blocked"])
def test_fakequant_semantics_onnx_options(cli, tmp_path, kind):
    data, a = _onnx_case(kind)
    b = _bundle(tmp_path / "b.h5", **{k: data[k] for k in ("x", "y_scale", "y_zero_point") if k in data})
    out = tmp_path / "out.h5"
    extra = [] if a["saturate"] else ["--no-saturate"]
    r = cli("fakequant", b, "--semantics", "onnx", "--dtype", a["dtype"], "--axis", a["axis"], "--block-size",
            a["block_size"] or 1, *extra, "-o", out)
    if not a["block_size"]:  # --block-size 1 with a per-axis/per-tensor scale would be blocked: run without it
        r = cli("fakequant", b, "--semantics", "onnx", "--dtype", a["dtype"], "--axis", a["axis"], *extra, "-o",
                out, "--force")
    assert r.exit_code == 0, r.output
    got, _ = _read(out)
    assert same_bits(got["outputs"], data["outputs"]) and same_bits(got["quantized"], data["quantized"])


def test_onnx_operands_from_options_and_zero_point_type(cli, tmp_path):
    """--inputs/--y-scale/--y-zero-point; no --dtype: the zero point's type (int8), as ONNX takes it."""
    x = np.array([[-3.0, -0.26, 0.0, 0.25, 0.75, 100.0]], np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "zp.npy", np.array(-2, np.int8))
    r = cli("fakequant", "--semantics", "onnx", "--inputs", tmp_path / "x.npy", "--y-scale", "0.5",
            "--y-zero-point", tmp_path / "zp.npy", "-o", tmp_path / "o.npz", "--json")
    assert r.exit_code == 0, r.output
    got = load_npz(tmp_path / "o.npz")
    assert got["quantized"].dtype == np.int8
    assert got["quantized"].tolist() == [[-8, -3, -2, -2, -0, 127]]  # round half to even: 0.5 -> 0, 1.5 -> 2
    assert got["outputs"].tolist() == [[-3.0, -0.5, 0.0, 0.0, 1.0, 64.5]]
    assert json.loads(r.stdout)["attributes"]["dtype"] == "int8"


def test_onnx_masked_ste_zeroes_exactly_the_saturated(cli, tmp_path):
    x = np.array([-1.0, -0.6, 0.0, 3.0, 3.6, 100.0, np.nan], np.float32)  # int4 with scale 0.5: [-8, 7]
    g = np.full(x.shape, 2.0, np.float32)
    b = _bundle(tmp_path / "b.h5", x=x, y_scale=np.float32(0.5), gradients=g)
    r = cli("fakequant-grad", b, "--semantics", "onnx", "--dtype", "int4", "--estimator", "masked-ste",
            "-o", tmp_path / "m.npz")
    assert r.exit_code == 0, r.output
    dx = load_npz(tmp_path / "m.npz")["backprops_wrt_input"]
    assert dx.tolist() == [2.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.0]  # round(7.2) = 7 passes, 200 and NaN do not
    assert not np.signbit(dx[5:]).any()  # +0
    r = cli("fakequant-grad", b, "--semantics", "onnx", "--dtype", "int4", "-o", tmp_path / "s.npz")
    assert r.exit_code == 0, r.output
    assert load_npz(tmp_path / "s.npz")["backprops_wrt_input"].tolist() == g.tolist()  # ste: the identity


@pytest.mark.parametrize("semantics,extra", [("mx", ["--mx-format", "mxfp4", "--block-size", "4"]), ("nvfp4", [])])
def test_mx_nvfp4_gradient_is_the_identity(cli, tmp_path, semantics, extra):
    x = np.linspace(-3, 3, 32, dtype=np.float32).reshape(2, 16)
    g = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
    b = _bundle(tmp_path / "b.h5", inputs=x, gradients=g)
    r = cli("fakequant-grad", b, "--semantics", semantics, *extra, "-o", tmp_path / "g.npz", "--json")
    assert r.exit_code == 0, r.output
    assert np.array_equal(load_npz(tmp_path / "g.npz")["backprops_wrt_input"], g)
    assert json.loads(r.stdout)["statistics"]["gradient"]["unchanged"] == 1.0


# --- refusals: one line, exit 2, nothing written -------------------------------------------------------------------

REFUSALS = [
    (["--semantics", "mx", "--block-size", "5"], "inputs", "divisible"),
    (["--semantics", "mx", "--mx-format", "mxfp5"], "--mx-format", None),
    (["--semantics", "nvfp4", "--scale-mode", "rceil"], "--scale-mode", "--semantics mx"),
    (["--semantics", "nvfp4", "--block-size", "32"], "--block-size", "--semantics mx / onnx"),
    (["--block-size", "4"], "--block-size", None),
    (["--semantics", "mx", "--no-per-tensor-scale"], "--no-per-tensor-scale", "nvfp4"),
    (["--semantics", "mx", "--num-bits", "4"], "--num-bits", None),
    (["--semantics", "mx", "--dtype", "int8"], "--dtype", None),
    (["--semantics", "mx", "--granularity", "per-row"], "--granularity", None),
    (["--semantics", "nvfp4", "--min", "0", "--max", "1"], "--min", None),
    (["--semantics", "onnx", "--dtype", "qint8"], "--dtype", None),
    (["--semantics", "onnx", "--dtype", "int8", "--no-saturate"], "--no-saturate", "float8"),
    (["--semantics", "onnx", "--mx-format", "mxfp4"], "--mx-format", None),
    (["--semantics", "torch", "--y-scale", "0.1"], "--y-scale", None),
    (["--semantics", "onnx", "--dtype", "float8e4m3fn", "--y-scale", "0.1", "--estimator", "masked-ste"],
     "--estimator", "integer"),
    (["--semantics", "mx", "--estimator", "masked-ste"], "--estimator", "integer"),
    (["--semantics", "mx", "--estimator", "lsq"], "--estimator", None),
]


@pytest.mark.parametrize("args,names,says", REFUSALS)
def test_refusals(cli, tmp_path, args, names, says):
    x = np.ones((2, 48), np.float32)
    b = _bundle(tmp_path / "b.h5", inputs=x, x=x, y_scale=np.float32(0.5), gradients=x)
    out = tmp_path / "out.h5"
    r = cli("fakequant-grad", b, *args, "-o", out)
    assert r.exit_code == 2, r.output
    lines = [line for line in r.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and names in lines[0], r.stderr
    assert says is None or says in lines[0]
    assert "Traceback" not in r.output and not out.exists()


def test_run_file_refuses_the_block_format_options(cli, tmp_path):
    run = tmp_path / "run.h5"
    with h5py.File(run, "w") as f:
        g = f.create_group("layer")
        g.attrs.update(op="mx", format="mxfp4", block_size=16)
        g["inputs"] = np.ones((2, 32), np.float32)
    r = cli("fakequant", run, "--block-size", "8", "-o", tmp_path / "o.h5")
    assert r.exit_code == 2 and "--block-size" in r.stderr
    r = cli("fakequant", run, "-o", tmp_path / "o.h5")
    assert r.exit_code == 0, r.output
    with h5py.File(run, "a") as f:
        f["layer"].attrs["block_size"] = 5
    r = cli("fakequant", run, "-o", tmp_path / "o2.h5")
    assert r.exit_code == 2 and "divisible" in r.stderr, r.output


# --- report and verify on run-file groups ----------------------------------------------------------------------------

def _layered_run(path, with_reference=False):
    """Three groups from golden cases (mx, nvfp4, QuantizeLinear with x), gradients of ones; ``with_reference``:
    each with a ``reference/outputs`` subgroup of the golden outputs (what verify reproduces)."""
    picks = [("mx", "mxfp4_rceil_normal"), ("nvfp4", "3d_pts1"), ("onnx", None)]
    with h5py.File(path, "w") as f:
        for fam, name in picks:
            if fam == "onnx":
                data, a = _onnx_case("int8/per-axis")
            else:
                data, a = (MX if fam == "mx" else NVFP4)[name]
            g = f.create_group(fam)
            if fam == "mx":
                g.attrs.update(op="mx", format=a["format"], block_size=int(a["block_size"]), scale_mode=a["scale_mode"])
            elif fam == "nvfp4":
                g.attrs.update(op="nvfp4", per_tensor_scale=True)
            else:
                g.attrs.update(op="QuantizeLinear", dtype=a["dtype"], axis=int(a["axis"]))
            for k in ("inputs", "x", "y_scale", "y_zero_point"):
                if k in data:
                    g[k] = data[k]
            g["gradients"] = np.ones(data.get("inputs", data.get("x")).shape, np.float32)
            if with_reference:
                g.create_group("reference")["outputs"] = data["outputs"]


def test_report_rows_of_block_format_groups(cli, tmp_path):
    run = tmp_path / "run.h5"
    _layered_run(run)
    r = cli("report", run, "--json")
    assert r.exit_code == 0, r.output
    rows = {row["path"]: row for row in json.loads(r.stdout)["layers"]}
    assert set(rows) == {"mx", "nvfp4", "onnx"}
    mx_data, _ = MX["mxfp4_rceil_normal"]
    assert rows["mx"]["channels"] == mx_data["scales"].size and rows["mx"]["num_bits"] == 4
    assert rows["nvfp4"]["channels"] == NVFP4["3d_pts1"][0]["block_scales"].size
    for row in rows.values():
        assert row["gradient_blocked"] == 0.0  # the identity STE blocks nothing
        assert row["sqnr_db"] is not None and row["sqnr_db"] > 0
    # the SQNR is the golden outputs' own
    x, y = mx_data["inputs"].astype(np.float64), mx_data["outputs"].astype(np.float64)
    want = 10 * np.log10(np.sum(x * x) / np.sum((y - x) ** 2))
    assert abs(rows["mx"]["sqnr_db"] - want) < 1e-9


def test_verify_reproduces_block_format_references(cli, tmp_path):
    run = tmp_path / "run.h5"
    _layered_run(run, with_reference=True)
    r = cli("verify", run, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    statuses = {row["path"]: row["status"] for row in doc["layers"]}
    assert statuses == {"mx": "identical", "nvfp4": "identical", "onnx": "identical"}
    with h5py.File(run, "a") as f:  # one wrong bit fails it
        ref = f["mx/reference/outputs"]
        bad = ref[()]
        bad.reshape(-1)[0] = np.nextafter(bad.reshape(-1)[0], np.float32(np.inf))
        ref[...] = bad
    r = cli("verify", run, "--json")
    assert r.exit_code != 0
    statuses = {row["path"]: row["status"] for row in json.loads(r.stdout)["layers"]}
    assert statuses["mx"] == "differs"


# --- compare-semantics --with tf,torch,onnx ------------------------------------------------------------------------

def test_compare_semantics_with_onnx_counts_ties_and_ranges(cli, tmp_path):
    """A grid of scale 1/16 (exact) and inputs on every half step: TF rounds half up, PyTorch and ONNX half to
    even, so TF differs from both on every other element (tie) and PyTorch equals ONNX; narrow range: ONNX's
    uint8 keeps 0 where the others clamp to 1."""
    x = (np.arange(-100, 100) * 0.0625 + 0.03125).astype(np.float32)
    b = _bundle(tmp_path / "b.h5", inputs=x, min=np.float32(-8), max=np.float32(7.9375))
    r = cli("compare-semantics", b, "--with", "tf,torch,onnx", "--json", "-o", tmp_path / "c.npz")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    pairs = {(p["a"], p["b"]): p for p in doc["pairs"]}
    assert pairs[("tf", "torch")]["differ"] == 100 and pairs[("tf", "torch")]["reasons"] == {"tie": 100}
    assert pairs[("tf", "onnx")]["reasons"] == {"tie": 100}
    assert pairs[("torch", "onnx")]["differ"] == 0
    assert doc["frameworks"]["onnx"]["grid_of"] == "tf" and doc["frameworks"]["onnx"]["dtype"] == "uint8"
    assert doc["frameworks"]["tf"]["max_abs_error_steps_inside"] == 0.5  # a tie is half a step from either
    got = load_npz(tmp_path / "c.npz")
    v = np.arange(-100, 100) + 128.5  # exact x / scale + zero point
    assert np.array_equal(got["q_tf"], np.floor(v + 0.5).astype(np.int64))  # half up
    assert np.array_equal(got["q_onnx"], np.rint(v).astype(np.int64))  # half to even
    r = cli("compare-semantics", b, "--with", "torch,onnx", "--narrow-range", "--json")
    doc = json.loads(r.stdout)
    assert doc["frameworks"]["onnx"]["grid_of"] == "torch"
    assert set(doc["pairs"][0]["reasons"]) <= {"range"}


def test_compare_semantics_with_torchao_is_torchaos_quantizer(cli, tmp_path):
    """--with torchao: torchao's own IntxFakeQuantizer (uint8 / uint4, per token, asymmetric) on a row holding the
    range's ends and the inputs (so that its min/max are the range) gives exactly qgcli's outputs_torchao; on
    half steps torchao rounds half to even like PyTorch and ONNX, TensorFlow half up."""
    torch = pytest.importorskip("torch")
    qat = pytest.importorskip("torchao.quantization.qat")
    from torchao.quantization.qat.fake_quantizer import IntxFakeQuantizer

    rng = np.random.default_rng(0)
    mn, mx = np.float32(-3.1), np.float32(5.3)
    for bits in (8, 4):
        step = (mx - mn) / np.float32(2**bits - 1)
        ties = ((np.arange(-2**bits, 2**bits) + 0.5) * step).astype(np.float32)
        x = np.concatenate([rng.uniform(mn, mx, 300), ties[(ties > mn) & (ties < mx)], [0.0]]).astype(np.float32)
        b = _bundle(tmp_path / f"b{bits}.h5", inputs=x, min=mn, max=mx)
        out = tmp_path / f"c{bits}.npz"
        r = cli("compare-semantics", b, "--with", "tf,torch,torchao,onnx", "--num-bits", bits, "--json", "-o", out)
        assert r.exit_code == 0, r.output
        doc = json.loads(r.stdout)
        fq = IntxFakeQuantizer(qat.IntxFakeQuantizeConfig(getattr(torch, f"uint{bits}"), "per_token",
                                                          is_symmetric=False))
        row = torch.from_numpy(np.concatenate([[mn, mx], x]).astype(np.float32)).reshape(1, -1)
        want = fq(row)[0, 2:].numpy()
        got = load_npz(out)
        assert same_bits(got["outputs_torchao"], want)
        assert doc["frameworks"]["torchao"]["scale"] == float(fq.scale.reshape(-1)[0])
        pairs = {(p["a"], p["b"]): p for p in doc["pairs"]}
        assert pairs[("torch", "torchao")]["differ"] == 0  # the same grid and arithmetic as PyTorch's
        assert set(pairs[("torchao", "onnx")]["reasons"]) <= {"arithmetic"}  # x * (1/s) against x / s
        assert pairs[("tf", "torchao")]["differ"] > 0 and set(pairs[("tf", "torchao")]["reasons"]) <= {"tie",
                                                                                                      "zero point"}


@pytest.mark.parametrize("args,says", [(["--with", "tf,mx"], "tf, torch, onnx, torchao"),
                                       (["--with", "tf"], "two or more"),
                                       (["--with", "tf,onnx", "--num-bits", "3"], "4-, 8- and 16-bit"),
                                       (["--with", "torch,torchao", "--num-bits", "16"], "uint1 to uint8")])
def test_compare_semantics_with_refusals(cli, tmp_path, args, says):
    b = _bundle(tmp_path / "b.h5", inputs=np.ones(4, np.float32), min=np.float32(-1), max=np.float32(1))
    r = cli("compare-semantics", b, *args, "-o", tmp_path / "c.npz")
    assert r.exit_code == 2 and "--with" in r.stderr and says in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "c.npz").exists()


def test_report_rows_give_the_block_statistics(cli, tmp_path):
    """report's row of an mx group blocked along axis 0 and an nvfp4 group: the share of nonzero inputs flushed
    to zero, of blocks whose scale saturates, the blocks' dynamic range and the worst block's SQNR, each
    recomputed here from the op's outputs."""
    from qgcli.ops import mx as mx_ops, nvfp4 as nvfp4_ops

    r = np.random.default_rng(3)
    x = (r.standard_normal((64, 6)) * np.exp2(r.integers(-20, 8, (1, 6)))).astype(np.float32)
    x[:32, 0] = 0
    x[3, 1] = 1e-30  # flushed, and a wide block
    x[:, 5] *= np.float32(2.0**-130)  # subnormal: scale code 0, saturated
    run = tmp_path / "run.h5"
    with h5py.File(run, "w") as f:
        g = f.create_group("m")
        g.attrs.update(op="mx", format="mxfp4", block_size=32, axis=0)
        g["inputs"] = x
        g = f.create_group("n")
        g.attrs.update(op="nvfp4", per_tensor_scale=False)
        g["inputs"] = x.T.copy()
    res = cli("report", run, "--json")
    assert res.exit_code == 0, res.output
    rows = {row["path"]: row for row in json.loads(res.stdout)["layers"]}
    m = mx_ops.mx_fake_quantize(x, format="mxfp4", block_size=32, axis=0)
    xb = np.moveaxis(x, 0, -1).reshape(-1, 32).astype(np.float64)
    yb = np.moveaxis(m.outputs, 0, -1).reshape(-1, 32).astype(np.float64)
    nz = xb != 0
    assert rows["m"]["flushed"] == pytest.approx(np.sum(nz & (yb == 0)) / np.sum(nz))
    codes = np.moveaxis(m.scales, 0, -1).reshape(-1)
    assert rows["m"]["saturated_scale_blocks"] == pytest.approx(np.mean((codes == 0) | (codes >= 254)))
    assert rows["m"]["saturated_scale_blocks"] > 0
    with np.errstate(divide="ignore"):
        amin = np.where(nz, np.abs(xb), np.inf).min(axis=1)
        dyn = np.log2(np.abs(xb).max(axis=1)) - np.log2(amin)
    dyn = dyn[nz.any(axis=1)]
    assert rows["m"]["dynamic_range_bits_max"] == pytest.approx(dyn.max())
    assert rows["m"]["dynamic_range_bits_median"] == pytest.approx(np.median(dyn))
    err = ((yb - xb) ** 2).sum(axis=1)
    with np.errstate(all="ignore"):
        sqnr = np.where(err > 0, 10 * np.log10((xb ** 2).sum(axis=1) / err), np.inf)
    assert rows["m"]["worst_channel"] == int(np.argmin(sqnr))
    assert rows["m"]["worst_channel_sqnr_db"] == pytest.approx(sqnr.min())
    n = nvfp4_ops.nvfp4_fake_quantize(x.T.copy(), per_tensor_scale=False)
    c = np.asarray(n.block_scales).view(np.uint8) & 0x7F
    assert rows["n"]["saturated_scale_blocks"] == pytest.approx(np.mean((c == 0x08) | (c == 0x7E)))
    text = cli("report", run)
    assert text.exit_code == 0
    line = next(ln for ln in text.stdout.splitlines() if ln.startswith("m: "))
    assert f"flushed to zero {100 * rows['m']['flushed']:.1f}%" in line and "scale saturated in" in line
    assert f"worst block {rows['m']['worst_channel']} at {rows['m']['worst_channel_sqnr_db']:.1f} dB" in line


def test_a_quantize_linear_group_that_says_masked_ste_runs_and_is_drawn_masked(cli, tmp_path):
    """A QuantizeLinear group whose ``estimator`` attribute is masked-ste (ModelOpt's pass_through_bwd=False,
    onnxruntime training's FakeQuant) gets that gradient in fakequant-grad RUN and in plot ste RUN (the mask
    drawn with its 0s), the same bits as the bundle with --estimator masked-ste; the other groups keep the
    identity; masked-ste on a float type, or another estimator, makes the group invalid with the reason."""
    x = np.array([[-1.0, -0.6, 0.0, 3.0, 3.6, 100.0, -50.0, 0.2]], np.float32)  # int4 with scale 0.5: [-8, 7]
    g = np.linspace(1, 8, x.size, dtype=np.float32).reshape(x.shape)
    run = tmp_path / "run.h5"
    with h5py.File(run, "w") as f:
        for name, attrs in (("masked", {"estimator": "masked-ste"}), ("identity", {}),
                            ("float_masked", {"estimator": "masked-ste", "dtype": "float8e4m3fn"}),
                            ("bogus", {"estimator": "lsq"})):
            grp = f.create_group(name)
            grp.attrs.update(op="QuantizeLinear", dtype=attrs.pop("dtype", "int4"), axis=1, **attrs)
            grp["x"], grp["y_scale"], grp["gradients"] = x, np.float32(0.5), g
    r = cli("fakequant-grad", run, "-o", tmp_path / "bad.h5")
    assert r.exit_code == 2 and "2 of 4 groups" in r.stderr and not (tmp_path / "bad.h5").exists()
    r = cli("fakequant-grad", run, "-o", tmp_path / "g.h5", "--json", "--skip-invalid")
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    reasons = {item["path"]: item["reason"] for item in s["invalid"]}
    assert set(reasons) == {"float_masked", "bogus"}
    assert "masked-ste" in reasons["float_masked"] and "float8e4m3fn" in reasons["float_masked"]
    assert "'lsq'" in reasons["bogus"]
    b = _bundle(tmp_path / "b.h5", x=x, y_scale=np.float32(0.5), gradients=g)
    r = cli("fakequant-grad", b, "--semantics", "onnx", "--dtype", "int4", "--estimator", "masked-ste",
            "-o", tmp_path / "m.npz")
    assert r.exit_code == 0, r.output
    want = load_npz(tmp_path / "m.npz")["backprops_wrt_input"]
    assert want.tolist() == [[1.0, 2.0, 3.0, 4.0, 5.0, 0.0, 0.0, 8.0]]  # round(7.2) = 7 passes, 200 and -100 not
    with h5py.File(tmp_path / "g.h5", "r") as f:
        assert f["masked/backprops_wrt_input"][()].view(np.uint32).tolist() == want.view(np.uint32).tolist()
        assert np.array_equal(f["identity/backprops_wrt_input"][()], g)
    r = cli("fakequant-grad", run, "--estimator", "ste", "-o", tmp_path / "s.h5", "--quiet", "--skip-invalid")
    assert r.exit_code == 0, r.output  # typed on the command line, the identity for every group
    with h5py.File(tmp_path / "s.h5", "r") as f:
        assert np.array_equal(f["masked/backprops_wrt_input"][()], g)
    for layer, values in (("masked", [0.0, 1.0]), ("identity", [1.0])):
        r = cli("plot", "ste", run, "--layer", layer, "-o", tmp_path / f"{layer}.png", "--json")
        assert r.exit_code == 0, r.output
        assert json.loads(r.stdout)["mask_values"] == values
