"""Collectives across worker processes over torch.distributed, with timeouts and named failures.

`MultiWorkerMirroredStrategy` makes one `Communicator` per process and
installs it as the active one; the module functions (`all_reduce`,
`all_gather`, `broadcast`, `barrier`) use it. They take and return plain
torch tensors (the strategy wraps them), so a later layer can record them
on the tape.

Failure handling (DESIGN.md "Collectives"; API.md "No deadlocks"):

* Every collective is launched asynchronously and waited for in slices of
  at most 20 ms; after each slice that did not finish it, the waiter polls
  the process group's store for a published error and checks its deadline
  (the strategy's timeout). A collective that finishes within its first
  slice costs no store traffic (a store round trip goes through torchrun's
  agent process, which on a busy machine first has to be scheduled).
* A worker whose step fails calls `publish_error`: its exception (type,
  message, rank, host, pid) goes to the store before it leaves, and it waits
  (briefly, bounded) for its peers to acknowledge. A peer blocked in a
  collective then raises the same exception type (builtin types; else
  `WorkerError`) with a note naming the failing rank.
* A peer that dies without publishing (SIGKILL, OOM kill) breaks its gloo
  connections: the waiters' collective fails at once; they name the dead
  rank by checking the pids every worker registered at start-up (ranks on
  the same host), else report the transport's error.
* A collective that does not finish in time raises `TimeoutError` naming the
  ranks that never reached it (ranks record their position in the store
  once a wait passes one second, so fast steps cost no store traffic).
* Collectives cannot pair wrong: before each one, the workers exchange its
  signature (sequence number, kind, the dtape call that issued it, dtype,
  shape) in one small float64 all-gather of a fixed size, and the payload is
  launched only when every worker's signature is the same. Otherwise every
  worker raises `CollectiveMismatchError` naming each worker's call
  ("rank 0 entered all_reduce #12 of checkpoint.save (float32[1]) while
  rank 1 entered all_reduce #12 of apply_gradients (float32[3])"), before
  any value is returned: never a value summed with another call's, nor
  gloo's abort on a size mismatch (gloo aborts the process when a payload's
  size differs, so a large payload waits for the check: one extra small
  round trip). A small floating all-reduce (losses, metrics, barriers)
  travels in the same fixed-size message as the signatures: no extra round
  trip. A checked all-reduce may announce the all-reduces that follow it
  (a step's gradient buckets: `all_reduce_async(announce=...)`); those skip
  their own exchange, and a worker that enters anything else instead first
  sends a poison of each announced size, so a peer inside one raises
  CollectiveMismatchError at its wait (see `_POISON`). A checked collective
  that announces nothing itself predicts from the (checked, identical)
  history: once the same gradient bucket (`all_reduce_async(flagged=True)`,
  with the buckets it announces) has followed it _PREDICT_AFTER times in a
  row, it announces them (a step's loss reduction announces the next step's
  buckets), so a step's buckets go out with no check round trip of their
  own; a prediction that misses costs one poison per predicted all-reduce
  and is learned again. The caller is named by `labelled` (outermost wins).
  DTAPE_CHECK_COLLECTIVES=0 turns the check off (for benchmarks).

Process-wide state: `_active` (the communicator of the process's strategy),
set by `set_active`; one process group per process, so one communicator.
Source: TF's CollectiveAllReduce (cross_device_ops.py) and
`CommunicationOptions(timeout_seconds)`; the store-published error follows
torch elastic's error files, carried in the rendezvous store instead; the
signature check follows torch's TORCH_DISTRIBUTED_DEBUG=DETAIL
(ProcessGroupWrapper's collective fingerprints), always on and naming
dtape's calls.
"""
import builtins
import collections
import contextlib
import datetime
import functools
import json
import math
import operator
import os
import socket
import sys
import threading
import time
import traceback
import zlib

import torch
import torch.distributed as dist

from dtape import _config
from dtape._notes import add_note

_POLL_MAX_S = 0.02          # longest slice a waiter sleeps between checks of the store
_MARK_WAITING_AFTER_S = 1.0  # a wait longer than this records its position for timeout messages
_ACK_WAIT_S = 3.0           # how long a failing worker waits for its peers to see its error

# Process-wide: the communicator of this process's MultiWorkerMirroredStrategy
# (None before one is made). Written once per strategy, read by every collective.
_active = None


class WorkerError(RuntimeError):
    """A peer worker failed with an exception this process cannot rebuild with its type.

    The message names the failing rank, its exception type and message.
    """


class PeerFailure(RuntimeError):
    """Marker base of errors a worker raises because a *peer* failed, or that every worker detects by itself
    (never republished as the cause)."""


class CollectiveMismatchError(PeerFailure):
    """The workers entered different collectives at the same position (another call, kind, shape or dtype).

    Raised on every worker, before any value of the collective is returned; the
    message names each worker's call. The group is unusable afterwards.
    """


# -- the collective ledger: signatures exchanged before each collective ----------------------------
_KINDS = ("all_reduce", "all_gather", "broadcast", "barrier")   # signature code: index + 1
_SIG_LEN = 15   # seq, kind, src, label, dtype, numel, ndim, four dims, shape hash, then the plan: count, two digests
# A checked all-reduce may announce the all-reduces its caller issues right after it (a gradient step's buckets):
# those skip their own exchange. A worker that is about to enter anything else first sends, for each announced
# all-reduce still to come, an all-reduce of its size filled with _POISON, so a peer inside an announced
# all-reduce pairs with a collective of the size it expects (gloo aborts on another size) and finds a negative
# sum in the last element, where an announced all-reduce's callers put 0 or 1 (a presence flag).
_POISON = -float(2 ** 20)
_PLAN_LEFT = -1   # plan count of a worker whose announced all-reduce met a poison (never a real plan's count)
# Every signature exchange is one all-gather of _SIG_LEN + _INLINE_MAX float64 per worker: always the same
# size (gloo aborts a process whose peer sends another size); floating all-reduces of up to _INLINE_MAX
# elements ride in it. (An all-gather: one exchange, where gloo's all-reduce of the same bytes takes two.)
_INLINE_MAX = 16
# A checked collective announces the buckets that followed it only after they followed it this many times in a row
# (a periodic other collective, e.g. a checkpoint every N steps, then costs one miss per period, not one per step).
_PREDICT_AFTER = 2
_FOLLOWS_MAX = 1024   # predictors remembered (distinct checked collectives that announce nothing themselves)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# The dtape calls that issue collectives, known on every worker (a peer's label is named even when
# this worker never made that call). `labelled` adds others.
KNOWN_LABELS = ("MultiWorkerMirroredStrategy()", "variable creation", "strategy.reduce", "strategy.gather",
                "get_rng_state", "ReplicaContext.all_reduce", "ReplicaContext.all_gather",
                "the gradient of ReplicaContext.all_reduce/all_gather", "tape.gradient's GradientSync",
                "apply_gradients", "checkpoint.save", "checkpoint.restore", "SyncOnReadVariable read",
                "ONLY_FIRST_REPLICA variable write", "experimental_distribute_dataset's data check",
                "strategy.extended.batch_reduce_to",
                "collective_ops.all_reduce", "collective_ops.all_gather", "collective_ops.broadcast",
                "collective_ops.barrier")
# Calls that users guard with `if rank == 0` (a DDP habit): named in the mismatch message.
_COLLECTIVE_APIS = {
    "checkpoint.save": "checkpoint.save is collective: every worker must call it (rank 0 writes the file while "
                       "the others wait for it to be complete, as in TF), not only rank 0 (`if rank == 0:`)",
    "checkpoint.restore": "checkpoint.restore is collective: every worker must call it",
    "SyncOnReadVariable read": "reading a SyncOnReadVariable (e.g. a metric's result()) outside strategy.run is "
                               "collective: every worker must read it",
}


def _code(text):
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


_LABEL_NAMES = {_code(t): t for t in KNOWN_LABELS}   # process-wide, add-only (labelled registers new ones)
_DTYPE_NAMES = {_code(str(d)): str(d).replace("torch.", "") for d in vars(torch).values()
                if isinstance(d, torch.dtype)}
_label = threading.local()   # per thread: the label of the outermost `labelled` block


@contextlib.contextmanager
def labelled(label):
    """Names the collectives issued inside the block after `label` (e.g. "checkpoint.save").

    The outermost block of a thread wins, so a reduction made by
    `checkpoint.save` is named after it, not after the strategy method it
    calls. Per thread; costs nothing without a MultiWorkerMirroredStrategy.
    """
    outer = getattr(_label, "current", None)
    if outer is None:
        _LABEL_NAMES.setdefault(_code(label), label)
        _label.current = label
    try:
        yield
    finally:
        if outer is None:
            _label.current = None


def current_label(default=None):
    """The label of the enclosing `labelled` block on this thread, else `default`."""
    return getattr(_label, "current", None) or default


def _signature(seq, kind, t, src, label):
    """[seq, kind, src, label, dtype, numel, ndim, four dims, shape hash, 0, 0, 0] of a collective on tensor `t`."""
    return [seq, *_signature_tail(kind, src, label, t.dtype, tuple(t.shape))[0], 0, 0, 0]


def _signed(seq, kind, t, src, label):
    """(signature, description) of a collective; the parts that do not depend on `seq` are cached."""
    tail, name, rest = _signature_tail(kind, src, label, t.dtype, tuple(t.shape))
    return [seq, *tail, 0, 0, 0], f"{name} #{seq}{rest}"


def _plan(seq, label, specs):
    """(plan fields [count, two digests], [(signature, dtype, numel)]) of the all-reduces `specs` ((dtype, numel)
    each) announced to follow collective #seq, with the same label."""
    entries = [([seq + 1 + i, *_signature_tail("all_reduce", 0, label, dtype, (numel,))[0], 0, 0, 0], dtype, numel)
               for i, (dtype, numel) in enumerate(specs)]
    return _plan_fields(entries), entries


def _plan_fields(entries):
    """[count, two digests] of announced `entries` ([(signature, dtype, numel)]): what every worker compares."""
    text = repr([e[0][1:12] for e in entries]).encode()
    return [len(entries), zlib.crc32(text) & 0x7FFFFFFF, zlib.adler32(text) & 0x7FFFFFFF]


@functools.lru_cache(maxsize=4096)   # a training loop has a few distinct collectives: computed once each
def _signature_tail(kind, src, label, dtype, shape):
    dims = (list(shape) + [0] * 4)[:4]
    tail = (_KINDS.index(kind) + 1, src, _code(label) if label else 0, _code(str(dtype)), math.prod(shape),
            len(shape), *dims, _code(repr(shape)))
    name, _, rest = describe_signature((0, *tail)).partition(" #0")
    return tail, name, rest


def describe_signature(row):
    """`row` (a signature) as words: "all_reduce #12 of checkpoint.save (float32[1])"."""
    seq, kind, src, label, dtype, _, ndim = row[:7]
    name = _KINDS[kind - 1] if 0 < kind <= len(_KINDS) else f"collective kind {kind}"
    if name == "broadcast":
        name += f" from rank {src}"
    of = f" of {_LABEL_NAMES.get(label, f'a call labelled {label}')}" if label else ""
    dims = [str(d) for d in row[7:7 + min(ndim, 4)]] + (["..."] if ndim > 4 else [])
    dtype = _DTYPE_NAMES.get(dtype, f"dtype code {dtype}")
    plan = row[12] if len(row) > 12 else 0
    then = (f" announcing {plan} more all-reduce{'s' * (plan > 1)}" if plan > 0 else
            " (announced by an earlier checked all-reduce)" if plan == _PLAN_LEFT else "")
    if name == "all_reduce" and src:  # all_reduce_async's `sources`
        then = f" over sources {int(src):#010x}{then}"
    return (f"{name} #{seq}{of} ({dtype}[{', '.join(dims)}]){then}" if dims else
            f"{name} #{seq}{of} ({dtype} scalar){then}")


def mismatch_message(rank, rows):
    """What every worker says when the signatures `rows` (one per rank) differ."""
    groups = {}
    for r, row in enumerate(rows):
        groups.setdefault(tuple(row), []).append(r)
    said = [f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))} entered {describe_signature(row)}"
            for row, rs in groups.items()]
    same_call = len({row[1:4] for row in groups}) == 1
    if len({row[:2] + row[3:] for row in groups}) == 1:  # only all_reduce_async's `sources` differ
        return (f"rank {rank}: collectives out of step: {said[0]} while {', '.join(said[1:])}: the workers passed "
                "tape.gradient different sources (names or shapes) at some position; every replica must ask for "
                "the same variables in the same order (variables of one name are told apart by their creation "
                "order: every worker must create its variables in the same order). No value was returned; the group is unusable now: fix the "
                "program and restart the workers.")
    shapes = (" Hint: the same call got values of different shapes or dtypes on different workers: every worker "
              "must pass the same shape and dtype (e.g. the same variables, in the same order).") if same_call else ""
    return (f"rank {rank}: collectives out of step: {said[0]} while {', '.join(said[1:])}; every worker must issue "
            f"the same collectives in the same order with the same shapes and dtypes. No value was returned; the "
            f"group is unusable now: fix the program and restart the workers." + _hints(" ".join(said)) + shapes)


def set_active(communicator):
    """Installs `communicator` as the process's (process-wide; the strategy calls it)."""
    global _active
    _active = communicator


def active_or_none():
    """The process's communicator, or None when no MultiWorkerMirroredStrategy was made."""
    return _active


def active():
    """The process's communicator.

    Raises:
      RuntimeError: no MultiWorkerMirroredStrategy has been made in this process.
    """
    if _active is None:
        raise RuntimeError("no collective group: create dtape.distribute.MultiWorkerMirroredStrategy() first "
                           "(under torchrun) before calling dtape.distribute.collective_ops functions")
    return _active


def all_reduce(t, op="sum"):
    """`active().all_reduce(t, op)`: the sum (or mean) of `t` over every worker. See Communicator.all_reduce."""
    return active().all_reduce(t, op, label="collective_ops.all_reduce")


def all_gather(t):
    """`active().all_gather(t)`: every worker's `t` stacked, [world, *t.shape]."""
    return active().all_gather(t, label="collective_ops.all_gather")


def broadcast(t, src=0):
    """`active().broadcast(t, src)`: worker `src`'s `t` on every worker."""
    return active().broadcast(t, src, label="collective_ops.broadcast")


def barrier():
    """`active().barrier()`: returns once every worker has called it."""
    return active().barrier(label="collective_ops.barrier")


class Communicator:
    """One worker's view of the group: rank, world size, store, timeout, and the collectives.

    Args:
      rank, world_size: this worker's rank and the number of workers.
      store: the group's torch.distributed Store (errors and positions are
        published under a prefix of it).
      timeout: seconds any collective may take before TimeoutError.
      device: torch.device collectives run on (CPU for gloo, cuda:i for NCCL).
      prefix: store key prefix, identical on every worker, unique per
        strategy and per torchrun restart (so stale errors are never read).
      group: the torch.distributed process group (None: the default one).
      check: whether each collective's signature is compared across the
        workers first (None: DTAPE_CHECK_COLLECTIVES; the same on every
        worker, else ValueError here).
    """

    def __init__(self, rank, world_size, store, timeout, device, prefix, group=None, check=None):
        self.rank, self.world_size, self.timeout = rank, world_size, float(timeout)
        self.device = torch.device(device)
        self.group = group
        self.store = dist.PrefixStore(prefix, store)
        # whether signatures are exchanged before each collective (the same on every worker: checked below)
        self.check = (_config.CHECK_COLLECTIVES if check is None else bool(check)) and world_size > 1
        self._seq = 0            # collectives entered by this worker (same order on every worker)
        self._entered = ""       # the latest one, described (for timeout and exit messages)
        self._signed = None      # the latest one's signature
        self._announced = collections.deque()  # [(signature, dtype, numel)] announced and still to come
        self._plans = True       # whether announcements are taken (off once every worker left one at once)
        # predictions (see the module docstring): signature key of a checked collective that announced nothing ->
        # [what followed it (a flagged all-reduce and what it announced) or None, times in a row]
        self._follows = {}
        self._after = None       # the latest collective's key when it may predict the next one, else None
        self._planned = []       # what the collective being checked announces: taken once its check passes
        self._predictor = None   # key of the collective whose prediction `_announced` holds (None: announced)
        self.exchanges = 0       # signature exchanges made (benchmarks: checks per collective)
        self._failed = None      # the error this worker reported, once it has one
        self._published = False  # whether this worker published the group's first error
        self.store.set(f"proc/{rank}", json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        if world_size > 1:
            self._agree_on_check()

    def _agree_on_check(self):
        """Every worker must check signatures, or none: a check on one side would pair with a payload."""
        self.store.set(f"check/{self.rank}", str(int(self.check)))
        keys = [f"check/{r}" for r in range(self.world_size)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=max(self.timeout, 300.0)))
        except RuntimeError as e:   # DistStoreError: a worker never started
            raise TimeoutError(f"rank {self.rank}: not every worker started its collective group: {e}") from None
        flags = [self.store.get(k).decode() for k in keys]
        if len(set(flags)) > 1:
            raise ValueError(f"DTAPE_CHECK_COLLECTIVES differs between workers (check on: "
                             f"{[r for r, f in enumerate(flags) if f == '1']}, off: "
                             f"{[r for r, f in enumerate(flags) if f == '0']}); set it the same on every worker")

    # -- collectives ----------------------------------------------------------------
    def all_reduce(self, t, op="sum", label=None):
        """The elementwise sum (op "sum") or mean ("mean") of `t` over every worker.

        Args:
          t: torch.Tensor of any shape; identical shape and dtype on every
            worker; on `self.device` (moved there if not; the result comes
            back on t's device). Not modified.
          op: "sum" or "mean" (or a ReduceOp with that name).
          label: the dtape call this collective belongs to, named if the
            workers' collectives differ (an enclosing `labelled` block wins).

        Returns:
          A new torch.Tensor, t's shape, dtype and device.

        Raises:
          CollectiveMismatchError: another worker entered another collective
            (or this one with another shape or dtype) at this position.
          The failing peer's exception (see the module docstring),
          TimeoutError, ValueError for an unknown op.
        """
        op = str(getattr(op, "name", op)).lower()
        if op not in ("sum", "mean"):
            raise ValueError(f"all_reduce op must be 'sum' or 'mean', got {op!r}")
        out = self._staged(t)
        self._sum("all_reduce", out, label)
        if op == "mean":
            out = out / self.world_size if out.is_floating_point() else torch.div(out, self.world_size,
                                                                                  rounding_mode="floor")
        return out.to(t.device)

    def all_reduce_async(self, t, scratch=False, label=None, announce=None, announced=False, sources=0,
                         flagged=False):
        """Launches the SUM of `t` over every worker; returns a pending result whose `wait()` gives it.

        Launch order must match on every worker (as every collective);
        the signature check runs before the launch (it raises
        CollectiveMismatchError here); `wait()` fails fast, naming the
        failing rank, as `all_reduce` does.
        `scratch=True`: the caller gives `t` away (a buffer it never reads
        again), so a contiguous `t` on the collective device is reduced in
        place instead of copied first (the result is then `t` itself).
        `announce`: [(torch.dtype, numel)] of the 1-D all-reduces the caller
        launches next, each with `announced=True` and the same label, whose
        last element is 0 or 1 on every worker (e.g. a presence flag): the
        check of this one covers them, so they skip their own. Anything else
        entered instead, on any worker, still raises CollectiveMismatchError
        on every worker before any value is returned (from `wait()` where a
        worker was already inside an announced one).
        `sources`: 0, or a positive int below 2**31 naming what the values
        stand for (a gradient bucket's sources): part of the signature, so
        workers that differ there raise CollectiveMismatchError.
        `flagged`: `t` is 1-D and its last element is 0 or 1 on every worker,
        as for `announced`: a prediction may announce it (then it skips its
        check; see the module docstring).
        """
        out = t.detach() if scratch and _in_place_ok(t, self.device) else self._staged(t)
        what, unchecked = self._enter("all_reduce", out, label, src=sources, announce=announce, announced=announced,
                                      flagged=flagged)
        try:
            work = dist.all_reduce(out, dist.ReduceOp.SUM, group=self.group, async_op=True)
        except RuntimeError as e:
            self._fail_from_transport(what, e)
        return _Pending(self, work, out, t.device, what, self._signed if unchecked else None)

    def all_gather(self, t, label=None):
        """Every worker's `t`, stacked in rank order: [world_size, *t.shape], on t's device.

        `t` must have the same shape and dtype on every worker (see
        `all_gather_uneven` for a first dimension that differs); else
        CollectiveMismatchError on every worker.
        """
        src = self._staged(t)
        parts = [torch.empty_like(src) for _ in range(self.world_size)]
        self._run("all_gather", src, label,
                  lambda: dist.all_gather(parts, src, group=self.group, async_op=True))
        return torch.stack(parts).to(t.device)

    def all_gather_uneven(self, t, label=None):
        """Every worker's `t` concatenated along dim 0 in rank order; dim 0 may differ per worker.

        Args:
          t: torch.Tensor with ndim >= 1; dims after the first, and the
            dtype, identical on every worker.
          label: as for `all_reduce`.

        Returns:
          [sum of every worker's t.shape[0], *t.shape[1:]] on t's device.
        """
        sizes = self.all_gather(torch.tensor([t.shape[0]], dtype=torch.int64), label).flatten().tolist()
        longest = max(sizes)
        padded = torch.zeros((longest,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        padded[:t.shape[0]] = t
        gathered = self.all_gather(padded, label)
        return torch.cat([gathered[i, :n] for i, n in enumerate(sizes)])

    def broadcast(self, t, src=0, label=None):
        """Worker `src`'s `t` on every worker (a new tensor on t's device; t's shape/dtype on every worker)."""
        out = self._staged(t)
        self._run("broadcast", out, label,
                  lambda: dist.broadcast(out, src, group=self.group, async_op=True), src)
        return out.to(t.device)

    def barrier(self, label=None):
        """Returns once every worker has reached it (a one-element all-reduce: works on gloo and NCCL).

        Its signature says "barrier", so it never pairs with a peer's one-element reduction.
        """
        self._sum("barrier", torch.zeros(1, device=self.device), label)

    def _staged(self, t):
        """A private contiguous copy of `t` on the collective device (collectives work in place)."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"collectives take torch.Tensor values, got {type(t).__name__}")
        return t.detach().to(self.device, copy=True).contiguous()

    # -- the ledger -------------------------------------------------------------------
    def _enter(self, kind, t, label, src=0, check=True, announce=None, announced=False, flagged=False):
        """Enters the next collective: its number, and (checking) the signature check with every worker.

        Returns (its description, e.g. "all_reduce #12 of checkpoint.save (float32[1])", and whether an
        earlier check announced it: then nothing is exchanged). `check=False`: the caller exchanges the
        signature itself (`_sum`). `announce`, `announced`, `flagged`: see `all_reduce_async`.

        Raises:
          CollectiveMismatchError: on every worker, when any signature differs.
        """
        what = f"{kind} #{self._seq + 1}"
        self._raise_if_failed(what)
        label = current_label(label)
        signed, what = _signed(self._seq + 1, kind, t, src, label)
        after, self._after = self._after, None
        follower = (tuple(signed[1:12]), t.dtype, t.numel(), label, tuple(announce or ())) if flagged else None
        if self._announced:
            if (announced or flagged) and self._is_next(signed, label, announce):
                self._announced.popleft()
                if not self._announced:
                    self._predictor = None
                self._learn(after, follower)
                what = describe_signature(signed) if signed[12] else what
                self._seq, self._signed, self._entered = self._seq + 1, signed, what
                return what, True
            self._poison_announced(what)   # then this collective's own check pairs with every worker's
            signed[12:] = [0, 0, 0]        # (plan fields `_is_next` may have filled)
        self._seq += 1
        self._signed, self._entered, self._planned = signed, what, []
        if self.check:
            self._learn(after, follower)
        if announce and self.check and self._plans:
            self._signed[12:], self._planned = _plan(self._seq, label, announce)
        elif self.check:
            self._after = tuple(signed[1:12])   # announcing nothing itself: it may predict what follows it
            self._predict()
        if self._signed[12]:
            what = self._entered = describe_signature(self._signed)
        if self.check and check:
            self._exchange_signatures(what, [])
        return what, False

    def _is_next(self, signed, label, announce):
        """Whether `signed` (its plan fields filled from `announce` here) is the next announced all-reduce."""
        head = self._announced[0][0]
        if signed[:12] != head[:12]:
            return False
        if announce and self._plans:
            signed[12:] = _plan(signed[0], label, announce)[0]
        return signed == head

    def _learn(self, after, follower):
        """Notes that `follower` (a flagged all-reduce's key, or None: anything else) came right after the
        collective keyed `after` (None: nothing to learn). Every worker learns the same: it sees only
        signatures that every worker checked or announced."""
        if after is None:
            return
        known = self._follows.get(after)
        if known is not None and known[0] == follower and follower is not None:
            known[1] += 1
            return
        if len(self._follows) >= _FOLLOWS_MAX:
            self._follows.clear()
        self._follows[after] = [follower, 1]

    def _predict(self):
        """Announces, in the current (checked, announcing nothing) collective's plan fields, the flagged
        all-reduce that followed it the latest _PREDICT_AFTER times, and the all-reduces that one announces."""
        known = self._follows.get(self._after)
        if not self._plans or known is None or known[0] is None or known[1] < _PREDICT_AFTER:
            return
        tail, dtype, numel, label, specs = known[0]
        first = [self._seq + 1, *tail, 0, 0, 0]
        rest = []
        if specs:
            first[12:], rest = _plan(self._seq + 1, label, list(specs))
        self._planned = [(first, dtype, numel)] + rest
        self._signed[12:] = _plan_fields(self._planned)
        self._predictor = self._after

    def _poison_announced(self, what):
        """Before entering `what` instead of an announced all-reduce: one poison per announced one still to come,
        each of its size (a peer inside one gets a negative last element, see `_Pending.wait`)."""
        left, self._announced = list(self._announced), collections.deque()
        for _, dtype, numel in left:
            poison = torch.full((numel,), _POISON, dtype=dtype, device=self.device)
            self._launch_and_wait(what, lambda p=poison: dist.all_reduce(p, dist.ReduceOp.SUM, group=self.group,
                                                                          async_op=True))
        # every worker that poisons checks what it enters next; the checks pass only where every worker left the
        # plan at the same point for the same collective: then stop announcing (it would cost poisons every step),
        # or, for a prediction, learn again what follows its predictor
        if self._predictor is None:
            self._plans = False
        else:
            self._follows.get(self._predictor, [None, 0])[1] = 0
            self._predictor = None

    def _announced_poisoned(self, signed, what):
        """A peer entered something else where this worker's announced all-reduce `signed` was: poisons the
        announced ones still to come, then names every worker's call in one check (it always differs)."""
        self._raise_if_failed(what)
        self._poison_announced(what)
        self._signed, self._planned = signed[:12] + [_PLAN_LEFT, 0, 0], []
        self._exchange_signatures(what, [])
        self._fail(CollectiveMismatchError(f"rank {self.rank}: collectives out of step: a peer entered another "
                                           f"collective where {what} was announced; no value was returned"))

    def _exchange_signatures(self, what, payload):
        """Every worker's message (signature, then `payload` padded to _INLINE_MAX) as lists of floats, in
        rank order; raises CollectiveMismatchError on every worker unless every signature is this one's."""
        n = _SIG_LEN + _INLINE_MAX
        self.exchanges += 1
        message = torch.tensor(self._signed + payload + [0.0] * (_INLINE_MAX - len(payload)), dtype=torch.float64,
                               device=self.device)
        flat = torch.empty(self.world_size * n, dtype=torch.float64, device=self.device)  # gloo wants it 1-D
        self._launch_and_wait(what, lambda: _all_gather_single(flat, message, group=self.group, async_op=True))
        rows = flat.tolist()
        rows = [rows[r * n:(r + 1) * n] for r in range(self.world_size)]
        if any(row[:_SIG_LEN] != self._signed for row in rows):   # floats == ints: exact below 2**53
            table = [[int(x) for x in row[:_SIG_LEN]] for row in rows]
            self._fail(CollectiveMismatchError(mismatch_message(self.rank, table)))
        self._announced.extend(self._planned)   # every worker announced the same
        self._planned = []
        return rows

    def _sum(self, kind, out, label):
        """Sums `out` (on the collective device) over the workers, in place.

        A small floating `out` travels with the signature in the same
        float64 all-gather (signatures are integers below 2**53, exact in
        float64), so the check costs no extra round trip; each worker then
        sums the gathered values in float64 in rank order and rounds once
        to out's dtype: the same on every worker (with 2 workers,
        bit-identical to a sum in out's dtype).
        """
        if not (self.check and out.is_floating_point() and out.numel() <= _INLINE_MAX):
            self._run(kind, out, label, lambda: dist.all_reduce(out, dist.ReduceOp.SUM, group=self.group,
                                                                 async_op=True))
            return
        what, _ = self._enter(kind, out, label, check=False)
        n = out.numel()
        rows = self._exchange_signatures(what, out.reshape(-1).tolist())
        sums = [functools.reduce(operator.add, column) for column in zip(*(row[_SIG_LEN:_SIG_LEN + n] for row in rows))]
        out.copy_(torch.tensor(sums, dtype=torch.float64).view(out.shape))

    def _run(self, kind, t, label, launch, src=0):
        """Enters one collective (signature check), launches it and waits, failing fast and naming the failing rank."""
        self._launch_and_wait(self._enter(kind, t, label, src)[0], launch)

    def _launch_and_wait(self, what, launch):
        try:
            work = launch()
        except RuntimeError as e:
            self._fail_from_transport(what, e)
        self._wait(work, what)

    # -- waiting ----------------------------------------------------------------------
    def _wait(self, work, what):
        start = checked = time.monotonic()
        # gloo's wait returns as soon as the work is done, so its first slice is the longest;
        # NCCL is polled with sleeps, so they start short.
        pause, marked = (0.001 if self.device.type == "cuda" else _POLL_MAX_S), False
        while True:
            try:
                if self._wait_slice(work, pause):
                    return
            except RuntimeError as e:
                if "timed out" not in str(e).lower():
                    self._fail_from_transport(what, e)
            now = time.monotonic()
            if now - checked >= _POLL_MAX_S * 0.99:  # the store at most every slice's worth of waiting
                self._raise_if_peer_failed(what)
                checked = now
            waited = now - start
            if not marked and waited > _MARK_WAITING_AFTER_S:
                self.store.set(f"at/{self.rank}", f"{self._seq}\t{what}")
                marked = True
            if waited > self.timeout:
                self._fail(TimeoutError(self._timeout_message(what)))
            pause = min(pause * 2, _POLL_MAX_S)

    def _wait_slice(self, work, pause):
        """True once `work` is done (raising its error), after waiting at most about `pause` seconds."""
        if self.device.type == "cuda":   # NCCL: a host wait with a timeout may abort the communicator; poll
            if work.is_completed():
                return work.wait()
            time.sleep(pause)
            return False
        # gloo: whole milliseconds, as c10d reads a 0 ms timeout as "wait forever"
        return work.wait(timeout=datetime.timedelta(milliseconds=max(1, round(pause * 1000))))

    def _raise_if_failed(self, what):
        """Refuses a launch after this worker failed. A peer's failure is seen by the wait (a collective
        cannot finish without the peer), so a launch costs no store round trip."""
        if self._failed is not None:
            raise RuntimeError(f"rank {self.rank}: cannot run {what}: this worker's group already failed "
                               f"({self._failed}); restart the workers (e.g. torchrun --max-restarts)")

    def _raise_if_peer_failed(self, what):
        try:
            published = self.store.get("error") if self.store.check(["error"]) else None
        except (RuntimeError, OSError) as e:  # DistStoreError is a RuntimeError
            self._fail(PeerFailure(f"rank {self.rank}: {what}: the group's store is unreachable ({e}); the process "
                                   "hosting it (torchrun's agent, or rank 0 without torchrun) has probably died"))
        if published is not None:
            self._fail(peer_exception(json.loads(published), self.rank, what), ack=True)

    def _fail_from_transport(self, what, cause):
        """A collective failed in the transport: a peer died or closed its connection."""
        self._raise_if_peer_failed(what)  # a peer that raised published before it exited
        deadline = time.monotonic() + 1.0  # a killed process closes its sockets a moment before it is a zombie
        dead = self._dead_local_ranks()
        while not dead and time.monotonic() < deadline:
            time.sleep(0.01)
            dead = self._dead_local_ranks()
        who = f"rank {', '.join(map(str, dead))} died (no exception published: killed, e.g. SIGKILL or " \
              f"out of memory)" if dead else "a peer closed its connection (rank unknown)"
        err = PeerFailure(f"rank {self.rank}: {what} failed because {who}; transport error: {cause}")
        self._fail(err, ack=True)

    def _local_peers(self):
        """{rank: pid} of the other workers on this host (from what they registered at start-up)."""
        host, peers = socket.gethostname(), {}
        for r in range(self.world_size):
            if r != self.rank and self.store.check([f"proc/{r}"]):
                info = json.loads(self.store.get(f"proc/{r}"))
                if info["host"] == host:
                    peers[r] = info["pid"]
        return peers

    def _dead_local_ranks(self):
        return [r for r, pid in self._local_peers().items() if not _process_alive(pid)]

    def _timeout_message(self, what):
        behind = [r for r in range(self.world_size) if r != self.rank and not self._reached(r)]
        who = f"ranks {behind} never reached it" if behind else \
            "every rank launched as many collectives but it did not finish (a peer may be in another collective " \
            f"that is its #{self._seq}: the workers did not run the same steps)"
        return (f"rank {self.rank}: {what} did not finish within {self.timeout:g} s: {who}; raise "
                "DTAPE_DISTRIBUTE_TIMEOUT or the strategy's timeout if the step is just slow" + _hints(what))

    def _reached(self, r):
        return self._waiting_in(r)[0] >= self._seq

    def _fail(self, err, ack=False):
        """Marks this worker failed, tells the store (acknowledging a peer's error), and raises `err`."""
        self._failed = f"{type(err).__name__}: {err}"
        note = getattr(err, "__notes__", [""])[0].split("\n")[0]
        print(f"dtape: rank {self.rank}: step failed: {self._failed} {note}", file=sys.stderr, flush=True)
        if ack:  # after printing: the failing worker leaves once acknowledged, and torchrun then stops us
            self.store.add("acks", 1)
        raise err

    # -- publishing ---------------------------------------------------------------------
    def publish_error(self, exc):
        """Publishes `exc` as this worker's failure (unless it only reports a peer's) and waits for acks.

        Call it on the failing worker before it leaves; peers blocked in a
        collective then raise it (see the module docstring). The wait for
        acknowledgements is bounded (a few seconds), so a peer busy
        elsewhere never holds the failing worker back for long.
        """
        if isinstance(exc, (PeerFailure, TimeoutError)) or getattr(exc, "_dtape_from_peer", False):
            return
        if self._failed is not None:   # already reported (run, then sys.excepthook, see the same error)
            return
        self._failed = f"{type(exc).__name__}: {exc}"
        payload = json.dumps(error_payload(exc, self.rank, self.world_size))
        first = self.store.compare_set("error", "", payload).decode() == payload
        self._published = first
        if first:
            deadline = time.monotonic() + min(_ACK_WAIT_S, self.timeout)
            while self.store.add("acks", 0) < self.world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.01)


    def exit_barrier(self):
        """At a clean exit: waits until every worker has reached its own exit, through the store only.

        Never a collective: a one-element all-reduce here would pair with a
        peer's next reduction (a peer still in the training loop) and hand
        it a wrong sum. Each worker records how many collectives it
        launched; the workers leave together only when every count is the
        same. A peer that waits in a collective this worker never launched
        (it marks its position after a second), or that exited after another
        count, gets an error published naming this rank, so it fails at once
        instead of computing with a missing partner.

        Returns:
          True when every worker reached its exit after the same collectives
          (the group can be destroyed); False after publishing such an error,
          after a peer's published error, or past the timeout.
        """
        self.store.set(f"exit/{self.rank}", f"{self._seq}\t{self._entered}")
        keys = [f"exit/{r}" for r in range(self.world_size)]
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.store.check(["error"]):
                return False
            if self.store.check(keys):
                last = [_position(self.store.get(k)) for k in keys]
                if len({n for n, _ in last}) == 1:
                    return True
                self._publish_left_early(", ".join(f"rank {r} exited after collective #{n} ({what or 'none'})"
                                                   for r, (n, what) in enumerate(last)))
                return False
            ahead = {r: at for r in range(self.world_size) if r != self.rank
                     and not self.store.check([keys[r]]) and (at := self._waiting_in(r))[0] > self._seq}
            if ahead:
                self._publish_left_early(", ".join(f"rank {r} waits in {what}" for r, (_, what) in ahead.items()))
                return False
            time.sleep(_POLL_MAX_S)
        return False

    def _waiting_in(self, r):
        """(number, description) of the collective rank `r` has been waiting in for over a second ((0, "") if none)."""
        key = f"at/{r}"
        return _position(self.store.get(key)) if self.store.check([key]) else (0, "")

    def _publish_left_early(self, why):
        mine = f" ({self._entered})" if self._entered else ""
        err = RuntimeError(f"rank {self.rank} left the program after collective #{self._seq}{mine} while {why}; "
                           f"every worker must run the same steps and collectives (did rank {self.rank} leave its "
                           "training loop early, e.g. sys.exit() or return outside strategy.run?)" + _hints(why))
        print(f"dtape: rank {self.rank}: exit: {err}", file=sys.stderr, flush=True)
        self.publish_error(err)

    def leave_after_failure(self):
        """At exit after a failure: the worker whose error started it waits (a few seconds at most) until
        every peer has reached its exit (its error printed), then leaves first, so torchrun names it as
        the root cause; torchrun then stops the peers still tearing down. The others say they are leaving."""
        try:
            if not self._published:
                self.store.add("left", 1)
                return
            deadline = time.monotonic() + min(_ACK_WAIT_S, self.timeout)
            while self.store.add("left", 0) < self.world_size - 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        except (RuntimeError, OSError):  # the store went with a dead worker: nothing left to coordinate
            pass


def _position(value):
    """(number, description) from a store value "12\tall_reduce #12 of checkpoint.save (float32[1])"."""
    n, _, what = value.decode().partition("\t")
    return int(n), what


def _hints(text):
    """" Hint: ..." for each call in `text` that users often make on one worker only."""
    return "".join(f" Hint: {h}." for name, h in _COLLECTIVE_APIS.items() if f" of {name} (" in text)


def _in_place_ok(t, device):
    return t.device == device and t.is_contiguous()


class _Pending:
    """One launched collective: `wait()` waits once (with the communicator's checks), then returns its tensor."""

    def __init__(self, comm, work, out, device, what, announced=None):
        self._comm, self._work, self._out, self._device, self._what = comm, work, out, device, what
        self._announced = announced   # its signature when it skipped its check (announced by an earlier one)
        self._waited = False

    def wait(self):
        if not self._waited:
            self._comm._wait(self._work, self._what)
            if self._announced is not None and self._out.reshape(-1)[-1].real.item() < 0:   # a peer's poison
                self._comm._announced_poisoned(self._announced, self._what)
            self._waited = True
        return self._out.to(self._device)


def _process_alive(pid):
    """False when `pid` is gone or a zombie (killed and not yet reaped), on this host."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return True


def error_payload(exc, rank, world_size):
    """A JSON-able description of `exc` raised on worker `rank`."""
    cls = type(exc)
    tb = "".join(traceback.format_exception(exc)[-6:])
    arg = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)
    return {"rank": rank, "world_size": world_size, "module": cls.__module__, "type": cls.__qualname__,
            "message": str(exc), "arg": arg, "host": socket.gethostname(), "pid": os.getpid(), "traceback": tb}


def peer_exception(payload, rank, what):
    """The exception a peer raises for a published failure: the original type where it can be rebuilt.

    Builtin exception types (ValueError, ZeroDivisionError, ...) and types
    from modules this process already imported, constructible from one
    message, come back with their type; anything else is a WorkerError.
    A note names the failing rank, its host and pid, and where this worker was.
    """
    cls = _exception_class(payload["module"], payload["type"])
    message = payload["message"]
    try:
        err = cls(payload.get("arg", message)) if cls is not None else None   # KeyError's str() adds quotes
    except Exception:  # noqa: BLE001 - a constructor that wants other arguments
        err = None
    if err is None:
        err = WorkerError(f"{payload['module']}.{payload['type']}: {message}")
    err._dtape_from_peer = True
    add_note(err, f"(raised on worker rank {payload['rank']} of {payload['world_size']}, host {payload['host']}, "
                  f"pid {payload['pid']}; rank {rank} was waiting in {what})\n"
                  f"rank {payload['rank']}'s traceback (last frames):\n{payload['traceback']}")
    return err


def _exception_class(module, qualname):
    owner = builtins if module == "builtins" else sys.modules.get(module)
    cls = owner
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        return cls
    return None


__all__ = ["Communicator", "WorkerError", "PeerFailure", "CollectiveMismatchError", "labelled", "current_label",
           "KNOWN_LABELS", "describe_signature", "mismatch_message", "all_reduce", "all_gather", "broadcast", "barrier",
           "set_active", "active", "active_or_none", "error_payload", "peer_exception"]
