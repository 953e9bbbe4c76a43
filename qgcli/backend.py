"""Array-module dispatch: ops take their module from their arguments, never from a global switch.

CuPy is imported only when a GPU is asked for or a CuPy array is passed in.
"""
import sys

import numpy

from qgcli.errors import DeviceError


def array_module(*arrays):
    """Return ``cupy`` if any argument is a CuPy array, else ``numpy``."""
    cupy = sys.modules.get("cupy")
    if cupy is not None and any(isinstance(a, cupy.ndarray) for a in arrays):
        return cupy

    return numpy


def get_xp(device="cpu"):
    """The array module for ``device`` ("cpu" or "gpu"); a clear error when the GPU is unusable."""
    if device == "cpu":
        import numpy

        return numpy
    if device != "gpu":
        raise DeviceError(f"unknown device {device!r}; use cpu or gpu", operand="--device")
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install raising at import
        raise DeviceError(
            f"the GPU needs CuPy ({type(exc).__name__}: {exc}); install with pip install 'qgcli[gpu]'",
            operand="--device",
        ) from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        raise DeviceError(f"CuPy found no usable CUDA device ({exc})", operand="--device") from None
    if count < 1:
        raise DeviceError("CuPy found no CUDA device", operand="--device")
    return cupy


def to_numpy(a):
    """A NumPy array from a NumPy or CuPy array (or scalar)."""
    if hasattr(a, "get") and type(a).__module__.startswith("cupy"):
        return a.get()

    return numpy.asarray(a)
