"""Ctrl-C (KeyboardInterrupt) cannot leave a mirrored variable's components different: updates of every
component run in an `uninterrupted` section, and the interrupt is raised after the last write."""
import _thread
import random
import signal
import threading
import time

import numpy as np
import pytest
import torch

import dtape
from dtape import distribute as ds
from dtape.distribute.interrupts import uninterrupted

from _strategies import mirrored as _strategy

pytestmark = pytest.mark.usefixtures("closes_strategies")


def _spin(n=1000):
    """Python bytecodes: where a pending KeyboardInterrupt is raised, unless held back."""
    total = 0
    for i in range(n):
        total += i
    return total


# -- the section itself -----------------------------------------------------------

def test_interrupt_inside_a_section_is_raised_when_it_ends():
    ran = []
    with pytest.raises(KeyboardInterrupt):
        with uninterrupted():
            _thread.interrupt_main()
            _spin()
            ran.append("after the interrupt")
    assert ran == ["after the interrupt"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_nested_sections_raise_once_at_the_outermost_end():
    ran = []
    with pytest.raises(KeyboardInterrupt):
        with uninterrupted():
            with uninterrupted():
                _thread.interrupt_main()
                _spin()
            _spin()
            ran.append("outer section went on")
    assert ran == ["outer section went on"]
    _spin()  # nothing left pending
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_python_handler_gets_each_signal_in_order_at_the_end_and_is_restored():
    got = []
    old = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        handlers = {s: signal.getsignal(s) for s in old}
        with uninterrupted():
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGINT)
            _spin()
            assert got == []
        assert got == [signal.SIGTERM, signal.SIGINT]
        assert {s: signal.getsignal(s) for s in old} == handlers
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_a_handler_installed_inside_a_section_stays_installed():
    """The section restored the handler it replaced over one that code inside it installed (an optimizer
    step runs in a section, so a handler installed by a callback there was silently dropped)."""
    got = []

    def before(signum, frame):
        got.append(("before", signum))

    def mine(signum, frame):
        got.append(("mine", signum))

    old = {s: signal.signal(s, before) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with uninterrupted():
            signal.raise_signal(signal.SIGINT)  # held back, for the handler in force now
            _spin()
            assert signal.signal(signal.SIGINT, mine) is not before  # the section's own stand-in
            signal.raise_signal(signal.SIGINT)  # the new handler's: runs now
            _spin()
            assert got == [("mine", signal.SIGINT)]
        assert signal.getsignal(signal.SIGINT) is mine
        assert signal.getsignal(signal.SIGTERM) is before  # not touched inside: restored
        assert got == [("mine", signal.SIGINT), ("before", signal.SIGINT)]
        with uninterrupted():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_section_without_an_interrupt_changes_nothing_and_works_off_the_main_thread():
    with uninterrupted():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    errors = []

    def off_main():
        try:
            with uninterrupted():  # signal.signal would raise ValueError here
                _spin()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    t = threading.Thread(target=off_main)
    t.start()
    t.join(10)
    assert errors == []


# -- updates of every component -----------------------------------------------------

class _InterruptedSGD(dtape.optimizers.SGD):
    """SGD that gets Ctrl-C right after it updated replica 0's components (a chosen point)."""

    def _apply_group(self, index, components, grads, step):
        super()._apply_group(index, components, grads, step)
        if index == 0:
            _thread.interrupt_main()
            _spin()


def test_interrupt_between_replicas_updates_in_apply_gradients_leaves_components_equal():
    strategy = _strategy()
    with strategy.scope():
        w = dtape.Variable([1.0, 2.0])
    opt = _InterruptedSGD(0.1)

    def step():
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(w * w)
        opt.apply_gradients([(tape.gradient(loss, w), w)])
    with pytest.raises(KeyboardInterrupt):
        strategy.run(step)
    assert strategy.extended.check_mirrored() >= 2
    # the update went through on both: w - 0.1 * (2w + 2w)
    for c in w.values:
        np.testing.assert_allclose(c.numpy(), [0.6, 1.2], rtol=1e-6)
    assert [int(c.numpy()) for c in opt.iterations.values] == [1, 1]


def test_interrupt_inside_extended_update_and_a_cross_replica_assign_leaves_components_equal():
    strategy = _strategy()
    with strategy.scope():
        v = dtape.Variable([1.0, 2.0])

    def add_one(component):
        component.assign_add([1.0, 1.0])
        if dtape.distribute.context.update_index() == 0:
            _thread.interrupt_main()
            _spin()
    with pytest.raises(KeyboardInterrupt):
        strategy.extended.update(v, add_one)
    assert [c.numpy().tolist() for c in v.values] == [[2.0, 3.0], [2.0, 3.0]]

    first = v.values[0]
    original = first.assign

    def assign_then_interrupt(value, read_value=False):
        result = original(value, read_value)
        _thread.interrupt_main()
        _spin()
        return result
    first.assign = assign_then_interrupt  # the first component's write is followed by Ctrl-C
    try:
        with pytest.raises(KeyboardInterrupt):
            with strategy.scope():
                v.assign([5.0, 6.0])
    finally:
        del first.assign
    assert [c.numpy().tolist() for c in v.values] == [[5.0, 6.0], [5.0, 6.0]]
    strategy.extended.check_mirrored()


def test_random_interrupts_during_adam_steps_never_leave_components_different():
    strategy = _strategy()
    torch.manual_seed(0)
    with strategy.scope():
        variables = [dtape.Variable(torch.randn(8, 16) * 0.1), dtape.Variable(torch.zeros(16)),
                     dtape.Variable(torch.randn(16, 1) * 0.1)]
    opt = dtape.optimizers.Adam(1e-2)
    x = ds.PerReplica((dtape.constant(torch.randn(4, 8)), dtape.constant(torch.randn(4, 8))))

    def step(x):
        w1, b1, w2 = variables
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_mean(dtape.matmul(dtape.nn.relu(dtape.matmul(x, w1) + b1), w2) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

    strategy.run(step, (x,))
    start = time.perf_counter()
    strategy.run(step, (x,))
    duration = time.perf_counter() - start
    rng = random.Random(1)
    diverged = []
    for i in range(25):
        timer = threading.Timer(rng.uniform(0, duration), _thread.interrupt_main)
        try:
            timer.start()  # a short delay interrupts its wait for the timer thread
            strategy.run(step, (x,))
        except KeyboardInterrupt:
            pass
        while True:  # the timer may fire after the step: let its interrupt land here
            try:
                timer.join(10)
                _spin()
                break
            except KeyboardInterrupt:
                continue
        try:
            strategy.extended.check_mirrored()
        except ValueError as e:
            diverged.append((i, str(e)))
            break
    assert diverged == []


def test_ctrl_c_sends_no_asynchronous_abort_into_a_replica_waiting_in_an_all_reduce(monkeypatch):
    # An asynchronous StepAborted landing inside the step's Condition code can leave its lock held:
    # every later step then hangs. Replicas inside merge_call or an all-reduce are woken, never shot.
    from dtape.distribute import mirrored_run
    sent = []
    raise_async = mirrored_run._raise_async

    def recording(ident, exc_type):
        sent.append(ident)
        return raise_async(ident, exc_type)
    monkeypatch.setattr(mirrored_run, "_raise_async", recording)
    strategy = _strategy()
    with strategy.scope():
        w = dtape.Variable([1.0, 2.0])
    idents, outcome = {}, {}

    def step():
        r = ds.get_replica_context().replica_id_in_sync_group
        idents[r] = threading.get_ident()
        if r == 1:
            coordinator = ds.get_replica_context()._coordinator
            deadline = time.monotonic() + 10
            while 0 not in coordinator.in_collective and time.monotonic() < deadline:
                _spin(100)
            _thread.interrupt_main()
            while time.monotonic() < deadline:  # busy in Python: gets StepAborted asynchronously
                _spin(100)
            return
        try:
            ds.gradient_sync.reduce_gradients([(dtape.constant([1.0, 1.0]), w)])
        except mirrored_run.StepAborted:
            outcome[0] = "aborted"
            raise
    with pytest.raises(KeyboardInterrupt):
        strategy.run(step)
    assert sent == [idents[1]] and outcome == {0: "aborted"}
    assert strategy.run(lambda: 3) == 3
