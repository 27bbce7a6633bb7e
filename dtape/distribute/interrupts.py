"""How a step is stopped: `StepAborted` in the replicas, and updates that Ctrl-C cannot split.

A leaf module (standard library only), so that the step machinery
(`mirrored_run`) and the modules it drives (`cross_device_ops`, `values`,
`distribute_lib`) can all raise and use these without importing each other.
"""
import signal
import threading

# The C functions behind `signal.getsignal/signal`: the same handlers, without the enum conversions that
# make those 8-11 us a call (a section swaps and restores a handler at every optimizer step).
import _signal


class StepAborted(BaseException):
    """Raised inside replicas whose step was ended by another replica's failure, a timeout or an interrupt."""


# The stop signals whose Python handlers `uninterrupted` holds back: Ctrl-C's KeyboardInterrupt, and a
# SIGTERM handler that raises (SystemExit). A signal left at SIG_DFL/SIG_IGN runs no Python code.
_DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Deferral:
    """The main thread's open `uninterrupted` sections (only the main thread runs signal handlers)."""

    depth = 0
    previous = {}   # signal number -> the handler `_hold` replaced, until it is restored
    pending = []    # [(signal number, frame)] that arrived inside a section, in order


def _hold(signum, frame):
    """The handler inside a section: records the signal. Outside one (left installed by an exception
    between two restores) it is the handler it replaced."""
    if _Deferral.depth:
        _Deferral.pending.append((signum, frame))
        return
    handler = _Deferral.previous.get(signum)
    if callable(handler):
        handler(signum, frame)


class uninterrupted:
    """A section that a signal handler's exception (Ctrl-C's KeyboardInterrupt) cannot split.

    Writes to every component of a mirrored variable, or an optimizer's
    update of every variable, run inside one: a KeyboardInterrupt that
    arrives meanwhile is raised when the section ends, after the last write,
    so the components never end up different. On the main thread the
    Python handlers of SIGINT and SIGTERM are swapped for one that records
    the signal, then restored, and the recorded signals handed to them in
    arrival order, on exit; a handler that code inside the section installs
    stays installed. On other threads (which never run signal
    handlers) and in nested sections it does nothing. Keep the section
    short: it is how long Ctrl-C may wait.

    Example:
      >>> with uninterrupted():
      ...     for component in variable.values:
      ...         component.assign(value)
    """

    __slots__ = ("_active", "_main")

    def __enter__(self):
        self._main = threading.current_thread() is threading.main_thread()
        self._active = False
        if not self._main:
            return self
        _Deferral.depth += 1
        self._active = _Deferral.depth == 1
        if self._active:
            try:
                for s in _DEFERRED_SIGNALS:
                    handler = _signal.getsignal(s)
                    if handler is not _hold:  # else: still _hold from an interrupted restore
                        _Deferral.previous[s] = handler
                    if callable(_Deferral.previous.get(s)):
                        _signal.signal(s, _hold)
            except BaseException:  # e.g. a SIGTERM handler that raised before its turn: undo
                self.__exit__(None, None, None)
                raise
        return self

    def __exit__(self, *exc):
        if not self._main:
            return False
        _Deferral.depth -= 1
        if not self._active:
            return False
        previous = _Deferral.previous
        held_for = {}  # signal -> the handler it was held for, where code in the section installed another
        for s in list(previous):
            if callable(previous[s]):
                if _signal.getsignal(s) is _hold:
                    _signal.signal(s, previous[s])
                else:  # a handler installed inside the section stays, as it would without the section
                    held_for[s] = previous[s]
            del previous[s]
        pending, _Deferral.pending = _Deferral.pending, []
        for signum, frame in pending:  # a handler that raises ends the replay, as it would end the code
            # a signal goes to the handler in force when it arrived (its replacement gets later ones)
            handler = held_for.get(signum) or _signal.getsignal(signum)
            if callable(handler):
                handler(signum, frame)
        return False


__all__ = ["StepAborted", "uninterrupted"]
