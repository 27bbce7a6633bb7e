"""Bucketed gradient all-reduce, overlapped with the backward walk; uneven batches; accumulation.

How the overlap works (DDP's reducer, on the tape):

* `GradientTape(gradient_sync=GradientSync())` in a replica context of a
  strategy with more than one replica opens a session at `tape.gradient`.
  The session lays the float sources out in buckets of about
  `bucket_cap_mb` (flattened, one dtype per bucket; the first bucket only
  `first_bucket_cap_mb`, 1 MB, as DDP, so the first all-reduce starts
  while the walk still has most of its work ahead) in order of readiness:
  the first call for a list of sources uses reverse source order (DDP's
  guess) and records the order in which the walk finishes them; replica
  0's order is then shared with every replica (one small all-reduce, once)
  and later calls bucket in it (DDP's bucket rebuild). The layout depends
  only on the sources' shapes and that agreed order, so every replica
  builds the same buckets.
* The backward walk tells the session when a source's gradient is final
  (the walk has processed its last consumer record; `backprop._Readiness`),
  in one call for all the sources a record finishes (a wrapped torch
  module's parameters, read in one record, all at once).
  The session notes them in their buckets; once every member of a bucket is in,
  and every earlier bucket has been launched, it launches that bucket's
  all-reduce asynchronously (`strategy.extended._all_reduce_flat_async`:
  across processes the bucket's gradients are copied into one flat buffer,
  one collective each; CPU replica threads sum them as they are) and the walk
  goes on. Buckets are launched in bucket order on every
  replica, so the k-th collective of every replica is the same bucket.
  Across workers the first bucket's signature check announces the later
  buckets' sizes (`_ledger`), so they start without a check round trip
  each (collective_ops: a worker that enters something else instead still
  makes every worker raise CollectiveMismatchError).
* A source with no gradient on this replica (None: not connected here)
  goes into its bucket as zeros, with a presence flag of 0. Each bucket
  carries one presence flag per member, summed with it: a variable is
  None after the reduction only if it is None on every replica. So
  replicas agree without scanning the graph and without a hang (no DDP
  `find_unused_parameters`).
* `tape.gradient` returns the local gradients (TF semantics, exactly).
  `optimizer.apply_gradients` in a replica context uses the launched
  reductions only if every gradient it is given is the very object
  `tape.gradient` returned for that variable in the same step (an identity
  check; None included; the record goes with the step's replica context);
  otherwise (clipped, scaled, accumulated gradients) it reduces
  what it is given afresh, bucketed the same way: one reduction per bucket,
  not per variable.

Every replica must call `tape.gradient` with the same sources, and
`apply_gradients` with the same variables, in the same order: they are
collectives. A mismatch raises ValueError (or TimeoutError), never a silent mix: each bucket's
all-reduce carries which variable is at each position (`_SourceIds`, built with the layout), compared by
the replica threads before the sum, and across workers as a digest of the names (with each variable's
`_name_ordinal` among same-named ones) and shapes in the bucket's signature (collective_ops).

Source: torch.nn.parallel.DistributedDataParallel's reducer (buckets,
readiness, bucket_cap_mb=25), Horovod's DistributedGradientTape.
"""
import operator
import threading
import zlib

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from dtape import _config
from dtape import tape as _tp
from dtape.backprop import profile_range
from dtape.distribute import collective_ops, context, values
from dtape.distribute.cross_device_ops import accumulation_dtype
from dtape.distribute.reduce_util import ReduceOp
from dtape.nn import compute_average_loss  # noqa: F401  (one function, public under both names)
from dtape.tensor import Tensor, convert_to_tensor, next_id, normalize_device
from dtape.variables import tracing_body

DEFAULT_BUCKET_CAP_MB = 25.0
DEFAULT_FIRST_BUCKET_CAP_MB = 1.0  # DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)


def _check_cap(bucket_cap_mb, name="bucket_cap_mb"):
    cap = float(bucket_cap_mb)
    if not cap > 0:
        raise ValueError(f"{name} must be a positive number of megabytes, got {bucket_cap_mb!r}")
    return int(cap * 2**20)


def _caps(cap_bytes, first_cap_bytes):
    """(cap, first bucket's cap) in bytes; the first never larger than the others."""
    return cap_bytes, min(cap_bytes, first_cap_bytes)


class GradientSync:
    """Opt-in: start the gradient all-reduce during `tape.gradient`'s backward walk.

    Args:
      bucket_cap_mb: megabytes (2**20 bytes) of gradients per bucket (default
        25, as DDP). Smaller buckets start earlier; larger ones make fewer
        collectives.
      first_bucket_cap_mb: the first bucket's cap (default 1, as DDP; at
        most bucket_cap_mb): the gradients ready first go out in a small
        all-reduce while the walk computes the rest.
      order: "readiness" (default): the first `tape.gradient` call for a
        given list of sources buckets them in reverse source order and
        records the order in which the walk finished them; replica 0's order
        is shared with every replica (one small all-reduce, once) and later
        calls bucket in that order (DDP's bucket rebuild). "reverse": always
        reverse source order, no extra all-reduce.

    Use it as `dtape.GradientTape(gradient_sync=dtape.distribute.GradientSync())`
    inside `strategy.run`; then `optimizer.apply_gradients(zip(grads, vars))`
    waits for the launched reductions instead of reducing again. Outside a
    replica context, or with one replica, it does nothing. One object may
    serve every replica and every step. See the module docstring for the
    design and its rules (every replica calls `tape.gradient` with the same
    sources). Each replica's bucket layout is kept while `tape.gradient` gets
    the very same source objects in the same order (a training loop's
    variables), as DDP builds its buckets once.

    Raises:
      ValueError: a non-positive bucket_cap_mb or first_bucket_cap_mb, or an
        unknown order; (at `tape.gradient`) a gradient whose size is not its
        source's as laid out (a source reshaped in place between steps).
    """

    def __init__(self, bucket_cap_mb=DEFAULT_BUCKET_CAP_MB, order="readiness",
                 first_bucket_cap_mb=DEFAULT_FIRST_BUCKET_CAP_MB):
        if order not in ("readiness", "reverse"):
            raise ValueError(f"GradientSync order must be 'readiness' or 'reverse', got {order!r}")
        self.bucket_cap_bytes, self.first_bucket_cap_bytes = _caps(
            _check_cap(bucket_cap_mb), _check_cap(first_bucket_cap_mb, "first_bucket_cap_mb"))
        self.order = order
        self._lock = threading.Lock()
        # (strategy id, sources' shapes and dtypes) -> agreed readiness order. One entry for all the
        # replicas of a process: the first replica back from the agreement adopts the order for every
        # replica, so a step that fails on some replicas after it cannot leave them with different orders.
        self._orders = {}
        # (strategy id, replica id) -> the _Layout of that replica's latest sources: kept while the next call
        # gets the very same source objects (a training loop's), so a step does not lay the buckets out again
        self._layouts = {}
        # per-position variable identities -> one shared copy, so that replicas asking for the same variables in
        # the same order hand their all-reduces the very same tuple (the thread collectives compare it with `is`)
        self._idents = {}

    def start(self, sources):
        """The tape's hook: a session for one `tape.gradient` call, or None (nothing to synchronise)."""
        rctx = context.get_replica_context()
        if rctx is None or rctx.num_replicas_in_sync == 1:
            return None
        if tracing_body():
            # its reductions start on other threads while the walk runs: a traced walk has no values to send,
            # and the replicas would wait on each other with nothing arriving
            raise RuntimeError(
                "GradientTape(gradient_sync=...) inside a compiled dtape.function (jit_compile=True): the "
                "overlapped all-reduce cannot run in a traced step. Drop gradient_sync= in the compiled step; "
                "apply_gradients traced in a replica all-reduces inside the graph")
        sources = list(sources)
        slot = (id(rctx.strategy), rctx.replica_id_in_sync_group)  # each replica has its own devices
        layout = self._layouts.get(slot)
        if layout is None or not layout.holds(sources):
            layout = None
            key = (id(rctx.strategy), tuple((tuple(getattr(x, "shape", ())), getattr(x, "dtype", None))
                                            for x in sources))
        else:
            key = layout.key
        order, learn = None, None
        if self.order == "readiness":
            with self._lock:
                order = self._orders.get(key)
            if order is None:
                learn = (self._learned, key, rctx.replica_id_in_sync_group)
        caps = (self.bucket_cap_bytes, self.first_bucket_cap_bytes)
        if layout is None or layout.order is not order:
            layout = self._layouts[slot] = _Layout(sources, key, order, caps, self._source_ids(sources))
        return _Session(rctx.strategy.extended, sources, caps, layout, learn)

    def _source_ids(self, sources):
        """The _SourceIds of `sources`, its identity tuple shared with every replica that has the same one."""
        ids = _SourceIds(sources)
        with self._lock:
            ids.ids = self._idents.setdefault(ids.ids, ids.ids)
        return ids

    def _learned(self, key, order):
        with self._lock:
            self._orders.setdefault(key, order)  # every replica agreed on this order: any copy will do


# -- bucket layout ----------------------------------------------------------------------
class _Bucket:
    """Members (index, offset, numel, shape, dtype) laid out in one flat buffer, then one presence flag each."""

    __slots__ = ("dtype", "device", "members", "numel", "cap", "_common")

    def __init__(self, dtype, device):
        self.dtype, self.device, self.members, self.numel, self.cap = dtype, device, [], 0, None
        self._common = None

    def common(self):
        """(every member's dtype is the bucket's, meta tensors of the members' shapes, presence flags all 1):
        what the common step (every gradient present, in the bucket's dtype) flattens and unflattens with
        one call each. Built once, after the members are all added."""
        if self._common is None:
            same = all(m[4] == self.dtype for m in self.members)
            shapes = [torch.empty(m[3], device="meta") for m in self.members]
            self._common = (same, shapes, torch.ones(len(self.members), dtype=self.dtype, device=self.device))
        return self._common

    def add(self, index, shape, dtype):
        n = 1
        for d in shape:
            n *= int(d)
        self.members.append((index, self.numel, n, tuple(shape), dtype))
        self.numel += n

    def size(self):
        return self.numel + len(self.members)


def plan_buckets(items, cap_bytes, first_cap_bytes=None):
    """Buckets for `items` = [(index, shape, dtype, device)], filled in the given order.

    One accumulation dtype and device per bucket; a bucket is closed once it
    holds `cap_bytes` (`first_cap_bytes` for the first bucket of each dtype
    and device, as DDP; default: `cap_bytes`); a larger item gets a bucket of
    its own. Depends only on the items, so every replica computes the same layout.
    """
    first_cap_bytes = cap_bytes if first_cap_bytes is None else first_cap_bytes
    open_, started, out = {}, set(), []
    for index, shape, dtype, device in items:
        acc = accumulation_dtype(dtype)
        key = (acc, device)
        bucket = open_.get(key)
        if bucket is None:
            bucket = open_[key] = _Bucket(acc, device)
            bucket.cap = cap_bytes if key in started else first_cap_bytes
            started.add(key)
            out.append(bucket)
        bucket.add(index, shape, dtype)
        if bucket.numel * bucket.dtype.itemsize >= bucket.cap:
            del open_[key]
    return out


def _flat(member, g, bucket):
    """Gradient `g` (torch/dtape tensor; None: zeros) as a 1-D tensor of the bucket's dtype and device."""
    _, _, n, shape, dtype = member
    if g is None:
        return torch.zeros(n, dtype=bucket.dtype, device=bucket.device)
    t = g.torch() if isinstance(g, Tensor) else g
    if t.numel() != n:  # a source whose shape changed since its bucket was laid out: never a misplaced sum
        raise ValueError(f"GradientSync: a gradient of shape {tuple(t.shape)} for a source laid out as {shape}; "
                         "a source's shape must not change between steps (use a new GradientSync after it does)")
    if t.dtype != dtype:  # as tape.gradient's result: cast to the source's dtype first
        t = t.to(dtype)
    return t.reshape(-1).to(bucket.device, bucket.dtype)


def _unpack(bucket, reduced):
    """{index: reduced Tensor (a view of the result), or None where no replica had a gradient} for one bucket.

    `reduced`: the reduction of what `_launch` sent: one flat buffer (values
    then presence flags), or one tensor per member then the flags.
    """
    if len(reduced) == 1:
        present = reduced[0][bucket.numel:].tolist()  # one host read per bucket, after the reduction
        same, shapes, _ = bucket.common()
        if same and all(present):   # every member present, in the bucket's dtype: its views, made in one call
            out = {}
            for m, v in zip(bucket.members, _unflatten_dense_tensors(reduced[0][:bucket.numel], shapes)):
                out[m[0]] = t = Tensor.__new__(Tensor)   # Tensor(v) without the Python-level __init__ call
                t._t, t._id = v, next_id()
            return out
        parts = reduced[0][:bucket.numel].split([m[2] for m in bucket.members])  # one call for every view
    else:
        present, parts = reduced[-1].tolist(), reduced[:-1]
    out = {}
    for (index, _, _, shape, dtype), part, count in zip(bucket.members, parts, present):
        out[index] = Tensor(part.view(shape).to(dtype)) if count != 0 else None  # complex flags in a complex bucket
    return out


@collective_ops.labelled("tape.gradient's GradientSync")   # apply_gradients' own reduction: its label wins
def _launch(ext, bucket, grads_by_index, ledger=None, tag=None):
    """Launches a bucket's all-reduce (SUM): its gradients, then one presence flag each; returns the handle.

    Across processes and devices the gradients are first copied into one
    flat buffer (one collective or device copy per bucket), which is given
    away (`scratch`): a strategy may reduce it in place. CPU replica threads
    (`ext._flat_buckets` False) sum the gradients as they are: a flat buffer
    would only add a copy of every gradient. A "dtape.all_reduce" range in
    torch.profiler traces.
    """
    with profile_range("dtape.all_reduce"):  # one named range per bucket, as DDP's one collective per bucket
        if ext._flat_buckets:
            flat = _flat_common(bucket, grads_by_index)
            if flat is not None:
                return ext._all_reduce_flat_async(ReduceOp.SUM, [flat], scratch=True, tag=tag, **(ledger or {}))
        parts, flags = [], []
        for member in bucket.members:
            g = grads_by_index.get(member[0])
            parts.append(_flat(member, g, bucket))
            flags.append(0.0 if g is None else 1.0)
        parts.append(torch.tensor(flags, dtype=bucket.dtype, device=bucket.device))
        if not ext._flat_buckets:
            return ext._all_reduce_flat_async(ReduceOp.SUM, parts, tag=tag)
        return ext._all_reduce_flat_async(ReduceOp.SUM, [torch.cat(parts)], scratch=True, tag=tag, **(ledger or {}))


def _flat_common(bucket, grads_by_index):
    """The bucket's flat buffer (values, then presence flags 1) made by one call, when every member's gradient
    is a torch or dtape tensor of its size in the bucket's dtype and device (a training step's); else None
    (`_flat` each)."""
    same, _, ones = bucket.common()
    if not same:
        return None
    tensors = [grads_by_index[m[0]] if m[0] in grads_by_index else None for m in bucket.members]
    # the walk's gradients; a dtape Tensor (apply_gradients') is unwrapped
    tensors = [t._t if type(t) is Tensor else t for t in tensors]
    dtype, device = bucket.dtype, bucket.device
    for t, m in zip(tensors, bucket.members):
        if type(t) is not torch.Tensor or t.dtype != dtype or t.device != device or t.shape != m[3]:
            return None   # (a gradient of another shape: `_flat` checks its size)
    tensors.append(ones)
    return _flatten_dense_tensors(tensors)


def _ledger(ext, buckets, b):
    """How bucket b's all-reduce is checked across workers (strategies that check collectives,
    `ext._announces`): the first announces the step's later buckets (their sizes end with the presence
    flags, 0 or 1), so they skip their own signature exchange, and is itself flagged: the checked collective
    before it (a step's loss reduction) may announce it once it has followed that one in earlier steps
    (collective_ops); {} elsewhere."""
    if not getattr(ext, "_announces", False):
        return {}
    if b > 0:
        return {"announced": True}
    if len(buckets) < 2:
        return {"flagged": True}
    return {"announce": [(bucket.dtype, bucket.size()) for bucket in buckets[1:]], "flagged": True}


def _float_items(values_and_refs, order=None):
    """[(index, shape, dtype, device)] for the float entries: in `order` (indices), else reversed (DDP's guess)."""
    items = []
    for j, ref in enumerate(values_and_refs):
        dtype = getattr(ref, "dtype", None)
        if dtype is not None and (dtype.is_floating_point or dtype.is_complex):
            items.append((j, tuple(ref.shape), dtype, normalize_device(ref.device)))
    if order is None:
        return items[::-1]
    rank = {j: p for p, j in enumerate(order)}
    return sorted(items, key=lambda item: rank[item[0]])


class _Layout:
    """The buckets of one list of sources on one replica (`order`: the agreed readiness order they were laid
    out in, or None: reverse source order), with the sources themselves: valid for a later call with the same
    objects (a variable's shape, dtype and device are fixed; `_flat` checks each gradient's size)."""

    __slots__ = ("sources", "key", "order", "buckets", "where", "ids")

    def __init__(self, sources, key, order, caps, ids=None):
        self.sources, self.key, self.order, self.ids = tuple(sources), key, order, ids
        self.buckets = plan_buckets(_float_items(sources, order), *caps)
        self.where = {m[0]: b for b, bucket in enumerate(self.buckets) for m in bucket.members}

    def holds(self, sources):
        return len(sources) == len(self.sources) and all(map(operator.is_, sources, self.sources))


class _SourceIds:
    """Which variable each of one replica's tape.gradient sources is: its distributed container's id (each
    replica may pass its own components or the container), None for anything else (e.g. a replica's own
    tensor). Each bucket's all-reduce among replica threads carries it: the buckets are summed position by
    position, so replicas that list the variables in different orders raise there, before any sum. Workers
    (MultiWorkerMirroredStrategy) compare `digest` (names, ordinals among same-named variables, shapes) in
    their buckets' signature check."""

    __slots__ = ("ids", "containers", "digest")

    def __init__(self, sources):
        self.containers = tuple(values.value_container(s) for s in sources)
        self.ids = tuple(id(c) if isinstance(c, values.DistributedVariable) else None for c in self.containers)
        # across processes ids mean nothing: the sources' names (with their ordinal among same-named variables,
        # so that two of one name and shape are told apart) and shapes by position, as one positive int that a
        # worker's bucket signature carries (collective_ops compares it with every worker's)
        described = repr([(_name(c), getattr(c, "_name_ordinal", 0), tuple(getattr(c, "shape", ())))
                          for c in self.containers]).encode()
        self.digest = (zlib.crc32(described) & 0x7FFFFFFF) or 1

    def mismatch(self, tags):
        """The error message when the replicas' `tags` (this one first) differ at some position, else None."""
        for t in tags:
            if t is not None and t.ids is not self.ids:
                break
        else:
            return None  # every replica has the same shared tuple (or made another collective: the size check's)
        for k, ref in enumerate(self.ids):
            if any(t is not None and (len(t.ids) <= k or t.ids[k] != ref) for t in tags):
                names = [_name(t.containers[k]) if t is not None and k < len(t.ids) else "-" for t in tags]
                return (f"the replicas passed tape.gradient different sources at position {k} ({names}); every "
                        "replica must ask for the same variables in the same order (e.g. "
                        "model.trainable_variables): their gradients are summed position by position. Nothing "
                        "was reduced.")
        return None


def _name(source):
    return getattr(source, "name", None) or f"a {type(source).__name__}"


# -- the session of one tape.gradient call ----------------------------------------------
class _Session:
    """Buckets of one `tape.gradient` call on one replica: filled during the walk, launched in order."""

    def __init__(self, ext, sources, caps, layout, learn=None):
        self.caps = caps  # (bucket cap, first bucket's cap) in bytes
        self._ext = ext
        self._sources = sources
        self._learn = learn
        self._seen = []  # float sources in the order the walk finished them
        self._buckets = layout.buckets
        self._where = layout.where
        self._ids = layout.ids
        self._left = [len(b.members) for b in self._buckets]
        self._grads = [{} for _ in self._buckets]
        self._handles = [None] * len(self._buckets)
        self._results = [None] * len(self._buckets)
        self._next = 0

    def ready(self, js, gs):
        """The walk's hook: the gradients `gs` of sources `js` (lists, in the walk's order) are final. Notes
        them all, then launches every bucket now complete (in bucket order): one call for the sources a record
        finished (a wrapped module's every parameter at once)."""
        where, grads, left = self._where, self._grads, self._left
        noted = [(j, g) for j, g in zip(js, gs) if j in where and j not in grads[where[j]]]  # js: distinct
        for j, g in noted:
            b = where[j]
            grads[b][j] = g
            left[b] -= 1
        self._seen.extend([j for j, _ in noted])
        while self._next < len(self._buckets) and self._left[self._next] == 0:
            b = self._next
            ledger = _ledger(self._ext, self._buckets, b)
            self._handles[b] = _launch(self._ext, self._buckets[b], self._grads[b], ledger, self._ids)
            self._grads[b] = {j: None for j in self._grads[b]}  # the buffer holds the values now
            self._next += 1

    def finish(self, grads):
        """After the walk: launches what is left, and registers the returned gradients for apply_gradients."""
        if self._next < len(self._buckets):  # else the walk reported every gradient and all are launched
            self.ready(range(len(grads)), grads)
        where = self._where
        floats = [j for j in range(len(self._sources)) if j in where]
        # an entry (source, gradient, session, index) per float source
        _registry().update(zip(map(id, [self._sources[j] for j in floats]),
                               [(self._sources[j], grads[j], self, j) for j in floats]))
        if self._learn is not None:
            self._agree_order()

    @collective_ops.labelled("tape.gradient's GradientSync")
    def _agree_order(self):
        """Replica 0's readiness order, on every replica (one SUM all-reduce: the others add zeros)."""
        remember, key, replica_id = self._learn
        if not self._seen:  # no float source (the same on every replica): nothing to agree on
            remember(key, [])
            return
        device = self._buckets[0].device
        seen = torch.tensor(self._seen if replica_id == 0 else [0] * len(self._seen), dtype=torch.float64,
                            device=device)
        (agreed,) = self._ext._all_reduce_flat(ReduceOp.SUM, [seen])
        remember(key, [int(j) for j in agreed.tolist()])

    def reduced(self, js, timeout):
        """The reduced gradients of sources `js` (a list), waiting for each bucket once."""
        where, results = self._where, self._results
        for b in sorted({where[j] for j in js}):  # each bucket's reduction waited for once, in bucket order
            if results[b] is None:
                results[b] = _unpack(self._buckets[b], self._handles[b].wait(timeout))
        return [results[where[j]][j] for j in js]


def _registry():
    """id(source) -> (source, gradient tape.gradient returned, its _Session, its index there): the entries of
    this replica's latest synced tape.gradient in the current step."""
    return context.get_replica_context().synced_gradients


# -- the reduction apply_gradients uses --------------------------------------------------
def reduce_gradients(pairs, bucket_cap_mb=None, timeout=None):
    """Sums (gradient, variable) pairs over the replicas; called on every replica, in a replica context.

    Args:
      pairs: list of (gradient or None, variable); the same variables, in
        the same order, on every replica.
      bucket_cap_mb: bucket size for gradients reduced here; default: that
        of the GradientSync that computed these variables' latest gradients
        on this replica, else 25.
      timeout: seconds to wait for each reduction (default: the strategy's).

    Returns:
      A list of (reduced gradient or None, variable): the sum over replicas
      (a replica's None counts as zeros), bit-identical on every replica, on
      this replica's device; None only where every replica had None.

    If every gradient is the object a `GradientTape(gradient_sync=...)`
    returned for that variable on this replica (None included), the
    reductions launched during its walk are used; otherwise the gradients
    are reduced here, one all-reduce per bucket.
    """
    rctx = context.get_replica_context()
    timeout = timeout if timeout is not None else _timeout(rctx.strategy)
    registry = _registry()
    keys = list(map(id, [v for _, v in pairs]))
    entries = list(map(registry.get, keys))
    if pairs and _launched_for(entries, pairs):
        for key in keys:
            if key in registry:  # each reduction serves one apply_gradients
                del registry[key]
        return list(zip(_launched(entries, timeout), [v for _, v in pairs]))
    if bucket_cap_mb is not None:
        caps = _caps(_check_cap(bucket_cap_mb), _check_cap(DEFAULT_FIRST_BUCKET_CAP_MB))
    else:
        caps = next((e[2].caps for e in entries if e is not None), _DEFAULT_CAPS)
    return _reduce_fresh(rctx.strategy.extended, pairs, caps, timeout)


def _launched_for(entries, pairs):
    """Whether every pair's gradient is the one its entry's synced tape.gradient returned for its variable."""
    for e, (g, v) in zip(entries, pairs):
        if e is None or e[0] is not v or e[1] is not g:
            return False
    return True


def _launched(entries, timeout):
    """The reduced gradients of `entries`, in order: one call per session (a training step's one)."""
    session = entries[0][2]
    for e in entries:
        if e[2] is not session:  # several tape.gradient calls' gradients in one apply_gradients
            return [e[2].reduced([e[3]], timeout)[0] for e in entries]
    return session.reduced([e[3] for e in entries], timeout)


_DEFAULT_CAPS = _caps(_check_cap(DEFAULT_BUCKET_CAP_MB), _check_cap(DEFAULT_FIRST_BUCKET_CAP_MB))


def _reduce_fresh(ext, pairs, caps, timeout):
    """Buckets `pairs`' gradients in reverse order and launches each bucket as soon as it is filled
    (the first, small one goes out while the next are copied); then waits for them in order."""
    refs = [v for _, v in pairs]
    buckets = plan_buckets(_float_items(refs), *caps)
    grads = {j: g for j, (g, _) in enumerate(pairs)}
    handles = [_launch(ext, b, {m[0]: grads[m[0]] for m in b.members}, _ledger(ext, buckets, i))
               for i, b in enumerate(buckets)]
    out = [None] * len(pairs)
    for bucket, handle in zip(buckets, handles):
        for j, g in _unpack(bucket, handle.wait(timeout)).items():
            out[j] = g
    return [(g, v) for g, (_, v) in zip(out, pairs)]


def _timeout(strategy):
    return getattr(strategy, "_timeout", None) or _config.DISTRIBUTE_TIMEOUT_S


# -- gradient accumulation ---------------------------------------------------------------
class GradientAccumulator:
    """Sums gradients over micro-batches on each replica, with no communication.

    `accumulate(grads_and_vars)` adds one micro-batch's local gradients;
    `grads_and_vars()` gives the sums, for one
    `optimizer.apply_gradients(...)`: one all-reduce per bucket per k
    micro-batches. Scale the micro-batch losses so that the sum is the
    gradient you want (e.g. `compute_average_loss(l, global_batch_size=k * N)`).
    Each replica keeps its own sums (safe with mirrored variables: one
    accumulator can be shared by the replicas of `strategy.run`).

    In the cross-replica context of a strategy with more than one replica
    in sync, `accumulate` and `grads_and_vars` raise RuntimeError (nothing
    is added): they would reach replica 0's sums only, as `apply_gradients`
    would update one copy (TF refuses both); `reset()` there forgets every
    replica's sums.

    Raises (accumulate):
      ValueError: variables that differ from the first micro-batch's.
      RuntimeError: called in a multi-replica cross-replica context (also
        `grads_and_vars`).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._state = {}  # replica id -> (variables, [sum or None], steps)

    def _replica(self, method=None):
        """This replica's id (0 outside any strategy); `method`: refuse a multi-replica cross-replica context."""
        rctx = context.get_replica_context()
        if rctx is None and method is not None and context.get_strategy().num_replicas_in_sync > 1:
            raise RuntimeError(
                f"`GradientAccumulator.{method}()` cannot be called in cross-replica context: each of the "
                f"{context.get_strategy().num_replicas_in_sync} replicas keeps its own sums. Use "
                "`dtape.distribute.Strategy.run` to enter replica context (call it in the function given to "
                "`strategy.run`). Nothing was changed.")
        return 0 if rctx is None else rctx.replica_id_in_sync_group

    def accumulate(self, grads_and_vars):
        """Adds (gradient or None, variable) pairs to this replica's sums (not recorded)."""
        r = self._replica("accumulate")
        pairs = list(grads_and_vars)
        with self._lock:
            state = self._state.get(r)
        variables = [v for _, v in pairs]
        if state is None:
            state = (variables, [None] * len(pairs), 0)
        elif len(state[0]) != len(variables) or any(a is not b for a, b in zip(state[0], variables)):
            raise ValueError("GradientAccumulator.accumulate got other variables than on the first micro-batch; "
                             "pass the same variables, in the same order, every time (or call reset())")
        sums = list(state[1])
        with _tp.stop_recording():
            for k, (g, _) in enumerate(pairs):
                if g is None:
                    continue
                t = convert_to_tensor(g).torch()
                sums[k] = t.clone() if sums[k] is None else sums[k] + t
        with self._lock:
            self._state[r] = (variables, sums, state[2] + 1)

    def grads_and_vars(self):
        """This replica's [(summed gradient as a Tensor, or None, variable)]."""
        r = self._replica("grads_and_vars")
        with self._lock:
            state = self._state.get(r)
        if state is None:
            return []
        return [(None if s is None else Tensor(s), v) for s, v in zip(state[1], state[0])]

    @property
    def step(self):
        """Micro-batches accumulated on this replica since the last reset."""
        with self._lock:
            state = self._state.get(self._replica())
        return 0 if state is None else state[2]

    def reset(self):
        """Forgets this replica's sums (in the cross-replica context: every replica's)."""
        everyone = context.get_replica_context() is None
        with self._lock:
            if everyone:
                self._state.clear()
            else:
                self._state.pop(self._replica(), None)


__all__ = ["GradientSync", "GradientAccumulator", "compute_average_loss", "reduce_gradients", "plan_buckets",
           "DEFAULT_BUCKET_CAP_MB", "DEFAULT_FIRST_BUCKET_CAP_MB"]
