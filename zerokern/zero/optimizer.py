"""ZeroAdamW: ZeRO stages 0-3 as a drop-in replacement for DDP + torch.optim.AdamW.

This file only sequences what every stage shares: argument checks, param groups, gradient
hooks, the layout (planned in layout.py, pure), the one norm-and-flags all-reduce per step,
clipping, the loss scaler, step counts, the sharded-state interface and the state dict. What
differs by stage (buffers, reduction and averaging, the update, the gather) is the stage's
engine in stages/.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..comm import Comm
from .layout import Layout, build_layout, build_stage3_layout
from .registry import runtime_of_param
from .scaler import LossScaler
from .shards import ParamShard, ShardRange
from .stages import ENGINES, Engine, Run
from .stages.flat import planned_flat_memory
from .validate import check_hparams, check_same_on_all_ranks, common_dtype_device


class ZeroAdamW(torch.optim.Optimizer):
    """AdamW with ZeRO partitioning across the ranks of ``process_group``.

    stage 0: DDP equivalent (bucketed all-reduce, fused step over everything);
    stage 1: optimizer state (fp32 master for 16-bit params, both moments) sharded 1/N;
    stage 2: gradients sharded as well, through constant-size buckets.
    Stage 3 is ``shard_model`` + ``stage=3``. Without an initialised process group it runs
    as world size 1. Gradients are averaged over the group by the optimizer itself: do not
    wrap the model in DDP.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        stage: int = 2,
        process_group: Any = None,
        bucket_numel: int | None = None,
        max_grad_norm: float | None = None,
        loss_scale: float | str | None = None,
        overlap_comm: bool = True,
        backend: str | None = None,
    ) -> None:
        check_hparams(lr, betas, eps, weight_decay)
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
        if bucket_numel is not None and (isinstance(bucket_numel, bool)
                                         or not isinstance(bucket_numel, int)
                                         or bucket_numel < 1):
            raise ValueError(f"bucket_numel must be a positive int, got {bucket_numel!r}")
        if max_grad_norm is not None and not float(max_grad_norm) > 0:
            raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        for gi, g in enumerate(self.param_groups):
            check_hparams(g["lr"], g["betas"], g["eps"], g["weight_decay"],
                           f" (param group {gi})")
        self.stage = stage
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.scaler = LossScaler.from_arg(loss_scale)
        self.backend = backend
        self.last_grad_norm: float | None = None

        managed = [[p for p in g["params"] if p.requires_grad] for g in self.param_groups]
        self._params: list[torch.nn.Parameter] = [p for ps in managed for p in ps]
        if not self._params:
            raise ValueError("params: no parameter requires grad; nothing to optimize")
        self._rt = self._stage3_runtime(stage)
        self.comm = self._rt.comm if self._rt is not None else Comm(process_group)
        self._shapes = [self._rt.shape_of(p) if self._rt else p.shape for p in self._params]
        self.dtype, self.device = common_dtype_device(self._params)
        self._bucket_numel = bucket_numel
        self._overlap = overlap_comm
        check_same_on_all_ranks(self.comm, stage, bucket_numel, [len(ps) for ps in managed],
                                self._shapes, self._params)
        if self._rt is None:
            self._broadcast_params()  # stage 3: shard_model did it
        self._group_sizes = [[self._shapes[self._index[id(p)]].numel() for p in ps]
                             for ps in managed]
        self._steps = [0] * len(self._params)
        # The flat layout is built at the first step() from the order in which the first
        # backward produced gradients (as DDP rebuilds its buckets after one iteration), so
        # buckets fill front to back and never wait on a late or unused parameter.
        self.layout: Layout | None = None
        self._engine: Engine | None = None  # the stage's buffers, once laid out
        self._sync = True
        self._observed: list[int] = []
        self._seen: set[int] = set()
        if self._rt is None:
            self._hooks = [
                p.register_post_accumulate_grad_hook(lambda _p, i=i: self._on_grad(i))
                for i, p in enumerate(self._params)
            ]
        else:
            self._build()  # stage 3: the units fix the layout already
        self._last_comm = self.comm.reset_stats()
        self._constructed = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch.optim.Optimizer's constructor adds the initial groups through this. A group
        added later would need a new layout (its state sharded, its gradients bucketed),
        which is not supported yet: refuse it, unchanged, rather than never update it."""
        if getattr(self, "_constructed", False):
            raise NotImplementedError(
                "ZeroAdamW.add_param_group after construction is not supported yet (its "
                "parameters would never be updated): pass every param group to ZeroAdamW "
                "when you build it")
        super().add_param_group(param_group)

    @property
    def _index(self) -> dict[int, int]:
        return {id(p): i for i, p in enumerate(self._params)}

    def _stage3_runtime(self, stage: int) -> Any:
        found = [runtime_of_param(p) for p in self._params]
        rts = {id(rt): rt for rt in found}
        if stage != 3:
            if any(rt is not None for rt in rts.values()):
                raise ValueError(f"params belong to a model partitioned by shard_model: use "
                                 f"stage=3 (got stage={stage})")
            return None
        if len(rts) != 1 or next(iter(rts.values())) is None:
            raise ValueError("stage=3 needs the parameters of one model partitioned by "
                             "zerokern.shard_model(model) first")
        return next(iter(rts.values()))

    def _on_grad(self, index: int) -> None:
        if self._engine is not None:
            self._engine.on_grad(index)
        elif index not in self._seen:  # before the layout exists: learn the ready order
            self._seen.add(index)
            self._observed.append(index)

    def _broadcast_params(self) -> None:
        if self.comm.world_size == 1:
            return
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in self._params])
            self.comm.broadcast(flat, 0, "initial parameters")
            off = 0
            for p in self._params:
                p.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()

    def _build(self, ready_order: list[int] | None = None) -> Layout:
        """Fix the layout (stages 0-2: in ``ready_order``, default reverse registration) and
        let the stage's engine allocate its buffers for it."""
        if self.layout is not None:
            return self.layout
        if self._rt is not None:
            layout = build_stage3_layout(self._rt, self._params, self.param_groups)
        else:
            layout = build_layout(
                self._group_sizes, stage=self.stage, world_size=self.comm.world_size,
                rank=self.comm.rank, bucket_numel=self._bucket_numel, ready_order=ready_order,
            )
        extra = {"runtime": self._rt} if self._rt is not None else {}
        self._engine = ENGINES[self.stage](
            layout, self._params, self.comm, dtype=self.dtype, device=self.device,
            overlap=self._overlap, backend=self.backend, **extra)
        self._engine.set_sync(self._sync)
        self.layout = layout
        return layout

    def _first_step_layout(self) -> None:
        """Agree on rank 0's observed order, lay everything out, then push the gradients the
        first backward left on the parameters through the buckets in that order."""
        order = self.comm.all_gather_object(self._observed, "bucket order")[0]
        self._build(order)
        for i in self.layout.ready_order:
            if self._params[i].grad is not None:
                self._engine.reducer.on_grad_ready(i, in_backward=False)

    # -- training-loop API ------------------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) for all but the last micro-batch."""
        prev = self._sync
        self._set_sync(False)
        try:
            yield
        finally:
            self._set_sync(prev)

    def _set_sync(self, value: bool) -> None:
        self._sync = value
        if self._engine is not None:
            self._engine.set_sync(value)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler is not None else loss

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._engine is not None:
            self._engine.zero_grad(set_to_none)
            return
        for p in self._params:
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                p.grad.zero_()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every group's hyperparameters (a scheduler may have changed them) before any group
        # is touched: a NaN lr in the second group must not leave the first one updated.
        for gi, g in enumerate(self.param_groups):
            check_hparams(g["lr"], g["betas"], g["eps"], g["weight_decay"],
                           f" (param group {gi})")
        if self.layout is None:
            self._first_step_layout()
        eng = self._engine
        got = eng.finish_grads()
        need_norm = self.max_grad_norm is not None or self.scaler is not None
        # One small all-reduce (and one host sync) per step: the squared-norm partial and
        # which parameters got a gradient on any rank (the others are left untouched).
        flags = torch.tensor([float(x) for x in got], dtype=torch.float32)
        vec = torch.cat([torch.zeros(1), flags]).to(self.device)
        if need_norm and not eng.replicated_grads:
            vec[0] = eng.grad_sq_norm()
        self.comm.all_reduce(vec, "grad norm and grad flags", count=False)
        if need_norm and eng.replicated_grads:  # every rank holds the full averaged grad
            vec[0] = eng.grad_sq_norm()
        vals = vec.tolist()
        active = [v > 0 for v in vals[1:]]
        scale = self.loss_scale
        if need_norm:
            self.last_grad_norm = math.sqrt(vals[0]) / scale
        if self.scaler is not None and not math.isfinite(vals[0]):
            self.scaler.update(True)  # every rank saw the same sum: all skip together
            self._end_step()
            return loss
        clip = 1.0
        if self.max_grad_norm is not None:
            clip = min(1.0, self.max_grad_norm / (self.last_grad_norm + 1e-6))
        # An infinite norm (no loss scaler to skip the step) clips by 0, as torch's
        # clip_grad_norm_ does: finite gradients become 0, infinite ones NaN.
        grad_scale = scale / clip if clip > 0 else math.inf
        eng.update(self._runs(active), self.param_groups, grad_scale, active)
        for i, a in enumerate(active):
            if a:
                self._steps[i] += 1
        if self.scaler is not None:
            self.scaler.update(False)
        self._end_step()
        return loss

    def _end_step(self) -> None:
        self._engine.end_step()
        self._last_comm = self.comm.reset_stats()

    def _runs(self, active: list[bool]) -> list[Run]:
        """Ranges of this rank's local space for the fused kernel.

        Consecutive pieces of this rank's local space merge into one range (the gaps between
        them are padding), normally one per param group; a range is cut only around
        parameters that got no gradient on any rank, parameters with another step count
        (torch's AdamW keeps a step per parameter) and, in stage 3, frozen parameters."""
        runs: list[list[int]] = []
        cur: list[int] | None = None
        for pc in self.layout.pieces:
            if pc.param < 0 or not active[pc.param]:
                cur = None
                continue
            st = self._steps[pc.param] + 1
            if cur is not None and cur[0] == pc.group and cur[3] == st:
                cur[2] = pc.local_start + pc.numel
            else:
                cur = [pc.group, pc.local_start, pc.local_start + pc.numel, st]
                runs.append(cur)
        return [Run(g, lo, hi, st) for g, lo, hi, st in runs]

    # -- sharded state ----------------------------------------------------------------------
    @property
    def managed_params(self) -> tuple[torch.nn.Parameter, ...]:
        """The parameters this optimizer trains (requires_grad at construction), in
        param-group order: the indices of shards() and of the state dicts."""
        return tuple(self._params)

    def full_shape(self, p: torch.nn.Parameter) -> torch.Size:
        """The full shape of a managed parameter (stage 3: not its released empty shape)."""
        return self._shapes[self._index[id(p)]]

    def shards(self, model: torch.nn.Module | None = None, *,
               ready_order: list[int] | None = None) -> list[ParamShard]:
        """Per managed parameter: its full shape, step count, and the element ranges this rank
        holds with writable fp32 views of their values, exp_avg and exp_avg_sq.

        Names come from ``model`` (its ``named_parameters``) when given, else from named
        param groups (``ZeroAdamW(model.named_parameters())``) or the shard_model'ed model.
        Before the first step() of stages 0-2 this fixes the bucket layout (in
        ``ready_order``, indices of managed_params, default reverse registration order),
        as loading a state does."""
        L = self._build(ready_order)
        names = self._names(model)
        group_of = {id(p): g for g, grp in enumerate(self.param_groups) for p in grp["params"]}
        ranges: list[list[ShardRange]] = [[] for _ in self._params]
        eng = self._engine
        for pc in L.pieces:
            if pc.param < 0:
                continue
            s, n = pc.local_start, pc.numel
            ranges[pc.param].append(ShardRange(
                pc.param_offset, n, eng.values(s, n), eng.exp_avg.narrow(0, s, n),
                eng.exp_avg_sq.narrow(0, s, n)))
        return [ParamShard(i, names.get(id(p)), p, group_of[id(p)], self._shapes[i], p.dtype,
                           self._steps[i], tuple(sorted(ranges[i], key=lambda r: r.start)))
                for i, p in enumerate(self._params)]

    @contextmanager
    def edit_shards(self, model: torch.nn.Module | None = None, *, gather: bool = True,
                    ready_order: list[int] | None = None) -> Iterator[list[ParamShard]]:
        """Write this rank's optimizer state: yields shards(); write into their views and
        assign their ``step``. On leaving, the steps are taken and the parameters take the
        new values (16-bit: rounded to nearest even). Call on every rank: with ``gather``
        (stages 1-2) the new parameters are all-gathered, a collective; ``gather=False``
        means the caller writes every rank's full parameters itself. If the block raises,
        the steps and parameters are left as they were (the views may be written)."""
        shards = self.shards(model, ready_order=ready_order)
        yield shards
        for sh in shards:
            if isinstance(sh.step, bool) or not isinstance(sh.step, int) or sh.step < 0:
                raise ValueError(f"step of parameter {sh.index} ({sh.name}) must be an int "
                                 f">= 0, got {sh.step!r}")
        with torch.no_grad():
            self._engine.sync_params(gather)
        for sh in shards:
            self._steps[sh.index] = sh.step

    def _names(self, model: torch.nn.Module | None) -> dict[int, str]:
        if model is not None:
            return {id(p): n for n, p in model.named_parameters()}
        out: dict[int, str] = {}
        for g in self.param_groups:
            for p, n in zip(g["params"], g.get("param_names") or []):
                out[id(p)] = n
        if not out and self._rt is not None:
            out = dict(self._rt.param_names)
        return out

    # -- introspection ----------------------------------------------------------------------
    def comm_stats(self) -> dict[str, Any]:
        """Collectives of the last completed step, counted as the paper counts (§7)."""
        d = self._last_comm.as_dict()
        paper = sum(v["elements"] for k, v in d.items()
                    if k in ("reduce_scatter", "all_gather", "all_reduce"))
        return {"per_kind": d, "elements": paper,
                "bytes": sum(v["bytes"] for k, v in d.items()
                             if k in ("reduce_scatter", "all_gather", "all_reduce")),
                "numel": sum(sh.numel() for sh in self._shapes)}

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds for model states, by kind, from the arenas' accounting.
        Padding (bucket/shard rounding, and in stage 3 the optimizer slots of frozen
        parameters) is reported on its own. Before the first step() of stages 0-2 nothing
        is allocated yet: the numbers are those of the buffers the first step will allocate
        (laid out in reverse registration order), and nothing is fixed by asking."""
        if self._engine is not None:
            return self._engine.memory_stats()
        L = build_layout(self._group_sizes, stage=self.stage, world_size=self.comm.world_size,
                         rank=self.comm.rank, bucket_numel=self._bucket_numel)
        return planned_flat_memory(L, self.dtype, ENGINES[self.stage].buffer_specs(L, self.dtype))

    # -- checkpointing ----------------------------------------------------------------------
    def _meta(self) -> dict[str, Any]:
        L = self.layout
        return {"stage": self.stage, "world_size": self.comm.world_size,
                "rank": self.comm.rank, "local_numel": None if L is None else L.local_numel,
                "flat_numel": None if L is None else L.flat_numel,
                "ready_order": None if L is None else list(L.ready_order)}

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (flat buffers in its local layout). Before
        the first step() nothing has been laid out or trained: as torch's AdamW, the state is
        empty ({}), and asking fixes nothing."""
        groups = []
        idx = 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(idx, idx + n))})
            idx += n
        eng = self._engine
        state: dict[str, Any] = {} if eng is None else {
            "exp_avg": eng.exp_avg.clone(), "exp_avg_sq": eng.exp_avg_sq.clone(),
            "master": None if eng.master is None else eng.master.clone(),
            "steps": torch.tensor(self._steps, dtype=torch.int64),
        }
        return {
            "state": state, "param_groups": groups,
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "zerokern": self._meta(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        meta = state_dict.get("zerokern")
        if meta is None:
            raise ValueError("state_dict: not a ZeroAdamW state dict (no 'zerokern' entry)")
        st = state_dict["state"]
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError("state_dict: number of param groups differs")
        for k in ("stage", "world_size", "rank"):
            if meta[k] != self._meta()[k]:
                raise ValueError(
                    f"state_dict was saved with {k}={meta[k]}, this optimizer has {k}="
                    f"{self._meta()[k]}; use zerokern.load_checkpoint to change world size "
                    "or stage")
        if st:
            self._build(list(meta.get("ready_order") or []) or None)
            mine = self._meta()
            for k in ("local_numel", "flat_numel", "ready_order"):
                if meta[k] != mine[k]:
                    raise ValueError(
                        f"state_dict was saved with {k}={meta[k]}, this optimizer has {k}="
                        f"{mine[k]}; use zerokern.load_checkpoint to change world size or "
                        "stage")
        eng = self._engine
        with torch.no_grad():
            if st:
                eng.exp_avg.copy_(st["exp_avg"])
                eng.exp_avg_sq.copy_(st["exp_avg_sq"])
                if eng.master is not None:
                    eng.master.copy_(st["master"])
                self._steps = [int(x) for x in st["steps"].tolist()]
            elif eng is not None:  # a state saved before any step: a fresh state
                eng.exp_avg.zero_()
                eng.exp_avg_sq.zero_()
                eng.init_master()
                self._steps = [0] * len(self._params)
        for g, sg in zip(self.param_groups, state_dict["param_groups"]):
            for k, v in sg.items():
                if k != "params":
                    g[k] = v
        if self.scaler is not None and state_dict.get("scaler") is not None:
            self.scaler.load_state_dict(state_dict["scaler"])
