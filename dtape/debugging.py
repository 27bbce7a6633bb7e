"""dtape.debugging: NaN/Inf checks on every op output and every gradient (tf.debugging names).

`enable_check_numerics()` swaps checking versions into the op call path
(each registered op's forward, torch functions run through the autograd
fallback) and into every record op's `backward` (the gradient walk); the
first floating output or gradient holding a NaN or an Inf raises
`InvalidArgumentError` naming the op. `disable_check_numerics()` swaps the
originals back. Nothing is checked, and nothing costs anything, while it is
off (the default): no flag is read on the hot path.

The switch is process-wide, as in TF: it affects every thread, replica
threads included. Each check reads the tensor back (a device sync on CUDA).

Source: tf.debugging.enable_check_numerics / disable_check_numerics,
tf.errors.InvalidArgumentError.
"""
import threading

import torch

from dtape import tape as _tp
from dtape.custom_gradient import CustomGradientOp
from dtape.ops._dispatch import TorchFallback
from dtape.ops._registry import REGISTRY, OpDef

__all__ = [
    "InvalidArgumentError",
    "disable_check_numerics",
    "enable_check_numerics",
    "is_check_numerics_enabled",
]


class InvalidArgumentError(ValueError):
    """An op produced (or a gradient rule returned) a NaN or Inf while check numerics is enabled.

    `op_name` names the op, `kind` is "output" or "gradient", `index` the
    output (or input, for a gradient) position. Source: tf.errors.InvalidArgumentError.
    """

    def __init__(self, message, op_name, kind, index):
        super().__init__(message)
        self.op_name = op_name
        self.kind = kind
        self.index = index


_lock = threading.Lock()  # serialises enable/disable (the swaps are process-wide)
_saved = None             # the originals while enabled: (cells, {class: backward}, call_raw)


def is_check_numerics_enabled():
    """True between `enable_check_numerics()` and `disable_check_numerics()`."""
    return _saved is not None


def enable_check_numerics():
    """Checks every op output and every gradient for NaN/Inf from now on (all threads).

    Raises (later, from the op or the gradient call):
      InvalidArgumentError: naming the op, the output or input position, the
        dtype and shape, and how many NaN and Inf elements it holds.

    Calling it again while enabled does nothing. Source: tf.debugging.enable_check_numerics.
    """
    global _saved
    with _lock:
        if _saved is not None:
            return
        cells = [(cell, cell.cell_contents) for cell in _forward_cells()]
        classes = _backward_classes()
        backwards = {cls: cls.__dict__["backward"] for cls in classes}
        call_raw = TorchFallback.call_raw
        for cell, fwd in cells:
            cell.cell_contents = _checked_forward(fwd, cell.op_name)
        for cls, bwd in backwards.items():
            cls.backward = _checked_backward(bwd)
        TorchFallback.call_raw = _checked_call_raw(call_raw)
        _saved = ([c for c, _ in cells], [f for _, f in cells], backwards, call_raw)


def disable_check_numerics():
    """Stops the checks started by `enable_check_numerics()` (does nothing if they are off).

    Source: tf.debugging.disable_check_numerics.
    """
    global _saved
    with _lock:
        if _saved is None:
            return
        cells, forwards, backwards, call_raw = _saved
        for cell, fwd in zip(cells, forwards):
            cell.cell_contents = fwd
        for cls, bwd in backwards.items():
            cls.backward = bwd
        TorchFallback.call_raw = call_raw
        _saved = None


class _Cell:
    """A closure cell of an op's call function holding its forward, with the op's name."""

    __slots__ = ("_cell", "op_name")

    def __init__(self, cell, op_name):
        self._cell = cell
        self.op_name = op_name

    @property
    def cell_contents(self):
        return self._cell.cell_contents

    @cell_contents.setter
    def cell_contents(self, value):
        self._cell.cell_contents = value


def _forward_cells():
    """The cell holding each registered op's forward in its call function (what the op calls)."""
    cells = []
    for opdef in REGISTRY:
        code = opdef.fn.__code__
        if "fwd" not in code.co_freevars:
            raise RuntimeError(f"enable_check_numerics: op {opdef.name!r}'s call function has no 'fwd' cell; "
                               "dtape.ops._registry changed how ops call their forward: update dtape.debugging")
        cells.append(_Cell(opdef.fn.__closure__[code.co_freevars.index("fwd")], opdef.name))
    return cells


def _backward_classes():
    """Record op classes whose `backward` gives input gradients to the walk."""
    return (OpDef, TorchFallback, _tp.CallableBackward, CustomGradientOp)


def _check(t, op_name, kind, index):
    if not isinstance(t, torch.Tensor):
        t = getattr(t, "_t", None)
        if not isinstance(t, torch.Tensor):
            return
    if not (t.is_floating_point() or t.is_complex()) or bool(torch.isfinite(t).all()):
        return
    n_nan = int(torch.isnan(t).sum())
    n_inf = int(torch.isinf(t).sum())
    what = "NaN and Inf" if n_nan and n_inf else ("NaN" if n_nan else "Inf")
    place = f"output {index}" if kind == "output" else f"gradient for input {index}"
    raise InvalidArgumentError(
        f"Tensor had {what} values: {place} of op {op_name!r} (dtype {t.dtype}, shape {tuple(t.shape)}, "
        f"device {t.device}) has {n_nan} NaN and {n_inf} Inf elements; check the op's inputs (or, for a "
        f"gradient, the upstream gradient and the rule) [Op:{op_name}]", op_name, kind, index)


def _check_all(out, op_name, kind):
    if isinstance(out, (tuple, list)):
        for i, o in enumerate(out):
            if o is not None:
                _check(o, op_name, kind, i)
    elif out is not None:
        _check(out, op_name, kind, 0)


def _checked_forward(fwd, op_name):
    def forward(*args, **kwargs):
        out = fwd(*args, **kwargs)
        _check_all(out, op_name, "output")
        return out
    forward.__wrapped__ = fwd
    return forward


def _checked_backward(bwd):
    def backward(self, *args, **kwargs):
        grads = bwd(self, *args, **kwargs)
        _check_all(grads, f"{self.name}", "gradient")
        return grads
    backward.__wrapped__ = bwd
    return backward


def _checked_call_raw(call_raw):
    def checked(self, tensors):
        out = call_raw(self, tensors)
        for i, t in enumerate(t for t in _flat(out) if isinstance(t, torch.Tensor)):
            _check(t, self.name, "output", i)
        return out
    checked.__wrapped__ = call_raw
    return checked


def _flat(out):
    if isinstance(out, (tuple, list)):
        return [x for o in out for x in _flat(o)]
    return [out]
