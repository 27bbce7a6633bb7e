"""Freezing a wrapped module's parameters the PyTorch way (`p.requires_grad_(False)` after wrapping it in a
TorchModule, and unfreezing later): no gradient, the optimizer leaves it, as in torch. References: the same
schedule of freezes run by plain torch (autograd, the same torch optimizer), in float64."""
import copy

import numpy as np
import pytest
import torch
from torch import nn

import dtape
from dtape import distribute as ds
from _strategies import mirrored

pytestmark = pytest.mark.usefixtures("closes_strategies")

STEPS = [("all", 2), ("frozen", 2), ("all", 2)]  # phases: which parameters train, for how many steps


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def _batch(step):
    return torch.randn(6, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(step))


def _set_frozen(model, frozen):
    """The fine-tuning habit: freeze the first layer (both of torch's spellings)."""
    model[0].weight.requires_grad_(not frozen)
    model[0].bias.requires_grad = not frozen


def _torch_run(model, phases):
    """Parameters after each step of plain torch: AdamW over every parameter, sum of squares loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    out, step = [], 0
    for phase, n in phases:
        _set_frozen(model, phase == "frozen")
        for _ in range(n):
            opt.zero_grad()
            model(_batch(step)).square().sum().backward()
            assert all((p.grad is None) == (phase == "frozen") for p in model[0].parameters())
            opt.step()
            out.append([p.detach().clone() for p in model.parameters()])
            step += 1
    return out


def _dtape_run(model, phases, strategy, fixed_list):
    """The same through TorchModule + from_torch(AdamW) under `strategy`; `fixed_list`: the variables
    listed once before the first step (their gradients: None while frozen), else each step's
    `trainable_variables`. Returns the parameters after each step and the gradients' None-ness per step."""
    with strategy.scope():
        tm = dtape.layers.TorchModule(model)
    opt = dtape.optimizers.from_torch(torch.optim.AdamW(tm.parameters(), lr=0.05, weight_decay=0.1))
    listed = tm.trainable_variables

    def step(x):
        variables = listed if fixed_list else tm.trainable_variables
        with dtape.GradientTape(gradient_sync=ds.GradientSync()) as tape:
            loss = dtape.reduce_sum(dtape.square(tm(x)))
        grads = tape.gradient(loss, variables)
        opt.apply_gradients(zip(grads, variables))
        return tuple(g is None for g in grads)

    out, nones, i = [], [], 0
    for phase, n in phases:
        _set_frozen(model, phase == "frozen")
        for _ in range(n):
            dist = strategy.experimental_distribute_dataset([_batch(i).numpy()])
            for x in dist:
                result = strategy.run(step, args=(x,))
            nones.append(strategy.experimental_local_results(result))
            out.append([p.detach().clone() for p in model.parameters()])
            _assert_components_equal(tm)
            i += 1
    return out, nones, tm


def _assert_components_equal(tm):
    for var in tm.variables:
        comps = getattr(var, "values", (var,))
        for c in comps[1:]:
            assert torch.equal(c.torch(), comps[0].torch()), var.name


def _strategy(kind):
    return mirrored(2) if kind == "mirrored" else ds.OneDeviceStrategy("cpu")


@pytest.mark.parametrize("fixed_list", [False, True])
@pytest.mark.parametrize("kind", ["one", "mirrored"])
def test_requires_grad_false_after_wrapping_freezes_as_in_torch(kind, fixed_list):
    ref = _torch_run(_model(), STEPS)
    got, nones, tm = _dtape_run(_model(), STEPS, _strategy(kind), fixed_list)
    for k, (a, b) in enumerate(zip(got, ref)):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=1e-12, atol=1e-14, err_msg=f"step {k}")
    assert torch.equal(got[1][0], got[3][0]) and torch.equal(got[1][1], got[3][1])  # untouched while frozen
    assert not torch.equal(got[3][0], got[5][0])  # trained again once unfrozen
    frozen = 2 if fixed_list else 0  # a listed frozen variable gets None, as torch's p.grad
    for k, per_replica in enumerate(nones):
        want = (True,) * frozen + (False,) * 2 if STEPS[k // 2][0] == "frozen" else (False,) * 4
        assert all(n == want for n in per_replica), (k, per_replica)
    assert len(tm.trainable_variables) == 4 and len(tm.non_trainable_variables) == 0


@pytest.mark.parametrize("kind", ["one", "mirrored"])
def test_requires_grad_true_on_a_parameter_frozen_when_wrapped_trains_it(kind):
    phases = [("frozen", 2), ("all", 2)]
    ref = _torch_run(_model(1), phases)
    model = _model(1)
    _set_frozen(model, True)  # frozen before wrapping: its variables start non-trainable
    got, _, tm = _dtape_run(model, phases, _strategy(kind), fixed_list=False)
    for a, b in zip(got, ref):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=1e-12, atol=1e-14)
    assert not torch.equal(got[1][0], got[3][0])


def test_frozen_parameter_is_left_by_dtape_optimizers_and_listed_as_non_trainable():
    model = _model(2)
    tm = dtape.layers.TorchModule(model)
    opt = dtape.optimizers.AdamW(learning_rate=0.05, weight_decay=0.1)
    _set_frozen(model, True)
    names = [v.name for v in tm.non_trainable_variables]  # before any call: the listing follows too
    assert names == [f"{tm.name}/0.weight", f"{tm.name}/0.bias"]
    first = [p.detach().clone() for p in model.parameters()]
    for step in range(2):
        variables = tm.variables
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(dtape.square(tm(_batch(step))))
        grads = tape.gradient(loss, variables)
        assert [g is None for g in grads] == [True, True, False, False]
        opt.apply_gradients(zip(grads, variables))
    after = list(model.parameters())
    assert torch.equal(after[0], first[0]) and torch.equal(after[1], first[1])
    assert not torch.equal(after[2], first[2])


@pytest.mark.parametrize("kind", ["one", "mirrored"])
def test_torch_optimizer_over_the_parameters_left_trainable_as_torch_feature_extraction(kind):
    """torchvision's feature-extraction recipe: freeze, then optimize `[p for p in params if p.requires_grad]`."""
    ref = _model(3)
    _set_frozen(ref, True)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    model = _model(3)
    strategy = _strategy(kind)
    with strategy.scope():
        tm = dtape.layers.TorchModule(model)
    _set_frozen(model, True)
    opt = dtape.optimizers.from_torch(torch.optim.SGD([p for p in tm.parameters() if p.requires_grad], lr=0.1,
                                                      momentum=0.9))

    def step(x):
        variables = tm.trainable_variables
        with dtape.GradientTape(gradient_sync=ds.GradientSync()) as tape:
            loss = dtape.reduce_sum(dtape.square(tm(x)))
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

    for i in range(3):
        ref_opt.zero_grad()
        ref(_batch(i)).square().sum().backward()
        ref_opt.step()
        for x in strategy.experimental_distribute_dataset([_batch(i).numpy()]):
            strategy.run(step, args=(x,))
    for a, b in zip(model.parameters(), ref.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-12, atol=1e-14)
    assert torch.equal(model[0].weight, _model(3)[0].weight)
    _assert_components_equal(tm)


def test_compiled_step_retraces_when_a_parameter_is_frozen_or_unfrozen():
    """A compiled step's graph watched the parameters trainable when traced: it is reused only while every
    requires_grad is as traced (torch.compile guards on it too). Reference: torch's SGD, the same freezes."""
    ref, model = _model(4), _model(4)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    tm = dtape.layers.TorchModule(model)
    opt = dtape.optimizers.SGD(0.1)

    @dtape.function(jit_compile=True, backend=None)
    def step(x):
        variables = tm.trainable_variables
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(dtape.square(tm(x)))
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    i = 0
    for phase, n in STEPS:
        _set_frozen(ref, phase == "frozen")
        _set_frozen(model, phase == "frozen")
        for _ in range(n):
            ref_opt.zero_grad()
            ref(_batch(i)).square().sum().backward()
            ref_opt.step()
            step(dtape.constant(_batch(i)))
            for a, b in zip(model.parameters(), ref.parameters()):
                np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-12, atol=1e-14,
                                           err_msg=f"step {i} ({phase})")
            i += 1
    assert step.experimental_get_tracing_count() == 2  # all trainable, frozen; unfreezing finds the first graph
