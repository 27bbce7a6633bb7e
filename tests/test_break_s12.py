"""The walk's test for a live reentrant checkpoint node (the class's reference count) when such a node is
alive as dtape is imported: the count it then takes as idle is one too high, and a tape's checkpoint node
made while that torch-only graph is freed leaves the count at it, so the walk skipped the search and asked
torch.autograd.grad, which a reentrant checkpoint refuses. Each run is a fresh interpreter (the count is
taken at import); gradients are compared with torch.autograd in float64."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT)  # this checkout's dtape, not an installed one

SCRIPT = """
import copy, gc, warnings
import numpy as np
import torch
from torch.utils.checkpoint import checkpoint
warnings.filterwarnings("ignore", "None of the inputs have requires_grad=True")
x0 = torch.randn(3, requires_grad=True)
FREE = {free!r}
old = checkpoint(torch.sin, x0, use_reentrant=True)  # a torch-only graph, alive as dtape is imported
if FREE == "cycle":
    holder = [old]
    holder.append(holder)  # a reference cycle: only gc frees it
    del old
import dtape
f64 = torch.float64

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3).to(f64)

    def forward(self, x):
        return checkpoint(self._inner, x, use_reentrant=True)

    def _inner(self, h):
        return torch.tanh(self.lin(h))

torch.manual_seed(0)
module = Block()
tm = dtape.layers.TorchModule(module)
x = torch.randn(2, 3, dtype=f64)
xd = dtape.constant(x)
with dtape.GradientTape() as tape:
    tape.watch(xd)
    y = dtape.reduce_sum(tm(xd) ** 2)
if FREE == "del":
    del old  # freed while the tape's graph lives: the class's count is back at the one taken at import
else:
    del holder
    gc.collect()
grads = tape.gradient(y, list(tm.trainable_variables) + [xd])
ref = copy.deepcopy(module)
xt = x.clone().requires_grad_()
(ref(xt) ** 2).sum().backward()
for g, e in zip(grads, [p.grad for p in ref.parameters()] + [xt.grad]):
    np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-10, atol=1e-12)
print("ok")
"""


def _run(free):
    proc = subprocess.run([sys.executable, "-c", SCRIPT.format(free=free)], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_checkpoint_graph_alive_at_import_freed_while_the_tapes_lives():
    _run("del")


def test_checkpoint_graph_alive_at_import_in_a_cycle_collected_while_the_tapes_lives():
    _run("cycle")
