"""Core layers: Dense, Masking, Lambda, Rescaling. Source: tf.keras.layers (keras/layers/core)."""
from dtape import nn as _nn
from dtape import regularizers as _regularizers
from dtape.ops import array_ops as _array
from dtape.ops import math_ops as _math
from dtape.layers.base import Layer, get_activation, last_dim
from dtape.tensor import convert_to_tensor


class Dense(Layer):
    """Densely connected layer: `activation(x @ kernel + bias)`.

    Args:
      units: output size.
      activation: None, a name ("relu", "tanh", "softmax", ...) or a callable.
      use_bias: whether to add a bias.
      kernel_initializer, bias_initializer: names or callables.
      input_dim: input size; when given, the variables are created now.
      kernel_regularizer, bias_regularizer: None, "l1"/"l2" or a callable;
        their penalties are in `losses`.
      name, dtype, seed, input_shape, activity_regularizer: see `Layer`.

    Variables: `kernel` [in, units], `bias` [units].
    Shapes: x [..., in] -> [..., units] (floating dtypes).
    Source: tf.keras.layers.Dense.

    Example:
      >>> layer = dtape.layers.Dense(3, activation="relu", input_dim=2)
      >>> layer(dtape.ones([4, 2])).shape
      torch.Size([4, 3])
    """

    supports_masking = True  # elementwise along the steps: a mask passes through (Keras)

    def __init__(self, units, activation=None, use_bias=True, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", input_dim=None, name=None, dtype=None, seed=None,
                 kernel_regularizer=None, bias_regularizer=None, activity_regularizer=None, input_shape=None):
        super().__init__(name=name, dtype=dtype, seed=seed, input_shape=input_shape,
                         activity_regularizer=activity_regularizer)
        if int(units) <= 0:
            raise ValueError(f"Dense units must be a positive int, got {units!r}")
        self.units = int(units)
        self.activation = get_activation(activation)
        self.use_bias = bool(use_bias)
        self.kernel_initializer = kernel_initializer
        self.bias_initializer = bias_initializer
        self.kernel_regularizer = _regularizers.get(kernel_regularizer)
        self.bias_regularizer = _regularizers.get(bias_regularizer)
        if input_dim is not None:
            self._maybe_build((None, int(input_dim)))

    def build(self, input_shape):
        in_dim = last_dim(input_shape, self)
        self.kernel = self.add_weight("kernel", (in_dim, self.units), self.kernel_initializer,
                                      regularizer=self.kernel_regularizer)
        if self.use_bias:
            self.bias = self.add_weight("bias", (self.units,), self.bias_initializer, regularizer=self.bias_regularizer)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.units,)

    def call(self, x):
        if self.use_bias:  # folds leading dimensions itself: one record for any rank
            return self.activation(_nn.xw_plus_b(x, self.kernel, self.bias))
        lead = tuple(x.shape[:-1])
        if len(lead) != 1:
            x = _array.reshape(x, (-1, x.shape[-1]))
        y = _math.matmul(x, self.kernel)
        if len(lead) != 1:
            y = _array.reshape(y, lead + (self.units,))
        return self.activation(y)


class Masking(Layer):
    """Marks the steps whose features all equal `mask_value` as padding, and zeroes them.

    Input [batch, steps, features] (any rank >= 2: the last axis holds a step's features); output the input
    with masked steps set to 0; `compute_mask` gives the mask [batch, steps] (bool, True where a step is kept),
    which the layers after it receive (Keras's propagation; a compiled loss and metrics skip masked steps).
    Source: tf.keras.layers.Masking.
    """

    supports_masking = True

    def __init__(self, mask_value=0.0, name=None, dtype=None, input_shape=None):
        super().__init__(name=name, dtype=dtype, input_shape=input_shape)
        self.mask_value = mask_value

    def compute_mask(self, inputs, mask=None):
        differs = _array.cast(_math.not_equal(inputs, self.mask_value), inputs.dtype)
        return _math.greater(_math.reduce_max(differs, axis=-1), 0.0)

    def call(self, x):
        keep = _array.cast(self.compute_mask(x), x.dtype)
        return x * _array.expand_dims(keep, -1)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)


class Lambda(Layer):
    """Wraps a function of tensors as a layer: `function(x, **arguments)`; no variables of its own.

    Args:
      function: a callable taking the input (a tensor or a list of them).
      output_shape: None (found by calling `function` on symbolic inputs), a
        tuple without the batch axis, or a callable `input_shape -> output_shape`.
      arguments: dict of keyword arguments passed to `function`.
      name: see `Layer`.

    Shapes: whatever `function` returns; its gradient is the function's.
    Saving: `get_config` gives the function object itself; a whole-model
      archive can store only functions it knows (as Keras 3, which refuses to
      load lambdas in safe mode): subclass Layer for a layer you save.
    Raises:
      TypeError: a `function` that is not callable.
    Source: tf.keras.layers.Lambda.
    """

    def __init__(self, function, output_shape=None, arguments=None, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        if not callable(function):
            raise TypeError(f"Lambda needs a callable function, got {function!r}")
        self.function, self.arguments, self._output_shape = function, dict(arguments or {}), output_shape

    def compute_output_shape(self, input_shape):
        if callable(self._output_shape):
            return tuple(self._output_shape(input_shape))
        if self._output_shape is not None:
            return (input_shape[0],) + tuple(self._output_shape)
        return super().compute_output_shape(input_shape)

    def call(self, x):
        return self.function(x, **self.arguments)


class Rescaling(Layer):
    """`x * scale + offset`, in the layer's dtype (`Rescaling(1. / 255)` for images); no variables.

    Args:
      scale, offset: floats (or arrays broadcastable to the input, e.g. one per channel).
      name, dtype: see `Layer` (inputs are cast to the layer's dtype, float32 by default, as Keras).

    Shapes: any -> the same shape; the layer's dtype.
    Gradient: `scale` per element.
    Source: tf.keras.layers.Rescaling.
    """

    def __init__(self, scale, offset=0.0, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        self.scale, self.offset = scale, offset

    def compute_output_shape(self, input_shape):
        return input_shape

    def call(self, x):
        x = _array.cast(x, self.compute_dtype)   # uint8 images too: the layer casts only floating inputs
        scale = convert_to_tensor(self.scale, dtype=x.dtype)
        return x * scale + convert_to_tensor(self.offset, dtype=x.dtype)
