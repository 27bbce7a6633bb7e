"""Checkpoints: save/restore variables, modules and optimizers to one file, atomically.

The file is a `torch.save` of a dict `{key: torch.Tensor}` plus plain data:
a variable passed as `name` is stored under `name`; a module's or an
optimizer's variables under `name/0`, `name/1`, ... in their stable order.
Objects are recognised by duck typing: a variable has `_dtape_read` and
`_handle`; a distributed variable also has a `.values` tuple of components
(the primary, `values[0]`, is saved; restore assigns every component); a
container has a `variables()` method or a `.variables` attribute.

Source: tf.train.Checkpoint (save / restore), by key instead of object graph.
"""
import os
import tempfile

import torch

from dtape import tape as _tp
from dtape.module import is_variable

__all__ = ["save", "restore", "read"]

_FORMAT = "dtape.checkpoint/1"
_DATA_PREFIX = "__data__/"


def _variables_of(obj):
    """The variables of a module/optimizer, or None when `obj` has none to offer."""
    found = getattr(obj, "variables", None)
    if found is None:
        return None
    if callable(found):
        found = found()
    return list(found)


def _named_variables(name, obj):
    """[(key, variable)] for one keyword argument of save/restore, or None for plain data."""
    if is_variable(obj):
        return [(name, obj)]
    found = _variables_of(obj)
    if found is None:
        return None
    return [(f"{name}/{i}", v) for i, v in enumerate(found)]


def _primary_value(var):
    """The value of `var` (its primary component when distributed) as a detached CPU tensor."""
    components = getattr(var, "values", None)
    if isinstance(components, tuple) and components:
        var = components[0]
    with _tp.stop_recording():
        value = var._dtape_read().torch()
    return value.detach().to("cpu", copy=True)


def _check_name(name):
    if "/" in name or name.startswith("__"):
        raise ValueError(f"checkpoint object name {name!r} may not contain '/' or start with '__'")


def save(path, **objects):
    """Saves `objects` to the file `path`, atomically (a reader never sees a partial file).

    Args:
      path: file path; its folder must exist.
      **objects: name -> variable, module, optimizer (anything with a
        `variables()` method or `.variables` attribute), or plain data
        (ints, floats, strings, tensors, lists/dicts of them) returned by
        `restore` / `read`.

    Call it in the cross-replica context (outside `strategy.run`).

    Example:
      >>> dtape.checkpoint.save("/tmp/ckpt.pt", model=model, optimizer=opt, step=10)
    """
    state = {"__format__": _FORMAT, "__names__": {}, "__objects__": {}}
    for name, obj in objects.items():
        _check_name(name)
        pairs = _named_variables(name, obj)
        if pairs is None:
            state[_DATA_PREFIX + name] = obj
            continue
        state["__objects__"][name] = [key for key, _ in pairs]
        for key, var in pairs:
            state[key] = _primary_value(var)
            state["__names__"][key] = getattr(var, "name", key)
    _atomic_torch_save(state, path)


def _atomic_torch_save(state, path):
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def read(path):
    """Loads the checkpoint at `path` without restoring anything.

    Returns:
      dict: each variable's value under its key (`name` or `name/i`), and the
      plain data under its own name.
    """
    state = _load(path)
    out = {k: v for k, v in state.items() if not k.startswith("__")}
    out.update(_data_of(state))
    return out


def _load(path):
    state = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or state.get("__format__") != _FORMAT:
        raise ValueError(f"{path} is not a dtape checkpoint (expected format {_FORMAT!r})")
    return state


def _data_of(state):
    n = len(_DATA_PREFIX)
    return {k[n:]: v for k, v in state.items() if k.startswith(_DATA_PREFIX)}


def restore(path, **objects):
    """Restores the variables of `objects` from `path`, all or nothing.

    Args:
      path: a file written by `save`.
      **objects: name -> variable, module or optimizer, as given to `save`.
        An optimizer must already have its slot variables (restore after it
        has been built or applied once).

    Returns:
      dict of the plain data stored in the file (name -> value).

    Raises:
      ValueError: a name is missing from the file, a module/optimizer has a
        different number of variables, or a shape differs; nothing is
        assigned then.

    Call it in the cross-replica context (outside `strategy.run`).
    """
    state = _load(path)
    plan = []
    for name, obj in objects.items():
        _check_name(name)
        pairs = _named_variables(name, obj)
        if pairs is None:
            raise TypeError(f"restore: {name!r} is a {type(obj).__name__}, not a variable, module or optimizer; "
                            f"plain data comes back in restore()'s return value")
        plan += _plan_restore(path, name, pairs, state)
    for var, value in plan:
        _assign_all(var, value)
    return _data_of(state)


def _plan_restore(path, name, pairs, state):
    stored = state["__objects__"].get(name)
    if stored is None:
        raise ValueError(f"restore: no {name!r} in checkpoint {path}; it holds variables for "
                         f"{sorted(state['__objects__'])} and data {sorted(_data_of(state))}")
    if [k for k, _ in pairs] != stored:
        raise ValueError(f"restore: {name!r} has {len(pairs)} variables but checkpoint {path} holds {len(stored)} "
                         f"for it (an optimizer creates its slots on first use: build or apply it before restore)")
    plan = []
    for key, var in pairs:
        value = state[key]
        if tuple(value.shape) != tuple(var.shape):
            raise ValueError(f"restore: shape mismatch for {key} ({getattr(var, 'name', key)}): checkpoint has "
                             f"{tuple(value.shape)}, variable has {tuple(var.shape)}")
        plan.append((var, value))
    return plan


def _assign_all(var, value):
    components = getattr(var, "values", None)
    targets = components if isinstance(components, tuple) and components else (var,)
    for component in targets:
        component.assign(value)
