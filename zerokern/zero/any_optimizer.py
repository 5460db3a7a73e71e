"""ZeroOptimizer: any element-wise torch optimizer under ZeRO stages 0-3, spelt as
``torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class, **defaults)``.

The machinery is the parts' (core.py builds them, training.py steps them, state_api.py shows
the state); what differs between optimizers is the update rule (rules/): AdamW's fused kernels
for ``torch.optim.AdamW`` (the very path of ``ZeroAdamW``), the class's own ``step()`` over
the flat shard for the other element-wise classes (rules/torch_class.py), and a refusal for
the rest (rules/elementwise.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..quant.adamw import DEFAULT_INT8_FORMAT
from .config import ZeroConfig
from .core import ZeroCore
from .interchange import check_adamw_flags
from .rules import ADAMW, UpdateRule
from .rules.elementwise import rule_for
from .rules.torch_class import class_name
from .state_api import StateSurface
from .training import TrainingLoop
from .validate import check_eps_moments, check_hparams


class ZeroOptimizer(StateSurface, TrainingLoop, ZeroCore):
    """A torch optimizer class, sharded with ZeRO across the ranks of ``process_group``.

    ``ZeroOptimizer(model.parameters(), torch.optim.SGD, stage=2, lr=0.1, momentum=0.9)`` is
    DDP + ``torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)``, with the optimizer
    state (stage 1), the gradients (stage 2) and with ``shard_model`` the parameters (stage 3)
    split 1/N to the element, as ``ZeroAdamW`` splits them. Everything ``ZeroAdamW`` has
    works the same way here: offload, the 2-D mesh, clipping, loss scaling, ``no_sync``,
    ``opt.state``, ``shards()``, per-rank and torch-format state dicts, ``save_checkpoint`` /
    ``load_checkpoint``.

    Which classes: ``torch.optim.AdamW`` runs zerokern's fused AdamW (the path of
    ``ZeroAdamW``, bit for bit). torch's other element-wise optimizers (SGD, Adam, Adagrad,
    RMSprop, NAdam, RAdam, Adamax, Adadelta, Rprop, ASGD) run their own ``step()`` over this
    rank's flat fp32 shard, so the result is the class's update, to the rounding of the same
    operations. A subclass that keeps one of their ``step`` methods is accepted; any other
    class must declare that its update is element-wise (class attribute
    ``zerokern_elementwise = True``, or ``elementwise=True`` here). ``torch.optim.Muon``
    runs with whole-matrix owners: its momentum sharded like any buffer, Newton-Schulz run
    once per matrix on the matrix's owner rank (zero/muon_step.py). LBFGS, SparseAdam and
    Adafactor are refused (docs/other-optimizers.md says why and what to do).

    The class's hyperparameters are checked as the class checks them (its constructor runs
    on a placeholder with each group's values, before anything is sharded), and per-element
    state, step counts and per-parameter scalars are what the class keeps, in its own
    state-dict keys: ``full_state_dict()`` loads into the torch class and a torch state dict
    of the class loads here (``load_state_dict``).

    Args:
        params: the parameters to train, or param-group dicts, as for ``optimizer_class``.
            Only parameters that require grad at construction are trained; at stages 0-2
            they may have several dtypes (one flat layout per dtype, as ``ZeroAdamW``).
        optimizer_class: the torch optimizer class (not an instance), e.g.
            ``torch.optim.SGD``.
        stage: the ZeRO stage, an int 0-3 (3 needs a model partitioned by
            ``shard_model``).
        process_group: the group whose ranks share the work; default the world.
        bucket_numel: gradient bucket size in elements (stages 0-2); default 2**21.
        max_grad_norm: clip every step to this global 2-norm (None: no clipping).
        loss_scale: ``"dynamic"`` or a float, for fp16 parameters (as ``ZeroAdamW``).
        overlap_comm: run the gradient collectives asynchronously, overlapping backward.
        backend: AdamW's kernels' backend (as ``ZeroAdamW``); other classes run torch's ops.
        offload: ``"cpu"`` for ZeRO-Offload (stages 1-3): the state and the step on the host.
        moments: ``"fp32"``; ``"bf16"`` and ``"int8"`` only for ``torch.optim.AdamW``.
        master: ``"fp32"``; ``"none"`` only for ``torch.optim.AdamW``.
        seed: the stochastic rounding key of ``master="none"``.
        int8_format: the format version of new int8 moments (2 or 3), as ``ZeroAdamW``.
        mesh: a ``DeviceMesh`` instead of ``process_group`` (2-D: hybrid sharding, as
            ``ZeroAdamW``).
        reduce_dtype: None, ``torch.float32``, or ``"int8"`` / ``"int4"`` (quantized
            gradient reduce-scatter, stages 1-3), as ``ZeroAdamW``.
        gather_dtype: None or ``"int8"`` (quantized parameter all-gather, stages 1-3), as
            ``ZeroAdamW``.
        error_feedback: error feedback on the quantized gradient reduce, as ``ZeroAdamW``.
        config: a ``zerokern.ZeroConfig`` holding the options ``stage`` through
            ``error_feedback``, instead of those keywords.
        elementwise: declare ``optimizer_class``'s update element-wise (for a class that is
            neither one of torch's element-wise optimizers, nor a subclass keeping its
            ``step``, nor marked ``zerokern_elementwise = True``).
        **defaults: the class's hyperparameters (``lr=``, ``momentum=``, ...), as its
            constructor takes them; checked by it.

    Every rank must give the same class, options and hyperparameters (compared in one gather
    before anything is sharded; a difference is refused on every rank, naming it).

    Attributes:
        rule: the update rule stepping the state (``zerokern.zero.rules``).
        config: the options as a ``ZeroConfig`` (validated and agreed across ranks).
        stage: the ZeRO stage.
        offload: ``"cpu"`` or None.
        max_grad_norm: the clipping norm of every step, or None.
        last_grad_norm: the global gradient norm of the last step (None before one).
        last_step_skipped: whether the last ``step()`` was skipped by the loss scaler.
        comm: the process group's wrapper; ``comm.rank`` and ``comm.world_size``.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        *,
        stage: int = 2,
        process_group: Any = None,
        bucket_numel: int | None = None,
        max_grad_norm: float | None = None,
        loss_scale: float | str | None = None,
        overlap_comm: bool = True,
        backend: str | None = None,
        offload: str | None = None,
        moments: str = "fp32",
        master: str = "fp32",
        seed: int = 0,
        int8_format: int = DEFAULT_INT8_FORMAT,
        mesh: Any = None,
        reduce_dtype: torch.dtype | str | None = None,
        gather_dtype: str | None = None,
        error_feedback: bool = False,
        config: ZeroConfig | None = None,
        elementwise: bool = False,
        **defaults: Any,
    ) -> None:
        def resolve(cfg: ZeroConfig) -> tuple[UpdateRule, dict[str, Any]]:
            rule = rule_for(optimizer_class, defaults, elementwise)
            if rule is ADAMW:  # torch.optim.AdamW itself: ZeroAdamW's path
                return rule, adamw_defaults(cfg, **defaults)
            rule.check_format(cfg.state_format)
            return rule, dict(rule.defaults)

        label = (class_name(optimizer_class) if isinstance(optimizer_class, type)
                 else repr(optimizer_class))
        self._construct(params, resolve, _options(locals()), config, mesh=mesh,
                        process_group=process_group, optimizer=label)


def _options(args: dict[str, Any]) -> dict[str, Any]:
    """The ZeroConfig keywords among a constructor's arguments."""
    return {k: args[k] for k in ZeroConfig.adamw_names()}


def adamw_defaults(cfg: ZeroConfig, lr: float = 1e-3,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                   weight_decay: float = 1e-2, amsgrad: bool = False, *,
                   maximize: bool = False, foreach: bool | None = None,
                   capturable: bool = False, differentiable: bool = False,
                   fused: bool | None = None,
                   decoupled_weight_decay: bool = True) -> dict[str, Any]:
    """torch.optim.AdamW's arguments, checked: the param groups' defaults of ZeroAdamW (the
    flags that change the update refused unless at AdamW's values; ``foreach``, ``fused``
    and ``capturable`` choose torch's kernels, and the fused rule has its own)."""
    del foreach, fused, capturable
    check_hparams(lr, betas, eps, weight_decay)
    check_eps_moments(eps, cfg.state_format.moments)
    check_adamw_flags(dict(amsgrad=amsgrad, maximize=maximize, differentiable=differentiable,
                           decoupled_weight_decay=decoupled_weight_decay,
                           weight_decay=weight_decay), "")
    return dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
