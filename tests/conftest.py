"""Shared fixtures: the ``xp`` array-module fixture (NumPy, and CuPy where a GPU exists), paths, CLI runner."""
import os
import sys

import numpy as np
import pytest

# TF's reduction order depends on its intra-op thread count; the golden files were made with 2 threads.
os.environ.setdefault("QGCLI_TF_THREADS", "2")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden")
SAMPLES = os.path.join(ROOT, "samples")


def _cupy_or_none():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return cupy
    except Exception:
        return None
    return None


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request):
    """Run an op test on NumPy, and on CuPy where CuPy and a CUDA device exist (skipped otherwise)."""
    if request.param == "numpy":
        return np
    cupy = _cupy_or_none()
    if cupy is None:
        pytest.skip("CuPy with a CUDA device is not available")
    return cupy


@pytest.fixture(autouse=True)
def _numpy_kernels_chosen_where_none_are_built(monkeypatch):
    """Where the compiled kernels are not built (an install without a C compiler), every command would end in
    the note that says so (qgcli.ops.native.take_fallback_note), and the tests that read stderr whole would
    fail: choose the NumPy kernels deliberately (the same bits).  The note's own test
    (tests/test_small_things.py) runs its commands with QGCLI_NATIVE unset."""
    from qgcli.ops import native

    if "QGCLI_NATIVE" not in os.environ and native.variant() == "numpy":
        monkeypatch.setenv("QGCLI_NATIVE", "0")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """PyTorch on one intra-op thread wherever a test module imported it.  Its OpenMP threads spin while they
    wait: on a shared 2-core machine two of them doubled the CPU time of the PyTorch tests (tests/
    test_monitor_torch.py + test_capture_models.py: 46 s -> 26 s user at load 4), with the models these
    tests train no faster.  The golden files were made on one thread (tests/golden/make_golden_formats.py)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(params=["auto", "baseline", "numpy"])
def kernels(request, monkeypatch):
    """Run a CPU test under each kernel build: compiled (AVX2 where the CPU has it), compiled for baseline
    x86-64, and the NumPy kernels.  Returns the variant that actually ran (see qgcli.ops.native)."""
    from qgcli.ops import native

    monkeypatch.setenv("QGCLI_NATIVE", {"auto": "", "baseline": "baseline", "numpy": "0"}[request.param])
    if request.param != "numpy" and native.library() is None:
        pytest.skip("the compiled kernels are not built here")
    return native.variant()


@pytest.fixture
def runner():
    """click's CliRunner as click >= 8.2 has it: ``result.stderr`` apart, ``result.output`` both streams."""
    from clirunner import make_runner

    return make_runner()


@pytest.fixture
def cli(runner):
    """Invoke the real click CLI in-process: ``cli("fakequant", ...)`` -> click Result."""
    from qgcli.cli import main

    def invoke(*args, input=None):
        return runner.invoke(main, [str(a) for a in args], input=input)

    return invoke
