"""Every process of a ZeroAdamW script exits with status 0, however the script ends: 2-rank
runs of tests/exit_case.py for stages 0-3 that end with destroy_process_group() (and no
gc.collect()), without it, with the model and optimizer alive at exit, after a caught
exception, and after a backward with no step. The abort these guard against was a race (a
few runs in a hundred per case before the fix): one run per case here would rarely catch its
return, a second one hardly more often, so each runs once and scripts/stress_exit.sh N runs
each N times (the stress test of a change to the exit path). The ranks are forked from a
process that imported torch once (tests/exit_zygote.py) and each leaves through a normal
interpreter exit."""

from __future__ import annotations

import pytest

CASES = [(stage, mode, 0) for stage in (0, 1, 2, 3)
         for mode in ("destroy", "nodestroy", "alive", "exception", "nostep")]


@pytest.mark.parametrize("stage,mode,rep", CASES)
def test_exit_clean(exit_zygote, stage, mode, rep):
    res = exit_zygote.run_case(stage, mode)
    bad = [(r, rc, err) for r, (rc, err) in enumerate(res) if rc != 0]
    assert not bad, "\n".join(f"rank {r} exited {rc}:\n{err}" for r, rc, err in bad)
