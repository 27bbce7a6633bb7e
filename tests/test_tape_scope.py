"""Which tapes see a variable read (issue 7 points 3 and 7).

A tape watches the variables read on its own thread and on the replica
threads of a `strategy.run` called from that thread; reads on other threads
add nothing to it, while explicit watches follow data to any thread (seed 1).
A read of a variable a tape already watches resolves nothing again.
"""
import threading

import pytest
import torch

import dtape
from dtape import tape as _tp
from dtape.distribute import MirroredStrategy

TIMEOUT = 5




def _replica_step(n):
    """One small step per replica, every replica inside its tape at the same time; returns
    (records per replica tape, gradients per replica as torch tensors, the variables' values)."""
    strategy = MirroredStrategy(devices=[f"cpu:{i}" for i in range(n)])
    with strategy.scope():
        w = dtape.Variable(torch.linspace(-1.0, 1.0, 12, dtype=torch.float64).reshape(4, 3))
        b = dtape.Variable(torch.tensor([0.1, -0.2, 0.3], dtype=torch.float64))
    x = dtape.constant(torch.linspace(0.5, 2.0, 8, dtype=torch.float64).reshape(2, 4))
    barrier = threading.Barrier(n, timeout=TIMEOUT)

    def step():
        with dtape.GradientTape() as tape:
            barrier.wait()  # every replica reads and computes while the others' tapes are open
            h = dtape.nn.relu(dtape.matmul(x, w) + b)
            loss = dtape.reduce_mean(h * h)
            barrier.wait()
        records = dtape.constant(tape._tape.num_records())  # a distinct object per replica
        gw, gb = tape.gradient(loss, [w, b])
        return records, gw.torch(), gb.torch()

    out = strategy.run(step)
    parts = strategy.experimental_local_results(out[0]), strategy.experimental_local_results(out[1]), \
        strategy.experimental_local_results(out[2])
    return [int(r) for r in parts[0]], list(zip(parts[1], parts[2]))


def _reference_grads():
    w = torch.linspace(-1.0, 1.0, 12, dtype=torch.float64).reshape(4, 3).requires_grad_()
    b = torch.tensor([0.1, -0.2, 0.3], dtype=torch.float64, requires_grad=True)
    x = torch.linspace(0.5, 2.0, 8, dtype=torch.float64).reshape(2, 4)
    h = torch.relu(x @ w + b)
    return torch.autograd.grad(torch.mean(h * h), [w, b])


@pytest.mark.parametrize("n", [1, 2, 4])
def test_records_per_replica_tape_do_not_grow_with_replicas(n, fast_switching):
    records, grads = _replica_step(n)
    # 2 reads, matmul, add, relu, mul, reduce_mean: the replica's own ops only (12, 38, 90-style growth before)
    assert records == [7] * n
    ref_w, ref_b = _reference_grads()
    for gw, gb in grads:
        torch.testing.assert_close(gw, ref_w, rtol=0, atol=1e-12)
        torch.testing.assert_close(gb, ref_b, rtol=0, atol=1e-12)


def _own_ops(vs):
    y = vs[0] * vs[1]
    for _ in range(3):
        y = dtape.tanh(y) + vs[2]
    return dtape.reduce_sum(y)


def test_unrelated_threads_reading_the_same_variables_add_no_records(fast_switching):
    vs = [dtape.Variable(torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64) * (i + 1)) for i in range(3)]
    with dtape.GradientTape() as solo:
        solo_loss = _own_ops(vs)  # alive: the tape keeps the records of live tensors only (trace deletion)
    expected = solo._tape.num_records()
    del solo_loss

    start, stop = threading.Event(), threading.Event()
    reads = [0]

    def other():
        start.wait(TIMEOUT)
        while not stop.is_set():
            for v in vs:
                dtape.tanh(v * 2.0 + 1.0)
                reads[0] += 1

    threads = [threading.Thread(target=other, daemon=True) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        with dtape.GradientTape() as tape:
            start.set()
            loss = _own_ops(vs)
            while reads[0] < 200:  # the others read the tape's variables while it is open
                threading.Event().wait(0.001)
    finally:
        stop.set()
        for t in threads:
            t.join(TIMEOUT)
    assert reads[0] >= 200
    assert tape._tape.num_records() == expected
    grads = tape.gradient(loss, vs)
    tv = [v.torch().clone().requires_grad_() for v in vs]
    y = tv[0] * tv[1]
    for _ in range(3):
        y = torch.tanh(y) + tv[2]
    for g, r in zip(grads, torch.autograd.grad(y.sum(), tv)):
        torch.testing.assert_close(g.torch(), r, rtol=0, atol=1e-12)


def test_main_thread_tape_records_replica_reads_and_the_reduce(fast_switching):
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        v = dtape.Variable(torch.tensor([1.0, 2.0], dtype=torch.float64))
    xs = [torch.tensor([3.0, 5.0], dtype=torch.float64), torch.tensor([-1.0, 4.0], dtype=torch.float64)]
    per_replica = dtape.distribute.PerReplica([dtape.constant(x) for x in xs])
    with dtape.GradientTape() as tape:
        out = strategy.run(lambda x: dtape.reduce_sum(v * v * x), args=(per_replica,))
        loss = strategy.reduce("SUM", out)
    g = tape.gradient(loss, v)
    torch.testing.assert_close(g.torch(), 2 * v.torch() * (xs[0] + xs[1]), rtol=0, atol=1e-12)


def test_tape_of_a_thread_that_calls_run_sees_its_replicas_but_a_main_thread_tape_does_not(fast_switching):
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        v = dtape.Variable(torch.tensor([1.0, -2.0], dtype=torch.float64))
    result = {}

    def worker():
        with dtape.GradientTape() as tape:
            out = strategy.run(lambda: dtape.reduce_sum(v * v))
            loss = strategy.reduce("SUM", out)
        result["grad"] = tape.gradient(loss, v).torch()

    with dtape.GradientTape() as main_tape:
        t = threading.Thread(target=worker)
        t.start()
        t.join(TIMEOUT)
    assert not t.is_alive()
    torch.testing.assert_close(result["grad"], 2 * 2 * v.torch(), rtol=0, atol=1e-12)
    assert main_tape._tape.num_records() == 0
    assert main_tape.watched_variables() == ()


def test_explicit_watch_follows_data_to_any_thread(fast_switching):
    x = dtape.constant(torch.tensor([1.5, -0.5], dtype=torch.float64))
    v = dtape.Variable(torch.tensor([2.0, 3.0], dtype=torch.float64))
    out = {}

    def other():
        out["y"] = dtape.reduce_sum(x * x * v)

    with dtape.GradientTape() as tape:
        tape.watch([x, v])
        t = threading.Thread(target=other)
        t.start()
        t.join(TIMEOUT)
    gx, gv = tape.gradient(out["y"], [x, v])
    torch.testing.assert_close(gx.torch(), 2 * x.torch() * v.torch(), rtol=0, atol=1e-12)
    torch.testing.assert_close(gv.torch(), x.torch() ** 2, rtol=0, atol=1e-12)


def test_a_variable_read_again_is_not_resolved_again(monkeypatch):
    calls = []
    resolve = _tp._resolve_watched
    monkeypatch.setattr(_tp, "_resolve_watched", lambda var: calls.append(var) or resolve(var))
    v = dtape.Variable(torch.tensor([1.0, 2.0], dtype=torch.float64))
    with dtape.GradientTape() as tape:
        y = v * 1.0
        for _ in range(5):
            y = y + v * v
    assert len(calls) == 1  # the first read only
    torch.testing.assert_close(tape.gradient(y, v).torch(), 1.0 + 10 * v.torch(), rtol=0, atol=1e-12)
    # reset() forgets it: the next read resolves again
    with dtape.GradientTape(persistent=True) as tape:
        v * 1.0
        tape.reset()
        z = v * 3.0
    assert len(calls) == 3  # one read before and one after reset (a plain Variable source is not resolved)
    torch.testing.assert_close(tape.gradient(z, v).torch(), torch.full((2,), 3.0, dtype=torch.float64))


def test_mirrored_read_in_replica_resolved_once_per_replica_tape(monkeypatch, fast_switching):
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        v = dtape.Variable(torch.tensor([1.0, 2.0], dtype=torch.float64))
    calls = []
    resolve = _tp._resolve_watched
    monkeypatch.setattr(_tp, "_resolve_watched", lambda var: calls.append(var) or resolve(var))

    def step():
        with dtape.GradientTape() as tape:
            y = v * 1.0
            for _ in range(4):
                y = y + v * v
        return tape.gradient(y, v).torch()

    grads = strategy.experimental_local_results(strategy.run(step))
    assert len([c for c in calls if c is not v]) == 2  # one resolution per replica tape (reads of components)
    for g in grads:
        torch.testing.assert_close(g, 1.0 + 8 * v.torch(), rtol=0, atol=1e-12)
