"""Keras layers and optimizer pieces: pooling/reshape gradients vs torch float64, BatchNormalization
(synchronized across replicas = one device), input_shape/build/summary, regularizers and Module.losses,
RMSprop/Adagrad, schedules, clipping after aggregation, minimize without a tape, len() of a dataset."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dtape
from dtape import distribute as ds
from dtape import layers
from dtape.optimizers import schedules

RNG = np.random.default_rng(7)


@pytest.fixture
def strategy():
    return ds.MirroredStrategy(["cpu:0", "cpu:1"], timeout=30)


def _grad_vs_torch(layer, x, ref_fn):
    """Output and input gradient of sum(layer(x) * r) vs a torch float64 reference."""
    xt = dtape.constant(x)
    r = RNG.normal(size=ref_fn(torch.tensor(x)).shape)
    with dtape.GradientTape() as tape:
        tape.watch(xt)
        y = layer(xt)
        loss = dtape.reduce_sum(y * dtape.constant(r))
    gx = tape.gradient(loss, xt)
    ref_x = torch.tensor(x, requires_grad=True)
    ref_y = ref_fn(ref_x)
    (ref_y * torch.tensor(r)).sum().backward()
    np.testing.assert_allclose(y.numpy(), ref_y.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gx.numpy(), ref_x.grad.numpy(), rtol=1e-12, atol=1e-12)


def _windows(x, k, s, pad, fill):
    """NHWC reference: explicit TF padding (before, after) then every window, with unfold."""
    (top, bottom), (left, right) = pad
    xp = F.pad(x.permute(0, 3, 1, 2), (left, right, top, bottom), value=fill)
    return xp.unfold(2, k[0], s[0]).unfold(3, k[1], s[1])  # [n, c, oh, ow, kh, kw]


@pytest.mark.parametrize("padding, pads", [("valid", ((0, 0), (0, 0))), ("same", ((0, 1), (0, 1)))])
def test_max_pooling_matches_tf_definition_with_gradients(padding, pads):
    x = RNG.normal(size=(2, 5, 6, 3))  # same, stride 2, k (2,3): h 5 -> 3, pads (0,1); w 6 -> 3, pads (0,1)
    layer = layers.MaxPooling2D((2, 3), strides=2, padding=padding)
    ref = lambda x: _windows(x, (2, 3), (2, 2), pads, float("-inf")).amax(dim=(-1, -2)).permute(0, 2, 3, 1)  # noqa
    _grad_vs_torch(layer, x, ref)


def test_average_pooling_same_does_not_count_padding():
    x = RNG.normal(size=(1, 5, 5, 2))
    layer = layers.AveragePooling2D(2, padding="same")  # 5 -> 3, pads (0, 1)

    def ref(x):
        s = _windows(x, (2, 2), (2, 2), ((0, 1), (0, 1)), 0.0).sum(dim=(-1, -2))
        n = _windows(torch.ones_like(x), (2, 2), (2, 2), ((0, 1), (0, 1)), 0.0).sum(dim=(-1, -2))
        return (s / n).permute(0, 2, 3, 1)
    _grad_vs_torch(layer, x, ref)
    assert layer.compute_output_shape((None, 5, 5, 2)) == (None, 3, 3, 2)


def test_global_pooling_flatten_reshape_gradients():
    x = RNG.normal(size=(2, 3, 4, 5))
    _grad_vs_torch(layers.GlobalAveragePooling2D(), x, lambda x: x.mean(dim=(1, 2)))
    _grad_vs_torch(layers.GlobalMaxPooling2D(keepdims=True), x, lambda x: x.amax(dim=(1, 2), keepdim=True))
    _grad_vs_torch(layers.Flatten(), x, lambda x: x.reshape(2, 60))
    _grad_vs_torch(layers.Reshape((-1, 6)), x, lambda x: x.reshape(2, 10, 6))
    assert layers.Flatten()(dtape.zeros([3])).shape == (3, 1)
    with pytest.raises(ValueError, match="cannot reshape"):
        layers.Reshape((7,))(dtape.zeros([2, 3]))


# -- BatchNormalization ------------------------------------------------------------

def test_batch_norm_training_and_inference_follow_keras_formulas():
    x = RNG.normal(size=(6, 4)) * 3 + 2
    bn = layers.BatchNormalization(momentum=0.9, epsilon=1e-3, dtype=torch.float64)
    y = bn(x, training=True)
    mean, var = x.mean(0), x.var(0)  # population variance, as Keras
    np.testing.assert_allclose(y.numpy(), (x - mean) / np.sqrt(var + 1e-3), rtol=1e-10)
    np.testing.assert_allclose(bn.moving_mean.numpy(), 0.1 * mean, rtol=1e-12)
    np.testing.assert_allclose(bn.moving_variance.numpy(), 0.9 + 0.1 * var, rtol=1e-12)
    y_inf = bn(x, training=False)
    np.testing.assert_allclose(y_inf.numpy(), (x - 0.1 * mean) / np.sqrt(0.9 + 0.1 * var + 1e-3), rtol=1e-10)
    assert [v.name.split("/")[-1] for v in bn.trainable_weights] == ["gamma", "beta"]
    assert [v.name.split("/")[-1] for v in bn.non_trainable_weights] == ["moving_mean", "moving_variance"]


def _bn_model(synchronized):
    return layers.Sequential([layers.Conv2D(3, 2, seed=1, dtype=torch.float64),
                              layers.BatchNormalization(synchronized=synchronized, momentum=0.5, dtype=torch.float64),
                              layers.Flatten(), layers.Dense(4, seed=2, dtype=torch.float64)])


def _bn_step(model, opt, x, y):
    loss_fn = dtape.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    with dtape.GradientTape() as tape:
        loss = dtape.nn.compute_average_loss(loss_fn(y, model(x, training=True)), global_batch_size=8)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))
    return loss


@pytest.mark.parametrize("synchronized", [True, False])
def test_synchronized_batch_norm_on_two_replicas_equals_one_device(strategy, synchronized):
    x, y = RNG.normal(size=(8, 3, 3, 2)) * 2 + 1, RNG.integers(0, 4, 8)
    one, opt1 = _bn_model(True), dtape.optimizers.SGD(0.1)
    for _ in range(2):
        _bn_step(one, opt1, dtape.constant(x), dtape.constant(y))
    with strategy.scope():
        two, opt2 = _bn_model(synchronized), dtape.optimizers.SGD(0.1)
        two.build((None, 3, 3, 2))
    for _ in range(2):
        for xb, yb in strategy.experimental_distribute_dataset([(x, y)]):
            strategy.run(_bn_step, (two, opt2, xb, yb))
    diffs = [np.abs(a.numpy() - b.numpy()).max() for a, b in zip(one.variables, two.variables)]
    for var in two.variables:  # the replicas' copies stay identical
        np.testing.assert_array_equal(var.values[0].numpy(), var.values[1].numpy())
    if synchronized:
        assert max(diffs) < 1e-12, diffs
    else:  # per-replica statistics are not the global batch's: the control that the test can fail
        assert max(diffs) > 1e-6


def test_batch_norm_on_an_empty_batch_changes_nothing():
    """API.md: an empty batch neither hangs nor biases the update: empty output, zero gradients, no NaN."""
    for synchronized in (False, True):
        bn = layers.BatchNormalization(synchronized=synchronized, momentum=0.5, dtype=torch.float64)
        bn(RNG.normal(size=(4, 3)), training=True)
        before = [v.numpy().copy() for v in bn.variables]
        with dtape.GradientTape() as tape:
            y = bn(np.zeros((0, 3)), training=True)
            loss = dtape.reduce_sum(y * 2.0)
        grads = tape.gradient(loss, bn.trainable_variables)
        assert tuple(y.shape) == (0, 3)
        for g in grads:
            np.testing.assert_array_equal(g.numpy(), np.zeros(3))
        for v, b in zip(bn.variables, before):
            np.testing.assert_array_equal(v.numpy(), b)


@pytest.mark.parametrize("synchronized", [True, False])
def test_batch_norm_on_an_empty_global_batch_keeps_the_moving_statistics(strategy, synchronized):
    with strategy.scope():
        bn = layers.BatchNormalization(synchronized=synchronized, momentum=0.5, dtype=torch.float64)
        bn.build((None, 3))
    strategy.run(lambda: bn(dtape.constant(RNG.normal(size=(2, 3))), training=True))
    before = [v.numpy().copy() for v in bn.variables]
    out = strategy.run(lambda: bn(dtape.zeros((0, 3), dtype=torch.float64), training=True))
    assert [tuple(t.shape) for t in strategy.experimental_local_results(out)] == [(0, 3), (0, 3)]
    for v, b in zip(bn.variables, before):
        for component in v.values:
            np.testing.assert_array_equal(component.numpy(), b)


def _bn_first_model(synchronized):
    """BatchNormalization on the raw inputs, so its batch means do not depend on the training."""
    return layers.Sequential([layers.BatchNormalization(synchronized=synchronized, momentum=0.5, dtype=torch.float64),
                              layers.Dense(4, seed=2, dtype=torch.float64)])


def _short_batch_step(model, opt, x, y, global_batch):
    loss_fn = dtape.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    with dtape.GradientTape() as tape:
        loss = dtape.nn.compute_average_loss(loss_fn(y, model(x, training=True)), global_batch_size=global_batch)
    grads = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))


@pytest.mark.parametrize("synchronized", [True, False])
def test_batch_norm_short_last_batch_with_an_empty_replica(strategy, synchronized):
    """33 examples in batches of 8: the last global batch of 1 leaves replica 1 empty.

    synchronized=True equals one device; synchronized=False has no NaN, and its
    moving mean (count-weighted over replicas) equals one device's, as the
    layer sees the raw inputs.
    """
    x, y = RNG.normal(size=(33, 3)) * 2 + 1, RNG.integers(0, 4, 33)
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 33, 8)]
    one, opt1 = _bn_first_model(True), dtape.optimizers.SGD(0.1)
    one.build((None, 3))
    for xb, yb in batches:
        _short_batch_step(one, opt1, dtape.constant(xb), dtape.constant(yb), len(xb))
    with strategy.scope():
        two, opt2 = _bn_first_model(synchronized), dtape.optimizers.SGD(0.1)
        two.build((None, 3))
    sizes = iter(len(xb) for xb, _ in batches)
    for xb, yb in strategy.experimental_distribute_dataset(batches):
        strategy.run(_short_batch_step, (two, opt2, xb, yb, next(sizes)))
    assert [tuple(t.shape) for t in strategy.experimental_local_results(xb)] == [(1, 3), (0, 3)]
    for var in two.variables:
        assert np.isfinite(var.numpy()).all(), var.name
        np.testing.assert_array_equal(var.values[0].numpy(), var.values[1].numpy())
    bn1, bn2 = one.layers[0], two.layers[0]
    np.testing.assert_allclose(bn2.moving_mean.numpy(), bn1.moving_mean.numpy(), rtol=1e-5, atol=1e-5)
    if synchronized:
        for a, b in zip(one.variables, two.variables):
            np.testing.assert_allclose(b.numpy(), a.numpy(), rtol=1e-5, atol=1e-5, err_msg=b.name)


# -- building, summary, weights, losses -----------------------------------------------

def test_input_shape_build_and_sequential_build_create_variables():
    dense = layers.Dense(3, input_shape=(4,))
    assert dense.built and tuple(dense.kernel.shape) == (4, 3)
    conv = layers.Conv2D(2, 3)
    conv.build((None, 8, 8, 5))
    assert conv.built and tuple(conv.kernel.shape) == (3, 3, 5, 2)
    kernel = conv.kernel
    conv.build((None, 8, 8, 5))
    conv(dtape.zeros([1, 8, 8, 5]))
    assert conv.kernel is kernel  # build runs once; the call does not rebuild
    model = layers.Sequential([layers.Conv2D(4, 3, padding="same"), layers.MaxPooling2D(), layers.Flatten(),
                               layers.Dense(10)])
    assert model.variables == ()
    model.build((None, 8, 8, 1))
    assert [tuple(v.shape) for v in model.trainable_weights] == [(3, 3, 1, 4), (4,), (64, 10), (10,)]
    eager = layers.Sequential([layers.Dense(5, input_shape=(2,)), layers.Dense(1)])
    assert len(eager.trainable_weights) == 4


def test_summary_lists_layers_shapes_and_parameter_counts():
    model = layers.Sequential([layers.Conv2D(4, 3, padding="same", input_shape=(8, 8, 1)), layers.MaxPooling2D(),
                               layers.BatchNormalization(), layers.Flatten(), layers.Dense(10)])
    text = model.summary(print_fn=lambda s: None)
    lines = text.splitlines()
    row = next(line for line in lines if "(Conv2D)" in line)
    assert "(None, 8, 8, 4)" in row and row.rstrip().endswith("40")
    bn_row = next(line for line in lines if "(BatchNormaliz" in line)
    assert bn_row.rstrip().endswith(" 16")  # gamma, beta and the 2 non-trainable moving statistics
    assert any("(MaxPooling2D)" in line and "(None, 4, 4, 4)" in line for line in lines)
    assert any("(Flatten)" in line and "(None, 64)" in line for line in lines)
    assert "Total params: 706" in text and "Trainable params: 698" in text and "Non-trainable params: 8" in text


def test_regularizers_in_module_losses_are_differentiable():
    dense = layers.Dense(2, input_dim=3, kernel_regularizer=dtape.regularizers.L2(0.1),
                         bias_regularizer=dtape.regularizers.L1(0.5), activity_regularizer="l1",
                         bias_initializer="ones")
    model = layers.Sequential([dense])
    x = dtape.constant(RNG.normal(size=(4, 3)).astype(np.float32))
    with dtape.GradientTape() as tape:
        y = model(x)
        reg = dtape.add_n(model.losses)
    k = dense.kernel.numpy()
    expected = 0.1 * (k ** 2).sum() + 0.5 * 2 + 0.01 * np.abs(y.numpy()).sum()
    np.testing.assert_allclose(float(reg), expected, rtol=1e-5)
    assert len(model.losses) == 3
    g_kernel = tape.gradient(reg, dense.kernel)
    sign = np.sign(y.numpy())
    np.testing.assert_allclose(g_kernel.numpy(), 0.2 * k + 0.01 * x.numpy().T @ sign, rtol=1e-5, atol=1e-6)
    model(x)
    assert len(model.losses) == 3  # the activity loss of the previous call was cleared


def test_layer_built_lazily_inside_run_registers_its_regularizer_once(strategy):
    with strategy.scope():
        dense = layers.Dense(2, kernel_regularizer="l2", seed=0)
    out = strategy.run(lambda x: (dense(x), len(dense.losses)), (dtape.ones([3, 4]),))
    assert out[1] == 1
    assert len(dense.losses) == 1 and isinstance(dense.kernel, ds.MirroredVariable)
    np.testing.assert_allclose(float(dense.losses[0]), 0.01 * (dense.kernel.numpy() ** 2).sum(), rtol=1e-6)


def test_len_of_distributed_dataset(strategy):
    assert len(strategy.experimental_distribute_dataset([np.zeros((4, 2))] * 3)) == 3
    with pytest.raises(TypeError, match=r"needs a dataset with len\(\); list_iterator has none"):
        len(strategy.experimental_distribute_dataset(iter([np.zeros(2)])))


# -- optimizers -----------------------------------------------------------------------------

def _run_torch(opt_cls, w0, grads, **kw):
    p = torch.nn.Parameter(torch.tensor(w0))
    opt = opt_cls([p], **kw)
    for g in grads:
        p.grad = torch.tensor(g)
        opt.step()
    return p.detach().numpy()


def _run_dtape(opt, w0, grads):
    v = dtape.Variable(w0)
    for g in grads:
        opt.apply_gradients([(dtape.constant(g), v)])
    return v.numpy()


W0 = RNG.normal(size=5)
GRADS = [RNG.normal(size=5) for _ in range(4)]


@pytest.mark.parametrize("centered, momentum", [(False, 0.0), (True, 0.0), (False, 0.5)])
def test_rmsprop_matches_torch_when_epsilon_is_zero(centered, momentum):
    ours = _run_dtape(dtape.optimizers.RMSprop(0.01, rho=0.8, momentum=momentum, epsilon=0.0, centered=centered),
                      W0, GRADS)
    ref = _run_torch(torch.optim.RMSprop, W0, GRADS, lr=0.01, alpha=0.8, momentum=momentum, eps=0.0,
                     centered=centered)
    np.testing.assert_allclose(ours, ref, rtol=1e-12)


def test_rmsprop_and_adagrad_put_epsilon_inside_the_root_as_keras():
    g = GRADS[0]
    v = 0.1 * g * g
    np.testing.assert_allclose(_run_dtape(dtape.optimizers.RMSprop(0.01, epsilon=0.5), W0, [g]),
                               W0 - 0.01 * g / np.sqrt(v + 0.5), rtol=1e-12)
    acc = 0.1 + g * g
    np.testing.assert_allclose(_run_dtape(dtape.optimizers.Adagrad(0.01, epsilon=0.5), W0, [g]),
                               W0 - 0.01 * g / np.sqrt(acc + 0.5), rtol=1e-12)


def test_adagrad_matches_torch_when_epsilon_is_zero():
    ours = _run_dtape(dtape.optimizers.Adagrad(0.1, initial_accumulator_value=0.2, epsilon=0.0), W0, GRADS)
    ref = _run_torch(torch.optim.Adagrad, W0, GRADS, lr=0.1, initial_accumulator_value=0.2, eps=0.0)
    np.testing.assert_allclose(ours, ref, rtol=1e-12)


def test_schedules_follow_keras_formulas():
    exp = schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    assert exp(5) == pytest.approx(0.1 * 0.5 ** 0.5)
    assert schedules.ExponentialDecay(0.1, 10, 0.5, staircase=True)(15) == pytest.approx(0.05)
    cos = schedules.CosineDecay(1.0, decay_steps=10, alpha=0.1)
    assert cos(5) == pytest.approx(0.9 * 0.5 + 0.1) and cos(50) == pytest.approx(0.1)
    warm = schedules.CosineDecay(0.0, decay_steps=10, warmup_target=2.0, warmup_steps=4)
    assert warm(0) == 0.0 and warm(2) == pytest.approx(1.0) and warm(4) == pytest.approx(2.0)
    assert warm(9) == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi * 0.5))) and warm(100) == pytest.approx(0.0)
    pw = schedules.PiecewiseConstantDecay([2, 5], [1.0, 0.5, 0.1])
    assert [pw(s) for s in (0, 2, 3, 5, 6)] == [1.0, 1.0, 0.5, 0.5, 0.1]
    with pytest.raises(ValueError, match="1 less"):
        schedules.PiecewiseConstantDecay([1], [1.0])


@pytest.mark.parametrize("lr", [schedules.PiecewiseConstantDecay([0], [1.0, 0.5]), lambda step: 1.0 / (step + 1)])
def test_schedules_and_callables_drive_the_step(lr):
    # step 0 uses lr 1.0, step 1 uses 0.5 (the schedule sees iterations before the update)
    out = _run_dtape(dtape.optimizers.SGD(lr), np.zeros(1), [np.ones(1), np.ones(1)])
    np.testing.assert_allclose(out, [-1.5])
    assert _run_dtape(dtape.optimizers.SGD(lambda: 0.25), np.zeros(1), [np.ones(1)])[0] == -0.25


def test_clip_by_global_norm_as_tf():
    a, b = dtape.constant([3.0, 0.0]), dtape.constant([0.0, 4.0])
    clipped, norm = dtape.clip_by_global_norm([a, None, b], 2.5)
    assert float(norm) == 5.0 and clipped[1] is None
    np.testing.assert_allclose(clipped[0].numpy(), [1.5, 0.0])
    np.testing.assert_allclose(clipped[2].numpy(), [0.0, 2.0])
    bad, _ = dtape.clip_by_global_norm([dtape.constant([float("inf"), 1.0])], 1.0)
    assert np.isnan(bad[0].numpy()).all()
    np.testing.assert_allclose(dtape.clip_by_norm(dtape.constant([3.0, 4.0]), 1.0).numpy(), [0.6, 0.8])


OPTIMIZERS = [lambda **kw: dtape.optimizers.SGD(0.1, momentum=0.9, **kw),
              lambda **kw: dtape.optimizers.Adam(0.1, **kw), lambda **kw: dtape.optimizers.AdamW(0.1, **kw),
              lambda **kw: dtape.optimizers.RMSprop(0.1, **kw), lambda **kw: dtape.optimizers.Adagrad(0.1, **kw)]
CLIPS = [{"clipnorm": 0.5}, {"clipvalue": 0.05}, {"global_clipnorm": 0.3}]


@pytest.mark.parametrize("make", OPTIMIZERS)
@pytest.mark.parametrize("clip", CLIPS)
def test_clipping_after_aggregation_two_replicas_equal_one_device(strategy, make, clip):
    x = RNG.normal(size=(6, 3)).astype(np.float32)
    w0, b0 = RNG.normal(size=(3, 2)).astype(np.float32), np.zeros(2, np.float32)

    def step(w, b, opt, xb):
        with dtape.GradientTape() as tape:
            loss = dtape.nn.compute_average_loss(dtape.reduce_sum((xb @ w + b) ** 2, axis=1), global_batch_size=6)
        opt.apply_gradients(zip(tape.gradient(loss, [w, b]), [w, b]))

    w1, b1, opt1 = dtape.Variable(w0), dtape.Variable(b0), make(**clip)
    for _ in range(2):
        step(w1, b1, opt1, dtape.constant(x))
    with strategy.scope():
        w2, b2, opt2 = dtape.Variable(w0), dtape.Variable(b0), make(**clip)
    for _ in range(2):
        for xb in strategy.experimental_distribute_dataset([x]):
            strategy.run(step, (w2, b2, opt2, xb))
    np.testing.assert_allclose(w2.values[0].numpy(), w1.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(w2.values[0].numpy(), w2.values[1].numpy())


@pytest.mark.parametrize("clip", CLIPS)
def test_clipping_follows_keras_formulas(clip):
    g = [np.array([3.0, -4.0]), np.array([0.01, 12.0])]  # norms 5 and ~12, global 13
    v = [dtape.Variable(np.zeros(2)), dtape.Variable(np.zeros(2))]
    dtape.optimizers.SGD(1.0, **clip).apply_gradients(zip([dtape.constant(x) for x in g], v))
    if "clipnorm" in clip:
        expected = [x * 0.5 / np.linalg.norm(x) for x in g]
    elif "clipvalue" in clip:
        expected = [np.clip(x, -0.05, 0.05) for x in g]
    else:
        total = np.sqrt(sum((x ** 2).sum() for x in g))
        expected = [x * 0.3 / total for x in g]
    for var, e in zip(v, expected):
        np.testing.assert_allclose(var.numpy(), -e, rtol=1e-12)


def test_only_one_clipping_option():
    with pytest.raises(ValueError, match="Only one"):
        dtape.optimizers.SGD(clipnorm=1.0, clipvalue=1.0)


def test_minimize_with_a_loss_callable_needs_no_tape():
    w = dtape.Variable([1.0, -2.0])
    opt = dtape.optimizers.SGD(0.1)
    opt.minimize(lambda: dtape.reduce_sum(w * w), var_list=[w])
    np.testing.assert_allclose(w.numpy(), [0.8, -1.6])
    dense = layers.Dense(1, kernel_initializer="ones")
    opt.minimize(lambda: dtape.reduce_sum(dense(dtape.ones([1, 2]))), var_list=lambda: dense.trainable_weights)
    np.testing.assert_allclose(dense.kernel.numpy(), [[0.9], [0.9]])
    with pytest.raises(ValueError, match="tape"):
        opt.minimize(dtape.constant(1.0), var_list=[w])


def test_tf_tutorial_loop_with_regularization_two_replicas_equal_one_device(strategy):
    """The 'custom training with tf.distribute' recipe: compute_average_loss + scale_regularization_loss."""
    x, y = RNG.normal(size=(6, 3)), RNG.integers(0, 2, 6)

    def make():
        return layers.Sequential([layers.Dense(2, input_shape=(3,), kernel_regularizer=dtape.regularizers.L2(0.05),
                                               seed=4, dtype=torch.float64)])
    loss_fn = dtape.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def step(model, opt, xb, yb):
        with dtape.GradientTape() as tape:
            loss = dtape.nn.compute_average_loss(loss_fn(yb, model(xb)), global_batch_size=6)
            loss = loss + dtape.nn.scale_regularization_loss(model.losses)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    one, opt1 = make(), dtape.optimizers.SGD(0.5)
    step(one, opt1, dtape.constant(x), dtape.constant(y))
    with strategy.scope():
        two, opt2 = make(), dtape.optimizers.SGD(0.5)
    for xb, yb in strategy.experimental_distribute_dataset([(x, y)]):
        strategy.run(step, (two, opt2, xb, yb))
    for a, b in zip(one.variables, two.variables):
        np.testing.assert_allclose(b.values[1].numpy(), a.numpy(), rtol=1e-12, atol=1e-14)
