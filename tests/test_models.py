"""Keras's Model: functional (Input, symbolic layer calls, several inputs/outputs, shared layers, nesting,
masks, training) against the same computation by hand in torch float64 (values and gradients);
subclassed (build, summary, variable order across processes); Sequential.add building at once; TF's
functional-API guide summary numbers; a functional model under MirroredStrategy equals one device."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import dtape
from dtape import keras
from tests._interleave import interleaved
from tests._strategies import mirrored

pytestmark = pytest.mark.usefixtures("closes_strategies")

L = keras.layers
F64 = torch.float64
RNG = np.random.default_rng(3)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Combine(L.Layer):
    """x * y + x over nested inputs (a two-input layer without weights)."""

    def __init__(self):
        super().__init__(dtype=F64)

    def call(self, inputs):
        x, y = inputs
        return x * y + x


def _t(var):
    return torch.tensor(var.numpy(), requires_grad=True)


def _two_in_two_out():
    a, b = keras.Input(shape=(4,), dtype="float64", name="a"), keras.Input(shape=(3,), dtype="float64", name="b")
    ha = L.Dense(5, activation="tanh", seed=1, dtype=F64)(a)
    hb = L.Dense(5, seed=2, dtype=F64)(b)
    joined = Combine()([ha, hb])
    out1 = L.Dense(2, seed=3, dtype=F64, name="out1")(joined)
    out2 = L.Dense(1, seed=4, dtype=F64, name="out2")(ha)
    return keras.Model([a, b], [out1, out2])


def test_functional_two_inputs_two_outputs_equals_the_computation_by_hand():
    model = _two_in_two_out()
    xa, xb = RNG.normal(size=(6, 4)), RNG.normal(size=(6, 3))
    r1, r2 = RNG.normal(size=(6, 2)), RNG.normal(size=(6, 1))
    with dtape.GradientTape() as tape:
        y1, y2 = model([dtape.constant(xa), dtape.constant(xb)])
        loss = dtape.reduce_sum(y1 * dtape.constant(r1)) + dtape.reduce_sum(y2 * dtape.constant(r2))
    grads = tape.gradient(loss, model.trainable_variables)

    ka, ba, kb, bb, k1, b1, k2, b2 = [_t(v) for v in model.trainable_variables]
    ha = torch.tanh(torch.tensor(xa) @ ka + ba)
    hb = torch.tensor(xb) @ kb + bb
    ref1, ref2 = (ha * hb + ha) @ k1 + b1, ha @ k2 + b2
    ((ref1 * torch.tensor(r1)).sum() + (ref2 * torch.tensor(r2)).sum()).backward()
    np.testing.assert_allclose(y1.numpy(), ref1.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(y2.numpy(), ref2.detach().numpy(), rtol=1e-12)
    for g, ref in zip(grads, (ka, ba, kb, bb, k1, b1, k2, b2)):
        np.testing.assert_allclose(g.numpy(), ref.grad.numpy(), rtol=1e-10, atol=1e-12)
    # the same inputs by name give the same outputs; the structure and shapes are Keras's
    by_name = model({"b": xb, "a": xa})
    np.testing.assert_array_equal(by_name[0].numpy(), y1.numpy())
    assert [layer.name for layer in model.layers[:2]] == ["a", "b"]
    assert model.output_shape == [(None, 2), (None, 1)]
    assert [t.shape for t in model.inputs] == [(None, 4), (None, 3)]


def test_shared_layer_is_one_set_of_variables_with_gradients_from_both_uses():
    shared = L.Dense(3, seed=5, dtype=F64)
    a, b = keras.Input(shape=(2,), dtype="float64"), keras.Input(shape=(2,), dtype="float64")
    model = keras.Model({"left": a, "right": b}, Combine()([shared(a), shared(b)]))
    assert len(model.trainable_variables) == 2 and model.count_params() == 9
    assert [layer for layer in model.layers if layer is shared] == [shared]
    shapes = [row[1] for row in _rows(model.summary(print_fn=lambda s: None))]
    assert shapes == ["(None, 2)", "(None, 2)", "(None, 3)", "(None, 3)"]
    seq = keras.Input(shape=(None, 2), dtype="float64")
    other = keras.Model([a, seq], [shared(a), shared(seq)])
    other([np.ones((1, 2)), np.ones((1, 5, 2))])  # a real call does not change the graph's shapes
    assert [row[1] for row in _rows(other.summary(print_fn=lambda s: None))][-1] == "multiple"
    xa, xb = RNG.normal(size=(4, 2)), RNG.normal(size=(4, 2))
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_sum(model({"left": xa, "right": xb}))
    gk, gb = tape.gradient(loss, [shared.kernel, shared.bias])
    k, bias = _t(shared.kernel), _t(shared.bias)
    left, right = torch.tensor(xa) @ k + bias, torch.tensor(xb) @ k + bias
    (left * right + left).sum().backward()
    np.testing.assert_allclose(loss.numpy(), (left * right + left).sum().item(), rtol=1e-12)
    np.testing.assert_allclose(gk.numpy(), k.grad.numpy(), rtol=1e-10)
    np.testing.assert_allclose(gb.numpy(), bias.grad.numpy(), rtol=1e-10)


def test_functional_model_nested_in_a_functional_and_a_subclassed_model():
    inner_in = keras.Input(shape=(3,), dtype="float64")
    inner = keras.Model(inner_in, L.Dense(4, activation="relu", seed=6, dtype=F64)(inner_in), name="inner")
    outer_in = keras.Input(shape=(3,), dtype="float64")
    outer = keras.Model(outer_in, L.Dense(1, seed=7, dtype=F64)(inner(outer_in)))
    assert outer.layers[1] is inner and len(outer.trainable_variables) == 4
    assert outer.count_params() == inner.count_params() + 5 == 21

    class Head(keras.Model):
        def __init__(self):
            super().__init__(dtype=F64)
            self.body = inner
            self.head = L.Dense(2, seed=8, dtype=F64)

        def call(self, x):
            return self.head(self.body(x))

    head = Head()
    x = RNG.normal(size=(5, 3))
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_sum(outer(x)) + dtape.reduce_sum(head(x))
    grads = tape.gradient(loss, inner.trainable_variables)
    k, b = _t(inner.variables[0]), _t(inner.variables[1])
    h = torch.relu(torch.tensor(x) @ k + b)
    ok, ob = [torch.tensor(v.numpy()) for v in outer.layers[2].variables]
    hk, hb = [torch.tensor(v.numpy()) for v in head.head.variables]
    ((h @ ok + ob).sum() + (h @ hk + hb).sum()).backward()
    np.testing.assert_allclose(grads[0].numpy(), k.grad.numpy(), rtol=1e-10)
    np.testing.assert_allclose(grads[1].numpy(), b.grad.numpy(), rtol=1e-10)
    assert [layer.name for layer in head.layers] == ["inner", head.head.name]


class _Masked(L.Layer):
    """Marks the zeros of its input as padding (a mask producer, as Embedding(mask_zero=True))."""

    def call(self, x):
        return x

    def compute_mask(self, x, mask=None):
        return dtape.not_equal(x, 0.0)


class _MaskedMean(L.Layer):
    """The mean over the kept entries of each row (a mask consumer)."""

    def call(self, x, mask=None):
        keep = dtape.ones_like(x) if mask is None else dtape.cast(mask, x.dtype)
        return dtape.reduce_sum(x * keep, axis=1) / dtape.reduce_sum(keep, axis=1)


def test_masks_follow_the_graph_and_training_reaches_every_layer():
    x_in = keras.Input(shape=(4,), dtype="float64")
    scaled = L.Dropout(0.5, seed=1)(_Masked()(x_in))  # Dropout passes the mask on (Keras: supports_masking)
    model = keras.Model(x_in, [_MaskedMean()(_Masked()(x_in)), _MaskedMean()(scaled), _MaskedMean()(x_in)])
    x = np.array([[1.0, 2.0, 0.0, 0.0], [3.0, 0.0, 5.0, 7.0]])
    kept, after_dropout, plain = model(x)
    np.testing.assert_allclose(kept.numpy(), [1.5, 5.0], rtol=1e-12)
    np.testing.assert_allclose(after_dropout.numpy(), [1.5, 5.0], rtol=1e-12)  # inference: Dropout is identity
    np.testing.assert_allclose(plain.numpy(), x.mean(axis=1), rtol=1e-12)  # no mask made on this branch
    _, dropped, _ = model(x, training=True)
    assert not np.allclose(dropped.numpy(), [1.5, 5.0])
    # a mask given to the model reaches the input's consumers
    single = keras.Model(x_in, _MaskedMean()(x_in))
    np.testing.assert_allclose(single(x, mask=dtape.constant(x > 2.0)).numpy(), [np.nan, 5.0], rtol=1e-12)


def test_unknown_sizes_stay_unknown_and_the_model_runs_on_any_length():
    seq = keras.Input(shape=(None, 3), dtype="float64")
    dense = L.Dense(2, seed=9, dtype=F64)
    out = dense(seq)
    assert out.shape == (None, None, 2) and out.dtype == F64
    model = keras.Model(seq, out)
    for length in (1, 5):
        x = RNG.normal(size=(2, length, 3))
        ref = torch.tensor(x) @ torch.tensor(dense.kernel.numpy()) + torch.tensor(dense.bias.numpy())
        np.testing.assert_allclose(model(x).numpy(), ref.numpy(), rtol=1e-12)


def test_functional_errors_say_what_is_wrong():
    a, b = keras.Input(shape=(2,)), keras.Input(shape=(2,))
    y = Combine()([L.Dense(2)(a), L.Dense(2)(b)])
    with pytest.raises(ValueError, match="Graph disconnected"):
        keras.Model(a, y)
    with pytest.raises(TypeError, match="must come from dtape.keras.Input"):
        keras.Model(L.Dense(2)(a), y)
    with pytest.raises(TypeError, match="no value"):
        a + 1.0
    model = keras.Model([a, b], y)
    with pytest.raises(ValueError, match="expects 2 input"):
        model([np.ones((1, 2))])
    with pytest.raises(AttributeError, match="read-only"):
        model.layers = []
    with pytest.raises(ValueError, match="can only come first"):
        keras.Sequential([L.Dense(2), keras.Input(shape=(2,))])


# The encoder of TF's "The Functional API" guide, its documented summary (TF 2): name (type), shape, params.
GUIDE_ENCODER = [("img (InputLayer)", "(None, 28, 28, 1)", "0"), ("(Conv2D)", "(None, 26, 26, 16)", "160"),
                 ("(Conv2D)", "(None, 24, 24, 32)", "4,640"), ("(MaxPooling2D)", "(None, 8, 8, 32)", "0"),
                 ("(Conv2D)", "(None, 6, 6, 32)", "9,248"), ("(Conv2D)", "(None, 4, 4, 16)", "4,624"),
                 ("(GlobalMaxPooling2D)", "(None, 16)", "0")]


def _rows(text):
    return [[c.strip() for c in line.split("  ") if c.strip()] for line in text.splitlines()
            if line.strip() and line[0] not in "_=" and not line.startswith(("Model:", "Layer (type)", "Total",
                                                                               "Trainable", "Non-trainable"))]


def test_summary_of_the_functional_api_guides_encoder_and_mnist_model():
    img = keras.Input(shape=(28, 28, 1), name="img")
    x = L.Conv2D(16, 3, activation="relu")(img)
    x = L.Conv2D(32, 3, activation="relu")(x)
    x = L.MaxPooling2D(3)(x)
    x = L.Conv2D(32, 3, activation="relu")(x)
    x = L.Conv2D(16, 3, activation="relu")(x)
    encoder = keras.Model(img, L.GlobalMaxPooling2D()(x), name="encoder")
    printed = []
    text = encoder.summary(print_fn=printed.append)
    assert printed == [text] and text.startswith('Model: "encoder"')
    rows = _rows(text)
    assert len(rows) == len(GUIDE_ENCODER)
    for (label, shape, count), (want_label, want_shape, want_count) in zip(rows, GUIDE_ENCODER):
        assert label.endswith(want_label) and shape == want_shape and count == want_count
    assert "Total params: 18,672\nTrainable params: 18,672\nNon-trainable params: 0" in text
    assert encoder.count_params() == 18672 and encoder.output_shape == (None, 16)

    inputs = keras.Input(shape=(784,))
    x = L.Dense(64, activation="relu")(inputs)
    x = L.Dense(64, activation="relu")(x)
    mnist = keras.Model(inputs=inputs, outputs=L.Dense(10)(x), name="mnist_model")
    assert [r[1:] for r in _rows(mnist.summary(print_fn=lambda s: None))] == [
        ["(None, 784)", "0"], ["(None, 64)", "50,240"], ["(None, 64)", "4,160"], ["(None, 10)", "650"]]
    assert mnist.count_params() == 55050


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="sub")
        self.first = L.Dense(8, activation="relu", name="first")
        self.norm = L.BatchNormalization(name="norm")
        self.last = L.Dense(2, name="last")

    def call(self, x, training=False):
        return self.last(self.norm(self.first(x)))


_ORDER_SCRIPT = """
import dtape
from tests.test_models import _Subclassed
m = _Subclassed()
m.build((None, 5))
print([(v.name, tuple(v.shape)) for v in m.trainable_variables])
"""


def test_subclassed_model_build_summary_and_variable_order_across_processes():
    model = _Subclassed()
    with pytest.raises(ValueError, match="has not been built"):
        model.summary()
    model.build((None, 5))
    assert model.output_shape == (None, 2) and model.count_params() == 48 + 32 + 18
    names = [v.name for v in model.trainable_variables]
    assert names == ["first/kernel", "first/bias", "norm/gamma", "norm/beta", "last/kernel", "last/bias"]
    assert [r[1:] for r in _rows(model.summary(print_fn=lambda s: None))] == [
        ["(None, 8)", "48"], ["(None, 8)", "32"], ["(None, 2)", "18"]]
    assert "Non-trainable params: 16" in model.summary(print_fn=lambda s: None)
    # another process (another string hash seed than this one's random one) finds the same order
    env = dict(os.environ, PYTHONHASHSEED="1", PYTHONPATH=REPO)
    run = subprocess.run([sys.executable, "-c", _ORDER_SCRIPT], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str([(n, tuple(v.shape)) for n, v in zip(names, model.trainable_variables)])


def test_subclass_build_override_builds_its_sublayers():
    class Built(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = L.Dense(3)

        def build(self, input_shape):
            self.dense.build(input_shape)
            self.scale = self.add_weight("scale", (3,), "ones")

        def call(self, x):
            return self.dense(x) * self.scale

    model = Built()
    model.build((None, 4))
    assert model.built and model.count_params() == 18
    called = Built()  # Keras calls the subclass's build before the first call
    assert called(np.ones((2, 4), dtype=np.float32)).shape == (2, 3) and len(called.variables) == 3


def test_sequential_add_builds_once_the_input_shape_is_known():
    model = keras.Sequential()
    model.add(L.Dense(8, input_shape=(4,)))
    assert model.built and model.output_shape == (None, 8)
    model.add(L.Dense(2))
    assert model.output_shape == (None, 2) and len(model.variables) == 4
    from_input = keras.Sequential([keras.Input(shape=(4,)), L.Dense(3)])
    assert from_input.output_shape == (None, 3) and len(from_input.layers) == 1
    with pytest.raises(AttributeError, match="output shape is unknown"):
        keras.Sequential([L.Dense(2)]).output_shape


def _functional(seed):
    x_in = keras.Input(shape=(3,), dtype="float64")
    shared = L.Dense(4, activation="tanh", seed=seed, dtype=F64)
    h = Combine()([shared(x_in), shared(L.Dense(3, seed=seed + 1, dtype=F64)(x_in))])
    return keras.Model(x_in, L.Dense(2, seed=seed + 2, dtype=F64)(h))


def _step(model, opt, x, y):
    loss_fn = dtape.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    with dtape.GradientTape() as tape:
        loss = dtape.nn.compute_average_loss(loss_fn(y, model(x, training=True)), global_batch_size=8)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss


def test_functional_model_under_mirrored_strategy_equals_one_device():
    x, y = RNG.normal(size=(8, 3)), RNG.integers(0, 2, 8)
    one, opt1 = _functional(10), dtape.optimizers.SGD(0.5)
    for _ in range(3):
        _step(one, opt1, dtape.constant(x), dtape.constant(y))
    with interleaved(seed=2):  # replica threads switch between almost any two steps: per-call state must be per call
        strategy = mirrored(2)
        with strategy.scope():
            two, opt2 = _functional(10), dtape.optimizers.SGD(0.5)
        for _ in range(3):
            for xb, yb in strategy.experimental_distribute_dataset([(x, y)]):
                strategy.run(_step, (two, opt2, xb, yb))
    assert len(two.trainable_variables) == 6
    for a, b in zip(one.trainable_variables, two.trainable_variables):
        np.testing.assert_array_equal(b.values[0].numpy(), b.values[1].numpy())
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-12, atol=1e-14)
    assert np.abs(one.trainable_variables[0].numpy() - _functional(10).trainable_variables[0].numpy()).max() > 1e-3


def test_training_given_by_position_in_a_functional_call_leaves_moving_statistics_alone():
    # building the graph probes each layer on zeros: BatchNormalization(...)(x, True) must not update on them
    inputs = dtape.keras.Input(shape=(3,))
    bn = dtape.keras.layers.BatchNormalization(momentum=0.5)
    model = dtape.keras.Model(inputs, bn(inputs, True))
    np.testing.assert_array_equal(bn.moving_mean.numpy(), np.zeros(3))
    np.testing.assert_array_equal(bn.moving_variance.numpy(), np.ones(3))   # zeros' variance would halve it
    x = np.array([[1.0, 2.0, 3.0], [3.0, 4.0, 5.0]], np.float32)
    model(x, training=True)
    np.testing.assert_allclose(bn.moving_mean.numpy(), [1.0, 1.5, 2.0], rtol=1e-6)
