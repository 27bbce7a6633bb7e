"""Predicted gradient buckets across torchrun workers (tests/multiprocess/worker_break_s5.py, 2 workers, gloo):
layouts that change between steps give exact values, and sources that differ where a bucket was predicted
raise on every worker instead of summing one worker's v0 gradient with the other's v1 gradient."""
import json
import os

import pytest

import _launch


@pytest.mark.multiprocess
def test_predicted_buckets_with_changing_layouts_are_exact_or_refused(tmp_path):
    args = _launch.torchrun_args(tmp_path / "logs") + [os.path.join(_launch.HERE, "worker_break_s5.py"),
                                                      str(tmp_path)]
    rc, output, _ = _launch.run(args, _launch.worker_env(timeout=20), timeout=150)
    logs = _launch.rank_logs(tmp_path / "logs")
    assert rc == 0, f"torchrun failed ({rc}):\n{output[-3000:]}\n{logs}"
    for r in range(2):
        assert f"rank {r}: done" in logs[r], logs[r][-3000:]
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        # AABBAABAAB: v0 -= 1 + 2 every step, v1 -= 10 + 20 in the 4 B steps; the loss (summed over the
        # workers) read before each step's update: 3 * sum(v0) + 30 * sum(v1)
        v0, v1, losses = 0.0, 0.0, []
        for layout in "AABBAABAAB":
            losses.append(3 * 2 * v0 + 30 * 2 * v1)
            v0 -= 3.0
            v1 -= 30.0 if layout == "B" else 0.0
        assert res["alternating"].get("value") == [v0, v0, v1, v1] + losses, res["alternating"]
        err = res["other_sources"].get("error", f"a value instead of an error: {res['other_sources']}")
        assert err.startswith(f"CollectiveMismatchError: rank {r}: collectives out of step"), err
        assert "while rank 1 entered all_reduce #13 of tape.gradient's GradientSync (float32[3]) over sources" in err
        # the 5th step's bucket raised before any update: 4 steps of v0 -= 3, v1 untouched
        assert res["other_sources"]["updates"] == [[-3.0 * k] * 2 + [0.0, 0.0] for k in range(1, 5)], res
