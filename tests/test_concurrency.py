"""Tape concurrency under forced interleaving (GIL builds included).

`interleaved()` (switch interval 1e-6 plus a profile hook that yields the
GIL after random C calls) lets another thread run between almost any two
steps, so a compound update of shared tape state that is not under its lock
loses data here. Each test names the lock it guards;
each was checked by replacing that lock with a no-op context manager.
"""
import threading

import pytest
import torch

import dtape
from dtape import tape as tp

from _interleave import interleaved, run_threads

D = torch.float64
TIMEOUT = 5


@pytest.fixture
def fast_switch():
    with interleaved(seed=0):
        yield


def _run(targets):
    run_threads(targets, TIMEOUT * 4)


def test_tapes_pushed_and_popped_on_many_threads_none_lost_none_leaked(fast_switch):
    """Guards `_set_lock`: push/pop replace the global tuple of tapes; unlocked, a pop that read
    the tuple before a concurrent push stores it back without that tape (lost: it records
    nothing), or with a tape popped meanwhile (leaked: it records forever)."""
    background = [tp.push_new_tape() for _ in range(300)]  # long tuple: slow scans in pop
    n_threads, n_iter = 4, 1000
    start = threading.Barrier(n_threads, timeout=TIMEOUT)
    lost = []

    def work():
        start.wait()
        for _ in range(n_iter):
            tape = tp.push_new_tape()
            if tape not in tp._tape_set:
                lost.append(tape)
            tp.pop_tape(tape)

    try:
        _run([work] * n_threads)
        leaked = [t for t in tp._tape_set if t not in background]
    finally:
        for t in background:
            tp.pop_tape(t)
    assert not lost, f"{len(lost)} pushed tapes were not in the active set"
    assert not leaked, f"{len(leaked)} popped tapes are still active"


def _snapshot(tape):
    """Records, watched ids and watched-variable ids, read atomically under the tape's lock."""
    with tape._lock:
        records, watched, variables = [r for r in tape._recs if r.op is not None], set(tape._watched), tuple(tape._watched_vars.values())
    return records, watched, {v._handle()._id for v in variables}


def _check_consistent(snapshot, explicit):
    """The state some serial order of the calls gives: each record has a watched input and
    watched outputs, and each watched id is explicitly watched, a listed variable's or the
    output of a kept record."""
    records, watched, var_ids = snapshot
    outs = {o for rec in records for o in rec.out_ids}
    assert outs <= watched, f"{len(outs - watched)} recorded outputs are not watched (record split by reset)"
    stray = watched - outs - var_ids - explicit
    assert not stray, f"{len(stray)} watched ids belong to no record nor listed variable (update split by reset)"
    for rec in records:
        assert any(i in watched for i in rec.in_ids), f"record {rec.op.name} has no watched input (landed after reset)"


def test_reset_concurrent_with_records_and_variable_watches_keeps_tape_consistent(fast_switch):
    """Guards `Tape._lock`: a record appends to the records and adds its outputs to the watched
    set, a variable watch fills the variable dict and the watched set, and reset() replaces all
    three; unlocked, a reset between two halves leaves them in different generations. Also
    guards record()'s re-check under the lock: a record that saw the pre-reset watched set
    must not land in the reset tape."""
    x = dtape.constant([1.0, 2.0], dtype=D)
    variables = [dtape.Variable(float(i), dtype=D) for i in range(8)]
    tape = tp.push_new_tape(persistent=True, watch_accessed_variables=False)
    stop = threading.Event()
    try:
        def record():
            while not stop.is_set():
                y = x * 2.0
                y + x

        def watch():
            while not stop.is_set():
                for v in variables:
                    tp.watch_variable(tape, v)

        def reset():
            try:
                for _ in range(1000):
                    _check_consistent(_snapshot(tape), {x._id})
                    tape.reset()
                    _check_consistent(_snapshot(tape), set())
                    tp.watch(tape, x)
            finally:
                stop.set()

        _run([record, record, watch, watch, reset])
    finally:
        stop.set()
        tp.pop_tape(tape)
    _check_consistent(_snapshot(tape), {x._id})
