"""Instructions per step of the GPT step through TorchModule + from_torch(AdamW) against plain torch.

Wall times on a shared machine move by several % between runs (other
processes, CPU steal, where glibc's heap trimming lands); the number of
instructions a step executes does not. This runs each side's step under
valgrind's callgrind, counting only the measured steps (collection is on
only inside a `functools.reduce` call that runs them, after warm-up steps),
both sides at once in two child processes, and prints instructions per step
and their ratio: the work dtape adds to torch's, without cache or page-fault
effects (those are in scripts/bench.py's (j)).

Needs valgrind (`apt install valgrind`); about 10-15 minutes on 2 cores (the
children run ~50x slower than native).

  python scripts/bench_instructions.py [--steps 3] [--warmup 4]
"""
import argparse
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch

import bench  # scripts/, beside this file (it puts this checkout's dtape first on the path)


def _steps():
    """(dtape step, torch step) of bench.py's (j), one intra-op thread."""
    torch.set_num_threads(1)
    return bench.gpt_case(torch.device("cpu"))


def child(side, steps, warmup):
    step = dict(zip(("dtape", "torch"), _steps()))[side]
    for _ in range(warmup):
        step()

    def measured(acc, _):
        for _ in range(steps):
            step()
        return acc
    functools.reduce(measured, [0, 1])  # callgrind collects inside functools_reduce only


def _launch(side, steps, warmup, out_dir):
    log = os.path.join(out_dir, f"{side}.log")
    cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
           f"--callgrind-out-file={os.path.join(out_dir, side + '.out')}", f"--log-file={log}",
           sys.executable, os.path.abspath(__file__), "--child", side, "--steps", str(steps), "--warmup", str(warmup)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL), log


def _collected(log):
    with open(log) as f:
        found = re.search(r"Collected\s*:\s*([\d,]+)", f.read())
    if found is None:
        raise RuntimeError(f"callgrind reported no collected instructions in {log}")
    return int(found.group(1).replace(",", ""))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--child", choices=["dtape", "torch"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.steps, args.warmup)
    if shutil.which("valgrind") is None:
        sys.exit("bench_instructions.py needs valgrind on PATH (apt install valgrind)")
    with tempfile.TemporaryDirectory() as out_dir:
        runs = {side: _launch(side, args.steps, args.warmup, out_dir) for side in ("dtape", "torch")}
        for side, (proc, log) in runs.items():
            if proc.wait(timeout=3600) != 0:
                raise RuntimeError(f"the {side} child failed (exit {proc.returncode}); see its log:\n"
                                   + open(log).read()[-2000:])
        per_step = {side: _collected(log) / args.steps for side, (_, log) in runs.items()}
    print(f"instructions per GPT step ({args.steps} steps after {args.warmup} warm-up, callgrind): "
          f"dtape {per_step['dtape'] / 1e6:.2f} M, torch {per_step['torch'] / 1e6:.2f} M, "
          f"ratio {per_step['dtape'] / per_step['torch']:.4f}")


if __name__ == "__main__":
    main()
