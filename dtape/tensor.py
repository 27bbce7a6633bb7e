"""dtape.Tensor: an immutable eager tensor over one torch.Tensor.

Layer 1: knows nothing of tapes or ops. Operators, `__torch_function__` and
reads of variables are filled in from above (`ops/_dispatch.py`,
`variables.py`) through the slots at the bottom of this file, as JAX installs
array methods from its numpy layer.
"""
import itertools
import threading

import numpy as np
import torch

from dtape import _config
from dtape._local import ThreadLocalScope

# Process-wide source of tensor ids. `next()` on itertools.count is atomic
# under the GIL; on free-threaded builds ids stay unique because count's
# __next__ holds the object's critical section.
_next_id = itertools.count(1).__next__

DEFAULT_FLOAT_DTYPE = getattr(torch, _config.DEFAULT_FLOAT_DTYPE)


class Tensor:
    """An immutable eager tensor wrapping one `torch.Tensor` (any shape, dtype, device).

    Every instance has a unique integer `_id` that tapes watch. `.torch()`
    returns the wrapped tensor without a copy; it never requires grad.
    Operators (`+ - * / // % ** @`, unary `-`, `abs`, indexing) are
    differentiable and recorded on active tapes.

    Source: tf.Tensor (EagerTensor) with torch dtypes and devices.

    Example:
      >>> x = dtape.constant([[1.0, 2.0]])
      >>> (x * 2).numpy()
      array([[2., 4.]], dtype=float32)
    """

    __slots__ = ("_t", "_id", "__weakref__")

    def __init__(self, value):
        self._t = value
        self._id = _next_id()

    # -- attributes ---------------------------------------------------------
    @property
    def shape(self):
        return self._t.shape

    @property
    def dtype(self):
        return self._t.dtype

    @property
    def device(self):
        return self._t.device

    @property
    def ndim(self):
        return self._t.dim()

    def torch(self):
        """The wrapped `torch.Tensor` (no copy; never requires grad)."""
        return self._t

    def numpy(self):
        """A numpy copy of the value (moved to the CPU first)."""
        return self._t.detach().cpu().numpy()

    def __array__(self, dtype=None, copy=None):
        arr = self.numpy()
        return arr if dtype is None else arr.astype(dtype)

    def __float__(self):
        return float(self._t)

    def __int__(self):
        return int(self._t)

    def __index__(self):
        return self._t.__index__()

    def __bool__(self):
        return bool(self._t)

    def __len__(self):
        if self._t.dim() == 0:
            raise TypeError("len() of a 0-d dtape.Tensor; it has no length")
        return self._t.shape[0]

    def __iter__(self):
        if self._t.dim() == 0:
            raise TypeError("iteration over a 0-d dtape.Tensor")
        return (self[i] for i in range(self._t.shape[0]))

    def __repr__(self):
        body = repr(self._t.numpy() if self._t.device.type == "cpu" else self._t.cpu().numpy())
        return f"<dtape.Tensor: shape={tuple(self._t.shape)}, dtype={self._t.dtype}, device={self._t.device}, numpy={body}>"

    __hash__ = object.__hash__  # identity hash, as tf.Tensor in eager sets/dicts


def is_variable(obj):
    """True for dtape variables (`Variable` and distributed variables), whose reads are recorded.

    The one test of "is this a variable" in dtape: classes get the mark from
    `variables.install_tensor_protocol`.
    """
    return getattr(type(obj), "_dtape_variable", False)


def _infer_dtype(value):
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    if isinstance(value, float):
        return DEFAULT_FLOAT_DTYPE
    return None


def _to_torch(value, dtype=None, device=None):
    """A torch.Tensor from a scalar, nested list, numpy array or torch.Tensor."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
    elif isinstance(value, np.ndarray) or np.isscalar(value) and not isinstance(value, (int, float, bool)):
        t = torch.from_numpy(np.array(value, copy=True))
    else:
        try:
            t = torch.tensor(value, dtype=dtype or _infer_dtype(value))
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"cannot convert {type(value).__name__} {value!r:.80} to a dtape.Tensor: {e}") from None
        if dtype is None and t.is_floating_point() and t.dtype != DEFAULT_FLOAT_DTYPE:
            t = t.to(DEFAULT_FLOAT_DTYPE)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device is None and not isinstance(value, torch.Tensor):
        device = _device_state.device  # new tensors follow the thread's dtape.device scope
    if device is not None:
        t = t.to(normalize_device(device))
    return t


class _DeviceState(threading.local):
    """Per-thread default device for new tensors (None: torch's own default, the CPU)."""

    device = None


_device_state = _DeviceState()


def current_device():
    """The device of the innermost `dtape.device` scope on this thread, or None outside any."""
    return _device_state.device


class device(ThreadLocalScope):
    """Thread-local scope: tensor factories and conversions place new tensors on `name`.

    Read by `constant`, `convert_to_tensor` (for values that are not already
    tensors), `zeros`, `ones`, `fill`, `range` and `dtape.random`. Each
    replica thread of a strategy runs inside its own device. Scopes nest;
    other threads are not affected.

    Args:
      name: a device name ("cpu", "cpu:1", "cuda:0", "gpu:1") or torch.device;
        "cpu:N" (a CPU replica) places tensors on the CPU.

    Raises:
      RuntimeError: (from torch) when a tensor is then made on a device that does not exist.

    Source: tf.device (eager placement).

    Example:
      >>> with dtape.device("cpu"):
      ...     x = dtape.constant([1.0])
      >>> x.device
      device(type='cpu')
    """

    __slots__ = ()
    _state = _device_state
    _attr = "device"

    def __init__(self, name):
        super().__init__(None if name is None else normalize_device(name))


def default_device(device=None):
    """`device` as a torch.device if given, else the scope's device, else the CPU."""
    if device is not None:
        return normalize_device(device)
    return _device_state.device or _CPU


_CPU = torch.device("cpu")


def normalize_device(device):
    """torch.device for a device name; 'cpu:N' (a replica on the CPU) maps to 'cpu'."""
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cpu" else device
    name = str(device).lower()
    if name.startswith("cpu"):
        return torch.device("cpu")
    if name.startswith("gpu"):
        name = "cuda" + name[3:]
    return torch.device(name)


def constant(value, dtype=None, shape=None, device=None):
    """Creates a dtape.Tensor holding a copy of `value`.

    Args:
      value: Python scalar, nested list, numpy array or torch.Tensor.
      dtype: torch.dtype; default float32 for Python floats, int64 for ints,
        the source dtype for numpy and torch values.
      shape: optional shape; a scalar value is broadcast to it.
      device: torch device or name ('cpu', 'cuda:0'); default: a torch.Tensor's
        own device, else the current `dtape.device` scope's, else the CPU.

    Returns:
      A Tensor that shares no memory with `value`.

    Raises:
      TypeError: if `value` cannot be converted.

    Source: tf.constant.
    """
    if isinstance(value, Tensor):
        value = value._t
    t = _to_torch(value, dtype, device)
    if isinstance(value, torch.Tensor) and t.data_ptr() == value.data_ptr():
        t = t.clone()
    if shape is not None:
        t = torch.broadcast_to(t, tuple(shape)).clone() if t.numel() == 1 else t.reshape(tuple(shape))
    return Tensor(t)


def convert_to_tensor(value, dtype=None, device=None):
    """Returns `value` as a dtape.Tensor (no copy when it already is one or is a torch.Tensor).

    Accepts Tensor, Variable (read: recorded, notifies tapes), torch.Tensor,
    numpy array, Python scalar or nested list.

    Raises:
      TypeError: for values that are not tensor-like.
      ValueError: if `value` is a Tensor of another dtype than `dtype`.

    Source: tf.convert_to_tensor.
    """
    if type(value) is Tensor:
        if dtype is not None and value.dtype != dtype:
            raise ValueError(f"convert_to_tensor: tensor has dtype {value.dtype}, requested {dtype}; use dtape.cast")
        return value
    if is_variable(value):
        return convert_to_tensor(value._dtape_read(), dtype)
    return Tensor(_to_torch(value, dtype, device))


def is_differentiable_dtype(dtype):
    """True for floating and complex dtypes (the ones that get gradients)."""
    return dtype.is_floating_point or dtype.is_complex
