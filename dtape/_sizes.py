"""Size and shape arguments: one reading for every op and factory that takes sizes.

TF accepts a size as a Python int, a numpy integer or a 0-d integer tensor,
and a shape as a list mixing those, a 1-D integer tensor (`tf.shape(x)`),
or a TensorShape. torch takes only ints: a dtape tensor handed to it inside
a shape runs `__torch_function__` and never reaches an int. So `reshape`,
`broadcast_to`, `one_hot`, `zeros`, `fill`, `range`, `tile`, `split`,
`dtape.random` and the rest read their sizes here, before torch sees them.
"""
import operator

import numpy as np
import torch

from dtape.tensor import Tensor, convert_to_tensor, is_variable

__all__ = ["size_value", "shape_values", "scalar_value", "num_elements", "count_divisor"]

_SEQUENCES = (tuple, list, torch.Size)

# True once a compiled function's trace made a size tensor (`carry`). Until then the integer arithmetic ops
# skip looking for sizes to follow (`follow`): eager code pays one global read per op.
traced = False


def _as_array(x):
    """A torch.Tensor or numpy array for tensor-like `x` (variables read), else None."""
    if isinstance(x, Tensor):
        return x.torch()
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return x
    return x._dtape_read().torch() if is_variable(x) else None


def _is_integer(arr):
    if isinstance(arr, torch.Tensor):
        return not (arr.dtype.is_floating_point or arr.dtype.is_complex or arr.dtype == torch.bool)
    return arr.dtype.kind in "iu"


def _traced_sizes(arr):
    """The sizes that `dtape.shape` (a tuple) or an int or slice of it (a size or a tuple) holds while a
    compiled function is traced, or None: the trace's tensors have no values to read, and the sizes (ints, or
    symbolic sizes of None dims) keep the graph general."""
    return getattr(arr, "_dtape_sizes", None) if isinstance(arr, torch.Tensor) else None


def carry(t, sizes):
    """Marks traced torch tensor `t` as holding `sizes`: a size (an int, or a symbolic size of a None dim) for
    a 0-d tensor, a tuple of them for `dtape.shape`'s. The trace's tensors have no values that a size
    argument could read; the sizes keep the graph general (symbolic where torch.tensor would fix them)."""
    global traced
    traced = True
    t._dtape_sizes = sizes
    return t


def _size_of(x):
    """The size that `x` (a Python int, or a 0-d torch tensor carrying one) stands for while traced, or None."""
    if type(x) is int:
        return x
    sizes = getattr(x, "_dtape_sizes", None)
    return None if isinstance(sizes, tuple) else sizes


def follow(out, x, y, fn):
    """`out` (torch tensor `fn(x, y)` of an integer arithmetic op) carrying `fn` of the sizes `x` and `y`
    carry, when both are sizes (or Python ints) and one carries a size: `dtape.shape(x)[1] - 1` and
    `h * w` of two sizes stay sizes inside a compiled function, as in TF's graphs. Anything else as it is."""
    a, b = _size_of(x), _size_of(y)
    if a is None or b is None:  # an op's forward never gets two Python ints (the first is made a tensor)
        return out
    value = fn(a, b)
    if isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool):
        out._dtape_sizes = value
    return out


def size_value(n, op, what="size"):
    """One size as a Python int: an int, a numpy integer or a 0-d integer tensor (dtape, torch, numpy).

    Raises:
      TypeError: a bool, a float, or a tensor that is not 0-d and integer.
    """
    if type(n) is int or isinstance(n, torch.SymInt):  # the common case first; a symbolic size of a trace
        return n
    if isinstance(n, (bool, np.bool_)):  # True is an int to Python, never a size to TF
        raise TypeError(f"{op}: {what} must be an integer, got {n!r}")
    arr = _as_array(n)
    if arr is not None and (arr.ndim != 0 or not _is_integer(arr)):
        raise TypeError(f"{op}: {what} must be an integer or a 0-d integer tensor, got a tensor of shape "
                        f"{tuple(arr.shape)} and dtype {arr.dtype}" + (" (cast it: dtape.cast(n, dtape.int32))"
                                                                        if arr.ndim == 0 else ""))
    traced = _traced_sizes(arr)
    if traced is not None and not isinstance(traced, tuple):
        return traced
    try:
        return operator.index(n if arr is None else arr.item())
    except TypeError:
        raise TypeError(f"{op}: {what} must be an integer (Python or numpy int, or a 0-d integer tensor), "
                        f"got {type(n).__name__} {n!r:.60}") from None


def shape_values(shape, op, what="shape", scalar=False):
    """A shape as a tuple of Python ints.

    Args:
      shape: a list, tuple or torch.Size of sizes (each as `size_value`
        takes), or a 1-D integer tensor (dtape, torch or numpy; variables are
        read). With `scalar=True` a single size means a 1-D shape (tf.zeros(3)).
      op, what: named in error messages.

    Raises:
      TypeError: an entry that is not an integer; a tensor that is not
        integer; a single size where a list is required.
      ValueError: a tensor of rank above 1.
    """
    if type(shape) in _SEQUENCES and all(type(s) is int for s in shape):  # the common case, first
        return tuple(shape)
    arr = _as_array(shape)
    traced = _traced_sizes(arr)
    if isinstance(traced, tuple):
        return traced
    if arr is not None:
        if not _is_integer(arr):
            raise TypeError(f"{op}: {what} must be of an integer dtype, got {arr.dtype}")
        if arr.ndim > 1:
            raise ValueError(f"{op}: {what} must be a 1-D list of sizes, got a tensor of shape {tuple(arr.shape)}")
        if arr.ndim == 1:
            return tuple(s if isinstance(s, torch.SymInt) else int(s) for s in arr.tolist())
    if isinstance(shape, (list, tuple, torch.Size)):
        return tuple(size_value(s, op, f"{what} entry") for s in shape)
    if not scalar:
        raise TypeError(f"{op}: {what} must be a list of sizes or a 1-D integer tensor, got "
                        f"{type(shape).__name__} {shape!r:.60} (for one dimension write [n])")
    return (size_value(shape, op, what),)


def scalar_value(x, op, what="value"):
    """A Python number for a scalar argument: Python numbers pass; 0-d tensors (any real dtype) give `.item()`.

    Raises:
      TypeError: a tensor of rank above 0.
    """
    arr = _as_array(x)
    if arr is None:
        return x
    if arr.ndim != 0:
        raise TypeError(f"{op}: {what} must be a scalar (a number or a 0-d tensor), got a tensor of shape "
                        f"{tuple(arr.shape)}")
    return arr.item()


def num_elements(t):
    """The number of elements of tensor-like `t` (with a shape): a Python int, or a torch.SymInt while a
    compiled function is traced with a None dim (a size of any call, which int() would fix to this one)."""
    n = 1
    for s in t.shape:
        n *= s if isinstance(s, torch.SymInt) else int(s)
    return n


def count_divisor(n, dtype):
    """A count `n` (an int, or a symbolic size of a trace) as the divisor of a mean: a Python float, or a
    0-d tensor of `dtype` for a symbolic size (a graph value, where float() would fix the traced size)."""
    return float(n) if type(n) is int else convert_to_tensor(n, dtype)
