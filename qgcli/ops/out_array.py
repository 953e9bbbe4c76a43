"""The ``out=`` of the gradient ops: an array to write the tensor-sized gradient into.

It may be the upstream gradient's own buffer (``gradients``, ``y_backprop``): the kernels read each value
before they write the result at the same place, so the gradient is overwritten by its backprop and no
second tensor-sized array is allocated (the CLI does this with the arrays it read itself).  Any other
``out`` must share no memory with the operands.
"""
import numpy as np

from qgcli.errors import OperandError


def check_out(out, xp, *, shape, dtype, reused, reused_name, others, operand="out"):
    """``out`` checked (None stays None): writeable, C order, ``shape`` and ``dtype``, on the device of ``xp``;
    either ``reused`` itself (same first byte, both C order) or sharing no memory with it nor with ``others``
    (``reused`` None: no array may take the result in place).  Errors name ``operand``."""
    if out is None:
        return None
    shape, dtype = list(shape), np.dtype(dtype)
    if (not isinstance(out, xp.ndarray) or out.dtype != dtype or list(out.shape) != shape
            or not out.flags.c_contiguous or not getattr(out.flags, "writeable", True)):  # CuPy has no such flag
        raise _error(f"must be a writeable C-contiguous {dtype} {xp.__name__} array of shape {shape}", operand)
    if any(other is not None and xp.may_share_memory(out, other) for other in others):
        only = f"only {reused_name} itself can take the result" if reused is not None else "it must be apart"
        raise _error(f"shares memory with an input or another output; {only}", operand)
    if (reused is not None and xp.may_share_memory(out, reused)
            and not (reused.flags.c_contiguous and address(out) == address(reused))):
        raise _error(f"overlaps {reused_name} without being the same array", operand)
    return out


def deliver(result, out):
    """``result`` as the op returns it: ``out`` itself when given (copied in unless the kernels wrote there)."""
    if out is None:
        return result
    if address(result) != address(out):
        out[...] = result
    return out


def can_take(a, *others):
    """Whether an op may write its result into NumPy array ``a`` (writeable, C order, apart from ``others``)."""
    return (isinstance(a, np.ndarray) and a.flags.writeable and a.flags.c_contiguous
            and not any(np.may_share_memory(a, other) for other in others))


def address(a):
    face = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    return face["data"][0]


def _error(message, operand):
    return OperandError(message, operand=operand)
