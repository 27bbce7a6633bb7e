"""`dtape.keras.models`: `Model`, `Sequential`, `Input` (the objects of `dtape.models`).

Source: tf.keras.models.
"""
from dtape.models import Input, InputLayer, Model, Sequential

__all__ = ["Input", "InputLayer", "Model", "Sequential"]
