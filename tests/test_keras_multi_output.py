"""compile with several outputs, as Keras's "Training & evaluation with the built-in methods" guide writes it:
a list or dict of losses, loss_weights, per-output metrics; the loss is the weighted sum of each output's
loss (each logged as "<output>_loss"), metrics are logged as "<output>_<metric>"; two replicas equal one device."""
import numpy as np
import pytest

from dtape import keras
from tests._strategies import mirrored

pytestmark = pytest.mark.usefixtures("closes_strategies")

RNG = np.random.default_rng(4)
X = RNG.normal(size=(9, 4)).astype(np.float32)
SCORE = RNG.normal(size=(9, 1)).astype(np.float32)
CLASSES = np.eye(3, dtype=np.float32)[RNG.integers(0, 3, 9)]


def _model():
    inputs = keras.Input(shape=(4,))
    hidden = keras.layers.Dense(5, activation="relu", seed=1)(inputs)
    score = keras.layers.Dense(1, name="score_output", seed=2)(hidden)
    klass = keras.layers.Dense(3, activation="softmax", name="class_output", seed=3)(hidden)
    return keras.Model(inputs, [score, klass])


def _by_hand(model, w_score=1.0, w_class=1.0):
    score, probs = (t.numpy() for t in model(X))
    mse = ((score - SCORE) ** 2).mean()
    cce = -(CLASSES * np.log(np.clip(probs, 1e-7, 1 - 1e-7))).sum(-1).mean()
    acc = (probs.argmax(-1) == CLASSES.argmax(-1)).mean()
    return w_score * mse + w_class * cce, mse, cce, np.abs(score - SCORE).mean(), acc


@pytest.mark.parametrize("as_dict", [False, True])
def test_losses_weights_and_metrics_per_output(as_dict):
    model = _model()
    losses = [keras.losses.MeanSquaredError(), keras.losses.CategoricalCrossentropy()]
    weights = [2.0, 0.5]
    metrics = [["mae"], [keras.metrics.CategoricalAccuracy()]]
    if as_dict:
        losses, weights, metrics = ({"score_output": losses[0], "class_output": losses[1]},
                                    {"score_output": 2.0, "class_output": 0.5},
                                    {"score_output": ["mae"], "class_output": [keras.metrics.CategoricalAccuracy()]})
    model.compile("sgd", loss=losses, loss_weights=weights, metrics=metrics)
    logs = model.evaluate(X, [SCORE, CLASSES], batch_size=4, return_dict=True)
    total, mse, cce, mae, acc = _by_hand(model, 2.0, 0.5)
    assert list(logs) == ["loss", "score_output_loss", "class_output_loss", "score_output_mae",
                          "class_output_categorical_accuracy"]
    np.testing.assert_allclose([logs["loss"], logs["score_output_loss"], logs["class_output_loss"],
                                logs["score_output_mae"], logs["class_output_categorical_accuracy"]],
                               [total, mse, cce, mae, acc], rtol=1e-5)
    # the value differentiated in train_step is the same weighted sum
    np.testing.assert_allclose(float(model.compute_loss(X, [SCORE, CLASSES], model(X))), total, rtol=1e-5)


def test_fit_under_two_replicas_equals_one_device():
    def run():
        model = _model()
        model.compile(keras.optimizers.SGD(0.1), loss={"score_output": "mse", "class_output":
                                                       "categorical_crossentropy"}, metrics=["mae"])
        return model, model.fit(X, {"score_output": SCORE, "class_output": CLASSES}, batch_size=4, epochs=2,
                                shuffle=False, verbose=0).history
    one_model, one = run()
    strategy = mirrored(2)
    with strategy.scope():
        two_model, two = run()
    assert set(one) == {"loss", "score_output_loss", "class_output_loss", "score_output_mae", "class_output_mae"}
    for key in one:
        np.testing.assert_allclose(two[key], one[key], rtol=1e-5)
    for a, b in zip(one_model.trainable_variables, two_model.trainable_variables):
        np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-6)


def test_errors_name_the_outputs():
    model = _model()
    with pytest.raises(ValueError, match=r"\['scor'\] are not output names; the outputs are \['score_output'"):
        model.compile("sgd", loss={"scor": "mse"})
    with pytest.raises(ValueError, match="1 losses for 2 outputs"):
        model.compile("sgd", loss=["mse"])
    with pytest.raises(ValueError, match="metric objects per output"):
        model.compile("sgd", loss="mse", metrics=[keras.metrics.MeanAbsoluteError()])
