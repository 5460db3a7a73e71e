"""Storing fp32 values into 8-bit block codes so that a decoded state comes back unchanged.

:func:`~zerokern.quant.maps.quantize_blockwise` (what every fused kernel does after its update)
is not a left inverse of :func:`~zerokern.quant.maps.dequantize_blockwise`: a block whose
largest magnitude is a negative element ``-a`` encodes it with the signed map's lowest code,
about ``-0.99296875``, and decodes it to ``-0.99296875 * a``. Quantizing that decoded block again
takes ``0.99296875 * a`` as the new absmax, every code of the block is read against the smaller
scale, and each round trip through fp32 (``full_state_dict`` then ``load_state_dict``, or
``opt.state[p]["exp_avg"]`` written back) shrinks the block a little more. With a subnormal
absmax, two codes can also decode to the same value, which the nearest-code rule may not pick
back.

:func:`requantize_blockwise` is the quantizer of every path that stores fp32 moments into an
int8 state from outside the step (state dicts, ``opt.state``, ``edit_shards``, a checkpoint
of another format). Per block:

1. the oracle's :func:`~zerokern.quant.maps.quantize_blockwise`; kept when it decodes to the
   block's values bit for bit (every block that is not a decoded one it cannot get back, and
   so every value a step could compute: the kernels' arithmetic is untouched);
2. else, when the block is a decoded one, an encoding that decodes to it exactly. The absmax
   ``a`` is the block's largest magnitude ``M`` (an element that decoded from code 1.0), or one
   of the few fp32 values with ``fl(map[0] * a) == -M`` (its largest magnitude decoded from
   the lowest code); each element takes the code the nearest-code rule gives for ``x / a``
   when that decodes to ``x``, else the lowest code whose ``fl(map[k] * a)`` is ``x``. The
   first candidate whose whole block decodes to the given values wins (smallest absmax
   first);
3. else (values no encoding reproduces: an fp32 state, or edited values) step 1's result.

So ``dequantize(requantize(dequantize(codes, absmax)))`` is ``dequantize(codes, absmax)`` bit
for bit for every block :func:`~zerokern.quant.maps.quantize_blockwise` can produce, and the
codes and absmax are the same ones, except where two absmax values one ulp apart (or two codes,
in the subnormal range) decode to the very same block: the state, as the step reads it, is the
same either way, and a second round trip changes nothing.
"""

from __future__ import annotations

import torch

from .maps import BLOCK, decision_thresholds, dequantize_blockwise, quantize_blockwise

# fp32 neighbours of the first estimate of the absmax tried in step 2: the estimate
# M / |map[0]| is correctly rounded in float64 and then once to fp32, so the true absmax is
# within 2 ulps of it; 3 leaves a margin.
_ULPS = 3


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _nearest(x: torch.Tensor, a: torch.Tensor, code: torch.Tensor,
             thresholds: torch.Tensor) -> torch.Tensor:
    """quantize_blockwise's code of each element of ``x`` (blocks x BLOCK) for absmax ``a``
    (one per block, > 0): one correctly rounded division, ties toward zero."""
    n = (x.double() / a.double()[:, None]).float().contiguous()
    below = torch.searchsorted(thresholds, n, right=False)
    at_or_below = torch.searchsorted(thresholds, n, right=True)
    return torch.where(n < 0, at_or_below, below)


def _encode_with(x: torch.Tensor, a: torch.Tensor, code: torch.Tensor,
                 thresholds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes of ``x`` (blocks x BLOCK) for absmax ``a`` (one per block, > 0, finite) that
    decode to ``x`` where some code does, and whether the whole block does."""
    idx = _nearest(x, a, code, thresholds)
    table = code[None, :] * a[:, None]  # fl(map[k] * a): non-decreasing in k since a > 0
    exact = _bits(table.gather(1, idx)) == _bits(x)
    # The lowest code whose decoded value is x (in the subnormal range several can be).
    first = torch.searchsorted(table.contiguous(), x.contiguous()).clamp_(max=code.numel() - 1)
    idx = torch.where(exact, idx, first)
    ok = (_bits(table.gather(1, idx)) == _bits(x)).all(dim=1)
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
        ``(codes, absmax)`` as :func:`~zerokern.quant.maps.quantize_blockwise` returns them:
        its result for every block it reproduces exactly or that no encoding reproduces, an
        encoding decoding to the block's values exactly otherwise.

    Raises:
        TypeError: ``x`` is not fp32.
        ValueError: a malformed ``code`` or ``block``.
    """
    codes, absmax = quantize_blockwise(x, code, block)
    flat = x.detach().reshape(-1)
    numel = flat.numel()
    if numel == 0:
        return codes, absmax
    nblocks = absmax.numel()
    # Zero padding decodes exactly under any absmax, so it never decides a block.
    blocks = torch.nn.functional.pad(flat, (0, nblocks * block - numel)).view(nblocks, block)
    back = dequantize_blockwise(codes.reshape(-1), absmax, code, block)
    back = torch.nn.functional.pad(back, (0, nblocks * block - numel)).view(nblocks, block)
    redo = ~(_bits(back) == _bits(blocks)).all(dim=1) & torch.isfinite(absmax)
    if not bool(redo.any()):
        return codes, absmax
    rows = redo.nonzero().squeeze(1)
    xb = blocks[rows]
    mag = absmax[rows]  # the largest magnitude M, > 0 (an all-zero block decodes exactly)
    thresholds = decision_thresholds(code).to(x.device)
    lo = code[0]
    # Candidates in increasing order: M itself, then (signed map only) the fp32 values
    # around M / |map[0]|, the absmax of a block whose largest magnitude decoded from map[0].
    cands = [mag]
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
    out_abs = mag.clone()
    done = torch.zeros_like(mag, dtype=torch.bool)
    for j, a in enumerate(cands):
        # Step 2's candidates: M, or an absmax whose lowest code decodes to -M.
        usable = ~done & torch.isfinite(a) & (a > 0)
        if j > 0:
            usable &= _bits(lo * a) == _bits(-mag)
        sel = usable.nonzero().squeeze(1)
        if sel.numel() == 0:
            continue
        idx, ok = _encode_with(xb[sel], a[sel], code, thresholds)
        take = sel[ok]
        out_idx[take] = idx[ok]
        out_abs[take] = a[take]
        done[take] = True
    if not bool(done.any()):
        return codes, absmax
    fixed = rows[done]
    flat_codes = torch.nn.functional.pad(codes.reshape(-1), (0, nblocks * block - numel))
    flat_codes = flat_codes.view(nblocks, block)
    flat_codes[fixed] = out_idx[done].to(torch.uint8)
    absmax = absmax.clone()
    absmax[fixed] = out_abs[done]
    return flat_codes.reshape(-1)[:numel].reshape(x.shape), absmax
