"""Uneven and short batches, weighted means, and gradient accumulation: same parameters as one device."""

import numpy as np
import pytest
import torch

import dtape
from dtape.distribute import GradientAccumulator, GradientSync, compute_average_loss

from _strategies import mirrored as _strategy

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("closes_strategies")


def _data(sizes, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(n, 3)), rng.normal(size=(n, 1))) for n in sizes]


def _model():
    return dtape.layers.Sequential([dtape.layers.Dense(4, "tanh", input_dim=3, seed=1, dtype=F64),
                                    dtape.layers.Dense(1, input_dim=4, seed=2, dtype=F64)])


def _per_example(model, x, y):
    return dtape.reduce_sum((model(x) - y) ** 2, axis=1)


def _one_device(batches, lr=0.1):
    """Mean loss over each global batch, one SGD step per batch, no strategy."""
    model, opt, losses = _model(), dtape.optimizers.SGD(lr), []
    for x, y in batches:
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_mean(_per_example(model, dtape.constant(x), dtape.constant(y)))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        losses.append(float(loss))
    return [v.numpy() for v in model.trainable_variables], losses


@pytest.mark.parametrize("sync", [False, True])
def test_uneven_epoch_matches_one_device(sync):
    batches = _data([4, 4, 3, 1])   # 3 splits 2/1; 1 leaves replica 1 empty
    strategy = _strategy()
    with strategy.scope():
        model, opt = _model(), dtape.optimizers.SGD(0.1)

    def step(x, y):
        with dtape.GradientTape(gradient_sync=GradientSync() if sync else None) as tape:
            per_example = _per_example(model, x, y)
            loss = compute_average_loss(per_example)   # sum / real global count
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return dtape.reduce_mean(per_example), dtape.constant(float(x.shape[0]))

    losses = []
    for x, y in strategy.experimental_distribute_dataset(batches):
        mean, count = strategy.run(step, args=(x, y))
        losses.append(float(strategy.reduce("MEAN", mean, weights=count)))
    want_vars, want_losses = _one_device(batches)
    for v, want in zip(model.trainable_variables, want_vars):
        for comp in v.values:
            np.testing.assert_allclose(comp.numpy(), want, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-12)


def test_global_batch_smaller_than_replicas_completes():
    strategy = _strategy(3)
    batches = _data([2])
    with strategy.scope():
        model, opt = _model(), dtape.optimizers.SGD(0.1)

    def step(x, y):
        with dtape.GradientTape() as tape:
            loss = compute_average_loss(_per_example(model, x, y))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    for x, y in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(x, y))
    want_vars, _ = _one_device(batches)
    for v, want in zip(model.trainable_variables, want_vars):
        np.testing.assert_allclose(v.values[2].numpy(), want, rtol=1e-12, atol=1e-14)


def test_compute_average_loss_with_a_given_global_batch_size():
    loss = compute_average_loss(dtape.constant([1.0, 2.0, 3.0]), global_batch_size=6)
    assert float(loss) == 1.0
    assert float(compute_average_loss(dtape.zeros((0,)))) == 0.0   # an empty batch: 0, not NaN


def _count_launches(strategy):
    ext = strategy.extended
    orig, calls = ext._all_reduce_flat_async, []

    def counting(reduce_op, tensors, **kw):
        calls.append(dtape.distribute.get_replica_context().replica_id_in_sync_group)
        return orig(reduce_op, tensors, **kw)
    ext._all_reduce_flat_async = counting
    return calls


def test_gradient_accumulation_matches_one_big_batch_with_one_reduction_per_k():
    k, micro = 3, 4
    data = _data([k * micro] * 2, seed=1)           # two optimizer steps of k * micro examples
    strategy = _strategy()
    with strategy.scope():
        model, opt = _model(), dtape.optimizers.SGD(0.1)
    acc = GradientAccumulator()
    calls = _count_launches(strategy)

    def micro_step(x, y):
        with dtape.GradientTape() as tape:
            loss = compute_average_loss(_per_example(model, x, y), global_batch_size=k * micro)
        acc.accumulate(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    def apply():
        assert acc.step == k
        opt.apply_gradients(acc.grads_and_vars())
        acc.reset()

    for xs, ys in data:
        micro_batches = [(xs[i * micro:(i + 1) * micro], ys[i * micro:(i + 1) * micro]) for i in range(k)]
        for x, y in strategy.experimental_distribute_dataset(micro_batches):
            strategy.run(micro_step, args=(x, y))
        assert calls.count(0) == calls.count(1)          # every replica the same
        before = len(calls)
        strategy.run(apply)
        assert len(calls) - before == 2                  # one bucket, one all-reduce per replica, per k
    assert len(calls) == 2 * 2                           # nothing during the micro-steps
    want_vars, _ = _one_device(data)
    for v, want in zip(model.trainable_variables, want_vars):
        for comp in v.values:
            np.testing.assert_allclose(comp.numpy(), want, rtol=1e-12, atol=1e-14)


def test_accumulator_rejects_other_variables():
    acc = GradientAccumulator()
    a, b = dtape.Variable(1.0), dtape.Variable(2.0)
    acc.accumulate([(dtape.constant(1.0), a)])
    with pytest.raises(ValueError, match="same variables"):
        acc.accumulate([(dtape.constant(1.0), b)])
    acc.reset()
    acc.accumulate([(dtape.constant(1.0), b)])
    assert [float(g) for g, _ in acc.grads_and_vars()] == [1.0]
