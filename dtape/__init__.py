"""dtape: a gradient tape for PyTorch with TensorFlow 2 semantics, for data-parallel training.

The public surface is described in API.md; this module re-exports it.
"""
import importlib

from dtape import tape, nn  # noqa: F401
from dtape.tensor import Tensor, as_dtype, constant, convert_to_tensor, device, from_dlpack  # noqa: F401
# dtype names: the torch dtypes themselves (dtape.float32 is torch.float32), as tf.float32 in TF.
from torch import (bfloat16, bool, complex64, complex128, float16, float32, float64,  # noqa: F401
                   int8, int16, int32, int64, uint8)
from dtape import random  # noqa: F401
from dtape.ops import *  # noqa: F401,F403
from dtape.ops import __all__ as _ops_all
from dtape.tape import stop_recording  # noqa: F401
from dtape.variables import (Variable, VariableAggregation, VariableSynchronization,  # noqa: F401
                             variable_creator_scope)
from dtape.backprop import GradientTape, UnconnectedGradients  # noqa: F401
from dtape.module import Module  # noqa: F401
from dtape import layers, checkpoint, checkpoint_management  # noqa: F401
# TF splits them the same way; tf.train.CheckpointManager is also reached from the checkpoint module's name.
checkpoint.CheckpointManager = checkpoint_management.CheckpointManager
from dtape import train  # noqa: F401,E402

__version__ = "0.1.0"

__all__ = ["Tensor", "as_dtype", "constant", "convert_to_tensor", "device", "from_dlpack", "random",
           "stop_recording", "Variable", "VariableAggregation", "VariableSynchronization", "variable_creator_scope",
           "GradientTape", "UnconnectedGradients", "tape", "nn"] + list(_ops_all)
# dtype names; `bool` is left out: a star import must not shadow the builtin.
__all__ += ["float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
            "complex64", "complex128"]
__all__ += ["Module", "layers", "checkpoint", "train"]
from dtape import distribute  # noqa: E402,F401  (last: registers the tape's resolver)
from dtape import _replica_info  # noqa: E402
_replica_info.register(distribute.get_replica_context, distribute.in_cross_replica_context,
                       distribute.has_strategy)
from dtape import optimizers  # noqa: E402,F401
from dtape import losses, metrics, regularizers, mixed_precision  # noqa: E402,F401
# Keras 3 also names it keras.optimizers.LossScaleOptimizer; it lives above the optimizers layer.
optimizers.LossScaleOptimizer = mixed_precision.LossScaleOptimizer
__all__ += ["distribute", "optimizers", "losses", "metrics", "regularizers", "mixed_precision"]
from dtape import backprop  # noqa: F401,E402
from dtape.custom_gradient import custom_gradient  # noqa: F401,E402
from dtape.function import function, recompute_grad  # noqa: F401,E402
from dtape._jit import TensorSpec, OperatorNotAllowedInGraphError  # noqa: F401,E402
__all__ += ["backprop", "custom_gradient", "function", "recompute_grad", "TensorSpec", "OperatorNotAllowedInGraphError"]
from dtape import debugging
__all__ += ["debugging"]
from dtape import math, linalg  # noqa: E402  (tf.math / tf.linalg names of the ops above)
__all__ += ["math", "linalg"]
from dtape import autodiff  # noqa: E402
__all__ += ["autodiff"]
__all__ += ["keras"]


def __getattr__(name):
    """`dtape.keras` is loaded on first use (as TF loads tf.keras lazily): it brings the training loop's
    progress bars and TensorBoard writer, which `import dtape` should not pay for."""
    if name == "keras":
        return importlib.import_module("dtape.keras")
    raise AttributeError(f"module 'dtape' has no attribute {name!r}")
