"""Keras-style layers built on dtape ops: Dense, Conv2D, Embedding, LayerNormalization, Dropout, Sequential.

Each layer is a `Module`; its variables are made with `dtape.Variable` when it
is built (on the first call, or at construction when the input size is given),
so a strategy's `scope()` turns them into distributed variables. Initial
values are drawn once, where the variable is created, from a
`torch.Generator` seeded by the layer's `seed` (or from torch's global
generator, seeded by `torch.manual_seed`, when `seed` is None). The initial
value is passed to `Variable` as a callable, so a layer built lazily inside
`strategy.run` draws it once, in the strategy's merge_call on the caller's
thread: creation is deterministic and equals building the layer outside.

Source: tf.keras.layers.
"""
import inspect
import math
import threading

import numpy as np
import torch

from dtape import nn as _nn
from dtape import random as _random
from dtape.module import Module
from dtape.ops import array_ops as _array
from dtape.ops import math_ops as _math
from dtape.tensor import Tensor, convert_to_tensor, is_variable
from dtape.variables import Variable

__all__ = ["Layer", "Dense", "Conv2D", "Embedding", "LayerNormalization", "Dropout", "Sequential",
           "get_activation", "get_initializer"]


# -- activations -------------------------------------------------------------

_ACTIVATIONS = {
    "linear": lambda x: x,
    "relu": _nn.relu,
    "relu6": _nn.relu6,
    "leaky_relu": _nn.leaky_relu,
    "elu": _nn.elu,
    "gelu": _nn.gelu,
    "silu": _nn.silu,
    "softplus": _nn.softplus,
    "tanh": _math.tanh,
    "sigmoid": _math.sigmoid,
    "softmax": lambda x: _nn.softmax(x, axis=-1),
    "log_softmax": lambda x: _nn.log_softmax(x, axis=-1),
}


def get_activation(activation):
    """An activation function from a name (`"relu"`, `"tanh"`, `"softmax"`, ...), a callable, or None.

    Raises:
      ValueError: an unknown name (the message lists the known ones).
    """
    if activation is None:
        return _ACTIVATIONS["linear"]
    if callable(activation):
        return activation
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; use one of {sorted(_ACTIVATIONS)} or a callable")
    return _ACTIVATIONS[activation]


# -- initializers ------------------------------------------------------------

def _fans(shape):
    if len(shape) < 2:
        return shape[0] if shape else 1, shape[0] if shape else 1
    receptive = math.prod(shape[:-2])
    return shape[-2] * receptive, shape[-1] * receptive


def _glorot_uniform(shape, dtype, gen):
    fan_in, fan_out = _fans(shape)
    limit = math.sqrt(6.0 / (fan_in + fan_out))
    return (torch.rand(shape, dtype=dtype, generator=gen) * 2 - 1) * limit


def _he_normal(shape, dtype, gen):
    return torch.randn(shape, dtype=dtype, generator=gen) * math.sqrt(2.0 / _fans(shape)[0])


def _he_uniform(shape, dtype, gen):
    limit = math.sqrt(6.0 / _fans(shape)[0])
    return (torch.rand(shape, dtype=dtype, generator=gen) * 2 - 1) * limit


_INITIALIZERS = {
    "glorot_uniform": _glorot_uniform,
    "he_normal": _he_normal,
    "he_uniform": _he_uniform,
    "random_normal": lambda shape, dtype, gen: torch.randn(shape, dtype=dtype, generator=gen) * 0.05,
    "random_uniform": lambda shape, dtype, gen: (torch.rand(shape, dtype=dtype, generator=gen) * 2 - 1) * 0.05,
    "zeros": lambda shape, dtype, gen: torch.zeros(shape, dtype=dtype),
    "ones": lambda shape, dtype, gen: torch.ones(shape, dtype=dtype),
}


def get_initializer(initializer):
    """An initializer `f(shape, dtype, generator) -> torch.Tensor` from a name or a callable.

    A callable may also take just `(shape, dtype)`.

    Raises:
      ValueError: an unknown name (the message lists the known ones).
    """
    if callable(initializer):
        params = inspect.signature(initializer).parameters
        return initializer if len(params) >= 3 else (lambda shape, dtype, gen: initializer(shape, dtype))
    if initializer not in _INITIALIZERS:
        raise ValueError(f"unknown initializer {initializer!r}; use one of {sorted(_INITIALIZERS)} or a callable")
    return _INITIALIZERS[initializer]


# -- base layer ----------------------------------------------------------------

class Layer(Module):
    """Base class: builds its variables on first call, then runs `call`.

    Subclasses define `build(input_shape)` (create variables with
    `self.add_weight`) and `call(x)` or `call(x, training=False)`.

    Args:
      name: module name (default: the snake-cased class name, made unique).
      dtype: torch floating dtype of the variables (default float32).
      seed: int seed of this layer's initializers; None draws from torch's
        global generator (`torch.manual_seed`).
    """

    def __init__(self, name=None, dtype=torch.float32, seed=None):
        super().__init__(name=name)
        self.dtype = dtype
        self.built = False
        self._generator = torch.Generator().manual_seed(seed) if seed is not None else None

    def build(self, input_shape):
        """Creates the variables for inputs of `input_shape` (a torch.Size)."""

    def call(self, x):
        raise NotImplementedError(f"{type(self).__name__} must define call(x)")

    def add_weight(self, name, shape, initializer="glorot_uniform", trainable=True):
        """Creates a variable `<layer>/<name>` of `shape`, its initial value drawn once where it is created.

        The value is given to `Variable` as a callable: inside `strategy.run`
        the strategy calls it once, in its merge_call on the caller's thread,
        so replica threads never draw (and never race on) initial values.
        """
        init, shape, dtype, gen = get_initializer(initializer), tuple(shape), self.dtype, self._generator
        return Variable(lambda: init(shape, dtype, gen), trainable=trainable, name=f"{self.name}/{name}",
                        dtype=self.dtype)

    def _maybe_build(self, input_shape):
        if not self.built:
            self.build(torch.Size(input_shape))
            self.built = True

    def __call__(self, x, training=False):
        """Applies the layer. x: Tensor, Variable, torch.Tensor, array or nested list."""
        if not isinstance(x, Tensor) and not is_variable(x):
            x = convert_to_tensor(x, dtype=self.dtype if _is_float_like(x) else None)
        self._maybe_build(x.shape)
        if _takes_training(self.call):
            return self.call(x, training=training)
        return self.call(x)


def _is_float_like(x):
    t = torch.as_tensor(x) if not isinstance(x, torch.Tensor) else x
    return t.is_floating_point()


def _takes_training(fn):
    try:
        return "training" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _last_dim(input_shape, layer):
    if len(input_shape) == 0 or input_shape[-1] is None:
        raise ValueError(f"{layer.name}: the last input dimension must be known, got shape {tuple(input_shape)}")
    return int(input_shape[-1])


# -- layers ----------------------------------------------------------------------

class Dense(Layer):
    """Densely connected layer: `activation(x @ kernel + bias)`.

    Args:
      units: output size.
      activation: None, a name ("relu", "tanh", "softmax", ...) or a callable.
      use_bias: whether to add a bias.
      kernel_initializer, bias_initializer: names or callables.
      input_dim: input size; when given, the variables are created now.
      name, dtype, seed: see `Layer`.

    Variables: `kernel` [in, units], `bias` [units].
    Shapes: x [..., in] -> [..., units] (floating dtypes).
    Source: tf.keras.layers.Dense.

    Example:
      >>> layer = dtape.layers.Dense(3, activation="relu", input_dim=2)
      >>> layer(dtape.ones([4, 2])).shape
      torch.Size([4, 3])
    """

    def __init__(self, units, activation=None, use_bias=True, kernel_initializer="glorot_uniform",
                 bias_initializer="zeros", input_dim=None, name=None, dtype=torch.float32, seed=None):
        super().__init__(name=name, dtype=dtype, seed=seed)
        if int(units) <= 0:
            raise ValueError(f"Dense units must be a positive int, got {units!r}")
        self.units = int(units)
        self.activation = get_activation(activation)
        self.use_bias = bool(use_bias)
        self.kernel_initializer = kernel_initializer
        self.bias_initializer = bias_initializer
        if input_dim is not None:
            self._maybe_build((int(input_dim),))

    def build(self, input_shape):
        in_dim = _last_dim(input_shape, self)
        self.kernel = self.add_weight("kernel", (in_dim, self.units), self.kernel_initializer)
        if self.use_bias:
            self.bias = self.add_weight("bias", (self.units,), self.bias_initializer)

    def call(self, x):
        lead = tuple(x.shape[:-1])
        if len(lead) != 1:
            x = _array.reshape(x, (-1, x.shape[-1]))
        y = _math.matmul(x, self.kernel)
        if self.use_bias:
            y = y + self.bias
        if len(lead) != 1:
            y = _array.reshape(y, lead + (self.units,))
        return self.activation(y)


class Conv2D(Layer):
    """2-D convolution over NHWC images: `activation(conv2d(x, kernel) + bias)`.

    Args:
      filters: number of output channels.
      kernel_size: int or (h, w).
      strides: int or (sh, sw).
      padding: "valid" or "same" (TF semantics).
      activation, use_bias, kernel_initializer, name, dtype, seed: as `Dense`.
      input_channels: when given, the variables are created now.

    Variables: `kernel` [kh, kw, in, filters], `bias` [filters].
    Shapes: x [batch, h, w, in] -> [batch, h', w', filters].
    Source: tf.keras.layers.Conv2D.
    """

    def __init__(self, filters, kernel_size, strides=1, padding="valid", activation=None, use_bias=True,
                 kernel_initializer="glorot_uniform", input_channels=None, name=None, dtype=torch.float32,
                 seed=None):
        super().__init__(name=name, dtype=dtype, seed=seed)
        self.filters = int(filters)
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.strides = _pair(strides, "strides")
        if padding.lower() not in ("valid", "same"):
            raise ValueError(f"Conv2D padding must be 'valid' or 'same', got {padding!r}")
        self.padding = padding.upper()
        self.activation = get_activation(activation)
        self.use_bias = bool(use_bias)
        self.kernel_initializer = kernel_initializer
        if input_channels is not None:
            self._maybe_build((1, 1, 1, int(input_channels)))

    def build(self, input_shape):
        if len(input_shape) != 4:
            raise ValueError(f"{self.name}: Conv2D expects NHWC input [batch, h, w, c], got {tuple(input_shape)}")
        shape = self.kernel_size + (_last_dim(input_shape, self), self.filters)
        self.kernel = self.add_weight("kernel", shape, self.kernel_initializer)
        if self.use_bias:
            self.bias = self.add_weight("bias", (self.filters,), "zeros")

    def call(self, x):
        y = _nn.conv2d(x, self.kernel, strides=[1, *self.strides, 1], padding=self.padding)
        if self.use_bias:
            y = y + self.bias
        return self.activation(y)


def _pair(v, what):
    pair = (int(v), int(v)) if isinstance(v, int) else tuple(int(i) for i in v)
    if len(pair) != 2 or min(pair) <= 0:
        raise ValueError(f"{what} must be a positive int or a pair of them, got {v!r}")
    return pair


class Embedding(Layer):
    """Lookup table: integer ids [...] -> vectors [..., output_dim].

    Args:
      input_dim: vocabulary size.
      output_dim: vector size.
      embeddings_initializer: name or callable (default "random_uniform", as Keras).
      name, dtype, seed: see `Layer`.

    Variables: `embeddings` [input_dim, output_dim], created at construction.
    Source: tf.keras.layers.Embedding.
    """

    def __init__(self, input_dim, output_dim, embeddings_initializer="random_uniform", name=None,
                 dtype=torch.float32, seed=None):
        super().__init__(name=name, dtype=dtype, seed=seed)
        self.input_dim, self.output_dim = int(input_dim), int(output_dim)
        self.embeddings = self.add_weight("embeddings", (self.input_dim, self.output_dim),
                                          embeddings_initializer)
        self.built = True

    def __call__(self, ids, training=False):
        ids = ids if isinstance(ids, Tensor) else convert_to_tensor(ids, dtype=torch.int64)
        return _nn.embedding_lookup(self.embeddings, ids)


class LayerNormalization(Layer):
    """Normalises the last axis: `gamma * (x - mean) / sqrt(var + epsilon) + beta`.

    Args:
      epsilon: added to the variance.
      input_dim: size d of the last axis; when given, the variables are created now.
      name, dtype, seed: see `Layer`.

    Variables: `gamma` [d] (ones), `beta` [d] (zeros).
    Shapes: x [..., d] -> [..., d].
    Source: tf.keras.layers.LayerNormalization(axis=-1).
    """

    def __init__(self, epsilon=1e-3, input_dim=None, name=None, dtype=torch.float32, seed=None):
        super().__init__(name=name, dtype=dtype, seed=seed)
        self.epsilon = float(epsilon)
        if input_dim is not None:
            self._maybe_build((int(input_dim),))

    def build(self, input_shape):
        d = _last_dim(input_shape, self)
        self.gamma = self.add_weight("gamma", (d,), "ones")
        self.beta = self.add_weight("beta", (d,), "zeros")

    def call(self, x):
        mean = _math.reduce_mean(x, axis=-1, keepdims=True)
        centered = x - mean
        var = _math.reduce_mean(centered * centered, axis=-1, keepdims=True)
        return centered * _math.rsqrt(var + self.epsilon) * self.gamma + self.beta


class Dropout(Layer):
    """Zeroes a fraction `rate` of inputs during training, scaling the rest by 1/(1-rate).

    Args:
      rate: float in [0, 1).
      name: see `Layer`.
      seed: None (default): the mask draws from the current replica's
        generator (`dtape.random.get_generator`: one per replica under a
        strategy, saved by `strategy.get_rng_state()`; torch's default
        generator outside replicas). An int: the layer draws from its own
        stateful generators: outside replicas one seeded with `seed` (per
        device); on replica i of a strategy one seeded from (seed, i), so
        replicas never share (or race on) one generator and each replica's
        masks are reproducible. These layer-owned streams are not part of
        the strategy's RNG state: for a bit-exact resume use seed=None.

    Shapes: x any shape -> the same shape and dtype. Identity unless called
    with `training=True`.
    Source: tf.keras.layers.Dropout (per-replica streams: tf.random.Generator.split).
    """

    def __init__(self, rate, name=None, seed=None):
        super().__init__(name=name, seed=seed)
        if not 0.0 <= float(rate) < 1.0:
            raise ValueError(f"Dropout rate must be in [0, 1), got {rate!r}")
        self.rate = float(rate)
        self.seed = None if seed is None else int(seed)
        self._streams = {}  # (replica id or None, device) -> torch.Generator; only with a seed
        self._streams_lock = threading.Lock()
        self.built = True

    def __call__(self, x, training=False):
        x = x if isinstance(x, Tensor) or is_variable(x) else convert_to_tensor(x)
        if not training or self.rate == 0.0:
            return x
        if self.seed is None:
            return _nn.dropout(x, self.rate)
        keep = torch.rand(tuple(x.shape), generator=self._stream(x.device), device=x.device) >= self.rate
        return x * Tensor(keep.to(x.dtype) / (1.0 - self.rate))

    def _stream(self, device):
        """This layer's generator for the current replica (None outside replicas) on `device`."""
        replica_id = getattr(_random.get_generator(device), "replica_id", None)
        key = (replica_id, device)
        with self._streams_lock:
            gen = self._streams.get(key)
            if gen is None:
                seed = self.seed if replica_id is None else _derive_seed(self.seed, replica_id)
                gen = self._streams[key] = torch.Generator(device=device).manual_seed(seed)
        return gen


def _derive_seed(seed, replica_id):
    """A well-mixed 63-bit seed for replica `replica_id`'s stream of `seed`."""
    ss = np.random.SeedSequence([seed & (2**64 - 1), int(replica_id), 0x64726F70])  # domain tag: "drop"
    return int(ss.generate_state(1, np.uint64)[0]) & (2**63 - 1)


class Sequential(Layer):
    """Chains layers: `layers[-1](...layers[0](x))`; `training` is passed to layers that take it.

    Args:
      layers: a list of layers (or any callables); more via `add`.
      name: see `Layer`.

    Source: tf.keras.Sequential.

    Example:
      >>> model = dtape.layers.Sequential([dtape.layers.Dense(8, "relu", input_dim=4),
      ...                                  dtape.layers.Dense(2)])
      >>> model(dtape.ones([3, 4])).shape
      torch.Size([3, 2])
    """

    def __init__(self, layers=None, name=None):
        super().__init__(name=name)
        self.layers = list(layers or [])
        self.built = True

    def add(self, layer):
        """Appends `layer`."""
        self.layers.append(layer)

    def __call__(self, x, training=False):
        for layer in self.layers:
            x = layer(x, training=training) if _takes_training(layer.__call__) else layer(x)
        return x


from dtape.torch_module import TorchModule  # noqa: F401  (re-export: dtape.layers.TorchModule)
