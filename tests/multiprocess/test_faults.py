"""A failure on one worker fails every worker's step, naming the failing rank (issue 6, point 6).

tests/multiprocess/worker_faults.py runs a small training loop on two
torchrun workers; rank 1 fails in step 2 (see its docstring). Every process
must exit non-zero within the timeout (10 s here), torchrun must return
non-zero, and rank 0 (blocked in a collective) must name rank 1 and its
exception.
"""
import os

import pytest

import _launch

FAULTS = {  # fault -> (what rank 0 must print, what rank 1 must print)
    "before_collective": ("ValueError: injected before a collective", "ValueError: injected before a collective"),
    "merge_fn": ("KeyError: 'injected in merge_fn'", "KeyError: 'injected in merge_fn'"),
    "grad_allreduce": ("ArithmeticError: injected in the gradient all-reduce",
                       "ArithmeticError: injected in the gradient all-reduce"),
    "sigkill": ("PeerFailure: rank 0: all_reduce", None),   # "... failed because rank 1 died (... killed ...)"
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_on_rank1_fails_every_worker_naming_rank1(fault, tmp_path):
    # torchrun checks its workers every 2 s here: rank 0 must report the failure itself, before the
    # launcher's SIGTERM (at 0.1 s, a loaded machine sometimes let torchrun win the race after SIGKILL).
    args = _launch.torchrun_args(tmp_path / "logs", extra=("--monitor-interval", "2")) + \
        [os.path.join(_launch.HERE, "worker_faults.py")]
    rc, output, seconds = _launch.run(args, _launch.worker_env(timeout=10, DTAPE_TEST_FAULT=fault), timeout=60)
    logs = _launch.rank_logs(tmp_path / "logs")
    assert rc != 0, output[-2000:]
    assert seconds < 40, f"took {seconds:.1f} s"
    rank0_says, rank1_says = FAULTS[fault]
    assert "rank 1: step 1 done" in logs[1] and "rank 1: step 2 done" not in logs[1]
    assert "rank 0: step 2 done" not in logs[0], logs[0][-2000:]
    line = [ln for ln in logs[0].splitlines() if ln.startswith("dtape: rank 0: step failed:")]
    assert line and rank0_says in line[0], logs[0][-3000:]
    assert "rank 1" in line[0].split(rank0_says, 1)[1]
    if rank1_says:
        assert rank1_says in logs[1] and "(raised on worker rank 1 of 2)" in logs[1], logs[1][-2000:]
        # rank 1 exits 1 once rank 0 has acknowledged; rank 0 exits 1 itself or, if torchrun
        # got there first, by torchrun's SIGTERM after printing its error.
        assert "exitcode  : 1" in output, output[-2500:]
    else:
        assert "because rank 1 died (no exception published: killed" in line[0]
        assert "exitcode  : -9" in output


@pytest.mark.multiprocess
@pytest.mark.slow
def test_hung_rank1_times_out_on_rank0_naming_rank1(tmp_path):
    args = _launch.torchrun_args(tmp_path / "logs") + [os.path.join(_launch.HERE, "worker_faults.py")]
    rc, output, seconds = _launch.run(args, _launch.worker_env(timeout=3, DTAPE_TEST_FAULT="hang"), timeout=60)
    logs = _launch.rank_logs(tmp_path / "logs")
    assert rc not in (0, None) and seconds < 40, output[-2000:]
    line = [ln for ln in logs[0].splitlines() if ln.startswith("dtape: rank 0: step failed:")]
    assert line and "TimeoutError" in line[0] and "ranks [1] never reached it" in line[0], logs[0][-2000:]
