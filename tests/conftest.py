import os

import pytest
import torch


def _test_threads(default: int) -> int:
    return int(os.environ.get("ZEROKERN_TEST_THREADS", 0)) or default


# One intra-op thread in this process: the in-process tests run tiny ops, where a second
# OpenMP thread costs more than it saves (a fork and a join per op; with any other process
# busy on the CI's 2 cores, a wait for the scheduler each: up to 7-25x slower). The tests of
# the kernels' OpenMP split take two (``two_threads``). ZEROKERN_TEST_THREADS=N sets N for
# every test (N=1: a check that no test depends on the thread count).
torch.set_num_threads(_test_threads(1))


@pytest.fixture
def two_threads():
    """Intra-op threads for a test of the CPU kernels' OpenMP split (the range cut between
    threads): min(2, cores), or ZEROKERN_TEST_THREADS; the count before is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(_test_threads(min(2, os.cpu_count() or 1)))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def exit_zygote():
    """tests/exit_zygote.py, started once for the session: test_exit.py's cases and
    test_told_not_hung.py's evaluation-on-rank-0 case fork their ranks from it (one import of
    torch for all of them)."""
    from exit_launch import Zygote

    z = Zygote()
    yield z
    z.close()


# First: xdist's worker reads the xdist_group marks in its own hook of this name.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    _group_for_workers(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _group_for_workers(items) -> None:
    """Under pytest-xdist (scripts/test.sh runs ``-n 2 --dist loadgroup``), keep on one worker
    the tests that share something built once per process, so it is built once, not once per
    worker: a Triton script mode's tests (one subprocess serves them all), the tests of a
    session-scoped fixture of ours (exit_zygote) and each module with a module- or
    class-scoped fixture (a compile, a training run). Every other test goes wherever a worker
    is free. Without xdist the mark is inert."""
    from triton_common import FIXTURE_MODES

    for item in items:
        names = getattr(item, "fixturenames", ())
        group = next((f"triton-{FIXTURE_MODES[n]}" for n in names if n in FIXTURE_MODES), None)
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if group is None:
            # pytest's own session fixtures (tmp_path_factory, ...) have an empty baseid
            group = next((f"fixture-{n}" for n, fd in defs.items()
                          if fd[-1].scope == "session" and fd[-1].baseid), None)
        if group is None and any(fd[-1].scope in ("module", "class") for fd in defs.values()):
            group = item.nodeid.split("::", 1)[0]
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_finish(session):
    # The Triton kernel tests run their interpreter and sm_90 compile scripts in
    # subprocesses: start them now, in the background, rather than when their first test
    # comes up. Not under pytest-xdist: each worker collects every test, and the scripts'
    # tests run on whichever worker gets their group, which starts them when it gets there.
    for item in session.items:
        mod = getattr(item, "module", None)
        if mod is not None and mod.__name__.rpartition(".")[2].startswith("test_triton_"):
            try:
                import triton  # noqa: F401
            except ImportError:
                return
            from triton_common import plan_scripts, start_scripts

            if os.environ.get("PYTEST_XDIST_WORKER"):
                plan_scripts(session.items)
            else:
                start_scripts(session.items)
            return
