"""dtape.math: the `tf.math` names of the ops dtape has.

Each name is the op itself (`dtape.math.reduce_sum is dtape.reduce_sum`),
not a copy, so `import dtape.math as tfm` or `dtape.math.log1p(x)` in a
ported script runs the same recorded op. Source: tf.math.
"""
from dtape.ops.math_ops import (  # noqa: F401
    abs, add, add_n, argmax, argmin, cos, divide, equal, exp, floordiv, floormod, greater, greater_equal, less,
    less_equal, log, log1p, logical_and, logical_not, logical_or, logical_xor, maximum, minimum, multiply, negative,
    not_equal, pow, reduce_logsumexp, reduce_max, reduce_mean, reduce_min, reduce_prod, reduce_sum, rsqrt, sigmoid,
    sign, sin, sqrt, square, subtract, tanh)
from dtape.ops.nn_ops import log_softmax, softmax, softplus  # noqa: F401  (tf.math has them too)

__all__ = ["abs", "add", "add_n", "argmax", "argmin", "cos", "divide", "equal", "exp", "floordiv", "floormod",
           "greater", "greater_equal", "less", "less_equal", "log", "log1p", "log_softmax", "logical_and",
           "logical_not", "logical_or", "logical_xor", "maximum", "minimum", "multiply", "negative", "not_equal",
           "pow", "reduce_logsumexp", "reduce_max", "reduce_mean", "reduce_min", "reduce_prod", "reduce_sum",
           "rsqrt", "sigmoid", "sign", "sin", "softmax", "softplus", "sqrt", "square", "subtract", "tanh"]
