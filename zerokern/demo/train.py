"""One rank's side of ``python -m zerokern demo``: train the demo GPT once per ZeRO policy.

Every policy starts from the same weights (``torch.manual_seed(seed)`` before building the
model) and sees the same global batches, so the losses should agree across policies; what
differs is what each rank holds and sends, which ``ZeroAdamW.memory_stats()`` and
``comm_stats()`` report after the last step.

Then the compressed bars: the same model under stage 3 with a compressed optimizer state
(``ZeroAdamW(moments=, master=)``, e.g. int8 moments). They are memory only, and untrained:
stage 3 allocates its state when the optimizer is built, so ``memory_stats()`` reads the
buffers it holds without a step (no kernel runs, and the demo's runtime barely changes).
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import zerokern
from zerokern.comm import Comm
from zerokern.zero.registry import runtime_of_module

from .data import VOCAB, get_batch
from .gpt import GPT, Block, config_for

__all__ = ["DemoOptions", "COMPRESSED_STAGE", "compressed_formats", "lr_at", "measure_compressed",
           "parse_format", "release_all", "train_all", "train_policy"]

COMPRESSED_STAGE = 3  # the compressed bars' stage: its state exists before the first step


@dataclass(frozen=True)
class DemoOptions:
    stages: tuple[int, ...] = (0, 1, 2, 3)
    steps: int = 50
    model_size: str = "small"
    precision: str = "bf16"
    micro_batch: int = 8
    lr: float = 1e-3
    seed: int = 0
    bucket_numel: int | None = None  # None: Ψ/8, i.e. 8 gradient buckets
    max_grad_norm: float | None = None
    # The compressed bars, "MOMENTS[:MASTER]" each ("int8", "int8:none"); None: the
    # precision's default (compressed_formats), () none.
    compressed: tuple[str, ...] | None = None


def parse_format(spec: str) -> tuple[str, str]:
    """``"int8"`` -> ("int8", "fp32"), ``"int8:none"`` -> ("int8", "none"): ZeroAdamW's
    (moments, master) of a compressed bar."""
    moments, _, master = spec.partition(":")
    return moments, master or "fp32"


def compressed_formats(opts: DemoOptions) -> tuple[tuple[str, str], ...]:
    """The (moments, master) of each compressed bar: by default int8 moments, and with bf16
    parameters int8 moments without a master too (master="none" needs bf16)."""
    specs = opts.compressed
    if specs is None:
        specs = ("int8", "int8:none") if opts.precision == "bf16" else ("int8",)
    return tuple(parse_format(s) for s in specs)


def lr_at(step: int, steps: int, lr: float) -> float:
    """Linear warm-up over the first 10% of the steps (but at least 20 steps, or a third of a
    shorter run: a short run's loss curve does not spike), then cosine decay to lr / 10."""
    warm = max(1, steps // 10, min(20, steps // 3))
    if step < warm:
        return lr * (step + 1) / warm
    frac = (step - warm) / max(1, steps - warm)
    return lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def _progress(stage: int, done: int, total: int, loss: float, secs: float) -> None:
    """A plain-text progress bar on stderr (one line per policy when not a terminal)."""
    tty = sys.stderr.isatty()
    if not tty and done < total:
        return
    width = 24
    fill = width * done // total
    bar = "#" * fill + "-" * (width - fill)
    line = (
        f"stage {stage} [{bar}] {done:>4}/{total} rank-0 loss {loss:6.3f} "
        f"{secs / max(done, 1):5.2f} s/step"
    )
    end = "\n" if done == total else ""
    sys.stderr.write(("\r" if tty else "") + line + end)
    sys.stderr.flush()


def train_policy(
    stage: int, opts: DemoOptions, device: torch.device, progress: Callable[..., None] | None = None
) -> dict:
    """Train with ``zerokern.parallelize(model, stage=stage)``'s ZeroAdamW; returns this
    rank's measurements."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config_for(opts.model_size, VOCAB)
    dtype = torch.bfloat16 if opts.precision == "bf16" else torch.float32
    torch.manual_seed(opts.seed)
    model = GPT(cfg).to(device=device, dtype=dtype)
    psi = model.num_params()
    # Buckets a fraction of the model, as with a large model and zerokern's default size;
    # zerokern pads only the last one, up to the bucket size (stages 0-2).
    bucket_numel = opts.bucket_numel or -(-psi // 8)
    # Stage 3: one unit per block (the model is partitioned before the optimizer is built).
    opt = zerokern.parallelize(
        model,
        stage=stage,
        unit_classes=(Block,),
        lr=opts.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        bucket_numel=bucket_numel,
        max_grad_norm=opts.max_grad_norm,
    )
    losses, times = [], []
    start = time.perf_counter()
    for step in range(opts.steps):
        x, y = get_batch(step, rank, world, opts.micro_batch, cfg.seq, device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, opts.steps, opts.lr)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.detach().float())
        if progress is not None:
            progress(stage, step + 1, opts.steps, losses[-1].item(), time.perf_counter() - start)
    # Mean over ranks of each rank's mean token loss = the global batch's loss (equal shares).
    loss_t = torch.stack(losses).to(device)
    Comm().all_reduce(loss_t, "demo losses", count=False)
    mem = opt.memory_stats()
    comm = opt.comm_stats()
    if stage == 3:
        rt = runtime_of_module(model)
        psi_padded = sum(u.plan.padded_numel for u in rt.units)
    else:
        psi_padded = opt.layout.flat_numel
    return {
        "stage": stage,
        "moments": "fp32",
        "master": "fp32",
        "trained": True,
        "rank": rank,
        "world": world,
        "psi": psi,
        "psi_padded": psi_padded,
        "param_bytes": torch.empty(0, dtype=dtype).element_size(),
        "losses": (loss_t / world).tolist(),
        "step_s": times,
        "memory": {k: int(v) for k, v in mem.items()},
        "comm_elements": int(comm["elements"]),
        "comm_per_kind": {k: int(v["elements"]) for k, v in comm["per_kind"].items()},
    }


def measure_compressed(moments: str, master: str, opts: DemoOptions,
                       device: torch.device) -> dict:
    """The demo GPT under stage 3 with ``ZeroAdamW(moments=moments, master=master)``: this
    rank's memory_stats() as soon as the optimizer exists (stage 3 allocates its state then),
    and how many elements the parameters too small to compress hold (counted from the
    parameters' sizes, for the report's independent check of the fp32 side moments)."""
    from ..formulas import MIN_COMPRESSED_NUMEL

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = config_for(opts.model_size, VOCAB)
    dtype = torch.bfloat16 if opts.precision == "bf16" else torch.float32
    torch.manual_seed(opts.seed)
    model = GPT(cfg).to(device=device, dtype=dtype)
    small = sum(p.numel() for p in model.parameters() if p.numel() < MIN_COMPRESSED_NUMEL)
    opt = zerokern.parallelize(model, stage=COMPRESSED_STAGE, unit_classes=(Block,),
                               lr=opts.lr, moments=moments, master=master)
    rt = runtime_of_module(model)
    return {
        "stage": COMPRESSED_STAGE,
        "moments": moments,
        "master": master,
        "trained": False,
        "rank": rank,
        "world": world,
        "psi": model.num_params(),
        "psi_padded": sum(u.plan.padded_numel for u in rt.units),
        "param_bytes": torch.empty(0, dtype=dtype).element_size(),
        "small_numel": small,
        "losses": [],
        "memory": {k: int(v) for k, v in opt.memory_stats().items()},
        "comm_elements": 0,
        "comm_per_kind": {},
    }


def train_all(opts: DemoOptions, device: torch.device) -> list[dict] | None:
    """Every policy in turn on this rank, then the compressed bars; rank 0 gets one merged
    record per policy (step times: the slowest rank's; memory and communication: every
    rank's) and per bar (memory: every rank's), other ranks None."""
    rank = dist.get_rank()
    progress = _progress if rank == 0 else None
    merged = []
    for moments, master in compressed_formats(opts):
        if master == "none" and opts.precision != "bf16":
            raise ValueError(f"the compressed bar {moments}:none needs bf16 parameters "
                             f"(master='none'), not {opts.precision}")
    for stage in opts.stages:
        mine = train_policy(stage, opts, device, progress)
        # ZeroAdamW and shard_model leave reference cycles (hooks that hold the optimizer or
        # runtime): collect them now, so that one policy's buffers are gone before the next
        # starts.
        gc.collect()
        # Through zerokern's Comm, whose collectives keep their tensors until gloo let go.
        everyone: list[dict] = Comm().all_gather_object(mine, "demo records")
        if rank != 0:
            continue
        rec = dict(everyone[0])
        step_s = [max(r["step_s"][i] for r in everyone) for i in range(opts.steps)]
        warm = min(3, opts.steps // 2)
        rec["step_s"] = step_s
        rec["step_ms_median"] = 1e3 * statistics.median(step_s[warm:])
        rec["memory_by_rank"] = [r["memory"] for r in everyone]
        rec["comm_by_rank"] = [r["comm_elements"] for r in everyone]
        merged.append(rec)
    for moments, master in compressed_formats(opts):
        mine = measure_compressed(moments, master, opts, device)
        gc.collect()  # as above: this bar's buffers are gone before the next
        everyone = Comm().all_gather_object(mine, "demo records")
        if rank == 0:
            rec = dict(everyone[0])
            rec["step_s"], rec["step_ms_median"] = [], 0.0
            rec["memory_by_rank"] = [r["memory"] for r in everyone]
            rec["comm_by_rank"] = [r["comm_elements"] for r in everyone]
            merged.append(rec)
    return merged if rank == 0 else None


def release_all() -> None:
    """Destroy the process group. Nothing else is needed for a clean exit: zerokern's
    collectives keep their tensors until the backend has released them (zerokern.comm)."""
    dist.destroy_process_group()
