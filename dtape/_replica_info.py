"""What the core may ask about distribution, without importing `dtape.distribute`.

`dtape.distribute` answers through functions registered once, at package
import (`dtape/__init__.py`); until then the answers are those of the default
strategy (one replica, no cross-replica context). Used by `dtape.nn`
(compute_average_loss), `dtape.layers` (synchronized BatchNormalization).
"""

_hooks = {}  # name -> function; process-wide, filled once at import


def register(get_replica_context, in_cross_replica_context, has_strategy):
    """Installs dtape.distribute's context functions (once per process).

    Raises:
      RuntimeError: if already registered.
    """
    if _hooks:
        raise RuntimeError("replica-info hooks are already registered; register them only once")
    _hooks.update(get_replica_context=get_replica_context, in_cross_replica_context=in_cross_replica_context,
                  has_strategy=has_strategy)


def replica_context():
    """The current ReplicaContext (the default strategy's outside any strategy); None in a cross-replica context."""
    fn = _hooks.get("get_replica_context")
    return fn() if fn else None


def in_cross_replica_context():
    """True inside a strategy's scope (outside `run`) or a merge_call."""
    fn = _hooks.get("in_cross_replica_context")
    return bool(fn()) if fn else False


def has_strategy():
    """True inside a non-default strategy's scope or replica function."""
    fn = _hooks.get("has_strategy")
    return bool(fn()) if fn else False


def num_replicas_in_sync():
    """Replicas of the current replica context (1 outside any strategy or without a context)."""
    ctx = replica_context()
    return 1 if ctx is None else int(ctx.num_replicas_in_sync)
