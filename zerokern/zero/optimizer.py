"""ZeroAdamW: ZeRO stages 0-3 as a drop-in replacement for DDP + torch.optim.AdamW.

ZeroAdamW is a ``torch.optim.Optimizer`` (param_groups, state, state_dict / load_state_dict,
add_param_group, zero_grad, step, torch's hooks and LR schedulers work on it). The work is
done by parts it holds, one file each:

- ``_table`` (param_table.py): the trained parameters, their index, full shapes, frozen
  ones, group sizes and step counts;
- ``_slot`` (engine_slot.py): the stage's engine (stages/) and the layout it was built for,
  the gradient order of the first backward, parameters written from outside;
- ``_reduction`` (reduction.py): the step's one norm-and-flags all-reduce, its record and
  the clipping coefficient;
- ``_guards`` (guard_set.py): what ``p.grad`` holds between a backward and ``step()``;
- ``_edits`` (grad_edits.py): gradients the script set or dropped by hand after backward,
  and the zero gradients ``zero_grad(set_to_none=False)`` keeps;
- ``_access`` (optimizer_state.py): ``opt.state``, ``shards()`` / ``edit_shards()``, the
  per-rank state dict;
- ``_interchange`` (interchange.py): the state in torch.optim.AdamW's format.

This file holds the public surface (each method a delegation), the gradient hooks, and the
sequence of a step: ``step()`` and ``_reduce_grads_now()``, readable in one place. It is
longer than the ~300 lines of a part because the API reference is generated from the
docstrings here.
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

from ..comm.collectives import comm_summary
from ..comm.mesh import check_same_mesh
from . import interop
from .agreement import agree_at_construction
from .config import ZeroConfig
from .engine_slot import EngineSlot
from .grad_edits import GradEdits, late_edit_error, param_label
from .guard_set import GuardSet
from .interchange import TorchFormat, check_adamw_flags, is_torch_format, strip_adamw_flags
from .layout import Layout
from .optimizer_state import StateAccess, set_seed
from .param_groups import check_groups, check_new_group
from .param_table import ParamTable, broadcast_params, stage3_runtime, trained_params
from .reduction import GradReduction, Reduced, grad_scale
from .rules import ADAMW, UpdateRule
from .scaler import LossScaler
from .shards import ParamShard
from .stage3 import foreign
from .stages import Engine
from .state_format import StateFormat
from .validate import (
    check_eps_moments,
    check_gather_dtype_params,
    check_hparams,
    check_master_dtype,
    check_offload_params,
    check_seed,
    common_dtype_device,
    finite_ge0,
)


class ZeroAdamW(torch.optim.Optimizer):
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
            Must be > 0 with ``moments="int8"`` (in every param group too, also when
            edited later): a second moment can decode to 0 there.
        weight_decay: decoupled weight decay, applied before the moments are updated.
        amsgrad: as torch's; only False (AdamW without AMSGrad) is implemented, True is
            refused.
        maximize: as torch's; only False, True is refused (minimize the negated loss).
        foreach: accepted and ignored: it chooses torch's kernels; ZeroAdamW's own run
            once over each flat shard.
        capturable: accepted and ignored, as ``foreach``.
        differentiable: only False (the step is not recorded by autograd).
        fused: accepted and ignored, as ``foreach``.
        stage: the ZeRO stage, an int 0-3 (3 needs a model partitioned by
            ``shard_model``).
        process_group: the group whose ranks share the work; default the world.
        bucket_numel: gradient bucket size in elements (stages 0-2); default 2**21.
        max_grad_norm: clip every step to this global 2-norm (None: no clipping).
        loss_scale: ``"dynamic"`` or a float, for fp16 parameters: scale the loss with
            ``scale_loss`` and overflowing steps are skipped on every rank.
        overlap_comm: run the gradient collectives asynchronously, overlapping backward.
        backend: the kernels' backend: ``"cuda"``, ``"triton"``, ``"cpu"``, ``"torch"``, or
            None for the fastest available (``$ZEROKERN_BACKEND`` also sets it). With
            ``offload`` the step runs on host tensors: ``"cuda"`` and ``"triton"`` are
            refused there (ValueError), ``"cpu"``, ``"torch"`` and None run.
        offload: ``"cpu"`` for ZeRO-Offload (stages 1-3), None to keep the state on the
            parameters' device.
        moments: how ``exp_avg`` and ``exp_avg_sq`` are stored: ``"fp32"`` (default, exact
            AdamW), ``"bf16"``, or ``"int8"`` (8-bit block-wise codes: blocks of 256
            elements of one parameter, each with an fp32 absmax, a dynamic-exponent map,
            signed for ``exp_avg`` and unsigned for ``exp_avg_sq``). A parameter with fewer
            than 4,096 elements keeps fp32 moments, decided on the whole parameter, so the
            format never depends on the world size or the stage.
        master: ``"fp32"`` (default: an fp32 master copy of 16-bit parameters) or
            ``"none"`` (bf16 parameters only: no master; the update is written into the
            bf16 parameters with stochastic rounding keyed by (``seed``, step, the element's
            index in its parameter), the same bits on every backend, world size and stage).
        seed: the stochastic rounding key of ``master="none"``, in [0, 2**63); saved with
            the state.
        mesh: instead of ``process_group``, a ``torch.distributed.device_mesh.DeviceMesh``.
            2-D: hybrid sharding (FSDP2's HSDP convention, dim 0 replicate, dim 1 shard,
            whatever the dims are named): the state (stage 2: and the gradients) is split
            over the S ranks of this rank's shard group; gradients are reduce-scattered
            within it, all-reduced across the R ranks of the replicate group and averaged
            over S * R; the new parameters are all-gathered within the shard group only
            (stage 0: the same three collectives per bucket). ``comm`` is then the shard
            group's (``comm.replicate`` the replicate group's). A 1-D mesh is its group. At
            stage 3 the model's mesh (``shard_model(mesh=)``) is used; one given here must
            be the same. A wrong mesh raises ValueError naming ``mesh`` on every rank
            before anything changes (docs/hybrid.md).
        reduce_dtype: None (reduce gradients in the parameters' dtype) or ``torch.float32``:
            16-bit parameters' gradients are reduced in fp32 (buckets, units' buffers and
            the gradient shard in fp32) and reach the fused step in fp32, as FSDP2's
            ``MixedPrecisionPolicy(reduce_dtype=)``; ``memory_stats()`` / ``comm_stats()``
            count the extra bytes. Not with ``offload``. ``"int8"`` / ``"int4"`` (stages
            1-3, ZeRO++'s qgZ): the gradients stay in the parameters' dtype and travel as
            block-wise int8 / int4 codes with an fp32 scale per 256 elements, each hop
            summed in fp32 (on a 2-D mesh, within the shard group and then across the
            replicate group); refused at stage 0 and with ``offload``
            (docs/reference/quantized-comm.md).
        gather_dtype: None, or ``"int8"`` (stages 1-3, ZeRO++'s qwZ): the parameters are
            all-gathered as block-wise int8 codes, every rank (the sender too) using the
            decoded values, so ranks agree bit for bit; the fp32 master, or stage 3's
            shards, are never quantized. Refused at stage 0, with ``offload``, with
            ``master="none"`` at stages 1-2 and with fp32 parameters at stages 1-2 (there
            the gathered buffer is the only copy of the weights).
        config: a ``zerokern.ZeroConfig`` holding ZeroAdamW's own options (``stage``
            through ``gather_dtype`` above, except ``process_group`` and ``mesh``), instead
            of those keywords; giving one of them as well, at another value than its
            default, is refused.

    Every rank must give the same ``stage``, ``bucket_numel``, ``offload``, ``moments``,
    ``master``, ``seed``, ``reduce_dtype``, ``gather_dtype``, ``loss_scale``,
    ``max_grad_norm``, mesh, per-group ``lr``, ``betas``, ``eps`` and ``weight_decay``, and
    the same parameters (shapes and dtypes): the constructor compares them across ranks in
    one gather, before any other collective, and raises ValueError on every rank naming each
    one that differs and every rank's value. An argument refused on one rank is raised on
    every rank. ``overlap_comm`` and ``backend`` may differ (the collectives are the same,
    and the kernels agree bit for bit).

    Attributes:
        config: the options as a ``ZeroConfig`` (validated and agreed across ranks).
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

    rule: ClassVar[UpdateRule] = ADAMW  # the update the state is stepped with (zero/rules/)

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
        moments: str = "fp32",
        master: str = "fp32",
        seed: int = 0,
        mesh: Any = None,
        reduce_dtype: torch.dtype | str | None = None,
        gather_dtype: str | None = None,
        config: ZeroConfig | None = None,
    ) -> None:
        # torch.optim.AdamW's signature, so that a script's AdamW(...) call works unchanged:
        # the flags that change the update are refused unless at AdamW's values; foreach,
        # fused and capturable choose torch's kernels, and ZeroAdamW has its own.
        del foreach, fused, capturable
        # Every check runs first, then one gather compares the options across ranks and
        # carries any rank's refusal to every rank (agreement.py); nothing is modified and
        # no other collective runs before it.
        cfg: ZeroConfig | None = None
        rt: Any = None
        table: ParamTable | None = None
        failure: BaseException | None = None
        try:
            cfg = ZeroConfig.merge(config, dict(
                stage=stage, bucket_numel=bucket_numel, max_grad_norm=max_grad_norm,
                loss_scale=loss_scale, overlap_comm=overlap_comm, backend=backend,
                offload=offload, moments=moments, master=master, seed=seed,
                reduce_dtype=reduce_dtype, gather_dtype=gather_dtype)).validate()
            check_hparams(lr, betas, eps, weight_decay)
            check_eps_moments(eps, cfg.state_format.moments)
            check_adamw_flags(dict(amsgrad=amsgrad, maximize=maximize,
                                   differentiable=differentiable), "")
            defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
            super().__init__(params, defaults)
            check_groups(self.param_groups, flags=False, moments=cfg.state_format.moments)
            managed, frozen = trained_params(self.param_groups)
            # A model wrapped in DDP first (DDP's constructor refuses the other order).
            interop.check_no_ddp([p for g in self.param_groups for p in g["params"]],
                                 "ZeroAdamW")
            rt = stage3_runtime([p for ps in managed for p in ps], cfg.stage)
            check_offload_params(rt, cfg.offload)
            if rt is not None:
                check_same_mesh(mesh, rt.comm)
            table = ParamTable(managed, frozen, rt)
            dtype, device = common_dtype_device(table.params)  # meta parameters refused
            check_master_dtype(cfg.state_format, dtype)
            check_gather_dtype_params(cfg.wire.gather_bits, cfg.stage, dtype)
        except (ValueError, TypeError, RuntimeError) as exc:
            failure = exc
        self.comm = agree_at_construction(
            None if cfg is None else cfg.agreed(), failure, runtime=rt, mesh=mesh,
            process_group=process_group, param_groups=getattr(self, "param_groups", []),
            table=table)
        assert cfg is not None and table is not None  # else agree raised
        self.config = cfg
        self.stage = cfg.stage
        self.offload = cfg.offload
        self.max_grad_norm = None if cfg.max_grad_norm is None else float(cfg.max_grad_norm)
        self.scaler = LossScaler.from_arg(cfg.loss_scale)
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False  # the last step() skipped (loss-scaler overflow)
        self._rt, self._table = rt, table
        params = table.params
        if rt is None:
            broadcast_params(self.comm, params)  # stage 3: shard_model did it
        else:
            rt.set_reduce_dtype(cfg.reduce_dtype if isinstance(cfg.reduce_dtype, torch.dtype)
                                else dtype)
            rt.set_wire(cfg.wire)
        self._slot = EngineSlot(table, self.comm, stage=cfg.stage, offload=cfg.offload,
                                runtime=rt, bucket_numel=cfg.bucket_numel,
                                overlap=cfg.overlap_comm, backend=cfg.backend, dtype=dtype,
                                device=device, fmt=cfg.state_format, seed=int(cfg.seed),
                                reduce_dtype=cfg.reduce_dtype, rule=self.rule, wire=cfg.wire)
        self._reduction = GradReduction(self.comm, self._rt)
        self._edits = GradEdits(len(params))
        me = weakref.ref(self)
        self._guards = GuardSet(params, self._guard_measure,
                                edited=functools.partial(_edited, me),
                                stale=functools.partial(_stale, me))
        self._access = StateAccess(table, self._slot, self.comm, stage=cfg.stage,
                                   runtime=rt, shards=self.shards)
        self._interchange = TorchFormat(table, self._access, self.comm, cfg.stage)
        self._grad_hooks: list[Any] = []
        interop.register_params(params, self)
        self._watch_grads(params, 0)
        if self._rt is not None:
            # Stage 3: gradients of the model's parameters outside this optimizer stay on
            # their .grad (plain leaves, as in torch) instead of being reduced and dropped.
            self._rt.hook_params(params)
            self._slot.build(self.param_groups)  # stage 3: the units fix the layout already
            self._rt.backward_end_callbacks.append(
                functools.partial(_end_backward, weakref.ref(self)))
            foreign.track(self, self._rt)  # one live optimizer per sharded model, at step()
            # The last step's stale guards come off before any unit reads p.grad.
            self._rt.backward_begin_callbacks.append(
                functools.partial(_begin_backward, weakref.ref(self)))
        self._last_comm = self.comm.reset_stats()
        self._constructed = True

    # -- what the parts hold, read as attributes --------------------------------------------
    @property
    def layout(self) -> Layout | None:
        """The flat layout of the parameters, fixed at the first ``step()`` (stages 0-2) or at
        construction (stage 3); None until then."""
        return self._slot.layout

    @property
    def state_format(self) -> StateFormat:
        """How the state is stored: ``moments`` and ``master`` as given at construction."""
        return self._slot.fmt

    @property
    def seed(self) -> int:
        """The stochastic rounding key of ``master="none"``; load_checkpoint and
        load_state_dict set it back to the saved state's, so the rounding goes on as it
        would have."""
        return self._slot.seed

    @seed.setter
    def seed(self, value: int) -> None:
        check_seed(value)
        set_seed(self._slot, value)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the trained parameters."""
        return self._slot.dtype

    @property
    def device(self) -> torch.device:
        """The device of the trained parameters (where they are when laid out)."""
        return self._slot.device

    @property
    def backend(self) -> str | None:
        """The kernels' backend asked for (None: the fastest available)."""
        return self._slot.backend

    @property
    def _engine(self) -> Engine | None:
        # Read by tests/test_offload.py and tests/test_gpu_offload.py (the engine's buffers).
        return self._slot.engine

    @property
    def state(self) -> Any:
        """This rank's part of each parameter's state, in torch's keys (ShardedStateView)."""
        # getattr: torch.optim.Optimizer.__init__ assigns state before the parts exist, and
        # an unpickled or deep-copied optimizer has none (its state is then {}, as before).
        access = getattr(self, "_access", None)
        return {} if access is None else access.view

    @state.setter
    def state(self, value: Any) -> None:
        access = getattr(self, "_access", None)
        if access is None:  # torch.optim.Optimizer.__init__'s empty dict: no state exists yet
            return
        access.view.replace(value)  # opt.state = defaultdict(dict): a reset, as in torch

    @property
    def managed_params(self) -> tuple[torch.nn.Parameter, ...]:
        """The parameters this optimizer trains (requires_grad at construction), in
        param-group order: the indices of shards() and of the state dicts."""
        return tuple(self._table.params)

    def shards_step(self, index: int) -> int:
        """The step count of managed parameter ``index`` (torch: ``state[p]["step"]``)."""
        return self._table.steps[index]

    def full_shape(self, p: torch.nn.Parameter) -> torch.Size:
        """The full shape of a managed parameter (stage 3: not its released empty shape)."""
        return self._table.shapes[self._table.index[id(p)]]

    # -- gradients from autograd ------------------------------------------------------------
    def _watch_grads(self, params: list[torch.nn.Parameter], first: int) -> None:
        """Guards for new trained parameters (``first``: the index of the first one) and, at
        stages 0-2, the hook that hands each gradient to the engine (stage 3: the
        shard_model runtime delivers them)."""
        self._guards.watch(params)
        if self._rt is None:
            # Weak: an optimizer dropped by the script must not live on through its
            # parameters' hooks, nor keep acting on their gradients.
            me = weakref.ref(self)
            self._grad_hooks += [p.register_post_accumulate_grad_hook(
                functools.partial(_delivered, me, first + k)) for k, p in enumerate(params)]

    def _on_grad(self, index: int) -> None:
        self._reduction.count_event()
        if self._slot.sync:
            self._guards.arm(self._install_guards)
        self._slot.on_grad(index)

    def _install_guards(self) -> None:
        """End of a synchronised backward: every trained parameter's ``.grad`` becomes its
        GradGuard (guard_set.py). (A method of the optimizer: bench_grad_guard.py switches it
        off to measure what the guards cost.)"""
        if self._slot.sync:
            self._guards.install()

    def _take_edits(self, edits: dict[int, torch.Tensor | None]) -> None:
        """The guards came off and some ``p.grad`` had been replaced by the script (set by
        hand, or to None) since the backward: grad_edits.py. After this step's reduction
        (clip_grad_norm_, a norm read through p.grad) the other ranks can no longer agree on
        it: refused, before anything changes."""
        if self._reduction.current is not None:
            i = min(edits)
            raise late_edit_error(self._label(i), edits[i] is None)
        self._edits.take(edits, self._table.params, self._slot.engine, self._label)

    def _label(self, index: int) -> str:
        """Parameter ``index`` as an error names it (grad_edits.param_label)."""
        return param_label(index, self._table.params[index], self._table.shapes[index],
                           self.param_groups, self._rt)

    # -- training-loop API ------------------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) for all but the last micro-batch."""
        prev = self._slot.sync
        self._slot.set_sync(False)
        try:
            yield
        finally:
            self._slot.set_sync(prev)

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
        gradient on every parameter that has one (under DDP: that the last step updated, or
        that got one since), so the next steps update those (decay, moments) with or without
        a new gradient, as torch's AdamW does. Call it after every ``step()``."""
        found = self._guards.discard()
        red = self._reduction.current
        # torch zeroes the gradients that exist and leaves the others None: AdamW then updates
        # (decays) the parameters that had one, and only those.
        kept = self._edits.zero_grad(set_to_none, found, self._table.params,
                                     None if red is None else red.active, self._slot.engine)
        if red is not None:
            # Gradients reduced (for a clip_grad_norm_) and then dropped without a step (the
            # "non-finite norm: zero_grad() and skip the batch" pattern): forget the step.
            self._slot.engine.end_step()
        self._reduction.forget()
        if self._slot.engine is not None:
            self._slot.engine.zero_grad(set_to_none, keep=kept)
            return
        for p in self._table.params:
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
        self._access.adopt_writes()  # weights and steps written from outside since
        coef = self._guards.coef()  # mixed factors: refused before anything is reduced
        red = self._reduce_grads(relay=False)  # the step ends them: no need to put them back
        self.last_step_skipped = False
        if self.scaler is not None and not math.isfinite(red.sq_norm):
            self.scaler.update(True)  # every rank saw the same sum: all skip together
            self.last_step_skipped = True  # trainers skip their LR scheduler step on it
            self._end_step(red.active)
            return loss
        scale = grad_scale(red, coef, self.max_grad_norm, self.loss_scale)
        self._slot.engine.update(self._table.runs(self.layout, red.active), self.param_groups,
                                 scale, red.active)
        self._table.advance(red.active)
        if self.scaler is not None:
            self.scaler.update(False)
        self._end_step(red.active)
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
            red.clip_to(float(max_norm))
        return torch.tensor(red.norm * red.clip_before, device=self.device)

    # -- the step's sequence ----------------------------------------------------------------
    def _reduce_grads(self, need_norm: bool = False, relay: bool = True) -> Reduced:
        # Internals read the real .grad (bucket views, gradients set by hand): the guards
        # come off for the reduction and go back on after it, for torch's utilities.
        with self._guards.lifted(relay=relay):
            return self._reduce_grads_now(need_norm)

    def _reduce_grads_now(self, need_norm: bool = False) -> Reduced:
        """Finish this step's gradient reduction and run the one small all-reduce (and host
        sync) of the step: the squared-norm partials and a flag per parameter saying whether
        it got a gradient on some rank (reduction.py). Done once per step: clip_grad_norm_,
        a norm read through p.grad, and step() share it."""
        events = self._reduction.events()
        if self._reduction.current is not None:
            red = self._reduction.reuse(events, need_norm, self.loss_scale)
        else:
            self._reduction.check_backward_since_step(events)
            # Nothing below changes anything until every group and parameter is checked.
            check_groups(self.param_groups, flags=True, moments=self.state_format.moments)
            self._table.check_frozen()
            if self.layout is None:
                self._slot.build_at_first_step(self.param_groups)
            self._slot.deliver_unseen_grads()
            self._reduction.check_not_carried(events, self.stage, self._slot.engine)
            need_norm = need_norm or self.max_grad_norm is not None or self.scaler is not None
            red = self._reduction.reduce(self._slot.engine, events=events, need_norm=need_norm,
                                         loss_scale=self.loss_scale, device=self.device,
                                         partials=self._param_sq_partials, edits=self._edits,
                                         layout=self.layout, label=self._label)
        if need_norm:
            self.last_grad_norm = red.norm
        return red

    def _param_sq_partials(self) -> torch.Tensor:
        # This rank's part of every parameter's squared gradient norm. (A method of the
        # optimizer: bench_grad_guard.py switches it off to measure what it costs.)
        return self._reduction.sq_partials(self._slot.engine, self.layout,
                                           len(self._table.params), self.device)

    def _guard_measure(self) -> tuple[list[float], float]:
        """For the guards' norms: every parameter's squared norm of its averaged gradient
        over all ranks, and clip / loss scale."""
        red = self._reduce_grads()
        if red.param_sq is None:  # stage 0: every rank holds the averaged gradients
            red.param_sq = self._param_sq_partials().tolist()
        return red.param_sq, red.clip / self.loss_scale

    def _end_step(self, active: list[bool]) -> None:
        # Stages 1-3 keep no whole gradient after the step: the updated parameters' guards
        # stay on as stale guards, so that the next backward tells a cleared gradient from a
        # carried one (guard_set.py); stage 0 keeps the averaged gradients, as torch.
        self._guards.discard(stale=[i for i, a in enumerate(active) if a]
                             if self.stage >= 1 else None)
        self._slot.engine.keep_set_grads(self._edits.values)
        self._edits.end_step(active)
        self._slot.engine.end_step()
        self._slot.mark_params()
        self._access.view.refresh_steps()  # opt.state[p]["step"] counts, as torch's does
        self._reduction.finish()
        self._last_comm = self.comm.reset_stats()

    # -- param groups -----------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's: the new group's parameters are trained from the next step() on.

        After construction this re-plans the layout with the new group appended (the
        existing groups keep their place, so their state is copied over unchanged) and is a
        collective: call it on every rank with the same group. Not between a backward and its
        step() (the pending gradients would be lost): that is refused."""
        # torch.optim.AdamW's own flags (a group written for it, e.g. {"fused": True}):
        # checked, and not kept, before anything changes.
        if isinstance(param_group, dict):
            param_group = strip_adamw_flags(
                param_group, f" (param group {len(self.param_groups)})", self.defaults)
        if not getattr(self, "_constructed", False):
            super().add_param_group(param_group)  # the constructor's groups
            return
        if self._slot.has_pending_grads():
            raise RuntimeError("add_param_group between backward() and step(): the pending "
                               "gradients would be lost; call it after step()")
        n_groups = len(self.param_groups)
        super().add_param_group(param_group)
        try:
            self._adopt_group(self.param_groups[-1])
        except BaseException:
            del self.param_groups[n_groups:]  # refused: nothing changed
            raise

    def _adopt_group(self, group: dict[str, Any]) -> None:
        new, shapes = check_new_group(group, self._table, self._rt, self.comm,
                                      moments=self.state_format.moments,
                                      options=self.config.agreed(),
                                      param_groups=self.param_groups,
                                      gi=len(self.param_groups) - 1)
        if self._rt is None and new:
            broadcast_params(self.comm, new)
        first = self._table.append(new, shapes,
                                   frozen=[p for p in group["params"] if not p.requires_grad])
        self._edits.grow(len(self._table.params))
        interop.register_params(new, self)
        self._watch_grads(new, first)
        if self._rt is not None:
            self._rt.hook_params(new)
        self._slot.relayout(self.param_groups, first)

    # -- optimizer state --------------------------------------------------------------------
    def shards(self, model: torch.nn.Module | None = None, *,
               ready_order: list[int] | None = None) -> list[ParamShard]:
        """Per managed parameter: its full shape, step count, and the element ranges this rank
        holds with writable fp32 views of their values, exp_avg and exp_avg_sq.

        Names come from ``model`` (its ``named_parameters``) when given, else from named
        param groups (``ZeroAdamW(model.named_parameters())``) or the shard_model'ed model.
        Before the first step() of stages 0-2 this fixes the bucket layout (in
        ``ready_order``, indices of managed_params, default reverse registration order),
        as loading a state does."""
        return self._access.shards(self.param_groups, model, ready_order)

    @contextmanager
    def edit_shards(self, model: torch.nn.Module | None = None, *, gather: bool = True,
                    ready_order: list[int] | None = None) -> Iterator[list[ParamShard]]:
        """Write this rank's optimizer state: yields shards(); write into their views and
        assign their ``step``. On leaving, the steps are taken and the parameters take the
        new values (16-bit: rounded to nearest even). Call on every rank: with ``gather``
        (stages 1-2) the new parameters are all-gathered, a collective; ``gather=False``
        means the caller writes every rank's full parameters itself. If the block raises,
        the steps and parameters are left as they were (the views may be written)."""
        with self._access.edit(self.param_groups, model, gather, ready_order) as shards:
            yield shards

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state (flat buffers in its local layout; a
        compressed state's buffers as stored, with its format and seed). Before the first
        step() nothing has been laid out or trained: as torch's AdamW, the state is empty
        ({}), and asking fixes nothing."""
        return self._access.state_dict(self.param_groups, self.scaler)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """This rank's own ``state_dict()``, or a full torch.optim.AdamW-format state dict
        (every rank passes the same one: from full_state_dict, any world size or stage, or a
        single-process AdamW run; 16-bit parameters then take their fp32 master from the
        current parameters). A per-rank state dict loads only into the moments/master format
        that saved it (refused otherwise); a torch-format one is stored in this optimizer's
        format (int8: quantized on load), which is how a state changes format."""
        if is_torch_format(state_dict):
            self._interchange.load(state_dict, self.param_groups)
        else:
            self._access.load(state_dict, self.param_groups, self.scaler)

    def full_state_dict(self, *, rank0_only: bool = True,
                        cpu_offload: bool = True) -> dict[str, Any]:
        """This optimizer's whole state in torch.optim.AdamW's format, on rank 0 (other ranks
        get ``{}``) or, with ``rank0_only=False``, on every rank; tensors on the CPU with
        ``cpu_offload``. A collective: call it on every rank. The moments are fp32 whatever
        the parameters' dtype (what AdamW holds for fp32 parameters; the fp32 master of
        16-bit parameters is not part of torch's format); compressed moments are dequantized
        and a top-level ``"state_format"`` entry names the format. For interchange and small
        models; at scale use save_checkpoint, where each rank writes its own part."""
        return self._interchange.save(self.param_groups, rank0_only=rank0_only,
                                      cpu_offload=cpu_offload)

    # -- introspection ----------------------------------------------------------------------
    def comm_stats(self) -> dict[str, Any]:
        """Collectives of the last completed step, counted as the paper counts (§7): every
        mesh dim together, and under ``per_dim`` the ``"shard"`` dim's (the whole group when
        flat) and the ``"replicate"`` dim's (zero when flat), each with ``elements``,
        ``bytes``, ``wire_elements`` (what each rank sends under bandwidth-optimal
        algorithms, (n-1)/n of the paper's count) and ``per_kind``: what
        ``zerokern.formulas.hybrid_comm_elements`` / ``hybrid_wire_elements`` /
        ``hybrid_comm_bytes`` give."""
        return comm_summary(self._last_comm, sum(sh.numel() for sh in self._table.shapes))

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds for model states, by kind, from the arenas' accounting.
        Padding (bucket/shard rounding, and in stage 3 the optimizer slots of frozen
        parameters) is reported on its own. Before the first step() of stages 0-2 nothing
        is allocated yet: the numbers are those of the buffers the first step will allocate
        (laid out in reverse registration order), and nothing is fixed by asking.

        ``total`` (= ``device_total``) is what the device holds; ``host_total`` what host
        memory holds (0 without offload). With ``offload="cpu"`` the device kinds are the
        16-bit parameters and the gradient buffers (``master``, ``exp_avg``, ``exp_avg_sq``
        are 0), and the ``host_*`` keys give the host side: master and moments (KΨ/N), the
        gradient shard, the two staging slots, padding.

        Each kind is the bytes of the buffers as stored, so K follows the state format: 12
        for fp32 moments with an fp32 master, about 6 for ``moments="int8"`` and 2 with
        ``master="none"`` too. ``exp_avg_absmax`` / ``exp_avg_sq_absmax`` are the int8
        blocks' scales and ``exp_avg_side`` / ``exp_avg_sq_side`` the fp32 moments of
        parameters too small to compress (docs/compressed-state.md)."""
        return self._slot.memory_stats()


def _delivered(ref: weakref.ref, index: int, _p: torch.Tensor) -> None:
    """Post-accumulate-grad hook of every trained parameter (stages 0-2)."""
    opt = ref()
    if opt is not None:
        opt._on_grad(index)


def _end_backward(ref: weakref.ref) -> None:
    """Stage 3: the shard_model runtime's end of a synchronised backward."""
    opt = ref()
    if opt is not None:
        opt._install_guards()


def _begin_backward(ref: weakref.ref) -> None:
    """Stage 3: the shard_model runtime's start of a backward."""
    opt = ref()
    if opt is not None:
        opt._guards.settle_stale()


def _edited(ref: weakref.ref, edits: dict[int, torch.Tensor | None]) -> None:
    """GuardSet: gradients replaced by the script since the backward."""
    opt = ref()
    if opt is not None:
        opt._take_edits(edits)


def _stale(ref: weakref.ref, carried: list[int], cleared: list[int],
           zeroed: list[int]) -> None:
    """GuardSet: what became of the last step's gradients (stages 1-3) by the next backward."""
    opt = ref()
    if opt is not None:
        if carried:
            opt._reduction.carried = True
        opt._edits.stale_settled(cleared, zeroed)
