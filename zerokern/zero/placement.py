"""Where this rank's optimizer state lives (issue 36): one protocol, one class per place.

A stage hands its state (shard_state.py) the chunks it steps (a bucket at stages 1-2, a unit
at stage 3, everything at stage 0); the placement implements the same verbs wherever the state
is, so a stage never asks which one it has:

- ``alloc``: a block of the state's buffers;
- ``acquire(chunk)`` / ``release(chunk)``: the chunk's state is ready to step / its new
  parameters are in place for the chunk's gather (device order);
- ``step(chunk, values, dst, kernel)``: run the update ``kernel(lp)`` over a range of the
  chunk, the new parameters ending in ``dst`` (``lp``: where the kernel writes them rounded);
- ``reduce_target`` / ``receive`` / ``drain``: reduced gradients into the state's shard;
  ``grad_sink``: what stage 3's runtime lands its reduced gradients through (None on the
  device: the runtime reduces into its own slice);
- ``memory()``: the bytes of its own arena (none on the device: its blocks are the engine's).

``OnDevice`` keeps the state in the engine's device arena. ``OnHost`` (ZeRO-Offload) keeps it
in a host arena (pinned on CUDA) and moves gradients in and parameters out through two
staging slots (offload.py moves the bytes). A later NVMe placement is one more class here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from .offload import HostArena, OffloadPipeline, Ticket

Kernel = Callable[[torch.Tensor | None], None]
"""``kernel(lp)``: the update of a range, writing the new 16-bit parameters into ``lp``."""


@dataclass(frozen=True)
class BufferSpec:
    """One block a stage or its state will take from an arena (pure: memory_stats() before
    the first step reports these without allocating)."""

    kind: str  # the memory_stats() key it is reported under
    numel: int
    dtype: torch.dtype


class GradSink(Protocol):
    """Where stage 3's runtime lands a unit's reduced gradient slice (offload)."""

    def land(self, chunk: int, reduced: torch.Tensor, target: torch.Tensor,
             accumulate: bool) -> Ticket: ...

    def drain(self) -> None: ...


class Placement(Protocol):
    """The verbs every placement implements (module docstring)."""

    on_host: bool
    kernel_backend: str | None

    def alloc(self, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def acquire(self, chunk: int) -> None: ...

    def step(self, chunk: int, values: torch.Tensor, dst: torch.Tensor | None,
             kernel: Kernel) -> None: ...

    def release(self, chunk: int) -> None: ...

    def reduce_target(self, target: torch.Tensor, own: torch.Tensor,
                      accumulate: bool) -> tuple[torch.Tensor, bool]: ...

    def receive(self, chunk: int, reduced: torch.Tensor, target: torch.Tensor,
                accumulate: bool) -> None: ...

    def drain(self) -> None: ...

    @property
    def grad_sink(self) -> GradSink | None: ...

    def end_step(self) -> None: ...

    def memory(self) -> dict[str, int]: ...


class OnDevice:
    """The state in the engine's device arena, updated in place by the device kernel."""

    on_host = False

    def __init__(self, alloc: Callable[[str, int, torch.dtype], torch.Tensor],
                 backend: str | None) -> None:
        self.alloc, self.backend = alloc, backend
        self.kernel_backend = backend

    def acquire(self, chunk: int) -> None:
        pass

    def step(self, chunk: int, values: torch.Tensor, dst: torch.Tensor | None,
             kernel: Kernel) -> None:
        # values: the fp32 master (dst its 16-bit parameters, written by the kernel) or the
        # parameters themselves (dst None).
        kernel(dst)

    def release(self, chunk: int) -> None:
        pass

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

    @property
    def grad_sink(self) -> GradSink | None:
        return None

    def end_step(self) -> None:
        pass

    def memory(self) -> dict[str, int]:
        return {}


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

    def acquire(self, chunk: int) -> None:
        pass  # the whole state is in host memory

    def step(self, chunk: int, values: torch.Tensor, dst: torch.Tensor | None,
             kernel: Kernel) -> None:
        lp_host = None
        if self.params_on_host and dst is not None:
            lp_host, dst = dst, None  # the host parameters: written by the kernel, in place
        self.pipe.update_with(chunk, values, dst, kernel, lp_host=lp_host)

    def release(self, chunk: int) -> None:
        """Device work issued from now on (the chunk's all-gather, the next forward) reads
        the parameters after every copy back issued so far."""
        self.pipe.fence_returns()
        self.pipe.returned(chunk)

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

    @property
    def grad_sink(self) -> GradSink | None:
        return self

    def end_step(self) -> None:
        self.pipe.end_step()

    def memory(self) -> dict[str, int]:
        return self.host.stats()
