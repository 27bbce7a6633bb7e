"""experimental_distribute_dataset under MultiWorkerMirroredStrategy checks once per epoch that every worker
holds the same global batch (tests/multiprocess/worker_data_check.py on 2 torchrun workers)."""
import json
import os

import pytest

import _launch


def _run(tmp_path, mode):
    args = _launch.torchrun_args(tmp_path / "logs") + [os.path.join(_launch.HERE, "worker_data_check.py"),
                                                      str(tmp_path), mode]
    rc, output, _ = _launch.run(args, _launch.worker_env(timeout=30), timeout=180)
    assert rc == 0, f"torchrun failed ({rc}):\n{output[-3000:]}\n{_launch.rank_logs(tmp_path / 'logs')}"
    seen = []
    for r in range(2):
        with open(tmp_path / f"rank{r}.json") as f:
            seen.append(json.load(f))
    return seen


@pytest.mark.multiprocess
def test_identical_loaders_train_and_the_check_is_cheap(tmp_path):
    seen = _run(tmp_path, "same")
    for s in seen:
        assert "error" not in s, s.get("error")
        assert len(s["losses"]) == 8          # 2 epochs of 4 global batches
    assert seen[0]["losses"] == seen[1]["losses"]
    print("check per epoch (us):", [round(s["check_us"], 1) for s in seen],
          "fingerprint alone (us):", [round(s["fingerprint_us"], 1) for s in seen])


@pytest.mark.multiprocess
def test_distributed_sampler_left_in_the_loader_raises_on_every_rank(tmp_path):
    for s in _run(tmp_path, "sampler"):
        msg = s["error"]
        assert "do not hold the same global batch" in msg
        assert "DistributedSampler (num_replicas=2" in msg
        assert "drop the DistributedSampler" in msg and "distribute_datasets_from_function" in msg
        assert "losses" not in s


@pytest.mark.multiprocess
def test_per_rank_shuffle_seeds_raise_on_every_rank(tmp_path):
    for s in _run(tmp_path, "seeds"):
        msg = s["error"]
        assert "shuffling seeded differently per worker" in msg
        assert "seed the shuffle identically" in msg and "distribute_datasets_from_function" in msg
        assert "losses" not in s
