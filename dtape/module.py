"""Module: a named container that finds the variables held by its attributes.

Source: tf.Module. Variables are recognised by `dtape.tensor.is_variable`,
so the distributed variables of `dtape.distribute` count without this module
importing it.
"""
import itertools
import math
import re
import threading
import weakref

from dtape.tensor import is_variable

__all__ = ["Module", "is_variable"]

_name_lock = threading.Lock()  # guards _name_counts (process-wide; modules may be built on replica threads)
_name_counts = {}  # process-wide: base name -> itertools.count, for unique default names


def _snake_case(name):
    """"Dense" -> "dense", "Conv2D" -> "conv2_d" (kept: checkpoints store these names)."""
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def unique_name(base):
    """`base`, then `base_1`, `base_2`, ... across the process."""
    with _name_lock:
        counter = _name_counts.setdefault(base, itertools.count())
        n = next(counter)
    return base if n == 0 else f"{base}_{n}"


def is_unique_name_base(base):
    """True once `unique_name(base)` has run in this process: `base`, `base_1`, ... may be default names."""
    with _name_lock:
        return base in _name_counts


_VARIABLE_DEFAULT = re.compile(r"Variable_\d+")
_NUMBERED = re.compile(r"(.+)_(\d+)")


def default_name_part(part):
    """(base, n) when a name component looks like a default name (`Variable_<n>`, or a module's `base` /
    `base_<n>` from `unique_name`), else None (a user-chosen name). Default numbers depend on what else the
    process created, so checkpoints and optimizer state compare such components by rank or not at all."""
    if _VARIABLE_DEFAULT.fullmatch(part):
        return "Variable", int(part[len("Variable_"):])
    if is_unique_name_base(part):
        return part, 0
    numbered = _NUMBERED.fullmatch(part)
    if numbered and is_unique_name_base(numbered.group(1)):
        return numbered.group(1), int(numbered.group(2))
    return None


def _children(value):
    """The values directly inside a container, in a stable order (insertion order for dicts)."""
    if isinstance(value, Module):
        return list(vars(value).values())
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, (list, tuple)):
        return list(value)
    return []


def _walk(module, into_modules=True):
    """Yields (kind, object) for every variable and sub-module below `module`, depth-first.

    Attribute insertion order, each object once; cycles are cut. With
    `into_modules=False` the walk does not descend into the modules it finds.
    """
    seen = {id(module)}
    stack = [iter(_children(module))]
    while stack:
        value = next(stack[-1], _DONE)
        if value is _DONE:
            stack.pop()
            continue
        if id(value) in seen:
            continue
        if is_variable(value):
            seen.add(id(value))
            yield "variable", value
        elif isinstance(value, (Module, dict, list, tuple)):
            seen.add(id(value))
            if isinstance(value, Module):
                yield "module", value
                if not into_modules:
                    continue
            stack.append(iter(_children(value)))


_DONE = object()


def _refresh_trainable(module):
    """Lets a module whose variables' trainability follows state elsewhere (a TorchModule: its torch
    parameters' `requires_grad`) update it before its variables are sorted into trainable or not."""
    refresh = getattr(type(module), "_refresh_trainable", None)
    if refresh is not None:
        refresh(module)


class _LossState(threading.local):
    """Per-thread: module -> the losses `add_loss` gave it on this thread (replica threads keep their own)."""

    def __init__(self):
        self.by_module = weakref.WeakKeyDictionary()


_loss_state = _LossState()


def _direct_children(module):
    """The modules directly held by `module` (through attributes, lists, tuples, dicts), in order."""
    return [obj for kind, obj in _walk(module, into_modules=False) if kind == "module"]


class Module:
    """A named container of variables and other modules.

    Variables are found through attributes, lists, tuples, dicts and
    sub-modules, depth-first in attribute insertion order (dict values in
    insertion order), each variable once.

    Args:
      name: the module's name; default is the snake-cased class name, made
        unique in the process (`dense`, `dense_1`, ...).

    Source: tf.Module.

    Example:
      >>> class Affine(dtape.Module):
      ...     def __init__(self):
      ...         super().__init__()
      ...         self.w = dtape.Variable([[1.0], [2.0]])
      ...         self.b = dtape.Variable([0.0], trainable=False)
      >>> m = Affine()
      >>> [v.shape for v in m.trainable_variables]
      [torch.Size([2, 1])]
    """

    def __init__(self, name=None):
        if name is not None and not isinstance(name, str):
            raise TypeError(f"Module name must be a str, got {type(name).__name__}")
        self._name = name or unique_name(_snake_case(type(self).__name__))

    @property
    def name(self):
        """The module's name (str)."""
        if "_name" not in vars(self):
            self._name = unique_name(_snake_case(type(self).__name__))
        return self._name

    @property
    def variables(self):
        """Every variable reachable from this module, as a tuple in discovery order."""
        return tuple(obj for kind, obj in _walk(self) if kind == "variable")

    @property
    def trainable_variables(self):
        """The variables with `trainable=True` not held by a frozen module (a Keras layer with
        `trainable = False`, this one or one below), as a tuple in discovery order."""
        variables, frozen = self._variables_and_frozen()
        return tuple(v for v in variables if getattr(v, "trainable", True) and id(v) not in frozen)

    @property
    def non_trainable_variables(self):
        """The other variables (`trainable=False`, or held by a frozen module), as a tuple in discovery order."""
        variables, frozen = self._variables_and_frozen()
        return tuple(v for v in variables if not getattr(v, "trainable", True) or id(v) in frozen)

    def _variables_and_frozen(self):
        """(every variable, the ids of those held by this module or a sub-module whose `trainable` is False):
        Keras's frozen layers, whose weights `layer.trainable = False` takes out of `trainable_weights` so fit
        leaves them. One walk; only frozen modules (rare) walk their own variables again."""
        variables, frozen_modules = [], [self] if getattr(self, "trainable", True) is False else []
        _refresh_trainable(self)
        for kind, obj in _walk(self):
            if kind == "variable":
                variables.append(obj)
            else:
                _refresh_trainable(obj)
                if getattr(obj, "trainable", True) is False:
                    frozen_modules.append(obj)
        return variables, {id(v) for m in frozen_modules for v in m.variables}

    @property
    def submodules(self):
        """Every module below this one (not itself), depth-first, as a tuple."""
        return tuple(obj for kind, obj in _walk(self) if kind == "module")

    # -- Keras names ----------------------------------------------------------
    @property
    def trainable_weights(self):
        """Keras name of `trainable_variables`. Source: tf.keras.layers.Layer.trainable_weights."""
        return list(self.trainable_variables)

    @property
    def non_trainable_weights(self):
        """Keras name of `non_trainable_variables`."""
        return list(self.non_trainable_variables)

    @property
    def weights(self):
        """Keras name of `variables`."""
        return list(self.variables)

    # -- losses ------------------------------------------------------------------
    def add_loss(self, loss):
        """Adds a loss (a scalar Tensor, e.g. an activity penalty) to `losses`, on this thread only.

        Losses added during a call are cleared when the next top-level call
        of a layer starts on the same thread. Under a strategy each replica
        thread sees only its own. Source: tf.keras.layers.Layer.add_loss.
        """
        _loss_state.by_module.setdefault(self, []).append(loss)

    def _clear_losses(self):
        """Forgets the losses added on this thread to this module and every sub-module."""
        if not _loss_state.by_module:  # nothing added on this thread: no walk over the sub-modules
            return
        for m in (self,) + self.submodules:
            _loss_state.by_module.pop(m, None)

    def _own_losses(self):
        added = list(_loss_state.by_module.get(self, ()))
        return added + [reg(var) for var, reg in vars(self).get("_regularized", ())]

    @property
    def losses(self):
        """The losses of this module and its sub-modules: those added by `add_loss` on this thread
        (activity regularizers) during the last call, then the weight penalties (`kernel_regularizer`, ...)
        computed now from the current values (so differentiable under a tape).

        Returns a list of scalar Tensors (empty when there are none). Sum them
        into the loss; under a strategy scale the sum with
        `dtape.nn.scale_regularization_loss`. Source: tf.keras.layers.Layer.losses.
        """
        out = []
        for m in (self,) + self.submodules:
            out.extend(m._own_losses())
        return out

    # -- summary ---------------------------------------------------------------
    def summary(self, print_fn=None, line_length=80):
        """Prints (and returns) a table of the direct sub-modules: name (type), output shape, parameters.

        Output shapes are those of the last call or build (`?` before any).
        Parameters count every element of the variables (a distributed
        variable once). Totals: all, trainable and non-trainable.

        Args:
          print_fn: called with the table (default `print`); pass
            `lambda s: None` to only get the string.
          line_length: width of the table (widened to fit long names and shapes).

        Returns:
          The table as a str. Source: tf.keras.Model.summary.
        """
        rows = self._summary_rows()
        w1 = max([int(line_length * 0.45), 20] + [len(label) + 2 for label, _, _ in rows])
        w2 = max([int(line_length * 0.3), 16] + [len(shape) + 2 for _, shape, _ in rows])
        w3 = max(line_length - w1 - w2, 10)
        line_length = w1 + w2 + w3
        rule, bold = "_" * line_length, "=" * line_length
        lines = [f'Model: "{self.name}"', rule, f"{'Layer (type)':<{w1}}{'Output Shape':<{w2}}{'Param #':>{w3}}", bold]
        for i, (label, shape, count) in enumerate(rows):
            lines.append(f"{label:<{w1}}{shape:<{w2}}{count:>{w3},}")
            lines.append(rule if i < len(rows) - 1 else bold)
        if not rows:
            lines.append(bold)
        trainable = _count(self.trainable_variables)
        total = _count(self.variables)
        lines += [f"Total params: {total:,}", f"Trainable params: {trainable:,}",
                  f"Non-trainable params: {total - trainable:,}", rule]
        text = "\n".join(lines)
        (print if print_fn is None else print_fn)(text)
        return text

    def _summary_rows(self):
        children = getattr(self, "layers", None)
        children = [c for c in children if isinstance(c, Module)] if isinstance(children, list) \
            else _direct_children(self)
        return [(f"{c.name} ({type(c).__name__})", _shape_str(getattr(c, "_output_shape", None)),
                 _count(c.variables)) for c in children]

    def __repr__(self):
        return f"<{type(self).__module__}.{type(self).__name__} '{self.name}'>"


def _count(variables):
    return sum(math.prod(tuple(v.shape)) for v in variables)


def _shape_str(shape):
    if shape is None:
        return "?"
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"
