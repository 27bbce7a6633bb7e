"""Registry completeness, the autograd fallback to second order, and TF semantics of ops."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dtape
from dtape.ops import REGISTRY

# The lists of API.md ("Ops": top level and dtape.nn), copied verbatim.
API_TOP_LEVEL = """add subtract multiply divide negative abs sign pow square sqrt
rsqrt exp log log1p sin cos tanh sigmoid maximum minimum clip_by_value
matmul einsum reduce_sum reduce_mean reduce_max reduce_min reduce_prod
reduce_logsumexp reshape transpose expand_dims squeeze concat stack split
tile broadcast_to gather gather_nd where cast one_hot zeros ones zeros_like
ones_like fill range identity stop_gradient""".split()
API_NN = """relu relu6 leaky_relu elu gelu silu softplus softmax log_softmax
sparse_softmax_cross_entropy_with_logits softmax_cross_entropy_with_logits
sigmoid_cross_entropy_with_logits l2_loss dropout conv2d bias_add moments embedding_lookup""".split()


# -- registry -----------------------------------------------------------------
def test_registry_ops_with_gradient_have_samples():
    missing = [op.name for op in REGISTRY if op.grad_fn is not None and not op.samples]
    assert not missing, f"ops with a gradient rule but no samples (add samples= to defop): {missing}"


@pytest.mark.parametrize("name", API_TOP_LEVEL)
def test_api_top_level_op_exists_callable(name):
    assert callable(getattr(dtape, name, None)), f"dtape.{name} (API.md) is missing"
    assert name in dtape.__all__


@pytest.mark.parametrize("name", API_NN)
def test_api_nn_op_exists_callable(name):
    assert callable(getattr(dtape.nn, name, None)), f"dtape.nn.{name} (API.md) is missing"
    assert name in dtape.nn.__all__


# -- the autograd fallback, to second order -----------------------------------
def _rand(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


FALLBACK_CASES = {
    "conv2d_nchw": (lambda x, w: F.conv2d(x, w, padding=1, stride=2), (_rand(2, 3, 5, 5), _rand(4, 3, 3, 3, seed=1))),
    "cumsum": (lambda x: torch.cumsum(x * x, dim=1), (_rand(3, 4),)),
    "softplus": (lambda x: F.softplus(x, beta=2.0), (_rand(3, 4),)),
}


def _second_order_dtape(fn, xs, cot, v):
    srcs = [dtape.constant(x) for x in xs]
    with dtape.GradientTape() as outer:
        outer.watch(srcs)
        with dtape.GradientTape() as inner:
            inner.watch(srcs)
            y = fn(*srcs)
        assert isinstance(y, dtape.Tensor)
        gs = inner.gradient(y, srcs, output_gradients=dtape.constant(cot))
        total = dtape.add_n([dtape.reduce_sum(g * dtape.constant(w)) for g, w in zip(gs, v)])
    return [g.torch() for g in gs], [g.torch() for g in outer.gradient(total, srcs)]


def _second_order_torch(fn, xs, cot, v):
    ts = [x.clone().requires_grad_() for x in xs]
    gs = torch.autograd.grad(fn(*ts), ts, cot, create_graph=True)
    total = sum(torch.sum(g * w) for g, w in zip(gs, v))
    return [g.detach() for g in gs], list(torch.autograd.grad(total, ts))


@pytest.mark.parametrize("name", sorted(FALLBACK_CASES))
def test_fallback_unregistered_torch_fn_second_order_matches_torch(name):
    fn, xs = FALLBACK_CASES[name]
    cot = _rand(*fn(*xs).shape, seed=5)
    v = [_rand(*x.shape, seed=7 + k) for k, x in enumerate(xs)]
    got1, got2 = _second_order_dtape(fn, xs, cot, v)
    want1, want2 = _second_order_torch(fn, xs, cot, v)
    for g, w in zip(got1 + got2, want1 + want2):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)


# -- TF semantics -------------------------------------------------------------
def _np_gather(params, indices, axis, batch_dims):
    """Reference tf.gather by explicit loops over the batch dimensions."""
    if batch_dims == 0:
        return np.take(params, indices, axis=axis)
    return np.stack([_np_gather(p, i, axis - 1, batch_dims - 1) for p, i in zip(params, indices)])


@pytest.mark.parametrize("axis,batch_dims", [(0, 0), (1, 0), (-1, 0), (1, 1), (2, 1), (2, 2), (3, 2)])
def test_gather_axis_batch_dims_matches_numpy_reference(axis, batch_dims):
    rng = np.random.default_rng(0)
    params = rng.standard_normal((2, 3, 4, 5))
    ishape = (2, 3, 2)[:batch_dims] + (2, 3)
    bound = params.shape[axis]
    indices = rng.integers(0, bound, size=ishape)
    got = dtape.gather(dtape.constant(params), dtape.constant(indices), axis=axis, batch_dims=batch_dims)
    np.testing.assert_allclose(got.numpy(), _np_gather(params, indices, axis % 4, batch_dims))


def test_gather_default_axis_is_batch_dims_matches_tf():
    params = np.arange(24.0).reshape(2, 3, 4)
    indices = np.array([[2, 0], [1, 1]])
    got = dtape.gather(params, indices, batch_dims=1)
    np.testing.assert_allclose(got.numpy(), _np_gather(params, indices, 1, 1))


@pytest.mark.parametrize("indices", [[[4, 0], [4, 2]], [[-1, 0], [4, -5]]], ids=["repeated", "negative"])
def test_gather_rows_gradient_matches_torch_autograd_first_and_second_order(indices):
    """Rows of a table (axis 0, an embedding): repeated rows accumulate, negative indices count from the end."""
    idx = torch.tensor(indices)
    p0 = torch.randn(5, 3, dtype=torch.float64)
    w = torch.randn(2, 2, 3, dtype=torch.float64)
    p = dtape.Variable(p0)
    with dtape.GradientTape() as outer:
        with dtape.GradientTape() as inner:
            loss = dtape.reduce_sum(dtape.gather(p, idx) ** 2 * w)
        g = inner.gradient(loss, p)
        gg = dtape.reduce_sum(g * g)
    h = outer.gradient(gg, p)
    tp = p0.clone().requires_grad_()
    (tg,) = torch.autograd.grad((tp[idx] ** 2 * w).sum(), tp, create_graph=True)
    (th,) = torch.autograd.grad((tg * tg).sum(), tp)
    torch.testing.assert_close(g.torch(), tg, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h.torch(), th, rtol=1e-12, atol=1e-12)


def test_gather_rows_gradient_with_ids_on_another_device_than_the_table():
    """The forward indexes a table with ids on another device (CPU ids, CUDA table); so must its gradient.
    index_add_ checks devices in its meta function, so a meta table stands in for CUDA here."""
    p = dtape.Variable(torch.zeros(5, 3, device="meta"))
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_sum(dtape.gather(p, torch.tensor([[1, -1], [1, 0]])))
    g = tape.gradient(loss, p).torch()
    assert g.device.type == "meta" and g.shape == (5, 3)


def test_gather_nd_batch_dims_matches_tf_example():
    params = np.arange(24.0).reshape(2, 3, 4)
    got = dtape.gather_nd(params, np.array([[[1, 2]], [[0, 3]]]), batch_dims=1)
    np.testing.assert_allclose(got.numpy(), [[params[0, 1, 2]], [params[1, 0, 3]]])
    np.testing.assert_allclose(dtape.gather_nd(params, np.array([[1, 2]])).numpy(), [params[1, 2]])


def test_split_sizes_with_minus_one_gives_tf_shapes():
    x = dtape.constant(np.arange(20.0).reshape(4, 5))
    parts = dtape.split(x, [1, -1, 2], axis=1)
    assert [tuple(p.shape) for p in parts] == [(4, 1), (4, 2), (4, 2)]
    assert [tuple(p.shape) for p in dtape.split(x, 2)] == [(2, 5), (2, 5)]
    with pytest.raises(ValueError):
        dtape.split(x, 3, axis=1)


def _conv_reference(x, w, stride, pads):
    """NHWC conv through explicit numpy padding and torch's NCHW conv."""
    (t, b), (left, r) = pads
    xp = np.pad(x, ((0, 0), (t, b), (left, r), (0, 0)))
    y = F.conv2d(torch.from_numpy(xp).permute(0, 3, 1, 2), torch.from_numpy(w).permute(3, 2, 0, 1), stride=stride)
    return y.permute(0, 2, 3, 1).numpy()


@pytest.mark.parametrize("hw,k,stride,pads", [((5, 5), 3, 1, ((1, 1), (1, 1))),
                                                ((6, 7), 3, 2, ((0, 1), (1, 1))),
                                                ((4, 4), 2, 1, ((0, 1), (0, 1)))])
def test_conv2d_same_padding_asymmetric_matches_tf_arithmetic(hw, k, stride, pads):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2,) + hw + (3,))
    w = rng.standard_normal((k, k, 3, 4))
    got = dtape.nn.conv2d(x, w, strides=[1, stride, stride, 1], padding="SAME")
    assert tuple(got.shape[1:3]) == tuple(-(-n // stride) for n in hw)
    np.testing.assert_allclose(got.numpy(), _conv_reference(x, w, stride, pads), rtol=1e-10)


def test_squeeze_axis_removes_only_named_dims():
    x = dtape.zeros([1, 2, 1, 3])
    assert tuple(dtape.squeeze(x).shape) == (2, 3)
    assert tuple(dtape.squeeze(x, axis=-2).shape) == (1, 2, 3)
    with pytest.raises(ValueError):
        dtape.squeeze(x, axis=1)


def test_reduce_negative_axis_matches_numpy():
    a = np.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_allclose(dtape.reduce_sum(a, axis=-1).numpy(), a.sum(-1))
    np.testing.assert_allclose(dtape.reduce_max(a, axis=(-1, 0), keepdims=True).numpy(),
                               a.max(axis=(2, 0), keepdims=True))


def test_sparse_softmax_xent_keywords_per_example_no_label_gradient():
    logits = dtape.constant(np.array([[1.0, 2.0, 0.5], [0.1, 0.2, 3.0]]))
    labels = dtape.constant([1, 0])
    with dtape.GradientTape(persistent=True) as tape:
        tape.watch(logits)
        loss = dtape.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
    assert tuple(loss.shape) == (2,)
    want = -F.log_softmax(logits.torch(), -1)[[0, 1], [1, 0]]
    np.testing.assert_allclose(loss.numpy(), want.numpy())
    with pytest.warns(UserWarning, match="int64"):
        assert tape.gradient(loss, labels) is None


def test_dropout_gradient_reuses_forward_mask():
    x = dtape.constant(np.ones((50, 40)))
    with dtape.GradientTape() as tape:
        tape.watch(x)
        y = dtape.nn.dropout(x, rate=0.25, seed=3)
    g = tape.gradient(y, x)
    np.testing.assert_allclose(g.numpy(), y.numpy())
    assert set(np.unique(y.numpy())) <= {0.0, 1 / 0.75}


def test_one_hot_out_of_range_is_off_value_and_axis_moves():
    got = dtape.one_hot(dtape.constant([0, 2, -1, 3]), 3, on_value=5.0, off_value=-1.0, axis=0)
    want = np.array([[5, -1, -1, -1], [-1, -1, -1, -1], [-1, 5, -1, -1]], dtype=np.float32)
    np.testing.assert_array_equal(got.numpy(), want)


def test_range_tf_forms_give_tf_values():
    np.testing.assert_array_equal(dtape.range(4).numpy(), [0, 1, 2, 3])
    np.testing.assert_array_equal(dtape.range(3, 18, 3).numpy(), [3, 6, 9, 12, 15])
    assert dtape.range(0.0, 1.0, 0.5).dtype == torch.float32


def test_reduce_max_min_over_empty_axis_give_tf_identity():
    x = dtape.zeros([0, 3])
    np.testing.assert_array_equal(dtape.reduce_max(x, axis=0).numpy(), [-np.inf] * 3)
    np.testing.assert_array_equal(dtape.reduce_min(x, axis=0, keepdims=True).numpy(), [[np.inf] * 3])
    assert tuple(dtape.reduce_max(x, axis=1).shape) == (0,)
    ints = dtape.constant(torch.zeros(2, 0, dtype=torch.int32))
    np.testing.assert_array_equal(dtape.reduce_min(ints, axis=1).numpy(), [2 ** 31 - 1] * 2)
