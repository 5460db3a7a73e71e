"""The update rule's state that is not per element: the per-parameter scalars a torch class
keeps besides its step count (NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``), and the
runs a step hands the rule so that every range it steps sees its parameters' own scalars.

torch keeps such a scalar per parameter; so does this table (``scalars[i]``, replicated on
every rank: each rank advances every stepped parameter's, so nothing is communicated). Runs
are cut where the scalars differ (param_table.keyed_runs) and each run gets a copy of its
group carrying its scalars; after the update each stepped parameter's scalars advance once,
by the class itself (``TorchClassRule.advance``), however many ranges or ranks its elements
were stepped in. For AdamW's fused rule and every rule without scalars this is a no-op: the
runs and groups are those of before.
"""

from __future__ import annotations

from typing import Any

import torch

from .layout import Layout
from .param_table import ParamTable
from .rules import TorchClassRule, UpdateRule
from .rules.torch_class import SCALARS
from .stages import Run


def scalar_key(scalars: dict[str, Any]) -> tuple[Any, ...]:
    """The scalars as a value runs are cut by."""
    return tuple((k, float(v) if v is not None else None) for k, v in sorted(scalars.items()))


class RuleState:
    """``scalars[i]``: managed parameter ``i``'s scalars by name ({} before its first step,
    and for rules without any)."""

    def __init__(self, rule: UpdateRule, n: int) -> None:
        self.rule = rule
        self.scalars: list[dict[str, Any]] = [{} for _ in range(n)]

    @property
    def names(self) -> tuple[str, ...]:
        return self.rule.scalar_names if isinstance(self.rule, TorchClassRule) else ()

    def grow(self, n: int) -> None:
        """Parameters appended (add_param_group): fresh, no scalars yet."""
        self.scalars += [{} for _ in range(n - len(self.scalars))]

    def reset(self, index: int) -> None:
        self.scalars[index] = {}

    def memory_stats(self, layout: Layout) -> dict[str, int]:
        """Bytes of buffers the rule keeps outside the engine's arena, by kind, for
        ``memory_stats()`` ({}: none; Muon's owner exchange: muon_step.py), with the
        parameters laid out as ``layout`` (the engine's, or the one it will fix)."""
        del layout
        return {}

    def runs(self, table: ParamTable, layout: Layout, active: list[bool],
             param_groups: list[dict[str, Any]]) -> tuple[list[Run], list[dict[str, Any]]]:
        """This step's runs and the groups they index (param_groups itself without scalars;
        else one copy per (group, scalars) carrying them under ``SCALARS``)."""
        if not self.names:
            return table.runs(layout, active), param_groups
        keys = [scalar_key(s) for s in self.scalars]
        keyed = table.keyed_runs(layout, active, key=keys.__getitem__)
        first = {}
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        groups: list[dict[str, Any]] = []
        at: dict[tuple[int, Any], int] = {}
        out = []
        for run, k in keyed:
            gi = at.get((run.group, k))
            if gi is None:
                gi = at[(run.group, k)] = len(groups)
                groups.append({**param_groups[run.group], SCALARS: self.scalars[first[k]]})
            out.append(Run(gi, run.start, run.stop, run.step))
        return out, groups

    def update(self, engine: Any, runs: list[Run], groups: list[dict[str, Any]],
               grad_scale: float, active: list[bool]) -> None:
        """The update of this step: the engine's, range by range (Muon's rule state sends
        its matrices to their owners instead: muon_step.py)."""
        engine.update(runs, groups, grad_scale, active)

    def advance(self, active: list[bool], steps: list[int], group_of: list[int],
                param_groups: list[dict[str, Any]], device: torch.device) -> None:
        """After the update, before the step counts advance: each stepped parameter's
        scalars, advanced by its step (one call per distinct (group, step, scalars))."""
        if not self.names:
            return
        assert isinstance(self.rule, TorchClassRule)
        done: dict[tuple[int, int, Any], dict[str, Any]] = {}
        for i, a in enumerate(active):
            if not a:
                continue
            key = (group_of[i], steps[i], scalar_key(self.scalars[i]))
            new = done.get(key)
            if new is None:
                g = {**param_groups[group_of[i]], SCALARS: self.scalars[i]}
                new = done[key] = self.rule.advance(g, steps[i] + 1, device)
            self.scalars[i] = dict(new)

    # -- in and out of state dicts ---------------------------------------------------------------
    def state_dict(self) -> list[dict[str, float]] | None:
        """Every parameter's scalars as floats (None: the rule keeps none)."""
        if not self.names:
            return None
        return [{k: None if v is None else float(v) for k, v in s.items()}
                for s in self.scalars]

    def load(self, saved: Any, where: str) -> None:
        """``state_dict()``'s list (None or absent: fresh)."""
        if not self.names:
            return
        if saved is None:
            self.scalars = [{} for _ in self.scalars]
            return
        if not isinstance(saved, list) or len(saved) != len(self.scalars):
            raise ValueError(f"{where}: the per-parameter scalars must be a list of "
                             f"{len(self.scalars)} dicts, got {saved!r}")
        self.scalars = [{k: _tensor(v) for k, v in s.items()} for s in saved]


def _tensor(v: Any) -> Any:
    """A scalar as torch's optimizers keep it (a 0-d float tensor on the CPU)."""
    if v is None or torch.is_tensor(v):
        return v
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(float(v), dtype=dtype)


def make_rule_state(rule: UpdateRule, n: int, comm: Any, table: ParamTable) -> RuleState:
    """The rule state ``rule`` steps with: Muon's owners (muon_step.py), or the
    per-parameter scalars of every other rule."""
    from .rules.muon import MuonRule

    if isinstance(rule, MuonRule):
        # Here, not at the top: zerokern.optim imports zerokern.comm, which this package's
        # import of it would enter half-initialized.
        from .muon_step import MuonRuleState

        return MuonRuleState(rule, n, comm, table)
    return RuleState(rule, n)
