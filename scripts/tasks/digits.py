"""Digits: scikit-learn's 8x8 handwritten digits (1797 images, 10 classes), an MLP 64-128-10.

Optional dropout (--dropout) after the hidden layer.

No download: the data ships with scikit-learn. Features are scaled to [0, 1];
the train/test split (80/20, stratified) is fixed by the seed.
"""
import numpy as np

import dtape

from . import DEFAULTS as _ALL_DEFAULTS

DEFAULTS = _ALL_DEFAULTS["digits"]
HIDDEN = 128


def load_data(seed):
    """The digits split for `seed`: x [n, 64] float32 in [0, 1], y [n] int64."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y.astype(np.int64), test_size=0.2, random_state=seed, stratify=y)
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}


def model_config(dropout=0.0):
    """The architecture settings build_model uses (compared on --resume)."""
    return {"layers": [64, HIDDEN, 10], "activation": "relu", "dropout": float(dropout)}


def build_model(seed, dropout=0.0):
    """An MLP 64 -> 128 (relu) -> dropout -> 10 logits; variables are created now (call in the strategy's scope)."""
    return dtape.layers.Sequential([
        dtape.layers.Dense(HIDDEN, activation="relu", input_dim=64, seed=seed),
        dtape.layers.Dropout(dropout),
        dtape.layers.Dense(10, input_dim=HIDDEN, seed=seed + 1),
    ], name="digits_mlp")


def per_example_loss(model, x, y):
    """Softmax cross entropy of each example in training mode: x [b, 64], y [b] -> [b]."""
    return dtape.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=model(x, training=True))


def accuracy(model, x, y):
    """Fraction of `x` whose arg-max logit is the label `y` (a Python float)."""
    logits = model(x).numpy()
    return float(np.mean(np.argmax(logits, axis=-1) == np.asarray(y)))
