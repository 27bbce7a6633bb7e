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
