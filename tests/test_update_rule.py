"""The optimizer-side seams of issue 36, proved by a rule that exists only in this file: SGD with
momentum, written as a ``TorchRule`` over torch's own functional SGD, plugs into ZeroAdamW by
a class attribute. No stage, placement, stored format or state-dict code knows it; its state
is allocated under its own name, stepped at every stage and on both placements, stored in a
compressed format, and shown in ``opt.state`` under torch.optim.SGD's key, and its steps equal
torch.optim.SGD's bit for bit (world 1 on gloo)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import pytest
import torch
import torch.optim.sgd as torch_sgd
from dist_utils import run_ranks
from torch import nn

import zerokern
from zerokern.zero.rules import RULES, TorchRule, register_rule
from zerokern.zero.state_format import StateFormat

LR, MOMENTUM, DECAY = 0.05, 0.9, 0.01
STEPS = 4


class SGDRule(TorchRule):
    """torch.optim.SGD(momentum=, weight_decay=) as an update rule: one buffer."""

    name = "test-sgd"
    state_names = ("momentum_buffer",)
    defaults: ClassVar[dict[str, Any]] = dict(lr=LR, momentum=MOMENTUM, weight_decay=DECAY)
    torch_class = torch.optim.SGD

    def check_hparams(self, group: Mapping[str, Any], where: str = "",
                      fmt: StateFormat | None = None) -> None:
        if not float(group["lr"]) >= 0:
            raise ValueError(f"lr{where} must be >= 0")

    def update(self, values: torch.Tensor, grad: torch.Tensor, state: dict[str, torch.Tensor],
               group: Mapping[str, Any], step: int) -> None:
        buf = state["momentum_buffer"]
        # torch's first step starts the buffer as a copy of the gradient, not from zeros.
        bufs: list[torch.Tensor | None] = [None if step == 1 else buf]
        torch_sgd.sgd([values], [grad], bufs, foreach=False,
                            weight_decay=float(group["weight_decay"]),
                            momentum=float(group["momentum"]), lr=float(group["lr"]),
                            dampening=0.0, nesterov=False, maximize=False)
        if step == 1:
            assert bufs[0] is not None
            buf.copy_(bufs[0])


SGD = register_rule(SGDRule())


class ZeroSGD(zerokern.ZeroAdamW):
    """ZeroAdamW's machinery (stages, placements, stored formats) with the SGD rule."""

    rule = SGD

    def __init__(self, params: Any, **kw: Any) -> None:
        super().__init__(params, lr=LR, weight_decay=DECAY, **kw)
        for g in self.param_groups:
            g["momentum"] = MOMENTUM


def _model() -> nn.Module:
    torch.manual_seed(0)
    # 64 x 128 = 8192 elements: compressed formats store its buffer compressed.
    return nn.Sequential(nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 3))


def _batch(step: int) -> torch.Tensor:
    return torch.randn(16, 128, generator=torch.Generator().manual_seed(step))


def _as_bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def sgd_case(rank: int, world: int, stage: int, offload: str | None, moments: str) -> None:
    model = _model()
    ref = _model()
    if stage == 3:
        model = zerokern.shard_model(model)
    opt = ZeroSGD(model.parameters(), stage=stage, offload=offload, moments=moments,
                  bucket_numel=3000)
    ropt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=DECAY,
                           foreach=False)
    big = ref[0].weight
    what = f"stage {stage} offload {offload} moments {moments}"
    for step in range(STEPS):
        model(_batch(step)).square().sum().backward()
        opt.step()
        opt.zero_grad()
        ref(_batch(step)).square().sum().backward()
        ropt.step()
        ropt.zero_grad()
        if moments == "bf16":  # the large weight's buffer is stored as bf16 after each step
            buf = ropt.state[big]["momentum_buffer"]
            buf.copy_(_as_bf16(buf))
        full = zerokern.full_state_dict(model, rank0_only=False)
        for (name, p), q in zip(ref.named_parameters(), full.values()):
            assert torch.equal(p.detach(), q), f"{what} step {step}: {name}"
    ms = opt.memory_stats()
    kind = "host_momentum_buffer" if offload else "momentum_buffer"
    assert ms[kind] > 0 and "exp_avg" not in ms, (what, ms)
    entry = opt.state[opt.managed_params[0]]
    assert set(entry) >= {"step", "momentum_buffer", "ranges"}, what
    want = ropt.state[big]["momentum_buffer"].reshape(-1)
    assert torch.equal(entry["momentum_buffer"], want), what


@pytest.mark.parametrize("stage,offload,moments", [
    (0, None, "fp32"), (1, None, "fp32"), (2, "cpu", "fp32"), (3, None, "fp32"),
    (3, "cpu", "fp32"), (2, None, "bf16")])
def test_a_rule_defined_here_steps_as_torch_sgd(stage, offload, moments, tmp_path):
    run_ranks(1, sgd_case, stage, offload, moments, tmp_path=tmp_path)


def test_the_rule_is_registered_and_adamw_is_the_default():
    assert RULES["test-sgd"] is SGD and RULES["adamw"] is zerokern.ZeroAdamW.rule
    assert zerokern.ZeroAdamW.rule.torch_keys == ("step", "exp_avg", "exp_avg_sq")
    assert SGD.torch_keys == ("step", "momentum_buffer")
