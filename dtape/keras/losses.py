"""`dtape.keras.losses`: `dtape.losses` under its Keras path (the same objects). Source: tf.keras.losses."""
from dtape.losses import *  # noqa: F401,F403
from dtape.losses import __all__  # noqa: F401  (every name of dtape.losses, none of its own)
