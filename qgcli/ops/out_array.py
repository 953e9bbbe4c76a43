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
    if not _fits(out, xp, shape, dtype):
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


def _fits(a, xp, shape, dtype):
    """Whether ``a`` can take a result of ``shape`` and ``dtype``: an array of ``xp``, writeable, C order."""
    return (isinstance(a, xp.ndarray) and a.dtype == np.dtype(dtype) and list(a.shape) == list(shape)
            and a.flags.c_contiguous and getattr(a.flags, "writeable", True))  # CuPy has no such flag


def _error(message, operand):
    return OperandError(message, operand=operand)


def check_outs(out, xp, expected, inputs):
    """``out=`` of an op with several results (the block formats'): None, the op's earlier result (its arrays
    are written over) or a sequence with one entry per result, each an array or None (a new one).  ``expected``:
    ``{name: (shape, dtype)}`` in the result's order; a named tuple's entries go by name (others, such as
    NVFP4's ``tensor_scale``, are left alone).  Each array is checked as :func:`check_out` checks one and may
    share no memory with ``inputs`` nor with another.  Returns ``{name: array or None}``."""
    if out is None:
        return dict.fromkeys(expected)
    if not isinstance(out, (tuple, list)):
        raise _error(f"must be the op's earlier result or a sequence of {len(expected)} arrays "
                     f"({', '.join(expected)}), not {type(out).__name__}", "out")
    if hasattr(out, "_fields"):
        given = {k: v for k, v in zip(out._fields, out) if k in expected}
    elif len(out) != len(expected):
        raise _error(f"holds {len(out)} entries; give {len(expected)} ({', '.join(expected)}), None for a new array", "out")
    else:
        given = dict(zip(expected, out))
    checked, seen = dict.fromkeys(expected), []
    for name, a in given.items():
        if a is None:
            continue
        shape, dtype = expected[name]
        if not _fits(a, xp, shape, dtype):
            raise _error(f"{name} must be a writeable C-contiguous {np.dtype(dtype)} {xp.__name__} array of shape "
                         f"{list(shape)}", "out")
        if any(xp.may_share_memory(a, other) for other in list(inputs) + seen):
            raise _error(f"{name} shares memory with an input or another output", "out")
        seen.append(a)
        checked[name] = a
    return checked


def as_bytes(a):
    """A 1-byte-element array (uint8, int8, ml_dtypes' float8/float4) as uint8, the same memory (None stays
    None): what the compiled kernels write codes into."""
    return None if a is None else a.view(np.uint8)
