"""Worker script for test_fit_multi_worker.py: Model.fit under MultiWorkerMirroredStrategy (2 torchrun workers),
71 examples in global batches of 32 (the last one, 7, splits 4 / 3), verbose=2 and a CSVLogger.

Writes $OUT/rank<r>.json: the history and the final variables. `run(strategy, out)` is also the one-device run.
"""
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dtape  # noqa: E402


def run(strategy, csv_path):
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(71, 5)).astype(np.float32), rng.integers(0, 3, 71)
    with strategy.scope():
        inputs = dtape.keras.Input(shape=(5,))
        hidden = dtape.keras.layers.Dense(8, activation="relu", seed=1)(inputs)
        model = dtape.keras.Model(inputs, dtape.keras.layers.Dense(3, seed=2)(hidden))
        model.compile(dtape.optimizers.SGD(0.5), dtape.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=2, validation_data=(x, y),
                        callbacks=[dtape.keras.callbacks.CSVLogger(csv_path)])
    return history.history, [v.numpy().tolist() for v in model.trainable_variables], model.predict(x).tolist()


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = sys.argv[1]
    history, variables, predicted = run(dtape.distribute.MultiWorkerMirroredStrategy(), os.path.join(out, "log.csv"))
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"history": history, "variables": variables, "predicted": predicted}, f)
