"""Whole-model saving: `Model.save(path)` and `dtape.keras.models.load_model(path)` (a `.keras`-style archive).

The archive is a zip holding `config.json` (the architecture: each layer's
class name and `get_config()`, a functional model's graph of calls, a
Sequential's layers, a subclassed model's constructor config and build
shape), `metadata.json` and `model.weights.safetensors` (every variable of
`model.variables`, in that order, as safetensors). Loading rebuilds the
model from the config (layers found in `dtape.layers`, then
`custom_objects`), builds it, and assigns the stored values by position,
checking each shape. Inside `strategy.scope()` the rebuilt variables are
that strategy's (MirroredVariables), as any variables made there.
The optimizer and compile arguments are not stored: compile the loaded
model (TF's tutorials do so). Source: tf.keras.Model.save / keras.models.load_model
(Keras 3's `.keras` format: zip of config.json and weights; weights here in safetensors, not HDF5).
"""
import inspect
import json
import os
import zipfile

import numpy as np
import safetensors.numpy
import torch

from dtape import _keras_tensor
from dtape import layers as _layers
from dtape import nest
from dtape import regularizers as _regularizers
from dtape.layers import base as _base

__all__ = ["register_keras_serializable", "serialize_keras_object", "deserialize_keras_object",
           "get_registered_object", "save_model", "load_model", "is_model_archive", "load_archive_weights", "serialize_model", "deserialize_model", "serialize_layer", "deserialize_layer",
           "serialize_layer_config", "functional_config", "functional_from_config", "find_class", "to_json_value",
           "from_json_value", "set_model_loader"]

_FORMAT = "dtape-keras-1"


# -- registered objects ---------------------------------------------------------------------------------------
_registered = {}  # "package>name" and the bare name -> a class or function registered by the decorator


def register_keras_serializable(package="Custom", name=None):
    """Decorator: registers a class or function so that saved models find it by name without custom_objects
    (as `"<package>><name>"`, and by its bare name). Returns the object unchanged.

    Source: keras.saving.register_keras_serializable.
    """
    def register(obj):
        key = f"{package}>{name or obj.__name__}"
        if key in _registered and _registered[key] is not obj:
            raise ValueError(f"{key!r} is already registered to {_registered[key]!r}")
        _registered[key] = _registered[obj.__name__] = obj
        obj._dtape_registered_name = key
        return obj
    return register


def get_registered_object(name, custom_objects=None):
    """The object registered (or in `custom_objects`) under `name`, else None. Source: keras.saving."""
    return (custom_objects or {}).get(name, _registered.get(name))


def serialize_keras_object(obj):
    """A layer as `{"class_name", "config"}`; other values as stored in configs. Source: keras.saving."""
    return serialize_layer(obj) if isinstance(obj, _base.Layer) else to_json_value(obj, repr(obj))


def deserialize_keras_object(config, custom_objects=None):
    """The layer (or value) of `serialize_keras_object`'s result. Source: keras.saving.deserialize_keras_object."""
    objects = dict(custom_objects or {})
    if isinstance(config, dict) and "class_name" in config and "config" in config:
        return deserialize_layer(config, objects)
    return from_json_value(config, objects)


# -- values in configs ---------------------------------------------------------------------------------------
def to_json_value(value, where):
    """A config value as JSON: plain values as they are, layers / objects with get_config as tagged dicts."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [to_json_value(v, where) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: to_json_value(v, where) for k, v in value.items()}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, _base.Layer):
        return {"__layer__": serialize_layer(value)}
    if hasattr(value, "get_config"):
        return {"__object__": type(value).__name__, "config": to_json_value(value.get_config(), where)}
    if callable(value) and _base.activation_name(value) is not None:
        return _base.activation_name(value)
    if isinstance(value, dict) and value.get("class_name") and "config" in value:  # serialize_keras_object's
        return value
    if callable(value) and not isinstance(value, type) and getattr(value, "__name__", "<lambda>") != "<lambda>":
        return {"__function__": getattr(value, "_dtape_registered_name", value.__name__)}
    if isinstance(value, _base.Initializer):
        return {"__object__": type(value).__name__, "config": to_json_value(_init_config(value), where)}
    raise TypeError(f"cannot save {where}: its config holds {value!r} ({type(value).__name__}), which is neither a "
                    "plain value, a layer, a known activation nor an object with get_config(); give that layer "
                    "a get_config() returning storable arguments")


def _init_config(obj):
    """An initializer's constructor arguments, read back from its attributes of the same names."""
    params = list(inspect.signature(type(obj).__init__).parameters)[1:]
    return {p: getattr(obj, p) for p in params if hasattr(obj, p)}


def from_json_value(value, objects):
    if isinstance(value, list):
        return [from_json_value(v, objects) for v in value]
    if not isinstance(value, dict):
        return value
    if "__dtype__" in value:
        return getattr(torch, value["__dtype__"])
    if "__function__" in value:
        return find_class(value["__function__"], objects)
    if "__layer__" in value:
        return deserialize_layer(value["__layer__"], objects)
    if "__object__" in value:
        return find_class(value["__object__"], objects)(**from_json_value(value["config"], objects))
    return {k: from_json_value(v, objects) for k, v in value.items()}


def find_class(class_name, objects):
    for source in (objects, _registered, vars(_layers), vars(_regularizers)):
        if class_name in source:
            return source[class_name]
    raise ValueError(f"unknown class {class_name!r} in the saved model: pass it in custom_objects="
                     f"{{'{class_name}': {class_name}}} to load_model")


# -- layers and models ---------------------------------------------------------------------------------------
def serialize_layer_config(layer):
    """A layer's `get_config()` as JSON values."""
    return to_json_value(layer.get_config(), f"layer {layer.name!r}")


def serialize_layer(layer):
    """`{"class_name", "config"}` of a layer (a model: its architecture, see the module docstring)."""
    if hasattr(layer, "_dtape_model_config"):
        return layer._dtape_model_config()
    return {"class_name": type(layer).__name__, "config": serialize_layer_config(layer)}


def set_model_loader(loader):
    """`dtape.models` gives the function that rebuilds models (functional, Sequential, subclassed)."""
    global _model_loader
    _model_loader = loader


_model_loader = None


def deserialize_layer(spec, objects):
    """The layer (or model) of `serialize_layer`'s dict, unbuilt unless it is a model."""
    if spec["class_name"] in ("Functional", "Sequential") or "build_input_shape" in spec:
        return _model_loader(spec, objects)
    cls = find_class(spec["class_name"], objects)
    return cls.from_config(from_json_value(spec["config"], objects))


def functional_config(model):
    """A functional model's graph: its layers (each once), the calls in order, the inputs and outputs."""
    layers, nodes, refs = list(model.layers), [], {}
    layer_index = {id(layer): i for i, layer in enumerate(layers)}

    def ref(t):
        if isinstance(t, _keras_tensor.KerasTensor):
            return {"__tensor__": refs[id(t)]}
        return to_json_value(t, f"a call argument in {model.name!r}")

    for t in model.inputs:
        refs[id(t)] = [len(nodes), 0]
        nodes.append({"layer": layer_index[id(t.node.layer)], "args": [], "kwargs": {}})
    for graph_node in model._graph:
        node = graph_node.node
        entry = {"layer": layer_index[id(node.layer)], "args": nest.map_structure(ref, list(node.args)),
                 "kwargs": {k: nest.map_structure(ref, v) for k, v in node.kwargs.items()}}
        for i, t in enumerate(nest.flatten(node.outputs)):
            refs[id(t)] = [len(nodes), i]
        nodes.append(entry)
    return {"name": model.name, "layers": [serialize_layer(layer) for layer in layers], "nodes": nodes,
            "inputs": nest.map_structure(ref, model._inputs_struct),
            "outputs": nest.map_structure(ref, model._outputs_struct)}


def functional_from_config(config, objects, model_cls):
    """Rebuilds a functional model: the layers from their configs, then each recorded call on KerasTensors."""
    layers = [deserialize_layer(spec, objects) for spec in config["layers"]]
    outputs = []

    def value(v):
        if isinstance(v, dict) and "__tensor__" in v:
            node, index = v["__tensor__"]
            return outputs[node][index]
        if isinstance(v, dict):
            return {k: value(x) for k, x in v.items()}
        if isinstance(v, list):
            return [value(x) for x in v]
        return from_json_value(v, objects)

    for entry in config["nodes"]:
        layer = layers[entry["layer"]]
        if not entry["args"] and hasattr(layer, "output"):  # an input layer: its KerasTensor
            outputs.append([layer.output])
            continue
        out = layer(*value(entry["args"]), **value(entry["kwargs"]))
        outputs.append(nest.flatten(out))
    return model_cls(value(config["inputs"]), value(config["outputs"]), name=config["name"])


# -- the archive ---------------------------------------------------------------------------------------------
def serialize_model(model):
    """The JSON text of a model's architecture (`Model.to_json`)."""
    return json.dumps(serialize_layer(model))


def save_model(model, filepath):
    """Writes `model` (architecture and variables) to the zip archive `filepath`; returns the path.

    Raises TypeError when a layer's config holds a value that cannot be stored (the message names the layer),
    ValueError for a model not yet built (no variables to store).
    """
    filepath = os.fspath(filepath)
    if not model.built:
        raise ValueError(f"{model.name} is not built: call it on data or build(input_shape) before save()")
    config = serialize_model(model)
    variables = list(model.variables)
    arrays = {f"{i:05d}": np.array(v.numpy(), order="C") for i, v in enumerate(variables)}  # 0-d stays 0-d
    metadata = {"format": _FORMAT, "names": [v.name for v in variables]}
    weights = safetensors.numpy.save(arrays, metadata={"names": json.dumps(metadata["names"])}) if arrays else b""
    if os.path.dirname(filepath):
        os.makedirs(os.path.dirname(filepath), exist_ok=True)
    with zipfile.ZipFile(filepath, "w") as archive:
        archive.writestr("config.json", config)
        archive.writestr("metadata.json", json.dumps(metadata))
        archive.writestr("model.weights.safetensors", weights)
    return filepath


def deserialize_model(text, loader, custom_objects=None):
    """The model of `serialize_model`'s JSON (unbuilt parts stay unbuilt; no weights)."""
    set_model_loader(loader)
    return deserialize_layer(json.loads(text), dict(custom_objects or {}))


def load_model(filepath, loader, custom_objects=None):
    """Rebuilds the model saved at `filepath` and fills its variables (by position, shapes checked).

    Raises ValueError for a file that is not such an archive, an unknown class (name it in custom_objects),
    or stored variables that do not match the rebuilt model's (count or shapes).
    """
    filepath = os.fspath(filepath)
    config, metadata, arrays = _read_archive(filepath)
    model = deserialize_model(config, loader, custom_objects)
    _assign(model, [arrays[k] for k in sorted(arrays)], metadata["names"], filepath)
    return model


def is_model_archive(filepath):
    """True for a file written by `save_model` (a zip archive; Keras 3's `.keras` files are zips too)."""
    return os.path.isfile(filepath) and zipfile.is_zipfile(filepath)


def load_archive_weights(model, filepath):
    """Assigns the variables stored in the `save_model` archive `filepath` to the built `model`'s (by position,
    shapes checked; Keras 3's `model.load_weights("m.keras")`). Raises ValueError as `load_model`."""
    filepath = os.fspath(filepath)
    _, metadata, arrays = _read_archive(filepath)
    if not model.built:
        raise ValueError(f"{model.name} is not built: call it on data or build(input_shape) before loading the "
                         f"weights of {filepath!r}")
    _assign(model, [arrays[k] for k in sorted(arrays)], metadata["names"], filepath)


def _read_archive(filepath):
    """(config JSON text, metadata, {key: array}) of a `save_model` archive; ValueError for another file."""
    if not zipfile.is_zipfile(filepath):
        raise ValueError(f"{filepath!r} is not a model saved by Model.save (a zip archive); for weights written "
                         "by save_weights use model.load_weights(path)")
    with zipfile.ZipFile(filepath) as archive:
        config = archive.read("config.json").decode()
        metadata = json.loads(archive.read("metadata.json"))
        blob = archive.read("model.weights.safetensors")
    if metadata.get("format") != _FORMAT:
        raise ValueError(f"{filepath!r}: unknown format {metadata.get('format')!r}, expected {_FORMAT!r}")
    return config, metadata, (safetensors.numpy.load(blob) if blob else {})


def _assign(model, values, names, filepath):
    variables = list(model.variables)
    if len(variables) != len(values):
        raise ValueError(f"{filepath!r} stores {len(values)} variables but the rebuilt model has {len(variables)}; "
                         "the layers' configs do not rebuild the same model (check get_config)")
    for var, value, name in zip(variables, values, names):
        if tuple(var.shape) != tuple(value.shape):
            raise ValueError(f"{filepath!r}: stored variable {name!r} has shape {tuple(value.shape)}, the rebuilt "
                             f"{var.name!r} has {tuple(var.shape)}")
        var.assign(torch.from_numpy(np.array(value)).to(var.dtype))
