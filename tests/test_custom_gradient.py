"""dtape.custom_gradient: one recorded op, the user's gradient, variables, higher order."""
import gc
import weakref

import pytest
import torch

import dtape

D = torch.float64


def _c(values):
    return dtape.constant(values, dtype=D)


@dtape.custom_gradient
def _log1pexp(x):
    e = dtape.exp(x)

    def grad(dy):
        return dy * (1 - 1 / (1 + e))
    return dtape.log(1 + e), grad


@dtape.custom_gradient
def _cube(x):
    def grad(dy):
        return dy * 3.0 * x * x  # dtape ops on the input: differentiable again
    return x * x * x, grad


def test_custom_gradient_value_and_gradient_match_eager():
    xt = torch.tensor([-3.0, 0.0, 2.0, 50.0], dtype=D)
    x = _c(xt)
    with dtape.GradientTape() as t:
        t.watch(x)
        y = _log1pexp(x)
    torch.testing.assert_close(y.torch(), torch.log1p(torch.exp(xt)))
    torch.testing.assert_close(t.gradient(y, x).torch(), torch.sigmoid(xt))


def test_custom_gradient_uses_user_rule_not_body():
    @dtape.custom_gradient
    def clip_grad(x):
        return x * 1.0, lambda dy: dtape.clip_by_value(dy, -0.5, 0.5)

    x = _c([1.0, 2.0])
    with dtape.GradientTape() as t:
        t.watch(x)
        y = clip_grad(x) * _c([3.0, 0.1])
    torch.testing.assert_close(t.gradient(y, x).torch(), torch.tensor([0.5, 0.1], dtype=D))


def test_custom_gradient_output_is_produced_by_the_single_custom_op():
    """The body is recorded (as in TF eager), but only what grad_fn keeps alive stays: `exp`, whose
    output `e` grad_fn closes over; the body's own `1 + e` and `log` died with its result."""
    x = _c([1.0, 2.0])
    with dtape.GradientTape(persistent=True) as t:
        t.watch(x)
        y = _log1pexp(x)
    records = t._tape.records()
    assert [r[0].name for r in records] == ["exp", "_log1pexp"]
    assert records[1][1] == (x._id,) and records[1][2] == (y._id,)
    assert not any(y._id in r[2] for r in records[:1])


def test_custom_gradient_second_order_through_grad_fn():
    x = _c([0.5, -2.0])
    with dtape.GradientTape() as outer:
        outer.watch(x)
        with dtape.GradientTape() as inner:
            inner.watch(x)
            y = _cube(x)
        g = inner.gradient(y, x)
    torch.testing.assert_close(g.torch(), 3 * x.torch() ** 2)
    torch.testing.assert_close(outer.gradient(g, x).torch(), 6 * x.torch())


def test_custom_gradient_with_variables_gets_variable_gradients():
    w = dtape.Variable(torch.tensor([2.0, -1.0], dtype=D))
    seen = []

    @dtape.custom_gradient
    def scale(x):
        def grad(dy, variables=None):
            seen.append(variables)
            return dy * w.read_value(), [dy * x * 10.0]  # deliberately 10x to show the rule is used
        return x * w, grad

    x = _c([3.0, 4.0])
    with dtape.GradientTape() as t:
        t.watch(x)
        y = scale(x)
    assert t.watched_variables() == (w,)
    gx, gw = t.gradient(y, [x, w])
    assert seen == [[w]]
    torch.testing.assert_close(gx.torch(), torch.tensor([2.0, -1.0], dtype=D))
    torch.testing.assert_close(gw.torch(), torch.tensor([30.0, 40.0], dtype=D))


def test_custom_gradient_variables_without_keyword_raises_type_error():
    w = dtape.Variable(2.0)

    @dtape.custom_gradient
    def f(x):
        return x * w, lambda dy: dy

    x = dtape.constant(1.0)
    with dtape.GradientTape() as t:
        t.watch(x)
        with pytest.raises(TypeError, match="variables"):
            f(x)


def test_custom_gradient_wrong_gradient_count_raises_value_error():
    @dtape.custom_gradient
    def f(x, y):
        return x * y, lambda dy: dy

    x, y = _c(1.0), _c(2.0)
    with dtape.GradientTape() as t:
        t.watch([x, y])
        z = f(x, y)
    with pytest.raises(ValueError, match="1 gradients for 2 inputs"):
        t.gradient(z, [x, y])


def test_custom_gradient_multiple_outputs_and_inputs():
    @dtape.custom_gradient
    def swap(a, b):
        return (b * 1.0, a * 1.0), lambda da, db: (db * 2.0, da * 3.0)

    a, b = _c([1.0]), _c([2.0])
    with dtape.GradientTape() as t:
        t.watch([a, b])
        p, q = swap(a, b)
        loss = p * 5.0 + q * 7.0
    ga, gb = t.gradient(loss, [a, b])
    assert (float(ga[0]), float(gb[0])) == (14.0, 15.0)


def test_custom_gradient_no_tape_returns_value_only():
    y = _cube(_c(2.0))
    assert isinstance(y, dtape.Tensor) and float(y) == 8.0


def _softplus_derivatives(xt, order):
    """d^k/dx^k of log(1 + exp(x)) for k = 1..order, by torch.autograd in float64."""
    x = xt.clone().requires_grad_()
    out, g = [], torch.log1p(torch.exp(x)).sum()
    for _ in range(order):
        g = torch.autograd.grad(g, x, create_graph=True)[0]
        out.append(g.detach())
        g = g.sum()
    return out


def test_custom_gradient_second_order_through_a_grad_fn_closing_over_the_body():
    """TF's own example: grad_fn closes over `e = exp(x)` of the body; d2/dx2 at 0.5 is 0.2350 (None before)."""
    x = _c(0.5)
    with dtape.GradientTape() as outer:
        outer.watch(x)
        with dtape.GradientTape() as inner:
            inner.watch(x)
            y = _log1pexp(x)
        g = inner.gradient(y, x)
    gg = outer.gradient(g, x)
    assert gg is not None
    d1, d2 = _softplus_derivatives(torch.tensor(0.5, dtype=D), 2)
    torch.testing.assert_close(g.torch(), d1, rtol=0, atol=1e-12)
    torch.testing.assert_close(gg.torch(), d2, rtol=0, atol=1e-12)
    assert round(float(gg), 4) == 0.2350


def test_custom_gradient_third_order_through_closure_and_upstream_gradient():
    """loss = y * y: the upstream dy = 2y depends on x through the custom op itself, so each order
    differentiates grad_fn through its argument and through its closure."""
    xt = torch.tensor([-1.5, 0.0, 0.5, 2.0], dtype=D)
    x = _c(xt)
    with dtape.GradientTape() as t3:
        t3.watch(x)
        with dtape.GradientTape() as t2:
            t2.watch(x)
            with dtape.GradientTape() as t1:
                t1.watch(x)
                y = _log1pexp(x)
                loss = dtape.reduce_sum(y * y)
            g1 = t1.gradient(loss, x)
        g2 = t2.gradient(g1, x)
    g3 = t3.gradient(g2, x)
    xr = xt.clone().requires_grad_()
    ref = torch.log1p(torch.exp(xr))
    r1 = torch.autograd.grad((ref * ref).sum(), xr, create_graph=True)[0]
    r2 = torch.autograd.grad(r1.sum(), xr, create_graph=True)[0]
    r3 = torch.autograd.grad(r2.sum(), xr)[0]
    for got, want in ((g1, r1), (g2, r2), (g3, r3)):
        torch.testing.assert_close(got.torch(), want.detach(), rtol=0, atol=1e-12)


def test_custom_gradient_first_order_is_grad_fns_not_the_bodys_derivative():
    """grad_fn deliberately differs from the body's derivative (5x^2 for a body x^3) and closes over a body
    intermediate; another closes over the body's own output. The recorded body must not add its path."""
    @dtape.custom_gradient
    def cube(x):
        sq = x * x
        return sq * x, lambda dy: dy * 5.0 * sq  # true derivative: 3 x^2

    @dtape.custom_gradient
    def exp2(x):
        y = dtape.exp(x)
        return y, lambda dy: dy * y * 2.0  # true derivative: e^x

    xt = torch.tensor([0.5, -2.0, 3.0], dtype=D)
    for fn, d1, d2 in ((cube, 5 * xt ** 2, 10 * xt), (exp2, 2 * torch.exp(xt), 2 * torch.exp(xt))):
        x = _c(xt)
        with dtape.GradientTape() as outer:
            outer.watch(x)
            with dtape.GradientTape() as inner:
                inner.watch(x)
                y = fn(x)
            g = inner.gradient(y, x)
        torch.testing.assert_close(g.torch(), d1, rtol=0, atol=1e-12)
        torch.testing.assert_close(outer.gradient(g, x).torch(), d2, rtol=0, atol=1e-12)


def test_custom_gradient_variables_form_first_and_second_order():
    """The body reads a variable; grad_fn (deliberately 2x and 3x the true rule) uses it and a closed-over
    body intermediate h = exp(x w) that depends on both: second order with respect to x and to w."""
    wt, xt = torch.tensor([1.5, -0.5], dtype=D), torch.tensor([0.3, 2.0], dtype=D)
    w = dtape.Variable(wt)

    @dtape.custom_gradient
    def f(x):
        h = dtape.exp(x * w)

        def grad(dy, variables=None):
            assert variables == [w]
            return dy * 2.0 * w * h, [dy * 3.0 * x * h]
        return h, grad

    x = _c(xt)
    with dtape.GradientTape(persistent=True) as outer:
        outer.watch(x)
        with dtape.GradientTape() as inner:
            inner.watch(x)
            y = f(x)
        gx, gw = inner.gradient(y, [x, w])
    assert inner.watched_variables() == (w,) and outer.watched_variables() == (w,)
    xr, wr = xt.clone().requires_grad_(), wt.clone().requires_grad_()
    h = torch.exp(xr * wr)
    rx, rw = 2.0 * wr * h, 3.0 * xr * h  # what grad_fn computes, by torch.autograd
    torch.testing.assert_close(gx.torch(), rx.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(gw.torch(), rw.detach(), rtol=0, atol=1e-12)
    want = torch.autograd.grad(rx.sum(), [xr, wr], retain_graph=True) + torch.autograd.grad(rw.sum(), [xr, wr])
    got = outer.gradient(gx, [x, w]) + outer.gradient(gw, [x, w])
    for g, r in zip(got, want):
        torch.testing.assert_close(g.torch(), r, rtol=0, atol=1e-12)


def test_custom_gradient_records_are_released_by_a_non_persistent_tape():
    """What the recorded body leaves (the closure's `e` and its record) goes with the custom op's record."""
    seen = []

    @dtape.custom_gradient
    def log1pexp(x):
        e = dtape.exp(x)
        seen.append(weakref.ref(e))
        return dtape.log(1 + e), lambda dy: dy * (1 - 1 / (1 + e))

    x = _c(torch.linspace(-2.0, 2.0, 1000, dtype=D))
    with dtape.GradientTape() as t:
        t.watch(x)
        y = log1pexp(x)
    assert t._tape.num_records() == 2 and t._tape.nbytes() > 0
    g = t.gradient(y, x)
    torch.testing.assert_close(g.torch(), torch.sigmoid(x.torch()), rtol=0, atol=1e-12)
    assert t._tape.num_records() == 0 and t._tape.nbytes() == 0
    gc.collect()
    assert seen[0]() is None  # grad_fn and its closure are gone with the record

    with dtape.GradientTape(persistent=True) as t:  # persistent: the records go when the output dies
        t.watch(x)
        y = log1pexp(x)
    assert t._tape.num_records() == 2
    del y
    gc.collect()
    assert t._tape.num_records() == 0 and seen[1]() is None
