"""AdamW as an update rule: torch.optim.AdamW's update through the fused kernels
(``zerokern.ops``): one launch over a range of the default fp32 state, or the range-contract
kernel over a run of a compressed state (bf16 or int8 moments, master="none")."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from ...ops.adamw import engine_adamw_
from ...ops.adamw_compressed import engine_step_
from ...quant.maps import SIGNED_MAP_ID, UNSIGNED_MAP_ID
from ..state_format import StateFormat
from ..stored import Int8Stored
from ..validate import check_eps_moments, check_hparams
from .base import RangeStep, UpdateRule, register_rule


class AdamWRule(UpdateRule):
    name = "adamw"
    state_names = ("exp_avg", "exp_avg_sq")
    defaults: ClassVar[dict[str, Any]] = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                              weight_decay=1e-2)
    # exp_avg_sq is never negative: the unsigned map spends its sign bit on precision.
    code_maps: ClassVar[dict[str, str]] = {"exp_avg": SIGNED_MAP_ID,
                                           "exp_avg_sq": UNSIGNED_MAP_ID}
    torch_class = torch.optim.AdamW
    nonnegative = ("exp_avg_sq",)

    def check_hparams(self, group: Mapping[str, Any], where: str = "",
                      fmt: StateFormat | None = None) -> None:
        check_hparams(group["lr"], group["betas"], group["eps"], group["weight_decay"], where)
        if fmt is not None:
            check_eps_moments(group["eps"], fmt.moments, where)

    def step(self, r: RangeStep, lp: torch.Tensor | None) -> None:
        g = r.group
        m, v = r.state["exp_avg"], r.state["exp_avg_sq"]
        hp = dict(lr=float(g["lr"]), beta1=float(g["betas"][0]), beta2=float(g["betas"][1]),
                  eps=float(g["eps"]), weight_decay=float(g["weight_decay"]), step=r.step,
                  grad_scale=r.grad_scale, param_lp=lp, backend=r.backend)
        if not r.in_runs:
            engine_adamw_(r.values, r.grad, m.data, v.data, **hp)
            return
        sr = r.values.dtype == torch.bfloat16  # no master: stochastic rounding
        # The codes' own format version (their map id says it), run by run: a state keeps
        # the version it was created or loaded with.
        version = m.version if isinstance(m, Int8Stored) else 2
        engine_step_(
            r.values, r.grad, m.data, v.data, exp_avg_absmax=m.absmax,
            exp_avg_sq_absmax=v.absmax, sr_index=r.sr_index if sr else None,
            seed=r.seed if sr else None, format_version=version, **hp)


ADAMW = register_rule(AdamWRule())
