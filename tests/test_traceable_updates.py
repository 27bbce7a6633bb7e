"""Optimizer updates, schedules, loss scaling, metrics and dropout trace into one torch graph.

A compiled step (`make_fx` with fake tensors) cannot read a tensor's value
on the host. Each update here is traced with the variables' values (weights,
slots, `iterations`, the learning-rate variable) as graph inputs; the graph is
then run step after step on real values and must give the eager update's
numbers, so nothing (step, learning rate, schedule value) was baked in.
"""
import math

import pytest
import torch

import dtape
from dtape import optimizers as opts
from dtape.mixed_precision import LossScaleOptimizer
from dtape.optimizers import schedules

from _strategies import mirrored
from _traceable import HostRead, NoHostReads, components, trace_with_variables

CASES = {
    "sgd": lambda: opts.SGD(0.1),
    "sgd_momentum_clipvalue": lambda: opts.SGD(0.05, momentum=0.9, clipvalue=0.3),
    "sgd_nesterov_fn_of_step": lambda: opts.SGD(lambda step: 0.1 / (1 + step), momentum=0.5, nesterov=True),
    "adam_clipnorm": lambda: opts.Adam(0.01, clipnorm=0.5),
    "adam_exponential": lambda: opts.Adam(schedules.ExponentialDecay(0.05, 2, 0.5, staircase=True)),
    "adamw_cosine_global_clip": lambda: opts.AdamW(
        schedules.CosineDecay(0.01, 5, warmup_target=0.05, warmup_steps=2), weight_decay=0.1, global_clipnorm=1.0),
    "rmsprop_centered": lambda: opts.RMSprop(0.01, momentum=0.5, centered=True),
    "adagrad_piecewise": lambda: opts.Adagrad(schedules.PiecewiseConstantDecay([1, 2], [0.1, 0.05, 0.01])),
    "loss_scale": lambda: LossScaleOptimizer(opts.SGD(0.1, momentum=0.9), initial_scale=4.0,
                                             dynamic_growth_steps=2),
}


def _grads(case, steps=5):
    gen = torch.Generator().manual_seed(7)
    out = [[torch.randn(3, 2, generator=gen, dtype=torch.float64),
            torch.randn(2, generator=gen, dtype=torch.float64)] for _ in range(steps)]
    if case == "loss_scale":  # a non-finite step: skipped, the scale halves
        out[2][1] = torch.tensor([math.inf, 1.0], dtype=torch.float64)
    return out


def _model():
    gen = torch.Generator().manual_seed(3)
    return [dtape.Variable(torch.randn(3, 2, generator=gen, dtype=torch.float64)),
            dtape.Variable(torch.randn(2, generator=gen, dtype=torch.float64))]


def _state(opt, variables):
    return list(variables) + opt.variables()   # the learning-rate variable is among the optimizer's


@pytest.mark.parametrize("case", sorted(CASES))
def test_update_traces_and_its_graph_gives_the_eager_steps(case):
    grads = _grads(case)
    eager_vars, eager_opt = _model(), CASES[case]()
    expected = []
    for g in grads:
        eager_opt.apply_gradients(zip(map(dtape.Tensor, g), eager_vars))
        expected.append([v.torch().clone() for v in _state(eager_opt, eager_vars)])

    variables, opt = _model(), CASES[case]()
    opt.build(variables)
    state = _state(opt, variables)
    gm = trace_with_variables(lambda *gs: opt.apply_gradients(zip(map(dtape.Tensor, gs), variables)), state,
                              *grads[0])
    assert int(opt.iterations.numpy()) == 0  # tracing wrote nothing
    values = [c.torch().clone() for c in components(state)]
    for k, g in enumerate(grads):
        values = [t.clone() for t in gm(*values, *g)]
        for got, want in zip(values, expected[k]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14, msg=f"{case}, step {k + 1}")
    assert int(values[len(variables)]) == len(grads)  # iterations, an input and an output
    if case == "loss_scale":  # 4, doubled after 2 finite steps, halved at the inf, doubled after 2 more
        assert [float(e[-2]) for e in expected] == [4.0, 8.0, 4.0, 4.0, 8.0]   # the scale, before the counter
        assert all(torch.equal(a, b) for a, b in zip(expected[1][:2], expected[2][:2]))  # the inf step skipped


def test_the_learning_rate_variable_is_a_graph_input():
    w = dtape.Variable(torch.zeros(2, dtype=torch.float64))
    opt = opts.SGD(0.1)
    opt.build([w])
    state = _state(opt, [w])
    gm = trace_with_variables(lambda g: opt.apply_gradients([(dtape.Tensor(g), w)]), state,
                              torch.ones(2, dtype=torch.float64))
    lr = torch.tensor(0.5, dtype=torch.float64)
    out = gm(torch.zeros(2, dtype=torch.float64), torch.tensor(0), lr, torch.ones(2, dtype=torch.float64))
    torch.testing.assert_close(out[0], torch.full((2,), -0.5, dtype=torch.float64))


@pytest.mark.parametrize("case", sorted(CASES))
def test_update_reads_nothing_on_the_host_while_traced(case):
    variables, opt = _model(), CASES[case]()
    opt.apply_gradients(zip(map(dtape.Tensor, _grads(case)[0]), variables))  # slots made eagerly
    with NoHostReads():
        opt.apply_gradients(zip(map(dtape.Tensor, _grads(case)[1]), variables))
    assert int(opt.iterations.numpy()) == 2


def test_no_host_reads_catches_the_reads_a_tracer_cannot_take():
    v = dtape.Variable(torch.ones(2))
    for read in (lambda: v.numpy(), lambda: float(v.torch()[0]), lambda: v.torch().tolist()):
        with pytest.raises(HostRead), NoHostReads():
            read()


@pytest.mark.parametrize("schedule", [
    schedules.ExponentialDecay(0.1, 3, 0.7), schedules.ExponentialDecay(0.1, 3, 0.7, staircase=True),
    schedules.CosineDecay(0.2, 6, alpha=0.1), schedules.CosineDecay(0.0, 6, warmup_target=0.2, warmup_steps=3),
    schedules.PiecewiseConstantDecay([2, 5], [1.0, 0.5, 0.1])], ids=lambda s: type(s).__name__)
def test_schedules_on_a_tensor_step_equal_the_python_formula(schedule):
    for step in range(0, 12):
        got = schedule(torch.tensor(step))
        assert isinstance(got, torch.Tensor) and got.dtype == torch.float64
        assert float(got) == pytest.approx(schedule(step), rel=1e-15, abs=1e-17), step
    holder = []
    gm = trace_with_variables(lambda s: holder.append(schedule(s)), [], torch.tensor(0))
    assert len([n for n in gm.graph.nodes if n.op == "placeholder"]) == 1


def _metric_graph(metric, *batch):
    return trace_with_variables(lambda *b: metric.update_state(*b), metric.variables, *batch)


@pytest.mark.parametrize("make, batches", [
    (lambda: dtape.metrics.Mean(), [(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 0.0, 2.0])),
                                    (torch.tensor([4.0, 5.0, 6.0]), torch.tensor([0.5, 0.5, 1.0]))]),
    (lambda: dtape.metrics.Mean(), [(torch.tensor([1.0, 2.0, 3.0]),), (torch.tensor([4.0, 5.0, 7.0]),)]),
    (lambda: dtape.metrics.Accuracy(), [(torch.tensor([1, 2, 3]), torch.tensor([1, 0, 3])),
                                        (torch.tensor([0, 0, 1]), torch.tensor([0, 1, 1]))]),
    (lambda: dtape.metrics.SparseCategoricalAccuracy(),
     [(torch.tensor([1, 0]), torch.tensor([[0.1, 0.9], [0.2, 0.8]])),
      (torch.tensor([0, 0]), torch.tensor([[0.7, 0.3], [0.6, 0.4]]))]),
], ids=["Mean_weighted", "Mean", "Accuracy", "SparseCategoricalAccuracy"])
def test_metric_updates_trace_and_accumulate_as_eager(make, batches):
    eager = make()
    for b in batches:
        eager.update_state(*b)
    metric = make()
    gm = _metric_graph(metric, *batches[0])
    values = [v.torch().clone() for v in metric.variables]
    for b in batches:
        values = gm(*values, *b)
    for got, v in zip(values, eager.variables):
        torch.testing.assert_close(got, v.torch(), rtol=0, atol=0)


def test_dropout_traces_and_draws_from_the_generator():
    x = torch.ones(64)
    holder = []
    gm = trace_with_variables(lambda t: holder.append(dtape.nn.dropout(t, 0.5)), [], x)
    assert any("rand" in str(n.target) or "uniform" in str(n.target) for n in gm.graph.nodes)  # a graph draw
    with NoHostReads():
        y = dtape.nn.dropout(x, 0.5)
    assert set(y.torch().unique().tolist()) <= {0.0, 2.0}


# -- the learning rate as a variable (Keras's API) -------------------------------------------------
def test_learning_rate_is_a_settable_float64_variable_with_an_lr_alias():
    w = dtape.Variable(torch.ones(2, dtype=torch.float64))
    opt = opts.SGD(0.1)
    lr = opt.learning_rate
    assert dtape.tensor.is_variable(lr) and lr.dtype == torch.float64 and not lr.trainable
    assert opt.lr is lr and float(lr) == 0.1
    opt.learning_rate = 0.05
    assert opt.learning_rate is lr and float(lr) == 0.05
    opt.lr.assign(0.25)
    opt.apply_gradients([(dtape.constant([1.0, 2.0], dtype=torch.float64), w)])
    assert w.numpy().tolist() == [0.75, 0.5]
    opt.learning_rate = schedules.PiecewiseConstantDecay([5], [0.5, 0.1])
    opt.apply_gradients([(dtape.constant([1.0, 1.0], dtype=torch.float64), w)])
    assert w.numpy().tolist() == [0.25, 0.0]
    opt.lr = 1.0  # back to a number: the same variable
    assert opt.learning_rate is lr and float(lr) == 1.0
    with pytest.raises(ValueError, match="learning_rate"):
        opt.learning_rate = -1.0
    with pytest.raises(TypeError, match="learning_rate"):
        opt.learning_rate = "fast"
    assert float(opt.learning_rate) == 1.0


def test_loss_scale_and_torch_optimizers_expose_lr_too():
    inner = opts.Adam(0.01)
    scaled = LossScaleOptimizer(inner)
    scaled.lr = 0.003
    assert float(inner.learning_rate) == 0.003 and scaled.lr is inner.learning_rate
    p = torch.zeros(2)
    torch_opt = torch.optim.SGD([p], lr=0.1)
    wrapped = opts.from_torch(torch_opt)
    wrapped.lr = 0.3
    assert torch_opt.param_groups[0]["lr"] == 0.3 and wrapped.lr == 0.3


@pytest.mark.usefixtures("closes_strategies")
def test_a_rate_set_outside_run_reaches_every_replica():
    strategy = mirrored(2)
    with strategy.scope():
        w = dtape.Variable(torch.zeros(2, dtype=torch.float64))
        opt = opts.SGD(0.1)
    opt.learning_rate = 0.5

    def step():
        rid = dtape.distribute.get_replica_context().replica_id_in_sync_group
        opt.apply_gradients([(dtape.constant([1.0, 2.0], dtype=torch.float64) * (rid + 1), w)])
    strategy.run(step)
    for component in w.values:  # summed gradient [3, 6] times 0.5
        assert component.numpy().tolist() == [-1.5, -3.0]
