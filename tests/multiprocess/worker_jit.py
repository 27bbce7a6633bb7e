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


def tutorial(form, steps):
    """TF's custom-training tutorial (tutorials/distribute/custom_training): train_step (compute_average_loss
    over the global batch, apply_gradients) run by distributed_train_step = strategy.reduce(SUM,
    strategy.run(train_step, ...)) over experimental_distribute_dataset of the global batches. form: "eager",
    "compiled" (the tutorial's @tf.function on distributed_train_step), "epoch" (the loop over the dataset
    inside the compiled function), "one_device" (no strategy, the whole global batches)."""
    torch.manual_seed(0)
    scope = dtape.distribute.get_strategy().scope() if form == "one_device" else strategy.scope()
    with scope:
        model = digits.build_model(0)
        optimizer = dtape.optimizers.SGD(0.1, momentum=0.9)  # not built, as in TF's tutorial
    runs = []

    def train_step(inputs):
        runs.append(1)
        images, labels = inputs
        with dtape.GradientTape() as tape:
            per_example = digits.per_example_loss(model, images, labels)
            loss = dtape.distribute.compute_average_loss(per_example, global_batch_size=GLOBAL)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def distributed_train_step(dataset_inputs):
        return strategy.reduce(dd.ReduceOp.SUM, strategy.run(train_step, args=(dataset_inputs,)), axis=None)

    def distributed_train_epoch(dataset):
        return dtape.stack([distributed_train_step(x) for x in dataset])
    batches = [(data["x_train"][GLOBAL * i:GLOBAL * (i + 1)], data["y_train"][GLOBAL * i:GLOBAL * (i + 1)])
               for i in range(steps)]
    jit = dtape.function(jit_compile=True, backend="aot_eager")
    f = None
    if form == "one_device":
        losses = [float(train_step((dtape.constant(x), dtape.constant(y)))) for x, y in batches]
    elif form == "eager":
        losses = [float(distributed_train_step(x)) for x in strategy.experimental_distribute_dataset(batches)]
    elif form == "compiled":
        f = jit(distributed_train_step)
        losses = [float(f(x)) for x in strategy.experimental_distribute_dataset(batches)]
    else:
        f = jit(distributed_train_epoch)
        losses = f(strategy.experimental_distribute_dataset(batches)).numpy().tolist()
    seen = {"losses": losses, "weights": [np.float64(v.numpy()).ravel().tolist() for v in model.trainable_variables],
            "train_step_runs": len(runs)}
    if f is not None:
        seen.update(reason=f.eager_body_reason, outer_traces=f.trace_count,
                    replica_traces=[g.trace_count for g in f.replica_functions.values()],
                    backends=[g._backend for g in f.replica_functions.values()])
    return seen


if len(sys.argv) > 3 and sys.argv[3] == "tutorial":
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({form: tutorial(form, steps) for form in ("one_device", "eager", "compiled", "epoch")}, fh)
    sys.exit(0)

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
