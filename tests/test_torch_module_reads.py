"""A TorchModule reads its parameters in one pass (`dtape.variables.read_values`), recorded as one record
where the tapes record the same reads: gradients equal torch.autograd's (float64) in every watch setting."""
import copy

import numpy as np
import pytest
import torch
from torch import nn

import dtape
from _strategies import mirrored

pytestmark = pytest.mark.usefixtures("closes_strategies")
f64 = torch.float64


class TwoLayers(nn.Module):
    """3 -> 3 through a, b; `unused` never runs; `scale` is frozen (requires_grad=False: not trainable)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 3)
        self.unused = nn.Linear(2, 2)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3), requires_grad=False)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))) * self.scale


def _module():
    torch.manual_seed(0)
    return TwoLayers().double()


def _x(seed=1, n=5):
    return torch.randn(n, 3, generator=torch.Generator().manual_seed(seed), dtype=f64)


def _torch_grads(module, loss_of, names):
    """torch.autograd's gradients of `loss_of(ref)` for the named parameters of a copy (None: unused)."""
    ref = copy.deepcopy(module)
    params = dict(ref.named_parameters())
    for name in names:
        params[name].requires_grad_(True)
    grads = torch.autograd.grad(loss_of(ref), [params[n] for n in names], allow_unused=True)
    return dict(zip(names, grads))


def _assert_grads(got, expected):
    assert got.keys() == expected.keys()
    for name, g in got.items():
        if expected[name] is None:
            assert g is None, name
        else:
            assert g is not None, name
            np.testing.assert_allclose(g.numpy(), expected[name].numpy(), rtol=1e-12, atol=1e-14, err_msg=name)


def _sq(out):
    return dtape.reduce_sum(out * out)


TRAINABLE = ["a.weight", "a.bias", "b.weight", "b.bias", "unused.weight", "unused.bias"]


def test_unused_parameter_gets_none_and_the_others_torchs_gradient():
    module, x = _module(), _x()
    tm = dtape.layers.TorchModule(module)
    assert [v.name.split("/")[-1] for v in tm.trainable_variables] == TRAINABLE
    with dtape.GradientTape(persistent=True) as tape:
        loss = _sq(tm(x))
    got = dict(zip(TRAINABLE, tape.gradient(loss, tm.trainable_variables)))
    _assert_grads(got, _torch_grads(module, lambda m: (m(x) ** 2).sum(), TRAINABLE))
    zeros = tape.gradient(loss, tm.trainable_variables, unconnected_gradients="zero")
    assert [float(dtape.reduce_sum(g * g)) for g in zeros[4:]] == [0.0, 0.0]
    # the frozen parameter: a variable no tape watched, so no gradient (as torch's requires_grad=False)
    assert tape.gradient(loss, tm._params["scale"]) is None


def test_persistent_tape_gives_the_same_gradients_twice_and_an_explicit_watch_reaches_a_frozen_parameter():
    module, x = _module(), _x()
    tm = dtape.layers.TorchModule(module)
    names = TRAINABLE + ["scale"]
    variables = [tm._params[n] for n in names]
    with dtape.GradientTape(persistent=True) as tape:
        tape.watch(tm._params["scale"])
        loss = _sq(tm(x))
    expected = _torch_grads(module, lambda m: (m(x) ** 2).sum(), names)
    for _ in range(2):
        _assert_grads(dict(zip(names, tape.gradient(loss, variables))), expected)


def test_watch_accessed_variables_false_watches_only_what_was_watched():
    module, x = _module(), _x()
    tm = dtape.layers.TorchModule(module)
    xt = dtape.constant(x)
    with dtape.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(xt)
        tape.watch(tm._params["b.weight"])
        loss = _sq(tm(xt))
    grads = tape.gradient(loss, [*tm.trainable_variables, xt])
    expected = _torch_grads(module, lambda m: (m(x) ** 2).sum(), TRAINABLE)
    expected = {n: g if n == "b.weight" else None for n, g in expected.items()}
    _assert_grads(dict(zip(TRAINABLE, grads[:-1])), expected)
    xr = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad((module(xr) ** 2).sum(), [xr])
    np.testing.assert_allclose(grads[-1].numpy(), dx.numpy(), rtol=1e-12)


def test_two_tapes_watching_different_parameters_each_get_their_own():
    module, x = _module(), _x()
    tm = dtape.layers.TorchModule(module)
    with dtape.GradientTape() as outer:
        with dtape.GradientTape(watch_accessed_variables=False) as inner:
            inner.watch(tm._params["a.bias"])
            loss = _sq(tm(x))
        inner_grads = inner.gradient(loss, tm.trainable_variables)
    outer_grads = outer.gradient(loss, tm.trainable_variables)
    expected = _torch_grads(module, lambda m: (m(x) ** 2).sum(), TRAINABLE)
    _assert_grads(dict(zip(TRAINABLE, outer_grads)), expected)
    _assert_grads(dict(zip(TRAINABLE, inner_grads)), {n: g if n == "a.bias" else None for n, g in expected.items()})


def test_tape_started_between_two_calls_sees_only_the_second():
    module, x = _module(), _x()
    tm = dtape.layers.TorchModule(module)
    with dtape.GradientTape() as outer:
        y1 = tm(x)
        with dtape.GradientTape() as inner:
            loss = _sq(tm(y1))
    inner_grads = inner.gradient(loss, tm.trainable_variables)
    outer_grads = outer.gradient(loss, tm.trainable_variables)
    _assert_grads(dict(zip(TRAINABLE, outer_grads)),
                  _torch_grads(module, lambda m: (m(m(x)) ** 2).sum(), TRAINABLE))
    _assert_grads(dict(zip(TRAINABLE, inner_grads)),
                  _torch_grads(module, lambda m: (m(m(x).detach()) ** 2).sum(), TRAINABLE))


def test_nested_tapes_second_order_equals_torch():
    module, x = _module(), _x()
    tm = dtape.layers.TorchModule(module)
    used = TRAINABLE[:4]
    variables = [tm._params[n] for n in used]
    with dtape.GradientTape() as outer:
        with dtape.GradientTape() as inner:
            loss = _sq(tm(x))
        grads = inner.gradient(loss, variables)
        penalty = dtape.add_n([dtape.reduce_sum(g * g) for g in grads])
    got = dict(zip(used, outer.gradient(penalty, variables)))

    def penalty_of(m):
        params = [dict(m.named_parameters())[n] for n in used]
        gs = torch.autograd.grad((m(x) ** 2).sum(), params, create_graph=True)
        return sum((g * g).sum() for g in gs)
    _assert_grads(got, _torch_grads(module, penalty_of, used))


def test_mirrored_replicas_read_and_differentiate_their_own_components():
    module = _module()
    xs = _x(seed=2, n=4)
    strategy = mirrored(2)
    with strategy.scope():
        tm = dtape.layers.TorchModule(module)
    one = dtape.layers.TorchModule(copy.deepcopy(module))
    with dtape.GradientTape() as tape:
        kept = _sq(one(xs[:2]))  # kept alive: the records of a dead output are deleted
        one_device_records = tape.num_records()
    assert kept is not None and one_device_records > 0
    with tm._params["a.weight"].values[1]._lock:   # replica 1's component differs: its reads must be its own
        tm._params["a.weight"].values[1]._t.mul_(2.0)
    twice = copy.deepcopy(module)
    with torch.no_grad():
        twice.a.weight.mul_(2.0)

    records = {}

    def step(x, model):
        with dtape.GradientTape() as tape:
            loss = _sq(model(x))
            # the sibling replica's reads and forward are not recorded on this replica's tape
            records[dtape.distribute.get_replica_context().replica_id_in_sync_group] = tape.num_records()
        return tape.gradient(loss, model.trainable_variables)
    batches = next(iter(strategy.experimental_distribute_dataset([xs])))
    # built outside the scope: plain variables that both replicas read (each replica's tape watches them)
    shared = dtape.layers.TorchModule(copy.deepcopy(module))
    strategy.run(step, args=(batches, shared))
    assert records == {0: one_device_records, 1: one_device_records}
    grads = strategy.run(step, args=(batches, tm))
    assert records == {0: one_device_records, 1: one_device_records}
    for k, (ref, part) in enumerate(((module, xs[:2]), (twice, xs[2:]))):
        got = [None if g is None else strategy.experimental_local_results(g)[k] for g in grads]  # None: both
        _assert_grads(dict(zip(TRAINABLE, got)), _torch_grads(ref, lambda m: (m(part) ** 2).sum(), TRAINABLE))


def test_fallback_with_tensor_keyword_arguments_equals_torch():
    # torch.nn.functional passes every keyword to __torch_function__: the fallback flattens leaf keywords
    # itself (no pytree), tensors among them included
    gen = torch.Generator().manual_seed(3)
    logits, w = torch.randn(6, 4, generator=gen, dtype=f64), torch.rand(4, generator=gen, dtype=f64) + 0.5
    gamma, beta = torch.randn(4, generator=gen, dtype=f64), torch.randn(4, generator=gen, dtype=f64)
    target = torch.tensor([0, 3, 1, 2, 3, 0])
    leaves = [logits, gamma, beta]

    def loss_of(f, lg, g, b):  # cross_entropy's class weights: a torch tensor (torch has no gradient for them)
        h = f.group_norm(lg, 2, weight=g, bias=b, eps=1e-3)
        return f.cross_entropy(h, target, weight=w, label_smoothing=0.1, reduction="sum")
    refs = [t.clone().requires_grad_() for t in leaves]
    expected = torch.autograd.grad(loss_of(torch.nn.functional, *refs), refs)
    ins = [dtape.constant(t) for t in leaves]
    with dtape.GradientTape() as tape:
        for t in ins:
            tape.watch(t)
        loss = loss_of(torch.nn.functional, *ins)
    for g, e in zip(tape.gradient(loss, ins), expected):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-12, atol=1e-14)


def test_cross_entropy_class_weights_as_a_dtape_constant():
    # torch has no derivative for the class weights: the fallback runs the call with them as a constant
    gen = torch.Generator().manual_seed(4)
    logits, w = torch.randn(6, 4, generator=gen, dtype=f64), torch.rand(4, generator=gen, dtype=f64) + 0.5
    target = torch.tensor([0, 3, 1, 2, 3, 0])
    ref = logits.clone().requires_grad_()
    (expected,) = torch.autograd.grad(torch.nn.functional.cross_entropy(ref, target, weight=w), [ref])
    x, wt = dtape.constant(logits), dtape.constant(w)
    with dtape.GradientTape(persistent=True) as tape:
        tape.watch(x)
        loss = torch.nn.functional.cross_entropy(x, target, weight=wt)
    grad_x, grad_w = tape.gradient(loss, [x, wt])
    np.testing.assert_allclose(grad_x.numpy(), expected.numpy(), rtol=1e-12, atol=1e-14)
    assert grad_w is None
    with dtape.GradientTape() as tape:
        tape.watch(wt)
        with pytest.raises(RuntimeError, match="no derivative for one of its inputs that a tape watches"):
            torch.nn.functional.cross_entropy(x, target, weight=wt)


def test_wrapped_forward_is_not_run_twice_for_an_argument_torch_cannot_differentiate():
    # a second run would update BatchNorm's running statistics twice: torch's error stands instead
    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.BatchNorm1d(4)

        def forward(self, x, target, class_weights):
            return torch.nn.functional.cross_entropy(self.norm(x), target, weight=class_weights)

    gen = torch.Generator().manual_seed(5)
    tm = dtape.layers.TorchModule(Classifier().double())
    x, w = torch.randn(6, 4, generator=gen, dtype=f64), torch.rand(4, generator=gen, dtype=f64)
    with dtape.GradientTape():
        with pytest.raises(RuntimeError, match="not differentiable with respect to argument 'weight'"):
            tm(x, torch.tensor([0, 3, 1, 2, 3, 0]), dtape.constant(w), training=True)
    assert int(tm._buffers["norm.num_batches_tracked"].numpy()) == 0
