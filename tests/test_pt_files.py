"""PyTorch .pt/.pth files as SPECs and bundles (#40, item 9): torch.load(weights_only=True) only, keys by name."""
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT

torch = pytest.importorskip("torch")


class _Runs:
    """Unpickling this runs a shell command: what a hostile .pt holds."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def files(tmp_path):
    g = torch.Generator().manual_seed(0)
    sd = {"backbone.conv1.weight": torch.randn(4, 3, generator=g), "backbone.conv1.bias": torch.randn(4, generator=g),
          "head.w": torch.randn(3, 3, generator=g).to(torch.bfloat16)}
    torch.save(sd, tmp_path / "sd.pt")
    torch.save({"model": sd, "epoch": 3, "opt": [torch.zeros(2)]}, tmp_path / "ckpt.pth")
    torch.save(torch.linspace(-1, 1, 20), tmp_path / "one.pt", _use_new_zipfile_serialization=False)
    torch.save({"x": torch.zeros(1), "e": _Runs(tmp_path / "ran")}, tmp_path / "evil.pt")
    return tmp_path, sd


def test_state_dict_keys_nested_keys_and_one_tensor(files, cli):
    d, sd = files
    from qgcli.storage import io

    with io.Container.open(str(d / "ckpt.pth")) as c:
        assert c.names() == ["model/backbone.conv1.weight", "model/backbone.conv1.bias", "model/head.w", "opt/0"]
        w = c.read("model/head.w")
        assert w.dtype.name == "bfloat16"
        assert np.array_equal(w.astype(np.float32), sd["head.w"].float().numpy())
    with io.Container.open(str(d / "one.pt")) as c:  # the legacy (pickle) format, one tensor
        assert c.names() == ["tensor"] and np.array_equal(c.read(), torch.linspace(-1, 1, 20).numpy())
    r = cli("fakequant", "--inputs", f"{d / 'sd.pt'}:backbone.conv1.weight", "--min", "-1", "--max", "1",
            "-o", str(d / "w.npy"))
    assert r.exit_code == 0, r.output
    np.save(d / "w_ref.npy", sd["backbone.conv1.weight"].numpy())
    tf = cli("fakequant", "--inputs", str(d / "w_ref.npy"), "--min", "-1", "--max", "1", "-o", str(d / "r.npy"))
    assert tf.exit_code == 0 and np.array_equal(np.load(d / "w.npy"), np.load(d / "r.npy"))


def test_a_missing_key_is_answered_with_the_closest(files, cli):
    d, _ = files
    r = cli("report", "--inputs", f"{d / 'sd.pt'}:backbone.conv.weight", "--min", "-1", "--max", "1")
    assert r.exit_code == 2 and r.stderr.count("\n") == 1
    assert "has no tensor 'backbone.conv.weight' (closest: backbone.conv1.weight" in r.stderr


def test_a_file_holding_code_is_refused_and_the_code_never_runs(files, cli):
    d, _ = files
    r = cli("inspect", str(d / "evil.pt"))
    assert r.exit_code == 2 and "weights_only=True" in r.stderr and "never unpickles code" in r.stderr
    assert r.stderr.count("\n") == 1
    assert not (d / "ran").exists()


def test_pt_is_never_an_output(files, cli):
    d, _ = files
    r = cli("fakequant", "--inputs", f"{d / 'sd.pt'}:head.w", "--min", "-1", "--max", "1", "-o", str(d / "o.pt"))
    assert r.exit_code == 2 and "does not write them" in r.stderr and not (d / "o.pt").exists()


def test_without_torch_the_error_names_the_extra(files):
    d, _ = files
    code = ("import sys; sys.modules['torch'] = None\n"
            "from qgcli.cli import main; main(['inspect', sys.argv[1]])")
    r = subprocess.run([sys.executable, "-c", code, str(d / "sd.pt")], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 2 and "pip install 'qgcli[torch]'" in r.stderr, r.stderr
