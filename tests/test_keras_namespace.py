"""`dtape.keras`: the tf.keras-shaped namespace names dtape's own objects (identity, not copies), imports with
`from` statements, and TF 2 code ported by replacing `tf.keras` with `dtape.keras` runs with the right values."""
import importlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import dtape
import dtape.keras as keras

ROOT = Path(__file__).resolve().parents[1]

# dtape.keras submodule -> the dtape module whose objects it names.
NAMESPACES = {
    "layers": "dtape.layers",
    "losses": "dtape.losses",
    "metrics": "dtape.metrics",
    "regularizers": "dtape.regularizers",
    "mixed_precision": "dtape.mixed_precision",
    "optimizers": "dtape.optimizers",
    "optimizers.schedules": "dtape.optimizers_schedules",
    "models": "dtape.models",
    "callbacks": "dtape.callbacks",
}
# Names a keras module adds from elsewhere in dtape (as Keras places them).
EXTRAS = {"layers": {"TorchModule", "Input", "InputLayer"}, "optimizers": {"schedules", "LossScaleOptimizer"}}
# The names API.md lists under dtape.keras, and those that come with the Model API (compile/fit).
API_NAMES = ["layers", "Model", "Input", "Sequential", "optimizers", "optimizers.schedules", "losses", "metrics",
             "callbacks", "mixed_precision", "regularizers", "initializers"]
WITH_THE_MODEL_API = set()


@pytest.mark.parametrize("sub", sorted(NAMESPACES))
def test_every_name_is_the_core_object(sub):
    ours, core = importlib.import_module(f"dtape.keras.{sub}"), importlib.import_module(NAMESPACES[sub])
    extras = EXTRAS.get(sub, set())  # named from other dtape modules, checked below
    names = [n for n in ours.__all__ if n not in extras]
    assert set(names) == set(core.__all__) - extras  # every core name, and nothing of its own
    for name in names:
        assert getattr(ours, name) is getattr(core, name), name


def test_identity_of_the_usual_names():
    assert keras.layers.Dense is dtape.layers.Dense
    assert keras.layers.Layer is dtape.layers.Layer
    assert keras.layers.TorchModule is dtape.layers.TorchModule
    assert keras.Sequential is dtape.models.Sequential is keras.models.Sequential  # a Model: it has fit
    assert issubclass(keras.Sequential, dtape.layers.Sequential) and keras.layers.Sequential is dtape.layers.Sequential
    assert keras.Model is dtape.models.Model is keras.models.Model
    assert keras.Input is dtape.models.Input is keras.layers.Input
    assert keras.optimizers.Adam is dtape.optimizers.Adam
    assert keras.optimizers.LossScaleOptimizer is dtape.mixed_precision.LossScaleOptimizer
    assert keras.optimizers.schedules.ExponentialDecay is dtape.optimizers.schedules.ExponentialDecay
    assert keras.losses.SparseCategoricalCrossentropy is dtape.losses.SparseCategoricalCrossentropy
    assert keras.metrics.Mean is dtape.metrics.Mean
    assert keras.regularizers.l2 is dtape.regularizers.L2
    assert keras.initializers.get is dtape.layers.get_initializer
    for name in keras.initializers.__all__[1:]:
        assert getattr(keras.initializers, name) is getattr(dtape.layers, name), name
    assert keras.activations.relu is dtape.nn.relu and keras.activations.sigmoid is dtape.sigmoid
    assert keras.activations.get("relu") is dtape.nn.relu
    assert keras.activations.linear is dtape.layers.get_activation(None)
    assert dtape.keras is keras


def test_every_api_name_exists_or_comes_with_the_model_api():
    for name in API_NAMES:
        obj = keras
        for part in name.split("."):
            obj = getattr(obj, part, None)
        if name in WITH_THE_MODEL_API:
            assert obj is None, f"dtape.keras.{name} exists now: document it and drop it from the later set"
            assert name in keras.__doc__  # the package says when it comes
        else:
            assert obj is not None, f"dtape.keras.{name} is missing"


def test_from_imports_in_a_fresh_interpreter():
    """`from ... import` of each path, with nothing imported before (as a ported script starts)."""
    script = "\n".join([
        "import dtape",
        "assert dtape.keras.layers.Dense is dtape.layers.Dense  # tf.keras after import tensorflow",
        "from dtape.optimizers.schedules import ExponentialDecay, CosineDecay",
        "from dtape.keras.optimizers.schedules import ExponentialDecay as E2",
        "from dtape.keras.layers import Dense, Dropout, BatchNormalization, Layer",
        "from dtape.keras import layers, losses, metrics, optimizers, regularizers, initializers, mixed_precision",
        "from dtape.keras.losses import SparseCategoricalCrossentropy",
        "from dtape.keras.metrics import Mean",
        "from dtape.keras.regularizers import l2",
        "from dtape.keras.mixed_precision import LossScaleOptimizer",
        "from dtape.keras.optimizers import Adam, SGD",
        "import dtape.optimizers.schedules as s",
        "import dtape",
        "assert E2 is ExponentialDecay and s is dtape.optimizers.schedules and Dense is dtape.layers.Dense",
        "print('ok')",
    ])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_custom_layers_guide_ported_by_replacing_tf_keras():
    """TF's "Custom layers" guide, each `tf.` turned into `dtape.` (ResnetIdentityBlock subclasses Layer until
    the Model API exists); values and counts are the guide's."""
    tf = dtape

    class MyDenseLayer(tf.keras.layers.Layer):
        def __init__(self, num_outputs):
            super(MyDenseLayer, self).__init__()
            self.num_outputs = num_outputs

        def build(self, input_shape):
            self.kernel = self.add_weight("kernel", shape=[int(input_shape[-1]), self.num_outputs])

        def call(self, inputs):
            return tf.matmul(inputs, self.kernel)

    layer = MyDenseLayer(10)
    x = np.arange(50.0, dtype=np.float32).reshape(10, 5)
    np.testing.assert_allclose(layer(x).numpy(), x @ layer.kernel.numpy(), rtol=1e-5, atol=1e-5)
    assert [var.name.split("/")[-1] for var in layer.trainable_variables] == ["kernel"]

    class ResnetIdentityBlock(tf.keras.layers.Layer):
        def __init__(self, kernel_size, filters):
            super(ResnetIdentityBlock, self).__init__(name='')
            filters1, filters2, filters3 = filters
            self.conv2a = tf.keras.layers.Conv2D(filters1, (1, 1))
            self.bn2a = tf.keras.layers.BatchNormalization()
            self.conv2b = tf.keras.layers.Conv2D(filters2, kernel_size, padding='same')
            self.bn2b = tf.keras.layers.BatchNormalization()
            self.conv2c = tf.keras.layers.Conv2D(filters3, (1, 1))
            self.bn2c = tf.keras.layers.BatchNormalization()

        def call(self, input_tensor, training=False):
            x = self.conv2a(input_tensor)
            x = self.bn2a(x, training=training)
            x = tf.nn.relu(x)
            x = self.conv2b(x)
            x = self.bn2b(x, training=training)
            x = tf.nn.relu(x)
            x = self.conv2c(x)
            x = self.bn2c(x, training=training)
            x += input_tensor
            return tf.nn.relu(x)

    block = ResnetIdentityBlock(1, [1, 2, 3])
    _ = block(tf.zeros([1, 2, 3, 3]))
    assert len(block.variables) == 18
    my_seq = tf.keras.Sequential([tf.keras.layers.Conv2D(1, (1, 1), input_shape=(None, None, 3)),
                                  tf.keras.layers.BatchNormalization(),
                                  tf.keras.layers.Conv2D(2, 1, padding='same'),
                                  tf.keras.layers.BatchNormalization(),
                                  tf.keras.layers.Conv2D(3, (1, 1)),
                                  tf.keras.layers.BatchNormalization()])
    assert tuple(my_seq(tf.zeros([1, 2, 3, 3])).shape) == (1, 2, 3, 3)
    text = my_seq.summary(print_fn=lambda s: None)
    assert "Total params: 41" in text and "Trainable params: 29" in text and "Non-trainable params: 12" in text


def test_a_ported_training_loop_with_from_imports_matches_torch():
    """A TF 2 custom loop written against dtape.keras (Keras 3 add_weight, a schedule, a regularizer, a loss
    object, a metric), two steps, equals the same steps in torch float64."""
    from dtape.keras import layers, losses, metrics, optimizers, regularizers
    from dtape.keras.optimizers.schedules import ExponentialDecay

    class Linear(layers.Layer):  # Keras 3's add_weight: no name
        def __init__(self, units):
            super().__init__(dtype=torch.float64)
            self.units = units

        def build(self, input_shape):
            self.w = self.add_weight(shape=(input_shape[-1], self.units), initializer="random_normal",
                                     trainable=True)
            self.b = self.add_weight(shape=(self.units,), initializer="zeros", trainable=True)

        def call(self, inputs):
            return dtape.matmul(inputs, self.w) + self.b

    torch.manual_seed(0)
    model = keras.Sequential([layers.Dense(4, activation="relu", kernel_regularizer=regularizers.l2(1e-3),
                                           dtype=torch.float64), Linear(3)])
    optimizer = optimizers.SGD(learning_rate=ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5))
    loss_fn = losses.SparseCategoricalCrossentropy(from_logits=True)
    train_loss = metrics.Mean()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 5)), rng.integers(0, 3, size=8)
    model.build((None, 5))
    ref = [torch.tensor(v.numpy(), requires_grad=True) for v in model.trainable_variables]
    assert [v.name.split("/")[-1] for v in model.trainable_variables] == ["kernel", "bias", "variable", "variable"]

    for step in range(2):
        with dtape.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits) + dtape.add_n(model.losses)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        train_loss(loss)

        k, b, w, c = ref
        h = torch.relu(torch.tensor(x) @ k + b)
        ref_loss = torch.nn.functional.cross_entropy(h @ w + c, torch.tensor(y)) + 1e-3 * (k * k).sum()
        ref_loss.backward()
        with torch.no_grad():
            for v in ref:
                v -= 0.1 * 0.5 ** step * v.grad
                v.grad = None
        assert float(loss) == pytest.approx(float(ref_loss.detach()), rel=1e-12)
    for v, r in zip(model.trainable_variables, ref):
        np.testing.assert_allclose(v.numpy(), r.detach().numpy(), rtol=1e-12, atol=1e-15)
    assert int(optimizer.iterations) == 2 and train_loss.result().numpy() > 0


def test_initializer_classes_are_what_the_names_give():
    """`kernel_initializer=keras.initializers.RandomNormal(stddev=0.02)` (DCGAN-style ports) and the names."""
    init = keras.initializers
    for name, obj in [("random_normal", init.RandomNormal()), ("glorot_uniform", init.GlorotUniform()),
                      ("he_normal", init.HeNormal()), ("random_uniform", init.RandomUniform()),
                      ("truncated_normal", init.TruncatedNormal())]:
        by_name = keras.layers.Dense(7, kernel_initializer=name, input_dim=5, seed=4)
        by_object = keras.layers.Dense(7, kernel_initializer=obj, input_dim=5, seed=4)
        np.testing.assert_array_equal(by_name.kernel.numpy(), by_object.kernel.numpy())
    torch.manual_seed(0)
    expected = torch.randn(5, 7) * 0.02 + 1.0
    torch.manual_seed(0)
    dense = keras.layers.Dense(7, kernel_initializer=init.RandomNormal(mean=1.0, stddev=0.02), input_dim=5)
    np.testing.assert_array_equal(dense.kernel.numpy(), expected.numpy())
    seeded = init.RandomNormal(stddev=0.5, seed=11)
    assert torch.equal(seeded((100,)), seeded((100,)))  # Keras: a seeded initializer repeats its values
    t = init.TruncatedNormal(mean=1.0, stddev=0.5, seed=0)((10000,), torch.float64)
    assert t.dtype == torch.float64 and float(t.min()) >= 0.0 and float(t.max()) <= 2.0
    assert abs(float(t.mean()) - 1.0) < 0.02
    np.testing.assert_array_equal(init.Constant(0.25)((2, 3)).numpy(), np.full((2, 3), 0.25))
    u = init.RandomUniform(minval=2.0, maxval=3.0, seed=1)((1000,))
    assert 2.0 <= float(u.min()) and float(u.max()) < 3.0


def test_import_dtape_leaves_keras_for_first_use_and_keras_works_without_tensorboard():
    # `import dtape` should not load the training loop's progress bars and TensorBoard writer; and the
    # tensorboard package is optional: only the TensorBoard callback needs it, and says so
    code = ("import sys\n"
            "sys.modules['tensorboard'] = None\n"
            "sys.modules['torch.utils.tensorboard'] = None\n"
            "import dtape\n"
            "assert 'dtape.keras' not in sys.modules and 'dtape.callbacks' not in sys.modules\n"
            "assert dtape.keras.Model is dtape.models.Model\n"
            "try:\n"
            "    dtape.keras.callbacks.TensorBoard('logs')\n"
            "except ImportError as e:\n"
            "    assert 'pip install tensorboard' in str(e)\n"
            "else:\n"
            "    raise AssertionError('TensorBoard without tensorboard did not raise')\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
