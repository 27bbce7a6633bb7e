"""A small Transformer with masking on a synthetic reverse (or copy) task: TF's Transformer tutorial, ported to dtape.

As in the tutorial: a PositionalEmbedding layer (Embedding(mask_zero=True) plus sinusoidal positions, its mask passed
on with `compute_mask`), an encoder with self-attention, a decoder with causal self-attention and cross-attention,
Add + LayerNormalization around each, a feed-forward block, and `compile(loss=masked_loss,
metrics=[masked_accuracy])` + `fit`. The sequences have 1 to 8 symbols, padded with 0: the padding masks keep the
padding out of the attention, the loss and the accuracy.

    python examples/transformer_copy.py                  # reverse, 5 epochs: masked accuracy 1.0000
    python examples/transformer_copy.py --task copy

Prints `masked accuracy: 0.9xx` (teacher forcing, held-out sequences); with --out, writes `metrics.json` there.
"""
import argparse
import json
import os

import numpy as np

import dtape
from dtape import keras
from dtape.keras import layers

PAD, START, END = 0, 1, 2
VOCAB = 13            # padding, start, end and 10 symbols
MAX_LEN = 8           # symbols per sequence
D_MODEL, NUM_HEADS, DFF = 64, 4, 128


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["reverse", "copy"], default="reverse")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--train-size", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="a folder for metrics.json (nothing is written without it)")
    return parser.parse_args(argv)


def make_data(rng, n, task):
    """((context [n, MAX_LEN], target input [n, MAX_LEN + 1]), labels [n, MAX_LEN + 1]), int64, 0-padded."""
    context = np.zeros((n, MAX_LEN), np.int64)
    target = np.zeros((n, MAX_LEN + 2), np.int64)      # START, the answer, END, padding
    for i, length in enumerate(rng.integers(1, MAX_LEN + 1, n)):
        symbols = rng.integers(3, VOCAB, length)
        context[i, :length] = symbols
        target[i, 0], target[i, length + 1] = START, END
        target[i, 1:length + 1] = symbols[::-1] if task == "reverse" else symbols
    return (context, target[:, :-1]), target[:, 1:]


def positional_encoding(length, depth):
    positions = np.arange(length)[:, None]
    angle_rates = 1 / (10000 ** (np.arange(depth // 2)[None, :] / (depth // 2)))
    angles = positions * angle_rates
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1).astype(np.float32)


class PositionalEmbedding(layers.Layer):
    def __init__(self, vocab_size, d_model):
        super().__init__()
        self.d_model = d_model
        self.embedding = layers.Embedding(vocab_size, d_model, mask_zero=True)
        self.pos_encoding = dtape.constant(positional_encoding(length=64, depth=d_model))

    def compute_mask(self, *args, **kwargs):
        return self.embedding.compute_mask(*args, **kwargs)

    def call(self, x):
        length = dtape.shape(x)[1]
        x = self.embedding(x)
        x *= dtape.math.sqrt(dtape.cast(self.d_model, dtape.float32))   # the embedding's scale vs the positions
        return x + self.pos_encoding[dtape.newaxis, :length, :]


class PaddingMask(layers.Layer):
    """`ids != 0`, for the cross-attention's `value_mask` (see `make_model`)."""

    def call(self, ids):
        return dtape.not_equal(ids, PAD)


def add_and_norm(x, y):
    return layers.LayerNormalization()(layers.Add()([x, y]))


def feed_forward(x):
    y = layers.Dense(DFF, activation="relu")(x)
    return add_and_norm(x, layers.Dense(D_MODEL)(y))


def make_model():
    context = keras.Input((None,), dtype="int64", name="context")
    target_in = keras.Input((None,), dtype="int64", name="target_in")

    # Encoder: self-attention; the padding mask comes from the embedding (Keras's implicit masks).
    x = PositionalEmbedding(VOCAB, D_MODEL)(context)
    x = add_and_norm(x, layers.MultiHeadAttention(NUM_HEADS, D_MODEL // NUM_HEADS)(query=x, value=x, key=x))
    encoded = feed_forward(x)

    # Decoder: causal self-attention, then cross-attention to the encoded context.
    y = PositionalEmbedding(VOCAB, D_MODEL)(target_in)
    causal = layers.MultiHeadAttention(NUM_HEADS, D_MODEL // NUM_HEADS)(query=y, value=y, key=y,
                                                                        use_causal_mask=True)
    y = add_and_norm(y, causal)
    # Keras takes the value's mask from the encoded tensor itself; a dtape functional model passes a layer the
    # mask of its first input only, so the context's padding mask is given by name.
    cross = layers.MultiHeadAttention(NUM_HEADS, D_MODEL // NUM_HEADS)(query=y, value=encoded, key=encoded,
                                                                       value_mask=PaddingMask()(context))
    y = feed_forward(add_and_norm(y, cross))
    logits = layers.Dense(VOCAB)(y)
    return keras.Model([context, target_in], logits)


def masked_loss(label, pred):
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    loss = loss_object(label, pred)
    mask = dtape.cast(label != PAD, loss.dtype)
    return dtape.reduce_sum(loss * mask) / dtape.reduce_sum(mask)


def masked_accuracy(label, pred):
    pred = dtape.argmax(pred, axis=2)
    label = dtape.cast(label, pred.dtype)
    mask = label != PAD
    match = dtape.cast((label == pred) & mask, "float32")
    return dtape.reduce_sum(match) / dtape.reduce_sum(dtape.cast(mask, "float32"))


def main(argv=None):
    args = parse_args(argv)
    dtape.random.set_seed(args.seed)
    np.random.seed(args.seed)   # fit's shuffling
    rng = np.random.default_rng(args.seed)
    x_train, y_train = make_data(rng, args.train_size, args.task)
    x_val, y_val = make_data(rng, 500, args.task)
    x_test, y_test = make_data(rng, 1000, args.task)

    model = make_model()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=masked_loss, metrics=[masked_accuracy])
    model.fit(x_train, y_train, batch_size=64, epochs=args.epochs, validation_data=(x_val, y_val), verbose=2)

    # The accuracy over every non-padding token of the test set (evaluate's would be a mean of batch means).
    logits = model.predict(x_test, batch_size=250)
    accuracy = float(masked_accuracy(dtape.constant(y_test), dtape.constant(logits)))
    print(f"masked accuracy: {accuracy:.4f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "metrics.json"), "w") as f:
            json.dump({"task": args.task, "masked_accuracy": accuracy}, f)
    return accuracy


if __name__ == "__main__":
    main()
