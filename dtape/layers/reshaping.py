"""Reshaping layers: Flatten, Reshape, Permute, UpSampling2D, ZeroPadding2D. Source: tf.keras.layers (keras/layers/reshaping)."""
import math

from dtape.ops import array_ops as _array
from dtape.layers.base import Layer, channels_last, check_rank, pair


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


class Permute(Layer):
    """Permutes the non-batch axes: `dims` lists them (from 1) in their new order, e.g. (2, 1).

    Shapes: [batch, d1, d2] -> [batch, d2, d1] for dims=(2, 1); dtype kept.
    Raises:
      ValueError: dims that are not a permutation of 1..n.
    Source: tf.keras.layers.Permute.
    """

    def __init__(self, dims, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        self.dims = tuple(int(d) for d in dims)
        if sorted(self.dims) != list(range(1, len(self.dims) + 1)):
            raise ValueError(f"Permute dims must be a permutation of 1..{len(self.dims)} (the batch axis 0 "
                             f"stays first), got {dims!r}")

    def compute_output_shape(self, input_shape):
        return (input_shape[0],) + tuple(input_shape[d] for d in self.dims)

    def call(self, x):
        if x.ndim != len(self.dims) + 1:
            raise ValueError(f"{self.name}: dims {self.dims} are for inputs of rank {len(self.dims) + 1}, "
                             f"got shape {tuple(x.shape)}")
        return _array.transpose(x, (0,) + self.dims)


class UpSampling2D(Layer):
    """Repeats the rows and columns of NHWC images `size` times (nearest neighbour).

    Args:
      size: int or (rows, cols) (default (2, 2)).
      data_format: "channels_last" only.
      interpolation: "nearest" only (Keras's default).
      name: see `Layer`.

    Shapes: [batch, h, w, c] -> [batch, h * rows, w * cols, c]; dtype kept.
    Gradient: each input pixel gets the sum over its copies.
    Raises:
      ValueError: another interpolation or data_format, or an input not of rank 4.
    Source: tf.keras.layers.UpSampling2D.
    """

    def __init__(self, size=(2, 2), data_format=None, interpolation="nearest", name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        channels_last(data_format, "UpSampling2D")
        if interpolation != "nearest":
            raise ValueError(f"UpSampling2D supports interpolation='nearest' only, got {interpolation!r}")
        self.size, self.interpolation = pair(size, "size"), interpolation

    def compute_output_shape(self, input_shape):
        check_rank(input_shape, 4, self)
        hw = [None if d is None else d * k for d, k in zip(input_shape[1:3], self.size)]
        return (input_shape[0], *hw, input_shape[3])

    def call(self, x):
        check_rank(x.shape, 4, self)
        b, h, w, c = x.shape
        (rows, cols) = self.size
        y = _array.broadcast_to(_array.reshape(x, (b, h, 1, w, 1, c)), (b, h, rows, w, cols, c))
        return _array.reshape(y, (b, h * rows, w * cols, c))


class ZeroPadding2D(Layer):
    """Adds rows and columns of zeros around NHWC images.

    Args:
      padding: int (the same on all four sides), (rows, cols) (symmetric),
        or ((top, bottom), (left, right)); non-negative ints.
      data_format: "channels_last" only.
      name: see `Layer`.

    Shapes: [batch, h, w, c] -> [batch, h + top + bottom, w + left + right, c]; dtype kept.
    Gradient: the input's part of the output's gradient (the padding's is dropped).
    Raises:
      ValueError: another padding form or a negative size, another
        data_format, an input not of rank 4.
    Source: tf.keras.layers.ZeroPadding2D.
    """

    def __init__(self, padding=(1, 1), data_format=None, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        channels_last(data_format, "ZeroPadding2D")
        self.padding = _padding_pairs(padding)

    def compute_output_shape(self, input_shape):
        check_rank(input_shape, 4, self)
        hw = [None if d is None else d + sum(p) for d, p in zip(input_shape[1:3], self.padding)]
        return (input_shape[0], *hw, input_shape[3])

    def call(self, x):
        check_rank(x.shape, 4, self)
        return _array.pad(x, [[0, 0], list(self.padding[0]), list(self.padding[1]), [0, 0]])


def _padding_pairs(padding):
    """((top, bottom), (left, right)) from Keras's three forms of a 2D padding."""
    try:
        if isinstance(padding, int):
            pairs = ((padding, padding), (padding, padding))
        elif all(isinstance(p, int) for p in padding):
            (rows, cols) = padding
            pairs = ((rows, rows), (cols, cols))
        else:
            pairs = tuple((int(a), int(b)) for a, b in padding)
        if len(pairs) != 2 or min(min(p) for p in pairs) < 0:
            raise ValueError
    except (TypeError, ValueError):
        raise ValueError(f"ZeroPadding2D padding must be an int, (rows, cols) or ((top, bottom), (left, right)) "
                         f"of non-negative ints, got {padding!r}") from None
    return pairs
