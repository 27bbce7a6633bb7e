"""Variable, its synchronization/aggregation enums, and the variable-creator stack.

Source: tf.Variable (ResourceVariable semantics in eager), tf.variable_creator_scope.
A variable has a stable id (its "handle"); every read is a recorded op whose
input is that id, so the gradient w.r.t. a variable is the sum over its reads.
"""
import enum
import itertools
import sys
import threading

import torch

from dtape import tape as _tp
from dtape._local import ThreadLocalScope
from dtape.ops._dispatch import install_variable_operators
from dtape.tensor import Tensor, next_id, to_torch, is_variable, numpy_repr, storage_held_alone, numpy_array, numpy_value


class VariableSynchronization(enum.Enum):
    """When a distributed variable is synchronized. Source: tf.VariableSynchronization."""

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3


class VariableAggregation(enum.Enum):
    """How replica-context writes are combined. Source: tf.VariableAggregation."""

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3


class _ReadVariableOp(_tp.RecordOp):
    """Record op of a variable read: the gradient passes straight to the variable."""

    __slots__ = ()
    name = "ReadVariableOp"
    saves_inputs = saves_outputs = False  # the gradient passes through: the record keeps no snapshot alive
    raw_saved = True  # the rule reads nothing saved: the raw walk skips rebuilding dtape.Tensors for it

    def backward(self, dys, outputs, inputs, attrs, raw, needs):
        return dys

    def jvp(self, tangents, outputs, inputs, attrs):
        return tangents  # the value is the variable's: its tangent too (TF's ReadVariableOp special case)


_READ_OP = _ReadVariableOp()


class _ReadVariablesOp(_tp.RecordOp):
    """Record op of several variable reads at once (`read_values`): output k's gradient is input k's."""

    __slots__ = ()
    name = "ReadVariableOp"
    saves_inputs = saves_outputs = False
    raw_saved = True
    passthrough = True  # the walk moves each output's gradient to its input without calling backward

    def backward(self, dys, outputs, inputs, attrs, raw, needs):
        return dys

    def jvp(self, tangents, outputs, inputs, attrs):
        return tangents


_READS_OP = _ReadVariablesOp()


class _ReadHookState(threading.local):
    """Per-thread hook `fn(variable, value) -> value` applied to every read (None: none)."""

    fn = None


_read_hook = _ReadHookState()


class read_hook_scope(ThreadLocalScope):
    """Thread-local: reads on this thread return `fn(variable, torch_value)` inside the block.

    For `dtape.recompute_grad`, which snapshots the values its body read and
    replays them in the backward re-run. Other threads are not affected.
    """

    __slots__ = ()
    _state = _read_hook
    _attr = "fn"


def current_read_hook():
    """This thread's read hook (set by `read_hook_scope`), or None."""
    return _read_hook.fn


class _TraceState(threading.local):
    """Per-thread tracer of a compiled function (None: none); see `trace_scope`."""

    tracer = None


_trace = _TraceState()


class trace_scope(ThreadLocalScope):
    """Thread-local: every read and write of any variable on this thread goes to `tracer` inside the block.

    For compiled `dtape.function`s: while the body is traced, `tracer.value(variable)`
    gives the variable's value in the graph (an input placeholder, or what the body
    wrote) and `tracer.write(variable, tensor)` takes a write, which the compiled
    function applies after each call; the variable itself is left alone.
    """

    __slots__ = ()
    _state = _trace
    _attr = "tracer"


def tracing_body():
    """True while a compiled `dtape.function` traces its body on this thread (its tensors have no values)."""
    return _trace.tracer is not None


class _CreatorState(threading.local):
    """Per-thread variable-creator stack (innermost last)."""

    stack = ()


_creator_state = _CreatorState()
_name_counter = itertools.count()  # process-wide, for default names


class variable_creator_scope(ThreadLocalScope):
    """Thread-local scope that routes Variable creation through `creator`.

    `creator(next_creator, **kwargs)` returns a variable, usually by calling
    `next_creator(**kwargs)`. Scopes nest; the innermost runs first.
    Source: tf.variable_creator_scope.
    """

    __slots__ = ()
    _state = _creator_state
    _attr = "stack"

    def _new(self, prev):
        return prev + (self._value,)


def current_creator_stack():
    """The calling thread's creator stack (for replica threads to inherit)."""
    return _creator_state.stack


class set_creator_stack(ThreadLocalScope):
    """Thread-local: replaces this thread's creator stack, restoring it on exit."""

    __slots__ = ()
    _state = _creator_state
    _attr = "stack"


class _VariableMeta(type):
    def __call__(cls, *args, **kwargs):
        if cls is not Variable:
            return super().__call__(*args, **kwargs)
        kwargs = _normalize_args(*args, **kwargs)

        def base(**kw):
            return type.__call__(Variable, **kw)
        make = base
        for creator in _creator_state.stack:
            make = _chain(creator, make)
        return make(**kwargs)


def _chain(creator, next_creator):
    return lambda **kw: creator(next_creator, **kw)


def _normalize_args(initial_value=None, trainable=None, name=None, dtype=None, device=None,
                    synchronization=VariableSynchronization.AUTO,
                    aggregation=VariableAggregation.NONE):
    if initial_value is None:
        raise ValueError("Variable needs an initial_value (a tensor-like value or a callable returning one)")
    # Resolved before the creators run, so a strategy's creator sees the final value (TF's
    # validate_synchronization_aggregation_trainable: trainable defaults to sync != ON_READ).
    synchronization = _synchronization(synchronization)
    if trainable is None:
        trainable = synchronization != VariableSynchronization.ON_READ
    return dict(initial_value=initial_value, trainable=trainable, name=name, dtype=dtype,
                device=device, synchronization=synchronization, aggregation=aggregation)


def _synchronization(value):
    """`value` as a VariableSynchronization (None is AUTO, as in TF; its int values are accepted).

    Raises:
      ValueError: a value that is not one of VariableSynchronization's.
    """
    if value is None:
        return VariableSynchronization.AUTO
    if isinstance(value, VariableSynchronization):
        return value
    try:
        return VariableSynchronization(value)
    except ValueError:
        raise ValueError(f"invalid variable synchronization {value!r}; use one of "
                         f"{[str(m) for m in VariableSynchronization]}") from None


# References to a variable's tensor, seen in `_sole_owner(self._t)`, when only the variable holds
# it: the variable's attribute, `_sole_owner`'s argument and getrefcount's argument.
_SOLE_REFS = 3
_COUNTER_DTYPES = frozenset([torch.int64, torch.int32])


def _sole_owner(t):
    """True if no Python object but the variable refers to `t` and no other tensor shares its storage.

    A variable's tensor is always dtape's own memory (the constructor and
    `assign` copy); one moved to shared memory (sent to another process)
    is never written in place, nor one made under `torch.inference_mode`
    while that mode is off (torch refuses that write).
    """
    return (sys.getrefcount(t) == _SOLE_REFS and storage_held_alone(t)
            and (not t.is_inference() or torch.is_inference_mode_enabled()))


def share_storage(variable, tensor):
    """Makes torch tensor `tensor` the value of concrete `variable` itself, for good (no copy).

    `tensor` (e.g. a torch module's parameter, detached) gets the variable's
    current value first, and from then on every write of the variable
    (assign*, optimizer updates, restores) goes into its storage, so its
    other owner sees each update. Unlike other variables, a read taken
    before a write then sees the new value, as torch's own parameters do (a
    gradient that needs the old value raises, from the version counter).

    Raises:
      ValueError: `tensor` differs from the variable in shape, dtype or device.
    """
    t = variable._t
    if tensor.shape != t.shape or tensor.dtype != t.dtype or tensor.device != t.device:
        raise ValueError(f"share_storage: variable {variable.name!r} is {tuple(t.shape)} {t.dtype} on {t.device}, "
                         f"the tensor {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}; they must agree")
    with variable._lock:
        if tensor.data_ptr() != variable._t.data_ptr():
            tensor.copy_(variable._t)
        variable._t = tensor
        variable._shared = True
        variable._own_version = tensor._version


def _note_own_write(variable, before):
    """After dtape wrote `variable`'s shared tensor (its torch version counter was `before`): the counter's
    new value is dtape's own, unless the other owner had written it since dtape's last write (`before` is
    not the noted one); then that write stays noticeable (the counter stays past the noted one)."""
    if before == variable._own_version:
        variable._own_version = variable._t._version


def update_together(variables, inplace):
    """Runs `inplace(tensors)` under all the variables' locks on their tensors, each one written in place
    if nothing but its variable holds it (see `Variable._update_value`), else on a copy that then
    becomes the variable's value (reads taken before keep their old value); returns the new tensors,
    or None (nothing done) for a list naming a variable twice.

    `inplace` may also replace an item of the list with a tensor of the same values (a row-major copy):
    that becomes the variable's value. Locks are taken in a fixed order (by id), so two callers cannot deadlock.
    Every variable gets the same kernel on the same values whoever holds
    what, so the results are bit-identical either way.
    """
    by_id = dict(zip(map(id, variables), variables))  # by id, not hash: no Python __hash__ call per variable
    if len(by_id) != len(variables):
        return None
    ordered = [by_id[i] for i in sorted(by_id)]
    n_taken = 0
    try:
        for v in ordered:
            v._lock.acquire()
            n_taken += 1
        for v in ordered:
            v._writing = True  # before the checks: see Variable._writing
        tracer = _trace.tracer
        if tracer is not None:  # traced: the kernel runs on copies of the graph's values, which become the writes
            tensors = [tracer.value(v).clone() for v in variables]
            inplace(tensors)
            for v, t in zip(variables, tensors):
                tracer.write(v, t)
            return tensors
        tensors = [v._t if v._shared or _sole_owner(v._t) else v._t.clone() for v in variables]
        before = [v._t._version if v._shared else None for v in variables]
        inplace(tensors)
        for v, t, version in zip(variables, tensors, before):
            if v._shared and t is not v._t:  # a storage shared with its owner stays the variable's value
                v._t.copy_(t)
            else:
                v._t = t
            if v._shared and version == v._own_version:  # _note_own_write, without a call per variable
                v._own_version = v._t._version
        return [v._t for v in variables]
    finally:
        for v in ordered[:n_taken]:
            v._writing = False
            v._lock.release()


class Variable(metaclass=_VariableMeta):
    """A mutable tensor-valued state, differentiable through its reads.

    Args:
      initial_value: tensor-like, or a callable returning one (any shape).
      trainable: watched automatically by tapes when read. Default: True,
        unless `synchronization` is ON_READ (then False, as tf.Variable: a
        sync-on-read variable holds per-replica state such as metric
        totals); an explicit `trainable=True` stays trainable.
      name: a name for checkpoints and messages (default "Variable_N").
      dtype: torch dtype; default that of `initial_value`.
      device: torch device or name; default that of `initial_value`.
      synchronization, aggregation: for distributed variables (see dtape.distribute).

    Reads (`read_value()`, ops, operators, torch functions) notify the tapes;
    `assign*` replace the value (reads taken before keep their old value).

    Source: tf.Variable.

    Example:
      >>> v = dtape.Variable(2.0)
      >>> with dtape.GradientTape() as tape:
      ...     y = v * v
      >>> float(tape.gradient(y, v))
      4.0
    """

    def __init__(self, initial_value=None, trainable=None, name=None, dtype=None, device=None,
                 synchronization=VariableSynchronization.AUTO, aggregation=VariableAggregation.NONE):
        synchronization = _synchronization(synchronization)
        if trainable is None:  # a creator may pass it on unresolved
            trainable = synchronization != VariableSynchronization.ON_READ
        if callable(initial_value):
            with _tp.stop_recording():
                initial_value = initial_value()
        if isinstance(initial_value, Tensor):
            initial_value = initial_value.torch()
        elif is_variable(initial_value):
            with _tp.stop_recording():
                initial_value = initial_value._dtape_read().torch()
        self._t = to_torch(initial_value, dtype, device).clone()
        self._id = next_id()  # process-wide and never reused (also keys optimizer slots)
        self._lock = threading.Lock()  # serialises writes (read-modify-write of `_t`)
        self._trainable = bool(trainable)
        self._name = name or f"Variable_{next(_name_counter)}"
        self._synchronization = synchronization
        self._aggregation = aggregation

    # -- identity -----------------------------------------------------------
    # The walk may take a source of exactly this class as its own handle without calling `_handle`.
    _handle_is_self = True

    def _handle(self):
        return self

    @property
    def name(self):
        return self._name

    @property
    def trainable(self):
        return self._trainable

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

    @property
    def synchronization(self):
        return self._synchronization

    @property
    def aggregation(self):
        return self._aggregation

    # -- reads --------------------------------------------------------------
    def read_value(self):
        """The current value as a Tensor; notifies the tapes and is recorded."""
        t = self._t
        if self._writing:
            t = self._after_write()
        if _trace.tracer is not None:
            t = _trace.tracer.value(self)
        if _read_hook.fn is not None:  # recompute_grad's snapshot/replay (thread-local, rare)
            t = _read_hook.fn(self, t)
        out = Tensor(t)
        if _tp.active_tapes:  # one call: watches (once per tape) and records the read
            _tp.variable_read(self, out, _READ_OP)
        elif self._trainable and _tp.capturing_reads():
            _tp.variable_accessed(self)
        return out

    value = read_value
    _dtape_read = read_value

    def numpy(self):
        """A numpy copy of the value, writable; writing it leaves the variable alone (use `assign`); a numpy
        scalar of its dtype for a 0-d variable, as TF's."""
        return numpy_value(self.torch())

    def __array__(self, dtype=None, copy=None):
        return numpy_array(self.torch(), dtype, copy)

    def torch(self):
        """The current torch.Tensor (no copy, not recorded)."""
        if _trace.tracer is not None:
            return _trace.tracer.value(self)
        t = self._t
        if self._writing:
            t = self._after_write()
        return t

    # An in-place update is running (`_update_value(inplace=...)`): a read taken now waits for it.
    # The writer sets this before it checks that nobody holds the tensor, and a read takes the
    # tensor before it looks at this: a read either holds the tensor in time for the check (the
    # update then copies) or waits here for the finished value.
    _writing = False
    # Set on a distributed variable's components (dtape.distribute); here so that a plain variable answers
    # without `__getattr__` (which raises for private names: every tape's first read of it asks).
    _distributed_container = None
    # The value's storage is shared with another owner (`share_storage`): every write goes into it.
    _shared = False
    # A shared value's torch version counter after dtape's last write of it: a counter past it means the other
    # owner wrote the storage itself (e.g. `torch.nn.init.*_` on a module's parameter), which dtape did not see.
    _own_version = None

    def _after_write(self):
        with self._lock:
            return self._t

    # -- writes -------------------------------------------------------------
    def _coerce(self, value, what):
        if is_variable(value):
            value = value._dtape_read()
        t = value.torch() if isinstance(value, Tensor) else to_torch(value, self._t.dtype)
        if t.shape != self._t.shape:
            try:
                t = torch.broadcast_to(t, self._t.shape)
            except RuntimeError:
                raise ValueError(f"{what} on variable {self._name!r}: value of shape {tuple(t.shape)} does not "
                                 f"match the variable's shape {tuple(self._t.shape)}") from None
        return t.to(device=self._t.device, dtype=self._t.dtype)

    def _update_value(self, fn, what="update", inplace=None):
        """Atomically replaces the value with `fn(current)`; returns the new torch.Tensor.

        The one write path of a variable: `assign*` and the optimizers go
        through it, under the variable's lock, so concurrent read-modify-writes
        never lose an update (no reliance on the GIL). `fn(current)` gets and
        returns torch tensors; it runs under the lock, so it must not write
        this variable. Its result must have the variable's shape; it is cast
        to the variable's dtype and device and then owned by the variable
        (reads taken before keep their old value).

        `inplace(current)`, when given, writes `fn(current)` into `current`
        bit for bit (same torch ops, same order). It is used instead of `fn`
        when nothing but the variable holds the current tensor (no read,
        record, view, numpy array or DLPack export of it is alive), so that
        no read can see the change; then a training step allocates no new
        weights (torch's optimizers also update in place).

        Raises:
          ValueError: if `fn`'s result has another shape.
        """
        tracer = _trace.tracer
        if tracer is not None:
            return self._traced_update(tracer, fn, what)
        with self._lock:
            if inplace is not None and self._update_in_place(inplace):
                return self._t
            new = fn(self._t)
            if new.shape != self._t.shape:
                raise ValueError(f"{what} of variable {self._name!r} produced shape {tuple(new.shape)}, "
                                 f"expected the variable's shape {tuple(self._t.shape)}")
            if self._shared:
                before = self._t._version
                self._t.copy_(new)
                _note_own_write(self, before)
            else:
                self._t = new.to(device=self._t.device, dtype=self._t.dtype)
            return self._t

    def _traced_update(self, tracer, fn, what):
        """`_update_value` while a compiled function traces its body: the write goes to `tracer`."""
        new = fn(tracer.value(self))
        if tuple(new.shape) != tuple(self._t.shape):
            raise ValueError(f"{what} of variable {self._name!r} produced shape {tuple(new.shape)}, "
                             f"expected the variable's shape {tuple(self._t.shape)}")
        new = new.to(device=self._t.device, dtype=self._t.dtype)
        tracer.write(self, new)
        return new

    def _update_in_place(self, inplace):
        """Runs `inplace(tensor)` if nothing but this variable holds its tensor (caller holds the lock)."""
        self._writing = True
        try:
            if not (self._shared or _sole_owner(self._t)):
                return False
            before = self._t._version
            inplace(self._t)
            if self._shared:
                _note_own_write(self, before)
            return True
        finally:
            self._writing = False

    # assign* write in place when nothing but the variable holds its tensor (`_update_value`), as the
    # optimizers do: a manual `w.assign_sub(lr * g)` step then allocates no new weights. The in-place
    # and the copying forms are the same torch op, so the bits do not depend on who holds the tensor.
    def assign(self, value, read_value=False):
        """Sets the value (same shape; cast to the variable's dtype and device). Returns the variable.

        Atomic with respect to other writes of this variable.
        """
        t = self._coerce(value, "assign")
        self._update_value(lambda old: t.clone(), "assign", inplace=lambda cur: cur.copy_(t))
        return self

    def assign_add(self, delta, read_value=False):
        """Adds `delta` to the value, atomically (no concurrent write is lost). Returns the variable."""
        if type(delta) is int and -2**31 <= delta < 2**31 and self._t.dtype in _COUNTER_DTYPES:
            # a step counter: the same sum, without making a tensor of `delta` on every step
            self._update_value(lambda old: old + delta, "assign_add", inplace=lambda cur: cur.add_(delta))
            return self
        t = self._coerce(delta, "assign_add")
        self._update_value(lambda old: old + t, "assign_add", inplace=lambda cur: cur.add_(t))
        return self

    def assign_sub(self, delta, read_value=False):
        """Subtracts `delta` from the value, atomically (no concurrent write is lost). Returns the variable."""
        t = self._coerce(delta, "assign_sub")
        self._update_value(lambda old: old - t, "assign_sub", inplace=lambda cur: cur.sub_(t))
        return self

    def __repr__(self):
        return (f"<dtape.Variable '{self._name}' shape={tuple(self._t.shape)} dtype={self._t.dtype} "
                f"device={self._t.device}, numpy={numpy_repr(self._t)}>")

    def __hash__(self):
        return id(self)


def read_values(variables):
    """The values of `variables`: what `[v.read_value() for v in variables]` gives (same values, same
    watches, same gradients), in one pass and, where the tapes allow, one record for all of them.

    For a caller that reads many variables at once (a wrapped torch module's
    parameters, every call): a read costs Python work per variable and per
    record of the backward walk. Plain variables, and distributed variables
    whose read is their component's (`_reads_handle`), are read here;
    anything else (another variable type, a trace or read hook active on
    this thread, a component being written) takes `read_value` one by one.

    Args:
      variables: a sequence of variables (each once).

    Returns:
      A list of dtape.Tensors, one per variable.
    """
    if _trace.tracer is not None or _read_hook.fn is not None:
        return [v.read_value() for v in variables]
    comps = _read_handles(variables)
    for c in comps:
        if type(c) is not Variable:
            return [v.read_value() for v in variables]
    outs = [Tensor.__new__(Tensor) for _ in comps]  # Tensor(t) without the Python-level __init__ call
    for c, out in zip(comps, outs):
        t = c._t  # before `_writing`, as `read_value` (see Variable._writing)
        if c._writing:
            t = c._after_write()
        out._t, out._id = t, next_id()
    if _tp.active_tapes:
        _tp.variables_read(comps, outs, _READS_OP, _READ_OP)
    elif _tp.capturing_reads():
        for c in comps:
            if c._trainable:
                _tp.variable_accessed(c)
    return outs


def _read_handles(variables):
    """The component each of `variables` reads (`_handle()`: plain variables and `_reads_handle` classes; None
    for others). Variables all of one `_reads_handle` class with `_handles_of` are looked up in one call (the
    distribution context once for a whole module's parameters, not per variable)."""
    kinds = set(map(type, variables))
    if len(kinds) == 1:
        kind = kinds.pop()
        if kind is not Variable and getattr(kind, "_reads_handle", False) and hasattr(kind, "_handles_of"):
            return kind._handles_of(variables)
    return [v if type(v) is Variable else v._handle() if getattr(type(v), "_reads_handle", False) else None
            for v in variables]


def install_tensor_protocol(cls):
    """Gives `cls` (a variable class with `_dtape_read()`) Tensor's operators and torch interop."""
    install_variable_operators(cls)


install_tensor_protocol(Variable)


def get_value(x):
    """The value of a variable or tensor as a numpy array (a Python number or array stays as it is).

    Source: tf.keras.backend.get_value (TF's callbacks guide reads `optimizer.learning_rate` with it).
    """
    if is_variable(x) or isinstance(x, Tensor):
        return x.numpy()
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return x


def set_value(x, value):
    """Assigns `value` (a number, array or tensor of x's shape) to the variable `x`: `x.assign(value)`.

    Raises:
      TypeError: `x` is not a variable (a number or array has nothing to assign to).
    Source: tf.keras.backend.set_value.
    """
    if not is_variable(x):
        raise TypeError(f"set_value needs a variable (e.g. optimizer.learning_rate), got {type(x).__name__}; "
                        "a plain value cannot be assigned in place")
    x.assign(value)
