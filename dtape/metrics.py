"""Streaming metrics: Mean, Sum, Accuracy, SparseCategoricalAccuracy (Keras API).

State lives in sync-on-read variables (synchronization ON_READ, aggregation
SUM): created inside a strategy's scope they become `SyncOnReadVariable`s,
so `update_state` inside `strategy.run` adds to this replica's component
only (no communication per step) and `result()` in the cross-replica
context reads the SUM over replicas: the metric of the global data, equal
to the metric computed on one device. Outside a strategy they are plain
variables (concurrent updates are serialised by the variable's lock).
Updates are never recorded on tapes.
Source: tf.keras.metrics.
"""
import torch

from dtape import tape as _tp
from dtape.module import Module
from dtape.ops import array_ops as _array
from dtape.ops import math_ops as _math
from dtape.tensor import convert_to_tensor, is_variable
from dtape.variables import Variable, VariableAggregation, VariableSynchronization

__all__ = ["Metric", "Mean", "Sum", "Accuracy", "SparseCategoricalAccuracy", "MeanMetricWrapper"]


def _tensor(x):
    return x._dtape_read() if is_variable(x) else convert_to_tensor(x)


class Metric(Module):
    """Base class: state variables, `update_state(...)`, `result()`, `reset_state()`.

    Args:
      name: the metric's name.
      dtype: torch floating dtype of the state (default float32).

    Create metrics inside `strategy.scope()` to use them under a strategy.
    Source: tf.keras.metrics.Metric.
    """

    def __init__(self, name=None, dtype=torch.float32):
        super().__init__(name=name)
        self.dtype = dtype
        self._state = []

    def add_variable(self, name, shape=(), initializer=0.0):
        """A sync-on-read (SUM) state variable `<metric>/<name>` of `shape`, not trainable."""
        var = Variable(torch.full(tuple(shape), float(initializer), dtype=self.dtype), trainable=False,
                       name=f"{self.name}/{name}", synchronization=VariableSynchronization.ON_READ,
                       aggregation=VariableAggregation.SUM)
        self._state.append((var, float(initializer)))
        return var

    add_weight = add_variable

    def update_state(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must define update_state")

    def result(self):
        raise NotImplementedError(f"{type(self).__name__} must define result")

    def reset_state(self):
        """Sets every state variable back to its initial value (call it in the cross-replica context)."""
        for var, init in self._state:
            var.assign(torch.full(tuple(var.shape), init, dtype=self.dtype))

    reset_states = reset_state

    def __call__(self, *args, **kwargs):
        """`update_state(*args, **kwargs)`, then `result()`."""
        self.update_state(*args, **kwargs)
        return self.result()


class _Reduce(Metric):
    """Weighted sum (and count) of values; `Mean` divides, `Sum` does not."""

    _with_count = True

    def __init__(self, name=None, dtype=torch.float32):
        super().__init__(name=name, dtype=dtype)
        self.total = self.add_variable("total")
        if self._with_count:
            self.count = self.add_variable("count")

    def update_state(self, values, sample_weight=None):
        """Adds `values` (any shape; weighted by `sample_weight`, broadcastable to values) to the state."""
        with _tp.stop_recording():
            values = _array.cast(_tensor(values), self.dtype)
            if sample_weight is None:
                total, count = _math.reduce_sum(values), float(_numel(values))
            else:
                weight = _array.cast(_tensor(sample_weight), self.dtype)
                weight = _match_rank(weight, values)
                values, weight = values * weight, _array.broadcast_to(weight, tuple(values.shape))
                total, count = _math.reduce_sum(values), _math.reduce_sum(weight)
            self.total.assign_add(total)
            if self._with_count:
                self.count.assign_add(count)


def _match_rank(weight, values):
    while weight.ndim > values.ndim and weight.shape[-1] == 1:
        weight = _array.squeeze(weight, -1)
    while weight.ndim < values.ndim:
        weight = _array.expand_dims(weight, -1)
    return weight


def _numel(t):
    n = 1
    for s in t.shape:
        n *= int(s)
    return n


class Mean(_Reduce):
    """The (weighted) mean of every value given: `sum(values * w) / sum(w)` (0 before any update).

    Variables: `total`, `count` (float32 scalars, sync-on-read SUM).
    Source: tf.keras.metrics.Mean.

    Example:
      >>> m = dtape.metrics.Mean()
      >>> m.update_state([1.0, 2.0, 6.0])
      >>> float(m.result())
      3.0
    """

    def __init__(self, name="mean", dtype=torch.float32):
        super().__init__(name=name, dtype=dtype)

    def result(self):
        """total / count as a scalar Tensor (0 when count is 0, as Keras' divide_no_nan)."""
        with _tp.stop_recording():
            total, count = self.total.read_value(), self.count.read_value()
            return _math.divide(total, _math.maximum(count, 1e-30)) * _array.cast(count > 0, self.dtype)


class Sum(_Reduce):
    """The (weighted) sum of every value given. Variable: `total`. Source: tf.keras.metrics.Sum."""

    _with_count = False

    def __init__(self, name="sum", dtype=torch.float32):
        super().__init__(name=name, dtype=dtype)

    def result(self):
        with _tp.stop_recording():
            return _array.identity(self.total.read_value())


class MeanMetricWrapper(Mean):
    """Mean of `fn(y_true, y_pred)` per example. Source: tf.keras.metrics.MeanMetricWrapper."""

    def __init__(self, fn, name=None, dtype=torch.float32):
        super().__init__(name=name or getattr(fn, "__name__", "mean_metric"), dtype=dtype)
        self._fn = fn

    def update_state(self, y_true, y_pred, sample_weight=None):
        with _tp.stop_recording():
            super().update_state(self._fn(y_true, y_pred), sample_weight)


def accuracy(y_true, y_pred):
    """1.0 where `y_pred == y_true` elementwise, else 0.0 (float32). Source: tf.keras.metrics.accuracy."""
    y_true, y_pred = _tensor(y_true), _tensor(y_pred)
    if y_true.ndim == y_pred.ndim + 1 and y_true.shape[-1] == 1:
        y_true = _array.squeeze(y_true, -1)
    elif y_pred.ndim == y_true.ndim + 1 and y_pred.shape[-1] == 1:
        y_pred = _array.squeeze(y_pred, -1)
    return _array.cast(_math.equal(y_true, _array.cast(y_pred, y_true.dtype)), torch.float32)


def sparse_categorical_accuracy(y_true, y_pred):
    """1.0 where `argmax(y_pred, -1) == y_true`. y_true [batch] or [batch, 1] ids; y_pred [batch, classes].

    Source: tf.keras.metrics.sparse_categorical_accuracy.
    """
    y_true, y_pred = _tensor(y_true), _tensor(y_pred)
    if y_true.ndim == y_pred.ndim and y_true.shape[-1] == 1:
        y_true = _array.squeeze(y_true, -1)
    pred = _math.argmax(y_pred, axis=-1)
    return _array.cast(_math.equal(_array.cast(y_true, pred.dtype), pred), torch.float32)


class Accuracy(MeanMetricWrapper):
    """How often predictions equal labels (elementwise). Source: tf.keras.metrics.Accuracy."""

    def __init__(self, name="accuracy", dtype=torch.float32):
        super().__init__(accuracy, name=name, dtype=dtype)


class SparseCategoricalAccuracy(MeanMetricWrapper):
    """How often `argmax(y_pred, -1)` equals the integer label.

    update_state(y_true [batch] or [batch, 1] int, y_pred [batch, classes], sample_weight=None).
    Source: tf.keras.metrics.SparseCategoricalAccuracy.
    """

    def __init__(self, name="sparse_categorical_accuracy", dtype=torch.float32):
        super().__init__(sparse_categorical_accuracy, name=name, dtype=dtype)
