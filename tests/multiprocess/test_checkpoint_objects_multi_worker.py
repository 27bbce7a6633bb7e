"""Checkpoint + CheckpointManager under MultiWorkerMirroredStrategy: 2 torchrun workers (gloo, 127.0.0.1)
(tests/multiprocess/worker_checkpoint_objects.py)."""
import json
import os

import pytest

import _launch


@pytest.mark.multiprocess
def test_every_worker_saves_rank_0_deletes_and_the_resumed_step_equals_the_uninterrupted_one(tmp_path):
    args = _launch.torchrun_args(tmp_path / "logs") + [os.path.join(_launch.HERE, "worker_checkpoint_objects.py"),
                                                      str(tmp_path)]
    rc, output, _ = _launch.run(args, _launch.worker_env(timeout=60), timeout=300)
    assert rc == 0, f"torchrun failed ({rc}):\n{output[-3000:]}\n{_launch.rank_logs(tmp_path / 'logs')}"
    ranks = []
    for r in range(2):
        with open(tmp_path / f"rank{r}.json") as f:
            ranks.append(json.load(f))
    for seen in ranks:
        whole_losses, _, whole_weights = seen["whole"]
        first_losses, first_files, _ = seen["first"]
        resumed_losses, resumed_files, resumed_weights = seen["resumed"]
        assert first_losses + resumed_losses == whole_losses           # exactly: slots restored when created
        assert resumed_weights == whole_weights
        assert first_files == ["ckpt-3"] and resumed_files == ["ckpt-4"]
    assert ranks[0]["removed"] == ["ckpt-1", "ckpt-2", "ckpt-3", "ckpt-1", "ckpt-2", "ckpt-3"]
    assert ranks[1]["removed"] == []                                   # only rank 0 deletes
