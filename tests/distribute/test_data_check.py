"""The fingerprint experimental_distribute_dataset compares across workers, and the check around it
(single process: a stand-in communicator plays the other worker)."""
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from dtape.distribute import input_lib


def test_fingerprint_exact_values():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    y = torch.tensor([5, 6])
    fp = input_lib.batch_fingerprint((x, y)).tolist()
    assert fp[:2] == [2, 2] and fp[6] == 1
    assert fp[3] == 21.0 and fp[4] == 1 + 4 + 9 + 16 + 25 + 36
    # x at positions 0..3 of 4, weights k/4 + 1; y at positions 0..1 of 2, weights k/2 + 2
    assert fp[5] == pytest.approx(1 * 1 + 2 * 1.25 + 3 * 1.5 + 4 * 1.75 + 5 * 2 + 6 * 2.5, rel=1e-15)


def test_fingerprint_tells_apart_what_sums_do_not():
    x = torch.arange(12.0).reshape(6, 2)
    base = input_lib.batch_fingerprint({"x": x, "n": np.ones(6)})
    assert torch.equal(base, input_lib.batch_fingerprint({"x": x.clone(), "n": np.ones(6)}))
    permuted = input_lib.batch_fingerprint({"x": x[[1, 0, 2, 3, 4, 5]], "n": np.ones(6)})
    assert permuted[3:5].tolist() == base[3:5].tolist() and permuted[5] != base[5]   # same examples, other order
    reshaped = input_lib.batch_fingerprint({"x": x.reshape(3, 4), "n": np.ones(3)})
    assert reshaped[1] != base[1] and reshaped[2] != base[2]
    retyped = input_lib.batch_fingerprint({"x": x.double(), "n": np.ones(6)})
    assert retyped[2] != base[2] and retyped[3:].tolist() == base[3:].tolist()
    assert input_lib.batch_fingerprint(None).tolist() == [0, -1, 0, 0, 0, 0, 0]


class _TwoWorkers:
    """A communicator whose all_gather pairs this worker's fingerprint with a fixed other worker's."""

    def __init__(self, other):
        self.other, self.calls = other, 0

    def all_gather(self, t, label=None):
        self.calls += 1
        return torch.stack([t, input_lib.batch_fingerprint(self.other)])


def test_worker_dataset_checks_once_per_epoch_and_names_the_cause():
    data = TensorDataset(torch.arange(16.0).reshape(8, 2))
    loader = DataLoader(data, batch_size=4)
    comm = _TwoWorkers(next(iter(loader)))
    ds = input_lib.WorkerDataset(loader, 0, 2, "cpu", comm=comm)
    assert len(list(ds)) == 2 and len(list(ds)) == 2 and comm.calls == 2
    other = DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="shuffling seeded differently per worker"):
        list(input_lib.WorkerDataset(other, 0, 2, "cpu", comm=comm))
    sharded = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=1))
    with pytest.raises(ValueError, match=r"DistributedSampler \(num_replicas=2, rank=1\).*drop the Distributed"):
        list(input_lib.WorkerDataset(sharded, 0, 2, "cpu", comm=comm))
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\]"):   # an empty epoch here still joins the check
        list(input_lib.WorkerDataset([], 0, 2, "cpu", comm=comm))


def test_fingerprint_in_chunks_equals_one_pass(monkeypatch):
    x = torch.randn(7, 5, generator=torch.Generator().manual_seed(0))
    y = torch.arange(7)
    whole = input_lib.batch_fingerprint((x, y))
    monkeypatch.setattr(input_lib, "FINGERPRINT_CHUNK", 4)   # 35 and 7 elements: uneven last chunks
    chunked = input_lib.batch_fingerprint((x, y))
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)
    monkeypatch.setattr(input_lib, "FINGERPRINT_CHUNK", 3)
    assert input_lib.batch_fingerprint((x[[1, 0, 2, 3, 4, 5, 6]], y))[5] != chunked[5]
