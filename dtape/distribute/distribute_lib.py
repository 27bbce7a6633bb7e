"""Strategy, StrategyExtended, ReplicaContext and the default strategy.

Source: tensorflow/python/distribute/distribute_lib.py. Public methods
validate and normalise, then call private `_impl`s.
"""
import torch

from dtape import nest, ops
from dtape import tape as _tp
from dtape.distribute import collective_ops, context, cross_device_ops, input_lib
from dtape.distribute.interrupts import uninterrupted
from dtape.distribute.reduce_util import ReduceOp
from dtape.distribute.values import (DistributedValues, DistributedVariable, Mirrored, MirroredVariable, PerReplica,
                                     live_variables, replica_operand, select_replica, value_container)
from dtape.tensor import Tensor, convert_to_tensor, device, normalize_device
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
        # GradientSync's record of what tape.gradient returned in this step (id(source) -> entry):
        # it goes with the step, so nothing of a finished step (or its strategy) stays on the thread.
        self.synced_gradients = {}

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
        if self._coordinator is not None:
            context.refuse_merge_call_in_traced_body(merge_fn)
        if self._coordinator is None:  # one replica, inline: its part of the result, as with threads
            with context.enter_mode(self._strategy, None), _tp.stop_recording():
                return select_replica(self._replica_id, merge_fn(self._strategy, *args, **kwargs))
        return self._coordinator.merge_call(self._replica_id, merge_fn, args, kwargs)

    @collective_ops.labelled("ReplicaContext.all_reduce")
    def all_reduce(self, reduce_op, value, weight=None):
        """Reduces `value` (a nest of tensors or numbers) across replicas; differentiable.

        Each replica gets its own result Tensor on its own device (so
        `experimental_local_results` of the step's result has one per
        replica). Numbers and variables count once per replica; a tensor
        that is the same object on every replica (created outside the
        replica function) is non-distributed: MEAN gives it back, SUM over
        more than one replica raises ValueError (as TF). float16/bfloat16
        accumulate in float32.

        Args:
          reduce_op: ReduceOp.SUM or ReduceOp.MEAN (or "SUM"/"MEAN").
          value: a nest of Tensors, variables or numbers, same shapes on every replica.
          weight: MEAN only: this replica's weight (e.g. its real example
            count; a number or scalar tensor, >= 0). The result is
            sum_r(w_r * v_r) / sum_r(w_r) (0 where every weight is 0), so
            means over uneven batches weigh each example once.

        Gradients (recorded on this replica's tapes): the transpose of a SUM
        is a SUM of the cotangents over replicas, of a MEAN that sum / n
        (jax.lax.psum/pmean's transposes). So the backward pass is itself a
        collective: every replica must compute the gradient through it
        (call `tape.gradient` on every replica, in the same order), inside
        `strategy.run`; a tape on the main thread cannot differentiate
        through a replica's all_reduce (use `strategy.reduce` there).

        Raises:
          ValueError: a bad reduce_op; `weight` with SUM; see above.
        """
        reduce_op = check_reduce_op(reduce_op)
        value = nest.map_structure(replica_operand, value)
        if weight is not None:
            if reduce_op != ReduceOp.MEAN:
                raise ValueError("all_reduce(weight=...) weights a MEAN; use ReduceOp.MEAN, or multiply the "
                                 "value by its weight yourself before a SUM")
            return _weighted_mean(self, value, weight)
        result = self.merge_call(_merge_all_reduce, args=(reduce_op, value))
        n = self.num_replicas_in_sync
        scale = None if reduce_op == ReduceOp.SUM else 1.0 / n
        for x, y in zip(nest.flatten(value), nest.flatten(result)):
            _record_collective(x, y, _AllReduceGrad(self._strategy, scale))
        return result

    @collective_ops.labelled("ReplicaContext.all_gather")
    def all_gather(self, value, axis):
        """Concatenates every replica's `value` along `axis`, in replica order; differentiable.

        Args:
          value: a nest of Tensors (or variables), same dtype and same shape
            except along `axis` on every replica (sizes along `axis` may differ).
          axis: the axis to concatenate along (negative counts from the end).

        Returns:
          The nest of gathered Tensors, each replica its own copy on its own
          device. A tensor that is the same object on every replica
          contributes once per replica.

        The gradient is a reduce-scatter: replica r gets the sum over
        replicas of the cotangent's slice that replica r contributed (every
        replica must call `tape.gradient`, as for `all_reduce`).
        """
        value = nest.map_structure(replica_operand, value)
        result, sizes = self.merge_call(_merge_all_gather, args=(value, axis))
        for x, y, n in zip(nest.flatten(value), nest.flatten(result), sizes):
            if n is None:  # this process holds one replica's value only: learn the others' sizes
                n = self._all_sizes(int(convert_to_tensor(x).shape[axis]))
            start = sum(n[:self._replica_id])
            _record_collective(x, y, _AllGatherGrad(self._strategy, axis, start, n[self._replica_id]))
        return result

    def _all_sizes(self, size):
        """Every replica's `size` (an int), by one SUM all-reduce of one-hot vectors."""
        onehot = torch.zeros(self.num_replicas_in_sync, dtype=torch.float64, device=normalize_device(self.devices[0]))
        onehot[self._replica_id] = size
        (total,) = self._strategy.extended._all_reduce_flat(ReduceOp.SUM, [onehot])
        return tuple(int(s) for s in total.tolist())


def _merge_all_reduce(strategy, reduce_op, value):
    return nest.map_structure(lambda v: strategy.extended._reduce_to_mirrored(reduce_op, v), value)


def _merge_all_gather(strategy, value, axis):
    n = strategy.num_replicas_in_sync

    sizes = []  # per leaf: every replica's size along `axis` (for the reduce-scatter transpose)

    def gather(v):
        if not isinstance(v, DistributedValues):  # the same object on every replica
            v = PerReplica((v,) * n)
        # every replica's size along `axis`, when this process holds every replica's value
        sizes.append(tuple(int(convert_to_tensor(x).shape[axis]) for x in v.values) if len(v.values) == n else None)
        gathered = strategy.gather(v, axis)
        return Mirrored(cross_device_ops.broadcast(gathered, strategy.extended._destinations(gathered)))
    return nest.map_structure(gather, value), sizes


def _weighted_mean(rctx, value, weight):
    """sum_r(w_r v_r) / sum_r(w_r): two recorded SUMs (the weights are constants)."""
    w = convert_to_tensor(weight)
    if w.ndim:
        raise ValueError(f"all_reduce weight must be a scalar (this replica's example count), got shape "
                         f"{tuple(w.shape)}")
    w = Tensor(w.torch().detach().to(torch.float64).clone())  # a fresh per-replica value, never watched
    total_w = rctx.all_reduce(ReduceOp.SUM, w)

    def weigh(v):
        # where(): a zero-weight replica (an empty batch's NaN mean) adds 0, not NaN, and stays on
        # the tape, so every replica's backward walk reaches the collective.
        if v is None:
            return None
        wv = ops.to_device(ops.cast(w, v.dtype), v.device)
        return ops.where(wv > 0, v, ops.zeros_like(v)) * wv
    sums = rctx.all_reduce(ReduceOp.SUM, nest.map_structure(weigh, value))

    def divide(s):
        if s is None:
            return None
        den = ops.cast(total_w, s.dtype)
        den = ops.to_device(den, s.device)
        return s / ops.maximum(den, torch.finfo(s.dtype).tiny)
    return nest.map_structure(divide, sums)


# -- collectives on the tape ------------------------------------------------------------
def _record_collective(x, y, grad):
    """Records `y = collective(x)` on the tapes of this thread that watch `x`, with backward `grad`."""
    if isinstance(x, Tensor) and isinstance(y, Tensor) and _tp.should_record((x,)):
        _tp.record(grad, (x._id,), (x,), (y,), None)


@collective_ops.labelled("the gradient of ReplicaContext.all_reduce/all_gather")
def replica_all_reduce_sum(strategy, x):
    """The SUM over `strategy`'s replicas of `x` (a Tensor on this replica), recorded; its own transpose.

    Runs on a replica thread of `strategy` (or its one inline replica);
    every replica must call it, in the same order (it is a collective).
    """
    ext = _replica_extended(strategy, "the gradient of ReplicaContext.all_reduce/all_gather")
    (total,) = ext._all_reduce_flat(ReduceOp.SUM, [x.torch().reshape(-1)])
    y = Tensor(total.reshape(x.shape))
    _record_collective(x, y, _AllReduceGrad(strategy, None))
    return y


def _replica_extended(strategy, what):
    rctx = context.get_replica_context()
    if rctx is None or rctx.strategy is not strategy:
        raise RuntimeError(f"{what} is a collective across replicas and must run in a replica context of the "
                           "same strategy: call tape.gradient inside strategy.run, on every replica (a tape on "
                           "the main thread cannot differentiate through ReplicaContext.all_reduce/all_gather; "
                           "reduce with strategy.reduce in the cross-replica context instead)")
    return strategy.extended


class _AllReduceGrad(_tp.RecordOp):
    """Backward of an all-reduce: SUM of the cotangents over replicas (times `scale` for a MEAN)."""

    __slots__ = ("strategy", "scale")
    name = "AllReduce"

    def __init__(self, strategy, scale):
        self.strategy, self.scale = strategy, scale

    def backward(self, dys, outputs, inputs, attrs, raw, needs):
        dy = dys[0]
        g = replica_all_reduce_sum(self.strategy, Tensor(dy) if raw else dy)
        if self.scale is not None:
            g = g * self.scale
        x = inputs[0]
        if g.dtype != x.dtype:
            g = ops.cast(g, x.dtype)
        return [g.torch() if raw else g]


class _AllGatherGrad(_tp.RecordOp):
    """Backward of an all-gather: reduce-scatter (this replica's slice of the summed cotangent)."""

    __slots__ = ("strategy", "axis", "start", "size")
    name = "AllGather"

    def __init__(self, strategy, axis, start, size):
        self.strategy, self.axis, self.start, self.size = strategy, axis, start, size

    def backward(self, dys, outputs, inputs, attrs, raw, needs):
        dy = dys[0]
        total = replica_all_reduce_sum(self.strategy, Tensor(dy) if raw else dy)
        index = [slice(None)] * total.ndim
        index[self.axis] = slice(self.start, self.start + self.size)
        g = total[tuple(index)]
        return [g.torch() if raw else g]


def _parts(i, members, args):
    """For `_update_many`: each list in `args`, restricted to `members`' positions, split to replica `i`."""
    return [[_part(i, a[k]) for k, _ in members] for a in args]


def _part(i, x):
    """`select_replica(i, x)`, without a nest traversal for a leaf (the common case: one gradient)."""
    if nest.is_nested(x):
        return select_replica(i, x)
    if isinstance(x, DistributedValues) and not isinstance(x, DistributedVariable):
        return x.values[i]
    return x


class StrategyExtended:
    """Device-level methods of a strategy. Source: tf.distribute.StrategyExtended."""

    def __init__(self, strategy, devices):
        self._strategy = strategy
        self._devices = tuple(devices)
        self._torch_devices = tuple(normalize_device(d) for d in devices)

    @property
    def worker_devices(self):
        return self._devices

    @property
    def should_checkpoint(self):
        """Whether this worker writes checkpoints: True but on non-chief workers of a multi-worker strategy.

        Source: tf.distribute.StrategyExtended.should_checkpoint.
        """
        return True

    @property
    def should_save_summary(self):
        """Whether this worker writes summaries: True but on non-chief workers of a multi-worker strategy.

        Source: tf.distribute.StrategyExtended.should_save_summary.
        """
        return True

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
        (Mirrored), or fn's result for a plain variable. All or nothing with
        respect to Ctrl-C (`interrupts.uninterrupted`).
        """
        kwargs = kwargs or {}
        if not isinstance(var, DistributedVariable):
            with _tp.stop_recording():
                return fn(var, *select_replica(0, args), **select_replica(0, kwargs))
        results = []
        with uninterrupted():  # every component or none: Ctrl-C waits for the last one
            for i, component in enumerate(var.values):
                with context.enter_mode(self._strategy, None, update_index=i), _tp.stop_recording():
                    results.append(fn(component, *select_replica(i, args), **select_replica(i, kwargs)))
        return Mirrored(results)

    def _update_many(self, var_list, fn, args=()):
        """`update` for many variables at once: `fn(index, components, *parts)` per group of components.

        Distributed variables: one call per replica index, with their
        components at that index, in the cross-replica context with the update
        index set. Variables that are not distributed: one call (index 0) with
        the variables themselves, as `update` runs them. `args` are lists
        parallel to `var_list`; `parts` the same lists for the group, each
        item split like `update`'s arguments. Not recorded. One call per group
        instead of one per variable, so an optimizer can update every variable
        with one batch of torch ops. All or nothing with respect to Ctrl-C:
        a KeyboardInterrupt is raised after the last group.
        """
        plain, groups = [], {}  # [(position in var_list, variable)]; index -> [(position, component)]
        for k, var in enumerate(var_list):
            if isinstance(var, DistributedVariable):
                for i, c in enumerate(var.values):
                    groups.setdefault(i, []).append((k, c))
            else:
                plain.append((k, var))
        with uninterrupted():  # every replica's components or none: Ctrl-C waits for the last group
            if plain:
                with _tp.stop_recording():
                    fn(0, [v for _, v in plain], *_parts(0, plain, args))
            for i in sorted(groups):
                with context.enter_mode(self._strategy, None, update_index=i), _tp.stop_recording():
                    fn(i, [c for _, c in groups[i]], *_parts(i, groups[i], args))

    # -- the flat all-reduce interface (replica side) ------------------------------
    # Gradient buckets, collectives on the tape and weighted means go through
    # these two methods only, called on a replica's thread inside `run` by
    # every replica in the same order. MirroredStrategy sums among its
    # replica threads; a multi-process strategy overrides them with
    # torch.distributed (dist.all_reduce(async_op=True) -> a handle).
    @property
    def _flat_buckets(self):
        """Whether gradient buckets are copied into one buffer before `_all_reduce_flat_async`: not for
        CPU replicas, which sum the tensors in one memory (a flat copy would only add traffic); yes with
        an accelerator, where the sum moves every tensor to the first device (one copy per bucket)."""
        return any(d.type != "cpu" for d in self._torch_devices)

    def _all_reduce_flat_async(self, reduce_op, tensors, scratch=False, tag=None):
        """Launches an all-reduce of this replica's `tensors`; returns a handle at once.

        Args:
          reduce_op: ReduceOp.SUM or ReduceOp.MEAN (plain mean over replicas).
          tensors: list of 1-D torch.Tensors on this replica's device (any
            float dtypes; float16/bfloat16 accumulate in float32). Every
            replica passes the same sizes and dtypes. Not modified; must not
            be modified until the handle is waited on.
          scratch: True when the caller gives `tensors` away (buffers it
            never reads again): a strategy may then reduce them in place
            instead of copying them first (the thread collectives never
            modify their inputs either way).
          tag: None, or what the contribution stands for (a gradient bucket's
            sources, `ThreadCollectives.launch`'s `tag`): replica threads
            compare it before summing.

        Returns:
          A handle with `.wait(timeout=None) -> list of torch.Tensor` (the
          reductions, same sizes/dtypes, on this replica's device,
          bit-identical on every replica) and `.done() -> bool`. `wait`
          raises the failing replica's error, or TimeoutError.

        Raises:
          RuntimeError: outside a replica context of this strategy.
        """
        rctx = context.get_replica_context()
        if rctx is None or rctx.strategy is not self._strategy:
            raise RuntimeError("an all-reduce across replicas must be launched inside strategy.run, "
                               "on every replica")
        coord = rctx._coordinator
        if coord is not None:
            group = cross_device_ops.thread_collectives(coord, self._devices)
            return group.launch(rctx.replica_id_in_sync_group, reduce_op, tensors, tag)
        if self._strategy.num_replicas_in_sync != 1:
            raise NotImplementedError(f"{type(self).__name__} must implement _all_reduce_flat_async "
                                      "for more than one replica")
        return cross_device_ops.DoneHandle(tensors)

    def _all_reduce_flat(self, reduce_op, tensors):
        """`_all_reduce_flat_async(reduce_op, tensors).wait()`: the reduced list, blocking."""
        return self._all_reduce_flat_async(reduce_op, tensors).wait()

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

    @property
    def cluster_resolver(self):
        """None: a single-process strategy has no cluster (MultiWorkerMirroredStrategy returns its resolver).

        Source: tf.distribute.Strategy.cluster_resolver.
        """
        return None

    def experimental_distribute_values_from_function(self, value_fn):
        """Calls `value_fn(ValueContext)` once per local replica, inside that replica's device scope.

        Args:
          value_fn: a function of a `ValueContext` (`replica_id_in_sync_group`,
            `num_replicas_in_sync`) returning that replica's value (a nest of
            tensors; tensors it creates land on the replica's device).

        Returns:
          A PerReplica of the values for several local replicas (pass it to
          `run`); the value itself for one (OneDeviceStrategy, the default
          strategy, each worker of MultiWorkerMirroredStrategy, where the
          replica id is the worker's rank).

        Source: tf.distribute.Strategy.experimental_distribute_values_from_function.
        """
        resolver = self.cluster_resolver
        first = 0 if resolver is None else int(resolver.task_id)
        values = []
        for i, dev in enumerate(self._extended.worker_devices):
            with device(dev):
                values.append(value_fn(ValueContext(first + i, self.num_replicas_in_sync)))
        return values[0] if len(values) == 1 else PerReplica(tuple(values))

    def scope(self):
        """Context manager: the cross-replica context; variables created inside are distributed."""
        return _StrategyScope(self)

    def _create_variable(self, next_creator, **kwargs):
        return next_creator(**kwargs)

    def run(self, fn, args=(), kwargs=None):
        """Runs `fn(*args, **kwargs)` once per replica; returns PerReplica results (or the value for one replica)."""
        raise NotImplementedError

    def reduce(self, reduce_op, value, axis=None, weights=None):
        """Reduces a per-replica value to one tensor (cross-replica context).

        Args:
          reduce_op: ReduceOp.SUM or ReduceOp.MEAN.
          value: PerReplica/Mirrored; or a non-distributed value (a plain
            tensor, or what `run` returns when every replica returned the same
            object): MEAN gives it back (reduced over `axis`), SUM needs a
            single replica.
          axis: None, or an axis (or axes) of each value to reduce as well;
            MEAN over an axis averages over all examples of all replicas.
          weights: MEAN only, with axis=None: one weight per replica (a
            PerReplica, or a list/tuple of numbers, e.g. each replica's
            real example count): the result is sum_r(w_r v_r) / sum_r(w_r)
            (0 if every weight is 0), so a mean of per-replica means over
            uneven batches equals the mean over all examples.

        Returns:
          A dtape.Tensor of the values' dtype on the first replica's device
          (float16/bfloat16 accumulated in float32); recorded on tapes that
          watch the values (a tape on the main thread sees through it).

        Raises:
          ValueError: SUM of a non-distributed value over more than one
            replica (as TF), naming the fixes; values of different shapes;
            an axis out of the values' range (an AxisError, also an IndexError).
        """
        reduce_op = check_reduce_op(reduce_op)
        if weights is not None:
            return self._weighted_mean(reduce_op, value, axis, weights)
        if axis is None:
            return self._extended._reduce(reduce_op, value)
        if not isinstance(value, DistributedValues):
            value = cross_device_ops.reduce_non_distributed_value(reduce_op, value, self.num_replicas_in_sync)
            values = [value]
        else:
            values = [convert_to_tensor(v) for v in value.values]
        for v in values:  # an out-of-range axis raises here, naming this call, instead of wrapping
            ops.math_ops.reduction_axes(v.ndim, axis, "strategy.reduce")
        dtype = values[0].dtype
        sums = [ops.reduce_sum(cross_device_ops.widen(v), axis=axis) for v in values]
        total = cross_device_ops.reduce_values(ReduceOp.SUM, sums, self._extended._destination(values))
        if reduce_op == ReduceOp.MEAN:
            total = total / max(sum(_count(v, axis) for v in values), 1)
        return cross_device_ops.narrow(total, dtype)

    def _weighted_mean(self, reduce_op, value, axis, weights):
        """sum_r(w_r v_r) / sum_r(w_r), recorded (the weights are constants); reductions via `_reduce`."""
        if reduce_op != ReduceOp.MEAN or axis is not None:
            raise ValueError("strategy.reduce(weights=...) weights a MEAN with axis=None; use ReduceOp.MEAN "
                             "(reduce over an axis already counts every example)")
        ws = weights.values if isinstance(weights, DistributedValues) else (
            tuple(weights) if isinstance(weights, (list, tuple)) else (weights,))
        n_local = len(self._extended.worker_devices)  # the replicas whose values this process holds
        if len(ws) != n_local:
            raise ValueError(f"strategy.reduce got {len(ws)} weights for {n_local} replicas; give one per replica "
                             "(a PerReplica, e.g. what `run` returned, or a list)")
        ws = [float(convert_to_tensor(w).torch()) for w in ws]
        values = value.values if isinstance(value, DistributedValues) else (value,) * n_local
        values = [convert_to_tensor(v) for v in values]
        # a zero weight (an empty batch, whose mean is NaN) contributes zeros
        total = self._extended._reduce(ReduceOp.SUM, PerReplica(tuple(
            v * w if w > 0 else ops.zeros_like(v) for v, w in zip(values, ws))))
        w_total = self._extended._reduce(ReduceOp.SUM, PerReplica(tuple(
            Tensor(torch.tensor(w, dtype=torch.float64)) for w in ws)))
        return total / max(float(w_total.torch()), torch.finfo(total.dtype).tiny)

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


class ValueContext:
    """What `experimental_distribute_values_from_function` tells `value_fn` about its replica.

    Source: tf.distribute.experimental.ValueContext.
    """

    __slots__ = ("_replica_id", "_num_replicas")

    def __init__(self, replica_id_in_sync_group=0, num_replicas_in_sync=1):
        self._replica_id, self._num_replicas = int(replica_id_in_sync_group), int(num_replicas_in_sync)

    @property
    def replica_id_in_sync_group(self):
        return self._replica_id

    @property
    def num_replicas_in_sync(self):
        return self._num_replicas

    def __repr__(self):
        return (f"ValueContext(replica_id_in_sync_group={self._replica_id}, "
                f"num_replicas_in_sync={self._num_replicas})")


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

__all__ = ["Strategy", "StrategyExtended", "ReplicaContext", "ValueContext"]
