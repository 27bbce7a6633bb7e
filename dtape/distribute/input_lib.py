"""Splitting global batches across replicas and workers. Source: tensorflow/python/distribute/input_lib.py.

A dataset is any iterable of global batches: tensors, numpy arrays, nests
(lists, tuples, dicts) of them, or a `torch.utils.data.DataLoader` (its
batches are such nests). Every replica of every worker gets its slice of
each global batch along dim 0, sized by `split_sizes`, so the global batches
a run sees do not depend on how many replicas or workers share them.
"""
import zlib

import numpy as np
import torch
import torch.utils.data

from dtape import _jit, nest
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


def _check_iterable(dataset):
    if not hasattr(dataset, "__iter__"):
        raise TypeError(f"a dataset must be an iterable of batches (a list, a generator, a torch DataLoader, ...), "
                        f"got {type(dataset).__name__}")


class _Batches:
    """An iterator over a distributed dataset's batches (the generator `batches`).

    In a compiled `dtape.function` being traced, each `next` first stops the
    trace, before a batch is drawn (the function then runs its body eagerly,
    its `strategy.run` steps compiled: `dtape._jit.leave_graph`), so an
    iterator passed to the function loses no batch to the trace.
    """

    __slots__ = ("_batches",)

    def __init__(self, batches):
        self._batches = batches

    def __iter__(self):
        return self

    def __next__(self):
        _jit.leave_graph("the iteration of a distributed dataset")
        return next(self._batches)


class DistributedDataset:
    """Iterable of per-replica batches: each global batch of `dataset` split along dim 0.

    `dataset` is any iterable of batches: tensors, numpy arrays, nests of
    them, or a torch DataLoader. `len()` is the dataset's, when it has one.
    """

    def __init__(self, strategy, dataset):
        _check_iterable(dataset)
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
        return _Batches(self._batches())

    def _batches(self):
        devices = self._strategy.extended.worker_devices
        for batch in self._dataset:
            yield split_batch(batch, devices)


def slice_batch(batch, index, count, device):
    """Part `index` of `count` of a global batch (a nest), each leaf's rows sliced as `split_sizes` says.

    Args:
      batch: a nest of tensors / numpy arrays with the same first dimension
        (scalars are given whole to every part).
      index, count: which part, of how many (a worker's rank and the world size).
      device: where the slices go.

    Returns:
      The nest with dtape.Tensor leaves on `device`.

    Raises:
      ValueError: leaves with different first dimensions.
    """
    leaves = [_leaf_to_torch(x) for x in nest.flatten(batch)]
    sizes = {int(t.shape[0]) for t in leaves if t.dim() > 0}
    if len(sizes) > 1:
        raise ValueError(f"every tensor of a batch needs the same first dimension, got {sorted(sizes)}")
    parts = split_sizes(sizes.pop() if sizes else 0, count)
    start = sum(parts[:index])
    device = normalize_device(device)
    out = [convert_to_tensor((t[start:start + parts[index]] if t.dim() > 0 else t).to(device)) for t in leaves]
    return nest.pack_sequence_as(batch, out)


FINGERPRINT_SIZE = 7


# elements of a leaf converted to float64 at a time by batch_fingerprint (8 MiB)
FINGERPRINT_CHUNK = 1 << 20


def batch_fingerprint(batch):
    """A few float64 numbers that differ, in practice, between two different global batches.

    [leaf count, batch size, crc32 of the leaves' shapes and dtypes, sum,
    sum of squares, position-weighted sum, 1]: the weights (each element's
    flat position, offset by its leaf's index) tell a permutation of the
    same examples apart, which sums alone do not. `batch=None` (a worker
    whose dataset is empty) gives batch size -1 and last entry 0.
    Computed in float64 on the CPU, a chunk of FINGERPRINT_CHUNK elements at a
    time (memory stays bounded), so identical batches give identical numbers.
    """
    if batch is None:
        return torch.tensor([0, -1, 0, 0, 0, 0, 0], dtype=torch.float64)
    leaves = [_leaf_to_torch(x).detach() for x in nest.flatten(batch)]
    sizes = [int(t.shape[0]) for t in leaves if t.dim() > 0]
    signature = ";".join(f"{tuple(t.shape)}:{t.dtype}" for t in leaves).encode()
    total = squares = weighted = 0.0
    for i, t in enumerate(leaves):
        flat, n = t.reshape(-1), t.numel()
        # chunks: a float64 copy of a whole image batch would be hundreds of MB on the host
        for start in range(0, n, FINGERPRINT_CHUNK):
            part = flat[start:start + FINGERPRINT_CHUNK].to("cpu", torch.float64)
            position = torch.arange(start, start + part.numel(), dtype=torch.float64) / max(n, 1) + i + 1
            total += float(part.sum())
            squares += float(part.square().sum())
            weighted += float(part.mul(position).sum())
    return torch.tensor([len(leaves), sizes[0] if sizes else 0, zlib.crc32(signature), total, squares, weighted, 1],
                        dtype=torch.float64)


def _distributed_sampler(dataset):
    """The DistributedSampler a torch DataLoader draws from, or None."""
    for sampler in (getattr(dataset, "sampler", None), getattr(getattr(dataset, "batch_sampler", None), "sampler",
                                                               None)):
        if isinstance(sampler, torch.utils.data.DistributedSampler):
            return sampler
    return None


def check_same_global_batch(comm, batch, dataset):
    """Raises ValueError on every worker unless every worker's `batch` has the same fingerprint (one all-gather).

    Args:
      comm: the collective_ops.Communicator (its timeouts and failure reports apply).
      batch: this worker's first global batch of an epoch (None: its dataset is empty).
      dataset: what the batches come from (named in the message; a DataLoader's
        DistributedSampler is detected).
    """
    prints = comm.all_gather(batch_fingerprint(batch), label="experimental_distribute_dataset's data check")
    # A tolerance, not equality, in case workers on different hardware sum in a different order.
    same = torch.isclose(prints, prints[0:1].expand_as(prints), rtol=1e-9, atol=0.0).all(dim=1)
    if bool(same.all()):
        return
    differ = [r for r in range(prints.shape[0]) if not same[r]]
    sampler = _distributed_sampler(dataset)
    if sampler is not None:
        cause = (f"this DataLoader draws from a torch DistributedSampler (num_replicas={sampler.num_replicas}, "
                 f"rank={sampler.rank}), which gives every worker different examples")
    else:
        cause = ("the likely cause is shuffling seeded differently per worker (a per-rank seed or torch.Generator), "
                 "or a DistributedSampler or other per-rank sharding inside the dataset")
    raise ValueError(
        f"experimental_distribute_dataset: the workers do not hold the same global batch (rank 0's first batch of "
        f"this epoch differs from rank(s) {differ}'s); it expects every worker to iterate the SAME global batches "
        f"and keeps its own slice of each, so different batches would silently train on duplicated and missing "
        f"examples. {cause[0].upper() + cause[1:]}. Fix: give every worker the same global batches (drop the "
        f"DistributedSampler, seed the shuffle identically on every worker, e.g. "
        f"DataLoader(..., shuffle=True, generator=torch.Generator().manual_seed(seed))), or build per-worker "
        f"input pipelines with strategy.distribute_datasets_from_function.")


class WorkerDataset:
    """Iterable of one worker's batches: part `index` of `count` of each global batch of `dataset`, on `device`.

    MultiWorkerMirroredStrategy's `experimental_distribute_dataset` (index =
    rank, count = world size) and `distribute_datasets_from_function` (the
    worker's own dataset whole: index 0 of 1). `len()` is the dataset's.

    `comm`: a collective_ops.Communicator, or None. Given, each iteration
    (an epoch) first checks with `check_same_global_batch` that every worker
    holds the same first global batch: a collective, so every worker must
    start each epoch's iteration.
    """

    def __init__(self, dataset, index, count, device, comm=None):
        _check_iterable(dataset)
        self._dataset, self._index, self._count, self._device = dataset, index, count, device
        self._comm = comm

    def __iter__(self):
        return _Batches(self._batches())

    def _batches(self):
        first = True
        for batch in self._dataset:
            if first and self._comm is not None:
                check_same_global_batch(self._comm, batch, self._dataset)
            first = False
            yield slice_batch(batch, self._index, self._count, self._device)
        if first and self._comm is not None:   # an empty epoch here: the others still wait for the check
            check_same_global_batch(self._comm, None, self._dataset)

    def __len__(self):
        return len(self._dataset)


class InputContext:
    """What `dataset_fn` learns about its input pipeline. Source: tf.distribute.InputContext.

    Attributes:
      num_input_pipelines: how many pipelines there are (MirroredStrategy:
        one per replica; MultiWorkerMirroredStrategy: one per worker).
      input_pipeline_id: this pipeline's index (the replica id / the rank).
      num_replicas_in_sync: replicas sharing each global batch.

    A dataset_fn shards its data with these (e.g. every
    `num_input_pipelines`-th example from `input_pipeline_id`) and batches
    with `get_per_replica_batch_size(global_batch_size)`.
    """

    def __init__(self, num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1):
        if not 0 <= input_pipeline_id < num_input_pipelines:
            raise ValueError(f"input_pipeline_id {input_pipeline_id} is not in [0, {num_input_pipelines})")
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
        return _Batches(self._batches())

    def _batches(self):
        for batches in zip(*self._datasets):
            leaves = [nest.flatten(b) for b in batches]
            per = [PerReplica(tuple(convert_to_tensor(_leaf_to_torch(x).to(normalize_device(d)))
                                    for x, d in zip(col, self._devices))) for col in zip(*leaves)]
            yield nest.pack_sequence_as(batches[0], per)
