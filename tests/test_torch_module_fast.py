"""The per-step fast paths of a TorchModule step (forward, walk, from_torch's update), each attacked where a
shortcut could give a silently wrong result: gradients compared with torch.autograd in float64, updates with
the same torch.optim step in plain torch."""
import copy
import gc

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import dtape
from dtape.ops import _dispatch

f64 = torch.float64


class DeepCheckpointed(nn.Module):
    """A chain of residual blocks; with `reentrant` set, the first block (the deepest node of the graph, ~20
    levels below the output) runs under a reentrant torch.utils.checkpoint."""

    def __init__(self, depth=8):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(depth)])
        self.reentrant = False

    def forward(self, x):
        for k, block in enumerate(self.blocks):
            if k == 0 and self.reentrant:
                x = x + checkpoint(self._first, x, use_reentrant=True)
            else:
                x = x + torch.tanh(block(x))
        return x

    def _first(self, h):  # run again by the checkpoint's backward
        return torch.tanh(self.blocks[0](h))


def _torch_grads(module, x):
    ref = copy.deepcopy(module)
    xt = x.clone().requires_grad_()
    (ref(xt) ** 2).sum().backward()  # a reentrant checkpoint refuses torch.autograd.grad
    return [p.grad for p in ref.parameters()] + [xt.grad]


def _dtape_grads(tm, x):
    xd = dtape.constant(x)
    with dtape.GradientTape() as tape:
        tape.watch(xd)
        y = dtape.reduce_sum(tm(xd) ** 2)
    return tape.gradient(y, list(tm.trainable_variables) + [xd])


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")  # torch's, on dtape inputs
def test_reentrant_checkpoint_appearing_deep_in_the_graph_on_a_later_call_is_found():
    """The walk searches each call's graph for a reentrant checkpoint (which refuses torch.autograd.grad): calls
    without one, then one with it deep in the graph, then without again, all give torch's gradients."""
    torch.manual_seed(0)
    module = DeepCheckpointed().to(f64)
    tm = dtape.layers.TorchModule(module)
    x = torch.randn(3, 4, dtype=f64)
    for reentrant in (False, False, True, False, True):
        module.reentrant = reentrant
        grads = _dtape_grads(tm, x)
        expected = _torch_grads(module, x)
        assert len(grads) == len(expected) == 17
        for g, e in zip(grads, expected):
            np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-10, atol=1e-12)


def test_the_search_is_skipped_only_while_no_reentrant_checkpoint_node_is_alive():
    """The walk searches a graph for a reentrant checkpoint only while such a node is alive somewhere (the
    class's reference count): none before, one while a graph holds it (also one the tape did not make),
    none again once it is freed."""
    gc.collect()  # a graph another test left in a reference cycle
    x = torch.randn(3, requires_grad=True)
    assert not _dispatch._may_hold_reentrant_checkpoint()
    y = checkpoint(torch.sin, x, use_reentrant=True)
    assert _dispatch._may_hold_reentrant_checkpoint()
    y.sum().backward()  # the node lives while `y` holds it
    assert _dispatch._may_hold_reentrant_checkpoint()
    del y
    assert not _dispatch._may_hold_reentrant_checkpoint()
    y = checkpoint(torch.sin, x, use_reentrant=False)
    assert not _dispatch._may_hold_reentrant_checkpoint()


def test_upstream_gradient_of_another_shape_is_refused_not_reduced():
    """torch's engine alone would sum an upstream gradient that broadcasts to its output's shape; an output
    gradient of the wrong shape must raise, as torch.autograd.grad does."""
    tm = dtape.layers.TorchModule(nn.Linear(3, 2).to(f64))
    x = dtape.constant(torch.ones(4, 3, dtype=f64))
    with dtape.GradientTape() as tape:
        y = tm(x)
    with pytest.raises(RuntimeError, match="[Mm]ismatch in shape"):
        tape.gradient(y, tm.trainable_variables, output_gradients=dtape.ones([5, 4, 2], dtype=f64))


def test_module_gradients_through_the_engine_equal_torch_autograd():
    """A wrapped module's gradients (taken straight from torch's engine) equal torch.autograd.grad's, with an
    upstream gradient, for parameters and input, twice (a second call's graph is its own)."""
    torch.manual_seed(1)
    module = nn.Sequential(nn.Linear(3, 5), nn.GELU(), nn.LayerNorm(5), nn.Linear(5, 2)).to(f64)
    tm = dtape.layers.TorchModule(module)
    ref = copy.deepcopy(module)
    for seed in (2, 3):
        g = torch.Generator().manual_seed(seed)
        x, dy = torch.randn(4, 3, dtype=f64, generator=g), torch.randn(4, 2, dtype=f64, generator=g)
        xd = dtape.constant(x)
        with dtape.GradientTape() as tape:
            tape.watch(xd)
            y = tm(xd)
        got = tape.gradient(y, list(tm.trainable_variables) + [xd], output_gradients=dtape.constant(dy))
        xt = x.clone().requires_grad_()
        expected = torch.autograd.grad(ref(xt), list(ref.parameters()) + [xt], dy)
        for a, e in zip(got, expected):
            np.testing.assert_allclose(a.numpy(), e.numpy(), rtol=1e-12, atol=1e-14)


class Swappable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(3, 4), nn.GELU(), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_a_submodule_replaced_between_calls_is_the_one_the_next_forward_runs():
    """Each call copies the module tree as it is now: an activation swapped after wrapping (GELU -> Tanh ->
    a frozen Linear's composition) gives the new structure's torch gradients on the next call."""
    torch.manual_seed(2)
    module = Swappable().to(f64)
    tm = dtape.layers.TorchModule(module)
    x = torch.randn(5, 3, dtype=f64)
    for act in (nn.GELU(), nn.Tanh(), nn.Sequential(nn.Tanh(), nn.Softsign())):
        module.act = act
        got = _dtape_grads(tm, x)
        expected = _torch_grads(module, x)
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-12, atol=1e-14)


def test_frozen_parameter_gets_no_gradient_unless_watched_and_then_torch_s():
    """A parameter frozen at wrapping (requires_grad=False) is a non-trainable Variable: no gradient from an
    automatic watch; watched explicitly, torch's gradient (the one torch gives once it requires grad)."""
    torch.manual_seed(3)
    module = Swappable().to(f64)
    module.fc1.weight.requires_grad_(False)
    tm = dtape.layers.TorchModule(module)
    frozen = next(v for v in tm.variables if v.name.endswith("fc1.weight"))
    assert not frozen.trainable and all(v is not frozen for v in tm.trainable_variables)
    x = torch.randn(5, 3, dtype=f64)
    with dtape.GradientTape() as tape:
        y = dtape.reduce_sum(tm(dtape.constant(x)) ** 2)
    assert tape.gradient(y, [frozen]) == [None]
    with dtape.GradientTape() as tape:
        tape.watch(frozen)
        y = dtape.reduce_sum(tm(dtape.constant(x)) ** 2)
    (g,) = tape.gradient(y, [frozen])
    module.fc1.weight.requires_grad_(True)
    expected = _torch_grads(module, x)[0]
    np.testing.assert_allclose(g.numpy(), expected.numpy(), rtol=1e-12, atol=1e-14)


def test_watched_variables_keep_first_watch_order_across_a_module_s_bulk_watch():
    """The module's reads watch its variables in one bulk update: variables watched before keep their
    position, new ones follow in read order (TF's first-watch order)."""
    tm = dtape.layers.TorchModule(Swappable().to(f64))
    a, b = tm.trainable_variables[2], tm.trainable_variables[0]
    with dtape.GradientTape() as tape:
        dtape.reduce_sum(a) + dtape.reduce_sum(b)
        tm(dtape.constant(torch.ones(2, 3, dtype=f64)))
    order = [v.name for v in tape.watched_variables()]
    rest = [v.name for v in tm.trainable_variables if v is not a and v is not b]
    assert order == [a.name, b.name] + rest


def test_gradient_of_mixed_sources_keeps_each_source_s_structure_dtype_and_unconnected_choice():
    """The walk's own-handle path (every source a Tensor or plain Variable) gives: a nested source structure
    back, a float64 variable its float64 gradient through a float32 computation, None or zeros for an
    unconnected one, None (with a warning) for an integer one."""
    w = dtape.Variable(torch.tensor([1.0, 2.0], dtype=f64))
    c = dtape.Variable(torch.tensor([0.5, -1.0]))
    n = dtape.Variable(torch.tensor([1, 2]))
    unused = dtape.Variable(torch.tensor([3.0]))
    x = dtape.constant([2.0, 3.0])
    with dtape.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = dtape.reduce_sum(dtape.cast(w, torch.float32) * x * c)
    gw, (gx, gc) = tape.gradient(y, [w, (x, c)])
    assert gw.dtype == f64
    np.testing.assert_allclose(gw.numpy(), [1.0, -3.0])
    np.testing.assert_allclose(gx.numpy(), [0.5, -2.0])
    np.testing.assert_allclose(gc.numpy(), [2.0, 6.0])
    with pytest.warns(UserWarning, match="must be floating"):
        assert tape.gradient(y, [n, unused, w])[:2] == [None, None]
    zeros = tape.gradient(y, [unused], unconnected_gradients=dtape.UnconnectedGradients.ZERO)[0]
    np.testing.assert_allclose(zeros.numpy(), [0.0])


def test_update_together_refuses_a_repeated_variable_and_releases_its_locks_after_an_error():
    a, b = dtape.Variable([1.0, 2.0]), dtape.Variable([3.0])
    calls = []
    assert dtape.optimizers.update_together([a, b, a], calls.append) is None and calls == []

    def fail(tensors):
        raise RuntimeError("kernel failed")
    with pytest.raises(RuntimeError, match="kernel failed"):
        dtape.optimizers.update_together([b, a], fail)
    assert not a._writing and not b._writing
    assert a._lock.acquire(blocking=False) and b._lock.acquire(blocking=False)  # released
    a._lock.release()
    b._lock.release()

    def add_one(tensors):
        for t in tensors:
            t.add_(1.0)
    dtape.optimizers.update_together([b, a], add_one)
    np.testing.assert_allclose(a.numpy(), [2.0, 3.0])
    np.testing.assert_allclose(b.numpy(), [4.0])


def test_from_torch_sees_per_replica_gradients_among_plain_ones():
    """Whether any gradient is distributed is decided per gradient type: a PerReplica among Tensors counts."""
    from dtape.distribute import PerReplica
    assert dtape.optimizers._any_distributed([dtape.constant(1.0), PerReplica((dtape.constant(1.0),))])
    assert not dtape.optimizers._any_distributed([dtape.constant(1.0), dtape.constant(2.0)])
