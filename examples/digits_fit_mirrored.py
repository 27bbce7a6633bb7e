"""Handwritten digits with `model.fit` under MirroredStrategy: TF's "Distributed training with Keras" tutorial, ported.

The TF 2 tutorial builds and compiles a Keras model inside `strategy.scope()` and calls `fit`: each global batch is
split over the replicas, the loss is divided by the global batch size and the gradients are summed across replicas.
Here the two replicas are CPU "devices" (threads) and the data is scikit-learn's 8x8 digits (1797 images).

    python examples/digits_fit_mirrored.py                 # 20 epochs: test accuracy about 0.97
    python examples/digits_fit_mirrored.py --epochs 5 --out runs/digits-fit

Prints one line per epoch and then `test accuracy: 0.9xx`; with --out, writes `history.json` there.
"""
import argparse
import json
import os

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import dtape
import dtape.distribute
from dtape import keras


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size-per-replica", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--devices", default="cpu:0,cpu:1", help="the replicas, comma-separated")
    parser.add_argument("--out", default=None, help="a folder for history.json (nothing is written without it)")
    return parser.parse_args(argv)


def load_data(seed):
    """Images [n, 8, 8, 1] float32 in [0, 1] and labels [n] int64: 70% train, 15% validation, 15% test."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
    y = y.astype(np.int64)
    x_train, x_rest, y_train, y_rest = train_test_split(x, y, test_size=0.3, stratify=y, random_state=seed)
    x_val, x_test, y_val, y_test = train_test_split(x_rest, y_rest, test_size=0.5, stratify=y_rest,
                                                    random_state=seed)
    return (x_train, y_train), (x_val, y_val), (x_test, y_test)


def make_model():
    inputs = keras.Input(shape=(8, 8, 1))
    x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(64, activation="relu")(x)
    outputs = keras.layers.Dense(10)(x)
    return keras.Model(inputs, outputs, name="digits_cnn")


def main(argv=None):
    args = parse_args(argv)
    dtape.random.set_seed(args.seed)   # the initial weights
    np.random.seed(args.seed)          # fit's shuffling (numpy's global generator, as in Keras)
    (x_train, y_train), validation, (x_test, y_test) = load_data(args.seed)

    strategy = dtape.distribute.MirroredStrategy(devices=args.devices.split(","))
    print(f"Number of devices: {strategy.num_replicas_in_sync}")
    global_batch = args.batch_size_per_replica * strategy.num_replicas_in_sync

    with strategy.scope():   # the variables, the optimizer's slots and the metrics are mirrored
        model = make_model()
        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])

    history = model.fit(x_train, y_train, batch_size=global_batch, epochs=args.epochs,
                        validation_data=validation, verbose=2)
    test_loss, test_accuracy = model.evaluate(x_test, y_test, batch_size=global_batch)
    strategy.close()
    print(f"test loss: {test_loss:.4f}")
    print(f"test accuracy: {test_accuracy:.4f}")

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "history.json"), "w") as f:
            json.dump({"history": history.history, "test_loss": test_loss, "test_accuracy": test_accuracy}, f,
                      indent=1)
    return test_accuracy


if __name__ == "__main__":
    main()
