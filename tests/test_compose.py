"""zerokern.parallelize / shard_for (zerokern/compose.py) against the composition written by
hand (``shard_model`` at stage 3, then ``ZeroAdamW``): the same training trajectory, bit for
bit, at stages 0-3, with offload and offload_params, in one process (world size 1, no
process group) and on 2 gloo ranks; and every refusal raised before the model is modified.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from dist_utils import run_ranks
from models import Block, TinyGPT, batch

import zerokern
from zerokern.zero.shard import runtime_of

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)


def _groups(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    other = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [dict(params=decay), dict(params=other, weight_decay=0.0, lr=HP["lr"] * 2)]


def _model(dtype, seed=0, cls=TinyGPT):
    torch.manual_seed(seed)
    return cls().to(dtype)


def _by_hand(stage, dtype, *, groups, offload=None, offload_params=False, **kw):
    """Today's composition, as the integrations, the demo and the example wrote it."""
    model = _model(dtype)
    if stage == 3:
        model = zerokern.shard_model(model, unit_classes=(Block,), offload_params=offload_params)
    params = _groups(model) if groups else model.parameters()
    opt = zerokern.ZeroAdamW(params, **HP, stage=stage, offload=offload, **kw)
    return model, opt


def _composed(stage, dtype, *, groups, offload=None, offload_params=False, units=(Block,),
              **kw):
    model = _model(dtype)
    opt = zerokern.parallelize(model, stage=stage, params=_groups(model) if groups else None,
                               unit_classes=units, offload=offload,
                               offload_params=offload_params, **HP, **kw)
    return model, opt


def _step(model, opt, step, rank):
    for mb in range(2):  # accumulation: the first micro-batch under no_sync
        x, y = batch(10 * step + mb, rank)
        if mb == 0:
            with opt.no_sync():
                (F.cross_entropy(model(x).float(), y) / 2).backward()
        else:
            (F.cross_entropy(model(x, skip=1 if step % 2 else None).float(), y) / 2).backward()
    opt.step()
    opt.zero_grad()


def _assert_same(a, b, what):
    (ma, oa), (mb, ob) = a, b
    fa = zerokern.full_state_dict(ma, rank0_only=False)
    fb = zerokern.full_state_dict(mb, rank0_only=False)
    assert list(fa) == list(fb), what
    for k in fa:
        assert torch.equal(fa[k], fb[k]), f"{what}: parameter {k} differs"
    assert [g["lr"] for g in oa.param_groups] == [g["lr"] for g in ob.param_groups], what
    sa_all, sb_all = oa.shards(), ob.shards()
    assert len(sa_all) == len(sb_all), what
    for sa, sb in zip(sa_all, sb_all):
        assert (sa.name, sa.step) == (sb.name, sb.step), (what, sa.index)
        for ra, rb in zip(sa.ranges, sb.ranges):
            assert (ra.start, ra.numel) == (rb.start, rb.numel), (what, sa.index)
            for key in ("values", "exp_avg", "exp_avg_sq"):
                assert torch.equal(getattr(ra, key), getattr(rb, key)), (what, sa.index, key)
    assert oa.last_grad_norm == ob.last_grad_norm, what


def trajectory_case(rank, world, stage, dtype_name, variant):
    dtype = getattr(torch, dtype_name)
    kw = dict(groups=variant != "plain_params", max_grad_norm=0.05, bucket_numel=61)
    if variant == "offload":
        kw["offload"] = "cpu"
    elif variant == "offload_params":
        kw.update(offload="cpu", offload_params=True)
    hand = _by_hand(stage, dtype, **kw)
    mine = _composed(stage, dtype, **kw)
    assert type(mine[1]) is zerokern.ZeroAdamW
    assert (mine[1].stage, mine[1].offload) == (stage, kw.get("offload"))
    assert (runtime_of(mine[0]) is None) == (stage != 3)
    if stage == 3:  # the same units, in the same order
        units = [(u.name, len(u.params)) for u in runtime_of(mine[0]).units]
        assert units == [(u.name, len(u.params)) for u in runtime_of(hand[0]).units]
        assert runtime_of(mine[0]).offload_params == (variant == "offload_params")
    _assert_same(hand, mine, f"{variant} before training")
    for step in range(3):
        for model, opt in (hand, mine):
            _step(model, opt, step, rank)
        _assert_same(hand, mine, f"stage {stage} {dtype_name} {variant} step {step}")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_world_one_same_trajectory_as_by_hand(stage):
    """In this process, no process group (world size 1): fp32 with param groups, bf16 with
    model.parameters()."""
    trajectory_case(0, 1, stage, "float32", "groups")
    trajectory_case(0, 1, stage, "bfloat16", "plain_params")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_world_one_offload_same_trajectory_as_by_hand(stage):
    trajectory_case(0, 1, stage, "float32", "offload")
    if stage == 3:
        trajectory_case(0, 1, stage, "bfloat16", "offload_params")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_two_ranks_same_trajectory_as_by_hand(stage, tmp_path):
    for dtype in ("float32", "bfloat16"):
        run_ranks(2, trajectory_case, stage, dtype, "groups", tmp_path=tmp_path)
    if stage:
        run_ranks(2, trajectory_case, stage, "bfloat16", "offload", tmp_path=tmp_path)
    if stage == 3:
        run_ranks(2, trajectory_case, stage, "float32", "offload_params", tmp_path=tmp_path)


# -- units ------------------------------------------------------------------------------------
class _HFStyleGPT(TinyGPT):
    """A model that names its blocks as Hugging Face models do."""

    _no_split_modules = ["Block"]


def _unit_names(model):
    return [u.name for u in runtime_of(model).units]


def test_units_by_name_and_from_no_split_modules_match_the_class():
    ref = _model(torch.float32)
    zerokern.shard_for(ref, stage=3, unit_classes=(Block,))
    expected = _unit_names(ref)
    assert expected == ["blocks.0", "blocks.1", "blocks.2", "<root>"]
    by_name = _model(torch.float32)
    zerokern.shard_for(by_name, stage=3, unit_classes=["Block"])
    assert _unit_names(by_name) == expected
    hf = _model(torch.float32, cls=_HFStyleGPT)
    zerokern.parallelize(hf, stage=3)  # no unit_classes: the model's _no_split_modules
    assert _unit_names(hf) == expected
    default = _model(torch.float32)  # neither: shard_model's own choice
    zerokern.parallelize(default, stage=3)
    plain = zerokern.shard_model(_model(torch.float32))
    assert _unit_names(default) == _unit_names(plain)


def test_stage_three_options_are_ignored_below_stage_three():
    for stage in (0, 1, 2):
        model = _model(torch.float32)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        assert zerokern.shard_for(model, stage=stage, unit_classes=("NoSuchBlock",),
                                  prefetch=3, reshard_after_forward=False,
                                  gather_timeout=5.0) is model
        opt = zerokern.parallelize(model, stage=stage, unit_classes=(Block,), prefetch=2)
        assert runtime_of(model) is None and opt.stage == stage
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_shard_for_then_zeroadamw_is_parallelize():
    """The two halves, for trainers that build the optimizer later (Lightning, HF)."""
    a = _model(torch.float32)
    opt_a = zerokern.ZeroAdamW(zerokern.shard_for(a, stage=3, unit_classes=(Block,)).parameters(),
                               **HP, stage=3)
    b = _model(torch.float32)
    opt_b = zerokern.parallelize(b, stage=3, unit_classes=(Block,), **HP)
    for step in range(2):
        for model, opt in ((a, opt_a), (b, opt_b)):
            _step(model, opt, step, 0)
    _assert_same((a, opt_a), (b, opt_b), "shard_for + ZeroAdamW")


# -- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,exc,match", [
    (dict(stage=4), ValueError, "stage must be 0, 1, 2 or 3, got 4"),
    (dict(stage=True), ValueError, "stage must be 0, 1, 2 or 3, got True"),
    (dict(stage=3, offload="gpu"), ValueError, "offload must be None or 'cpu'"),
    (dict(stage=0, offload="cpu"), ValueError, "offload='cpu' needs stage 1, 2 or 3"),
    (dict(stage=2, offload="cpu", offload_params=True), ValueError,
     r"offload_params=True: .*pass stage=3.*got stage=2"),
    (dict(stage=3, offload_params=True), ValueError,
     r"offload_params=True.*offload='cpu'"),
    (dict(stage=3, lr=-1.0), ValueError, "lr must be a finite number >= 0"),
    (dict(stage=3, betas=(0.9, 1.5)), ValueError, r"betas\[1\] must be in \[0, 1\)"),
    (dict(stage=3, lrr=1e-3), TypeError, "parallelize: .*lrr"),
    (dict(stage=3, bucket_numel=0), ValueError, "bucket_numel must be a positive int"),
    (dict(stage=3, max_grad_norm=0.0), ValueError, "max_grad_norm must be > 0 or None"),
    (dict(stage=3, loss_scale="static"), ValueError, "loss_scale must be None, 'dynamic'"),
    (dict(stage=3, amsgrad=True), ValueError, "amsgrad=True"),
    (dict(stage=3, maximize=True), ValueError, "maximize=True"),
    (dict(stage=3, unit_classes=("NoSuchBlock",)), ValueError,
     "shard_for: unit class 'NoSuchBlock' .* is not a module of the model"),
    (dict(stage=3, unit_classes=(Block, 3)), TypeError,
     "unit_classes must hold module classes or class names"),
    (dict(stage=3, unit_classes=(torch.nn.Conv1d,)), ValueError,
     r"unit_classes \(Conv1d\) match no submodule"),
    (dict(stage=3, prefetch=-1), ValueError, "prefetch must be an int >= 0"),
])
def test_bad_input_is_refused_before_the_model_changes(kw, exc, match):
    model = _model(torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(exc, match=match):
        zerokern.parallelize(model, **kw)
    assert runtime_of(model) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None and not p._post_accumulate_grad_hooks for p in model.parameters())
    # Nothing was left behind: the corrected call works on the same model.
    opt = zerokern.parallelize(model, stage=3, unit_classes=(Block,))
    assert runtime_of(model) is not None and opt.stage == 3


def test_shard_for_refusals():
    model = _model(torch.float32)
    with pytest.raises(ValueError, match=r"offload_params=True: .*got stage=1"):
        zerokern.shard_for(model, stage=1, offload_params=True)
    with pytest.raises(ValueError, match="stage must be 0, 1, 2 or 3"):
        zerokern.shard_for(model, stage=-1)
    with pytest.raises(TypeError, match="offload_params must be True or False"):
        zerokern.shard_for(model, stage=3, offload_params="yes")
    assert runtime_of(model) is None


def test_a_sharded_model_is_refused_as_shard_model_refuses_it():
    model = _model(torch.float32)
    zerokern.parallelize(model, stage=3, unit_classes=(Block,))
    with pytest.raises(RuntimeError, match="already sharded"):
        zerokern.parallelize(model, stage=3, unit_classes=(Block,))
    with pytest.raises(RuntimeError, match="already sharded"):
        zerokern.shard_for(model, stage=3)
    # At stages 0-2 ZeroAdamW refuses the partitioned parameters, as it does by hand.
    with pytest.raises(ValueError, match="use stage=3"):
        zerokern.parallelize(model, stage=2)


def test_hf_resolve_units_keeps_naming_zero_trainer():
    transformers = pytest.importorskip("zerokern.integrations.transformers")
    model = _model(torch.float32, cls=_HFStyleGPT)
    assert transformers.resolve_units(model, None) == (Block,)
    assert transformers.resolve_units(model, ["Block"]) == (Block,)
    with pytest.raises(ValueError, match="^ZeroTrainer: unit class 'Nope'"):
        transformers.resolve_units(model, ["Nope"])
    with pytest.raises(TypeError, match="^ZeroTrainer: unit_classes must hold"):
        transformers.resolve_units(model, [1])
