import sys

import pytest
import torch

import _strategies


@pytest.fixture
def fast_switching():
    """Forces frequent thread switches (sys.setswitchinterval(1e-6)) so races show on a GIL build."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


@pytest.fixture
def closes_strategies(fast_switching):
    """Closes the strategies `_strategies.mirrored` made during the test (with forced thread switches)."""
    try:
        yield
    finally:
        _strategies.close_all()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
