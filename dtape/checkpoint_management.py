"""CheckpointManager: numbered checkpoints in a folder, the newest `max_to_keep` kept.

The state is the folder itself: the files `<checkpoint_name>-<n>`, ordered by
number (TF keeps a state file ordered by save time; since a save here may not
take a number below the latest kept one, the two orders agree), so a new
manager on the same folder finds what an earlier run left. Also
`dtape.checkpoint.CheckpointManager`.
Source: tf.train.CheckpointManager (tensorflow/python/checkpoint/checkpoint_management.py).
"""
import os

import numpy as np

from dtape import checkpoint as _checkpoint

__all__ = ["CheckpointManager"]

_REQUIRED = object()


class CheckpointManager:
    """Saves numbered checkpoints `<directory>/<checkpoint_name>-<n>` and keeps the newest `max_to_keep`.

    Args:
      checkpoint: the `dtape.checkpoint.Checkpoint` to save (TF's form). A
        folder (str or os.PathLike) instead gives the keyword form
        `CheckpointManager(directory, max_to_keep=...)`, whose `save` takes
        the objects as keywords (as `dtape.checkpoint.save`).
      directory: folder for the checkpoints (str or os.PathLike); created by
        the first `save`.
      max_to_keep: how many checkpoints to keep (a positive int), or None to
        keep all; required, as in TF.
      keep_checkpoint_every_n_hours: only None (checkpoints to keep longer
        are copied elsewhere; `max_to_keep=None` keeps all).
      checkpoint_name: the file prefix (default "ckpt", as TF).
      init_fn: called by `restore_or_initialize` when there is no checkpoint.

    Raises:
      TypeError: `checkpoint` is neither a Checkpoint nor a folder, or
        `max_to_keep` is missing.
      ValueError: `max_to_keep` is not a positive int or None; a bad
        `checkpoint_name`; `keep_checkpoint_every_n_hours` is set.

    Under MultiWorkerMirroredStrategy every worker calls `save` (a
    collective, as `dtape.checkpoint.save`); rank 0 writes the file and
    deletes old ones, the others wait for it. The folder must be visible to
    every worker.
    Source: tf.train.CheckpointManager.

    Example:
      >>> ckpt = dtape.checkpoint.Checkpoint(model=model, optimizer=opt)
      >>> manager = dtape.checkpoint.CheckpointManager(ckpt, "/tmp/run", max_to_keep=3)
      >>> ckpt.restore(manager.latest_checkpoint)      # None on the first run: nothing restored
      >>> manager.save()                               # /tmp/run/ckpt-<save_counter>
    """

    def __init__(self, checkpoint, directory=None, max_to_keep=_REQUIRED, keep_checkpoint_every_n_hours=None,
                 checkpoint_name="ckpt", init_fn=None):
        if isinstance(checkpoint, (str, os.PathLike)):
            if directory is not None:
                raise TypeError("CheckpointManager: give CheckpointManager(checkpoint, directory, max_to_keep) or "
                                "CheckpointManager(directory, max_to_keep=...), not a folder as the checkpoint")
            checkpoint, directory = None, checkpoint
        elif not isinstance(checkpoint, _checkpoint.Checkpoint) or directory is None:
            raise TypeError(f"CheckpointManager(checkpoint, directory, max_to_keep): checkpoint must be a "
                            f"dtape.checkpoint.Checkpoint and directory a folder, got {type(checkpoint).__name__} "
                            f"and {directory!r}")
        if max_to_keep is _REQUIRED:
            raise TypeError("CheckpointManager: max_to_keep is required (a positive int, or None to keep all)")
        _check_options(max_to_keep, checkpoint_name, keep_checkpoint_every_n_hours)
        self._checkpoint = checkpoint
        self._directory = os.fspath(directory)
        self._max_to_keep = max_to_keep
        self._checkpoint_name = checkpoint_name
        self._init_fn = init_fn

    @property
    def checkpoint(self):
        """The managed Checkpoint (None in the keyword form)."""
        return self._checkpoint

    @property
    def directory(self):
        """The folder of the checkpoints (str)."""
        return self._directory

    @property
    def checkpoints(self):
        """Paths of the kept checkpoints, oldest (lowest number) first (list of str)."""
        return [p for _, p in _checkpoint.numbered_checkpoints(self._directory, self._checkpoint_name)]

    @property
    def latest_checkpoint(self):
        """Path of the newest checkpoint, or None when there is none (a first run)."""
        return _checkpoint.latest_checkpoint(self._directory, self._checkpoint_name)

    def save(self, checkpoint_number=None, **objects):
        """Saves the next numbered checkpoint, then deletes the oldest beyond `max_to_keep`.

        Args:
          checkpoint_number: the file's number (an int >= 0, or a 0-d integer
            variable or tensor such as `optimizer.iterations`, e.g. the step).
            None: the Checkpoint's `save_counter` after adding 1 to it (TF;
            the counter is restored with the checkpoint, so a resumed run
            goes on numbering); in the keyword form the latest number + 1.
            It may not be below the latest kept number (that file would be
            taken for an older one); equal overwrites it.
          **objects: in the keyword form only, as for `dtape.checkpoint.save`.

        Returns:
          str: the path written.

        Raises:
          TypeError: a `checkpoint_number` that is not an int; objects given
            to a manager of a Checkpoint, or none in the keyword form.
          ValueError: a number below the latest kept one (restore the latest
            checkpoint first, so `save_counter` goes on from it); as
            `dtape.checkpoint.save`.
        """
        found = _checkpoint.numbered_checkpoints(self._directory, self._checkpoint_name)
        latest = found[-1][0] if found else None
        if self._checkpoint is None:
            if not objects:
                raise TypeError("CheckpointManager(directory, ...).save needs the objects to save as keywords")
            number = self._number(checkpoint_number, latest, 1 if latest is None else latest + 1)
            return _checkpoint.save_objects(self._path(number), objects, make_folder=True, after=self._sweep)
        if objects:
            raise TypeError(f"CheckpointManager.save saves its Checkpoint; got objects {sorted(objects)} "
                            f"(add them to the Checkpoint instead)")
        counter = int(self._checkpoint.save_counter.numpy()) + 1
        number = self._number(checkpoint_number, latest, counter)
        self._checkpoint.save_counter.assign(counter)
        return self._checkpoint.write_then(self._path(number), after=self._sweep)

    def restore_or_initialize(self):
        """Restores the latest checkpoint if there is one, else calls `init_fn` (if given).

        Returns:
          str or None: the restored path, or None when there was none.

        Source: tf.train.CheckpointManager.restore_or_initialize.
        """
        if self._checkpoint is None:
            raise TypeError("restore_or_initialize needs CheckpointManager(checkpoint, directory, max_to_keep)")
        latest = self.latest_checkpoint
        if latest is not None:
            self._checkpoint.restore(latest)
            return latest
        if self._init_fn is not None:
            self._init_fn()
        return None

    def _path(self, number):
        return os.path.join(self._directory, f"{self._checkpoint_name}-{number}")

    def _number(self, checkpoint_number, latest, default):
        if checkpoint_number is None:
            number = default
        else:
            number = _as_number(checkpoint_number)
        if number < 0 or (latest is not None and number < latest):
            fix = ("; restore the latest checkpoint first (checkpoint.restore(manager.latest_checkpoint)) so "
                   "save_counter goes on from it" if checkpoint_number is None else "")
            raise ValueError(f"checkpoint_number {number} is below the latest kept checkpoint number {latest} in "
                             f"{self._directory!r} (or negative); use a larger number or remove the newer files"
                             + fix)
        return number

    def _sweep(self):
        """Deletes the oldest checkpoints beyond `max_to_keep` (run where the file was written: rank 0)."""
        kept = self.checkpoints
        if self._max_to_keep is None:
            return
        for path in kept[:max(0, len(kept) - self._max_to_keep)]:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass            # removed by another manager on the same folder


def _as_number(value):
    """An int from an int, a numpy integer, or a 0-d integer variable/tensor (TF: `optimizer.iterations`)."""
    if type(value) is int or isinstance(value, np.integer):
        return int(value)
    read = getattr(value, "numpy", None)
    array = np.asarray(read()) if callable(read) else None
    if array is not None and array.shape == () and array.dtype.kind in "iu":
        return int(array)
    raise TypeError(f"checkpoint_number must be an int or a 0-d integer variable/tensor, got "
                    f"{type(value).__name__}{'' if array is None else f' of dtype {array.dtype}, shape {array.shape}'}")


def _check_options(max_to_keep, checkpoint_name, keep_checkpoint_every_n_hours):
    if max_to_keep is not None and (type(max_to_keep) is not int or max_to_keep < 1):
        raise ValueError(f"max_to_keep must be a positive int or None, got {max_to_keep!r}")
    if not isinstance(checkpoint_name, str) or not checkpoint_name or os.sep in checkpoint_name:
        raise ValueError(f"checkpoint_name must be a non-empty file name, got {checkpoint_name!r}")
    if keep_checkpoint_every_n_hours is not None:
        raise ValueError("keep_checkpoint_every_n_hours is not supported: copy the checkpoints to keep elsewhere, "
                         "or pass max_to_keep=None to keep them all")
