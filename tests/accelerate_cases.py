"""Rank-side cases of tests/test_integration_accelerate.py (importable by spawned ranks): the
loop of Accelerate's documentation (prepare, accumulate, backward, clip_grad_norm_ when
sync_gradients, step, zero_grad, save_state / load_state) with ZeroAccelerator + ZeroAdamW,
against the same loop with accelerate.Accelerator + torch AdamW (which wraps DDP)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from integration_common import (
    ACCUM,
    MAX_NORM,
    SAVE_AT,
    STEPS,
    TokenData,
    as_launched,
    assert_one_reduction_per_step,
    assert_params_close,
    tiny_gpt2,
)

import zerokern
import zerokern.integrations.accelerate

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))


def _loader():
    return torch.utils.data.DataLoader(TokenData(), batch_size=2, shuffle=False)


def _build(stage: int | None, seed: int = 0):
    """stage None: the reference (plain Accelerator, torch AdamW); else ZeroAccelerator."""
    from accelerate import Accelerator

    from zerokern.integrations.accelerate import ZeroAccelerator

    model = tiny_gpt2(seed)
    if stage is None:
        acc = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True)
        opt = torch.optim.AdamW(model.parameters(), foreach=False, **HP)
    else:
        acc = ZeroAccelerator(gradient_accumulation_steps=ACCUM, cpu=True)
        if stage == 3:
            from transformers.models.gpt2.modeling_gpt2 import GPT2Block

            model = zerokern.shard_model(model, unit_classes=(GPT2Block,))
        opt = zerokern.ZeroAdamW(model.parameters(), stage=stage, bucket_numel=97, **HP)
    sched = _schedule(opt)
    pmodel, popt, dl, psched = acc.prepare(model, opt, _loader(), sched)
    return acc, model, pmodel, popt, dl, psched


def _train(acc, pmodel, popt, dl, psched, *, start: int = 0, stop: int = STEPS,
           save: str | None = None) -> tuple[list[float], list[float]]:
    """Optimizer steps start..stop; returns the per-step loss (last micro-batch) and norm."""
    losses, norms = [], []
    step = start
    if start:
        dl = acc.skip_first_batches(dl, start * ACCUM)
    for batch in dl:
        with acc.accumulate(pmodel):
            loss = pmodel(**batch).loss
            acc.backward(loss)
            if acc.sync_gradients:
                norms.append(acc.clip_grad_norm_(pmodel.parameters(), MAX_NORM).item())
                losses.append(loss.item())
            popt.step()
            psched.step()
            popt.zero_grad()
        if acc.sync_gradients:
            step += 1
            if save is not None and step == SAVE_AT:
                acc.save_state(save)
            if step == stop:
                break
    return losses, norms


def _params(model):
    full = zerokern.full_state_dict(model, rank0_only=False)
    return {n: full[n] for n, _ in model.named_parameters()}


@as_launched
def parity_and_resume(rank: int, world: int, stage: int, tmp: str) -> None:
    acc, model, *rest = _build(None)
    assert isinstance(rest[0], torch.nn.parallel.DistributedDataParallel)
    ref_loss, ref_norm = _train(acc, *rest)
    assert all(n > MAX_NORM for n in ref_norm), "clipping must fire on every step"
    ref = _params(model)

    acc, model, pmodel, *rest = _build(stage)
    assert pmodel is model, "ZeroAccelerator must not wrap the model in DDP"
    ckpt = os.path.join(tmp, "state")
    loss, norm = _train(acc, pmodel, *rest, save=ckpt)
    for i, (a, b) in enumerate(zip(norm, ref_norm, strict=True)):
        assert math.isclose(a, b, rel_tol=1e-5), ("clip_grad_norm_", i, a, b)
    for i, (a, b) in enumerate(zip(loss, ref_loss, strict=True)):
        assert math.isclose(a, b, rel_tol=1e-5), ("loss", i, a, b)
    ours = _params(model)
    assert_one_reduction_per_step(zerokern.integrations.accelerate.unwrap_optimizer(rest[0]))
    assert_params_close(ours, ref, f"stage {stage} vs Accelerator + DDP + AdamW")
    # save_state: zerokern's sharded checkpoint, nothing of the optimizer in Accelerate's files.
    assert os.path.isfile(os.path.join(ckpt, "zerokern", "meta.json"))
    assert not any(f.startswith("optimizer") for f in os.listdir(ckpt)), os.listdir(ckpt)

    # Resume in a fresh accelerator from a model that starts elsewhere (seed 1).
    acc, model, *rest = _build(stage, seed=1)
    acc.load_state(ckpt)
    _train(acc, *rest, start=SAVE_AT)
    assert_params_close(_params(model), ours, f"stage {stage} resumed at step {SAVE_AT}",
                        tol=1e-6)

    # get_state_dict of a sharded model: the full parameters (rank 0), gathered on every rank.
    sd = acc.get_state_dict(rest[0])
    if rank == 0:
        for n, p in ours.items():
            torch.testing.assert_close(sd[n], p, rtol=0, atol=1e-6)


@as_launched
def torch_optimizer_is_refused(rank: int, world: int) -> None:
    """ZeroAccelerator does not wrap DDP, so a torch optimizer (whose gradients nobody would
    average) is refused at prepare, and so is a backward through a model no ZeroAdamW trains."""
    from zerokern.integrations.accelerate import ZeroAccelerator

    acc = ZeroAccelerator(cpu=True)
    model = tiny_gpt2()
    with pytest.raises(TypeError, match="ZeroAdamW"):
        acc.prepare(model, torch.optim.AdamW(model.parameters()))
    other = acc.prepare(tiny_gpt2())
    batch = next(iter(_loader()))
    with pytest.raises(RuntimeError, match="no ZeroAdamW trains"):
        acc.backward(other(**batch).loss)
    assert all(p.grad is None for p in other.parameters())


@as_launched
def fp16_is_refused(rank: int, world: int) -> None:
    from zerokern.integrations.accelerate import ZeroAccelerator

    with pytest.raises(ValueError, match="mixed_precision='fp16'"):
        ZeroAccelerator(cpu=True, mixed_precision="fp16")


@as_launched
def plain_accelerator_is_refused(rank: int, world: int) -> None:
    from accelerate import Accelerator

    model = tiny_gpt2()
    opt = zerokern.ZeroAdamW(model.parameters(), stage=2)
    with pytest.raises(RuntimeError, match="ZeroAccelerator"):
        Accelerator(cpu=True).prepare(model, opt)


@as_launched
def skipped_step_is_reported(rank: int, world: int) -> None:
    """ZeroAdamW's loss scaler skips an overflowing step on every rank; Accelerate's
    optimizer_step_was_skipped says so (the HF Trainer then leaves its LR scheduler alone),
    and nothing changes."""
    from zerokern.integrations.accelerate import ZeroAccelerator

    acc = ZeroAccelerator(cpu=True)
    model = tiny_gpt2()
    opt = zerokern.ZeroAdamW(model.parameters(), stage=2, loss_scale=1e38, **HP)
    pmodel, popt = acc.prepare(model, opt)
    before = _params(model)
    acc.backward(pmodel(**next(iter(_loader()))).loss)  # scaled by 1e38: inf gradients
    popt.step()
    assert acc.optimizer_step_was_skipped
    after = _params(model)
    for k, v in before.items():
        assert torch.equal(after[k], v), k
