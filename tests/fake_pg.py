"""Rank r of an N-rank group, in this process: torch's fake process group.

Much of what the engine tests check depends on the world size and the rank but not on what a
collective computes: memory_stats() against the paper's formulas, comm_stats() element counts,
the layout and its padding, which elements a rank owns. torch's fake backend ("fake", with a
FakeStore: no peers, no rendezvous) answers every collective at once without moving data, so
such a check runs as one rank after another in the test's own process instead of on spawned
gloo ranks. What the collectives return is not a sum over ranks (an all-gather repeats this
rank's input, a reduce-scatter keeps this rank's slice, an all-reduce leaves its input, a
receive receives nothing), so values trained under it are meaningless, with
``gloo_reduce_scatter`` not even reproducible (the point-to-point reduce-scatter adds receive
buffers nobody wrote): only sizes, counts, layouts and refusals may be asserted, never a value
or anything a value decides (a loss scaler's skipped steps, a non-finite norm).

``gloo_reduce_scatter`` (the default) makes every Comm built inside the group take the
point-to-point reduce-scatter it takes on gloo (zerokern/comm/collectives.py chooses it by
backend name), so that its receive buffers, and with them ``comm_scratch`` and the planned
memory, are what a gloo rank reports; False leaves the fake backend's native reduce-scatter
(NCCL's path: no receive buffers).

Many tests assume that no default process group exists, so the group lives only inside the
``with`` and is destroyed on the way out, failing or not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from zerokern.comm.collectives import Comm, inflight_count

T = TypeVar("T")


@contextmanager
def fake_group(rank: int, world: int, *, gloo_reduce_scatter: bool = True) -> Iterator[None]:
    """The default process group is a fake one of ``world`` ranks, this process rank
    ``rank``, for the duration of the ``with``."""
    if dist.is_initialized():
        raise RuntimeError("a default process group exists already: fake_group would replace "
                           "it, and destroying it afterwards would break its owner")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    original = Comm.__init__

    def gloo_like(self: Comm, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.p2p_reduce_scatter = self.world_size > 1

    if gloo_reduce_scatter:
        Comm.__init__ = gloo_like  # type: ignore[method-assign]
    try:
        yield
    finally:
        Comm.__init__ = original  # type: ignore[method-assign]
        dist.destroy_process_group()
    # The fake backend keeps no tensor after a collective: nothing is left for zerokern's
    # exit hook to wait for (it would wait in vain for 10 s).
    assert inflight_count() == 0, "the fake backend still holds tensors of ours"


def each_rank(world: int, fn: Callable[[int, int], T], *,
              gloo_reduce_scatter: bool = True) -> list[T]:
    """``fn(rank, world)`` for every rank in turn, each inside its own fake group: what the
    ranks would have computed, in rank order."""
    out = []
    for rank in range(world):
        with fake_group(rank, world, gloo_reduce_scatter=gloo_reduce_scatter):
            out.append(fn(rank, world))
    return out
