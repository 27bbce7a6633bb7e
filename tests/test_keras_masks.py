"""A model output carrying a Keras mask (Embedding(mask_zero=True) -> ... -> Dense) weighs the compiled loss and
metrics as Keras does: masked positions are excluded, the loss is the mean over unmasked positions; under
MirroredStrategy (two replica threads) the loss is the one device's (unmasked positions counted globally)."""
import numpy as np
import pytest
import torch

import dtape
from dtape import keras
from tests._strategies import mirrored

pytestmark = pytest.mark.usefixtures("closes_strategies")

# 5 sequences of 4 steps; zeros are padding. The global batch of 5 splits 3 / 2 over two replicas, with 7 and
# 3 unmasked steps: a per-replica mean of means (TF's) would differ from the global masked mean.
IDS = np.array([[1, 2, 3, 0], [4, 1, 0, 0], [2, 0, 0, 0], [5, 0, 0, 0], [3, 4, 0, 0]], dtype=np.int64)
LABELS = np.array([[2, 3, 1, 0], [5, 5, 0, 0], [1, 4, 4, 4], [3, 1, 1, 1], [0, 2, 2, 2]], dtype=np.int64)
MASK = IDS != 0


def _functional(seed=0):
    ids = keras.Input(shape=(None,), dtype="int64")
    h = keras.layers.Embedding(6, 3, mask_zero=True, seed=seed)(ids)
    h = keras.layers.Dense(8, activation="relu", seed=seed + 1)(h)
    return keras.Model(ids, keras.layers.Dense(6, seed=seed + 2)(h))


def _sequential(seed=0):
    return keras.Sequential([keras.layers.Embedding(6, 3, mask_zero=True, seed=seed),
                             keras.layers.Dense(6, seed=seed + 2)])


def _by_hand(model, ids=IDS, labels=LABELS):
    logits = torch.as_tensor(model(ids).numpy())
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 6), torch.as_tensor(labels).reshape(-1),
                                           reduction="none").reshape(labels.shape).numpy()
    hits = logits.argmax(-1).numpy() == labels
    m = ids != 0
    return float((ce * m).sum() / m.sum()), float((hits * m).sum() / m.sum())


def _compile(model):
    model.compile(dtape.optimizers.SGD(0.5), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


@pytest.mark.parametrize("make", [_functional, _sequential])
def test_masked_loss_and_accuracy_equal_hand_computed(make):
    model = _compile(make())
    model.fit(IDS, LABELS, batch_size=5, epochs=5, verbose=0)  # away from uniform logits
    loss, acc = _by_hand(model)
    logs = model.evaluate(IDS, LABELS, batch_size=5, return_dict=True)
    np.testing.assert_allclose(logs["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(logs["accuracy"], acc, rtol=1e-6)
    unmasked_mean = float(torch.nn.functional.cross_entropy(
        torch.as_tensor(model(IDS).numpy()).reshape(-1, 6), torch.as_tensor(LABELS).reshape(-1)))
    assert abs(logs["loss"] - unmasked_mean) > 0.1  # the padding positions do change the plain mean


def test_masked_loss_with_sample_weight():
    model = _compile(_functional())
    w = np.array([1.0, 2.0, 0.5, 0.0, 3.0], dtype=np.float32)
    logits = torch.as_tensor(model(IDS).numpy())
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 6), torch.as_tensor(LABELS).reshape(-1),
                                           reduction="none").reshape(5, 4).numpy()
    expected = (ce * MASK * w[:, None]).sum() / MASK.sum()  # Keras: weights times mask, over the unmasked count
    got = model.compute_loss(None, dtape.constant(LABELS), model(IDS), dtape.constant(w))
    np.testing.assert_allclose(float(got), expected, rtol=1e-5)


def test_unmasked_sequence_loss_is_the_mean_over_every_position():
    # [batch, steps] per-example losses reduce by their number of elements, as Keras's sum_over_batch_size.
    ids = keras.Input(shape=(4,), dtype="int64")
    model = _compile(keras.Model(ids, keras.layers.Dense(6, seed=2)(keras.layers.Embedding(6, 3, seed=0)(ids))))
    logits = torch.as_tensor(model(IDS).numpy())
    expected = float(torch.nn.functional.cross_entropy(logits.reshape(-1, 6), torch.as_tensor(LABELS).reshape(-1)))
    np.testing.assert_allclose(model.evaluate(IDS, LABELS, batch_size=5)[0], expected, rtol=1e-5)


def test_masked_fit_under_two_replicas_equals_one_device():
    one = _compile(_functional())
    hist_one = one.fit(IDS, LABELS, batch_size=5, epochs=3, shuffle=False, verbose=0).history
    strategy = mirrored(2)
    with strategy.scope():
        two = _compile(_functional())
    hist_two = two.fit(IDS, LABELS, batch_size=5, epochs=3, shuffle=False, verbose=0).history
    np.testing.assert_allclose(hist_two["loss"], hist_one["loss"], rtol=1e-5)
    np.testing.assert_allclose(hist_two["accuracy"], hist_one["accuracy"], rtol=1e-6)
    for a, b in zip(one.trainable_variables, two.trainable_variables):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6)
    with strategy.scope():
        logs = two.evaluate(IDS, LABELS, batch_size=5, return_dict=True)
    np.testing.assert_allclose(logs["loss"], _by_hand(one)[0], rtol=1e-5)


def test_a_replica_with_an_empty_slice_does_not_make_the_loss_nan():
    # 5 examples in batches of 4: the last batch of 1 leaves the second replica nothing.
    x, y = np.arange(10, dtype=np.float32).reshape(5, 2) / 10, np.ones((5, 1), np.float32)

    def run():
        inputs = keras.Input(shape=(2,))
        model = keras.Model(inputs, keras.layers.Dense(1, seed=1)(inputs))
        model.compile(dtape.optimizers.SGD(0.1), "mse")
        return model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0).history["loss"]
    one = run()
    with mirrored(2).scope():
        two = run()
    np.testing.assert_allclose(two, one, rtol=1e-5)
