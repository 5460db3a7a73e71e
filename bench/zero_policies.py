"""The training setups that bench_zero.py compares, one per policy, built on one rank.

Every setup gets the same model (same initial weights), the same AdamW hyper-parameters and
no gradient clipping, and returns one training step plus a count of the model-state bytes
the rank holds. bench/README.md describes each policy and its bf16 pipeline.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from _harness import generic_state
from gpt import GPT, GPTConfig
from host_step import OFFLOAD_VARIANTS, HostStepTimer, time_deepspeed, time_zerokern
from torch import nn

from zerokern.zero.layout import DEFAULT_BUCKET_NUMEL

HP = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
POLICIES = [
    "ddp",
    "zero_redundancy",
    "fsdp2",
    "zk_stage0",
    "zk_stage1",
    "zk_stage2",
    "zk_stage3",
    "zk_stage2_int8",
    "zk_stage3_int8",
    "ds_stage1",
    "ds_stage2",
]
# Compressed optimizer state (issue 27): "_int8" rows store both moments in 8 bits (fp32
# master kept), "_int8_nomaster" rows also drop the master (bf16 params, stochastic rounding;
# bf16 only). bench_zero.py --compressed adds the _nomaster rows to the default list.
COMPRESSED_POLICIES = [
    "zk_stage2_int8",
    "zk_stage3_int8",
    "zk_stage2_int8_nomaster",
    "zk_stage3_int8_nomaster",
]
# ZeRO-Offload rows (bench_zero.py --offload, bench_offload.py): optimizer state and step on
# the CPU; "_params": stage 3's parameter shard in host memory too.
OFFLOAD_POLICIES = [
    "zk_stage2_offload",
    "zk_stage3_offload",
    "zk_stage3_offload_params",
    "ds_stage2_offload",
    "ds_stage3_offload",
    "ds_stage3_offload_params",
]
# bench_zero.py --mesh RxS (issue 28): the same policies on a 2-D mesh of R replicas of S
# ranks (dim 0 replicates, dim 1 shards), each beside its flat run over all R*S ranks.
# "_hybrid": ZeroAdamW / shard_model(mesh=); "fsdp2_hsdp": fully_shard(mesh=2-D mesh), HSDP.
HYBRID_OF = {
    "fsdp2_hsdp": "fsdp2",
    "zk_stage1_hybrid": "zk_stage1",
    "zk_stage2_hybrid": "zk_stage2",
    "zk_stage3_hybrid": "zk_stage3",
}
MESH_POLICIES = ["ddp"] + [p for h, f in HYBRID_OF.items() for p in (f, h)]
# Quantized communication (issue 38, bench_zero.py --mesh RxS --quantized): zerokern stage 3
# with ZeroAdamW(gather_dtype=, reduce_dtype=), flat and hybrid, beside its 16-bit rows.
QUANT_OPTIONS = {
    "g8": {"gather_dtype": "int8"},
    "r8": {"reduce_dtype": "int8"},
    "r4": {"reduce_dtype": "int4"},
    "g8r8": {"gather_dtype": "int8", "reduce_dtype": "int8"},
    "g8r4": {"gather_dtype": "int8", "reduce_dtype": "int4"},
    # error feedback: the same int4 bytes, each rank's quantization residual carried over
    "r4ef": {"reduce_dtype": "int4", "error_feedback": True},
}
HYBRID_OF.update({f"zk_stage3_{q}_hybrid": f"zk_stage3_{q}" for q in QUANT_OPTIONS})
# "_hpz": shard_model(mesh=, hpz=True) on the same mesh (ZeRO++'s hpZ: sharded over all R*S
# ranks as flat, the backward's gathers in the node), each beside its flat policy
HPZ_OF = {f"zk_stage3{q}_hpz": f"zk_stage3{q}" for q in ("", "_g8", "_g8r4")}
FLAT_OF = {**HYBRID_OF, **HPZ_OF}  # a mesh policy -> the flat one it is compared with
QUANT_MESH_POLICIES = ["ddp", "zk_stage3", "zk_stage3_hybrid"] + [
    p for q in QUANT_OPTIONS for p in (f"zk_stage3_{q}", f"zk_stage3_{q}_hybrid")] + list(HPZ_OF)


class Skip(Exception):
    """The policy cannot run in this environment (recorded as 'skipped: ...')."""


@dataclass
class Job:
    """What the ranks of one policy run: picklable, handed to every spawned rank."""

    policy: str
    precision: str
    device: str
    cfg: dict[str, Any]
    micro_batch: int
    steps: int
    prof_steps: int
    world: int
    init_method: str  # the group's rendezvous (zerokern.comm.rendezvous.file_init_method)
    outdir: str  # where each rank writes its result or its error
    bucket_numel: int | None = None  # zerokern stages 0-2 (None: ZeroAdamW's default)


@dataclass
class Setup:
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # one training step -> loss
    state: Callable[[], dict[str, int]]  # model-state bytes held by this rank, by kind
    optim: str  # what does the update, for the CSV
    # zerokern: its comm_stats() per mesh dim of the last step (bench_zero.py --mesh)
    comm_dims: Callable[[], dict[str, float]] | None = None
    # offload rows: the host step's calls alone, timed (host_step.py)
    host_timer: HostStepTimer | None = None


def unavailable(policy: str) -> str | None:
    """Why the policy cannot run here, found without spawning its ranks (None: it can)."""
    if policy.startswith("ds_") and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed not installed (optional provider)"
    return None


def adamw_impl(device: torch.device) -> dict[str, bool]:
    """fused=True where torch has a fused AdamW for this device (CUDA; CPU in recent torch),
    else foreach=True. Checked by running one step, not by version."""
    try:
        p = nn.Parameter(torch.zeros(4, device=device))
        p.grad = torch.ones(4, device=device)
        torch.optim.AdamW([p], fused=True).step()
        return {"fused": True}
    except (RuntimeError, TypeError, NotImplementedError):
        return {"foreach": True}


class Masters:
    """fp32 master copy of a bf16 model for torch's optimizers (the mixed-precision pipeline
    of bench_adam's torch_mixed): grads bf16 -> fp32, AdamW on the masters, copy back."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.masters = [nn.Parameter(p.detach().float().clone()) for p in params]

    def alloc_grads(self, owned: set[int] | None = None) -> None:
        """Persistent fp32 grads for the masters this rank's optimizer steps (all: None)."""
        self.owned = owned
        for m in self.masters:
            if owned is None or id(m) in owned:
                m.grad = torch.zeros_like(m)

    def grads_in(self) -> None:
        pairs = [
            (m.grad, p.grad)
            for m, p in zip(self.masters, self.params)
            if p.grad is not None and m.grad is not None
        ]
        if pairs:
            torch._foreach_copy_([a for a, _ in pairs], [b for _, b in pairs])

    @torch.no_grad()
    def params_out(self) -> None:
        torch._foreach_copy_([p.data for p in self.params], self.masters)


def setup_ddp(job: Job, model: nn.Module, device: torch.device, zero1: bool) -> Setup:
    from torch.nn.parallel import DistributedDataParallel as DDP

    kw = adamw_impl(device)
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )
    params = list(model.parameters())
    ms = Masters(params) if job.precision == "bf16" else None
    targets = ms.masters if ms else params
    if zero1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(targets, optimizer_class=torch.optim.AdamW, **HP, **kw)
        owned = {id(p) for g in opt.optim.param_groups for p in g["params"]}
    else:
        opt = torch.optim.AdamW(targets, **HP, **kw)
        owned = None
    if ms is not None:
        ms.alloc_grads(owned)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        _, loss = ddp(x, y)
        loss.backward()
        if ms is not None:
            ms.grads_in()
        opt.step()
        if ms is not None:
            ms.params_out()
        return loss

    name = ("ZeroRedundancyOptimizer(AdamW)" if zero1 else "AdamW") + f"({next(iter(kw))})"
    if ms is not None:
        name += ", fp32 masters"
    return Setup(step, generic_state(model, opt, ms.masters if ms else []), name)


def _plain_step(
    model: nn.Module, opt: torch.optim.Optimizer
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The step of the setups whose optimizer does all the communication itself."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        return loss

    return step


def setup_fsdp2(job: Job, model: nn.Module, device: torch.device, mesh: Any = None) -> Setup:
    """``mesh``: a 2-D DeviceMesh makes it HSDP (FSDP2's replicate x shard); None: its default
    1-D mesh over the whole group."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        if job.precision == "bf16"
        else MixedPrecisionPolicy()
    )
    for blk in model.blocks:
        fully_shard(blk, mp_policy=mp_policy, mesh=mesh)
    fully_shard(model, mp_policy=mp_policy, mesh=mesh)
    kw = adamw_impl(device)
    opt = torch.optim.AdamW(model.parameters(), **HP, **kw)
    name = f"AdamW({next(iter(kw))}) on DTensor shards"
    if mesh is not None:
        name += f", HSDP mesh {tuple(mesh.shape)}"
    if job.precision == "bf16":
        name += ", MixedPrecisionPolicy(bf16, reduce bf16)"
    return Setup(_plain_step(model, opt), generic_state(model, opt), name)


def setup_zerokern(job: Job, model: nn.Module, stage: int, offload: bool = False,
                   offload_params: bool = False, fmt: dict[str, Any] | None = None,
                   mesh: Any = None, hpz: bool = False) -> Setup:
    import zerokern

    kw: dict[str, Any] = {"bucket_numel": job.bucket_numel} if job.bucket_numel else {}
    kw.update(fmt or {})  # moments= / master= of the compressed rows
    if mesh is not None:  # hybrid sharding (only passed then: older trees lack the argument)
        kw["mesh"] = mesh
    if hpz:  # hpZ on that mesh instead of hybrid sharding
        kw["hpz"] = True
    # Stage 3: shard_model's default units (the blocks), then the optimizer.
    opt = zerokern.parallelize(model, stage=stage, offload="cpu" if offload else None,
                               offload_params=offload_params, **HP, **kw)

    def state() -> dict[str, int]:
        # Device bytes by kind (with offload the optimizer state is on the host: host_total).
        s = opt.memory_stats()
        grads = s["grads"] + s["buckets"] + s.get("comm_scratch", 0)
        return {
            "params": s["params"],
            "grads": grads,
            "optim": s["total"] - s["params"] - grads,
            "host": s.get("host_total", 0),
            "zk_comm": opt.comm_stats()["bytes"],
        }

    name = f"ZeroAdamW(stage={stage}{', offload=cpu' if offload else ''}"
    name += "".join(f", {k}={v}" for k, v in (fmt or {}).items()) + ")"
    if fmt and ("moments" in fmt or "master" in fmt):
        # the kernels of the compressed step (the fastest here, or $ZEROKERN_BACKEND)
        from zerokern.ops._backend import resolve_backend

        name += f", {resolve_backend(None, next(model.parameters()).device)} kernels"
    if offload_params:
        name += " + shard_model(offload_params=True)"
    if mesh is not None:
        name += f", {'hpZ' if hpz else 'hybrid'} mesh {tuple(mesh.shape)}"
    return Setup(_plain_step(model, opt), state, name, lambda: comm_per_dim(opt),
                 time_zerokern() if offload else None)


def comm_per_dim(opt: Any) -> dict[str, float]:
    """Bytes and elements per mesh dim of ZeroAdamW's last step (``comm_stats()["per_dim"]``:
    "shard", the whole group when flat, and "replicate"), the paper's collectives only:
    ``<dim>_bytes`` / ``<dim>_elements`` as the paper counts them, ``<dim>_wire_bytes`` what
    each rank sends under ring collectives ((n-1)/n of that), ``<dim>_calls`` how many
    collectives. Empty on a tree without it."""
    from zerokern.comm.collectives import PAPER_KINDS

    per_dim = opt.comm_stats().get("per_dim")
    if per_dim is None:
        return {}

    def counted(kind: str) -> bool:  # the paper's kinds, quantized ones ("all_gather_q8") too
        return kind.rsplit("_q", 1)[0] in PAPER_KINDS

    out: dict[str, float] = {}
    for dim, d in per_dim.items():
        kinds = {k: v for k, v in d["per_kind"].items() if counted(k)}
        out[f"{dim}_bytes"] = sum(v["bytes"] for v in kinds.values())
        out[f"{dim}_elements"] = d["elements"]
        out[f"{dim}_calls"] = sum(v["calls"] for v in kinds.values())
        out[f"{dim}_wire_bytes"] = sum(
            v["wire_elements"] * v["bytes"] / v["elements"]
            for v in kinds.values() if v["elements"])
    return out


def setup_deepspeed(job: Job, model: nn.Module, device: torch.device, stage: int,
                    offload: bool = False, offload_params: bool = False) -> Setup:
    import deepspeed  # the rank imported it before forming its group (zero_ranks.run_rank)

    kw = adamw_impl(device)
    if offload:
        return _setup_deepspeed_offload(job, model, stage, offload_params)
    opt = torch.optim.AdamW(model.parameters(), **HP, **kw)
    config = {
        "train_micro_batch_size_per_gpu": job.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": job.precision == "bf16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    return Setup(
        step,
        generic_state(engine.module, ds_opt),
        f"deepspeed {deepspeed.__version__} ZeRO-{stage}, AdamW({next(iter(kw))})",
    )


def _setup_deepspeed_offload(job: Job, model: nn.Module, stage: int,
                             offload_params: bool) -> Setup:
    """DeepSpeed ZeRO-Offload: its own DeepSpeedCPUAdam (AdamW mode) on the host, state in
    pinned memory, as its docs configure it; never a dependency (skipped when missing)."""
    import deepspeed

    # Buckets of zerokern's default size: DeepSpeed's defaults (5e8 elements) would allocate
    # about 1 GB of bucket per rank and make the memory columns compare bucket settings.
    zero: dict[str, Any] = {"stage": stage,
                            "offload_optimizer": {"device": "cpu", "pin_memory": True},
                            "reduce_bucket_size": DEFAULT_BUCKET_NUMEL}
    if stage == 2:
        zero["allgather_bucket_size"] = DEFAULT_BUCKET_NUMEL
    else:
        zero["stage3_prefetch_bucket_size"] = DEFAULT_BUCKET_NUMEL
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_micro_batch_size_per_gpu": job.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": HP["lr"], "betas": list(HP["betas"]),
                                                  "eps": HP["eps"],
                                                  "weight_decay": HP["weight_decay"]}},
        "zero_optimization": zero,
        "bf16": {"enabled": job.precision == "bf16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    engine, ds_opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                config=config)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss

    return Setup(step, generic_state(engine.module, ds_opt),
                 f"deepspeed {deepspeed.__version__} ZeRO-{stage} offload_optimizer=cpu"
                 + (" + offload_param=cpu" if offload_params else "") + ", DeepSpeedCPUAdam",
                 host_timer=time_deepspeed(ds_opt))


def build(job: Job, device: torch.device, mesh: Any = None) -> Setup:
    """The seeded model of job.cfg on `device`, set up for job.policy. ``mesh``: the 2-D
    DeviceMesh the hybrid policies (HYBRID_OF) shard over; the others ignore it."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**job.cfg))
    pol = job.policy
    hybrid, hpz = pol in HYBRID_OF, pol in HPZ_OF
    if (hybrid or hpz) and mesh is None:
        raise ValueError(f"policy {pol!r} needs a 2-D mesh (bench_zero.py --mesh RxS)")
    mesh = mesh if hybrid or hpz else None
    if hybrid or hpz:
        pol = FLAT_OF[pol]  # the same setup as the flat policy, on the mesh
    # bf16: the model is bf16 except for fsdp2 (its fp32 shard is the master) and deepspeed
    # (it casts the model itself).
    keep_fp32 = pol == "fsdp2" or pol.startswith("ds_")
    lowp = job.precision == "bf16" and not keep_fp32
    model = model.to(device=device, dtype=torch.bfloat16 if lowp else torch.float32)
    if pol in ("ddp", "zero_redundancy"):
        return setup_ddp(job, model, device, zero1=pol == "zero_redundancy")
    if pol == "fsdp2":
        return setup_fsdp2(job, model, device, mesh)
    stage = int(pol.split("_")[1][-1]) if "_stage" in pol else -1
    offload, offload_params = "_offload" in pol, pol.endswith("_offload_params")
    if pol.startswith("zk_stage"):
        fmt = {"moments": "int8"} if "_int8" in pol else {}
        fmt.update(QUANT_OPTIONS.get(pol.split("_")[2] if pol.count("_") >= 2 else "", {}))
        fmt.update(OFFLOAD_VARIANTS.get(pol.partition("_offload_")[2], {}))  # "_offload_int8v3"
        if pol.endswith("_nomaster"):
            if not lowp:
                raise Skip("master='none' needs 16-bit parameters (bf16 precision only)")
            fmt["master"] = "none"
        return setup_zerokern(job, model, stage, offload, offload_params, fmt, mesh, hpz)
    if pol.startswith("ds_stage"):
        return setup_deepspeed(job, model, device, stage, offload, offload_params)
    raise ValueError(f"unknown policy {pol!r}")
