"""`dtape.keras.saving`: whole-model saving under its Keras 3 path (the objects of `dtape.saving` and
`dtape.models`). Source: keras.saving.
"""
from dtape.models import load_model
from dtape.saving import deserialize_keras_object, get_registered_object, register_keras_serializable, \
    serialize_keras_object

__all__ = ["load_model", "register_keras_serializable", "serialize_keras_object", "deserialize_keras_object",
           "get_registered_object"]
