"""fused_adamw_compressed_: one in-place AdamW pass over a flat range whose optimizer state is
compressed (issue 27): moments in fp32, bf16 or 8-bit block-wise codes, and either an fp32
master (the 16-bit copy written in the same pass) or none (the bf16 parameter updated with
stochastic rounding).

**The range contract** every backend implements (the ``torch`` backend below is the oracle;
the others equal it bit for bit):

* ``n`` elements; blocks are 256 consecutive elements counted from the range's first element,
  the last one partial. The caller lays the range out so that no block mixes two parameters
  (zerokern pads the layout so each compressed parameter starts on a block).
* Moments, by ``exp_avg``'s dtype: fp32 (updated in place), bf16 (widened, updated with
  the folded scalars of ``kernel_contract.fold_bias_correction``, stored rounded to nearest
  even) or uint8 codes (``exp_avg`` on the signed map, ``exp_avg_sq`` on
  the unsigned one, one fp32 scale per block in ``exp_avg_absmax`` / ``exp_avg_sq_absmax``;
  dequantized ``code[c] * scale`` (``zerokern.quant.maps``), updated, requantized with
  format version 2: a signed scale and one reciprocal per block,
  ``zerokern.quant.blockwise``). A version-1 state (absmax >= 0) decodes the same way.
  ``format_version=3`` reads and writes version 3's computed maps instead
  (``zerokern.quant.fmt_v3``: an unsigned absmax per block, codes from bit patterns, no
  table); every backend runs it.
* The parameter, by ``param``'s dtype: fp32 is the master (``param_lp`` optionally receives
  it rounded to nearest even); bf16 is updated directly and written with
  ``stochastic_round_bf16(p, sr_bits16(seed, step, index))`` (format version 2: one Philox
  call per 8 elements, 16 bits each) where element ``i``'s index in its parameter is
  ``sr_index[i // 256] + i % 256``.
* The fp32 update between is the kernels' rounding contract (csrc/kernels.h),
  ``zerokern.quant.contract.adamw_contract_``.

Native backends receive version 2's code maps and decision thresholds as one fp32 table of
1024 values (:func:`zerokern.quant.maps.kernel_tables`); version 3 does not read it.
"""

from __future__ import annotations

import torch

from .. import _native
from ..kernel_contract import (
    AdamScalars,
    adam_scalars,
    fold_bias_correction,
    folds_bias_correction,
)
from ..quant.blockwise import quantize_blockwise_v2
from ..quant.contract import adamw_contract_
from ..quant.fmt_v3 import code_map_v3, quantize_blockwise_v3
from ..quant.maps import (
    BLOCK,
    SIGNED_MAP_ID,
    UNSIGNED_MAP_ID,
    code_map,
    dequantize_blockwise,
    kernel_tables,
)
from ..quant.philox import sr_bits16  # keyed as [Note: stochastic-rounding keys] says
from ..quant.rounding import stochastic_round_bf16
from ._backend import resolve_backend
from ._validate import FLOAT_DTYPES, LOW_DTYPES, check_flat, check_real

__all__ = ["fused_adamw_compressed_", "moments_format"]

MOMENT_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.uint8: "int8"}
FORMAT_VERSIONS = (2, 3)
"""The int8 encodings the range op runs (``format_version=``); 2 is the default."""
V3_BACKENDS = ("cpu", "torch", "triton", "cuda")
"""The backends that run int8 format version 3 (all of them; a new backend joins once its
kernel equals the oracle, and is refused ``format_version=3`` until then)."""


def moments_format(exp_avg: torch.Tensor) -> str:
    """``"fp32"``, ``"bf16"`` or ``"int8"``: the format ``exp_avg``'s dtype stores."""
    return MOMENT_DTYPES[exp_avg.dtype]


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def sr_indices(sr_index: torch.Tensor, n: int) -> torch.Tensor:
    """Each element's index in its parameter: ``sr_index[i // 256] + i % 256`` (int64)."""
    i = torch.arange(n, dtype=torch.int64, device=sr_index.device)
    return sr_index.repeat_interleave(BLOCK)[:n] + i % BLOCK


def adamw_compressed_torch_(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    exp_avg_absmax: torch.Tensor | None, exp_avg_sq_absmax: torch.Tensor | None,
    param_lp: torch.Tensor | None, sr_index: torch.Tensor | None, seed: int, step: int,
    s: AdamScalars, format_version: int = 2,
) -> None:
    """The oracle of the range contract (module docstring), in pure PyTorch. ``s`` are the
    kernel scalars: for bf16 moments and int8 version 3, ``fold_bias_correction``'s (as every
    kernel)."""
    n = param.numel()
    fmt = moments_format(exp_avg)
    v3 = format_version == 3
    if folds_bias_correction(fmt, format_version) and s.bc2_sqrt != 1.0:
        raise ValueError("bf16 moments and format_version=3 take the folded scalars "
                         "(kernel_contract.fold_bias_correction: bc2_sqrt == 1)")
    if fmt == "int8":
        assert exp_avg_absmax is not None and exp_avg_sq_absmax is not None
        dev = exp_avg.device
        mmap = code_map_v3(True, dev) if v3 else code_map(SIGNED_MAP_ID, dev)
        vmap = code_map_v3(False, dev) if v3 else code_map(UNSIGNED_MAP_ID, dev)
        m = dequantize_blockwise(exp_avg, exp_avg_absmax, mmap)
        v = dequantize_blockwise(exp_avg_sq, exp_avg_sq_absmax, vmap)
    elif fmt == "bf16":
        m, v = exp_avg.float(), exp_avg_sq.float()  # new tensors (bf16 -> fp32 is exact)
    else:
        m, v = exp_avg, exp_avg_sq
    p = param if param.dtype == torch.float32 else param.float()
    adamw_contract_(p, grad, m, v, None, s)
    if fmt == "bf16":
        exp_avg.copy_(m)  # round to nearest even
        exp_avg_sq.copy_(v)
    elif fmt == "int8":
        assert exp_avg_absmax is not None and exp_avg_sq_absmax is not None
        if v3:
            codes, absmax = quantize_blockwise_v3(m, True)
        else:
            codes, absmax = quantize_blockwise_v2(m, code_map(SIGNED_MAP_ID, m.device))
        exp_avg.copy_(codes)
        exp_avg_absmax.copy_(absmax)
        if v3:
            codes, absmax = quantize_blockwise_v3(v, False)
        else:
            codes, absmax = quantize_blockwise_v2(v, code_map(UNSIGNED_MAP_ID, v.device))
        exp_avg_sq.copy_(codes)
        exp_avg_sq_absmax.copy_(absmax)
    if param.dtype == torch.bfloat16:
        assert sr_index is not None
        param.copy_(stochastic_round_bf16(p, sr_bits16(seed, step, sr_indices(sr_index, n))))
    elif param_lp is not None:
        param_lp.copy_(p)


def _run(backend: str, param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
         exp_avg_sq: torch.Tensor, exp_avg_absmax: torch.Tensor | None,
         exp_avg_sq_absmax: torch.Tensor | None, param_lp: torch.Tensor | None,
         sr_index: torch.Tensor | None, seed: int, step: int, s: AdamScalars,
         format_version: int = 2) -> None:
    if param.numel() == 0:
        return
    if format_version == 3 and exp_avg.dtype == torch.uint8 and backend not in V3_BACKENDS:
        # Also for direct callers of the custom op: never step version 3 with version 2's code.
        raise ValueError(f"format_version=3 (int8) runs on the backends "
                         f"{', '.join(V3_BACKENDS)} only, not {backend!r}")
    if folds_bias_correction(moments_format(exp_avg), format_version):
        s = fold_bias_correction(s)  # the folded update (the kernels may skip a division)
    args = (param, grad, exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax, param_lp,
            sr_index, seed, step)
    if backend == "torch":
        adamw_compressed_torch_(*args, s, format_version)
    elif backend == "triton":
        from ..kernels.triton.adamw_compressed import adamw_compressed_triton_

        adamw_compressed_triton_(*args, kernel_tables(param.device), s,
                                 format_version=format_version)
    else:  # cpu and cuda share one native entry point that dispatches on the device
        _native.require(backend).adamw_compressed(*args, kernel_tables(param.device),
                                                  format_version, *s)


@torch.library.custom_op(
    "zerokern::fused_adamw_compressed_",
    mutates_args=("param", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax",
                  "param_lp"),
)
def _op(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor, exp_avg_absmax: torch.Tensor | None,
        exp_avg_sq_absmax: torch.Tensor | None, param_lp: torch.Tensor | None,
        sr_index: torch.Tensor | None, seed: int, lr: float, beta1: float, beta2: float,
        eps: float, weight_decay: float, step: int, grad_scale: float, backend: str,
        format_version: int) -> None:
    # The schema's int is int64: seeds >= 2**63 travel as negatives.
    engine_step_(param, grad, exp_avg, exp_avg_sq, exp_avg_absmax=exp_avg_absmax,
                 exp_avg_sq_absmax=exp_avg_sq_absmax, param_lp=param_lp, sr_index=sr_index,
                 seed=seed % 2**64, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                 weight_decay=weight_decay, step=step, grad_scale=grad_scale, backend=backend,
                 format_version=format_version)


@_op.register_fake
def _(param, grad, exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax, param_lp, sr_index,
      seed, lr, beta1, beta2, eps, weight_decay, step, grad_scale, backend,
      format_version) -> None:
    return None


def _int64(seed: int) -> int:
    return seed - 2**64 if seed >= 2**63 else seed


def validate_compressed_args(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    *, exp_avg_absmax: torch.Tensor | None, exp_avg_sq_absmax: torch.Tensor | None,
    param_lp: torch.Tensor | None, sr_index: torch.Tensor | None, seed: int | None,
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
    grad_scale: float,
) -> None:
    """Raise TypeError/ValueError naming the first bad argument; touches nothing."""
    p = check_flat(param, "param", dtypes=(torch.float32, torch.bfloat16))
    n, dev = p.numel(), p.device
    check_flat(grad, "grad", dtypes=FLOAT_DTYPES, numel=n, device=dev)
    m = check_flat(exp_avg, "exp_avg", dtypes=tuple(MOMENT_DTYPES), numel=n, device=dev)
    check_flat(exp_avg_sq, "exp_avg_sq", dtypes=(m.dtype,), numel=n, device=dev)
    nb = _blocks(n)
    for name, a in (("exp_avg_absmax", exp_avg_absmax),
                    ("exp_avg_sq_absmax", exp_avg_sq_absmax)):
        if m.dtype == torch.uint8:
            if a is None:
                raise ValueError(f"{name} is required with uint8 (int8) moments")
            check_flat(a, name, dtypes=(torch.float32,), device=dev)
            if a.numel() != nb:
                raise ValueError(f"{name} has {a.numel()} values, expected {nb} "
                                 f"(one per {BLOCK}-element block)")
        elif a is not None:
            raise ValueError(f"{name} must be None unless the moments are uint8 codes")
    if p.dtype == torch.bfloat16:
        if param_lp is not None:
            raise ValueError("param_lp must be None with a bf16 param (master-free mode: "
                             "the param itself is updated with stochastic rounding)")
        if sr_index is None or seed is None:
            raise ValueError("sr_index and seed are required with a bf16 param (the "
                             "stochastic rounding key)")
        check_flat(sr_index, "sr_index", dtypes=(torch.int64,), device=dev)
        if sr_index.numel() != nb:
            raise ValueError(f"sr_index has {sr_index.numel()} values, expected {nb}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    else:
        if sr_index is not None:
            raise ValueError("sr_index is only used with a bf16 param (master-free mode)")
        if param_lp is not None:
            check_flat(param_lp, "param_lp", dtypes=LOW_DTYPES, numel=n, device=dev)
    check_real(lr, "lr", lo=0.0, finite=True)
    check_real(beta1, "beta1", lo=0.0, hi=1.0, hi_open=True)
    check_real(beta2, "beta2", lo=0.0, hi=1.0, hi_open=True)
    check_real(eps, "eps", lo=0.0, finite=True)
    check_real(weight_decay, "weight_decay", lo=0.0, finite=True)
    check_real(grad_scale, "grad_scale", lo=0.0, lo_open=True)
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int (1-based), got {type(step).__name__}")
    if not 1 <= step < 2**32:
        raise ValueError(f"step must be in [1, 2**32) (1-based AdamW step), got {step}")
    named = {"param": p, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    for k, t in (("exp_avg_absmax", exp_avg_absmax), ("exp_avg_sq_absmax", exp_avg_sq_absmax),
                 ("param_lp", param_lp)):
        if t is not None:
            named[k] = t
    spans = [(k, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
             for k, t in named.items()]
    for i, (a, lo_a, hi_a) in enumerate(spans):
        for b, lo_b, hi_b in spans[:i]:
            if n and lo_a < hi_b and lo_b < hi_a:
                raise ValueError(f"{a} overlaps the memory of {b}")


def fused_adamw_compressed_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    grad_scale: float = 1.0,
    exp_avg_absmax: torch.Tensor | None = None,
    exp_avg_sq_absmax: torch.Tensor | None = None,
    param_lp: torch.Tensor | None = None,
    sr_index: torch.Tensor | None = None,
    seed: int | None = None,
    backend: str | None = None,
    format_version: int = 2,
) -> None:
    """One AdamW step over a flat range with compressed state, in place (module docstring).

    Args:
        param: fp32 master, or the bf16 parameter itself (no master: stochastic rounding).
        grad: fp32, bf16 or fp16 gradient (``grad_scale`` divides it).
        exp_avg: fp32, bf16, or uint8 codes on the signed map.
        exp_avg_sq: the same dtype as ``exp_avg`` (uint8: codes on the unsigned map).
        lr: learning rate.
        beta1: the first moment's coefficient.
        beta2: the second moment's coefficient.
        eps: added to the denominator.
        weight_decay: decoupled weight decay.
        step: the 1-based AdamW step (also the stochastic rounding counter).
        grad_scale: the gradient is divided by it.
        exp_avg_absmax: uint8 moments only: fp32, one per 256-element block.
        exp_avg_sq_absmax: as ``exp_avg_absmax``, for ``exp_avg_sq``.
        param_lp: fp32 param only: the 16-bit copy written in the same pass.
        sr_index: bf16 param only: int64, each block's first element's index in its
            parameter.
        seed: bf16 param only: the stochastic rounding seed, in [0, 2**64).
        backend: "cuda", "triton", "cpu", "torch" or None (fastest for the device).
        format_version: the int8 encoding, 2 (``zerokern.quant.blockwise``, the default) or
            3 (``zerokern.quant.fmt_v3``, computed maps, and the update with ``v``'s bias
            correction folded into the step size and eps; every backend); the other moment
            formats ignore it (bf16 moments always take the folded update).

    Raises:
        TypeError, ValueError: naming the first bad argument, with nothing modified.
    """
    if isinstance(format_version, bool) or format_version not in FORMAT_VERSIONS:
        raise ValueError(f"format_version must be one of {FORMAT_VERSIONS}, "
                         f"got {format_version!r}")
    validate_compressed_args(
        param, grad, exp_avg, exp_avg_sq, exp_avg_absmax=exp_avg_absmax,
        exp_avg_sq_absmax=exp_avg_sq_absmax, param_lp=param_lp, sr_index=sr_index, seed=seed,
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
        grad_scale=grad_scale)
    chosen = resolve_backend(backend, param.device)
    if format_version == 3 and exp_avg.dtype == torch.uint8 and chosen not in V3_BACKENDS:
        raise ValueError(f"format_version=3 (int8) runs on the backends "
                         f"{', '.join(V3_BACKENDS)} only, not {chosen!r} (its kernel "
                         f"implements version 2)")
    _op(param, grad, exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax, param_lp,
        sr_index, _int64(seed or 0), float(lr), float(beta1), float(beta2), float(eps),
        float(weight_decay), int(step), float(grad_scale), chosen, int(format_version))


def engine_step_(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    *, exp_avg_absmax: torch.Tensor | None, exp_avg_sq_absmax: torch.Tensor | None,
    param_lp: torch.Tensor | None, sr_index: torch.Tensor | None, seed: int | None,
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
    grad_scale: float, backend: str | None, format_version: int,
) -> None:
    """:func:`fused_adamw_compressed_` for the optimizer's own step: the same kernels and
    bits, without the per-call argument checks and the custom-op dispatch.

    The optimizer calls the range op once per run of a compressed state (about one per
    parameter) every step, and those two cost about 0.1 ms a call in Python, ten times the
    call itself, while everything they check holds by construction there: the ranges come
    from the optimizer's layout (contiguous, on their parameter's blocks, apart in memory),
    and its param groups are checked at every step, after any clip_grad_norm_ too. Callers
    outside the optimizer use
    :func:`fused_adamw_compressed_`.

    Args:
        param: as :func:`fused_adamw_compressed_`.
        grad: as :func:`fused_adamw_compressed_`.
        exp_avg: as :func:`fused_adamw_compressed_`.
        exp_avg_sq: as :func:`fused_adamw_compressed_`.
        exp_avg_absmax: as :func:`fused_adamw_compressed_`.
        exp_avg_sq_absmax: as :func:`fused_adamw_compressed_`.
        param_lp: as :func:`fused_adamw_compressed_`.
        sr_index: as :func:`fused_adamw_compressed_`.
        seed: as :func:`fused_adamw_compressed_`.
        lr: as :func:`fused_adamw_compressed_`.
        beta1: as :func:`fused_adamw_compressed_`.
        beta2: as :func:`fused_adamw_compressed_`.
        eps: as :func:`fused_adamw_compressed_`.
        weight_decay: as :func:`fused_adamw_compressed_`.
        step: as :func:`fused_adamw_compressed_`.
        grad_scale: as :func:`fused_adamw_compressed_`.
        backend: as :func:`fused_adamw_compressed_`.
        format_version: as :func:`fused_adamw_compressed_`.
    """
    s = adam_scalars(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                     step=step, grad_scale=grad_scale)
    _run(resolve_backend(backend, param.device), param, grad, exp_avg, exp_avg_sq,
         exp_avg_absmax, exp_avg_sq_absmax, param_lp, sr_index, seed or 0, step, s,
         format_version)
