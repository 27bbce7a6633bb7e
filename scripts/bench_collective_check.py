"""The cost of the collective signature check (MultiWorkerMirroredStrategy), on 2 torchrun workers (gloo).

Every collective dtape issues across workers first exchanges a signature (a
fixed-size float64 all-gather) and launches its payload only when every
worker's matches (`dtape.distribute.collective_ops`); a step's gradient
buckets are checked together by the first one's exchange. This measures, inside
one launch and under the same machine load, the same work with the check on
and off, the two taking turns bench_multiworker.BLOCK steps at a time (a loop's
consecutive steps: from its third step a step's loss reduction announces the
next step's first bucket):

  * one-element `strategy.reduce` calls (the per-collective cost: one extra
    small round trip);
  * bench_multiworker.py's MLP step (784-1024-1024-10, SGD, global batch
    256) with GradientSync at its default buckets (the all-reduce overlapped
    with the walk: 2 buckets per step), plus the step's loss reduction;
  * an all-reduce-heavy step: a 24-layer MLP 128 wide with 0.1 MB buckets
    (12 bucket all-reduces per step, each launched from the walk).

Times are medians on rank 0 of wall times between two barriers, after
warm-up. The check is switched per case through `communicator.check`
(identically on both workers); users turn it off only with
DTAPE_CHECK_COLLECTIVES=0 on every worker.

  python scripts/bench_collective_check.py [--steps 40] [--json PATH]

(`scripts/bench.py` runs it as its case (j).)
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
sys.path.insert(0, HERE)
import bench_multiworker as mw  # noqa: E402


def _mlp_step(strategy, rank, world, bucket_cap_mb, sizes=mw.SIZES):
    """step(k): one step of an MLP of `sizes` (784 in, 10 out) with GradientSync(bucket_cap_mb), and the loss
    reduced across workers."""
    import torch
    import dtape
    _, data, labels = mw._init(torch)
    with strategy.scope():
        layers = [dtape.layers.Dense(n, activation="relu" if i + 2 < len(sizes) else None, input_dim=m, seed=i)
                  for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:]))]
        opt = dtape.optimizers.SGD(0.01)
    variables = [v for layer in layers for v in layer.trainable_variables]
    part = mw._slice(rank, world, mw.GLOBAL_BATCH)
    sync = dtape.distribute.GradientSync(bucket_cap_mb=bucket_cap_mb, first_bucket_cap_mb=min(1.0, bucket_cap_mb))

    def replica_step(x, y):
        with dtape.GradientTape(gradient_sync=sync) as tape:
            h = x
            for layer in layers:
                h = layer(h)
            loss = dtape.reduce_sum(dtape.nn.sparse_softmax_cross_entropy_with_logits(y, h)) / mw.GLOBAL_BATCH
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    def step(k):
        x, y = dtape.constant(data[k % 4, part]), dtape.constant(labels[k % 4, part])
        return float(strategy.reduce("SUM", strategy.run(replica_step, args=(x, y))).torch())
    return step


def _reduces(strategy, n=20):
    """step(k): n one-element strategy.reduce calls."""
    import dtape
    one = dtape.constant([1.0])

    def step(k):
        for _ in range(n):
            strategy.reduce("SUM", one)
    return step


def _worker(steps):
    import torch.distributed as dist
    import dtape
    dist.init_process_group("gloo")
    strategy = dtape.distribute.MultiWorkerMirroredStrategy(seed=0)  # on the existing group
    comm = strategy.communicator
    rank, world = dist.get_rank(), dist.get_world_size()
    work = {"20 one-element reduces": _reduces(strategy),
            "MLP step, GradientSync default buckets": _mlp_step(strategy, rank, world, 25.0),
            "24-layer MLP step, 0.1 MB buckets": _mlp_step(strategy, rank, world, 0.1, (784,) + (128,) * 23 + (10,))}
    cases = [(name, check) for name in work for check in (True, False)]
    times = {c: [] for c in cases}
    launches, exchanges = {}, {}
    for k in range(0, steps, mw.BLOCK):   # each case mw.BLOCK consecutive steps (a loop's repeating collectives)
        b = k // mw.BLOCK
        for name, check in cases[b % len(cases):] + cases[:b % len(cases)]:  # rotate: none always first
            comm.check = check   # the same on both workers, at the same point: they never disagree
            for j in range(k, min(k + mw.BLOCK, steps)):
                dist.barrier()
                before, checks, t0 = comm._seq, getattr(comm, "exchanges", 0), time.perf_counter()
                work[name](j)
                dist.barrier()
                times[(name, check)].append(time.perf_counter() - t0)
                launches[name] = comm._seq - before
                if check:
                    exchanges[name] = getattr(comm, "exchanges", 0) - checks
    comm.check = True
    out = {name: {"on_s": statistics.median(times[(name, True)][steps // 5:]),
                  "off_s": statistics.median(times[(name, False)][steps // 5:]),
                  "collectives_per_step": launches[name], "checks_per_step": exchanges[name]} for name in work}
    dist.barrier()
    dist.destroy_process_group()
    return out


def measure(steps=40):
    """{case: {"on_s", "off_s", "collectives_per_step", "checks_per_step"}} from one 2-worker launch (checks:
    signature exchanges with the check on)."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
               "--worker", "--steps", str(steps), "--out", out.name]
        path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // 2)), PYTHONPATH=path)
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, timeout=900)
        return json.load(open(out.name))


def print_table(res):
    print(f"{'case (2 torchrun workers, gloo)':42s} {'check on':>10s} {'off':>10s} {'on/off':>7s} {'colls':>6s} "
          f"{'checks':>6s}")
    for name, r in res.items():
        print(f"{name:42s} {r['on_s'] * 1e3:8.2f}ms {r['off_s'] * 1e3:8.2f}ms {r['on_s'] / r['off_s']:7.2f} "
              f"{r['collectives_per_step']:6d} {r['checks_per_step']:6d}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        result = _worker(args.steps)
        if int(os.environ.get("RANK", "0")) == 0:
            with open(args.out, "w") as f:
                json.dump(result, f)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)   # as bench_multiworker.py: interpreter teardown after gloo sometimes aborts
    if args.steps < 5:
        ap.error("--steps must be at least 5")
    print(f"load average at start {os.getloadavg()}")
    res = measure(args.steps)
    print_table(res)
    print(f"load average at end {os.getloadavg()}")
    if args.json:
        json.dump({"results": res, "loadavg": os.getloadavg()}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
