"""Rank-side cases of tests/test_integration_transformers.py (importable by spawned ranks)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from integration_common import (
    ACCUM,
    MAX_NORM,
    SAVE_AT,
    STEPS,
    TokenData,
    as_launched,
    assert_one_reduction_per_step,
    assert_params_close,
    tiny_gpt2,
)

import zerokern


def _args(out: str, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=ACCUM,
                max_steps=STEPS, learning_rate=3e-3, weight_decay=0.1, adam_beta2=0.95,
                max_grad_norm=MAX_NORM, warmup_steps=2, logging_steps=1,
                save_strategy="steps", save_steps=SAVE_AT, report_to=[], use_cpu=True,
                seed=0, disable_tqdm=True, optim="adamw_torch", dataloader_num_workers=0)
    base.update(kw)
    return TrainingArguments(**base)


def _logs(trainer) -> tuple[list[float], list[float]]:
    rows = [r for r in trainer.state.log_history if "loss" in r and "grad_norm" in r]
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]


def _params(model) -> dict[str, torch.Tensor]:
    full = zerokern.full_state_dict(model, rank0_only=False)
    return {n: full[n] for n, _ in model.named_parameters()}


def _reference(out: str):
    """The plain Trainer with torch AdamW: Accelerate wraps the model in DDP."""
    from transformers import Trainer

    model = tiny_gpt2()
    tr = Trainer(model=model, args=_args(out), train_dataset=TokenData())
    tr.train()
    assert isinstance(tr.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    return _logs(tr), _params(model)


def _zero(out: str, stage: int, resume: str | None = None, seed: int = 0):
    from zerokern.integrations.transformers import ZeroTrainer

    model = tiny_gpt2(seed)
    tr = ZeroTrainer(model=model, args=_args(out), train_dataset=TokenData(), zero_stage=stage,
                     bucket_numel=97)
    tr.train(resume_from_checkpoint=resume)
    assert tr.model_wrapped is model, "ZeroTrainer must not wrap the model (no DDP)"
    return tr, _logs(tr), _params(model)


@as_launched
def parity_and_resume(rank: int, world: int, stage: int, tmp: str) -> None:
    (ref_loss, ref_norm), ref_params = _reference(os.path.join(tmp, "ref"))
    assert len(ref_norm) == STEPS and all(n > MAX_NORM for n in ref_norm), \
        "clipping must fire on every step for the test to mean anything"

    out = os.path.join(tmp, f"zero{stage}")
    tr, (loss, norm), params = _zero(out, stage)
    if stage == 3:  # units from the model's _no_split_modules: one per GPT2Block, and the root
        from zerokern.zero.registry import runtime_of_module

        units = runtime_of_module(tr.model).units
        assert [type(u.module).__name__ for u in units if not u.is_root] == ["GPT2Block"] * 2
    # The logged loss and grad_norm are the true global ones, step by step.
    for i, (a, b) in enumerate(zip(norm, ref_norm, strict=True)):
        assert math.isclose(a, b, rel_tol=1e-5), ("grad_norm", i, a, b)
    for i, (a, b) in enumerate(zip(loss, ref_loss, strict=True)):
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), ("loss", i, a, b)
    assert_params_close(params, ref_params, f"stage {stage} vs DDP + AdamW")
    assert_one_reduction_per_step(tr.zero_optimizer)

    # Each rank wrote its part of a zerokern checkpoint; resume in a fresh trainer whose model
    # starts elsewhere (seed 1) and reach the same step-20 parameters.
    ckpt = os.path.join(out, f"checkpoint-{SAVE_AT}")
    assert os.path.isdir(os.path.join(ckpt, "zerokern"))
    assert not os.path.exists(os.path.join(ckpt, "optimizer.pt"))
    _, _, resumed = _zero(os.path.join(tmp, f"resumed{stage}"), stage, resume=ckpt, seed=1)
    assert_params_close(resumed, params, f"stage {stage} resumed from step {SAVE_AT}",
                        tol=1e-6)

    # save_model: a normal HF checkpoint of the full parameters, at stage 3 too.
    final = os.path.join(tmp, f"final{stage}")
    tr.save_model(final)
    torch.distributed.barrier()
    if rank == 0:
        from transformers import GPT2LMHeadModel

        loaded = GPT2LMHeadModel.from_pretrained(final)
        assert os.path.isfile(os.path.join(final, "model.safetensors"))
        assert_params_close(dict(loaded.named_parameters()), params, "save_model", tol=0)
    torch.distributed.barrier()


@as_launched
def plain_trainer_is_refused(rank: int, world: int, tmp: str) -> None:
    """transformers.Trainer(optimizers=(ZeroAdamW, None)) on several ranks: an error that
    names ZeroTrainer, before any step."""
    from transformers import Trainer

    model = tiny_gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = zerokern.ZeroAdamW(model.parameters(), stage=2)
    tr = Trainer(model=model, args=_args(os.path.join(tmp, "plain")), train_dataset=TokenData(),
                 optimizers=(opt, None))
    with pytest.raises(RuntimeError, match="ZeroTrainer"):
        tr.train()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


@as_launched
def resume_from_plain_trainer(rank: int, world: int, stage: int, tmp: str) -> None:
    """A checkpoint of the plain Trainer (optimizer.pt in torch AdamW's format, rank 0's file)
    resumes in ZeroTrainer at any stage and reaches the plain Trainer's step-20 parameters."""
    from transformers import Trainer

    model = tiny_gpt2()
    ref_out = os.path.join(tmp, "ref")
    Trainer(model=model, args=_args(ref_out), train_dataset=TokenData()).train()
    ref = _params(model)
    _, _, resumed = _zero(os.path.join(tmp, "from_plain"), stage,
                          resume=os.path.join(ref_out, f"checkpoint-{SAVE_AT}"), seed=1)
    assert_params_close(resumed, ref, f"stage {stage} resumed from a plain Trainer checkpoint")


@as_launched
def options_and_refusals(rank: int, world: int, tmp: str) -> None:
    """A ZeroAdamW given through optimizers= trains as the one ZeroTrainer builds; what
    ZeroTrainer cannot honour is refused when it is constructed."""
    from transformers import Trainer

    from zerokern.integrations.transformers import ZeroTrainer

    kw = dict(max_steps=4, weight_decay=0.0, save_strategy="no")
    built = tiny_gpt2()
    ZeroTrainer(model=built, args=_args(os.path.join(tmp, "built"), **kw),
                train_dataset=TokenData(), zero_stage=2).train()
    given = tiny_gpt2()
    opt = zerokern.ZeroAdamW(given.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=0.0, stage=2)
    ZeroTrainer(model=given, args=_args(os.path.join(tmp, "given"), **kw),
                train_dataset=TokenData(), optimizers=(opt, None)).train()
    assert_params_close(_params(given), _params(built), "optimizers=(ZeroAdamW, None)")
    # ZeRO-Offload through the Trainer: the same parameters (the same kernel on the host).
    off = tiny_gpt2()
    tr = ZeroTrainer(model=off, args=_args(os.path.join(tmp, "offload"), **kw),
                     train_dataset=TokenData(), zero_stage=3, offload="cpu",
                     offload_params=True)
    tr.train()
    assert tr.zero_optimizer.memory_stats()["host_total"] > 0
    assert_params_close(_params(off), _params(built), "offload='cpu', offload_params")
    # Compressed state through the Trainer: the ZeroAdamW it builds stores int8 moments and
    # equals one given with the same options.
    q_built, q_given = tiny_gpt2(), tiny_gpt2()
    tr = ZeroTrainer(model=q_built, args=_args(os.path.join(tmp, "int8"), **kw),
                     train_dataset=TokenData(), zero_stage=2, moments="int8")
    tr.train()
    assert tr.zero_optimizer.state_format.moments == "int8"
    opt = zerokern.ZeroAdamW(q_given.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=0.0, stage=2, moments="int8")
    ZeroTrainer(model=q_given, args=_args(os.path.join(tmp, "int8g"), **kw),
                train_dataset=TokenData(), optimizers=(opt, None)).train()
    assert_params_close(_params(q_given), _params(q_built), "moments='int8'")

    model = tiny_gpt2()
    a = _args(os.path.join(tmp, "x"), **kw)
    with pytest.raises(TypeError, match="ZeroTrainer trains with zerokern.ZeroAdamW or"):
        ZeroTrainer(model=model, args=a, optimizers=(torch.optim.AdamW(model.parameters()),
                                                     None))
    with pytest.raises(ValueError, match="zero_stage=3 but the ZeroAdamW"):
        ZeroTrainer(model=model, args=a, zero_stage=3,
                    optimizers=(zerokern.ZeroAdamW(model.parameters(), stage=1), None))
    with pytest.raises(ValueError, match="optim='adafactor'"):
        ZeroTrainer(model=model, args=_args(os.path.join(tmp, "x"), optim="adafactor", **kw))
    # bf16/fp16_full_eval cast the whole model for the final evaluate: refused at stage 3
    # when the trainer is built, not after the training (the model left unpartitioned).
    from zerokern.zero.registry import runtime_of_module

    for full_eval in ("bf16_full_eval", "fp16_full_eval"):
        with pytest.raises(ValueError, match=rf"{full_eval}=True\) at stage 3"):
            ZeroTrainer(model=model, args=_args(os.path.join(tmp, "x"), **{full_eval: True}, **kw),
                        zero_stage=3)
        assert runtime_of_module(model) is None
    with pytest.raises(ValueError, match=r"optimizer_class=torch\.optim\.LBFGS is not"):
        ZeroTrainer(model=model, args=a, optimizer_cls_and_kwargs=(torch.optim.LBFGS, {}))
    with pytest.raises(ValueError, match="not a module of the model"):
        ZeroTrainer(model=tiny_gpt2(), args=a, zero_stage=3, unit_classes=["NoSuchBlock"])
    assert Trainer is not ZeroTrainer


@as_launched
def sgd_matches_trainer_with_ddp(rank: int, world: int, tmp: str) -> None:
    """Another torch class, named the Trainer's two ways (optimizer_cls_and_kwargs, and
    optim="sgd" with optim_args): ZeroTrainer builds ZeroOptimizer(SGD with momentum) and
    trains as the plain Trainer with DDP + torch SGD (losses, clipped grad norms, parameters)."""
    from transformers import Trainer

    from zerokern.integrations.transformers import ZeroTrainer

    kw = dict(max_steps=8, save_strategy="no")
    sgd = (torch.optim.SGD, {"lr": 3e-3, "momentum": 0.9, "nesterov": True})
    model = tiny_gpt2()
    ref = Trainer(model=model, args=_args(os.path.join(tmp, "ref"), **kw),
                  train_dataset=TokenData(), optimizer_cls_and_kwargs=sgd)
    ref.train()
    assert isinstance(ref.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    assert type(ref.optimizer.optimizer) is torch.optim.SGD
    (ref_loss, ref_norm), ref_params = _logs(ref), _params(model)
    ref_state = ref.optimizer.optimizer.state_dict()["state"]
    assert len(ref_norm) == 8 and all(n > MAX_NORM for n in ref_norm)

    by_cls = tiny_gpt2()
    tr = ZeroTrainer(model=by_cls, args=_args(os.path.join(tmp, "cls"), **kw),
                     train_dataset=TokenData(), zero_stage=2, bucket_numel=97,
                     optimizer_cls_and_kwargs=sgd)
    by_name = tiny_gpt2()
    tr2 = ZeroTrainer(model=by_name, args=_args(os.path.join(tmp, "name"), optim="sgd",
                                                optim_args="momentum=0.9,nesterov=True", **kw),
                      train_dataset=TokenData(), zero_stage=1, bucket_numel=97)
    for t, m, what in ((tr, by_cls, "optimizer_cls_and_kwargs"), (tr2, by_name, "optim='sgd'")):
        t.train()
        assert isinstance(t.zero_optimizer, zerokern.ZeroOptimizer)
        assert type(t.zero_optimizer) is zerokern.ZeroOptimizer  # not ZeroAdamW
        loss, norm = _logs(t)
        for i, (a, b) in enumerate(zip(norm, ref_norm, strict=True)):
            assert math.isclose(a, b, rel_tol=1e-5), (what, "grad_norm", i, a, b)
        for i, (a, b) in enumerate(zip(loss, ref_loss, strict=True)):
            assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), (what, "loss", i, a, b)
        assert_params_close(_params(m), ref_params, f"ZeroTrainer {what} vs DDP + SGD")
        # The momentum too, in torch SGD's own format, against the reference's.
        state = t.zero_optimizer.full_state_dict(rank0_only=False)["state"]
        assert state.keys() == ref_state.keys()
        for i, v in ref_state.items():
            torch.testing.assert_close(state[i]["momentum_buffer"], v["momentum_buffer"],
                                       rtol=1e-5, atol=1e-6,
                                       msg=lambda m, i=i, w=what: f"{w} {i} {m}")
