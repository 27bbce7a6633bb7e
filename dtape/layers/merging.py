"""Merging layers: Add, Multiply, Concatenate (called on a list of tensors). Source: tf.keras.layers (keras/layers/merging)."""
import functools

import torch

from dtape.ops import array_ops as _array
from dtape.ops import math_ops as _math
from dtape.tensor import Tensor
from dtape.layers.base import Layer


def _as_list(inputs, layer):
    if not isinstance(inputs, (list, tuple)) or len(inputs) < 1:
        raise ValueError(f"{layer.name}: {type(layer).__name__} is called on a list of tensors, "
                         f"e.g. {type(layer).__name__}()([x, y]); got {type(inputs).__name__}")
    return list(inputs)


def _mask_list(mask, n):
    """The masks of n inputs: a list of n (None for an input without one), or one mask for the first input."""
    if isinstance(mask, (list, tuple)):
        return list(mask) + [None] * (n - len(mask))
    return [mask] + [None] * (n - 1)


def _all_masks(masks):
    """Elementwise AND of the masks that are given; None when none is."""
    given = [m for m in masks if m is not None]
    return functools.reduce(_math.logical_and, given) if given else None


class _Merge(Layer):
    """A layer of one elementwise reduction over a list of same-shape tensors; masks are ANDed (Keras)."""

    supports_masking = True

    def compute_output_shape(self, input_shape):
        shapes = [tuple(s) for s in input_shape]
        out = list(shapes[0])
        for s in shapes[1:]:
            if len(s) != len(out):
                raise ValueError(f"{self.name}: inputs of different ranks: {shapes}")
            out = [b if a in (None, 1) else a for a, b in zip(out, s)]
        return tuple(out)

    def compute_mask(self, inputs, mask=None):
        n = len(inputs) if isinstance(inputs, (list, tuple)) else 1
        return _all_masks(_mask_list(mask, n))

    def call(self, inputs):
        xs = _as_list(inputs, self)
        return functools.reduce(self._merge, xs[1:], xs[0])


class Add(_Merge):
    """Sum of a list of tensors of one shape (numpy broadcasting allowed): `Add()([x, y])`.

    Shapes: [batch, ...] each -> [batch, ...]; dtype of the inputs. The output
    mask is the AND of the inputs' masks. Raises ValueError for a call on
    something other than a non-empty list. Source: tf.keras.layers.Add.
    """

    _merge = staticmethod(_math.add)


class Multiply(_Merge):
    """Elementwise product of a list of tensors of one shape: `Multiply()([x, y])`.

    Shapes, masks, errors: as `Add`. Source: tf.keras.layers.Multiply.
    """

    _merge = staticmethod(_math.multiply)


class Concatenate(Layer):
    """Joins a list of tensors along `axis` (default -1): `Concatenate()([x, y])`.

    Args:
      axis: the axis to join along (other sizes must match).
      name: see `Layer`.

    Shapes: [batch, ..., d_i] -> [batch, ..., sum d_i] (axis=-1). Masks: the
    AND of the inputs' masks when joining features (the mask has fewer axes
    than the inputs, e.g. [batch, time] masks of [batch, time, d] inputs);
    joined along `axis` otherwise, an input without a mask counting as all kept.
    Raises ValueError for a call on something other than a non-empty list.
    Source: tf.keras.layers.Concatenate.
    """

    supports_masking = True

    def __init__(self, axis=-1, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        self.axis = int(axis)

    def compute_output_shape(self, input_shape):
        shapes = [tuple(s) for s in input_shape]
        axis = self.axis % len(shapes[0])
        sizes = [s[axis] for s in shapes]
        out = list(shapes[0])
        out[axis] = None if None in sizes else sum(sizes)
        return tuple(out)

    def compute_mask(self, inputs, mask=None):
        xs = inputs if isinstance(inputs, (list, tuple)) else [inputs]
        masks = _mask_list(mask, len(xs))
        if all(m is None for m in masks):
            return None
        rank = xs[0].ndim
        axis = self.axis % rank
        mask_rank = next(m for m in masks if m is not None).ndim
        if axis >= mask_rank:  # joining features: a position is kept where every input keeps it
            return _all_masks(masks)
        full = [Tensor(torch.ones(tuple(x.shape[:mask_rank]), dtype=torch.bool, device=x.device)) if m is None
                else m for m, x in zip(masks, xs)]
        return _array.concat(full, axis)

    def call(self, inputs):
        return _array.concat(_as_list(inputs, self), self.axis)


def add(inputs, **kwargs):
    """`Add(**kwargs)(inputs)`: Keras's functional form. Source: tf.keras.layers.add."""
    return Add(**kwargs)(inputs)


def multiply(inputs, **kwargs):
    """`Multiply(**kwargs)(inputs)`: Keras's functional form. Source: tf.keras.layers.multiply."""
    return Multiply(**kwargs)(inputs)


def concatenate(inputs, axis=-1, **kwargs):
    """`Concatenate(axis, **kwargs)(inputs)`: Keras's functional form. Source: tf.keras.layers.concatenate."""
    return Concatenate(axis=axis, **kwargs)(inputs)
