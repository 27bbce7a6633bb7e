"""Strategy, StrategyExtended, ReplicaContext and the default strategy.

Source: tensorflow/python/distribute/distribute_lib.py. Public methods
validate and normalise, then call private `_impl`s.
"""
from dtape import nest, ops
from dtape import tape as _tp
from dtape.distribute import context, cross_device_ops, input_lib
from dtape.distribute.reduce_util import ReduceOp
from dtape.distribute.values import (DistributedValues, DistributedVariable, Mirrored, PerReplica,
                                     replica_operand, select_replica, value_container)
from dtape.tensor import convert_to_tensor, normalize_device
from dtape.variables import current_creator_stack, variable_creator_scope


def check_reduce_op(reduce_op):
    if isinstance(reduce_op, str):
        reduce_op = ReduceOp[reduce_op.upper()]
    if not isinstance(reduce_op, ReduceOp):
        raise ValueError(f"reduce_op must be ReduceOp.SUM or ReduceOp.MEAN, got {reduce_op!r}")
    return reduce_op


class ReplicaContext:
    """The context of one replica inside `strategy.run`.

    Source: tf.distribute.ReplicaContext.
    """

    def __init__(self, strategy, replica_id_in_sync_group, coordinator=None):
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group
        self._coordinator = coordinator

    @property
    def strategy(self):
        return self._strategy

    @property
    def replica_id_in_sync_group(self):
        return self._replica_id

    @property
    def num_replicas_in_sync(self):
        return self._strategy.num_replicas_in_sync

    @property
    def devices(self):
        return (self._strategy.extended.worker_devices[self._replica_id],)

    def merge_call(self, merge_fn, args=(), kwargs=None):
        """Runs `merge_fn(strategy, *args, **kwargs)` once, in the cross-replica context.

        Every replica must call it; arguments that differ across replicas
        arrive grouped as PerReplica values. Each replica gets its part of
        the result (PerReplica/Mirrored values are split). Legal only in a
        replica context. Raises the failing replica's exception, or
        TimeoutError after the configured timeout, instead of hanging.
        """
        kwargs = kwargs or {}
        if self._coordinator is None:  # one replica, inline: its part of the result, as with threads
            with context.enter_mode(self._strategy, None), _tp.stop_recording():
                return select_replica(self._replica_id, merge_fn(self._strategy, *args, **kwargs))
        return self._coordinator.merge_call(self._replica_id, merge_fn, args, kwargs)

    def all_reduce(self, reduce_op, value):
        """Reduces `value` (a nest of tensors or numbers) across replicas.

        Each replica gets its own result Tensor on its own device (so
        `experimental_local_results` of the step's result has one per
        replica). Numbers and variables count once per replica; a tensor
        that is the same object on every replica (created outside the
        replica function) is non-distributed: MEAN gives it back, SUM over
        more than one replica raises ValueError (as TF). float16/bfloat16
        accumulate in float32.
        """
        reduce_op = check_reduce_op(reduce_op)
        value = nest.map_structure(replica_operand, value)
        return self.merge_call(_merge_all_reduce, args=(reduce_op, value))

    def all_gather(self, value, axis):
        """Concatenates every replica's `value` along `axis`, in replica order.

        Each replica gets its own result Tensor on its own device. A tensor
        that is the same object on every replica contributes once per replica.
        """
        value = nest.map_structure(replica_operand, value)
        return self.merge_call(_merge_all_gather, args=(value, axis))


def _merge_all_reduce(strategy, reduce_op, value):
    return nest.map_structure(lambda v: strategy.extended._reduce_to_mirrored(reduce_op, v), value)


def _merge_all_gather(strategy, value, axis):
    n = strategy.num_replicas_in_sync

    def gather(v):
        if not isinstance(v, DistributedValues):  # the same object on every replica
            v = PerReplica((v,) * n)
        gathered = strategy.gather(v, axis)
        return Mirrored(cross_device_ops.broadcast(gathered, strategy.extended._destinations(gathered)))
    return nest.map_structure(gather, value)


class StrategyExtended:
    """Device-level methods of a strategy. Source: tf.distribute.StrategyExtended."""

    def __init__(self, strategy, devices):
        self._strategy = strategy
        self._devices = tuple(devices)
        self._torch_devices = tuple(normalize_device(d) for d in devices)

    @property
    def worker_devices(self):
        return self._devices

    def check_mirrored(self):
        """Verifies that every component of every live MirroredVariable of this strategy is identical.

        Compares each replica's component with replica 0's, bit for bit (NaNs
        in the same places count as equal), on replica 0's device. Call it
        between steps, in the cross-replica context.

        Returns:
          The number of MirroredVariables checked.

        Raises:
          ValueError: naming the first variable (in creation order) and the
            first replica whose component differs, with the largest difference.
        """
        import torch  # local: keeps this addition to one method

        from dtape.distribute.values import MirroredVariable, live_variables
        checked = 0
        for var in live_variables(self._strategy):
            if not isinstance(var, MirroredVariable):
                continue
            first = var.values[0].torch()
            for i, comp in enumerate(var.values[1:], start=1):
                other = comp.torch().to(first.device)
                same = (first == other) | (torch.isnan(first) & torch.isnan(other)) if first.is_floating_point() \
                    else first == other
                if not bool(same.all()):
                    diff = (first.double() - other.double()).abs().nan_to_num(float("inf")).max().item()
                    raise ValueError(f"MirroredVariable {var.name!r}: replica {i}'s component on "
                                     f"{comp.device} differs from replica 0's on {var.values[0].device} "
                                     f"(max |difference| {diff:g}, {int((~same).sum())} of {same.numel()} "
                                     "elements); a write bypassed the strategy (assign a component directly, "
                                     "or a replica-local update without aggregation)")
            checked += 1
        return checked

    def value_container(self, value):
        """The distributed container of a component variable, else `value`."""
        return value_container(value)

    def update(self, var, fn, args=(), kwargs=None, group=True):
        """Runs `fn(component, *args)` once per component of `var`, in the cross-replica context.

        Mirrored/PerReplica arguments are split per component; plain values
        are given to every component. Returns the per-component results
        (Mirrored), or fn's result for a plain variable.
        """
        kwargs = kwargs or {}
        if not isinstance(var, DistributedVariable):
            with _tp.stop_recording():
                return fn(var, *select_replica(0, args), **select_replica(0, kwargs))
        results = []
        for i, component in enumerate(var.values):
            with context.enter_mode(self._strategy, None, update_index=i), _tp.stop_recording():
                results.append(fn(component, *select_replica(i, args), **select_replica(i, kwargs)))
        return Mirrored(results)

    def reduce_to(self, reduce_op, value, destinations=None):
        """Reduces a PerReplica value to a Mirrored value (one copy per device)."""
        return self._reduce_to_mirrored(check_reduce_op(reduce_op), value)

    def batch_reduce_to(self, reduce_op, value_destination_pairs):
        """`reduce_to` for many (value, destination) pairs."""
        reduce_op = check_reduce_op(reduce_op)
        return [self._reduce_to_mirrored(reduce_op, v) for v, _ in value_destination_pairs]

    def _destination(self, values):
        """The device a reduction of `values` lands on: the first replica's."""
        return self._torch_devices[0]

    def _destinations(self, value):
        """The devices a reduced value is broadcast to: one per replica."""
        return self._torch_devices

    def _reduce(self, reduce_op, value):
        """One Tensor on the first device: the reduction of a distributed or non-distributed value."""
        if isinstance(value, DistributedValues):
            values = [convert_to_tensor(v) for v in value.values]
            return cross_device_ops.reduce_values(reduce_op, values, self._destination(values))
        return cross_device_ops.reduce_non_distributed_value(reduce_op, value, len(self._devices))

    def _reduce_to_mirrored(self, reduce_op, value):
        if value is None:
            return None
        total = self._reduce(reduce_op, value)
        return Mirrored(cross_device_ops.broadcast(total, self._destinations(total)))


class Strategy:
    """A way to run a computation on several replicas. Source: tf.distribute.Strategy."""

    _is_default = False

    def __init__(self, extended):
        self._extended = extended

    @property
    def extended(self):
        return self._extended

    @property
    def num_replicas_in_sync(self):
        return len(self._extended.worker_devices)

    def scope(self):
        """Context manager: the cross-replica context; variables created inside are distributed."""
        return _StrategyScope(self)

    def _create_variable(self, next_creator, **kwargs):
        return next_creator(**kwargs)

    def run(self, fn, args=(), kwargs=None):
        """Runs `fn(*args, **kwargs)` once per replica; returns PerReplica results (or the value for one replica)."""
        raise NotImplementedError

    def reduce(self, reduce_op, value, axis=None):
        """Reduces a per-replica value to one tensor (cross-replica context).

        Args:
          reduce_op: ReduceOp.SUM or ReduceOp.MEAN.
          value: PerReplica/Mirrored; or a non-distributed value (a plain
            tensor, or what `run` returns when every replica returned the same
            object): MEAN gives it back (reduced over `axis`), SUM needs a
            single replica.
          axis: None, or an axis (or axes) of each value to reduce as well;
            MEAN over an axis averages over all examples of all replicas.

        Returns:
          A dtape.Tensor of the values' dtype on the first replica's device
          (float16/bfloat16 accumulated in float32); recorded on tapes that
          watch the values (a tape on the main thread sees through it).

        Raises:
          ValueError: SUM of a non-distributed value over more than one
            replica (as TF), naming the fixes; values of different shapes.
        """
        reduce_op = check_reduce_op(reduce_op)
        if axis is None:
            return self._extended._reduce(reduce_op, value)
        if not isinstance(value, DistributedValues):
            value = cross_device_ops.reduce_non_distributed_value(reduce_op, value, self.num_replicas_in_sync)
            values = [value]
        else:
            values = [convert_to_tensor(v) for v in value.values]
        dtype = values[0].dtype
        sums = [ops.reduce_sum(cross_device_ops.widen(v), axis=axis) for v in values]
        total = cross_device_ops.reduce_values(ReduceOp.SUM, sums, self._extended._destination(values))
        if reduce_op == ReduceOp.MEAN:
            total = total / max(sum(_count(v, axis) for v in values), 1)
        return cross_device_ops.narrow(total, dtype)

    def gather(self, value, axis):
        """Concatenates the per-replica values along `axis` on the first device."""
        values = [convert_to_tensor(v) for v in (value.values if isinstance(value, DistributedValues) else (value,))]
        dev = self._extended._destination(values)
        return ops.concat([cross_device_ops.on_device(v, dev) for v in values], axis=axis)

    def experimental_local_results(self, value):
        """The per-replica parts of `value` as a tuple (a 1-tuple for plain values)."""
        if isinstance(value, DistributedValues):
            return value.values
        return (value,)

    def experimental_distribute_dataset(self, dataset):
        """Splits each global batch of `dataset` across the replicas (see input_lib)."""
        return input_lib.DistributedDataset(self, dataset)

    def distribute_datasets_from_function(self, dataset_fn):
        """Calls `dataset_fn(InputContext)` once per replica and zips the per-replica datasets."""
        return input_lib.DatasetsFromFunction(self, dataset_fn)


def _count(v, axis):
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    n = 1
    for a in axes:
        n *= v.shape[a]
    return n


class _StrategyScope:
    def __init__(self, strategy):
        self._strategy = strategy
        self._mode = context.enter_mode(strategy, None)
        self._creator = variable_creator_scope(strategy._create_variable)

    def __enter__(self):
        current = context.get_strategy()
        if context.has_strategy() and current is not self._strategy:
            raise ValueError(f"cannot enter the scope of {type(self._strategy).__name__} inside the scope of "
                             f"another strategy ({type(current).__name__}); exit that scope first")
        # Re-entering the same strategy's scope (e.g. inside merge_call) must
        # not stack its creator twice, or variables would be mirrored twice.
        self._push_creator = self._strategy._create_variable not in current_creator_stack()
        self._mode.__enter__()
        if self._push_creator:
            self._creator.__enter__()
        return self._strategy

    def __exit__(self, *exc):
        if self._push_creator:
            self._creator.__exit__(*exc)
        self._mode.__exit__(*exc)
        return False


class _DefaultExtended(StrategyExtended):
    """One replica wherever values already are: reductions stay on the value's device."""

    def _destination(self, values):
        return values[0].device

    def _destinations(self, value):
        return (value.device,)


class _DefaultStrategy(Strategy):
    """The strategy in force outside any scope: one replica, the current device.

    The standard loop works on it unchanged: `experimental_distribute_dataset`
    gives the dataset's batches as they are, `run` calls fn once (taking
    replica 0's part of any PerReplica argument), `reduce` of the result is
    the value itself. Source: TF's _DefaultDistributionStrategy.
    """

    _is_default = True

    def __init__(self):
        super().__init__(_DefaultExtended(self, ("cpu:0",)))

    def run(self, fn, args=(), kwargs=None):
        """Calls `fn(*args, **kwargs)` once, on this thread, in the default replica context."""
        args, kwargs = select_replica(0, args), select_replica(0, kwargs or {})
        with context.enter_mode(self, _DEFAULT_REPLICA):
            return fn(*args, **kwargs)

    def experimental_distribute_dataset(self, dataset):
        """The dataset itself: one replica takes every batch whole (TF's default strategy)."""
        return dataset

    def distribute_datasets_from_function(self, dataset_fn):
        """`dataset_fn(InputContext(1, 0, 1))`: the one replica's dataset."""
        return dataset_fn(input_lib.InputContext(1, 0, 1))


_DEFAULT_STRATEGY = _DefaultStrategy()
_DEFAULT_REPLICA = ReplicaContext(_DEFAULT_STRATEGY, 0)
_DEFAULT_MODE = context.Mode(_DEFAULT_STRATEGY, _DEFAULT_REPLICA)
context.register_default_mode_factory(lambda: _DEFAULT_MODE)

__all__ = ["Strategy", "StrategyExtended", "ReplicaContext"]
