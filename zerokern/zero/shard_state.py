"""This rank's optimizer state, as one part every stage composes: the values (an fp32 master,
or none), the update rule's buffers, the gradient shard when the state keeps its own, where
they live, and the rule's step over any range of them.

A stage decides *which* elements are this rank's and how their gradients are reduced and
their parameters come back (stages/); this file decides how the state of those elements is
stored and stepped, through three parts given to it:

- the update rule (rules/): which buffers there are and how a range is updated;
- the stored type of each buffer (stored.py), chosen once from the state format
  (state_format.py): fp32, bf16, or int8 codes with block scales;
- the placement (placement.py): on the device, or on the host (ZeRO-Offload).

None of them touches the stages, nor each other.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

import torch

from ..quant.maps import BLOCK
from .placement import BufferSpec, OnDevice, OnHost, Placement
from .rules import ADAMW, RangeStep, UpdateRule
from .state_format import RunPlan, StateFormat, StateRun
from .stored import STORED_PARTS, Fp32Stored, Stored, blocks, stored_type

__all__ = ["BufferSpec", "OnDevice", "OnHost", "Placement", "ShardState", "StateBuffer",
           "part_kind"]


def part_kind(name: str, part: str) -> str:
    """The memory_stats() kind (and per-rank state dict key) of ``part`` of buffer ``name``:
    the buffer's own name for its data, ``<name>_<part>`` for the rest (``exp_avg_absmax``)."""
    return name if part == "data" else f"{name}_{part}"


class StateBuffer:
    """One of the rule's buffers over the local space: ``main`` in the state's format, and
    ``side`` (fp32) for the runs of parameters too small to compress (None: no such run, or
    an fp32 state)."""

    def __init__(self, name: str, main: Stored, side: Fp32Stored | None) -> None:
        self.name, self.main, self.side = name, main, side

    def at(self, r: StateRun, o: int, n: int) -> Stored:
        """Elements [o, o + n) of run ``r``, as stored."""
        if r.side_start >= 0:
            assert self.side is not None
            return self.side.narrow(r.side_start + o, n)
        return self.main.narrow(r.local_start + o, n)

    def part(self, part: str) -> torch.Tensor | None:
        """Its tensor of ``part`` (a stored part, or "side"), None where it has none."""
        if part == "side":
            return None if self.side is None else self.side.data
        return getattr(self.main, part, None)


class ShardState:
    """The optimizer state of ``numel`` local elements: ``master`` (fp32, or None when the
    parameters are updated in place), the rule's buffers (``buffers``, by name) and, when
    ``own_grads``, ``grads`` (the reduced gradient shard, in ``grad_dtype``), allocated from
    the placement in that order.

    A compressed ``fmt`` stores the buffers as bf16 or int8 (with one fp32 absmax per
    256-element block), those of parameters too small to compress in fp32 side buffers, and
    with ``master="none"`` no master on the device (on the host, ZeRO-Offload keeps a bf16
    copy of the parameters in its place). ``runs`` says which local ranges are stepped in
    which format; ``seed`` keys the stochastic rounding. Each tensor is also an attribute by
    its kind (``exp_avg``, ``exp_avg_absmax``, ``exp_avg_side``; None when absent)."""

    def __init__(self, numel: int, grad_dtype: torch.dtype, placement: Placement, *,
                 master: bool, own_grads: bool, fmt: StateFormat | None = None,
                 runs: RunPlan | None = None, seed: int = 0,
                 rule: UpdateRule | None = None) -> None:
        self.numel, self.placement = numel, placement
        self.fmt = fmt or StateFormat()
        self.rule = rule or ADAMW
        self.runs, self.seed = runs, seed
        if not self.fmt.is_default and runs is None:
            raise ValueError("a compressed state needs its run plan")
        self._sr: dict[tuple[int, int], torch.Tensor] = {}
        got = {s.kind: placement.alloc(s.kind, s.numel, s.dtype)
               for s in self.specs(numel, grad_dtype, master=master, own_grads=own_grads,
                                   fmt=self.fmt, side_numel=self.side_numel, rule=self.rule)}
        self.master: torch.Tensor | None = got.get("master")
        self.grads: torch.Tensor | None = got.get("grads")
        typ = stored_type(self.fmt.moments)
        self.buffers: dict[str, StateBuffer] = {}
        for name in self.rule.state_names:
            main = typ.make({p: got[part_kind(name, p)] for p, _, _ in typ.parts(numel)},
                            self.rule.map_id(name, self.fmt.int8_format))
            side = got.get(part_kind(name, "side"))
            self.buffers[name] = StateBuffer(name, main,
                                             None if side is None else Fp32Stored(side))

    @property
    def side_numel(self) -> int:
        return 0 if self.runs is None else self.runs.side_numel

    @staticmethod
    def specs(numel: int, grad_dtype: torch.dtype, *, master: bool, own_grads: bool,
              fmt: StateFormat | None = None, side_numel: int = 0,
              rule: UpdateRule | None = None) -> list[BufferSpec]:
        """The blocks a state of these options takes (pure): the master, each part of the
        rule's buffers (all buffers' data, then all their scales), the side buffers, the
        gradient shard."""
        fmt = fmt or StateFormat()
        names = (rule or ADAMW).state_names
        out = [BufferSpec("master", numel, fmt.master_dtype)] if master else []
        for part, n, dtype in stored_type(fmt.moments).parts(numel):
            out += [BufferSpec(part_kind(name, part), n, dtype) for name in names]
        if side_numel:
            out += [BufferSpec(part_kind(name, "side"), side_numel, torch.float32)
                    for name in names]
        if own_grads:
            out.append(BufferSpec("grads", numel, grad_dtype))
        return out

    def tensors(self) -> dict[str, torch.Tensor | None]:
        """Every stored tensor of the rule's buffers by kind (``part_kind``; each part of
        every buffer, then the next part), None where this format has no such part: what a
        per-rank state dict holds."""
        return {part_kind(name, part): b.part(part) for part in (*STORED_PARTS, "side")
                for name, b in self.buffers.items()}

    def __getattr__(self, kind: str) -> torch.Tensor | None:
        tensors = self.__dict__.get("buffers")
        if tensors is not None:
            t = self.tensors()
            if kind in t:
                return t[kind]
        raise AttributeError(kind)

    @property
    def on_host(self) -> bool:
        return self.placement.on_host

    # -- the step ------------------------------------------------------------------------------
    def step(self, chunk: int, grp: dict[str, Any], start: int, numel: int, step: int,
             grad_scale: float, *, grad: torch.Tensor, param: torch.Tensor | None,
             lp: torch.Tensor | None = None) -> None:
        """The rule's update of local range [start, start + numel) with ``grad``: the master
        is updated and the new parameters written to ``lp`` if given, else to ``param`` (the
        parameters' own elements; 16-bit ones in the kernel's pass); without a master
        ``param`` itself is updated in place. ``chunk``: the bucket or unit."""
        self.placement.acquire(chunk)
        out = lp if lp is not None else param
        if self.runs is None:  # the default state: one launch over the range
            values = param if self.master is None else self.master.narrow(0, start, numel)
            assert values is not None
            self._launch(chunk, grp, values, None if self.master is None else out, step,
                         grad_scale, grad, {k: b.main.narrow(start, numel)
                                            for k, b in self.buffers.items()}, None)
            return
        for r, o, n in self.runs_in(start, start + numel):
            at = r.local_start + o - start  # in the caller's range
            dst = None if out is None else out.narrow(0, at, n)
            if self.master is not None:
                values = self.master.narrow(0, r.local_start + o, n)
            else:
                assert dst is not None
                values, dst = dst, None  # the parameters themselves, in place
            sr = (self.sr_index(r, o, n, values.device) if values.dtype == torch.bfloat16
                  else None)
            self._launch(chunk, grp, values, dst, step, grad_scale, grad.narrow(0, at, n),
                         {k: b.at(r, o, n) for k, b in self.buffers.items()}, sr)

    def _launch(self, chunk: int, grp: dict[str, Any], values: torch.Tensor,
                dst: torch.Tensor | None, step: int, grad_scale: float, grad: torch.Tensor,
                state: dict[str, Stored], sr: torch.Tensor | None) -> None:
        args = RangeStep(values, grad, state, grp, step, grad_scale,
                         self.placement.kernel_backend, self.runs is not None, sr, self.seed)
        self.placement.step(chunk, values, dst, lambda lp: self.rule.step(args, lp))

    def runs_in(self, start: int, stop: int) -> list[tuple[StateRun, int, int]]:
        """(run, offset, numel): the parts of the runs inside local range [start, stop). A
        stage's range holds whole pieces, and pieces join a run only on chunk boundaries, so
        a part starts on a 256-element chunk of its run."""
        assert self.runs is not None
        out = []
        runs = self.runs.runs
        i = max(0, bisect_right(self.runs.starts, start) - 1)
        while i < len(runs) and runs[i].local_start < stop:
            r = runs[i]
            a, b = max(start, r.local_start), min(stop, r.stop)
            if a < b:
                assert (a - r.local_start) % BLOCK == 0, "a step range cuts a chunk"
                out.append((r, a - r.local_start, b - a))
            i += 1
        return out

    def sr_index(self, r: StateRun, o: int, n: int, device: torch.device) -> torch.Tensor:
        """Each chunk's index in its parameter, for elements [o, o + n) of run ``r``."""
        key = (r.local_start + o, n)
        t = self._sr.get(key)
        if t is None or t.device != device:
            c = o // BLOCK
            t = self._sr[key] = torch.tensor(r.sr_index[c:c + blocks(n)], dtype=torch.int64,
                                             device=device)
        return t

    # -- the stored buffers, read and written from outside the step ----------------------------
    def stored(self, start: int, numel: int) -> dict[str, Stored]:
        """The rule's buffers of local range [start, start + numel), whole pieces of ONE run
        (any range of the default state), as stored: views, written exactly."""
        if self.runs is None:
            return {k: b.main.narrow(start, numel) for k, b in self.buffers.items()}
        parts = self.runs_in(start, start + numel)
        assert len(parts) == 1 and parts[0][2] == numel, "a range of one run"
        r, o, n = parts[0]
        return {k: b.at(r, o, n) for k, b in self.buffers.items()}

    def read_moments(self, start: int, numel: int) -> tuple[torch.Tensor, ...]:
        """New fp32 tensors holding the rule's buffers (in ``state_names`` order) over local
        range [start, start + numel), a range of whole pieces (decoded; padding between runs
        reads 0)."""
        out = tuple(torch.zeros(numel, dtype=torch.float32, device=b.main.data.device)
                    for b in self.buffers.values())
        if self.runs is None:
            for t, b in zip(out, self.buffers.values()):
                t.copy_(b.main.narrow(start, numel).data)
            return out
        for r, o, n in self.runs_in(start, start + numel):
            at = r.local_start + o - start
            for t, b in zip(out, self.buffers.values()):
                t.narrow(0, at, n).copy_(b.at(r, o, n).read())
        return out

    def zero_moments(self) -> None:
        """A fresh state's buffers (every format's zero decodes to exact zeros)."""
        for t in self.tensors().values():
            if t is not None:
                t.zero_()

    # -- gradients ----------------------------------------------------------------------------
    def grad_range(self, start: int, numel: int) -> torch.Tensor:
        assert self.grads is not None
        return self.grads.narrow(0, start, numel)

    def reduce_target(self, start: int, own: torch.Tensor,
                      accumulate: bool) -> tuple[torch.Tensor, bool]:
        """Where a reduce-scatter of local range [start, start + own.numel()) writes, and
        whether it may run asynchronously; ``own``: this rank's slice of the send buffer."""
        return self.placement.reduce_target(self.grad_range(start, own.numel()), own,
                                            accumulate)

    def receive(self, chunk: int, start: int, reduced: torch.Tensor, accumulate: bool) -> None:
        """The reduced gradient of local range [start, start + reduced.numel()) into the
        shard: overwritten, or added to (a further backward of the same step). A no-op
        when the state keeps no gradient of its own (the stage's buffer is the gradient)."""
        if self.grads is not None:
            self.placement.receive(chunk, reduced, self.grad_range(start, reduced.numel()),
                                   accumulate)

    def drain(self) -> None:
        """Every gradient received so far is in the shard."""
        self.placement.drain()

    def before_gather(self, chunk: int) -> None:
        """The chunk's new parameters are in place (device order) for its gather."""
        self.placement.release(chunk)

    def end_step(self) -> None:
        self.placement.end_step()
