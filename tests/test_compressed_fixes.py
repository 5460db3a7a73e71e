"""Compressed optimizer state, fixes of issue 35 (items 9, 10 and 19).

* **19**: ``add_param_group`` mid-run at stage 3 with compressed moments. Parameters under
  4,096 elements keep fp32 moments in "side" buffers packed in local order; at stage 3 a new
  group's small parameter can sit before an old one in the local space, and the old state was
  carried over as a prefix, so the old parameter read another's moments. Checked against a
  per-parameter oracle (``adamw_compressed_step_reference_``) after every step, at world sizes
  1 and 2, stages 0-3 (stage 3 plain, with offload and with offloaded parameters), bf16 and
  int8 moments, with and without a master.
* **9**: ``full_state_dict`` then ``load_state_dict`` into the same int8 optimizer, and
  ``opt.state[p]["exp_avg"]`` written back unchanged, leave every stored byte as it was:
  ``zerokern.quant.requantize.requantize_blockwise`` gives a decoded block its codes back. Its
  own tests: exhaustive over every fp32 binade (subnormal to the largest) and every code, and
  a hypothesis property over random and adversarial blocks (negative maxima, ties at the
  decision thresholds, zeros, subnormals).
* **10**: ``eps=0`` with ``moments="int8"`` is refused, naming ``eps`` and ``moments``, at
  construction, in a param group, by ``add_param_group``, by ``parallelize`` and at ``step()``
  after an edit, before anything changes.

The gradients are small integers, the same on every rank: their mean over 1 or 2 ranks is
exact in bf16, so every world size must give the oracle's bits.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from dist_utils import run_ranks
from torch import nn

import zerokern
from zerokern.kernel_contract import adam_scalars
from zerokern.quant.adamw import (
    CompressedMoments,
    adamw_compressed_step_reference_,
    dequantize_moments,
    init_compressed_moments,
)
from zerokern.quant.blockwise import quantize_blockwise_v2
from zerokern.quant.maps import (
    create_dynamic_map,
    decision_thresholds,
    dequantize_blockwise,
    quantize_blockwise,
)
from zerokern.quant.requantize import requantize_blockwise

SIGNED = create_dynamic_map(True)
UNSIGNED = create_dynamic_map(False)
TINY = torch.finfo(torch.float32).tiny
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SEED = 99
STORED = ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax", "exp_avg_side",
          "exp_avg_sq_side")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.int32)


# -- the model: old and new parameters, small ones before others in the local space ----------
class Leaf(nn.Module):
    """A stage-3 unit of its own, with one or two weights."""

    def __init__(self, *shapes: tuple[int, ...]) -> None:
        super().__init__()
        self.ws = nn.ParameterList([nn.Parameter(torch.randn(*s) * 0.5) for s in shapes])


SHAPES = {  # registration order; "new." parameters join by add_param_group after 2 steps
    "new_small": (37,), "old_small": (7, 13), "pair.ws.0": (40,), "pair.ws.1": (50,),
    "nbig.ws.0": (17, 300), "obig.ws.0": (24, 256), "odd.ws.0": (61, 71)}
NEW = ("new_small", "pair.ws.0", "nbig.ws.0")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.new_small = nn.Parameter(torch.randn(37) * 0.5)
        self.old_small = nn.Parameter(torch.randn(7, 13) * 0.5)
        self.pair = Leaf((40,), (50,))
        self.nbig = Leaf((17, 300))
        self.obig = Leaf((24, 256))
        self.odd = Leaf((61, 71))

    def forward(self, coefs: dict[str, torch.Tensor]) -> torch.Tensor:
        params = dict(self.named_parameters())
        return sum((params[k].float() * c).sum() for k, c in coefs.items())


def coef(name: str, step: int) -> torch.Tensor:
    """Small nonzero integers of both signs (exact in bf16, and as a mean over ranks)."""
    g = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)))
    n = math.prod(SHAPES[name])
    sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    return (torch.randint(1, 5, (n,), generator=g) * sign).float().reshape(SHAPES[name])


class Oracle:
    """adamw_compressed_step_reference_ on each whole parameter, its own step count."""

    def __init__(self, moments: str, master: str) -> None:
        self.moments, self.master = moments, master
        self.values: dict[str, torch.Tensor] = {}
        self.lp: dict[str, torch.Tensor | None] = {}
        self.state: dict[str, CompressedMoments] = {}
        self.steps: dict[str, int] = {}
        self.lr: dict[str, float] = {}

    def add(self, params: dict[str, torch.Tensor], lr: float) -> None:
        for k, p in params.items():
            flat = p.detach().reshape(-1)
            self.values[k] = flat.clone() if self.master == "none" else flat.float()
            self.lp[k] = None if self.master == "none" else flat.clone()
            self.state[k] = init_compressed_moments(self.moments, flat.numel(), flat.numel())
            self.steps[k], self.lr[k] = 0, lr

    def step(self, names: list[str], step: int) -> None:
        for k in names:
            self.steps[k] += 1
            s = adam_scalars(lr=self.lr[k], beta1=HP["betas"][0], beta2=HP["betas"][1],
                             eps=HP["eps"], weight_decay=HP["weight_decay"],
                             step=self.steps[k])
            none = self.master == "none"
            adamw_compressed_step_reference_(
                self.values[k], coef(k, step).to(torch.bfloat16).reshape(-1), self.state[k], s,
                moments=self.moments, master=self.master, total_numel=self.values[k].numel(),
                param_lp=self.lp[k], seed=SEED if none else None,
                step=self.steps[k] if none else None)

    def param(self, k: str) -> torch.Tensor:
        lp = self.lp[k]
        return lp if lp is not None else self.values[k]


def _build(stage: int, offload: str | None, moments: str, master: str,
           ) -> tuple[nn.Module, zerokern.ZeroAdamW, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Net().to(torch.bfloat16)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    if stage == 3:
        model = zerokern.shard_model(model, unit_classes=(Leaf,),
                                     offload_params=offload == "params")
    opt = zerokern.ZeroAdamW(
        [p for n, p in model.named_parameters() if n not in NEW], **HP, stage=stage,
        bucket_numel=3000, offload="cpu" if offload else None, moments=moments,
        master=master, seed=SEED)
    return model, opt, init


def add_group_case(rank: int, world: int, configs: list[tuple[int, str | None, str, str]],
                   ) -> None:
    """Four steps, the NEW parameters added after two (their own lr); after every step the
    full parameters and this rank's moments equal the oracle's bit for bit."""
    for stage, offload, moments, master in configs:
        what = f"world {world} stage {stage} offload {offload} {moments}+{master}"
        model, opt, init = _build(stage, offload, moments, master)
        orc = Oracle(moments, master)
        orc.add({k: init[k] for k in SHAPES if k not in NEW}, HP["lr"])
        active = [k for k in SHAPES if k not in NEW]
        for step in range(4):
            if step == 2:
                params = dict(model.named_parameters())
                opt.add_param_group({"params": [params[k] for k in NEW], "lr": 2e-2})
                orc.add({k: init[k] for k in NEW}, 2e-2)
                active = list(SHAPES)
            model({k: coef(k, step) for k in active}).backward()
            opt.step()
            opt.zero_grad()
            orc.step(active, step)
            full = dict(zerokern.full_state_dict(model, rank0_only=False))
            for k in SHAPES:  # the NEW ones untouched until added
                want = orc.param(k) if k in orc.values else init[k].reshape(-1)
                assert torch.equal(full[k].reshape(-1).view(torch.int16),
                                   want.view(torch.int16)), f"{what} step {step}: {k}"
            st = opt._engine.state
            order = [k for k in SHAPES if k not in NEW] + list(NEW)  # the optimizer's indices
            for pc in opt.layout.pieces:
                k = order[pc.param] if pc.param >= 0 else None
                if k is None or pc.numel == 0 or orc.steps[k] == 0:
                    continue
                got = st.read_moments(pc.local_start, pc.numel)
                want = dequantize_moments(orc.state[k])
                for name, g, w in zip(("exp_avg", "exp_avg_sq"), got, want):
                    w = w[pc.param_offset:pc.param_offset + pc.numel]
                    assert torch.equal(_bits(g), _bits(w)), f"{what} step {step}: {k} {name}"


ENGINES = ((0, None), (1, None), (2, "cpu"), (3, None), (3, "cpu"), (3, "params"))
FORMATS = (("bf16", "fp32"), ("int8", "fp32"), ("int8", "none"), ("bf16", "none"))


@pytest.mark.parametrize("world", [1, 2])
def test_add_param_group_stage3_compressed_matches_oracle(world, tmp_path):
    configs = [(s, o, m, ma) for s, o in ENGINES for m, ma in FORMATS
               if world == 1 or s == 3 or (m, ma) == ("int8", "fp32")]
    run_ranks(world, add_group_case, configs, tmp_path=tmp_path)


# -- 10: eps=0 with int8 moments is refused ------------------------------------------------------
def _plain(dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 64), nn.Linear(64, 2)).to(dtype)


def _train(model: nn.Module, opt: zerokern.ZeroAdamW, steps: int = 2, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 128, generator=g).to(next(model.parameters()).dtype)
        model(x).float().square().sum().backward()
        opt.step()
        opt.zero_grad()


def _stored(opt: zerokern.ZeroAdamW) -> dict[str, torch.Tensor]:
    st = opt._engine.state
    out = {k: getattr(st, k).detach().clone().view(torch.uint8) for k in STORED
           if getattr(st, k) is not None}
    if st.master is not None:
        out["master"] = st.master.detach().clone().view(torch.uint8)
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


EPS_REFUSED = r"eps.* must be > 0 with moments='int8'"


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.parametrize("how", ["argument", "group"])
def test_eps_zero_with_int8_refused_at_construction(stage, how):
    model = _plain()
    if stage == 3:
        model = zerokern.shard_model(model)
    params: list[Any] = list(model.parameters())
    kw: dict[str, Any] = {"eps": 0}
    if how == "group":
        params, kw = [{"params": params, "eps": 0.0}], {}
    with pytest.raises(ValueError, match=EPS_REFUSED):
        zerokern.ZeroAdamW(params, stage=stage, moments="int8", **kw)


def test_eps_zero_with_int8_refused_by_parallelize_before_sharding():
    model = _plain()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=EPS_REFUSED):
        zerokern.parallelize(model, stage=3, moments="int8", eps=0.0)
    assert zerokern.zero.shard.runtime_of(model) is None  # shard_model did not run
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("stage", [1, 3])
def test_eps_zero_with_int8_refused_later_before_anything_changes(stage):
    """add_param_group, a param group edited to eps=0, and a torch-format state dict with
    eps=0: refused with the state, the parameters and the groups as they were."""
    model = _plain()
    if stage == 3:
        model = zerokern.shard_model(model)
    first, second = list(model[0].parameters()), list(model[1].parameters())
    opt = zerokern.ZeroAdamW(first, **HP, stage=stage, moments="int8")
    _train(model, opt)
    stored, groups = _stored(opt), [dict(g) for g in opt.param_groups]
    with pytest.raises(ValueError, match=r"eps \(param group 1\) must be > 0.*moments"):
        opt.add_param_group({"params": second, "eps": 0.0})
    assert len(opt.param_groups) == 1 and _same(_stored(opt), stored)
    sd = opt.full_state_dict(rank0_only=False)
    sd["param_groups"][0]["eps"] = 0.0
    with pytest.raises(ValueError, match=r"eps \(state_dict param group 0\).*moments"):
        opt.load_state_dict(sd)
    assert [dict(g) for g in opt.param_groups] == groups and _same(_stored(opt), stored)
    params = {k: v.clone() for k, v in zerokern.full_state_dict(model, rank0_only=False).items()}
    opt.param_groups[0]["eps"] = 0.0
    model(torch.randn(8, 128).to(torch.bfloat16)).float().sum().backward()
    with pytest.raises(ValueError, match=r"eps \(param group 0\) must be > 0.*moments"):
        opt.step()
    assert _same(_stored(opt), stored)
    after = zerokern.full_state_dict(model, rank0_only=False)
    assert all(torch.equal(after[k], v) for k, v in params.items())
    opt.param_groups[0]["eps"] = 1e-8  # and it trains on once eps is set back
    opt.step()
    assert opt.shards_step(0) == 3


@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_eps_zero_still_accepted_without_int8(moments):
    """What torch's AdamW accepts (eps=0 divides by sqrt(v) alone): unchanged there."""
    model = _plain()
    opt = zerokern.ZeroAdamW(model.parameters(), stage=2, moments=moments, eps=0.0)
    _train(model, opt, steps=1)


# -- 9: a decoded int8 state stored back is the same state ----------------------------------------
def assert_roundtrip(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                     block: int = 256) -> None:
    """``codes`` / ``absmax``: blocks whose largest decoded magnitude comes from code 1.0 or
    from the lowest code (every block quantize_blockwise makes). requantize_blockwise of the
    decoded values decodes to them bit for bit and is its own fixed point; where every code of
    a block decodes to a normal number (or is the zero code), the codes are the same, and so
    is the absmax but where another absmax one ulp away decodes to the very same block."""
    y = dequantize_blockwise(codes, absmax, code, block)
    c2, a2 = requantize_blockwise(y, code, block)
    y2 = dequantize_blockwise(c2, a2, code, block)
    assert torch.equal(_bits(y2), _bits(y)), "decoded values changed"
    c3, a3 = requantize_blockwise(y2, code, block)
    assert torch.equal(c3, c2) and torch.equal(_bits(a3), _bits(a2)), "not a fixed point"
    n = codes.numel()
    nb = absmax.numel()
    pad = nb * block - n
    cb = torch.nn.functional.pad(codes.reshape(-1).long(), (0, pad), value=int(
        (code == 0).nonzero()[0])).view(nb, block)
    vals = code[cb]
    nonzero = vals != 0
    smallest = torch.where(nonzero, vals.abs(), torch.ones_like(vals)).amin(dim=1)
    normal = (smallest.double() * absmax.double() >= TINY) & (absmax > 0)
    c2b = torch.nn.functional.pad(c2.reshape(-1).long(), (0, pad), value=int(
        (code == 0).nonzero()[0])).view(nb, block)
    # Format version 2 blocks (the scale element on code 1.0) come back with the same codes and
    # scale; a version 1 block whose maximum decoded from the lowest code (loaded as stored from
    # a version 1 checkpoint) may come back with other codes that decode to the same values.
    v2 = normal & (cb == code.numel() - 1).any(dim=1)
    assert torch.equal(c2b[v2], cb[v2]), "codes changed in a normal block"
    assert torch.equal(_bits(a2[v2]), _bits(absmax[v2])), "scale changed in a normal block"


@pytest.mark.parametrize("signed", [True, False])
def test_requantize_every_binade_and_code(signed):
    """Every fp32 binade of the absmax, subnormal to the largest finite (four mantissas
    each: 1, the largest, two others), times blocks holding every code: with code 1.0 (the
    maximum positive), and for the signed map without it (the maximum from the lowest code,
    tied with +0.99296875 or alone)."""
    code = SIGNED if signed else UNSIGNED
    bits = []
    for e in range(0, 255):  # biased exponent 0: the subnormals
        for mant in (1, 0x7FFFFF, 0x2AAAAB, 0x400000):
            bits.append((e << 23) | mant)
    absmax = torch.tensor(bits, dtype=torch.int32).view(torch.float32)
    every = torch.arange(256)
    kinds = [every]
    if signed:
        zero = int((code == 0).nonzero()[0])
        kinds += [torch.cat([every[:255], torch.tensor([zero])]),  # no 1.0: -0.993 and +0.993
                  torch.cat([every[:254], torch.tensor([zero, zero])])]  # -0.993 alone
    g = torch.Generator().manual_seed(0)
    blocks = [k[torch.randperm(256, generator=g)] for k in kinds for _ in range(len(bits))]
    codes = torch.stack(blocks).to(torch.uint8).reshape(-1)
    scales = absmax.repeat(len(kinds))
    assert_roundtrip(codes, scales, code)
    # The blocks without code 1.0 are those the oracle's quantizer does not get back.
    if signed:
        y = dequantize_blockwise(codes, scales, code)
        c2, a2 = quantize_blockwise(y, code)
        assert not torch.equal(_bits(dequantize_blockwise(c2, a2, code)), _bits(y))


def test_requantize_property_random_and_adversarial_blocks():
    """Blocks quantize_blockwise makes from random fp32 values (subnormals included), from
    values on the decision thresholds and on the map (ties) times random scales with random
    signs, with zeros, negative maxima and partial last blocks; and blocks of random codes
    holding code 1.0 or the lowest code, under random absmax values (subnormal to huge)."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True)
    positive32 = st.floats(min_value=2.0**-149, max_value=torch.finfo(torch.float32).max,
                           width=32, allow_subnormal=True)

    @hypothesis.settings(max_examples=150, deadline=None, derandomize=True, database=None)
    @hypothesis.given(
        kind=st.sampled_from(["values", "ties", "codes"]),
        values=st.lists(finite32, min_size=1, max_size=600),
        picks=st.lists(st.integers(0, 2**20), min_size=1, max_size=600),
        scale=positive32,
        block=st.sampled_from([1, 7, 256]),
        signed=st.booleans(),
        neg_max=st.booleans(),
    )
    def check(kind, values, picks, scale, block, signed, neg_max):
        code = SIGNED if signed else UNSIGNED
        if kind == "codes":
            c = torch.tensor(picks, dtype=torch.int64) % 256
            nb = -(-c.numel() // block)
            top = 0 if signed and neg_max else 255
            c.view(-1)[::block] = top  # every block holds its maximum code
            absmax = torch.full((nb,), scale, dtype=torch.float32)
            assert_roundtrip(c.to(torch.uint8), absmax, code, block)
            return
        if kind == "values":
            x = torch.tensor(values, dtype=torch.float32)
        else:
            table = torch.cat([decision_thresholds(code), code])
            idx = torch.tensor(picks) % table.numel()
            sign = torch.where(torch.tensor(picks) % 3 == 0, -1.0, 1.0)
            x = (table[idx].double() * sign * scale).float()
            x[::5] = 0.0
            if neg_max:
                x[0] = -x.abs().max()
        x = x if signed else x.abs()
        for quantize in (quantize_blockwise_v2, quantize_blockwise):  # format versions 2, 1
            codes, absmax = quantize(x, code, block)
            if bool(torch.isfinite(absmax).all()):
                assert_roundtrip(codes, absmax, code, block)

    check()


def _negative_max_blocks(sd: dict[str, Any]) -> int:
    """Blocks of exp_avg (compressed parameters) whose largest magnitude is negative only."""
    n = 0
    for st in sd["state"].values():
        m = st["exp_avg"].reshape(-1).float()
        if m.numel() < 4096:
            continue
        pad = torch.nn.functional.pad(m, (0, -m.numel() % 256)).view(-1, 256)
        n += int((pad.amin(dim=1).abs() > pad.amax(dim=1)).sum())
    return n


def _moments(opt: zerokern.ZeroAdamW) -> dict[str, torch.Tensor]:
    """The stored moments' bytes (torch's format has no master: a load takes it from the
    parameters)."""
    out = _stored(opt)
    out.pop("master", None)
    return out


def roundtrip_case(rank: int, world: int, configs: list[tuple[int, str | None, str]]) -> None:
    """After three steps: a torch-format round trip (twice), opt.state[p] moments written back
    unchanged (assigned, and edited in place), and edit_shards copies written in place
    unchanged leave every stored byte of the moments (codes, absmax, side buffers) as it was."""
    for stage, offload, master in configs:
        what = f"world {world} stage {stage} offload {offload} int8+{master}"
        model, opt, _ = _build(stage, offload, "int8", master)
        named = dict(model.named_parameters())
        opt.add_param_group({"params": [named[k] for k in NEW]})  # before the first step
        for step in range(3):
            model({k: coef(k, step) for k in SHAPES}).backward()
            opt.step()
            opt.zero_grad()
        changed = []
        before = _moments(opt)
        for p in named.values():
            entry = opt.state[p]
            entry["exp_avg"] = entry["exp_avg"].clone()
            opt.state[p]["exp_avg_sq"].mul_(1.0)  # in place: adopted at the next read
            _ = opt.state[p]
        if not _same(_moments(opt), before):
            changed.append("opt.state moments written back")
        before = _moments(opt)
        with opt.edit_shards() as shards:
            for sh in shards:
                for r in sh.ranges:
                    r.exp_avg.mul_(1.0)
        if not _same(_moments(opt), before):
            changed.append("edit_shards copies written back")
        before = _moments(opt)
        for _ in range(2):
            sd = opt.full_state_dict(rank0_only=False)
            assert _negative_max_blocks(sd) > 0, what  # the blocks the old path changed
            opt.load_state_dict(sd)
        if not _same(_moments(opt), before):
            changed.append("torch-format round trips")
        assert not changed, f"{what}: stored moments changed by {changed}"


@pytest.mark.parametrize("world", [1, 2])
def test_int8_state_roundtrips_leave_stored_bytes(world, tmp_path):
    configs = [(0, None, "fp32"), (1, None, "none"), (2, "cpu", "fp32"), (3, None, "fp32"),
               (3, "params", "none")]
    run_ranks(world, roundtrip_case, configs, tmp_path=tmp_path)


# -- the optimizer's step calls the kernels directly -------------------------------------------
@pytest.mark.parametrize("moments,master", [("int8", "fp32"), ("bf16", "none"), ("fp32", "fp32")])
def test_engine_step_skips_the_public_ops_checks_with_the_same_bits(monkeypatch, moments,
                                                                    master):
    """The step runs each run of a compressed state (about one per parameter) through
    ``engine_step_`` and each range of the default state through ``engine_adamw_``: no
    per-call argument checks and no custom-op dispatch, whose Python cost was about ten
    times the kernel call's; the bits are the public ops'."""
    import zerokern.zero.rules.adamw as rule_mod
    from zerokern import ops
    from zerokern.ops import adamw as fp32mod
    from zerokern.ops import adamw_compressed as opmod

    def train(public: bool) -> dict[str, torch.Tensor]:
        model = _plain()
        opt = zerokern.ZeroAdamW(model.parameters(), **HP, stage=2, moments=moments,
                                 master=master, seed=3)
        with monkeypatch.context() as mp:
            if public:  # the path before: the public ops
                mp.setattr(rule_mod, "engine_step_",
                           lambda *a, **k: ops.fused_adamw_compressed_(*a, **k))
                mp.setattr(rule_mod, "engine_adamw_", lambda *a, **k: ops.fused_adamw_(*a, **k))
            else:
                def dispatched(*a: Any, **k: Any) -> None:
                    raise AssertionError("the optimizer's step dispatched a public op")

                mp.setattr(opmod, "_op", dispatched)
                mp.setattr(fp32mod, "_fused_adamw_op", dispatched)
            _train(model, opt)
        out = _stored(opt)
        out.update({k: v.view(torch.uint8) for k, v in
                    zerokern.full_state_dict(model, rank0_only=False).items()})
        return out

    assert _same(train(public=False), train(public=True))


@pytest.mark.parametrize("moments", ["fp32", "int8"])
def test_group_changed_after_clip_is_checked_before_the_step(moments):
    """clip_grad_norm_ reduces the gradients and checks the groups; a group changed after it
    (lr set to NaN or below 0) is refused by step(), which then reuses that reduction, with
    nothing modified (the optimizer's kernels take the values as given)."""
    model = _plain()
    opt = zerokern.ZeroAdamW(model.parameters(), **HP, stage=2, moments=moments)
    _train(model, opt, steps=1)
    for bad in (float("nan"), -1.0):
        stored = _stored(opt)
        params = {k: v.clone() for k, v in model.state_dict().items()}
        model(torch.randn(8, 128).to(torch.bfloat16)).float().sum().backward()
        opt.clip_grad_norm_(1.0)
        opt.param_groups[0]["lr"] = bad
        with pytest.raises(ValueError, match=r"lr"):
            opt.step()
        assert _same(_stored(opt), stored)
        assert all(torch.equal(v, params[k]) for k, v in model.state_dict().items())
        opt.param_groups[0]["lr"] = HP["lr"]
        opt.step()  # the same reduction, stepped once the group is fixed
        opt.zero_grad()
