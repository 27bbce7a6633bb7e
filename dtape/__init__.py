"""dtape: a gradient tape for PyTorch with TensorFlow 2 semantics, for data-parallel training.

The public surface is described in API.md; this module re-exports it.
"""
from dtape import tape, nn  # noqa: F401
from dtape.tensor import Tensor, constant, convert_to_tensor  # noqa: F401
from dtape.ops import *  # noqa: F401,F403
from dtape.ops import __all__ as _ops_all
from dtape.tape import stop_recording  # noqa: F401
from dtape.variables import (Variable, VariableAggregation, VariableSynchronization,  # noqa: F401
                             variable_creator_scope)
from dtape.backprop import GradientTape, UnconnectedGradients  # noqa: F401

__version__ = "0.1.0"

__all__ = ["Tensor", "constant", "convert_to_tensor", "stop_recording", "Variable",
           "VariableAggregation", "VariableSynchronization", "variable_creator_scope",
           "GradientTape", "UnconnectedGradients", "tape", "nn"] + list(_ops_all)
