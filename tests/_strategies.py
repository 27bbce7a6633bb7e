"""MirroredStrategy on CPU devices for tests, closed after the test that made it (its replica threads stop).

Use `mirrored(n)` in a module marked `pytest.mark.usefixtures("closes_strategies")` (tests/conftest.py),
which also forces frequent thread switches.
"""
from dtape.distribute import MirroredStrategy

_made = []  # strategies made by the current test


def mirrored(n=2):
    """MirroredStrategy(["cpu:0", ..., "cpu:{n-1}"], timeout=60), closed after the test: a generous timeout, so a loaded machine does not fail a test that is not about timeouts (those set their own)."""
    _made.append(MirroredStrategy([f"cpu:{i}" for i in range(n)], timeout=60))
    return _made[-1]


def close_all():
    while _made:
        _made.pop().close()
