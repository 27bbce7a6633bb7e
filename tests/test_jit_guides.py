"""TF's tf.function guides ported to dtape.function(jit_compile=True), each against the same code eager.

Sources: "Better performance with tf.function" (tracing rules, variables
created once, `tf.Module` methods, input_signature with None dims),
"Introduction to graphs and tf.function" (nested functions) and Keras'
"Writing a training loop from scratch" (compiled train_step/test_step with
dropout, a learning-rate schedule, clipping and metrics). Graphs run with
backend=None (the traced graph itself) to keep the tests fast.
"""
import numpy as np
import pytest
import torch

import dtape
from dtape import keras

D = torch.float64


def _jit(fn=None, **kw):
    return dtape.function(fn, jit_compile=True, backend=None, **kw)


def test_tracing_rules_of_the_guide():
    traced = []

    @_jit
    def double(x):
        traced.append(x if isinstance(x, (int, float)) else tuple(x.shape))  # Python runs only while tracing
        return x + x
    results = [double(1), double(1), double(2), double(dtape.constant([1.0])), double(dtape.constant([5.0]))]
    assert results[:3] == [2, 2, 4] and [float(r) for r in results[3:]] == [2.0, 10.0]
    assert traced == [1, 2, (1,)] and double.experimental_get_tracing_count() == 3

    @_jit(reduce_retracing=True)
    def g(x):
        return x * 2
    outs = [g(dtape.constant(list(range(n)))).numpy().tolist() for n in (3, 5, 2, 9)]
    assert outs == [[2 * i for i in range(n)] for n in (3, 5, 2, 9)]
    assert g.experimental_get_tracing_count() == 2  # the second shape made the dim general


def test_a_compiled_function_calls_another_inline():
    # the graphs guide's outer_function calling a tf.function inner_function
    inner = _jit(lambda x, y, b: dtape.matmul(x, y) + b)

    @_jit
    def outer(x):
        return inner(x, dtape.constant([[2.0], [3.0]]), dtape.constant(4.0))

    assert outer(dtape.constant([[1.0, 2.0]])).numpy().tolist() == [[12.0]]
    assert outer(dtape.constant([[3.0, 1.0]])).numpy().tolist() == [[13.0]]
    assert outer.trace_count == 1 and inner.trace_count == 0  # inlined in outer's graph


def test_a_compiled_method_keeps_its_traces_per_instance():
    # the guide's Count(tf.Module) with a variable created once inside a @tf.function __call__
    class Count(dtape.Module):
        def __init__(self, step):
            super().__init__()
            self.count, self.step = None, step

        @_jit
        def __call__(self):
            if self.count is None:
                self.count = dtape.Variable(0)
            return self.count.assign_add(self.step)

    a, b = Count(1), Count(10)
    assert [int(a()) for _ in range(3)] == [1, 2, 3]
    assert [int(b()) for _ in range(2)] == [10, 20]
    assert int(a()) == 4 and Count.__call__.__get__(a).trace_count == 1


def test_a_body_creating_a_variable_on_every_call_raises_as_tf():
    def accumulate(x):
        v = dtape.Variable(0.0)
        v.assign_add(x)
        return v.read_value()
    eager = dtape.function(accumulate)
    assert [float(eager(dtape.constant(2.0))) for _ in range(3)] == [2.0, 2.0, 2.0]
    compiled = _jit(accumulate)  # it would return 2, 4, 6: one variable kept across calls
    with pytest.raises(ValueError, match="creates a variable again on a later trace"):
        compiled(dtape.constant(2.0))

    # from a value computed in the body: the first call runs eagerly, the next may not create one again
    compiled = _jit(lambda x: dtape.Variable(dtape.zeros_like(x)) + x)
    assert float(compiled(dtape.constant(2.0))) == 2.0
    with pytest.raises(ValueError, match="creates a variable again on a later trace"):
        compiled(dtape.constant(2.0))


def test_torch_tensor_arguments_and_results():
    f = _jit(lambda x: (x * x, torch.relu(x).sum()))
    for k in (3.0, -4.0):
        sq, s = f(torch.full((2,), k))
        assert type(sq) is torch.Tensor and type(s) is torch.Tensor  # graph values, never the trace's fakes
        assert sq.tolist() == [k * k, k * k] and float(s) == max(k, 0) * 2
    assert f.trace_count == 1


def _dynamic(body):
    return _jit(body, input_signature=[dtape.TensorSpec([None, 2], D)])


def test_none_dims_stay_symbolic_in_size_arithmetic():
    mean = _dynamic(lambda x: dtape.reduce_sum(x) / x.shape[0])
    flat = _dynamic(lambda x: dtape.reshape(x, [x.shape[0] * 2]) * dtape.cast(dtape.size(x), D))
    flipped = _dynamic(lambda x: dtape.reshape(x, dtape.shape(x)[::-1]))
    noise = _dynamic(lambda x: x + dtape.random.uniform(dtape.shape(x), dtype=D) * 0)
    # the first call has one row: a size of 1 must not be taken for every size
    for rows in (1, 3, 4):
        x = dtape.constant(np.arange(rows * 2.0).reshape(rows, 2))
        assert float(mean(x)) == pytest.approx(float(dtape.reduce_sum(x)) / rows, rel=1e-12)
        np.testing.assert_array_equal(flat(x).numpy(), x.numpy().reshape(-1) * rows * 2)
        np.testing.assert_array_equal(flipped(x).numpy(), x.numpy().reshape(2, rows))
        np.testing.assert_array_equal(noise(x).numpy(), x.numpy())
    assert (mean.trace_count, flat.trace_count, flipped.trace_count, noise.trace_count) == (1, 1, 1, 1)


@pytest.mark.parametrize("signature", [None, [dtape.TensorSpec([None, 2], D)]])
def test_size_and_rank_are_size_arguments_in_a_compiled_function(signature):
    # tf.size / tf.rank as sizes (TF's graph idiom): a traced tensor has no value to read, so they carry the size
    def body(x):
        flat = dtape.reshape(x, [dtape.size(x)])
        return flat, dtape.zeros([dtape.rank(x), dtape.size(x)], dtype=D), dtape.ones(dtape.rank(x), dtype=D)
    f = _jit(body, input_signature=signature)
    for rows in (1, 3, 4):
        x = dtape.constant(np.arange(rows * 2.0).reshape(rows, 2))
        got, want = f(x), body(x)
        for g, w in zip(got, want):
            assert tuple(g.shape) == tuple(w.shape) and g.dtype == w.dtype == D
            np.testing.assert_array_equal(g.numpy(), w.numpy())
        assert tuple(want[1].shape) == (2, rows * 2) and tuple(want[2].shape) == (2,)
    assert f.trace_count == (1 if signature else 3)
    assert dtape.size(x).dtype == torch.int32 and int(dtape.size(x)) == 8 and int(dtape.rank(x)) == 2
    assert dtape.size(x, out_type=torch.int64).dtype == torch.int64 and dtape.rank(x).dtype == torch.int32


@pytest.mark.parametrize("signature", [None, [dtape.TensorSpec([None, None, 3], D)]])
def test_slice_bounds_from_tf_shape_as_the_transformer_tutorial_adds_its_positional_encoding(signature):
    # TF's Transformer tutorial: seq_len = tf.shape(x)[1]; x += pos_encoding[:, :seq_len, :] in a tf.function
    pos = dtape.Variable(torch.arange(30.0, dtype=D).reshape(1, 10, 3))

    def body(x):
        seq_len = dtape.shape(x)[1]
        return dtape.reduce_sum((x + pos[:, :seq_len, :]) ** 2) + dtape.reduce_sum(pos[:, x.shape[1] - 1:seq_len])
    f = _jit(body, input_signature=signature)
    for n in (1, 4, 6):
        x = dtape.constant(np.arange(2 * n * 3.0).reshape(2, n, 3))
        with dtape.GradientTape() as tape:
            got = f(x)
        (g,) = tape.gradient(got, [pos])
        with dtape.GradientTape() as tape:
            want = body(x)
        (w,) = tape.gradient(want, [pos])
        assert float(got) == float(want)
        np.testing.assert_array_equal(g.numpy(), w.numpy())
        assert np.count_nonzero(w.numpy()[0, n:]) == 0 and np.count_nonzero(w.numpy()[0, :n]) > 0
    assert f.trace_count == (1 if signature else 3)
    # eager, a 0-d integer tensor as a bound is its value, as in torch
    assert tuple(pos[:, :dtape.constant(4)].shape) == (1, 4, 3)
    # a traced tensor that is no size (a size times a constant tensor) as a bound: a clear error, not Python's
    # "__index__ returned non-int"
    g = _jit(lambda x: pos[:, :dtape.shape(x)[1] * dtape.constant(1)],
             input_signature=[dtape.TensorSpec([None, None, 3], D)])
    with pytest.raises(TypeError, match=r"use x.shape\[i\], whose arithmetic stays symbolic"):
        g(dtape.ones([2, 4, 3], dtype=D))


@pytest.mark.parametrize("signature", [None, [dtape.TensorSpec([None, None, 4], D)]])
def test_arithmetic_on_traced_sizes_gives_sizes(signature):
    # TF computes sizes in graphs: tf.reshape(x, [b * n, c]), half = tf.shape(x)[-1] // 2, x[:, :n - 1], 2 * b
    pos = dtape.Variable(torch.arange(40.0, dtype=D).reshape(1, 10, 4))

    def body(x):
        s = dtape.shape(x)
        b, n, c = s[0], s[1], s[2]
        half = c // 2
        trimmed = x + pos[:, 1:n + 1] - pos[:, :n]
        return (dtape.reshape(trimmed, [b * n, c]), x[:, :, :half] * 2.0, x[:, :, half:], x[:, :n - 1],
                dtape.zeros([2 * b, n + 1, c % 3 + 1], dtype=D), dtape.range(1 + n - 1), [0, 1, 2, 3][half])
    f = _jit(body, input_signature=signature)
    for n in (3, 5, 4):
        x = dtape.constant(np.arange(2 * n * 4.0).reshape(2, n, 4))
        got, want = f(x), body(x)
        assert got[-1] == want[-1] == 2
        for g, w in zip(got[:-1], want[:-1]):
            assert tuple(g.shape) == tuple(w.shape) and g.dtype == w.dtype
            np.testing.assert_array_equal(g.numpy(), w.numpy())
        assert tuple(want[0].shape) == (2 * n, 4) and tuple(want[3].shape) == (2, n - 1, 4)
        assert tuple(want[4].shape) == (4, n + 1, 2) and tuple(want[5].shape) == (n,)
    assert f.experimental_get_tracing_count() == (1 if signature else 3)


def test_a_none_dim_read_as_a_python_number_raises_naming_the_line():
    f = _dynamic(lambda x: dtape.reduce_sum(x) / float(x.shape[0]))
    with pytest.raises(dtape.OperatorNotAllowedInGraphError, match=r"test_jit_guides.py:\d+: .*float\(x.shape\[0\]\)"):
        f(dtape.ones([3, 2], dtype=D))


def test_keras_loss_and_metric_means_divide_by_each_calls_batch():
    # a compiled test_step over batches of 8 then 4 (a dataset's last batch): the mean was over the traced 8
    loss_fn, mean = keras.losses.SparseCategoricalCrossentropy(from_logits=True), keras.metrics.Mean()
    accuracy = keras.metrics.SparseCategoricalAccuracy()

    @_jit(input_signature=[dtape.TensorSpec([None, 3], D), dtape.TensorSpec([None], torch.int64)])
    def test_step(x, y):
        loss = loss_fn(y, x)
        mean.update_state(loss)
        accuracy.update_state(y, x)
        return loss
    x = dtape.constant(np.random.RandomState(0).randn(8, 3))
    y = dtape.constant([0, 1, 2, 0, 1, 2, 0, 1])
    losses = [float(test_step(x, y)), float(test_step(x[:4], y[:4]))]
    expected = [float(loss_fn(y, x)), float(loss_fn(y[:4], x[:4]))]
    np.testing.assert_allclose(losses, expected, rtol=1e-12)
    assert float(mean.result()) == pytest.approx(sum(expected) / 2, rel=1e-6)  # a float32 state
    hits = np.argmax(x.numpy(), -1) == y.numpy()
    assert float(accuracy.result()) == pytest.approx((hits.sum() + hits[:4].sum()) / 12, rel=1e-6)
    assert test_step.trace_count == 1


def _guide_training(jit, steps_per_epoch=3, epochs=2):
    """Keras' custom training loop: Sequential with dropout, Adam on a schedule with clipnorm, two metrics,
    a compiled train_step and test_step; the last batch of each epoch is smaller (input_signature None dims)."""
    rng = np.random.RandomState(0)
    xs, ys = rng.randn(40, 6), rng.randint(0, 4, 40)
    with dtape.random.generator_scope(torch.Generator().manual_seed(7)):
        model = keras.Sequential([keras.layers.Dense(16, activation="relu", dtype=D), keras.layers.Dropout(0.3),
                                  keras.layers.Dense(4, dtype=D)])
        model(dtape.constant(xs[:2]))
        for i, v in enumerate(model.trainable_variables):
            v.assign(dtape.constant(np.random.RandomState(i).randn(*v.shape) * 0.5))
        schedule = keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.5)
        optimizer = keras.optimizers.Adam(learning_rate=schedule, clipnorm=0.5)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        train_acc, val_acc, loss_mean = (keras.metrics.SparseCategoricalAccuracy(),
                                         keras.metrics.SparseCategoricalAccuracy(), keras.metrics.Mean())
        spec = dict(input_signature=[dtape.TensorSpec([None, 6], D), dtape.TensorSpec([None], torch.int64)])

        @dtape.function(jit_compile=jit, backend=None, **(spec if jit else {}))
        def train_step(x, y):
            with dtape.GradientTape() as tape:
                logits = model(x, training=True)
                loss = loss_fn(y, logits)
            grads = tape.gradient(loss, model.trainable_weights)
            optimizer.apply_gradients(zip(grads, model.trainable_weights))
            train_acc.update_state(y, logits)
            loss_mean.update_state(loss)
            return loss

        @dtape.function(jit_compile=jit, backend=None, **(spec if jit else {}))
        def test_step(x, y):
            val_acc.update_state(y, model(x, training=False))

        record = []
        for _ in range(epochs):
            for start in (0, 16, 32)[:steps_per_epoch]:  # batches of 16, 16 and 8
                x, y = dtape.constant(xs[start:start + 16]), dtape.constant(ys[start:start + 16])
                record.append(float(train_step(x, y)))
            test_step(dtape.constant(xs[:24]), dtape.constant(ys[:24]))
            record += [float(m.result()) for m in (train_acc, loss_mean, val_acc)]
            for m in (train_acc, loss_mean, val_acc):
                m.reset_state()
    return record, [v.numpy() for v in model.trainable_variables], optimizer, train_step


def test_training_loop_from_scratch_equals_eager():
    eager, eager_weights, _, _ = _guide_training(False)
    compiled, weights, optimizer, step = _guide_training(True)
    np.testing.assert_allclose(compiled, eager, rtol=1e-6, atol=1e-12)
    for w, e in zip(weights, eager_weights):
        np.testing.assert_allclose(w, e, rtol=1e-6, atol=1e-12)
    assert int(optimizer.iterations) == 6 and step.trace_count == 1


def _gan_steps(jit, signature):
    """The guide's GAN train_step: two models and optimizers, noise of `tf.shape(real)[0]` rows, noisy labels,
    clipped discriminator gradients; the batches are 8, 8 and 4 rows."""
    with dtape.random.generator_scope(torch.Generator().manual_seed(5)):
        disc = keras.Sequential([keras.layers.Dense(8, activation="relu", dtype=D), keras.layers.Dense(1, dtype=D)])
        gen = keras.Sequential([keras.layers.Dense(8, activation="relu", dtype=D), keras.layers.Dense(4, dtype=D)])
        disc(dtape.zeros([1, 4], dtype=D))
        gen(dtape.zeros([1, 3], dtype=D))
        for i, v in enumerate(disc.trainable_variables + gen.trainable_variables):
            v.assign(dtape.constant(np.random.RandomState(i).randn(*v.shape) * 0.3))
        d_opt, g_opt = keras.optimizers.Adam(1e-2), keras.optimizers.Adam(1e-2)
        loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
        spec = dict(input_signature=[dtape.TensorSpec([None, 4], D)]) if signature else {}

        @dtape.function(jit_compile=jit, backend=None, **spec)
        def train_step(real):
            batch = dtape.shape(real)[0]
            fake = gen(dtape.random.normal(shape=(batch, 3), dtype=D))
            labels = dtape.concat([dtape.ones((batch, 1), dtype=D), dtape.zeros((batch, 1), dtype=D)], axis=0)
            labels += 0.05 * dtape.random.uniform(dtape.shape(labels), dtype=D)
            with dtape.GradientTape() as tape:
                d_loss = loss_fn(labels, disc(dtape.concat([fake, real], axis=0)))
            grads, _ = dtape.clip_by_global_norm(tape.gradient(d_loss, disc.trainable_weights), 1.0)
            d_opt.apply_gradients(zip(grads, disc.trainable_weights))
            with dtape.GradientTape() as tape:
                g_loss = loss_fn(dtape.zeros((batch, 1), dtype=D), disc(gen(dtape.random.normal((batch, 3), dtype=D))))
            g_opt.apply_gradients(zip(tape.gradient(g_loss, gen.trainable_weights), gen.trainable_weights))
            return d_loss, g_loss

        data = np.random.RandomState(9).randn(20, 4)
        losses = [float(v) for s in (0, 8, 16) for v in train_step(dtape.constant(data[s:s + 8]))]
    return losses, [v.numpy() for v in disc.trainable_variables + gen.trainable_variables], train_step


@pytest.mark.parametrize("signature", [False, True])
def test_gan_step_with_sizes_from_tf_shape_equals_eager(signature):
    eager, eager_weights, _ = _gan_steps(False, False)
    compiled, weights, step = _gan_steps(True, signature)
    np.testing.assert_allclose(compiled, eager, rtol=1e-6, atol=1e-12)
    for w, e in zip(weights, eager_weights):
        np.testing.assert_allclose(w, e, rtol=1e-6, atol=1e-12)
    assert step.trace_count == (1 if signature else 2)  # batches of 8 and 4 rows
