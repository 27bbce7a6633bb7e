"""The tape module: a process-global set of tapes, a per-thread stop flag.

Seed 1 (TF "Fix the threading model of gradient tapes"): tapes live in one
set shared by every thread, so a tape opened on one thread records the ops
other threads run on tensors it watches (what replica threads need), while
`stop_recording()` pauses recording on the calling thread only.

Automatic watching of variable reads is global too, as the seed's
`TFE_Py_TapeSetWatchVariable` (a read on any thread is watched by every
active tape), with one narrowing: a tape opened on one replica thread of a
`strategy.run` neither watches nor records the reads of the sibling replica
threads of that same run (`replica_run_scope`), unless it watched that
variable explicitly. Otherwise each replica's tape would record every other
replica's forward pass, records growing with the number of replicas. The
same holds for ops that take a variable as an input (`record_reading`, a
`dtape.function` call's op), and a function's private tape made in one
replica records none of the sibling replicas' ops.

Concurrency: the set is mutated under `_set_lock` and published as an
immutable tuple, so the hot path reads one module global with no lock. Each
tape guards its records and watch sets with its own lock; nothing relies on
the GIL.

Seed 2 (TF "Make defun work under distributed strategies"): what a watch or
an access of a variable resolves to is decided by a resolver that
`dtape.distribute` registers (containers in a replica context, components in
the cross-replica context). The core never imports `dtape.distribute`.
"""
import threading
import weakref

import torch

from dtape._local import ThreadLocalScope
from dtape.tensor import Tensor, convert_to_tensor, is_variable

# Process-wide: the active tapes, published as an immutable tuple; replaced
# (never mutated) under _set_lock. Readers take a snapshot without locking.
_tape_set = ()
_set_lock = threading.Lock()
# The same tuple under a public name: the "is any tape active" check every op makes before it builds a
# record (a module attribute read; a function call per op would cost more than the check). Read it as
# `tape.active_tapes` each time: an imported name keeps the snapshot of its import.
active_tapes = ()


def _publish(tapes):
    """Makes `tapes` the active set (the caller holds _set_lock)."""
    global _tape_set, active_tapes
    _tape_set = active_tapes = tapes


class _ThreadState(threading.local):
    """Per-thread state: stop flag, tapes paused on this thread, variable-read captures, replica run,
    and the tracker of the tapes pushed on this thread (a PushedTapes or None).

    `scope` is this thread's own tape-scope token (a tape created here is
    owned by it); `run` is the token of the `strategy.run` whose replica job
    this thread runs now (`replica_run_scope`), None elsewhere. A variable
    read is not watched by the tapes of the sibling replicas: tapes made
    under the same `run` token on another thread.
    """

    stopped = False
    paused = ()
    captures = ()
    pushed = None
    run = None
    freeing = False  # running the last walk of a non-persistent tape (`walk_frees`)

    def __init__(self):  # threading.local runs it once per thread, on first use there
        self.scope = object()


_thread_state = _ThreadState()

# torch's grad mode is thread-local, as the stop flag: `torch.no_grad()`, `inference_mode()` and
# `set_grad_enabled(False)` stop recording on the thread that enters them, so module code written for
# torch keeps its meaning (a value computed under no_grad is a constant). Bound once: this is read on
# every recorded op, after the cheaper "is any tape active" check.
_grad_enabled = torch.is_grad_enabled
_fwd_grad_enabled = torch._C._is_fwd_grad_enabled
_inference_mode = torch.is_inference_mode_enabled


def _grad_mode_stops():
    """True when torch's grad mode stops recording on this thread (read only once grad mode is off).

    torch runs an `autograd.Function`'s forward with grad mode and forward-mode
    AD both off; a user's `no_grad()` / `set_grad_enabled(False)` leaves
    forward-mode AD on, and `inference_mode()` says so itself. Inside such a
    forward (reentrant `torch.utils.checkpoint` is one) the function got
    dtape tensors, since `Function.apply` does not dispatch
    `__torch_function__`: dtape keeps recording there, or the gradient
    through the function would be lost (None) instead of the gradient of
    the ops it ran.
    """
    return _fwd_grad_enabled() or _inference_mode()


def _identity_resolver(variable):
    return (variable,)


def _resolve_each(variables):
    """`resolve_watched_all` from the one-variable resolver (a resolver registered without its list form)."""
    watched = [_resolve_watched(v) for v in variables]
    return watched, [tuple([w._handle() for w in ws]) for ws in watched]


def _identity_resolver_all(variables):
    return [(v,) for v in variables], [(v if vars(type(v)).get("_handle_is_self", False) else v._handle(),)
                                       for v in variables]


# Process-wide, set once at import of dtape.distribute (register_watched_variable_resolver).
_resolve_watched = _identity_resolver
_resolve_watched_all = _identity_resolver_all


def resolve_watched(variable):
    """What watching `variable` watches: the registered resolver's answer (identity without one)."""
    return _resolve_watched(variable)


def resolve_watched_all(variables):
    """(`[resolve_watched(v) for v in variables]`, the concrete handle (`_handle()`) of each variable of those,
    as a tuple per variable): the same answers, for a whole list at once (a wrapped module's dozens of
    parameters on every step: the resolver looks the thread's distribution context up once, not per variable)."""
    return _resolve_watched_all(variables)


def capturing_reads():
    """True while a `capture_variable_reads()` is active on this thread."""
    return bool(_thread_state.captures)


def walk_frees():
    """True while this thread runs a non-persistent tape's last backward walk (`imperative_grad(free=True)`).

    A record op whose state only that walk reads (a kept torch graph) may
    free it as it is used; a persistent tape, a jacobian's several walks, and
    records shared by several tapes keep it.
    """
    return _thread_state.freeing


class walk_scope(ThreadLocalScope):
    """Thread-local: the backward walk run inside is (True) or is not (False) its tape's last (`walk_frees`)."""

    __slots__ = ()
    _state = _thread_state
    _attr = "freeing"


def register_watched_variable_resolver(fn, fn_all=None):
    """Installs `fn(variable) -> iterable of variables to watch` (once per process), and its list form
    `fn_all(variables)`, which answers as `resolve_watched_all` (default: `fn` per variable).

    Raises:
      RuntimeError: if a resolver is already registered.
    """
    global _resolve_watched, _resolve_watched_all
    if _resolve_watched is not _identity_resolver:
        raise RuntimeError("a watched-variable resolver is already registered; register it only once")
    _resolve_watched = fn
    _resolve_watched_all = _resolve_each if fn_all is None else fn_all


class RecordOp:
    """What a tape records an op as: the protocol of every record op (the tape knows no op but this).

    A subclass declares, as class attributes (or slots) with these defaults:

    * `name`: the op's name, for messages.
    * `saves_inputs`, `saves_outputs`: whether the rule reads the values of
      the op's inputs, of its outputs. A record keeps the torch tensors it
      reads and only shape/dtype/device metadata of the rest, whatever
      the tapes watch, so a tensor watched after the op ran still gets its
      gradient.
    * `complex_grad`: how the rule treats complex values: True (right as
      written: dy times the conjugate derivative), "conj" (written for a
      holomorphic function with real coefficients, dy * f'(x): the walk
      passes it the conjugates of the saved tensors) or False (the walk
      refuses a complex gradient through it).
    * `raw_saved`: on a raw walk (nothing records it) the rule takes the
      saved torch tensors as they are; otherwise it gets dtape.Tensors
      rebuilt with their recorded ids.
    * `passthrough`: the rule is the identity from output k to input k
      (one per input; several variable reads as one record): the walk adds
      each output's gradient to its input's itself, without calling
      `backward`, so an output without a gradient leaves its input without one.

    and implements `backward`, the vector-Jacobian product.
    """

    __slots__ = ()
    name = "op"
    saves_inputs = True
    saves_outputs = True
    complex_grad = True
    raw_saved = False
    passthrough = False

    def backward(self, dys, outputs, inputs, attrs, raw, needs):
        """Input gradients: one per input (None for no gradient), each of its input's shape or broadcastable to it.

        Args:
          dys: one upstream gradient per output (zeros for an output that got none).
          outputs, inputs: what the record kept (see `saves_*`): torch
            tensors on a raw walk, dtape.Tensors otherwise, metadata with
            `shape`, `dtype`, `device` and `ndim` for what the rule does not read.
          attrs: the dict of non-tensor arguments given to `record`, or None.
          raw: True on a raw walk (torch tensors in and out).
          needs: one bool per input: whether the walk uses its gradient (a
            rule may skip the others and return None for them).
        """
        raise NotImplementedError(f"record op {type(self).__name__} does not define backward")

    def jvp(self, tangents, outputs, inputs, attrs):
        """Output tangents (forward mode), or NotImplemented: the accumulator then derives them from `backward`.

        Args:
          tangents: one per input: a dtape.Tensor of the input's shape, or
            None for an input without a tangent (at least one has one).
          outputs, inputs, attrs: the op's own outputs and inputs
            (dtape.Tensors, variables or Python scalars) and attrs, as given to `record`.

        Returns one tangent (dtape.Tensor or None) per output. A rule is
        written with torch functions and operators on dtape.Tensors, so a tape
        watching the tangents records it (gradients of JVPs).
        """
        return NotImplemented

    def recorded_again(self):
        """Hears that this op object is being recorded once more (`dtape.function` splicing a body's
        records onto the outer tapes): state that only one walk could use must now serve every walk."""


class _Meta:
    """Shape, dtype and device of a tensor a record does not keep (what unbroadcasting and zeros need)."""

    __slots__ = ("shape", "dtype", "device", "_id", "__weakref__")

    def __init__(self, t, tid=None):
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self._id = tid  # set only in `Tape.records()` views, which `record` may replay

    @property
    def ndim(self):
        return len(self.shape)

    def dim(self):
        return len(self.shape)

    def __repr__(self):
        return f"<saved metadata: shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device}>"


class _Ref(weakref.ref):
    """Weak reference to a recorded output Tensor, carrying its id for the death callback."""

    __slots__ = ("tid",)


_MANY = object()  # _Rec.s2 when the saved entries do not fit the three slots (then s0 holds their tuple)


class _Rec(_Ref):
    """One record: a weak reference to the op's first output that also holds the record.

    One GC-tracked object per recorded op (the collector's passes over long
    tapes cost more than the ops): the op, input and output ids, what the
    rule reads of the inputs then of the outputs (torch tensors, or `_Meta`
    for the rest) in the slots `s0`-`s2` (the common ops save at most three
    entries; more go in a tuple in `s0`), attrs, weak references to further
    outputs, `ver`, the sum of the saved torch tensors' version counters
    when they were saved (an in-place write to one of them raises at the
    walk, as in torch's autograd), and `amp`, the torch.autocast state the op
    ran under (`autocast_state()`; the walk runs its rule under the same).
    `op` is None once the record is deleted.
    """

    __slots__ = ("op", "in_ids", "out_ids", "s0", "s1", "s2", "attrs", "refs", "ver", "amp")

    @property
    def saved(self):
        """The saved entries: inputs then outputs."""
        if self.s2 is _MANY:
            return self.s0
        return (self.s0, self.s1, self.s2)[:len(self.in_ids) + len(self.out_ids)]

    def set_saved(self, saved):
        n = len(saved)
        if n > 3:
            self.s0, self.s1, self.s2 = saved, None, _MANY
        else:
            self.s0, self.s1, self.s2 = saved + (None,) * (3 - n)

    def split(self):
        """(saved inputs, saved outputs)."""
        n = len(self.in_ids)
        if self.s2 is _MANY:
            return self.s0[:n], self.s0[n:]
        if n == 2:
            return (self.s0, self.s1), ((self.s2,) if len(self.out_ids) == 1 else ())
        if n == 1:
            return (self.s0,), (self.s1, self.s2)[:len(self.out_ids)]
        saved = self.saved
        return saved[:n], saved[n:]

    def drop(self):
        """Deletes the record's content (trace deletion, release)."""
        self.op = self.s0 = self.s1 = self.s2 = self.attrs = self.refs = None


def _keep(x):
    """What a record keeps of a saved input or output: the torch tensor, or a variable/scalar as is."""
    return x._t if type(x) is Tensor else x


# Process-wide: one shared _Meta per (shape, dtype, device), so records of a
# chain of same-shaped ops allocate none. Cleared when large; races only
# create duplicates.
_meta_cache = {}


def _meta(x):
    """What a record keeps of an input or output its rule does not read: metadata (scalars as is)."""
    if type(x) is Tensor:
        t = x._t
        key = (t.shape, t.dtype, t.device)
    elif type(x) is _Meta or not hasattr(x, "shape") or getattr(x, "_dtape_variable", False):
        return x  # a variable stays: the model keeps it alive anyway, and dtape.function reads it back
    else:
        key = (x.shape, x.dtype, x.device)
    try:
        m = _meta_cache.get(key)
    except TypeError:  # symbolic sizes (a compiled function's None dims, while traced) do not hash
        return _Meta(x)
    if m is None:
        if len(_meta_cache) > 4096:
            _meta_cache.clear()
        m = _meta_cache[key] = _Meta(x)
    return m


def _save(op, inputs, outputs):
    """The saved inputs then outputs: what `op.saves_inputs` / `op.saves_outputs` say the rule reads.

    The rest is metadata, except that a single output of an op whose rule
    reads its inputs but not its output is saved as None (the walk needs
    nothing of it; multi-output ops keep metadata: the walk makes zero
    gradients from it).
    """
    keep_in, keep_out = op.saves_inputs, op.saves_outputs
    if len(outputs) == 1 and len(inputs) <= 2:  # the common shapes, without comprehensions
        x = inputs[0]
        if keep_out:
            o = outputs[0]._t
        else:
            o = None if keep_in else _meta(outputs[0])
        if len(inputs) == 1:
            return ((x._t if type(x) is Tensor else x) if keep_in else _meta(x), o)
        y = inputs[1]
        if keep_in:
            return (x._t if type(x) is Tensor else x, y._t if type(y) is Tensor else y, o)
        return (_meta(x), _meta(y), o)
    ins = [_keep(x) for x in inputs] if keep_in else _metas(inputs)
    return tuple(ins + ([o._t for o in outputs] if keep_out else _metas(outputs)))


def _metas(xs):
    """[_meta(x) for x in xs], a Tensor's found in the cache without a call (a wrapped module's op has
    one input per parameter)."""
    cache = _meta_cache
    try:
        return [cache[k] if type(x) is Tensor and (k := (x._t.shape, x._t.dtype, x._t.device)) in cache
                else _meta(x) for x in xs]
    except (TypeError, KeyError):  # symbolic sizes (a compiled function's None dims, while traced) do not
        return [_meta(x) for x in xs]  # hash; another thread cleared the cache between `in` and `[]`


_AMP_DEVICES = ("cpu", "cuda")
_any_autocast = torch._C._is_any_autocast_enabled


def autocast_state():
    """This thread's torch.autocast state: None when off, else ((device type, dtype), ...) of each enabled one."""
    if not _any_autocast():
        return None
    return tuple([(d, torch.get_autocast_dtype(d)) for d in _AMP_DEVICES if torch.is_autocast_enabled(d)]) or None


def set_autocast_state(amp):
    """Sets this thread's torch.autocast state to `amp` (an `autocast_state()` value); returns it."""
    on = dict(amp or ())
    for dev in _AMP_DEVICES:
        if dev in on:
            torch.set_autocast_enabled(dev, True)
            torch.set_autocast_dtype(dev, on[dev])
        elif torch.is_autocast_enabled(dev):
            torch.set_autocast_enabled(dev, False)
    return amp


def check_saved_versions(rec, inputs, outputs):
    """Raises RuntimeError if a tensor `rec` saved was written in place after the op was recorded.

    The rule would read the new values and give a wrong gradient silently
    (torch's autograd refuses the same way, from the same version counters).
    """
    now = 0
    try:
        for x in inputs:  # two plain loops (no tuple, no call): this runs once per record of every walk
            if isinstance(x, torch.Tensor):
                now += x._version
        for x in outputs:
            if isinstance(x, torch.Tensor):
                now += x._version
    except RuntimeError:  # an inference tensor (made under torch.inference_mode) has no version counter
        now = _version_sum(inputs + outputs)
    if now != rec.ver:
        shapes = [tuple(x.shape) for x in inputs + outputs if isinstance(x, torch.Tensor)]
        raise RuntimeError(
            f"a tensor saved for the gradient of op {rec.op.name!r} (saved tensors of shapes {shapes}) was "
            f"modified by an in-place operation after the op ran (version counters sum {now}, "
            f"{rec.ver} when saved), so its gradient cannot be computed: write into a copy "
            "(t.torch().clone()) or run the op after the in-place write")


def _version_sum(tensors):
    """The sum of the version counters of the torch tensors in `tensors`, inference tensors counting 0.

    A tensor made under `torch.inference_mode` has no version counter, and
    outside that mode it cannot be written in place (torch refuses), so
    there is nothing to check for it.
    """
    return sum(x._version for x in tensors if isinstance(x, torch.Tensor) and not x.is_inference())


def is_meta(x):
    """True for a record entry kept only as shape/dtype/device metadata."""
    return type(x) is _Meta


def rebuild(x, tid):
    """A saved torch tensor as the dtape.Tensor it was recorded from (same id: outer tapes know it)."""
    if not isinstance(x, torch.Tensor) or tid is None:
        return x
    t = Tensor.__new__(Tensor)
    t._t, t._id = x, tid
    return t


class _Unsaved:
    """Stands in `Tape.records()` for an output a record did not keep (its rule reads only inputs)."""

    __slots__ = ("_id", "__weakref__")

    def __init__(self, tid):
        self._id = tid


def _view(x, tid):
    """A saved entry for `Tape.records()`: a dtape.Tensor with the recorded id.

    An input or output kept only as metadata comes back as a zero tensor
    of its shape, dtype and device that owns one element (an expanded
    scalar): `dtape.function` re-records and connects such entries by id,
    and the op's rule never reads their values.
    """
    if tid is None:
        return x
    if x is None:
        return _Unsaved(tid)
    if type(x) is _Meta:
        x = torch.zeros((), dtype=x.dtype, device=x.device).expand(x.shape)
    return rebuild(x, tid)


class Tape:
    """One gradient tape: watched ids, watched variables and the op records.

    Records are `_Rec` objects in recording order, one per op. What a
    record saves of each input and output is what the op's rule reads
    (`op.saves_inputs`, `op.saves_outputs`); the rest is kept as
    shape/dtype/device metadata (`_Meta`). Saved tensors are torch tensors,
    so the user's dtape.Tensor objects can die.

    Trace deletion (TF's TapeSetDeleteTrace, point 2): `_usage[id]` counts
    the records that use a tensor id as input, plus one while a recorded
    output Tensor is alive. The record is a weak reference to its output
    whose callback queues it; the queue is drained under the lock (on the
    next record or read of the tape), and a record whose outputs all reached
    zero is deleted, with its inputs' counts decremented in turn.

    `op.backward(dys, outputs, inputs, attrs, raw, needs)` gives input gradients (`RecordOp`).
    """

    __slots__ = ("persistent", "watch_accessed_variables", "_lock", "_recs", "_nrec", "_usage",
                 "_producer", "_pending", "_on_death",
                 "_watched", "_watched_vars", "_accessed", "_explicit", "_owner", "_run", "_stands_for",
                 "__weakref__")
    # A forward accumulator (dtape.autodiff) is a tape in the same set that keeps no records: `record`
    # hands it each op on a watched input (`accumulate`) once the tapes recorded the op.
    accumulates = False

    def __init__(self, persistent=False, watch_accessed_variables=True):
        self.persistent = persistent
        self.watch_accessed_variables = watch_accessed_variables
        self._lock = threading.Lock()
        self._pending = []  # _Refs of dead outputs, appended by the weakref callback (no lock: list.append)
        self._on_death = self._pending.append  # bound to the list, not the tape: no reference cycle
        self._clear_records()
        self._watched = set()
        self._watched_vars = {}  # id(var) -> var, insertion (first-watch) ordered
        self._accessed = set()   # _id of variables whose reads were already resolved and watched
        self._explicit = set()   # _id of variables watched by `watch`: their reads follow to any thread
        self._owner = _thread_state.scope  # the creating thread's tape scope
        self._run = _thread_state.run  # the strategy.run whose replica created it (None elsewhere)
        self._stands_for = ()  # dtape.function's private tape: the caller's tapes it records for

    def _clear_records(self):
        self._recs = []       # _Rec per record, in recording order (deleted ones until compaction)
        self._nrec = 0        # live records
        self._usage = {}      # tensor id -> uses (records using it as input, +1 while a recorded output lives)
        self._producer = {}   # output id -> the _Rec that produced it
        del self._pending[:]

    def _watch_ids(self, ids):
        with self._lock:
            self._watched.update(ids)

    def _watch_variable(self, variable, explicit=False):
        handle = variable._handle()
        with self._lock:
            self._watched_vars.setdefault(id(variable), variable)
            self._watched.add(handle._id)
            if explicit:
                self._explicit.add(handle._id)

    def _watch_accessed(self, key, variables):
        """Watches the resolved `variables` of an accessed variable and remembers `key` as done."""
        handles = [v._handle()._id for v in variables]
        with self._lock:
            for v in variables:
                self._watched_vars.setdefault(id(v), v)
            self._watched.update(handles)
            self._accessed.add(key)

    def _watch_accessed_all(self, accessed):
        """`_watch_accessed(v._id, resolve_watched(v))` for each variable of `accessed`, under one lock."""
        watched, handles = _resolve_watched_all(accessed)  # the whole list at once
        resolved = [w for ws in watched for w in ws]
        handles = [h._id for hs in handles for h in hs]
        with self._lock:  # in bulk: `update` keeps a watched variable's first-watch position, as setdefault
            self._watched_vars.update(zip(map(id, resolved), resolved))
            self._watched.update(handles)
            self._accessed.update([v._id for v in accessed])

    def watched_variables(self):
        """Variables watched so far, in first-watch order, without duplicates."""
        with self._lock:
            return tuple(self._watched_vars.values())

    # -- records -------------------------------------------------------------
    def _more_refs(self, outputs, out_ids):
        """Weak references to the outputs after the first (whose reference is the record itself)."""
        cb = self._on_death
        refs = [_Ref(o, cb) for o in outputs[1:]]
        for r, i in zip(refs, out_ids[1:]):
            r.tid = i
        return refs

    def _drain(self):
        """Deletes the traces of the outputs that died since the last drain (caller holds the lock).

        Each dead output drops one use of its id; an id with no use left
        deletes the record that produced it once all that record's outputs
        are unused, which drops one use of each of its inputs in turn (TF
        GradientTape::DeleteTrace, iterative: chains can be 100,000 long).
        """
        usage, producer, watched, pending = self._usage, self._producer, self._watched, self._pending
        stack = []  # ids whose use a deleted record dropped; dead outputs come straight from `pending`
        while stack or pending:  # one call per dead output in the common case (a use left): a module's
            i = stack.pop() if stack else pending.pop().tid  # parameter reads die together, every step
            if i not in usage:
                continue
            n = usage[i]
            if n > 1:
                usage[i] = n - 1
                continue
            del usage[i]
            rec = producer.pop(i, None)
            if rec is None:
                continue
            watched.discard(i)
            for o in rec.out_ids:
                if o in usage:
                    break  # another output of the same op is still alive or used
            else:
                for j in rec.in_ids:
                    if j is not None:
                        stack.append(j)
                rec.drop()
                self._nrec -= 1
        if len(self._recs) > 256 and len(self._recs) > 2 * self._nrec:
            self._recs = [r for r in self._recs if r.op is not None]

    def _live(self):
        """The live record objects in recording order, after deleting the traces of dead outputs.

        A list of the tape's own `_Rec`s (no per-record allocation: the walk
        reads their attributes).
        """
        with self._lock:
            if self._pending:
                self._drain()
            return [r for r in self._recs if r.op is not None]

    def records(self):
        """A snapshot of the records, in recording order: tuples (op, in_ids, out_ids, inputs, outputs, attrs).

        Saved tensors come back as dtape.Tensors with their recorded ids; what
        the op's rule does not read comes back as shape/dtype/device metadata.
        """
        out = []
        for r in self._live():
            ins, outs = r.split()
            out.append((r.op, r.in_ids, r.out_ids, tuple([_view(x, i) for x, i in zip(ins, r.in_ids)]),
                        tuple([_view(o, i) for o, i in zip(outs, r.out_ids)]), r.attrs))
        return out

    def reset(self):
        """Forgets all records and watches; the tape stays in the active set."""
        with self._lock:
            self._clear_records()
            self._watched = set()
            self._watched_vars = {}
            self._accessed = set()
            self._explicit = set()

    def release(self):
        """Drops the records (a non-persistent tape after its gradient)."""
        with self._lock:
            self._clear_records()

    def num_records(self):
        """Number of records the tape holds (after deleting the traces of dead tensors)."""
        with self._lock:
            if self._pending:
                self._drain()
            return self._nrec

    def nbytes(self):
        """Bytes of tensor storage the records keep alive, each storage counted once.

        Counts the torch tensors saved for gradient rules, those stashed in
        attrs included (a view counts its whole storage, which it keeps
        alive); variables are not counted.
        """
        seen = {}
        for rec in self._live():
            for x in rec.saved + _attr_tensors(rec.attrs):
                if isinstance(x, torch.Tensor):
                    st = x.untyped_storage()
                    seen[(x.device, st.data_ptr())] = st.nbytes()
        return sum(seen.values())


def _attr_tensors(attrs):
    """Torch tensors a record keeps in its attrs (what a forward stashed for its rule: layer_norm's statistics)."""
    if not attrs:
        return ()
    out = ()
    for v in attrs.values():
        out += (v,) if isinstance(v, torch.Tensor) else tuple(v) if type(v) is tuple else ()
    return out


def push_new_tape(persistent=False, watch_accessed_variables=True):
    """Creates a tape, adds it to the process-global set and returns it."""
    tape = Tape(persistent, watch_accessed_variables)
    with _set_lock:
        _publish(_tape_set + (tape,))
    if _thread_state.pushed is not None:
        _thread_state.pushed.add(tape)
    return tape


def push_tape(tape):
    """Adds an existing tape back to the active set (no-op if present); the calling thread owns it."""
    tape._owner, tape._run = _thread_state.scope, _thread_state.run
    with _set_lock:
        if tape not in _tape_set:
            _publish(_tape_set + (tape,))
    if _thread_state.pushed is not None:
        _thread_state.pushed.add(tape)


def pop_tape(tape):
    """Removes `tape` from the active set, whatever its position (no stack order)."""
    with _set_lock:
        _publish(tuple(t for t in _tape_set if t is not tape))
    if _thread_state.pushed is not None:
        _thread_state.pushed.discard(tape)


class PushedTapes:
    """The tapes pushed on one thread (inside `track_pushed_tapes`) and not popped there since.

    Thread-safe: `detach()` may run on another thread, e.g. to remove the
    tapes of a replica thread that was abandoned while stuck.
    """

    __slots__ = ("_lock", "_tapes")

    def __init__(self):
        self._lock = threading.Lock()
        self._tapes = {}  # id -> tape

    def add(self, tape):
        with self._lock:
            self._tapes[id(tape)] = tape

    def discard(self, tape):
        with self._lock:
            self._tapes.pop(id(tape), None)

    def detach(self):
        """Removes every tracked tape from the active set; returns how many there were."""
        with self._lock:
            tapes, self._tapes = list(self._tapes.values()), {}
        for tape in tapes:
            pop_tape(tape)
        return len(tapes)


class track_pushed_tapes(ThreadLocalScope):
    """Thread-local: records in a PushedTapes the tapes pushed on this thread inside the block."""

    __slots__ = ()
    _state = _thread_state
    _attr = "pushed"


def _recording_tapes():
    """Tapes that record on this thread now (empty when stopped or torch's grad mode is off)."""
    state = _thread_state
    if state.stopped or not _grad_enabled() and _grad_mode_stops():
        return ()
    tapes = _tape_set
    if state.paused:
        tapes = tuple(t for t in tapes if t not in state.paused)
    return tapes


def recording_tapes():
    """Tapes that record on this thread now (empty when stopped or paused)."""
    return _recording_tapes()


def watch(tape, tensor):
    """Marks `tensor` (a dtape.Tensor) as watched by `tape`."""
    tape._watch_ids((tensor._id,))


def watch_variable(tape, variable):
    """Marks `variable` as watched by `tape`, as the registered resolver resolves it.

    An explicitly watched variable's reads are recorded on any thread
    (explicit watches follow data, seed 1).
    """
    for v in _resolve_watched(variable):
        tape._watch_variable(v, explicit=True)


def variable_accessed(variable):
    """Notifies the active tapes that `variable` was read on this thread.

    Every tape with `watch_accessed_variables` watches it, on whatever
    thread it was opened (seed 1), except the tapes of the sibling replicas
    of the `strategy.run` this thread serves (see `replica_run_scope`) and
    tapes paused here; an active `capture_variable_reads()` on this thread
    records it regardless of the stop flag.
    """
    state = _thread_state
    if state.captures:
        state.captures[-1].setdefault(id(variable), variable)
    if state.stopped or not _grad_enabled() and _grad_mode_stops():
        return
    key = getattr(variable, "_id", None)
    run, scope, paused = state.run, state.scope, state.paused
    for tape in _tape_set:
        if tape.watch_accessed_variables and not (run is not None and tape._run is run and tape._owner is not scope) \
                and not (paused and tape in paused) and (key is None or key not in tape._accessed):
            if key is None:
                for v in _resolve_watched(variable):
                    tape._watch_variable(v)
            else:
                tape._watch_accessed(key, _resolve_watched(variable))


def variable_read(variable, out, op):
    """The tape side of `Variable.read_value`: notifies the tapes, then records `op` from the variable to `out`.

    The read is recorded on the tapes that watch the variable, except the
    tapes of sibling replicas (same `strategy.run`, another replica thread)
    that did not watch it explicitly. A tape that already resolved this
    variable is skipped without calling the resolver or taking its lock.
    """
    state = _thread_state
    trainable = variable._trainable
    if trainable and state.captures:
        state.captures[-1].setdefault(id(variable), variable)
    vid = variable._id
    foreign = ()  # sibling replicas' tapes: they must not record this replica's read
    # variable_accessed inlined: this is the hot path of every variable operand
    if not (state.stopped or not _grad_enabled() and _grad_mode_stops()):
        run, scope, paused = state.run, state.scope, state.paused
        for tape in _tape_set:
            if run is not None and tape._run is run and tape._owner is not scope:
                if vid not in tape._explicit:
                    foreign += (tape,)
            elif trainable and tape.watch_accessed_variables and vid not in tape._accessed and \
                    not (paused and tape in paused):
                tape._watch_accessed(vid, _resolve_watched(variable))
    if not foreign:
        record(op, (vid,), (variable,), (out,), None)
        return
    prev = state.paused
    state.paused = prev + foreign
    try:
        record(op, (vid,), (variable,), (out,), None)
    finally:
        state.paused = prev


def variables_read(variables, outs, op, read_op):
    """`variable_read(variables[k], outs[k], read_op)` for every k, the recorded reads as one record of `op`.

    Each tape watches what `variable_read` makes it watch, and each read is
    recorded by the tapes that would record it alone (those watching the
    variable; a sibling replica's tape only through an explicit watch).
    When every tape that records any of these reads records the same ones
    (one tape; tapes that watch alike), those reads become one record of
    `op` (a `passthrough` op: inputs those variables, outputs their
    values); otherwise each read is recorded alone, with `read_op`.
    """
    state = _thread_state
    if state.captures:
        captured = state.captures[-1]
        for v in variables:
            if v._trainable:
                captured.setdefault(id(v), v)
    if state.stopped or not _grad_enabled() and _grad_mode_stops():
        return
    run, scope, paused = state.run, state.scope, state.paused
    foreign, common = (), None  # common: the positions of the reads that the recording tapes record
    for tape in _tape_set:
        if paused and tape in paused:
            continue
        if run is not None and tape._run is run and tape._owner is not scope:
            explicit, watched = tape._explicit, tape._watched
            ks = [k for k, v in enumerate(variables) if v._id in explicit and v._id in watched]
            if not ks:
                foreign += (tape,)
                continue
        else:
            if tape.watch_accessed_variables:
                accessed = tape._accessed
                todo = [v for v in variables if v._trainable and v._id not in accessed]
                if todo:
                    tape._watch_accessed_all(todo)
            watched = tape._watched
            ks = [k for k, v in enumerate(variables) if v._id in watched]
            if not ks:
                continue
        if common is None:
            common = ks
        elif ks != common:  # the tapes record different reads: one record each, as variable_read
            for v, out in zip(variables, outs):
                variable_read(v, out, read_op)
            return
    if common is not None:
        _record_reads(op, [variables[k] for k in common], [outs[k] for k in common], state, foreign)


def _record_reads(op, variables, outs, state, foreign):
    """Records `op` from `variables` to `outs` (keeping the variables and their values' metadata), with
    the `foreign` tapes paused."""
    args = (op, tuple([v._id for v in variables]), tuple(variables), tuple(outs), None,
            (*variables, *_metas(outs)))
    if not foreign:
        record(*args)
        return
    prev = state.paused
    state.paused = prev + foreign
    try:
        record(*args)
    finally:
        state.paused = prev


def record_reading(op, in_ids, inputs, outputs, attrs):
    """`record` for an op that takes variables among its inputs (a `dtape.function` call's op).

    Sibling replicas' tapes (same `strategy.run`, another replica thread)
    record it only through an input they watch that is not a variable, or a
    variable they watched explicitly, as `variable_read` treats a plain read:
    every replica reads a shared variable itself, so every replica's tape
    watches it, and recording the siblings' ops through it would make each
    replica's tape record every replica's forward.
    """
    state = _thread_state
    run = state.run
    foreign = ()
    if run is not None and not state.stopped:
        scope = state.scope
        variables = {i for i, x in zip(in_ids, inputs) if i is not None and is_variable(x)}
        for tape in _tape_set:
            if tape._run is run and tape._owner is not scope:
                watched, explicit = tape._watched, tape._explicit
                if not any(i in watched and (i not in variables or i in explicit) for i in in_ids):
                    foreign += (tape,)
    if not foreign:
        record(op, in_ids, inputs, outputs, attrs)
        return
    prev = state.paused
    state.paused = prev + foreign
    try:
        record(op, in_ids, inputs, outputs, attrs)
    finally:
        state.paused = prev


def stand_in(tape):
    """Makes `tape` stand in for the tapes recording on this thread (`dtape.function`'s private tape).

    While the caller's tapes are paused for the body, `tape` watches the
    variables they watch explicitly (a non-trainable one, say, stays
    connected) and pausing one of them (`GradientTape.stop_recording()` in
    the body) pauses `tape` too.
    """
    outers = _recording_tapes()
    tape._stands_for = outers
    for outer in outers:
        with outer._lock:
            explicit = set(outer._explicit)
        with tape._lock:
            tape._explicit.update(explicit)
            tape._watched.update(explicit)


class replica_run_scope(ThreadLocalScope):
    """Thread-local: this thread runs one replica of the `strategy.run` call identified by `run`.

    `run` is any object, one per `strategy.run` call, entered by every
    replica thread of that call: a tape opened inside the block ignores the
    variable reads of the other threads in the same run (the sibling
    replicas), so its records do not grow with the number of replicas.
    Restores the previous value on exit.
    """

    __slots__ = ()
    _state = _thread_state
    _attr = "run"


def _ids(tensors):
    return tuple([getattr(t, "_id", None) for t in tensors])


def should_record(tensors):
    """True if a tape recording on this thread watches any of `tensors`."""
    tapes = _recording_tapes()
    if not tapes:
        return False
    ids = _ids(tensors)
    return any(i in tape._watched for tape in tapes for i in ids)


def record(op, in_ids, inputs, outputs, attrs, saved=None):
    """Records `op` on each tape recording on this thread that watches an input.

    The record keeps what `op` declares its rule reads (`saves_inputs`,
    `saves_outputs`) and shape/dtype/device metadata for the rest, and is
    deleted once its outputs died and no later record needs them (trace
    deletion).

    Args:
      op: a `RecordOp`.
      in_ids: tuple of the inputs' ids (None for Python scalars).
      inputs: tuple of Tensors, Variables or Python scalars.
      outputs: tuple of Tensors.
      attrs: dict of non-tensor arguments (given back to `op.backward`), or None.
      saved: what the record keeps, as `_save(op, inputs, outputs)` would give it, when the caller
        built it already (None: built here); for an op that saves neither inputs nor outputs, no torch
        tensor (metadata, variables, scalars), as `_save` gives.
    """
    state = _thread_state
    if state.stopped or not _grad_enabled() and _grad_mode_stops():
        return
    out_ids = None
    accumulators = ()
    for tape in _tape_set:
        watched = tape._watched
        for i in in_ids:
            if i in watched:
                break
        else:
            continue
        if state.paused and tape in state.paused:
            continue
        if tape.accumulates:
            accumulators += (tape,)
            continue
        if tape._stands_for and tape._run is not None and tape._run is state.run and tape._owner is not state.scope:
            # a dtape.function's private tape made in one replica: the sibling replicas' ops (on a tensor
            # they share, say) are no part of its call, and its backward would splice them onto this tape
            continue
        if out_ids is None:
            out_ids = (outputs[0]._id,) if len(outputs) == 1 else tuple([o._id for o in outputs])
            if saved is None:
                saved = _save(op, inputs, outputs)
            n_saved = len(saved)
            ver = 0  # inline (no call): every recorded op runs this
            if op.saves_inputs or op.saves_outputs:  # else only metadata, variables and scalars: no version
                try:
                    for x in saved:
                        if isinstance(x, torch.Tensor):
                            ver += x._version
                except RuntimeError:  # an inference tensor has no version counter
                    ver = _version_sum(saved)
            amp = autocast_state() if _any_autocast() else None
        with tape._lock:
            # reset() may have replaced the sets since the unlocked check: re-check, so a
            # record and its outputs' watch land in the same generation of the tape.
            if tape._watched is not watched and not any(i in tape._watched for i in in_ids):
                continue
            if len(tape._pending) > 32:  # deaths are processed in batches (and before any read)
                tape._drain()
            cb = tape._on_death  # the record is built inline: this is every recorded op's path
            rec = _Rec(outputs[0], cb)
            rec.tid, rec.op, rec.in_ids, rec.out_ids, rec.attrs, rec.refs, rec.ver, rec.amp = \
                out_ids[0], op, in_ids, out_ids, attrs, None, ver, amp
            if n_saved == 3:
                rec.s0, rec.s1, rec.s2 = saved
            elif n_saved == 2:
                rec.s0, rec.s1, rec.s2 = saved[0], saved[1], None
            else:
                rec.set_saved(saved)
            tape._recs.append(rec)
            usage, producer = tape._usage, tape._producer
            for i in in_ids:  # operators, not dict methods: a module's op has one input per parameter
                if i is not None:
                    usage[i] = usage[i] + 1 if i in usage else 1
            if len(outputs) == 1:
                o = out_ids[0]
                usage[o] = usage[o] + 1 if o in usage else 1
                producer[o] = rec
                tape._watched.add(o)
            else:
                rec.refs = tape._more_refs(outputs, out_ids)
                for o in out_ids:
                    usage[o] = usage[o] + 1 if o in usage else 1
                    producer[o] = rec
                tape._watched.update(out_ids)
            tape._nrec += 1
    # after the tapes: the tangents are computed from the outputs, whose records a tape recording that
    # computation (the gradient of a JVP) must already hold, in creation order (TF's order)
    for acc in accumulators:
        acc.accumulate(op, in_ids, inputs, outputs, attrs)


class CallableBackward(RecordOp):
    """Adapts a seed-style `backward_function(*output_grads)` to a record op."""

    __slots__ = ("name", "fn")

    def __init__(self, name, fn):
        self.name = name
        self.fn = fn

    def backward(self, dys, outputs, inputs, attrs, raw, needs):
        if raw:  # the seed contract gives dtape.Tensors to backward_function
            dys = [Tensor(d) for d in dys]
        grads = self.fn(*dys)
        grads = grads if isinstance(grads, (tuple, list)) else (grads,)
        return [to_walk_grad(g, raw) for g in grads]


def to_walk_grad(g, raw):
    """A user-returned gradient as the backward walk wants it: torch.Tensor (raw) or dtape.Tensor."""
    if g is None:
        return None
    if raw:
        return g if isinstance(g, torch.Tensor) else convert_to_tensor(g).torch()
    return g if isinstance(g, Tensor) else convert_to_tensor(g)


def record_operation(op_type, output_tensors, input_tensors, backward_function):
    """Records one op given by a backward function (seed API).

    Args:
      op_type: name of the op, for messages.
      output_tensors: list of dtape.Tensors produced.
      input_tensors: list of dtape.Tensors consumed.
      backward_function: `f(*output_grads) -> input grads` (one per input,
        None allowed); it receives dtape.Tensors.
    """
    if _tape_set:
        inputs = tuple(input_tensors)
        record(CallableBackward(op_type, backward_function), _ids(inputs), inputs,
               tuple(output_tensors), None)


def delete_trace(tensor_id):
    """Makes every tape forget tensor id `tensor_id` (it will not be watched)."""
    for tape in _tape_set:
        with tape._lock:
            tape._watched.discard(tensor_id)


def could_possibly_record():
    """True if some tape is active and this thread is not stopped."""
    return bool(_recording_tapes())


class stop_recording(ThreadLocalScope):
    """Pauses recording of every tape on this thread only (thread-local).

    Other threads keep recording into the same tapes. Nests and restores the
    previous state on exit, also on exceptions.

    Example:
      >>> with dtape.stop_recording():
      ...     y = x * 2          # not recorded on any tape, on this thread
    """

    __slots__ = ()
    _state = _thread_state
    _attr = "stopped"

    def __init__(self):
        super().__init__(True)


class pause_tape(ThreadLocalScope):
    """Pauses one tape on this thread only; other tapes and threads keep recording.

    Tapes standing in for it (`dtape.function` bodies) pause with it.
    """

    __slots__ = ()
    _state = _thread_state
    _attr = "paused"

    def _new(self, prev):
        tape = self._value
        return prev + (tape,) + tuple(t for t in _tape_set if tape in t._stands_for)


class pause_from(ThreadLocalScope):
    """Thread-local: pauses `tape` and every tape or accumulator made active after it, on this thread.

    What an accumulator's own tangent computation runs under: tapes and
    accumulators entered before it see that computation (gradients of JVPs,
    higher-order JVPs), those entered inside it do not (TF's strict nesting).
    """

    __slots__ = ()
    _state = _thread_state
    _attr = "paused"

    def _new(self, prev):
        tapes = _tape_set
        k = tapes.index(self._value) if self._value in tapes else len(tapes)
        return prev + tapes[k:]


class pause_accumulators(ThreadLocalScope):
    """Thread-local: pauses every active forward accumulator on this thread (tapes keep recording)."""

    __slots__ = ()
    _state = _thread_state
    _attr = "paused"

    def _new(self, prev):
        return prev + tuple(t for t in _tape_set if t.accumulates)


def accumulating():
    """True if a forward accumulator records on this thread now."""
    return any(t.accumulates for t in _recording_tapes())


class _pause_all_but(ThreadLocalScope):
    """Thread-local: pauses every active tape but `tape` on this thread."""

    __slots__ = ()
    _state = _thread_state
    _attr = "paused"

    def _new(self, prev):
        return tuple(t for t in _tape_set if t is not self._value)


class record_only:
    """Thread-local: on this thread, only `tape` records (the stop flag is lifted).

    Used to record a body on a private tape whatever the caller's state
    (stopped, torch's grad mode off, or other tapes active); restores the
    previous state on exit. Grad mode is part of the stop flag, so it is
    enabled in the block: a `recompute_grad` body re-run by a walk that the
    user started under `torch.no_grad()` must still record on its tape.
    """

    __slots__ = ("_scopes",)

    def __init__(self, tape):
        self._scopes = (_resume_recording(False), torch.enable_grad(), _pause_all_but(tape))

    def __enter__(self):
        for scope in self._scopes:
            scope.__enter__()
        return self

    def __exit__(self, *exc):
        for scope in reversed(self._scopes):
            scope.__exit__(*exc)
        return False


class _resume_recording(ThreadLocalScope):
    """Thread-local: sets the stop flag to the given value (False lifts an outer `stop_recording`)."""

    __slots__ = ()
    _state = _thread_state
    _attr = "stopped"


class capture_variable_reads(ThreadLocalScope):
    """Collects, on this thread, every variable reported by `variable_accessed`.

    Used by `dtape.function` to find the variables its body reads; works
    under `stop_recording`. `as` gives a dict id -> variable, in first-read order.
    """

    __slots__ = ()
    _state = _thread_state
    _attr = "captures"

    def __init__(self):
        super().__init__({})

    def _new(self, prev):
        return prev + (self._value,)

    def __enter__(self):
        super().__enter__()
        return self._value


__all__ = ["Tape", "RecordOp", "check_saved_versions", "active_tapes", "recording_tapes", "push_new_tape", "push_tape", "pop_tape",
           "watch", "watch_variable", "variable_accessed", "variable_read", "replica_run_scope", "should_record", "record", "record_reading",
           "record_operation", "delete_trace",
           "could_possibly_record", "stop_recording", "pause_tape", "pause_from", "pause_accumulators", "accumulating", "record_only", "capture_variable_reads",
           "register_watched_variable_resolver", "resolve_watched", "resolve_watched_all", "walk_frees", "walk_scope", "autocast_state", "set_autocast_state", "stand_in", "capturing_reads", "PushedTapes", "track_pushed_tapes"]
