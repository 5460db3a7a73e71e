"""The construction of a ZeRO optimizer and the parts it holds (``ZeroCore``, the base of
``ZeroOptimizer`` and ``ZeroAdamW``), one file each:

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
- ``_interchange`` (interchange.py): the state in the torch optimizer class's format;
- ``_rule_state`` (rule_state.py): the update rule's per-parameter scalars and the runs the
  rule steps.

This file holds the construction sequence (every check, then the one agreement across ranks,
then the parts), what the parts hold read as attributes, the gradient hooks, and
``add_param_group``. The step's sequence is training.py's, the state's surface state_api.py's.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..comm.mesh import check_same_mesh
from . import interop
from .agreement import agree_at_construction
from .config import ZeroConfig
from .engine_slot import EngineSlot
from .grad_edits import GradEdits, late_edit_error, param_label
from .guard_set import GuardSet
from .interchange import TorchFormat, strip_adamw_flags
from .layout import Layout
from .mixed import build_parts
from .mixed_plan import Part, plan_parts
from .optimizer_state import StateAccess, set_seed
from .param_groups import check_groups, check_new_group
from .param_table import ParamTable, broadcast_params, stage3_runtime, trained_params
from .reduction import GradReduction
from .rule_state import make_rule_state
from .rules import TorchClassRule, UpdateRule
from .scaler import LossScaler
from .stage3 import owners
from .stages import Engine
from .state_format import StateFormat
from .validate import (
    check_gather_dtype_params,
    check_int8_format_backend,
    check_master_dtype,
    check_offload_params,
    check_seed,
    common_dtype_device,
)

Resolve = Callable[[ZeroConfig], tuple[UpdateRule, dict[str, Any]]]
"""Given the validated options: the update rule and the param groups' defaults (raising,
naming it, what the optimizer class or its hyperparameters refuse)."""


class ZeroCore(torch.optim.Optimizer):
    """The parts every ZeRO optimizer of zerokern holds, built by ``_construct``."""

    def _construct(self, params: Any, resolve: Resolve, options: dict[str, Any],
                   config: ZeroConfig | None, *, mesh: Any, process_group: Any,
                   optimizer: str) -> None:
        """Build the optimizer: ``options`` are the ZeroConfig keywords of the call,
        ``optimizer`` names the torch class for the agreement across ranks."""
        where = type(self).__name__
        # Every check runs first, then one gather compares the options across ranks and
        # carries any rank's refusal to every rank (agreement.py); nothing is modified and
        # no other collective runs before it.
        cfg: ZeroConfig | None = None
        rt: Any = None
        replaced: list[Any] = []
        table: ParamTable | None = None
        rule: UpdateRule | None = None
        failure: BaseException | None = None
        parts: list[Part] | None = None
        try:
            cfg = ZeroConfig.merge(config, options, where).validate()
            rule, defaults = resolve(cfg)
            self.rule = rule  # the update the state is stepped with (zero/rules/)
            super().__init__(params, defaults)
            if isinstance(rule, TorchClassRule):  # the buffers it keeps, from its groups
                rule.declare(self.param_groups)
            check_groups(self.param_groups, flags=False, moments=cfg.state_format.moments,
                         rule=rule)
            managed, frozen = trained_params(self.param_groups)
            # A model wrapped in DDP first (DDP's constructor refuses the other order).
            interop.check_no_ddp([p for g in self.param_groups for p in g["params"]], where)
            rt = stage3_runtime([p for ps in managed for p in ps], cfg.stage)
            check_offload_params(rt, cfg.offload)
            if rt is not None:
                check_same_mesh(mesh, rt.comm)
                if cfg.hpz and rt.comm.secondary is None:
                    raise ValueError("hpz=True: the model was sharded without it; hpZ is the "
                                     "model's layout: pass hpz=True to shard_model (or "
                                     "parallelize)")
            # Several dtypes (or groups with their own master): one part per partition (each
            # part, an optimizer of its own, runs the checks below when it is built).
            parts = plan_parts(self.param_groups, cfg, rt)
            if parts is None:
                table = ParamTable(managed, frozen, rt)
                # A parameter another live optimizer trains is refused (several optimizers
                # take disjoint parameters), unless this one replaces it whole (a second
                # fit, a resume, a re-run cell while the old object still lives).
                replaced = owners.check_disjoint(table.params, rt, where)
                if rt is not None:
                    owners.check_offload_alone(rt, cfg.offload, replaced)
                dtype, device = common_dtype_device(table.params)  # meta parameters refused
                check_master_dtype(cfg.state_format, dtype)
                check_int8_format_backend(cfg.state_format, cfg.backend, device, cfg.offload)
                check_gather_dtype_params(cfg.wire.gather_bits, cfg.stage, dtype)
        except (ValueError, TypeError, RuntimeError) as exc:
            failure = exc
        if failure is None and parts is not None:
            # Each part agrees across ranks as a whole optimizer does (a rank refused above
            # meets the first part's agreement and every rank raises there).
            assert cfg is not None
            build_parts(self, parts, resolve, cfg, mesh=mesh, process_group=process_group,
                        optimizer=optimizer)
            return
        # The optimizer class is compared with the options: ranks given different classes
        # would lay out different buffers.
        self._agreed = None if cfg is None else {**cfg.agreed(), "optimizer": optimizer}
        self.comm = agree_at_construction(
            self._agreed, failure, runtime=rt, mesh=mesh, process_group=process_group,
            param_groups=getattr(self, "param_groups", []), table=table, where=where,
            rule=rule)
        assert cfg is not None and table is not None and rule is not None  # else agree raised
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
            wire = cfg.wire
            if wire.gather_bits is None and rt.gather_bits is not None:
                # shard_model(gather_dtype=): the model's gathers stay quantized.
                wire = dataclasses.replace(wire, gather_bits=rt.gather_bits)
            rt.set_comm(cfg.reduce_dtype if isinstance(cfg.reduce_dtype, torch.dtype)
                        else dtype, wire)
        self._slot = EngineSlot(table, self.comm, stage=cfg.stage, offload=cfg.offload,
                                runtime=rt, bucket_numel=cfg.bucket_numel,
                                overlap=cfg.overlap_comm, backend=cfg.backend, dtype=dtype,
                                device=device, fmt=cfg.state_format, seed=int(cfg.seed),
                                reduce_dtype=cfg.reduce_dtype, rule=rule, wire=cfg.wire)
        self._rule_state = make_rule_state(rule, len(params), self.comm, table)
        self._reduction = GradReduction(self.comm, self._rt)
        self._edits = GradEdits(len(params))
        me = weakref.ref(self)
        self._guards = GuardSet(params, self._guard_measure,
                                edited=functools.partial(_edited, me),
                                stale=functools.partial(_stale, me))
        self._access = StateAccess(table, self._slot, self.comm, stage=cfg.stage,
                                   runtime=rt, shards=self.shards)
        self._interchange = TorchFormat(table, self._access, self.comm, cfg.stage,
                                        self._rule_state)
        self._grad_hooks: list[Any] = []
        for old in replaced:
            if old._rt is None:  # stage 3: the runtime's callbacks skip a superseded one
                old._retire()
        interop.register_params(params, self)
        owners.supersede(replaced, self)
        self._watch_grads(params, 0)
        if self._rt is not None:
            # Stage 3: gradients of the model's parameters outside this optimizer stay on
            # their .grad (plain leaves, as in torch) instead of being reduced and dropped.
            self._rt.hook_params(params)
            self._slot.build(self.param_groups)  # stage 3: the units fix the layout already
            self._rt.backward_end_callbacks.append(
                functools.partial(_end_backward, weakref.ref(self)))
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
        """How the state is stored: ``moments``, ``master`` and ``int8_format`` as given at
        construction."""
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

    def _retire(self) -> None:
        """Stages 0-2, superseded by a newer optimizer over all of its parameters: as if it
        had been dropped, its hooks come off (the gradients are the new one's to reduce) and so
        do its guards (a gradient one stood for is gone, as a dropped optimizer's)."""
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks = []
        self._guards.retire()
        self._retired = True  # for good (owners.is_superseded)

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

    # -- param groups -----------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's: the new group's parameters are trained from the next step() on.

        After construction this re-plans the layout with the new group appended (the
        existing groups keep their place, so their state is copied over unchanged) and is a
        collective: call it on every rank with the same group. Not between a backward and its
        step() (the pending gradients would be lost): that is refused."""
        # torch.optim.AdamW's own flags (a group written for it, e.g. {"fused": True}):
        # checked, and not kept, before anything changes (a torch class's groups keep them).
        if isinstance(param_group, dict) and not self._torch_class_rule():
            param_group = strip_adamw_flags(
                param_group, f" (param group {len(self.param_groups)})", self.defaults)
        if not getattr(self, "_constructed", False):
            super().add_param_group(param_group)  # the constructor's groups
            return
        if owners.is_superseded(self):  # its parameters are the newer optimizer's
            raise owners.superseded_error(self, "add_param_group")
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

    def _torch_class_rule(self) -> bool:
        return isinstance(getattr(self, "rule", None), TorchClassRule)

    def _adopt_group(self, group: dict[str, Any]) -> None:
        new, shapes = check_new_group(group, self._table, self._rt, self.comm,
                                      moments=self.state_format.moments,
                                      options=self._agreed, param_groups=self.param_groups,
                                      gi=len(self.param_groups) - 1, rule=self.rule)
        if self._rt is None and new:
            broadcast_params(self.comm, new)
        if self._rt is not None:
            owners.check_disjoint(new, self._rt, "param group", replace=False, me=self)
        first = self._table.append(new, shapes,
                                   frozen=[p for p in group["params"] if not p.requires_grad])
        self._edits.grow(len(self._table.params))
        self._rule_state.grow(len(self._table.params))
        interop.register_params(new, self)
        self._watch_grads(new, first)
        if self._rt is not None:
            self._rt.hook_params(new)
        self._slot.relayout(self.param_groups, first)


def _delivered(ref: weakref.ref, index: int, _p: torch.Tensor) -> None:
    """Post-accumulate-grad hook of every trained parameter (stages 0-2)."""
    opt = ref()
    if opt is not None:
        opt._on_grad(index)


def _end_backward(ref: weakref.ref) -> None:
    """Stage 3: the shard_model runtime's end of a synchronised backward."""
    opt = ref()
    if opt is not None and not owners.is_superseded(opt):
        opt._install_guards()


def _begin_backward(ref: weakref.ref) -> None:
    """Stage 3: the shard_model runtime's start of a backward."""
    opt = ref()
    if opt is not None and not owners.is_superseded(opt):
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
