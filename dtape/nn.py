"""dtape.nn: activations, cross-entropies, conv2d, dropout, moments, loss averaging (tf.nn names)."""
import torch

from dtape import _replica_info
from dtape.ops import array_ops as _array
from dtape.ops import math_ops as _math
from dtape.ops.nn_ops import *  # noqa: F401,F403
from dtape.ops.nn_ops import __all__ as _nn_all
from dtape.tensor import Tensor, convert_to_tensor, is_variable

__all__ = list(_nn_all) + ["compute_average_loss", "scale_regularization_loss"]


def _check_replica_context(what):
    if _replica_info.has_strategy() and _replica_info.in_cross_replica_context():
        raise RuntimeError(f"You are calling `{what}` in cross replica context, while it was expected to be "
                           "called in replica context: call it inside the function given to strategy.run")


def compute_average_loss(per_example_loss, global_batch_size=None, sample_weight=None):
    """Scales per-example losses by the GLOBAL batch size: `sum(per_example_loss * sample_weight) / global_batch_size`.

    Under a strategy every replica calls it on its own examples; the
    optimizer then SUMS the replicas' gradients (TF semantics), and the sum
    of the replicas' results is the mean over the global batch, so training
    matches one device on the whole batch. DDP/Horovod users note: those
    AVERAGE gradients over replicas and so divide each replica's loss by
    the per-replica batch size; with dtape divide by the global batch size
    (this function), never by the per-replica size, or the gradients are
    num_replicas times too large.

    Args:
      per_example_loss: floating tensor-like of rank >= 1, [batch, ...]; all
        elements are summed.
      global_batch_size: positive int (or integer scalar tensor), the batch
        size across all replicas. None: the local batch size times
        `num_replicas_in_sync` (TF's default; wrong for a short last batch:
        pass the real global size then).
      sample_weight: None, or weights broadcastable to per_example_loss.

    Returns:
      A scalar Tensor of per_example_loss's dtype and device.

    Raises:
      ValueError: a scalar per_example_loss; a non-integer or non-positive
        global_batch_size.
      RuntimeError: called in a cross-replica context (inside a strategy's
        scope but outside strategy.run), as TF.

    Source: tf.nn.compute_average_loss.
    """
    loss = convert_to_tensor(per_example_loss)
    if loss.ndim < 1:
        raise ValueError("Invalid value passed for `per_example_loss`. Expected a tensor with at least rank 1, "
                         f"got a scalar ({loss.dtype}); give the per-example losses (reduction='none')")
    dtype = loss.dtype
    if sample_weight is not None:
        loss = _math.multiply(loss, _array.cast(convert_to_tensor(sample_weight), dtype))
    if global_batch_size is None:
        _check_replica_context("compute_average_loss")
        global_batch_size = loss.shape[0] * _replica_info.num_replicas_in_sync()
    global_batch_size = _check_batch_size(global_batch_size)
    return _math.reduce_sum(loss) / float(global_batch_size)


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
