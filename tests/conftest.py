import os

import pytest
import torch

# Keep intra-op threads at 2 so multi-process tests do not oversubscribe the CI's cores.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
