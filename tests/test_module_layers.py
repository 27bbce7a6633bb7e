"""dtape.Module variable discovery and dtape.layers, checked against torch.autograd in float64."""
import math

import numpy as np
import pytest
import torch

import dtape
from dtape import layers


class _Leaf(dtape.Module):
    def __init__(self, value, name=None):
        super().__init__(name=name)
        self.w = dtape.Variable(value, name=f"{self.name}/w")


class _Tree(dtape.Module):
    def __init__(self):
        super().__init__()
        self.a = dtape.Variable(1.0, name="a")
        self.frozen = dtape.Variable(2.0, trainable=False, name="frozen")
        self.items = [dtape.Variable(3.0, name="l0"), (dtape.Variable(4.0, name="t0"),)]
        self.table = {"z": dtape.Variable(5.0, name="dz"), "b": _Leaf(6.0, name="leaf")}
        self.again = self.a            # a duplicate: reported once
        self.text = "not a variable"
        self.tensor = dtape.constant(1.0)  # a tensor, not a variable


def test_module_variables_insertion_order_depth_first_no_duplicates():
    names = [v.name for v in _Tree().variables]
    assert names == ["a", "frozen", "l0", "t0", "dz", "leaf/w"]


def test_module_trainable_variables_excludes_non_trainable():
    m = _Tree()
    assert [v.name for v in m.trainable_variables] == ["a", "l0", "t0", "dz", "leaf/w"]
    assert [v.name for v in m.non_trainable_variables] == ["frozen"]


def test_module_submodules_and_default_names_unique():
    m = _Tree()
    assert [s.name for s in m.submodules] == ["leaf"]
    first, second = _Leaf(0.0), _Leaf(0.0)
    assert first.name != second.name and first.name.startswith("_leaf")


def test_module_cycle_terminates():
    m = _Leaf(1.0)
    m.parent = m
    m.peers = [m]
    assert len(m.variables) == 1


def test_module_finds_variables_of_any_class_given_the_tensor_protocol():
    class FakeMirrored:
        def __init__(self, components):
            self.values = tuple(components)
            self.trainable = True

        def _dtape_read(self):
            return self.values[0].read_value()

        def _handle(self):
            return self

    m = dtape.Module()
    m.v = FakeMirrored([dtape.Variable(1.0), dtape.Variable(1.0)])
    assert m.variables == ()  # duck typing alone does not make a variable: one test decides
    dtape.variables.install_tensor_protocol(FakeMirrored)
    assert m.variables[0] is m.v and len(m.variables) == 1
    assert float(m.v + 1.0) == 2.0 and bool(m.v == 1.0)  # Tensor's operator table, after a read


def test_module_without_super_init_still_has_name():
    class Bare(dtape.Module):
        def __init__(self):
            self.v = dtape.Variable(1.0)

    assert Bare().name.startswith("bare") and len(Bare().variables) == 1


def test_dense_lazy_build_creates_variables_on_first_call():
    layer = layers.Dense(3)
    assert layer.variables == ()
    y = layer(np.ones((2, 5), np.float32))
    assert y.shape == (2, 3)
    assert [tuple(v.shape) for v in layer.variables] == [(5, 3), (3,)]


def test_dense_input_dim_builds_at_construction():
    layer = layers.Dense(4, use_bias=False, input_dim=2)
    assert [tuple(v.shape) for v in layer.variables] == [(2, 4)]
    assert layer(dtape.ones([7, 3, 2])).shape == (7, 3, 4)


def test_dense_variables_go_through_creator_scope():
    made = []

    def creator(next_creator, **kwargs):
        made.append(kwargs["name"])
        return next_creator(**kwargs)

    with dtape.variable_creator_scope(creator):
        layer = layers.Dense(2, input_dim=3, name="probe")
    assert made == ["probe/kernel", "probe/bias"]
    assert layer.kernel.name == "probe/kernel"


def test_dense_seed_reproducible():
    a = layers.Dense(5, input_dim=4, seed=3)
    b = layers.Dense(5, input_dim=4, seed=3)
    c = layers.Dense(5, input_dim=4, seed=4)
    np.testing.assert_array_equal(a.kernel.numpy(), b.kernel.numpy())
    assert not np.array_equal(a.kernel.numpy(), c.kernel.numpy())


def _torch_oracle(x, params, fn):
    xs = [torch.tensor(p, dtype=torch.float64, requires_grad=True) for p in [x] + params]
    out = fn(*xs)
    grads = torch.autograd.grad(out, xs)
    return out.detach().numpy(), [g.numpy() for g in grads]


@pytest.mark.parametrize("activation,torch_fn", [
    (None, lambda y: y), ("relu", torch.relu), ("tanh", torch.tanh),
    ("softmax", lambda y: torch.softmax(y, -1)), ("sigmoid", torch.sigmoid)])
def test_dense_forward_and_gradients_match_torch_float64(activation, torch_fn):
    rng = np.random.default_rng(0)
    layer = layers.Dense(3, activation=activation, input_dim=4, dtype=torch.float64, seed=1)
    x = dtape.Variable(rng.normal(size=(5, 4)))
    weights = rng.normal(size=(3,))
    with dtape.GradientTape() as tape:
        out = dtape.reduce_sum(layer(x) * dtape.constant(weights))
    grads = tape.gradient(out, [x, layer.kernel, layer.bias])
    ref_out, ref_grads = _torch_oracle(x.numpy(), [layer.kernel.numpy(), layer.bias.numpy()],
                                       lambda x, k, b: (torch_fn(x @ k + b) * torch.tensor(weights)).sum())
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=1e-12)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-10, atol=1e-12)


def test_sequential_gradients_match_torch_float64():
    model = layers.Sequential([layers.Dense(6, "relu", input_dim=3, dtype=torch.float64, seed=0),
                               layers.Dense(2, dtype=torch.float64, seed=1)])
    x = np.random.default_rng(1).normal(size=(4, 3))
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_sum(model(x) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    params = [v.numpy() for v in model.trainable_variables]
    _, ref = _torch_oracle(x, params, lambda x, k1, b1, k2, b2: ((torch.relu(x @ k1 + b1) @ k2 + b2) ** 2).sum())
    for g, r in zip(grads, ref[1:]):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-10, atol=1e-12)


def test_dense_unknown_activation_raises_listing_choices():
    with pytest.raises(ValueError, match="relu"):
        layers.Dense(2, activation="swishy")


def test_conv2d_same_matches_torch_nchw():
    conv = layers.Conv2D(4, 3, strides=2, padding="same", dtype=torch.float64, seed=0)
    x = np.random.default_rng(2).normal(size=(2, 7, 7, 3))
    y = conv(x)
    assert y.shape == (2, 4, 4, 4)
    k = torch.tensor(conv.kernel.numpy()).permute(3, 2, 0, 1)
    xt = torch.nn.functional.pad(torch.tensor(x).permute(0, 3, 1, 2), [1, 1, 1, 1])
    ref = torch.nn.functional.conv2d(xt, k, stride=2).permute(0, 2, 3, 1)
    np.testing.assert_allclose(y.numpy(), ref.numpy(), rtol=1e-10, atol=1e-12)


def test_layer_normalization_matches_torch():
    ln = layers.LayerNormalization(epsilon=1e-5, dtype=torch.float64)
    x = np.random.default_rng(3).normal(size=(3, 8))
    ref = torch.nn.functional.layer_norm(torch.tensor(x), (8,), eps=1e-5)
    np.testing.assert_allclose(ln(x).numpy(), ref.numpy(), rtol=1e-8, atol=1e-10)
    assert [v.name.split("/")[-1] for v in ln.variables] == ["gamma", "beta"]


def test_embedding_gradient_accumulates_repeated_ids():
    emb = layers.Embedding(5, 2, seed=0)
    with dtape.GradientTape() as tape:
        out = dtape.reduce_sum(emb([[1, 1], [3, 1]]))
    assert out.shape == ()
    np.testing.assert_array_equal(tape.gradient(out, emb.embeddings).numpy()[:, 0], [0, 3, 0, 1, 0])


def test_dropout_identity_in_inference_scaled_in_training():
    drop = layers.Dropout(0.5, seed=0)
    x = dtape.ones([1000])
    np.testing.assert_array_equal(drop(x).numpy(), x.numpy())
    y = drop(x, training=True).numpy()
    assert set(np.unique(y)) <= {0.0, 2.0} and 300 < (y == 0).sum() < 700


def test_sequential_passes_training_to_dropout():
    model = layers.Sequential([layers.Dropout(0.9, seed=0)])
    assert (model(dtape.ones([100]), training=True).numpy() == 0).sum() > 50
    assert (model(dtape.ones([100])).numpy() == 1).all()


def test_layer_normalization_input_dim_builds_at_construction():
    ln = layers.LayerNormalization(input_dim=6)
    assert [tuple(v.shape) for v in ln.variables] == [(6,), (6,)]


def test_add_weight_passes_a_callable_so_the_value_is_drawn_where_the_variable_is_made():
    seen = []

    def creator(next_creator, **kwargs):
        seen.append(callable(kwargs["initial_value"]))
        torch.manual_seed(4)  # the draw happens after this point, inside the creator
        return next_creator(**kwargs)
    with dtape.variable_creator_scope(creator):
        layer = layers.Dense(3, input_dim=2)
    torch.manual_seed(4)
    expected = (torch.rand(2, 3) * 2 - 1) * math.sqrt(6.0 / 5)
    assert seen == [True, True]
    np.testing.assert_allclose(layer.kernel.numpy(), expected.numpy(), rtol=1e-6)


def test_dropout_without_seed_draws_from_the_threads_generator():
    drop = layers.Dropout(0.5)
    x = dtape.ones([256])
    with dtape.random.generator_scope(torch.Generator().manual_seed(3)):
        a = drop(x, training=True).numpy()
    with dtape.random.generator_scope(torch.Generator().manual_seed(3)):
        b = drop(x, training=True).numpy()
    np.testing.assert_array_equal(a, b)
    assert set(np.unique(a)) == {0.0, 2.0}


def test_seeded_dropout_outside_replicas_is_a_stateful_stream_of_its_seed():
    a, b = layers.Dropout(0.5, seed=9), layers.Dropout(0.5, seed=9)
    x = dtape.ones([128])
    first, second = a(x, training=True).numpy(), a(x, training=True).numpy()
    assert not np.array_equal(first, second)  # the stream advances
    np.testing.assert_array_equal(first, b(x, training=True).numpy())
