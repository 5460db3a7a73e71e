"""The shard's state part (zero/shard_state.py) on its own, in one process: its fused step
against torch.optim.AdamW, the two placements against each other (bitwise), the gradient
shard's reduce target / receive contract, and its specs against what it allocates."""

from __future__ import annotations

import pytest
import torch
from _tol import ADAM_FP32

from zerokern.memory import Arena
from zerokern.zero.shard_state import BufferSpec, OnDevice, OnHost, ShardState
from zerokern.zero.stages.base import ARENA_ALIGN, reserved_bytes

N = 203  # odd: no range lines up with a vector width
RANGES = [(0, 0, 120), (1, 120, 83)]  # (group, start, numel)
GROUPS = [dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
          dict(lr=3e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0)]
STEPS = 4


def _grads(step: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(N, generator=g).to(dtype)


def _arena_for(specs: list[BufferSpec]) -> Arena:
    return Arena(max(reserved_bytes(specs), ARENA_ALIGN), torch.device("cpu"),
                 alignment=ARENA_ALIGN)


def _state(kind: str, dtype: torch.dtype, *, own_grads: bool = False,
           params_on_host: bool = False, master: bool | None = None) -> ShardState:
    master = dtype != torch.float32 if master is None else master
    specs = ShardState.specs(N, dtype, master=master, own_grads=own_grads)
    if kind == "device":
        arena = _arena_for(specs)
        placement = OnDevice(lambda k, n, d: arena.alloc(n, d).tensor.zero_(), None)
    else:
        placement = OnHost(specs + [BufferSpec("staging", N, dtype)] * 2, torch.device("cpu"),
                           chunks=len(RANGES), slot_numel=N, dtype=dtype, backend=None,
                           params_on_host=params_on_host)
    return ShardState(N, dtype, placement, master=master, own_grads=own_grads)


def _train(state: ShardState, dtype: torch.dtype, param0: torch.Tensor) -> torch.Tensor:
    param = param0.clone()
    if state.master is not None:
        state.master.copy_(param0.float())
    for step in range(1, STEPS + 1):
        grad = _grads(step, dtype)
        for c, (g, s, n) in enumerate(RANGES):
            state.step(c, GROUPS[g], s, n, step, 1.0, grad=grad.narrow(0, s, n),
                       param=param.narrow(0, s, n))
        for c in range(len(RANGES)):
            state.before_gather(c)
        state.end_step()
    return param


def _reference(dtype: torch.dtype, param0: torch.Tensor):
    """torch.optim.AdamW(foreach=False) on an fp32 master, one param group per range."""
    master = param0.float().clone()
    views = [torch.nn.Parameter(master[s:s + n].clone()) for _, s, n in RANGES]
    opt = torch.optim.AdamW([dict(params=[v], **GROUPS[g]) for v, (g, _, _) in
                             zip(views, RANGES)], foreach=False)
    for step in range(1, STEPS + 1):
        grad = _grads(step, dtype).float()
        for v, (_, s, n) in zip(views, RANGES):
            v.grad = grad[s:s + n].clone()
        opt.step()
    flat = torch.cat([v.detach() for v in views])
    m = torch.cat([opt.state[v]["exp_avg"] for v in views])
    v2 = torch.cat([opt.state[v]["exp_avg_sq"] for v in views])
    return flat, m, v2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_matches_torch_adamw(dtype: torch.dtype) -> None:
    param0 = torch.randn(N, generator=torch.Generator().manual_seed(7)).to(dtype)
    st = _state("device", dtype)
    param = _train(st, dtype, param0)
    ref, m, v = _reference(dtype, param0)
    values = st.master if st.master is not None else param
    torch.testing.assert_close(values, ref, rtol=ADAM_FP32[0], atol=ADAM_FP32[1])
    torch.testing.assert_close(st.exp_avg, m, rtol=ADAM_FP32[0], atol=ADAM_FP32[1])
    torch.testing.assert_close(st.exp_avg_sq, v, rtol=ADAM_FP32[0], atol=ADAM_FP32[1])
    if dtype != torch.float32:
        # The 16-bit parameters are the master rounded to nearest even, in the same pass.
        assert torch.equal(param, st.master.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("params_on_host", [False, True])
def test_host_placement_equals_device(dtype: torch.dtype, params_on_host: bool) -> None:
    """The host placement runs the same kernel on the same values: bitwise the device's,
    whether the new parameters return through the staging slots or are written in place."""
    param0 = torch.randn(N, generator=torch.Generator().manual_seed(3)).to(dtype)
    dev = _state("device", dtype)
    # offload keeps an fp32 master unless fp32 parameters live in host memory themselves
    host = _state("host", dtype, params_on_host=params_on_host,
                  master=dtype != torch.float32 or not params_on_host)
    pd, ph = _train(dev, dtype, param0), _train(host, dtype, param0)
    assert torch.equal(pd, ph)
    assert torch.equal(dev.exp_avg, host.exp_avg)
    assert torch.equal(dev.exp_avg_sq, host.exp_avg_sq)
    pipe = host.placement.pipe
    if dtype != torch.float32 and not params_on_host:
        assert pipe.copier.h2d > 0  # the 16-bit values really crossed back
    assert pipe.staging.pending == 0  # end_step settled every slot


def test_device_reduce_target_and_receive() -> None:
    st = _state("device", torch.float32, own_grads=True)
    own = torch.ones(50)
    out, may_async = st.reduce_target(10, own, accumulate=False)
    assert may_async and out.data_ptr() == st.grads[10:].data_ptr() and out.numel() == 50
    out.fill_(2.0)
    st.receive(0, 10, out, accumulate=False)  # reduced in place: nothing to do
    assert torch.equal(st.grads[10:60], torch.full((50,), 2.0))
    tmp, may_async = st.reduce_target(10, own, accumulate=True)
    assert not may_async and tmp.data_ptr() != st.grads.data_ptr()
    tmp.fill_(0.5)
    st.receive(0, 10, tmp, accumulate=True)
    assert torch.equal(st.grads[10:60], torch.full((50,), 2.5))
    assert torch.equal(st.grads[:10], torch.zeros(10))


def test_host_receive_lands_through_staging() -> None:
    st = _state("host", torch.bfloat16, own_grads=True)
    own = torch.arange(40, dtype=torch.bfloat16)
    out, may_async = st.reduce_target(5, own, accumulate=False)
    assert may_async and out is own  # in place, in the send buffer
    st.receive(0, 5, own, accumulate=False)
    st.receive(1, 5, own, accumulate=True)  # a further backward adds
    st.drain()
    assert torch.equal(st.grads[5:45], 2 * own)
    assert st.placement.pipe.staging.settled == 2


def test_without_own_grads_receive_is_a_no_op() -> None:
    st = _state("device", torch.float32)
    assert st.grads is None
    st.receive(0, 0, torch.ones(3), accumulate=True)  # the stage's buffer is the gradient


@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize("own_grads", [False, True])
def test_specs_are_what_it_allocates(master: bool, own_grads: bool) -> None:
    specs = ShardState.specs(N, torch.bfloat16, master=master, own_grads=own_grads)
    arena = _arena_for(specs)
    kinds: list[str] = []

    def alloc(kind: str, n: int, d: torch.dtype) -> torch.Tensor:
        kinds.append(kind)
        return arena.alloc(n, d).tensor

    ShardState(N, torch.bfloat16, OnDevice(alloc, None), master=master, own_grads=own_grads)
    assert kinds == [s.kind for s in specs]
    assert arena.stats()["in_use"] == reserved_bytes(specs)
