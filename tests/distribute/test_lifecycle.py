"""MirroredStrategy lifecycle and failure paths: close/GC, abandoned replicas, errors vs timeouts,
Ctrl-C, timeout validation, and tapes that are never exited."""
import gc
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
import weakref

import numpy as np
import pytest

import dtape
from dtape import _config, _notes
from dtape import distribute as ds
from dtape import tape as _tp
from dtape.distribute import mirrored_run

DEVICES = ["cpu:0", "cpu:1"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rid():
    return ds.get_replica_context().replica_id_in_sync_group


def _replica_threads():
    return [t for t in threading.enumerate() if t.name.startswith("dtape-replica")]


def _threads_of(strategy):
    """The Thread objects serving `strategy` now (found by a step that reports their idents)."""
    idents = set(strategy.run(threading.get_ident).values)
    return [t for t in threading.enumerate() if t.ident in idents]


def _wait_until(pred, timeout=30.0):
    """Polls `pred` until true or `timeout` s (a bound, not a timing assertion); returns its last value."""
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.005)
    return pred()




# -- close, context manager, garbage collection ---------------------------------

def test_close_stops_threads_is_idempotent_and_later_run_raises():
    strategy = ds.MirroredStrategy(DEVICES, timeout=5)
    threads = _threads_of(strategy)
    assert len(threads) == 2
    strategy.close()
    strategy.close()
    assert _wait_until(lambda: not any(t.is_alive() for t in threads))
    with pytest.raises(RuntimeError, match="closed; create a new strategy"):
        strategy.run(_rid)


def test_context_manager_closes_on_exit():
    with ds.MirroredStrategy(DEVICES, timeout=5) as strategy:
        threads = _threads_of(strategy)
    assert _wait_until(lambda: not any(t.is_alive() for t in threads))
    with pytest.raises(RuntimeError, match="closed"):
        strategy.run(_rid)


def test_fifty_dropped_strategies_leave_no_replica_threads():
    threads = []
    for _ in range(50):
        strategy = ds.MirroredStrategy(DEVICES, timeout=5)
        threads += _threads_of(strategy)
        del strategy
    assert len(threads) == 100
    gc.collect()
    assert _wait_until(lambda: not any(t.is_alive() for t in threads)), sum(t.is_alive() for t in threads)


def _training_strategy(sync=None, apply=True):
    """A strategy and a step that all-reduces gradients among the replica threads (optionally a GradientSync)."""
    strategy = ds.MirroredStrategy(DEVICES, timeout=5)
    with strategy.scope():
        w = dtape.Variable([[1.0, 2.0], [3.0, 4.0]])
    opt = dtape.optimizers.SGD(0.01)

    def step():
        with dtape.GradientTape(gradient_sync=sync) as tape:
            loss = dtape.reduce_sum(w * w)
        grads = tape.gradient(loss, [w])
        if apply:
            opt.apply_gradients(zip(grads, [w]))
    return strategy, step


def test_gc_objects_stay_flat_over_many_steps_with_gradient_all_reduces():
    strategy, step = _training_strategy()
    for _ in range(50):
        strategy.run(step)
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(600):
        strategy.run(step)
    gc.collect()
    grown = len(gc.get_objects()) - before
    strategy.close()
    assert grown < 300, f"{grown} more gc-tracked objects after 600 steps (each step's coordinator kept?)"


@pytest.mark.parametrize("sync, apply", [(None, True), ("sync", True), ("sync", False)])
def test_dropped_strategy_after_all_reduce_steps_is_collected_and_its_threads_stop(sync, apply):
    # ("sync", False): gradients a synced tape returned and nobody applied stay recorded until the step ends.
    strategy, step = _training_strategy(ds.GradientSync() if sync else None, apply)
    for _ in range(3):
        strategy.run(step)
    threads = _threads_of(strategy)
    ref = weakref.ref(strategy)
    del strategy, step
    # A replica thread may still be leaving its last job (its frames refer to the strategy) when run
    # returns: collect until the strategy is gone, within a bound, instead of once.
    assert _wait_until(lambda: gc.collect() is not None and ref() is None)
    assert _wait_until(lambda: not any(t.is_alive() for t in threads))


# -- abandoned replicas after a timeout ----------------------------------------

def test_timeout_detaches_stuck_replicas_tapes_and_fresh_thread_serves_next_step():
    strategy = ds.MirroredStrategy(DEVICES, timeout=0.5)
    release = threading.Event()
    entered = []

    def fn():
        if _rid() == 0:
            tape = dtape.GradientTape()
            tape.__enter__()  # never exited: the replica is stuck in the step
            entered.append(tape._tape)
            release.wait(10)
        return threading.get_ident()

    old = strategy.run(lambda: threading.get_ident()).values
    with pytest.raises(TimeoutError, match=r"replicas \[0\]"):
        strategy.run(fn)
    assert entered and entered[0] not in _tp._tape_set  # detached while the replica is still stuck
    new = strategy.run(lambda: threading.get_ident()).values
    assert new[0] != old[0] and new[1] == old[1]  # only the stuck replica's thread was replaced
    stuck = [t for t in _replica_threads() if t.ident == old[0]]
    release.set()
    assert all(t.join(5) or not t.is_alive() for t in stuck)  # it exits once its job returns
    strategy.close()


def test_thirty_timeouts_grow_neither_threads_nor_memory():
    strategy = ds.MirroredStrategy(DEVICES, timeout=0.03)
    before = set(_replica_threads())

    def step(release):
        def fn():
            if _rid() == 0:
                with dtape.GradientTape():
                    release.wait(10)
        return fn

    def one_timeout():
        release = threading.Event()
        strategy._timeout = 0.03
        try:
            with pytest.raises(TimeoutError):
                strategy.run(step(release))
        finally:  # the steps that must succeed get a timeout a loaded machine cannot reach
            strategy._timeout = 60
        release.set()

    one_timeout()  # warm up caches before measuring
    strategy.run(_rid)
    tracemalloc.start()
    try:
        start = tracemalloc.take_snapshot()
        for _ in range(30):
            one_timeout()
        assert strategy.run(_rid).values == (0, 1)
        assert _wait_until(lambda: len(set(_replica_threads()) - before) <= 2)
        gc.collect()
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(start, "filename"))
    finally:
        tracemalloc.stop()
    assert len(set(_replica_threads()) - before) == 2  # the strategy's two threads, nothing left over
    assert grown < 256 * 1024, f"{grown} bytes kept after 30 timeouts"
    assert not _tp._tape_set
    strategy.close()


# -- which error the user gets ------------------------------------------------

def test_replica_error_beats_timeout_of_busy_peer():
    strategy = ds.MirroredStrategy(DEVICES, timeout=0.5)
    busy, release = threading.Event(), threading.Event()

    def fn():
        if _rid() == 1:
            busy.wait(5)
            raise ValueError("bad batch")
        busy.set()
        release.wait(10)  # replica 0 is still busy when the timeout expires

    try:
        with pytest.raises(ValueError, match="bad batch") as info:
            strategy.run(fn)
    finally:
        release.set()
    assert isinstance(info.value.__context__, TimeoutError)
    assert any("replica 1, device cpu:1" in n for n in info.value.__notes__)
    assert strategy.run(_rid).values == (0, 1)


def test_replica_error_with_peer_in_merge_call_has_no_timeout_context():
    strategy = ds.MirroredStrategy(DEVICES, timeout=5)

    def fn():
        if _rid() == 1:
            raise ValueError("bad batch")
        ds.get_replica_context().merge_call(lambda s: None)

    with pytest.raises(ValueError, match="bad batch") as info:
        strategy.run(fn)
    assert info.value.__context__ is None


def test_merge_fn_slower_than_timeout_raises_timeout_naming_it():
    strategy = ds.MirroredStrategy(DEVICES, timeout=0.3)

    def slow_merge(s):
        time.sleep(0.6)

    with pytest.raises(TimeoutError, match="merge_fn .*slow_merge took longer than the timeout"):
        strategy.run(lambda: ds.get_replica_context().merge_call(slow_merge))
    assert strategy.run(_rid).values == (0, 1)


def test_merge_after_a_long_wait_for_a_slow_peer_is_not_aborted():
    # Replica 0 waits in merge_call most of the timeout for replica 1; the merge must still succeed.
    strategy = ds.MirroredStrategy(DEVICES, timeout=0.6)

    def fn():
        if _rid() == 1:
            time.sleep(0.35)
        return ds.get_replica_context().merge_call(lambda s: (time.sleep(0.3), 7)[1])

    assert strategy.run(fn) == 7


def _stall_replica_1_once_the_others_wait_in_an_all_reduce(release, reduce_timeout=None):
    """A step on 3 replicas: replicas 0 and 2 reach the gradient all-reduce, replica 1 stalls before it."""
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], timeout=1.5)
    with strategy.scope():
        w = dtape.Variable([1.0, 2.0])

    def step():
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(w * w)
        grad = tape.gradient(loss, w)
        if _rid() == 1:
            coordinator = ds.get_replica_context()._coordinator
            _wait_until(lambda: set(coordinator.in_collective) == {0, 2})
            release.wait(10)
        return ds.gradient_sync.reduce_gradients([(grad, w)], timeout=reduce_timeout)
    return strategy, step


@pytest.mark.parametrize("reduce_timeout", [None, 0.2])
def test_timeout_names_the_stalled_replica_not_those_waiting_for_it(fast_switching, reduce_timeout):
    # reduce_timeout=0.2: the waiting replicas' own timeout expires first; the step's verdict still names replica 1.
    release = threading.Event()
    strategy, step = _stall_replica_1_once_the_others_wait_in_an_all_reduce(release, reduce_timeout)
    try:
        with pytest.raises(TimeoutError) as info:
            strategy.run(step)
    finally:
        release.set()
    assert str(info.value).startswith("replicas [1] neither finished nor reached merge_call within 1.5 s "
                                      "(replicas [0, 2] are waiting in all-reduce #0)"), str(info.value)
    assert not getattr(info.value, "__notes__", None)  # no "raised on replica k": no replica raised it
    strategy._timeout = 5
    assert strategy.run(_rid).values == (0, 1, 2)
    strategy.close()


def test_failure_note_goes_to_the_replica_that_raised_first_not_to_one_failing_because_of_it(fast_switching):
    strategy = ds.MirroredStrategy(DEVICES, timeout=5)

    def fn():
        if _rid() == 1:
            raise ValueError("bad batch")
        try:
            ds.get_replica_context().merge_call(lambda s: None)
        except mirrored_run.StepAborted:
            raise RuntimeError("replica 0's cleanup after the abort failed") from None

    with pytest.raises(ValueError, match="bad batch") as info:
        strategy.run(fn)
    assert info.value.__notes__ == ["(raised on replica 1, device cpu:1)"]


def test_failure_note_without_add_note_python_310(monkeypatch):
    monkeypatch.setattr(_notes, "_HAS_ADD_NOTE", False)
    strategy = ds.MirroredStrategy(DEVICES, timeout=5)

    def fn():
        if _rid() == 1:
            raise ValueError("bad batch")
        ds.get_replica_context().merge_call(lambda s: None)

    with pytest.raises(ValueError) as info:
        strategy.run(fn)
    assert info.value.__notes__ == ["(raised on replica 1, device cpu:1)"]
    assert str(info.value) == "bad batch\n(raised on replica 1, device cpu:1)"


# -- Ctrl-C ---------------------------------------------------------------------

def test_caught_keyboard_interrupt_aborts_replicas_and_strategy_is_usable_at_once(fast_switching):
    strategy = ds.MirroredStrategy(DEVICES, timeout=5)
    outcome = {}

    def fn():
        if _rid() == 1:
            try:
                ds.get_replica_context().merge_call(lambda s: None)  # a blocked wait: must wake
            except mirrored_run.StepAborted:
                outcome[1] = "aborted"
                raise
            return
        coordinator = ds.get_replica_context()._coordinator
        assert _wait_until(lambda: 1 in coordinator.in_merge_call)
        deadline = time.monotonic() + 5
        try:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            while time.monotonic() < deadline:  # busy in Python: gets StepAborted asynchronously
                pass
            outcome[0] = "not interrupted"
        except mirrored_run.StepAborted:
            outcome[0] = "aborted"
            raise

    with pytest.raises(KeyboardInterrupt):
        strategy.run(fn)
    assert outcome == {0: "aborted", 1: "aborted"}
    assert strategy.run(_rid).values == (0, 1)  # a TimeoutError here if the threads were still busy
    strategy.close()


_SIGINT_SCRIPT = """
import sys, threading, time, torch
from dtape import distribute as ds

def spin():
    x = torch.randn(64, 64)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        x = torch.tanh(x @ x)

strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"], timeout=60)
try:  # an abandoned replica still spinning in torch: only the exit handler stops it
    ds.MirroredStrategy(["cpu:0", "cpu:1"], timeout=0.2).run(
        lambda: spin() if ds.get_replica_context().replica_id_in_sync_group == 0 else None)
except TimeoutError:
    pass

def fn():
    if ds.get_replica_context().replica_id_in_sync_group == 0:
        print("running", flush=True)
    spin()

strategy.run(fn)
"""


def test_sigint_during_run_exits_with_130_without_terminate():
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_SIGINT_SCRIPT)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "running"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode in (130, -signal.SIGINT), (proc.returncode, err[-2000:])
    assert "terminate called" not in err and "KeyboardInterrupt" in err


# -- timeout validation ---------------------------------------------------------

BAD_TIMEOUTS = [(math.nan, ValueError, "positive"), (-1.0, ValueError, "positive"), (0, ValueError, "positive"),
                (math.inf, ValueError, "finite"), (1e12, ValueError, "finite")]


@pytest.mark.parametrize("value, error, message", BAD_TIMEOUTS + [("5", TypeError, "number"),
                                                                  (True, TypeError, "number")])
def test_timeout_argument_rejected(value, error, message):
    with pytest.raises(error, match=message):
        ds.MirroredStrategy(DEVICES, timeout=value)


@pytest.mark.parametrize("value, error, message", BAD_TIMEOUTS + [("soon", ValueError, "not a number")])
def test_timeout_environment_rejected_the_same_way(monkeypatch, value, error, message):
    monkeypatch.setenv("DTAPE_DISTRIBUTE_TIMEOUT", str(value))
    with pytest.raises(error, match=f"DTAPE_DISTRIBUTE_TIMEOUT=.*{message}"):
        _config._read_timeout("DTAPE_DISTRIBUTE_TIMEOUT", 300.0)


def test_valid_timeouts_accepted(monkeypatch):
    assert ds.MirroredStrategy(DEVICES, timeout=2)._timeout == 2.0
    assert ds.MirroredStrategy(DEVICES)._timeout == _config.DISTRIBUTE_TIMEOUT_S
    monkeypatch.setenv("DTAPE_DISTRIBUTE_TIMEOUT", "0.5")
    assert _config._read_timeout("DTAPE_DISTRIBUTE_TIMEOUT", 300.0) == 0.5


def test_numpy_number_timeouts_accepted_and_numpy_bools_refused():
    # np.float32(2) was refused with a TypeError: numpy's numbers are real numbers (numbers.Real)
    assert ds.MirroredStrategy(DEVICES, timeout=np.float32(2))._timeout == 2.0
    assert ds.MirroredStrategy(DEVICES, timeout=np.int64(3))._timeout == 3.0
    assert ds.CommunicationOptions(timeout_seconds=np.float32(2)).timeout_seconds == 2.0
    assert type(ds.CommunicationOptions(timeout_seconds=np.float64(2.5)).timeout_seconds) is float
    with pytest.raises(ValueError, match="finite"):
        ds.CommunicationOptions(timeout_seconds=np.float64(np.inf))
    with pytest.raises(TypeError, match="number"):
        ds.MirroredStrategy(DEVICES, timeout=np.bool_(True))


# -- tapes never exited -----------------------------------------------------------

def test_gradient_tape_entered_and_never_exited_stops_recording_when_collected():
    x = dtape.constant(3.0)
    tape = dtape.GradientTape()
    tape.__enter__()
    tape.watch(x)
    inner = tape._tape
    dead = weakref.ref(tape)
    del tape
    gc.collect()
    assert dead() is None
    assert inner not in _tp._tape_set
    y = x * x
    assert inner.num_records() == 0 and not _tp.should_record([x])
    del y


def test_exited_tape_leaves_no_finalizer_and_reentry_works():
    x = dtape.constant(3.0)
    tape = dtape.GradientTape(persistent=True)
    with tape:
        tape.watch(x)
        y = x * x
    assert not tape._unpush.alive
    with tape:
        z = y * x
    assert float(tape.gradient(z, x)) == 27.0


def test_run_never_cancels_async_exceptions_with_null(monkeypatch):
    """CPython's PyThreadState_SetAsyncExc(id, NULL) leaves the interpreter's async-exception flag
    set for good (every later bytecode of every thread then takes the slow path: 40% slower loops,
    forced-interleaving tests hang). A step with no abort must not call it at all (an interrupted
    one delivers its abort instead of cancelling it: the Ctrl-C tests cover that path)."""
    calls = []
    real = mirrored_run._set_async_exc
    monkeypatch.setattr(mirrored_run, "_set_async_exc", lambda ident, exc: calls.append(exc) or real(ident, exc))
    with ds.MirroredStrategy(["cpu:0", "cpu:1"], timeout=5) as strategy:
        for _ in range(3):
            strategy.run(lambda: 1)
    assert calls == [], f"PyThreadState_SetAsyncExc called with {calls}"
