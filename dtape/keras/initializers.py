"""`dtape.keras.initializers`: how layers take initial values, under the Keras path.

`get` is `dtape.layers.get_initializer`: a name ("glorot_uniform",
"he_normal", "he_uniform", "random_normal", "random_uniform", "zeros",
"ones") or a callable `f(shape, dtype)` / `f(shape, dtype, generator)`
returning a torch.Tensor gives the function layers call. Pass these to
`kernel_initializer=` and friends. Keras's initializer classes
(`GlorotUniform()`, `RandomNormal(stddev=...)`) are not defined by dtape:
use the name, or a callable for other parameters, e.g.
`lambda shape, dtype: 0.02 * torch.randn(shape, dtype=dtype)`.
Source: tf.keras.initializers.get.
"""
from dtape.layers import get_initializer as get

__all__ = ["get"]
