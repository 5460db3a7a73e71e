"""ZeroAdamW: ZeRO stages 0-2 as a drop-in replacement for DDP + torch.optim.AdamW.

This file only sequences: the layout is planned in layout.py (pure), gradients are bucketed
and reduced by grads.py, collectives go through comm/, the update is ops.fused_adamw_.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .. import ops
from ..comm import Comm
from ..memory import Arena
from .grads import GradReducer
from .layout import Layout, build_layout, build_stage3_layout
from .registry import runtime_of_param
from .scaler import LossScaler

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_hparams(lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                   where: str = "") -> None:
    if not (isinstance(lr, (int, float)) or torch.is_tensor(lr)) or not _finite_ge0(lr):
        raise ValueError(f"lr{where} must be a finite number >= 0, got {lr!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas{where} must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        if not 0.0 <= float(b) < 1.0:
            raise ValueError(f"betas[{i}]{where} must be in [0, 1), got {b!r}")
    if not _finite_ge0(eps):
        raise ValueError(f"eps{where} must be a finite number >= 0, got {eps!r}")
    if not _finite_ge0(weight_decay):
        raise ValueError(f"weight_decay{where} must be a finite number >= 0, got {weight_decay!r}")


def _finite_ge0(x: Any) -> bool:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return False
    return math.isfinite(v) and v >= 0


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
        _check_hparams(lr, betas, eps, weight_decay)
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
            _check_hparams(g["lr"], g["betas"], g["eps"], g["weight_decay"],
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
        self.dtype, self.device = self._common_dtype_device()
        self._bucket_numel = bucket_numel
        self._overlap = overlap_comm
        self._check_same_on_all_ranks(bucket_numel)
        if self._rt is None:
            self._broadcast_params()  # stage 3: shard_model did it
        self._group_sizes = [[self._shapes[self._index[id(p)]].numel() for p in ps]
                             for ps in managed]
        self._steps = [0] * len(self._params)
        # The flat layout is built at the first step() from the order in which the first
        # backward produced gradients (as DDP rebuilds its buckets after one iteration), so
        # buckets fill front to back and never wait on a late or unused parameter.
        self.layout: Layout | None = None
        self._reducer: GradReducer | None = None
        self._sync = True
        self._observed: list[int] = []
        self._seen: set[int] = set()
        if self._rt is None:
            self._hooks = [
                p.register_post_accumulate_grad_hook(lambda _p, i=i: self._on_grad(i))
                for i, p in enumerate(self._params)
            ]
        else:
            self._ensure_layout()  # stage 3: the units fix the layout already
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
        if self._reducer is not None:
            self._reducer.on_grad_ready(index)
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

    def _ensure_layout(self, ready_order: list[int] | None = None) -> Layout:
        if self.layout is not None:
            return self.layout
        if self._rt is not None:
            self.layout = build_stage3_layout(self._rt, self._params, self.param_groups)
            self._allocate()
            return self.layout
        self.layout = build_layout(
            self._group_sizes, stage=self.stage, world_size=self.comm.world_size,
            rank=self.comm.rank, bucket_numel=self._bucket_numel, ready_order=ready_order,
        )
        self._allocate()
        self._reducer = GradReducer(
            self.layout, self._params, self.comm, flat_grad=self.flat_grad,
            grad_shard=self.grad_shard, alloc_bucket=self._alloc_bucket,
            pool_size=self._pool_reserve,
            overlap=self._overlap, backend=self.backend,
        )
        self._reducer.sync = self._sync
        return self.layout

    def _first_step_layout(self) -> None:
        """Agree on rank 0's observed order, lay everything out, then push the gradients the
        first backward left on the parameters through the buckets in that order."""
        order = self.comm.all_gather_object(self._observed, "bucket order")[0]
        self._ensure_layout(order)
        for i in self.layout.ready_order:
            if self._params[i].grad is not None:
                self._reducer.on_grad_ready(i, in_backward=False)

    # -- construction -----------------------------------------------------------------------
    def _common_dtype_device(self) -> tuple[torch.dtype, torch.device]:
        p0 = self._params[0]
        for i, p in enumerate(self._params):
            if p.dtype not in _DTYPES:
                raise TypeError(f"params: parameter {i} has dtype {p.dtype}; supported: "
                                "float32, bfloat16, float16")
            if p.dtype != p0.dtype or p.device != p0.device:
                raise ValueError(
                    f"params: all trainable parameters must share one dtype and device; "
                    f"parameter 0 is {p0.dtype} on {p0.device}, parameter {i} is {p.dtype} "
                    f"on {p.device}"
                )
        if p0.dtype == torch.float16 and self.scaler is None:
            pass  # allowed (a static scale of 1); fp16 users normally pass loss_scale
        return p0.dtype, p0.device

    def _check_same_on_all_ranks(self, bucket_numel: int | None) -> None:
        sig = {
            "stage": self.stage, "bucket_numel": bucket_numel,
            "groups": [len([p for p in g["params"] if p.requires_grad])
                       for g in self.param_groups],
            "params": [(tuple(sh), str(p.dtype)) for sh, p in zip(self._shapes, self._params)],
        }
        sigs = self.comm.all_gather_object(sig, "parameter signatures")
        ref = sigs[0]
        for r, s in enumerate(sigs):
            if s == ref:
                continue
            for key in ("stage", "bucket_numel", "groups"):
                if s[key] != ref[key]:
                    raise ValueError(f"ZeroAdamW arguments differ across ranks: {key} is "
                                     f"{ref[key]} on rank 0 but {s[key]} on rank {r}")
            if len(s["params"]) != len(ref["params"]):
                raise ValueError(f"parameter lists differ across ranks: rank 0 has "
                                 f"{len(ref['params'])} trainable parameters, rank {r} has "
                                 f"{len(s['params'])}")
            for i, (a, b) in enumerate(zip(ref["params"], s["params"])):
                if a != b:
                    raise ValueError(f"parameter lists differ across ranks: parameter {i} is "
                                     f"{a[0]} {a[1]} on rank 0 but {b[0]} {b[1]} on rank {r}")

    def _allocate(self) -> None:
        if self._rt is not None:
            return self._allocate_stage3()
        L, st, pdt = self.layout, self.stage, self.dtype
        esz = torch.tensor([], dtype=pdt).element_size()
        max_bucket = max((b.numel for b in L.buckets), default=0)
        self._pool_reserve = 2 if st == 2 else 0  # double-buffered constant buckets
        need = [L.flat_numel * esz]
        if st in (0, 1):
            need.append(L.flat_numel * esz)
        if st == 2:
            need.append(L.local_numel * esz)
        # fp32 params need no master: the kernel updates this rank's slices of the flat
        # parameters in place (stage 0: all of them) and the all-gather runs in place.
        self._has_master = pdt != torch.float32
        need += [L.local_numel * 4] * (3 if self._has_master else 2)
        need += [max_bucket * esz] * self._pool_reserve
        align = 256
        cap = sum(-(-n // align) * align for n in need) + align
        self.arena = Arena(cap, self.device, alignment=align)
        self._blocks: dict[str, Any] = {}

        def alloc(kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
            blk = self.arena.alloc(numel, dtype)
            self._blocks[kind] = blk
            t = blk.tensor
            t.zero_()
            return t

        with torch.no_grad():
            self.flat_param = alloc("params", L.flat_numel, pdt)
            for i, p in enumerate(self._params):
                off = L.param_flat_offset[i]
                view = self.flat_param.narrow(0, off, p.numel())
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
            self.flat_grad = alloc("grads", L.flat_numel, pdt) if st in (0, 1) else None
            # Stage 1 reduce-scatters in place into the flat gradient: no separate shard.
            self.grad_shard = alloc("grads", L.local_numel, pdt) if st == 2 else None
            self.master = alloc("master", L.local_numel, torch.float32) if self._has_master \
                else None
            self.exp_avg = alloc("exp_avg", L.local_numel, torch.float32)
            self.exp_avg_sq = alloc("exp_avg_sq", L.local_numel, torch.float32)
            if self.master is not None:
                if st == 0:
                    self.master.copy_(self.flat_param)
                else:
                    for bk in L.buckets:
                        lo = bk.flat_start + self.comm.rank * bk.shard_numel
                        self.master.narrow(0, bk.shard_start, bk.shard_numel).copy_(
                            self.flat_param.narrow(0, lo, bk.shard_numel))
        self._bucket_blocks: list[Any] = []
        self._overflow_bucket_bytes = 0

    def _allocate_stage3(self) -> None:
        rt, n = self._rt, self.layout.local_numel
        self.flat_param = self.flat_grad = None
        self.grad_shard = rt.local_grads
        self._has_master = self.dtype != torch.float32
        nstate = 3 if self._has_master else 2
        self.arena = Arena(max(n * 4 * nstate + 1024, 1024), self.device)
        self._blocks = {}
        self._bucket_blocks, self._overflow_bucket_bytes, self._pool_reserve = [], 0, 0

        def alloc(kind: str) -> torch.Tensor:
            self._blocks[kind] = blk = self.arena.alloc(n, torch.float32)
            return blk.tensor.zero_()

        self.master = alloc("master") if self._has_master else None
        if self.master is not None:
            self.master.copy_(rt.local_params)
        self.exp_avg = alloc("exp_avg")
        self.exp_avg_sq = alloc("exp_avg_sq")

    def _alloc_bucket(self) -> torch.Tensor:
        numel = max(b.numel for b in self.layout.buckets)
        if len(self._bucket_blocks) < self._pool_reserve:
            blk = self.arena.alloc(numel, self.dtype)
            self._bucket_blocks.append(blk)
            return blk.tensor
        # Buckets completing out of order can need more than two at once: counted, not hidden.
        t = torch.empty(numel, dtype=self.dtype, device=self.device)
        self._overflow_bucket_bytes += t.numel() * t.element_size()
        return t

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
        if self._reducer is not None:
            self._reducer.sync = value
        if self._rt is not None:
            self._rt.sync = value

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler is not None else loss

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._rt is not None:
            for p in self._params:
                p.grad = None
            self._rt.new_step()
            return
        if self.layout is None:
            for p in self._params:
                if set_to_none or p.grad is None:
                    p.grad = None
                else:
                    p.grad.zero_()
            return
        for i, p in enumerate(self._params):
            if set_to_none or self.flat_grad is None:
                p.grad = None
            else:
                off = self.layout.param_flat_offset[i]
                p.grad = self.flat_grad.narrow(0, off, p.numel()).view_as(p)
        if not set_to_none and self.flat_grad is not None:
            self.flat_grad.zero_()
        self._reducer.reset()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Every group's hyperparameters (a scheduler may have changed them) before any group
        # is touched: a NaN lr in the second group must not leave the first one updated.
        for gi, g in enumerate(self.param_groups):
            _check_hparams(g["lr"], g["betas"], g["eps"], g["weight_decay"],
                           f" (param group {gi})")
        if self.layout is None:
            self._first_step_layout()
        if self._rt is not None:
            self._rt.prepare_step()
            got = [self._rt.got_grad.get(id(p), False) for p in self._params]
        else:
            self._reducer.flush()
            got = self._reducer.got_grad
        grad_src = self.flat_grad if self.stage == 0 else self.grad_shard  # stage 1: None
        need_norm = self.max_grad_norm is not None or self.scaler is not None
        # One small all-reduce (and one host sync) per step: the squared-norm partial and
        # which parameters got a gradient on any rank (the others are left untouched).
        flags = torch.tensor([float(x) for x in got], dtype=torch.float32)
        vec = torch.cat([torch.zeros(1), flags]).to(self.device)
        if self.stage == 1:
            # This rank's slices of the flat gradient hold sums over ranks (in-place
            # reduce-scatter, so that accumulating backwards keep adding to them): average
            # now, in the gradient dtype as stages 0 and 2 do, so every stage computes the
            # same numbers.
            slices = [self.flat_grad.narrow(0, fs, k)
                      for _, fs, k in self._flat_slices(0, self.layout.local_numel)]
            if self.comm.world_size > 1:
                for t in slices:
                    t.div_(self.comm.world_size)
            if need_norm:
                vec[0] = torch.stack([ops.sq_norm(t, backend=self.backend)
                                      for t in slices]).sum()
        elif need_norm and self.stage != 0:
            vec[0] = ops.sq_norm(grad_src, backend=self.backend)
        self.comm.all_reduce(vec, "grad norm and grad flags", count=False)
        if need_norm and self.stage == 0:  # already reduced: every rank holds the full grad
            vec[0] = ops.sq_norm(grad_src, backend=self.backend)
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
        runs = self._runs(active)
        if self.stage in (1, 2):
            self._update_and_gather(runs, grad_scale, active)
        else:
            for g, s, e, step in runs:
                self._fused(g, s, e, step, grad_scale)
        for i, a in enumerate(active):
            if a:
                self._steps[i] += 1
        if self.scaler is not None:
            self.scaler.update(False)
        self._end_step()
        return loss

    def _end_step(self) -> None:
        if self._rt is not None:
            self._rt.new_step()
        else:
            self._reducer.reset()
        self._last_comm = self.comm.reset_stats()

    def _runs(self, active: list[bool]) -> list[tuple[int, int, int, int]]:
        """(group, local start, local stop, 1-based step) ranges for the fused kernel.

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
        return [(g, lo, hi, st) for g, lo, hi, st in runs]

    def _fused(self, g: int, s: int, e: int, step: int, grad_scale: float) -> None:
        grp = self.param_groups[g]
        n = e - s
        lowp = self.dtype != torch.float32
        if self.stage == 0:
            grad = self.flat_grad.narrow(0, s, n)
            param = self.master.narrow(0, s, n) if lowp else self.flat_param.narrow(0, s, n)
            lp = self.flat_param.narrow(0, s, n) if lowp else None
        elif self.stage == 3:  # the new 16-bit shard is all the next forward needs
            grad = self.grad_shard.narrow(0, s, n)
            own = self._rt.local_params.narrow(0, s, n)
            param = self.master.narrow(0, s, n) if lowp else own
            lp = own if lowp else None
        else:
            if self.stage == 1 or not lowp:
                # The new parameters go straight into this rank's slice of each bucket of the
                # flat parameters, the source of the in-place all-gather. Stage 1 reads its
                # gradient from the same slice of the flat gradient (averaged in step()).
                for ls, fs, k in self._flat_slices(s, e):
                    grad = (self.flat_grad.narrow(0, fs, k) if self.stage == 1
                            else self.grad_shard.narrow(0, ls, k))
                    fp = self.flat_param.narrow(0, fs, k)
                    if lowp:
                        self._adamw(grp, self.master.narrow(0, ls, k), grad, ls, k, step,
                                    grad_scale, fp)
                    else:
                        self._adamw(grp, fp, grad, ls, k, step, grad_scale, None)
                return
            grad = self.grad_shard.narrow(0, s, n)
            param = self.master.narrow(0, s, n)
            # The new 16-bit shard overwrites the gradient it was computed from, element by
            # element in the same pass: no extra Ψ/N buffer for the all-gather source.
            lp = grad
        self._adamw(grp, param, grad, s, n, step, grad_scale, lp)

    def _adamw(self, grp: dict, param: torch.Tensor, grad: torch.Tensor, s: int, n: int,
               step: int, grad_scale: float, lp: torch.Tensor | None) -> None:
        ops.fused_adamw_(
            param, grad, self.exp_avg.narrow(0, s, n), self.exp_avg_sq.narrow(0, s, n),
            lr=float(grp["lr"]), beta1=float(grp["betas"][0]), beta2=float(grp["betas"][1]),
            eps=float(grp["eps"]), weight_decay=float(grp["weight_decay"]), step=step,
            grad_scale=grad_scale, param_lp=lp, backend=self.backend,
        )

    def _flat_slices(self, s: int, e: int) -> list[tuple[int, int, int]]:
        """(local start, flat start, numel) of local range [s, e) in stages 1-2: this rank's
        slice of each bucket sits at flat_start + rank * shard_numel."""
        out = []
        r = self.comm.rank
        for bk in self.layout.buckets:
            lo, hi = max(s, bk.shard_start), min(e, bk.shard_start + bk.shard_numel)
            if lo < hi:
                out.append((lo, bk.flat_start + r * bk.shard_numel + lo - bk.shard_start,
                            hi - lo))
        return out

    def _local_values(self) -> torch.Tensor:
        """This rank's fp32 values in local order: the master, or (fp32 params) a copy of its
        slices of the parameters (for checkpoints)."""
        if self.master is not None:
            return self.master
        if self._rt is not None:
            return self._rt.local_params
        if self.stage == 0:
            return self.flat_param
        out = torch.empty(self.layout.local_numel, dtype=torch.float32, device=self.device)
        for ls, fs, k in self._flat_slices(0, self.layout.local_numel):
            out.narrow(0, ls, k).copy_(self.flat_param.narrow(0, fs, k))
        return out

    def _update_and_gather(self, runs: list[tuple[int, int, int, int]], grad_scale: float,
                           active: list[bool]) -> None:
        """Stages 1-2: update this rank's slice bucket by bucket, and start each bucket's
        all-gather as soon as its slice is final, so the gathers overlap the remaining
        updates (NCCL on its stream, gloo on its threads). Every rank gathers in bucket
        order."""
        # Stage 2 with 16-bit params: the new shard overwrote the gradient shard. Otherwise
        # the kernel wrote this rank's slice of the flat parameters: gather in place.
        lowp = self.dtype != torch.float32 and self.stage == 2
        src = self.grad_shard
        skipped = lowp and not all(active)
        works = []
        for bk in self.layout.buckets:
            lo, hi = bk.shard_start, bk.shard_start + bk.shard_numel
            for g, s, e, step in runs:
                a, b = max(s, lo), min(e, hi)
                if a < b:
                    self._fused(g, a, b, step, grad_scale)
            if skipped:
                # Pieces the kernel skipped (no gradient on any rank): their current value.
                for pc in self.layout.pieces:
                    a = max(pc.local_start, lo)
                    b = min(pc.local_start + pc.numel, hi)
                    if a < b and not active[pc.param]:
                        src.narrow(0, a, b - a).copy_(self.master.narrow(0, a, b - a))
            full = self.flat_param.narrow(0, bk.flat_start, bk.numel)
            # fp32: in place, from this rank's own slice of the bucket
            mine = (src.narrow(0, lo, bk.shard_numel) if lowp else
                    full.narrow(0, self.comm.rank * bk.shard_numel, bk.shard_numel))
            w = self.comm.all_gather(
                full, mine,
                f"parameters of bucket {bk.index}", async_op=self._reducer.overlap,
            )
            if w is not None:
                works.append(w)
        for w in works:
            w.wait()

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
        parameters) is reported on its own. Before the first step() of stages 0-2 this lays
        buffers out in reverse registration order."""
        L = self._ensure_layout()
        esz = torch.empty(0, dtype=self.dtype).element_size()
        psi = sum(sh.numel() for sh in self._shapes)
        local_real = sum(pc.numel for pc in L.pieces if pc.param >= 0)
        nstate = 3 if self.master is not None else 2
        out = {"params": 0, "grads": 0, "master": local_real * 4 if self.master is not None
               else 0, "exp_avg": local_real * 4, "exp_avg_sq": local_real * 4, "buckets": 0,
               "padding": (L.local_numel - local_real) * 4 * nstate}
        if self._rt is not None:
            rt = self._rt
            held = sum(pc.numel for pc in L.pieces)  # this rank's slice, frozen params too
            out["params"] = out["grads"] = held * esz
            out["padding"] += 2 * (rt.local_numel - held) * esz
            g = rt.memory_stats()
            out.update({f"gather_{k}" if not k.startswith("gather") else k: v
                        for k, v in g.items() if not k.startswith("local")})
            out["total"] = 2 * rt.local_numel * esz + int(self.arena.stats()["in_use"])
            return out
        out["params"] = psi * esz
        out["padding"] += (L.flat_numel - psi) * esz
        if self.flat_grad is not None:
            out["grads"] += psi * esz
            out["padding"] += (L.flat_numel - psi) * esz
        if self.grad_shard is not None:
            out["grads"] += local_real * esz
            out["padding"] += (L.local_numel - local_real) * esz
        pool = sum(b.nbytes for b in self._bucket_blocks)
        out["buckets"] = pool + self._overflow_bucket_bytes
        # Receive buffers of gloo's point-to-point reduce-scatter (stage 1 in place; stage 2
        # with more than 2 ranks): the most held at once. 0 on NCCL.
        out["comm_scratch"] = self.comm.scratch_peak
        a = self.arena.stats()
        out["arena_in_use"] = int(a["in_use"])
        out["arena_capacity"] = int(a["capacity"])
        out["total"] = int(a["in_use"]) + self._overflow_bucket_bytes + self.comm.scratch_peak
        return out

    # -- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        L = self._ensure_layout()
        groups = []
        idx = 0
        for g in self.param_groups:
            n = len(g["params"])
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": list(range(idx, idx + n))})
            idx += n
        state = {
            "exp_avg": self.exp_avg.clone(), "exp_avg_sq": self.exp_avg_sq.clone(),
            "master": None if self.master is None else self.master.clone(),
            "steps": torch.tensor(self._steps, dtype=torch.int64),
        }
        return {
            "state": state, "param_groups": groups,
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "zerokern": {"stage": self.stage, "world_size": self.comm.world_size,
                         "rank": self.comm.rank, "local_numel": L.local_numel,
                         "flat_numel": L.flat_numel, "ready_order": list(L.ready_order)},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        meta = state_dict.get("zerokern")
        if meta is None:
            raise ValueError("state_dict: not a ZeroAdamW state dict (no 'zerokern' entry)")
        if self.layout is None:
            self._ensure_layout(list(meta.get("ready_order") or []) or None)
        mine = self.state_dict()["zerokern"]
        for k in ("stage", "world_size", "rank", "local_numel", "flat_numel", "ready_order"):
            if meta[k] != mine[k]:
                raise ValueError(
                    f"state_dict was saved with {k}={meta[k]}, this optimizer has {k}="
                    f"{mine[k]}; use zerokern.load_checkpoint to change world size or stage"
                )
        st = state_dict["state"]
        if len(state_dict["param_groups"]) != len(self.param_groups):
            raise ValueError("state_dict: number of param groups differs")
        with torch.no_grad():
            self.exp_avg.copy_(st["exp_avg"])
            self.exp_avg_sq.copy_(st["exp_avg_sq"])
            if self.master is not None:
                self.master.copy_(st["master"])
        self._steps = [int(x) for x in st["steps"].tolist()]
        for g, sg in zip(self.param_groups, state_dict["param_groups"]):
            for k, v in sg.items():
                if k != "params":
                    g[k] = v
        if self.scaler is not None and state_dict.get("scaler") is not None:
            self.scaler.load_state_dict(state_dict["scaler"])
