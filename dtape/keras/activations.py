"""`dtape.keras.activations`: the activation functions layers take by name, under their Keras path.

Each name is dtape's own op (`relu is dtape.nn.relu`, `sigmoid is
dtape.sigmoid`, ...) and `get` is `dtape.layers.get_activation` (a name, a
callable or None -> a function). Source: tf.keras.activations.
"""
from dtape.layers import get_activation as get
from dtape.nn import elu, gelu, leaky_relu, log_softmax, relu, relu6, silu, softmax, softplus
from dtape.ops.math_ops import sigmoid, tanh

linear = get("linear")  # the very function Dense(activation=None) applies

__all__ = ["get", "linear", "elu", "gelu", "leaky_relu", "log_softmax", "relu", "relu6", "silu", "softmax",
           "softplus", "sigmoid", "tanh"]
