"""The step's gradient reduction: once per step, after the engine finished reducing the
gradients, one small all-reduce carries a flag per parameter (did it get a gradient on some
rank: the others are left untouched, as AdamW leaves them) and this rank's part of every
parameter's squared gradient norm, and with it the total norm. ``clip_grad_norm_``, the
norms torch's utilities read through ``p.grad`` and ``step()`` share that one reduction; its
record (``Reduced``) keeps the clipping coefficient they asked for until the step ends.

On a 2-D mesh (hybrid sharding) the vector is all-reduced within the shard group, then across
the replicate group with the norm parts of every replica but the first zeroed: the same norm
and flags, bit for bit, on every rank of the mesh.

The gradients the script set or dropped by hand after backward (grad_edits.py) join the
reduction here: the set ones are added to the averaged gradient before the norms are taken,
and how many ranks made each edit rides in the same all-reduce, so that every rank refuses
alike when they disagree; gradients every rank set are then checked for equal values (a
fingerprint each, in one more small all-reduce made only in such a step).

This part also keeps the bookkeeping that tells one step's gradients from the next: the
gradient events of the backward, those seen when the last step ended (a step with no
backward since is refused; no ``zero_grad()`` since is refused or warned by stage).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..comm import Comm
from ..comm.mesh import MeshInfo
from .grad_edits import GradEdits
from .layout import Layout
from .stages import Engine


@dataclass
class Reduced:
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

    def clip_to(self, max_norm: float) -> None:
        """clip_grad_norm_(max_norm): scale so that the clipped norm is at most max_norm."""
        self.clip *= min(1.0, max_norm / (self.norm * self.clip + 1e-6))


def grad_scale(red: Reduced, coef: float, max_grad_norm: float | None,
               loss_scale: float) -> float:
    """What the fused step divides the gradients by: the loss scale over the clipping
    coefficient (clip_grad_norm_'s, times the factor torch's utilities applied through
    p.grad, times ZeroAdamW(max_grad_norm=)'s)."""
    clip = red.clip * coef
    if max_grad_norm is not None:
        clip *= min(1.0, max_grad_norm / (red.norm * clip + 1e-6))
    # An infinite norm (no loss scaler to skip the step) clips by 0, as torch's
    # clip_grad_norm_ does: finite gradients become 0, infinite ones NaN.
    return (loss_scale / clip if clip > 0
            else math.nan if math.isnan(clip) else math.inf)


class GradReduction:
    """This step's reduction (``current``, None until done) and the bookkeeping between
    steps. ``runtime``: stage 3's shard_model runtime, which counts its own gradient events
    (stages 0-2: the optimizer's hooks call ``count_event``)."""

    def __init__(self, comm: Comm, runtime: Any = None) -> None:
        self.comm, self.rt = comm, runtime
        self.mesh = MeshInfo.of(comm)  # a 2-D mesh: the replicate group joins the sums
        self.current: Reduced | None = None
        self._events = 0  # gradients delivered by autograd hooks (stages 0-2)
        self._stepped_events: int | None = None  # events() when the last step ended
        self._warned_carry = False
        # Stages 2-3: a gradient of the last step was still on p.grad when the next backward
        # started (no zero_grad of any kind since): torch would have added to it.
        self.carried = False
        self._sq_views: tuple[Any, list[torch.Tensor], torch.Tensor] | None = None

    # -- gradient events --------------------------------------------------------------------
    def count_event(self) -> None:
        self._events += 1

    def events(self) -> int:
        return self.rt.grad_events if self.rt is not None else self._events

    def finish(self) -> None:
        """The step is over: its reduction is spent."""
        self.current = None
        self._stepped_events = self.events()
        self.carried = False

    def forget(self) -> None:
        """zero_grad(): this step's gradients (and any reduction of them) are dropped."""
        self.current = None
        self._stepped_events = None
        self.carried = False

    def check_backward_since_step(self, events: int) -> None:
        if self._stepped_events is not None and events == self._stepped_events:
            raise RuntimeError(
                "ZeroAdamW: step() again with no backward since the last step(). torch's "
                "AdamW would step again with the same gradients; ZeroAdamW has used them up. "
                "Run backward() before every step() (call opt.zero_grad() first if a step "
                "without gradients is what you mean: it then updates nothing, as in torch)")

    def check_not_carried(self, events: int, stage: int, engine: Engine) -> None:
        """No zero_grad() since the last step: torch's AdamW would add this step's gradients
        to the last step's. Stage 0 does the same (the bucket views keep them); stage 1
        cannot (the last step's sums were averaged in place), so it refuses; stages 2-3 keep
        no gradient between steps, so they warn once when a gradient of the last step was
        still on a parameter (its stale guard) as the next backward began (``carried``)."""
        if self._stepped_events is None or events == self._stepped_events:
            return
        if stage == 1 and engine.reducer.carried:
            raise RuntimeError(
                "ZeroAdamW(stage=1): no zero_grad() since the last step(), so torch's AdamW "
                "would accumulate gradients across steps, which stage 1 cannot do. Call "
                "opt.zero_grad() after every step() (use opt.no_sync() to accumulate "
                "micro-batches within a step)")
        if stage in (2, 3) and self.carried and not self._warned_carry:
            self._warned_carry = True
            warnings.warn(
                "ZeroAdamW: step() with no opt.zero_grad() since the last step(): the last "
                "step's gradients were still on p.grad when the next backward began. At "
                "stages 2-3 gradients are not carried from one step to the next (torch's "
                "AdamW would add them to the new ones). Call opt.zero_grad() (or "
                "model.zero_grad()) after every step()", stacklevel=3)

    # -- the reduction ----------------------------------------------------------------------
    def reuse(self, events: int, need_norm: bool, loss_scale: float) -> Reduced:
        """``current`` again (clip_grad_norm_, a p.grad norm and step() share it), with its
        norm when ``need_norm``; refused when gradients came after it."""
        red = self.current
        assert red is not None
        if red.events != events:
            raise RuntimeError(
                "ZeroAdamW: gradients were produced after clip_grad_norm_() in this step; "
                "call it after the last backward, right before step()")
        if need_norm and not red.has_norm and red.param_sq is not None:
            # Reduced without a norm (p.grad read first): the per-parameter squares that
            # came with the reduction give it.
            red.sq_norm = math.fsum(red.param_sq)
            red.norm = math.sqrt(red.sq_norm) / loss_scale
            red.has_norm = True
        if need_norm and not red.has_norm:
            raise RuntimeError("ZeroAdamW: clip_grad_norm_() after the gradients were "
                               "reduced without a norm; call it right before step()")
        red.clip_before = red.clip
        return red

    def reduce(self, engine: Engine, *, events: int, need_norm: bool, loss_scale: float,
               device: torch.device, partials: Callable[[], torch.Tensor],
               edits: GradEdits | None = None, layout: Layout | None = None,
               label: Callable[[int], str] = str) -> Reduced:
        """Finish the engine's reduction and run the one small all-reduce (and host sync) of
        the step. ``partials()``: this rank's part of every parameter's squared norm.
        ``edits``: this step's gradients set or dropped by hand (grad_edits.py; every rank
        passes them or none does), added to ``layout``'s averaged gradient, their counts
        checked; ``label(i)`` names parameter i in the refusal."""
        got = engine.finish_grads()
        codes: list[float] = []
        if edits is not None:
            assert layout is not None
            edits.add_values(engine, layout)  # before the norms: they are the step's
            got = edits.flags(got)
            codes = edits.counts()
        flags = torch.tensor([float(x) for x in got] + codes, dtype=torch.float32)
        n = len(got)
        # Each parameter's squared norm rides along in the same all-reduce, for torch's
        # utilities reading p.grad (grad_guard.py): a rank that reads p.grad.norm() alone
        # (logging on rank 0) then joins the collective every rank makes at step(). Always
        # (one multi-tensor norm pass over the local shard), so that the all-reduce has the
        # same size on every rank whatever each one did. Stage 0 holds the averaged
        # gradients: computed there when asked, without a collective.
        extra = not engine.replicated_grads
        # [total, flags and edit counts (n + len(codes)), squares (n, when extra)]
        sq = 1 + n + len(codes)
        vec = torch.cat([torch.zeros(1), flags] + ([torch.zeros(n)] if extra else []))
        vec = vec.to(device)
        if extra:
            vec[sq:] = partials()
            if need_norm:  # the same pass gives the total: no second read of the shard
                vec[0] = vec[sq:].sum()
        self.comm.all_reduce(vec, "grad norm and grad flags", count=False)
        if self.mesh.replicate is not None:
            # A 2-D mesh: the shards are the same on every replica (their gradients were
            # all-reduced across it), so the norm is the shard group's sum, taken from the
            # first replica exactly (the others add zeros); the flags are summed over the
            # whole mesh, so every rank of the world skips or updates the same parameters.
            if self.mesh.replicate.rank != 0:
                vec[0] = 0.0
                if extra:
                    vec[sq:] = 0.0
            self.mesh.replicate.all_reduce(vec, "grad norm and grad flags", count=False)
        if need_norm and engine.replicated_grads:  # every rank holds the full averaged grad
            vec[0] = engine.grad_sq_norm()
        vals = vec.tolist()
        if edits is not None:  # the same sums on every rank: all refuse, or none
            edits.check_agreed(vals[1 + n:sq], self.mesh.dp_size, label)
            self._check_set_values(edits, vals[1 + n:sq], device, label)
        red = Reduced(events=events, sq_norm=vals[0], active=[v > 0 for v in vals[1:n + 1]],
                      has_norm=need_norm)
        if extra:
            red.param_sq = vals[sq:]
        red.norm = math.sqrt(vals[0]) / loss_scale if need_norm else 0.0
        self.current = red
        return red

    def _check_set_values(self, edits: GradEdits, sums: list[float], device: torch.device,
                          label: Callable[[int], str]) -> None:
        """Gradients every rank set by hand must hold the same values: the largest of each
        one's fingerprint and of its negation over every rank (one int64 MAX all-reduce, on
        a mesh then across the replicas) are each other's negation only when all ranks agree.
        Made only when some gradient was set, which every rank knows from ``sums``."""
        indices = edits.set_indices(sums)
        if not indices:
            return
        fps = edits.fingerprints(indices)
        vec = torch.tensor(fps + [-f for f in fps], dtype=torch.int64, device=device)
        self.comm.all_reduce(vec, "hand-set gradient fingerprints", count=False,
                             op=dist.ReduceOp.MAX)
        if self.mesh.replicate is not None:
            self.mesh.replicate.all_reduce(vec, "hand-set gradient fingerprints", count=False,
                                           op=dist.ReduceOp.MAX)
        got = vec.tolist()
        k = len(indices)
        edits.check_values(indices, got[:k], [-v for v in got[k:]], label)

    def sq_partials(self, engine: Engine, layout: Layout, n_params: int,
                    device: torch.device) -> torch.Tensor:
        """This rank's part of every parameter's squared gradient norm (fp32, one entry per
        trained parameter), from its pieces of the local space; a fused multi-tensor norm
        on CUDA."""
        if self._sq_views is None or self._sq_views[0] is not engine:  # once per layout
            views, owner = [], []
            for pc in layout.pieces:
                if pc.param >= 0 and pc.numel:
                    for t in engine.grad_slices(pc.local_start, pc.numel):
                        views.append(t)
                        owner.append(pc.param)
            self._sq_views = (engine, views, torch.tensor(owner, device=device))
        _, views, owner_t = self._sq_views
        out = torch.zeros(n_params, dtype=torch.float32, device=device)
        if views:
            norms = torch.stack(torch._foreach_norm(views, 2, dtype=torch.float32))
            out.index_add_(0, owner_t, norms.to(device).square())
        return out
