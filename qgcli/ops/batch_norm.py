"""TensorFlow's ``FusedBatchNormGrad`` / ``V2`` / ``V3``: batch-norm gradients from saved tensors.

Semantics follow TF 2.21 (tf_semantics.md §2).  With ``n`` values per channel, ``inv = 1/sqrt(var + eps)``
and ``xc = x - reserve_space_1``::

    is_training=True  (batch statistics: reserve_space_1 = mean, reserve_space_2 = biased variance)
        x_backprop      = scale * inv * (dy - mean(dy) - xc * inv**2 * mean(dy * xc))
    is_training=False (population statistics; mean and variance are constants)
        x_backprop      = dy * scale * inv
    both
        scale_backprop  = inv * sum(dy * xc)
        offset_backprop = sum(dy)

sums and means running over every axis but the channel axis.

**Numerics.**  TF's default CPU path (oneDNN) cannot be reproduced bit for bit by a formula (§2.4), so the
target is accuracy: within float32 rounding of TensorFlow and never farther than TensorFlow from the exact
(float64) result.  TF accumulates the per-channel sums in float32, which loses digits as the tensor grows
(relative 1e-5 at 50,000 values per channel); here they are accumulated in float64.  The per-channel
coefficients and ``x_backprop`` itself are evaluated in float64 too, in the order of TF's Eigen kernel,
and rounded to float32 once, so every output is the float32 nearest the exact value for all but
pathological data.  Measured against TF 2.21 (oneDNN): no element of ``x_backprop`` is farther from the
float64 result than TF's, at about 1.3x the time of a float32 evaluation (docs/batch-norm.md, "Accuracy").
``x`` and ``y_backprop`` of dtype float16/bfloat16 are widened first; ``x_backprop`` is rounded to the
input dtype once (TF rounds its float32 result, a second rounding that can fall on the wrong side of a tie).

The work is done in blocks of rows so that float64 temporaries stay in cache; a block is the whole tensor
on CuPy, where kernel launches, not cache, set the cost.

Deliberate differences from TF: subnormal inputs are used as they are (TF's CPU threads flush them to zero,
a change far below the tolerance above); NCHW/NCDHW work with ``is_training=False`` (TF's CPU kernel
refuses them; TF's registered gradient transposes to channels-last around the op, which gives the same
values); negative epsilon, negative variance
and non-float operands are refused (TF silently returns NaN or refuses at graph construction).
"""
import math
from dataclasses import dataclass, field

import numpy as np

from qgcli.backend import array_module, to_numpy
from qgcli.errors import OperandError, QgcliError
from qgcli.ops import native
from qgcli.ops.out_array import check_out, deliver

_F32 = np.float32
_F64 = np.float64

#: data_format -> (rank TF's shape functions ask for, channels_first)
DATA_FORMATS = {"NHWC": (4, False), "NCHW": (4, True), "NDHWC": (5, False), "NCDHW": (5, True)}

#: What reserve_space_2 can hold, as the op reads it.
VARIANCE_KINDS = ("variance", "inv-std")

# Elements per block on NumPy: a few float64 temporaries of this size stay in L2.
_BLOCK = 1 << 16


@dataclass(frozen=True)
class BatchNormGradVersion:
    """One of TF's three gradient ops: its name, allowed dtypes/layouts and placeholder outputs."""

    name: str
    op: str
    x_dtypes: tuple
    data_formats: tuple
    takes_reserve_space_3: bool
    placeholders: tuple


VERSIONS = {
    "v1": BatchNormGradVersion("v1", "FusedBatchNormGrad", ("float32",), ("NHWC", "NCHW"), False,
                               ("reserve_space_3", "reserve_space_4")),
    "v2": BatchNormGradVersion("v2", "FusedBatchNormGradV2", ("float32", "float16", "bfloat16"), ("NHWC", "NCHW"),
                               False, ("reserve_space_3", "reserve_space_4")),
    "v3": BatchNormGradVersion("v3", "FusedBatchNormGradV3", ("float32", "float16", "bfloat16"),
                               tuple(DATA_FORMATS), True, ("reserve_space_4", "reserve_space_5")),
}


def batch_norm_grad_version(version="v3", *, x_dtype=None, data_format=None, reserve_space_3=False,
                            y_backprop_dtype=None):
    """The :class:`BatchNormGradVersion` for ``version`` ("v1", "v2", "v3"), checked against the operands.

    Applies TF's registration rules: V1 takes float32 only, V2/V3 also float16 and bfloat16; only V3
    takes 5-D layouts and a ``reserve_space_3`` input.

    >>> batch_norm_grad_version("v2", x_dtype="float16").op
    'FusedBatchNormGradV2'
    """
    key = str(version).lower()
    if key not in VERSIONS:
        raise QgcliError(f"unknown version {version!r}; use v1, v2 or v3", operand="version")
    spec = VERSIONS[key]
    for operand, dtype in (("x", x_dtype), ("y_backprop", y_backprop_dtype)):
        if dtype is not None and str(dtype) not in spec.x_dtypes and str(dtype) in VERSIONS["v3"].x_dtypes:
            raise OperandError(
                f"dtype {dtype} needs FusedBatchNormGradV2 or V3; {spec.op} takes {', '.join(spec.x_dtypes)} only",
                operand=operand,
            )
    if data_format is not None and data_format in DATA_FORMATS and data_format not in spec.data_formats:
        raise QgcliError(f"{data_format} needs FusedBatchNormGradV3; {spec.op} takes NHWC or NCHW",
                         operand="data_format")
    if reserve_space_3 and not spec.takes_reserve_space_3:
        raise OperandError(f"only FusedBatchNormGradV3 has this input, not {spec.op}", operand="reserve_space_3")
    return spec


def placeholder_outputs(version="v3", xp=np):
    """TF's unused extra outputs of the gradient op, shaped as its Eigen CPU kernel returns them: ``[0]`` float32.

    V1/V2 name them ``reserve_space_3``/``reserve_space_4``, V3 ``reserve_space_4``/``reserve_space_5``
    (oneDNN returns 0-d zeros instead; graph shape inference declares ``[0]``).

    >>> sorted(placeholder_outputs("v3"))
    ['reserve_space_4', 'reserve_space_5']
    """
    spec = batch_norm_grad_version(version)
    return {name: xp.zeros((0,), _F32) for name in spec.placeholders}


# --- validation -------------------------------------------------------------------------------------

def _check_format(data_format):
    if data_format not in DATA_FORMATS:
        raise QgcliError(f"unknown data format {data_format!r}; use NHWC, NCHW, NDHWC or NCDHW",
                         operand="data_format")
    return DATA_FORMATS[data_format]


def _check_epsilon(epsilon):
    try:
        eps = float(epsilon)
    except (TypeError, ValueError):
        raise QgcliError(f"must be a number, got {epsilon!r}", operand="epsilon") from None
    if not np.isfinite(eps) or eps < 0 or eps > float(np.finfo(_F32).max):
        raise QgcliError(f"must be a finite number >= 0, got {eps!r}", operand="epsilon")
    # TF's attribute is a 32-bit float (1e-4 is stored as 9.999999747378752e-05).
    return float(_F32(eps))


def _is_float(dtype):
    return dtype.kind == "f" or dtype.name == "bfloat16"


def data_operand(a, name, xp):
    a = xp.asarray(a)
    if not _is_float(a.dtype):
        raise OperandError(f"dtype {a.dtype} is not a floating type (TF takes float32, float16 or bfloat16)",
                           operand=name)
    if a.dtype.itemsize > 4:  # TF has no float64 kernel: round to float32 first, as a cast would (and as said)
        a = a.astype(_F32)
    return a


def _check_rank(x, data_format, rank):
    # As TF's Eigen kernel: any 4-D or 5-D tensor, channels first or last as the format letters say
    # (so a 5-D tensor with "NHWC" works, as in TF's eager V1/V2 without oneDNN).
    if x.ndim not in (4, 5):
        raise OperandError(
            f"must be 4- or 5-dimensional ({data_format}), got rank {x.ndim} (shape {list(x.shape)})", operand="x"
        )


def _channel_operand(a, name, channels, data_format):
    """A per-channel float32 host vector: 1-D of length ``channels`` (a 0-d value is broadcast)."""
    # Python numbers and lists are values; an array (from a file) must carry a floating dtype.
    arr = np.asarray(to_numpy(a)) if hasattr(a, "dtype") else np.asarray(a, dtype=_F64)
    if not _is_float(arr.dtype):
        raise OperandError(f"dtype {arr.dtype} is not a floating type (TF takes float32)", operand=name)
    if arr.ndim == 0:
        arr = np.full(channels, arr, dtype=arr.dtype)
    if arr.ndim != 1:
        raise OperandError(f"must be 1-dimensional, got shape {list(arr.shape)}", operand=name)
    if arr.shape[0] != channels:
        raise OperandError(
            f"has {arr.shape[0]} entries but x has {channels} channels ({data_format})", operand=name
        )
    # TF's U type is float32: statistics saved in float64 are rounded first, as TF would.
    return arr.astype(_F32)


def _check_variance(var, variance_kind):
    if variance_kind == "variance":
        bad = var < 0
        what = "negative variance"
    else:
        bad = ~(var > 0) & ~np.isnan(var)
        what = "an inverse standard deviation must be > 0, got"
    if bad.any():
        c = int(np.argmax(bad))
        raise OperandError(f"{what} {float(var[c])!r} at channel {c}", operand="reserve_space_2")


# --- over first-axis blocks of tensors left on disk ----------------------------------------------------

@dataclass(frozen=True)
class BlockOperands:
    """FusedBatchNormGrad's checked operands when ``x`` and ``y_backprop`` stay on disk and are read in blocks
    of their first axis (:mod:`qgcli.execution.blocks`): what every block needs besides its rows."""

    channels_first: bool
    epsilon: float
    channels: int
    scale: np.ndarray
    mean: np.ndarray
    var: np.ndarray


def block_operands(y_backprop, x, scale, reserve_space_1, reserve_space_2, *, epsilon, data_format,
                   variance_kind, dtypes):
    """The checks of :func:`fused_batch_norm_grad`, in its order, with ``x`` and ``y_backprop`` unread
    (anything with ``shape``, ``ndim`` and ``dtype``); ``dtypes``: their dtypes by name, bfloat16 where the
    file says so."""
    rank, channels_first = _check_format(data_format)
    eps = _check_epsilon(epsilon)
    for name in ("x", "y_backprop"):
        if not _is_float(dtypes[name]):
            raise OperandError(f"dtype {dtypes[name]} is not a floating type (TF takes float32, float16 or "
                               "bfloat16)", operand=name)
    _check_rank(x, data_format, rank)
    if tuple(y_backprop.shape) != tuple(x.shape):
        raise OperandError(f"shape {list(y_backprop.shape)} differs from x shape {list(x.shape)}",
                           operand="y_backprop")
    channels = x.shape[1] if channels_first else x.shape[-1]
    scale = _channel_operand(scale, "scale", channels, data_format)
    mean = _channel_operand(reserve_space_1, "reserve_space_1", channels, data_format)
    var = _channel_operand(reserve_space_2, "reserve_space_2", channels, data_format)
    _check_variance(var, variance_kind)
    return BlockOperands(channels_first, eps, channels, scale, mean, var)


def sum_units(acb, dtype):
    """The units :func:`channel_sums` cuts [A, C, B] into on the host, in the order their partial sums are
    added: ``((a0, a1), (b0, b1) or None)``.  Summing each unit with :func:`channel_sums` and adding the
    partials in this order gives the whole tensor's sums bit for bit, however the units are shared out."""
    if native.for_arrays(np, np.empty((1,), dtype)) is not None:  # the compiled kernels run on float32 data
        return [((s.start, s.stop), None) for s in _native_chunks(acb)]
    out = []
    for a, b in _blocks(acb, np):
        out.append(((a.start, min(a.stop, acb[0])), None if b == slice(None) else (b.start, min(b.stop, acb[2]))))
    return out


# --- blocked [A, C, B] views ---------------------------------------------------------------------------

def acb_shape(shape, channels_first):
    """``x`` viewed as [A, C, B]: channels-last is [rest, C, 1], channels-first [N, C, spatial]."""
    # math.prod, not np.prod: the same product of Python ints, without NumPy's ~8 us per call (a small call's)
    if channels_first:
        return (shape[0], shape[1], int(math.prod(shape[2:])))
    return (int(math.prod(shape[:-1])), shape[-1], 1)


def _blocks(acb, xp):
    """Slices (a, b) covering [A, C, B] in blocks of about ``_BLOCK`` elements (one block on CuPy)."""
    a_len, c_len, b_len = acb
    if xp is not np:
        yield slice(None), slice(None)
        return
    row = max(c_len * b_len, 1)
    if row <= _BLOCK:
        step = max(_BLOCK // row, 1)
        for a in range(0, a_len, step):
            yield slice(a, a + step), slice(None)
    else:
        step = max(_BLOCK // max(c_len, 1), 1)
        for a in range(a_len):
            for b in range(0, b_len, step):
                yield slice(a, a + 1), slice(b, b + step)


def _native_chunks(acb):
    """Slices of A (about 2**20 values each) for the compiled kernels, run on the thread pool."""
    step = max(1, (1 << 20) // max(1, acb[1] * acb[2]))
    return [slice(a, min(a + step, acb[0])) for a in range(0, acb[0], step)]


def channel_sums(dy3, x3, mean, acb, xp):
    """Per-channel ``sum(dy)`` and ``sum(dy * (x - mean))``, accumulated in float64."""
    lib = native.for_arrays(xp, dy3, x3)
    if lib is not None:
        from qgcli.ops.blocked import _map
        address = native.address

        mean64 = np.ascontiguousarray(mean, _F64)
        row = 4 * acb[1] * acb[2]

        def run(a):
            sums = np.zeros((2, acb[1]), _F64)
            lib.qg_bn_sums(address(dy3, _F32) + a.start * row, address(x3, _F32) + a.start * row, a.stop - a.start,
                           acb[1], acb[2], address(mean64, _F64), address(sums, _F64))
            return sums

        parts = _map(run, _native_chunks(acb))
        total = parts[0]  # as 0.0 + parts[0]: a sum started at +0.0 is never -0.0
        for part in parts[1:]:  # added in chunk order: the same bits on any thread count
            total += part
        return total[0], total[1]
    sum_dy = xp.zeros(acb[1], _F64)
    sum_dyxc = xp.zeros(acb[1], _F64)
    mean64 = xp.asarray(mean[:, None], _F64)
    buf = None
    for a, b in _blocks(acb, xp):
        dy = dy3[a, :, b]
        if buf is None or buf.shape != dy.shape:
            buf = xp.empty(dy.shape, _F64)
        xp.subtract(x3[a, :, b], mean64, out=buf)
        buf *= dy
        sum_dy += dy.sum(axis=(0, 2), dtype=_F64)
        sum_dyxc += buf.sum(axis=(0, 2))
    return sum_dy, sum_dyxc


def _round_once(g, dtype, xp):
    """float64 -> float16/bfloat16, rounded once to nearest-even (no double-rounding error).

    Rounding to float32 first and then to ``dtype`` (as TF rounds its float32 result) can land on the
    wrong side of a tie; rounding to float32 *to odd* first cannot, as float32 has more than
    ``p + 2`` bits for either target.
    """
    return _round_to_odd(g, xp).astype(dtype)


def _round_to_odd(g, xp):
    """float64 -> float32, rounded to odd (truncated, the last bit set when inexact)."""
    r = g.astype(_F32)
    r64 = r.astype(_F64)
    inexact = r64 != g
    bits = r.view(xp.uint32)
    # Sign-magnitude bits: one less is one step toward zero, where RNE went away from it.
    bits = xp.where(inexact & (xp.abs(r64) > xp.abs(g)), bits - xp.uint32(1), bits)
    bits = xp.where(inexact, bits | xp.uint32(1), bits)
    return bits.view(_F32)


# --- the op ---------------------------------------------------------------------------------------------

def fused_batch_norm_grad_to_odd(y_backprop, x, scale, reserve_space_1, reserve_space_2, **attributes):
    """:func:`fused_batch_norm_grad` of float32 data widened from float16/bfloat16, with ``x_backprop``
    rounded to odd: narrowed back to the data's type it is then rounded once, as the direct computation
    (used on the GPU, where CuPy has no bfloat16)."""
    return fused_batch_norm_grad(y_backprop, x, scale, reserve_space_1, reserve_space_2, _to_odd=True, **attributes)


def fused_batch_norm_grad(y_backprop, x, scale, reserve_space_1, reserve_space_2, reserve_space_3=None, *,
                          epsilon=1e-4, data_format="NHWC", is_training=True, variance_kind="variance",
                          out=None, _to_odd=False):
    """TensorFlow's ``FusedBatchNormGrad{,V2,V3}``: gradients of batch normalisation.

    Parameters
    ----------
    y_backprop, x : array
        Upstream gradient and forward input, same shape, rank 4 (NHWC/NCHW) or 5 (NDHWC/NCDHW);
        float32, float16 or bfloat16 (float64 is computed as float32).
    scale : array
        ``gamma``, one value per channel.
    reserve_space_1, reserve_space_2 : array
        ``is_training=True``: the batch mean and the *biased* batch variance (TF's CPU forward), or, with
        ``variance_kind="inv-std"``, ``1/sqrt(var + epsilon)`` as cuDNN saves it.  ``is_training=False``:
        the population mean and variance.  One value per channel (a 0-d value is broadcast).
    reserve_space_3 : array, optional
        V3's extra input; ignored, as on TF's CPU.
    epsilon : float
        Added to the variance (a float32 attribute in TF); must be >= 0.
    data_format : {"NHWC", "NCHW", "NDHWC", "NCDHW"}
    is_training : bool
    variance_kind : {"variance", "inv-std"}
        What ``reserve_space_2`` holds (see :func:`detect_variance_convention` to find out).
    out : array, optional
        Where to write ``x_backprop`` (returned): a writeable C-contiguous array of its shape and dtype on the
        same device.  It may be ``y_backprop`` itself, which is then overwritten (no second tensor-sized
        array); otherwise it must share no memory with the operands.

    Returns
    -------
    x_backprop : array
        Shape and dtype of ``x`` (float32 for float64 ``x``).
    scale_backprop, offset_backprop : array
        float32, one value per channel.

    Examples
    --------
    TF's own unit test (``fused_batch_norm_op_test.cc``, ``FusedBatchNormGradOpTest.Simple``):

    >>> dy = np.array([2, 2, 9, 9, -4, -4, 5, 5, 8, 8, 7, 7], np.float32).reshape(1, 1, 6, 2)
    >>> x = np.array([1, 1, 7, 7, 4, 4, -3, -3, -11, -11, 13, 13], np.float32).reshape(1, 1, 6, 2)
    >>> dx, dscale, doffset = fused_batch_norm_grad(dy, x, [4, 4], [1.833, 1.833], [57.472, 57.472],
    ...                                             epsilon=0.001)
    >>> print(dx[0, 0, :, 0].round(2), dscale.round(4), doffset)
    [-1.33  2.47 -4.44  0.17  1.6   1.53] [-1.6477 -1.6477] [27. 27.]
    """
    if not _to_odd:
        small = _small_call(y_backprop, x, scale, reserve_space_1, reserve_space_2, epsilon, data_format,
                            is_training, variance_kind, out)
        if small is not None:
            return small
    rank, channels_first = _check_format(data_format)
    eps = _check_epsilon(epsilon)
    if variance_kind not in VARIANCE_KINDS:
        raise QgcliError(f"unknown kind {variance_kind!r}; use variance or inv-std", operand="variance_kind")
    xp = array_module(y_backprop, x)
    # C order first: the float64 channel sums (and so the last bit of x_backprop) must not depend on the
    # memory layout of the same values (a Fortran-order .npy, a strided view).
    x = xp.ascontiguousarray(data_operand(x, "x", xp))
    dy = xp.ascontiguousarray(data_operand(y_backprop, "y_backprop", xp))
    _check_rank(x, data_format, rank)
    if dy.shape != x.shape:
        raise OperandError(f"shape {list(dy.shape)} differs from x shape {list(x.shape)}", operand="y_backprop")
    channels = x.shape[1] if channels_first else x.shape[-1]
    scale = _channel_operand(scale, "scale", channels, data_format)
    mean = _channel_operand(reserve_space_1, "reserve_space_1", channels, data_format)
    var = _channel_operand(reserve_space_2, "reserve_space_2", channels, data_format)
    _check_variance(var, variance_kind)
    out_dtype = x.dtype if x.dtype.itemsize <= 4 else np.dtype(_F32)
    out = check_out(out, xp, shape=x.shape, dtype=out_dtype, reused=dy, reused_name="y_backprop",
                    others=(x,))

    acb = acb_shape(x.shape, channels_first)
    n = acb[0] * acb[2]
    if n == 0 or channels == 0:  # TF: empty x_backprop, zero sums (both modes)
        zeros = xp.zeros(channels, _F32)
        return deliver(xp.zeros(x.shape, out_dtype), out), zeros, zeros.copy()

    x3, dy3 = x.reshape(acb), dy.reshape(acb)
    with np.errstate(all="ignore"):  # inf/NaN data propagate, as in TF
        sum_dy, sum_dyxc = (to_numpy(s) for s in channel_sums(dy3, x3, mean, acb, xp))
    coefs = gradient_coefficients(sum_dy, sum_dyxc, n, scale, mean, var, eps, is_training, variance_kind)
    dx = xp.empty(x.shape, out_dtype) if out is None else out
    x_backprop_blocks(dy3, x3, dx.reshape(acb), acb, coefs, xp, to_odd=_to_odd)  # dx may be dy: see there
    return dx, xp.asarray(coefs.scale_backprop), xp.asarray(coefs.offset_backprop)


# --- the small call: one compiled call, its checks paid once per shape and attributes ----------------------

_SMALL_PLANS = {}  # (shape, data_format, epsilon, variance_kind) -> (acb, eps, inv_std) for a one-chunk tensor
_SMALL_PLANS_MAX = 256


def _small_plan(shape, data_format, epsilon, variance_kind):
    """What a one-chunk call of this shape and these attributes needs, or None (the general path then runs,
    and raises where an attribute is bad)."""
    try:
        key = (shape, data_format, epsilon, variance_kind)
        plan = _SMALL_PLANS.get(key)
    except TypeError:  # an unhashable attribute
        return None
    if plan is not None or key in _SMALL_PLANS:
        return plan
    try:
        rank, channels_first = _check_format(data_format)
        eps = _check_epsilon(epsilon)
    except QgcliError:
        return None
    acb = acb_shape(shape, channels_first)
    ok = (variance_kind in VARIANCE_KINDS and len(shape) in (4, 5) and acb[0] * acb[2] > 0 and acb[1] > 0
          and len(_native_chunks(acb)) == 1)
    plan = (acb, eps, variance_kind == "inv-std") if ok else None
    if len(_SMALL_PLANS) >= _SMALL_PLANS_MAX:
        _SMALL_PLANS.clear()
    _SMALL_PLANS[key] = plan
    return plan


def _small_call(y_backprop, x, scale, mean, var, epsilon, data_format, is_training, variance_kind, out):
    """:func:`fused_batch_norm_grad` of a float32 NumPy tensor of one chunk (at most about 2**20 values) with
    float32 per-channel vectors, as one compiled call (``qg_bn_grad``: the sums, the coefficients and
    ``x_backprop`` in the general path's float64 operations and order, so the same bits), or None: anything
    else, or anything to refuse, goes the general way, which names the operand."""
    if (type(x) is not np.ndarray or type(y_backprop) is not np.ndarray or x.dtype != _F32
            or y_backprop.dtype != _F32 or x.shape != y_backprop.shape or not x.flags.c_contiguous
            or not y_backprop.flags.c_contiguous):
        return None
    plan = _small_plan(x.shape, data_format, epsilon, variance_kind)
    lib = native.library() if plan is not None else None
    if lib is None:
        return None
    acb, eps, inv_std = plan
    channels = acb[1]
    for v in (scale, mean, var):
        if (type(v) is not np.ndarray or v.dtype != _F32 or v.shape != (channels,)
                or not v.flags.c_contiguous):
            return None
    if out is None:
        dx = np.empty(x.shape, _F32)
    else:
        try:
            dx = check_out(out, np, shape=x.shape, dtype=_F32, reused=y_backprop, reused_name="y_backprop",
                           others=(x,))
        except QgcliError:  # refused by the general path, after the checks it makes first
            return None
    scale_bp, offset_bp = np.empty(channels, _F32), np.empty(channels, _F32)
    p_dy, p_x, p_dx, p_scale, p_mean, p_var, p_sbp, p_obp = native.addresses(
        y_backprop, x, dx, scale, mean, var, scale_bp, offset_bp)  # all checked above: C order, float32
    # No np.errstate: NumPy's error state is not looked at by the C code (inf/NaN propagate, as in TF).
    status = lib.qg_bn_grad(p_dy, p_x, p_dx, acb[0], channels, acb[2], p_scale, p_mean, p_var, eps,
                            1 if is_training else 0, inv_std, p_sbp, p_obp)
    if status < 0:
        raise MemoryError("no memory for the batch-norm gradient's per-channel scratch")
    return None if status else (dx, scale_bp, offset_bp)


@dataclass(frozen=True)
class Coefficients:
    """Per-channel float64 host vectors that turn the channel sums into ``x_backprop``."""

    is_training: bool
    coef1: np.ndarray
    coef2: np.ndarray = None
    dy_mean: np.ndarray = None
    mean: np.ndarray = None
    scale_backprop: np.ndarray = None
    offset_backprop: np.ndarray = None


def gradient_coefficients(sum_dy, sum_dyxc, n, scale, mean, var, eps, is_training, variance_kind="variance"):
    """Coefficients from the per-channel float64 sums ``sum(dy)`` and ``sum(dy * (x - mean))`` over n values."""
    with np.errstate(all="ignore"):  # eps = 0 with a constant channel gives inf/NaN, as in TF
        # Per-channel coefficients in float64 on the host (C values), rounded to float32 once.
        inv = 1.0 / np.sqrt(var.astype(_F64) + eps) if variance_kind == "variance" else var.astype(_F64)
        coef1 = scale.astype(_F64) * inv
        common = dict(is_training=is_training, coef1=coef1, scale_backprop=(sum_dyxc * inv).astype(_F32),
                      offset_backprop=sum_dy.astype(_F32))
        if not is_training:
            return Coefficients(**common)
        return Coefficients(coef2=inv * inv * (sum_dyxc / n), dy_mean=sum_dy / n, mean=mean.astype(_F64), **common)


def x_backprop_blocks(dy3, x3, dx3, acb, coefs, xp, *, to_odd=False):
    """Write ``x_backprop`` into ``dx3`` block by block ([A, C, B] views; dx3's dtype is the output dtype).
    ``dx3`` may be ``dy3`` itself: each block of ``dy3`` is read before that block of ``dx3`` is written.

    ``to_odd``: float32 ``dx3`` rounded to odd, for a caller that narrows it to float16/bfloat16 later
    (CuPy has no bfloat16) and must still round only once."""
    out_dtype = dx3.dtype
    lib = None if to_odd else native.for_arrays(xp, dy3, x3, dx3)
    if lib is not None:
        from qgcli.ops.blocked import _map
        address = native.address

        table = np.zeros((4, acb[1]), _F64)
        for row, v in zip(table, (coefs.coef1, coefs.coef2, coefs.dy_mean, coefs.mean)):
            if v is not None:
                row[...] = v
        row = 4 * acb[1] * acb[2]

        def run(a):
            offset = a.start * row
            lib.qg_bn_dx(address(dy3, _F32) + offset, address(x3, _F32) + offset, address(dx3, _F32) + offset,
                         a.stop - a.start, acb[1], acb[2], address(table, _F64), int(coefs.is_training))

        _map(run, _native_chunks(acb))
        return
    col = (slice(None), None)
    c1 = xp.asarray(coefs.coef1[col])
    if coefs.is_training:
        c2, dym, m64 = (xp.asarray(v[col]) for v in (coefs.coef2, coefs.dy_mean, coefs.mean))
    g = xc = None
    with np.errstate(all="ignore"):
        for a, b in _blocks(acb, xp):
            dyb = dy3[a, :, b]
            if g is None or g.shape != dyb.shape:
                g, xc = xp.empty(dyb.shape, _F64), xp.empty(dyb.shape, _F64)
            if coefs.is_training:
                # TF's order, coef1 * ((dy - mean(dy)) - (x - mean) * coef2), in float64: each x_backprop
                # is then rounded once, to the float32 nearest the exact value for all but pathological data.
                xp.subtract(x3[a, :, b], m64, out=xc)
                xc *= c2
                xp.subtract(dyb, dym, out=g)
                g -= xc
                g *= c1
            else:
                xp.multiply(dyb, c1, out=g)
            if to_odd:
                dx3[a, :, b] = _round_to_odd(g, xp)
            else:
                dx3[a, :, b] = g if out_dtype == _F32 else _round_once(g, out_dtype, xp)


def channel_norms(a, data_format="NHWC"):
    """The L2 norm of each channel of ``a`` (float64 host vector), e.g. of ``x_backprop`` for a summary.

    >>> channel_norms(np.full((1, 2, 2, 3), 0.5, np.float32)).tolist()
    [1.0, 1.0, 1.0]
    """
    rank, channels_first = _check_format(data_format)
    xp = array_module(a)
    a = xp.asarray(a)
    acb = acb_shape(a.shape, channels_first)
    a3 = a.reshape(acb)
    if native.for_arrays(xp, a3) is not None:  # sum(a * (a - 0)) on the compiled kernels and both cores
        return np.sqrt(channel_sums(a3, a3, np.zeros(acb[1]), acb, xp)[1])
    total = xp.zeros(acb[1], _F64)
    for i, j in _blocks(acb, xp):
        blk = a3[i, :, j].astype(_F64)
        blk *= blk
        total += blk.sum(axis=(0, 2))
    return np.sqrt(to_numpy(total))


# --- which convention reserve_space_2 follows ----------------------------------------------------------

#: The conventions :func:`detect_variance_convention` tells apart: kind -> (op's variance_kind, wording).
CONVENTIONS = {
    "biased-variance": ("variance", "the biased batch variance (TensorFlow's CPU convention)"),
    "unbiased-variance": ("variance", "the unbiased (Bessel-corrected, n/(n-1)) batch variance, i.e. the "
                                      "forward's batch_variance output rather than its reserve_space_2"),
    "inv-std": ("inv-std", "1/sqrt(variance + epsilon) (cuDNN's saved inverse standard deviation)"),
    "inv-variance": ("inv-std", "1/(variance + epsilon) (an inverse variance)"),
}

# Saved statistics come from float32 forwards (sums over up to millions of values, sometimes E[x^2] - mean^2),
# so a match allows 0.1% of the variance plus 1e-5 of the second moment; any real mix-up is far larger.
_RTOL = 1e-3
_MOMENT_TOL = 1e-5


@dataclass(frozen=True)
class VarianceConvention:
    """What ``reserve_space_2`` holds, found by recomputing the batch statistics from ``x``.

    ``kind`` is a key of :data:`CONVENTIONS`; ``variance_kind`` and ``reserve_space_2`` (float32, converted
    where needed: an unbiased variance is rescaled to the biased one, an inverse variance to an inverse
    std) are what to pass to :func:`fused_batch_norm_grad`.  ``mismatch`` gives, per candidate, the worst
    channel's distance in units of the tolerance (<= 1 fits).
    """

    kind: str
    variance_kind: str
    reserve_space_2: np.ndarray
    description: str
    n: int
    batch_mean: np.ndarray
    batch_variance: np.ndarray
    mismatch: dict = field(default_factory=dict)
    also_fits: tuple = ()


def _moments(x, shift, data_format, xp):
    """Per-channel ``n``, mean and biased variance of ``x`` in float64 (one pass, shifted by ``shift``)."""
    _, channels_first = DATA_FORMATS[data_format]
    acb = acb_shape(x.shape, channels_first)
    n = acb[0] * acb[2]
    x3 = x.reshape(acb)
    s1 = xp.zeros(acb[1], _F64)
    s2 = xp.zeros(acb[1], _F64)
    shift64 = xp.asarray(shift[:, None], _F64)
    buf = None
    for a, b in _blocks(acb, xp):
        blk = x3[a, :, b]
        if buf is None or buf.shape != blk.shape:
            buf = xp.empty(blk.shape, _F64)
        xp.subtract(blk, shift64, out=buf)
        s1 += buf.sum(axis=(0, 2))
        buf *= buf
        s2 += buf.sum(axis=(0, 2))
    s1, s2 = to_numpy(s1), to_numpy(s2)
    d = s1 / max(n, 1)
    # Shifted by (nearly) the mean, E[(x-s)^2] - E[x-s]^2 loses nothing in float64.
    return n, shift + d, np.maximum(s2 / max(n, 1) - d * d, 0.0)


def detect_variance_convention(x, reserve_space_1, reserve_space_2, *, epsilon=1e-4, data_format="NHWC"):
    """Find out what a training run saved in ``reserve_space_2``, by recomputing the statistics from ``x``.

    TF's CPU forward saves the biased batch variance, cuDNN ``1/sqrt(var + epsilon)``; files also turn up
    with the unbiased variance (the forward's ``batch_variance`` output) or an inverse variance.  Only for
    training-mode statistics: ``reserve_space_1`` must be the batch mean of ``x``.

    Returns a :class:`VarianceConvention`; raises :class:`~qgcli.errors.OperandError` when the mean is not
    the batch mean or no convention fits every channel.

    >>> x = np.arange(8, dtype=np.float32).reshape(2, 1, 1, 4)          # per channel: 2 values, 4 apart
    >>> detect_variance_convention(x, [2, 3, 4, 5], [4, 4, 4, 4], epsilon=0.0).kind
    'biased-variance'
    >>> detect_variance_convention(x, [2, 3, 4, 5], [0.5] * 4, epsilon=0.0).kind
    'inv-std'
    """
    rank, _ = _check_format(data_format)
    eps = _check_epsilon(epsilon)
    xp = array_module(x)
    x = data_operand(x, "x", xp)
    _check_rank(x, data_format, rank)
    channels = x.shape[1] if DATA_FORMATS[data_format][1] else x.shape[-1]
    rs1 = _channel_operand(reserve_space_1, "reserve_space_1", channels, data_format).astype(_F64)
    rs2 = _channel_operand(reserve_space_2, "reserve_space_2", channels, data_format).astype(_F64)
    n, mean, var = _moments(x, np.nan_to_num(rs1, nan=0.0, posinf=0.0, neginf=0.0), data_format, xp)
    if n == 0 or channels == 0:
        raise OperandError("is empty: there are no values to recompute the batch statistics from", operand="x")
    second = var + mean * mean
    mean_tol = _RTOL * np.sqrt(var) + 1e-4 * np.sqrt(second) + 1e-30
    off = ~(np.abs(rs1 - mean) <= mean_tol)
    if off.any():
        c = int(np.argmax(np.where(off, np.abs(rs1 - mean) / mean_tol, 0.0)))
        raise OperandError(
            f"is not the batch mean of x (channel {c}: {rs1[c]:.7g}, x gives {mean[c]:.7g}), so the variance "
            "convention cannot be checked; with population statistics use --no-is-training, else check "
            "--data-format and that x is the forward input",
            operand="reserve_space_1",
        )
    tol = _RTOL * var + _MOMENT_TOL * (second + eps) + 1e-30
    with np.errstate(all="ignore"):
        implied = {  # the biased variance each convention says reserve_space_2 stands for
            "biased-variance": rs2,
            "unbiased-variance": rs2 * (n - 1) / n if n > 1 else rs2,
            "inv-std": 1.0 / (rs2 * rs2) - eps,
            "inv-variance": 1.0 / rs2 - eps,
        }
        mismatch = {}
        for kind, v in implied.items():
            dist = np.abs(v - var) / tol
            valid = np.isfinite(v) & (rs2 > 0 if kind.startswith("inv") else rs2 >= 0)
            mismatch[kind] = float(np.max(np.where(valid, dist, np.inf)))
    fits = [k for k in CONVENTIONS if mismatch[k] <= 1.0]
    if not fits:
        raise OperandError(_no_convention_message(rs2, var, eps, n, mismatch), operand="reserve_space_2")
    kind = min(fits, key=lambda k: mismatch[k])
    variance_kind, wording = CONVENTIONS[kind]
    if kind == "unbiased-variance":
        converted = implied[kind]
    elif kind == "inv-variance":
        converted = np.sqrt(rs2)
    else:
        converted = rs2
    description = f"reserve_space_2 holds {wording}"
    if kind == "unbiased-variance":
        description += "; rescaled by (n-1)/n to the biased variance the gradient needs"
    elif kind == "inv-variance":
        description += "; its square root is used as the inverse std"
    others = tuple(k for k in fits if k != kind)
    if others:
        description += (f" (the {', '.join(k.replace('-', ' ') for k in others)} fits too: with n = {n} values per "
                        "channel they are too close to tell apart, and so are the gradients)")
    return VarianceConvention(
        kind=kind, variance_kind=variance_kind, reserve_space_2=converted.astype(_F32), description=description,
        n=int(n), batch_mean=mean, batch_variance=var, mismatch=mismatch, also_fits=others,
    )


def _no_convention_message(rs2, var, eps, n, mismatch):
    c = int(np.argmax(np.abs(rs2 - var) / (_RTOL * var + 1e-30)))
    message = (f"matches none of the biased or unbiased variance, 1/sqrt(var + epsilon) or 1/(var + epsilon) of x "
               f"(channel {c}: {rs2[c]:.7g}, while x has biased variance {var[c]:.7g}, n = {n})")
    with np.errstate(all="ignore"):
        implied_eps = 1.0 / (rs2 * rs2) - var
    if np.all(rs2 > 0) and np.all(np.isfinite(implied_eps)):
        guess = float(np.median(implied_eps))
        if 0 < guess <= 1 and np.all(np.abs(implied_eps - guess) <= _RTOL * (var + guess) + _MOMENT_TOL * guess):
            return (message + f"; it fits 1/sqrt(var + epsilon) with epsilon = {guess:.3g} rather than {eps:g}: "
                    "pass that --epsilon, or --variance-kind inv-std to use it as it is")
    return message + "; check --data-format and --epsilon, or pass --variance-kind variance|inv-std to use it as it is"
