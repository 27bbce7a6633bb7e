"""Convolution layers over channels-last inputs. Source: tf.keras.layers (keras/layers/convolutional)."""
from dtape import nn as _nn
from dtape import regularizers as _regularizers
from dtape.ops import array_ops as _array
from dtape.layers.base import Layer, channels_last, check_rank, get_activation, last_dim, padding_arg, pair, pool_out


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


def _deconv_length(size, k, stride, padding, output_padding, dilation):
    """Keras's output length of a transposed convolution along one axis (None stays None)."""
    if size is None:
        return None
    k = k + (k - 1) * (dilation - 1)
    if output_padding is None:
        return size * stride if padding == "SAME" else size * stride + max(k - stride, 0)
    pad = k // 2 if padding == "SAME" else 0
    return (size - 1) * stride + k - 2 * pad + output_padding


class Conv2DTranspose(Layer):
    """Transposed 2-D convolution of NHWC images (the DCGAN generator's upsampling layer).

    y = activation(conv2d_transpose(x, kernel) + bias): each input pixel adds
    its kernel-weighted window to the output, windows `strides` apart.

    Args:
      filters: number of output channels.
      kernel_size: int or (h, w).
      strides: int or (sh, sw) (default 1).
      padding: "valid" (output (h - 1) * sh + max(kh, sh)) or "same" (output h * sh).
      output_padding: None, or an int or pair added as Keras does
        ((h - 1) * sh + kh - 2 * pad + output_padding, pad = kh // 2 for "same").
      data_format: "channels_last" only.
      dilation_rate: int or pair (default 1).
      activation, use_bias, kernel_initializer, bias_initializer: as `Dense`.
      kernel_regularizer, bias_regularizer, activity_regularizer, name, dtype, seed, input_shape: see `Layer`.

    Variables: `kernel` [kh, kw, filters, in] (Keras's order), `bias` [filters].
    Shapes: [batch, h, w, in] -> [batch, h', w', filters].
    Raises:
      ValueError: a padding other than "valid"/"same", inputs not of rank 4,
        an output_padding not smaller than the stride.
    Source: tf.keras.layers.Conv2DTranspose (tf.nn.conv2d_transpose).
    """

    def __init__(self, filters, kernel_size, strides=(1, 1), padding="valid", output_padding=None,
                 data_format=None, dilation_rate=(1, 1), activation=None, use_bias=True,
                 kernel_initializer="glorot_uniform", bias_initializer="zeros", kernel_regularizer=None,
                 bias_regularizer=None, activity_regularizer=None, name=None, dtype=None, seed=None,
                 input_shape=None):
        super().__init__(name=name, dtype=dtype, seed=seed, input_shape=input_shape,
                         activity_regularizer=activity_regularizer)
        channels_last(data_format, "Conv2DTranspose")
        self.filters = int(filters)
        self.kernel_size, self.strides = pair(kernel_size, "kernel_size"), pair(strides, "strides")
        self.dilation_rate = pair(dilation_rate, "dilation_rate")
        self.padding = padding_arg(padding, "Conv2DTranspose")
        self.output_padding = None if output_padding is None else \
            ((int(output_padding),) * 2 if isinstance(output_padding, int) else tuple(int(p) for p in output_padding))
        if self.output_padding is not None and any(p >= s for p, s in zip(self.output_padding, self.strides)):
            raise ValueError(f"Conv2DTranspose output_padding {self.output_padding} must be smaller than the "
                             f"strides {self.strides}")
        self.activation, self.use_bias = get_activation(activation), bool(use_bias)
        self.kernel_initializer, self.bias_initializer = kernel_initializer, bias_initializer
        self.kernel_regularizer = _regularizers.get(kernel_regularizer)
        self.bias_regularizer = _regularizers.get(bias_regularizer)

    def build(self, input_shape):
        check_rank(input_shape, 4, self)
        shape = self.kernel_size + (self.filters, last_dim(input_shape, self))
        self.kernel = self.add_weight("kernel", shape, self.kernel_initializer, regularizer=self.kernel_regularizer)
        if self.use_bias:
            self.bias = self.add_weight("bias", (self.filters,), self.bias_initializer,
                                        regularizer=self.bias_regularizer)

    def compute_output_shape(self, input_shape):
        check_rank(input_shape, 4, self)
        pads = self.output_padding or (None, None)
        hw = [_deconv_length(n, k, s, self.padding, p, d) for n, k, s, p, d in
              zip(input_shape[1:3], self.kernel_size, self.strides, pads, self.dilation_rate)]
        return (input_shape[0], *hw, self.filters)

    def call(self, x):
        check_rank(x.shape, 4, self)
        out = self.compute_output_shape(tuple(x.shape))
        y = _nn.conv2d_transpose(x, self.kernel, out, strides=self.strides, padding=self.padding,
                                 dilations=self.dilation_rate)
        if self.use_bias:
            y = y + self.bias
        return self.activation(y)


class Conv1D(Layer):
    """1-D convolution over [batch, steps, channels] sequences (a conv2d over one row).

    Args:
      filters: number of output channels.
      kernel_size: int.
      strides: int (default 1).
      padding: "valid", "same" (TF's, output ceil(steps / strides)) or
        "causal" (left-padded by (kernel_size - 1) * dilation_rate: output
        step t sees inputs up to t only, as WaveNet).
      data_format: "channels_last" only.
      dilation_rate: int (default 1).
      activation, use_bias, kernel_initializer, bias_initializer: as `Dense`.
      kernel_regularizer, bias_regularizer, activity_regularizer, name, dtype, seed, input_shape: see `Layer`.

    Variables: `kernel` [k, in, filters], `bias` [filters].
    Shapes: [batch, steps, in] -> [batch, steps', filters].
    Raises:
      ValueError: another padding, inputs not of rank 3.
    Source: tf.keras.layers.Conv1D.
    """

    def __init__(self, filters, kernel_size, strides=1, padding="valid", data_format=None, dilation_rate=1,
                 activation=None, use_bias=True, kernel_initializer="glorot_uniform", bias_initializer="zeros",
                 kernel_regularizer=None, bias_regularizer=None, activity_regularizer=None, name=None, dtype=None,
                 seed=None, input_shape=None):
        super().__init__(name=name, dtype=dtype, seed=seed, input_shape=input_shape,
                         activity_regularizer=activity_regularizer)
        channels_last(data_format, "Conv1D")
        self.filters, self.kernel_size = int(filters), _single(kernel_size, "kernel_size")
        self.strides, self.dilation_rate = _single(strides, "strides"), _single(dilation_rate, "dilation_rate")
        if not isinstance(padding, str) or padding.lower() not in ("valid", "same", "causal"):
            raise ValueError(f"Conv1D padding must be 'valid', 'same' or 'causal', got {padding!r}")
        self.padding = padding.upper()
        self.activation, self.use_bias = get_activation(activation), bool(use_bias)
        self.kernel_initializer, self.bias_initializer = kernel_initializer, bias_initializer
        self.kernel_regularizer = _regularizers.get(kernel_regularizer)
        self.bias_regularizer = _regularizers.get(bias_regularizer)

    def build(self, input_shape):
        _check_rank3(input_shape, self)
        shape = (self.kernel_size, last_dim(input_shape, self), self.filters)
        self.kernel = self.add_weight("kernel", shape, self.kernel_initializer, regularizer=self.kernel_regularizer)
        if self.use_bias:
            self.bias = self.add_weight("bias", (self.filters,), self.bias_initializer,
                                        regularizer=self.bias_regularizer)

    def compute_output_shape(self, input_shape):
        _check_rank3(input_shape, self)
        k = (self.kernel_size - 1) * self.dilation_rate + 1
        steps = input_shape[1]
        if steps is not None:
            steps = -(-steps // self.strides) if self.padding in ("SAME", "CAUSAL") else \
                max((steps - k) // self.strides + 1, 0)
        return (input_shape[0], steps, self.filters)

    def call(self, x):
        _check_rank3(x.shape, self)
        padding = self.padding
        if padding == "CAUSAL":
            padding = [[0, 0], [0, 0], [(self.kernel_size - 1) * self.dilation_rate, 0], [0, 0]]
        y = _nn.conv2d(_array.expand_dims(x, 1), _array.expand_dims(self.kernel, 0), strides=[1, 1, self.strides, 1],
                       padding=padding, dilations=[1, 1, self.dilation_rate, 1])
        y = _array.squeeze(y, [1])
        if self.use_bias:
            y = y + self.bias
        return self.activation(y)


def _single(v, what):
    v = v[0] if isinstance(v, (list, tuple)) and len(v) == 1 else v
    if not isinstance(v, int) or v <= 0:
        raise ValueError(f"Conv1D {what} must be a positive int, got {v!r}")
    return v


def _check_rank3(shape, layer):
    if len(shape) != 3:
        raise ValueError(f"{layer.name}: Conv1D expects inputs of rank 3 ([batch, steps, channels]), "
                         f"got shape {tuple(shape)}")
