"""MirroredStrategy: synchronous data parallelism, one thread per replica device.

Source: tf.distribute.MirroredStrategy.
"""
import re
import weakref

import torch

from dtape import _config, _jit
from dtape.torch_module import check_torch_writes_in_run, follow_torch_writes
from dtape import tape as _tp
from dtape.distribute import context, mirrored_run, replica_scope
from dtape.distribute.distribute_lib import Strategy, StrategyExtended
from dtape.distribute.values import MirroredVariable, PerReplica, SyncOnReadVariable, regroup, select_replica
from dtape.tensor import normalize_device
from dtape.variables import VariableSynchronization


# torch keeps a device index in 8 bits: 'cpu:128' would silently become 'cpu:-128'
_MAX_DEVICE_INDEX = 127


def _validate_devices(devices):
    """The replicas' device names in canonical form ('cpu:N', 'cuda:N'), distinct and available."""
    if devices is None:
        n = torch.cuda.device_count()
        devices = [f"cuda:{i}" for i in range(n)] if n else ["cpu:0"]
    if isinstance(devices, (str, torch.device)):  # as TF: a list of devices, even for one
        raise ValueError(f"MirroredStrategy(devices=...) takes a list of device names, got the single "
                         f"{type(devices).__name__} {str(devices)!r}; pass [{str(devices)!r}]")
    given = [str(d) for d in devices]
    if not given:
        raise ValueError("MirroredStrategy needs at least one device, e.g. devices=['cpu:0', 'cpu:1']")
    devices = [_canonical_device(d) for d in given]
    if len(set(devices)) != len(devices):
        raise ValueError(f"MirroredStrategy devices must be distinct, got {given}, which name {devices}; "
                         "name CPU replicas 'cpu:0', 'cpu:1', ... ('cpu' is 'cpu:0', case does not matter)")
    for d in devices:
        dev = normalize_device(d)
        if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
            raise ValueError(f"device {d!r} is not available ({torch.cuda.device_count()} CUDA devices); "
                             "use 'cpu:0', 'cpu:1', ... to simulate replicas on the CPU")
    return devices


_NAMES = "name devices 'cpu:0', 'cpu:1', ... or 'cuda:0', 'cuda:1', ..."


def _canonical_device(name):
    """'CPU:0', 'cpu' -> 'cpu:0'; 'gpu:1', 'CUDA:1' -> 'cuda:1'; 'cuda' -> the current CUDA device.

    TF's spellings name the same devices: '/cpu:0', '/device:CPU:0',
    '/job:localhost/replica:0/task:0/device:GPU:1' (this process's job,
    replica and task only). Two spellings of one device would otherwise make
    two replicas share it, and a malformed index ('cpu:x') would be taken
    as 'cpu'.
    """
    kind, index = _parse_device(name)
    kind = "cuda" if kind == "gpu" else kind
    if index is not None and not re.fullmatch("[0-9]+", index):
        raise ValueError(f"MirroredStrategy device {name!r} has no valid index (expected a number after "
                         f"'{kind}:'); {_NAMES}")
    if index is not None and int(index) > _MAX_DEVICE_INDEX:
        raise ValueError(f"MirroredStrategy device {name!r}: index {int(index)} is past {_MAX_DEVICE_INDEX}, "
                         f"the largest device index torch holds; {_NAMES}")
    if kind == "cpu":
        return f"cpu:{int(index) if index is not None else 0}"
    try:
        dev = torch.device(f"{kind}:{int(index)}" if index is not None else kind)
    except RuntimeError:
        raise ValueError(f"MirroredStrategy device {name!r} is not a device name; {_NAMES}") from None
    if dev.index is None:
        current = torch.cuda.current_device() if dev.type == "cuda" and torch.cuda.is_available() else 0
        dev = torch.device(dev.type, current)
    return str(dev)


def _parse_device(name):
    """(kind, index or None) of 'cpu:0', 'cuda', or a TF device string ('/job:localhost/replica:0/
    task:0/device:CPU:0', '/device:GPU:1', '/gpu:1'); kind lower-case, index as written."""
    parts = [p for p in name.strip().split("/") if p]
    if not parts:
        raise ValueError(f"MirroredStrategy device {name!r} is not a device name; {_NAMES}")
    found = None
    for part in parts:
        field, sep, value = part.partition(":")
        field = field.lower()
        if sep and field in ("job", "replica", "task"):
            if value != {"job": "localhost"}.get(field, "0"):
                raise ValueError(f"MirroredStrategy device {name!r} names {field} {value!r}: its replicas run in "
                                 "this process (job:localhost, replica:0, task:0); name local devices, e.g. "
                                 "'cpu:0' or 'cuda:1', and use MultiWorkerMirroredStrategy across processes")
            continue
        if field == "device" and sep:  # '/device:CPU:0' -> 'CPU:0'
            field, sep, value = value.partition(":")
            field = field.lower()
        if found is not None or not field:
            raise ValueError(f"MirroredStrategy device {name!r} is not a device name; {_NAMES}")
        found = (field, value if sep else None)
    if found is None:
        raise ValueError(f"MirroredStrategy device {name!r} names no device; {_NAMES}")
    return found


class MirroredStrategy(Strategy):
    """Runs a step on every device at once, with variables mirrored on each.

    Args:
      devices: device names, e.g. ["cuda:0", "cuda:1"], or ["cpu:0", "cpu:1"]
        for replicas simulated as threads on the CPU. Default: every GPU, else one CPU.
        Names are made canonical ('CPU:0', 'cpu' and TF's '/cpu:0',
        '/device:CPU:0', '/job:localhost/replica:0/task:0/device:CPU:0' are
        'cpu:0', 'gpu:1' and '/gpu:1' are 'cuda:1'; `extended.worker_devices`
        holds them) and must be distinct: a ValueError names duplicates,
        malformed names ('cpu:x'), indices past 127, other jobs or tasks,
        and a bare string instead of a list (as TF, always a list).
      timeout: seconds a step may wait on a replica, or a merge_fn may run,
        before TimeoutError (default DTAPE_DISTRIBUTE_TIMEOUT, 300). Finite
        and > 0: NaN, zero, negative and infinity raise ValueError (every
        wait has a timeout; use a large number, e.g. 86400, for slow steps).
        merge_fn runs on the caller's thread and is timed when it returns.
      seed: int in [0, 2**63 - 1] seeding the replicas' random generators:
        replica i draws (dtape.random, nn.dropout, layers.Dropout) from its
        own torch.Generator on its device, seeded from (seed, i), made once
        and never re-seeded across steps. None (default): one seed is drawn
        now from torch's default CPU generator (advancing it by one draw),
        so `torch.manual_seed` before construction fixes every replica's
        stream. Save/restore the streams with get_rng_state/set_rng_state.

    Each replica thread runs inside its device (`dtape.device`), its
    generator (`dtape.random.generator_scope`) and the caller's thread-local
    torch state at `run` time (autocast, grad mode, inference mode).

    Lifecycle: the replica threads start at the first `run`. `close()` (or
    leaving `with MirroredStrategy(...) as strategy:`) stops them, and so
    does garbage collection of the strategy; after `close()`, `run` raises
    RuntimeError (variables, `scope()` and `reduce` keep working). The `with`
    block manages the threads only: it does not enter `scope()`. A replica
    stuck past the timeout is abandoned (its open tapes stop recording) and
    a fresh thread serves the next step. Ctrl-C during `run` raises
    StepAborted in the replicas and KeyboardInterrupt in the caller.

    Example:
      >>> strategy = dtape.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
      >>> with strategy.scope():
      ...     v = dtape.Variable(1.0)            # a MirroredVariable
      >>> strategy.run(lambda: v * 2)           # PerReplica of two tensors
    """

    def __init__(self, devices=None, timeout=None, seed=None):
        devices = _validate_devices(devices)
        super().__init__(StrategyExtended(self, devices))
        self._timeout = _config.DISTRIBUTE_TIMEOUT_S if timeout is None else \
            _config.validate_timeout(timeout, "MirroredStrategy(timeout=...)")
        self._pool = None
        self._stop_pool = None  # weakref.finalize: stops the threads when self is collected
        self._closed = False
        self._generators = replica_scope.ReplicaGenerators(devices, replica_scope.check_seed(seed))

    # -- random state (TF: tf.random.Generator split per replica) ---------------
    def replica_generator(self, replica_id):
        """The torch.Generator replica `replica_id` draws from (on its device; see `seed`)."""
        return self._generators[replica_id]

    def get_rng_state(self):
        """Every replica's generator state: a list of uint8 CPU tensors, one per replica (copies).

        Named after torch.get_rng_state (PyTorch convention for RNG state);
        save it with the model to resume bit-identically. Call it between
        steps, in the cross-replica context.

        Raises:
          RuntimeError: inside `run` (a replica context of this strategy).
        """
        self._check_cross_replica("get_rng_state")
        return self._generators.get_state()

    def set_rng_state(self, states):
        """Restores every replica's generator from a `get_rng_state()` list (all or nothing).

        Raises:
          TypeError: `states` is not a list of uint8 tensors.
          ValueError: a different number of replicas, or a state that does
            not fit its replica's generator (saved on other device types).
          RuntimeError: inside `run`.
        """
        self._check_cross_replica("set_rng_state")
        self._generators.set_state(states)

    def _check_cross_replica(self, what):
        ctx = context.get_replica_context()
        if ctx is not None and ctx.strategy is self:
            raise RuntimeError(f"{what} was called inside strategy.run; call it between steps, "
                               "outside strategy.run")

    def _create_variable(self, next_creator, **kwargs):
        ctx = context.get_replica_context()
        if ctx is not None and ctx.strategy is self:
            # Created inside `run` (e.g. a layer's lazy build): every replica
            # reaches this point; one merge_call makes one variable for all.
            # A callable initial value (layers pass one) is called there once,
            # on the caller's thread and generator, so the value does not
            # depend on how the replica threads were scheduled.
            return ctx.merge_call(_create_in_merge, args=(next_creator,), kwargs=kwargs)
        return self._create_mirrored(next_creator, **kwargs)

    def _create_mirrored(self, next_creator, **kwargs):
        init = kwargs["initial_value"]
        if callable(init):
            with _tp.stop_recording():
                init = init()
        sync = kwargs.get("synchronization")
        name = kwargs.get("name") or "Variable"
        components = []
        for i, device in enumerate(self.extended.worker_devices):
            kw = dict(kwargs, initial_value=init, device=normalize_device(device), name=f"{name}/replica_{i}")
            if i > 0:
                kw["initial_value"] = components[0]
            components.append(next_creator(**kw))
        cls = SyncOnReadVariable if sync == VariableSynchronization.ON_READ else MirroredVariable
        return cls(self, components, kwargs.get("aggregation"))

    def _replica_threads(self):
        """The replica threads (a ReplicaPool), started on first use."""
        if self._closed:
            raise RuntimeError("this MirroredStrategy was closed; create a new strategy to run more steps")
        if self._pool is None:
            self._pool = mirrored_run.ReplicaPool(self.extended.worker_devices)
            self._stop_pool = weakref.finalize(self, self._pool.stop)  # the pool never references self
        return self._pool

    def close(self):
        """Stops the replica threads; idempotent. Later `run` calls raise RuntimeError.

        Waits up to the timeout for the threads to exit (they are idle
        between steps). Do not call it while `run` is in progress.
        """
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            self._stop_pool()
            pool.join(self._timeout)

    def __enter__(self):
        if self._closed:
            raise RuntimeError("this MirroredStrategy was closed; create a new one")
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def run(self, fn, args=(), kwargs=None):
        """Runs `fn(*args, **kwargs)` on every replica, each on its own thread and device.

        PerReplica arguments are split; others are given to every replica.
        Legal in the cross-replica context (or outside any scope).

        Returns:
          PerReplica of the replicas' results (a nest of PerReplica leaves).

        Raises:
          The original exception of a failing replica (its type kept, a note
          naming the replica and device added; if other replicas were still
          running when the timeout expired, a TimeoutError as its
          `__context__`); TimeoutError if a replica neither finishes nor
          reaches merge_call within the timeout, or a merge_fn runs longer;
          RuntimeError after `close()`. On KeyboardInterrupt the step is
          aborted on every replica and the strategy stays usable; an update
          of mirrored variables in progress finishes first, so their
          components stay identical.
        """
        if context.get_replica_context() is not None and context.has_strategy():
            raise RuntimeError("strategy.run was called inside a replica context; call it from the "
                               "cross-replica context (outside strategy.run)")
        # in a compiled function: its trace stops and its body runs eagerly, running `fn` compiled
        fn = _jit.replica_function(fn, "MirroredStrategy.run")
        pool = self._replica_threads()
        with self.scope():
            follow_torch_writes()  # a wrapped module written through torch since the last step: every replica
            results = mirrored_run.run_on_replicas(self, pool, fn, args, kwargs or {}, self._timeout)
            check_torch_writes_in_run()  # an in-place torch write by each replica would land on one tensor
        return _group_results(results)


def _create_in_merge(strategy, next_creator, **kwargs):
    """merge_fn: creates the variable once, from replica 0's arguments."""
    return strategy._create_mirrored(select_replica(0, next_creator), **select_replica(0, kwargs))


def _group_results(results):
    if all(r is None for r in results):
        return None
    return regroup(results)


__all__ = ["MirroredStrategy", "PerReplica"]
