"""dtape.linalg: the `tf.linalg` names of the ops dtape has.

Each name is the op itself (`dtape.linalg.matmul is dtape.matmul`), not a
copy. Source: tf.linalg.
"""
from dtape.ops.array_ops import band_part, eye  # noqa: F401
from dtape.ops.math_ops import einsum, global_norm, matmul, norm, solve  # noqa: F401

__all__ = ["band_part", "einsum", "eye", "global_norm", "matmul", "norm", "solve"]
