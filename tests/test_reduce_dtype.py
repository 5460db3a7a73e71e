"""``ZeroAdamW(reduce_dtype=torch.float32)`` with bf16 parameters (issue 28): gradients reduced
in fp32 and handed to the fused step in fp32, as FSDP2's ``MixedPrecisionPolicy(reduce_dtype=)``.

The reference is the mixed-precision recipe done by hand: a bf16 model's gradients cast to
fp32, all-reduced in fp32 over the world and averaged, then torch.optim.AdamW on fp32 masters
(cast back to bf16). Gradients are multiples of 1/64 with at most 8 significant bits (exact in
bf16), so the fp32 sums are exact in any order: our averaged gradient is the reference's
exactly, and the optimizer states (``full_state_dict``: exp_avg, exp_avg_sq) agree to the
last bits the two AdamW implementations round differently (1e-6 relative), the bf16 parameters
within one ulp. The same run without ``reduce_dtype`` sums in bf16, where a sum of four such
gradients needs up to 10 significant bits: its states are off by ~1e-3 relative, which the
comparison catches (so the test would see fp32 reduction missing). Flat groups and the 2x2
mesh, stages 0-3, on 4 gloo ranks; the memory and traffic it costs under the fake process
group against ``zerokern.formulas``; the refusals.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from fake_pg import each_rank
from models import OddNet
from test_hybrid import ExactGradNet, _mesh

import zerokern
from zerokern import formulas

LR, BETAS, WD = 1e-2, (0.9, 0.95), 0.05


def _reference_step(ref: torch.nn.Module, masters: list[torch.Tensor],
                    ropt: torch.optim.Optimizer, world: int, clip: float) -> float:
    """fp32 reduction of the bf16 gradients, clipping, AdamW on the fp32 masters."""
    params = list(ref.parameters())
    flags = torch.tensor([float(p.grad is not None) for p in params])
    dist.all_reduce(flags)
    for p, m, f in zip(params, masters, flags.tolist()):
        if not p.requires_grad or f == 0:
            m.grad = None
            continue
        g = torch.zeros(p.shape) if p.grad is None else p.grad.float()
        dist.all_reduce(g)
        m.grad = g / world
    norm = torch.nn.utils.clip_grad_norm_([m for m in masters if m.grad is not None], clip)
    ropt.step()
    ropt.zero_grad()
    with torch.no_grad():
        for p, m in zip(params, masters):
            p.copy_(m)
            p.grad = None
    return norm.item()


def _against_reference(rank: int, world: int, stage: int, hybrid: bool) -> None:
    torch.manual_seed(0)
    base = ExactGradNet()
    mesh = _mesh() if hybrid else None
    runs = {}
    for name, reduce_dtype in (("fp32", torch.float32), ("bf16", None)):
        model = copy.deepcopy(base).to(torch.bfloat16)
        if stage == 3:
            model = zerokern.shard_model(model, mesh=mesh)
        opt = zerokern.ZeroAdamW(model.parameters(), stage=stage, mesh=mesh, lr=LR,
                                 betas=BETAS, weight_decay=WD, bucket_numel=300,
                                 max_grad_norm=1e6, reduce_dtype=reduce_dtype)
        runs[name] = (model, opt)
    ref = copy.deepcopy(base).to(torch.bfloat16)
    masters = [p.detach().float().clone().requires_grad_(p.requires_grad)
               for p in ref.parameters()]
    ropt = torch.optim.AdamW([m for m in masters if m.requires_grad], lr=LR, betas=BETAS,
                             weight_decay=WD, foreach=False)
    names = [n for n, p in ref.named_parameters() if p.requires_grad]
    worst_bf16 = 0.0
    for step in range(3):
        for mb in range(2):  # accumulation under no_sync: autograd adds in bf16 everywhere
            for model, opt in runs.values():
                with opt.no_sync() if mb == 0 else _Null():
                    model(2 * step + mb, rank).backward()
            ref(2 * step + mb, rank).backward()
        for _, opt in runs.values():
            opt.step()
            opt.zero_grad()
        norm = _reference_step(ref, masters, ropt, world, 1e6)
        opt = runs["fp32"][1]
        # fp32 sums of squares over ~5,000 elements, in another order: 1e-5 relative
        assert abs(opt.last_grad_norm - norm) <= 1e-5 * norm, (opt.last_grad_norm, norm)
        for run, (_, opt) in runs.items():
            state = opt.full_state_dict(rank0_only=False)["state"]
            for i, name in enumerate(names):
                m = masters[[n for n, _ in ref.named_parameters()].index(name)]
                if m not in ropt.state:
                    continue  # never got a gradient (unused)
                for key in ("exp_avg", "exp_avg_sq"):
                    ours, want = state[i][key], ropt.state[m][key]
                    if run == "fp32":
                        torch.testing.assert_close(ours, want, rtol=1e-6, atol=0,
                                                   msg=lambda s, n=name, k=key: f"{n} {k}: {s}")
                    else:
                        err = ((ours - want).abs() / want.abs().clamp_min(1e-30)).max().item()
                        worst_bf16 = max(worst_bf16, err)
        got = (zerokern.full_state_dict(runs["fp32"][0], rank0_only=False) if stage == 3
               else dict(runs["fp32"][0].named_parameters()))
        for name, p in ref.named_parameters():
            _within_one_ulp(got[name].detach(), p.detach(), f"{name} step {step}")
    # Reduced in bf16 the same states are visibly off: the comparison above would catch it.
    assert worst_bf16 > 1e-4, worst_bf16


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> bool:
        return False


def _within_one_ulp(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    diff = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
    assert bool(((diff <= 1) | (a == b)).all()), f"{what}: more than one ulp apart"


@pytest.mark.parametrize("hybrid", [False, True], ids=["flat", "mesh2x2"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_reduced_in_fp32_matches_fp32_reduction_reference(stage, hybrid, tmp_path):
    run_ranks(4, _against_reference, stage, hybrid, tmp_path=tmp_path)


# -- accounting under the fake process group ---------------------------------------------------
def _accounting(rank: int, world: int, stage: int) -> tuple[int, int]:
    torch.manual_seed(0)
    model = OddNet().to(torch.bfloat16)
    if stage == 3:
        model = zerokern.shard_model(model)
    opt = zerokern.ZeroAdamW(model.parameters(), stage=stage, bucket_numel=97,
                             reduce_dtype=torch.float32)
    planned = opt.memory_stats() if stage < 3 else None
    for step in range(2):
        x = torch.randint(0, 37, (4, 5), generator=torch.Generator().manual_seed(step + rank))
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    ms = opt.memory_stats()
    if planned is not None:  # what memory_stats() said before the first step (the receive
        # buffers of gloo's point-to-point reduce-scatter are measured, not planned)
        same = ("params", "grads", "master", "exp_avg", "exp_avg_sq", "buckets", "padding",
                "arena_in_use", "arena_capacity")
        assert {k: planned[k] for k in same} == {k: ms[k] for k in same}, (planned, ms)
    L = opt.layout
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad) if stage < 3 else 0
    local = sum(pc.numel for pc in L.pieces if pc.param >= 0)
    # Stage 3: the gradient slices cover this rank's whole slice of every unit (frozen
    # parameters' pieces too), whatever the optimizer's own (compact) layout holds.
    held = (sum(sp.numel for u in zerokern.zero.shard.runtime_of(model).units
                for sp in u.plan.rank_pieces(rank)) if stage == 3 else 0)
    grads = {0: 2 * psi + 4 * psi, 1: 2 * psi + 4 * local, 2: 4 * local, 3: 4 * held}[stage]
    assert ms["grads"] == grads, (stage, ms["grads"], grads)
    cs = opt.comm_stats()
    if world > 1:  # gradients travel in fp32 (4 bytes), parameters in bf16
        moved = (L.flat_numel if stage < 3 else
                 sum(u.plan.padded_numel for u in zerokern.zero.shard.runtime_of(model).units))
        kind, factor = ("all_reduce", 2) if stage == 0 else ("reduce_scatter", 1)
        assert cs["per_kind"][kind]["bytes"] == 4 * factor * moved
        want = formulas.hybrid_comm_bytes(stage, moved, world, 1, 2, 4)
        assert cs["per_dim"]["shard"]["bytes"] == want["shard"], (cs, want)
    states = sum(ms[k] for k in ("params", "grads", "master", "exp_avg", "exp_avg_sq"))
    return local, states


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_memory_and_comm_formulas_with_reduce_dtype(stage):
    world = 3
    ranks = each_rank(world, lambda r, w: _accounting(r, w, stage))
    psi = sum(p.numel() for p in OddNet().parameters() if p.requires_grad)
    rep, sh = formulas.coefficients(stage, 2, 12, reduce_bytes=4)
    assert sum(b for _, b in ranks) == world * rep * psi + sh * psi
    assert formulas.expected_model_state_bytes(stage, 12, 3, 2, reduce_bytes=4) == \
        rep * 12 + sh * 12 / 3


def test_stage3_reduce_dtype_accounting():
    ranks = each_rank(2, lambda r, w: _accounting(r, w, 3))
    assert len(ranks) == 2


# -- refusals and no-ops -----------------------------------------------------------------------
def test_refusals():
    model = OddNet().to(torch.bfloat16)
    with pytest.raises(ValueError, match="reduce_dtype must be None or torch.float32"):
        zerokern.ZeroAdamW(model.parameters(), reduce_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="reduce_dtype must be None or torch.float32"):
        zerokern.ZeroAdamW(model.parameters(), reduce_dtype="fp32")
    with pytest.raises(ValueError, match="reduce_dtype=torch.float32 with offload"):
        zerokern.ZeroAdamW(model.parameters(), stage=2, offload="cpu",
                           reduce_dtype=torch.float32)


def test_second_stage3_optimizer_must_reduce_alike():
    model = zerokern.shard_model(OddNet().to(torch.bfloat16))
    params = list(model.parameters())
    zerokern.ZeroAdamW(params[:3], stage=3, reduce_dtype=torch.float32)
    with pytest.raises(ValueError, match="reduce_dtype: another ZeroAdamW"):
        zerokern.ZeroAdamW(params[3:], stage=3)


def test_fp32_parameters_reduce_dtype_is_a_no_op():
    torch.manual_seed(0)
    a, b = OddNet(), OddNet()
    b.load_state_dict(a.state_dict())
    oa = zerokern.ZeroAdamW(a.parameters(), stage=2, reduce_dtype=torch.float32)
    ob = zerokern.ZeroAdamW(b.parameters(), stage=2)
    x = torch.randint(0, 37, (4, 5), generator=torch.Generator().manual_seed(0))
    for model, opt in ((a, oa), (b, ob)):
        model(x).square().mean().backward()
        opt.step()
    assert oa.memory_stats() == ob.memory_stats()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
