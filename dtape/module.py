"""Module: a named container that finds the variables held by its attributes.

Source: tf.Module. Variables are recognised by `dtape.tensor.is_variable`,
so the distributed variables of `dtape.distribute` count without this module
importing it.
"""
import itertools
import re
import threading

from dtape.tensor import is_variable

__all__ = ["Module", "is_variable"]

_name_lock = threading.Lock()  # guards _name_counts (process-wide; modules may be built on replica threads)
_name_counts = {}  # process-wide: base name -> itertools.count, for unique default names


def _snake_case(name):
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def unique_name(base):
    """`base`, then `base_1`, `base_2`, ... across the process."""
    with _name_lock:
        counter = _name_counts.setdefault(base, itertools.count())
        n = next(counter)
    return base if n == 0 else f"{base}_{n}"


def _children(value):
    """The values directly inside a container, in a stable order (insertion order for dicts)."""
    if isinstance(value, Module):
        return list(vars(value).values())
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, (list, tuple)):
        return list(value)
    return []


def _walk(module):
    """Yields (kind, object) for every variable and sub-module below `module`, depth-first.

    Attribute insertion order, each object once; cycles are cut.
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
            stack.append(iter(_children(value)))


_DONE = object()


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
        """The variables with `trainable=True`, as a tuple in discovery order."""
        return tuple(v for v in self.variables if getattr(v, "trainable", True))

    @property
    def non_trainable_variables(self):
        """The variables with `trainable=False`, as a tuple in discovery order."""
        return tuple(v for v in self.variables if not getattr(v, "trainable", True))

    @property
    def submodules(self):
        """Every module below this one (not itself), depth-first, as a tuple."""
        return tuple(obj for kind, obj in _walk(self) if kind == "module")

    def __repr__(self):
        return f"<{type(self).__module__}.{type(self).__name__} '{self.name}'>"
