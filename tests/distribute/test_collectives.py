"""ReplicaContext.all_reduce / all_gather on the tape (transposes), and strategy.reduce under a main-thread tape.

References: the same computation written on one device in float64 with
torch.autograd, whose loss is the sum of every replica's loss (psum's
transpose gives replica r the derivative of that sum w.r.t. its own input).
"""
import sys

import numpy as np
import pytest
import torch

import dtape
from dtape.distribute import MirroredStrategy, ReduceOp

N = 2


@pytest.fixture
def strategy():
    # generous: a loaded machine must not fail these; timeouts are tested elsewhere
    s = MirroredStrategy([f"cpu:{i}" for i in range(N)], timeout=60)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield s
    finally:
        sys.setswitchinterval(old)
        s.close()


def _rid():
    return dtape.distribute.get_replica_context().replica_id_in_sync_group


def _locals(strategy, value):
    return [np.asarray(v.numpy()) for v in strategy.experimental_local_results(value)]


def test_issue_example_sum_gradient_is_3_on_both_replicas(strategy):
    def fn():
        r = _rid()
        x = dtape.constant(float(r + 1))
        with dtape.GradientTape() as tape:
            tape.watch(x)
            y = dtape.distribute.get_replica_context().all_reduce(ReduceOp.SUM, x) * (r + 1)
        return tape.gradient(y, x)
    assert [float(g) for g in _locals(strategy, strategy.run(fn))] == [3.0, 3.0]


# -- one replica's program, written once for dtape (replica) and torch (reference) ---------------
SHAPES = {"sum": lambda r: (3,), "mean": lambda r: (3,),
          "gather0": lambda r: (r + 1, 3), "gather1": lambda r: (2, r + 2)}


def _input(kind, r):
    rng = np.random.default_rng(10 + r)
    return rng.normal(size=SHAPES[kind](r))


def _program(kind, x, r, collective, lib):
    """Replica r's loss: a nonlinear function of its input and of the collective of x**2."""
    a = collective(x * x)
    if kind.startswith("gather"):
        w = lib.constant(np.random.default_rng(r).normal(size=tuple(a.shape)))
        return lib.reduce_sum(lib.sin(a) * w) * lib.reduce_sum(x)
    return lib.reduce_sum(lib.sin(a) * x) * (r + 1)


class _TorchLib:
    constant = staticmethod(lambda v: torch.tensor(v, dtype=torch.float64))
    reduce_sum = staticmethod(torch.sum)
    sin = staticmethod(torch.sin)


def _torch_collective(kind, xs_sq):
    if kind == "sum":
        return sum(xs_sq)
    if kind == "mean":
        return sum(xs_sq) / len(xs_sq)
    return torch.cat(xs_sq, dim=0 if kind == "gather0" else 1)


def _reference(kind):
    """Per replica: first-order gradient and second-order (d/dx_r of sum_s |g_s|^2) in float64."""
    xs = [torch.tensor(_input(kind, r), requires_grad=True) for r in range(N)]
    sq = [x * x for x in xs]
    loss = sum(_program(kind, xs[r], r, lambda _, r=r: _torch_collective(kind, sq), _TorchLib) for r in range(N))
    grads = torch.autograd.grad(loss, xs, create_graph=True)
    second = torch.autograd.grad(sum((g * g).sum() for g in grads), xs)
    return [g.detach().numpy() for g in grads], [h.numpy() for h in second]


def _dtape_collective(kind):
    ctx = dtape.distribute.get_replica_context()
    if kind == "sum":
        return lambda v: ctx.all_reduce(ReduceOp.SUM, v)
    if kind == "mean":
        return lambda v: ctx.all_reduce("MEAN", v)
    return lambda v: ctx.all_gather(v, 0 if kind == "gather0" else 1)


@pytest.mark.parametrize("kind", ["sum", "mean", "gather0", "gather1"])
def test_first_and_second_order_match_one_device(strategy, kind):
    def fn():
        r = _rid()
        x = dtape.constant(_input(kind, r))
        with dtape.GradientTape() as outer:
            outer.watch(x)
            with dtape.GradientTape() as inner:
                inner.watch(x)
                loss = _program(kind, x, r, _dtape_collective(kind), dtape)
            g = inner.gradient(loss, x)
            z = dtape.reduce_sum(g * g)
        return g, outer.gradient(z, x)
    grads, second = strategy.run(fn)
    ref_g, ref_h = _reference(kind)
    for r in range(N):
        np.testing.assert_allclose(_locals(strategy, grads)[r], ref_g[r], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(_locals(strategy, second)[r], ref_h[r], rtol=1e-12, atol=1e-12)


def test_all_reduce_of_a_variable_read_gives_the_summed_gradient(strategy):
    with strategy.scope():
        v = dtape.Variable([1.0, 2.0])

    def fn():
        r = _rid()
        with dtape.GradientTape() as tape:
            s = dtape.distribute.get_replica_context().all_reduce(ReduceOp.SUM, v * (r + 1))
            loss = dtape.reduce_sum(s * s) * (r + 1)
        return tape.gradient(loss, v)
    # s = 3v on both replicas. The cotangent of s summed over replicas is sum_s 2 s (s+1) = 18 v; replica
    # r's input to the all-reduce is (r+1) v_r, so its component's gradient is (r+1) * 18 v.
    got = _locals(strategy, strategy.run(fn))
    for r in range(N):
        np.testing.assert_allclose(got[r], (r + 1) * 18.0 * np.array([1.0, 2.0]), rtol=1e-6)


def test_weighted_mean_all_reduce_value_and_gradient(strategy):
    weights = [3.0, 1.0]

    def fn():
        r = _rid()
        x = dtape.constant(float(r + 1))
        with dtape.GradientTape() as tape:
            tape.watch(x)
            y = dtape.distribute.get_replica_context().all_reduce(ReduceOp.MEAN, x, weight=weights[r])
            loss = y * (r + 1)
        return y, tape.gradient(loss, x)
    y, g = strategy.run(fn)
    assert [float(v) for v in _locals(strategy, y)] == [1.25, 1.25]          # (3*1 + 1*2) / 4
    np.testing.assert_allclose(_locals(strategy, g), [0.75 * 3, 0.75 * 1])   # w_r / W * (1 + 2)


def test_weighted_mean_ignores_an_empty_replica(strategy):
    def fn():
        r = _rid()
        x = dtape.constant([[1.0, 2.0], [3.0, 5.0]]) if r == 0 else dtape.zeros((0, 2))
        return dtape.distribute.get_replica_context().all_reduce(
            "MEAN", dtape.reduce_mean(x, axis=0), weight=x.shape[0])
    for v in _locals(strategy, strategy.run(fn)):
        np.testing.assert_allclose(v, [2.0, 3.5])


def test_weight_with_sum_raises(strategy):
    with pytest.raises(ValueError, match="weights a MEAN"):
        strategy.run(lambda: dtape.distribute.get_replica_context().all_reduce("SUM", 1.0, weight=2))


def test_one_replica_all_reduce_gradient_is_local():
    x = dtape.constant(2.0)
    with dtape.GradientTape() as tape:
        tape.watch(x)
        y = dtape.distribute.get_replica_context().all_reduce("SUM", x) * 5.0
    assert float(tape.gradient(y, x)) == 5.0


def test_main_thread_tape_through_replica_all_reduce_raises_clearly(strategy):
    with strategy.scope():
        v = dtape.Variable(1.0)
    with dtape.GradientTape() as tape:
        per = strategy.run(lambda: dtape.distribute.get_replica_context().all_reduce("SUM", v * 2.0))
        total = strategy.reduce("SUM", per)
    with pytest.raises(RuntimeError, match="replica context"):
        tape.gradient(total, v)


@pytest.mark.parametrize("op,weights,expected", [("SUM", None, 3.0), ("MEAN", None, 1.5),
                                                  ("MEAN", [3.0, 1.0], 1.25)])
def test_strategy_reduce_under_main_thread_tape_is_differentiable(strategy, op, weights, expected):
    with strategy.scope():
        v = dtape.Variable(2.0)
    with dtape.GradientTape() as tape:
        per = strategy.run(lambda: v * float(_rid() + 1))
        total = strategy.reduce(op, per, weights=weights)
    assert float(total) == pytest.approx(2.0 * expected)
    assert float(tape.gradient(total, v)) == pytest.approx(expected)  # total derivative over the components


def test_strategy_reduce_weights_skip_an_empty_replica(strategy):
    per = dtape.distribute.PerReplica((dtape.constant(4.0), dtape.constant(float("nan"))))
    assert float(strategy.reduce("MEAN", per, weights=[2, 0])) == 4.0
    with pytest.raises(ValueError, match="one per replica"):
        strategy.reduce("MEAN", per, weights=[1])


def test_mismatched_collectives_fail_instead_of_mixing(strategy):
    def fn():
        r = _rid()
        x = dtape.constant(np.ones(2 + r))
        with dtape.GradientTape() as tape:
            tape.watch(x)
            y = dtape.reduce_sum(x * 2.0)
        ext = dtape.distribute.get_strategy().extended
        return ext._all_reduce_flat(ReduceOp.SUM, [tape.gradient(y, x).torch()])
    with pytest.raises(ValueError, match="different contributions"):
        strategy.run(fn)


def test_failure_on_one_replica_wakes_a_replica_waiting_in_an_all_reduce(strategy):
    def fn():
        if _rid() == 1:
            raise KeyError("boom on replica 1")
        ext = dtape.distribute.get_strategy().extended
        return ext._all_reduce_flat(ReduceOp.SUM, [torch.ones(3)])
    with pytest.raises(KeyError, match="boom on replica 1"):
        strategy.run(fn)


def test_cpu_replicas_share_the_reduced_buffer_and_accumulating_into_it_changes_neither(strategy):
    """CPU replicas get one (immutable) reduced buffer, not a copy each; a walk that adds another
    gradient to it makes its own sum (the other replica's gradient is untouched)."""
    def fn():
        r = _rid()
        x = dtape.constant(torch.full((1 << 14,), float(r + 1)))  # large enough for in-place sums
        with dtape.GradientTape() as tape:
            tape.watch(x)
            x2 = x * 1.0
            t = x2 * 4.0                                           # recorded first: processed last
            s = dtape.distribute.get_replica_context().all_reduce(ReduceOp.SUM, x2)
            loss = dtape.reduce_sum(s * 2.0 + t)
        shared = s.torch().data_ptr()
        return tape.gradient(loss, x), dtape.constant(float(shared))
    grads, ptrs = strategy.run(fn)
    # d/dx of sum_r loss_r: 2 * N (the all-reduce's transpose sums every replica's 2) + 4
    assert all((v == 2.0 * N + 4.0).all() for v in _locals(strategy, grads))
    assert len({float(p) for p in strategy.experimental_local_results(ptrs)}) == 1
