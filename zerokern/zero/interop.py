"""Where torch habits meet ZeroAdamW.

- ``torch.nn.utils.clip_grad_norm_`` reads ``p.grad``, which ZeroAdamW has reduced into flat
  shards (stage 1: this rank's slices of a flat gradient; stages 2-3: no ``p.grad`` at all), so
  it would silently compute a per-rank partial norm. Trainers (HF Trainer, Accelerate,
  Lightning) call it themselves. zerokern replaces it (at import) by a function that hands the
  parameters of a ZeroAdamW to ``ZeroAdamW.clip_grad_norm_`` (the global norm, a collective),
  those of several zerokern optimizers to one norm over all of them (joint_clip.py), and
  passes every other call through unchanged.
- A model run inside ``DistributedDataParallel`` would have its gradients averaged twice (or,
  at stage 3, break inside autograd). Two checks refuse it before anything changes: DDP's
  constructor (wrapped at import) refuses a module holding parameters of a ZeroAdamW or of
  ``shard_model``, and remembers (weakly) every DDP it built; ZeroAdamW and shard_model
  refuse parameters that a live DDP holds (the model was wrapped first). No global module
  hook is involved: torch.compile warns about those and they run on every module's forward.
"""

from __future__ import annotations

import functools
import gc
import sys
import weakref
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.weak import WeakIdKeyDictionary

from .joint_clip import check_covered, clip_joint
from .registry import runtime_of_param

_OPT_OF_PARAM: WeakIdKeyDictionary = WeakIdKeyDictionary()
_TORCH_CLIP = torch.nn.utils.clip_grad_norm_


def register_params(params: list[torch.nn.Parameter], opt: Any) -> None:
    # A weak reference: a deleted optimizer must not live on through its parameters.
    ref = weakref.ref(opt)
    for p in params:
        _OPT_OF_PARAM[p] = ref


def optimizer_of(p: object) -> Any:
    """The zerokern optimizer (ZeroAdamW, ZeroOptimizer) that trains ``p`` (None if none)."""
    ref = _OPT_OF_PARAM.get(p) if isinstance(p, torch.Tensor) else None
    return None if ref is None else ref()


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_, made correct for the parameters of zerokern's
    optimizers: one optimizer's go to its ``clip_grad_norm_``, several optimizers' to one
    norm over all of them (joint_clip.py)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    opts = {id(o): o for o in map(optimizer_of, params) if o is not None}
    if not opts:
        return _TORCH_CLIP(params, max_norm, norm_type=norm_type,
                           error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    # Only whole optimizers, and no gradient of this rank alone: refused before anything.
    check_covered(params, list(opts.values()), optimizer_of)
    if len(opts) > 1:
        return clip_joint(list(opts.values()), max_norm, norm_type,
                          error_if_nonfinite=error_if_nonfinite)
    (opt,) = opts.values()
    return opt.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)


_DDP_INIT = DistributedDataParallel.__init__
_DDP_MESSAGE = (
    "ZeroAdamW averages gradients over the ranks itself, so DDP would average them twice "
    "(stage 3: break inside autograd). Remove the DDP(...) wrapper and give ZeroAdamW the "
    "plain model's parameters.")


# Trainers that wrap the model in DDP themselves, by the module of the code that called
# DDP(...) (or ran the forward), and what to use instead. The first match in this order wins:
# the HF Trainer calls Accelerate, and an HF model's own code (transformers.models) may run
# under Lightning, so the trainer modules themselves are what is looked for.
_TRAINER_HINTS = (
    ("transformers.trainer", "the HF Trainer wraps the model in DDP: use "
     "zerokern.integrations.transformers.ZeroTrainer instead of transformers.Trainer"),
    ("pytorch_lightning", "Lightning's DDP strategy wraps the model: use "
     "pl.Trainer(strategy=zerokern.integrations.lightning.ZeroStrategy(...))"),
    ("lightning", "Lightning's DDP strategy wraps the model: use "
     "pl.Trainer(strategy=zerokern.integrations.lightning.ZeroStrategy(...))"),
    ("accelerate", "accelerate.Accelerator.prepare wraps the model in DDP: use "
     "zerokern.integrations.accelerate.ZeroAccelerator instead of Accelerator"),
)


def _trainer_hint() -> str:
    """What to use instead, when a known trainer is among the callers."""
    found: set[str] = set()
    frame = sys._getframe(2)
    while frame is not None:
        found.add(str(frame.f_globals.get("__name__", "")))
        frame = frame.f_back
    for module, hint in _TRAINER_HINTS:
        if any(m == module or m.startswith(module + ".") for m in found):
            return f" Here {hint}."
    return ""


# Every DDP built in this process (weakly): for a model wrapped before its ZeroAdamW exists.
_LIVE_DDP: weakref.WeakSet = weakref.WeakSet()


@functools.wraps(_DDP_INIT)
def _ddp_init(self: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
    for p in module.parameters():
        if optimizer_of(p) is not None or runtime_of_param(p) is not None:
            raise RuntimeError("DistributedDataParallel(model): the model's parameters are "
                               "managed by zerokern (ZeroAdamW or shard_model). "
                               + _DDP_MESSAGE + _trainer_hint())
    _DDP_INIT(self, module, *args, **kwargs)
    _LIVE_DDP.add(self)


def check_no_ddp(params: Any, who: str) -> None:
    """Raise (before ``who`` changes anything) when a live DDP holds any of ``params``: the
    model was wrapped in DDP before ZeroAdamW / shard_model saw it."""
    if not _LIVE_DDP:
        return
    ids = {id(p) for p in params}
    for ddp in list(_LIVE_DDP):
        mod = getattr(ddp, "module", None)
        if mod is not None and any(id(p) in ids for p in mod.parameters()):
            raise RuntimeError(f"{who}: the model is wrapped in torch DistributedDataParallel. "
                               + _DDP_MESSAGE + _trainer_hint())


def install() -> None:
    """Point torch's clip_grad_norm_ (both places it is reachable from) at the function above
    and put the check in front of DDP's constructor; idempotent."""
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_
    if DistributedDataParallel.__init__ is not _ddp_init:
        DistributedDataParallel.__init__ = _ddp_init
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # zerokern imported after the process group exists: DDPs may have been built
            # without the wrapper. Found once, here (DDP needs a group, so only then).
            _LIVE_DDP.update(o for o in gc.get_objects()
                             if issubclass(type(o), DistributedDataParallel))


def active_ddp_module() -> Any:
    # Present since torch 2.0 (torch.compile's DDP support); absent: nothing to detect with.
    return getattr(DistributedDataParallel, "_active_ddp_module", None)
