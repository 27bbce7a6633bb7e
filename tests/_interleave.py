"""Forced thread interleaving for concurrency tests (GIL builds included).

`sys.setswitchinterval(1e-6)` asks for a switch every microsecond, but on a
loaded machine the GIL changes hands only every few milliseconds, and mostly
where torch kernels release it. `interleaved(seed, p)` also installs a
profile hook on threads started inside it that yields the GIL (sleep(0))
after a random fraction `p` of C calls, so another thread can run between
almost any two steps of a compound update. Seeded: a schedule can be replayed.
"""
import contextlib
import random
import sys
import threading
import time


@contextlib.contextmanager
def interleaved(seed=0, p=0.3):
    rnd = random.Random(seed)

    def yielder(frame, event, arg):
        if event == "c_return" and rnd.random() < p:
            time.sleep(0)

    old_interval, old_profile = sys.getswitchinterval(), threading.getprofile()
    sys.setswitchinterval(1e-6)
    threading.setprofile(yielder)
    try:
        yield
    finally:
        threading.setprofile(old_profile)
        sys.setswitchinterval(old_interval)


def run_threads(targets, timeout):
    """Runs each target on its own thread; joins each within `timeout` s; re-raises the first error.

    Raises:
      AssertionError: a thread did not finish in time (a hang, not a silent pass).
    """
    errors = []

    def guarded(fn):
        def run():
            try:
                fn()
            except BaseException as e:  # reported on the main thread
                errors.append(e)
        return run

    threads = [threading.Thread(target=guarded(t), daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a thread did not finish in time"
    if errors:
        raise errors[0]
