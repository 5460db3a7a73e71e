"""Error feedback on the quantized gradient reduce (issue 38; the LoCo idea, arXiv
2407.04480): ``error_feedback=True`` with ``reduce_dtype="int8"`` / ``"int4"``.

A fixed gradient stream: each rank's loss is linear in the weights (``(lin(x) * v).sum()``
with fixed ``x``, ``v``), so every step's gradient is the same, and SGD with lr=1 turns the
parameters into minus the sum of the averaged gradients the reduce delivered. In float64 the
exact result is ``p0 - K * mean_r(g_r)``. Without feedback a fixed gradient's quantization
error is the same every step and adds up (K errors); with feedback the sum of what a rank
sent is the sum of its gradients minus one residual, so after K steps the parameters are
within one step's quantization error bound of the exact result (per hop on a mesh). Each run
checks both: the bound holds with feedback and is exceeded many times over without it.

Also ``memory_stats()["ef_residual"]`` equals ``formulas.error_feedback_bytes`` of the
slices sent (buckets, units; hops 2-3 on a mesh) and is in ``total``, and the refusals.
Checkpoints: the residuals are saved and restored (a resumed run is bitwise the one that went
on), a checkpoint without them loads with zero residuals, and one with them loads into an
optimizer without quantized communication at another world size (dropped).

One launch of 2 ranks (stage 2 int8, stage 3 int4, flat; and ``shard_model(gather_dtype=)``
with the quantized collectives' scratch in ``memory_stats()["comm_scratch"]``) and one of a
(2, 2) mesh (stage 2, int8, the three hops).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from test_hpz import _mesh
from torch import nn

import zerokern
from zerokern import ZeroConfig, formulas
from zerokern.checkpoint.residuals import residual_file
from zerokern.zero.shard import runtime_of

STEPS = 40
LEVELS = {"int8": 127, "int4": 7}


class Linear2(nn.Module):
    """Two bias-free linear maps; the loss is linear in their weights."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(40, 24, bias=False)
        self.b = nn.Linear(24, 40, bias=False)

    def forward(self, d: dict[str, torch.Tensor]) -> torch.Tensor:
        return (self.a(d["xa"]) * d["va"]).sum() + (self.b(d["xb"]) * d["vb"]).sum()


def _data(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return {"xa": torch.randn(4, 40, generator=g), "va": torch.randn(4, 24, generator=g),
            "xb": torch.randn(4, 24, generator=g), "vb": torch.randn(4, 40, generator=g)}


def _grads(rank: int) -> dict[str, torch.Tensor]:
    d = {k: v.double() for k, v in _data(rank).items()}
    return {"a.weight": d["va"].T @ d["xa"], "b.weight": d["vb"].T @ d["xb"]}


def _run(stage: int, bits: str, feedback: bool, mesh=None):
    torch.manual_seed(0)
    m = Linear2()
    p0 = {k: v.double().clone() for k, v in m.state_dict().items()}
    if stage == 3:
        zerokern.shard_model(m, unit_classes=(nn.Linear,), mesh=mesh)
    opt = zerokern.ZeroOptimizer(m.parameters(), torch.optim.SGD, stage=stage, lr=1.0,
                                 mesh=None if stage == 3 else mesh, reduce_dtype=bits,
                                 error_feedback=feedback)
    d = _data(dist.get_rank())
    for _ in range(STEPS):
        m(d).backward()
        opt.step()
        opt.zero_grad()
    got = {k: v.double() for k, v in zerokern.full_state_dict(m, rank0_only=False).items()}
    return got, p0, opt


def _error(got: dict, p0: dict, world: int) -> tuple[float, float]:
    """(max |p_K - exact|, max |g| over every rank's gradient), float64."""
    gs = [_grads(r) for r in range(world)]
    mean = {k: sum(g[k] for g in gs) / world for k in gs[0]}
    err = max(float((got[k] - (p0[k] - STEPS * mean[k])).abs().max()) for k in mean)
    return err, max(float(g[k].abs().max()) for g in gs for k in g)


def _check(stage: int, bits: str, hops: int, mesh=None) -> None:
    world = dist.get_world_size()
    got, p0, opt = _run(stage, bits, True, mesh)
    err, big = _error(got, p0, world)
    # One residual per hop, each at most its input's block absmax / (2 L) (a hop's input
    # is a sum of at most as many gradients as it is later divided by), plus fp32 rounding
    # of the parameters (|p| <= K |g|) and of the sums over K steps.
    tol = hops * 1.05 * big / (2 * LEVELS[bits]) + STEPS * STEPS * big * 2.0**-23
    what = f"stage {stage} {bits} {'mesh' if mesh else 'flat'}"
    assert err <= tol, f"{what}: with error feedback |p_K - exact| = {err} > {tol}"
    plain_err, _ = _error(*_run(stage, bits, False, mesh)[:2], world)
    assert plain_err > 5 * tol, f"{what}: without feedback only {plain_err} (tol {tol})"

    # The residuals: one per slice sent, fp32, as the formula says, in the total.
    s = opt.comm.world_size
    r = opt.comm.replicate.world_size if opt.comm.replicate is not None else 1
    if stage == 3:
        slices = [u.plan.padded_numel for u in opt._rt.units if u.plan.padded_numel]
    else:
        slices = [bk.numel for bk in opt.layout.buckets]
    mem = opt.memory_stats()
    assert mem["ef_residual"] == formulas.error_feedback_bytes(slices, s, r) > 0, (mem, slices)
    assert mem["total"] >= mem["ef_residual"]
    c = max(slices) // s  # a slice's chunk: its payloads sent and received at once
    assert mem["comm_scratch"] >= 2 * s * formulas.quantized_payload_bytes(
        c, LEVELS[bits].bit_length() + 1), mem


def _shard_model_gather_dtype_and_scratch() -> None:
    """shard_model(gather_dtype="int8"): the forward gathers int8 before any optimizer, and a
    ZeroAdamW without a gather_dtype of its own keeps it; the quantized collectives' payloads
    are in memory_stats()["comm_scratch"] (at least one collective's, send and receive)."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    m = Linear2()
    zerokern.shard_model(m, unit_classes=(nn.Linear,), gather_dtype="int8")
    rt = runtime_of(m)
    d = _data(dist.get_rank())
    with torch.no_grad():
        m(d)
    calls = dict(rt.comm.reset_stats().calls)  # no optimizer yet: the model's own wire
    assert calls.get("all_gather_q8", 0) >= 2 and "all_gather" not in calls, calls
    opt = zerokern.ZeroAdamW(m.parameters(), stage=3, lr=1e-2)
    m(d).backward()
    opt.step()
    kinds = opt.comm_stats()["per_kind"]
    assert "all_gather_q8" in kinds and "all_gather" not in kinds, kinds
    biggest = max(u.plan.shard_numel for u in rt.units)
    one = (world + 1) * formulas.quantized_payload_bytes(biggest)  # sent + received
    assert opt.memory_stats()["comm_scratch"] >= one
    with pytest.raises(ValueError, match="gather_dtype must be None or 'int8'"):
        zerokern.shard_model(Linear2(), gather_dtype="int4")


def _flat_case(rank: int, world: int) -> None:
    _check(2, "int8", 1)
    _check(3, "int4", 1)
    _shard_model_gather_dtype_and_scratch()


def _mesh_case(rank: int, world: int) -> None:
    _check(2, "int8", 3, _mesh())


def test_error_feedback_flat(tmp_path):
    run_ranks(2, _flat_case, tmp_path=tmp_path)


def test_error_feedback_mesh_2x2(tmp_path):
    run_ranks(4, _mesh_case, tmp_path=tmp_path)


def _opt(m: nn.Module, **kw):
    return zerokern.ZeroAdamW(m.parameters(), stage=2, lr=1e-2, **kw)


def _steps(m: nn.Module, opt, n: int) -> None:
    d = _data(dist.get_rank())
    for _ in range(n):
        m(d).backward()
        opt.step()
        opt.zero_grad()


def _save_case(rank: int, world: int, root: str) -> None:
    """Saved with feedback after 3 steps, resumed: 2 more steps are bitwise those of the run
    that went on (the residuals came back); a checkpoint saved without them loads with
    zero residuals."""
    ef = dict(reduce_dtype="int8", error_feedback=True)
    torch.manual_seed(0)
    m = Linear2()
    opt = _opt(m, **ef)
    _steps(m, opt, 3)
    zerokern.save_checkpoint(f"{root}/ef", m, opt)
    if rank == 0:
        torch.save(m.state_dict(), f"{root}/p3.pt")
    _steps(m, opt, 2)
    m2 = Linear2()
    opt2 = _opt(m2, **ef)
    zerokern.load_checkpoint(f"{root}/ef", m2, opt2)
    _steps(m2, opt2, 2)
    for k, v in m.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), f"{k}: resumed run differs"
    # A residual file changed on disk is refused (its sha256 is in meta.json), never added
    # into the next sends.
    if rank == 0:
        shutil.copytree(f"{root}/ef", f"{root}/ef_bad")
        with open(f"{root}/ef_bad/{residual_file(1)}", "r+b") as fh:
            fh.seek(-9, os.SEEK_END)
            b = fh.read(1)
            fh.seek(-9, os.SEEK_END)
            fh.write(bytes([b[0] ^ 1]))
    dist.barrier()
    with pytest.raises(zerokern.CheckpointError, match="is corrupt"):
        zerokern.load_checkpoint(f"{root}/ef_bad", m2, _opt(m2, **ef))
    torch.manual_seed(0)
    m3 = Linear2()
    opt3 = _opt(m3)
    _steps(m3, opt3, 1)
    zerokern.save_checkpoint(f"{root}/plain", m3, opt3)
    m4 = Linear2()
    opt4 = _opt(m4, **ef)
    _steps(m4, opt4, 1)  # residuals held now
    assert opt4.memory_stats()["ef_residual"] > 0
    zerokern.load_checkpoint(f"{root}/plain", m4, opt4)
    assert opt4.memory_stats()["ef_residual"] == 0  # none saved: they start from zero


def _load_plain_case(rank: int, world: int, root: str) -> None:
    """Saved with feedback on 2 ranks, loaded without quantized communication on 3: the
    residuals are dropped, the weights are the saved ones."""
    m = Linear2()
    opt = _opt(m)
    zerokern.load_checkpoint(f"{root}/ef", m, opt)
    want = torch.load(f"{root}/p3.pt")
    for k, v in m.state_dict().items():
        assert torch.equal(v, want[k]), k
    _steps(m, opt, 1)


def test_error_feedback_checkpoint(tmp_path):
    root = str(tmp_path)
    run_ranks(2, _save_case, root, tmp_path=tmp_path)
    run_ranks(3, _load_plain_case, root, tmp_path=tmp_path)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(stage=2, error_feedback=True), ValueError, r"error_feedback=True with reduce_dtype=None"),
    (dict(stage=2, error_feedback=True, reduce_dtype=torch.float32), ValueError,
     "this one is not quantized"),
    (dict(stage=2, error_feedback=1, reduce_dtype="int8"), TypeError,
     "error_feedback must be True or False"),
])
def test_error_feedback_refused(kw, exc, match):
    with pytest.raises(exc, match=match):
        ZeroConfig(**kw).validate()


def test_error_feedback_is_agreed():
    cfg = ZeroConfig(stage=2, reduce_dtype="int8", error_feedback=True)
    assert cfg.agreed()["error_feedback"] is True and cfg.wire.feedback
