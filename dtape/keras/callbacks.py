"""`dtape.keras.callbacks`: `dtape.callbacks` under its Keras path (the same objects). Source: tf.keras.callbacks."""
from dtape.callbacks import *  # noqa: F401,F403
from dtape.callbacks import __all__  # noqa: F401  (every name of dtape.callbacks, none of its own)
