"""Worker for test_collectives_multi_worker.py (two torchrun workers, gloo).

Each rank checks, against one-device values computed in the same process:
differentiable all_reduce (SUM, weighted MEAN) and all_gather (unequal sizes);
the flat all-reduce (in place only for buffers given away: scratch);
an epoch of global batches 4, 4, 3, 1 (rank 1's last slice is empty) with
compute_average_loss and strategy.reduce(MEAN, weights=counts), with and
without GradientSync; gradient accumulation with one all-reduce per k.
Prints "RANK r OK" when every check passed.
"""
import numpy as np
import torch

import dtape
import dtape.optimizers
from dtape.distribute import GradientAccumulator, GradientSync, MultiWorkerMirroredStrategy, compute_average_loss

F64 = torch.float64
s = MultiWorkerMirroredStrategy()
rank = s.cluster_resolver.rank


def ctx():
    return dtape.distribute.get_replica_context()


def ex():
    x = dtape.constant(float(rank + 1))
    with dtape.GradientTape() as t:
        t.watch(x); y = ctx().all_reduce("SUM", x) * (rank + 1)
    return t.gradient(y, x)
assert float(s.run(ex)) == 3.0, float(s.run(ex))

def gat():
    x = dtape.constant(np.full((rank + 1, 3), 1.0))
    with dtape.GradientTape() as t:
        t.watch(x); l = dtape.reduce_sum(ctx().all_gather(x, 0) * float(rank + 1))
    return t.gradient(l, x)
g = s.run(gat); assert g.shape == (rank + 1, 3) and np.all(g.numpy() == 3.0), g

def wm():
    x = dtape.constant(float(rank + 1))
    with dtape.GradientTape() as t:
        t.watch(x); y = ctx().all_reduce("MEAN", x, weight=[3.0, 1.0][rank]); l = y * (rank + 1)
    return y, t.gradient(l, x)
y, g = s.run(wm); assert float(y) == 1.25 and abs(float(g) - [2.25, 0.75][rank]) < 1e-12, (float(y), float(g))

def flat(scratch):
    # the flat all-reduce leaves the caller's tensor alone; only a buffer given away (scratch) is reduced in place
    t = torch.full((3,), float(rank + 1))
    (out,) = s.extended._all_reduce_flat_async("SUM", [t], scratch=scratch).wait()
    return out, t
out, t = s.run(flat, args=(False,)); assert out.tolist() == [3.0] * 3 and t.tolist() == [rank + 1.0] * 3, (out, t)
out, t = s.run(flat, args=(True,)); assert out.tolist() == t.tolist() == [3.0] * 3, (out, t)  # reduced in t itself

def model():
    return dtape.layers.Sequential([dtape.layers.Dense(4, "tanh", input_dim=3, seed=1, dtype=F64),
                                    dtape.layers.Dense(1, input_dim=4, seed=2, dtype=F64)])
rng = np.random.default_rng(0)
batches = [(rng.normal(size=(n, 3)), rng.normal(size=(n, 1))) for n in (4, 4, 3, 1)]
ref, opt0 = model(), dtape.optimizers.SGD(0.1)
ref_losses = []
for x, yb in batches:
    with dtape.GradientTape() as t:
        l = dtape.reduce_mean(dtape.reduce_sum((ref(dtape.constant(x)) - dtape.constant(yb)) ** 2, axis=1))
    opt0.apply_gradients(zip(t.gradient(l, ref.trainable_variables), ref.trainable_variables))
    ref_losses.append(float(l))
calls = []
orig = s.extended._all_reduce_flat_async


def counting(op, tensors, **kw):
    calls.append(len(tensors))
    return orig(op, tensors, **kw)


s.extended._all_reduce_flat_async = counting
for sync in (None, GradientSync(1e-9)):
    with s.scope():
        m, opt = model(), dtape.optimizers.SGD(0.1)
    def step(x, yb):
        with dtape.GradientTape(gradient_sync=sync) as t:
            per = dtape.reduce_sum((m(x) - yb) ** 2, axis=1); l = compute_average_loss(per)
        opt.apply_gradients(zip(t.gradient(l, m.trainable_variables), m.trainable_variables))
        return dtape.reduce_mean(per), dtape.constant(float(x.shape[0]))
    n0, losses = len(calls), []
    for x, yb in s.experimental_distribute_dataset(batches):
        mean, cnt = s.run(step, args=(x, yb))
        losses.append(float(s.reduce("MEAN", mean, weights=cnt)))
    for v, w in zip(m.trainable_variables, ref.trainable_variables):
        np.testing.assert_allclose(v.numpy(), w.numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-12)
    print(f"rank {rank} sync={sync is not None} flat launches {len(calls) - n0}", flush=True)
# accumulation
with s.scope():
    m, opt = model(), dtape.optimizers.SGD(0.1)
acc = GradientAccumulator(); data = [(rng.normal(size=(4, 3)), rng.normal(size=(4, 1))) for _ in range(3)]
def micro(x, yb):
    with dtape.GradientTape() as t:
        l = compute_average_loss(dtape.reduce_sum((m(x) - yb) ** 2, axis=1), global_batch_size=12)
    acc.accumulate(zip(t.gradient(l, m.trainable_variables), m.trainable_variables))
n0 = len(calls)
for x, yb in s.experimental_distribute_dataset(data):
    s.run(micro, args=(x, yb))
assert len(calls) == n0
s.run(lambda: opt.apply_gradients(acc.grads_and_vars()))
assert len(calls) == n0 + 1
ref2, o2 = model(), dtape.optimizers.SGD(0.1)
X = np.concatenate([d[0] for d in data]); Y = np.concatenate([d[1] for d in data])
with dtape.GradientTape() as t:
    l = dtape.reduce_mean(dtape.reduce_sum((ref2(dtape.constant(X)) - dtape.constant(Y)) ** 2, axis=1))
o2.apply_gradients(zip(t.gradient(l, ref2.trainable_variables), ref2.trainable_variables))
for v, w in zip(m.trainable_variables, ref2.trainable_variables):
    np.testing.assert_allclose(v.numpy(), w.numpy(), rtol=1e-12, atol=1e-14)
print(f"RANK {rank} OK", flush=True)
