"""One optimizer over parameters of several dtypes (issue 37, item 7), stages 0-3, on gloo
ranks: a bf16 embedding with fp32 matrices, the reverse, and a bf16 embedding stepped in place
(``master="none"`` in its param group) beside fp32 parameters keeping fp32 state.

**Exact gradients at every world size.** Each parameter's loss is linear, ``sum(p * coef)``:
rank r's ``coef`` is ``base + delta_r`` with small integers and ``sum_r delta_r = 0``
(tests/test_compressed_zero.py's construction), so the averaged gradient is ``base`` bit for
bit in bf16 and fp32, at 1, 2 and 3 ranks, whatever order or dtype the reduction sums in. The
references are then stepped with ``base`` in one process, as DDP + torch.optim.AdamW would be:

* fp32 parameters: ``torch.optim.AdamW(foreach=False)``, to ``TRAIN_FP32`` (zerokern's fused
  kernel and torch's order the same fp32 operations differently);
* bf16 parameters with ``master="fp32"``: torch's AdamW on an fp32 master, written back
  rounded to nearest: our fp32 master (``shards()``) to ``TRAIN_FP32``, and every bf16 element
  this rank steps exactly its own master rounded to nearest;
* bf16 parameters with ``master="none"``: torch's AdamW would round the update to nearest
  (no comparison to make: a 1e-2 step of a value near 1 is under half a bf16 ulp for many
  elements), so the reference is the pure-PyTorch oracle of the stochastic-rounding step
  (``adamw_compressed_step_reference_``, the one test_compressed_zero.py trusts), bit for
  bit, with the clipping coefficient of the norm zerokern reports (itself within 1e-6 of
  the float64 norm).

Clipping is one global norm over every dtype (``max_grad_norm``, and
``torch.nn.utils.clip_grad_norm_`` of the whole model), with a learning rate edited through
``param_groups`` half-way. Then: the torch-format state dict (indices across all groups) round
trip into another stage and into torch.optim.AdamW; the per-rank state dict; checkpoints (bf16
with an fp32 master, and bf16 stepped in place beside fp32 state)
saved at 2 ranks loaded at 1 and at 3; the refusals.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from _tol import TRAIN_FP32
from dist_utils import run_ranks
from test_compressed_zero import rank_coef
from torch import nn

import zerokern
from zerokern.kernel_contract import adam_scalars
from zerokern.quant.adamw import adamw_compressed_step_reference_, init_compressed_moments

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SHAPES = {"emb": (40, 16), "w1": (16, 24), "b1": (24,), "w2": (24, 8)}
MAX_NORM = 5.0  # the integer gradients' norm is about 100: every step clips
STEPS = 3
SEED = 77
BF, F32 = torch.bfloat16, torch.float32
# name: (embedding dtype, matrices' dtype, embedding stepped in place, clip by max_grad_norm)
CONFIGS = {"bf16-emb": (BF, F32, False, True), "bf16-mats": (F32, BF, False, False),
           "bf16-emb-none": (BF, F32, True, True)}


class MixNet(nn.Module):
    def __init__(self, emb: torch.dtype, mats: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        for k, s in SHAPES.items():
            setattr(self, k, nn.Parameter((torch.randn(*s) * 0.5).to(emb if k == "emb"
                                                                        else mats)))

    def forward(self, coefs: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((getattr(self, k).float() * c).sum() for k, c in coefs.items())


def _groups(model: MixNet, none: bool) -> list[dict]:
    """One group, or (in place) a group splitting across two parts: the embedding stepped in
    place and b1 (fp32, its own master) with it, the matrices without decay."""
    if not none:
        return [{"params": list(model.parameters())}]
    return [{"params": [model.emb, model.b1], "master": "none"},
            {"params": [model.w1, model.w2], "weight_decay": 0.0}]


def build(name: str, stage: int) -> tuple[MixNet, zerokern.ZeroAdamW]:
    emb, mats, none, clip = CONFIGS[name]
    model = MixNet(emb, mats)
    if stage == 3:  # one root unit of two dtypes: a runtime (one flat buffer) per dtype
        zerokern.shard_model(model)
    opt = zerokern.ZeroAdamW(_groups(model, none), **HP, stage=stage, bucket_numel=300,
                             seed=SEED, max_grad_norm=MAX_NORM if clip else None)
    return model, opt


class Reference:
    """The parameters stepped with the exact averaged gradient (module docstring)."""

    def __init__(self, name: str) -> None:
        emb, mats, self.none, _ = CONFIGS[name]
        model = MixNet(emb, mats)
        self.lp = {k: p.detach().clone() for k, p in model.named_parameters()}
        self.master = {k: nn.Parameter(p.detach().float()) for k, p in self.lp.items()
                       if not (self.none and k == "emb")}
        groups = [{"params": [self.master[k] for k in ("w1", "w2")], "weight_decay": 0.0},
                  {"params": [self.master[k] for k in self.master if k not in ("w1", "w2")]}] \
            if self.none else [{"params": list(self.master.values())}]
        self.opt = torch.optim.AdamW(groups, **HP, foreach=False)
        self.state = init_compressed_moments("fp32", 640, 640)
        self.steps = 0

    def step(self, grads: dict[str, torch.Tensor], grad_scale: float) -> None:
        self.steps += 1
        for k, p in self.master.items():
            p.grad = grads[k] / grad_scale
        self.opt.step()
        for k, p in self.master.items():
            self.lp[k] = p.detach().to(self.lp[k].dtype)
        if self.none:
            g = self.opt.param_groups[1]
            s = adam_scalars(lr=g["lr"], beta1=HP["betas"][0], beta2=HP["betas"][1],
                             eps=HP["eps"], weight_decay=HP["weight_decay"], step=self.steps,
                             grad_scale=grad_scale)
            v = self.lp["emb"].reshape(-1)
            adamw_compressed_step_reference_(v, grads["emb"].reshape(-1), self.state, s,
                                             moments="fp32", master="none",
                                             total_numel=v.numel(), seed=SEED, step=self.steps)


def _check(name: str, model: MixNet, opt: zerokern.ZeroAdamW, ref: Reference, what: str) -> None:
    none = CONFIGS[name][2]
    full = model.state_dict()  # stage 3: gathered (a collective), as the others' own values
    for k, p in model.named_parameters():
        want = ref.lp[k]
        assert p.dtype == want.dtype == full[k].dtype, (what, k)
        if p.dtype == F32:
            torch.testing.assert_close(full[k], want, rtol=TRAIN_FP32[0], atol=TRAIN_FP32[1],
                                       msg=lambda m, k=k: f"{what} {k}: {m}")
        elif none:
            assert torch.equal(full[k].view(torch.int16), want.view(torch.int16)), (what, k)
    for sh in opt.shards():
        k = sh.name or next(n for n, q in model.named_parameters() if q is sh.param)
        if sh.param.dtype != BF or none:
            continue
        for r in sh.ranges:  # this rank's fp32 master, and its bf16 parameter rounded from it
            m = ref.master[k].detach().reshape(-1)[r.start:r.start + r.numel]
            torch.testing.assert_close(r.values, m, rtol=TRAIN_FP32[0], atol=TRAIN_FP32[1],
                                       msg=lambda s, k=k: f"{what} master of {k}: {s}")
            lp = full[k].reshape(-1)[r.start:r.start + r.numel]
            assert torch.equal(lp, r.values.to(BF)), (what, k)


def train(rank: int, world: int, name: str, stage: int) -> tuple[MixNet, zerokern.ZeroAdamW]:
    model, opt = build(name, stage)
    ref = Reference(name)
    clip_in_opt = CONFIGS[name][3]
    for step in range(STEPS):
        if step == 2:  # a script's (or scheduler's) edit of the user's group
            opt.param_groups[-1]["lr"] *= 0.5  # the reference's first group: the same
            ref.opt.param_groups[0]["lr"] *= 0.5
        coefs = {k: rank_coef(k, s, step, rank, world)[1] for k, s in SHAPES.items()}
        base = {k: rank_coef(k, s, step, rank, world)[0] for k, s in SHAPES.items()}
        model(coefs).backward()
        if not clip_in_opt:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        norm64 = math.sqrt(sum(float(b.double().pow(2).sum()) for b in base.values()))
        assert math.isclose(opt.last_grad_norm, norm64, rel_tol=1e-6), (opt.last_grad_norm,
                                                                        norm64)
        ref.step(base, 1.0 / min(1.0, MAX_NORM / (opt.last_grad_norm + 1e-6)))
        _check(name, model, opt, ref, f"{name} stage {stage} world {world} step {step}")
    # The statistics and opt.state span the parts as one optimizer's.
    assert opt.memory_stats()["total"] == sum(p.memory_stats()["total"] for p in opt._parts)
    assert opt.comm_stats()["numel"] == sum(math.prod(s) for s in SHAPES.values())
    assert len(opt.state) == len(SHAPES) and opt.state[model.emb]["step"] == STEPS
    return model, opt


def _same_torch_sd(a: dict, b: dict, what: str) -> None:
    assert a["param_groups"] == b["param_groups"], what
    assert sorted(a["state"]) == sorted(b["state"]), what
    for i, st in a["state"].items():
        for k, t in st.items():
            assert torch.equal(t, b["state"][i][k]), (what, i, k)


def interchange(rank: int, world: int, name: str, stage: int, model: MixNet,
                opt: zerokern.ZeroAdamW) -> None:
    """The torch-format state dict into another stage, into torch's AdamW, and the per-rank
    state dict into a twin."""
    sd = opt.full_state_dict(rank0_only=False)
    assert sorted(sd["state"]) == [0, 1, 2, 3]  # torch's numbering across all groups
    twin, opt2 = build(name, (stage + 1) % 3)
    twin.load_state_dict(model.state_dict())
    opt2.load_state_dict(sd)
    _same_torch_sd(opt2.full_state_dict(rank0_only=False), sd, f"{name} torch format")
    plain = copy.deepcopy(twin)
    torch.optim.AdamW(_groups(plain, CONFIGS[name][2]), **HP).load_state_dict(sd)
    twin3, opt3 = build(name, stage)
    twin3.load_state_dict(model.state_dict())
    opt3.load_state_dict(opt.state_dict())
    _same_torch_sd(opt3.full_state_dict(rank0_only=False), sd, f"{name} per-rank")
    assert opt3.param_groups[-1]["lr"] == opt.param_groups[-1]["lr"]


def grid_case(rank: int, world: int, stages: list[int], ckpt: str) -> None:
    for name in CONFIGS:
        for stage in stages:
            model, opt = train(rank, world, name, stage)
            if world == 2 and stage in (stages[0], 3):
                interchange(rank, world, name, stage, model, opt)
            if world == 2 and name != "bf16-mats" and stage in (2, 3):
                path = f"{ckpt}-{name}" + ("-s3" if stage == 3 else "")
                zerokern.save_checkpoint(path, model, opt)
                sd, params = opt.full_state_dict(), model.state_dict()  # collectives
                if rank == 0:
                    torch.save({"sd": sd, "params": params}, path + ".ref.pt")
    if world == 2:
        units_case(rank, world)
    else:
        load_case(rank, world, ckpt)


def load_case(rank: int, world: int, ckpt: str) -> None:
    """The checkpoints of 2 ranks at stage 2, loaded here at stage 1: the same parameters
    and the same state in torch's format (bf16 stepped in place beside fp32 state too: its
    values are saved as fp32, exactly)."""
    for name in ("bf16-emb", "bf16-emb-none", "bf16-emb-s3", "bf16-emb-none-s3"):
        path = f"{ckpt}-{name}"
        name = name.removesuffix("-s3")
        saved = torch.load(path + ".ref.pt")
        model, opt = build(name, 1)
        zerokern.load_checkpoint(path, model, opt)
        for k, p in model.state_dict().items():
            assert torch.equal(p, saved["params"][k]), (name, k)
        _same_torch_sd(opt.full_state_dict(rank0_only=False), saved["sd"],
                       f"{name} loaded at {world}")


def test_mixed_dtypes_match_references(tmp_path):
    ckpt = os.path.join(tmp_path, "ck")
    run_ranks(2, grid_case, [0, 1, 2, 3], ckpt, tmp_path=tmp_path)
    load_case(0, 1, ckpt)  # one process, no group
    run_ranks(3, grid_case, [1], ckpt, tmp_path=tmp_path)


def test_mixed_dtypes_refusals():
    model = MixNet(BF, F32)
    model.w2 = nn.Parameter(torch.zeros(3, device="meta"))
    with pytest.raises(ValueError, match="params: all trainable parameters must share one "
                                         "device"):
        zerokern.ZeroAdamW(model.parameters(), stage=1)
    model = MixNet(BF, F32)
    with pytest.raises(ValueError, match="loss_scale"):
        zerokern.ZeroAdamW(model.parameters(), stage=1, loss_scale="dynamic")
    with pytest.raises(ValueError, match=r"master \(param group 0\)"):
        zerokern.ZeroAdamW([{"params": list(model.parameters()), "master": "fp16"}])
    with pytest.raises(ValueError, match="master='none' needs bf16"):
        zerokern.ZeroAdamW([{"params": list(MixNet(torch.float16, F32).parameters()),
                             "master": "none"}])
    opt = zerokern.ZeroAdamW(model.parameters(), stage=1)
    with pytest.raises(NotImplementedError, match="add_param_group"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    with pytest.raises(ValueError, match="state_dict: saved by an optimizer with the parts"):
        opt.load_state_dict({"zerokern": {}, "state": {}, "param_groups": []})
    # Several dtypes shard (one runtime each); what shares one pipeline is refused, by name.
    with pytest.raises(ValueError, match="offload_params=True with parameters of several "
                                         "dtypes"):
        zerokern.shard_model(MixNet(BF, F32), offload_params=True)
    with pytest.raises(ValueError, match="gather_dtype='int8' with parameters of several"):
        zerokern.shard_model(MixNet(BF, F32), gather_dtype="int8")
    sharded = zerokern.shard_model(MixNet(BF, F32))
    for bad, match in (({"offload": "cpu"}, "offload='cpu' with parameters of several"),
                       ({"reduce_dtype": F32}, "reduce_dtype=torch.float32 with parameters")):
        with pytest.raises(ValueError, match=match):
            zerokern.ZeroAdamW(sharded.parameters(), stage=3, **bad)
    zerokern.ZeroAdamW(sharded.parameters(), stage=3)  # nothing was built by the refusals


def test_mixed_dtypes_load_is_all_or_nothing():
    """A torch-format state dict whose last part is refused (a moment of the wrong shape)
    leaves every part as it was: the first part's state was loaded, then put back."""
    model = MixNet(BF, F32)
    opt = zerokern.ZeroAdamW(model.parameters(), stage=1, **HP)
    model({k: torch.ones(s) for k, s in SHAPES.items()}).backward()
    opt.step()
    before = copy.deepcopy(opt.full_state_dict())
    bad = copy.deepcopy(before)
    for st in bad["state"].values():
        st["exp_avg"] = st["exp_avg"] + 1.0  # what the first part would take
    last = max(bad["state"])  # w2: the fp32 part, after the bf16 embedding's
    bad["state"][last]["exp_avg_sq"] = torch.ones(5)
    with pytest.raises(ValueError, match="exp_avg_sq"):
        opt.load_state_dict(bad)
    after = opt.full_state_dict()
    for i, st in before["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(after["state"][i][k]), torch.as_tensor(v)), (i, k)


class _Block(nn.Module):
    """A unit of two dtypes: fp32 matrix, bf16 gain (shard_model splits it, one flat buffer
    per dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.gain = nn.Parameter(torch.ones(16, dtype=BF))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.gain.float()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(32, 16).to(BF)  # the root's: bf16
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(16, 4)  # the root's: fp32

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx).float()
        for b in self.blocks:
            x = b(x)
        return self.head(x).pow(2).mean()


def test_shard_model_mixed_dtypes_units():
    """shard_model of a model whose units hold two dtypes: one runtime (one flat buffer, one
    gather arena) per dtype, the units split; the full state dict and load round trip bit for
    bit, memory_stats counts each dtype's slices in its own element size, and training at
    stage 3 (the saved activations of both dtypes' gathered units read back in the backward,
    prefetch on) gives stage 0's parameters. One process here; 2 ranks in grid_case."""
    units_case(0, 1)


def units_case(rank: int, world: int) -> None:
    """test_shard_model_mixed_dtypes_units on ``world`` ranks (the same batch on each)."""
    idx = torch.arange(24).reshape(4, 6) % 32
    plain = _Net()
    want = copy.deepcopy(plain.state_dict())
    model = zerokern.shard_model(_Net(), unit_classes=(_Block,), prefetch=1)
    rts = zerokern.zero.shard.runtime_of(model).siblings
    assert [r.dtype for r in rts] == [BF, F32]
    assert [len(r.units) for r in rts] == [4, 4]  # 3 blocks + the root, per dtype
    for r in rts:
        st = r.memory_stats()
        assert st["local_params"] == r.local_numel * (2 if r.dtype == BF else 4)
        assert r.local_numel >= sum(p.numel() for u in r.units for p in u.params)
    full = zerokern.full_state_dict(model, rank0_only=False)
    assert list(full) == list(want)
    for k, v in want.items():
        assert full[k].dtype == v.dtype and torch.equal(full[k], v), k
    opts = []
    for m, stage in ((plain, 0), (model, 3)):
        opt = zerokern.ZeroAdamW(m.parameters(), **HP, stage=stage)
        for _ in range(STEPS):
            m(idx).backward()
            opt.step()
            opt.zero_grad()
        opts.append(opt)
    got = zerokern.full_state_dict(model, rank0_only=False)
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=TRAIN_FP32[0], atol=TRAIN_FP32[1],
                                   msg=lambda s, k=k: f"{k}: {s}")
    assert opts[1].memory_stats()["total"] == sum(p.memory_stats()["total"]
                                                  for p in opts[1]._parts)
    model.load_state_dict(want)  # each dtype's slices from the full values
    for k, v in zerokern.full_state_dict(model, rank0_only=False).items():
        assert torch.equal(v, want[k]), k
