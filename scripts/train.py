#!/usr/bin/env python3
"""The main job: trains a task's model under a dtape.distribute strategy.

    python scripts/train.py --task digits --strategy mirrored --devices cpu:0,cpu:1 --out runs/digits

Each step: the global batch is split across replicas; in `strategy.run` each
replica computes its per-example losses, loss = sum / GLOBAL batch size,
takes `tape.gradient` and calls `optimizer.apply_gradients` (which all-reduces
the gradients); the step's loss is `strategy.reduce(SUM, ...)`. The loss is
therefore the same, up to float rounding, for any number of replicas.

Batches: each epoch shuffles the training set with a permutation derived from
(--seed, epoch) and drops the last short batch, so every strategy sees the
same global batches and a resumed run continues exactly where it stopped.

Random numbers: --dropout RATE adds the task's dropout layers. Under
--strategy mirrored the strategy is seeded with --seed and every replica draws
its masks from its own generator (seeded from (seed, replica id)), so a run
is reproducible whatever the thread schedule.

Outputs: --out DIR gets metrics.json (per-step loss, per-epoch train/test
accuracy, examples/second) and loss.png; --checkpoint-dir DIR gets last.pt,
written atomically at the end of each epoch and of the run; --resume continues
from it (model, optimizer, step counter, metrics so far, and every random
state: torch's default CPU and CUDA generators and the replicas' generators),
so a resumed run, dropout included, continues bit-identically.
Only the public dtape API is used.
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dtape  # noqa: E402
import dtape.distribute  # noqa: E402
import dtape.optimizers  # noqa: E402
import tasks  # noqa: E402

CHECKPOINT_NAME = "last.pt"


def parse_args(argv=None):
    """Parses the command line (API.md "Command line"); task defaults fill what is not given."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=tasks.TASKS, default="digits")
    p.add_argument("--strategy", choices=("one_device", "mirrored", "multi_worker"), default="one_device")
    p.add_argument("--devices", default=None, help="comma-separated, e.g. cpu:0,cpu:1 (default: cpu)")
    p.add_argument("--epochs", type=int, default=None, help="number of epochs (task default)")
    p.add_argument("--steps", type=int, default=None, help="stop after this many global steps in total")
    p.add_argument("--batch-size", type=int, default=None, help="GLOBAL batch size, split across replicas")
    p.add_argument("--lr", type=float, default=None, help="learning rate (task default)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default=None, help="(task default)")
    p.add_argument("--dropout", type=float, default=None, help="dropout rate in [0, 1) (task default: 0)")
    p.add_argument("--checkpoint-dir", default=None, help="save last.pt here after each epoch")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint-dir/last.pt")
    p.add_argument("--out", default=None, help="folder for metrics.json and loss.png")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = p.parse_args(argv)
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.dropout is not None and not 0.0 <= args.dropout < 1.0:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    return args


def make_strategy(args):
    """The strategy named by --strategy, on --devices.

    multi_worker: MultiWorkerMirroredStrategy from torchrun's environment
    (one replica per process). A single-process strategy under torchrun with
    WORLD_SIZE > 1 would train duplicate copies that overwrite each other's
    files: it exits with a message pointing to multi_worker.
    """
    devices = args.devices.split(",") if args.devices else None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.strategy != "multi_worker" and world > 1:
        raise SystemExit(f"train.py: --strategy {args.strategy} runs in one process, but this is one of "
                         f"WORLD_SIZE={world} processes (torchrun); every process would train its own copy and "
                         "overwrite the others' checkpoints. Use --strategy multi_worker under torchrun.")
    if args.strategy == "one_device":
        return dtape.distribute.OneDeviceStrategy(devices[0] if devices else "cpu")
    if args.strategy == "mirrored":
        return dtape.distribute.MirroredStrategy(devices=devices or ["cpu:0", "cpu:1"], seed=args.seed)
    if devices and len(devices) > 1:
        raise SystemExit("train.py: --strategy multi_worker runs one replica per process on one device; "
                         f"got --devices {args.devices}. Launch one process per device with torchrun instead.")
    return dtape.distribute.MultiWorkerMirroredStrategy(device=devices[0] if devices else None, seed=args.seed)


def make_optimizer(name, lr):
    if name == "adam":
        return dtape.optimizers.Adam(learning_rate=lr)
    return dtape.optimizers.SGD(learning_rate=lr, momentum=0.9)


def epoch_batches(data, seed, epoch, batch_size):
    """The epoch's global batches [(x [B, ...], y [B])], full batches only, shuffled by (seed, epoch)."""
    n = len(data["x_train"])
    order = np.random.default_rng([seed, epoch]).permutation(n)
    starts = range(0, n - batch_size + 1, batch_size)
    return [(data["x_train"][order[s:s + batch_size]], data["y_train"][order[s:s + batch_size]]) for s in starts]


class Trainer:
    """One training run: model, optimizer, strategy, counters and metrics."""

    def __init__(self, args, task):
        self.args, self.task = args, task
        self.strategy = make_strategy(args)
        torch.manual_seed(args.seed)
        self.data = task.load_data(args.seed)
        with self.strategy.scope():
            self.model = task.build_model(args.seed, dropout=args.dropout)
            self.optimizer = make_optimizer(args.optimizer, args.lr)
        self.step = 0
        self.metrics = {"task": args.task, "strategy": args.strategy, "seed": args.seed,
                        "num_replicas": self.strategy.num_replicas_in_sync, "global_batch_size": args.batch_size,
                        "lr": args.lr, "optimizer": args.optimizer, "dropout": args.dropout, "loss": [],
                        "epochs": []}
        self._train_step = self._make_train_step()

    def _make_train_step(self):
        model, optimizer, task, global_batch = self.model, self.optimizer, self.task, self.args.batch_size

        def replica_step(batch):
            x, y = batch
            with dtape.GradientTape() as tape:
                loss = dtape.reduce_sum(task.per_example_loss(model, x, y)) / global_batch
            variables = model.trainable_variables
            grads = tape.gradient(loss, variables)
            optimizer.apply_gradients(zip(grads, variables))
            return loss

        def step(batch):
            per_replica = self.strategy.run(replica_step, args=(batch,))
            return float(self.strategy.reduce(dtape.distribute.ReduceOp.SUM, per_replica, axis=None))
        return step

    # -- checkpoints ----------------------------------------------------------
    def checkpoint_path(self):
        return os.path.join(self.args.checkpoint_dir, CHECKPOINT_NAME)

    def save(self):
        """Every worker calls it (a collective under multi_worker); dtape.checkpoint writes on rank 0 only."""
        if not self.args.checkpoint_dir:
            return
        if is_chief():
            os.makedirs(self.args.checkpoint_dir, exist_ok=True)
        dtape.checkpoint.save(self.checkpoint_path(), model=self.model, optimizer=self.optimizer,
                              step=self.step, metrics=self.metrics, **self.rng_states())

    def restore(self):
        """Restores the last checkpoint if there is one; returns whether it did."""
        if not os.path.exists(self.checkpoint_path()):
            print(f"--resume: no checkpoint at {self.checkpoint_path()}, starting from scratch", file=sys.stderr)
            return False
        self._create_optimizer_slots()
        data = dtape.checkpoint.restore(self.checkpoint_path(), model=self.model, optimizer=self.optimizer)
        self.step, self.metrics = int(data["step"]), data["metrics"]
        self.metrics.update(strategy=self.args.strategy, num_replicas=self.strategy.num_replicas_in_sync)
        self.set_rng_states(data)
        return True

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
        torch.set_rng_state(data["rng"])
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

    def _create_optimizer_slots(self):
        """Makes the optimizer create its slots so that restore can fill them."""
        self.optimizer.build(self.model.trainable_variables)

    # -- training ---------------------------------------------------------------
    def total_steps(self, steps_per_epoch):
        full = self.args.epochs * steps_per_epoch
        return full if self.args.steps is None else min(self.args.steps, full)

    def run(self):
        steps_per_epoch = len(self.data["x_train"]) // self.args.batch_size
        if steps_per_epoch == 0:
            raise ValueError(f"--batch-size {self.args.batch_size} is larger than the training set "
                             f"({len(self.data['x_train'])} examples)")
        total = self.total_steps(steps_per_epoch)
        bar = progress_bar(total, self.step, disable=self.args.no_progress or not is_chief())
        start = time.perf_counter()
        while self.step < total:
            self.run_epoch(self.step // steps_per_epoch, steps_per_epoch, total, bar)
        bar.close()
        self.finish(time.perf_counter() - start)
        return self.metrics

    def run_epoch(self, epoch, steps_per_epoch, total, bar):
        batches = epoch_batches(self.data, self.args.seed, epoch, self.args.batch_size)
        first = self.step - epoch * steps_per_epoch
        remaining = batches[first:first + total - self.step]
        t0 = time.perf_counter()
        for batch in self.strategy.experimental_distribute_dataset(remaining):
            loss = self._train_step(batch)
            self.metrics["loss"].append(loss)
            self.step += 1
            bar.update(1)
            bar.set_postfix(epoch=epoch, loss=f"{loss:.4f}", refresh=False)
        seconds = time.perf_counter() - t0
        if self.step % steps_per_epoch == 0:
            self.end_epoch(epoch, len(remaining) * self.args.batch_size, seconds, bar)

    def end_epoch(self, epoch, examples, seconds, bar):
        record = {"epoch": epoch, "step": self.step, "train_accuracy": self.accuracy("train"),
                  "test_accuracy": self.accuracy("test"), "seconds": seconds,
                  "examples_per_second": examples / seconds if seconds > 0 else None}
        self.metrics["epochs"].append(record)
        if is_chief():
            bar.write(f"epoch {epoch}: train acc {record['train_accuracy']:.4f}, "
                      f"test acc {record['test_accuracy']:.4f}, {record['examples_per_second']:.0f} examples/s")
        self.save()

    def accuracy(self, split):
        return self.task.accuracy(self.model, self.data[f"x_{split}"], self.data[f"y_{split}"])

    def finish(self, seconds):
        m = self.metrics
        m["final_step"] = self.step
        m["final_train_accuracy"], m["final_test_accuracy"] = self.accuracy("train"), self.accuracy("test")
        m["run_seconds"] = seconds
        speeds = [e["examples_per_second"] for e in m["epochs"] if e["examples_per_second"]]
        m["examples_per_second"] = float(np.mean(speeds)) if speeds else None
        self.save()


def is_chief():
    """True on the process that writes files (rank 0 under torchrun, or a single process)."""
    return int(os.environ.get("RANK", "0")) == 0


def progress_bar(total, initial, disable):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, unit="step", disable=disable, dynamic_ncols=True)


def write_outputs(metrics, out):
    """Writes out/metrics.json and out/loss.png."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "metrics.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(range(len(metrics["loss"])), metrics["loss"], lw=1)
    ax.set(xlabel="step", ylabel="loss", yscale="log",
           title=f"{metrics['task']} ({metrics['strategy']}, {metrics['num_replicas']} replicas)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=100)
    plt.close(fig)


def main(argv=None):
    """Runs the job; returns the metrics dict."""
    args = parse_args(argv)
    try:
        task = tasks.get_task(args.task)
    except NotImplementedError as e:
        raise SystemExit(f"train.py: {e}") from None
    for key, value in task.DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    trainer = Trainer(args, task)
    if args.resume:
        trainer.restore()
    metrics = trainer.run()
    if args.out and is_chief():
        write_outputs(metrics, args.out)
    if is_chief():
        print(f"final test accuracy {metrics['final_test_accuracy']:.4f} after {metrics['final_step']} steps "
              f"({metrics['run_seconds']:.1f} s)")
    return metrics


if __name__ == "__main__":
    main()
