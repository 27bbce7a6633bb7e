"""torch interop: `__torch_function__`, the autograd fallback, and operators.

A torch function called on dtape tensors runs the registered op for it
(TORCH_TABLE) or, with no registered gradient, the fallback: the function on
the raw tensors, recorded with a backward that asks `torch.autograd` for its
vector-Jacobian product. That backward is itself run through the fallback
when a tape records it, so fallback derivatives compose to any order.
A random function (dropout, attention with dropout) runs on a private seeded
stream that the backward's re-run replays, so both see the same masks.
"""
import threading

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from dtape import random as _random
from dtape import tape as _tp
from dtape.ops._registry import TORCH_TABLE, Tensor
from dtape.tensor import is_variable


def _is_diff(t):
    return t.dtype.is_floating_point or t.dtype.is_complex


class TorchFallback(_tp.RecordOp):
    """Record op for a torch function without a registered gradient."""

    __slots__ = ("name", "func", "spec", "leaves", "positions", "seed")

    def __init__(self, func, spec, leaves, positions, seed=None):
        self.name = getattr(func, "__name__", repr(func))
        self.func = func
        self.spec = spec
        self.leaves = leaves          # flat args/kwargs with tensors replaced by None
        self.positions = positions    # where the tensor inputs go in `leaves`
        self.seed = seed              # random functions: (seed, devices) of their private stream

    def call_raw(self, tensors):
        leaves = list(self.leaves)
        for pos, t in zip(self.positions, tensors):
            leaves[pos] = t
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        if self.seed is None:
            return self.func(*args, **kwargs)
        with _seeded(*self.seed):
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
                # an output that does not depend on any input contributes nothing (at third order the
                # gradient of a linear function, e.g. cumsum's, is such an output: zeros with no graph)
                pairs = [(o, dy) for o, dy in zip(outs, dys) if o.requires_grad]
                wrt = [x for x in xs if _is_diff(x)]
                grads = torch.autograd.grad([o for o, _ in pairs], wrt, [dy for _, dy in pairs], allow_unused=True,
                                            create_graph=create) if pairs else (None,) * len(wrt)
            return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(wrt, grads))
        vjp.__name__ = f"vjp_{self.name}"
        return vjp

    def backward(self, dys, outputs, inputs, attrs, raw, needs):
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


# Torch functions that draw from torch's global generators. The fallback's
# backward re-runs the function, so each call runs on a private stream seeded
# from the calling replica's generator (dtape.random) and replayed by the
# re-run: the gradient uses the forward's dropout masks, and replicas draw
# reproducibly whatever the thread schedule.
_RANDOM_FNS = frozenset([
    F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
    F.rrelu, F.gumbel_softmax, F.multi_head_attention_forward, F.scaled_dot_product_attention,
    torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout, torch.rrelu,
    torch.bernoulli, torch.Tensor.bernoulli, torch.rand_like, torch.randn_like, torch.randint_like,
    torch.normal, torch.poisson, torch.multinomial, torch.Tensor.multinomial])
# Held while a seeded stream is installed in torch's (process-global) generators.
_rng_lock = threading.RLock()


def _new_seed(tensors):
    """(seed, cuda device indices) for a random function's private stream."""
    device = next((t._t.device for t in tensors), None)
    gen = _random.get_generator(device)
    seed = int(torch.randint(0, 2**62, (), generator=gen, device=gen.device))
    cuda = sorted({t._t.device.index or 0 for t in tensors if t._t.device.type == "cuda"})
    return seed, tuple(cuda)


class _seeded:
    """Runs a block with torch's CPU (and listed CUDA) generators seeded by `seed`; restores them after."""

    def __init__(self, seed, cuda_devices):
        self.seed, self.cuda = seed, cuda_devices

    def __enter__(self):
        _rng_lock.acquire()
        self._fork = torch.random.fork_rng(devices=list(self.cuda))
        self._fork.__enter__()
        torch.default_generator.manual_seed(self.seed)
        for i in self.cuda:
            torch.cuda.default_generators[i].manual_seed(self.seed)

    def __exit__(self, *exc):
        try:
            return self._fork.__exit__(*exc)
        finally:
            _rng_lock.release()


def call_fallback(func, args, kwargs):
    """Runs torch `func` on dtape tensors; records it with an autograd-derived backward.

    `inplace=True` (torch.nn.functional, e.g. from `nn.Dropout(inplace=True)`)
    runs out of place: dtape tensors are immutable, and callers use the result.
    """
    name = getattr(func, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):
        raise TypeError(f"torch.{name} modifies its input in place; dtape.Tensor is immutable. "
                        f"Use the out-of-place torch.{name[:-1]} instead")
    if kwargs.get("inplace") is True:  # torch.nn.functional's `inplace=`: immutable inputs, return the result
        kwargs = dict(kwargs, inplace=False)
    flat, spec = pytree.tree_flatten((args, kwargs))
    leaves, tensors, positions = _unwrap_leaves(flat)
    seed = _new_seed(tensors) if func in _RANDOM_FNS else None
    op = TorchFallback(func, spec, tuple(leaves), tuple(positions), seed)
    out = op.call_raw([t._t for t in tensors])
    out_leaves, out_spec = pytree.tree_flatten(out)
    wrapped = [Tensor(o) if isinstance(o, torch.Tensor) else o for o in out_leaves]
    outputs = tuple(w for w in wrapped if type(w) is Tensor)
    if _tp.active_tapes and outputs and any(_is_diff(o._t) for o in outputs):
        _tp.record(op, tuple([t._id for t in tensors]), tuple(tensors), outputs, None)
    return pytree.tree_unflatten(wrapped, out_spec)


# torch functions whose result torch's autograd treats as a constant (no grad_fn): `.detach()`,
# `.data` and the `new_*` / `*_like` factories. They run on the values and are never recorded, so a
# gradient never flows through them (and the walk never asks torch for one).
_CONSTANT_FNS = frozenset([
    torch.Tensor.detach, torch.detach, torch.Tensor.data.__get__, torch.Tensor.new_zeros, torch.Tensor.new_ones,
    torch.Tensor.new_full, torch.Tensor.new_empty, torch.Tensor.new_empty_strided, torch.Tensor.new_tensor,
    torch.empty_like, torch.full_like])


def _call_constant(func, args, kwargs):
    """Runs `func` on the raw values of dtape tensors and variables; wraps its tensors, unrecorded."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    with _tp.stop_recording():  # a variable's value is read, not recorded: the result is a constant
        leaves, tensors, positions = _unwrap_leaves(flat)
    for pos, t in zip(positions, tensors):
        leaves[pos] = t._t
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    return pytree.tree_map_only(torch.Tensor, Tensor, func(*args, **kwargs))


def _torch_function(cls, func, types, args=(), kwargs=None):
    if kwargs and kwargs.get("out") is not None:
        _refuse_out(func)
    handler = TORCH_TABLE.get(func)
    if handler is not None:
        return handler(*args, **(kwargs or {}))
    if func in _CONSTANT_FNS:
        return _call_constant(func, args, kwargs or {})
    return call_fallback(func, args, kwargs or {})


def _refuse_out(func):
    """`out=` would write into a tensor that records may have saved: dtape tensors are immutable."""
    name = getattr(func, "__name__", repr(func))
    raise TypeError(f"torch.{name}(..., out=...) is not supported with dtape tensors: dtape tensors are "
                    f"immutable (a recorded op may have saved the one you would overwrite); use the "
                    f"returned value instead: y = torch.{name}(...)")


# Tensor's value protocol (defined in dtape/tensor.py) that variables forward after a read.
_VALUE_DUNDERS = ("__float__", "__int__", "__index__", "__bool__", "__len__", "__iter__")
# Tensor's protocol written on `self.torch()` (no recorded read): variables get the same functions.
_SHARED_DUNDERS = ("__format__", "__array_ufunc__", "__dlpack__", "__dlpack_device__")


def install_operators(ops):
    """Installs Python operators and `__torch_function__` on Tensor (the one operator table)."""
    Tensor.__torch_function__ = classmethod(_torch_function)
    table = {}
    binary = {"add": ops.add, "sub": ops.subtract, "mul": ops.multiply, "truediv": ops.divide,
              "floordiv": ops.floordiv, "mod": ops.floormod, "pow": ops.pow, "matmul": ops.matmul}
    for name, fn in binary.items():
        table[f"__{name}__"] = fn  # the op itself: `x * y` is `multiply(x, y)`, one Python call
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
    Tensor._operator_names = tuple(table) + _VALUE_DUNDERS + _SHARED_DUNDERS
    Tensor.__getattr__ = _torch_attribute


def install_variable_operators(cls):
    """Gives a variable class (one with `_dtape_read()`) every Tensor operator and torch interop.

    Each operator reads the variable (a recorded read that notifies the
    tapes) and applies Tensor's own operator, so Tensor and variables share
    one table; the `_SHARED_DUNDERS` (f-string format, numpy ufuncs, DLPack)
    are Tensor's own functions, which use only `.torch()` and so record no
    read. `cls._dtape_variable` marks the class for `tensor.is_variable`.
    """
    for name in Tensor._operator_names:
        setattr(cls, name, _delegate(name))
    cls.__torch_function__ = classmethod(_torch_function)
    cls.__getattr__ = _variable_attribute
    cls.grad = property(_no_grad_attribute, doc="Always raises AttributeError: see NO_GRAD_MESSAGE.")
    cls._dtape_variable = True


def _variable_attribute(self, name):
    """torch.Tensor's methods and properties on a variable (`v.view(2, 2)`, `v.sum()`, `v.item()`, `v.T`).

    Called only for names the variable class lacks: reads the variable (a
    recorded read, as every operator) and answers as `Tensor` does, so a
    variable has the torch methods a dtape.Tensor has. Private names and
    the names dtape duck-types on are never forwarded, so `hasattr` checks
    and half-built objects raise AttributeError at once.
    """
    if name.startswith("_") or name in _NOT_FORWARDED or getattr(torch.Tensor, name, None) is None:
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
    return _torch_attribute(self._dtape_read(), name)


def _delegate(name):
    tensor_method = getattr(Tensor, name)
    if name in _SHARED_DUNDERS:
        return tensor_method

    def method(self, *args):
        return tensor_method(self._dtape_read(), *args)
    method.__name__ = name
    return method


# Names dtape duck-types on (variables' `.values`, `.name`): never answered from torch.Tensor.
_NOT_FORWARDED = frozenset({"values", "name"})


# `.grad`: torch.nn.utils.clip_grad_norm_ (and code like it) reads `p.grad` of each tensor it is given and skips
# None; answering torch's None would make it clip nothing and return 0, silently.
NO_GRAD_MESSAGE = (
    "dtape tensors and variables have no .grad: a gradient is the value tape.gradient returns (so "
    "torch.nn.utils.clip_grad_norm_ on them would find no gradient and clip nothing). Clip the summed gradients "
    "with the optimizer's global_clipnorm= (dtape.optimizers.from_torch(torch_optimizer, global_clipnorm=max_norm) "
    "uses clip_grad_norm_'s formula), or clip the values: dtape.clip_by_global_norm(grads, max_norm)")


def _no_grad_attribute(self):
    raise AttributeError(NO_GRAD_MESSAGE)


def _torch_attribute(self, name):
    """torch.Tensor's methods and properties on a dtape.Tensor (`x.dim()`, `x.view(...)`, `x.T`).

    Called only for names Tensor lacks; the call runs through
    `__torch_function__`, so it is recorded like `torch.<name>(x)`. This is
    what lets torch.nn module code (`input.dim()`, `x.transpose(0, 1)`) run
    on dtape tensors. Private names and in-place methods are not forwarded
    (in-place methods raise TypeError when called: Tensor is immutable).
    """
    if name == "grad":
        _no_grad_attribute(self)
    attr = None if name.startswith("_") or name in _NOT_FORWARDED else getattr(torch.Tensor, name, None)
    if attr is None:
        raise AttributeError(f"'dtape.Tensor' object has no attribute {name!r}")
    if isinstance(attr, (property, type(torch.Tensor.T))):  # a property: read it now
        return _torch_function(Tensor, attr.__get__, (Tensor,), (self,))
    if not callable(attr):
        raise AttributeError(f"'dtape.Tensor' object has no attribute {name!r}")
    return lambda *args, **kwargs: _torch_function(Tensor, attr, (Tensor,), (self,) + args, kwargs)


def _method(fn):
    def method(self, other):
        return fn(self, other)
    return method


def _rmethod(fn):
    def method(self, other):
        return fn(other, self)
    return method


__all__ = []
