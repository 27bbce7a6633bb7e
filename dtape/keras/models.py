"""`dtape.keras.models`: `Model`, `Sequential`, `Input`, `load_model`, `model_from_json` (the objects of
`dtape.models`).

Source: tf.keras.models.
"""
from dtape.models import Input, InputLayer, Model, Sequential, load_model, model_from_json

__all__ = ["Input", "InputLayer", "Model", "Sequential", "load_model", "model_from_json"]
