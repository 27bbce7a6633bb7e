"""Worker script for test_backup_multi_worker.py: BackupAndRestore under MultiWorkerMirroredStrategy.

Each worker first fits without interruption (once; its batch logs and variables to $OUT/whole<rank>.json), then
fits the same model with BackupAndRestore(save_freq=2); on torchrun's first attempt rank 1 SIGKILLs itself after
the 7th batch, torchrun restarts both workers and the second fit resumes from the backup
($OUT/resumed<rank>_<attempt>.json). Every fit starts from the same seeds and replica generator states.
With a second argument "steps": batches of 18 (four a pass), steps_per_epoch=2 for 3 epochs (epoch 1 continues
the pass epoch 0 started), a backup after every batch and rank 1 killed after the 3rd.
"""
import json
import os
import signal
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dtape  # noqa: E402
from dtape import keras  # noqa: E402

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ["RANK"])
STEPS = len(sys.argv) > 2 and sys.argv[2] == "steps"
KILL_AFTER = 3 if STEPS else 7
FIT = dict(batch_size=18, epochs=3, steps_per_epoch=2) if STEPS else dict(batch_size=16, epochs=2)


class KillRank1(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if ATTEMPT == 0 and RANK == 1 and self.seen == KILL_AFTER:
            os.kill(os.getpid(), signal.SIGKILL)


class BatchLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.rows, self.epoch = [], None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        self.rows.append([self.epoch, batch, logs["loss"], logs["accuracy"]])


def fit(strategy, replica_states, callbacks):
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(71, 5)).astype(np.float32), rng.integers(0, 3, 71)
    np.random.seed(0)
    torch.manual_seed(0)
    strategy.set_rng_state(replica_states)
    with strategy.scope():
        inputs = keras.Input(shape=(5,))
        hidden = keras.layers.Dropout(0.3)(keras.layers.Dense(8, activation="relu", seed=1)(inputs))
        model = keras.Model(inputs, keras.layers.Dense(3, seed=2)(hidden))
        model.compile(keras.optimizers.Adam(0.05), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    logs = BatchLogs()
    model.fit(x, y, **FIT, callbacks=callbacks + [logs], verbose=0)
    return {"rows": logs.rows, "variables": [v.numpy().tolist() for v in model.variables]}


def write(path, value):
    with open(path, "w") as f:
        json.dump(value, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = sys.argv[1]
    strategy = dtape.distribute.MultiWorkerMirroredStrategy()
    states = strategy.get_rng_state()
    if ATTEMPT == 0:
        write(os.path.join(out, f"whole{RANK}.json"), fit(strategy, states, []))
    backup = keras.callbacks.BackupAndRestore(os.path.join(out, "backup"), save_freq=1 if STEPS else 2)
    resumed = fit(strategy, states, [backup, KillRank1()])
    folder = os.path.join(out, "backup")
    resumed["backup_left"] = sorted(os.listdir(folder)) if os.path.exists(folder) else None   # None: deleted
    write(os.path.join(out, f"resumed{RANK}_{ATTEMPT}.json"), resumed)
