"""Optimizer state in torch.optim.AdamW's own format, out and in (as torch's
``get_optimizer_state_dict(..., StateDictOptions(full_state_dict=True, cpu_offload=True))``
gives it for FSDP): ``{"state": {i: {"step", <the update rule's buffers>}}, "param_groups":
[...]}`` with ``i`` numbering the parameters of ``param_groups`` as torch does (the rule's
``torch_keys``: for AdamW ``exp_avg`` and its second moment).

Built one parameter at a time from the sharded state (``shards()``): every rank puts its
ranges into a zeroed full-size buffer and one all-reduce sums them, so the peak extra memory
is one parameter's state plus what is returned. Also the checks of torch.optim.AdamW's
own flags, wherever a group written for it comes in.

Compressed state: the moments go out dequantized to fp32 (torch's format has nothing else),
with the format named in a top-level ``"state_format"`` entry (``moments``, ``master``,
``seed`` and ``stored_as``: each stepped parameter's moments as they were stored); torch's
AdamW ignores it on load. In, the fp32 moments are stored in this optimizer's format
(quantized per 256-element block, or rounded to bf16), so a state changes format through
a full state dict (fp32 -> int8 -> fp32); the seed of a ``master="none"`` state comes back
into a ``master="none"`` optimizer.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from ..comm import CollectiveTimeout, Comm
from . import gather_timeout as told
from .optimizer_state import StateAccess, set_seed
from .param_table import ParamTable
from .rules import TorchClassRule
from .state_format import StateFormat


def _torch_defaults(cls: type[torch.optim.Optimizer]) -> dict[str, Any]:
    """The group keys torch's optimizer ``cls`` of this torch version has (for AdamW amsgrad,
    foreach, ...), so that ``cls(...).load_state_dict`` of what we return can step."""
    probe = cls([torch.nn.Parameter(torch.zeros(1))])
    return {k: v for k, v in probe.param_groups[0].items() if k != "params"}


# torch.optim.AdamW's param-group flags that change the update, at the values that give
# AdamW's update (ZeroAdamW's only one): any other value is refused by name, never dropped.
_MATH_FLAGS = {"amsgrad": False, "maximize": False, "decoupled_weight_decay": True}
# Flags that choose how torch computes the same update (for-each or fused kernels, step
# counts on the device for CUDA graphs): nothing ZeroAdamW computes depends on them.
_IMPL_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def check_adamw_flags(flags: dict[str, Any], where: str) -> None:
    """Refuse, by name, a torch.optim.AdamW flag whose value would change the update."""
    if flags.get("amsgrad", False):
        raise ValueError(f"amsgrad=True{where}: ZeroAdamW implements AdamW without AMSGrad "
                         "(it keeps no running maximum of the second moment); use "
                         "amsgrad=False, or "
                         "torch.optim.AdamW for AMSGrad")
    if flags.get("maximize", False):
        raise ValueError(f"maximize=True{where}: ZeroAdamW minimizes; minimize the negated "
                         "objective instead (loss = -objective) with maximize=False")
    if not flags.get("decoupled_weight_decay", True) and flags.get("weight_decay", 0.0):
        raise ValueError(f"decoupled_weight_decay=False{where} (torch.optim.Adam's L2 penalty "
                         "added to the gradient): ZeroAdamW applies AdamW's decoupled weight "
                         "decay; use weight_decay=0 or decoupled_weight_decay=True")
    if flags.get("differentiable", False):
        raise ValueError(f"differentiable=True{where}: ZeroAdamW's step is not recorded by "
                         "autograd; use differentiable=False")


def strip_adamw_flags(group: dict[str, Any], where: str,
                      defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """``group`` without torch.optim.AdamW's flags, once checked (with ``defaults`` for the
    hyperparameters it leaves out): ZeroAdamW's param groups hold what it uses (and any
    other key, e.g. a scheduler's initial_lr), and full_state_dict() puts torch's defaults
    back."""
    flags = [k for k in (*_MATH_FLAGS, *_IMPL_FLAGS) if k in group]
    if not flags:
        return group
    check_adamw_flags({**(defaults or {}), **group}, where)
    return {k: v for k, v in group.items() if k not in flags}


def is_torch_format(sd: dict[str, Any]) -> bool:
    """A torch.optim.AdamW-format state dict (not one of ZeroAdamW's per-rank ones)."""
    return "zerokern" not in sd and isinstance(sd.get("state"), dict) and \
        isinstance(sd.get("param_groups"), list)


class TorchFormat:
    """ZeroAdamW's state out in torch.optim.AdamW's format (``full_state_dict``) and in
    (``load_state_dict`` of such a dict), through the sharded-state interface of ``access``."""

    def __init__(self, table: ParamTable, access: StateAccess, comm: Comm, stage: int,
                 rule_state: Any = None) -> None:
        self.table, self.access, self.comm, self.stage = table, access, comm, stage
        self.rule_state = rule_state  # a torch class's per-parameter scalars (rule_state.py)

    def save(self, param_groups: list[dict[str, Any]], *, rank0_only: bool,
             cpu_offload: bool) -> dict[str, Any]:
        """ZeroAdamW.full_state_dict()."""
        keep = not rank0_only or self.comm.rank == 0
        torch_index, groups = self._torch_numbering(param_groups)
        state: dict[int, dict[str, Any]] = {}
        fmt, rule = self.access.slot.fmt, self.access.slot.rule
        stored_as: dict[int, str] = {}
        cls_rule = rule if isinstance(rule, TorchClassRule) else None
        # Each wait is bounded (as a stage-3 gather's): a rank that calls this alone, under
        # nanoGPT's `if master_process:`, is told why instead of waiting silently for the
        # process group's timeout.
        limit = told.wait_limit(*told.resolve(None), self.comm.backend)
        with torch.no_grad():
            for sh in self.access.shards(param_groups):
                probe = None if cls_rule is None else cls_rule.probe(param_groups[sh.group])
                if sh.step == 0 and (probe is None or not probe.init):
                    continue  # torch has no state for a parameter never stepped
                stored_as[torch_index[sh.index]] = fmt.effective(sh.numel)
                full = {}
                for key in (rule.state_names if probe is None else probe.buffers):
                    buf = torch.zeros(sh.numel, dtype=torch.float32, device=sh.param.device)
                    for r in sh.ranges:  # fp32 views, or dequantized one range at a time
                        buf.narrow(0, r.start, r.numel).copy_(r.read(key))
                    if self.stage != 0:  # stage 0: every rank holds all of it already
                        self._all_reduce(buf, f"{key} of parameter {sh.index}", limit)
                    full[key] = buf.view(sh.shape)
                if sh.step == 0 and probe is not None:  # as the class made it (Adagrad)
                    full = {k: probe.init[k].reshape(-1)[:1].expand(sh.numel).clone().view(
                        sh.shape) for k in probe.buffers}
                if keep:
                    entry = self._scalars(sh.index, sh.step, probe)
                    for key, t in full.items():
                        entry[key] = t.cpu() if cpu_offload else t
                    if entry:  # torch keeps no entry where the class keeps nothing (SGD
                        state[torch_index[sh.index]] = entry  # without momentum)
        if not keep:
            return {}
        out: dict[str, Any] = {"state": state, "param_groups": groups}
        L = self.access.slot.layout
        if self.access.slot.rt is None and L is not None:
            # Stages 0-2 lay the buffers out in the first backward's gradient order, and the
            # clipping norm is summed over that layout's shards: a resume that laid them out
            # otherwise (reverse registration) would clip by a norm one rounding away, where
            # torch's AdamW resumes bit for bit. torch's load_state_dict ignores the key.
            out["grad_order"] = [torch_index[i] for i in L.ready_order]
        if not fmt.is_default:
            out["state_format"] = {"moments": fmt.moments, "master": fmt.master,
                                   "seed": self.access.slot.seed, "stored_as": stored_as}
        return out

    def _all_reduce(self, buf: torch.Tensor, label: str, limit: float | None) -> None:
        handle = self.comm.all_reduce(buf, label, count=False, async_op=True)
        if handle is None:  # world size 1
            return
        try:
            handle.wait(timeout=limit)
        except CollectiveTimeout as exc:
            raise CollectiveTimeout(
                f"full_state_dict(): rank {self.comm.rank} of {self.comm.world_size} waited "
                f"{exc.waited:.1f} s in the all-reduce of {label} and the other ranks did not "
                f"join it. At stages 1-3 each rank holds only its shard of the optimizer "
                f"state, so full_state_dict() is a collective: call it on every rank and save "
                f"its result on rank 0 (nanoGPT: build the checkpoint dict on every rank, then "
                f"torch.save it under `if master_process:`). If a rank was only busy for "
                f"longer, raise the limit: {told.ENV}=SECONDS (now {limit:g} s). The "
                f"collective is still pending, so the process group cannot be used again: end "
                f"the process.", exc.waited) from exc

    def _scalars(self, index: int, step: int, probe: Any) -> dict[str, Any]:
        """A parameter's torch entry besides its buffers: the step count (where the class
        keeps one) and its per-parameter scalars."""
        if probe is None:
            return {"step": torch.tensor(float(step))}
        out: dict[str, Any] = {}
        if probe.has_step:
            out["step"] = torch.tensor(float(step), dtype=probe_dtype(probe))
        saved = self.rule_state.scalars[index] if step else {}
        for k in probe.scalars:
            v = saved.get(k, probe.init.get(k))
            out[k] = v.detach().clone() if torch.is_tensor(v) else v
        return out

    def _torch_numbering(self, param_groups: list[dict[str, Any]],
                         ) -> tuple[dict[int, int], list[dict[str, Any]]]:
        """Managed index -> torch's index (every parameter of every group, in order), and the
        groups in torch's format with AdamW's default keys filled in."""
        rule = self.access.slot.rule
        defaults = (dict(rule.defaults) if isinstance(rule, TorchClassRule)
                    else _torch_defaults(rule.torch_class))
        torch_index: dict[int, int] = {}
        groups = []
        k = 0
        for g in param_groups:
            ids = []
            for p in g["params"]:
                i = self.table.index.get(id(p))
                if i is not None:
                    torch_index[i] = k
                ids.append(k)
                k += 1
            out = {**defaults, **{key: v for key, v in g.items() if key != "params"}}
            if "betas" in out:
                out["betas"] = tuple(out["betas"])
            out["params"] = ids
            groups.append(out)
        return torch_index, groups

    def load(self, sd: dict[str, Any], param_groups: list[dict[str, Any]]) -> None:
        """Each rank keeps its part of a full state dict of the torch class (every rank passes
        the same dict; from any world size, or a single-process run). The fp32 master of
        16-bit parameters is taken from the current parameters."""
        torch_index, _ = self._torch_numbering(param_groups)
        groups = sd["param_groups"]
        if len(groups) != len(param_groups):
            raise ValueError(f"state_dict has {len(groups)} param groups, this optimizer has "
                             f"{len(param_groups)}")
        for gi, (g, sg) in enumerate(zip(param_groups, groups)):
            if len(sg.get("params", [])) != len(g["params"]):
                raise ValueError(f"state_dict: param group {gi} has {len(sg['params'])} "
                                 f"parameters there and {len(g['params'])} here")
        state = sd["state"]
        rule = self.access.slot.rule
        cls_rule = rule if isinstance(rule, TorchClassRule) else None
        # The hyperparameters each group steps with after the load: the saved ones.
        hps = [{k: sg.get(k, g[k]) for k in rule.defaults if k in sg or k in g}
               for g, sg in zip(param_groups, groups)]
        for gi, (sg, hp) in enumerate(zip(groups, hps)):
            rule.check_hparams(hp, f" (state_dict param group {gi})", self.access.slot.fmt)
            if cls_rule is None:
                check_adamw_flags({**sg, **hp}, f" (state_dict param group {gi})")
        group_of = [gi for gi, n in enumerate(self.table.group_counts()) for _ in range(n)]
        probes = [None if cls_rule is None else cls_rule.probe(hp) for hp in hps]
        for i, shape in enumerate(self.table.shapes):
            st = state.get(torch_index[i], state.get(str(torch_index[i])))
            if not st:
                continue
            pr = probes[group_of[i]]
            keys = rule.torch_keys if pr is None else (
                ("step",) if pr.has_step else ()) + pr.buffers + pr.scalars
            missing = [k for k in keys if k not in st]
            if missing:
                raise ValueError(f"state_dict: parameter {torch_index[i]} has no {missing[0]}")
            for key in (rule.state_names if pr is None else pr.buffers):
                if tuple(st[key].shape) != tuple(shape):
                    raise ValueError(
                        f"state_dict: {key} of parameter {torch_index[i]} has shape "
                        f"{tuple(st[key].shape)}, the parameter {tuple(shape)}: it comes from "
                        "another model")
            if "step" in keys:
                try:
                    step = float(st["step"])
                except (TypeError, ValueError, RuntimeError):
                    raise ValueError(f"state_dict: step of parameter {torch_index[i]} must be "
                                     f"a number or a one-element tensor, got "
                                     f"{st['step']!r:.60}") from None
                if not math.isfinite(step) or step < 0 or step != int(step):
                    raise ValueError(f"state_dict: step of parameter {torch_index[i]} is "
                                     f"{step}")
            for key in (rule.state_names if pr is None else pr.buffers):
                rule.check_state(key, st[key], f"state_dict: {key} of parameter "
                                               f"{torch_index[i]}")
        saved_fmt = sd.get("state_format")
        seed = saved_fmt.get("seed") if isinstance(saved_fmt, dict) else None
        if self.access.slot.fmt.in_place and StateFormat.saved_in_place(saved_fmt):
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
                raise ValueError(f"state_dict: state_format's seed must be an int in "
                                 f"[0, 2**63), got {seed!r}")
        else:
            seed = None  # the seed of a master="none" state is this optimizer's concern only
        order = self._saved_order(sd, torch_index)
        with torch.no_grad(), self.access.edit(param_groups, ready_order=order) as shards:
            # torch's format has no fp32 master: the 16-bit parameters' master is taken from
            # the current parameters (load the model first), as a fresh optimizer's is.
            self.access.slot.engine.init_master()
            for sh in shards:
                st = state.get(torch_index[sh.index], state.get(str(torch_index[sh.index])))
                pr = probes[sh.group]
                buffers = rule.state_names if pr is None else pr.buffers
                sh.step = _step_of(st, pr)
                if pr is not None:
                    self.rule_state.scalars[sh.index] = {
                        k: st[k].detach().clone() if torch.is_tensor(st[k]) else st[k]
                        for k in pr.scalars} if st else {}
                for r in sh.ranges:
                    if not st or len(buffers) < len(rule.state_names):
                        r.zero_moments()  # as a fresh state stores them
                    if not st:
                        continue
                    for key in buffers:
                        # Stored in this optimizer's format: quantized, rounded or copied.
                        r.write(key, st[key].reshape(-1)[r.start:r.start + r.numel])
        if seed is not None:
            set_seed(self.access.slot, seed)
        for gi, (g, sg) in enumerate(zip(param_groups, groups)):
            # As torch's load_state_dict: the saved group replaces this one, params aside (and
            # param_names, and the rule's hyperparameters, when it lacks them); so initial_lr
            # and the other schedulers' keys come along and StepLR(..., last_epoch=k) resumes.
            new = {k: v for k, v in sg.items() if k != "params"}
            if cls_rule is None:
                new = strip_adamw_flags(new, f" (state_dict param group {gi})")
            for key in list(g):
                if key not in new and key not in ("params", "param_names", *rule.defaults):
                    del g[key]
            g.update(new)
            if "betas" in g:
                g["betas"] = tuple(g["betas"])

    def _saved_order(self, sd: dict[str, Any], torch_index: dict[int, int]) -> list[int] | None:
        """The layout order full_state_dict saved (``grad_order``), as this optimizer's
        indices, for a load that fixes the layout (stages 0-2, before the first step); None
        where there is none to follow (a torch AdamW state dict, another set of trained
        parameters: the layout is then planned as for a fresh optimizer)."""
        saved = sd.get("grad_order")
        slot = self.access.slot
        if saved is None or slot.rt is not None or slot.layout is not None:
            return None
        if isinstance(saved, torch.Tensor) and saved.dim() == 1 and not saved.is_floating_point():
            saved = saved.tolist()  # a pipeline that turned the list into a tensor
        try:  # numpy integers too (operator.index), never bools
            if not isinstance(saved, (list, tuple)) or any(isinstance(k, bool) for k in saved):
                raise TypeError
            saved = [operator.index(k) for k in saved]
        except TypeError:
            raise ValueError(f"state_dict: grad_order must be a list of parameter indices "
                             f"(as full_state_dict writes it), got {saved!r:.60}") from None
        table_of = {k: i for i, k in torch_index.items()}
        if sorted(saved) != sorted(table_of):
            return None
        return [table_of[k] for k in saved]


def _step_of(st: dict[str, Any] | None, probe: Any) -> int:
    """A parameter's step count from its torch entry: its ``step``, or for a class that
    keeps none (SGD) 1 once it has state (its next step is not its first)."""
    if not st:
        return 0
    if probe is None or probe.has_step:
        return int(float(st["step"]))
    return 1 if any(torch.is_tensor(st.get(k)) for k in probe.buffers) else 0


def probe_dtype(probe: Any) -> torch.dtype:
    """The dtype of the class's step tensors."""
    t = probe.init.get("step")
    if torch.is_tensor(t):
        return t.dtype
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
