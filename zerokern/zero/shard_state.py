"""This rank's optimizer state, as one part every stage composes: the fp32 master (or none),
both moments, the gradient shard when the state keeps its own, where they live, and the fused
AdamW step over any range of them.

A stage decides *which* elements are this rank's and how their gradients are reduced and
their parameters come back (stages/); this file decides how the state of those elements is
stored and updated. Where it is stored is a placement given to the state, not a subclass per
stage:

- ``OnDevice``: blocks of the engine's device arena; the step is the device kernel writing the
  16-bit parameters in the same pass.
- ``OnHost`` (ZeRO-Offload): one host arena (pinned on CUDA) with two staging slots; reduced
  gradients land through the slots during backward, the step runs the CPU kernel and sends
  the new parameters back through them (offload.py moves the bytes).

A new state format (what the moments are stored as, whether there is a master) changes
``ShardState`` and the kernels; a new placement is a new class beside these two. Neither
touches the stages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import ops
from ..quant.maps import BLOCK
from .offload import HostArena, OffloadPipeline, Ticket
from .state_format import RunPlan, StateFormat, StateRun


@dataclass(frozen=True)
class BufferSpec:
    """One block a stage or its state will take from an arena (pure: memory_stats() before
    the first step reports these without allocating)."""

    kind: str  # the memory_stats() key it is reported under
    numel: int
    dtype: torch.dtype


def _adamw(values: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
           grp: dict[str, Any], step: int, grad_scale: float, lp: torch.Tensor | None,
           backend: str | None) -> None:
    ops.fused_adamw_(
        values, grad, m, v, lr=float(grp["lr"]), beta1=float(grp["betas"][0]),
        beta2=float(grp["betas"][1]), eps=float(grp["eps"]),
        weight_decay=float(grp["weight_decay"]), step=step, grad_scale=grad_scale,
        param_lp=lp, backend=backend)


class OnDevice:
    """The state in the engine's device arena, updated in place by the device kernel."""

    on_host = False

    def __init__(self, alloc: Callable[[str, int, torch.dtype], torch.Tensor],
                 backend: str | None) -> None:
        self.alloc, self.backend = alloc, backend
        self.kernel_backend = backend

    def update(self, chunk: int, grp: dict[str, Any], values: torch.Tensor, grad: torch.Tensor,
               m: torch.Tensor, v: torch.Tensor, step: int, grad_scale: float,
               new: torch.Tensor | None) -> None:
        _adamw(values, grad, m, v, grp, step, grad_scale, new, self.backend)

    def update_compressed(self, chunk: int, values: torch.Tensor, dst: torch.Tensor | None,
                          kernel: Callable[[torch.Tensor | None], None]) -> None:
        # values: the fp32 master (dst its 16-bit parameters, written by the kernel) or the
        # parameters themselves (dst None).
        kernel(dst)

    def reduce_target(self, target: torch.Tensor, own: torch.Tensor,
                      accumulate: bool) -> tuple[torch.Tensor, bool]:
        # Straight into the shard; a further backward of the same step reduces into a
        # temporary (synchronously: it is added at once) and adds it.
        return (target, True) if not accumulate else (torch.empty_like(target), False)

    def receive(self, chunk: int, reduced: torch.Tensor, target: torch.Tensor,
                accumulate: bool) -> None:
        if reduced.data_ptr() == target.data_ptr():
            return  # reduced in place
        if accumulate:
            target.add_(reduced)
        else:
            target.copy_(reduced)

    def drain(self) -> None:
        pass

    def before_gather(self, chunk: int) -> None:
        pass

    def end_step(self) -> None:
        pass


class OnHost:
    """The state in a host arena (ZeRO-Offload): the CPU kernel updates it, reduced gradients
    and new parameters cross through two staging slots, one chunk (bucket or unit) at a time.
    ``params_on_host``: the parameters' own slices live in host memory too (stage 3's
    ``offload_params``): the kernel writes them directly, nothing goes back."""

    on_host = True

    def __init__(self, specs: list[BufferSpec], device: torch.device, *, chunks: int,
                 slot_numel: int, dtype: torch.dtype, backend: str | None,
                 params_on_host: bool = False) -> None:
        self.host = HostArena([(s.kind, s.numel, s.dtype) for s in specs], device)
        self.pipe = OffloadPipeline(self.host, device, chunks, slot_numel, dtype, backend)
        self.params_on_host = params_on_host
        self.kernel_backend = self.pipe.backend

    def alloc(self, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.host.alloc(kind, numel, dtype)

    def update(self, chunk: int, grp: dict[str, Any], values: torch.Tensor, grad: torch.Tensor,
               m: torch.Tensor, v: torch.Tensor, step: int, grad_scale: float,
               new: torch.Tensor | None) -> None:
        if new is None:  # fp32 parameters in host memory: updated in place
            self.pipe.update(chunk, grp, values, grad, m, v, step, grad_scale, None)
        elif self.params_on_host:
            self.pipe.update(chunk, grp, values, grad, m, v, step, grad_scale, None,
                             lp_host=new)
        else:
            self.pipe.update(chunk, grp, values, grad, m, v, step, grad_scale, new)

    def update_compressed(self, chunk: int, values: torch.Tensor, dst: torch.Tensor | None,
                          kernel: Callable[[torch.Tensor | None], None]) -> None:
        if self.params_on_host and dst is not None and dst.data_ptr() == values.data_ptr():
            dst = None  # the host parameters updated in place (master="none")
        self.pipe.update_with(chunk, values, dst, kernel,
                              lp_host=dst if self.params_on_host else None)

    def reduce_target(self, target: torch.Tensor, own: torch.Tensor,
                      accumulate: bool) -> tuple[torch.Tensor, bool]:
        # In place, into this rank's slice of the send buffer; landed on the host after.
        return own, True

    def receive(self, chunk: int, reduced: torch.Tensor, target: torch.Tensor,
                accumulate: bool) -> None:
        # fence: device work issued later (the next round's writes into the send buffer)
        # waits for the copy out of it.
        self.land(chunk, reduced, target, accumulate).fence()

    def land(self, chunk: int, reduced: torch.Tensor, target: torch.Tensor,
             accumulate: bool) -> Ticket:
        return self.pipe.land(chunk, reduced, target, accumulate)

    def drain(self) -> None:
        self.pipe.drain()

    def before_gather(self, chunk: int) -> None:
        """Device work issued from now on (the chunk's all-gather, the next forward) reads
        the parameters after every copy back issued so far."""
        self.pipe.fence_returns()
        self.pipe.returned(chunk)

    def end_step(self) -> None:
        self.pipe.end_step()


Placement = OnDevice | OnHost


def _adamw_compressed(grp: dict[str, Any], values: torch.Tensor, grad: torch.Tensor,
                      m: torch.Tensor, v: torch.Tensor, am: torch.Tensor | None,
                      avm: torch.Tensor | None, lp: torch.Tensor | None,
                      sr_index: torch.Tensor | None, seed: int, step: int, grad_scale: float,
                      backend: str | None) -> None:
    ops.fused_adamw_compressed_(
        values, grad, m, v, lr=float(grp["lr"]), beta1=float(grp["betas"][0]),
        beta2=float(grp["betas"][1]), eps=float(grp["eps"]),
        weight_decay=float(grp["weight_decay"]), step=step, grad_scale=grad_scale,
        exp_avg_absmax=am, exp_avg_sq_absmax=avm, param_lp=lp,
        sr_index=sr_index if values.dtype == torch.bfloat16 else None,
        seed=seed if values.dtype == torch.bfloat16 else None, backend=backend)


_MOMENT_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


class ShardState:
    """The optimizer state of ``numel`` local elements: ``master`` (fp32, or None when the
    parameters are updated in place), ``exp_avg``, ``exp_avg_sq`` and, when ``own_grads``,
    ``grads`` (the reduced gradient shard, in the parameters' dtype), allocated from the
    placement in that order.

    A compressed ``fmt`` (state_format.py) stores the moments as bf16 or uint8 codes (with
    one fp32 absmax per 256-element block, ``exp_avg_absmax`` / ``exp_avg_sq_absmax``), the
    moments of parameters too small to compress in fp32 side buffers (``exp_avg_side`` /
    ``exp_avg_sq_side``), and with ``master="none"`` no master on the device (on the host,
    ZeRO-Offload keeps a bf16 copy of the parameters in its place). ``runs`` says which local
    ranges are stepped in which format; ``seed`` keys the stochastic rounding."""

    def __init__(self, numel: int, grad_dtype: torch.dtype, placement: Placement, *,
                 master: bool, own_grads: bool, fmt: StateFormat | None = None,
                 runs: RunPlan | None = None, seed: int = 0) -> None:
        self.numel, self.placement = numel, placement
        self.fmt = fmt or StateFormat()
        self.runs, self.seed = runs, seed
        if not self.fmt.is_default and runs is None:
            raise ValueError("a compressed state needs its run plan")
        self._sr: dict[tuple[int, int], torch.Tensor] = {}
        alloc = placement.alloc
        for spec in self.specs(numel, grad_dtype, master=master, own_grads=own_grads,
                               fmt=self.fmt, side_numel=self.side_numel):
            setattr(self, spec.kind if spec.kind != "grads" else "grads",
                    alloc(spec.kind, spec.numel, spec.dtype))
        for name in ("master", "exp_avg_absmax", "exp_avg_sq_absmax", "exp_avg_side",
                     "exp_avg_sq_side", "grads"):
            if not hasattr(self, name):
                setattr(self, name, None)

    @property
    def side_numel(self) -> int:
        return 0 if self.runs is None else self.runs.side_numel

    @staticmethod
    def specs(numel: int, grad_dtype: torch.dtype, *, master: bool, own_grads: bool,
              fmt: StateFormat | None = None, side_numel: int = 0) -> list[BufferSpec]:
        """The blocks a state of these options takes (pure)."""
        fmt = fmt or StateFormat()
        mdt = _MOMENT_DTYPE[fmt.moments]
        # master="none" with a host state: the host keeps the bf16 parameters themselves.
        out = ([BufferSpec("master", numel, torch.bfloat16 if fmt.master == "none"
                           else torch.float32)] if master else [])
        out += [BufferSpec("exp_avg", numel, mdt), BufferSpec("exp_avg_sq", numel, mdt)]
        if fmt.moments == "int8":
            out += [BufferSpec("exp_avg_absmax", _blocks(numel), torch.float32),
                    BufferSpec("exp_avg_sq_absmax", _blocks(numel), torch.float32)]
        if fmt.moments != "fp32" and side_numel:
            out += [BufferSpec("exp_avg_side", side_numel, torch.float32),
                    BufferSpec("exp_avg_sq_side", side_numel, torch.float32)]
        if own_grads:
            out.append(BufferSpec("grads", numel, grad_dtype))
        return out

    @property
    def on_host(self) -> bool:
        return self.placement.on_host

    # -- the step ------------------------------------------------------------------------------
    def step(self, chunk: int, grp: dict[str, Any], start: int, numel: int, step: int,
             grad_scale: float, *, grad: torch.Tensor, param: torch.Tensor | None,
             lp: torch.Tensor | None = None) -> None:
        """The fused AdamW of local range [start, start + numel) with ``grad``: the master is
        updated and the new parameters written to ``lp`` if given, else to ``param`` (the
        parameters' own elements; 16-bit ones in the kernel's pass); without a master
        ``param`` itself is updated in place. ``chunk``: the bucket or unit (the host
        pipeline's bookkeeping)."""
        if not self.fmt.is_default:
            self._step_runs(chunk, grp, start, numel, step, grad_scale, grad, param, lp)
            return
        m = self.exp_avg.narrow(0, start, numel)
        v = self.exp_avg_sq.narrow(0, start, numel)
        if self.master is None:
            assert param is not None
            self.placement.update(chunk, grp, param, grad, m, v, step, grad_scale, None)
        else:
            self.placement.update(chunk, grp, self.master.narrow(0, start, numel), grad, m,
                                  v, step, grad_scale, lp if lp is not None else param)

    def runs_in(self, start: int, stop: int) -> list[tuple[StateRun, int, int]]:
        """(run, offset, numel): the parts of the runs inside local range [start, stop). A
        stage's range holds whole pieces, and pieces join a run only on chunk boundaries, so
        a part starts on a 256-element chunk of its run."""
        assert self.runs is not None
        from bisect import bisect_right

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

    def moments_of(self, r: StateRun, o: int = 0, n: int | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                              torch.Tensor | None]:
        """The stored moments of elements [o, o + n) of run ``r`` (default all):
        (exp_avg, exp_avg_sq, their absmax or None)."""
        n = r.numel - o if n is None else n
        if r.side_start >= 0:
            assert self.exp_avg_side is not None and self.exp_avg_sq_side is not None
            return (self.exp_avg_side.narrow(0, r.side_start + o, n),
                    self.exp_avg_sq_side.narrow(0, r.side_start + o, n), None, None)
        ls = r.local_start + o
        m = self.exp_avg.narrow(0, ls, n)
        v = self.exp_avg_sq.narrow(0, ls, n)
        if r.fmt != "int8":
            return m, v, None, None
        assert self.exp_avg_absmax is not None and self.exp_avg_sq_absmax is not None
        b0, nb = ls // BLOCK, _blocks(n)
        return m, v, self.exp_avg_absmax.narrow(0, b0, nb), self.exp_avg_sq_absmax.narrow(
            0, b0, nb)

    def sr_index(self, r: StateRun, o: int, n: int, device: torch.device) -> torch.Tensor:
        """Each chunk's index in its parameter, for elements [o, o + n) of run ``r``."""
        key = (r.local_start + o, n)
        t = self._sr.get(key)
        if t is None or t.device != device:
            c = o // BLOCK
            t = self._sr[key] = torch.tensor(r.sr_index[c:c + _blocks(n)], dtype=torch.int64,
                                             device=device)
        return t

    # -- the stored moments as fp32 (state dicts, checkpoints, opt.state) ----------------------
    def read_moments(self, start: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """New fp32 tensors holding the moments of local range [start, start + numel), a range
        of whole pieces (dequantized or widened; padding between runs reads 0)."""
        m32 = torch.zeros(numel, dtype=torch.float32, device=self.exp_avg.device)
        v32 = torch.zeros_like(m32)
        if self.fmt.moments == "fp32" or self.runs is None:
            m32.copy_(self.exp_avg.narrow(0, start, numel))
            v32.copy_(self.exp_avg_sq.narrow(0, start, numel))
            return m32, v32
        from ..quant.maps import SIGNED_MAP_ID, UNSIGNED_MAP_ID, code_map, dequantize_blockwise

        for r, o, n in self.runs_in(start, start + numel):
            at = r.local_start + o - start
            m, v, am, avm = self.moments_of(r, o, n)
            if am is not None and avm is not None:
                m = dequantize_blockwise(m, am, code_map(SIGNED_MAP_ID, m.device))
                v = dequantize_blockwise(v, avm, code_map(UNSIGNED_MAP_ID, v.device))
            m32.narrow(0, at, n).copy_(m)
            v32.narrow(0, at, n).copy_(v)
        return m32, v32

    def write_moments(self, start: int, numel: int, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor) -> None:
        """Store fp32 moments for local range [start, start + numel) of whole pieces in this
        state's format: quantized per block of each run part (absmax recomputed), rounded to
        nearest even (bf16), or copied."""
        if self.fmt.moments == "fp32" or self.runs is None:
            self.exp_avg.narrow(0, start, numel).copy_(exp_avg)
            self.exp_avg_sq.narrow(0, start, numel).copy_(exp_avg_sq)
            return
        from ..quant.blockwise import quantize_blockwise_v2 as quantize_blockwise
        from ..quant.maps import SIGNED_MAP_ID, UNSIGNED_MAP_ID, code_map

        for r, o, n in self.runs_in(start, start + numel):
            at = r.local_start + o - start
            m, v, am, avm = self.moments_of(r, o, n)
            src_m = exp_avg.narrow(0, at, n).to(torch.float32)
            src_v = exp_avg_sq.narrow(0, at, n).to(torch.float32)
            if am is not None and avm is not None:
                codes, absmax = quantize_blockwise(src_m, code_map(SIGNED_MAP_ID, m.device))
                m.copy_(codes)
                am.copy_(absmax)
                codes, absmax = quantize_blockwise(src_v, code_map(UNSIGNED_MAP_ID, v.device))
                v.copy_(codes)
                avm.copy_(absmax)
            else:
                m.copy_(src_m)
                v.copy_(src_v)

    def stored_moments(self, start: int, numel: int) -> dict[str, Any]:
        """The moments of local range [start, start + numel) (whole pieces of ONE run) as
        stored, as writable views: ``{"format", "exp_avg", "exp_avg_sq"}`` plus
        ``"exp_avg_absmax"`` / ``"exp_avg_sq_absmax"`` (one per 256-element block of the
        range, which starts on one) for int8. Writing them changes the state exactly."""
        if self.fmt.moments == "fp32" or self.runs is None:
            return {"format": "fp32", "exp_avg": self.exp_avg.narrow(0, start, numel),
                    "exp_avg_sq": self.exp_avg_sq.narrow(0, start, numel)}
        parts = self.runs_in(start, start + numel)
        assert len(parts) == 1 and parts[0][2] == numel, "a range of one run"
        r, o, n = parts[0]
        m, v, am, avm = self.moments_of(r, o, n)
        out: dict[str, Any] = {"format": r.fmt, "exp_avg": m, "exp_avg_sq": v}
        if am is not None:
            out["exp_avg_absmax"], out["exp_avg_sq_absmax"] = am, avm
        return out

    def zero_moments(self) -> None:
        """A fresh state's moments (every format's zero decodes to exact zeros)."""
        for name in ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax",
                     "exp_avg_side", "exp_avg_sq_side"):
            t = getattr(self, name)
            if t is not None:
                t.zero_()

    def _step_runs(self, chunk: int, grp: dict[str, Any], start: int, numel: int, step: int,
                   grad_scale: float, grad: torch.Tensor, param: torch.Tensor | None,
                   lp: torch.Tensor | None) -> None:
        backend = getattr(self.placement, "kernel_backend", None)
        out = lp if lp is not None else param
        for r, o, n in self.runs_in(start, start + numel):
            at = r.local_start + o - start  # in the caller's range
            g = grad.narrow(0, at, n)
            m, v, am, avm = self.moments_of(r, o, n)
            dst = None if out is None else out.narrow(0, at, n)
            if self.master is not None:
                values = self.master.narrow(0, r.local_start + o, n)
            else:
                assert dst is not None
                values, dst = dst, None  # the parameters themselves, in place
            sr = (self.sr_index(r, o, n, values.device) if values.dtype == torch.bfloat16
                  else None)

            def kernel(lp_out: torch.Tensor | None, values: torch.Tensor = values,
                       g: torch.Tensor = g, m: torch.Tensor = m, v: torch.Tensor = v,
                       am: torch.Tensor | None = am, avm: torch.Tensor | None = avm,
                       sr: torch.Tensor | None = sr) -> None:
                _adamw_compressed(grp, values, g, m, v, am, avm, lp_out, sr, self.seed, step,
                                  grad_scale, backend)

            self.placement.update_compressed(chunk, values, dst, kernel)

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
        self.placement.before_gather(chunk)

    def end_step(self) -> None:
        self.placement.end_step()
