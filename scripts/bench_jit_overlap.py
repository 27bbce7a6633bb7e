"""Compiled replica steps under torchrun (gloo): the gradient all-reduce overlapped with the walk, or not.

The MLP step of scripts/bench_multiworker.py (784-1024-1024-10 as dtape.layers.Dense, SGD, global
batch 256) or the charlm step (Adam, 32 sequences), as `dtape.function(step, jit_compile=True)` inside
`strategy.run` of MultiWorkerMirroredStrategy, traced twice: with `traceable_collectives.OVERLAP` on
(the buckets re-made in the walk's order with GradientSync's caps, each launched as soon as the walk has
its gradients, waited for after the walk) and off (one all-reduce per dtype after the walk, where
apply_gradients is called). In one launch the two take turns step by step (the order alternating), each
step between two barriers, on the same weights; times are medians over the steps after warm-up on
rank 0 (wall and this process's CPU time). The first-step losses of the two are checked equal.

  python scripts/bench_jit_overlap.py [--model mlp|charlm] [--steps 40] [--workers 2] [--backend inductor]
                                     [--bucket-cap-mb 25] [--first-bucket-cap-mb 1]

(charlm's 117k weights fit the default first bucket: one all-reduce either way; smaller caps split it.)

Under the hood it re-runs itself with `--worker`.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SIZES = (784, 1024, 1024, 10)
GLOBAL_BATCH = 256
CHARLM_BATCH = 32


def _mlp(dtape, torch, rank, world):
    g = torch.Generator().manual_seed(0)
    layers = [dtape.layers.Dense(n, activation="relu" if i + 2 < len(SIZES) else None, input_dim=m)
              for i, (m, n) in enumerate(zip(SIZES[:-1], SIZES[1:]))]
    for layer in layers:
        layer.kernel.assign(torch.randn(*layer.kernel.shape, generator=g) * layer.kernel.shape[0] ** -0.5)
    per = GLOBAL_BATCH // world
    data = torch.randn(4, GLOBAL_BATCH, SIZES[0], generator=g)[:, rank * per:(rank + 1) * per]
    labels = torch.randint(0, SIZES[-1], (4, GLOBAL_BATCH), generator=g)[:, rank * per:(rank + 1) * per]

    def loss_fn(x, y):
        h = x
        for layer in layers:
            h = layer(h)
        return dtape.reduce_sum(dtape.nn.sparse_softmax_cross_entropy_with_logits(y, h)) / GLOBAL_BATCH
    variables = [v for layer in layers for v in layer.trainable_variables]
    return variables, dtape.optimizers.SGD(0.01), loss_fn, data, labels


def _charlm(dtape, torch, rank, world):
    sys.path.insert(0, HERE)
    from tasks import charlm
    data = charlm.load_data(0)
    per = CHARLM_BATCH // world
    x = torch.as_tensor(data["x_train"][:4 * CHARLM_BATCH]).reshape(4, CHARLM_BATCH, -1)[:, rank * per:(rank + 1) * per]
    y = torch.as_tensor(data["y_train"][:4 * CHARLM_BATCH]).reshape(4, CHARLM_BATCH, -1)[:, rank * per:(rank + 1) * per]
    model = charlm.build_model(0)

    def loss_fn(a, b):
        return dtape.reduce_sum(charlm.per_example_loss(model, a, b)) / CHARLM_BATCH
    return list(model.trainable_variables), dtape.optimizers.Adam(1e-3), loss_fn, x, y


def _worker(model, steps, backend, caps):
    import torch
    import torch.distributed as dist
    import dtape
    from dtape.distribute import traceable_collectives as tc
    dist.init_process_group("gloo")
    tc.OVERLAP_BUCKET_CAP_MB, tc.OVERLAP_FIRST_BUCKET_CAP_MB = caps
    strategy = dtape.distribute.MultiWorkerMirroredStrategy()  # on the existing group
    rank, world = dist.get_rank(), dist.get_world_size()
    with strategy.scope():
        variables, opt, loss_fn, data, labels = (_charlm if model == "charlm" else _mlp)(dtape, torch, rank, world)
        opt.build(variables)

    def replica_step(x, y):
        with dtape.GradientTape() as tape:
            loss = loss_fn(x, y)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss
    cases, compile_s, buckets = {}, {}, {}
    for name, overlap in (("overlap", True), ("after_walk", False)):
        f = dtape.function(replica_step, jit_compile=True, backend=backend)
        tc.OVERLAP = overlap  # read when the step is traced: on its first call, just below
        t0 = time.perf_counter()
        cases[name] = lambda k, f=f: float(strategy.reduce(dtape.distribute.ReduceOp.SUM, strategy.run(
            f, args=(dtape.constant(data[k % 4]), dtape.constant(labels[k % 4]))), axis=None))
        state = [v.torch().clone() for v in variables + opt.variables()]
        first = cases[name](0)
        for v, s in zip(variables + opt.variables(), state):  # both cases start from the same weights
            v.assign(s)
        compile_s[name] = time.perf_counter() - t0
        (concrete,) = [c for cs in f._concrete.values() for c in cs]
        buckets[name] = sum(n.target is torch.ops.dtape.all_reduce_start.default for n in concrete.graph.graph.nodes)
        cases[name + "_first_loss"] = first
    names = ["overlap", "after_walk"]
    times, cpu = {n: [] for n in names}, {n: [] for n in names}
    for k in range(1, steps + 1):
        for name in names[k % 2:] + names[:k % 2]:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            cases[name](k)
            cpu[name].append(time.process_time() - c0)
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    out = {n: {"step_s": statistics.median(times[n][steps // 5:]), "cpu_s": statistics.median(cpu[n][steps // 5:]),
               "first_loss": cases[n + "_first_loss"], "compile_s": compile_s[n], "buckets": buckets[n]}
           for n in names}
    dist.barrier()
    dist.destroy_process_group()
    return out


def measure(model="mlp", steps=40, workers=2, backend="inductor", caps=(25.0, 1.0)):
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={workers}",
               __file__, "--worker", "--model", model, "--steps", str(steps), "--backend", backend,
               "--bucket-cap-mb", str(caps[0]), "--first-bucket-cap-mb", str(caps[1]), "--out", out.name]
        path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // workers)), PYTHONPATH=path)
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, timeout=1800)
        return json.load(open(out.name))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["mlp", "charlm"], default="mlp")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0)
    ap.add_argument("--first-bucket-cap-mb", type=float, default=1.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        res = _worker(args.model, args.steps, args.backend, (args.bucket_cap_mb, args.first_bucket_cap_mb))
        if int(os.environ["RANK"]) == 0:
            json.dump(res, open(args.out, "w"))
        return
    res = measure(args.model, args.steps, args.workers, args.backend, (args.bucket_cap_mb, args.first_bucket_cap_mb))
    on, off = res["overlap"], res["after_walk"]
    assert abs(on["first_loss"] - off["first_loss"]) <= 1e-6 * abs(off["first_loss"]), res
    for name, r in res.items():
        print(f"{args.model} {name:10s}: {r['buckets']} all-reduce(s), step {r['step_s'] * 1e3:.2f} ms "
              f"(cpu {r['cpu_s'] * 1e3:.2f} ms), first call (trace + compile) {r['compile_s']:.1f} s")
    print(f"overlap / after_walk: {on['step_s'] / off['step_s']:.3f} wall, {on['cpu_s'] / off['cpu_s']:.3f} cpu")


if __name__ == "__main__":
    main()
