"""Checkpoint + CheckpointManager under MultiWorkerMirroredStrategy: 2 torchrun workers (gloo, 127.0.0.1)
(tests/multiprocess/worker_checkpoint_objects.py)."""

import pytest

import _launch


@pytest.mark.multiprocess
def test_every_worker_saves_rank_0_deletes_and_the_resumed_step_equals_the_uninterrupted_one(tmp_path):
    ranks = _launch.run_ranks(tmp_path, "worker_checkpoint_objects.py")
    for seen in ranks:
        whole_losses, _, whole_weights = seen["whole"]
        first_losses, first_files, _ = seen["first"]
        resumed_losses, resumed_files, resumed_weights = seen["resumed"]
        assert first_losses + resumed_losses == whole_losses           # exactly: slots restored when created
        assert resumed_weights == whole_weights
        assert first_files == ["ckpt-3"] and resumed_files == ["ckpt-4"]
    assert ranks[0]["removed"] == ["ckpt-1", "ckpt-2", "ckpt-3", "ckpt-1", "ckpt-2", "ckpt-3"]
    assert ranks[1]["removed"] == []                                   # only rank 0 deletes
