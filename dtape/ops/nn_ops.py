"""Neural-network ops, exported as `dtape.nn` (TF names and arguments; NHWC conv).

One block per op: forward on torch tensors, then its gradient rule.
"""
import torch  # noqa: F401

from dtape.ops import _samples as S  # noqa: F401
from dtape.ops._registry import defop  # noqa: F401

__all__ = []
