"""from_torch under MirroredStrategy on CPU replicas updates replica 1 by copying replica 0's new values; a
component written on its own (bypassing the strategy) would have that write silently discarded, so the step
refuses it. References: plain torch (the same torch optimizer on one parameter)."""
import copy

import numpy as np
import pytest
import torch
from torch import nn

import dtape
from dtape import distribute as ds
from dtape import optimizers as dopt
from _strategies import mirrored

pytestmark = pytest.mark.usefixtures("closes_strategies")

DIVERGED = "replica 1's component of MirroredVariable"


def _step(strategy, opt, variables, loss_fn):
    def step():
        with dtape.GradientTape(gradient_sync=ds.GradientSync()) as tape:
            loss = loss_fn()
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    strategy.run(step)


def _components(var):
    return [c.numpy().tolist() for c in var.values]


def test_a_component_written_on_its_own_is_refused_before_anything_is_updated():
    strategy = mirrored(2)
    with strategy.scope():
        v = dtape.Variable([1.0, 2.0], name="v")
    torch_opt = torch.optim.SGD([v.torch()], lr=0.5, momentum=0.9)
    opt = dopt.from_torch(torch_opt)
    loss = lambda: dtape.reduce_sum(v * v)  # noqa: E731
    _step(strategy, opt, [v], loss)
    v.values[1].assign([10.0, 20.0])  # replica 1 only: the strategy is bypassed
    before = _components(v)
    with pytest.raises(ValueError, match=DIVERGED + " 'v' differs from replica 0's: it was written on its own") as e:
        _step(strategy, opt, [v], loss)
    assert "var.assign(value) in the cross-replica context" in str(e.value) and "Nothing was updated" in str(e.value)
    assert _components(v) == before and int(opt.iterations.numpy()) == 1
    # written through the strategy (every component): the run goes on, as torch's from that value
    v.assign([3.0, -1.0])
    p = torch.tensor([1.0, 2.0], requires_grad=True)
    ref = torch.optim.SGD([p], lr=0.5, momentum=0.9)
    for value in ([1.0, 2.0], [3.0, -1.0], None):
        if value is not None:
            with torch.no_grad():
                p.copy_(torch.tensor(value))
        ref.zero_grad()
        (2 * (p * p).sum()).backward()  # two replicas, each the same loss: the sum
        ref.step()
    _step(strategy, opt, [v], loss)
    _step(strategy, opt, [v], loss)
    np.testing.assert_allclose(_components(v), [p.detach().tolist()] * 2, rtol=1e-6)


def test_torch_module_loaded_through_the_torch_module_reaches_every_replica_and_trains_as_torch():
    """`module.load_state_dict` writes the parameters in place (replica 0's components, the module's storage):
    the wrapper copies the write to the other replicas before the next call uses them, so the step is
    torch's from the loaded weights (no divergence to refuse)."""
    torch.manual_seed(0)
    model, saved = nn.Linear(3, 2).double(), nn.Linear(3, 2).double().state_dict()
    strategy = mirrored(2)
    with strategy.scope():
        tm = dtape.layers.TorchModule(model)
    opt = dopt.from_torch(torch.optim.AdamW(tm.parameters(), lr=0.1))
    x = torch.randn(4, 3, dtype=torch.float64)
    variables = tm.trainable_variables

    def loss():
        return dtape.reduce_sum(dtape.square(tm(x)))
    model.load_state_dict(saved)  # the torch habit
    ref = nn.Linear(3, 2).double()
    ref.load_state_dict(saved)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    for _ in range(3):
        _step(strategy, opt, variables, loss)
        ref_opt.zero_grad()
        (2 * ref(x).square().sum()).backward()
        ref_opt.step()
    for var, p in zip(variables, ref.parameters()):
        for c in var.values:
            np.testing.assert_allclose(c.numpy(), p.detach().numpy(), rtol=1e-12)


def test_components_are_compared_only_after_a_write_outside_the_step(monkeypatch):
    compared = []
    real = dopt._equal
    monkeypatch.setattr(dopt, "_equal", lambda a, b: compared.append(1) or real(a, b))
    strategy = mirrored(2)
    with strategy.scope():
        vs = [dtape.Variable([1.0, 2.0]), dtape.Variable([[0.5]])]
    opt = dopt.from_torch(torch.optim.Adam([v.torch() for v in vs], lr=0.1))
    loss = lambda: dtape.reduce_sum(vs[0] * vs[0]) + dtape.reduce_sum(vs[1])  # noqa: E731
    _step(strategy, opt, vs, loss)
    assert len(compared) == 2  # the first step: every copied component
    for _ in range(3):
        _step(strategy, opt, vs, loss)
    assert len(compared) == 2  # steady state: nothing written outside the steps, nothing compared
    vs[1].assign([[4.0]])  # every component: compared once, equal, accepted
    _step(strategy, opt, vs, loss)
    assert len(compared) == 3
    assert all(torch.equal(c.torch(), v.values[0].torch()) for v in vs for c in v.values)


def test_dtape_optimizers_keep_a_component_s_own_write_as_tf_does():
    """TF (and dtape's own optimizers) update each component from its own value: the difference stays."""
    strategy = mirrored(2)
    with strategy.scope():
        v = dtape.Variable([1.0, 2.0])
    v.values[1].assign([10.0, 20.0])
    _step(strategy, dopt.SGD(0.5), [v], lambda: dtape.reduce_sum(v))
    assert _components(v) == [[0.0, 1.0], [9.0, 19.0]]
    with pytest.raises(ValueError, match="replica 1's component on cpu differs from replica 0's"):
        strategy.extended.check_mirrored()
