"""Compiled `dtape.function(fn, jit_compile=True)`: the body traced into one torch graph and compiled.

Source: tf.function's tracing model (a concrete function per input signature,
TF's retracing rules, `input_signature`, `reduce_retracing`, variables created
only on the first trace, the retracing warning), on torch's tracer: with no
tape recording, dtape's ops and its backward walk are plain torch calls, so
`torch.fx.experimental.proxy_tensor.make_fx` records the forward, every
`tape.gradient` inside the body (the rules become graph ops, as TF's graph
gradients) and the variable writes into one aten graph, which `torch.compile`
compiles.

Variables are graph inputs, never constants: while the body is traced, every
read and write of a variable on this thread goes to a tracer
(`dtape.variables.trace_scope`), which gives the variable's placeholder (or
the value the body last wrote) and collects the writes as graph outputs; the
call applies them to the variables afterwards. A variable first met during a
trace (one read through a closure, one built lazily) is read there as a
constant, which the trace then turns into a new graph input.

Tensors have no values while the body is traced (fake tensors), so a host
read (`float(t)`, `bool(t)` in an `if`, `.numpy()`) cannot bake a value in:
it raises `OperatorNotAllowedInGraphError` naming the user's file and line.

Called while a tape records, the call is one op on that tape, whose
gradients (for the tensor arguments and the trainable variables the body
reads) come from a second compiled graph: the body's forward and the
gradient of its outputs, traced once per signature on first use and run with
the values (and the random-generator state) of the forward call.
"""
import os
import sysconfig
import threading
import time
import traceback
import warnings
import weakref

import numpy as np
import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode, unset_fake_temporarily)
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing, make_fx
from torch.fx.experimental.symbolic_shapes import (DimDynamic, GuardOnDataDependentSymNode, ShapeEnv,
                                                   StatelessSymbolicContext)

from dtape import nest
from dtape import random as _random
from dtape._local import ThreadLocalScope
from dtape import tape as _tp
from dtape.backprop import imperative_grad
from dtape.tensor import Tensor, as_dtype, convert_to_tensor, is_variable
from dtape.variables import trace_scope, tracing_body, update_together, variable_creator_scope

# TF warns once a function has been traced this many times (tf.function's FREQUENT_TRACING_WARNING_THRESHOLD)
RETRACE_WARNING_THRESHOLD = 5
_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, nest)) + (
    sysconfig.get_paths()["stdlib"] + os.sep,)
_TRACE_SIZE = 7  # the size a None dim is traced with when the call's is 0 or 1
_DTAPE_DIR = os.path.dirname(nest.__file__) + os.sep
_TENSOR_FILES = ("tensor.py", "variables.py")  # the conversion itself: the note names its caller


class OperatorNotAllowedInGraphError(TypeError):
    """A compiled function's body needs a tensor's value on the host while it is traced.

    Source: tf.errors.OperatorNotAllowedInGraphError (a TypeError in TF too).
    """


class TensorSpec:
    """The shape and dtype of a Tensor argument, for `dtape.function(..., input_signature=[...])`.

    Args:
      shape: a list of ints and None (None: any size there; the compiled graph
        takes every size without retracing).
      dtype: a torch dtype or name (default float32).
      name: optional, for messages.

    Source: tf.TensorSpec.
    """

    __slots__ = ("shape", "dtype", "name")

    def __init__(self, shape, dtype=torch.float32, name=None):
        self.shape = tuple(None if d is None else int(d) for d in shape)
        self.dtype = as_dtype(dtype)
        self.name = name

    def is_compatible_with(self, t):
        """True if torch/dtape tensor `t` has this spec's dtype and a shape it allows."""
        return t.dtype == self.dtype and _shape_matches(self.shape, tuple(t.shape))

    def __repr__(self):
        return f"TensorSpec(shape={list(self.shape)}, dtype={self.dtype}, name={self.name!r})"


def _shape_matches(pattern, shape):
    return len(pattern) == len(shape) and all(p is None or p == s for p, s in zip(pattern, shape))


# Passes over each traced step graph before it is compiled (fn(graph_module), in place): higher layers
# install theirs at import (dtape.distribute: gradient all-reduces overlapped with the walk).
GRAPH_PASSES = []

# One lock for every compiled function's lookups and traces in the process: make_fx is not thread-safe
# (torch.fx keeps one global patcher: two threads tracing at once fail), and one lock, rather than one per
# function, cannot deadlock when a body being traced calls another compiled function.
_TRACE_LOCK = threading.RLock()


class _NeedsEagerCall(Exception):
    """The body creates a variable from a value computed in the trace: this call runs eagerly."""


class _NeedsEagerBody(Exception):
    """The body reached a call no graph can hold (`strategy.run`): the function runs its body eagerly from now on."""

    def __init__(self, what):
        super().__init__(what)
        self.what = what


# The hook a strategy consults (seed 2: this module knows no strategy). A graph cannot hold the rendezvous of
# a strategy's replicas (threads meeting in merge_call, processes in host collectives, the reduce after
# them), so a compiled function whose trace reaches `strategy.run` (or a distributed dataset's iteration)
# runs its body eagerly instead, once and for all, and compiles the functions that body gives to
# `strategy.run` with its own options: TF's compiled outer step becomes an eager outer step around
# compiled replica steps, which is where the time goes.
class _EagerBodyState(threading.local):
    owner = None  # the JitFunction whose body runs eagerly on this thread now


_eager_body = _EagerBodyState()


class _eager_body_scope(ThreadLocalScope):
    __slots__ = ()
    _state = _eager_body
    _attr = "owner"


def leave_graph(what):
    """Called where the body does what no graph can hold (`what`, e.g. "MirroredStrategy.run"): while a
    compiled function traces its body on this thread, the trace stops and that function runs its body
    eagerly, this call included and every later one (the caller sees nothing but the eager call)."""
    if tracing_body():
        raise _NeedsEagerBody(what)


def call_eagerly_instead():
    """Called where a body being traced needs what only an eager call does (an optimizer making its slots,
    which under a strategy is a rendezvous of the replicas): while a compiled function traces its body on
    this thread, that call runs eagerly instead and the next call traces again (the rule for variables made
    from values computed in the body). Elsewhere: nothing."""
    if tracing_body():
        raise _NeedsEagerCall()


def replica_function(fn, what):
    """What `strategy.run` (`what`) runs on the replicas for `fn`.

    While a compiled function traces its body on this thread: the trace
    stops (`leave_graph`). In the eager body of such a function: `fn`
    compiled with that function's backend, compile_options and
    reduce_retracing (one `JitFunction` per `fn`, kept, so later steps reuse
    its trace; `fn` itself if it is a `JitFunction`). Elsewhere: `fn`.
    """
    leave_graph(what)
    owner = _eager_body.owner
    if owner is None or isinstance(fn, JitFunction):
        return fn
    return owner.replica_function(fn)


class _Tracer:
    """The variables' values while a body is traced (see `dtape.variables.trace_scope`)."""

    def __init__(self, placeholders):
        self.values = dict(placeholders)  # variable -> its placeholder, then what the body wrote
        self.written = {}  # variable -> None, in first-write order
        self.unknown = {}  # variables met that are not inputs of this trace
        self.created = []

    def value(self, variable):
        t = self.values.get(variable)
        if t is None:
            self.unknown[variable] = None
            return variable._t  # a constant, which becomes an input once the trace ends (`_lift_constants`)
        return t

    def write(self, variable, t):
        if variable not in self.values:
            self.unknown[variable] = None
        self.values[variable] = t
        self.written[variable] = None


class JitFunction:
    """`dtape.function(fn, jit_compile=True, ...)`: `fn` traced per input signature and compiled.

    Args:
      python_function: as for `dtape.function`.
      input_signature: None, or a list of `TensorSpec`, one per positional
        argument (all Tensors): one trace for every call matching it
        (None dims take any size); a call that does not match raises.
      reduce_retracing: when a call's tensor shapes differ from a traced
        signature's, trace once with the differing dims generalised (any size).
      backend: `torch.compile`'s backend ("inductor", "aot_eager", "eager", ...);
        None runs the traced aten graph as it is (no `torch.compile`: no
        compile time, for debugging and tests).
      compile_options: extra keyword arguments of `torch.compile` (e.g. `mode`);
        inductor on the CPU without a `mode` gets `options={"cpp_wrapper": True}`
        unless they set it.

    Calls return what the body returns (Tensors as new Tensors of the graph's
    outputs, Python values as the trace returned them). The body runs as
    Python only while traced: once per input signature (shapes, dtypes and
    devices of Tensor arguments, the values of Python arguments, the identity
    of Variable arguments), as tf.function. Variables may be created only
    during the first trace (TF's rule); optimizer slots and metric
    variables made from values computed in the body make that first call run
    eagerly, and the next call traces.

    A trace that reaches `strategy.run` (or the iteration of a distributed
    dataset) stops: a graph cannot hold the replicas' rendezvous. From then
    on the function runs its body eagerly (`eager_body_reason` says why;
    remembered, so the trace is tried once), and `strategy.run` in that body
    runs the function it is given compiled with this function's backend,
    compile_options and reduce_retracing (`replica_functions`: replica fn ->
    its `JitFunction`, kept, so later steps reuse its trace). TF's tutorial
    form, `strategy.reduce(SUM, strategy.run(train_step, ...))` in a compiled
    function, thus compiles `train_step`.

    Raises:
      OperatorNotAllowedInGraphError (a TypeError): at trace time, the body
        reads a tensor's value on the host; the message names the file and line.
      ValueError: a call does not match `input_signature`, or a trace after
        the first creates a variable (a first trace that created variables is
        traced again, as TF's, so a body creating them on every call raises
        on its first call).
      RuntimeError: a second-order gradient through the call.

    Source: tf.function(jit_compile=True) semantics; torch.compile.
    """

    def __init__(self, python_function, input_signature=None, reduce_retracing=False, backend="inductor",
                 compile_options=None, eager_call=None):
        self.python_function = python_function
        self._input_signature = None if input_signature is None else list(input_signature)
        self._reduce_retracing = bool(reduce_retracing)
        self._backend = backend
        self._compile_options = _compile_options(backend, compile_options)
        self._eager_call = eager_call  # the eager Function, for a first call that must create variables
        self._lock = _TRACE_LOCK
        self._concrete = {}  # relaxed key -> list of _Concrete
        self._variables = {}  # every variable a trace took as an input, in first-seen order
        self._initialized = False  # variables may be created only until the first trace completes
        self._bound = weakref.WeakKeyDictionary()  # instance -> its JitFunction (a decorated method)
        self.trace_count = 0
        # per signature: the seconds spent tracing; the compile happens in the first call of each graph
        self.trace_seconds = []
        # None while the body is compiled; else why it runs eagerly (its trace reached strategy.run)
        self.eager_body_reason = None
        self.replica_functions = {}  # replica fn -> its JitFunction, compiled for strategy.run in the eager body
        self._first_cause = "first call"

    def _name(self):
        return getattr(self.python_function, "__qualname__", None) or getattr(self.python_function, "__name__",
                                                                               "function")

    def __repr__(self):
        state = (f"body eager: {self.eager_body_reason}; compiled replica functions "
                 f"{[f._name() for f in self.replica_functions.values()]}" if self.eager_body_reason is not None
                 else f"{self.trace_count} trace(s)")
        return f"<dtape.function {self._name()!r} jit_compile=True, {state}>"

    def __get__(self, instance, owner=None):
        """A decorated method: one JitFunction per instance, kept (its traces too) while the instance lives."""
        if instance is None:
            return self
        try:
            bound = self._bound.get(instance)
        except TypeError:
            raise TypeError(f"a compiled dtape.function method {self._name()!r} needs instances that can be "
                            f"weakly referenced and hashed, to keep its traces per instance; "
                            f"{type(instance).__name__} cannot be") from None
        if bound is None:
            bound = JitFunction(self.python_function.__get__(instance, owner), self._input_signature,
                                self._reduce_retracing, self._backend, self._compile_options,
                                None if self._eager_call is None else self._eager_call.__get__(instance, owner))
            self._bound[instance] = bound
        return bound

    def __call__(self, *args, **kwargs):
        if tracing_body():  # called from another compiled function's body: inlined in its graph, as TF does
            return self.python_function(*args, **kwargs)
        if self.eager_body_reason is not None:
            return self._call_body_eagerly(args, kwargs)
        flat = not kwargs and not any(nest.is_nested(a) for a in args)  # the common case, without the nest walk
        leaves = list(args) if flat else nest.flatten((args, kwargs))
        kinds, tensors, shapes = _classify(leaves)
        if self._input_signature is not None:
            shapes = self._signature_shapes(args, kwargs, tensors)
        relaxed = (len(args) if flat else repr(nest.map_structure(lambda _: 0, (args, kwargs))), kinds)
        # Replica threads of a strategy calling this function trace one at a time (the first traces, the
        # others then find its graph); nothing in a trace waits for another replica, so this cannot deadlock.
        with self._lock:
            concrete = self._lookup(relaxed, tensors, shapes)
            if concrete is None:
                try:
                    concrete = self._trace(relaxed, args, kwargs, leaves, tensors, shapes)
                except _NeedsEagerCall:
                    concrete = None
                except _NeedsEagerBody as e:
                    self.eager_body_reason = (f"its trace reached {e.what}, which a graph cannot hold; the "
                                              "functions given to strategy.run are compiled instead")
                    concrete = None
        # outside the lock: the eager call may wait for other replicas (merge_call, a strategy's threads)
        if self.eager_body_reason is not None:
            return self._call_body_eagerly(args, kwargs)
        if concrete is None:
            result = self._eager_call(*args, **kwargs)
            self._initialized = True  # that call was the first: later traces may not create variables (TF's rule)
            return result
        return concrete.call(leaves, tensors)

    def _call_body_eagerly(self, args, kwargs):
        """The body run eagerly (as `jit_compile=False`), compiling what it gives to strategy.run
        (`replica_function`)."""
        with _eager_body_scope(self):
            return self._eager_call(*args, **kwargs)

    def replica_function(self, fn):
        """`fn` compiled with this function's options for `strategy.run` in its eager body, kept per `fn`.

        A new function object of the code of a kept one (a replica function
        defined inside the body: a fresh closure per call) replaces it and
        continues its trace count, so the retracing warning names it.
        """
        with self._lock:
            compiled = self.replica_functions.get(fn)
            if compiled is None:
                compiled = JitFunction(fn, reduce_retracing=self._reduce_retracing, backend=self._backend,
                                       compile_options=self._compile_options, eager_call=type(self._eager_call)(fn))
                code = _code_of(fn)
                for old in [f for f in self.replica_functions if code is not None and _code_of(f) is code]:
                    compiled.trace_count += self.replica_functions.pop(old).trace_count
                    compiled._first_cause = ("a new function object of the same code was given to strategy.run "
                                             "(defined inside the compiled function? define it outside)")
                self.replica_functions[fn] = compiled
            return compiled

    def _signature_shapes(self, args, kwargs, tensors):
        spec = self._input_signature
        if kwargs or len(args) != len(spec) or len(tensors) != len(spec) or not all(
                isinstance(a, (Tensor, torch.Tensor)) and s.is_compatible_with(a) for a, s in zip(args, spec)):
            got = [f"{type(a).__name__}{list(a.shape)} {a.dtype}" if hasattr(a, "shape") else repr(a) for a in args]
            raise ValueError(f"{self._name()}: the arguments {got}{' and keywords ' + str(sorted(kwargs)) if kwargs else ''}"
                             f" do not match input_signature {spec}; pass one positional Tensor per TensorSpec, "
                             "of its dtype and of a shape it allows")
        return [s.shape for s in spec]

    def _lookup(self, relaxed, tensors, shapes):
        for c in self._concrete.get(relaxed, ()):
            if all(_shape_matches(p, tuple(t.shape)) for p, t in zip(c.shapes, tensors)) and \
                    all(p.requires_grad is flag for p, flag in c.requires_grad) and \
                    all(version() == seen for version, seen in c.views):
                return c
        return None

    def _trace(self, relaxed, args, kwargs, leaves, tensors, shapes):
        previous = self._concrete.get(relaxed, [])
        if self._reduce_retracing and previous and self._input_signature is None:
            shapes = [tuple(None if a != b else a for a, b in zip(p, s)) for p, s in zip(previous[-1].shapes, shapes)]
        cause = _retrace_cause(previous, shapes, bool(self._concrete), self._first_cause)
        for x in leaves:
            if is_variable(x):
                self._variables.setdefault(_shared(x), None)
        started = time.perf_counter()
        concrete = _Concrete(self, args, kwargs, leaves, tensors, shapes, list(self._variables))
        first, self._initialized = not self._initialized, True
        if first and concrete.created:
            # TF traces a first call that created variables again: a body that creates them on every call
            # (not once, behind `if self.v is None`) raises now rather than silently keep the first ones
            concrete = _Concrete(self, args, kwargs, leaves, tensors, shapes, list(self._variables))
        self.trace_seconds.append(time.perf_counter() - started)
        self.trace_count += 1
        self._concrete.setdefault(relaxed, []).append(concrete)
        if self.trace_count >= RETRACE_WARNING_THRESHOLD:
            warnings.warn(
                f"{self.trace_count} calls to dtape.function {self._name()!r} triggered retracing ({cause}). "
                "Tracing is expensive and the excessive number of tracings could be due to (1) creating the "
                "dtape.function repeatedly in a loop, (2) passing tensors with different shapes, (3) passing "
                "Python objects (numbers, lists) that change instead of tensors. For (1), define the function "
                "outside of the loop. For (2), use reduce_retracing=True or an input_signature with None dims. "
                "For (3), pass tensors (the same tf.function retracing rules apply).", stacklevel=3)
        return concrete

    def experimental_get_tracing_count(self):
        """The number of traces so far (`trace_count`; 0 while its body runs eagerly around strategy.run).
        Source: tf.function's method of this name."""
        return self.trace_count

    def trace_variable(self, variable):
        """Registers a variable met during a trace (an input of this trace's graph and of later traces)."""
        self._variables.setdefault(_shared(variable), None)


# Distributed variables (seed 2: the container decides, this module knows no strategy). A trace meets the
# component that a read reaches on the tracing thread (a replica's); the graph keeps the variable shared by
# every replica (the component's container) and each call resolves it again, so replicas calling one graph
# pass, and write, their own components.
def _shared(variable):
    """The variable every replica's trace means: a component's container, else `variable` itself."""
    container = getattr(variable, "_distributed_container", None)
    return variable if container is None else container


def _local(variable):
    """The plain variable a read of `variable` reaches on this thread now (a container's `_handle()`)."""
    return _shared(variable)._handle()


def _compile_options(backend, options):
    """`torch.compile` keyword arguments: inductor draws random numbers with torch's own kernels from the
    graph's generator (`fallback_random`), so dropout follows the caller's seed and equals eager's draws."""
    options = dict(options or {})
    if backend == "inductor" and "mode" not in options:
        options["options"] = {"fallback_random": True, **options.get("options", {})}
    return options


def _classify(leaves):
    """The hashable key of each leaf (TF's retracing rules), the tensor leaves and their shapes."""
    kinds, tensors, shapes = [], [], []
    for x in leaves:
        if isinstance(x, (Tensor, torch.Tensor)):
            kinds.append(("T", tuple(x.shape).__len__(), x.dtype, x.device))
            tensors.append(x)
            shapes.append(tuple(x.shape))
        elif isinstance(x, np.ndarray):
            raise TypeError("a compiled dtape.function takes Tensors, not numpy arrays: wrap them in "
                            "dtape.constant(...) outside the function (a Python value would be a retracing key)")
        elif is_variable(x):
            kinds.append(("V", id(x)))
        else:
            try:
                hash(x)
                kinds.append(("P", type(x), x))
            except TypeError:
                kinds.append(("P", type(x), id(x)))
    return tuple(kinds), tensors, shapes


def _requires_grad_guard(variables):
    """[(torch parameter, its requires_grad)] for the variables whose trainability follows a torch parameter's
    (a TorchModule's): which of them a trace watched depends on it, so a graph is reused only while every flag
    is as it was traced (torch.compile guards on requires_grad too); freezing or unfreezing retraces."""
    params = [getattr(v, "_requires_grad_of", None) for v in variables]
    return [(p, p.requires_grad) for p in params if p is not None]


def _view_guard(variables):
    """[(view_version method, its value)] of the TorchModules whose Variables the graph reads: a module whose
    parameters, buffers or submodules were replaced after the trace (`model.fc = nn.Linear(...)`) has new
    Variables, which the old graph would not read (it would silently train the old ones); so it retraces."""
    owners = {}
    for v in variables:
        method = getattr(v, "_view_of", None)
        method = method() if method is not None else None
        if method is not None:
            owners.setdefault(id(method.__self__), method)
    return [(method, method()) for method in owners.values()]


def _retrace_cause(previous, shapes, traced_before, first_cause):
    if previous and list(shapes) == list(previous[-1].shapes):
        return ("a TorchModule parameter's requires_grad changed (a layer frozen or unfrozen), or its module's "
                "parameters, buffers or submodules were replaced")
    if previous:
        return f"tensor shapes {[list(s) for s in shapes]} differ from the traced {[list(s) for s in previous[-1].shapes]}"
    if traced_before:
        return "the Python arguments, the arguments' structure, or tensor dtypes/devices changed"
    return first_cause


def _code_of(fn):
    """The code object of a function or bound method (None for other callables)."""
    return getattr(getattr(fn, "__func__", fn), "__code__", None)


class _Concrete:
    """One traced and compiled graph of a `JitFunction` for one input signature."""

    def __init__(self, owner, args, kwargs, leaves, tensors, shapes, variables):
        self.owner = owner
        self.shapes = shapes
        self.variables = variables
        self.structure = (args, kwargs)
        # a seed of its own: the graph holds another Python object for this generator, found by its seed
        self.generator = torch.Generator(device=_device_of(tensors, variables)).manual_seed(
            int.from_bytes(os.urandom(7), "little"))
        self._vjp = None
        self.graph, self.template, self.written = self._trace_forward(leaves, tensors)
        self.requires_grad = _requires_grad_guard(self.variables)
        self.views = _view_guard(self.variables)
        # the positions (among the graph's inputs) of the variables the graph writes into, or None: it returns
        # their new values instead (see `_write_into_inputs`)
        self._targets = _write_into_inputs(self.graph, len(tensors), self.variables, self.written,
                                           owner._compile_options)
        self.compiled = _compile(owner, self.graph, self.dynamic, self.generator.device)
        self._draws = _generator_attributes(self.graph, self.generator)
        self._runners = {}  # a caller's generator -> (compiled graph, its generator), for graphs that draw

    @property
    def dynamic(self):
        return any(d is None for s in self.shapes for d in s)

    def _fakes(self, tensors, extra=()):
        """Fake inputs for the trace: the tensor arguments (None dims symbolic), the variables' values, `extra`."""
        # None dims are sizes of their own: two equal traced sizes are not taken for one
        mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=_ShapeEnv(duck_shape=False))
        fakes = []
        for t, s in zip(tensors, self.shapes):
            t = t.torch() if isinstance(t, Tensor) else t
            dims = [DimDynamic.DYNAMIC if d is None else DimDynamic.STATIC for d in s]
            if any(d is None and n < 2 for d, n in zip(s, t.shape)):
                # a traced size of 0 or 1 makes torch take the dim for that size (its size-1 cases, as
                # broadcasting): the trace sees a general size there (the graph takes any), an odd one, which
                # torch's checks are unlikely to find equal to a fixed dim and fix the None dim to
                t = t.new_empty([_TRACE_SIZE if d is None and n < 2 else n for d, n in zip(s, t.shape)])
            fakes.append(mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))
                         if None in s else mode.from_tensor(t, static_shapes=True))
        fakes += [mode.from_tensor(_local(v)._t, static_shapes=True) for v in self.variables]
        return fakes + [mode.from_tensor(t, static_shapes=True) for t in extra]

    def _rebuild_args(self, leaves, placeholders):
        it = iter(placeholders)
        flat = [(Tensor(next(it)) if isinstance(x, Tensor) else next(it)) if isinstance(x, (Tensor, torch.Tensor))
                else x for x in leaves]
        return nest.pack_sequence_as(self.structure, flat)

    def _run_body(self, leaves, flat, tracer):
        """Runs the body on placeholders `flat` under `tracer`; returns its result."""
        n = len(flat) - len(self.variables)
        args, kwargs = self._rebuild_args(leaves, flat[:n])
        creator = _creator(self.owner, tracer)
        # the caller's tapes are paused on this thread (tapes opened in the body record as usual)
        with _tp.pause_accumulators(), _tp.record_only(None), trace_scope(tracer), variable_creator_scope(creator), \
                _random.generator_scope(self.generator):
            return self.owner.python_function(*args, **kwargs)

    def _trace_forward(self, leaves, tensors):
        box = {}

        def body(*flat):
            tracer = _Tracer(zip([_local(v) for v in self.variables], flat[len(flat) - len(self.variables):]))
            result = self._run_body(leaves, flat, tracer)
            box["tracer"] = tracer
            box["template"] = nest.map_structure(_slot, result)
            box["written"] = [_shared(v) for v in tracer.written]
            outs = [y.torch() if isinstance(y, Tensor) else y for y in nest.flatten(result)
                    if isinstance(y, (Tensor, torch.Tensor))]
            return outs + [tracer.values[v] for v in tracer.written]
        graph = _make_fx(self.owner, body, self._fakes(tensors), self.dynamic)
        self.created = box["tracer"].created
        met = list(box["tracer"].unknown)
        if met:
            _lift_constants(graph, [v._t for v in met])
            self.variables = self.variables + [_shared(v) for v in met]
            for v in met:
                self.owner.trace_variable(v)
        for graph_pass in GRAPH_PASSES:
            graph_pass(graph)
        return graph, box["template"], box["written"]

    def call(self, leaves, tensors):
        """Runs the compiled graph, applies the writes, records one op on recording tapes; returns the result."""
        local = [v._handle() for v in self.variables]  # `_local`: self.variables are already `_shared`
        recording = _tp.could_possibly_record()
        ins = [t.torch() if isinstance(t, Tensor) else t for t in tensors]
        if recording or self._targets is None:  # the gradient graph reruns the body on the values read now
            ins += [v.torch() for v in local]
        # The graph draws from this function's generator: it takes over the caller's stream (the thread's or
        # replica's generator, `dtape.random.get_generator`) for the call, so draws follow the caller's seed.
        stream = _random.get_generator(self.generator.device)
        compiled, generator = self._runner(stream)
        state = None  # the generator's state for the gradient graph (None: the body draws nothing)
        if generator is not None:
            generator.set_state(stream.get_state())
            state = generator.get_state() if recording else None
        if self._targets is None:
            outs = compiled(*ins)
            n = len(outs) - len(self.written)
            for v, new in zip(self.written, outs[n:]):
                _local(v)._update_value(lambda old, new=new: new, "dtape.function write")
        else:
            outs = self._run_in_place(compiled, ins, local, recording)
            n = len(outs)
        if generator is not None:
            stream.set_state(generator.get_state())
        if self.template is _TENSOR:
            result = Tensor(outs[0])
            flat = [result]
        else:
            it = iter(outs[:n])
            flat = [Tensor(next(it)) if y is _TENSOR else next(it) if y is _TORCH_TENSOR else y
                    for y in nest.flatten(self.template)]
            result = nest.pack_sequence_as(self.template, flat)
        if recording:
            self._record(leaves, tensors, ins, state, [y for y in flat if isinstance(y, Tensor)])
        return result

    def _run_in_place(self, compiled, ins, local, recording):
        """Runs the graph that writes the variables into their inputs; returns its outputs (the body's).

        As eager writes (`variables.update_together`): under the written variables' locks, into the tensor of
        each variable that nothing else holds, else into a copy that becomes its value, so a tensor taken from
        `v.value()` before the call keeps its value, as in eager dtape and TF. `ins` holds the tensor
        arguments, then (recording: for the gradient graph) the variables' values read before the call.
        """
        n = len(ins) - (len(local) if recording else 0)
        if recording:  # a storage shared with its owner is written in place whoever holds it: keep a copy
            for i in self._targets:
                if local[i]._shared:
                    ins[n + i] = ins[n + i].clone()
        written = set(self._targets)
        box = []

        def run(targets):
            args = ins[:n] + [None if i in written else v.torch() for i, v in enumerate(local)]
            for i, t in zip(self._targets, targets):
                args[n + i] = t
            box.append(compiled(*args))
        if update_together([local[i] for i in self._targets], run) is None:
            raise RuntimeError(f"dtape.function {self.owner._name()!r} writes one variable through two names")
        return box[0]

    def _runner(self, stream):
        """(compiled graph, the generator it draws from, or None if it draws nothing) for a caller drawing from
        `stream`. Callers with different streams (the replica threads of a strategy) may run at once, so each
        gets a copy of the graph drawing from a generator of its own (one trace; a compile per copy); a graph
        that draws nothing is one compiled graph for all."""
        if not self._draws:
            return self.compiled, None
        runner = self._runners.get(stream)
        if runner is None:
            with self.owner._lock:
                runner = self._runners.get(stream)
                if runner is None:
                    runner = (self.compiled, self.generator) if not self._runners else self._copy_drawing_from(
                        torch.Generator(device=self.generator.device))
                    self._runners[stream] = runner
        return runner

    def _copy_drawing_from(self, generator):
        graph = torch.fx.GraphModule(self.graph, self.graph.graph)
        for name in self._draws:
            setattr(graph, name, generator)
        return _compile(self.owner, graph, self.dynamic, self.generator.device), generator

    def _record(self, leaves, tensors, ins, state, outputs):
        dtape_tensors = [t for t in tensors if isinstance(t, Tensor)]
        trainable = [_local(v) for v in self.variables if v.trainable]
        for v in trainable:
            _tp.variable_accessed(v)
        inputs = dtape_tensors + trainable
        if not outputs or not _tp.should_record(inputs):
            return
        op = _JitOp(self, leaves, ins, state)
        _tp.record_reading(op, tuple(x._id for x in inputs), tuple(inputs), tuple(outputs), None)

    def vjp(self, leaves, ins, state, dys):
        """Gradients for the tensor arguments and the variables (in order), from the compiled VJP graph."""
        if self._vjp is None:
            with self.owner._lock:  # traced once, one thread at a time (make_fx is not thread-safe)
                if self._vjp is None:
                    self._vjp = self._trace_vjp(leaves, ins, dys)
        graph, keep = self._vjp
        if state is not None:
            self.generator.set_state(state)  # the forward's draws again
        grads = iter(graph(*ins, *dys))
        return [next(grads) if k else None for k in keep]

    def _trace_vjp(self, leaves, ins, dys):
        box = {}
        n_in = len(ins)

        def body(*flat):
            values, upstream = flat[:n_in], flat[n_in:]
            tracer = _Tracer(zip([_local(v) for v in self.variables], values[n_in - len(self.variables):]))
            inner = _tp.push_new_tape(persistent=True, watch_accessed_variables=True)
            try:
                with _tp.record_only(inner):
                    n = n_in - len(self.variables)
                    args, kwargs = self._rebuild_args(leaves, values[:n])
                    sources = [x for x in nest.flatten((args, kwargs)) if isinstance(x, Tensor)]
                    for s in sources:
                        _tp.watch(inner, s)
                    with trace_scope(tracer), variable_creator_scope(_creator(self.owner, tracer)), \
                            _random.generator_scope(self.generator):
                        result = self.owner.python_function(*args, **kwargs)
                targets = [y for y in nest.flatten(result) if isinstance(y, Tensor)]
                pairs = [(t, Tensor(d)) for t, d in zip(targets, upstream) if t.dtype.is_floating_point]
                trainable = [_local(v) for v in self.variables if v.trainable]
                with trace_scope(tracer):
                    grads = imperative_grad(inner, [t for t, _ in pairs], sources + trainable, [d for _, d in pairs])
            finally:
                _tp.pop_tape(inner)
            box["keep"] = [g is not None for g in grads]
            return [g.torch() for g in grads if g is not None]
        graph = _make_fx(self.owner, body, self._fakes(ins[:n_in - len(self.variables)], dys), self.dynamic)
        return _compile(self.owner, graph, self.dynamic, self.generator.device), box["keep"]


def _compile(owner, graph, dynamic, device):
    """`graph` compiled with the owner's backend (None: the traced graph itself, run op by op) for `device`."""
    if owner._backend is None:
        return graph
    return torch.compile(graph, backend=owner._backend, dynamic=dynamic, **_device_options(owner, device))


def _device_options(owner, device):
    """The owner's `torch.compile` options, with inductor's C++ wrapper on the CPU unless they choose a mode or
    set `cpp_wrapper`: a step graph is mostly matmuls and fused kernels whose Python launcher (buffer allocation,
    views and size checks, one Python line each) took 3-5% of the charlm train step on one thread (21% of the
    1,000-op chain's). The wrapper's C++ compiles in the first call: cold, on a loaded 2-core box, charlm's
    step took 79-109 s against 81-250 s with the Python wrapper, the chain 99 s against 87 s."""
    options = owner._compile_options
    inductor = options.get("options")
    if owner._backend != "inductor" or device.type != "cpu" or inductor is None or "cpp_wrapper" in inductor:
        return options
    return {**options, "options": {**inductor, "cpp_wrapper": True}}


class _TensorSlot:
    """Marks where the body's result had a tensor (filled with the graph's outputs at each call)."""


_TENSOR = _TensorSlot()
_TORCH_TENSOR = _TensorSlot()  # a torch.Tensor result: returned as a torch.Tensor of the graph's output


def _slot(y):
    """The template's entry for one leaf of the body's result."""
    if isinstance(y, Tensor):
        return _TENSOR
    return _TORCH_TENSOR if isinstance(y, torch.Tensor) else y


def _generator_attributes(graph, generator):
    """The names of `graph`'s attributes that are `generator` (what its random ops draw from).

    make_fx keeps a generator as another Python object of the same torch generator: they share the seed.
    """
    seed = generator.initial_seed()
    attributes = [(n.target, getattr(graph, n.target, None)) for n in graph.graph.nodes if n.op == "get_attr"]
    return [name for name, a in attributes if isinstance(a, torch.Generator) and a.initial_seed() == seed]


def _device_of(tensors, variables):
    for x in list(tensors) + list(variables):
        return x.device
    return torch.device("cpu")


def _lift_constants(graph, values):
    """Turns the graph's constants that are `values` (torch tensors, by identity) into new last inputs.

    The variables a trace met without taking them as inputs were read as
    constants (their tensors, `get_attr` nodes of the graph); made inputs,
    they need no second trace.
    """
    uses = {id(v): [] for v in values}
    for node in graph.graph.nodes:
        if node.op == "get_attr" and id(getattr(graph, node.target, None)) in uses:
            uses[id(getattr(graph, node.target))].append(node)
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    last = placeholders[-1] if placeholders else None
    for k, v in enumerate(values):
        with (graph.graph.inserting_after(last) if last is not None
              else graph.graph.inserting_before(next(iter(graph.graph.nodes)))):
            last = graph.graph.placeholder(f"variable_{k}")
        for node in uses[id(v)]:
            last.meta.setdefault("val", node.meta.get("val"))
            node.replace_all_uses_with(last)
            graph.graph.erase_node(node)
    for target in {node.target for nodes in uses.values() for node in nodes}:
        delattr(graph, target)
    graph.recompile()


# Collectives wait for the other replicas: a graph holding them must not run under the variables' locks
# (another replica's graph may write a variable both replicas hold, and would wait for that lock forever);
# every op of the "dtape" namespace is one (torch.ops.dtape.all_reduce_sum / _start / _wait)
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "dtape")
# modes that run the graph as a CUDA graph, which torch skips for a graph that writes into its inputs
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _write_into_inputs(graph, n_tensors, variables, written, compile_options):
    """Makes `graph` write the new values of the `written` variables into their inputs (`aten.copy_` into the
    placeholders, which inductor turns into kernels storing into the variables' buffers) instead of returning
    them; returns those inputs' positions among the variables, or None where the graph is left returning them.

    Left as it is: a variable written that is not an input, a result or write that may share a written
    input's memory (its later write would show through), collectives (see `_COLLECTIVE_NAMESPACES`), a
    CUDA-graph mode.
    """
    if compile_options.get("mode") in _CUDA_GRAPH_MODES or not written:
        return None
    position = {v: i for i, v in enumerate(variables)}
    if any(v not in position for v in written):
        return None
    nodes = list(graph.graph.nodes)
    if any(getattr(n.target, "namespace", None) in _COLLECTIVE_NAMESPACES for n in nodes):
        return None
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = nodes[-1]
    values = list(output.args[0])
    n = len(values) - len(written)
    targets = [placeholders[n_tensors + position[v]] for v in written]
    storages = [_storage(t) for t in targets]
    if None in storages or any(_storage(x) in storages for x in values if isinstance(x, torch.fx.Node)):
        return None
    with graph.graph.inserting_before(output):
        for target, value in zip(targets, values[n:]):
            graph.graph.call_function(torch.ops.aten.copy_.default, (target, value))
    output.args = (values[:n],)
    graph.recompile()
    return [position[v] for v in written]


def _storage(node):
    """An id of the memory of `node`'s value in the trace (views share it), or None if it has no tensor value."""
    val = node.meta.get("val")
    return val.untyped_storage()._cdata if isinstance(val, torch.Tensor) else None


def _creator(owner, tracer):
    """A variable creator for the trace: variables are made for real (outside the trace), first trace only."""

    def create(next_creator, **kwargs):
        if owner._initialized:
            raise ValueError(
                f"dtape.function {owner._name()!r} creates a variable again on a later trace (or on every "
                "call); a compiled function may create variables only once, on its first call (TF's rule): "
                "create it outside the function, or once (e.g. `if self.v is None: self.v = dtape.Variable(...)`)")
        init = kwargs["initial_value"]
        if isinstance(init, Tensor):
            init = init.torch()
        if isinstance(init, FakeTensor):
            raise _NeedsEagerCall()
        with disable_proxy_modes_tracing(), unset_fake_temporarily(), trace_scope(None):
            v = next_creator(**kwargs)
        tracer.created.append(v)
        return v
    return create


class _ShapeEnv(ShapeEnv):
    """torch's ShapeEnv, keeping the stack where the trace first fixed a symbolic size (a None dim) to a number."""

    def _set_replacement(self, a, tgt, msg):
        if tgt.is_number:
            self.__dict__.setdefault("fixed", {}).setdefault(a, traceback.extract_stack()[:-1])
        super()._set_replacement(a, tgt, msg)


def _make_fx(owner, body, fakes, dynamic):
    # the symbols of the None dims (sizes the body derives, as from `dtape.shape(x)`, may be fixed)
    symbols = [d.node.expr for f in fakes if isinstance(f, FakeTensor) for d in f.shape if isinstance(d, torch.SymInt)]
    try:
        graph = make_fx(body, tracing_mode="symbolic" if dynamic else "fake", _allow_non_fake_inputs=True)(*fakes)
    except _NeedsEagerCall:
        raise
    except (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException) as e:
        raise _host_read_error(owner, e, "the value of a tensor (float(t), int(t), bool(t) as in `if t:` "
                                         "or `while t:`, a comparison used as a Python bool)") from None
    except RuntimeError as e:
        if "tensor subclasses" in str(e) or "FakeTensor" in str(e):
            raise _host_read_error(owner, e, "a tensor's data on the host (.numpy(), .tolist(), a numpy "
                                             "conversion)") from None
        raise
    fixed = fakes[0].fake_mode.shape_env.__dict__.get("fixed", {}) if symbols else {}
    fixed = next((stack for s, stack in fixed.items() if s in symbols), None)  # the first fixed, in trace order
    if fixed is not None:  # the graph would take any size there and compute with the traced one: never silently
        raise OperatorNotAllowedInGraphError(_host_read_message(
            owner, _user_frame(fixed), "a None dim's size as a Python number (float(x.shape[0]), a size compared "
            "or broadcast against a fixed one), which would fix it to the traced call's size; sizes in tensor "
            "arithmetic (x.shape[0] with tensors, dtape.shape(x)) stay any size. Or declare the size in "
            "input_signature (without reduce_retracing)"))
    return graph


def _user_frame(frames):
    """(file, line, source) of the innermost of `frames` (a traceback's) outside dtape, torch and the stdlib,
    and a note naming the innermost dtape frame below it (where a library function made the read)."""
    note = ""
    for frame in reversed(frames):
        if frame.filename.startswith(_DTAPE_DIR) and not note and not frame.filename.endswith(_TENSOR_FILES):
            note = f" (in {os.path.relpath(frame.filename, os.path.dirname(_DTAPE_DIR.rstrip(os.sep)))}:{frame.lineno}: " \
                   f"`{(frame.line or '').strip()}`)"
        if not frame.filename.startswith(_LIBRARY_DIRS) and not frame.filename.startswith("<"):
            return frame.filename, frame.lineno, (frame.line or "").strip(), note
    return "<unknown>", 0, "", note


def _host_read_error(owner, exc, what):
    return OperatorNotAllowedInGraphError(_host_read_message(
        owner, _user_frame(traceback.extract_tb(exc.__traceback__)),
        f"{what}; while the function is traced its tensors have no values. Use dtape ops on tensors instead "
        "(dtape.where(cond, a, b) for a choice, a mask for a conditional update), move the read out of the "
        "function (return the tensor and read it after the call), or use jit_compile=False"))


def _host_read_message(owner, where, what):
    path, line, source, note = where
    return f"{path}:{line}: `{source}` in dtape.function {owner._name()!r} (jit_compile=True) reads {what}{note}"


class _JitOp(_tp.RecordOp):
    """Record op of one compiled call: its backward runs the compiled VJP graph."""

    __slots__ = ("name", "concrete", "leaves", "ins", "state")
    # Declared as read, so that a walk recorded by a tape watching an input (second order) is not raw:
    # `backward` then sees it and refuses.
    saves_inputs = True
    saves_outputs = False
    raw_saved = True

    def __init__(self, concrete, leaves, ins, state):
        self.name = concrete.owner._name()
        self.concrete, self.leaves, self.ins, self.state = concrete, leaves, ins, state

    def backward(self, dys, outputs, inputs, attrs, raw, needs):
        if not raw and _tp.should_record(list(dys) + list(inputs)):
            raise RuntimeError(
                f"a second-order gradient through compiled dtape.function {self.name!r}: its gradient is a "
                "compiled graph, which the tapes cannot differentiate again; use jit_compile=False for this "
                "function (the eager function supports higher order)")
        dys = [d.torch() if isinstance(d, Tensor) else d for d in dys]
        dys = [torch.zeros(o.shape, dtype=o.dtype, device=o.device) if d is None else d for d, o in zip(dys, outputs)]
        out = self.concrete.vjp(self.leaves, self.ins, self.state, dys)
        return out if raw else [None if g is None else Tensor(g) for g in out]


__all__ = ["JitFunction", "TensorSpec", "OperatorNotAllowedInGraphError", "RETRACE_WARNING_THRESHOLD", "leave_graph",
           "call_eagerly_instead", "replica_function"]
