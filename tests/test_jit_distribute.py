"""Compiled replica steps: `strategy.run(dtape.function(step, jit_compile=True), args=...)` in MirroredStrategy threads.

The compiled function has no strategy logic: a captured MirroredVariable is
resolved to the calling replica's component at each call (inputs and
writes), replica threads trace one at a time and share one graph, and
`apply_gradients` traced in a replica sums the gradients with the
`torch.ops.dtape.all_reduce_start`/`all_reduce_wait` ops when the graph runs (launched during the
walk, waited for after it: `traceable_collectives.overlap_reductions`). Per-step losses and
final variables equal the eager mirrored step (and one device, where eager
does) in float32; dropout draws from each replica's own generator. What
cannot be traced in a replica step raises, saying what to do. Every wait has
the strategy's timeout (tests/_strategies.py: 60 s); threads switch often
(`closes_strategies`).
"""
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import dtape
from dtape.distribute import ReduceOp
from dtape.distribute import traceable_collectives as tc

from _strategies import mirrored

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from tasks import charlm, digits  # noqa: E402

pytestmark = pytest.mark.usefixtures("closes_strategies")

GLOBAL = 32  # global batch: 16 examples per replica


def _split(strategy, array):
    """The global batch `array` as PerReplica halves (or one Tensor without a strategy)."""
    if strategy is None:
        return dtape.constant(array)
    n = strategy.num_replicas_in_sync
    parts = [dtape.constant(p) for p in np.split(array, n)]
    return strategy.experimental_distribute_values_from_function(lambda ctx: parts[ctx.replica_id_in_sync_group])


def _train(strategy, jit, task, make_optimizer, batches, dropout=0.0, backend=None):
    """Per-step global losses, final weights and optimizer state (every component) and the step function."""
    torch.manual_seed(0)
    scope = strategy.scope() if strategy is not None else dtape.distribute.get_strategy().scope()
    with scope:
        model = task.build_model(0, dropout=dropout)
        optimizer = make_optimizer()
        optimizer.build(model.trainable_variables)

    def step(x, y):
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(task.per_example_loss(model, x, y)) / GLOBAL
        variables = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss
    f = dtape.function(step, jit_compile=True, backend=backend) if jit else step
    losses = []
    for x, y in batches:
        if strategy is None:
            losses.append(float(f(dtape.constant(x), dtape.constant(y))))
        else:
            per_replica = strategy.run(f, args=(_split(strategy, x), _split(strategy, y)))
            losses.append(float(strategy.reduce(ReduceOp.SUM, per_replica, axis=None)))
    # the weights and the optimizer's state (iterations, slots), every replica's component
    state = list(model.trainable_variables) + list(optimizer.variables())
    variables = [[np.asarray(c.numpy(), dtype=np.float64) for c in getattr(v, "values", (v,))] for v in state]
    return np.array(losses), variables, f


def _digits_batches(steps):
    data = digits.load_data(0)
    return [(data["x_train"][GLOBAL * i:GLOBAL * (i + 1)], data["y_train"][GLOBAL * i:GLOBAL * (i + 1)])
            for i in range(steps)]


def _sgd():
    return dtape.optimizers.SGD(0.1, momentum=0.9)


def _assert_same(run, reference, rtol=1e-5, atol=1e-7):
    """Losses to `rtol`; every replica's component of each variable to the reference's (first) one, to `rtol`
    and, for entries near 0, `atol` (Adam divides by sqrt(v): float32 roundings of tiny entries grow there)."""
    np.testing.assert_allclose(run[0], reference[0], rtol=rtol)
    for got, want in zip(run[1], reference[1]):
        for component in got:
            np.testing.assert_allclose(component, want[0], rtol=rtol, atol=atol)


def _concretes(f):
    return [c for cs in f._concrete.values() for c in cs]


def test_digits_step_compiled_in_two_replicas_equals_eager_mirrored_and_one_device():
    batches = _digits_batches(20)
    eager = _train(mirrored(2), False, digits, _sgd, batches)
    compiled = _train(mirrored(2), True, digits, _sgd, batches)
    one_device = _train(None, False, digits, _sgd, batches)
    _assert_same(compiled, eager)
    _assert_same(compiled, one_device)
    f = compiled[2]
    assert f.trace_count == 1  # the second replica found the first one's graph
    (concrete,) = _concretes(f)
    graph_ops = [n.target for n in concrete.graph.graph.nodes if n.op == "call_function"]
    # one bucket: every float32 gradient (38 KB, under the first bucket's 1 MB)
    assert graph_ops.count(torch.ops.dtape.all_reduce_start.default) == 1
    assert not concrete._runners  # draws nothing: one graph for both replicas


def test_digits_dropout_draws_from_each_replicas_generator_as_eager_does():
    batches = _digits_batches(20)
    eager = _train(mirrored(2), False, digits, _sgd, batches, dropout=0.3)
    compiled = _train(mirrored(2), True, digits, _sgd, batches, dropout=0.3)
    _assert_same(compiled, eager)
    (concrete,) = _concretes(compiled[2])
    assert len(concrete._runners) == 2  # one copy of the graph per replica generator, from one trace
    assert compiled[2].trace_count == 1
    no_dropout = _train(mirrored(2), False, digits, _sgd, batches[:3])
    assert not np.allclose(no_dropout[0], compiled[0][:3])


def _adam():
    schedule = dtape.optimizers.schedules.ExponentialDecay(3e-3, decay_steps=5, decay_rate=0.8)
    return dtape.optimizers.Adam(schedule, global_clipnorm=0.5)


def _charlm_batches(steps, b=4, t=16):
    data = charlm.load_data(0)
    return [(data["x_train"][b * i:b * (i + 1), :t], data["y_train"][b * i:b * (i + 1), :t]) for i in range(steps)]


def test_charlm_adam_schedule_clipnorm_compiled_in_two_replicas_equals_eager_and_one_device(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "GLOBAL", 4)
    batches = _charlm_batches(20)
    eager = _train(mirrored(2), False, charlm, _adam, batches)
    compiled = _train(mirrored(2), True, charlm, _adam, batches)
    one_device = _train(None, False, charlm, _adam, batches)
    # entries of ~1e-6 (Adam moves weights with near-zero gradients by about lr): eager mirrored and one
    # device differ there by 1.9e-6 too (float32 sums in another order)
    _assert_same(compiled, eager, atol=5e-6)
    _assert_same(compiled, one_device, atol=5e-6)
    assert compiled[2].trace_count == 1
    assert compiled[0][-1] < compiled[0][0]  # it trains


def test_inductor_compiled_replica_step_equals_eager():
    batches = _digits_batches(3)
    eager = _train(mirrored(2), False, digits, _sgd, batches)
    compiled = _train(mirrored(2), True, digits, _sgd, batches, backend="inductor")
    _assert_same(compiled, eager)


def _model_in(strategy):
    with strategy.scope():
        w = dtape.Variable(torch.ones(3))
    return w


def _tutorial(strategy, form, batches, steps_run=None, backend=None, make_optimizer=_sgd, build=True):
    """TF's custom-training tutorial (tutorials/distribute/custom_training) on the digits MLP: a replica
    `train_step` (compute_average_loss over the global batch, apply_gradients, an accuracy metric) and
    `distributed_train_step` = strategy.reduce(SUM, strategy.run(train_step, ...)), over
    `experimental_distribute_dataset`. form: "eager" (nothing compiled), "compiled" (the tutorial's
    `@tf.function` on distributed_train_step), "epoch" (the loop over the dataset inside the compiled
    function), "iterator" (next(iterator) inside it). Returns (losses, variables, accuracy, the compiled
    function or None); `steps_run` counts the Python runs of train_step's body."""
    torch.manual_seed(0)
    with strategy.scope():
        model = digits.build_model(0)
        optimizer = make_optimizer()
        if build:
            optimizer.build(model.trainable_variables)
        accuracy = dtape.metrics.SparseCategoricalAccuracy()

    def train_step(inputs):
        if steps_run is not None:
            steps_run.append(1)
        images, labels = inputs
        with dtape.GradientTape() as tape:
            logits = model(images, training=True)
            per_example = dtape.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
            loss = dtape.distribute.compute_average_loss(per_example, global_batch_size=GLOBAL)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        accuracy.update_state(labels, logits)
        return loss

    def distributed_train_step(dataset_inputs):
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(ReduceOp.SUM, per_replica_losses, axis=None)

    def distributed_train_epoch(dataset):
        losses = []
        for x in dataset:
            losses.append(distributed_train_step(x))
        return dtape.stack(losses)
    dataset = strategy.experimental_distribute_dataset(batches)
    jit = dtape.function(jit_compile=True, backend=backend)
    if form == "eager":
        f, losses = None, [float(distributed_train_step(x)) for x in dataset]
    elif form == "compiled":
        f = jit(distributed_train_step)
        losses = [float(f(x)) for x in dataset]
    elif form == "epoch":
        f = jit(distributed_train_epoch)
        losses = f(dataset).numpy().tolist()
    else:
        iterator = iter(dataset)
        f = jit(lambda it: distributed_train_step(next(it)))
        losses = [float(f(iterator)) for _ in batches]
    variables = [[np.asarray(c.numpy(), dtype=np.float64) for c in getattr(v, "values", (v,))]
                 for v in list(model.trainable_variables) + list(optimizer.variables())]
    return np.array(losses), variables, float(accuracy.result()), f


def test_tf_tutorial_form_compiled_around_strategy_run_equals_eager_and_one_device():
    """`dtape.function(distributed_train_step, jit_compile=True)` with strategy.run and strategy.reduce
    inside: the trace stops at strategy.run, once, and the body runs eagerly from then on around train_step
    compiled (traced once for all 10 steps and both replicas)."""
    batches = _digits_batches(10)
    eager = _tutorial(mirrored(2), "eager", batches)
    one_device = _tutorial(dtape.distribute.get_strategy(), "eager", batches)
    steps_run = []
    compiled = _tutorial(mirrored(2), "compiled", batches, steps_run)
    _assert_same(compiled[:2], eager[:2])
    _assert_same(compiled[:2], one_device[:2])
    assert compiled[2] == eager[2] and 0.0 < compiled[2] <= 1.0
    f = compiled[3]
    assert "reached MirroredStrategy.run" in f.eager_body_reason and "body eager" in repr(f)
    assert f.experimental_get_tracing_count() == 0  # the outer trace stopped; no graph of it
    (replica,) = f.replica_functions.values()
    assert replica.python_function.__name__ == "train_step" and replica.trace_count == 1
    assert replica._backend is f._backend and replica._compile_options == f._compile_options
    # train_step's Python ran once (its trace), not 10 steps x 2 replicas
    assert len(steps_run) == 1
    (concrete,) = _concretes(replica)
    graph_ops = [n.target for n in concrete.graph.graph.nodes if n.op == "call_function"]
    assert graph_ops.count(torch.ops.dtape.all_reduce_start.default) == 1


def test_tf_tutorial_form_with_an_optimizer_not_built_makes_its_slots_in_an_eager_first_call():
    """TF's tutorial builds no optimizer: the replica step's first call runs eagerly (its slots are made in
    merge_call, as TF makes them on the first trace), the next traces, once."""
    batches = _digits_batches(6)
    eager = _tutorial(mirrored(2), "eager", batches, make_optimizer=_adam, build=False)
    steps_run = []
    compiled = _tutorial(mirrored(2), "compiled", batches, steps_run, make_optimizer=_adam, build=False)
    _assert_same(compiled[:2], eager[:2], atol=5e-6)
    (replica,) = compiled[3].replica_functions.values()
    assert replica.trace_count == 1
    assert len(steps_run) == 2 + 2 + 1  # first call: each replica's stopped trace and eager run; then one trace


def test_the_switch_to_an_eager_body_happens_once():
    strategy = mirrored(2)
    w = _model_in(strategy)
    bodies = []

    def outer(x):
        bodies.append(1)
        return strategy.reduce(ReduceOp.SUM, strategy.run(lambda: w * x), axis=None)
    f = dtape.function(outer, jit_compile=True, backend=None)
    assert f.eager_body_reason is None
    values = [f(dtape.constant(float(i))).numpy().tolist() for i in range(1, 4)]
    assert values == [[2.0 * i] * 3 for i in range(1, 4)]
    assert len(bodies) == 4  # the stopped trace, then one eager run per call (no second trace)
    assert f.eager_body_reason is not None and f.trace_count == 0


def test_tf_tutorial_loops_over_the_distributed_dataset_inside_the_compiled_function():
    """TF's "iterating inside a tf.function" forms: the loop over the dataset inside, and next(iterator)
    inside; the trace stops before a batch is drawn, so none is lost and the numbers equal eager."""
    batches = _digits_batches(6)
    eager = _tutorial(mirrored(2), "eager", batches)
    for form in ("iterator", "epoch"):
        steps_run = []
        compiled = _tutorial(mirrored(2), form, batches, steps_run)
        _assert_same(compiled[:2], eager[:2])
        assert "iteration of a distributed dataset" in compiled[3].eager_body_reason
        assert len(steps_run) == 1


def test_a_replica_function_made_inside_the_compiled_function_retraces_with_tf_s_warning():
    """A fresh closure per call is a new function to compile: its traces add up, and the fifth warns."""
    strategy = mirrored(2)
    w = _model_in(strategy)

    def outer(x):
        def replica_fn():
            return w * x
        return strategy.reduce(ReduceOp.SUM, strategy.run(replica_fn), axis=None)
    f = dtape.function(outer, jit_compile=True, backend=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(4):
            assert f(dtape.constant(1.0)).numpy().tolist() == [2.0] * 3
    with pytest.warns(UserWarning, match=r"5 calls to dtape.function '\S*outer.<locals>.replica_fn' triggered "
                                         r"retracing \(a new function object of the same code"):
        f(dtape.constant(1.0))
    assert len(f.replica_functions) == 1  # the latest closure only: the cache does not grow per call


def test_merge_call_in_a_compiled_replica_step_says_to_run_it_eagerly():
    strategy = mirrored(2)
    with strategy.scope():
        total = dtape.Variable(0.0, aggregation=dtape.distribute.VariableAggregation.SUM)
    f = dtape.function(lambda x: total.assign_add(x), jit_compile=True, backend=None)
    with pytest.raises(RuntimeError, match=r"merge_call.*jit_compile=False"):
        strategy.run(f, args=(dtape.constant(1.0),))
    assert [float(c.numpy()) for c in total.values] == [0.0, 0.0]


def test_merge_call_in_a_replica_step_compiled_for_the_tutorial_form_says_which_function_to_run_eagerly():
    strategy = mirrored(2)
    with strategy.scope():
        total = dtape.Variable(0.0, aggregation=dtape.distribute.VariableAggregation.SUM)

    def replica_fn(x):
        return total.assign_add(x * 1.0)  # a value of each replica, summed by the merge_call
    f = dtape.function(lambda x: strategy.run(replica_fn, args=(x,)), jit_compile=True, backend=None)
    with pytest.raises(RuntimeError, match=r"merge_call.*inside a compiled function is compiled with it: make "
                                           r"that function jit_compile=False"):
        f(dtape.constant(1.0))
    assert [float(c.numpy()) for c in total.values] == [0.0, 0.0]
    eager = dtape.function(lambda x: strategy.run(replica_fn, args=(x,)))
    eager(dtape.constant(1.0))
    assert [float(c.numpy()) for c in total.values] == [2.0, 2.0]  # jit_compile=False runs it, as the message says


def test_gradient_sync_in_a_compiled_replica_step_is_refused_not_a_hang():
    # the overlapped all-reduce starts reductions on other threads during the walk: traced, the replicas
    # waited on each other until killed
    strategy = mirrored(2)
    with strategy.scope():
        w = dtape.Variable(torch.ones(3))
    sync = dtape.distribute.GradientSync()

    def step(x):
        with dtape.GradientTape(gradient_sync=sync) as tape:
            loss = dtape.reduce_sum(w * x)
        return tape.gradient(loss, w)
    f = dtape.function(step, jit_compile=True, backend=None)
    with pytest.raises(RuntimeError, match=r"gradient_sync=.*compiled dtape.function.*Drop gradient_sync"):
        strategy.run(f, args=(dtape.constant(1.0),))


@pytest.mark.parametrize("wrap", ["loss_scale", "from_torch"])
def test_wrapping_optimizers_in_a_compiled_replica_step_say_to_run_eagerly(wrap):
    strategy = mirrored(2)
    with strategy.scope():
        w = dtape.Variable(torch.ones(3))
        if wrap == "loss_scale":
            optimizer = dtape.mixed_precision.LossScaleOptimizer(dtape.optimizers.SGD(0.1))
        else:
            optimizer = dtape.optimizers.from_torch(torch.optim.SGD([w.torch()], lr=0.1))

    def step(x):
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(w * x)
        optimizer.apply_gradients([(tape.gradient(loss, w), w)])
        return loss
    f = dtape.function(step, jit_compile=True, backend=None)
    with pytest.raises((NotImplementedError, RuntimeError), match="eagerly"):
        strategy.run(f, args=(dtape.constant(1.0),))
    assert [c.numpy().tolist() for c in w.values] == [[1.0] * 3] * 2


def test_tf_tutorial_replica_step_with_average_loss_and_a_metric_compiled_equals_eager():
    """The step of TF's custom-training tutorial (tutorials/distribute/custom_training): compute_average_loss
    over the global batch, apply_gradients, and a metric updated in the replica step, compiled."""
    batches = _digits_batches(8)
    runs = []
    for jit in (False, True):
        strategy = mirrored(2)
        torch.manual_seed(0)
        with strategy.scope():
            model = digits.build_model(0)
            optimizer = dtape.optimizers.SGD(0.1, momentum=0.9)
            optimizer.build(model.trainable_variables)
            accuracy = dtape.metrics.SparseCategoricalAccuracy()

        def train_step(x, y):
            with dtape.GradientTape() as tape:
                logits = model(x, training=True)
                per_example = dtape.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
                loss = dtape.distribute.compute_average_loss(per_example, global_batch_size=GLOBAL)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            accuracy.update_state(y, logits)
            return loss
        step = dtape.function(train_step, jit_compile=True, backend=None) if jit else train_step
        losses = [float(strategy.reduce(ReduceOp.SUM, strategy.run(step, args=(_split(strategy, x),
                                                                             _split(strategy, y))), axis=None))
                  for x, y in batches]
        runs.append((losses, float(accuracy.result()), [c.numpy() for c in accuracy.variables[0].values]))
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-5)
    assert runs[1][1] == runs[0][1] and 0.0 < runs[1][1] <= 1.0
    np.testing.assert_allclose(runs[1][2], runs[0][2])  # each replica's own count, as eager


def test_replicas_tracing_different_compiled_functions_at_once_trace_one_at_a_time():
    """make_fx is not thread-safe: two replica threads each tracing its own compiled function (none of them
    a collective) must not trace at the same moment (torch.fx's global patcher: 'CURRENT_PATCHER is None')."""
    strategy = mirrored(2)
    with strategy.scope():
        w = dtape.Variable(torch.arange(6.0).reshape(2, 3))

    def body(x):
        h = x
        for _ in range(30):  # a longer trace: more chances to overlap
            h = dtape.tanh(dtape.matmul(h, w) @ dtape.transpose(w))
        return dtape.reduce_sum(h)
    for attempt in range(3):
        fs = [dtape.function(body, jit_compile=True, backend=None) for _ in range(2)]
        run = strategy.run(lambda x: fs[dtape.distribute.get_replica_context().replica_id_in_sync_group](x),
                           args=(dtape.ones([4, 2]) * 0.1,))
        values = [float(v) for v in strategy.experimental_local_results(run)]
        assert values[0] == values[1] == pytest.approx(float(body(dtape.ones([4, 2]) * 0.1)), rel=1e-6)
        assert [f.trace_count for f in fs] == [1, 1]


def test_charlm_step_with_overlapped_buckets_equals_eager_and_launches_them_during_the_walk(monkeypatch):
    """Small bucket caps (50 KB first, 100 KB then: 4 buckets of charlm's 117k weights): each bucket's
    all-reduce starts as soon as the walk has its gradients and is waited for after the walk, before the
    update; the losses and weights equal the eager mirrored step's."""
    monkeypatch.setattr(sys.modules[__name__], "GLOBAL", 4)
    monkeypatch.setattr(tc, "OVERLAP_FIRST_BUCKET_CAP_MB", 0.05)
    monkeypatch.setattr(tc, "OVERLAP_BUCKET_CAP_MB", 0.1)
    batches = _charlm_batches(10)
    eager = _train(mirrored(2), False, charlm, _sgd, batches)
    compiled = _train(mirrored(2), True, charlm, _sgd, batches)
    _assert_same(compiled, eager, rtol=1e-6, atol=1e-7)
    (concrete,) = _concretes(compiled[2])
    nodes = list(concrete.graph.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    starts = [n for n in nodes if n.target is torch.ops.dtape.all_reduce_start.default]
    waits = [n for n in nodes if n.target is torch.ops.dtape.all_reduce_wait.default]
    last_gradient = max(at[g] for s in starts for g in s.args[0])
    assert len(starts) == len(waits) == 4
    assert sum(len(s.args[0]) for s in starts) == 30  # every weight's gradient (charlm has 30), once
    assert at[starts[0]] < at[starts[1]] < at[starts[2]] < last_gradient  # launched while the walk goes on
    for early, late in zip(starts, starts[1:]):  # bucketed in the walk's order: no bucket waits for a late one
        assert max(at[g] for g in early.args[0]) < min(at[g] for g in late.args[0])
    assert min(at[w] for w in waits) > at[starts[-1]] == last_gradient + 1


def test_compiled_step_without_the_overlap_pass_reduces_in_one_bucket_after_the_walk(monkeypatch):
    monkeypatch.setattr(tc, "OVERLAP", False)
    monkeypatch.setattr(tc, "OVERLAP_FIRST_BUCKET_CAP_MB", 0.01)
    batches = _digits_batches(3)
    eager = _train(mirrored(2), False, digits, _sgd, batches)
    compiled = _train(mirrored(2), True, digits, _sgd, batches)
    _assert_same(compiled, eager, rtol=1e-6)
    (concrete,) = _concretes(compiled[2])
    ops = [n.target for n in concrete.graph.graph.nodes]
    assert ops.count(torch.ops.dtape.all_reduce_start.default) == 1
    assert ops.index(torch.ops.dtape.all_reduce_wait.default) == ops.index(torch.ops.dtape.all_reduce_start.default) + 1
