"""The Muon schedules that bench_muon.py compares, one per name, built on one rank.

Every schedule trains its own copy of the same seeded GPT on the same batches, with Muon for
the hidden 2-D matrices (:func:`muon_split`) and AdamW for everything else:

  owner-s{1,2,3}  zerokern: ``ZeroOptimizer(matrices, torch.optim.Muon, stage=s)`` beside
                  ``ZeroOptimizer(rest, torch.optim.AdamW, stage=s)``: each matrix's update
                  goes to one owner rank, which runs Newton-Schulz once (zero/muon_step.py);
                  the exchange overlapped with the step (zerokern.comm.shard_pipeline)
  owner-s{1,2,3}-sync  the same with the exchange synchronous (``set_chunks(0)``: two
                  blocking all-to-alls), for the side-by-side (not in the default list)
  redundant       the baseline (DeepSpeed's fix for its issue 7807): every rank all-reduces
                  every gradient and runs ``torch.optim.Muon`` on every matrix, AdamW on the
                  rest; torch collectives directly
  single          one process (rank 0; the others wait): torch's Muon + AdamW on its own
                  gradients, no communication: the Newton-Schulz work done once
  ds-s{1,2,3}     DeepSpeed's own Muon (``"optimizer": {"type": "Muon"}``) at its ZeRO stage s
                  on gloo CPU ranks (optional: skipped with the reason when it does not run)

A step returns its phases in milliseconds on this rank: ``step``, ``fwdbwd`` (forward and
backward, the gradient hooks' communication included), ``opt`` (the whole optimizer step,
Muon and AdamW), ``muon`` (the Muon optimizer's step), ``ns`` (Newton-Schulz alone: the time
inside torch's, zerokern's or DeepSpeed's NS function on this rank), ``exchange`` (zerokern:
the owner exchange's collectives, those labelled "Muon"; redundant: the Muon gradients'
all-reduce); ``*_cpu`` the same in CPU time of the rank's thread (one torch thread per rank:
the work itself, which other processes sharing the cores do not stretch as they stretch the
wall clock; a wait in a collective costs none); ``step_cpu`` the process's CPU time of the
step (every thread, gloo's included). Bytes per step as the ZeRO paper counts them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.optim._muon as torch_muon
from gpt import GPT, GPTConfig
from torch import nn

import zerokern
from zerokern.zero import muon_step

ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
SCHEDULES = ["owner-s1", "owner-s2", "owner-s3", "redundant", "single", "ds-s1", "ds-s2",
             "ds-s3"]
CHOICES = [*SCHEDULES, "owner-s1-sync", "owner-s2-sync", "owner-s3-sync"]


class Skip(Exception):
    """The schedule cannot run in this environment (its row says 'skipped: ...')."""


class NSClock:
    """Wall and CPU milliseconds spent inside Newton-Schulz since the last ``reset``:
    torch's, zerokern's and DeepSpeed's NS functions are wrapped once, at import."""

    wall = 0.0
    cpu = 0.0

    @classmethod
    def reset(cls) -> None:
        cls.wall = cls.cpu = 0.0

    @classmethod
    def wrap(cls, module: Any, name: str) -> None:
        fn = getattr(module, name)

        def timed(*a: Any, **k: Any) -> Any:
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                cls.wall += (time.perf_counter() - t) * 1e3
                cls.cpu += (time.thread_time() - c) * 1e3

        setattr(module, name, timed)


NSClock.wrap(torch_muon, "_zeropower_via_newtonschulz")  # torch.optim.Muon's NS
NSClock.wrap(muon_step, "_ns")  # zerokern's owners' batched NS


def muon_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the hidden 2-D matrices, everything else): Muon takes the blocks' weight matrices;
    embeddings, the LM head, biases and norms stay with AdamW, as Muon's authors use it."""
    muon, other = [], []
    for name, p in model.named_parameters():
        (muon if p.ndim == 2 and name.startswith("blocks.") else other).append(p)
    return muon, other


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


class Schedule:
    """One schedule on this rank: ``step(x, y)`` -> phases, ``bytes()`` -> its counts.
    ``ranks``: "all" (a collective step) or "rank0" (the single-process schedule)."""

    ranks = "all"
    what = ""

    def optimizer_step(self) -> dict[str, float]:
        """The optimizer step; returns the Muon step's and its exchange's wall and CPU ms
        (``muon``, ``muon_cpu``, ``exchange``, ``exchange_cpu``)."""
        raise NotImplementedError

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, loss = self.model(x, y)
        loss.backward()
        return loss

    def step(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        NSClock.reset()
        c0, t0 = time.process_time(), time.perf_counter()
        loss = self.forward_backward(x, y)
        fwdbwd = _ms(t0)
        t1 = time.perf_counter()
        parts = self.optimizer_step()
        opt = _ms(t1)
        return {"step": _ms(t0), "step_cpu": (time.process_time() - c0) * 1e3,
                "fwdbwd": fwdbwd, "opt": opt, **parts,
                "ns": NSClock.wall, "ns_cpu": NSClock.cpu, "loss": float(loss.detach())}

    def bytes(self) -> dict[str, Any]:
        return {}


class Owner(Schedule):
    """zerokern's two ZeroOptimizers at stage ``stage``; the Muon one's collectives labelled
    "Muon" (the owner exchange) are timed and counted by wrapping its Comm's methods."""

    def __init__(self, cfg: GPTConfig, stage: int, sync: bool = False) -> None:
        torch.manual_seed(0)
        model = GPT(cfg)
        if stage == 3:
            model = zerokern.shard_model(model)
        self.model = model
        muon, other = muon_split(model)
        self.om = zerokern.ZeroOptimizer(muon, torch.optim.Muon, stage=stage, **MUON)
        self.oa = zerokern.ZeroOptimizer(other, torch.optim.AdamW, stage=stage, **ADAMW)
        if sync:
            self.om._rule_state.set_chunks(0)
        self.what = (f"zerokern ZeroOptimizer(torch.optim.Muon) + ZeroOptimizer(AdamW) at "
                     f"stage {stage}: one owner per matrix, exchange "
                     f"{'synchronous' if sync else 'overlapped'}")
        self.ex_ms = self.ex_cpu = 0.0
        self.ex_bytes: dict[str, int] = {}
        comm = self.om.comm
        # Stage 0's exchange is an all-gather; stages 1-3's two uneven all-to-alls
        # (zerokern.comm.shard_exchange), whose label comes after the split sizes.
        for kind in ("reduce_scatter", "all_gather", "all_to_all"):
            if hasattr(comm, kind):
                setattr(comm, kind, self._timed(kind, getattr(comm, kind)))
        comm.all_to_all_uneven = self._timed_uneven(comm.all_to_all_uneven, comm.rank)

    def _clock(self, kind: str, nbytes: int, call: Callable[[], Any]) -> Any:
        t, c = time.perf_counter(), time.thread_time()
        try:
            return call()
        finally:
            self.ex_ms += _ms(t)
            self.ex_cpu += (time.thread_time() - c) * 1e3
            self.ex_bytes[kind] = self.ex_bytes.get(kind, 0) + nbytes

    def _timed(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(out: torch.Tensor, inp: torch.Tensor, label: str = "", *a: Any,
                **k: Any) -> Any:
            if not str(label).startswith("Muon"):
                return fn(out, inp, label, *a, **k)
            moved = out if kind == "all_gather" else inp  # the paper's count
            return self._clock(kind, moved.numel() * moved.element_size(),
                               lambda: fn(out, inp, label, *a, **k))

        return run

    def _timed_uneven(self, fn: Callable[..., Any], rank: int) -> Callable[..., Any]:
        def run(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                in_splits: list[int], label: str = "", async_op: bool = False) -> Any:
            if not str(label).startswith("Muon"):
                return fn(out, inp, out_splits, in_splits, label, async_op)
            # What comm_stats() counts: the elements sent to the other ranks.
            sent = (sum(in_splits) - in_splits[rank]) * inp.element_size()
            handle = self._clock("all_to_all", sent,
                                 lambda: fn(out, inp, out_splits, in_splits, label, async_op))
            if handle is not None:  # overlapped: the exchange's time is also its wait
                wait = handle.wait
                handle.wait = lambda *a, **k: self._clock("all_to_all", 0,
                                                          lambda: wait(*a, **k))
            return handle

        return run

    def optimizer_step(self) -> dict[str, float]:
        self.ex_ms, self.ex_cpu, self.ex_bytes = 0.0, 0.0, {}
        t, c = time.perf_counter(), time.thread_time()
        self.om.step()
        out = {"muon": _ms(t), "muon_cpu": (time.thread_time() - c) * 1e3,
               "exchange": self.ex_ms, "exchange_cpu": self.ex_cpu}
        self.oa.step()
        self.om.zero_grad()
        self.oa.zero_grad()
        return out

    def bytes(self) -> dict[str, Any]:
        # A collective (every rank calls bytes() for the same schedules in the same order):
        # every rank's shard of every owner's matrices, for zerokern.formulas.
        plan = self.om._rule_state.plan
        mine = [0] * plan.world_size
        for pc in self.om.layout.pieces:
            if pc.param >= 0:
                mine[plan.units[pc.param].owner] += pc.numel
        held: list[Any] = [None] * plan.world_size
        dist.all_gather_object(held, mine)
        return {"held": ";".join(" ".join(map(str, row)) for row in held),
                "rank": self.om.comm.rank,
                "muon_opt_bytes": self.om.comm_stats()["bytes"],
                "adamw_opt_bytes": self.oa.comm_stats()["bytes"],
                "exchange_bytes": sum(self.ex_bytes.values()),
                "exchange_kinds": " ".join(f"{k}={v}" for k, v in sorted(self.ex_bytes.items())),
                "owned_numel": " ".join(map(str, plan.owned_numel)),
                "owner_ns_share": max(plan.loads) / max(1, sum(plan.loads)),
                "muon_memory": " ".join(f"{k}={v}" for k, v in self.om.memory_stats().items()
                                        if k.startswith("muon_"))}


class Redundant(Schedule):
    """One all-reduce of every gradient (Muon's first, timed as its exchange), then
    ``torch.optim.Muon`` on every matrix on every rank and AdamW on the rest."""

    def __init__(self, cfg: GPTConfig, world: int) -> None:
        torch.manual_seed(0)
        self.model = GPT(cfg)
        self.world = world
        self.muon_params, self.other_params = muon_split(self.model)
        self.muon = torch.optim.Muon(self.muon_params, **MUON)
        self.adamw = torch.optim.AdamW(self.other_params, **ADAMW, foreach=True)
        self.bufs = [torch.zeros(sum(p.numel() for p in ps))
                     for ps in (self.muon_params, self.other_params)]
        self.counted = [0, 0]
        self.what = ("redundant: all-reduce, torch.optim.Muon on every matrix on every rank "
                     "(DeepSpeed's fix for #7807), torch collectives")

    @torch.no_grad()
    def _average(self, i: int, params: list[nn.Parameter]) -> None:
        buf = self.bufs[i]
        views, off = [], 0
        for p in params:
            views.append(buf.narrow(0, off, p.numel()).view_as(p))
            off += p.numel()
        torch._foreach_copy_(views, [p.grad for p in params])
        dist.all_reduce(buf)
        buf.div_(self.world)
        self.counted[i] = 2 * buf.numel() * buf.element_size()  # the paper's all-reduce
        torch._foreach_copy_([p.grad for p in params], views)

    def optimizer_step(self) -> dict[str, float]:
        t, c = time.perf_counter(), time.thread_time()
        self._average(0, self.muon_params)
        out = {"exchange": _ms(t), "exchange_cpu": (time.thread_time() - c) * 1e3}
        self.muon.step()
        out.update(muon=_ms(t), muon_cpu=(time.thread_time() - c) * 1e3)
        self._average(1, self.other_params)
        self.adamw.step()
        self.model.zero_grad(set_to_none=True)
        return out

    def bytes(self) -> dict[str, Any]:
        return {"muon_opt_bytes": self.counted[0], "adamw_opt_bytes": self.counted[1],
                "exchange_bytes": self.counted[0]}


class Single(Redundant):
    """One process alone: the same optimizers, no communication."""

    ranks = "rank0"

    def __init__(self, cfg: GPTConfig, world: int) -> None:
        super().__init__(cfg, 1)
        self.what = "single: torch.optim.Muon + AdamW in one process (rank 0 alone)"

    def _average(self, i: int, params: list[nn.Parameter]) -> None:
        pass


class _DSNames(nn.Module):
    """The GPT under names DeepSpeed's Muon tagging reads: it puts every 2-D parameter whose
    name has neither "embed" nor "lm_head" under Muon, so the embeddings and the head are
    registered first under such names (a parameter is named once, by its first path) and
    DeepSpeed picks the same hidden matrices as the other schedules."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.embed = nn.ModuleDict({"tok": gpt.tok_emb, "pos": gpt.pos_emb})
        self.lm_head = gpt.head
        self.gpt = gpt

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
        return self.gpt(x, y)


class DeepSpeedMuon(Schedule):
    """DeepSpeed's own Muon (MuonWithAuxAdam) under its ZeRO stage ``stage``, its AdamW for
    the rest; the NS of its ``ns_method`` is timed by wrapping its functions."""

    def __init__(self, cfg: GPTConfig, micro_batch: int, stage: int, ns_method: str) -> None:
        if os.environ.get("DS_ACCELERATOR") != "cpu":
            raise Skip("DS_ACCELERATOR=cpu must be set before deepspeed is imported")
        try:
            import deepspeed
            from deepspeed.runtime.zero.muon import original_muon
        except Exception as exc:  # never a dependency
            raise Skip(f"import deepspeed failed: {type(exc).__name__}: {exc}") from exc
        if not getattr(original_muon, "_bench_wrapped", False):
            for fn in ("zeropower_via_newtonschulz5", "zeropower_via_gram_newtonschulz"):
                if hasattr(original_muon, fn):
                    NSClock.wrap(original_muon, fn)
            original_muon._bench_wrapped = True
        torch.manual_seed(0)
        gpt = GPT(cfg)
        self.model = gpt
        self.muon_params, _ = muon_split(gpt)
        config = {
            "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "Muon", "params": {
                "lr": ADAMW["lr"], "muon_lr": MUON["lr"], "adam_lr": ADAMW["lr"],
                "momentum": MUON["momentum"], "weight_decay": MUON["weight_decay"],
                "betas": list(ADAMW["betas"]), "eps": ADAMW["eps"], "ns_method": ns_method}},
            "zero_optimization": {"stage": stage},
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        threads = torch.get_num_threads()
        try:
            self.engine, _, _, _ = deepspeed.initialize(
                model=_DSNames(gpt), model_parameters=_DSNames(gpt).parameters(), config=config)
        except Exception as exc:
            raise Skip(f"DeepSpeed Muon at ZeRO-{stage} does not start here: "
                       f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from exc
        torch.set_num_threads(threads)  # whatever DeepSpeed's CPU accelerator set
        tagged = {id(p) for p in gpt.parameters() if getattr(p, "use_muon", False)}
        if stage < 3 and tagged != {id(p) for p in self.muon_params}:
            raise Skip(f"DeepSpeed tagged {len(tagged)} Muon parameters, not the "
                       f"{len(self.muon_params)} hidden matrices")
        self.what = (f"deepspeed {deepspeed.__version__} Muon (ns_method={ns_method!r}) at "
                     f"ZeRO-{stage}, its AdamW for the rest")

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        _, loss = self.engine(x, y)
        self.engine.backward(loss)
        return loss

    def optimizer_step(self) -> dict[str, float]:
        self.engine.step()
        nan = float("nan")  # its Muon runs inside its step or its backward: not apart
        return {"muon": nan, "muon_cpu": nan, "exchange": nan, "exchange_cpu": nan}


def build(name: str, cfg: GPTConfig, world: int, micro_batch: int,
          ds_ns_method: str) -> Schedule:
    if name.startswith("owner-s"):
        return Owner(cfg, int(name[len("owner-s")]), sync=name.endswith("-sync"))
    if name == "redundant":
        return Redundant(cfg, world)
    if name == "single":
        return Single(cfg, world)
    if name.startswith("ds-s"):
        return DeepSpeedMuon(cfg, micro_batch, int(name[-1]), ds_ns_method)
    raise ValueError(f"unknown schedule {name!r}")
