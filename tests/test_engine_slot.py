"""The engine slot (zerokern/zero/engine_slot.py) in one process at world size 1 (no process
group): the layout learned from the first backward's gradient order, memory before and after
the engine exists, the state carried over by a re-layout, and parameters written from
outside (their values become the fp32 master, exactly: a 16-bit value widens to fp32
without rounding)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerokern.comm import Comm
from zerokern.zero.engine_slot import EngineSlot
from zerokern.zero.param_table import ParamTable, trained_params


def _slot(shapes, dtype=torch.float32, stage=2, bucket_numel=64, groups=1):
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]
    k = -(-len(ps) // groups)
    param_groups = [{"params": ps[i:i + k]} for i in range(0, len(ps), k)]
    managed, frozen = trained_params(param_groups)
    table = ParamTable(managed, frozen)
    slot = EngineSlot(table, Comm(None), stage=stage, offload=None, runtime=None,
                      bucket_numel=bucket_numel, overlap=False, backend="torch", dtype=dtype,
                      device=torch.device("cpu"))
    return ps, param_groups, table, slot


def _master_of(slot, i):
    """Parameter i's fp32 values as the engine holds them (world size 1: all of them)."""
    pieces = sorted((pc for pc in slot.layout.pieces if pc.param == i),
                    key=lambda pc: pc.param_offset)
    return torch.cat([slot.engine.values(pc.local_start, pc.numel) for pc in pieces])


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_first_backward_order_and_its_gradients(stage):
    ps, groups, _, slot = _slot([(5,), (7, 3), (4,)], stage=stage)
    for i in (1, 2, 0, 1):  # gradients arrive; a repeat is ignored
        ps[i].grad = torch.full_like(ps[i], float(i + 1))
        slot.on_grad(i)
    assert slot.layout is None and slot.engine is None
    slot.build_at_first_step(groups)
    assert slot.layout.ready_order[:3] == (1, 2, 0)
    assert slot.engine.finish_grads() == [True, True, True]
    for pc in slot.layout.pieces:  # the pushed gradients are the engine's, unchanged
        got = torch.cat(slot.engine.grad_slices(pc.local_start, pc.numel))
        assert torch.equal(got, torch.full((pc.numel,), float(pc.param + 1)))


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_memory_before_is_memory_after(stage, dtype):
    _, groups, _, slot = _slot([(33,), (8, 8), (5,), (70,)], dtype=dtype, stage=stage,
                               groups=2)
    planned = slot.memory_stats()
    assert slot.layout is None, "asking fixed the layout"
    slot.build(groups)
    after = slot.memory_stats()
    # Every buffer the plan names is what the engine holds, stage 2's bucket pool included
    # (world size 1: its reductions complete at once and use one slot; both are held).
    for k in ("params", "grads", "master", "exp_avg", "exp_avg_sq", "padding", "buckets",
              "arena_in_use", "arena_capacity", "total"):
        assert after[k] == planned[k], k


def test_relayout_keeps_the_state_of_the_existing_groups():
    ps, groups, table, slot = _slot([(6,), (9,)], dtype=torch.bfloat16)
    slot.build(groups)
    eng = slot.engine
    n = slot.layout.local_numel
    with torch.no_grad():
        eng.state.exp_avg.copy_(torch.arange(n, dtype=torch.float32))
        eng.state.exp_avg_sq.copy_(torch.arange(n, dtype=torch.float32) * 2)
        eng.master.copy_(torch.arange(n, dtype=torch.float32) * 3)
    new = nn.Parameter(torch.ones(11, dtype=torch.bfloat16))
    groups.append({"params": [new]})
    first = table.append([new], table.shapes_of([new]), frozen=[])
    slot.relayout(groups, first)
    assert slot.engine is not eng and slot.layout.local_numel > n
    for key, k in (("exp_avg", 1), ("exp_avg_sq", 2), ("master", 3)):
        t = getattr(slot.engine.state, key)
        assert torch.equal(t[:n], torch.arange(n, dtype=torch.float32) * k)
    m = slot.engine.state.exp_avg
    assert torch.equal(m[n:], torch.zeros_like(m[n:]))


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_relayout_keeps_the_gradients(stage):
    """add_param_group's re-layout: the existing parameters' .grad (stages 0-1: views of the
    flat gradient, e.g. zeros kept by zero_grad(set_to_none=False)) move into the new buffer
    as they were; the new parameter's gradient, accumulated while it was in no optimizer, is
    left on it for the next step."""
    ps, groups, table, slot = _slot([(6,), (9,)], stage=stage)
    slot.build(groups)
    slot.engine.zero_grad(set_to_none=False, keep=[True, False])
    if stage < 2:
        ps[0].grad.fill_(3.0)  # the last step's gradient, not zeroed yet
    new = nn.Parameter(torch.ones(11))
    new.grad = torch.full((11,), 5.0)
    groups.append({"params": [new]})
    first = table.append([new], table.shapes_of([new]), frozen=[])
    slot.relayout(groups, first)
    assert ps[1].grad is None and torch.equal(new.grad, torch.full((11,), 5.0))
    if stage < 2:
        flat = slot.engine.flat_grad
        assert ps[0].grad.data_ptr() == flat.data_ptr() + \
            slot.layout.param_flat_offset[0] * flat.element_size()
        assert torch.equal(ps[0].grad, torch.full((6,), 3.0))
        assert slot.engine.reducer.zeroed
    else:
        assert ps[0].grad is None


def test_weights_written_from_outside_become_the_master():
    ps, groups, _, slot = _slot([(6,), (9,)], dtype=torch.bfloat16)
    slot.build(groups)
    with torch.no_grad():
        slot.engine.master.fill_(7.0)  # the master disagrees; the parameters did not change
    slot.adopt_param_writes()
    assert torch.equal(slot.engine.master, torch.full_like(slot.engine.master, 7.0))
    want = torch.linspace(-2, 2, 9).to(torch.bfloat16)
    with torch.no_grad():
        ps[1].copy_(want)  # model.load_state_dict's copy_
    slot.adopt_param_writes()
    assert torch.equal(_master_of(slot, 1), want.float())
    assert torch.equal(_master_of(slot, 0), ps[0].detach().float())


def test_replaced_tensor_is_adopted_and_a_cast_refused():
    ps, groups, table, slot = _slot([(6,), (9,)], dtype=torch.bfloat16)
    slot.build(groups)
    t = torch.full((9,), 0.5, dtype=torch.bfloat16)
    ps[1].data = t  # p.data = t of the same shape, dtype and device: t is trained
    slot.adopt_param_writes()
    flat = slot.engine.flat_param  # p is bound again: a view of the flat parameters
    assert ps[1].data_ptr() == (flat.data_ptr()
                                + slot.layout.param_flat_offset[1] * flat.element_size())
    assert torch.equal(ps[1].detach(), t) and torch.equal(_master_of(slot, 1), t.float())
    ps[0].data = ps[0].data.float()
    with pytest.raises(RuntimeError, match="cast or move the model before"):
        slot.adopt_param_writes()
    ps[0].grad = torch.zeros(6)
    with pytest.raises(RuntimeError, match="cast or move the model before"):
        slot.on_grad(0)


def test_sparse_gradients_and_pending_gradients():
    ps, groups, _, slot = _slot([(4, 3)])
    ps[0].grad = torch.zeros(4, 3).to_sparse()
    with pytest.raises(TypeError, match="sparse gradients are not supported"):
        slot.on_grad(0)
    ps[0].grad = torch.ones(4, 3)
    slot.on_grad(0)
    assert not slot.has_pending_grads()  # nothing laid out: nothing pending
    slot.build_at_first_step(groups)
    assert slot.has_pending_grads()
    slot.engine.finish_grads()
    slot.engine.end_step()
    assert not slot.has_pending_grads()


def test_no_sync_reaches_the_engine_and_unseen_gradients_wait():
    ps, groups, _, slot = _slot([(5,), (3,)], stage=0)
    slot.build(groups)
    slot.set_sync(False)
    ps[0].grad = torch.ones(5)
    slot.deliver_unseen_grads()  # inside no_sync: nothing is delivered
    assert slot.engine.reducer.got_grad == [False, False]
    slot.set_sync(True)
    slot.deliver_unseen_grads()
    assert slot.engine.reducer.got_grad == [True, False]
