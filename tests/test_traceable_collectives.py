"""torch.ops.dtape.all_reduce_sum: the cross-replica SUM as one custom op that make_fx and torch.compile keep.

Eagerly and from a compiled graph, in two MirroredStrategy replica threads,
it gives the sum of the replicas' values; traced, it is one graph node (its
fake implementation gives only the shape). Every wait has the strategy's
timeout (tests/_strategies.py: 60 s).
"""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import dtape
from dtape.distribute import traceable_collectives as tc

from _strategies import mirrored
from _traceable import trace_with_variables

pytestmark = pytest.mark.usefixtures("closes_strategies")


def _replica_value():
    rid = dtape.distribute.get_replica_context().replica_id_in_sync_group
    return torch.tensor([1.0, 2.0, 3.0]) * (rid + 1) + 0.25 * rid


def _locals(strategy, fn):
    return [t for t in strategy.experimental_local_results(strategy.run(fn))]


def test_eager_op_sums_over_two_replicas():
    strategy = mirrored(2)
    results = _locals(strategy, lambda: torch.ops.dtape.all_reduce_sum(_replica_value()))
    want = torch.tensor([3.25, 6.25, 9.25])
    assert len(results) == 2
    for r in results:
        torch.testing.assert_close(torch.as_tensor(r), want, rtol=0, atol=0)
    assert results[0] is not results[1]


def test_outside_a_replica_context_it_is_a_copy_and_ints_are_refused():
    x = torch.tensor([1.0, -2.0])
    y = tc.all_reduce_sum(x)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    with pytest.raises(TypeError, match="floating"):
        tc.all_reduce_sum(torch.tensor([1, 2]))


def _step(x):
    return torch.ops.dtape.all_reduce_sum(x * 2.0) + 1.0


def _graph():
    return make_fx(_step, tracing_mode="fake")(torch.zeros(3))


def test_make_fx_keeps_the_reduction_as_one_node():
    gm = _graph()
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    reductions = [n for n in calls if n.target is torch.ops.dtape.all_reduce_sum.default]
    assert len(reductions) == 1 and len(calls) == 3  # mul, the reduction, add


def test_compiled_graph_reduces_in_both_replica_threads():
    compiled = torch.compile(_graph(), backend="aot_eager")
    torch.testing.assert_close(compiled(torch.ones(3)), torch.full((3,), 3.0))  # compiled here, one replica
    strategy = mirrored(2)
    results = _locals(strategy, lambda: compiled(_replica_value()))
    want = torch.tensor([3.25, 6.25, 9.25]) * 2.0 + 1.0
    for r in results:
        torch.testing.assert_close(torch.as_tensor(r), want, rtol=0, atol=0)


def test_reduce_gradients_one_op_per_bucket_and_the_sums():
    grads = lambda: [torch.ones(2, 2) * _replica_value()[0], None, torch.arange(3.0, dtype=torch.float64),
                     torch.full((4,), 0.5) * _replica_value()[1]]
    gm = make_fx(tc.reduce_gradients, tracing_mode="fake")([torch.zeros(2, 2), None, torch.zeros(3, dtype=torch.float64),
                                                            torch.zeros(4)])
    assert sum(n.target is torch.ops.dtape.all_reduce_sum.default for n in gm.graph.nodes) == 2
    strategy = mirrored(2)
    outs = strategy.run(lambda: tuple(tc.reduce_gradients(grads())))
    assert outs[1] is None
    for r in range(2):
        a, b, c = (strategy.experimental_local_results(outs[k])[r] for k in (0, 2, 3))
        torch.testing.assert_close(torch.as_tensor(a), torch.full((2, 2), 3.25), rtol=0, atol=0)
        torch.testing.assert_close(torch.as_tensor(b), torch.arange(3.0, dtype=torch.float64) * 2, rtol=0, atol=0)
        torch.testing.assert_close(torch.as_tensor(c), torch.full((4,), 0.5 * 6.25), rtol=0, atol=0)


def _replica_model(strategy):
    with strategy.scope():
        w = dtape.Variable(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
        opt = dtape.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=5.0)
        opt.build([w])
    return w, opt, [w] + opt.variables()       # iterations, learning_rate, momentum


def _replica_grad(k):
    rid = dtape.distribute.get_replica_context().replica_id_in_sync_group
    return torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64) * (rid + 1) * (k + 1)


def test_apply_gradients_traced_in_each_replica_reduces_with_the_op_and_matches_eager():
    eager = mirrored(2)
    w_e, opt_e, state_e = _replica_model(eager)
    for k in range(3):
        eager.run(lambda k=k: opt_e.apply_gradients([(dtape.Tensor(_replica_grad(k)), w_e)]))

    strategy = mirrored(2)
    w, opt, state = _replica_model(strategy)
    graphs, values = {}, {}

    def trace():
        rid = dtape.distribute.get_replica_context().replica_id_in_sync_group
        comps = [v.values[rid] for v in state]
        graphs[rid] = trace_with_variables(lambda g: opt.apply_gradients([(dtape.Tensor(g), w)]), comps,
                                           _replica_grad(0))
        values[rid] = [c.torch().clone() for c in comps]
    strategy.run(trace)
    assert int(opt.iterations.numpy()) == 0  # tracing wrote nothing
    for gm in graphs.values():
        assert sum(n.target is torch.ops.dtape.all_reduce_sum.default for n in gm.graph.nodes) == 1

    def run(k):
        rid = dtape.distribute.get_replica_context().replica_id_in_sync_group
        values[rid] = [t.clone() for t in graphs[rid](*values[rid], _replica_grad(k))]
    for k in range(3):
        strategy.run(lambda k=k: run(k))
    for rid in range(2):
        for got, var in zip(values[rid], state_e):
            torch.testing.assert_close(got, var.values[rid].torch(), rtol=1e-12, atol=1e-14)


def test_traced_replica_step_without_slots_or_with_a_wrapping_optimizer_says_what_to_do():
    strategy = mirrored(2)
    with strategy.scope():
        w = dtape.Variable(torch.zeros(3, dtype=torch.float64))
        unbuilt = dtape.optimizers.SGD(0.1, momentum=0.9)
        scaled = dtape.mixed_precision.LossScaleOptimizer(dtape.optimizers.SGD(0.1))
    for opt, error, match in ((unbuilt, RuntimeError, "optimizer.build"), (scaled, NotImplementedError, "eagerly")):
        def trace(opt=opt):
            rid = dtape.distribute.get_replica_context().replica_id_in_sync_group
            trace_with_variables(lambda g: opt.apply_gradients([(dtape.Tensor(g), w)]), [w.values[rid]],
                                 _replica_grad(0))
        with pytest.raises(error, match=match):
            strategy.run(trace)
    assert w.values[0].numpy().tolist() == [0.0, 0.0, 0.0]
