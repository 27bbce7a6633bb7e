"""dtape.function: values, gradients, captured variables, higher order."""
import torch

import dtape

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


def test_function_dropout_rerun_uses_same_random_mask():
    f = dtape.function(lambda x: dtape.nn.dropout(x, 0.5))
    x = _c(torch.ones(64))
    with dtape.GradientTape() as t:
        t.watch(x)
        y = f(x)
    g = t.gradient(y, x)
    torch.testing.assert_close(g.torch(), y.torch())  # d(mask * x / keep)/dx == y when x == 1


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
