"""Metrics: Keras values, reset, and sync-on-read state under MirroredStrategy equal to one device."""
import numpy as np
import pytest

import dtape
from dtape import distribute as ds
from dtape import metrics

RNG = np.random.default_rng(3)
Y = RNG.integers(0, 3, 7)
P = RNG.random((7, 3)).astype(np.float32)
W = RNG.random(7).astype(np.float32)


@pytest.fixture
def strategy():
    return ds.MirroredStrategy(["cpu:0", "cpu:1"], timeout=30)


def test_mean_sum_weighted_and_reset():
    m, s = metrics.Mean(), metrics.Sum()
    assert float(m.result()) == 0.0  # divide_no_nan before any update
    m.update_state([1.0, 2.0, 6.0])
    m.update_state([[4.0]], sample_weight=[[3.0]])
    np.testing.assert_allclose(float(m.result()), (1 + 2 + 6 + 12) / 6)
    s.update_state([1.0, 2.0], sample_weight=[0.5, 2.0])
    np.testing.assert_allclose(float(s.result()), 4.5)
    m.reset_state()
    assert float(m.result()) == 0.0 and float(m.count.numpy()) == 0.0


def test_accuracies_match_numpy():
    sca = metrics.SparseCategoricalAccuracy()
    sca.update_state(Y, P)
    np.testing.assert_allclose(float(sca.result()), np.mean(P.argmax(-1) == Y), rtol=1e-6)
    sca.update_state(Y[:, None], P, sample_weight=W)  # [batch, 1] labels as Keras
    both = np.concatenate([np.ones(7), W])
    hits = np.concatenate([P.argmax(-1) == Y] * 2)
    np.testing.assert_allclose(float(sca.result()), (hits * both).sum() / both.sum(), rtol=1e-6)
    acc = metrics.Accuracy()
    np.testing.assert_allclose(float(acc([1, 2, 3, 4], [1, 2, 0, 4])), 0.75)


def test_updates_are_not_recorded_on_tapes():
    m = metrics.Mean()
    x = dtape.constant([1.0, 2.0])
    with dtape.GradientTape() as tape:
        tape.watch(x)
        m.update_state(x * 2)
    assert tape.gradient(m.result(), x) is None


@pytest.mark.parametrize("cls", [metrics.Mean, metrics.Sum, metrics.SparseCategoricalAccuracy, metrics.Accuracy])
def test_metric_over_strategy_equals_one_device(strategy, cls):
    def args(lo, hi):
        if cls in (metrics.Mean, metrics.Sum):
            return (dtape.constant(P[lo:hi, 0]),), {"sample_weight": dtape.constant(W[lo:hi])}
        if cls is metrics.Accuracy:
            return (dtape.constant(Y[lo:hi]), dtape.constant(P[lo:hi].argmax(-1))), {}
        return (dtape.constant(Y[lo:hi]), dtape.constant(P[lo:hi])), {"sample_weight": dtape.constant(W[lo:hi])}

    single = cls()
    for lo, hi in ((0, 4), (4, 7)):
        a, kw = args(lo, hi)
        single.update_state(*a, **kw)
    with strategy.scope():
        dist = cls()
    assert all(isinstance(v, ds.SyncOnReadVariable) for v in dist.variables)
    for parts in (((0, 2), (2, 4)), ((4, 6), (6, 7))):  # uneven split on the second step
        (a0, kw0), (a1, kw1) = args(*parts[0]), args(*parts[1])
        per = [ds.PerReplica(pair) for pair in zip(a0, a1)]
        kws = {k: ds.PerReplica((kw0[k], kw1[k])) for k in kw0}
        strategy.run(lambda *a, **k: dist.update_state(*a, **k), args=tuple(per), kwargs=kws)
    with strategy.scope():
        np.testing.assert_allclose(float(dist.result()), float(single.result()), rtol=1e-6)
        dist.reset_state()
        assert float(dist.result()) == 0.0


def test_metrics_of_a_label_vector_and_one_unit_are_per_example_so_weights_weigh_examples():
    # Keras 3 matches [n] with [n, 1] (squeeze_or_expand_to_same_rank); the old squeeze gave one value per batch
    y, p = np.array([1.0, 0.0, 1.0, 0.0]), np.array([[0.9], [0.2], [0.4], [0.7]])
    np.testing.assert_allclose(dtape.metrics.mean_squared_error(y, p).numpy(), [0.01, 0.04, 0.36, 0.49], rtol=1e-6)
    np.testing.assert_array_equal(dtape.metrics.binary_accuracy(y, p).numpy(), [1.0, 1.0, 0.0, 0.0])
    mse = dtape.metrics.MeanSquaredError()
    mse.update_state(y, p, sample_weight=[1.0, 0.0, 0.0, 3.0])
    np.testing.assert_allclose(float(mse.result()), (0.01 * 1 + 0.49 * 3) / 4, rtol=1e-6)
    accuracy = dtape.metrics.BinaryAccuracy()
    accuracy.update_state(y, p, sample_weight=[1.0, 0.0, 0.0, 3.0])
    assert float(accuracy.result()) == 0.25
