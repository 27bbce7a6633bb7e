"""fit(steps_per_epoch=k) takes the next k batches of the ongoing pass over the data, as Keras 2 and 3 do: the
iterator continues across epochs and a new pass (a new shuffle) starts only when one is exhausted; a pass that
runs out mid-epoch ends that epoch early with a warning (keras/src/trainers/epoch_iterator.py)."""
import warnings

import numpy as np
import pytest
import torch

import dtape
from dtape import keras
from tests._strategies import mirrored

pytestmark = pytest.mark.usefixtures("closes_strategies")

X = np.arange(24, dtype=np.float32).reshape(24, 1)   # each example's value is its index
Y = np.zeros((24, 1), np.float32)


class Recorder(keras.Model):
    """Records the first value of each replica's part of every batch it trains on."""

    def __init__(self):
        super().__init__()
        self.dense, self.seen = keras.layers.Dense(1), []

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x = data[0]
        self.seen.append(float(np.asarray(x.numpy() if hasattr(x, "numpy") else x)[0, 0]))
        return super().train_step(data)


def _fit(x, replicas=1, **kwargs):
    strategy = mirrored(replicas) if replicas > 1 else dtape.distribute.get_strategy()
    with strategy.scope():
        model = Recorder()
        model.compile(keras.optimizers.SGD(0.001), "mse")
    model.fit(x, **kwargs, verbose=0)
    return model.seen


def _loader(batch_size=4):   # 24 / 4: six batches, unshuffled
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.from_numpy(X), torch.from_numpy(Y)),
                                       batch_size=batch_size)


class Endless:
    """An iterable without len() (a generator-making object): 6 batches of 4 per pass."""

    def __iter__(self):
        return ((X[i:i + 4], Y[i:i + 4]) for i in range(0, 24, 4))


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_epochs_continue_one_pass_of_a_dataloader(replicas):
    seen = _fit(_loader(), replicas, epochs=3, steps_per_epoch=2)
    if replicas == 2:   # replica 0 gets rows 0-1 of each global batch of 4, replica 1 rows 2-3
        seen = [v for v in seen if v % 4 == 0]
    assert seen == [0, 4, 8, 12, 16, 20]     # batches 0 1 | 2 3 | 4 5, not 0 1 | 0 1 | 0 1


def test_a_pass_that_runs_out_mid_epoch_ends_it_with_a_warning_and_a_new_pass_follows():
    for data in (_loader(), Endless()):
        with pytest.warns(UserWarning, match="ran out of data after 6 batches"):
            seen = _fit(data, epochs=3, steps_per_epoch=4)
        assert seen == [0, 4, 8, 12, 16, 20, 0, 4, 8, 12]    # 4 | 2 (ran out) | 4 of the next pass


def test_a_pass_ending_with_the_epoch_gives_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _fit(_loader(), epochs=4, steps_per_epoch=3) == [0, 4, 8, 12, 16, 20] * 2


def test_arrays_continue_the_pass_and_reshuffle_only_for_the_next():
    assert _fit(X, y=Y, batch_size=4, shuffle=False, epochs=3, steps_per_epoch=2) == [0, 4, 8, 12, 16, 20]
    np.random.seed(0)
    seen = _fit(X, y=Y, batch_size=1, epochs=4, steps_per_epoch=12)   # two epochs per shuffled pass
    assert sorted(seen[:24]) == sorted(seen[24:]) == list(range(24))  # each pass: every example once
    assert seen[:24] != seen[24:]                                     # the second pass is a new shuffle


def test_arrays_without_batch_size_are_cut_into_steps_per_epoch_batches():
    # Keras: batch_size = ceil(n / steps_per_epoch) when only steps_per_epoch is given (not 32)
    assert _fit(X, y=Y, shuffle=False, epochs=2, steps_per_epoch=3) == [0, 8, 16] * 2


def test_bad_steps_per_epoch_is_refused():
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="steps_per_epoch must be a positive int"):
            _fit(_loader(), steps_per_epoch=bad)
