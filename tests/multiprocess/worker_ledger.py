"""Worker script for test_collective_ledger.py: collectives that the workers enter differently (2 torchrun
workers, gloo) must raise on every worker, naming each worker's call, and never hand out a wrong value.

argv: out_dir, mode.
  "scenarios": one fresh MultiWorkerMirroredStrategy per scenario (the process group outlives a mismatch:
    nothing but the signatures was exchanged), in sequence:
      save_then_reduce: rank 0 alone calls checkpoint.save, then both call strategy.reduce;
      save_then_step:   rank 0 alone calls checkpoint.save, then both run a training step (apply_gradients);
      shapes, dtypes:   strategy.reduce of a [2] vs a [3000] value; of float32 vs float64;
      order:            rank 0 calls strategy.reduce while rank 1 calls strategy.gather;
      fine:             both reduce (the value every scenario would give when paired right: 1 + 2).
      announced_*:      a checked all-reduce announces two 5-element ones (which then skip their own check);
        announced_fine: both launch the announced ones;
        announced_then_large / announced_then_small: rank 1 enters a strategy.reduce of a [3000] (a scalar)
          value instead of the second announced one, which rank 0 is already inside;
        announced_both_leave: both enter a strategy.reduce between the announced ones (legitimate).
      predicted_*:      rounds of a strategy.reduce then a flagged all-reduce (a loss, then the next step's
        gradient bucket), which the reduction announces from the third round on;
        predicted_fine: 4 rounds; predicted_both_leave: 7 rounds, in the 4th both reduce something else before
        the bucket (the announced one); predicted_one_leaves: in the 4th rank 1 alone reduces a [3000] value;
        predicted_steps: the same through GradientSync training steps and their loss reductions.
      walk_one, walk_both: a training step with GradientSync (one bucket per variable: the first announces the
        other two) whose backward walk issues a collective between buckets (the gradient of a
        ReplicaContext.all_reduce made by both) on rank 1 only / on both (then: the variables, then those of the
        same step without GradientSync).
      sources_same, sources_swapped(_one_bucket): a GradientSync step with two same-shaped variables, passed to
        tape.gradient in the same order / in another order on rank 1 (two buckets, one).
      same_name_same, same_name_swapped, unnamed_swapped_one_bucket: the same with two variables of one name
        ("w"; unnamed: "Variable" on every worker), in one order / swapped on rank 1.
    Writes $OUT/rank<r>.json: {scenario: {"value": ...} or {"error": "Type: message"}}.
  "save_then_exit": rank 0 alone calls checkpoint.save while rank 1 leaves the program.
"""
import json
import os
import sys

import torch

import dtape
import dtape.checkpoint
import dtape.distribute as dd

out, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
results = {}


def rank0_saves(strategy, v=None):
    if v is None:
        with strategy.scope():
            v = dtape.Variable([1.0, 2.0])
    if rank == 0:   # the DDP habit: save on rank 0 only
        dtape.checkpoint.save(os.path.join(out, "ckpt"), v=v)
    return v


def save_then_reduce(strategy):
    rank0_saves(strategy)
    return strategy.reduce("SUM", dtape.constant(float(rank + 1)))


def save_then_step(strategy):
    v = rank0_saves(strategy)
    opt = dtape.optimizers.SGD(0.5)

    def step():
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(v * float(rank + 1))
        opt.apply_gradients(zip(tape.gradient(loss, [v]), [v]))
    strategy.run(step)
    return v.read_value()


def shapes(strategy):
    # a small reduction travels with its signature, a large one after it: the messages still pair
    return strategy.reduce("SUM", dtape.ones([[2, 3000][rank]]))


def dtypes(strategy):
    return strategy.reduce("SUM", dtape.ones([2], dtype=["float32", "float64"][rank]))


def order(strategy):
    x = dtape.constant([float(rank + 1)])
    return strategy.reduce("SUM", x) if rank == 0 else strategy.gather(x, 0)


def fine(strategy):
    return strategy.reduce("SUM", dtape.constant(float(rank + 1)))


def _bucket(n):
    """A GradientSync-like buffer: values rank + 1, then a presence flag 1 last."""
    t = torch.full((n,), float(rank + 1))
    t[-1] = 1.0
    return t


def _announced(strategy, between=None):
    comm = strategy.communicator
    first = comm.all_reduce_async(_bucket(4), announce=[(torch.float32, 5), (torch.float32, 5)])
    second = comm.all_reduce_async(_bucket(5), announced=True)
    other = between() if between is not None else None
    third = comm.all_reduce_async(_bucket(5), announced=True)
    sums = [x for p in (first, second, third) for x in p.wait().tolist()]   # one flat list
    return sums if other is None else sums + [float(dtape.convert_to_tensor(other).numpy())]


def announced_fine(strategy):
    return _announced(strategy)


def announced_then_large(strategy):
    return _announced(strategy, (lambda: strategy.reduce("SUM", dtape.ones([3000]))) if rank == 1 else None)


def announced_then_small(strategy):
    return _announced(strategy, (lambda: strategy.reduce("SUM", dtape.constant(1.0))) if rank == 1 else None)


def announced_both_leave(strategy):
    return _announced(strategy, lambda: strategy.reduce("SUM", dtape.constant(float(rank + 1))))


def _predicted(strategy, other=None, at=3, steps=4):
    """`steps` rounds of a checked strategy.reduce then a flagged bucket (a training step's loss reduction, then
    the next step's gradient bucket): from the third round the reduction announces the bucket, which then skips
    its check. Round `at` (from 0) runs `other` (if given) before its bucket, on the ranks it returns a value for.
    Returns [exchanges per round, then each round's values]."""
    comm = strategy.communicator
    rounds, values = [], []
    for k in range(steps):
        before = comm.exchanges
        values.append(float(strategy.reduce("SUM", dtape.constant(float(rank + 1))).numpy()))
        if k == at and other is not None:
            values.append(float(dtape.convert_to_tensor(other()).numpy().sum()))
        values += comm.all_reduce_async(_bucket(5), flagged=True).wait().tolist()
        rounds.append(comm.exchanges - before)
    return rounds + values


def predicted_fine(strategy):
    return _predicted(strategy)


def predicted_both_leave(strategy):     # both reduce something else where the bucket was announced, then go on
    return _predicted(strategy, lambda: strategy.reduce("SUM", dtape.constant(float(rank + 1))), steps=7)


def predicted_one_leaves(strategy):     # rank 1 alone reduces a [3000] value where rank 0 is in the bucket
    return _predicted(strategy, (lambda: strategy.reduce("SUM", dtape.ones([3000]))) if rank == 1 else None)


def predicted_steps(strategy):
    """7 SGD(1.0) steps with GradientSync (one bucket), each followed by its loss reduction (the loss announces
    the next step's bucket once learned); both workers reduce something else before step 5's bucket (where the
    bucket was announced). Returns [exchanges per step (the other reduction's in step 5's), the other
    reduction's value, the variables]."""
    comm = strategy.communicator
    with strategy.scope():
        vs = [dtape.Variable([0.0, 0.0], name="v0"), dtape.Variable([0.0, 0.0], name="v1")]
    opt, sync = dtape.optimizers.SGD(1.0), dd.GradientSync(order="reverse")

    def step():
        with dtape.GradientTape(gradient_sync=sync) as tape:
            loss = (rank + 1) * dtape.reduce_sum(vs[0]) + 10 * (rank + 1) * dtape.reduce_sum(vs[1])
        opt.apply_gradients(zip(tape.gradient(loss, vs), vs))
        return loss
    rounds, other = [], None
    for k in range(7):
        before = comm.exchanges
        if k == 4:
            other = float(strategy.reduce("SUM", dtape.constant(float(rank + 1))).numpy())
        strategy.reduce("SUM", strategy.run(step))
        rounds.append(comm.exchanges - before)
    return rounds + [other] + [x for v in vs for x in v.numpy().tolist()]


def _walk_step(strategy, in_walk, sync):
    with strategy.scope():
        vs = [dtape.Variable([1.0, 2.0]), dtape.Variable([3.0]), dtape.Variable([4.0, 5.0, 6.0])]
    opt = dtape.optimizers.SGD(1.0)

    def step():
        with dtape.GradientTape(gradient_sync=sync) as tape:
            a = dd.get_replica_context().all_reduce("SUM", dtape.reduce_sum(vs[0] * float(rank + 1)))
            if not in_walk:   # the loss without `a`: the walk issues no collective for its gradient
                a = dtape.constant(9.0)
            loss = dtape.reduce_sum(vs[2]) * dtape.reduce_sum(vs[1] * a)
        opt.apply_gradients(zip(tape.gradient(loss, vs), vs))
    strategy.run(step)
    return [x for v in vs for x in v.numpy().tolist()]


def _walk_sync():
    return dd.GradientSync(bucket_cap_mb=1e-9, first_bucket_cap_mb=1e-9, order="reverse")


def walk_one(strategy):
    return _walk_step(strategy, rank == 1, _walk_sync())


def walk_both(strategy):
    return _walk_step(strategy, True, _walk_sync()) + _walk_step(strategy, True, None)


def _ordered_sources(strategy, swap, cap_mb, names=("v0", "v1")):
    """One SGD(1.0) step with GradientSync; rank r's loss is (r + 1) * sum(v0) + 10 * (r + 1) * sum(v1) (same
    shapes; named `names`); rank 1 passes tape.gradient [v1, v0] when `swap`. Returns the variables."""
    with strategy.scope():
        vs = [dtape.Variable([0.0, 0.0], name=names[0]), dtape.Variable([0.0, 0.0], name=names[1])]
    opt = dtape.optimizers.SGD(1.0)

    def step():
        with dtape.GradientTape(gradient_sync=dd.GradientSync(cap_mb, first_bucket_cap_mb=cap_mb)) as tape:
            loss = (rank + 1) * dtape.reduce_sum(vs[0]) + 10 * (rank + 1) * dtape.reduce_sum(vs[1])
        sources = vs[::-1] if swap and rank == 1 else vs
        opt.apply_gradients(zip(tape.gradient(loss, sources), sources))
    strategy.run(step)
    return [x for v in vs for x in v.numpy().tolist()]


def sources_same(strategy):
    return _ordered_sources(strategy, False, 1e-9) + _ordered_sources(strategy, False, 25.0)


def sources_swapped(strategy):       # one bucket per variable: the first announces the second
    return _ordered_sources(strategy, True, 1e-9)


def sources_swapped_one_bucket(strategy):
    return _ordered_sources(strategy, True, 25.0)


def same_name_same(strategy):         # two variables named "w", in one order on both: no false alarm
    return _ordered_sources(strategy, False, 1e-9, ("w", "w"))


def same_name_swapped(strategy):      # ... in another order on rank 1: names and shapes alike, creation order not
    return _ordered_sources(strategy, True, 1e-9, ("w", "w"))


def unnamed_swapped_one_bucket(strategy):  # both unnamed ("Variable" on every worker), one bucket
    return _ordered_sources(strategy, True, 25.0, (None, None))


def attempt(fn, strategy=None, *args):
    strategy = strategy or dd.MultiWorkerMirroredStrategy(seed=0)
    try:
        results[fn.__name__] = {"value": dtape.convert_to_tensor(fn(strategy, *args)).numpy().tolist()}
    except Exception as e:  # noqa: BLE001 - the test reads the message
        results[fn.__name__] = {"error": f"{type(e).__name__}: {e}"}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if mode == "scenarios":
    for scenario in (save_then_reduce, save_then_step, shapes, dtypes, order, fine, announced_fine,
                     announced_then_large, announced_then_small, announced_both_leave, predicted_fine,
                     predicted_both_leave, predicted_one_leaves, predicted_steps, walk_one, walk_both,
                     sources_same, sources_swapped, sources_swapped_one_bucket, same_name_same, same_name_swapped,
                     unnamed_swapped_one_bucket):
        attempt(scenario)
    # the last scenarios fail their group's collectives on purpose: a healthy last communicator lets the exit
    # leave together and destroy the group (a failed one is left to teardown, where gloo's threads can abort)
    closing = dd.MultiWorkerMirroredStrategy(seed=0)
    assert float(closing.reduce("SUM", closing.run(lambda: dtape.constant(1.0))).numpy()) == 2.0
else:
    strategy = dd.MultiWorkerMirroredStrategy(seed=0)
    with strategy.scope():
        variable = dtape.Variable([1.0, 2.0])
    if rank == 0:
        attempt(rank0_saves, strategy, variable)
print(f"rank {rank}: done", flush=True)
