"""ZeroAdamW (and any ``ZeroOptimizer``) under Hugging Face Accelerate: ``ZeroAccelerator``, an
``accelerate.Accelerator`` whose multi-process path leaves gradient averaging to zerokern's
optimizers. (ZeroAdamW below stands for any of them: ``ZeroOptimizer`` of a torch class too.)

A plain ``Accelerator`` wraps every trainable model in DistributedDataParallel when it runs on
several processes, which would average ZeroAdamW's gradients twice (zerokern refuses that
wrap). ``ZeroAccelerator`` differs from it in exactly the places where ZeroAdamW needs it:

- ``prepare(model, ...)`` does everything ``Accelerator`` does (device placement, autocast,
  torch.compile) except the DDP wrap;
- an optimizer given to ``prepare`` on several processes must be a ZeroAdamW or ZeroOptimizer
  (a torch optimizer
  would then step on gradients nobody averaged), and ``backward`` refuses a prepared model whose
  trainable parameters no ZeroAdamW trains, before any gradient exists;
- ``no_sync(model)`` / ``accumulate(model)`` skip ZeroAdamW's communication (``opt.no_sync()``)
  on the micro-steps that do not step;
- ``clip_grad_norm_(model.parameters(), max_norm)`` is ZeroAdamW's global-norm clipping (one
  norm over all of them when two optimizers train disjoint parts of the model);
- ``save_state`` / ``load_state`` write and read zerokern's sharded checkpoint (every rank its
  own part) for each ZeroAdamW and its model, and Accelerate's own files for the rest (RNG
  states, schedulers, samplers, custom objects);
- ``get_state_dict(model)`` of a ``shard_model``'ed model gathers the full parameters (call it on
  every rank).

The model and its optimizer are put together by the script, before ``prepare``, with
``opt = zerokern.parallelize(model, stage=..., ...)`` (at stage 3 it partitions the model
first); ``prepare(model, opt, ...)`` then takes both as they are.

fp16 mixed precision is refused: Accelerate's GradScaler reads ``p.grad``, which ZeroAdamW
keeps in flat shards. Use bf16, or 16-bit parameters with ``ZeroAdamW(loss_scale="dynamic")``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..checkpoint import load_checkpoint, save_checkpoint
from ..zero import ZeroOptimizer
from ..zero.interop import optimizer_of
from ..zero.registry import runtime_of_module, runtime_of_param
from ..zero.shard import full_state_dict
from ._optional import require

_acc = require("accelerate", "accelerate", "accelerate")
_acc_utils = require("accelerate.utils", "accelerate", "accelerate")
DistributedType = _acc_utils.DistributedType

# Where save_state puts zerokern's checkpoint of the i-th ZeroAdamW inside its output_dir.
CHECKPOINT_DIR = "zerokern"


def _checkpoint_dir(output_dir: str, i: int) -> str:
    return os.path.join(output_dir, CHECKPOINT_DIR if i == 0 else f"{CHECKPOINT_DIR}_{i}")


def unwrap_optimizer(opt: Any) -> Any:
    """The optimizer inside Accelerate's (possibly nested) AcceleratedOptimizer wrappers."""
    while isinstance(opt, _acc.optimizer.AcceleratedOptimizer):
        opt = opt.optimizer
    return opt


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def zero_managed(model: torch.nn.Module) -> bool:
    """Whether zerokern manages ``model``: shard_model partitioned it, or a ZeroAdamW trains
    one of its parameters."""
    return runtime_of_module(model) is not None or any(
        optimizer_of(p) is not None or runtime_of_param(p) is not None
        for p in model.parameters())


class _ZeroAcceleratedOptimizer(_acc.optimizer.AcceleratedOptimizer):
    """Accelerate's wrapper, reporting ZeroAdamW's own skipped steps (its loss scaler's
    overflow), so that the Trainer and ``accelerator.optimizer_step_was_skipped`` leave the
    LR scheduler alone on them, as with torch's GradScaler."""

    @property
    def step_was_skipped(self) -> bool:
        return bool(getattr(unwrap_optimizer(self), "last_step_skipped", False))


class ZeroAccelerator(_acc.Accelerator):
    """``accelerate.Accelerator`` for models trained by ZeroAdamW: takes the same arguments and
    is used the same way (``prepare``, ``backward``, ``accumulate``, ``clip_grad_norm_``,
    ``save_state``); the differences are listed in the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.mixed_precision == "fp16":
            raise ValueError(
                "ZeroAccelerator(mixed_precision='fp16'): Accelerate's GradScaler reads p.grad, "
                "which ZeroAdamW keeps in flat shards; use mixed_precision='bf16', or fp16 "
                "parameters with ZeroAdamW(loss_scale='dynamic')")
        if self.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU,
                                         DistributedType.MULTI_GPU):
            raise ValueError(
                f"ZeroAccelerator: distributed_type {self.distributed_type} (an Accelerate "
                "FSDP/DeepSpeed/... plugin) shards the model itself; ZeroAdamW replaces that "
                "plugin: launch without it")

    # -- prepare ----------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        rt = runtime_of_module(self.unwrap_model(model, keep_torch_compile=False))
        if rt is not None and rt.device.type != self.device.type:
            # Moving a partitioned model would move only its placeholders.
            raise ValueError(
                f"ZeroAccelerator.prepare: the model was partitioned by shard_model on "
                f"{rt.device}, but this accelerator trains on {self.device}; move the model "
                f"to the device first, then call zerokern.parallelize (or shard_model)")
        # evaluation_mode is Accelerate's own "everything but the distributed wrapper": device
        # placement, autocast and torch.compile are applied as for any model.
        return super().prepare_model(model, device_placement=device_placement,
                                     evaluation_mode=True)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          device_placement: bool | None = None) -> Any:
        inner = unwrap_optimizer(optimizer)
        if self.num_processes > 1 and not isinstance(inner, ZeroOptimizer):
            raise TypeError(
                f"ZeroAccelerator.prepare: got a {type(inner).__name__}; on several processes "
                "ZeroAccelerator leaves gradient averaging to ZeroAdamW (no DDP wrap), so other "
                "optimizers would step on unaveraged gradients. Use zerokern.ZeroAdamW (or "
                "zerokern.ZeroOptimizer(params, <the torch class>, ...)), or a plain "
                "accelerate.Accelerator for this optimizer")
        if not isinstance(inner, ZeroOptimizer):
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        # No device placement: Accelerate would round-trip the optimizer's whole state
        # through state_dict() onto the device (with offload="cpu": the state kept off it).
        # ZeroAdamW keeps its state where its parameters are (or on the host, offloaded).
        prepared = super().prepare_optimizer(optimizer, device_placement=False)
        prepared.__class__ = _ZeroAcceleratedOptimizer
        return prepared

    def zero_optimizers(self) -> list[ZeroOptimizer]:
        """The zerokern optimizers (ZeroAdamW, ZeroOptimizer) given to prepare, unwrapped."""
        return [o for o in map(unwrap_optimizer, self._optimizers) if isinstance(o, ZeroOptimizer)]

    def _optimizers_of(self, model: torch.nn.Module) -> list[ZeroOptimizer]:
        ids = {id(p) for p in model.parameters()}
        return [o for o in self.zero_optimizers()
                if any(id(p) in ids for p in o.managed_params)]

    def _model_of(self, opt: ZeroOptimizer) -> torch.nn.Module:
        managed = {id(p) for p in opt.managed_params}
        for m in self._models:
            m = self.unwrap_model(m, keep_torch_compile=False)
            if managed <= {id(p) for p in m.parameters()}:
                return m
        raise ValueError("ZeroAccelerator: no prepared model holds every parameter of a "
                         "prepared ZeroAdamW; prepare the model together with its optimizer")

    # -- the training step ------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.num_processes > 1:
            self._check_every_model_is_managed()
        scaled = loss
        for opt in self.zero_optimizers():  # a ZeroAdamW loss scaler (16-bit parameters)
            if opt.scaler is not None:
                scaled = opt.scale_loss(scaled)
                break
        super().backward(scaled, **kwargs)

    def _check_every_model_is_managed(self) -> None:
        for m in self._models:
            m = self.unwrap_model(m, keep_torch_compile=False)
            left = [p for p in _trainable(m)
                    if optimizer_of(p) is None and runtime_of_param(p) is None]
            if left:
                raise RuntimeError(
                    f"ZeroAccelerator.backward: a prepared model has {len(left)} trainable "
                    "parameters that no ZeroAdamW trains; ZeroAccelerator does not wrap models "
                    "in DDP, so their gradients would not be averaged. Build ZeroAdamW from "
                    "all of model.parameters() (freeze the others) and prepare it")

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        opts = self._optimizers_of(self.unwrap_model(model, keep_torch_compile=False))
        if not opts:
            with super().no_sync(model):
                yield
            return
        with contextlib.ExitStack() as stack:
            for o in opts:
                stack.enter_context(o.no_sync())
            yield

    def clip_grad_norm_(self, parameters: Iterable[torch.nn.Parameter] | torch.Tensor,
                        max_norm: float, norm_type: float = 2) -> torch.Tensor:
        # Accelerate ends in torch.nn.utils.clip_grad_norm_, which zerokern routes to
        # ZeroAdamW.clip_grad_norm_ for its parameters (the global norm, a collective).
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    # -- state ------------------------------------------------------------------------------
    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        inner = self.unwrap_model(model, keep_torch_compile=False)
        if runtime_of_module(inner) is not None:
            # A collective: every rank gathers unit by unit; rank 0 keeps the values.
            return full_state_dict(inner, rank0_only=True)
        return super().get_state_dict(model, unwrap=unwrap)

    @contextlib.contextmanager
    def _without_zero_objects(self) -> Iterator[None]:
        """Hide the ZeroAdamW optimizers and their models from Accelerate's own save/load,
        which would write rank 0's shard as if it were the whole optimizer."""
        zero_opts = {id(o) for o in self.zero_optimizers()}
        zero_models = {id(self._model_of(o)) for o in self.zero_optimizers()}
        models, opts = self._models, self._optimizers
        self._models = [m for m in models
                        if id(self.unwrap_model(m, keep_torch_compile=False)) not in zero_models]
        self._optimizers = [o for o in opts if id(unwrap_optimizer(o)) not in zero_opts]
        try:
            yield
        finally:
            self._models, self._optimizers = models, opts

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> str:
        with self._without_zero_objects():
            location = super().save_state(output_dir, safe_serialization=safe_serialization,
                                          **save_model_func_kwargs)
        # Accelerate may have chosen the directory (automatic_checkpoint_naming).
        for i, opt in enumerate(self.zero_optimizers()):
            save_checkpoint(_checkpoint_dir(location, i), self._model_of(opt), opt)
        return location

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> None:
        if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
            folder = os.path.join(self.project_dir, "checkpoints")
            input_dir = max((os.path.join(folder, f) for f in os.listdir(folder)),
                            key=lambda f: int(f.rsplit("_", 1)[-1]))
        if input_dir is None:
            raise ValueError("ZeroAccelerator.load_state: input_dir is required")
        input_dir = os.fspath(input_dir)
        opts = self.zero_optimizers()
        missing = [d for d in (_checkpoint_dir(input_dir, i) for i in range(len(opts)))
                   if not os.path.isdir(d)]
        if missing:  # checked before Accelerate's loads modify anything
            raise FileNotFoundError(
                f"ZeroAccelerator.load_state({input_dir}): no zerokern checkpoint at "
                f"{missing[0]} (was it saved by ZeroAccelerator.save_state?)")
        for i, opt in enumerate(opts):
            load_checkpoint(_checkpoint_dir(input_dir, i), self._model_of(opt), opt)
        with self._without_zero_objects():
            super().load_state(input_dir, load_kwargs=load_kwargs, **load_model_func_kwargs)
