"""Worker script for test_data_check_multi_worker.py: experimental_distribute_dataset's check that every
worker holds the same global batches, under MultiWorkerMirroredStrategy (2 torchrun workers, gloo).

argv: out_dir, mode. Modes: "same" (one identically seeded shuffled DataLoader: trains 2 epochs, and
times the check), "sampler" (the DDP loader kept with its DistributedSampler), "seeds" (shuffle seeded
with the rank). Writes $OUT/rank<r>.json: the losses, or the ValueError's message.
"""
import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import dtape
import dtape.distribute as dd
from dtape.distribute import input_lib

out, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
torch.set_num_threads(1)
strategy = dd.MultiWorkerMirroredStrategy(seed=3)
data = TensorDataset(torch.linspace(-1, 1, 64 * 3).reshape(64, 3), torch.arange(64, dtype=torch.float32)[:, None])
if mode == "same":
    loader = DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5))
elif mode == "sampler":
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=2, rank=rank, seed=5))
else:
    loader = DataLoader(data, batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(100 + rank))

with strategy.scope():
    layer = dtape.layers.Dense(1, input_dim=3)
    opt = dtape.optimizers.SGD(0.01)


def step(batch):
    x, y = batch
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_sum((layer(x) - y) ** 2) / 16.0
    grads = tape.gradient(loss, layer.trainable_variables)
    opt.apply_gradients(zip(grads, layer.trainable_variables))
    return loss


seen = {"rank": rank}
try:
    losses = []
    for epoch in range(2):
        for batch in strategy.experimental_distribute_dataset(loader):
            losses.append(float(strategy.reduce("SUM", strategy.run(step, args=(batch,)))))
    seen["losses"] = losses
    if mode == "same":   # the check's cost: fingerprint + one all-gather, per epoch
        first = next(iter(loader))
        comm = strategy.communicator
        for _ in range(5):
            input_lib.check_same_global_batch(comm, first, loader)
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            input_lib.check_same_global_batch(comm, first, loader)
        seen["check_us"] = (time.perf_counter() - t0) / n * 1e6
        t0 = time.perf_counter()
        for _ in range(n):
            input_lib.batch_fingerprint(first)
        seen["fingerprint_us"] = (time.perf_counter() - t0) / n * 1e6
except ValueError as e:
    seen["error"] = str(e)
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(seen, f)
