"""Worker script for test_break_s5_multi_worker.py (2 torchrun workers, gloo): predicted gradient buckets
(a step's loss reduction announces the next step's bucket once it followed twice) attacked with layouts that
change between steps.

argv: out_dir. Scenarios, each on a fresh MultiWorkerMirroredStrategy:
  alternating: 10 SGD(1.0) steps with GradientSync, the sources [v0] ("A") or [v0, v1] ("B") in the pattern
    AABBAABAAB on both workers, each step followed by its loss reduction; returns the variables and the losses.
  other_sources: 5 steps of [v0]; in the 5th (where the bucket is predicted) rank 1 passes [v1], of the same
    shape, dtype and name count: its gradients must never be summed with rank 0's v0 gradients ("updates":
    the variables after each step's update, recorded before a later collective could notice).
Writes $OUT/rank<r>.json: {scenario: {"value": ...} or {"error": "Type: message"}}.
"""
import json
import os
import sys

import dtape
import dtape.distribute as dd

out = sys.argv[1]
rank = int(os.environ["RANK"])
results = {}
updates = []  # the variables after each step's apply_gradients, before any later collective could object


def _steps(strategy, pattern):
    with strategy.scope():
        vs = [dtape.Variable([0.0, 0.0], name="v0"), dtape.Variable([0.0, 0.0], name="v1")]
    opt, sync = dtape.optimizers.SGD(1.0), dd.GradientSync()
    losses = []

    def step(sources):
        with dtape.GradientTape(gradient_sync=sync) as tape:
            loss = (rank + 1) * dtape.reduce_sum(vs[0]) + 10 * (rank + 1) * dtape.reduce_sum(vs[1])
        opt.apply_gradients(zip(tape.gradient(loss, sources), sources))
        updates.append([x for v in vs for x in v.numpy().tolist()])
        return loss
    for k, layout in enumerate(pattern):
        sources = {"A": [vs[0]], "B": vs, "C": [vs[1]]}[layout]
        losses.append(float(strategy.reduce("SUM", strategy.run(step, args=(sources,))).numpy()))
    return [x for v in vs for x in v.numpy().tolist()] + losses


def alternating(strategy):
    return _steps(strategy, "AABBAABAAB")


def other_sources(strategy):
    updates.clear()
    return _steps(strategy, "AAAAC" if rank == 1 else "AAAAA")


for scenario in (alternating, other_sources):
    try:
        results[scenario.__name__] = {"value": scenario(dd.MultiWorkerMirroredStrategy(seed=0))}
    except Exception as e:  # noqa: BLE001 - the test reads the message
        results[scenario.__name__] = {"error": f"{type(e).__name__}: {e}"}
    results[scenario.__name__]["updates"] = list(updates)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
# other_sources fails its group's collectives on purpose: a healthy last communicator lets the exit leave
# together and destroy the group (a failed one is left to teardown, where gloo's threads can abort the process)
closing = dd.MultiWorkerMirroredStrategy(seed=0)
assert float(closing.reduce("SUM", closing.run(lambda: dtape.constant(1.0))).numpy()) == 2.0
print(f"rank {rank}: done", flush=True)
