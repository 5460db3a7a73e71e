"""The checks of ZeroAdamW's param groups: every group's hyperparameters (at construction, and
at every step, since a scheduler or a script may have changed them), and a group added by
``add_param_group`` after construction, before anything changes (its parameters are then
appended to the param table and the layout re-planned: optimizer.py sequences that).
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import Comm
from .agreement import agree, agreement_comm, group_facts, hyper_keys, param_facts
from .interchange import check_adamw_flags
from .param_table import ParamTable
from .registry import runtime_of_param
from .rules import TorchClassRule
from .validate import check_eps_moments, check_hparams, check_no_duplicates, common_dtype_device


def check_groups(param_groups: list[dict[str, Any]], *, flags: bool, moments: str,
                 rule: Any = None) -> None:
    """Every group's hyperparameters before any group is touched (a NaN lr in the second
    group must not leave the first one updated), ``eps`` against the ``moments`` format
    (int8: eps > 0); with ``flags``, a torch AdamW flag set on a group afterwards
    (``g["amsgrad"] = True``) is not dropped in silence either. A torch class's rule
    (``TorchClassRule``) checks them as the class does."""
    if isinstance(rule, TorchClassRule):
        for gi, g in enumerate(param_groups):
            rule.check_hparams(g, f" (param group {gi})")
        return
    for gi, g in enumerate(param_groups):
        check_hparams(g["lr"], g["betas"], g["eps"], g["weight_decay"],
                      f" (param group {gi})")
        check_eps_moments(g["eps"], moments, f" (param group {gi})")
        if flags:
            check_adamw_flags(g, f" (param group {gi})")


def check_new_group(group: dict[str, Any], table: ParamTable, runtime: Any, comm: Comm, *,
                    moments: str, options: dict[str, Any],
                    param_groups: list[dict[str, Any]], gi: int, rule: Any = None,
                    ) -> tuple[list[torch.nn.Parameter], list[torch.Size]]:
    """Param group ``gi`` (the last of ``param_groups``), added after construction: its
    trained parameters and their full shapes, once it is checked against the table (same
    kind of model, dtype and device; ``eps`` against the ``moments`` format) and across
    ranks with the optimizer's ``options`` (``ZeroConfig.agreed()``) in one gather (a
    collective: every rank adds the same group; a refusal on one rank is raised on every
    rank)."""
    new: list[torch.nn.Parameter] = []
    shapes: list[torch.Size] = []
    failure: BaseException | None = None
    try:
        if isinstance(rule, TorchClassRule):
            rule.check_hparams(group, f" (param group {gi})")
        else:
            check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"],
                          f" (param group {gi})")
            check_eps_moments(group["eps"], moments, f" (param group {gi})")
        check_no_duplicates(group["params"], gi)
        new = [p for p in group["params"] if p.requires_grad]
        owners = {id(rt) for rt in map(runtime_of_param, new)}
        if new and owners != {id(runtime)}:
            raise ValueError("add_param_group: the new parameters must belong to the same "
                             + ("shard_model'ed model (stage 3)" if runtime is not None
                                else "kind of model (not partitioned by shard_model)"))
        if new:
            common_dtype_device(table.params + new)
        shapes = table.shapes_of(new)
        groups = group_facts(param_groups, table.group_counts() + [len(new)],
                             hyper_keys(rule))
        params = param_facts(table.shapes + shapes, table.params + new)
    except (ValueError, TypeError, RuntimeError) as exc:
        failure, groups, params = exc, None, None
    agree(agreement_comm(comm), "add_param_group", options=options, failure=failure,
          groups=groups, params=params)
    return new, shapes
