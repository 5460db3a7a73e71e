"""Storing fp32 values into 8-bit block codes so that a decoded state comes back unchanged.

Format version 2's :func:`~zerokern.quant.blockwise.quantize_blockwise_v2` (what every fused
kernel does after its update) gives a decoded block its own codes and scale back whenever the
decoded values are zero or normal fp32 numbers: the signed scale puts the scale element on code
``+1``, which decodes to the scale exactly. Below the normal range two codes can decode to the
same fp32 value, and the reciprocal's code need not be the one that was stored, so a round trip
(``full_state_dict`` then ``load_state_dict``, or ``opt.state[p]["exp_avg"]`` written back)
could still move a block.

:func:`requantize_blockwise` is the quantizer of every path that stores fp32 moments into an
int8 state from outside the step (state dicts, ``opt.state``, ``edit_shards``, a checkpoint
of another format). Per block:

1. :func:`~zerokern.quant.blockwise.quantize_blockwise_v2`; kept when it decodes to the
   block's values bit for bit (every block that is not a decoded one it cannot get back, and
   so every value a step could compute: the kernels' arithmetic is untouched);
2. else, with the same signed scale ``s`` (a decoded block's largest magnitude is ``1 * s``,
   exact), each element takes version 2's code when that decodes to it, else the code of
   lowest magnitude whose ``fl(map[k] * s)`` is the element; kept when the whole block then
   decodes to its values;
3. else (values no encoding with that scale reproduces: an fp32 state, or edited values)
   step 1's result.

So ``dequantize(requantize(dequantize(codes, scale)))`` is ``dequantize(codes, scale)`` bit
for bit for every block version 2 can produce, and a second round trip changes nothing.
"""

from __future__ import annotations

import torch

from .blockwise import quantize_blockwise_v2
from .maps import BLOCK, dequantize_blockwise


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _exact_codes(x: torch.Tensor, idx: torch.Tensor, s: torch.Tensor,
                 code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of ``x`` (blocks x BLOCK) for the signed scales ``s`` (one per block, finite,
    nonzero) that decode to ``x`` where some code does (``idx``, version 2's codes, where they
    already do), and whether the whole block does."""
    # fl(map[k] * s) = sign(s) * fl(map[k] * |s|): encode sign(s) * x against |s|, whose table
    # is non-decreasing in k.
    sign = torch.where(s < 0, -1.0, 1.0).to(x.dtype)[:, None]
    xs = x * sign
    table = code[None, :] * s.abs()[:, None]
    exact = _bits(table.gather(1, idx)) == _bits(xs)
    first = torch.searchsorted(table.contiguous(), xs.contiguous()).clamp_(max=code.numel() - 1)
    idx = torch.where(exact, idx, first)
    ok = (_bits(table.gather(1, idx)) == _bits(xs)).all(dim=1)
    return idx, ok


def requantize_blockwise(
    x: torch.Tensor, code: torch.Tensor, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize fp32 values that may be a decoded int8 state, so that a decoded block comes
    back as it was (the module docstring says how and what is guaranteed).

    Args:
        x: fp32 tensor of any shape.
        code: the map, 256 strictly increasing fp32 values on ``x``'s device.
        block: elements per block.

    Returns:
        ``(codes, scale)`` as :func:`~zerokern.quant.blockwise.quantize_blockwise_v2` returns
        them: its result for every block it reproduces exactly or that no encoding with its
        scale reproduces, an encoding decoding to the block's values exactly otherwise.

    Raises:
        TypeError: ``x`` is not fp32.
        ValueError: a malformed ``code`` or ``block``.
    """
    codes, scale = quantize_blockwise_v2(x, code, block)
    flat = x.detach().reshape(-1)
    numel = flat.numel()
    if numel == 0:
        return codes, scale
    nblocks = scale.numel()
    pad = nblocks * block - numel
    # Zero padding decodes exactly under any scale, so it never decides a block.
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(nblocks, block)
    back = dequantize_blockwise(codes.reshape(-1), scale, code, block)
    back = torch.nn.functional.pad(back, (0, pad)).view(nblocks, block)
    redo = ~(_bits(back) == _bits(blocks)).all(dim=1) & torch.isfinite(scale) & (scale != 0)
    if not bool(redo.any()):
        return codes, scale
    rows = redo.nonzero().squeeze(1)
    flat_codes = torch.nn.functional.pad(codes.reshape(-1), (0, pad)).view(nblocks, block)
    idx, ok = _exact_codes(blocks[rows], flat_codes[rows].to(torch.int64), scale[rows], code)
    if not bool(ok.any()):
        return codes, scale
    flat_codes = flat_codes.clone()
    flat_codes[rows[ok]] = idx[ok].to(torch.uint8)
    return flat_codes.reshape(-1)[:numel].reshape(x.shape), scale
