"""Everyday idioms of Keras's guides ("Writing your own callbacks", the beginner tutorials) on dtape's fit."""
import numpy as np
import pytest

from dtape import keras
from tests._strategies import mirrored

pytestmark = pytest.mark.usefixtures("closes_strategies")

RNG = np.random.default_rng(5)
X = RNG.normal(size=(23, 4)).astype(np.float32)
Y = RNG.normal(size=(23, 1)).astype(np.float32)


def _model(seed=1):
    inputs = keras.Input(shape=(4,))
    model = keras.Model(inputs, keras.layers.Dense(1, seed=seed)(keras.layers.Dense(3, seed=seed + 1)(inputs)))
    model.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"])
    return model


def test_get_and_set_weights_round_trip_as_the_callbacks_guide():
    model = _model()
    best = model.get_weights()
    assert [w.shape for w in best] == [tuple(v.shape) for v in model.weights]
    model.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    assert np.abs(model.get_weights()[0] - best[0]).max() > 0
    model.set_weights(best)
    for w, v in zip(best, model.weights):
        np.testing.assert_array_equal(v.numpy(), w)
    with pytest.raises(ValueError, match="got 3 arrays for 4 weights"):
        model.set_weights(best[:3])
    with pytest.raises(ValueError, match=r"has shape \(4, 3\), got an array of shape \(3, 4\)"):
        model.set_weights([best[0].T] + best[1:])


def test_validation_split_holds_out_the_last_examples_unshuffled():
    split = _model().fit(X, Y, batch_size=8, epochs=2, verbose=0, shuffle=False, validation_split=0.3).history
    # floor(23 * 0.7) = 16 examples to train on, the last 7 to validate on
    given = _model().fit(X[:16], Y[:16], batch_size=8, epochs=2, verbose=0, shuffle=False,
                         validation_data=(X[16:], Y[16:])).history
    assert sorted(split) == ["loss", "mae", "val_loss", "val_mae"]
    np.testing.assert_allclose(split["val_loss"], given["val_loss"], rtol=1e-6)
    with pytest.raises(ValueError, match="validation_split is only supported for arrays"):
        _model().fit([(X, Y)], validation_split=0.2, verbose=0)


XB = RNG.normal(size=(13, 4)).astype(np.float32)   # batches of 4, 4, 4, 1: the last leaves a replica empty
YB = (XB[:, 0] > 0).astype(np.int64)               # 0/1 labels as a vector, one sigmoid unit: shapes [n] vs [n, 1]
SW = RNG.uniform(0.5, 2.0, size=13).astype(np.float32)


def _binary(strategy=None):
    def make():
        inputs = keras.Input(shape=(4,))
        model = keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid", seed=2)(inputs))
        model.compile("sgd", "binary_crossentropy", metrics=["accuracy"])
        return model
    if strategy is None:
        return make()
    with strategy.scope():
        return make()


@pytest.mark.parametrize("replicas", [1, 2])
def test_binary_accuracy_with_vector_labels_is_the_mean_over_examples(replicas):
    model = _binary(None if replicas == 1 else mirrored(replicas))
    hits = ((model.predict(XB, batch_size=4)[:, 0] > 0.5) == YB).astype(np.float64)
    got = model.evaluate(XB, YB, batch_size=4, return_dict=True)
    np.testing.assert_allclose(got["accuracy"], hits.mean(), rtol=1e-6)
    weighted = model.evaluate(XB, YB, batch_size=4, sample_weight=SW, return_dict=True)
    np.testing.assert_allclose(weighted["accuracy"], (hits * SW).sum() / SW.sum(), rtol=1e-6)


def test_model_checkpoint_keras_path_saves_the_model_load_model_reads(tmp_path):
    path = str(tmp_path / "best.model.keras")
    model = _model()
    model.compile(keras.optimizers.SGD(0.5), "mse")
    snapshots = []
    record = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: snapshots.append(
        (logs["val_loss"], model.predict(X, batch_size=8))))
    model.fit(X, Y, batch_size=8, epochs=4, verbose=0, validation_data=(X[:8], Y[:8]), callbacks=[
        keras.callbacks.ModelCheckpoint(path, monitor="val_loss", save_best_only=True), record])
    best = min(snapshots, key=lambda s: s[0])[1]
    np.testing.assert_allclose(keras.models.load_model(path).predict(X, batch_size=8), best, rtol=1e-6)


def test_model_checkpoint_save_freq_in_batches(tmp_path):
    model = _model()
    checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "ckpt-{epoch}.weights"), save_weights_only=True,
                                                 save_freq=2)
    model.fit(X, Y, batch_size=5, epochs=2, verbose=0, callbacks=[checkpoint])   # 5 batches an epoch
    assert [p[len(str(tmp_path)) + 1:] for p in checkpoint.saved] == ["ckpt-1.weights"] * 2 + ["ckpt-2.weights"] * 3
    again = _model(seed=9)
    again.load_weights(checkpoint.saved[-1])
    for a, b in zip(again.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="save_freq must be 'epoch' or a positive int"):
        keras.callbacks.ModelCheckpoint("x", save_freq=0)


def test_lambda_callback_hooks():
    seen = []
    callback = keras.callbacks.LambdaCallback(on_batch_end=lambda batch, logs: seen.append(("batch", batch)),
                                              on_epoch_end=lambda epoch, logs: seen.append(("epoch", epoch)),
                                              on_train_end=lambda logs: seen.append(sorted(logs)))
    _model().fit(X, Y, batch_size=12, epochs=2, verbose=0, callbacks=[callback])
    assert seen == [("batch", 0), ("batch", 1), ("epoch", 0), ("batch", 0), ("batch", 1), ("epoch", 1),
                    ["loss", "mae"]]
    with pytest.raises(TypeError, match="'on_epoch' is not a callback hook"):
        keras.callbacks.LambdaCallback(on_epoch=print)


def test_validation_freq_steps_and_batch_size():
    batches = []
    counter = keras.callbacks.LambdaCallback(on_test_batch_end=lambda batch, logs: batches.append(batch))
    history = _model().fit(X, Y, batch_size=8, epochs=4, verbose=0, validation_data=(X, Y), validation_freq=2,
                           validation_steps=2, validation_batch_size=5, callbacks=[counter]).history
    assert len(history["loss"]) == 4 and len(history["val_loss"]) == 2   # after epochs 2 and 4
    assert batches == [0, 1, 0, 1]
    model = _model()
    np.testing.assert_allclose(model.evaluate(X, Y, batch_size=5, steps=2), model.evaluate(X[:10], Y[:10]), rtol=1e-6)
    assert model.predict(X, batch_size=5, steps=2).shape == (10, 1)
    with pytest.raises(ValueError, match="validation_freq must be a positive int"):
        model.fit(X, Y, verbose=0, validation_data=(X, Y), validation_freq=0)
