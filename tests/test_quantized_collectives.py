"""Quantized collectives (zerokern/comm/quantized.py, issue 38) on gloo ranks: worlds 2, 3
and 4, and a 2x2 mesh for the two-hop reduce.

Every rank builds every rank's input from seeds, so each checks its result against a
single-process simulation with the codec's oracle (zerokern.quant.comm_codec) and against the
exact float64 result:

- all-gather: ``out`` is bit for bit the oracle's decoding of every rank's quantized shard
  (the same bits on every rank, checked by gathering them), and within the codec's error
  bound (plus the rounding into ``out``'s dtype) of the shards themselves;
- reduce-scatter: ``out`` is bit for bit the oracle's fp32 sum, in rank order, of the decoded
  chunks, and within the sum of the chunks' bounds, fp32 summation ((N - 1) u times the sum of
  magnitudes) and the final rounding of the exact float64 sum;
- two-hop reduce on the 2x2 mesh: the same, hop by hop (each hop's bound includes the error
  of its inputs), and the replicas hold the same bits;
- a block holding inf or NaN on one rank decodes to NaN on every rank that receives it, and
  only that block;
- ``CommStats`` counts the quantized kinds only, with exactly ``zerokern.formulas``' bytes.

Sizes are odd (blocks partial at the end of every rank's piece), inputs fp32/bf16/fp16,
outputs all three, in place and not, synchronous and asynchronous.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from dist_utils import run_ranks
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from zerokern import formulas
from zerokern.comm import Comm
from zerokern.comm.mesh import mesh_comm
from zerokern.comm.quantized import (
    quantized_all_gather,
    quantized_kind,
    quantized_reduce_scatter,
    quantized_reduce_scatter_2hop,
)
from zerokern.quant import comm_codec as cc

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
U = 2.0**-24
# (unit roundoff, half the smallest subnormal) of rounding fp32 into each output dtype
CAST = {torch.float32: (0.0, 0.0), torch.bfloat16: (2.0**-8, 2.0**-134),
        torch.float16: (2.0**-11, 2.0**-25)}
_MESHES: dict[str, DeviceMesh] = {}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _inputs(world: int, numel: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Every rank's input: magnitudes over 8 decades, some exact zeros, in ``dtype``."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(seed * 1000 + r)
        mags = torch.logspace(-4, 4, numel)[torch.randperm(numel, generator=g)]
        x = torch.randn(numel, generator=g) * mags
        x[torch.rand(numel, generator=g) < 0.05] = 0.0
        out.append(x.to(dtype))
    return out


def _cast_bound(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    u, half_eta = CAST[dtype]
    return v.double().abs() * u + half_eta


def _sim_reduce(pieces: list[torch.Tensor], bits: int, block: int):
    """The oracle's quantized reduce of equal pieces (one per rank, in rank order): (fp32
    value, float64 bound on its distance to the exact sum of the pieces)."""
    n = pieces[0].numel()
    payload = torch.cat([cc.quantize(p, 1, bits, block) for p in pieces])
    value = cc.dequantize(payload, n, len(pieces), bits, block, reduce=True)
    ys = cc.dequantize(payload, n, len(pieces), bits, block).reshape(len(pieces), n)
    k = len(pieces) - 1
    gamma = k * U / (1 - k * U)  # recursive fp32 summation of k + 1 terms
    bound = sum(cc.error_bound(cc.block_absmax(p, 1, block), bits) for p in pieces)
    return value, bound + gamma * ys.double().abs().sum(0)


def _check_stats(comm: Comm, want: dict[str, tuple[int, int]]) -> None:
    """comm.stats holds exactly the kinds of ``want``: kind -> (elements, bytes), one call."""
    assert set(comm.stats.calls) == set(want), dict(comm.stats.calls)
    for kind, (elements, nbytes) in want.items():
        assert comm.stats.calls[kind] == 1, kind
        assert comm.stats.elements[kind] == elements, (kind, comm.stats.elements[kind])
        assert comm.stats.bytes[kind] == nbytes, (kind, comm.stats.bytes[kind], nbytes)
        w = comm.world_size
        assert comm.stats.wire[kind] == Fraction(elements * (w - 1), w), kind


def _same_on_every_rank(comm: Comm, t: torch.Tensor) -> None:
    mine = _bits(t).tolist()
    assert all(o == mine for o in comm.all_gather_object(mine, "check")), "ranks differ"


# -- all-gather -------------------------------------------------------------------------------
def _gather(rank: int, world: int, bits: int) -> None:
    configs = [(n, block, dt, od, async_op, in_place)
               for n, block in ((37, 16), (300, 256), (1, 16))
               for dt in DTYPES for od in DTYPES
               for async_op in (False, True) for in_place in (False, True)
               if not in_place or od == dt]
    for i, (n, block, dt, od, async_op, in_place) in enumerate(configs):
        comm = Comm(None)
        shards = _inputs(world, n, dt, seed=i)
        out = torch.full((world * n,), math.nan, dtype=od)
        if in_place:
            shard = out[rank * n:(rank + 1) * n].copy_(shards[rank])
        else:
            shard = shards[rank].clone()
        h = quantized_all_gather(comm, out, shard, bits=bits, block=block, async_op=async_op)
        if async_op:
            if not in_place:
                shard.fill_(math.nan)  # quantized at the call: may be reused at once
            h.wait()
            assert h.is_completed() and h.wait()
        what = f"n={n} block={block} {dt}->{od} async={async_op} in_place={in_place}"
        payload = torch.cat([cc.quantize(s, 1, bits, block) for s in shards])
        want = cc.dequantize(payload, n, world, bits, block, dtype=od)
        assert torch.equal(_bits(out), _bits(want)), what
        exact = torch.cat(shards).double()
        fp32 = cc.dequantize(payload, n, world, bits, block)
        bound = (torch.cat([cc.error_bound(cc.block_absmax(s, 1, block), bits) for s in shards])
                 + _cast_bound(fp32, od))
        assert ((out.double() - exact).abs() <= bound).all(), what
        _same_on_every_rank(comm, out)
        nbytes = formulas.quantized_all_gather_bytes(n, world, bits, block)
        assert nbytes < world * n * 2 or n == 1  # fewer bytes than a bf16 gather
        _check_stats(comm, {quantized_kind("all_gather", bits): (world * n, nbytes)})


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("bits", [8, 4])
def test_all_gather(world, bits, tmp_path):
    run_ranks(world, _gather, bits, tmp_path=tmp_path)


# -- reduce-scatter ---------------------------------------------------------------------------
def _reduce_scatter(rank: int, world: int, bits: int) -> None:
    configs = [(c, block, dt, od, async_op, in_place)
               for c, block in ((37, 16), (301, 256), (1, 16))
               for dt in DTYPES for od in DTYPES
               for async_op in (False, True) for in_place in (False, True)
               if not in_place or od == dt]
    for i, (c, block, dt, od, async_op, in_place) in enumerate(configs):
        comm = Comm(None)
        fulls = _inputs(world, world * c, dt, seed=100 + i)
        full = fulls[rank].clone()
        out = full[rank * c:(rank + 1) * c] if in_place else torch.full((c,), math.nan, dtype=od)
        h = quantized_reduce_scatter(comm, out, full, bits=bits, block=block,
                                     async_op=async_op)
        if async_op:
            if not in_place:
                full.fill_(math.nan)  # quantized at the call
            h.wait()
        what = f"c={c} block={block} {dt}->{od} async={async_op} in_place={in_place}"
        value, bound = _sim_reduce([f[rank * c:(rank + 1) * c] for f in fulls], bits, block)
        assert torch.equal(_bits(out), _bits(cc.to_dtype(value, od))), what
        exact = sum(f[rank * c:(rank + 1) * c].double() for f in fulls)
        err = (out.double() - exact).abs()
        assert (err <= bound + _cast_bound(value, od)).all(), what
        nbytes = formulas.quantized_reduce_scatter_bytes(c, world, bits, block)
        _check_stats(comm, {quantized_kind("reduce_scatter", bits): (world * c, nbytes)})


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("bits", [8, 4])
def test_reduce_scatter(world, bits, tmp_path):
    run_ranks(world, _reduce_scatter, bits, tmp_path=tmp_path)


# -- inf / NaN --------------------------------------------------------------------------------
def _nonfinite(rank: int, world: int) -> None:
    comm = Comm(None)
    n, block = 50, 16
    for bad in (math.inf, -math.inf, math.nan):
        # reduce-scatter: rank 1 holds `bad` in block 1 of rank 0's chunk
        full = _inputs(world, world * n, torch.float32, seed=7)[rank]
        if rank == 1:
            full[20] = bad
        out = torch.empty(n, dtype=torch.bfloat16)
        quantized_reduce_scatter(comm, out, full, bits=4, block=block)
        nan = torch.isnan(out)
        if rank == 0:
            assert nan[16:32].all() and not nan[:16].any() and not nan[32:].any(), bad
            assert (_bits(out[16:32]) == 0x7FC0).all()
        else:
            assert not nan.any()
        # all-gather: rank world-1's shard holds `bad` in its last (partial) block
        shard = _inputs(world, n, torch.float16, seed=8)[rank]
        if rank == world - 1:
            shard[49] = bad
        out = torch.empty(world * n)
        quantized_all_gather(comm, out, shard, bits=8, block=block)
        nan = torch.isnan(out)
        last = (world - 1) * n
        assert nan[last + 48:].all() and not nan[:last + 48].any(), bad


def test_inf_and_nan_decode_to_nan_on_every_receiver(tmp_path):
    run_ranks(3, _nonfinite, tmp_path=tmp_path)


# -- two hops on a 2x2 mesh -------------------------------------------------------------------
def _mesh() -> DeviceMesh:
    if "2x2" not in _MESHES:
        _MESHES["2x2"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return _MESHES["2x2"]


def _two_hop(rank: int, world: int, bits: int, gather_bits: int) -> None:
    comm = mesh_comm(_mesh())
    s, r = comm.world_size, comm.replicate.world_size
    me, rep = comm.rank, comm.replicate.rank
    assert (s, r, me, rep) == (2, 2, rank % 2, rank // 2)  # mesh [[0, 1], [2, 3]]
    # block None: each hop at its width's default block (cc.WIRE_BLOCK: int4 finer than int8)
    for c, block, dt, od in ((38, 16, torch.bfloat16, torch.float32),
                             (600, 256, torch.float32, torch.bfloat16),
                             (2, 16, torch.float16, torch.float16),
                             (600, None, torch.bfloat16, torch.bfloat16)):
        comm.reset_stats()
        fulls = _inputs(world, s * c, dt, seed=c)  # global rank g = replica * s + shard
        out = torch.full((c,), math.nan, dtype=od)
        quantized_reduce_scatter_2hop(comm, out, fulls[rank].clone(), bits=bits,
                                      gather_bits=gather_bits, block=block)
        what = f"c={c} block={block} {dt}->{od} bits={bits}/{gather_bits}"
        default = block is None
        gblock, block = cc.wire_block(gather_bits, block), cc.wire_block(bits, block)
        if default:
            assert (block, gblock) == ({8: 256, 4: 32}[bits], 256), what
        # Hop 1, per replica i: the shard group's reduce of chunk `me`.
        chunk = [[fulls[i * s + k][me * c:(me + 1) * c] for k in range(s)] for i in range(r)]
        hop1 = [_sim_reduce(chunk[i], bits, block) for i in range(r)]
        # Hop 2, per part k (of c / r): the replicas' reduce of their partial sums.
        p = c // r
        hop2 = []
        for k in range(r):
            value, bound = _sim_reduce([v[k * p:(k + 1) * p] for v, _ in hop1], bits, block)
            hop2.append((value, bound + sum(b[k * p:(k + 1) * p] for _, b in hop1)))
        # Hop 3: every replica decodes every part.
        payload = torch.cat([cc.quantize(v, 1, gather_bits, gblock) for v, _ in hop2])
        fp32 = cc.dequantize(payload, p, r, gather_bits, gblock)
        assert torch.equal(_bits(out), _bits(cc.to_dtype(fp32, od))), what
        bound = torch.cat([b + cc.error_bound(cc.block_absmax(v, 1, gblock), gather_bits)
                           for v, b in hop2]) + _cast_bound(fp32, od)
        exact = sum(f[me * c:(me + 1) * c].double() for f in fulls)
        assert ((out.double() - exact).abs() <= bound).all(), what
        _same_on_every_rank(comm.replicate, out)
        # the formulas' defaults are the collectives' (and explicit blocks give the same)
        want = formulas.quantized_2hop_bytes(c, s, r, bits, gather_bits,
                                             None if default else block)
        _check_stats(comm, {quantized_kind("reduce_scatter", bits): (s * c, want["shard"])})
        rs = formulas.quantized_reduce_scatter_bytes(p, r, bits, block)
        ag = formulas.quantized_all_gather_bytes(p, r, gather_bits, gblock)
        assert rs + ag == want["replicate"]
        _check_stats(comm.replicate, {quantized_kind("reduce_scatter", bits): (c, rs),
                                      quantized_kind("all_gather", gather_bits): (c, ag)})


@pytest.mark.parametrize("bits,gather_bits", [(8, 8), (4, 8)])
def test_two_hop_reduce_on_a_2x2_mesh(bits, gather_bits, tmp_path):
    run_ranks(4, _two_hop, bits, gather_bits, tmp_path=tmp_path)


# -- refusals and one rank --------------------------------------------------------------------
def _refusals(rank: int, world: int) -> None:
    comm = Comm(None)
    full, out = torch.ones(world * 10), torch.zeros(10)
    cases = [
        (lambda: quantized_reduce_scatter(comm, out, full[:-1]), ValueError, "full"),
        (lambda: quantized_reduce_scatter(comm, out, full, bits=2), ValueError, "bits"),
        (lambda: quantized_reduce_scatter(comm, out, full.double()), TypeError, "full"),
        (lambda: quantized_all_gather(comm, full, out[:9]), ValueError, "shard"),
        (lambda: quantized_all_gather(comm, full, out, block=100), ValueError, "block"),
        (lambda: quantized_all_gather(object(), full, out), TypeError, "comm"),
        (lambda: quantized_reduce_scatter_2hop(comm, out, full, gather_bits=3), ValueError,
         "bits"),
    ]
    for call, exc, word in cases:
        with pytest.raises(exc, match=word):
            call()
    assert (out == 0).all() and not comm.stats.calls
    # Nothing was sent: the group still works.
    quantized_all_gather(comm, full, out + rank)
    assert full.reshape(world, 10)[:, 0].tolist() == list(range(world))


def test_bad_arguments_raise_before_anything_is_sent(tmp_path):
    run_ranks(2, _refusals, tmp_path=tmp_path)


def test_one_rank_copies_and_counts_nothing():
    comm = Comm(None)
    assert comm.world_size == 1
    x = torch.randn(37)
    out = torch.empty(37, dtype=torch.bfloat16)
    assert quantized_all_gather(comm, out, x, async_op=True) is None
    assert torch.equal(out, x.to(torch.bfloat16))
    assert quantized_reduce_scatter(comm, out, x) is None
    assert torch.equal(out, x.to(torch.bfloat16))
    quantized_reduce_scatter_2hop(comm, out, x, bits=4)
    assert torch.equal(out, x.to(torch.bfloat16)) and not comm.stats.calls
    assert formulas.quantized_all_gather_bytes(37, 1) == 0
    assert formulas.quantized_2hop_bytes(37, 1, 1) == {"shard": 0, "replicate": 0}
