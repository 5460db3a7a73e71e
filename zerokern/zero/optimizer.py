"""ZeroAdamW: ZeRO stages 0-3 as a drop-in replacement for DDP + torch.optim.AdamW.

``ZeroAdamW(params, lr=, betas=, ...)`` is ``ZeroOptimizer(params, torch.optim.AdamW, ...)``
with torch.optim.AdamW's own signature, so that a script's ``AdamW(...)`` call works
unchanged: the same parts (core.py, training.py, state_api.py) and AdamW's fused rule
(rules/adamw.py). A subclass may set the class attribute ``rule`` to step the same machinery
with another ``UpdateRule`` (tests/test_update_rule.py does). The API reference is generated
from the docstrings here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from ..quant.adamw import DEFAULT_INT8_FORMAT
from .any_optimizer import ZeroOptimizer, _options, adamw_defaults
from .config import ZeroConfig
from .rules import ADAMW, UpdateRule


class ZeroAdamW(ZeroOptimizer):
    """AdamW with ZeRO partitioning across the ranks of ``process_group``.

    stage 0: DDP equivalent (bucketed all-reduce, fused step over everything);
    stage 1: optimizer state (fp32 master for 16-bit params, both moments) sharded 1/N;
    stage 2: gradients sharded as well, through constant-size buckets.
    Stage 3 is ``shard_model`` + ``stage=3``. Without an initialised process group it runs
    as world size 1. Gradients are averaged over the group by the optimizer itself: do not
    wrap the model in DDP.

    ``offload="cpu"`` (stages 1-3, ZeRO-Offload): this rank's fp32 master, moments and
    gradient shard live in host memory (pinned on CUDA) and the fused step runs on the CPU;
    gradients are copied to the host bucket by bucket during backward and the new
    parameters copied back bucket by bucket during the step. Results are bitwise those of
    the same run without offload on CPU devices.

    Args:
        params: the parameters to train, or param-group dicts, as for ``torch.optim.AdamW``.
            Only parameters that require grad at construction are trained. At stages 0-2
            they may have several dtypes (a bf16 embedding beside fp32 matrices): each
            (dtype, master) partition gets its own flat layout, and a group may carry its own
            ``"master"`` (docs/porting.md, "Parameters of several dtypes").
        lr: learning rate (per group, and schedulers may change it).
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator after the square root, as torch's AdamW adds it.
            Must be > 0 with ``moments="int8"`` (in every param group too, also when
            edited later): a second moment can decode to 0 there.
        weight_decay: decoupled weight decay, applied before the moments are updated.
        amsgrad: as torch's; only False (AdamW without AMSGrad) is implemented, True is
            refused.
        maximize: as torch's; only False, True is refused (minimize the negated loss).
        foreach: accepted and ignored: it chooses torch's kernels; ZeroAdamW's own run
            once over each flat shard.
        capturable: accepted and ignored, as ``foreach``.
        differentiable: only False (the step is not recorded by autograd).
        fused: accepted and ignored, as ``foreach``.
        stage: the ZeRO stage, an int 0-3 (3 needs a model partitioned by
            ``shard_model``).
        process_group: the group whose ranks share the work; default the world.
        bucket_numel: gradient bucket size in elements (stages 0-2); default 2**21.
        max_grad_norm: clip every step to this global 2-norm (None: no clipping).
        loss_scale: ``"dynamic"`` or a float, for fp16 parameters: scale the loss with
            ``scale_loss`` and overflowing steps are skipped on every rank.
        overlap_comm: run the gradient collectives asynchronously, overlapping backward.
        backend: the kernels' backend: ``"cuda"``, ``"triton"``, ``"cpu"``, ``"torch"``, or
            None for the fastest available (``$ZEROKERN_BACKEND`` also sets it). With
            ``offload`` the step runs on host tensors: ``"cuda"`` and ``"triton"`` are
            refused there (ValueError), ``"cpu"``, ``"torch"`` and None run.
        offload: ``"cpu"`` for ZeRO-Offload (stages 1-3), None to keep the state on the
            parameters' device.
        moments: how ``exp_avg`` and ``exp_avg_sq`` are stored: ``"fp32"`` (default, exact
            AdamW), ``"bf16"``, or ``"int8"`` (8-bit block-wise codes: blocks of 256
            elements of one parameter, each with an fp32 absmax, a dynamic-exponent map,
            signed for ``exp_avg`` and unsigned for ``exp_avg_sq``). A parameter with fewer
            than 4,096 elements keeps fp32 moments, decided on the whole parameter, so the
            format never depends on the world size or the stage.
        master: ``"fp32"`` (default: an fp32 master copy of 16-bit parameters) or
            ``"none"`` (bf16 parameters only: no master; the update is written into the
            bf16 parameters with stochastic rounding keyed by (``seed``, step, the element's
            index in its parameter), the same bits on every backend, world size and stage).
        seed: the stochastic rounding key of ``master="none"``, in [0, 2**63); saved with
            the state.
        int8_format: the format version of the int8 moments a new state is created with:
            2 (the dynamic maps above) or 3 (computed maps, ``zerokern.quant.fmt_v3``;
            faster to encode and decode on CPUs). Default
            ``zerokern.quant.adamw.DEFAULT_INT8_FORMAT``. Version 3 is refused (ValueError
            naming ``int8_format``) where the step's backend cannot run it
            (``zerokern.ops.adamw_compressed.V3_BACKENDS``). A loaded state is converted to
            this version (docs/compressed-state.md); the other formats ignore it.
        mesh: instead of ``process_group``, a ``torch.distributed.device_mesh.DeviceMesh``.
            2-D: hybrid sharding (FSDP2's HSDP convention, dim 0 replicate, dim 1 shard,
            whatever the dims are named): the state (stage 2: and the gradients) is split
            over the S ranks of this rank's shard group; gradients are reduce-scattered
            within it, all-reduced across the R ranks of the replicate group and averaged
            over S * R; the new parameters are all-gathered within the shard group only
            (stage 0: the same three collectives per bucket). ``comm`` is then the shard
            group's (``comm.replicate`` the replicate group's). A 1-D mesh is its group. At
            stage 3 the model's mesh (``shard_model(mesh=)``) is used; one given here must
            be the same. A wrong mesh raises ValueError naming ``mesh`` on every rank
            before anything changes (docs/hybrid.md).
        reduce_dtype: None (reduce gradients in the parameters' dtype) or ``torch.float32``:
            16-bit parameters' gradients are reduced in fp32 (buckets, units' buffers and
            the gradient shard in fp32) and reach the fused step in fp32, as FSDP2's
            ``MixedPrecisionPolicy(reduce_dtype=)``; ``memory_stats()`` / ``comm_stats()``
            count the extra bytes. Not with ``offload``. ``"int8"`` / ``"int4"`` (stages
            1-3, ZeRO++'s qgZ): the gradients stay in the parameters' dtype and travel as
            block-wise int8 / int4 codes with an fp32 scale per 256 elements, each hop
            summed in fp32 (on a 2-D mesh, within the shard group and then across the
            replicate group); refused at stage 0 and with ``offload``
            (docs/reference/quantized-comm.md).
        gather_dtype: None, or ``"int8"`` (stages 1-3, ZeRO++'s qwZ): the parameters are
            all-gathered as block-wise int8 codes, every rank (the sender too) using the
            decoded values, so ranks agree bit for bit; the fp32 master, or stage 3's
            shards, are never quantized. Refused at stage 0, with ``offload``, with
            ``master="none"`` at stages 1-2 and with fp32 parameters at stages 1-2 (there
            the gathered buffer is the only copy of the weights).
        error_feedback: with ``reduce_dtype="int8"`` / ``"int4"``: error feedback (the
            LoCo idea, arXiv 2407.04480): each rank keeps the fp32 residual of every
            gradient slice it sends quantized and adds it to the next send of that slice, so
            the quantization errors do not add up over the steps
            (docs/reference/quantized-comm.md). Refused without a quantized reduce.
        config: a ``zerokern.ZeroConfig`` holding ZeroAdamW's own options (``stage``
            through ``error_feedback`` above, except ``process_group`` and ``mesh``), instead
            of those keywords; giving one of them as well, at another value than its
            default, is refused.

    Every rank must give the same ``stage``, ``bucket_numel``, ``offload``, ``moments``,
    ``master``, ``seed``, ``int8_format``, ``reduce_dtype``, ``gather_dtype``,
    ``error_feedback``, ``loss_scale``, ``max_grad_norm``, mesh, per-group ``lr``,
    ``betas``, ``eps`` and ``weight_decay``, and the same parameters (shapes and dtypes):
    the constructor compares them across ranks in one gather, before any other collective,
    and raises ValueError on every rank naming each
    one that differs and every rank's value. An argument refused on one rank is raised on
    every rank. ``overlap_comm`` and ``backend`` may differ (the collectives are the same,
    and the kernels agree bit for bit).

    Attributes:
        config: the options as a ``ZeroConfig`` (validated and agreed across ranks).
        stage: the ZeRO stage.
        offload: ``"cpu"`` or None.
        max_grad_norm: the clipping norm of every step, or None.
        last_grad_norm: the global gradient norm of the last step (None before one).
        last_step_skipped: whether the last ``step()`` was skipped by the loss scaler.
        state: ``opt.state[p]``: this rank's part of ``step``, ``exp_avg`` and
            ``exp_avg_sq`` of each trained parameter, with the element ``ranges`` it covers
            (a ``ShardedStateView``).
        comm: the process group's wrapper; ``comm.rank`` and ``comm.world_size``.
        layout: the flat layout of the parameters, fixed at the first ``step()`` (stages
            0-2) or at construction (stage 3); None until then.
    """

    rule: ClassVar[UpdateRule] = ADAMW  # the update the state is stepped with (zero/rules/)

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
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
    ) -> None:
        hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                     maximize=maximize, foreach=foreach, capturable=capturable,
                     differentiable=differentiable, fused=fused)
        rule = type(self).rule
        self._construct(params, lambda cfg: (rule, adamw_defaults(cfg, **hyper)),
                        _options(locals()), config, mesh=mesh, process_group=process_group,
                        optimizer="torch.optim.AdamW")
