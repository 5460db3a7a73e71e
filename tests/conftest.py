import os
from pathlib import Path

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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    # The Triton kernel tests run their interpreter and sm_90 compile scripts in
    # subprocesses: start them now, in the background, rather than when their first test
    # comes up.
    for item in session.items:
        mod = getattr(item, "module", None)
        if mod is not None and mod.__name__.rpartition(".")[2].startswith("test_triton_"):
            try:
                import triton  # noqa: F401
            except ImportError:
                return
            # Under pytest-xdist every worker collects every test: the workers share the
            # scripts through a folder beside their own temporary folders (the run's).
            shared = None
            if os.environ.get("PYTEST_XDIST_WORKER") and session.config.option.basetemp:
                shared = Path(session.config.option.basetemp).parent / "triton-scripts"
            mod.start_scripts(session.items, shared)
            return
