"""Reductions that cannot depend on object identity, SyncOnRead in the cross-replica context,
low-precision accumulation, per-replica collective results, and the standard loop on every strategy."""

import collections

import numpy as np
import pytest
import torch

import dtape
from dtape import distribute as ds
from dtape import nest
from dtape import tape as _tape
from dtape.distribute.values import map_leaves
from _interleave import interleaved, run_threads

SUM, MEAN = ds.ReduceOp.SUM, ds.ReduceOp.MEAN
AGG = dtape.VariableAggregation


@pytest.fixture
def strategy():
    return ds.MirroredStrategy(["cpu:0", "cpu:1"], timeout=10)


def _ctx():
    return ds.get_replica_context()


def _rid():
    return _ctx().replica_id_in_sync_group


def _floats(per_replica, strategy):
    return [float(v) for v in strategy.experimental_local_results(per_replica)]


# -- point 4: non-distributed values -------------------------------------------------
def test_all_reduce_sum_of_tensor_made_outside_raises_naming_the_fix(strategy):
    shared = dtape.constant(1.0)
    with pytest.raises(ValueError, match=r"non-distributed.*per-replica.*MEAN.*num_replicas_in_sync"):
        strategy.run(lambda: _ctx().all_reduce(SUM, shared))
    inside = strategy.run(lambda: _ctx().all_reduce(SUM, dtape.constant(1.0)))
    assert _floats(inside, strategy) == [2.0, 2.0]


def test_all_reduce_mean_of_tensor_made_outside_returns_it(strategy):
    shared = dtape.constant([1.0, 5.0])
    out = strategy.experimental_local_results(strategy.run(lambda: _ctx().all_reduce(MEAN, shared)))
    assert len(out) == 2
    for value in out:
        np.testing.assert_array_equal(value.numpy(), [1.0, 5.0])


def test_all_reduce_of_a_python_number_counts_it_once_per_replica(strategy):
    # Both replicas pass the very same constant object; the sum must not depend on that.
    out = strategy.run(lambda: (_ctx().all_reduce(SUM, 1.5), _ctx().all_reduce(MEAN, 3)))
    assert _floats(out[0], strategy) == [3.0, 3.0]
    assert _floats(out[1], strategy) == [3.0, 3.0]


def test_all_reduce_of_a_variable_reads_it_once_per_replica(strategy):
    with strategy.scope():
        mirrored = dtape.Variable(2.0)
    plain = dtape.Variable(5.0)
    out = strategy.run(lambda: (_ctx().all_reduce(SUM, mirrored), _ctx().all_reduce(SUM, plain)))
    assert _floats(out[0], strategy) == [4.0, 4.0]
    assert _floats(out[1], strategy) == [10.0, 10.0]


@pytest.mark.parametrize("made", ["outside", "inside"])
def test_assign_add_with_sum_aggregation_never_depends_on_where_the_delta_was_made(strategy, made):
    with strategy.scope():
        v = dtape.Variable(10.0, aggregation=AGG.SUM)
    shared = dtape.constant(1.0)

    def step():
        v.assign_add(shared if made == "outside" else dtape.constant(1.0))
    if made == "outside":
        with pytest.raises(ValueError, match="non-distributed"):
            strategy.run(step)
        expected = 10.0
    else:
        strategy.run(step)
        expected = 12.0
    assert [float(c) for c in v.values] == [expected, expected]


def test_assign_add_with_mean_aggregation_of_shared_tensor_adds_it_once(strategy):
    with strategy.scope():
        v = dtape.Variable(10.0, aggregation=AGG.MEAN)
    shared = dtape.constant(4.0)
    strategy.run(lambda: v.assign_add(shared))
    assert [float(c) for c in v.values] == [14.0, 14.0]


def test_strategy_reduce_of_non_distributed_value(strategy):
    shared = dtape.constant([2.0, 4.0])
    with pytest.raises(ValueError, match="non-distributed"):
        strategy.reduce(SUM, shared)
    with pytest.raises(ValueError, match="non-distributed"):
        strategy.reduce(SUM, strategy.run(lambda: shared))  # the same object from every replica
    with pytest.raises(ValueError, match="non-distributed"):
        strategy.reduce(SUM, shared, axis=0)
    np.testing.assert_array_equal(strategy.reduce(MEAN, shared).numpy(), [2.0, 4.0])
    assert float(strategy.reduce(MEAN, shared, axis=0)) == 3.0
    per_replica = strategy.run(lambda: shared * 1.0)  # a new tensor on each replica
    np.testing.assert_array_equal(strategy.reduce(SUM, per_replica).numpy(), [4.0, 8.0])


def test_run_with_different_structures_per_replica_raises(strategy):
    with pytest.raises(ValueError, match="different structures"):
        strategy.run(lambda: [dtape.constant(1.0)] * (1 + _rid()))


# -- point 4: SyncOnReadVariable in the cross-replica context ------------------------
def _sync_var(strategy, aggregation, parts=(3.0, 10.0), dtype=torch.float32):
    with strategy.scope():
        v = dtape.Variable(torch.zeros((), dtype=dtype), synchronization=dtape.VariableSynchronization.ON_READ,
                           aggregation=aggregation)
    strategy.run(lambda: v.assign(torch.tensor(parts[_rid()], dtype=dtype)))
    return v


def test_sync_on_read_sum_cross_replica_reads_writes_and_host_views(strategy):
    v = _sync_var(strategy, AGG.SUM)
    with strategy.scope():
        assert float(v.read_value()) == 13.0
        assert float(v) == 13.0 and v.numpy() == 13.0 and np.asarray(v) == 13.0
        assert float(v.torch()) == 13.0
        v.assign(10.0)
        assert [float(c) for c in v.values] == [5.0, 5.0] and float(v.read_value()) == 10.0
        v.assign_add(4.0)
        assert float(v.read_value()) == 14.0
        v.assign_sub(1.0)
        assert float(v.read_value()) == 13.0 and v.numpy() == 13.0
    assert _floats(strategy.run(lambda: v.read_value()), strategy) == [6.5, 6.5]  # replicas: their own part


def test_sync_on_read_sum_integer_assign_reads_back_exactly(strategy):
    v = _sync_var(strategy, AGG.SUM, parts=(0, 0), dtype=torch.int64)
    with strategy.scope():
        v.assign(7)
        assert int(v.read_value()) == 7 and sorted(int(c) for c in v.values) == [3, 4]
        v.assign_add(3)
        assert int(v.read_value()) == 10


def test_sync_on_read_mean_cross_replica(strategy):
    v = _sync_var(strategy, AGG.MEAN)
    with strategy.scope():
        assert float(v.read_value()) == 6.5 and v.numpy() == 6.5
        v.assign(4.0)
        assert [float(c) for c in v.values] == [4.0, 4.0]
        v.assign_add(1.5)
        assert float(v.read_value()) == 5.5


def test_sync_on_read_only_first_replica_cross_replica(strategy):
    v = _sync_var(strategy, AGG.ONLY_FIRST_REPLICA)
    with strategy.scope():
        assert float(v.read_value()) == 3.0 and v.numpy() == 3.0
        v.assign(4.0)
        v.assign_add(2.0)
        assert [float(c) for c in v.values] == [6.0, 6.0]


# -- point 4: float16 / bfloat16 accumulate in float32 --------------------------------
# float16: each value fits; the sum of two does not; the mean (the result) does.
BIG = 40000.0
F16 = torch.float16


def _c(values, dtype):
    return dtape.constant(torch.tensor(values, dtype=dtype))


def test_float16_strategy_reduce_overflows_only_when_the_result_does(strategy):
    pair = ds.PerReplica((_c([BIG, BIG], F16), _c([BIG, BIG], F16)))
    got = strategy.reduce(MEAN, pair)
    assert got.dtype == F16 and got.numpy().tolist() == [BIG, BIG]
    assert float(strategy.reduce(MEAN, pair, axis=0)) == BIG
    assert strategy.reduce(MEAN, pair, axis=0).dtype == F16
    ragged = ds.PerReplica((_c([BIG, BIG], F16), _c([-BIG], F16)))
    assert float(strategy.reduce(SUM, ragged, axis=0)) == BIG
    assert float(strategy.reduce(SUM, ragged, axis=(0,))) == BIG
    assert np.isinf(float(strategy.reduce(SUM, pair, axis=0)))  # the result itself overflows


def test_float16_all_reduce_and_sync_on_read_mean_do_not_overflow(strategy):
    out = strategy.run(lambda: _ctx().all_reduce(MEAN, _c(BIG, F16)))
    for value in strategy.experimental_local_results(out):
        assert value.dtype == F16 and float(value) == BIG
    v = _sync_var(strategy, AGG.MEAN, parts=(BIG, BIG), dtype=F16)
    with strategy.scope():
        assert float(v.read_value()) == BIG and v.numpy() == BIG


# Three replicas giving (base, 1, 1): summed one by one in the low dtype, base + 1 rounds
# back to base (twice); accumulated in float32 the exact base + 2 is representable.
PRECISION_BASE = {torch.float16: 2048.0, torch.bfloat16: 256.0}


@pytest.mark.parametrize("low", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_low_precision_reductions_round_once(low):
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], timeout=10)
    base = PRECISION_BASE[low]
    parts = (base, 1.0, 1.0)
    values = ds.PerReplica(tuple(_c([p], low) for p in parts))
    total = strategy.reduce(SUM, values)
    assert total.dtype == low and float(total) == base + 2
    assert float(strategy.reduce(SUM, values, axis=0)) == base + 2
    out = strategy.run(lambda: _ctx().all_reduce(SUM, _c(parts[_rid()], low)))
    assert [float(v) for v in strategy.experimental_local_results(out)] == [base + 2] * 3
    v = _sync_var(strategy, AGG.SUM, parts=parts, dtype=low)
    with strategy.scope():
        assert float(v.read_value()) == base + 2


# -- point 3: collectives give every replica its own result ----------------------------
def test_all_reduce_and_all_gather_give_each_replica_its_own_result(strategy):
    def step():
        x = dtape.constant([float(_rid() + 1)])
        return _ctx().all_reduce(SUM, x), _ctx().all_gather(x, axis=0)
    reduced, gathered = strategy.run(step)
    r0, r1 = strategy.experimental_local_results(reduced)
    g0, g1 = strategy.experimental_local_results(gathered)
    assert r0 is not r1 and g0 is not g1
    assert r0.numpy().tolist() == r1.numpy().tolist() == [3.0]
    assert g0.numpy().tolist() == g1.numpy().tolist() == [1.0, 2.0]
    assert r0.device == r1.device == torch.device("cpu")


def test_all_gather_of_tensor_made_outside_contributes_once_per_replica(strategy):
    shared = dtape.constant([7.0])
    out = strategy.run(lambda: _ctx().all_gather(shared, axis=0))
    assert [v.numpy().tolist() for v in strategy.experimental_local_results(out)] == [[7.0, 7.0]] * 2


def test_gradient_of_mirrored_variable_wrt_itself_in_replica_context(strategy):
    with strategy.scope():
        v = dtape.Variable(2.0)

    def step():
        with dtape.GradientTape() as tape:
            y = v * 3.0
        return tape.gradient([v, y], v)
    assert _floats(strategy.run(step), strategy) == [4.0, 4.0]


# -- point 9: the standard loop on the default and one-device strategies ---------------
def _standard_loop(strategy, data):
    with strategy.scope():
        w = dtape.Variable(torch.tensor([[0.5], [-0.25]], dtype=torch.float64))
        opt = dtape.optimizers.SGD(0.1)

    def step(batch):
        x, y = batch
        with dtape.GradientTape() as tape:
            err = dtape.matmul(dtape.convert_to_tensor(x), w) - dtape.convert_to_tensor(y)
            loss = dtape.reduce_sum(err * err) / 4.0
        opt.apply_gradients([(tape.gradient(loss, w), w)])
        return loss
    losses = [float(strategy.reduce(SUM, strategy.run(step, args=(b,)), axis=None))
              for b in strategy.experimental_distribute_dataset(data)]
    return losses, w


@pytest.mark.parametrize("make", [ds.get_strategy, lambda: ds.OneDeviceStrategy("cpu")], ids=["default", "one_device"])
def test_standard_loop_runs_on_single_replica_strategies(make):
    rng = np.random.default_rng(0)
    data = [(rng.normal(size=(4, 2)), rng.normal(size=(4, 1))) for _ in range(3)]
    losses, w = _standard_loop(make(), data)
    wt = torch.tensor([[0.5], [-0.25]], dtype=torch.float64)
    expected = []
    for x, y in data:  # the same steps by hand, in torch
        x, y = torch.as_tensor(x), torch.as_tensor(y)
        wr = wt.clone().requires_grad_()
        loss = ((x @ wr - y) ** 2).sum() / 4.0
        (g,) = torch.autograd.grad(loss, wr)
        expected.append(float(loss.detach()))
        wt = wt - 0.1 * g
    np.testing.assert_allclose(losses, expected, rtol=1e-12)
    np.testing.assert_allclose(w.numpy(), wt.numpy(), rtol=1e-12)


def test_default_strategy_dataset_passes_batches_and_run_takes_replica_zero_part():
    default = ds.get_strategy()
    batches = [np.ones((3, 2)), np.zeros((2, 2))]
    assert list(default.experimental_distribute_dataset(batches)) == batches  # TF: the dataset itself
    out = default.run(lambda x, scale: x * scale, args=(ds.PerReplica((dtape.constant(2.0),)),),
                      kwargs={"scale": ds.PerReplica((dtape.constant(3.0),))})
    assert float(out) == 6.0


def test_default_replica_context_collectives_return_tensors():
    x = dtape.constant([1.0, 2.0])
    out = ds.get_replica_context().all_reduce(SUM, x)
    assert isinstance(out, dtape.Tensor)
    np.testing.assert_array_equal(out.numpy(), [1.0, 2.0])
    gathered = ds.get_replica_context().all_gather(x, axis=0)
    assert isinstance(gathered, dtape.Tensor) and gathered.shape == (2,)


# -- point 3 on a real second device -----------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mixed_devices_reductions_copy_to_the_destination():
    strategy = ds.MirroredStrategy(["cpu:0", "cuda:0"], timeout=30)
    cpu, cuda = torch.device("cpu"), torch.device("cuda:0")
    values = ds.PerReplica((dtape.constant([1.0, 2.0]), dtape.constant([3.0, 4.0], device="cuda:0")))
    total = strategy.reduce(SUM, values)
    assert total.device == cpu and total.numpy().tolist() == [4.0, 6.0]
    assert float(strategy.reduce(MEAN, values, axis=0)) == 2.5

    def step():
        x = dtape.constant([float(_rid() + 1)], device=strategy.extended.worker_devices[_rid()])
        return _ctx().all_reduce(SUM, x), _ctx().all_gather(x, axis=0)
    reduced, gathered = strategy.run(step)
    assert [v.device for v in strategy.experimental_local_results(reduced)] == [cpu, cuda]
    assert [v.device for v in strategy.experimental_local_results(gathered)] == [cpu, cuda]
    assert [v.cpu().tolist() for v in (r.torch() for r in strategy.experimental_local_results(reduced))] == [[3.0]] * 2
    v = _sync_var(strategy, AGG.SUM)
    assert [c.device for c in v.values] == [cpu, cuda]
    with strategy.scope():
        assert float(v.read_value()) == 13.0 and v.numpy() == 13.0
        v.assign(10.0)
        assert float(v.read_value()) == 10.0
    half = ds.PerReplica((_c([BIG], F16), dtape.constant(torch.tensor([BIG], dtype=F16, device=cuda))))
    assert float(strategy.reduce(MEAN, half)) == BIG


# -- writes of every component are atomic ------------------------------------------------
def _race(writers, timeout=5):
    """Runs the writers on threads under forced interleaving; re-raises the first error."""
    with interleaved(seed=0):
        run_threads(writers, timeout)


@pytest.mark.parametrize("kind", ["mirrored", "sync_on_read_mean"])
def test_concurrent_cross_replica_writes_leave_components_identical(kind):
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2", "cpu:3"], timeout=10)
    with strategy.scope():
        if kind == "mirrored":
            var = dtape.Variable(torch.zeros(2))
        else:
            var = dtape.Variable(torch.zeros(2), synchronization=dtape.VariableSynchronization.ON_READ,
                                 aggregation=AGG.MEAN)
    for trial in range(25):
        _race([lambda v=float(i): [var.assign(torch.full((2,), v)) for _ in range(5)] for i in range(4)])
        comps = [c.numpy() for c in var.values]
        for c in comps[1:]:
            np.testing.assert_array_equal(c, comps[0], err_msg=f"trial {trial}: components {comps}")
        var.assign_add(torch.ones(2))       # and a read-modify-write keeps them equal too


def test_gradient_with_respect_to_components_is_each_components_own():
    """Seed 2's total derivative is for the container; a component passed as a source gets its own
    gradient (found while writing the docs: each component got the container's total)."""
    with dtape.distribute.MirroredStrategy(["cpu:0", "cpu:1"], timeout=10) as strategy:
        with strategy.scope():
            v = dtape.Variable(1.0)
        with dtape.GradientTape() as tape:
            total = strategy.reduce("SUM", strategy.run(lambda: v * 3.0), axis=None)
        by_component = tape.gradient(total, list(v.values) + [v])
    assert [float(g) for g in by_component] == [3.0, 3.0, 6.0]


def test_map_leaves_equals_nest_map_structure():
    # select_replica (every run, merge_call and update) maps in one pass; the result must be
    # map_structure's: same values, same container types, dicts in sorted key order.
    Pair = collections.namedtuple("Pair", "a b")
    structure = [1, (2, Pair(3, [4, {"z": 5, "a": (6,)}])), collections.OrderedDict([("y", 7), ("b", 8)]), {}, ()]
    got = map_leaves(lambda x: x * 10, structure)
    want = nest.map_structure(lambda x: x * 10, structure)
    assert got == want

    def types(s):
        return [type(s)] + [t for c in (s.values() if isinstance(s, dict) else s) if nest.is_nested(c)
                            for t in types(c)] if nest.is_nested(s) else []
    assert types(got) == types(want)
    assert list(got[2]) == list(want[2]) == ["b", "y"]


# -- the watched-variable resolver's list form -------------------------------------------------
def _resolved_each(variables):
    """What resolving `variables` one by one gives: per variable, the ids of what it watches and of their handles."""
    watched = [tuple(ds.resolve_watched(v)) for v in variables]
    return [tuple(map(id, ws)) for ws in watched], [tuple(id(w._handle()) for w in ws) for ws in watched]


def _resolved_all(variables):
    watched, handles = _tape.resolve_watched_all(variables)
    return [tuple(map(id, ws)) for ws in watched], [tuple(map(id, hs)) for hs in handles]


def test_resolve_watched_all_answers_as_each_variable_resolved_alone_in_every_context(strategy):
    """tape.gradient's sources and a module's reads are resolved per list: in every distribution context
    (none, cross-replica, each replica's, an update's, another strategy's replica) each variable watches
    what `resolve_watched` says and each watched variable's handle is its `_handle()` (this replica's
    component in a replica context: replica 1 never gets replica 0's)."""
    other = ds.MirroredStrategy(["cpu:0", "cpu:1"], timeout=10)
    plain = dtape.Variable(1.0)
    with strategy.scope():
        m = dtape.Variable([1.0, 2.0])
        s = dtape.Variable(0.0, synchronization=dtape.VariableSynchronization.ON_READ, aggregation=AGG.SUM)
    with other.scope():
        o = dtape.Variable(3.0)
    lists = [[m, s], [*m.values, *s.values], [m, plain, s, *m.values, o, *o.values], [plain], []]

    def check():
        for variables in lists:
            assert _resolved_all(variables) == _resolved_each(variables)
        return _resolved_all([m])[1][0][0]

    try:
        check()
        with strategy.scope():
            check()
            with ds.context.enter_mode(strategy, None, update_index=1):
                check()
        handles = strategy.experimental_local_results(strategy.run(check))
        assert list(handles) == [id(m.values[0]), id(m.values[1])]
        other.run(check)
    finally:
        other.close()
