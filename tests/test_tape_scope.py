"""Which tapes see a variable read (seed 1), and reads resolved once per tape.

A variable read on any thread (the tape's own, a plain thread, a pool
thread, a replica) is watched by every active tape, as the seed's
`TFE_Py_TapeSetWatchVariable` walks the whole set; the one exception is a
tape opened inside one replica of a `strategy.run`, which ignores the reads
of the sibling replicas of that run, so its records do not grow with the
number of replicas. Explicit watches follow data to any thread. A read of a
variable a tape already watches resolves nothing again.
"""
import concurrent.futures
import threading

import pytest
import torch

import dtape
from dtape import tape as _tp
from dtape.distribute import MirroredStrategy
from _strategies import mirrored

TIMEOUT = 5




_SCALE = 0.5


def _replica_step(n):
    """One small step per replica, every replica inside its tape at the same time; returns
    (records per replica tape, gradients per replica as torch tensors). `w`, `b` are mirrored;
    `s`, made outside the strategy's scope, is one plain variable every replica reads."""
    strategy = MirroredStrategy(devices=[f"cpu:{i}" for i in range(n)])
    with strategy.scope():
        w = dtape.Variable(torch.linspace(-1.0, 1.0, 12, dtype=torch.float64).reshape(4, 3))
        b = dtape.Variable(torch.tensor([0.1, -0.2, 0.3], dtype=torch.float64))
    s = dtape.Variable(torch.tensor(_SCALE, dtype=torch.float64))
    x = dtape.constant(torch.linspace(0.5, 2.0, 8, dtype=torch.float64).reshape(2, 4))
    barrier = threading.Barrier(n, timeout=TIMEOUT)

    def step():
        with dtape.GradientTape() as tape:
            barrier.wait()  # every replica reads and computes while the others' tapes are open
            h = dtape.nn.relu(dtape.matmul(x, w) + b) * s
            loss = dtape.reduce_mean(h * h)
            barrier.wait()
        records = dtape.constant(tape._tape.num_records())  # a distinct object per replica
        gw, gb, gs = tape.gradient(loss, [w, b, s])
        return records, gw.torch(), gb.torch(), gs.torch()

    out = strategy.run(step)
    parts = [strategy.experimental_local_results(o) for o in out]
    return [int(r) for r in parts[0]], list(zip(*parts[1:]))


def _reference_grads():
    w = torch.linspace(-1.0, 1.0, 12, dtype=torch.float64).reshape(4, 3).requires_grad_()
    b = torch.tensor([0.1, -0.2, 0.3], dtype=torch.float64, requires_grad=True)
    s = torch.tensor(_SCALE, dtype=torch.float64, requires_grad=True)
    x = torch.linspace(0.5, 2.0, 8, dtype=torch.float64).reshape(2, 4)
    h = torch.relu(x @ w + b) * s
    return torch.autograd.grad(torch.mean(h * h), [w, b, s])


@pytest.mark.parametrize("n", [1, 2, 4])
def test_records_per_replica_tape_do_not_grow_with_replicas(n, fast_switching):
    records, grads = _replica_step(n)
    # 3 reads, matmul, add, relu, 2 mul, reduce_mean: the replica's own ops only, for the mirrored
    # variables and for the plain one all replicas read (12, 38, 90-style growth without the narrowing)
    assert records == [9] * n
    ref = _reference_grads()
    for got in grads:
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, rtol=0, atol=1e-12)


def _replica_call_step(n, wrap):
    """As `_replica_step`, the forward inside `wrap` (dtape.function or recompute_grad): its one record
    takes the plain variable `s` (which every replica's tape watches) and the shared `x` as inputs."""
    strategy = mirrored(n)
    with strategy.scope():
        w = dtape.Variable(torch.linspace(-1.0, 1.0, 12, dtype=torch.float64).reshape(4, 3))
        b = dtape.Variable(torch.tensor([0.1, -0.2, 0.3], dtype=torch.float64))
    s = dtape.Variable(torch.tensor(_SCALE, dtype=torch.float64))
    x = dtape.constant(torch.linspace(0.5, 2.0, 8, dtype=torch.float64).reshape(2, 4))
    barrier = threading.Barrier(n, timeout=TIMEOUT)

    @wrap
    def forward(x):
        return dtape.nn.relu(dtape.matmul(x, w) + b) * s

    def step():
        with dtape.GradientTape() as tape:
            barrier.wait()  # every replica calls the function while the others' tapes are open
            h = forward(x)
            loss = dtape.reduce_mean(h * h)
            barrier.wait()
        records = dtape.constant(tape._tape.num_records())
        # the first replicas out walk their backward (splicing the body) while the others' tapes are open
        gw, gb, gs = tape.gradient(loss, [w, b, s])
        return records, gw.torch(), gb.torch(), gs.torch()

    out = strategy.run(step)
    parts = [strategy.experimental_local_results(o) for o in out]
    return [int(r) for r in parts[0]], list(zip(*parts[1:]))


@pytest.mark.parametrize("wrap", [dtape.function, dtape.recompute_grad], ids=["function", "recompute_grad"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_records_of_a_function_per_replica_tape_do_not_grow_with_replicas(n, wrap, closes_strategies):
    """A function's record (and its spliced body) reaches a sibling replica's tape through no variable."""
    for _ in range(3):  # the overlap of forwards and backwards varies from run to run
        records, grads = _replica_call_step(n, wrap)
        # the function's one record, multiply, reduce_mean (grew as 3, 6, 9, 12 with the replicas)
        assert records == [3] * n
        ref = _reference_grads()
        for got in grads:
            for g, r in zip(got, ref):
                torch.testing.assert_close(g, r, rtol=0, atol=1e-12)


def test_a_function_called_in_a_replica_records_no_sibling_op(closes_strategies):
    """The private tape of a function running in replica 0 watches its argument `x`, which replica 1 uses
    meanwhile: replica 1's ops are no part of the call (its backward would splice them onto the tapes open
    on replica 0's thread, duplicating replica 1's records on replica 1's own tape)."""
    strategy = mirrored(2)
    s = dtape.Variable(torch.tensor(_SCALE, dtype=torch.float64))
    x = dtape.constant(torch.linspace(0.5, 2.0, 4, dtype=torch.float64))
    barrier = threading.Barrier(2, timeout=TIMEOUT)

    @dtape.function
    def forward(x):
        barrier.wait()  # replica 1 now computes on x
        barrier.wait()
        return x * s

    def step():
        if dtape.distribute.get_replica_context().replica_id_in_sync_group == 1:
            barrier.wait()
            y = dtape.tanh(x) * 3.0
            barrier.wait()
            barrier.wait()  # y lives until replica 0 counted: trace deletion would drop records of it
            return dtape.constant(-1), dtape.reduce_sum(y)
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(forward(x))
        (call, *_), = [r for r in tape._tape.records() if r[0].name == "forward"]
        inner_records = call.tape.num_records()
        barrier.wait()
        return dtape.constant(inner_records), tape.gradient(loss, s)

    counts, grads = (strategy.experimental_local_results(o) for o in strategy.run(step))
    assert int(counts[0]) == 2  # the read of s and the multiply (4 with replica 1's tanh and multiply)
    assert float(grads[0]) == float(dtape.reduce_sum(x))


def _cube_on_a_plain_thread(v):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("y", v * v * v))
    t.start()
    t.join(TIMEOUT)
    assert not t.is_alive()
    return out["y"]


def _cube_on_a_pool_thread(v):
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: v * v * v).result(timeout=TIMEOUT)


@pytest.mark.parametrize("run_in_thread", [_cube_on_a_plain_thread, _cube_on_a_pool_thread], ids=["thread", "pool"])
def test_a_read_on_a_worker_thread_is_watched_by_a_tape_open_on_another_thread(run_in_thread, fast_switching):
    v = dtape.Variable(2.0)
    with dtape.GradientTape() as tape:
        y = run_in_thread(v)
    assert tape.watched_variables() == (v,)
    assert float(y) == 8.0 and float(tape.gradient(y, v)) == 12.0  # 3 v**2 (None before)
    w = dtape.Variable(torch.tensor([0.5, -1.5], dtype=torch.float64))
    with dtape.GradientTape() as tape:
        y = dtape.reduce_sum(run_in_thread(w))
    torch.testing.assert_close(tape.gradient(y, w).torch(), 3 * w.torch() ** 2, rtol=0, atol=1e-12)


def _own_ops(vs):
    y = vs[0] * vs[1]
    for _ in range(3):
        y = dtape.tanh(y) + vs[2]
    return dtape.reduce_sum(y)


def test_unrelated_threads_reading_the_same_variables_leave_no_records(fast_switching):
    """Their reads are watched and recorded, and trace deletion drops them with their dead results."""
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


def test_a_main_thread_tape_sees_the_replicas_of_a_run_called_on_another_thread(fast_switching):
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        v = dtape.Variable(torch.tensor([1.0, -2.0], dtype=torch.float64))
    result = {}

    def worker():
        with dtape.GradientTape() as tape:
            out = strategy.run(lambda: dtape.reduce_sum(v * v))
            loss = strategy.reduce("SUM", out)
        result["loss"] = loss
        result["grad"] = tape.gradient(loss, v).torch()

    with dtape.GradientTape() as main_tape:
        t = threading.Thread(target=worker)
        t.start()
        t.join(TIMEOUT)
    assert not t.is_alive()
    torch.testing.assert_close(result["grad"], 2 * 2 * v.torch(), rtol=0, atol=1e-12)
    assert main_tape.watched_variables() == (v,)
    torch.testing.assert_close(main_tape.gradient(result["loss"], v).torch(), 2 * 2 * v.torch(), rtol=0, atol=1e-12)


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
