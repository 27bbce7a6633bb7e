"""`dtape.keras.layers`: the layers of `dtape.layers` under their Keras names (the same objects).

Source: tf.keras.layers.
"""
from dtape.layers import *  # noqa: F401,F403
from dtape.layers import __all__ as _layers_all
from dtape.models import Input, InputLayer
from dtape.torch_module import TorchModule

__all__ = list(_layers_all) + ["Input", "InputLayer", "TorchModule"]
