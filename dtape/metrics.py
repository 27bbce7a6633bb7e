"""Streaming metrics (Keras API): Mean, Sum, Accuracy, SparseCategoricalAccuracy, BinaryAccuracy,
CategoricalAccuracy, TopKCategoricalAccuracy, SparseTopKCategoricalAccuracy, MeanSquaredError,
MeanAbsoluteError, RootMeanSquaredError, Precision, Recall, AUC (ROC).

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

from dtape import nn as _nn
from dtape._sizes import count_divisor, num_elements
from dtape import tape as _tp
from dtape.module import Module
from dtape.ops import array_ops as _array
from dtape.ops import math_ops as _math
from dtape.tensor import convert_to_tensor, is_variable
from dtape.variables import Variable, VariableAggregation, VariableSynchronization

__all__ = ["Metric", "Mean", "Sum", "Accuracy", "SparseCategoricalAccuracy", "MeanMetricWrapper", "BinaryAccuracy",
           "CategoricalAccuracy", "TopKCategoricalAccuracy", "SparseTopKCategoricalAccuracy", "MeanSquaredError",
           "MeanAbsoluteError", "RootMeanSquaredError", "Precision", "Recall", "AUC", "get"]


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
        """A sync-on-read (SUM) state variable `<metric>/<name>` of `shape`, not trainable.

        initializer: a number, or Keras's "zeros" / "ones". Raises ValueError for another name.
        """
        initializer = _initial_value(initializer)
        var = Variable(torch.full(tuple(shape), initializer, dtype=self.dtype), trainable=False,
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


def _initial_value(initializer):
    """A state variable's fill value from a number or Keras's initializer name."""
    named = {"zeros": 0.0, "ones": 1.0}
    if isinstance(initializer, str):
        if initializer not in named:
            raise ValueError(f"a metric state initializer must be a number, 'zeros' or 'ones', got {initializer!r}")
        return named[initializer]
    return float(initializer)


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
                total, count = _math.reduce_sum(values), count_divisor(num_elements(values), self.dtype)
            else:
                weight = _array.cast(_tensor(sample_weight), self.dtype)
                weight = _match_rank(weight, values)
                if weight.ndim > values.ndim:
                    # one value for a batch of weights (a metric function that reduced the batch itself, weighed
                    # by an output's mask): it stands for every weighted example, so it weighs by their sum
                    values = _array.broadcast_to(values, tuple(weight.shape))
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


# -- Keras's other built-in metrics ----------------------------------------------------------------------
def _float_pair(y_true, y_pred, dtype=torch.float32):
    """Both cast to `dtype`, ranks matched as Keras 3's squeeze_or_expand_to_same_rank: [n] with [n, 1] gives
    [n, 1] twice (one value per example after the mean over the last axis, so sample weights weigh examples),
    [n, t, 1] with [n, t] drops the trailing axis (the same rule as dtape.losses)."""
    y_true, y_pred = _array.cast(_tensor(y_true), dtype), _array.cast(_tensor(y_pred), dtype)
    return _nn.squeeze_or_expand_to_same_rank(y_true, y_pred)


def mean_squared_error(y_true, y_pred):
    """Per-example `mean((y_true - y_pred)**2, axis=-1)`. Source: tf.keras.metrics.mean_squared_error."""
    y_true, y_pred = _float_pair(y_true, y_pred)
    return _math.reduce_mean(_math.square(y_true - y_pred), axis=-1)


def mean_absolute_error(y_true, y_pred):
    """Per-example `mean(|y_true - y_pred|, axis=-1)`. Source: tf.keras.metrics.mean_absolute_error."""
    y_true, y_pred = _float_pair(y_true, y_pred)
    return _math.reduce_mean(_math.abs(y_true - y_pred), axis=-1)


def binary_accuracy(y_true, y_pred, threshold=0.5):
    """Per-example mean over the last axis of `y_true == (y_pred > threshold)`.

    Source: tf.keras.metrics.binary_accuracy."""
    y_true, y_pred = _float_pair(y_true, y_pred)
    hit = _math.equal(y_true, _array.cast(_math.greater(y_pred, threshold), torch.float32))
    return _math.reduce_mean(_array.cast(hit, torch.float32), axis=-1)


def categorical_accuracy(y_true, y_pred):
    """1.0 where `argmax(y_true, -1) == argmax(y_pred, -1)` (one-hot labels). Source: tf.keras.metrics."""
    y_true, y_pred = _tensor(y_true), _tensor(y_pred)
    return _array.cast(_math.equal(_math.argmax(y_true, axis=-1), _math.argmax(y_pred, axis=-1)), torch.float32)


def sparse_top_k_categorical_accuracy(y_true, y_pred, k=5):
    """1.0 where the label's score is among the `k` highest of `y_pred` [batch, classes] (TF's in_top_k: fewer
    than k classes score strictly higher, so ties at the boundary count as in). Source: tf.keras.metrics."""
    y_pred = _array.cast(_tensor(y_pred), torch.float32)
    y_true = _tensor(y_true)
    if y_true.ndim == y_pred.ndim and y_true.shape[-1] == 1:
        y_true = _array.squeeze(y_true, -1)
    picked = _array.one_hot(_array.cast(y_true, torch.int64), int(y_pred.shape[-1]), dtype=torch.float32)
    target = _math.reduce_sum(picked * y_pred, axis=-1, keepdims=True)
    above = _math.reduce_sum(_array.cast(_math.greater(y_pred, target), torch.float32), axis=-1)
    return _array.cast(_math.less(above, float(k)), torch.float32)


def top_k_categorical_accuracy(y_true, y_pred, k=5):
    """`sparse_top_k_categorical_accuracy` with one-hot labels (their argmax). Source: tf.keras.metrics."""
    return sparse_top_k_categorical_accuracy(_math.argmax(_tensor(y_true), axis=-1), y_pred, k)


class BinaryAccuracy(MeanMetricWrapper):
    """How often `y_pred > threshold` equals the 0/1 label. Source: tf.keras.metrics.BinaryAccuracy."""

    def __init__(self, name="binary_accuracy", dtype=torch.float32, threshold=0.5):
        super().__init__(lambda t, p: binary_accuracy(t, p, threshold), name=name, dtype=dtype)
        self.threshold = threshold


class CategoricalAccuracy(MeanMetricWrapper):
    """How often `argmax(y_pred)` equals `argmax(y_true)` (one-hot labels). Source: tf.keras.metrics.CategoricalAccuracy."""

    def __init__(self, name="categorical_accuracy", dtype=torch.float32):
        super().__init__(categorical_accuracy, name=name, dtype=dtype)


class TopKCategoricalAccuracy(MeanMetricWrapper):
    """How often the one-hot label is among the `k` top scores. Source: tf.keras.metrics.TopKCategoricalAccuracy."""

    def __init__(self, k=5, name="top_k_categorical_accuracy", dtype=torch.float32):
        super().__init__(lambda t, p: top_k_categorical_accuracy(t, p, k), name=name, dtype=dtype)
        self.k = k


class SparseTopKCategoricalAccuracy(MeanMetricWrapper):
    """How often the integer label is among the `k` top scores.

    Source: tf.keras.metrics.SparseTopKCategoricalAccuracy."""

    def __init__(self, k=5, name="sparse_top_k_categorical_accuracy", dtype=torch.float32):
        super().__init__(lambda t, p: sparse_top_k_categorical_accuracy(t, p, k), name=name, dtype=dtype)
        self.k = k


class MeanSquaredError(MeanMetricWrapper):
    """Mean over examples of `mean((y_true - y_pred)**2, -1)`. Source: tf.keras.metrics.MeanSquaredError."""

    def __init__(self, name="mean_squared_error", dtype=torch.float32):
        super().__init__(mean_squared_error, name=name, dtype=dtype)


class MeanAbsoluteError(MeanMetricWrapper):
    """Mean over examples of `mean(|y_true - y_pred|, -1)`. Source: tf.keras.metrics.MeanAbsoluteError."""

    def __init__(self, name="mean_absolute_error", dtype=torch.float32):
        super().__init__(mean_absolute_error, name=name, dtype=dtype)


class RootMeanSquaredError(Mean):
    """`sqrt` of the (weighted) mean of every squared error element. Source: tf.keras.metrics.RootMeanSquaredError."""

    def __init__(self, name="root_mean_squared_error", dtype=torch.float32):
        super().__init__(name=name, dtype=dtype)

    def update_state(self, y_true, y_pred, sample_weight=None):
        with _tp.stop_recording():
            y_true, y_pred = _float_pair(y_true, y_pred, self.dtype)
            super().update_state(_math.square(y_pred - y_true), sample_weight)

    def result(self):
        return _math.sqrt(super().result())


class _Confusion(Metric):
    """Counts of true/false positives/negatives at `thresholds` (predicted positive: `y_pred > threshold`)."""

    _counts = ()

    def __init__(self, thresholds, name, dtype):
        super().__init__(name=name, dtype=dtype)
        self._single = not isinstance(thresholds, (list, tuple))
        self.thresholds = [float(thresholds)] if self._single else [float(t) for t in thresholds]
        n = len(self.thresholds)
        for count in self._counts:
            setattr(self, count, self.add_variable(count, shape=(n,)))

    def update_state(self, y_true, y_pred, sample_weight=None):
        """y_true 0/1 (or bool), y_pred scores in [0, 1], same shape (a trailing 1 may differ); sample_weight
        broadcastable to them."""
        with _tp.stop_recording():
            y_true, y_pred = _float_pair(y_true, y_pred, self.dtype)
            weight = 1.0
            if sample_weight is not None:
                weight = _array.cast(_tensor(sample_weight), self.dtype)
                weight = _array.reshape(_array.broadcast_to(_match_rank(weight, y_true), tuple(y_true.shape)),
                                        [-1, 1])
            y_true, y_pred = _array.reshape(y_true, [-1, 1]), _array.reshape(y_pred, [-1, 1])
            pred = _array.cast(_math.greater(y_pred, convert_to_tensor(self.thresholds, dtype=self.dtype)[None]),
                               self.dtype)
            cells = {"true_positives": y_true * pred, "false_positives": (1.0 - y_true) * pred,
                     "false_negatives": y_true * (1.0 - pred), "true_negatives": (1.0 - y_true) * (1.0 - pred)}
            for count in self._counts:
                getattr(self, count).assign_add(_math.reduce_sum(cells[count] * weight, axis=0))

    def _ratio(self, num, other):
        with _tp.stop_recording():
            num, den = num.read_value(), num.read_value() + other.read_value()
            value = _math.divide(num, _math.maximum(den, 1e-30)) * _array.cast(den > 0, self.dtype)
            return value[0] if self._single else value


class Precision(_Confusion):
    """tp / (tp + fp) at `thresholds` (default 0.5; a list gives one value per threshold; 0 with no positive
    prediction). Variables: `true_positives`, `false_positives`. Source: tf.keras.metrics.Precision."""

    _counts = ("true_positives", "false_positives")

    def __init__(self, thresholds=None, name="precision", dtype=torch.float32):
        super().__init__(0.5 if thresholds is None else thresholds, name, dtype)

    def result(self):
        return self._ratio(self.true_positives, self.false_positives)


class Recall(_Confusion):
    """tp / (tp + fn) at `thresholds` (default 0.5). Variables: `true_positives`, `false_negatives`.
    Source: tf.keras.metrics.Recall."""

    _counts = ("true_positives", "false_negatives")

    def __init__(self, thresholds=None, name="recall", dtype=torch.float32):
        super().__init__(0.5 if thresholds is None else thresholds, name, dtype)

    def result(self):
        return self._ratio(self.true_positives, self.false_negatives)


class AUC(_Confusion):
    """Area under the ROC curve from confusion counts at `num_thresholds` thresholds spread over [0, 1]
    (Keras's: i/(n-1) for the inner ones, and -1e-7, 1+1e-7 at the ends), by the trapezoidal rule
    (summation_method "interpolation"; "minoring"/"majoring" take the lower/upper rectangle).

    Only curve="ROC" (ValueError otherwise). Source: tf.keras.metrics.AUC.
    """

    _counts = ("true_positives", "false_positives", "true_negatives", "false_negatives")

    def __init__(self, num_thresholds=200, curve="ROC", summation_method="interpolation", name="auc",
                 dtype=torch.float32):
        if curve != "ROC":
            raise ValueError(f"AUC: only curve='ROC' is supported, got {curve!r}")
        if summation_method not in ("interpolation", "minoring", "majoring"):
            raise ValueError(f"AUC: summation_method must be interpolation, minoring or majoring, got "
                             f"{summation_method!r}")
        if num_thresholds < 2:
            raise ValueError(f"AUC: num_thresholds must be > 1, got {num_thresholds}")
        inner = [(i + 1) / (num_thresholds - 1) for i in range(num_thresholds - 2)]
        super().__init__([-1e-7] + inner + [1.0 + 1e-7], name, dtype)
        self.num_thresholds, self.summation_method = num_thresholds, summation_method

    def result(self):
        with _tp.stop_recording():
            tp, fp = self.true_positives.read_value(), self.false_positives.read_value()
            tn, fn = self.true_negatives.read_value(), self.false_negatives.read_value()
            tpr = _math.divide(tp, _math.maximum(tp + fn, 1e-30))
            fpr = _math.divide(fp, _math.maximum(fp + tn, 1e-30))
            if self.summation_method == "interpolation":
                heights = (tpr[:-1] + tpr[1:]) / 2.0
            else:
                pick = _math.minimum if self.summation_method == "minoring" else _math.maximum
                heights = pick(tpr[:-1], tpr[1:])
            return _math.reduce_sum((fpr[:-1] - fpr[1:]) * heights)


_BY_NAME = {"accuracy": Accuracy, "acc": Accuracy, "binary_accuracy": BinaryAccuracy,
            "categorical_accuracy": CategoricalAccuracy, "sparse_categorical_accuracy": SparseCategoricalAccuracy,
            "top_k_categorical_accuracy": TopKCategoricalAccuracy,
            "sparse_top_k_categorical_accuracy": SparseTopKCategoricalAccuracy,
            "mse": MeanSquaredError, "mean_squared_error": MeanSquaredError,
            "mae": MeanAbsoluteError, "mean_absolute_error": MeanAbsoluteError,
            "rmse": RootMeanSquaredError, "root_mean_squared_error": RootMeanSquaredError,
            "precision": Precision, "recall": Recall, "auc": AUC}


def get(identifier):
    """A new metric from its Keras name ("mae", "mse", "binary_accuracy", "auc", "precision", ...), or the
    metric given. The name becomes the metric's `name` (as Keras reports "mae", not "mean_absolute_error").

    Raises ValueError for an unknown name. Source: tf.keras.metrics.get.
    """
    if isinstance(identifier, Metric):
        return identifier
    if identifier not in _BY_NAME:
        raise ValueError(f"unknown metric {identifier!r}; Keras names known here: {sorted(_BY_NAME)}")
    return _BY_NAME[identifier](name=identifier)


def keras_accuracy(y_true, y_pred):
    """What Keras's compile(metrics=["accuracy"]) computes, chosen from the shapes on each update:
    `binary_accuracy` when y_pred's last axis is 1; `sparse_categorical_accuracy` when y_true has a lower rank
    than y_pred or a last axis of 1 (integer labels); else `categorical_accuracy` (one-hot labels).

    Source: Keras's compile_utils.get_metric (is_binary_or_sparse_categorical)."""
    y_true, y_pred = _tensor(y_true), _tensor(y_pred)
    if y_pred.shape[-1] == 1:
        return binary_accuracy(y_true, y_pred)
    if y_true.ndim < y_pred.ndim or y_true.shape[-1] == 1:
        return sparse_categorical_accuracy(y_true, y_pred)
    return categorical_accuracy(y_true, y_pred)
