"""Worker script for test_jit_multi_worker.py: the digits MLP trained under MultiWorkerMirroredStrategy, each
worker on its half of every global batch, with the replica step run eagerly and compiled
(`dtape.function(step, jit_compile=True)` inside `strategy.run`), for SGD with momentum and dropout, and for
Adam with a learning-rate schedule and a global clipnorm, and for SGD again with small overlap buckets (three
all-reduces launched during the walk).

Writes $OUT/rank<r>.json: {optimizer: {"eager"|"compiled": per-step global losses, "weights": every weight's
sum after the run}, "reductions": the all_reduce_start ops in the compiled graph, "traces": its trace count}.
"""
import json
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import dtape  # noqa: E402
import dtape.distribute as dd  # noqa: E402
from dtape.distribute import traceable_collectives as tc  # noqa: E402
from tasks import digits  # noqa: E402

out, steps = sys.argv[1], int(sys.argv[2])
rank = int(os.environ["RANK"])
torch.set_num_threads(1)
strategy = dd.MultiWorkerMirroredStrategy()
data = digits.load_data(0)
GLOBAL, LOCAL = 32, 16


def make_optimizer(name):
    if name.startswith("sgd"):
        return dtape.optimizers.SGD(0.1, momentum=0.9)
    schedule = dtape.optimizers.schedules.ExponentialDecay(3e-3, decay_steps=5, decay_rate=0.8)
    return dtape.optimizers.Adam(schedule, global_clipnorm=0.5)


def train(name, jit):
    torch.manual_seed(0)
    with strategy.scope():
        model = digits.build_model(0, dropout=0.2 if name == "sgd" else 0.0)
        optimizer = make_optimizer(name)
        optimizer.build(model.trainable_variables)

    def step(x, y):
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(digits.per_example_loss(model, x, y)) / GLOBAL
        variables = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss
    f = dtape.function(step, jit_compile=True, backend="aot_eager") if jit else step
    losses = []
    for i in range(steps):
        part = slice(GLOBAL * i + LOCAL * rank, GLOBAL * i + LOCAL * (rank + 1))
        x, y = dtape.constant(data["x_train"][part]), dtape.constant(data["y_train"][part])
        losses.append(float(strategy.reduce(dd.ReduceOp.SUM, strategy.run(f, args=(x, y)), axis=None)))
    weights = [float(np.float64(v.numpy()).sum()) for v in model.trainable_variables]
    return losses, weights, f


generator = strategy.run(dtape.random.get_generator)  # this worker's replica generator (dropout draws from it)
result = {}
for name in ("sgd", "adam", "sgd_buckets"):
    # sgd_buckets: caps of 4 KB, three buckets (W2; b2 and W1; b1) launched as the walk makes them
    tc.OVERLAP_FIRST_BUCKET_CAP_MB = tc.OVERLAP_BUCKET_CAP_MB = 0.004 if name == "sgd_buckets" else 25.0
    state = generator.get_state()
    eager, weights_eager, _ = train(name, False)
    generator.set_state(state)  # the compiled run draws the eager run's dropout masks
    compiled, weights, f = train(name, True)
    (concrete,) = [c for cs in f._concrete.values() for c in cs]
    result[name] = {"eager": eager, "compiled": compiled, "weights_eager": weights_eager, "weights": weights,
                    "traces": f.trace_count, "reductions": sum(n.target is torch.ops.dtape.all_reduce_start.default
                                                               for n in concrete.graph.graph.nodes)}
with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
    json.dump(result, fh)
