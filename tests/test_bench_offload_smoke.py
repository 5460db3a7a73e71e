"""bench/bench_offload.py's host-step columns (issue 39), in this process, without spawning
ranks or needing DeepSpeed: the timer of zerokern's offload rows sees every element of the
shard once per training step (one rank, the quick GPT, fp32 and int8 v3 moments), the
DeepSpeed timer counts what ``DeepSpeedCPUAdam.step`` is given (a stand-in class of that
name), the ranks' host times combine as the step times do, and the summary's "x DeepSpeed"
is DeepSpeed's ns per element over zerokern's at the same stage, overall and per repeat.
No timing is asserted."""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_offload  # noqa: E402
from gpt import GPT, GPTConfig, batch  # noqa: E402
from host_step import time_deepspeed  # noqa: E402
from zero_policies import Job, build  # noqa: E402
from zero_ranks import combine  # noqa: E402

from zerokern.zero.placement import OnHost  # noqa: E402


@pytest.mark.parametrize("policy", ["zk_stage2_offload", "zk_stage2_offload_int8v3"])
def test_zerokern_host_step_timer(policy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # time_zerokern patches OnHost.step for the process (a rank's, in the bench): monkeypatch
    # puts the original back after this test.
    monkeypatch.setattr(OnHost, "step", OnHost.step)
    q = bench_offload.QUICK
    cfg: GPTConfig = q["cfg"]
    job = Job(policy, "fp32", "cpu", asdict(cfg), q["micro_batch"], 3, 0, 1, "", "")
    s = build(job, torch.device("cpu"))
    assert s.host_timer is not None
    if policy.endswith("int8v3"):
        assert "moments=int8, int8_format=3" in s.optim
    params = sum(p.numel() for p in GPT(cfg).parameters())
    for step in range(1, 4):
        x, y = batch(step, 0, q["micro_batch"], cfg.seq, cfg.vocab)
        s.step(x, y)
        calls = s.host_timer.calls
        wall, cpu, numel = s.host_timer.take()
        assert calls >= 1 and wall > 0 and cpu > 0
        if policy == "zk_stage2_offload":
            assert numel == params  # one rank: the whole model, each element once
        else:  # the compressed state's runs start on 256-element blocks of each parameter
            n_tensors = len(list(GPT(cfg).parameters()))
            assert params <= numel < params + 256 * n_tensors
        assert s.host_timer.take() == (0.0, 0.0, 0)


def test_deepspeed_host_step_timer() -> None:
    """The wrapper counts the elements of the params given (those with a gradient) per call,
    passes the call through, and refuses any other optimizer class."""

    class DeepSpeedCPUAdam:  # the name time_deepspeed checks, not DeepSpeed's class
        def __init__(self) -> None:
            a, b = torch.zeros(10, requires_grad=True), torch.zeros(7, requires_grad=True)
            a.grad = torch.ones(10)
            self.param_groups = [{"params": [a, b]}]
            self.steps = 0

        def step(self) -> str:
            self.steps += 1
            return "done"

    class Zero:
        optimizer = DeepSpeedCPUAdam()

    timer = time_deepspeed(Zero())
    assert timer is not None
    assert Zero.optimizer.step() == "done" and Zero.optimizer.step() == "done"
    assert Zero.optimizer.steps == 2 and timer.calls == 2
    assert timer.take()[2] == 20

    class Other:
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)

    assert time_deepspeed(Other()) is None


def _rank(times: list[float], host: list[float], numel: int) -> dict[str, Any]:
    return {"times": times, "losses": [1.0] * len(times), "optim": "o", "host_times": host,
            "host_cpu_times": [t / 2 for t in host], "host_numel": numel}


def test_combine_and_summary_host_columns() -> None:
    # combine: per step the slowest rank, the median of steps 3..; the larger rank's shard.
    row = combine([_rank([1, 1, 1, 1, 1], [9, 9, 0.001, 0.004, 0.002], 100),
                   _rank([1, 1, 1, 1, 1], [9, 9, 0.003, 0.001, 0.003], 104)], 5)
    assert row["host_step_ms"] == pytest.approx(3.0)
    assert row["host_numel"] == 104
    assert row["host_ns_per_elt"] == pytest.approx(3.0e6 / 104)
    assert row["host_cpu_step_ms"] == pytest.approx(1.5)  # the CPU clock, combined alike
    assert "host_step_ms" not in combine([{k: v for k, v in _rank([1] * 3, [1] * 3, 1).items()
                                           if not k.startswith("host")}], 3)

    def run(pol: str, rep: int, ms: float, numel: int) -> dict[str, Any]:
        return {"policy": pol, "repeat": rep, "status": "ok", "step_ms": 10.0, "device_mb": 1.0,
                "host_mb": 1.0, "loss": 1.0, "optim": pol, "host_step_ms": ms,
                "host_cpu_step_ms": ms / 2, "host_numel": numel}

    rows = [run("zk_stage2_offload", 1, 2.0, 1000), run("ds_stage2_offload", 1, 3.0, 1000),
            run("zk_stage2_offload_int8v3", 1, 4.0, 1024), run("zk_stage3_offload", 1, 1.0, 10),
            run("zk_stage2_offload", 2, 4.0, 1000), run("ds_stage2_offload", 2, 5.0, 1000),
            run("zk_stage2_offload_int8v3", 2, 5.0, 1024), run("zk_stage3_offload", 2, 1.0, 10)]
    by = {r["policy"]: r for r in bench_offload.summarize(rows)}
    zk, ds, v3 = by["zk_stage2_offload"], by["ds_stage2_offload"], by["zk_stage2_offload_int8v3"]
    assert zk["host_step_ms"] == 3.0 and ds["host_step_ms"] == 4.0
    assert zk["x_host_vs_ds"] == pytest.approx(4.0 / 3.0) and zk["vs_ds"] == "ds_stage2_offload"
    assert zk["x_host_vs_ds_runs"] == "1.50 / 1.25"
    # the CPU clock's columns alike (each CPU time here is half the wall time)
    assert zk["host_cpu_step_ms"] == 1.5 and zk["x_host_cpu_vs_ds"] == pytest.approx(4.0 / 3.0)
    assert zk["x_host_cpu_vs_ds_runs"] == "1.50 / 1.25"
    # on a larger shard the ratio is per element: (4.0 / 1000) / (4.5 / 1024)
    assert v3["x_host_vs_ds"] == pytest.approx((4.0 / 1000) / (4.5 / 1024))
    assert [float(x) for x in v3["x_host_vs_ds_runs"].split(" / ")] == pytest.approx(
        [(3.0 / 1000) / (4.0 / 1024), (5.0 / 1000) / (5.0 / 1024)], abs=5e-3)
    assert "x_host_vs_ds" not in ds and "x_host_vs_ds" not in by["zk_stage3_offload"]
    table = bench_offload.markdown(list(by.values()), "h", bench_offload.HOST_COLS)
    assert "| CPU ns/element | x DeepSpeed |" in table
    assert f"| {statistics.median([2.0, 4.0]):.2f} |" in table
