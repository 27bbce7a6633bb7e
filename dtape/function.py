"""`dtape.function`: run a Python function as one unit on the tapes.

Source: tf.function / eager `function.py` (`Function.__call__` reports the
captured variables with `tape.variable_accessed`, seed 2, and records one
op). The body runs under `stop_recording()` inside `capture_variable_reads()`;
the one recorded op's backward re-runs the body under a private tape and
differentiates it, so it composes with outer tapes for higher order. No
compilation: correctness never depends on `torch.compile`.
"""
import functools

import torch

from dtape import nest
from dtape import tape as _tp
from dtape.backprop import imperative_grad
from dtape.tensor import Tensor


class Function:
    """A callable running `python_function` as one recorded op.

    Args:
      python_function: a function of Tensors, Variables, Python values and
        nests of them, returning a Tensor, a nest of Tensors, or other Python values.

    Calling it returns what `python_function` returns (Tensors are new
    objects). Gradients flow to the Tensor arguments (positional and keyword,
    nests included) and to the trainable variables the body reads; tensors
    the body closes over are constants. The body is re-run in the backward
    pass with the same torch random state (dropout masks agree).

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
        return Function(self.python_function.__get__(instance, owner))

    def __call__(self, *args, **kwargs):
        rng = _rng_state() if _tp._tape_set else None
        with _tp.capture_variable_reads() as captured, _tp.stop_recording():
            result = self.python_function(*args, **kwargs)
        variables = list(captured.values())
        for v in variables:  # same path as plain reads: the resolver picks container or components
            _tp.variable_accessed(v)
        if not _tp._tape_set:
            return result
        return self._record(args, kwargs, variables, result, _rng_if_used(rng))

    def _record(self, args, kwargs, variables, result, rng):
        tensors = [x for x in nest.flatten((args, kwargs)) if isinstance(x, Tensor)]
        handles = [v._handle() for v in variables]
        leaves = nest.flatten(result)
        outputs = [Tensor(y.torch()) if isinstance(y, Tensor) else y for y in leaves]
        recorded = tuple(o for o in outputs if isinstance(o, Tensor))
        if recorded:
            op = _FunctionOp(self, args, kwargs, len(tensors), rng)
            inputs = tuple(tensors) + tuple(handles)
            _tp.record(op, tuple([x._id for x in inputs]), inputs, recorded, None)
        return nest.pack_sequence_as(result, outputs)


class _FunctionOp:
    """Record op of one `Function` call; backward differentiates a re-run of the body."""

    __slots__ = ("name", "function", "args", "kwargs", "n_tensors", "rng")

    def __init__(self, function, args, kwargs, n_tensors, rng):
        self.name = getattr(function.python_function, "__name__", "function")
        self.function = function
        self.args = args
        self.kwargs = kwargs
        self.n_tensors = n_tensors
        self.rng = rng

    def backward(self, dys, outputs, inputs, attrs, raw):
        if raw:
            dys = [Tensor(d) for d in dys]
        inner = _tp.push_new_tape(persistent=False, watch_accessed_variables=False)
        try:
            targets = self._rerun(inner, inputs, raw)
        finally:
            _tp.pop_tape(inner)
        pairs = [(t, d) for t, d in zip(targets, dys) if _is_float(t)]
        grads = imperative_grad(inner, [t for t, _ in pairs], list(inputs), [d for _, d in pairs])
        return [g.torch() if raw and g is not None else g for g in grads]

    def _rerun(self, inner, inputs, raw):
        """Runs the body again, recorded on `inner` (watching every input), with the saved RNG state.

        In a raw walk nothing else records; otherwise the outer tapes record
        the re-run too, which connects the gradients for higher order.
        """
        inner._watch_ids([x._id for x in inputs])
        with (_tp.record_only(inner) if raw else _nullcontext()), _restored_rng(self.rng):
            result = self.function.python_function(*self.args, **self.kwargs)
        return [y for y in nest.flatten(result) if isinstance(y, Tensor)]


class _nullcontext:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _is_float(t):
    return t.dtype.is_floating_point or t.dtype.is_complex


def _rng_state():
    """The CPU and initialised CUDA random states (for a faithful re-run)."""
    cuda = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _rng_if_used(before):
    """`before` if the body drew random numbers, else None (the re-run then needs no RNG swap)."""
    if before is None:
        return None
    after = _rng_state()
    same_cpu = torch.equal(before[0], after[0])
    same_cuda = (before[1] is None) == (after[1] is None) and all(
        torch.equal(a, b) for a, b in zip(before[1] or (), after[1] or ()))
    return None if same_cpu and same_cuda else before


class _restored_rng:
    """Sets the saved RNG state, restores the previous one on exit.

    Process-wide (torch's default generators are global): concurrent re-runs
    of random bodies on several threads may interleave their draws.
    """

    __slots__ = ("_saved", "_prev")

    def __init__(self, saved):
        self._saved = saved

    def __enter__(self):
        if self._saved is not None:
            self._prev = _rng_state()
            _set_rng_state(self._saved)
        return self

    def __exit__(self, *exc):
        if self._saved is not None:
            _set_rng_state(self._prev)
        return False


def _set_rng_state(state):
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for i, s in enumerate(cuda or ()):
        torch.cuda.set_rng_state(s, i)


def function(fn=None, **options):
    """Wraps `fn` as a `Function` (usable as `@dtape.function` or `@dtape.function()`).

    Args:
      fn: the Python function to run as one unit.
      **options: accepted for tf.function compatibility (e.g. `jit_compile`);
        ignored, nothing is compiled.

    Returns:
      A `Function` with `.python_function` the original `fn`.

    Source: tf.function.
    """
    if fn is None:
        return lambda f: Function(f)
    return Function(fn)


__all__ = ["function", "Function"]
