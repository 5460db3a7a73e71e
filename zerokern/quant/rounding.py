"""Stochastic rounding fp32 -> bf16: the oracle of ``master="none"``'s parameter write.

A bf16 value is the top 16 bits of an fp32 bit pattern. Adding a uniform 16-bit random
integer r to the fp32 pattern's low 16 bits and truncating rounds the magnitude up (away from
zero) exactly when low16 + r >= 2**16, i.e. with probability low16 / 2**16, which is x's
distance from the lower neighbour in units of the gap between the two neighbours. The
expected result is therefore x itself: the rounding error is zero-mean. This holds across a
binade boundary (a carry out of the mantissa raises the exponent, which is the next bf16
value) and for subnormals (same exponent field as fp32, evenly spaced), and it is symmetric
in the sign because it acts on the magnitude.

What each input gives (the rules every backend must match bit for bit):

* Values representable in bf16 (low 16 bits zero, +-0, +-inf and subnormals included) come
  back unchanged, whatever the bits: r < 2**16 cannot carry.
* Negative values round their magnitude like positive ones; the sign is kept (-0 stays -0).
* Subnormals are rounded on their bit pattern like any other value: nothing is flushed to
  zero here, so a backend must not flush fp32 subnormals (FTZ) before rounding.
* Overflow: no finite input becomes inf. A finite value above bf16's largest finite value
  (0x7F7F, about 3.39e38) has no finite upper neighbour; it saturates to +-0x7F7F, as
  truncation would, instead of carrying into the exponent of inf. (Round-to-nearest's
  ``x.to(torch.bfloat16)`` gives inf from 0x7F7F8000 up; a parameter that large is already
  lost, and saturating keeps an optimizer step from creating an inf itself.)
* NaN (any sign or payload) gives the canonical quiet NaN 0x7FC0. Truncating a NaN could
  otherwise give inf (a payload only in the low 16 bits) and the addition could carry out.

Only the low 16 bits of ``bits`` are used; ``zerokern.quant.philox.sr_bits16`` supplies them.
"""

from __future__ import annotations

import torch

_SIGN = 0x80000000
_ABS = 0x7FFFFFFF
_INF32 = 0x7F800000  # magnitude pattern of fp32 inf; above it: NaN
BF16_MAX = 0x7F7F  # bit pattern of the largest finite bf16
BF16_NAN = 0x7FC0  # the NaN every backend writes


def stochastic_round_bf16(x: torch.Tensor, bits: torch.Tensor | int) -> torch.Tensor:
    """Round each element of ``x`` to one of its two neighbouring bf16 values, the upper one
    (in magnitude) with probability proportional to the distance from the lower one.

    Args:
        x: float32 tensor.
        bits: Integer tensor broadcastable to ``x``'s shape (or an int): the random words,
            of which the low 16 bits are used. Uniform 16-bit values make the rounding
            unbiased.

    Returns:
        bf16 tensor shaped like ``x``. Special values follow the rules in the module
        docstring: representable values unchanged, finite values never become inf, NaN
        becomes 0x7FC0.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"x must be float32, got {x.dtype}")
    bits = torch.as_tensor(bits, device=x.device)
    if bits.dtype.is_floating_point or bits.dtype.is_complex or bits.dtype == torch.bool:
        raise TypeError(f"bits must be integer, got {bits.dtype}")
    r = torch.broadcast_to(bits.to(torch.int64) & 0xFFFF, x.shape)
    u = x.view(torch.int32).to(torch.int64)
    sign = (u & _SIGN) >> 16
    mag = u & _ABS
    out = (mag + r) >> 16  # the magnitude's bf16 pattern, rounded up when the low bits carry
    # Finite inputs saturate at the largest finite bf16; an inf input (low bits 0) is exact.
    out = torch.where(mag < _INF32, out.clamp(max=BF16_MAX), out) | sign
    out = torch.where(mag > _INF32, BF16_NAN, out)
    # uint16 pattern -> int16 with the same bits, then reinterpreted as bf16
    out = out - ((out & 0x8000) << 1)
    return out.to(torch.int16).view(torch.bfloat16)
