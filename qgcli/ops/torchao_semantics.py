"""torchao's QAT fake quantizers (``torchao.quantization.qat``, torchao 0.18 on torch 2.13 CPU), with dynamic
qparams, and the full autograd gradient of their input.  Pure NumPy/CuPy (picked from the arguments); torch
and torchao are never imported.

Two quantizers, as ``IntxFakeQuantizer`` / ``Float8FakeQuantizer`` compute them on float32 inputs.
Blocks: ``per-group:G`` (2-D inputs, G consecutive values of a row), ``per-channel`` (a whole row of a 2-D
input: torchao's ``PerAxis(0)`` is a group of the last dimension's length), ``per-token`` / ``per-row`` (the
last dimension, any rank), ``per-tensor`` (float8 only).

Integer (``IntxFakeQuantizeConfig``; ``mn``/``mx``: the block's min/max, ``b``: bit width; float32 throughout,
each step rounded as torch does)::

    symmetric, per group/channel:  s = max(-min(mn, 0), max(mx, 0)) / ((Qs_max - Qs_min) / 2), clamp(s, eps)
                                   with Qs = [-2^(b-1), 2^(b-1) - 1] (b = 1: [-1, 0]) for int AND uint; z = 0
    asymmetric, per group/channel: s = (mx - mn) / (2^b - 1), clamp(s, eps = 1e-6 by default),
                                   z = trunc(mn + s * 2^(b-1))  (torchao's float-domain "tinygemm" zero point,
                                   cast to zero_point_precision: int32 truncates toward zero)
    asymmetric, per token:         s = (max(mx, 0) - min(mn, 0)) / (Q_max - Q_min), clamp(s, eps),
                                   z = clamp(Q_min - round(min(mn, 0) / s), Q_min, Q_max)
    forward (zero_point_domain int, Q = the dtype's own range, r = 1/s in the scale precision):
        v = round(x * r) + z;  q = clamp(v, Q_min, Q_max);  y = (q - z) * s     (round: half to even)
    forward (zero_point_domain float): v = round((x - (z - s * m)) / s), y = (clamp(v) - m) * s + z,
        m = (Q_max + Q_min + 1) / 2

eps defaults to float32's smallest normal (2^-126) except in the asymmetric per-group path (1e-6).  torchao
computes the integer qparams under ``torch.no_grad()``: the scale is a constant to autograd, so the input
gradient is the straight-through mask in torch's own rounding, ``dx = where(Q_min <= v <= Q_max, dy * s, 0)
* r`` (float domain: ``/ s``); it differs from ``dy`` by one float32 rounding on many unclipped elements
and has *no* scale-path term.

Float8 (``Float8FakeQuantizeConfig``; ``F`` = 448 for e4m3fn, 57344 for e5m2)::

    m = clamp(max|x|, hp_value_lb, hp_value_ub);  s = m / F;  u = x / s;  c = clamp(u, -F, F)
    y = fp8(c) * s              (fp8: round to the nearest float8 value, ties to even)

Here the scale stays inside autograd, so with ``[.]`` the 0/1 indicator and sums over the block::

    dx = where(|u| <= F, dy * s, 0) / s                                  (straight-through part)
       + sign(x) * [|x| = max|x|] / count * [lb <= max|x| <= ub] / F * g_s   (scale path)
    g_s = sum(dy * fp8(c)) - sum(where(|u| <= F, dy * s, 0) * (x / s) / s)

(``count``: how many elements of the block reach its max|x|).  The scale-path term reaches only the
block's extreme elements but carries the whole block's sensitivity to the scale.

NaN and infinities propagate as in torchao: a NaN or infinite value makes its block's scale NaN or
infinite and every output of the block NaN; an all-zero float8 block has scale 0 and NaN outputs (0/0),
an all-zero integer block the scale eps.  The block sums of the float8 gradient are accumulated in float64
and rounded once, so they agree with torch to float32 summation error, not bit for bit.
"""
from dataclasses import dataclass
from typing import Optional

import numpy as np

from qgcli.backend import array_module
from qgcli.errors import OperandError

_F32 = np.float32
INT_DTYPES = tuple(f"int{b}" for b in range(1, 9)) + tuple(f"uint{b}" for b in range(1, 9))
FLOAT8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
MAPPING_TYPES = ("symmetric", "asymmetric")
SCALE_PRECISIONS = ("float32", "bfloat16", "float16")
ZERO_POINT_PRECISIONS = ("int32", "float32", "bfloat16", "float16")
ZERO_POINT_DOMAINS = ("int", "float")
#: float8 format: (mantissa bits, smallest normal exponent, largest finite value)
_FLOAT8 = {"float8_e4m3fn": (3, -6, 448.0), "float8_e5m2": (2, -14, 57344.0)}
_SMALLEST_NORMAL = float(np.finfo(np.float32).tiny)


def dtype_bounds(dtype):
    """``(quant_min, quant_max)`` of a torchao integer dtype (torchao's ``_DTYPE_TO_QVALUE_BOUNDS``)."""
    bits = bit_width(dtype)
    if dtype.startswith("uint"):
        return 0, 2**bits - 1
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def bit_width(dtype):
    if dtype not in INT_DTYPES:
        raise OperandError(f"{dtype!r} is not one of torchao's integer dtypes {', '.join(INT_DTYPES)}",
                           operand="dtype")
    return int(dtype.lstrip("uint"))


# --- configs -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class IntxFakeQuantizeConfig:
    """torchao's ``IntxFakeQuantizeConfig`` with ``is_dynamic=True``.  ``granularity``: ``per-group``
    (with ``group_size``), ``per-channel`` or ``per-token``; build it with :func:`intx_fake_quantize_config`."""

    dtype: str
    granularity: str
    group_size: Optional[int] = None
    mapping_type: str = "symmetric"
    scale_precision: str = "float32"
    zero_point_precision: str = "int32"
    zero_point_domain: str = "int"
    eps: Optional[float] = None

    @property
    def op(self):
        return "torchao.IntxFakeQuantizer"

    @property
    def granularity_text(self):
        return f"per-group:{self.group_size}" if self.granularity == "per-group" else self.granularity

    def attributes(self):
        return {"dtype": self.dtype, "granularity": self.granularity_text, "mapping_type": self.mapping_type,
                "scale_precision": self.scale_precision, "zero_point_precision": self.zero_point_precision,
                "zero_point_domain": self.zero_point_domain, "eps": self.eps, "is_dynamic": True}


@dataclass(frozen=True)
class Float8FakeQuantizeConfig:
    """torchao's ``Float8FakeQuantizeConfig``: ``per-row`` (the last dimension) or ``per-tensor``."""

    dtype: str = "float8_e4m3fn"
    granularity: str = "per-row"
    hp_value_lb: Optional[float] = None
    hp_value_ub: Optional[float] = None

    @property
    def op(self):
        return "torchao.Float8FakeQuantizer"

    @property
    def granularity_text(self):
        return self.granularity

    def attributes(self):
        return {"dtype": self.dtype, "granularity": self.granularity, "hp_value_lb": self.hp_value_lb,
                "hp_value_ub": self.hp_value_ub}


def parse_granularity(text):
    """``(granularity, group_size)`` from ``per-group:G``, ``per-channel``, ``per-token``, ``per-row``,
    ``per-tensor`` (underscores accepted)."""
    t = str(text).strip().lower().replace("_", "-")
    if t.startswith("per-group"):
        _, _, size = t.partition(":")
        try:
            g = int(size)
        except ValueError:
            raise OperandError(f"{text!r}: per-group needs a group size, e.g. per-group:32", operand="granularity")
        return "per-group", g
    if t in ("per-channel", "per-token", "per-row", "per-tensor"):
        return t, None
    raise OperandError(f"{text!r} is not per-group:G, per-channel, per-token, per-row or per-tensor",
                       operand="granularity")


def _granularity(granularity):
    """:func:`parse_granularity` of text; anything else (``1234``, ``None``, ``3.5``) is refused naming the
    operand, not left to fail as a TypeError further on."""
    if not isinstance(granularity, str):
        raise OperandError(f"{granularity!r} is not per-group:G, per-channel, per-token, per-row or per-tensor",
                           operand="granularity")
    return parse_granularity(granularity)


def intx_fake_quantize_config(dtype, granularity, mapping_type="symmetric", scale_precision="float32",
                              zero_point_precision="int32", zero_point_domain="int", eps=None):
    """An :class:`IntxFakeQuantizeConfig`, refused where torchao refuses it (or computes something qgcli does
    not reproduce: see docs/estimators.md, "torchao QAT")."""
    bit_width(dtype)
    gran, group = _granularity(granularity)
    if gran in ("per-tensor", "per-row"):
        raise OperandError(f"torchao's IntxFakeQuantizeConfig supports per-group:G, per-channel and per-token, not "
                           f"{gran} (torchao: Granularity '{'PerTensor()' if gran == 'per-tensor' else 'PerRow()'}' "
                           "is not supported)", operand="granularity")
    if mapping_type not in MAPPING_TYPES:
        raise OperandError(f"{mapping_type!r} is not symmetric or asymmetric (torchao refuses "
                           "SYMMETRIC_NO_CLIPPING_ERR in IntxFakeQuantizeConfig)", operand="mapping_type")
    if gran == "per-token" and mapping_type == "symmetric":
        raise OperandError("torchao refuses symmetric per-token (NotImplementedError: Symmetric per token is not "
                           "supported yet); give --mapping-type asymmetric", operand="mapping_type")
    if gran == "per-group" and (group is None or group < 2):
        raise OperandError(f"group size {group} must be at least 2 (torchao asserts group_size > 1)",
                           operand="granularity")
    if scale_precision not in SCALE_PRECISIONS:
        raise OperandError(f"{scale_precision!r} is not one of {', '.join(SCALE_PRECISIONS)}",
                           operand="scale_precision")
    if zero_point_precision not in ZERO_POINT_PRECISIONS:
        raise OperandError(f"{zero_point_precision!r} is not one of {', '.join(ZERO_POINT_PRECISIONS)}",
                           operand="zero_point_precision")
    if zero_point_domain == "none":
        raise OperandError("torchao's IntxFakeQuantizer always passes a zero point, so zero_point_domain none "
                           "fails (ValueError: zero_point should be None when zero_point_domain is NONE)",
                           operand="zero_point_domain")
    if zero_point_domain not in ZERO_POINT_DOMAINS:
        raise OperandError(f"{zero_point_domain!r} is not int or float", operand="zero_point_domain")
    if zero_point_domain == "float" and gran != "per-token" and scale_precision != "float32":
        raise OperandError("zero_point_domain float with a non-float32 scale precision mixes bfloat16/float16 "
                           "type promotions qgcli does not reproduce", operand="zero_point_domain")
    if eps is not None:
        eps = float(eps)
        if not (np.isfinite(eps) and eps >= 0):
            raise OperandError(f"{eps!r} must be finite and >= 0", operand="eps")
    return IntxFakeQuantizeConfig(dtype, gran, group, mapping_type, scale_precision, zero_point_precision,
                                  zero_point_domain, eps)


def float8_fake_quantize_config(dtype="float8_e4m3fn", granularity="per-row", hp_value_lb=None, hp_value_ub=None):
    """A :class:`Float8FakeQuantizeConfig`, refused where torchao refuses it."""
    if dtype not in FLOAT8_DTYPES:
        raise OperandError(f"{dtype!r} is not {' or '.join(FLOAT8_DTYPES)}", operand="dtype")
    gran, _ = _granularity(granularity)
    if gran not in ("per-row", "per-tensor"):
        raise OperandError(f"torchao's Float8FakeQuantizeConfig takes per-row or per-tensor, not {gran} (torchao: "
                           "Expected PerRow or PerTensor granularity)", operand="granularity")
    for name, v in (("hp_value_lb", hp_value_lb), ("hp_value_ub", hp_value_ub)):
        if v is not None and not np.isfinite(float(v)):
            raise OperandError(f"{v!r} must be finite", operand=name)
    return Float8FakeQuantizeConfig(dtype, gran, None if hp_value_lb is None else float(hp_value_lb),
                                    None if hp_value_ub is None else float(hp_value_ub))


# --- helpers --------------------------------------------------------------------------------------------

def round_to_precision(a, precision, xp):
    """float32 ``a`` rounded to ``precision`` (as torch's ``.to``), returned as float32 values; int32
    truncates toward zero (NaN, infinities and values beyond int32: INT32_MIN, as x86 gives them)."""
    a = a.astype(_F32, copy=False)
    if precision == "float32":
        return a
    if precision == "float16":
        with np.errstate(over="ignore"):
            return a.astype(np.float16).astype(_F32)
    if precision == "bfloat16":
        u = a.view(np.uint32).astype(np.uint64)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        out = (r & 0xFFFFFFFF).astype(np.uint32).view(_F32)
        return xp.where(xp.isnan(a), a, out)
    if precision == "int32":
        ok = xp.isfinite(a) & (xp.abs(a) < 2.0**31)
        return (xp.where(ok, xp.trunc(xp.where(ok, a, 0)), _F32(-(2.0**31))) + _F32(0)).astype(_F32)
    raise ValueError(precision)


def float8_underflow_exponent(dtype):
    """e such that a value of magnitude 2^e or less rounds to 0 in ``dtype`` (half its smallest subnormal,
    ties to even): -10 for float8_e4m3fn, -17 for float8_e5m2."""
    mant, emin, _ = _FLOAT8[dtype]
    return emin - mant - 1


def _round_float8(c, dtype, xp):
    """float32 ``c`` cast to float8 as torch 2.13's ``.to(float8)`` does, returned as float32: nearest value,
    ties to even; e4m3fn saturates (infinities too) to ±448, e5m2 overflows to ±inf; NaN stays NaN."""
    mant, emin, fmax = _FLOAT8[dtype]
    c64 = c.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        _, e = xp.frexp(xp.abs(c64))
        e = xp.maximum(e - 1, emin)
        quantum = xp.ldexp(xp.ones_like(c64), (e - mant).astype(np.int32))
        r = xp.rint(c64 / quantum) * quantum
        r = xp.where(xp.isinf(c64), c64, r)
        if dtype == "float8_e4m3fn":
            r = xp.where(xp.isnan(r), r, xp.clip(r, -fmax, fmax))
        else:
            r = xp.where(xp.abs(r) > fmax, xp.copysign(np.inf, r), r)
        return r.astype(_F32)


def _blocks(x, config):
    """``(x as (blocks, block length), torchao's scale shape)``; refuses what torchao's asserts refuse."""
    shape = tuple(x.shape)
    if x.ndim == 0 or x.size == 0:
        raise OperandError(f"shape {list(shape)}: torchao's quantizers need a non-empty tensor of rank >= 1",
                           operand="inputs")
    gran = config.granularity
    if gran in ("per-group", "per-channel"):
        if x.ndim != 2:
            raise OperandError(f"shape {list(shape)}: torchao's {gran} fake quant takes 2-D inputs only "
                               "(asserts input.dim() == 2); per-token works on any rank", operand="inputs")
        rows, cols = shape
        group = cols if gran == "per-channel" else config.group_size
        if gran == "per-channel" and group < 2:
            raise OperandError("per-channel needs rows of at least 2 values (torchao asserts group_size > 1)",
                               operand="inputs")
        if cols % group:
            raise OperandError(f"the last dimension ({cols}) is not a multiple of the group size {group} (torchao "
                               "asserts input.shape[-1] % group_size == 0)", operand="inputs")
        return x.reshape(rows * (cols // group), group), (rows, cols // group)
    if gran in ("per-token", "per-row"):
        scale_shape = shape[:-1] if gran == "per-token" else shape[:-1] + (1,)
        return x.reshape(-1, shape[-1]), scale_shape
    return x.reshape(1, -1), (1,) * x.ndim  # per-tensor


def _inputs(inputs, gradients):
    xp = array_module(inputs) if gradients is None else array_module(inputs, gradients)
    x = xp.asarray(inputs)
    if x.dtype.kind != "f" and x.dtype.name != "bfloat16":
        raise OperandError(f"dtype {x.dtype} is not a real floating type", operand="inputs")
    x = x.astype(_F32, copy=False)
    g = None
    if gradients is not None:
        g = xp.asarray(gradients)
        if g.dtype.kind != "f" and g.dtype.name != "bfloat16":
            raise OperandError(f"dtype {g.dtype} is not a real floating type", operand="gradients")
        g = g.astype(_F32, copy=False)
        if g.shape != x.shape:
            raise OperandError(f"shape {list(g.shape)} differs from inputs shape {list(x.shape)}",
                               operand="gradients")
    return xp, x, g


@dataclass
class TorchaoResult:
    """What a torchao fake quantizer gives: ``outputs``, ``scale`` / ``zero_point`` in torchao's shapes
    (float32 values; zero_point None for float8) and, with gradients, ``backprops_wrt_input`` split into
    ``straight_through`` (``dy`` where the element is not clipped), ``scale_path`` (through the scale; 0 for
    the integer quantizers) and ``rounding`` (the rest: torch's float32 rounding of the chain rule).
    ``inside`` is the not-clipped mask; ``blocks`` the (blocks, block length) shape the block arrays use."""

    config: object
    outputs: object
    scale: object
    zero_point: object
    inside: object
    blocks: tuple
    backprops_wrt_input: object = None
    straight_through: object = None
    scale_path: object = None
    rounding: object = None


# --- the integer quantizer ----------------------------------------------------------------------------

def choose_qparams(inputs, config):
    """``(scale, zero_point)`` as torchao's dynamic IntxFakeQuantizer (or ``(scale, None)`` for float8)
    computes them, in torchao's shapes, as float32 values."""
    xp, x, _ = _inputs(inputs, None)
    xb, scale_shape = _blocks(x, config)
    if isinstance(config, Float8FakeQuantizeConfig):
        s, _ = _float8_scale(xb, config, xp)
        return s.reshape(scale_shape), None
    s, z = _intx_qparams(xb, config, xp)
    return s.reshape(scale_shape), z.reshape(scale_shape)


def _intx_qparams(xb, c, xp):
    """(scale, zero point) per block, shape (blocks, 1), as float32 values of their precisions."""
    bits = bit_width(c.dtype)
    with np.errstate(all="ignore"):
        mn = xp.min(xb, axis=1, keepdims=True)
        mx = xp.max(xb, axis=1, keepdims=True)
        if c.granularity == "per-token":
            qmin, qmax = dtype_bounds(c.dtype)
            eps = _F32(_SMALLEST_NORMAL if c.eps is None else c.eps)
            mn_neg, mx_pos = xp.minimum(mn, _F32(0)), xp.maximum(mx, _F32(0))
            s = (mx_pos - mn_neg) / _F32(qmax - qmin)
            s = _clamp_min(s, eps, xp)
            z = _F32(qmin) - xp.rint(mn_neg / s)
            z = xp.minimum(xp.maximum(z, _F32(qmin)), _F32(qmax))  # NaN propagates as torch.clamp
            z = xp.where(xp.isnan(mn_neg / s), mn_neg / s, z)
            return round_to_precision(s, c.scale_precision, xp), round_to_precision(z, c.zero_point_precision, xp)
        if c.mapping_type == "symmetric":
            qmin_s, qmax_s = (-1, 0) if bits == 1 else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
            eps = _F32(_SMALLEST_NORMAL if c.eps is None else c.eps)
            mn_neg, mx_pos = xp.minimum(mn, _F32(0)), xp.maximum(mx, _F32(0))
            mx_pos = xp.maximum(-mn_neg, mx_pos)
            s = mx_pos / _F32((qmax_s - qmin_s) / 2)
            z = xp.full_like(s, _F32(int((qmax_s + qmin_s + 1) / 2)))
            s = _clamp_min(s, eps, xp)
            s = round_to_precision(s, c.scale_precision, xp)
            z = round_to_precision(round_to_precision(z, c.scale_precision, xp), c.zero_point_precision, xp)
            return s, z
        # asymmetric per group/channel: torchao's get_groupwise_affine_qparams, float ("tinygemm") zero point
        qmin_a, qmax_a = 0, 2**bits - 1
        eps = _F32(1e-6 if c.eps is None else c.eps)
        s = (mx - mn) / _F32(qmax_a - qmin_a)
        s = _clamp_min(s, eps, xp)
        z = mn + s * _F32((qmax_a + qmin_a + 1) / 2)
        z = round_to_precision(z, c.scale_precision, xp)
        s = round_to_precision(s, c.scale_precision, xp)
        return s, round_to_precision(z, c.zero_point_precision, xp)


def _clamp_min(a, lo, xp):
    """torch.clamp(a, min=lo): NaN stays NaN."""
    return xp.where(xp.isnan(a), a, xp.maximum(a, lo))


def range_qparams(lo, hi, config):
    """``(scale, zero_point)``, shape (blocks, 1), that torchao's integer quantizer computes for blocks whose
    smallest value is ``lo`` and largest ``hi`` (one per block): its qparams depend on nothing else.

    >>> c = intx_fake_quantize_config("int4", "per-group:4")
    >>> s, z = range_qparams(np.float32([-0.5]), np.float32([1.5]), c)
    >>> float(s[0, 0]), float(z[0, 0])
    (0.20000000298023224, 0.0)
    """
    if isinstance(config, Float8FakeQuantizeConfig):
        raise OperandError("float8 has no range parameters (its scale is amax / the dtype's max, per block)",
                           operand="--ranges-out")
    ends = np.stack([np.asarray(lo, _F32).ravel(), np.asarray(hi, _F32).ravel()], axis=1)
    return _intx_qparams(ends, config, np)


def _intx(xb, gb, c, xp, qparams=None):
    s, z = _intx_qparams(xb, c, xp) if qparams is None else qparams
    qmin, qmax = dtype_bounds(c.dtype)
    domain = "int" if c.granularity == "per-token" else c.zero_point_domain
    with np.errstate(all="ignore"):
        if domain == "int":
            r = round_to_precision(_F32(1) / s, c.scale_precision, xp)
            v = xp.rint(xb * r) + z
            q = xp.where(xp.isnan(v), v, xp.minimum(xp.maximum(v, _F32(qmin)), _F32(qmax)))
            y = (q - z) * s
        else:
            mid = _F32((qmax + qmin + 1) / 2)
            min_val = z - s * mid
            v = xp.rint((xb - min_val) / s)
            q = xp.where(xp.isnan(v), v, xp.minimum(xp.maximum(v, _F32(qmin)), _F32(qmax)))
            y = (q - mid) * s + z
        inside = (v >= qmin) & (v <= qmax)
        grads = None
        if gb is not None:
            t = xp.where(inside, gb * s, _F32(0))
            dx = t * r if domain == "int" else t / s
            ste = xp.where(inside, gb, _F32(0))
            grads = dx, ste, xp.zeros_like(dx)
    return y.astype(_F32), s, z, inside, grads


# --- the float8 quantizer -----------------------------------------------------------------------------

def _float8_scale(xb, c, xp):
    with np.errstate(all="ignore"):
        m_raw = xp.max(xp.abs(xb), axis=1, keepdims=True)
        m = m_raw
        if c.hp_value_lb is not None:
            m = _clamp_min(m, _F32(c.hp_value_lb), xp)
        if c.hp_value_ub is not None:
            m = xp.where(xp.isnan(m), m, xp.minimum(m, _F32(c.hp_value_ub)))
        return (m / _F32(_FLOAT8[c.dtype][2])).astype(_F32), m_raw


def _float8(xb, gb, c, xp):
    s, m_raw = _float8_scale(xb, c, xp)
    fmax = _F32(_FLOAT8[c.dtype][2])
    with np.errstate(all="ignore"):
        u = xb / s
        cl = xp.where(xp.isnan(u), u, xp.minimum(xp.maximum(u, -fmax), fmax))
        r = _round_float8(cl, c.dtype, xp)
        y = r * s
        inside = (u >= -fmax) & (u <= fmax)
        grads = None
        if gb is not None:
            # torch casts the gradient of the float8 tensor to float8 (ToCopyBackward of .to(float32)), then
            # back to float32 for the clamp: the upstream gradient times s is itself rounded to float8.
            t = xp.where(inside, _round_float8(gb * s, c.dtype, xp), _F32(0))
            direct = t / s
            f64 = np.float64
            # per element in float32 as torch's mul/div backward (0 * inf = NaN where (x / s) / s overflows),
            # summed over the block in float64
            g_s = (gb * r).astype(f64).sum(axis=1, keepdims=True) \
                + (-t * ((xb / s) / s)).astype(f64).sum(axis=1, keepdims=True)
            g_m = g_s / f64(fmax)
            through = xp.ones_like(m_raw, dtype=bool)
            if c.hp_value_lb is not None:
                through &= m_raw >= _F32(c.hp_value_lb)
            if c.hp_value_ub is not None:
                through &= m_raw <= _F32(c.hp_value_ub)
            g_m = xp.where(through, g_m, 0.0)
            hit = xp.abs(xb) == m_raw
            count = hit.sum(axis=1, keepdims=True).astype(f64)
            sp = (g_m / count) * hit * xp.sign(xb).astype(f64)
            dx = (direct.astype(f64) + sp).astype(_F32)
            ste = xp.where(inside, gb, _F32(0))
            grads = dx, ste, sp
    return y.astype(_F32), s, None, inside, grads


# --- public API ------------------------------------------------------------------------------------------

def _run(inputs, config, gradients=None, qparams=None):
    xp, x, g = _inputs(inputs, gradients)
    xb, scale_shape = _blocks(x, config)
    gb = None if g is None else g.reshape(xb.shape)
    if qparams is not None:  # static qparams (IntxFakeQuantizer's own scale / zero_point, set or initialised)
        if isinstance(config, Float8FakeQuantizeConfig):
            raise OperandError("float8's quantizer takes no scale (it computes it from each block)", operand="scale")
        s, z = (xp.asarray(np.asarray(a, _F32)) for a in qparams)
        if s.size != xb.shape[0] or z.size != xb.shape[0]:
            raise OperandError(f"has {s.size} values, the quantizer's blocks are {xb.shape[0]} (torchao's scale "
                               f"shape {list(scale_shape)})", operand="scale")
        y, s, z, inside, grads = _intx(xb, gb, config, xp, (s.reshape(-1, 1), z.reshape(-1, 1)))
    else:
        fn = _float8 if isinstance(config, Float8FakeQuantizeConfig) else _intx
        y, s, z, inside, grads = fn(xb, gb, config, xp)
    res = TorchaoResult(config=config, outputs=y.reshape(x.shape), scale=s.reshape(scale_shape),
                        zero_point=None if z is None else z.reshape(scale_shape), inside=inside.reshape(x.shape),
                        blocks=tuple(xb.shape))
    if grads is not None:
        dx, ste, sp = grads
        res.backprops_wrt_input = dx.reshape(x.shape)
        res.straight_through = ste.reshape(x.shape)
        res.scale_path = sp.reshape(x.shape)
        with np.errstate(all="ignore"):
            res.rounding = (dx.astype(np.float64) - ste.astype(np.float64) - sp).reshape(x.shape)
    return res


def intx_fake_quantize(inputs, config):
    """torchao's ``IntxFakeQuantizer(config)(inputs)`` (dynamic qparams): a :class:`TorchaoResult`
    (``outputs``, ``scale``, ``zero_point``).

    >>> import numpy as np
    >>> c = intx_fake_quantize_config("int4", "per-group:4")
    >>> intx_fake_quantize(np.array([[0.1, -0.5, 1.5, 0.2]], np.float32), c).outputs
    array([[ 0. , -0.4,  1.4,  0.2]], dtype=float32)
    """
    return _run(inputs, config)


def intx_fake_quantize_gradient(gradients, inputs, config):
    """torchao's ``IntxFakeQuantizer`` forward and autograd input gradient: a :class:`TorchaoResult` with
    ``backprops_wrt_input`` (and its straight-through / scale-path / rounding split)."""
    return _run(inputs, config, gradients)


def float8_fake_quantize(inputs, config):
    """torchao's ``Float8FakeQuantizer(config)(inputs)``: a :class:`TorchaoResult` (``outputs``, ``scale``)."""
    return _run(inputs, config)


def float8_fake_quantize_gradient(gradients, inputs, config):
    """torchao's ``Float8FakeQuantizer`` forward and full autograd input gradient (scale path included)."""
    return _run(inputs, config, gradients)


def fake_quantize(inputs, config, gradients=None, qparams=None):
    """Either quantizer, by the type of ``config``; with ``gradients`` also the input gradient; ``qparams``:
    the integer quantizer's ``(scale, zero_point)`` (torchao's shapes) instead of those of the data, as an
    ``IntxFakeQuantizer`` whose ``scale`` / ``zero_point`` are set (static, or range learning) uses them."""
    return _run(inputs, config, gradients, qparams)


def block_statistics(result, xp=None):
    """Per block (float64 arrays of length blocks): elements clipped, |dy| mass, the mass of the
    straight-through, scale-path and rounding parts of the gradient, the gradient mass the mask blocks."""
    xp = xp or array_module(result.inside)
    nb, length = result.blocks
    inside = result.inside.reshape(nb, length)
    out = {"elements": length, "clipped": (~inside).sum(axis=1).astype(np.float64)}
    if result.backprops_wrt_input is not None:
        def mass(a):
            a = xp.abs(xp.asarray(a).reshape(nb, length).astype(np.float64))
            return xp.where(xp.isfinite(a), a, 0.0).sum(axis=1)

        dy = result.straight_through.reshape(nb, length)  # dy where inside, else 0
        out["straight_through"] = mass(dy)
        out["scale_path"] = mass(result.scale_path)
        out["rounding"] = mass(result.rounding)
        out["dx"] = mass(result.backprops_wrt_input)
    return out
