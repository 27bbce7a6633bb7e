"""Worker script for test_faults.py: rank 1 leaves with sys.exit() as $DTAPE_TEST_EXIT says; rank 0 carries on.

  in_run:      rank 1 calls sys.exit(3) inside strategy.run in step 2, before the step's one-element all-reduce.
  outside_run: rank 1 calls sys.exit(0) after step 1's strategy.run, before the one-element strategy.reduce
               that follows it on every worker (outside strategy.run).
Every step prints the value of its one-element reductions: 1 + 2 = 3 (step s: 3 * s); a value from a
reduction paired with something else (the exiting worker's barrier gives 0) would print another number.
"""
import os
import sys

import torch

import dtape.distribute as dd

MODE = os.environ["DTAPE_TEST_EXIT"]
rank = int(os.environ["RANK"])
strategy = dd.MultiWorkerMirroredStrategy(seed=0)


def replica_step(step_no):
    if step_no == 2 and rank == 1 and MODE == "in_run":
        sys.exit(3)
    value = torch.tensor([float(rank + 1) * step_no])
    return dd.get_replica_context().all_reduce("SUM", value)


for step_no in range(1, 4):
    inside = strategy.run(replica_step, args=(step_no,))
    print(f"rank {rank}: step {step_no} in-run sum {float(inside[0])}", flush=True)
    if step_no == 1 and rank == 1 and MODE == "outside_run":
        sys.exit(0)
    outside = strategy.reduce("SUM", inside)
    print(f"rank {rank}: step {step_no} reduce {float(outside[0])}", flush=True)
print(f"rank {rank}: done", flush=True)
