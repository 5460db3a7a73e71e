"""OwnerMuon on gloo ranks against DDP + torch.optim.Muon: bit for bit.

Reference: one torch.optim.Muon per rank, fed the averaged gradient as zerokern averages (the
sum over ranks, then one division by N). Each owner runs torch's own operations on the same
averaged gradient, so parameters and momentum are compared with ``torch.equal``. The one place
a distributed sum can differ from another is the order of its additions: the gradients here
are small integers, so every partial sum is exact and the reduce-scatter's sum is the
reference's whatever its order (at 2 ranks any values would do: a + b = b + a).

Also checked: every rank ends with the same parameters; each rank keeps momentum only for
the units it owns and runs Newton-Schulz only on those; the collectives move what
zerokern.formulas says; a 2x2 mesh (hybrid) gives the same result as a flat group of 4.
"""

from __future__ import annotations

import pytest
import torch
import torch.optim._muon as torch_muon
from dist_utils import run_ranks

from zerokern import formulas
from zerokern.comm import Comm
from zerokern.comm.mesh import mesh_comm
from zerokern.optim.owner_muon import OwnerMuon

HYPER = dict(lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=True)
# Odd shapes, tall and wide, two of one shape (a batch), one much larger than the rest.
SHAPES = [(7, 5), (5, 7), (16, 16), (16, 16), (33, 65), (3, 1)]
STEPS = 3


def _init(shapes, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _grad(shape, rank, step, i, dtype=torch.float32):
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + i)
    return torch.randint(-4, 5, shape, generator=g).to(dtype)


def _reference(shapes, world, hyper, row_splits=None, dtype=torch.float32):
    """torch.optim.Muon with each block its own parameter, fed the averaged gradient."""
    blocks = []  # (matrix, row_start, rows)
    for m, (rows, _) in enumerate(shapes):
        start = 0
        for r in (row_splits or {}).get(m, (rows,)):
            blocks.append((m, start, r))
            start += r
    init = _init(shapes, dtype)
    ps = [torch.nn.Parameter(init[m][s:s + r].clone()) for m, s, r in blocks]
    opt = torch.optim.Muon(ps, **hyper)
    for step in range(STEPS):
        for p, (m, s, r) in zip(ps, blocks):
            total = sum(_grad(shapes[m], k, step, m, dtype).double() for k in range(world))
            g = total[s:s + r].to(dtype)  # exact: small integers
            p.grad = g.div_(world) if world > 1 else g
        opt.step()
    full = [torch.cat([ps[j].detach() for j, b in enumerate(blocks) if b[0] == m])
            for m in range(len(shapes))]
    return full, [opt.state[p]["momentum_buffer"] for p in ps]


def _train(rank, comm, shapes, hyper, row_splits=None, batched=False, dtype=torch.float32):
    params = [torch.nn.Parameter(t) for t in _init(shapes, dtype)]
    opt = OwnerMuon(params, comm, row_splits=row_splits, batched=batched, **hyper)
    calls = []
    ns = torch_muon._zeropower_via_newtonschulz

    def counting(grad, *a, **k):  # which matrices this rank orthogonalizes
        calls.append(tuple(grad.shape))
        return ns(grad, *a, **k)

    torch_muon._zeropower_via_newtonschulz = counting
    try:
        for step in range(STEPS):
            for i, p in enumerate(params):
                p.grad = _grad(shapes[i], rank, step, i, dtype)  # the global rank's
            opt.step()
    finally:
        torch_muon._zeropower_via_newtonschulz = ns
    return params, opt, calls


def _check(rank, world, comm, shapes, hyper, row_splits=None, batched=False,
           dtype=torch.float32):
    params, opt, calls = _train(rank, comm, shapes, hyper, row_splits, batched, dtype)
    want_p, want_m = _reference(shapes, comm.dp_size, hyper, row_splits, dtype)
    for i, (p, w) in enumerate(zip(params, want_p)):
        assert torch.equal(p.detach(), w), (rank, i)
    mine = [u.index for u in opt.plan.owned(comm.rank)]
    assert sorted(opt.momentum) == sorted(mine)  # momentum for its own units only
    for i in mine:
        assert torch.equal(opt.momentum[i], want_m[i]), (rank, i)
    if not batched:  # batched units bypass torch's function: counted by shape instead
        owned = sorted(u.shape for u in opt.plan.owned(comm.rank)) * STEPS
        assert sorted(calls) == sorted(owned), rank  # NS on owned units only, once a step
    # The collectives and the memory, as zerokern.formulas says.
    owned_numel = list(opt.plan.owned_numel)
    want = formulas.muon_exchange_elements(owned_numel)
    stats = comm.reset_stats()
    for kind in ("reduce_scatter", "all_gather"):
        assert stats.elements.get(kind, 0) == STEPS * want[kind], kind
        assert stats.wire.get(kind, 0) == STEPS * want["wire"] / 2, kind
    esize = params[0].element_size()
    assert opt.memory_bytes() == formulas.muon_owner_memory_bytes(
        owned_numel, comm.rank, esize, esize)
    # Every rank holds the same parameters afterwards.
    for p in params:
        gathered = comm.all_gather_object(p.detach())
        assert all(torch.equal(g, gathered[0]) for g in gathered)


def _flat(rank, world, shapes, hyper, row_splits=None, batched=False, dtype_name="float32"):
    _check(rank, world, Comm(), shapes, hyper, row_splits, batched, getattr(torch, dtype_name))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_owner_muon_equals_ddp_torch_muon(world, tmp_path):
    run_ranks(world, _flat, SHAPES, HYPER, tmp_path=tmp_path)


def test_world_one_equals_torch_muon():
    _check(0, 1, Comm(), SHAPES, HYPER)


def test_more_ranks_than_matrices(tmp_path):
    run_ranks(4, _flat, [(5, 3), (2, 9)], dict(HYPER, nesterov=False), tmp_path=tmp_path)


def test_row_blocks_and_adjusted_lr_3_ranks(tmp_path):
    # A fused QKV weight (12 x 5) split per head, beside plain matrices.
    hyper = dict(HYPER, adjust_lr_fn="match_rms_adamw", weight_decay=0.0)
    run_ranks(3, _flat, [(12, 5), (6, 4), (4, 6)], hyper, {0: (4, 4, 4)}, tmp_path=tmp_path)


def test_batched_bitwise_2_ranks(tmp_path):
    run_ranks(2, _flat, [(6, 4)] * 5 + [(9, 9)] * 2 + [(4, 6)], HYPER, None, True,
              tmp_path=tmp_path)


def test_bf16_parameters_3_ranks(tmp_path):
    # bf16 gradients are reduced in bf16: integers up to 3 x 4 are exact there too.
    run_ranks(3, _flat, SHAPES, dict(HYPER, nesterov=False), None, False, "bfloat16",
              tmp_path=tmp_path)


def _mesh_case(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    comm = mesh_comm(init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    assert comm.world_size == 2 and comm.replicate.world_size == 2 and comm.dp_size == 4
    _check(rank, world, comm, SHAPES, HYPER)


def test_hybrid_mesh_2x2(tmp_path):
    # Owners per shard group (each replica updates its own copy), gradients summed over all 4.
    run_ranks(4, _mesh_case, tmp_path=tmp_path, isolated=True)


def _refusals(rank, world):
    comm = Comm()
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        OwnerMuon([torch.nn.Parameter(torch.zeros(3, 3)), torch.nn.Parameter(torch.zeros(3))],
                  comm)
    a, b = torch.nn.Parameter(torch.zeros(3, 3)), torch.nn.Parameter(torch.ones(2, 2))
    opt = OwnerMuon([a, b], comm)
    a.grad = torch.ones(3, 3)
    with pytest.raises(ValueError, match=r"params\[1\]\.grad is None"):
        opt.step()  # refused on every rank before any collective
    assert not a.any() and b.eq(1).all()
    with pytest.raises(ValueError, match=r"params\[1\] is torch.float64"):
        OwnerMuon([a, torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))], comm)


def test_refusals(tmp_path):
    run_ranks(2, _refusals, tmp_path=tmp_path)


def test_shard_exchange_on_one_rank_and_its_refusals():
    from zerokern.comm.owner_exchange import segment_view
    from zerokern.comm.shard_exchange import ShardExchange, ShardPiece
    from zerokern.optim.muon_plan import plan_muon

    plan = plan_muon([(2, 3), (4, 2)], 1)
    # one rank holds both matrices in three runs, the second split in two
    pieces = [[ShardPiece(1, 0, 5), ShardPiece(0, 0, 6), ShardPiece(1, 5, 3)]]
    sx = ShardExchange(plan, Comm(), pieces, torch.float32, torch.bfloat16, "cpu")
    values = [torch.arange(5.0), torch.arange(6.0) + 10, torch.arange(3.0) + 20]
    seg = sx.to_owners(values, [True, True])
    assert torch.equal(segment_view(seg, plan.units[0]).flatten(), values[1])
    assert torch.equal(segment_view(seg, plan.units[1]).flatten(),
                       torch.cat([values[0], values[2]]))
    sx.param_segment.copy_(seg)
    back = sx.from_owners([True, True])
    assert [torch.equal(b.float(), v) for b, v in zip(back, values)] == [True] * 3
    assert len(sx.from_owners([False, True])) == 2  # an inactive unit's runs stay out
    with pytest.raises(ValueError, match="values"):
        sx.to_owners(values[:2], [True, True])
    with pytest.raises(ValueError, match="values"):
        sx.to_owners([torch.zeros(4)] + values[1:], [True, True])
    with pytest.raises(ValueError, match="active"):
        sx.from_owners([True])
    with pytest.raises(ValueError, match="pieces"):
        ShardExchange(plan, Comm(), [[ShardPiece(0, 4, 3)]], torch.float32, torch.float32,
                      "cpu")
    with pytest.raises(ValueError, match="pieces"):
        ShardExchange(plan, Comm(), pieces * 2, torch.float32, torch.float32, "cpu")
    with pytest.raises(ValueError, match="plan is for 2 ranks"):
        ShardExchange(plan_muon([(2, 3)], 2), Comm(), pieces, torch.float32, torch.float32,
                      "cpu")
    with pytest.raises(ValueError, match="splits"):
        Comm().all_to_all_uneven(torch.zeros(3), torch.zeros(3), [1, 2], [3])
    with pytest.raises(ValueError, match="do not sum"):
        Comm().all_to_all_uneven(torch.zeros(3), torch.zeros(3), [2], [3])
