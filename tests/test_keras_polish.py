"""Small things TF users' Keras code (Keras's guides, as written there) hit: Masking, add_weight(dtype=),
Conv1D on sequences of unknown length in a functional model, layers.concatenate/add/multiply, on_batch_end,
TensorBoard's usual arguments."""
import numpy as np
import pytest
import torch

import dtape
from dtape import keras
from dtape.keras import layers
from tests._strategies import close_all, mirrored


def test_masking_layer_masks_all_equal_steps_and_feeds_the_loss():
    x = np.ones((2, 4, 3), np.float32)
    x[0, 1], x[1, 2:] = 0.0, 0.0
    masking = layers.Masking(mask_value=0.0)
    np.testing.assert_array_equal(masking.compute_mask(dtape.constant(x)).numpy(),
                                  [[True, False, True, True], [True, True, False, False]])
    x[0, 3, 0] = 0.0  # one zero feature among others: the step is kept
    out = masking(x).numpy()
    np.testing.assert_array_equal(out, x)
    inputs = keras.Input(shape=(4, 3))
    model = keras.Model(inputs, layers.Dense(1, kernel_initializer="ones", bias_initializer="ones")(
        layers.Masking()(inputs)))
    model.compile("sgd", "mse")
    y = np.zeros((2, 4, 1), np.float32)
    pred = x.sum(-1, keepdims=True) + 1.0
    keep = np.array([[1, 0, 1, 1], [1, 1, 0, 0]], bool)
    np.testing.assert_allclose(model.evaluate(x, y), (pred[..., 0] ** 2)[keep].mean(), rtol=1e-6)


def test_add_weight_dtype():
    class Layer(layers.Layer):
        def build(self, input_shape):
            self.table = self.add_weight(shape=(3,), initializer="zeros", dtype="float64")
            self.count = self.add_weight(shape=(), initializer="zeros", dtype=torch.int64, trainable=False)

        def call(self, x):
            return x

    layer = Layer()
    layer(np.zeros((1, 2), np.float32))
    assert layer.table.dtype == torch.float64 and layer.count.dtype == torch.int64


def test_conv1d_on_sequences_of_unknown_length_in_a_functional_model():
    # Keras's guide: Input(shape=(None, 10)) -> Conv1D(3, 3) -> GlobalMaxPooling1D; the probe had 2 steps.
    ts = keras.Input(shape=(None, 10))
    conv = layers.Conv1D(3, 3, seed=0)
    model = keras.Model(ts, layers.GlobalMaxPooling1D()(conv(ts)))
    assert conv.output_shape == (None, None, 3) and model.output_shape == (None, 3)
    x = np.random.default_rng(0).random((2, 5, 10)).astype(np.float32)
    ref = torch.nn.functional.conv1d(torch.as_tensor(x).transpose(1, 2), torch.as_tensor(conv.kernel.numpy()).permute(
        2, 1, 0), torch.as_tensor(conv.bias.numpy())).amax(-1)
    np.testing.assert_allclose(model(x).numpy(), ref.numpy(), rtol=1e-5)


def test_functional_merge_helpers():
    a, b = keras.Input(shape=(2,)), keras.Input(shape=(3,))
    model = keras.Model([a, b], layers.concatenate([a, b]))
    np.testing.assert_array_equal(model([np.ones((1, 2)), np.zeros((1, 3))]).numpy(), [[1, 1, 0, 0, 0]])
    c = keras.Input(shape=(2,))
    summed = keras.Model([a, c], [layers.add([a, c]), layers.multiply([a, c])])
    s, p = summed([np.full((1, 2), 2.0), np.full((1, 2), 3.0)])
    assert s.numpy().tolist() == [[5.0, 5.0]] and p.numpy().tolist() == [[6.0, 6.0]]


def test_on_batch_end_is_called_as_keras_guide_writes_it():
    class LossHistory(keras.callbacks.Callback):
        def on_train_begin(self, logs):
            self.per_batch_losses = []

        def on_batch_end(self, batch, logs):
            self.per_batch_losses.append(logs.get("loss"))

    inputs = keras.Input(shape=(2,))
    model = keras.Model(inputs, layers.Dense(1)(inputs))
    model.compile("sgd", "mse")
    history = LossHistory()
    model.fit(np.ones((10, 2), np.float32), np.ones((10, 1), np.float32), batch_size=4, verbose=0,
              callbacks=[history])
    assert len(history.per_batch_losses) == 3 and all(np.isfinite(history.per_batch_losses))


def test_tensorboard_accepts_keras_defaults_and_refuses_the_rest(tmp_path):
    keras.callbacks.TensorBoard(log_dir=str(tmp_path), histogram_freq=0, embeddings_freq=0, update_freq="epoch")
    with pytest.raises(ValueError, match="histogram_freq"):
        keras.callbacks.TensorBoard(log_dir=str(tmp_path), histogram_freq=1)


def test_tf_multi_worker_tutorial_model_with_float64_numpy_data_under_two_replicas():
    # The tutorial's model (Keras 2's InputLayer(input_shape=) first in a Sequential) fed `x / 255.0` (float64 in
    # numpy): Keras's data adapter makes it float32 (floatx); one device and two replicas give the same losses.
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 255, (12, 6, 6)) / 255.0, rng.integers(0, 10, 12)
    assert x.dtype == np.float64

    def build():
        model = keras.Sequential([layers.InputLayer(input_shape=(6, 6)), layers.Reshape(target_shape=(6, 6, 1)),
                                  layers.Conv2D(4, 3, activation="relu", seed=1), layers.Flatten(),
                                  layers.Dense(10, seed=2)])
        model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      optimizer=keras.optimizers.SGD(learning_rate=0.1), metrics=["accuracy"])
        return model

    try:
        one = build().fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0).history
        strategy = mirrored(2)
        with strategy.scope():
            model = build()
        assert model.output_shape == (None, 10)
        two = model.fit(x, y, batch_size=6, epochs=2, shuffle=False, verbose=0).history
    finally:
        close_all()
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-5)
    with pytest.raises(TypeError, match="shape= .* or input_shape="):
        layers.InputLayer()
