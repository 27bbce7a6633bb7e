"""Forward-mode automatic differentiation: `ForwardAccumulator` (Jacobian-vector products).

Source: tf.autodiff.ForwardAccumulator (tensorflow/python/eager/forwardprop.py)
and TF's "Advanced automatic differentiation" guide.

An accumulator is a tape in the tape set (`dtape.tape`) that keeps no
records: each op run on a tensor it holds a tangent for is handed to it once
the tapes recorded the op, and it computes the op's output tangents at once.
So it follows the tapes' rules: every thread records into it, the calling
thread's stop flag (`dtape.stop_recording`, `GradientTape.stop_recording`
does not apply: that pauses one tape) and torch's grad mode (`torch.no_grad`)
stop it.

Where the output tangents come from:

* the op's explicit rule, written beside its gradient rule in the op's block
  (`@op.jvp`; `RecordOp.jvp` for the record ops outside the registry);
* otherwise, derived from the gradient rule (TF's "double-backward trick"):
  the vector-Jacobian product `u -> J^T u` is linear in `u`, so
  `J v = d/du <J^T u, v>`, one more reverse walk over the rule's own ops,
  taken on a private tape. This covers every registered op without an
  explicit rule, `dtape.custom_gradient`, `record_operation`, and torch
  functions without a dtape op (through the autograd graph the fallback
  keeps, `create_graph=True`).

Every tangent computation runs on dtape.Tensors: tapes and accumulators
entered before this accumulator record it (the gradient of a JVP,
back-over-forward; a JVP of a JVP), those entered after it do not (TF's
strict nesting). A tape inside the accumulator gives gradients whose
tangents are Hessian-vector products (forward-over-back).
"""
import warnings
import weakref

import torch

from dtape import nest, ops
from dtape import tape as _tp
from dtape.backprop import UnconnectedGradients, imperative_grad
from dtape.tensor import Tensor, convert_to_tensor, is_variable


def _is_float(t):
    return t.dtype.is_floating_point or t.dtype.is_complex


class _PrimalRef(weakref.ref):
    """Weak reference to a primal's torch tensor, carrying the primal's id for the death callback."""

    __slots__ = ("tid",)


class _AccumulatorTape(_tp.Tape):
    """The accumulator's entry in the tape set: tangents by tensor id, kept while the primal's torch tensor lives.

    A tangent lives as long as its primal's torch tensor, not its Tensor
    object: a tape's record keeps the torch tensor its gradient rule reads and
    rebuilds a Tensor with the same id in the walk, whose tangent the
    forward-over-back product needs. Variable tangents live with the accumulator.
    """

    __slots__ = ("tangents", "refs", "dead", "on_death")
    accumulates = True

    def __init__(self):
        super().__init__(persistent=True, watch_accessed_variables=False)
        self.tangents = {}  # id -> tangent Tensor
        self.refs = {}      # id -> _PrimalRef of the primal's torch tensor (absent for variables)
        self.dead = []      # ids whose primal died, appended by the weakref callback, dropped under the lock
        self.on_death = self.dead.append

    def _drop_dead(self):
        """Forgets the tangents of dead primals (caller holds the lock)."""
        while self.dead:
            r = self.dead.pop()
            if self.refs.get(r.tid) is r:
                del self.refs[r.tid]
                self.tangents.pop(r.tid, None)
                self._watched.discard(r.tid)

    def get(self, tid):
        return self.tangents.get(tid)

    def put(self, tid, tangent, torch_tensor=None):
        """Sets the tangent of id `tid` (`torch_tensor`: the primal's, whose death drops it; None: a variable)."""
        ref = None
        if torch_tensor is not None:
            ref = _PrimalRef(torch_tensor, self.on_death)
            ref.tid = tid
        with self._lock:
            self._drop_dead()
            self.tangents[tid] = tangent
            if ref is not None:
                self.refs[tid] = ref
            self._watched.add(tid)

    def accumulate(self, op, in_ids, inputs, outputs, attrs):
        """Computes and stores the output tangents of `op` (called by `dtape.tape.record`)."""
        tangents = [None if i is None else self.tangents.get(i) for i in in_ids]
        if all(t is None for t in tangents):
            return
        with _tp.pause_from(self):
            outs = output_tangents(op, tangents, inputs, outputs, attrs)
            outs = [_fit(t, o) for t, o in zip(outs, outputs)]
        for o, t in zip(outputs, outs):
            if t is not None:
                self.put(o._id, t, o._t)


def _fit(tangent, output):
    """A rule's tangent as its output's: broadcast (a broadcast input's tangent alone) and cast (autocast)."""
    if tangent is None or not _is_float(output):
        return None
    tangent = convert_to_tensor(tangent)
    if tangent.dtype != output.dtype:
        tangent = ops.cast(tangent, output.dtype)
    if tuple(tangent.shape) != tuple(output.shape):
        tangent = ops.broadcast_to(tangent, tuple(output.shape))
    return tangent


def output_tangents(op, tangents, inputs, outputs, attrs):
    """One tangent (or None) per output of `op`: its explicit rule, else derived from its gradient rule."""
    out = op.jvp(tangents, outputs, inputs, attrs or {})
    if out is NotImplemented:
        out = derived_jvp(op, tangents, inputs, outputs, attrs)
    if len(out) != len(outputs):
        raise ValueError(f"the forward-mode rule of op {op.name!r} gave {len(out)} tangents for "
                         f"{len(outputs)} outputs; the rule is wrong")
    return out


def derived_jvp(op, tangents, inputs, outputs, attrs):
    """Output tangents from `op.backward` (TF's double-backward trick): J v = d/du <J^T u, v>.

    `u` (ones, as TF's forwardprop aids) stands for the floating outputs'
    gradients; the rule runs on dtape.Tensors under a private tape watching
    `u`, and one reverse walk of that tape along `v` (the input tangents)
    gives J v. Only the values the rule reads are used, so this holds for
    any record op whose rule is differentiable.

    Raises:
      NotImplementedError: complex inputs or outputs (the rule's conjugations
        do not transpose this way).
    """
    if any(getattr(x, "dtype", torch.float32).is_complex for x in tuple(inputs) + tuple(outputs)):
        raise NotImplementedError(
            f"forward mode through op {op.name!r} with complex values is not implemented (its tangent is "
            "derived from its gradient rule, whose conjugations do not transpose); compute in real and "
            "imaginary parts")
    aids = {k: Tensor(torch.ones_like(o._t)) for k, o in enumerate(outputs) if _is_float(o)}
    if not aids:
        return (None,) * len(outputs)
    dys = tuple(aids[k] if k in aids else Tensor(torch.zeros_like(o._t)) for k, o in enumerate(outputs))
    private = _tp.push_new_tape(persistent=False, watch_accessed_variables=False)
    try:
        for u in aids.values():
            _tp.watch(private, u)
        needs = tuple(t is not None for t in tangents)
        grads = op.backward(dys, tuple(outputs), tuple(inputs), attrs or {}, False, needs)
        total = _pairing(grads, tangents)
    finally:
        _tp.pop_tape(private)
    if total is None:
        return (None,) * len(outputs)
    keys = list(aids)
    jvps = imperative_grad(private, [total], [aids[k] for k in keys], free=True)
    out = [None] * len(outputs)
    for k, j in zip(keys, jvps):
        out[k] = j
    return tuple(out)


def _pairing(grads, tangents):
    """sum_k <grads[k], tangents[k]> over the inputs with both (a broadcast gradient pairs with the broadcast tangent)."""
    total = None
    for g, t in zip(grads, tangents):
        if g is None or t is None:
            continue
        g = convert_to_tensor(g)
        if t.dtype != g.dtype:
            t = ops.cast(t, g.dtype)
        term = ops.reduce_sum(g * t)
        total = term if total is None else total + term
    return total


class ForwardAccumulator:
    """Computes Jacobian-vector products with forward-mode autodiff, as the ops run.

    Args:
      primals: a Tensor, Variable, or nest of them, to watch.
      tangents: a nest like `primals`: per primal, a tensor-like of its shape
        (converted to its dtype, on its device): the "vector" of the JVP.

    Inside `with acc:`, every op on a watched primal (or a tensor computed
    from one) gets the tangent of its outputs; `acc.jvp(t)` then looks up the
    tangent of `t` (no computation), inside or after the block. Floating
    dtypes only; a tangent lives as long as its tensor (a variable's as long
    as the accumulator).

    Nesting: accumulators and tapes entered before this one record its
    tangent computation, those entered inside do not (TF's strict nesting):
    `tape.gradient(acc.jvp(y), x)` with the tape outside (back-over-forward)
    and `acc.jvp(tape.gradient(y, x))` with the tape inside
    (forward-over-back: a Hessian-vector product, the Hessian of `y` times
    the tangent). `dtape.stop_recording()` and `torch.no_grad()` stop it on
    the calling thread, as they stop tapes; a `dtape.function` called inside
    runs eagerly so its ops are followed one by one.

    Tangents come from an op's explicit forward rule where its block gives
    one (elementwise arithmetic, exp/log/sqrt/square/trig, tanh, sigmoid,
    relu, softmax, bias_add, matmul, add_n, reduce_sum/mean, and the shape
    ops: reshape, transpose, expand_dims, squeeze, concat, stack,
    broadcast_to, cast, identity, getitem; variable reads), else derived from
    its gradient rule (every other op, custom gradients, torch functions
    without a dtape op). The exact lists: docs/api.md ("Forward mode").
    Complex values pass through explicit rules only.

    Raises:
      ValueError: a primal listed twice (sum its tangents instead); a tangent
        whose shape differs from its primal's, or on another device;
        `primals` and `tangents` of different structures.
      TypeError: a primal that is neither a Tensor nor a Variable.

    Source: tf.autodiff.ForwardAccumulator.

    Example:
      >>> x = dtape.constant(3.0)
      >>> with dtape.autodiff.ForwardAccumulator(x, dtape.constant(1.0)) as acc:
      ...     y = x * x
      >>> float(acc.jvp(y))
      6.0
    """

    def __init__(self, primals, tangents):
        self._tape = _AccumulatorTape()
        self._recording = False
        self._unpush = None
        flat_p, flat_t = nest.flatten(primals), nest.flatten(tangents)
        if len(flat_p) != len(flat_t):
            raise ValueError(f"ForwardAccumulator: {len(flat_p)} primals but {len(flat_t)} tangents; give one "
                             "tangent per primal, in the same structure")
        seen = set()
        for p in flat_p:
            if id(p) in seen:
                raise ValueError(f"ForwardAccumulator: a primal ({_describe(p)}) is listed more than once; "
                                 "list it once with the sum of its tangents")
            seen.add(id(p))
        for p, t in zip(flat_p, flat_t):
            self.watch(p, t)

    def __enter__(self):
        if self._recording:
            raise ValueError("ForwardAccumulator is already recording; it cannot be entered again inside "
                             "its own `with` block")
        _tp.push_tape(self._tape)
        self._recording = True
        self._unpush = weakref.finalize(self, _tp.pop_tape, self._tape)
        return self

    def __exit__(self, *exc):
        if self._recording:
            self._unpush.detach()
            _tp.pop_tape(self._tape)
            self._recording = False
        return False

    def watch(self, primal, tangent):
        """Watches `primal` (Tensor or Variable) with `tangent`; watching it again adds to its tangent.

        Raises:
          TypeError: `primal` is neither a Tensor nor a Variable.
          ValueError: `tangent`'s shape is not `primal`'s, or it lives on another device.
        """
        if not (isinstance(primal, Tensor) or is_variable(primal)):
            raise TypeError(f"ForwardAccumulator: a primal must be a dtape.Tensor or Variable, got "
                            f"{type(primal).__name__}; wrap values with dtape.constant first")
        if not _is_float(primal):
            warnings.warn(f"ForwardAccumulator: primal of dtype {primal.dtype} cannot have a tangent; "
                          "watch a floating (or complex) tensor instead", stacklevel=2)
            return
        tangent = _checked_tangent(primal, tangent)
        for tid, torch_tensor in _ids(primal):
            prev = self._tape.get(tid)
            if prev is not None:
                with _tp.pause_from(self._tape):
                    tangent = prev + tangent
            self._tape.put(tid, tangent, torch_tensor)

    def jvp(self, primals, unconnected_gradients=UnconnectedGradients.NONE):
        """The tangents computed for `primals` (a Tensor, Variable or nest of them); no computation.

        Args:
          primals: what to look up.
          unconnected_gradients: `UnconnectedGradients.NONE` (None for a
            tensor that got no tangent) or `.ZERO` (zeros of its shape).

        Returns:
          A nest like `primals`: per entry its tangent (its shape and dtype) or None.
        """
        zero = UnconnectedGradients(unconnected_gradients) is UnconnectedGradients.ZERO

        def fetch(t):
            found = [self._tape.get(tid) for tid, _ in _ids(t)]
            found = [f for f in found if f is not None]
            if found:
                return found[0]
            if zero:
                return Tensor(torch.zeros(tuple(t.shape), dtype=t.dtype, device=t.device))
            return None
        return nest.map_structure(fetch, primals)


def _ids(x):
    """(tensor id, torch tensor or None) pairs a primal's tangent is kept under: a variable's handles."""
    if is_variable(x):
        return [(v._handle()._id, None) for v in _tp.resolve_watched(x)]
    if not isinstance(x, Tensor):
        raise TypeError(f"ForwardAccumulator.jvp: expected dtape.Tensors or Variables, got {type(x).__name__}")
    return [(x._id, x.torch())]


def _checked_tangent(primal, tangent):
    t = convert_to_tensor(tangent, dtype=primal.dtype) if not isinstance(tangent, Tensor) else tangent
    if t.dtype != primal.dtype:
        t = ops.cast(t, primal.dtype)
    if tuple(t.shape) != tuple(primal.shape):
        raise ValueError(f"ForwardAccumulator: the tangent of a primal of shape {tuple(primal.shape)} has shape "
                         f"{tuple(t.shape)}; give a tangent of the primal's shape")
    if t.device != primal.device:
        raise ValueError(f"ForwardAccumulator: the tangent is on {t.device} but its primal on {primal.device}; "
                         "create the tangent on the primal's device")
    return t


def _describe(p):
    return f"{type(p).__name__} of shape {tuple(getattr(p, 'shape', ()))}"


__all__ = ["ForwardAccumulator"]
