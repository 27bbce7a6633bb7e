"""`dtape.keras.optimizers.schedules`: dtape's learning-rate schedules under their Keras path (the same objects).

Source: tf.keras.optimizers.schedules.
"""
from dtape.optimizers_schedules import *  # noqa: F401,F403
from dtape.optimizers_schedules import __all__  # noqa: F401  (every schedule, none of its own)
