"""Worker script for test_break_s6_multi_worker.py (2 torchrun workers, gloo): a worker is its process's only
replica, so a wrapped module's forward draws the replica generator's stream through torch's default generator.

argv: out_dir. Scenarios, each on a fresh MultiWorkerMirroredStrategy(seed=7):
  draws: a wrapped forward drawing torch.rand(4), dtape.random.uniform([4]), an inner wrapped Linear+Dropout
    called inside it, torch.rand(4); returns the outputs, the replica generator's state before and after and
    whether torch's own generator was left as it was.
  train: 3 SGD steps with GradientSync of a module with a tied weight, a frozen and an unused layer, on each
    rank's half of the batch, the gradients listed in reverse and clipped to global norm 1 before apply;
    returns the parameters by name.
Writes $OUT/rank<r>.json: {scenario: {"value": ...} or {"error": "Type: message"}}.
"""
import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the shared model

from _tied_frozen import TiedFrozenUnused  # noqa: E402
import dtape  # noqa: E402
import dtape.distribute as dd  # noqa: E402

out = sys.argv[1]
rank = int(os.environ["RANK"])
results = {}


class Draws(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        object.__setattr__(self, "inner", inner)   # a dtape TorchModule, not a torch submodule

    def forward(self, x):
        return torch.rand(4), dtape.random.uniform([4]).torch(), self.inner(x).torch(), torch.rand(4)


def draws(strategy):
    torch.manual_seed(0)
    inner_module = nn.Sequential(nn.Linear(2, 16), nn.Dropout(0.5))
    with strategy.scope():
        inner = dtape.layers.TorchModule(inner_module)
        outer = dtape.layers.TorchModule(Draws(inner))
    generator = strategy.replica_generator()
    before, torch_before = generator.get_state(), torch.get_rng_state()
    outs = strategy.run(lambda: outer(torch.ones(1, 2), training=True))
    return {"outs": [o.numpy().tolist() for o in outs], "before": before.tolist(),
            "after": generator.get_state().tolist(), "torch_unchanged": torch.equal(torch_before, torch.get_rng_state()),
            "inner": {k: v.tolist() for k, v in inner_module.state_dict().items()}}


def train(strategy):
    torch.manual_seed(0)
    net = TiedFrozenUnused().double()
    with strategy.scope():
        tm = dtape.layers.TorchModule(net)
        opt = dtape.optimizers.SGD(0.05)
    sync = dd.GradientSync()

    def step(x):
        variables = tm.trainable_variables[::-1]
        with dtape.GradientTape(gradient_sync=sync) as tape:
            loss = dtape.reduce_sum(dtape.square(tm(x)))
        grads, _ = dtape.clip_by_global_norm(tape.gradient(loss, variables), 1.0)
        opt.apply_gradients(zip(grads, variables))
    for k in range(3):
        x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
        strategy.run(step, args=(dtape.constant(x[2 * rank:2 * rank + 2]),))
    return {name: var.numpy().tolist() for name, var in tm._params.items()}


for scenario in (draws, train):
    try:
        results[scenario.__name__] = {"value": scenario(dd.MultiWorkerMirroredStrategy(seed=7))}
    except Exception as e:  # noqa: BLE001 - the test reads the message
        results[scenario.__name__] = {"error": f"{type(e).__name__}: {e}"}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
print(f"rank {rank}: done", flush=True)
