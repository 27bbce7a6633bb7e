"""Instructions per step of the GPT step through TorchModule + from_torch(AdamW) against plain torch.

Wall times on a shared machine move by several % between runs (other
processes, CPU steal, where glibc's heap trimming lands); the number of
instructions a step executes does not. This runs each side's step under
valgrind's callgrind, counting only the measured steps (collection is on
only inside a `functools.reduce` call that runs them, after warm-up steps),
both sides at once in two child processes, and prints instructions per step
and their ratio: the work dtape adds to torch's, without cache or page-fault
effects (those are in scripts/bench.py's (j)).

`--workers` counts case (i) instead (its warm-up fixed at 4 steps): the GPT step of
scripts/bench_multiworker.py on 2 gloo workers, dtape (MultiWorkerMirroredStrategy,
GradientSync, from_torch(AdamW)) against DistributedDataParallel, each side's
two workers alone under callgrind (the DDP workers never import dtape); it
prints each rank's instructions per step (the step's thread and gloo's
threads while the step runs) and their ratio. Under valgrind a collective
outlasts dtape's 20 ms wait slices, and each expired slice costs a C++
exception that a native step rarely pays, so dtape's count is a little high.

Needs valgrind (`apt install valgrind`); about 10-15 minutes on 2 cores (the
children run ~50x slower than native), `--workers` about 17.

  python scripts/bench_instructions.py [--steps 3] [--warmup 4] [--workers]
"""
import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

import torch

import bench  # scripts/, beside this file (it puts this checkout's dtape first on the path)
import bench_multiworker


def _steps():
    """(dtape step, torch step) of bench.py's (j), one intra-op thread."""
    torch.set_num_threads(1)
    return bench.gpt_case(torch.device("cpu"))


def child(side, steps, warmup):
    step = dict(zip(("dtape", "torch"), _steps()))[side]
    bench_multiworker.counted(lambda k: step(), steps, warmup)  # callgrind collects inside functools_reduce only


def _launch(side, steps, warmup, out_dir):
    return _callgrind(side, out_dir, [os.path.abspath(__file__), "--child", side, "--steps", str(steps),
                                      "--warmup", str(warmup)])


def _callgrind(tag, out_dir, argv, env=None):
    """(process, log path) of `python argv` under callgrind, counting inside functools.reduce only."""
    log = os.path.join(out_dir, f"{tag}.log")
    cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
           f"--callgrind-out-file={os.path.join(out_dir, tag + '.out')}", f"--log-file={log}", sys.executable, *argv]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, env=env), log


def _workers(side, steps, out_dir, world=2):
    """{rank: (process, log)} of one side's `world` gloo workers under callgrind (env:// rendezvous on a free
    local port; collectives given an hour: valgrind runs them ~50x slower)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runs = {}
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", DTAPE_DISTRIBUTE_TIMEOUT="3600",
                   PYTHONPATH=bench_multiworker.worker_pythonpath())
        # bench_multiworker's worker, not this file: the DDP workers must not import dtape (this file's
        # `bench` import does)
        runs[rank] = _callgrind(f"{side}.{rank}", out_dir, [bench_multiworker.__file__, "--worker", "gpt_counted",
                                                            "--side", side, "--steps", str(steps)], env)
    return runs


def _collect(runs, steps):
    """Instructions per step of each run ({key: (process, log)}), once every process has exited."""
    for key, (proc, log) in runs.items():
        if proc.wait(timeout=3600) != 0:
            raise RuntimeError(f"the child {key} failed (exit {proc.returncode}); see its log:\n"
                               + open(log).read()[-2000:])
    return {key: _collected(log) / steps for key, (_, log) in runs.items()}


def workers_main(steps):
    """`--workers`: (i)'s step, each side's 2 workers alone in turn (bench_multiworker.COUNTED_WARMUP warm-up
    steps); prints per rank and the ratio."""
    warmup = bench_multiworker.COUNTED_WARMUP
    with tempfile.TemporaryDirectory() as out_dir:
        per_step = {side: _collect(_workers(side, steps, out_dir), steps)
                    for side in bench_multiworker.GPT_ALONE_SIDES}
    dtape_side, ddp = (per_step[side] for side in bench_multiworker.GPT_ALONE_SIDES)
    for rank in sorted(ddp):
        print(f"instructions per GPT step on 2 gloo workers, rank {rank} ({steps} steps after {warmup} warm-up, "
              f"callgrind): dtape {dtape_side[rank] / 1e6:.2f} M, DDP {ddp[rank] / 1e6:.2f} M, "
              f"ratio {dtape_side[rank] / ddp[rank]:.4f}")


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
    ap.add_argument("--workers", action="store_true", help="case (i): 2 gloo workers, dtape against DDP")
    ap.add_argument("--child", choices=["dtape", "torch"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.steps, args.warmup)
    if shutil.which("valgrind") is None:
        sys.exit("bench_instructions.py needs valgrind on PATH (apt install valgrind)")
    if args.workers:
        return workers_main(args.steps)
    with tempfile.TemporaryDirectory() as out_dir:
        per_step = _collect({side: _launch(side, args.steps, args.warmup, out_dir) for side in ("dtape", "torch")},
                            args.steps)
    print(f"instructions per GPT step ({args.steps} steps after {args.warmup} warm-up, callgrind): "
          f"dtape {per_step['dtape'] / 1e6:.2f} M, torch {per_step['torch'] / 1e6:.2f} M, "
          f"ratio {per_step['dtape'] / per_step['torch']:.4f}")


if __name__ == "__main__":
    main()
