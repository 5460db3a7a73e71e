"""ZeroConfig: zerokern's options (beyond torch's AdamW hyperparameters, the mesh and the
process group) in one object, which ZeroAdamW, ``parallelize`` and the trainer integrations
all take, so that one object configures every integration alike.

``ZeroAdamW(..., stage=, moments=, ...)`` builds one from its keywords (or takes
``config=``); ``parallelize`` and the integrations build one too, so that they can check
every option before they partition the model. The stage-3 model options (``MODEL``:
``unit_classes``, ``prefetch``, ...) are ``shard_model``'s, applied by ``parallelize`` and
the integrations; ZeroAdamW, which gets an already partitioned model, checks them and
otherwise ignores them. Two steps, in this order, before anything is modified:

- ``validate()``: pure, every argument check, an error naming the argument;
- ``agree(comm)``: the one gathered comparison across ranks (zero/agreement.py). The options
  in ``AGREED`` must be the same on every rank: a stage, bucket size, offload or moments
  format that differs gives different layouts and collectives (a hang, or gloo aborting the
  process); a seed, master format, int8 format version, loss scaling or clipping norm that
  differs trains the replicas (stage 0, or the replicas of a 2-D mesh) apart, or stores the
  shards in mixed formats, without a word. ``overlap_comm`` and ``backend`` are this rank's
  own choices: the collectives are the same either way and the kernels agree bit for bit
  (docs/numerics.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, ClassVar

import torch

from ..comm.quantized_parts import WireFormat
from ..ops._backend import BACKENDS
from ..quant.adamw import DEFAULT_INT8_FORMAT
from . import gather_timeout as told
from .scaler import LossScaler
from .state_format import StateFormat
from .validate import (
    check_offload_backend,
    check_offload_params,
    check_quantized_comm,
    check_reduce_dtype,
    check_seed,
    check_zero_args,
)


@dataclass(frozen=True)
class ZeroConfig:
    """zerokern's options, as the keywords of the same names (see ``ZeroAdamW`` and
    ``parallelize``).

    Building one checks nothing (``unit_classes`` given as a list is kept as a tuple);
    ``validate()`` does (ZeroAdamW, ``parallelize`` and the integrations call it before
    anything changes).

    Attributes:
        stage: the ZeRO stage, 0-3.
        bucket_numel: gradient bucket size in elements (stages 0-2); None for 2**21.
        max_grad_norm: clip every step to this global 2-norm (None: no clipping).
        loss_scale: ``"dynamic"``, a positive float, or None (fp16 loss scaling).
        overlap_comm: run the gradient collectives asynchronously, overlapping backward.
        backend: the kernels' backend (``"cuda"``, ``"triton"``, ``"cpu"``, ``"torch"``)
            or None for the fastest available.
        offload: ``"cpu"`` (ZeRO-Offload, stages 1-3) or None.
        moments: ``"fp32"``, ``"bf16"`` or ``"int8"``.
        master: ``"fp32"`` or ``"none"`` (bf16 parameters only).
        seed: the stochastic rounding key of ``master="none"``, in [0, 2**63).
        int8_format: the format version of new int8 moments, 2 or 3 (default
            ``zerokern.quant.adamw.DEFAULT_INT8_FORMAT``); the other formats ignore it.
        reduce_dtype: None, ``torch.float32``, or ``"int8"`` / ``"int4"``: the gradient
            reduce-scatter quantized on the wire (stages 1-3; docs/reference/quantized-comm.md).
        gather_dtype: None or ``"int8"``: the parameter all-gather quantized on the wire
            (stages 1-3).
        error_feedback: with a quantized ``reduce_dtype``: each rank keeps the residual of
            what it sent (fp32) and adds it to the next send of the same slice.
        unit_classes: stage 3: the module classes (or class names) that become units;
            None: the model's ``_no_split_modules``, else ``shard_model``'s choice.
        prefetch: stage 3: how many units are gathered ahead.
        reshard_after_forward: stage 3: release each unit after its forward.
        offload_params: stage 3 only, with ``offload="cpu"``: the parameter shards in host
            memory too.
        gather_timeout: stage 3: the longest wait, in seconds, in one unit's collective
            (None: ``$ZEROKERN_GATHER_TIMEOUT``, else the default).
        hpz: stage 3 on a 2-D mesh: ZeRO++'s hpZ, the model sharded over every rank of the
            mesh with a secondary in-node copy of the parameters for the backward's gathers
            (``shard_model(hpz=True)``; docs/reference/quantized-comm.md).
    """

    stage: int = 2
    bucket_numel: int | None = None
    max_grad_norm: float | None = None
    loss_scale: float | str | None = None
    overlap_comm: bool = True
    backend: str | None = None
    offload: str | None = None
    moments: str = "fp32"
    master: str = "fp32"
    seed: int = 0
    int8_format: int = DEFAULT_INT8_FORMAT
    reduce_dtype: torch.dtype | str | None = None
    gather_dtype: str | None = None
    error_feedback: bool = False
    unit_classes: tuple[type | str, ...] | None = None
    prefetch: int = 1
    reshard_after_forward: bool = True
    offload_params: bool = False
    gather_timeout: float | None = None
    hpz: bool = False

    MODEL: ClassVar[tuple[str, ...]] = (
        "unit_classes", "prefetch", "reshard_after_forward", "offload_params", "gather_timeout",
        "hpz")
    """The stage-3 model options (``shard_model``'s); ZeroAdamW has no keywords for them."""

    AGREED: ClassVar[tuple[str, ...]] = (
        "stage", "bucket_numel", "offload", "moments", "master", "seed", "int8_format",
        "reduce_dtype", "gather_dtype", "error_feedback", "loss_scale", "max_grad_norm", "hpz")
    """The options every rank must give alike (compared by ``agree``)."""

    def __post_init__(self) -> None:
        # A list (or another iterable) of unit classes, kept as a tuple: the config stays
        # hashable and a generator is read once. A single class or name is left for
        # validate() to refuse.
        units = self.unit_classes
        if units is not None and not isinstance(units, (str, type, tuple)) \
                and isinstance(units, Iterable):
            object.__setattr__(self, "unit_classes", tuple(units))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every option name: the keywords that ``parallelize`` and the integrations
        (``ZeroTrainer``, ``ZeroStrategy``) take for a ZeroConfig's fields."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def adamw_names(cls) -> tuple[str, ...]:
        """The option names that are ZeroAdamW's keywords (all but ``MODEL``)."""
        return tuple(n for n in cls.names() if n not in cls.MODEL)

    @classmethod
    def merge(cls, config: ZeroConfig | None, given: dict[str, Any],
              where: str = "ZeroAdamW") -> ZeroConfig:
        """The config of a call that got ``config`` and the option keywords ``given``.

        Args:
            config: the call's ``config=``, or None.
            given: the call's option keywords, name -> value.
            where: the call, named in the errors.

        Returns:
            A config of the keywords alone, or ``config`` when every keyword is at its
            default.

        Raises:
            ValueError: a keyword, not at its default, that ``config`` would silently
                override.
            TypeError: a ``config`` that is no ZeroConfig.
        """
        if config is None:
            return cls(**given)
        if not isinstance(config, ZeroConfig):
            raise TypeError(f"{where}: config must be a zerokern.ZeroConfig, got "
                            f"{type(config).__name__}")
        default = cls()
        for name, value in given.items():
            if not _same(value, getattr(default, name)):
                raise ValueError(
                    f"{where}: {name}={value!r} was given together with config=; give "
                    f"the options either as keywords or in config (config has "
                    f"{name}={getattr(config, name)!r})")
        return config

    def validate(self) -> ZeroConfig:
        """Check every option (pure); returns self.

        Raises:
            ValueError: an option out of its range, named (``stage`` that is not an int
                0-3, ``True`` and ``2.0`` included; ``offload`` other than None or "cpu",
                or at stage 0; ``bucket_numel``, ``max_grad_norm``, ``loss_scale``,
                ``moments``, ``master``, ``seed``, ``int8_format`` (2 or 3),
                ``reduce_dtype``, ``backend``;
                ``gather_dtype`` other than None or ``"int8"``; a quantized
                ``reduce_dtype`` / ``gather_dtype`` at stage 0 or with ``offload``, and
                ``gather_dtype`` with ``master="none"`` at stages 1-2 (not built);
                ``error_feedback`` without a quantized ``reduce_dtype``;
                ``backend="cuda"`` or ``"triton"`` with ``offload`` (the step runs on the
                host); ``prefetch`` that is not an int >= 0, ``gather_timeout`` that is not a
                number of seconds > 0, ``offload_params`` at stages 0-2 or without
                ``offload="cpu"``, ``hpz`` at stages 0-2 or with ``offload_params``).
            TypeError: ``overlap_comm``, ``error_feedback``, ``reshard_after_forward``,
                ``offload_params`` or ``hpz`` that is not a bool; ``unit_classes`` that is
                not a sequence of classes and class names.
        """
        check_zero_args(self.stage, self.offload, self.bucket_numel, self.max_grad_norm)
        LossScaler.from_arg(self.loss_scale)  # ValueError naming loss_scale
        StateFormat(self.moments, self.master, self.int8_format)  # ValueError naming each
        check_seed(self.seed)
        check_reduce_dtype(self.reduce_dtype, self.offload)
        check_quantized_comm(self.reduce_dtype, self.gather_dtype, self.stage, self.offload,
                             self.master)
        check_error_feedback(self.error_feedback, self.reduce_dtype)
        check_offload_backend(self.backend, self.offload)
        for name in ("overlap_comm", "error_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or None, got "
                             f"{self.backend!r}")
        self._validate_model_options()
        return self

    def _validate_model_options(self) -> None:
        """The stage-3 options, as shard_model and parallelize check them (the unit class
        names are looked up in the model later, by ``compose.resolve_units``)."""
        units = self.unit_classes
        if units is not None and (not isinstance(units, tuple) or not all(
                isinstance(c, (type, str)) for c in units)):
            raise TypeError(f"unit_classes must hold module classes or class names (a tuple "
                            f"or list of them), got {units!r}")
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) \
                or self.prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {self.prefetch!r}")
        for name in ("reshard_after_forward", "offload_params", "hpz"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_offload_params_stage(self.offload_params, self.stage)
        check_hpz(self.hpz, self.stage, self.offload_params)
        # The optimizer's own rule (ZeroAdamW checks it against the partitioned model).
        check_offload_params(SimpleNamespace(offload_params=self.offload_params), self.offload)
        if self.gather_timeout is not None:
            told.resolve(self.gather_timeout)  # ValueError naming gather_timeout

    @property
    def wire(self) -> WireFormat:
        """What the communication parts quantize (``reduce_dtype`` / ``gather_dtype``)."""
        return WireFormat.of(self.reduce_dtype, self.gather_dtype, self.error_feedback)

    @property
    def state_format(self) -> StateFormat:
        """``moments``, ``master`` and ``int8_format`` as a StateFormat (validated)."""
        return StateFormat(self.moments, self.master, self.int8_format)

    def agreed(self) -> dict[str, Any]:
        """The options of ``AGREED`` as plain values every rank compares (validated)."""
        out: dict[str, Any] = {}
        for name in self.AGREED:
            v = getattr(self, name)
            if name == "reduce_dtype":
                v = None if v is None else str(v)
            elif name == "max_grad_norm":
                v = None if v is None else float(v)
            elif name == "loss_scale":
                v = v if v is None or v == "dynamic" else float(v)
            elif name in ("stage", "seed", "int8_format"):
                v = int(v)
            out[name] = v
        return out

    def agree(self, comm: Any, *, where: str = "ZeroAdamW", **facts: Any) -> None:
        """Compare these options (validated) across the ranks of ``comm`` in one gather:
        a collective, call it on every rank.

        Args:
            comm: the group to compare over (``zero.agreement.agreement_comm``).
            where: the call, named in the errors.
            **facts: what else to compare in the same gather (``zero.agreement.agree``'s
                ``failure``, ``mesh``, ``groups``, ``params``).

        Raises:
            ValueError: on every rank, naming each option that differs and every rank's
                value (or another rank's refusal).
        """
        from .agreement import agree

        agree(comm, where, options=self.agreed(), **facts)


def check_offload_params_stage(offload_params: Any, stage: int) -> None:
    """``offload_params`` is stage 3's (shard_model keeps the parameter shards)."""
    if offload_params and stage != 3:
        raise ValueError(
            f"offload_params={offload_params!r}: parameter shards in host memory are stage 3's "
            f"(shard_model partitions the parameters); pass stage=3, or leave offload_params "
            f"False (got stage={stage})")


def check_error_feedback(error_feedback: Any, reduce_dtype: Any) -> None:
    """Error feedback keeps what the quantized reduce's codes missed: there must be one."""
    if error_feedback is True and not isinstance(reduce_dtype, str):
        raise ValueError(
            f"error_feedback=True with reduce_dtype={reduce_dtype!r}: error feedback keeps the "
            f"residual of the quantized gradient reduce, and this one is not quantized; pass "
            f"reduce_dtype='int8' or 'int4' (or leave error_feedback False)")


def check_hpz(hpz: Any, stage: int, offload_params: bool = False) -> None:
    """``hpz`` is stage 3's (a secondary copy of the partitioned parameters) and not built
    with ``offload_params`` (the slices' host copy feeds the crossing gather only)."""
    if hpz and stage != 3:
        raise ValueError(
            f"hpz=True at stage={stage}: hpZ keeps an in-node copy of the parameters that "
            f"stage 3 partitions (stages 0-2 keep every parameter on every rank, so no gather "
            f"crosses the nodes to save); pass stage=3")
    if hpz and offload_params:
        raise ValueError("hpz=True with offload_params=True is not built: the parameter "
                         "slices in host memory feed each gather through a copy that the "
                         "in-node gathers would skip; drop one of them")


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b
