"""Symmetric block-wise int8 / int4 codes of communicated tensors (ZeRO++'s qwZ and qgZ): the
format, its pure-PyTorch oracle and its error bound.

Every backend of ``zerokern.ops.quantize_blocks_`` / ``dequantize_blocks_`` (the ``torch``
backend is this module; the Triton kernel in ``zerokern/kernels/triton/comm_quant.py``) must
produce the same bytes and the same values as the functions below, bit for bit.

**Blocks.** A segment of ``n`` elements (a rank's shard, or the chunk bound for one rank) is cut
into blocks of ``block`` consecutive elements counted from the segment's start; the last block
is partial when ``block`` does not divide ``n``. Blocks never straddle segments, so a rank
quantizes its shard without knowing anyone else's. ``block`` is a power of two in
[``MIN_BLOCK``, ``MAX_BLOCK``]; the default, 256, keeps one outlier from coarsening more than
256 neighbours (a flat bucket packs tensors of very different magnitudes side by side), costs
4/256 byte of scale per element (1.6% of an int8 payload) and is the block of the int8 Adam
moments (``zerokern.quant.maps.BLOCK``). The quantized collectives take int4 in blocks of 32
(:data:`WIRE_BLOCK`: 7 levels a side are too coarse for 256 gradients under one scale).

**Quantize** (``L`` = 127 for 8 bits, 7 for 4 bits; ``x`` widened to fp32, exact for bf16 and
fp16), per block, each step rounded to nearest even, nothing flushed to zero:

1. ``a = max |x_i|`` over the block (exact).
2. ``s = fl(a / L)``, one IEEE division: the block's fp32 scale.
3. ``t_i = fl(x_i / s)``, one IEEE division (divisor 1 when ``s == 0``: an all-zero block, or
   ``a <= L * 2**-150`` whose scale underflows), clamped to ``[-L, L]``.
4. ``q_i = round_half_even(t_i)``, an integer in ``[-L, L]``.

**Non-finite blocks.** A block holding an inf or a NaN gets the scale NaN (``0x7FC00000``) and
all-zero codes, and decodes to NaN everywhere (the canonical NaN of the output dtype), so the
engine's overflow check (a non-finite gradient norm) still trips after a quantized reduce.
Other blocks are unaffected.

**Dequantize**: ``y_i = fl(q_i * s)``, one fp32 multiply (NaN where ``s`` is NaN), saturated
to ``[-FLT_MAX, FLT_MAX]`` (the product exceeds fp32's largest value only when ``a`` is within
``2**-23`` of it and ``s`` was rounded up: a finite block decodes to finite values), then
rounded to nearest even into the output dtype. A reduce sums the segments' fp32 ``y`` in
segment order (``((y_0 + y_1) + y_2) + ...``, each add rounded in fp32; never in 8 or 4 bits)
and rounds the sum once into the output dtype. Every NaN written is the canonical NaN of the
output dtype (:data:`NAN_BITS`). ``-0.0`` and values below half a step decode to ``+0.0``.

**Bytes.** One segment's payload is ``scales | codes | pad``: ``ceil(n / block)`` fp32 scales
(little-endian, as the tensor's memory holds them), then the codes, one int8 (two's complement)
per element for 8 bits, or two 4-bit two's complement codes per byte for 4 bits (element ``2j``
in the low nibble, ``2j + 1`` in the high one, a zero high nibble after an odd ``n``), then zero
bytes up to a multiple of 4, so that every segment's scales start 4-byte aligned when segments
are laid end to end (:func:`payload_nbytes`).

**Error bound.** With ``u = 2**-24`` and ``eta = 2**-149`` (the smallest subnormal), every
element of a block of absmax ``a`` satisfies

    |y_i - x_i| <= a / (2 L) + 2**-22 * a + (L + 1) / 2 * eta      (:func:`error_bound`).

Proof. If ``|t| <= L``: ``|q - t| <= 1/2``; ``|t - x/s| <= u |x/s|`` when ``x/s`` is normal
(otherwise ``|x/s| < 2**-126``, ``q = 0`` and the error ``|x| < s/2``), so ``|q s - x| <= s/2 +
u |x|``, with ``s/2 <= a/(2L) (1 + u)`` (normal ``s``) or ``a/(2L) + eta/4`` (subnormal ``s``).
If ``t > L`` (only an ``s`` rounded down): ``x/s > L``, ``q = L`` and ``0 < x - L s <= a - L
s``, which is at most ``u a`` (normal ``s``) or ``L eta / 2`` (subnormal ``s``: ``|s - a/L| <=
eta/2``); likewise for ``t < -L``. When ``s = 0`` the codes are 0 and ``|x| <= a <= L eta /
2``. The multiply adds at most ``u |q s| <= u a (1 + u)`` or ``eta/2``; the saturation only
moves ``y`` towards ``x`` (``|x| <= FLT_MAX``). Altogether the relative slack is ``(2 + 1/(2L))
u + O(u**2) < 4u = 2**-22`` and the absolute slack at most ``(L + 1) eta / 2``. For 8 bits that
is ``a/254`` up to a relative ``2**-22 * 254 < 7e-5`` of it (plus ``64 * 2**-149``, below
``1e-43``).
"""

from __future__ import annotations

import math

import torch

DEFAULT_BLOCK = 256
"""Elements per quantization block by default (see the module docstring for why)."""

WIRE_BLOCK = {8: DEFAULT_BLOCK, 4: 32}
"""The block the quantized collectives (``zerokern.comm.quantized``, the engine's quantized
parts, ``zerokern.formulas``) use by code width when none is given: 256 for int8; 32 for
int4, whose 7 levels a side leave every element below ``absmax / 14`` of its block at zero, so
a 256-element block (one outlier among them) zeroed most small gradients: measured on the demo
GPT, int4 with 256-element blocks ended 1.4-1.6% above 16-bit communication in loss (error
feedback did not help), with 32 within 0.2% (docs/quantized-comm.md, Convergence). Its cost:
4/32 byte of scale per element, 5 bits an element on the wire instead of 4.125."""

MIN_BLOCK, MAX_BLOCK = 16, 8192
"""The block sizes the kernels take: powers of two in this range."""

BITS = (8, 4)
"""The code widths: int8 codes in [-127, 127], int4 codes in [-7, 7]."""

LEVELS = {8: 127, 4: 7}
"""``L``, the largest code magnitude, by code width."""

FLT_MAX = torch.finfo(torch.float32).max


def check_format(bits: object, block: object) -> tuple[int, int]:
    """``(bits, block)`` validated.

    Args:
        bits: 8 or 4.
        block: a power of two in [MIN_BLOCK, MAX_BLOCK].

    Returns:
        ``(bits, block)``.

    Raises:
        ValueError: naming the argument that is off.
    """
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    if (isinstance(block, bool) or not isinstance(block, int) or block & (block - 1)
            or not MIN_BLOCK <= block <= MAX_BLOCK):
        raise ValueError(f"block must be a power of two in [{MIN_BLOCK}, {MAX_BLOCK}], "
                         f"got {block!r}")
    return int(bits), block


def wire_block(bits: int, block: int | None = None) -> int:
    """``block``, or the quantized collectives' default for ``bits`` (:data:`WIRE_BLOCK`)
    when it is None.

    Args:
        bits: 8 or 4.
        block: elements per block, or None.

    Returns:
        The block.

    Raises:
        ValueError: ``bits`` is not 8 or 4.
    """
    if block is not None:
        return block
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits must be 8 or 4, got {bits!r}")
    return WIRE_BLOCK[bits]


def num_blocks(n: int, block: int) -> int:
    """Blocks of a segment of ``n`` elements (the last one partial when block does not
    divide n)."""
    return -(-n // block)


def code_nbytes(n: int, bits: int) -> int:
    """Bytes of the codes of ``n`` elements: n for 8 bits, ceil(n / 2) for 4 bits."""
    return n if bits == 8 else (n + 1) // 2


def payload_nbytes(n: int, bits: int = 8, block: int = DEFAULT_BLOCK) -> int:
    """Bytes of one segment's payload: 4 per block (the fp32 scales), then the codes padded
    with zero bytes to a multiple of 4."""
    codes = code_nbytes(n, bits)
    return 4 * num_blocks(n, block) + codes + (-codes % 4)


def _blocks(x: torch.Tensor, segments: int, block: int) -> tuple[torch.Tensor, int]:
    """``x`` as fp32 ``[segments, blocks, block]``, each segment zero-padded to whole blocks."""
    n = x.numel() // segments
    nb = num_blocks(n, block)
    xs = x.reshape(segments, n).to(torch.float32)
    xs = torch.nn.functional.pad(xs, (0, nb * block - n))
    return xs.reshape(segments, nb, block), n


def quantize(x: torch.Tensor, segments: int = 1, bits: int = 8,
             block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """The payloads of ``segments`` equal segments of flat ``x`` (fp32, bf16 or fp16), laid
    end to end: a uint8 tensor of ``segments * payload_nbytes(n, bits, block)`` bytes.

    Args:
        x: 1-D floating tensor of ``segments * n`` elements.
        segments: how many equal segments ``x`` holds (blocks restart at each).
        bits: 8 or 4.
        block: elements per block.

    Returns:
        uint8 tensor on ``x``'s device.
    """
    bits, block = check_format(bits, block)
    lv = LEVELS[bits]
    xs, n = _blocks(x, segments, block)
    finite = torch.isfinite(xs)
    bad = ~finite.all(dim=-1)  # [segments, blocks]
    a = torch.where(finite, xs.abs(), 0.0).amax(dim=-1)
    # A tensor divisor: torch may turn a division by a Python scalar into a reciprocal multiply.
    s = a / torch.full_like(a, float(lv))
    s = torch.where(bad, torch.full_like(s, math.nan), s)
    div = torch.where(bad | (s == 0), torch.ones_like(s), s)
    t = (xs / div.unsqueeze(-1)).clamp(-lv, lv)
    t = torch.where(bad.unsqueeze(-1), torch.zeros_like(t), t)
    q = torch.round(t).to(torch.int32).reshape(segments, -1)[:, :n]  # round half to even
    if bits == 8:
        codes = q.to(torch.int8).view(torch.uint8)
    else:
        q = torch.nn.functional.pad(q, (0, n % 2))
        codes = ((q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)).to(torch.uint8)
    codes = torch.nn.functional.pad(codes, (0, -codes.shape[1] % 4))
    scales = s.contiguous().view(torch.uint8).reshape(segments, -1)
    return torch.cat([scales, codes], dim=1).reshape(-1)


def split_payload(payload: torch.Tensor, n: int, segments: int, bits: int,
                  block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts of ``segments`` payloads.

    Args:
        payload: uint8 tensor of ``segments * payload_nbytes(n, bits, block)`` bytes.
        n: elements per segment.
        segments: how many payloads ``payload`` holds.
        bits: 8 or 4.
        block: elements per block.

    Returns:
        (fp32 scales ``[segments, blocks]``, the codes as int32 ``[segments, n]``).
    """
    bits, block = check_format(bits, block)
    nb = num_blocks(n, block)
    rows = payload.reshape(segments, payload_nbytes(n, bits, block))
    scales = rows[:, : 4 * nb].contiguous()
    # (an empty [segments, 0] byte tensor cannot be viewed as fp32)
    scales = scales.view(torch.float32) if nb else scales.to(torch.float32)
    raw = rows[:, 4 * nb: 4 * nb + code_nbytes(n, bits)]
    if bits == 8:
        codes = raw.view(torch.int8).to(torch.int32)
    else:
        v = raw.to(torch.int32)
        # Sign-extend each nibble: (v ^ 8) - 8 maps 0..7 to itself and 8..15 to -8..-1.
        lo, hi = ((v & 0xF) ^ 8) - 8, ((v >> 4) ^ 8) - 8
        codes = torch.stack([lo, hi], dim=-1).reshape(segments, -1)[:, :n]
    return scales, codes


def dequantize(payload: torch.Tensor, n: int, segments: int = 1, bits: int = 8,
               block: int = DEFAULT_BLOCK, *, reduce: bool = False,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of ``segments`` payloads of ``n`` elements each: ``segments * n`` values, or
    with ``reduce`` their fp32 sum in segment order (``n`` values), in ``dtype``.

    Args:
        payload: uint8 tensor of ``segments * payload_nbytes(n, bits, block)`` bytes.
        n: elements per segment.
        segments: how many payloads ``payload`` holds.
        bits: 8 or 4, as they were quantized.
        block: elements per block, as they were quantized.
        reduce: sum the segments (in fp32, in order) instead of concatenating them.
        dtype: the output's dtype (rounded to nearest even from fp32).

    Returns:
        1-D tensor on ``payload``'s device.
    """
    scales, codes = split_payload(payload, n, segments, bits, block)
    per_elem = scales.repeat_interleave(block, dim=1)[:, :n]
    # NaN where the scale is NaN; a finite block stays finite (see "Dequantize").
    y = (codes.to(torch.float32) * per_elem).clamp(-FLT_MAX, FLT_MAX)
    if reduce:
        acc = y[0].clone() if segments else y.new_zeros(n)
        for i in range(1, segments):
            acc = acc + y[i]
        y = acc
    return to_dtype(y.reshape(-1), dtype)


NAN_BITS = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}
"""The NaN every backend writes, by output dtype (the GPU's arithmetic and torch's own
conversions give other bit patterns, e.g. 0xFFFF for bf16 from torch 2.14 on CPU)."""


def to_dtype(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``y`` rounded to nearest even into ``dtype``, every NaN written as
    ``NAN_BITS[dtype]``.

    Args:
        y: fp32 tensor.
        dtype: torch.float32, torch.bfloat16 or torch.float16.

    Returns:
        A new tensor of ``dtype``.
    """
    out = y.to(dtype)
    ints = {4: torch.int32, 2: torch.int16}[out.element_size()]
    nan = torch.tensor(NAN_BITS[dtype], dtype=torch.int64).to(ints).view(dtype)
    return torch.where(torch.isnan(y), nan.to(y.device), out)


def error_bound(absmax: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """The bound on ``|dequantize(quantize(x)) - x|`` of each element of a block whose absmax
    is ``absmax``, in float64 (see the module docstring's proof).

    Args:
        absmax: the blocks' absmax values (any float dtype).
        bits: 8 or 4.

    Returns:
        float64 tensor, ``a / (2L) + 2**-22 a + (L + 1) / 2 * 2**-149``.
    """
    lv = LEVELS[check_format(bits, DEFAULT_BLOCK)[0]]
    a = absmax.to(torch.float64)
    return a / (2 * lv) + a * 2.0**-22 + (lv + 1) / 2 * 2.0**-149


def block_absmax(x: torch.Tensor, segments: int = 1, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """``max |x|`` of each element's block: the ``absmax`` its :func:`error_bound` is
    taken at.

    Args:
        x: 1-D floating tensor of ``segments * n`` elements.
        segments: how many equal segments ``x`` holds (blocks restart at each).
        block: elements per block.

    Returns:
        float64 tensor shaped like ``x`` (NaN in a block holding NaN).
    """
    _, block = check_format(8, block)
    xs, n = _blocks(x, segments, block)
    a = xs.abs().amax(dim=-1, keepdim=True)
    return a.expand_as(xs).reshape(segments, -1)[:, :n].reshape(-1).to(torch.float64)
