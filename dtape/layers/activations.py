"""Activation layers. Source: tf.keras.layers (keras/layers/activations)."""
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

    def __init__(self, activation, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        self.activation = get_activation(activation)

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        return self.activation(x)
