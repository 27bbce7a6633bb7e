"""Starting torchrun from tests: free ports, the worktree's dtape, small timeouts, per-rank logs."""
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(ROOT, "scripts", "train.py")


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(timeout=10, **extra):
    """The environment for workers: this checkout's dtape first, one thread each, a short collective timeout."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               DTAPE_DISTRIBUTE_TIMEOUT=str(timeout), PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def torchrun_args(log_dir, nproc=2, standalone=True, extra=()):
    """`python -m torch.distributed.run` arguments: `nproc` CPU workers on this machine, per-rank logs in log_dir.

    standalone: `--standalone` (one node); else the caller adds its rendezvous flags.
    """
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--monitor-interval",
            "0.1", "--log-dir", str(log_dir), "--redirects", "3", *extra]
    if standalone:
        args += ["--standalone", "--nnodes", "1"]   # c10d rendezvous on a free localhost port
    return args


def run(args, env, timeout=90):
    """Runs a command in its own process group; returns (returncode, combined output, seconds).

    Past `timeout` the whole group (torchrun and its workers) is killed and
    the output so far is returned with returncode None.
    """
    start = time.monotonic()
    rc, output = finish(start_command(args, env), timeout)
    return rc, output, time.monotonic() - start


def run_ranks(tmp_path, script, *script_args, timeout=300, nproc=2):
    """Runs `script` (in this folder) on `nproc` torchrun workers with `tmp_path` as its first argument and
    returns each rank's `tmp_path/rank<r>.json`, in rank order; a failed run fails the test with the output
    and the ranks' logs (collectives time out after 60 s, the run after `timeout` s)."""
    args = torchrun_args(tmp_path / "logs", nproc) + [os.path.join(HERE, script), str(tmp_path),
                                                     *map(str, script_args)]
    rc, output, _ = run(args, worker_env(timeout=60), timeout=timeout)
    assert rc == 0, f"torchrun failed ({rc}):\n{output[-3000:]}\n{rank_logs(tmp_path / 'logs')}"
    ranks = []
    for r in range(nproc):
        with open(tmp_path / f"rank{r}.json") as f:
            ranks.append(json.load(f))
    return ranks


def rank_logs(log_dir, attempt=0):
    """{global rank: stdout + stderr} of one attempt, from torchrun's --log-dir (local rank = rank on one node)."""
    out = {}
    for folder in sorted(glob.glob(os.path.join(str(log_dir), "*", f"attempt_{attempt}", "*"))):
        rank = int(os.path.basename(folder))
        text = ""
        for name in ("stdout.log", "stderr.log"):
            path = os.path.join(folder, name)
            if os.path.exists(path):
                with open(path) as f:
                    text += f.read()
        out[rank] = text
    return out


def start_command(args, env):
    """Starts a command in a new session (output to a pipe); finish it with `finish`."""
    return subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def finish(proc, timeout=90):
    """(returncode, output) of a started command; past the timeout its whole session is killed (returncode None)."""
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, output + f"\n[killed after {timeout} s]"
