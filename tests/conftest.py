import sys

import pytest
import torch


@pytest.fixture
def fast_switching():
    """Forces frequent thread switches (sys.setswitchinterval(1e-6)) so races show on a GIL build."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
