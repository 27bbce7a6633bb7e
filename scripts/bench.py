"""dtape vs plain torch.autograd: op-chain overhead and an MLP training step.

Runs each case INTERLEAVED in one process (dtape and torch alternate, the one
that goes first alternates too) and reports medians; gc stays enabled, so GC
costs are part of the times.

  python scripts/bench.py [--device cpu|cuda] [--quick] [--json PATH]
"""
import argparse
import json
import os
import platform
import statistics
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = ap.parse_args()
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

    print(f"\n{'case':40s} {'dtape (ms)':>11s} {'torch (ms)':>11s} {'ratio':>7s} {'reps':>5s}")
    for name, d, t, r in rows:
        print(f"{name:40s} {d * 1e3:11.3f} {t * 1e3:11.3f} {d / t:7.2f} {r:5d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "threads": threads, "torch": torch.__version__,
                       "results": [dict(case=n, dtape_s=d, torch_s=t, ratio=d / t, reps=r)
                                   for n, d, t, r in rows]}, f, indent=2)


if __name__ == "__main__":
    main()
