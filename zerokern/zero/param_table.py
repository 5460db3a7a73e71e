"""The parameters a ZeroAdamW trains: which they are, in what order, their full shapes and
step counts.

A parameter is trained when it requires grad at construction (or when ``add_param_group``
adds it); its position in ``params`` (param-group order) is its index everywhere: in the
layout, the gradient flags, ``shards()``, the state dicts. The table also remembers the
parameters that were frozen at that time (training them later is refused: no state was
planned for them) and each trained parameter's step count (torch's AdamW keeps one per
parameter), and cuts the local space into the ranges one fused update can cover.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import Comm
from .layout import Layout
from .registry import runtime_of_param
from .stages import Run
from .validate import check_no_duplicates


def trained_params(param_groups: list[dict[str, Any]],
                   ) -> tuple[list[list[torch.nn.Parameter]], list[torch.nn.Parameter]]:
    """The parameters to train, per group (those that require grad), and the frozen ones;
    refuses a parameter listed twice and a list with nothing to train."""
    for gi, g in enumerate(param_groups):
        check_no_duplicates(g["params"], gi)
    managed = [[p for p in g["params"] if p.requires_grad] for g in param_groups]
    params = [p for ps in managed for p in ps]
    if not params:
        raise ValueError("params: no parameter requires grad; nothing to optimize")
    if not any(p.numel() for p in params) and runtime_of_param(params[0]) is None:
        raise ValueError("params: every trainable parameter has 0 elements; nothing to "
                         "optimize")
    frozen = [p for g in param_groups for p in g["params"] if not p.requires_grad]
    return managed, frozen


def stage3_runtime(params: list[torch.nn.Parameter], stage: int) -> Any:
    """The shard_model runtime the parameters belong to (stage 3), or None (stages 0-2)."""
    rts = {id(rt): rt for rt in map(runtime_of_param, params)}
    if stage != 3:
        if any(rt is not None for rt in rts.values()):
            raise ValueError(f"params belong to a model partitioned by shard_model: use "
                             f"stage=3 (got stage={stage})")
        return None
    firsts = {id(rt.siblings[0]): rt.siblings[0] for rt in rts.values() if rt is not None}
    if None in rts.values() or len(firsts) != 1:
        raise ValueError("stage=3 needs the parameters of one model partitioned by "
                         "zerokern.shard_model(model) first")
    # A model of several dtypes has one runtime per dtype (siblings): its first stands for
    # them until the optimizer splits into parts, each on its own dtype's (mixed_plan.py).
    return next(iter(rts.values())) if len(rts) == 1 else next(iter(firsts.values()))


def broadcast_params(comm: Comm, params: list[torch.nn.Parameter]) -> None:
    """Every rank starts from rank 0's values (stages 0-2; shard_model does it at stage 3);
    on a 2-D mesh, global rank 0's (within the shard group, then across replicas)."""
    if comm.dp_size == 1:
        return
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        comm.broadcast_all(flat, "initial parameters")
        off = 0
        for p in params:
            p.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()


class ParamTable:
    """The trained parameters and what is kept per parameter.

    Attributes:
        params: the trained parameters in param-group order. One list for the optimizer's
            life, extended in place by ``append`` (the gradient hooks and the guards index
            into it).
        shapes: each one's full shape (stage 3: not the released placeholder's).
        index: ``id(p)`` -> position in ``params``.
        group_sizes: per param group, the element count of each trained parameter.
        frozen: parameters of the groups that did not require grad when they were added.
        steps: each parameter's step count (torch: ``state[p]["step"]``).
    """

    def __init__(self, managed: list[list[torch.nn.Parameter]],
                 frozen: list[torch.nn.Parameter], runtime: Any = None) -> None:
        self._rt = runtime
        self.params: list[torch.nn.Parameter] = [p for ps in managed for p in ps]
        self.shapes: list[torch.Size] = [self._shape_of(p) for p in self.params]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.group_sizes = [[self.shapes[self.index[id(p)]].numel() for p in ps]
                            for ps in managed]
        self.frozen = list(frozen)
        self.steps = [0] * len(self.params)

    def _shape_of(self, p: torch.nn.Parameter) -> torch.Size:
        return self._rt.shape_of(p) if self._rt is not None else p.shape

    def shapes_of(self, params: list[torch.nn.Parameter]) -> list[torch.Size]:
        """Full shapes of parameters about to be added."""
        return [self._shape_of(p) for p in params]

    def group_counts(self) -> list[int]:
        """Trained parameters per param group."""
        return [len(g) for g in self.group_sizes]

    def append(self, new: list[torch.nn.Parameter], shapes: list[torch.Size],
               frozen: list[torch.nn.Parameter]) -> int:
        """A param group added after construction (checked already): its trained parameters
        come last, with step 0. Returns the index of the first one."""
        first = len(self.params)
        self.params += new  # in place: the same list for the hooks and guards
        self.shapes += shapes
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.group_sizes.append([sh.numel() for sh in shapes])
        self.steps += [0] * len(new)
        self.frozen += frozen
        return first

    def check_frozen(self) -> None:
        """Frozen at construction, trainable now: refused (its state was never planned)."""
        for p in self.frozen:
            if p.requires_grad:
                raise RuntimeError(
                    f"ZeroAdamW: a parameter of shape {tuple(p.shape)} had requires_grad=False "
                    "when ZeroAdamW was built and requires grad now; its optimizer state was "
                    "never planned, so it would not be trained. Set requires_grad before "
                    "building ZeroAdamW")

    def runs(self, layout: Layout, active: list[bool]) -> list[Run]:
        """``keyed_runs`` without keys."""
        return [r for r, _ in self.keyed_runs(layout, active)]

    def keyed_runs(self, layout: Layout, active: list[bool],
                   key: Any = None) -> list[tuple[Run, Any]]:
        """Ranges of this rank's local space for the fused kernel.

        Consecutive pieces of this rank's local space merge into one range (the gaps between
        them are padding), normally one per param group; a range is cut only around
        parameters that got no gradient on any rank, parameters with another step count
        (torch's AdamW keeps a step per parameter), parameters whose ``key(index)`` differs
        (the per-parameter scalars of a rule: rule_state.py) and, in stage 3, frozen
        parameters."""
        runs: list[list[Any]] = []
        cur: list[Any] | None = None
        for pc in layout.pieces:
            if pc.param < 0 or not active[pc.param]:
                cur = None
                continue
            st = self.steps[pc.param] + 1
            k = None if key is None else key(pc.param)
            if cur is not None and cur[0] == pc.group and cur[3] == st and cur[4] == k:
                cur[2] = pc.local_start + pc.numel
            else:
                cur = [pc.group, pc.local_start, pc.local_start + pc.numel, st, k]
                runs.append(cur)
        return [(Run(g, lo, hi, st), k) for g, lo, hi, st, k in runs]

    def advance(self, active: list[bool]) -> None:
        """One step taken by every parameter that got a gradient on some rank."""
        for i, a in enumerate(active):
            if a:
                self.steps[i] += 1
