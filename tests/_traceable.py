"""Checks that code traces into a torch graph: no host reads, variables as graph inputs.

`NoHostReads()` raises on anything that brings a tensor's value to Python
(`.item()`, `float(t)`, `int(t)`, `bool(t)`, `.numpy()`, `.tolist()`):
those calls fail under `make_fx(tracing_mode="fake")` and under
`torch.compile` break the graph. `trace_with_variables(fn, variables, *args)`
is the real thing: `make_fx` with fake tensors of `fn(*args)`, every
variable's value a graph input and its value after `fn` an output.
"""
import threading

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_HOST_OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}
_HOST_METHODS = {torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__float__,
                 torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__index__, torch.Tensor.__array__}


class HostRead(RuntimeError):
    pass


class _NoHostDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _HOST_OPS:
            raise HostRead(f"host read of a tensor value ({func}) while tracing")
        return func(*args, **(kwargs or {}))


class _NoHostFunction(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _HOST_METHODS:
            raise HostRead(f"host read of a tensor value (Tensor.{func.__name__}) while tracing")
        return func(*args, **(kwargs or {}))


class NoHostReads:
    """Context manager: HostRead on any host read of a tensor value inside (see the module docstring)."""

    def __enter__(self):
        self._modes = [_NoHostFunction(), _NoHostDispatch()]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)
        return False


# make_fx is not thread-safe (torch.fx's symbolic tracer keeps one global patcher: two threads tracing at
# once fail with "CURRENT_PATCHER is None"), so replica threads trace one at a time.
_TRACE_LOCK = threading.Lock()


def components(variables):
    """The plain variables behind `variables` (a distributed variable's components)."""
    out = []
    for v in variables:
        out.extend(getattr(v, "values", None) or (v,))
    return out


def trace_with_variables(fn, variables, *args):
    """`make_fx(tracing_mode="fake")` of `fn(*args)` with the variables' values as the first inputs.

    Returns the GraphModule: `gm(*values, *args)` -> the variables' values after `fn` (a list).
    """
    variables = components(variables)

    def step(*inputs):
        saved = [v._t for v in variables]
        for v, t in zip(variables, inputs):
            v._t = t
        try:
            fn(*inputs[len(variables):])
            return [v._t for v in variables]
        finally:
            for v, t in zip(variables, saved):
                v._t = t

    with _TRACE_LOCK:
        return make_fx(step, tracing_mode="fake")(*[v._t for v in variables], *args)
