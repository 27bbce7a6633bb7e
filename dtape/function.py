"""`dtape.function` and `dtape.recompute_grad`: a Python function as one op on the tapes.

Source: tf.function / eager `function.py` (`Function.__call__` reports the
captured variables with `tape.variable_accessed`, seed 2, and records one
op whose inputs are the tensor arguments and the captured variables) and
tf.recompute_grad.

`dtape.function` records its body once, during the call: the caller's tapes
are paused on this thread only (other threads keep recording) and the body
runs under a private inner tape; tapes opened inside the body record as in
eager code. The one op recorded on the outer tapes keeps the inner tape as
its saved state and its backward walks those records, so the body never
runs again: gradients use forward-time values (variables, random masks) and
side effects happen once. When an outer tape records the backward (higher
order), the inner records are first re-recorded ("spliced") onto the
recording tapes, so they learn how the intermediates the rules use depend
on the inputs.

`dtape.recompute_grad` keeps no intermediates: its backward re-runs the body
with the variable values it read and the generator state of the forward.
No compilation here: correctness never depends on `torch.compile`.
`function(fn, jit_compile=True)` is the compiled path instead (`dtape._jit`:
the body traced into one torch graph per input signature, then compiled).
"""
import contextlib
import functools
import threading

import torch

from dtape import _call_context
from dtape import _jit
from dtape import nest
from dtape import random as _random
from dtape import tape as _tp
from dtape.backprop import imperative_grad
from dtape.tensor import Tensor, is_variable
from dtape.variables import current_read_hook, read_hook_scope


class Function:
    """A callable running `python_function` as one recorded op.

    Args:
      python_function: a function of Tensors, Variables, Python values and
        nests of them, returning a Tensor, a nest of Tensors, or other Python values.

    Calling it returns what `python_function` returns (recorded Tensors are
    new objects with the same torch tensors, dtypes and devices). Gradients
    flow to the Tensor arguments (positional and keyword, nests included)
    and to the trainable variables the body reads; tensors the body closes
    over are constants. The body runs once per call; its backward uses the
    values of the forward pass (later `assign`s and random draws do not
    change it). Tapes opened inside the body work as in eager code.

    Source: tf.function (eager semantics, no tracing).

    Example:
      >>> v = dtape.Variable(2.0)
      >>> f = dtape.function(lambda x: x * v)
      >>> with dtape.GradientTape() as tape:
      ...     y = f(dtape.constant(3.0))
      >>> float(tape.gradient(y, v))
      3.0
    """

    def __init__(self, python_function):
        self.python_function = python_function
        functools.update_wrapper(self, python_function)

    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        return type(self)(self.python_function.__get__(instance, owner))

    def __call__(self, *args, **kwargs):
        if not _tp.could_possibly_record() or _tp.accumulating():
            # nothing can record on this thread, or a forward accumulator does: a plain eager call (an
            # accumulator then follows the body's ops one by one, and the tangents of the intermediates
            # that a forward-over-back walk through the body needs exist)
            return self.python_function(*args, **kwargs)
        tensors = _tensor_args(args, kwargs)
        inner = _tp.push_new_tape(persistent=True, watch_accessed_variables=True)
        _tp.stand_in(inner)
        try:
            for t in tensors:
                _tp.watch(inner, t)
            with _tp.capture_variable_reads() as captured, _tp.record_only(inner):
                result = self.python_function(*args, **kwargs)
        finally:
            _tp.pop_tape(inner)  # kept only as the op's saved state
        inputs = _external_inputs(inner, tensors + _report(captured))
        return _record_call(lambda targets: _FunctionOp(self._name(), inner, targets), inputs, result)

    def _name(self):
        return getattr(self.python_function, "__name__", "function")


class _FunctionOp(_tp.RecordOp):
    """Record op of one `Function` call: backward walks the inner tape's records."""

    __slots__ = ("name", "tape", "targets")

    def __init__(self, name, tape, targets):
        self.name = name
        self.tape = tape
        self.targets = targets

    def backward(self, dys, outputs, inputs, attrs, raw, needs):
        # The spliced records' tensors stay alive through the walk, so the outer tapes keep the
        # records (trace deletion) until the walk's recorded ops use them.
        spliced = None if raw else _splice(self.tape)
        grads = _walk(self.tape, self.targets, dys, inputs, raw)
        del spliced
        return grads


def _splice(inner):
    """Re-records `inner`'s records, in forward order, on the tapes recording on this thread.

    A tape records a record only if it watches one of its inputs, so an
    outer tape learns exactly the dependencies of the intermediates on what
    it watches (what differentiating the backward again needs).
    """
    records = inner.records()
    # forward accumulators never saw the body's ops (it ran with them paused): a replay is not an op to them
    with _tp.pause_accumulators():
        for op, in_ids, _, inputs, outputs, attrs in records:
            op.recorded_again()
            _tp.record_reading(op, in_ids, inputs, outputs, attrs)  # a read in the body: a sibling replica's tape skips it
    return records


def _walk(inner, targets, dys, inputs, raw):
    """Input gradients from `inner`'s records: the walk type (torch in a raw walk), None if unconnected."""
    pairs = [(t, d) for t, d in zip(targets, dys) if _is_float(t)]
    grads = imperative_grad(inner, [t for t, _ in pairs], list(inputs), [d for _, d in pairs])
    return [g.torch() if raw and g is not None else g for g in grads]


def _external_inputs(inner, inputs):
    """`inputs`, then every Tensor or variable the body's records consume without producing it.

    The latter are variables read on other threads inside the body (the
    replicas of a `strategy.run` it calls) and explicitly watched ones; as
    inputs of the one recorded op they connect the caller's tapes to them.
    """
    seen = {x._id for x in inputs}
    out = list(inputs)
    produced = set()
    for _, in_ids, out_ids, ins, _, _ in inner.records():
        for i, x in zip(in_ids, ins):
            if i is not None and i not in produced and i not in seen and (isinstance(x, Tensor) or is_variable(x)):
                seen.add(i)
                out.append(x)
        produced.update(out_ids)
    return out


def _tensor_args(args, kwargs):
    """The distinct Tensors in the arguments (a repeated one is one input, so its gradient is not doubled)."""
    seen, out = set(), []
    for x in nest.flatten((args, kwargs)):
        if isinstance(x, Tensor) and x._id not in seen:
            seen.add(x._id)
            out.append(x)
    return out


def _report(captured):
    """Reports the captured variables to the tapes (the resolver picks container or components);
    returns their handles."""
    variables = list(captured.values())
    for v in variables:
        _tp.variable_accessed(v)
    return [v._handle() for v in variables]


def _record_call(make_op, inputs, result):
    """Records one op `make_op(body_result_tensors)` from `inputs` to new output Tensors.

    Returns `result` unchanged when no tape recording on this thread watches
    an input (nothing is kept).
    """
    leaves = nest.flatten(result)
    targets = [y for y in leaves if isinstance(y, Tensor)]
    if not targets or not _tp.should_record(inputs):
        return result
    outputs = [Tensor(y.torch()) if isinstance(y, Tensor) else y for y in leaves]
    recorded = tuple(o for o in outputs if isinstance(o, Tensor))
    _tp.record_reading(make_op(targets), tuple([x._id for x in inputs]), tuple(inputs), recorded, None)
    return nest.pack_sequence_as(result, outputs)


def _is_float(t):
    return t.dtype.is_floating_point or t.dtype.is_complex


def function(fn=None, jit_compile=False, input_signature=None, reduce_retracing=False, backend="inductor",
             compile_options=None, **options):
    """Wraps `fn` as a `Function` (usable as `@dtape.function` or `@dtape.function(...)`).

    Args:
      fn: the Python function to run as one unit.
      jit_compile: False (default): `fn` runs eagerly as one recorded op
        (`Function`). True: `fn` is traced once per input signature into one
        torch graph (forward, every `tape.gradient` inside, variable writes)
        and compiled with `torch.compile` (`dtape._jit.JitFunction`); a
        body calling `strategy.run` runs eagerly around the replica function
        compiled (see `JitFunction`).
      input_signature, reduce_retracing: tf.function's, for `jit_compile=True`:
        a list of `dtape.TensorSpec` (None dims: any size), or generalise
        shapes after a retrace instead of tracing every shape.
      backend, compile_options: `torch.compile`'s backend ("inductor",
        "aot_eager", "eager", ...) and extra keyword arguments (e.g.
        `{"mode": "reduce-overhead"}`), for `jit_compile=True`.
      **options: other tf.function arguments (e.g. `autograph`), accepted and ignored.

    Returns:
      A `Function` (eager) or a `JitFunction` (compiled), each with
      `.python_function` the original `fn`.

    Source: tf.function.
    """
    def wrap(f):
        if not jit_compile:
            return Function(f)
        return _jit.JitFunction(f, input_signature=input_signature, reduce_retracing=reduce_retracing,
                                backend=backend, compile_options=compile_options, eager_call=Function(f))
    if fn is None:
        return wrap
    return wrap(fn)


class _Recompute(Function):
    """A `Function` whose backward re-runs the body instead of keeping its records (see `recompute_grad`)."""

    def __call__(self, *args, **kwargs):
        if not _tp.could_possibly_record():
            return self.python_function(*args, **kwargs)
        generator = _random.get_generator()
        rng_state = generator.get_state()
        read = {}
        # record_only(None): the caller's tapes pause on this thread; tapes opened in the body record
        with _tp.capture_variable_reads() as captured, _tp.record_only(None), \
                read_hook_scope(_snapshot_reads(read)):
            result = self.python_function(*args, **kwargs)
        handles = _report(captured)
        rng_end = generator.get_state()
        forward = (args, kwargs, read, generator.device, rng_state, rng_end, threading.get_ident(),
                   _call_context.current_training())
        return _record_call(lambda targets: _RecomputeOp(self, forward),
                            _tensor_args(args, kwargs) + handles, result)


def _snapshot_reads(read):
    """A read hook keeping each variable's first-read torch value in `read` (id -> (variable, value)).

    Chains to an enclosing hook, so nested recomputes see the same values.
    `assign` replaces a variable's tensor, so holding it is a snapshot.
    """
    prev = current_read_hook()

    def hook(variable, value):
        if prev is not None:
            value = prev(variable, value)
        read.setdefault(id(variable), (variable, value))
        return value
    return hook


def _replay_reads(read):
    """A read hook giving the variables read in the forward their forward-time values."""
    prev = current_read_hook()

    def hook(variable, value):
        saved = read.get(id(variable))
        if saved is not None:
            return saved[1]
        return value if prev is None else prev(variable, value)
    return hook


class _RecomputeOp(_tp.RecordOp):
    """Record op of one `recompute_grad` call: backward re-runs the body, then walks it."""

    __slots__ = ("name", "function", "forward")

    def __init__(self, function, forward):
        self.name = function._name()
        self.function = function
        self.forward = forward

    def backward(self, dys, outputs, inputs, attrs, raw, needs):
        tape = _tp.push_new_tape(persistent=False, watch_accessed_variables=False)
        try:
            targets = self._rerun(tape, inputs, raw)
        finally:
            _tp.pop_tape(tape)
        return _walk(tape, targets, dys, inputs, raw)

    def _rerun(self, tape, inputs, raw):
        """Runs the body again on `tape` (watching every input) with the forward's reads and RNG state.

        In a raw walk only `tape` records; otherwise the outer tapes record
        the re-run too, which connects the gradients for higher order.
        """
        args, kwargs, read, device, rng_state, rng_end, thread, training = self.forward
        if threading.get_ident() != thread:
            raise RuntimeError(
                f"recompute_grad({self.name}): the block ran on another thread (e.g. a replica of strategy.run) "
                "than the one taking its gradient; re-running it here would read other variable components. "
                "Take the gradient on the thread that ran the block (open the tape inside the replica "
                "function), or use dtape.function, which keeps the forward's records")
        generator = torch.Generator(device=device)  # private clone: the caller's generator is untouched
        generator.set_state(rng_state)
        for x in inputs:
            _tp.watch(tape, x)
        # The forward's layer-call mode too: a Dropout inside must drop again when the gradient is taken
        # outside `model(x, training=True)`.
        with (_tp.record_only(tape) if raw else contextlib.nullcontext()), read_hook_scope(_replay_reads(read)), \
                _random.generator_scope(generator), _call_context.training_scope(training):
            result = self.function.python_function(*args, **kwargs)
        if not torch.equal(generator.get_state(), rng_end):
            raise RuntimeError(
                f"recompute_grad({self.name}): the re-run drew different random numbers than the forward "
                "(e.g. a layer built lazily inside the block drew its initial weights in the forward only); "
                "build the layers before the first call, or use dtape.function")
        return [y for y in nest.flatten(result) if isinstance(y, Tensor)]


def recompute_grad(fn):
    """Wraps `fn` so that its backward recomputes the body instead of keeping intermediates.

    Args:
      fn: a function of Tensors, Variables, Python values and nests of them,
        returning a Tensor or a nest of Tensors (as for `dtape.function`).

    Returns:
      A callable with `fn`'s signature and value. On the tapes it is one op
      whose inputs are the Tensor arguments and the trainable variables the
      body reads; it saves only the arguments and the forward-time variable
      values. The backward re-runs `fn` with those values and with the
      forward's layer-call `training` mode (Keras's call context) and the
      forward's state of this thread's generator (`dtape.random.get_generator()`
      of the current device; dropout and `dtape.random` then draw the same
      numbers), on a private generator clone, so other threads are
      undisturbed. Draws from other generators (torch's global RNG called
      directly, another device's, a seeded `layers.Dropout`'s own stream) are
      not replayed, and side effects in the body (assignments, lazy layer
      builds) happen again in the backward: keep `fn` free of them.

    Raises (in the backward):
      RuntimeError: the gradient is taken on another thread than the one
        that ran the block (e.g. a tape on the main thread around a block run
        inside `strategy.run`), or the re-run drew a different amount from
        the generator than the forward (e.g. a layer built inside the block).

    Source: tf.recompute_grad.

    Example:
      >>> block = dtape.recompute_grad(lambda x: dtape.tanh(x) * 2.0)
      >>> x = dtape.constant(0.0)
      >>> with dtape.GradientTape() as tape:
      ...     tape.watch(x)
      ...     y = block(x)
      >>> float(tape.gradient(y, x))
      2.0
    """
    return _Recompute(fn)


__all__ = ["function", "Function", "recompute_grad"]
