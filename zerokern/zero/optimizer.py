"""ZeroAdamW: ZeRO stages 0-3 as a drop-in replacement for DDP + torch.optim.AdamW.

This file only sequences what every stage shares: argument checks, param groups, gradient
hooks, the layout (planned in layout.py, pure), the one norm-and-flags all-reduce per step,
clipping, the loss scaler, step counts, the sharded-state interface and the state dict. What
differs by stage (buffers, reduction and averaging, the update, the gather) is the stage's
engine in stages/.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..comm import Comm
from . import interop, rebind
from .grad_guard import GradGuard
from .interchange import InterchangeMixin, check_adamw_flags
from .layout import Layout, build_layout, build_stage3_layout
from .optimizer_state import ShardedStateMixin
from .param_groups import ParamGroupsMixin
from .registry import runtime_of_param
from .scaler import LossScaler
from .shards import ShardedStateView
from .stages import Engine, Run, make_engine, planned_memory
from .validate import (
    check_hparams,
    check_no_duplicates,
    check_offload,
    check_offload_params,
    check_same_on_all_ranks,
    common_dtype_device,
    finite_ge0,
)


@dataclass
class _Reduced:
    """The step's gradient reduction: its all-reduced norm and flags, and the clipping
    coefficient clip_grad_norm_ asked for."""

    events: int
    sq_norm: float
    active: list[bool]
    has_norm: bool
    norm: float = 0.0
    clip: float = 1.0
    clip_before: float = 1.0  # clip before the latest clip_grad_norm_ call
    # Squared 2-norm of every parameter's averaged gradient, when GradGuards were on the
    # parameters (torch's utilities may ask for them, on some ranks only: no collective then).
    param_sq: list[float] | None = None


class ZeroAdamW(ParamGroupsMixin, InterchangeMixin, ShardedStateMixin, torch.optim.Optimizer):
    """AdamW with ZeRO partitioning across the ranks of ``process_group``.

    stage 0: DDP equivalent (bucketed all-reduce, fused step over everything);
    stage 1: optimizer state (fp32 master for 16-bit params, both moments) sharded 1/N;
    stage 2: gradients sharded as well, through constant-size buckets.
    Stage 3 is ``shard_model`` + ``stage=3``. Without an initialised process group it runs
    as world size 1. Gradients are averaged over the group by the optimizer itself: do not
    wrap the model in DDP.

    ``offload="cpu"`` (stages 1-3, ZeRO-Offload): this rank's fp32 master, moments and
    gradient shard live in host memory (pinned on CUDA) and the fused step runs on the CPU;
    gradients are copied to the host bucket by bucket during backward and the new
    parameters copied back bucket by bucket during the step. Results are bitwise those of
    the same run without offload on CPU devices.

    Args:
        params: the parameters to train, or param-group dicts, as for ``torch.optim.AdamW``.
            Only parameters that require grad at construction are trained.
        lr: learning rate (per group, and schedulers may change it).
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator after the square root, as torch's AdamW adds it.
        weight_decay: decoupled weight decay, applied before the moments are updated.
        amsgrad: as torch's; only False (AdamW without AMSGrad) is implemented, True is
            refused.
        maximize: as torch's; only False, True is refused (minimize the negated loss).
        foreach: accepted and ignored: it chooses torch's kernels; ZeroAdamW's own run
            once over each flat shard.
        capturable: accepted and ignored, as ``foreach``.
        differentiable: only False (the step is not recorded by autograd).
        fused: accepted and ignored, as ``foreach``.
        stage: the ZeRO stage, 0-3 (3 needs a model partitioned by ``shard_model``).
        process_group: the group whose ranks share the work; default the world.
        bucket_numel: gradient bucket size in elements (stages 0-2); default 2**21.
        max_grad_norm: clip every step to this global 2-norm (None: no clipping).
        loss_scale: ``"dynamic"`` or a float, for fp16 parameters: scale the loss with
            ``scale_loss`` and overflowing steps are skipped on every rank.
        overlap_comm: run the gradient collectives asynchronously, overlapping backward.
        backend: the kernels' backend: ``"cuda"``, ``"triton"``, ``"cpu"``, ``"torch"``, or
            None for the fastest available (``$ZEROKERN_BACKEND`` also sets it).
        offload: ``"cpu"`` for ZeRO-Offload (stages 1-3), None to keep the state on the
            parameters' device.

    Attributes:
        stage: the ZeRO stage.
        offload: ``"cpu"`` or None.
        max_grad_norm: the clipping norm of every step, or None.
        last_grad_norm: the global gradient norm of the last step (None before one).
        last_step_skipped: whether the last ``step()`` was skipped by the loss scaler.
        state: ``opt.state[p]``: this rank's part of ``step``, ``exp_avg`` and
            ``exp_avg_sq`` of each trained parameter, with the element ``ranges`` it covers
            (a ``ShardedStateView``).
        comm: the process group's wrapper; ``comm.rank`` and ``comm.world_size``.
        layout: the flat layout of the parameters, fixed at the first ``step()`` (stages
            0-2) or at construction (stage 3); None until then.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        stage: int = 2,
        process_group: Any = None,
        bucket_numel: int | None = None,
        max_grad_norm: float | None = None,
        loss_scale: float | str | None = None,
        overlap_comm: bool = True,
        backend: str | None = None,
        offload: str | None = None,
    ) -> None:
        check_hparams(lr, betas, eps, weight_decay)
        # torch.optim.AdamW's signature, so that a script's AdamW(...) call works unchanged:
        # the flags that change the update are refused unless at AdamW's values; foreach,
        # fused and capturable choose torch's kernels, and ZeroAdamW has its own.
        del foreach, fused, capturable
        check_adamw_flags(dict(amsgrad=amsgrad, maximize=maximize,
                               differentiable=differentiable), "")
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")
        check_offload(offload, stage)
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
        self.offload = offload
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.scaler = LossScaler.from_arg(loss_scale)
        self.backend = backend
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False  # the last step() skipped (loss-scaler overflow)

        for gi, g in enumerate(self.param_groups):
            check_no_duplicates(g["params"], gi)
        managed = [[p for p in g["params"] if p.requires_grad] for g in self.param_groups]
        self._params: list[torch.nn.Parameter] = [p for ps in managed for p in ps]
        if not self._params:
            raise ValueError("params: no parameter requires grad; nothing to optimize")
        if not any(p.numel() for p in self._params) and runtime_of_param(self._params[0]) \
                is None:
            raise ValueError("params: every trainable parameter has 0 elements; nothing to "
                             "optimize")
        # A model wrapped in DDP first (DDP's constructor refuses the other order).
        interop.check_no_ddp([p for g in self.param_groups for p in g["params"]], "ZeroAdamW")
        self._index = {id(p): i for i, p in enumerate(self._params)}
        # Frozen now, trainable later: refused at step() (its state was never planned).
        self._frozen = [p for g in self.param_groups for p in g["params"]
                        if not p.requires_grad]
        self._rt = self._stage3_runtime(stage)
        check_offload_params(self._rt, offload)
        self.comm = self._rt.comm if self._rt is not None else Comm(process_group)
        self._shapes = [self._rt.shape_of(p) if self._rt else p.shape for p in self._params]
        self.dtype, self.device = common_dtype_device(self._params)
        self._bucket_numel = bucket_numel
        self._overlap = overlap_comm
        check_same_on_all_ranks(self.comm, stage, bucket_numel, [len(ps) for ps in managed],
                                self._shapes, self._params, offload)
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
        self._events = 0  # gradients delivered by autograd hooks (stages 0-2)
        self._stepped_events: int | None = None  # _grad_events() when the last step ended
        self._reduced: _Reduced | None = None  # this step's reduction, once done
        self._zero_kept = False  # zero_grad(set_to_none=False): every .grad is a zero tensor
        self._warned_carry = False
        self._versions: tuple[int, ...] | None = None  # parameters as ZeroAdamW last left them
        interop.register_params(self._params, self)
        self.state = ShardedStateView(self)  # type: ignore[assignment]
        # p.grad between a synchronised backward and step(): a GradGuard (grad_guard.py).
        self._guards: list[GradGuard | None] = []
        self._guarded = False  # the guards are on the parameters now
        self._guard_cb_task = -1  # the backward (graph task) whose end installs them
        self._sq_views: tuple[Any, list[torch.Tensor], torch.Tensor] | None = None
        self._guard_norm_cache: list[float] | None = None
        self._pre_hooks: list[Any] = []
        self._hooks: list[Any] = []
        self._watch_grads(self._params)
        me = weakref.ref(self)
        if self._rt is not None:
            # Stage 3: gradients of the model's parameters outside this optimizer stay on
            # their .grad (plain leaves, as in torch) instead of being reduced and dropped.
            self._rt.hook_params(self._params)
            self._build()  # stage 3: the units fix the layout already
            self._rt.backward_end_callbacks.append(functools.partial(_end_backward, me))
        self._last_comm = self.comm.reset_stats()
        self._constructed = True

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
        self._events += 1
        task = torch._C._current_graph_task_id()
        if self._sync and task != self._guard_cb_task:
            # When this backward ends (after every hook of it): the guards go on. Keyed by
            # the backward, not a flag: a backward that raised never runs its callbacks.
            self._guard_cb_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._install_guards)
        g = self._params[index].grad
        if g is not None and g.layout != torch.strided:
            raise TypeError(
                f"ZeroAdamW: parameter {index} got a {g.layout} gradient; sparse gradients "
                "are not supported (build nn.Embedding / EmbeddingBag with sparse=False)")
        if self._engine is not None:
            rebind.check_grad_param(self, index)  # cast or moved since the first step
            self._engine.on_grad(index)
        elif index not in self._seen:  # before the layout exists: learn the ready order
            self._seen.add(index)
            self._observed.append(index)

    def _broadcast_params(self, params: list[torch.nn.Parameter] | None = None) -> None:
        params = self._params if params is None else params
        if self.comm.world_size == 1:
            return
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            self.comm.broadcast(flat, 0, "initial parameters")
            off = 0
            for p in params:
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
            # Where the parameters are now: a model moved after ZeroAdamW was built (as
            # Accelerate's prepare does, and the HF Trainer with optimizers=) trains there,
            # as torch's AdamW would; nothing was allocated for the old place.
            self.dtype, self.device = common_dtype_device(self._params)
            layout = build_layout(
                self._group_sizes, stage=self.stage, world_size=self.comm.world_size,
                rank=self.comm.rank, bucket_numel=self._bucket_numel, ready_order=ready_order,
            )
        self._engine = make_engine(
            self.stage, self.offload, layout, self._params, self.comm, dtype=self.dtype,
            device=self.device, overlap=self._overlap, backend=self.backend, runtime=self._rt)
        self._engine.set_sync(self._sync)
        self.layout = layout
        self._mark_params()
        return layout

    # -- parameters written from outside ----------------------------------------------------
    def _param_versions(self) -> tuple[int, ...]:
        # Stage 3: the shard store itself (model.load_state_dict's hook writes into it);
        # stages 0-2: each parameter (its in-place writes, e.g. load_state_dict's copy_, bump
        # its own counter; ZeroAdamW writes the flat buffer underneath, which does not).
        if self._rt is not None:
            return (self._rt.local_params._version,)
        return tuple(p._version for p in self._params)

    def _mark_params(self) -> None:
        """Remember the parameters' versions: ZeroAdamW has just written them (or its master
        agrees with them)."""
        self._versions = self._param_versions() if self._engine is not None else None

    def _adopt_param_writes(self) -> None:
        """torch's AdamW reads its parameters at every step, so weights written into the
        model after construction (model.load_state_dict, p.copy_) are what it trains from.
        ZeroAdamW's fp32 master (16-bit parameters; with offload, every parameter) would
        overwrite them at the next step: when the parameters changed since ZeroAdamW last
        wrote them, the master takes them."""
        self.state.adopt_step_writes()  # opt.state[p]["step"] written in place: the same
        if self._engine is None or self._versions is None:
            return
        # `p.data = t` since: t is adopted (its master too); a cast or move is refused.
        with torch.no_grad():
            (rebind.adopt_stage3 if self._rt is not None else rebind.adopt_flat)(self)
        if self._param_versions() != self._versions:
            with torch.no_grad():
                self._engine.init_master()
            self._mark_params()

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
        """``loss`` times the current loss scale (``loss_scale=``; unchanged without one):
        call ``opt.scale_loss(loss).backward()``. ``step()`` divides the scale out."""
        return loss * self.scaler.scale if self.scaler is not None else loss

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without ``loss_scale=``)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: drop this step's gradients. ``set_to_none=False`` keeps a zero
        gradient on every parameter, so the next step updates every parameter (decay,
        moments), as torch's AdamW does. Call it after every ``step()``."""
        self._discard_guards()
        if self._reduced is not None:
            # Gradients reduced (for a clip_grad_norm_) and then dropped without a step (the
            # "non-finite norm: zero_grad() and skip the batch" pattern): forget the step.
            self._reduced = None
            self._engine.end_step()
        self._stepped_events = None
        # torch keeps zero gradients on every parameter: AdamW then updates them all (decay,
        # moments), those autograd left alone included. Stages 2-3 hold no .grad to zero, so
        # the next steps count every parameter as having one, as torch would.
        self._zero_kept = not set_to_none
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
        """One AdamW step of this rank's shard, then the parameters gathered where the stage
        keeps them whole. Finishes the gradient reduction, runs the one norm-and-flags
        all-reduce (clipping, the fp16 overflow skip), updates, and returns ``closure()``'s
        loss as torch's does. A collective: call it on every rank."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._adopt_param_writes()
        coef = self._guard_coef()  # mixed factors: refused before anything is reduced
        red = self._reduce_grads(relay=False)  # the step ends them: no need to put them back
        self.last_step_skipped = False
        if self.scaler is not None and not math.isfinite(red.sq_norm):
            self.scaler.update(True)  # every rank saw the same sum: all skip together
            self.last_step_skipped = True  # trainers skip their LR scheduler step on it
            self._end_step()
            return loss
        clip = red.clip * coef
        if self.max_grad_norm is not None:
            clip *= min(1.0, self.max_grad_norm / (red.norm * clip + 1e-6))
        # An infinite norm (no loss scaler to skip the step) clips by 0, as torch's
        # clip_grad_norm_ does: finite gradients become 0, infinite ones NaN.
        grad_scale = (self.loss_scale / clip if clip > 0
                      else math.nan if math.isnan(clip) else math.inf)
        self._engine.update(self._runs(red.active), self.param_groups, grad_scale, red.active)
        for i, a in enumerate(red.active):
            if a:
                self._steps[i] += 1
        if self.scaler is not None:
            self.scaler.update(False)
        self._end_step()
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over every parameter this optimizer trains: returns
        the total norm of the averaged gradients over all ranks (a 0-d tensor on the
        parameters' device) and clips them by it at the next step(). A collective: call it on
        every rank, between the last backward and step() (torch.nn.utils.clip_grad_norm_ on
        these parameters comes here too). With a loss scaler the norm is of the unscaled
        gradients."""
        if float(norm_type) != 2.0:
            raise ValueError(f"norm_type: ZeroAdamW clips by the 2-norm only, got {norm_type!r}")
        # max_norm=inf is torch's way to ask for the norm alone (the HF Trainer logs it so).
        if not (isinstance(max_norm, (int, float)) or torch.is_tensor(max_norm)) or \
                not (finite_ge0(max_norm) or float(max_norm) == math.inf):
            raise ValueError(f"max_norm must be a number >= 0 (inf: no clipping), got "
                             f"{max_norm!r}")
        red = self._reduce_grads(need_norm=True)
        if error_if_nonfinite and not math.isfinite(red.norm):
            raise RuntimeError(
                "The total norm of order 2.0 for gradients from `parameters` is non-finite, "
                "so it cannot be clipped. To disable this error and scale the gradients by "
                "the non-finite norm anyway, set `error_if_nonfinite=False`")
        if float(max_norm) != math.inf:
            red.clip *= min(1.0, float(max_norm) / (red.norm * red.clip + 1e-6))
        return torch.tensor(red.norm * red.clip_before, device=self.device)

    def _reduce_grads(self, need_norm: bool = False, relay: bool = True) -> _Reduced:
        # Internals read the real .grad (bucket views, gradients set by hand): the guards
        # come off for the reduction and go back on after it, for torch's utilities.
        was = self._guarded
        self._lift_guards()
        done = False
        try:
            red = self._reduce_grads_now(need_norm)
            done = True
            return red
        finally:
            if was and (relay or not done):  # an error leaves p.grad as it was
                self._relay_guards()

    def _reduce_grads_now(self, need_norm: bool = False) -> _Reduced:
        """Finish this step's gradient reduction and run the one small all-reduce (and host
        sync) of the step: the squared-norm partial and a flag per parameter saying whether it
        got a gradient on some rank (the others are left untouched, as AdamW does). Done once
        per step: clip_grad_norm_ and step() share it."""
        events = self._grad_events()
        red = self._reduced
        if red is not None:
            if red.events != events:
                raise RuntimeError(
                    "ZeroAdamW: gradients were produced after clip_grad_norm_() in this step; "
                    "call it after the last backward, right before step()")
            if need_norm and not red.has_norm and red.param_sq is not None:
                # Reduced without a norm (p.grad read first): the per-parameter squares
                # that came with the reduction give it.
                red.sq_norm = math.fsum(red.param_sq)
                red.norm = math.sqrt(red.sq_norm) / self.loss_scale
                red.has_norm = True
                self.last_grad_norm = red.norm
            if need_norm and not red.has_norm:
                raise RuntimeError("ZeroAdamW: clip_grad_norm_() after the gradients were "
                                   "reduced without a norm; call it right before step()")
            red.clip_before = red.clip
            return red
        if self._stepped_events is not None and events == self._stepped_events:
            raise RuntimeError(
                "ZeroAdamW: step() again with no backward since the last step(). torch's "
                "AdamW would step again with the same gradients; ZeroAdamW has used them up. "
                "Run backward() before every step() (call opt.zero_grad() first if a step "
                "without gradients is what you mean: it then updates nothing, as in torch)")
        # Every group's hyperparameters (a scheduler may have changed them) before any group
        # is touched: a NaN lr in the second group must not leave the first one updated.
        for gi, g in enumerate(self.param_groups):
            check_hparams(g["lr"], g["betas"], g["eps"], g["weight_decay"],
                          f" (param group {gi})")
            # A torch AdamW flag set on a group afterwards (g["amsgrad"] = True) is not
            # dropped in silence either.
            check_adamw_flags(g, f" (param group {gi})")
        for p in self._frozen:
            if p.requires_grad:
                raise RuntimeError(
                    f"ZeroAdamW: a parameter of shape {tuple(p.shape)} had requires_grad=False "
                    "when ZeroAdamW was built and requires grad now; its optimizer state was "
                    "never planned, so it would not be trained. Set requires_grad before "
                    "building ZeroAdamW")
        if self.layout is None:
            self._first_step_layout()
        self._deliver_unseen_grads()
        eng = self._engine
        self._check_not_carried(events)
        got = eng.finish_grads()
        if self._zero_kept:
            got = [True] * len(got)
        need_norm = need_norm or self.max_grad_norm is not None or self.scaler is not None
        flags = torch.tensor([float(x) for x in got], dtype=torch.float32)
        n = len(got)
        # Each parameter's squared norm rides along in the same all-reduce, for torch's
        # utilities reading p.grad (grad_guard.py): a rank that reads p.grad.norm() alone
        # (logging on rank 0) then joins the collective every rank makes at step(). Always
        # (one multi-tensor norm pass over the local shard), so that the all-reduce has the
        # same size on every rank whatever each one did. Stage 0 holds the averaged
        # gradients: computed there when asked, without a collective.
        extra = not eng.replicated_grads
        vec = torch.cat([torch.zeros(1), flags] + ([torch.zeros(n)] if extra else []))
        vec = vec.to(self.device)
        if extra:
            vec[1 + n:] = self._param_sq_partials()
            if need_norm:  # the same pass gives the total: no second read of the shard
                vec[0] = vec[1 + n:].sum()
        self.comm.all_reduce(vec, "grad norm and grad flags", count=False)
        if need_norm and eng.replicated_grads:  # every rank holds the full averaged grad
            vec[0] = eng.grad_sq_norm()
        vals = vec.tolist()
        red = _Reduced(events=events, sq_norm=vals[0], active=[v > 0 for v in vals[1:n + 1]],
                       has_norm=need_norm)
        if extra:
            red.param_sq = vals[1 + n:]
        red.norm = math.sqrt(vals[0]) / self.loss_scale if need_norm else 0.0
        if need_norm:
            self.last_grad_norm = red.norm
        self._reduced = red
        return red

    def _check_not_carried(self, events: int) -> None:
        """No zero_grad() since the last step: torch's AdamW would add this step's gradients
        to the last step's. Stage 0 does the same (the bucket views keep them); stage 1
        cannot (the last step's sums were averaged in place), so it refuses; stages 2-3 keep
        no gradient between steps, and cannot tell this from model.zero_grad(): warn once."""
        if self._stepped_events is None or events == self._stepped_events:
            return
        if self.stage == 1 and self._engine.reducer.carried:
            raise RuntimeError(
                "ZeroAdamW(stage=1): no zero_grad() since the last step(), so torch's AdamW "
                "would accumulate gradients across steps, which stage 1 cannot do. Call "
                "opt.zero_grad() after every step() (use opt.no_sync() to accumulate "
                "micro-batches within a step)")
        if self.stage in (2, 3) and not self._warned_carry:
            self._warned_carry = True
            warnings.warn(
                "ZeroAdamW: step() with no opt.zero_grad() since the last step(). At stages "
                "2-3 gradients are not carried from one step to the next (torch's AdamW would "
                "accumulate them). If you clear them with model.zero_grad(), this is harmless; "
                "otherwise call opt.zero_grad() after every step()", stacklevel=3)

    def _grad_events(self) -> int:
        return self._rt.grad_events if self._rt is not None else self._events

    def _deliver_unseen_grads(self) -> None:
        """Gradients on the parameters that no autograd hook delivered in this step (set by
        hand, left by no_sync backwards, or zeros kept by zero_grad(set_to_none=False)) are
        used, as torch's AdamW uses whatever .grad holds (stage 3: its runtime does this)."""
        if self._rt is not None or not self._sync:
            return
        red = self._engine.reducer
        for i, p in enumerate(self._params):
            if p.grad is not None and not red.got_grad[i]:
                if p.grad.layout != torch.strided:
                    raise TypeError(f"ZeroAdamW: parameter {i} has a {p.grad.layout} "
                                    "gradient; sparse gradients are not supported")
                red.on_grad_ready(i, in_backward=False)

    def _end_step(self) -> None:
        self._discard_guards()
        self._engine.end_step()
        self._mark_params()
        self.state.refresh_steps()  # opt.state[p]["step"] counts, as torch's does
        self._reduced = None
        self._stepped_events = self._grad_events()
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

    # -- p.grad for torch's utilities (grad_guard.py) ----------------------------------------
    def _watch_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Guard slots for new trainable parameters, and a hook on each that runs before
        autograd accumulates into it: a new backward has begun, so the real .grad (stages
        0-1: the bucket view; otherwise None) goes back first."""
        me = weakref.ref(self)
        first = len(self._guards)
        self._guards += [None] * len(params)
        self._pre_hooks += [p.register_hook(functools.partial(_before_accumulate, me))
                            for p in params]
        if self._rt is None:  # stage 3: the shard_model runtime delivers the gradients
            # Weak: an optimizer dropped by the script must not live on through its
            # parameters' hooks, nor keep acting on their gradients.
            self._hooks += [p.register_post_accumulate_grad_hook(
                functools.partial(_delivered, me, first + k)) for k, p in enumerate(params)]

    def _install_guards(self) -> None:
        """End of a synchronised backward: every trainable parameter's ``.grad`` becomes its
        GradGuard (the real one, if any, kept on the guard), so torch's clipping utilities
        either compute the global norm or are refused, whatever the stage."""
        if not self._sync:
            return
        for i, p in enumerate(self._params):
            g = self._guards[i]
            if g is None:
                g = self._guards[i] = GradGuard(p, self, i)
            if p.grad is not g:
                g.zk_held = p.grad
                g.zk_coef = 1.0
                p.grad = g
        self._guarded = True

    def _lift_guards(self) -> None:
        if not self._guarded:
            return
        for p, g in zip(self._params, self._guards):
            if g is not None and p.grad is g:
                p.grad = g.zk_held
        self._guarded = False

    def _relay_guards(self) -> None:
        for p, g in zip(self._params, self._guards):
            if g is not None and p.grad is not g:
                g.zk_held = p.grad
                p.grad = g
        self._guarded = True

    def _discard_guards(self) -> None:
        """The step is over (or its gradients dropped): the real .grad goes back."""
        self._lift_guards()
        for g in self._guards:
            if g is not None:
                g.zk_coef, g.zk_held = 1.0, None
        self._guard_norm_cache = None

    def _guard_coef(self) -> float:
        """The one scalar torch's utilities multiplied every guarded gradient by (clipping
        through p.grad); refused, before anything changes, when they differ."""
        coefs = {g.zk_coef for g in self._guards if g is not None}
        if coefs and all(math.isnan(c) for c in coefs):
            return math.nan  # torch's clip by a NaN norm: NaN gradients, as in torch
        if len(coefs) > 1:
            raise RuntimeError(
                "ZeroAdamW: the gradients were scaled through p.grad by different factors "
                "(a clip over some of the parameters only, or clip_grad_value_-like code). "
                "ZeroAdamW clips by one global norm: use opt.clip_grad_norm_(max_norm) "
                "before step(); call opt.zero_grad() to drop this step's gradients")
        return coefs.pop() if coefs else 1.0

    def _param_sq_partials(self) -> torch.Tensor:
        """This rank's part of every parameter's squared gradient norm (fp32, one entry per
        trainable parameter), from its pieces of the local space; a fused multi-tensor norm
        on CUDA."""
        eng = self._engine
        if self._sq_views is None or self._sq_views[0] is not eng:  # once per layout
            views, owner = [], []
            for pc in self.layout.pieces:
                if pc.param >= 0 and pc.numel:
                    for t in eng.grad_slices(pc.local_start, pc.numel):
                        views.append(t)
                        owner.append(pc.param)
            self._sq_views = (eng, views, torch.tensor(owner, device=self.device))
        _, views, owner_t = self._sq_views
        out = torch.zeros(len(self._params), dtype=torch.float32, device=self.device)
        if views:
            norms = torch.stack(torch._foreach_norm(views, 2, dtype=torch.float32))
            out.index_add_(0, owner_t, norms.to(self.device).square())
        return out

    def _guard_norms(self) -> list[float]:
        """The 2-norm of every trainable parameter's averaged gradient over all ranks (torch's
        norm of p.grad under DDP), after opt.clip_grad_norm_'s clipping. They come with the
        step's one all-reduce (see _reduce_grads_now): no collective of their own."""
        if self._guard_norm_cache is None:
            red = self._reduce_grads()
            sq = red.param_sq
            if sq is None:  # stage 0: every rank holds the averaged gradients
                sq = red.param_sq = self._param_sq_partials().tolist()
            scale = red.clip / self.loss_scale
            self._guard_norm_cache = [math.sqrt(max(v, 0.0)) * scale for v in sq]
        return self._guard_norm_cache

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
        (laid out in reverse registration order), and nothing is fixed by asking.

        ``total`` (= ``device_total``) is what the device holds; ``host_total`` what host
        memory holds (0 without offload). With ``offload="cpu"`` the device kinds are the
        16-bit parameters and the gradient buffers (``master``, ``exp_avg``, ``exp_avg_sq``
        are 0), and the ``host_*`` keys give the host side: master and moments (12Ψ/N), the
        gradient shard, the two staging slots, padding."""
        if self._engine is not None:
            return self._engine.memory_stats()
        L = build_layout(self._group_sizes, stage=self.stage, world_size=self.comm.world_size,
                         rank=self.comm.rank, bucket_numel=self._bucket_numel)
        return planned_memory(self.stage, self.offload, L, self.dtype)


def _before_accumulate(ref: weakref.ref, grad: torch.Tensor) -> None:
    """Tensor hook of every trainable parameter, run before autograd accumulates into it: a
    new backward has begun, so the real gradients go back on the parameters."""
    opt = ref()
    if opt is None or not opt._guarded:
        return
    if any(g is not None and g.zk_coef != 1.0 for g in opt._guards):
        raise RuntimeError(
            "ZeroAdamW: the gradients were scaled through p.grad (torch's clip_grad_norm_ or "
            "clip_grads_with_norm_) and then another backward started before step(); torch "
            "would add the new gradients to the clipped ones, which ZeroAdamW cannot. Clip "
            "after the last backward of the step, right before step()")
    opt._lift_guards()
    opt._guard_norm_cache = None


def _delivered(ref: weakref.ref, index: int, _p: torch.Tensor) -> None:
    opt = ref()
    if opt is not None:
        opt._on_grad(index)


def _end_backward(ref: weakref.ref) -> None:
    opt = ref()
    if opt is not None:
        opt._install_guards()
