"""GradientSync: bucketed gradient all-reduce launched during the backward walk; apply_gradients' reduction."""
import sys
import threading
import warnings

import numpy as np
import pytest
import torch

import dtape
from dtape.distribute import GradientSync, ReduceOp
from dtape.distribute import gradient_sync
from dtape.distribute.gradient_sync import _flat as flat_member, plan_buckets, reduce_gradients

from _strategies import mirrored as _strategy

TINY_MB = 1e-9  # every variable in a bucket of its own
N_VARS = 6      # 3 Dense layers


pytestmark = pytest.mark.usefixtures("closes_strategies")


def _model(strategy, dtype=torch.float32):
    with strategy.scope():
        return dtape.layers.Sequential([
            dtape.layers.Dense(16, "tanh", input_dim=5, seed=1, dtype=dtype),
            dtape.layers.Dense(16, "tanh", input_dim=16, seed=2, dtype=dtype),
            dtape.layers.Dense(3, input_dim=16, seed=3, dtype=dtype)])


def _rid():
    return dtape.distribute.get_replica_context().replica_id_in_sync_group


def _batch(r, step=0, dtype=torch.float32):
    rng = np.random.default_rng(100 * step + r)
    return dtape.constant(rng.normal(size=(4, 5)), dtype=dtype), dtape.constant(rng.normal(size=(4, 3)), dtype=dtype)


def _loss(model, x, y):
    # The L2 term reads every variable again: several consumer records each, so a gradient is final
    # only after the last of them (the readiness rule under test).
    l2 = dtape.add_n([dtape.reduce_sum(v * v) for v in model.trainable_variables])
    return dtape.reduce_mean((model(x) - y) ** 2) + 1e-2 * l2


def _count_launches(strategy):
    """Wraps the strategy's flat all-reduce: records (replica id, launched inside the backward walk)."""
    ext = strategy.extended
    orig = ext._all_reduce_flat_async
    calls = []

    def counting(reduce_op, tensors, **kw):
        f, inside = sys._getframe(), False
        while f is not None and not inside:
            inside, f = f.f_code.co_name == "_walk", f.f_back
        calls.append((_rid(), inside))
        return orig(reduce_op, tensors, **kw)
    ext._all_reduce_flat_async = counting
    return calls


def _per_replica(calls, n):
    return [sum(1 for r, _ in calls if r == i) for i in range(n)]


def _values(model):
    return [[c.numpy().copy() for c in v.values] for v in model.trainable_variables]


@pytest.mark.parametrize("cap_mb,n_buckets", [(25.0, 1), (TINY_MB, N_VARS)])
def test_synced_reduction_equals_per_variable_reduction_exactly(cap_mb, n_buckets):
    strategy = _strategy(3)
    model = _model(strategy)
    calls = _count_launches(strategy)

    def fn():
        x, y = _batch(_rid())
        with dtape.GradientTape(gradient_sync=GradientSync(cap_mb, order="reverse")) as tape:
            loss = _loss(model, x, y)
        variables = model.trainable_variables
        grads = tape.gradient(loss, variables)
        launched = dtape.constant(len([c for c in calls if c[0] == _rid()]))
        reduced = [g for g, _ in reduce_gradients(list(zip(grads, variables)))]
        ref = dtape.distribute.get_replica_context().merge_call(
            lambda s, g: s.extended.batch_reduce_to(ReduceOp.SUM, [(t, None) for t in g]), args=(grads,))
        return launched, reduced, ref
    launched, reduced, ref = strategy.run(fn)
    assert [int(t) for t in strategy.experimental_local_results(launched)] == [n_buckets] * 3   # before tape.gradient returned
    assert all(inside for _, inside in calls)                                       # ... from inside the walk
    assert _per_replica(calls, 3) == [n_buckets] * 3                                # and nothing more
    assert len(reduced) == len(ref) == N_VARS
    for got, want in zip(reduced, ref):   # per variable, per replica
        for a, b in zip(strategy.experimental_local_results(got), strategy.experimental_local_results(want)):
            assert torch.equal(a.torch(), b.torch())


def _train(sync, transform=None, steps=2, cap_mb=TINY_MB, extra=False):
    """Trains a fresh model; returns (final values, launches per replica, warnings)."""
    strategy = _strategy()
    model = _model(strategy, torch.float64)
    with strategy.scope():
        more = [dtape.Variable([1.0, 2.0], name="extra"), dtape.Variable(3.0, name="unused")] if extra else []
    opt = dtape.optimizers.SGD(0.1, momentum=0.9)
    calls = _count_launches(strategy)
    gradient_sync = GradientSync(cap_mb) if sync else None   # learns the readiness order at the first step

    def step(i):
        x, y = _batch(_rid(), i, torch.float64)
        with dtape.GradientTape(gradient_sync=gradient_sync) as tape:
            loss = _loss(model, x, y)
            if extra and _rid() == 0:   # used on replica 0 only: None on replica 1
                loss = loss + dtape.reduce_sum(more[0] * more[0])
        variables = list(model.trainable_variables) + more
        grads = tape.gradient(loss, variables)
        if transform is not None:
            grads = transform(grads)
        opt.apply_gradients(zip(grads, variables))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(steps):
            strategy.run(step, args=(i,))
    values = _values(model) + [[c.numpy().copy() for c in v.values] for v in more]
    return values, _per_replica(calls, 2), [str(w.message) for w in caught]


def _assert_same(a, b):
    # Two separate runs: float64 and a tight tolerance, since a CPU matmul may round differently from run
    # to run (MKL's result depends on memory alignment); the reduction itself is compared bit for bit above.
    for va, vb in zip(a, b):
        for ca, cb in zip(va, vb):
            np.testing.assert_allclose(ca, cb, rtol=1e-12, atol=1e-15)


def test_training_with_sync_equals_training_without_and_reduces_once_per_bucket():
    plain, plain_calls, _ = _train(sync=False)
    synced, synced_calls, _ = _train(sync=True)
    _assert_same(plain, synced)
    assert plain_calls == [2] * 2             # unsynced: apply_gradients reduces, one 25 MB bucket per step
    # synced: the walk's launches are used, nothing reduced again; + 1: the readiness order agreed at step 1
    assert synced_calls == [2 * N_VARS + 1] * 2
    for comps in synced:                      # mirrored components stay bit-identical
        np.testing.assert_array_equal(comps[0], comps[1])
    assert not np.allclose(plain[0][0], _values(_model(_strategy(), torch.float64))[0][0])  # it did train


def test_default_bucket_size_makes_one_reduction_per_step():
    _, calls, _ = _train(sync=True, cap_mb=25.0)
    assert calls == [2 + 1, 2 + 1]


def test_transformed_gradients_are_reduced_afresh():
    def clip(grads):
        return [g * 0.5 for g in grads]
    plain, _, _ = _train(sync=False, transform=clip)
    unclipped, _, _ = _train(sync=False)
    assert not np.allclose(plain[0][0], unclipped[0][0])  # clipping matters here
    synced, calls, _ = _train(sync=True, transform=clip)
    _assert_same(plain, synced)                   # the clipped values were summed, not the tape's
    assert calls == [2 * 2 * N_VARS + 1] * 2      # launched in the walk, then reduced again (the tape's buckets)


def test_gradient_none_on_one_replica_counts_as_zeros():
    for sync in (False, True):
        values, _, msgs = _train(sync=sync, steps=1, extra=True)
        extra, unused = values[-2], values[-1]
        # replica 0's gradient 2 * [1, 2], replica 1's None -> 0; SGD with momentum, first step: -lr * g
        for comp in extra:
            np.testing.assert_allclose(comp, [1.0 - 0.1 * 2.0, 2.0 - 0.1 * 4.0], rtol=1e-6)
        for comp in unused:
            assert float(comp) == 3.0
        assert any("unused" in m for m in msgs), msgs
        assert not any("extra" in m for m in msgs), msgs


def _nested(sync, apply_inner):
    strategy = _strategy()
    model = _model(strategy, torch.float64)
    opt = dtape.optimizers.SGD(0.1)
    gradient_sync = GradientSync(TINY_MB) if sync else None

    def step():
        x, y = _batch(_rid(), 0, torch.float64)
        variables = model.trainable_variables
        with dtape.GradientTape() as outer:
            with dtape.GradientTape(gradient_sync=gradient_sync) as inner:
                loss = _loss(model, x, y)
            g = inner.gradient(loss, variables)
            total = loss + 0.1 * dtape.add_n([dtape.reduce_sum(t * t) for t in g])
        og = outer.gradient(total, variables)
        opt.apply_gradients(zip(g if apply_inner else og, variables))
    strategy.run(step)
    return _values(model)


@pytest.mark.parametrize("apply_inner", [True, False])
def test_nested_tapes(apply_inner):
    _assert_same(_nested(False, apply_inner), _nested(True, apply_inner))


def test_different_sources_on_replicas_raise_instead_of_mixing():
    strategy = _strategy()
    model = _model(strategy)

    def fn():
        x, y = _batch(_rid())
        with dtape.GradientTape(gradient_sync=GradientSync(TINY_MB)) as tape:
            loss = _loss(model, x, y)
        variables = model.trainable_variables if _rid() == 0 else model.trainable_variables[::-1]
        grads = tape.gradient(loss, variables)
        dtape.optimizers.SGD(0.1).apply_gradients(zip(grads, variables))
    with pytest.raises(ValueError, match="different sources at position 0"):
        strategy.run(fn)


# Two variables of one shape: replica r's loss is A[r] * sum(v0) + B[r] * sum(v1), so its gradients are A[r]
# and B[r] everywhere, and one SGD(1.0) step leaves v0 = -sum(A), v1 = -sum(B) (here -3 and -30).
_A, _B = (1.0, 2.0), (10.0, 20.0)


def _pair(strategy):
    with strategy.scope():
        return [dtape.Variable(torch.zeros(2, dtype=torch.float64), name=f"v{i}") for i in range(2)]


def _ordered_step(strategy, vs, sync, orders, errors, opt=None):
    """One step; replica r asks tape.gradient for `[vs[k] for k in orders[r]]`; with `opt`, applies what it
    got; else replica 1 passes its own components and every replica waits for the synced sums
    (`reduce_gradients`). Returns {replica: sums in its order}; ValueErrors are recorded per replica."""
    sums = {}

    def fn():
        r = _rid()
        with dtape.GradientTape(gradient_sync=sync) as tape:
            loss = _A[r] * dtape.reduce_sum(vs[0]) + _B[r] * dtape.reduce_sum(vs[1])
        sources = [vs[k] if opt is not None or r == 0 else vs[k].values[r] for k in orders[r]]
        try:
            grads = tape.gradient(loss, sources)
            if opt is not None:
                opt.apply_gradients(zip(grads, sources))
            else:
                sums[r] = [g.numpy().tolist() for g, _ in reduce_gradients(list(zip(grads, sources)))]
        except ValueError as e:
            errors[r] = str(e)
    strategy.run(fn)
    return sums


@pytest.mark.parametrize("cap_mb", [TINY_MB, 25.0])
def test_sources_in_one_order_are_summed_per_variable(cap_mb):
    strategy = _strategy()
    vs, errors = _pair(strategy), {}
    _ordered_step(strategy, vs, GradientSync(cap_mb), [(0, 1), (0, 1)], errors, dtape.optimizers.SGD(1.0))
    assert errors == {}
    np.testing.assert_array_equal(vs[0].numpy(), [-3.0, -3.0])
    np.testing.assert_array_equal(vs[1].numpy(), [-30.0, -30.0])
    # replica 1 passing its own components: the same variables, in the same order
    sums = _ordered_step(strategy, vs, GradientSync(cap_mb), [(1, 0), (1, 0)], errors)
    assert errors == {} and sums == {0: [[30.0, 30.0], [3.0, 3.0]], 1: [[30.0, 30.0], [3.0, 3.0]]}


def _assert_raised_on_every_replica(errors):
    assert sorted(errors) == [0, 1]
    for message in errors.values():
        assert "the replicas passed tape.gradient different sources at position 0" in message
        assert "every replica must ask for the same variables in the same order" in message
        assert "'v0" in message and "'v1" in message


@pytest.mark.parametrize("cap_mb", [TINY_MB, 25.0])
def test_sources_in_different_orders_raise_on_every_replica_and_change_nothing(cap_mb):
    strategy = _strategy()
    vs, errors = _pair(strategy), {}
    _ordered_step(strategy, vs, GradientSync(cap_mb), [(0, 1), (1, 0)], errors, dtape.optimizers.SGD(1.0))
    _assert_raised_on_every_replica(errors)
    for v in vs:
        np.testing.assert_array_equal(v.numpy(), [0.0, 0.0])
    errors = {}  # replica 1 passing its own components in the other order
    assert _ordered_step(strategy, vs, GradientSync(cap_mb), [(0, 1), (1, 0)], errors) == {}
    _assert_raised_on_every_replica(errors)


@pytest.mark.parametrize("cap_mb", [TINY_MB, 25.0])
def test_an_order_changed_after_the_layout_was_kept_raises(cap_mb):
    strategy = _strategy()
    vs, sync, opt = _pair(strategy), GradientSync(cap_mb), dtape.optimizers.SGD(1.0)
    for _ in range(2):  # the second step keeps each replica's layout
        errors = {}
        _ordered_step(strategy, vs, sync, [(0, 1), (0, 1)], errors, opt)
        assert errors == {}
    _ordered_step(strategy, vs, sync, [(0, 1), (1, 0)], errors, opt)
    _assert_raised_on_every_replica(errors)
    np.testing.assert_array_equal(vs[0].numpy(), [-6.0, -6.0])
    np.testing.assert_array_equal(vs[1].numpy(), [-60.0, -60.0])


def test_gradient_sync_outside_a_strategy_is_plain():
    v = dtape.Variable([1.0, 2.0])
    with dtape.GradientTape(gradient_sync=GradientSync()) as tape:
        loss = dtape.reduce_sum(v * v)
    np.testing.assert_array_equal(tape.gradient(loss, v).numpy(), [2.0, 4.0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        GradientSync(0)
    with pytest.raises(ValueError, match="order"):
        GradientSync(order="forward")
    with pytest.raises(TypeError, match="gradient_sync"):
        dtape.GradientTape(gradient_sync=object())


def test_plan_buckets_cap_and_dtypes():
    cpu = torch.device("cpu")
    items = [(0, (256,), torch.float32, cpu), (1, (256,), torch.float32, cpu), (2, (10,), torch.float64, cpu),
             (3, (200,), torch.float32, cpu), (4, (4,), torch.float16, cpu)]
    buckets = plan_buckets(items, cap_bytes=1024)
    layout = [(b.dtype, [m[0] for m in b.members]) for b in buckets]
    assert layout == [(torch.float32, [0]), (torch.float32, [1]), (torch.float64, [2]), (torch.float32, [3, 4])]
    assert buckets[3].size() == 204 + 2     # values, then one presence flag per member


def test_plan_buckets_first_bucket_has_its_own_cap():
    # DDP's layout: the first bucket of each dtype closes at first_cap_bytes, the later ones at cap_bytes.
    cpu = torch.device("cpu")
    items = [(j, (256,), torch.float32, cpu) for j in range(6)] + [(6, (128,), torch.float64, cpu),
                                                                   (7, (128,), torch.float64, cpu)]
    buckets = plan_buckets(items, cap_bytes=4096, first_cap_bytes=1024)
    layout = [(b.dtype, [m[0] for m in b.members]) for b in buckets]
    assert layout == [(torch.float32, [0]), (torch.float32, [1, 2, 3, 4]), (torch.float32, [5]),
                      (torch.float64, [6]), (torch.float64, [7])]


def test_gradient_sync_first_bucket_cap_checked_and_never_above_the_cap():
    with pytest.raises(ValueError, match="first_bucket_cap_mb"):
        GradientSync(first_bucket_cap_mb=0)
    sync = GradientSync(bucket_cap_mb=0.5, first_bucket_cap_mb=4)
    assert sync.first_bucket_cap_bytes == sync.bucket_cap_bytes == 2**19
    assert GradientSync().first_bucket_cap_bytes == 2**20   # DDP's 1 MB


@pytest.mark.parametrize("first_mb,launches", [(1.0, 2), (25.0, 1)])
def test_small_first_bucket_is_launched_before_the_walk_ends(first_mb, launches):
    # Two 1 MB weights: with DDP's 1 MB first bucket, the last layer's gradients go out on their
    # own from inside the walk (before the first layer's are computed); with one 25 MB cap,
    # everything waits for the last gradient. Either way the reduction equals the per-variable one.
    strategy = _strategy()
    with strategy.scope():
        model = dtape.layers.Sequential([dtape.layers.Dense(512, "tanh", input_dim=512, seed=1),
                                         dtape.layers.Dense(512, input_dim=512, seed=2)])
    calls = _count_launches(strategy)
    seen = []

    def fn():
        x = dtape.constant(np.random.default_rng(_rid()).normal(size=(2, 512)), dtype=torch.float32)
        with dtape.GradientTape(gradient_sync=GradientSync(first_bucket_cap_mb=first_mb, order="reverse")) as tape:
            loss = dtape.reduce_sum(model(x) ** 2)
        variables = model.trainable_variables
        grads = tape.gradient(loss, variables)
        seen.append([g.numpy().copy() for g in grads])
        return [g for g, _ in reduce_gradients(list(zip(grads, variables)))]
    reduced = strategy.run(fn)
    assert _per_replica(calls, 2) == [launches, launches]
    assert all(inside for _, inside in calls)
    for k, got in enumerate(reduced):   # the sum of both replicas' gradients (a + b == b + a exactly)
        want = seen[0][k] + seen[1][k]
        for part in strategy.experimental_local_results(got):
            np.testing.assert_array_equal(part.numpy(), want)


def test_a_gradient_shared_by_every_replica_is_not_summed():
    strategy = _strategy()
    with strategy.scope():
        v = dtape.Variable(1.0)
    shared = dtape.constant(1.0)   # one object, made outside the replica function: not distributed
    with pytest.raises(ValueError, match="non-distributed"):
        strategy.run(lambda: dtape.optimizers.SGD(0.1).apply_gradients([(shared, v)]))
    assert [float(c) for c in v.values] == [1.0, 1.0]


def test_buckets_follow_the_learned_readiness_order():
    strategy = _strategy()
    model = _model(strategy)
    sync, opt = GradientSync(TINY_MB), dtape.optimizers.SGD(0.1)
    sizes = []
    orig = strategy.extended._all_reduce_flat_async

    def recording(reduce_op, tensors, **kw):
        if _rid() == 0:
            sizes.append(sum(int(t.numel()) for t in tensors))
        return orig(reduce_op, tensors, **kw)
    strategy.extended._all_reduce_flat_async = recording
    variables = list(model.trainable_variables)                  # W1 b1 W2 b2 W3 b3
    shuffled = [variables[i] for i in (2, 1, 4, 0, 5, 3)]         # W2 b1 W3 W1 b3 b2

    def step():
        x, y = _batch(_rid())
        with dtape.GradientTape(gradient_sync=sync) as tape:
            loss = _loss(model, x, y)
        opt.apply_gradients(zip(tape.gradient(loss, shuffled), shuffled))
    strategy.run(step)
    first, sizes[:] = list(sizes), []
    strategy.run(step)
    bucket = [int(np.prod(v.shape)) + 1 for v in shuffled]       # values + one presence flag
    assert first == bucket[::-1] + [N_VARS]                      # reverse source order, then the agreement
    # The walk finishes the last layer first: b3 W3 b2 W2 b1 W1 (each layer reads its kernel, then its bias).
    assert sizes == [int(np.prod(v.shape)) + 1 for v in variables[::-1]]


@pytest.mark.parametrize("sync", [None, "sync"])
def test_complex_gradients_are_summed_over_replicas(sync):
    """A complex bucket's presence flags are complex too: a variable counts as present where its flag sum is not 0."""
    def coefficient(r):
        return dtape.constant(torch.full((3,), 1 + 2j * (r + 1), dtype=torch.complex64))

    def loss_fn(v, r):
        return dtape.reduce_sum(v * coefficient(r))
    strategy = _strategy()
    with strategy.scope():
        v = dtape.Variable(torch.ones(3, dtype=torch.complex64))
    opt = dtape.optimizers.SGD(0.5)

    def step():
        with dtape.GradientTape(gradient_sync=GradientSync() if sync else None) as tape:
            loss = loss_fn(v, _rid())
        opt.apply_gradients(zip(tape.gradient(loss, [v]), [v]))
    strategy.run(step)
    one = dtape.Variable(torch.ones(3, dtype=torch.complex64))  # the same step on one device: both losses
    with dtape.GradientTape() as tape:
        loss = loss_fn(one, 0) + loss_fn(one, 1)
    dtape.optimizers.SGD(0.5).apply_gradients([(tape.gradient(loss, one), one)])
    assert not np.allclose(one.numpy(), 1.0)
    for comp in v.values:
        np.testing.assert_allclose(comp.numpy(), one.numpy(), rtol=1e-6)


@pytest.mark.parametrize("flat", [False, True])
def test_bucket_layouts_launch_as_the_devices_want_and_reduce_the_same(monkeypatch, flat):
    """CPU replicas sum a bucket's gradients as they are (one tensor per member, then the flags); with an
    accelerator among the devices (forced here) a bucket goes as one flat buffer. Same reduction either way."""
    strategy = _strategy()
    assert strategy.extended._flat_buckets is False          # cpu:0, cpu:1
    monkeypatch.setattr(type(strategy.extended), "_flat_buckets", flat)
    model = _model(strategy, torch.float64)
    sizes, orig = [], strategy.extended._all_reduce_flat_async

    def recording(reduce_op, tensors, **kw):
        if _rid() == 0:
            sizes.append([int(t.numel()) for t in tensors])
        return orig(reduce_op, tensors, **kw)
    strategy.extended._all_reduce_flat_async = recording

    def fn():
        x, y = _batch(_rid(), 0, torch.float64)
        with dtape.GradientTape(gradient_sync=GradientSync(25.0, order="reverse")) as tape:
            loss = _loss(model, x, y)
        variables = model.trainable_variables
        grads = tape.gradient(loss, variables)
        reduced = [g for g, _ in reduce_gradients(list(zip(grads, variables)))]
        return reduced, grads
    reduced, grads = strategy.run(fn)
    members = [int(np.prod(v.shape)) for v in model.trainable_variables][::-1]
    assert sizes == ([[sum(members) + N_VARS]] if flat else [members + [N_VARS]])
    for k in range(N_VARS):
        local = [g.torch() for g in strategy.experimental_local_results(grads[k])]
        for got in strategy.experimental_local_results(reduced[k]):
            np.testing.assert_allclose(got.numpy(), (local[0] + local[1]).numpy(), rtol=1e-15)


@pytest.mark.parametrize("case", ["all_present", "one_missing", "missing_everywhere", "float16"])
def test_flat_buckets_sum_each_member_in_place_whether_flattened_in_one_call_or_one_by_one(monkeypatch, case):
    """A flat bucket (as across workers) whose gradients are all present in its dtype is flattened and
    unflattened in one call each; a missing gradient (zeros, presence flag 0) or a float16 one (summed in
    float32) go member by member. Either way every variable gets the exact sum of its replicas' gradients,
    None where no replica has one."""
    strategy = _strategy()
    monkeypatch.setattr(type(strategy.extended), "_flat_buckets", True)
    dtype = torch.float16 if case == "float16" else torch.float32
    with strategy.scope():
        vs = [dtape.Variable(torch.ones(2, 3, dtype=dtype)), dtape.Variable(torch.ones(3, dtype=dtype)),
              dtape.Variable(torch.ones(4, dtype=dtype))]
    one_by_one = []
    monkeypatch.setattr(gradient_sync, "_flat", lambda *a: one_by_one.append(1) or flat_member(*a))

    def fn():
        r = _rid()
        with dtape.GradientTape(gradient_sync=GradientSync(25.0, order="reverse")) as tape:
            # replica 1 (every replica) never uses vs[2]: its gradient is None there
            used = vs[:2] if case == "missing_everywhere" or case == "one_missing" and r == 1 else vs
            loss = dtape.add_n([(k + 1) * (r + 2) * dtape.reduce_sum(v * v) for k, v in enumerate(used)])
        grads = tape.gradient(loss, vs)
        return [g for g, _ in reduce_gradients(list(zip(grads, vs)))]
    reduced = strategy.run(fn)
    # d/dv of (k + 1)(r + 2) sum(v^2) at v = 1: 2 (k + 1)(r + 2); summed over r = 0, 1: 10 (k + 1)
    expect = [10.0, 20.0, {"one_missing": 12.0, "missing_everywhere": None}.get(case, 30.0)]  # 12: 2 * 3 * 2
    for k, v in enumerate(vs):
        if expect[k] is None:
            assert reduced[k] is None
            continue
        for got in strategy.experimental_local_results(reduced[k]):
            assert got.dtype == dtype and tuple(got.shape) == tuple(v.shape)
            np.testing.assert_array_equal(got.numpy(), np.full(tuple(v.shape), expect[k]))
    assert (len(one_by_one) == 0) == (case == "all_present"), one_by_one   # (zeros for each None)


# -- the learned order after a failed first step ----------------------------------------

def _three_sizes(strategy):
    with strategy.scope():
        return [dtape.Variable(torch.ones(k + 1)) for k in range(3)]   # sizes 1, 2, 3: a mismatch shows


def _sized_loss(ws, hook=lambda x: x):
    # Summed last-to-first, so the walk finishes w0 first: the learned order (0 1 2) is not the
    # first call's reverse source order (2 1 0), and replicas that disagree launch different sizes.
    r = _rid()
    terms = [(k + 1) * (r + 1) * dtape.reduce_sum(hook(ws[k] * 1.0)) for k in (2, 1, 0)]
    return dtape.add_n(terms)


def _expect_sgd_steps(ws, steps):
    # gradient of w_k: (k + 1)(r + 1), summed over replicas r = 0, 1: 3(k + 1); SGD(0.1)
    for k, w in enumerate(ws):
        for c in w.values:
            np.testing.assert_allclose(c.numpy(), np.full(k + 1, 1 - steps * 0.3 * (k + 1)), rtol=1e-6)


def test_first_step_failing_on_one_replica_after_the_order_agreement_leaves_later_steps_correct(monkeypatch):
    strategy = _strategy()
    ws = _three_sizes(strategy)
    sync, opt = GradientSync(TINY_MB), dtape.optimizers.SGD(0.1)
    learned = GradientSync._learned
    failed = []

    def fail_once_on_replica_1(self, key, order):   # e.g. Ctrl-C's StepAborted landing right here
        if _rid() == 1 and not failed:
            failed.append(True)
            raise RuntimeError("replica 1 fails between the order's all-reduce and adopting it")
        return learned(self, key, order)
    monkeypatch.setattr(GradientSync, "_learned", fail_once_on_replica_1)

    def step():
        with dtape.GradientTape(gradient_sync=sync) as tape:
            loss = _sized_loss(ws)
        opt.apply_gradients(zip(tape.gradient(loss, ws), ws))
    with pytest.raises(RuntimeError, match="replica 1 fails"):
        strategy.run(step)
    _expect_sgd_steps(ws, 0)
    strategy.run(step)   # before: replica 0 used the learned order, replica 1 learned again (ValueError)
    strategy.run(step)
    _expect_sgd_steps(ws, 2)


def test_first_step_timing_out_with_a_replica_stuck_in_its_walk_leaves_later_steps_correct():
    strategy = _strategy()
    ws = _three_sizes(strategy)
    sync, opt = GradientSync(TINY_MB), dtape.optimizers.SGD(0.1)
    stuck, release, left = threading.Event(), threading.Event(), threading.Event()

    @dtape.custom_gradient
    def stall_on_replica_1(x):
        def grad(dy):
            if _rid() == 1 and not release.is_set():
                stuck.set()
                release.wait(10)
            return dy
        return dtape.identity(x), grad

    def step():
        with dtape.GradientTape(gradient_sync=sync) as tape:
            loss = _sized_loss(ws, stall_on_replica_1)
        try:
            grads = tape.gradient(loss, ws)
        finally:
            if _rid() == 1 and stuck.is_set():
                left.set()
        opt.apply_gradients(zip(grads, ws))
    strategy._timeout = 0.5   # replica 0 waits for replica 1 in the first step's all-reduces
    with pytest.raises(TimeoutError):
        strategy.run(step)
    strategy._timeout = 5
    release.set()
    # The abandoned replica 1 finishes its walk now, on the failed step's collectives: it must not adopt an
    # order (before: it completed the order's all-reduce alone and adopted it; replica 0 had not).
    assert left.wait(10)
    strategy.run(step)
    strategy.run(step)
    _expect_sgd_steps(ws, 2)


@pytest.mark.parametrize("order", ["readiness", "reverse"])
def test_a_kept_bucket_layout_follows_the_sources_of_each_call(order):
    """One GradientSync keeps each replica's bucket layout while tape.gradient gets the same source objects:
    a list in another order, a shorter list, new variables of the same shapes and a source whose shape
    changed (refused, naming the cause) each get the sums over the replicas of their own gradients."""
    strategy = _strategy(2)
    with strategy.scope():
        first = [dtape.Variable(torch.full(s, float(k + 1), dtype=torch.float64)) for k, s in
                 enumerate([(3, 2), (2,), (5,)])]
        other = [dtape.Variable(torch.full(v.shape, -2.0, dtype=torch.float64)) for v in first]
    sync = GradientSync(TINY_MB, order=order)  # one bucket per source: a stale layout misplaces every sum

    def step(sources, scales):
        r = _rid()
        with dtape.GradientTape(gradient_sync=sync) as tape:
            loss = dtape.add_n([dtape.reduce_sum(v * v) * (s * (r + 1)) for v, s in zip(sources, scales)])
        grads = tape.gradient(loss, sources)
        return [g for g, _ in reduce_gradients(list(zip(grads, sources)))]

    def check(sources, scales):
        reduced = strategy.run(step, args=(sources, scales))
        for v, s, g in zip(sources, scales, reduced):
            want = 2 * v.values[0].torch() * s * 3  # replicas 1 and 2: the scale times 1 + 2
            for part in strategy.experimental_local_results(g):
                assert torch.equal(part.torch(), want)
    for _ in range(3):  # the first call learns the readiness order, the next ones keep the layout
        check(first, [1.0, 2.0, 3.0])
    check(first[::-1], [1.0, 2.0, 3.0])
    check(first[1:], [5.0, 7.0])
    check(other, [1.0, 2.0, 3.0])
    check(first, [1.0, 2.0, 3.0])
    layout = sync._layouts[(id(strategy), 0)]
    bucket = next(b for b in layout.buckets if b.members[0][0] == 0)
    bucket.members[0] = bucket.members[0][:2] + (7, (7,)) + bucket.members[0][4:]  # laid out for 7 elements
    with pytest.raises(ValueError, match=r"a gradient of shape \(3, 2\) for a source laid out as \(7,\)"):
        strategy.run(step, args=(first, [1.0, 2.0, 3.0]))


# -- per list, not per variable: a wrapped module's parameters; gradients of several tapes -------------------------
def test_a_wrapped_modules_parameters_are_noted_in_one_call_and_launched_once(monkeypatch):
    """A TorchModule's parameters all become final with its one record of reads: the walk tells each replica's
    session of all of them in one call, which launches their bucket once; the update is torch's on the whole
    batch (the sum of the replicas' gradients)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    reference = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    reference.load_state_dict(module.state_dict())
    rng = np.random.default_rng(0)
    x, y = torch.tensor(rng.normal(size=(8, 5))), torch.tensor(rng.normal(size=(8, 3)))
    strategy = _strategy()
    with strategy.scope():
        tm = dtape.layers.TorchModule(module)
        opt = dtape.optimizers.SGD(0.1)
    calls = []
    ready = gradient_sync._Session.ready
    monkeypatch.setattr(gradient_sync._Session, "ready",
                        lambda self, js, gs: calls.append((_rid(), list(js))) or ready(self, js, gs))
    launches = _count_launches(strategy)
    sync = GradientSync(order="reverse")  # no order agreement: the bucket's all-reduce is the only launch

    def step():
        part = slice(4 * _rid(), 4 * _rid() + 4)
        variables = tm.trainable_variables
        with dtape.GradientTape(gradient_sync=sync) as tape:
            loss = dtape.reduce_sum((tm(dtape.constant(x[part])) - dtape.constant(y[part])) ** 2) / 8
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    strategy.run(step)
    assert sorted(calls) == [(0, [0, 1, 2, 3]), (1, [0, 1, 2, 3])]
    assert sorted(launches) == [(0, True), (1, True)]  # one bucket each, launched inside the walk
    (((reference(x) - y) ** 2).sum() / 8).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    for var, want in zip(tm.trainable_variables, reference.parameters()):
        for comp in var.values:
            torch.testing.assert_close(comp.torch(), want, rtol=1e-12, atol=1e-14)


def _two_tapes(sync):
    """One step whose apply_gradients gets the gradients of two tapes (each over half of the variables)."""
    strategy = _strategy()
    model = _model(strategy, torch.float64)
    opt = dtape.optimizers.SGD(0.1)
    launches = _count_launches(strategy)

    def step():
        x, y = _batch(_rid(), 0, torch.float64)
        variables = model.trainable_variables
        with dtape.GradientTape(gradient_sync=sync) as first:
            loss = _loss(model, x, y)
        with dtape.GradientTape(gradient_sync=sync) as second:
            loss2 = 2.0 * _loss(model, x, y)
        grads = first.gradient(loss, variables[:3]) + second.gradient(loss2, variables[3:])
        opt.apply_gradients(zip(grads, variables))
    strategy.run(step)
    return _values(model), _per_replica(launches, 2)


def test_gradients_of_two_synced_tapes_applied_together_use_each_tapes_launches():
    plain, plain_launches = _two_tapes(None)
    synced, synced_launches = _two_tapes(GradientSync(TINY_MB, order="reverse"))
    _assert_same(plain, synced)
    assert plain_launches == [1, 1]            # apply_gradients reduces all six in one bucket
    assert synced_launches == [N_VARS, N_VARS]  # each variable's bucket, launched by its tape; nothing again
