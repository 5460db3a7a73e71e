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
2. else, when the block is a decoded one, an encoding that decodes to it exactly. The scale is
   version 2's signed scale ``s`` (a version 2 block's largest magnitude decoded from code
   ``+1``: ``1 * s``, exact) or, for the signed map, one of the few fp32 values ``a`` with
   ``fl(map[0] * a) == -|s|`` (a version 1 block, loaded as stored from a version 1 checkpoint,
   whose largest magnitude decoded from the lowest code); each element takes version 2's code
   for that scale when it decodes to the element, else the code of lowest magnitude whose
   ``fl(map[k] * scale)`` is the element. The first candidate whose whole block decodes to the
   given values wins;
3. else (values no encoding reproduces: an fp32 state, or edited values) step 1's result.

So ``dequantize(requantize(dequantize(codes, scale)))`` is ``dequantize(codes, scale)`` bit
for bit for every block version 1 or 2 can produce, and a second round trip changes nothing.
The codes and scale are the same for a version 2 block of normal values; a version 1 block may
come back with other codes or scale that decode to the very same values (the state, as the step
reads it, is the same).
"""

from __future__ import annotations

import torch

from .blockwise import codes_of, normalise, quantize_blockwise_v2
from .maps import BLOCK, dequantize_blockwise

# fp32 neighbours of the first estimate of a version 1 absmax tried in step 2: the estimate
# M / |map[0]| is correctly rounded in float64 and then once to fp32, so the true absmax is
# within 2 ulps of it; 3 leaves a margin.
_ULPS = 3


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
    xb = blocks[rows]
    sr = scale[rows]
    mag = sr.abs()
    # Candidates in order: version 2's signed scale, then (signed map only) the fp32 values
    # around M / |map[0]|, the absmax of a version 1 block (a checkpoint of version 1 is
    # loaded as stored) whose largest magnitude M decoded from the lowest code.
    cands = [sr]
    lo = code[0]
    if float(lo) < 0:
        est = (mag.double() / -lo.double()).float()
        up = torch.full_like(est, float("inf"))
        down = torch.zeros_like(est)
        for _ in range(_ULPS):
            est = torch.nextafter(est, down)
        for _ in range(2 * _ULPS + 1):
            cands.append(est)
            est = torch.nextafter(est, up)
    out_idx = torch.zeros_like(xb, dtype=torch.int64)
    out_scale = sr.clone()
    done = torch.zeros_like(sr, dtype=torch.bool)
    for j, a in enumerate(cands):
        usable = ~done & torch.isfinite(a) & (a != 0)
        if j > 0:
            usable &= _bits(lo * a) == _bits(-mag)
        sel = usable.nonzero().squeeze(1)
        if sel.numel() == 0:
            continue
        guess = codes_of(normalise(xb[sel], a[sel][:, None]), code)
        idx, ok = _exact_codes(xb[sel], guess, a[sel], code)
        take = sel[ok]
        out_idx[take] = idx[ok]
        out_scale[take] = a[take]
        done[take] = True
    if not bool(done.any()):
        return codes, scale
    fixed = rows[done]
    flat_codes = torch.nn.functional.pad(codes.reshape(-1), (0, pad)).view(nblocks, block)
    flat_codes = flat_codes.clone()
    flat_codes[fixed] = out_idx[done].to(torch.uint8)
    scale = scale.clone()
    scale[fixed] = out_scale[done]
    return flat_codes.reshape(-1)[:numel].reshape(x.shape), scale
