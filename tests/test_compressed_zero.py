"""Compressed optimizer state (issue 27) inside the ZeRO engines, on CPU ranks over gloo:
``ZeroAdamW(moments=, master=, seed=)`` at world sizes 1-3, stages 0-3, with and without
offload, against the per-parameter oracle
``zerokern.quant.adamw.adamw_compressed_step_reference_`` (one whole parameter at a time).

**Why bitwise comparisons are possible across world sizes.** Every parameter's loss is linear,
``sum(p * coef)``, so its gradient is ``coef`` exactly. Rank r's ``coef`` is ``base + delta_r``
with small integers (``|base|`` in 1..4, the deltas in -8..8) and ``sum_r delta_r = 0``: the
ranks really hold different gradients, yet every partial sum the reduction forms (in any
order, in bf16 or fp16) is an exact small integer and the engines' one division by N (sum,
then ``div_(N)`` in the gradient dtype) gives ``base`` exactly. So the reduced gradient is
bitwise ``base`` at every world size and stage, and the oracle stepped with ``base`` is THE
expected result of every run: after every step, every rank's full parameters and its part of
the state (the values it steps, both moments as its stored format decodes them) must equal
the oracle's bit for bit. The same expected tensors are checked at world sizes 1, 2 and 3,
so a run at world size W passing is bitwise the run at world size 1. ``base`` is never 0 and
stays within a factor 4 inside a block, inside the int8 format's faithful range (see the
oracle's docstring).

**The model** (``CompressNet``, bf16): ``small`` (7 x 13 = 91 elements, under 4,096: fp32
moments in the side buffers), ``bias`` (29), ``odd`` (61 x 71 = 4,331, compressed, not a
multiple of 256: its last block is partial), ``big`` (24 x 256 = 6,144 = 24 blocks, split
across the ranks at every sharded stage and world size > 1: the grid checks that each rank
holds only part of it). ``odd`` and ``big`` live in ``Leaf`` modules, the stage-3 units;
``small`` and ``bias`` stay in the root unit.

**The grid.** Each pytest case runs several configurations in ONE call to the long-lived rank
pool (tests/dist_utils.py), so the cost is a few steps per configuration, not a spawn.

* formats: int8 + fp32 master, int8 + no master, bf16 + fp32 master, fp32 + no master;
* engines: stage 0; stages 1 and 2 with and without ``offload="cpu"``; stage 3 plain, with
  ``offload="cpu"`` and with ``shard_model(offload_params=True)``;
* world size 3 (uneven shards, ``big`` cut across three ranks): the full product, 8 x 4;
* world size 1 (the reference of the parity statement): the full product, 8 x 4;
* world size 2: every engine x the two int8 formats. bf16 + fp32 and fp32 + none have no
  blocks (their runs are cut anywhere), so where a world size cuts the layout matters to them
  only through the stochastic-rounding index, which world size 3 exercises with the same
  code; int8 is the format whose layout (block-aligned cuts) changes with the world size.

**The other checks.** fp16 parameters with ``loss_scale="dynamic"``: a step with inf/NaN
gradients on one rank is skipped with every stored byte unchanged (codes, absmax, fp32 side
buffers, master), at world sizes 1 and 2, every engine with int8 moments, two with bf16.
Clipping, accumulation (two backward passes a step, under ``no_sync`` on even steps) and
``add_param_group`` after two steps, with int8 moments (fp32 master and none), at world sizes
2 and 3 on a covering subset of engines: equal to the oracle fed the accumulated gradients and
the clipping coefficient of the norm the engine reports (itself checked against float64).
The refusals of bad ``moments`` / ``master`` / ``seed``. ``master="none"``: reproducible per
seed and unbiased (the mean over many elements follows the exact path within 6 sigma).

Backend: the default one (the native CPU kernel, which must be bitwise the torch oracle).
While the built extension lacks it (the placeholder raising "not built yet", or a build that
predates the entry point) the optimizers get ``backend="torch"``; the assertions are the same.
"""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch import nn

import zerokern
from zerokern.kernel_contract import adam_scalars
from zerokern.quant.adamw import (
    DEFAULT_INT8_FORMAT,
    INT8_FORMATS,
    CompressedMoments,
    adamw_compressed_step_reference_,
    dequantize_moments,
    init_compressed_moments,
)
from zerokern.quant.philox import sr_bits
from zerokern.quant.rounding import stochastic_round_bf16

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
FORMATS = (("int8", "fp32"), ("int8", "none"), ("bf16", "fp32"), ("fp32", "none"))
INT8 = FORMATS[:2]
# (stage, offload): None, "cpu", or "params" (stage 3: shard_model(offload_params=True) too).
ENGINES = ((0, None), (1, None), (1, "cpu"), (2, None), (2, "cpu"), (3, None), (3, "cpu"),
           (3, "params"))
SEED = 1234
STEPS = 3
# Parameter shapes, in registration order. Names are the keys of the model's state dict.
SHAPES = {"small": (7, 13), "bias": (29,), "odd.w": (61, 71), "big.w": (24, 256)}
LATE_SHAPE = (17, 300)  # 5,100 elements: the group added after some steps (int8, partial block)


def _native_or_torch() -> str | None:
    """None (the default backend) once the native compressed kernel exists; "torch" while
    csrc/adam_compressed_cpu.cpp is the placeholder that refuses with "not built yet", or the
    built extension predates the entry point. Any other failure of the default backend is
    not hidden: it propagates."""
    from zerokern import ops

    p = torch.zeros(4)
    try:
        ops.fused_adamw_compressed_(p, torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16),
                                    torch.zeros(4, dtype=torch.bfloat16), lr=1e-3, beta1=0.9,
                                    beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    except (RuntimeError, AttributeError) as exc:
        if "not built yet" in str(exc) or "has no attribute 'adamw_compressed'" in str(exc):
            return "torch"
        raise
    return None


BACKEND = _native_or_torch()


# -- the model and its gradients ------------------------------------------------------------
class Leaf(nn.Module):
    """One weight, a stage-3 unit of its own."""

    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(*shape) * 0.5)

    def forward(self, coef: torch.Tensor) -> torch.Tensor:
        return (self.w.float() * coef).sum()


class CompressNet(nn.Module):
    """The parameters of ``SHAPES``; the loss is linear in each (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Parameter(torch.randn(*SHAPES["small"]) * 0.5)
        self.bias = nn.Parameter(torch.randn(*SHAPES["bias"]) * 0.5)
        self.odd = Leaf(*SHAPES["odd.w"])
        self.big = Leaf(*SHAPES["big.w"])

    def forward(self, coefs: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = (self.small.float() * coefs["small"]).sum() + (
            self.bias.float() * coefs["bias"]).sum()
        loss = loss + self.odd(coefs["odd.w"]) + self.big(coefs["big.w"])
        late = getattr(self, "late", None)
        if late is not None and "late.w" in coefs:
            loss = loss + late(coefs["late.w"])
        return loss


class LateNet(CompressNet):
    """CompressNet and a ``late`` unit (LATE_SHAPE) trained only once added to the
    optimizer by add_param_group."""

    def __init__(self) -> None:
        super().__init__()
        self.late = Leaf(*LATE_SHAPE)


def _make_model(dtype: torch.dtype, late: bool = False) -> CompressNet:
    torch.manual_seed(0)
    return (LateNet() if late else CompressNet()).to(dtype)


def _salt(name: str) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate(name))


def rank_coef(name: str, shape: tuple[int, ...], step: int, rank: int, world: int,
              mb: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, this rank's coefficient) of parameter ``name`` in micro-batch ``mb`` of
    ``step``: fp32 small integers; the mean over the ``world`` ranks' coefficients is
    ``base`` exactly. The sign of ``base`` depends on the step only, so the micro-batches of
    a step add up without cancelling (the accumulated gradient is never 0)."""
    n = math.prod(shape)
    sign = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(
        7919 * step + _salt(name))) * 2 - 1
    g = torch.Generator().manual_seed(7919 * step + _salt(name) + 104729 * (mb + 1))
    base = torch.randint(1, 5, (n,), generator=g) * sign
    deltas = [torch.randint(-4, 5, (n,), generator=g) for _ in range(world - 1)]
    deltas.append(-sum(deltas, torch.zeros(n, dtype=torch.int64)))
    return base.float().reshape(shape), (base + deltas[rank]).float().reshape(shape)


def _coefs(step: int, rank: int, world: int, shapes: dict[str, tuple[int, ...]], mb: int = 0,
           ) -> dict[str, torch.Tensor]:
    return {k: rank_coef(k, s, step, rank, world, mb)[1] for k, s in shapes.items()}


# -- the oracle: each parameter alone, whole ----------------------------------------------------
class Oracle:
    """``adamw_compressed_step_reference_`` over each whole parameter, in a plain dict: the
    expected bits of every run (world size, stage, offload). Parameters keep their own step
    counts (those added later start at 1), as the optimizer keeps them."""

    def __init__(self, moments: str, master: str, seed: int = SEED,
                 version: int = DEFAULT_INT8_FORMAT) -> None:
        self.moments, self.master, self.seed, self.version = moments, master, seed, version
        self.values: dict[str, torch.Tensor] = {}  # fp32 master, or the bf16 parameter
        self.lp: dict[str, torch.Tensor | None] = {}  # the 16-bit copy (master="fp32")
        self.state: dict[str, CompressedMoments] = {}
        self.steps: dict[str, int] = {}
        self.groups: dict[str, dict[str, Any]] = {}

    def add(self, params: dict[str, torch.Tensor], **group: Any) -> None:
        for k, p in params.items():
            flat = p.detach().reshape(-1)
            if self.master == "none":
                self.values[k], self.lp[k] = flat.clone(), None
            else:
                self.values[k] = flat.float()
                self.lp[k] = flat.clone() if p.dtype != torch.float32 else None
            self.state[k] = init_compressed_moments(self.moments, flat.numel(), flat.numel())
            self.steps[k] = 0
            self.groups[k] = {**HP, **group}

    def step(self, grads: dict[str, torch.Tensor], grad_scale: float = 1.0) -> None:
        for k, g in grads.items():
            self.steps[k] += 1
            grp = self.groups[k]
            s = adam_scalars(lr=grp["lr"], beta1=grp["betas"][0], beta2=grp["betas"][1],
                             eps=grp["eps"], weight_decay=grp["weight_decay"],
                             step=self.steps[k], grad_scale=grad_scale)
            n = self.values[k].numel()
            adamw_compressed_step_reference_(
                self.values[k], g.reshape(-1), self.state[k], s, moments=self.moments,
                master=self.master, total_numel=n, param_lp=self.lp[k],
                seed=self.seed if self.master == "none" else None,
                step=self.steps[k] if self.master == "none" else None,
                format_version=self.version)

    def params(self) -> dict[str, torch.Tensor]:
        """The parameters' bits as the model holds them (16-bit)."""
        out = {}
        for k, v in self.values.items():
            lp = self.lp[k]
            out[k] = (lp if lp is not None else v).clone()
        return out


def oracle_run(moments: str, master: str, version: int = DEFAULT_INT8_FORMAT,
               steps: int = STEPS) -> list[Oracle]:
    """The oracle after each of ``steps`` steps of the grid's training (copies), int8 codes
    in format ``version``."""
    model = _make_model(torch.bfloat16)
    orc = Oracle(moments, master, version=version)
    orc.add(dict(model.state_dict()))
    out = []
    for step in range(steps):
        orc.step({k: rank_coef(k, s, step, 0, 1)[0].to(torch.bfloat16)
                  for k, s in SHAPES.items()})
        out.append(copy.deepcopy(orc))
    return out


# -- the engines ------------------------------------------------------------------------------
def build(stage: int, offload: str | None, moments: str, master: str, *,
          dtype: torch.dtype = torch.bfloat16, **kw: Any,
          ) -> tuple[nn.Module, zerokern.ZeroAdamW]:
    """The model (sharded for stage 3) and its ZeroAdamW of this configuration."""
    model = _make_model(dtype)
    if stage == 3:
        model = zerokern.shard_model(model, unit_classes=(Leaf,),
                                     offload_params=offload == "params")
    opt = zerokern.ZeroAdamW(model.parameters(), **HP, stage=stage, bucket_numel=3000,
                             offload="cpu" if offload else None, moments=moments,
                             master=master, seed=SEED, backend=BACKEND, **kw)
    return model, opt


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, on every rank (stage 3 gathers; a collective)."""
    return dict(zerokern.full_state_dict(model, rank0_only=False))


def _assert_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for k, w in want.items():
        a = got[k].reshape(-1)
        assert a.dtype == w.dtype, (what, k, a.dtype, w.dtype)
        same = a.view(torch.int16) == w.view(torch.int16)
        assert bool(same.all()), (
            f"{what}: parameter {k}: {int((~same).sum())} of {a.numel()} elements differ "
            f"from the oracle (first at {int((~same).nonzero()[0])})")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_state(opt: zerokern.ZeroAdamW, orc: Oracle, names: list[str], what: str) -> None:
    """This rank's part of the state against the oracle's, bit for bit: the values each
    range steps (from shards(): the fp32 master, or with master="none" the bf16 parameter
    or its host copy) and both moments as the state decodes them (``ShardState.read_moments`` of
    every piece of the layout: the int8 codes and block absmax, the bf16 moments or the fp32
    side buffers), against ``dequantize_moments`` of the oracle's whole-parameter state."""
    for sh in opt.shards():
        k = names[sh.index]
        for r in sh.ranges:
            # As fp32 (exact for bf16): shards() hands fp32 values whatever is stored.
            want = orc.values[k][r.start:r.start + r.numel].float()
            assert torch.equal(_bits(r.values.float()), _bits(want)), f"{what}: {k} values"
    st = opt._engine.state
    for pc in opt.layout.pieces:
        if pc.param < 0 or pc.numel == 0:
            continue
        k = names[pc.param]
        got = st.read_moments(pc.local_start, pc.numel)
        want = dequantize_moments(orc.state[k], orc.version)
        for name, g, w in zip(("exp_avg", "exp_avg_sq"), got, want):
            w = w[pc.param_offset:pc.param_offset + pc.numel]
            assert torch.equal(_bits(g), _bits(w)), (
                f"{what}: {k}[{pc.param_offset}:+{pc.numel}] {name}")


def grid_case(rank: int, world: int, configs: list[tuple[Any, ...]],
              expected: dict[tuple[Any, ...], list[Oracle]]) -> None:
    """Each (stage, offload, moments, master[, int8 format version]) trained STEPS steps;
    after every step, every rank's full parameters and its part of the state bitwise equal
    to the oracle's (stepping that version; default: the optimizer's default)."""
    for stage, offload, moments, master, *version in configs:
        what = f"world {world} stage {stage} offload {offload} {moments}+{master} {version}"
        kw = {"int8_format": version[0]} if version else {}
        model, opt = build(stage, offload, moments, master, **kw)
        for step in range(STEPS):
            model(_coefs(step, rank, world, SHAPES)).backward()
            opt.step()
            opt.zero_grad()
            orc = expected[(moments, master, *version)][step]
            _assert_bits(full_params(model), orc.params(), f"{what} step {step}")
            assert_state(opt, orc, list(SHAPES), f"{what} step {step}")
        if stage > 0 and world > 1:
            # The claim is about sharded runs: this rank did hold only part of `big`.
            sh = next(s for s in opt.shards() if s.numel == math.prod(SHAPES["big.w"]))
            assert 0 < sum(r.numel for r in sh.ranges) < sh.numel, what


_EXPECTED: dict[tuple[Any, ...], list[Oracle]] = {}


def _expected(formats: tuple[tuple[Any, ...], ...]) -> dict:
    for f in formats:
        if f not in _EXPECTED:
            _EXPECTED[f] = oracle_run(*f)
    return {f: _EXPECTED[f] for f in formats}


def _grid(world: int, stages: tuple[int, ...]) -> list[tuple[int, str | None, str, str]]:
    formats = INT8 if world == 2 else FORMATS
    return [(s, o, m, ma) for s, o in ENGINES if s in stages for m, ma in formats]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stages", [(0, 1, 2), (3,)], ids=["stages0-2", "stage3"])
def test_grid_bitwise_equal_to_oracle_and_world_size_1(world, stages, tmp_path):
    configs = _grid(world, stages)
    run_ranks(world, grid_case, configs, _expected(tuple({c[2:] for c in configs})),
              tmp_path=tmp_path)


# int8 format version 3 given explicitly (and, once the default is 3, version 2 too): stages
# 1-3 each with both masters, with and without offload, at world size 2 (``big`` cut across
# the ranks), against the one oracle stepping that version: so stage- and world-size-free.
EXPLICIT_VERSIONS = sorted({3, *(v for v in INT8_FORMATS if v != DEFAULT_INT8_FORMAT)})
VERSION_ENGINES = ((1, None, "int8", "fp32"), (1, "cpu", "int8", "none"),
                   (2, None, "int8", "none"), (2, "cpu", "int8", "fp32"),
                   (3, None, "int8", "fp32"), (3, "params", "int8", "none"))


@pytest.mark.parametrize("version", EXPLICIT_VERSIONS)
def test_int8_format_version_bitwise_equal_to_its_oracle(version, tmp_path):
    configs = [(*c, version) for c in VERSION_ENGINES]
    run_ranks(2, grid_case, configs, _expected(tuple({c[2:] for c in configs})),
              tmp_path=tmp_path)


# -- the loss scaler's skipped step leaves the compressed state untouched ---------------------
STORED = ("master", "exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax",
          "exp_avg_side", "exp_avg_sq_side")
LOSS_FACTOR = 2.0**-12  # keeps coef x loss scale (2**16) within fp16's range


def stored_state(opt: zerokern.ZeroAdamW) -> dict[str, torch.Tensor]:
    """Copies of every buffer this rank's compressed state stores (codes, absmax, fp32 side
    buffers of small parameters, master), as raw bytes."""
    st = opt._engine.state
    return {k: getattr(st, k).detach().clone().view(torch.uint8) for k in STORED
            if getattr(st, k) is not None}


def scaler_case(rank: int, world: int, configs: list[tuple[int, str | None, str]],
                expected: dict[str, list[Oracle]]) -> None:
    """fp16 parameters, fp32 master, dynamic loss scale: step 1 has inf/NaN gradients on the
    last rank. It is skipped on every rank with every stored byte unchanged; steps 0 and 2
    equal the oracle's two steps."""
    for stage, offload, moments in configs:
        what = f"world {world} stage {stage} offload {offload} {moments}+fp32 fp16"
        model, opt = build(stage, offload, moments, "fp32", dtype=torch.float16,
                           loss_scale="dynamic")
        before: dict[str, torch.Tensor] = {}
        params_before: dict[str, torch.Tensor] = {}
        for step in range(3):
            loss = model(_coefs(step, rank, world, SHAPES)) * LOSS_FACTOR
            if step == 1:
                before, params_before = stored_state(opt), full_params(model)
                if rank == world - 1:
                    loss = loss * float("inf")  # inf gradients, NaN where coef is 0
            opt.scale_loss(loss).backward()
            opt.step()
            opt.zero_grad()
            if step == 1:
                assert opt.last_step_skipped and opt.scaler.skipped_steps == 1, what
                assert opt.loss_scale == 2.0**15, (what, opt.loss_scale)
                after = stored_state(opt)
                assert set(after) == set(before), what
                # What the check covered, over all ranks (a rank may hold no small
                # parameter, hence no side buffer).
                kinds = ["exp_avg_side"] + (["exp_avg_absmax"] if moments == "int8" else [])
                held = torch.tensor([float(k in after) for k in kinds])
                dist.all_reduce(held)
                assert bool((held > 0).all()), (what, kinds, held)
                for k in before:
                    assert torch.equal(before[k], after[k]), f"{what}: {k} changed"
                got = full_params(model)
                for k in params_before:
                    assert torch.equal(got[k].view(torch.int16),
                                       params_before[k].view(torch.int16)), (what, k)
                assert all(opt.shards_step(i) == 1 for i in range(4)), what
            else:
                assert not opt.last_step_skipped, what
                orc = expected[moments][step // 2]
                _assert_bits(full_params(model), orc.params(), f"{what} step {step}")
                assert_state(opt, orc, list(SHAPES), f"{what} step {step}")


def oracle_scaler_run(moments: str) -> list[Oracle]:
    """The oracle of ``scaler_case``: steps 0 and 2 (the skipped one does not count)."""
    model = _make_model(torch.float16)
    orc = Oracle(moments, "fp32")
    orc.add(dict(model.state_dict()))
    out = []
    for step in (0, 2):
        # The kernel's gradient is coef x 2**-12 x loss scale, divided by the loss scale.
        orc.step({k: rank_coef(k, s, step, 0, 1)[0].half() for k, s in SHAPES.items()},
                 grad_scale=1 / LOSS_FACTOR)
        out.append(copy.deepcopy(orc))
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_loss_scaler_skip_leaves_compressed_state_bit_identical(world, tmp_path):
    configs = [(s, o, "int8") for s, o in ENGINES]
    if world == 2:
        configs += [(2, None, "bf16"), (3, "params", "bf16")]
    expected = {m: oracle_scaler_run(m) for m in ("int8", "bf16")}
    run_ranks(world, scaler_case, configs, expected, tmp_path=tmp_path)


# -- clipping, accumulation, add_param_group --------------------------------------------------
MAX_NORM = 50.0  # well below the gradients' norm (hundreds): every step is clipped
# Adam is invariant to the gradients' scale but for eps: an eps near the clipped gradients
# (0.2-0.8) makes the clipping coefficient change every update by percents, far above a
# bf16 ulp, so a wrong coefficient cannot go unnoticed.
CLIP_EPS = 1e-2


def clip_accum_case(rank: int, world: int,
                    configs: list[tuple[int, str | None, str, str]]) -> None:
    """Two micro-batches a step (the first under no_sync on even steps, reduced on its own
    on odd ones), clipping to MAX_NORM, and ``late`` added by add_param_group after two
    steps with its own lr and no decay: every step equal to the oracle stepped with the
    accumulated gradients and the clipping coefficient of the norm the engine reports
    (torch's clip_grad_norm_ formula); that norm within 1e-6 of the exact float64 norm."""
    for stage, offload, moments, master in configs:
        what = f"world {world} stage {stage} offload {offload} {moments}+{master}"
        model = _make_model(torch.bfloat16, late=True)
        init = {k: v.clone() for k, v in model.state_dict().items()}
        if stage == 3:
            model = zerokern.shard_model(model, unit_classes=(Leaf,),
                                         offload_params=offload == "params")
        opt = zerokern.ZeroAdamW(
            [p for n, p in model.named_parameters() if not n.startswith("late.")],
            **{**HP, "eps": CLIP_EPS}, stage=stage, bucket_numel=3000,
            offload="cpu" if offload else None, moments=moments, master=master, seed=SEED,
            backend=BACKEND, max_grad_norm=MAX_NORM)
        orc = Oracle(moments, master)
        orc.add({k: init[k] for k in SHAPES}, eps=CLIP_EPS)
        shapes = dict(SHAPES)
        for step in range(4):
            if step == 2:
                opt.add_param_group({"params": [model.late.w], "lr": 2e-2,
                                     "weight_decay": 0.0})
                orc.add({"late.w": init["late.w"]}, lr=2e-2, weight_decay=0.0, eps=CLIP_EPS)
                shapes["late.w"] = LATE_SHAPE
            for mb in range(2):
                with opt.no_sync() if mb == 0 and step % 2 == 0 else nullcontext():
                    model(_coefs(step, rank, world, shapes, mb)).backward()
            opt.step()
            opt.zero_grad()
            grads = {k: sum(rank_coef(k, s, step, 0, 1, mb)[0] for mb in range(2))
                     for k, s in shapes.items()}
            exact = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
            norm = opt.last_grad_norm
            assert norm is not None and abs(norm - exact) <= 1e-6 * exact, (what, norm, exact)
            clip = min(1.0, MAX_NORM / (norm + 1e-6))
            assert clip < 0.5, (what, clip)
            orc.step({k: g.to(torch.bfloat16) for k, g in grads.items()}, grad_scale=1 / clip)
            _assert_bits(full_params(model), orc.params(), f"{what} step {step}")
            assert_state(opt, orc, [*SHAPES, "late.w"], f"{what} step {step}")


@pytest.mark.parametrize("world", [2, 3])
def test_clipping_accumulation_add_param_group_match_oracle(world, tmp_path):
    """Every stage and offload kind once with int8 + fp32 master at world size 2; int8 + no
    master at stages 1-3 there; both at world size 3 (uneven cuts) on three engines."""
    if world == 2:
        configs = [(0, None, "int8", "fp32"), (1, "cpu", "int8", "fp32"),
                   (2, None, "int8", "fp32"), (3, "params", "int8", "fp32"),
                   (1, None, "int8", "none"), (2, "cpu", "int8", "none"),
                   (3, None, "int8", "none")]
    else:
        configs = [(0, None, "int8", "none"), (2, "cpu", "int8", "fp32"),
                   (3, "cpu", "int8", "none")]
    run_ranks(world, clip_accum_case, configs, tmp_path=tmp_path)


# -- refusals -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_master_none_needs_bf16_params(dtype):
    model = _make_model(dtype)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="master"):
        zerokern.ZeroAdamW(model.parameters(), stage=1, moments="int8", master="none",
                           backend=BACKEND)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(("kw", "name"), [
    (dict(moments="int4"), "moments"), (dict(moments="INT8"), "moments"),
    (dict(master="fp16"), "master"), (dict(seed=-1), "seed"), (dict(seed=2**63), "seed"),
    (dict(seed=1.0), "seed"), (dict(int8_format=1), "int8_format"),
    (dict(int8_format=4), "int8_format"), (dict(int8_format=True), "int8_format"),
    (dict(int8_format="3"), "int8_format"), (dict(int8_format=3.0), "int8_format")])
def test_bad_format_arguments_refused(kw, name):
    model = _make_model(torch.bfloat16)
    with pytest.raises(ValueError, match=name):
        zerokern.ZeroAdamW(model.parameters(), stage=2, backend=BACKEND, **kw)


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_int8_format_3_refused_where_the_backend_cannot_run_it(monkeypatch, offload):
    """A backend outside V3_BACKENDS (the GPU kernels until they implement version 3) is
    refused at construction, naming the option and the backend, before anything changes;
    version 2, and moments that are not int8, build."""
    from zerokern.ops import adamw_compressed

    monkeypatch.setattr(adamw_compressed, "V3_BACKENDS", ("cpu",))
    model = _make_model(torch.bfloat16)
    with pytest.raises(ValueError, match=r"int8_format=3 .*backend 'torch'"):
        zerokern.ZeroAdamW(model.parameters(), stage=1, moments="int8", int8_format=3,
                           backend="torch", offload=offload)
    assert all(p.grad is None for p in model.parameters())
    for kw in (dict(moments="int8", int8_format=2), dict(moments="bf16", int8_format=3)):
        model = _make_model(torch.bfloat16)
        zerokern.ZeroAdamW(model.parameters(), stage=1, backend="torch", offload=offload,
                           **kw)


# -- master="none": stochastic rounding through the optimizer ---------------------------------
SR_N = 2**15  # elements of the parameter
SR_STEPS = 8
SR_LR = 7e-4  # each update about 0.36 of the bf16 gap below 1.0 (2**-8): round-to-nearest
#              would never move the parameter at all


def _sr_train(seed: int, steps: int = SR_STEPS) -> torch.Tensor:
    """A bf16 parameter of SR_N ones, master="none", no decay, gradient 1 everywhere at
    every step: Adam's update is lr / (1 + eps) at every step (m_hat = v_hat = 1), the same
    for every element whatever its value, so the exact trajectory is 1 - t * lr / (1 + eps)."""
    p = nn.Parameter(torch.ones(SR_N, dtype=torch.bfloat16))
    opt = zerokern.ZeroAdamW([p], lr=SR_LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                             stage=1, moments="fp32", master="none", seed=seed,
                             backend=BACKEND)
    for _ in range(steps):
        p.grad = torch.ones_like(p)
        opt.step()
        opt.zero_grad()
    return p.detach().clone()


def test_master_none_reproducible_per_seed():
    """Same seed: the same bits (the random bits are keyed by (seed, step, index), not drawn
    from a generator with state). Another seed: other bits, for a sizeable fraction of the
    elements (each element's result depends on its random word)."""
    torch.manual_seed(1)
    a = _sr_train(SEED, steps=3)
    torch.manual_seed(2)  # torch's global generator plays no part
    b = _sr_train(SEED, steps=3)
    c = _sr_train(SEED + 1, steps=3)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    differ = int((a.view(torch.int16) != c.view(torch.int16)).sum())
    assert differ > SR_N // 8, differ


def test_master_none_unbiased():
    """The mean of the parameter over its SR_N elements follows the exact (float64) path.

    After t steps each element is y_t = SR(fl32(y_{t-1} - u)), u = lr / (1 + eps): given
    uniform bits, SR is unbiased (E[SR(x)] = x) with variance at most gap**2 / 4 (gap: the
    bf16 spacing, 2**-8 on [0.5, 1)), independently across steps and elements, so the mean
    over N elements has E = 1 - t * u + r and standard deviation sigma <= gap *
    sqrt(t / (4 N)), where |r| <= t * 2**-24 bounds the fp32 rounding of each update (values
    below 1). The bound is 6 sigma + t * 2**-24: for truly random bits it fails with
    probability about 2e-9; the Philox bits are deterministic, so the test either always
    passes or always fails, it cannot flake. At N = 2**15, t = 8 the bound is 0.047 gap;
    round-to-nearest would stay at 1.0 (off by 1.43 gaps) and truncation would fall a
    whole gap every step."""
    gap = 2.0**-8
    p = _sr_train(SEED)
    exact = 1.0 - SR_STEPS * SR_LR / (1 + 1e-8)
    assert 1.0 - 2 * gap < exact < 1.0 - gap  # strictly between two bf16 values: not exact
    vals = p.double()
    mean = float(vals.mean())
    bound = 6 * gap * math.sqrt(SR_STEPS / (4 * SR_N)) + SR_STEPS * 2.0**-24
    assert abs(mean - exact) <= bound, (mean, exact, bound)
    # Each step moves an element down by 0 or 1 gap (u < gap), never up; both neighbours
    # of the exact value occur.
    assert float(vals.min()) >= 1.0 - SR_STEPS * gap and float(vals.max()) <= 1.0
    assert {1.0 - 2 * gap, 1.0 - gap} <= set(vals.unique().tolist())


def test_sr_bits_unbiased_over_steps_and_indices():
    """The rounding function with the optimizer's key: values strictly between two bf16
    neighbours (both signs, several binades, a subnormal), each rounded with
    sr_bits(seed, step, index) for 16 steps x 4,096 indices (N = 65,536 draws). With
    p = (|x| - lo) / gap the mean is x exactly in expectation and its standard deviation is
    gap * sqrt(p (1 - p) / N); the bound 6 sigma fails with probability about 2e-9 for
    random bits, and never flakes (the bits are deterministic)."""
    xs = torch.tensor([1.0 + 0.3 * 2**-7, -3.0 - 0.77 * 2**-6, 0.1, -7.3e-5, 123.456,
                       2.0**-130 * 1.37], dtype=torch.float32)
    steps = torch.arange(1, 17, dtype=torch.int64).reshape(-1, 1)
    index = torch.arange(4096, dtype=torch.int64).reshape(1, -1)
    bits = sr_bits(SEED, steps, index).reshape(-1)
    n = bits.numel()
    for x in xs:
        xd = float(x)
        lo_b = torch.tensor([x.item()]).view(torch.int32) & ~0xFFFF
        lo = abs(float(lo_b.view(torch.float32)))
        hi = abs(float((lo_b + 0x10000).view(torch.float32)))
        gap, p = hi - lo, (abs(xd) - lo) / (hi - lo)
        assert 0 < p < 1, xd
        r = stochastic_round_bf16(x.expand(n).contiguous(), bits).double()
        assert set(r.abs().unique().tolist()) == {lo, hi}, xd
        sigma = gap * math.sqrt(p * (1 - p) / n)
        assert abs(float(r.mean()) - xd) <= 6 * sigma, (xd, float(r.mean()), sigma)
