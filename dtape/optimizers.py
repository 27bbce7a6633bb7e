"""Optimizers with the Keras update formulas, distribution-aware.

Under a strategy, `apply_gradients` in a replica context all-reduces the
gradients (SUM) in one `merge_call` and applies one update to every
component, so mirrored components stay bit-identical. Slot variables are
created in their variable's strategy scope, so they are mirrored like it.
Every write goes through `Variable._update_value` (the variable's lock);
slots are keyed by the variable's never-reused id and freed when it dies.
Updates are batched: each update formula runs once per step on all the
variables (torch._foreach_* ops, one C++ loop per op instead of Python per
variable) and is then committed variable by variable (`_write_all`); the
ops and their order are those of the one-variable formula, so the results
are bit-identical to updating one variable at a time.
Clipping (`clipnorm`, `clipvalue`, `global_clipnorm`, one of them) is a
separate step after the cross-replica aggregation (`_distributed_apply`),
as Keras 3: under a strategy the summed gradient is clipped, so 2 replicas
train exactly as one device on the global batch.
Source: tf.keras.optimizers (SGD, Adam, AdamW, RMSprop, Adagrad).
"""
import contextlib
import copy
import functools
import inspect
import math
import operator
import sys
import warnings
import weakref

import torch

from dtape import _jit, _restore_hooks
from dtape import distribute
from dtape import optimizers_schedules as schedules
from dtape import ops as _ops
from dtape import tape as _tp
from dtape.backprop import GradientTape, profile_range
from dtape.distribute.cross_device_ops import reduce_non_distributed_value
from dtape.distribute.interrupts import uninterrupted
from dtape.distribute.reduce_util import ReduceOp
from dtape.module import default_name_part
from dtape.tensor import Tensor, convert_to_tensor, is_tracing, is_variable, normalize_device
from dtape.variables import Variable, VariableAggregation, update_together

# `from dtape.optimizers.schedules import ExponentialDecay`, TF's spelling: this module is a file, not a
# package, so the import system can only find the submodule through its sys.modules entry.
sys.modules.setdefault(__name__ + ".schedules", schedules)


class Optimizer:
    """Base class: slot bookkeeping, gradient aggregation, the update loop.

    Subclasses define `_slot_names` and `_update_many(variables, grads,
    slots, step)` (component Variables, torch gradients on their devices,
    one {slot name: component} dict per variable); they write with
    `_write_all(variables, fn, *operands)`, never by touching a variable's
    tensor. (`_update(var, grad, slots, step)` updates one variable.)

    Args (every optimizer):
      learning_rate: a float >= 0 (held in a non-trainable float64 scalar
        Variable: `learning_rate`); a `schedules.LearningRateSchedule` (called
        with `iterations`); a callable taking the step; or a callable taking
        no argument (Keras 3), evaluated at each step. Eagerly the step is an
        int and the rate is read as a float (bit-identical to a plain number);
        while a compiled step is traced the step is a float64 scalar tensor
        and the rate stays a tensor, so write a callable with operators or
        torch ops (`0.1 / (1 + step)`), not `math` functions or `if`s on it.
      name: prefix of the slot variables' names.
      clipnorm: clip each aggregated gradient to this L2 norm (tf.clip_by_norm).
      clipvalue: clip each aggregated gradient elementwise to [-clipvalue, clipvalue].
      global_clipnorm: clip all aggregated gradients together to this global
        norm (tf.clip_by_global_norm). At most one of the three.

    Raises:
      ValueError: more than one clipping option, or a non-positive/non-finite
        one; a negative or non-finite learning rate; a hyperparameter out of
        its range (betas in [0, 1), momentum and rho in [0, 1], epsilon,
        weight_decay and initial_accumulator_value >= 0).
      TypeError: a hyperparameter that is not a number.
    """

    _slot_names = ()
    _slot_initial = {}  # slot name -> initial value (default 0)

    def __init__(self, learning_rate, name, clipnorm=None, clipvalue=None, global_clipnorm=None):
        self.name = name
        self._learning_rate = None
        self.learning_rate = learning_rate
        self.clipnorm, self.clipvalue, self.global_clipnorm = _check_clipping(clipnorm, clipvalue, global_clipnorm)
        self._slots = {}          # _slot_key(var) -> {slot name: variable}, in creation order
        self._slot_primary = {}   # _slot_key(var) -> weak reference to var, the variable those slots belong to
        self._iterations = None

    @property
    def learning_rate(self):
        """The learning rate: a non-trainable float64 scalar Variable when it is a number (read at every step,
        so a compiled step takes its current value as an input), else the schedule or callable given.

        Set it to a number (assigned to that variable, or a new one if it was a schedule), a schedule, a
        callable or a Variable of your own; `learning_rate.assign(x)` also works. `lr` is an alias.
        Raises TypeError / ValueError as the constructor for a bad value.
        Source: tf.keras.optimizers.Optimizer.learning_rate.
        """
        return self._learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        value = _check_learning_rate(value)
        if callable(value) or is_variable(value):
            self._learning_rate = value
            return
        own = self.__dict__.get("_own_learning_rate")  # the variable made for a number, reused by the next
        if own is None:
            own = self._own_learning_rate = self._make_variable(float(value), torch.float64, None, "learning_rate")
        else:
            with _tp.stop_recording():
                own.assign(float(value))
        self._learning_rate = own

    @property
    def lr(self):
        """Alias of `learning_rate` (tf.keras's)."""
        return self.learning_rate

    @lr.setter
    def lr(self, value):
        self.learning_rate = value

    @property
    def iterations(self):
        """Number of applied steps (an int64 variable, mirrored under a strategy)."""
        if self._iterations is None:
            self._iterations = self._make_variable(0, torch.int64, None, "iterations")
        return self._iterations

    def _make_variable(self, value, dtype, like, name):
        strategy = getattr(like, "distribute_strategy", None) or distribute.get_strategy()
        with _tp.stop_recording(), _scope(strategy):
            init = torch.zeros((), dtype=dtype) + value if like is None else torch.zeros_like(like.torch()) + value
            return Variable(init, trainable=False, name=f"{self.name}/{name}",
                            aggregation=VariableAggregation.ONLY_FIRST_REPLICA)

    def _slots_for(self, var):
        key = _slot_key(var)
        slots = self._slots.get(key)
        if slots is None:
            slots = {n: self._make_variable(self._slot_initial.get(n, 0), None, var, f"{var.name}/{n}")
                     for n in self._slot_names}
            self._slots[key] = slots
            self._slot_primary[key] = weakref.ref(var)
            # The key is never reused, so a new variable never inherits these;
            # dropping the variable frees them (the finalizer holds no optimizer).
            weakref.finalize(var, _forget_slots, weakref.ref(self), key).atexit = False
        return slots

    def build(self, var_list):
        """Creates the slot variables (and `iterations`) for `var_list` now.

        Call it in the cross-replica context (e.g. inside `strategy.scope()`)
        before a checkpoint restore, so restored slots have somewhere to go.
        Source: tf.keras.optimizers.Optimizer.build.
        """
        for var in var_list:
            self._slots_for(distribute.value_container(var))
        iterations = self.iterations
        _restore_hooks.variables_created(self)   # a checkpoint restored before the slots existed fills them
        return iterations

    def variables(self):
        """The optimizer's variables: `iterations`, the `learning_rate` variable (when the rate is a number or a
        Variable, not a schedule or callable), then the slots in creation order (Keras 3's order).
        Source: keras.optimizers.Optimizer.variables."""
        out = self._checkpoint_variables()
        return out[:1] + list(self._checkpoint_children().values()) + out[1:]

    def _checkpoint_variables(self):
        """`iterations`, then the slots in creation order: what a checkpoint matches by position (files written
        before the learning rate was saved hold exactly these)."""
        out = [self.iterations]
        for slots in self._slots.values():
            out.extend(slots.values())
        return out

    def _checkpoint_children(self):
        """{"learning_rate": its variable} when the rate is a variable, else {}: saved under its own key
        (`<name>.learning_rate`) so that a file without it still restores the rest by position."""
        lr = self._learning_rate
        return {"learning_rate": lr} if is_variable(lr) else {}

    def _checkpoint_slots(self):
        """{id(slot variable): (its variable, slot name)}: what a checkpoint records so that a slot's saved value
        goes back to the slot of the same variable, whatever order or subset of slots exists (TF's object graph
        links slot -> optimizer + variable the same way)."""
        out = {}
        for key, slots in list(self._slots.items()):
            primary = self._slot_primary.get(key, lambda: None)()
            if primary is not None:
                out.update((id(slot), (primary, name)) for name, slot in slots.items())
        return out

    def apply_gradients(self, grads_and_vars):
        """Applies gradients to variables.

        Args:
          grads_and_vars: iterable of (gradient, variable); gradients are
            dtape.Tensors with the variable's shape, or None.

        In a replica context of a strategy the gradients are summed over
        replicas, flattened into buckets (one all-reduce per bucket, see
        `dtape.distribute.GradientSync`; the reductions a synced tape
        launched are used for the very tensors it returned), and every
        component gets the same update (one merge_call); a variable whose
        gradient is None on some replicas only gets zeros there (the
        replicas agree), and one that is None on every replica is skipped
        with a warning. In the cross-replica context gradients are applied
        as given (None skipped, with a warning). The update is the range
        "dtape.apply_gradients" in torch.profiler traces.

        Returns:
          The iterations variable.

        Raises:
          RuntimeError: called in the cross-replica context (inside
            `strategy.scope()` or a merge_call, outside `strategy.run`) of a
            strategy with more than one replica in sync, as TF: the gradients
            of one replica cannot update every copy consistently. Raised
            before anything is written (no variable, slot or `iterations`).
            Also outside any scope for variables of such a strategy (no
            `strategy.run`): the copies would be updated one by one.
          ValueError: a gradient whose shape is not its variable's; (under a
            strategy) a gradient that is the same object on every replica
            (not distributed) cannot be summed.
          TypeError: a gradient whose dtype is not its variable's.
          Either is raised before any variable is written.
        """
        # the optimizer update: a named range in torch.profiler traces; its collectives are named after it
        with profile_range("dtape.apply_gradients"), distribute.collective_ops.labelled("apply_gradients"):
            pairs = [(g, v) for g, v in grads_and_vars]
            _check_not_cross_replica("apply_gradients", [v for _, v in pairs])
            _check_gradients(pairs)
            ctx = distribute.get_replica_context()
            if ctx is not None and ctx.num_replicas_in_sync > 1 and is_tracing():
                return self._replica_local_apply(ctx, pairs)
            if ctx is not None and ctx.num_replicas_in_sync > 1:
                reduced = distribute.gradient_sync.reduce_gradients(pairs)
                mine = _ReplicaGradients([g for g, _ in reduced], [g for g, _ in pairs], [v for _, v in pairs])
                return ctx.merge_call(self._merge_apply_replicas, args=(mine,))
            if ctx is not None:
                return ctx.merge_call(self._merge_apply, args=(pairs,))
            return self._distributed_apply(distribute.get_strategy(), _drop_missing(pairs))

    def _replica_local_apply(self, ctx, pairs):
        """A replica step being traced: no merge_call (a rendezvous of the replicas' Python threads, which
        a graph cannot hold). Each replica sums the gradients with `torch.ops.dtape.all_reduce_sum` (one op
        per bucket, run when the graph runs), clips the sums and updates its own components with them: the
        same sums and the same formula on every replica, so the components stay identical, as with the one
        update of merge_call. The slots must exist (`build(var_list)` in the strategy's scope first)."""
        # a wrapping optimizer (LossScaleOptimizer) or one running its own update (from_torch's torch.optim step,
        # which writes the tensors in place: no graph op) needs the eager cross-replica path
        if type(self)._distributed_apply is not Optimizer._distributed_apply or \
                type(self)._apply is not Optimizer._apply:
            raise NotImplementedError(
                f"{type(self).__name__}.apply_gradients cannot be traced in a replica step of a strategy with "
                f"{ctx.num_replicas_in_sync} replicas (its update needs the cross-replica context); run this "
                "step eagerly, or use a plain dtape optimizer")
        kept = _drop_missing(pairs)
        containers = [distribute.value_container(v) for _, v in kept]
        unbuilt = [v.name for v in containers if self._slot_names and _slot_key(v) not in self._slots]
        if unbuilt:
            # a compiled function's first call then runs eagerly, making the slots in merge_call (TF makes them
            # on the first trace); the next call traces
            _jit.call_eagerly_instead()
            raise RuntimeError(f"{self.name}: the slots of {unbuilt[:4]} do not exist while this replica step is "
                               "traced; call optimizer.build(variables) inside strategy.scope() before the first "
                               "compiled step (slots are made in the cross-replica context)")
        sums = distribute.traceable_collectives.reduce_gradients([convert_to_tensor(g).torch() for g, _ in kept])
        comps = [c._component() if isinstance(c, distribute.DistributedValues) else c for c in containers]
        clipped = self._clip_gradients([(Tensor(g), c) for g, c in zip(sums, comps)])
        with _tp.stop_recording():
            step = self._step_count() + 1
            # the slots' components at each component's own index: a worker of several processes holds one
            # component (index 0) whatever its replica id
            self._update_many(comps, [convert_to_tensor(g).torch().to(c.device) for (g, _), c in zip(clipped, comps)],
                              [self._component_slots(c, _component_index(c)) for c in comps], step)
            iterations = self.iterations
            local = iterations._component() if isinstance(iterations, distribute.DistributedValues) else iterations
            local.assign_add(1)
        return iterations

    def _merge_apply(self, strategy, pairs):
        """merge_fn: fills one-sided None gradients with zeros, sums over replicas, applies."""
        devices = strategy.extended.worker_devices
        kept = [(_fill_missing(g, v, devices), v) for g, v in _drop_missing(pairs)]
        reduced = strategy.extended.batch_reduce_to(ReduceOp.SUM, kept)
        return self._distributed_apply(strategy, [(g, v) for g, (_, v) in zip(reduced, kept)])

    def _distributed_apply(self, strategy, pairs):
        """Cross-replica context, gradients already aggregated: clip, then apply."""
        return self._apply(strategy, self._clip_gradients(pairs))

    def _clip_gradients(self, pairs):
        """`clipnorm` / `global_clipnorm` / `clipvalue` on the aggregated gradients (Keras 3 order).

        A Mirrored gradient is clipped copy by copy (copies are identical, so
        every replica applies the same update).
        """
        if not pairs or (self.clipnorm is None and self.clipvalue is None and self.global_clipnorm is None):
            return pairs
        grads = [g for g, _ in pairs]
        n = max((len(g.values) for g in grads if isinstance(g, distribute.DistributedValues)), default=0)
        with _tp.stop_recording():
            if not n:
                clipped = self._clip_list([convert_to_tensor(g) for g in grads])
            else:
                per = [self._clip_list([_replica_part(g, i) for g in grads]) for i in range(n)]
                clipped = [distribute.Mirrored(tuple(p[k] for p in per)) for k in range(len(grads))]
        return [(g, v) for g, (_, v) in zip(clipped, pairs)]

    def _clip_list(self, grads):
        if self.clipnorm is not None:
            return [_ops.clip_by_norm(g, self.clipnorm) for g in grads]
        if self.global_clipnorm is not None:
            return _ops.clip_by_global_norm(grads, self.global_clipnorm)[0]
        return [_ops.clip_by_value(g, -self.clipvalue, self.clipvalue) for g in grads]

    def _merge_apply_replicas(self, strategy, mine):
        """merge_fn: `mine` is each replica's _ReplicaGradients (a PerReplica of them with several replicas in
        this process); groups them as merge_call groups its arguments, then `_merge_apply_reduced`."""
        parts = mine.values if isinstance(mine, distribute.DistributedValues) else (mine,)
        if len(parts) == 1:  # one replica of several in sync (a worker's): its tensors are its parts (as
            # its merge_call wraps them); anything else is the same on every worker, so not distributed
            reduced, variables = parts[0].reduced, parts[0].variables
            given = [None if type(g) is Tensor or isinstance(g, (Tensor, torch.Tensor)) and not isinstance(g, Variable)
                     else g for g in parts[0].given]
        else:  # the same object on every replica is not distributed
            reduced, given = _group([p.reduced for p in parts]), _group([p.given for p in parts])
            variables = _group([p.variables for p in parts])  # each replica's own components stay its own
            _check_same_variables(variables)
        return self._merge_apply_reduced(strategy, list(zip(reduced, variables)), given)

    def _merge_apply_reduced(self, strategy, pairs, given):
        """merge_fn: the gradients are already summed (each replica holds an identical copy): applies.

        `given` (the gradients as passed, grouped): one that is the same object
        on every replica is not distributed, and summing it raises (as TF).
        """
        for g in given:
            if g is not None and not isinstance(g, distribute.DistributedValues):
                reduce_non_distributed_value(ReduceOp.SUM, g, strategy.num_replicas_in_sync)
        return self._distributed_apply(strategy, _drop_missing(pairs))

    def _apply(self, strategy, pairs):
        for _, var in pairs:  # slots are made here, once, in the cross-replica context
            self._slots_for(distribute.value_container(var))
        _restore_hooks.variables_created(self)   # a checkpoint restored before the slots existed fills them
        step = self._step_count() + 1
        # Ctrl-C waits for the whole update: every component and `iterations`, or nothing.
        with _tp.stop_recording(), uninterrupted():
            # one batched update per replica index (not one per variable): see the module docstring
            strategy.extended._update_many([v for _, v in pairs], functools.partial(self._apply_group, step=step),
                                           args=([g for g, _ in pairs],))
            self.iterations.assign_add(1)
        return self.iterations

    def _apply_group(self, index, components, grads, step):
        """`_update_many` on the components of one replica index (their gradients moved to their devices)."""
        grads = [convert_to_tensor(g).torch().to(c.device) for g, c in zip(grads, components)]
        self._update_many(components, grads, [self._component_slots(c, index) for c in components], step)

    def _component_slots(self, component, index):
        """{slot name: the slot's component at `index`} (the slots themselves for a plain variable)."""
        container = distribute.value_container(component)
        slots = self._slots_for(container)
        if container is component:
            return slots
        return {n: s.values[index] if isinstance(s, distribute.DistributedValues) else s for n, s in slots.items()}

    def _apply_one(self, var, grad, step):
        """Updates one component `var` (the per-variable path; `_apply` batches every variable)."""
        container = distribute.value_container(var)
        slots = {n: _component_like(s, var) for n, s in self._slots_for(container).items()}
        self._update(var, convert_to_tensor(grad).torch().to(var.device), slots, step)

    def _update(self, var, g, slots, step):
        """One component variable's update: the batched formula on a batch of one."""
        self._update_many([var], [g], [slots], step)

    def _update_many(self, variables, grads, slots, step):
        raise NotImplementedError(f"{type(self).__name__} must define _update_many(variables, grads, slots, step)")

    def minimize(self, loss, var_list, tape=None):
        """Minimizes `loss` over `var_list`: gradients, then `apply_gradients`.

        Args:
          loss: a scalar Tensor computed under `tape`, or a callable taking no
            arguments that returns one (then no tape is needed: one is opened
            here around the call).
          var_list: list of variables, or a callable returning it (called
            after `loss()`, so layers built lazily by `loss` are included).
          tape: the GradientTape that recorded a Tensor `loss`.

        Returns:
          The iterations variable.

        Raises:
          ValueError: a Tensor loss without a tape.
          RuntimeError: in the cross-replica context of a strategy with more
            than one replica (see `apply_gradients`), before `loss` is called.

        Source: tf.keras.optimizers.Optimizer.minimize.
        """
        # a callable or iterator var_list is checked by apply_gradients, still before any write
        _check_not_cross_replica("minimize", var_list if isinstance(var_list, (list, tuple)) else ())
        if not callable(loss):
            if tape is None:
                raise ValueError("`tape` is required when a `Tensor` loss is passed; pass a callable "
                                 "`loss=lambda: ...` to minimize without a tape")
            if callable(var_list):
                var_list = var_list()
        else:
            tape = tape if tape is not None else GradientTape()
            with tape:
                if not callable(var_list):
                    tape.watch(var_list)
                loss = loss()
                if callable(var_list):
                    var_list = var_list()
        var_list = list(var_list)
        grads = tape.gradient(loss, var_list)
        return self.apply_gradients(zip(grads, var_list))

    def _step_count(self):
        """`iterations` (the steps applied so far): an int, or while tracing the int64 scalar tensor read."""
        if is_tracing():
            with _tp.stop_recording():
                return self.iterations.read_value().torch()
        return int(self.iterations.numpy())

    def _lr(self):
        """The learning rate for this step (a variable, a schedule or `fn(step)` of `iterations`, or `fn()`):
        a float, read on the host (a CPU scalar: exact and cheap); while tracing a torch scalar tensor, so
        the graph reads the variable and the schedule's ops on `iterations` instead of a baked-in number."""
        lr = self._learning_rate
        if is_variable(lr):
            with _tp.stop_recording():
                value = lr.read_value()
        elif isinstance(lr, schedules.LearningRateSchedule) or (callable(lr) and _takes_step(lr)):
            step = self._step_count()  # traced: a float64 tensor, so `0.1 / (1 + step)` stays in float64
            value = lr(step.to(torch.float64) if isinstance(step, torch.Tensor) else step)
        elif callable(lr):
            value = lr()
        else:
            value = lr
        if not is_tracing() or not hasattr(value, "__float__") or isinstance(value, (int, float)):
            return float(value)
        return value.torch() if hasattr(value, "torch") else torch.as_tensor(value)


class _ReplicaGradients:
    """One replica's summed gradients, the gradients it was given and its variables, for merge_call as one
    argument: merge_call groups (or, on a worker, wraps) every leaf of its arguments, one Python call each;
    `Optimizer._merge_apply_replicas` groups these lists itself, with the same rule."""

    __slots__ = ("reduced", "given", "variables")

    def __init__(self, reduced, given, variables):
        self.reduced, self.given, self.variables = reduced, given, variables


def _check_same_variables(variables):
    """Raises ValueError when the replicas listed other variables at one position (`variables`: grouped):
    their gradients were summed position by position, so applying them would mix the variables' gradients."""
    for k, v in enumerate(variables):
        if isinstance(v, distribute.PerReplica) and \
                len({id(distribute.value_container(c)) for c in v.values}) > 1:
            names = [getattr(c, "name", "?") for c in v.values]
            raise ValueError(f"apply_gradients: the replicas passed different variables at position {k} ({names}); "
                             "their gradients are summed position by position, so every replica must pass the "
                             "same variables in the same order (e.g. zip(grads, model.trainable_variables)). "
                             "Nothing was updated.")


def _group(lists):
    """Per position of the replicas' `lists`: the one object every replica has there, else a PerReplica of
    theirs (`distribute.values.regroup`'s rule for one leaf)."""
    return [xs[0] if _all_same(xs) else distribute.PerReplica(xs) for xs in zip(*lists)]


def _all_same(xs):
    for x in xs:
        if x is not xs[0]:
            return False
    return True


def _check_not_cross_replica(method, variables=()):
    """TF's guard: no update from the cross-replica context of a strategy with several replicas in sync.

    There one call would hold one replica's gradients (or a non-distributed
    value) for every copy; TF refuses it, and so, before any write, do we.
    With one replica in sync (OneDeviceStrategy, the default strategy) the
    update is unambiguous and allowed. Variables of a several-replica
    strategy updated where another strategy is current (outside its scope,
    or on a thread that never entered it) are refused too: the update would
    run with the wrong strategy and write only the first copy.
    """
    strategy = distribute.get_strategy()
    if distribute.in_cross_replica_context() and strategy.num_replicas_in_sync > 1:
        raise RuntimeError(
            f"`{method}()` cannot be called in cross-replica context. Use `dtape.distribute.Strategy.run` to enter "
            f"replica context: call it inside the function given to `strategy.run` (here "
            f"{strategy.num_replicas_in_sync} replicas in sync), as TF requires. Nothing was updated.")
    # per class: a distributed variable's strategy without its property's call (a module's dozens, every step)
    distributed = {kind for kind in set(map(type, variables))
                   if issubclass(kind, distribute.values.DistributedVariable)}
    for var in variables:
        if type(var) is Variable:  # a plain variable belongs to no strategy (and the lookup below would raise)
            continue
        owner = var._distribute_strategy if type(var) in distributed else getattr(var, "distribute_strategy", None)
        if owner is not None and owner is not strategy and owner.num_replicas_in_sync > 1:
            raise RuntimeError(
                f"`{method}()`: variable {getattr(var, 'name', '?')!r} was created under a {type(owner).__name__} "
                f"scope ({owner.num_replicas_in_sync} replicas in sync) but this call runs under "
                f"{type(strategy).__name__} (outside that strategy's scope, or on a thread that did not enter "
                "it). Call it inside the function given to that strategy's `run`. Nothing was updated.")


def _check_learning_rate(lr):
    if callable(lr) or is_variable(lr):
        return lr
    try:
        value = float(lr)
    except (TypeError, ValueError):
        raise TypeError(f"learning_rate must be a float, a LearningRateSchedule or a callable, got "
                        f"{type(lr).__name__} {lr!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"learning_rate must be a finite float >= 0, got {lr!r}")
    return lr


def _check_gradients(pairs):
    """`_check_gradient` of every (gradient, variable) pair: for a tape's gradients (plain Tensors) one
    comparison of the shapes and dtypes of all at once, and the per-pair checks (with their messages) only
    when that finds a difference or another kind of gradient."""
    got = [(g._t.shape, g._t.dtype) if type(g) is Tensor else None for g, _ in pairs]
    variables = [v for _, v in pairs]
    distributed = {kind for kind in set(map(type, variables)) if issubclass(kind, distribute.DistributedValues)}
    firsts = [v if type(v) is Variable else v._values[0] if type(v) in distributed else v for v in variables]
    want = [(v._t.shape, v._t.dtype) if type(v) is Variable else (tuple(v.shape), v.dtype) for v in firsts]
    if None in got or got != want:
        for g, v in pairs:
            _check_gradient(g, v)


def _check_gradient(grad, var):
    """A gradient (or each replica's part of a distributed one) must have its variable's shape and dtype.

    Broadcasting a [1] gradient over a [2] variable, or casting a float64
    one into a float32 variable, would apply an update the tape never
    computed; TF's apply ops refuse both.
    """
    if grad is None:
        return
    parts = grad.values if isinstance(grad, distribute.DistributedValues) else (grad,)
    for part in parts:
        if part is None:
            continue
        t = convert_to_tensor(part)
        if tuple(t.shape) != tuple(var.shape):
            raise ValueError(f"apply_gradients: the gradient for variable {var.name!r} has shape {list(t.shape)}, "
                             f"but the variable has shape {list(var.shape)}; pass a gradient of the variable's "
                             "shape (tape.gradient(loss, variable) gives one)")
        if t.dtype != var.dtype:
            raise TypeError(f"apply_gradients: the gradient for variable {var.name!r} has dtype {t.dtype}, but "
                            f"the variable is {var.dtype}; cast the gradient to the variable's dtype "
                            "(dtape.cast(grad, variable.dtype))")


def _check_hyper(owner, name, value, low, high, high_open=False):
    """`value` as a float in [low, high] ([low, high) when high_open); `owner` names the optimizer for the message.

    Read once, here: a callable (Keras 2 allows one for a hyperparameter, called at every step) is refused
    with a TypeError; only `learning_rate` may be a schedule or callable.
    """
    if callable(value):
        raise TypeError(f"{owner}: {name} must be a number, got the callable {value!r}: callable "
                        f"hyperparameters are not supported (only learning_rate may be a schedule or "
                        f"callable); pass the number it would return")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{owner}: {name} must be a number, got {type(value).__name__} {value!r}") from None
    above = x >= high if high_open else x > high
    if math.isnan(x) or x < low or above:
        interval = f"[{low}, {high})" if high_open else f"[{low}, {high}]"
        raise ValueError(f"{owner}: {name} must be in {interval}, got {value!r}; pass a value in that range")
    return x


def _check_clipping(clipnorm, clipvalue, global_clipnorm):
    given = [n for n, v in (("clipnorm", clipnorm), ("clipvalue", clipvalue), ("global_clipnorm", global_clipnorm))
             if v is not None]
    if len(given) > 1:
        raise ValueError(f"Only one of `clipnorm`, `clipvalue` and `global_clipnorm` can be set, got {given}")
    out = []
    for name, v in (("clipnorm", clipnorm), ("clipvalue", clipvalue), ("global_clipnorm", global_clipnorm)):
        if v is not None:
            v = float(v)
            if not v > 0 or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite float > 0, got {v!r}")
        out.append(v)
    return tuple(out)


def _takes_step(fn):
    """Whether a learning-rate callable takes the step (Keras 3 calls plain callables with none)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)


def _replica_part(grad, i):
    return convert_to_tensor(grad.values[i] if isinstance(grad, distribute.DistributedValues) else grad)


def _write(var, fn):
    """Sets component `var` to `fn(current torch value)` through the variable's one write path.

    Returns the new torch value.
    """
    return var._update_value(fn, "optimizer update")


class _Batch:
    """A list of torch tensors whose + - * / are torch._foreach_* ops: an update formula written for one
    tensor runs on every variable at once, with the same ops in the same order (bit-identical results)."""

    __slots__ = ("ts",)

    def __init__(self, ts):
        self.ts = ts

    def __add__(self, o):
        return _Batch(torch._foreach_add(self.ts, _operand(o, self.ts)))

    def __sub__(self, o):
        return _Batch(torch._foreach_sub(self.ts, _operand(o, self.ts)))

    def __mul__(self, o):
        return _Batch(torch._foreach_mul(self.ts, _operand(o, self.ts)))

    def __truediv__(self, o):
        return _Batch(torch._foreach_div(self.ts, _operand(o, self.ts)))

    __radd__ = __add__  # number + batch: IEEE addition and multiplication are commutative, so exact
    __rmul__ = __mul__

    # in place (the `inplace` formulas of `_write_all`): the same foreach ops, written into self
    def add_(self, o, alpha=None):
        if alpha is None:
            torch._foreach_add_(self.ts, _operand(o, self.ts))
        elif isinstance(alpha, torch.Tensor):  # a traced learning rate: torch's Scalar alpha would read it
            torch._foreach_add_(self.ts, torch._foreach_mul(_operand(o, self.ts), _operand(alpha, self.ts)))
        else:
            torch._foreach_add_(self.ts, _operand(o, self.ts), alpha=alpha)
        return self

    def sub_(self, o):
        torch._foreach_sub_(self.ts, _operand(o, self.ts))
        return self

    def mul_(self, o):
        torch._foreach_mul_(self.ts, _operand(o, self.ts))
        return self


def _operand(o, like):
    """`o` as a foreach operand for the tensors `like`: a batch's list; a scalar tensor (a traced learning rate
    or step size) on their device."""
    if isinstance(o, _Batch):
        return o.ts
    if isinstance(o, torch.Tensor) and like and o.device != like[0].device:
        return o.to(like[0].device)
    return o


def _sqrt(x):
    return _Batch(torch._foreach_sqrt(x.ts))


def _add(a, b, alpha):
    """torch.add(a, b, alpha=alpha), batched; a tensor alpha (traced) multiplies first."""
    if isinstance(alpha, torch.Tensor):
        return a + b * alpha
    return _Batch(torch._foreach_add(a.ts, b.ts, alpha=alpha))


def _write_all(variables, fn, *operands, inplace=None):
    """Sets each variable k to `fn(value_k, *operands_k)`, computed for all at once; returns the new values.

    `fn` is written for single tensors and gets `_Batch`es (operands: lists of
    torch tensors parallel to `variables`). It runs on a snapshot of the
    values; each result is then committed through the variable's one write
    path (`_update_value`, under its lock). A variable written by someone
    else since the snapshot gets `fn` of its current value instead, alone:
    no concurrent write is lost, exactly as with one update per variable.

    `inplace(values, *operands)`, when given, writes the same results into
    the values (`_Batch`es; its `add_`/`sub_`/`mul_`) with the same torch ops
    in the same order (bit-identical). It runs on every variable at once, in
    place where nothing but the variable holds its tensor and on a copy
    elsewhere (see `variables.update_together`): no new weights and slots
    are allocated per step, as with torch's optimizers. A list naming a
    variable twice goes variable by variable.
    """
    if inplace is not None:
        done = update_together(variables, lambda ts: inplace(_Batch(ts), *(_Batch(list(o)) for o in operands)))
        if done is not None:
            return done
        return [v._update_value(functools.partial(_recompute, fn, [o[k] for o in operands]),
                                "optimizer update", inplace=functools.partial(_in_place, inplace, [o[k] for o in operands]))
                for k, v in enumerate(variables)]
    olds = [v.torch() for v in variables]
    news = fn(_Batch(olds), *(_Batch(list(o)) for o in operands)).ts
    return [v._update_value(functools.partial(_commit, olds[k], news[k], fn, [o[k] for o in operands]),
                            "optimizer update")
            for k, v in enumerate(variables)]


def _in_place(inplace, operands, current):
    inplace(_Batch([current]), *(_Batch([o]) for o in operands))


def _commit(old, new, fn, operands, current):
    """`new` if the variable still holds `old`, else `fn` recomputed on its current value (runs under its lock)."""
    return new if current is old else _recompute(fn, operands, current)


def _recompute(fn, operands, current):
    """`fn` on one variable's current value (the batched formula on a batch of one)."""
    return fn(_Batch([current]), *(_Batch([o]) for o in operands)).ts[0]


def _slot_key(var):
    """A never-reused key for a variable (a container: its primary component's id)."""
    handle = var.values[0] if isinstance(var, distribute.DistributedValues) else var
    return handle._id


def _forget_slots(optimizer_ref, key):
    """Finalizer of a variable: its slots go with it (if the optimizer still exists)."""
    optimizer = optimizer_ref()
    if optimizer is not None:
        optimizer._slots.pop(key, None)
        optimizer._slot_primary.pop(key, None)


def _drop_missing(pairs):
    """The pairs with a gradient; warns naming the variables that have none (on any replica)."""
    missing = [v.name for g, v in pairs if g is None]
    if missing:
        warnings.warn(f"Gradients do not exist for variables {missing} when minimizing the loss", stacklevel=4)
    return [(g, v) for g, v in pairs if g is not None]


def _fill_missing(grad, var, devices):
    """A PerReplica gradient with zeros (on the replica's device) where a replica had None."""
    if not isinstance(grad, distribute.PerReplica) or all(g is not None for g in grad.values):
        return grad
    return distribute.PerReplica(tuple(
        Tensor(torch.zeros(tuple(var.shape), dtype=var.dtype, device=normalize_device(d))) if g is None else g
        for g, d in zip(grad.values, devices)))


def _component_index(component):
    """The index of `component` among its container's components (0 for a plain variable)."""
    container = distribute.value_container(component)
    return next((i for i, x in enumerate(getattr(container, "values", ())) if x is component), 0)


def _component_like(slot, var):
    """The slot component on the same replica as component `var`."""
    comps = getattr(slot, "values", None)
    container = distribute.value_container(var)
    if comps is None or container is var:
        return slot
    return comps[next(i for i, c in enumerate(container.values) if c is var)]


def _scope(strategy):
    return contextlib.nullcontext() if getattr(strategy, "_is_default", True) else strategy.scope()


class SGD(Optimizer):
    """Stochastic gradient descent with optional (Nesterov) momentum, Keras formulas.

    velocity = momentum * velocity - lr * g; w += velocity
    (Nesterov: w += momentum * velocity - lr * g). Source: tf.keras.optimizers.SGD.
    """

    def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False, name="SGD", **clipping):
        super().__init__(learning_rate, name, **clipping)
        self.momentum = _check_hyper("SGD", "momentum", momentum, 0.0, 1.0)
        self.nesterov = bool(nesterov)
        self._slot_names = ("momentum",) if momentum else ()

    def _update_many(self, variables, grads, slots, step):
        lr, mu = self._lr(), self.momentum
        if not mu:
            _write_all(variables, lambda w, g: _add(w, g, -lr), grads, inplace=lambda w, g: w.add_(g, alpha=-lr))
            return
        velocity = _write_all([s["momentum"] for s in slots], lambda m, g: _add(mu * m, g, -lr), grads,
                              inplace=lambda m, g: m.mul_(mu).add_(g, alpha=-lr))
        delta = _add(mu * _Batch(velocity), _Batch(grads), -lr).ts if self.nesterov else velocity
        _write_all(variables, lambda w, d: w + d, delta, inplace=lambda w, d: w.add_(d))


class Adam(Optimizer):
    """Adam with Keras's epsilon placement.

    lr_t = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t); m = b1 m + (1-b1) g;
    v = b2 v + (1-b2) g^2; w -= lr_t * m / (sqrt(v) + epsilon).
    Computed by torch's fused Adam kernel (AdamW: its fused AdamW kernel)
    when every variable, slot and gradient is float32 or float64 of one dtype
    on one CPU or CUDA device (one pass over each tensor; equal to the
    formula up to rounding), else by batched torch._foreach ops.
    Source: tf.keras.optimizers.Adam (Kingma & Ba, 2015, section 2).
    """

    _slot_names = ("m", "v")

    def __init__(self, learning_rate=1e-3, beta_1=0.9, beta_2=0.999, epsilon=1e-7, name="Adam", **clipping):
        super().__init__(learning_rate, name, **clipping)
        owner = type(self).__name__
        self.beta_1 = _check_hyper(owner, "beta_1", beta_1, 0.0, 1.0, high_open=True)
        self.beta_2 = _check_hyper(owner, "beta_2", beta_2, 0.0, 1.0, high_open=True)
        self.epsilon = _check_hyper(owner, "epsilon", epsilon, 0.0, math.inf, high_open=True)

    def _update_many(self, variables, grads, slots, step):
        b1, b2, eps, lr = self.beta_1, self.beta_2, self.epsilon, self._lr()
        decay = _FUSED_DECAY.get(type(self)._decay)  # None: a subclass's own decay formula
        # the fused kernel takes its epsilon as a host float (from the step): eager only
        if decay is not None and not is_tracing() and \
                _fused_adam(variables, grads, slots, step, lr, b1, b2, eps, decay(self)):
            return
        lr_t = _step_size(lr, step, b1, b2)
        m = _write_all([s["m"] for s in slots], lambda m, g: m * b1 + (1 - b1) * g, grads,
                       inplace=lambda m, g: m.mul_(b1).add_((1 - b1) * g))
        v = _write_all([s["v"] for s in slots], lambda v, g: v * b2 + (1 - b2) * g * g, grads,
                       inplace=lambda v, g: v.mul_(b2).add_((1 - b2) * g * g))
        plain = type(self)._decay is Adam._decay  # w - update, in place (AdamW's decay reads w twice)
        _write_all(variables, lambda w, m, v: self._decay(w, lr) - lr_t * m / (_sqrt(v) + eps), m, v,
                   inplace=(lambda w, m, v: w.sub_(lr_t * m / (_sqrt(v) + eps))) if plain else None)

    def _decay(self, w, lr):
        return w  # Adam: no decay (w - 0.0 would be w exactly)


def _step_size(lr, step, b1, b2):
    """Adam's `lr * sqrt(1 - b2^t) / (1 - b1^t)`: a float from host numbers, a float64 scalar tensor from a
    traced step or learning rate (no host read)."""
    if not isinstance(step, torch.Tensor) and not isinstance(lr, torch.Tensor):
        return lr * math.sqrt(1 - b2 ** step) / (1 - b1 ** step)
    t = torch.as_tensor(step).to(torch.float64)
    return lr * torch.sqrt(1 - b2 ** t) / (1 - b1 ** t)


# torch's fused Adam and AdamW kernels (torch.optim.Adam/AdamW(fused=True)), by "decoupled weight
# decay?"; None where torch lacks one (torch < 2.4 has no CPU kernel: the first call fails in the
# dispatcher, before writing anything, and sets None).
_FUSED_KERNELS = {False: getattr(torch, "_fused_adam_", None), True: getattr(torch, "_fused_adamw_", None)}
_FUSED_DTYPES = (torch.float32, torch.float64)


def _fused_adam(variables, grads, slots, step, lr, b1, b2, eps, weight_decay=0.0):
    """Adam's update (AdamW's with `weight_decay`) of every variable and its m and v slots in one pass
    of torch's fused kernel.

    The kernel divides sqrt(v) by sqrt(1 - b2^t) before adding its epsilon;
    with epsilon / sqrt(1 - b2^t) there it computes Keras's update
    (epsilon added to sqrt(v)) up to rounding; AdamW's decay w * (1 - lr *
    weight_decay) is Keras's w - lr * weight_decay * w. Same kernel in place
    and on copies (`update_together`), so results do not depend on who holds
    a tensor. Returns False, having done nothing, unless every tensor is
    float32 or float64 of one dtype on one CPU or CUDA device and beta_2 < 1.
    """
    decoupled = bool(weight_decay)
    kernel_fn = _FUSED_KERNELS[decoupled]
    if kernel_fn is None:
        return False
    dev, dt = variables[0].device, variables[0].dtype
    bias_correction2 = 1 - b2 ** step
    if dev.type not in ("cpu", "cuda") or dt not in _FUSED_DTYPES or not bias_correction2 > 0:
        return False  # beta_2 = 1: Keras's step size is 0, the kernel's would divide by 0
    ms, vs = [s["m"] for s in slots], [s["v"] for s in slots]
    for t in (*variables, *grads, *ms, *vs):
        if t.dtype != dt or t.device != dev:
            return False
    # The kernel pairs elements by memory position, so every tensor must be row-major: an expanded or
    # transposed gradient is copied, and so is (under the locks) a variable or slot of another layout.
    grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
    n = len(variables)
    steps = [torch.tensor(float(step), device=dev)] * n  # read-only: one tensor serves every variable
    eps_t = eps / math.sqrt(bias_correction2)

    def kernel(ts):
        for k, t in enumerate(ts):
            if not t.is_contiguous():  # a transposed initial or assigned value: its row-major copy
                ts[k] = t.contiguous()
        kernel_fn(ts[:n], grads, ts[n:2 * n], ts[2 * n:], [], steps, lr=lr, beta1=b1, beta2=b2,
                  weight_decay=weight_decay, eps=eps_t, amsgrad=False, maximize=False)
    try:
        return update_together(list(variables) + ms + vs, kernel) is not None
    except NotImplementedError:  # no kernel for this device (torch < 2.4 on the CPU): foreach from now on
        _FUSED_KERNELS[decoupled] = None
        return False


class AdamW(Adam):
    """Adam with decoupled weight decay: w -= lr * weight_decay * w before the Adam step.

    Source: tf.keras.optimizers.AdamW (Loshchilov & Hutter, 2019).
    """

    def __init__(self, learning_rate=1e-3, weight_decay=0.004, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 name="AdamW", **clipping):
        super().__init__(learning_rate, beta_1, beta_2, epsilon, name, **clipping)
        self.weight_decay = _check_hyper(type(self).__name__, "weight_decay", weight_decay, 0.0, math.inf,
                                         high_open=True)

    def _decay(self, w, lr):
        return w - lr * self.weight_decay * w


# The decays the fused kernels compute (optimizer -> its weight_decay), by `_decay` method: a
# subclass with a formula of its own takes the foreach path.
_FUSED_DECAY = {Adam._decay: lambda opt: 0.0, AdamW._decay: lambda opt: opt.weight_decay}


class RMSprop(Optimizer):
    """RMSprop with Keras's epsilon inside the square root.

    v = rho v + (1 - rho) g^2; (centered: a = rho a + (1 - rho) g, den = v - a^2 + eps; else den = v + eps);
    inc = lr g / sqrt(den); momentum > 0: m = momentum m + inc, w -= m; else w -= inc.
    (torch.optim.RMSprop adds eps outside the root: equal when eps = 0.)

    Args:
      learning_rate: float, schedule or callable (default 0.001).
      rho: decay of the squared-gradient average (0.9).
      momentum: float in [0, 1] (0.0).
      epsilon: 1e-7.
      centered: divide by the estimated variance instead of the second moment.
      name, clipnorm, clipvalue, global_clipnorm: see `Optimizer`.

    Source: tf.keras.optimizers.RMSprop.
    """

    def __init__(self, learning_rate=0.001, rho=0.9, momentum=0.0, epsilon=1e-7, centered=False, name="RMSprop",
                 **clipping):
        super().__init__(learning_rate, name, **clipping)
        self.rho = _check_hyper("RMSprop", "rho", rho, 0.0, 1.0)
        self.momentum = _check_hyper("RMSprop", "momentum", momentum, 0.0, 1.0)
        self.epsilon = _check_hyper("RMSprop", "epsilon", epsilon, 0.0, math.inf, high_open=True)
        self.centered = bool(centered)
        self._slot_names = ("velocity",) + (("momentum",) if self.momentum else ()) + \
            (("average_gradient",) if self.centered else ())

    def _update_many(self, variables, grads, slots, step):
        lr, rho, eps, mu = self._lr(), self.rho, self.epsilon, self.momentum
        v = _Batch(_write_all([s["velocity"] for s in slots], lambda v, g: rho * v + (1 - rho) * g * g, grads))
        if self.centered:
            a = _Batch(_write_all([s["average_gradient"] for s in slots], lambda a, g: rho * a + (1 - rho) * g,
                                  grads))
            den = v - a * a + eps
        else:
            den = v + eps
        inc = (lr * _Batch(grads) / _sqrt(den)).ts
        if mu:
            inc = _write_all([s["momentum"] for s in slots], lambda m, i: mu * m + i, inc)
        _write_all(variables, lambda w, i: w - i, inc)


class Adagrad(Optimizer):
    """Adagrad: acc += g^2; w -= lr g / sqrt(acc + epsilon) (Keras's epsilon inside the root).

    Args:
      learning_rate: float, schedule or callable (default 0.001).
      initial_accumulator_value: starting value of acc (0.1).
      epsilon: 1e-7. (torch.optim.Adagrad adds eps outside the root: equal when eps = 0.)
      name, clipnorm, clipvalue, global_clipnorm: see `Optimizer`.

    Source: tf.keras.optimizers.Adagrad.
    """

    _slot_names = ("accumulator",)

    def __init__(self, learning_rate=0.001, initial_accumulator_value=0.1, epsilon=1e-7, name="Adagrad", **clipping):
        super().__init__(learning_rate, name, **clipping)
        self.initial_accumulator_value = _check_hyper("Adagrad", "initial_accumulator_value",
                                                      initial_accumulator_value, 0.0, math.inf, high_open=True)
        self.epsilon = _check_hyper("Adagrad", "epsilon", epsilon, 0.0, math.inf, high_open=True)
        self._slot_initial = {"accumulator": self.initial_accumulator_value}

    def _update_many(self, variables, grads, slots, step):
        lr, eps = self._lr(), self.epsilon
        acc = _write_all([s["accumulator"] for s in slots], lambda a, g: a + g * g, grads)
        _write_all(variables, lambda w, g, a: w - lr * g / _sqrt(a + eps), grads, acc)


# -- torch.optim ---------------------------------------------------------------------------

def from_torch(torch_optimizer, global_clipnorm=None):
    """A dtape optimizer that runs `torch_optimizer`'s own update after the usual cross-replica sum.

    Args:
      torch_optimizer: a `torch.optim.Optimizer` (any class, any parameter
        groups and hyperparameters) built over the variables' own tensors:
        a TorchModule's `parameters()`, or `[v.torch() for v in variables]`
        (a MirroredVariable's `torch()` is its primary component).
      global_clipnorm: clip the summed gradients together to this L2 norm
        first, with `torch.nn.utils.clip_grad_norm_` itself (scale by
        min(1, max_norm / (norm + 1e-6))); None: no clipping.

    Returns:
      A `TorchOptimizer`: `apply_gradients(grads_and_vars)` as every dtape
      optimizer (see `TorchOptimizer`).

    Raises:
      TypeError: `torch_optimizer` is not a torch.optim.Optimizer.
      ValueError: a non-positive or non-finite global_clipnorm.

    Example:
      >>> opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
      ...                          {"params": no_decay, "weight_decay": 0.0}], lr=6e-4)
      >>> sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
      >>> optimizer = dtape.optimizers.from_torch(opt, global_clipnorm=1.0)
      >>> # in strategy.run: optimizer.apply_gradients(zip(grads, variables)); after it: sched.step()

    Step schedulers once per training step, outside `strategy.run` (in it,
    every replica thread would step the scheduler). Calling the torch
    optimizer's own `step()` or `zero_grad()` as well is harmless: its
    parameters have no `.grad` outside `apply_gradients`.
    """
    return TorchOptimizer(torch_optimizer, global_clipnorm=global_clipnorm)


class TorchOptimizer(Optimizer):
    """A `torch.optim.Optimizer` behind dtape's `apply_gradients` (made by `from_torch`).

    `apply_gradients` aggregates as every dtape optimizer (in a replica
    context: the bucketed SUM all-reduce of `GradientSync`, one merge_call),
    then gives each variable's tensor its summed gradient as `.grad` (for
    torch's Adam, AdamW and SGD without nesterov, whose step only reads it,
    the gradient itself; for other classes, or with `global_clipnorm`, a copy
    in a buffer kept between steps, as torch keeps `p.grad`: the gradients
    passed in are never written), runs `torch.nn.utils.clip_grad_norm_` on
    them if `global_clipnorm` is set, and the torch optimizer's `step()`:
    torch's formulas, parameter groups, hyperparameters and per-parameter state.
    Variables whose gradient is None (on every replica) are skipped, as torch
    skips parameters without `.grad`.

    Under MirroredStrategy every replica index has its own component of each
    variable: index 0 (the primary components) is updated by the user's
    optimizer itself. An index whose components are in the same memory as the
    primary ones (CPU replicas: "cpu:1" beside "cpu:0") takes their new values
    with one copy: the same kernels on the same values and gradients would give
    the same bits, and a second step would double the update's cost. An index
    on another device is updated by a private copy of the user's optimizer
    (same class, parameter groups and state), with its own optimizer state on
    that device. Before each step the copies take every hyperparameter of the
    user's parameter groups (`lr`, `betas`, `momentum`, `weight_decay`, ...),
    so a `torch.optim.lr_scheduler` stepping the user's optimizer reaches every
    replica; they take its state again after its `load_state_dict`. The copies
    see the same gradients and values, so the components stay bit-identical.
    Under MultiWorkerMirroredStrategy each worker's optimizer is the user's.

    What a step over one list of variables needs besides the gradients (their
    slots, components, `.grad` buffers) is worked out at the first step and
    kept while `apply_gradients` gets the very same variables in the same
    order; another list (or order) works it out again.

    Between steps the torch optimizer's parameters are the variables' current
    tensors (its `param_groups`); a variable's tensor is written in place
    when nothing else holds it, else its copy is updated and becomes the
    variable's value, as with every dtape optimizer (the optimizer's own
    references do not count). `state_dict()` / `load_state_dict()` are the
    torch optimizer's (plus `iterations`); `dtape.checkpoint.save(path,
    optimizer=opt)` stores that state dict and `restore` loads it (before or
    after the first step).

    `from_torch` takes the torch optimizer's parameters over: each variable is
    matched with the parameter that is its tensor (or has its memory) at the
    first `build(var_list)` or `apply_gradients`; until then its slot holds
    an empty placeholder and only a weak reference to the user's tensor, so a
    write before the first step (a checkpoint restore) stays in place and the
    match still holds.

    Raises (apply_gradients, build):
      ValueError: a variable that is none of the torch optimizer's
        parameters; a variable listed twice; under MirroredStrategy, a
        component that the step would overwrite with a copy of replica 0's
        new value differs from replica 0's (written on its own, bypassing the
        strategy: TF and dtape's optimizers would keep that write), raised
        before anything is updated. Otherwise as `Optimizer`.
    """

    _checkpoint_by_state_dict = True  # dtape.checkpoint stores state_dict() (torch's state, not dtape variables)

    def __init__(self, torch_optimizer, global_clipnorm=None, name=None):
        if not isinstance(torch_optimizer, torch.optim.Optimizer):
            raise TypeError(f"from_torch takes a torch.optim.Optimizer, got {type(torch_optimizer).__name__}; "
                            "for a dtape optimizer use it directly")
        # Not Optimizer.__init__: the learning rate is the torch optimizer's (its param_groups).
        self.name = name or type(torch_optimizer).__name__
        self.clipnorm, self.clipvalue, self.global_clipnorm = _check_clipping(None, None, global_clipnorm)
        self._slots, self._slot_primary = {}, {}
        self._iterations = None
        self.torch_optimizer = torch_optimizer
        self._slot_of = {}       # _slot_key(variable) -> (group index, position): where it is in param_groups
        self._var_at = {}        # (group index, position) -> the variable (container) there
        self._copies = {}        # replica index >= 1 -> the torch optimizer of that index's components
        self._grads = {}         # replica index -> (its parameters, their `.grad` buffers) (see _grad_buffers)
        self._plan = None        # the latest variables' _Plan: kept while apply_gradients gets the same ones
        self._stale = False      # the user's optimizer loaded a state dict since the copies were made
        self._in_sync = {}       # id(copied component) -> its and replica 0's (tensor id, version) when last equal
        torch_optimizer.register_load_state_dict_post_hook(
            functools.partial(_copies_stale, weakref.ref(self)))
        # Until a variable is matched with its slot, the slot holds an empty placeholder and only a weak
        # reference to the user's tensor: the optimizer holding it would make a write before the first step
        # (a checkpoint restore) copy the variable's tensor, which then no longer matches.
        self._pending = {}       # (group index, position) -> (weakref to the user's tensor, its _memory_key)
        self._saved_names = {}   # (group index, position) -> the variable name a loaded state dict had there
        for g, group in enumerate(torch_optimizer.param_groups):
            params = group["params"]
            for i, p in enumerate(params):
                self._pending[(g, i)] = (weakref.ref(p), _memory_key(p))
                _bind(torch_optimizer, [((g, i), None, None)], [torch.empty(0, dtype=p.dtype, device=p.device)],
                      [None])

    @property
    def learning_rate(self):
        """The first parameter group's `lr`. Setting it sets the first group's and scales every other group's
        by the same factor, as torch's schedulers scale each group's rate (Keras' ReduceLROnPlateau callback
        sets `lr * factor`: a head trained at 100x the backbone's rate keeps its 100x); every group's is set to
        the value when the first group's is 0."""
        return self.torch_optimizer.param_groups[0]["lr"]

    @learning_rate.setter
    def learning_rate(self, value):
        _check_learning_rate(value)
        first, *others = self.torch_optimizer.param_groups
        old = float(first["lr"])
        first["lr"] = value
        for group in others:
            group["lr"] = value if old == 0 else group["lr"] * (float(value) / old)

    def _lr(self):
        return float(self.learning_rate)

    def build(self, var_list):
        """Matches `var_list` with the torch optimizer's parameters now (see the class docstring)."""
        self._match([distribute.value_container(v) for v in var_list])
        return self.iterations

    def variables(self):
        """The `iterations` variable (the optimizer's state is torch's: see `state_dict`)."""
        return [self.iterations]

    def state_dict(self):
        """The torch optimizer's `state_dict()` (its tensors, not copies), plus `iterations` (an int) and
        `dtape.params`: per group, per position, [name of the variable there or None, its shape or None]."""
        out = self.torch_optimizer.state_dict()
        out["iterations"] = int(self.iterations.numpy())
        out[_PARAMS_KEY] = [[[getattr(self._var_at.get((g, i)), "name", None), self._param_shape(g, i, p)]
                             for i, p in enumerate(group["params"])]
                            for g, group in enumerate(self.torch_optimizer.param_groups)]
        return out

    def load_state_dict(self, state_dict):
        """Loads a torch optimizer state dict (as `torch.optim.Optimizer.load_state_dict`) into every replica's
        optimizer; `iterations` too when present (a dict from `state_dict()`).

        torch matches the saved state to parameters by their position in
        `param_groups`; a dict from `state_dict()` also says which variable
        (name, shape) was at each position, and a parameter listed in another
        order raises ValueError: a shape that differs here, before anything
        is loaded; a name that differs (its default-numbered parts aside) here
        or, for a variable not matched yet, at the first `build` or
        `apply_gradients`, before the step.
        """
        state_dict = dict(state_dict)
        iterations = state_dict.pop("iterations", None)
        params = state_dict.pop(_PARAMS_KEY, None)
        saved_names = {} if params is None else {(g, i): row[0] for g, rows in enumerate(params)
                                                  for i, row in enumerate(rows) if row[0] is not None}
        if params is not None:      # before torch loads anything: a mismatch leaves the optimizer as it was
            self._check_shapes(params)
            self._check_names(list(self._var_at.items()), saved_names)
        self.torch_optimizer.load_state_dict(state_dict)
        self._saved_names = saved_names
        if iterations is not None:
            with _tp.stop_recording(), _scope(getattr(self.iterations, "distribute_strategy", None)):
                self.iterations.assign(int(iterations))

    def _param_shape(self, g, i, p):
        """The shape (list) of the parameter at (g, i): its variable's, the user's tensor's; None if it is gone."""
        var = self._var_at.get((g, i))
        if var is not None:
            return list(var.shape)
        ref, _ = self._pending.get((g, i), (None, None))
        tensor = p if ref is None else ref()
        return None if tensor is None else list(tensor.shape)

    def _check_shapes(self, params):
        """Raises ValueError when a saved parameter's shape differs from the one at its position here."""
        for g, group in enumerate(self.torch_optimizer.param_groups[:len(params)]):
            for i, (p, row) in enumerate(zip(group["params"], params[g])):
                here = self._param_shape(g, i, p)
                if here is not None and row[1] is not None and list(row[1]) != here:
                    raise ValueError(
                        f"{self.name}.load_state_dict: parameter {i} of group {g} has shape {tuple(here)} here "
                        f"but {tuple(row[1])} in the saved state ({row[0] or 'unnamed'}); torch matches state by "
                        f"position, so build the torch optimizer over the parameters in the order of the run "
                        f"that saved it (e.g. model.parameters())")

    def _check_names(self, placed, saved_names):
        """Raises ValueError when a variable at (g, i) (`placed`: [((g, i), variable)]) is not the one the state
        was saved for (`saved_names`: (g, i) -> name; names compared without their default-numbered parts)."""
        for (g, i), var in placed:
            saved = saved_names.get((g, i))
            if saved is not None and _stable_name(saved) != _stable_name(var.name):
                raise ValueError(
                    f"{self.name}: the loaded state of parameter {i} of group {g} was saved for variable "
                    f"{saved!r}, but {var.name!r} is there now; torch matches state by position, so build the "
                    f"torch optimizer over the parameters in the order of the run that saved it")

    def _clip_gradients(self, pairs):
        return pairs  # clipped per replica index in `_step_index`, by torch.nn.utils.clip_grad_norm_

    def _merge_apply(self, strategy, pairs):
        """One replica in sync: the sum over the replicas is each gradient itself, so it is not reduced (an
        identity op per variable); `_step_index` copies the gradients into the `.grad` buffers, which torch's
        step may write. Several replicas: `Optimizer._merge_apply`."""
        if strategy.num_replicas_in_sync == 1 and not _any_distributed([g for g, _ in pairs]):
            return self._distributed_apply(strategy, _drop_missing(pairs))
        return super()._merge_apply(strategy, pairs)

    def _apply(self, strategy, pairs):
        plan = self._plan_for([v for _, v in pairs])
        grads = [g for g, _ in pairs]
        with _tp.stop_recording(), uninterrupted():
            self._check_copied(plan)
            stepped = plan.stepped
            optimizers = self._optimizers(stepped)
            for i in stepped:
                parts = [grads[k]._t if type(grads[k]) is Tensor else _replica_part(grads[k], i).torch()
                         for k in plan.positions[i]]
                self._step_index(i, optimizers[i], plan, parts)
            for i in plan.copied:  # same memory as index 0: its new values, bit for bit (see _Plan)
                update_together(plan.components[i], functools.partial(_copy_from, plan.sources(i)))
            self._note_copied(plan)
            self.iterations.assign_add(1)
        return self.iterations

    # -- copied replica indices: their components must still equal replica 0's ---------------------
    def _check_copied(self, plan):
        """Raises ValueError, before anything is updated, if a component that the step would overwrite with
        replica 0's new value (a copied index) differs from replica 0's: it was written on its own. TF keeps
        such a write (each component is updated with its own value); a copy would silently discard it, so
        the step refuses. Only components written since the last step (their tensor or its version moved)
        are compared; the first step compares all."""
        for i in plan.copied:
            for src, comp in zip(plan.sources(i), plan.components[i]):
                t0, t = src._t, comp._t
                if self._in_sync.get(id(comp)) != (id(t0), t0._version, id(t), t._version) and \
                        not _equal(t0, t):
                    raise _diverged_error(self.name, distribute.value_container(comp), i)

    def _note_copied(self, plan):
        """After the copies: each copied component equals replica 0's as its tensors stand now."""
        for i in plan.copied:
            for src, comp in zip(plan.sources(i), plan.components[i]):
                t0, t = src._t, comp._t
                self._in_sync[id(comp)] = (id(t0), t0._version, id(t), t._version)

    def _plan_for(self, variables):
        """The _Plan of `variables`: the cached one while they are the very same objects in the same order
        (a variable's slot never changes once matched), else a new one (matching any new variable first)."""
        plan = self._plan
        if plan is not None and len(plan.variables) == len(variables) and \
                all(map(operator.is_, plan.variables, variables)):
            return plan
        if len({id(v) for v in variables}) != len(variables):
            raise ValueError(f"{self.name}.apply_gradients: a variable is listed twice; pass each variable once "
                             "(sum its gradients first)")
        self._match(variables)
        plan = self._plan = _Plan(variables, [self._slot_of[_slot_key(v)] for v in variables])
        for i in plan.copied:  # its optimizer state would go stale: a later step of that index starts afresh
            self._copies.pop(i, None)
        return plan

    # -- matching variables with the torch optimizer's parameters -----------------------------
    def _match(self, variables):
        """Finds each new variable's slot in the torch optimizer: the parameter that is one of its component
        tensors or has exactly its memory; the user's optimizer then holds the primary component's tensor."""
        todo = [v for v in variables if _slot_key(v) not in self._slot_of]
        if not todo:
            return
        user = self.torch_optimizer
        by_id, by_memory, alive = {}, {}, []
        for g, group in enumerate(user.param_groups):
            for i, p in enumerate(group["params"]):
                if (g, i) in self._var_at:
                    continue
                ref, key = self._pending.get((g, i), (None, None))
                if ref is not None:
                    p = ref()  # None: the user's tensor is gone, so no variable holds it
                else:
                    key = _memory_key(p)  # a group added after from_torch holds the tensors themselves
                if p is None:
                    continue
                alive.append(p)  # alive while matching: its memory cannot be reused by another tensor meanwhile
                by_id[id(p)] = (g, i)
                if key is not None:
                    by_memory[key] = (g, i)
        found, missing = {}, []
        for var in todo:
            comps = var.values if isinstance(var, distribute.DistributedValues) else (var,)
            slot = next((s for s in (by_id.get(id(c.torch())) or by_memory.get(_memory_key(c.torch()))
                                     for c in comps) if s is not None), None)
            if slot is None or slot in found.values():
                missing.append(var)
            else:
                found[_slot_key(var)] = slot
        del alive
        if missing:
            names = ", ".join(f"{v.name!r} {list(v.shape)}" for v in missing[:4])
            names += f" and {len(missing) - 4} more" if len(missing) > 4 else ""
            raise ValueError(
                f"{self.name}: variables {names} are not parameters of the torch optimizer (none of its parameters "
                f"is their tensor or has its memory). Build the torch optimizer over the variables' own tensors "
                f"(a TorchModule's parameters(), or [v.torch() for v in variables]), not over copies or the "
                f"tensors of another module")
        self._check_names([(found[_slot_key(var)], var) for var in todo], self._saved_names)
        for var in todo:
            slot = found[_slot_key(var)]
            self._slot_of[_slot_key(var)] = slot
            self._var_at[slot] = var
            self._pending.pop(slot, None)
            comps = var.values if isinstance(var, distribute.DistributedValues) else (var,)
            _bind(user, [(slot, None, None)], [comps[0].torch()], [None])

    # -- one torch optimizer per replica index ---------------------------------------------------
    def _optimizers(self, indices):
        """{i: the torch optimizer of replica index i for i in `indices`}: the user's for 0, else its copy
        (made or refreshed before any index steps, so every copy starts from the user's state)."""
        user = self.torch_optimizer
        layout = [len(g["params"]) for g in user.param_groups]
        if self._stale or any([len(g["params"]) for g in c.param_groups] != layout for c in self._copies.values()):
            self._grads = {0: self._grads[0]} if 0 in self._grads else {}
            self._copies.clear()
            self._stale = False
        missing = [i for i in indices if i and i not in self._copies]
        if missing:
            state = user.state_dict()
            for i in missing:
                self._copies[i] = _copy_optimizer(user, self._index_params(i), copy.deepcopy(state))
                self._grads.pop(i, None)
        for c in self._copies.values():  # the hyperparameters a scheduler (or the user) set on the user's groups
            for mine, theirs in zip(c.param_groups, user.param_groups):
                for key, value in theirs.items():
                    if key != "params":
                        mine[key] = value
        return {i: self._copies[i] if i else user for i in indices}

    def _index_params(self, index):
        """{slot: replica `index`'s component tensor} for the matched variables with such a component."""
        out = {}
        for slot, var in self._var_at.items():
            comps = var.values if isinstance(var, distribute.DistributedValues) else (var,)
            if index < len(comps):
                out[slot] = comps[index].torch()
        return out

    def _grad_buffers(self, index, tensors):
        """The `.grad` tensors of replica `index`'s parameters `tensors`: kept from step to step while the
        parameters are the same tensors with the same shapes, dtypes and devices (torch keeps `p.grad`), so a
        step that writes its gradients (clipping does) writes these private copies, never the gradients given
        to apply_gradients nor another replica's. Only the parameters' ids are kept: a reference would make
        every update of a variable that does not share its storage write a copy."""
        ids, meta = list(map(id, tensors)), [(t.shape, t.dtype, t.device) for t in tensors]
        kept = self._grads.get(index)
        if kept is not None and kept[0] == ids and kept[2] == meta:
            return kept[1]
        old = {} if kept is None else dict(zip(kept[0], kept[1]))
        buffers = [_reuse(old.get(i), t) for i, t in zip(ids, tensors)]
        self._grads[index] = (ids, buffers, meta)
        return buffers

    def _step_index(self, index, opt, plan, grads):
        """Runs `opt.step()` on replica `index`'s components with their summed gradients `grads` as `.grad`."""
        comps, entries = plan.components[index], plan.entries[index]
        # let go of the tensors that update_together may copy: it must see who else holds them (a variable
        # sharing its storage with its module's parameter is always written in place)
        released = None if plan.shared[index] else self._release(opt, entries)

        def step(tensors):  # under the variables' locks, on their tensors or their copies
            _bind(opt, entries, tensors, released or _NONE * len(entries))
            lent = self.global_clipnorm is None and _reads_grads_only(opt) and _lendable(grads, tensors)
            if lent:  # the step only reads them: no copy (torch's own step reads what backward left)
                given = grads
                versions = [g._version for g in grads]
            else:
                given = self._grad_buffers(index, tensors)
                torch._foreach_copy_(given, grads)  # one call, not one per variable
            for t, g in zip(tensors, given):
                t.grad = g
            try:
                if self.global_clipnorm is not None:
                    torch.nn.utils.clip_grad_norm_(tensors, self.global_clipnorm)
                opt.step()
            finally:
                for t in tensors:
                    t.grad = None
            if lent and [g._version for g in grads] != versions:
                raise RuntimeError(_wrote_grads_message(opt))
        if released is None:  # written in place: the optimizer holds the variables' tensors already
            update_together(comps, step)
            return
        try:
            update_together(comps, step)
        finally:  # the optimizer's parameters: what the variables hold now (also if the step failed)
            _bind(opt, entries, [c.torch() for c in comps], released)

    @staticmethod
    def _release(opt, entries):
        """Takes `entries`' parameters (and their state) out of `opt`; returns their states."""
        saved = []
        for (g, i), _, _ in entries:
            params = opt.param_groups[g]["params"]
            saved.append(opt.state.pop(params[i], None))
            params[i] = None
        return saved


class _Plan:
    """What an apply_gradients step over one list of variables needs besides the gradients, worked out once.

    For replica index i: `positions[i]`, the variables with a component there (all of them, but for plain
    variables among mirrored ones: index 0 only); `components[i]` those components; `entries[i]`
    [(slot, None, None)] for them (the form `_bind` takes); `shared[i]`: every one shares its storage with
    its module's parameter (always written in place, so the optimizer may keep holding it). `stepped`: the
    indices whose torch optimizer steps: 0, and every index with a component on another device than its
    index-0 component (CPU devices are one memory) or of a sync-on-read variable; `copied`: the other indices, which take index 0's new
    values with one copy instead of a step of their own: the same values as the same kernels on the same
    inputs would give. Valid while the variables are the same objects (their slots, components and devices
    are fixed).
    """

    __slots__ = ("variables", "positions", "entries", "components", "shared", "stepped", "copied")

    def __init__(self, variables, slots):
        self.variables = tuple(variables)
        parts = [v.values if isinstance(v, distribute.DistributedValues) else (v,) for v in variables]
        n = max((len(p) for p in parts), default=1)
        self.positions = [[k for k, p in enumerate(parts) if i < len(p)] for i in range(n)]
        self.entries = [[(slots[k], None, None) for k in ks] for ks in self.positions]
        self.components = [[parts[k][i] for k in ks] for i, ks in enumerate(self.positions)]
        self.shared = [all(getattr(c, "_shared", False) for c in comps) for comps in self.components]
        # a copy is index 0's values: only for mirrored variables (a sync-on-read one holds each replica's own)
        same = [all(isinstance(variables[k], distribute.MirroredVariable) and
                    _same_memory(parts[k][i].device, parts[k][0].device) for k in ks)
                for i, ks in enumerate(self.positions)]
        self.stepped = [i for i in range(n) if i == 0 or not same[i]]
        self.copied = [i for i in range(1, n) if same[i]]

    def sources(self, i):
        """The index-0 components of the variables at index i (what a copied index takes its values from)."""
        first = dict(zip(self.positions[0], self.components[0]))
        return [first[k] for k in self.positions[i]]


def _any_distributed(values):
    # by type, each type once: a model's gradients are a few types (one call per value adds up every step)
    for kind in set(map(type, values)):
        if issubclass(kind, distribute.DistributedValues):
            return True
    return False


def _same_memory(a, b):
    """Devices whose tensors are in one memory: the same device, or two CPU devices ("cpu:0", "cpu:1")."""
    return a == b or (a.type == "cpu" and b.type == "cpu")


def _copy_from(sources, tensors):
    torch._foreach_copy_(tensors, [s.torch() for s in sources])


def _equal(a, b):
    """Bit-for-bit equal values (NaNs in the same places count as equal), on `a`'s device."""
    b = b.to(a.device)
    return torch.equal(a, b) or bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all()) \
        if a.is_floating_point() else torch.equal(a, b)


def _diverged_error(name, var, index):
    return ValueError(
        f"{name}.apply_gradients: replica {index}'s component of MirroredVariable {var.name!r} differs from "
        f"replica 0's: it was written on its own since the last step (e.g. var.values[{index}].assign(...), or, "
        f"for replica 0, in place through the wrapped torch module's parameter, which is replica 0's component, "
        f"inside strategy.run: module.load_state_dict(...), torch.nn.init.*_; made between steps, such a write "
        f"reaches every replica at the next strategy.run). This step would update replica {index} by copying "
        f"replica 0's new value, discarding that write (TF updates each component from its own value, and "
        f"strategy.extended.check_mirrored() reports the difference). Write every replica instead: "
        f"var.assign(value) in the cross-replica context, or the TorchModule's load_state_dict. Nothing was "
        f"updated.")


def _reuse(buf, param):
    """`buf` if it can be `param`'s `.grad` (its shape, strides, dtype and device), else a new one."""
    if buf is None or buf.shape != param.shape or buf.stride() != param.stride() or \
            buf.dtype != param.dtype or buf.device != param.device:
        return torch.empty_like(param)
    return buf


# torch optimizers whose step only reads `p.grad` under the flags below (torch 2.x sources: Adam/AdamW
# rebind `grad = grad.add(...)` / `-grad`, and write in place only with differentiable=True; SGD's foreach
# nesterov path adds the momentum into the gradients in place). Others get a private copy as `.grad`.
_READS_GRADS_ONLY = {torch.optim.Adam: (), torch.optim.AdamW: (), torch.optim.SGD: ("nesterov",)}


def _reads_grads_only(opt):
    """True if torch optimizer `opt`'s step leaves its `.grad` tensors unwritten (exact class, every group's
    flags): the gradients given to apply_gradients can then be its `.grad` without a copy."""
    writers = _READS_GRADS_ONLY.get(type(opt))
    if writers is None:
        return False
    return not any(group.get("differentiable") or group.get("fused") or any(group.get(k) for k in writers)
                   for group in opt.param_groups)


def _lendable(grads, tensors):
    """True if every gradient can be its tensor's `.grad` as it is: contiguous, on its device, none in the
    memory of a tensor the step writes (a gradient passed through from a variable's value would change under
    the update of that variable). Shapes and dtypes were checked by apply_gradients (`_check_gradients`).
    Plain loops: this runs on every step."""
    for g, t in zip(grads, tensors):
        if not g.is_contiguous() or g.device != t.device:
            return False
    written = {t.untyped_storage().data_ptr() for t in tensors}
    for g in grads:
        if g.untyped_storage().data_ptr() in written:
            return False
    return True


def _wrote_grads_message(opt):
    return (f"{type(opt).__name__}.step() wrote the gradients given to apply_gradients in place, which dtape "
            "lends it without a copy for this class; please report it (torch's version and the optimizer's "
            "arguments); meanwhile set global_clipnorm or use a subclass, which get a private copy")


_PARAMS_KEY = "dtape.params"
_NONE = [None]


def _stable_name(name):
    """`name` with its default-numbered components (`Variable_3`, `torch_module_2`, `dense`) as "*": their
    numbers depend on what else the process created (dtape.checkpoint compares names the same way)."""
    return "/".join("*" if default_name_part(part) else part for part in name.split("/"))


def _copies_stale(optimizer_ref, torch_optimizer):
    """The user's optimizer loaded a state dict: the replicas' copies take it before the next step."""
    optimizer = optimizer_ref()
    if optimizer is not None:
        optimizer._stale = True


def _memory_key(t):
    """Where tensor `t`'s elements are (storage, offset, shape, strides, dtype, device); None for no elements."""
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)


def _copy_optimizer(user, params, state_dict):
    """A torch optimizer of `user`'s class and parameter groups over `params` ({slot: tensor}; an empty
    placeholder on the user's parameter's device elsewhere), with `state_dict` loaded. `user`'s
    per-instance `step` (a scheduler's wrapper) and hooks are not copied."""
    clone = type(user).__new__(type(user))
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "params": [params[(g, i)] if (g, i) in params else torch.empty(0, dtype=p.dtype, device=p.device)
                          for i, p in enumerate(group["params"])]}
              for g, group in enumerate(user.param_groups)]
    torch.optim.Optimizer.__init__(clone, groups, user.defaults)
    for key, value in user.__dict__.items():  # flags a subclass's __init__ set (e.g. _step_supports_amp_scaling)
        if key not in clone.__dict__ and key not in ("step", "_opt_called"):
            clone.__dict__[key] = value
    clone.load_state_dict(state_dict)
    return clone


def _bind(opt, entries, tensors, released):
    """Makes `tensors` the parameters at `entries`' slots of `opt`, each with its state: that of the slot's
    current tensor, or (a slot let go of, None) its entry in `released`."""
    for ((g, i), _, _), t, state in zip(entries, tensors, released):
        params = opt.param_groups[g]["params"]
        if params[i] is t:  # already there with its state (an in-place step): nothing to move
            continue
        if params[i] is not None:
            state = opt.state.pop(params[i], None)
        params[i] = t
        if state is not None:
            opt.state[t] = state


__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "TorchOptimizer", "from_torch", "schedules"]
