"""A/B in one process: charlm's compiled train step (forward, gradient, Adam; batch 32) with the variable
writes made in the graph (into the variables' buffers) against the same step returning the new values,
which the call then assigns (the graph as it was before in-place writes), and torch autograd + fused Adam
as the yardstick of `bench.py --jit-only` case (b). Timings interleaved, medians; run on an idle machine.

  python scripts/bench_jit_writes.py [--reps 41] [--threads N]
"""
import argparse
import os
import sys
import time

import torch

import bench  # scripts/, beside this file: puts this checkout's dtape first on sys.path
from dtape import _jit


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=41)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    fns = bench.jit_charlm_fns(torch.device("cpu"))
    returned = bench.jit_charlm_fns(torch.device("cpu"))["dtape compiled"]
    in_graph = _jit._write_into_inputs
    _jit._write_into_inputs = lambda *a: None  # the baseline's trace keeps returning the writes
    try:
        started = time.perf_counter()
        returned()
        print(f"first call, writes returned: {time.perf_counter() - started:.1f} s")
    finally:
        _jit._write_into_inputs = in_graph
    started = time.perf_counter()
    fns["dtape compiled"]()
    print(f"first call, writes in the graph: {time.perf_counter() - started:.1f} s")
    cases = {"writes in the graph": fns["dtape compiled"], "writes returned": returned,
             "torch autograd + fused Adam": fns["torch autograd + fused Adam"]}
    medians = bench.interleave_many(bench.timer(torch.device("cpu")), cases, args.reps, 3)
    base = medians["torch autograd + fused Adam"]
    for name, t in medians.items():
        print(f"  {name:30s} {t * 1e3:8.3f} ms   / torch autograd {t / base:5.3f}")
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()}")


if __name__ == "__main__":
    sys.exit(main())
