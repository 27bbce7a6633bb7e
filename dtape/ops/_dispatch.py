"""torch interop: `__torch_function__`, the autograd fallback, and operators.

A torch function called on dtape tensors runs the registered op for it
(TORCH_TABLE) or, with no registered gradient, the fallback: the function on
the raw tensors, recorded with a backward that asks `torch.autograd` for its
vector-Jacobian product. That backward is itself run through the fallback
when a tape records it, so fallback derivatives compose to any order.
"""
import torch
from torch.utils import _pytree as pytree

from dtape import tape as _tp
from dtape.ops._registry import TORCH_TABLE, Tensor
from dtape.tensor import is_variable


def _is_diff(t):
    return t.dtype.is_floating_point or t.dtype.is_complex


class TorchFallback:
    """Record op for a torch function without a registered gradient."""

    __slots__ = ("name", "func", "spec", "leaves", "positions")

    def __init__(self, func, spec, leaves, positions):
        self.name = getattr(func, "__name__", repr(func))
        self.func = func
        self.spec = spec
        self.leaves = leaves          # flat args/kwargs with tensors replaced by None
        self.positions = positions    # where the tensor inputs go in `leaves`

    def call_raw(self, tensors):
        leaves = list(self.leaves)
        for pos, t in zip(self.positions, tensors):
            leaves[pos] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.func(*args, **kwargs)

    def vjp_torch(self, n_in, diff_out):
        """A torch-level function (*inputs, *dys) -> grads of the float inputs."""
        def vjp(*xs_and_dys):
            xs, dys = xs_and_dys[:n_in], xs_and_dys[n_in:]
            create = any(t.requires_grad for t in xs_and_dys)
            with torch.enable_grad():
                xs = [x if x.requires_grad or not _is_diff(x) else x.detach().requires_grad_() for x in xs]
                outs = pytree.tree_leaves(self.call_raw(xs))
                outs = [o for o, d in zip(outs, diff_out) if d]
                wrt = [x for x in xs if _is_diff(x)]
                grads = torch.autograd.grad(outs, wrt, dys, allow_unused=True, create_graph=create)
            return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(wrt, grads))
        vjp.__name__ = f"vjp_{self.name}"
        return vjp

    def backward(self, dys, outputs, inputs, attrs, raw):
        diff_out = [_is_diff(o._t) for o in outputs]
        dys = [d for d, ok in zip(dys, diff_out) if ok]
        if not dys:
            return (None,) * len(inputs)
        vjp = self.vjp_torch(len(inputs), diff_out)
        if raw:
            grads = vjp(*[x._t for x in inputs], *dys)
        else:
            grads = call_fallback(vjp, tuple(inputs) + tuple(dys), {})
        grads = iter(grads)
        return tuple(next(grads) if _is_diff(x._t) else None for x in inputs)


def _unwrap_leaves(flat):
    leaves, tensors, positions = [], [], []
    for i, leaf in enumerate(flat):
        if type(leaf) is not Tensor and is_variable(leaf):
            leaf = leaf._dtape_read()
        if type(leaf) is Tensor:
            tensors.append(leaf)
            positions.append(i)
            leaves.append(None)
        else:
            leaves.append(leaf)
    return leaves, tensors, positions


def call_fallback(func, args, kwargs):
    """Runs torch `func` on dtape tensors; records it with an autograd-derived backward."""
    name = getattr(func, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):
        raise TypeError(f"torch.{name} modifies its input in place; dtape.Tensor is immutable. "
                        f"Use the out-of-place torch.{name[:-1]} instead")
    flat, spec = pytree.tree_flatten((args, kwargs))
    leaves, tensors, positions = _unwrap_leaves(flat)
    op = TorchFallback(func, spec, tuple(leaves), tuple(positions))
    out = op.call_raw([t._t for t in tensors])
    out_leaves, out_spec = pytree.tree_flatten(out)
    wrapped = [Tensor(o) if isinstance(o, torch.Tensor) else o for o in out_leaves]
    outputs = tuple(w for w in wrapped if type(w) is Tensor)
    if _tp._tape_set and outputs and any(_is_diff(o._t) for o in outputs):
        _tp.record(op, tuple([t._id for t in tensors]), tuple(tensors), outputs, None)
    return pytree.tree_unflatten(wrapped, out_spec)


def _torch_function(cls, func, types, args=(), kwargs=None):
    handler = TORCH_TABLE.get(func)
    if handler is not None:
        return handler(*args, **(kwargs or {}))
    return call_fallback(func, args, kwargs or {})


# Tensor's value protocol (defined in dtape/tensor.py) that variables forward after a read.
_VALUE_DUNDERS = ("__float__", "__int__", "__index__", "__bool__", "__len__", "__iter__")


def install_operators(ops):
    """Installs Python operators and `__torch_function__` on Tensor (the one operator table)."""
    Tensor.__torch_function__ = classmethod(_torch_function)
    table = {}
    binary = {"add": ops.add, "sub": ops.subtract, "mul": ops.multiply, "truediv": ops.divide,
              "floordiv": ops.floordiv, "mod": ops.floormod, "pow": ops.pow, "matmul": ops.matmul}
    for name, fn in binary.items():
        table[f"__{name}__"] = _method(fn)
        table[f"__r{name}__"] = _rmethod(fn)
    for name, fn in {"lt": ops.less, "le": ops.less_equal, "gt": ops.greater,
                     "ge": ops.greater_equal, "eq": ops.equal, "ne": ops.not_equal}.items():
        table[f"__{name}__"] = _method(fn)
    table["__neg__"] = lambda self: ops.negative(self)
    table["__pos__"] = lambda self: self
    table["__abs__"] = lambda self: ops.abs(self)
    table["__invert__"] = lambda self: ops.logical_not(self)
    table["__getitem__"] = lambda self, key: ops.getitem(self, key)
    for name, fn in table.items():
        setattr(Tensor, name, fn)
    Tensor._operator_names = tuple(table) + _VALUE_DUNDERS


def install_variable_operators(cls):
    """Gives a variable class (one with `_dtape_read()`) every Tensor operator and torch interop.

    Each operator reads the variable (a recorded read that notifies the
    tapes) and applies Tensor's own operator, so Tensor and variables share
    one table. `cls._dtape_variable` marks the class for `tensor.is_variable`.
    """
    for name in Tensor._operator_names:
        setattr(cls, name, _delegate(name))
    cls.__torch_function__ = classmethod(_torch_function)
    cls._dtape_variable = True


def _delegate(name):
    tensor_method = getattr(Tensor, name)

    def method(self, *args):
        return tensor_method(self._dtape_read(), *args)
    method.__name__ = name
    return method


def _method(fn):
    def method(self, other):
        return fn(self, other)
    return method


def _rmethod(fn):
    def method(self, other):
        return fn(other, self)
    return method


__all__ = []
