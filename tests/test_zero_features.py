"""ZeroAdamW: fp16 overflow skipping, state dicts,
cross-rank validation and single-process use."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from models import OddNet, batch

import zerokern


def _train(model, opt, steps, rank, start=0, dtype=None):
    for step in range(start, start + steps):
        x, y = batch(step, rank)
        loss = F.cross_entropy(model(x).float(), y)
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()


# -- fp16 overflow -----------------------------------------------------------------------------
def overflow(rank, world, stage):
    torch.manual_seed(0)
    model = OddNet().to(torch.float16)
    opt = zerokern.ZeroAdamW(model.parameters(), lr=1e-3, stage=stage, loss_scale="dynamic",
                             bucket_numel=64)
    assert opt.loss_scale == 2.0**16
    for step in range(4):
        x, y = batch(step, rank)
        loss = F.cross_entropy(model(x).float(), y)
        if step == 2 and rank == world - 1:
            loss = loss * float("inf")  # only the last rank overflows
        before = [p.detach().clone() for p in model.parameters()]
        state_before = opt.state_dict()
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
        if step == 2:
            for a, b in zip(model.parameters(), before):
                assert torch.equal(a, b), "a skipped step changed a parameter"
            sd = opt.state_dict()
            for k in ("exp_avg", "exp_avg_sq", "master", "steps"):
                assert torch.equal(sd["state"][k], state_before["state"][k]), k
            assert opt.loss_scale == 2.0**15 and opt.scaler.skipped_steps == 1
        elif step < 2:
            assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), before))


@pytest.mark.parametrize("stage", [0, 2])
def test_fp16_overflow_skips_on_every_rank(stage, tmp_path):
    run_ranks(2, overflow, stage, tmp_path=tmp_path)


# -- state dict --------------------------------------------------------------------------------
def state_round_trip(rank, world, stage):
    torch.manual_seed(0)
    base = OddNet().to(torch.bfloat16)
    m1 = copy.deepcopy(base)
    o1 = zerokern.ZeroAdamW(m1.parameters(), stage=stage, bucket_numel=50)
    _train(m1, o1, 3, rank)
    saved_model = copy.deepcopy(m1.state_dict())
    saved_opt = copy.deepcopy(o1.state_dict())
    _train(m1, o1, 3, rank, start=3)
    m2 = copy.deepcopy(base)
    o2 = zerokern.ZeroAdamW(m2.parameters(), stage=stage, bucket_numel=50)
    m2.load_state_dict(saved_model)
    o2.load_state_dict(saved_opt)
    _train(m2, o2, 3, rank, start=3)
    for a, b in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    bad = copy.deepcopy(saved_opt)
    bad["zerokern"]["stage"] = (stage + 1) % 3
    with pytest.raises(ValueError, match="stage"):
        o2.load_state_dict(bad)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_state_dict_round_trip_bitwise(stage, tmp_path):
    run_ranks(2, state_round_trip, stage, tmp_path=tmp_path)


# -- validation --------------------------------------------------------------------------------
def mismatched(rank, world):
    model = torch.nn.Linear(4, 3 if rank == 0 else 5)
    with pytest.raises(ValueError, match="differ across ranks.*parameter 0"):
        zerokern.ZeroAdamW(model.parameters(), stage=2)


def test_param_lists_that_differ_raise_on_every_rank(tmp_path):
    run_ranks(2, mismatched, tmp_path=tmp_path)


def test_world_size_one_without_process_group_matches_adamw():
    torch.manual_seed(0)
    a = OddNet()
    b = copy.deepcopy(a)
    opt = zerokern.ZeroAdamW(a.parameters(), lr=1e-2, stage=2, bucket_numel=33)
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=1e-2, foreach=False)
    for step in range(5):
        for m, o in ((a, opt), (b, ref)):
            x, y = batch(step, 0)
            F.cross_entropy(m(x), y).backward()
            o.step()
            o.zero_grad()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kw,match",
    [(dict(stage=4), "stage"), (dict(lr=-1.0), "lr"), (dict(betas=(0.9, 1.0)), "betas"),
     (dict(bucket_numel=0), "bucket_numel"), (dict(max_grad_norm=0.0), "max_grad_norm"),
     (dict(loss_scale="auto"), "loss_scale"), (dict(weight_decay=-1.0), "weight_decay")],
)
def test_bad_arguments(kw, match):
    model = torch.nn.Linear(3, 3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        zerokern.ZeroAdamW(model.parameters(), **kw)
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)


def test_step_with_closure_returns_loss():
    model = torch.nn.Linear(3, 2)
    opt = zerokern.ZeroAdamW(model.parameters(), stage=1)
    x = torch.randn(4, 3)

    def closure():
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss) and loss.item() > 0


def test_launcher_without_process_group_raises(monkeypatch):
    # torchrun sets WORLD_SIZE; forgetting init_process_group() must not silently train
    # each rank as world size 1.
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = torch.nn.Linear(4, 3)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="init_process_group"):
        zerokern.ZeroAdamW(model.parameters(), stage=2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        zerokern.shard_model(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    monkeypatch.setenv("WORLD_SIZE", "1")  # a single process launched by torchrun: fine
    zerokern.ZeroAdamW(model.parameters(), stage=2)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_inf_gradient_with_clipping_matches_torch(stage):
    # max_grad_norm and no loss scaler: an infinite gradient element makes the norm inf and
    # torch's clip_grad_norm_ scales every gradient by 0 (finite ones become 0, the infinite
    # one NaN) before AdamW steps. ZeroAdamW does the same instead of failing.
    from _tol import TRAIN_FP32

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    ours = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    opt = zerokern.ZeroAdamW(ours.parameters(), lr=1e-2, stage=stage, max_grad_norm=1.0)
    x = torch.randn(4, 6)
    poison = [False]

    def inf_at_2_3(g):  # runs before the gradient is accumulated (and, for us, bucketed)
        if not poison[0]:
            return g
        g = g.clone()
        g[2, 3] = float("inf")
        return g

    for m in (ref, ours):
        m[0].weight.register_hook(inf_at_2_3)
    for step in range(3):
        poison[0] = step == 1
        for m in (ref, ours):
            m(x).square().sum().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    for a, b in zip(ref.parameters(), ours.parameters()):
        assert torch.equal(a.isnan(), b.isnan())
        torch.testing.assert_close(b, a, rtol=TRAIN_FP32[0], atol=TRAIN_FP32[1], equal_nan=True)
    assert ours[0].weight.isnan().any()  # the case did reach the infinite element


@pytest.mark.parametrize("key,bad", [("lr", float("nan")), ("lr", float("inf")),
                                     ("eps", float("nan")), ("weight_decay", float("nan"))])
def test_bad_hyperparameter_in_any_group_raises_before_anything_changes(key, bad):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match=key):
        zerokern.ZeroAdamW(model.parameters(), stage=2, **{key: bad})
    groups = [{"params": model[0].parameters()}, {"params": model[1].parameters()}]
    opt = zerokern.ZeroAdamW(groups, lr=1e-2, stage=2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(3, 4)).sum().backward()
    opt.param_groups[1][key] = bad  # e.g. a scheduler gone wrong, in the second group
    with pytest.raises(ValueError, match=rf"{key} \(param group 1\)"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_add_param_group_refuses_a_bad_group_unchanged():
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    opt = zerokern.ZeroAdamW(a.parameters(), lr=1e-2, stage=2)
    groups_before = len(opt.param_groups)
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": b.parameters(), "lr": float("nan")})
    with pytest.raises(ValueError, match="dtype and device"):
        opt.add_param_group({"params": torch.nn.Linear(4, 2).bfloat16().parameters()})
    assert len(opt.param_groups) == groups_before
    assert len(opt.managed_params) == 2


def test_dynamic_scale_follows_grad_scaler_with_its_growth_interval():
    """docs/numerics.md: the dynamic scale is GradScaler's with growth_interval 1000 instead of
    2000; set to 2000 it gives torch's scale at every step (an overflow pattern that lets it
    grow, halve and grow again)."""
    from zerokern.zero.scaler import LossScaler

    ours = LossScaler.from_arg("dynamic")
    ours.growth_interval = 2000
    scale, tracker = torch.tensor([2.0**16]), torch.tensor([0], dtype=torch.int32)
    for step in range(7000):
        inf = step in (10, 11, 2500, 6000)
        torch._amp_update_scale_(scale, tracker, torch.tensor([float(inf)]), 2.0, 0.5, 2000)
        ours.update(inf)
        assert ours.scale == scale.item(), step
