"""Ops at edge points, against torch.autograd in float64: torch's own meaning of torch calls, crossed
bounds, NaN and tied extremes, out-of-range axes, `out=`, and valid input that used to raise."""
import math

import numpy as np
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


X23 = [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


@pytest.mark.parametrize("call", [
    lambda x: dtape.gather(x, [0], axis=2), lambda x: dtape.gather(x, [0], axis=-3),
    lambda x: dtape.concat([x, x], axis=2), lambda x: dtape.concat([x, x], axis=-3),
    lambda x: dtape.stack([x, x], axis=3), lambda x: dtape.stack([x, x], axis=-4),
    lambda x: dtape.split(x, 1, axis=2), lambda x: dtape.split(x, 2, axis=-3),
    lambda x: dtape.expand_dims(x, 3), lambda x: dtape.expand_dims(x, -4),
    lambda x: dtape.squeeze(dtape.reshape(x, [1, 6]), 2), lambda x: dtape.squeeze(dtape.reshape(x, [1, 6]), -3),
    lambda x: dtape.nn.softmax(x, axis=2), lambda x: dtape.nn.log_softmax(x, axis=-3),
    lambda x: dtape.argmax(x, axis=2), lambda x: dtape.argmin(x, axis=-3),
    lambda x: dtape.one_hot(dtape.constant([0, 1]), 3, axis=2),
    lambda x: dtape.one_hot(dtape.constant([0, 1]), 3, axis=-2),
    lambda x: dtape.gather(x, dtape.constant([[0], [1]]), axis=1, batch_dims=-3),
    lambda x: dtape.gather(x, dtape.constant([[0], [1]]), axis=1, batch_dims=3),
], ids=["gather2", "gather-3", "concat2", "concat-3", "stack3", "stack-4", "split2", "split-3", "expand3",
        "expand-4", "squeeze2", "squeeze-3", "softmax2", "log_softmax-3", "argmax2", "argmin-3", "one_hot2",
        "one_hot-2", "batch_dims-3", "batch_dims3"])
def test_axis_taking_ops_refuse_an_out_of_range_axis_instead_of_wrapping(call):
    # gather took axis=2 as axis 0 ([[0, 1, 2]]) and axis=-3 as axis 1 ([[0], [3]]); TF raises
    x = dtape.constant(X23)
    with pytest.raises(dtape.ops.math_ops.AxisError, match=r"is out of range for (a tensor|indices) of rank \d"):
        call(x)


def test_gather_negative_batch_dims_counts_from_the_indices_rank_as_tf():
    # TF adds rank(indices): -1 on rank-2 indices is 1 (it was read as 2, past the indices' batch)
    x = dtape.constant(X23)
    idx = dtape.constant([[2, 0], [1, 1]])
    want = dtape.gather(x, idx, axis=1, batch_dims=1).torch()
    assert want.tolist() == [[2.0, 0.0], [4.0, 4.0]]
    assert torch.equal(dtape.gather(x, idx, axis=1, batch_dims=-1).torch(), want)


@pytest.mark.parametrize("perm, match", [([0, 0], "not a permutation"), ([1, -1], "not a permutation"),
                                         ([0], "1 entries for a tensor of rank 2"), ([0, 2], "out of range")])
def test_transpose_perm_must_be_a_permutation(perm, match):
    with pytest.raises(ValueError, match=match):
        dtape.transpose(dtape.constant(X23), perm)


@pytest.mark.parametrize("name", REDUCTIONS + ["moments"])
@pytest.mark.parametrize("axis", [0, -1, [0]])
def test_reduce_any_axis_of_a_scalar_raises_as_tf(name, axis):
    # sum/mean/prod/logsumexp returned the scalar, max/min raised a bare IndexError
    fn = dtape.nn.moments if name == "moments" else getattr(dtape, name)
    with pytest.raises(dtape.ops.math_ops.AxisError,
                       match=rf"{name}: axis -?[01] is out of range for a tensor of rank 0; a 0-d tensor has no axis"):
        fn(dtape.constant(3.0), axis)
    assert fn(dtape.constant(3.0), None if name != "moments" else []) is not None


@pytest.mark.parametrize("name", REDUCTIONS + ["moments"])
@pytest.mark.parametrize("axis", [[0, 0], [1, -1], (-2, 0, 1)])
def test_reduce_duplicate_axes_raise_one_message(name, axis):
    # reduce_prod computed silently, the others raised torch's "dim 1 appears multiple times"
    fn = dtape.nn.moments if name == "moments" else getattr(dtape, name)
    with pytest.raises(ValueError, match=rf"{name}: axes .* contain a duplicate dimension"):
        fn(dtape.constant(X23), axis)


def _axis_spellings(axis):
    spellings = [np.int64(axis) if isinstance(axis, int) else np.array(axis, dtype=np.int32),
                 dtape.constant(axis), torch.tensor(axis), dtape.Variable(axis)]
    return spellings + ([[np.int32(a) for a in axis]] if isinstance(axis, list) else [])


@pytest.mark.parametrize("name", REDUCTIONS + ["moments"])
@pytest.mark.parametrize("axis", [1, -2, [0, 1], [1]])
def test_reduce_axis_as_numpy_int_or_integer_tensor_matches_the_int(name, axis):
    # np.int64 and dtape.constant raised TypeError, dtape.constant([0, 1]) a RecursionError
    fn = dtape.nn.moments if name == "moments" else getattr(dtape, name)
    a = torch.tensor(X23, dtype=D) + 0.5
    want = _grads(lambda x: fn(x, axis)[0] if name == "moments" else fn(x, axis), a.tolist())
    for spelled in _axis_spellings(axis):
        got = _grads(lambda x: fn(x, spelled)[0] if name == "moments" else fn(x, spelled), a.tolist())
        _assert_same([got[0]] + got[1], [want[0]] + want[1])


@pytest.mark.parametrize("call", [
    lambda x, ax: dtape.gather(x, [2, 0], axis=ax), lambda x, ax: dtape.concat([x, x], axis=ax),
    lambda x, ax: dtape.stack([x, x], axis=ax), lambda x, ax: dtape.split(x, [1, 2], axis=ax)[1],
    lambda x, ax: dtape.expand_dims(x, ax) * 2.0, lambda x, ax: dtape.nn.softmax(x, axis=ax),
    lambda x, ax: dtape.nn.log_softmax(x, axis=ax), lambda x, ax: dtape.transpose(x, [ax, 0]),
    lambda x, ax: dtape.squeeze(dtape.expand_dims(x, 2), ax + 1) * 2.0,
], ids=["gather", "concat", "stack", "split", "expand_dims", "softmax", "log_softmax", "transpose", "squeeze"])
def test_axis_taking_ops_accept_numpy_ints_and_integer_tensors(call):
    want = _grads(lambda x: call(x, 1), X23)
    for spelled in _axis_spellings(1):
        got = _grads(lambda x: call(x, spelled), X23)
        _assert_same([got[0]] + got[1], [want[0]] + want[1])


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


# -- valid input that used to raise ------------------------------------------------
@pytest.mark.parametrize("data_format", ["NHWC", "NCHW"])
@pytest.mark.parametrize("c_in,k,strides,padding", [
    (2, 2, 1, "SAME"), (3, 3, 1, "SAME"), (3, 3, 2, "VALID"), (2, 3, 2, "SAME"), (4, (2, 3), 1, "VALID")])
def test_conv2d_one_output_channel_gradients_match_torch_autograd(data_format, c_in, k, strides, padding):
    kh, kw = (k, k) if isinstance(k, int) else k
    gen = torch.Generator().manual_seed(c_in * 10 + kh)
    x0 = torch.randn((2, 6, 5, c_in) if data_format == "NHWC" else (2, c_in, 6, 5), generator=gen, dtype=D)
    w0 = torch.randn(kh, kw, c_in, 1, generator=gen, dtype=D)
    x, w = dtape.constant(x0), dtape.constant(w0)
    tx, tw = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    nchw = tx.permute(0, 3, 1, 2) if data_format == "NHWC" else tx
    pads = dtape.ops.nn_ops._pads(tuple(nchw.shape[2:]), (kh, kw), (strides, strides), (1, 1), padding, "NCHW")
    ow = tw.permute(3, 2, 0, 1).contiguous()  # torch's own kernel refuses this view's gradient too
    ty = torch.nn.functional.conv2d(torch.nn.functional.pad(nchw, pads), ow, stride=strides)
    ty = ty.permute(0, 2, 3, 1) if data_format == "NHWC" else ty
    dy = torch.randn(ty.shape, generator=gen, dtype=D)
    want = torch.autograd.grad((ty * dy).sum(), [tx, tw])
    for recorded in (False, True):  # the raw walk uses torch's kernel, a recorded walk composite ops
        with dtape.GradientTape() as tape:
            tape.watch([x, w])
            y = dtape.nn.conv2d(x, w, strides, padding, data_format=data_format)
        if recorded:
            with dtape.GradientTape() as other:
                other.watch(dtape.constant(0.0))
                got = tape.gradient(y, [x, w], output_gradients=dtape.constant(dy))
        else:
            got = tape.gradient(y, [x, w], output_gradients=dtape.constant(dy))
        _assert_same([g.torch() for g in got], want)


F_ = torch.nn.functional
THIRD_ORDER_FNS = {
    "cumsum": lambda x: torch.cumsum(x, 0), "flip": lambda x: torch.flip(x, [0]),
    "pad": lambda x: F_.pad(x, (1, 2)), "view": lambda x: x.view(-1), "T": lambda x: x.T,
    "linear": lambda x: F_.linear(x, torch.linspace(-1, 1, 6, dtype=D).reshape(2, 3)),
    "layer_norm": lambda x: F_.layer_norm(x, (3,)),
}


def _third_order(fn, x, ns):
    """d/dx of <d/dx |d/dx sum(f^3)|^2, sin x>, with `ns` the namespace (torch or dtape) of the glue."""
    def total(v):
        y = fn(v)
        return (y * y * y).sum() if ns is torch else dtape.reduce_sum(y * y * y)

    if ns is torch:
        x = x.clone().requires_grad_()
        (g1,) = torch.autograd.grad(total(x), x, create_graph=True)
        (g2,) = torch.autograd.grad((g1 * g1).sum(), x, create_graph=True)
        (g3,) = torch.autograd.grad((g2 * torch.sin(x)).sum(), x)
        return g3
    x = dtape.constant(x)
    with dtape.GradientTape() as t3:
        t3.watch(x)
        with dtape.GradientTape() as t2:
            t2.watch(x)
            with dtape.GradientTape() as t1:
                t1.watch(x)
                y = total(x)
            g1 = t1.gradient(y, x)
            s1 = dtape.reduce_sum(g1 * g1)
        g2 = t2.gradient(s1, x)
        s2 = dtape.reduce_sum(g2 * dtape.sin(x))
    return t3.gradient(s2, x).torch()


@pytest.mark.parametrize("name", sorted(THIRD_ORDER_FNS))
def test_fallback_third_order_where_a_lower_order_ignores_the_input_matches_torch(name):
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(5), dtype=D)
    got = _third_order(THIRD_ORDER_FNS[name], x, dtape)
    want = _third_order(THIRD_ORDER_FNS[name], x, torch)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("fn,alpha", [(torch.add, 2.5), (torch.sub, 2.5), (torch.add, 1), (torch.subtract, -3)])
def test_torch_add_sub_alpha_values_and_gradients_match_torch(fn, alpha):
    a, b = [0.5, -1.0, 2.0], [[1.5], [2.0]]
    got, got_g = _grads(lambda x, y: fn(x, y, alpha=alpha), a, b)
    want, want_g = _torch_grads(lambda x, y: fn(x, y, alpha=alpha), a, b)
    _assert_same([got] + got_g, [want] + want_g)


@pytest.mark.parametrize("rounding_mode", [None, "floor", "trunc"])
def test_torch_div_rounding_mode_values_and_gradients_match_torch(rounding_mode):
    a, b = [7.0, -7.0, 2.5], [2.0, 2.0, -0.75]
    got, got_g = _grads(lambda x, y: torch.div(x, y, rounding_mode=rounding_mode), a, b)
    want, want_g = _torch_grads(lambda x, y: torch.div(x, y, rounding_mode=rounding_mode), a, b)
    _assert_same([got] + got_g, [want] + want_g)


@pytest.mark.parametrize("equation,shapes", [("ij,jk", [(2, 3), (3, 4)]), ("ba,ac", [(2, 3), (3, 4)]),
                                              ("i,i", [(3,), (3,)]), ("ij", [(2, 3)]), ("ji", [(2, 3)]),
                                              ("ab,cA", [(2, 3), (4, 5)])])
def test_einsum_implicit_output_values_and_gradients_match_torch(equation, shapes):
    gen = torch.Generator().manual_seed(1)
    vals = [torch.randn(s, generator=gen, dtype=D).tolist() for s in shapes]
    for fn in (lambda *xs: torch.einsum(equation, *xs), lambda *xs: dtape.einsum(equation, *xs)):
        got, got_g = _grads(fn, *vals)
        want, want_g = _torch_grads(lambda *xs: torch.einsum(equation, *xs), *vals)
        assert got.shape == want.shape
        _assert_same([got] + got_g, [want] + want_g)


@pytest.mark.parametrize("equation,shapes", [
    ("...ij,jk->...ik", [(2, 5, 3, 4), (4, 2)]), ("...ij,...jk", [(2, 1, 3, 4), (5, 4, 2)]),
    ("i...->...", [(3, 2, 4)]), ("...,...->...", [(2, 1), (3,)]), ("ii->i", [(3, 3)]), ("ii->", [(3, 3)]),
    ("bii->bi", [(2, 3, 3)]), ("iij,jk->ik", [(3, 3, 2), (2, 4)]), ("ij,ii->j", [(3, 2), (3, 3)]),
    ("iji->j", [(3, 2, 3)]), ("xyi,xyi->xy", [(5, 1, 2), (5, 3, 2)]),
])
def test_einsum_ellipsis_repeated_and_broadcast_indices_match_torch_to_second_order(equation, shapes):
    # the gradient raised NotImplementedError for an ellipsis or an index repeated within one operand
    gen = torch.Generator().manual_seed(2)
    vals = [torch.randn(s, generator=gen, dtype=D) for s in shapes]
    tx = [v.clone().requires_grad_() for v in vals]
    y = torch.einsum(equation, *tx)
    w = torch.randn(y.shape, generator=gen, dtype=D)
    g1 = torch.autograd.grad((y * w).sum(), tx, create_graph=True)
    g2 = torch.autograd.grad(sum((g * g * torch.tanh(x)).sum() for g, x in zip(g1, tx)), tx)
    xs = [dtape.Variable(v) for v in vals]
    with dtape.GradientTape() as outer:
        with dtape.GradientTape() as inner:
            got = dtape.einsum(equation, *xs)
            total = dtape.reduce_sum(got * dtape.constant(w))
        d1 = inner.gradient(total, xs)
        second = sum(dtape.reduce_sum(g * g * dtape.tanh(x)) for g, x in zip(d1, xs))
    d2 = outer.gradient(second, xs)
    _assert_same([t.torch() for t in [got, *d1, *d2]], [t.detach() for t in [y, *g1, *g2]])


@pytest.mark.parametrize("args", [
    lambda a, b: (a, [0, 1], b, [1, 2]), lambda a, b: (a, [0, 1], b, [1, 2], [2, 0]),
    lambda a, b: (a, [Ellipsis, 1], b, [1, 2], [Ellipsis, 2]), lambda a, b: (a, [0, 27], b, [27, 1]),
], ids=["implicit", "explicit", "ellipsis", "upper-case"])
def test_torch_einsum_sublist_form_values_and_gradients_match_torch(args):
    # torch.einsum(a, [0, 1], b, [1, 2]) raised AttributeError "'Tensor' object has no attribute 'replace'"
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(2, 3, generator=gen, dtype=D).tolist(), torch.randn(3, 4, generator=gen, dtype=D).tolist()
    got, got_g = _grads(lambda x, y: torch.einsum(*args(x, y)), a, b)
    want, want_g = _torch_grads(lambda x, y: torch.einsum(*args(x, y)), a, b)
    assert got.shape == want.shape
    _assert_same([got] + got_g, [want] + want_g)


@pytest.mark.parametrize("key", [[], (slice(None), [])])
def test_getitem_empty_list_selects_nothing_as_torch(key):
    a = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    got, got_g = _grads(lambda x: x[key], a)
    want, want_g = _torch_grads(lambda x: x[key], a)
    assert got.shape == want.shape
    _assert_same([got] + got_g, [want] + want_g)


@pytest.mark.parametrize("y", [0, 0.0, [0.0, 0.0, 0.0], 2.0, [0.0, 2.0, 1.0]])
def test_pow_zero_exponent_at_zero_has_torch_gradient_to_third_order(y):
    x0 = torch.tensor([0.0, 1.5, 0.0], dtype=D)
    tensor_y = isinstance(y, list)
    yt = torch.tensor(y, dtype=D) if tensor_y else y

    def fn(x):  # + x: a constant x ** 0 alone would leave torch's own higher orders without a graph
        return torch.pow(x, dtape.constant(yt) if tensor_y and not isinstance(x, torch.Tensor) else yt) + x
    first = _grads(lambda x: x ** (dtape.constant(yt) if tensor_y else yt), x0.tolist())[1][0]
    want_first = _torch_grads(lambda x: x ** yt, x0.tolist())[1][0]
    _assert_same([first], [want_first])
    assert torch.isfinite(first).all()
    got3 = _third_order(fn, x0, dtape)
    # elementwise, so element i needs only y_i: torch's scalar-exponent path is the reference (with a
    # tensor exponent torch's own third order is NaN at x = 0, where the exact value is finite)
    ys = yt.tolist() if tensor_y else [yt] * 3
    want3 = torch.stack([_third_order(lambda x, e=e: torch.pow(x, e) + x, x0, torch)[i] for i, e in enumerate(ys)])
    torch.testing.assert_close(got3, want3, rtol=1e-10, atol=1e-10)
