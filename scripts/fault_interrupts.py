"""Ctrl-C at random moments during MirroredStrategy steps: how many leave the mirrored components different.

Trains a small MLP with Adam on 2 CPU replicas; before each step a timer
calls `_thread.interrupt_main()` (what Ctrl-C does) after a random delay
within one step's duration. After each step `check_mirrored()` compares
every component bit for bit; a diverged variable is counted and re-synced.

    PYTHONPATH=. python scripts/fault_interrupts.py --steps 136 --seed 0 [--fast-switching]

Prints: step time; steps; steps that raised KeyboardInterrupt; steps that
left components diverged. With --fast-switching (sys.setswitchinterval(1e-6))
a run that hangs shows a lost lock (run it under `timeout`).
"""
import _thread
import argparse
import random
import sys
import threading
import time

import torch

import dtape
from dtape import distribute as ds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=136)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fast-switching", action="store_true")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each divergence")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    torch.manual_seed(0)
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"], timeout=30)
    with strategy.scope():
        variables = [dtape.Variable(torch.randn(16, 32) * 0.1), dtape.Variable(torch.zeros(32)),
                     dtape.Variable(torch.randn(32, 1) * 0.1)]
        opt = dtape.optimizers.Adam(1e-2)
        opt.build(variables)
    x = ds.PerReplica((dtape.constant(torch.randn(8, 16)), dtape.constant(torch.randn(8, 16))))

    def step(x):
        w1, b1, w2 = variables
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_mean(dtape.matmul(dtape.nn.relu(dtape.matmul(x, w1) + b1), w2) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

    for _ in range(5):
        strategy.run(step, (x,))
    start = time.perf_counter()
    for _ in range(20):
        strategy.run(step, (x,))
    duration = (time.perf_counter() - start) / 20
    if args.fast_switching:
        sys.setswitchinterval(1e-6)
    interrupted = diverged = 0
    for i in range(args.steps):
        timer = threading.Timer(rng.uniform(0, duration), _thread.interrupt_main)
        try:
            timer.start()
            strategy.run(step, (x,))
        except KeyboardInterrupt:
            interrupted += 1
        _settle(timer)
        try:
            strategy.extended.check_mirrored()
        except ValueError as e:
            diverged += 1
            if args.verbose:
                print(i, e)
            for var in variables + opt.variables():
                for c in var.values[1:]:
                    c.assign(var.values[0].torch().clone())
    print(f"step {duration * 1e3:.2f} ms; {args.steps} steps, {interrupted} interrupted, "
          f"{diverged} left components diverged")
    strategy.close()


def _settle(timer):
    """Waits for the timer; its interrupt, if it comes after the step, lands here."""
    while True:
        try:
            timer.join()
            time.sleep(0.002)
            return
        except KeyboardInterrupt:
            continue


if __name__ == "__main__":
    main()
