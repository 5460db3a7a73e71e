"""ZeroConfig as the one object of every option (issue 36 item 5), in one process: the stage-3
model options are fields too (``parallelize`` and the integrations take them from it; ZeroAdamW
ignores them), checked by ``validate()``; ``parallelize(config=...)`` is the keyword call;
``prepare_model`` (the integrations' first half) refuses what ZeroAdamW would refuse before
the model is partitioned. The integrations themselves: tests/test_integration_*.py."""

from __future__ import annotations

import math

import pytest
import torch
from models import Block, TinyGPT
from test_compose import _assert_same, _model, _step

import zerokern
from zerokern import ZeroConfig
from zerokern.compose import prepare_model
from zerokern.zero.shard import runtime_of

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)


def test_names_hold_every_option_once():
    names = ZeroConfig.names()
    assert len(set(names)) == len(names)
    assert set(ZeroConfig.MODEL) <= set(names)
    assert ZeroConfig.adamw_names() == tuple(n for n in names if n not in ZeroConfig.MODEL)
    # ZeroAdamW has a keyword for each of its options, parallelize for every option
    import inspect

    adamw = inspect.signature(zerokern.ZeroAdamW).parameters
    assert all(n in adamw for n in ZeroConfig.adamw_names())
    assert not any(n in adamw for n in ZeroConfig.MODEL)
    par = inspect.signature(zerokern.parallelize).parameters
    assert all(n in par or n in adamw for n in names)


def test_unit_classes_list_is_kept_as_a_tuple():
    cfg = ZeroConfig(stage=3, unit_classes=[Block, "Block"])
    assert cfg.unit_classes == (Block, "Block")
    assert cfg == ZeroConfig(stage=3, unit_classes=(Block, "Block"))
    hash(cfg)  # frozen and hashable


@pytest.mark.parametrize("kw,exc,match", [
    (dict(unit_classes=Block), TypeError, "unit_classes must hold module classes or class"),
    (dict(unit_classes="Block"), TypeError, "unit_classes must hold module classes or class"),
    (dict(unit_classes=(Block, 3)), TypeError, "unit_classes must hold module classes"),
    (dict(prefetch=-1), ValueError, "prefetch must be an int >= 0"),
    (dict(prefetch=True), ValueError, "prefetch must be an int >= 0"),
    (dict(reshard_after_forward=1), TypeError, "reshard_after_forward must be True or False"),
    (dict(offload_params="yes"), TypeError, "offload_params must be True or False"),
    (dict(stage=2, offload="cpu", offload_params=True), ValueError,
     r"offload_params=True: .*got stage=2"),
    (dict(stage=3, offload_params=True), ValueError, r"offload.*offload='cpu'"),
    (dict(gather_timeout=0.0), ValueError, "gather_timeout must be a number of seconds > 0"),
    (dict(gather_timeout=math.nan), ValueError, "gather_timeout must be"),
])
def test_model_options_are_validated(kw, exc, match):
    cfg = ZeroConfig(**kw)  # building one checks nothing
    with pytest.raises(exc, match=match):
        cfg.validate()


def test_int8_format_is_a_checked_and_agreed_option():
    """The int8 format version: validated naming it, compared across ranks, carried by the
    state format (what new int8 states are created in), default the one constant."""
    from zerokern.quant.adamw import DEFAULT_INT8_FORMAT

    assert ZeroConfig().int8_format == DEFAULT_INT8_FORMAT
    assert ZeroConfig().state_format.int8_format == DEFAULT_INT8_FORMAT
    cfg = ZeroConfig(moments="int8", int8_format=3).validate()
    assert cfg.agreed()["int8_format"] == 3 and cfg.state_format.int8_format == 3
    for bad in (1, 4, True, "3", 3.0, None):
        with pytest.raises(ValueError, match="int8_format must be one of 2, 3"):
            ZeroConfig(int8_format=bad).validate()


def test_parallelize_config_with_model_options_equals_keywords():
    cfg = ZeroConfig(stage=3, unit_classes=("Block",), prefetch=2, reshard_after_forward=False,
                     gather_timeout=60.0, max_grad_norm=0.05, bucket_numel=61)
    a = _model(torch.float32)
    opt_a = zerokern.parallelize(a, config=cfg, **HP)
    b = _model(torch.float32)
    opt_b = zerokern.parallelize(b, stage=3, unit_classes=("Block",), prefetch=2,
                                 reshard_after_forward=False, gather_timeout=60.0,
                                 max_grad_norm=0.05, bucket_numel=61, **HP)
    assert opt_a.config == opt_b.config == cfg
    for rt in (runtime_of(a), runtime_of(b)):
        assert (rt.prefetch, rt.reshard) == (2, False)
        units = [type(u.module) for u in rt.units if not u.is_root]
        assert units and set(units) == {Block}
    for step in range(2):
        for model, opt in ((a, opt_a), (b, opt_b)):
            _step(model, opt, step, 0)
    _assert_same((a, opt_a), (b, opt_b), "config= vs keywords")


def test_parallelize_refuses_a_model_option_given_twice():
    model = _model(torch.float32)
    with pytest.raises(ValueError, match="prefetch=2 was given together with config="):
        zerokern.parallelize(model, config=ZeroConfig(stage=3), prefetch=2)
    assert runtime_of(model) is None


def test_zero_adamw_ignores_the_model_options():
    """ZeroAdamW gets a model partitioned already: the config an integration holds, model
    options included, builds the same optimizer as its keywords."""
    model = zerokern.shard_model(_model(torch.float32), unit_classes=(Block,))
    cfg = ZeroConfig(stage=3, unit_classes=(Block,), prefetch=3)
    opt = zerokern.ZeroAdamW(model.parameters(), config=cfg, **HP)
    assert opt.config == cfg and opt.stage == 3


@pytest.mark.parametrize("cfg,hparams,exc,match", [
    (ZeroConfig(stage=3, moments="int4"), None, ValueError, "moments must be one of"),
    (ZeroConfig(stage=3, master="none"), None, ValueError, "master='none' needs bf16"),
    (ZeroConfig(stage=3, moments="int8"), dict(eps=0.0), ValueError, "eps must be > 0"),
    (ZeroConfig(stage=3), dict(lr=-1.0), ValueError, "lr must be a finite number"),
    (ZeroConfig(stage=3, unit_classes=("Nope",)), None, ValueError,
     "^Trainer: unit class 'Nope'"),
    (ZeroConfig(stage=3), dict(lrr=1.0), TypeError, "hparams takes"),
    ({"stage": 3}, None, TypeError, "config must be a zerokern.ZeroConfig"),
])
def test_prepare_model_refuses_before_the_model_changes(cfg, hparams, exc, match):
    model = _model(torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(exc, match=match):
        prepare_model(model, cfg, hparams=hparams, where="Trainer")
    assert runtime_of(model) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # the corrected call partitions the same model
    assert prepare_model(model, ZeroConfig(stage=3, unit_classes=(Block,))) is model
    assert runtime_of(model) is not None


def test_prepare_model_then_zero_adamw_is_parallelize():
    cfg = ZeroConfig(stage=3, unit_classes=(Block,), moments="int8", bucket_numel=61)
    a = _model(torch.float32)
    opt_a = zerokern.ZeroAdamW(prepare_model(a, cfg, hparams=HP).parameters(), config=cfg,
                               **HP)
    b = _model(torch.float32)
    opt_b = zerokern.parallelize(b, config=cfg, **HP)
    for step in range(2):
        for model, opt in ((a, opt_a), (b, opt_b)):
            _step(model, opt, step, 0)
    _assert_same((a, opt_a), (b, opt_b), "prepare_model + ZeroAdamW vs parallelize")
    # stages 0-2: the model is left as it is
    c = TinyGPT()
    assert prepare_model(c, ZeroConfig(stage=2, unit_classes=("Nope",))) is c
    assert runtime_of(c) is None
