"""Block-wise 8-bit quantization, format version 3: computed maps, the oracle every kernel that
runs version 3 equals bit for bit.

Version 2 (``zerokern.quant.blockwise``) keeps the dynamic maps of bitsandbytes: 256 values
with no closed form, so a kernel decodes a code by a table lookup and encodes a value by a
search (or a 256 KiB table of lookup words). On a CPU without gathers those lookups, four per
element, cost more than the whole fp32 AdamW update (issue 39). Version 3 changes the maps so
that both directions are a few integer operations on bit patterns:

**The maps.** A magnitude ``q`` means the fp32 whose pattern is ``(q + bias) << 20``: 3
mantissa bits, ``q`` counting up through the exponents, so consecutive magnitudes are the
fp32 values with 3 mantissa bits (an "e4m3"/"e5m3" float without subnormals, re-biased so
that the top magnitude is exactly 1.0); ``q = 0`` is 0.

* signed map (``exp_avg``): code ``c`` in 0..255, ``k = c - 128``, value
  ``sign(k) * mag(|k|)`` with ``bias = 889``: ``mag(127) = 1.0``, ``mag(1) = 1.25 * 2**-16``
  (16 binades). Code 0 (``k = -128``) is ``-1.125``; it is never produced (``|n| <= 1``) but
  decodes like the others, so the map stays strictly increasing.
* unsigned map (``exp_avg_sq``): code ``c`` is the magnitude, ``bias = 761``:
  ``mag(255) = 1.0``, ``mag(1) = 1.25 * 2**-32`` (32 binades).

**Quantize** a block of ``x`` (fp32, blocks of 256 consecutive elements of the flattened
tensor, the last one partial):

1. ``s = max |x_i|`` (NaN-propagating; both maps hold ``+-1``, so no signed scale is needed).
2. ``n_i``: version 2's normalisation with ``d = s`` (``1`` for ``s = 0``): ``x_i * fl(1/d)``
   when ``2**-126 <= d < 2**126``, else ``x_i / d`` (``blockwise.normalise``).
3. With ``u`` the pattern of ``n`` and ``a = u & 0x7FFFFFFF``: signed map
   ``q = clamp(((a + 2**19) >> 20) - 889, 0, 127)``, code ``128 + q`` (``128 - q`` when the
   sign bit is set); unsigned map ``q = clamp(((a + 2**19) >> 20) - 761, 0, 255)``, code
   ``q``, and code 0 when the sign bit is set (``-0.0``, or a negative value: never one of
   ``exp_avg_sq``). A NaN ``n`` takes the zero code (128, 0). Adding half a step to the
   pattern and truncating rounds to the nearest map value, ties away from zero (inside a
   binade the values are evenly spaced, and a carry out of the mantissa lands on the next
   binade's first value); below ``mag(1)`` the magnitude truncates to 0.

**Dequantize**: ``y_i = fl(map[c_i] * s)``, the same one multiply as versions 1 and 2
(``zerokern.quant.maps.dequantize_blockwise`` with :func:`code_map_v3`).

**The update** of a version-3 step is the contract's fp32 AdamW with the bias correction of
``exp_avg_sq`` folded into the step size and eps (``kernel_contract.fold_bias_correction``):
``p - (step_size * bc2_sqrt) * m / (sqrt(v) + eps * bc2_sqrt)``, AdamW's update in exact
arithmetic with the two products rounded once on the host. It drops one of the two IEEE
divisions per element, which with the square root bound the CPU step (issue 39); versions 1
and 2 keep ``sqrt(v) / bc2_sqrt + eps``, as torch does.

**Error bound** (tested in float64 against the exact nearest map value). The half-step around
``|n| >= 2**E`` is at most ``2**(E-4) <= |n| / 16``; below ``mag(1)`` the error is at most
``mag(1)``; the reciprocal, the product and the decoding multiply add ``2**-21 |x|`` and
``2**-149``: ``|y_i - x_i| <= |x_i| / 16 + |s| * mag(1) + 2**-21 |x_i| + 2**-149``. Version 2's
dynamic maps are finer near the block's absmax (0.7% half-step at ``|n| = 1``, 7% at 0.1)
and coarser below (14% at 0.01, 28% at 0.001); version 3 is 3.1-6.25% everywhere down to
``2**-16`` (signed) or ``2**-32`` (unsigned) of the absmax.

**Re-encoding is exact** for blocks whose decoded values are zero or normal: the scale
element decodes to ``1.0 * s = s``, every other ``|y| <= s``, so the scale comes back, and
each ``n`` is its map value up to ``3 * 2**-24`` relative, far inside its rounding interval.
"""

from __future__ import annotations

import torch

from .blockwise import normalise
from .maps import BLOCK, _check_block

FORMAT_VERSION = 3
"""The encoding version this module implements."""

SIGNED_MAP_ID_V3 = "computed-signed-v3"
"""Id of version 3's signed map (``exp_avg``)."""

UNSIGNED_MAP_ID_V3 = "computed-unsigned-v3"
"""Id of version 3's unsigned map (``exp_avg_sq``)."""

SIGNED_BIAS = 889
"""Signed map: magnitude ``q`` is the fp32 pattern ``(q + 889) << 20`` (``q = 127``: 1.0)."""

UNSIGNED_BIAS = 761
"""Unsigned map: code ``q`` is the fp32 pattern ``(q + 761) << 20`` (``q = 255``: 1.0)."""

_HALF = 1 << 19  # half a step of the 3 mantissa bits kept (bit 20 up)
_MAPS: dict[tuple[bool, torch.device], torch.Tensor] = {}


def _mag_bits(q: torch.Tensor, bias: int) -> torch.Tensor:
    """int64 fp32 patterns of magnitudes ``q`` (0 -> +0.0)."""
    return torch.where(q == 0, torch.zeros_like(q), (q + bias) << 20)


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    # int64 patterns in [0, 2**32) -> the fp32 values (through int32's two's complement).
    signed = torch.where(bits >= 2**31, bits - 2**32, bits)
    return signed.to(torch.int32).view(torch.float32)


def code_map_v3(signed: bool, device: torch.device | str | None = None) -> torch.Tensor:
    """Version 3's map as a table: 256 strictly increasing fp32 values, code ``c`` means
    ``map[c]`` (module docstring).

    Args:
        signed: the signed map (``exp_avg``) or the unsigned one (``exp_avg_sq``).
        device: where to put the tensor (default CPU).

    Returns:
        An fp32 tensor of 256 values (cached per device; do not modify it).
    """
    dev = torch.device(device if device is not None else "cpu")
    key = (bool(signed), dev)
    t = _MAPS.get(key)
    if t is None:
        c = torch.arange(256, dtype=torch.int64)
        if signed:
            k = c - 128
            bits = _mag_bits(k.abs(), SIGNED_BIAS) | torch.where(k < 0, 2**31, 0)
        else:
            bits = _mag_bits(c, UNSIGNED_BIAS)
        t = _MAPS[key] = _from_bits(bits).to(dev)
    return t


def codes_v3(n: torch.Tensor, signed: bool) -> torch.Tensor:
    """Version 3's code of each normalised fp32 value ``n`` (step 3 of the module
    docstring), as int64."""
    u = n.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    neg = u >= 2**31
    a = u & 0x7FFFFFFF
    if signed:
        q = (((a + _HALF) >> 20) - SIGNED_BIAS).clamp(0, 127)
        code = 128 + torch.where(neg, -q, q)
        zero = 128
    else:
        q = (((a + _HALF) >> 20) - UNSIGNED_BIAS).clamp(0, 255)
        code = torch.where(neg, torch.zeros_like(q), q)
        zero = 0
    return torch.where(torch.isnan(n), torch.full_like(code, zero), code)


def quantize_blockwise_v3(
    x: torch.Tensor, signed: bool, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize one parameter's fp32 elements to version 3 codes with one absmax per block.

    Args:
        x: fp32 tensor of any shape; blocks run over it flattened, the last one partial.
        signed: the signed map (``exp_avg``) or the unsigned one (``exp_avg_sq``).
        block: elements per block (default 256).

    Returns:
        ``(codes, absmax)``: uint8 codes shaped like ``x`` and one fp32 absmax per block.
        Decode with ``maps.dequantize_blockwise(codes, absmax, code_map_v3(signed))``.

    Raises:
        TypeError: ``x`` is not fp32.
        ValueError: a malformed ``block``.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"x must be fp32, got {x.dtype}")
    _check_block(block)
    flat = x.detach().reshape(-1)
    numel = flat.numel()
    nblocks = -(-numel // block)
    padded = torch.zeros(nblocks * block, dtype=torch.float32, device=x.device)
    padded[:numel] = flat
    blocks = padded.view(nblocks, block)
    absmax = blocks.abs().amax(dim=1) if numel else flat.new_empty(0)
    n = normalise(blocks, absmax[:, None])
    codes = codes_v3(n, signed).to(torch.uint8).reshape(-1)[:numel].reshape(x.shape)
    return codes, absmax
