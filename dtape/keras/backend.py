"""`dtape.keras.backend`: Keras's `get_value` / `set_value` (the same objects as `dtape.variables`').

Source: tf.keras.backend.
"""
from dtape.variables import get_value, set_value

__all__ = ["get_value", "set_value"]
