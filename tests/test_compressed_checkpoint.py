"""Compressed optimizer state (issue 27) seen from outside and saved: ``opt.state``,
``shards()`` / ``edit_shards()``, the per-rank state dict, the torch-format full state dict and
checkpoints, for ``moments="int8" | "bf16"`` and ``master="none"``.

**Why runs at different world sizes can be compared bit for bit.** Each parameter's loss is
linear, ``sum(p * coef)``, with ``coef`` small integers (|coef| in 1..4) that every rank uses
alike: every partial sum of the gradient reduction is an exact small integer in bf16, and the
engines' one division by N gives ``coef`` back exactly. So the reduced gradient is the same
bits at every world size and stage, and so (the engines being bitwise equal to the
per-parameter oracle at every stage, tests/test_compressed_zero.py) is every run. A run resumed
from a checkpoint is therefore compared with the run at its own world size and stage that
never stopped, stored buffers included (codes, absmax, side buffers, master).

**The model** (bf16): ``small`` (7 x 13: under 4,096 elements, fp32 moments in side buffers),
``odd`` (61 x 71 = 4,331: int8 with a partial last block) and ``big`` (48 x 256: 48 blocks, cut
across every rank); ``odd`` and ``big`` are stage-3 units of their own.

Backend: the default (the native kernel, bitwise equal to the torch oracle); while the native
compressed kernel is not built yet, ``backend="torch"``. The assertions are the same.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_utils import run_ranks
from torch import nn

import zerokern
from zerokern.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from zerokern.checkpoint.format import META, meta_digest, rank_file
from zerokern.quant.adamw import DEFAULT_INT8_FORMAT
from zerokern.quant.fmt_v3 import quantize_blockwise_v3
from zerokern.quant.maps import (
    SIGNED_MAP_ID,
    UNSIGNED_MAP_ID,
    code_map,
    dequantize_blockwise,
    versioned_map_id,
)
from zerokern.quant.requantize import requantize_blockwise

st = pytest.importorskip("safetensors.torch")  # the [checkpoint] extra

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SHAPES = {"small": (7, 13), "odd.w": (61, 71), "big.w": (48, 256)}
SEED = 1234
SAVE_AT, MORE = 2, 2  # steps before a save, and after it
V2_MAPS = {"exp_avg": SIGNED_MAP_ID, "exp_avg_sq": UNSIGNED_MAP_ID}


def maps_of(version: int) -> dict[str, str]:
    """The code map ids of int8 format ``version``, by moment."""
    return {k: versioned_map_id(v, version) for k, v in V2_MAPS.items()}


MAPS = maps_of(DEFAULT_INT8_FORMAT)  # what a state of the default version names


def _native_or_torch() -> str | None:
    """None (the default backend) once the native compressed kernel runs; "torch" while it is
    a placeholder ("not built yet") or the built extension lacks it. Other failures propagate."""
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


class Leaf(nn.Module):
    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(*shape) * 0.5)

    def forward(self, coef: torch.Tensor) -> torch.Tensor:
        return (self.w.float() * coef).sum()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Parameter(torch.randn(*SHAPES["small"]) * 0.5)
        self.odd = Leaf(*SHAPES["odd.w"])
        self.big = Leaf(*SHAPES["big.w"])

    def forward(self, coefs: dict[str, torch.Tensor]) -> torch.Tensor:
        return ((self.small.float() * coefs["small"]).sum() + self.odd(coefs["odd.w"])
                + self.big(coefs["big.w"]))


def coefs(step: int) -> dict[str, torch.Tensor]:
    """Every parameter's gradient at ``step``: small integers, the same on every rank. The
    first element of every other 256-block is -8, the block's one largest magnitude: its
    exp_avg block has a negative absmax element, which the signed map (no -1) cannot give
    back after a trip through fp32, so only an exact copy of codes and absmax restores it."""
    out = {}
    for k, (name, shape) in enumerate(SHAPES.items()):
        g = torch.Generator().manual_seed(1000 * step + k)
        n = math.prod(shape)
        sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
        c = (torch.randint(1, 5, (n,), generator=g) * sign).float()
        c[::512] = -8.0
        out[name] = c.reshape(shape)
    return out


def build(stage: int, moments: str, master: str, *, offload: str | None = None,
          seed: int = SEED, init: int = 0, int8_format: int = DEFAULT_INT8_FORMAT,
          ) -> tuple[nn.Module, zerokern.ZeroAdamW]:
    torch.manual_seed(init)
    model: nn.Module = Net().to(torch.bfloat16)
    if stage == 3:
        model = zerokern.shard_model(model, unit_classes=(Leaf,))
    opt = zerokern.ZeroAdamW(model.parameters(), **HP, stage=stage, bucket_numel=3000,
                             offload=offload, moments=moments, master=master, seed=seed,
                             backend=BACKEND, int8_format=int8_format)
    return model, opt


def train(model: nn.Module, opt: zerokern.ZeroAdamW, start: int, steps: int) -> None:
    for step in range(start, start + steps):
        model(coefs(step)).backward()
        opt.step()
        opt.zero_grad()


def snapshot(model: nn.Module, opt: zerokern.ZeroAdamW) -> dict[str, Any]:
    """Full parameters and the full (dequantized) optimizer state, on every rank."""
    return {"params": zerokern.full_state_dict(model, rank0_only=False),
            "opt": opt.full_state_dict(rank0_only=False)}


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Bit for bit: every parameter, step and moment."""
    assert a["params"].keys() == b["params"].keys()
    for k in a["params"]:
        assert torch.equal(a["params"][k], b["params"][k]), k
    sa, sb = a["opt"]["state"], b["opt"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        assert float(sa[i]["step"]) == float(sb[i]["step"]), i
        for key in MAPS:
            assert torch.equal(sa[i][key], sb[i][key]), (i, key)


def assert_stored_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Two per-rank state dicts hold the same stored buffers, bit for bit."""
    assert a["state"].keys() == b["state"].keys()
    for k, v in a["state"].items():
        w = b["state"][k]
        assert (v is None) == (w is None), k
        if v is not None:
            assert v.dtype == w.dtype and torch.equal(v, w), k
    fa, fb = a["zerokern"]["state_format"], b["zerokern"]["state_format"]
    # The seed matters (and is restored) only without a master.
    assert {**fa, "seed": 0} == {**fb, "seed": 0}
    assert fa["master"] == "fp32" or fa["seed"] == fb["seed"]


def requantized(x: torch.Tensor, key: str, version: int = DEFAULT_INT8_FORMAT) -> torch.Tensor:
    """What storing the fp32 values ``x`` (a whole parameter) as int8 of format ``version``
    and reading them back gives: blocks of 256 of the flattened parameter (independent of any
    layout), stored by ``requantize_blockwise`` (version 2: the oracle's quantizer, but a
    block of decoded values, such as half of a decoded block, is stored exactly) or
    ``quantize_blockwise_v3`` (version 3's oracle)."""
    code = code_map(maps_of(version)[key])
    flat = x.float().reshape(-1)
    if version == 3:
        codes, absmax = quantize_blockwise_v3(flat, key == "exp_avg")
    else:
        codes, absmax = requantize_blockwise(flat, code)
    return dequantize_blockwise(codes, absmax, code).reshape(x.shape)


def assert_converted(got: dict[str, Any], saved: dict[str, Any], version: int) -> None:
    """``got`` (a snapshot) is ``saved`` converted into int8 format ``version``: the same
    parameters and steps, each int8 moment what storing the saved fp32 values in that
    version gives (``requantized``, bit for bit), fp32 moments (small parameters) as saved;
    and, into version 3, within version 3's error bound of the saved values."""
    assert all(torch.equal(got["params"][k], v) for k, v in saved["params"].items())
    for i, name in enumerate(SHAPES):
        a, b = got["opt"]["state"][i], saved["opt"]["state"][i]
        assert float(a["step"]) == float(b["step"])
        for key in MAPS:
            big = math.prod(SHAPES[name]) >= 4096
            want = requantized(b[key], key, version) if big else b[key]
            assert torch.equal(a[key], want), (name, key, version)
            if big and version == 3:
                assert_v3_bound(a[key], b[key], key)


def assert_v3_bound(y: torch.Tensor, x: torch.Tensor, key: str) -> None:
    """Version 3's per-element bound (zerokern.quant.fmt_v3), in float64:
    ``|y - x| <= |x| / 16 + s * mag(1) + 2**-21 |x| + 2**-149`` with ``s`` the block's
    absmax and ``mag(1)`` the smallest nonzero magnitude of the moment's map."""
    mag1 = 1.25 * 2.0**(-16 if key == "exp_avg" else -32)
    xf, yf = x.double().reshape(-1), y.double().reshape(-1)
    pad = -xf.numel() % 256
    s = torch.nn.functional.pad(xf.abs(), (0, pad)).view(-1, 256).amax(1)
    s = s.repeat_interleave(256)[:xf.numel()]
    bound = xf.abs() / 16 + s * mag1 + 2.0**-21 * xf.abs() + 2.0**-149
    assert bool(((yf - xf).abs() <= bound).all()), key


# -- one process: opt.state, shards, edit_shards --------------------------------------------
def _one(moments: str, master: str, stage: int = 0, **kw: Any):
    model, opt = build(stage, moments, master, **kw)
    train(model, opt, 0, 2)
    return model, opt


def whole(sh: Any, key: str) -> torch.Tensor:
    """A parameter's fp32 ``key`` from its ranges (one rank holds all of it)."""
    assert sum(r.numel for r in sh.ranges) == sh.numel
    return torch.cat([getattr(r, key) for r in sh.ranges])


def local_start(opt: zerokern.ZeroAdamW, index: int, param_offset: int) -> int:
    (pc,) = [pc for pc in opt.layout.pieces
             if pc.param == index and pc.param_offset == param_offset]
    return pc.local_start


@pytest.mark.parametrize("moments,master", [("int8", "fp32"), ("int8", "none"),
                                            ("bf16", "fp32"), ("fp32", "none")])
def test_shards_hold_fp32_and_the_stored_form(moments, master):
    model, opt = _one(moments, master)
    state = opt._slot.engine.state  # noqa: SLF001 - the reference accessor of the engine
    for sh in opt.shards(model):
        want = "fp32" if sh.numel < 4096 else moments
        for r in sh.ranges:  # buckets cut a parameter into several ranges
            s = local_start(opt, sh.index, r.start)
            m32, v32 = state.read_moments(s, r.numel)
            assert torch.equal(r.exp_avg, m32) and torch.equal(r.exp_avg_sq, v32)
            assert r.stored.moments == want and r.stored.master == master
            assert r.is_copy("exp_avg") == (want != "fp32")
            assert r.is_copy("values") == (master == "none")
            assert r.values.dtype == torch.float32
            raw = state.stored(s, r.numel)["exp_avg"]
            assert r.stored.exp_avg.data_ptr() == raw.data.data_ptr()
            if want == "int8":
                assert r.stored.exp_avg_map == MAPS["exp_avg"]
                assert torch.equal(r.stored.exp_avg_absmax, raw.absmax)
        if master == "none":  # the values are the bf16 parameter's own
            assert torch.equal(whole(sh, "values"), sh.param.detach().reshape(-1).float())
        entry = opt.state[sh.param]
        assert entry["moments"] == want and entry["master"] == master
        assert entry["ranges"] == [(r.start, r.numel) for r in sh.ranges]
        assert entry["exp_avg"].dtype == torch.float32
        assert torch.equal(entry["exp_avg"], whole(sh, "exp_avg"))


def test_edit_shards_stores_written_copies_only():
    model, opt = _one("int8", "none")
    big = model.big.w
    (before,) = [sh for sh in opt.shards() if sh.param is big]
    codes_sq = [r.stored.exp_avg_sq.clone() for r in before.ranges]
    m, vals = whole(before, "exp_avg"), whole(before, "values")
    with opt.edit_shards() as shards:
        (sh,) = [s for s in shards if s.param is big]
        for r in sh.ranges:
            r.exp_avg.mul_(0.5)  # a copy: stored on leaving (quantized)
            r.values.add_(1e-2)  # master="none": rounded to nearest even into the parameter
            r.exp_avg_sq.sum()  # read only: its codes stay as they are
    (after,) = [sh for sh in opt.shards() if sh.param is big]
    assert torch.equal(whole(after, "exp_avg"), requantized(m * 0.5, "exp_avg"))
    assert all(torch.equal(r.stored.exp_avg_sq, c) for r, c in zip(after.ranges, codes_sq))
    assert torch.equal(big.detach().reshape(-1), (vals + 1e-2).to(torch.bfloat16))


def test_opt_state_copies_follow_the_state():
    """The documented behaviour of opt.state copies (state_view.ShardedStateView): refreshed after
    each step; written in place, stored at the next step exactly as edit_shards stores."""
    model, opt = _one("int8", "fp32")
    twin_model, twin = _one("int8", "fp32")
    p, q = model.big.w, twin_model.big.w
    held = opt.state[p]["exp_avg"]
    held.mul_(0.5)  # in place into a copy
    with twin.edit_shards() as shards:
        for r in next(s for s in shards if s.param is q).ranges:
            r.exp_avg.mul_(0.5)
    # Read back before the step: the write is already in the state.
    assert torch.equal(opt.state[p]["exp_avg"], twin.state[q]["exp_avg"])
    train(model, opt, 2, 1)
    train(twin_model, twin, 2, 1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))
    assert torch.equal(held, opt.state[p]["exp_avg"])  # the held copy follows the step
    assert torch.equal(held, twin.state[q]["exp_avg"])
    # Assignment stores (quantized); reset zeroes the stored bytes.
    ones = torch.full(SHAPES["big.w"], 0.25)
    opt.state[p]["exp_avg_sq"] = ones
    assert torch.equal(opt.state[p]["exp_avg_sq"], requantized(ones, "exp_avg_sq").reshape(-1))
    with pytest.raises(ValueError, match=r"'moments'\] is 'int8', fixed"):
        opt.state[p]["moments"] = "fp32"
    del opt.state[p]
    (sh,) = [s for s in opt.shards() if s.param is p]
    assert not any(r.stored.exp_avg.any() or r.stored.exp_avg_absmax.any() for r in sh.ranges)
    assert not held.any()  # refreshed to the reset state


# -- one process: torch-format state dicts switch formats ------------------------------------
@pytest.mark.parametrize("stage", [0, 2])
def test_full_state_dict_switches_formats(stage):
    model, opt = _one("fp32", "fp32", stage)
    full = opt.full_state_dict()
    assert "state_format" not in full
    names = [n for n, _ in model.named_parameters()]
    m8, o8 = build(stage, "int8", "fp32", init=1)
    m8.load_state_dict(model.state_dict())
    o8.load_state_dict(full)  # quantized on load
    full8 = o8.full_state_dict()
    assert full8["state_format"] == {"moments": "int8", "master": "fp32", "seed": SEED,
                                     "stored_as": {0: "fp32", 1: "int8", 2: "int8"}}
    for i, name in enumerate(names):
        for key in MAPS:
            want = full["state"][i][key]
            if math.prod(SHAPES[name]) >= 4096:
                want = requantized(want, key)
            assert torch.equal(full8["state"][i][key], want), (name, key)
    back_model, back = build(stage, "fp32", "fp32", init=2)
    back_model.load_state_dict(model.state_dict())
    back.load_state_dict(full8)
    full32 = back.full_state_dict()
    for i in full8["state"]:
        for key in MAPS:
            assert torch.equal(full32["state"][i][key], full8["state"][i][key])
    # The seed of a master="none" state comes back into a master="none" optimizer only.
    mn, on = _one("int8", "none", stage, seed=77)
    fulln = on.full_state_dict()
    m2, o2 = build(stage, "bf16", "none", seed=5, init=1)
    o2.load_state_dict(fulln)
    assert o2.seed == 77
    m3, o3 = build(stage, "int8", "fp32", seed=5, init=1)
    o3.load_state_dict(fulln)
    assert o3.seed == 5


def test_per_rank_state_dict_of_another_format_is_refused():
    _, opt = _one("int8", "none")
    sd = opt.state_dict()
    _, other = build(2, "fp32", "fp32")
    with pytest.raises(ValueError, match=r"moments='int8', master='none'.*moments='fp32', "
                                         r"master='fp32'"):
        other.load_state_dict({**sd, "zerokern": {**sd["zerokern"], "stage": 2}})
    assert other.layout is None  # nothing was laid out or loaded
    _, fp32 = _one("fp32", "fp32")
    with pytest.raises(ValueError, match=r"moments='fp32', master='fp32'"):
        opt.load_state_dict(fp32.state_dict())  # an old-style (default) one, too


# -- one process: checkpoint files, round trips, consolidate -----------------------------------
@pytest.mark.parametrize("moments,master", [("int8", "fp32"), ("int8", "none"),
                                            ("bf16", "fp32"), ("fp32", "none")])
def test_checkpoint_stores_the_state_as_stored(tmp_path, moments, master):
    model, opt = _one(moments, master)
    ck = tmp_path / "ck"
    save_checkpoint(ck, model, opt)
    meta = json.loads((ck / META).read_text())
    sf = meta["state_format"]
    assert (sf["moments"], sf["master"], sf["seed"]) == (moments, master, SEED)
    assert sf.get("maps") == (MAPS if moments == "int8" else None)
    saved = st.load_file(str(ck / rank_file(0)))
    pieces = {(r[0], r[1]): r for r in meta["files"][0]["pieces"]}
    table = meta["files"][0].get("moments")
    assert (table is None) == (moments == "fp32")
    rows = {(r[0], r[1]): r for r in table or []}
    for sh, r in [(s, r) for s in opt.shards(model) for r in s.ranges]:
        _, _, n, kind, off = pieces[sh.name, r.start]
        # The values: the fp32 master, or the bf16 parameters themselves (no master).
        assert saved["master"].dtype == (torch.bfloat16 if master == "none" else torch.float32)
        assert torch.equal(saved["master"][off:off + n], r.stored.values)
        fmt = "fp32" if sh.numel < 4096 else moments
        for key in MAPS:
            raw = getattr(r.stored, key)
            if table is None:  # fp32 moments: in the state triple, as a default checkpoint
                assert torch.equal(saved[key][off:off + n], raw)
                continue
            _, _, _, row_fmt, moff, blk = rows[sh.name, r.start]
            t = saved[f"{key}.{row_fmt}"]
            assert row_fmt == fmt and t.dtype == raw.dtype
            assert torch.equal(t[moff:moff + n], raw)  # codes, bf16 or fp32 as stored
            if fmt == "int8":
                assert torch.equal(saved[f"{key}.absmax"][blk:blk + -(-n // 256)],
                                   r.stored.absmax(key))
    # Back into a fresh optimizer (another seed, other weights): bit for bit, and on.
    ref_sd = opt.state_dict()
    m2, o2 = build(0, moments, master, seed=SEED + 1, init=1)
    load_checkpoint(ck, m2, o2)
    assert o2.seed == (SEED if master == "none" else SEED + 1)
    assert_stored_same(o2.state_dict(), ref_sd)
    train(model, opt, 2, 2)
    train(m2, o2, 2, 2)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), m2.parameters()))
    assert_stored_same(o2.state_dict(), opt.state_dict())


@pytest.mark.parametrize("moments,master", [("int8", "none"), ("bf16", "fp32")])
def test_consolidate_writes_fp32_values(tmp_path, moments, master):
    from zerokern.cli import consolidate as cli

    model, opt = _one(moments, master)
    save_checkpoint(tmp_path / "ck", model, opt)
    cli.consolidate(str(tmp_path / "ck"), str(tmp_path / "model.safetensors"),
                    str(tmp_path / "adamw.pt"))
    out = st.load_file(str(tmp_path / "model.safetensors"))
    for name, p in model.named_parameters():
        # master="none": the bf16 parameters are the values; else the fp32 master, whose
        # nearest-even cast is the parameter
        want = p.detach().float() if master == "none" else out[name].to(p.dtype).float()
        assert out[name].dtype == torch.float32 and torch.equal(want, p.detach().float())
        assert master != "none" or torch.equal(out[name], want)
    # --optimizer: the moments dequantized to fp32, as full_state_dict gives them
    adamw = torch.load(tmp_path / "adamw.pt", weights_only=True)
    full = opt.full_state_dict()
    assert adamw["state"].keys() == full["state"].keys()
    for i, s in full["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            got = adamw["state"][i][key]
            assert got.dtype == torch.float32 and torch.equal(got, s[key]), (i, key)


def _edited(ck: Path, edit) -> None:
    meta = json.loads((ck / META).read_text())
    edit(meta)
    meta["meta_sha256"] = meta_digest(meta)
    (ck / META).write_text(json.dumps(meta))


EDITS = {
    "unknown-map": (lambda m: m["state_format"]["maps"].update(exp_avg="dynamic-signed-v9"),
                    r"state_format\.maps\.exp_avg is 'dynamic-signed-v9', a code map"),
    "no-table": (lambda m: m["files"][0].pop("moments"), r"files\[0\] lacks the entry 'moments'"),
    "misaligned": (lambda m: [r.__setitem__(1, 128) for r in m["files"][0]["moments"]
                              if r[0] == "big.w"], r"gap, overlap or overrun|whole 256-element"),
    "wrong-format": (lambda m: [r.__setitem__(3, "bf16") for r in m["files"][0]["moments"]
                                if r[0] == "big.w"], r"moments='int8' stores them as 'int8'"),
    "block": (lambda m: m["state_format"].update(block=128), r"state_format\.block must be 256"),
}


@pytest.mark.parametrize("case", sorted(EDITS))
def test_compressed_meta_is_checked(tmp_path, case):
    edit, match = EDITS[case]
    model, opt = _one("int8", "none")
    ck = tmp_path / "ck"
    save_checkpoint(ck, model, opt)
    _edited(ck, edit)
    m2, o2 = build(0, "int8", "none", init=1)
    before = [p.detach().clone() for p in m2.parameters()]
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(ck, m2, o2)
    assert all(torch.equal(a, b) for a, b in zip(before, m2.parameters()))


# -- ranks: per-rank state dicts ----------------------------------------------------------------
PER_RANK = ((2, None, "int8", "none"), (3, None, "int8", "fp32"), (1, "cpu", "bf16", "fp32"),
            (2, "cpu", "int8", "none"))


def _per_rank_case(rank: int, world: int) -> None:
    for stage, offload, moments, master in PER_RANK:
        model, opt = build(stage, moments, master, offload=offload)
        train(model, opt, 0, SAVE_AT)
        # model.state_dict() holds the parameters themselves: a copy, for later.
        sd, msd = opt.state_dict(), {k: v.clone() for k, v in model.state_dict().items()}
        train(model, opt, SAVE_AT, MORE)
        ref = snapshot(model, opt)
        m2, o2 = build(stage, moments, master, offload=offload, seed=SEED + 1, init=1)
        m2.load_state_dict(msd)
        o2.load_state_dict(sd)
        assert o2.seed == (SEED if master == "none" else SEED + 1)
        assert_stored_same(o2.state_dict(), sd)
        train(m2, o2, SAVE_AT, MORE)
        assert_same(snapshot(m2, o2), ref)


def test_per_rank_state_dict_round_trips(tmp_path):
    run_ranks(2, _per_rank_case, tmp_path=tmp_path)


# -- ranks: resharding (saved at world size 4, loaded at 2 and 3) -------------------------------
SAVED4 = (("int8", "fp32"), ("int8", "none"), ("fp32", "fp32"))


# The other int8 format version than the default, saved at world size 4 too (its name's tail):
# resumed exactly at world sizes 2 and 3, and converted into the default version at 2.
OTHER_VERSION = 5 - DEFAULT_INT8_FORMAT  # 3 while the default is 2, and the reverse
OTHER = ("int8", "fp32", OTHER_VERSION)


def _save4(rank: int, world: int, root: str) -> None:
    for moments, master, *version in (*SAVED4, OTHER):
        tail = f"_v{version[0]}" if version else ""
        model, opt = build(2, moments, master, **({"int8_format": version[0]} if version
                                                   else {}))
        train(model, opt, 0, SAVE_AT)
        save_checkpoint(os.path.join(root, f"ck_{moments}_{master}{tail}"), model, opt)
        ref = {"at_save": snapshot(model, opt)}
        train(model, opt, SAVE_AT, MORE)
        ref["after"] = snapshot(model, opt)
        if rank == 0:
            torch.save(ref, os.path.join(root, f"ref_{moments}_{master}{tail}.pt"))


@pytest.fixture(scope="module")
def saved4(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("saved4")
    run_ranks(4, _save4, str(root), tmp_path=root)
    return str(root)


def _resume(root: str, ck: str, stage: int, offload: str | None, moments: str, master: str,
            start: int, steps: int, int8_format: int = DEFAULT_INT8_FORMAT,
            ) -> tuple[nn.Module, zerokern.ZeroAdamW]:
    """Load ``ck`` (saved after ``start`` steps) at this world size and stage and train on:
    the stored buffers equal the uninterrupted run's at ``start``, and ``steps`` steps later
    everything equals it again, bit for bit."""
    um, uo = build(stage, moments, master, offload=offload, int8_format=int8_format)
    train(um, uo, 0, start)
    uninterrupted_sd = uo.state_dict()
    train(um, uo, start, steps)
    uninterrupted = snapshot(um, uo)
    model, opt = build(stage, moments, master, offload=offload, seed=SEED + 1, init=1,
                       int8_format=int8_format)
    load_checkpoint(os.path.join(root, ck), model, opt)
    assert opt.seed == (SEED if master == "none" else SEED + 1)
    assert_stored_same(opt.state_dict(), uninterrupted_sd)
    train(model, opt, start, steps)
    assert_same(snapshot(model, opt), uninterrupted)
    return model, opt


def _resume2(rank: int, world: int, root: str) -> None:
    for (moments, master), (stage, offload) in zip(SAVED4[:2], ((1, None), (2, "cpu"))):
        ref = torch.load(os.path.join(root, f"ref_{moments}_{master}.pt"))
        model, opt = build(stage, moments, master, offload=offload, init=1)
        load_checkpoint(os.path.join(root, f"ck_{moments}_{master}"), model, opt)
        assert_same(snapshot(model, opt), ref["at_save"])  # the dequantized state, exactly
        train(model, opt, SAVE_AT, MORE)
        assert_same(snapshot(model, opt), ref["after"])
        _resume(root, f"ck_{moments}_{master}", stage, offload, moments, master, SAVE_AT, MORE)
    # The case: saved at world size 2, stage 2 (to be loaded at 3, stage 3).
    model, opt = _resume(root, "ck_int8_none", 2, None, "int8", "none", SAVE_AT, MORE)
    save_checkpoint(os.path.join(root, "ck2_int8_none"), model, opt)
    # The other int8 format version: exactly, with offload; then converted into the default
    # version (decoded on its maps, stored by the default version's quantizer).
    ck = f"ck_int8_fp32_v{OTHER_VERSION}"
    _resume(root, ck, 1, "cpu", "int8", "fp32", SAVE_AT, MORE, int8_format=OTHER_VERSION)
    ref = torch.load(os.path.join(root, f"ref_int8_fp32_v{OTHER_VERSION}.pt"))["at_save"]
    model, opt = build(2, "int8", "fp32", init=1)
    load_checkpoint(os.path.join(root, ck), model, opt)
    assert_converted(snapshot(model, opt), ref, DEFAULT_INT8_FORMAT)


@pytest.fixture(scope="module")
def resumed2(saved4) -> str:
    run_ranks(2, _resume2, saved4, tmp_path=Path(saved4))
    return saved4


def test_reshard_world4_to_world2(resumed2):
    assert os.path.isdir(os.path.join(resumed2, "ck2_int8_none"))


def _resume3(rank: int, world: int, root: str) -> None:
    for moments, master in SAVED4[:2]:
        ref = torch.load(os.path.join(root, f"ref_{moments}_{master}.pt"))
        model, opt = build(3, moments, master, init=1)
        load_checkpoint(os.path.join(root, f"ck_{moments}_{master}"), model, opt)
        assert_same(snapshot(model, opt), ref["at_save"])
        _resume(root, f"ck_{moments}_{master}", 3, None, moments, master, SAVE_AT, MORE)
    _resume(root, "ck2_int8_none", 3, None, "int8", "none", SAVE_AT + MORE, MORE)
    _resume(root, f"ck_int8_fp32_v{OTHER_VERSION}", 3, None, "int8", "fp32", SAVE_AT, MORE,
            int8_format=OTHER_VERSION)
    # Format switching through checkpoints: fp32 (world 4) -> int8 (world 3, stage 3) -> fp32.
    ref = torch.load(os.path.join(root, "ref_fp32_fp32.pt"))["at_save"]
    m8, o8 = build(3, "int8", "fp32", init=1)
    load_checkpoint(os.path.join(root, "ck_fp32_fp32"), m8, o8)
    got = snapshot(m8, o8)
    names = list(SHAPES)
    for i, name in enumerate(names):
        for key in MAPS:
            want = ref["opt"]["state"][i][key]
            if math.prod(SHAPES[name]) >= 4096:
                want = requantized(want, key)
            assert torch.equal(got["opt"]["state"][i][key], want), (name, key)
    assert all(torch.equal(got["params"][k], ref["params"][k]) for k in ref["params"])
    save_checkpoint(os.path.join(root, "ck_switched"), m8, o8)
    m32, o32 = build(2, "fp32", "fp32", init=2)
    load_checkpoint(os.path.join(root, "ck_switched"), m32, o32)
    assert_same(snapshot(m32, o32), got)
    # int8 without a master into the default state: the bf16 parameters become the master.
    mn, on = build(2, "fp32", "fp32", init=2)
    load_checkpoint(os.path.join(root, "ck_int8_none"), mn, on)
    assert_same(snapshot(mn, on), torch.load(os.path.join(root, "ref_int8_none.pt"))["at_save"])
    for sh in on.shards(mn):
        for r in sh.ranges:
            assert torch.equal(r.values, r.values.to(torch.bfloat16).float())


def test_reshard_world4_and_world2_to_world3(resumed2):
    run_ranks(3, _resume3, resumed2, tmp_path=Path(resumed2))
