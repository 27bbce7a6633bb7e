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
                "of strategy.reduce (float32[3000])") in err and "different shapes or dtypes" in err, err
        err = _error(res, "dtypes")
        assert "(float32[2]) while rank 1 entered all_reduce #1 of strategy.reduce (float64[2])" in err, err
        err = _error(res, "order")
        assert ("rank 0 entered all_reduce #1 of strategy.reduce (float32[1]) while rank 1 entered all_gather #1 of "
                "strategy.gather (int64[1])") in err and "Hint" not in err, err
        # a new strategy on the same process group works: the mismatch left no collective half-done
        assert res["fine"] == {"value": 3.0}, res["fine"]
        # all-reduces announced by a checked one skip their own check, and still give the sums
        sums = [3.0, 3.0, 3.0, 2.0] + ([3.0] * 4 + [2.0]) * 2   # values 1 + 2, presence flags 1 + 1
        assert res["announced_fine"] == {"value": sums}, res["announced_fine"]
        # rank 1 enters something else where rank 0 is already inside an announced all-reduce: both raise
        # (rank 0 at its wait), never gloo's abort on the other size, never a value
        for scenario, other in (("announced_then_large", "float32[3000]"), ("announced_then_small", "float32 scalar")):
            err = _error(res, scenario)
            assert err.startswith(said), err
            assert ("rank 0 entered all_reduce #3 (float32[5]) (announced by an earlier "
                    f"checked all-reduce) while rank 1 entered all_reduce #3 of strategy.reduce ({other})") in err, err
        # both workers enter the same other collective between the announced ones: it is checked, all values right
        assert res["announced_both_leave"] == {"value": sums + [3.0]}, res["announced_both_leave"]
        # a checked collective that announces nothing announces the flagged all-reduce that followed it twice in a
        # row: from the third round the loss reduction's check covers the bucket (one exchange per round, not two)
        bucket = [3.0, 3.0, 3.0, 3.0, 2.0]
        assert res["predicted_fine"] == {"value": [2, 2, 1, 1] + ([3.0] + bucket) * 4}, res["predicted_fine"]
        # both workers reduce something else where the bucket was announced (round 4): poisoned, checked, the
        # right values; the bucket is learned again (checked in round 5) and announced from round 6
        values = ([3.0] + bucket) * 3 + [3.0, 3.0] + bucket + ([3.0] + bucket) * 3
        assert res["predicted_both_leave"] == {"value": [2, 2, 1, 3, 2, 1, 1] + values}, res["predicted_both_leave"]
        err = _error(res, "predicted_one_leaves")
        assert err.startswith(said), err
        assert ("rank 0 entered all_reduce #8 (float32[5]) (announced by an earlier checked all-reduce) while rank 1 "
                "entered all_reduce #8 of strategy.reduce (float32[3000])") in err, err
        # through GradientSync: a step's bucket, then its loss; the loss announces the next bucket from step 4 on;
        # the other reduction before step 5's bucket (both workers) costs a poison and its own check, and the
        # bucket is announced again from step 7 (step 1 also creates SGD's iterations: a broadcast). Every step:
        # v0 -= 1 + 2, v1 -= 10 + 20
        assert res["predicted_steps"] == {"value": [3, 2, 2, 1, 3, 2, 1, 3.0] + [-21.0] * 2 + [-210.0] * 2}, \
            res["predicted_steps"]
        # the same through GradientSync: rank 1's backward walk alone issues a collective between the buckets
        err = _error(res, "walk_one")
        assert err.startswith(said) and "of tape.gradient's GradientSync (float32[" in err, err
        assert "(announced by an earlier checked all-reduce) while rank 1 entered all_reduce #" in err, err
        # on both (the same collective at the same point): no error, the same step as without GradientSync:
        # v2 -= 2 * 27, v1 -= 2 * 15 * 9, v0 -= 15 * 3 * 2 * (1 + 2), summed over the 2 workers
        walked = [-269.0, -268.0, -267.0, -50.0, -49.0, -48.0]
        assert res["walk_both"] == {"value": walked * 2}, res["walk_both"]
        # tape.gradient's sources in one order: v0 -= 1 + 2, v1 -= 10 + 20 (two buckets, then one)
        assert res["sources_same"] == {"value": [-3.0, -3.0, -30.0, -30.0] * 2}, res["sources_same"]
        # in another order on rank 1 (same shapes): the buckets' signatures carry the sources' names and shapes
        for scenario, size in (("sources_swapped", "3]) over sources 0x"), ("sources_swapped_one_bucket", "6]) over")):
            err = _error(res, scenario)
            assert err.startswith(said) and f"of tape.gradient's GradientSync (float32[{size}" in err, err
            assert "the workers passed tape.gradient different sources (names or shapes) at some position" in err
        # two variables of one name and shape are told apart by their creation order among that name's
        assert res["same_name_same"] == {"value": [-3.0, -3.0, -30.0, -30.0]}, res["same_name_same"]
        for scenario, size in (("same_name_swapped", "3]) over sources 0x"), ("unnamed_swapped_one_bucket", "6]) over")):
            err = _error(res, scenario)
            assert err.startswith(f"CollectiveMismatchError: rank {r}: collectives out of step: "), err
            assert f"of tape.gradient's GradientSync (float32[{size}" in err, err
            assert "variables of one name are told apart by their creation order" in err, err


@pytest.mark.multiprocess
def test_rank0_only_save_while_rank1_exits_fails_rank0_saying_save_is_collective(tmp_path):
    rank0, _ = _launch_ledger(tmp_path, "save_then_exit")
    err = _error(rank0, "rank0_saves")
    assert err.startswith("RuntimeError: rank 1 left the program after collective #1"), err
    assert "while rank 0 waits in all_reduce #2 of checkpoint.save (float32[1])" in err and SAVE_IS_COLLECTIVE in err
    logs = _launch.rank_logs(tmp_path / "logs")
    assert "dtape: rank 1: exit: rank 1 left the program" in logs[1] and SAVE_IS_COLLECTIVE in logs[1], logs[1]


# -- in one process: the signatures and their words --------------------------------------------
import threading  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dtape.distribute import collective_ops  # noqa: E402


def test_the_outermost_label_names_the_collective_and_unknown_labels_are_registered():
    assert collective_ops.current_label("inner") == "inner"
    with collective_ops.labelled("checkpoint.save"):
        with collective_ops.labelled("strategy.reduce"):
            assert collective_ops.current_label("SyncOnReadVariable read") == "checkpoint.save"
    assert collective_ops.current_label() is None
    with collective_ops.labelled("my_eval_loop"):
        sig = collective_ops._signature(7, "broadcast", torch.zeros(2, 3, 4, 5, 6, dtype=torch.int32), 1,
                                        collective_ops.current_label())
    assert collective_ops.describe_signature(sig) == "broadcast from rank 1 #7 of my_eval_loop (int32[2, 3, 4, 5, ...])"


def test_mismatch_message_groups_ranks_and_names_each_call():
    t = torch.zeros(4)
    rows = [collective_ops._signature(3, "all_reduce", t, 0, "apply_gradients"),
            collective_ops._signature(3, "barrier", torch.zeros(1), 0, None),
            collective_ops._signature(3, "all_reduce", t, 0, "apply_gradients")]
    msg = collective_ops.mismatch_message(1, rows)
    assert msg.startswith("rank 1: collectives out of step: ranks 0, 2 entered all_reduce #3 of apply_gradients "
                          "(float32[4]) while rank 1 entered barrier #3 (float32[1]);"), msg
    assert "Hint" not in msg


def test_workers_that_disagree_on_checking_refuse_to_start():
    store, errors = dist.HashStore(), {}

    def make(rank, check):
        try:
            collective_ops.Communicator(rank, 2, store, 5.0, "cpu", "ledger_test/", check=check)
        except ValueError as e:
            errors[rank] = str(e)
    threads = [threading.Thread(target=make, args=(r, r == 0)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert sorted(errors) == [0, 1], errors
    assert "DTAPE_CHECK_COLLECTIVES differs between workers (check on: [0], off: [1])" in errors[0]
