"""End-to-end training step: zerokern ZeRO stages vs DDP, ZeroRedundancyOptimizer, FSDP2 and
DeepSpeed, side by side in one run on the same GPT, data, global batch, precision and device.

    python bench/bench_zero.py                          # reference workload (DESIGN.md §7)
    python bench/bench_zero.py --precision bf16 --policies ddp zk_stage2
    python bench/bench_zero.py --quick                  # tiny model, 4 steps: a smoke test

Reference workload: GPT of 6 blocks, d_model 384, 6 heads, vocab 4096, sequence 128 (13.84M
parameters, bench/gpt.py), micro-batch 4 per rank, 2 ranks (gloo on CPU with 1 thread per
rank, nccl on GPU), 30 steps; steps/s = 1 / median step time of steps 3..N. Every policy runs
in its own fresh set of processes (torch.multiprocessing, spawn), from the same initial weights
(seed 0) on the same token stream (gpt.batch(step, rank)), with the same AdamW
hyper-parameters and no gradient clipping.

Policies ("-" = what the optimizer works on):
  ddp              DDP(gradient_as_bucket_view=True) + torch.optim.AdamW (fused kernel where
                   torch has one for the device, CPU included; else foreach: see the optim
                   column)
  zero_redundancy  DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW): optimizer
                   state sharded, updated parameters broadcast by their owner
  fsdp2            fully_shard on every block, then on the root (torch defaults: parameters
                   resharded after forward, i.e. ZeRO-3) + AdamW on the DTensor shards
  zk_stage0/1/2    zerokern.ZeroAdamW(stage=s) on the plain model (no DDP: it averages
                   gradients itself)
  zk_stage3        zerokern.shard_model(model) (its default units: the blocks) +
                   ZeroAdamW(stage=3); skipped where zerokern has no shard_model
  ds_stage1/2      DeepSpeed ZeRO stage 1/2 (optional: skipped with the reason when deepspeed
                   is not installed; on CPU DS_ACCELERATOR=cpu and
                   deepspeed.init_distributed(dist_backend="gloo")), client torch AdamW

Precision:
  fp32  fp32 model, fp32 AdamW everywhere.
  bf16  "bf16 model, fp32 master", i.e. bf16 parameters for compute, bf16 gradients
        communicated, AdamW on fp32 master weights, new bf16 parameters cast from the master:
    ddp / zero_redundancy: bf16 model in DDP (bf16 all-reduce); an fp32 master copy of every
        parameter; the bf16 grads are copied into persistent fp32 master grads (for
        zero_redundancy only those of the parameters this rank's optimizer owns), AdamW steps
        the masters, the masters are copied back into the bf16 parameters. torch's ZeRO-1
        shards the optimizer state but not this master copy (it has no notion of one), and
        broadcasts the updated fp32 masters.
    fsdp2: fp32 model sharded by fully_shard with MixedPrecisionPolicy(param_dtype=bf16,
        reduce_dtype=bf16): the fp32 shard is the master, parameters are all-gathered and
        computed in bf16, gradients reduce-scattered in bf16 and kept as an fp32 shard.
    zerokern: bf16 model; ZeroAdamW keeps the fp32 master (sharded from stage 1 on).
    deepspeed: fp32 model handed to deepspeed.initialize with {"bf16": {"enabled": true}}
        (bf16 model, fp32 master partitions held by the ZeRO optimizer).

Measured, per policy (ranks' numbers combined as said):
  step_ms, _min, _max  wall time of one training step (zero_grad, forward, backward,
        optimizer step, master copies), max over ranks for each step, median/min/max over
        steps 3..N; on GPU with a device synchronize before and after. Nothing else runs
        during these steps (no profiler, no hooks).
  comm_mb, comm_ms    per step, from torch.profiler over `--prof-steps` extra steps run after
        the timed ones: every event the process-group backend records for a collective
        ("gloo:<kind>" / "nccl:<kind>", on its own threads, DDP's C++ reducer included).
        Bytes as the ZeRO paper counts them (DESIGN.md §4): all-reduce 2x the tensor,
        reduce-scatter the full input, all-gather the full output, broadcast once (rank 0's
        view). What is counted is what the backend ran: gloo executes reduce_scatter_tensor
        as an all-reduce of the full input (its event is "gloo:all_reduce"), so there a
        reduce-scatter counts 2x. zerokern does not use it on gloo: it exchanges slices
        point to point, recorded as "gloo:send" and "gloo:recv" and counted as the bytes
        each moves (for 2 ranks, send + recv = the paper count of the reduce-scatter).
        Time: length of the union of those events' intervals (on GPU: of the NCCL
        kernels), i.e. wall time during which a collective was in progress on the rank,
        overlapped with compute or not, waiting for the peer included; max over ranks.
  zk_comm_mb          zerokern only: ZeroAdamW.comm_stats()["bytes"] of the last timed step:
        what zerokern asked for, paper count (a reduce-scatter once), without the scalar
        grad-norm all-reduce.
  params_mb, grads_mb, optim_mb, state_mb   model-state bytes held by one rank (max over
        ranks) after the last timed step, gradients still present. zerokern:
        memory_stats() (grads include the stage-2 bucket pool and, on gloo, the receive
        buffers of the point-to-point reduce-scatter; optim = fp32 master + moments
        + padding + other arena use). Others: unique tensor storages (views counted once,
        DTensors by their local shard) of the model's parameters, then of their .grad
        (DDP's buckets, which those grads view), then of every other tensor reachable from the
        optimizer/engine object and the fp32 masters (moments, step counters, master weights
        and grads, DeepSpeed's flat partitions and gradient buffers).
  rss_mb (CPU)        peak resident set of the rank process after the timed steps (max over
        ranks): everything, activations and libraries included.
  max_alloc_mb, max_reserved_mb (GPU)  torch.cuda.max_memory_allocated / _reserved.
  loss                mean over ranks of the last timed step's loss (same data everywhere: fp32
        policies should agree closely).
  status              ok, oom, skipped: why, or error: the failing rank's last line. A policy
        that fails is a row, not a gap.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402
from gpt import GPT, GPTConfig, batch  # noqa: E402

HP = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
POLICIES = [
    "ddp",
    "zero_redundancy",
    "fsdp2",
    "zk_stage0",
    "zk_stage1",
    "zk_stage2",
    "zk_stage3",
    "ds_stage1",
    "ds_stage2",
]
REFERENCE = dict(
    cfg=GPTConfig(n_layer=6, n_embd=384, n_head=6, vocab=4096, seq=128), micro_batch=4, steps=30
)
QUICK = dict(
    cfg=GPTConfig(n_layer=2, n_embd=64, n_head=2, vocab=256, seq=32), micro_batch=2, steps=4
)
MB = 1 << 20


class Skip(Exception):
    """The policy cannot run in this environment (recorded as 'skipped: ...')."""


# -- per-rank setup of each policy -------------------------------------------------------------
@dataclass
class Job:
    policy: str
    precision: str
    device: str
    cfg: dict[str, Any]
    micro_batch: int
    steps: int
    prof_steps: int
    world: int
    port: int
    outdir: str
    bucket_numel: int | None = None  # zerokern stages 0-2 (None: ZeroAdamW's default)


@dataclass
class Setup:
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # one training step -> loss
    state: Callable[[], dict[str, int]]  # model-state bytes held by this rank, by kind
    optim: str  # what does the update, for the CSV


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


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # DTensor -> its shard


class StateBytes:
    """Bytes of unique tensor storages, attributed to the first kind that reaches them."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.out: dict[str, int] = {}

    def add(self, kind: str, t: torch.Tensor) -> None:
        t = _local(t)
        st = t.untyped_storage()
        key = st.data_ptr()
        if key == 0 or key in self.seen:
            return
        self.seen.add(key)
        self.out[kind] = self.out.get(kind, 0) + st.nbytes()

    def walk(self, kind: str, obj: Any, depth: int = 6, _ids: set[int] | None = None) -> None:
        """Every tensor reachable from obj through containers and object attributes."""
        ids = set() if _ids is None else _ids
        if id(obj) in ids or depth < 0:
            return
        ids.add(id(obj))
        if isinstance(obj, torch.Tensor):
            self.add(kind, obj)
            if obj.grad is not None:
                self.add(kind, obj.grad)
            return
        if isinstance(obj, nn.Module) or dist.is_available() and isinstance(obj, dist.ProcessGroup):
            return  # the model is counted as params/grads; process groups hold no state
        if isinstance(obj, dict):
            items = [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = list(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in (
            "torch",
            "deepspeed",
            "zerokern",
            __name__.split(".")[0],
        ):
            items = list(vars(obj).values())
        else:
            return
        for x in items:
            if isinstance(x, (str, bytes, int, float, bool, type(None))):
                continue
            self.walk(kind, x, depth - 1, ids)


def generic_state(model: nn.Module, *extra: Any) -> Callable[[], dict[str, int]]:
    def state() -> dict[str, int]:
        sb = StateBytes()
        params = list(model.parameters())
        for p in params:
            sb.add("params", p)
        for p in params:
            if p.grad is not None:
                sb.add("grads", p.grad)
        for obj in extra:
            sb.walk("optim", obj)
        return {k: sb.out.get(k, 0) for k in ("params", "grads", "optim")}

    return state


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


def setup_fsdp2(job: Job, model: nn.Module, device: torch.device) -> Setup:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        if job.precision == "bf16"
        else MixedPrecisionPolicy()
    )
    for blk in model.blocks:
        fully_shard(blk, mp_policy=mp_policy)
    fully_shard(model, mp_policy=mp_policy)
    kw = adamw_impl(device)
    opt = torch.optim.AdamW(model.parameters(), **HP, **kw)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        return loss

    name = f"AdamW({next(iter(kw))}) on DTensor shards"
    if job.precision == "bf16":
        name += ", MixedPrecisionPolicy(bf16, reduce bf16)"
    return Setup(step, generic_state(model, opt), name)


def setup_zerokern(job: Job, model: nn.Module, stage: int) -> Setup:
    import zerokern

    if stage == 3:
        if not hasattr(zerokern, "shard_model"):
            raise Skip("zerokern.shard_model not available (stage 3 not implemented)")
        model = zerokern.shard_model(model)
    kw = {"bucket_numel": job.bucket_numel} if job.bucket_numel else {}
    opt = zerokern.ZeroAdamW(model.parameters(), **HP, stage=stage, **kw)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        return loss

    def state() -> dict[str, int]:
        s = opt.memory_stats()
        grads = s["grads"] + s["buckets"] + s.get("comm_scratch", 0)
        return {
            "params": s["params"],
            "grads": grads,
            "optim": s["total"] - s["params"] - grads,
            "zk_comm": opt.comm_stats()["bytes"],
        }

    return Setup(step, state, f"ZeroAdamW(stage={stage})")


def setup_deepspeed(job: Job, model: nn.Module, device: torch.device, stage: int) -> Setup:
    try:
        import deepspeed
    except Exception as exc:  # not installed, or broken: never a dependency
        raise Skip(f"import deepspeed failed: {type(exc).__name__}: {exc}") from exc
    kw = adamw_impl(device)
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


# -- collective accounting from the profiler --------------------------------------------------
def comm_from_profile(prof: Any, device: torch.device, steps: int, world: int) -> dict[str, Any]:
    """Bytes (paper count) and union-of-intervals time of backend collective events."""
    by_kind: dict[str, float] = {}
    intervals: list[tuple[float, float]] = []
    for e in prof.events():
        backend, _, kind = e.name.partition(":")
        if backend not in ("gloo", "nccl") or not kind:
            continue
        nbytes = 0
        dtypes = getattr(e, "input_dtypes", None) or []
        sizes = []
        for shape, dt in zip(e.input_shapes or [], dtypes):
            if isinstance(shape, list) and shape and all(isinstance(s, int) for s in shape):
                try:
                    esz = torch.empty(0, dtype=_dtype(dt)).element_size()
                except (TypeError, KeyError):
                    continue
                sizes.append(math.prod(shape) * esz)
        if sizes:
            # all-reduce / broadcast: the tensor itself; reduce-scatter: the largest operand
            # is the full input; all-gather: the full output (gloo records only the shard).
            nbytes = max(sizes) * (2 if "all_reduce" in kind or "allreduce" in kind else 1)
            if "gather" in kind:
                nbytes = max(nbytes, world * min(sizes))
        by_kind[kind] = by_kind.get(kind, 0) + nbytes
        if device.type != "cuda":
            intervals.append((e.time_range.start, e.time_range.end))
    if device.type == "cuda":  # the NCCL kernels' own intervals on the device
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA and e.name.lower().startswith(
                "nccl"
            ):
                intervals.append((e.time_range.start, e.time_range.end))
    busy, cur_s, cur_e = 0.0, None, None
    for s, t in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, t
        else:
            cur_e = max(cur_e, t)
    if cur_e is not None:
        busy += cur_e - cur_s
    out = {"comm_bytes": sum(by_kind.values()) / steps, "comm_ms": busy / 1e3 / steps}
    out["comm_kinds"] = ",".join(f"{k}:{v / steps / MB:.2f}MB" for k, v in sorted(by_kind.items()))
    return out


_DTYPE_NAMES = {
    "float": torch.float32,
    "double": torch.float64,
    "c10::BFloat16": torch.bfloat16,
    "c10::Half": torch.float16,
    "long int": torch.int64,
    "int": torch.int32,
    "signed char": torch.int8,
    "unsigned char": torch.uint8,
    "bool": torch.bool,
    "BFloat16": torch.bfloat16,
    "Half": torch.float16,
}


def _dtype(name: str) -> torch.dtype:
    return _DTYPE_NAMES[name]


# -- one rank -----------------------------------------------------------------------------------
def worker(rank: int, job: Job) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(job.port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(job.world),
    )
    out = Path(job.outdir)
    try:
        result = run_rank(rank, job)
    except BaseException as exc:
        kind = (
            "skipped"
            if isinstance(exc, Skip)
            else ("oom" if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) else "error")
        )
        (out / f"rank{rank}.err").write_text(
            json.dumps(
                {
                    "kind": kind,
                    "msg": f"{type(exc).__name__}: {exc}".splitlines()[0][:300],
                    "traceback": traceback.format_exc(),
                }
            )
        )
        raise
    (out / f"rank{rank}.json").write_text(json.dumps(result))


def run_rank(rank: int, job: Job) -> dict[str, Any]:
    # torch 2.14 deprecates reduce_scatter_tensor / all_gather_into_tensor (the libraries
    # measured still call them): one warning per rank and call site is noise here.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    cuda = job.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    ds = job.policy.startswith("ds_")
    if ds and not cuda:
        os.environ["DS_ACCELERATOR"] = "cpu"
    if ds:
        try:
            import deepspeed
        except Exception as exc:
            raise Skip(f"import deepspeed failed: {type(exc).__name__}: {exc}") from exc
        deepspeed.utils.logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    else:
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            rank=rank,
            world_size=job.world,
            device_id=device if cuda else None,
        )
    try:
        return train(rank, job, device)
    finally:
        dist.destroy_process_group()


def train(rank: int, job: Job, device: torch.device) -> dict[str, Any]:
    cfg = GPTConfig(**job.cfg)
    torch.manual_seed(0)
    model = GPT(cfg)
    lowp = job.precision == "bf16"
    p, pol = job.policy, job.policy
    # fsdp2 keeps the fp32 model (its shard is the master); deepspeed casts it itself.
    model_dtype = (
        torch.bfloat16
        if lowp and p not in ("fsdp2",) and not p.startswith("ds_")
        else torch.float32
    )
    model = model.to(device=device, dtype=model_dtype)
    if pol == "ddp":
        s = setup_ddp(job, model, device, zero1=False)
    elif pol == "zero_redundancy":
        s = setup_ddp(job, model, device, zero1=True)
    elif pol == "fsdp2":
        s = setup_fsdp2(job, model, device)
    elif pol.startswith("zk_stage"):
        s = setup_zerokern(job, model, int(pol[-1]))
    elif pol.startswith("ds_stage"):
        s = setup_deepspeed(job, model, device, int(pol[-1]))
    else:
        raise ValueError(f"unknown policy {pol!r}")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()
    times, losses = [], []
    for step in range(1, job.steps + 1):
        x, y = batch(step, rank, job.micro_batch, cfg.seq, cfg.vocab, device)
        sync()
        t0 = time.perf_counter()
        loss = s.step(x, y)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach().float()))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"loss is {losses[-1]} at step {step}")
    res: dict[str, Any] = {"times": times, "losses": losses, "optim": s.optim}
    res.update({f"{k}_bytes": v for k, v in s.state().items()})
    if device.type == "cuda":
        res["max_alloc"] = torch.cuda.max_memory_allocated(device)
        res["max_reserved"] = torch.cuda.max_memory_reserved(device)
    else:
        res["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if job.prof_steps > 0:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        dist.barrier()
        with profile(activities=acts, record_shapes=True) as prof:
            for step in range(job.steps + 1, job.steps + 1 + job.prof_steps):
                x, y = batch(step, rank, job.micro_batch, cfg.seq, cfg.vocab, device)
                s.step(x, y)
            sync()
        res.update(comm_from_profile(prof, device, job.prof_steps, job.world))
    return res


# -- driver -------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


def run_policy(job: Job, timeout: float) -> dict[str, Any]:
    """Spawn the ranks, wait (at most `timeout` s), combine their results into one row."""
    t0 = time.perf_counter()
    ctx = mp.start_processes(
        worker, args=(job,), nprocs=job.world, join=False, start_method="spawn"
    )
    failure = None
    try:
        while not ctx.join(timeout=5):
            if time.perf_counter() - t0 > timeout:
                failure = f"error: timed out after {timeout:.0f} s"
                break
    except Exception as exc:  # a rank raised or died: the context has ended the others
        failure = f"error: {type(exc).__name__}"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
            p.join(5)
    out = Path(job.outdir)
    errs = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.err"))]
    if errs:
        e = next((x for x in errs if x["kind"] != "error"), errs[0])
        if e["kind"] == "error":
            print(f"# {job.policy} failed:\n{e['traceback']}", file=sys.stderr)
        return {"status": f"{e['kind']}: {e['msg']}" if e["kind"] != "oom" else "oom"}
    ranks = [
        json.loads((out / f"rank{r}.json").read_text())
        for r in range(job.world)
        if (out / f"rank{r}.json").exists()
    ]
    if failure or len(ranks) != job.world:
        return {"status": failure or "error: a rank wrote no result"}
    per_step = [max(r["times"][i] for r in ranks) for i in range(job.steps)]
    window = per_step[2:] if job.steps >= 3 else per_step[-1:]
    med = statistics.median(window)
    row: dict[str, Any] = {
        "status": "ok",
        "steps_s": 1.0 / med,
        "step_ms": med * 1e3,
        "step_ms_min": min(window) * 1e3,
        "step_ms_max": max(window) * 1e3,
        "first_step_ms": per_step[0] * 1e3,
    }
    for k in ("params", "grads", "optim"):
        row[f"{k}_mb"] = max(r.get(f"{k}_bytes", 0) for r in ranks) / MB
    row["state_mb"] = (
        max(sum(r.get(f"{k}_bytes", 0) for k in ("params", "grads", "optim")) for r in ranks) / MB
    )
    if "comm_bytes" in ranks[0]:
        row["comm_mb"] = ranks[0]["comm_bytes"] / MB
        row["comm_ms"] = max(r["comm_ms"] for r in ranks)
        row["comm_kinds"] = ranks[0]["comm_kinds"]
    if "zk_comm_bytes" in ranks[0]:
        row["zk_comm_mb"] = ranks[0]["zk_comm_bytes"] / MB
    if "rss" in ranks[0]:
        row["rss_mb"] = max(r["rss"] for r in ranks) / MB
    if "max_alloc" in ranks[0]:
        row["max_alloc_mb"] = max(r["max_alloc"] for r in ranks) / MB
        row["max_reserved_mb"] = max(r["max_reserved"] for r in ranks) / MB
    row["loss"] = statistics.fmean(r["losses"][-1] for r in ranks)
    row["optim"] = ranks[0]["optim"]
    return row


def markdown(rows: list[dict[str, Any]], header: str) -> str:
    cols = [
        ("policy", "policy"),
        ("status", "status"),
        ("steps_s", "steps/s"),
        ("step_ms", "step ms (median)"),
        ("x_time_vs_ddp", "time / ddp"),
        ("state_mb", "model state MB/rank"),
        ("x_mem_vs_ddp", "mem / ddp"),
        ("comm_mb", "comm MB/step"),
        ("comm_ms", "comm ms/step"),
        ("loss", "final loss"),
    ]
    lines = [
        header,
        "",
        "| " + " | ".join(c[1] for c in cols) + " |",
        "|" + "|".join("---" if i < 2 else "---:" for i in range(len(cols))) + "|",
    ]
    for r in rows:
        cells = []
        for k, _ in cols:
            v = r.get(k, "")
            if k == "step_ms" and v != "":
                v = f"{v:.0f} ({r['step_ms_min']:.0f}-{r['step_ms_max']:.0f})"
            elif isinstance(v, float):
                v = (
                    f"{v:.3f}"
                    if k in ("steps_s", "x_time_vs_ddp", "x_mem_vs_ddp", "loss")
                    else f"{v:.1f}"
                )
            cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"])
    ap.add_argument("--steps", type=int, help="timed steps (default 30; --quick: 4)")
    ap.add_argument(
        "--prof-steps",
        type=int,
        default=2,
        help="extra steps under torch.profiler for comm bytes/time (0: none)",
    )
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, help="per rank (default 4; --quick: 2)")
    ap.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=POLICIES)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per policy")
    ap.add_argument("--out", help="folder for the CSV (default bench/results)")
    ap.add_argument("--bucket-numel", type=int,
                    help="zerokern stages 0-2: bucket_numel (default: ZeroAdamW's own)")
    args = ap.parse_args(argv)

    ref = QUICK if args.quick else REFERENCE
    cfg: GPTConfig = ref["cfg"]
    steps = args.steps or ref["steps"]
    mb = args.micro_batch or ref["micro_batch"]
    device = torch.device(args.device)
    if device.type == "cuda" and torch.cuda.device_count() < args.world_size:
        ap.error(
            f"--world-size {args.world_size} needs as many GPUs ({torch.cuda.device_count()} here)"
        )
    if device.type == "cpu":
        torch.set_num_threads(1)  # the ranks' setting, so machine() reports it
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # the profiler's start/stop chatter
    meta = H.machine(device)
    meta.update(
        world_size=args.world_size,
        backend="nccl" if device.type == "cuda" else "gloo",
        model=f"GPT {cfg.n_layer}x{cfg.n_embd}, {cfg.n_head} heads, vocab {cfg.vocab}, "
        f"seq {cfg.seq}, {cfg.num_params() / 1e6:.2f}M params",
        micro_batch=mb,
        global_batch=mb * args.world_size,
        steps=steps,
    )
    command = "python bench/bench_zero.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(
        f"# {meta['device']} | torch {meta['torch']} | {meta['date']} | {meta['model']} | "
        f"{args.world_size} ranks ({meta['backend']}), micro-batch {mb}, {steps} steps"
    )
    for prec in args.precision:
        rows: list[dict[str, Any]] = []
        for pol in args.policies:
            row: dict[str, Any] = {"policy": pol, "precision": prec}
            if pol == "zk_stage3":
                import zerokern

                if not hasattr(zerokern, "shard_model"):
                    row["status"] = "skipped: zerokern.shard_model not available"
            if pol.startswith("ds_"):
                import importlib.util

                if importlib.util.find_spec("deepspeed") is None:
                    row["status"] = "skipped: deepspeed not installed (optional provider)"
            if "status" not in row:
                with tempfile.TemporaryDirectory(prefix="bench_zero_") as tmp:
                    job = Job(
                        pol,
                        prec,
                        device.type,
                        asdict(cfg),
                        mb,
                        steps,
                        args.prof_steps,
                        args.world_size,
                        free_port(),
                        tmp,
                        args.bucket_numel,
                    )
                    row.update(run_policy(job, args.timeout))
            if row["status"] != "ok":
                print(f"# {pol} ({prec}): {row['status']}")
            rows.append({**row, **meta})
        base = next((r for r in rows if r["policy"] == "ddp" and r["status"] == "ok"), None)
        for r in rows:
            if base and r["status"] == "ok":
                r["x_time_vs_ddp"] = r["step_ms"] / base["step_ms"]
                r["x_mem_vs_ddp"] = r["state_mb"] / base["state_mb"]
        print(f"\n## {prec}")
        cols = [
            "policy",
            "status",
            "steps_s",
            "step_ms",
            "step_ms_min",
            "step_ms_max",
            "x_time_vs_ddp",
            "state_mb",
            "x_mem_vs_ddp",
            "params_mb",
            "grads_mb",
            "optim_mb",
            "comm_mb",
            "comm_ms",
            "loss",
        ]
        cols += ["rss_mb"] if device.type == "cpu" else ["max_alloc_mb", "max_reserved_mb"]
        H.print_table([{**r, "status": r["status"][:40]} for r in rows], cols)
        for r in rows:
            if r["status"] == "ok":
                print(
                    f"#   {r['policy']}: {r['optim']}; comm {r.get('comm_kinds', '')}"
                    + (f"; comm_stats {r['zk_comm_mb']:.2f} MB" if "zk_comm_mb" in r else "")
                )
        name = f"bench_zero_{device.type}_{prec}_{meta['date']}{'_quick' if args.quick else ''}"
        path = H.write_csv(rows, name + ".csv", args.out)
        header = (
            f"**{prec}**, {meta['device']}, torch {meta['torch']}, {meta['date']}: "
            f"{meta['model']}, {args.world_size} ranks over {meta['backend']}, micro-batch "
            f"{mb}/rank, median of steps 3..{steps}.  \n`{command}`"
        )
        print("\n" + markdown(rows, header))
        print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
