"""Worker script for test_faults.py: a small training loop where rank 1 fails as $DTAPE_TEST_FAULT says.

Faults (all on rank 1, in step 2):
  before_collective: raises ValueError in the replica function before its all_reduce.
  merge_fn:          raises KeyError inside a merge_fn (rank 0's merge_fn is in a reduction).
  grad_allreduce:    raises ArithmeticError inside the gradient all-reduce of apply_gradients.
  sigkill:           kills itself with SIGKILL before apply_gradients (1 s into the step).
  hang:              sleeps 60 s before apply_gradients (rank 0 must time out naming rank 1).
Rank 0 is left blocked in a collective; it must fail within the timeout naming rank 1.
"""
import os
import signal
import time

import torch

import dtape
import dtape.distribute as dd
import dtape.optimizers

FAULT = os.environ["DTAPE_TEST_FAULT"]
rank = int(os.environ["RANK"])
strategy = dd.MultiWorkerMirroredStrategy(seed=0)
with strategy.scope():
    layer = dtape.layers.Dense(4, input_dim=8, seed=0)
    opt = dtape.optimizers.SGD(0.1)
failing = rank == 1
step_no = 0

if failing and FAULT == "grad_allreduce":
    comm = strategy.communicator
    real_all_reduce = comm.all_reduce

    def all_reduce(t, op="sum", **kw):
        if step_no == 2 and t.numel() > 1:
            raise ArithmeticError("injected in the gradient all-reduce")
        return real_all_reduce(t, op, **kw)
    real_all_reduce_async = comm.all_reduce_async

    def all_reduce_async(t, **kw):  # apply_gradients' bucketed all-reduce
        if step_no == 2 and t.numel() > 1:
            raise ArithmeticError("injected in the gradient all-reduce")
        return real_all_reduce_async(t, **kw)
    comm.all_reduce = all_reduce
    comm.all_reduce_async = all_reduce_async


def bad_merge(strategy, value):
    if failing:
        raise KeyError("injected in merge_fn")
    return strategy.reduce("SUM", value)


def replica_step(x):
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_mean(layer(x) ** 2)
    if step_no == 2 and failing and FAULT == "before_collective":
        raise ValueError("injected before a collective")
    if step_no == 2 and FAULT == "merge_fn":
        dd.get_replica_context().merge_call(bad_merge, args=(loss,))
    grads = tape.gradient(loss, layer.trainable_variables)
    if step_no == 2 and failing and FAULT == "sigkill":
        time.sleep(1.0)   # rank 0 is surely blocked in the gradient all-reduce by now, even on a loaded machine
        os.kill(os.getpid(), signal.SIGKILL)
    if step_no == 2 and failing and FAULT == "hang":
        time.sleep(60)
    opt.apply_gradients(zip(grads, layer.trainable_variables))
    return dd.get_replica_context().all_reduce("SUM", loss)


for step_no in range(1, 5):
    batch = torch.ones(4, 8) * step_no
    for local in strategy.experimental_distribute_dataset([batch]):
        strategy.run(replica_step, args=(local,))
    print(f"rank {rank}: step {step_no} done", flush=True)
