"""Activation layers: Activation, ReLU, LeakyReLU, Softmax. Source: tf.keras.layers (keras/layers/activations)."""
from dtape import nn as _nn
from dtape.ops import array_ops as _array
from dtape.ops import math_ops as _math
from dtape.layers.base import Layer, get_activation


class Activation(Layer):
    """Applies an activation elementwise (softmax on the last axis); no variables.

    Args:
      activation: a name (`"relu"`, `"softmax"`, `"linear"`, ... as `get_activation`) or a callable.
      dtype: its policy; `dtype="float32"` after half-precision layers casts their output to float32
        before the activation (the mixed-precision guide's float32 softmax output).

    Shapes: any -> the same shape; dtype: the layer's compute dtype (floating inputs are cast to it).
    Raises:
      ValueError: an unknown activation name.
    Source: tf.keras.layers.Activation.
    """

    supports_masking = True

    def __init__(self, activation, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        self.activation = get_activation(activation)

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        return self.activation(x)


class ReLU(Layer):
    """Rectified linear unit with Keras's options; no variables.

    f(x) = max_value for x >= max_value, x for threshold <= x < max_value,
    negative_slope * (x - threshold) otherwise.

    Args:
      max_value: None (no upper bound) or a float >= 0.
      negative_slope: float >= 0, the slope below the threshold (default 0).
      threshold: float, where the unit turns on (default 0).
      name, dtype: see `Layer`.

    Shapes: any -> the same shape and dtype. Masks pass through.
    Raises:
      ValueError: a negative max_value or negative_slope.
    Source: tf.keras.layers.ReLU.
    """

    supports_masking = True

    def __init__(self, max_value=None, negative_slope=0.0, threshold=0.0, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        if (max_value is not None and float(max_value) < 0) or float(negative_slope) < 0:
            raise ValueError(f"ReLU needs max_value >= 0 (or None) and negative_slope >= 0, got "
                             f"max_value={max_value}, negative_slope={negative_slope}")
        self.max_value = None if max_value is None else float(max_value)
        self.negative_slope, self.threshold = float(negative_slope), float(threshold)

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        if self.negative_slope == 0.0 and self.threshold == 0.0:
            y = _nn.relu(x)
        else:
            below = (x - self.threshold) * self.negative_slope
            y = _array.where(_math.greater_equal(x, self.threshold), x, below)
        return y if self.max_value is None else _math.minimum(y, self.max_value)


class LeakyReLU(Layer):
    """x for x >= 0, negative_slope * x otherwise; no variables.

    Args:
      negative_slope: float >= 0 (default 0.3, as Keras). `alpha=` (Keras 2's
        name, used by TF 2 tutorials) is accepted too.
      name, dtype: see `Layer`.

    Shapes: any -> the same shape and dtype. Masks pass through.
    Raises:
      ValueError: a negative slope, or both names given.
    Source: tf.keras.layers.LeakyReLU.
    """

    supports_masking = True

    def __init__(self, negative_slope=0.3, alpha=None, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        if alpha is not None:
            if negative_slope != 0.3:
                raise ValueError("LeakyReLU: give negative_slope= or alpha= (its Keras 2 name), not both")
            negative_slope = alpha
        if float(negative_slope) < 0:
            raise ValueError(f"LeakyReLU negative_slope must be >= 0, got {negative_slope}")
        self.negative_slope = float(negative_slope)

    @property
    def alpha(self):
        return self.negative_slope

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        return _nn.leaky_relu(x, alpha=self.negative_slope)


class Softmax(Layer):
    """exp(x) / sum(exp(x), axis), the softmax over `axis`; no variables.

    Args:
      axis: int (default -1, the last axis).
      name, dtype: see `Layer`.

    Shapes: any floating [..] -> the same shape and dtype.
    Gradient: softmax's (`dtape.nn.softmax`).
    Raises:
      ValueError: an axis outside the input's rank (at call).
    Source: tf.keras.layers.Softmax.
    """

    def __init__(self, axis=-1, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise ValueError(f"Softmax axis must be an int, got {axis!r}")
        self.axis = axis

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        return _nn.softmax(x, axis=self.axis)
