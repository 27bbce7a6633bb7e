"""scripts/train.py: short runs in-process (metrics, plot, checkpoints, resume, strategies agree)."""
import importlib.util
import json
import os
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
    acc_ax = train.plot_metrics(metrics).axes[1]  # no full epoch: the final accuracies as bars, not an empty plot
    assert [p.get_height() for p in acc_ax.patches] == [saved["final_train_accuracy"], saved["final_test_accuracy"]]


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


# -- checking first, resuming, stopping, outputs -------------------------

def _usage_error(train, capsys, *args):
    """Runs main, expecting a usage error; returns its one stderr line."""
    with pytest.raises(SystemExit) as e:
        _run(train, *args)
    assert e.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("train.py: error: "), lines
    return lines[0]


def test_train_unknown_device_and_too_large_batch_are_usage_errors(train, capsys):
    assert "--devices: 'tpu:0' is not a device name; use cpu, cpu:N (CPU replicas) or cuda:N" in \
        _usage_error(train, capsys, "--devices", "tpu:0")
    assert "--batch-size 5000 is larger than the digits training set (1437 examples); use --batch-size 1437 or less" \
        in _usage_error(train, capsys, "--batch-size", 5000)


@pytest.mark.parametrize("args, message", [
    (["--task", "charlm", "--batch-size", 128, "--optimizer", "sgd", "--lr", 0.1],
     "was made with --task digits, this run has --task charlm; pass --task digits to continue it"),
    (["--seed", 1], "was made with --seed 0, this run has --seed 1; pass --seed 0"),
    (["--batch-size", 64], "was made with --batch-size 128, this run has --batch-size 64; pass --batch-size 128"),
    (["--dropout", 0.2], "was made with --dropout 0.0, this run has --dropout 0.2; pass --dropout 0.0"),
    (["--optimizer", "adam"], "was made with --optimizer sgd, this run has --optimizer adam; pass --optimizer sgd"),
    (["--lr", 0.05], "was made with --lr 0.1, this run has --lr 0.05; pass --lr 0.1"),
])
def test_train_resume_refuses_a_checkpoint_of_other_settings(train, tmp_path, capsys, args, message):
    ckpt = tmp_path / "ckpt"
    _run(train, "--steps", 2, "--batch-size", 128, "--checkpoint-dir", ckpt)
    before = (ckpt / "last.pt").read_bytes()
    capsys.readouterr()
    common = ["--steps", 4, "--checkpoint-dir", ckpt, "--resume", "--batch-size", 128]
    line = _usage_error(train, capsys, *common, *args)
    assert f"--resume: {ckpt}/last.pt {message}" in line
    assert line.endswith("or start a new run with --overwrite or another --checkpoint-dir")
    assert (ckpt / "last.pt").read_bytes() == before


def test_train_resume_refuses_another_model_architecture(train, tmp_path, capsys, monkeypatch):
    ckpt = tmp_path / "ckpt"
    _run(train, "--steps", 2, "--checkpoint-dir", ckpt)
    capsys.readouterr()
    digits = train.tasks.get_task("digits")
    monkeypatch.setattr(digits, "HIDDEN", 256)  # the code changed since the checkpoint was made
    line = _usage_error(train, capsys, "--steps", 4, "--checkpoint-dir", ckpt, "--resume")
    assert "was made with model layers = [64, 128, 10], this run has [64, 256, 10]; use the code that made it" in line


def test_train_resume_checks_a_checkpoint_without_config_by_its_metrics(train, capsys):
    old = {"metrics": {"task": "digits", "seed": 0, "global_batch_size": 64, "optimizer": "sgd", "lr": 0.1,
                       "dropout": 0.0}}
    args = train.build_parser().parse_args(["--seed", "3", "--checkpoint-dir", "ckpt"])
    for key, value in train.tasks.DEFAULTS["digits"].items():
        setattr(args, key, value)
    with pytest.raises(SystemExit):
        train.check_resumable(args, train.tasks.get_task("digits"), old)
    assert "was made with --seed 0, this run has --seed 3" in capsys.readouterr().err
    args.seed = 0
    train.check_resumable(args, train.tasks.get_task("digits"), old)  # same settings: accepted


def test_train_resume_without_a_checkpoint_says_so_and_starts_at_step_0(train, tmp_path, capsys):
    metrics = _run(train, "--steps", 3, "--checkpoint-dir", tmp_path / "new", "--resume")
    assert "--resume: no checkpoint at" in capsys.readouterr().err and len(metrics["loss"]) == 3
    assert metrics["loss"] == _run(train, "--steps", 3)["loss"]


def test_train_resume_of_a_corrupt_checkpoint_is_a_usage_error(train, tmp_path, capsys):
    (tmp_path / "last.pt").write_bytes(b"not a checkpoint")
    line = _usage_error(train, capsys, "--steps", 3, "--checkpoint-dir", tmp_path, "--resume")
    assert "last.pt" in line and line.endswith("move it away, or start over with --overwrite")


def test_train_save_every_saves_every_n_steps_and_at_epoch_ends(train, tmp_path, monkeypatch):
    saved = []
    original = train.Trainer.save
    monkeypatch.setattr(train.Trainer, "save", lambda self: (saved.append(self.step), original(self)))
    _run(train, "--steps", 14, "--batch-size", 128, "--save-every", 4, "--checkpoint-dir", tmp_path)
    assert saved == [4, 8, 11, 12, 14]  # 11 steps per epoch; 14: the end of the run
    assert train.dtape.checkpoint.read(tmp_path / "last.pt")["step"] == 14


def test_train_metrics_continue_across_resume(train, tmp_path, capsys):
    """Batch 128: 11 steps per epoch; the first session stops in epoch 0, the second ends after epoch 1."""
    common = ["--batch-size", 128, "--checkpoint-dir", tmp_path]
    full = _run(train, "--steps", 25, "--batch-size", 128)
    first = _run(train, "--steps", 7, *common)
    capsys.readouterr()
    resumed = _run(train, "--steps", 25, "--resume", *common)
    assert "resumed from step 7" in capsys.readouterr().out
    assert resumed["loss"] == full["loss"]
    assert [(e["epoch"], e["step"]) for e in resumed["epochs"]] == [(0, 11), (1, 22)]
    assert [e["test_accuracy"] for e in resumed["epochs"]] == [e["test_accuracy"] for e in full["epochs"]]
    epoch0 = resumed["epochs"][0]  # its time and examples add up over both sessions
    assert epoch0["examples_per_second"] * epoch0["seconds"] == pytest.approx(11 * 128)
    assert [(s["first_step"], s["last_step"]) for s in resumed["sessions"]] == [(0, 7), (7, 25)]
    assert resumed["run_seconds"] >= first["run_seconds"] + resumed["sessions"][1]["seconds"]
    assert train.dtape.checkpoint.read(tmp_path / "last.pt")["metrics"]["run_seconds"] == resumed["run_seconds"]


def test_train_loss_png_has_the_loss_curve_and_accuracy_per_epoch(train, tmp_path):
    metrics = _run(train, "--epochs", 2, "--batch-size", 256, "--out", tmp_path)
    fig = train.plot_metrics(metrics)
    loss_ax, acc_ax = fig.axes
    assert list(loss_ax.lines[0].get_ydata()) == metrics["loss"]
    train_line, test_line = acc_ax.lines
    assert list(train_line.get_xdata()) == [0, 1]
    assert list(train_line.get_ydata()) == [e["train_accuracy"] for e in metrics["epochs"]]
    assert list(test_line.get_ydata()) == [e["test_accuracy"] for e in metrics["epochs"]]
    import matplotlib.image
    assert matplotlib.image.imread(tmp_path / "loss.png").shape[:2] == (400, 1000)


def test_train_logdir_writes_tensorboard_scalars(train, tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    metrics = _run(train, "--epochs", 1, "--batch-size", 256, "--logdir", tmp_path)
    events = event_accumulator.EventAccumulator(str(tmp_path))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"loss", "learning_rate", "accuracy/train", "accuracy/test",
                                             "examples_per_second"}
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5]
    np.testing.assert_allclose([e.value for e in loss], metrics["loss"], rtol=1e-6)
    assert [e.value for e in events.Scalars("learning_rate")] == pytest.approx([0.1] * 5)
    (test_acc,) = events.Scalars("accuracy/test")
    assert test_acc.step == 5 and test_acc.value == pytest.approx(metrics["epochs"][0]["test_accuracy"])
    (speed,) = events.Scalars("examples_per_second")
    assert speed.value == pytest.approx(metrics["epochs"][0]["examples_per_second"], rel=1e-6)


def test_train_readme_first_command_parses_and_runs(train, tmp_path):
    with open(os.path.join(ROOT, "README.md")) as f:
        command = next(line for line in f if line.startswith("python3 -m venv"))
    argv = command.split("python scripts/train.py ", 1)[1].split()
    assert argv == ["--task", "digits", "--strategy", "mirrored", "--devices", "cpu:0,cpu:1", "--out", "runs/digits"]
    metrics = _run(train, *argv[:-1], tmp_path, "--steps", 3)
    assert metrics["num_replicas"] == 2 and (tmp_path / "loss.png").exists()


# -- crafted checkpoints: a valid checksum, contents train.py cannot use ----------------------

def _craft(path, change):
    """Rewrites the checkpoint at `path` with `change(tensors, stored, data)` applied, checksum and all (what
    anyone who can write the file can do): variables' tensors, stored objects and plain data, decoded."""
    ckpt = sys.modules["dtape.checkpoint"]
    tensors, stored, data = ckpt._load(path)
    tensors = {k: v for k, v in tensors.items() if not k.startswith("__data__/")}
    change(tensors, stored, data)
    encoded = {name: ckpt._encode(value, repr(name), tensors, set()) for name, value in data.items()}
    with open(path, "wb") as f:
        f.write(ckpt._serialize(tensors, stored, encoded))


def _set(*path, value):
    def change(tensors, stored, data):
        node = data
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return change


def _delete(*path):
    def change(tensors, stored, data):
        node = data
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]
    return change


def _change_variable(key, make):
    def change(tensors, stored, data):
        tensors[key] = make(tensors[key])
    return change


def _drop_last_variable(name):
    def change(tensors, stored, data):
        key, _ = stored[name].pop()
        del tensors[key]
    return change


def _add_variable(name):
    def change(tensors, stored, data):
        key = f"{name}/{len(stored[name])}"
        stored[name].append([key, "extra"])
        tensors[key] = sys.modules["torch"].zeros(3)
    return change


def _rename_variable(tensors, stored, data):
    stored["model"][0][1] = "someone_else/kernel"


def _drop_object(name):
    def change(tensors, stored, data):
        for key, _ in stored.pop(name):
            del tensors[key]
    return change


def _torch():
    return sys.modules["torch"]


CRAFTED = {  # id -> (change, words the one error line must hold)
    "step_str": (_set("step", value="2"), "step"),
    "step_negative": (_set("step", value=-1), "step"),
    "step_float": (_set("step", value=2.5), "step"),
    "step_bool": (_set("step", value=True), "step"),
    "step_huge": (_set("step", value=10 ** 30), "step"),
    "step_vs_losses": (_set("step", value=1), "step"),
    "no_step": (_delete("step"), "step"),
    "metrics_list": (_set("metrics", value=[1, 2]), "metrics"),
    "no_metrics": (_delete("metrics"), "metrics"),
    "loss_strings": (_set("metrics", "loss", value=["a", "b"]), "loss"),
    "epochs_int": (_set("metrics", "epochs", value=3), "epochs"),
    "sessions_ints": (_set("metrics", "sessions", value=[5]), "sessions"),
    "run_seconds_str": (_set("metrics", "run_seconds", value="x"), "run_seconds"),
    "config_str": (_set("config", value="x"), "config"),
    "no_config_nor_settings": (lambda t, s, d: (d.pop("config"), d["metrics"].pop("task")), "settings"),
    "epoch_time_str": (_set("epoch_time", "seconds", value="x"), "epoch_time"),
    "epoch_time_list": (_set("epoch_time", value=[1]), "epoch_time"),
    "rng_short": (lambda t, s, d: d.update(rng=_torch().zeros(10, dtype=_torch().uint8)), "rng"),
    "rng_float": (lambda t, s, d: d.update(rng=d["rng"].float()), "rng"),
    "no_rng": (_delete("rng"), "rng"),
    "variable_shape": (_change_variable("model/0", lambda v: v[:1]), "shape"),
    "variable_dtype": (_change_variable("model/0", lambda v: v.double()), "dtype"),
    "variable_name": (_rename_variable, "someone_else/kernel"),
    "variable_missing": (_drop_last_variable("model"), "variables"),
    "variable_extra": (_add_variable("optimizer"), "variables"),
    "no_model": (_drop_object("model"), "'model'"),
    "no_optimizer": (_drop_object("optimizer"), "'optimizer'"),
}


@pytest.fixture(scope="module")
def finished_checkpoint(train, tmp_path_factory):
    """The bytes of a 2-step run's checkpoint (mirrored, so that it has every kind of random state)."""
    ckpt = tmp_path_factory.mktemp("crafted") / "ckpt"
    _run(train, "--steps", 2, "--strategy", "mirrored", "--checkpoint-dir", ckpt)
    return (ckpt / "last.pt").read_bytes()


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_train_resume_of_a_crafted_self_consistent_checkpoint_is_one_error_line(train, tmp_path, capsys,
                                                                               finished_checkpoint, case):
    change, words = CRAFTED[case]
    path = tmp_path / "last.pt"
    path.write_bytes(finished_checkpoint)
    _craft(str(path), change)
    train.dtape.checkpoint.read(path)   # the file itself is well-formed: only its contents are wrong
    capsys.readouterr()
    line = _usage_error(train, capsys, "--steps", 4, "--strategy", "mirrored", "--checkpoint-dir", tmp_path,
                        "--resume")
    assert str(path) in line and words in line, line


def test_train_resume_of_replica_states_that_do_not_fit_warns_and_continues(train, tmp_path, capsys,
                                                                            finished_checkpoint):
    """Replica generator states that do not fit (as if saved on other devices) are skipped with one warning line,
    as documented; the run continues (not bit-identically)."""
    path = tmp_path / "last.pt"
    path.write_bytes(finished_checkpoint)
    _craft(str(path), lambda t, s, d: d.update(replica_rng=[_torch().zeros(3, dtype=_torch().uint8)] * 2))
    capsys.readouterr()
    metrics = _run(train, "--steps", 4, "--strategy", "mirrored", "--checkpoint-dir", tmp_path, "--resume")
    err = capsys.readouterr().err.splitlines()
    assert [ln for ln in err if "random state not restored for replica generators" in ln] and \
        len(metrics["loss"]) == 4, err


@pytest.mark.parametrize("task, strategy", [("digits", "one_device"), ("digits", "mirrored"), ("charlm", "one_device")])
def test_train_jit_compile_gives_the_eager_losses_and_reports_the_compile_time(train, task, strategy, capsys):
    """--jit-compile traces the step (backend none: the traced graph, not compiled, to keep the test fast)."""
    args = ["--task", task, "--strategy", strategy, "--steps", 4, "--batch-size", 16, "--optimizer", "adam"]
    eager = _run(train, *args)
    capsys.readouterr()
    compiled = _run(train, *args, "--jit-compile", "--jit-backend", "none")
    np.testing.assert_allclose(compiled["loss"], eager["loss"], rtol=1e-5)
    session = compiled["sessions"][-1]
    assert session["jit_compile"] and session["traces"] == 1 and session["jit_backend"] == "none"
    assert 0 < session["trace_seconds"] <= session["compile_seconds"] and session["step_seconds"] > 0
    assert "compiled step (none): first step " in capsys.readouterr().out
    assert not eager["sessions"][-1]["jit_compile"] and "compile_seconds" not in eager["sessions"][-1]
