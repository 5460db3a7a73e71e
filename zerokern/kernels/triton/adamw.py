"""Fused AdamW step over a flat fp32 shard, as a Triton kernel.

Per element, in fp32, exactly the formula and rounding contract of csrc/kernels.h:

    g = grad * inv_grad_scale
    p = p * decay
    m = lerp(m, g, w)     w < 0.5 ? fma(w, g-m, m) : fma(-(g-m), 1-w, g)     (w = 1 - beta1)
    v = fma((1 - beta2) * g, g, v * beta2)
    p = fma(-step_size, m / (sqrt(v) / bc2_sqrt + eps), p)
    param_lp = round_to_nearest_even(p)   (optional, bf16 or fp16)

The three fma are single roundings (explicit tl.fma -> fma.rn.f32); every other operation
is rounded on its own: sqrt and the divisions are the IEEE ones (sqrt_rn / div_rn), and the
kernel is compiled with enable_fp_fusion=False so that no other mul + add is contracted.
Every scalar is rounded to fp32 on the host (and 1 - w is computed there in fp32, as
torch's lerp does), so the kernel sees the same fp32 operands as the CPU and CUDA kernels
and agrees with them bit for bit.

Layout: one program per BLOCK elements. Full blocks take an unmasked path (so the JIT's
16-byte alignment specialisation of the pointers gives 128-bit vector accesses even when
n is odd); only the last, partial block is masked. Offsets are int32 unless n >= 2**31.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from zerokern.kernel_contract import AdamScalars

from . import check_interpreter

# 1024 elements over 8 warps = 4 per thread: every tensor (fp32 or 16-bit) then gets the
# same register layout, so the 16-bit grad / param_lp accesses need no shared-memory layout
# conversion (with 8 per thread Triton converts the fp32 stores through shared memory).
BLOCK = 1024
NUM_WARPS = 8
# Launch options; the compile tests use the same. fp fusion off: no mul+add is contracted
# into an FMA behind our back; the contract's three FMAs are explicit tl.fma calls.
COMPILE_OPTIONS = dict(num_warps=NUM_WARPS, enable_fp_fusion=False)


def _f32(x: float) -> float:
    """Round a Python float to the nearest fp32 value (returned as a Python float)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _neg_bits(x: float) -> int:
    """The int32 bit pattern of fp32 -x (sign-exact: -0.0 for x = 0.0)."""
    return struct.unpack("i", struct.pack("f", -x))[0]


@triton.jit
def _round_lp(p, LP_DTYPE: tl.constexpr, SOFT_FP: tl.constexpr):
    """fp32 -> bf16/fp16, round to nearest even (what torch's .to(dtype) does; [Note: 16-bit
    values are rounded to nearest even] in zerokern/ops/adamw.py)."""
    if SOFT_FP and LP_DTYPE == tl.bfloat16:
        # Integer RNE, used under TRITON_INTERPRET: the interpreter's own fp32->bf16
        # conversion rounds ties away from zero and drops the carry into the exponent.
        # NaN becomes 0x7FC0 like torch's CPU conversion.
        bits = p.to(tl.uint32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        rounded = tl.where(p != p, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        # cvt.rn.bf16.f32 / cvt.rn.f16.f32 on the GPU.
        return p.to(LP_DTYPE, fp_downcast_rounding="rtne")


@triton.jit
def _fma(x, y, z, SOFT_FP: tl.constexpr):
    """fp32 x * y + z with a single rounding (fma.rn.f32 on the GPU)."""
    if SOFT_FP:
        # The interpreter's tl.fma is x * y + z in numpy fp32, rounded twice. Exact emulation
        # in fp64 instead: a = x*y is exact (24 + 24 <= 53 bits, no under/overflow for fp32
        # operands); s = a + c rounded to fp64, and err = (a + c) - s exactly (Knuth's
        # TwoSum). If err != 0, s is forced odd by moving it one fp64 ulp towards err: that
        # is a + c rounded to odd at 53 bits, and since 53 >= 24 + 2, rounding it to fp32
        # (nearest even) gives exactly fp32 round-to-nearest-even of a + c (Boldo and
        # Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using
        # rounding to odd", IEEE TC 2008). Inf/NaN: err is NaN, never < 0 or > 0, s is kept.
        # (tl.cast, not .to: the interpreter passes scalar arguments as Python floats)
        a = tl.cast(x, tl.float64) * tl.cast(y, tl.float64)
        c = tl.cast(z, tl.float64)
        s = a + c
        cc = s - a
        err = (a - (s - cc)) + (c - cc)
        bits = s.to(tl.int64, bitcast=True)
        inexact = (err < 0) | (err > 0)
        step = tl.where((err > 0) == (s > 0), 1, -1).to(tl.int64)  # +1: magnitude up
        bits = tl.where(inexact & ((bits & 1) == 0), bits + step, bits)
        return bits.to(tl.float64, bitcast=True).to(tl.float32)
    else:
        return tl.fma(x, y, z)


@triton.jit
def _bits_f32(bits, like):
    """An fp32 scalar passed as its int32 bit pattern, splat to ``like``'s shape. The two
    negated scalars travel this way because a negation in the kernel is not sign-exact on
    every Triton (3.6 lowers -x as 0 - x, so -0.0 from lr = 0 becomes +0.0) and the
    interpreter turns a -0.0 float argument into +0.0."""
    return tl.full(like.shape, bits, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def adamw_update(
    p,
    g,
    m,
    v,
    decay,
    w,
    neg_one_minus_w_bits,
    beta2,
    one_minus_beta2,
    neg_step_size_bits,
    bc2_sqrt,
    eps,
    inv_grad_scale,
    LERP_LOW: tl.constexpr,
    APPLY_SCALE: tl.constexpr,
    SOFT_FP: tl.constexpr,
    FOLDED: tl.constexpr,
):
    """The fp32 AdamW update of the kernel contract (module docstring), spelled once for
    every Triton kernel (this one and ``adamw_compressed.py``): fp32 ``p`` (the master), ``g``
    (the widened gradient before its scaling), ``m``, ``v`` in; the updated ``(p, m, v)``
    out. FOLDED: the scalars are ``kernel_contract.fold_bias_correction``'s (bf16 moments,
    int8 format version 3), ``bc2_sqrt == 1``, so the division by it is exact and skipped."""
    if APPLY_SCALE:
        g = g * inv_grad_scale
    p = p * decay
    diff = g - m
    if LERP_LOW:
        m = _fma(w, diff, m, SOFT_FP)
    else:
        # fma(-(g-m), 1-w, g) == fma(g-m, -(1-w), g) bit for bit (negation is exact), with
        # -(1-w) negated on the host: no negation in the kernel (below).
        m = _fma(diff, _bits_f32(neg_one_minus_w_bits, v), g, SOFT_FP)
    v = _fma(one_minus_beta2 * g, g, v * beta2, SOFT_FP)
    # div_rn does not broadcast its operands: splat the scalar divisor first.
    if FOLDED:
        denom = tl.sqrt_rn(v) + eps
    else:
        denom = tl.div_rn(tl.sqrt_rn(v), tl.full(v.shape, bc2_sqrt, tl.float32)) + eps
    p = _fma(_bits_f32(neg_step_size_bits, p), tl.div_rn(m, denom), p, SOFT_FP)
    return p, m, v


@triton.jit
def _adamw_block(
    offs,
    mask,
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    lp_ptr,
    decay,
    w,
    neg_one_minus_w_bits,
    beta2,
    one_minus_beta2,
    neg_step_size_bits,
    bc2_sqrt,
    eps,
    inv_grad_scale,
    MASKED: tl.constexpr,
    HAS_LP: tl.constexpr,
    LERP_LOW: tl.constexpr,
    APPLY_SCALE: tl.constexpr,
    SOFT_FP: tl.constexpr,
):
    if MASKED:
        p = tl.load(param_ptr + offs, mask=mask, other=0.0)
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0)
        m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
        v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)
    else:
        p = tl.load(param_ptr + offs)
        g = tl.load(grad_ptr + offs)
        m = tl.load(exp_avg_ptr + offs)
        v = tl.load(exp_avg_sq_ptr + offs)

    p, m, v = adamw_update(
        p,
        g.to(tl.float32),
        m,
        v,
        decay,
        w,
        neg_one_minus_w_bits,
        beta2,
        one_minus_beta2,
        neg_step_size_bits,
        bc2_sqrt,
        eps,
        inv_grad_scale,
        LERP_LOW,
        APPLY_SCALE,
        SOFT_FP,
        False,
    )
    if HAS_LP:
        p_lp = _round_lp(p, lp_ptr.dtype.element_ty, SOFT_FP)

    if MASKED:
        tl.store(param_ptr + offs, p, mask=mask)
        tl.store(exp_avg_ptr + offs, m, mask=mask)
        tl.store(exp_avg_sq_ptr + offs, v, mask=mask)
        if HAS_LP:
            tl.store(lp_ptr + offs, p_lp, mask=mask)
    else:
        tl.store(param_ptr + offs, p)
        tl.store(exp_avg_ptr + offs, m)
        tl.store(exp_avg_sq_ptr + offs, v)
        if HAS_LP:
            tl.store(lp_ptr + offs, p_lp)


# The bit patterns change every step: no int specialisation (== 1, divisible by 16) on them,
# or a step would recompile the kernel when its lr's bits happened to change class.
@triton.jit(do_not_specialize=["neg_one_minus_w_bits", "neg_step_size_bits"])
def adamw_kernel(
    param_ptr,
    grad_ptr,
    exp_avg_ptr,
    exp_avg_sq_ptr,
    lp_ptr,
    n,
    decay,
    w,
    neg_one_minus_w_bits,
    beta2,
    one_minus_beta2,
    neg_step_size_bits,
    bc2_sqrt,
    eps,
    inv_grad_scale,
    BLOCK: tl.constexpr,
    HAS_LP: tl.constexpr,
    LERP_LOW: tl.constexpr,
    APPLY_SCALE: tl.constexpr,
    USE_INT64: tl.constexpr,
    SOFT_FP: tl.constexpr,
):
    pid = tl.program_id(0)
    if USE_INT64:
        start = pid.to(tl.int64) * BLOCK
    else:
        start = pid * BLOCK
    offs = start + tl.arange(0, BLOCK)
    if pid < n // BLOCK:
        _adamw_block(
            offs,
            None,
            param_ptr,
            grad_ptr,
            exp_avg_ptr,
            exp_avg_sq_ptr,
            lp_ptr,
            decay,
            w,
            neg_one_minus_w_bits,
            beta2,
            one_minus_beta2,
            neg_step_size_bits,
            bc2_sqrt,
            eps,
            inv_grad_scale,
            False,
            HAS_LP,
            LERP_LOW,
            APPLY_SCALE,
            SOFT_FP,
        )
    else:
        _adamw_block(
            offs,
            offs < n,
            param_ptr,
            grad_ptr,
            exp_avg_ptr,
            exp_avg_sq_ptr,
            lp_ptr,
            decay,
            w,
            neg_one_minus_w_bits,
            beta2,
            one_minus_beta2,
            neg_step_size_bits,
            bc2_sqrt,
            eps,
            inv_grad_scale,
            True,
            HAS_LP,
            LERP_LOW,
            APPLY_SCALE,
            SOFT_FP,
        )


# Under TRITON_INTERPRET=1 (read when triton.jit runs, i.e. at import of this module) the
# decorator returns an InterpretedFunction; the kernel then rounds to bf16 with integer ops
# and emulates the FMAs in fp64 (SOFT_FP), where the interpreter's own versions are inexact.
_INTERPRETED = type(adamw_kernel).__name__ == "InterpretedFunction"


def kernel_scalars(s: AdamScalars) -> dict:
    """The fp32-rounded runtime scalars and scalar-derived constexprs of one step."""
    w = _f32(s.one_minus_beta1)
    # 1 - w as fp32 arithmetic computes it (torch's lerp uses the fp32 opmath type): for
    # w >= 2**-29 the double difference is exact and rounds once; below, both give 1.0.
    one_minus_w = _f32(1.0 - w)
    inv = _f32(s.inv_grad_scale)
    return dict(
        decay=_f32(s.decay),
        w=w,
        neg_one_minus_w_bits=_neg_bits(one_minus_w),
        beta2=_f32(s.beta2),
        one_minus_beta2=_f32(s.one_minus_beta2),
        neg_step_size_bits=_neg_bits(_f32(s.step_size)),
        bc2_sqrt=_f32(s.bc2_sqrt),
        eps=_f32(s.eps),
        inv_grad_scale=inv,
        LERP_LOW=bool(w < 0.5),
        APPLY_SCALE=bool(inv != 1.0),
    )


def adamw_triton_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_lp: torch.Tensor | None,
    s: AdamScalars,
) -> None:
    """In-place AdamW step over flat shards (inputs validated by the caller)."""
    check_interpreter()
    n = param.numel()
    if n == 0:
        return
    has_lp = param_lp is not None
    grid = (triton.cdiv(n, BLOCK),)
    adamw_kernel[grid](
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        param_lp if has_lp else param,  # dummy pointer when there is no low-precision copy
        n,
        BLOCK=BLOCK,
        HAS_LP=has_lp,
        USE_INT64=n >= 2**31 - BLOCK,
        SOFT_FP=_INTERPRETED,
        **COMPILE_OPTIONS,
        **kernel_scalars(s),
    )
