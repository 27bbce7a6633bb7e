"""GradientTape and the backward walk (imperative_grad).

Source: tf.GradientTape / tensorflow/python/eager/backprop.py, with seed 2's
distribution-aware sources: a variable source is expanded through the tape's
watched-variable resolver and the gradients of its components are summed.
"""
import contextlib
import enum
import inspect
import sys
import threading
import warnings
import weakref

import numpy as np
import torch

from dtape import nest, ops
from dtape.ops.math_ops import conj as _conj
from dtape import tape as _tp
from dtape.tensor import Tensor, convert_to_tensor, is_variable, next_id, storage_held_alone


class UnconnectedGradients(enum.Enum):
    """What `gradient()` returns for a source the target does not depend on. Source: tf.UnconnectedGradients."""

    NONE = "none"
    ZERO = "zero"


_NO_RANGE = contextlib.nullcontext()
_torch_profiler = torch.autograd.profiler


def profile_range(name):
    """A `torch.profiler.record_function(name)` range while a torch profiler runs, else a no-op context.

    dtape's backward walks ("dtape.gradient") and collectives
    ("dtape.all_reduce", "dtape.broadcast") show as named ranges in
    torch.profiler traces, MirroredStrategy's replica threads included
    (`strategy.run` carries a default profiler into them).
    The test is torch's process-wide "a profiler is running" flag (set on
    whichever thread started it), so without a profiler a range costs a
    module attribute read.
    """
    if getattr(_torch_profiler, "_is_profiler_enabled", True):
        return torch.profiler.record_function(name)
    return _NO_RANGE


def _source_handles(source):
    """Concrete (id-bearing) objects a source stands for: one per component of a container.

    A concrete variable (a plain Variable, or one component of a distributed
    variable passed explicitly) stands for itself: its own gradient.
    """
    if is_variable(source) and source._handle() is not source:
        return [v._handle() for v in _tp.resolve_watched(source)]
    return [source]


def _diff_dtype(dtype):
    return dtype.is_floating_point or dtype.is_complex


def _prune(records, target_ids, source_ids):
    """Records on a path from a source to a target (reverse recording order), and the
    ids reachable from a source. `records` are the tape's record objects (`tape._live()`)."""
    reach = set(source_ids)
    forward = []
    for rec in records:
        for i in rec.in_ids:
            if i in reach:
                reach.update(rec.out_ids)
                forward.append(rec)
                break
    needed = set(target_ids)
    kept = []
    for rec in reversed(forward):
        for o in rec.out_ids:
            if o in needed:
                needed.update(rec.in_ids)
                kept.append(rec)
                break
    return kept, reach


def _unbroadcast(g, shape, rec, argnum):
    gshape = g.shape
    if gshape == shape:
        return g
    lead = len(gshape) - len(shape)
    if lead < 0 or any(s != 1 and s != gs for s, gs in zip(shape, gshape[lead:])):
        raise ValueError(f"gradient of op {rec.op.name!r} for input {argnum} has shape {tuple(gshape)}, "
                         f"which does not reduce to the input's shape {tuple(shape)}; the gradient rule is wrong")
    dims = list(range(lead)) + [lead + i for i, s in enumerate(shape) if s == 1 and gshape[lead + i] != 1]
    if dims:
        g = torch.sum(g, dim=dims, keepdim=True)
    return torch.reshape(g, tuple(shape)) if lead else g


def _zeros_for(t, raw):
    z = torch.zeros(t.shape, dtype=t.dtype, device=t.device)  # t: saved tensor or its metadata
    return z if raw else Tensor(z)


def _gather_multi(rec, grads, keep, raw):
    """Output gradients of a multi-output record (None if no output got one)."""
    dys = [grads.get(i) if i in keep else grads.pop(i, None) for i in rec.out_ids]
    if all(d is None for d in dys):
        return None
    return tuple(_zeros_for(o, raw) if d is None else d for d, o in zip(dys, rec.split()[1]))


def _rebuilt(saved, ids):
    """Saved torch tensors as the dtape.Tensors they were recorded from (same ids), the rest as is."""
    return tuple([_tp.rebuild(x, i) for x, i in zip(saved, ids)])


_HALF = (torch.float16, torch.bfloat16)


def _widen_autocast_dy(dys, inputs, raw):
    """Under torch.autocast an op's output, hence its gradient, may be narrower than its floating
    inputs (bf16 matmul of float32 operands); the rule would then mix dtypes. Widen the gradient."""
    dt = dys[0].dtype
    for x in inputs:
        xd = getattr(x, "dtype", None)
        if xd is not None and xd is not dt and xd.is_floating_point and dt.is_floating_point \
                and xd.itemsize > dt.itemsize:
            return (dys[0].to(xd) if raw else ops.cast(dys[0], xd),)
    return dys


def _walk(records, reach, grads, keep, raw, ready=None, free=False):
    """Reverse walk: calls each record's backward once its outputs' gradients are summed.

    `records` are the pruned tape record objects (`op`, `in_ids`, `out_ids`,
    `saved`: saved inputs then outputs, `attrs`) in reverse recording order.
    Only inputs reachable from a source get gradients; each rule hears which
    in `needs` and may skip computing the others (TF's skip_input_indices).
    A record whose saved tensors were written in place since raises. On the raw
    walk a registered op gets the saved torch tensors as they are; other
    record ops, and every op on a recorded walk, get dtape.Tensors with the
    recorded ids. `ready` (a `_Readiness`) hears of each record once it is
    processed. The loop reads record attributes directly and allocates
    nothing that outlives one record (no GC pressure on long tapes). `free`
    (a non-persistent tape's only walk) drops each record's saved tensors
    once its rule ran, so peak memory falls as the walk proceeds (as torch
    frees saved tensors without retain_graph). Each rule runs under the
    torch.autocast state its op ran under (`rec.amp`), wherever
    `tape.gradient` is called, and its input gradients come back in the
    inputs' dtypes, as torch's autocast casts do in its backward.
    """
    amp_now = _tp.autocast_state()
    try:
        _walk_records(records, reach, grads, keep, raw, ready, free, amp_now)
    finally:
        _tp.set_autocast_state(amp_now)


def _walk_records(records, reach, grads, keep, raw, ready, free, amp_now):
    amp = amp_now
    for rec in (records if ready is None else ready.iterate(records)):
        out_ids = rec.out_ids
        if rec.op.passthrough:  # several variable reads: their gradients move to the variables
            _pass_through(rec, grads, keep, reach, raw)
            dys = None
        elif len(out_ids) == 1:
            i = out_ids[0]
            g = grads.get(i) if i in keep else grads.pop(i, None)
            dys = None if g is None else (g,)
            if g is not None and g.dtype in _HALF:  # only autocast makes an output narrower than its inputs
                dys = _widen_autocast_dy(dys, rec.saved, raw)
        else:
            dys = _gather_multi(rec, grads, keep, raw)
        if dys is not None:
            if rec.amp != amp:
                amp = _tp.set_autocast_state(rec.amp)
            _backward_record(rec, dys, grads, reach, raw)
        if free:  # its saved tensors are no longer needed (the record itself goes with the tape's release)
            rec.s0 = rec.s1 = rec.s2 = None


def _backward_record(rec, dys, grads, reach, raw):
    """Runs one record's rule (its op's `backward`, see `tape.RecordOp`) and adds its input gradients into `grads`."""
    op, in_ids = rec.op, rec.in_ids
    n = len(in_ids)
    inputs, outputs = rec.split()
    if op.saves_inputs or op.saves_outputs:  # else the record holds no tensor (metadata only): nothing to check
        _tp.check_saved_versions(rec, inputs, outputs)
    if not (raw and op.raw_saved):
        inputs, outputs = _rebuilt(inputs, in_ids), _rebuilt(outputs, rec.out_ids)
    cplx = dys[0].dtype.is_complex
    if cplx:
        how = op.complex_grad
        if not how:
            raise NotImplementedError(_complex_message(op))
        if how == "conj":  # the rule's dy * f'(x) on conjugates: dy * conj(f'(x)) (recorded off the raw walk)
            inputs, outputs = tuple([_conj(x) for x in inputs]), tuple([_conj(o) for o in outputs])
    if n == 2:
        needs = (in_ids[0] in reach, in_ids[1] in reach)
    elif n == 1:
        needs = (in_ids[0] in reach,)
    else:
        needs = tuple([i in reach for i in in_ids])
    in_grads = op.backward(dys, outputs, inputs, rec.attrs, raw, needs)
    for argnum in range(n):
        g = in_grads[argnum]
        if g is None or not needs[argnum]:
            continue
        i = in_ids[argnum]
        shape = inputs[argnum].shape
        if cplx and g.dtype.is_complex and not inputs[argnum].dtype.is_complex:
            g = g.real  # a real input of a complex op gets the real part (as torch)
        if g.shape != shape:
            g = _unbroadcast(g, shape, rec, argnum)
        if rec.amp is not None:  # autocast cast this input for the op: the gradient comes back in its dtype
            g = _to_input_dtype(g, inputs[argnum], raw)
        prev = grads[i] if i in grads else None  # no call: a module's op has one input per parameter
        if prev is None:
            grads[i] = g
        elif raw and prev.numel() >= _IN_PLACE_MIN and _sole_sum(prev, g):
            prev.add_(g)  # the same kernel as prev + g, without a new buffer (as torch accumulates)
        else:
            grads[i] = prev + g


def _pass_through(rec, grads, keep, reach, raw):
    """Adds the gradient of each output of a `passthrough` record to its input's, as `_backward_record`
    would with a rule returning `dys` (widened to a wider floating input, cast back under autocast, the
    real part for a real input), but an output without a gradient gives its input none (not zeros)."""
    inputs, outputs = rec.split()
    for x, m, i, o in zip(inputs, outputs, rec.in_ids, rec.out_ids):
        if o not in grads:  # operators, not dict methods: a module's read record has one item per parameter
            continue
        g = grads[o]
        if o not in keep:
            del grads[o]
        if g is None or i not in reach:
            continue
        if g.dtype is not m.dtype:  # m: the output's metadata, of its input's dtype
            if g.dtype in _HALF:
                g = _widen_autocast_dy((g,), (x,), raw)[0]
            if g.dtype.is_complex and not x.dtype.is_complex:
                g = g.real
            if rec.amp is not None:
                g = _to_input_dtype(g, x, raw)
        grads[i] = grads[i] + g if i in grads and grads[i] is not None else g


def _to_input_dtype(g, x, raw):
    dt = getattr(x, "dtype", None)
    if dt is None or dt == g.dtype or not dt.is_floating_point or not g.dtype.is_floating_point:
        return g
    return g.to(dt) if raw else ops.cast(g, dt)


def _complex_message(op):
    ready = sorted(o.name for o in ops.REGISTRY if o.complex_grad)
    return (f"the gradient of {op.name} for complex values is not implemented (its rule assumes real "
            f"values); complex gradients flow through {', '.join(ready)}, and through torch functions "
            "without a dtape op (torch.autograd's own rules): use those, or compute in real and imaginary parts")


# References to a running gradient sum `prev` seen in `_sole_sum(prev, g)` when only the walk holds it:
# the `grads` dict, `_backward_record`'s local, `_sole_sum`'s argument and getrefcount's argument.
_SUM_REFS = 4
# Below this many elements a new buffer costs less than the ownership checks (chains of small ops).
_IN_PLACE_MIN = 1 << 14


def _sole_sum(prev, g):
    """True if the raw walk may add `g` into `prev` in place: same dtype (no promotion), `prev` a dense
    tensor of its own storage (not an expanded or shared view, not numpy/DLPack or shared memory) that
    nothing but the walk holds (not a user's output gradient, a saved tensor or another id's gradient).
    The caller checks the size first (`_IN_PLACE_MIN`), without a call for the small sums of a chain."""
    if prev.dtype != g.dtype or prev.device != g.device:
        return False
    if sys.getrefcount(prev) != _SUM_REFS or not prev.is_contiguous():
        return False
    # not outside memory (numpy, DLPack storages are not resizable); no other tensor on it
    return prev.untyped_storage().resizable() and storage_held_alone(prev)


class _WalkInfo(threading.local):
    """Per thread: whether the last backward walk ran raw (instrumentation for tests and benchmarks)."""

    last_raw = None


walk_info = _WalkInfo()


def _walk_is_raw(records, target_ids, dys):
    """True unless a tape recording on this thread watches a tensor the walk reads.

    The walk's results are computed from the output gradients and the
    records' saved tensors, so it must be recorded (run on dtape.Tensors)
    only if a tape recording here watches one of their ids: a tape of
    another thread, or one watching unrelated tensors, leaves it raw.
    """
    tapes = _tp.recording_tapes()
    if not tapes:
        return True
    watched = [t._watched for t in tapes]
    for d in dys:
        i = getattr(d, "_id", None)
        if i is not None and any(i in w for w in watched):
            return False
    for i in target_ids:
        if any(i in w for w in watched):
            return False
    for rec in records:
        for ids in (rec.in_ids, rec.out_ids):
            for i in ids:
                if i is not None and any(i in w for w in watched):
                    return False
    return True


class _Readiness:
    """Calls `on_ready(positions, grads)` as soon as sources' gradients are final.

    A source's gradient is final once the walk has processed its last
    consumer among the pruned records (sources with none: before the walk).
    One call per record that finishes some (a wrapped module's one record
    finishes all its parameters at once), with the sources' positions in the
    order of the record's inputs and their gradients: the walk's values
    (torch.Tensor on the raw path, else dtape.Tensor) or None. The hook
    gradient all-reduce overlap uses.
    """

    __slots__ = ("_left", "_positions", "_grads", "_on_ready")

    def __init__(self, records, source_ids, grads, on_ready):
        self._positions = {i: (k,) for k, i in enumerate(source_ids)}
        if len(self._positions) != len(source_ids):  # a source listed more than once: each of its positions
            self._positions = {}
            for k, i in enumerate(source_ids):
                self._positions.setdefault(i, []).append(k)
        self._left = dict.fromkeys(self._positions, 0)
        for rec in records:
            for i in rec.in_ids:
                if i in self._left:
                    self._left[i] += 1
        self._grads, self._on_ready = grads, on_ready
        unused = [i for i, n in self._left.items() if n == 0]
        if unused:
            self._fire(unused)

    def iterate(self, records):
        left = self._left
        for rec in records:
            yield rec
            hit = [i for i in rec.in_ids if i in left]
            if hit:  # the walk is done with rec: its source inputs have one consumer less
                for i in hit:
                    left[i] -= 1
                # those with none left (the counts are of these very records: each reaches 0 at its last one)
                done = [i for i in dict.fromkeys(hit) if not left[i]]
                if done:
                    self._fire(done)

    def _fire(self, ids):
        grads, positions = self._grads, self._positions
        self._on_ready([k for i in ids for k in positions[i]],
                       [grads[i] if i in grads else None for i in ids for _ in positions[i]])


def imperative_grad(tape, targets, sources, output_gradients=None, on_ready=None, free=False):
    """Gradients of the sum of `targets` w.r.t. `sources` from `tape`'s records.

    Args:
      tape: a `dtape.tape.Tape`.
      targets: flat list of Tensors.
      sources: flat list of Tensors or concrete variables (with `_id`).
      output_gradients: flat list (None entries allowed) of Tensors matching targets.
      on_ready: optional `f(source_positions, grads)` (lists), told of each
        source once, as soon as its gradient is final, during the walk (see
        `_Readiness`).
      free: drop each record's saved tensors once used (the tape's last walk).

    Returns:
      A list with a gradient (dtape.Tensor) or None per source.
    """
    source_ids = [s._id for s in sources]
    target_ids = [t._id for t in targets]
    dys = [None if dy is None else convert_to_tensor(dy) for dy in (output_gradients or [None] * len(targets))]
    for k, (t, dy) in enumerate(zip(targets, dys)):
        if dy is not None and dy.dtype.is_complex != t.dtype.is_complex:
            raise TypeError(_dy_kind_message(k, dy, t))
    with profile_range("dtape.gradient"):  # a named range in torch.profiler traces
        records, reach = _prune(tape._live(), target_ids, source_ids)
        raw = _walk_is_raw(records, target_ids, dys)
        walk_info.last_raw = raw
        grads = {}
        for t, dy in zip(targets, dys):
            dy = Tensor(torch.ones_like(t._t)) if dy is None else dy
            dy = dy._t if raw else dy
            prev = grads.get(t._id)
            grads[t._id] = dy if prev is None else prev + dy
        ready = None if on_ready is None else _Readiness(records, source_ids, grads, on_ready)
        with _tp.walk_scope(free):
            _walk(records, reach, grads, set(source_ids), raw, ready, free)
    out = [grads[i] if i in grads else None for i in source_ids]  # no call per source
    if raw:
        for k, g in enumerate(out):
            if g is not None:  # Tensor(g), without the Python-level __init__ call
                out[k] = t = Tensor.__new__(Tensor)
                t._t, t._id = g, next_id()
    return out


def _dy_kind_message(k, dy, t):
    # The walk picks each rule's complex form from the gradient's dtype: a real gradient for a complex
    # target would skip the conjugations, a complex one for a real target lose its imaginary part.
    return (f"output_gradients[{k}] has dtype {dy.dtype} but its target has dtype {t.dtype}: a complex target "
            "needs a complex upstream gradient and a real target a real one (torch refuses the mismatch too); "
            f"cast it, e.g. dtape.cast(dy, {t.dtype})")


class GradientTape:
    """Records operations for automatic differentiation (TF 2 semantics).

    Args:
      persistent: bool, allow more than one `gradient()`/`jacobian()` call.
      watch_accessed_variables: bool, watch every trainable variable read while active.
      gradient_sync: None, or a `dtape.distribute.GradientSync`: under a
        strategy, `gradient()` starts all-reducing each bucket of gradients
        as soon as the walk has finished it (it still returns the local
        gradients; `apply_gradients` uses the reductions). Any object with
        `start(sources) -> session or None`, the session having
        `ready(indices, grads)` (lists: the sources a record finished) and `finish(grads)`.

    Ops run on any thread are recorded while the tape is active, when an
    input is watched (the set of tapes is process-global). A tape entered
    and never exited stops recording once it is garbage-collected (the
    global set does not keep it alive). Under a strategy,
    a watched `MirroredVariable` is its container in a replica context and
    its components in the cross-replica context (seed 2).

    Raises:
      TypeError: `persistent` or `watch_accessed_variables` is not a bool (numpy bools are bools);
        `gradient_sync` has no `start` method.

    Source: tf.GradientTape.

    Example:
      >>> x = dtape.constant(3.0)
      >>> with dtape.GradientTape() as tape:
      ...     tape.watch(x)
      ...     y = x * x
      >>> float(tape.gradient(y, x))
      6.0
    """

    def __init__(self, persistent=False, watch_accessed_variables=True, gradient_sync=None):
        for name, flag in (("persistent", persistent), ("watch_accessed_variables", watch_accessed_variables)):
            if not isinstance(flag, (bool, np.bool_)):  # persistent="no" would be truthy: a persistent tape, silently
                raise TypeError(f"GradientTape({name}=...) must be True or False, got {type(flag).__name__} "
                                f"{flag!r}; pass a bool (or numpy bool), e.g. GradientTape({name}=True)")
        if gradient_sync is not None and not callable(getattr(gradient_sync, "start", None)):
            raise TypeError(f"gradient_sync must be a dtape.distribute.GradientSync (or None), got "
                            f"{type(gradient_sync).__name__}")
        self._gradient_sync = gradient_sync
        self._persistent = bool(persistent)
        self._watch_accessed_variables = bool(watch_accessed_variables)
        self._tape = None
        self._recording = False
        self._used = False
        self._unpush = None  # weakref.finalize popping the tape if self dies while recording

    def __enter__(self):
        if self._recording:
            raise ValueError("GradientTape is already recording; it cannot be entered again "
                             "inside its own `with` block")
        if self._tape is None:
            self._tape = _tp.push_new_tape(self._persistent, self._watch_accessed_variables)
        else:  # re-entering resumes recording on the same tape (tf.GradientTape)
            _tp.push_tape(self._tape)
        self._recording = True
        self._unpush = weakref.finalize(self, _tp.pop_tape, self._tape)
        return self

    def __exit__(self, *exc):
        if self._recording:
            self._stop()
        return False

    def _stop(self):
        self._unpush.detach()
        _tp.pop_tape(self._tape)
        self._recording = False

    def _require_tape(self, what):
        if self._tape is None:
            raise RuntimeError(f"GradientTape.{what}() needs the tape to be entered first: "
                               f"use `with dtape.GradientTape() as tape:`")

    def watch(self, tensor):
        """Watches a Tensor, a Variable, or a nest of them.

        Raises:
          ValueError: for objects that are neither tensors nor variables.
        """
        self._require_tape("watch")
        for t in nest.flatten(tensor):
            if is_variable(t):
                _tp.watch_variable(self._tape, t)
            elif isinstance(t, Tensor):
                if not _diff_dtype(t.dtype):
                    warnings.warn(f"GradientTape.watch: tensor of dtype {t.dtype} cannot have a gradient; "
                                  "watch a floating tensor instead", stacklevel=2)
                _tp.watch(self._tape, t)
            else:
                raise ValueError(f"GradientTape.watch: expected a dtape.Tensor or Variable, got "
                                 f"{type(t).__name__}; wrap values with dtape.constant first")

    def watched_variables(self):
        """Variables watched so far, in first-watch order, no duplicates."""
        return () if self._tape is None else self._tape.watched_variables()

    def num_records(self):
        """Number of op records the tape holds now (0 before entering and after a non-persistent gradient).

        Records of tensors that died and that nothing live needs are dropped
        (TF's trace deletion), so a persistent tape over a loop stays flat.
        """
        return 0 if self._tape is None else self._tape.num_records()

    def nbytes(self):
        """Bytes of tensor storage the tape keeps alive for its gradient rules (shared storage counted once)."""
        return 0 if self._tape is None else self._tape.nbytes()

    def reset(self):
        """Forgets everything recorded and watched; recording continues."""
        self._require_tape("reset")
        self._tape.reset()
        self._used = False

    def stop_recording(self):
        """Context manager that pauses this tape on the current thread only.

        Raises:
          RuntimeError: if the tape is not recording.
        """
        if not self._recording:
            raise RuntimeError("GradientTape.stop_recording(): the tape is not recording; "
                               "call it inside the tape's `with` block")
        return _tp.pause_tape(self._tape)

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=UnconnectedGradients.NONE):
        """Gradient of `target` (summed over its elements) w.r.t. `sources`.

        Args:
          target: Tensor or nest of Tensors (each floating).
          sources: Tensor, Variable, or nest of them.
          output_gradients: optional nest like `target`: the upstream gradients
            (complex for a complex target, real for a real one).
          unconnected_gradients: `UnconnectedGradients.NONE` (None) or `.ZERO`.

        Returns:
          A nest like `sources`; each entry has its source's shape, dtype and
          device, or is None (unconnected, or integer/bool source).

        Raises:
          RuntimeError: on a second call of a non-persistent tape, or before
            the tape was entered.
          TypeError: an output gradient is real for a complex target, or
            complex for a real one.
        """
        self._begin_use("gradient")
        try:
            flat_targets = [_as_target(t) for t in nest.flatten(target)]
            flat = _flat_list(sources)  # a plain list or tuple of sources: no nest walk either way
            flat_sources = nest.flatten(sources) if flat is None else flat
            flat_dys = None if output_gradients is None else nest.flatten(output_gradients)
            grads = self._gradients(flat_targets, flat_sources, flat_dys, unconnected_gradients)
        finally:  # a call that raised was the tape's use too (TF drops it before walking)
            self._end_use()
        return nest.pack_sequence_as(sources, grads) if flat is None else type(sources)(grads)

    def _begin_use(self, what):
        """Checks a gradient()/jacobian() call is allowed; stops a non-persistent tape recording."""
        self._require_tape(what)
        if self._used and not self._persistent:
            raise RuntimeError("A non-persistent GradientTape can only be used to compute one set of "
                               "gradients (or jacobians); create it with persistent=True to call "
                               f"{what}() more than once")
        if self._recording and not self._persistent:
            self._stop()
        self._used = True

    def _end_use(self):
        if not self._persistent:
            self._tape.release()

    def _gradients(self, targets, sources, dys, unconnected):
        session = None if self._gradient_sync is None else self._gradient_sync.start(sources)
        free = not self._persistent  # the only walk of this tape: free saved tensors as it goes
        if session is None:
            return tape_gradients(self._tape, targets, sources, dys, unconnected, free=free)
        grads = tape_gradients(self._tape, targets, sources, dys, unconnected, on_ready=session.ready, free=free)
        session.finish(grads)
        return grads

    def jacobian(self, target, sources, unconnected_gradients=UnconnectedGradients.NONE):
        """Full Jacobian of `target` w.r.t. each source.

        Args:
          target: floating Tensor of shape [y_1, ..., y_n].
          sources: Tensor, Variable or nest of them; source k has shape [x_1, ..., x_m].
          unconnected_gradients: `UnconnectedGradients.NONE` (None) or `.ZERO`.

        Returns:
          A nest like `sources`; entry k has shape [y_1, ..., y_n, x_1, ..., x_m]
          and the source's dtype, or is None (unconnected).

        Raises:
          RuntimeError: on a second use of a non-persistent tape.

        Source: tf.GradientTape.jacobian (one gradient walk per target element).
        """
        return _jacobian(self, target, sources, unconnected_gradients, batch=False)

    def batch_jacobian(self, target, source, unconnected_gradients=UnconnectedGradients.NONE):
        """Per-example Jacobian, assuming example i of target depends only on example i of source.

        Args:
          target: floating Tensor of shape [b, y_1, ..., y_n].
          source: Tensor or Variable of shape [b, x_1, ..., x_m].
          unconnected_gradients: `UnconnectedGradients.NONE` (None) or `.ZERO`.

        Returns:
          A Tensor of shape [b, y_1, ..., y_n, x_1, ..., x_m], or None (unconnected).

        Raises:
          ValueError: if target and source differ in their first dimension.
          RuntimeError: on a second use of a non-persistent tape.

        Source: tf.GradientTape.batch_jacobian.
        """
        target = _as_target(target)
        if target.ndim == 0 or len(source.shape) == 0 or target.shape[0] != source.shape[0]:
            raise ValueError(f"batch_jacobian: target shape {tuple(target.shape)} and source shape "
                             f"{tuple(source.shape)} must share a leading batch dimension")
        return _jacobian(self, target, source, unconnected_gradients, batch=True)


def tape_gradients(tape, targets, sources, dys=None, unconnected=UnconnectedGradients.NONE, on_ready=None,
                   free=False):
    """Gradients of flat `targets` w.r.t. flat `sources` (tensors or variables) from a raw tape.

    Integer/bool targets are dropped with a warning (with their output
    gradient); variable sources are expanded through the watch resolver and
    the gradients of their components summed (seed 2). `on_ready(js, grads)`
    hears during the walk of the sources j that stand for one handle (lists).
    `free`: the tape's last walk (see `imperative_grad`).
    """
    if dys is not None and len(dys) != len(targets):
        raise ValueError(f"output_gradients has {len(dys)} entries but target has {len(targets)}; "
                         "give one upstream gradient (or None) per target tensor")
    pairs = [(t, None if dys is None else d) for t, d in zip(targets, dys or targets)]
    pairs = [(t, d) for t, d in pairs if _check_dtype(t, "target")]
    targets, dys = [t for t, _ in pairs], [d for _, d in pairs]
    if _own_handles(sources):  # each source its own handle: positions are sources, no expansion, no sums
        raw = imperative_grad(tape, targets, sources, dys, on_ready, free) if targets else [None] * len(sources)
        return _finish_own(sources, raw, unconnected)
    expanded = _expand_sources(sources)
    flat = [h for hs in expanded for h in hs]
    hook = None if on_ready is None else _single_handle_hook(expanded, on_ready)
    raw = imperative_grad(tape, targets, flat, dys, hook, free) if targets else [None] * len(flat)
    # the kinds of handle whose value is in `_t`: a source with one such handle has its dtype and device
    valued = {kind for kind in set(map(type, flat)) if kind is Tensor or vars(kind).get("_handle_is_self", False)}
    if len(flat) == len(sources):  # every source has one handle (each has at least one): positions are sources
        return _finish_single(sources, flat, raw, valued, unconnected)
    out, pos = [], 0
    for src, hs in zip(sources, expanded):
        if len(hs) == 1:
            out += _finish_single((src,), hs, raw[pos:pos + 1], valued, unconnected)
        else:  # the components' gradients summed
            out.append(_finish(src, [g for g in raw[pos:pos + len(hs)] if g is not None], unconnected))
        pos += len(hs)
    return out


def _finish_single(sources, handles, raw, valued, unconnected):
    """The gradients of sources with one handle each from the walk's `raw` ones: a gradient in its source's
    dtype and device (its one handle's: itself, or the component it stands for, read from `_t` for the
    `valued` kinds) as it is (the common case, without a call), else `_finish` (casts, zeros, warnings)."""
    out = list(raw)
    for k, (src, h, g) in enumerate(zip(sources, handles, raw)):
        if type(g) is Tensor:
            ref = h._t if type(h) in valued else src
            t, dtype = g._t, ref.dtype
            if t.dtype is dtype and (dtype.is_floating_point or dtype.is_complex) and t.device == ref.device:
                continue
        out[k] = _finish(src, () if g is None else (g,), unconnected)
    return out


def _finish_own(sources, raw, unconnected):
    """The gradients of sources that are their own handles (`_own_handles`) from the walk's `raw` ones: a
    gradient in its source's dtype and device as it is (no call), else `_finish` (casts, zeros, warnings)."""
    out = list(raw)
    for k, (src, g) in enumerate(zip(sources, raw)):
        if type(g) is Tensor:
            s, t = src._t, g._t  # the source's value (Tensor and Variable hold it in `_t`)
            dtype = s.dtype
            if t.dtype is dtype and (dtype.is_floating_point or dtype.is_complex) and t.device == s.device:
                continue
        out[k] = _finish(src, () if g is None else (g,), unconnected)
    return out


def _flat_list(structure):
    """`structure` as a list when it is a list or tuple (not a subclass) of leaves (`nest.flatten` would
    give the same list, and `pack_sequence_as` rebuild it as `type(structure)(values)`), else None."""
    if type(structure) is not list and type(structure) is not tuple:
        return None
    for kind in set(map(type, structure)):  # each type once (a model's sources are one or two types)
        if issubclass(kind, (list, tuple, dict)):  # nest.is_nested
            return None
    return list(structure)


def _own_handles(sources):
    """True when every source is a Tensor or of a variable class whose `_handle()` is itself (a plain
    Variable; decided per class, not per source: a model's sources are one or two classes)."""
    for kind in set(map(type, sources)):
        if kind is not Tensor and not vars(kind).get("_handle_is_self", False):
            return False
    return True


def _expand_sources(sources):
    """`_source_handles` of each source (checked), a Tensor or a variable that is its own handle directly;
    variables of classes that are never their own handle (distributed variables) resolved as one list
    (`resolve_watched_all`: the distribution context looked up once, not per source)."""
    resolved = {kind for kind in set(map(type, sources))
                if getattr(kind, "_dtape_variable", False) and getattr(kind, "_handle_is_self", None) is False}
    expanded = [None if type(s) in resolved else (s,) if type(s) is Tensor else
                (s,) if getattr(type(s), "_dtape_variable", False) and s._handle() is s else  # is_variable
                _source_handles(_check_source(s)) for s in sources]
    if resolved:
        pending = [k for k, s in enumerate(sources) if type(s) in resolved]
        for k, hs in zip(pending, _tp.resolve_watched_all([sources[k] for k in pending])[1]):
            expanded[k] = hs
    return expanded


def _single_handle_hook(expanded, on_ready):
    """Maps walk positions to source indices, for sources with one handle (the others: none early); when
    every source has one handle (each has at least one), positions are source indices: `on_ready` itself."""
    if sum(map(len, expanded)) == len(expanded):
        return on_ready
    owner = [j if len(hs) == 1 else None for j, hs in enumerate(expanded) for _ in hs]

    def hook(ks, gs):
        js, kept = [], []
        for k, g in zip(ks, gs):
            if owner[k] is not None:
                js.append(owner[k])
                kept.append(g)
        if js:
            on_ready(js, kept)
    return hook


def _check_source(s):
    if isinstance(s, Tensor) or is_variable(s):
        return s
    if isinstance(s, torch.Tensor) or inspect.isgenerator(s):  # `tape.gradient(loss, model.parameters())`
        raise ValueError(f"gradient sources must be dtape.Tensors or Variables (in a list, tuple or dict), got "
                         f"{type(s).__name__}: a torch module's parameters are no tape's sources; for a "
                         f"dtape.layers.TorchModule pass its trainable_variables (in module.parameters()'s "
                         f"order), for other values dtape.constant them and tape.watch them first")
    raise ValueError(f"gradient sources must be dtape.Tensors or Variables, got {type(s).__name__}; "
                     "wrap values with dtape.constant and watch them first")


def _as_target(t):
    """A gradient target as the walk sees it: a Tensor, or for a variable its concrete handle.

    A variable target stands for its value at its handle's id (TF's
    `_handle_or_self`), exactly as a read of it recorded on the tape would:
    `tape.gradient(v, v)` is ones, and `max(list_of_variables)` is
    differentiable. A distributed variable resolves to this replica's
    component (the primary in the cross-replica context).
    """
    if is_variable(t):
        return t._handle()
    if isinstance(t, torch.Tensor):  # "got Tensor" alone reads as if a dtape.Tensor were refused
        raise ValueError(
            "gradient target must be a dtape.Tensor, got a torch.Tensor: torch code on torch tensors is not "
            "recorded on tapes (a torch module called instead of its dtape.layers.TorchModule wrapper, `.torch()` "
            "of a loss, a wrapped module's own parameters `net.weight`, or torch tensors a TorchModule returns "
            "inside objects it does not convert, such as a dataclass). Compute the target from dtape tensors: "
            "the TorchModule's outputs (a tensor, tuple, list or dict) or its variables (`tm.trainable_variables`)")
    if not isinstance(t, Tensor):
        raise ValueError(f"gradient target must be a dtape.Tensor, got {type(t).__name__}")
    return t


def _check_dtype(t, role):
    if _diff_dtype(t.dtype):
        return True
    warnings.warn(f"The dtype of the {role} tensor must be floating (e.g. float32) to get a gradient; "
                  f"got {t.dtype}, which gets None", stacklevel=4)
    return False


def _finish(src, parts, unconnected):
    dtype = src.dtype
    if not _diff_dtype(dtype):
        warnings.warn(f"The dtype of the source tensor must be floating (e.g. float32) to get a gradient; "
                      f"got {dtype}, which gets None", stacklevel=4)
        return None
    if parts:  # each part in the source's dtype (autocast may have run the walk in bfloat16)
        parts = [p if p.dtype == dtype else ops.cast(p, dtype) for p in parts]
        # Components of a distributed variable live on several devices: sum on the source's.
        parts = [ops.to_device(p, src.device) for p in parts]
        g = parts[0]
        for p in parts[1:]:
            g = g + p
        return g
    if unconnected is UnconnectedGradients.ZERO or unconnected == "zero":
        return Tensor(torch.zeros(tuple(src.shape), dtype=dtype, device=src.device))
    return None


def _jacobian(gtape, target, sources, unconnected, batch):
    """Row-by-row Jacobian: one gradient walk per (per-example) target element."""
    gtape._begin_use("batch_jacobian" if batch else "jacobian")
    try:
        target = _as_target(target)
        flat_sources = nest.flatten(sources)
        seeds = _jacobian_seeds(target, batch)
        rows = [tape_gradients(gtape._tape, [target], flat_sources, [seed], unconnected) for seed in seeds]
    finally:  # freed even if a walk raised (see GradientTape.gradient)
        gtape._end_use()
    out = [_assemble(target, src, [r[j] for r in rows], batch) for j, src in enumerate(flat_sources)]
    return nest.pack_sequence_as(sources, out)


def _jacobian_seeds(target, batch):
    """One-hot output gradients: per element of target, or per element of each example."""
    n = target.shape[0] if batch else 1
    per = int(torch.tensor(target.shape[1 if batch else 0:], dtype=torch.int64).prod())
    eye = torch.eye(per, dtype=target.dtype, device=target.device)
    return [Tensor(eye[k].expand(n, per).reshape(target.shape)) for k in range(per)]


def _assemble(target, src, col, batch):
    """Stacks per-element gradients into [*target.shape, *src.shape] (batch: [b, y..., x...])."""
    shape = (tuple(target.shape) + tuple(src.shape[1:])) if batch else (tuple(target.shape) + tuple(src.shape))
    if not col:  # empty target
        return Tensor(torch.zeros(shape, dtype=src.dtype, device=src.device))
    if all(c is None for c in col):
        return None
    col = [Tensor(torch.zeros(tuple(src.shape), dtype=src.dtype, device=src.device)) if c is None else c
           for c in col]
    return ops.reshape(ops.stack(col, axis=1 if batch else 0), shape)


# -- functional forms (tf.contrib.eager / eager backprop.py) -------------------
def _require_value(result, f):
    if result is None:
        raise ValueError("Cannot differentiate a function that returns None; did you forget to "
                         f"return a value from {getattr(f, '__name__', f)}?")


def implicit_val_and_grad(f):
    """Returns `g(*args, **kwargs) -> (f's value, [(gradient, variable), ...])`.

    The gradient is that of `f`'s value (summed over its elements and nest
    leaves) w.r.t. every trainable variable `f` reads, in creation order.

    Raises (when `g` is called):
      ValueError: if `f` returns None or reads no trainable variable.

    Source: tf.contrib.eager.implicit_value_and_gradients (eager backprop.py, seed 1).

    Example:
      >>> v = dtape.Variable(2.0)
      >>> val, [(g, var)] = dtape.backprop.implicit_val_and_grad(lambda: v * v)()
      >>> float(g)
      4.0
    """
    def grad_fn(*args, **kwargs):
        this_tape = _tp.push_new_tape()
        try:
            end_node = f(*args, **kwargs)
            _require_value(end_node, f)
        finally:
            _tp.pop_tape(this_tape)
        variables = sorted(this_tape.watched_variables(), key=lambda v: v._handle()._id)
        if not variables:
            raise ValueError("No trainable variables were accessed while the function was being computed.")
        targets = [_as_target(t) for t in nest.flatten(end_node)]
        grads = tape_gradients(this_tape, targets, variables)
        return end_node, list(zip(grads, variables))
    return grad_fn


def implicit_grad(f):
    """Like `implicit_val_and_grad`, returning only `[(gradient, variable), ...]`.

    Source: tf.contrib.eager.implicit_gradients.
    """
    def grad_fn(*args, **kwargs):
        return implicit_val_and_grad(f)(*args, **kwargs)[1]
    return grad_fn


def _get_arg_spec(f, params, param_args):
    """Positions, in `param_args`, of the arguments of `f` to differentiate."""
    if params is None:
        return list(range(len(param_args)))
    if all(isinstance(p, int) for p in params):
        return list(params)
    if all(isinstance(p, str) for p in params):
        names = list(inspect.signature(f).parameters)
        missing = [p for p in params if p not in names]
        if missing:
            raise ValueError(f"params {missing} are not arguments of {getattr(f, '__name__', f)}: {names}")
        return [names.index(p) for p in params]
    raise ValueError(f"params must be all strings or all integers; got {params!r}")


def make_vjp(f, params=None, persistent=True):
    """Returns `g(*args) -> (f(*args), vjp)` with `vjp(dy=None)` the vector-Jacobian product.

    Args:
      f: function of tensors returning a Tensor or a nest of Tensors.
      params: positions (ints) or names (strs) of the arguments to
        differentiate; default all.
      persistent: allow `vjp` to be called more than once.

    `vjp(dy)` returns a list with one gradient (or None) per differentiated
    argument, each of that argument's shape; `dy` is a nest like `f`'s value
    (default ones).

    Raises (when `g` is called):
      ValueError: if `f` returns None.

    Source: tf.contrib.eager.make_vjp (eager backprop.py, seed 1).

    Example:
      >>> val, vjp = dtape.backprop.make_vjp(lambda x: x * x)(dtape.constant(3.0))
      >>> float(vjp()[0])
      6.0
    """
    def decorated(*args, **kwargs):
        if kwargs:
            raise ValueError("The gradient function can't take keyword arguments.")
        positions = _get_arg_spec(f, params, args)
        this_tape = _tp.push_new_tape(persistent=persistent)
        try:
            args, sources = _watched_args(this_tape, positions, args)
            result = f(*args)
            _require_value(result, f)
            flat = [ops.identity(_as_target(x)) for x in nest.flatten(result)]
            result = nest.pack_sequence_as(result, flat)
        finally:
            _tp.pop_tape(this_tape)

        def vjp(dy=None):
            dys = None if dy is None else [None if d is None else convert_to_tensor(d) for d in nest.flatten(dy)]
            return tape_gradients(this_tape, flat, sources, dys)
        return result, vjp
    return decorated


def _watched_args(this_tape, positions, args):
    """Converts the differentiated args to Tensors (distinct objects) and watches them."""
    args, seen, sources = list(args), set(), []
    for i in positions:  # all distinct before any is watched, so the identity is not recorded
        t = convert_to_tensor(args[i])
        if id(t) in seen:
            t = ops.identity(t)
        seen.add(id(t))
        args[i] = t
        sources.append(t)
    for t in sources:
        _tp.watch(this_tape, t)
    return args, sources


def val_and_grad_function(f, params=None):
    """Returns `g(*args, dy=None) -> (f(*args), [gradient per differentiated argument])`.

    Args:
      f: function of tensors returning a Tensor or a nest of Tensors.
      params: positions or names of the arguments to differentiate; default all.

    The gradients have the shapes of their arguments (None if unconnected);
    `dy` is the upstream gradient, a nest like `f`'s value (default ones).

    Source: tf.contrib.eager.value_and_gradients_function.

    Example:
      >>> val, (g,) = dtape.backprop.val_and_grad_function(lambda x: x * x)(dtape.constant(3.0))
      >>> float(g)
      6.0
    """
    def decorated(*args, **kwargs):
        dy = kwargs.pop("dy", None)
        if kwargs:
            raise ValueError("Functions to be differentiated cannot receive keyword arguments.")
        val, vjp = make_vjp(f, params)(*args)
        return val, vjp(dy=dy)
    return decorated


def gradients_function(f, params=None):
    """Returns `g(*args, dy=None) -> [gradient of f per differentiated argument]`.

    Nesting gives higher derivatives: `gradients_function(lambda x:
    gradients_function(f)(x)[0])`.

    Source: tf.contrib.eager.gradients_function.

    Example:
      >>> g = dtape.backprop.gradients_function(lambda x, y: x * y)
      >>> [float(t) for t in g(dtape.constant(3.0), dtape.constant(2.0))]
      [2.0, 3.0]
    """
    def decorated(*args, **kwargs):
        return val_and_grad_function(f, params=params)(*args, **kwargs)[1]
    return decorated
