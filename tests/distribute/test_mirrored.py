"""MirroredStrategy on CPU replica threads: contexts, seed-2 tape semantics, failures, updates."""
import threading

import numpy as np
import pytest
import torch

import dtape
from dtape import distribute as ds

DEVICES = ["cpu:0", "cpu:1"]


@pytest.fixture
def strategy():
    return ds.MirroredStrategy(DEVICES, timeout=30)


def _rid():
    return ds.get_replica_context().replica_id_in_sync_group


def test_context_default_is_replica_context_of_default_strategy():
    assert not ds.has_strategy()
    assert not ds.in_cross_replica_context()
    assert ds.get_replica_context().num_replicas_in_sync == 1


def test_context_scope_and_run_switch_modes(strategy):
    with strategy.scope():
        assert ds.in_cross_replica_context() and ds.get_replica_context() is None
        assert ds.get_strategy() is strategy
        ids = strategy.run(lambda: (_rid(), threading.current_thread().name, ds.in_cross_replica_context()))
    assert ids[0].values == (0, 1)
    assert len(set(ids[1].values)) == 2 and ids[2] is False
    assert not ds.has_strategy()


def test_replica_threads_reused_across_steps(strategy):
    first = strategy.run(lambda: threading.get_ident()).values
    second = strategy.run(lambda: threading.get_ident()).values
    assert first == second and len(set(first)) == 2


def test_variable_in_scope_is_mirrored_with_identical_components(strategy):
    with strategy.scope():
        v = dtape.Variable(lambda: torch.randn(3, 2))
    assert isinstance(v, ds.MirroredVariable)
    a, b = v.values
    assert a is not b and torch.equal(a.torch(), b.torch())
    reads = strategy.run(lambda: v.read_value().torch().data_ptr())
    assert reads.values == (a.torch().data_ptr(), b.torch().data_ptr())


def test_tape_replica_context_watches_container_and_gives_local_gradient(strategy):
    with strategy.scope():
        v = dtape.Variable(2.0)
    scale = ds.PerReplica((dtape.constant(1.0), dtape.constant(3.0)))

    def step(s):
        with dtape.GradientTape() as tape:
            y = v * v * s
        watched = tape.watched_variables()
        return tape.gradient(y, v), len(watched) == 1 and watched[0] is v

    grads, ok = strategy.run(step, args=(scale,))
    assert [float(g) for g in grads.values] == [4.0, 12.0]
    assert ok is True


def test_tape_cross_replica_context_watches_components_and_sums_gradients(strategy):
    with strategy.scope():
        v = dtape.Variable(2.0)
        with dtape.GradientTape() as tape:
            y = v.values[0] * 3.0 + v.values[1] * 5.0 + v * v
        assert tape.watched_variables() == v.values
        assert float(tape.gradient(y, v)) == 3.0 + 5.0 + 4.0


def test_tape_explicit_watch_in_cross_replica_context_unwraps(strategy):
    with strategy.scope():
        v = dtape.Variable(1.0)
        with dtape.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(v)
        assert tape.watched_variables() == v.values


def test_tape_on_main_thread_sees_through_run_and_reduce(strategy):
    with strategy.scope():
        v = dtape.Variable(2.0)
    x = ds.PerReplica((dtape.constant(1.0), dtape.constant(10.0)))
    with dtape.GradientTape() as tape:
        per_replica = strategy.run(lambda xi: v * xi, args=(x,))
        total = strategy.reduce(ds.ReduceOp.SUM, per_replica)
    assert float(total) == 22.0
    assert float(tape.gradient(total, v)) == 11.0


def test_tape_watching_replica_outputs_differentiates_reduce(strategy):
    values = ds.PerReplica((dtape.constant([1.0, 2.0]), dtape.constant([3.0, 4.0])))
    with dtape.GradientTape(persistent=True) as tape:
        tape.watch(list(values.values))
        mean = strategy.reduce(ds.ReduceOp.MEAN, values)
        total = dtape.reduce_sum(mean * mean)
    g0, g1 = tape.gradient(total, list(values.values))
    np.testing.assert_allclose(g0.numpy(), [2.0, 3.0])
    np.testing.assert_allclose(g1.numpy(), [2.0, 3.0])


def test_reduce_mean_with_axis_weights_every_example(strategy):
    values = ds.PerReplica((dtape.constant([1.0, 2.0, 3.0]), dtape.constant([10.0])))
    assert float(strategy.reduce(ds.ReduceOp.MEAN, values, axis=0)) == pytest.approx(4.0)
    assert float(strategy.reduce("sum", values, axis=0)) == pytest.approx(16.0)


def test_merge_call_groups_per_replica_args_and_splits_result(strategy):
    seen = {}

    def merge_fn(strat, value, shared):
        seen["cross"] = ds.in_cross_replica_context()
        seen["thread"] = threading.current_thread() is threading.main_thread()
        assert isinstance(value, ds.PerReplica) and shared == "same"
        return ds.PerReplica(tuple(float(v) * 10 for v in value.values))

    out = strategy.run(lambda: ds.get_replica_context().merge_call(
        merge_fn, args=(dtape.constant(float(_rid() + 1)), "same")))
    assert out.values == (10.0, 20.0)
    assert seen == {"cross": True, "thread": True}


def test_all_reduce_sum_and_mean(strategy):
    def fn(op):
        return ds.get_replica_context().all_reduce(op, dtape.constant([float(_rid() + 1), 1.0]))
    for op, expected in ((ds.ReduceOp.SUM, [3.0, 2.0]), (ds.ReduceOp.MEAN, [1.5, 1.0])):
        for value in strategy.experimental_local_results(strategy.run(fn, args=(op,))):
            np.testing.assert_allclose(value.numpy(), expected)


def test_run_exception_reraised_with_type_and_replica_note(strategy):
    def fn():
        if _rid() == 1:
            raise KeyError("bad key")
        ds.get_replica_context().merge_call(lambda s: None)  # replica 0 waits in a merge_call

    with pytest.raises(KeyError, match="bad key") as info:
        strategy.run(fn)
    assert type(info.value) is KeyError
    assert any("replica 1, device cpu:1" in note for note in info.value.__notes__)
    assert strategy.run(lambda: _rid()).values == (0, 1)  # still usable


def test_run_exception_in_merge_fn_fails_every_replica(strategy):
    def fn():
        ds.get_replica_context().merge_call(lambda s: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        strategy.run(fn)
    assert strategy.run(lambda: 5) == 5  # identical results are not wrapped (TF regroup)


def test_run_stuck_replica_raises_timeout_instead_of_hanging():
    strategy = ds.MirroredStrategy(DEVICES, timeout=0.5)
    release = threading.Event()

    def fn():
        if _rid() == 0:
            release.wait(10)  # without the timeout, the run would succeed after 10 s and pytest.raises fail
    with pytest.raises(TimeoutError, match=r"replicas \[0\]"):
        strategy.run(fn)
    release.set()
    assert strategy.run(lambda: _rid()).values == (0, 1)


def test_run_merge_call_on_some_replicas_only_raises(strategy):
    def fn():
        if _rid() == 0:
            ds.get_replica_context().merge_call(lambda s: None)
    with pytest.raises(RuntimeError, match="same merge_call"):
        strategy.run(fn)


def test_replica_write_without_aggregation_raises_with_fix(strategy):
    with strategy.scope():
        v = dtape.Variable(1.0)
    with pytest.raises(ValueError, match="aggregation"):
        strategy.run(lambda: v.assign(2.0))


def test_replica_write_with_sum_aggregation_updates_every_component(strategy):
    with strategy.scope():
        v = dtape.Variable(1.0, aggregation=dtape.VariableAggregation.SUM)
    strategy.run(lambda: v.assign_add(float(_rid() + 1)))
    assert [float(c.numpy()) for c in v.values] == [4.0, 4.0]


def test_distribute_dataset_splits_global_batches(strategy):
    batches = [{"x": np.arange(10.0).reshape(5, 2), "y": torch.arange(5)}]
    (per_replica,) = list(strategy.experimental_distribute_dataset(batches))
    x0, x1 = per_replica["x"].values
    assert x0.shape == (3, 2) and x1.shape == (2, 2)
    np.testing.assert_array_equal(np.concatenate([x0.numpy(), x1.numpy()]), batches[0]["x"])
    assert per_replica["y"].values[1].numpy().tolist() == [3, 4]


def test_distribute_dataset_short_batch_gives_empty_replica(strategy):
    (per_replica,) = list(strategy.experimental_distribute_dataset([torch.ones(1, 3)]))
    assert [v.shape[0] for v in per_replica.values] == [1, 0]


def _train(strategy, make_opt, steps=6):
    gen = torch.Generator().manual_seed(0)
    xs, ys, w0 = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen), torch.randn(4, 1, generator=gen)
    with strategy.scope():
        w = dtape.Variable(w0)
        opt = make_opt()

    def step(x, y):
        with dtape.GradientTape() as tape:
            err = dtape.matmul(x, w) - y
            loss = dtape.reduce_sum(err * err) / 8.0
        opt.apply_gradients([(tape.gradient(loss, w), w)])
        return loss
    losses = []
    for x, y in strategy.experimental_distribute_dataset([(xs, ys)] * steps):
        losses.append(float(strategy.reduce(ds.ReduceOp.SUM, strategy.run(step, args=(x, y)))))
    return losses, w


@pytest.mark.parametrize("make_opt", [lambda: dtape.optimizers.SGD(0.1, momentum=0.9),
                                      lambda: dtape.optimizers.Adam(0.05)], ids=["sgd_momentum", "adam"])
def test_apply_gradients_mirrored_matches_one_device_and_stays_identical(strategy, make_opt):
    ref, w_ref = _train(ds.OneDeviceStrategy("cpu"), make_opt)
    got, w = _train(strategy, make_opt)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    a, b = w.values
    assert torch.equal(a.torch(), b.torch())
    np.testing.assert_allclose(a.numpy(), w_ref.numpy(), rtol=1e-5, atol=1e-6)
    assert ref[-1] < ref[0]


def test_optimizer_slots_are_mirrored(strategy):
    with strategy.scope():
        v = dtape.Variable(torch.ones(2))
        opt = dtape.optimizers.Adam(0.1)
    strategy.run(lambda: opt.apply_gradients([(dtape.constant([1.0, 1.0]), v)]))
    slots = opt.variables()
    assert all(isinstance(s, ds.MirroredVariable) for s in slots)
    assert int(opt.iterations.numpy()) == 1
    m0, m1 = slots[2].values    # m, after iterations and learning_rate
    assert torch.equal(m0.torch(), m1.torch())
    np.testing.assert_allclose(m0.numpy(), [0.2, 0.2], rtol=1e-6)  # (1 - 0.9) * summed grad 2


def test_one_device_strategy_runs_inline():
    strategy = ds.OneDeviceStrategy("cpu")
    with strategy.scope():
        v = dtape.Variable(3.0)
    assert isinstance(v, dtape.Variable)
    assert strategy.run(lambda: threading.current_thread() is threading.main_thread())
    assert strategy.num_replicas_in_sync == 1


def test_mirrored_strategy_bad_devices_raise():
    with pytest.raises(ValueError, match="distinct"):
        ds.MirroredStrategy(["cpu:0", "cpu:0"])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="not available"):
            ds.MirroredStrategy(["cuda:0"])


@pytest.mark.parametrize("devices, match", [
    (["CPU:0", "cpu:0"], "must be distinct.*which name \\['cpu:0', 'cpu:0'\\]"),
    (["cpu", "cpu:0"], "must be distinct"), (["cpu:1", "cpu:01"], "must be distinct"),
    (["cpu:x", "cpu:1"], "'cpu:x' has no valid index"), (["cpu:0", "cpu:-1"], "'cpu:-1' has no valid index"),
    (["cpu:0", "tpu:0"], "'tpu:0' is not a device name"),
])
def test_mirrored_strategy_devices_that_name_one_device_twice_or_none_raise(devices, match):
    # Two spellings of one device made two replicas share it; 'cpu:x' was taken as the CPU.
    with pytest.raises(ValueError, match=match):
        ds.MirroredStrategy(devices)


def test_mirrored_strategy_device_names_are_canonical():
    strategy = ds.MirroredStrategy(["CPU:0", torch.device("cpu", 1), "cpu:2"])
    assert strategy.extended.worker_devices == ("cpu:0", "cpu:1", "cpu:2")
    assert ds.MirroredStrategy(["cpu"]).extended.worker_devices == ("cpu:0",)


@pytest.mark.parametrize("devices, want", [
    (["/cpu:0"], ("cpu:0",)), (["/device:CPU:0", "/CPU:1"], ("cpu:0", "cpu:1")),
    (["/job:localhost/replica:0/task:0/device:CPU:0", "cpu:1"], ("cpu:0", "cpu:1")),
    (["cpu:127"], ("cpu:127",)),
])
def test_mirrored_strategy_accepts_tf_device_spellings_of_local_devices(devices, want):
    # TF canonicalizes '/cpu:0' and '/job:localhost/.../device:CPU:0' to the local CPU; they were refused
    assert ds.MirroredStrategy(devices).extended.worker_devices == want


@pytest.mark.parametrize("spelling", ["/gpu:1", "/device:GPU:1", "/job:localhost/replica:0/task:0/device:GPU:1"])
def test_mirrored_strategy_tf_gpu_spellings_name_the_cuda_device(spelling):
    if torch.cuda.device_count() > 1:
        assert ds.MirroredStrategy([spelling]).extended.worker_devices == ("cuda:1",)
    else:  # read as cuda:1, refused for want of it (not as a malformed name)
        with pytest.raises(ValueError, match=r"device 'cuda:1' is not available"):
            ds.MirroredStrategy([spelling])


@pytest.mark.parametrize("devices, match", [
    (["/job:worker/replica:0/task:0/device:CPU:0"], "names job 'worker'.*this process.*MultiWorkerMirroredStrategy"),
    (["/job:localhost/replica:0/task:1/device:CPU:0"], "names task '1'.*this process"),
    (["/replica:2/cpu:0"], "names replica '2'"),
    (["/device:CPU:x"], "'/device:CPU:x' has no valid index"), (["/job:localhost"], "names no device"),
    (["/cpu:0/gpu:0"], "is not a device name"),
    (["cpu:99999999999999999999"], "index 99999999999999999999 is past 127"), (["cpu:128"], "index 128 is past 127"),
    (["cuda:200"], "index 200 is past 127"),
    ("cpu:0", r"takes a list of device names, got the single str 'cpu:0'; pass \['cpu:0'\]"),
])
def test_mirrored_strategy_refuses_other_jobs_absurd_indices_and_a_bare_string(devices, match):
    # 'cpu:99999999999999999999' was accepted; torch keeps 8 bits, so 'cpu:128' would be 'cpu:-128'.
    # A bare string was read letter by letter ("device 'c' is not a device name"); TF takes a list.
    with pytest.raises(ValueError, match=match):
        ds.MirroredStrategy(devices)


def test_optimizer_build_creates_mirrored_slots_before_any_step(strategy):
    with strategy.scope():
        v = dtape.Variable(torch.ones(3))
        opt = dtape.optimizers.SGD(0.1, momentum=0.5)
        opt.build([v])
    slots = opt.variables()
    assert len(slots) == 3 and int(opt.iterations.numpy()) == 0     # iterations, learning_rate, momentum
    assert isinstance(slots[2], ds.MirroredVariable) and slots[2].shape == (3,)


def test_variable_created_inside_run_is_one_mirrored_variable_for_all_replicas(strategy):
    with strategy.scope():
        layer = dtape.layers.Dense(3)  # built lazily, on the replica threads
    for _ in range(5):  # the race this guards against was intermittent
        created = strategy.run(lambda: dtape.Variable(torch.zeros(2)))
        assert isinstance(created, ds.MirroredVariable)
    x = ds.PerReplica((dtape.constant(torch.ones(2, 4)), dtape.constant(torch.ones(1, 4))))
    strategy.run(lambda xi: layer(xi), args=(x,))
    assert len(layer.trainable_variables) == 2
    assert all(isinstance(v, ds.MirroredVariable) for v in layer.trainable_variables)
