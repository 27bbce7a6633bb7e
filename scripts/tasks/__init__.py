"""Training tasks for scripts/train.py: each module exposes the same small interface.

A task module has:
  DEFAULTS: dict of default command-line values (epochs, batch_size, lr, optimizer, dropout),
    kept in this file's DEFAULTS[name] so that train.py checks its arguments without
    importing a task (or torch).
  model_config(dropout) -> dict of the model's architecture settings (plain data), stored in
    checkpoints so that --resume refuses a checkpoint of another model, naming the setting.
  load_data(seed) -> dict with numpy arrays "x_train", "y_train", "x_test", "y_test".
  build_model(seed, dropout=0.0) -> a dtape.Module, callable on a batch of inputs as
    model(x, training=False) (variables created now; `dropout` is the rate of its
    layers.Dropout layers, which draw from the current replica's generator).
  per_example_loss(model, x, y) -> dtape.Tensor [batch] of training losses (dropout active).
  accuracy(model, x, y) -> float in [0, 1] (dropout off).
"""
import importlib

TASKS = ("digits", "charlm")
DEFAULTS = {
    "digits": {"epochs": 20, "batch_size": 64, "lr": 0.1, "optimizer": "sgd", "dropout": 0.0},
    "charlm": {"epochs": 3, "batch_size": 32, "lr": 3e-3, "optimizer": "adam", "dropout": 0.0},
}


def get_task(name):
    """The task module called `name`.

    Raises:
      ValueError: an unknown task (the message lists the known ones).
      NotImplementedError: a known task that has no implementation yet.
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {list(TASKS)}")
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise NotImplementedError(f"task {name!r} is not implemented yet; use --task digits") from None
