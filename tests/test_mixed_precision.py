"""LossScaleOptimizer (dynamic loss scaling, under a strategy) and torch.autocast with dtape."""
import numpy as np
import pytest
import torch

import dtape
from dtape import distribute as ds
from dtape.mixed_precision import LossScaleOptimizer

INF = float("inf")


@pytest.fixture
def strategy():
    return ds.MirroredStrategy(["cpu:0", "cpu:1"], timeout=30)


def _state(opt, v):
    return v.numpy().tolist(), float(opt.loss_scale), int(opt.dynamic_counter), int(opt.iterations.numpy())


def test_dynamic_scaling_skips_halves_and_doubles():
    v = dtape.Variable([1.0, 2.0])
    opt = LossScaleOptimizer(dtape.optimizers.SGD(0.5), initial_scale=8.0, dynamic_growth_steps=2)
    states = []
    for g in ([1.0, 1.0], [INF, 1.0], [float("nan"), 0.0], [1.0, 1.0], [1.0, 1.0]):
        opt.apply_gradients([(dtape.constant(g), v)])
        states.append(_state(opt, v))
    assert states == [([0.5, 1.5], 8.0, 1, 1),
                      ([0.5, 1.5], 4.0, 0, 2),    # skipped: variables kept, scale halved, counter reset
                      ([0.5, 1.5], 2.0, 0, 3),
                      ([0.0, 1.0], 2.0, 1, 4),
                      ([-0.5, 0.5], 4.0, 0, 5)]   # 2 good steps in a row: doubled


def test_scale_never_below_one_and_fixed_scale_never_changes():
    v = dtape.Variable([0.0])
    opt = LossScaleOptimizer(dtape.optimizers.SGD(1.0), initial_scale=1.5)
    for _ in range(3):
        opt.apply_gradients([(dtape.constant([INF]), v)])
    assert float(opt.loss_scale) == 1.0
    fixed = LossScaleOptimizer(dtape.optimizers.SGD(1.0), dynamic=False, initial_scale=4.0)
    fixed.apply_gradients([(dtape.constant([INF]), v)])
    assert float(fixed.loss_scale) == 4.0 and v.numpy().tolist() == [0.0]


def test_scaled_loss_and_unscaled_gradients_give_the_true_gradient():
    w = dtape.Variable([3.0])
    opt = LossScaleOptimizer(dtape.optimizers.SGD(0.1), initial_scale=1024.0)
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_sum(w * w)
        scaled = opt.get_scaled_loss(loss)
    (g_scaled,) = tape.gradient(scaled, [w])
    assert float(g_scaled) == 6.0 * 1024
    (g,) = opt.get_unscaled_gradients([g_scaled])
    assert float(g) == 6.0 and opt.get_unscaled_gradients([None]) == [None]
    assert float(opt.get_scaled_loss(lambda: loss)()) == float(loss) * 1024


def test_non_finite_on_one_replica_skips_on_every_replica(strategy):
    with strategy.scope():
        v = dtape.Variable([1.0, 1.0])
        opt = LossScaleOptimizer(dtape.optimizers.Adam(0.1), initial_scale=16.0, dynamic_growth_steps=3)

    def step(bad):
        with dtape.GradientTape() as tape:
            loss = opt.get_scaled_loss(dtape.reduce_sum(v * bad))
        grads = opt.get_unscaled_gradients(tape.gradient(loss, [v]))
        opt.apply_gradients(zip(grads, [v]))

    # replica 1 alone overflows: the aggregated gradient is inf, so both replicas skip
    strategy.run(step, (ds.PerReplica((dtape.constant([1.0, 1.0]), dtape.constant([INF, 1.0]))),))
    for comp in v.values:
        assert comp.numpy().tolist() == [1.0, 1.0]
    assert [float(c.numpy()) for c in opt._loss_scale.values] == [8.0, 8.0]
    strategy.run(step, (ds.PerReplica((dtape.constant([1.0, 2.0]), dtape.constant([1.0, 2.0]))),))
    np.testing.assert_array_equal(v.values[0].numpy(), v.values[1].numpy())
    assert v.values[0].numpy()[0] < 1.0 and int(opt.dynamic_counter) == 1


def test_bfloat16_autocast_training_step_on_cpu_gives_float32_gradients():
    torch.manual_seed(0)
    model = dtape.layers.Sequential([dtape.layers.Dense(8, "relu", input_dim=4), dtape.layers.Dense(3)])
    opt = dtape.optimizers.SGD(0.1)
    x = dtape.constant(np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32))
    y = dtape.constant([0, 1, 2, 1, 0])
    loss_fn = dtape.losses.SparseCategoricalCrossentropy(from_logits=True)
    with dtape.GradientTape() as tape:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        loss = loss_fn(y, dtape.cast(logits, torch.float32))
    grads = tape.gradient(loss, model.trainable_variables)
    assert [g.dtype for g in grads] == [torch.float32] * 4
    # autocast really ran the matmuls in bfloat16 (float32 bias added after: the logits are float32)
    assert np.abs(logits.numpy() - model(x).numpy()).max() > 1e-4
    # the same step in float32: bfloat16 gradients agree to bfloat16 precision
    with dtape.GradientTape() as tape32:
        ref = loss_fn(y, model(x))
    ref_grads = tape32.gradient(ref, model.trainable_variables)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=0.05, atol=0.02)
    before = [v.numpy().copy() for v in model.trainable_variables]
    opt.apply_gradients(zip(grads, model.trainable_variables))
    assert all(v.dtype == torch.float32 for v in model.trainable_variables)
    assert all(np.abs(v.numpy() - b).max() > 0 for v, b in zip(model.trainable_variables, before))


def test_gradient_taken_after_autocast_of_a_bfloat16_matmul():
    # autocast ends before tape.gradient: matmul's rule gets a bfloat16 output gradient and float32 inputs
    rng = np.random.default_rng(1)
    w = dtape.Variable(rng.normal(size=(3, 4)).astype(np.float32))
    x = dtape.constant(rng.normal(size=(2, 3)).astype(np.float32))
    with dtape.GradientTape() as tape:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = dtape.matmul(x, w)
        loss = dtape.reduce_sum(dtape.cast(y, torch.float32) ** 2)
    grad = tape.gradient(loss, w)
    assert y.dtype == torch.bfloat16 and grad.dtype == torch.float32
    ref = 2 * x.numpy().T @ (x.numpy() @ w.numpy())
    np.testing.assert_allclose(grad.numpy(), ref, rtol=0.05, atol=0.05)


def test_mixed_dtype_gradients_take_each_sources_dtype():
    w16 = dtape.Variable(torch.ones(3, dtype=torch.bfloat16))
    w32 = dtape.Variable(torch.ones(3))
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_sum(w16 * w32 * dtape.constant([1.0, 2.0, 3.0]))  # promoted to float32
    g16, g32 = tape.gradient(loss, [w16, w32])
    assert (g16.dtype, g32.dtype) == (torch.bfloat16, torch.float32)
    np.testing.assert_allclose(g16.torch().float().numpy(), [1.0, 2.0, 3.0])


def test_autocast_reaches_replica_threads(strategy):
    with strategy.scope():
        w = dtape.Variable(np.ones((4, 2), np.float32))

    def step(x):
        with dtape.GradientTape() as tape:
            y = dtape.matmul(x, w)
            loss = dtape.reduce_sum(dtape.cast(y, torch.float32))
        return y.dtype == torch.bfloat16, tape.gradient(loss, w).dtype

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = strategy.run(step, (dtape.ones([2, 4]),))
    assert out == (True, torch.float32)  # every replica returned these same objects (else PerReplica values)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_float16_autocast_with_dynamic_loss_scaling_on_cuda():
    gen = torch.Generator().manual_seed(0)
    w = dtape.Variable(torch.randn(4, 3, generator=gen).cuda())
    x = dtape.constant(torch.randn(8, 4, generator=gen).cuda())
    opt = LossScaleOptimizer(dtape.optimizers.SGD(0.1), initial_scale=2.0 ** 15)
    with dtape.GradientTape() as tape:
        with torch.autocast("cuda", dtype=torch.float16):
            y = dtape.matmul(x, w)
        assert y.dtype == torch.float16
        loss = dtape.reduce_mean(dtape.cast(y, torch.float32) ** 2)
        scaled = opt.get_scaled_loss(loss)
    (grad,) = opt.get_unscaled_gradients(tape.gradient(scaled, [w]))
    assert grad.dtype == torch.float32 and grad.device.type == "cuda"
    ref = 2 * x.torch().T @ (x.torch() @ w.torch()) / 24
    torch.testing.assert_close(grad.torch(), ref, rtol=2e-2, atol=2e-3)
    opt.apply_gradients([(grad, w)])
    assert float(opt.loss_scale) == 2.0 ** 15 and int(opt.iterations.numpy()) == 1


def test_layer_norm_bfloat16_activations_float32_weights_match_torch_autograd():
    """The fused layer-norm rule on half activations beside float32 weights (the walk widens dy to float32)."""
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 5, 8, generator=g).to(torch.bfloat16)
    w0, b0, dy0 = torch.randn(8, generator=g), torch.randn(8, generator=g), torch.randn(2, 5, 8, generator=g)
    x, w, b = dtape.constant(x0), dtape.Variable(w0), dtape.Variable(b0)
    with dtape.GradientTape() as tape:
        tape.watch(x)
        y = dtape.nn.layer_norm(x, w, b, epsilon=1e-3)
    got = tape.gradient(y, [x, w, b], output_gradients=dtape.constant(dy0.to(torch.bfloat16)))
    tx, tw, tb = (t.clone().requires_grad_() for t in (x0, w0, b0))
    ty = torch.nn.functional.layer_norm(tx, (8,), tw, tb, eps=1e-3)
    want = torch.autograd.grad(ty, [tx, tw, tb], dy0.to(torch.bfloat16))
    assert torch.equal(y.torch(), ty.detach())
    for a, e in zip(got, want):
        assert a.dtype == e.dtype
        torch.testing.assert_close(a.torch(), e, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [8, 96])  # 96 rows into 10 columns: the weight gradient's transposed product
@pytest.mark.parametrize("op", ["matmul", "xw_plus_b"])
def test_bfloat16_activations_into_float32_weights_under_autocast_match_torch_autograd(op, rows):
    """A float32 layer fed bfloat16 activations under autocast (an autocast matmul's output into a Dense
    projection): the weight gradient's operands are the bfloat16 input and the widened float32 dy."""
    g = torch.Generator().manual_seed(0)
    x0, w1_0, w2_0, b0 = (torch.randn(s, generator=g) for s in ((rows, 6), (6, 16), (16, 10), (10,)))
    x, w1, w2, b = dtape.constant(x0), dtape.Variable(w1_0), dtape.Variable(w2_0), dtape.Variable(b0)
    with dtape.GradientTape() as tape:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = dtape.matmul(x, w1)
            y = dtape.nn.xw_plus_b(h, w2, b) if op == "xw_plus_b" else dtape.matmul(h, w2)
        loss = dtape.reduce_sum(dtape.cast(y, torch.float32) ** 2)
    got = tape.gradient(loss, [w1, w2])
    tw1, tw2, tb = (t.clone().requires_grad_() for t in (w1_0, w2_0, b0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ty = x0 @ tw1 @ tw2 + (tb if op == "xw_plus_b" else 0.0)
    want = torch.autograd.grad((ty.float() ** 2).sum(), [tw1, tw2])
    assert h.dtype == torch.bfloat16 and torch.equal(y.torch(), ty.detach())
    for a, e in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.torch(), e, rtol=0.03, atol=0.03 * e.abs().max().item())
