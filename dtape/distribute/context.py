"""The distribution context: a thread-local stack of modes.

Exactly one of these holds on a thread at any time:
  1. Outside any strategy: the default strategy, in its replica context
     (one replica): `get_replica_context()` is a ReplicaContext,
     `in_cross_replica_context()` is False.
  2. Inside `strategy.scope()` (and not inside `run`): the cross-replica
     context: `get_replica_context()` is None, `in_cross_replica_context()`
     is True.
  3. Inside the function given to `strategy.run`, on that replica's thread:
     a replica context of `strategy`.
`merge_call` re-enters (2) for the duration of `merge_fn`; `extended.update`
adds an update index so distributed variables resolve to one component.

Source: tensorflow/python/distribute/distribution_strategy_context.py.
"""
import threading

from dtape._local import ThreadLocalScope
from dtape.variables import tracing_body


class Mode:
    __slots__ = ("strategy", "replica_context", "update_index")

    def __init__(self, strategy, replica_context, update_index=None):
        self.strategy = strategy
        self.replica_context = replica_context
        self.update_index = update_index


class _ContextState(threading.local):
    """Per-thread stack of Mode (innermost last)."""

    stack = ()


_state = _ContextState()

# Process-wide, set once by distribute_lib at import: () -> default Mode.
_default_mode_factory = None


def register_default_mode_factory(factory):
    """Installs the factory of the default (no strategy) mode; once per process."""
    global _default_mode_factory
    if _default_mode_factory is not None:
        raise RuntimeError("default distribution mode registered twice")
    _default_mode_factory = factory


def current_mode():
    stack = _state.stack
    return stack[-1] if stack else _default_mode_factory()


def get_strategy():
    """The current strategy: the one whose scope or run we are in, else the default strategy."""
    return current_mode().strategy


def has_strategy():
    """True inside a non-default strategy's scope or replica function."""
    return not getattr(current_mode().strategy, "_is_default", False)


def in_cross_replica_context():
    """True inside `strategy.scope()` or a `merge_call` function; False in a replica context."""
    return current_mode().replica_context is None


def get_replica_context():
    """The current ReplicaContext, or None in the cross-replica context."""
    return current_mode().replica_context


def update_index():
    """The component index inside `extended.update`, else None."""
    return current_mode().update_index


class enter_mode(ThreadLocalScope):
    """Thread-local: pushes a mode on this thread's stack; pops it on exit. `as` gives the mode."""

    __slots__ = ()
    _state = _state
    _attr = "stack"

    def __init__(self, strategy, replica_context, update_index=None):
        super().__init__(Mode(strategy, replica_context, update_index))

    def _new(self, prev):
        return prev + (self._value,)

    def __enter__(self):
        super().__enter__()
        return self._value


def current_stack():
    """This thread's mode stack (replica threads start from the caller's)."""
    return _state.stack


class set_stack(ThreadLocalScope):
    """Thread-local: replaces this thread's stack, restoring it on exit."""

    __slots__ = ()
    _state = _state
    _attr = "stack"


def refuse_in_traced_body(what, instead):
    """Raises RuntimeError if a compiled `dtape.function` is tracing its body on this thread: `what` (a
    rendezvous of replica threads, or a step of several replicas) cannot be a graph op; `instead` says what to do."""
    if tracing_body():
        raise RuntimeError(f"{what} inside a compiled dtape.function (jit_compile=True) being traced: a graph "
                           f"cannot hold a rendezvous of the replicas; {instead}")


def refuse_merge_call_in_traced_body(merge_fn):
    """`refuse_in_traced_body` for a merge_call of several replicas, saying what a compiled step can do instead."""
    refuse_in_traced_body(
        f"merge_call({getattr(merge_fn, '__name__', 'merge_fn')})",
        "what needs the cross-replica context in a replica step (a MirroredVariable assign from a replica, "
        "ReplicaContext.all_reduce/all_gather, a LossScaleOptimizer's update) must run eagerly: call this step "
        "with jit_compile=False (a step given to strategy.run inside a compiled function is compiled with it: "
        "make that function jit_compile=False). A compiled step may sum across replicas with "
        "torch.ops.dtape.all_reduce_sum, and a plain dtape optimizer's apply_gradients reduces with it by itself")
