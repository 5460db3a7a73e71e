"""Quantized communication in the engine (issue 38): ``gather_dtype="int8"`` and
``reduce_dtype="int8"`` / ``"int4"`` through the quantized parts (comm/quantized_parts.py).

One run_ranks call per world (2 and 3 ranks flat, a (2, 2) mesh of 4), each looping over the
stages and options on tiny odd-sized models for 2 steps:

- every rank holds the same bits of the parameters the forward uses (stages 1-2: the flat
  parameters; stage 3: each unit as gathered);
- ``comm_stats()`` counts the quantized kinds with exactly ``zerokern.formulas``' bytes
  (scales and padding included) per mesh dim, and no 16-bit traffic of the quantized kind;
- the gathered parameters are within the codec's error bound (float64) of what was sent:
  stages 1-2 the 16-bit rounding of the fp32 master, stage 3 the unit's exact values (an
  exact gather of the same shards); the master itself is never quantized (after one step with
  an int8 gather it is bitwise the master of an unquantized run: the first forward used the
  exact initial parameters);
- the reduce parts: the flat one's result is bitwise ``quantized_reduce_scatter`` / N, the
  hybrid one's bitwise ``quantized_reduce_scatter_2hop`` / (S R), both within the codecs'
  error bounds of the exact float64 mean.

Also: the refusals (int4 gather, stage 0, offload, ``master="none"`` and fp32 parameters with
a gather at stages 1-2, a bad spelling), world size 1 (a no-op: the same bits as without the
options, nothing counted), and a checkpoint saved with quantized communication on 2 ranks
loaded without it on 3 (and back), bitwise.
"""

from __future__ import annotations

import os
from functools import reduce as _fold

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_ranks
from models import OddNet, batch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import zerokern
from zerokern import formulas
from zerokern.comm import Comm
from zerokern.comm.mesh import MeshInfo, mesh_comm
from zerokern.comm.quantized import quantized_reduce_scatter, quantized_reduce_scatter_2hop
from zerokern.comm.quantized_parts import QuantizedFlatReduce, QuantizedHybridReduce
from zerokern.quant import comm_codec as cc

G8 = {"gather_dtype": "int8"}
R8 = {"reduce_dtype": "int8"}
R4G8 = {"reduce_dtype": "int4", "gather_dtype": "int8"}
BF16_CAST = 2.0**-8  # unit roundoff of rounding into bf16
_MESHES: dict[str, DeviceMesh] = {}


def _mesh() -> DeviceMesh:
    if "2x2" not in _MESHES:
        _MESHES["2x2"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return _MESHES["2x2"]


class Stack(nn.Module):
    """Three units of one odd size (stage 3's gathers and reduces all move one size), the root
    holding no parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(13, 13) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for lin in self.layers:
            x = torch.tanh(lin(x))
        return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _same_everywhere(tensors: list[torch.Tensor], what: str) -> None:
    mine = [_bits(t.detach().cpu()) for t in tensors]
    for r, theirs in enumerate(Comm(None).all_gather_object(mine, what)):
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs)), f"{what}: rank {r} differs"


def _build(stage: int, opts: dict, mesh: DeviceMesh | None, dtype: torch.dtype):
    torch.manual_seed(0)
    if stage == 3:
        m = Stack().to(dtype)
        opt = zerokern.parallelize(m, stage=3, unit_classes=(nn.Linear,), lr=1e-2, mesh=mesh,
                                   **opts)
    else:
        m = OddNet().to(dtype)
        opt = zerokern.ZeroAdamW(m.parameters(), stage=stage, lr=1e-2, mesh=mesh, **opts)
    return m, opt


def _train_step(m: nn.Module, opt, stage: int, step: int, rank: int) -> None:
    if stage == 3:
        g = torch.Generator().manual_seed(100 * step + rank)
        m(torch.randn(4, 13, generator=g)).square().mean().backward()
    else:
        x, y = batch(step, rank)
        F.cross_entropy(m(x).float(), y).backward()
    opt.step()
    opt.zero_grad()


def _expected_bytes(opt, stage: int, opts: dict, comm: Comm) -> dict[str, dict[str, int]]:
    """Per mesh dim, the quantized kinds' bytes of one step by zerokern.formulas, from the
    sizes the engine moves (each bucket once per step; stage 3: each unit as often as the
    counted elements say)."""
    s = comm.world_size
    r = comm.replicate.world_size if comm.replicate is not None else 1
    stats = opt.comm_stats()["per_dim"]
    if stage == 3:
        sizes = {u.plan.shard_numel for u in opt._rt.units if u.plan.shard_numel}
        assert len(sizes) == 1, sizes  # Stack: one unit size
        (n,) = sizes

        def times(dim: str, kind: str, numel: int) -> dict[int, int]:
            el = stats[dim]["per_kind"][kind]["elements"]
            assert el % numel == 0, (kind, el, numel)
            return {n: el // numel}
        counts_g = times("shard", "all_gather_q8", s * n) if "gather_dtype" in opts else {}
        bits = {"int8": 8, "int4": 4}.get(opts.get("reduce_dtype"))
        counts_r = times("shard", f"reduce_scatter_q{bits}", s * n) if bits else {}
    else:
        ns = [bk.shard_numel for bk in opt.layout.buckets]
        counts_g = counts_r = {}
        for k in ns:
            counts_g[k] = counts_g.get(k, 0) + 1
        counts_r = dict(counts_g)
        if "gather_dtype" not in opts:
            counts_g = {}
        bits = {"int8": 8, "int4": 4}.get(opts.get("reduce_dtype"))
        if not bits:
            counts_r = {}
    want: dict[str, dict[str, int]] = {"shard": {}, "replicate": {}}
    for k, c in counts_g.items():
        want["shard"]["all_gather_q8"] = (want["shard"].get("all_gather_q8", 0)
                                          + c * formulas.quantized_all_gather_bytes(k, s))
    for k, c in counts_r.items():
        padded = -(-k // r) * r  # hops 2-3 split the chunk into R equal parts
        two = formulas.quantized_2hop_bytes(padded, s, r, bits)
        kind = f"reduce_scatter_q{bits}"
        # hop 1 quantizes the unpadded chunk
        want["shard"][kind] = (want["shard"].get(kind, 0)
                               + c * formulas.quantized_reduce_scatter_bytes(k, s, bits))
        if r > 1:
            p = padded // r
            for kk, b in ((kind, formulas.quantized_reduce_scatter_bytes(p, r, bits)),
                          ("all_gather_q8", formulas.quantized_all_gather_bytes(p, r, 8))):
                want["replicate"][kk] = want["replicate"].get(kk, 0) + c * b
            assert (formulas.quantized_reduce_scatter_bytes(p, r, bits)
                    + formulas.quantized_all_gather_bytes(p, r, 8)) == two["replicate"]
    return want


def _check_bytes(opt, stage: int, opts: dict, comm: Comm, what: str) -> None:
    want = _expected_bytes(opt, stage, opts, comm)
    stats = opt.comm_stats()["per_dim"]
    for dim, kinds in want.items():
        got = {k: v["bytes"] for k, v in stats[dim]["per_kind"].items() if "_q" in k}
        assert got == kinds, f"{what} {dim}: {got} != {kinds}"
    plain = {k for d in stats.values() for k in d["per_kind"]}
    if "gather_dtype" in opts:
        assert "all_gather" not in plain, what
    if "reduce_dtype" in opts:
        assert "reduce_scatter" not in plain and "all_reduce" not in plain, (what, plain)


def _check_gather_bound(m: nn.Module, opt, stage: int, comm: Comm, what: str) -> None:
    """The gathered parameters within the int8 bound of what was sent, and the same bits on
    every rank."""
    s = comm.world_size
    if stage == 3:
        rt = opt._rt
        got, exact = [], []
        for u in rt.units:
            if not u.plan.shard_numel:
                continue
            rt.gather(u)
            got.append(u.buf.detach().clone())
            rt.release(u)
            with rt.ctx.exact_gathers():
                rt.gather(u)
                exact.append(u.buf.detach().clone())
                rt.release(u)
        _same_everywhere(got, f"{what}: gathered units")
        for y, x in zip(got, exact):
            bound = cc.error_bound(cc.block_absmax(x, s), 8)  # fp32: decoded without a cast
            assert ((y.double() - x.double()).abs() <= bound).all(), what
            assert not torch.equal(y, x), f"{what}: nothing was quantized"
        return
    eng = opt._slot.engine
    _same_everywhere(list(m.parameters()), f"{what}: parameters")
    differs = False
    for ls, fs, k in eng.flat_slices(0, eng.layout.local_numel):
        x = eng.master.narrow(0, ls, k).to(torch.bfloat16)  # what the step wrote and sent
        y = eng.flat_param.narrow(0, fs, k)  # its decoding, this rank's too
        bound = (cc.error_bound(cc.block_absmax(x, 1), 8)
                 + BF16_CAST * y.double().abs() + 2.0**-134)
        assert ((y.double() - x.double()).abs() <= bound).all(), what
        differs |= not torch.equal(x, y)
    assert differs, f"{what}: the own slices were not replaced by their decoding"


def _master_untouched(rank: int, stage: int, mesh: DeviceMesh | None, what: str) -> None:
    """After one step with an int8 gather the master is bitwise the unquantized run's (the
    first forward used the exact initial parameters; the gather never wrote the master)."""
    m, opt = _build(stage, G8, mesh, torch.bfloat16)
    m0, opt0 = _build(stage, {}, mesh, torch.bfloat16)
    _train_step(m, opt, stage, 0, rank)
    _train_step(m0, opt0, stage, 0, rank)
    assert torch.equal(opt._slot.engine.master, opt0._slot.engine.master), what
    assert not all(torch.equal(p, q) for p, q in zip(m.parameters(), m0.parameters())), what


def _engine_case(rank: int, world: int, hybrid: bool) -> None:
    mesh = _mesh() if hybrid else None
    comm = mesh_comm(mesh) if hybrid else Comm(None)
    cases = ([(st, o) for st in (1, 2, 3) for o in (R4G8, R8)] if hybrid
             else [(st, o) for st in (1, 2, 3) for o in (G8, R8, R4G8)])
    for stage, opts in cases:
        what = f"world={world} hybrid={hybrid} stage={stage} {opts}"
        # 16-bit parameters at stages 1-2 (fp32 ones are refused with a gather), fp32 at 3.
        dtype = torch.float32 if stage == 3 else torch.bfloat16
        m, opt = _build(stage, opts, mesh, dtype)
        for step in range(2):
            _train_step(m, opt, stage, step, rank)
        _check_bytes(opt, stage, opts, opt.comm, what)
        if "gather_dtype" in opts:
            _check_gather_bound(m, opt, stage, opt.comm, what)
        elif stage != 3:
            _same_everywhere(list(m.parameters()), f"{what}: parameters")
        else:
            _same_everywhere([v for v in zerokern.full_state_dict(m, rank0_only=False).values()],
                             f"{what}: parameters")
    if not hybrid:
        _master_untouched(rank, 2, None, f"world={world} stage=2 master")
    _reduce_parts(rank, world, comm)


def _reduce_parts(rank: int, world: int, comm: Comm) -> None:
    """The reduce parts against the collectives they wrap (bitwise) and float64 (bounded)."""
    hybrid = comm.replicate is not None
    s, r = comm.world_size, (comm.replicate.world_size if hybrid else 1)
    for bits in (8, 4):
        for c in (38, 300):  # per-rank chunk; 300: several blocks, the last partial
            g = torch.Generator().manual_seed(c)
            ins = [torch.randn(s * c, generator=g) * 10.0 ** torch.randint(-3, 3, (s * c,),
                                                                            generator=g)
                   for _ in range(world)]
            mine = ins[rank]
            part = (QuantizedHybridReduce if hybrid else QuantizedFlatReduce)(
                MeshInfo.of(comm), torch.float32, bits)
            out = torch.empty(c)
            h = part.reduce(out, mine.clone(), "t", async_op=True)
            if h is not None:
                h.wait()
            part.complete(out, "t")
            part.settle()
            ref = torch.empty(c)
            if hybrid:
                quantized_reduce_scatter_2hop(comm, ref, mine.clone(), bits=bits)
            else:
                quantized_reduce_scatter(comm, ref, mine.clone(), bits=bits)
            assert torch.equal(out, ref / (s * r)), (bits, c)  # S * R: a power of two or 3
            me = comm.rank
            chunks = [x[me * c:(me + 1) * c] for x in ins]
            exact = _fold(lambda a, b: a + b, [x.double() for x in chunks])
            # hop 1 over every rank's chunk (each replica's partial), hops 2-3 bounded by the
            # blocks' magnitudes with hop 1's error added (as the collectives' test does).
            b1 = sum(cc.error_bound(cc.block_absmax(x, 1, cc.wire_block(bits)), bits)
                     for x in chunks)
            bound = b1 + 1e-6 * sum(x.double().abs() for x in chunks)
            if hybrid:
                big = max(float(x.abs().max()) for x in chunks) * s + float(b1.max())
                bound = (bound + r * cc.error_bound(torch.tensor(big), bits)
                         + cc.error_bound(torch.tensor(big * r), 8))
            assert ((ref.double() - exact).abs() <= bound).all(), (bits, c)
            assert not torch.equal(ref.double(), exact), (bits, c)


@pytest.mark.parametrize("world", [2, 3])
def test_flat(world, tmp_path):
    run_ranks(world, _engine_case, False, tmp_path=tmp_path)


def test_mesh_2x2(tmp_path):
    run_ranks(4, _engine_case, True, tmp_path=tmp_path)


# -- checkpoints do not depend on the communication options --------------------------------
def _refs(m: nn.Module, opt) -> dict:
    return {"model": zerokern.full_state_dict(m, rank0_only=False),
            "opt": opt.full_state_dict(rank0_only=False)["state"]}


def _assert_refs(a: dict, b: dict, what: str) -> None:
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), (what, k)
    for i, st in a["opt"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["opt"][i][k])), (what, i, k)


def _ckpt_case(rank: int, world: int, root: str, load: str | None, save: str,
               opts: dict) -> None:
    m, opt = _build(3, opts, None, torch.float32)
    if load is not None:
        zerokern.load_checkpoint(os.path.join(root, load), m, opt)
        _assert_refs(torch.load(os.path.join(root, load + ".pt")), _refs(m, opt),
                     f"loaded {load} on {world} ranks with {opts}")
    _train_step(m, opt, 3, 0, rank)
    _train_step(m, opt, 3, 1, rank)
    zerokern.save_checkpoint(os.path.join(root, save), m, opt)
    refs = _refs(m, opt)  # an exact gather even with gather_dtype="int8"
    if rank == 0:
        torch.save(refs, os.path.join(root, save + ".pt"))
    dist.barrier()


def test_checkpoint_independent_of_comm_options(tmp_path):
    root = str(tmp_path)
    run_ranks(2, _ckpt_case, root, None, "q2", R4G8, tmp_path=tmp_path)
    run_ranks(3, _ckpt_case, root, "q2", "p3", {}, tmp_path=tmp_path)
    run_ranks(2, _ckpt_case, root, "p3", "q2b", R4G8, tmp_path=tmp_path)


# -- refusals and world size 1 ---------------------------------------------------------------
@pytest.mark.parametrize("kw,match", [
    (dict(stage=3, gather_dtype="int4"), "4-bit weights are not built"),
    (dict(stage=2, gather_dtype="fp8"), "gather_dtype must be None or 'int8'"),
    (dict(stage=2, reduce_dtype="int2"), "reduce_dtype must be"),
    (dict(stage=2, reduce_dtype=torch.bfloat16), "reduce_dtype must be"),
    (dict(stage=0, gather_dtype="int8"), "stage=0"),
    (dict(stage=0, reduce_dtype="int4"), "stage=0"),
    (dict(stage=2, reduce_dtype="int8", offload="cpu"), "offload='cpu' is not built"),
    (dict(stage=3, gather_dtype="int8", offload="cpu"), "offload='cpu' is not built"),
    (dict(stage=1, gather_dtype="int8", master="none"), "master='none'"),
])
def test_refused_at_construction(kw, match):
    with pytest.raises(ValueError, match=match):
        zerokern.ZeroConfig(**kw).validate()
    p = nn.Parameter(torch.randn(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=match):
        zerokern.ZeroAdamW([p], **kw)
    assert p.grad is None


def test_fp32_parameters_with_a_gather_at_stages_1_2_refused():
    m = OddNet()
    before = [p.detach().clone() for p in m.parameters()]
    for stage in (1, 2):
        with pytest.raises(ValueError, match="fp32 parameters are their own master"):
            zerokern.ZeroAdamW(m.parameters(), stage=stage, gather_dtype="int8")
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
    zerokern.ZeroAdamW(m.parameters(), stage=2, reduce_dtype="int8")  # reduce alone: fine


def test_world_size_1_is_a_no_op():
    """One rank sends nothing: nothing is quantized, nothing counted, the same bits."""
    runs = []
    for opts in ({}, R4G8):
        torch.manual_seed(0)
        m = OddNet().to(torch.bfloat16)
        opt = zerokern.ZeroAdamW(m.parameters(), stage=2, lr=1e-2, **opts)
        for step in range(2):
            _train_step(m, opt, 2, step, 0)
        assert not any("_q" in k for k in opt.comm_stats()["per_kind"])
        runs.append([p.detach().clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_options_in_config_and_agreed():
    cfg = zerokern.ZeroConfig(stage=3, reduce_dtype="int4", gather_dtype="int8").validate()
    assert cfg.agreed()["gather_dtype"] == "int8" and cfg.agreed()["reduce_dtype"] == "int4"
    assert (cfg.wire.reduce_bits, cfg.wire.gather_bits) == (4, 8)
    assert zerokern.ZeroConfig(reduce_dtype=torch.float32).wire.reduce_bits is None
    assert "gather_dtype" in zerokern.ZeroConfig.adamw_names()
    # the integrations take every ZeroConfig field as a keyword of the same name
    from zerokern.integrations._options import config_of, pop_options

    kw = {"gather_dtype": "int8", "reduce_dtype": "int8", "stage": 3, "other": 1}
    got = config_of(None, pop_options(kw), "ZeroTrainer")
    assert (got.gather_dtype, got.reduce_dtype, kw) == ("int8", "int8", {"other": 1})
