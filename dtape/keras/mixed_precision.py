"""`dtape.keras.mixed_precision`: `dtape.mixed_precision` under its Keras path (the same objects).

Source: tf.keras.mixed_precision.
"""
from dtape.mixed_precision import *  # noqa: F401,F403
from dtape.mixed_precision import __all__  # noqa: F401  (every name of dtape.mixed_precision, none of its own)
