"""Model.fit under MultiWorkerMirroredStrategy: 2 torchrun workers give one device's history, variables and
predictions; only rank 0 prints and writes (tests/multiprocess/worker_fit.py)."""
import json
import os

import numpy as np
import pytest

import _launch
import dtape
import worker_fit


@pytest.mark.multiprocess
def test_fit_on_two_workers_equals_one_device_and_only_rank_0_prints(tmp_path):
    args = _launch.torchrun_args(tmp_path / "logs") + [os.path.join(_launch.HERE, "worker_fit.py"), str(tmp_path)]
    rc, output, _ = _launch.run(args, _launch.worker_env(timeout=60), timeout=300)
    logs = _launch.rank_logs(tmp_path / "logs")
    assert rc == 0, f"torchrun failed ({rc}):\n{output[-3000:]}\n{logs}"
    ref_history, ref_vars, ref_predicted = worker_fit.run(dtape.distribute.get_strategy(), str(tmp_path / "one.csv"))
    for r in range(2):
        with open(tmp_path / f"rank{r}.json") as f:
            seen = json.load(f)
        assert set(seen["history"]) == set(ref_history)
        for key in ref_history:
            np.testing.assert_allclose(seen["history"][key], ref_history[key], rtol=1e-5, err_msg=key)
        for got, want in zip(seen["variables"], ref_vars):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(seen["predicted"], ref_predicted, rtol=1e-5, atol=1e-6)  # every row, in order
    assert logs[0].count("Epoch 2/2 - loss: ") == 1 and "Epoch" not in logs[1]
    rows = open(tmp_path / "log.csv").read().splitlines()   # rank 0's only: one header, one row per epoch
    assert len(rows) == 3 and rows[0] == open(tmp_path / "one.csv").read().splitlines()[0]
