"""`dtape.custom_gradient`: a function recorded as one op with a user gradient.

Source: tf.custom_gradient (eager mode, `_eager_mode_decorator`). As in TF
eager, the body runs with the tapes recording, so the intermediates that
`grad_fn` closes over (`e = exp(x)` in TF's `log1pexp`) stay connected to
the inputs and a tape recording the backward walk differentiates `grad_fn`
through them (higher order). The outputs are then rewired as TF does with
its `identity` + `record_operation`: the caller gets new tensors (new ids)
whose only producer on the tapes is the custom op from the inputs, so the
body's records give no second path from the outputs to the inputs and a
first-order gradient is exactly `grad_fn`'s. The body's records of tensors
that die (its own outputs) are dropped by trace deletion; those `grad_fn`
keeps alive stay as long as the custom op's record does. The trainable
variables the body reads are extra inputs of that op, so their gradients
come from `grad_fn(..., variables=...)`.
"""
import functools
import inspect

from dtape import nest
from dtape import tape as _tp
from dtape.tensor import Tensor, convert_to_tensor, is_variable


def custom_gradient(f):
    """Decorator: `f(*x)` returns `(y, grad_fn)`; `grad_fn` defines the gradient of `y`.

    Args:
      f: a function of tensors (Tensors, Variables, Python scalars, nests)
        returning `(y, grad_fn)`, `y` a Tensor or a nest of Tensors.
        `grad_fn(*dys)` gets one upstream gradient per leaf of `y` (same
        shape and dtype) and returns one gradient per leaf of the positional
        arguments (None allowed). If `f` reads trainable variables (other
        than its arguments), `grad_fn(*dys, variables=vars)` must return
        `(input_grads, variable_grads)`, one per variable in `vars`.

    Returns:
      A function with `f`'s arguments returning `y`. The body runs with the
      tapes recording (as in TF eager), but `y` is produced on the tapes by
      one op named after `f` from the inputs, so gradients of `y` come from
      `grad_fn` only; higher order through `grad_fn` works when `grad_fn` is
      written with dtape ops, on its arguments or on tensors of the body it
      closes over (the backward walk records it on outer tapes).

    Raises:
      TypeError: if `f` reads variables and `grad_fn` takes no `variables`.
      ValueError: if `grad_fn` returns the wrong number of gradients, or one of
        a shape that does not reduce to its input's (at `gradient()`).

    Source: tf.custom_gradient.

    Example:
      >>> @dtape.custom_gradient
      ... def log1pexp(x):
      ...     e = dtape.exp(x)
      ...     return dtape.log(1 + e), lambda dy: dy * (1 - 1 / (1 + e))
    """
    @functools.wraps(f)
    def decorated(*args, **kwargs):
        return _call(f, args, kwargs)
    return decorated


def _call(f, args, kwargs):
    with _tp.capture_variable_reads() as captured:
        result, grad_fn = f(*args, **kwargs)
    flat_args = nest.flatten(args)
    variables = [v for v in captured.values() if not any(v is a for a in flat_args)]
    for v in variables:  # report them as plain reads would (the resolver decides container/components)
        _tp.variable_accessed(v)
    if not _tp.active_tapes:
        return result
    _check_variables_arg(f, grad_fn, variables)
    inputs = tuple(_as_input(a) for a in flat_args) + tuple(v._handle() for v in variables)
    # New Tensors (new ids) over the body's values: the custom op is their only producer.
    flat_out = [Tensor(convert_to_tensor(y).torch()) for y in nest.flatten(result)]
    op = CustomGradientOp(getattr(f, "__name__", "custom_gradient"), grad_fn, variables, len(flat_args))
    _tp.record(op, tuple([getattr(x, "_id", None) for x in inputs]), inputs, tuple(flat_out), None)
    return nest.pack_sequence_as(result, flat_out)


def _as_input(a):
    """A Tensor for tensor-like arguments (a Variable is read, so recorded); others as is."""
    if isinstance(a, Tensor) or is_variable(a):
        return convert_to_tensor(a)
    return a


def _check_variables_arg(f, grad_fn, variables):
    if not variables:
        return
    try:
        params = inspect.signature(grad_fn).parameters
    except (TypeError, ValueError):
        return
    if "variables" not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        names = [getattr(v, "name", "?") for v in variables]
        raise TypeError(f"@dtape.custom_gradient grad_fn of {getattr(f, '__name__', f)!r} must accept "
                        f"keyword argument 'variables', since the function uses variables: {names}")


class CustomGradientOp(_tp.RecordOp):
    """Record op of one custom-gradient call: `backward` calls the user's grad_fn."""

    __slots__ = ("name", "grad_fn", "variables", "n_args")

    def __init__(self, name, grad_fn, variables, n_args):
        self.name = name
        self.grad_fn = grad_fn
        self.variables = variables
        self.n_args = n_args

    def backward(self, dys, outputs, inputs, attrs, raw, needs):
        if raw:
            dys = [Tensor(d) for d in dys]
        grads = self._user_grads(dys)
        return [_tp.to_walk_grad(g, raw) for g in grads]

    def _user_grads(self, dys):
        if self.variables:
            input_grads, var_grads = self.grad_fn(*dys, variables=self.variables)
            var_grads = list(var_grads)
            if len(var_grads) != len(self.variables):
                raise ValueError(f"custom_gradient {self.name!r}: grad_fn returned {len(var_grads)} variable "
                                 f"gradients for {len(self.variables)} variables; return one per variable")
        else:
            input_grads, var_grads = self.grad_fn(*dys), []
        flat = nest.flatten(input_grads)
        if len(flat) != self.n_args:
            raise ValueError(f"custom_gradient {self.name!r}: grad_fn returned {len(flat)} gradients for "
                             f"{self.n_args} inputs; return one per positional argument (None allowed)")
        return flat + var_grads


__all__ = ["custom_gradient"]
