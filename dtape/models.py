"""Keras's Model: the functional API (`Input`, layers called on symbolic inputs, `Model(inputs, outputs)`)
and subclassing (`class M(Model)` with layers as attributes and `call`).

A functional model records the graph of layer calls made on `Input`
placeholders (`dtape._keras_tensor`) and replays it, in topological order,
on real tensors: a layer used twice is one layer (one set of variables),
`training` reaches every layer through the call context, masks follow the
graph. A model is a `Layer`, so it can be called inside another model,
functional or subclassed, and is trained with `dtape.GradientTape` and a
strategy as any layer. Source: tf.keras.Model / tf.keras.Input (TF 2), keras.Model (Keras 3).
"""
import inspect
import math
import os

import torch

from dtape import _call_context
from dtape import _keras_tensor
from dtape import nest
from dtape import saving as _saving
from dtape import tape as _tp
from dtape import layers as _layers
from dtape.layers import Layer
from dtape.ops.array_ops import cast
from dtape.tensor import Tensor, as_dtype, convert_to_tensor, is_variable
from dtape.training import Trainer

__all__ = ["Input", "InputLayer", "Model", "Sequential", "load_model", "model_from_json"]

KerasTensor = _keras_tensor.KerasTensor


class InputLayer(Layer):
    """The layer behind `Input`: no variables; its output is the model's input, unchanged.

    Source: tf.keras.layers.InputLayer.
    """

    def __init__(self, shape=None, batch_size=None, dtype=None, name=None, input_shape=None):
        super().__init__(name=name)
        if (shape is None) == (input_shape is None):
            raise TypeError("InputLayer takes the sample shape as shape= (Keras 3) or input_shape= (Keras 2): one of "
                            f"them, got shape={shape!r}, input_shape={input_shape!r}")
        shape = shape if input_shape is None else input_shape
        try:
            shape = (batch_size,) + tuple(None if d is None else int(d) for d in shape)
        except (TypeError, ValueError):
            raise TypeError(f"Input shape must be a tuple of ints or None (without the batch), got {shape!r}") from None
        self.built = True
        self._output_shape = shape
        self.output = _keras_tensor.source_node(self, shape, as_dtype(dtype) or torch.float32, self.name)

    def get_config(self):
        """shape (without the batch), batch_size, dtype name, name. Source: tf.keras.layers.InputLayer.get_config."""
        return {"shape": list(self._output_shape[1:]), "batch_size": self._output_shape[0],
                "dtype": str(self.output.dtype).removeprefix("torch."), "name": self.name}

    def call(self, x):
        return x


def Input(shape, batch_size=None, dtype=None, name=None):
    """A symbolic input of a functional model: a `KerasTensor` of shape `(batch_size, *shape)`.

    Args:
      shape: a sample's shape, without the batch (None for a size known only
        at call time, e.g. `(None,)` for sequences of any length).
      batch_size: the batch size, or None (any).
      dtype: the input's dtype (torch dtype or name); default float32. Ids
        for an `Embedding` are "int64".
      name: the input layer's name (default `input_layer`, `input_layer_1`, ...);
        a dict of inputs given to the model may use these names as keys.

    Returns a KerasTensor (`shape`, `dtype`); layers called on it record a
    graph. Raises TypeError for a shape that is not a tuple of ints/None.
    Source: tf.keras.Input.
    """
    return InputLayer(shape, batch_size=batch_size, dtype=dtype, name=name).output


def _is_input(t):
    return isinstance(t, KerasTensor) and isinstance(t.node.layer, InputLayer)


class _GraphNode:
    """A node replayed by a functional model, with what it needs at call time computed once."""

    __slots__ = ("node", "takes_mask", "first_input")

    def __init__(self, node):
        self.node = node
        self.takes_mask = _call_takes(node.layer, "mask") and "mask" not in node.kwargs
        inputs = node.inputs
        self.first_input = inputs[0] if inputs else None


def _call_takes(layer, name):
    try:
        params = inspect.signature(layer.call).parameters
    except (TypeError, ValueError):
        return False
    return name in params


def _topological(outputs, inputs):
    """The nodes between `inputs` and `outputs`, each once, every node after the nodes it reads."""
    wanted = {id(t) for t in inputs}
    order, done, stack = [], set(), [(t, False) for t in reversed(outputs)]
    while stack:
        tensor, expanded = stack.pop()
        node = tensor.node
        if _is_input(tensor):
            if id(tensor) not in wanted:
                raise ValueError(f"Graph disconnected: the outputs depend on {tensor!r}, which is not among the "
                                 "model's inputs; pass it in Model(inputs=[...])")
            continue
        if id(node) in done:
            continue
        if expanded:
            done.add(id(node))
            order.append(node)
            continue
        stack.append((tensor, True))
        stack.extend((t, False) for t in reversed(node.inputs) if id(t.node) not in done)
    return order


class Model(Trainer, Layer):
    """A model: functional (`Model(inputs, outputs)`) or subclassed (`class M(Model)` defining `call`).

    Functional: `inputs` and `outputs` are KerasTensors (from `Input` and
    layers called on them), or lists or dicts of them; calling the model
    gives the outputs in the same structure, for inputs given as a tensor, a
    list in the order of `inputs`, or a dict keyed by the input names (or
    by `inputs`' keys). `layers` lists the input layers, then each layer
    once in the order of the graph; the variables follow that order.

    Subclassed: `super().__init__(name=...)`, layers assigned as attributes
    (tracked in assignment order: `trainable_variables` is the same order
    in every run), `call(self, inputs, training=None)`. `build(input_shape)`
    builds the sublayers by running `call` once on zeros (a batch of 1, not
    recorded); a subclass may override `build` to build them itself.

    Args:
      inputs, outputs: the functional model's placeholders (by position or keyword).
      name, dtype, seed: as `Layer`.

    Raises:
      ValueError: functional outputs that need an `Input` not in `inputs`
        ("Graph disconnected"); model inputs of the wrong number or names at call time.
      TypeError: functional `inputs` that are not `Input`s, `outputs` that are not KerasTensors.

    Source: tf.keras.Model.

    Example:
      >>> inputs = dtape.keras.Input(shape=(4,))
      >>> outputs = dtape.keras.layers.Dense(2)(dtape.keras.layers.Dense(8, "relu")(inputs))
      >>> model = dtape.keras.Model(inputs, outputs)
      >>> model.output_shape, model.count_params()
      ((None, 2), 58)
      >>> model(dtape.ones([3, 4])).shape
      torch.Size([3, 2])
    """

    def __init__(self, *args, **kwargs):
        inputs = kwargs.pop("inputs", args[0] if args else None)
        outputs = kwargs.pop("outputs", args[1] if len(args) > 1 else None)
        if len(args) > 2:
            raise TypeError(f"Model takes inputs and outputs by position, got {len(args)} positional arguments")
        super().__init__(**kwargs)
        self._graph = None
        if inputs is None and outputs is None:
            return
        if inputs is None or outputs is None:
            raise TypeError("a functional Model needs both inputs and outputs: Model(inputs, outputs)")
        self._init_graph(inputs, outputs)

    def _init_graph(self, inputs, outputs):
        flat_in, flat_out = nest.flatten(inputs), nest.flatten(outputs)
        bad = [t for t in flat_in if not _is_input(t)]
        if bad:
            raise TypeError(f"{self.name}: Model inputs must come from dtape.keras.Input(...), got {bad[0]!r}")
        bad = [t for t in flat_out if not isinstance(t, KerasTensor)]
        if bad:
            raise TypeError(f"{self.name}: Model outputs must be results of layers called on Inputs, got {bad[0]!r}")
        nodes = _topological(flat_out, flat_in)
        graph_layers = [t.node.layer for t in flat_in]
        for node in nodes:
            if not any(node.layer is seen for seen in graph_layers):
                graph_layers.append(node.layer)
        self._graph_layers = graph_layers  # first attribute holding layers: the variables' order
        self._graph = tuple(_GraphNode(n) for n in nodes)
        self._inputs_struct, self._outputs_struct = inputs, outputs
        self.inputs, self.outputs = flat_in, flat_out
        self.built = True
        self._build_shape = nest.map_structure(lambda t: t.shape, inputs)
        self._output_shape = nest.map_structure(lambda t: t.shape, outputs)

    # -- structure --------------------------------------------------------------------
    @property
    def layers(self):
        """The model's layers: functional, the input layers then the graph's layers (each once, in order);
        subclassed, the layers held by its attributes, in assignment order."""
        if self._graph is not None:
            return list(self._graph_layers)
        return [m for m in self._direct_layers() if isinstance(m, Layer)]

    @layers.setter
    def layers(self, value):
        raise AttributeError(f"{type(self).__name__}.layers is read-only (as Keras's): hold the layers in another "
                             "attribute, e.g. self.blocks = [...]")

    def _direct_layers(self):
        found = []
        for value in vars(self).values():
            for leaf in nest.flatten(value) if nest.is_nested(value) else [value]:
                if isinstance(leaf, Layer) and not any(leaf is f for f in found):
                    found.append(leaf)
        return found

    def get_layer(self, name=None, index=None):
        """The layer called `name` (or at `index` of `layers`). Raises ValueError if none. Source: tf.keras.Model.get_layer."""
        layers = self.layers
        if index is not None:
            return layers[index]
        for layer in layers:
            if layer.name == name:
                return layer
        raise ValueError(f"{self.name} has no layer named {name!r}; its layers: {[l.name for l in layers]}")

    @property
    def input(self):
        """The functional model's input KerasTensor(s), in the structure given."""
        return self._functional_attr("_inputs_struct")

    @property
    def output(self):
        """The functional model's output KerasTensor(s), in the structure given."""
        return self._functional_attr("_outputs_struct")

    def _functional_attr(self, attr):
        if self._graph is None:
            raise AttributeError(f"{self.name} is a subclassed model: it has no symbolic input/output")
        return getattr(self, attr)

    # -- saving --------------------------------------------------------------------
    def save(self, filepath, overwrite=True):
        """Writes the architecture and every variable to `filepath` (a zip: config.json and safetensors weights,
        see `dtape.saving`); `dtape.keras.models.load_model(filepath)` rebuilds it. Functional and Sequential
        models need nothing more; a subclassed one needs `get_config` (default: its constructor's arguments)
        and its class in `load_model(custom_objects=...)`. The optimizer is not stored.

        Raises FileExistsError with overwrite=False and an existing file; TypeError for a layer whose config
        cannot be stored; ValueError before the model is built. Source: tf.keras.Model.save.
        """
        if not overwrite and os.path.exists(filepath):
            raise FileExistsError(f"{filepath!r} exists and overwrite=False")
        return _saving.save_model(self, filepath)

    def load_weights(self, filepath):
        """Reads variables written by `save_weights` / ModelCheckpoint into this model (returns the load status);
        a whole model written by `save` / ModelCheckpoint("....keras") gives its weights too, as in Keras 3 (by
        position, shapes checked, the model built first; returns None). Source: tf.keras.Model.load_weights."""
        if _saving.is_model_archive(filepath):
            return _saving.load_archive_weights(self, filepath)
        return Trainer.load_weights(self, filepath)

    def to_json(self):
        """The architecture as JSON text (no weights); `dtape.keras.models.model_from_json` rebuilds it.
        Source: tf.keras.Model.to_json."""
        return _saving.serialize_model(self)

    def get_config(self):
        """Functional: the graph (layers, calls, inputs, outputs); subclassed: the constructor's arguments
        (override it when they cannot be stored). Source: tf.keras.Model.get_config."""
        if self._graph is not None:
            return _saving.functional_config(self)
        return super().get_config()

    def _dtape_model_config(self):
        if self._graph is not None:
            return {"class_name": "Functional", "config": self.get_config()}
        config = _saving.serialize_layer_config(self)
        return {"class_name": type(self).__name__, "config": config, "build_input_shape": _json_shape(
            self._build_shape)}

    # -- build ---------------------------------------------------------------------
    def build(self, input_shape):
        """Builds a subclassed model for inputs of `input_shape` (batch first; a list/dict for several inputs).

        Runs `call` once on zeros with the batch (None) set to 1, tape
        stopped, in inference mode, so every sublayer creates its
        variables. Raises ValueError when a size other than the batch is
        unknown (call the model on data instead). A functional model is
        built at construction. Source: tf.keras.Model.build.
        """
        if self._graph is not None:
            return
        zeros = _map_shapes(self._zeros_for, input_shape)
        with _tp.stop_recording(), torch.no_grad(), _call_context.training_scope(False):
            out = self.call(zeros)
        self._clear_losses()
        if hasattr(out, "shape"):
            self._output_shape = (None,) + tuple(out.shape[1:])

    def _maybe_build(self, input_shape):
        if type(self).build is Model.build:  # nothing to build first: the sublayers build on this call
            self.built = True
        else:  # the subclass's own build (Keras calls it before the first call)
            self.build(input_shape)

    def _zeros_for(self, shape):
        shape = tuple(shape)
        if any(d is None for d in shape[1:]):
            raise ValueError(f"{self.name}.build: only the batch size may be None, got {shape}; call the model "
                             "on a batch of data to build it for unknown sizes")
        return Tensor(torch.zeros((1 if shape and shape[0] is None else shape[0],) + shape[1:], dtype=self.dtype))

    def count_params(self):
        """The number of elements of all the model's variables (int). Raises ValueError before it is built.
        Source: tf.keras.Model.count_params."""
        self._check_built()
        return sum(math.prod(tuple(v.shape)) for v in self.variables)

    def summary(self, print_fn=None, line_length=80):
        """Prints (and returns) Keras's table: each layer's name (type), output shape, parameter count, then
        the totals (all, trainable, non-trainable). See `dtape.Module.summary` for the arguments.

        Raises ValueError before the model is built (as Keras). Source: tf.keras.Model.summary.
        """
        self._check_built()
        return super().summary(print_fn=print_fn, line_length=line_length)

    def _summary_rows(self):
        """Functional: each layer's output shape from the graph ("multiple" for a layer called with several)."""
        if self._graph is None:
            return super()._summary_rows()
        shapes = {}
        for graph_node in self._graph:
            shapes.setdefault(id(graph_node.node.layer), set()).add(_shape_text(graph_node.node.outputs))
        rows = []
        for layer in self.layers:
            texts = shapes.get(id(layer)) or {_shape_text(getattr(layer, "output", None))}
            count = sum(math.prod(tuple(v.shape)) for v in layer.variables)
            rows.append((f"{layer.name} ({type(layer).__name__})", texts.pop() if len(texts) == 1 else "multiple",
                         count))
        return rows

    def _check_built(self):
        if not self.built:
            raise ValueError(f"{self.name} has not been built yet: call build(input_shape) or call the model on "
                             "a batch of data first")

    # -- call -----------------------------------------------------------------------
    def call(self, inputs, training=None, mask=None):
        """Functional: replays the recorded graph on `inputs` (training reaches the layers through the call
        context). Subclasses override it."""
        if self._graph is None:
            raise NotImplementedError(f"{type(self).__name__} must define call(inputs), or be built as "
                                      "Model(inputs, outputs)")
        values, masks = {}, {}
        for t, value, m in zip(self.inputs, self._flat_inputs(inputs), self._flat_masks(mask)):
            values[id(t)], masks[id(t)] = _as_input(value, t), m
        for graph_node in self._graph:
            self._run_node(graph_node, values, masks)
        self.note_output_masks([values[id(t)] for t in self.outputs], [masks.get(id(t)) for t in self.outputs])
        return nest.map_structure(lambda t: values[id(t)], self._outputs_struct)

    def _run_node(self, graph_node, values, masks):
        node = graph_node.node
        args, kwargs = nest.map_structure(lambda t: values[id(t)] if isinstance(t, KerasTensor) else t,
                                          [list(node.args), node.kwargs])
        first = graph_node.first_input
        in_mask = None if first is None else masks.get(id(first))
        if graph_node.takes_mask and in_mask is not None:
            kwargs["mask"] = in_mask
        out = node.layer(*args, **kwargs)
        out_masks = _output_masks(node.layer, args, out, in_mask)
        for t, value, m in zip(nest.flatten(node.outputs), nest.flatten(out), out_masks):
            values[id(t)], masks[id(t)] = value, m

    def _convert_input(self, x):
        if self._graph is None:
            return super()._convert_input(x)
        return x if isinstance(x, Tensor) or is_variable(x) else convert_to_tensor(x)  # cast per Input in call

    def _flat_inputs(self, inputs):
        """The call's inputs in the order of `self.inputs`."""
        struct, n = self._inputs_struct, len(self.inputs)
        if isinstance(inputs, dict) and not isinstance(struct, dict):
            missing = [t.name for t in self.inputs if t.name not in inputs]
            if missing:
                raise ValueError(f"{self.name}: inputs given as a dict miss {missing}; keys: {sorted(inputs)}")
            return [inputs[t.name] for t in self.inputs]
        flat = nest.flatten(inputs) if nest.is_nested(struct) else [inputs]
        if len(flat) != n:
            raise ValueError(f"{self.name} expects {n} input(s) {[t.name for t in self.inputs]}, got {len(flat)}")
        return flat

    def _flat_masks(self, mask):
        if mask is None:
            return [None] * len(self.inputs)
        flat = nest.flatten(mask) if nest.is_nested(self._inputs_struct) else [mask]
        if len(flat) != len(self.inputs):
            raise ValueError(f"{self.name}: {len(flat)} mask(s) for {len(self.inputs)} input(s)")
        return flat


class Sequential(Trainer, _layers.Sequential):
    """`dtape.layers.Sequential` with Keras's training API (`compile`, `fit`, `evaluate`, `predict`: see
    `dtape.training`), as `tf.keras.Sequential` is a Model. Everything else is `dtape.layers.Sequential`'s.

    Build it before `fit` under a strategy (a first layer given `input_shape=`, an `Input` first, or
    `build(input_shape)`), so its variables are made in the strategy's scope. Source: tf.keras.Sequential.
    """

    save, to_json, load_weights = Model.save, Model.to_json, Model.load_weights

    def add(self, layer):
        """`dtape.layers.Sequential.add`; an `InputLayer` first (Keras 2's `InputLayer(input_shape=...)`) gives
        the input shape as an `Input` does."""
        super().add(layer.output if isinstance(layer, InputLayer) else layer)

    def get_config(self):
        """The layers' configs, in order, and the name. Source: tf.keras.Sequential.get_config."""
        return {"name": self.name, "layers": [_saving.serialize_layer(layer) for layer in self.layers]}

    def _dtape_model_config(self):
        return {"class_name": "Sequential", "config": self.get_config(),
                "build_input_shape": _json_shape(self._build_shape if self.built else None)}

    def call(self, x, training=False, mask=None):
        out, out_mask = self.call_with_mask(x, training, mask)
        self.note_output_masks([out], [out_mask])  # the compiled loss and metrics weigh by it, as Keras
        return out


def _as_input(value, placeholder):
    """A model input as a Tensor of its `Input`'s dtype (Keras casts floating inputs to it)."""
    if not isinstance(value, Tensor) and not is_variable(value):
        return convert_to_tensor(value, dtype=placeholder.dtype)
    if value.dtype != placeholder.dtype and value.dtype.is_floating_point and placeholder.dtype.is_floating_point:
        return cast(value, placeholder.dtype)
    return value


def _output_masks(layer, args, out, in_mask):
    """The masks of a layer's outputs: its `compute_mask`, else the input's mask when it `supports_masking`
    (Keras's propagation), else none."""
    n = len(nest.flatten(out))
    if hasattr(layer, "compute_mask"):
        masks = layer.compute_mask(args[0] if len(args) == 1 else args, in_mask)
        return nest.flatten(masks) if nest.is_nested(masks) else [masks] * n
    return [in_mask if getattr(layer, "supports_masking", False) else None] * n


def _shape_text(outputs):
    """"(None, 784)" for one KerasTensor, "[(None, 2), (None, 1)]" for several, "?" for none."""
    if isinstance(outputs, KerasTensor):
        dims = ["None" if d is None else str(d) for d in outputs.shape]
        return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"
    if nest.is_nested(outputs):
        return "[" + ", ".join(_shape_text(t) for t in nest.flatten(outputs)) + "]"
    return "?"


def _map_shapes(fn, shape):
    """`fn` on one shape, or on each shape of a list/tuple/dict of them (several inputs)."""
    if isinstance(shape, dict):
        return {k: _map_shapes(fn, v) for k, v in shape.items()}
    if isinstance(shape, (list, tuple)) and any(isinstance(d, (list, tuple, dict)) for d in shape):
        return type(shape)(_map_shapes(fn, d) for d in shape)
    return fn(shape)


def _json_shape(shape):
    return _saving.to_json_value(shape, "the build shape")


def _load_spec(spec, objects):
    """A model from its saved spec: functional, Sequential or a subclass (its class in custom_objects)."""
    name, config, shape = spec["class_name"], spec["config"], spec.get("build_input_shape")
    if name == "Functional":
        return _saving.functional_from_config(config, objects, Model)
    if name == "Sequential":
        model = Sequential([_saving.deserialize_layer(s, objects) for s in config["layers"]], name=config["name"])
    else:
        model = _saving.find_class(name, objects).from_config(_saving.from_json_value(config, objects))
    if shape is not None:
        model.build(_tuple_shape(shape))
    return model


def _tuple_shape(shape):
    if isinstance(shape, list) and all(d is None or isinstance(d, int) for d in shape):
        return tuple(shape)
    if isinstance(shape, dict):
        return {k: _tuple_shape(v) for k, v in shape.items()}
    return type(shape)(_tuple_shape(d) for d in shape)


_saving.set_model_loader(_load_spec)


def load_model(filepath, custom_objects=None, compile=True):  # noqa: A002  (Keras's argument name)
    """The model `Model.save(filepath)` wrote: architecture rebuilt, variables filled (inside
    `strategy.scope()`: that strategy's variables, e.g. MirroredVariables).

    Args:
      filepath: the archive's path.
      custom_objects: `{class_name: class}` for layers and models not in dtape (a subclassed model, custom layers).
      compile: accepted for Keras's signature; the compile arguments are not stored, so compile the model
        before fit/evaluate (as TF's tutorials do after load_model).

    Raises ValueError for a file that is not such an archive, an unknown class (the message says to pass it in
    custom_objects) or variables that do not match. Source: tf.keras.models.load_model.
    """
    return _saving.load_model(filepath, _load_spec, dict(custom_objects or {}, InputLayer=InputLayer))


def model_from_json(json_string, custom_objects=None):
    """The (unbuilt-weights) model of `Model.to_json()`: fresh variables. Source: tf.keras.models.model_from_json."""
    return _saving.deserialize_model(json_string, _load_spec, dict(custom_objects or {}, InputLayer=InputLayer))
