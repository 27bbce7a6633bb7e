"""scripts/train.py as a user runs it: argument mistakes, -h, refusing to replace a checkpoint, stop signals.

Every run is a subprocess (exit status, stderr, no traceback). Argument
mistakes are found before torch is imported, so those runs take ~0.05 s.
"""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "train.py")
ENV = dict(os.environ, PYTHONPATH=ROOT)  # this checkout's dtape, not an installed one
WAIT_ENV = "DTAPE_TRAIN_TEST_WAIT_FOR_SIGNAL_AT_STEP"


@pytest.fixture(scope="module")
def train():
    spec = importlib.util.spec_from_file_location("dtape_train_script_cli", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cli(*args, timeout=60):
    return subprocess.run([sys.executable, SCRIPT, "--no-progress", *map(str, args)], capture_output=True, check=False,
                          text=True, timeout=timeout, env=ENV, cwd=ROOT)


def _assert_usage_error(proc, expected):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error: "), proc.stderr
    assert expected in lines[0], lines[0]


MISTAKES = [
    (["--epochs", "0"], "--epochs must be 1 or more, got 0; e.g. --epochs 5"),
    (["--epochs", "-2"], "--epochs must be 1 or more, got -2"),
    (["--steps", "0"], "--steps must be 1 or more, got 0; e.g. --steps 100"),
    (["--batch-size", "0"], "--batch-size must be 1 or more, got 0; e.g. --batch-size 64"),
    (["--batch-size", "-8"], "--batch-size must be 1 or more, got -8"),
    (["--lr", "nan"], "--lr must be a finite number above 0, got nan; e.g. --lr 0.01"),
    (["--lr", "inf"], "--lr must be a finite number above 0, got inf"),
    (["--lr", "0"], "--lr must be a finite number above 0, got 0.0"),
    (["--lr", "-0.1"], "--lr must be a finite number above 0, got -0.1"),
    (["--strategy", "mirrored", "--devices", "cpu:0, cpu:1"],
     "--devices 'cpu:0, cpu:1' contains spaces; write the list without them, e.g. --devices cpu:0,cpu:1"),
    (["--strategy", "mirrored", "--devices", ","], "--devices ',' has an empty item; give comma-separated names"),
    (["--strategy", "mirrored", "--devices", "cpu:0,,cpu:1"], "--devices 'cpu:0,,cpu:1' has an empty item"),
    (["--strategy", "mirrored", "--devices", "cpu:0,cpu:0"], "--devices names cpu:0 twice"),
    (["--devices", "cpu:0,cpu:1"],
     "--strategy one_device takes one device, got 2 (cpu:0,cpu:1); use --strategy mirrored for several"),
    (["--devices", "cpu:x"], "--devices: 'cpu:x' is not a device name; use cpu, cpu:N (CPU replicas) or cuda:N"),
    (["--save-every", "0", "--checkpoint-dir", "{tmp}/ckpt"], "--save-every must be 1 or more, got 0"),
    (["--save-every", "5"], "--save-every needs --checkpoint-dir DIR"),
    (["--resume"], "--resume needs --checkpoint-dir DIR"),
    (["--overwrite"], "--overwrite needs --checkpoint-dir DIR"),
    (["--resume", "--overwrite", "--checkpoint-dir", "{tmp}/ckpt"], "--resume and --overwrite exclude each other"),
    (["--dropout", "1"], "--dropout must be in [0, 1), got 1.0; e.g. --dropout 0.1"),
    (["--dropout", "-0.1"], "--dropout must be in [0, 1), got -0.1"),
    (["--dropout", "nan"], "--dropout must be in [0, 1), got nan"),
    (["--seed", "-1"], "--seed must be in [0, 4294967295], got -1"),
    (["--epochs", "x"], "argument --epochs: invalid int value: 'x' (see train.py -h)"),
    (["--task", "mnist"], "argument --task: invalid choice: 'mnist'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--jit-backend", "aot_eager"], "--jit-backend aot_eager needs --jit-compile (the eager step is not compiled)"),
    (["--jit-compile", "--jit-backend", "cudagraphs"], "argument --jit-backend: invalid choice: 'cudagraphs'"),
    (["--out", "{tmp}/file"], "--out {tmp}/file is a file, not a folder; give a folder (it is created if missing)"),
    (["--checkpoint-dir", "{tmp}/file"], "--checkpoint-dir {tmp}/file is a file, not a folder"),
    (["--logdir", "{tmp}/file"], "--logdir {tmp}/file is a file, not a folder"),
    (["--out", "{tmp}/file/sub"], "--out {tmp}/file/sub cannot be written (Not a directory); give a folder you can"),
    (["--checkpoint-dir", "{tmp}/file/sub"], "--checkpoint-dir {tmp}/file/sub cannot be written (Not a directory)"),
]


@pytest.mark.parametrize("args, expected", MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_argument_mistake_is_one_line_and_exit_2(tmp_path, args, expected):
    (tmp_path / "file").write_text("not a folder")
    args = [a.format(tmp=tmp_path) for a in args]
    _assert_usage_error(_cli("--steps", 2, *args), expected.format(tmp=tmp_path))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_cuda_device_on_a_machine_without_cuda_is_a_usage_error():
    _assert_usage_error(_cli("--devices", "cuda:0", "--steps", 2),
                        "--devices: cuda:0 does not exist on this machine (no cuda device); use cpu:0,cpu:1")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write to any folder")
def test_unwritable_out_folder_is_a_usage_error(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    _assert_usage_error(_cli("--out", locked, "--steps", 2), f"--out {locked} cannot be written (Permission denied)")


def test_bad_folder_is_found_before_training(tmp_path):
    """The --out mistake stops the run before the first step: no checkpoint is written in a good folder."""
    (tmp_path / "file").write_text("")
    proc = _cli("--checkpoint-dir", tmp_path / "ckpt", "--out", tmp_path / "file", "--steps", 2)
    _assert_usage_error(proc, "is a file, not a folder")
    assert not (tmp_path / "ckpt" / "last.pt").exists()


def test_logdir_without_tensorboard_names_the_package(tmp_path):
    hide = ("import runpy, sys; sys.modules['tensorboard'] = None; "
            f"sys.argv = ['train.py', '--logdir', {str(tmp_path)!r}, '--steps', '2']; "
            f"runpy.run_path({SCRIPT!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", hide], capture_output=True, text=True, timeout=60, env=ENV, check=False)
    _assert_usage_error(proc, "--logdir needs the tensorboard package: pip install tensorboard")


def test_help_shows_defaults():
    proc = _cli("-h")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # undo argparse's line wrapping
    for shown in ("(default: digits)", "(default: one_device)", "(default: 0)",
                  "(task default: digits 20, charlm 3)", "(task default: digits 64, charlm 32)",
                  "(task default: digits 0.1, charlm 0.003)"):
        assert shown in text, shown


def test_existing_checkpoint_is_not_replaced_without_resume_or_overwrite(train, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = _cli("--steps", 3, "--checkpoint-dir", ckpt, "--out", tmp_path / "out")
    assert first.returncode == 0 and "final test accuracy" in first.stdout, first.stderr
    assert (tmp_path / "out" / "metrics.json").exists()
    before = (ckpt / "last.pt").read_bytes()
    proc = _cli("--steps", 2, "--checkpoint-dir", ckpt)
    _assert_usage_error(proc, f"--checkpoint-dir {ckpt} already holds a checkpoint (last.pt, step 3); "
                              "continue it with --resume, replace it with --overwrite, or choose another "
                              "--checkpoint-dir")
    assert (ckpt / "last.pt").read_bytes() == before
    train.main(["--no-progress", "--steps", "2", "--checkpoint-dir", str(ckpt), "--overwrite"])
    assert (ckpt / "last.pt").read_bytes() != before


# -- stop signals ----------------------------------------------------------------------

def _stopped_run(sig, step, args):
    """Runs the job in a subprocess that waits, in the middle of step `step`, for `sig`; sends it.

    `step` may also name another place of the test hook ("evaluation", "outputs": see train.py)."""
    env = dict(ENV, **{WAIT_ENV: str(step)})
    proc = subprocess.Popen([sys.executable, SCRIPT, "--no-progress", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    watchdog = threading.Timer(120, proc.kill)  # a bug fails the test instead of hanging it
    watchdog.start()
    try:
        for line in proc.stdout:  # ends early only if the child exits without reaching the step
            if line.startswith(f"test hook: step {step} waits") or (
                    line.startswith("test hook: ") and not str(step).isdigit()):
                proc.send_signal(sig)
                break
        err = proc.communicate(timeout=120)[1]
    finally:
        watchdog.cancel()
    return proc.returncode, err


@pytest.mark.parametrize("sig, status, strategy", [(signal.SIGTERM, 143, "mirrored"),
                                                   (signal.SIGINT, 130, "one_device")])
def test_signal_mid_epoch_saves_and_resume_gives_the_uninterrupted_losses(train, tmp_path, sig, status, strategy):
    """Batch 128: 11 steps per epoch. The signal arrives during step 8; step 8 finishes and is saved."""
    devices = "cpu:0,cpu:1" if strategy == "mirrored" else "cpu"
    common = ["--strategy", strategy, "--devices", devices, "--batch-size", 128, "--dropout", 0.3,
              "--optimizer", "adam", "--lr", 0.01]
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    code, err = _stopped_run(sig, 8, ["--steps", 16, "--checkpoint-dir", ckpt, "--out", out,
                                      "--save-every", 3, *common])
    name = signal.Signals(sig).name
    assert code == status, err
    assert err.splitlines()[-1] == (f"train.py: stopped by {name} after step 8; saved {ckpt}/last.pt; "
                                    "continue with --resume"), err
    with open(out / "metrics.json") as f:
        stopped = json.load(f)
    assert stopped["final_step"] == 8 and len(stopped["loss"]) == 8 and stopped["stopped_by"] == name
    assert (out / "loss.png").exists()

    full = train.main(["--no-progress", "--steps", "16", *map(str, common)])
    assert train.dtape.checkpoint.read(ckpt / "last.pt")["step"] == 8  # the step in flight was finished and saved
    resumed = train.main(["--no-progress", "--steps", "16", "--checkpoint-dir", str(ckpt), "--resume",
                          *map(str, common)])
    assert resumed["loss"] == full["loss"]  # bit-identical, dropout masks included
    assert resumed["loss"][:8] == stopped["loss"]
    assert [e["epoch"] for e in resumed["epochs"]] == [0] and resumed["epochs"][0]["step"] == 11
    assert [(s["first_step"], s["last_step"], s["stopped_by"]) for s in resumed["sessions"]] == \
        [(0, 8, name), (8, 16, None)]
    assert "stopped_by" not in resumed
    np.testing.assert_equal(resumed["final_test_accuracy"], full["final_test_accuracy"])


def test_signal_during_the_final_evaluation_stops_with_the_line_and_resume_evaluates(train, tmp_path):
    """SIGTERM between the final train and test accuracies: the last step is saved, the evaluation is left to
    --resume, the outputs say so, the job exits 143 after the "stopped by" line (before: exit 0, no line)."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    code, err = _stopped_run(signal.SIGTERM, "evaluation", ["--steps", 3, "--checkpoint-dir", ckpt, "--out", out])
    assert code == 143, err
    assert err.splitlines()[-1] == ("train.py: stopped by SIGTERM after step 3; saved "
                                    f"{ckpt}/last.pt; continue with --resume"), err
    stopped = json.loads((out / "metrics.json").read_text())
    assert stopped["stopped_by"] == "SIGTERM" and stopped["final_step"] == 3 and "final_test_accuracy" not in stopped
    full = train.main(["--no-progress", "--steps", "3"])
    assert train.dtape.checkpoint.read(ckpt / "last.pt")["step"] == 3
    resumed = train.main(["--no-progress", "--steps", "3", "--checkpoint-dir", str(ckpt), "--resume"])
    assert resumed["loss"] == full["loss"] and resumed["final_test_accuracy"] == full["final_test_accuracy"]
    assert [s["stopped_by"] for s in resumed["sessions"]] == ["SIGTERM", None]


def test_signal_while_the_outputs_are_written_finishes_them_then_stops_with_the_line(tmp_path):
    """SIGINT after metrics.json, before loss.png: both are written whole, then the line and exit 130
    (before: killed mid-write by the default handler, no line)."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    code, err = _stopped_run(signal.SIGINT, "outputs", ["--steps", 3, "--checkpoint-dir", ckpt, "--out", out])
    assert code == 130, err
    assert err.splitlines()[-1] == ("train.py: stopped by SIGINT after step 3, the last one; the run had finished "
                                    f"(saved {ckpt}/last.pt)"), err
    finished = json.loads((out / "metrics.json").read_text())
    assert finished["final_step"] == 3 and "final_test_accuracy" in finished and "stopped_by" not in finished
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(out)) == ["loss.png", "metrics.json"]   # no temporary left behind


def test_the_same_signal_again_within_a_second_is_the_same_stop_request(train):
    """torchrun passes a SIGINT/SIGTERM it gets on to its workers, which the terminal's Ctrl-C or the
    scheduler's SIGTERM already reached: that repeat must not be the "second signal" that stops at once."""
    clock, escalated = [100.0], []
    stop = train.StopSignals()
    stop.clock = lambda: clock[0]
    previous = {s: signal.signal(s, lambda signum, frame: escalated.append(signum)) for s in stop.SIGNALS}
    try:
        with stop:
            stop._handle(signal.SIGTERM, None)
            clock[0] += 0.3
            stop._handle(signal.SIGTERM, None)       # torchrun's copy of the same request
            assert stop.signum == signal.SIGTERM and escalated == []
            stop._handle(signal.SIGINT, None)        # another signal: the user insists
            assert escalated == [signal.SIGINT]
            clock[0] += 1.0
            stop._handle(signal.SIGTERM, None)       # the same signal, later: stops at once
            assert escalated == [signal.SIGINT, signal.SIGTERM]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_global_batch_smaller_than_the_replicas_trains_and_says_so(tmp_path):
    proc = _cli("--task", "digits", "--strategy", "mirrored", "--devices", "cpu:0,cpu:1", "--batch-size", 1,
                "--steps", 2, "--out", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    assert "--batch-size 1 is smaller than the 2 replicas: 1 of them get no examples" in proc.stderr
    proc = _cli("--task", "digits", "--strategy", "mirrored", "--batch-size", 2, "--steps", 2, "--out", tmp_path / "ok")
    assert proc.returncode == 0 and "smaller than" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("world", ["two", "", "1.5"])
def test_a_world_size_that_is_not_a_number_is_one_error_line_and_exit_2(train, monkeypatch, capsys, world):
    """torchrun sets WORLD_SIZE to a number; anything else (a hand-set environment) is named, not a traceback."""
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit) as exc:
        train.make_strategy(train.parse_args(["--steps", "2"]))
    err = capsys.readouterr().err.splitlines()
    assert exc.value.code == 2 and len(err) == 1, err
    assert err[0] == f"train.py: error: WORLD_SIZE={world!r} is not a whole number; unset it, or launch with torchrun", err


def test_single_process_strategy_under_torchrun_is_refused_before_any_folder_is_made(tmp_path):
    env = dict(ENV, WORLD_SIZE="2")
    proc = subprocess.run([sys.executable, SCRIPT, "--no-progress", "--strategy", "mirrored", "--out", tmp_path / "out",
                           "--checkpoint-dir", tmp_path / "ckpt"], capture_output=True, text=True, timeout=60,
                          env=env, cwd=ROOT, check=False)
    _assert_usage_error(proc, "--strategy mirrored runs in one process, but this is one of WORLD_SIZE=2 processes")
    assert not (tmp_path / "out").exists() and not (tmp_path / "ckpt").exists()
