"""The base of dtape's Keras-style layers: `Layer`, activations and initializers by name, shared helpers.

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
from dtape import _restore_hooks
from dtape import nest
from dtape import nn as _nn
from dtape import regularizers as _regularizers
from dtape.module import Module
from dtape.ops import array_ops as _array
from dtape.ops import math_ops as _math
from dtape.tensor import Tensor, convert_to_tensor, is_variable
from dtape.tensor import as_dtype as _as_dtype
from dtape.variables import Variable, VariableAggregation, current_read_hook, read_hook_scope


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


def activation_name(fn):
    """The name `get_activation` knows `fn` by ("relu", ...), or None (a model's config stores the name)."""
    for name, known in _ACTIVATIONS.items():
        if known is fn:
            return name
    return None


_init_signatures = {}  # class -> inspect.Signature of its __init__ (for the constructor arguments)


class _Recorded:
    """Holds a layer's constructor arguments out of the module walk (a layer or variable among them is not one
    of this layer's children unless an attribute holds it)."""

    __slots__ = ("args",)

    def __init__(self, args):
        self.args = args


def _init_signature(cls):
    sig = _init_signatures.get(cls)
    if sig is None:
        sig = _init_signatures[cls] = inspect.signature(cls.__init__)
    return sig


def _init_parameters(cls):
    """The named parameters of `cls.__init__` (not its **kwargs)."""
    return {n for n, p in _init_signature(cls).parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}


def _constructor_args(cls, args, kwargs):
    """The arguments a layer was constructed with, by parameter name (what `get_config` returns by default)."""
    sig = _init_signature(cls)
    try:
        bound = sig.bind(None, *args, **kwargs)
    except TypeError:
        return None  # __init__ raises its own error
    params, found = sig.parameters, {}
    for name, value in list(bound.arguments.items())[1:]:
        kind = params[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            found.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                found["*" + name] = value
        else:
            found[name] = value
    return found


class _LayerMeta(type):
    """Records the constructor's arguments (the default `get_config`); builds the layer at the end of
    construction when `input_shape=` was given."""

    def __call__(cls, *args, **kwargs):
        # Keras's base Layer takes trainable= for every layer (`Dense(3, trainable=False)`): set after __init__
        # unless the layer's own __init__ names it
        trainable = kwargs.pop("trainable", None) if "trainable" not in _init_parameters(cls) else None
        layer = super().__call__(*args, **kwargs)
        if trainable is not None:
            layer.trainable = trainable
            kwargs = dict(kwargs, trainable=bool(trainable))
        vars(layer).setdefault("_constructor_args", _Recorded(_constructor_args(cls, args, kwargs)))
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
      trainable: False freezes the layer (see `trainable`); every layer's
        constructor takes it, as Keras's.

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

    def __init__(self, name=None, dtype=None, seed=None, input_shape=None, activity_regularizer=None, trainable=True):
        super().__init__(name=name)
        if not trainable:   # `super().__init__(trainable=False)` in a subclass, as Keras's Layer takes it
            vars(self)["_trainable"] = False
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

    def get_config(self):
        """The arguments that rebuild this layer with `from_config`: by default the constructor's arguments as
        given (recorded at construction), with `name` set to this layer's name. A dict of plain values, layers,
        activation functions and objects with a `get_config` (`dtape.models.save_model` serializes them).

        Override it (and `from_config`) when `__init__` takes what cannot be stored, as in Keras.
        Raises NotImplementedError for a layer constructed with extra positional arguments (*args).
        Source: tf.keras.layers.Layer.get_config.
        """
        recorded = vars(self).get("_constructor_args")
        args = None if recorded is None else recorded.args
        if args is None or any(k.startswith("*") for k in args):
            raise NotImplementedError(f"{type(self).__name__} cannot tell its constructor arguments; define "
                                      "get_config() returning them (and from_config if needed)")
        config = dict(args, name=self.name)
        if not self.trainable:  # frozen after construction: a saved model reloads frozen, as Keras's
            config["trainable"] = False
        else:
            config.pop("trainable", None)
        return config

    @property
    def trainable(self):
        """False once frozen: the layer's weights (and its sub-layers') are in `non_trainable_weights`, so
        `fit` and `optimizer.minimize(loss, model.trainable_variables)` leave them; a frozen
        BatchNormalization runs in inference mode (its moving statistics used and kept). Setting it sets
        every sub-layer's too (so `base_model.trainable = True` unfreezes all, as Keras's fine-tuning).
        Also a constructor argument of every layer (`Dense(3, trainable=False)`).
        Source: tf.keras.layers.Layer.trainable (Keras 2 / TF 2 BatchNormalization semantics)."""
        return vars(self).get("_trainable", True)

    @trainable.setter
    def trainable(self, value):
        for m in (self,) + self.submodules:
            if isinstance(m, Layer):
                vars(m)["_trainable"] = bool(value)

    def get_weights(self):
        """The values of `weights` (this layer's and its sub-layers' variables, in `weights` order) as a list
        of numpy arrays (copies). Source: tf.keras.layers.Layer.get_weights."""
        return [v.numpy().copy() for v in self.weights]

    def set_weights(self, weights):
        """Assigns a list of arrays (as `get_weights` returns) to `weights`, in order.

        Raises ValueError when the number of arrays or a shape differs from the
        layer's weights (nothing is assigned then). Source: tf.keras.layers.Layer.set_weights."""
        variables, weights = self.weights, list(weights)
        if len(weights) != len(variables):
            raise ValueError(f"{self.name}.set_weights: got {len(weights)} arrays for {len(variables)} weights "
                             f"{[v.name for v in variables]}; pass the list get_weights() returns")
        arrays = [np.asarray(w) for w in weights]
        for v, a in zip(variables, arrays):
            if tuple(a.shape) != tuple(v.shape):
                raise ValueError(f"{self.name}.set_weights: weight {v.name} has shape {tuple(v.shape)}, "
                                 f"got an array of shape {tuple(a.shape)}")
        for v, a in zip(variables, arrays):
            v.assign(a)  # cast to the variable's dtype

    @classmethod
    def from_config(cls, config):
        """`cls(**config)`: a new, unbuilt layer from `get_config()`'s dict. Source: tf.keras.layers.Layer.from_config."""
        return cls(**config)

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
                   aggregation=VariableAggregation.NONE, dtype=None):
        """Creates a variable `<layer>/<name>` of `shape`, its initial value drawn once where it is created.

        Keras 2 (`add_weight("kernel", shape=...)`) and Keras 3
        (`add_weight(shape=..., initializer=...)`) calls both work: without
        a name a weight is `<layer>/variable` (as Keras 3; names are labels,
        checkpoints match weights by position); shape None is a scalar;
        initializer None is "glorot_uniform".

        The value is given to `Variable` as a callable: inside `strategy.run`
        the strategy calls it once, in its merge_call on the caller's thread,
        so replica threads never draw (and never race on) initial values.
        `regularizer(variable)` is added to `losses`. dtype (torch dtype or name, Keras 3's argument): the
        variable's dtype instead of the layer's.
        """
        name = "variable" if name is None else name  # Keras 3's name for unnamed weights (not unique there either)
        init = get_initializer("glorot_uniform" if initializer is None else initializer)
        dtype = self.dtype if dtype is None else _as_dtype(dtype)
        shape, gen = () if shape is None else tuple(shape), self._generator
        var = Variable(lambda: init(shape, dtype, gen), trainable=trainable, name=f"{self.name}/{name}",
                       dtype=dtype, aggregation=aggregation)
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


def takes_training(fn):
    return _call_spec(fn).takes_training


def takes_mask(fn):
    return _call_spec(fn).takes_mask


def last_dim(input_shape, layer):
    if len(input_shape) == 0 or input_shape[-1] is None:
        raise ValueError(f"{layer.name}: the last input dimension must be known, got shape {tuple(input_shape)}")
    return int(input_shape[-1])


# -- layers ----------------------------------------------------------------------


def pair(v, what):
    pair = (int(v), int(v)) if isinstance(v, int) else tuple(int(i) for i in v)
    if len(pair) != 2 or min(pair) <= 0:
        raise ValueError(f"{what} must be a positive int or a pair of them, got {v!r}")
    return pair

def pool_out(size, k, stride, padding):
    """Output length of a window op along one axis (None stays None). TF: VALID floor, SAME ceil(size / stride)."""
    if size is None:
        return None
    if padding == "SAME":
        return -(-size // stride)
    return max((size - k) // stride + 1, 0)


def same_pads(size, k, stride):
    """TF "SAME" padding along one axis: (before, after), the extra one after."""
    total = max((pool_out(size, k, stride, "SAME") - 1) * stride + k - size, 0)
    return total // 2, total - total // 2


def padding_arg(padding, layer):
    if not isinstance(padding, str) or padding.lower() not in ("valid", "same"):
        raise ValueError(f"{layer} padding must be 'valid' or 'same', got {padding!r}")
    return padding.upper()


def channels_last(data_format, layer):
    if data_format not in (None, "channels_last"):
        raise ValueError(f"{layer}: only data_format='channels_last' (NHWC) is supported, got {data_format!r}; "
                         "transpose NCHW inputs with dtape.transpose(x, (0, 2, 3, 1))")

def check_rank(shape, rank, layer):
    if len(shape) != rank:
        raise ValueError(f"{layer.name}: {type(layer).__name__} expects inputs of rank {rank} "
                         f"([batch, height, width, channels]), got shape {tuple(shape)}")


Layer.build = _wrap_build(Layer.build)  # a plain Layer (no variables) is built by its first call too
