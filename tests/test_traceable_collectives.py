"""torch.ops.dtape.all_reduce_sum: the cross-replica SUM as one custom op that make_fx and torch.compile keep.

Eagerly and from a compiled graph, in two MirroredStrategy replica threads,
it gives the sum of the replicas' values; traced, it is one graph node (its
fake implementation gives only the shape). The gradient reduction of a
traced apply_gradients is a start/wait pair per bucket, which
`overlap_reductions` re-buckets and moves into the walk: checked by the
order of the graph's nodes and of inductor's compiled code, and by the sums. Every wait has the strategy's
timeout (tests/_strategies.py: 60 s).
"""
import pytest
import torch
from torch._inductor.utils import run_and_get_code
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
    assert sum(n.target is torch.ops.dtape.all_reduce_start.default for n in gm.graph.nodes) == 2
    assert sum(n.target is torch.ops.dtape.all_reduce_wait.default for n in gm.graph.nodes) == 2
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
        assert sum(n.target is torch.ops.dtape.all_reduce_start.default for n in gm.graph.nodes) == 1

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


def test_start_and_wait_sum_one_bucket_over_two_replicas_once_per_token():
    def replica():
        a, b = _replica_value(), torch.arange(4.0).reshape(2, 2) * _replica_value()[0]
        token = tc.all_reduce_start([a, b])
        sums = tc.all_reduce_wait(token, *tc.bucket_layout([a, b]))
        with pytest.raises(KeyError, match="no all-reduce in flight"):
            tc.all_reduce_wait(token, *tc.bucket_layout([a, b]))
        return tuple(sums)
    strategy = mirrored(2)
    outs = strategy.run(replica)
    for r in range(2):
        a, b = (strategy.experimental_local_results(o)[r] for o in outs)
        torch.testing.assert_close(torch.as_tensor(a), torch.tensor([3.25, 6.25, 9.25]), rtol=0, atol=0)
        torch.testing.assert_close(torch.as_tensor(b), torch.arange(4.0).reshape(2, 2) * 3.25, rtol=0, atol=0)
    x = torch.tensor([[1.0, -2.0]])  # outside a replica context: the values themselves
    assert torch.equal(tc.all_reduce_wait(tc.all_reduce_start([x]), *tc.bucket_layout([x]))[0], x)
    with pytest.raises(ValueError, match="one dtype and device"):
        tc.all_reduce_start([x, x.double()])
    with pytest.raises(TypeError, match="floating"):
        tc.all_reduce_start([torch.tensor([1, 2])])


def _walk(x, w1, w2, w3):
    """A two-layer tanh network's forward, its backward walk written out, and an SGD update of the summed
    gradients: g3 is ready first, g1 last."""
    h1 = torch.tanh(x @ w1)
    h2 = torch.tanh(h1 @ w2)
    d = torch.ones_like(h2 @ w3)
    g3 = h2.t() @ d
    d = (d @ w3.t()) * (1 - h2 * h2)
    g2 = h1.t() @ d
    d = (d @ w2.t()) * (1 - h1 * h1)
    g1 = x.t() @ d
    s1, s2, s3 = tc.reduce_gradients([g1, g2, g3])
    return w1 - 0.1 * s1, w2 - 0.1 * s2, w3 - 0.1 * s3


def _walk_args():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(8, 32, generator=g), *(torch.randn(32, 32, generator=g) * 0.3 for _ in range(3))]


def _overlapped_walk():
    gm = make_fx(_walk, tracing_mode="fake")(*_walk_args())
    # caps of 1 KB: one 4 KB gradient per bucket
    assert tc.overlap_reductions(gm, bucket_cap_mb=2 ** -10, first_bucket_cap_mb=2 ** -10) == 3
    return gm


def test_overlap_pass_starts_each_bucket_as_its_gradient_is_ready_and_waits_after_the_walk():
    gm = _overlapped_walk()
    nodes = list(gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    starts = [n for n in nodes if n.target is torch.ops.dtape.all_reduce_start.default]
    waits = [n for n in nodes if n.target is torch.ops.dtape.all_reduce_wait.default]
    grads = [n.args[0][0] for n in starts]
    assert [g.meta["val"].shape for g in grads] == [(32, 32)] * 3 and len(waits) == 3
    last_grad = max(at[g] for g in grads)
    for start, grad in zip(starts, grads):
        assert at[start] == at[grad] + 1  # launched right after its gradient
    assert at[starts[0]] < at[starts[1]] < last_grad  # the first two go out while the walk goes on
    for wait in waits:
        assert at[wait] > at[starts[-1]] and wait.args[-1] is starts[-1]  # waited for after the walk
        first_use = min(at[u] for g in wait.users for u in g.users)
        assert all(at[wait] < at[g] < first_use for g in wait.users)
    args = _walk_args()
    for got, want in zip(gm(*args), _walk(*args)):  # one replica: the same numbers
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_overlapped_graph_sums_over_two_replicas_as_the_traced_one():
    plain = make_fx(_walk, tracing_mode="fake")(*_walk_args())
    overlapped = _overlapped_walk()

    def replica(gm):
        rid = dtape.distribute.get_replica_context().replica_id_in_sync_group
        return tuple(gm(*[a * (rid + 1) for a in _walk_args()]))
    strategy = mirrored(2)
    want, got = strategy.run(lambda: replica(plain)), strategy.run(lambda: replica(overlapped))
    for w, g in zip(want, got):
        for r in range(2):
            torch.testing.assert_close(torch.as_tensor(strategy.experimental_local_results(g)[r]),
                                       torch.as_tensor(strategy.experimental_local_results(w)[r]), rtol=0, atol=0)


def test_inductor_keeps_the_starts_inside_the_walk_and_the_waits_after_it():
    """The order of the compiled code (inductor's `call`): the start op is tagged so that reorder_for_locality
    does not pull it down to its wait, and each wait depends on the walk's last gradient."""
    args = _walk_args()
    with torch._inductor.config.patch(force_disable_caches=True):  # a cached compile would hide a change
        out, (code,) = run_and_get_code(torch.compile(_overlapped_walk(), backend="inductor"), *args)
    for got, want in zip(out, _walk(*args)):
        torch.testing.assert_close(got, want)
    calls = [line.strip() for line in code[code.index("def call("):].splitlines()
             if ("mm(" in line or "torch.ops.dtape" in line) and not line.strip().startswith(("#", "assert"))]
    kinds = ["start" if "all_reduce_start" in c else "wait" if "all_reduce_wait" in c else "mm" for c in calls]
    last_mm = max(i for i, k in enumerate(kinds) if k == "mm")
    starts = [i for i, k in enumerate(kinds) if k == "start"]
    waits = [i for i, k in enumerate(kinds) if k == "wait"]
    assert len(starts) == len(waits) == 3, calls
    assert starts[1] < last_mm and min(waits) > max(starts) > last_mm, calls
