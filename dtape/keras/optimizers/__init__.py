"""`dtape.keras.optimizers`: `dtape.optimizers` under its Keras path (the same objects), with `schedules`
and `LossScaleOptimizer` (Keras 3 names it here too).

Source: tf.keras.optimizers / keras.optimizers (Keras 3).
"""
from dtape.optimizers import *  # noqa: F401,F403
from dtape.optimizers import __all__ as _optimizers_all
from dtape.mixed_precision import LossScaleOptimizer
from dtape.keras.optimizers import schedules

__all__ = sorted(set(_optimizers_all) | {"LossScaleOptimizer", "schedules"})
