"""Reshaping layers: Flatten, Reshape. Source: tf.keras.layers (keras/layers/reshaping)."""
import math

from dtape.ops import array_ops as _array
from dtape.layers.base import Layer, channels_last


class Flatten(Layer):
    """Flattens all but the batch axis: [batch, d1, d2, ...] -> [batch, d1 * d2 * ...] ([batch] -> [batch, 1]).

    Source: tf.keras.layers.Flatten.
    """

    def __init__(self, data_format=None, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        channels_last(data_format, "Flatten")

    def compute_output_shape(self, input_shape):
        rest = input_shape[1:]
        return (input_shape[0], None if None in rest else math.prod(rest))

    def call(self, x):
        if x.ndim == 0:
            raise ValueError(f"{self.name}: Flatten needs a batch axis, got a scalar")
        return _array.reshape(x, (x.shape[0], math.prod(x.shape[1:])))


class Reshape(Layer):
    """Reshapes all but the batch axis to `target_shape` (one entry may be -1).

    Args:
      target_shape: tuple of ints, without the batch dimension.

    Shapes: [batch, ...] -> [batch, *target_shape].
    Raises:
      ValueError: a target_shape with more than one -1, or one that does not fit the input.
    Source: tf.keras.layers.Reshape.
    """

    def __init__(self, target_shape, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        self.target_shape = tuple(int(d) for d in target_shape)
        if sum(d == -1 for d in self.target_shape) > 1 or any(d < -1 or d == 0 for d in self.target_shape):
            raise ValueError(f"Reshape target_shape must have positive sizes and at most one -1, "
                             f"got {self.target_shape}")

    def _resolved(self, input_shape):
        rest = input_shape[1:]
        if None in rest:
            return tuple(None if d == -1 else d for d in self.target_shape)
        n, known = math.prod(rest), math.prod(d for d in self.target_shape if d != -1)
        if -1 in self.target_shape:
            if n % known:
                raise ValueError(f"{self.name}: cannot reshape {tuple(rest)} ({n} values) to {self.target_shape}")
            return tuple(n // known if d == -1 else d for d in self.target_shape)
        if n != known:
            raise ValueError(f"{self.name}: cannot reshape {tuple(rest)} ({n} values) to {self.target_shape} "
                             f"({known} values)")
        return self.target_shape

    def compute_output_shape(self, input_shape):
        return (input_shape[0],) + self._resolved(tuple(input_shape))

    def call(self, x):
        return _array.reshape(x, (x.shape[0],) + self._resolved(tuple(x.shape)))


# -- batch normalization -------------------------------------------------------------
