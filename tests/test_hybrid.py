"""Hybrid sharding on a 2-D mesh (issue 28): ``ZeroAdamW(mesh=)`` / ``shard_model(mesh=)`` on 4
gloo ranks as 2 replicas x 2 ranks per shard group, ``init_device_mesh("cpu", (2, 2))``.

- Against DDP + torch.optim.AdamW (fp32, stages 0-3, clipping, unused and sometimes-used
  parameters): within 1e-6 relative. Not bitwise, because the summation order differs: DDP's
  all-reduce adds the four ranks' gradients in one ring over the world, the mesh adds the two
  ranks of a shard group in its reduce-scatter and then the two replicas' sums, and fp32
  addition is not associative; the global norm's squares are also summed per shard piece.
- Against the flat run over the same 4 ranks (``process_group`` = world): bitwise, for every
  stage, fp32 and bf16, with and without ``reduce_dtype=float32``, with gradient accumulation
  under ``no_sync`` and without it, and with int8 moments / no master (issue 27). The
  reduction order is made irrelevant instead of equal: every gradient is a multiple of 1/64
  below 4 in magnitude, so every sum of up to 8 of them is exact in fp32 (and the bf16 runs
  reduce in fp32) in any order, and the average divides by 4, a power of two, in both.
- ``last_grad_norm`` and the parameters are the same bits on every rank of the mesh.
- Mesh mistakes (a 3-D mesh, a mesh that differs between processes, dims that do not cover the
  world, a mesh with process_group, not a DeviceMesh) raise ValueError naming ``mesh`` on
  every rank, before the model or anything else changed.

The accounting (``memory_stats()`` with N = S, ``comm_stats()`` per mesh dim against
``zerokern.formulas``) needs no collective's result: it runs each rank in turn under the fake
process group (tests/fake_pg.py), for meshes 2x2, 1x4, 4x1 and 2x4.

The 2x2 mesh is built once per rank process and kept (the rank pool lives across tests):
building one creates process groups, a collective of every rank.
"""

from __future__ import annotations

import copy
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_ranks
from fake_pg import each_rank
from models import Block, OddNet, TinyGPT, batch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import zerokern
from zerokern import formulas
from zerokern.zero.registry import runtime_of_module

_MESHES: dict[str, DeviceMesh] = {}


def _mesh() -> DeviceMesh:
    """This rank's 2x2 mesh (dims named as FSDP2's HSDP examples name them)."""
    if "2x2" not in _MESHES:
        _MESHES["2x2"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return _MESHES["2x2"]


class ExactGradNet(nn.Module):
    """Loss linear in every parameter with coefficients k/64, |k| <= 255: every gradient is a
    multiple of 1/64 with at most 8 significant bits (exact in bf16), so sums of a few of them
    are exact in fp32 in any order. One parameter is large enough for int8 moments (4,096
    elements or more); one is unused, one used on alternate steps, one frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(37, 13))
        self.big = nn.Parameter(torch.randn(65, 67))
        self.b = nn.Parameter(torch.randn(29))
        self.d = nn.Parameter(torch.randn(7))
        self.unused = nn.Parameter(torch.randn(5, 3))
        self.frozen = nn.Parameter(torch.randn(11), requires_grad=False)

    def forward(self, step: int, rank: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(7919 * step + rank)
        loss = torch.zeros((), dtype=torch.float32)
        for name in ("a", "big", "b", "d"):
            if name == "d" and step % 2:
                continue
            p = getattr(self, name)
            coef = torch.randint(-255, 256, p.shape, generator=g).to(p.dtype) / 64
            loss = loss + (p * coef).sum().float()
        return loss


def _build(base: nn.Module, stage: int, dtype: torch.dtype, *, mesh: DeviceMesh | None,
           **kw) -> tuple[nn.Module, zerokern.ZeroAdamW]:
    model = copy.deepcopy(base).to(dtype)
    if stage == 3:
        model = zerokern.shard_model(model, mesh=mesh,
                                     unit_classes=(Block,) if isinstance(base, TinyGPT)
                                     else None)
    opt = zerokern.ZeroAdamW(model.parameters(), stage=stage, mesh=mesh, lr=1e-2,
                             betas=(0.9, 0.95), weight_decay=0.05, **kw)
    return model, opt


def _full(model: nn.Module, stage: int) -> dict[str, torch.Tensor]:
    if stage == 3:
        return zerokern.full_state_dict(model, rank0_only=False)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same_on_every_rank(value: torch.Tensor, what: str) -> None:
    """Every rank of the world holds the same bits."""
    got = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(got, value)
    for r, g in enumerate(got):
        assert torch.equal(g.view(torch.uint8), value.view(torch.uint8)), f"{what}: rank {r}"


# -- against DDP + torch AdamW -----------------------------------------------------------------
def _ddp_parity(rank: int, world: int, stage: int) -> None:
    torch.manual_seed(0)
    gpt = stage == 3
    base = TinyGPT() if gpt else OddNet()
    ours, opt = _build(base, stage, torch.float32, mesh=_mesh(), bucket_numel=61,
                       max_grad_norm=0.5)
    ref = copy.deepcopy(base)
    ddp = nn.parallel.DistributedDataParallel(ref, find_unused_parameters=not gpt)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.05,
                             foreach=False)
    for step in range(5):
        for mb in range(2):  # accumulation: no_sync on the first micro-batch of both
            x, y = batch(2 * step + mb, rank, out=37 if gpt else 7)
            with opt.no_sync() if mb == 0 else _null(), ddp.no_sync() if mb == 0 else _null():
                out = ours(x) if gpt else ours(x, step % 2 == 0)
                F.cross_entropy(out, y).backward()
                out_r = ddp(x) if gpt else ddp(x, step % 2 == 0)
                F.cross_entropy(out_r, y).backward()
        norm = nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], 0.5)
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
        assert abs(opt.last_grad_norm - norm.item()) <= 1e-6 * norm.item()
        _same_on_every_rank(torch.tensor([opt.last_grad_norm], dtype=torch.float64), "norm")
    got = _full(ours, stage)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-6, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")
        _same_on_every_rank(got[name], name)
    if not gpt:  # never used on any rank: left as it was
        assert torch.equal(ours.unused.weight, base.unused.weight)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> bool:
        return False


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_hybrid_matches_ddp_adamw(stage, tmp_path):
    run_ranks(4, _ddp_parity, stage, tmp_path=tmp_path)


# -- against the flat run, bitwise -------------------------------------------------------------
def _flat_parity(rank: int, world: int, stage: int, dtype: torch.dtype,
                 kw: dict) -> None:
    torch.manual_seed(0)
    base = ExactGradNet()
    hyb, hopt = _build(base, stage, dtype, mesh=_mesh(), bucket_numel=300, **kw)
    flat, fopt = _build(base, stage, dtype, mesh=None, bucket_numel=300, **kw)
    assert (hopt.comm.world_size, hopt.comm.replicate.world_size) == (2, 2)
    assert fopt.comm.world_size == 4 and fopt.comm.replicate is None
    for step in range(4):
        no_sync = step < 2  # then accumulation without it: two reductions in the step
        for mb in range(2):
            for model, opt in ((hyb, hopt), (flat, fopt)):
                with opt.no_sync() if no_sync and mb == 0 else _null():
                    model(2 * step + mb, rank).backward()
        hopt.step()
        fopt.step()
        hopt.zero_grad()
        fopt.zero_grad()
        h, f = _full(hyb, stage), _full(flat, stage)
        for name in f:
            assert torch.equal(h[name].view(torch.uint8), f[name].view(torch.uint8)), \
                f"{name} differs at step {step}"
            _same_on_every_rank(h[name], name)
    assert not torch.equal(h["a"], base.a.to(dtype))  # it trained
    assert torch.equal(h["unused"], base.unused.to(dtype))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_hybrid_bitwise_equal_to_flat_fp32(stage, tmp_path):
    run_ranks(4, _flat_parity, stage, torch.float32, {}, tmp_path=tmp_path)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_hybrid_bitwise_equal_to_flat_bf16_reduce_fp32(stage, tmp_path):
    run_ranks(4, _flat_parity, stage, torch.bfloat16, {"reduce_dtype": torch.float32},
              tmp_path=tmp_path)


@pytest.mark.parametrize("stage", [2, 3])
def test_hybrid_compressed_state_bitwise_equal_to_flat(stage, tmp_path):
    # int8 moments with no master: blocks of each parameter and stochastic rounding keyed by
    # the element's index in its parameter, whatever the layout cuts (issue 27). Reduced in
    # fp32: bf16 sums of the four ranks' gradients would round differently by order.
    run_ranks(4, _flat_parity, stage, torch.bfloat16,
              {"moments": "int8", "master": "none", "reduce_dtype": torch.float32},
              tmp_path=tmp_path)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_offload_bitwise_equal_to_flat(stage, tmp_path):
    # ZeRO-Offload: the slices summed across replicas are what lands in host memory (stage 1:
    # once, at the step, after the replicate all-reduce of the own slices).
    run_ranks(4, _flat_parity, stage, torch.float32, {"offload": "cpu"}, tmp_path=tmp_path)


# -- mesh mistakes -----------------------------------------------------------------------------
def _refusals(rank: int, world: int) -> None:
    good = _mesh()
    flipped = DeviceMesh("cpu", [[0, 2], [1, 3]], _init_backend=False)
    three = DeviceMesh("cpu", [[[0, 1], [2, 3]]], _init_backend=False)
    short = DeviceMesh("cpu", [[0], [1], [2]], _init_backend=False)  # 3 x 1 in a world of 4
    cases = [
        (three, None, "3 dims"),
        (flipped if rank == 3 else good, None, "differs across processes"),
        (short, None, "multiply to the world size"),
        (good, dist.group.WORLD, "process_group were both given"),
        ((2, 2), None, "must be a torch.distributed.device_mesh.DeviceMesh"),
    ]
    for mesh, pg, words in cases:
        torch.manual_seed(0)
        model = OddNet()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for call in (zerokern.ZeroAdamW, zerokern.shard_model):
            try:
                if call is zerokern.ZeroAdamW:
                    call(model.parameters(), stage=2, mesh=mesh, process_group=pg)
                else:
                    call(model, mesh=mesh, process_group=pg)
            except ValueError as exc:
                assert "mesh" in str(exc) and words in str(exc), str(exc)
            else:
                raise AssertionError(f"{words}: not refused on rank {rank}")
            # nothing changed: not sharded, not registered, the same values
            assert runtime_of_module(model) is None
            for n, p in model.named_parameters():
                assert torch.equal(p.detach(), before[n]), n
    # stage 3: the optimizer's mesh must be the model's
    model = zerokern.shard_model(OddNet(), mesh=good)
    other = DeviceMesh("cpu", [[0, 1, 2, 3]], _init_backend=False)
    with pytest.raises(ValueError, match="mesh .* is not the one the model was sharded over"):
        zerokern.ZeroAdamW(model.parameters(), stage=3, mesh=other)
    zerokern.ZeroAdamW(model.parameters(), stage=3, mesh=good)  # the same one: accepted


def test_mesh_mistakes_raise_on_every_rank(tmp_path):
    run_ranks(4, _refusals, tmp_path=tmp_path)


def test_one_dim_mesh_is_its_group(tmp_path):
    run_ranks(4, _one_dim, tmp_path=tmp_path)


def _one_dim(rank: int, world: int) -> None:
    if "1d" not in _MESHES:
        _MESHES["1d"] = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    base = ExactGradNet()
    a, aopt = _build(base, 2, torch.float32, mesh=_MESHES["1d"])
    b, bopt = _build(base, 2, torch.float32, mesh=None)
    assert aopt.comm.world_size == 4 and aopt.comm.replicate is None
    for step in range(2):
        a(step, rank).backward()
        b(step, rank).backward()
        aopt.step()
        bopt.step()
        aopt.zero_grad()
        bopt.zero_grad()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert aopt.comm_stats()["per_dim"]["replicate"]["elements"] == 0


def _parallelize(rank: int, world: int) -> None:
    torch.manual_seed(0)
    base = ExactGradNet()
    for stage in (2, 3):
        by_hand, hopt = _build(base, stage, torch.float32, mesh=_mesh())
        model = copy.deepcopy(base)
        opt = zerokern.parallelize(model, stage=stage, mesh=_mesh(), lr=1e-2,
                                   betas=(0.9, 0.95), weight_decay=0.05)
        assert (opt.comm.world_size, opt.comm.replicate.world_size) == (2, 2)
        for m, o in ((by_hand, hopt), (model, opt)):
            m(0, rank).backward()
            o.step()
        a, b = _full(by_hand, stage), _full(model, stage)
        assert all(torch.equal(a[n], b[n]) for n in a)


def test_parallelize_passes_the_mesh(tmp_path):
    run_ranks(4, _parallelize, tmp_path=tmp_path)


# -- accounting, each rank in turn under the fake process group ---------------------------------
def _accounting(rank: int, world: int, shape: tuple[int, int], stage: int,
                reduce: bool) -> tuple[int, int, int]:
    mesh = init_device_mesh("cpu", shape)
    r_size, s_size = shape
    torch.manual_seed(0)
    base = TinyGPT() if stage == 3 else OddNet()
    model, opt = _build(base, stage, torch.bfloat16, mesh=mesh, bucket_numel=97,
                        reduce_dtype=torch.float32 if reduce else None)
    assert (opt.comm.world_size, opt.comm.rank) == (s_size, rank % s_size)
    for step in range(2):
        x, y = batch(step, rank, out=37 if stage == 3 else 7)
        F.cross_entropy(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
    e, g = 2, 4 if reduce else 2
    L = opt.layout
    if stage == 3:
        moved = sum(u.plan.padded_numel for u in runtime_of_module(model).units)
    else:
        moved = L.flat_numel
    # comm_stats per mesh dim == the formulas (elements as the paper counts, what each link
    # carries, bytes with the gradients in the reduce dtype)
    cs = opt.comm_stats()
    for key, fn in (("elements", formulas.hybrid_comm_elements),
                    ("wire_elements", formulas.hybrid_wire_elements)):
        want = fn(stage, moved, s_size, r_size)
        assert {d: cs["per_dim"][d][key] for d in formulas.MESH_DIMS} == want, (key, cs, want)
    want = formulas.hybrid_comm_bytes(stage, moved, s_size, r_size, e, g)
    assert {d: cs["per_dim"][d]["bytes"] for d in formulas.MESH_DIMS} == want, (cs, want)
    assert cs["elements"] == sum(formulas.hybrid_comm_elements(stage, moved, s_size,
                                                               r_size).values())
    # memory_stats: the kinds this rank holds (N = S: replicas hold the same)
    ms = opt.memory_stats()
    psi = sum(p.numel() for p in base.parameters() if p.requires_grad)
    local = sum(pc.numel for pc in L.pieces if pc.param >= 0)
    held = sum(pc.numel for pc in L.pieces)
    full = psi if stage < 3 else held
    grads = {0: (e + (g if reduce else 0)) * psi, 1: e * psi + (g * local if reduce else 0),
             2: g * local, 3: g * held}[stage]
    assert ms["params"] == e * full and ms["grads"] == grads, (ms, grads)
    assert ms["master"] == ms["exp_avg"] == ms["exp_avg_sq"] == 4 * local
    states = sum(ms[k] for k in ("params", "grads", "master", "exp_avg", "exp_avg_sq"))
    return local, states, psi


@pytest.mark.parametrize("reduce", [False, True], ids=["bf16", "reduce_fp32"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_and_comm_stats_match_formulas_2x2(stage, reduce):
    _check_accounting((2, 2), stage, reduce)


@pytest.mark.parametrize("shape", [(1, 4), (4, 1), (2, 4)], ids=["1x4", "4x1", "2x4"])
@pytest.mark.parametrize("stage", [1, 3])
def test_memory_and_comm_stats_other_meshes(shape, stage):
    _check_accounting(shape, stage, True)


def _check_accounting(shape: tuple[int, int], stage: int, reduce: bool) -> None:
    r_size, s_size = shape
    ranks = each_rank(r_size * s_size, lambda r, w: _accounting(r, w, shape, stage, reduce))
    psi = ranks[0][2]
    k = formulas.optimizer_bytes_per_param(2)
    rep, sh = formulas.coefficients(stage, 2, k, reduce_bytes=4 if reduce else None)
    for rep_rank in range(r_size):  # each replica: its S ranks hold the model once
        mine = ranks[rep_rank * s_size:(rep_rank + 1) * s_size]
        if stage < 3:
            assert sum(local for local, _, _ in mine) == (psi if stage else psi * s_size)
            # the formula with N = S, summed over the shard group's ranks
            assert sum(b for _, b, _ in mine) == s_size * rep * psi + sh * psi, (mine, psi)
        else:  # stage 3 holds frozen and padding slots too: its own test (fake_pg_engine)
            assert sum(local for local, _, _ in mine) == psi
    # the replicas hold the same bytes
    assert len({b for _, b, _ in ranks[:s_size]} ^ {b for _, b, _ in ranks[-s_size:]}) == 0


def test_formulas_hybrid_examples():
    # The stage-2 example: 2 Psi (S-1)/S inside the shard group, 2 Psi (R-1)/(R S)
    # across it, for Psi = 1200 on 2 nodes of 4.
    assert formulas.hybrid_wire_elements(2, 1200, 4, 2) == {"shard": 1800, "replicate": 300}
    assert formulas.hybrid_comm_elements(3, 1200, 4, 2) == {"shard": 3600, "replicate": 600}
    assert formulas.hybrid_comm_elements(2, 1200, 4, 1) == {"shard": 2400, "replicate": 0}
    assert formulas.hybrid_comm_elements(2, 1200, 1, 4) == {"shard": 0, "replicate": 2400}
    assert formulas.hybrid_wire_elements(0, 10, 3, 3)["replicate"] == float(Fraction(40, 9))
    with pytest.raises(ValueError, match="replicate"):
        formulas.hybrid_comm_elements(2, 10, 2, 0)
