"""zerokern.comm.Comm on real gloo ranks: the point-to-point reduce-scatter it uses on gloo
(out of place, in place, several in flight at once) against a float64 sum of every rank's
input, and its accounting."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks

from zerokern.comm import Comm


def _input(rank: int, world: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype == torch.float32:
        return torch.randn(numel * world, generator=g).to(dtype)
    # Small integers: every partial sum is exact in bf16/fp16, so the check can be exact.
    return torch.randint(-8, 9, (numel * world,), generator=g).to(dtype)


def _expected(rank: int, world: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    total = sum(_input(r, world, numel, dtype, seed).double() for r in range(world))
    return total[rank * numel:(rank + 1) * numel]


def exchange(rank, world, dtype_name):
    dtype = getattr(torch, dtype_name)
    comm = Comm()
    assert comm.p2p_reduce_scatter  # gloo: zerokern's own reduce-scatter
    numel = 1031  # odd, so slices are not aligned to anything
    exact = dtype != torch.float32

    def check(out, seed):
        ref = _expected(rank, world, numel, dtype, seed)
        if exact:
            assert torch.equal(out.double(), ref), seed
        else:
            torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-5)

    # synchronous, out of place; the input is left as it was
    inp = _input(rank, world, numel, dtype, 0)
    before = inp.clone()
    out = torch.full((numel,), 7.0, dtype=dtype)
    assert comm.reduce_scatter(out, inp, "plain") is None
    check(out, 0)
    assert torch.equal(inp, before)

    # in place: the output is this rank's own slice of the input
    inp = _input(rank, world, numel, dtype, 1)
    mine = inp.narrow(0, rank * numel, numel)
    comm.reduce_scatter(mine, inp, "in place")
    check(mine, 1)

    # several in flight at once, waited in issue order (as the gradient buckets are)
    inps = [_input(rank, world, numel, dtype, 10 + k) for k in range(4)]
    outs = [torch.empty(numel, dtype=dtype) for _ in inps]
    works = [comm.reduce_scatter(o, i, f"bucket {k}", async_op=True)
             for k, (o, i) in enumerate(zip(outs, inps))]
    assert all(w is not None for w in works)
    for k, (w, o) in enumerate(zip(works, outs)):
        assert w.wait()
        assert w.is_completed()
        check(o, 10 + k)
    works[0].wait()  # a second wait is a no-op: the sum is not added twice
    check(outs[0], 10)

    # the paper's count: the full input once per reduce-scatter
    st = comm.stats.as_dict()["reduce_scatter"]
    assert st["calls"] == 6
    assert st["elements"] == 6 * numel * world

    # wrong sizes: a clear error naming what was being moved, nothing sent
    with pytest.raises(ValueError, match="reduce_scatter of bad bucket"):
        comm.reduce_scatter(torch.empty(numel + 1, dtype=dtype), inp, "bad bucket")


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_p2p_reduce_scatter(world, dtype, tmp_path):
    run_ranks(world, exchange, dtype, tmp_path=tmp_path)
