"""`dtape.keras.initializers`: the initializers layers use, under the Keras path (the same objects).

`get` is `dtape.layers.get_initializer` (a name such as "glorot_uniform" or
"truncated_normal", an `Initializer`, or a callable `f(shape, dtype)` ->
the function layers call); the classes are `dtape.layers`' (`GlorotUniform`,
`RandomNormal(mean, stddev, seed)`, `TruncatedNormal`, `Constant(value)`, ...).
Source: tf.keras.initializers.
"""
from dtape.layers import (Constant, GlorotUniform, HeNormal, HeUniform, Initializer, Ones, RandomNormal,
                          RandomUniform, TruncatedNormal, Zeros)
from dtape.layers import get_initializer as get

__all__ = ["get", "Initializer", "Constant", "GlorotUniform", "HeNormal", "HeUniform", "Ones", "RandomNormal",
           "RandomUniform", "TruncatedNormal", "Zeros"]
