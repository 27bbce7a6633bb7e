"""Loss classes and functions with Keras formulas and `reduction`.

A loss class is called as `loss(y_true, y_pred, sample_weight=None)`: the
per-example losses (the function of the same name, averaged over the last
axis where Keras does) are multiplied by `sample_weight` and reduced:
  "sum_over_batch_size" (default): sum / number of per-example losses;
  "sum": sum;  "none" (or None): the weighted per-example losses.
Under a strategy use reduction="none" and `dtape.nn.compute_average_loss`
(divides by the GLOBAL batch size, see its note on sum versus mean): as TF,
a loss object reducing "sum_over_batch_size" (or "auto") called in a
replica context of more than one replica raises ValueError, since each
replica would divide by its own batch and the summed gradients would be
num_replicas times too large.
Probabilities are clipped to [1e-7, 1 - 1e-7] before the log, as Keras.
Source: tf.keras.losses.
"""
import torch

from dtape import _replica_info
from dtape import nn as _nn
from dtape._sizes import count_divisor, num_elements
from dtape.ops import array_ops as _array
from dtape.ops import math_ops as _math
from dtape.tensor import convert_to_tensor, is_variable

__all__ = ["Loss", "SparseCategoricalCrossentropy", "CategoricalCrossentropy", "BinaryCrossentropy",
           "MeanSquaredError", "MeanAbsoluteError", "sparse_categorical_crossentropy", "categorical_crossentropy",
           "binary_crossentropy", "mean_squared_error", "mean_absolute_error", "Reduction"]

EPSILON = 1e-7


class Reduction:
    """The reductions a loss class accepts. Source: tf.keras.losses.Reduction (Keras 3 strings)."""

    NONE = "none"
    SUM = "sum"
    SUM_OVER_BATCH_SIZE = "sum_over_batch_size"
    AUTO = "sum_over_batch_size"
    all = ("none", "sum", "sum_over_batch_size")


def _tensor(x):
    return x if is_variable(x) else convert_to_tensor(x)


def _float_pair(y_true, y_pred):
    y_pred = _tensor(y_pred)
    y_true = _array.cast(_tensor(y_true), y_pred.dtype)
    return _nn.squeeze_or_expand_to_same_rank(y_true, y_pred)


def _log_probs(y_pred, from_logits, axis):
    if from_logits:
        return _nn.log_softmax(y_pred, axis=axis)
    probs = y_pred / _math.reduce_sum(y_pred, axis=axis, keepdims=True)
    return _math.log(_math.clip_by_value(probs, EPSILON, 1.0 - EPSILON))


def sparse_categorical_crossentropy(y_true, y_pred, from_logits=False, axis=-1):
    """Per-example `-log p[y_true]`.

    Args:
      y_true: integer class ids [batch, ...] (a trailing axis of size 1 is dropped).
      y_pred: [batch, ..., classes] probabilities (from_logits=False) or logits.
      from_logits: whether y_pred are logits (softmax taken here).
      axis: the class axis (-1).

    Returns:
      [batch, ...] of y_pred's dtype.

    Raises:
      TypeError: y_true of a floating, complex or bool dtype.

    Source: tf.keras.losses.sparse_categorical_crossentropy.
    """
    y_pred = _tensor(y_pred)
    y_true = _tensor(y_true)
    if y_true.ndim == y_pred.ndim and y_true.shape[-1] == 1:
        y_true = _array.squeeze(y_true, -1)
    if y_true.dtype.is_floating_point or y_true.dtype.is_complex or y_true.dtype == torch.bool:
        raise TypeError(f"sparse_categorical_crossentropy: y_true has dtype {y_true.dtype}, expected an integer "
                        "dtype of class ids: a float label would be truncated to a class silently (1.7 -> 1); "
                        "cast integer-valued labels with dtape.cast(y_true, 'int64'), or use "
                        "CategoricalCrossentropy for one-hot or soft labels")
    if from_logits and axis in (-1, y_pred.ndim - 1):
        return _nn.sparse_softmax_cross_entropy_with_logits(labels=y_true, logits=y_pred)
    log_p = _log_probs(y_pred, from_logits, axis)
    one_hot = _array.one_hot(y_true, y_pred.shape[axis], dtype=y_pred.dtype)
    return -_math.reduce_sum(one_hot * log_p, axis=axis)


def categorical_crossentropy(y_true, y_pred, from_logits=False, label_smoothing=0.0, axis=-1):
    """Per-example `-sum(y_true * log p)`, with `y_true * (1 - ls) + ls / classes` when label_smoothing > 0.

    Shapes: y_true, y_pred [batch, ..., classes] -> [batch, ...].
    Raises ValueError when the ranks differ (integer class ids [batch] with
    [batch, classes] would broadcast: use sparse_categorical_crossentropy),
    as Keras 3's.
    Source: tf.keras.losses.categorical_crossentropy.
    """
    y_pred = _tensor(y_pred)
    y_true = _array.cast(_tensor(y_true), y_pred.dtype)
    if y_true.ndim != y_pred.ndim:
        raise ValueError(f"categorical_crossentropy: y_true of shape {list(y_true.shape)} and y_pred of shape "
                         f"{list(y_pred.shape)} have different ranks; y_true must be one-hot (or soft) labels of "
                         f"y_pred's shape: for integer class ids use sparse_categorical_crossentropy")
    if label_smoothing:
        y_true = y_true * (1.0 - label_smoothing) + label_smoothing / y_pred.shape[axis]
    return -_math.reduce_sum(y_true * _log_probs(y_pred, from_logits, axis), axis=axis)


def binary_crossentropy(y_true, y_pred, from_logits=False, label_smoothing=0.0, axis=-1):
    """Per-example mean over `axis` of `-(y log p + (1 - y) log(1 - p))`.

    Labels are smoothed to `y * (1 - ls) + 0.5 * ls`. With from_logits the
    stable `sigmoid_cross_entropy_with_logits` is used; otherwise p is
    clipped to [1e-7, 1 - 1e-7].
    Shapes: y_true, y_pred [batch, ..., d] -> [batch, ...]. Ranks that differ
    by a trailing size-1 axis are matched first (`dtape.nn.squeeze_or_expand_to_same_rank`): labels
    [n] with one sigmoid unit [n, 1] give [n], one loss per example. (Keras
    3's function raises for different ranks and tf.keras 2's broadcast them
    to [n, n] and averaged the wrong pairs; dtape matches them as Keras's
    BinaryCrossentropy class does.)
    Source: tf.keras.losses.binary_crossentropy.
    """
    y_true, y_pred = _float_pair(y_true, y_pred)
    if label_smoothing:
        y_true = y_true * (1.0 - label_smoothing) + 0.5 * label_smoothing
    if from_logits:
        bce = _nn.sigmoid_cross_entropy_with_logits(labels=y_true, logits=y_pred)
    else:
        p = _math.clip_by_value(y_pred, EPSILON, 1.0 - EPSILON)
        bce = -(y_true * _math.log(p) + (1.0 - y_true) * _math.log(1.0 - p))
    return _math.reduce_mean(bce, axis=axis)


def mean_squared_error(y_true, y_pred):
    """Per-example `mean(square(y_pred - y_true), axis=-1)`. Source: tf.keras.losses.mean_squared_error."""
    y_true, y_pred = _float_pair(y_true, y_pred)
    return _math.reduce_mean(_math.square(y_pred - y_true), axis=-1)


def mean_absolute_error(y_true, y_pred):
    """Per-example `mean(abs(y_pred - y_true), axis=-1)`. Source: tf.keras.losses.mean_absolute_error."""
    y_true, y_pred = _float_pair(y_true, y_pred)
    return _math.reduce_mean(_math.abs(y_pred - y_true), axis=-1)


def _check_reduction(reduction):
    if reduction is None:
        return "none"
    if reduction == "auto":
        return "sum_over_batch_size"
    if reduction not in Reduction.all:
        raise ValueError(f"invalid loss reduction {reduction!r}; use one of {list(Reduction.all)}")
    return reduction


class Loss:
    """Base class: `__call__(y_true, y_pred, sample_weight=None)` = reduce(call(y_true, y_pred) * sample_weight).

    Args:
      reduction: "sum_over_batch_size" (default), "sum", or "none"/None.
      name: a name for messages.

    Subclasses define `call(y_true, y_pred)` returning per-example losses.
    The built-in losses first match the ranks of y_true and y_pred as
    Keras's LossFunctionWrapper does (squeeze_or_expand_to_same_rank): labels
    [n] with predictions [n, 1] give [n] per-example losses, not one number.
    A subclass of your own gets them as given (as Keras's Loss).
    Source: tf.keras.losses.Loss.
    """

    _match_ranks = False   # the built-in losses below set it, as Keras's LossFunctionWrapper matches ranks

    # A built-in training loop that divides the replicas' mean losses by the number of replicas sets
    # this on its loss objects (TF's LossesContainer does the same): they may then reduce by batch size.
    _allow_sum_over_batch_size = False

    def __init__(self, reduction="sum_over_batch_size", name=None):
        self.reduction = _check_reduction(reduction)
        self.name = name or type(self).__name__

    def call(self, y_true, y_pred):
        raise NotImplementedError(f"{type(self).__name__} must define call(y_true, y_pred)")

    def __call__(self, y_true, y_pred, sample_weight=None):
        """The reduced loss (a scalar Tensor; with reduction "none" the per-example losses).

        Raises:
          ValueError: reduction "sum_over_batch_size" (the default, or
            "auto") in a replica context of more than one replica (inside
            `strategy.run` of a multi-replica strategy), as TF: use
            reduction="none" and `dtape.nn.compute_average_loss`.
        """
        self._check_distributed_reduction()
        if self._match_ranks:
            y_true, y_pred = _nn.squeeze_or_expand_to_same_rank(_tensor(y_true), _tensor(y_pred))
        losses = _tensor(self.call(y_true, y_pred))
        losses = _nn.scale_losses_by_sample_weight(losses, sample_weight)
        if self.reduction == "none":
            return losses
        total = _math.reduce_sum(losses)
        if self.reduction == "sum":
            return total
        return total / count_divisor(max(num_elements(losses), 1), total.dtype)

    def _check_distributed_reduction(self):
        """TF's `_get_reduction` guard, for a replica context of more than one replica."""
        if self.reduction != "sum_over_batch_size" or self._allow_sum_over_batch_size:
            return
        n = _replica_info.num_replicas_in_sync()
        if n > 1:
            raise ValueError(
                f"{self.name}: Please use `dtape.losses.Reduction.SUM` or `dtape.losses.Reduction.NONE` for loss "
                f"reduction when losses are used with a `dtape.distribute` strategy ({n} replicas in sync) outside "
                "of the built-in training loops: reduction \"sum_over_batch_size\" divides by this replica's batch "
                f"only, so the gradients summed over replicas would be {n} times too large. Reduce by the global "
                "batch size instead:\n    loss_obj = dtape.losses.SparseCategoricalCrossentropy(reduction=\"none\")"
                "\n    loss = dtape.nn.compute_average_loss(loss_obj(labels, predictions), "
                "global_batch_size=GLOBAL_BATCH_SIZE)\n(as tf.nn.compute_average_loss in TF's custom training "
                "tutorial: https://www.tensorflow.org/tutorials/distribute/custom_training)")


class SparseCategoricalCrossentropy(Loss):
    """Cross-entropy with integer labels. Args: from_logits, reduction, name. See `sparse_categorical_crossentropy`.

    Source: tf.keras.losses.SparseCategoricalCrossentropy.

    Example:
      >>> loss = dtape.losses.SparseCategoricalCrossentropy(from_logits=True)
      >>> round(float(loss([0], [[0.0, 0.0]])), 4)
      0.6931
    """

    _match_ranks = True

    def __init__(self, from_logits=False, reduction="sum_over_batch_size", name="sparse_categorical_crossentropy"):
        super().__init__(reduction, name)
        self.from_logits = bool(from_logits)

    def call(self, y_true, y_pred):
        return sparse_categorical_crossentropy(y_true, y_pred, from_logits=self.from_logits)


class CategoricalCrossentropy(Loss):
    """Cross-entropy with one-hot (or soft) labels. Args: from_logits, label_smoothing, reduction, name.

    Source: tf.keras.losses.CategoricalCrossentropy.
    """

    _match_ranks = True

    def __init__(self, from_logits=False, label_smoothing=0.0, reduction="sum_over_batch_size",
                 name="categorical_crossentropy"):
        super().__init__(reduction, name)
        self.from_logits, self.label_smoothing = bool(from_logits), float(label_smoothing)

    def call(self, y_true, y_pred):
        return categorical_crossentropy(y_true, y_pred, self.from_logits, self.label_smoothing)


class BinaryCrossentropy(Loss):
    """Binary cross-entropy. Args: from_logits, label_smoothing, reduction, name.

    Source: tf.keras.losses.BinaryCrossentropy.
    """

    _match_ranks = True

    def __init__(self, from_logits=False, label_smoothing=0.0, reduction="sum_over_batch_size",
                 name="binary_crossentropy"):
        super().__init__(reduction, name)
        self.from_logits, self.label_smoothing = bool(from_logits), float(label_smoothing)

    def call(self, y_true, y_pred):
        return binary_crossentropy(y_true, y_pred, self.from_logits, self.label_smoothing)


class MeanSquaredError(Loss):
    """Mean of squared errors over the last axis, per example. Source: tf.keras.losses.MeanSquaredError."""

    _match_ranks = True

    def __init__(self, reduction="sum_over_batch_size", name="mean_squared_error"):
        super().__init__(reduction, name)

    def call(self, y_true, y_pred):
        return mean_squared_error(y_true, y_pred)


class MeanAbsoluteError(Loss):
    """Mean of absolute errors over the last axis, per example. Source: tf.keras.losses.MeanAbsoluteError."""

    _match_ranks = True

    def __init__(self, reduction="sum_over_batch_size", name="mean_absolute_error"):
        super().__init__(reduction, name)

    def call(self, y_true, y_pred):
        return mean_absolute_error(y_true, y_pred)
