"""What every stage-3 unit's verbs work over (unit.py says how they are used).

One ``UnitContext`` per sharded model, shared by its units: the process group and its
communication parts, this rank's persistent slices (``local_params`` and ``local_grads``,
each in its own arena, on the device or in host memory), the gather arena that units borrow
full-size buffers from, the placeholder released parameters point at, the offload copier and
gradient sink, the bound on one wait in a collective, and the one gradient reduce-scatter in
flight. It holds no hook and no policy: the
runtime (runtime.py) decides when units move, the units (unit.py) how.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from ...comm import CollectiveTimeout, Comm
from ...comm.parts import gather_part, reduce_part
from ...comm.quantized_parts import WireFormat
from ...memory import Arena, ArenaOutOfMemory, Block
from .. import gather_timeout as told
from ..offload import HOST, Copier, pin_host_memory
from ..placement import GradSink

if TYPE_CHECKING:
    from .secondary import Secondary
    from .unit import Unit

GATHER_ALIGN = 256  # bytes: every gather buffer starts aligned for vector loads and NCCL


def gather_arena_bytes(root_numels: list[int], unit_numels: list[int], prefetch: int,
                       element_size: int, grad_element_size: int | None = None) -> int:
    """Capacity of the gather arena: the root (held through the whole forward), the
    ``prefetch + 1`` biggest other units (gathered at once), and one gradient buffer of the
    biggest unit (the reduce-scatter in flight, ``grad_element_size`` bytes an element: the
    reduce dtype's); plus one alignment's slack per buffer."""
    sizes = sorted(unit_numels, reverse=True)
    root = sum(root_numels)
    biggest = sizes[0] if sizes else root
    gsz = element_size if grad_element_size is None else grad_element_size
    elems = root + sum(sizes[: prefetch + 1])
    return elems * element_size + biggest * gsz + GATHER_ALIGN * (prefetch + 4)


class UnitContext:
    """The comm, arenas and shared bookkeeping the units of one sharded model use.

    Attributes: ``comm``, ``dtype``, ``device``; ``grad_comm`` / ``param_comm`` (the reduce and
    gather parts of comm/parts.py, the only way the units reach the wire); ``local_params`` /
    ``local_grads`` (this rank's slice of every unit, flat, ``local_numel`` elements) in
    ``param_arena`` / ``grad_arena``; ``gather_arena``; ``overflow_bytes`` (buffers the arena
    could not hold, allocated outside it and counted); ``gathered_units`` / ``peak_units``
    (non-root units holding a gather buffer now / at most); ``nan`` (the placeholder's one
    element); ``copier`` (offload_params) and ``grad_sink`` (offloaded gradients); ``broken``
    (the message of a collective that timed out, after which nothing runs); ``inflight`` (the
    unit whose reduce-scatter is in flight); ``adopted`` (parameters whose assigned values the
    slices took, for the optimizer's master); ``param_names`` (for error messages).
    """

    def __init__(self, comm: Comm, dtype: torch.dtype, device: torch.device, *,
                 local_numel: int, gather_bytes: int, offload_params: bool,
                 gather_timeout: tuple[float, bool]) -> None:
        self.comm, self.dtype, self.device = comm, dtype, device
        # The dtype gradients are reduced in and kept in (local_grads): the parameters' until
        # an optimizer asks for another (ZeroAdamW(reduce_dtype=), set_grad_dtype).
        self.grad_dtype = dtype
        # How the units' gradients are reduced and their parameters gathered on this layout
        # (comm/parts.py): the units call their verbs, never a collective. ``wire``: what they
        # quantize (plain until an optimizer asks, ZeroAdamW(gather_dtype=, reduce_dtype=)).
        self.wire = WireFormat()
        self.grad_comm = reduce_part(comm, dtype)
        self.param_comm = gather_part(comm)
        self.local_numel = local_numel
        # hpZ's in-node shares of the units (secondary.py; shard_model(hpz=True)), or None.
        self.secondary: Secondary | None = None
        # Prefetched gathers (and gradient reduce-scatters) run asynchronously on every
        # backend (NCCL stream, gloo threads).
        self.overlap = comm.world_size > 1
        # Bound on one wait in a unit's collective (gather_timeout.py); after a timeout the
        # context refuses to go on (``broken``): the timed-out collective is still pending.
        self.timeout_s = gather_timeout[0]
        self.wait_timeout = told.wait_limit(*gather_timeout, comm.backend)
        self.broken: str | None = None
        self.abandoned: list[torch.Tensor] = []  # buffers a pending collective may still write
        # Arena blocks of units moved out of them in a backward's recompute, which tensors
        # saved earlier in that recompute may still view: returned when the backward ends.
        self.retired: list[Block] = []
        # Persistent model state of this rank: its slice of every unit (params and grads),
        # each in its own arena on the device, or in host memory when offloaded.
        self.param_arena, self.local_params = self._alloc_local(offload_params)
        self.grad_arena, self.local_grads = self._alloc_local(False)
        self.local_grads.zero_()
        self.grads_on_host = False
        self.grad_sink: GradSink | None = None  # the offloading optimizer's host placement
        self.copier = Copier(device) if offload_params else None
        self.gather_arena = Arena(gather_bytes, device, alignment=GATHER_ALIGN)
        self.overflow_bytes = 0
        self.gathered_units = self.peak_units = 0
        # Released parameters keep their full shape, dtype and device (as FSDP2's DTensor
        # parameters do: shape-based param groups and parameter counts stay right) but hold no
        # memory: a zero-stride view of one NaN, so a value read outside a forward is NaN,
        # never a plausible number, and a write raises.
        self.nan = torch.full((), float("nan"), dtype=dtype, device=device)
        self.inflight: Unit | None = None
        self.adopted: list[torch.nn.Parameter] = []
        self.param_names: dict[int, str] = {}

    def _alloc_local(self, on_host: bool,
                     dtype: torch.dtype | None = None) -> tuple[Arena, torch.Tensor]:
        dtype = dtype or self.dtype
        esz = torch.empty(0, dtype=dtype).element_size()
        arena = Arena(max(self.local_numel * esz + 512, 512), HOST if on_host else self.device,
                      pin_memory=on_host and pin_host_memory(self.device))
        return arena, arena.alloc(self.local_numel, dtype).tensor

    def _check_between_steps(self, option: str) -> None:
        """The communication options change only with no unit gathered or reducing."""
        if (self.inflight is not None or self.grad_comm.pending
                or self.gather_arena.stats()["in_use"]):
            raise RuntimeError(f"{option}: the sharded model is in a forward or backward "
                               "(units gathered or reducing); build the optimizer between "
                               "steps")

    def set_grad_dtype(self, dtype: torch.dtype, gather_bytes: int) -> None:
        """Gradients are reduced and kept in ``dtype`` from now on: new gradient slices (the
        values so far carried over) and a gather arena of ``gather_bytes`` whose gradient
        buffer is in that dtype. Only between steps, with no unit gathered or reducing."""
        if dtype == self.grad_dtype:
            return
        self._check_between_steps("reduce_dtype")
        self.grad_arena, grads = self._alloc_local(self.grads_on_host, dtype)
        grads.copy_(self.local_grads)
        self.local_grads = grads
        self.grad_dtype = dtype
        self.grad_comm = reduce_part(self.comm, dtype, self.wire.reduce_bits, self.wire.feedback)
        self.gather_arena = Arena(gather_bytes, self.device, alignment=GATHER_ALIGN)

    def set_wire(self, wire: WireFormat) -> None:
        """The units' gathers and reduce-scatters travel as ``wire`` says from now on (new
        parts, comm/quantized_parts.py). Only between steps, with no unit gathered or
        reducing."""
        if wire == self.wire:
            return
        self._check_between_steps("gather_dtype / reduce_dtype")
        self.wire = wire
        self.grad_comm = reduce_part(self.comm, self.grad_dtype, wire.reduce_bits, wire.feedback)
        self.param_comm = gather_part(self.comm, wire.gather_bits)

    @contextmanager
    def exact_gathers(self) -> Iterator[None]:
        """Gathers in the parameters' own dtype within (full_state_dict: what is saved or
        exported are the parameters' values, never their int8 decoding)."""
        part, sec = self.param_comm, self.secondary
        # hpZ's shares may hold an int8 decoding: neither read nor filled here.
        self.param_comm, self.secondary = gather_part(self.comm), None
        try:
            yield
        finally:
            self.param_comm, self.secondary = part, sec

    def offload_grads(self, sink: GradSink) -> None:
        """ZeRO-Offload: the gradient slices move to host memory (a fresh, zeroed buffer: no
        step is in progress when an optimizer is built) and every unit's reduced gradients
        are landed there through ``sink``."""
        if not self.grads_on_host:
            self.grad_arena, self.local_grads = self._alloc_local(True, self.grad_dtype)
            self.local_grads.zero_()
            self.grads_on_host = True
        self.grad_sink = sink

    def alloc(self, numel: int,
              dtype: torch.dtype | None = None) -> tuple[torch.Tensor, Block | None]:
        """A buffer of ``numel`` elements (of ``dtype``, default the parameters') from the
        gather arena (its block), or, when the arena is full, a plain tensor (block None)
        counted in ``overflow_bytes``."""
        dtype = dtype or self.dtype
        try:
            blk = self.gather_arena.alloc(numel, dtype)
            return blk.tensor, blk
        except ArenaOutOfMemory:
            # Unusual call orders can need more at once; allowed, and counted in the stats.
            self.overflow_bytes += numel * torch.empty(0, dtype=dtype).element_size()
            return torch.empty(numel, dtype=dtype, device=self.device), None

    def check_usable(self) -> None:
        """Raise once a collective timed out: it is still pending on this process group."""
        if self.broken is not None:
            raise RuntimeError(self.broken)

    def wait(self, work: Any, unit: str, what: str) -> None:
        """Wait for a unit's collective, at most ``wait_timeout`` seconds (gather_timeout.py)."""
        try:
            work.wait(timeout=self.wait_timeout)
        except CollectiveTimeout as exc:
            self.broken = told.message(self.comm.rank, self.comm.world_size, what, unit,
                                       exc.waited, self.timeout_s)
            raise CollectiveTimeout(self.broken, exc.waited) from exc

    def memory_stats(self) -> dict[str, int]:
        """Bytes of the slices and of the gather arena (its capacity, use and peak)."""
        esz = self.local_params.element_size()
        a = self.gather_arena.stats()
        return {
            "local_params": self.local_numel * esz,
            "local_grads": self.local_numel * self.local_grads.element_size(),
            "local_params_on_host": int(self.copier is not None),
            "local_grads_on_host": int(self.grads_on_host),
            "gather_capacity": int(a["capacity"]),
            "gather_in_use": int(a["in_use"]),
            "gather_peak": int(a["peak_in_use"]),
            "gather_overflow": self.overflow_bytes,
            "peak_gathered_units": self.peak_units,
        }

    def free_retired(self) -> None:
        """The blocks units left in a backward go back to the arena (it ended)."""
        for blk in self.retired:
            self.gather_arena.free(blk)
        self.retired = []

    def finish_scatter(self) -> None:
        """Complete the reduce-scatter in flight, if any (Unit.finish_reduce); its sum across
        a mesh's replicas may still run (the next unit's overlaps it)."""
        if self.inflight is not None:
            self.inflight.finish_reduce()

    def finish_reduce(self) -> None:
        """Complete every reduction in flight: the reduce-scatter and the cross-replica sums
        (before anything reads ``local_grads``)."""
        self.finish_scatter()
        self.grad_comm.settle()
