"""Array ops: shape manipulation, indexing, selection, creation, casting.

TF names and arguments (tf.reshape, tf.gather, ...), torch dtypes. One block
per op: forward on torch tensors, then its gradient rule.
"""
import builtins

import torch

from dtape._sizes import carry, scalar_value, shape_values, size_value
from dtape.ops import _samples as S
from dtape.ops._axes import AxisError, axis_values, canonical_axis, permutation
from dtape.ops._dispatch import call_fallback
from dtape.ops._registry import TORCH_TABLE, defop, tangents_or_zeros
from dtape.tensor import (DEFAULT_FLOAT_DTYPE, Tensor, to_torch, as_dtype, default_device, is_tracing, is_variable,
                          is_differentiable_dtype)

_brange = builtins.range  # `range` below is tf.range

__all__ = ["reshape", "transpose", "expand_dims", "squeeze", "concat", "stack", "broadcast_to",
           "where", "cast", "identity", "stop_gradient", "zeros", "ones", "zeros_like",
           "ones_like", "getitem", "split", "tile", "gather", "gather_nd", "one_hot", "fill", "range", "copy_to_device", "to_device"]


@defop(torch_fns=((torch.reshape, lambda x, shape: reshape(x, shape)),),
       samples=lambda rng: [((S.randn(rng, 2, 6),), {"shape": (3, -1)})], saves="none", complex_grad=True)
def reshape(tensor, shape):
    """Same elements in a new shape: a list of sizes (ints or 0-d integer tensors; one may be -1) or a 1-D
    integer tensor such as `dtape.shape(y)`. Source: tf.reshape."""
    return torch.reshape(tensor, shape_values(shape, "reshape"))


@reshape.grad
def _to_input_shape(dy, ans, tensor, shape):
    """reshape's and view's gradient: the upstream gradient in the input's shape (torch's ViewBackward)."""
    return torch.reshape(dy, tuple(tensor.shape))


@reshape.jvp
def _reshaped_tangent(dx, ans, tensor, shape):
    return reshape(dx, shape)


@defop(samples=lambda rng: [((S.randn(rng, 2, 6),), {"shape": (3, -1)}), ((S.randn(rng, 4),), {"shape": (2, 1, 2)})],
       saves="none", complex_grad=True)
def view(tensor, shape):
    """`torch.Tensor.view` with sizes: the same elements in a new shape, sharing the input's memory.

    torch's rules and errors: -1 infers one size; a shape the input's strides
    cannot view (e.g. a transposed input flattened) raises RuntimeError
    naming `.reshape(...)`. The gradient is the upstream gradient reshaped to
    the input's shape (torch's ViewBackward). Not exported: it is what
    `x.view(*sizes)` runs on dtape tensors. Source: torch.Tensor.view.
    """
    return tensor.view(shape_values(shape, "view"))


view.grad(_to_input_shape)
view.jvp(_reshaped_tangent)


def _method_sizes(sizes):
    """`x.view(2, 3)` and `x.view((2, 3))` alike: the sizes of a torch.Tensor shape method's arguments (one
    sequence, or sizes one by one: ints, numpy ints, 0-d integer tensors), as torch reads them."""
    return sizes[0] if len(sizes) == 1 and isinstance(sizes[0], (tuple, list, torch.Size)) else sizes


def _sizes_method(method, op):
    """torch.Tensor `method` (`view`, `reshape`) taking sizes, as `op` on dtape tensors. Other forms go to the
    autograd fallback, as before: keywords, no sizes, and a dtype (`view(dtype)` reads the same bits as another
    dtype, with no gradient in torch; `reshape` refuses one with torch's error)."""
    def call(tensor, *sizes, **kwargs):
        if kwargs or not sizes or isinstance(sizes[0], torch.dtype):
            return call_fallback(method, (tensor, *sizes), kwargs)
        return op(tensor, _method_sizes(sizes))
    return call


TORCH_TABLE[torch.Tensor.view] = _sizes_method(torch.Tensor.view, view)
TORCH_TABLE[torch.Tensor.reshape] = _sizes_method(torch.Tensor.reshape, reshape)


def _invert(perm):
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


@defop(torch_fns=((torch.permute, lambda x, dims: transpose(x, list(dims))),),
       samples=lambda rng: [((S.randn(rng, 2, 3, 4),), {"perm": (2, 0, 1)}), ((S.randn(rng, 3, 4),), {})], saves="none", complex_grad=True)
def transpose(a, perm=None):
    """Permutes dimensions; perm=None reverses them. Source: tf.transpose.

    A result of more than two dimensions is laid out contiguously, as TF's
    transpose materialises: batched matmuls and reshapes after it then copy
    nothing, forward or backward (a 2-D transpose stays a view: matrix
    products read transposed strides directly).
    """
    perm = list(_brange(a.ndim))[::-1] if perm is None else permutation(perm, a.ndim)
    out = torch.permute(a, perm)
    return out.contiguous() if out.ndim > 2 else out


@transpose.grad
def _(dy, ans, a, perm=None):
    perm = list(_brange(a.ndim))[::-1] if perm is None else permutation(perm, a.ndim)
    return transpose.any(dy, _invert(perm))


@transpose.jvp
def _(dx, ans, a, perm=None):
    return transpose(dx, perm)


def _torch_transpose(x, dim0, dim1):
    perm = list(_brange(x.ndim))
    perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
    return transpose(x, perm)


TORCH_TABLE[torch.transpose] = _torch_transpose


@defop(samples=lambda rng: [((S.randn(rng, 2, 3),), {"axis": 1}), ((S.randn(rng, 2, 3),), {"axis": -1})])
def expand_dims(input, axis):  # noqa: A002 - TF's argument name
    """Inserts a size-1 dimension at `axis` (negative counts from the end of the result). Source: tf.expand_dims."""
    return torch.unsqueeze(input, canonical_axis(axis, input.ndim, "expand_dims", inserts=True))


@expand_dims.grad
def _(dy, ans, input, axis):  # noqa: A002
    return torch.reshape(dy, tuple(input.shape))


@expand_dims.jvp
def _(dx, ans, input, axis):  # noqa: A002
    return reshape(dx, tuple(ans.shape))


@defop(samples=lambda rng: [((S.randn(rng, 2, 1, 3, 1),), {}), ((S.randn(rng, 2, 1, 3, 1),), {"axis": 1})])
def squeeze(input, axis=None):  # noqa: A002
    """Removes size-1 dimensions (all, or those in `axis`). Source: tf.squeeze.

    Raises:
      ValueError: if a dimension named in `axis` is not of size 1.
    """
    if axis is None:
        return torch.squeeze(input)
    axes = axis_values(axis, "squeeze")
    axes = {canonical_axis(a, input.ndim, "squeeze") for a in ((axes,) if isinstance(axes, int) else axes)}
    for a in sorted(axes):
        if input.shape[a] != 1:
            raise ValueError(f"squeeze: dimension {a} has size {input.shape[a]}, not 1 (shape {tuple(input.shape)})")
    return torch.reshape(input, [s for i, s in enumerate(input.shape) if i not in axes])


@squeeze.grad
def _(dy, ans, input, axis=None):  # noqa: A002
    return torch.reshape(dy, tuple(input.shape))


@squeeze.jvp
def _(dx, ans, input, axis=None):  # noqa: A002
    return reshape(dx, tuple(ans.shape))


def _concat_samples(rng):
    return [(([S.randn(rng, 2, 3), S.randn(rng, 1, 3)],), {"axis": 0}),
            (([S.randn(rng, 2, 3), S.randn(rng, 2, 2)],), {"axis": -1})]


@defop(list_input=True, samples=_concat_samples, saves="none", complex_grad=True)
def concat(values, axis):
    """Joins a list of tensors along an existing `axis`. Source: tf.concat."""
    return torch.cat(list(values), dim=_concat_axis(values, axis))


def _concat_axis(values, axis):
    return canonical_axis(axis, values[0].ndim if values else 1, "concat")


@concat.grad
def _(dy, ans, values, axis):
    axis = _concat_axis(values, axis)
    sizes = [v.shape[axis] for v in values]
    return tuple(torch.split(dy, sizes, dim=axis))


@concat.jvp
def _(tangents, ans, values, axis):
    return concat(tangents_or_zeros(tangents, values), axis)


def _stack_samples(rng):
    return [(([S.randn(rng, 2, 3), S.randn(rng, 2, 3)],), {"axis": 1})]


@defop(list_input=True, samples=_stack_samples, saves="none", complex_grad=True)
def stack(values, axis=0):
    """Stacks same-shape tensors along a new `axis`. Source: tf.stack."""
    return torch.stack(list(values), dim=_stack_axis(values, axis))


def _stack_axis(values, axis):
    return canonical_axis(axis, values[0].ndim if values else 0, "stack", inserts=True)


@stack.grad
def _(dy, ans, values, axis=0):
    return tuple(torch.unbind(dy, dim=_stack_axis(values, axis)))


@stack.jvp
def _(tangents, ans, values, axis=0):
    return stack(tangents_or_zeros(tangents, values), axis)


@defop(samples=lambda rng: [((S.randn(rng, 3, 1),), {"shape": (2, 3, 4)})], complex_grad=True)
def broadcast_to(input, shape):  # noqa: A002
    """Broadcasts `input` to `shape` (numpy rules; sizes as `reshape` takes them). Source: tf.broadcast_to."""
    return torch.broadcast_to(input, shape_values(shape, "broadcast_to")).clone()


@broadcast_to.grad
def _(dy, ans, input, shape):  # noqa: A002
    return dy  # the backward walk sums it down to input's shape


@broadcast_to.jvp
def _(dx, ans, input, shape):  # noqa: A002
    return broadcast_to(dx, shape)


TORCH_TABLE[torch.broadcast_to] = lambda x, size: broadcast_to(x, size)


def _where_samples(rng):
    cond = S.randn(rng, 3, 4) > 0
    return [((cond, S.randn(rng, 3, 4), S.randn(rng, 4)), {})]


@defop(n_in=3, samples=_where_samples, saves="inputs")
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
        return call_fallback(torch.where, (condition,), {})
    return where(condition, input, other)


TORCH_TABLE[torch.where] = _torch_where


@defop(samples=lambda rng: [((S.randn(rng, 3),), {"dtype": torch.float32})], saves="none",
       complex_grad=True)
def cast(x, dtype):
    """x converted to torch `dtype`; float-to-float casts pass the gradient back. Source: tf.cast."""
    return x.to(as_dtype(dtype))


@cast.grad
def _(dy, ans, x, dtype):
    if not (is_differentiable_dtype(x.dtype) and is_differentiable_dtype(ans.dtype)):
        return None
    if dy.dtype.is_complex and not x.dtype.is_complex:  # complex to real: the real part (as torch)
        dy = dy.real
    return cast.any(dy, x.dtype)


@cast.jvp
def _(dx, ans, x, dtype):
    if not (is_differentiable_dtype(x.dtype) and is_differentiable_dtype(ans.dtype)):
        return None
    return cast(dx, ans.dtype)


@defop(samples=S.unary, saves="none", complex_grad=True)
def identity(input):  # noqa: A002
    """Returns a new tensor with the same value (a distinct id). Source: tf.identity."""
    return input


@identity.grad
def _(dy, ans, input):  # noqa: A002
    return dy


@identity.jvp
def _(dx, ans, input):  # noqa: A002
    return dx


@defop()
def stop_gradient(input):  # noqa: A002
    """The same value, with no gradient to `input` (never recorded). Source: tf.stop_gradient."""
    return input


def _creation_dtype(dtype):
    return DEFAULT_FLOAT_DTYPE if dtype is None else as_dtype(dtype)


def zeros(shape, dtype=None, device=None, *, name=None):
    """A tensor of zeros of `shape` (default float32, on the `dtape.device` scope's device). Source: tf.zeros."""
    return Tensor(torch.zeros(shape_values(shape, "zeros", scalar=True), dtype=_creation_dtype(dtype),
                              device=default_device(device)))


def ones(shape, dtype=None, device=None, *, name=None):
    """A tensor of ones of `shape` (default float32, on the `dtape.device` scope's device). Source: tf.ones."""
    return Tensor(torch.ones(shape_values(shape, "ones", scalar=True), dtype=_creation_dtype(dtype),
                             device=default_device(device)))


def zeros_like(input, dtype=None, name=None):  # noqa: A002
    """Zeros with input's shape, dtype (unless given) and device. Source: tf.zeros_like."""
    t = _like(input)
    return Tensor(torch.zeros_like(t, dtype=as_dtype(dtype) or t.dtype))


def ones_like(input, dtype=None, name=None):  # noqa: A002
    """Ones with input's shape, dtype (unless given) and device. Source: tf.ones_like."""
    t = _like(input)
    return Tensor(torch.ones_like(t, dtype=as_dtype(dtype) or t.dtype))


def _like(x):
    if isinstance(x, Tensor):
        return x.torch()
    return x._dtape_read().torch() if is_variable(x) else to_torch(x)


TORCH_TABLE[torch.zeros_like] = lambda x, dtype=None, **kw: zeros_like(x, dtype)
TORCH_TABLE[torch.ones_like] = lambda x, dtype=None, **kw: ones_like(x, dtype)


# -- indexing -----------------------------------------------------------------
_PLAIN_BOUNDS = frozenset([int, type(None)])


def _raw_key(key):
    if isinstance(key, tuple):
        return tuple(_raw_key(k) for k in key)
    if isinstance(key, Tensor):
        return key.torch()
    if type(key) is slice and not {type(key.start), type(key.stop), type(key.step)} <= _PLAIN_BOUNDS:
        return slice(_bound(key.start), _bound(key.stop), _bound(key.step))
    if isinstance(key, list):  # an empty list selects nothing: int64, as torch reads x[[]]
        return torch.as_tensor(key) if key else torch.zeros(0, dtype=torch.int64)
    return key


def _bound(b):
    """A slice bound: a traced size (`x[:, :dtape.shape(x)[1]]` in a compiled function, TF's idiom) is the size it
    carries (an int, or a symbolic size that torch's slicing takes), where reading the traced tensor's value would
    fail; anything else as given (torch reads a 0-d integer tensor's value)."""
    sizes = getattr(b.torch() if isinstance(b, Tensor) else b, "_dtape_sizes", None)
    return b if sizes is None or isinstance(sizes, tuple) else sizes


def getitem(tensor, key):
    """tensor[key] with numpy/torch indexing (ints, slices, None, Ellipsis, index tensors).

    Negative slice steps (`x[::-1]`, `x[5:1:-2]`) select as numpy's and TF's
    do (torch refuses them), in a key of ints, slices, None and Ellipsis.

    Raises:
      IndexError: a negative step in a key that also holds an index tensor or list.

    Source: tf.Tensor.__getitem__ (plus torch advanced indexing).
    """
    raw = _raw_key(key)
    plain, reversals = _negative_steps(raw, tensor.shape)
    out = _getitem(tensor, key=plain)
    for position, index in reversals:  # one index per reversed dimension: tensor indices would broadcast together
        out = _getitem(out, key=(slice(None),) * position + (index,))
    sizes = getattr(tensor._t, "_dtape_sizes", None) if type(tensor) is Tensor else None
    if sizes is not None and (type(raw) is int or isinstance(raw, slice)):  # dtape.shape(x)[0] traced: kept
        carry(out._t, sizes[raw])
    return out


def _negative_steps(key, shape):
    """(key with each negative-step slice made `:`, [(its dimension in the result, the positions it selects)])."""
    items = key if isinstance(key, tuple) else (key,)
    if not any(isinstance(k, slice) and k.step is not None and k.step < 0 for k in items):
        return key, []
    items = [k.item() if isinstance(k, torch.Tensor) and k.ndim == 0 and k.dtype != torch.bool else k for k in items]
    if not all(k is None or k is Ellipsis or isinstance(k, (int, slice)) for k in items):
        raise IndexError("a negative slice step together with an index tensor or list in one key is not supported "
                         "(numpy would move the indexed dimensions); index in two steps, e.g. x[::-1][:, idx]")
    plain, reversals, dim, position = [], [], 0, 0
    for k in items:
        if k is Ellipsis:
            skipped = len(shape) - sum(1 for j in items if j is not None and j is not Ellipsis)
            dim, position = dim + skipped, position + skipped
        elif isinstance(k, slice) and k.step is not None and k.step < 0:
            reversals.append((position, torch.arange(*k.indices(shape[dim]))))
            k = slice(None)
        plain.append(k)
        dim += k is not None and k is not Ellipsis
        position += k is None or isinstance(k, slice)
    return tuple(plain), reversals


@defop(name="getitem", samples=lambda rng: [((S.randn(rng, 4, 5),), {"key": (slice(1, None), None, torch.tensor([0, 2, 2]))})], saves="none",
       complex_grad=True)
def _getitem(tensor, key):
    return tensor[key]


@_getitem.grad
def _(dy, ans, tensor, key):
    return _getitem_grad.any(dy, shape=tuple(tensor.shape), key=key)


@_getitem.jvp
def _(dx, ans, tensor, key):
    return _getitem(dx, key=key)


@defop(name="getitem_grad",
       samples=lambda rng: [((S.randn(rng, 3, 1, 3),), {"shape": (4, 5), "key": (slice(1, None), None, torch.tensor([0, 2, 2]))})],
       complex_grad=True)
def _getitem_grad(dy, shape, key):
    """Scatter-adds dy into zeros of `shape` at `key` (repeated indices accumulate)."""
    with torch.enable_grad():
        z = torch.zeros(shape, dtype=dy.dtype, device=dy.device, requires_grad=True)
        (g,) = torch.autograd.grad(z[key], z, dy, create_graph=dy.requires_grad)
    return g


@_getitem_grad.grad
def _(ddy, ans, dy, shape, key):
    return _getitem.any(ddy, key=key)


# -- split, tile --------------------------------------------------------------
def _split_sizes(n, num_or_size_splits):
    if not isinstance(num_or_size_splits, (list, tuple)) and getattr(num_or_size_splits, "ndim", 0) == 0:
        k = size_value(num_or_size_splits, "split", "num_or_size_splits")
        if k <= 0 or n % k:
            raise ValueError(f"split: dimension of size {n} is not divisible into {k} parts")
        return [n // k] * k
    sizes = list(shape_values(num_or_size_splits, "split", "num_or_size_splits"))
    if sizes.count(-1) > 1:
        raise ValueError(f"split: at most one size may be -1, got {sizes}")
    if -1 in sizes:
        sizes[sizes.index(-1)] = n - (sum(sizes) + 1)
    if sum(sizes) != n or min(sizes) < 0:
        raise ValueError(f"split: sizes {sizes} do not sum to the dimension's size {n}")
    return sizes


def _split_samples(rng):
    return [((S.randn(rng, 6, 4),), {"num_or_size_splits": 3}),
            ((S.randn(rng, 2, 7),), {"num_or_size_splits": [2, -1, 1], "axis": -1})]


@defop(multi_output=True, samples=_split_samples, saves="none", complex_grad=True)
def split(value, num_or_size_splits, axis=0):
    """Splits `value` along `axis` into pieces.

    Args:
      value: tensor of any dtype, shape [..., n, ...] (n at `axis`).
      num_or_size_splits: an int k dividing n (k equal pieces), or a list of
        sizes summing to n (one may be -1: the rest).
      axis: the dimension to split (negative counts from the end).

    Returns:
      A tuple of tensors, the i-th of shape [..., size_i, ...].

    Source: tf.split.
    """
    axis = canonical_axis(axis, value.ndim, "split")
    sizes = _split_sizes(value.shape[axis], num_or_size_splits)
    return tuple(torch.split(value, sizes, dim=axis))


@split.grad
def _(dys, ans, value, num_or_size_splits, axis=0):
    return torch.cat(list(dys), dim=canonical_axis(axis, value.ndim, "split"))


def _tile_samples(rng):
    return [((S.randn(rng, 2, 3),), {"multiples": [2, 3]}), ((S.randn(rng, 3),), {"multiples": [1]})]


@defop(samples=_tile_samples)
def tile(input, multiples):  # noqa: A002 - TF's argument name
    """Repeats `input` `multiples[i]` times along dimension i.

    Args:
      input: tensor of rank r, shape [d_0, ..., d_{r-1}], any dtype.
      multiples: r ints (a list of ints or 0-d integer tensors, or a 1-D integer tensor).

    Returns:
      Shape [d_0 * m_0, ..., d_{r-1} * m_{r-1}], input's dtype.

    Source: tf.tile.
    """
    multiples = shape_values(multiples, "tile", "multiples")
    if len(multiples) != input.ndim:
        raise ValueError(f"tile: multiples has length {len(multiples)}, expected the input's rank {input.ndim}")
    return torch.tile(input, tuple(multiples))


@tile.grad
def _(dy, ans, input, multiples):  # noqa: A002
    multiples = shape_values(multiples, "tile", "multiples")
    split_shape = [d for m, s in zip(multiples, input.shape) for d in (m, s)]
    summed = torch.sum(torch.reshape(dy, split_shape), dim=tuple(_brange(0, 2 * len(multiples), 2)))
    return torch.reshape(summed, tuple(input.shape))


# -- gather -------------------------------------------------------------------
def _gather_layout(pshape, ishape, axis, batch_dims):
    """Permutation of params to [batch..., n, mid..., rest...] for a batched take along `axis`."""
    rank, irank = len(pshape), len(ishape)
    batch_dims = axis_values(batch_dims, "gather", "batch_dims")
    if isinstance(batch_dims, tuple) or not -irank <= batch_dims <= irank:
        raise AxisError(f"gather: batch_dims {batch_dims} is out of range for indices of rank {irank}; "
                        f"batch_dims must be in [{-irank}, {irank}] (negative counts from the indices' rank)")
    batch_dims = batch_dims + irank if batch_dims < 0 else batch_dims
    axis = batch_dims if axis is None else canonical_axis(axis, rank, "gather")
    if not batch_dims <= axis < rank:
        raise ValueError(f"gather: need batch_dims <= axis < rank, got batch_dims={batch_dims}, axis={axis}, "
                         f"params rank {rank}")
    if tuple(pshape[:batch_dims]) != tuple(ishape[:batch_dims]):
        raise ValueError(f"gather: batch dims of params {tuple(pshape)} and indices {tuple(ishape)} differ")
    perm = list(_brange(batch_dims)) + [axis] + list(_brange(batch_dims, axis)) + list(_brange(axis + 1, rank))
    return axis, batch_dims, perm


def _batch_index(ind, batch_dims):
    """Index tensors (batch position, index) for `p[batch..., ind]` with batch dims flattened."""
    bshape = tuple(ind.shape[:batch_dims])
    nb = 1
    for b in bshape:
        nb *= b
    flat = torch.reshape(ind, (nb,) + tuple(ind.shape[batch_dims:]))
    pos = torch.reshape(torch.arange(nb, device=ind.device), (nb,) + (1,) * (flat.ndim - 1))
    return pos, flat, bshape, nb


def _gather_take(params, indices, axis, batch_dims):
    axis, batch_dims, perm = _gather_layout(params.shape, indices.shape, axis, batch_dims)
    pos, flat, bshape, nb = _batch_index(indices, batch_dims)
    p = torch.reshape(torch.permute(params, perm), (nb,) + tuple(params.shape[axis:axis + 1])
                      + tuple(params.shape[batch_dims:axis]) + tuple(params.shape[axis + 1:]))
    out = p[pos, flat]                     # [nb, idx..., mid..., rest...]
    n_idx, n_mid = flat.ndim - 1, axis - batch_dims
    order = [0] + list(_brange(1 + n_idx, 1 + n_idx + n_mid)) + list(_brange(1, 1 + n_idx)) \
        + list(_brange(1 + n_idx + n_mid, out.ndim))
    out = torch.permute(out, order)
    return torch.reshape(out, bshape + tuple(out.shape[1:]))


def _gather_samples(rng):
    idx = torch.tensor([[0, 2], [2, 2], [1, 0]])
    return [((S.randn(rng, 3, 4), idx), {}),
            ((S.randn(rng, 2, 3, 4), torch.tensor([3, 0, 3])), {"axis": -1}),
            ((S.randn(rng, 3, 2, 4, 5), torch.tensor([[0, 3], [1, 1], [2, 0]])), {"axis": 2, "batch_dims": 1})]


@defop(n_in=2, samples=_gather_samples, saves="inputs")
def gather(params, indices, axis=None, batch_dims=0):
    """Gathers slices of `params` along `axis` at `indices` (not torch.gather).

    Args:
      params: tensor [b_0..b_{B-1}, p_B..p_{a-1}, n, p_{a+1}...], any dtype.
      indices: int tensor [b_0..b_{B-1}, i...] with values in [0, n).
      axis: the gathered dimension a of params (default `batch_dims`; negative
        counts from the end).
      batch_dims: B, the number of leading dimensions shared by both.

    Returns:
      Shape params.shape[:a] + indices.shape[B:] + params.shape[a+1:],
      params' dtype. Repeated indices accumulate in the gradient.

    Source: tf.gather.
    """
    return _gather_take(params, indices, axis, batch_dims)


@gather.grad
def _(dy, ans, params, indices, axis=None, batch_dims=0, needs=(True, False)):
    if not needs[0]:  # params unreachable from a source (integer indices never take a gradient)
        return None, None
    return _gather_grad.any(dy, indices, shape=tuple(params.shape), axis=axis, batch_dims=batch_dims), None


def _gather_grad_samples(rng):
    return [((S.randn(rng, 3, 2, 2, 5), torch.tensor([[0, 3], [1, 1], [2, 0]])),
             {"shape": (3, 2, 4, 5), "axis": 2, "batch_dims": 1}),
            ((S.randn(rng, 3, 2, 4), torch.tensor([[0, 2], [2, 2], [1, 0]])), {"shape": (3, 4), "axis": None, "batch_dims": 0})]


@defop(n_in=2, name="gather_grad", samples=_gather_grad_samples, saves="inputs")
def _gather_grad(dy, indices, shape, axis=None, batch_dims=0):
    """Scatter-adds `dy` (gather's output shape) into zeros of `shape`: gather's transpose."""
    axis, batch_dims, perm = _gather_layout(shape, indices.shape, axis, batch_dims)
    if axis == 0 and batch_dims == 0:  # rows of a table (an embedding): one index_add, ~4x faster than index_put
        # index_add_ wants the indices on dy's device (index_put, the forward's indexing, take CPU ones too)
        n, flat = shape[0], torch.reshape(indices, (-1,)).to(dy.device)
        flat = torch.where(flat < 0, flat + n, flat)  # negative indices count from the end, as the forward's
        z = torch.zeros(tuple(shape), dtype=dy.dtype, device=dy.device)
        return z.index_add_(0, flat, torch.reshape(dy, (flat.shape[0],) + tuple(shape[1:])))
    pos, flat, bshape, nb = _batch_index(indices, batch_dims)
    n_idx, n_mid = flat.ndim - 1, axis - batch_dims
    d = torch.reshape(dy, (nb,) + tuple(dy.shape[batch_dims:]))
    order = [0] + list(_brange(1 + n_mid, 1 + n_mid + n_idx)) + list(_brange(1, 1 + n_mid)) \
        + list(_brange(1 + n_mid + n_idx, d.ndim))
    d = torch.permute(d, order)                     # [nb, idx..., mid..., rest...]
    pshape = [nb, shape[axis]] + list(shape[batch_dims:axis]) + list(shape[axis + 1:])
    z = torch.zeros(pshape, dtype=dy.dtype, device=dy.device)
    g = torch.index_put(z, (torch.broadcast_to(pos, flat.shape), flat), d, accumulate=True)
    g = torch.reshape(g, tuple(shape[:batch_dims]) + tuple(pshape[1:]))
    return torch.permute(g, _invert(perm))


@_gather_grad.grad
def _(ddy, ans, dy, indices, shape, axis=None, batch_dims=0):
    return gather.any(ddy, indices, axis=axis, batch_dims=batch_dims), None


def _nd_key(indices, batch_dims):
    pos, flat, bshape, nb = _batch_index(indices, batch_dims)
    pos = torch.reshape(pos, tuple(pos.shape[:-1]))
    return (torch.broadcast_to(pos, flat.shape[:-1]),) + tuple(torch.unbind(flat, dim=-1)), bshape, nb


def _gather_nd_samples(rng):
    return [((S.randn(rng, 3, 4, 2), torch.tensor([[0, 1], [2, 3], [0, 1]])), {}),
            ((S.randn(rng, 2, 3, 4), torch.tensor([[[1], [1]], [[0], [2]]])), {"batch_dims": 1})]


@defop(n_in=2, samples=_gather_nd_samples, saves="inputs")
def gather_nd(params, indices, batch_dims=0):
    """Gathers slices of `params` addressed by the last dimension of `indices`.

    Args:
      params: tensor [b..., p_0..p_{m-1}, rest...], any dtype (B = batch_dims leading b's).
      indices: int tensor [b..., i..., m]; each row of m ints addresses p_0..p_{m-1}.
      batch_dims: number of leading dimensions shared by both.

    Returns:
      Shape indices.shape[:-1] + params.shape[B + m:], params' dtype.

    Source: tf.gather_nd.
    """
    key, bshape, nb = _nd_key(indices, batch_dims)
    p = torch.reshape(params, (nb,) + tuple(params.shape[batch_dims:]))
    out = p[key]
    return torch.reshape(out, bshape + tuple(out.shape[1:]))


@gather_nd.grad
def _(dy, ans, params, indices, batch_dims=0, needs=(True, False)):
    if not needs[0]:
        return None, None
    return _gather_nd_grad.any(dy, indices, shape=tuple(params.shape), batch_dims=batch_dims), None


@defop(n_in=2, name="gather_nd_grad",
       samples=lambda rng: [((S.randn(rng, 3, 2), torch.tensor([[0, 1], [2, 3], [0, 1]])), {"shape": (3, 4, 2)})], saves="inputs")
def _gather_nd_grad(dy, indices, shape, batch_dims=0):
    """Scatter-adds `dy` into zeros of `shape` at gather_nd's `indices`: gather_nd's transpose."""
    key, bshape, nb = _nd_key(indices, batch_dims)
    z = torch.zeros((nb,) + tuple(shape[batch_dims:]), dtype=dy.dtype, device=dy.device)
    d = torch.reshape(dy, (nb,) + tuple(dy.shape[batch_dims:]))
    return torch.reshape(torch.index_put(z, key, d, accumulate=True), tuple(shape))


@_gather_nd_grad.grad
def _(ddy, ans, dy, indices, shape, batch_dims=0):
    return gather_nd.any(ddy, indices, batch_dims=batch_dims), None


# -- creation -----------------------------------------------------------------
@defop()
def one_hot(indices, depth, on_value=1.0, off_value=0.0, axis=-1, dtype=torch.float32):
    """One-hot encoding of integer `indices` (no gradient).

    Args:
      indices: int tensor [i...]; values outside [0, depth) give all `off_value`.
      depth: number of classes (an int or a 0-d integer tensor).
      on_value, off_value: Python scalars or 0-d tensors.
      axis: where the new dimension of size `depth` goes (-1: last).
      dtype: output torch dtype.

    Returns:
      Shape [i...] with `depth` inserted at `axis`, `dtype`.

    Source: tf.one_hot.
    """
    dtype = as_dtype(dtype)
    depth = size_value(depth, "one_hot", "depth")
    on_value, off_value = scalar_value(on_value, "one_hot", "on_value"), scalar_value(off_value, "one_hot", "off_value")
    axis = axis_values(axis, "one_hot")
    if isinstance(axis, tuple) or not (axis == -1 or 0 <= axis <= indices.ndim):
        raise AxisError(f"one_hot: axis {axis} is out of range for indices of rank {indices.ndim}; "
                        f"axis must be -1 (last) or in [0, {indices.ndim}]")
    valid = torch.logical_and(indices >= 0, indices < depth)
    hot = torch.nn.functional.one_hot(torch.where(valid, indices, 0).long(), depth).bool()
    hot = torch.logical_and(hot, valid.unsqueeze(-1))
    out = torch.where(hot, torch.tensor(on_value, dtype=dtype, device=indices.device),
                      torch.tensor(off_value, dtype=dtype, device=indices.device))
    return out if axis == -1 else torch.movedim(out, -1, axis)


@defop(name="fill", samples=lambda rng: [((S.randn(rng),), {"dims": (2, 3)})], saves="none")
def _fill(value, dims):
    return torch.full(tuple(dims), 0, dtype=value.dtype, device=value.device) + value


@_fill.grad
def _(dy, ans, value, dims):
    return torch.sum(dy)


def fill(dims, value, name=None):
    """A tensor of shape `dims` filled with the scalar `value` (differentiable in `value`).

    Args:
      dims: the output shape: a list of ints or 0-d integer tensors, or a 1-D integer tensor.
      value: scalar (Python number or 0-d tensor); its dtype is the output's.

    Returns:
      Shape `dims`, value's dtype (float32 for Python floats, int64 for ints).

    Source: tf.fill.
    """
    return _fill(value, dims=shape_values(dims, "fill", "dims", scalar=True))


def range(start, limit=None, delta=1, dtype=None, name=None):  # noqa: A001 - TF's name
    """Numbers from `start` (inclusive) to `limit` (exclusive) by `delta`; `range(n)` is 0..n-1.

    Args:
      start, limit, delta: Python or 0-d tensor scalars.
      dtype: torch dtype; default: the widest dtype of the 0-d tensor arguments
        (int32 from `dtape.shape`, as TF), made float32 by a Python float;
        with Python numbers only, int64 if all are ints, else float32.

    Returns:
      A 1-D tensor of ceil((limit - start) / delta) elements (no gradient).

    Source: tf.range.
    """
    if limit is None:
        start, limit = 0, start
    args = (start, limit, delta)
    vals = [scalar_value(v, "range", name) for v, name in zip(args, ("start", "limit", "delta"))]
    return Tensor(torch.arange(*vals, dtype=_range_dtype(args, vals, dtype), device=default_device()))


def _range_dtype(args, vals, dtype):
    """tf.range's dtype: the given one, else the widest of the 0-d tensor arguments' dtypes (Python ints
    take theirs, as TF's do), made floating (float32) by a Python float; int64 for Python ints alone."""
    if dtype is not None:
        return as_dtype(dtype)
    out = None
    for d in filter(None, map(_scalar_dtype, args)):
        out = d if out is None else torch.promote_types(out, d)
    out = out or torch.int64
    floats = any(isinstance(v, float) for a, v in zip(args, vals) if _scalar_dtype(a) is None)
    return _creation_dtype(None) if floats and not out.is_floating_point else out


def _scalar_dtype(a):
    if is_variable(a) or isinstance(a, Tensor):
        return a.dtype
    return a.dtype if isinstance(a, torch.Tensor) else None


@defop(samples=lambda rng: [((S.randn(rng, 2, 3),), {"device": torch.device("cpu")})], saves="none",
       complex_grad=True)
def copy_to_device(x, device):
    """A copy of x on `device` (torch.device); the gradient is copied back to x's device.

    Source: tf.identity under tf.device.
    """
    return x.to(device, copy=True)


@copy_to_device.grad
def _(dy, ans, x, device):
    return copy_to_device.any(dy, device=x.device)


def to_device(x, device):
    """`x` itself when it is on `device` (a torch.device), else a recorded copy there."""
    return x if x.device == device else copy_to_device(x, device)


# -- shape queries, padding, eye, linspace (TF names) ---------------------------
newaxis = None  # x[:, dtape.newaxis] inserts a dimension, as tf.newaxis (and numpy's)


def shape(input, out_type=torch.int32, name=None):  # noqa: A002 - TF's argument name
    """The shape of `input` as a 1-D integer tensor (no gradient).

    Args:
      input: tensor-like of any shape, dtype and device.
      out_type: integer torch dtype of the result (TF's default: int32).

    Returns:
      A [rank] tensor of `out_type` on the CPU (TF keeps shapes in host memory:
      a size argument reads it without waiting for a device). Every size
      argument takes it (`dtape.reshape(y, dtape.shape(x))`,
      `dtape.random.normal(dtape.shape(x))`); `x.shape` is the torch.Size.

    Source: tf.shape.

    Example:
      >>> dtape.shape(dtape.zeros([2, 3])).numpy()
      array([2, 3], dtype=int32)
    """
    sizes, dtype = tuple(_like(input).shape), as_dtype(out_type)
    if not is_tracing():
        return Tensor(torch.tensor(sizes, dtype=dtype))
    # traced (a compiled function), the tensor has no values to read back: it carries the sizes, which size
    # arguments take (`dtape._sizes`), symbolic for None dims (graph values, where torch.tensor would fix them)
    t = torch.stack([torch.full((), d, dtype=dtype) for d in sizes]) if sizes else torch.zeros(0, dtype=dtype)
    return Tensor(carry(t, sizes))


def size(input, out_type=torch.int32, name=None):  # noqa: A002
    """The number of elements of `input` as a 0-d integer tensor of `out_type` on the CPU; every size argument
    takes it, in a compiled function too (as `shape`). Source: tf.size."""
    return _size_tensor(_like(input).numel(), as_dtype(out_type))


def rank(input, name=None):  # noqa: A002
    """The number of dimensions of `input` as a 0-d int32 tensor on the CPU; every size argument takes it, in a
    compiled function too (as `shape`). Source: tf.rank."""
    return _size_tensor(_like(input).ndim, torch.int32)


def _size_tensor(n, dtype):
    """A 0-d tensor of size `n` (an int, or a symbolic size of a trace). Traced, it also carries `n`, as
    `shape`'s result carries its sizes: the trace's tensors have no values for a size argument to read."""
    t = torch.full((), n, dtype=dtype)
    return Tensor(carry(t, n) if is_tracing() else t)


def eye(num_rows, num_columns=None, batch_shape=None, dtype=None, name=None):
    """Identity matrices: ones on the main diagonal, zeros elsewhere (no gradient).

    Args:
      num_rows, num_columns: sizes (ints or 0-d integer tensors); num_columns defaults to num_rows.
      batch_shape: None, or a shape: the result is that many copies, [*batch_shape, num_rows, num_columns].
      dtype: torch dtype (default float32).

    Returns:
      [*batch_shape, num_rows, num_columns] of `dtype`, on the `dtape.device` scope's device.

    Source: tf.eye.

    Example:
      >>> dtape.eye(2, 3).numpy()
      array([[1., 0., 0.],
             [0., 1., 0.]], dtype=float32)
    """
    rows = size_value(num_rows, "eye", "num_rows")
    cols = rows if num_columns is None else size_value(num_columns, "eye", "num_columns")
    batch = () if batch_shape is None else shape_values(batch_shape, "eye", "batch_shape")
    m = torch.eye(rows, cols, dtype=_creation_dtype(dtype), device=default_device())
    return Tensor(m.expand(batch + (rows, cols)).clone())


def _paddings(paddings, ndim):
    """TF's paddings ([rank, 2] ints: a list of pairs or an integer tensor) as a list of (before, after)."""
    rows = _like(paddings) if isinstance(paddings, Tensor) or is_variable(paddings) else paddings
    rows = list(rows) if getattr(rows, "ndim", 0) > 1 else rows  # a [rank, 2] tensor: its 1-D rows
    if isinstance(rows, (list, tuple)) and all(isinstance(r, (list, tuple, torch.Size)) or getattr(r, "ndim", 0) == 1
                                               for r in rows):
        pairs = [shape_values(r, "pad", "paddings row") for r in rows]
    else:
        pairs = None
    if pairs is None or len(pairs) != ndim or any(len(p) != 2 for p in pairs):
        raise ValueError(f"pad: paddings must be [rank, 2] = [{ndim}, 2] (one [before, after] pair per "
                         f"dimension), got {paddings!r:.80}")
    if any(p < 0 for pair in pairs for p in pair):
        raise ValueError(f"pad: paddings must be non-negative, got {pairs}")
    return pairs


_PAD_MODES = ("CONSTANT", "REFLECT", "SYMMETRIC")


def _pad_mode(mode):
    m = str(mode).upper()
    if m not in _PAD_MODES:
        raise ValueError(f"pad: mode must be one of {_PAD_MODES} (any case), got {mode!r}")
    return m


def _mirror_index(n, before, after, mode, device):
    """Indices along a dimension of size n that REFLECT (edge not repeated) or SYMMETRIC (edge repeated) pads."""
    edge = 0 if mode == "SYMMETRIC" else 1
    if max(before, after) > n - edge:
        raise ValueError(f"pad: {mode} padding of ({before}, {after}) on a dimension of size {n}: each side must "
                         f"be at most {n - edge} (the size{' - 1' if edge else ''}), as TF")
    return torch.cat([torch.arange(before - 1 + edge, edge - 1, -1, device=device),
                      torch.arange(n, device=device),
                      torch.arange(n - 1 - edge, n - 1 - edge - after, -1, device=device)])


def _pad_samples(rng):
    x = S.randn(rng, 3, 4)
    return [((x,), {"paddings": [[1, 2], [0, 3]]}),
            ((x,), {"paddings": [[2, 1], [3, 0]], "mode": "REFLECT"}),
            ((x,), {"paddings": [[3, 3], [1, 4]], "mode": "symmetric"}),
            ((S.randn(rng, 2, 3, 2),), {"paddings": [[0, 0], [1, 1], [1, 0]], "constant_values": 2.5})]


@defop(samples=_pad_samples, saves="none", complex_grad=True)
def pad(tensor, paddings, mode="CONSTANT", constant_values=0):
    """Pads `tensor` with `paddings[d] = [before, after]` entries on each side of dimension d.

    Args:
      tensor: any shape [n_0, ..., n_{r-1}] and dtype.
      paddings: [r, 2] non-negative ints (a list of pairs, or an integer tensor).
      mode: "CONSTANT" (`constant_values`), "REFLECT" (mirror without the edge:
        at most n_d - 1 per side) or "SYMMETRIC" (mirror with the edge: at
        most n_d); any case.
      constant_values: a scalar of tensor's dtype (no gradient, as TF).

    Returns:
      [n_0 + before_0 + after_0, ...], tensor's dtype and device; the gradient
      sums the padded copies back onto their sources.

    Raises:
      ValueError: paddings of the wrong shape or negative; a mirror padding wider than allowed; an unknown mode.

    Source: tf.pad.

    Example:
      >>> dtape.pad(dtape.constant([1, 2, 3]), [[2, 1]], mode="REFLECT").numpy()
      array([3, 2, 1, 2, 3, 2])
    """
    pads, mode = _paddings(paddings, tensor.ndim), _pad_mode(mode)
    if mode == "CONSTANT":
        flat = [p for pair in reversed(pads) for p in pair]  # torch lists the last dimension first
        value = scalar_value(constant_values, "pad", "constant_values")
        return torch.nn.functional.pad(tensor, flat, value=value) if flat else tensor.clone()
    out = tensor
    for axis, (before, after) in enumerate(pads):
        if before or after:
            out = torch.index_select(out, axis, _mirror_index(out.shape[axis], before, after, mode, out.device))
    return out if out is not tensor else tensor.clone()


@pad.grad
def _(dy, ans, tensor, paddings, mode="CONSTANT", constant_values=0):
    pads, mode = _paddings(paddings, tensor.ndim), _pad_mode(mode)
    if mode == "CONSTANT":
        return dy[tuple(slice(before, before + n) for (before, _), n in zip(pads, tensor.shape))]
    g = dy
    for axis in reversed(_brange(tensor.ndim)):
        before, after = pads[axis]
        if before or after:
            n = tensor.shape[axis]
            zeros = torch.zeros(tuple(g.shape[:axis]) + (n,) + tuple(g.shape[axis + 1:]), dtype=g.dtype,
                                device=g.device)
            g = torch.index_add(zeros, axis, _mirror_index(n, before, after, mode, g.device), g)
    return g


def _linspace_samples(rng):
    return [((S.randn(rng), S.randn(rng)), {"num": 5}),
            ((S.randn(rng, 3), S.randn(rng, 2, 1)), {"num": 4, "axis": -1}),
            ((S.randn(rng, 2), S.randn(rng, 2)), {"num": 3, "axis": 1}),
            ((S.randn(rng), S.randn(rng)), {"num": 1}), ((S.randn(rng), S.randn(rng)), {"num": 2})]


@defop(n_in=2, samples=_linspace_samples, saves="none")
def linspace(start, stop, num, axis=0):
    """`num` evenly spaced values from `start` to `stop`, both included, along a new `axis`.

    Args:
      start, stop: floating scalars or broadcastable tensors (integers give float64, as TF's division).
      num: the number of values (int or 0-d integer tensor, >= 0); 1 gives `start`.
      axis: where the new dimension goes in the result (negative counts from its end).

    Returns:
      broadcast_shape(start, stop) with `num` inserted at `axis`; element i is
      `start + i * (stop - start) / (num - 1)`, the last exactly `stop`.
      Differentiable in start and stop.

    Source: tf.linspace.

    Example:
      >>> dtape.linspace(0.0, 1.0, 5).numpy()
      array([0.  , 0.25, 0.5 , 0.75, 1.  ], dtype=float32)
    """
    n, start, stop, ax = _linspace_args(start, stop, num, axis)
    first, last = torch.unsqueeze(start, ax), torch.unsqueeze(stop, ax)
    steps = builtins.max(n - 1, 1)
    k = torch.reshape(torch.arange(1, steps, dtype=start.dtype, device=start.device), _along(ax, start.ndim + 1))
    out = torch.cat([first, first + (last - first) / steps * k, last], dim=ax)
    return torch.narrow(out, ax, 0, n)


def _linspace_args(start, stop, num, axis):
    n = size_value(num, "linspace", "num")
    if n < 0:
        raise ValueError(f"linspace: num must be >= 0, got {n}")
    stop = stop if isinstance(stop, torch.Tensor) else torch.as_tensor(stop, dtype=start.dtype, device=start.device)
    dtype = start.dtype if start.dtype.is_floating_point or start.dtype.is_complex else torch.float64
    start, stop = torch.broadcast_tensors(start.to(dtype), stop.to(dtype))
    return n, start, stop, canonical_axis(axis, start.ndim, "linspace", inserts=True)


def _along(ax, ndim):
    return [-1 if i == ax else 1 for i in _brange(ndim)]


@linspace.grad
def _(dy, ans, start, stop, num, axis=0):
    n = size_value(num, "linspace", "num")
    ax = canonical_axis(axis, dy.ndim - 1, "linspace", inserts=True)
    w = torch.reshape(torch.arange(n, dtype=dy.dtype, device=dy.device) / builtins.max(n - 1, 1), _along(ax, dy.ndim))
    return torch.sum(dy * (1 - w), dim=ax), torch.sum(dy * w, dim=ax)


def _band_mask(shape, num_lower, num_upper, device):
    """[m, n] bool: row i, column j is kept when (num_lower < 0 or i - j <= num_lower) and
    (num_upper < 0 or j - i <= num_upper)."""
    lower, upper = size_value(num_lower, "band_part", "num_lower"), size_value(num_upper, "band_part", "num_upper")
    i = torch.arange(shape[-2], device=device)[:, None]
    j = torch.arange(shape[-1], device=device)[None, :]
    return torch.logical_and(torch.logical_or(torch.tensor(lower < 0, device=device), i - j <= lower),
                             torch.logical_or(torch.tensor(upper < 0, device=device), j - i <= upper))


def _band_part_samples(rng):
    return [((S.randn(rng, 3, 4),), {"num_lower": -1, "num_upper": 0}),
            ((S.randn(rng, 2, 4, 3),), {"num_lower": 1, "num_upper": -1}),
            ((S.randn(rng, 4, 4),), {"num_lower": 0, "num_upper": 0})]


@defop(samples=_band_part_samples, saves="none", complex_grad=True)
def band_part(input, num_lower, num_upper):  # noqa: A002 - TF's argument name
    """Keeps a band around the diagonal of each innermost matrix, zeroes the rest.

    Args:
      input: [..., m, n], any dtype.
      num_lower, num_upper: how many subdiagonals / superdiagonals to keep
        (ints or 0-d integer tensors; negative: all of them).
        `band_part(ones([n, n]), -1, 0)` is the lower triangle (a causal mask).

    Returns:
      input's shape, dtype and device. The gradient is band_part of dy.

    Raises:
      ValueError: input of rank below 2.

    Source: tf.linalg.band_part (exported as dtape.linalg.band_part).
    """
    if input.ndim < 2:
        raise ValueError(f"band_part: input must be at least 2-D ([..., m, n]), got shape {tuple(input.shape)}")
    keep = _band_mask(input.shape, num_lower, num_upper, input.device)
    return torch.where(keep, input, torch.zeros((), dtype=input.dtype, device=input.device))


@band_part.grad
def _(dy, ans, input, num_lower, num_upper):  # noqa: A002
    return band_part.any(dy, num_lower, num_upper)


__all__ += ["newaxis", "shape", "size", "rank", "eye", "pad", "linspace"]
