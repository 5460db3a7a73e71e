"""Several zerokern optimizers over disjoint parameters of one model sharded by shard_model
(ZeRO stage 3, issue 37 items 3 and 8): torch's Muon recipe, ``ZeroOptimizer(matrices,
torch.optim.Muon, stage=3)`` next to ``ZeroOptimizer(rest, torch.optim.AdamW, stage=3)``.

One 2-rank launch checks: a parameter in two optimizers is refused at construction (and in
add_param_group) naming it, and so is ``offload="cpu"`` next to another optimizer; Muon +
AdamW with ``torch.nn.utils.clip_grad_norm_`` over both (one global norm) and a step in which
only Muon steps and zero_grads (AdamW's gradients accumulate over two backwards, as torch's
do) against DDP-style averaging + torch.optim.Muon + torch.optim.AdamW, parameters, momentum
and moments; each optimizer's state_dict() and the project's checkpoints round trip
(training on bit for bit as the original); a replaced optimizer (a new one over all of its
parameters) cannot step; bf16 parameters (an fp32 master each) train bit for bit as one
ZeroAdamW with one param group per optimizer, with each optimizer's step and zero_grad
interleaved and a no_sync micro-batch (the other optimizer's step is no outside write of
the weights, and a zero_grad before a backward does not drop the next step's gradients),
and each of the two holds state (and reports it in memory_stats()) for its own elements
only: together about what the one optimizer holds.
test_zero_muon.py runs the plain recipe at stage 3 on 2 and 3 ranks and on a 2x2 mesh;
test_clip_two_optimizers.py the clip's forms.

Tolerance: that of test_zero_muon.py (derived there): AdamW's side within ``TOL`` of torch's,
Muon's within ``MUON_TOL``. The clip adds one coefficient, max_norm / (norm + 1e-6), whose
norm is a sum of squares taken in another order (per optimizer, per rank): a few fp32
roundings, relative, on every gradient: the same size as the averaged gradient's own
rounding that MUON_TOL bounds (a flipped bfloat16 rounding of Newton-Schulz's input), and
far below TOL's 80 fp32 units a step on the AdamW side.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from dist_utils import run_ranks
from test_zero_muon import (
    ADAMW,
    MATRICES,
    MUON,
    TOL,
    MuonNet,
    _compare,
    _compare_momentum,
    _split,
)
from test_zero_parity import _ref_average

import zerokern
from zerokern.zero.interop import optimizer_of
from zerokern.zero.registry import runtime_of_module

MAX_NORM = 0.5
STEPS = 3


def _pair(model):
    muon, rest = _split(model, MATRICES)
    om = zerokern.ZeroOptimizer(muon, torch.optim.Muon, stage=3, bucket_numel=64, **MUON)
    oa = zerokern.ZeroOptimizer(rest, torch.optim.AdamW, stage=3, bucket_numel=64, **ADAMW)
    return om, oa


def _sharded(values):
    model = MuonNet()
    model.load_state_dict(values)
    return zerokern.shard_model(model)


def _iteration(model, om, oa, step, rank, world, ref=False):
    """One training step of the recipe; at step 1 only Muon steps and zero_grads: AdamW's
    gradients accumulate into the next step's, as torch's would."""
    model(step, rank).backward()
    if ref:
        _ref_average(model, world)
    if step == 1:
        om.step()
        om.zero_grad()
        return None
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    for o in (om, oa):
        o.step()
    for o in (om, oa):
        o.zero_grad()
    return float(norm)


def _compare_moments(oa, roa, what):
    full = oa.full_state_dict(rank0_only=False)
    want = roa.state_dict()
    assert set(full["state"]) == set(want["state"]), what
    for i, st in want["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(full["state"][i][k], st[k], rtol=TOL, atol=TOL,
                                       msg=lambda m, k=k, i=i: f"{what}: {k} {i}: {m}")


def _bitwise(a, b, what):
    fa = zerokern.full_state_dict(a, rank0_only=False)
    fb = zerokern.full_state_dict(b, rank0_only=False)
    for k in fa:
        assert torch.equal(fa[k], fb[k]), f"{what}: {k}"


def overlap_refused(rank, world):
    torch.manual_seed(0)
    model = zerokern.shard_model(MuonNet())
    muon, rest = _split(model, MATRICES)
    om = zerokern.ZeroOptimizer(muon, torch.optim.Muon, stage=3, **MUON)
    with pytest.raises(ValueError, match=r"parameter l1\.weight is already trained by a "
                                         r"live ZeroOptimizer"):
        zerokern.ZeroOptimizer(rest + [model.l1.weight], torch.optim.AdamW, stage=3)
    assert optimizer_of(model.l1.weight) is om and optimizer_of(model.l1.bias) is None
    # The host gradient slices of offload="cpu" go through one optimizer's staging.
    with pytest.raises(ValueError, match="offload: another zerokern optimizer trains"):
        zerokern.ZeroAdamW(rest, stage=3, offload="cpu")
    assert optimizer_of(model.l1.bias) is None
    oa = zerokern.ZeroOptimizer(rest[1:], torch.optim.AdamW, stage=3, **ADAMW)
    with pytest.raises(ValueError, match=r"parameter l2\.weight is already trained"):
        oa.add_param_group({"params": [rest[0], model.l2.weight]})
    assert len(oa.param_groups) == 1 and optimizer_of(rest[0]) is None
    assert optimizer_of(model.l2.weight) is om


def replaced_cannot_step(rank, world):
    """A new optimizer over all of an old one's parameters (a resume while the old object
    lives) takes them over: the old one's step is refused, the new one trains."""
    torch.manual_seed(0)
    model = zerokern.shard_model(MuonNet())
    old = zerokern.ZeroAdamW(model.parameters(), stage=3, **ADAMW)
    new = zerokern.ZeroAdamW(model.parameters(), stage=3, **ADAMW)
    model(0, rank).backward()
    before = zerokern.full_state_dict(model, rank0_only=False)
    with pytest.raises(RuntimeError, match="a newer zerokern optimizer was built over all"):
        old.step()
    new.step()
    new.zero_grad()
    after = zerokern.full_state_dict(model, rank0_only=False)
    assert all(not torch.equal(before[k], after[k]) for k in before)
    del old


def recipe_matches_ddp(rank, world, path):
    torch.manual_seed(0)
    base = MuonNet()
    values = base.state_dict()
    model = _sharded(values)
    om, oa = _pair(model)
    ref = copy.deepcopy(base)
    rmuon, rrest = _split(ref, MATRICES)
    rom = torch.optim.Muon(rmuon, **MUON)
    roa = torch.optim.AdamW(rrest, **ADAMW)
    for step in range(STEPS):
        n_ours = _iteration(model, om, oa, step, rank, world)
        n_ref = _iteration(ref, rom, roa, step, rank, world, ref=True)
        if n_ref is not None:
            assert n_ref > MAX_NORM  # the clip fires
            assert math.isclose(n_ours, n_ref, rel_tol=1e-5), (step, n_ours, n_ref)
    what = "stage 3 Muon + AdamW"
    _compare(model, ref, MATRICES, what, exact=False)
    _compare_momentum(om, rom, what, exact=False)
    _compare_moments(oa, roa, what)

    # Round trips: each optimizer's state_dict() into fresh ones, and a checkpoint per
    # optimizer into others; all go on as the original, bit for bit.
    full = zerokern.full_state_dict(model, rank0_only=False)
    m2 = _sharded(full)
    o2m, o2a = _pair(m2)
    o2m.load_state_dict(om.state_dict())
    o2a.load_state_dict(oa.state_dict())
    ck = os.path.join(path, "ck")
    zerokern.save_checkpoint(ck + "-muon", model, om)
    zerokern.save_checkpoint(ck + "-adamw", model, oa)
    torch.manual_seed(1)
    m3 = zerokern.shard_model(MuonNet())  # other weights: the checkpoint brings them
    o3m, o3a = _pair(m3)
    zerokern.load_checkpoint(ck + "-muon", m3, o3m)
    zerokern.load_checkpoint(ck + "-adamw", m3, o3a)
    for m, o_m, o_a in ((model, om, oa), (m2, o2m, o2a), (m3, o3m, o3a)):
        for step in range(STEPS, STEPS + 3):
            _iteration(m, o_m, o_a, step, rank, world)
    _bitwise(m2, model, "state_dict round trip")
    _bitwise(m3, model, "checkpoint round trip")


def bf16_as_one_optimizer(rank, world):
    """bf16 parameters: each optimizer keeps an fp32 master of its pieces. Two ZeroAdamW
    train bit for bit as one with a param group per optimizer (same kernels on the same
    slices); the other optimizer's step must not count as an outside write of the weights
    (its master would be reset to the bf16 values)."""
    torch.manual_seed(0)
    base = MuonNet().to(torch.bfloat16)
    values = base.state_dict()

    def build():
        model = MuonNet().to(torch.bfloat16)
        model.load_state_dict(values)
        return zerokern.shard_model(model)

    two, one = build(), build()
    a_two, b_two = _split(two, MATRICES)
    a_one, b_one = _split(one, MATRICES)
    opts = [zerokern.ZeroAdamW(a_two, stage=3, **ADAMW),
            zerokern.ZeroAdamW(b_two, stage=3, **{**ADAMW, "lr": 0.003})]
    single = zerokern.ZeroAdamW([dict(params=a_one), dict(params=b_one, lr=0.003)],
                                stage=3, **ADAMW)
    for step in range(STEPS):
        if step == 1:  # a micro-batch under no_sync (either optimizer's: one model)
            with opts[1].no_sync(), single.no_sync():
                for m in (two, one):
                    m(10 + step, rank).float().backward()
        for m in (two, one):
            m(step, rank).float().backward()
        for o in opts + [single]:
            o.step()
            o.zero_grad()
    _bitwise(two, one, "bf16, two optimizers vs one with two groups")
    _state_covers_own_elements(two, opts, single)


def _own_pieces(model, params):
    """(elements, runs) of ``params``' pieces in this rank's slices; a run is contiguous there
    (it ends at another parameter's piece or at padding)."""
    mine = {id(p) for p in params}
    own = runs = 0
    end = -1  # slice end of the last own piece
    pieces = runtime_of_module(model).local_pieces()
    for p, _, k, v in sorted(pieces, key=lambda t: t[3].storage_offset()):  # slice order
        if id(p) in mine and k:
            own += k
            runs += v.storage_offset() != end
            end = v.storage_offset() + k
        elif k:
            end = -1
    return own, runs


def _state_covers_own_elements(model, opts, single):
    """Each optimizer's state (fp32 master and two moments, 12 bytes an element) covers
    its own elements in this rank's slices, plus under 8 elements a run of them (each run
    keeps its 16-byte phase; the local space ends on 8): the two together hold about what one
    optimizer over the whole model holds, not twice it. memory_stats() reports the state's
    kinds for the own elements exactly, the rest of its buffers and the slices' padding as
    ``padding``."""
    rt = runtime_of_module(model)
    held = sum(k for _, _, k, _ in rt.local_pieces())
    slice_pad = (rt.local_numel - held) * (2 + 2)  # bf16 parameters and gradients
    locals_, bound = [], 0
    for o in opts:
        own, runs = _own_pieces(model, [p for g in o.param_groups for p in g["params"]])
        ms, n = o.memory_stats(), o.layout.local_numel
        assert own <= n <= own + 7 * (runs + 1), (own, runs, n)
        assert ms["master"] == ms["exp_avg"] == ms["exp_avg_sq"] == 4 * own
        assert ms["padding"] == 12 * (n - own) + slice_pad, (ms["padding"], n, own)
        locals_.append(n)
        bound += 7 * (runs + 1)
    whole = single.layout.local_numel
    assert sum(locals_) <= whole + bound < 2 * whole, (locals_, whole, bound)


def two_optimizers_case(rank, world, path):
    overlap_refused(rank, world)
    replaced_cannot_step(rank, world)
    recipe_matches_ddp(rank, world, path)
    bf16_as_one_optimizer(rank, world)


def test_two_optimizers_on_one_stage3_model(tmp_path):
    run_ranks(2, two_optimizers_case, dict(path=str(tmp_path)), tmp_path=tmp_path,
              kwargs=True)
