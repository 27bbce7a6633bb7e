"""Keras callbacks for `Model.fit` / `evaluate` / `predict` (also `dtape.keras.callbacks`).

A `Callback` gets Keras's hooks with `self.model` (the model being
trained) and `self.params` (`{"epochs", "steps", "verbose"}`). `logs`
are dicts of Python floats: the running epoch means of the metrics at a
batch's end, the epoch's values (and `val_*`) at an epoch's end. Files
(CSVLogger, ModelCheckpoint, TensorBoard, BackupAndRestore) are written on the worker that
checkpoints (rank 0 under MultiWorkerMirroredStrategy; the only one otherwise).
Source: tf.keras.callbacks (TF 2 / Keras 2 semantics).
"""
import csv
import os

import numpy as np
import torch
try:
    from torch.utils.tensorboard import SummaryWriter
except ImportError:   # the tensorboard package is optional (pip install tensorboard, or dtape's "examples" extra)
    SummaryWriter = None

from dtape import checkpoint as _checkpoint
from dtape import distribute
from dtape.tensor import Tensor

__all__ = ["Callback", "CallbackList", "History", "EarlyStopping", "LearningRateScheduler", "ReduceLROnPlateau",
           "CSVLogger", "ModelCheckpoint", "TensorBoard", "BackupAndRestore", "LambdaCallback"]

_HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_train_batch_begin",
          "on_train_batch_end", "on_test_begin", "on_test_end", "on_test_batch_begin", "on_test_batch_end",
          "on_predict_begin", "on_predict_end", "on_predict_batch_begin", "on_predict_batch_end")


class Callback:
    """Base class: override any of Keras's hooks; each gets `logs` (a dict, maybe empty).

    Hooks: on_train_begin/end(logs), on_epoch_begin/end(epoch, logs),
    on_train_batch_begin/end(batch, logs), on_test_begin/end(logs),
    on_test_batch_begin/end(batch, logs), on_predict_begin/end(logs),
    on_predict_batch_begin/end(batch, logs). Set `self.model.stop_training = True` to stop fit after
    this batch/epoch. Source: tf.keras.callbacks.Callback.
    """

    def __init__(self):
        self.model = None
        self.params = {}

    def set_model(self, model):
        self.model = model

    def set_params(self, params):
        self.params = params


def _noop(self, *args, **kwargs):
    del self, args, kwargs


for _hook in _HOOKS:
    setattr(Callback, _hook, _noop)


def _to_batch_hook(which):
    def hook(self, batch, logs=None):
        legacy = getattr(type(self), f"on_batch_{which}")  # looked up on the class: only an override is called
        if legacy is not _noop:
            legacy(self, batch, logs)
    hook.__name__ = f"on_train_batch_{which}"
    return hook


# Keras's older names: on_batch_begin/end are what on_train_batch_begin/end call unless overridden (TF's guides
# still write on_batch_end).
Callback.on_batch_begin = Callback.on_batch_end = _noop
Callback.on_train_batch_begin, Callback.on_train_batch_end = _to_batch_hook("begin"), _to_batch_hook("end")


class LambdaCallback(Callback):
    """A callback made of functions given by hook name, each called as that hook is (`on_epoch_end=lambda
    epoch, logs: ...`, `on_train_begin=lambda logs: ...`); `on_batch_begin` / `on_batch_end` are the
    training batches' hooks (Keras's older names).

    Raises TypeError for a name that is not a hook, or a value that is not callable.
    Source: tf.keras.callbacks.LambdaCallback.
    """

    def __init__(self, **hooks):
        super().__init__()
        for name, fn in hooks.items():
            hook = {"on_batch_begin": "on_train_batch_begin", "on_batch_end": "on_train_batch_end"}.get(name, name)
            if hook not in _HOOKS:
                raise TypeError(f"LambdaCallback: {name!r} is not a callback hook; use one of {list(_HOOKS)}")
            if fn is not None and not callable(fn):
                raise TypeError(f"LambdaCallback: {name} must be a function, got {fn!r}")
            if fn is not None:
                setattr(self, hook, fn)


class CallbackList:
    """Calls each hook on every callback in order (what fit uses). Source: tf.keras.callbacks.CallbackList."""

    def __init__(self, callbacks, model=None, **params):
        self.callbacks = list(callbacks)
        bad = [c for c in self.callbacks if not isinstance(c, Callback)]
        if bad:
            raise TypeError(f"callbacks must be dtape.keras.callbacks.Callback objects, got {bad[0]!r}")
        for c in self.callbacks:
            c.set_model(model)
            c.set_params(dict(params))

    def __getattr__(self, hook):
        if hook not in _HOOKS:
            raise AttributeError(hook)

        def call(*args):
            *head, logs = args if args and isinstance(args[-1], dict) else args + ({},)
            for c in self.callbacks:
                getattr(c, hook)(*head, logs)
        return call


def _writes(model):
    strategy = getattr(model, "_compiled", None)
    extended = getattr(getattr(strategy, "strategy", None), "extended", None)
    return getattr(extended, "should_checkpoint", True)


class History(Callback):
    """Records every epoch's logs: `history[name]` = list of per-epoch values, `epoch` = epochs run.

    `fit` returns it (also `model.history`). Source: tf.keras.callbacks.History.
    """

    def on_train_begin(self, logs=None):
        self.epoch, self.history = [], {}

    def on_epoch_end(self, epoch, logs=None):
        self.epoch.append(epoch)
        for k, v in (logs or {}).items():
            self.history.setdefault(k, []).append(v)


class _Monitor(Callback):
    """A monitored quantity with Keras's mode ("auto": max for names with "acc", else min) and min_delta."""

    def __init__(self, monitor, mode, min_delta):
        super().__init__()
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"mode must be 'auto', 'min' or 'max', got {mode!r}")
        self.monitor = monitor
        self.mode = mode if mode != "auto" else ("max" if "acc" in monitor or monitor.startswith("fmeasure")
                                                 else "min")
        self.min_delta = abs(min_delta)

    def _better(self, current, best):
        if self.mode == "min":
            return current + self.min_delta < best
        return current - self.min_delta > best

    def _initial(self):
        return np.inf if self.mode == "min" else -np.inf

    def _current(self, logs):
        value = (logs or {}).get(self.monitor)
        if value is None:
            raise KeyError(f"{type(self).__name__}: the monitored {self.monitor!r} is not in the logs "
                           f"{sorted(logs or {})}; pass validation_data for val_* or monitor one of those")
        return value


class EarlyStopping(_Monitor):
    """Stops training when `monitor` has not improved by more than `min_delta` for `patience` epochs.

    Args:
      monitor: a logs key (default "val_loss"); mode "auto" | "min" | "max".
      min_delta: the least change that counts as an improvement.
      patience: epochs without improvement before stopping.
      restore_best_weights: at the stop, set the model's variables back to
        the best epoch's (as Keras 2: only when it stops early).
      baseline: training stops if the monitor does not beat it within `patience` epochs.
    Attributes: `stopped_epoch` (0-based epoch at which it stopped, 0 if it did not), `best_epoch`.
    Raises KeyError at an epoch's end when `monitor` is not in the logs.
    Source: tf.keras.callbacks.EarlyStopping.
    """

    def __init__(self, monitor="val_loss", min_delta=0, patience=0, verbose=0, mode="auto", baseline=None,
                 restore_best_weights=False):
        super().__init__(monitor, mode, min_delta)
        self.patience, self.verbose, self.baseline = int(patience), verbose, baseline
        self.restore_best_weights = restore_best_weights

    def on_train_begin(self, logs=None):
        self.wait, self.stopped_epoch, self.best_epoch = 0, 0, 0
        self.best, self.best_weights = self._initial(), None

    def on_epoch_end(self, epoch, logs=None):
        current = self._current(logs)
        if self.restore_best_weights and self.best_weights is None:
            self.best_weights = _get_weights(self.model)
        self.wait += 1
        if self._better(current, self.best):
            self.best, self.best_epoch = current, epoch
            if self.restore_best_weights:
                self.best_weights = _get_weights(self.model)
            if self.baseline is None or self._better(current, self.baseline):
                self.wait = 0
                return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.model.stop_training = True
            if self.restore_best_weights and self.best_weights is not None:
                _set_weights(self.model, self.best_weights)


def _get_weights(model):
    return [v.numpy().copy() for v in model.variables]


def _set_weights(model, weights):
    for v, w in zip(model.variables, weights):
        v.assign(w)


def _lr(model):
    return float(model.optimizer.learning_rate)


class LearningRateScheduler(Callback):
    """Sets the optimizer's learning rate at each epoch's start to `schedule(epoch, lr)` (or `schedule(epoch)`).

    `epoch` is 0-based; `lr` the current rate (a float). The rate is logged as "lr".
    Raises ValueError for a schedule returning a non-finite or negative rate.
    Source: tf.keras.callbacks.LearningRateScheduler.
    """

    def __init__(self, schedule, verbose=0):
        super().__init__()
        self.schedule, self.verbose = schedule, verbose

    def on_epoch_begin(self, epoch, logs=None):
        try:
            lr = self.schedule(epoch, _lr(self.model))
        except TypeError:  # a one-argument schedule, as Keras accepts
            lr = self.schedule(epoch)
        lr = float(lr)
        if not np.isfinite(lr) or lr < 0:
            raise ValueError(f"LearningRateScheduler: schedule({epoch}) gave {lr}; a rate must be finite and >= 0")
        self.model.optimizer.learning_rate = lr

    def on_epoch_end(self, epoch, logs=None):
        logs["lr"] = _lr(self.model)


class ReduceLROnPlateau(_Monitor):
    """Multiplies the learning rate by `factor` when `monitor` has not improved for `patience` epochs.

    Args: monitor ("val_loss"), factor (< 1), patience, mode, min_delta
    (1e-4), cooldown (epochs to wait after a reduction), min_lr.
    Raises ValueError for factor >= 1. Source: tf.keras.callbacks.ReduceLROnPlateau.
    """

    def __init__(self, monitor="val_loss", factor=0.1, patience=10, verbose=0, mode="auto", min_delta=1e-4,
                 cooldown=0, min_lr=0.0):
        super().__init__(monitor, mode, min_delta)
        if factor >= 1.0:
            raise ValueError(f"ReduceLROnPlateau does not support a factor >= 1.0, got {factor}")
        self.factor, self.patience, self.verbose = float(factor), int(patience), verbose
        self.cooldown, self.min_lr = int(cooldown), float(min_lr)

    def on_train_begin(self, logs=None):
        self.wait, self.cooldown_counter, self.best = 0, 0, self._initial()

    def on_epoch_end(self, epoch, logs=None):
        logs["lr"] = _lr(self.model)
        current = self._current(logs)
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.wait = 0
        if self._better(current, self.best):
            self.best, self.wait = current, 0
        elif self.cooldown_counter <= 0:
            self.wait += 1
            if self.wait >= self.patience and _lr(self.model) > self.min_lr:
                self.model.optimizer.learning_rate = max(_lr(self.model) * self.factor, self.min_lr)
                self.cooldown_counter, self.wait = self.cooldown, 0


class CSVLogger(Callback):
    """Writes one CSV row per epoch: `epoch` then the logs' keys in sorted order (a header first).

    Args: filename, separator (","), append (keep an existing file and add rows, no second header).
    Source: tf.keras.callbacks.CSVLogger.
    """

    def __init__(self, filename, separator=",", append=False):
        super().__init__()
        self.filename, self.sep, self.append = os.fspath(filename), separator, append
        self._file = self._writer = self._keys = None

    def on_train_begin(self, logs=None):
        if not _writes(self.model):
            return
        has_header = self.append and os.path.exists(self.filename) and os.path.getsize(self.filename) > 0
        self._file = open(self.filename, "a" if self.append else "w", newline="")
        self._writer, self._keys = csv.writer(self._file, delimiter=self.sep), None
        self._header_done = has_header

    def on_epoch_end(self, epoch, logs=None):
        if self._file is None:
            return
        logs = logs or {}
        if self._keys is None:
            self._keys = sorted(logs)
            if not self._header_done:
                self._writer.writerow(["epoch"] + self._keys)
        self._writer.writerow([epoch] + [logs.get(k, "NA") for k in self._keys])
        self._file.flush()

    def on_train_end(self, logs=None):
        if self._file is not None:
            self._file.close()
            self._file = None


class ModelCheckpoint(_Monitor):
    """Saves the model at each epoch's end, or only when `monitor` improved (`save_best_only`).

    What is written depends on `filepath` and `save_weights_only`, as Keras 3 decides by the name:
      * a name ending in `.keras` (save_weights_only=False): the whole model, `model.save(path)` (a zip
        of its config and weights, see `dtape.saving`; the optimizer is not in it), reloaded with
        `dtape.keras.models.load_model(path)` or its weights with `model.load_weights(path)`;
      * save_weights_only=True: the model's variables, `model.save_weights(path)` (a dtape checkpoint,
        `dtape.checkpoint.Checkpoint(model=...)`). Keras 3's `.weights.h5` names are accepted, but the
        file is a dtape checkpoint (safetensors), NOT HDF5: h5py and Keras cannot read it;
        `model.load_weights(path)` can;
      * any other name (save_weights_only=False): a `dtape.checkpoint.Checkpoint(model=..., optimizer=...)`
        (tf.keras 2's TF checkpoint, the optimizer's slots included), read with `model.load_weights(path)`
        or `Checkpoint(model=model, optimizer=opt).read(path)`.
    Checkpoint files (not `.keras` archives) are recorded in the folder's state file `checkpoint`, so
    `dtape.train.latest_checkpoint(folder)` returns the file written last, as TF's.

    Args:
      filepath: a file path, formatted with `epoch` (1-based) and the logs' keys,
        e.g. "ckpt/weights.{epoch:02d}-{val_loss:.2f}", "ckpt/ckpt_{epoch}" or "best.keras".
      monitor, mode: as EarlyStopping (for save_best_only).
      save_freq: "epoch" (at each epoch's end), or an int: every that many
        batches (counted across epochs; the batch's logs are monitored and
        formatted, `epoch` is the current one), as Keras.
    Attributes: `best`, `saved` (the paths written, in order).
    Raises KeyError naming the missing key when `filepath` uses a key the logs lack (e.g. val_loss without
    validation_data); ValueError for a file named `checkpoint` (the state file's name), for a `.keras` name
    with save_weights_only=True (a `.keras` file is a whole model, as in Keras 3), and for an HDF5 name
    (`.h5`, `.hdf5`) with save_weights_only=False: dtape does not write HDF5 (use `.keras`).
    Source: tf.keras.callbacks.ModelCheckpoint (Keras 3's file-name rules).
    """

    def __init__(self, filepath, monitor="val_loss", verbose=0, save_best_only=False, save_weights_only=False,
                 mode="auto", save_freq="epoch"):
        super().__init__(monitor, mode, 0)
        if save_freq != "epoch" and (type(save_freq) is not int or save_freq < 1):
            raise ValueError(f"ModelCheckpoint: save_freq must be 'epoch' or a positive int (batches), "
                             f"got {save_freq!r}")
        self.filepath, self.verbose = _checkpoint.check_not_state_file(filepath), verbose
        self.save_best_only, self.save_weights_only, self.save_freq = save_best_only, save_weights_only, save_freq
        self.best, self.saved = self._initial(), []
        self._epoch, self._batches_seen = 0, 0
        self._whole_model = _checked_checkpoint_name(self.filepath, save_weights_only)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.save_freq == "epoch":
            return
        self._batches_seen += 1   # counted across epochs, as Keras
        if self._batches_seen % self.save_freq == 0:
            self._save(self._epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._save(epoch, logs)

    def _save(self, epoch, logs):
        logs = logs or {}
        if self.save_best_only:
            current = self._current(logs)
            if not self._better(current, self.best):
                return
            self.best = current
        try:
            path = self.filepath.format(epoch=epoch + 1, **logs)
        except KeyError as e:
            raise KeyError(f"ModelCheckpoint: filepath {self.filepath!r} uses {e.args[0]!r}, which is not in the "
                           f"logs {sorted(logs)} (nor 'epoch'); pass validation_data for val_* keys") from None
        if self._whole_model:
            if _writes(self.model):
                self.model.save(path)
            self.saved.append(path)
            return
        objects = {"model": self.model}
        if not self.save_weights_only:
            objects["optimizer"] = self.model.optimizer
        _checkpoint.Checkpoint(**objects).write_then(path, after=lambda: _checkpoint.record_latest(path))
        self.saved.append(path)


def _checked_checkpoint_name(filepath, save_weights_only):
    """True when ModelCheckpoint writes the whole model (a `.keras` name), False for a checkpoint; ValueError
    for the names Keras 3 refuses with these settings, and for HDF5 whole models (dtape writes no HDF5)."""
    name = os.fspath(filepath).lower()
    if name.endswith(".keras"):
        if save_weights_only:
            raise ValueError(f"ModelCheckpoint: filepath {filepath!r} ends in .keras, a whole model, but "
                             f"save_weights_only=True; name weights-only files e.g. 'ckpt.weights.h5' (Keras 3's "
                             f"name; the file is a dtape checkpoint, not HDF5) or 'ckpt/weights_{{epoch}}'")
        return True
    if name.endswith((".h5", ".hdf5")) and not save_weights_only:
        raise ValueError(f"ModelCheckpoint: filepath {filepath!r} asks for an HDF5 whole model (Keras 2's .h5 "
                         f"format), which dtape does not write; use a name ending in .keras for the whole model "
                         f"(dtape.keras.models.load_model reads it), or save_weights_only=True (a dtape checkpoint "
                         f"in safetensors, not HDF5, read by model.load_weights)")
    return False


class TensorBoard(Callback):
    """Writes every epoch's logs as scalars through `torch.utils.tensorboard.SummaryWriter`:
    `<log_dir>/train` (tags `epoch_<name>`) and `<log_dir>/validation` (the `val_*` values).

    Keras's other arguments are accepted at their defaults (histogram_freq=0, write_graph, write_images=False,
    update_freq="epoch", embeddings_freq=0, profile_batch); other values raise ValueError (not written here).
    Source: tf.keras.callbacks.TensorBoard (scalars per epoch only).
    """

    def __init__(self, log_dir="logs", histogram_freq=0, write_graph=True, write_images=False, write_steps_per_second=False,
                 update_freq="epoch", profile_batch=0, embeddings_freq=0, embeddings_metadata=None):
        super().__init__()
        unsupported = {k: v for k, v in (("histogram_freq", histogram_freq), ("write_images", write_images),
                                         ("write_steps_per_second", write_steps_per_second),
                                         ("embeddings_freq", embeddings_freq), ("embeddings_metadata", embeddings_metadata))
                       if v} | ({} if update_freq == "epoch" else {"update_freq": update_freq})
        if unsupported:
            raise ValueError(f"TensorBoard writes each epoch's scalars only; {unsupported} is not supported here")
        if SummaryWriter is None:
            raise ImportError("dtape.keras.callbacks.TensorBoard writes through torch.utils.tensorboard, which needs "
                              "the tensorboard package: pip install tensorboard")
        self.log_dir = os.fspath(log_dir)
        self._writers = {}

    def _writer(self, which):
        if which not in self._writers:
            self._writers[which] = SummaryWriter(os.path.join(self.log_dir, which))
        return self._writers[which]

    def on_epoch_end(self, epoch, logs=None):
        if not _writes(self.model):
            return
        for key, value in (logs or {}).items():
            which, name = ("validation", key[4:]) if key.startswith("val_") else ("train", key)
            self._writer(which).add_scalar(f"epoch_{name}", value, epoch)
        for w in self._writers.values():
            w.flush()

    def on_train_end(self, logs=None):
        for w in self._writers.values():
            w.close()
        self._writers = {}


class _TrainingState:
    """BackupAndRestore's plain data in its checkpoint (saved by `state_dict`, as a torch optimizer's state is)."""

    def __init__(self, read):
        self._read, self.loaded = read, None

    def state_dict(self):
        return self._read()

    def load_state_dict(self, state):
        self.loaded = state


class BackupAndRestore(Callback):
    """Backs up the training state to `backup_dir`; a new `fit` with this callback resumes from the backup.

    Args:
      backup_dir: folder (str or os.PathLike) for the one backup file,
        `<backup_dir>/backup`, overwritten at each backup (atomically: a kill
        during a write leaves the previous backup). Use it for nothing else.
      save_freq: "epoch" (a backup at each epoch's end) or a positive int N
        (a backup after every N batches, counted across epochs, as Keras 2).
      delete_checkpoint: delete the backup when fit completes (also when a
        callback stopped it); kept when fit raised or the process died.

    The backup is a `dtape.checkpoint.Checkpoint` of the model's variables,
    the optimizer's (slots and `iterations`: restored when the first step
    creates them), the metrics' running states, and the position: the epoch,
    the batches of it done, the random states the epoch's data order was
    drawn from (numpy's global RNG for fit's shuffle, torch's default
    generator and a DataLoader's own generators) and those of the moment of
    the backup (numpy's, torch's default generator, the strategy's replica
    generators, `strategy.get_rng_state()`). At `on_train_begin` a backup
    found is restored and fit continues at its epoch and batch: the epoch's
    order is drawn again from the saved states, its done batches skipped,
    so the resumed run's per-batch losses, metrics and variables are the
    uninterrupted run's (same data, model and callbacks; under the same
    strategy and number of replicas).

    Under MultiWorkerMirroredStrategy every worker takes part in each backup
    (dtape's checkpoint save is a collective: rank 0 writes, the others wait
    for the file; TF's Keras writes the others to temporary folders instead)
    and every worker restores from the same file: `backup_dir` must be
    visible to all. Numpy's and torch's global states restored are rank 0's
    (workers draw the data order alike, as the strategy requires); the
    replica generators are each worker's own.

    Raises:
      ValueError: a `save_freq` other than "epoch" or a positive int.
      As `dtape.checkpoint.Checkpoint.read` for a backup that does not fit
      the model (another architecture; CheckpointError for a corrupt file),
      and `set_rng_state`'s ValueError for a backup of another number of replicas.

    Source: tf.keras.callbacks.BackupAndRestore (Keras 2 semantics: save_freq
    in batches; the epoch's done batches are skipped on resume).

    Example:
      >>> backup = dtape.keras.callbacks.BackupAndRestore("/tmp/backup", save_freq=50)
      >>> model.fit(x, y, epochs=10, callbacks=[backup])   # killed? run the same line again
    """

    FILE_NAME = "backup"

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint=True):
        super().__init__()
        if save_freq != "epoch" and (type(save_freq) is not int or save_freq < 1):
            raise ValueError(f"BackupAndRestore: save_freq must be 'epoch' or a positive int (batches), "
                             f"got {save_freq!r}")
        self.backup_dir, self.save_freq = os.fspath(backup_dir), save_freq
        self.delete_checkpoint = bool(delete_checkpoint)
        self._epoch, self._batches_seen, self._checkpoint, self._state = 0, 0, None, None

    @property
    def backup_path(self):
        """The backup file, `<backup_dir>/backup`."""
        return os.path.join(self.backup_dir, self.FILE_NAME)

    def on_train_begin(self, logs=None):
        model = self.model
        self._state, self._batches_seen, self._position = _TrainingState(self._current_state), 0, (0, 0)
        self._checkpoint = _checkpoint.Checkpoint(model=model, optimizer=model.optimizer,
                                                  metrics=list(model.metrics), training_state=self._state)
        if not os.path.exists(self.backup_path):
            return
        self._checkpoint.read(self.backup_path).expect_partial()  # the optimizer's slots wait for the first step
        saved = self._state.loaded
        _check_replicas(model.distribute_strategy, saved, self.backup_path)
        _set_metric_rows(model.distribute_strategy, model.metrics, saved["metric_rows"])
        if saved["batch"] == 0:          # at an epoch's start: the random states are those the epoch starts with
            self._set_random(saved)
        model._resume_fit(saved["epoch"], saved["batch"], saved["order"], lambda: self._set_random(saved))

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.save_freq == "epoch":
            return
        self._batches_seen += 1
        if self._batches_seen >= self.save_freq:
            self._batches_seen = 0
            self._back_up(self._epoch, batch + 1)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._back_up(epoch + 1, 0)

    def on_train_end(self, logs=None):
        if self.delete_checkpoint:
            _checkpoint.remove_checkpoint(self.backup_path, self.model.distribute_strategy, folder_too=True)
        self._checkpoint = self._state = None

    def _back_up(self, epoch, batch):
        self._position = (epoch, batch)
        self._checkpoint.write(self.backup_path)

    def _current_state(self):
        strategy = self.model.distribute_strategy
        get_replicas = getattr(strategy, "get_rng_state", None)   # a collective under MultiWorkerMirroredStrategy
        return {"epoch": self._position[0], "batch": self._position[1], "order": self.model._fit_order_state(),
                "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                "replicas": None if get_replicas is None else get_replicas(),
                "metric_rows": _metric_rows(strategy, self.model.metrics)}

    def _set_random(self, saved):
        np.random.set_state(saved["numpy"])
        torch.set_rng_state(saved["torch"])
        if saved["replicas"] is not None:
            self.model.distribute_strategy.set_rng_state(saved["replicas"])


def _check_replicas(strategy, saved, path):
    """ValueError unless the backup's replica generators fit `strategy` (checked before anything is resumed)."""
    states = saved["replicas"]
    mine = strategy.num_replicas_in_sync if hasattr(strategy, "set_rng_state") else None
    theirs = None if states is None else len(states)
    if mine != theirs:
        raise ValueError(f"BackupAndRestore: the backup {path} was written by "
                         f"{'no strategy' if theirs is None else f'a strategy of {theirs} replicas'}, this fit "
                         f"runs {'without one' if mine is None else f'on {mine} replicas'}; resume under the same "
                         "strategy and number of replicas (or delete the backup to start over)")


def _components(var):
    parts = getattr(var, "values", None)
    return parts if isinstance(parts, tuple) and parts else (var,)


def _metric_rows(strategy, metrics):
    """Each metric state variable's replica components, [replicas, size] arrays (a collective across workers).

    The checkpoint keeps a metric's aggregate, which restore puts on one
    replica; the running sums then add up in another order and the resumed
    epoch's running means can differ in the last bit: these rows give each
    replica its own part back.
    """
    rows = []
    for var in (v for m in metrics for v in m.variables):
        parts = tuple(Tensor(torch.as_tensor(c.numpy()).reshape(1, -1)) for c in _components(var))
        rows.append(strategy.gather(distribute.PerReplica(parts), axis=0).numpy())
    return rows


def _set_metric_rows(strategy, metrics, rows):
    variables = [v for m in metrics for v in m.variables]
    if len(rows) != len(variables) or any(r.shape[0] != strategy.num_replicas_in_sync for r in rows):
        return      # other metrics or replicas: the checkpoint's aggregates stand
    resolver = getattr(strategy, "cluster_resolver", None)
    for var, row in zip(variables, rows):
        parts = _components(var)
        first = (getattr(resolver, "task_id", 0) or 0) * len(parts)   # this worker's first replica
        for i, part in enumerate(parts):
            part.assign(torch.as_tensor(row[first + i]).reshape(tuple(part.shape)))
