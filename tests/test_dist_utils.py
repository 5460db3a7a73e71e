"""The rank pool of dist_utils: a failing rank is reported with its traceback, a rank left
blocked by a peer's failure is stopped after the grace period, and the next case gets a
working pool again."""

from __future__ import annotations

import dist_utils
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks


def fail_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one fails on purpose")
    t = torch.ones(4)
    dist.all_reduce(t)  # never completes: rank 1 does not join


def sums(rank: int, world: int) -> None:
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    assert t.tolist() == [world * (world + 1) / 2] * 3


def test_failure_is_reported_and_pool_recovers(tmp_path, monkeypatch):
    run_ranks(2, sums, tmp_path=tmp_path)
    monkeypatch.setattr(dist_utils, "GRACE_S", 1.0)
    with pytest.raises(AssertionError) as info:
        run_ranks(2, fail_on_one, tmp_path=tmp_path)
    msg = str(info.value)
    assert "rank one fails on purpose" in msg and "--- rank 1 ---" in msg
    assert "rank 0 did not finish" in msg
    run_ranks(2, sums, tmp_path=tmp_path)  # a fresh pool


def test_isolated_case(tmp_path):
    # World 2: the size whose shared pool the other tests (and the one above) leave running,
    # so the isolated ranks are formed beside a live pool of the same key.
    before = dist_utils._POOLS.get((2, "gloo"))
    run_ranks(2, sums, tmp_path=tmp_path, isolated=True)
    assert dist_utils._POOLS.get((2, "gloo")) is before  # the shared pool is not touched
