"""TensorFlow's ``QuantizeV2`` + ``Dequantize`` round trip: the tutorial notebook's own fake quant.

The notebook ("Writing Custom Gradient Function") quantizes with ``tf.quantization.quantize(x, -6, 6,
tf.quint8)``, dequantizes with the range the op hands back, and gives the pair a custom gradient.  This module
reproduces TensorFlow 2.21's CPU kernels (``quantize_op.cc``, ``dequantize_op.cc``, ``quantization_utils.h``)
operation by operation in float32:

* **Range adjustment** (every mode): ``min_range = min(0, min)``,
  ``max_range = max(0, max(max, min_range + max(1, |min|, |max|) * ensure_minimum_range))``.
  SCALED then makes the range symmetric in the integer domain (``scale = min(min_out / min_range,
  max_out / max_range)``, ``min_range = min_out / scale``, ``max_range = max_out / scale``).
  QuantizeV2 returns the adjusted range as ``output_min``/``output_max``; Dequantize is fed that range.
* **MIN_COMBINED**: ``q = (clamp(x) - min) * (T_max - T_min) / (max - min)`` then ``+ 0.5`` and truncation for
  unsigned types, ``- (T_max - T_min + 1) / 2`` and round-half-away-from-zero for signed types.
  Dequantize: ``(q + half_range) * (max - min) / (T_max - T_min) + min``.
* **MIN_FIRST**: ``q = round(x * scale) - (round(min * scale) - T_lowest)``, clamped (no clamp of ``x``),
  ``scale = (2^bits - 1) / (max - min)``.  Dequantize subtracts the rounded minimum the same way.
* **SCALED**: ``q = round(clamp(x) * scale)`` (half away from zero or half to even), Dequantize ``q / scale``.

Exactness notes (each pinned by a golden case from real TensorFlow, ``tests/golden/make_golden_quantize.py``):
the scale factors mix double and float arithmetic exactly where the C++ does; ``qint32`` values that round to
``2^31`` wrap to ``-2^31`` as TF's ``lrint``-based cast does (MIN_COMBINED and SCALED at the top of the range),
and per-tensor SCALED Dequantize reads qint32 values that round to ``2^31`` as ``-2^31`` (its int cast goes
through float); NaN inputs become what x86's conversions give: ``0``, ``-2^31`` for qint32 MIN_FIRST, and for
qint8/qint16 MIN_COMBINED/SCALED the type's minimum inside whole Eigen packets (see :func:`_to_qtype`);
subnormals are flushed (TF's CPU threads run with FTZ/DAZ) whenever the range is tiny enough for that to matter.

These are the Eigen kernels that default TensorFlow runs.  With ``TF_ENABLE_ONEDNN_OPTS=1`` (or oneDNN on by
default on some Intel CPUs) TF swaps in ``_MklQuantizeV2`` for SCALED + HALF_TO_EVEN and for quint8 MIN_FIRST
(per-tensor, not narrow_range), which uses a symmetric ``[-max|.|, max|.|]`` range and different rounding;
qgcli does not emulate that.

Where TensorFlow silently returns garbage (NaN or infinite ``min``/``max``) these functions refuse with an
:class:`~qgcli.errors.OperandError`; every combination TF refuses is refused with TF's reason.
"""
from dataclasses import dataclass

import numpy as np

from qgcli.backend import array_module, to_numpy
from qgcli.errors import OperandError, QgcliError
from qgcli.ops.blocked import _map, BLOCK_ELEMENTS
from qgcli.ops.estimators import Quantized
from qgcli.ops.fake_quant import _quiet, as_float32, flush_subnormals

_F32 = np.float32
_TINY = np.finfo(np.float32).tiny  # smallest normal float32
_MAX_SUBNORMAL = np.nextafter(_TINY, _F32(0))
_FLT_MAX = np.finfo(np.float32).max
# Constants outside [2**-100, 2**100] can make intermediates subnormal (flushed by TF): take the slow path.
_FLUSH_LOW, _FLUSH_HIGH = _F32(2.0**-100), _F32(2.0**100)
_INT32_MIN = np.int32(-(2**31))


@dataclass(frozen=True)
class QType:
    """One of TensorFlow's quantized types: its name, the NumPy dtype that holds it, its integer range."""

    name: str
    numpy_dtype: type
    min: int
    max: int

    @property
    def signed(self):
        return self.min < 0

    @property
    def bits(self):
        return np.dtype(self.numpy_dtype).itemsize * 8


QTYPES = {
    "quint8": QType("quint8", np.uint8, 0, 255),
    "qint8": QType("qint8", np.int8, -128, 127),
    "quint16": QType("quint16", np.uint16, 0, 65535),
    "qint16": QType("qint16", np.int16, -32768, 32767),
    "qint32": QType("qint32", np.int32, -(2**31), 2**31 - 1),
}
MODES = ("MIN_COMBINED", "MIN_FIRST", "SCALED")
ROUND_MODES = ("HALF_AWAY_FROM_ZERO", "HALF_TO_EVEN")


@dataclass(frozen=True)
class QuantizeDequantizeResult:
    """What the round trip gives: ``outputs`` (dequantized float32), ``quantized`` (integers in the natural NumPy
    dtype of the quantized type), and QuantizeV2's adjusted range ``output_min``/``output_max`` (0-d, or one
    entry per slice of ``axis``).  Unpacks as a tuple in that order."""

    outputs: object
    quantized: object
    output_min: np.ndarray
    output_max: np.ndarray

    def __iter__(self):
        return iter((self.outputs, self.quantized, self.output_min, self.output_max))

    def as_dict(self):
        return {"outputs": self.outputs, "quantized": self.quantized,
                "output_min": self.output_min, "output_max": self.output_max}


@dataclass(frozen=True)
class QuantizeRange:
    """QuantizeV2's view of one range (host float32 arrays, 0-d or one entry per slice).

    ``min``/``max`` are the ranges given; ``output_min``/``output_max`` the adjusted range QuantizeV2 returns
    (and the clamp bounds for MIN_COMBINED/SCALED); ``scale`` the factor the kernel multiplies by.
    """

    qtype: QType
    mode: str
    min: np.ndarray
    max: np.ndarray
    output_min: np.ndarray
    output_max: np.ndarray
    scale: np.ndarray

    @property
    def per_slice(self):
        return self.output_min.ndim == 1


# --- small float32 helpers with C++ semantics ----------------------------------------------------------

def _std_min(a, b):
    """``std::min(a, b)``: ``b < a ? b : a`` (keeps ``a`` when unordered)."""
    return np.where(b < a, b, a)


def _std_max(a, b):
    """``std::max(a, b)``: ``a < b ? b : a``."""
    return np.where(a < b, b, a)


def _round_half_away(v, xp):
    """``std::round`` in float32: ties go away from zero.

    Exact: ``f = v - trunc(v)`` has no rounding error and ``2 * f`` neither, so ``trunc(2 * f)`` is the
    sign of ``v`` where ``|f| >= 0.5`` and 0 elsewhere; infinities and NaN come back unchanged.
    """
    t = xp.trunc(v)
    if getattr(t, "ndim", 0) == 0:  # scalars: no in-place work
        return t + xp.fmax(xp.trunc((v - t) * _F32(2)), _F32(-1))
    f = xp.subtract(v, t)
    xp.multiply(f, _F32(2), out=f)
    xp.trunc(f, out=f)
    xp.fmax(f, _F32(-1), out=f)  # inf - inf is NaN: any finite step keeps +-inf (fmax drops the NaN)
    return xp.add(t, f, out=t)


def _to_qtype(v, qtype, how, xp, *, packet_body=0):
    """Convert float32 ``v`` to the integer type as the compiled kernel does on x86.

    ``"trunc"``: ``cvttss2si`` (truncation; NaN and out-of-range give ``-2**31``) then the type's low bits.
    ``"lrint"``: qint32's float constructor, ``lrint`` to 64 bits then the low 32 bits (NaN gives 0, ``2**31``
    wraps to ``-2**31``); ``v`` is integral here.
    ``packet_body``: Eigen converts whole packets of floats to qint8/qint16 with saturating packs, so a NaN in
    the first ``packet_body`` elements (row-major) becomes the type's minimum; the scalar tail casts NaN to 0.
    """
    if how == "lrint":
        bad = ~xp.isfinite(v)
        if bool(bad.any()):
            v = xp.where(bad, _F32(0), v)
        return v.astype(np.int64).astype(np.int32)
    bad = ~(xp.abs(v) < _F32(2.0**31))  # NaN, and beyond int32 (-2**31 itself converts to -2**31 either way)
    if bool(bad.any()):
        narrow = xp.where(bad, _F32(0), v).astype(np.int32)
        narrow = xp.where(bad, _INT32_MIN, narrow)
    else:
        narrow = v.astype(np.int32)
    out = xp.ascontiguousarray(narrow.astype(qtype.numpy_dtype))  # low bits kept, as a C cast does
    if packet_body and bool(bad.any()):
        nan = xp.isnan(v).reshape(-1)[:packet_body]  # row-major order, as TF's flat view
        if bool(nan.any()):
            flat = out.reshape(-1)
            flat[:packet_body] = xp.where(nan, qtype.numpy_dtype(qtype.min), flat[:packet_body])
    return out


# --- validation ----------------------------------------------------------------------------------------

def qtype_of(dtype):
    """The :class:`QType` for a name (``"quint8"``...) or for the NumPy dtype that holds it (``np.uint8``...)."""
    if isinstance(dtype, QType):
        return dtype
    if isinstance(dtype, str) and dtype.lower() in QTYPES:
        return QTYPES[dtype.lower()]
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        np_dtype = None
    for qt in QTYPES.values():
        if np_dtype is not None and np_dtype == np.dtype(qt.numpy_dtype) and not isinstance(dtype, str):
            return qt
    raise QgcliError(f"{dtype!r} is not a quantized type; use one of {', '.join(QTYPES)}", operand="dtype")


def _check_attrs(mode, round_mode):
    if mode not in MODES:
        raise QgcliError(f"{mode!r} is not one of {', '.join(MODES)}", operand="mode")
    if round_mode not in ROUND_MODES:
        raise QgcliError(f"{round_mode!r} is not one of {', '.join(ROUND_MODES)}", operand="round_mode")
    if round_mode == "HALF_TO_EVEN" and mode != "SCALED":
        # TensorFlow's own reason, word for word (QuantizeV2Op's constructor).
        raise QgcliError(f"Round mode 'HALF_TO_EVEN' only supported for mode 'SCALED', but mode is '{mode}'.",
                         operand="round_mode")


def _host_range(value, name):
    arr = np.asarray(to_numpy(value))
    if arr.dtype.kind not in "fiu" and arr.dtype.name != "bfloat16":
        raise OperandError(f"dtype {arr.dtype} is not a real number type", operand=name)
    return arr.astype(_F32)


def _normalise_axis(axis, ndim):
    """TF's Python wrapper maps a negative axis with ``axis % ndim``; the kernel wants ``0 <= axis < ndim``."""
    if axis is None:
        return None
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise OperandError(f"must be an integer, got {axis!r}", operand="axis")
    axis = int(axis)
    if axis < 0 and ndim > 0:
        axis %= ndim
    if not 0 <= axis < ndim:
        raise OperandError(
            "Axis is on a zero-based index, so its value must always be less than number of input's dims, "
            f"but given axis value was {axis} and input's dims was {ndim}", operand="axis")
    return axis


def _slice_ranges(min_range, max_range, shape, axis):
    """Host float32 ranges: 0-d for one range, 1-d (one per slice of ``axis``) otherwise, as TF reads them."""
    mn, mx = _host_range(min_range, "min"), _host_range(max_range, "max")
    slices = 1 if axis is None else shape[axis]
    for name, arr in (("min", mn), ("max", mx)):
        if axis is None:
            if arr.size != 1:
                raise OperandError(f"If axis is not specified, min_range must contain a single float element, "
                                   f"but it contains {arr.size} elements", operand=name)
        elif arr.ndim != 1 or arr.shape[0] != slices:
            got = (f"is a 1-D tensor of size {arr.shape[0]}" if arr.ndim == 1 else f"dims are {arr.ndim}")
            raise OperandError(
                f"If axis is specified, {name}_range must be a 1-D tensor whose size matches the axis dimension of "
                f"the input and output tensors, but {name}_range {got} and input's axis dimension is of size "
                f"{slices}", operand=name)
    if slices == 1:  # TF takes the per-tensor path (scalar output_min/max) whenever there is one slice
        mn, mx = mn.reshape(()), mx.reshape(())
    for name, arr in (("min", mn), ("max", mx)):
        bad = ~np.isfinite(arr)
        if bad.any():
            i = int(np.argmax(bad.reshape(-1)))
            at = f" at slice {i}" if arr.ndim else ""
            raise OperandError(f"is {arr.reshape(-1)[i]}{at}; the range must be finite (TensorFlow would "
                               "return NaN or ignore it)", operand=name)
    reversed_ = np.atleast_1d(mx < mn)
    if reversed_.any():
        i = int(np.argmax(reversed_))
        at = f" at slice {i}" if mn.ndim else ""
        raise OperandError(f"{float(np.atleast_1d(mx)[i])!r} is below min {float(np.atleast_1d(mn)[i])!r}{at}; "
                           "input_max_range must be larger than input_min_range.", operand="max")
    return mn, mx


# --- ranges ------------------------------------------------------------------------------------------------

def quantize_range(min_range, max_range, *, dtype="quint8", mode="MIN_COMBINED", narrow_range=False,
                   ensure_minimum_range=0.01):
    """QuantizeV2's adjusted range and scale for raw ``min_range``/``max_range`` (scalars or one per slice).

    >>> r = quantize_range(-6.0, 6.0, dtype="qint8", mode="SCALED")
    >>> float(r.output_min), float(r.output_max), float(r.scale)
    (-6.047244071960449, 6.0, 21.16666603088379)
    """
    qt = qtype_of(dtype)
    if mode not in MODES:
        raise QgcliError(f"{mode!r} is not one of {', '.join(MODES)}", operand="mode")
    emr = _F32(ensure_minimum_range)
    if not np.isfinite(emr):
        raise OperandError(f"must be finite, got {ensure_minimum_range!r}", operand="ensure_minimum_range")
    mn = flush_subnormals(np.asarray(min_range, _F32))
    mx = flush_subnormals(np.asarray(max_range, _F32))
    with np.errstate(all="ignore"):
        lo = _std_min(_F32(0), mn).astype(_F32)
        eps = flush_subnormals(_std_max(_F32(1), _std_max(np.abs(mn), np.abs(mx))).astype(_F32) * emr)
        hi = _std_max(_F32(0), _std_max(mx, flush_subnormals(lo + eps))).astype(_F32)
        if mode == "MIN_COMBINED":
            # (double)(T::max - T::min) / (float)(max - min), stored as float
            width = flush_subnormals(hi - lo)
            scale = (np.float64(qt.max - qt.min) / width.astype(np.float64)).astype(_F32)
        elif mode == "MIN_FIRST":
            width = flush_subnormals(hi - lo)
            scale = np.where(hi == lo, 0.0, (2.0**qt.bits - 1.0) / width.astype(np.float64)).astype(_F32)
        else:
            min_out = _F32(qt.min + (1 if narrow_range else 0))
            max_out = _F32(qt.max)  # 2**31 - 1 becomes 2**31 as a float, as in C++
            ftz = flush_subnormals
            from_min = np.where(ftz(min_out * lo) > 0, ftz(min_out / lo), _FLT_MAX).astype(_F32)
            from_max = np.where(ftz(max_out * hi) > 0, ftz(max_out / hi), _FLT_MAX).astype(_F32)
            scale = _std_min(from_min, from_max).astype(_F32)
            lo = flush_subnormals(min_out / scale).astype(_F32)
            hi = flush_subnormals(max_out / scale).astype(_F32)
    return QuantizeRange(qt, mode, mn, mx, lo, hi, flush_subnormals(np.asarray(scale, _F32)))


def _needs_flush(*constants):
    for c in constants:
        a = np.abs(np.asarray(c, _F32))
        if np.any((a != 0) & (a < _FLUSH_LOW)) or np.any(a > _FLUSH_HIGH):
            return True
    return False


def _broadcastable(values, ndim, axis, xp):
    """Per-slice constants reshaped to broadcast along ``axis`` of an ``ndim`` tensor (scalars unchanged)."""
    values = np.asarray(values, _F32)
    if values.ndim == 0:
        return values[()]  # a NumPy scalar: CuPy takes scalars, not host arrays
    return xp.asarray(values.reshape((-1,) + (1,) * (ndim - axis - 1)))


# --- QuantizeV2 -------------------------------------------------------------------------------------------

def quantize_v2(inputs, min_range, max_range, *, dtype="quint8", mode="MIN_COMBINED",
                round_mode="HALF_AWAY_FROM_ZERO", narrow_range=False, axis=None, ensure_minimum_range=0.01):
    """TensorFlow's ``QuantizeV2`` (``tf.quantization.quantize``): ``(quantized, output_min, output_max)``.

    ``quantized`` holds the integers in the natural NumPy dtype of ``dtype`` (quint8 -> uint8, qint8 -> int8,
    quint16 -> uint16, qint16 -> int16, qint32 -> int32); ``output_min``/``output_max`` are the adjusted range
    (0-d float32, or one entry per slice of ``axis``).

    >>> q, lo, hi = quantize_v2(np.array([-6.0, 0.0, 6.0], np.float32), -6.0, 6.0, dtype="quint8")
    >>> q.tolist(), float(lo), float(hi)
    ([0, 128, 255], -6.0, 6.0)
    """
    xp = array_module(inputs)
    x = as_float32(inputs, "inputs", xp)
    qt = qtype_of(dtype)
    _check_attrs(mode, round_mode)
    axis = _normalise_axis(axis, x.ndim)
    mn, mx = _slice_ranges(min_range, max_range, x.shape, axis)
    if mn.ndim == 1 and mode == "MIN_FIRST":
        raise QgcliError("MIN_FIRST mode is not implemented for Quantize with axis != -1.", operand="mode")
    rng = quantize_range(mn, mx, dtype=qt, mode=mode, narrow_range=narrow_range,
                         ensure_minimum_range=ensure_minimum_range)
    q = _quantize_kernel(x, rng, round_mode, axis if mn.ndim else None, xp)
    return q, rng.output_min, rng.output_max


def _quantize_kernel(x, rng, round_mode, axis, xp):
    qt = rng.qtype
    lo_h, hi_h, scale_h = rng.output_min, rng.output_max, rng.scale
    if rng.mode == "MIN_FIRST":
        # FloatToQuantizedStruct: range_min_scaled = round(min * scale); offset = range_min_scaled - lowest.
        with np.errstate(all="ignore"):
            min_scaled = _round_half_away(flush_subnormals(lo_h * scale_h), np).astype(_F32)
            offset = flush_subnormals(min_scaled - _F32(qt.min)).astype(_F32)
        flush = _needs_flush(scale_h, offset)
    else:
        offset = None
        flush = _needs_flush(lo_h, hi_h, scale_h)
    nd = x.ndim
    lo, hi, scale = (_broadcastable(v, nd, axis, xp) for v in (lo_h, hi_h, scale_h))
    # Only the per-tensor kernel is vectorised (per-slice chips run the scalar cast everywhere); TF's
    # HALF_TO_EVEN functor leaves the 8-wide packet loop out, so only whole 4-packet blocks (32) vectorise.
    packet = 32 if round_mode == "HALF_TO_EVEN" else 8
    vectorised = qt.signed and qt.bits < 32 and axis is None and rng.mode != "MIN_FIRST"
    body = x.size - x.size % packet if vectorised else 0

    def elements(v, packet_body):
        with _quiet(xp):
            return _quantize_elements(v, qt, rng.mode, round_mode, lo, hi, scale, offset, flush, packet_body, xp)

    return _blocked(elements, x, body, qt.numpy_dtype, per_tensor=axis is None, xp=xp)


def _quantize_elements(v, qt, mode, round_mode, lo, hi, scale, offset, flush, packet_body, xp):
    ftz = (lambda a: flush_subnormals(a)) if flush else (lambda a: a)
    v = ftz(v)
    if mode == "MIN_FIRST":
        v = ftz(v * scale)
        v = _round_half_away(v, xp)
        v = ftz(xp.subtract(v, _F32(offset), out=v))
        # Eigen's cwiseMax/cwiseMin keep a NaN from the left operand, as np.maximum/np.minimum do.
        lower = _F32(max(float(qt.min), -2.147483648e09))
        upper = _F32(min(float(np.float32(qt.max)), 2.147483520e09))
        v = xp.minimum(xp.maximum(v, lower, out=v), upper, out=v)
        return _to_qtype(v, qt, "trunc", xp)
    v = xp.minimum(v, hi)
    xp.maximum(v, lo, out=v)  # NaN propagates, as Eigen's cwiseMin/cwiseMax
    if mode == "MIN_COMBINED":
        v = ftz(xp.subtract(v, lo, out=v))
        v = ftz(xp.multiply(v, scale, out=v))
        if not qt.signed:  # the unsigned "fast path": + 0.5 and a truncating cast
            return _to_qtype(xp.add(v, _F32(0.5), out=v), qt, "trunc", xp)
        half = _F32((float(qt.max) - float(qt.min) + 1) / 2.0)
        v = _round_half_away(xp.subtract(v, half, out=v), xp)
    else:
        v = ftz(xp.multiply(v, scale, out=v))
        v = xp.rint(v, out=v) if round_mode == "HALF_TO_EVEN" else _round_half_away(v, xp)
    return _to_qtype(v, qt, "lrint" if qt.name == "qint32" else "trunc", xp, packet_body=packet_body)


def _blocked(elements, x, body, out_dtype, *, per_tensor, xp):
    """Run ``elements(block, packet_body)`` over ``x``: in cache-sized blocks on a thread pool for large
    per-tensor NumPy work (results are identical: every operation is element-wise), else in one go."""
    if x.ndim == 0:  # the element kernels work in place on arrays of rank >= 1
        return elements(x.reshape(1), body).reshape(())
    if xp is not np or not per_tensor or x.size <= 2 * BLOCK_ELEMENTS:
        return elements(x, body)
    flat = np.ascontiguousarray(x).reshape(-1)
    out = np.empty(x.shape, out_dtype)
    out_flat = out.reshape(-1)

    def work(start):
        stop = min(start + BLOCK_ELEMENTS, flat.size)
        with np.errstate(all="ignore"):  # errstate is per thread
            out_flat[start:stop] = elements(flat[start:stop], max(0, min(body - start, stop - start)))

    _map(work, range(0, flat.size, BLOCK_ELEMENTS))
    return out


# --- Dequantize -------------------------------------------------------------------------------------------

def dequantize(quantized, min_range, max_range, *, mode="MIN_COMBINED", narrow_range=False, axis=None,
               dtype=None):
    """TensorFlow's ``Dequantize`` (``tf.quantization.dequantize``) to float32.

    The quantized type comes from ``dtype`` or else from the integer dtype of ``quantized`` (uint8 -> quint8,
    int8 -> qint8, uint16 -> quint16, int16 -> qint16, int32 -> qint32).  ``min_range``/``max_range`` are the
    range QuantizeV2 returned (scalars, or one per slice of ``axis``).

    >>> dequantize(np.array([0, 128, 255], np.uint8), -6.0, 6.0)
    array([-6.        ,  0.02352953,  6.        ], dtype=float32)
    """
    xp = array_module(quantized)
    q = xp.asarray(quantized)
    qt = qtype_of(dtype if dtype is not None else q.dtype)
    if q.dtype != np.dtype(qt.numpy_dtype):
        if q.dtype.kind not in "iu":
            raise OperandError(f"dtype {q.dtype} is not an integer type", operand="quantized")
        if q.size and (int(q.min()) < qt.min or int(q.max()) > qt.max):
            raise OperandError(f"has values outside {qt.name}'s range [{qt.min}, {qt.max}]", operand="quantized")
        q = q.astype(qt.numpy_dtype)
    if mode not in MODES:
        raise QgcliError(f"{mode!r} is not one of {', '.join(MODES)}", operand="mode")
    axis = _normalise_axis(axis, q.ndim)
    lo, hi = _host_range(min_range, "min"), _host_range(max_range, "max")
    slices = 1 if axis is None else q.shape[axis]
    for name, arr in (("min", lo), ("max", hi)):
        if arr.size != slices:
            raise OperandError(f"input_{name}_tensor must have as many elements as input on the dequantization "
                               f"axis ({-1 if axis is None else axis}), got {arr.size}, expected {slices}",
                               operand=name)
    if slices == 1:
        lo, hi = lo.reshape(()), hi.reshape(())
    elif mode == "MIN_FIRST":
        raise QgcliError("MIN_FIRST mode is not implemented for Dequantize with axis != -1.", operand="mode")
    return _dequantize_kernel(q, qt, mode, narrow_range, flush_subnormals(lo), flush_subnormals(hi),
                              axis if lo.ndim else None, xp)


def _dequantize_constants(qt, mode, narrow_range, lo, hi):
    """``(offset, scale, add)``: the output is ``(q + offset) * scale + add`` in float32 (one rounding each)."""
    with np.errstate(all="ignore"):
        if mode == "MIN_COMBINED":
            t_width = _F32(_F32(qt.max) - _F32(qt.min))  # float(T::max) - T::min, in float
            half = _F32((t_width + _F32(1)) / _F32(2)) if qt.signed else _F32(0)
            scale = flush_subnormals(flush_subnormals(hi - lo) / t_width)
            return half, scale.astype(_F32), lo
        if mode == "SCALED":
            if not qt.signed:
                scale = flush_subnormals(hi / _F32(qt.max))
            else:
                min_out = _F32(qt.min + (1 if narrow_range else 0))
                scale = _std_max(flush_subnormals(lo / min_out), flush_subnormals(hi / _F32(qt.max)))
            return _F32(0), np.asarray(scale, _F32), None
        # MIN_FIRST, QuantizedToFloatStruct: range_scale = (max - min) / (2^bits - 1.0), stored as float;
        # range_min_rounded = round(min / range_scale) * range_scale; add = rounded - lowest * range_scale.
        width = flush_subnormals(hi - lo).astype(np.float64)
        scale = flush_subnormals((width / (2.0**qt.bits - 1.0)).astype(_F32))
        ftz = flush_subnormals
        rounded = np.where(hi == lo, lo, ftz(_round_half_away(ftz(lo / scale), np) * scale)).astype(_F32)
        add = flush_subnormals(rounded - flush_subnormals(_F32(qt.min) * scale)).astype(_F32)
        return None, scale, add


def _dequantize_kernel(q, qt, mode, narrow_range, lo, hi, axis, xp):
    offset, scale_h, add_h = _dequantize_constants(qt, mode, narrow_range, lo, hi)
    flush = _needs_flush(scale_h, *(c for c in (add_h,) if c is not None))
    nd = q.ndim
    scale = _broadcastable(scale_h, nd, axis, xp)
    add = None if add_h is None else _broadcastable(add_h, nd, axis, xp)

    def elements(block, _):
        with _quiet(xp):
            return _dequantize_elements(block, qt, mode, offset, scale, add, flush, axis is None, xp)

    return _blocked(elements, q, 0, _F32, per_tensor=axis is None, xp=xp)


def _dequantize_elements(q, qt, mode, offset, scale, add, flush, per_tensor, xp):
    ftz = (lambda a: flush_subnormals(a)) if flush else (lambda a: a)
    v = q.astype(_F32)  # int -> float rounds to nearest even (qint32), as C++ does
    if mode == "MIN_COMBINED":
        if qt.signed:
            xp.add(v, offset, out=v)
        v = ftz(xp.multiply(v, scale, out=v))
        return ftz(xp.add(v, add, out=v))
    if mode == "SCALED":
        if qt.name == "qint32" and per_tensor:
            # TF's per-tensor kernel casts qint32 -> int -> float, and Eigen's QInt32 -> int goes through
            # float: values that round to 2**31 come back as -2**31 (cvttss2si's overflow answer).  The
            # per-slice kernel casts straight to float.
            v = xp.where(v >= _F32(2.0**31), _F32(-(2.0**31)), v)
        return ftz(xp.multiply(v, scale, out=v))
    v = ftz(xp.multiply(v, scale, out=v))
    return ftz(xp.add(add, v, out=v))


# --- the round trip and its gradient ---------------------------------------------------------------------

def quantize_dequantize(inputs, min_range, max_range, *, dtype="quint8", mode="MIN_COMBINED",
                        round_mode="HALF_AWAY_FROM_ZERO", narrow_range=False, axis=None, ensure_minimum_range=0.01):
    """``Dequantize(QuantizeV2(inputs, min_range, max_range))`` with QuantizeV2's adjusted range, as TF 2.21 does.

    The notebook's fake quant is ``quantize_dequantize(x, -6.0, 6.0, dtype="quint8")``.  Returns a
    :class:`QuantizeDequantizeResult` ``(outputs, quantized, output_min, output_max)``.

    >>> r = quantize_dequantize(np.array([-1.0, 0.01, 2.5], np.float32), -6.0, 6.0)
    >>> r.outputs, r.quantized
    (array([-1.0117645 ,  0.02352953,  2.5176468 ], dtype=float32), array([106, 128, 181], dtype=uint8))
    """
    q, lo, hi = quantize_v2(inputs, min_range, max_range, dtype=dtype, mode=mode, round_mode=round_mode,
                            narrow_range=narrow_range, axis=axis, ensure_minimum_range=ensure_minimum_range)
    axis = None if lo.ndim == 0 else _normalise_axis(axis, q.ndim)
    out = _dequantize_kernel(q, qtype_of(dtype), mode, narrow_range, lo, hi, axis, array_module(q))
    return QuantizeDequantizeResult(out, q, lo, hi)


def range_bounds(output_min, output_max, ndim, axis, xp=np):
    """The adjusted range as bounds broadcastable against the inputs (``axis`` None for one range)."""
    lo, hi = np.asarray(output_min, _F32), np.asarray(output_max, _F32)
    if lo.ndim == 0:
        return xp.asarray(lo), xp.asarray(hi)
    axis = _normalise_axis(axis, ndim)
    return _broadcastable(lo, ndim, axis, xp), _broadcastable(hi, ndim, axis, xp)


def range_mask(inputs, lo, hi, xp=None):
    """``lo <= inputs <= hi`` as TF's DAZ comparison sees it (a subnormal input compares as zero)."""
    xp = xp or array_module(inputs)
    lo = xp.where(xp.asarray(lo) == 0, _F32(-_MAX_SUBNORMAL), xp.asarray(lo, dtype=_F32))
    hi = xp.where(xp.asarray(hi) == 0, _F32(_MAX_SUBNORMAL), xp.asarray(hi, dtype=_F32))
    return (inputs >= lo) & (inputs <= hi)


def quantize_dequantize_gradient(gradients, inputs, output_min, output_max, *, axis=None):
    """Straight-through gradient of the round trip over QuantizeV2's adjusted range.

    ``backprops_wrt_input = gradients * (output_min <= inputs <= output_max)`` (inclusive; NaN inputs block,
    as in TF's fake-quant gradients).  The notebook's custom gradient scales this by 0.9 (an estimator).

    >>> quantize_dequantize_gradient(np.ones(3, np.float32), np.array([-7.0, 0.0, 6.0], np.float32), -6.0, 6.0)
    array([0., 1., 1.], dtype=float32)
    """
    xp = array_module(gradients, inputs)
    g = as_float32(gradients, "gradients", xp)
    x = as_float32(inputs, "inputs", xp)
    if g.shape != x.shape:
        raise OperandError(f"shape {list(g.shape)} differs from inputs shape {list(x.shape)}", operand="gradients")
    lo, hi = range_bounds(output_min, output_max, x.ndim, axis, xp)
    with _quiet(xp):
        # A product, as TF's multiply: g * 0 keeps -0.0 and NaN; subnormal gradients flush (FTZ).
        return xp.multiply(flush_subnormals(g), range_mask(x, lo, hi, xp), dtype=_F32)


def quantize_dequantize_backprops(gradients, inputs, lo, hi):
    """The round trip's gradient path: ``(gradients, inputs, lo, hi) -> {"backprops_wrt_input": ...}``.

    ``lo``/``hi`` are the adjusted range as bounds broadcastable against ``inputs`` (see
    :func:`range_bounds`); the clipped straight-through estimator over them, ``gradients * 1{lo <= x <= hi}``.
    Other estimators go through :func:`quantize_dequantize_view` and :mod:`qgcli.ops.estimators`.
    """
    xp = array_module(gradients, inputs)
    g = as_float32(gradients, "gradients", xp)
    x = as_float32(inputs, "inputs", xp)
    if g.shape != x.shape:
        raise OperandError(f"shape {list(g.shape)} differs from inputs shape {list(x.shape)}", operand="gradients")
    with _quiet(xp):
        return {"backprops_wrt_input": xp.multiply(flush_subnormals(g), range_mask(x, lo, hi, xp), dtype=_F32)}


# --- the round trip as an estimator (and a plot) sees it --------------------------------------------------

@dataclass(frozen=True)
class RoundTripGrid:
    """The round trip's grid in the vocabulary of :class:`qgcli.ops.Grid`, for summaries and plots.

    ``nudged_min``/``nudged_max`` hold QuantizeV2's adjusted range (``output_min``/``output_max``), ``scale``
    Dequantize's step, ``quant_min``/``quant_max`` the integer levels as offsets from the lowest one (SCALED:
    the integers themselves), ``zero_point``/``quant_zero`` the level of 0.0 (a float for MIN_COMBINED, whose
    grid need not contain 0).  Host float32 arrays, 0-d or one entry per slice.
    """

    min: np.ndarray
    max: np.ndarray
    num_bits: int
    narrow_range: bool
    quant_min: int
    quant_max: int
    scale: np.ndarray
    inv_scale: np.ndarray
    zero_point: np.ndarray
    quant_zero: np.ndarray
    nudged_min: np.ndarray
    nudged_max: np.ndarray
    passthrough: np.ndarray
    dtype: str = "quint8"
    mode: str = "MIN_COMBINED"
    round_mode: str = "HALF_AWAY_FROM_ZERO"

    @property
    def per_channel(self):
        return self.min.ndim == 1

    bounds_label = "output_min/max (adjusted)"

    def summary(self):
        """Plain numbers (lists per slice) for JSON summaries."""
        def plain(a):
            return np.asarray(a, np.float64).tolist()
        return {"dtype": self.dtype, "mode": self.mode, "round_mode": self.round_mode,
                "narrow_range": self.narrow_range, "min": plain(self.min), "max": plain(self.max),
                "output_min": plain(self.nudged_min), "output_max": plain(self.nudged_max), "step": plain(self.scale),
                "levels": self.quant_max - self.quant_min + 1, "zero_level": plain(self.zero_point)}

    def words(self):
        """One line for titles: type, mode, raw and adjusted range, step."""
        def fmt(v):
            v = np.asarray(v)
            return f"{float(v):.5g}" if v.ndim == 0 else f"{v.size} slices"
        rounding = f", {self.round_mode}" if self.mode == "SCALED" else ""
        narrow = ", narrow range" if self.narrow_range else ""
        return (f"{self.dtype} {self.mode}{rounding}{narrow}: [{fmt(self.min)}, {fmt(self.max)}] adjusted to "
                f"[{fmt(self.nudged_min)}, {fmt(self.nudged_max)}], {self.quant_max - self.quant_min + 1} levels, "
                f"step {fmt(self.scale)}")


def round_trip_grid(min_range, max_range, *, dtype="quint8", mode="MIN_COMBINED", round_mode="HALF_AWAY_FROM_ZERO",
                    narrow_range=False, ensure_minimum_range=0.01):
    """The :class:`RoundTripGrid` of a range (scalars or one per slice), as QuantizeV2 and Dequantize use it.

    >>> g = round_trip_grid(-6.0, 6.0, dtype="quint8")
    >>> float(g.nudged_min), float(g.nudged_max), g.quant_max, float(g.scale)
    (-6.0, 6.0, 255, 0.0470588244497776)
    """
    qt = qtype_of(dtype)
    rng = quantize_range(_host_range(min_range, "min"), _host_range(max_range, "max"), dtype=qt, mode=mode,
                         narrow_range=narrow_range, ensure_minimum_range=ensure_minimum_range)
    lo, hi = rng.output_min, rng.output_max
    step = _dequantize_constants(qt, mode, narrow_range, lo, hi)[1]
    step = np.asarray(step, _F32)
    with np.errstate(all="ignore"):
        if mode == "SCALED":
            n, p = qt.min + (1 if narrow_range else 0), qt.max
            zero = np.zeros_like(step)
        else:
            n, p = 0, (qt.max - qt.min if mode == "MIN_COMBINED" else int(2**qt.bits - 1))
            # MIN_COMBINED's levels start at lo; MIN_FIRST's at round(lo / step) * step (an integer level).
            first = lo / step if mode == "MIN_COMBINED" else _round_half_away(flush_subnormals(lo / step), np)
            zero = np.where(step > 0, -first, 0).astype(_F32) + _F32(0)
        inv = np.where(step > 0, _F32(1) / step, 0).astype(_F32)
    return RoundTripGrid(
        min=rng.min, max=rng.max, num_bits=qt.bits, narrow_range=bool(narrow_range), quant_min=n, quant_max=p,
        scale=step, inv_scale=inv, zero_point=zero, quant_zero=zero, nudged_min=lo, nudged_max=hi,
        passthrough=np.zeros(lo.shape, bool), dtype=qt.name, mode=mode, round_mode=round_mode)


def plot_data(inputs, min_range, max_range, *, dtype="quint8", mode="MIN_COMBINED", round_mode="HALF_AWAY_FROM_ZERO",
              narrow_range=False, axis=None, ensure_minimum_range=0.01):
    """``(result, grid)``: the round trip and its :class:`RoundTripGrid` (what plots draw and label)."""
    xp = array_module(inputs)
    x = as_float32(inputs, "inputs", xp)
    kw = dict(dtype=dtype, mode=mode, narrow_range=narrow_range, ensure_minimum_range=ensure_minimum_range)
    result = quantize_dequantize(x, min_range, max_range, round_mode=round_mode, axis=axis, **kw)
    mn, mx = _slice_ranges(min_range, max_range, x.shape, _normalise_axis(axis, x.ndim))
    return result, round_trip_grid(mn, mx, round_mode=round_mode, **kw)


def quantize_dequantize_view(inputs, min_range, max_range, *, dtype="quint8", mode="MIN_COMBINED",
                             round_mode="HALF_AWAY_FROM_ZERO", narrow_range=False, axis=None,
                             ensure_minimum_range=0.01):
    """The round trip as :mod:`qgcli.ops.estimators` sees a forward pass: ``(view, result)``.

    ``view`` is a :class:`qgcli.ops.estimators.Quantized` over QuantizeV2's adjusted range (``lo``/``hi`` =
    ``output_min``/``output_max``, ``inside = lo <= x <= hi``) with Dequantize's step as ``scale``; so
    ``apply_estimator("scaled:0.9", dy, view)`` is the notebook's custom gradient ``0.9 * dy``.  ``result`` is
    the :class:`QuantizeDequantizeResult`.
    """

    xp = array_module(inputs)
    x = as_float32(inputs, "inputs", xp)
    result = quantize_dequantize(x, min_range, max_range, dtype=dtype, mode=mode, round_mode=round_mode,
                                 narrow_range=narrow_range, axis=axis, ensure_minimum_range=ensure_minimum_range)
    axis = _normalise_axis(axis, x.ndim)
    mn, mx = _slice_ranges(min_range, max_range, x.shape, axis)
    grid = round_trip_grid(mn, mx, dtype=dtype, mode=mode, round_mode=round_mode, narrow_range=narrow_range,
                           ensure_minimum_range=ensure_minimum_range)
    channel_axis = None if mn.ndim == 0 else axis
    last = (lambda a: a) if channel_axis is None else (lambda a: xp.moveaxis(a, channel_axis, -1))  # noqa: E731
    xl, out = last(flush_subnormals(x)), last(result.outputs)
    lo_d, hi_d = xp.asarray(result.output_min), xp.asarray(result.output_max)
    lo_b = xp.where(lo_d == 0, _F32(-_MAX_SUBNORMAL), lo_d)
    hi_b = xp.where(hi_d == 0, _F32(_MAX_SUBNORMAL), hi_d)
    with _quiet(xp):
        residual = xp.subtract(out, xl, dtype=_F32)
    view = Quantized(
        inputs=xl, outputs=out, residual=residual, inside=(xl >= lo_b) & (xl <= hi_b), below=xl < lo_b,
        above=xl > hi_b, scale=xp.asarray(grid.scale), inv_scale=xp.asarray(grid.inv_scale),
        zero_point=xp.asarray(grid.zero_point), quant_min=grid.quant_min, quant_max=grid.quant_max,
        lo=lo_d, hi=hi_d, axis=channel_axis, flush=True, semantics="tf")
    return view, result
