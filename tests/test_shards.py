"""The public sharded-state interface (ZeroAdamW.shards / edit_shards) against torch.optim.AdamW
trained on the same data in the same processes, and the side-effect-free introspection before
the first step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _tol import U_FP32
from dist_utils import run_ranks
from models import OddNet, batch
from test_zero_parity import _ref_average

import zerokern

HP = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.05)

# How far the shards may be from torch's AdamW (u = U_FP32 = 2**-24). Both runs compute the
# same real numbers from the same start; what separates their floats:
#  1. AdamW's roundings. zerokern's kernel fuses the lerp, the v update and the p update
#     (csrc/kernels.h); torch's CPU AdamW (foreach=False) fuses them in its vector body but
#     not in its scalar tail. Per step each of m, v, p is at most 2 roundings apart: 2u of its
#     size, and for p 2u(|p| + lr |r|), where the normalised step r = m^/(sqrt(v^) + eps)
#     is at most ~1 (_tol.adamw_step_bound).
#  2. At world size 3 the ranks' gradients are summed in another order: 1 rounding of the sum.
#  3. From the second step on, the forward runs on parameters 1.-2. moved apart, so the
#     gradients, and through them m, v and the steps, differ by as much as OddNet's gradient
#     moves with them.
# Over the 3 steps before a check (2 after edit_shards) 1.-2. come to 6u. 3. is a property of
# the model, not of the arithmetic; on OddNet, every stage and world size, both check points,
# everything together measured at most 12u (|p| + lr) for p, 4.5u max|m| and 8.3u max|v|: no
# more than as much again as 1.-2. The bound is therefore 2 x 6u, with a factor 2.7 for other
# CPUs (vector width, hence which elements torch leaves to its scalar tail): K_U = 32u.
# m and v are measured against the largest |m|, |v| of the parameter's tensor, not their own
# element: m sums gradients of both signs and cancels, and v follows those gradients' squares,
# so an element's own size does not bound the roundings that made it. (Before: 1e-5 absolute
# on all three, 100 to 2700 times what they differ by, and larger than most v elements.)
K_U = 32 * U_FP32


def _step(model, opt, step, rank, world, ref=None, ropt=None):
    x, y = batch(step, rank)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    if ref is not None:
        F.cross_entropy(ref(x), y).backward()
        _ref_average(ref, world)
        ropt.step()
        ropt.zero_grad()


def _build(stage, world, hp=HP):
    """OddNet under ZeroAdamW (stage 3: sharded) and an identical copy under torch AdamW."""
    torch.manual_seed(0)
    base = OddNet()
    ours = copy.deepcopy(base)
    if stage == 3:
        ours = zerokern.shard_model(ours)
    opt = zerokern.ZeroAdamW(ours.parameters(), stage=stage, bucket_numel=61, **hp)
    ref = copy.deepcopy(base)
    ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], foreach=False,
                             **hp)
    return ours, opt, ref, ropt


def _check_against(opt, ref, ropt, rank, world):
    """Every range of every shard holds torch AdamW's values; the ranks together hold every
    element exactly once (stage 0: each rank holds all of it)."""
    lr = ropt.param_groups[0]["lr"]
    shards = opt.shards()
    covered = []
    for sh, rp in zip(shards, [p for p in ref.parameters() if p.requires_grad]):
        assert sh.shape == rp.shape and sh.numel == rp.numel()
        st = ropt.state.get(rp, {})
        assert sh.step == int(st.get("step", 0))
        for r in sh.ranges:
            sl = slice(r.start, r.start + r.numel)
            torch.testing.assert_close(r.values, rp.detach().reshape(-1)[sl], rtol=K_U,
                                       atol=K_U * lr)
            for key, got in (("exp_avg", r.exp_avg), ("exp_avg_sq", r.exp_avg_sq)):
                if st:
                    want = st[key]
                    torch.testing.assert_close(got, want.reshape(-1)[sl], rtol=0.0,
                                               atol=K_U * float(want.abs().max()))
            covered.append((sh.index, r.start, r.numel))
    every = [None] * world
    dist.all_gather_object(every, covered)
    for sh in shards:
        count = torch.zeros(sh.numel, dtype=torch.int64)
        for rows in every:
            for i, s, n in rows:
                if i == sh.index:
                    count[s:s + n] += 1
        expected = world if opt.stage == 0 else 1
        assert torch.all(count == expected), (sh.index, count)


def shards_case(rank, world, stage):
    ours, opt, ref, ropt = _build(stage, world)
    if stage < 3:
        ms = opt.memory_stats()
        sd = opt.state_dict()
        assert opt.layout is None, "memory_stats()/state_dict() fixed the layout"
        assert sd["state"] == {} and sd["zerokern"]["ready_order"] is None
    for step in range(3):
        _step(ours, opt, step, rank, world, ref, ropt)
    _check_against(opt, ref, ropt, rank, world)
    if stage < 3:  # what was reported before the first step is what was allocated
        after = opt.memory_stats()
        for k in ("params", "grads", "master", "exp_avg", "exp_avg_sq", "padding"):
            assert ms[k] == after[k], (k, ms[k], after[k])
        assert ms["arena_capacity"] == after["arena_capacity"]

    # edit_shards: perturb our state, write torch AdamW's back, and both continue alike.
    _step(ours, opt, 3, rank, world)
    refp = [p for p in ref.parameters() if p.requires_grad]
    with opt.edit_shards() as shards:
        for sh, rp in zip(shards, refp):
            st = ropt.state.get(rp) or {}  # no state: never had a gradient
            zero = torch.zeros(rp.numel())
            for r in sh.ranges:
                sl = slice(r.start, r.start + r.numel)
                r.values.copy_(rp.detach().reshape(-1)[sl])
                r.exp_avg.copy_(st.get("exp_avg", zero).reshape(-1)[sl])
                r.exp_avg_sq.copy_(st.get("exp_avg_sq", zero).reshape(-1)[sl])
            sh.step = int(st.get("step", 0))
    # What edit_shards wrote is what the shards hold: a copy, bit for bit.
    for sh, rp in zip(opt.shards(), refp):
        st = ropt.state.get(rp) or {}
        zero = torch.zeros(rp.numel())
        assert sh.step == int(st.get("step", 0))
        for r in sh.ranges:
            sl = slice(r.start, r.start + r.numel)
            assert torch.equal(r.values, rp.detach().reshape(-1)[sl]), sh.index
            assert torch.equal(r.exp_avg, st.get("exp_avg", zero).reshape(-1)[sl]), sh.index
            assert torch.equal(r.exp_avg_sq, st.get("exp_avg_sq", zero).reshape(-1)[sl]), \
                sh.index
    for step in range(4, 6):
        _step(ours, opt, step, rank, world, ref, ropt)
    _check_against(opt, ref, ropt, rank, world)
    full = zerokern.full_state_dict(ours, rank0_only=False)
    for n, p in ref.named_parameters():  # the parameters of the shards just checked
        torch.testing.assert_close(full[n], p.detach(), rtol=K_U, atol=K_U * HP["lr"])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_shards_hold_torch_adamw_state_and_edit_shards_sets_it(stage, world, tmp_path):
    run_ranks(world, shards_case, stage, tmp_path=tmp_path)

