"""scripts/train.py --strategy multi_worker under torchrun equals --strategy one_device.

Per-step losses of 2 CPU workers (gloo, 127.0.0.1) must equal one device's
on the same global batches to 1e-5 relative: standalone for digits and a
short charlm run, two `--nnodes 2` launches on a c10d rendezvous, and a run
whose rank 1 is SIGKILLed mid-epoch, restarted by torchrun and resumed from
the last checkpoint.
"""
import importlib.util
import json
import os
import signal
import time

import numpy as np
import pytest

import _launch

DIGITS = ["--task", "digits", "--steps", "6", "--batch-size", "64"]
CHARLM = ["--task", "charlm", "--steps", "3", "--batch-size", "8"]
RESTART = ["--task", "digits", "--epochs", "2", "--batch-size", "256"]   # 5 steps per epoch


@pytest.fixture(scope="module")
def train():
    spec = importlib.util.spec_from_file_location("dtape_train_script_mp", _launch.TRAIN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _one_device_losses(train, args):
    return train.main(["--no-progress", "--strategy", "one_device", *args])["loss"]


def _losses(out):
    with open(os.path.join(out, "metrics.json")) as f:
        return json.load(f)["loss"]


def _train_cmd(out, args):
    return [_launch.TRAIN, "--strategy", "multi_worker", "--no-progress", "--out", str(out), *args]


def _assert_same_losses(got, want):
    assert len(got) == len(want)
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.multiprocess
@pytest.mark.parametrize("args", [DIGITS, CHARLM], ids=["digits", "charlm"])
def test_standalone_two_workers_losses_equal_one_device(train, args, tmp_path):
    cmd = _launch.torchrun_args(tmp_path / "logs") + _train_cmd(tmp_path, args)
    rc, output, _ = _launch.run(cmd, _launch.worker_env(timeout=30))
    assert rc == 0, output[-3000:] + str(_launch.rank_logs(tmp_path / "logs"))
    _assert_same_losses(_losses(tmp_path), _one_device_losses(train, args))
    logs = _launch.rank_logs(tmp_path / "logs")
    assert "final test accuracy" in logs[0] and "final test accuracy" not in logs[1]   # rank 0 reports


@pytest.mark.multiprocess
def test_two_workers_with_a_compiled_step_equal_one_device(train, tmp_path):
    """--jit-compile under torchrun: the traced apply_gradients reduces inside the graph (backend none: fast)."""
    args = [*DIGITS, "--optimizer", "adam", "--jit-compile", "--jit-backend", "none"]
    cmd = _launch.torchrun_args(tmp_path / "logs") + _train_cmd(tmp_path, args)
    rc, output, _ = _launch.run(cmd, _launch.worker_env(timeout=30))
    logs = _launch.rank_logs(tmp_path / "logs")
    assert rc == 0, output[-3000:] + str(logs)
    _assert_same_losses(_losses(tmp_path), _one_device_losses(train, DIGITS + ["--optimizer", "adam"]))
    assert "compiled step (none): first step" in logs[0]
    with open(tmp_path / "metrics.json") as f:
        assert json.load(f)["sessions"][-1]["traces"] == 1  # really traced, not run eagerly


@pytest.mark.multiprocess
def test_two_nodes_on_c10d_rendezvous_losses_equal_one_device(train, tmp_path):
    port = _launch.free_port()
    procs = []
    for node in (0, 1):
        cmd = [*_launch.torchrun_args(tmp_path / f"logs{node}", nproc=1, standalone=False),
               "--nnodes", "2", "--node-rank", str(node), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "dtape-test",
               *_train_cmd(tmp_path / f"out{node}", DIGITS)]
        procs.append(_launch.start_command(cmd, _launch.worker_env(timeout=30)))
    results = [_launch.finish(p, timeout=90) for p in procs]
    assert all(rc == 0 for rc, _ in results), results
    written = [n for n in (0, 1) if os.path.exists(tmp_path / f"out{n}" / "metrics.json")]
    assert len(written) == 1    # only global rank 0 writes, whichever node it landed on
    _assert_same_losses(_losses(tmp_path / f"out{written[0]}"), _one_device_losses(train, DIGITS))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_worker_killed_mid_epoch_restarts_and_resumes_same_losses(train, tmp_path):
    cmd = _launch.torchrun_args(tmp_path / "logs", extra=["--max-restarts", "1"])
    cmd += [os.path.join(_launch.HERE, "kill_once_train.py"), "--strategy", "multi_worker", "--no-progress",
            "--out", str(tmp_path), "--checkpoint-dir", str(tmp_path / "ckpt"), "--resume", *RESTART]
    rc, output, _ = _launch.run(cmd, _launch.worker_env(timeout=30, DTAPE_TEST_KILL_AT_STEP=7), timeout=150)
    assert rc == 0, output[-3000:]
    first, second = _launch.rank_logs(tmp_path / "logs", 0), _launch.rank_logs(tmp_path / "logs", 1)
    assert "rank 1 died" in first[0], first[0][-2000:]           # the survivor named the killed rank
    assert "no checkpoint" in first[0] and "no checkpoint" not in second[0]   # the restart resumed
    _assert_same_losses(_losses(tmp_path), _one_device_losses(train, RESTART))


def test_single_process_strategy_under_torchrun_world_refuses(train, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for strategy in ("mirrored", "one_device"):
        with pytest.raises(SystemExit) as exc:  # refused while the arguments are checked
            train.parse_args(["--strategy", strategy])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "error:" in err and "--strategy multi_worker" in err, err
        assert "launch/README.md" in err


def test_multi_worker_without_torchrun_says_it_trains_as_one_worker(train, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    train.load_libraries()
    monkeypatch.setattr(train.dtape.distribute, "MultiWorkerMirroredStrategy", lambda **kw: "strategy")
    assert train.make_strategy(train.parse_args(["--strategy", "multi_worker"])) == "strategy"
    assert "no torchrun environment" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    train.make_strategy(train.parse_args(["--strategy", "multi_worker"]))
    assert "no torchrun environment" not in capsys.readouterr().err


# -- stop signals under torchrun ------------------------------------------------------------

SIGNALLED = ["--task", "digits", "--steps", "12", "--batch-size", "64"]


def _worker_pids(parent):
    """{rank: pid} of torchrun's worker processes (its children whose environment has RANK)."""
    pids = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError):
            continue
        if b"RANK" in env:
            pids[int(env[b"RANK"])] = int(entry)
    return pids


def _wait_for_line(log_dir, rank, text, proc, timeout=120):
    """Waits until rank's log holds `text` (True), or torchrun ended or `timeout` passed (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if text in _launch.rank_logs(log_dir).get(rank, ""):
            return True
        time.sleep(0.05)
    return False


def _stop_workers(tmp_path, hooks, send):
    """Runs SIGNALLED on 2 workers whose test hook waits as `hooks` says ("R:K,..."); once the hook of the
    first rank in `hooks` waits, `send(pids)` signals workers. Returns (torchrun's rc, output, rank logs)."""
    logs = tmp_path / "logs"
    cmd = _launch.torchrun_args(logs, extra=("--monitor-interval", "2")) + _train_cmd(
        tmp_path / "out", [*SIGNALLED, "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "2"])
    env = _launch.worker_env(timeout=60, DTAPE_TRAIN_TEST_WAIT_FOR_SIGNAL_AT_STEP=hooks)
    proc = _launch.start_command(cmd, env)
    rank, step = hooks.split(",")[0].split(":")
    rank = int(rank)
    try:
        assert _wait_for_line(logs, rank, f"test hook: step {step} waits", proc), _launch.rank_logs(logs)
        send(_worker_pids(proc.pid))
    finally:
        rc, output = _launch.finish(proc, timeout=150)
    return rc, output, _launch.rank_logs(logs)


def _assert_stopped_after(train, tmp_path, logs, step, lines):
    """Each rank's last "stopped by" line is lines[rank]; the checkpoint and metrics.json hold `step` steps,
    and resuming the checkpoint gives one device's uninterrupted losses."""
    for rank, line in enumerate(lines):
        said = [ln for ln in logs[rank].splitlines() if ln.startswith("train.py: stopped by")]
        assert said == [line.format(ckpt=tmp_path / "ckpt" / "last.pt")], logs[rank][-3000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["final_step"] == step == len(metrics["loss"]) and metrics["stopped_by"] == "SIGTERM"
    resumed = train.main(["--no-progress", "--strategy", "one_device", "--checkpoint-dir", str(tmp_path / "ckpt"),
                          "--resume", *SIGNALLED])
    assert resumed["sessions"][0]["last_step"] == step
    _assert_same_losses(resumed["loss"], _one_device_losses(train, SIGNALLED))


@pytest.mark.multiprocess
def test_sigterm_to_one_worker_stops_every_worker_after_the_same_step_with_the_checkpoint(train, tmp_path):
    """Rank 1 alone gets SIGTERM, during step 3: rank 0 must stop after step 3 too (not run step 4 against
    rank 1's checkpoint collectives and hang), both save the one checkpoint and say so."""
    rc, output, logs = _stop_workers(tmp_path, "1:3",
                                     lambda pids: os.kill(pids[1], signal.SIGTERM))
    assert rc is not None, output[-3000:]   # no hang
    _assert_stopped_after(train, tmp_path, logs, 3, [
        "train.py: stopped by SIGTERM (sent to another worker) after step 3; saved {ckpt}; continue with --resume",
        "train.py: stopped by SIGTERM after step 3; saved {ckpt}; continue with --resume"])


@pytest.mark.multiprocess
def test_sigterm_reaching_the_workers_at_different_moments_stops_both_after_the_same_step(train, tmp_path):
    """Rank 0 waits in step 3; rank 1, already further in step 3 (maybe past the point where its request
    joins the step's all-reduce), gets SIGTERM first, then rank 0: both stop after step 3."""
    def send(pids):
        os.kill(pids[1], signal.SIGTERM)
        time.sleep(0.5)  # a different moment; the outcome does not depend on it
        os.kill(pids[0], signal.SIGTERM)
    rc, output, logs = _stop_workers(tmp_path, "0:3", send)
    assert rc is not None, output[-3000:]
    line = "train.py: stopped by SIGTERM after step 3; saved {ckpt}; continue with --resume"
    _assert_stopped_after(train, tmp_path, logs, 3, [line, line])
