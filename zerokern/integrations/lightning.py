"""ZeroAdamW (or a ``ZeroOptimizer`` of another torch class) inside PyTorch Lightning:
``ZeroStrategy``, for ``pl.Trainer(strategy=...)``.

Lightning's DDPStrategy wraps the model in DDP, lets DDP average the gradients and saves one
file from rank 0. ZeroAdamW averages the gradients itself and holds only this rank's part of
the optimizer state (stage 3: of the parameters too), so ``ZeroStrategy`` changes what Lightning's
DeepSpeed and FSDP strategies change, and keeps the rest of DDPStrategy (process group,
launcher, sampler, collectives):

- the options are one ``zerokern.ZeroConfig`` (``config=``, or its fields as keywords) and
  a ``mesh`` (or its shape, built once the process group exists);
- no DDP wrap. In the strategy's setup, after ``configure_model`` and before
  ``configure_optimizers``, ``zerokern.compose.prepare_model`` (the first half of
  ``zerokern.parallelize``) checks the options against the model and compares them across
  ranks, and at stage 3 partitions the LightningModule, so that the ZeroAdamW built in
  ``configure_optimizers`` (the second half; ``strategy.zero_adamw(self.parameters(),
  lr=...)``) gets the sharded parameters;
- ``configure_optimizers`` must return one ``zerokern.ZeroAdamW`` (or ``ZeroOptimizer``:
  ``strategy.zero_optimizer(self.parameters(), torch.optim.SGD, lr=...)``) of the strategy's
  stage, mesh and options (with or without an LR scheduler): a torch optimizer would step on
  gradients nobody averaged, so anything else is refused at setup;
- accumulation (``accumulate_grad_batches``): the micro-batches before the last run under
  ``opt.no_sync()``, where DDPStrategy uses ``DDP.no_sync()``;
- clipping (``gradient_clip_val``): the precision plugin's clip-by-norm is
  ``opt.clip_grad_norm_``, the norm over all ranks; clip-by-value is refused;
- checkpoints: ``trainer.save_checkpoint(path)`` writes a zerokern sharded checkpoint
  directory at ``path`` (every rank its own part), with Lightning's own state (loops,
  callbacks, LR schedulers, hyperparameters) inside its ``extra``; ``Trainer.fit(...,
  ckpt_path=path)`` restores both, at any world size and stage. A single-file checkpoint of
  another strategy (e.g. DDP: torch AdamW state) resumes too.
"""

from __future__ import annotations

from ._optional import require

# Before the imports below: a missing package is reported with the install line.
require("pytorch_lightning", "pytorch-lightning", "lightning")

import base64  # noqa: E402
import io  # noqa: E402
import os  # noqa: E402
from collections.abc import Generator, Mapping, Sequence  # noqa: E402
from contextlib import ExitStack, contextmanager  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Any, Literal  # noqa: E402

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment  # noqa: E402
from lightning_fabric.plugins.collectives.torch_collective import default_pg_timeout  # noqa: E402
from lightning_fabric.strategies import _StrategyRegistry  # noqa: E402
from pytorch_lightning.core.optimizer import LightningOptimizer  # noqa: E402
from pytorch_lightning.overrides.distributed import _sync_module_states  # noqa: E402
from pytorch_lightning.plugins.precision import MixedPrecision, Precision  # noqa: E402
from pytorch_lightning.strategies import DDPStrategy  # noqa: E402
from pytorch_lightning.strategies.strategy import _ForwardRedirection  # noqa: E402
from pytorch_lightning.trainer.states import TrainerFn  # noqa: E402
from torch import nn  # noqa: E402

from ..checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from ..checkpoint.format import remove_checkpoint_dir  # noqa: E402
from ..checkpoint.locks import publishing  # noqa: E402
from ..compose import prepare_model  # noqa: E402
from ..zero import ZeroAdamW, ZeroOptimizer, full_state_dict  # noqa: E402
from ..zero.config import ZeroConfig  # noqa: E402
from ..zero.interop import optimizer_of  # noqa: E402
from ..zero.registry import runtime_of_param  # noqa: E402
from ._options import build_mesh, check_mesh_arg, check_optimizer, config_of  # noqa: E402

__all__ = ["ZeroStrategy", "to_lightning_checkpoint"]

# The key of ZeroStrategy's entry in a zerokern checkpoint's ``extra``.
EXTRA_KEY = "lightning"
_EXTRA_FORMAT = 1
# Lightning checkpoint entries the zerokern checkpoint itself holds (sharded, exact).
_SHARDED_KEYS = ("state_dict", "optimizer_states")


class _Stage3Root(nn.Module):
    """The module ``shard_model`` partitions at stage 3: a view of the LightningModule.

    The stage-3 runtime gathers the root's own parameters in the root's forward and keeps them
    through it, and its saved-tensor hooks are active only inside it, so the whole
    ``training_step`` must run inside the root's forward. Lightning arranges that for a
    wrapper (its forward redirection, used for DDP and FSDP), and ``training_step`` usually
    calls ``self(x)``, which would re-enter the root if the root were the LightningModule
    itself. This root shares the LightningModule's parameter, buffer and submodule dicts (it
    does not hold the LightningModule as a child), so its parameter names, state dict and
    checkpoints are the LightningModule's own, without a prefix: a checkpoint saved at
    stage 3 loads at stages 0-2 and back.
    """

    def __init__(self, module: pl.LightningModule) -> None:
        super().__init__()
        object.__setattr__(self, "_lightning_module", module)  # not a submodule: no prefix
        object.__setattr__(self, "_parameters", module._parameters)
        object.__setattr__(self, "_buffers", module._buffers)
        object.__setattr__(self, "_non_persistent_buffers_set",
                           module._non_persistent_buffers_set)
        object.__setattr__(self, "_modules", module._modules)
        self.training = module.training

    @property
    def lightning_module(self) -> pl.LightningModule:
        return self._lightning_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._lightning_module(*args, **kwargs)

    def train(self, mode: bool = True) -> _Stage3Root:
        # The LightningModule is not a child: set its own flag (self.training in user code).
        self._lightning_module.train(mode)
        self.training = mode
        return self


def _raw(optimizer: Any) -> Any:
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _encode(obj: Any) -> str:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _decode(text: str, weights_only: bool | None) -> Any:
    # As Lightning loads a checkpoint file (torch.load's default weights_only unless given).
    return torch.load(io.BytesIO(base64.b64decode(text)), map_location="cpu",
                      weights_only=weights_only)


def _bind_to_optimizer(lopt: LightningOptimizer) -> LightningOptimizer:
    """Make the optimizer's methods, called on Lightning's wrapper (``self.optimizers()`` in
    manual optimization), run on the optimizer itself.

    LightningOptimizer takes the optimizer's class as a base and forwards only missing
    attributes, so ``wrapper.zero_grad()`` or ``wrapper.clip_grad_norm_(1.0)`` runs
    ZeroAdamW's method with ``self`` the wrapper: what it records for the step (the clip
    coefficient, the zero_grad mark, no_sync's flag) lands on the wrapper, and step(), which
    runs on the optimizer, would not see it. Torch optimizers keep such state in ``state`` and
    ``param_groups``, which are forwarded; ZeroAdamW keeps it in attributes. Everything but
    what LightningOptimizer defines itself (step, toggle_model, ...) is bound to the optimizer.
    """
    opt = lopt.optimizer
    own = set(vars(LightningOptimizer))
    for cls in type(opt).__mro__:
        if cls is object:
            continue
        for name, value in vars(cls).items():
            if name in own or (name.startswith("__") and name.endswith("__")):
                continue
            if callable(value) and not isinstance(value, type):
                lopt.__dict__[name] = getattr(opt, name)
    return lopt


class ZeroStrategy(DDPStrategy):
    """ZeRO stages 0-3 with ``zerokern.ZeroAdamW`` for ``pl.Trainer(strategy=...)``.

    zerokern's options are one ``zerokern.ZeroConfig`` (``config=``, the object
    ``parallelize`` and ``ZeroTrainer`` take) or its fields as keywords of the same names
    (``ZeroConfig.names()``: ``moments``, ``master``, ``reduce_dtype``, ``offload``,
    ``offload_params``, ...), plus ``mesh``. They are checked when the strategy is built, and
    compared across ranks in its setup, before the model is partitioned (stage 3).
    ``configure_optimizers`` builds the optimizer with them:
    ``self.trainer.strategy.zero_adamw(self.parameters(), lr=...)``, for another torch class
    ``self.trainer.strategy.zero_optimizer(self.parameters(), torch.optim.SGD, lr=...,
    momentum=...)``, or a ``ZeroAdamW`` / ``ZeroOptimizer`` of its own, which must then have
    the strategy's stage, mesh and every option the strategy was given (not at its
    default).

    Args:
        stage: the ZeRO stage (0-3).
        unit_classes: stage 3: the module classes (or class names) that become units of
            ``shard_model`` (e.g. the transformer block class); default: ``shard_model``'s
            choice. Ignored at stages 0-2, as by ``parallelize``.
        prefetch: stage 3: how many units ``shard_model`` gathers ahead.
        accelerator: as for ``DDPStrategy``.
        parallel_devices: as for ``DDPStrategy``.
        cluster_environment: as for ``DDPStrategy``.
        checkpoint_io: as for ``DDPStrategy``.
        precision_plugin: as for ``DDPStrategy`` (see Precision below).
        process_group_backend: as for ``DDPStrategy`` (a process group that already exists
            is used as it is).
        timeout: as for ``DDPStrategy``.
        start_method: as for ``DDPStrategy``.
        config: every zerokern option as one ``ZeroConfig``; an option given both here and
            as a keyword is refused.
        mesh: a 1-D or 2-D ``DeviceMesh`` (hybrid sharding: dim 0 replicate, dim 1 shard), or
            its shape ``(replicate, shard)``, built over the process group in the strategy's
            setup (the strategy is built before Lightning starts the processes).
        **options: zerokern's other options by name (``ZeroConfig``'s fields).

    Precision: "32-true", "bf16-true", "16-true" (16-bit parameters with ZeroAdamW's fp32
    master; for fp16 give ``loss_scale="dynamic"``: the strategy scales the loss)
    and "bf16-mixed". "16-mixed" (torch's GradScaler, which reads ``p.grad`` that ZeroAdamW
    has reduced into shards) is refused.

    Checkpoints are directories (every rank calls ``trainer.save_checkpoint``, as it does for
    DDP anyway). The checkpoint hooks (``on_save_checkpoint``) see the weights in
    ``checkpoint["state_dict"]`` (stage 3: gathered, on rank 0 only, as FSDPStrategy's full
    state dict), but not the optimizer's state (``["optimizer_states"]`` holds ``{}``): model
    and optimizer go into zerokern's sharded files. Use ``strategy.full_state_dict()`` (or
    ``python -m zerokern consolidate``) for plain weights.
    """

    def __init__(
        self,
        stage: int = 2,
        unit_classes: Sequence[type[nn.Module] | str] | None = None,
        prefetch: int = 1,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        *,
        config: ZeroConfig | None = None,
        mesh: Any = None,
        **options: Any,
    ) -> None:
        unknown = sorted(set(options) - set(ZeroConfig.names()))
        if unknown:
            raise TypeError(f"ZeroStrategy: unexpected keyword {unknown[0]!r}; zerokern's "
                            f"options are {', '.join(ZeroConfig.names())}")
        options.update(stage=stage, unit_classes=unit_classes, prefetch=prefetch)
        self._config = config_of(config, options, "ZeroStrategy")
        self._stage = self._config.stage
        check_mesh_arg(mesh, "ZeroStrategy")
        self._mesh_arg = mesh
        self._mesh: Any = None if isinstance(mesh, (tuple, list)) else mesh
        self._clip_installed: Precision | None = None
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        # Lightning's plain redirection: DDP's variant toggles DDP-only flags.
        self._forward_redirection = _ForwardRedirection()

    @property
    def config(self) -> ZeroConfig:
        """zerokern's options (validated): what ``zero_adamw`` builds the optimizer with."""
        return self._config

    @property
    def mesh(self) -> Any:
        """The DeviceMesh (built in the strategy's setup when its shape was given), or None."""
        return self._mesh

    def zero_adamw(self, params: Any, **kwargs: Any) -> ZeroAdamW:
        """The optimizer for ``configure_optimizers``: ``zerokern.ZeroAdamW(params,
        config=self.config, mesh=self.mesh, **kwargs)``.

        Args:
            params: parameters or param-group dicts, as for ``torch.optim.AdamW``.
            **kwargs: the hyperparameters (``lr``, ``betas``, ``eps``, ``weight_decay``);
                an option of the config given again is refused.

        Returns:
            The ZeroAdamW, with every option the strategy was given.
        """
        return ZeroAdamW(params, config=self._config, mesh=self._mesh, **kwargs)

    def zero_optimizer(self, params: Any, optimizer_class: type[torch.optim.Optimizer],
                       **kwargs: Any) -> ZeroOptimizer:
        """The optimizer for ``configure_optimizers``, of any element-wise torch class:
        ``zerokern.ZeroOptimizer(params, optimizer_class, config=self.config,
        mesh=self.mesh, **kwargs)``.

        Args:
            params: parameters or param-group dicts, as for ``optimizer_class``.
            optimizer_class: the torch optimizer class, e.g. ``torch.optim.SGD``.
            **kwargs: the class's hyperparameters (``lr``, ``momentum``, ...), checked by
                its constructor; an option of the config given again is refused.

        Returns:
            The ZeroOptimizer, with every option the strategy was given.
        """
        return ZeroOptimizer(params, optimizer_class, config=self._config, mesh=self._mesh,
                             **kwargs)

    @property
    def stage(self) -> int:
        return self._stage

    # -- precision --------------------------------------------------------------------------
    @property
    def precision_plugin(self) -> Precision:
        # Not stored when unset: the Trainer reads _precision_plugin as "given by the user".
        plugin = self._precision_plugin
        return plugin if plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        if isinstance(precision_plugin, MixedPrecision) and precision_plugin.scaler is not None:
            raise ValueError(
                "ZeroStrategy: precision='16-mixed' uses torch's GradScaler, which unscales and "
                "checks p.grad; ZeroAdamW has reduced the gradients into its shards, so the "
                "scaler would see none of them. Use precision='bf16-mixed' or 'bf16-true', or "
                "'16-true' with ZeroAdamW(loss_scale='dynamic') (ZeroAdamW's own loss scaler; "
                "the strategy scales the loss)")
        self._precision_plugin = precision_plugin

    # -- setup ------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        super().setup_environment()  # the process group
        if self._mesh is None and self._mesh_arg is not None:
            self._mesh = build_mesh(self._mesh_arg, self.root_device.type, "ZeroStrategy")

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        assert self.model is not None
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.model = self._setup_model(self.model)
        if fitting:
            self.setup_optimizers(trainer)
            self._check_clipping(trainer)
        elif self._stage != 3:
            # As DDPStrategy: evaluation starts from rank 0's weights (stage 3: shard_model
            # broadcast them, and the ranks hold only their slices).
            _sync_module_states(self.model)
        self.setup_precision_plugin()
        # No _optimizers_to_device: ZeroAdamW allocates its buffers on the parameters' device,
        # and its state is a read-only view of them.

    def _setup_model(self, model: nn.Module) -> nn.Module:
        """Stages 0-2: the LightningModule itself (no DDP). Stage 3: partitioned by
        shard_model, through a _Stage3Root (made once per LightningModule). Either way
        after every check of the config against the model and the comparison across ranks
        (``prepare_model``, the first half of ``parallelize``)."""
        if self._stage != 3:
            return prepare_model(model, self._config, mesh=self._mesh, where="ZeroStrategy")
        lm = self.lightning_module
        assert lm is not None
        existing = _existing_root(lm)
        if existing is not None:  # fitted or evaluated before (this Trainer or another)
            return existing
        if any(runtime_of_param(p) is not None for p in lm.parameters()):
            raise ValueError(
                "ZeroStrategy(stage=3): the LightningModule's parameters are already "
                "partitioned by zerokern.shard_model; the strategy partitions the "
                "LightningModule itself in its setup (give ZeroStrategy(unit_classes=...)) and "
                "configure_model must not call shard_model")
        # The first half of zerokern.parallelize: configure_optimizers builds the second.
        return prepare_model(_Stage3Root(lm), self._config, mesh=self._mesh,
                             where="ZeroStrategy")

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        opts = [_raw(o) for o in self.optimizers]
        if len(opts) != 1:
            raise ValueError(f"ZeroStrategy: configure_optimizers must return one "
                             f"zerokern.ZeroAdamW, got {len(opts)} optimizers")
        (opt,) = opts
        if not isinstance(opt, ZeroOptimizer):
            raise TypeError(
                f"ZeroStrategy: configure_optimizers returned a {type(opt).__name__}; it must "
                f"return zerokern.ZeroAdamW (self.trainer.strategy.zero_adamw(self.parameters(),"
                f" lr=...) builds it with the strategy's options) or zerokern.ZeroOptimizer "
                "(self.trainer.strategy.zero_optimizer(self.parameters(), <torch class>, "
                "...)). The "
                "strategy does not wrap the model in DDP: ZeroAdamW averages the gradients "
                "over the ranks itself, another optimizer would step on each rank's own")
        if opt.stage != self._stage:
            raise ValueError(
                f"ZeroStrategy(stage={self._stage}): configure_optimizers returned a "
                f"{type(opt).__name__}(stage={opt.stage}); give both the same stage (e.g. "
                "stage=self.trainer.strategy.stage)")
        check_optimizer(opt, self._config, self._mesh, "ZeroStrategy",
                        "the ZeroAdamW of configure_optimizers (build it with "
                        "self.trainer.strategy.zero_adamw(...))")

    def _check_clipping(self, trainer: pl.Trainer) -> None:
        if trainer.gradient_clip_val and trainer.gradient_clip_algorithm == "value":
            raise ValueError(
                "ZeroStrategy: gradient_clip_algorithm='value' is not supported (ZeroAdamW "
                "holds the averaged gradients in shards); use the default 'norm'")

    def setup_precision_plugin(self) -> None:
        if self._precision_plugin is None:  # Strategy's getter would make a new one per call
            self._precision_plugin = Precision()
        super().setup_precision_plugin()
        self._install_clipping(self.precision_plugin)

    def _install_clipping(self, plugin: Precision) -> None:
        """Route the plugin's clip-by-norm to ZeroAdamW.clip_grad_norm_ (the global norm).

        Lightning picks the plugin's class from the precision flag (Precision, MixedPrecision,
        HalfPrecision, ...) and checks it with isinstance, so the plugin is kept and only the
        two clipping methods of this instance are replaced. Its own clip_grad_by_norm calls
        torch.nn.utils.clip_grad_norm_ on the optimizer's parameters, which zerokern also
        routes; this does not depend on that (nor on which parameters main_params yields)."""
        if self._clip_installed is plugin:
            return
        by_norm, by_value = plugin.clip_grad_by_norm, plugin.clip_grad_by_value

        def clip_grad_by_norm(optimizer: Any, clip_val: int | float) -> None:
            opt = _raw(optimizer)
            if isinstance(opt, ZeroOptimizer):
                opt.clip_grad_norm_(clip_val)
            else:
                by_norm(optimizer, clip_val)

        def clip_grad_by_value(optimizer: Any, clip_val: int | float) -> None:
            if isinstance(_raw(optimizer), ZeroOptimizer):
                raise ValueError("ZeroStrategy: clipping gradients by value is not supported "
                                 "(ZeroAdamW holds the averaged gradients in shards); clip by "
                                 "norm")
            by_value(optimizer, clip_val)

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]
        plugin.clip_grad_by_value = clip_grad_by_value  # type: ignore[method-assign]
        self._clip_installed = plugin

    def _uninstall_clipping(self) -> None:
        plugin, self._clip_installed = self._clip_installed, None
        if plugin is not None:
            for name in ("clip_grad_by_norm", "clip_grad_by_value"):
                plugin.__dict__.pop(name, None)

    # -- optimizers -------------------------------------------------------------------------
    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return self._optimizers

    @optimizers.setter
    def optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._optimizers = optimizers
        self._lightning_optimizers = [
            _bind_to_optimizer(LightningOptimizer._to_lightning_optimizer(o, self))
            for o in optimizers
        ]

    def _zero_optimizers(self) -> list[ZeroOptimizer]:
        return [o for o in map(_raw, self.optimizers) if isinstance(o, ZeroOptimizer)]

    def _optimizer(self, what: str) -> ZeroOptimizer:
        opts = self._zero_optimizers()
        if not opts:
            raise RuntimeError(f"ZeroStrategy: {what} needs the ZeroAdamW of a fit (call it "
                               "during or after trainer.fit)")
        return opts[0]

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """The accumulation micro-batches before the last: no gradient communication (the
        last backward reduces the accumulated sums), as DDP.no_sync() for DDPStrategy."""
        with ExitStack() as stack:
            for opt in self._zero_optimizers():
                stack.enter_context(opt.no_sync())
            yield None

    def backward(self, closure_loss: torch.Tensor, optimizer: torch.optim.Optimizer | None,
                 *args: Any, **kwargs: Any) -> torch.Tensor:
        """Strategy.backward, with the loss scaled by ZeroAdamW's loss scaler when it has one
        (``loss_scale=``): its step() unscales by that factor. The returned loss is
        unscaled."""
        self.pre_backward(closure_loss)
        assert self.lightning_module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        opts = [_raw(optimizer)] if optimizer is not None else self._zero_optimizers()
        loss = closure_loss
        if len(opts) == 1 and isinstance(opts[0], ZeroOptimizer):
            loss = opts[0].scale_loss(closure_loss)
        self.precision_plugin.backward(loss, self.lightning_module, optimizer, *args, **kwargs)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        # Not part of the checkpoint dict: save_checkpoint writes the sharded state itself.
        return {}

    # -- checkpoints ------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the load needs the (sharded) model and the ZeroAdamW

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores it

    def _checkpoint_model(self) -> nn.Module:
        """The module whose parameter names a checkpoint uses: the LightningModule's (at
        stage 3 through its _Stage3Root, which has the same names)."""
        assert self.lightning_module is not None
        if self._stage == 3:
            root = _existing_root(self.lightning_module)
            if root is None:
                raise RuntimeError("ZeroStrategy(stage=3): the model is not set up yet")
            return root
        return self.lightning_module

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The LightningModule's weights, as Lightning puts them in the checkpoint dict that
        ``on_save_checkpoint`` and callbacks see: its ``state_dict()`` at stages 0-2; at stage
        3 (where its own parameters are released) the full parameters and buffers on the
        CPU, gathered one unit at a time, on rank 0 (the other ranks get {}), as
        FSDPStrategy's full state dict. A collective at stage 3: every rank calls it
        (``trainer.save_checkpoint`` does). save_checkpoint does not write this dict: the
        weights go into zerokern's sharded files."""
        if self._stage == 3:
            return self.full_state_dict(rank0_only=True)
        assert self.lightning_module is not None
        return self.lightning_module.state_dict()

    def full_state_dict(self, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The LightningModule's full parameters and buffers (on the CPU, keys as its
        state_dict), e.g. to export the weights. A collective at stage 3 (units are gathered
        one at a time): call it on every rank. With ``rank0_only`` the other ranks get {}."""
        return dict(full_state_dict(self._checkpoint_model(), rank0_only=rank0_only))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        """Write a zerokern checkpoint directory at ``filepath`` (every rank its own part)
        holding the model, the ZeroAdamW and, in its ``extra``, the rest of Lightning's
        checkpoint dict. Call on every rank (trainer.save_checkpoint and ModelCheckpoint
        do)."""
        if storage_options is not None:
            raise TypeError("ZeroStrategy.save_checkpoint(..., storage_options=...) is not "
                            "supported: the checkpoint is written by zerokern, not by a "
                            "CheckpointIO")
        path = os.fspath(self.broadcast(os.fspath(filepath)))  # one path on every rank
        opt = self._optimizer("trainer.save_checkpoint")
        state = {k: v for k, v in checkpoint.items() if k not in _SHARDED_KEYS}
        extra = {EXTRA_KEY: {
            "format": _EXTRA_FORMAT,
            "pytorch-lightning_version": pl.__version__,
            "epoch": checkpoint.get("epoch"),
            "global_step": checkpoint.get("global_step"),
            # Lightning's state holds tensors and arbitrary hyperparameters: torch.save's
            # bytes, inside meta.json, so that it is published atomically with the rest.
            "state": _encode(state),
        }}
        save_checkpoint(path, self._checkpoint_model(), opt, extra=extra)

    def load_checkpoint(self, checkpoint_path: str | os.PathLike[str],
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Restore the model and the ZeroAdamW from a checkpoint directory written by
        save_checkpoint (any world size and stage) and return Lightning's part of it.
        A single file (a checkpoint of another strategy, e.g. DDP's) loads too: its
        state_dict into the model and its torch AdamW state into the ZeroAdamW."""
        path = os.fspath(self.broadcast(os.fspath(checkpoint_path)))
        lm = self.lightning_module
        assert lm is not None
        fitting = lm.trainer.state.fn == TrainerFn.FITTING
        if os.path.isfile(path):
            return self._load_file(path, weights_only, fitting)
        model = self._checkpoint_model()
        # Outside a fit (validate/test/predict) the weights only, unless an earlier fit's
        # ZeroAdamW still trains them (test(ckpt_path="best") after fit): its fp32 master
        # would undo a load of the weights alone, so they load through it, and its state
        # becomes the checkpoint's, as the weights do.
        opt = self._optimizer("load") if fitting else _trainer_of(model)
        extra = load_checkpoint(path, model, opt)
        entry = extra.get(EXTRA_KEY) if isinstance(extra, Mapping) else None
        if not isinstance(entry, Mapping) or "state" not in entry:
            raise ValueError(
                f"ZeroStrategy: {path} is a zerokern checkpoint without Lightning's state "
                "(not written by trainer.save_checkpoint with ZeroStrategy); load it with "
                "zerokern.load_checkpoint(path, model, optimizer) instead of ckpt_path")
        if entry.get("format") != _EXTRA_FORMAT:
            raise ValueError(f"ZeroStrategy: {path} holds Lightning state of format "
                             f"{entry.get('format')!r}; this version reads {_EXTRA_FORMAT}")
        return _decode(entry["state"], weights_only)

    def _load_file(self, path: str, weights_only: bool | None, fitting: bool) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(path, weights_only)  # torch.load, every rank
        lm = self.lightning_module
        assert lm is not None
        if "state_dict" not in checkpoint:
            raise KeyError(f"ZeroStrategy: {path} has no 'state_dict'")
        # Stage 3: the root's load_state_dict hook copies each rank's slices.
        self._checkpoint_model().load_state_dict(checkpoint.pop("state_dict"),
                                                 strict=lm.strict_loading)
        states = checkpoint.pop("optimizer_states", None)
        if fitting:
            if not states:
                raise KeyError(
                    f"ZeroStrategy: {path} holds no optimizer state (saved with "
                    "weights_only?), so the fit cannot resume from it")
            if len(states) != 1:
                raise ValueError(f"ZeroStrategy: {path} holds {len(states)} optimizer states; "
                                 "ZeroStrategy trains with one ZeroAdamW")
            # torch AdamW's format, the same on every rank: each keeps its part. After the
            # model, so that 16-bit parameters take their master from the loaded weights.
            self._optimizer("load").load_state_dict(states[0])
        return checkpoint

    def remove_checkpoint(self, filepath: str | os.PathLike[str]) -> None:
        """Delete a checkpoint directory (ModelCheckpoint's top-k) on rank 0, as zerokern
        deletes one: meta.json first, so that a deletion cut short never leaves a directory
        that looks complete, and under the path's lock, so that no load reads it meanwhile."""
        path = os.fspath(filepath)
        if not self.is_global_zero:
            return
        if os.path.isdir(path) and not os.path.islink(path):
            with publishing(path):
                remove_checkpoint_dir(path)
        else:
            super().remove_checkpoint(path)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint loaded the model already

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint loaded the optimizer already

    # -- teardown ---------------------------------------------------------------------------
    def teardown(self) -> None:
        """As FSDPStrategy: the model and the optimizer stay where they are. Strategy's
        teardown would move them to the CPU, which re-points parameters away from
        ZeroAdamW's flat buffers (and at stage 3 materialises every released parameter)."""
        lm = self.lightning_module
        if (lm is not None and lm._trainer is not None
                and lm._trainer.state.fn == TrainerFn.FITTING and self._layer_sync):
            assert self.model is not None
            self.model = self._layer_sync.revert(self.model)
        self._uninstall_clipping()
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        # Not registered by name: DDPStrategy's names ("ddp", ...) must stay DDPStrategy's.
        pass


def _trainer_of(model: nn.Module) -> ZeroOptimizer | None:
    """The zerokern optimizer that trains ``model``'s parameters (an earlier fit's), if any."""
    for p in model.parameters():
        opt = optimizer_of(p)
        if opt is not None:
            return opt
    return None


def _existing_root(lm: pl.LightningModule) -> _Stage3Root | None:
    """The _Stage3Root that partitioned ``lm`` before (found through the runtime that owns its
    parameters, which keeps the root alive), if any."""
    for p in lm.parameters():
        rt = runtime_of_param(p)
        if rt is not None:
            root = rt.root
            if isinstance(root, _Stage3Root) and root.lightning_module is lm:
                return root
            return None
    return None


# After ZeroStrategy: the converter reads this module's checkpoint entry (lazily, in its body).
from .lightning_checkpoint import to_lightning_checkpoint  # noqa: E402
