"""BackupAndRestore under torchrun (2 gloo workers, MultiWorkerMirroredStrategy): rank 1 is SIGKILLed mid-epoch,
torchrun restarts both workers and fit resumes from rank 0's backup with the uninterrupted run's batch logs and
variables, exactly (tests/multiprocess/worker_backup.py)."""
import json
import os

import pytest

import _launch


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["epochs", "steps"])
def test_a_worker_killed_mid_epoch_restarts_and_fit_resumes_with_the_same_losses(mode, tmp_path):
    # "epochs": backups after batches 2, 4, 6 of 5 + 5; killed after the 7th: the restart resumes at epoch 1,
    # batch 1. "steps": steps_per_epoch=2 of a 4-batch pass, a backup after each batch, killed after the 3rd:
    # epoch 1 batch 1 is the pass's 4th batch, drawn again after skipping 3 (not a new pass's 2nd)
    args = _launch.torchrun_args(tmp_path / "logs", extra=["--max-restarts", "1"])
    args += [os.path.join(_launch.HERE, "worker_backup.py"), str(tmp_path), mode]
    rc, output, _ = _launch.run(args, _launch.worker_env(timeout=30, PYTHONFAULTHANDLER=1), timeout=240)
    logs = _launch.rank_logs(tmp_path / "logs", 1)
    assert rc == 0, f"torchrun failed ({rc}):\n{output[-3000:]}\n{logs}"
    assert not os.path.exists(tmp_path / "resumed1_0.json")      # rank 1 died in its first attempt
    for rank in (0, 1):
        with open(tmp_path / f"whole{rank}.json") as f:
            whole = json.load(f)
        with open(tmp_path / f"resumed{rank}_1.json") as f:
            resumed = json.load(f)
        assert resumed["rows"][0][:2] == [1, 1], resumed["rows"]
        assert resumed["rows"] == whole["rows"][-len(resumed["rows"]):]   # exactly: ==, not approx
        assert resumed["variables"] == whole["variables"]
        assert resumed["backup_left"] is None                             # deleted once fit completed
    assert not os.path.exists(tmp_path / "backup")
