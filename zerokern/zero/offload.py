"""ZeRO-Offload runtime: this rank's optimizer state in host memory, the fused AdamW step on
the CPU, and the per-shard pipeline that moves gradients to the host and new parameters back.

Pieces (the plan, which elements a rank owns and which bucket or unit they belong to, stays in
layout.py; this file only moves bytes):

- ``HostArena``: one host ``Arena`` (page-locked when the device is CUDA) holding the fp32
  master, both moments, the gradient shard and the staging slots, with exact accounting.
- ``Copier``: every copy between the device and the host. On CUDA it runs on a side stream
  from/into pinned memory and returns a ``Ticket`` (an event); on a CPU device the copy is a
  plain synchronous ``copy_`` and the ticket is already complete. The rest of the pipeline is
  the same code on both, so CPU runs exercise the staging slots and their ordering for real.
- ``StagingRing``: two pinned slots. A gradient shard lands in one while the previous lands in
  the other; a slot is *settled* (its copy waited for, then its contents moved into the host
  gradient shard) in the order it was filled, before it is reused and before the step.
- ``OffloadPipeline``: one ``ShardPhase`` per chunk (a bucket at stages 1-2, a unit at stage 3):
  ON_DEVICE -> COPYING -> ON_HOST during backward, UPDATED -> RETURNED during the step.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..memory import Arena, Block

HOST = torch.device("cpu")
OFFLOAD_CHOICES = ("cpu",)
_ALIGN = 256
# OffloadPipeline.log keeps this many transitions per chunk: a step makes about four per
# chunk (two per backward, two in the step), so a few steps' worth, never the whole run.
LOG_PER_CHUNK = 16


class ShardPhase(enum.Enum):
    """Where one chunk's (bucket's or unit's) share of this rank's shard is in the step."""

    ON_DEVICE = "on device"  # nothing copied yet in this step
    COPYING = "copying"  # its reduced gradient is in a staging slot (copy maybe in flight)
    ON_HOST = "on host"  # its gradient is in the host gradient shard
    UPDATED = "updated"  # the CPU AdamW ran; its new parameters are being copied back
    RETURNED = "returned"  # its new parameters are on the device


def pin_host_memory(device: torch.device) -> bool:
    """Host memory is page-locked when the device is a GPU: only then are copies DMA
    transfers that can overlap compute (and pinning needs a CUDA context anyway)."""
    return device.type == "cuda" and torch.cuda.is_available()


class Ticket:
    """A copy issued by ``Copier``: ``wait()`` blocks the host until it is done; ``fence()``
    orders work issued on the device's current stream afterwards after it (no host wait)."""

    __slots__ = ("_event", "_device")

    def __init__(self, event: Any = None, device: torch.device | None = None) -> None:
        self._event = event
        self._device = device  # the device whose current stream fence() orders

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def fence(self) -> None:
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)

    @property
    def done(self) -> bool:
        return self._event is None or bool(self._event.query())


class Copier:
    """Device <-> host copies: asynchronous on a side stream for CUDA, synchronous otherwise."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        # The parameters' device, not the current one: a process may drive cuda:1 without
        # torch.cuda.set_device, and the ordering must be with that device's stream.
        self.device = device
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.d2h = self.h2d = 0  # copies issued, by direction (bytes)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        self.d2h += src.numel() * src.element_size()
        return self._copy(dst, src)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        self.h2d += src.numel() * src.element_size()
        return self._copy(dst, src)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        # Directions are the caller's roles, not the tensors' devices: on a CPU "device" both
        # sides are CPU tensors and the copy is synchronous.
        if not self.cuda:
            dst.copy_(src)
            return Ticket()
        stream = self.stream
        # The source was written by work on the current stream (a collective waited on, the
        # CPU kernel before that): the side stream starts after it.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        for t in (dst, src):
            if t.is_cuda:
                t.record_stream(stream)  # memory from torch's allocator is not reused early
        ev = torch.cuda.Event()
        ev.record(stream)
        return Ticket(ev, self.device)


class HostArena:
    """This rank's host-resident model state, in one arena (pinned when the device is CUDA)."""

    def __init__(self, specs: list[tuple[str, int, torch.dtype]], device: torch.device) -> None:
        need = sum(-(-max(n * _esize(d), 1) // _ALIGN) * _ALIGN for _, n, d in specs)
        self.arena = Arena(max(need, _ALIGN), HOST, alignment=_ALIGN,
                           pin_memory=pin_host_memory(device))
        self.blocks: dict[str, list[Block]] = {}

    def alloc(self, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        blk = self.arena.alloc(numel, dtype)
        self.blocks.setdefault(kind, []).append(blk)
        return blk.tensor.zero_()

    def stats(self) -> dict[str, int]:
        s = self.arena.stats()
        return {"in_use": int(s["in_use"]), "capacity": int(s["capacity"])}


def _esize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


@dataclass
class _Parked:
    slot: int
    ticket: Ticket
    then: Callable[[], None] | None


class StagingRing:
    """Staging slots in host memory, used round robin and settled in the order filled."""

    def __init__(self, host: HostArena, slots: int, numel: int, dtype: torch.dtype) -> None:
        self.numel = numel
        self.slots = [host.alloc("staging", max(numel, 1), dtype) for _ in range(slots)]
        self._next = 0
        self._parked: deque[_Parked] = deque()
        self.settled = 0  # slot uses completed (tests: the ring really turned)

    def take(self) -> tuple[int, torch.Tensor]:
        """The next slot, once what its previous use left pending is done (and everything
        parked before it: gradients of one bucket must land in the order they came)."""
        k = self._next
        self._next = (k + 1) % len(self.slots)
        while any(p.slot == k for p in self._parked):
            self._settle_oldest()
        return k, self.slots[k]

    def park(self, slot: int, ticket: Ticket, then: Callable[[], None] | None = None) -> None:
        """The slot is busy until ``ticket`` completes; ``then`` runs on the host after it."""
        self._parked.append(_Parked(slot, ticket, then))

    def _settle_oldest(self) -> None:
        p = self._parked.popleft()
        p.ticket.wait()
        if p.then is not None:
            p.then()
        self.settled += 1

    def settle_all(self) -> None:
        while self._parked:
            self._settle_oldest()

    @property
    def pending(self) -> int:
        return len(self._parked)


class OffloadPipeline:
    """The host state's per-chunk pipeline. ``land`` moves a reduced gradient shard to the
    host (during backward); ``update_with`` runs the update rule's kernel on a host range and
    sends the new parameters back (during the step)."""

    def __init__(self, host: HostArena, device: torch.device, chunks: int, slot_numel: int,
                 dtype: torch.dtype, backend: str | None) -> None:
        self.host, self.device, self.dtype = host, device, dtype
        self.copier = Copier(device)
        self.staging = StagingRing(host, 2, slot_numel, dtype)
        # The user's choice as it is (check_offload_backend refused the device-only ones at
        # construction): the kernel raises on a request it cannot run, never swaps it.
        self.backend = backend
        self.phase = [ShardPhase.ON_DEVICE] * chunks
        # The latest transitions, in order (tests and debugging read them). Bounded: a run
        # of many steps must not grow host memory with a record of every one.
        self.log: deque[tuple[int, ShardPhase]] = deque(maxlen=LOG_PER_CHUNK * max(chunks, 1))
        self._returns: list[Ticket] = []
        self._fenced = 0  # returns already fenced (the device stream stays ordered after them)

    def _set(self, c: int, ph: ShardPhase) -> None:
        self.phase[c] = ph
        self.log.append((c, ph))

    # -- backward: gradients to the host -----------------------------------------------------
    def land(self, c: int, src: torch.Tensor, dst: torch.Tensor, accumulate: bool) -> Ticket:
        """Copy chunk ``c``'s reduced gradient ``src`` (device) through a staging slot into
        ``dst`` (its range of the host gradient shard): overwrite, or add (a further
        backward of the same step). The returned ticket fences the reuse of ``src``."""
        k, slot = self.staging.take()
        stage = slot.narrow(0, 0, src.numel())
        ticket = self.copier.to_host(stage, src)

        def arrived() -> None:
            if accumulate:
                dst.add_(stage)
            else:
                dst.copy_(stage)
            self._set(c, ShardPhase.ON_HOST)

        self.staging.park(k, ticket, arrived)
        self._set(c, ShardPhase.COPYING)
        return ticket

    def drain(self) -> None:
        """Every gradient copied so far is in the host gradient shard."""
        self.staging.settle_all()

    # -- step: the update on the CPU, new parameters back to the device --------------------
    def update_with(self, c: int, values: torch.Tensor, dst: torch.Tensor | None,
                    kernel: Callable[[torch.Tensor | None], None], *,
                    lp_host: torch.Tensor | None = None) -> None:
        """``kernel(lp)`` updates host range ``values`` (writing the new parameters into
        ``lp`` when not None), then they are copied to ``dst`` on the device: through a
        staging slot the kernel writes when ``dst``'s dtype differs from ``values``' (the
        fp32 master of 16-bit parameters), else straight from ``values``. ``dst`` None: the
        parameters live on the host (``lp_host``: their 16-bit copy, or None)."""
        n = values.numel()
        lp = lp_host
        if dst is not None and dst.dtype != values.dtype:
            if n > self.staging.numel:
                raise AssertionError("a returned range is larger than a staging slot")
            k, slot = self.staging.take()
            lp = slot.narrow(0, 0, n)
        kernel(lp)
        if self.phase[c] is not ShardPhase.UPDATED:
            self._set(c, ShardPhase.UPDATED)
        if dst is None:
            return
        ticket = self.copier.to_device(dst, lp if lp is not None else values)
        if lp is not None:
            self.staging.park(k, ticket)
        self._returns.append(ticket)

    def fence_returns(self) -> None:
        """Device work issued from now on (the all-gather of the new parameters) runs after
        every parameter copy issued so far."""
        for t in self._returns[self._fenced:]:
            t.fence()
        self._fenced = len(self._returns)

    def returned(self, c: int) -> None:
        self._set(c, ShardPhase.RETURNED)

    def end_step(self) -> None:
        """Wait for every copy of the step (the slots and the master are reused next step)."""
        for t in self._returns:
            t.wait()
        self._returns = []
        self._fenced = 0
        self.staging.settle_all()
        self.phase = [ShardPhase.ON_DEVICE] * len(self.phase)
