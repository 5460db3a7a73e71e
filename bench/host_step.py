"""The optimizer's host step alone, timed inside a ZeRO-Offload training run (issue 39:
zerokern's offloaded step against DeepSpeed's ``DeepSpeedCPUAdam`` on the same shard).

bench_offload.py's step times hold forward, backward and the communication too, which hide
the optimizer's share. A ``HostStepTimer`` sums, over one training step, the wall time of
each call that runs the AdamW update on this rank's host shard, and the elements it updated;
the rank takes both after every step (zero_ranks.train).

What is timed, on each side, is the same work: the update of the fp32 host shard from its
gradient and moments, nothing before or after it.

- zerokern: the ``kernel`` that ``OnHost.step`` (zerokern/zero/placement.py, the offload
  placement's verb for "update this range") receives and runs once per bucket (stages 1-2) or
  unit (stage 3) and state run. Its copies of the gradients in and of the new parameters back
  are outside the kernel, so they are not timed.
- DeepSpeed: ``DeepSpeedCPUAdam.step``, wrapped on the instance its ZeRO optimizer calls
  once per partition (stage 1-2: per parameter group; stage 3: per sub-group). Its
  gradient copies and its copy of the fp32 partition back into the model's partition run in
  the ZeRO optimizer around that call, so they are not timed either. (DeepSpeed's own
  ``optimizer_step`` timer would include that copy back; hence the wrapper.)

Each rank process runs one policy, so patching a class there touches no other run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# zerokern's offload rows beside the plain one (zero_policies.build:
# "zk_stage{2,3}_offload_<variant>"): compressed state (fp32 master, the moments in bf16 or
# int8 at format version 2 or 3), and "sync": the collectives synchronous, so that no gather
# of updated parameters runs on the rank's communication threads during the host step (by
# default each bucket's gather overlaps the next bucket's update).
OFFLOAD_VARIANTS: dict[str, dict[str, Any]] = {
    "bf16": {"moments": "bf16"},
    "int8": {"moments": "int8", "int8_format": 2},
    "int8v3": {"moments": "int8", "int8_format": 3},
    "sync": {"overlap_comm": False},
}


class HostStepTimer:
    """Wall and CPU seconds, and elements, of the host step's calls since the last ``take``.

    The CPU clock is the calling thread's CPU time (``time.thread_time``). The update runs on
    that thread alone when the rank has one thread: bench_offload's CPU ranks call
    ``torch.set_num_threads(1)``, and both kernels take their OpenMP threads from torch's
    runtime (zerokern's ``_C`` and DeepSpeed's ``cpu_adam`` op resolve ``libgomp.so.1`` to
    the one libtorch loaded). On a machine shared with other work it leaves out the time
    slices other processes (and this rank's own communication threads) take; the wall clock
    keeps them. With more threads per rank only the wall clock means anything."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0
        self.numel = self.calls = 0

    def call(self, fn: Callable[..., Any], numel: int, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, timed, counted as one call updating ``numel`` elements."""
        w0, c0 = time.perf_counter(), time.thread_time()
        out = fn(*args, **kwargs)
        self.cpu += time.thread_time() - c0
        self.wall += time.perf_counter() - w0
        self.numel += numel
        self.calls += 1
        return out

    def take(self) -> tuple[float, float, int]:
        """(wall s, CPU s, elements) of this training step's host update, then zero again."""
        out = (self.wall, self.cpu, self.numel)
        self.wall = self.cpu = 0.0
        self.numel = self.calls = 0
        return out


def time_zerokern() -> HostStepTimer | None:
    """Time every kernel zerokern's offload placement runs in this process. None where the
    tree has no ``OnHost`` placement (an older checkout): its rows then have no host step."""
    try:
        from zerokern.zero.placement import OnHost
    except ImportError:
        return None
    timer = HostStepTimer()
    step = OnHost.step

    def timed_step(
        self: Any, chunk: int, values: Any, dst: Any, kernel: Callable[[Any], None]
    ) -> None:
        def timed(lp: Any) -> None:
            timer.call(kernel, values.numel(), lp)

        step(self, chunk, values, dst, timed)

    OnHost.step = timed_step  # type: ignore[method-assign]
    return timer


def time_deepspeed(zero_optimizer: Any) -> HostStepTimer | None:
    """Time ``DeepSpeedCPUAdam.step`` on the instance ``zero_optimizer`` (what
    ``deepspeed.initialize`` returned) steps with. None when that is not a DeepSpeedCPUAdam."""
    inner = getattr(zero_optimizer, "optimizer", None)
    if inner is None or type(inner).__name__ != "DeepSpeedCPUAdam":
        return None
    timer = HostStepTimer()
    step = inner.step

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        # What this call updates: the partitions its ZeRO optimizer has put in param_groups
        # for it (those with a gradient: DeepSpeedCPUAdam skips the others).
        n = sum(p.numel() for g in inner.param_groups for p in g["params"] if p.grad is not None)
        return timer.call(step, n, *args, **kwargs)

    inner.step = timed_step
    return timer
