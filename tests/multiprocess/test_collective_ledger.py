"""Collectives cannot pair wrong across torchrun workers: each worker's call is checked against the others'
before anything is exchanged (tests/multiprocess/worker_ledger.py on 2 workers, gloo)."""
import json
import os

import pytest

import _launch

SAVE_IS_COLLECTIVE = "Hint: checkpoint.save is collective: every worker must call it"


def _launch_ledger(tmp_path, mode):
    args = _launch.torchrun_args(tmp_path / "logs") + [os.path.join(_launch.HERE, "worker_ledger.py"),
                                                      str(tmp_path), mode]
    rc, output, _ = _launch.run(args, _launch.worker_env(timeout=20), timeout=150)
    logs = _launch.rank_logs(tmp_path / "logs")
    assert rc == 0, f"torchrun failed ({rc}):\n{output[-3000:]}\n{logs}"
    results = []
    for r in range(2):
        assert f"rank {r}: done" in logs[r], logs[r][-3000:]
        path = tmp_path / f"rank{r}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {})
    return results


def _error(result, scenario):
    assert "value" not in result[scenario], f"{scenario}: a value instead of an error: {result[scenario]}"
    return result[scenario]["error"]


@pytest.mark.multiprocess
def test_mismatched_collectives_raise_on_every_worker_naming_both_calls(tmp_path):
    results = _launch_ledger(tmp_path, "scenarios")
    for r, res in enumerate(results):
        said = f"CollectiveMismatchError: rank {r}: collectives out of step: "
        # rank 0 saves alone; rank 1's next reduction would have been summed with the save's barrier
        err = _error(res, "save_then_reduce")
        assert err.startswith(said), err
        assert ("rank 0 entered all_reduce #2 of checkpoint.save (float32[1]) while rank 1 entered all_reduce #2 "
                "of strategy.reduce (float32 scalar)") in err, err
        assert SAVE_IS_COLLECTIVE in err and "not only rank 0" in err
        err = _error(res, "save_then_step")
        assert ("rank 0 entered all_reduce #2 of checkpoint.save (float32[1]) while rank 1 entered all_reduce #2 "
                "of apply_gradients (float32[3])") in err and SAVE_IS_COLLECTIVE in err, err
        err = _error(res, "shapes")
        assert ("rank 0 entered all_reduce #1 of strategy.reduce (float32[2]) while rank 1 entered all_reduce #1 "
                "of strategy.reduce (float32[3])") in err and "different shapes or dtypes" in err, err
        err = _error(res, "dtypes")
        assert "(float32[2]) while rank 1 entered all_reduce #1 of strategy.reduce (float64[2])" in err, err
        err = _error(res, "order")
        assert ("rank 0 entered all_reduce #1 of strategy.reduce (float32[1]) while rank 1 entered all_gather #1 of "
                "strategy.gather (int64[1])") in err and "Hint" not in err, err
        # a new strategy on the same process group works: nothing but the signatures was exchanged
        assert res["fine"] == {"value": 3.0}, res["fine"]


@pytest.mark.multiprocess
def test_rank0_only_save_while_rank1_exits_fails_rank0_saying_save_is_collective(tmp_path):
    rank0, _ = _launch_ledger(tmp_path, "save_then_exit")
    err = _error(rank0, "rank0_saves")
    assert err.startswith("RuntimeError: rank 1 left the program after collective #1"), err
    assert "while rank 0 waits in all_reduce #2 of checkpoint.save (float32[1])" in err and SAVE_IS_COLLECTIVE in err
    logs = _launch.rank_logs(tmp_path / "logs")
    assert "dtape: rank 1: exit: rank 1 left the program" in logs[1] and SAVE_IS_COLLECTIVE in logs[1], logs[1]
