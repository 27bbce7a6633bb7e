"""ModelCheckpoint's Keras file names ("ckpt_{epoch}", "weights.{epoch:02d}-{val_loss:.2f}") are found by
`dtape.train.latest_checkpoint(folder)`, alongside CheckpointManager's numbered files."""
import os

import numpy as np
import pytest

import dtape
from dtape import keras

RNG = np.random.default_rng(5)
X = RNG.normal(size=(40, 4)).astype(np.float32)
Y = RNG.integers(0, 3, 40)


def _model(seed=1):
    inputs = keras.Input(shape=(4,))
    model = keras.Model(inputs, keras.layers.Dense(3, seed=seed)(inputs))
    model.compile(keras.optimizers.SGD(0.3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _weights(model):
    return [v.numpy().copy() for v in model.trainable_variables]


def test_latest_checkpoint_finds_the_last_keras_named_file_and_it_loads(tmp_path):
    model = _model()
    saver = keras.callbacks.ModelCheckpoint(str(tmp_path / "ckpt_{epoch}"), save_weights_only=True)
    model.fit(X, Y, epochs=3, verbose=0, callbacks=[saver], shuffle=False)
    assert saver.saved == [str(tmp_path / f"ckpt_{e}") for e in (1, 2, 3)]
    latest = dtape.train.latest_checkpoint(tmp_path)
    assert latest == str(tmp_path / "ckpt_3")
    fresh = _model(seed=9)
    fresh.load_weights(latest)
    for got, want in zip(_weights(fresh), _weights(model)):
        np.testing.assert_array_equal(got, want)


def test_formatted_names_with_logs_and_best_only(tmp_path):
    model = _model()
    saver = keras.callbacks.ModelCheckpoint(str(tmp_path / "weights.{epoch:02d}-{val_loss:.2f}"),
                                            save_best_only=True)
    history = model.fit(X, Y, epochs=3, verbose=0, callbacks=[saver], validation_data=(X, Y), shuffle=False)
    best = int(np.argmin(history.history["val_loss"]))
    want = tmp_path / f"weights.{best + 1:02d}-{history.history['val_loss'][best]:.2f}"
    assert saver.saved[-1] == str(want)
    assert dtape.train.latest_checkpoint(tmp_path) == str(want)


def test_numbered_and_keras_named_files_in_one_folder_newest_wins(tmp_path):
    model = _model()
    ckpt = dtape.checkpoint.Checkpoint(model=model)
    manager = dtape.train.CheckpointManager(ckpt, tmp_path, max_to_keep=2)
    manager.save()
    manager.save()                                        # ckpt-1, ckpt-2
    assert dtape.train.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-2")
    model.save_weights(tmp_path / "after_two")
    assert dtape.train.latest_checkpoint(tmp_path) == str(tmp_path / "after_two")
    manager.save()                                        # ckpt-3 (ckpt-1 deleted): newer than after_two
    assert dtape.train.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-3")
    assert manager.latest_checkpoint == str(tmp_path / "ckpt-3")
    assert manager.checkpoints == [str(tmp_path / "ckpt-2"), str(tmp_path / "ckpt-3")]   # TF's numbering kept
    model.fit(X, Y, epochs=1, verbose=0, callbacks=[keras.callbacks.ModelCheckpoint(str(tmp_path / "k{epoch}"))])
    assert dtape.train.latest_checkpoint(tmp_path) == str(tmp_path / "k1")
    assert dtape.train.latest_checkpoint(tmp_path, "ckpt") == str(tmp_path / "ckpt-3")   # by name: numbered only
    os.remove(tmp_path / "k1")                             # the recorded file gone: the numbered one
    assert dtape.train.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-3")


def test_a_file_named_like_the_state_file_or_a_missing_key_is_refused(tmp_path):
    with pytest.raises(ValueError, match="may not be named 'checkpoint'"):
        keras.callbacks.ModelCheckpoint(str(tmp_path / "checkpoint"))
    with pytest.raises(ValueError, match="may not be named 'checkpoint'"):
        _model().save_weights(tmp_path / "checkpoint")
    saver = keras.callbacks.ModelCheckpoint(str(tmp_path / "w{epoch}-{val_loss:.2f}"))
    with pytest.raises(KeyError, match="uses 'val_loss', which is not in the logs"):
        _model().fit(X, Y, epochs=1, verbose=0, callbacks=[saver])
    assert dtape.train.latest_checkpoint(tmp_path) is None


class _EpochWeights(keras.callbacks.Callback):
    """The trainable weights at each epoch's end."""

    def __init__(self):
        super().__init__()
        self.by_epoch = []

    def on_epoch_end(self, epoch, logs=None):
        self.by_epoch.append(_weights(self.model))


def test_a_keras_name_saves_the_whole_model_that_load_model_rebuilds(tmp_path):
    model, seen = _model(), _EpochWeights()
    saver = keras.callbacks.ModelCheckpoint(str(tmp_path / "m{epoch}.keras"), monitor="loss", save_best_only=True)
    model.fit(X, Y, epochs=3, verbose=0, callbacks=[seen, saver], shuffle=False)
    assert saver.saved == [str(tmp_path / f"m{e}.keras") for e in (1, 2, 3)]     # the loss falls every epoch
    assert dtape.train.latest_checkpoint(tmp_path) is None        # archives are not checkpoints
    for epoch, path in enumerate(saver.saved):
        loaded = keras.models.load_model(path)
        for got, want in zip(_weights(loaded), seen.by_epoch[epoch]):
            np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(loaded.predict(X, verbose=0), model.predict(X, verbose=0))
    fresh = _model(seed=9)                      # Keras 3: load_weights reads a .keras file's weights too
    fresh.load_weights(saver.saved[0])
    for got, want in zip(_weights(fresh), seen.by_epoch[0]):
        np.testing.assert_array_equal(got, want)


def test_weights_h5_names_are_dtape_checkpoints_and_hdf5_models_are_refused(tmp_path):
    model = _model()
    saver = keras.callbacks.ModelCheckpoint(str(tmp_path / "best.weights.h5"), save_weights_only=True)
    model.fit(X, Y, epochs=1, verbose=0, callbacks=[saver])
    with open(tmp_path / "best.weights.h5", "rb") as f:
        assert f.read(8) != b"\x89HDF\r\n\x1a\n"          # not HDF5: a checkpoint read by load_weights
    fresh = _model(seed=9)
    fresh.load_weights(str(tmp_path / "best.weights.h5"))
    for got, want in zip(_weights(fresh), _weights(model)):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"ends in \.keras, a whole model, but save_weights_only=True"):
        keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras"), save_weights_only=True)
    for name in ("model.h5", "weights.{epoch:02d}-{val_loss:.2f}.hdf5"):
        with pytest.raises(ValueError, match=r"HDF5 whole model .*which dtape does not write; use a name ending in "
                                             r"\.keras"):
            keras.callbacks.ModelCheckpoint(str(tmp_path / name))


def test_a_sequential_models_keras_file_loads_with_load_model_and_load_weights(tmp_path):
    model = keras.Sequential([keras.layers.Dense(3, input_shape=(4,), seed=1)])
    model.compile(keras.optimizers.SGD(0.3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(X, Y, epochs=1, verbose=0, callbacks=[keras.callbacks.ModelCheckpoint(str(tmp_path / "s.keras"))])
    fresh = keras.Sequential([keras.layers.Dense(3, input_shape=(4,), seed=2)])
    fresh.load_weights(str(tmp_path / "s.keras"))
    for loaded in (fresh, keras.models.load_model(tmp_path / "s.keras")):
        for got, want in zip(_weights(loaded), _weights(model)):
            np.testing.assert_array_equal(got, want)
