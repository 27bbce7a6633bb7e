"""Keras's built-in metric classes and compile's metric names: values from Keras's documented examples and
numpy, weighted, and under MirroredStrategy (two replica threads) equal to one device."""
import numpy as np
import pytest

import dtape
from dtape import keras
from dtape import metrics
from tests._strategies import mirrored

pytestmark = pytest.mark.usefixtures("closes_strategies")

RNG = np.random.default_rng(11)
T = RNG.random((9, 4)).astype(np.float32)
P = RNG.random((9, 4)).astype(np.float32)
W = RNG.random(9).astype(np.float32)


def _value(metric, *args, **kwargs):
    metric.update_state(*args, **kwargs)
    return float(metric.result())


def test_keras_documented_values():
    # The examples in Keras's docstrings of each class.
    assert _value(metrics.BinaryAccuracy(), [[1], [1], [0], [0]], [[0.98], [1], [0], [0.6]]) == 0.75
    assert _value(metrics.CategoricalAccuracy(), [[0, 0, 1], [0, 1, 0]], [[0.1, 0.9, 0.8], [0.05, 0.95, 0]]) == 0.5
    assert _value(metrics.TopKCategoricalAccuracy(k=1), [[0, 0, 1], [0, 1, 0]],
                  [[0.1, 0.9, 0.8], [0.05, 0.95, 0]]) == 0.5
    assert _value(metrics.SparseTopKCategoricalAccuracy(k=1), [2, 1], [[0.1, 0.9, 0.8], [0.05, 0.95, 0]]) == 0.5
    assert _value(metrics.SparseTopKCategoricalAccuracy(k=2), [2, 1], [[0.1, 0.9, 0.8], [0.05, 0.95, 0]]) == 1.0
    assert _value(metrics.RootMeanSquaredError(), [[0, 1], [0, 0]], [[1, 1], [0, 0]]) == 0.5
    assert _value(metrics.MeanSquaredError(), [[0, 1], [0, 0]], [[1, 1], [0, 0]]) == 0.25
    assert _value(metrics.MeanAbsoluteError(), [[0, 1], [0, 0]], [[1, 1], [0, 0]]) == 0.25
    np.testing.assert_allclose(_value(metrics.Precision(), [0, 1, 1, 1], [1, 0, 1, 1]), 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(_value(metrics.Recall(), [0, 1, 1, 1], [1, 0, 1, 1]), 2 / 3, rtol=1e-6)
    np.testing.assert_allclose(_value(metrics.AUC(num_thresholds=3), [0, 0, 1, 1], [0, 0.5, 0.3, 0.9]), 0.75)
    # Scores between the 200 thresholds: the ROC points are exact, so is the trapezoid: sklearn's 0.75.
    np.testing.assert_allclose(_value(metrics.AUC(), [0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]), 0.75, rtol=1e-6)


def test_weighted_values_match_numpy():
    np.testing.assert_allclose(_value(metrics.MeanSquaredError(), T, P, sample_weight=W),
                               np.sum(((T - P) ** 2).mean(-1) * W) / W.sum(), rtol=1e-5)
    np.testing.assert_allclose(_value(metrics.MeanAbsoluteError(), T, P, sample_weight=W),
                               np.sum(np.abs(T - P).mean(-1) * W) / W.sum(), rtol=1e-5)
    np.testing.assert_allclose(_value(metrics.RootMeanSquaredError(), T, P, sample_weight=W),
                               np.sqrt(np.sum((T - P) ** 2 * W[:, None]) / (W.sum() * 4)), rtol=1e-5)
    labels = (T > 0.5).astype(np.float32)
    pos = P > 0.3
    tp, fp, fn = [np.sum(((labels == a) & (pos == b)) * W[:, None]) for a, b in ((1, 1), (0, 1), (1, 0))]
    np.testing.assert_allclose(_value(metrics.Precision(thresholds=0.3), labels, P, sample_weight=W),
                               tp / (tp + fp), rtol=1e-5)
    recall = metrics.Recall(thresholds=[0.3, 2.0])  # a list: one value per threshold
    recall.update_state(labels, P, sample_weight=W)
    np.testing.assert_allclose(recall.result().numpy(), [tp / (tp + fn), 0.0], rtol=1e-5)
    top2 = np.argsort(-P, -1)[:, :2]
    y = RNG.integers(0, 4, 9)
    np.testing.assert_allclose(_value(metrics.SparseTopKCategoricalAccuracy(k=2), y, P),
                               np.mean([y[i] in top2[i] for i in range(9)]), rtol=1e-6)


def test_state_reset_and_errors():
    auc = metrics.AUC(num_thresholds=5)
    auc.update_state([0, 1], [0.2, 0.9])
    assert float(auc.result()) == 1.0
    auc.reset_state()
    assert float(auc.true_positives.numpy().sum()) == 0.0
    with pytest.raises(ValueError, match="curve='ROC'"):
        metrics.AUC(curve="PR")
    with pytest.raises(ValueError, match="unknown metric 'maee'"):
        metrics.get("maee")
    with pytest.raises(ValueError, match="'zeros' or 'ones'"):
        metrics.Mean().add_variable("x", initializer="glorot")


class CategoricalTruePositives(keras.metrics.Metric):
    """Keras's guide's custom metric, as written there (add_variable with a string initializer)."""

    def __init__(self, name="categorical_true_positives", **kwargs):
        super().__init__(name=name, **kwargs)
        self.true_positives = self.add_variable(shape=(), name="ctp", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_pred = dtape.reshape(dtape.argmax(y_pred, axis=1), (-1, 1))
        values = dtape.cast(dtape.equal(dtape.cast(y_true, "int32"), dtape.cast(y_pred, "int32")), "float32")
        self.true_positives.assign_add(dtape.reduce_sum(values))

    def result(self):
        return self.true_positives.read_value()


def test_guide_custom_metric_with_string_initializer():
    m = CategoricalTruePositives()
    m.update_state(np.array([[1], [0], [2]]), np.array([[0.1, 0.9, 0], [0.8, 0.1, 0.1], [0, 0.3, 0.2]]))
    assert float(m.result()) == 2.0


@pytest.mark.parametrize("make", [metrics.AUC, metrics.Precision, metrics.RootMeanSquaredError,
                                  lambda: metrics.SparseTopKCategoricalAccuracy(k=2)])
def test_under_two_replicas_equals_one_device(make):
    labels = (T > 0.5).astype(np.float32) if make is not metrics.RootMeanSquaredError else T
    if not isinstance(make, type):
        labels = RNG.integers(0, 4, 9)
    one = make()
    one.update_state(labels, P, sample_weight=W)
    strategy = mirrored(2)
    with strategy.scope():
        dist = make()
    batches = strategy.experimental_distribute_dataset([(labels, P, W)])
    for batch in batches:
        strategy.run(lambda b: dist.update_state(*b[:2], sample_weight=b[2]), (batch,))
    np.testing.assert_allclose(dist.result().numpy(), one.result().numpy(), rtol=1e-6)


@pytest.mark.parametrize("y, out, expected", [
    (np.array([1.0, 0.0, 1.0]), np.array([[0.9], [0.3], [0.2]]), 2 / 3),         # binary: last axis 1
    (np.array([2, 0, 1]), np.array([[0, 0, 1.0], [1, 0, 0], [0, 0, 1]]), 2 / 3),  # sparse: labels of lower rank
    (np.eye(3)[[2, 0, 1]], np.array([[0, 0, 1.0], [1, 0, 0], [0, 0, 1]]), 2 / 3),  # categorical: one-hot
])
def test_compile_accuracy_resolves_by_shapes_as_keras(y, out, expected):
    inputs = keras.Input(shape=(out.shape[1],))
    model = keras.Model(inputs, keras.layers.Activation("linear")(inputs))
    model.compile("sgd", None, metrics=["accuracy", "mae"])
    logs = model.evaluate(out.astype(np.float32), y, return_dict=True)
    np.testing.assert_allclose(logs["accuracy"], expected, rtol=1e-6)
    assert list(logs) == ["accuracy", "mae"]


def test_compile_metric_names():
    inputs = keras.Input(shape=(4,))
    model = keras.Model(inputs, keras.layers.Activation("linear")(inputs))
    model.compile("sgd", "mse", metrics=["mae", "mse", "root_mean_squared_error", keras.metrics.AUC()])
    assert [m.name for m in model.metrics] == ["loss", "mae", "mse", "root_mean_squared_error", "auc"]
    logs = model.evaluate(P, T, return_dict=True)
    np.testing.assert_allclose(logs["mae"], np.abs(T - P).mean(), rtol=1e-5)
    np.testing.assert_allclose(logs["mse"], ((T - P) ** 2).mean(), rtol=1e-5)
    np.testing.assert_allclose(logs["root_mean_squared_error"], np.sqrt(((T - P) ** 2).mean()), rtol=1e-5)


def test_a_batch_value_weighed_by_a_mask_counts_once_per_weighted_example():
    # TF's Transformer tutorial: masked_accuracy returns one value for the batch while fit weighs metrics by
    # the output's [batch, steps] mask; the value stands for each unmasked token (it raised on the shapes)
    metric = dtape.metrics.Mean()
    metric.update_state(dtape.constant(0.5), sample_weight=np.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    metric.update_state(dtape.constant(1.0), sample_weight=np.array([[1.0, 0.0, 0.0]]))
    assert float(metric.result()) == pytest.approx((0.5 * 3 + 1.0 * 1) / 4)
