"""The training loop of a ZeRO optimizer (``TrainingLoop``, a part of ``ZeroOptimizer``):
``no_sync``, ``scale_loss``, ``zero_grad``, ``step`` and ``clip_grad_norm_``, and the sequence
of a step: ``step()`` and ``_reduce_grads_now()``, readable in one place (the parts they call
are core.py's)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .param_groups import check_groups
from .reduction import Reduced, grad_scale
from .stage3.owners import is_superseded, superseded_error
from .validate import finite_ge0


class TrainingLoop:
    """The training-loop methods (mixed into ``ZeroOptimizer`` before ``ZeroCore``)."""

    _table: Any
    _slot: Any
    _guards: Any
    _edits: Any
    _reduction: Any
    _rule_state: Any
    _rt: Any
    _access: Any
    param_groups: list[dict[str, Any]]

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
        if is_superseded(self):
            return  # a newer optimizer trains all of its parameters: their gradients are its
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
        """One step of the optimizer over this rank's shard, then the parameters gathered
        where the stage keeps them whole. Finishes the gradient reduction, runs the one
        norm-and-flags
        all-reduce (clipping, the fp16 overflow skip), updates, and returns ``closure()``'s
        loss as torch's does. A collective: call it on every rank."""
        if is_superseded(self):  # stages 0-2 (at stage 3 the step pre-hook refuses first)
            raise superseded_error(self)
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
        runs, groups = self._rule_state.runs(self._table, self.layout, red.active,
                                             self.param_groups)
        self._rule_state.update(self._slot.engine, runs, groups, scale, red.active)
        self._rule_state.advance(red.active, self._table.steps, self._group_of(),
                                 self.param_groups, self.device)
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
            raise ValueError(f"norm_type: {type(self).__name__} clips by the 2-norm only, got "
                             f"{norm_type!r}")
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
    def _group_of(self) -> list[int]:
        """Each managed parameter's param group."""
        return [gi for gi, n in enumerate(self._table.group_counts()) for _ in range(n)]

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
            # The groups again: one may have changed since clip_grad_norm_ (or a p.grad norm)
            # reduced them, and the kernels take the values as given (engine_step_).
            check_groups(self.param_groups, flags=True, moments=self.state_format.moments,
                         rule=self.rule)
            red = self._reduction.reuse(events, need_norm, self.loss_scale)
        else:
            self._reduction.check_backward_since_step(events)
            # Nothing below changes anything until every group and parameter is checked.
            check_groups(self.param_groups, flags=True, moments=self.state_format.moments,
                         rule=self.rule)
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
        self._slot.mark_params(wrote=True)
        self._access.view.refresh_steps()  # opt.state[p]["step"] counts, as torch's does
        self._reduction.finish()
        self._last_comm = self.comm.reset_stats()

