"""Array ops: shape manipulation, indexing, selection, creation, casting.

TF names and arguments (tf.reshape, tf.gather, ...), torch dtypes. One block
per op: forward on torch tensors, then its gradient rule.
"""
import torch

from dtape.ops import _samples as S
from dtape.ops._registry import TORCH_TABLE, defop
from dtape.tensor import Tensor, _to_torch, normalize_device

__all__ = ["reshape", "transpose", "expand_dims", "squeeze", "concat", "stack", "broadcast_to",
           "where", "cast", "identity", "stop_gradient", "zeros", "ones", "zeros_like",
           "ones_like", "getitem"]


@defop(torch_fns=((torch.reshape, lambda x, shape: reshape(x, shape)),),
       samples=lambda rng: [((S.randn(rng, 2, 6),), {"shape": (3, -1)})])
def reshape(tensor, shape):
    """Same elements in a new shape (one entry may be -1). Source: tf.reshape."""
    return torch.reshape(tensor, tuple(shape))


@reshape.grad
def _(dy, ans, tensor, shape):
    return torch.reshape(dy, tuple(tensor.shape))


def _invert(perm):
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


@defop(torch_fns=((torch.permute, lambda x, dims: transpose(x, list(dims))),),
       samples=lambda rng: [((S.randn(rng, 2, 3, 4),), {"perm": (2, 0, 1)}), ((S.randn(rng, 3, 4),), {})])
def transpose(a, perm=None):
    """Permutes dimensions; perm=None reverses them. Source: tf.transpose."""
    perm = list(range(a.dim()))[::-1] if perm is None else [p % a.dim() for p in perm]
    return torch.permute(a, perm)


@transpose.grad
def _(dy, ans, a, perm=None):
    perm = list(range(a.dim()))[::-1] if perm is None else [p % a.dim() for p in perm]
    return torch.permute(dy, _invert(perm))


def _torch_transpose(x, dim0, dim1):
    perm = list(range(x.ndim))
    perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
    return transpose(x, perm)


TORCH_TABLE[torch.transpose] = _torch_transpose


@defop(samples=lambda rng: [((S.randn(rng, 2, 3),), {"axis": 1}), ((S.randn(rng, 2, 3),), {"axis": -1})])
def expand_dims(input, axis):  # noqa: A002 - TF's argument name
    """Inserts a size-1 dimension at `axis` (negative counts from the end of the result). Source: tf.expand_dims."""
    return torch.unsqueeze(input, axis)


@expand_dims.grad
def _(dy, ans, input, axis):  # noqa: A002
    return torch.reshape(dy, tuple(input.shape))


@defop(samples=lambda rng: [((S.randn(rng, 2, 1, 3, 1),), {}), ((S.randn(rng, 2, 1, 3, 1),), {"axis": 1})])
def squeeze(input, axis=None):  # noqa: A002
    """Removes size-1 dimensions (all, or those in `axis`). Source: tf.squeeze.

    Raises:
      ValueError: if a dimension named in `axis` is not of size 1.
    """
    if axis is None:
        return torch.squeeze(input)
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    for a in axes:
        if input.shape[a] != 1:
            raise ValueError(f"squeeze: dimension {a} has size {input.shape[a]}, not 1 (shape {tuple(input.shape)})")
    return torch.reshape(input, [s for i, s in enumerate(input.shape) if i not in {a % input.dim() for a in axes}])


@squeeze.grad
def _(dy, ans, input, axis=None):  # noqa: A002
    return torch.reshape(dy, tuple(input.shape))


def _concat_samples(rng):
    return [(([S.randn(rng, 2, 3), S.randn(rng, 1, 3)],), {"axis": 0}),
            (([S.randn(rng, 2, 3), S.randn(rng, 2, 2)],), {"axis": -1})]


@defop(list_input=True, samples=_concat_samples)
def concat(values, axis):
    """Joins a list of tensors along an existing `axis`. Source: tf.concat."""
    return torch.cat(list(values), dim=axis)


@concat.grad
def _(dy, ans, values, axis):
    sizes = [v.shape[axis] for v in values]
    return tuple(torch.split(dy, sizes, dim=axis))


def _stack_samples(rng):
    return [(([S.randn(rng, 2, 3), S.randn(rng, 2, 3)],), {"axis": 1})]


@defop(list_input=True, samples=_stack_samples)
def stack(values, axis=0):
    """Stacks same-shape tensors along a new `axis`. Source: tf.stack."""
    return torch.stack(list(values), dim=axis)


@stack.grad
def _(dy, ans, values, axis=0):
    return tuple(torch.unbind(dy, dim=axis))


@defop(samples=lambda rng: [((S.randn(rng, 3, 1),), {"shape": (2, 3, 4)})])
def broadcast_to(input, shape):  # noqa: A002
    """Broadcasts `input` to `shape` (numpy rules). Source: tf.broadcast_to."""
    return torch.broadcast_to(input, tuple(shape)).clone()


@broadcast_to.grad
def _(dy, ans, input, shape):  # noqa: A002
    return dy  # the backward walk sums it down to input's shape


TORCH_TABLE[torch.broadcast_to] = lambda x, size: broadcast_to(x, size)


def _where_samples(rng):
    cond = S.randn(rng, 3, 4) > 0
    return [((cond, S.randn(rng, 3, 4), S.randn(rng, 4)), {})]


@defop(n_in=3, samples=_where_samples)
def where(condition, x=None, y=None):
    """Elementwise x where condition else y, broadcasting. Source: tf.where (v2).

    With x and y None, returns the [num_true, ndim] int64 coordinates of true entries.
    """
    if x is None and y is None:
        return torch.nonzero(condition)
    dtype = x.dtype if isinstance(x, torch.Tensor) else (y.dtype if isinstance(y, torch.Tensor) else None)
    x = x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=dtype)
    y = y if isinstance(y, torch.Tensor) else torch.as_tensor(y, dtype=dtype)
    return torch.where(condition, x, y)


@where.grad
def _(dy, ans, condition, x=None, y=None):
    return None, torch.where(condition, dy, 0.0), torch.where(condition, 0.0, dy)


def _torch_where(condition, input=None, other=None):  # noqa: A002
    if input is None:
        from dtape.ops._dispatch import call_fallback
        return call_fallback(torch.where, (condition,), {})
    return where(condition, input, other)


TORCH_TABLE[torch.where] = _torch_where


@defop(samples=lambda rng: [((S.randn(rng, 3),), {"dtype": torch.float32})])
def cast(x, dtype):
    """x converted to torch `dtype`; float-to-float casts pass the gradient back. Source: tf.cast."""
    return x.to(dtype)


@cast.grad
def _(dy, ans, x, dtype):
    if not (x.dtype.is_floating_point and dtype.is_floating_point):
        return None
    return cast.any(dy, x.dtype)


@defop(samples=S.unary)
def identity(input):  # noqa: A002
    """Returns a new tensor with the same value (a distinct id). Source: tf.identity."""
    return input


@identity.grad
def _(dy, ans, input):  # noqa: A002
    return dy


@defop()
def stop_gradient(input):  # noqa: A002
    """The same value, with no gradient to `input` (never recorded). Source: tf.stop_gradient."""
    return input


def _creation_dtype(dtype):
    from dtape.tensor import DEFAULT_FLOAT_DTYPE
    return DEFAULT_FLOAT_DTYPE if dtype is None else dtype


def zeros(shape, dtype=None, device=None):
    """A tensor of zeros of `shape` (default float32, cpu). Source: tf.zeros."""
    return Tensor(torch.zeros(tuple(_to_list(shape)), dtype=_creation_dtype(dtype),
                              device=normalize_device(device or "cpu")))


def ones(shape, dtype=None, device=None):
    """A tensor of ones of `shape` (default float32, cpu). Source: tf.ones."""
    return Tensor(torch.ones(tuple(_to_list(shape)), dtype=_creation_dtype(dtype),
                             device=normalize_device(device or "cpu")))


def _to_list(shape):
    if isinstance(shape, Tensor):
        return [int(s) for s in shape.torch().tolist()]
    return [int(s) for s in (shape if isinstance(shape, (list, tuple, torch.Size)) else [shape])]


def zeros_like(input, dtype=None):  # noqa: A002
    """Zeros with input's shape, dtype (unless given) and device. Source: tf.zeros_like."""
    t = _like(input)
    return Tensor(torch.zeros_like(t, dtype=dtype or t.dtype))


def ones_like(input, dtype=None):  # noqa: A002
    """Ones with input's shape, dtype (unless given) and device. Source: tf.ones_like."""
    t = _like(input)
    return Tensor(torch.ones_like(t, dtype=dtype or t.dtype))


def _like(x):
    if isinstance(x, Tensor):
        return x.torch()
    read = getattr(x, "_dtape_read", None)
    return read().torch() if read else _to_torch(x)


TORCH_TABLE[torch.zeros_like] = lambda x, dtype=None, **kw: zeros_like(x, dtype)
TORCH_TABLE[torch.ones_like] = lambda x, dtype=None, **kw: ones_like(x, dtype)


# -- indexing -----------------------------------------------------------------
def _raw_key(key):
    if isinstance(key, tuple):
        return tuple(_raw_key(k) for k in key)
    if isinstance(key, Tensor):
        return key.torch()
    if isinstance(key, list):
        return torch.as_tensor(key)
    return key


def getitem(tensor, key):
    """tensor[key] with numpy/torch indexing (ints, slices, None, Ellipsis, index tensors).

    Source: tf.Tensor.__getitem__ (plus torch advanced indexing).
    """
    return _getitem(tensor, key=_raw_key(key))


@defop(name="getitem", samples=lambda rng: [((S.randn(rng, 4, 5),), {"key": (slice(1, None), None, torch.tensor([0, 2, 2]))})])
def _getitem(tensor, key):
    return tensor[key]


@_getitem.grad
def _(dy, ans, tensor, key):
    return _getitem_grad.any(dy, shape=tuple(tensor.shape), key=key)


@defop(name="getitem_grad",
       samples=lambda rng: [((S.randn(rng, 3, 1, 3),), {"shape": (4, 5), "key": (slice(1, None), None, torch.tensor([0, 2, 2]))})])
def _getitem_grad(dy, shape, key):
    """Scatter-adds dy into zeros of `shape` at `key` (repeated indices accumulate)."""
    with torch.enable_grad():
        z = torch.zeros(shape, dtype=dy.dtype, device=dy.device, requires_grad=True)
        (g,) = torch.autograd.grad(z[key], z, dy)
    return g


@_getitem_grad.grad
def _(ddy, ans, dy, shape, key):
    return _getitem.any(ddy, key=key)
