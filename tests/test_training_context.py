"""`training` reaches inner layers as Keras's call context does: an explicit argument, else the mode of the
enclosing layer call on this thread, else the default of `call`; per thread, carried into strategy.run's
replicas and into recompute_grad's re-run; layer calls with extra positional inputs and mask=."""
import threading

import numpy as np
import pytest
import torch

import dtape
from dtape import distribute as ds
from dtape import layers
from tests._strategies import mirrored

pytestmark = pytest.mark.usefixtures("closes_strategies")

X = np.arange(64, dtype=np.float64).reshape(2, 32) / 10.0 + 1.0  # no zeros: a zero out is a dropped one


class Discriminator(layers.Layer):
    """The ported DCGAN's shape: Dropout and BatchNormalization called in `call` without `training`."""

    def __init__(self):
        super().__init__(dtype=torch.float64)
        self.drop = layers.Dropout(0.3)
        self.norm = layers.BatchNormalization(momentum=0.5, dtype=torch.float64)

    def call(self, x):
        return self.norm(self.drop(x))


def _dropped(y):
    return int((y.numpy() == 0).sum())


def test_a_training_call_reaches_dropout_and_batch_norm_inside_a_custom_layer():
    model = Discriminator()
    torch.manual_seed(0)
    y = model(X, training=True)
    torch.manual_seed(0)  # the same mask, drawn by the inner layers called explicitly
    expected = model.norm(model.drop(dtape.constant(X), training=True), training=True)
    assert _dropped(model.drop(dtape.constant(X), training=True)) > 0
    np.testing.assert_array_equal(y.numpy(), expected.numpy())
    # Two training updates from 0 with momentum 0.5: 0.25 * m1 + 0.5 * m2, both the same dropped batch's mean.
    torch.manual_seed(0)
    kept = model.drop(dtape.constant(X), training=True).numpy()
    np.testing.assert_allclose(model.norm.moving_mean.numpy(), 0.75 * kept.mean(axis=0), rtol=1e-12)


def test_the_dcgan_symptom_some_of_32_outputs_are_dropped():
    model = Discriminator()
    torch.manual_seed(1)
    out = model.drop(dtape.constant(X[:1]), training=True)  # reference: 32 outputs, p = 0.3
    torch.manual_seed(1)
    wrapped = layers.Sequential([_DropOnly(model.drop)])
    y = wrapped(X[:1], training=True)
    assert _dropped(y) == _dropped(out) > 0  # before: 0 of 32 dropped


class _DropOnly(layers.Layer):
    def __init__(self, drop):
        super().__init__(dtype=torch.float64)
        self.drop = drop

    def call(self, x):
        return self.drop(x)


def test_an_explicit_argument_inside_wins_and_nothing_leaks_after_the_call():
    class Explicit(layers.Layer):
        def __init__(self):
            super().__init__(dtype=torch.float64)
            self.drop = layers.Dropout(0.5)
            self.norm = layers.BatchNormalization(dtype=torch.float64)

        def call(self, x):
            return self.norm(self.drop(x, training=False), training=False)

    model = Explicit()
    y = model(X, training=True)
    np.testing.assert_allclose(y.numpy(), X / np.sqrt(1.0 + 1e-3), rtol=1e-12)  # moving stats 0 and 1
    np.testing.assert_array_equal(model.norm.moving_mean.numpy(), np.zeros(32))
    outer = Discriminator()
    np.testing.assert_array_equal(outer(X, training=False).numpy(), outer.norm(X).numpy())  # explicit False
    assert _dropped(outer.drop(X)) == 0  # after the calls: no mode left on the thread
    assert dtape._call_context.current_training() is None


def test_nested_modules_torch_modules_and_the_call_default():
    class Block(dtape.Module):  # a plain Module between two layer calls
        def __init__(self):
            super().__init__()
            self.drop = layers.Dropout(0.5)
            self.torch_drop = layers.TorchModule(torch.nn.Dropout(0.5))

        def __call__(self, x):
            return self.drop(x), self.torch_drop(x)

    class Outer(layers.Layer):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def call(self, x):
            return self.block(x)

    class TrainsByDefault(Outer):
        def call(self, x, training=True):
            return self.block(x)

    model = Outer()
    model.block.torch_drop.module.eval()
    x = np.ones((4, 64))
    a, b = model(x, training=True)
    assert _dropped(a) > 0 and _dropped(b) > 0
    a, b = model(x)
    assert _dropped(a) == 0 and _dropped(b) == 0  # no mode anywhere: Dropout's default, the module's own eval()
    a, b = TrainsByDefault()(x)  # call's own default reaches the inner layers
    assert _dropped(a) > 0 and _dropped(b) > 0
    with_block = TrainsByDefault()
    with_block.block = model.block
    a, b = with_block(x, training=False)  # explicit beats the default
    assert _dropped(a) == 0 and _dropped(b) == 0


def test_sequential_passes_the_mode_to_custom_layers_inside():
    model = layers.Sequential([_DropOnly(layers.Dropout(0.5)), layers.Dense(3, dtype=torch.float64)])
    x = np.ones((8, 16))
    torch.manual_seed(3)
    y = model(x, training=True)
    torch.manual_seed(3)
    hidden = model.layers[0].drop(dtape.constant(x), training=True)
    assert _dropped(hidden) > 0
    np.testing.assert_allclose(y.numpy(), model.layers[1](hidden).numpy(), rtol=1e-12)
    np.testing.assert_allclose(model(x).numpy(), model.layers[1](x).numpy(), rtol=1e-12)


def test_each_thread_has_its_own_mode():
    """A thread inside a training call does not make another thread's Dropout drop (forced interleaving)."""
    inside, checked = threading.Event(), threading.Event()
    seen = {}

    class Waits(layers.Layer):
        def call(self, x):
            inside.set()
            assert checked.wait(30)
            return layers.Dropout(0.5)(x)

    def other():
        assert inside.wait(30)
        seen["dropped"] = _dropped(layers.Dropout(0.5)(np.ones((4, 64))))
        seen["mode"] = dtape._call_context.current_training()
        checked.set()

    t = threading.Thread(target=other)
    t.start()
    y = Waits()(np.ones((4, 64)), training=True)
    t.join(30)
    assert not t.is_alive()
    assert seen == {"dropped": 0, "mode": None}
    assert _dropped(y) > 0


def test_replicas_see_their_own_training_call_and_the_callers_mode():
    dropped = {}

    class Keeps(Discriminator):
        def call(self, x):
            kept = self.drop(x)
            dropped[ds.get_replica_context().replica_id_in_sync_group] = kept.numpy()
            return self.norm(kept)

    strategy = mirrored(2)
    with strategy.scope():
        model = Keeps()
        model.build((None, 32))
    halves = ds.PerReplica((dtape.constant(X[:1]), dtape.constant(X[1:])))
    strategy.run(lambda x: model(x, training=True), args=(halves,))
    assert _dropped(dtape.constant(dropped[0])) > 0 and _dropped(dtape.constant(dropped[1])) > 0
    # Each replica's BatchNormalization trained: the moving mean is 0.5 * the global batch's (dropped) mean.
    expected = 0.5 * np.concatenate([dropped[0], dropped[1]]).mean(axis=0)
    for component in model.norm.moving_mean.values:
        np.testing.assert_allclose(component.numpy(), expected, rtol=1e-12)

    seen = []

    def replica_step(x):
        seen.append((dtape._call_context.current_training(), _dropped(model.drop(x))))

    class RunsReplicas(layers.Layer):
        def call(self, x):
            strategy.run(replica_step, args=(x,))
            return x

    RunsReplicas()(np.ones((4, 64)), training=True)
    assert [m for m, _ in seen] == [True, True] and all(n > 0 for _, n in seen)
    seen.clear()
    strategy.run(replica_step, args=(dtape.ones([4, 64]),))
    assert seen == [(None, 0), (None, 0)]  # a long-lived replica thread keeps no previous step's mode


def test_recompute_grad_replays_the_forwards_mode():
    drop = layers.Dropout(0.5)
    block = dtape.recompute_grad(lambda x: drop(x) * x)

    class Outer(layers.Layer):
        def call(self, x):
            return block(x)

    x = dtape.constant(np.linspace(0.5, 2.0, 64))
    with dtape.GradientTape() as tape:
        tape.watch(x)
        y = Outer()(x, training=True)
    g = tape.gradient(y, x)  # taken outside the training call: the re-run must drop the same entries
    kept = y.numpy() != 0
    assert 0 < kept.sum() < 64
    np.testing.assert_allclose(g.numpy(), np.where(kept, 4.0 * x.numpy(), 0.0), rtol=1e-12)


def test_extra_positional_inputs_and_mask():
    class Cross(layers.Layer):
        def call(self, x, context, mask=None, scale=1.0):
            out = (x + context) * scale
            return out if mask is None else out * mask

    layer = Cross()
    y = layer(np.ones((2, 3)), torch.full((2, 3), 2.0), mask=dtape.constant([[1.0, 0.0, 1.0]] * 2), scale=2.0)
    np.testing.assert_array_equal(y.numpy(), [[6.0, 0.0, 6.0]] * 2)
    with pytest.raises(TypeError, match="no `mask` parameter"):
        layers.Dense(2)(np.ones((2, 3)), mask=dtape.ones([2, 3]))
    with pytest.raises(TypeError, match="with its input"):
        layers.Dense(2)()


def test_training_given_by_position_as_before():
    """`layer(x, True)` with `call(self, x, training=False)` is an explicit argument, as in Keras."""
    class Outer(layers.Layer):
        def call(self, x, training=False):
            return layers.Dropout(0.5)(x)

    x = np.ones((4, 64))
    assert _dropped(Outer()(x, True)) > 0 and _dropped(Outer()(x, False)) == 0
    norm = layers.BatchNormalization(momentum=0.5, dtype=torch.float64)
    norm(np.full((4, 3), 2.0), True)
    np.testing.assert_array_equal(norm.moving_mean.numpy(), [1.0, 1.0, 1.0])


def test_nested_inputs_build_with_nested_shapes():
    """TF's Transformer tutorial: `call(self, inputs)` with `context, x = inputs`."""
    seen = {}

    class Pair(layers.Layer):
        def build(self, input_shape):
            seen["shape"] = input_shape
            context_shape, x_shape = input_shape
            self.w = self.add_weight("w", (context_shape[-1], x_shape[-1]), "ones")

        def call(self, inputs):
            context, x = inputs
            return dtape.matmul(context, self.w) + x

    y = Pair()((np.ones((2, 3), np.float32), torch.ones(2, 4)))
    assert seen["shape"] == ((2, 3), (2, 4))
    np.testing.assert_array_equal(y.numpy(), np.full((2, 4), 4.0))
    nested_numbers = layers.Dense(1, kernel_initializer="ones")([[1.0, 2.0]])  # still one tensor, as before
    np.testing.assert_array_equal(nested_numbers.numpy(), [[3.0]])
