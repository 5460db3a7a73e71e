"""The part of a step's gradients that autograd did not produce: what the script did to
``p.grad`` between a backward and ``step()``, and the zero gradients torch would keep.

torch's AdamW steps with whatever ``p.grad`` holds. Under DDP that is the averaged gradient
unless the script replaced it after backward: ``p.grad = t`` (the same on every rank) is
stepped with as it is; ``p.grad = None`` skips the parameter (no update, no weight decay, no
state change, its step count stays). ZeroAdamW has reduced the gradients into flat buffers
by then, so it sees an edit when the parameter's GradGuard comes off (guard_set.py): at the
step's reduction (``clip_grad_norm_``, a norm read through ``p.grad``, ``step()``) or when a
further backward starts. The parameter's gradient so far is then dropped from the engine's
buffers (``Engine.drop_grad``); a set tensor is copied (torch's utilities may still scale the
script's tensor in place) and added to this rank's part of the averaged gradient once the
reduction is done, so a further backward adds to it as autograd adds to ``p.grad``.

Every rank must make the same edits (each DDP rank would otherwise step with its own
gradient): how many ranks set each parameter's gradient and how many dropped it travel in the
step's one norm-and-flags all-reduce, and a disagreement is refused on every rank, naming the
parameter, before anything is updated. When every rank set a gradient by hand, the values
must be the same too: a 62-bit fingerprint of each set tensor's bytes (``fingerprint``) goes
into one more small all-reduce (MAX of the fingerprint and of its negation: equal exactly
when every rank holds the same bytes), made only in a step where gradients were set by hand,
which every rank knows from the sums. An edit after that reduction cannot be agreed on any
more: it is refused on the rank that made it.

Zeros kept: ``zero_grad(set_to_none=False)`` zeroes the gradients that exist and leaves the
others None, so AdamW then also updates (decays) the parameters that had a gradient, and
only those. ``had`` follows which parameters would hold a ``.grad`` under DDP (those updated
by the last step, or kept since); ``kept`` which hold a zero gradient now.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .layout import Layout
from .stages import Engine

SET, DROPPED = 1, 2  # the last edit of a parameter's gradient in this step, on this rank
_FP_CHUNK = 1 << 22  # elements hashed at a time: bounds the int64 scratch of a large tensor
_FP_MOD = (1 << 61) - 1  # a Mersenne prime: the fingerprint fits an int64 with its negation


def fingerprint(t: torch.Tensor) -> int:
    """A hash of ``t``'s dtype, shape and bytes, the same on every device: the words of
    its bytes, each times a weight that depends on its position, summed in int64 (wrapping,
    so the order of the sum does not matter), then reduced mod 2^61 - 1. Tensors that
    differ collide by a chance of the order of 2^-61 (the weights are odd, under 2^31)."""
    flat = t.detach().contiguous().reshape(-1)
    width = flat.element_size() * flat.numel()
    word = torch.int32 if width % 4 == 0 else torch.int16 if width % 2 == 0 else torch.uint8
    words = flat.view(torch.uint8).view(word) if flat.numel() else flat.new_zeros(0, dtype=word)
    acc = 0
    for at in range(0, words.numel(), _FP_CHUNK):
        w = words[at:at + _FP_CHUNK].to(torch.int64)
        pos = torch.arange(at, at + w.numel(), dtype=torch.int64, device=w.device)
        weight = ((pos * 0x9E3779B1 + 0x7F4A7C15) & 0x7FFFFFFF) | 1
        # mod 2^64, as one int64 sum of the whole tensor would wrap: chunking changes nothing
        acc = (acc + int((w * weight).sum())) & 0xFFFFFFFFFFFFFFFF
    # dtype and shape by their text (Python's hash() of a str differs between processes)
    meta = sum(ord(c) * (i + 1) for i, c in enumerate(f"{t.dtype}{tuple(t.shape)}"))
    return (acc % _FP_MOD * 1_000_003 + meta) % _FP_MOD


class GradEdits:
    """Per trained parameter (the optimizer's index): this step's edits and the kept zeros."""

    def __init__(self, n: int) -> None:
        self.kind = [0] * n
        self.values: dict[int, torch.Tensor] = {}  # set by hand: added after the reduction
        self.had = [False] * n
        self.kept = [False] * n

    def grow(self, n: int) -> None:
        """add_param_group: slots for the new parameters (no gradient of theirs was edited:
        torch keeps what autograd accumulated on them)."""
        k = n - len(self.kind)
        self.kind += [0] * k
        self.had += [False] * k
        self.kept += [False] * k

    def take(self, edits: dict[int, torch.Tensor | None], params: Sequence[torch.nn.Parameter],
             engine: Engine | None, label: Any) -> None:
        """Edits found when the guards came off: each parameter's gradient so far is dropped
        (from the engine's buffers; before the first step of stages 0-2 it is only on
        ``p.grad``), a set one is kept to be added once the reduction is done."""
        for i, t in edits.items():
            if t is not None and t.layout != torch.strided:
                raise TypeError(f"ZeroAdamW: {label(i)} was given a {t.layout} gradient; "
                                "sparse gradients are not supported")
        for i, t in edits.items():
            value = None if t is None else t.detach().clone()
            if engine is not None:
                engine.drop_grad(i)
            params[i].grad = None
            self.kind[i] = DROPPED if t is None else SET
            self.kept[i] = False
            self.had[i] = t is not None
            if value is None:
                self.values.pop(i, None)
            else:
                self.values[i] = value

    def add_values(self, engine: Engine, layout: Layout) -> None:
        """After the engine's reduction: each gradient set by hand added to this rank's part
        of its parameter's averaged gradient (zero unless a further backward added to it)."""
        if not self.values:
            return
        for pc in layout.pieces:
            t = self.values.get(pc.param)
            if t is None or not pc.numel:
                continue
            src = t.reshape(-1).narrow(0, pc.param_offset, pc.numel)
            at = 0
            for dst in engine.grad_slices(pc.local_start, pc.numel):
                dst.add_(src.narrow(0, at, dst.numel()).to(dst.device))
                at += dst.numel()

    def flags(self, got: Sequence[bool]) -> list[bool]:
        """Which parameters have a gradient on this rank: from autograd (``got``), a zero
        kept, or set by hand."""
        return [bool(g) or self.kept[i] or self.kind[i] == SET for i, g in enumerate(got)]

    def counts(self) -> list[float]:
        """For the step's all-reduce: per parameter, 1 if this rank set its gradient, then
        per parameter 1 if this rank dropped it."""
        return ([1.0 if k == SET else 0.0 for k in self.kind]
                + [1.0 if k == DROPPED else 0.0 for k in self.kind])

    def set_indices(self, sums: Sequence[float]) -> list[int]:
        """The parameters every rank set by hand (after check_agreed: the same on every
        rank, from the summed counts)."""
        return [i for i in range(len(self.kind)) if sums[i] > 0.5]

    def fingerprints(self, indices: Sequence[int]) -> list[int]:
        """This rank's fingerprint of each set gradient in ``indices``."""
        return [fingerprint(self.values[i]) for i in indices]

    def check_values(self, indices: Sequence[int], highest: Sequence[int],
                     lowest: Sequence[int], label: Any) -> None:
        """``highest`` / ``lowest``: the largest and smallest fingerprint of each set
        gradient over every rank. Refused, on every rank alike, when they differ."""
        bad = [i for i, hi, lo in zip(indices, highest, lowest) if hi != lo]
        if not bad:
            return
        what = ", ".join(label(i) for i in bad[:4])
        more = f" (and {len(bad) - 4} more)" if len(bad) > 4 else ""
        raise RuntimeError(
            f"ZeroAdamW: the ranks set p.grad by hand to different values after backward "
            f"({what}{more}). Under DDP each rank would step with its own gradient and the "
            "replicas would drift apart. Set the same tensor on every rank (for instance "
            "average it with torch.distributed.all_reduce first), or none; call "
            "opt.zero_grad() to drop this step's gradients")

    def check_agreed(self, sums: Sequence[float], ranks: int, label: Any) -> None:
        """``sums``: counts() summed over every rank. Refused, on every rank alike (they all
        hold the same sums), when some ranks edited a gradient and others did not."""
        n = len(self.kind)
        bad = [i for i in range(n)
               if any(0.5 < s < ranks - 0.5 for s in (sums[i], sums[n + i]))]
        if not bad:
            return
        what = "; ".join(f"{label(i)}: set by hand on {round(sums[i])}, set to None on "
                         f"{round(sums[n + i])} of {ranks} ranks" for i in bad[:4])
        more = f" (and {len(bad) - 4} more)" if len(bad) > 4 else ""
        raise RuntimeError(
            f"ZeroAdamW: the ranks edited p.grad differently after backward ({what}{more}). "
            "Under DDP each rank would step with its own gradient and the replicas would "
            "drift apart. Make the same edit on every rank (p.grad = t with the same t, or "
            "p.grad = None), or none; call opt.zero_grad() to drop this step's gradients")

    def end_step(self, active: Sequence[bool]) -> None:
        """After step(): torch holds a .grad on every parameter that had one in the step."""
        self.had = list(active)
        self.kind = [0] * len(self.kind)
        self.values = {}

    def zero_grad(self, set_to_none: bool, found: dict[int, torch.Tensor | None],
                  params: Sequence[torch.nn.Parameter], active: Sequence[bool] | None,
                  engine: Engine | None) -> list[bool]:
        """opt.zero_grad(): which parameters keep a zero gradient, as torch's
        zero_grad(set_to_none=False) keeps one where ``p.grad`` is not None: those that had
        one at the last step, or have one of this step (``active``: the step's reduction,
        when done; else this rank's, or what the guards ``found`` on ``p.grad``)."""
        n = len(self.kind)
        if set_to_none:
            self.kept = [False] * n
        else:
            now = [found[i] is not None if i in found
                   else active[i] if active is not None
                   else (params[i].grad is not None
                         or (engine is not None and engine.has_grad(i)))
                   for i in range(n)]
            self.kept = [self.had[i] or now[i] or self.kind[i] == SET for i in range(n)]
        self.had = list(self.kept)
        self.kind = [0] * n
        self.values = {}
        return self.kept

    def stale_settled(self, cleared: Sequence[int], zeroed: Sequence[int]) -> None:
        """Stages 2-3, the last step's gradients at the next backward: ``cleared`` were set
        to None by the script (model.zero_grad()), ``zeroed`` zeroed in place
        (model.zero_grad(set_to_none=False): a zero gradient kept, as torch keeps it)."""
        for i in cleared:
            self.had[i] = self.kept[i] = False
        for i in zeroed:
            self.had[i] = self.kept[i] = True


def param_label(index: int, p: torch.nn.Parameter, shape: Any,
                param_groups: Sequence[dict[str, Any]], runtime: Any) -> str:
    """How an error names a trained parameter: its name when known (named param groups,
    a shard_model'ed model), its index among ZeroAdamW's trained parameters and shape."""
    names: dict[int, str] = dict(runtime.param_names) if runtime is not None else {}
    for g in param_groups:
        names.update(zip(map(id, g["params"]), g.get("param_names") or []))
    name = names.get(id(p))
    where = f"parameter {index}, shape {tuple(shape)}"
    return f"{name} ({where})" if name else where


def late_edit_error(label: str, dropped: bool) -> RuntimeError:
    """An edit of ``p.grad`` seen after the step's reduction: the ranks cannot agree on it."""
    how = "set to None" if dropped else "set by hand"
    return RuntimeError(
        f"ZeroAdamW: p.grad of {label} was {how} after this step's gradients were reduced "
        "(by clip_grad_norm_ or a norm read through p.grad): torch's AdamW steps with what "
        "p.grad holds, but the ranks can no longer agree on this edit. Set or drop gradients "
        "right after backward, before clipping; call opt.zero_grad() to drop this step's "
        "gradients")
