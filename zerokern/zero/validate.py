"""ZeroAdamW's argument checks: hyperparameters, its own options, parameter dtypes and devices.
Each is local and pure; the comparison across ranks is zero/agreement.py's."""

from __future__ import annotations

import math
from typing import Any

import torch

from .offload import OFFLOAD_CHOICES

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_hparams(lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                   where: str = "") -> None:
    if not (isinstance(lr, (int, float)) or torch.is_tensor(lr)) or not finite_ge0(lr):
        raise ValueError(f"lr{where} must be a finite number >= 0, got {lr!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas{where} must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        if not 0.0 <= float(b) < 1.0:
            raise ValueError(f"betas[{i}]{where} must be in [0, 1), got {b!r}")
    if not finite_ge0(eps):
        raise ValueError(f"eps{where} must be a finite number >= 0, got {eps!r}")
    if not finite_ge0(weight_decay):
        raise ValueError(f"weight_decay{where} must be a finite number >= 0, got {weight_decay!r}")


def check_eps_moments(eps: Any, moments: str, where: str = "") -> None:
    """int8 moments need ``eps > 0``. An ``exp_avg_sq`` below about 1.6e-7 of its block's
    absmax decodes to exactly 0 (the unsigned map's smallest nonzero value is about 3.25e-7),
    while its ``exp_avg`` keeps a nonzero code: with ``eps=0`` the update divides by zero and
    writes inf/NaN into the parameters (docs/compressed-state.md). Call after check_hparams."""
    if moments == "int8" and float(eps) == 0.0:
        raise ValueError(f"eps{where} must be > 0 with moments='int8' (an exp_avg_sq that "
                         f"decodes to 0 would divide by zero), got {eps!r}")


def finite_ge0(x: Any) -> bool:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return False
    return math.isfinite(v) and v >= 0


def check_zero_args(stage: Any, offload: Any, bucket_numel: Any, max_grad_norm: Any) -> None:
    """ZeroAdamW's own arguments (beyond torch's AdamW ones)."""
    # An int 0-3: True == 1 and 2.0 == 2 would pass `in (0, 1, 2, 3)`, and a stage is no
    # flag and no measurement (parallelize refused them; ZeroAdamW took them).
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        kind = "" if type(stage) is int else f" (a {type(stage).__name__}; give an int)"
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}{kind}")
    check_offload(offload, stage)
    if bucket_numel is not None and (isinstance(bucket_numel, bool)
                                     or not isinstance(bucket_numel, int)
                                     or bucket_numel < 1):
        raise ValueError(f"bucket_numel must be a positive int, got {bucket_numel!r}")
    if max_grad_norm is not None and (isinstance(max_grad_norm, (bool, str))
                                      or not _number_gt0(max_grad_norm)):
        raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")


def _number_gt0(x: Any) -> bool:
    try:
        return float(x) > 0  # NaN is not
    except (TypeError, ValueError):
        return False


def check_seed(seed: Any) -> None:
    """The stochastic rounding key: an int in [0, 2**63) (saved with the state)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), got {seed!r}")


def check_master_dtype(fmt: Any, dtype: torch.dtype) -> None:
    """master="none" updates the parameters themselves with stochastic rounding to bf16: it
    needs bf16 parameters (fp32 ones are their own master already; fp16 has no stochastic
    rounding here)."""
    if fmt.master == "none" and dtype != torch.bfloat16:
        raise ValueError(f"master='none' needs bf16 parameters (the update is rounded "
                         f"stochastically into them); these are {dtype}. Use master='fp32', "
                         "or cast the model to bf16")


def check_offload(offload: Any, stage: int) -> None:
    """ZeroAdamW(offload=...): None, or "cpu" at stages 1-3 (the host holds this rank's
    shard of the optimizer state; stage 0 has no shard, every rank holds everything)."""
    if offload is None:
        return
    if not isinstance(offload, str) or offload not in OFFLOAD_CHOICES:
        raise ValueError(f"offload must be None or 'cpu' (optimizer state and step in host "
                         f"memory), got {offload!r}")
    if stage == 0:
        raise ValueError("offload='cpu' needs stage 1, 2 or 3: stage 0 does not partition "
                         "the optimizer state, so there is no shard to offload (got stage=0)")


def check_offload_params(rt: Any, offload: str | None) -> None:
    """A model sharded with offload_params keeps its parameter slices in host memory: the
    optimizer must run its step there as well."""
    if rt is not None and rt.offload_params and offload is None:
        raise ValueError(
            "offload: the model was sharded with shard_model(..., offload_params=True), so its "
            "parameter shards live in host memory; build ZeroAdamW(..., stage=3, "
            "offload='cpu') so that the step runs there too")


def check_no_duplicates(params: list[torch.nn.Parameter], group: int) -> None:
    """torch's AdamW warns about a parameter listed twice and then updates it twice per step
    (its step count advances by 2; torch says this will become an error): refused here."""
    seen: dict[int, int] = {}
    for j, p in enumerate(params):
        if id(p) in seen:
            raise ValueError(
                f"params: param group {group} lists the same parameter twice (positions "
                f"{seen[id(p)]} and {j}; torch's AdamW would update it twice per step); list "
                "each parameter once")
        seen[id(p)] = j


def common_dtype_device(params: list[torch.nn.Parameter]) -> tuple[torch.dtype, torch.device]:
    p0 = params[0]
    for i, p in enumerate(params):
        if p.is_meta:
            # A model built under torch.device("meta") (deferred initialisation) has shapes
            # and no values: there is nothing to broadcast, flatten or step.
            raise ValueError(
                f"params: parameter {i} (shape {tuple(p.shape)}) is on the meta device and "
                "holds no values; materialise the model first: model.to_empty(device=...) "
                "and initialise its parameters (e.g. reset_parameters() or "
                "load_state_dict), then build ZeroAdamW")
        if p.dtype not in _DTYPES:
            raise TypeError(f"params: parameter {i} has dtype {p.dtype}; supported: "
                            "float32, bfloat16, float16")
        if p.dtype != p0.dtype or p.device != p0.device:
            raise ValueError(
                f"params: all trainable parameters must share one dtype and device; "
                f"parameter 0 is {p0.dtype} on {p0.device}, parameter {i} is {p.dtype} "
                f"on {p.device} (several dtypes are trained at stages 0-2 when given at "
                f"construction; cast or move before building the optimizer, and before "
                f"add_param_group)"
            )
    return p0.dtype, p0.device


def check_reduce_dtype(reduce_dtype: Any, offload: str | None) -> None:
    """ZeroAdamW(reduce_dtype=): None (reduce in the parameters' dtype) or torch.float32
    (16-bit parameters' gradients reduced, and stepped, in fp32; nothing changes for fp32
    parameters). Not with offload: the host pipeline moves gradients in the parameters'
    dtype."""
    if reduce_dtype is None or reduce_dtype in QUANTIZED_REDUCE:
        return  # the quantized spellings: check_quantized_comm
    if reduce_dtype is not torch.float32:
        raise ValueError(f"reduce_dtype must be None or torch.float32 (gradients of 16-bit "
                         f"parameters reduced in fp32), or 'int8' / 'int4' (quantized on the "
                         f"wire), got {reduce_dtype!r}")
    if offload is not None:
        raise ValueError("reduce_dtype=torch.float32 with offload='cpu' is not supported: the "
                         "offload pipeline moves gradients in the parameters' dtype; drop "
                         "one of them")


def check_offload_backend(backend: Any, offload: Any) -> None:
    """ZeroAdamW(backend=..., offload=...): with offload the AdamW step runs on host tensors,
    where the CUDA kernels cannot run (nor Triton's, but under its interpreter, a debugging
    mode). An explicit request works or raises (ops/_backend.py), so it is refused here
    rather than replaced by the CPU kernel without a word."""
    if offload is not None and backend in ("cuda", "triton"):
        raise ValueError(
            f"backend={backend!r} with offload={offload!r}: with offload the AdamW step runs "
            f"on the host, on CPU tensors, where the {backend} kernels do not run. Pass "
            "backend=None (the fastest kernel for each tensor's device), 'cpu' or 'torch', "
            "or drop offload to step on the device")


def check_int8_format_backend(fmt: Any, backend: str | None, device: torch.device,
                              offload: str | None) -> None:
    """``int8_format=3`` with int8 moments needs a step backend that runs version 3
    (``V3_BACKENDS``): the one ``backend`` resolves to for the state's device (the host with
    ``offload``). Refused at construction rather than at the first step."""
    if fmt.moments != "int8" or fmt.int8_format != 3:
        return
    from ..ops._backend import resolve_backend
    from ..ops.adamw_compressed import V3_BACKENDS

    where = torch.device("cpu") if offload is not None else torch.device(device)
    chosen = resolve_backend(backend, where)
    if chosen not in V3_BACKENDS:
        raise ValueError(
            f"int8_format=3 with moments='int8': the step's backend {chosen!r} (backend="
            f"{backend!r} on {where.type} tensors) runs int8 format version 2 only; version 3 "
            f"runs on {', '.join(V3_BACKENDS)}. Pass int8_format=2, or a backend that runs it")


QUANTIZED_REDUCE = ("int8", "int4")
QUANTIZED_GATHER = ("int8",)


def check_quantized_comm(reduce_dtype: Any, gather_dtype: Any, stage: int,
                         offload: str | None, master: str) -> None:
    """``reduce_dtype="int8"`` / ``"int4"`` and ``gather_dtype="int8"`` (ZeRO++'s quantized
    communication): every combination that is not built is refused, with the reason."""
    if gather_dtype is not None and gather_dtype not in QUANTIZED_GATHER:
        why = (": 4-bit weights are not built (ZeRO++ gathers int8 weights; int4 is for "
               "gradients, reduce_dtype='int4')" if gather_dtype == "int4" else "")
        raise ValueError(f"gather_dtype must be None or 'int8' (the parameter all-gather in "
                         f"int8 codes), got {gather_dtype!r}{why}")
    quantized = [f"{n}={v!r}" for n, v in (("reduce_dtype", reduce_dtype),
                                             ("gather_dtype", gather_dtype))
                 if isinstance(v, str)]
    if not quantized:
        return
    what = " and ".join(quantized)
    if stage == 0:
        raise ValueError(f"{what} at stage=0: stage 0 all-reduces whole gradients and gathers "
                         f"no parameters; quantized communication is built for the "
                         f"reduce-scatter and all-gather of stages 1-3")
    if offload is not None:
        raise ValueError(f"{what} with offload={offload!r} is not built: the offload "
                         f"pipeline moves gradients and parameters in their own dtype; drop "
                         f"one of them")
    if gather_dtype is not None and stage in (1, 2) and master == "none":
        raise ValueError(
            f"gather_dtype={gather_dtype!r} with master='none' at stage={stage}: at stages "
            f"1-2 each rank's slice of the parameters is both what is gathered and, without "
            f"a master, the only copy of its values, which the gather would replace with "
            f"their int8 decoding; use master='fp32' or stage=3")


def check_gather_dtype_params(gather_bits: int | None, stage: int, dtype: torch.dtype) -> None:
    """Stages 1-2 gather the parameters out of their own flat buffer: with fp32 parameters
    there is no master behind it, and an int8 gather would quantize the weights themselves."""
    if gather_bits is not None and stage in (1, 2) and dtype == torch.float32:
        raise ValueError(
            f"gather_dtype='int{gather_bits}' at stage={stage} with fp32 parameters: fp32 "
            f"parameters are their own master at stages 1-2 (each rank's slice is the only "
            f"copy of its values), which an int8 gather would overwrite with its decoding; "
            f"use 16-bit parameters (with their fp32 master) or stage=3")
