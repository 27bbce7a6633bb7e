"""Checkpoint values waiting for variables that do not exist yet (TF's deferred restoration).

A checkpoint restored into an object that has not created all its variables
(an optimizer before its first step creates its slots, a layer before its
first call) leaves the rest here; code that creates variables calls
`variables_created(owner)` right after creating them and before using them, and
each waiting restoration assigns the values whose variables now exist.

Layer 0 (stdlib only): the optimizers and layers call it, dtape.checkpoint
registers; neither needs to know the other.
"""
import threading

_lock = threading.Lock()
_waiting = []   # callables fn(owner) -> True once finished (all assigned, or the object is gone)


def wait(fn):
    """Registers `fn`, called by every later `variables_created(owner)` until it returns True."""
    with _lock:
        _waiting.append(fn)


def variables_created(owner):
    """Runs the waiting restorations; each assigns the values whose variables now exist.

    `owner` is the object that created the variables (the optimizer, the
    layer): a restoration whose object grew without being (or containing)
    the owner refuses, since the new variables may have been used already.

    Called without the lock held (a restoration may wait for other threads);
    an error raised by one (a name or shape that does not match) propagates
    to the code creating the variables, before they are used, and that
    restoration is dropped (asked again, it would fail every later step).
    """
    if not _waiting:        # the common case, once per optimizer step: one list check
        return
    with _lock:
        pending = list(_waiting)
    finished, error = [], None
    for fn in pending:          # every one, even after an error: each must see the variables announced now
        try:
            done = fn(owner)
        except Exception as e:  # noqa: BLE001 - the first is raised below, once the others have run
            done, error = True, error or e
        if done:
            finished.append(fn)
    with _lock:
        _waiting[:] = [fn for fn in _waiting if not any(fn is f for f in finished)]
    if error is not None:
        raise error
