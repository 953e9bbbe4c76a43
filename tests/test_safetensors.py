"""safetensors as a SPEC, a bundle and an output (-o out.safetensors), through safetensors' NumPy API."""
import numpy as np
import pytest

st = pytest.importorskip("safetensors.numpy")

from qgcli.storage import io  # noqa: E402
from qgcli.cli import main  # noqa: E402


def test_spec_bundle_and_output(tmp_path, runner):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    g = rng.standard_normal((4, 8)).astype(np.float32)
    bundle = str(tmp_path / "b.safetensors")
    st.save_file({"inputs": x, "gradients": g, "min": np.array(-1.0, np.float32), "max": np.array(1.0, np.float32)}, bundle)
    out = str(tmp_path / "out.safetensors")
    r = runner.invoke(main, ["fakequant-grad", bundle, "-o", out])
    assert r.exit_code == 0, r.output
    ref = str(tmp_path / "ref.npz")
    r = runner.invoke(main, ["fakequant-grad", "--inputs", f"{bundle}:inputs", "--gradients",
                                  f"{bundle}:gradients", "--min", "-1", "--max", "1", "-o", ref])
    assert r.exit_code == 0, r.output
    got = st.load_file(out)
    with np.load(ref) as want:
        assert set(got) == set(want.files)
        for k in want.files:
            np.testing.assert_array_equal(got[k], want[k])
    assert io.load_spec(io.parse_spec(f"{bundle}:inputs")).tobytes() == x.tobytes()


def test_run_file_to_safetensors(tmp_path, runner):
    out = str(tmp_path / "grads.safetensors")
    r = runner.invoke(main, ["fakequant-grad", "samples/run.h5:step_000100", "-o", out, "-q"])
    assert r.exit_code == 0, r.output
    assert "step_000100/backbone/conv1/weight_quant/backprops_wrt_input" in st.load_file(out)


def test_bad_files(tmp_path, runner):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file at all")
    r = runner.invoke(main, ["fakequant", str(bad), "-o", str(tmp_path / "o.npz")])
    assert r.exit_code == 2 and "bad.safetensors" in r.stderr and "Traceback" not in r.output
    good = str(tmp_path / "g.safetensors")
    st.save_file({"inputs": np.zeros(3, np.float32)}, good)
    r = runner.invoke(main, ["fakequant", "--inputs", f"{good}:nope", "--min", "0", "--max", "1",
                                  "-o", str(tmp_path / "o.npz")])
    assert r.exit_code == 2 and "no key 'nope'" in r.stderr
