"""dtape ops: each family module owns its `__all__`; operators installed on Tensor here."""
from dtape.ops.math_ops import *  # noqa: F401,F403
from dtape.ops.array_ops import *  # noqa: F401,F403
from dtape.ops import math_ops, array_ops, nn_ops, _dispatch  # noqa: F401
from dtape.ops._registry import REGISTRY, TORCH_TABLE, defop  # noqa: F401
from dtape.ops._axes import AxisError  # noqa: F401  (public: what an out-of-range axis raises)

_dispatch.install_operators(__import__("dtape.ops", fromlist=["*"]))

__all__ = math_ops.__all__ + array_ops.__all__
