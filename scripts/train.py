#!/usr/bin/env python3
"""The main job: trains a task's model under a dtape.distribute strategy.

    python scripts/train.py --task digits --strategy mirrored --devices cpu:0,cpu:1 --out runs/digits

Each step: the global batch is split across replicas; in `strategy.run` each
replica computes its per-example losses, loss = sum / GLOBAL batch size,
takes `tape.gradient` and calls `optimizer.apply_gradients`, which waits for
the gradients' all-reduce (started during the backward walk by
`dtape.distribute.GradientSync`, bucketed as DDP does); the step's loss is
`strategy.reduce(SUM, ...)`. The loss is therefore the same, up to float
rounding, for any number of replicas.

Batches: each epoch shuffles the training set with a permutation derived from
(--seed, epoch) and drops the last short batch, so every strategy sees the
same global batches and a resumed run continues exactly where it stopped.

Random numbers: --dropout RATE adds the task's dropout layers. Under
--strategy mirrored the strategy is seeded with --seed and every replica draws
its masks from its own generator (seeded from (seed, replica id)), so a run
is reproducible whatever the thread schedule.

Checking first: every argument is checked before any work (numbers, device
names and their existence, the output folders, which are created and probed
with a file); a mistake prints one line on stderr saying what to do and exits
with status 2. An existing checkpoint is never replaced unless --resume
(continue it) or --overwrite (start over) is given.

Checkpoints: --checkpoint-dir DIR gets last.pt, written atomically at the end
of each epoch, every --save-every steps, at the end of the run and when the job
is stopped. It holds the model, optimizer, step counter, metrics so far, the
run's settings and every random state (torch's default CPU and CUDA
generators and the replicas' generators), so a resumed run, dropout included,
continues bit-identically. --resume refuses a checkpoint made with another
task, seed, global batch size, model or optimizer, naming the setting; with no
checkpoint there yet it says so and starts at step 0 (as Keras'
BackupAndRestore), so a requeued batch job can always pass --resume.

Stopping: SIGINT (Ctrl-C) or SIGTERM (what batch schedulers send before
preemption) lets the current step finish, saves the checkpoint, writes the
outputs and exits with 128 + the signal number (130, 143) after a line
"train.py: stopped by SIGTERM after step N; ...". A signal during the final
evaluation stops the same way (the evaluation is skipped; --resume does it);
one while the last checkpoint or the outputs are written lets them finish
first. Under multi_worker the workers agree on the step to stop after (the
loss's all-reduce carries every worker's stop requests), so a signal that
reaches one worker, or each at a different step, stops all of them after the
same step, with the same checkpoint. A second signal stops at once; a repeat
of the same signal within a second counts as the same request (torchrun
passes on a Ctrl-C or SIGTERM its workers may already have received).

Outputs: --out DIR gets metrics.json (per-step loss, per-epoch train/test
accuracy, examples/second, total run time over all resumed sessions) and
loss.png (loss per step; accuracy per epoch); --logdir DIR gets TensorBoard
scalars (loss, learning rate, accuracy, examples per second).

Compiled steps: --jit-compile wraps the replica step (forward, tape.gradient,
apply_gradients) in dtape.function(jit_compile=True), which traces it once
into one graph and compiles it with torch.compile (--jit-backend, default
inductor; "none" runs the traced graph uncompiled). The first step pays the
trace and the compile; the final line and metrics.json report that time
(compile_seconds) apart from the steady-state time per step (step_seconds,
the median of the later steps). Losses equal the eager run's.
Only the public dtape API is used.
"""
import argparse
import importlib.util
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tasks  # noqa: E402  (light: torch is imported only after the argument checks)

CHECKPOINT_NAME = "last.pt"
PROG = "train.py"
MAX_SEED = 2**32 - 1  # scikit-learn's random_state range
JIT_BACKENDS = ("inductor", "aot_eager", "eager", "none")
# Test hook: during step K (after its update, before its loss is recorded) print a line and wait for a signal.
# "K": every process; "R:K,...": the worker of rank R only (multi_worker). "evaluation": in the final evaluation
# (between the train and test accuracies); "outputs": between writing metrics.json and loss.png.
TEST_WAIT_ENV = "DTAPE_TRAIN_TEST_WAIT_FOR_SIGNAL_AT_STEP"
OPTIMIZER_SETTINGS = {"sgd": {"momentum": 0.9},
                      "adam": {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7}}

np = torch = dtape = None  # imported by load_libraries() once the arguments passed the cheap checks


def load_libraries():
    """Imports numpy, torch and dtape (about a second), so argument mistakes are reported before."""
    global np, torch, dtape
    import numpy as np
    import torch

    import dtape
    import dtape.checkpoint
    import dtape.distribute
    import dtape.optimizers


# -- command line ---------------------------------------------------------------

def fail(message):
    """Exits with status 2 after one line on stderr: what was wrong and what to do."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own mistakes (bad int, unknown option) as one line too
        fail(f"{message} (see {PROG} -h)")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every default; options whose default depends on the task give it in their help instead."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:  # task-dependent, or an off switch
            return action.help
        return super()._get_help_string(action)


def _task_default(key):
    return "task default: " + ", ".join(f"{name} {d[key]}" for name, d in tasks.DEFAULTS.items())


def build_parser():
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter)
    p.add_argument("--task", choices=tasks.TASKS, default="digits",
                   help="digits: an MLP on scikit-learn's 8x8 digits; charlm: a small character-level transformer")
    p.add_argument("--strategy", choices=("one_device", "mirrored", "multi_worker"), default="one_device",
                   help="mirrored: one replica thread per device; multi_worker: one process per replica "
                        "under torchrun")
    p.add_argument("--devices", default=None,
                   help="comma-separated, no spaces, e.g. cpu:0,cpu:1 or cuda:0,cuda:1 "
                        "(default: cpu for one_device, cpu:0,cpu:1 for mirrored)")
    p.add_argument("--epochs", type=int, default=None, help=f"number of epochs ({_task_default('epochs')})")
    p.add_argument("--steps", type=int, default=None,
                   help="stop after this many global steps in total, resumed ones included (default: all epochs)")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"GLOBAL batch size, split across replicas ({_task_default('batch_size')})")
    p.add_argument("--lr", type=float, default=None, help=f"learning rate ({_task_default('lr')})")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZER_SETTINGS), default=None,
                   help=f"sgd (momentum 0.9) or adam ({_task_default('optimizer')})")
    p.add_argument("--dropout", type=float, default=None, help=f"dropout rate in [0, 1) ({_task_default('dropout')})")
    p.add_argument("--checkpoint-dir", default=None,
                   help="save last.pt here after each epoch, every --save-every steps and when stopped")
    p.add_argument("--save-every", type=int, default=None, help="also save every N steps (needs --checkpoint-dir)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir/last.pt (if there is one)")
    p.add_argument("--overwrite", action="store_true", help="start over, replacing --checkpoint-dir/last.pt")
    p.add_argument("--out", default=None, help="folder for metrics.json and loss.png")
    p.add_argument("--logdir", default=None, help="folder for TensorBoard scalars (needs the tensorboard package)")
    p.add_argument("--seed", type=int, default=0, help=f"seeds data split, shuffling, init, dropout; 0..{MAX_SEED}")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--jit-compile", action="store_true",
                   help="trace the train step once and compile it (dtape.function(jit_compile=True))")
    p.add_argument("--jit-backend", choices=JIT_BACKENDS, default="inductor",
                   help="torch.compile backend for --jit-compile (none: the traced graph, not compiled)")
    return p


def parse_args(argv=None):
    """Parses and checks the command line; task defaults fill what is not given.

    Every mistake exits with status 2 and one line on stderr, before torch is imported
    (except to check that a non-CPU device exists) and before any training work.
    """
    args = build_parser().parse_args(argv)
    for key, value in tasks.DEFAULTS[args.task].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    check_numbers(args)
    check_flags(args)
    check_devices(args)
    check_launch(args)
    check_folders(args)
    return args


def check_numbers(args):
    for flag, value, example in (("--epochs", args.epochs, "--epochs 5"), ("--steps", args.steps, "--steps 100"),
                                 ("--batch-size", args.batch_size, "--batch-size 64"),
                                 ("--save-every", args.save_every, "--save-every 100")):
        if value is not None and value < 1:
            fail(f"{flag} must be 1 or more, got {value}; e.g. {example}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        fail(f"--lr must be a finite number above 0, got {args.lr}; e.g. --lr 0.01")
    if not 0.0 <= args.dropout < 1.0:  # also refuses nan
        fail(f"--dropout must be in [0, 1), got {args.dropout}; e.g. --dropout 0.1 (0 turns dropout off)")
    if not 0 <= args.seed <= MAX_SEED:
        fail(f"--seed must be in [0, {MAX_SEED}], got {args.seed}; e.g. --seed 0")


def check_flags(args):
    if args.resume and args.overwrite:
        fail("--resume and --overwrite exclude each other; --resume continues the checkpoint, "
             "--overwrite replaces it")
    for flag, given in (("--resume", args.resume), ("--overwrite", args.overwrite),
                        ("--save-every", args.save_every is not None)):
        if given and not args.checkpoint_dir:
            fail(f"{flag} needs --checkpoint-dir DIR (the folder of last.pt)")
    if args.jit_backend != "inductor" and not args.jit_compile:
        fail(f"--jit-backend {args.jit_backend} needs --jit-compile (the eager step is not compiled)")
    if args.logdir and importlib.util.find_spec("tensorboard") is None:
        fail("--logdir needs the tensorboard package: pip install tensorboard "
             "(or pip install -e '.[examples]')")


def check_devices(args):
    if args.devices is None:
        return
    names = args.devices.split(",")
    if any(c.isspace() for c in args.devices):
        fail(f"--devices {args.devices!r} contains spaces; write the list without them, e.g. --devices cpu:0,cpu:1")
    if "" in names:
        fail(f"--devices {args.devices!r} has an empty item; give comma-separated names, e.g. --devices cpu:0,cpu:1")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        fail(f"--devices names {twice[0]} twice; give each device once (CPU replicas: cpu:0,cpu:1,...)")
    if args.strategy == "one_device" and len(names) > 1:
        fail(f"--strategy one_device takes one device, got {len(names)} ({args.devices}); "
             f"use --strategy mirrored for several")
    for name in names:
        check_device(name)


def check_device(name):
    """Exits unless `name` is a device of this machine ('cpu', 'cpu:N' for CPU replicas, 'cuda:N', 'gpu:N', ...)."""
    lower = name.lower()
    if lower == "cpu" or (lower.startswith("cpu:") and lower[4:].isdigit()):
        return
    if lower.startswith("cpu"):
        fail(f"--devices: {name!r} is not a device name; use cpu, cpu:N (CPU replicas) or cuda:N")
    import torch as _torch  # only for a non-CPU device
    try:
        device = _torch.device("cuda" + lower[3:] if lower.startswith("gpu") else lower)
    except RuntimeError:
        fail(f"--devices: {name!r} is not a device name; use cpu, cpu:N (CPU replicas) or cuda:N")
    backend = getattr(_torch, device.type, None)
    try:
        count = backend.device_count() if backend.is_available() else 0
    except AttributeError:  # not a device module (e.g. "meta")
        count = 0
    if device.type == "cpu" or count == 0:
        fail(f"--devices: {name} does not exist on this machine (no {device.type} device); "
             "use cpu:0,cpu:1 to run replicas on the CPU")
    if (device.index or 0) >= count:
        fail(f"--devices: {name} does not exist on this machine ({count} {device.type} devices: "
             f"{device.type}:0 to {device.type}:{count - 1})")


def check_folders(args):
    """Creates --out, --checkpoint-dir and --logdir and writes a probe file in each, so that a folder
    that cannot be written fails now, not after training."""
    if not is_chief():
        return
    for flag, path in (("--out", args.out), ("--checkpoint-dir", args.checkpoint_dir), ("--logdir", args.logdir)):
        if path is None:
            continue
        if os.path.exists(path) and not os.path.isdir(path):
            fail(f"{flag} {path} is a file, not a folder; give a folder (it is created if missing)")
        try:
            os.makedirs(path, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".train-probe-", dir=path)
            os.close(fd)
            os.remove(probe)
        except OSError as e:
            fail(f"{flag} {path} cannot be written ({e.strerror}); give a folder you can write to")


# -- the run's settings, checked on --resume ----------------------------------------

def optimizer_config(args):
    return {"name": args.optimizer, "learning_rate": args.lr, **OPTIMIZER_SETTINGS[args.optimizer]}


def run_config(args, task):
    """The settings a checkpoint must share with the run that resumes it (plain data)."""
    return {"task": args.task, "seed": args.seed, "global_batch_size": args.batch_size,
            "model": task.model_config(args.dropout), "optimizer": optimizer_config(args)}


def _config_of_old_checkpoint(metrics):
    """run_config's fields that a checkpoint without "config" (older train.py) kept in its metrics."""
    return {"task": metrics["task"], "seed": metrics["seed"], "global_batch_size": metrics["global_batch_size"],
            "model": {"dropout": float(metrics.get("dropout") or 0.0)},
            "optimizer": {"name": metrics["optimizer"], "learning_rate": metrics["lr"]}}


_FLAGS = {("task",): "--task", ("seed",): "--seed", ("global_batch_size",): "--batch-size",
          ("model", "dropout"): "--dropout", ("optimizer", "name"): "--optimizer",
          ("optimizer", "learning_rate"): "--lr"}


def config_difference(saved, current, path=()):
    """The first setting of `saved` that `current` does not share, as (key path, saved, current), else None."""
    for key, value in saved.items():
        mine = current.get(key) if isinstance(current, dict) else None
        if isinstance(value, dict) and isinstance(mine, dict):
            found = config_difference(value, mine, path + (key,))
            if found:
                return found
        elif value != mine:
            return path + (key,), value, mine
    return None


def check_resumable(args, task, data):
    """Exits unless checkpoint `data` was made with this run's task, seed, batch size, model and optimizer."""
    saved = data.get("config") or _config_of_old_checkpoint(data["metrics"])
    found = config_difference(saved, run_config(args, task))
    if found is None:
        return
    key, theirs, mine = found
    flag = _FLAGS.get(key)
    setting = f"{flag} {theirs}, this run has {flag} {mine}" if flag else \
        f"{' '.join(key)} = {theirs}, this run has {mine}"
    fix = f"pass {flag} {theirs} to continue it" if flag else "use the code that made it to continue it"
    fail(f"--resume: {checkpoint_path(args)} was made with {setting}; {fix}, "
         "or start a new run with --overwrite or another --checkpoint-dir")


def checkpoint_path(args):
    return os.path.join(args.checkpoint_dir, CHECKPOINT_NAME)


def read_checkpoint(args):
    """The checkpoint's plain data and values, or None if there is none yet; exits if it cannot be read."""
    path = checkpoint_path(args)
    if not os.path.exists(path):
        return None
    try:
        return dtape.checkpoint.read(path)
    except dtape.checkpoint.CheckpointError as e:
        fail(f"{e}; move it away, or start over with --overwrite")


def _number(x, none=False):
    return (type(x) in (int, float) and math.isfinite(x)) or (none and x is None)


def _uint8_vector(x):
    return torch.is_tensor(x) and x.dtype == torch.uint8 and x.dim() == 1


def checkpoint_data_problem(data):
    """What makes checkpoint `data` unusable for a resumed run (a sentence), or None.

    The file's checksum only proves it is whole: whoever can write it can also
    write a valid checksum over any contents, so every value the run reads is
    checked here, once, instead of failing somewhere in the middle of it.
    """
    step, metrics = data.get("step"), data.get("metrics")
    if type(step) is not int or step < 0:
        return f"its step is {step!r:.40}, not a whole number >= 0"
    if not isinstance(metrics, dict):
        return f"its metrics are {type(metrics).__name__}, not a dict"
    loss = metrics.get("loss")
    if not isinstance(loss, list) or not all(_number(x) for x in loss):
        return "its metrics' loss is not a list of finite numbers"
    if len(loss) != step:
        return f"its step is {step} but its metrics hold {len(loss)} losses (one per step)"
    epochs = metrics.get("epochs")
    if not isinstance(epochs, list) or not all(
            isinstance(e, dict) and type(e.get("epoch")) is int
            and all(_number(e.get(k), none=True) for k in ("train_accuracy", "test_accuracy", "examples_per_second"))
            for e in epochs):
        return "its metrics' epochs are not a list of epoch records (epoch, accuracies, examples_per_second)"
    if not isinstance(metrics.get("sessions", []), list) or not all(isinstance(x, dict)
                                                                    for x in metrics.get("sessions", [])):
        return "its metrics' sessions are not a list of session records"
    if not _number(metrics.get("run_seconds"), none=True):
        return f"its metrics' run_seconds is {metrics.get('run_seconds')!r:.40}, not a number"
    config = data.get("config")
    if config is not None and not isinstance(config, dict):
        return f"its run settings (config) are {type(config).__name__}, not a dict"
    if config is None and not all(k in metrics for k in ("task", "seed", "global_batch_size", "optimizer", "lr")):
        return "it holds no run settings (config, nor task, seed, batch size, optimizer and lr in its metrics)"
    epoch_time = data.get("epoch_time")
    if epoch_time is not None and not (isinstance(epoch_time, dict) and _number(epoch_time.get("seconds"))
                                       and _number(epoch_time.get("examples"))):
        return "its epoch_time is not a dict of seconds and examples"
    if not _uint8_vector(data.get("rng")):
        return "its random state (rng) is missing or not a vector of bytes"
    for key in ("cuda_rng", "replica_rng"):
        states = data.get(key)
        if states is not None and not (isinstance(states, list) and all(_uint8_vector(x) for x in states)):
            return f"its {key} is not a list of byte vectors"
    return None


def check_checkpoint_data(args, data):
    """Exits with one line if checkpoint `data` cannot be continued (see checkpoint_data_problem)."""
    problem = checkpoint_data_problem(data)
    if problem:
        fail(f"{'--resume: ' if args.resume else ''}{checkpoint_path(args)} cannot be continued: {problem}; "
             "move it away, or start over with --overwrite")


def check_checkpoint(args, task):
    """Refuses to replace a checkpoint without --resume/--overwrite; on --resume, checks the settings.

    Returns the checkpoint to resume from (read's dict), or None to start at step 0.
    """
    if not args.checkpoint_dir or args.overwrite:
        return None
    if not os.path.exists(checkpoint_path(args)):
        if args.resume:
            print(f"{PROG}: --resume: no checkpoint at {checkpoint_path(args)} yet; starting at step 0",
                  file=sys.stderr)
        return None
    data = read_checkpoint(args)
    check_checkpoint_data(args, data)
    if not args.resume:
        fail(f"--checkpoint-dir {args.checkpoint_dir} already holds a checkpoint ({CHECKPOINT_NAME}, "
             f"step {int(data['step'])}); continue it with --resume, replace it with --overwrite, "
             "or choose another --checkpoint-dir")
    check_resumable(args, task, data)
    return data


# -- strategy and optimizer --------------------------------------------------------

def _world_size():
    """torchrun's WORLD_SIZE (1 when unset); a value that is not a whole number is a usage error."""
    value = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(value)
    except ValueError:
        fail(f"WORLD_SIZE={value!r} is not a whole number; unset it, or launch with torchrun")


def make_strategy(args):
    """The strategy named by --strategy, on --devices.

    multi_worker: MultiWorkerMirroredStrategy from torchrun's environment
    (one replica per process). `args` come from `parse_args`, whose
    `check_launch` has refused a single-process strategy under torchrun.
    """
    devices = args.devices.split(",") if args.devices else None
    if args.strategy == "multi_worker" and "WORLD_SIZE" not in os.environ:
        print(f"{PROG}: note: no torchrun environment (WORLD_SIZE unset): training as one worker; launch "
              "with torchrun for more (see launch/README.md)", file=sys.stderr)
    if args.strategy == "one_device":
        return dtape.distribute.OneDeviceStrategy(devices[0] if devices else "cpu")
    if args.strategy == "mirrored":
        return dtape.distribute.MirroredStrategy(devices=devices or ["cpu:0", "cpu:1"], seed=args.seed)
    return dtape.distribute.MultiWorkerMirroredStrategy(device=devices[0] if devices else None, seed=args.seed)


def check_launch(args):
    """The strategy fits how the job was launched (checked before any folder is made)."""
    world = _world_size()
    if args.strategy != "multi_worker" and world > 1:
        fail(f"--strategy {args.strategy} runs in one process, but this is one of WORLD_SIZE={world} processes "
             "(torchrun); every process would train its own copy and overwrite the others' checkpoints. "
             "Use --strategy multi_worker under torchrun (see launch/README.md)")
    if args.strategy == "multi_worker" and args.devices and len(args.devices.split(",")) > 1:
        fail(f"--strategy multi_worker runs one replica per process on one device; got --devices {args.devices}. "
             "Launch one process per device with torchrun instead (see launch/README.md)")


def make_optimizer(config):
    """The optimizer of `optimizer_config(args)`."""
    settings = {k: v for k, v in config.items() if k != "name"}
    if config["name"] == "adam":
        return dtape.optimizers.Adam(**settings)
    return dtape.optimizers.SGD(**settings)


def epoch_batches(data, seed, epoch, batch_size):
    """The epoch's global batches [(x [B, ...], y [B])], full batches only, shuffled by (seed, epoch)."""
    n = len(data["x_train"])
    order = np.random.default_rng([seed, epoch]).permutation(n)
    starts = range(0, n - batch_size + 1, batch_size)
    return [(data["x_train"][order[s:s + batch_size]], data["y_train"][order[s:s + batch_size]]) for s in starts]


# -- stopping on a signal -------------------------------------------------------------

class StopSignals:
    """While active, SIGINT and SIGTERM ask the training loop to stop after the current step.

    The handler only records the signal (the loop checks `signum` between
    steps); a second signal gets the previous handler (Ctrl-C twice raises
    KeyboardInterrupt at once; SIGTERM twice terminates). The same signal
    again within REPEAT_S seconds is the same request: torchrun passes the
    SIGINT or SIGTERM it gets on to its workers, which a Ctrl-C in the
    terminal or a scheduler's SIGTERM to the job already reached. A signal
    that was ignored (SIG_IGN) stays ignored. Handlers can only be set in
    the main thread; elsewhere this does nothing.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    REPEAT_S = 1.0
    clock = staticmethod(time.monotonic)

    def __init__(self):
        self.signum = None
        self._when = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                previous = signal.getsignal(signum)
                if previous is not signal.SIG_IGN:
                    self._previous[signum] = previous
                    signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum, frame):
        now = self.clock()
        if self.signum is None:
            self.signum, self._when = signum, now
            return
        if signum == self.signum and now - self._when < self.REPEAT_S:
            return
        previous = self._previous.get(signum)
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signum)

    @property
    def name(self):
        return signal.Signals(self.signum).name


class _NoStop:
    signum = None


def hook_wait_point(value, rank):
    """Where the test hook (TEST_WAIT_ENV) waits on this process: a step number as a str, a name, or ""."""
    if ":" not in value:
        return value
    return dict(item.split(":") for item in value.split(",")).get(str(rank), "")


# -- training -------------------------------------------------------------------------

class Trainer:
    """One training run: model, optimizer, strategy, counters and metrics."""

    def __init__(self, args, task):
        load_libraries()
        self.args, self.task, self.stop = args, task, _NoStop()
        # multi_worker: a signal reaches each worker at its own moment; they stop on the one they agreed on
        self.workers = args.strategy == "multi_worker"
        self.agreed_stop = None
        self.wait_at = hook_wait_point(os.environ.get(TEST_WAIT_ENV, ""), os.environ.get("RANK", "0"))
        self.config = run_config(args, task)
        self.strategy = make_strategy(args)
        n = self.strategy.num_replicas_in_sync
        if args.batch_size < n:  # legal (uneven batches), but some replicas then only wait: say so
            print(f"{PROG}: note: --batch-size {args.batch_size} is smaller than the {n} replicas: "
                  f"{n - args.batch_size} of them get no examples at any step", file=sys.stderr)
        torch.manual_seed(args.seed)
        self.data = task.load_data(args.seed)
        with self.strategy.scope():
            self.model = task.build_model(args.seed, dropout=args.dropout)
            self.optimizer = make_optimizer(self.config["optimizer"])
        self.step = self.first_step = 0
        self.seconds_before = 0.0  # run time of the sessions this one resumes
        self.epoch_time = {"seconds": 0.0, "examples": 0}  # the current epoch's training so far
        self.metrics = {"task": args.task, "strategy": args.strategy, "seed": args.seed,
                        "num_replicas": self.strategy.num_replicas_in_sync, "global_batch_size": args.batch_size,
                        "lr": args.lr, "optimizer": args.optimizer, "dropout": args.dropout, "loss": [],
                        "epochs": [], "sessions": [], "run_seconds": 0.0}
        self.writer = None
        self._started = time.perf_counter()  # reset by run()
        self.step_seconds = []  # wall time of each step of this session (the first one compiles, under --jit-compile)
        self.jit_function = None
        self._train_step = self._make_train_step()

    def _make_train_step(self):
        model, optimizer, task, global_batch = self.model, self.optimizer, self.task, self.args.batch_size
        wait_at = self.wait_at
        # Eager: the gradient all-reduce starts during the backward walk (DDP's overlap); nothing with one
        # replica. Compiled: apply_gradients traced in the replica step sums the gradients inside the graph.
        sync = None if self.args.jit_compile else dtape.distribute.GradientSync()

        def replica_step(batch):
            x, y = batch
            with dtape.GradientTape(gradient_sync=sync) as tape:
                loss = dtape.reduce_sum(task.per_example_loss(model, x, y)) / global_batch
            variables = model.trainable_variables
            grads = tape.gradient(loss, variables)
            optimizer.apply_gradients(zip(grads, variables))
            return loss

        if self.args.jit_compile:
            replica_step = self._compiled(replica_step)

        def step(batch):
            started = time.perf_counter()
            loss = reduced_step(batch)
            self.step_seconds.append(time.perf_counter() - started)
            return loss

        def reduced_step(batch):
            per_replica = self.strategy.run(replica_step, args=(batch,))
            if str(self.step + 1) == wait_at:
                self._wait_for_signal(f"step {self.step + 1}")
            if not self.workers:
                return float(self.strategy.reduce(dtape.distribute.ReduceOp.SUM, per_replica, axis=None))
            # The loss's all-reduce also sums every worker's stop requests: one collective, and every worker
            # learns after the same step that one of them was signalled (element-wise sum: same loss bits).
            loss = dtape.reshape(per_replica, [1])
            sums = self.strategy.reduce(dtape.distribute.ReduceOp.SUM,
                                        dtape.concat([loss, self.stop_request(loss.dtype)], 0), axis=None).numpy()
            self.agree_on_stop(sums[1:])
            return float(sums[0])
        return step

    def _compiled(self, replica_step):
        """`replica_step` as a dtape.function(jit_compile=True); the optimizer's slots are made first, so that
        the first step traces and compiles (a trace may not create variables after the first one)."""
        self.optimizer.build(self.model.trainable_variables)
        backend = None if self.args.jit_backend == "none" else self.args.jit_backend
        self.jit_function = dtape.function(replica_step, jit_compile=True, backend=backend)
        return self.jit_function

    def step_times(self):
        """This session's step times: {"compile_seconds" (the first step: trace + compile + its run, for
        --jit-compile), "first_step_seconds", "step_seconds" (median of the later steps), "trace_seconds"}."""
        times = self.step_seconds
        record = {"jit_compile": self.args.jit_compile,
                  "first_step_seconds": times[0] if times else None,
                  "step_seconds": float(np.median(times[1:])) if len(times) > 1 else None}
        if self.args.jit_compile:
            record.update(jit_backend=self.args.jit_backend, compile_seconds=record["first_step_seconds"],
                          trace_seconds=float(sum(self.jit_function.trace_seconds)),
                          traces=self.jit_function.trace_count)
        return record

    def _wait_for_signal(self, where, timeout=60.0):
        """Test hook (TEST_WAIT_ENV): a signal arriving in the middle of a step (or `where`), deterministically."""
        print(f"test hook: {where} waits for a signal (rank {os.environ.get('RANK', '0')}, pid {os.getpid()})",
              flush=True)
        deadline = time.monotonic() + timeout
        while self.stop.signum is None and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop_request(self, dtype):
        """This process's stop request: one count per StopSignals.SIGNALS (1 for the signal it got)."""
        return dtape.constant([1.0 if self.stop.signum == s else 0.0 for s in StopSignals.SIGNALS], dtype=dtype)

    def agree_on_stop(self, counts):
        """Records the signal every worker stops for, from the summed requests (SIGTERM before SIGINT)."""
        if self.agreed_stop is None:
            got = [s for s, n in zip(StopSignals.SIGNALS, counts) if n > 0]
            self.agreed_stop = max(got, key=lambda s: s == signal.SIGTERM) if got else None

    def agree_to_stop(self):
        """Whether to stop now; under multi_worker a collective, so that every worker decides alike."""
        if self.workers and self.agreed_stop is None:
            sums = self.strategy.reduce(dtape.distribute.ReduceOp.SUM, self.stop_request(torch.float32), axis=None)
            self.agree_on_stop(sums.numpy())
        return self.stop_requested()

    def stop_signum(self):
        """The signal the run stops for, or None. Workers go by what they agreed on only, never by their
        own signal alone: one that stopped a step earlier than its peers would pair its checkpoint's
        collectives with their training step's."""
        return self.agreed_stop if self.workers else self.stop.signum

    def stop_requested(self):
        """Whether a signal asked the run to stop (checked between steps)."""
        return self.stop_signum() is not None

    # -- checkpoints ----------------------------------------------------------
    def checkpoint_path(self):
        return checkpoint_path(self.args)

    def save(self):
        """Every worker calls it (a collective under multi_worker); dtape.checkpoint writes on rank 0 only."""
        if not self.args.checkpoint_dir:
            return
        if is_chief():
            os.makedirs(self.args.checkpoint_dir, exist_ok=True)
        dtape.checkpoint.save(self.checkpoint_path(), model=self.model, optimizer=self.optimizer,
                              step=self.step, metrics=self.metrics_now(), config=self.config,
                              epoch_time=self.epoch_time, **self.rng_states())

    def metrics_now(self):
        """The metrics with the run time so far (what a checkpoint stores)."""
        self.metrics["run_seconds"] = self.elapsed()
        return self.metrics

    def restore(self):
        """Continues from the checkpoint (checked by `check_checkpoint` first); prints "resumed from step N"."""
        self.optimizer.build(self.model.trainable_variables)  # the slots restore fills
        try:
            data = dtape.checkpoint.restore(self.checkpoint_path(), model=self.model, optimizer=self.optimizer)
        except dtape.checkpoint.CheckpointError as e:
            fail(f"{e}; move it away, or start over with --overwrite")
        except ValueError as e:  # variables that do not fit: names, shapes, dtypes, counts (nothing was assigned)
            fail(f"--resume: {self.checkpoint_path()} does not fit this run's model and optimizer ({e}); "
                 "start over with --overwrite or another --checkpoint-dir")
        check_checkpoint_data(self.args, data)  # what restore read, which may not be the file checked before
        self.step = self.first_step = int(data["step"])
        self.metrics = data["metrics"]
        self.metrics.update(strategy=self.args.strategy, num_replicas=self.strategy.num_replicas_in_sync)
        self.metrics.setdefault("sessions", [])
        self.seconds_before = float(self.metrics.get("run_seconds") or 0.0)
        self.epoch_time = data.get("epoch_time") or {"seconds": 0.0, "examples": 0}
        self.set_rng_states(data)
        print(f"resumed from step {self.step} ({self.checkpoint_path()})", flush=True)

    def rng_states(self):
        """Every random state a step draws from, as checkpoint data (uint8 CPU tensors and lists of them)."""
        states = {"rng": torch.get_rng_state()}
        if torch.cuda.is_available():
            states["cuda_rng"] = torch.cuda.get_rng_state_all()
        if hasattr(self.strategy, "get_rng_state"):  # one generator per replica (MirroredStrategy)
            states["replica_rng"] = self.strategy.get_rng_state()
        return states

    def set_rng_states(self, data):
        """Restores `rng_states()`; a state that does not fit this run is skipped, with a warning."""
        try:
            torch.set_rng_state(data["rng"])
        except RuntimeError as e:  # bytes of another length: not a state torch wrote
            fail(f"--resume: {self.checkpoint_path()} cannot be continued: its random state (rng) is not one torch "
                 f"can restore ({e}); move it away, or start over with --overwrite")
        skipped = []
        cuda = data.get("cuda_rng")
        if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        elif cuda is not None:
            skipped.append("CUDA generators (saved with other GPUs)")
        replica = data.get("replica_rng")
        if replica is not None and hasattr(self.strategy, "set_rng_state"):
            try:
                self.strategy.set_rng_state(replica)
            except (TypeError, ValueError) as e:
                skipped.append(f"replica generators ({e})")
        elif replica is not None or hasattr(self.strategy, "set_rng_state"):
            skipped.append("replica generators (saved under another strategy)")
        if skipped:
            print(f"--resume: random state not restored for {'; '.join(skipped)}; the run continues, "
                  "but not bit-identically", file=sys.stderr)

    # -- training ---------------------------------------------------------------
    def steps_per_epoch(self):
        n = len(self.data["x_train"])
        if self.args.batch_size > n:
            fail(f"--batch-size {self.args.batch_size} is larger than the {self.args.task} training set "
                 f"({n} examples); use --batch-size {n} or less")
        return n // self.args.batch_size

    def total_steps(self, steps_per_epoch):
        full = self.args.epochs * steps_per_epoch
        return full if self.args.steps is None else min(self.args.steps, full)

    def elapsed(self):
        """Run time in seconds over every session of this run (resumed ones included)."""
        return self.seconds_before + time.perf_counter() - self._started

    def run(self):
        """Trains up to the last step, evaluates, saves, writes --out and returns the metrics.

        After SIGINT/SIGTERM see `interrupted` and `finish`: both exit with 128 + the signal.
        """
        steps_per_epoch = self.steps_per_epoch()
        total = self.total_steps(steps_per_epoch)
        self._started = time.perf_counter()
        self.open_writer()
        bar = progress_bar(total, self.step, disable=self.args.no_progress or not is_chief())
        try:
            with StopSignals() as self.stop:  # also covers the final evaluation, save and outputs
                while self.step < total and not self.stop_requested():
                    self.run_epoch(self.step // steps_per_epoch, steps_per_epoch, total, bar)
                bar.close()
                if self.step < total:  # a signal came first
                    self.interrupted()  # exits
                self.finish()
        finally:
            if self.writer is not None:
                self.writer.close()
        return self.metrics

    def run_epoch(self, epoch, steps_per_epoch, total, bar):
        batches = epoch_batches(self.data, self.args.seed, epoch, self.args.batch_size)
        first = self.step - epoch * steps_per_epoch
        remaining = batches[first:first + total - self.step]
        t = time.perf_counter()
        for batch in self.strategy.experimental_distribute_dataset(remaining):
            loss = self._train_step(batch)
            self.metrics["loss"].append(loss)
            self.step += 1
            self.epoch_time["seconds"] += time.perf_counter() - t
            self.epoch_time["examples"] += self.args.batch_size
            bar.update(1)
            bar.set_postfix(epoch=epoch, loss=f"{loss:.4f}", refresh=False)
            self.log_scalars(loss=loss, learning_rate=self.learning_rate())
            if self.step % steps_per_epoch == 0:
                self.end_epoch(epoch, bar)
            elif self.args.save_every and self.step % self.args.save_every == 0:
                self.save()
            if self.stop_requested():
                return
            t = time.perf_counter()

    def end_epoch(self, epoch, bar):
        seconds, examples = self.epoch_time["seconds"], self.epoch_time["examples"]  # over resumed sessions too
        self.epoch_time = {"seconds": 0.0, "examples": 0}
        record = {"epoch": epoch, "step": self.step, "train_accuracy": self.accuracy("train"),
                  "test_accuracy": self.accuracy("test"), "seconds": seconds,
                  "examples_per_second": examples / seconds if seconds > 0 else None}
        self.log_scalars(**{"accuracy/train": record["train_accuracy"], "accuracy/test": record["test_accuracy"],
                            "examples_per_second": record["examples_per_second"]})
        self.metrics["epochs"].append(record)
        if is_chief():
            bar.write(f"epoch {epoch}: train acc {record['train_accuracy']:.4f}, "
                      f"test acc {record['test_accuracy']:.4f}, {record['examples_per_second']:.0f} examples/s")
        self.save()

    def accuracy(self, split):
        return self.task.accuracy(self.model, self.data[f"x_{split}"], self.data[f"y_{split}"])

    def learning_rate(self):
        lr = self.optimizer.learning_rate
        return float(lr(self.step)) if callable(lr) else float(lr)

    def end_session(self, stopped_by):
        m = self.metrics
        m["final_step"] = self.step
        m["sessions"].append({"first_step": self.first_step, "last_step": self.step,
                              "seconds": time.perf_counter() - self._started, "stopped_by": stopped_by,
                              **self.step_times()})
        m["run_seconds"] = self.elapsed()
        speeds = [e["examples_per_second"] for e in m["epochs"] if e["examples_per_second"]]
        m["examples_per_second"] = float(np.mean(speeds)) if speeds else None

    def finish(self):
        """After the last step: final evaluation, checkpoint, --out, the final line.

        A signal before the evaluation is done stops as between steps (see
        `interrupted`; the evaluation is skipped and --resume does it). One
        that comes later lets the checkpoint and the outputs be finished
        (never half-written), then exits with 128 + the signal and the
        "stopped by" line.
        """
        self.metrics.pop("stopped_by", None)
        for split in ("train", "test"):
            if self.stop.signum is None:
                self.metrics[f"final_{split}_accuracy"] = self.accuracy(split)
            if split == "train" and self.wait_at == "evaluation":
                self._wait_for_signal("the final evaluation")
        if self.agree_to_stop():
            self.interrupted()  # exits
        self.end_session(None)
        self.save()
        if self.args.out and is_chief():
            between = (lambda: self._wait_for_signal("writing the outputs")) if self.wait_at == "outputs" else None
            write_outputs(self.metrics, self.args.out, between)
        if is_chief():
            print(timing_line(self.metrics["sessions"][-1]), flush=True)
            print(f"final test accuracy {self.metrics['final_test_accuracy']:.4f} after {self.metrics['final_step']} "
                  f"steps ({self.metrics['run_seconds']:.1f} s)", flush=True)
        if self.stop.signum is not None:  # came after the evaluation: the run is complete, and saved
            print(f"{PROG}: stopped by {self.stop.name} after step {self.step}, the last one; the run had finished "
                  f"({self.saved_where()})", file=sys.stderr, flush=True)
            raise SystemExit(128 + self.stop.signum)

    def saved_where(self):
        return f"saved {self.checkpoint_path()}" if self.args.checkpoint_dir else "no --checkpoint-dir, nothing saved"

    def interrupted(self):
        """After a stop signal: saves (if this session trained), writes --out, exits with 128 + the signal.

        No evaluation: a batch scheduler waits only a few seconds after SIGTERM.
        Under multi_worker every worker gets here after the same step (they
        agreed on it), so their checkpoint collectives pair.
        """
        signum = self.stop_signum()
        name = signal.Signals(signum).name
        self.metrics["stopped_by"] = name
        for key in ("final_train_accuracy", "final_test_accuracy"):
            self.metrics.pop(key, None)
        self.end_session(name)
        if self.step > self.first_step:
            self.save()
        if self.args.out and is_chief():
            write_outputs(self.metrics, self.args.out)
        saved = f"saved {self.checkpoint_path()}; continue with --resume" if self.args.checkpoint_dir else \
            "no --checkpoint-dir, nothing saved"
        by = name if self.stop.signum is not None or not self.workers else f"{name} (sent to another worker)"
        print(f"{PROG}: stopped by {by} after step {self.step}; {saved}", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    # -- TensorBoard --------------------------------------------------------------
    def open_writer(self):
        if self.args.logdir and is_chief():
            from torch.utils.tensorboard import SummaryWriter
            # purge_step drops events a killed session logged after the checkpoint it resumes from
            self.writer = SummaryWriter(self.args.logdir, purge_step=self.step or None)

    def log_scalars(self, **scalars):
        if self.writer is None:
            return
        for tag, value in scalars.items():
            if value is not None:
                self.writer.add_scalar(tag, value, self.step)


def timing_line(session):
    """The step times of a session record: under --jit-compile the first step (trace + compile) apart."""
    steady = (f"then {session['step_seconds'] * 1e3:.2f} ms per step (median of the later steps)"
              if session["step_seconds"] is not None else "no later step timed")
    if session["first_step_seconds"] is None:
        return "no step run in this session"
    if session["jit_compile"]:
        return (f"compiled step ({session['jit_backend']}): first step {session['compile_seconds']:.2f} s "
                f"(trace {session['trace_seconds']:.2f} s + compile + run), {steady}")
    return f"eager step: first step {session['first_step_seconds']:.3f} s, {steady}"


def is_chief():
    """True on the process that writes files (rank 0 under torchrun, or a single process)."""
    return int(os.environ.get("RANK", "0")) == 0


def progress_bar(total, initial, disable):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, unit="step", disable=disable, dynamic_ncols=True)


def plot_metrics(metrics):
    """A matplotlib Figure (Agg canvas, no pyplot): loss per step (left), train/test accuracy per epoch (right)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    loss_ax, acc_ax = fig.subplots(1, 2)
    loss_ax.plot(range(1, len(metrics["loss"]) + 1), metrics["loss"], lw=1)
    loss_ax.set(xlabel="step", ylabel="loss", yscale="log", title="training loss")
    epochs = [e["epoch"] for e in metrics["epochs"]]
    for split in ("train", "test"):
        if epochs:
            acc_ax.plot(epochs, [e[f"{split}_accuracy"] for e in metrics["epochs"]], marker="o", label=split)
        elif metrics.get(f"final_{split}_accuracy") is not None:  # a run shorter than one epoch
            acc_ax.bar(split, metrics[f"final_{split}_accuracy"], label=split)
    if epochs:
        acc_ax.set(xlabel="epoch", title="accuracy per epoch")
    else:
        acc_ax.set(xlabel=f"after step {metrics.get('final_step')}", title="accuracy (no full epoch)", ylim=(0, 1))
    acc_ax.set(ylabel="accuracy")
    acc_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    acc_ax.legend(loc="lower right")
    n = metrics["num_replicas"]
    fig.suptitle(f"{metrics['task']} ({metrics['strategy']}, {n} replica{'s' if n != 1 else ''})")
    fig.tight_layout()
    return fig


def write_outputs(metrics, out, between=None):
    """Writes out/metrics.json and out/loss.png, each atomically; returns the plotted Figure.

    `between`: called after metrics.json (a test hook).
    """
    os.makedirs(out, exist_ok=True)
    replace_file(os.path.join(out, "metrics.json"), lambda f: f.write(json.dumps(metrics, indent=1).encode()))
    if between is not None:
        between()
    fig = plot_metrics(metrics)
    replace_file(os.path.join(out, "loss.png"), lambda f: fig.savefig(f, format="png", dpi=100))
    return fig


def replace_file(path, write):
    """Writes a file through `write(binary file)` into a temporary beside it, then renames it over `path`:
    a process killed meanwhile (a second signal) leaves the old file or the new one, never half of one."""
    folder, base = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{base}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:  # the mode the umask gives, as open(path, "w") did
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def main(argv=None):
    """Runs the job; returns the metrics dict (after SIGINT/SIGTERM: saves, then exits with 130/143)."""
    args = parse_args(argv)
    load_libraries()
    try:
        task = tasks.get_task(args.task)
    except NotImplementedError as e:
        raise SystemExit(f"train.py: {e}") from None
    resume = check_checkpoint(args, task) is not None
    trainer = Trainer(args, task)
    if resume:
        trainer.restore()
    return trainer.run()  # also writes --out and the final line


if __name__ == "__main__":
    main()
