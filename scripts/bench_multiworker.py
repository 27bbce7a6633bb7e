"""dtape's MultiWorkerMirroredStrategy against torch DistributedDataParallel, under torchrun (gloo).

One MLP training step (784-1024-1024-10, SGD, global batch 256), and the
charlm step (the 2-layer transformer of scripts/tasks/charlm.py, Adam, 32
sequences; DDP runs the same transformer as a torch.nn.Module), with the
same initial weights and the same global batches: each of W workers takes
its slice of every global batch, dtape sums the per-worker gradients of a
loss divided by the global batch size (TF semantics), DDP averages the
gradients of per-worker mean losses; both give the one-device update. The
first-step losses are checked equal. Times are medians of per-step wall
times on rank 0 after warm-up, each step ending with a barrier.

  python scripts/bench_multiworker.py [--steps 30] [--json PATH]

runs `torchrun --standalone --nproc-per-node W` for W = 1 and 2, for dtape
(with and without GradientSync, the all-reduce overlapped with the walk)
and for DDP, and prints dtape/DDP at 2 workers, 2 workers / 1 worker, and
the share of the all-reduce hidden behind the walk: 1 - (extra time
apply_gradients spends at 2 workers with GradientSync) / (the same without).
It also prints rank 0's phase times per step (medians): dtape's forward,
gradient walk and apply_gradients (all-reduce wait + update), DDP's
forward, backward (with its all-reduce) and optimizer.step.
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

SIZES = (784, 1024, 1024, 10)
GLOBAL_BATCH = 256
CHARLM_BATCH = 32  # sequences of 64 characters per global batch (charlm's default batch size)
HERE = os.path.dirname(os.path.abspath(__file__))


def _init(torch):
    g = torch.Generator().manual_seed(0)
    params = []
    for fan_in, fan_out in zip(SIZES[:-1], SIZES[1:]):
        params += [torch.randn(fan_in, fan_out, generator=g) * fan_in ** -0.5, torch.zeros(fan_out)]
    data = torch.randn(4, GLOBAL_BATCH, SIZES[0], generator=g)
    labels = torch.randint(0, SIZES[-1], (4, GLOBAL_BATCH), generator=g)
    return params, data, labels


def _slice(rank, world):
    per = GLOBAL_BATCH // world
    return slice(rank * per, (rank + 1) * per)


def _ddp_worker(steps, lr):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    params, data, labels = _init(torch)
    layers = []
    for i in range(0, len(params), 2):
        lin = torch.nn.Linear(SIZES[i // 2], SIZES[i // 2 + 1])
        with torch.no_grad():
            lin.weight.copy_(params[i].T)
            lin.bias.copy_(params[i + 1])
        layers += [lin, torch.nn.ReLU()]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers[:-1]))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    part = _slice(rank, world)
    return _ddp_time(model, opt, lambda k: F.cross_entropy(model(data[k % 4, part]), labels[k % 4, part]),
                     steps, dist, world)


def _ddp_time(model, opt, loss_fn, steps, dist, world):
    """DDP steps timed by phase: forward, backward (with the bucketed all-reduce), optimizer step."""
    phases = _Phases("forward", "backward", "optimizer")

    def step(k):
        opt.zero_grad(set_to_none=True)
        with phases("forward"):
            loss = loss_fn(k)
        with phases("backward"):
            loss.backward()
        with phases("optimizer"):
            opt.step()
        return loss.detach() / world
    result = _time(step, steps, dist, lambda v: dist.all_reduce(v) or v)
    result.update(phases.medians())
    return result


class _Phases:
    """Per-step wall times of named phases; `medians()` after warm-up (the first fifth dropped)."""

    def __init__(self, *names):
        self.times = {n: [] for n in names}

    def __call__(self, name):
        return _Timer(self.times[name])

    def medians(self):
        return {f"{k}_s": statistics.median(v[len(v) // 5:]) for k, v in self.times.items() if v}


class _Timer:
    def __init__(self, out):
        self.out = out

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.out.append(time.perf_counter() - self.t0)


def _dtape_worker(steps, lr, sync=False):
    import torch
    import dtape
    strategy = dtape.distribute.MultiWorkerMirroredStrategy()
    rank, world = strategy.cluster_resolver.task_id, strategy.num_replicas_in_sync
    params, data, labels = _init(torch)
    with strategy.scope():
        variables = [dtape.Variable(p) for p in params]
        opt = dtape.optimizers.SGD(lr)
    part = _slice(rank, world)

    def loss_fn(x, y):
        h = x
        for i in range(0, len(variables), 2):
            h = dtape.matmul(h, variables[i]) + variables[i + 1]
            if i + 2 < len(variables):
                h = dtape.nn.relu(h)
        return dtape.reduce_sum(dtape.nn.sparse_softmax_cross_entropy_with_logits(y, h)) / GLOBAL_BATCH

    def batch(k):
        return dtape.constant(data[k % 4, part]), dtape.constant(labels[k % 4, part])
    return _dtape_time(strategy, variables, opt, loss_fn, batch, steps, sync)


def _dtape_time(strategy, variables, opt, loss_fn, batch, steps, sync):
    """dtape steps timed by phase: forward, gradient walk, apply_gradients (all-reduce wait + update).

    "gradient" + "apply" is what earlier versions reported as "gradient" (forward included) and "apply".
    """
    import dtape
    import torch.distributed as dist
    gradient_sync = dtape.distribute.GradientSync() if sync else None
    phases = _Phases("forward", "walk", "apply")

    def replica_step(x, y):
        with phases("forward"), dtape.GradientTape(gradient_sync=gradient_sync) as tape:
            loss = loss_fn(x, y)
        with phases("walk"):
            grads = tape.gradient(loss, variables)
        with phases("apply"):
            opt.apply_gradients(zip(grads, variables))
        return loss

    def step(k):
        return strategy.run(replica_step, args=batch(k))
    result = _time(step, steps, dist,
                   lambda v: strategy.reduce(dtape.distribute.ReduceOp.SUM, v, axis=None).torch())
    result.update(phases.medians())
    result["gradient_s"] = result["forward_s"] + result["walk_s"]
    return result


def _charlm(torch):
    sys.path.insert(0, HERE)
    from tasks import charlm
    data = charlm.load_data(0)
    x = torch.as_tensor(data["x_train"][:4 * CHARLM_BATCH]).reshape(4, CHARLM_BATCH, -1)
    y = torch.as_tensor(data["y_train"][:4 * CHARLM_BATCH]).reshape(4, CHARLM_BATCH, -1)
    return charlm, x, y


def _charlm_dtape_worker(steps, lr, sync=False):
    import torch
    import dtape
    charlm, data, labels = _charlm(torch)
    strategy = dtape.distribute.MultiWorkerMirroredStrategy()
    rank, world = strategy.cluster_resolver.task_id, strategy.num_replicas_in_sync
    with strategy.scope():
        model = charlm.build_model(0)
        opt = dtape.optimizers.Adam(lr)
    variables = list(model.trainable_variables)
    part = slice(rank * (CHARLM_BATCH // world), (rank + 1) * (CHARLM_BATCH // world))

    def loss_fn(x, y):
        return dtape.reduce_sum(charlm.per_example_loss(model, x, y)) / CHARLM_BATCH

    def batch(k):
        return dtape.constant(data[k % 4, part]), dtape.constant(labels[k % 4, part])
    return _dtape_time(strategy, variables, opt, loss_fn, batch, steps, sync)


def _charlm_ddp_worker(steps, lr):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import dtape
    sys.path.insert(0, HERE)
    from bench import _TorchCharLM
    charlm, data, labels = _charlm(torch)
    values = [v.torch().clone() for v in charlm.build_model(0).trainable_variables]  # the same initial weights
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.parallel.DistributedDataParallel(_TorchCharLM(values, charlm))
    opt = torch.optim.Adam(model.parameters(), lr=lr, eps=1e-7)
    part = slice(rank * (CHARLM_BATCH // world), (rank + 1) * (CHARLM_BATCH // world))

    def loss_fn(k):
        logits = model(data[k % 4, part])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[k % 4, part].reshape(-1))
    return _ddp_time(model, opt, loss_fn, steps, dist, world)


def _time(step, steps, dist, global_loss):
    first = float(global_loss(step(0)))
    times = []
    for k in range(1, steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        step(k)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    warm = times[len(times) // 5:]
    return {"first_loss": first, "step_s": statistics.median(warm)}


def _launch(mode, world, steps):
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               __file__, "--worker", mode, "--steps", str(steps), "--out", out.name]
        env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // world)))
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, timeout=600)
        return json.load(open(out.name))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--worker", choices=["dtape", "dtape_sync", "ddp", "charlm_dtape", "charlm_dtape_sync",
                                         "charlm_ddp"],
                    help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        workers = {"dtape": _dtape_worker, "dtape_sync": lambda n, lr: _dtape_worker(n, lr, sync=True),
                   "ddp": _ddp_worker, "charlm_dtape": _charlm_dtape_worker,
                   "charlm_dtape_sync": lambda n, lr: _charlm_dtape_worker(n, lr, sync=True),
                   "charlm_ddp": _charlm_ddp_worker}
        result = workers[args.worker](args.steps, 1e-3 if args.worker.startswith("charlm") else 0.01)
        if int(os.environ.get("RANK", "0")) == 0:
            json.dump(result, open(args.out, "w"))
        return
    res = {f"{m}_{w}": _launch(m, w, args.steps) for w in (1, 2) for m in ("dtape", "dtape_sync", "ddp")}
    res.pop("dtape_sync_1")
    res.update({f"{m}_2": _launch(m, 2, args.steps) for m in ("charlm_dtape", "charlm_dtape_sync", "charlm_ddp")})
    for key, r in res.items():
        print(f"{key:18s} first loss {r['first_loss']:.7f}  step {r['step_s'] * 1e3:8.2f} ms")
    assert abs(res["dtape_2"]["first_loss"] - res["ddp_2"]["first_loss"]) < 1e-5, "dtape and DDP disagree"
    for key in ("charlm_dtape_2", "charlm_dtape_sync_2"):
        assert abs(res[key]["first_loss"] - res["charlm_ddp_2"]["first_loss"]) < 1e-5, "charlm disagrees"
    # apply_gradients waits for the reduction: with GradientSync only for what the walk did not hide.
    exposed_sync = max(res["dtape_sync_2"]["apply_s"] - res["dtape_1"]["apply_s"], 0.0)
    exposed = res["dtape_2"]["apply_s"] - res["dtape_1"]["apply_s"]
    hidden = min(max(1 - exposed_sync / exposed, 0.0), 1.0) if exposed > 0 else float("nan")
    for key, r in res.items():  # rank 0's phases (ms per step, medians)
        print(f"{key:18s} " + "  ".join(f"{p} {r[p + '_s'] * 1e3:6.2f}" for p in
                                        ("forward", "walk", "apply", "backward", "optimizer") if p + "_s" in r))
    ratios = {"dtape/ddp at 2 workers": res["dtape_2"]["step_s"] / res["ddp_2"]["step_s"],
              "dtape+GradientSync/ddp at 2": res["dtape_sync_2"]["step_s"] / res["ddp_2"]["step_s"],
              "communication hidden (share)": hidden,
              "charlm dtape/ddp at 2 workers": res["charlm_dtape_2"]["step_s"] / res["charlm_ddp_2"]["step_s"],
              "charlm dtape+GradientSync/ddp": res["charlm_dtape_sync_2"]["step_s"] / res["charlm_ddp_2"]["step_s"],
              "dtape/ddp at 1 worker": res["dtape_1"]["step_s"] / res["ddp_1"]["step_s"],
              "dtape 2 workers / 1 worker": res["dtape_2"]["step_s"] / res["dtape_1"]["step_s"],
              "ddp 2 workers / 1 worker": res["ddp_2"]["step_s"] / res["ddp_1"]["step_s"]}
    for k, v in ratios.items():
        print(f"{k:28s} {v:.2f}x")
    print(f"load average {os.getloadavg()}")
    if args.json:
        json.dump({"results": res, "ratios": ratios, "loadavg": os.getloadavg()}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
