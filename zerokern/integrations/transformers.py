"""zerokern's optimizers inside the Hugging Face Trainer: ``ZeroTrainer``.

``transformers.Trainer`` assumes the optimizer is a torch one and the model is wrapped in DDP:
it clips with ``clip_grad_norm_``, steps, calls ``model.zero_grad()``, saves ``optimizer.pt``
from rank 0 and the model with ``save_pretrained`` from rank 0. ``ZeroTrainer`` keeps the
Trainer's loop and arguments and changes what a ZeRO optimizer needs:

- the accelerator is a ``ZeroAccelerator`` (no DDP wrap; ``no_sync`` on the accumulation
  micro-steps is ZeroAdamW's; ``clip_grad_norm_`` is ZeroAdamW's global norm, so the logged
  ``grad_norm`` is the norm over all ranks);
- the optimizer is a ZeroAdamW built from the Trainer's own settings (``learning_rate``,
  ``adam_beta1/2``, ``adam_epsilon``, ``weight_decay`` with the Trainer's decay / no-decay
  groups); or, for the Trainer's other ways to name an optimizer, a ``ZeroOptimizer`` of the
  torch class they name, with the same groups and keywords as the Trainer would give it
  (``optimizer_cls_and_kwargs=(torch.optim.SGD, {...})``, ``optim="sgd"``, ``"adagrad"``,
  ``"rmsprop"`` with ``optim_args``); or the ZeroAdamW / ZeroOptimizer given through
  ``optimizers=``;
- the options are one ``zerokern.ZeroConfig`` (``config=``, or its fields as keywords),
  checked and compared across ranks at construction by ``zerokern.compose.prepare_model``
  (the first half of ``zerokern.parallelize``), which at stage 3 then partitions the model,
  with the model's ``_no_split_modules`` as units unless ``unit_classes`` is given; the
  optimizer, built later by ``create_optimizer`` with that config and ``mesh``, is its
  second half;
- checkpoints: every rank writes its part of a zerokern checkpoint into
  ``checkpoint-N/zerokern`` (model and optimizer, exact), rank 0 the scheduler, RNG and trainer
  state as usual; ``resume_from_checkpoint`` reads it back. A checkpoint of a plain Trainer
  (``optimizer.pt`` in torch AdamW's format) also resumes, at any stage and world size;
- ``save_model`` writes a normal HF checkpoint (safetensors of the full parameters) at every
  stage; at stage 3 the units are gathered one at a time (call it on every rank, as the
  Trainer does).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from ..checkpoint import load_checkpoint, save_checkpoint
from ..compose import prepare_model
from ..compose import resolve_units as _resolve_units
from ..zero import ZeroAdamW, ZeroOptimizer
from ..zero.config import ZeroConfig
from ..zero.registry import runtime_of_module
from ..zero.rules.elementwise import rule_for
from ..zero.shard import full_state_dict
from ._optional import require
from ._options import build_mesh, check_mesh_arg, check_optimizer, config_of, pop_options
from .accelerate import ZeroAccelerator, unwrap_optimizer

_tf = require("transformers", "transformers", "transformers")
_trainer_mod = require("transformers.trainer", "transformers", "transformers")

# The Trainer's own file names (transformers.trainer constants).
SCHEDULER_NAME = _trainer_mod.SCHEDULER_NAME
OPTIMIZER_NAME = _trainer_mod.OPTIMIZER_NAME
# Inside a Trainer checkpoint-N directory: zerokern's sharded checkpoint of model + optimizer.
ZERO_CHECKPOINT = "zerokern"
# TrainingArguments.optim values that are torch's AdamW (what ZeroAdamW computes).
_ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")
# TrainingArguments.optim values that the Trainer maps to torch's element-wise classes (SGD,
# Adagrad, RMSprop, with their optim_args): a ZeroOptimizer of that class.
_TORCH_OPTIMS = ("sgd", "adagrad", "rmsprop")


def resolve_units(model: torch.nn.Module,
                  unit_classes: Iterable[type | str] | None) -> tuple[type, ...] | None:
    """The stage-3 unit classes: ``unit_classes`` (classes or class names) if given, else the
    model's ``_no_split_modules`` (the blocks HF's FSDP auto-wrap policy shards by), else None
    (shard_model's default). ``zerokern.compose.resolve_units``, with errors naming
    ZeroTrainer."""
    return _resolve_units(model, unit_classes, caller="ZeroTrainer")


class _ZeroGradAfterStep(_tf.TrainerCallback):
    """The Trainer ends a step with ``model.zero_grad()``, which cannot reach the gradient
    buffers ZeroAdamW keeps for stages 1-3; ZeroAdamW's own zero_grad runs right after step."""

    def __init__(self, trainer: ZeroTrainer) -> None:
        self.trainer = trainer

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.zero_optimizer.zero_grad()


class ZeroTrainer(_tf.Trainer):
    """``transformers.Trainer`` training with ZeroAdamW (or a ``ZeroOptimizer`` of another
    torch class) at ZeRO stage 0-3.

    Takes the Trainer's arguments and zerokern's options: ``config=zerokern.ZeroConfig(...)``
    (the object ``parallelize`` and ``ZeroStrategy`` take), or any of its fields as a keyword
    of the same name (``stage``, ``moments``, ``reduce_dtype``, ``unit_classes``,
    ``offload_params``, ...: ``ZeroConfig.names()``), plus ``mesh``. The optimizer's
    hyperparameters are the TrainingArguments' (``max_grad_norm`` there is applied as
    ZeroAdamW's global norm). Another torch class is named the Trainer's ways:
    ``optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})``, or
    ``TrainingArguments(optim="sgd", optim_args="momentum=0.9")`` (also ``"adagrad"``,
    ``"rmsprop"``); the trainer then builds ``zerokern.ZeroOptimizer`` of that class, with
    the Trainer's decay / no-decay groups and those keywords (the class must be element-wise:
    checked at construction). Every option is checked, and compared across ranks, when the
    trainer is constructed, before the model is partitioned (stage 3).

    Args:
        *args: the Trainer's positional arguments (``model``, ``args``, ...).
        zero_stage: the ZeRO stage, as ``stage``; default 2, or the stage of the optimizer
            given in ``optimizers``.
        config: every zerokern option as one ``ZeroConfig``; an option given both here and
            as a keyword is refused.
        mesh: a 1-D or 2-D ``DeviceMesh`` (hybrid sharding: dim 0 replicate, dim 1 shard),
            or its shape ``(replicate, shard)``, built over the default process group.
        **kwargs: the Trainer's keyword arguments, and zerokern's options by name.

    Attributes:
        zero_config: the options, validated (a given optimizer's own config).
        zero_mesh: the DeviceMesh, or None.
    """

    def __init__(self, *args: Any, zero_stage: int | None = None,
                 config: ZeroConfig | None = None, mesh: Any = None, **kwargs: Any) -> None:
        options = pop_options(kwargs)
        if zero_stage is not None:
            if "stage" in options:
                raise TypeError("ZeroTrainer: zero_stage and stage were both given (they are "
                                "the same option); give one")
            options["stage"] = zero_stage
        given = kwargs.get("optimizers", (None, None))
        given_opt = unwrap_optimizer(given[0]) if given and given[0] is not None else None
        if given_opt is not None and not isinstance(given_opt, ZeroOptimizer):
            raise TypeError(f"ZeroTrainer(optimizers=...): got a {type(given_opt).__name__}; "
                            "ZeroTrainer trains with zerokern.ZeroAdamW or "
                            "zerokern.ZeroOptimizer (or pass none and it builds one from the "
                            "TrainingArguments)")
        # Every option checked first: nothing below (the Trainer, the partition) runs on a
        # config ZeroAdamW would refuse.
        cfg = config_of(config, options, "ZeroTrainer")
        check_mesh_arg(mesh, "ZeroTrainer")
        if given_opt is not None:
            cfg = self._given_config(given_opt, cfg, "stage" in options or config is not None,
                                     mesh)
        cls_kw = kwargs.get("optimizer_cls_and_kwargs")
        if cls_kw is not None:
            self._check_cls_and_kwargs(cls_kw)
        if kwargs.get("model_init") is not None:
            raise ValueError("ZeroTrainer: model_init (hyperparameter search) is not supported; "
                             "pass the model")
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        have_optimizer = given_opt is not None or cls_kw is not None
        if targs is not None:
            self._check_args(targs, have_optimizer, cfg.stage)
        self.zero_config = cfg
        self.zero_stage = cfg.stage
        super().__init__(*args, **kwargs)
        self._check_args(self.args, have_optimizer, cfg.stage)
        self.zero_mesh = build_mesh(mesh, self.args.device.type, "ZeroTrainer")
        if given_opt is not None:
            if cfg.stage == 3 and runtime_of_module(self.model) is None:
                raise ValueError("ZeroTrainer: the ZeroAdamW given is stage 3 but the model was "
                                 "not partitioned by zerokern.shard_model")
        elif cfg.stage != 3 or runtime_of_module(self.model) is None:
            if cfg.stage == 3:
                # The Trainer may have left the model on the CPU (full-eval dtypes, no device
                # placement); a partitioned model's shards stay where they are made.
                self.model.to(self.args.device)
            # The first half of zerokern.parallelize, with all of its checks (the Trainer's
            # hyperparameters included) and the comparison across ranks, before the
            # partition; create_optimizer builds the second half.
            # (The hyperparameters of another torch class are its constructor's to check,
            # when create_optimizer builds it.)
            a = self.args
            adamw = cls_kw is None and self._optim_name(a) in _ADAMW_OPTIMS
            prepare_model(self.model, cfg, mesh=self.zero_mesh, where="ZeroTrainer",
                          hparams=dict(lr=a.learning_rate, betas=(a.adam_beta1, a.adam_beta2),
                                       eps=a.adam_epsilon, weight_decay=a.weight_decay)
                          if adamw else None)
        self.add_callback(_ZeroGradAfterStep(self))

    @staticmethod
    def _check_cls_and_kwargs(cls_kw: Any) -> None:
        """``optimizer_cls_and_kwargs``: a torch optimizer class whose update zerokern can
        shard (element-wise) and its keywords, refused now as ZeroOptimizer would refuse
        them (the class's own constructor checks the keywords)."""
        if not (isinstance(cls_kw, (tuple, list)) and len(cls_kw) == 2
                and isinstance(cls_kw[0], type) and isinstance(cls_kw[1], dict)):
            raise TypeError("ZeroTrainer: optimizer_cls_and_kwargs must be (a torch optimizer "
                            f"class, a dict of its keywords), got {cls_kw!r}")
        rule_for(cls_kw[0], cls_kw[1])

    @staticmethod
    def _optim_name(targs: Any) -> str:
        optim = getattr(targs, "optim", "adamw_torch")
        return getattr(optim, "value", None) or optim

    @staticmethod
    def _given_config(opt: ZeroOptimizer, cfg: ZeroConfig, stage_given: bool,
                      mesh: Any) -> ZeroConfig:
        """The config of a ZeroAdamW given in ``optimizers=``: the options given to the
        trainer too must be its own."""
        if stage_given and cfg.stage != opt.stage:
            raise ValueError(f"ZeroTrainer: zero_stage={cfg.stage} but the ZeroAdamW "
                             f"given in optimizers is stage {opt.stage}")
        if mesh is not None:
            raise ValueError("ZeroTrainer: mesh= together with optimizers=: the ZeroAdamW "
                             "given runs over the group or mesh it was built with; give the "
                             "mesh to it (or to zerokern.parallelize)")
        default = ZeroConfig()
        moved = [n for n in ZeroConfig.MODEL if getattr(cfg, n) != getattr(default, n)]
        if moved:
            raise ValueError(
                f"ZeroTrainer: {moved[0]}={getattr(cfg, moved[0])!r} together with "
                "optimizers=: the model was prepared before that ZeroAdamW was built; give "
                "the stage-3 options to zerokern.parallelize (or shard_model)")
        check_optimizer(opt, cfg, None, "ZeroTrainer", "the ZeroAdamW given in optimizers=")
        return opt.config

    @staticmethod
    def _check_args(targs: Any, have_optimizer: bool, stage: int) -> None:
        if getattr(targs, "n_gpu", 1) > 1:
            raise ValueError("ZeroTrainer: this process sees several GPUs, so the Trainer would "
                             "use torch.nn.DataParallel; launch one process per GPU with "
                             "torchrun (or set CUDA_VISIBLE_DEVICES)")
        if getattr(targs, "fp16", False):
            raise ValueError("ZeroTrainer: TrainingArguments(fp16=True) uses Accelerate's "
                             "GradScaler, which reads p.grad (ZeroAdamW keeps flat shards); "
                             "use bf16=True")
        for full_eval in ("bf16_full_eval", "fp16_full_eval"):
            # The Trainer casts the whole model with model.to(dtype) for an evaluation outside
            # train() (the final evaluate, an eval-only run): a partitioned model's flat shards
            # keep their dtype, so that evaluate would fail after all of the training.
            if stage == 3 and getattr(targs, full_eval, False):
                raise ValueError(
                    f"ZeroTrainer: TrainingArguments({full_eval}=True) at stage 3: the Trainer "
                    "evaluates by casting the whole model (model.to(dtype)), which a "
                    f"partitioned model cannot be (even a no-op cast); drop {full_eval} and "
                    "evaluate under autocast with bf16=True, train a 16-bit model, or use "
                    "stage 0-2")
        optim = ZeroTrainer._optim_name(targs)
        if not have_optimizer and optim not in _ADAMW_OPTIMS + _TORCH_OPTIMS:
            raise ValueError(f"ZeroTrainer: TrainingArguments(optim={optim!r}); "
                             "ZeroTrainer shards 'adamw_torch' (ZeroAdamW) and torch's "
                             f"element-wise classes {', '.join(map(repr, _TORCH_OPTIMS))}, or "
                             "optimizer_cls_and_kwargs=(an element-wise torch class, {...})")
        if getattr(targs, "optim_args", None) and (have_optimizer or optim in _ADAMW_OPTIMS):
            raise ValueError("ZeroTrainer: TrainingArguments(optim_args=...) is not used by "
                             "ZeroAdamW or a given optimizer; pass a ZeroAdamW (or "
                             "ZeroOptimizer) through optimizers= instead")

    # -- construction -----------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        # The Trainer builds `Accelerator(**args)` from the name in its module; ZeroAccelerator
        # takes the same arguments.
        plain = _trainer_mod.Accelerator
        _trainer_mod.Accelerator = ZeroAccelerator
        try:
            super().create_accelerator_and_postprocess()
        finally:
            _trainer_mod.Accelerator = plain

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is not None:
            return self.optimizer
        opt_model = self.model if model is None else model
        decay = set(self.get_decay_parameter_names(opt_model))
        trainable = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in trainable if n in decay],
             "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0},
        ]
        # Both groups, even an empty one, as the Trainer builds them: a plain Trainer's
        # optimizer.pt and the schedulers' per-group lists then line up.
        if self.optimizer_cls_and_kwargs is not None or \
                self._optim_name(self.args) in _TORCH_OPTIMS:
            # The class and keywords the Trainer itself would build, sharded.
            if self.optimizer_cls_and_kwargs is not None:
                cls, kw = self.optimizer_cls_and_kwargs
            else:
                cls, kw = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
            self.optimizer = ZeroOptimizer(groups, cls, config=self.zero_config,
                                           mesh=self.zero_mesh, **kw)
            return self.optimizer
        self.optimizer = ZeroAdamW(
            groups, lr=self.args.learning_rate,
            betas=(self.args.adam_beta1, self.args.adam_beta2), eps=self.args.adam_epsilon,
            weight_decay=self.args.weight_decay, config=self.zero_config, mesh=self.zero_mesh)
        return self.optimizer

    @property
    def zero_optimizer(self) -> ZeroOptimizer:
        """The ZeroAdamW (or ZeroOptimizer) inside the Trainer's (Accelerate-wrapped)
        optimizer."""
        opt = unwrap_optimizer(self.optimizer)
        if not isinstance(opt, ZeroOptimizer):
            raise RuntimeError("ZeroTrainer: the optimizer is not built yet (train() builds it)")
        return opt

    # -- checkpoints ------------------------------------------------------------------------
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # Every rank writes its own shards (a collective); rank 0 the scheduler, as the Trainer.
        save_checkpoint(os.path.join(output_dir, ZERO_CHECKPOINT), self.model,
                        self.zero_optimizer)
        if self.args.should_save and self.lr_scheduler is not None:
            with warnings.catch_warnings(record=True):
                torch.save(self.lr_scheduler.state_dict(),
                           os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str,
                              model: torch.nn.Module | None = None) -> None:
        # A zerokern checkpoint restores the model exactly (fp32 masters included) together
        # with the optimizer, in _load_optimizer_and_scheduler; anything else is the Trainer's.
        if not os.path.isdir(os.path.join(resume_from_checkpoint, ZERO_CHECKPOINT)):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        zero_dir = os.path.join(checkpoint, ZERO_CHECKPOINT)
        torch_opt = os.path.join(checkpoint, OPTIMIZER_NAME)
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isdir(zero_dir):
            load_checkpoint(zero_dir, self.model, self.zero_optimizer)
        elif os.path.isfile(torch_opt):
            # A plain Trainer's optimizer.pt: the torch class's format, which ZeroAdamW /
            # ZeroOptimizer load at any stage and world size (every rank reads the file).
            self.zero_optimizer.load_state_dict(
                torch.load(torch_opt, map_location="cpu", weights_only=True))
        else:
            return
        if os.path.isfile(sched) and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if runtime_of_module(self.model) is None:
            super().save_model(output_dir, _internal_call)
            return
        # Stage 3: gather the full parameters unit by unit on every rank (rank 0 keeps them),
        # then the Trainer writes them as usual (safetensors, config) from rank 0.
        output_dir = self.args.output_dir if output_dir is None else output_dir
        state_dict = full_state_dict(self.model, rank0_only=True)
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
