"""Every stage engine with its state on the device and on the host, in one process (world
size 1: no process group, no collective): the same training run gives bitwise the same
parameters and state, and stage 0 follows torch.optim.AdamW. The multi-rank parity of each
stage against DDP is in test_zero_parity.py / test_stage3.py; this is the cheap first check
of the composition (stage x placement) that a refactor of either breaks first."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _tol import TRAIN_FP32
from models import OddNet, batch

import zerokern

STEPS = 4
CASES = [(0, None), (1, None), (2, None), (3, None), (1, "cpu"), (2, "cpu"), (3, "cpu")]


def _run(stage: int, offload: str | None, dtype: torch.dtype, base: torch.nn.Module,
         clip: float | None = None):
    model = copy.deepcopy(base).to(dtype)
    if stage == 3:
        zerokern.shard_model(model)
    opt = zerokern.ZeroAdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95),
                             weight_decay=0.05, stage=stage, offload=offload, bucket_numel=61,
                             max_grad_norm=clip)
    for step in range(STEPS):
        x, y = batch(step, 0)
        F.cross_entropy(model(x, step % 2 == 0).float(), y).backward()
        opt.step()
        opt.zero_grad()
    params = zerokern.full_state_dict(model) if stage == 3 else {
        k: v.detach().clone() for k, v in model.state_dict().items()}
    return params, opt.full_state_dict()


def _assert_same(a, b, what) -> None:
    (pa, sa), (pb, sb) = a, b
    for k, v in pa.items():
        assert torch.equal(pb[k], v), (what, k)
    for k, v in sa["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sb["state"][k][name], v[name]), (what, k, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_stage_and_placement_bitwise_equal(dtype: torch.dtype) -> None:
    """Without clipping every stage and placement computes the same numbers."""
    torch.manual_seed(0)
    base = OddNet()
    ref = _run(0, None, dtype, base)
    for stage, offload in CASES[1:]:
        _assert_same(ref, _run(stage, offload, dtype, base), (stage, offload))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_host_placement_equals_device_with_clipping(stage: int) -> None:
    """With clipping the norm's summation order is the stage's (stage 3 sums per unit), so
    stages may differ in the last bit; a stage's two placements may not."""
    torch.manual_seed(0)
    base = OddNet()
    for dtype in (torch.float32, torch.bfloat16):
        _assert_same(_run(stage, None, dtype, base, clip=0.5),
                     _run(stage, "cpu", dtype, base, clip=0.5), (stage, dtype))


def test_stage0_follows_torch_adamw() -> None:
    torch.manual_seed(0)
    base = OddNet()
    params, _ = _run(0, None, torch.float32, base, clip=1.0)
    ref = copy.deepcopy(base)
    opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.05,
                            foreach=False)
    for step in range(STEPS):
        x, y = batch(step, 0)
        F.cross_entropy(ref(x, step % 2 == 0), y).backward()
        torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None],
                                       1.0)
        opt.step()
        opt.zero_grad()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(params[k], v, rtol=TRAIN_FP32[0], atol=TRAIN_FP32[1])
