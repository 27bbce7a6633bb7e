"""OpDef and `defop`: one block per op, forward and gradient side by side.

Call path of an op: normalise inputs -> forward on torch tensors (they never
require grad, so torch builds no graph) -> wrap -> record on the tapes that
watch an input. Gradient rules are written with `torch` functions and
operators only, so the same rule runs on raw torch tensors when nothing
records (the fast path) and on dtape.Tensors, through `__torch_function__`,
when an outer tape records the backward pass (higher order).

The registry is keyed by OpDef object; names serve messages only.
"""
import inspect

import torch

from dtape import _sizes
from dtape import tape as _tp
from dtape.tensor import Tensor, convert_to_tensor, is_tracing

# Process-wide, filled at import time only (not thread-safe to mutate later).
REGISTRY = []          # every OpDef, in definition order
TORCH_TABLE = {}       # torch callable -> handler taking torch's own arguments

_SCALARS = (int, float, bool)
# What a gradient rule reads, so what a record keeps alive (PyTorch's derivatives.yaml): "all" inputs
# and outputs, only the "inputs", only the "output(s)", or "none" (shapes, dtypes and devices only),
# as (saves_inputs, saves_outputs) of the record op. "other_input" (matmul) and "denominator" (divide)
# are "inputs" for binary rules taking `needs` that read the first input only for the second's
# gradient: with a Python number as the second input, that gradient is never asked, and nothing is kept.
_SAVES = {"all": (True, True), "inputs": (True, False), "output": (False, True), "none": (False, False),
          "other_input": (True, False), "denominator": (True, False)}


class OpDef(_tp.RecordOp):
    """An op: its forward on torch tensors and its gradient rule.

    `grad_fn(dy, ans, *inputs, **attrs)` returns one gradient per tensor
    input (a bare value when there is one input); for multi-output ops `dy`
    and `ans` are tuples. `jvp_fn(tangents, ans, *inputs, **attrs)`, when the
    op's block gives one (`@op.jvp`), returns the output tangent (a tuple for
    multi-output ops); `tangents` is one per input, None for an input
    without one (a bare value when there is one input). Without it, forward
    mode derives the tangents from `grad_fn` (dtape.autodiff).
    """

    __slots__ = ("name", "forward", "n_in", "list_input", "grad_fn", "jvp_fn", "samples",
                 "second_order", "multi_output", "attr_names", "in_names", "fn", "takes_needs", "saves",
                 "saves_inputs", "saves_outputs", "complex_grad", "stash", "with_number")

    # The raw walk passes the saved torch tensors (and metadata) to `backward` as they are.
    raw_saved = True

    def __init__(self, name, forward, n_in, list_input, samples, second_order, multi_output, saves="all",
                 complex_grad=False, stash=False):
        self.name = name
        self.stash = stash
        self.complex_grad = complex_grad
        self.forward = forward
        self.n_in = n_in
        self.list_input = list_input
        self.grad_fn = None
        self.jvp_fn = None
        self.takes_needs = False
        self.samples = samples
        self.second_order = second_order
        self.multi_output = multi_output
        if saves not in _SAVES:
            raise ValueError(f"op {name}: saves={saves!r}; expected one of {tuple(_SAVES)}")
        self.saves = saves
        self.saves_inputs, self.saves_outputs = _SAVES[saves]
        # the record op when the second input is a Python number (see _SAVES)
        self.with_number = _WithNumber(self) if saves in ("other_input", "denominator") else self
        params = list(inspect.signature(forward).parameters)
        self.attr_names = tuple(params[1 if list_input else n_in:])
        self.in_names = tuple(params[:1 if list_input else n_in])
        self.fn = None

    def grad(self, fn):
        """Decorator: registers `fn` as this op's gradient rule.

        A rule with a `needs` parameter receives a tuple of bools, one per
        input, and may return None for inputs that need no gradient.
        """
        self.grad_fn = fn
        self.takes_needs = "needs" in inspect.signature(fn).parameters
        return fn

    def def_jvp(self, fn):
        """Decorator: registers `fn` as this op's forward-mode rule (see the class docstring).

        Written with torch functions and operators on dtape.Tensors, as
        gradient rules are, so a tape watching the tangents records it.
        """
        self.jvp_fn = fn
        return fn

    def jvp(self, tangents, outputs, inputs, attrs):
        if self.jvp_fn is None:
            return NotImplemented
        ans = tuple(outputs) if self.multi_output else outputs[0]
        if self.list_input:
            inputs, tangents = (list(inputs),), list(tangents)
        elif self.n_in == 1:
            tangents = tangents[0]
        out = self.jvp_fn(tangents, ans, *inputs, **attrs) if attrs else self.jvp_fn(tangents, ans, *inputs)
        return tuple(out) if self.multi_output else (out,)

    def backward(self, dys, outputs, inputs, attrs, raw, needs):
        """Input gradients; `inputs`/`outputs` are what the record saved (torch tensors on the raw
        walk, dtape.Tensors otherwise), or shape/dtype/device metadata for what `saves` leaves out."""
        if self.multi_output:
            dy, ans = tuple(dys), tuple(outputs)
        else:
            dy, ans = dys[0], outputs[0]
        if self.list_input:
            inputs = (list(inputs),)
        if self.takes_needs:
            grads = self.grad_fn(dy, ans, *inputs, needs=needs, **attrs) if attrs else \
                self.grad_fn(dy, ans, *inputs, needs=needs)
        else:
            grads = self.grad_fn(dy, ans, *inputs, **attrs) if attrs else self.grad_fn(dy, ans, *inputs)
        return (grads,) if self.n_in == 1 and not self.list_input else grads

    def __repr__(self):
        return f"<OpDef {self.name}>"


class _WithNumber(_tp.RecordOp):
    """An op whose rule reads its first input only for the second's gradient, recorded with a Python
    number as the second input: that gradient is never asked, so the record keeps no tensor
    (`scores / scale` keeps nothing)."""

    __slots__ = ("opdef",)
    saves_inputs = saves_outputs = False
    raw_saved = True

    def __init__(self, opdef):
        self.opdef = opdef

    @property
    def name(self):
        return self.opdef.name

    @property
    def complex_grad(self):
        return self.opdef.complex_grad

    def backward(self, dys, outputs, inputs, attrs, raw, needs):
        return self.opdef.backward(dys, outputs, inputs, attrs, raw, needs)

    def jvp(self, tangents, outputs, inputs, attrs):
        return self.opdef.jvp(tangents, outputs, inputs, attrs)


class _KernelValue(_tp.RecordOp):
    """Record op of `kernel_value`: the gradient passes straight to the composite formula."""

    __slots__ = ()
    name = "kernel_value"
    saves_inputs = saves_outputs = False
    raw_saved = True

    def backward(self, dys, outputs, inputs, attrs, raw, needs):
        return dys

    def jvp(self, tangents, outputs, inputs, attrs):
        return tangents


_KERNEL_VALUE = _KernelValue()


def kernel_value(composite, value):
    """A recorded walk's gradient with the bits of the raw walk's fused kernel and the composite's derivatives.

    A rule that uses a fused torch kernel on the raw walk (`tanh_backward`)
    must give the same bits when a tape records the walk, or a walk's
    result would depend on which other tapes exist. There it returns
    `kernel_value(composite, kernel(raw tensors))`: a Tensor holding
    `value`, recorded as an identity of `composite` (the same function
    written in differentiable ops), so higher orders differentiate the
    composite.

    Args:
      composite: the dtape.Tensor the recorded formula gives.
      value: the fused kernel's torch.Tensor, same shape and dtype.
    """
    out = Tensor(value)
    if _tp.active_tapes:
        _tp.record(_KERNEL_VALUE, (composite._id,), (composite,), (out,), None)
    return out


def tangent_sum(*terms):
    """The sum of the tangent terms that are not None (None when all are): a forward rule's inputs
    without a tangent contribute nothing."""
    total = None
    for t in terms:
        if t is not None:
            total = t if total is None else total + t
    return total


def tangents_or_zeros(tangents, inputs):
    """Each input's tangent, zeros of its shape where it has none (rules that place tangents side by side)."""
    return [torch.zeros_like(x) if t is None else t for t, x in zip(tangents, inputs)]


def as_input(x, opdef=None):
    """A Tensor or Python scalar for an op input of `opdef` (variables are read here)."""
    if type(x) is Tensor or type(x) in _SCALARS:
        return x
    return _converted(x, opdef)


def _converted(x, opdef=None):
    """`convert_to_tensor(x)` for an op input that is no Tensor; refuses a torch tensor in torch's autograd
    while a tape records (`check_no_autograd_input`), except as the input of an op without a gradient rule
    (`stop_gradient`, `argmax`, `equal`): no tape records it, so no gradient is lost (a constant meant)."""
    if isinstance(x, torch.Tensor) and (opdef is None or opdef.grad_fn is not None):
        check_no_autograd_input(x)
    return convert_to_tensor(x)


def _autograd_origin(t):
    return "a leaf, such as a parameter" if t.grad_fn is None else f"computed by torch's {type(t.grad_fn).__name__}"


def check_no_autograd_input(t):
    """Raises TypeError if torch tensor `t` is a parameter of a module a TorchModule wraps, or torch computed
    it from one (`sum(p.pow(2).sum() for p in net.parameters())`), while a tape records with torch's grad
    mode on.

    A tape sees no torch autograd graph: `t` would enter as a constant, and the
    wrapped parameters behind it would get no gradient from this use, silently.
    A torch module left unwrapped (an attacked classifier, a fixed loss
    network) is a constant function, as before: no dtape variable is behind it.
    """
    if t.requires_grad and _tp.active_tapes and _tp.recording_tapes() and _behind_wrapped_parameter(t):
        raise TypeError(
            f"a torch.Tensor that requires grad (shape {tuple(t.shape)}, {_autograd_origin(t)}) "
            "entered a dtape op while a GradientTape records: tapes do not see torch's autograd graph, so it "
            "would be a constant and the parameters behind it would get no gradient from this use. A wrapped "
            "module's parameters are its TorchModule's variables (the same memory): compute with those (an L2 "
            "penalty as sum(dtape.reduce_sum(v ** 2) for v in tm.trainable_variables)) or inside the module's "
            "forward (a tied head, a logit scale); or .detach() it if it is meant as a constant")


def _behind_wrapped_parameter(t):
    """True if `t` is a wrapped module's parameter (marked by TorchModule) or torch's graph of `t` reaches
    one. Runs only for a torch tensor that requires grad entering a taped op, not on dtape's own path."""
    if t.grad_fn is None:
        return getattr(t, "_dtape_wrapped", False)
    seen, level = set(), [t.grad_fn]
    while level:
        following = []
        for node in level:
            if node is None or node in seen:
                continue
            seen.add(node)
            if getattr(getattr(node, "variable", None), "_dtape_wrapped", False):  # an AccumulateGrad leaf
                return True
            following.extend(n for n, _ in node.next_functions)
        level = following
    return False


def _raw(x):
    return x._t if type(x) is Tensor else x


def _wrap(out, opdef):
    if isinstance(out, torch.Tensor):
        return (Tensor(out),)
    if isinstance(out, (tuple, list)):
        return tuple(Tensor(o) for o in out)
    raise TypeError(f"op {opdef.name}: forward returned {type(out).__name__}, expected torch.Tensor(s)")


def _attrs(opdef, args, attrs):
    if len(args) > len(opdef.attr_names):
        raise TypeError(f"{opdef.name}() takes {len(opdef.attr_names)} non-tensor arguments after "
                        f"its tensor inputs, got {len(args)}")
    if args:
        attrs = dict(attrs)
        attrs.update(zip(opdef.attr_names, args))
    return attrs


def _pop_input(opdef, attrs, i):
    """Tensor input `i` given by keyword (TF style, e.g. `logits=`)."""
    name = opdef.in_names[i]
    if name not in attrs:
        raise TypeError(f"{opdef.name}() missing its tensor argument {name!r}")
    return attrs.pop(name)


def _make_unary(opdef):
    fwd = opdef.forward

    def call(x=None, *args, name=None, **attrs):  # noqa: ARG001 - TF's op name: eager TF ignores it too
        if type(x) is not Tensor:
            if x is None:
                x = _pop_input(opdef, attrs, 0)
            x = _converted(x, opdef)
        if args:
            attrs = _attrs(opdef, args, attrs)
        out = fwd(x._t, **attrs) if attrs else fwd(x._t)
        if isinstance(out, torch.Tensor):
            out = Tensor(out)
            if _tp.active_tapes and opdef.grad_fn is not None:
                _tp.record(opdef, (x._id,), (x,), (out,), attrs or None)
            return out
        return _finish_multi(opdef, out, (x,), attrs)
    return call


def _make_binary(opdef):
    fwd = opdef.forward

    def call(x=None, y=None, *args, name=None, **attrs):  # noqa: ARG001 - TF's op name, ignored
        if type(x) is not Tensor:
            x = as_input(_pop_input(opdef, attrs, 0) if x is None else x, opdef)
        if type(y) is not Tensor:
            y = as_input(_pop_input(opdef, attrs, 1) if y is None else y, opdef)
            if type(x) is not Tensor and type(y) is not Tensor:
                x = convert_to_tensor(x)
        if type(x) is not Tensor:  # scalar first: torch functions want a tensor `input`
            x = _scalar_beside(x, y)
        if args:
            attrs = _attrs(opdef, args, attrs)
        a = x._t if type(x) is Tensor else x
        b = y._t if type(y) is Tensor else y
        out = fwd(a, b, **attrs) if attrs else fwd(a, b)
        if isinstance(out, torch.Tensor):
            out = Tensor(out)
            if _tp.active_tapes and opdef.grad_fn is not None:
                _tp.record(opdef if type(y) is Tensor else opdef.with_number,
                           (getattr(x, "_id", None), getattr(y, "_id", None)), (x, y), (out,), attrs or None)
            return out
        return _finish_multi(opdef, out, (x, y), attrs)
    return call


def _scalar_beside(s, t):
    """A Python scalar `s` as a 0-d Tensor of torch's promoted dtype (as `t op s`) on t's device.

    Binary forwards and rules get a Python scalar only as their second input
    (torch's `other`); a scalar first input becomes this tensor.
    """
    value = torch.as_tensor(s, dtype=torch.result_type(t._t, s), device=t._t.device)
    if _sizes.traced and type(s) is int and is_tracing():  # `2 * dtape.shape(x)[1]` traced: a size too
        _sizes.carry(value, s)
    return Tensor(value)


def _finish_multi(opdef, out, inputs, attrs):
    outs = _wrap(out, opdef)
    if _tp.active_tapes and opdef.grad_fn is not None:
        _tp.record(opdef, tuple([getattr(x, "_id", None) for x in inputs]), inputs, outs, attrs or None)
    return outs if opdef.multi_output else outs[0]


def _make_nary(opdef):
    fwd, n, listed = opdef.forward, opdef.n_in, opdef.list_input

    def call(*args, name=None, **attrs):  # noqa: ARG001 - TF's op name, ignored
        if len(args) < (1 if listed else n) and any(k in attrs for k in opdef.in_names):
            args = _keyword_inputs(opdef, args, attrs)
        if listed:
            if not isinstance(args[0], (list, tuple)):
                raise TypeError(f"{opdef.name}: first argument must be a list of tensors, got {type(args[0]).__name__}")
            inputs = tuple(v if type(v) is Tensor else _converted(v, opdef) for v in args[0])
            attrs = _attrs(opdef, args[1:], attrs)
            raw = fwd([t._t for t in inputs], **attrs)
        else:
            inputs = tuple(as_input(v, opdef) for v in args[:n])
            attrs = _attrs(opdef, args[n:], attrs)
            raw = fwd(*[_raw(t) for t in inputs], **attrs)
        if opdef.stash:  # (result, what the forward computed for the rule): the latter rides in the record's attrs
            raw, stash = raw
            if _tp.active_tapes:
                attrs = dict(attrs, stash=stash)
        return _finish_multi(opdef, raw, inputs, attrs)
    return call


def _keyword_inputs(opdef, args, attrs):
    attrs_defaults = inspect.signature(opdef.forward).parameters
    extra = [attrs.pop(k) if k in attrs else attrs_defaults[k].default
             for k in opdef.in_names[len(args):]]
    return tuple(args) + tuple(extra)


def defop(n_in=1, list_input=False, torch_fns=(), samples=None, second_order=True,
          multi_output=False, name=None, saves="all", complex_grad=False, stash=False):
    """Declares an op from its forward on torch tensors; returns the public function.

    Args:
      n_in: number of leading tensor arguments (ignored with `list_input`).
      list_input: the first argument is a list of tensors (concat, stack, add_n).
      torch_fns: torch callables whose calls on dtape tensors run this op.
        Each entry is a callable (same arguments as the op) or a pair
        `(torch_fn, adapter)` where `adapter` takes torch's arguments.
      samples: `f(rng) -> list of (args, attrs)` float64 inputs for the registry test.
      second_order: False when the rule is not differentiable again.
      multi_output: forward returns a tuple of tensors.
      saves: what the gradient rule reads of the tensors: "all", "inputs",
        "output" or "none"; for binary rules taking `needs` that read the
        first input only for the second's gradient, "other_input" (matmul)
        or "denominator" (divide): the inputs, but nothing with a Python
        number as the second input. The rest reaches the rule as an object
        with only `shape`, `dtype`, `device` and `ndim`.
      complex_grad: True if the rule is right for complex values too (torch's
        and TF's convention: dy times the conjugate derivative); "conj" if it
        is a holomorphic function's rule written with real coefficients
        (dy * f'(x)), which the walk then gives the conjugates of the saved
        tensors. The walk refuses a complex gradient through any other op.
      stash: the forward returns (result, stash): torch tensors it computed
        that the rule would otherwise recompute (layer_norm's mean and 1/std,
        as torch saves them). A record keeps them in its attrs and the rule
        gets them as its `stash` argument (None outside a record: a rule must
        not rely on them). Single-output ops of three or more inputs.

    The returned function has `.opdef`, `.grad` (decorator for the rule), `.jvp`
    (decorator for an optional forward-mode rule, see `OpDef`) and
    `.any` (runs on raw torch tensors without wrapping, or as the op on dtape tensors).
    """
    def deco(forward):
        opdef = OpDef(name or forward.__name__, forward, n_in, list_input, samples,
                      second_order, multi_output, saves, complex_grad, stash)
        if stash and not (n_in > 2 and not list_input and not multi_output):
            raise ValueError(f"op {opdef.name}: stash is for single-output ops of three or more inputs")
        if list_input or n_in > 2:
            call = _make_nary(opdef)
        else:
            call = (_make_unary if n_in == 1 else _make_binary)(opdef)
        call.__name__ = call.__qualname__ = opdef.name
        call.__doc__ = forward.__doc__
        call.__module__ = forward.__module__
        call.opdef = opdef
        call.grad = opdef.grad
        call.jvp = opdef.def_jvp
        call.any = _make_any(call, (lambda *a, **k: forward(*a, **k)[0]) if stash else forward)
        opdef.fn = call
        REGISTRY.append(opdef)
        for entry in torch_fns:
            torch_fn, adapter = entry if isinstance(entry, tuple) else (entry, call)
            TORCH_TABLE[torch_fn] = adapter
        return call
    return deco


def _make_any(call, forward):
    def any_(*args, **kwargs):
        for a in args:
            if type(a) is Tensor:
                return call(*args, **kwargs)
            if isinstance(a, (list, tuple)) and any(type(v) is Tensor for v in a):
                return call(*args, **kwargs)
        return forward(*args, **kwargs)
    return any_
