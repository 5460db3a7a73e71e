"""Block-wise int8 / int4 quantization of communicated tensors, as Triton kernels.

They implement the format of ``zerokern.quant.comm_codec`` (read its module docstring first)
and equal its torch oracle bit for bit: the same payload bytes from ``quantize``, the same
values from ``dequantize`` (with or without the fp32 reduce over segments).

Layout: program ``(i, seg)`` handles blocks ``[i * ROWS, (i + 1) * ROWS)`` of segment ``seg``
as a ``[ROWS, BLOCK]`` tile (``ROWS * BLOCK = TILE`` elements, or one block when the block is
larger), so a block's absmax is a ``tl.max`` over axis 1. 4-bit codes pair element ``2j``
with ``2j + 1``: the tile is then two ``[ROWS, BLOCK / 2]`` halves, the even and the odd
elements, and each byte is written once. The reduce launches one program per tile of blocks
and loops over the segments in order, accumulating in fp32.

Why each exact step is written as it is:

* **Absmax.** The max of the finite magnitudes (a max is exact); a block holding any inf or
  NaN gets the scale NaN instead (``tl.max`` on the GPU drops NaN, so it is tested lane by
  lane), and its codes are zeroed before rounding.
* **Divisions.** ``tl.div_rn`` (IEEE, round to nearest even): ``s = a / L`` and ``x / s``.
* **Rounding to an integer.** After clamping to ``[-L, L]``, ``(t + 1.5 * 2**23) - 1.5 *
  2**23``: the sum lies where fp32 values are integers, so the add rounds ``t`` to the nearest
  integer, ties to even (torch.round's rule), and the subtraction is exact. Compiled with fp
  fusion off (``COMPILE_OPTIONS``), so neither this nor the reduce's multiply and add is
  contracted into an fma behind our back.
* **NaN bits.** The GPU's arithmetic and conversions give another NaN than the oracle's, so
  every NaN written is the canonical one of its dtype (``0x7FC00000``, ``0x7FC0`` bf16,
  ``0x7E00`` fp16), set explicitly.
* **Interpreter.** Under ``TRITON_INTERPRET=1`` (``SOFT_FP``) bf16 loads and the fp32 ->
  bf16 rounding use the exact emulations of ``adamw_compressed.py`` / ``adamw.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zerokern.quant.comm_codec import LEVELS, code_nbytes, num_blocks, payload_nbytes

from . import check_interpreter
from .adamw import _round_lp
from .adamw_compressed import _widen

TILE = 4096  # elements per program (ROWS blocks), unless one block is larger
NUM_WARPS = 8
# Launch options; the compile tests use the same. fp fusion off: the reduce's q * s and the
# add into the fp32 sum must round separately, as in the oracle.
COMPILE_OPTIONS = dict(num_warps=NUM_WARPS, enable_fp_fusion=False)
_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23
FLT_MAX = tl.constexpr(3.4028234663852886e38)
_NAN_BITS = {torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}


@triton.jit
def _quant_rows(x, mask):
    """Per row (block) of the fp32 tile x: (bad [ROWS], finite absmax [ROWS])."""
    bad = ((x != x) | (tl.abs(x) == float("inf"))) & mask
    mag = tl.where(bad, 0.0, tl.abs(x))
    return tl.max(bad.to(tl.int32), axis=1) > 0, tl.max(mag, axis=1)


@triton.jit
def _codes(x, div, bad, L: tl.constexpr):
    """int32 codes of the tile x under its rows' divisors (zero in a bad row)."""
    t = tl.div_rn(x, div[:, None])
    t = tl.where(bad[:, None], 0.0, t)
    t = tl.minimum(tl.maximum(t, -L), L)
    return ((t + _MAGIC) - _MAGIC).to(tl.int32)


@triton.jit
def quantize_kernel(
    x_ptr, scales_ptr, codes_ptr, n, nb, seg_bytes,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr, L: tl.constexpr,
    USE_INT64: tl.constexpr, SOFT_FP: tl.constexpr,
):
    pid = tl.program_id(0)
    seg = tl.program_id(1)
    rows = pid * ROWS + tl.arange(0, ROWS)
    if USE_INT64:
        seg, rows = seg.to(tl.int64), rows.to(tl.int64)
        n, seg_bytes = n.to(tl.int64), seg_bytes.to(tl.int64)
    x_base = seg * n
    c_base = seg * seg_bytes + 4 * nb  # the codes follow the segment's nb scales
    if BITS == 8:
        elem = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = elem < n
        x = _widen(tl.load(x_ptr + x_base + elem, mask=mask, other=0.0), SOFT_FP)
        bad, a = _quant_rows(x, mask)
    else:
        pair = rows[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
        m0 = 2 * pair < n
        m1 = 2 * pair + 1 < n
        x0 = _widen(tl.load(x_ptr + x_base + 2 * pair, mask=m0, other=0.0), SOFT_FP)
        x1 = _widen(tl.load(x_ptr + x_base + 2 * pair + 1, mask=m1, other=0.0), SOFT_FP)
        bad0, a0 = _quant_rows(x0, m0)
        bad1, a1 = _quant_rows(x1, m1)
        bad = bad0 | bad1
        a = tl.maximum(a0, a1)
    s = tl.div_rn(a, tl.full(a.shape, L, tl.float32))
    qnan = tl.full(a.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    s = tl.where(bad, qnan, s)
    div = tl.where(bad | (s == 0.0), 1.0, s)
    tl.store(scales_ptr + seg * (seg_bytes // 4) + rows, s, mask=rows < nb)
    if BITS == 8:
        q = _codes(x, div, bad, L)
        tl.store(codes_ptr + c_base + elem, (q & 0xFF).to(tl.uint8), mask=mask)
    else:
        q0 = _codes(x0, div, bad, L)
        q1 = _codes(x1, div, bad, L)
        byte = (q0 & 0xF) | ((q1 & 0xF) << 4)
        tl.store(codes_ptr + c_base + pair, byte.to(tl.uint8), mask=m0)


@triton.jit
def _deq(scales_ptr, codes_ptr, seg, rows, cols, n, nb, seg_bytes, BLOCK: tl.constexpr,
         BITS: tl.constexpr):
    """fp32 values of segment seg's tile: (y0, y1) = (elements, unused) for 8 bits, (even,
    odd elements) for 4 bits; NaN (canonical) in a block whose scale is NaN."""
    s = tl.load(scales_ptr + seg * (seg_bytes // 4) + rows, mask=rows < nb, other=0.0)[:, None]
    c_base = seg * seg_bytes + 4 * nb
    qnan = tl.full(s.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    if BITS == 8:
        elem = rows[:, None] * BLOCK + cols[None, :]
        v = tl.load(codes_ptr + c_base + elem, mask=elem < n, other=0)
        y0 = v.to(tl.int8, bitcast=True).to(tl.float32) * s
        y1 = y0
    else:
        pair = rows[:, None] * (BLOCK // 2) + cols[None, :]
        v = tl.load(codes_ptr + c_base + pair, mask=2 * pair < n, other=0).to(tl.int32)
        y0 = (((v & 0xF) ^ 8) - 8).to(tl.float32) * s
        y1 = ((((v >> 4) & 0xF) ^ 8) - 8).to(tl.float32) * s
    # Saturate (a finite block stays finite: q * s may round past FLT_MAX), then the NaN of
    # a non-finite block (the GPU's min/max would drop it, so it is set after).
    y0 = tl.minimum(tl.maximum(y0, -FLT_MAX), FLT_MAX)
    y1 = tl.minimum(tl.maximum(y1, -FLT_MAX), FLT_MAX)
    return tl.where(s != s, qnan, y0), tl.where(s != s, qnan, y1)


@triton.jit
def _store_out(out_ptr, offs, y, mask, NAN_BITS: tl.constexpr, SOFT_FP: tl.constexpr):
    """y (fp32) into out's dtype, rounded to nearest even; NaN as the dtype's canonical NaN."""
    if out_ptr.dtype.element_ty == tl.float32:
        tl.store(out_ptr + offs, y, mask=mask)
    else:
        low = _round_lp(y, out_ptr.dtype.element_ty, SOFT_FP)
        nan = tl.full(y.shape, NAN_BITS, tl.int16).to(out_ptr.dtype.element_ty, bitcast=True)
        tl.store(out_ptr + offs, tl.where(y != y, nan, low), mask=mask)


@triton.jit
def dequantize_kernel(
    scales_ptr, codes_ptr, out_ptr, n, nb, seg_bytes, segments,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr, REDUCE: tl.constexpr,
    NAN_BITS: tl.constexpr, USE_INT64: tl.constexpr, SOFT_FP: tl.constexpr,
):
    pid = tl.program_id(0)
    seg = tl.program_id(1)
    rows = pid * ROWS + tl.arange(0, ROWS)
    if USE_INT64:
        seg, rows = seg.to(tl.int64), rows.to(tl.int64)
        n, seg_bytes = n.to(tl.int64), seg_bytes.to(tl.int64)
    cols = tl.arange(0, BLOCK if BITS == 8 else BLOCK // 2)
    y0, y1 = _deq(scales_ptr, codes_ptr, seg, rows, cols, n, nb, seg_bytes, BLOCK, BITS)
    if REDUCE:
        # Segment order, one fp32 add each (the oracle's ((y_0 + y_1) + y_2) + ...).
        for k in range(1, segments):
            z0, z1 = _deq(scales_ptr, codes_ptr, k, rows, cols, n, nb, seg_bytes, BLOCK, BITS)
            y0 += z0
            y1 += z1
        qnan = tl.full(y0.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
        y0 = tl.where(y0 != y0, qnan, y0)
        y1 = tl.where(y1 != y1, qnan, y1)
        base = 0
    else:
        base = seg * n
    if BITS == 8:
        elem = rows[:, None] * BLOCK + cols[None, :]
        _store_out(out_ptr, base + elem, y0, elem < n, NAN_BITS, SOFT_FP)
    else:
        e0 = 2 * (rows[:, None] * (BLOCK // 2) + cols[None, :])
        _store_out(out_ptr, base + e0, y0, e0 < n, NAN_BITS, SOFT_FP)
        _store_out(out_ptr, base + e0 + 1, y1, e0 + 1 < n, NAN_BITS, SOFT_FP)


# Under TRITON_INTERPRET=1 (read when triton.jit runs) the decorator returns an
# InterpretedFunction; the kernels then use the exact emulations (SOFT_FP).
_INTERPRETED = type(quantize_kernel).__name__ == "InterpretedFunction"


def _geometry(n: int, segments: int, bits: int, block: int) -> dict:
    nb = num_blocks(n, block)
    rows = max(1, TILE // block)
    seg_bytes = payload_nbytes(n, bits, block)
    # Offsets reach the tensors' ends plus one tile of masked lanes.
    big = max(segments * n, segments * seg_bytes) + 2 * rows * block >= 2**31
    return dict(nb=nb, rows=rows, seg_bytes=seg_bytes, use_int64=big,
                grid=triton.cdiv(nb, rows))


def quantize_triton_(x: torch.Tensor, payload: torch.Tensor, segments: int, bits: int,
                     block: int) -> None:
    """Write the payloads of ``segments`` segments of flat ``x`` into ``payload`` (uint8), as
    ``zerokern.quant.comm_codec.quantize`` does (the op has checked the arguments)."""
    check_interpreter()
    n = x.numel() // segments if segments else 0
    if n == 0:
        return
    g = _geometry(n, segments, bits, block)
    pad = -code_nbytes(n, bits) % 4
    if pad:  # the kernel writes the scales and the codes, not the zero bytes after them
        payload.view(segments, g["seg_bytes"])[:, g["seg_bytes"] - pad:].zero_()
    scales = payload.view(torch.float32)
    quantize_kernel[(g["grid"], segments)](
        x, scales, payload, n, g["nb"], g["seg_bytes"],
        BLOCK=block, ROWS=g["rows"], BITS=bits, L=LEVELS[bits], USE_INT64=g["use_int64"],
        SOFT_FP=_INTERPRETED, **COMPILE_OPTIONS,
    )


def dequantize_triton_(payload: torch.Tensor, out: torch.Tensor, segments: int, bits: int,
                       block: int, reduce: bool) -> None:
    """Decode ``segments`` payloads into ``out`` (their concatenation, or with ``reduce``
    their fp32 sum), as ``zerokern.quant.comm_codec.dequantize`` does."""
    check_interpreter()
    n = out.numel() if reduce else (out.numel() // segments if segments else 0)
    if n == 0:
        return
    if reduce and segments == 0:
        out.zero_()
        return
    g = _geometry(n, segments, bits, block)
    scales = payload.view(torch.float32)
    dequantize_kernel[(g["grid"], 1 if reduce else segments)](
        scales, payload, out, n, g["nb"], g["seg_bytes"], segments,
        BLOCK=block, ROWS=g["rows"], BITS=bits, REDUCE=reduce,
        NAN_BITS=_NAN_BITS.get(out.dtype, 0), USE_INT64=g["use_int64"],
        SOFT_FP=_INTERPRETED, **COMPILE_OPTIONS,
    )


__all__ = ["LEVELS", "dequantize_triton_", "quantize_triton_"]
