"""ZeRO-Offload (ZeroAdamW(..., offload="cpu"), shard_model(..., offload_params=True)) against
the same run without offload, bitwise, on CPU ranks over gloo.

With no GPU the "device" is the CPU, but the offload path runs for real: the host state in its
own arena, every gradient through the staging slots, the per-bucket pipeline. Each case trains
an offloaded and a plain optimizer side by side in the same processes on the same data and
demands identical bits after every step (parameters, master, moments, the clipping norm).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from models import Block, OddNet, TinyGPT, batch

import zerokern
from zerokern.zero.offload import ShardPhase

HP = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.05)


def _build(stage, dtype, offload, *, offload_params=False, clip=None, loss_scale=None,
           seed=0, bucket_numel=61, gpt=None):
    torch.manual_seed(seed)
    model = (TinyGPT() if (stage == 3 if gpt is None else gpt) else OddNet()).to(dtype)
    if stage == 3:
        model = zerokern.shard_model(model, unit_classes=(Block,), offload_params=offload_params)
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    other = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    groups = [dict(params=decay), dict(params=other, weight_decay=0.0, lr=HP["lr"] * 2)]
    opt = zerokern.ZeroAdamW(groups, **HP, stage=stage, bucket_numel=bucket_numel,
                             max_grad_norm=clip, loss_scale=loss_scale,
                             offload="cpu" if offload else None)
    return model, opt


def _loss(model, stage, step, rank, mb):
    x, y = batch(10 * step + mb, rank)
    if isinstance(model, TinyGPT):
        return F.cross_entropy(model(x, skip=1 if step % 3 == 2 else None).float(), y)
    return F.cross_entropy(model(x, step % 2 == 0).float(), y)  # `sometimes` unused on odd


def _train_step(model, opt, stage, step, rank, accum, overflow_rank=None):
    for mb in range(accum):
        # Even steps accumulate under no_sync, odd ones without it (several reductions per
        # step: the host shard is added to).
        ctx = opt.no_sync() if (mb < accum - 1 and step % 2 == 0) else _null()
        with ctx:
            loss = _loss(model, stage, step, rank, mb) / accum
            if overflow_rank == rank and step == 2:
                loss = loss * float("inf")
            opt.scale_loss(loss).backward()
    opt.step()
    opt.zero_grad()


def _assert_same(a_model, a_opt, b_model, b_opt, what):
    fa = zerokern.full_state_dict(a_model, rank0_only=False)
    fb = zerokern.full_state_dict(b_model, rank0_only=False)
    for k in fa:
        assert torch.equal(fa[k], fb[k]), f"{what}: parameter {k} differs"
    for sa, sb in zip(a_opt.shards(), b_opt.shards()):
        assert sa.step == sb.step, (what, sa.index)
        for ra, rb in zip(sa.ranges, sb.ranges):
            assert (ra.start, ra.numel) == (rb.start, rb.numel)
            for key in ("values", "exp_avg", "exp_avg_sq"):
                assert torch.equal(getattr(ra, key), getattr(rb, key)), (what, sa.index, key)
    na, nb = a_opt.last_grad_norm, b_opt.last_grad_norm
    assert na == nb or (math.isnan(na) and math.isnan(nb)), (what, na, nb)
    assert a_opt.loss_scale == b_opt.loss_scale, what


def bitwise_case(rank, world, stage, dtype_name, variant):
    dtype = getattr(torch, dtype_name)
    kw = dict(clip=0.05)
    accum = 2
    overflow_rank = None
    if variant == "fp16":
        kw, accum, overflow_rank = dict(loss_scale="dynamic", clip=1.0), 1, world - 1
    plain = _build(stage, dtype, False, **kw)
    offl = _build(stage, dtype, True, offload_params=variant == "params", **kw)
    assert offl[1]._engine is None or offl[1]._engine.offload
    for step in range(5):
        for model, opt in (plain, offl):
            _train_step(model, opt, stage, step, rank, accum, overflow_rank)
        _assert_same(*plain, *offl, f"{variant} step {step}")
    if variant == "fp16":
        assert offl[1].scaler.skipped_steps == plain[1].scaler.skipped_steps >= 1
    eng = offl[1]._engine
    assert eng.host.arena.device.type == "cpu"
    assert eng.pipe.staging.settled > 0 and eng.pipe.copier.d2h > 0


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_bitwise_equal_to_no_offload(world, stage, tmp_path):
    """fp32 and bf16, clipping, accumulation with and without no_sync, unused parameters."""
    for dtype in ("float32", "bfloat16"):
        run_ranks(world, bitwise_case, stage, dtype, "cpu", tmp_path=tmp_path)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_offload_params_bitwise_equal_to_no_offload(world, tmp_path):
    for dtype in ("float32", "bfloat16"):
        run_ranks(world, bitwise_case, 3, dtype, "params", tmp_path=tmp_path)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_fp16_loss_scaling_skips_with_no_offload(stage, tmp_path):
    run_ranks(2, bitwise_case, stage, "float16", "fp16", tmp_path=tmp_path)


# -- the pipeline -----------------------------------------------------------------------------
def pipeline_case(rank, world):
    model, opt = _build(2, torch.bfloat16, True, bucket_numel=61)
    _train_step(model, opt, 2, 1, rank, 1)  # first step: lays out the buckets
    eng = opt._engine
    pipe = eng.pipe
    nb = len(opt.layout.buckets)
    assert nb >= 4
    pipe.log.clear()
    settled = pipe.staging.settled
    _loss(model, 2, 4, rank, 0).backward()
    # During backward the gradient of every complete bucket left the device, in bucket
    # order (the buckets holding the never-used parameters last complete at step()); all but
    # the last two (still in their staging slots) are in the host shard already.
    copying = [c for c, ph in pipe.log if ph is ShardPhase.COPYING]
    k = len(copying)
    assert copying == list(range(k)) and nb - 4 <= k < nb, (copying, nb)
    assert pipe.staging.pending == 2 and pipe.staging.settled == settled + k - 2
    assert pipe.phase[: k - 2] == [ShardPhase.ON_HOST] * (k - 2)
    assert pipe.phase[k:] == [ShardPhase.ON_DEVICE] * (nb - k)
    before = pipe.copier.h2d
    opt.step()
    opt.zero_grad()
    # Step: every bucket landed, then updated and returned before the next one's update.
    assert pipe.log.index((nb - 1, ShardPhase.ON_HOST)) < pipe.log.index((0, ShardPhase.UPDATED))
    order = [(c, ph) for c, ph in pipe.log if ph in (ShardPhase.UPDATED, ShardPhase.RETURNED)]
    active = sorted({c for c, ph in order if ph is ShardPhase.UPDATED})
    assert order == [(c, ph) for c in range(nb) for ph in (ShardPhase.UPDATED,
                                                           ShardPhase.RETURNED)
                     if c in active or ph is ShardPhase.RETURNED]
    landed = [c for c, ph in pipe.log if ph is ShardPhase.ON_HOST]
    assert sorted(landed) == list(range(nb))
    assert pipe.copier.h2d > before
    assert pipe.staging.pending == 0
    # The d2h bytes of one backward: one shard per bucket.
    d2h = pipe.copier.d2h
    _loss(model, 2, 6, rank, 0).backward()
    opt.step()  # (the last buckets land in step's flush)
    assert pipe.copier.d2h - d2h == sum(b.shard_numel for b in opt.layout.buckets) * 2
    opt.zero_grad()


def test_offload_pipeline_lands_gradients_during_backward(tmp_path):
    run_ranks(2, pipeline_case, tmp_path=tmp_path)


# -- checkpoints ------------------------------------------------------------------------------
def _ck_build(stage, offload, seed=0):
    # TinyGPT at every stage, so that a checkpoint can move between all of them.
    model, opt = _build(stage, torch.bfloat16, offload, clip=0.05, seed=seed, gpt=True,
                        offload_params=stage == 3 and offload)
    return model, opt


def ck_save(rank, world, stage, offload, path, steps):
    model, opt = _ck_build(stage, offload)
    for step in range(steps):
        _train_step(model, opt, stage, step, rank, 1)
    zerokern.save_checkpoint(path, model, opt)
    full = _full_state(model, opt)
    if rank == 0:
        torch.save(full, path + ".expected.pt")


def _full_state(model, opt):
    """Parameters and the whole AdamW state (torch's format), gathered on every rank."""
    return {"model": zerokern.full_state_dict(model, rank0_only=False),
            "opt": opt.full_state_dict(rank0_only=False)}


def ck_load_elsewhere(rank, world, stage, offload, path):
    """Resharded to another world size and stage: every value arrives unchanged."""
    model, opt = _ck_build(stage, offload, seed=1)
    zerokern.load_checkpoint(path, model, opt)
    got, want = _full_state(model, opt), torch.load(path + ".expected.pt")
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    for i, st in want["opt"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["opt"]["state"][i][key], st[key]), (i, key)
        assert float(got["opt"]["state"][i]["step"]) == float(st["step"])
    _train_step(model, opt, stage, 3, rank, 1)  # and it trains on


def ck_resume(rank, world, stage, offload, path, start, steps, ref_stage):
    model, opt = _ck_build(stage, offload, seed=1)  # other initial values: all must load
    zerokern.load_checkpoint(path, model, opt)
    ref, ropt = _ck_build(ref_stage, False)
    for step in range(start):
        _train_step(ref, ropt, ref_stage, step, rank, 1)
    for step in range(start, start + steps):
        _train_step(model, opt, stage, step, rank, 1)
        _train_step(ref, ropt, ref_stage, step, rank, 1)
    fa = zerokern.full_state_dict(model, rank0_only=False)
    fb = zerokern.full_state_dict(ref, rank0_only=False)
    for k in fa:
        assert torch.equal(fa[k], fb[k]), k


@pytest.mark.parametrize("save_off,load_off", [(True, False), (False, True)])
def test_offload_checkpoint_round_trip_bitwise(save_off, load_off, tmp_path):
    pytest.importorskip("safetensors")
    path = str(tmp_path / "ck")
    run_ranks(2, ck_save, 2, save_off, path, 3, tmp_path=tmp_path)
    run_ranks(2, ck_resume, 2, load_off, path, 3, 2, 2, tmp_path=tmp_path)


def test_offload_checkpoint_other_world_and_stage(tmp_path):
    """Saved offloaded at stage 2 on 2 ranks, loaded offloaded at stage 1 and at stage 3
    (parameters offloaded too) on 3 ranks."""
    pytest.importorskip("safetensors")
    path = str(tmp_path / "ck")
    run_ranks(2, ck_save, 2, True, path, 3, tmp_path=tmp_path)
    run_ranks(3, ck_load_elsewhere, 1, True, path, tmp_path=tmp_path)
    run_ranks(3, ck_load_elsewhere, 3, True, path, tmp_path=tmp_path)


def state_dict_case(rank, world):
    a_model, a = _build(2, torch.float32, False)
    b_model, b = _build(2, torch.float32, True)
    for step in range(2):
        _train_step(a_model, a, 2, step, rank, 1)
    b_model.load_state_dict(a_model.state_dict())
    b.load_state_dict(a.state_dict())  # fp32 without offload has no master: taken from params
    for step in range(2, 4):
        _train_step(a_model, a, 2, step, rank, 1)
        _train_step(b_model, b, 2, step, rank, 1)
    _assert_same(a_model, a, b_model, b, "state dict off -> on")


def test_offload_per_rank_state_dict_from_no_offload(tmp_path):
    run_ranks(2, state_dict_case, tmp_path=tmp_path)


# -- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,match", [
    (dict(offload="gpu"), "offload must be None or 'cpu'"),
    (dict(offload=True), "offload must be None or 'cpu'"),
    (dict(offload="cpu", stage=0), "offload='cpu' needs stage 1, 2 or 3"),
])
def test_offload_bad_arguments(kw, match):
    model = OddNet()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match):
        zerokern.ZeroAdamW(model.parameters(), **kw)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None and not p._post_accumulate_grad_hooks for p in model.parameters())


def test_offload_params_needs_offloading_optimizer_and_a_bool():
    with pytest.raises(TypeError, match="offload_params must be True or False"):
        zerokern.shard_model(TinyGPT(), unit_classes=(Block,), offload_params="yes")
    model = zerokern.shard_model(TinyGPT(), unit_classes=(Block,), offload_params=True)
    with pytest.raises(ValueError, match="offload_params=True.*offload='cpu'"):
        zerokern.ZeroAdamW(model.parameters(), stage=3)
    with pytest.raises(ValueError, match="use stage=3"):  # offload_params is stage 3 only
        zerokern.ZeroAdamW(model.parameters(), stage=2, offload="cpu")
    opt = zerokern.ZeroAdamW(model.parameters(), stage=3, offload="cpu")  # the right way
    x, y = batch(0, 0)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def test_world_one_without_process_group_matches_torch_adamw():
    """Offload at world size 1 (no process group) against torch.optim.AdamW itself."""
    torch.manual_seed(0)
    base = OddNet()
    ours, ref = copy.deepcopy(base), copy.deepcopy(base)
    opt = zerokern.ZeroAdamW(ours.parameters(), **HP, stage=2, offload="cpu", bucket_numel=61)
    ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], **HP,
                             foreach=False)
    for step in range(4):
        for m, o in ((ours, opt), (ref, ropt)):
            x, y = batch(step, 0)
            F.cross_entropy(m(x), y).backward()
            o.step()
            o.zero_grad()
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
