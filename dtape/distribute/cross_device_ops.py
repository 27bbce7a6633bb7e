"""Reductions across replica devices inside one process.

Reductions are dtape ops (add_n, a device copy, casts), so a tape that
watches the replicas' values records them. Every value is moved to the
destination device explicitly (`copy_to_device`) before it is summed; sums
run in replica order on the destination device, so every replica receives
bit-identical results; float16/bfloat16 values are summed in float32 and
cast back, so a reduction overflows only when its result does.
Source: tensorflow/python/distribute/cross_device_ops.py.
"""
import torch

from dtape import ops
from dtape.backprop import profile_range
from dtape.distribute.reduce_util import ReduceOp
from dtape.ops.array_ops import copy_to_device, to_device
from dtape.tensor import convert_to_tensor, normalize_device


def on_device(value, device):
    return to_device(convert_to_tensor(value), device)


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def accumulation_dtype(dtype):
    """The dtype a reduction of `dtype` values accumulates in: float32 for float16/bfloat16."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def widen(value):
    """`value` cast to its accumulation dtype (a recorded cast), or unchanged."""
    acc = accumulation_dtype(value.dtype)
    return value if acc == value.dtype else ops.cast(value, acc)


def narrow(value, dtype):
    """`value` cast back to `dtype` after accumulating (a recorded cast), or unchanged."""
    return value if value.dtype == dtype else ops.cast(value, dtype)


def reduce_values(reduce_op, values, device=None):
    """Reduces one tensor per replica to one tensor on `device` (default: the first value's).

    Args:
      reduce_op: ReduceOp.SUM or ReduceOp.MEAN.
      values: sequence of same-shape tensors (any devices); each is copied
        to `device` first. float16/bfloat16 accumulate in float32.

    Returns:
      A new Tensor on `device`, of the values' dtype.

    Raises:
      ValueError: for an empty sequence or mismatched shapes.

    Shows in torch.profiler traces as the range "dtape.all_reduce".
    """
    if not values:
        raise ValueError("reduce_values: no values to reduce")
    with profile_range("dtape.all_reduce"):  # every collective's reduction: a named range
        return _reduce_values(reduce_op, [convert_to_tensor(v) for v in values], device)


def _reduce_values(reduce_op, values, device):
    shapes = {tuple(v.shape) for v in values}
    if len(shapes) > 1:
        raise ValueError(f"cannot reduce values of different shapes across replicas: {sorted(shapes)}; "
                         "every replica must produce the same shape")
    device = values[0].device if device is None else normalize_device(device)
    dtype = values[0].dtype
    values = [widen(on_device(v, device)) for v in values]
    total = ops.add_n(values) if len(values) > 1 else ops.identity(values[0])
    if reduce_op == ReduceOp.MEAN:
        total = total / len(values)
    return narrow(total, dtype)


def reduce_non_distributed_value(reduce_op, value, num_replicas):
    """Reduces a value that is not distributed (the same object on every replica, or a plain tensor).

    MEAN (or a single replica) gives the value itself; SUM over more than
    one replica is ambiguous (was it one value, or one per replica?) and
    raises, as TF's `reduce_non_distributed_value`.

    Returns:
      The value as a Tensor.

    Raises:
      ValueError: for SUM over more than one replica, naming the fixes.
    """
    if reduce_op == ReduceOp.MEAN or num_replicas == 1:
        return convert_to_tensor(value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        described = f"a {type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}"
    else:
        described = f"{type(value).__name__} {value!r:.40}"
    raise ValueError(
        f"cannot reduce a non-distributed value ({described}) with ReduceOp.SUM over {num_replicas} replicas: "
        "it is the same object on every replica (e.g. a tensor created outside the replica function), so "
        "its sum is ambiguous. Return or pass a per-replica value (a tensor computed inside the replica "
        "function), reduce with ReduceOp.MEAN to get the value itself, or multiply it by "
        "num_replicas_in_sync yourself")


def broadcast(value, devices):
    """One Tensor per device, each a distinct object: an identity on the value's own device, a copy elsewhere."""
    value = convert_to_tensor(value)
    out = []
    with profile_range("dtape.broadcast"):
        for d in devices:
            d = normalize_device(d)
            out.append(ops.identity(value) if value.device == d else copy_to_device(value, d))
    return tuple(out)


__all__ = ["reduce_values", "reduce_non_distributed_value", "broadcast", "copy_to_device", "widen", "narrow",
           "accumulation_dtype"]
