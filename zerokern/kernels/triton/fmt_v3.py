"""Format version 3 of the 8-bit moments (``zerokern.quant.fmt_v3``: computed maps) as Triton
functions, for the compressed AdamW kernel (``adamw_compressed.py``, its ``V3`` constexpr).

Both directions are integer operations on fp32 bit patterns, exact by construction on the
GPU and under the interpreter alike: a code's map value is the pattern ``(q + bias) << 20``
(negated for the signed map's negative codes: a negation flips the sign bit only), and a
normalised value's code is its magnitude's pattern plus half a step, shifted right by 20,
re-biased and clamped, in uint32 so that adding half a step cannot overflow even for a NaN
pattern. No table is read.
"""

from __future__ import annotations

import triton
import triton.language as tl

from zerokern.quant import fmt_v3

SIGNED_BIAS = tl.constexpr(fmt_v3.SIGNED_BIAS)
UNSIGNED_BIAS = tl.constexpr(fmt_v3.UNSIGNED_BIAS)


@triton.jit
def dequantize_v3(codes, absmax, SIGNED: tl.constexpr):
    """fp32 ``map_v3[c] * absmax`` per element, the map value built from the code's bits
    (zerokern.quant.fmt_v3: magnitude q is the fp32 pattern (q + bias) << 20, q = 0 is 0)."""
    c = codes.to(tl.int32)
    if SIGNED:
        k = c - 128
        q = tl.abs(k)
        mag = tl.where(q == 0, 0, (q + SIGNED_BIAS) << 20).to(tl.float32, bitcast=True)
        value = tl.where(k < 0, -mag, mag)  # a negation flips the sign bit only
    else:
        value = tl.where(c == 0, 0, (c + UNSIGNED_BIAS) << 20).to(tl.float32, bitcast=True)
    return value * absmax


@triton.jit
def quantize_v3(x, scale, SIGNED: tl.constexpr):
    """Version 3's code of each element of x under its block's absmax (per element): the
    normalisation of version 2 (n = x * fl(1 / d) when 2**-126 <= d < 2**126, else x / d;
    d = the absmax, 1 for 0), then the pattern of |n| rounded at bit 20 (half a step added,
    ties away from zero), re-biased and clamped; NaN n takes the zero code."""
    d = tl.where(scale == 0.0, 1.0, scale)  # >= 0 or NaN
    fast = (d >= 1.1754943508222875e-38) & (d < 8.507059173023462e37)
    r = tl.div_rn(tl.full(d.shape, 1.0, tl.float32), d)
    n = tl.where(fast, x * r, tl.div_rn(x, d))
    u = n.to(tl.uint32, bitcast=True)
    # uint32: |n|'s pattern plus half a step stays below 2**32 even for a NaN pattern
    e = (((u & 0x7FFFFFFF) + 0x80000) >> 20).to(tl.int32)
    neg = (u >> 31) != 0
    nan = n != n
    if SIGNED:
        q = tl.minimum(tl.maximum(e - SIGNED_BIAS, 0), 127)
        code = tl.where(nan, 128, tl.where(neg, 128 - q, 128 + q))
    else:
        q = tl.minimum(tl.maximum(e - UNSIGNED_BIAS, 0), 255)
        code = tl.where(nan | neg, 0, q)  # -0.0 and negative values: code 0
    return code.to(tl.uint8)
