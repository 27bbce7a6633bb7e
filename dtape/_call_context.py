"""The `training` mode of the layer calls in progress on this thread (Keras's call context).

Layer 0 (stdlib only). A layer call enters `training_scope(value)` with the
value it resolved; layers (and `TorchModule`s) called inside it, however
deep and through whatever plain Python or `Module.__call__` in between, then
resolve a `training` they were not given to that value. Per thread: replica
threads start from the value of the thread that called `strategy.run` (the
strategy carries it) and never see another thread's.
Source: tf.keras's base_layer_utils.CallContext (TF 2) / keras.src.backend.common.global_state call context.
"""
import threading

from dtape._local import ThreadLocalScope


class _State(threading.local):
    training = None  # None: no enclosing call chose a mode


_state = _State()


def current_training():
    """The mode of the innermost layer call in progress on this thread: True, False or None (none chose one)."""
    return _state.training


def resolve_training(explicit, default):
    """A call's `training`: `explicit` if not None, else the enclosing call's, else `default`.

    Keras's precedence (TF 2 base_layer `_set_training_mode`): an argument
    given to this call, then the mode of an outer layer call, then the
    default of the layer's `call` signature (None there means inference
    for dtape's layers, as Keras's learning phase 0).
    """
    if explicit is not None:
        return explicit if isinstance(explicit, bool) else bool(explicit)
    outer = _state.training
    return default if outer is None else outer


class training_scope(ThreadLocalScope):
    """Sets this thread's call-context mode inside the block (None: as if no call were in progress)."""

    __slots__ = ()
    _state = _state
    _attr = "training"


__all__ = ["current_training", "resolve_training", "training_scope"]
