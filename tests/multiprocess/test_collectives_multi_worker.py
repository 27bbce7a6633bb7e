"""Collectives on the tape, overlapped bucketed gradients, uneven data and accumulation on two torchrun workers."""
import os

import pytest

import _launch


@pytest.mark.multiprocess
def test_collectives_gradient_sync_uneven_and_accumulation_on_two_workers(tmp_path):
    args = _launch.torchrun_args(tmp_path / "logs") + [os.path.join(_launch.HERE, "worker_collectives.py")]
    rc, output, _ = _launch.run(args, _launch.worker_env(timeout=20))
    logs = _launch.rank_logs(tmp_path / "logs")
    assert rc == 0, f"torchrun failed ({rc}):\n{output[-3000:]}\n{logs}"
    for r in range(2):
        assert f"RANK {r} OK" in logs[r], logs[r][-3000:]
        # unsynced: one bucket per step (4 steps); synced, 1-byte buckets: one per variable per step (4 x 4),
        # + 1: the readiness order agreed at the first step
        assert f"rank {r} sync=False flat launches 4" in logs[r] and f"rank {r} sync=True flat launches 17" in logs[r]
