"""The examples under examples/ run as a user runs them (a subprocess on this checkout) and reach their results:
digits under MirroredStrategy with fit (test accuracy > 0.9), the DCGAN (samples that are different digits, not one
collapsed image), the Transformer (masked accuracy > 0.9). Shorter runs than the defaults, same checks."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression

import dtape

ROOT = Path(__file__).resolve().parents[1]
# One thread per process: the suite runs on two shared cores, where torch's thread pool only adds waiting.
ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MPLBACKEND="Agg")


def run_example(name, *args, timeout=1200):   # a guard against a hang only: the machine may be loaded
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name), *map(str, args)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_digits_fit_under_mirrored_strategy_reaches_the_documented_accuracy(tmp_path):
    out = run_example("digits_fit_mirrored.py", "--epochs", 10, "--out", tmp_path)
    result = json.loads((tmp_path / "history.json").read_text())
    assert "Number of devices: 2" in out
    assert len(result["history"]["val_accuracy"]) == 10
    assert result["test_accuracy"] > 0.9, out
    assert f"test accuracy: {result['test_accuracy']:.4f}" in out


def _digit_reader():
    """A classifier of the real 8x8 digits in the generator's range [-1, 1], and the real images."""
    x, y = load_digits(return_X_y=True)
    x = x / 8.0 - 1.0
    return LogisticRegression(max_iter=2000).fit(x, y), x


def test_dcgan_samples_are_many_different_digits_not_one_collapsed_image(tmp_path):
    out = run_example("dcgan_digits.py", "--epochs", 15, "--out", tmp_path)
    samples = np.load(tmp_path / "samples.npy")
    assert samples.shape == (64, 8, 8, 1) and np.abs(samples).max() <= 1.0
    flat = samples.reshape(64, -1)
    reader, real = _digit_reader()
    probs = reader.predict_proba(flat)
    counts = np.bincount(probs.argmax(1), minlength=10)
    # A collapsed generator gives one class and near-zero distances between samples (spread 0.0 to 0.09 of the
    # real digits'); an untrained one or noise is far from every real digit (2.7 to 3.1 times as far as real
    # digits are from each other) and read with little confidence. These are several digits, near real ones.
    assert (counts > 0).sum() >= 6 and counts.max() <= 32, counts
    assert probs.max(1).mean() > 0.7, probs.max(1).mean()
    spread = np.linalg.norm(flat[:, None] - flat[None], axis=-1)[np.triu_indices(64, 1)].mean()
    real_spread = np.linalg.norm(real[:64, None] - real[None, :64], axis=-1)[np.triu_indices(64, 1)].mean()
    assert spread > 0.5 * real_spread, (spread, real_spread)
    nearest = np.linalg.norm(flat[:, None] - real[None], axis=-1).min(1).mean()
    real_nearest = np.linalg.norm(real[:64, None] - real[None, 64:], axis=-1).min(1).mean()
    assert nearest < 1.6 * real_nearest, (nearest, real_nearest)
    png = tmp_path / "dcgan_digits.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {png}" in out


def test_transformer_masked_accuracy_passes_0_9(tmp_path):
    out = run_example("transformer_copy.py", "--epochs", 3, "--out", tmp_path)
    accuracy = json.loads((tmp_path / "metrics.json").read_text())["masked_accuracy"]
    assert accuracy > 0.9, out
    assert f"masked accuracy: {accuracy:.4f}" in out


def test_transformer_masks_padding_and_the_future():
    """The example's masks keep the padding out: more padding on the context and on the target input leaves every
    kept token's logits as they were (the encoder's self-attention, the cross-attention and the causal decoder);
    and the causal mask: a later target token changes no earlier logits."""
    spec = importlib.util.spec_from_file_location("transformer_copy", ROOT / "examples" / "transformer_copy.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    dtape.random.set_seed(0)
    model = example.make_model()
    (context, target_in), _ = example.make_data(np.random.default_rng(1), 16, "reverse")
    logits = model((context, target_in)).numpy()
    padded = model((np.pad(context, ((0, 0), (0, 5))), np.pad(target_in, ((0, 0), (0, 3))))).numpy()
    kept = target_in != 0
    np.testing.assert_allclose(padded[:, :target_in.shape[1]][kept], logits[kept], rtol=1e-4, atol=1e-5)
    changed = target_in.copy()
    changed[:, 3:] = 5
    later = model((context, changed)).numpy()
    np.testing.assert_allclose(later[:, :3], logits[:, :3], rtol=1e-4, atol=1e-5)
    assert np.abs(later[:, 3:] - logits[:, 3:]).max() > 1e-3
