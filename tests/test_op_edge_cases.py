"""Ops at edge points, against torch.autograd in float64: torch's own meaning of torch calls, crossed
bounds, NaN and tied extremes, out-of-range axes, `out=`, and valid input that used to raise."""
import math

import pytest
import torch

import dtape

D = torch.float64
NAN = math.nan


def _grads(fn, *values):
    """(value, gradients of sum(fn(*xs))) through dtape, for float64 inputs."""
    xs = [dtape.constant(torch.tensor(v, dtype=D)) for v in values]
    with dtape.GradientTape() as tape:
        tape.watch(xs)
        y = fn(*xs)
        total = dtape.reduce_sum(y)
    gs = tape.gradient(total, xs)
    return y.torch(), [g.torch() for g in gs]


def _torch_grads(fn, *values):
    xs = [torch.tensor(v, dtype=D, requires_grad=True) for v in values]
    y = fn(*xs)
    return y.detach(), list(torch.autograd.grad(y.sum(), xs))


def _assert_same(got, want):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, equal_nan=True)


# -- torch calls keep torch's meaning ---------------------------------------------
@pytest.mark.parametrize("fn", [torch.sum, torch.mean])
@pytest.mark.parametrize("dim", [(), []])
@pytest.mark.parametrize("keepdim", [False, True])
def test_torch_sum_mean_empty_dim_reduces_every_axis_as_torch(fn, dim, keepdim):
    a = torch.arange(6, dtype=D).reshape(2, 3)
    got, got_g = _grads(lambda x: fn(x, dim=dim, keepdim=keepdim), a.tolist())
    want, want_g = _torch_grads(lambda x: fn(x, dim=dim, keepdim=keepdim), a.tolist())
    assert got.shape == want.shape
    _assert_same([got] + got_g, [want] + want_g)


def test_tf_reduce_sum_mean_empty_axis_reduce_nothing():
    x = dtape.constant(torch.arange(6, dtype=D).reshape(2, 3))
    assert torch.equal(dtape.reduce_sum(x, axis=[]).torch(), x.torch())
    assert torch.equal(dtape.reduce_mean(x, axis=()).torch(), x.torch())


# -- clip_by_value: torch.clamp's values and gradients ---------------------------
@pytest.mark.parametrize("t,lo,hi", [
    ([0.5, 2.0, -1.0], 1.0, 0.0),            # min > max: max everywhere, only max gets dy
    ([0.5, 2.0, -1.0, 1.0], 1.0, 1.0),       # min == max
    ([0.5, NAN, -1.0, 3.0], 0.0, 1.0),       # NaN in t: NaN value, no gradient from it
    ([[0.5, 2.0, -1.0], [0.1, 0.2, 0.3]], [1.0, 0.0, -2.0], [[0.0], [0.25]]),  # broadcast, mixed crossings
])
def test_clip_by_value_matches_torch_clamp_values_and_all_three_gradients(t, lo, hi):
    got, got_g = _grads(dtape.clip_by_value, t, lo, hi)
    want, want_g = _torch_grads(torch.clamp, t, lo, hi)
    _assert_same([got] + got_g, [want] + want_g)


def test_clip_by_value_crossed_bounds_issue_figures():
    _, (gt, glo, ghi) = _grads(dtape.clip_by_value, [0.5, 2.0, -1.0], 1.0, 0.0)
    assert glo.item() == 0.0 and ghi.item() == 3.0 and gt.tolist() == [0.0, 0.0, 0.0]


# -- reduce_max / reduce_min: NaN and ties ---------------------------------------
@pytest.mark.parametrize("ops", [(dtape.reduce_max, torch.amax), (dtape.reduce_min, torch.amin)], ids=["max", "min"])
@pytest.mark.parametrize("x,axis", [
    ([1.0, NAN, 0.5], None),                          # NaN: a NaN gradient (TF and torch)
    ([[1.0, NAN, 0.5], [2.0, 3.0, 1.0]], 1),          # only the slice holding the NaN
    ([1.0, 3.0, 3.0, 3.0, 1.0], None),                # three-way ties share dy equally
    ([[2.0, 2.0, 0.0], [5.0, 1.0, 5.0]], 1),          # two-way ties per row
    ([[2.0, 2.0], [2.0, 2.0]], None),                 # all tied
    ([[4.0, 1.0, 4.0], [4.0, 4.0, 1.0]], 0),          # ties down columns
])
def test_reduce_max_min_nan_and_ties_match_torch_amax(ops, x, axis):
    mine, ref = ops
    dim = () if axis is None else axis
    got, got_g = _grads(lambda v: mine(v, axis=axis), x)
    want, want_g = _torch_grads(lambda v: ref(v, dim=dim), x)
    _assert_same([got] + got_g, [want] + want_g)


def test_reduce_max_ties_gradient_is_an_equal_split():
    _, (g,) = _grads(dtape.reduce_max, [1.0, 3.0, 3.0, 3.0])
    assert g.tolist() == pytest.approx([0.0, 1 / 3, 1 / 3, 1 / 3], abs=1e-15)


# -- out-of-range axes raise ----------------------------------------------------
REDUCTIONS = ["reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_prod", "reduce_logsumexp"]


@pytest.mark.parametrize("name", REDUCTIONS)
@pytest.mark.parametrize("axis", [2, -3, (0, 2), [5]])
def test_reduce_out_of_range_axis_raises_naming_op_and_range(name, axis):
    x = dtape.constant(torch.ones(2, 3))
    with pytest.raises(ValueError, match=rf"{name}: axis -?\d is out of range for a tensor of rank 2.*\[-2, 1\]"):
        getattr(dtape, name)(x, axis=axis)
    with pytest.raises(IndexError):  # torch's exception type for the same mistake
        getattr(dtape, name)(x, axis=axis)


@pytest.mark.parametrize("name", REDUCTIONS)
def test_reduce_in_range_negative_axis_still_counts_from_the_end(name):
    a = torch.rand(2, 3, dtype=D) + 0.5
    x = dtape.constant(a)
    assert torch.allclose(getattr(dtape, name)(x, axis=-2).torch(), getattr(dtape, name)(x, axis=0).torch())


def test_moments_out_of_range_axis_raises():
    with pytest.raises(ValueError, match="moments: axis 5 is out of range"):
        dtape.nn.moments(dtape.constant(torch.ones(2, 3)), axes=[5])


def test_strategy_reduce_out_of_range_axis_raises_naming_the_call():
    strategy = dtape.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    v = strategy.run(lambda: dtape.constant(torch.ones(2, 3)))
    with pytest.raises(ValueError, match="strategy.reduce: axis 5 is out of range"):
        strategy.reduce("SUM", v, axis=5)
    assert strategy.reduce("SUM", v, axis=-1).torch().tolist() == [6.0, 6.0]


# -- out= is refused --------------------------------------------------------------
def test_torch_fallback_out_into_dtape_tensor_is_refused_and_leaves_it_unchanged():
    x = dtape.constant([1.0, 1.0, 1.0])
    with dtape.GradientTape() as tape:
        tape.watch(x)
        y = x * x  # the record saves x
        with pytest.raises(TypeError, match=r"torch\.cumsum\(\.\.\., out=\.\.\.\).*immutable.*returned value"):
            torch.cumsum(x, 0, out=x)
    assert x.torch().tolist() == [1.0, 1.0, 1.0]
    assert tape.gradient(y, x).torch().tolist() == [2.0, 2.0, 2.0]


def test_registered_op_out_is_refused_too():
    x = dtape.constant([1.0, 2.0])
    with pytest.raises(TypeError, match="out="):
        torch.add(x, x, out=dtape.constant([0.0, 0.0]))
