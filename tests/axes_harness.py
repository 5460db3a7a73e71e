"""One training run per axis of ZeroAdamW on two sides, compared bit for bit: the harness of
tests/test_gpu_axes.py (CUDA/NCCL against the CPU/gloo oracle) and of
tests/test_gpu_axes_harness.py (the same harness CPU against CPU, which runs without a GPU and
shows it passes equal runs and fails different ones).

**Why bitwise.** The two sides run the same code from the same initial bits on the same
batches; what may differ is the device's arithmetic. Forward and backward matmuls on a GPU
round differently from the CPU's, so the model here has none: every parameter's loss is
linear, ``sum(p * coef)``, and its gradient is ``coef`` exactly on any device (the backward
multiplies ``coef`` by the loss's gradient 1.0). Each coefficient is k/16 with |k| <= 8, so a
sum of the gradients of up to 32 ranks is a multiple of 1/16 of magnitude at most 16 (at most
256 sixteenths: 8 significant bits), exact in bf16 and fp32 in any order NCCL or gloo adds. The
engines then divide by N once in the gradient dtype: exact for the powers of two the GPU test
runs (torch's CUDA ``div_`` by a Python scalar multiplies by its fp32 reciprocal, the CPU's
divides; for other N these may differ in the last bit, so tests/test_gpu_axes.py skips them).
So both sides feed the fused step the same gradients, and from there on the step is bitwise
by contract on every backend: the fp32 AdamW kernels follow one rounding contract
(csrc/kernels.h: the three marked fused multiply-adds, every other operation rounded on its
own), and the compressed-state kernels (bf16 / int8 moments, ``master="none"``'s stochastic
rounding keyed by seed, step and element index) equal the pure-PyTorch oracle bit for bit on
every backend. No tolerance is needed, so none is used: any difference is a finding.

Not compared, because it is not specified bitwise across devices: the loss values (a bf16
``sum`` reduces in another order on a GPU), gradient norms (clipping is off: the norm's sum
order differs by device, and with it the clip coefficient's last bits).

**What is compared**, per rank: every full parameter (stage 3: gathered) and this rank's
optimizer state through ``opt.shards()``, each range as stored (fp32 master or the bf16
parameter's own elements, fp32 / bf16 moments or int8 codes with their per-block absmax) and
each parameter's step count. Padding is not part of any range and is not compared.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from dist_utils import run_ranks
from torch import nn

import zerokern

STEPS = 4
LR, WD = 1e-2, 0.1
BUCKET = 1000  # smaller than a unit's weight: parameters straddle buckets
UNIT_W, UNIT_B = (67, 71), (29,)  # 4,757 elements: int8-compressed, last block partial
ROOT, SOMETIMES, UNUSED, FROZEN = (13, 7), (37,), (5, 3), (11,)
N_UNITS = 2

# name -> ZeroAdamW / shard_model settings. "mesh": "1xN" (1 replica of every rank: at world 1
# the degenerate 1x1 mesh) or "2xN/2" (2 replicas, world >= 4 and even).
CASES: dict[str, dict[str, Any]] = {
    **{f"stage{s}_{d}": dict(stage=s, dtype=d) for s in range(4) for d in ("fp32", "bf16")},
    "int8_stage1": dict(stage=1, dtype="bf16", moments="int8"),
    "int8_stage3": dict(stage=3, dtype="bf16", moments="int8"),
    "bf16_moments_stage2": dict(stage=2, dtype="bf16", moments="bf16"),
    "bf16_moments_stage3": dict(stage=3, dtype="bf16", moments="bf16"),
    "no_master_stage2": dict(stage=2, dtype="bf16", master="none"),
    "no_master_int8_stage3": dict(stage=3, dtype="bf16", moments="int8", master="none"),
    "offload_stage1_fp32": dict(stage=1, dtype="fp32", offload="cpu"),
    "offload_stage2_bf16": dict(stage=2, dtype="bf16", offload="cpu"),
    "offload_int8_stage2": dict(stage=2, dtype="bf16", offload="cpu", moments="int8"),
    "offload_stage3": dict(stage=3, dtype="bf16", offload="cpu"),
    "offload_params_stage3": dict(stage=3, dtype="bf16", offload="cpu", offload_params=True),
    "reduce_fp32_stage2": dict(stage=2, dtype="bf16", reduce_dtype="fp32"),
    "reduce_fp32_stage3": dict(stage=3, dtype="bf16", reduce_dtype="fp32"),
    # The Triton kernels instead of the CUDA ones on the device (the CPU side: its own kernel).
    "triton_stage2_bf16": dict(stage=2, dtype="bf16", device_backend="triton"),
    "triton_int8_no_master_stage3": dict(stage=3, dtype="bf16", moments="int8", master="none",
                                         device_backend="triton"),
    "mesh_1xN_stage0": dict(stage=0, dtype="bf16", mesh="1xN"),
    "mesh_1xN_stage2": dict(stage=2, dtype="bf16", mesh="1xN"),
    "mesh_1xN_stage3": dict(stage=3, dtype="bf16", mesh="1xN"),
    "mesh_2d_stage1": dict(stage=1, dtype="bf16", mesh="2xN/2"),
    "mesh_2d_stage2_int8": dict(stage=2, dtype="bf16", mesh="2xN/2", moments="int8"),
    "mesh_2d_stage3": dict(stage=3, dtype="bf16", mesh="2xN/2", reduce_dtype="fp32"),
}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def mesh_shape(case: dict[str, Any], world: int) -> tuple[int, int] | None:
    """The case's mesh at this world size; None: no mesh. ValueError: not possible here."""
    kind = case.get("mesh")
    if kind is None:
        return None
    if kind == "1xN":
        return (1, world)
    if world < 4 or world % 2:
        raise ValueError(f"a 2 x N/2 mesh needs an even world size >= 4, got {world}")
    return (2, world // 2)


class AxesUnit(nn.Module):
    """A stage-3 unit: a weight large enough for int8 moments and a small bias."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(UNIT_W))
        self.b = nn.Parameter(torch.randn(UNIT_B))

    def forward(self, cw: torch.Tensor, cb: torch.Tensor) -> torch.Tensor:
        return (self.w * cw).sum().float() + (self.b * cb).sum().float()


class AxesNet(nn.Module):
    """Loss linear in every parameter (gradients exact on any device: the module docstring).
    Two units; at the root a small parameter (fp32 moments under every format), one used on
    even steps only, one never used, one frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.units = nn.ModuleList(AxesUnit() for _ in range(N_UNITS))
        self.root = nn.Parameter(torch.randn(ROOT))
        self.sometimes = nn.Parameter(torch.randn(SOMETIMES))
        self.unused = nn.Parameter(torch.randn(UNUSED))
        self.frozen = nn.Parameter(torch.randn(FROZEN), requires_grad=False)

    def forward(self, coefs: list[torch.Tensor]) -> torch.Tensor:
        loss = sum((u(coefs[2 * i], coefs[2 * i + 1]) for i, u in enumerate(self.units)),
                   torch.zeros((), device=coefs[0].device))
        loss = loss + (self.root * coefs[2 * N_UNITS]).sum().float()
        if len(coefs) > 2 * N_UNITS + 1:
            loss = loss + (self.sometimes * coefs[-1]).sum().float()
        return loss


def coefs(step: int, rank: int, dtype: torch.dtype, dev: torch.device,
          bump: bool = False) -> list[torch.Tensor]:
    """This rank's loss coefficients (= gradients) of a step, drawn on the CPU so both sides
    get the same bits. ``bump``: one coefficient of the root parameter is 1/16 larger (the
    harness test's deliberate difference)."""
    g = torch.Generator().manual_seed(7919 * step + rank)
    shapes = [UNIT_W, UNIT_B] * N_UNITS + [ROOT] + ([SOMETIMES] if step % 2 == 0 else [])
    out = [torch.randint(-8, 9, sh, generator=g).to(dtype) / 16 for sh in shapes]
    if bump:
        out[2 * N_UNITS].view(-1)[0] += 1 / 16
    return [c.to(dev) for c in out]


_MESHES: dict[tuple[str, tuple[int, int]], Any] = {}


def _mesh(device_type: str, shape: tuple[int, int]) -> Any:
    """This rank process's mesh of that shape, built once (building one creates process
    groups, a collective; the rank pools live across tests)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (device_type, shape)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, shape, mesh_dim_names=("rep", "shard"))
    return _MESHES[key]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({8: torch.int64, 4: torch.int32, 2: torch.int16,
                               1: torch.uint8}[t.element_size()])


def collect(model: nn.Module, opt: zerokern.ZeroAdamW, stage: int) -> dict[str, torch.Tensor]:
    """Everything compared, on the CPU: full parameters, this rank's stored state by range,
    step counts. A collective at stage 3 (the parameters are gathered)."""
    out: dict[str, torch.Tensor] = {}
    if stage == 3:
        params = zerokern.full_state_dict(model, rank0_only=False)
    else:
        params = {n: p.detach() for n, p in model.named_parameters()}
    for name, p in params.items():
        out[f"param/{name}"] = p.detach().cpu().clone()
    for sh in opt.shards(model):
        out[f"step/{sh.name}"] = torch.tensor(sh.step)
        for r in sh.ranges:
            key = f"state/{sh.name}/{r.start}+{r.numel}"
            if r.stored is None:
                parts = {k: getattr(r, k) for k in ("values", "exp_avg", "exp_avg_sq")}
            else:
                parts = {k: getattr(r.stored, k) for k in (
                    "values", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax")}
            for k, t in parts.items():
                if t is not None:
                    out[f"{key}/{k}"] = t.detach().cpu().clone()
    return out


def check_axis(opt: zerokern.ZeroAdamW, case: dict[str, Any], dev: torch.device) -> None:
    """The run went through the axis it names (not a silent fallback)."""
    ms = opt.memory_stats()
    fmt = opt.state_format
    assert (fmt.moments, fmt.master) == (case.get("moments", "fp32"),
                                         case.get("master", "fp32"))
    if case.get("moments") == "int8":
        assert ms["exp_avg_absmax"] + ms.get("host_exp_avg_absmax", 0) > 0, ms
    if case.get("offload"):
        assert ms["host_total"] > 0 and ms["exp_avg"] == 0, ms
        if dev.type == "cuda":
            eng = opt._engine
            assert eng.host.arena.pinned and eng.pipe.copier.stream is not None
            assert eng.pipe.copier.d2h > 0 and eng.pipe.copier.h2d > 0
    if dev.type == "cuda" and case.get("device_backend"):
        assert opt.backend == case["device_backend"]
    if case.get("mesh") == "2xN/2":
        assert opt.comm.replicate.world_size == 2


def train_rank(rank: int, world: int, *, case: dict[str, Any], device: str, out: str,
               bump: bool = False) -> None:
    """Rank ``rank``'s run of ``case`` on ``device`` ("cpu" or "cuda"): STEPS steps from the
    seed-0 initial bits, then collect() saved to ``out``."""
    dev = (torch.device("cuda", torch.cuda.current_device()) if device == "cuda"
           else torch.device("cpu"))
    dtype = _DTYPES[case["dtype"]]
    stage = case["stage"]
    torch.manual_seed(0)
    model = AxesNet().to(dtype)  # built on the CPU: the same initial bits on both sides
    model = model.to(dev)
    shape = mesh_shape(case, world)
    mesh = None if shape is None else _mesh(dev.type, shape)
    if stage == 3:
        model = zerokern.shard_model(model, unit_classes=(AxesUnit,), mesh=mesh,
                                     offload_params=case.get("offload_params", False))
    reduce = case.get("reduce_dtype")
    opt = zerokern.ZeroAdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=WD,
                             stage=stage, bucket_numel=None if stage == 3 else BUCKET,
                             offload=case.get("offload"),
                             moments=case.get("moments", "fp32"),
                             master=case.get("master", "fp32"), seed=12345, mesh=mesh,
                             backend=case.get("device_backend") if dev.type == "cuda" else None,
                             reduce_dtype=None if reduce is None else _DTYPES[reduce])
    for step in range(STEPS):
        loss = model(coefs(step, rank, dtype, dev, bump=bump and step == STEPS - 1))
        assert math.isfinite(float(loss))
        loss.backward()
        opt.step()
        opt.zero_grad()
    check_axis(opt, case, dev)
    torch.save(collect(model, opt, stage), Path(out) / f"rank{rank}.pt")


def run_side(world: int, case: str, device: str, backend: str, out: Path,
             bump: bool = False) -> list[dict[str, torch.Tensor]]:
    """One side: ``case`` on ``world`` ranks of ``backend``; every rank's collect()."""
    out.mkdir(parents=True, exist_ok=True)
    run_ranks(world, train_rank, dict(case=CASES[case], device=device, out=str(out), bump=bump),
              tmp_path=out, kwargs=True, backend=backend)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(world)]


def compare_states(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                   what: str) -> None:
    """Bit for bit: the same keys, dtypes and shapes, and every element's bits (AssertionError
    listing every difference)."""
    assert want, f"{what}: nothing was collected"
    bad = [f"only on one side: {sorted(set(got) ^ set(want))}"] if got.keys() != want.keys() \
        else []
    for k in sorted(set(got) & set(want)):
        a, b = got[k], want[k]
        if a.dtype != b.dtype or a.shape != b.shape:
            bad.append(f"{k}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
            continue
        diff = _bits(a) != _bits(b)
        if bool(diff.any()):
            i = int(diff.nonzero()[0])
            gap = (a.double() - b.double()).abs().max().item()
            bad.append(f"{k}: {int(diff.sum())} of {a.numel()} elements differ (first at "
                       f"{i}: {a.reshape(-1)[i].item()!r} vs {b.reshape(-1)[i].item()!r}; "
                       f"max |diff| {gap:.3g})")
    assert not bad, f"{what}: not bitwise equal:\n  " + "\n  ".join(bad)


def compare_sides(world: int, case: str, tmp_path: Path, *, device: str, backend: str,
                  bump: bool = False) -> None:
    """``case`` on (device, backend) against the CPU/gloo oracle, both computed here."""
    want = run_side(world, case, "cpu", "gloo", tmp_path / "oracle")
    got = run_side(world, case, device, backend, tmp_path / device, bump=bump)
    for r in range(world):
        compare_states(got[r], want[r], f"{case}, world {world}, rank {r}, {device}/{backend} "
                                        "vs cpu/gloo")
