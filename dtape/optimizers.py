"""Optimizers with the Keras update formulas, distribution-aware.

Under a strategy, `apply_gradients` in a replica context all-reduces the
gradients (SUM) in one `merge_call` and applies one update to every
component, so mirrored components stay bit-identical. Slot variables are
created in their variable's strategy scope, so they are mirrored like it.
Every write goes through `Variable._update_value` (the variable's lock);
slots are keyed by the variable's never-reused id and freed when it dies.
Source: tf.keras.optimizers (SGD, Adam, AdamW).
"""
import contextlib
import math
import warnings
import weakref

import torch

from dtape import distribute
from dtape import tape as _tp
from dtape.distribute.cross_device_ops import reduce_non_distributed_value
from dtape.distribute.reduce_util import ReduceOp
from dtape.tensor import Tensor, convert_to_tensor, normalize_device
from dtape.variables import Variable, VariableAggregation


class Optimizer:
    """Base class: slot bookkeeping, gradient aggregation, the update loop.

    Subclasses define `_slot_names` and `_update(var, grad, slots, step)`
    (`var` a component Variable, `grad` a torch.Tensor on its device); they
    write with `_write(variable, fn)`, never by touching a variable's tensor.
    """

    _slot_names = ()

    def __init__(self, learning_rate, name):
        self.learning_rate = learning_rate
        self.name = name
        self._slots = {}          # _slot_key(var) -> {slot name: variable}, in creation order
        self._iterations = None

    @property
    def iterations(self):
        """Number of applied steps (an int64 variable, mirrored under a strategy)."""
        if self._iterations is None:
            self._iterations = self._make_variable(0, torch.int64, None, "iterations")
        return self._iterations

    def _make_variable(self, value, dtype, like, name):
        strategy = getattr(like, "distribute_strategy", None) or distribute.get_strategy()
        with _tp.stop_recording(), _scope(strategy):
            init = torch.zeros((), dtype=dtype) + value if like is None else torch.zeros_like(like.torch())
            return Variable(init, trainable=False, name=f"{self.name}/{name}",
                            aggregation=VariableAggregation.ONLY_FIRST_REPLICA)

    def _slots_for(self, var):
        key = _slot_key(var)
        slots = self._slots.get(key)
        if slots is None:
            slots = {n: self._make_variable(0, None, var, f"{var.name}/{n}") for n in self._slot_names}
            self._slots[key] = slots
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
        return self.iterations

    def variables(self):
        """The optimizer's state: iterations, then slots in creation order."""
        out = [self.iterations]
        for slots in self._slots.values():
            out.extend(slots.values())
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
        as given (None skipped, with a warning).

        Returns:
          The iterations variable.

        Raises:
          ValueError: (under a strategy) a gradient that is the same object
            on every replica (not distributed) cannot be summed.
        """
        pairs = [(g, v) for g, v in grads_and_vars]
        ctx = distribute.get_replica_context()
        if ctx is not None and ctx.num_replicas_in_sync > 1:
            reduced = distribute.gradient_sync.reduce_gradients(pairs)
            return ctx.merge_call(self._merge_apply_reduced, args=(reduced, [g for g, _ in pairs]))
        if ctx is not None:
            return ctx.merge_call(self._merge_apply, args=(pairs,))
        return self._apply(distribute.get_strategy(), _drop_missing(pairs))

    def _merge_apply(self, strategy, pairs):
        """merge_fn: fills one-sided None gradients with zeros, sums over replicas, applies."""
        devices = strategy.extended.worker_devices
        kept = [(_fill_missing(g, v, devices), v) for g, v in _drop_missing(pairs)]
        reduced = strategy.extended.batch_reduce_to(ReduceOp.SUM, kept)
        return self._apply(strategy, [(g, v) for g, (_, v) in zip(reduced, kept)])

    def _merge_apply_reduced(self, strategy, pairs, given):
        """merge_fn: the gradients are already summed (each replica holds an identical copy): applies.

        `given` (the gradients as passed, grouped): one that is the same object
        on every replica is not distributed, and summing it raises (as TF).
        """
        for g in given:
            if g is not None and not isinstance(g, distribute.DistributedValues):
                reduce_non_distributed_value(ReduceOp.SUM, g, strategy.num_replicas_in_sync)
        return self._apply(strategy, _drop_missing(pairs))

    def _apply(self, strategy, pairs):
        for _, var in pairs:  # slots are made here, once, in the cross-replica context
            self._slots_for(distribute.value_container(var))
        step = int(self.iterations.numpy()) + 1
        with _tp.stop_recording():
            for grad, var in pairs:
                strategy.extended.update(var, self._apply_one, args=(grad, step))
            self.iterations.assign_add(1)
        return self.iterations

    def _apply_one(self, var, grad, step):
        container = distribute.value_container(var)
        slots = {n: _component_like(s, var) for n, s in self._slots_for(container).items()}
        self._update(var, convert_to_tensor(grad).torch().to(var.device), slots, step)

    def minimize(self, loss, var_list, tape):
        """Computes the gradients of `loss` with `tape` and applies them to `var_list`."""
        grads = tape.gradient(loss, var_list)
        return self.apply_gradients(zip(grads, var_list))

    def _lr(self):
        lr = self.learning_rate
        return float(lr(int(self.iterations.numpy()))) if callable(lr) else float(lr)


def _write(var, fn):
    """Sets component `var` to `fn(current torch value)` through the variable's one write path.

    Returns the new torch value.
    """
    return var._update_value(fn, "optimizer update")


def _slot_key(var):
    """A never-reused key for a variable (a container: its primary component's id)."""
    handle = var.values[0] if isinstance(var, distribute.DistributedValues) else var
    return handle._id


def _forget_slots(optimizer_ref, key):
    """Finalizer of a variable: its slots go with it (if the optimizer still exists)."""
    optimizer = optimizer_ref()
    if optimizer is not None:
        optimizer._slots.pop(key, None)


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

    def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False, name="SGD"):
        super().__init__(learning_rate, name)
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"SGD momentum must be in [0, 1], got {momentum}")
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self._slot_names = ("momentum",) if momentum else ()

    def _update(self, var, g, slots, step):
        lr = self._lr()
        if not self.momentum:
            _write(var, lambda w: torch.add(w, g, alpha=-lr))
            return
        velocity = _write(slots["momentum"], lambda m: torch.add(self.momentum * m, g, alpha=-lr))
        delta = torch.add(self.momentum * velocity, g, alpha=-lr) if self.nesterov else velocity
        _write(var, lambda w: w + delta)


class Adam(Optimizer):
    """Adam with Keras's epsilon placement.

    lr_t = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t); m = b1 m + (1-b1) g;
    v = b2 v + (1-b2) g^2; w -= lr_t * m / (sqrt(v) + epsilon).
    Source: tf.keras.optimizers.Adam (Kingma & Ba, 2015, section 2).
    """

    _slot_names = ("m", "v")

    def __init__(self, learning_rate=1e-3, beta_1=0.9, beta_2=0.999, epsilon=1e-7, name="Adam"):
        super().__init__(learning_rate, name)
        self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), float(epsilon)

    def _update(self, var, g, slots, step):
        b1, b2 = self.beta_1, self.beta_2
        lr_t = self._lr() * math.sqrt(1 - b2 ** step) / (1 - b1 ** step)
        m = _write(slots["m"], lambda m: m * b1 + (1 - b1) * g)
        v = _write(slots["v"], lambda v: v * b2 + (1 - b2) * g * g)
        _write(var, lambda w: w - self._decay(w) - lr_t * m / (torch.sqrt(v) + self.epsilon))

    def _decay(self, w):
        return 0.0


class AdamW(Adam):
    """Adam with decoupled weight decay: w -= lr * weight_decay * w before the Adam step.

    Source: tf.keras.optimizers.AdamW (Loshchilov & Hutter, 2019).
    """

    def __init__(self, learning_rate=1e-3, weight_decay=0.004, beta_1=0.9, beta_2=0.999, epsilon=1e-7,
                 name="AdamW"):
        super().__init__(learning_rate, beta_1, beta_2, epsilon, name)
        self.weight_decay = float(weight_decay)

    def _decay(self, w):
        return self._lr() * self.weight_decay * w


__all__ = ["Optimizer", "SGD", "Adam", "AdamW"]
