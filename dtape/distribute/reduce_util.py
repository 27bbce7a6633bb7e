"""ReduceOp: how values are combined across replicas; CommunicationImplementation: over which library.

Source: tf.distribute.ReduceOp, tf.distribute.experimental.CommunicationImplementation.
"""
import enum


class ReduceOp(enum.Enum):
    """SUM adds the replicas' values; MEAN averages them."""

    SUM = "SUM"
    MEAN = "MEAN"

    @staticmethod
    def from_variable_aggregation(aggregation):
        name = getattr(aggregation, "name", str(aggregation))
        if name not in ("SUM", "MEAN"):
            raise ValueError(f"no ReduceOp for aggregation {name}")
        return ReduceOp[name]


class CommunicationImplementation(enum.Enum):
    """Which collective library `CommunicationOptions(implementation=...)` asks for.

    AUTO: from the device (NCCL on CUDA, gloo on the CPU); RING: TF's
    ring all-reduce over the network, here torch.distributed's gloo; NCCL:
    NCCL (CUDA devices).
    Source: tf.distribute.experimental.CommunicationImplementation.
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"
