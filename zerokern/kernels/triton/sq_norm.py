"""Sum of squares of a flat tensor (fp32 / bf16 / fp16) as a deterministic Triton reduction.

Stage 1: G = min(cdiv(n, BLOCK), MAX_PARTIALS) programs; program i accumulates the squares
of blocks i, i + G, i + 2G, ... in a BLOCK-wide fp32 register vector (one partial sum per
lane), reduces it with tl.sum and writes partials[i]. Full blocks are loaded unmasked (so
they get 128-bit vector loads); the one partial block, if any, is masked.
Stage 2: a single program sums the G partials in a fixed tree order.

The grid and every reduction order depend on n only, so the result is bitwise
reproducible from run to run. inf and nan propagate (inf^2 = inf, nan^2 = nan, masked
lanes contribute 0). An empty tensor gives 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import check_interpreter

BLOCK = 4096
NUM_WARPS = 8
MAX_PARTIALS = 1024  # also the stage-2 block size


@triton.jit
def sq_norm_partials_kernel(
    x_ptr,
    partials_ptr,
    n,
    BLOCK: tl.constexpr,
    USE_INT64: tl.constexpr,
):
    pid = tl.program_id(0)
    num_progs = tl.num_programs(0)
    n_full = n // BLOCK
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    # Blocks pid, pid + G, ... below n_full (written as a counted loop: the interpreter
    # and every Triton version handle a runtime trip count).
    iters = (n_full - pid + num_progs - 1) // num_progs
    for i in range(0, iters):
        blk = pid + i * num_progs
        if USE_INT64:
            start = blk.to(tl.int64) * BLOCK
        else:
            start = blk * BLOCK
        x = tl.load(x_ptr + start + offs).to(tl.float32)
        acc += x * x
    # The trailing partial block goes to the program that would own it in the cycle.
    if pid == n_full % num_progs:
        if USE_INT64:
            start = n_full.to(tl.int64) * BLOCK
        else:
            start = n_full * BLOCK
        idx = start + offs
        x = tl.load(x_ptr + idx, mask=idx < n, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(partials_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def sq_norm_final_kernel(partials_ptr, out_ptr, num_partials, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(partials_ptr + offs, mask=offs < num_partials, other=0.0)
    tl.store(out_ptr, tl.sum(x, axis=0))


def sq_norm_triton(t: torch.Tensor) -> torch.Tensor:
    """Sum of squares of all elements of t as a 0-dim fp32 tensor on t's device."""
    check_interpreter()
    x = t.reshape(-1)
    if not x.is_contiguous():
        x = x.contiguous()
    n = x.numel()
    out = torch.empty((), dtype=torch.float32, device=t.device)
    if n == 0:
        out.zero_()
        return out
    num_partials = min(triton.cdiv(n, BLOCK), MAX_PARTIALS)
    partials = torch.empty(num_partials, dtype=torch.float32, device=t.device)
    sq_norm_partials_kernel[(num_partials,)](
        x,
        partials,
        n,
        BLOCK=BLOCK,
        USE_INT64=n >= 2**31 - BLOCK,
        num_warps=NUM_WARPS,
    )
    sq_norm_final_kernel[(1,)](partials, out, num_partials, BLOCK=MAX_PARTIALS, num_warps=4)
    return out
