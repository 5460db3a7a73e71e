"""How an optimizer over parameters of several dtypes is split into parts (stages 0-3).

A flat buffer holds one dtype, and its state one format: so the trained parameters are
partitioned by (dtype, master option), each partition trained by one part (a whole ZeRO
optimizer of the same class over its own param groups, with its own flat layout and
buckets), and ``MixedParts`` (mixed.py) shows the parts as one optimizer. ``master`` may be
given per param group (``{"params": ..., "master": "none"}``): it applies to the group's
bf16 parameters; fp32 parameters are their own master and keep fp32 state whatever it says.

Each user param group maps to one sub-group per partition it has trained parameters in
(the sub-group holds the same hyperparameters, pushed again before every step so that
schedulers and scripts edit the user's groups). Frozen parameters are in no part.
At stage 3 ``shard_model`` keeps one runtime per dtype, so each part, built over one dtype,
is a stage-3 optimizer on that dtype's runtime (several parts of one dtype: several
optimizers on one runtime, stage3/owners.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .validate import _DTYPES, check_gather_dtype_params, check_master_dtype

MASTER_CHOICES = ("fp32", "none")
# Keys of a user group that are not handed to its sub-groups.
NOT_PUSHED = ("params", "param_names", "master")


@dataclass
class Part:
    """One partition: its dtype and master option, its sub-groups (dicts for the part's
    constructor) and, per sub-group, the user group it comes from."""

    dtype: torch.dtype
    master: str
    groups: list[dict[str, Any]] = field(default_factory=list)
    source: list[int] = field(default_factory=list)  # sub-group -> user group
    managed: list[int] = field(default_factory=list)  # local index -> global managed index


def group_master(g: dict[str, Any], gi: int, default: str) -> str:
    """Param group ``gi``'s ``master`` (the optimizer's when it gives none), checked."""
    m = g.get("master", default)
    if not isinstance(m, str) or m not in MASTER_CHOICES:
        raise ValueError(f"master (param group {gi}) must be 'fp32' or 'none', got {m!r}")
    return m


def plan_parts(param_groups: list[dict[str, Any]], cfg: Any, runtime: Any,
               ) -> list[Part] | None:
    """The parts of an optimizer over ``param_groups`` with the options ``cfg``, or None
    when every trained parameter has one dtype and no group names its own ``master`` (one
    flat layout: the optimizer is built as it always was). Refuses, naming the argument,
    what the parts cannot hold: several devices, ``loss_scale``, and each part's
    own dtype checks (so that no part is built when a later one would be refused)."""
    trained = [(gi, p) for gi, g in enumerate(param_groups) for p in g["params"]
               if p.requires_grad]
    per_group = any("master" in g for g in param_groups)
    dtypes = {p.dtype for _, p in trained}
    if len(dtypes) <= 1 and not per_group:
        return None
    p0 = trained[0][1]
    for i, (_, p) in enumerate(trained):
        if p.dtype not in _DTYPES:
            raise TypeError(f"params: parameter {i} has dtype {p.dtype}; supported: "
                            "float32, bfloat16, float16")
        if p.device != p0.device:
            raise ValueError(
                f"params: all trainable parameters must share one device; parameter 0 is "
                f"on {p0.device}, parameter {i} is on {p.device}")
    if runtime is not None:
        # Stage 3: each part is a stage-3 optimizer on its own dtype's runtime (shard_model);
        # what would move a runtime's slices or wire for one part is not built yet.
        for name, on in (("offload='cpu'", cfg.offload is not None),
                         ("reduce_dtype / gather_dtype quantized", cfg.wire.quantized),
                         (f"reduce_dtype={cfg.reduce_dtype!r}", cfg.reduce_dtype is not None)):
            if on:
                raise ValueError(
                    f"{name} with parameters of several dtypes (or a param group's own "
                    "'master') at stage 3 is not built; use stage 0-2, or one dtype")
    if cfg.loss_scale is not None:
        raise ValueError(
            f"loss_scale={cfg.loss_scale!r} with parameters of several dtypes (or a param "
            "group's own 'master'): one loss scaler over several flat layouts is not built; "
            "use bf16 (no loss scaling needed) or one dtype")
    parts: dict[tuple[torch.dtype, str], Part] = {}
    for gi, g in enumerate(param_groups):
        master = group_master(g, gi, cfg.master)
        subs: dict[tuple[torch.dtype, str], dict[str, Any]] = {}
        names = g.get("param_names")
        for j, p in enumerate(g["params"]):
            if not p.requires_grad:
                continue
            # fp32 parameters are their own master: master="none" is for the 16-bit ones.
            key = (p.dtype, master if p.dtype != torch.float32 else "fp32")
            sub = subs.get(key)
            if sub is None:
                sub = subs[key] = {k: v for k, v in g.items() if k not in NOT_PUSHED}
                sub["params"] = []
                if names is not None:
                    sub["param_names"] = []
                part = parts.setdefault(key, Part(*key))
                part.groups.append(sub)
                part.source.append(gi)
            sub["params"].append(p)
            if names is not None:
                sub["param_names"].append(names[j])
    index = {id(p): i for i, (_, p) in enumerate(trained)}
    for part in parts.values():
        fmt = replace(cfg.state_format, master=part.master)
        check_master_dtype(fmt, part.dtype)
        check_gather_dtype_params(cfg.wire.gather_bits, cfg.stage, part.dtype)
        part.managed = [index[id(p)] for g in part.groups for p in g["params"]]
    return list(parts.values())
