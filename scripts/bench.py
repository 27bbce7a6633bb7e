"""dtape vs plain torch.autograd: op-chain overhead, an MLP and a CNN training step; tape counts.

Runs each case INTERLEAVED in one process (dtape and torch alternate, the one
that goes first alternates too) and reports medians; gc stays enabled, so GC
costs are part of the times. `--counts` prints only the deterministic
counts (records per replica tape, records with unrelated threads, Python
calls per op with a variable operand).

  python scripts/bench.py [--device cpu|cuda] [--quick] [--counts] [--json PATH]
"""
import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time

import torch
import torch.nn.functional as F

import dtape


def timer(device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run(fn):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0
    return run


def interleave(run, fn_dtape, fn_torch, reps, warmup):
    for _ in range(warmup):
        fn_dtape(), fn_torch()
    td, tt = [], []
    for r in range(reps):
        if r % 2:
            tt.append(run(fn_torch)); td.append(run(fn_dtape))
        else:
            td.append(run(fn_dtape)); tt.append(run(fn_torch))
    return statistics.median(td), statistics.median(tt)


# -- (a) a chain of N small ops ------------------------------------------------
def chain_case(n, device):
    g = torch.Generator().manual_seed(0)
    x0, w0, b0 = (torch.randn(4, 4, generator=g).to(device) for _ in range(3))
    dx, dw, db = (dtape.constant(v) for v in (x0, w0, b0))
    tx, tw, tb = (v.clone().requires_grad_() for v in (x0, w0, b0))

    def run_dtape():
        with dtape.GradientTape() as tape:
            tape.watch([dx, dw, db])
            y = dx
            for i in range(n):
                k = i % 3
                y = y * dw if k == 0 else (y + db if k == 1 else dtape.tanh(y))
            loss = dtape.reduce_sum(y)  # inside the tape, or it is not recorded (TF semantics)
        return tape.gradient(loss, [dx, dw, db])

    def run_torch():
        y = tx
        for i in range(n):
            k = i % 3
            y = y * tw if k == 0 else (y + tb if k == 1 else torch.tanh(y))
        return torch.autograd.grad(y.sum(), [tx, tw, tb])

    err = max((a.torch() - b).abs().max().item() for a, b in zip(run_dtape(), run_torch()))
    return run_dtape, run_torch, f"max |grad diff| {err:.1e}"


# -- (b) MLP training step -----------------------------------------------------
def mlp_case(device, sizes=(784, 1024, 1024, 10), batch=256, lr=0.01):
    g = torch.Generator().manual_seed(0)
    init = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        init += [torch.randn(fan_in, fan_out, generator=g) * fan_in ** -0.5, torch.zeros(fan_out)]
    init = [p.to(device) for p in init]
    data = torch.randn(batch, sizes[0], generator=g).to(device)
    labels = torch.randint(0, sizes[-1], (batch,), generator=g).to(device)

    dvars = [dtape.Variable(p) for p in init]
    dx, dy = dtape.constant(data), dtape.constant(labels)
    opt = dtape.optimizers.SGD(lr)
    tparams = [p.clone().requires_grad_() for p in init]

    def run_dtape():
        with dtape.GradientTape() as tape:
            h = dx
            for i in range(0, len(dvars), 2):
                h = dtape.matmul(h, dvars[i]) + dvars[i + 1]
                if i + 2 < len(dvars):
                    h = dtape.nn.relu(h)
            loss = dtape.reduce_mean(dtape.nn.sparse_softmax_cross_entropy_with_logits(dy, h))
        grads = tape.gradient(loss, dvars)
        opt.apply_gradients(zip(grads, dvars))
        return loss

    def run_torch():
        h = data
        for i in range(0, len(tparams), 2):
            h = h @ tparams[i] + tparams[i + 1]
            if i + 2 < len(tparams):
                h = torch.relu(h)
        loss = F.cross_entropy(h, labels)
        grads = torch.autograd.grad(loss, tparams)
        with torch.no_grad():
            for p, gr in zip(tparams, grads):
                p.sub_(lr * gr)
        return loss

    ld, lt = float(run_dtape()), run_torch().item()
    print(f"MLP first-step loss: dtape {ld:.7f}  torch {lt:.7f}  |diff| {abs(ld - lt):.1e}")
    assert abs(ld - lt) < 1e-5 * max(1.0, abs(lt)), "dtape and torch MLP steps disagree"

    def check():
        return max((v.torch() - p.detach()).abs().max().item() for v, p in zip(dvars, tparams))
    return run_dtape, run_torch, check


# -- (c) a small CNN step (conv2d gradients: torch's kernels, no image gradient for layer 1) --
def cnn_case(device, batch=32, lr=0.01):
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 3, 1, 16), (16,), (3, 3, 16, 32), (32,), (7 * 7 * 32, 10), (10,)]
    init = [(torch.randn(*s, generator=g) * 0.1).to(device) for s in shapes]
    data = torch.randn(batch, 28, 28, 1, generator=g).to(device)
    labels = torch.randint(0, 10, (batch,), generator=g).to(device)
    dvars = [dtape.Variable(p) for p in init]
    dx, dy = dtape.constant(data), dtape.constant(labels)
    opt = dtape.optimizers.SGD(lr)
    tparams = [p.clone().requires_grad_() for p in init]

    def run_dtape():
        with dtape.GradientTape() as tape:
            h = dx
            for i in (0, 2):
                h = dtape.nn.relu(dtape.nn.conv2d(h, dvars[i], strides=2, padding="SAME") + dvars[i + 1])
            logits = dtape.matmul(dtape.reshape(h, (batch, -1)), dvars[4]) + dvars[5]
            loss = dtape.reduce_mean(dtape.nn.sparse_softmax_cross_entropy_with_logits(dy, logits))
        opt.apply_gradients(zip(tape.gradient(loss, dvars), dvars))
        return loss

    def run_torch():
        h = data.permute(0, 3, 1, 2)
        for i in (0, 2):  # SAME with stride 2 on even sizes, k=3: pad 0 before, 1 after
            h = F.conv2d(F.pad(h, (0, 1, 0, 1)), tparams[i].permute(3, 2, 0, 1), stride=2)
            h = torch.relu(h + tparams[i + 1].reshape(1, -1, 1, 1))
        logits = h.permute(0, 2, 3, 1).reshape(batch, -1) @ tparams[4] + tparams[5]
        loss = F.cross_entropy(logits, labels)
        grads = torch.autograd.grad(loss, tparams)
        with torch.no_grad():
            for p, gr in zip(tparams, grads):
                p.sub_(lr * gr)
        return loss

    ld, lt = float(run_dtape()), run_torch().item()
    print(f"CNN first-step loss: dtape {ld:.7f}  torch {lt:.7f}  |diff| {abs(ld - lt):.1e}")
    assert abs(ld - lt) < 1e-5 * max(1.0, abs(lt)), "dtape and torch CNN steps disagree"
    return run_dtape, run_torch


# -- (d) counts: tape scope (issue 7 point 3) and Python calls per variable read (point 7) ----
def count_calls(fn):
    """Python function calls (sys.setprofile 'call' events, this thread) made by fn(), fn itself included."""
    n = [0]

    def prof(frame, event, arg):
        if event == "call":
            n[0] += 1
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n[0]


def calls_variable_op():
    """Calls for `v * x` (v a Variable the recording tape already watches)."""
    v, x = dtape.Variable(torch.ones(3)), dtape.constant(torch.ones(3))
    with dtape.GradientTape():
        v * x
        v * x
        return count_calls(lambda: v * x)


def calls_mirrored_op():
    """Calls for `v * x` on each replica thread (v a MirroredVariable, a tape open in each replica)."""
    strategy = dtape.distribute.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        v = dtape.Variable(torch.ones(3))
    x = dtape.constant(torch.ones(3))

    def step():
        with dtape.GradientTape():
            v * x
            v * x
            return count_calls(lambda: v * x)
    return _ints_per_replica(strategy, step)


def records_per_replica_tape(n):
    """Records on each replica's own tape for one small step, all replicas inside their tapes at once."""
    strategy = dtape.distribute.MirroredStrategy(devices=[f"cpu:{i}" for i in range(n)])
    with strategy.scope():
        w, b = dtape.Variable(torch.ones(4, 3)), dtape.Variable(torch.zeros(3))
    x = dtape.constant(torch.ones(2, 4))
    barrier = threading.Barrier(n, timeout=30)

    def step():
        with dtape.GradientTape() as tape:
            barrier.wait()
            h = dtape.nn.relu(dtape.matmul(x, w) + b)
            loss = dtape.reduce_mean(h * h)
            barrier.wait()
        records = tape._tape.num_records()
        tape.gradient(loss, [w, b])
        return records
    return _ints_per_replica(strategy, step)


def _ints_per_replica(strategy, step):
    """Runs `step` (returning an int) on every replica; the ints in replica order."""
    out = strategy.run(lambda: dtape.constant(step()))  # a tensor: a distinct object per replica
    return [int(t) for t in strategy.experimental_local_results(out)]


def records_with_unrelated_threads(n_threads=32, iters=200):
    """Records on one tape (16 ops of its own) while n_threads - 1 other threads read the same variables."""
    vs = [dtape.Variable(torch.ones(4)) for _ in range(4)]
    start, done = threading.Event(), threading.Barrier(n_threads, timeout=60)

    def other():
        start.wait(30)
        for _ in range(iters):
            for v in vs:
                v * 2.0 + 1.0
        done.wait()
    threads = [threading.Thread(target=other, daemon=True) for _ in range(n_threads - 1)]
    for t in threads:
        t.start()
    with dtape.GradientTape() as tape:
        start.set()
        y = vs[0] * vs[1]
        for _ in range(4):
            y = dtape.tanh(y) + vs[2]
        dtape.reduce_sum(y)
        done.wait()
    for t in threads:
        t.join(30)
    return tape._tape.num_records()


def counts():
    out = {"calls_variable_op": calls_variable_op(), "calls_mirrored_op": calls_mirrored_op()}
    for n in (1, 2, 4):
        out[f"records_per_replica_tape_{n}"] = records_per_replica_tape(n)
    out["records_32_threads"] = records_with_unrelated_threads()
    for k, v in out.items():
        print(f"{k:32s} {v}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--counts", action="store_true", help="only the record and call counts")
    args = ap.parse_args()
    if args.counts:
        result = counts()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return
    device = torch.device(args.device)
    threads = os.cpu_count()
    torch.set_num_threads(threads)
    print(f"torch {torch.__version__}, Python {platform.python_version()}, device {device}, "
          f"torch.set_num_threads({threads})")
    run = timer(device)
    q = args.quick
    rows = []

    # (name, make case, reps, warmup)
    for n, reps, warm in ((1_000, 7 if q else 31, 2 if q else 5), (100_000, 1 if q else 5, 1)):
        fd, ft, note = chain_case(n, device)
        print(f"chain N={n:,}: {note}")
        rows.append((f"(a) chain N={n:,}", *interleave(run, fd, ft, reps, warm), reps))

    fd, ft, check = mlp_case(device)
    reps = 7 if q else 41
    rows.append(("(b) MLP step 784-1024-1024-10, b=256", *interleave(run, fd, ft, reps, 3 if q else 5), reps))
    print(f"MLP weights after all steps: max |dtape - torch| {check():.1e}")

    fd, ft = cnn_case(device)
    reps = 7 if q else 31
    rows.append(("(c) CNN step 2 conv + dense, b=32", *interleave(run, fd, ft, reps, 3 if q else 5), reps))
    count_results = counts()

    print(f"\n{'case':40s} {'dtape (ms)':>11s} {'torch (ms)':>11s} {'ratio':>7s} {'reps':>5s}")
    for name, d, t, r in rows:
        print(f"{name:40s} {d * 1e3:11.3f} {t * 1e3:11.3f} {d / t:7.2f} {r:5d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "threads": threads, "torch": torch.__version__,
                       "results": [dict(case=n, dtape_s=d, torch_s=t, ratio=d / t, reps=r)
                                   for n, d, t, r in rows], "counts": count_results}, f, indent=2)


if __name__ == "__main__":
    main()
