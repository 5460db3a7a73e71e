"""Rank-side cases of tests/test_integration_transformers.py about ZeroTrainer's options (issue
36 item 5): one ZeroConfig, or its fields as keywords, plus mesh=; checked before the model is
partitioned; the same training as ZeroAdamW used directly with the same options."""

from __future__ import annotations

import os

import pytest
import torch
from hf_cases import _args, _params
from integration_common import MAX_NORM, TokenData, as_launched, tiny_gpt2

import zerokern
from zerokern import ZeroConfig
from zerokern.zero.registry import runtime_of_module

HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)  # as _args gives them
_MESHES: dict[str, object] = {}


def _mesh():
    """This rank process's 2x2 mesh, built once (building one is a collective that makes
    process groups; the rank pool lives across tests)."""
    if "2x2" not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES["2x2"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return _MESHES["2x2"]


class _Ids(TokenData):
    """Token sequences without labels: the Trainer then neither counts label tokens nor
    rescales the loss (num_items_in_batch is None), so the loss it backpropagates is the
    model's own, and a hand loop can repeat it exactly."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i]}


def _recording_trainer(seen: list[torch.Tensor], **kwargs):
    """A ZeroTrainer that records each batch it trains on (for the hand loop to replay)."""
    from zerokern.integrations.transformers import ZeroTrainer

    class Recording(ZeroTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            ids = inputs["input_ids"]
            seen.append(ids.clone())
            return model(input_ids=ids, labels=ids).loss

    return Recording(**kwargs)


def _same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(set(a) ^ set(b)))
    for k in a:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), f"{what}: {k}"


@as_launched
def mesh_and_reduce_dtype(rank: int, world: int, tmp: str) -> None:
    """ZeroTrainer(mesh=2x2, reduce_dtype=float32) on a bf16 GPT-2, stages 2 and 3, trains to
    the same bits as shard_model + ZeroAdamW(mesh=, reduce_dtype=) driven by hand on the
    batches the Trainer used (clipping included)."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    mesh = _mesh()
    steps = 3
    for stage in (2, 3):
        seen: list[torch.Tensor] = []
        model = tiny_gpt2().to(torch.bfloat16)
        args = _args(os.path.join(tmp, f"mesh{stage}"), max_steps=steps,
                     gradient_accumulation_steps=1, lr_scheduler_type="constant",
                     warmup_steps=0, save_strategy="no")
        tr = _recording_trainer(seen, model=model, args=args, train_dataset=_Ids(),
                                stage=stage, mesh=mesh, reduce_dtype=torch.float32)
        tr.train()
        opt = tr.zero_optimizer
        assert (opt.comm.world_size, opt.comm.replicate.world_size) == (2, 2)
        assert opt.config.reduce_dtype is torch.float32 and opt.dtype is torch.bfloat16
        assert len(seen) == steps

        ref = tiny_gpt2().to(torch.bfloat16)
        if stage == 3:
            zerokern.shard_model(ref, mesh=mesh, unit_classes=(GPT2Block,))
        decay = set(tr.get_decay_parameter_names(ref))
        named = list(ref.named_parameters())
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        ropt = zerokern.ZeroAdamW(groups, **HP, stage=stage, mesh=mesh,
                                  reduce_dtype=torch.float32)
        for ids in seen:
            ref(input_ids=ids, labels=ids).loss.backward()
            ropt.clip_grad_norm_(MAX_NORM)
            ropt.step()
            ropt.zero_grad()
        _same_bits(_params(model), _params(ref), f"stage {stage}: ZeroTrainer vs ZeroAdamW")
        assert not torch.equal(_params(model)["transformer.h.0.mlp.c_fc.weight"],
                               _params(tiny_gpt2().to(torch.bfloat16))[
                                   "transformer.h.0.mlp.c_fc.weight"])  # it trained


@as_launched
def config_whole_equals_keywords(rank: int, world: int, tmp: str) -> None:
    """ZeroTrainer(config=ZeroConfig(...)) is ZeroTrainer(<the same options as keywords>):
    the same config and the same parameters, bit for bit; an option given both ways, or a
    ZeroAdamW in optimizers= that lacks a given option, is refused."""
    from zerokern.integrations.transformers import ZeroTrainer

    kw = dict(max_steps=2, save_strategy="no")
    options = dict(stage=3, moments="int8", bucket_numel=97, prefetch=2,
                   unit_classes=["GPT2Block"], reduce_dtype=torch.float32)
    runs = {}
    for how in ("config", "keywords"):
        model = tiny_gpt2()
        extra = {"config": ZeroConfig(**options)} if how == "config" else options
        tr = ZeroTrainer(model=model, args=_args(os.path.join(tmp, how), **kw),
                         train_dataset=TokenData(), **extra)
        tr.train()
        assert tr.zero_optimizer.config == tr.zero_config == ZeroConfig(**options)
        assert tr.zero_optimizer.state_format.moments == "int8"
        runs[how] = _params(model)
    _same_bits(runs["config"], runs["keywords"], "config= vs keywords")

    model = tiny_gpt2()
    a = _args(os.path.join(tmp, "x"), **kw)
    with pytest.raises(ValueError, match="moments='int8' was given together with config="):
        ZeroTrainer(model=model, args=a, config=ZeroConfig(stage=2), moments="int8")
    with pytest.raises(TypeError, match="zero_stage and stage were both given"):
        ZeroTrainer(model=model, args=a, zero_stage=2, stage=2)
    opt = zerokern.ZeroAdamW(model.parameters(), **HP, stage=2)
    with pytest.raises(ValueError, match=r"moments='int8' was given, but the ZeroAdamW given"):
        ZeroTrainer(model=model, args=a, optimizers=(opt, None), moments="int8")
    with pytest.raises(ValueError, match="prefetch=2 together with optimizers="):
        ZeroTrainer(model=model, args=a, optimizers=(opt, None), prefetch=2)


def _untouched(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    assert runtime_of_module(model) is None, "the model was partitioned"
    now = model.state_dict()
    assert all(torch.equal(now[k], v) for k, v in before.items())


@as_launched
def refused_before_the_model_is_sharded(rank: int, world: int, tmp: str) -> None:
    """What ZeroAdamW would refuse is refused when ZeroTrainer(stage=3) is constructed, on
    every rank, before the model is partitioned: a moments format that does not exist, a
    master format the model's dtype does not allow, eps=0 with int8 moments. The model is as
    it was, and a corrected trainer trains it."""
    from zerokern.integrations.transformers import ZeroTrainer

    kw = dict(max_steps=2, save_strategy="no")
    model = tiny_gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cases = [
        (dict(stage=3, moments="int4"), {}, "moments must be one of"),
        (dict(stage=3, master="none"), {}, "master='none'"),
        (dict(stage=3, moments="int8"), dict(adam_epsilon=0.0), "eps must be > 0"),
    ]
    for options, targs, words in cases:
        with pytest.raises(ValueError, match=words):
            ZeroTrainer(model=model, args=_args(os.path.join(tmp, "bad"), **kw, **targs),
                        train_dataset=TokenData(), **options)
        _untouched(model, before)
    tr = ZeroTrainer(model=model, args=_args(os.path.join(tmp, "good"), **kw),
                     train_dataset=TokenData(), stage=3, moments="int8")
    tr.train()
    assert runtime_of_module(model) is not None and tr.state.global_step == 2
