"""scripts/train.py: short runs in-process (metrics, plot, checkpoints, resume, strategies agree)."""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "train.py")


@pytest.fixture(scope="module")
def train():
    spec = importlib.util.spec_from_file_location("dtape_train_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(train, *args):
    return train.main(["--no-progress", *map(str, args)])


def test_train_short_run_writes_metrics_json_and_loss_png(train, tmp_path):
    metrics = _run(train, "--steps", 5, "--out", tmp_path)
    with open(tmp_path / "metrics.json") as f:
        saved = json.load(f)
    assert len(saved["loss"]) == 5 and all(np.isfinite(saved["loss"]))
    assert saved["final_step"] == 5 and 0.0 <= saved["final_test_accuracy"] <= 1.0
    assert saved["loss"] == metrics["loss"]
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_train_epoch_end_records_accuracy_throughput_and_checkpoint(train, tmp_path):
    metrics = _run(train, "--epochs", 1, "--batch-size", 256, "--checkpoint-dir", tmp_path)
    (epoch,) = metrics["epochs"]
    assert epoch["epoch"] == 0 and epoch["step"] == 1437 // 256
    assert 0.0 <= epoch["test_accuracy"] <= 1.0 and epoch["examples_per_second"] > 0
    assert os.listdir(tmp_path) == ["last.pt"]


def test_train_resume_continues_from_saved_step(train, tmp_path):
    common = ["--optimizer", "adam", "--lr", 0.01, "--batch-size", 128]
    full = _run(train, "--steps", 16, *common)
    _run(train, "--steps", 7, "--checkpoint-dir", tmp_path, *common)
    resumed = _run(train, "--steps", 16, "--checkpoint-dir", tmp_path, "--resume", *common)
    assert resumed["final_step"] == 16 and len(resumed["loss"]) == 16
    np.testing.assert_allclose(resumed["loss"], full["loss"], rtol=1e-6)
    assert resumed["final_test_accuracy"] == full["final_test_accuracy"]


def test_train_resume_under_mirrored_continues(train, tmp_path):
    common = ["--strategy", "mirrored", "--devices", "cpu:0,cpu:1", "--batch-size", 128]
    full = _run(train, "--steps", 14, *common)
    _run(train, "--steps", 5, "--checkpoint-dir", tmp_path, *common)
    resumed = _run(train, "--steps", 14, "--checkpoint-dir", tmp_path, "--resume", *common)
    np.testing.assert_allclose(resumed["loss"], full["loss"], rtol=1e-6)


@pytest.mark.parametrize("strategy", ["mirrored", "one_device"])
def test_train_resume_with_dropout_is_bit_identical(train, tmp_path, strategy):
    """The checkpoint holds every random state (replicas' generators, torch's default one)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # force replica interleaving: results must not depend on it
    try:
        devices = "cpu:0,cpu:1" if strategy == "mirrored" else "cpu"
        common = ["--strategy", strategy, "--devices", devices, "--batch-size", 128, "--dropout", 0.3]
        full = _run(train, "--steps", 9, *common)
        _run(train, "--steps", 4, "--checkpoint-dir", tmp_path, *common)
        resumed = _run(train, "--steps", 9, "--checkpoint-dir", tmp_path, "--resume", *common)
        no_dropout = _run(train, "--steps", 4, *common[:-2])
    finally:
        sys.setswitchinterval(old)
    assert resumed["loss"] == full["loss"] and resumed["dropout"] == 0.3
    assert no_dropout["loss"] != full["loss"][:4]


def test_train_mirrored_per_step_losses_match_one_device(train):
    one = _run(train, "--steps", 30, "--strategy", "one_device")
    two = _run(train, "--steps", 30, "--strategy", "mirrored", "--devices", "cpu:0,cpu:1")
    assert two["num_replicas"] == 2 and one["num_replicas"] == 1
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-5)


def test_train_same_seed_reproducible_other_seed_differs(train):
    a, b = _run(train, "--steps", 4, "--seed", 3), _run(train, "--steps", 4, "--seed", 3)
    c = _run(train, "--steps", 4, "--seed", 4)
    assert a["loss"] == b["loss"] and a["loss"] != c["loss"]


def test_train_resume_without_checkpoint_dir_is_a_usage_error(train):
    with pytest.raises(SystemExit):
        train.parse_args(["--resume"])


def test_train_command_line_runs(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--steps", "2", "--no-progress", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "final test accuracy" in proc.stdout
    assert (tmp_path / "metrics.json").exists()


def test_train_charlm_without_implementation_exits_with_message(train, monkeypatch):
    def not_yet(name):
        raise NotImplementedError(f"task {name!r} is not implemented yet; use --task digits")

    monkeypatch.setattr(train.tasks, "get_task", not_yet)
    with pytest.raises(SystemExit, match="not implemented yet"):
        train.main(["--task", "charlm", "--steps", "1"])


def test_readme_starts_with_title_and_the_two_commands_ci_runs():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    assert text.startswith("# dtape")
    commands = [line for line in text.splitlines() if line.startswith("python3 -m venv")]
    assert len(commands) == 2
    assert "scripts/train.py --task digits --strategy mirrored --devices cpu:0,cpu:1" in commands[0]
    assert "torch==2.13.0" in commands[0] and "torch==2.13.0" in ci
    assert commands[1].endswith("lint-imports && python -m pytest -q -p no:cacheprovider")
    assert 'pip install -e ".[test,examples]"' in commands[1] and '-e ".[test,examples]"' in ci
    assert "lint-imports" in ci and "pytest -q -p no:cacheprovider" in ci


def test_readme_python_examples_run(tmp_path, monkeypatch):
    import re
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) >= 2
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        exec(compile(block.replace("/tmp/model.pt", str(tmp_path / "model.pt")), "README.md", "exec"), {})


def test_train_charlm_short_mirrored_run_matches_one_device(train):
    args = ["--task", "charlm", "--steps", 2, "--batch-size", 4]
    one = _run(train, *args)
    two = _run(train, *args, "--strategy", "mirrored", "--devices", "cpu:0,cpu:1")
    assert len(one["loss"]) == 2 and one["loss"][0] > 1.0
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-5)
