"""TF's guards: loss reductions under several replicas, updates from the cross-replica context, dtype
policies (mixed precision) and the strategy attributes TF code reads."""
import threading

import numpy as np
import pytest
import torch

import dtape
from dtape import distribute as ds
from dtape import losses
from dtape.mixed_precision import LossScaleOptimizer, Policy, global_policy, set_global_policy
from tests._strategies import mirrored

pytestmark = pytest.mark.usefixtures("closes_strategies")

LOSS_CLASSES = [
    (losses.SparseCategoricalCrossentropy, lambda: ([0, 2], [[1.0, 2.0, 0.5], [0.1, 0.2, 3.0]]), {"from_logits": True}),
    (losses.CategoricalCrossentropy, lambda: ([[1.0, 0.0], [0.0, 1.0]], [[0.7, 0.3], [0.4, 0.6]]), {}),
    (losses.BinaryCrossentropy, lambda: ([[1.0], [0.0]], [[0.7], [0.2]]), {}),
    (losses.MeanSquaredError, lambda: ([[1.0], [0.0]], [[0.5], [0.2]]), {}),
    (losses.MeanAbsoluteError, lambda: ([[1.0], [0.0]], [[0.5], [0.2]]), {}),
]
LOSS_IDS = [c.__name__ for c, _, _ in LOSS_CLASSES]


# -- losses: sum_over_batch_size under several replicas --------------------------------------------

@pytest.mark.parametrize("cls,data,kw", LOSS_CLASSES, ids=LOSS_IDS)
@pytest.mark.parametrize("reduction", [None, "sum_over_batch_size", "auto", losses.Reduction.AUTO])
def test_batch_size_reduction_in_a_two_replica_context_raises_tfs_error(cls, data, kw, reduction):
    loss = cls(**kw) if reduction is None else cls(reduction=reduction, **kw)
    with pytest.raises(ValueError, match=r"(?s)Please use `dtape\.losses\.Reduction\.SUM` or "
                                         r"`dtape\.losses\.Reduction\.NONE`.*2 replicas.*reduction=\"none\".*"
                                         r"compute_average_loss"):
        mirrored(2).run(lambda: loss(*data()))


@pytest.mark.parametrize("cls,data,kw", LOSS_CLASSES, ids=LOSS_IDS)
def test_one_replica_none_and_sum_and_the_cross_replica_context_are_allowed(cls, data, kw):
    y, p = data()
    mean = float(cls(**kw)(y, p))
    per_example = cls(reduction="none", **kw)(y, p).numpy()
    assert mean == pytest.approx(per_example.mean(), rel=1e-6)
    for strategy in (mirrored(1), ds.OneDeviceStrategy("cpu"), ds.get_strategy()):   # one replica in sync
        assert float(strategy.run(lambda: cls(**kw)(y, p))) == mean
    two = mirrored(2)
    got = two.run(lambda: (cls(reduction="sum", **kw)(y, p), cls(reduction="none", **kw)(y, p)))
    for total, each in zip(*(two.experimental_local_results(g) for g in got)):
        assert float(total) == pytest.approx(per_example.sum(), rel=1e-6)
        np.testing.assert_array_equal(each.numpy(), per_example)
    with two.scope():    # cross-replica context: the loss of the whole global batch
        assert float(cls(**kw)(y, p)) == mean
    allowed = cls(**kw)
    allowed._allow_sum_over_batch_size = True    # what a built-in training loop sets (TF's LossesContainer)
    for value in two.experimental_local_results(two.run(lambda: allowed(y, p))):
        assert float(value) == mean


def _mlp(seed):
    return dtape.layers.Sequential([dtape.layers.Dense(6, "tanh", input_dim=4, seed=seed),
                                    dtape.layers.Dense(3, seed=seed + 1)])


def test_reduction_none_with_compute_average_loss_trains_two_replicas_as_one_device():
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(8, 4)).astype(np.float32), rng.integers(0, 3, size=8)) for _ in range(3)]
    ref_model, ref_opt = _mlp(5), dtape.optimizers.SGD(0.5)
    ref_loss = losses.SparseCategoricalCrossentropy(from_logits=True)    # default reduction, one device
    for x, y in batches:
        with dtape.GradientTape() as tape:
            loss = ref_loss(y, ref_model(x))
        ref_opt.apply_gradients(zip(tape.gradient(loss, ref_model.trainable_variables),
                                    ref_model.trainable_variables))
    strategy = mirrored(2)
    with strategy.scope():
        model, opt = _mlp(5), dtape.optimizers.SGD(0.5)
        loss_obj = losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def step(batch):
        x, y = batch
        with dtape.GradientTape() as tape:
            loss = dtape.nn.compute_average_loss(loss_obj(y, model(x)), global_batch_size=8)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    for batch in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(batch,))
    for v, r in zip(model.trainable_variables, ref_model.trainable_variables):
        for c in v.values:
            np.testing.assert_allclose(c.numpy(), r.numpy(), rtol=1e-6, atol=1e-7)


# -- optimizers: no update from the cross-replica context of several replicas ----------------------

OPTIMIZERS = {
    "sgd": lambda vs: dtape.optimizers.SGD(0.1),
    "momentum": lambda vs: dtape.optimizers.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda vs: dtape.optimizers.Adam(0.1),
    "adamw": lambda vs: dtape.optimizers.AdamW(0.1, clipnorm=1.0),
    "rmsprop": lambda vs: dtape.optimizers.RMSprop(0.1, momentum=0.5, centered=True),
    "adagrad": lambda vs: dtape.optimizers.Adagrad(0.1),
    "loss_scale": lambda vs: LossScaleOptimizer(dtape.optimizers.Adam(0.1), initial_scale=4.0, dynamic_growth_steps=1),
    "from_torch": lambda vs: dtape.optimizers.from_torch(torch.optim.AdamW([v.torch() for v in vs], lr=0.1)),
}


def _components(opt, variables):
    """Every component of the variables and the optimizer's variables, and the torch optimizer's state."""
    out = [c.torch().clone() for v in list(variables) + list(opt.variables()) for c in getattr(v, "values", (v,))]
    torch_opt = getattr(opt, "torch_optimizer", None)
    if torch_opt is not None:
        out += [t.clone() for s in torch_opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return out


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_apply_gradients_in_the_cross_replica_context_raises_before_any_write(name):
    strategy = mirrored(2)
    with strategy.scope():
        variables = [dtape.Variable([1.0, -2.0], name="a"), dtape.Variable([[0.5], [3.0]], name="b")]
        opt = OPTIMIZERS[name](variables)
    fresh_slots = len(opt.variables())

    def step():
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(variables[0] ** 2) + dtape.reduce_sum(variables[1] * 3.0)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    with strategy.scope():    # before the first step: not even the slots are made
        with pytest.raises(RuntimeError, match=r"`apply_gradients\(\)` cannot be called in cross-replica context\. "
                                               r"Use `dtape\.distribute\.Strategy\.run`"):
            opt.apply_gradients(zip([dtape.constant([1.0, 1.0]), dtape.constant([[1.0], [1.0]])], variables))
    assert len(opt.variables()) == fresh_slots
    strategy.run(step)    # now every slot exists and has moved
    before = _components(opt, variables)
    assert int(opt.iterations.numpy()) == 1
    grads = [dtape.constant([1.0, 1.0]), dtape.constant([[1.0], [1.0]])]
    mirrored_grads = [ds.Mirrored((g, g)) for g in grads]
    called = []
    with strategy.scope():
        for attempt in (lambda: opt.apply_gradients(zip(grads, variables)),
                        lambda: opt.apply_gradients(zip(mirrored_grads, variables)),
                        lambda: opt.minimize(lambda: called.append(1) or dtape.reduce_sum(variables[0]), variables),
                        lambda: strategy.run(lambda: dtape.distribute.get_replica_context().merge_call(
                            lambda s: opt.apply_gradients(zip(grads, variables))))):
            with pytest.raises(RuntimeError, match="cannot be called in cross-replica context"):
                attempt()
    after = _components(opt, variables)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    assert int(opt.iterations.numpy()) == 1 and not called
    strategy.run(step)    # the replica context still works, and the copies agree
    for v in variables:
        assert torch.equal(v.values[0].torch(), v.values[1].torch())
    assert int(opt.iterations.numpy()) == 2



@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_mirrored_variables_updated_outside_their_strategy_raise_before_any_write(name):
    """Outside `strategy.scope()`, or on a thread that never entered it, the default strategy is current: the
    update ran with it, wrote the first copy of each MirroredVariable and then raised IndexError (the copies
    diverged: [0, 1] and [1, 2]). Broken on purpose: without the variables' strategy check in
    `_check_not_cross_replica` this failed with IndexError and unequal components."""
    strategy = mirrored(2)
    with strategy.scope():
        variables = [dtape.Variable([1.0, -2.0], name="a"), dtape.Variable([[0.5], [3.0]], name="b")]
        opt = OPTIMIZERS[name](variables)

    def step():
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(variables[0] ** 2) + dtape.reduce_sum(variables[1] * 3.0)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    strategy.run(step)
    before = _components(opt, variables)
    grads = [dtape.constant([1.0, 1.0]), dtape.constant([[1.0], [1.0]])]
    errors = []

    def on_a_thread():
        try:
            opt.apply_gradients(zip(grads, variables))
        except RuntimeError as e:
            errors.append(e)
    with strategy.scope():      # the scope is per thread: the new thread runs under the default strategy
        worker = threading.Thread(target=on_a_thread)
        worker.start()
        worker.join(60)
    assert not worker.is_alive() and len(errors) == 1 and "was created under a MirroredStrategy" in str(errors[0])
    for attempt in (lambda: opt.apply_gradients(zip(grads, variables)),
                    lambda: opt.minimize(lambda: dtape.reduce_sum(variables[0]), variables),
                    lambda: opt.minimize(lambda: dtape.reduce_sum(variables[0]), lambda: variables)):
        with pytest.raises(RuntimeError, match=r"variable 'a' was created under a MirroredStrategy scope \(2 "
                                               r"replicas in sync\).*Nothing was updated"):
            attempt()
    after = _components(opt, variables)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    strategy.run(step)
    for v in variables:
        assert torch.equal(v.values[0].torch(), v.values[1].torch())
    assert int(opt.iterations.numpy()) == 2

def test_one_replica_in_sync_may_update_from_the_cross_replica_context():
    for strategy in (ds.OneDeviceStrategy("cpu"), mirrored(1)):
        with strategy.scope():
            v = dtape.Variable([1.0, 2.0])
            dtape.optimizers.SGD(0.5).apply_gradients([(dtape.constant([1.0, 1.0]), v)])
        assert v.numpy().tolist() == [0.5, 1.5]


def test_gradient_accumulator_refuses_the_cross_replica_context_of_several_replicas():
    strategy = mirrored(2)
    with strategy.scope():
        v = dtape.Variable([1.0, 2.0])
    acc = ds.GradientAccumulator()

    def micro(scale):
        acc.accumulate([(dtape.constant([1.0, 1.0]) * scale, v)])
    strategy.run(micro, args=(ds.PerReplica((dtape.constant(1.0), dtape.constant(2.0))),))
    with strategy.scope():
        with pytest.raises(RuntimeError, match=r"`GradientAccumulator\.accumulate\(\)` cannot be called in "
                                               r"cross-replica context.*strategy\.run"):
            acc.accumulate([(dtape.constant([5.0, 5.0]), v)])
        with pytest.raises(RuntimeError, match="grads_and_vars"):
            acc.grads_and_vars()
    sums = strategy.run(lambda: (acc.step, acc.grads_and_vars()[0][0]))
    assert sums[0] == 1    # every replica counts one micro-batch: nothing was added
    assert [t.numpy().tolist() for t in strategy.experimental_local_results(sums[1])] == [[1.0, 1.0], [2.0, 2.0]]
    with strategy.scope():
        acc.reset()    # the cross-replica reset forgets every replica's sums
    assert strategy.run(lambda: acc.step) == 0


# -- dtype policies ---------------------------------------------------------------------------------

@pytest.fixture
def restore_policy():
    yield
    set_global_policy(None)


def test_policy_names_and_dtypes():
    cases = {"mixed_float16": (torch.float16, torch.float32), "mixed_bfloat16": (torch.bfloat16, torch.float32),
             "float32": (torch.float32, torch.float32), "float64": (torch.float64, torch.float64),
             torch.bfloat16: (torch.bfloat16, torch.bfloat16)}
    for name, (compute, variable) in cases.items():
        p = Policy(name)
        assert (p.compute_dtype, p.variable_dtype) == (compute, variable)
    assert Policy("mixed_float16").name == "mixed_float16" and repr(Policy("float32")) == '<Policy "float32">'
    for bad in ("int32", "mixed_float8", torch.int64):
        with pytest.raises(ValueError, match="mixed precision Policy"):
            Policy(bad)


def test_global_policy_is_the_default_of_layers_made_after_it(restore_policy):
    assert global_policy().name == "float32"
    set_global_policy("mixed_float16")
    mixed, explicit = dtape.layers.Dense(3), dtape.layers.Dense(3, dtype="float32")
    set_global_policy(Policy("mixed_bfloat16"))
    bf = dtape.layers.Dense(3)
    set_global_policy("float32")
    plain = dtape.layers.Dense(3)
    assert (mixed.dtype_policy.name, mixed.dtype, mixed.compute_dtype) == ("mixed_float16", torch.float32,
                                                                          torch.float16)
    assert (bf.dtype, bf.compute_dtype) == (torch.float32, torch.bfloat16)
    assert explicit.compute_dtype == plain.compute_dtype == torch.float32
    with pytest.raises(ValueError):
        set_global_policy("int8")


@pytest.mark.parametrize("policy,half", [("mixed_float16", torch.float16), ("mixed_bfloat16", torch.bfloat16)])
def test_mixed_dense_computes_in_half_with_float32_variables_and_gradients(policy, half):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(5, 4)).astype(np.float32)
    layer = dtape.layers.Dense(3, "relu", input_dim=4, dtype=policy, seed=0)
    with dtape.GradientTape() as tape:
        y = layer(x)
        loss = dtape.reduce_sum(dtape.cast(y, torch.float32) ** 2)
    grads = tape.gradient(loss, layer.trainable_variables)
    assert [v.dtype for v in layer.variables] == [torch.float32] * 2
    assert layer.kernel.read_value().dtype == torch.float32    # outside `call` the variable reads in float32
    # the oracle: torch autograd on the same float32 leaves, cast to the compute dtype as Keras's AutoCast does
    k, b = (torch.tensor(v.numpy(), requires_grad=True) for v in (layer.kernel, layer.bias))
    ref = torch.relu(torch.tensor(x).to(half) @ k.to(half) + b.to(half))
    (ref.float() ** 2).sum().backward()
    assert y.dtype == half and torch.equal(y.torch(), ref.detach())
    for g, r in zip(grads, (k.grad, b.grad)):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.torch(), r, rtol=0, atol=0)


def test_float32_output_layer_takes_half_inputs_and_normalization_keeps_float32_parameters(restore_policy):
    set_global_policy("mixed_float16")
    ln, bn = dtape.layers.LayerNormalization(), dtape.layers.BatchNormalization()
    head = dtape.layers.Dense(2, dtype="float32")
    x = dtape.constant(np.random.default_rng(2).normal(size=(6, 4)).astype(np.float32))
    h = bn(ln(x), training=True)
    assert h.dtype == torch.float16 and head(h).dtype == torch.float32
    assert all(v.dtype == torch.float32 for layer in (ln, bn, head) for v in layer.variables)
    xt = x.torch()    # the moving mean of float16 inputs, in float32: momentum 0.99 of 0 plus 0.01 of the mean
    ln_out = torch.nn.functional.layer_norm(xt.half().float(), (4,), eps=1e-3).half()
    np.testing.assert_allclose(bn.moving_mean.numpy(), 0.01 * ln_out.float().mean(0).numpy(), atol=1e-4)


def test_float32_activation_output_after_half_layers_value_and_gradient_match_torch(restore_policy):
    # the mixed-precision guide's output: Dense in float16, then Activation("softmax", dtype="float32")
    set_global_policy("mixed_float16")
    dense = dtape.keras.layers.Dense(3, seed=0)
    act = dtape.keras.layers.Activation("softmax", dtype="float32")
    relu = dtape.keras.layers.Activation(dtape.nn.relu)
    x = np.random.default_rng(3).normal(size=(4, 5)).astype(np.float32)
    with dtape.GradientTape() as tape:
        h = dense(x)
        y = act(h)
        loss = dtape.reduce_sum(y * dtape.constant([[1.0, -2.0, 0.5]]))
    g = tape.gradient(loss, dense.kernel)
    k, b = (torch.tensor(v.numpy(), requires_grad=True) for v in (dense.kernel, dense.bias))
    ref_h = torch.tensor(x).half() @ k.half() + b.half()
    ref = torch.softmax(ref_h.float(), dim=-1)
    (ref * torch.tensor([[1.0, -2.0, 0.5]])).sum().backward()
    assert (h.dtype, y.dtype, relu(h).dtype) == (torch.float16, torch.float32, torch.float16)
    torch.testing.assert_close(y.torch(), ref.detach(), rtol=0, atol=0)
    torch.testing.assert_close(g.torch(), k.grad, rtol=1e-3, atol=1e-4)
    assert torch.equal(relu(h).torch(), torch.relu(ref_h.detach()))
    assert len(act.variables) == 0 and act.compute_output_shape((None, 3)) == (None, 3)
    with pytest.raises(ValueError, match="unknown activation 'softmx'"):
        dtape.keras.layers.Activation("softmx")


def test_mixed_batch_normalization_reads_its_moving_statistics_in_float32():
    bn = dtape.layers.BatchNormalization(input_shape=(1,), dtype="mixed_float16", epsilon=1e-3)
    x16 = torch.tensor([[0.125]], dtype=torch.float16)
    bn.moving_mean.assign([0.125 + 1e-5])    # 1e-5 is below float16's resolution at 0.125 (6.1e-5)
    bn.moving_variance.assign([1.0 - 1e-3])
    y = bn(x16.float().numpy(), training=False)
    assert y.dtype == torch.float16
    # float32 statistics: (0.125 - (0.125 + 1e-5)) / 1; read in float16 the mean would be 0.125 and y 0
    np.testing.assert_allclose(y.torch().float().numpy(), [[-1e-5]], rtol=1e-2)


def _train(policy, steps, scaled):
    torch.manual_seed(0)
    set_global_policy(policy)
    try:
        model = dtape.layers.Sequential([dtape.layers.Dense(16, "relu", input_dim=8, seed=3),
                                         dtape.layers.Dense(1, dtype="float32", seed=4)])
    finally:
        set_global_policy(None)
    opt = dtape.optimizers.SGD(0.05)
    opt = LossScaleOptimizer(opt) if scaled else opt
    rng = np.random.default_rng(4)
    x = rng.normal(size=(32, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 1)) * 0.5).astype(np.float32)
    mse = losses.MeanSquaredError()
    curve = []
    for _ in range(steps):
        with dtape.GradientTape() as tape:
            loss = mse(y, model(x))
            target = opt.get_scaled_loss(loss) if scaled else loss
        grads = tape.gradient(target, model.trainable_variables)
        grads = opt.get_unscaled_gradients(grads) if scaled else grads
        opt.apply_gradients(zip(grads, model.trainable_variables))
        curve.append(float(loss))
    return np.array(curve), model


@pytest.mark.parametrize("policy,scaled", [("mixed_float16", True), ("mixed_bfloat16", False)])
def test_mixed_training_follows_float32_training(policy, scaled):
    ref, ref_model = _train("float32", 30, scaled=False)
    got, model = _train(policy, 30, scaled)
    assert got[-1] < 0.3 * got[0]    # it trains
    np.testing.assert_allclose(got, ref, rtol=0.05 if policy == "mixed_float16" else 0.15)
    for v, r in zip(model.trainable_variables, ref_model.trainable_variables):
        assert v.dtype == torch.float32
        np.testing.assert_allclose(v.numpy(), r.numpy(), atol=0.03 if policy == "mixed_float16" else 0.1)


def test_loss_scaling_rescues_float16_gradients_that_underflow():
    layer = dtape.layers.Dense(1, use_bias=False, input_dim=2, dtype="mixed_float16", seed=0)
    x = np.array([[1.0, -1.0]], np.float32)
    opt = LossScaleOptimizer(dtape.optimizers.SGD(1.0), initial_scale=2.0 ** 15)

    def grads(scaled):
        with dtape.GradientTape() as tape:
            out = layer(x)                      # float16
            tiny = dtape.constant(1e-4, dtype=torch.float16)
            small = out * tiny * tiny           # d small / d out = 1e-8: below float16's smallest (6e-8)
            loss = dtape.reduce_sum(small)
            target = opt.get_scaled_loss(loss) if scaled else loss
        (g,) = tape.gradient(target, [layer.kernel])
        return opt.get_unscaled_gradients([g])[0] if scaled else g
    assert float(dtape.reduce_max(dtape.abs(grads(False)))) == 0.0
    rescued = grads(True).numpy().ravel()
    np.testing.assert_allclose(rescued, [1e-8, -1e-8], rtol=1e-2)    # float16 rounding of 1e-4


def test_mixed_layer_under_a_mirrored_strategy_reads_every_component_in_half():
    strategy = mirrored(2)
    with strategy.scope():
        layer = dtape.layers.Dense(2, input_dim=3, dtype="mixed_bfloat16", seed=0)
    outs = strategy.run(lambda: layer(np.ones((1, 3), np.float32)))
    for out in strategy.experimental_local_results(outs):
        assert out.dtype == torch.bfloat16
    assert [c.dtype for c in layer.kernel.values] == [torch.float32] * 2


# -- strategy attributes --------------------------------------------------------------------------

def test_every_strategy_has_tfs_attributes():
    for strategy in (mirrored(2), ds.OneDeviceStrategy("cpu"), ds.get_strategy()):
        assert strategy.cluster_resolver is None
        assert strategy.extended.should_checkpoint is True and strategy.extended.should_save_summary is True
    assert [m.name for m in ds.CommunicationImplementation] == ["AUTO", "RING", "NCCL"]
    for impl, want in ((ds.CommunicationImplementation.AUTO, None), (ds.CommunicationImplementation.RING, "gloo"),
                       (ds.CommunicationImplementation.NCCL, "nccl")):
        assert ds.CommunicationOptions(implementation=impl).implementation == want


def test_distribute_values_from_function_gives_each_replica_its_value():
    seen = []

    def value_fn(ctx):
        seen.append((ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync))
        return dtape.constant([float(ctx.replica_id_in_sync_group)])
    strategy = mirrored(2)
    values = strategy.experimental_distribute_values_from_function(value_fn)
    assert isinstance(values, ds.PerReplica) and seen == [(0, 2), (1, 2)]
    doubled = strategy.run(lambda v: v * 2.0, args=(values,))
    assert [t.numpy().tolist() for t in strategy.experimental_local_results(doubled)] == [[0.0], [2.0]]
    for one in (ds.OneDeviceStrategy("cpu"), ds.get_strategy()):
        seen.clear()
        value = one.experimental_distribute_values_from_function(value_fn)
        assert seen == [(0, 1)] and value.numpy().tolist() == [0.0]


def test_multi_worker_strategy_of_one_worker_has_tfs_attributes():
    strategy = ds.MultiWorkerMirroredStrategy(cluster_resolver=ds.TorchrunClusterResolver(0, 1))
    resolver = strategy.cluster_resolver
    assert (resolver.task_type, resolver.task_id, resolver.num_workers) == ("worker", 0, 1)
    assert strategy.extended.should_checkpoint and strategy.extended.should_save_summary
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: dtape.constant([ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync]))
    assert value.numpy().tolist() == [0, 1]
