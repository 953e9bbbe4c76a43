"""QuantizeAndDequantizeV2/V3/V4 and V4Grad against real TensorFlow 2.21 (tests/golden/qdq.h5), bit for bit."""
import os

import h5py
import numpy as np
import pytest

from qgcli.errors import QgcliError
from qgcli.ops import quantize_and_dequantize as qdq

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "qdq.h5")
VERSION = {"QuantizeAndDequantizeV2": "v2", "QuantizeAndDequantizeV3": "v3", "QuantizeAndDequantizeV4": "v4"}


def _load():
    with h5py.File(GOLDEN, "r") as f:
        out = []
        for name, g in f.items():
            attrs = {k: (v.item() if hasattr(v, "item") else v) for k, v in g.attrs.items()}
            data = {k: g[k][()] for k in g}
            out.append(pytest.param(name, attrs, data, id=name))
        return out


CASES = _load()


def _call(attrs, data, xp=np):
    op = attrs["op"]
    axis = int(attrs["axis"])
    if op == "QuantizeAndDequantizeV4Grad":
        res = qdq.quantize_and_dequantize_v4_grad(xp.asarray(data["gradients"]), xp.asarray(data["input"]),
                                                  data["input_min"], data["input_max"], axis=axis)
        return dict(zip(("input_backprop", "input_min_backprop", "input_max_backprop"), res))
    version = VERSION[op]
    return {"output": qdq._run(version, xp.asarray(data["input"]), data["input_min"], data["input_max"],
                               bool(attrs["signed_input"]), int(attrs["num_bits"]), bool(attrs["range_given"]),
                               str(attrs["round_mode"]), bool(attrs["narrow_range"]), axis)}


def _bits(a):
    a = np.asarray(a, np.float32)
    return a.shape, a.tobytes()


@pytest.mark.parametrize("name,attrs,data", CASES)
def test_golden(name, attrs, data):
    # qgcli's own refusal: NaN data with a per-axis range from the data (see NAN_RANGE_LIMIT).
    if "error" in attrs or ("NaN, from data" in attrs["description"] and int(attrs["axis"]) >= 0):
        with pytest.raises(QgcliError) as info:
            _call(attrs, data)
        assert "\n" not in str(info.value)
        return
    got = _call(attrs, data)
    expected = {k: data[k] for k in ("output", "input_backprop", "input_min_backprop", "input_max_backprop")
                if k in data}
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert _bits(got[k]) == _bits(v), (k, attrs["description"])


def test_golden_file_is_tf_2_21():
    with h5py.File(GOLDEN, "r") as f:
        assert f.attrs["tensorflow_version"] == "2.21.0"
        assert bool(f.attrs["onednn_identical"])
        assert len(f) >= 400


def test_issue_example():
    x = np.array([-3.0], np.float32)
    out = qdq.quantize_and_dequantize_v4(x, -2.0, 2.5, num_bits=4, range_given=True)
    assert out[0] == np.float32(-8) * (np.float32(2.5) / np.float32(7))


def test_half_up_rounds_just_below_half_up():
    out = qdq.quantize_and_dequantize_v4(np.array([0.49999997], np.float32), -128.0, 127.0, range_given=True,
                                         round_mode="HALF_UP")
    assert out.tolist() == [1.0]


# --- the CLI ------------------------------------------------------------------------------------------------

def _golden_case(name):
    with h5py.File(GOLDEN, "r") as f:
        g = f[name]
        return dict(g.attrs), {k: g[k][()] for k in g}


def _first(pred):
    for p in CASES:
        name, attrs, data = p.values
        if pred(attrs):
            return name, attrs, data
    raise LookupError


def test_cli_forward_and_grad_bitwise(tmp_path):
    from click.testing import CliRunner

    from qgcli.cli import main

    for pred, cmd in ((lambda a: a["op"] == "QuantizeAndDequantizeV4" and "error" not in a and a["range_given"]
                       and a["round_mode"] == "HALF_UP" and not a["signed_input"], "fakequant"),
                      (lambda a: a["op"] == "QuantizeAndDequantizeV3" and "error" not in a and a["axis"] == 1,
                       "fakequant"),
                      (lambda a: a["op"] == "QuantizeAndDequantizeV4Grad" and "error" not in a and a["axis"] == 2,
                       "fakequant-grad")):
        name, attrs, data = _first(pred)
        bundle = tmp_path / f"{name}.h5"
        with h5py.File(bundle, "w") as f:
            for k, v in data.items():
                if k in ("input", "input_min", "input_max", "gradients"):
                    f[k] = v
        variant = {"QuantizeAndDequantizeV4": "v4", "QuantizeAndDequantizeV3": "v3",
                   "QuantizeAndDequantizeV4Grad": "v4"}[attrs["op"]]
        args = [cmd, str(bundle), "--variant", f"quantize-and-dequantize-{variant}", "-o", str(tmp_path / f"o{name}.npz"),
                "-q", "--axis", str(int(attrs["axis"]))]
        if cmd == "fakequant":
            args += ["--num-bits", str(int(attrs["num_bits"])),
                     "--signed-input" if attrs["signed_input"] else "--no-signed-input",
                     "--range-given" if attrs["range_given"] else "--no-range-given"]
            if attrs["narrow_range"]:
                args.append("--narrow-range")
            if variant != "v3":
                args += ["--round-mode", str(attrs["round_mode"])]
        r = CliRunner().invoke(main, args)
        assert r.exit_code == 0, r.output
        with np.load(tmp_path / f"o{name}.npz") as got:
            for k in ("output", "input_backprop", "input_min_backprop", "input_max_backprop"):
                if k in data:
                    assert _bits(got[k]) == _bits(data[k]), (name, k)


@pytest.mark.parametrize("argv,words", [
    (["--input-min", "2", "--input-max", "1", "--range-given"], "input_min 2 > input_max 1"),
    (["--num-bits", "62"], "1..61"),
    (["--axis", "-2"], "at least -1"),
    (["--axis", "0", "--range-given", "--input-min", "-1,-1", "--input-max", "1,1"], "V3 accepts"),
    (["--dtype", "qint8"], "QuantizeV2"),
])
def test_cli_refusals(tmp_path, argv, words):
    from click.testing import CliRunner

    from qgcli.cli import main

    np.save(tmp_path / "x.npy", np.arange(6, dtype=np.float32).reshape(2, 3))
    args = ["fakequant", "--variant", "quantize-and-dequantize-v4", "--input", str(tmp_path / "x.npy"),
            "-o", str(tmp_path / "o.npz")]
    if "--input-min" not in argv:
        args += ["--input-min", "-1", "--input-max", "1"]
    r = CliRunner().invoke(main, args + argv)
    assert r.exit_code == 2, r.output
    assert words in r.output
    assert "Traceback" not in r.output


def test_cli_v2_grad_passes_through_and_other_variants_refuse_input(tmp_path):
    from click.testing import CliRunner

    from qgcli.cli import main

    g = np.array([1e-39, 2.0, np.inf], np.float32)
    np.save(tmp_path / "g.npy", g)
    np.save(tmp_path / "x.npy", np.array([0.0, 5.0, 9.0], np.float32))
    r = CliRunner().invoke(main, ["fakequant-grad", "--variant", "quantize-and-dequantize-v2", "--gradients",
                                  str(tmp_path / "g.npy"), "--input", str(tmp_path / "x.npy"), "--input-min", "-1",
                                  "--input-max", "1", "-o", str(tmp_path / "o.npz"), "--json"])
    assert r.exit_code == 0, r.output
    assert "pass-through" in r.output
    with np.load(tmp_path / "o.npz") as out:
        assert set(out) == {"input_backprop"} and out["input_backprop"].tobytes() == g.tobytes()
    r = CliRunner().invoke(main, ["fakequant", "--input", str(tmp_path / "x.npy"), "--min", "-1", "--max", "1",
                                  "-o", str(tmp_path / "p.npz")])
    assert r.exit_code == 2 and "--input" in r.output


def test_cli_subprocess(tmp_path):
    import subprocess
    import sys

    np.save(tmp_path / "x.npy", np.array([-3, -2, 0, 1, 2.5, 3], np.float32))
    p = subprocess.run([sys.executable, "-m", "qgcli", "fakequant", "--variant", "quantize-and-dequantize-v4",
                        "--input", str(tmp_path / "x.npy"), "--input-min", "-2", "--input-max", "2.5", "--num-bits",
                        "4", "--range-given", "-o", str(tmp_path / "o.npz")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "outside [input_min, input_max]" in p.stderr.replace("\n", " ")
    with np.load(tmp_path / "o.npz") as out:
        assert out["output"][0] == np.float32(-8) * (np.float32(2.5) / np.float32(7))
