"""dtape.optimizers.from_torch under MultiWorkerMirroredStrategy: 2 torchrun workers (gloo, 127.0.0.1) train
the small GPT as plain single-process torch does (tests/multiprocess/worker_torch_optim.py)."""
import copy
import json
import os

import numpy as np
import pytest
import torch

import _gpt
import _launch

STEPS, RESUME_STEPS = 100, 5


@pytest.mark.multiprocess
def test_gpt_adamw_groups_lambdalr_clip_on_two_workers_equals_torch(tmp_path):
    args = _launch.torchrun_args(tmp_path / "logs") + [os.path.join(_launch.HERE, "worker_torch_optim.py"),
                                                      str(tmp_path), str(STEPS), str(RESUME_STEPS)]
    rc, output, _ = _launch.run(args, _launch.worker_env(timeout=60), timeout=600)
    assert rc == 0, f"torchrun failed ({rc}):\n{output[-3000:]}\n{_launch.rank_logs(tmp_path / 'logs')}"
    ranks = []
    for r in range(2):
        with open(tmp_path / f"rank{r}.json") as f:
            ranks.append(json.load(f))
    old = torch.get_num_threads()
    torch.set_num_threads(1)   # a loaded machine makes torch's thread pool far slower than one thread here
    try:
        ref, _, _ = _gpt.torch_run(copy.deepcopy(_gpt.seeded_gpt(0)), _gpt.make_adamw, _gpt.batches(STEPS), 1.0)
    finally:
        torch.set_num_threads(old)
    for seen in ranks:
        np.testing.assert_allclose(seen["losses"], ref, rtol=1e-5)
        assert seen["state_steps"] == STEPS
        half = STEPS // 2
        assert seen["resumed"] == seen["losses"][half:half + RESUME_STEPS]   # the checkpoint resumes exactly
    assert ranks[0]["checksum"] == ranks[1]["checksum"] and ranks[0]["losses"] == ranks[1]["losses"]
