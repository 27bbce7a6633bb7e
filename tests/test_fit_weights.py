"""fit / evaluate with sample_weight, class_weight and weighted validation_data, against hand-computed weighted
losses (Keras: sum of weight * loss over the batch, divided by the batch's examples) and the custom loop."""
import numpy as np
import pytest
import torch

import dtape
from dtape import keras
from tests._strategies import mirrored

pytestmark = pytest.mark.usefixtures("closes_strategies")

RNG = np.random.default_rng(11)
X = RNG.normal(size=(71, 5)).astype(np.float32)   # global batches of 32, 32, 7 (the last splits 4 / 3)
Y = RNG.integers(0, 3, 71)
SW = RNG.uniform(0.0, 2.0, size=71).astype(np.float32)
CLASS_WEIGHT = {0: 0.5, 1: 2.0, 2: 1.25}


def _model(strategy=None, lr=0.0):
    with (strategy or dtape.distribute.get_strategy()).scope():
        inputs = keras.Input(shape=(5,))
        hidden = keras.layers.Dense(8, activation="relu", seed=1)(inputs)
        model = keras.Model(inputs, keras.layers.Dense(3, seed=2)(hidden))
        model.compile(keras.optimizers.SGD(lr), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    return model


def _per_example(model, x=X, y=Y):
    """Per-example cross-entropies and correctness of the model as it is (float64 numpy)."""
    logits = torch.as_tensor(model.predict(x, batch_size=71), dtype=torch.float64)
    losses = torch.nn.functional.cross_entropy(logits, torch.as_tensor(y), reduction="none").numpy()
    return losses, (logits.argmax(-1).numpy() == y).astype(np.float64)


def _strategy(replicas):
    return mirrored(replicas) if replicas > 1 else None


@pytest.mark.parametrize("replicas", [1, 2])
def test_fit_weighs_each_examples_loss_and_metric_by_its_sample_weight(replicas):
    model = _model(_strategy(replicas))            # lr 0: every step sees the initial weights
    losses, correct = _per_example(model)
    history = model.fit(X, Y, sample_weight=SW, batch_size=32, epochs=1, shuffle=False, verbose=0)
    # the epoch's loss: each batch's sum(w * loss) / batch size, averaged over batches by their size
    np.testing.assert_allclose(history.history["loss"][0], (SW * losses).sum() / 71, rtol=1e-5)
    np.testing.assert_allclose(history.history["accuracy"][0], (SW * correct).sum() / SW.sum(), rtol=1e-5)
    unweighted = model.fit(X, Y, batch_size=32, epochs=1, shuffle=False, verbose=0).history["loss"][0]
    assert abs(unweighted - history.history["loss"][0]) > 1e-3      # the weights changed the number
    np.testing.assert_allclose(unweighted, losses.mean(), rtol=1e-5)


def test_a_weight_per_example_as_a_column_weighs_the_same():
    model = _model()
    flat = model.fit(X, Y, sample_weight=SW, batch_size=32, shuffle=False, verbose=0).history["loss"]
    column = model.fit(X, Y, sample_weight=SW[:, None], batch_size=32, shuffle=False, verbose=0).history["loss"]
    assert flat == column


def _custom_loop(epochs, lr):
    """The weighted custom loop on one device: loss = sum(w * per-example loss) / batch size, SGD."""
    model, opt = _model(lr=lr), dtape.optimizers.SGD(lr)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    steps = []
    for _ in range(epochs):
        for start in range(0, 71, 32):
            xb, yb, wb = (dtape.constant(a[start:start + 32]) for a in (X, Y, SW))
            with dtape.GradientTape() as tape:
                loss = dtape.reduce_sum(loss_fn(yb, model(xb, training=True)) * wb) / float(len(xb))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            steps.append(float(loss))
    return steps, [v.numpy() for v in model.trainable_variables]


def test_weighted_fit_under_mirrored_strategy_equals_the_weighted_custom_loop():
    ref_steps, ref_vars = _custom_loop(epochs=2, lr=0.5)
    model = _model(mirrored(2), lr=0.5)
    history = model.fit(X, Y, sample_weight=SW, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(model.trainable_variables, ref_vars):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    sizes = [32, 32, 7]
    for epoch in range(2):
        epoch_steps = ref_steps[3 * epoch:3 * epoch + 3]
        want = sum(s * n for s, n in zip(epoch_steps, sizes)) / 71
        np.testing.assert_allclose(history.history["loss"][epoch], want, rtol=1e-5)


def test_evaluate_and_weighted_validation_data():
    model = _model()
    losses, correct = _per_example(model)
    loss, accuracy = model.evaluate(X, Y, sample_weight=SW, batch_size=32)
    np.testing.assert_allclose(loss, (SW * losses).sum() / 71, rtol=1e-5)
    np.testing.assert_allclose(accuracy, (SW * correct).sum() / SW.sum(), rtol=1e-5)
    history = model.fit(X, Y, batch_size=32, verbose=0, shuffle=False, validation_data=(X, Y, SW))
    assert history.history["val_loss"][0] == pytest.approx(loss, rel=1e-6)
    assert history.history["val_accuracy"][0] == pytest.approx(accuracy, rel=1e-6)


@pytest.mark.parametrize("replicas", [1, 2])
def test_class_weight_weighs_each_example_by_its_class_times_its_sample_weight(replicas):
    model = _model(_strategy(replicas))
    losses, _ = _per_example(model)
    by_class = np.array([CLASS_WEIGHT[int(c)] for c in Y])
    history = model.fit(X, Y, class_weight=CLASS_WEIGHT, batch_size=32, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"][0], (by_class * losses).sum() / 71, rtol=1e-5)
    history = model.fit(X, Y, class_weight=CLASS_WEIGHT, sample_weight=SW, batch_size=32, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"][0], (by_class * SW * losses).sum() / 71, rtol=1e-5)
    one_hot = np.eye(3, dtype=np.float32)[Y]           # one-hot targets: the class is argmax(y)
    model.compile(keras.optimizers.SGD(0.0), keras.losses.CategoricalCrossentropy(from_logits=True))
    history = model.fit(X, one_hot, class_weight=CLASS_WEIGHT, batch_size=32, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"][0], (by_class * losses).sum() / 71, rtol=1e-5)


def test_bad_weights_are_refused_with_what_to_do():
    model = _model()
    with pytest.raises(ValueError, match=r"different numbers of examples: \[70, 71\]"):
        model.fit(X, Y, sample_weight=SW[:70], verbose=0)
    with pytest.raises(ValueError, match="carry their weights"):
        model.fit([(X, Y)], sample_weight=SW, verbose=0)
    with pytest.raises(ValueError, match=r"no weight for the classes \[2\]"):
        model.fit(X, Y, class_weight={0: 1.0, 1: 2.0}, verbose=0)
    with pytest.raises(ValueError, match="needs targets y"):
        model.evaluate(X, sample_weight=SW)


def test_the_imbalanced_data_tutorials_binary_idiom():
    # TF's imbalanced-data tutorial: one sigmoid unit, 0/1 labels as a vector, {0: w0, 1: w1}
    labels = (Y == 1).astype(np.int64)
    inputs = keras.Input(shape=(5,))
    model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid", seed=3)(inputs))
    model.compile(keras.optimizers.SGD(0.0), "binary_crossentropy")
    p = model.predict(X, batch_size=71)[:, 0].astype(np.float64)
    bce = -(labels * np.log(p) + (1 - labels) * np.log(1 - p))
    weights = np.where(labels == 1, 3.0, 0.6)
    history = model.fit(X, labels, class_weight={0: 0.6, 1: 3.0}, batch_size=32, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"][0], (weights * bce).sum() / 71, rtol=1e-4)
    with pytest.raises(ValueError, match=r"dict\(enumerate\(weights\)\)"):
        model.fit(X, labels, class_weight=np.array([0.6, 3.0]), verbose=0)
