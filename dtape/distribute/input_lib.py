"""Splitting global batches across replicas. Source: tensorflow/python/distribute/input_lib.py."""
import numpy as np
import torch

from dtape import nest
from dtape.distribute.values import PerReplica
from dtape.tensor import Tensor, convert_to_tensor, normalize_device


def split_sizes(n, num_replicas):
    """Sizes of each replica's slice of a batch of n examples (differ by at most 1, first replicas larger)."""
    base, extra = divmod(n, num_replicas)
    return [base + (1 if i < extra else 0) for i in range(num_replicas)]


def _leaf_to_torch(x):
    if isinstance(x, Tensor):
        return x.torch()
    if isinstance(x, torch.Tensor):
        return x
    return torch.as_tensor(np.asarray(x))


def split_batch(batch, devices):
    """A nest of tensors -> PerReplica leaves, each the replica's slice along dim 0 on its device.

    Raises:
      ValueError: if the leaves of `batch` have different batch sizes.
    """
    leaves = [_leaf_to_torch(x) for x in nest.flatten(batch)]
    sizes = {int(t.shape[0]) for t in leaves if t.dim() > 0}
    if len(sizes) > 1:
        raise ValueError(f"every tensor of a batch needs the same first dimension, got {sorted(sizes)}")
    n = sizes.pop() if sizes else 0
    parts = split_sizes(n, len(devices))
    out = []
    for t in leaves:
        pieces = torch.split(t, parts) if t.dim() > 0 else [t] * len(devices)
        out.append(PerReplica(tuple(convert_to_tensor(p.to(normalize_device(d)))
                                    for p, d in zip(pieces, devices))))
    return nest.pack_sequence_as(batch, out)


class DistributedDataset:
    """Iterable of per-replica batches: each global batch of `dataset` split along dim 0.

    `dataset` is any iterable of batches: tensors, numpy arrays or nests of them.
    """

    def __init__(self, strategy, dataset):
        self._strategy = strategy
        self._dataset = dataset

    def __len__(self):
        """The number of global batches: `len(dataset)` (each is split, not dropped).

        Raises:
          TypeError: the dataset has no len() (e.g. a generator), as `len()` of it would.
        """
        try:
            return len(self._dataset)
        except TypeError:
            raise TypeError(f"len() of a distributed dataset needs a dataset with len(); "
                            f"{type(self._dataset).__name__} has none (a generator? pass a list or a "
                            "torch DataLoader)") from None

    def __iter__(self):
        devices = self._strategy.extended.worker_devices
        for batch in self._dataset:
            yield split_batch(batch, devices)


class InputContext:
    """What `dataset_fn` learns about its replica. Source: tf.distribute.InputContext."""

    def __init__(self, num_input_pipelines, input_pipeline_id, num_replicas_in_sync):
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id
        self.num_replicas_in_sync = num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size):
        """global_batch_size / num_replicas_in_sync.

        Raises:
          ValueError: if it does not divide evenly.
        """
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(f"global batch size {global_batch_size} is not divisible by "
                             f"{self.num_replicas_in_sync} replicas")
        return global_batch_size // self.num_replicas_in_sync


class DatasetsFromFunction:
    """Zips one dataset per replica, each made by `dataset_fn(InputContext)`."""

    def __init__(self, strategy, dataset_fn):
        n = strategy.num_replicas_in_sync
        self._devices = strategy.extended.worker_devices
        self._datasets = [dataset_fn(InputContext(n, i, n)) for i in range(n)]

    def __iter__(self):
        for batches in zip(*self._datasets):
            leaves = [nest.flatten(b) for b in batches]
            per = [PerReplica(tuple(convert_to_tensor(_leaf_to_torch(x).to(normalize_device(d)))
                                    for x, d in zip(col, self._devices))) for col in zip(*leaves)]
            yield nest.pack_sequence_as(batches[0], per)
