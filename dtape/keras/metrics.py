"""`dtape.keras.metrics`: `dtape.metrics` under its Keras path (the same objects). Source: tf.keras.metrics."""
from dtape.metrics import *  # noqa: F401,F403
from dtape.metrics import __all__  # noqa: F401  (every name of dtape.metrics, none of its own)
