"""One TensorFlow package in qgcli[tensorflow], and its CUDA start-up noise kept out of qgcli's output (#40)."""
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from qgcli.monitor import quiet_tensorflow

#: What the `tensorflow` wheel printed here on import and first device scan, on a machine without a GPU.
STARTUP = """\
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1796281766.258206    8320 port.cc:153] oneDNN custom operations are on. You may see slightly different numerical results due to floating-point round-off errors from different computation orders. To turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.
I0000 00:00:1796281766.258632    8320 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.
I0000 00:00:1796281766.454283    8320 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use available CPU instructions in performance-critical operations.
To enable the following instructions: AVX2 AVX512F AVX512_VNNI AVX512_BF16 FMA, in other operations, rebuild TensorFlow with the appropriate compiler flags.
E0000 00:00:1796281777.026279    8320 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)
"""
REAL = "E0000 00:00:1796281777.1 8320 op_kernel.cc:1] OP_REQUIRES failed: a real problem\n"


def _extra():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is new in Python 3.11")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        return tomllib.load(fh)["project"]["optional-dependencies"]["tensorflow"]


def _name(requirement):
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower().replace("_", "-")


def test_the_extra_names_one_tensorflow_package_the_one_tf_keras_requires():
    names = [_name(r) for r in _extra()]
    tensorflows = [n for n in names if n.startswith("tensorflow") and n != "tensorflow-model-optimization"]
    assert tensorflows == ["tensorflow"], names
    from importlib import metadata

    try:
        requires = metadata.requires("tf_keras") or []
    except metadata.PackageNotFoundError:
        return
    assert "tensorflow" in {_name(r) for r in requires if "extra ==" not in r}


def test_only_the_startup_lines_are_dropped():
    assert quiet_tensorflow.without_noise(STARTUP + REAL) == REAL
    assert quiet_tensorflow.without_noise("Traceback (most recent call last):\n") == "Traceback (most recent call last):\n"


def test_the_filter_holds_descriptor_2_and_passes_the_rest_on(capfd):
    with quiet_tensorflow._stderr_filtered():
        os.write(2, (STARTUP + REAL).encode())
        print("from python", file=sys.stderr)
    out, err = capfd.readouterr()
    assert err == "from python\n" + REAL or err == REAL + "from python\n"
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "after\n"


def test_capture_imports_tensorflow_without_cuda_noise():
    pytest.importorskip("tensorflow")
    code = ("import sys; from qgcli.capture.tensorflow import _tf; tf = _tf(); tf.constant(1.0) + 1; "
            "print('ready', file=sys.stderr)")
    env = dict(os.environ, PYTHONPATH=ROOT, TF_USE_LEGACY_KERAS="1")
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.endswith("ready\n")
    for noise in ("cuInit", "cudart_stub", "cpu_feature_guard", "oneDNN", "absl::InitializeLog"):
        assert noise not in done.stderr, done.stderr
