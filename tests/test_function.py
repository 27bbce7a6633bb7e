"""dtape.function (records its body once) and dtape.recompute_grad (re-runs it): values,
gradients, captured variables, forward-time semantics, higher order, replicas."""
import contextlib
import threading

import pytest
import torch

import dtape
from dtape import distribute as ds
from dtape import tape as _tp

D = torch.float64


def _c(values):
    return dtape.constant(values, dtype=D)


def _body(x, y):
    return dtape.reduce_sum(dtape.tanh(x * y) + x * x, axis=0)


def test_function_values_and_gradients_match_eager():
    xt, yt = torch.randn(3, 2, dtype=D), torch.randn(3, 2, dtype=D)
    f = dtape.function(_body)
    results = []
    for fn in (_body, f):
        x, y = _c(xt), _c(yt)
        with dtape.GradientTape() as t:
            t.watch([x, y])
            out = fn(x, y)
        results.append((out.torch(), *[g.torch() for g in t.gradient(out, [x, y])]))
    for eager, fun in zip(*results):
        torch.testing.assert_close(fun, eager)


def test_function_recorded_as_single_op():
    f = dtape.function(_body)
    x, y = _c([1.0, 2.0]), _c([3.0, 4.0])
    with dtape.GradientTape(persistent=True) as t:
        t.watch([x, y])
        out = f(x, y)
    records = t._tape.records()
    assert len(records) == 1
    assert records[0][0].name == "_body" and records[0][2] == (out._id,)


def test_function_captured_variables_watched_and_get_gradients():
    wt = torch.tensor([[0.5, -1.0], [2.0, 0.25]], dtype=D)
    w, b = dtape.Variable(wt), dtape.Variable(torch.tensor([0.1, 0.2], dtype=D))
    frozen = dtape.Variable(torch.tensor(3.0, dtype=D), trainable=False)

    @dtape.function
    def layer(x):
        return dtape.reduce_sum(dtape.sigmoid(x @ w + b) * frozen)

    xt = torch.tensor([[1.0, -2.0]], dtype=D)
    with dtape.GradientTape() as t:
        out = layer(_c(xt))
    assert t.watched_variables() == (w, b)
    gw, gb = t.gradient(out, [w, b])
    wr, br = wt.clone().requires_grad_(), torch.tensor([0.1, 0.2], dtype=D).requires_grad_()
    ew, eb = torch.autograd.grad((torch.sigmoid(xt @ wr + br) * 3.0).sum(), [wr, br])
    torch.testing.assert_close(gw.torch(), ew)
    torch.testing.assert_close(gb.torch(), eb)


def test_function_second_order_through_body():
    v = dtape.Variable(torch.tensor(1.5, dtype=D))
    f = dtape.function(lambda x: dtape.sin(x * v))
    x = _c([0.3, -0.8])
    with dtape.GradientTape() as outer:
        outer.watch(x)
        with dtape.GradientTape() as inner:
            inner.watch(x)
            y = f(x)
        g = inner.gradient(y, x)
    gg = outer.gradient(g, x)
    xt = x.torch()
    torch.testing.assert_close(g.torch(), 1.5 * torch.cos(1.5 * xt))
    torch.testing.assert_close(gg.torch(), -2.25 * torch.sin(1.5 * xt))


def test_function_nested_structures_and_kwargs():
    @dtape.function
    def f(pair, scale=None):
        a, b = pair
        return {"s": a * b * scale, "n": 7}

    a, b, s = _c(2.0), _c(3.0), _c(10.0)
    with dtape.GradientTape() as t:
        t.watch([a, b, s])
        out = f((a, b), scale=s)
    assert out["n"] == 7
    ga, gb, gs = t.gradient(out["s"], [a, b, s])
    assert (float(ga), float(gb), float(gs)) == (30.0, 20.0, 6.0)


def test_function_returning_input_is_new_tensor_with_identity_gradient():
    f = dtape.function(lambda x: x)
    x = _c([1.0, 2.0])
    with dtape.GradientTape() as t:
        t.watch(x)
        y = f(x)
        z = y * 3.0
    assert y is not x
    torch.testing.assert_close(t.gradient(z, x).torch(), torch.full((2,), 3.0, dtype=D))


def test_function_python_function_attribute_and_no_tape_call():
    def body(x):
        return x + 1.0

    f = dtape.function(body)
    assert f.python_function is body and f.__name__ == "body"
    assert float(f(_c(1.0))) == 2.0


def test_function_as_method_binds_self():
    class M:
        def __init__(self):
            self.v = dtape.Variable(torch.tensor(2.0, dtype=D))

        @dtape.function
        def __call__(self, x):
            return x * self.v

    m = M()
    with dtape.GradientTape() as t:
        y = m(_c(5.0))
    assert float(t.gradient(y, m.v)) == 5.0


def test_function_variable_read_in_custom_gradient_inside_function_captured():
    w = dtape.Variable(torch.tensor(3.0, dtype=D))

    @dtape.custom_gradient
    def scaled(x):
        return x * w, lambda dy, variables=None: (dy * w.read_value(), [dy * x])

    f = dtape.function(lambda x: scaled(x) * 2.0)
    with dtape.GradientTape() as t:
        y = f(_c(4.0))
    assert t.watched_variables() == (w,)
    assert float(t.gradient(y, w)) == 8.0


@contextlib.contextmanager
def _mirrored():
    """Two CPU replica threads; closed afterwards where the strategy supports it."""
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"], timeout=10)
    try:
        yield strategy
    finally:
        getattr(strategy, "close", lambda: None)()




# -- (a) tapes opened inside the body -----------------------------------------
def test_function_tape_inside_body_gives_real_gradients_and_composes_with_outer_tape():
    @dtape.function
    def grad_of_cube(x):
        with dtape.GradientTape() as t:
            t.watch(x)
            y = x * x * x
        return t.gradient(y, x)

    x = _c([0.5, -2.0])
    torch.testing.assert_close(grad_of_cube(x).torch(), 3 * x.torch() ** 2)  # no outer tape
    with dtape.GradientTape() as outer:
        outer.watch(x)
        g = grad_of_cube(x)
    torch.testing.assert_close(g.torch(), 3 * x.torch() ** 2)
    torch.testing.assert_close(outer.gradient(g, x).torch(), 6 * x.torch())  # through the inner tape's gradient


def _train_losses(run_step, steps=4):
    """Losses and final weights of a small tanh MLP trained with Adam; `run_step(step, x, y)` runs one step."""
    gen = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
    w1 = dtape.Variable(torch.randn(4, 8, generator=gen) * 0.5)
    b1 = dtape.Variable(torch.zeros(8))
    w2 = dtape.Variable(torch.randn(8, 1, generator=gen) * 0.5)
    variables, opt = [w1, b1, w2], dtape.optimizers.Adam(0.05)

    def step(x, y):
        with dtape.GradientTape() as tape:
            h = dtape.tanh(x @ w1 + b1)
            loss = dtape.reduce_mean(dtape.square(h @ w2 - y))
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    losses = [run_step(step, dtape.constant(xs), dtape.constant(ys)) for _ in range(steps)]
    return losses, [v.torch() for v in variables]


@pytest.mark.parametrize("observer", [False, True], ids=["no_outer_tape", "outer_tape"])
def test_function_train_step_gives_exactly_the_eager_losses(observer):
    def run(wrap):
        def run_step(step, x, y):
            with dtape.GradientTape() if observer else _Null():  # an outer tape: the recorded path
                return float(wrap(step)(x, y))
        return _train_losses(run_step)

    eager_losses, eager_w = run(lambda f: f)
    fn_losses, fn_w = run(dtape.function)
    assert fn_losses == eager_losses and eager_losses[-1] < eager_losses[0]
    assert all(torch.equal(a, b) for a, b in zip(fn_w, eager_w))


def _mirrored_train(wrap, observer, steps=3):
    with _mirrored() as strategy:
        gen = torch.Generator().manual_seed(1)
        xs, ys = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
        with strategy.scope():
            w = dtape.Variable(torch.randn(4, 1, generator=gen))
            opt = dtape.optimizers.SGD(0.1, momentum=0.9)

        def step(x, y):
            with dtape.GradientTape() as tape:
                loss = dtape.reduce_sum(dtape.square(dtape.tanh(x @ w) - y)) / 8.0
            opt.apply_gradients([(tape.gradient(loss, w), w)])
            return loss
        step = wrap(step)
        losses = []
        for x, y in strategy.experimental_distribute_dataset([(xs, ys)] * steps):
            with dtape.GradientTape() if observer else _Null():  # a main-thread tape: the recorded path
                losses.append([float(v) for v in strategy.run(step, args=(x, y)).values])
        return losses, [c.torch() for c in w.values]


@pytest.mark.parametrize("observer", [False, True], ids=["no_outer_tape", "outer_tape"])
def test_function_train_step_under_mirrored_strategy_gives_exactly_the_eager_losses(observer, fast_switching):
    eager_losses, eager_w = _mirrored_train(lambda f: f, observer)
    fn_losses, fn_w = _mirrored_train(dtape.function, observer)
    assert fn_losses == eager_losses and sum(eager_losses[-1]) < sum(eager_losses[0])
    assert all(torch.equal(a, b) for a, b in zip(fn_w, eager_w))


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# -- (b) (c) (d) forward-time values, side effects once, forward masks --------------
def test_function_gradient_uses_forward_time_variable_value():
    v = dtape.Variable(torch.tensor(2.0, dtype=D))
    f = dtape.function(lambda x: x * v + v * v)
    x = _c(3.0)
    with dtape.GradientTape() as t:
        t.watch(x)
        y = f(x)
    v.assign(5.0)
    gx, gv = t.gradient(y, [x, v])
    assert (float(gx), float(gv)) == (2.0, 3.0 + 2 * 2.0)  # eager: the values read in the forward


def test_function_state_update_in_body_happens_once_per_call():
    counter = dtape.Variable(torch.tensor(0.0, dtype=D), trainable=False)

    @dtape.function
    def f(x):
        counter.assign_add(1.0)
        return x * x

    x = _c(3.0)
    with dtape.GradientTape(persistent=True) as t:
        t.watch(x)
        y = f(x) + f(x)
    assert float(t.gradient(y, x)) == 12.0
    assert float(t.gradient(y, x)) == 12.0
    assert float(counter) == 2.0


def test_function_random_draws_use_the_forward_draws_without_replay():
    @dtape.function
    def f(x):
        noise = dtape.random.uniform([64], dtype=D)
        return dtape.nn.dropout(x, 0.5) * noise

    x = _c(torch.ones(64))
    with dtape.random.generator_scope(torch.Generator().manual_seed(7)):  # a replica-style generator
        with dtape.GradientTape() as t:
            t.watch(x)
            y = f(x)
        dtape.random.uniform([100])  # the generator moves on before the backward
        g = t.gradient(y, x)
    torch.testing.assert_close(g.torch(), y.torch())  # d(mask * x / keep * noise)/dx == y when x == 1
    assert 0 < int((y.torch() == 0).sum()) < 64


# -- (e) which inputs get gradients ----------------------------------------------
def test_function_gradients_for_positional_keyword_nested_repeated_args_and_variables():
    v = dtape.Variable(torch.tensor([0.5, -1.5], dtype=D))

    def body(pair, x, x_again, scale=None, unused=None):
        a, (b,) = pair
        return dtape.reduce_sum(dtape.tanh(a * b * v) * scale + x * x_again)

    a, b, x, s, u = _c([1.0, 2.0]), _c([3.0, -1.0]), _c([0.7, 0.2]), _c([2.0, 3.0]), _c([9.0, 9.0])
    sources = [a, b, x, s, u, v]
    results = []
    for fn in (body, dtape.function(body)):
        with dtape.GradientTape() as t:
            t.watch([a, b, x, s, u])
            y = fn((a, [b]), x, x, scale=s, unused=u)
        results.append(t.gradient(y, sources))
    eager, got = results
    assert eager[4] is None and got[4] is None
    for e, g in zip(eager[:4] + eager[5:], got[:4] + got[5:]):
        torch.testing.assert_close(g.torch(), e.torch())
    torch.testing.assert_close(got[2].torch(), 2 * x.torch())  # x passed twice: counted once per use


def test_function_unwatched_call_keeps_nothing_and_restores_the_tape_set():
    f = dtape.function(lambda x: x * 2.0)
    before = _tp._tape_set
    with dtape.GradientTape(persistent=True) as t:  # recording, but it watches nothing f uses
        y = f(_c(1.0))
        assert _tp._tape_set == before + (t._tape,)
        with pytest.raises(ZeroDivisionError):
            dtape.function(lambda x: 1 / 0)(_c(1.0))
        assert _tp._tape_set == before + (t._tape,)
    assert t._tape.num_records() == 0 and float(y) == 2.0


def test_function_pauses_outer_tapes_on_the_calling_thread_only():
    x = _c(2.0)
    started, done = threading.Event(), threading.Event()
    other = {}

    def worker():
        assert started.wait(timeout=5)
        other["z"] = x * 5.0  # another thread, while the body runs: the outer tape records it
        done.set()

    @dtape.function
    def f(x):
        started.set()
        assert done.wait(timeout=5)
        return x * 3.0

    th = threading.Thread(target=worker)
    th.start()
    with dtape.GradientTape(persistent=True) as t:
        t.watch(x)
        y = f(x)
    th.join(timeout=5)
    assert [r[0].name for r in t._tape.records()] == ["multiply", "f"]
    assert float(t.gradient(other["z"], x)) == 5.0 and float(t.gradient(y, x)) == 3.0


# -- (f) replicas ---------------------------------------------------------------------
@pytest.mark.parametrize("wrap", [dtape.function, dtape.recompute_grad], ids=["function", "recompute_grad"])
def test_function_concurrent_replicas_each_get_their_own_gradient(wrap, fast_switching):
    with _mirrored() as strategy:
        with strategy.scope():
            v = dtape.Variable(torch.tensor(1.5, dtype=D))
        both_inside = threading.Barrier(2, timeout=5)

        def body(x):
            both_inside.wait()  # the two replicas run the body at the same time
            return dtape.nn.dropout(x * v, 0.5)
        f = wrap(body)

        def step():
            rid = ds.get_replica_context().replica_id_in_sync_group
            x = _c(torch.arange(1.0, 201.0) * (rid + 1))
            with dtape.random.generator_scope(torch.Generator().manual_seed(rid)):
                with dtape.GradientTape() as t:
                    t.watch(x)
                    y = f(x)
                    dtape.random.uniform([50])  # move the replica's generator on
                gx, gv = t.gradient(y, [x, v])
            return y.torch(), x.torch(), gx.torch(), gv.torch()

        for _ in range(3):
            for y, x, gx, gv in zip(*[r.values for r in strategy.run(step)]):
                torch.testing.assert_close(gx, y / x)  # y = mask * x * v / keep
                torch.testing.assert_close(gv, y.sum() / 1.5)


# -- second order ---------------------------------------------------------------------
def _second_order(fn, xt, vt, ct):
    """d/d(x, v) of <c, dy/dx> and the Hessian of y w.r.t. x, with nested dtape tapes."""
    x, v, c = _c(xt), dtape.Variable(vt), _c(ct)
    with dtape.GradientTape(persistent=True) as outer:
        outer.watch(x)
        with dtape.GradientTape() as inner:
            inner.watch(x)
            y = fn(x, v)
        gx = inner.gradient(y, x)
        z = dtape.reduce_sum(gx * c)
    return gx.torch(), [g.torch() for g in outer.gradient(z, [x, v])], outer.jacobian(gx, x).torch()


def _torch_second_order(body, xt, vt, ct):
    x, v = xt.clone().requires_grad_(), vt.clone().requires_grad_()
    (gx,) = torch.autograd.grad(body(x, v), x, create_graph=True)
    gxx, gxv = torch.autograd.grad((gx * ct).sum(), [x, v])
    hess = torch.autograd.functional.hessian(lambda x_: body(x_, vt), xt)
    return gx.detach(), [gxx, gxv], hess


def _nested_function(body):
    inner = dtape.function(body)
    return dtape.function(lambda x, v: inner(x, v) * 1.0)


@pytest.mark.parametrize("wrap", [dtape.function, dtape.recompute_grad, _nested_function],
                         ids=["function", "recompute_grad", "function_in_function"])
def test_second_order_and_mixed_derivatives_match_torch(wrap):
    gen = torch.Generator().manual_seed(3)
    xt, vt, ct = (torch.randn(3, generator=gen, dtype=D), torch.randn(3, 2, generator=gen, dtype=D),
                  torch.randn(3, generator=gen, dtype=D))

    def dtape_body(x, v):
        h = dtape.tanh(dtape.matmul(dtape.reshape(x, [1, 3]), v))
        return dtape.reduce_sum(dtape.exp(h) * h) + dtape.reduce_sum(dtape.tanh(x) * x)

    def torch_body(x, v):
        h = torch.tanh(x.reshape(1, 3) @ v)
        return (torch.exp(h) * h).sum() + (torch.tanh(x) * x).sum()

    got = _second_order(wrap(dtape_body), xt, vt, ct)
    want = _torch_second_order(torch_body, xt, vt, ct)
    torch.testing.assert_close(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w)
    torch.testing.assert_close(got[2], want[2])


# -- recompute_grad ---------------------------------------------------------------------
def _block_grads(wrap, assign_between):
    """Gradients of a dropout block w.r.t. x and w, drawing from a seeded generator."""
    gen = torch.Generator().manual_seed(0)
    xt, wt = torch.randn(4, 6, generator=gen, dtype=D), torch.randn(6, 6, generator=gen, dtype=D)
    x, w = _c(xt), dtape.Variable(wt)
    block = wrap(lambda x: dtape.reduce_sum(dtape.nn.dropout(dtape.tanh(x @ w), 0.4) * dtape.exp(x @ w)))
    with dtape.random.generator_scope(torch.Generator().manual_seed(11)):
        with dtape.GradientTape() as t:
            t.watch(x)
            y = block(x)
        if assign_between:
            w.assign(wt * 3.0)
            dtape.random.uniform([10])
        return [g.torch() for g in t.gradient(y, [x, w])] + [y.torch()]


def test_recompute_grad_equals_eager_gradient_with_dropout_and_assign_before_backward():
    eager = _block_grads(lambda f: f, assign_between=False)
    got = _block_grads(dtape.recompute_grad, assign_between=True)
    for g, e in zip(got, eager):
        torch.testing.assert_close(g, e)


def _saved_tensors(tape):
    """Distinct torch tensors a tape keeps alive: its records' inputs/outputs, and what ops save."""
    seen, stack = {}, [tape]
    while stack:
        for op, _, _, inputs, outputs, _ in stack.pop().records():
            for t in list(inputs) + list(outputs):
                tt = t.torch() if hasattr(t, "torch") else None
                if isinstance(tt, torch.Tensor):
                    seen[id(tt)] = tt
            if isinstance(getattr(op, "tape", None), _tp.Tape):
                stack.append(op.tape)
            for t in nest_leaves(getattr(op, "forward", ())):
                seen[id(t)] = t
    return len(seen)


def nest_leaves(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dtape.Tensor):
        return [x.torch()]
    if isinstance(x, dict):
        return [t for v in x.values() for t in nest_leaves(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in nest_leaves(v)]
    return []


def test_recompute_grad_keeps_fewer_tensors_than_function():
    w = dtape.Variable(torch.randn(8, 8, dtype=D) * 0.3)

    def body(x):
        for _ in range(6):
            x = dtape.tanh(x @ w)
        return dtape.reduce_sum(x)

    counts = {}
    for name, wrap in (("function", dtape.function), ("recompute", dtape.recompute_grad)):
        x = _c(torch.ones(4, 8))
        with dtape.GradientTape() as t:
            t.watch(x)
            y = wrap(body)(x)
        counts[name] = (t._tape.num_records(), _saved_tensors(t._tape))
        t.gradient(y, x)
    assert counts["function"][0] == counts["recompute"][0] == 1
    # x, w, y, w's snapshot, RNG end state vs 6 layers' saved inputs and outputs (what each rule reads)
    assert counts["recompute"][1] <= 5 < 8 <= counts["function"][1]


def test_recompute_grad_replays_snapshot_thread_locally_and_leaves_generator_alone():
    v = dtape.Variable(torch.tensor(2.0, dtype=D))
    other_thread_reads = []

    def body(x):
        if other_thread_reads:  # the backward's re-run: another thread reads v meanwhile
            th = threading.Thread(target=lambda: other_thread_reads.append(float(v.read_value())))
            th.start()
            th.join(timeout=5)
        other_thread_reads.append("forward")
        return dtape.nn.dropout(x * v, 0.5)

    f = dtape.recompute_grad(body)
    x = _c(torch.ones(32))
    gen = torch.Generator().manual_seed(5)
    with dtape.random.generator_scope(gen):
        with dtape.GradientTape() as t:
            t.watch(x)
            y = f(x)
        dtape.random.uniform([10])
        state = gen.get_state()
        v.assign(7.0)
        g = t.gradient(y, x)
        assert torch.equal(gen.get_state(), state)  # the re-run drew from a private clone
    torch.testing.assert_close(g.torch(), y.torch() / 1.0)  # mask * v / keep, with the forward's v
    assert float(v.read_value()) == 7.0  # reads after the backward see the current value
    assert other_thread_reads == ["forward", 7.0, "forward"]  # the replay is thread-local


@pytest.mark.gpu
@pytest.mark.parametrize("wrap", [dtape.function, dtape.recompute_grad], ids=["function", "recompute_grad"])
def test_function_and_recompute_dropout_on_cuda_use_the_forward_mask(wrap):
    f = wrap(lambda x: dtape.nn.dropout(x * 2.0, 0.5))
    with dtape.device("cuda:0"):
        x = dtape.ones([256], dtype=D)
        with dtape.GradientTape() as t:
            t.watch(x)
            y = f(x)
        dtape.random.uniform([10])
        g = t.gradient(y, x)
    assert g.device.type == "cuda"
    torch.testing.assert_close(g.torch(), y.torch())  # mask * 2 / keep, x == 1


def test_function_keeps_eager_semantics_for_explicit_watches_replica_reads_and_paused_tapes():
    """Found by review: a non-trainable variable watched explicitly, a body that calls
    strategy.run (reads on replica threads), and the outer tape's stop_recording in the body."""
    def grads(wrap):
        out = []
        v = dtape.Variable(2.0, trainable=False)
        f = wrap(lambda: v * 3.0)
        with dtape.GradientTape() as t:
            t.watch(v)
            y = f()
        out.append(t.gradient(y, v))
        with dtape.distribute.MirroredStrategy(["cpu:0", "cpu:1"], timeout=10) as s:
            with s.scope():
                mv = dtape.Variable(2.0)
            f = wrap(lambda: s.reduce("SUM", s.run(lambda: mv * 3.0), axis=None))
            with dtape.GradientTape() as t:
                y = f()
            out.append(t.gradient(y, mv))
        x = dtape.constant(2.0)
        with dtape.GradientTape() as t:
            t.watch(x)

            def body(x):
                with t.stop_recording():
                    y = x * x
                return y + x
            z = wrap(body)(x)
        out.append(t.gradient(z, x))
        return [None if g is None else float(g) for g in out]

    eager = grads(lambda f: f)
    assert eager == [3.0, 6.0, 1.0]
    assert grads(dtape.function) == eager


def test_recompute_grad_refuses_what_it_cannot_replay():
    """A layer built inside the block (the forward drew its weights, the re-run does not) and a
    gradient taken on another thread than the block's: clear errors, never silently wrong numbers."""
    layer = dtape.layers.Dense(2)
    block = dtape.recompute_grad(lambda x: dtape.nn.dropout(layer(x), 0.5))
    x = dtape.constant([[1.0, 2.0]])
    with dtape.GradientTape() as t:
        t.watch(x)
        y = block(x)
    with pytest.raises(RuntimeError, match="drew different random numbers"):
        t.gradient(y, x)
    with dtape.distribute.MirroredStrategy(["cpu:0", "cpu:1"], timeout=10) as s:
        with s.scope():
            v = dtape.Variable(1.0)
        block = dtape.recompute_grad(lambda: v * 3.0)
        with dtape.GradientTape() as t:
            y = s.reduce("SUM", s.run(block), axis=None)
        with pytest.raises(RuntimeError, match="another thread"):
            t.gradient(y, v)
