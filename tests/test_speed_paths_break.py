"""Fast paths of TorchModule reads, from_torch's step plan and GradientSync's kept bucket layout, attacked where
they could give a silently wrong result: each test compares with torch.optim / torch.autograd in float64, or
with what dtape's own optimizers do (TF's per-component update)."""
import copy

import pytest
import torch

import dtape
import dtape.distribute as ds
from _strategies import mirrored

pytestmark = pytest.mark.usefixtures("closes_strategies")
f64 = torch.float64


def test_from_torch_updates_each_component_of_a_trainable_sync_on_read_variable_with_its_own_value():
    """A sync-on-read variable holds each replica's own value (TF): the update of index 1 is its own torch step
    on its own value, not a copy of index 0's new value (as dtape's SGD and torch's SGD on that value give)."""
    strategy = mirrored(2)
    with strategy.scope():
        v = dtape.Variable(torch.zeros(3, dtype=f64), trainable=True, name="v",
                           synchronization=ds.VariableSynchronization.ON_READ,
                           aggregation=ds.VariableAggregation.MEAN)
    opt = dtape.optimizers.from_torch(torch.optim.SGD([v.values[0].torch()], lr=0.1, momentum=0.9))
    mine = [torch.tensor([1.0, -2.0, 3.0], dtype=f64), torch.tensor([4.0, 5.0, -6.0], dtype=f64)]
    refs = [m.clone().requires_grad_() for m in mine]
    ref_opts = [torch.optim.SGD([r], lr=0.1, momentum=0.9) for r in refs]

    def set_own():
        v.assign(mine[ds.get_replica_context().replica_id_in_sync_group])

    def step(k):
        r = ds.get_replica_context().replica_id_in_sync_group
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(v * v * (r + 1.0 + k))
        opt.apply_gradients(zip(tape.gradient(loss, [v]), [v]))

    strategy.run(set_own)
    for k in range(3):
        strategy.run(step, args=(k,))
        # the summed gradient, the same on both: sum over the replicas q of 2 (q + 1 + k) v_q (each its own v)
        g = sum(2 * (q + 1.0 + k) * refs[q].detach() for q in range(2))
        for ref, ref_opt in zip(refs, ref_opts):
            ref.grad = g.clone()
            ref_opt.step()
        for r in range(2):
            torch.testing.assert_close(v.values[r].torch(), refs[r].detach(), rtol=1e-12, atol=1e-12)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()


def test_forward_mode_through_a_module_s_one_read_record_equals_torch_hvp():
    """The one record of a module's parameter reads carries tangents (its jvp): a JVP, and a Hessian-vector
    product by forward-over-backward, equal torch.func's."""
    module = _mlp()
    x = torch.randn(5, 3, dtype=f64, generator=torch.Generator().manual_seed(1))
    tm = dtape.layers.TorchModule(copy.deepcopy(module))
    variables = tm.trainable_variables
    tangents = [torch.full_like(v.torch(), 0.1 * (k + 1)) for k, v in enumerate(variables)]
    with dtape.autodiff.ForwardAccumulator(variables, [dtape.constant(t) for t in tangents]) as acc:
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(tm(dtape.constant(x)) ** 2)
        grads = tape.gradient(loss, variables)
    names = [n for n, _ in module.named_parameters()]

    def f(*params):
        return torch.func.functional_call(module, dict(zip(names, params)), (x,)).pow(2).sum()
    params = tuple(p.detach() for p in module.parameters())
    _, jvp = torch.func.jvp(f, params, tuple(tangents))
    _, hvp = torch.autograd.functional.hvp(f, params, tuple(tangents))
    torch.testing.assert_close(acc.jvp(loss).torch(), jvp, rtol=1e-12, atol=1e-12)
    for got, want in zip(acc.jvp(grads), hvp):
        torch.testing.assert_close(got.torch(), want, rtol=1e-12, atol=1e-12)



def _two_variables(strategy):
    with strategy.scope():
        return [dtape.Variable(torch.full((3,), float(k + 1), dtype=f64), name=f"v{k}") for k in range(2)]


@pytest.mark.parametrize("kind", ["torch", "dtape"])
def test_replicas_listing_their_variables_in_other_orders_raise_instead_of_mixing_gradients(kind):
    """The gradients are summed position by position: replica 1 listing (g, v) in another order would add v1's
    gradient to v0's. A clear error, nothing written."""
    strategy = mirrored(2)
    variables = _two_variables(strategy)
    opt = dtape.optimizers.SGD(1.0) if kind == "dtape" else \
        dtape.optimizers.from_torch(torch.optim.SGD([v.torch() for v in variables], lr=1.0))

    def step():
        r = ds.get_replica_context().replica_id_in_sync_group
        listed = variables if r == 0 else variables[::-1]
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(variables[0] * 10.0) + dtape.reduce_sum(variables[1])
        opt.apply_gradients(zip(tape.gradient(loss, listed), listed))
    with pytest.raises(ValueError, match="same variables in the same order"):
        strategy.run(step)
    for k, v in enumerate(variables):
        for comp in v.values:
            assert torch.equal(comp.torch(), torch.full((3,), float(k + 1), dtype=f64))


def test_from_torch_given_each_replica_s_own_components_updates_every_component():
    """Each replica passing its own components (v.values[r]): every component takes torch's SGD step with the
    summed gradient (replica 1's components are not left behind)."""
    strategy = mirrored(2)
    variables = _two_variables(strategy)
    opt = dtape.optimizers.from_torch(torch.optim.SGD([v.torch() for v in variables], lr=1.0))

    def step():
        comps = [v.values[ds.get_replica_context().replica_id_in_sync_group] for v in variables]
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(variables[0] * 10.0) + dtape.reduce_sum(variables[1])
        opt.apply_gradients(zip(tape.gradient(loss, comps), comps))
    strategy.run(step)
    for v, want in zip(variables, (1.0 - 20.0, 2.0 - 2.0)):
        for comp in v.values:
            assert torch.equal(comp.torch(), torch.full((3,), want, dtype=f64))
