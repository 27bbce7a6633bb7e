"""dtape.custom_gradient: one recorded op, the user's gradient, variables, higher order."""
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


def test_custom_gradient_body_recorded_as_single_op():
    x = _c([1.0, 2.0])
    with dtape.GradientTape(persistent=True) as t:
        t.watch(x)
        y = _log1pexp(x)
    records = t._tape.records()
    assert len(records) == 1
    assert records[0][0].name == "_log1pexp"
    assert records[0][2] == (y._id,)


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
