"""Worker script for test_multi_worker.py: checks MultiWorkerMirroredStrategy's API on every rank.

Run under torchrun with 2 workers. Each rank seeds torch differently (so
identical variables can only come from the broadcast), runs the checks and
writes what it saw to $OUT/rank<r>.json; an AssertionError fails the launch.
"""
import json
import os
import sys

import numpy as np
import torch

import dtape
import dtape.distribute as dd
import dtape.optimizers

out = sys.argv[1]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.manual_seed(1000 + rank)                  # ranks disagree on purpose
strategy = dd.MultiWorkerMirroredStrategy(seed=7)
seen = {"rank": rank, "task_id": strategy.cluster_resolver.task_id, "num_replicas": strategy.num_replicas_in_sync,
        "backend": strategy.backend}

# Variables start from rank 0's (different on each rank before the broadcast).
with strategy.scope():
    v = dtape.Variable(torch.randn(3), name="v")
    layer = dtape.layers.Dense(2, input_dim=3)          # seed None: drawn from each rank's own torch seed
    opt = dtape.optimizers.SGD(0.5, momentum=0.9)
    counter = dtape.Variable(0.0, synchronization=dtape.VariableSynchronization.ON_READ,
                             aggregation=dtape.VariableAggregation.SUM, name="counter")
seen["v"] = v.numpy().tolist()
seen["kernel"] = layer.kernel.numpy().tolist()


# run / replica context / collectives.
def replica_fn(x):
    ctx = dd.get_replica_context()
    total = ctx.all_reduce(dd.ReduceOp.SUM, x)
    mean = ctx.all_reduce("MEAN", x)
    gathered = ctx.all_gather(dtape.constant([float(ctx.replica_id_in_sync_group)] * (ctx.replica_id_in_sync_group + 1)),
                              axis=0)
    merged = ctx.merge_call(lambda s, y: s.reduce("SUM", y), args=(x * 10,))
    counter.assign_add(float(ctx.replica_id_in_sync_group + 1))
    return ctx.replica_id_in_sync_group, total, mean, gathered, merged, x


rid, total, mean, gathered, merged, x = strategy.run(replica_fn, args=(dtape.constant(float(rank + 1)),))
seen.update(rid=rid, all_reduce_sum=float(total), all_reduce_mean=float(mean), all_gather=gathered.numpy().tolist(),
            merged=float(merged), reduce_sum=float(strategy.reduce("SUM", x)),
            reduce_mean=float(strategy.reduce("MEAN", x)),
            gather=strategy.gather(dtape.constant([[rank]] * (rank + 1)), axis=0).numpy().ravel().tolist(),
            local_results=len(strategy.experimental_local_results(x)), counter=float(counter.read_value()))

# Input: worker slices of global batches from numpy, tensors, nests and a DataLoader.
global_x = np.arange(10, dtype=np.float32).reshape(5, 2)
seen["numpy_slice"] = [b.numpy().tolist() for b in strategy.experimental_distribute_dataset([global_x])]
seen["nest_slice"] = [{k: t.numpy().tolist() for k, t in b.items()}
                      for b in strategy.experimental_distribute_dataset([{"a": torch.arange(3), "b": np.ones(3)}])]
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(8.0), torch.arange(8)), batch_size=4)
seen["loader_slices"] = [[t.numpy().tolist() for t in b] for b in strategy.experimental_distribute_dataset(loader)]
contexts = []


def dataset_fn(ctx):
    contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.get_per_replica_batch_size(8)))
    return [np.full((4,), ctx.input_pipeline_id)]


seen["from_function"] = [b.numpy().tolist() for b in strategy.distribute_datasets_from_function(dataset_fn)]
seen["input_contexts"] = contexts

# Training: a step on this worker's slice; apply_gradients sums gradients across workers.
xs = torch.linspace(-1, 1, 12).reshape(4, 3)
ys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.5, -0.5]])


def train_step(batch):
    bx, by = batch
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_sum((layer(bx) - by) ** 2) / 4.0
    grads = tape.gradient(loss, layer.trainable_variables)
    opt.apply_gradients(zip(grads, layer.trainable_variables))
    return loss


losses = []
for batch in strategy.experimental_distribute_dataset([(xs, ys), (xs, ys)]):
    losses.append(float(strategy.reduce("SUM", strategy.run(train_step, args=(batch,)))))
seen["losses"] = losses
seen["trained_kernel"] = layer.kernel.numpy().tolist()

# Checkpoints: every rank calls save (rank 0 writes), every rank restores.
path = os.path.join(out, "ckpt")
dtape.checkpoint.save(path, layer=layer, opt=opt, counter=counter, step=3)
seen["ckpt_exists_after_save"] = os.path.exists(path)
trained = layer.kernel.numpy().copy()
with strategy.scope():
    layer.kernel.assign(torch.zeros(3, 2))
    counter.assign(100.0)
data = dtape.checkpoint.restore(path, layer=layer, opt=opt, counter=counter)
seen["restored_equal"] = bool(np.array_equal(layer.kernel.numpy(), trained)) and data["step"] == 3
seen["counter_after_assign_restore"] = float(counter.read_value())
# TF's attributes and guards: no update from the cross-replica context of 2 workers, no per-worker batch mean.
seen["values_from_function"] = strategy.experimental_distribute_values_from_function(
    lambda ctx: [ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync])
seen["should_checkpoint"] = [strategy.extended.should_checkpoint, strategy.extended.should_save_summary]
state = [layer.kernel.numpy().tolist(), int(opt.iterations.numpy())]
with strategy.scope():
    try:
        opt.apply_gradients([(dtape.constant(np.ones((3, 2), np.float32)), layer.kernel)])
    except RuntimeError as e:
        seen["cross_replica_apply"] = str(e)
seen["unchanged_after_cross_replica_apply"] = state == [layer.kernel.numpy().tolist(), int(opt.iterations.numpy())]


def batch_mean_loss():
    try:
        dtape.losses.MeanSquaredError()(ys, layer(xs))
    except ValueError as e:
        return str(e)


seen["batch_mean_loss"] = strategy.run(batch_mean_loss)

# Dropout in a wrapped torch module: each worker (its process's only replica) draws its replica generator's stream.
dropout = dtape.layers.TorchModule(torch.nn.Dropout(0.5))
generator = strategy.replica_generator()
seen["dropout_state"] = generator.get_state().tolist()
torch_state = torch.get_rng_state()
seen["dropout_masks"] = [strategy.run(lambda: dropout(torch.ones(64), training=True)).numpy().tolist()
                         for _ in range(2)]
seen["dropout_after"] = generator.get_state().tolist()
seen["torch_rng_unchanged"] = torch.equal(torch_state, torch.get_rng_state())
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(seen, f)
