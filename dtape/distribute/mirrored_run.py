"""Replica threads and the merge_call rendezvous of MirroredStrategy.

One long-lived thread per replica runs `fn`; the caller's thread
coordinates: it waits until every replica has either finished or reached a
`merge_call`, runs `merge_fn` once in the cross-replica context, and hands
each replica its part. An exception on any replica aborts the step on every
replica and is re-raised from `run`; every wait has a timeout.
Source: tensorflow/python/distribute/mirrored_run.py.

Failures and lifecycle:
  * A replica still running user code when a step ends badly (timeout,
    interrupt, or a peer's error it did not finish within the timeout) is
    abandoned: the tapes it pushed leave the global tape set, the step's
    results are dropped, and a fresh thread serves its next step; the old
    thread exits when its job returns. Replicas waiting in merge_call get
    `StepAborted` at once.
  * `merge_fn` runs on the caller's thread (it keeps the caller's
    thread-local state and Ctrl-C reaches it); one that takes longer than
    the timeout fails the step with a TimeoutError naming it once it
    returns.
  * KeyboardInterrupt (or another BaseException) in the caller during `run`
    aborts the step and raises `StepAborted` asynchronously in the replicas
    running user code (delivered at their next Python bytecode; a long C
    call ends first), waits briefly for them, and re-raises. Replicas inside
    the step's machinery (merge_call, an all-reduce: `Coordinator.shielded`)
    are woken instead, and raise StepAborted when they leave it. Updates of
    mirrored components run on the caller's thread in an `uninterrupted`
    section: Ctrl-C is raised after their last write. At interpreter
    exit, replicas still running get the same, so no replica is inside
    torch when the interpreter finalizes.
"""
import atexit
import ctypes
import queue
import threading
import time
import weakref

from dtape import tape as _tp
from dtape._notes import add_note
from dtape import variables
from dtape.distribute import context, replica_scope
from dtape.distribute.distribute_lib import ReplicaContext
from dtape.distribute.interrupts import StepAborted
from dtape.distribute.values import regroup, select_replica

# Seconds an interrupted step (and interpreter exit) waits for replicas to stop.
_INTERRUPT_GRACE_S = 1.0




# The caller's waits wake this often: CPython handles a signal that lands just
# before a blocking wait only when the wait returns, so Ctrl-C needs short waits.
_SIGNAL_POLL_S = 0.1


def _wait_for(cond, predicate, timeout):
    """`cond.wait_for(predicate, timeout)` in short slices, so the caller's Ctrl-C is seen at once."""
    deadline = time.monotonic() + timeout
    result = predicate()
    while not result:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        cond.wait(min(remaining, _SIGNAL_POLL_S))
        result = predicate()
    return result


try:  # CPython: raise an exception in another thread at its next bytecode
    _set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    _set_async_exc.argtypes = (ctypes.c_ulong, ctypes.c_void_p)
    _set_async_exc.restype = ctypes.c_int
except AttributeError:  # other implementations: replicas stop at their next merge_call only
    _set_async_exc = None


def _raise_async(ident, exc_type):
    """Raises `exc_type` in thread `ident` at its next bytecode; False if not possible."""
    return _set_async_exc is not None and _set_async_exc(ident, id(exc_type)) == 1


def _take_pending_async():
    """Lets an asynchronous exception sent to this thread land here, and swallows it.

    CPython's way to cancel one (`PyThreadState_SetAsyncExc(id, NULL)`) leaves
    the interpreter's "async exception pending" flag set for good, which slows
    every later bytecode of every thread; delivering it resets the flag.
    """
    try:
        for _ in range(1_000_000):  # the eval loop checks for it at each backward jump
            pass
    except StepAborted:
        pass


# Process-wide: threads running a replica job now (ident -> Thread), for the exit handler.
_running = {}
_running_lock = threading.Lock()


def _serve(jobs):
    """Thread body: runs jobs until a None arrives. References only its queue, never a strategy."""
    me = threading.current_thread()
    while True:
        try:
            job = jobs.get()
            if job is None:
                return
            with _running_lock:
                _running[me.ident] = me
            try:
                job()
            finally:
                job = None  # drop the step's references before waiting for the next job
                with _running_lock:
                    _running.pop(me.ident, None)
        except StepAborted:
            continue  # an asynchronous abort that arrived after its job had ended


# Process-wide: every replica thread started, so that exit can wait for them (weak: dead ones go).
_all_threads = weakref.WeakSet()


@atexit.register
def _stop_running_replicas():
    """At exit: aborts replica jobs still running, stops idle replica threads, and waits briefly.

    No replica thread may be inside torch, or still exiting (tearing down its
    thread-local torch state), once the interpreter finalizes: that aborts the
    process with "terminate called without an active exception". Runs after
    the strategies' own finalizers (atexit is last-in, first-out).
    """
    with _running_lock:
        running = list(_running.values())
    for t in running:
        _raise_async(t.ident, StepAborted)
    replicas = [t for t in list(_all_threads) if t.is_alive()]
    for t in replicas:
        t.stop()
    deadline = time.monotonic() + _INTERRUPT_GRACE_S
    for t in running:
        t.join(max(0.0, deadline - time.monotonic()))
    for t in replicas:
        t.join(max(0.0, deadline - time.monotonic()))


class ReplicaThread:
    """A daemon thread that runs jobs for one replica, one at a time."""

    def __init__(self, replica_id, device):
        self.replica_id = replica_id
        self.device = device
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(target=_serve, args=(self._jobs,), name=f"dtape-replica-{replica_id}",
                                        daemon=True)
        self._thread.start()
        _all_threads.add(self)

    def submit(self, job):
        self._jobs.put(job)

    def stop(self):
        """Asks the thread to exit after its current job; does not wait."""
        self._jobs.put(None)

    def join(self, timeout):
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def is_alive(self):
        return self._thread.is_alive()


class ReplicaPool:
    """The replica threads of one strategy. Holds no reference to the strategy, so a
    `weakref.finalize` on the strategy can stop the threads when it is collected."""

    def __init__(self, devices):
        self._devices = tuple(devices)
        self.threads = [ReplicaThread(i, d) for i, d in enumerate(self._devices)]

    def replace(self, ids):
        """Abandons the threads of replicas `ids` (they exit after their job) and starts fresh ones."""
        for i in ids:
            self.threads[i].stop()
            self.threads[i] = ReplicaThread(i, self._devices[i])

    def stop(self):
        """Asks every thread to exit after its current job (safe from a finalizer on any thread)."""
        for t in self.threads:
            t.stop()

    def join(self, timeout):
        """Waits up to `timeout` seconds in all for the threads to exit; True if all did."""
        deadline = time.monotonic() + timeout
        stopped = [t.join(max(0.0, deadline - time.monotonic())) for t in self.threads]  # join every one
        return all(stopped)


class Coordinator:
    """State of one `run` step: results, errors and pending merge calls, under one condition."""

    def __init__(self, strategy, num_replicas, timeout):
        self.strategy = strategy
        self.n = num_replicas
        self.timeout = timeout
        self.cond = threading.Condition()
        self.done = [False] * num_replicas
        self.results = [None] * num_replicas
        self.errors = [None] * num_replicas
        self.pending = {}
        self.merged = {}
        self.in_merge_call = set()
        self.idents = [None] * num_replicas
        self.user_lock = threading.Lock()  # guards in_user and the sending of asynchronous aborts
        self.in_user = [False] * num_replicas
        self.abort_sent = [False] * num_replicas
        self.tapes = [_tp.PushedTapes() for _ in range(num_replicas)]
        self.aborted = False
        self.progress_at = time.monotonic()  # last time the coordinator moved the step on
        self.collectives = None  # the step's all-reduces among replica threads (cross_device_ops)
        self.in_collective = {}  # replica id -> number of the all-reduce it waits in (kept by cross_device_ops)
        self.raised = []  # replica ids in the order their errors arrived

    # -- replica side ---------------------------------------------------------
    def replica_job(self, fn, replica_id, args, kwargs, stack, creators, caller):
        rctx = ReplicaContext(self.strategy, replica_id, self)

        def job():
            try:
                self._enter_user(replica_id)
                try:
                    with replica_scope.replica_scope(self.strategy, replica_id, caller), context.set_stack(stack), \
                            variables.set_creator_stack(creators), context.enter_mode(self.strategy, rctx), \
                            _tp.track_pushed_tapes(self.tapes[replica_id]):
                        result = fn(*args, **kwargs)
                finally:
                    self._leave_user(replica_id)
                self.results[replica_id] = result
            except BaseException as e:  # noqa: BLE001 - every failure must reach run()
                with self.cond:
                    self.errors[replica_id] = e
                    self.raised.append(replica_id)
            finally:
                with self.cond:
                    self.done[replica_id] = True
                    self.cond.notify_all()
        return job

    def _enter_user(self, replica_id):
        with self.user_lock:
            if self.aborted:
                raise StepAborted(f"replica {replica_id}: step aborted before it started")
            self.idents[replica_id] = threading.get_ident()
            self.in_user[replica_id] = True

    def _leave_user(self, replica_id):
        # Under user_lock no abort can be sent any more, and one sent but not
        # yet delivered is cancelled: it can never land in this bookkeeping.
        with self.user_lock:
            self.in_user[replica_id] = False
            if self.abort_sent[replica_id]:
                try:
                    _take_pending_async()
                except StepAborted:  # delivered on entering the call: swallowed all the same
                    pass
                self.abort_sent[replica_id] = False

    def _resume_user(self, replica_id, stop=True):
        with self.user_lock:
            if self.aborted:  # no asynchronous abort reached this replica meanwhile
                if stop:
                    raise StepAborted(f"replica {replica_id}: step aborted")
                return
            self.in_user[replica_id] = True

    def shielded(self, replica_id):
        """Context manager for the step's machinery on replica `replica_id` (merge_call, all-reduces).

        No asynchronous StepAborted lands inside: it could land in a
        Condition's Python code with the step's lock held and never released,
        or between a collective's sum and its publication, and every later wait
        would hang. An abort that came meanwhile is raised on leaving.
        """
        return _Shielded(self, replica_id)

    def merge_call(self, replica_id, merge_fn, args, kwargs):
        with self.shielded(replica_id):
            return self._merge_call(replica_id, merge_fn, args, kwargs)

    def _merge_call(self, replica_id, merge_fn, args, kwargs):
        with self.cond:
            if self.aborted:
                raise StepAborted(f"replica {replica_id}: step aborted before merge_call")
            self.pending[replica_id] = (merge_fn, args, kwargs)
            self.in_merge_call.add(replica_id)
            self.cond.notify_all()
            try:
                self._wait_merged(replica_id)
            finally:
                self.in_merge_call.discard(replica_id)
            return self.merged.pop(replica_id)

    def _wait_merged(self, replica_id):
        # The coordinator aborts on its own timeout; this limit only guards
        # against a coordinator that stopped (e.g. a merge_fn that never returns).
        while replica_id not in self.merged and not self.aborted:
            remaining = self.progress_at + 2 * self.timeout - time.monotonic()
            if remaining <= 0:
                raise StepAborted(f"replica {replica_id}: no progress for {2 * self.timeout:g} s "
                                  "while waiting in merge_call")
            self.cond.wait(remaining)
        if self.aborted:
            raise StepAborted(f"replica {replica_id}: step aborted while waiting in merge_call")

    # -- coordinator side -----------------------------------------------------
    def _settled(self):
        return all(self.done[i] or i in self.pending for i in range(self.n))

    def _failed(self):
        return any(e is not None for e in self.errors)

    def wait(self):
        """Drives the step to completion; returns the per-replica results.

        Raises the step's failure; the caller then calls `abort()` (for an
        Exception) or `interrupt()` (KeyboardInterrupt and other
        BaseExceptions), and `release()` in every case.
        """
        while True:
            with self.cond:
                settled = _wait_for(self.cond, lambda: self._settled() or self._failed(), self.timeout)
                if self._failed():
                    raise self._replica_error()
                if not settled:
                    raise TimeoutError(self._timeout_message())
                if all(self.done):
                    return list(self.results)
                if not all(i in self.pending for i in range(self.n)):
                    raise RuntimeError(self._partial_merge_message())
                calls, self.pending = self.pending, {}
                self.progress_at = start = time.monotonic()
            parts = self._run_merge(calls)
            if time.monotonic() - start > self.timeout:
                raise TimeoutError(self._slow_merge_message(calls))
            with self.cond:
                self.merged.update(parts)
                self.progress_at = time.monotonic()
                self.cond.notify_all()

    def _run_merge(self, calls):
        merge_fn = calls[0][0]
        args = regroup([calls[i][1] for i in range(self.n)])
        kwargs = regroup([calls[i][2] for i in range(self.n)])
        with context.enter_mode(self.strategy, None), _tp.stop_recording():
            result = merge_fn(self.strategy, *args, **kwargs)
        return {i: select_replica(i, result) for i in range(self.n)}

    def abort(self):
        """Ends the step: replicas in merge_call get StepAborted; waits for them to return."""
        with self.cond:
            self.aborted = True
            self.cond.notify_all()
            waiting = set(self.in_merge_call) | set(self.pending)
            _wait_for(self.cond, lambda: all(self.done[i] for i in waiting), self.timeout)

    def interrupt(self):
        """Aborts the step and raises StepAborted in the replicas running user code; waits briefly."""
        with self.cond:
            self.aborted = True
            self.cond.notify_all()
            with self.user_lock:
                for i in range(self.n):
                    if self.in_user[i] and i not in self.in_merge_call:
                        self.abort_sent[i] = _raise_async(self.idents[i], StepAborted)
            _wait_for(self.cond, lambda: all(self.done), min(self.timeout, _INTERRUPT_GRACE_S))

    def _replica_error(self):
        """A replica raised: aborts, waits up to the timeout for the others, returns the error to raise."""
        self.aborted = True
        self.cond.notify_all()
        finished = _wait_for(self.cond, lambda: all(self.done), self.timeout)
        error = self._first_error()
        if not finished:
            busy = [i for i in range(self.n) if not self.done[i]]
            timeout = TimeoutError(f"replicas {busy} were still running {self.timeout:g} s after the failure "
                                   "and were abandoned")
            if error.__context__ is None:
                error.__context__ = timeout
            add_note(error, str(timeout))
        return error

    def _first_error(self):
        """The error raised first (StepAborted aside: a consequence), noted with its replica."""
        for i in self.raised:
            e = self.errors[i]
            if e is not None and not isinstance(e, StepAborted):
                add_note(e, f"(raised on replica {i}, device {self.strategy.extended.worker_devices[i]})")
                return e
        reasons = sorted({str(e) for e in self.errors if e is not None})
        return RuntimeError(f"every replica's step was aborted: {'; '.join(reasons)}")

    def release(self):
        """After the step: drops its values and abandons replicas still running user code.

        Returns the ids of the abandoned replicas (their threads must be
        replaced); the tapes they pushed and did not pop leave the global set.
        """
        with self.cond:
            self.aborted = True  # no effect after a complete step; wakes merge_call waits otherwise
            self.cond.notify_all()
            stuck = [i for i in range(self.n) if not self.done[i]]
            self.results = [None] * self.n
            self.errors = [None] * self.n
            self.raised = []
            self.pending, self.merged = {}, {}
            self.collectives = None  # it refers back to this coordinator: no cycle outlives the step
        for i in stuck:
            self.tapes[i].detach()
        return stuck

    def _timeout_message(self):
        """Names the stalled replicas (neither finished nor waiting for the others), then who waits where."""
        in_merge = self.in_merge_call | set(self.pending)
        where = {}
        for i in sorted(in_merge):
            where.setdefault("merge_call", []).append(i)
        for i, seq in sorted(self.in_collective.items()):
            where.setdefault(f"all-reduce #{seq}", []).append(i)
        waits = "; ".join(f"replicas {ids} are waiting in {name}" for name, ids in where.items())
        stuck = [i for i in range(self.n) if not self.done[i] and i not in in_merge and i not in self.in_collective]
        if not stuck:  # nobody is missing: the replicas wait for one another in different places
            return (f"every unfinished replica waited {self.timeout:g} s for the others in another place "
                    f"({waits}); every replica must make the same merge_call/all_reduce calls in the same order")
        waits = f" ({waits})" if waits else ""
        return (f"replicas {stuck} neither finished nor reached merge_call within {self.timeout:g} s{waits}; "
                "raise DTAPE_DISTRIBUTE_TIMEOUT or the strategy's timeout if the step is just slow")

    def _slow_merge_message(self, calls):
        merge_fn = calls[0][0]
        name = getattr(merge_fn, "__qualname__", None) or repr(merge_fn)
        return (f"merge_fn {name} took longer than the timeout ({self.timeout:g} s); "
                "raise DTAPE_DISTRIBUTE_TIMEOUT or the strategy's timeout if it is just slow")

    def _partial_merge_message(self):
        waiting = sorted(self.pending)
        finished = [i for i in range(self.n) if self.done[i]]
        return (f"replicas {waiting} called merge_call but replicas {finished} returned without it; "
                "every replica must make the same merge_call/all_reduce calls in the same order")


class _Shielded:
    """`Coordinator.shielded`: replica code outside user mode (no asynchronous aborts) while inside."""

    __slots__ = ("_coord", "_replica_id", "_outer")

    def __init__(self, coord, replica_id):
        self._coord, self._replica_id = coord, replica_id

    def __enter__(self):
        self._outer = self._coord.in_user[self._replica_id]  # nested, or no user code: nothing to switch
        if self._outer:
            self._coord._leave_user(self._replica_id)
        return self

    def __exit__(self, exc_type, *exc):
        if self._outer:  # an exception already leaving is not replaced by StepAborted
            self._coord._resume_user(self._replica_id, stop=exc_type is None)
        return False


def run_on_replicas(strategy, pool, fn, args, kwargs, timeout):
    """Runs fn on every replica thread of `pool`; returns the list of per-replica results."""
    threads = pool.threads
    coord = Coordinator(strategy, len(threads), timeout)
    stack = context.current_stack()
    creators = variables.current_creator_stack()
    caller = replica_scope.capture_caller_state()  # autocast, grad mode: thread-local in torch
    try:
        for i, thread in enumerate(threads):
            thread.submit(coord.replica_job(fn, i, select_replica(i, args), select_replica(i, kwargs),
                                            stack, creators, caller))
        return coord.wait()
    except Exception:
        coord.abort()
        raise
    except BaseException:  # KeyboardInterrupt, SystemExit: stop the replicas now
        coord.interrupt()
        raise
    finally:
        stuck = coord.release()
        if stuck:
            pool.replace(stuck)
