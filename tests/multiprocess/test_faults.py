"""A failure on one worker fails every worker's step, naming the failing rank.

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
    # Bounded by the launch timeout (rc None past it), not by a timed assertion: starting two workers
    # that import torch takes 20-40 s on a loaded 2-core machine.
    rc, output, _ = _launch.run(args, _launch.worker_env(timeout=10, DTAPE_TEST_FAULT=fault), timeout=120)
    logs = _launch.rank_logs(tmp_path / "logs")
    assert rc not in (0, None), output[-2000:]
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
    rc, output, _ = _launch.run(args, _launch.worker_env(timeout=3, DTAPE_TEST_FAULT="hang"), timeout=120)
    logs = _launch.rank_logs(tmp_path / "logs")
    assert rc not in (0, None), output[-2000:]
    line = [ln for ln in logs[0].splitlines() if ln.startswith("dtape: rank 0: step failed:")]
    assert line and "TimeoutError" in line[0] and "ranks [1] never reached it" in line[0], logs[0][-2000:]


EXITS = {  # how rank 1 leaves -> (rank 0's failure line must contain, the exception rank 0 must name)
    "in_run": "WorkerError: builtins.SystemExit: 3",
    "outside_run": "RuntimeError: rank 1 left the program after collective #",
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", sorted(EXITS))
def test_sys_exit_on_rank1_fails_rank0_naming_rank1_never_a_wrong_sum(mode, tmp_path):
    """sys.exit() is a BaseException: inside strategy.run it must be published as the step's failure, and the
    exiting worker's exit barrier must never pair with rank 0's next one-element reduction (a wrong sum)."""
    args = _launch.torchrun_args(tmp_path / "logs", extra=("--monitor-interval", "2")) + \
        [os.path.join(_launch.HERE, "worker_exits.py")]
    rc, output, _ = _launch.run(args, _launch.worker_env(timeout=30, DTAPE_TEST_EXIT=mode), timeout=120)
    logs = _launch.rank_logs(tmp_path / "logs")
    assert rc not in (0, None), output[-3000:]
    assert "rank 0: step 1 in-run sum 3.0" in logs[0] and "rank 0: step 2 in-run sum" not in logs[0], logs[0][-3000:]
    if mode == "in_run":
        assert "rank 0: step 1 reduce 6.0" in logs[0]
    # every sum rank 0 printed is right: step s gives 3 s inside run and 6 s across workers
    sums = [ln for ln in logs[0].splitlines() if ln.startswith("rank 0: step")]
    assert all(float(ln.split()[-1]) == (3 if "in-run" in ln else 6) * int(ln.split()[3]) for ln in sums), sums
    line = [ln for ln in logs[0].splitlines() if ln.startswith("dtape: rank 0: step failed:")]
    assert line and EXITS[mode] in line[0] and "rank 1" in line[0].split(EXITS[mode], 1)[1], logs[0][-3000:]
    assert "raised on worker rank 1 of 2" in logs[0], logs[0][-3000:]
