"""The per-step fast paths of a TorchModule step (forward, walk, from_torch's update), each attacked where a
shortcut could give a silently wrong result: gradients compared with torch.autograd in float64, updates with
the same torch.optim step in plain torch."""
import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import dtape

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
