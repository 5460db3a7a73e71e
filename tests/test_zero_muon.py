"""torch's Muon recipe under ZeRO: ``ZeroOptimizer(matrices, torch.optim.Muon, stage=s)`` next to
``ZeroOptimizer(rest, torch.optim.AdamW, stage=s)`` on one model, at stages 0-3, against
DDP-style averaging + ``torch.optim.Muon`` + ``torch.optim.AdamW`` (parameters and momentum).

Tolerance. Muon's step of a matrix is element-wise except for Newton-Schulz (NS), which torch
runs in bfloat16 on the whole matrix: ours runs the element-wise lines on each rank's flat
slices (on the CPU the same bits as on the whole matrix: ``lerp_``, ``mul_``, ``add_`` are
evaluated element by element) and NS once on the owner, on the same fp32 input, batched
(bitwise equal to torch's per-matrix NS on the CPU: tests/test_muon_update.py). So the only
difference can come from the averaged gradient: on 2 ranks it is one addition, the same in any
order, and the Muon side must agree BIT FOR BIT (asserted). On 3 ranks the sum's order may differ
by one fp32 rounding (U = 2**-24 relative), which can flip the bfloat16 rounding of an element of
NS's input, i.e. move it by one bfloat16 unit (U_BF16 = 2**-8 relative). NS's output has spectral
norm at most about 1.2 (every entry at most that), and a flipped input rounding moves its entries
by a few bfloat16 units of that size; bound it by 8 units: |dO| <= 8 * U_BF16 * 1.2 per step.
A parameter moves by adjusted_lr * dO per step, adjusted_lr <= lr * sqrt(max(1, rows / cols)),
and its change feeds back into the next gradients through the model by a factor of order 1: so
``MUON_TOL = STEPS * LR * sqrt(rows/cols max) * 8 * 1.2 * U_BF16`` absolute, on parameters and
momentum (about 2.5e-3 here). The AdamW side runs zerokern's fused AdamW: test_zero_optimizer's
``TOL``.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.distributed as dist
from _tol import U_BF16
from dist_utils import run_ranks
from test_zero_optimizer import TOL
from test_zero_parity import _ref_average
from torch import nn

import zerokern
from zerokern import formulas
from zerokern.zero import muon_step
from zerokern.zero.registry import runtime_of_module

STEPS = 3
LR = 0.02
MUON = dict(lr=LR, momentum=0.9, weight_decay=0.05)
ADAMW = dict(lr=0.01, weight_decay=0.01)
BUCKET = 64  # elements: the 480-element matrix spans several buckets
MUON_TOL = STEPS * LR * math.sqrt(40 / 12) * 8 * 1.2 * U_BF16


class MuonNet(nn.Module):
    """Embeddings, norms and biases (AdamW) around 2-D hidden matrices of odd shapes (Muon):
    tall, square (two of one shape: one NS batch), wide, and one larger than a bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.l1 = nn.Linear(8, 12)
        self.l2 = nn.Linear(12, 12)
        self.l3 = nn.Linear(12, 12)
        self.norm = nn.LayerNorm(12)
        self.big = nn.Linear(12, 40, bias=False)
        self.head = nn.Linear(40, 5)

    def forward(self, step: int, rank: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, 11, (6, 3), generator=g)
        target = torch.randint(0, 5, (6,), generator=g)
        x = self.emb(tokens).mean(1)
        x = torch.tanh(self.l1(x))
        x = torch.tanh(self.l2(x))
        x = self.norm(self.l3(x))
        x = torch.nn.functional.gelu(self.big(x))
        return torch.nn.functional.cross_entropy(self.head(x), target)


def _split(model, matrices):
    muon = [p for n, p in model.named_parameters() if n in matrices]
    rest = [p for n, p in model.named_parameters() if n not in matrices]
    return muon, rest


def _build(base, stage, matrices, nesterov=True, rest_cls=torch.optim.AdamW, mesh=None,
           offload=None):
    # Stage 3: both optimizers over one sharded model (stage3/owners.py).
    model = copy.deepcopy(base)
    if stage == 3:
        model = zerokern.shard_model(model, mesh=mesh)
    muon, rest = _split(model, matrices)
    kw = {} if mesh is None else {"mesh": mesh}
    om = zerokern.ZeroOptimizer(muon, torch.optim.Muon, stage=stage, bucket_numel=BUCKET,
                                nesterov=nesterov, offload=offload, **kw, **MUON)
    oa = zerokern.ZeroOptimizer(rest, rest_cls, stage=stage, bucket_numel=BUCKET, **kw,
                                offload=offload, **ADAMW)
    return model, om, oa


def _train(model, opts, world, rank, start, steps, ref=False):
    for step in range(start, start + steps):
        model(step, rank).backward()
        if ref:
            _ref_average(model, world)
        for o in opts:
            if o is not None:
                o.step()
        for o in opts:
            if o is not None:
                o.zero_grad()


def _full(model):
    if runtime_of_module(model) is not None:
        return zerokern.full_state_dict(model, rank0_only=False)
    return {n: p.detach() for n, p in model.named_parameters()}


def _compare(model, ref, matrices, what, exact):
    full = _full(model)
    for name, b in ref.named_parameters():
        a, b = full[name].detach(), b.detach()
        if exact:
            assert torch.equal(a, b), f"{what}: {name}: {(a - b).abs().max()}"
        elif name not in matrices:
            torch.testing.assert_close(a, b, rtol=TOL, atol=TOL,
                                       msg=lambda m, w=f"{what}: {name}": f"{w}: {m}")
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=MUON_TOL, msg=f"{what}: {name}")


def _compare_momentum(om, rom, what, exact):
    full = om.full_state_dict(rank0_only=False)
    want = rom.state_dict()
    assert set(full["state"]) == set(want["state"]), what
    for i, st in want["state"].items():
        assert set(full["state"][i]) == {"momentum_buffer"}, (what, full["state"][i].keys())
        a, b = full["state"][i]["momentum_buffer"], st["momentum_buffer"]
        if exact:
            assert torch.equal(a, b), f"{what}: momentum {i}: {(a - b).abs().max()}"
        else:
            torch.testing.assert_close(a, b, rtol=TOL, atol=MUON_TOL,
                                       msg=f"{what}: momentum {i}")


def _reference(base, matrices, nesterov=True, rest_cls=torch.optim.AdamW):
    ref = copy.deepcopy(base)
    muon, rest = _split(ref, matrices)
    rom = torch.optim.Muon(muon, nesterov=nesterov, **MUON)
    return ref, rom, rest_cls(rest, **ADAMW)


MATRICES = ("l1.weight", "l2.weight", "l3.weight", "big.weight", "head.weight")


def parity_case(rank, world, *, stages, matrices, path):
    torch.manual_seed(0)
    base = MuonNet()
    for stage in stages:
        # The recipe (AdamW: zerokern's fused kernels, within TOL of torch's, which the Muon
        # side sees through the gradients: MUON_TOL); and with torch's own Adam step for the
        # rest, where on 2 ranks every operation is torch's on the same numbers: bit for bit.
        # With offload="cpu" (stages 2-3) the momentum and the element-wise lines are on the
        # host, the exchange and Newton-Schulz on the device: the same operations, so the
        # same bits.
        variants = [(True, torch.optim.AdamW, False, None)]
        if stage in (1, 3) and world == 2:
            variants.append((False, torch.optim.Adam, world == 2, None))
        if stage == 2 and world == 2:
            # Offload next to another optimizer of one stage-3 model is refused (owners.py).
            variants.append((True, torch.optim.Adam, True, "cpu"))
        for nesterov, rest_cls, exact, offload in variants:
            what = (f"world {world} stage {stage} nesterov {nesterov} {rest_cls.__name__} "
                    f"offload {offload}")
            model, om, oa = _build(base, stage, matrices, nesterov, rest_cls, offload=offload)
            if offload:
                assert om.memory_stats()["host_momentum_buffer"] > 0, what
            ref, rom, roa = _reference(base, matrices, nesterov, rest_cls)
            _train(model, (om, oa), world, rank, 0, STEPS)
            _train(ref, (rom, roa), world, rank, 0, STEPS, ref=True)
            _compare(model, ref, matrices, what, exact)
            _compare_momentum(om, rom, what, exact)
            if stage in (1, 2) and nesterov and not offload:
                _exchange_counted(model, om, oa, world, rank)
            if exact and stage == 1:
                _round_trips(base, model, om, oa, ref, rom, roa, matrices, world, rank, path,
                             rest_cls)


def _exchange_counted(model, om, oa, world, rank):
    """One more step: Newton-Schulz runs on exactly the matrices this rank owns, once each;
    comm_stats() holds the stage's own reduce-scatter and all-gather of the flat space plus
    the owner exchange's two all-to-alls of exactly the elements that change rank
    (formulas.muon_shard_exchange_elements, from every rank's shard pieces): updates in
    fp32 to the owners, orthogonalized updates in bfloat16 back."""
    plan = om._rule_state.plan
    seen = []
    ns = muon_step._ns
    muon_step._ns = lambda stack, key: (seen.append(stack.numel()), ns(stack, key))[1]
    try:
        _train(model, (om, oa), world, rank, 100, 1)
    finally:
        muon_step._ns = ns
    assert sum(seen) == plan.owned_numel[rank], (seen, plan.owned_numel)
    held = [[0] * world for _ in range(world)]
    rows = [None] * world
    dist.all_gather_object(rows, [(pc.param, pc.numel) for pc in om.layout.pieces
                                  if pc.param >= 0])
    for r, row in enumerate(rows):
        for param, numel in row:
            held[r][plan.units[param].owner] += numel
    assert [sum(h[o] for h in held) for o in range(world)] == list(plan.owned_numel)
    want = formulas.muon_shard_exchange_elements(held, rank)
    kinds = om.comm_stats()["per_kind"]
    flat = om.layout.flat_numel
    assert kinds["reduce_scatter"]["elements"] == flat, kinds
    assert kinds["all_gather"]["elements"] == flat, kinds
    a2a = kinds["all_to_all"]
    assert a2a["elements"] == a2a["wire_elements"] == want["all_to_all"], (kinds, want)
    assert a2a["bytes"] == 4 * want["to_owners"] + 2 * want["from_owners"], (kinds, want)


def _round_trips(base, model, om, oa, ref, rom, roa, matrices, world, rank, path, rest_cls):
    """After STEPS steps at stage 1: this rank's state dict into a fresh optimizer, torch's
    Muon state dict into ours (stage 0) and ours into torch's, a checkpoint loaded at stage
    2: all train on STEPS more steps bit for bit as the reference does (2 ranks, torch's
    own Adam for the rest: every operation the same on the same numbers)."""
    kw = dict(nesterov=False, rest_cls=rest_cls)
    sd = om.state_dict()
    m5, o5, a5 = _build(model, 1, matrices, **kw)
    o5.load_state_dict(sd)
    a5.load_state_dict(oa.state_dict())
    m3, o3, a3 = _build(ref, 0, matrices, **kw)
    o3.load_state_dict(rom.state_dict())
    a3.load_state_dict(roa.state_dict())
    r2, r2m, r2a = _reference(ref, matrices, **kw)
    r2m.load_state_dict(om.full_state_dict(rank0_only=False))
    r2a.load_state_dict(copy.deepcopy(roa.state_dict()))  # torch would share the tensors
    _save(os.path.join(path, "ck"), model, om, oa)
    m4, o4, a4 = _build(base, 2, matrices, **kw)
    _load(os.path.join(path, "ck"), m4, o4, a4)
    _train(ref, (rom, roa), world, rank, STEPS, STEPS, ref=True)
    _train(r2, (r2m, r2a), world, rank, STEPS, STEPS, ref=True)
    _compare(r2, ref, matrices, "ours -> torch", True)
    for m, o, a, label in ((m5, o5, a5, "state_dict"), (m3, o3, a3, "torch -> ours"),
                           (m4, o4, a4, "checkpoint")):
        _train(m, (o, a), world, rank, STEPS, STEPS)
        _compare(m, ref, matrices, label, True)
    dist.barrier()


def _save(path, model, om, oa):
    # One optimizer per checkpoint directory: the model is written with each.
    zerokern.save_checkpoint(path + "-muon", model, om)
    zerokern.save_checkpoint(path + "-adamw", model, oa)


def _load(path, model, om, oa):
    zerokern.load_checkpoint(path + "-muon", model, om)
    zerokern.load_checkpoint(path + "-adamw", model, oa)


def test_muon_and_adamw_match_ddp_at_every_stage(tmp_path):
    run_ranks(2, parity_case, dict(stages=(0, 1, 2, 3), matrices=MATRICES, path=str(tmp_path)),
              tmp_path=tmp_path, kwargs=True)


def test_three_ranks_more_ranks_than_matrices(tmp_path):
    # Two matrices over three ranks: one rank owns none (its segment is all padding).
    run_ranks(3, parity_case, dict(stages=(1, 3), matrices=("l2.weight", "big.weight"),
                                   path=str(tmp_path)), tmp_path=tmp_path, kwargs=True)


def mesh_case(rank, world):
    """A 2x2 mesh (hybrid sharding): owners within each shard group, replicas alike."""
    from test_hybrid import _mesh

    torch.manual_seed(0)
    base = MuonNet()
    for stage in (0, 2, 3):
        model, om, oa = _build(base, stage, MATRICES, mesh=_mesh())
        assert om._rule_state.plan.world_size == 2  # the shard group's
        ref, rom, roa = _reference(base, MATRICES)
        _train(model, (om, oa), world, rank, 0, STEPS)
        _train(ref, (rom, roa), world, rank, 0, STEPS, ref=True)
        _compare(model, ref, MATRICES, f"mesh stage {stage}", False)
        _compare_momentum(om, rom, f"mesh stage {stage}", False)


def test_two_d_mesh(tmp_path):
    # 4 ranks: the pool test_zero_optimizer's mesh case forms is reused in one session.
    run_ranks(4, mesh_case, tmp_path=tmp_path)


def save_case(rank, world, *, path):
    torch.manual_seed(0)
    base = MuonNet()
    model, om, oa = _build(base, 2, MATRICES, rest_cls=torch.optim.Adam)
    _train(model, (om, oa), world, rank, 0, STEPS)
    _save(os.path.join(path, "ck"), model, om, oa)
    full = om.full_state_dict(rank0_only=False)  # a collective
    if rank == 0:
        torch.save(_full(model), os.path.join(path, "..", "params.pt"))
        torch.save(full, os.path.join(path, "..", "muon.pt"))


def test_checkpoint_at_two_ranks_loads_at_one(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    run_ranks(2, save_case, dict(path=str(ck)), tmp_path=tmp_path, kwargs=True)
    torch.manual_seed(0)
    # torch's own Adam for the rest: the resumed step is torch's, bit for bit
    model, om, oa = _build(MuonNet(), 1, MATRICES, rest_cls=torch.optim.Adam)
    _load(str(ck / "ck"), model, om, oa)
    want = torch.load(tmp_path / "params.pt")
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), want[n]), n
    got, saved = om.full_state_dict(), torch.load(tmp_path / "muon.pt")
    for i, st in saved["state"].items():
        assert torch.equal(got["state"][i]["momentum_buffer"], st["momentum_buffer"]), i
    # and it trains on, as one process with torch's Muon from the same state would
    ref, rom, roa = _reference(model, MATRICES, rest_cls=torch.optim.Adam)
    rom.load_state_dict(got)
    roa.load_state_dict(oa.full_state_dict())
    _train(model, (om, oa), 1, 0, STEPS, 1)
    _train(ref, (rom, roa), 1, 0, STEPS, 1)
    _compare(model, ref, MATRICES, "resumed at world 1", True)


def test_non_matrix_is_refused_with_torchs_error():
    model = MuonNet()
    bias = model.l1.bias
    with pytest.raises(ValueError, match=r"Muon only supports 2D parameters whereas we found "
                                         r"a parameter with size: torch.Size\(\[12\]\)"):
        zerokern.ZeroOptimizer([model.l1.weight, bias], torch.optim.Muon, stage=1)
    with pytest.raises(ValueError, match="momentum should be >= 0"):
        zerokern.ZeroOptimizer([model.l1.weight], torch.optim.Muon, stage=1, momentum=-1.0)
    with pytest.raises(ValueError, match="Adjust learning rate function nope"):
        zerokern.ZeroOptimizer([model.l1.weight], torch.optim.Muon, stage=1,
                               adjust_lr_fn="nope")
    with pytest.raises(ValueError, match="Number of steps must be less than 100"):
        zerokern.ZeroOptimizer([model.l1.weight], torch.optim.Muon, stage=1, ns_steps=100)
    assert model.l1.weight.grad is None
    # a group added later: the same refusal, nothing added
    opt = zerokern.ZeroOptimizer([model.l1.weight], torch.optim.Muon, stage=1)
    with pytest.raises(ValueError, match=r"\(param group 1\): Muon only supports 2D"):
        opt.add_param_group({"params": [model.l2.bias]})
    assert len(opt.param_groups) == 1
    # stage 3: the full shape is checked, not the released placeholder's
    sharded = zerokern.shard_model(MuonNet())
    with pytest.raises(ValueError, match=r"Muon only supports 2D.*torch.Size\(\[12\]\)"):
        zerokern.ZeroOptimizer([sharded.l1.weight, sharded.l1.bias], torch.optim.Muon,
                               stage=3)
