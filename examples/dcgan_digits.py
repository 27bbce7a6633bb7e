"""A DCGAN on handwritten digits: TF's DCGAN tutorial (tutorials/generative/dcgan), ported to dtape.

As in the tutorial: a generator (Dense, Reshape, Conv2DTranspose, BatchNormalization, LeakyReLU) and a
discriminator (Conv2D, LeakyReLU, Dropout, Flatten, Dense), two GradientTapes, two Adam optimizers and a
`@dtape.function` train step. The data is scikit-learn's 8x8 digits (the tutorial: MNIST 28x28), so the
generator upsamples 4x4 to 8x8 once, and the models are smaller. Unlike the tutorial, Adam uses 2e-4 and
beta_1=0.5 (the DCGAN paper's settings), which trains in fewer steps.

    python examples/dcgan_digits.py --out runs/dcgan     # 50 epochs, 1400 steps: about 2 minutes on 2 CPU cores

Writes `OUT/dcgan_digits.png` (64 generated digits, 8 by 8), `OUT/samples.npy` and `OUT/samples.json`, and
prints how a classifier trained on the real digits reads the samples (how many different digits, how sure it
is): the check that the generator did not collapse to one image.
"""
import argparse
import json
import os

import matplotlib
import numpy as np
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression

import dtape
from dtape import keras
from dtape.keras import layers

matplotlib.use("Agg")   # files only, no display
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

NOISE_DIM = 64


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/dcgan", help="folder for dcgan_digits.png and samples.json")
    return parser.parse_args(argv)


def load_images():
    """The 1797 digits as [n, 8, 8, 1] float32 in [-1, 1] (the pixels are 0..16), and their labels."""
    x, y = load_digits(return_X_y=True)
    return (x.reshape(-1, 8, 8, 1) / 8.0 - 1.0).astype(np.float32), y


def make_generator_model():
    model = keras.Sequential()
    model.add(layers.Dense(4 * 4 * 64, use_bias=False, input_shape=(NOISE_DIM,)))
    model.add(layers.BatchNormalization())
    model.add(layers.LeakyReLU())
    model.add(layers.Reshape((4, 4, 64)))
    assert model.output_shape == (None, 4, 4, 64)   # None is the batch size
    model.add(layers.Conv2DTranspose(32, (5, 5), strides=(1, 1), padding="same", use_bias=False))
    assert model.output_shape == (None, 4, 4, 32)
    model.add(layers.BatchNormalization())
    model.add(layers.LeakyReLU())
    model.add(layers.Conv2DTranspose(1, (5, 5), strides=(2, 2), padding="same", use_bias=False,
                                     activation="tanh"))
    assert model.output_shape == (None, 8, 8, 1)
    return model


def make_discriminator_model():
    model = keras.Sequential()
    model.add(layers.Conv2D(32, (5, 5), strides=(2, 2), padding="same", input_shape=[8, 8, 1]))
    model.add(layers.LeakyReLU())
    model.add(layers.Dropout(0.3))
    model.add(layers.Conv2D(64, (5, 5), strides=(2, 2), padding="same"))
    model.add(layers.LeakyReLU())
    model.add(layers.Dropout(0.3))
    model.add(layers.Flatten())
    model.add(layers.Dense(1))
    return model


cross_entropy = keras.losses.BinaryCrossentropy(from_logits=True)


def discriminator_loss(real_output, fake_output):
    real_loss = cross_entropy(dtape.ones_like(real_output), real_output)
    fake_loss = cross_entropy(dtape.zeros_like(fake_output), fake_output)
    return real_loss + fake_loss


def generator_loss(fake_output):
    return cross_entropy(dtape.ones_like(fake_output), fake_output)


def train(images, epochs, batch_size, seed):
    dtape.random.set_seed(seed)
    generator, discriminator = make_generator_model(), make_discriminator_model()
    generator_optimizer = keras.optimizers.Adam(2e-4, beta_1=0.5)
    discriminator_optimizer = keras.optimizers.Adam(2e-4, beta_1=0.5)

    @dtape.function
    def train_step(real_images):
        noise = dtape.random.normal([real_images.shape[0], NOISE_DIM])
        with dtape.GradientTape() as gen_tape, dtape.GradientTape() as disc_tape:
            generated_images = generator(noise, training=True)
            real_output = discriminator(real_images, training=True)
            fake_output = discriminator(generated_images, training=True)
            gen_loss = generator_loss(fake_output)
            disc_loss = discriminator_loss(real_output, fake_output)
        gradients_of_generator = gen_tape.gradient(gen_loss, generator.trainable_variables)
        gradients_of_discriminator = disc_tape.gradient(disc_loss, discriminator.trainable_variables)
        generator_optimizer.apply_gradients(zip(gradients_of_generator, generator.trainable_variables))
        discriminator_optimizer.apply_gradients(zip(gradients_of_discriminator, discriminator.trainable_variables))
        return gen_loss, disc_loss

    rng = np.random.default_rng(seed)
    for epoch in range(epochs):
        order = rng.permutation(len(images))
        for start in range(0, len(images) - batch_size + 1, batch_size):   # full batches only
            gen_loss, disc_loss = train_step(dtape.constant(images[order[start:start + batch_size]]))
        if (epoch + 1) % 10 == 0 or epoch + 1 == epochs:
            print(f"epoch {epoch + 1}: generator loss {float(gen_loss):.3f}, discriminator loss {float(disc_loss):.3f}")
    return generator


def read_samples(samples, images, labels):
    """How a classifier of real digits reads the samples: {digit classes found, mean confidence, ...}."""
    classifier = LogisticRegression(max_iter=2000).fit(images.reshape(len(images), -1), labels)
    probs = classifier.predict_proba(samples.reshape(len(samples), -1))
    classes = probs.argmax(1)
    spread = np.mean([np.linalg.norm(a - b) for i, a in enumerate(samples) for b in samples[i + 1:]])
    return {"classes": sorted(set(classes.tolist())), "counts": np.bincount(classes, minlength=10).tolist(),
            "mean_confidence": float(probs.max(1).mean()), "mean_pairwise_distance": float(spread)}


def save_grid(samples, path):
    fig = plt.figure(figsize=(6, 6))
    for i, image in enumerate(samples):
        plt.subplot(8, 8, i + 1)
        plt.imshow(image[:, :, 0] * 127.5 + 127.5, cmap="gray", vmin=0, vmax=255)
        plt.axis("off")
    plt.savefig(path)
    plt.close(fig)


def main(argv=None):
    args = parse_args(argv)
    images, labels = load_images()
    generator = train(images, args.epochs, args.batch_size, args.seed)
    seed_noise = dtape.random.normal([64, NOISE_DIM], seed=args.seed)   # the tutorial's fixed `seed` for the grid
    samples = generator(seed_noise, training=False).numpy()
    os.makedirs(args.out, exist_ok=True)
    save_grid(samples, os.path.join(args.out, "dcgan_digits.png"))
    np.save(os.path.join(args.out, "samples.npy"), samples)
    report = read_samples(samples, images, labels)
    with open(os.path.join(args.out, "samples.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"samples read as {len(report['classes'])} different digits {report['classes']}, "
          f"mean confidence {report['mean_confidence']:.2f}")
    print(f"wrote {os.path.join(args.out, 'dcgan_digits.png')}")
    return report


if __name__ == "__main__":
    main()
