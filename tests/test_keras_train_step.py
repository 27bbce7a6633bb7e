"""A custom train_step with Keras 3's own trackers (`self.loss_tracker = keras.metrics.Mean(name="loss")` and a
`metrics` property), as Keras's "Customizing what happens in fit()" guide writes it, under MirroredStrategy.

What TF reports (Keras 2's result_wrapper / Keras 3's SUM-aggregated metric variables): a metric's `result()` is
read over every replica, so the logged "loss" is the tracker's weighted mean of every value any replica gave
`update_state` this epoch. Fed the per-example losses, that is the mean over the epoch's examples (as one device);
fed each replica's scaled loss (`compute_average_loss`: local sum / global batch) it is the mean of those parts,
one device's loss divided by the number of replicas (why TF's tutorials track `loss * num_replicas_in_sync`).
dtape reports the same: fit re-reads each metric of `model.metrics` over the replicas."""
import numpy as np
import pytest

import dtape
from dtape import keras
from tests._strategies import mirrored

pytestmark = pytest.mark.usefixtures("closes_strategies")

RNG = np.random.default_rng(2)
X = RNG.normal(size=(10, 3)).astype(np.float32)  # batches of 4, 4, 2
Y = RNG.normal(size=(10, 1)).astype(np.float32)


class CustomModel(keras.Model):
    def __init__(self, *args, track="examples", **kwargs):
        super().__init__(*args, **kwargs)
        self.track = track
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")

    def train_step(self, data):
        x, y = data
        with dtape.GradientTape() as tape:
            y_pred = self(x, training=True)
            per_example = keras.losses.mean_squared_error(y, y_pred)
            loss = dtape.nn.compute_average_loss(per_example)  # / the global batch: one device's gradient
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.loss_tracker.update_state(per_example if self.track == "examples" else loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


def _model(track="examples"):
    inputs = keras.Input(shape=(3,))
    model = CustomModel(inputs, keras.layers.Dense(1, seed=3)(inputs), track=track)
    model.compile(dtape.optimizers.SGD(0.1))
    return model


def _by_hand():
    """One device, plain numpy: the epoch's mean over examples of the squared errors before each step's update."""
    model = _model()
    w, b = (v.numpy().copy() for v in model.trainable_variables)
    errors, abs_errors = [], []
    for start in range(0, 10, 4):
        x, y = X[start:start + 4], Y[start:start + 4]
        pred = x @ w + b
        errors.extend(((pred - y) ** 2)[:, 0]), abs_errors.extend(np.abs(pred - y)[:, 0])
        grad = 2 * (pred - y) / len(x)
        w, b = w - 0.1 * x.T @ grad, b - 0.1 * grad.sum(0)
    return np.mean(errors), np.mean(abs_errors), w


def test_tracker_of_per_example_losses_reports_one_device_mean_under_two_replicas():
    loss, mae, w = _by_hand()
    one = _model().fit(X, Y, batch_size=4, shuffle=False, verbose=0).history
    strategy = mirrored(2)
    with strategy.scope():
        model = _model()
    two = model.fit(X, Y, batch_size=4, shuffle=False, verbose=0).history
    np.testing.assert_allclose([one["loss"][0], two["loss"][0]], [loss, loss], rtol=1e-5)
    np.testing.assert_allclose([one["mae"][0], two["mae"][0]], [mae, mae], rtol=1e-5)
    np.testing.assert_allclose(model.trainable_variables[0].numpy(), w, rtol=1e-5)


def test_tracker_of_scaled_replica_losses_reports_one_device_over_replicas_as_tf():
    one = _model(track="scaled").fit(X, Y, batch_size=4, shuffle=False, verbose=0).history
    strategy = mirrored(2)
    with strategy.scope():
        model = _model(track="scaled")
    two = model.fit(X, Y, batch_size=4, shuffle=False, verbose=0).history
    # one device: the mean of the 3 batch losses; two replicas: the mean of the 6 halves (each local sum / global
    # batch), so half of it, as TF reports (its tutorials multiply by num_replicas_in_sync before update_state).
    np.testing.assert_allclose(two["loss"][0], one["loss"][0] / 2, rtol=1e-5)
