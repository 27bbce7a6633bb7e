"""Pooling layers over NHWC images and [batch, steps, features] sequences. Source: tf.keras.layers (keras/layers/pooling)."""
import torch

from dtape.ops import array_ops as _array
from dtape.ops import math_ops as _math
from dtape.tensor import Tensor
from dtape.layers.base import Layer, channels_last, check_rank, padding_arg, pair, pool_out, same_pads


class _Pooling2D(Layer):
    """Window reduction over NHWC images (the reduction in `_pool`)."""

    def __init__(self, pool_size=(2, 2), strides=None, padding="valid", data_format=None, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        channels_last(data_format, type(self).__name__)
        self.pool_size = pair(pool_size, "pool_size")
        self.strides = self.pool_size if strides is None else pair(strides, "strides")
        self.padding = padding_arg(padding, type(self).__name__)

    def compute_output_shape(self, input_shape):
        check_rank(input_shape, 4, self)
        hw = [pool_out(d, k, st, self.padding) for d, k, st in zip(input_shape[1:3], self.pool_size, self.strides)]
        return (input_shape[0], *hw, input_shape[3])

    def call(self, x):
        check_rank(x.shape, 4, self)
        nchw = _array.transpose(x, (0, 3, 1, 2))
        pads = (0, 0, 0, 0)
        if self.padding == "SAME":
            (top, bottom), (left, right) = (same_pads(d, k, st) for d, k, st in
                                            zip(x.shape[1:3], self.pool_size, self.strides))
            pads = (left, right, top, bottom)
        return _array.transpose(self._pool(nchw, pads), (0, 2, 3, 1))


class MaxPooling2D(_Pooling2D):
    """Max over `pool_size` windows of NHWC images, moved by `strides`.

    Args:
      pool_size: int or (h, w) (default (2, 2)).
      strides: int or (sh, sw); default pool_size.
      padding: "valid" (windows inside the image) or "same" (TF: output
        ceil(size / stride), padding split with the extra row/column after;
        padded positions never win).
      data_format: "channels_last" only.
      name: see `Layer`.

    Shapes: [batch, h, w, c] -> [batch, h', w', c], same dtype and device.
    Gradients go to the maximum of each window.
    Source: tf.keras.layers.MaxPooling2D.
    """

    def _pool(self, x, pads):
        if any(pads):
            x = torch.nn.functional.pad(x, pads, value=float("-inf"))
        return torch.nn.functional.max_pool2d(x, self.pool_size, self.strides)


class AveragePooling2D(_Pooling2D):
    """Mean over `pool_size` windows of NHWC images.

    Args: as `MaxPooling2D`. With padding="same" the padded positions are
    not counted (TF): a border window averages only the real pixels.
    Shapes: [batch, h, w, c] -> [batch, h', w', c].
    Source: tf.keras.layers.AveragePooling2D.
    """

    def _pool(self, x, pads):
        if not any(pads):
            return torch.nn.functional.avg_pool2d(x, self.pool_size, self.strides)
        total = torch.nn.functional.avg_pool2d(torch.nn.functional.pad(x, pads), self.pool_size, self.strides)
        ones = torch.ones((1, 1) + tuple(x.shape[2:]), dtype=x.dtype, device=x.device)
        share = torch.nn.functional.avg_pool2d(torch.nn.functional.pad(ones, pads), self.pool_size, self.strides)
        return total / Tensor(share)


class _GlobalPooling2D(Layer):
    def __init__(self, data_format=None, keepdims=False, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        channels_last(data_format, type(self).__name__)
        self.keepdims = bool(keepdims)

    def compute_output_shape(self, input_shape):
        check_rank(input_shape, 4, self)
        return (input_shape[0], 1, 1, input_shape[3]) if self.keepdims else (input_shape[0], input_shape[3])

    def call(self, x):
        check_rank(x.shape, 4, self)
        return self._reduce(x, axis=(1, 2), keepdims=self.keepdims)


class GlobalAveragePooling2D(_GlobalPooling2D):
    """Mean over height and width: [batch, h, w, c] -> [batch, c] ([batch, 1, 1, c] with keepdims).

    Source: tf.keras.layers.GlobalAveragePooling2D.
    """

    _reduce = staticmethod(_math.reduce_mean)


class GlobalMaxPooling2D(_GlobalPooling2D):
    """Max over height and width: [batch, h, w, c] -> [batch, c]. Source: tf.keras.layers.GlobalMaxPooling2D."""

    _reduce = staticmethod(_math.reduce_max)


def _check_rank3(shape, layer):
    if len(shape) != 3:
        raise ValueError(f"{layer.name}: {type(layer).__name__} expects inputs of rank 3 ([batch, steps, "
                         f"features]), got shape {tuple(shape)}")


class _GlobalPooling1D(Layer):
    supports_masking = True

    def __init__(self, data_format=None, keepdims=False, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        channels_last(data_format, type(self).__name__)
        self.keepdims = bool(keepdims)

    def compute_output_shape(self, input_shape):
        _check_rank3(input_shape, self)
        return (input_shape[0], 1, input_shape[2]) if self.keepdims else (input_shape[0], input_shape[2])

    def compute_mask(self, inputs, mask=None):
        return None  # the steps are reduced away: no mask after (Keras)


class GlobalAveragePooling1D(_GlobalPooling1D):
    """Mean over the steps: [batch, steps, features] -> [batch, features] ([batch, 1, features] with keepdims).

    With a mask ([batch, steps], e.g. from `Embedding(mask_zero=True)`), the
    mean of the kept steps only (Keras); a row with no kept step gives NaN
    as Keras's 0 / 0. The output carries no mask.
    Args: data_format ("channels_last" only), keepdims, name.
    Source: tf.keras.layers.GlobalAveragePooling1D.
    """

    def call(self, x, mask=None):
        _check_rank3(x.shape, self)
        if mask is None:
            return _math.reduce_mean(x, axis=1, keepdims=self.keepdims)
        weight = _array.expand_dims(_array.cast(mask, x.dtype), -1)
        total = _math.reduce_sum(x * weight, axis=1, keepdims=self.keepdims)
        return total / _math.reduce_sum(weight, axis=1, keepdims=self.keepdims)


class GlobalMaxPooling1D(_GlobalPooling1D):
    """Max over the steps: [batch, steps, features] -> [batch, features]. Masks are not applied (as Keras).

    Source: tf.keras.layers.GlobalMaxPooling1D.
    """

    def call(self, x):
        _check_rank3(x.shape, self)
        return _math.reduce_max(x, axis=1, keepdims=self.keepdims)
