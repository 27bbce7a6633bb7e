"""Dtype policies: the dtype a layer's variables are stored in and the dtype it computes in.

Kept below the layers (which read the global policy when they are made);
the public names are `dtape.mixed_precision.Policy`, `set_global_policy`
and `global_policy`.
Source: tf.keras.mixed_precision.Policy, set_global_policy, global_policy.
"""
import threading

import torch

from dtape.tensor import as_dtype

_MIXED = {"mixed_float16": torch.float16, "mixed_bfloat16": torch.bfloat16}
_HALF = (torch.float16, torch.bfloat16)


class Policy:
    """A layer's dtypes: `variable_dtype` (its variables) and `compute_dtype` (its inputs and outputs).

    Args:
      name: "mixed_float16" / "mixed_bfloat16" (variables float32, computation
        in float16 / bfloat16), or a floating dtype name ("float32",
        "float16", "bfloat16", "float64") or torch floating dtype, which is
        both dtypes.

    Attributes (torch dtypes, as every dtype in dtape):
      name, compute_dtype, variable_dtype.

    Raises:
      ValueError: an unknown name or a dtype that is not floating.

    Source: tf.keras.mixed_precision.Policy.
    """

    __slots__ = ("_name", "_compute", "_variable")

    def __init__(self, name):
        if isinstance(name, str) and name in _MIXED:
            self._name, self._compute, self._variable = name, _MIXED[name], torch.float32
            return
        try:
            dtype = as_dtype(name)
        except (TypeError, ValueError):
            dtype = None
        if dtype is None or not dtype.is_floating_point:
            raise ValueError(f"Cannot convert value {name!r} to a mixed precision Policy: use 'mixed_float16', "
                             "'mixed_bfloat16' or a floating dtype ('float32', 'float16', 'bfloat16', 'float64', "
                             "or a torch floating dtype)")
        self._name, self._compute, self._variable = str(dtype).removeprefix("torch."), dtype, dtype

    @property
    def name(self):
        return self._name

    @property
    def compute_dtype(self):
        """The dtype of the layer's computation: floating inputs are cast to it and variables read in it."""
        return self._compute

    @property
    def variable_dtype(self):
        """The dtype the layer's variables are created in."""
        return self._variable

    @property
    def is_mixed(self):
        """Whether variables and computation differ in dtype (variables are then read in `compute_dtype`)."""
        return self._compute != self._variable

    def casts_input(self, dtype):
        """Whether a floating input of `dtype` is cast to `compute_dtype`: the two differ and one is 16-bit."""
        return dtype.is_floating_point and dtype != self._compute and (dtype in _HALF or self._compute in _HALF)

    def __eq__(self, other):
        return isinstance(other, Policy) and other.name == self.name

    def __hash__(self):
        return hash(self._name)

    def __repr__(self):
        return f'<Policy "{self._name}">'


_lock = threading.Lock()
_global = [Policy("float32")]  # process-wide, as Keras's global policy


def set_global_policy(policy):
    """Sets the policy of the layers made from now on without an explicit `dtype` (process-wide).

    Args:
      policy: a Policy, a policy name ("mixed_float16", "mixed_bfloat16",
        "float32", ...) or None (back to "float32").

    Raises:
      ValueError: as `Policy`.

    Source: tf.keras.mixed_precision.set_global_policy.
    """
    new = Policy("float32") if policy is None else get(policy)
    with _lock:
        _global[0] = new


def global_policy():
    """The global Policy ("float32" unless `set_global_policy` changed it). Source: tf.keras.mixed_precision."""
    return _global[0]


def get(dtype):
    """The Policy for a layer's `dtype=` argument: None gives the global policy; a Policy is itself."""
    if dtype is None:
        return global_policy()
    if isinstance(dtype, Policy):
        return dtype
    return Policy(dtype)
