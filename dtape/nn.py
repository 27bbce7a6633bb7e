"""dtape.nn: activations, cross-entropies, conv2d, dropout, moments, loss averaging (tf.nn names)."""
import torch

from dtape import _replica_info
from dtape._sizes import count_divisor
from dtape import tape as _tape
from dtape.ops import array_ops as _array
from dtape.ops import math_ops as _math
from dtape.ops.nn_ops import *  # noqa: F401,F403
from dtape.ops.nn_ops import __all__ as _nn_all
from dtape.ops.math_ops import sigmoid, tanh  # noqa: F401  (tf.nn.sigmoid and tf.nn.tanh: the same ops)
from dtape.tensor import Tensor, convert_to_tensor, is_variable

__all__ = list(_nn_all) + ["compute_average_loss", "scale_losses_by_sample_weight", "scale_regularization_loss", "sigmoid",
                            "tanh"]


def _check_replica_context(what):
    if _replica_info.has_strategy() and _replica_info.in_cross_replica_context():
        raise RuntimeError(f"You are calling `{what}` in cross replica context, while it was expected to be "
                           "called in replica context: call it inside the function given to strategy.run")


def compute_average_loss(per_example_loss, sample_weight=None, global_batch_size=None):
    """Scales per-example losses by the GLOBAL batch size: `sum(per_example_loss * sample_weight) / global_batch_size`.

    Under a strategy every replica calls it on its own examples; the
    optimizer then SUMS the replicas' gradients (TF semantics), and the sum
    of the replicas' results is the mean over the global batch, so training
    matches one device on the whole batch, also when the replicas' slices
    differ in size or one is empty. DDP/Horovod users note: those AVERAGE
    gradients over replicas and so divide each replica's loss by the
    per-replica batch size; with dtape divide by the global batch size
    (this function), never by the per-replica size, or the gradients are
    num_replicas times too large. `dtape.distribute.compute_average_loss`
    is this same function.

    Args:
      per_example_loss: floating tensor-like of rank >= 1, [batch, ...]
        (batch may be 0 on a replica whose slice of a short batch is
        empty); all elements are summed.
      sample_weight: None, or weights broadcastable to per_example_loss.
      global_batch_size: positive int (or integer scalar tensor), the batch
        size across all replicas. None: the real count, `batch` summed over
        the replicas in sync (one small all-reduce, so every replica must
        call it, as any collective), so uneven and short last batches weigh
        every example once; a global batch of 0 examples gives 0.

    Returns:
      A scalar Tensor of per_example_loss's dtype and device, differentiable
      with respect to the losses.

    Raises:
      ValueError: a scalar per_example_loss; a non-integer or non-positive
        global_batch_size.
      RuntimeError: global_batch_size omitted in a cross-replica context
        (inside a strategy's scope but outside strategy.run), as TF.

    Source: tf.nn.compute_average_loss (whose default, the local batch times
    the number of replicas, is wrong for uneven batches; this one counts).

    Example:
      >>> float(compute_average_loss([1.0, 2.0, 3.0], global_batch_size=6))
      1.0
    """
    loss = convert_to_tensor(per_example_loss)
    if loss.ndim < 1:
        raise ValueError("Invalid value passed for `per_example_loss`. Expected a tensor with at least rank 1, "
                         f"got a scalar ({loss.dtype}); give the per-example losses (reduction='none')")
    loss = scale_losses_by_sample_weight(loss, sample_weight)
    total = _math.reduce_sum(loss)
    if global_batch_size is None:
        _check_replica_context("compute_average_loss")
        return total / count_divisor(max(_global_count(loss.shape[0]), 1), total.dtype)
    return total / float(_check_batch_size(global_batch_size))


def squeeze_or_expand_to_same_rank(y_true, y_pred):
    """`(y_true, y_pred)` with ranks matched as Keras 3's `squeeze_or_expand_to_same_rank` (Tensors in, Tensors
    out; dtypes and devices kept): when the ranks differ by one and the higher-rank side ends in a size-1
    axis, a rank-1 other side gains that axis ([n] with [n, 1] -> [n, 1] and [n, 1], so a mean over the last
    axis leaves one value per example), else that axis is dropped ([n, t, 1] with [n, t] -> [n, t]); any
    other pair is returned as it is. Used by dtape.losses and dtape.metrics. Source: keras/src/losses/loss.py."""
    if y_true.ndim == y_pred.ndim + 1 and y_true.shape[-1] == 1:
        if y_pred.ndim == 1:
            y_pred = _array.expand_dims(y_pred, -1)
        else:
            y_true = _array.squeeze(y_true, -1)
    elif y_pred.ndim == y_true.ndim + 1 and y_pred.shape[-1] == 1:
        if y_true.ndim == 1:
            y_true = _array.expand_dims(y_true, -1)
        else:
            y_pred = _array.squeeze(y_pred, -1)
    return y_true, y_pred


def scale_losses_by_sample_weight(losses, sample_weight):
    """`losses * sample_weight`, the weight's rank matched to the losses' first as Keras does.

    A weight with one trailing size-1 axis more than the losses ([batch, 1]
    for [batch] losses, the shape Keras users pass) loses that axis; a weight
    of lower rank gains trailing axes; then the two broadcast. Multiplying a
    [batch, 1] weight by [batch] losses directly would broadcast to a
    [batch, batch] grid: a silently wrong loss.

    Args:
      losses: floating tensor-like [batch, ...].
      sample_weight: None (losses returned as they are) or tensor-like
        broadcastable to losses after the rank match; cast to losses' dtype.

    Source: keras losses_utils.scale_losses_by_sample_weight /
    squeeze_or_expand_dimensions.
    """
    losses = convert_to_tensor(losses)
    if sample_weight is None:
        return losses
    weight = _array.cast(convert_to_tensor(sample_weight), losses.dtype)
    if weight.ndim == losses.ndim + 1 and weight.shape[-1] == 1:
        weight = _array.squeeze(weight, -1)
    while weight.ndim < losses.ndim:
        weight = _array.expand_dims(weight, -1)
    return _math.multiply(losses, weight)


def _global_count(local_count):
    """The number of examples summed over the replicas in sync (a collective when there are several)."""
    rctx = _replica_info.replica_context()
    if rctx is None or rctx.num_replicas_in_sync == 1:
        return local_count
    with _tape.stop_recording():
        count = rctx.all_reduce("SUM", Tensor(torch.tensor(float(local_count), dtype=torch.float64)))
    return int(round(float(count.torch())))


def _check_batch_size(n):
    if isinstance(n, Tensor) or is_variable(n) or isinstance(n, torch.Tensor):
        t = convert_to_tensor(n).torch()
        if t.ndim != 0 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"global_batch_size must be an integer scalar, got {t.dtype} of shape {tuple(t.shape)}")
        n = int(t)
    if isinstance(n, bool) or not isinstance(n, int) and not hasattr(n, "__index__"):
        raise ValueError(f"global_batch_size must be an integer, got {type(n).__name__} {n!r}")
    n = int(n)
    if n <= 0:
        raise ValueError(f"global_batch_size must be positive, got {n}")
    return n


def scale_regularization_loss(regularization_loss):
    """Divides a regularization loss by `num_replicas_in_sync`: `sum(regularization_loss) / num_replicas`.

    Each replica adds the same regularization (e.g. `sum(model.losses)`) to
    its loss; the optimizer sums the replicas' gradients, so dividing by
    the number of replicas counts it once (TF semantics; see
    `compute_average_loss` for the sum-versus-mean note).

    Args:
      regularization_loss: a scalar tensor-like, or a list of them (summed).

    Returns:
      A scalar Tensor.

    Raises:
      RuntimeError: called in a cross-replica context.

    Source: tf.nn.scale_regularization_loss.
    """
    _check_replica_context("scale_regularization_loss")
    if isinstance(regularization_loss, (list, tuple)):
        if not regularization_loss:
            return convert_to_tensor(0.0)
        regularization_loss = _math.add_n([_math.reduce_sum(convert_to_tensor(x)) for x in regularization_loss])
    loss = _math.reduce_sum(convert_to_tensor(regularization_loss))
    return loss / float(_replica_info.num_replicas_in_sync())
