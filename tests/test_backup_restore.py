"""BackupAndRestore: a fit killed mid-epoch and run again continues with the uninterrupted run's batch logs and
variables, bit for bit (one device and MirroredStrategy threads; torchrun in tests/multiprocess)."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import dtape
from dtape import keras
from tests._strategies import mirrored

pytestmark = pytest.mark.usefixtures("closes_strategies")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RNG = np.random.default_rng(3)
X = RNG.normal(size=(71, 5)).astype(np.float32)   # batches of 16: 16 16 16 16 7 per epoch (the last splits 4 / 3)
Y = RNG.integers(0, 3, 71)
EPOCHS = 3


class Killed(Exception):
    pass


class KillAfter(keras.callbacks.Callback):
    """Raises after the `n`-th training batch of the fit: the job dies there (no on_train_end)."""

    def __init__(self, n):
        super().__init__()
        self.n, self.seen = n, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.n:
            raise Killed(f"killed after batch {batch}")


class BatchLogs(keras.callbacks.Callback):
    """(epoch, batch, loss, accuracy) of every training batch, as the callbacks see them."""

    def __init__(self):
        super().__init__()
        self.rows, self.epoch = [], None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.rows.append((self.epoch, batch, logs["loss"], logs["accuracy"]))


def _model(strategy, seed):
    with strategy.scope():
        inputs = keras.Input(shape=(5,))
        hidden = keras.layers.Dropout(0.3)(keras.layers.Dense(8, activation="relu", seed=seed)(inputs))
        model = keras.Model(inputs, keras.layers.Dense(3, seed=seed + 1)(hidden))
        model.compile(keras.optimizers.Adam(0.05), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    return model


def _fit(strategy, seed, callbacks, data=None, **fit_kwargs):
    """A fresh model (initialised by `seed`) fitted with the callbacks; (model, batch logs, history or None).

    `data`: None (the arrays X, Y in batches of 16) or a function making a fresh dataset."""
    model, logs = _model(strategy, seed), BatchLogs()
    kwargs = dict(x=X, y=Y, batch_size=16) if data is None else dict(x=data(seed))
    kwargs.update(fit_kwargs)
    try:
        history = model.fit(**kwargs, epochs=EPOCHS, callbacks=callbacks + [logs], verbose=0)
    except Killed:
        history = None
    return model, logs.rows, history


def _seed(n):
    np.random.seed(n)      # fit's shuffle
    torch.manual_seed(n)   # dropout outside a strategy, a DataLoader's shuffle


def _strategy(replicas):
    return mirrored(replicas) if replicas > 1 else dtape.distribute.get_strategy()


def _killed_then_resumed(replicas, save_freq, kill_after, tmp_path, data=None, extra=(), **fit_kwargs):
    """(uninterrupted run, resumed run): each (model, batch logs, history); `extra`: callbacks of every run."""
    extra = list(extra)
    _seed(0)
    whole = _fit(_strategy(replicas), 1, extra, data, **fit_kwargs)
    _seed(0)
    backup = keras.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=save_freq)
    _, killed_rows, history = _fit(_strategy(replicas), 1, [backup, KillAfter(kill_after)] + extra, data, **fit_kwargs)
    assert history is None and len(killed_rows) == kill_after - 1   # the kill comes before BatchLogs
    assert os.path.exists(tmp_path / "backup" / "backup")          # a killed run keeps its backup
    _seed(99)                      # the restart's own seeds and initial weights are overwritten by the backup
    backup = keras.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=save_freq)
    resumed = _fit(_strategy(replicas), 7, [backup] + extra, data, **fit_kwargs)
    assert not os.path.exists(tmp_path / "backup")                  # deleted once fit completed
    return whole, resumed


def _assert_same_run(whole, resumed, first, history_from=None):
    (model, rows, history), (model2, rows2, history2) = whole, resumed
    history_from = first[0] if history_from is None else history_from
    assert rows2[0][:2] == first                   # (epoch, batch) the resumed fit started at
    assert rows2 == rows[-len(rows2):]             # every later batch log, exactly (==, not approx)
    for got, want in zip(model2.variables, model.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert history2.epoch == list(range(history_from, EPOCHS))
    for key, values in history2.history.items():
        assert values == history.history[key][history_from:], key


@pytest.mark.parametrize("replicas", [1, 2])
def test_killed_mid_epoch_resumes_at_the_backups_batch_with_the_same_losses(replicas, tmp_path):
    # backups after batches 3, 6, 9 (counted across epochs, as Keras 2); killed after 11: the 9th batch was
    # epoch 1's 4th (index 3), so the restart skips epoch 1's first four batches in the same shuffled order
    whole, resumed = _killed_then_resumed(replicas, 3, 11, tmp_path)
    _assert_same_run(whole, resumed, (1, 4))
    assert len(resumed[1]) == 1 + 5   # epoch 1's last batch, then epoch 2


def test_an_epoch_backup_resumes_at_the_next_epochs_start(tmp_path):
    whole, resumed = _killed_then_resumed(2, "epoch", 8, tmp_path)
    _assert_same_run(whole, resumed, (1, 0))


def test_a_backup_after_an_epochs_last_batch_ends_that_epoch_with_its_logs(tmp_path):
    # save_freq=5 saves after each epoch's last batch, before its end: the restart runs no batch of epoch 0
    # but still reports its logs (restored metrics), then goes on
    whole, resumed = _killed_then_resumed(1, 5, 6, tmp_path)
    _assert_same_run(whole, resumed, (1, 0), history_from=0)   # epoch 0's logs come from the restored metrics


def test_a_shuffling_dataloader_resumes_in_the_same_order(tmp_path):
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(X), torch.from_numpy(Y))

    def loader(seed):   # each run makes its own, as a restarted job does; the restart's seed (7) is overwritten
        return torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=True,
                                           generator=torch.Generator().manual_seed(seed))
    whole, resumed = _killed_then_resumed(2, 2, 7, tmp_path, data=loader)
    _assert_same_run(whole, resumed, (1, 1))


def test_delete_checkpoint_false_keeps_the_backup_and_bad_save_freq_is_refused(tmp_path):
    backup = keras.callbacks.BackupAndRestore(tmp_path / "b", save_freq="epoch", delete_checkpoint=False)
    _fit(dtape.distribute.get_strategy(), 1, [backup])
    assert os.path.exists(tmp_path / "b" / "backup")
    for bad in (0, -1, 1.5, "batch", None):
        with pytest.raises(ValueError, match="save_freq must be 'epoch' or a positive int"):
            keras.callbacks.BackupAndRestore(tmp_path / "c", save_freq=bad)


def test_replica_generator_states_restore_from_rows_of_one_tensor():
    # torch's Generator.set_state crashes the process on a view into a larger storage (a row of the gathered
    # tensor MultiWorkerMirroredStrategy.get_rng_state gives rank 1): run in a child process, so a crash fails
    # this test instead of killing the test run
    code = ("import torch, dtape\n"
            "s = dtape.distribute.MirroredStrategy(['cpu:0', 'cpu:1'])\n"
            "states = s.get_rng_state()\n"
            "s.set_rng_state(list(torch.stack(states).unbind(0)))\n"
            "assert all(torch.equal(a, b) for a, b in zip(s.get_rng_state(), states))\n"
            "s.close()\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_backup_of_two_replicas_is_refused_by_a_fit_without_the_strategy(tmp_path):
    backup = keras.callbacks.BackupAndRestore(tmp_path / "b", save_freq=2)
    _fit(mirrored(2), 1, [backup, KillAfter(3)])
    with pytest.raises(ValueError, match="written by a strategy of 2 replicas, this fit runs without one"):
        _fit(dtape.distribute.get_strategy(), 1, [keras.callbacks.BackupAndRestore(tmp_path / "b")])



@pytest.mark.parametrize("replicas", [1, 2])
def test_a_learning_rate_lowered_by_a_callback_is_restored_with_the_backup(replicas, tmp_path):
    # the schedule halves the *current* rate at each epoch's start: a restart that lost the rate lowered before
    # the backup would train epoch 1 at 0.025 instead of 0.0125 and drift from the uninterrupted run
    halve = keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5)
    whole, resumed = _killed_then_resumed(replicas, "epoch", 8, tmp_path, extra=[halve])
    _assert_same_run(whole, resumed, (1, 0))
    lr = resumed[0].optimizer.learning_rate
    assert float(lr) == float(whole[0].optimizer.learning_rate) == 0.05 * 0.5 ** EPOCHS
    for component in getattr(lr, "values", (lr,)):    # one value on every replica
        assert float(component.numpy()) == 0.05 * 0.5 ** EPOCHS


def _shuffled_loader(seed):   # batches of 18: 18 18 18 17, four per pass
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(X), torch.from_numpy(Y))
    return torch.utils.data.DataLoader(dataset, batch_size=18, shuffle=True,
                                       generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("replicas, data", [(1, None), (2, None), (2, _shuffled_loader)])
@pytest.mark.parametrize("save_freq, first", [(1, (1, 1)), ("epoch", (1, 0))])
def test_steps_per_epoch_resumes_inside_the_ongoing_pass(replicas, data, save_freq, first, tmp_path):
    # steps_per_epoch=2 of four batches a pass: epochs [a0 a1] [a2 a3] [b0 b1] (b a new shuffle). Killed after
    # 3 batches: the backup after a2 (save_freq=1) resumes at epoch 1's a3, the one after epoch 0 at a2 --
    # the pass drawn again and its done batches skipped, not epoch 1's first batches of a new pass
    fit_kwargs = dict(steps_per_epoch=2) if data else dict(steps_per_epoch=2, batch_size=18)
    whole, resumed = _killed_then_resumed(replicas, save_freq, 3, tmp_path, data, **fit_kwargs)
    _assert_same_run(whole, resumed, first)
    assert len(whole[1]) == 6 and len(resumed[1]) == 6 - 2 - first[1]
