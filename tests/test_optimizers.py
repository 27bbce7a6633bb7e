"""Optimizers: writes through the variable's lock, slots keyed by never-reused ids, partial gradients."""
import gc
import threading
import time
import warnings
import weakref

import numpy as np
import pytest
import torch

import dtape
from dtape import distribute as ds




def _run_threads(targets, timeout=30):
    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a writer thread did not finish"


def test_optimizer_update_and_assign_add_from_threads_lose_nothing(fast_switching):
    # SGD(lr=1) with gradient -1 adds exactly 1 per step, through the same write
    # path (and lock) as assign_add: every one of the 4 * n increments must land.
    v = dtape.Variable(0.0)
    opt = dtape.optimizers.SGD(1.0)
    grad = dtape.constant(-1.0)
    n = 3000

    def optimize():
        for _ in range(n):
            opt._apply_one(v, grad, 1)

    def add():
        for _ in range(n):
            v.assign_add(1.0)
    _run_threads([optimize, add, optimize, add])
    assert float(v) == 4 * n


def test_optimizer_writes_through_update_value(monkeypatch):
    """Every write goes through the variables' locks: all at once in `update_together` (or `_update_value`)."""
    calls = []
    original, together = dtape.Variable._update_value, dtape.optimizers.update_together

    def spy(self, fn, what="update", inplace=None):
        calls.append(what)
        return original(self, fn, what, inplace)

    def spy_together(variables, inplace):
        done = together(variables, inplace)
        calls.extend(["together"] * (0 if done is None else len(variables)))
        return done
    monkeypatch.setattr(dtape.Variable, "_update_value", spy)
    monkeypatch.setattr(dtape.optimizers, "update_together", spy_together)
    for held in (False, True):  # sole holder: in place; a live read: the variable's tensor is copied first
        calls.clear()
        v = dtape.Variable(torch.ones(2))
        before = v.torch().data_ptr()
        read = v.read_value() if held else None
        dtape.optimizers.Adam(0.1).apply_gradients([(dtape.constant([1.0, 1.0]), v)])
        assert calls.count("together") == 3 and calls.count("optimizer update") == 0, calls  # m, v, the variable
        assert (v.torch().data_ptr() == before) == (not held)
        if held:
            assert read.numpy().tolist() == [1.0, 1.0]


def test_new_variable_never_inherits_a_dead_variables_momentum():
    opt = dtape.optimizers.SGD(0.1, momentum=0.9)
    g = dtape.constant(1.0)
    for _ in range(200):  # until CPython gives the new variable the dead one's address (usually at once)
        old = dtape.Variable(0.0)
        opt.apply_gradients([(g, old)])   # velocity -0.1 stored for `old`
        old_id = id(old)
        del old
        gc.collect()
        for _ in range(100):
            new = dtape.Variable(0.0)
            if id(new) == old_id:
                break
            del new
        else:
            continue
        opt.apply_gradients([(g, new)])
        # A fresh velocity gives -0.1; an inherited one would give 0.9 * -0.1 - 0.1 = -0.19.
        assert float(new) == pytest.approx(-0.1)
        return
    pytest.fail("CPython never reused a dead variable's address; the test could not check inheritance")


def test_dropped_variable_frees_its_slots():
    opt = dtape.optimizers.Adam(0.1)
    keep = dtape.Variable(torch.ones(3))
    drop = dtape.Variable(torch.ones(3))
    opt.apply_gradients([(dtape.constant([1.0, 1.0, 1.0]), keep), (dtape.constant([1.0, 1.0, 1.0]), drop)])
    assert len(opt.variables()) == 6  # iterations, learning_rate + 2 slots each
    slot_refs = [weakref.ref(s) for s in opt.variables()[4:]]
    del drop
    gc.collect()
    assert all(r() is None for r in slot_refs)
    assert len(opt.variables()) == 4
    opt.apply_gradients([(dtape.constant([1.0, 1.0, 1.0]), keep)])  # the survivor keeps training
    assert len(opt.variables()) == 4


def test_dropped_optimizer_does_not_keep_slots_alive():
    v = dtape.Variable(torch.ones(2))
    opt = dtape.optimizers.SGD(0.1, momentum=0.5)
    opt.apply_gradients([(dtape.constant([1.0, 1.0]), v)])
    slot = weakref.ref(opt.variables()[2])    # after iterations and learning_rate
    del opt
    gc.collect()
    assert slot() is None


# -- apply_gradients in a replica context with gradients missing on some replicas ---
@pytest.fixture
def strategy():
    return ds.MirroredStrategy(["cpu:0", "cpu:1"], timeout=10)


def _rid():
    return ds.get_replica_context().replica_id_in_sync_group


@pytest.mark.parametrize("used_on", [0, 1])
def test_apply_gradients_missing_on_some_replicas_counts_as_zero(strategy, used_on):
    with strategy.scope():
        a = dtape.Variable(1.0)
        b = dtape.Variable(2.0)
        unused = dtape.Variable(5.0)
        opt = dtape.optimizers.SGD(0.1)

    def step():
        with dtape.GradientTape() as tape:
            y = a * 2.0
            if _rid() == used_on:
                y = y + b * 3.0
        grads = tape.gradient(y, [a, b, unused])
        opt.apply_gradients(zip(grads, [a, b, unused]))

    with pytest.warns(UserWarning, match=r"\[.*'Variable.*\]") as record:
        strategy.run(step)
    assert len(record) == 1 and "Gradients do not exist" in str(record[0].message)  # only `unused`
    for var, expected in ((a, 1.0 - 0.1 * 4.0), (b, 2.0 - 0.1 * 3.0), (unused, 5.0)):
        c0, c1 = var.values
        assert torch.equal(c0.torch(), c1.torch())
        assert float(c0) == pytest.approx(expected)


def test_apply_gradients_missing_slot_momentum_stays_identical(strategy):
    with strategy.scope():
        w = dtape.Variable(torch.ones(2))
        opt = dtape.optimizers.SGD(0.5, momentum=0.9)

    def step():
        g = dtape.constant([1.0, 2.0]) if _rid() == 1 else None
        opt.apply_gradients([(g, w)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the variable has a gradient on replica 1: no warning
        strategy.run(step)
        strategy.run(step)
    m0, m1 = opt.variables()[2].values    # the momentum slot, after iterations and learning_rate
    assert torch.equal(m0.torch(), m1.torch())
    # velocity: -0.5 g, then 0.9 * -0.5 g - 0.5 g; w = 1 - 0.5 g - 0.95 g
    np.testing.assert_allclose(w.values[0].numpy(), [1 - 1.45, 1 - 2.9], rtol=1e-6)


# -- batched updates (torch._foreach_*) equal the one-variable formulas bit for bit ---------
def _reference_update(name, kw, w, g, slots, step, lr):
    """The per-variable update formulas as plain torch ops (the math before updates were batched).

    A slot keeps the variable's dtype: its new value is cast on writing, and the cast value is used.
    """
    def put(n, value):
        slots[n] = value.to(w.dtype)
        return slots[n]
    if name == "SGD":
        mu = kw.get("momentum", 0.0)
        if not mu:
            return torch.add(w, g, alpha=-lr)
        vel = put("momentum", torch.add(mu * slots["momentum"], g, alpha=-lr))
        return w + (torch.add(mu * vel, g, alpha=-lr) if kw.get("nesterov") else vel)
    if name in ("Adam", "AdamW"):
        b1, b2, eps = 0.9, 0.999, 1e-7
        lr_t = lr * np.sqrt(1 - b2 ** step) / (1 - b1 ** step)
        m = put("m", slots["m"] * b1 + (1 - b1) * g)
        v = put("v", slots["v"] * b2 + (1 - b2) * g * g)
        decay = lr * kw["weight_decay"] * w if name == "AdamW" else 0.0
        return w - decay - lr_t * m / (torch.sqrt(v) + eps)
    if name == "RMSprop":
        rho, eps, mu = 0.9, 1e-7, kw["momentum"]
        v = put("velocity", rho * slots["velocity"] + (1 - rho) * g * g)
        a = put("average_gradient", rho * slots["average_gradient"] + (1 - rho) * g)
        inc = lr * g / torch.sqrt(v - a * a + eps)
        inc = put("momentum", mu * slots["momentum"] + inc)
        return w - inc
    acc = put("accumulator", slots["accumulator"] + g * g)   # Adagrad
    return w - lr * g / torch.sqrt(acc + 1e-7)


_CASES = [("SGD", {}), ("SGD", {"momentum": 0.9}), ("SGD", {"momentum": 0.9, "nesterov": True}),
          ("Adam", {}), ("AdamW", {"weight_decay": 0.1}), ("RMSprop", {"momentum": 0.5, "centered": True}),
          ("Adagrad", {})]


@pytest.mark.parametrize("name,kw", _CASES)
def test_batched_update_equals_per_variable_formula_bit_for_bit(name, kw):
    # Shapes of every kind (scalar, vector, matrix), float32 and float64 variables in one batch:
    # one batch of foreach ops must give exactly the per-variable results, slots included, over
    # several steps. (A gradient of another dtype than its variable's is refused.)
    gen = torch.Generator().manual_seed(0)
    specs = [((), torch.float32, torch.float32), ((5,), torch.float32, torch.float32),
             ((3, 4), torch.float32, torch.float32), ((2, 3), torch.float64, torch.float64)]
    init = [torch.randn(s, generator=gen, dtype=d) for s, d, _ in specs]
    variables = [dtape.Variable(t.clone()) for t in init]
    opt = getattr(dtape.optimizers, name)(0.05, **kw)
    initial = {"accumulator": 0.1} if name == "Adagrad" else {}
    ref = [{n: torch.zeros_like(t) + initial.get(n, 0.0)
            for n in ("m", "v", "momentum", "velocity", "average_gradient", "accumulator")} for t in init]
    ws = [t.clone() for t in init]
    for step in range(1, 4):
        grads = [torch.randn(s, generator=gen, dtype=gd) for s, _, gd in specs]
        opt.apply_gradients(zip([dtape.constant(g) for g in grads], variables))
        ws = [_reference_update(name, kw, w, g, r, step, 0.05).to(w.dtype) for w, g, r in zip(ws, grads, ref)]
    for v, w in zip(variables, ws):
        assert v.dtype == w.dtype and torch.equal(v.torch(), w), f"{name} {kw}: {v.torch()} != {w}"
    for k, v in enumerate(variables):
        for n, slot in opt._slots_for(v).items():
            assert torch.equal(slot.torch(), ref[k][n]), f"{name} slot {n} of variable {k}"


def test_batched_write_recomputes_a_variable_written_since_the_snapshot():
    # _write_all computes every new value from a snapshot; a variable that someone else wrote
    # in between must get fn(its current value), not the stale result (no lost update).
    from dtape.optimizers import _write_all
    a, b = dtape.Variable(1.0), dtape.Variable(10.0)
    calls = []

    def fn(w, g):
        calls.append(len(w.ts))
        if len(calls) == 1:
            b.assign_add(5.0)   # a concurrent write between the snapshot and the commit
        return w + g
    out = _write_all([a, b], fn, [torch.tensor(1.0), torch.tensor(2.0)])
    assert calls == [2, 1]            # the batch, then b alone again
    assert float(a) == 2.0 and float(b) == 17.0   # 10 + 5 + 2: the write is not lost
    assert [float(t) for t in out] == [2.0, 17.0]


def test_apply_gradients_batched_under_mirrored_strategy_equals_default(strategy):
    # The update runs once per replica index on every component; both replicas' components
    # stay bit-identical and equal the update on one device.
    gen = torch.Generator().manual_seed(3)
    init = [torch.randn(4, 3, generator=gen), torch.randn(3, generator=gen)]
    grads = [torch.randn(4, 3, generator=gen), torch.randn(3, generator=gen)]
    plain = [dtape.Variable(t.clone()) for t in init]
    dtape.optimizers.Adam(0.1).apply_gradients(zip([dtape.constant(g) for g in grads], plain))
    with strategy.scope():
        mirrored = [dtape.Variable(t.clone()) for t in init]
        opt = dtape.optimizers.Adam(0.1)
    # each replica gives half of the gradient (exact in binary): the summed gradient is `grads` bit for bit
    strategy.run(lambda: opt.apply_gradients(zip([dtape.constant(g / 2) for g in grads], mirrored)))
    for p, m in zip(plain, mirrored):
        for c in m.values:
            assert torch.equal(c.torch(), p.torch())


@pytest.mark.parametrize("make", [lambda: dtape.optimizers.SGD(0.1), lambda: dtape.optimizers.SGD(0.1, momentum=0.9),
                                  lambda: dtape.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
                                  lambda: dtape.optimizers.Adam(0.01), lambda: dtape.optimizers.AdamW(0.01)],
                         ids=["sgd", "momentum", "nesterov", "adam", "adamw"])
def test_updates_in_place_when_only_the_variable_holds_its_tensor(make):
    """In place (no new weights per step) with nothing else holding the tensor; copy-on-write while a read lives;
    both paths give the same bits."""
    g = torch.Generator().manual_seed(0)
    init, grads = torch.randn(5, 3, generator=g), [torch.randn(5, 3, generator=g) for _ in range(4)]
    free, held = dtape.Variable(init.clone()), dtape.Variable(init.clone())
    opt_free, opt_held = make(), make()
    ptr = free.torch().data_ptr()
    for k, gr in enumerate(grads):
        opt_free.apply_gradients([(dtape.constant(gr), free)])
        before = held.read_value()  # a live read: the update must not change it
        snapshot = before.numpy().copy()
        opt_held.apply_gradients([(dtape.constant(gr), held)])
        np.testing.assert_array_equal(before.numpy(), snapshot)
        assert torch.equal(free.torch(), held.torch()), f"step {k}: in-place and copy-on-write updates differ"
    in_place = free.torch().data_ptr() == ptr
    assert in_place


def test_update_never_changes_a_numpy_view_a_torch_reference_or_a_dlpack_export():
    v = dtape.Variable(torch.zeros(4))
    opt = dtape.optimizers.SGD(1.0)
    arr, t, exported = np.asarray(v), v.torch(), np.from_dlpack(v)
    opt.apply_gradients([(dtape.constant(torch.ones(4)), v)])
    assert arr.tolist() == [0.0] * 4 and t.tolist() == [0.0] * 4 and exported.tolist() == [0.0] * 4
    assert v.numpy().tolist() == [-1.0] * 4
    del arr, t, exported
    ptr = v.torch().data_ptr()
    opt.apply_gradients([(dtape.constant(torch.ones(4)), v)])
    assert v.torch().data_ptr() == ptr and v.numpy().tolist() == [-2.0] * 4


def test_a_read_on_another_thread_never_sees_an_in_place_update_midway(fast_switching):
    """torch releases the GIL inside the update kernel: a read taken then waits for the finished value."""
    v = dtape.Variable(torch.zeros(4_000_000))
    g = dtape.constant(torch.ones(4_000_000))
    opt = dtape.optimizers.SGD(1.0)
    stop, changed = threading.Event(), []

    def reader():
        while not stop.is_set():
            r = v.read_value()
            first = r.torch().clone()
            time.sleep(0.001)  # an update may run now: r must not change
            if not torch.equal(first, r.torch()) or first.min() != first.max():
                changed.append((first.min().item(), first.max().item()))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for _ in range(100):
            opt.apply_gradients([(g, v)])
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
    assert not changed, f"{len(changed)} reads changed or were half-updated, e.g. {changed[:2]}"
    assert float(v.numpy()[0]) == -100.0


def test_a_tensor_in_shared_memory_is_never_updated_in_place():
    """A value sent to another process (torch.multiprocessing moves its storage to shared memory) keeps it."""
    v = dtape.Variable(torch.zeros(10))
    sent = v.torch().share_memory_()  # what a torch.multiprocessing queue does to the tensor it sends
    ptr = sent.data_ptr()
    del sent
    dtape.optimizers.SGD(1.0).apply_gradients([(dtape.constant(torch.ones(10)), v)])
    assert v.torch().data_ptr() != ptr and v.numpy().tolist() == [-1.0] * 10


# -- Adam through torch's fused kernel ----------------------------------------------------------
@pytest.mark.parametrize("name,kw", [("Adam", {}), ("AdamW", {"weight_decay": 0.1})])
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_fused_adam_equals_keras_formula(monkeypatch, dtype, rtol, name, kw):
    """One fused kernel call per step for every variable and slot; the values are Keras's formula
    (epsilon added to sqrt(v); AdamW: w - lr * weight_decay * w first) up to rounding, slots included."""
    calls = []
    decoupled = name == "AdamW"
    kernel = dtape.optimizers._FUSED_KERNELS[decoupled]
    if kernel is None:
        pytest.skip(f"this torch has no fused {name} kernel for the CPU")
    monkeypatch.setitem(dtape.optimizers._FUSED_KERNELS, decoupled,
                        lambda *a, **k: (calls.append(len(a[0])), kernel(*a, **k)))
    gen = torch.Generator().manual_seed(1)
    shapes = [(), (7,), (4, 3)]
    init = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    variables = [dtape.Variable(t.clone().to(dtype)) for t in init]
    opt = getattr(dtape.optimizers, name)(0.05, **kw)
    ref = [{"m": torch.zeros_like(t), "v": torch.zeros_like(t)} for t in init]
    ws = [t.clone() for t in init]
    for step in range(1, 6):
        grads = [torch.randn(s, generator=gen, dtype=torch.float64) * 10 ** -step for s in shapes]
        opt.apply_gradients(zip([dtape.constant(g.to(dtype)) for g in grads], variables))
        ws = [_reference_update(name, kw, w, g, r, step, 0.05) for w, g, r in zip(ws, grads, ref)]
    assert calls == [3] * 5
    for k, (v, w) in enumerate(zip(variables, ws)):
        torch.testing.assert_close(v.torch().double(), w, rtol=rtol, atol=0)
        for n, slot in opt._slots_for(v).items():
            torch.testing.assert_close(slot.torch().double(), ref[k][n], rtol=rtol, atol=0)


def test_fused_adam_batched_equals_one_variable_at_a_time_bit_for_bit():
    gen = torch.Generator().manual_seed(2)
    init = [torch.randn(s, generator=gen) for s in [(3,), (2, 5)]]
    together, alone = [dtape.Variable(t.clone()) for t in init], [dtape.Variable(t.clone()) for t in init]
    opt_together, opt_alone = dtape.optimizers.Adam(0.01), dtape.optimizers.Adam(0.01)
    for _ in range(3):
        grads = [dtape.constant(torch.randn(t.shape, generator=gen)) for t in init]
        opt_together.apply_gradients(zip(grads, together))
        opt_alone.apply_gradients([(grads[0], alone[0])])
        opt_alone.iterations.assign_sub(1)  # the same step for the second variable
        opt_alone.apply_gradients([(grads[1], alone[1])])
    for a, b in zip(together, alone):
        assert torch.equal(a.torch(), b.torch())


def test_fused_adam_pairs_elements_of_any_layout():
    """The fused kernel walks raw memory: a gradient whose layout differs from its variable's (reduce_sum's
    expanded ones, dtape.transpose's transposed gradient), and a variable whose layout changed on assign
    (its slots keep the old one), must still update element by element as Keras's formula does."""
    gen = torch.Generator().manual_seed(3)
    x = dtape.constant(torch.randn(5, 3, generator=gen, dtype=torch.float64))
    a, b, c = (dtape.Variable(torch.randn(4, 3, generator=gen, dtype=torch.float64)) for _ in range(3))
    opt = dtape.optimizers.Adam(0.1)
    opt.build([a, b, c])
    c.assign(torch.randn(3, 4, generator=gen, dtype=torch.float64).T)  # now column-major; its slots are not
    ws = [v.torch().clone() for v in (a, b, c)]
    ref = [{"m": torch.zeros(4, 3, dtype=torch.float64), "v": torch.zeros(4, 3, dtype=torch.float64)} for _ in ws]
    for step in range(1, 4):
        with dtape.GradientTape() as tape:
            loss = (dtape.reduce_sum(a) + dtape.reduce_sum(dtape.matmul(x, dtape.transpose(b)) ** 2)
                    + dtape.reduce_sum(c * c))
        grads = tape.gradient(loss, [a, b, c])
        assert grads[0].torch().stride() == (0, 0) and grads[1].torch().stride() == (1, 4)  # what is tested
        want = [g.torch().contiguous() for g in grads]
        opt.apply_gradients(zip(grads, [a, b, c]))
        ws = [_reference_update("Adam", {}, w, g, r, step, 0.1) for w, g, r in zip(ws, want, ref)]
        for v, w in zip((a, b, c), ws):
            torch.testing.assert_close(v.torch(), w, rtol=1e-12, atol=0)


_OPTIMIZERS = [dtape.optimizers.SGD, lambda lr: dtape.optimizers.SGD(lr, momentum=0.9), dtape.optimizers.Adam,
               dtape.optimizers.AdamW, dtape.optimizers.RMSprop, dtape.optimizers.Adagrad]


@pytest.mark.parametrize("make, kwargs, name", [
    (dtape.optimizers.Adam, {"beta_1": 1.5}, "beta_1"), (dtape.optimizers.Adam, {"beta_1": 1.0}, "beta_1"),
    (dtape.optimizers.Adam, {"beta_1": -0.1}, "beta_1"), (dtape.optimizers.Adam, {"beta_2": 1.0}, "beta_2"),
    (dtape.optimizers.AdamW, {"beta_2": float("nan")}, "beta_2"),
    (dtape.optimizers.Adam, {"epsilon": -1e-8}, "epsilon"),
    (dtape.optimizers.Adam, {"epsilon": float("inf")}, "epsilon"),
    (dtape.optimizers.AdamW, {"weight_decay": -0.1}, "weight_decay"),
    (dtape.optimizers.SGD, {"momentum": 1.5}, "momentum"), (dtape.optimizers.SGD, {"momentum": -0.1}, "momentum"),
    (dtape.optimizers.RMSprop, {"momentum": 1.5}, "momentum"), (dtape.optimizers.RMSprop, {"rho": 1.5}, "rho"),
    (dtape.optimizers.RMSprop, {"epsilon": -1.0}, "epsilon"), (dtape.optimizers.Adagrad, {"epsilon": -1.0}, "epsilon"),
    (dtape.optimizers.Adagrad, {"initial_accumulator_value": -1.0}, "initial_accumulator_value"),
    (dtape.optimizers.Adam, {"learning_rate": -1e-3}, "learning_rate"),
    (dtape.optimizers.SGD, {"learning_rate": float("inf")}, "learning_rate"),
])
def test_optimizer_hyperparameter_out_of_range_raises(make, kwargs, name):
    # Adam(beta_1=1.5) trained silently (and beta_1 = 1 divided by zero at the first step).
    with pytest.raises(ValueError, match=f"{name} must be"):
        make(**kwargs)


def test_optimizer_hyperparameter_not_a_number_raises():
    with pytest.raises(TypeError, match="beta_1 must be a number, got str"):
        dtape.optimizers.Adam(beta_1="0.9x")


@pytest.mark.parametrize("name", ["beta_1", "beta_2", "epsilon"])
def test_optimizer_callable_hyperparameter_is_refused_clearly(name):
    # Keras 2 calls a callable hyperparameter at each step; dtape reads each once, at construction (it never
    # supported callables: float(callable) failed before), so the message says so instead of "got function"
    with pytest.raises(TypeError, match=rf"Adam: {name} must be a number, got the callable .*callable "
                                        r"hyperparameters are not supported \(only learning_rate"):
        dtape.optimizers.Adam(**{name: lambda: 0.5})


def test_optimizer_hyperparameters_accept_numpy_numbers():
    opt = dtape.optimizers.Adam(beta_1=np.float32(0.5), beta_2=np.float64(0.75), epsilon=np.float16(0.0))
    assert (opt.beta_1, opt.beta_2, opt.epsilon) == (0.5, 0.75, 0.0)
    assert all(type(x) is float for x in (opt.beta_1, opt.beta_2, opt.epsilon))


def test_optimizer_hyperparameters_at_the_ends_of_their_ranges_are_accepted():
    opt = dtape.optimizers.Adam(0.0, beta_1=0.0, beta_2=0.0, epsilon=0.0)
    assert (opt.beta_1, opt.beta_2, opt.epsilon) == (0.0, 0.0, 0.0)
    assert dtape.optimizers.SGD(momentum=1.0).momentum == 1.0
    assert dtape.optimizers.RMSprop(rho=1.0, momentum=1.0).rho == 1.0
    assert dtape.optimizers.AdamW(weight_decay=0.0).weight_decay == 0.0


@pytest.mark.parametrize("make", _OPTIMIZERS, ids=["SGD", "SGD_momentum", "Adam", "AdamW", "RMSprop", "Adagrad"])
@pytest.mark.parametrize("bad, error, match", [
    (torch.tensor([1.0]), ValueError, r"has shape \[1\], but the variable has shape \[2\]"),
    (torch.tensor([1.0, 1.0], dtype=torch.float64), TypeError,
     "has dtype torch.float64, but the variable is torch.float32; cast"),
], ids=["shape", "dtype"])
def test_apply_gradients_wrong_gradient_raises_before_any_write(make, bad, error, match):
    # A [1] gradient was broadcast over a [2] variable, a float64 one cast into float32. The bad pair
    # comes second: the first variable, the slots and iterations must be untouched.
    first, second = dtape.Variable([1.0, 2.0], name="first"), dtape.Variable([3.0, 4.0], name="second")
    opt = make(0.1)
    with pytest.raises(error, match=f"variable 'second' {match}"):
        opt.apply_gradients([(dtape.constant([1.0, 1.0]), first), (dtape.constant(bad), second)])
    assert first.numpy().tolist() == [1.0, 2.0] and second.numpy().tolist() == [3.0, 4.0]
    assert int(opt.iterations.numpy()) == 0 and opt._slots == {}


def test_apply_gradients_wrong_gradient_under_a_strategy_raises_before_any_write(strategy):
    with strategy.scope():
        first, second = dtape.Variable([1.0, 2.0], name="first"), dtape.Variable([3.0, 4.0], name="second")
        opt = dtape.optimizers.Adam(0.1)
    good = dtape.constant([1.0, 1.0])

    def step(bad_on):   # the replicas in `bad_on` pass a [1] gradient for `second`
        bad = _rid() in bad_on
        opt.apply_gradients([(good, first), (dtape.constant([1.0] if bad else [1.0, 1.0]), second)])
    for bad_on in ((0, 1), (1,)):
        with pytest.raises(ValueError, match=r"variable 'second' has shape \[1\]"):
            strategy.run(step, (bad_on,))
    with pytest.raises(TypeError, match="variable 'second' has dtype torch.float64"):
        strategy.run(lambda: opt.apply_gradients([(dtape.constant([1.0, 1.0]), first),
                                                  (dtape.constant([1.0, 1.0], dtype=torch.float64), second)]))
    for v, want in ((first, [1.0, 2.0]), (second, [3.0, 4.0])):
        assert [c.numpy().tolist() for c in v.values] == [want, want]
    assert int(opt.iterations.numpy()) == 0
