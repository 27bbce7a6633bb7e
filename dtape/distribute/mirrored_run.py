"""Replica threads and the merge_call rendezvous of MirroredStrategy.

One long-lived thread per replica runs `fn`; the caller's thread
coordinates: it waits until every replica has either finished or reached a
`merge_call`, runs `merge_fn` once in the cross-replica context, and hands
each replica its part. An exception on any replica aborts the step on every
replica and is re-raised from `run`; every wait has a timeout.
Source: tensorflow/python/distribute/mirrored_run.py.
"""
import queue
import threading
import time

from dtape import tape as _tp
from dtape import variables
from dtape.distribute import context, replica_scope
from dtape.distribute.distribute_lib import ReplicaContext
from dtape.distribute.values import regroup, select_replica


class StepAborted(BaseException):
    """Raised inside replicas whose step was ended by another replica's failure."""


class ReplicaThread:
    """A daemon thread that runs jobs for one replica, one at a time."""

    def __init__(self, replica_id, device):
        self.replica_id = replica_id
        self.device = device
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=f"dtape-replica-{replica_id}", daemon=True)
        self._thread.start()

    def _loop(self):
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    def submit(self, job):
        self._jobs.put(job)

    def stop(self):
        self._jobs.put(None)


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
        self.aborted = False

    # -- replica side ---------------------------------------------------------
    def replica_job(self, fn, replica_id, args, kwargs, stack, creators, caller):
        rctx = ReplicaContext(self.strategy, replica_id, self)

        def job():
            try:
                with replica_scope.replica_scope(self.strategy, replica_id, caller), context.set_stack(stack), \
                        variables.set_creator_stack(creators), context.enter_mode(self.strategy, rctx):
                    self.results[replica_id] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - every failure must reach run()
                self.errors[replica_id] = e
            finally:
                with self.cond:
                    self.done[replica_id] = True
                    self.cond.notify_all()
        return job

    def merge_call(self, replica_id, merge_fn, args, kwargs):
        with self.cond:
            self.pending[replica_id] = (merge_fn, args, kwargs)
            self.cond.notify_all()
            ok = self.cond.wait_for(lambda: replica_id in self.merged or self.aborted, self.timeout)
            if self.aborted or not ok:
                raise StepAborted(f"replica {replica_id}: step aborted while waiting in merge_call")
            return self.merged.pop(replica_id)

    # -- coordinator side -----------------------------------------------------
    def _settled(self):
        return all(self.done[i] or i in self.pending for i in range(self.n))

    def wait(self):
        """Drives the step to completion; returns the per-replica results."""
        with self.cond:
            while True:
                if not self.cond.wait_for(self._settled, self.timeout):
                    self._abort()
                    raise TimeoutError(self._timeout_message())
                if any(e is not None for e in self.errors):
                    self._abort()
                    self._drain()
                    raise self._first_error()
                if all(self.done):
                    return list(self.results)
                if not all(i in self.pending for i in range(self.n)):
                    self._abort()
                    self._drain()
                    raise RuntimeError(self._partial_merge_message())
                calls, self.pending = self.pending, {}
                self.cond.release()
                try:
                    parts = self._run_merge(calls)
                except BaseException:
                    self.cond.acquire()
                    self._abort()
                    self._drain()
                    raise
                self.cond.acquire()
                self.merged.update(parts)
                self.cond.notify_all()

    def _run_merge(self, calls):
        merge_fn = calls[0][0]
        args = regroup([calls[i][1] for i in range(self.n)])
        kwargs = regroup([calls[i][2] for i in range(self.n)])
        with context.enter_mode(self.strategy, None), _tp.stop_recording():
            result = merge_fn(self.strategy, *args, **kwargs)
        return {i: select_replica(i, result) for i in range(self.n)}

    def _abort(self):
        self.aborted = True
        self.cond.notify_all()

    def _drain(self):
        deadline = time.monotonic() + self.timeout
        self.cond.wait_for(lambda: all(self.done), max(0.0, deadline - time.monotonic()))

    def _first_error(self):
        for i, e in enumerate(self.errors):
            if e is not None and not isinstance(e, StepAborted):
                e.add_note(f"(raised on replica {i}, device {self.strategy.extended.worker_devices[i]})")
                return e
        return RuntimeError("every replica's step was aborted")

    def _timeout_message(self):
        stuck = [i for i in range(self.n) if not self.done[i] and i not in self.pending]
        return (f"replicas {stuck} neither finished nor reached merge_call within {self.timeout:g} s; "
                "raise DTAPE_DISTRIBUTE_TIMEOUT or the strategy's timeout if the step is just slow")

    def _partial_merge_message(self):
        waiting = sorted(self.pending)
        finished = [i for i in range(self.n) if self.done[i]]
        return (f"replicas {waiting} called merge_call but replicas {finished} returned without it; "
                "every replica must make the same merge_call/all_reduce calls in the same order")


def run_on_replicas(strategy, threads, fn, args, kwargs, timeout):
    """Runs fn on every replica thread; returns the list of per-replica results."""
    coord = Coordinator(strategy, len(threads), timeout)
    stack = context.current_stack()
    creators = variables.current_creator_stack()
    caller = replica_scope.capture_caller_state()  # autocast, grad mode: thread-local in torch
    for i, thread in enumerate(threads):
        thread.submit(coord.replica_job(fn, i, select_replica(i, args), select_replica(i, kwargs),
                                        stack, creators, caller))
    return coord.wait()
