"""Reductions across replica devices inside one process.

Reductions are dtape ops (add_n, a device copy), so a tape that watches the
replicas' values records them. Sums run in replica order on the first
device, so every replica receives bit-identical results.
Source: tensorflow/python/distribute/cross_device_ops.py.
"""
import torch

from dtape import ops
from dtape.distribute.reduce_util import ReduceOp
from dtape.ops import _samples as S
from dtape.ops._registry import defop
from dtape.tensor import convert_to_tensor, normalize_device


@defop(samples=lambda rng: [((S.randn(rng, 2, 3),), {"device": torch.device("cpu")})])
def copy_to_device(x, device):
    """A copy of x on `device`; the gradient is copied back. Source: tf.identity under tf.device."""
    return x.to(device, copy=True)


@copy_to_device.grad
def _(dy, ans, x, device):
    return copy_to_device.any(dy, device=x.device)


def _on(value, device):
    value = convert_to_tensor(value)
    return value if value.device == device else copy_to_device(value, device)


def reduce_values(reduce_op, values, device=None):
    """Reduces one tensor per replica to one tensor on `device` (default: the first value's).

    Args:
      reduce_op: ReduceOp.SUM or ReduceOp.MEAN.
      values: sequence of same-shape tensors (any devices).

    Raises:
      ValueError: for an empty sequence or mismatched shapes.
    """
    if not values:
        raise ValueError("reduce_values: no values to reduce")
    values = [convert_to_tensor(v) for v in values]
    shapes = {tuple(v.shape) for v in values}
    if len(shapes) > 1:
        raise ValueError(f"cannot reduce values of different shapes across replicas: {sorted(shapes)}; "
                         "every replica must produce the same shape")
    device = values[0].device if device is None else normalize_device(device)
    values = [_on(v, device) for v in values]
    total = ops.add_n(values) if len(values) > 1 else ops.identity(values[0])
    return total / len(values) if reduce_op == ReduceOp.MEAN else total


def broadcast(value, devices):
    """One copy of `value` per device (the same Tensor where the device already matches)."""
    return tuple(_on(value, normalize_device(d)) for d in devices)


__all__ = ["reduce_values", "broadcast", "copy_to_device"]
