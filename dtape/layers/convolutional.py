"""Convolution layers over channels-last inputs. Source: tf.keras.layers (keras/layers/convolutional)."""
from dtape import nn as _nn
from dtape import regularizers as _regularizers
from dtape.layers.base import Layer, get_activation, last_dim, pair, pool_out


class Conv2D(Layer):
    """2-D convolution over NHWC images: `activation(conv2d(x, kernel) + bias)`.

    Args:
      filters: number of output channels.
      kernel_size: int or (h, w).
      strides: int or (sh, sw).
      padding: "valid" or "same" (TF semantics).
      activation, use_bias, kernel_initializer, name, dtype, seed: as `Dense`.
      input_channels: when given, the variables are created now.
      kernel_regularizer, bias_regularizer, activity_regularizer, input_shape: as `Dense`.

    Variables: `kernel` [kh, kw, in, filters], `bias` [filters].
    Shapes: x [batch, h, w, in] -> [batch, h', w', filters].
    Source: tf.keras.layers.Conv2D.
    """

    def __init__(self, filters, kernel_size, strides=1, padding="valid", activation=None, use_bias=True,
                 kernel_initializer="glorot_uniform", input_channels=None, name=None, dtype=None,
                 seed=None, kernel_regularizer=None, bias_regularizer=None, activity_regularizer=None,
                 input_shape=None):
        super().__init__(name=name, dtype=dtype, seed=seed, input_shape=input_shape,
                         activity_regularizer=activity_regularizer)
        self.kernel_regularizer = _regularizers.get(kernel_regularizer)
        self.bias_regularizer = _regularizers.get(bias_regularizer)
        self.filters = int(filters)
        self.kernel_size = pair(kernel_size, "kernel_size")
        self.strides = pair(strides, "strides")
        if padding.lower() not in ("valid", "same"):
            raise ValueError(f"Conv2D padding must be 'valid' or 'same', got {padding!r}")
        self.padding = padding.upper()
        self.activation = get_activation(activation)
        self.use_bias = bool(use_bias)
        self.kernel_initializer = kernel_initializer
        if input_channels is not None:
            self._maybe_build((None, None, None, int(input_channels)))

    def build(self, input_shape):
        if len(input_shape) != 4:
            raise ValueError(f"{self.name}: Conv2D expects NHWC input [batch, h, w, c], got {tuple(input_shape)}")
        shape = self.kernel_size + (last_dim(input_shape, self), self.filters)
        self.kernel = self.add_weight("kernel", shape, self.kernel_initializer, regularizer=self.kernel_regularizer)
        if self.use_bias:
            self.bias = self.add_weight("bias", (self.filters,), "zeros", regularizer=self.bias_regularizer)

    def compute_output_shape(self, input_shape):
        hw = [pool_out(d, k, s, self.padding) for d, k, s in zip(input_shape[1:3], self.kernel_size, self.strides)]
        return (input_shape[0], *hw, self.filters)

    def call(self, x):
        y = _nn.conv2d(x, self.kernel, strides=[1, *self.strides, 1], padding=self.padding)
        if self.use_bias:
            y = y + self.bias
        return self.activation(y)
