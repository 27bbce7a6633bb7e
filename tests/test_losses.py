"""Loss classes (Keras formulas, reductions) and tf.nn.compute_average_loss / scale_regularization_loss."""
import inspect

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dtape
from dtape import distribute as ds
from dtape import losses

RNG = np.random.default_rng(0)
LOGITS = torch.tensor(RNG.normal(size=(6, 4)))
LABELS = torch.tensor(RNG.integers(0, 4, 6))


@pytest.fixture
def strategy():
    return ds.MirroredStrategy(["cpu:0", "cpu:1"], timeout=30)


def _np(x):
    return np.asarray(x.numpy() if hasattr(x, "numpy") else x)


@pytest.mark.parametrize("from_logits", [True, False])
def test_sparse_categorical_crossentropy_matches_torch_value_and_gradient(from_logits):
    x = dtape.constant(LOGITS)
    with dtape.GradientTape() as tape:
        tape.watch(x)
        pred = x if from_logits else dtape.nn.softmax(x)
        loss = losses.SparseCategoricalCrossentropy(from_logits=from_logits)(LABELS, pred)
    grad = tape.gradient(loss, x)
    ref_x = LOGITS.clone().requires_grad_()
    ref = F.cross_entropy(ref_x, LABELS)
    ref.backward()
    np.testing.assert_allclose(float(loss), float(ref.detach()), rtol=1e-10)
    np.testing.assert_allclose(grad.numpy(), ref_x.grad.numpy(), rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("labels", [[1.7, 0.0], [1.0, 0.0], [True, False]], ids=["fraction", "integral", "bool"])
@pytest.mark.parametrize("loss_fn", [
    lambda y, p: dtape.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=p),
    lambda y, p: losses.SparseCategoricalCrossentropy(from_logits=True)(y, p),
    lambda y, p: losses.SparseCategoricalCrossentropy()(y, dtape.nn.softmax(p)),
    lambda y, p: losses.sparse_categorical_crossentropy(y, p, from_logits=True, axis=0),
], ids=["tf.nn", "keras_logits", "keras_probs", "keras_axis0"])
def test_sparse_cross_entropy_non_integer_labels_raise(labels, loss_fn):
    # 1.7 was truncated to class 1 silently; TF refuses label dtypes other than int32/int64.
    with pytest.raises(TypeError, match="expected an integer dtype.*cast integer-valued labels"):
        loss_fn(dtape.constant(labels), dtape.constant(LOGITS[:2, :2]))


def test_sparse_cross_entropy_int32_and_int64_labels_give_the_same_loss():
    logits = dtape.constant(LOGITS)
    want = F.cross_entropy(LOGITS, LABELS, reduction="none").numpy()
    for dtype in (torch.int32, torch.int64):
        labels = dtape.constant(LABELS.to(dtype))
        np.testing.assert_allclose(
            dtape.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits).numpy(), want, rtol=1e-12)
        np.testing.assert_allclose(
            losses.sparse_categorical_crossentropy(labels, logits, from_logits=True).numpy(), want, rtol=1e-12)


def test_categorical_crossentropy_label_smoothing_matches_torch():
    onehot = F.one_hot(LABELS, 4).double()
    loss = losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.2)(onehot, LOGITS)
    ref = F.cross_entropy(LOGITS, LABELS, label_smoothing=0.2)
    np.testing.assert_allclose(float(loss), float(ref), rtol=1e-10)
    probs = torch.softmax(LOGITS, -1)
    np.testing.assert_allclose(float(losses.CategoricalCrossentropy()(onehot, probs)),
                               float(F.cross_entropy(LOGITS, LABELS)), rtol=1e-10)


def test_probabilities_are_clipped_to_epsilon_as_keras():
    # p = 0 for the true class: Keras clips to 1e-7 instead of giving inf.
    loss = losses.SparseCategoricalCrossentropy()([0], [[0.0, 1.0]])
    np.testing.assert_allclose(float(loss), -np.log(1e-7), rtol=1e-5)


@pytest.mark.parametrize("from_logits", [True, False])
def test_binary_crossentropy_matches_torch_mean_over_last_axis(from_logits):
    y = torch.tensor(RNG.integers(0, 2, (5, 3))).double()
    z = torch.tensor(RNG.normal(size=(5, 3)))
    pred = z if from_logits else torch.sigmoid(z)
    per_example = losses.BinaryCrossentropy(from_logits=from_logits, reduction="none")(y, pred)
    ref = F.binary_cross_entropy_with_logits(z, y, reduction="none").mean(-1)
    assert tuple(per_example.shape) == (5,)
    np.testing.assert_allclose(per_example.numpy(), ref.numpy(), rtol=1e-6)


def test_regression_losses_and_every_reduction():
    yt = torch.tensor(RNG.normal(size=(4, 3)))
    yp = torch.tensor(RNG.normal(size=(4, 3)))
    w = torch.tensor([1.0, 0.0, 2.0, 0.5], dtype=torch.float64)
    per = ((yp - yt) ** 2).mean(-1)
    mse = losses.MeanSquaredError
    np.testing.assert_allclose(_np(mse(reduction="none")(yt, yp)), per.numpy(), rtol=1e-12)
    np.testing.assert_allclose(float(mse()(yt, yp)), float(per.mean()), rtol=1e-12)
    np.testing.assert_allclose(float(mse(reduction="sum")(yt, yp)), float(per.sum()), rtol=1e-12)
    # sum_over_batch_size divides the weighted sum by the number of examples (not the weights' sum).
    np.testing.assert_allclose(float(mse()(yt, yp, sample_weight=w)), float((per * w).sum() / 4), rtol=1e-12)
    mae = losses.MeanAbsoluteError(reduction="none")(yt, yp)
    np.testing.assert_allclose(mae.numpy(), (yp - yt).abs().mean(-1).numpy(), rtol=1e-12)


def test_trailing_unit_axis_is_squeezed_as_keras():
    yt = torch.tensor([[1.0], [2.0]])
    np.testing.assert_allclose(_np(losses.MeanSquaredError(reduction="none")(yt, [[1.5], [2.0]])), [0.25, 0.0])
    # Keras 3 (squeeze_or_expand_to_same_rank) gives the rank-1 side y_true's trailing 1: one loss per example
    np.testing.assert_allclose(_np(losses.MeanSquaredError(reduction="none")(yt, [1.5, 2.0])), [0.25, 0.0])
    # a trailing 1 on a rank-2 side is dropped: [2, 2, 1] with [2, 2] averages over the last axis of [2, 2]
    np.testing.assert_allclose(_np(losses.mean_squared_error([[[1.0], [2.0]], [[0.0], [0.0]]], [[1.5, 2.0], [1.0, 3.0]])),
                               [0.125, 5.0])


def test_bad_reduction_raises():
    with pytest.raises(ValueError, match="sum_over_batch_size"):
        losses.MeanSquaredError(reduction="mean_of_something")


# -- compute_average_loss / scale_regularization_loss -----------------------------

def test_compute_average_loss_divides_by_global_batch_size():
    per_example = dtape.constant([1.0, 2.0, 3.0])
    np.testing.assert_allclose(float(dtape.nn.compute_average_loss(per_example, global_batch_size=6)), 1.0)
    np.testing.assert_allclose(float(dtape.nn.compute_average_loss(per_example)), 2.0)
    weighted = dtape.nn.compute_average_loss(per_example, global_batch_size=3, sample_weight=[1.0, 0.0, 2.0])
    np.testing.assert_allclose(float(weighted), (1.0 + 6.0) / 3)


@pytest.mark.parametrize("bad, match", [(0, "positive"), (2.5, "integer"), (-3, "positive")])
def test_compute_average_loss_rejects_bad_batch_sizes(bad, match):
    with pytest.raises(ValueError, match=match):
        dtape.nn.compute_average_loss([1.0, 2.0], global_batch_size=bad)


def test_compute_average_loss_rejects_scalar_loss():
    with pytest.raises(ValueError, match="rank 1"):
        dtape.nn.compute_average_loss(dtape.constant(1.0), global_batch_size=1)


def test_under_strategy_replica_losses_sum_to_the_global_mean(strategy):
    values = np.arange(6, dtype=np.float32)

    def fn(x):
        return dtape.nn.compute_average_loss(x)  # global batch: 3 + 3 examples, counted over the replicas

    per_replica = ds.PerReplica((dtape.constant(values[:3]), dtape.constant(values[3:])))
    total = strategy.reduce(ds.ReduceOp.SUM, strategy.run(fn, (per_replica,)))
    np.testing.assert_allclose(float(total), values.mean(), rtol=1e-6)
    reg = strategy.run(lambda: dtape.nn.scale_regularization_loss([dtape.constant(3.0), dtape.constant(1.0)]))
    np.testing.assert_allclose([float(v) for v in strategy.experimental_local_results(reg)], [2.0, 2.0])


# x such that one device gives d(mean(w * x))/dw = 40 / 5 = 8.00, while dividing each replica by its local
# batch times 2 replicas gives 4 / 6 + 36 / 4 = 9.67 on a 3/2 split.
UNEVEN_X = np.array([1.0, 1.0, 2.0, 16.0, 20.0])


def _summed_replica_gradient(strategy, slices, **kwargs):
    """The sum over replicas of d(compute_average_loss(w * x_r))/dw, each replica given its slice x_r."""
    with strategy.scope():
        w = dtape.Variable(1.0, dtype=torch.float64)

    def step(xb):
        with dtape.GradientTape() as tape:
            loss = dtape.nn.compute_average_loss(w * xb, **kwargs)
        return tape.gradient(loss, w)
    per_replica = ds.PerReplica(tuple(dtape.constant(x) for x in slices))
    grads = strategy.experimental_local_results(strategy.run(step, (per_replica,)))
    return sum(float(g) for g in grads)


def test_compute_average_loss_uneven_replicas_give_the_one_device_gradient(strategy):
    assert _summed_replica_gradient(strategy, (UNEVEN_X[:3], UNEVEN_X[3:])) == pytest.approx(8.0, abs=1e-12)


def test_compute_average_loss_an_empty_replica_gives_the_one_device_gradient(strategy):
    assert _summed_replica_gradient(strategy, (UNEVEN_X[:1], UNEVEN_X[1:1])) == pytest.approx(1.0, abs=1e-12)
    assert _summed_replica_gradient(strategy, (UNEVEN_X[:0], UNEVEN_X[:0])) == 0.0   # no example anywhere: 0


def test_compute_average_loss_explicit_global_batch_size_is_used_as_given(strategy):
    got = _summed_replica_gradient(strategy, (UNEVEN_X[:3], UNEVEN_X[3:]), global_batch_size=10)
    assert got == pytest.approx(40.0 / 10, abs=1e-12)


def test_compute_average_loss_sample_weight_under_uneven_replicas(strategy):
    weight = np.array([1.0, 0.0, 2.0, 0.5, 1.0])
    with strategy.scope():
        w = dtape.Variable(1.0, dtype=torch.float64)

    def step(xb, wb):
        with dtape.GradientTape() as tape:
            loss = dtape.nn.compute_average_loss(w * xb, sample_weight=wb)
        return tape.gradient(loss, w)
    split = lambda a: ds.PerReplica((dtape.constant(a[:3]), dtape.constant(a[3:])))  # noqa: E731
    grads = strategy.experimental_local_results(strategy.run(step, (split(UNEVEN_X), split(weight))))
    assert sum(float(g) for g in grads) == pytest.approx(float(np.sum(weight * UNEVEN_X)) / 5, abs=1e-12)


def test_compute_average_loss_is_one_function_under_both_names():
    assert dtape.nn.compute_average_loss is dtape.distribute.compute_average_loss
    assert list(inspect.signature(dtape.nn.compute_average_loss).parameters) == [
        "per_example_loss", "sample_weight", "global_batch_size"]


def test_cross_replica_context_raises_as_tf(strategy):
    with strategy.scope():
        with pytest.raises(RuntimeError, match="cross replica context"):
            dtape.nn.compute_average_loss([1.0])
        with pytest.raises(RuntimeError, match="cross replica context"):
            dtape.nn.scale_regularization_loss(1.0)


# -- labels [n] with one output unit [n, 1] (Keras's rank matching) ----------------

Y01 = np.array([1.0, 0.0, 1.0, 0.0])
P01 = np.array([[0.9], [0.2], [0.6], [0.7]])
BCE01 = -(Y01 * np.log(P01[:, 0]) + (1 - Y01) * np.log(1 - P01[:, 0]))  # -log 0.9, -log 0.8, -log 0.6, -log 0.3


@pytest.mark.parametrize("labels", [Y01, Y01.astype(np.int64), Y01.tolist()])
def test_binary_crossentropy_of_label_vector_and_one_unit_is_per_example(labels):
    np.testing.assert_allclose(_np(losses.BinaryCrossentropy(reduction="none")(labels, P01)), BCE01, rtol=1e-12)
    np.testing.assert_allclose(_np(losses.binary_crossentropy(labels, P01)), BCE01, rtol=1e-12)
    np.testing.assert_allclose(float(losses.BinaryCrossentropy()(labels, P01)), BCE01.mean(), rtol=1e-12)
    weights = np.array([1.0, 2.0, 0.0, 0.5])
    np.testing.assert_allclose(float(losses.BinaryCrossentropy(reduction="sum")(labels, P01, sample_weight=weights)),
                               (BCE01 * weights).sum(), rtol=1e-12)
    logits = np.log(P01 / (1 - P01))
    np.testing.assert_allclose(_np(losses.BinaryCrossentropy(from_logits=True, reduction="none")(labels, logits)),
                               BCE01, rtol=1e-9)
    # predictions [n] with labels [n, 1]: the same per-example losses
    np.testing.assert_allclose(_np(losses.BinaryCrossentropy(reduction="none")(Y01[:, None], P01[:, 0])), BCE01,
                               rtol=1e-12)


def test_regression_losses_of_target_vector_and_one_unit_are_per_example():
    y, p = np.array([1.0, 2.0, -1.0]), np.array([[1.5], [2.0], [1.0]])
    for fn, cls, want in [(losses.mean_squared_error, losses.MeanSquaredError, [0.25, 0.0, 4.0]),
                          (losses.mean_absolute_error, losses.MeanAbsoluteError, [0.5, 0.0, 2.0])]:
        np.testing.assert_allclose(_np(fn(y, p)), want)
        np.testing.assert_allclose(_np(cls(reduction="none")(y, p)), want)
        np.testing.assert_allclose(float(cls()(y, p)), np.mean(want))


def test_sparse_labels_with_a_trailing_unit_axis_and_categorical_rank_mismatch():
    logits = np.array([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]])
    want = -np.log(np.exp(logits[[0, 1], [0, 2]]) / np.exp(logits).sum(-1))
    for labels in ([0, 2], [[0], [2]]):
        np.testing.assert_allclose(
            _np(losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")(labels, logits)), want)
    with pytest.raises(ValueError, match="sparse_categorical_crossentropy"):
        losses.categorical_crossentropy([0.0, 2.0, 1.0], np.ones((3, 3)) / 3)   # ids where one-hot is due


def test_a_builtin_loss_subclass_gets_matched_ranks_in_its_call():
    # a call written with plain ops: given y [n] and p [n, 1] unmatched it would broadcast to [n, n]
    class Plain(losses.BinaryCrossentropy):
        def call(self, y_true, y_pred):
            return -dtape.reduce_mean(y_true * dtape.math.log(y_pred) + (1 - y_true) * dtape.math.log(1 - y_pred),
                                      axis=-1)

    np.testing.assert_allclose(_np(Plain(reduction="none")(Y01, P01)), BCE01, rtol=1e-12)
