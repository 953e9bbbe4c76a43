"""Bit-level float32 <-> small float conversions shared by the MX, NVFP4 and ONNX ops (NumPy or CuPy).

:func:`f32_to_floatx` is torchao 0.18's ``_f32_to_floatx_unpacked`` (``torchao/prototype/custom_fp_utils.py``)
operation for operation on int32 bit patterns: round to nearest, ties to even, subnormals by the float-add
trick, saturation to the largest magnitude at or above ``max_normal`` (the all-ones exponent counts as normal:
these formats have no Inf/NaN).  A NaN goes down the "normal" branch and comes out as whatever its bits give
(torchao does not special-case it); callers that need another NaN rule apply it afterwards.
:func:`floatx_to_f32_table` is ``_floatx_unpacked_to_f32`` evaluated on all 256 byte values, garbage bits
included, so that a lookup reproduces torchao even on the codes a NaN leaves behind.
"""
import numpy as np

_F32 = np.float32
_SIGN32 = np.int32(-(2**31))  # 0x80000000


def floatx_constants(ebits, mbits):
    """``(exp_bias, max_normal, min_normal)`` of an all-finite ``ebits``/``mbits`` format (torchao's)."""
    exp_bias = (1 << (ebits - 1)) - 1
    max_normal = 2.0 ** ((1 << ebits) - 1 - exp_bias) * (((1 << (mbits + 1)) - 1) / 2.0**mbits)
    return exp_bias, max_normal, 2.0 ** (1 - exp_bias)


def f32_to_floatx(v, ebits, mbits, xp=np):
    """float32 ``v`` -> uint8 codes (sign in bit ``ebits + mbits``), as torchao's ``_f32_to_floatx_unpacked``."""
    exp_bias, max_normal, min_normal = floatx_constants(ebits, mbits)
    max_int = (1 << (ebits + mbits)) - 1
    sign_mask = 1 << (ebits + mbits)
    magic_adder = (1 << (23 - mbits - 1)) - 1
    denorm_mask_int = ((127 - exp_bias) + (23 - mbits) + 1) << 23
    denorm_mask_float = np.array(denorm_mask_int, np.int32).view(_F32)
    bits = v.view(np.int32)
    sign = bits & _SIGN32
    a_bits = bits ^ sign
    a = a_bits.view(_F32)
    saturate = a >= _F32(max_normal)
    denormal = ~saturate & (a < _F32(min_normal))
    with np.errstate(over="ignore", invalid="ignore"):
        den = ((a + denorm_mask_float).view(np.int32) - np.int32(denorm_mask_int)).astype(np.uint8)
    mant_odd = (a_bits >> (23 - mbits)) & 1
    val_to_add = np.int32(((exp_bias - 127) << 23) + magic_adder)
    nor = ((a_bits + val_to_add + mant_odd) >> (23 - mbits)).astype(np.uint8)
    out = xp.where(denormal, den, xp.where(saturate, np.uint8(max_int), nor))
    sign_lp = (sign >> (23 + 8 - mbits - ebits)).astype(np.uint8) & np.uint8(sign_mask)
    return out | sign_lp


def floatx_to_f32_table(ebits, mbits):
    """float32[256]: torchao's ``_floatx_unpacked_to_f32`` of every byte (uint8 arithmetic as torch does it)."""
    x = np.arange(256, dtype=np.uint8)
    sign_mask = np.uint8(1 << (ebits + mbits))
    exp_bias = (1 << (ebits - 1)) - 1
    sign_lp = x & sign_mask
    x_pos = x ^ sign_lp
    zero = x_pos == 0
    denormal = (x_pos > 0) & ((x_pos >> mbits) == 0)
    exp_f32 = ((x_pos >> mbits) - np.uint8(exp_bias) + np.uint8(127)).astype(np.int32) << 23
    mant = (x_pos & np.uint8((1 << mbits) - 1)).astype(np.int32)
    result = exp_f32 | (mant << (23 - mbits))
    result[zero] = 0
    denormal_exp_biased = 1 - exp_bias + 127
    if mbits == 1:
        result[denormal] = (denormal_exp_biased - mbits) << 23
    else:
        for i in range(mbits):
            for cmp in range(1 << i, 1 << (i + 1)):
                left = mbits - i
                value = ((denormal_exp_biased - left) << 23) + ((cmp - (1 << i)) << (left + 23 - mbits))
                mant[mant == cmp] = value
        result = np.where(denormal, mant, result)
    result = result | (sign_lp.astype(np.int32) << (23 - mbits + 8 - ebits))
    return result.view(_F32)


def float8_codes(v, fmt, xp=np):
    """float32 ``v`` already clamped to the format's range (NaN allowed) -> float8 bytes, as torch 2.13's
    ``.to(float8_e4m3fn / float8_e5m2)``: nearest, ties to even; NaN -> 0x7F with the NaN's sign bit."""
    ebits, mbits = (4, 3) if fmt == "float8_e4m3fn" else (5, 2)
    codes = f32_to_floatx(v, ebits, mbits, xp)
    sign = (v.view(np.int32) < 0).astype(np.uint8) << 7
    return xp.where(xp.isnan(v), np.uint8(0x7F) | sign, codes)


def float8_table(fmt):
    """float32[256]: the value of every float8 byte as torch (c10) converts it, NaN bit patterns included
    (e4m3fn 0x7F -> 0x7FF00000; e5m2 goes through float16: NaN mantissa m -> 0x7F800000 | m << 21)."""
    import ml_dtypes

    codes = np.arange(256, dtype=np.uint8)
    table = codes.view(getattr(ml_dtypes, fmt)).astype(_F32)
    bits = table.view(np.uint32)
    sign = (codes.astype(np.uint32) & 0x80) << 24
    if fmt == "float8_e4m3fn":
        nan = (codes & 0x7F) == 0x7F
        bits[nan] = sign[nan] | np.uint32(0x7FF00000)
    else:
        nan = ((codes & 0x7C) == 0x7C) & ((codes & 0x3) != 0)
        bits[nan] = sign[nan] | np.uint32(0x7F800000) | ((codes[nan].astype(np.uint32) & 0x3) << 21)
    return table


#: the NaN torch's vectorised max/amax reductions return (``max | unordered-mask``: all bits set)
NAN_ALL_ONES = np.array(-1, np.int32).view(_F32)


def nan_as_torch_max(a, xp=np):
    """``a`` (a reduction's result) with its NaNs replaced by torch's all-ones NaN: its bits reach the codes."""
    return xp.where(xp.isnan(a), NAN_ALL_ONES, a)


def times_scale(x, r, xp=np):
    """``x * r`` (``r`` broadcast per block) with torch's NaN choice: where both are NaN torch's kernel returns
    ``r``'s NaN (whose bits then reach the element codes); plain IEEE multiplication elsewhere."""
    v = x * r
    nan_r = xp.isnan(r)
    if bool(nan_r.any()):
        v = xp.where(nan_r, r, v)
    return v


#: (ebits, mbits) -> the ml_dtypes type whose cast equals :func:`f32_to_floatx` on every non-NaN float32
#: (checked on all float32 patterns in [2^-40, 2^20) and 60 million random ones; fp8 on values within +-F)
_ML_NAMES = {(4, 3): "float8_e4m3fn", (5, 2): "float8_e5m2", (2, 3): "float6_e2m3fn", (3, 2): "float6_e3m2fn",
             (2, 1): "float4_e2m1fn"}


def fast_codes(v, ebits, mbits):
    """:func:`f32_to_floatx` of a NumPy ``v`` with no NaN (fp8: within the format's finite range) through
    ml_dtypes' C cast, one pass; None where this ml_dtypes lacks the type."""
    import ml_dtypes

    t = getattr(ml_dtypes, _ML_NAMES[(ebits, mbits)], None)
    if t is None:
        return None
    return v.astype(t).view(np.uint8)  # ml_dtypes' casts set no floating-point flags, warn about nothing
