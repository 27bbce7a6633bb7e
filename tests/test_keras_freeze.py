"""Freezing as Keras's "Transfer learning & fine-tuning" guide uses it: `layer.trainable = False`."""
import numpy as np
import pytest

import dtape
from dtape import keras
from tests._strategies import mirrored

pytestmark = pytest.mark.usefixtures("closes_strategies")

RNG = np.random.default_rng(3)
X = RNG.normal(size=(13, 4)).astype(np.float32)   # batches of 4, 4, 4, 1: the last one leaves a replica empty
Y = RNG.normal(size=(13, 2)).astype(np.float32)


def _counts(layer):
    return len(layer.weights), len(layer.trainable_weights), len(layer.non_trainable_weights)


def test_frozen_layer_weight_lists_as_the_guide():
    dense = keras.layers.Dense(3)
    dense.build((None, 4))
    dense.trainable = False
    assert _counts(dense) == (2, 0, 2)
    bn = keras.layers.BatchNormalization()
    bn.build((None, 4))
    assert _counts(bn) == (4, 2, 2)
    bn.trainable = False
    assert _counts(bn) == (4, 0, 4)
    assert _counts(keras.layers.Dense(3, trainable=False, input_shape=(4,))) == (2, 0, 2)


def _base(seed):
    inputs = keras.Input(shape=(4,))
    h = keras.layers.Dense(5, seed=seed)(inputs)
    return keras.Model(inputs, keras.layers.BatchNormalization()(h), name="base")


def _transfer(seed=1):
    """The guide's idiom: a frozen base called with training=False under a new head."""
    base = _base(seed)
    base.trainable = False
    inputs = keras.Input(shape=(4,))
    outputs = keras.layers.Dense(2, seed=seed + 1)(base(inputs, training=False))
    return base, keras.Model(inputs, outputs)


def test_model_trainable_false_counts_and_summary():
    base, model = _transfer()
    assert [len(base.trainable_weights), len(base.non_trainable_weights)] == [0, 6]
    assert [len(model.trainable_weights), len(model.non_trainable_weights)] == [2, 6]
    text = model.summary(print_fn=lambda s: None)
    # base: 4*5+5 + 4*5 (gamma, beta, moving mean and variance); head: 5*2+2
    assert "Total params: 57" in text and "Trainable params: 12" in text and "Non-trainable params: 45" in text
    base.trainable = True   # fine-tuning: every sub-layer unfrozen again
    assert [len(model.trainable_weights), len(model.non_trainable_weights)] == [6, 2]


def test_fit_leaves_frozen_weights_and_bn_statistics():
    base, model = _transfer()
    model.compile(keras.optimizers.SGD(0.1), "mse")
    frozen = [v.numpy().copy() for v in base.weights]
    head = [v.numpy().copy() for v in model.layers[-1].weights]
    model.fit(X, Y, batch_size=4, epochs=2, verbose=0)
    for before, v in zip(frozen, base.weights):
        np.testing.assert_array_equal(v.numpy(), before)
    assert all(np.abs(v.numpy() - b).max() > 1e-4 for b, v in zip(head, model.layers[-1].weights))


def test_frozen_batchnorm_runs_in_inference_mode_when_training():
    bn = keras.layers.BatchNormalization()
    x = dtape.constant(RNG.normal(2.0, 3.0, size=(8, 3)).astype(np.float32))
    bn(x, training=True)   # moves the statistics away from 0 / 1
    bn.trainable = False
    moving = bn.moving_mean.numpy().copy()
    np.testing.assert_array_equal(bn(x, training=True).numpy(), bn(x, training=False).numpy())
    np.testing.assert_array_equal(bn.moving_mean.numpy(), moving)


def test_frozen_layer_survives_save_and_load(tmp_path):
    _, model = _transfer()
    model.compile("sgd", "mse")
    model.save(str(tmp_path / "m.keras"))
    loaded = keras.models.load_model(str(tmp_path / "m.keras"))
    assert [len(loaded.trainable_weights), len(loaded.non_trainable_weights)] == [2, 6]


def _fit_transfer(strategy):
    if strategy is None:
        _, model = _transfer()
    else:
        with strategy.scope():
            _, model = _transfer()
    model.compile(keras.optimizers.SGD(0.1), "mse")
    losses = model.fit(X, Y, batch_size=4, epochs=2, verbose=0, shuffle=False).history["loss"]
    return losses, [v.numpy() for v in model.weights]


def test_frozen_fit_on_two_replicas_equals_one_device():
    one_losses, one_weights = _fit_transfer(None)
    two_losses, two_weights = _fit_transfer(mirrored(2))
    np.testing.assert_allclose(two_losses, one_losses, rtol=1e-5)
    for a, b in zip(two_weights, one_weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


class _Scale(keras.layers.Layer):
    """A subclass passing Keras's base-layer arguments through, as the subclassing guide's serializable layers."""

    def __init__(self, units=2, **kwargs):
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], self.units), initializer="ones")

    def call(self, x):
        return dtape.matmul(x, self.w)


def test_subclassed_layer_takes_trainable_through_kwargs_and_config():
    layer = _Scale(3, trainable=False)
    layer(dtape.ones((1, 4)))
    assert _counts(layer) == (1, 0, 1)
    again = _Scale.from_config(layer.get_config())
    again(dtape.ones((1, 4)))
    assert _counts(again) == (1, 0, 1) and again.units == 3


class _FrozenScale(_Scale):
    def __init__(self):
        super().__init__(units=2, trainable=False)


def test_subclass_freezing_itself_in_init():
    layer = _FrozenScale()
    layer(dtape.ones((1, 4)))
    assert _counts(layer) == (1, 0, 1)
