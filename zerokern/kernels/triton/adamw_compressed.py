"""Fused AdamW step over a flat range with compressed optimizer state, as a Triton kernel.

It implements the range contract of ``zerokern.ops.adamw_compressed`` (read its module
docstring first) and equals its torch oracle, ``adamw_compressed_torch_``, bit for bit:

* moments fp32 (in place), bf16 (widened exactly, stored rounded to nearest even) or uint8
  codes with one fp32 scale per 256-element block (``zerokern.quant.maps``): dequantize
  ``code[c] * scale``, update, then requantize with format version 2
  (``zerokern.quant.blockwise``: the block's signed scale, one reciprocal per block), or with
  format version 3 (the ``V3`` constexpr, ``zerokern.quant.fmt_v3``: the map value built
  from the code's bits, the absmax as scale, the code from the normalised value's bits; no
  table is read);
* the fp32 update of the kernel contract (three explicit fma, the rest rounded op by op,
  IEEE sqrt/div), shared with the fp32 kernel in ``adamw.py``; bf16 moments and version 3
  take the folded scalars (``kernel_contract.folds_bias_correction``) and skip the division
  by ``bc2_sqrt`` (the ``FOLDED`` constexpr of ``adamw_update``);
* the parameter: an fp32 master (``param_lp`` optionally receives it rounded to nearest even)
  or a bf16 parameter written with ``stochastic_round_bf16`` of ``zerokern.quant.rounding``
  using 16 bits of ``tl.randint4x(seed, (step << 32) | (index // 8))`` with a 64-bit offset
  (``zerokern.quant.philox.sr_bits16``; [Note: stochastic-rounding keys] there).

Layout: one program per tile of ``ROWS`` quantization blocks, held as one flat tensor of
``ROWS * 256`` elements; the block absmax reshapes it to ``[ROWS, 256]`` for a ``tl.max`` over
axis 1, and per-block values (absmax, ``sr_index``) are loaded per element (a broadcast load).
Flat, every memory access has the same order, so Triton 3.6 and 3.8 both give the table gathers
the layout of the contiguous accesses (with a 2-D tile Triton 3.6 orders the gathers the other
way and converts the state through shared memory). Full tiles take an unmasked path (vector
accesses); only the last tile is masked.

Why each exact step is written as it is:

* **Scale.** torch's ``amax`` propagates NaN, Triton's ``tl.max`` on the GPU does not
  (``max.f32`` returns the other operand). So the kernel takes the max over the non-NaN
  magnitudes and sets the block's scale to NaN when any lane of the block is NaN. A max is
  exact, so the non-NaN result equals torch's. (The NaN's payload is not specified: a NaN
  compares by position, like every NaN the fp32 arithmetic produces.) The sign: a second
  max over the lanes that equal ``+A``.
* **Normalisation.** ``n = x * r`` with ``r = tl.div_rn(1, d)`` (one IEEE division; fp fusion
  is off, so the product rounds on its own), or ``tl.div_rn(x, d)`` outside
  ``[2**-126, 2**126)``; ``d`` is the scale, 1 for an all-zero block.
* **Version 3's codes** (``fmt_v3.py``): integer operations on fp32 bit patterns both ways,
  exact on the GPU and in the interpreter alike; the scale is the NaN-propagating absmax.
* **Code search.** ``code = #{t_k < n}`` for ``n >= 0`` and ``#{t_k <= n}`` for ``n < 0``,
  over the 256-entry threshold table padded with +inf: a branch-free binary search of eight
  ``tl.load`` gathers (halves 128, 64, ..., 1). The predicate is monotone in ``k`` (the
  thresholds are sorted) and false at the +inf pad, so the search returns the count, in
  [0, 255]. A NaN compares false everywhere: code 0, as the oracle's NaN rule says.
* **Stochastic rounding.** Integer operations on the fp32 bit pattern (uint32), exactly the
  rules of ``zerokern.quant.rounding``: no float conversion is involved, so the GPU and the
  interpreter agree by construction.
* **Interpreter.** Under ``TRITON_INTERPRET=1`` (``SOFT_FP``) the fma and the fp32 -> bf16
  rounding are the exact emulations of ``adamw.py``, and bf16 -> fp32 is a shift of the bit
  pattern; the interpreter's own versions round differently or lose subnormals.

The 64-bit seed and the step travel as int32 bit patterns, so the kernel's argument types never
depend on their values (Triton types an int argument i32, i64 or u64 by its value) and one
compiled kernel serves every step and seed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from zerokern.kernel_contract import AdamScalars, folds_bias_correction

from . import check_interpreter
from .adamw import _round_lp, adamw_update, kernel_scalars
from .fmt_v3 import dequantize_v3, quantize_v3

QBLOCK = 256  # elements per quantization block (zerokern.quant.maps.BLOCK)
# 4 quantization blocks per program over 8 warps: 4 elements per thread, as in adamw.py, so
# every tensor (fp32, 16-bit or uint8) gets the same register layout and no access needs a
# layout conversion through shared memory (with 8 per thread the fp32 and 16-bit accesses
# differ). A row then spans two warps: the absmax reductions exchange 32 bytes of shared memory.
ROWS = 4
NUM_WARPS = 8
# Launch options; the compile tests use the same. fp fusion off: no mul + add is contracted
# into an fma behind our back; the contract's three fma are explicit.
COMPILE_OPTIONS = dict(num_warps=NUM_WARPS, enable_fp_fusion=False)

# Moment formats (the MOMENTS constexpr), by exp_avg's dtype.
MOMENTS_FP32, MOMENTS_BF16, MOMENTS_INT8 = 0, 1, 2
_MOMENTS = {torch.float32: MOMENTS_FP32, torch.bfloat16: MOMENTS_BF16, torch.uint8: MOMENTS_INT8}
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.uint8: "int8"}

# zerokern.quant.maps.kernel_tables: four 256-entry parts, at offsets 0 (signed map), 256 (its
# thresholds), 512 (unsigned map) and 768 (its thresholds); the kernel uses these literals.
TABLE_SIZE = 1024


@triton.jit
def _load(ptr, offs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptr + offs, mask=mask, other=0)
    else:
        return tl.load(ptr + offs)


@triton.jit
def _store(ptr, offs, x, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, x, mask=mask)
    else:
        tl.store(ptr + offs, x)


@triton.jit
def _widen(x, SOFT_FP: tl.constexpr):
    """A loaded fp32, bf16 or fp16 tensor as fp32 (exact)."""
    if SOFT_FP and x.dtype == tl.bfloat16:
        # The interpreter's bf16 -> fp32 conversion loses bf16 subnormals; the bit pattern
        # shifted into the top half is the exact fp32 value (what cvt.f32.bf16 does).
        wide = x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
        return wide.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def _dequantize(codes, absmax, tables_ptr, CODES_AT: tl.constexpr):
    """fp32 ``code[c] * absmax`` per element (one rounding, as dequantize_blockwise)."""
    value = tl.load(tables_ptr + CODES_AT + codes.to(tl.int32))
    return value * absmax


@triton.jit
def _block_scale(x, mask, ROWS: tl.constexpr, MASKED: tl.constexpr, V3: tl.constexpr):
    """Per block (row of 256 lanes) the signed scale of format version 2
    (zerokern.quant.blockwise.block_scales): A = max |x| over the valid lanes (NaN when any
    valid lane is NaN, as torch.amax), -A when A > 0 and no valid lane equals +A, else +A.
    Version 3 (V3) stores A itself (its maps hold +-1). Returns (per block [ROWS], per
    element [ROWS * 256])."""
    nan = x != x
    mag = tl.where(nan, 0.0, tl.abs(x))
    if MASKED:
        nan = nan & mask
        mag = tl.where(mask, mag, 0.0)  # the oracle pads a partial block with zeros
    amax = tl.max(tl.reshape(mag, (ROWS, 256)), axis=1)
    any_nan = tl.max(tl.reshape(nan.to(tl.int32), (ROWS, 256)), axis=1)
    qnan = tl.full(amax.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    if V3:
        scale = tl.where(any_nan > 0, qnan, amax)
    else:
        per = tl.reshape(tl.broadcast_to(amax[:, None], (ROWS, 256)), (ROWS * 256,))
        hit = x == per  # a lane holding +A (-0 == +0: an all-zero block counts as +0)
        if MASKED:
            hit = hit & mask
        has_pos = tl.max(tl.reshape(hit.to(tl.int32), (ROWS, 256)), axis=1)
        scale = tl.where(any_nan > 0, qnan, tl.where(has_pos > 0, amax, -amax))
    return scale, tl.reshape(tl.broadcast_to(scale[:, None], (ROWS, 256)), (ROWS * 256,))


@triton.jit
def _quantize(x, scale, tables_ptr, THRESHOLDS_AT: tl.constexpr):
    """The code of each element of x (fp32) under its block's signed scale (per element):
    n = x * fl(1 / d) when 2**-126 <= |d| < 2**126, else x / d (d = scale, 1 for 0)."""
    d = tl.where(scale == 0.0, 1.0, scale)
    ad = tl.abs(d)
    fast = (ad >= 1.1754943508222875e-38) & (ad < 8.507059173023462e37)
    r = tl.div_rn(tl.full(d.shape, 1.0, tl.float32), d)
    q = tl.where(fast, x * r, tl.div_rn(x, d))
    neg = q < 0.0
    pos = tl.zeros(x.shape, tl.int32)
    for k in tl.static_range(8):
        # Every threshold before pos satisfies the predicate; test the last one of the
        # next 128 >> k and move past them if it does too.
        t = tl.load(tables_ptr + THRESHOLDS_AT + (pos + ((128 >> k) - 1)))
        pos = tl.where((t < q) | (neg & (t == q)), pos + (128 >> k), pos)
    return pos.to(tl.uint8)


@triton.jit
def _stochastic_round_bf16(p, r):
    """zerokern.quant.rounding.stochastic_round_bf16(p, r) on the fp32 bit pattern."""
    u = p.to(tl.uint32, bitcast=True)
    mag = u & 0x7FFFFFFF
    sign = (u >> 16) & 0x8000
    low = r.to(tl.uint32, bitcast=True) & 0xFFFF
    out = (mag + low) >> 16  # < 2**16: mag + low < 2**31 + 2**16
    # Finite values saturate at the largest finite bf16 instead of carrying into inf.
    out = tl.where(mag < 0x7F800000, tl.minimum(out, 0x7F7F), out) | sign
    out = tl.where(mag > 0x7F800000, 0x7FC0, out)  # any NaN -> the canonical 0x7FC0
    return out.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _sr_bits(first, col, seed_lo_bits, seed_hi_bits, step_bits):
    """quant.philox.sr_bits16 (format version 2): element i takes half i % 2 of word
    (i // 2) % 4 of tl.randint4x(seed, (step << 32) | (i // 8)) with an int64 offset,
    i = sr_index[block] + column (first: sr_index[block] per element)."""
    index = first.to(tl.int64) + col.to(tl.int64)
    step = tl.cast(tl.cast(step_bits, tl.uint32, bitcast=True), tl.int64)
    offset = (step << 32) | (index >> 3)
    lo = tl.cast(tl.cast(seed_lo_bits, tl.uint32, bitcast=True), tl.uint64)
    hi = tl.cast(tl.cast(seed_hi_bits, tl.uint32, bitcast=True), tl.uint64)
    w0, w1, w2, w3 = tl.randint4x((hi << 32) | lo, offset)
    pick = (index >> 1) & 3
    w = tl.where(pick == 0, w0, tl.where(pick == 1, w1, tl.where(pick == 2, w2, w3)))
    w = w.to(tl.uint32, bitcast=True)
    return (w >> ((index & 1) * 16).to(tl.uint32)) & 0xFFFF


@triton.jit
def _tile(
    offs, mask, eblk, col, rblk, row_ok,
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, m_absmax_ptr, v_absmax_ptr, lp_ptr,
    sr_index_ptr, tables_ptr,
    seed_lo_bits, seed_hi_bits, step_bits,
    decay, w, neg_one_minus_w_bits, beta2, one_minus_beta2, neg_step_size_bits, bc2_sqrt, eps,
    inv_grad_scale,
    ROWS: tl.constexpr, MASKED: tl.constexpr, MOMENTS: tl.constexpr, HAS_LP: tl.constexpr,
    SR: tl.constexpr, LERP_LOW: tl.constexpr, APPLY_SCALE: tl.constexpr, SOFT_FP: tl.constexpr,
    V3: tl.constexpr,
):
    # offs, mask, eblk (the element's block) and col (its place in the block) are per element;
    # rblk and row_ok are per block (the absmax stores).
    p = _widen(_load(param_ptr, offs, mask, MASKED), SOFT_FP)
    g = _widen(_load(grad_ptr, offs, mask, MASKED), SOFT_FP)
    if MOMENTS == 2:
        m_amax = _load(m_absmax_ptr, eblk, mask, MASKED)  # each block's scale, per element
        v_amax = _load(v_absmax_ptr, eblk, mask, MASKED)
        cm = _load(exp_avg_ptr, offs, mask, MASKED)
        cv = _load(exp_avg_sq_ptr, offs, mask, MASKED)
        if V3:
            m = dequantize_v3(cm, m_amax, True)
            v = dequantize_v3(cv, v_amax, False)
        else:
            m = _dequantize(cm, m_amax, tables_ptr, 0)
            v = _dequantize(cv, v_amax, tables_ptr, 512)
    else:
        m = _widen(_load(exp_avg_ptr, offs, mask, MASKED), SOFT_FP)
        v = _widen(_load(exp_avg_sq_ptr, offs, mask, MASKED), SOFT_FP)

    # bf16 moments (MOMENTS == 1) and version 3 take the folded scalars: one division less.
    p, m, v = adamw_update(
        p, g, m, v, decay, w, neg_one_minus_w_bits, beta2, one_minus_beta2, neg_step_size_bits,
        bc2_sqrt, eps, inv_grad_scale, LERP_LOW, APPLY_SCALE, SOFT_FP, V3 or MOMENTS == 1)

    if MOMENTS == 2:
        m_rows, m_amax = _block_scale(m, mask, ROWS, MASKED, V3)
        v_rows, v_amax = _block_scale(v, mask, ROWS, MASKED, V3)
        if V3:
            cm = quantize_v3(m, m_amax, True)
            cv = quantize_v3(v, v_amax, False)
        else:
            cm = _quantize(m, m_amax, tables_ptr, 256)
            cv = _quantize(v, v_amax, tables_ptr, 768)
        _store(exp_avg_ptr, offs, cm, mask, MASKED)
        _store(exp_avg_sq_ptr, offs, cv, mask, MASKED)
        _store(m_absmax_ptr, rblk, m_rows, row_ok, MASKED)
        _store(v_absmax_ptr, rblk, v_rows, row_ok, MASKED)
    elif MOMENTS == 1:
        _store(exp_avg_ptr, offs, _round_lp(m, tl.bfloat16, SOFT_FP), mask, MASKED)
        _store(exp_avg_sq_ptr, offs, _round_lp(v, tl.bfloat16, SOFT_FP), mask, MASKED)
    else:
        _store(exp_avg_ptr, offs, m, mask, MASKED)
        _store(exp_avg_sq_ptr, offs, v, mask, MASKED)

    if SR:
        first = _load(sr_index_ptr, eblk, mask, MASKED)
        r = _sr_bits(first, col, seed_lo_bits, seed_hi_bits, step_bits)
        _store(param_ptr, offs, _stochastic_round_bf16(p, r), mask, MASKED)
    else:
        _store(param_ptr, offs, p, mask, MASKED)
        if HAS_LP:
            _store(lp_ptr, offs, _round_lp(p, lp_ptr.dtype.element_ty, SOFT_FP), mask, MASKED)


# Bit patterns change every step (and the seed per run): no int specialisation on them, or a
# value that happened to be 1 or a multiple of 16 would compile another kernel.
@triton.jit(do_not_specialize=["seed_lo_bits", "seed_hi_bits", "step_bits",
                               "neg_one_minus_w_bits", "neg_step_size_bits"])
def adamw_compressed_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, m_absmax_ptr, v_absmax_ptr, lp_ptr,
    sr_index_ptr, tables_ptr,
    n,
    seed_lo_bits, seed_hi_bits, step_bits,
    decay, w, neg_one_minus_w_bits, beta2, one_minus_beta2, neg_step_size_bits, bc2_sqrt, eps,
    inv_grad_scale,
    ROWS: tl.constexpr, MOMENTS: tl.constexpr, HAS_LP: tl.constexpr, SR: tl.constexpr,
    LERP_LOW: tl.constexpr, APPLY_SCALE: tl.constexpr, USE_INT64: tl.constexpr,
    SOFT_FP: tl.constexpr, V3: tl.constexpr,
):
    pid = tl.program_id(0)
    lane = tl.arange(0, ROWS * 256)
    rows = tl.arange(0, ROWS)
    eblk = pid * ROWS + lane // 256  # < 2**31 / 256 blocks: int32 is enough
    rblk = pid * ROWS + rows
    col = lane % 256
    if USE_INT64:
        start = pid.to(tl.int64) * (ROWS * 256)
    else:
        start = pid * (ROWS * 256)
    offs = start + lane
    if pid < n // (ROWS * 256):
        _tile(
            offs, None, eblk, col, rblk, None,
            param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, m_absmax_ptr, v_absmax_ptr,
            lp_ptr, sr_index_ptr, tables_ptr, seed_lo_bits, seed_hi_bits, step_bits,
            decay, w, neg_one_minus_w_bits, beta2, one_minus_beta2, neg_step_size_bits,
            bc2_sqrt, eps, inv_grad_scale,
            ROWS, False, MOMENTS, HAS_LP, SR, LERP_LOW, APPLY_SCALE, SOFT_FP, V3,
        )
    else:
        _tile(
            offs, offs < n, eblk, col, rblk, start + rows * 256 < n,
            param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, m_absmax_ptr, v_absmax_ptr,
            lp_ptr, sr_index_ptr, tables_ptr, seed_lo_bits, seed_hi_bits, step_bits,
            decay, w, neg_one_minus_w_bits, beta2, one_minus_beta2, neg_step_size_bits,
            bc2_sqrt, eps, inv_grad_scale,
            ROWS, True, MOMENTS, HAS_LP, SR, LERP_LOW, APPLY_SCALE, SOFT_FP, V3,
        )


# Under TRITON_INTERPRET=1 (read when triton.jit runs) the decorator returns an
# InterpretedFunction; the kernel then uses the exact emulations (SOFT_FP).
_INTERPRETED = type(adamw_compressed_kernel).__name__ == "InterpretedFunction"


def _i32_bits(x: int) -> int:
    """The int32 whose two's complement bits are the 32-bit word x (in [0, 2**32))."""
    return x - (1 << 32) if x >= 1 << 31 else x


def compressed_scalars(s: AdamScalars, seed: int, step: int) -> dict:
    """The runtime scalars and scalar-derived constexprs of one step (see adamw.py), plus the
    seed's two words and the step as int32 bit patterns."""
    k = kernel_scalars(s)
    # The lerp branch is kernel_scalars' (on the fp32-rounded w), as the oracle
    # (quant.contract.adamw_contract_) and the C++/CUDA kernels pick it.
    k["seed_lo_bits"] = _i32_bits(seed & 0xFFFFFFFF)
    k["seed_hi_bits"] = _i32_bits(seed >> 32)
    k["step_bits"] = _i32_bits(step)
    return k


def adamw_compressed_triton_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    exp_avg_absmax: torch.Tensor | None,
    exp_avg_sq_absmax: torch.Tensor | None,
    param_lp: torch.Tensor | None,
    sr_index: torch.Tensor | None,
    seed: int,
    step: int,
    tables: torch.Tensor,
    s: AdamScalars,
    *,
    rows: int = ROWS,
    format_version: int = 2,
) -> None:
    """One in-place AdamW step over a flat range with compressed state (the range contract of
    zerokern.ops.adamw_compressed; its validate_compressed_args has checked the tensors).

    Args:
        param, grad, exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax, param_lp,
            sr_index: as fused_adamw_compressed_ takes them (contiguous, one device).
        seed: the stochastic rounding seed, an int in [0, 2**64) (bf16 param only).
        step: the 1-based step, an int in [1, 2**32).
        tables: zerokern.quant.maps.kernel_tables(device), 1024 fp32 values.
        s: zerokern.kernel_contract.adam_scalars(...) of the step (bf16 moments and int8
            version 3: folded by ``fold_bias_correction``).
        rows: quantization blocks per program, a power of two (the result does not depend on
            it; the interpreter tests use more to launch fewer programs).
        format_version: the int8 encoding, 2 (``zerokern.quant.blockwise``) or 3
            (``zerokern.quant.fmt_v3``: ``tables`` is then not read); other moments ignore it.

    Raises:
        ValueError: a bad seed, step or tables (nothing is modified).
        RuntimeError: the Triton interpreter cannot run here.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    if isinstance(step, bool) or not isinstance(step, int) or not 1 <= step < 1 << 32:
        raise ValueError(f"step must be an int in [1, 2**32), got {step!r}")
    if (tables.dtype != torch.float32 or tables.numel() != TABLE_SIZE
            or not tables.is_contiguous() or tables.device != param.device):
        raise ValueError(f"tables must be zerokern.quant.maps.kernel_tables(param.device): "
                         f"{TABLE_SIZE} contiguous fp32 values on {param.device}, got "
                         f"{tables.dtype} {tuple(tables.shape)} on {tables.device}")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1 or rows & (rows - 1):
        raise ValueError(f"rows must be a power of two, got {rows!r}")
    if isinstance(format_version, bool) or format_version not in (2, 3):
        raise ValueError(f"format_version must be 2 or 3, got {format_version!r}")
    if folds_bias_correction(_NAMES[exp_avg.dtype], format_version) and s.bc2_sqrt != 1.0:
        # The kernel skips the division by bc2_sqrt there: only exact when it is 1.
        raise ValueError("bf16 moments and format_version=3 take the folded scalars "
                         "(kernel_contract.fold_bias_correction: bc2_sqrt == 1)")
    check_interpreter()
    n = param.numel()
    if n == 0:
        return
    moments = _MOMENTS[exp_avg.dtype]
    sr = param.dtype == torch.bfloat16
    has_lp = param_lp is not None and not sr
    quantized = moments == MOMENTS_INT8
    tile = rows * QBLOCK
    adamw_compressed_kernel[(triton.cdiv(n, tile),)](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        exp_avg_absmax if quantized else tables,  # unused pointers: any fp32 tensor
        exp_avg_sq_absmax if quantized else tables,
        param_lp if has_lp else param,
        sr_index if sr else tables,
        tables,
        n,
        ROWS=rows,
        MOMENTS=moments,
        HAS_LP=has_lp,
        SR=sr,
        USE_INT64=n >= 2**31 - tile,
        SOFT_FP=_INTERPRETED,
        V3=quantized and format_version == 3,
        **COMPILE_OPTIONS,
        **compressed_scalars(s, seed if sr else 0, step),
    )
