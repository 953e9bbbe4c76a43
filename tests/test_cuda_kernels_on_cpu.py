"""The CUDA kernels' arithmetic, compiled for the CPU and checked against TensorFlow's golden cases.

``qgcli/ops/cuda.py`` keeps each kernel's per-index body in plain C (``DEVICE_SOURCE``). Here the host C
compiler builds those same bodies, with the ``__f*_rn`` intrinsics as plain float operations and FMA
contraction off, behind loops that stand in for the grid; the orchestration in ``cuda.quantize`` and
``cuda.backprops`` (reduction plan, launches, host-side combination) runs unchanged through a launcher
that calls them. So on a machine without a GPU the GPU path's numerics are still pinned bit for bit.
"""
import ctypes
import os
import shutil
import subprocess

import h5py
import numpy as np
import pytest

from qgcli.ops import cuda, fake_quant

from conftest import GOLDEN

SHIMS = r"""
#include <math.h>
#define __device__
#define __forceinline__ static inline
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
"""


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the kernels for the CPU")
    loops = "".join(
        f"void cpu_{name}(long long n, {params}) {{ for (long long i = 0; i < n; ++i) {name}_at(i, {args}); }}\n"
        for name, params, args in cuda.KERNELS
    )
    folder = tmp_path_factory.mktemp("kernels")
    source, library = folder / "kernels.c", folder / "kernels.so"
    source.write_text(SHIMS + cuda.DEVICE_SOURCE + loops)
    subprocess.run([compiler, "-O2", "-std=c99", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC",
                    str(source), "-o", str(library), "-lm"], check=True, capture_output=True)
    return CpuLauncher(ctypes.CDLL(str(library)))


class CpuLauncher:
    """Stands in for cuda.CupyLauncher: NumPy arrays, C loops instead of a CUDA grid."""

    xp = np

    def __init__(self, lib):
        self.lib = lib

    def __call__(self, name, n, *args):
        def c_arg(a):
            if isinstance(a, np.ndarray):
                assert a.flags.c_contiguous
                return ctypes.c_void_p(a.ctypes.data)
            return ctypes.c_longlong(int(a)) if isinstance(a, np.int64) else ctypes.c_int(int(a))

        getattr(self.lib, "cpu_" + name)(ctypes.c_longlong(n), *[c_arg(a) for a in args])

    @staticmethod
    def to_host(a):
        return a


def load_cases():
    with h5py.File(os.path.join(GOLDEN, "fake_quant.h5"), "r") as f:
        cases = []
        for name in f:
            attrs = dict(f[name].attrs)
            if "error" in attrs or str(attrs.get("description", "")).startswith("tf-garbage:"):
                continue
            cases.append((name, attrs, {k: f[name][k][()] for k in f[name]}))
        return cases


CASES = load_cases()


def same_bits(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    nan = np.isnan(want)
    return np.array_equal(np.isnan(got), nan) and np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("name, attrs, data", CASES, ids=[c[0] for c in CASES])
def test_kernels_match_tensorflow(launcher, name, attrs, data):
    op = attrs["op"]
    bits, narrow = int(attrs["num_bits"]), bool(attrs["narrow_range"])
    x = np.asarray(data["inputs"], np.float32)
    if op.startswith("FakeQuantWithMinMaxArgs"):
        grid, depth, divide = fake_quant._args_grid(attrs["min"], attrs["max"], bits, narrow), 1, False
    elif op.startswith("FakeQuantWithMinMaxVarsPerChannel"):
        grid, _ = fake_quant._prepare_per_channel(x, data["min"], data["max"], bits, narrow, -1, np)
        depth, divide = x.shape[-1], False
    else:
        grid = fake_quant._prepare_per_tensor(x, data["min"], data["max"], bits, narrow, np)
        depth, divide = 1, True
    x2 = x.reshape(-1, depth)
    if not op.endswith("Gradient"):
        out = cuda.quantize(x2, grid, divide, grid.needs_flush(), launch=launcher)
        assert same_bits(out.reshape(x.shape), data["outputs"]), name
        return
    g2 = np.asarray(data["gradients"], np.float32).reshape(-1, depth)
    if op == "FakeQuantWithMinMaxArgsGradient":
        dx = cuda.backprops(g2, x2, grid, reduce=False, kind="flat", launch=launcher)
        assert same_bits(dx.reshape(x.shape), data["backprops"]), name
        return
    kind = "chip" if depth > 1 or "PerChannel" in op else "flat"
    dx, dmin, dmax = cuda.backprops(g2, x2, grid, reduce=True, kind=kind, launch=launcher)
    assert same_bits(dx.reshape(x.shape), data["backprops_wrt_input"]), name
    assert same_bits(np.reshape(dmin, np.shape(data["backprop_wrt_min"])), data["backprop_wrt_min"]), name
    assert same_bits(np.reshape(dmax, np.shape(data["backprop_wrt_max"])), data["backprop_wrt_max"]), name


def test_the_kernel_source_compiles_for_the_gpu(tmp_path):
    """With the CUDA toolkit present (no GPU needed), nvcc must accept the module for Hopper."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    source = tmp_path / "kernels.cu"
    source.write_text("#include <cuda_runtime.h>\n#include <math.h>\n" + cuda.KERNEL_SOURCE)
    proc = subprocess.run([nvcc, "-arch=sm_90", "--fmad=false", "-std=c++14", "-c", str(source), "-o",
                           str(tmp_path / "kernels.o")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
