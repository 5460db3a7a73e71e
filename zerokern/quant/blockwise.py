"""Block-wise 8-bit quantization, format version 2: the oracle every kernel equals bit for bit.

Version 2 keeps version 1's code maps (``zerokern.quant.maps``: the same 256 values, the same
255 decision thresholds, the same decoding ``y = fl(code[c] * scale)``) and changes how a block
is encoded, so that a kernel spends one division per block instead of one per element, and so
that decoding then re-encoding a block gives its codes and scale back:

1. **Signed scale.** ``A = max |x_i|`` over the block (NaN-propagating). The stored scale is
   ``s = +A``, or ``s = -A`` when ``A > 0`` and every element of magnitude ``A`` is negative
   (NaN: ``s`` is that NaN). So the element that sets the scale always normalises to ``+1``,
   which both maps hold (the signed map has no ``-1``: with version 1's ``+A`` a block whose
   largest element is negative decoded to a smaller absmax, and re-encoding it moved codes).
2. **Reciprocal.** The divisor is ``d = s`` (``1`` when ``s`` is zero). When
   ``2**-126 <= |d| < 2**126``: ``r = fl(1 / d)`` (one IEEE division per block) and
   ``n_i = fl(x_i * r)``, one multiply per element (what bitsandbytes' kernels do). Otherwise
   (subnormal, huge, inf or NaN scales, where ``1 / d`` would leave the normal range)
   ``n_i = fl(x_i / d)``, the correctly rounded division of version 1.
3. **Code** of ``n``: version 1's threshold rule, ``#{t_k < n}`` for ``n >= 0``,
   ``#{t_k <= n}`` for ``n < 0``, NaN -> code 0 (ties toward zero).

**Error bound** (tested in float64). With ``v = x_i / s`` exact and ``h`` the half-step of the
map around ``v``: the reciprocal and the product move ``n`` by at most ``(2**-23 + 2**-48)|v|``,
the rounded thresholds add at most ``2**-24``, the decoding multiply ``2**-24 |s|`` (``2**-150``
below the normal range): ``|y_i - x_i| <= |s| * (h + 2**-21) + 2**-149``. Version 1's bound had
``2**-22``; the extra ``2**-22 |s|`` is 30 times smaller than the finest half-step of either
map (about ``1.6e-7`` at the bottom of the unsigned map).

**Re-encoding is exact** for a block whose decoded values are zero or normal fp32 numbers
(``|code[c] * s| >= 2**-126``): decoding gives the scale element back exactly (``1 * s``) and
every other ``|y_i| <= |s|``, so the scale is the same; each ``n_i`` is then ``code[c_i]`` up
to ``3 * 2**-24`` relative, far inside the code's own decision interval. Blocks whose decoded
values fall below the normal range lose bits in fp32 and may re-encode differently; NaN and
inf blocks are not round-trips either.

Everything else is version 1's: zeros decode to exact zeros, ``-0.0`` takes the zero code,
negative values on the unsigned map take code 0 unless the whole block is negative (then the
scale is negative and they are encoded by magnitude), a NaN makes its block NaN.
"""

from __future__ import annotations

import torch

from .maps import BLOCK, _check_block, _check_code, decision_thresholds

FORMAT_VERSION = 2
"""The encoding version this module implements (checkpoints name it through their map ids)."""

_F32, _F64 = torch.float32, torch.float64
RECIP_LO = 2.0**-126
"""Smallest ``|d|`` encoded with a reciprocal: ``1 / d`` stays a normal fp32 below 2**126."""
RECIP_HI = 2.0**126
"""``|d|`` from here up is divided: ``1 / d`` would be subnormal."""


def block_scales(blocks: torch.Tensor) -> torch.Tensor:
    """The signed scale of each row of ``blocks`` (``[nblocks, block]`` fp32, rows padded
    with zeros): ``+A``, or ``-A`` when every element of magnitude ``A > 0`` is negative."""
    amax = blocks.abs().amax(dim=1)  # NaN-propagating, like the kernels' maximum of patterns
    has_pos = (blocks == amax[:, None]).any(dim=1)  # -0 == +0: an all-zero block is +0
    return torch.where(torch.isnan(amax) | has_pos, amax, -amax)


def normalise(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``n = x * fl(1 / d)`` or ``x / d`` per element (steps 2 of the module docstring).

    Args:
        x: fp32 values, any shape.
        scale: fp32 signed scale of each element's block, broadcast against ``x``.

    Returns:
        fp32 ``n``; each operation correctly rounded (computed in float64, whose 53 bits make
        the second rounding to fp32 harmless for one +, *, / of fp32 operands).
    """
    d = torch.where(scale == 0, torch.ones_like(scale), scale).to(_F64)
    ad = d.abs()
    fast = (ad >= RECIP_LO) & (ad < RECIP_HI)
    r = (1.0 / d).to(_F32).to(_F64)
    x64 = x.to(_F64)
    return torch.where(fast, x64 * r, x64 / d).to(_F32)


def codes_of(n: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Version 1's threshold rule: the int64 code of each ``n`` (NaN -> 0)."""
    thresholds = decision_thresholds(code)
    n = n.contiguous()
    below = torch.searchsorted(thresholds, n, right=False)  # #{t_k < n}
    at_or_below = torch.searchsorted(thresholds, n, right=True)  # #{t_k <= n}
    index = torch.where(n < 0, at_or_below, below)  # ties toward zero
    return torch.where(torch.isnan(n), torch.zeros_like(index), index)


def quantize_blockwise_v2(
    x: torch.Tensor, code: torch.Tensor, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize one parameter's fp32 elements to 8-bit codes with one signed scale per block
    (format version 2, module docstring). Decode with ``maps.dequantize_blockwise``.

    Args:
        x: fp32 tensor of any shape; blocks run over it flattened, the last one partial.
        code: the map, 256 strictly increasing fp32 values on ``x``'s device.
        block: elements per block (default 256).

    Returns:
        ``(codes, scale)``: uint8 codes shaped like ``x`` and one fp32 signed scale per block.

    Raises:
        TypeError: ``x`` is not fp32.
        ValueError: a malformed ``code`` or ``block``, or ``code`` on another device.
    """
    if x.dtype != _F32:
        raise TypeError(f"x must be fp32, got {x.dtype}")
    _check_code(code)
    _check_block(block)
    if code.device != x.device:
        raise ValueError(f"code is on {code.device}, x on {x.device}")
    flat = x.reshape(-1)
    numel = flat.numel()
    nblocks = -(-numel // block)
    padded = torch.zeros(nblocks * block, dtype=_F32, device=x.device)
    padded[:numel] = flat
    blocks = padded.view(nblocks, block)
    scale = block_scales(blocks)
    n = normalise(blocks, scale[:, None])
    codes = codes_of(n, code).to(torch.uint8).reshape(-1)[:numel].reshape(x.shape)
    return codes, scale
