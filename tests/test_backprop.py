"""GradientTape, the backward walk and the functional forms, against torch.autograd in float64."""
import math
import threading

import numpy as np
import pytest
import torch

import dtape
from dtape import backprop

D = torch.float64


def _c(values):
    return dtape.constant(values, dtype=D)


def _close(a, b):
    torch.testing.assert_close(a.torch() if isinstance(a, dtape.Tensor) else a, b)


# -- seed 2 tests (tf backprop_test.py) -----------------------------------------
def test_watched_variables_automatic_with_reset_lists_variable():
    with dtape.GradientTape() as t:
        assert len(t.watched_variables()) == 0
        v = dtape.Variable(1.0)
        loss = v * v
        assert t.watched_variables() == (v,)
        t.reset()
        assert len(t.watched_variables()) == 0
        loss += v * v
        assert t.watched_variables() == (v,)
    assert float(t.gradient(loss, v)) == 2.0


def test_watched_variables_explicit_with_reset_lists_variable():
    with dtape.GradientTape() as t:
        assert len(t.watched_variables()) == 0
        v = dtape.Variable(1.0)
        t.watch(v)
        assert t.watched_variables() == (v,)
        t.reset()
        assert len(t.watched_variables()) == 0
        t.watch(v)
        assert t.watched_variables() == (v,)


# -- basics ---------------------------------------------------------------------
def test_gradient_persistent_many_calls_same_values():
    x = _c([1.0, 2.0, 3.0])
    with dtape.GradientTape(persistent=True) as t:
        t.watch(x)
        y = dtape.reduce_sum(x * x)
        z = dtape.reduce_sum(dtape.exp(x))
    for _ in range(3):
        _close(t.gradient(y, x), 2 * x.torch())
        _close(t.gradient(z, x), torch.exp(x.torch()))


def test_gradient_second_call_non_persistent_raises():
    x = _c(2.0)
    with dtape.GradientTape() as t:
        t.watch(x)
        y = x * x
    t.gradient(y, x)
    with pytest.raises(RuntimeError, match="persistent=True"):
        t.gradient(y, x)


def test_non_persistent_gradient_that_raises_midway_still_frees_the_tape():
    """A non-persistent tape frees its records at its first gradient() (API.md; TF drops the tape before
    walking), also when that call raises midway: no half-walked records (some without their saved
    tensors) stay behind to count, list or hold memory, and a second call is the usual RuntimeError."""
    x = _c([1.0, 2.0, 3.0])

    @dtape.custom_gradient
    def boom(a):
        def grad(dy):
            raise ValueError("boom")
        return a * 1.0, grad

    for use in ("gradient", "jacobian", "output_gradients"):
        with dtape.GradientTape() as t:
            t.watch(x)
            w = dtape.sin(boom(x * x)) * 2.0
        assert t.num_records() == 4 and t.nbytes() > 0
        with pytest.raises(ValueError):
            if use == "gradient":
                t.gradient(w, x)              # raises in the rule after two records were walked
            elif use == "jacobian":
                t.jacobian(w, x)
            else:
                t.gradient(w, x, output_gradients=[_c(1.0), _c(2.0)])  # bad: two for one target
        assert (t.num_records(), t.nbytes(), t._tape.records()) == (0, 0, []), use
        with pytest.raises(RuntimeError, match="persistent=True"):
            t.gradient(w, x)


@pytest.mark.parametrize("kwargs", [{"persistent": "yes"}, {"persistent": "no"}, {"persistent": 1},
                                    {"persistent": None}, {"watch_accessed_variables": "no"},
                                    {"watch_accessed_variables": 0}])
def test_gradient_tape_flags_that_are_not_bools_raise(kwargs):
    # persistent="no" was truthy: a persistent tape that kept its records, silently
    (name, value), = kwargs.items()
    with pytest.raises(TypeError, match=rf"GradientTape\({name}=...\) must be True or False, got "
                                        rf"{type(value).__name__}"):
        dtape.GradientTape(**kwargs)


def test_gradient_tape_flags_accept_numpy_bools():
    # np.bool_(True) (e.g. from a config array) was refused with a TypeError
    x = dtape.constant(3.0)
    with dtape.GradientTape(persistent=np.bool_(True)) as tape:
        tape.watch(x)
        y = x * x
    assert tape._persistent is True  # stored as a bool
    assert float(tape.gradient(y, x)) == 6.0 and float(tape.gradient(y, x)) == 6.0  # persistent: twice
    v = dtape.Variable(2.0)
    with dtape.GradientTape(persistent=np.bool_(False), watch_accessed_variables=np.bool_(False)) as tape:
        y = v * v
    assert tape.watched_variables() == () and tape.gradient(y, v) is None
    with pytest.raises(RuntimeError, match="persistent=True"):
        tape.gradient(y, v)


def test_gradient_nested_structures_result_has_sources_structure():
    a, b, c = _c([1.0, 2.0]), _c(3.0), _c([[0.5]])
    with dtape.GradientTape() as t:
        t.watch([a, b, c])
        targets = {"p": dtape.reduce_sum(a * b), "q": [dtape.reduce_sum(c * c), b * b]}
    g = t.gradient(targets, {"x": a, "rest": (b, [c])})
    assert set(g) == {"x", "rest"} and isinstance(g["rest"], tuple) and isinstance(g["rest"][1], list)
    _close(g["x"], torch.full((2,), 3.0, dtype=D))
    _close(g["rest"][0], torch.tensor(3.0 + 6.0, dtype=D))
    _close(g["rest"][1][0], torch.tensor([[1.0]], dtype=D))


def test_gradient_output_gradients_weight_targets():
    x = _c([1.0, 2.0])
    with dtape.GradientTape() as t:
        t.watch(x)
        y = x * x
        z = x * 3.0
    g = t.gradient([y, z], x, output_gradients=[_c([10.0, 100.0]), _c([1.0, -1.0])])
    _close(g, torch.tensor([20.0 + 3.0, 400.0 - 3.0], dtype=D))


def test_gradient_unconnected_none_and_zero():
    x, u = _c([1.0, 2.0]), _c([[1.0, 2.0, 3.0]])
    with dtape.GradientTape(persistent=True) as t:
        t.watch([x, u])
        y = x * 2.0
    assert t.gradient(y, [x, u])[1] is None
    z = t.gradient(y, [x, u], unconnected_gradients=dtape.UnconnectedGradients.ZERO)[1]
    _close(z, torch.zeros(1, 3, dtype=D))


def test_gradient_second_derivative_nested_tapes_cube_exact():
    x = _c([1.0, -2.0, 0.5])
    with dtape.GradientTape() as outer:
        outer.watch(x)
        with dtape.GradientTape() as inner:
            inner.watch(x)
            y = x ** 3
        g = inner.gradient(y, x)
    gg = outer.gradient(g, x)
    _close(g, 3 * x.torch() ** 2)
    _close(gg, 6 * x.torch())


def test_gradient_third_derivative_sin_exact():
    x = _c([0.3, 1.2])
    with dtape.GradientTape() as t3:
        t3.watch(x)
        with dtape.GradientTape() as t2:
            t2.watch(x)
            with dtape.GradientTape() as t1:
                t1.watch(x)
                y = dtape.sin(x)
            g1 = t1.gradient(y, x)
        g2 = t2.gradient(g1, x)
    g3 = t3.gradient(g2, x)
    _close(g2, -torch.sin(x.torch()))
    _close(g3, -torch.cos(x.torch()))


def test_gradient_integer_source_none_with_dtype_warning():
    i = dtape.constant([1, 2])
    with dtape.GradientTape() as t:
        with pytest.warns(UserWarning, match="int64"):
            t.watch(i)
        y = dtape.cast(i, D) * 2.0
    with pytest.warns(UserWarning, match="int64"):
        assert t.gradient(y, i) is None


def test_gradient_integer_target_none_with_dtype_warning():
    x = _c([1.0, 2.0])
    with dtape.GradientTape() as t:
        t.watch(x)
        y = dtape.cast(x, torch.int32)
    with pytest.warns(UserWarning, match="int32"):
        assert t.gradient(y, x) is None


def test_gradient_integer_target_in_list_keeps_output_gradients_aligned():
    x = _c([1.0, 2.0])
    with dtape.GradientTape() as t:
        t.watch(x)
        k = dtape.cast(x, torch.int64)
        y = x * x
    with pytest.warns(UserWarning, match="int64"):
        g = t.gradient([k, y], x, output_gradients=[None, _c([1.0, 10.0])])
    _close(g, torch.tensor([2.0, 40.0], dtype=D))


def test_watch_accessed_variables_false_ignores_reads():
    v, w = dtape.Variable(_c(2.0)), dtape.Variable(_c(5.0))
    with dtape.GradientTape(persistent=True, watch_accessed_variables=False) as t:
        t.watch(w)
        y = v * w
    assert t.watched_variables() == (w,)
    assert t.gradient(y, v) is None
    assert float(t.gradient(y, w)) == 2.0


def test_watched_variables_first_watch_order_no_duplicates():
    a, b, c = dtape.Variable(1.0), dtape.Variable(2.0), dtape.Variable(3.0)
    with dtape.GradientTape() as t:
        y = c * b + a * c + b * a
        t.watch([a, c])
    assert t.watched_variables() == (c, b, a)
    del y


def test_gradient_reentered_tape_keeps_records():
    x = _c(3.0)
    t = dtape.GradientTape(persistent=True)
    with t:
        t.watch(x)
        y = x * x
    with t:
        z = y * x
    assert float(t.gradient(z, x)) == 27.0


def test_gradient_broadcast_inputs_reduce_to_their_shapes():
    xt, yt = torch.randn(3, 1, dtype=D), torch.randn(4, dtype=D)
    x, y = _c(xt), _c(yt)
    with dtape.GradientTape() as t:
        t.watch([x, y])
        z = dtape.reduce_sum((x + y) * (x * y))
    gx, gy = t.gradient(z, [x, y])
    xr, yr = xt.clone().requires_grad_(), yt.clone().requires_grad_()
    ex, ey = torch.autograd.grad(((xr + yr) * (xr * yr)).sum(), [xr, yr])
    assert gx.shape == (3, 1) and gy.shape == (4,)
    _close(gx, ex)
    _close(gy, ey)


def test_gradient_torch_functions_on_dtape_tensors_recorded():
    torch.manual_seed(0)
    xt, wt = torch.randn(1, 2, 5, 5, dtype=D), torch.randn(3, 2, 3, 3, dtype=D)
    x, w = _c(xt), _c(wt)
    with dtape.GradientTape() as t:
        t.watch([x, w])
        y = torch.tanh(torch.nn.functional.conv2d(x, w, padding=1))
        loss = dtape.reduce_sum(y * y)
    assert isinstance(y, dtape.Tensor)
    gx, gw = t.gradient(loss, [x, w])
    xr, wr = xt.clone().requires_grad_(), wt.clone().requires_grad_()
    ex, ew = torch.autograd.grad((torch.tanh(torch.nn.functional.conv2d(xr, wr, padding=1)) ** 2).sum(), [xr, wr])
    _close(gx, ex)
    _close(gw, ew)


def test_gradient_wrong_shape_rule_raises_value_error_naming_op():
    class BadOp(dtape.tape.RecordOp):
        name = "BadShapeOp"

        def backward(self, dys, outputs, inputs, attrs, raw, needs):
            return (dys[0][:1],)

    x = _c([1.0, 2.0, 3.0])
    with dtape.GradientTape() as t:
        t.watch(x)
        y = dtape.Tensor(x.torch() * 2)
        dtape.tape.record(BadOp(), (x._id,), (x,), (y,), None)
    with pytest.raises(ValueError, match="BadShapeOp"):
        t.gradient(y, x)


def test_gradient_raw_torch_source_raises_value_error():
    x = _c(1.0)
    with dtape.GradientTape() as t:
        t.watch(x)
        y = x * x
    with pytest.raises(ValueError, match="dtape.Tensors or Variables"):
        t.gradient(y, torch.tensor(1.0))


# -- jacobians ------------------------------------------------------------------
def _f_jac(z):
    return torch.tanh(z) * z.sum() + z ** 2


def test_jacobian_matches_torch_autograd():
    at = torch.randn(2, 3, dtype=D)
    a = _c(at)
    with dtape.GradientTape(persistent=True) as t:
        t.watch(a)
        y = dtape.tanh(a) * dtape.reduce_sum(a) + a ** 2
    j = t.jacobian(y, a)
    assert j.shape == (2, 3, 2, 3)
    _close(j, torch.autograd.functional.jacobian(_f_jac, at))


def test_jacobian_nested_sources_and_non_persistent_tape():
    at, bt = torch.randn(3, dtype=D), torch.randn(2, dtype=D)
    a, b = _c(at), _c(bt)
    with dtape.GradientTape() as t:
        t.watch([a, b])
        y = dtape.sin(a)[:2] * b
    j = t.jacobian(y, {"a": a, "b": [b]})
    ea, eb = torch.autograd.functional.jacobian(lambda p, q: torch.sin(p)[:2] * q, (at, bt))
    _close(j["a"], ea)
    _close(j["b"][0], eb)


def test_jacobian_unconnected_zero_gives_zeros():
    a, u = _c([1.0, 2.0]), _c([3.0, 4.0, 5.0])
    with dtape.GradientTape(persistent=True) as t:
        t.watch([a, u])
        y = a * a
    assert t.jacobian(y, [a, u])[1] is None
    z = t.jacobian(y, [a, u], unconnected_gradients=dtape.UnconnectedGradients.ZERO)[1]
    _close(z, torch.zeros(2, 3, dtype=D))


def test_batch_jacobian_matches_torch_autograd_per_example():
    xt, wt = torch.randn(4, 3, dtype=D), torch.randn(3, 2, dtype=D)
    x, w = _c(xt), _c(wt)
    with dtape.GradientTape(persistent=True) as t:
        t.watch(x)
        y = dtape.tanh(x @ w)
    bj = t.batch_jacobian(y, x)
    assert bj.shape == (4, 2, 3)
    full = torch.autograd.functional.jacobian(lambda z: torch.tanh(z @ wt), xt)  # [4, 2, 4, 3]
    _close(bj, torch.stack([full[i, :, i, :] for i in range(4)]))


def test_batch_jacobian_mismatched_batch_raises_value_error():
    x = _c([[1.0, 2.0]])
    with dtape.GradientTape(persistent=True) as t:
        t.watch(x)
        y = dtape.concat([x, x], axis=0)
    with pytest.raises(ValueError, match="batch dimension"):
        t.batch_jacobian(y, x)


# -- functional forms -----------------------------------------------------------
def test_implicit_val_and_grad_variables_in_creation_order():
    b, a = dtape.Variable(_c(3.0)), dtape.Variable(_c(2.0))
    val, grads = backprop.implicit_val_and_grad(lambda x: a * a * x + b * x)(_c(4.0))
    assert float(val) == 2.0 * 2.0 * 4.0 + 3.0 * 4.0
    assert [v for _, v in grads] == [b, a]
    assert [float(g) for g, _ in grads] == [4.0, 16.0]


def test_implicit_grad_no_variables_raises_value_error():
    with pytest.raises(ValueError, match="No trainable variables"):
        backprop.implicit_grad(lambda x: x * 2.0)(_c(1.0))


def test_implicit_val_and_grad_none_result_raises_value_error():
    v = dtape.Variable(1.0)

    def f():
        v.read_value()

    with pytest.raises(ValueError, match="returns None"):
        backprop.implicit_val_and_grad(f)()


def test_gradients_function_params_by_name_and_position():
    def f(x, y):
        return x * x * y

    x, y = _c(3.0), _c(2.0)
    assert [float(g) for g in backprop.gradients_function(f)(x, y)] == [12.0, 9.0]
    assert [float(g) for g in backprop.gradients_function(f, params=["y"])(x, y)] == [9.0]
    assert [float(g) for g in backprop.gradients_function(f, params=[0])(x, y)] == [12.0]


def test_gradients_function_nested_second_derivative_exact():
    def f(x):
        return x ** 3

    df = backprop.gradients_function(f)
    ddf = backprop.gradients_function(lambda x: df(x)[0])
    assert float(ddf(_c(2.0))[0]) == 12.0


def test_gradients_function_same_tensor_twice_gets_both_gradients():
    x = _c(3.0)
    gx, gy = backprop.gradients_function(lambda a, b: a * b)(x, x)
    assert (float(gx), float(gy)) == (3.0, 3.0)


def test_val_and_grad_function_dy_scales_gradient():
    val, (g,) = backprop.val_and_grad_function(lambda x: dtape.sin(x))(_c(0.5), dy=_c(2.0))
    assert math.isclose(float(val), math.sin(0.5))
    assert math.isclose(float(g), 2.0 * math.cos(0.5))


def test_make_vjp_vector_jacobian_product_vs_torch():
    xt = torch.randn(3, dtype=D)
    result, vjp = backprop.make_vjp(lambda x: [dtape.exp(x), x * x])(_c(xt))
    _close(result[0], torch.exp(xt))
    dy = [torch.ones(3, dtype=D), torch.arange(3, dtype=D)]
    (g,) = vjp([_c(dy[0]), _c(dy[1])])
    _close(g, torch.exp(xt) * dy[0] + 2 * xt * dy[1])
    (g2,) = vjp()  # persistent: callable again
    _close(g2, torch.exp(xt) + 2 * xt)


@pytest.mark.parametrize("outer", [False, True], ids=["raw_walk", "recorded_walk"])
def test_an_in_place_write_to_a_saved_tensor_raises_naming_the_op(outer):
    # The rule would read the new values: 10x gradients without the check (torch raises the same way).
    x = _c([1.0, 2.0, 3.0])
    with dtape.GradientTape(persistent=True) as o:
        o.watch(x)
        with dtape.GradientTape() as t:
            t.watch(x)
            y = dtape.reduce_sum(x * x)
        x.torch().mul_(10)
        with pytest.raises(RuntimeError, match=r"op 'multiply'.*in-place"):
            if not outer:
                with o.stop_recording():
                    t.gradient(y, x)
            else:
                t.gradient(y, x)
        assert backprop.walk_info.last_raw is (not outer)


def test_an_in_place_write_to_a_saved_output_or_fallback_input_raises():
    x = _c([0.5, 1.0])
    with dtape.GradientTape(persistent=True) as t:
        t.watch(x)
        e = dtape.exp(x)  # the rule reads its output
        c = torch.lgamma(x)  # torch fallback: torch's graph keeps its input
    e.torch().add_(1.0)
    with pytest.raises(RuntimeError, match=r"op 'exp'"):
        t.gradient(e, x)
    x.torch().add_(1.0)
    with pytest.raises(RuntimeError, match=r"op 'lgamma'.*in-place"):
        t.gradient(c, x)


def test_an_in_place_write_to_a_tensor_no_record_keeps_is_allowed():
    x, b = _c([1.0, 2.0]), _c([3.0, 4.0])
    with dtape.GradientTape() as t:
        t.watch(x)
        y = x + b  # add keeps neither input: its gradient does not depend on their values
    x.torch().mul_(10)
    b.torch().mul_(10)
    assert t.gradient(y, x).torch().tolist() == [1.0, 1.0]


# Rules that use a fused torch kernel on the raw walk; a recorded walk must give the same bits.
_FUSED_RULES = {
    "tanh": (dtape.tanh, [(8, 4)]),
    "sigmoid": (dtape.sigmoid, [(8, 4)]),
    "gelu": (dtape.nn.gelu, [(8, 4)]),
    "gelu_tanh": (lambda a: dtape.nn.gelu(a, approximate=True), [(8, 4)]),
    "softmax": (dtape.nn.softmax, [(8, 5)]),
    "log_softmax": (dtape.nn.log_softmax, [(8, 5)]),
    "layer_norm": (dtape.nn.layer_norm, [(8, 6), (6,), (6,)]),
    "conv2d": (lambda a, w: dtape.nn.conv2d(a, w, 1, "SAME"), [(2, 6, 6, 3), (3, 3, 3, 4)]),
    "matmul_weight": (dtape.matmul, [(128, 16), (16, 10)]),  # a^T dy computed as (dy^T a)^T
    "xw_plus_b": (dtape.nn.xw_plus_b, [(128, 16), (16, 10), (10,)]),
}


def _walk_bits(f, values, dy, recorded):
    xs = [dtape.constant(v) for v in values]
    with dtape.GradientTape(persistent=True) as outer:
        for x in xs:
            if recorded:
                outer.watch(x)
        with dtape.GradientTape() as t:
            t.watch(xs)
            y = f(*xs)
        grads = t.gradient(y, xs, output_gradients=dtape.constant(dy))
        assert backprop.walk_info.last_raw is (not recorded)
    return [g.torch() for g in grads]


@pytest.mark.parametrize("name", sorted(_FUSED_RULES))
def test_a_recorded_walk_gives_the_raw_walks_bits(name):
    """float32 gradients, bit for bit: a walk's result must not depend on whether a tape records it
    (it did for these rules, whose recorded form was a composite formula: 20 of 20 draws differed)."""
    f, shapes = _FUSED_RULES[name]
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        values = [torch.randn(*s, generator=gen) for s in shapes]
        dy = torch.randn(f(*[dtape.constant(v) for v in values]).shape, generator=gen)
        raw, recorded = _walk_bits(f, values, dy, False), _walk_bits(f, values, dy, True)
        for a, b in zip(raw, recorded):
            assert torch.equal(a, b), f"{name}: recorded walk differs from the raw walk by {(a - b).abs().max()}"


def test_a_shared_variables_gradient_does_not_depend_on_another_threads_tape(fast_switching):
    """Another thread's tape that watches the variable makes this thread's walk recorded: same bits."""
    gen = torch.Generator().manual_seed(1)
    v = dtape.Variable(torch.randn(16, 8, generator=gen))
    x = dtape.constant(torch.randn(32, 16, generator=gen))

    def gradient():
        with dtape.GradientTape() as t:
            loss = dtape.reduce_sum(dtape.sigmoid(dtape.tanh(x @ v)))
        return t.gradient(loss, v).torch(), backprop.walk_info.last_raw

    alone, alone_raw = gradient()
    watching, done = threading.Event(), threading.Event()

    def other_thread():
        with dtape.GradientTape() as t:
            t.watch(v)
            watching.set()
            done.wait(10)

    thread = threading.Thread(target=other_thread)
    thread.start()
    try:
        assert watching.wait(10)
        shared, shared_raw = gradient()
    finally:
        done.set()
        thread.join(10)
    assert alone_raw and not shared_raw
    assert torch.equal(alone, shared)
