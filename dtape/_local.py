"""One way to swap a thread-local setting for the duration of a `with` block.

Layer 0 (stdlib only). Every thread-local scope in dtape (stop flag, paused
tapes, device, generator, distribution mode stack, creator stack) is a
`ThreadLocalScope`: it saves the previous value on entry and restores it on
exit, also on exceptions, so scopes nest.
"""


class ThreadLocalScope:
    """Sets `state.<attr>` on this thread inside the block; restores the previous value on exit.

    Subclasses set `_state` and `_attr` as class attributes and may override
    `_new(prev)` to derive the new value from the previous one (e.g. push on
    a tuple stack). Thread-local: other threads are not affected.
    """

    __slots__ = ("_value", "_prev")
    _state = None
    _attr = None

    def __init__(self, value=None):
        self._value = value

    def _new(self, prev):
        return self._value

    def __enter__(self):
        state, attr = self._state, self._attr
        self._prev = getattr(state, attr)
        setattr(state, attr, self._new(self._prev))
        return self

    def __exit__(self, *exc):
        setattr(self._state, self._attr, self._prev)
        return False


__all__ = ["ThreadLocalScope"]
