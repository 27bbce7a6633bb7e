"""dtape.nn: activations, cross-entropies, conv2d, dropout, moments (tf.nn names)."""
from dtape.ops.nn_ops import *  # noqa: F401,F403
from dtape.ops.nn_ops import __all__  # noqa: F401
