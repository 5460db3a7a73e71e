"""Optimizer state in torch.optim.AdamW's format: full_state_dict out of ZeroAdamW into torch's
AdamW, a torch AdamW state dict into ZeroAdamW, each continuing as the other would; and the
error for a per-rank state dict loaded on another rank."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from models import OddNet, batch
from test_zero_parity import _ref_average

import zerokern

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)


def _close(a, b, what):
    # fp32 within 1e-6: the fused kernel and torch's AdamW(foreach=False) after 5 more steps
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _ours(base, stage, dtype=torch.float32):
    m = copy.deepcopy(base).to(dtype)
    if stage == 3:
        m = zerokern.shard_model(m)
    return m, zerokern.ZeroAdamW(m.parameters(), stage=stage, bucket_numel=61, **HP)


def _train_ours(model, opt, steps, rank, start=0):
    for step in range(start, start + steps):
        x, y = batch(step, rank)
        F.cross_entropy(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()


def _train_ref(model, opt, steps, rank, world, start=0):
    for step in range(start, start + steps):
        x, y = batch(step, rank)
        F.cross_entropy(model(x), y).backward()
        _ref_average(model, world)  # what one process on the ranks' joint batch would get
        opt.step()
        opt.zero_grad()


def out_case(rank, world, stage, dtype):
    torch.manual_seed(0)
    base = OddNet()
    ours, opt = _ours(base, stage, dtype)
    _train_ours(ours, opt, 3, rank)
    sd = opt.full_state_dict(rank0_only=False)
    assert (opt.full_state_dict() == {}) == (rank != 0)  # rank0_only: others get {}
    full = zerokern.full_state_dict(ours, rank0_only=False)
    ref = OddNet()
    ref.load_state_dict({k: v.float() for k, v in full.items()})
    ropt = torch.optim.AdamW([p for p in ref.parameters()], foreach=False, **HP)
    ropt.load_state_dict(sd)  # torch's own loader accepts it
    for p, sh in zip([p for p in ref.parameters() if p.requires_grad], opt.shards()):
        st = ropt.state.get(p, {})
        assert (sh.step > 0) == bool(st) and (not st or int(st["step"]) == sh.step)
    if dtype == torch.float32:  # both continue alike (16-bit: ours keeps its finer master)
        _train_ours(ours, opt, 5, rank, start=3)
        _train_ref(ref, ropt, 5, rank, world, start=3)
        full = zerokern.full_state_dict(ours, rank0_only=False)
        for n, p in ref.named_parameters():
            _close(full[n], p.detach(), n)
    else:  # the round trip back into a fresh ZeroAdamW gives the same moments
        ours2, opt2 = _ours(base, stage, dtype)
        ours2.load_state_dict(zerokern.full_state_dict(ours, rank0_only=False))
        opt2.load_state_dict(sd)
        back = opt2.full_state_dict(rank0_only=False)
        assert back["state"].keys() == sd["state"].keys()
        for i, st in sd["state"].items():
            for k in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(back["state"][i][k], st[k]), (i, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [2, 3])
def test_full_state_dict_continues_in_torch_adamw(world, stage, dtype, tmp_path):
    run_ranks(world, out_case, stage, dtype, tmp_path=tmp_path)


def in_case(rank, world, stage):
    torch.manual_seed(0)
    base = OddNet()
    ref = copy.deepcopy(base)
    ropt = torch.optim.AdamW(list(ref.parameters()), foreach=False, **HP)
    _train_ref(ref, ropt, 5, rank, world)
    ours, opt = _ours(ref, stage)  # the model's values first, then the optimizer's state
    opt.load_state_dict(ropt.state_dict())
    _train_ours(ours, opt, 5, rank, start=5)
    _train_ref(ref, ropt, 5, rank, world, start=5)
    full = zerokern.full_state_dict(ours, rank0_only=False)
    for n, p in ref.named_parameters():
        _close(full[n], p.detach(), n)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [2, 3])
def test_torch_adamw_state_dict_loads_into_zero_adamw(world, stage, tmp_path):
    run_ranks(world, in_case, stage, tmp_path=tmp_path)


def wrong_rank_case(rank, world):
    torch.manual_seed(0)
    ours, opt = _ours(OddNet(), 2)
    _train_ours(ours, opt, 1, rank)
    mine = opt.state_dict()
    other = [None]
    torch.distributed.broadcast_object_list(other if rank else [mine], src=0)
    if rank == 1:
        with pytest.raises(ValueError, match=r"only rank 0's shard of a stage-2 ZeroAdamW "
                                             r"over 2 ranks.*full_state_dict"):
            opt.load_state_dict(other[0])


def test_per_rank_state_dict_on_another_rank_says_what_it_is(tmp_path):
    run_ranks(2, wrong_rank_case, tmp_path=tmp_path)


def memory_case(rank, world):
    """full_state_dict builds one parameter at a time: what it allocates is what it returns
    plus at most one parameter's two moments (never a second copy of the whole state)."""
    from zerokern.zero import interchange

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(600, 500), torch.nn.Linear(500, 600),
                                torch.nn.Linear(600, 3))
    opt = zerokern.ZeroAdamW(model.parameters(), stage=2, **HP)
    model(torch.randn(4, 600)).square().sum().backward()
    opt.step()
    allocated = []
    real = interchange.torch.zeros

    def counting(*a, **k):
        t = real(*a, **k)
        allocated.append(t.numel() * t.element_size())
        return t

    interchange.torch.zeros = counting
    try:
        sd = opt.full_state_dict(rank0_only=False)
    finally:
        interchange.torch.zeros = real
    returned = sum(v.numel() * v.element_size() for st in sd["state"].values()
                   for k, v in st.items() if k != "step")
    largest = max(p.numel() for p in model.parameters()) * 4
    assert sum(allocated) <= returned + 2 * largest, (sum(allocated), returned, largest)
    assert returned == 2 * 4 * sum(p.numel() for p in model.parameters())


def test_full_state_dict_builds_one_parameter_at_a_time(tmp_path):
    run_ranks(2, memory_case, tmp_path=tmp_path)
