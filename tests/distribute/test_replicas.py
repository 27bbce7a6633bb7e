"""What a replica thread enters: its device, its own random generator, the caller's torch state.

Also: a model built lazily inside `run` gets the same weights from run to run
(initial values drawn once, in the merge, from the caller's generator).
Concurrency tests force interleaving with sys.setswitchinterval(1e-6).
"""

import numpy as np
import pytest
import torch

import dtape
from dtape import distribute as ds
from dtape import layers
from dtape.distribute.replica_scope import derive_seed
from dtape.distribute.values import select_replica
from dtape.tensor import current_device, normalize_device

DEVICES = ["cpu:0", "cpu:1"]




def _strategy(seed=0, devices=DEVICES):
    return ds.MirroredStrategy(devices, timeout=30, seed=seed)


def _rid():
    return ds.get_replica_context().replica_id_in_sync_group


def _per_replica(result, n=2):
    """[replica 0's result, replica 1's result] of a `run` result (a nest with PerReplica leaves)."""
    return [select_replica(i, result) for i in range(n)]


def _noop_merge(strategy):
    return None


# -- devices --------------------------------------------------------------------

def test_each_replica_runs_inside_its_device_scope():
    strategy = _strategy()
    assert current_device() is None

    def fn():
        made = dtape.convert_to_tensor(np.ones(2, np.float32))
        return current_device(), made.device, dtape.zeros([1]).device
    expected = [(normalize_device(d),) * 3 for d in DEVICES]
    assert _per_replica(strategy.run(fn)) == expected
    assert current_device() is None  # the caller's scope is untouched


def test_replica_generator_lives_on_the_replica_device():
    strategy = _strategy()
    gens = strategy.run(lambda: dtape.random.get_generator())
    assert gens.values == (strategy.replica_generator(0), strategy.replica_generator(1))
    assert gens.values[0] is not gens.values[1]
    assert all(g.device == normalize_device(d) for g, d in zip(gens.values, DEVICES))
    assert dtape.random.get_generator() is torch.default_generator  # caller keeps the default one


# -- random numbers per replica ---------------------------------------------------

def _draw():
    return dtape.random.uniform([5]).numpy()


def test_replica_streams_seeded_from_seed_and_replica_id_and_not_reseeded_per_step():
    strategy = _strategy(seed=42)
    first = [v for v in strategy.run(_draw).values]
    second = [v for v in strategy.run(_draw).values]
    for i in range(2):
        ref = torch.Generator().manual_seed(derive_seed(42, i))
        np.testing.assert_array_equal(first[i], torch.rand(5, generator=ref).numpy())
        np.testing.assert_array_equal(second[i], torch.rand(5, generator=ref).numpy())  # the stream continues
    assert not np.array_equal(first[0], first[1])
    other = _strategy(seed=43).run(_draw).values
    assert not np.array_equal(other[0], first[0])


def test_seed_none_is_drawn_from_torchs_default_generator():
    torch.manual_seed(5)
    a = _strategy(seed=None).run(_draw).values
    torch.manual_seed(5)
    b = _strategy(seed=None).run(_draw).values
    torch.manual_seed(6)
    c = _strategy(seed=None).run(_draw).values
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])


def _draws_after_other_replica(other_draws):
    """Replica 1 first draws `other_draws` numbers of each kind; then both replicas draw."""
    def fn():
        if _rid() == 1 and other_draws:
            dtape.random.uniform([other_draws])
            dtape.random.normal([other_draws])
            dtape.nn.dropout(dtape.ones([other_draws]), 0.5)
            dtape.random.categorical(dtape.zeros([other_draws, 3]), 1)
        ds.get_replica_context().merge_call(_noop_merge)  # replica 0 draws only after replica 1
        return (dtape.random.uniform([4]).numpy(), dtape.random.normal([4]).numpy(),
                dtape.nn.dropout(dtape.ones([16]), 0.5).numpy(),
                dtape.random.categorical(dtape.zeros([4, 5]), 3).numpy())
    return _per_replica(_strategy(seed=7).run(fn))


def test_replica_draws_do_not_depend_on_the_other_replicas_draws():
    quiet, busy = _draws_after_other_replica(0), _draws_after_other_replica(1000)
    for a, b in zip(quiet[0], busy[0]):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(quiet[0][0], quiet[1][0])


def test_rng_state_round_trip_and_errors():
    strategy = _strategy(seed=3)
    state = strategy.get_rng_state()
    assert len(state) == 2 and all(s.dtype == torch.uint8 and s.device.type == "cpu" for s in state)
    a = strategy.run(_draw).values
    strategy.set_rng_state(state)
    b = strategy.run(_draw).values
    other = _strategy(seed=99)
    other.set_rng_state(state)
    c = other.run(_draw).values
    for i in range(2):
        np.testing.assert_array_equal(a[i], b[i])
        np.testing.assert_array_equal(a[i], c[i])
    with pytest.raises(ValueError, match="1 states for 2 replicas"):
        strategy.set_rng_state(state[:1])
    with pytest.raises(TypeError, match="uint8"):
        strategy.set_rng_state([s.numpy() for s in state])
    before = strategy.get_rng_state()
    with pytest.raises(ValueError, match="does not fit replica 1"):
        strategy.set_rng_state([state[0], torch.zeros(3, dtype=torch.uint8)])
    np.testing.assert_array_equal(strategy.get_rng_state()[0].numpy(), before[0].numpy())  # all or nothing
    with pytest.raises(RuntimeError, match="outside strategy.run"):
        strategy.run(lambda: strategy.get_rng_state())
    with pytest.raises(TypeError, match="seed must be an int"):
        ds.MirroredStrategy(DEVICES, seed=1.5)
    with pytest.raises(ValueError, match="seed must be in"):
        ds.MirroredStrategy(DEVICES, seed=-1)


def test_seeded_dropout_layer_gives_each_replica_its_own_stream():
    """Dropout(seed=...) must not share one generator between replicas (a race and a shared stream)."""
    def fn(extra):
        drop = extra[0]
        if _rid() == 1:
            for _ in range(extra[1]):
                drop(dtape.ones([64]), training=True)
        ds.get_replica_context().merge_call(_noop_merge)
        return drop(dtape.ones([64]), training=True).numpy()
    results = [_strategy().run(fn, args=((layers.Dropout(0.5, seed=11), n),)).values for n in (0, 3)]
    np.testing.assert_array_equal(results[0][0], results[1][0])  # replica 0 unaffected by replica 1
    assert not np.array_equal(results[0][0], results[0][1])       # replicas draw different masks
    outside = layers.Dropout(0.5, seed=11)(dtape.ones([64]), training=True).numpy()
    ref = (torch.rand(64, generator=torch.Generator().manual_seed(11)) >= 0.5).numpy() * 2.0
    np.testing.assert_array_equal(outside, ref)  # outside replicas: the layer's seed as given


def _train_with_dropout(seed, steps=4):
    """Losses of a small MLP with nn.dropout and layers.Dropout trained on 2 replicas."""
    strategy = _strategy(seed=seed)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=8)
    with strategy.scope():
        model = layers.Sequential([layers.Dense(16, "relu", input_dim=6, seed=1), layers.Dropout(0.5),
                                   layers.Dense(3, input_dim=16, seed=2)])
        opt = dtape.optimizers.SGD(0.5)
    xs = ds.PerReplica((dtape.constant(x[:4]), dtape.constant(x[4:])))
    ys = ds.PerReplica((dtape.constant(y[:4]), dtape.constant(y[4:])))

    def step(xi, yi):
        with dtape.GradientTape() as tape:
            logits = model(dtape.nn.dropout(xi, 0.25), training=True)
            loss = dtape.reduce_sum(dtape.nn.sparse_softmax_cross_entropy_with_logits(labels=yi, logits=logits)) / 8
        variables = model.trainable_variables
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss
    losses = []
    for _ in range(steps):
        losses.append(float(strategy.reduce("sum", strategy.run(step, args=(xs, ys)))))
    return losses


def test_identically_seeded_mirrored_runs_with_dropout_give_bit_identical_losses(fast_switching):
    a, b = _train_with_dropout(seed=5), _train_with_dropout(seed=5)
    assert a == b
    assert a != _train_with_dropout(seed=6)  # the masks do matter


# -- deterministic lazy creation -------------------------------------------------

def _lazy_model():
    return layers.Sequential([layers.Dense(8, "relu"), layers.Dense(3), layers.LayerNormalization()])


def test_lazy_build_inside_run_is_deterministic_and_equals_building_outside(fast_switching):
    x = np.ones((4, 5), np.float32)
    torch.manual_seed(123)
    ref = _lazy_model()
    ref(x)
    expected = [v.numpy() for v in ref.variables]
    strategy = _strategy()
    for _ in range(5):
        torch.manual_seed(123)
        model = _lazy_model()
        with strategy.scope():
            strategy.run(lambda: model(x))
        assert len(model.variables) == len(expected) == 6
        for v, e in zip(model.variables, expected):
            assert isinstance(v, ds.MirroredVariable)
            for component in v.values:
                np.testing.assert_array_equal(component.numpy(), e)


# -- the caller's thread-local torch state -------------------------------------------

def _autocast_seen():
    a = torch.ones(2, 2)
    return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.mm(a, a).dtype


def test_cpu_autocast_reaches_replicas_and_does_not_leak_into_later_steps():
    strategy = _strategy()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        on = strategy.run(_autocast_seen)
        with torch.autocast("cpu", enabled=False):
            off_inside = strategy.run(_autocast_seen)
    after = strategy.run(_autocast_seen)
    assert _per_replica(on) == [(True, torch.bfloat16, torch.bfloat16)] * 2
    assert all(v[0] is False and v[2] == torch.float32 for v in _per_replica(off_inside) + _per_replica(after))


def test_grad_and_inference_mode_reach_replicas():
    strategy = _strategy()
    w = torch.ones(2, requires_grad=True)

    def seen():
        return torch.is_grad_enabled(), (w * 2).requires_grad, torch.is_inference_mode_enabled()
    with torch.no_grad():
        off = strategy.run(seen)
        with torch.enable_grad():
            on = strategy.run(seen)
    with torch.inference_mode():
        inference = strategy.run(seen)
    after = strategy.run(seen)
    assert _per_replica(off) == [(False, False, False)] * 2
    assert _per_replica(on) == [(True, True, False)] * 2
    assert _per_replica(inference) == [(False, False, True)] * 2
    assert _per_replica(after) == [(True, True, False)] * 2


def test_default_dtype_reaches_replicas():
    strategy = _strategy()
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        seen = strategy.run(lambda: (torch.get_default_dtype(), torch.zeros(1).dtype))
    finally:
        torch.set_default_dtype(old)
    assert _per_replica(seen) == [(torch.float64, torch.float64)] * 2


# -- CUDA: mixed devices expose every missing copy ------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mixed_cpu_cuda_strategy_trains_reduces_and_checkpoints(tmp_path):
    devices = ["cpu:0", "cuda:0"]
    strategy = _strategy(seed=1, devices=devices)
    cuda = torch.device("cuda:0")
    seen = strategy.run(lambda: (current_device(), dtape.convert_to_tensor(np.ones(2)).device,
                                 dtape.random.uniform([2]).device, dtape.random.get_generator().device))
    assert _per_replica(seen) == [(torch.device("cpu"),) * 4, (cuda,) * 4]
    with torch.autocast("cuda", dtype=torch.float16):
        amp = strategy.run(lambda: (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")))
    assert _per_replica(amp) == [(True, torch.float16)] * 2

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 6)).astype(np.float32), rng.integers(0, 3, size=8)
    with strategy.scope():
        model = layers.Sequential([layers.Dense(16, "relu", input_dim=6, seed=1), layers.Dropout(0.5),
                                   layers.Dense(3, input_dim=16, seed=2)])
        opt = dtape.optimizers.SGD(0.5, momentum=0.9)

    def step(i):
        xi, yi = x[4 * i:4 * i + 4], y[4 * i:4 * i + 4]  # numpy: converted on the replica's device
        with dtape.GradientTape() as tape:
            logits = model(xi, training=True)
            loss = dtape.reduce_sum(dtape.nn.sparse_softmax_cross_entropy_with_logits(labels=yi, logits=logits)) / 8
        variables = model.trainable_variables
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        total = ds.get_replica_context().all_reduce("sum", loss)
        return loss, total
    ids = ds.PerReplica((0, 1))
    losses = []
    for _ in range(3):
        loss, total = strategy.run(step, args=(ids,))
        assert [t.device for t in strategy.experimental_local_results(total)] == [torch.device("cpu"), cuda]
        reduced = strategy.reduce("sum", loss)
        np.testing.assert_allclose(float(reduced), float(total.values[0]), rtol=1e-6)
        np.testing.assert_allclose(float(total.values[1]), float(total.values[0]), rtol=1e-6)
        losses.append(float(reduced))
    for v in model.variables:
        assert [c.device.type for c in v.values] == ["cpu", "cuda"]
        np.testing.assert_allclose(v.values[0].numpy(), v.values[1].numpy(), rtol=1e-5, atol=1e-6)

    path = str(tmp_path / "mixed.pt")
    dtape.checkpoint.save(path, model=model, optimizer=opt, rng=strategy.get_rng_state())
    saved = [v.numpy() for v in model.variables]
    after_save = strategy.run(step, args=(ids,))[0]
    data = dtape.checkpoint.restore(path, model=model, optimizer=opt)
    strategy.set_rng_state(data["rng"])
    for v, s in zip(model.variables, saved):
        for component in v.values:
            np.testing.assert_array_equal(component.numpy(), s)
    again = strategy.run(step, args=(ids,))[0]
    assert float(strategy.reduce("sum", again)) == float(strategy.reduce("sum", after_save))
