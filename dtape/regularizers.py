"""Weight regularizers: L1, L2, L1L2 (Keras formulas).

A regularizer is a callable `reg(x) -> scalar Tensor`; layers take them as
`kernel_regularizer=`, `bias_regularizer=`, `activity_regularizer=` and
report the penalties in `Module.losses`. Source: tf.keras.regularizers.
"""
from dtape.ops import math_ops as _math
from dtape.tensor import convert_to_tensor, is_variable

__all__ = ["Regularizer", "L1", "L2", "L1L2", "l1", "l2", "l1_l2", "get"]


def _factor(value, what):
    value = float(value)
    if not value >= 0.0 or value == float("inf"):
        raise ValueError(f"{what} must be a finite float >= 0, got {value!r}")
    return value


class Regularizer:
    """Base class: `__call__(x)` returns a scalar penalty Tensor (differentiable in x)."""

    def __call__(self, x):
        raise NotImplementedError(f"{type(self).__name__} must define __call__(x)")

    def get_config(self):
        return {}


class L1L2(Regularizer):
    """`l1 * sum(abs(x)) + l2 * sum(square(x))`.

    Args:
      l1, l2: finite floats >= 0 (default 0.0, as Keras).

    Shapes: x any floating tensor -> scalar of x's dtype, on x's device.
    Source: tf.keras.regularizers.L1L2.
    """

    def __init__(self, l1=0.0, l2=0.0):
        self.l1 = _factor(l1, "l1")
        self.l2 = _factor(l2, "l2")

    def __call__(self, x):
        x = x if is_variable(x) else convert_to_tensor(x)
        total = None
        if self.l1:
            total = self.l1 * _math.reduce_sum(_math.abs(x))
        if self.l2:
            term = self.l2 * _math.reduce_sum(_math.square(x))
            total = term if total is None else total + term
        return total if total is not None else _math.reduce_sum(x) * 0.0

    def get_config(self):
        return {"l1": self.l1, "l2": self.l2}

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{k}={v}' for k, v in self.get_config().items())})"


class L1(L1L2):
    """`l1 * sum(abs(x))`, l1 default 0.01. Source: tf.keras.regularizers.L1."""

    def __init__(self, l1=0.01):
        super().__init__(l1=l1)

    def get_config(self):
        return {"l1": self.l1}


class L2(L1L2):
    """`l2 * sum(square(x))` (no 1/2), l2 default 0.01. Source: tf.keras.regularizers.L2."""

    def __init__(self, l2=0.01):
        super().__init__(l2=l2)

    def get_config(self):
        return {"l2": self.l2}


l1, l2, l1_l2 = L1, L2, L1L2

_NAMES = {"l1": L1, "l2": L2, "l1_l2": L1L2, "l1l2": L1L2}


def get(identifier):
    """A regularizer from None, a name ("l1", "l2", "l1_l2"), or a callable (returned as is).

    Raises:
      ValueError: an unknown name or a non-callable object.
    """
    if identifier is None or callable(identifier):
        return identifier
    if isinstance(identifier, str) and identifier.lower() in _NAMES:
        return _NAMES[identifier.lower()]()
    raise ValueError(f"unknown regularizer {identifier!r}; use one of {sorted(_NAMES)}, a Regularizer or a callable")
