"""dtape.distribute: strategies, replica contexts, distributed values and variables.

Importing it registers the tape's watched-variable resolver (seed 2): the
core never imports this package.
"""
from dtape import tape as _tape
from dtape.distribute.context import (get_replica_context, get_strategy, has_strategy,  # noqa: F401
                                      in_cross_replica_context)
from dtape.distribute.distribute_lib import ReplicaContext, Strategy, StrategyExtended, ValueContext  # noqa: F401
from dtape.distribute import gradient_sync  # noqa: F401
from dtape.distribute import traceable_collectives  # noqa: F401  (registers torch.ops.dtape.all_reduce_sum)
from dtape.distribute.gradient_sync import GradientAccumulator, GradientSync, compute_average_loss  # noqa: F401
from dtape.distribute.input_lib import InputContext  # noqa: F401
from dtape.distribute.mirrored_strategy import MirroredStrategy  # noqa: F401
from dtape.distribute.multi_worker_mirrored_strategy import (CommunicationOptions,  # noqa: F401
                                                             MultiWorkerMirroredStrategy, TorchrunClusterResolver)
from dtape.distribute.collective_ops import CollectiveMismatchError, WorkerError  # noqa: F401
from dtape.distribute.one_device_strategy import OneDeviceStrategy  # noqa: F401
from dtape.distribute.reduce_util import CommunicationImplementation, ReduceOp  # noqa: F401
from dtape.distribute.values import (DistributedValues, Mirrored, MirroredVariable, PerReplica,  # noqa: F401
                                     SyncOnReadVariable, resolve_watched, resolve_watched_all,
                                     value_container)
from dtape.variables import VariableAggregation, VariableSynchronization  # noqa: F401

_tape.register_watched_variable_resolver(resolve_watched, resolve_watched_all)

__all__ = ["get_strategy", "has_strategy", "in_cross_replica_context", "get_replica_context",
           "ReduceOp", "VariableAggregation", "VariableSynchronization", "Strategy",
           "StrategyExtended", "ReplicaContext", "MirroredStrategy", "OneDeviceStrategy",
           "DistributedValues", "PerReplica", "Mirrored", "MirroredVariable", "SyncOnReadVariable",
           "InputContext", "GradientSync", "GradientAccumulator", "compute_average_loss",
           "MultiWorkerMirroredStrategy", "CommunicationOptions", "TorchrunClusterResolver", "WorkerError",
           "CommunicationImplementation", "ValueContext", "CollectiveMismatchError"]
