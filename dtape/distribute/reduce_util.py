"""ReduceOp: how values are combined across replicas. Source: tf.distribute.ReduceOp."""
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
