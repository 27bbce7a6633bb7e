"""dtape: a gradient tape for PyTorch with TensorFlow 2 semantics, for data-parallel training.

The public surface is described in API.md; this module re-exports it.
"""
from dtape import tape, nn  # noqa: F401
from dtape.tensor import Tensor, constant, convert_to_tensor, device  # noqa: F401
from dtape import random  # noqa: F401
from dtape.ops import *  # noqa: F401,F403
from dtape.ops import __all__ as _ops_all
from dtape.tape import stop_recording  # noqa: F401
from dtape.variables import (Variable, VariableAggregation, VariableSynchronization,  # noqa: F401
                             variable_creator_scope)
from dtape.backprop import GradientTape, UnconnectedGradients  # noqa: F401
from dtape.module import Module  # noqa: F401
from dtape import layers, checkpoint  # noqa: F401

__version__ = "0.1.0"

__all__ = ["Tensor", "constant", "convert_to_tensor", "device", "random", "stop_recording", "Variable",
           "VariableAggregation", "VariableSynchronization", "variable_creator_scope",
           "GradientTape", "UnconnectedGradients", "tape", "nn"] + list(_ops_all)
__all__ += ["Module", "layers", "checkpoint"]
from dtape import distribute  # noqa: E402,F401  (last: registers the tape's resolver)
from dtape import optimizers  # noqa: E402,F401
__all__ += ["distribute", "optimizers"]
from dtape import backprop  # noqa: F401,E402
from dtape.custom_gradient import custom_gradient  # noqa: F401,E402
from dtape.function import function, recompute_grad  # noqa: F401,E402
__all__ += ["backprop", "custom_gradient", "function", "recompute_grad"]
from dtape import debugging
__all__ += ["debugging"]
