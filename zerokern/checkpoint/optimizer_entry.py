"""meta.json's ``optimizer`` entry: which update rule a checkpoint's state belongs to, when it is
not AdamW's (a checkpoint without the entry holds AdamW's, as every checkpoint did before).

::

    "optimizer": {"class": "torch.optim.NAdam", "rule": "torch:torch.optim.nadam.NAdam",
                  "buffers": ["exp_avg", "exp_avg_sq"], "scalars": ["mu_product"],
                  "param_scalars": {"fc.weight": {"mu_product": 0.8734}, ...}}

``buffers`` are the per-element buffers the rank files hold beside ``master`` (one tensor
each, in the state's layout, as AdamW's ``exp_avg`` and ``exp_avg_sq``); ``param_scalars``
are each trained parameter's per-parameter scalars (``rule_state.py``), by name. The param
groups' ``hyper`` then hold the class's hyperparameters (any JSON value), checked at load by
the class itself. A load refuses a checkpoint of another rule before anything is modified.
"""

from __future__ import annotations

import math
from typing import Any

from ..zero.rules import ADAMW, TorchClassRule
from ..zero.rules.torch_class import class_name
from .format import CheckpointError

OPTIMIZER = "optimizer"
ENTRY_KEYS = frozenset({"class", "rule", "buffers", "scalars", "param_scalars"})


def optimizer_entry(opt: Any, names: dict[int, str]) -> dict[str, Any] | None:
    """The entry of ``opt``'s rule (None for AdamW's); ``names``: id(param) -> name."""
    rule = opt.rule
    if not isinstance(rule, TorchClassRule):
        return None
    scalars: dict[str, dict[str, float | None]] = {}
    saved = opt._rule_state.state_dict() or []
    for i, s in enumerate(saved):
        if s:
            scalars[names[id(opt.managed_params[i])]] = s
    return {"class": class_name(rule.torch_class), "rule": rule.name,
            "buffers": list(rule.state_names), "scalars": list(rule.scalar_names),
            "param_scalars": scalars}


def state_tensors(meta: dict[str, Any]) -> tuple[str, ...]:
    """The tensors behind piece kind "state" of a rank file: the values, then the buffers."""
    entry = meta.get(OPTIMIZER)
    buffers = ADAMW.state_names if entry is None else tuple(entry["buffers"])
    return ("master", *buffers)


def rule_name(meta: dict[str, Any]) -> str:
    entry = meta.get(OPTIMIZER)
    return ADAMW.name if entry is None else entry["rule"]


def known_hyper(opt: Any, key: str) -> bool:
    """A param-group key a checkpoint of ``opt`` holds besides validate.HYPER_KEYS: its
    torch class's hyperparameters."""
    rule = opt.rule
    return isinstance(rule, TorchClassRule) and key in rule.defaults


def check_entry(meta: dict[str, Any], error: Any) -> None:
    """The entry's form (validate.check_meta): ``error(field, why)`` makes the exception."""
    e = meta[OPTIMIZER]
    if not isinstance(e, dict) or set(e) != ENTRY_KEYS:
        raise error(OPTIMIZER, f"must be an object with the entries {sorted(ENTRY_KEYS)}")
    for k in ("class", "rule"):
        if not isinstance(e[k], str) or not e[k]:
            raise error(f"{OPTIMIZER}.{k}", f"must be a string, got {e[k]!r}")
    for k in ("buffers", "scalars"):
        v = e[k]
        if not (isinstance(v, list) and all(isinstance(x, str) and x and x != "master"
                                            for x in v) and len(set(v)) == len(v)):
            raise error(f"{OPTIMIZER}.{k}", f"must be a list of distinct names, got {v!r}")
    ps = e["param_scalars"]
    if not isinstance(ps, dict):
        raise error(f"{OPTIMIZER}.param_scalars", "must be an object")
    for name, s in ps.items():
        if name not in meta["params"] or not meta["params"][name]["managed"]:
            raise error(f"{OPTIMIZER}.param_scalars", f"names {name!r}, not a trained "
                                                       "parameter")
        if not isinstance(s, dict) or set(s) - set(e["scalars"]) or not all(
                v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                              and math.isfinite(v)) for v in s.values()):
            raise error(f"{OPTIMIZER}.param_scalars[{name!r}]",
                        f"must map scalars {e['scalars']} to finite numbers, got {s!r}")


def check_hyper(h: dict[str, Any], field: str, error: Any) -> None:
    """A group's ``hyper`` of a torch class's checkpoint: JSON values (the class checks their
    meaning at load, ``match_rule``)."""
    for k, v in h.items():
        if isinstance(v, float) and not math.isfinite(v):
            raise error(f"{field}.{k}", f"must be finite, got {v!r}")


def match_rule(ck_dir: str, meta: dict[str, Any], opt: Any,
               groups: list[int | None]) -> None:
    """The checkpoint's rule is ``opt``'s, and each of ``opt``'s groups, with the saved
    hyperparameters of its source group (``groups``), is one the rule steps."""
    saved = rule_name(meta)
    if saved != opt.rule.name:
        cls = meta[OPTIMIZER]["class"] if OPTIMIZER in meta else "torch.optim.AdamW"
        mine = class_name(opt.rule.torch_class)
        if cls == mine:  # one class, two rules (AdamW: fused, or torch's step for amsgrad)
            raise CheckpointError(
                f"{ck_dir}: the checkpoint holds the state of {_how(cls, saved, meta)}, this "
                f"optimizer steps {_how(mine, opt.rule.name, None)}: build it with the "
                "checkpoint's flags")
        raise CheckpointError(f"{ck_dir}: the checkpoint holds the state of {cls}, this "
                              f"optimizer steps {mine}: load it into the same optimizer class")
    if not isinstance(opt.rule, TorchClassRule):
        return
    for gi, src in enumerate(groups):
        if src is None:
            continue
        hyper = meta["param_groups"][src]["hyper"]
        merged = {**opt.param_groups[gi], **{k: tuple(v) if isinstance(v, list) else v
                                             for k, v in hyper.items()}}
        try:
            opt.rule.check_hparams(merged, f" (saved param group {src})")
        except (ValueError, TypeError) as exc:
            raise CheckpointError(f"{ck_dir}: {exc}") from None


def _how(cls: str, rule: str, meta: dict[str, Any] | None) -> str:
    """``cls`` with the rule that steps it, where one class has two (torch.optim.AdamW)."""
    if rule == ADAMW.name:
        return f"{cls} as zerokern's fused AdamW (amsgrad=False, maximize=False)"
    buffers = f", buffers {meta[OPTIMIZER]['buffers']}" if meta is not None else ""
    return f"{cls} by torch's own step (amsgrad=True or maximize=True{buffers})"


def apply_scalars(meta: dict[str, Any], opt: Any, names: dict[int, str]) -> None:
    """Each trained parameter's scalars from the checkpoint (after its steps are set)."""
    entry = meta.get(OPTIMIZER)
    if entry is None or not isinstance(opt.rule, TorchClassRule):
        return
    saved = entry["param_scalars"]
    rs = opt._rule_state
    rs.load([saved.get(names[id(p)], {}) for p in opt.managed_params], "checkpoint")
