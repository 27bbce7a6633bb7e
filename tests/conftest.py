import signal
import sys
import time

import pytest
import torch

import _strategies
from dtape import tape as _tp

# How long a test's leftover threads (a replica abandoned by a timeout test, still leaving its job)
# may keep a tape in the process-global set before the next test starts.
_LEFTOVER_TAPES_WAIT_S = 30.0

# A shell starts background jobs with SIGINT ignored, and Python then keeps it ignored: the Ctrl-C tests
# (and the children they start, which inherit the disposition) would see no KeyboardInterrupt. Python's own
# handler restores what a foreground run has; children get the default disposition back on exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def no_tape_left_active():
    """Waits, bounded, until no tape is active before the next test runs.

    The tape set is global to the process: a tape still open on a thread a
    test abandoned would make the next test's walks recorded walks (another
    code path) on a loaded machine, where that thread takes longer to leave.
    """
    yield
    deadline = time.monotonic() + _LEFTOVER_TAPES_WAIT_S
    while _tp.active_tapes and time.monotonic() < deadline:
        time.sleep(0.01)


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
