"""Keras-style layers built on dtape ops.

Dense, Conv2D, Embedding, LayerNormalization, BatchNormalization, Dropout,
MaxPooling2D, AveragePooling2D, GlobalAveragePooling2D, GlobalMaxPooling2D,
Flatten, Reshape, Sequential.

Each layer is a `Module`; its variables are made with `dtape.Variable` when it
is built (on the first call, or at construction when the input size is given),
so a strategy's `scope()` turns them into distributed variables. Initial
values are drawn once, where the variable is created, from a
`torch.Generator` seeded by the layer's `seed` (or from torch's global
generator, seeded by `torch.manual_seed`, when `seed` is None). The initial
value is passed to `Variable` as a callable, so a layer built lazily inside
`strategy.run` draws it once, in the strategy's merge_call on the caller's
thread: creation is deterministic and equals building the layer outside.

A layer is built by its first call, by `build(input_shape)` (shapes with
None for unknown sizes, e.g. the batch), or at construction from
`input_shape=` (without the batch dimension, as Keras) or a layer's own
size argument (`input_dim=`, `input_channels=`).

Source: tf.keras.layers.
"""
import contextlib
import functools
import inspect
import math
import threading
import weakref

import numpy as np
import torch

from dtape import _keras_tensor
from dtape import _policy
from dtape import _call_context
from dtape import _replica_info
from dtape import _restore_hooks
from dtape import nest
from dtape import nn as _nn
from dtape import random as _random
from dtape import regularizers as _regularizers
from dtape import tape as _tp
from dtape.custom_gradient import custom_gradient
from dtape.module import Module
from dtape.ops import array_ops as _array
from dtape.ops import math_ops as _math
from dtape.tensor import Tensor, convert_to_tensor, is_variable
from dtape.variables import Variable, VariableAggregation, current_read_hook, read_hook_scope

__all__ = ["Layer", "Dense", "Conv2D", "Embedding", "LayerNormalization", "BatchNormalization", "Dropout",
           "MaxPooling2D", "AveragePooling2D", "GlobalAveragePooling2D", "GlobalMaxPooling2D", "Flatten", "Reshape",
           "Sequential", "Activation", "get_activation", "get_initializer"]


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


class Initializer:
    """Base of the Keras initializer classes: `init(shape, dtype=None, generator=None) -> torch.Tensor`.

    Layers call it with their dtype and generator (their `seed=`, or torch's
    global generator). dtype None is float32. An initializer made with
    `seed=` draws from its own generator seeded with it at every call, so
    each call gives the same values (as Keras's seeded initializers).
    Pass one as `kernel_initializer=` (or call it). Source: tf.keras.initializers.
    """

    seed = None

    def __call__(self, shape, dtype=None, generator=None):
        if self.seed is not None:
            generator = torch.Generator().manual_seed(self.seed)
        return self._draw(tuple(shape), torch.float32 if dtype is None else dtype, generator)

    def _draw(self, shape, dtype, gen):
        raise NotImplementedError(f"{type(self).__name__} must define _draw(shape, dtype, generator)")


def _seed(seed):
    return None if seed is None else int(seed)


class Zeros(Initializer):
    """All zeros. Source: tf.keras.initializers.Zeros."""

    def _draw(self, shape, dtype, gen):
        return torch.zeros(shape, dtype=dtype)


class Ones(Initializer):
    """All ones. Source: tf.keras.initializers.Ones."""

    def _draw(self, shape, dtype, gen):
        return torch.ones(shape, dtype=dtype)


class Constant(Initializer):
    """All `value`. Source: tf.keras.initializers.Constant."""

    def __init__(self, value=0.0):
        self.value = float(value)

    def _draw(self, shape, dtype, gen):
        return torch.full(shape, self.value, dtype=dtype)


class RandomNormal(Initializer):
    """Normal(mean, stddev). Source: tf.keras.initializers.RandomNormal."""

    def __init__(self, mean=0.0, stddev=0.05, seed=None):
        self.mean, self.stddev, self.seed = float(mean), float(stddev), _seed(seed)

    def _draw(self, shape, dtype, gen):
        t = torch.randn(shape, dtype=dtype, generator=gen) * self.stddev
        return t + self.mean if self.mean else t


class RandomUniform(Initializer):
    """Uniform on [minval, maxval). Source: tf.keras.initializers.RandomUniform."""

    def __init__(self, minval=-0.05, maxval=0.05, seed=None):
        self.minval, self.maxval, self.seed = float(minval), float(maxval), _seed(seed)

    def _draw(self, shape, dtype, gen):
        half, mid = (self.maxval - self.minval) / 2, (self.maxval + self.minval) / 2
        t = (torch.rand(shape, dtype=dtype, generator=gen) * 2 - 1) * half
        return t + mid if mid else t


class TruncatedNormal(Initializer):
    """Normal(mean, stddev), values beyond 2 stddev from the mean redrawn. Source: tf.keras.initializers.TruncatedNormal."""

    def __init__(self, mean=0.0, stddev=0.05, seed=None):
        self.mean, self.stddev, self.seed = float(mean), float(stddev), _seed(seed)

    def _draw(self, shape, dtype, gen):
        lo, hi = self.mean - 2 * self.stddev, self.mean + 2 * self.stddev
        return torch.nn.init.trunc_normal_(torch.empty(shape, dtype=dtype), self.mean, self.stddev, lo, hi,
                                           generator=gen)


class GlorotUniform(Initializer):
    """Uniform on +-sqrt(6 / (fan_in + fan_out)). Source: tf.keras.initializers.GlorotUniform."""

    def __init__(self, seed=None):
        self.seed = _seed(seed)

    def _draw(self, shape, dtype, gen):
        fan_in, fan_out = _fans(shape)
        limit = math.sqrt(6.0 / (fan_in + fan_out))
        return (torch.rand(shape, dtype=dtype, generator=gen) * 2 - 1) * limit


class HeNormal(Initializer):
    """Normal(0, sqrt(2 / fan_in)) (not truncated, unlike Keras's). Source: tf.keras.initializers.HeNormal."""

    def __init__(self, seed=None):
        self.seed = _seed(seed)

    def _draw(self, shape, dtype, gen):
        return torch.randn(shape, dtype=dtype, generator=gen) * math.sqrt(2.0 / _fans(shape)[0])


class HeUniform(Initializer):
    """Uniform on +-sqrt(6 / fan_in). Source: tf.keras.initializers.HeUniform."""

    def __init__(self, seed=None):
        self.seed = _seed(seed)

    def _draw(self, shape, dtype, gen):
        limit = math.sqrt(6.0 / _fans(shape)[0])
        return (torch.rand(shape, dtype=dtype, generator=gen) * 2 - 1) * limit


_INITIALIZERS = {
    "glorot_uniform": GlorotUniform(),
    "he_normal": HeNormal(),
    "he_uniform": HeUniform(),
    "random_normal": RandomNormal(),
    "random_uniform": RandomUniform(),
    "truncated_normal": TruncatedNormal(),
    "zeros": Zeros(),
    "ones": Ones(),
}


def get_initializer(initializer):
    """An initializer `f(shape, dtype, generator) -> torch.Tensor` from a name or a callable.

    A name gives the `Initializer` instance (`"glorot_uniform"` ->
    `GlorotUniform()`, `"truncated_normal"` -> `TruncatedNormal()`, ...). A
    callable (an `Initializer`, or a function) may also take just `(shape, dtype)`.

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

def _shape_tuple(shape):
    """A shape as a tuple of ints and Nones (unknown sizes)."""
    if isinstance(shape, int):
        shape = (shape,)
    try:
        return tuple(None if d is None else int(d) for d in shape)
    except (TypeError, ValueError):
        raise TypeError(f"a shape must be a tuple of ints or None, got {shape!r}") from None


def _shape_struct(shape):
    """`_shape_tuple` of one shape, or of each shape in a list/tuple/dict of them (a layer with nested inputs)."""
    if isinstance(shape, dict):
        return {k: _shape_struct(v) for k, v in shape.items()}
    if isinstance(shape, (list, tuple)) and any(isinstance(d, (list, tuple, dict)) for d in shape):
        shapes = [_shape_struct(d) for d in shape]
        return shapes if isinstance(shape, list) else tuple(shapes)
    return _shape_tuple(shape)


def _wrap_build(build):
    """A subclass's `build`: runs once (later calls do nothing), then marks the layer built."""
    @functools.wraps(build)
    def wrapper(self, input_shape):
        if self.built:
            return
        build(self, _shape_struct(input_shape))
        self.built = True
        _restore_hooks.variables_created(self)   # values a checkpoint restored before the build fill them now
        if getattr(self, "_build_shape", None) is None:
            self._build_shape = _shape_struct(input_shape)
    wrapper._dtape_wrapped = True
    return wrapper


class _LayerMeta(type):
    """Builds a layer at the end of construction when `input_shape=` was given."""

    def __call__(cls, *args, **kwargs):
        layer = super().__call__(*args, **kwargs)
        shape = vars(layer).get("_input_shape_arg")
        if shape is not None and not layer.built:
            layer.build((None,) + shape)
            layer._output_shape = layer.compute_output_shape((None,) + shape)
        return layer


_regularized_lock = threading.Lock()  # guards Layer._regularized (rare: at build)


class _CallState(threading.local):
    depth = 0


_call_state = _CallState()


class Layer(Module, metaclass=_LayerMeta):
    """Base class: builds its variables on first call (or `build(shape)`), then runs `call`.

    Subclasses define `build(input_shape)` (create variables with
    `self.add_weight`; it runs once and sets `built`) and `call(x)` or
    `call(x, training=False)` (more inputs and keyword arguments allowed).
    Layers called inside `call` get this call's `training` unless given
    their own (Keras's call context; see `__call__`).

    Args:
      name: module name (default: the snake-cased class name, made unique).
      dtype: the layer's dtype policy: a floating dtype (torch dtype or name,
        e.g. "float32": variables and computation in it), "mixed_float16" or
        "mixed_bfloat16" (variables float32, computation in the 16-bit
        dtype: floating inputs are cast to it and, inside `call`, the
        layer's variables are read in it; gradients reach them in float32),
        or a `dtape.mixed_precision.Policy`; None: the global policy
        (`dtape.mixed_precision.set_global_policy`, "float32" by default).
        Sets `dtype` (the variables' torch dtype), `compute_dtype` and
        `dtype_policy`. Source: tf.keras.layers.Layer(dtype=...).
      seed: int seed of this layer's initializers; None draws from torch's
        global generator (`torch.manual_seed`).
      input_shape: the input's shape without the batch dimension (Keras);
        when given the layer is built at construction for (None, *input_shape).
      activity_regularizer: None, a name ("l1", "l2") or a callable; its
        value on the output is added to `losses` at each call.

    Losses added during a call (`add_loss`, activity regularizers) are kept
    per thread and cleared when the next top-level layer call starts on it.
    Source: tf.keras.layers.Layer.
    """

    _autocast = True  # under a mixed policy, `call` reads the layer's variables in the compute dtype

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        build = cls.__dict__.get("build")
        if build is not None and not getattr(build, "_dtape_wrapped", False):
            cls.build = _wrap_build(build)

    def __init__(self, name=None, dtype=None, seed=None, input_shape=None, activity_regularizer=None):
        super().__init__(name=name)
        self.dtype_policy = _policy.get(dtype)
        self.dtype, self.compute_dtype = self.dtype_policy.variable_dtype, self.dtype_policy.compute_dtype
        self.built = False
        self._generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self._input_shape_arg = None if input_shape is None else _shape_tuple(input_shape)
        self._build_shape = None
        self._output_shape = None
        self._regularized = []  # (variable, regularizer) pairs, for `losses`
        self.activity_regularizer = _regularizers.get(activity_regularizer)

    def build(self, input_shape):
        """Creates the variables for inputs of `input_shape` (a tuple, None for unknown sizes).

        Runs once: later calls do nothing. Source: tf.keras.layers.Layer.build.
        """

    def compute_output_shape(self, input_shape):
        """The output shape for `input_shape`, or None when this layer cannot tell without a call."""
        return None

    @property
    def output_shape(self):
        """The output shape (batch first, None for unknown sizes) of the last build, call or symbolic call.

        Raises AttributeError before any. Source: tf.keras.layers.Layer.output_shape.
        """
        if self._output_shape is None:
            raise AttributeError(f"{self.name} has not been built or called yet, so its output shape is unknown; "
                                 "give the first layer input_shape=, call build(), or call it on an input")
        return self._output_shape

    def call(self, x):
        raise NotImplementedError(f"{type(self).__name__} must define call(x)")

    def add_weight(self, name=None, shape=None, initializer="glorot_uniform", trainable=True, regularizer=None,
                   aggregation=VariableAggregation.NONE):
        """Creates a variable `<layer>/<name>` of `shape`, its initial value drawn once where it is created.

        Keras 2 (`add_weight("kernel", shape=...)`) and Keras 3
        (`add_weight(shape=..., initializer=...)`) calls both work: without
        a name a weight is `<layer>/variable` (as Keras 3; names are labels,
        checkpoints match weights by position); shape None is a scalar;
        initializer None is "glorot_uniform".

        The value is given to `Variable` as a callable: inside `strategy.run`
        the strategy calls it once, in its merge_call on the caller's thread,
        so replica threads never draw (and never race on) initial values.
        `regularizer(variable)` is added to `losses`.
        """
        name = "variable" if name is None else name  # Keras 3's name for unnamed weights (not unique there either)
        init = get_initializer("glorot_uniform" if initializer is None else initializer)
        shape, dtype, gen = () if shape is None else tuple(shape), self.dtype, self._generator
        var = Variable(lambda: init(shape, dtype, gen), trainable=trainable, name=f"{self.name}/{name}",
                       dtype=self.dtype, aggregation=aggregation)
        if self.dtype_policy.is_mixed and self._autocast:
            _autocast_variables(var)
        regularizer = _regularizers.get(regularizer)
        if regularizer is not None:
            # A layer built lazily inside strategy.run is built by every replica thread, and every
            # replica gets the same variable back: register it once.
            with _regularized_lock:
                if not any(v is var for v, _ in self._regularized):
                    self._regularized.append((var, regularizer))
        return var

    def _maybe_build(self, input_shape):
        if not self.built:
            self.build(input_shape)

    def _convert_leaf(self, x):
        """A torch.Tensor or numpy array among the inputs as a Tensor (as `_convert_input`); other values as they are."""
        return self._convert_input(x) if isinstance(x, (torch.Tensor, np.ndarray)) else x

    def _convert_input(self, x):
        if not isinstance(x, Tensor) and not is_variable(x):
            x = convert_to_tensor(x, dtype=self.compute_dtype if _is_float_like(x) else None)
        elif self.dtype_policy.casts_input(x.dtype):  # Keras casts floating inputs to the compute dtype
            x = _array.cast(x, self.compute_dtype)
        return x

    def _autocast_scope(self):
        """Inside `call` of a mixed-policy layer: its variables are read in the compute dtype (Keras's AutoCast)."""
        if not self.dtype_policy.is_mixed:
            return _NO_SCOPE
        return read_hook_scope(_autocast_reads(self.compute_dtype, current_read_hook()))

    def __call__(self, *args, training=None, mask=None, **kwargs):
        """Applies the layer: `call(x, *more, training=, mask=, **kwargs)`.

        x: Tensor, Variable, torch.Tensor, array or nested list of numbers
        (converted to a Tensor; its shape builds the layer), or a tuple/list/
        dict holding tensors (each converted; `build` gets their shapes in
        the same structure). More positional inputs (e.g.
        `call(self, x, context)`) and keyword arguments go to `call` as they
        are (torch.Tensors and numpy arrays become Tensors).
        training: True/False for this call; None (default) takes the mode of
        the enclosing layer call on this thread, else the default of `call`'s
        `training` parameter (Keras's call context). It is passed to `call`
        when `call` names it, and reaches the layers called inside either way.
        Given by position where `call` has it (`layer(x, True)`), it counts
        as given.
        mask: passed to `call` when given; a `call` without a `mask`
        parameter raises TypeError.
        Source: tf.keras.layers.Layer.__call__.
        """
        if not args:
            raise TypeError(f"{self.name}: call the layer with its input, e.g. layer(x), got no positional argument")
        spec = _call_spec(self.call)
        positional = spec.training_position is not None and len(args) > spec.training_position
        if positional:  # layer(x, True) with call(self, x, training=False): the argument given by position
            training = args[spec.training_position] if training is None else training
            args = args[:spec.training_position] + args[spec.training_position + 1:]
        if _keras_tensor.holds_symbolic(args, kwargs, mask):  # functional API: record, compute nothing
            # training by position is taken out above, so the shape probe (run in inference) never sees it
            given = {k: v for k, v in (("training", training), ("mask", mask)) if v is not None}
            return _keras_tensor.record_call(self, args, dict(kwargs, **given))
        training = _call_context.resolve_training(training, spec.training_default)
        if spec.takes_training and (training is not None or positional):
            kwargs["training"] = training
        if mask is not None:
            if not spec.takes_mask:
                raise TypeError(f"{self.name}: mask= was given but {type(self).__name__}.call has no `mask` "
                                "parameter; add `mask=None` to call() or do not pass a mask")
            kwargs["mask"] = mask
        top = _call_state.depth == 0
        if top:
            self._clear_losses()
        _call_state.depth += 1
        try:
            x, more = args[0], args[1:]
            if _holds_tensors(x):  # call(self, inputs) with `context, x = inputs` (Keras's nested inputs)
                x = nest.map_structure(self._convert_leaf, x)
                self._maybe_build(nest.map_structure(lambda t: tuple(t.shape), x))
            else:
                x = self._convert_input(x)
                self._maybe_build(tuple(x.shape))
            more = tuple(self._convert_leaf(a) for a in more)
            with _call_context.training_scope(training), self._autocast_scope():
                out = self.call(x, *more, **kwargs)
        finally:
            _call_state.depth -= 1
        if self.activity_regularizer is not None:
            self.add_loss(self.activity_regularizer(out))
        if hasattr(out, "shape"):
            self._output_shape = (None,) + tuple(out.shape[1:]) if len(out.shape) else ()
        return out


# ids of the variables mixed-policy layers made: read in the compute dtype inside a mixed layer's `call`.
# An id leaves the set when its variable dies (before the id can be reused). By id, not a WeakSet: a
# variable's == is elementwise. Components of a distributed variable are what reads see.
_autocast_ids = set()
_autocast_lock = threading.Lock()
_NO_SCOPE = contextlib.nullcontext()


def _autocast_variables(var):
    for component in getattr(var, "values", None) or (var,):
        with _autocast_lock:
            if id(component) in _autocast_ids:  # built inside strategy.run: every replica gets this variable
                continue
            _autocast_ids.add(id(component))
        weakref.finalize(component, _forget_autocast, id(component)).atexit = False


def _forget_autocast(key):
    with _autocast_lock:
        _autocast_ids.discard(key)


def _autocast_reads(dtype, prev):
    """A read hook casting the registered floating variables to `dtype` (after an enclosing hook)."""
    def hook(variable, value):
        if prev is not None:
            value = prev(variable, value)
        if value.is_floating_point() and value.dtype != dtype and id(variable) in _autocast_ids:
            return value.to(dtype)
        return value
    return hook


def _is_tensor_like(x):
    return isinstance(x, (Tensor, torch.Tensor, np.ndarray)) or is_variable(x)


def _holds_tensors(x):
    """A list/tuple/dict with a tensor or array among its leaves (not a nested list of numbers)."""
    return isinstance(x, (list, tuple, dict)) and any(_is_tensor_like(leaf) for leaf in nest.flatten(x))


def _is_float_like(x):
    t = torch.as_tensor(x) if not isinstance(x, torch.Tensor) else x
    return t.is_floating_point()


class _CallSpec:
    """What a `call` signature takes: `training` (and its default), `mask`."""

    __slots__ = ("takes_training", "training_default", "training_position", "takes_mask")

    def __init__(self, params, bound):
        training = params.get("training")
        self.takes_training = training is not None
        positional = [name for name, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        # Index of `training` among the call's inputs (a bound method's self excluded).
        self.training_position = positional.index("training") - bound if "training" in positional else None
        # No default (or None): None is resolved, `call` gets its own default and inner layers theirs (Keras).
        self.training_default = None if training is None or training.default is inspect.Parameter.empty \
            else training.default
        self.takes_mask = "mask" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _call_spec(fn):
    bound = int(hasattr(fn, "__func__"))
    fn = getattr(fn, "__func__", fn)
    try:
        return _function_call_spec(fn, bound)
    except TypeError:  # an unhashable callable: not cached
        return _function_call_spec.__wrapped__(fn, bound)


@functools.lru_cache(maxsize=4096)  # per function, not per call: inspect.signature is slow
def _function_call_spec(fn, bound):
    try:
        return _CallSpec(inspect.signature(fn).parameters, bound)
    except (TypeError, ValueError):
        return _CallSpec({}, bound)


def _takes_training(fn):
    return _call_spec(fn).takes_training


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
        in_dim = _last_dim(input_shape, self)
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
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.strides = _pair(strides, "strides")
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
        shape = self.kernel_size + (_last_dim(input_shape, self), self.filters)
        self.kernel = self.add_weight("kernel", shape, self.kernel_initializer, regularizer=self.kernel_regularizer)
        if self.use_bias:
            self.bias = self.add_weight("bias", (self.filters,), "zeros", regularizer=self.bias_regularizer)

    def compute_output_shape(self, input_shape):
        hw = [_pool_out(d, k, s, self.padding) for d, k, s in zip(input_shape[1:3], self.kernel_size, self.strides)]
        return (input_shape[0], *hw, self.filters)

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
      embeddings_regularizer: None, "l1"/"l2" or a callable (penalty in `losses`).
      name, dtype, seed, input_shape, activity_regularizer: see `Layer`.

    Variables: `embeddings` [input_dim, output_dim], created at construction.
    Source: tf.keras.layers.Embedding.
    """

    _input_dtype = torch.int64

    def __init__(self, input_dim, output_dim, embeddings_initializer="random_uniform", name=None,
                 dtype=None, seed=None, embeddings_regularizer=None, activity_regularizer=None,
                 input_shape=None):
        super().__init__(name=name, dtype=dtype, seed=seed, input_shape=input_shape,
                         activity_regularizer=activity_regularizer)
        self.input_dim, self.output_dim = int(input_dim), int(output_dim)
        self.embeddings = self.add_weight("embeddings", (self.input_dim, self.output_dim),
                                          embeddings_initializer, regularizer=embeddings_regularizer)
        self.built = True

    def _convert_input(self, ids):
        return ids if isinstance(ids, Tensor) else convert_to_tensor(ids, dtype=torch.int64)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.output_dim,)

    def call(self, ids):
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

    _autocast = False  # a mixed policy keeps gamma and beta in float32: 16-bit inputs, float32 statistics

    def __init__(self, epsilon=1e-3, input_dim=None, name=None, dtype=None, seed=None, input_shape=None):
        super().__init__(name=name, dtype=dtype, seed=seed, input_shape=input_shape)
        self.epsilon = float(epsilon)
        if input_dim is not None:
            self._maybe_build((None, int(input_dim)))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def build(self, input_shape):
        d = _last_dim(input_shape, self)
        self.gamma = self.add_weight("gamma", (d,), "ones")
        self.beta = self.add_weight("beta", (d,), "zeros")

    def call(self, x):
        return _nn.layer_norm(x, self.gamma, self.beta, epsilon=self.epsilon)


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
    with `training=True`, or with `training` left None inside a layer call
    made with `training=True` (Keras's call context; see `Layer.__call__`).
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

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def __call__(self, x, training=None):
        if isinstance(x, _keras_tensor.KerasTensor):  # functional API: record, compute nothing
            return _keras_tensor.record_call(self, (x,), {} if training is None else {"training": training})
        x = x if isinstance(x, Tensor) or is_variable(x) else convert_to_tensor(x)
        if not _call_context.resolve_training(training, False) or self.rate == 0.0:
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


# -- pooling, reshaping ---------------------------------------------------------

def _pool_out(size, k, stride, padding):
    """Output length of a window op along one axis (None stays None). TF: VALID floor, SAME ceil(size / stride)."""
    if size is None:
        return None
    if padding == "SAME":
        return -(-size // stride)
    return max((size - k) // stride + 1, 0)


def _same_pads(size, k, stride):
    """TF "SAME" padding along one axis: (before, after), the extra one after."""
    total = max((_pool_out(size, k, stride, "SAME") - 1) * stride + k - size, 0)
    return total // 2, total - total // 2


def _padding_arg(padding, layer):
    if not isinstance(padding, str) or padding.lower() not in ("valid", "same"):
        raise ValueError(f"{layer} padding must be 'valid' or 'same', got {padding!r}")
    return padding.upper()


def _channels_last(data_format, layer):
    if data_format not in (None, "channels_last"):
        raise ValueError(f"{layer}: only data_format='channels_last' (NHWC) is supported, got {data_format!r}; "
                         "transpose NCHW inputs with dtape.transpose(x, (0, 2, 3, 1))")


class _Pooling2D(Layer):
    """Window reduction over NHWC images (the reduction in `_pool`)."""

    def __init__(self, pool_size=(2, 2), strides=None, padding="valid", data_format=None, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        _channels_last(data_format, type(self).__name__)
        self.pool_size = _pair(pool_size, "pool_size")
        self.strides = self.pool_size if strides is None else _pair(strides, "strides")
        self.padding = _padding_arg(padding, type(self).__name__)

    def compute_output_shape(self, input_shape):
        _check_rank(input_shape, 4, self)
        hw = [_pool_out(d, k, st, self.padding) for d, k, st in zip(input_shape[1:3], self.pool_size, self.strides)]
        return (input_shape[0], *hw, input_shape[3])

    def call(self, x):
        _check_rank(x.shape, 4, self)
        nchw = _array.transpose(x, (0, 3, 1, 2))
        pads = (0, 0, 0, 0)
        if self.padding == "SAME":
            (top, bottom), (left, right) = (_same_pads(d, k, st) for d, k, st in
                                            zip(x.shape[1:3], self.pool_size, self.strides))
            pads = (left, right, top, bottom)
        return _array.transpose(self._pool(nchw, pads), (0, 2, 3, 1))


def _check_rank(shape, rank, layer):
    if len(shape) != rank:
        raise ValueError(f"{layer.name}: {type(layer).__name__} expects inputs of rank {rank} "
                         f"([batch, height, width, channels]), got shape {tuple(shape)}")


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
        _channels_last(data_format, type(self).__name__)
        self.keepdims = bool(keepdims)

    def compute_output_shape(self, input_shape):
        _check_rank(input_shape, 4, self)
        return (input_shape[0], 1, 1, input_shape[3]) if self.keepdims else (input_shape[0], input_shape[3])

    def call(self, x):
        _check_rank(x.shape, 4, self)
        return self._reduce(x, axis=(1, 2), keepdims=self.keepdims)


class GlobalAveragePooling2D(_GlobalPooling2D):
    """Mean over height and width: [batch, h, w, c] -> [batch, c] ([batch, 1, 1, c] with keepdims).

    Source: tf.keras.layers.GlobalAveragePooling2D.
    """

    _reduce = staticmethod(_math.reduce_mean)


class GlobalMaxPooling2D(_GlobalPooling2D):
    """Max over height and width: [batch, h, w, c] -> [batch, c]. Source: tf.keras.layers.GlobalMaxPooling2D."""

    _reduce = staticmethod(_math.reduce_max)


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


class Flatten(Layer):
    """Flattens all but the batch axis: [batch, d1, d2, ...] -> [batch, d1 * d2 * ...] ([batch] -> [batch, 1]).

    Source: tf.keras.layers.Flatten.
    """

    def __init__(self, data_format=None, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        _channels_last(data_format, "Flatten")

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

def _local_moments(x, axes):
    """Mean and (population) variance of x over `axes`, and the example count (a Python int).

    An empty x (count 0) gets zeros, not NaN: its output is empty anyway, and
    finite statistics keep its gradient contributions (to gamma, beta) zero.
    """
    count = math.prod(x.shape[a] for a in axes)
    if count == 0:
        zeros = Tensor(torch.zeros([x.shape[a] for a in range(x.ndim) if a not in axes], dtype=x.dtype,
                                   device=x.device))
        return zeros, zeros, 0
    mean, var = _nn.moments(x, axes)
    return mean, var, count


def _sync_moments(x, axes, ctx):
    """Mean and (population) variance of x over `axes` and over every replica's x (one all-reduce), and the count.

    Keras 3's synchronized formula: sums of x and x^2 and the count are
    all-reduced (SUM), mean = sum / count, var = max(sum_sq / count - mean^2, 0).
    The gradient is exact for the global batch: each replica's cotangents of
    mean and var are all-reduced too (the transpose of the all-reduce), so
    summing the replicas' gradients equals one device on the whole batch.
    Every replica must then compute gradients (tape.gradient) in step.
    A replica with an empty batch adds zeros; an empty global batch gives
    mean = var = 0 (count 0), not NaN. The count is a Python int on one
    replica, else the all-reduced scalar Tensor (identical on every replica).
    """
    replicas = 1 if ctx is None else ctx.num_replicas_in_sync
    counted = []

    @custom_gradient
    def moments(x):
        count = float(math.prod(x.shape[a] for a in axes))
        sums = [_math.reduce_sum(x, axis=axes), _math.reduce_sum(x * x, axis=axes),
                Tensor(torch.tensor(count, dtype=x.dtype, device=x.device))]
        if replicas > 1:
            sums = ctx.all_reduce("sum", sums)
        counted.append(sums[2] if replicas > 1 else int(count))
        total = _math.maximum(sums[2], 1.0)  # an empty global batch: zeros, not 0 / 0
        mean = sums[0] / total
        var = _math.maximum(sums[1] / total - mean * mean, 0.0)

        def grad(dmean, dvar):
            if replicas > 1:
                dmean, dvar = ctx.all_reduce("sum", [dmean, dvar])
            return (dmean + 2.0 * dvar * (x - mean)) / total
        return (mean, var), grad
    mean, var = moments(x)
    return mean, var, counted[0]


class BatchNormalization(Layer):
    """Normalises with batch statistics in training and moving statistics in inference.

    training=True: mean, var = moments of x over every axis but `axis`
    (population variance); y = gamma * (x - mean) / sqrt(var + epsilon) + beta;
    moving_mean = momentum * moving_mean + (1 - momentum) * mean, likewise
    moving_variance with var (Keras: the biased variance; torch's BatchNorm
    uses the unbiased one and momentum = 1 - Keras momentum).
    training=False: the moving statistics instead of the batch's.

    Under a strategy: with synchronized=True the statistics are those of the
    global batch (sums all-reduced across replicas, as PyTorch's
    SyncBatchNorm), so 2 replicas compute what one device computes on the
    whole batch, gradients included (every replica must call tape.gradient
    in step). With synchronized=False each replica uses its own batch. The
    moving statistics are non-trainable variables with aggregation MEAN,
    updated with the same value on every replica so the mirrored copies stay
    identical: the global batch's statistics (synchronized=True), or the
    replicas' statistics weighted by their example counts (False; the
    moving mean is then the global batch's mean).
    An empty batch (API.md: a short or empty last batch on some replicas)
    gives an empty output, zero gradients to gamma and beta, and no NaN; it
    adds nothing to the moving statistics, which stay unchanged when the
    whole (global) batch is empty.

    Args:
      axis: the feature axis (default -1, channels last).
      momentum: of the moving statistics (0.99).
      epsilon: added to the variance (1e-3).
      center, scale: use beta / gamma.
      beta_initializer, gamma_initializer, moving_mean_initializer,
        moving_variance_initializer: names or callables.
      synchronized: batch statistics across replicas (Keras 3 name).
      name, dtype, seed, input_shape: see `Layer`.

    Variables: `gamma`, `beta` [d] (trainable), `moving_mean`,
    `moving_variance` [d] (non-trainable). Shapes: x [..., d, ...] -> same.
    Source: tf.keras.layers.BatchNormalization (Keras 3, synchronized=).
    """

    _autocast = False  # a mixed policy keeps gamma, beta and the moving statistics in float32, as Keras

    def __init__(self, axis=-1, momentum=0.99, epsilon=1e-3, center=True, scale=True, beta_initializer="zeros",
                 gamma_initializer="ones", moving_mean_initializer="zeros", moving_variance_initializer="ones",
                 synchronized=False, name=None, dtype=None, seed=None, input_shape=None,
                 beta_regularizer=None, gamma_regularizer=None):
        super().__init__(name=name, dtype=dtype, seed=seed, input_shape=input_shape)
        self.axis, self.momentum, self.epsilon = int(axis), float(momentum), float(epsilon)
        if not 0.0 <= self.momentum <= 1.0 or not self.epsilon > 0:
            raise ValueError(f"BatchNormalization needs 0 <= momentum <= 1 and epsilon > 0, got "
                             f"momentum={momentum}, epsilon={epsilon}")
        self.center, self.scale, self.synchronized = bool(center), bool(scale), bool(synchronized)
        self._inits = (beta_initializer, gamma_initializer, moving_mean_initializer, moving_variance_initializer)
        self._regs = (beta_regularizer, gamma_regularizer)

    def _feature_axis(self, rank):
        axis = self.axis + rank if self.axis < 0 else self.axis
        if not 0 <= axis < rank:
            raise ValueError(f"{self.name}: axis {self.axis} is out of range for inputs of rank {rank}")
        return axis

    def build(self, input_shape):
        axis = self._feature_axis(len(input_shape))
        d = input_shape[axis]
        if d is None:
            raise ValueError(f"{self.name}: the feature axis {self.axis} must be known, got shape {input_shape}")
        beta_init, gamma_init, mean_init, var_init = self._inits
        if self.scale:
            self.gamma = self.add_weight("gamma", (d,), gamma_init, regularizer=self._regs[1])
        if self.center:
            self.beta = self.add_weight("beta", (d,), beta_init, regularizer=self._regs[0])
        self.moving_mean = self.add_weight("moving_mean", (d,), mean_init, trainable=False,
                                           aggregation=VariableAggregation.MEAN)
        self.moving_variance = self.add_weight("moving_variance", (d,), var_init, trainable=False,
                                               aggregation=VariableAggregation.MEAN)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def call(self, x, training=False):
        in_dtype = x.dtype
        if in_dtype in (torch.float16, torch.bfloat16):  # statistics of 16-bit inputs in float32 (Keras)
            x = _array.cast(x, torch.float32)
        rank = x.ndim
        axis = self._feature_axis(rank)
        axes = [a for a in range(rank) if a != axis]
        if training:
            ctx = _replica_info.replica_context()
            if self.synchronized:
                mean, var, count = _sync_moments(x, axes, ctx)
            else:
                mean, var, count = _local_moments(x, axes)
            self._update_moving(mean, var, count, ctx)
        else:
            mean, var = self.moving_mean, self.moving_variance
        shape = [1] * rank
        shape[axis] = -1
        inv = _math.rsqrt(_array.reshape(var, shape) + self.epsilon)
        if self.scale:
            inv = inv * _array.reshape(self.gamma, shape)
        y = (x - _array.reshape(mean, shape)) * inv
        y = y + _array.reshape(self.beta, shape) if self.center else y
        return y if x.dtype == in_dtype else _array.cast(y, in_dtype)  # 16-bit in: 16-bit out

    def _update_moving(self, mean, var, count, ctx):
        """moving = momentum * moving + (1 - momentum) * stat, each replica weighted by its example count.

        `count` is this replica's (synchronized=False) or the global batch's
        (synchronized=True, stats already global) number of examples. Across
        replicas, synchronized=False all-reduces (SUM) count * stat and count,
        so the update uses the count-weighted mean of the replicas' statistics
        (an empty replica adds nothing) and every replica writes the same value.
        No examples in total: no update (skipped at once when the count is a
        Python number, else the update keeps the old value, so every replica
        still makes the same assign calls).
        """
        with _tp.stop_recording():
            dtype = self.moving_mean.dtype
            mean, var = mean.torch().to(dtype), var.torch().to(dtype)
            replicas = 1 if ctx is None else ctx.num_replicas_in_sync
            count = count.torch() if isinstance(count, Tensor) else count
            if not self.synchronized and replicas > 1:
                n = torch.tensor(float(count), dtype=dtype, device=mean.device)
                sums = ctx.all_reduce("sum", [Tensor(mean * n), Tensor(var * n), Tensor(n)])
                count = sums[2].torch()
                mean, var = (t.torch() / torch.clamp(count, min=1.0) for t in sums[:2])
            if isinstance(count, (int, float)) and count == 0:
                return
            m = self.momentum
            for moving, batch in ((self.moving_mean, mean), (self.moving_variance, var)):
                old = moving.torch()
                new = old * m + batch.to(old.device) * (1.0 - m)
                if isinstance(count, torch.Tensor):
                    new = torch.where(count.to(old.device) > 0, new, old)
                moving.assign(Tensor(new))


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

    def call(self, x, training=False):
        for layer in self.layers:
            x = layer(x, training=training) if _takes_training(layer.__call__) else layer(x)
        return x


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


Layer.build = _wrap_build(Layer.build)  # a plain Layer (no variables) is built by its first call too

from dtape.torch_module import TorchModule  # noqa: F401  (re-export: dtape.layers.TorchModule)
