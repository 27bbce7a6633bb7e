"""Sequential: a stack of layers, each built from the previous one's output shape. Source: tf.keras.Sequential."""
import torch

from dtape import _keras_tensor
from dtape import tape as _tp
from dtape.tensor import Tensor
from dtape.layers.base import Layer, takes_mask, takes_training


class Sequential(Layer):
    """Chains layers: `layers[-1](...layers[0](x))`; `training` is passed to layers that take it.

    Args:
      layers: a list of layers (or any callables); more via `add`.
      name: see `Layer`.

    `build(input_shape)` (batch dimension included, None allowed) creates
    every layer's variables now, each from the previous layer's output
    shape; a first layer given `input_shape=` builds the whole model at
    construction (Keras). `summary()` then lists every layer's output shape
    and parameter count.

    Source: tf.keras.Sequential.

    Example:
      >>> model = dtape.layers.Sequential([dtape.layers.Dense(8, "relu", input_dim=4),
      ...                                  dtape.layers.Dense(2)])
      >>> model(dtape.ones([3, 4])).shape
      torch.Size([3, 2])
    """

    def __init__(self, layers=None, name=None):
        super().__init__(name=name)
        self.layers = []
        for layer in layers or []:
            self.add(layer)

    def add(self, layer):
        """Appends `layer`; an `Input(shape=...)` (first only) gives the model its input shape instead.

        The model is built as soon as its input shape is known (an `Input`
        or a first layer given `input_shape=`), then each added layer at
        once: `output_shape` and `summary()` are known (Keras).
        Raises ValueError for an `Input` after the first layer.
        """
        if isinstance(layer, _keras_tensor.KerasTensor):
            if self.layers or self.built:
                raise ValueError(f"{self.name}: an Input can only come first in a Sequential model; "
                                 f"{len(self.layers)} layer(s) were already added")
            self.build(layer.shape)
            return
        self.layers.append(layer)
        if self.built and self._output_shape is not None:
            self._output_shape = _build_layer(layer, self._output_shape)
        elif not self.built and len(self.layers) == 1 and getattr(layer, "_input_shape_arg", None) is not None:
            self.build((None,) + layer._input_shape_arg)

    def build(self, input_shape):
        """Builds every layer for inputs of `input_shape` (e.g. (None, 784)); runs once.

        Each layer is built from the previous one's output shape
        (`compute_output_shape`); a layer that cannot tell its output shape
        is run once on a zero batch of 1 (not recorded) to find it.
        Source: tf.keras.Sequential.build.
        """
        shape = tuple(input_shape)
        for layer in self.layers:
            shape = _build_layer(layer, shape)
        self._output_shape = shape

    def compute_output_shape(self, input_shape):
        return self._output_shape if self.built else None

    def _maybe_build(self, input_shape):
        self.built = True  # its layers build themselves on this first call

    def _convert_input(self, x):
        first = self.layers[0] if self.layers else None
        return first._convert_input(x) if isinstance(first, Layer) else super()._convert_input(x)

    def call(self, x, training=False, mask=None):
        """Each layer on the previous one's output; a mask (given, or from a layer's `compute_mask`, e.g.
        `Embedding(mask_zero=True)`) goes to the next layers whose `call` takes `mask` and passes through those
        that `supports_masking` (Keras's propagation), else it stops."""
        return self.call_with_mask(x, training, mask)[0]

    def call_with_mask(self, x, training=False, mask=None):
        """`call`, returning `(output, the output's mask or None)` (a model hands that mask to its loss)."""
        for layer in self.layers:
            kwargs = {"training": training} if takes_training(layer.__call__) else {}
            if mask is not None and isinstance(layer, Layer) and takes_mask(layer.call):
                kwargs["mask"] = mask
            x, mask = layer(x, **kwargs), _next_mask(layer, x, mask)
        return x, mask


def _next_mask(layer, x, mask):
    """The mask after `layer`: its `compute_mask`, else `mask` if it `supports_masking`, else None."""
    if hasattr(layer, "compute_mask"):
        return layer.compute_mask(x, mask)
    return mask if getattr(layer, "supports_masking", False) else None


def _build_layer(layer, shape):
    """Builds `layer` for inputs of `shape`; returns its output shape (None where unknown)."""
    if not isinstance(layer, Layer):
        return _probe(layer, shape)
    layer.build(shape)
    out = layer.compute_output_shape(shape)
    if out is None:
        return _probe(layer, shape)
    layer._output_shape = tuple(out)
    return tuple(out)


def _probe(layer, shape):
    """Runs `layer` once on zeros of `shape` (None -> 1), unrecorded; its output shape with the batch unknown."""
    if shape is None or any(d is None for d in shape[1:]):
        return None
    dtype = getattr(layer, "_input_dtype", None) or getattr(layer, "dtype", torch.float32)
    device = next((v.device for v in getattr(layer, "variables", ())), None)
    with _tp.stop_recording():
        out = layer(Tensor(torch.zeros((1,) + tuple(shape[1:]), dtype=dtype, device=device)))
    return (shape[0],) + tuple(out.shape[1:])
