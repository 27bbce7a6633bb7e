"""RSS and gc-tracked objects over many MirroredStrategy steps, then whether a dropped strategy is collected.

Each step computes a gradient on 2 CPU replicas and applies it with SGD (one
all-reduce among the replica threads per step).

    PYTHONPATH=. python scripts/fault_memory.py --steps 10000
"""
import argparse
import gc
import threading
import time
import weakref

import torch

import dtape
from dtape import distribute as ds


def _rss_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _make():
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"], timeout=30)
    with strategy.scope():
        w = dtape.Variable(torch.randn(8, 4))
        opt = dtape.optimizers.SGD(0.01)
    x = ds.PerReplica((dtape.constant(torch.randn(4, 8)), dtape.constant(torch.randn(4, 8))))

    def step(x):
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(dtape.matmul(x, w) ** 2)
        opt.apply_gradients([(tape.gradient(loss, w), w)])
    return strategy, step, x


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10000)
    args = parser.parse_args()
    strategy, step, x = _make()
    for _ in range(200):
        strategy.run(step, (x,))
    gc.collect()
    rss, objects = _rss_mb(), len(gc.get_objects())
    start = time.perf_counter()
    for _ in range(args.steps):
        strategy.run(step, (x,))
    elapsed = time.perf_counter() - start
    gc.collect()
    rss1, objects1 = _rss_mb(), len(gc.get_objects())
    print(f"{args.steps} steps in {elapsed:.1f} s: RSS {rss:.1f} -> {rss1:.1f} MB ({rss1 - rss:+.1f}); "
          f"gc objects {objects} -> {objects1} ({objects1 - objects:+d})")
    threads = [t for t in threading.enumerate() if t.name.startswith("dtape-replica")]
    ref = weakref.ref(strategy)
    del strategy, step
    gc.collect()
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        time.sleep(0.01)
    print(f"dropped strategy collected: {ref() is None}; its threads alive after 5 s: "
          f"{sum(t.is_alive() for t in threads)}")


if __name__ == "__main__":
    main()
