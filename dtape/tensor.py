"""dtape.Tensor: an immutable eager tensor over one torch.Tensor.

Layer 1: knows nothing of tapes or ops. Operators, `__torch_function__` and
reads of variables are filled in from above (`ops/_dispatch.py`,
`variables.py`) through the slots at the bottom of this file, as JAX installs
array methods from its numpy layer.
"""
import itertools
import operator
import threading

import numpy as np
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from dtape import _config
from dtape._local import ThreadLocalScope

# Process-wide source of tensor ids. `next()` on itertools.count is atomic
# under the GIL; on free-threaded builds ids stay unique because count's
# __next__ holds the object's critical section.
next_id = itertools.count(1).__next__

DEFAULT_FLOAT_DTYPE = getattr(torch, _config.DEFAULT_FLOAT_DTYPE)


class Tensor:
    """An immutable eager tensor wrapping one `torch.Tensor` (any shape, dtype, device).

    Every instance has a unique integer `_id` that tapes watch. `.torch()`
    returns the wrapped tensor without a copy; it never requires grad.
    Operators (`+ - * / // % ** @`, unary `-`, `abs`, indexing) are
    differentiable and recorded on active tapes, also with a numpy array on
    the left (`np_array * x` is a recorded Tensor). A 0-d tensor formats as
    a number (`f"{loss:.4f}"`); `x.numpy()` is a writable copy, `np.asarray(x)`
    a read-only view (zero-copy on the CPU); DLPack
    (`np.from_dlpack(x)`, `torch.from_dlpack(x)`) shares memory.

    Source: tf.Tensor (EagerTensor) with torch dtypes and devices.

    Example:
      >>> x = dtape.constant([[1.0, 2.0]])
      >>> (x * 2).numpy()
      array([[2., 4.]], dtype=float32)
    """

    __slots__ = ("_t", "_id", "__weakref__")

    def __init__(self, value):
        self._t = value
        self._id = next_id()

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
        """A numpy copy of the value (moved to the CPU first), writable; writing it leaves the tensor alone.
        A 0-d value gives a numpy scalar of its dtype (`np.float32`), as TF's EagerTensor.numpy().

        Raises:
          TypeError: for dtypes numpy lacks (bfloat16): cast first, e.g. `dtape.cast(x, dtape.float32)`.
        """
        return numpy_value(self._t)

    def __array__(self, dtype=None, copy=None):
        return numpy_array(self._t, dtype, copy)

    def __float__(self):
        return float(self._t)

    def __int__(self):
        return int(self._t)

    def __index__(self):
        return index_value(self._t)

    def __bool__(self):
        return bool(self._t)

    def __len__(self):
        if self._t.dim() == 0:
            # torch.tensor([a, b]) asks a list's items for len(): torch reads only numbers, numpy and torch tensors
            raise TypeError("len() of a 0-d dtape.Tensor; it has no length (torch.tensor([...]) cannot read dtape "
                            "tensors inside a list: use torch.stack([...]) or dtape.stack, or numbers: float(x))")
        return self._t.shape[0]

    def __iter__(self):
        if self._t.dim() == 0:
            # code that treats what is not a torch.Tensor as a sequence (torch.amp.GradScaler.scale,
            # word_language_model's repackage_hidden) recurses through a dtape tensor's items down to here
            raise TypeError("iteration over a 0-d dtape.Tensor: a dtape.Tensor is not a torch.Tensor, and code that "
                            "iterates whatever fails `isinstance(x, torch.Tensor)` recursed into it. Your own code "
                            "(a repackage_hidden that detaches a hidden-state nest): test "
                            "`isinstance(x, (torch.Tensor, dtape.Tensor))`, or use "
                            "dtape.nest.map_structure(dtape.stop_gradient, hidden). A torch API such as "
                            "torch.amp.GradScaler.scale: multiply by the scale instead, loss * scaler.get_scale(), "
                            "or use dtape.mixed_precision.LossScaleOptimizer")
        return (self[i] for i in range(self._t.shape[0]))

    def __repr__(self):
        return (f"<dtape.Tensor: shape={tuple(self._t.shape)}, dtype={self._t.dtype}, device={self._t.device}, "
                f"numpy={numpy_repr(self._t)}>")

    # -- number and array protocols -----------------------------------------
    # Written on `self.torch()` (not recorded), so variables install these same
    # functions unchanged (ops/_dispatch.py `_SHARED_DUNDERS`).
    def __format__(self, spec):
        """`f"{loss:.4f}"`: a 0-d tensor formats as its number (numpy's and torch's rule).

        Raises:
          TypeError: for a format spec on a tensor with more than one element.
        """
        t = self.torch()
        if t.dim() == 0:
            arr = _display_numpy(t)
            return format(arr[()], spec) if spec else str(arr)  # str: numpy's shortest digits ('0.1')
        if not spec:
            return str(self)
        raise TypeError(f"format spec {spec!r} needs a 0-d (scalar) dtape tensor, got shape {tuple(t.shape)}; "
                        f"format one element (f\"{{x[0]:{spec}}}\") or the numpy array (np.array2string)")

    # numpy ufuncs on dtape tensors (NEP 13). The operator ufuncs, which numpy
    # also runs for `np_array * x`, `np_array @ w`, `np_array < x`, run dtape's
    # operators: a recorded dtape.Tensor, so gradients flow to `x`. Any other
    # ufunc or ufunc method (np.exp, np.add.reduce, out=) runs numpy on the
    # values, as torch.Tensor and tf.Tensor do, and returns numpy (no gradient).
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        fn = _UFUNC_OPERATORS.get(ufunc)
        if fn is not None and method == "__call__" and not kwargs:
            return fn(*[x if type(x) in _PY_SCALARS or isinstance(x, Tensor) or is_variable(x)
                        else convert_to_tensor(x) for x in inputs])
        if any(isinstance(o, Tensor) or is_variable(o) for o in kwargs.get("out", ())):
            raise TypeError(f"numpy {ufunc.__name__}(out=...): a dtape tensor is immutable and a variable "
                            f"changes only through assign; use the result, or variable.assign(...)")
        inputs = [np.asarray(x) if isinstance(x, Tensor) or is_variable(x) else x for x in inputs]
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        """numpy functions (`np.mean(x, axis=0)`, `np.concatenate`) run on the values and return numpy,
        with no gradient, as on a tf.Tensor: the tensors are read-only numpy views, so a function that
        writes into one (`np.copyto`, `np.put`) raises numpy's read-only error."""
        return func(*_numpy_values(args), **_numpy_values(kwargs))

    def __dlpack__(self, **kwargs):
        """DLPack export (`np.from_dlpack(x)`, `torch.from_dlpack(x)`): shares memory, no copy.

        Keyword arguments (`stream`, `max_version`, `dl_device`, `copy`) are
        torch.Tensor.__dlpack__'s. The consumer must not write to the shared
        memory: dtape tensors are immutable.
        """
        return self.torch().__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.torch().__dlpack_device__()

    __hash__ = object.__hash__  # identity hash, as tf.Tensor in eager sets/dicts


def is_variable(obj):
    """True for dtape variables (`Variable` and distributed variables), whose reads are recorded.

    The one test of "is this a variable" in dtape: classes get the mark from
    `variables.install_tensor_protocol`.
    """
    return getattr(type(obj), "_dtape_variable", False)


_PY_SCALARS = (int, float, bool, complex)

# numpy ufunc -> the Python operator whose dtape implementation it runs.
_UFUNC_OPERATORS = {
    np.add: operator.add, np.subtract: operator.sub, np.multiply: operator.mul,
    np.true_divide: operator.truediv, np.floor_divide: operator.floordiv, np.remainder: operator.mod,
    np.power: operator.pow, np.matmul: operator.matmul, np.less: operator.lt, np.less_equal: operator.le,
    np.greater: operator.gt, np.greater_equal: operator.ge, np.equal: operator.eq, np.not_equal: operator.ne,
    np.negative: operator.neg, np.positive: operator.pos, np.absolute: operator.abs,
    np.bitwise_and: operator.and_, np.bitwise_or: operator.or_, np.bitwise_xor: operator.xor,
    np.invert: operator.invert,
}


def _numpy_values(obj):
    """`obj` with every dtape tensor and variable in it (in lists, tuples, dicts) as a read-only numpy array."""
    if isinstance(obj, Tensor) or is_variable(obj):
        return np.asarray(obj)
    if type(obj) in (list, tuple):  # numpy's argument nests (np.concatenate([x, y])); other sequences pass as given
        return type(obj)(_numpy_values(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _numpy_values(v) for k, v in obj.items()}
    return obj


def index_value(t):
    """`operator.index` of a dtape value held as torch tensor `t`: a 0-d integer tensor is its int (TF's rule:
    `range(n)`, `[...][n]`, sizes); torch would also take a one-element or bool tensor."""
    if t.dim() != 0 or t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
        raise TypeError(f"only 0-d integer tensors can be used as an index or size, got shape {tuple(t.shape)} "
                        f"and dtype {t.dtype}" + ("; cast it: dtape.cast(x, dtape.int64)" if t.dim() == 0 else ""))
    sizes = getattr(t, "_dtape_sizes", None)
    if type(sizes) is int:  # traced `dtape.shape(x)[i]` of a static dim (`range(n)`): the size it carries
        return sizes
    value = t.item()
    if type(value) is not int:  # a traced tensor's value is symbolic (a SymInt), which Python's index protocol refuses
        raise TypeError("a tensor computed inside a compiled function (dtape.function(jit_compile=True)) has no value "
                        "to use as an index or size while it is traced; use x.shape[i], whose arithmetic stays "
                        "symbolic (x[:, :x.shape[1] - 1]), or dtape.shape(x)[i] itself, without arithmetic")
    return value


def _host_numpy(t):
    """numpy array of torch tensor `t`: its own memory on the CPU, a copy from another device."""
    try:
        return t.detach().cpu().numpy()
    except TypeError:
        raise TypeError(f"numpy has no {t.dtype}: cast first, e.g. "
                        f"dtape.cast(x, dtape.float32).numpy()") from None


def numpy_copy(t):
    """`.numpy()` of a dtape value held as torch tensor `t`: a writable copy (tf EagerTensor.numpy()).

    The value is immutable (a Tensor) or changes only through assign (a
    variable); an array sharing its memory would let a write change it
    behind the tapes, which saved it for the gradient.
    """
    arr = _host_numpy(t)
    return arr.copy() if t.device.type == "cpu" else arr  # .cpu() already copied from another device


def numpy_value(t):
    """`.numpy()` of a dtape value held as torch tensor `t`, as TF's EagerTensor.numpy(): a writable array copy,
    or for a 0-d value a numpy scalar of its dtype (`np.float32(0.5)`), so `round(loss.numpy(), 4)`, `float(...)`,
    `f"{...:.3f}"` and `==` work as on TF's (a 0-d ndarray has no `__round__`)."""
    arr = numpy_copy(t)
    return arr[()] if arr.ndim == 0 else arr


def numpy_array(t, dtype=None, copy=None):
    """`__array__` of a dtape value held as torch tensor `t` (the numpy 2 protocol).

    copy=True gives a writable copy; otherwise a read-only array (zero-copy
    on the CPU, so `np.asarray(x)` costs nothing, and a write raises numpy's
    read-only error instead of changing the value). copy=False raises
    ValueError where a copy cannot be avoided (another device or dtype).
    """
    if copy:
        arr = numpy_copy(t)
        return arr if dtype is None else arr.astype(dtype, copy=False)
    arr = _host_numpy(t)
    converts = dtype is not None and arr.dtype != np.dtype(dtype)
    if copy is False and (converts or t.device.type != "cpu"):
        raise ValueError(f"np.asarray(..., copy=False) of a dtape value of dtype {t.dtype} on {t.device}"
                         f"{f' as {np.dtype(dtype)}' if converts else ''} needs a copy; pass copy=None or True")
    if converts:
        arr = arr.astype(dtype)
    arr.flags.writeable = False
    return arr


def _display_numpy(t):
    """numpy copy of torch tensor `t` for display: dtypes numpy lacks (bfloat16, float8) as float32."""
    t = t.detach().cpu()
    try:
        return t.numpy()
    except TypeError:
        return t.to(torch.complex64 if t.is_complex() else torch.float32).numpy()


def numpy_repr(t):
    """numpy-style repr of torch tensor `t`, any dtype: bfloat16 shows its float32 values, named bfloat16."""
    arr = _display_numpy(t)
    body = repr(arr)
    if arr.dtype.name != str(t.dtype).removeprefix("torch."):  # converted for display: name the real dtype
        body = body.replace(f"dtype={arr.dtype.name}", f"dtype={str(t.dtype).removeprefix('torch.')}")
    return body


# -- dtypes ----------------------------------------------------------------------
# dtype names dtape accepts (torch's and TF's canonical names, and TF's aliases).
_DTYPE_NAMES = {name: getattr(torch, name) for name in (
    "float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool",
    "complex64", "complex128")}
_DTYPE_NAMES.update(half=torch.float16, float=torch.float32, double=torch.float64)
# Python types as dtypes: what dtape makes of a Python value of that type.
_PY_TYPE_DTYPES = {float: DEFAULT_FLOAT_DTYPE, int: torch.int64, bool: torch.bool, complex: torch.complex64}


def as_dtype(dtype):
    """The torch.dtype for `dtype`: a torch.dtype, a name ("float32", "bfloat16", "int64", "bool"),
    a numpy dtype or type (np.float32, np.dtype("int32")) or a Python type (float: float32, int: int64).

    None passes through (it means "the default" wherever a dtype is optional).
    Every dtype argument in dtape goes through this function.

    Raises:
      ValueError: for an unknown name (the message lists the valid ones).
      TypeError: for a value that is not a dtype at all.

    Source: tf.dtypes.as_dtype, returning torch dtypes.
    """
    if type(dtype) is torch.dtype or dtype is None:
        return dtype
    if isinstance(dtype, str):
        found = _DTYPE_NAMES.get(dtype.removeprefix("torch."))
        if found is None:
            raise ValueError(f"unknown dtype name {dtype!r}; valid names: {', '.join(_DTYPE_NAMES)} "
                             f"(or a torch.dtype such as dtape.float32)")
        return found
    if isinstance(dtype, type) and dtype in _PY_TYPE_DTYPES:
        return _PY_TYPE_DTYPES[dtype]
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = None
    if name not in _DTYPE_NAMES:
        raise TypeError(f"{dtype!r} is not a dtype dtape supports; give a torch.dtype (dtape.float32), "
                        f"a name ({', '.join(_DTYPE_NAMES)}) or a numpy dtype")
    return _DTYPE_NAMES[name]


def _infer_dtype(value):
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    if isinstance(value, float):
        return DEFAULT_FLOAT_DTYPE
    return None


_SYMBOLIC_SCALARS = {torch.SymInt: torch.int64, torch.SymFloat: DEFAULT_FLOAT_DTYPE, torch.SymBool: torch.bool}


def to_torch(value, dtype=None, device=None):
    """A torch.Tensor from a scalar, nested list, numpy array or torch.Tensor."""
    if dtype is not None:
        dtype = as_dtype(dtype)
    if isinstance(value, torch.Tensor):
        t = value.detach()
    elif isinstance(value, tuple(_SYMBOLIC_SCALARS)):
        # a size of a traced tensor whose dimension is symbolic (a compiled function's None dim): `full` keeps
        # it a graph value, where torch.tensor would fix it to the traced call's size
        t = torch.full((), value, dtype=dtype or _SYMBOLIC_SCALARS[type(value)])
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


def constant(value, dtype=None, shape=None, device=None, *, name=None):
    """Creates a dtape.Tensor holding a copy of `value`.

    Args:
      value: Python scalar, nested list, numpy array or torch.Tensor.
      dtype: torch.dtype or a name/numpy dtype (see `as_dtype`); default float32 for Python floats, int64 for ints,
        the source dtype for numpy and torch values.
      shape: optional shape; a scalar value is broadcast to it.
      device: torch device or name ('cpu', 'cuda:0'); default: a torch.Tensor's
        own device, else the current `dtape.device` scope's, else the CPU.
      name: accepted and ignored, as TF's eager tensors have no name (every op takes it).

    Returns:
      A Tensor that shares no memory with `value`.

    Raises:
      TypeError: if `value` cannot be converted.

    Source: tf.constant.
    """
    if isinstance(value, Tensor):
        value = value._t
    t = to_torch(value, dtype, device)
    if isinstance(value, torch.Tensor) and t.data_ptr() == value.data_ptr():
        t = t.clone()
    if shape is not None:
        t = torch.broadcast_to(t, tuple(shape)).clone() if t.numel() == 1 else t.reshape(tuple(shape))
    return Tensor(t)


def convert_to_tensor(value, dtype=None, device=None, *, name=None):
    """Returns `value` as a dtape.Tensor (no copy when it already is one or is a torch.Tensor).

    Accepts Tensor, Variable (read: recorded, notifies tapes), torch.Tensor,
    numpy array, Python scalar or nested list.

    Raises:
      TypeError: for values that are not tensor-like.
      ValueError: if `value` is a Tensor of another dtype than `dtype`.

    Source: tf.convert_to_tensor.
    """
    if type(value) is Tensor:
        if dtype is not None and value.dtype != as_dtype(dtype):
            raise ValueError(f"convert_to_tensor: tensor has dtype {value.dtype}, requested {as_dtype(dtype)}; "
                             f"use dtape.cast")
        return value
    if is_variable(value):
        return convert_to_tensor(value._dtape_read(), dtype)
    return Tensor(to_torch(value, dtype, device))


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def is_tracing():
    """Whether torch is tracing the calling code (make_fx, a TorchDispatchMode, torch.compile's dynamo).

    Code that reads a scalar on the host in eager mode (a step count, a
    learning rate: exact and cheap on the CPU) keeps it a tensor instead
    while tracing, where a host read fails (fake tensors have no values) or
    would bake the value into the graph.
    """
    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None


def storage_held_alone(t):
    """True if torch.Tensor `t` is the only tensor on its storage and that storage is not in shared
    memory (not sent to another process): what dtape checks, with Python's reference count of `t`,
    before writing a tensor in place (optimizer updates, gradient sums). False when torch cannot tell."""
    if _storage_use_count is None:
        return False
    st = t.untyped_storage()
    if st.is_shared():  # the storage's own check (what t.is_shared() asks, without its TypedStorage)
        return False
    return _storage_use_count(st._cdata) == 2  # `t` + the storage object asked for here


def is_differentiable_dtype(dtype):
    """True for floating and complex dtypes (the ones that get gradients)."""
    return dtype.is_floating_point or dtype.is_complex


def from_dlpack(obj):
    """A dtape.Tensor sharing memory with `obj` (no copy), through DLPack.

    Args:
      obj: anything with `__dlpack__` (numpy array, torch.Tensor, CuPy/JAX
        array, dtape Tensor or Variable) or a DLPack capsule.

    Returns:
      A Tensor of obj's shape, dtype and device over the same memory: writes
      to `obj` afterwards show in the Tensor (dtape never writes to it).
      A torch.Tensor that requires grad is detached first.

    Raises:
      BufferError / RuntimeError: (from the producer or torch) for memory
        DLPack cannot share (e.g. a read-only numpy array).

    Source: tf.experimental.dlpack.from_dlpack, torch.from_dlpack.
    """
    if isinstance(obj, torch.Tensor):
        obj = obj.detach()
    return Tensor(torch.from_dlpack(obj))
