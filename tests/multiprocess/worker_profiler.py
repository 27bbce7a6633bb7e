"""Worker script for test_profiler_multi_worker.py: one training step (tape.gradient with GradientSync buckets,
apply_gradients) under MultiWorkerMirroredStrategy inside a default torch.profiler.profile().

Writes $OUT/rank<r>.json: each range's thread ids, the thread ids of the forward's matmul and of a marker
range opened on the main thread, and the step's weights.
"""
import json
import os
import sys
import warnings

import numpy as np
import torch
from torch import nn

import dtape
import dtape.distribute as dd

out = sys.argv[1]
rank = int(os.environ["RANK"])
torch.set_num_threads(1)
strategy = dd.MultiWorkerMirroredStrategy()
with strategy.scope():
    torch.manual_seed(0)
    net = dtape.layers.TorchModule(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)))
    opt = dtape.optimizers.SGD(0.1)
sync = dd.GradientSync(bucket_cap_mb=1e-9, first_bucket_cap_mb=1e-9)  # one bucket per variable: 4
x = dtape.constant(np.random.default_rng(rank).standard_normal((5, 4)).astype(np.float32))


def step():
    with dtape.GradientTape(gradient_sync=sync) as tape:
        loss = dtape.reduce_sum(net(x) ** 2)
    opt.apply_gradients(zip(tape.gradient(loss, net.trainable_variables), net.trainable_variables))
    return loss


strategy.run(step)  # a first step outside the profile: the one-time setup is not in the counts
with warnings.catch_warnings():
    warnings.simplefilter("error")  # no warning: the replica is this very thread
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("test.main"):
            pass
        strategy.run(step)
names = ("test.main", "aten::addmm", "dtape.gradient", "dtape.all_reduce", "dtape.apply_gradients")
threads = {n: sorted(e.thread for e in prof.events() if e.name == n) for n in names}
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"threads": threads, "weights": [v.numpy().tolist() for v in net.trainable_variables]}, f)
