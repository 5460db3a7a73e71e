import os

import pytest
import torch

# Keep intra-op threads at 2 so multi-process tests do not oversubscribe the CI's cores.
# ZEROKERN_TEST_THREADS=1 runs the suite single-threaded (a check that no test depends on the
# thread count: another machine has other cores).
torch.set_num_threads(int(os.environ.get("ZEROKERN_TEST_THREADS", 0))
                      or min(2, os.cpu_count() or 1))


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
            mod.start_scripts(session.items)
            return
