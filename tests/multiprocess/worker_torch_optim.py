"""Worker script for test_torch_optimizer_multi_worker.py: the small GPT trained through TorchModule and
dtape.optimizers.from_torch(AdamW in two groups, warmup + cosine LambdaLR, global clip 1.0) under
MultiWorkerMirroredStrategy, each worker on its half of every global batch.

Writes $OUT/rank<r>.json: the per-step global losses, a checksum of every weight, and the losses of a
resumed run (a fresh model, optimizer and scheduler restored from the checkpoint saved halfway).
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the shared model

import _gpt  # noqa: E402
import dtape  # noqa: E402
import dtape.distribute as dd  # noqa: E402

out, steps, resume_steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rank = int(os.environ["RANK"])
torch.set_num_threads(1)
strategy = dd.MultiWorkerMirroredStrategy()
data = _gpt.batches(steps)
tokens = _gpt.GLOBAL_BATCH * _gpt.CONTEXT


def setup(seed):
    with strategy.scope():
        tm = dtape.layers.TorchModule(_gpt.seeded_gpt(seed))
    params = tm.parameters() if callable(getattr(tm, "parameters", None)) else [v.torch() for v in
                                                                                 tm.trainable_variables]
    torch_opt, sched = _gpt.make_adamw(list(params), steps)
    return tm, torch_opt, sched, dtape.optimizers.from_torch(torch_opt, global_clipnorm=1.0)


def train(tm, opt, sched, batches, save_at=None):
    variables = tm.trainable_variables

    def step(x, y):
        with dtape.GradientTape(gradient_sync=dd.GradientSync()) as tape:
            loss = F.cross_entropy(tm(x).view(-1, _gpt.VOCAB), y.view(-1), reduction="sum") / tokens
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss
    losses = []
    for k, (x, y) in enumerate(strategy.experimental_distribute_dataset(batches)):
        losses.append(float(strategy.reduce(dd.ReduceOp.SUM, strategy.run(step, args=(x, y)))))
        sched.step()
        if save_at is not None and k + 1 == save_at:   # every rank calls save (a collective); rank 0 writes
            dtape.checkpoint.save(os.path.join(out, "ckpt"), model=tm, optimizer=opt, scheduler=sched)
    return losses


half = steps // 2
tm, torch_opt, sched, opt = setup(0)
losses = train(tm, opt, sched, data, save_at=half)
checksum = [float(v.torch().double().sum()) for v in tm.trainable_variables]

tm2, _, sched2, opt2 = setup(1)   # other initial weights: everything comes from the checkpoint
dtape.checkpoint.restore(os.path.join(out, "ckpt"), model=tm2, optimizer=opt2, scheduler=sched2)
resumed = train(tm2, opt2, sched2, data[half:half + resume_steps])

with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"losses": losses, "checksum": checksum, "resumed": resumed,
               "state_steps": float(torch_opt.state_dict()["state"][0]["step"])}, f)
