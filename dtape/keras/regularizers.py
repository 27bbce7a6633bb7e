"""`dtape.keras.regularizers`: `dtape.regularizers` under its Keras path (the same objects).

Source: tf.keras.regularizers.
"""
from dtape.regularizers import *  # noqa: F401,F403
from dtape.regularizers import __all__  # noqa: F401  (every name of dtape.regularizers, none of its own)
