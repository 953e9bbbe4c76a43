"""Builds the optional compiled kernels (qgcli/ops/_kernels.c); everything else is in pyproject.toml.

``optional=True``: without a C compiler the install still succeeds and qgcli runs its NumPy kernels,
which give the same bits, only slower.  On x86-64 a second build uses AVX2 (picked at run time when the
CPU has it): floorf becomes one roundps and the loops run 8 lanes wide.
"""
import platform
import sys

from setuptools import Extension, setup

# -ffp-contract=off: no a * b + c may become an FMA (TF rounds the product); -fno-math-errno lets floorf be
# inlined; -fno-trapping-math only lets gcc if-convert the vectorised loops: neither changes a value.
FLAGS = [] if sys.platform == "win32" else ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]


def kernels(module, extra=()):
    return Extension(f"qgcli.ops.{module}", ["qgcli/ops/_kernels.c"], extra_compile_args=FLAGS + list(extra),
                     define_macros=[("QG_MODULE", module)], optional=True)


modules = [kernels("_kernels")]
if platform.machine().lower() in ("x86_64", "amd64") and sys.platform != "win32":
    modules.append(kernels("_kernels_avx2", ["-mavx2"]))
setup(ext_modules=modules)
