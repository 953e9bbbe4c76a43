"""FusedBatchNormGrad over blocks, written once for every block source: the per-channel sums, then
``x_backprop``.

Training takes two passes: pass 1 adds the per-channel float64 sums ``sum(dy)`` and ``sum(dy * (x - mean))``
block by block, pass 2 writes ``x_backprop`` from the coefficients (element-wise once they are known, so any
blocks do).  Inference can take one: its ``x_backprop`` does not depend on the sums.  The functions are the
in-memory op's (:mod:`qgcli.ops.batch_norm`).  Blocks computed independently (Zarr tasks) sum the units of
:func:`qgcli.ops.batch_norm.sum_units` that start in them, so their sums are the in-memory ones bit for bit.
"""
import numpy as np

from qgcli.families.batch_norm import dtype_of as family_dtype
from qgcli.ops import batch_norm as bn


def dtype_of(ds):
    """The dtype of an unread HDF5 dataset or Zarr array, bfloat16 where qgcli's tag says so."""
    return family_dtype(ds)


def checked(y_backprop, x, small_in, *, epsilon, data_format, variance_kind):
    """:class:`qgcli.ops.batch_norm.BlockOperands` of unread ``x`` and ``y_backprop`` and the per-channel
    operands ``small_in`` (read), checked as the in-memory op checks them."""
    return bn.block_operands(y_backprop, x, small_in["scale"], small_in["reserve_space_1"],
                             small_in["reserve_space_2"], epsilon=epsilon, data_format=data_format,
                             variance_kind=variance_kind, dtypes={"x": dtype_of(x), "y_backprop": dtype_of(y_backprop)})


def output_dtype(x):
    """``x_backprop``'s dtype: x's own (bfloat16 where tagged), float32 for float64 x."""
    dtype = dtype_of(x)
    return np.dtype(np.float32) if dtype.itemsize > 4 else dtype


def as_acb(channels_first, *blocks):
    """Each block viewed as [A, C, B] (:func:`qgcli.ops.batch_norm.acb_shape`)."""
    return [b.reshape(bn.acb_shape(b.shape, channels_first)) for b in blocks]


def sums(dy3, x3, mean):
    """``[2, channels]`` float64: ``sum(dy)`` and ``sum(dy * (x - mean))`` of one block or unit ([A, C, B])."""
    with np.errstate(all="ignore"):
        return np.stack(bn.channel_sums(dy3, x3, mean, dy3.shape, np))


def add(total, part):
    """``total += part``, in the order the blocks (or units) come: as the in-memory op adds its partials."""
    with np.errstate(all="ignore"):  # inf - inf is NaN here as in TF, not a warning
        total += part


def coefficients(total, n, operands, *, is_training, variance_kind):
    """The coefficients of ``x_backprop`` from the whole tensor's sums ``total`` over ``n`` values per channel."""
    return bn.gradient_coefficients(total[0], total[1], n, operands.scale, operands.mean, operands.var,
                                    operands.epsilon, is_training, variance_kind)


def values_per_channel(shape, channels_first):
    acb = bn.acb_shape(shape, channels_first)
    return acb[0] * acb[2]


def x_backprop(dy, x, dx, coefs, channels_first):
    """Write one block's ``x_backprop`` into ``dx`` (which may be ``dy``: each part of dy is read first)."""
    acb = bn.acb_shape(dy.shape, channels_first)
    with np.errstate(all="ignore"):
        bn.x_backprop_blocks(dy.reshape(acb), x.reshape(acb), dx.reshape(acb), acb, coefs, np)


def small_outputs(coefs, n, channels):
    """``scale_backprop`` and ``offset_backprop`` (zeros for an empty tensor)."""
    if n == 0 or channels == 0:
        zeros = np.zeros(channels, np.float32)
        return {"scale_backprop": zeros, "offset_backprop": zeros.copy()}
    return {"scale_backprop": np.asarray(coefs.scale_backprop), "offset_backprop": np.asarray(coefs.offset_backprop)}
