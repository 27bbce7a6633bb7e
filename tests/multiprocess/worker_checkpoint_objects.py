"""Worker script for test_checkpoint_objects_multi_worker.py: TF's Checkpoint/CheckpointManager idiom under
MultiWorkerMirroredStrategy (2 workers), a model built lazily inside strategy.run and Adam.

Every rank calls manager.save (rank 0 writes and deletes: os.remove is recorded per rank), then a fresh
model and optimizer restore the latest checkpoint and train one step. Writes $OUT/rank<r>.json.
"""
import json
import os
import sys

import torch

import dtape
import dtape.distribute as dd

out = sys.argv[1]
rank = int(os.environ["RANK"])
torch.set_num_threads(1)
strategy = dd.MultiWorkerMirroredStrategy()
removed = []
_remove = os.remove


def recording_remove(path):
    removed.append(os.path.basename(path))
    _remove(path)


os.remove = recording_remove   # the manager deletes through os.remove: which rank deletes is what is checked
xs = torch.linspace(-1.0, 1.0, 24).reshape(8, 3)
ys = torch.sin(torch.arange(8.0)).reshape(8, 1)


def run(folder, steps):
    with strategy.scope():
        model = dtape.layers.Sequential([dtape.layers.Dense(4, "tanh", seed=1), dtape.layers.Dense(1, seed=2)])
        opt = dtape.optimizers.Adam(0.05)
        ckpt = dtape.train.Checkpoint(model=model, optimizer=opt)
        manager = dtape.train.CheckpointManager(ckpt, folder, max_to_keep=1)
        status = ckpt.restore(manager.latest_checkpoint)

    def step(batch):
        bx, by = batch
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum((model(bx) - by) ** 2) / 8.0
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    losses = []
    for batch in strategy.experimental_distribute_dataset([(xs, ys)] * steps):
        losses.append(float(strategy.reduce("SUM", strategy.run(step, args=(batch,)))))
        manager.save()
    if manager.latest_checkpoint != os.path.join(folder, f"ckpt-{steps}"):   # a resumed run
        status.assert_consumed()                                              # every waiting value found its slot
    return losses, sorted(os.listdir(folder)), [v.numpy().tolist() for v in model.variables]


whole = run(os.path.join(out, "whole"), 4)
first = run(os.path.join(out, "cut"), 3)
resumed = run(os.path.join(out, "cut"), 1)
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"whole": whole, "first": first, "resumed": resumed, "removed": removed}, f)
