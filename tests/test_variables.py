"""Variables: creator stack, assignment, reads and their gradients."""
import pytest
import torch

import dtape

D = torch.float64


def test_variable_creator_scope_nested_innermost_runs_first():
    calls = []

    def creator(tag):
        def create(next_creator, **kwargs):
            calls.append(tag)
            return next_creator(**kwargs)
        return create

    with dtape.variable_creator_scope(creator("outer")):
        with dtape.variable_creator_scope(creator("inner")):
            v = dtape.Variable(1.0)
        w = dtape.Variable(2.0)
    u = dtape.Variable(3.0)
    assert calls == ["inner", "outer", "outer"]
    assert isinstance(v, dtape.Variable) and float(w) == 2.0 and float(u) == 3.0


def test_variable_creator_scope_can_replace_kwargs():
    def double_init(next_creator, **kwargs):
        kwargs["initial_value"] = kwargs["initial_value"] * 2
        kwargs["trainable"] = False
        return next_creator(**kwargs)

    with dtape.variable_creator_scope(double_init):
        v = dtape.Variable(torch.tensor([1.0, 2.0], dtype=D))
    torch.testing.assert_close(v.torch(), torch.tensor([2.0, 4.0], dtype=D))
    assert not v.trainable


def test_variable_creator_scope_restored_on_exception():
    def boom(next_creator, **kwargs):
        raise KeyError("nope")

    with pytest.raises(KeyError):
        with dtape.variable_creator_scope(boom):
            dtape.Variable(1.0)
    assert float(dtape.Variable(5.0)) == 5.0


def test_variable_assign_methods_return_variable_and_update():
    v = dtape.Variable(torch.tensor([1.0, 2.0], dtype=D))
    assert v.assign([3.0, 4.0]) is v
    assert v.assign_add(dtape.constant([1.0, 1.0], dtype=D)) is v
    assert v.assign_sub(torch.tensor([0.5, 0.5], dtype=D)) is v
    torch.testing.assert_close(v.torch(), torch.tensor([3.5, 4.5], dtype=D))
    assert v.dtype == D


def test_variable_read_before_assign_keeps_old_value():
    v = dtape.Variable(torch.tensor([1.0, 2.0], dtype=D))
    before = v.read_value()
    v.assign_add([10.0, 10.0])
    v.assign([7.0, 7.0])
    torch.testing.assert_close(before.torch(), torch.tensor([1.0, 2.0], dtype=D))
    torch.testing.assert_close(v.read_value().torch(), torch.tensor([7.0, 7.0], dtype=D))


def test_variable_assign_shape_mismatch_raises_value_error():
    v = dtape.Variable(torch.zeros(3, dtype=D), name="w")
    with pytest.raises(ValueError, match=r"'w'.*\(2,\).*\(3,\)"):
        v.assign(torch.zeros(2, dtype=D))


def test_variable_non_trainable_not_auto_watched():
    v = dtape.Variable(2.0, trainable=False)
    w = dtape.Variable(3.0)
    with dtape.GradientTape(persistent=True) as t:
        y = v * w
    assert t.watched_variables() == (w,)
    assert t.gradient(y, v) is None
    assert float(t.gradient(y, w)) == 2.0


def test_variable_non_trainable_explicit_watch_gets_gradient():
    v = dtape.Variable(2.0, trainable=False)
    with dtape.GradientTape() as t:
        t.watch(v)
        y = v * v * v
    assert float(t.gradient(y, v)) == 12.0


def test_variable_in_operators_gradient_vs_torch():
    vt = torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=D)
    v = dtape.Variable(vt)
    with dtape.GradientTape() as t:
        y = dtape.reduce_sum((2.0 - v) * v / 4.0 + v @ v + v ** 2 + (-v)[0] + abs(v)[1])
    vr = vt.clone().requires_grad_()
    expected, = torch.autograd.grad(((2.0 - vr) * vr / 4.0 + vr @ vr + vr ** 2 + (-vr)[0] + vr.abs()[1]).sum(), vr)
    torch.testing.assert_close(t.gradient(y, v).torch(), expected)


def test_variable_in_torch_functions_gradient_vs_torch():
    vt = torch.tensor([0.2, -0.7, 1.1], dtype=D)
    v = dtape.Variable(vt)
    with dtape.GradientTape() as t:
        y = torch.sum(torch.tanh(v) * torch.nn.functional.softplus(v))
    assert isinstance(y, dtape.Tensor)
    vr = vt.clone().requires_grad_()
    expected, = torch.autograd.grad(torch.sum(torch.tanh(vr) * torch.nn.functional.softplus(vr)), vr)
    torch.testing.assert_close(t.gradient(y, v).torch(), expected)


def test_variable_gradient_sums_over_reads():
    v = dtape.Variable(torch.tensor(3.0, dtype=D))
    with dtape.GradientTape() as t:
        y = v.read_value() * 2.0 + v.value() * v
    assert float(t.gradient(y, v)) == 2.0 + 6.0


def test_variable_initial_value_callable_and_dtype():
    v = dtape.Variable(lambda: torch.ones(2), dtype=D, name="ones")
    assert v.dtype == D and v.name == "ones" and v.shape == (2,)
    with pytest.raises(ValueError, match="initial_value"):
        dtape.Variable()
