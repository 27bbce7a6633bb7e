"""Distributed values and variables, and the tape's watched-variable resolver.

Source: tensorflow/python/distribute/values.py. Seed 2: in a replica context
a watched distributed variable is its container; in the cross-replica
context it is every component.
"""
from dtape import nest
from dtape.distribute import context
from dtape.distribute.reduce_util import ReduceOp
from dtape.variables import VariableAggregation, install_tensor_protocol


class DistributedValues:
    """One value per replica. `.values` is a tuple ordered by replica id."""

    def __init__(self, values):
        self._values = tuple(values)

    @property
    def values(self):
        return self._values

    def _primary(self):
        return self._values[0]

    def __repr__(self):
        return f"{type(self).__name__}({list(self._values)!r})"


class PerReplica(DistributedValues):
    """Values that may differ per replica (e.g. each replica's loss)."""


class Mirrored(DistributedValues):
    """Values known to be identical on every replica."""


def _local_index(container):
    """Component index for `container` on this thread, or None in a cross-replica view."""
    idx = context.update_index()
    if idx is not None:
        return idx
    rctx = context.get_replica_context()
    if rctx is not None and rctx.strategy is container._distribute_strategy:
        return rctx.replica_id_in_sync_group
    return None


class DistributedVariable(DistributedValues):
    """A variable with one component Variable per replica device."""

    def __init__(self, strategy, components, aggregation):
        super().__init__(components)
        self._distribute_strategy = strategy
        self._aggregation = aggregation
        for c in components:
            c._distributed_container = self

    # identity ---------------------------------------------------------------
    def _component(self):
        idx = _local_index(self)
        return self._values[0 if idx is None else idx]

    def _handle(self):
        return self._component()

    @property
    def name(self):
        return self._values[0].name.rsplit("/replica_", 1)[0]

    @property
    def trainable(self):
        return self._values[0].trainable

    @property
    def shape(self):
        return self._values[0].shape

    @property
    def dtype(self):
        return self._values[0].dtype

    @property
    def device(self):
        return self._component().device

    @property
    def ndim(self):
        return self._values[0].ndim

    @property
    def aggregation(self):
        return self._aggregation

    @property
    def distribute_strategy(self):
        return self._distribute_strategy

    def numpy(self):
        return self._component().numpy()

    def torch(self):
        return self._component().torch()

    def __array__(self, dtype=None, copy=None):
        return self._component().__array__(dtype)

    # writes: each subclass's `_write(method, value)` decides which components change
    def assign(self, value, read_value=False):
        """Sets the value (see the subclass for which components change). Returns self."""
        return self._write("assign", value)

    def assign_add(self, delta, read_value=False):
        return self._write("assign_add", delta)

    def assign_sub(self, delta, read_value=False):
        return self._write("assign_sub", delta)

    def __hash__(self):
        return id(self)

    def __repr__(self):
        return f"{type(self).__name__}({self.name!r}, {list(self._values)!r})"


class MirroredVariable(DistributedVariable):
    """A variable kept identical on every replica device.

    Reads in a replica context give that replica's component; in the
    cross-replica context, the primary component (and the access watches
    every component). Writes in the cross-replica context go to every
    component; in a replica context they go through the variable's
    aggregation (NONE is an error). Source: tf.distribute MirroredVariable.
    """

    def read_value(self):
        # The component's read reports the access; resolve_watched maps it to
        # the container (replica context) or to every component (cross-replica).
        return self._component().read_value()

    value = read_value
    _dtape_read = read_value

    def _write(self, method, value):
        if context.update_index() is not None or context.in_cross_replica_context() or \
                _local_index(self) is None:
            return self._write_all(method, value)
        return self._write_from_replica(method, value)

    def _write_all(self, method, value):
        idx = context.update_index()
        if idx is not None:
            getattr(self._values[idx], method)(value)
            return self
        if isinstance(value, DistributedValues):
            value = value.values[0]
        for c in self._values:
            getattr(c, method)(value)
        return self

    def _write_from_replica(self, method, value):
        if self._aggregation == VariableAggregation.NONE:
            raise ValueError(
                f"You must specify an aggregation method to update MirroredVariable {self.name!r} in a "
                "replica context: create it with aggregation=VariableAggregation.SUM, MEAN or "
                "ONLY_FIRST_REPLICA, or update it in a merge_call / cross-replica context")
        ctx = context.get_replica_context()
        return ctx.merge_call(_merge_write, args=(self, method, value))


def _merge_write(strategy, var, method, value):
    if var.aggregation == VariableAggregation.ONLY_FIRST_REPLICA:
        reduced = value.values[0] if isinstance(value, DistributedValues) else value
    else:
        reduced = strategy.reduce(ReduceOp.from_variable_aggregation(var.aggregation), value)
    with context.enter_mode(strategy, None):
        var._write_all(method, reduced)
    return var


class SyncOnReadVariable(DistributedVariable):
    """A variable each replica updates locally; a cross-replica read aggregates the components.

    Source: tf.distribute SyncOnReadVariable.
    """

    def read_value(self):
        if _local_index(self) is not None:
            return self._component().read_value()
        comps = [c.read_value() for c in self._values]
        if self._aggregation in (VariableAggregation.ONLY_FIRST_REPLICA, VariableAggregation.NONE):
            return comps[0]
        total = comps[0]
        for c in comps[1:]:
            total = total + c
        return total / len(comps) if self._aggregation == VariableAggregation.MEAN else total

    value = read_value
    _dtape_read = read_value

    def _write(self, method, value):
        """Replica context: this replica's component; cross-replica: every component."""
        idx = _local_index(self)
        if idx is not None:
            getattr(self._values[idx], method)(value)
        else:
            for c in self._values:
                getattr(c, method)(value)
        return self


install_tensor_protocol(MirroredVariable)
install_tensor_protocol(SyncOnReadVariable)


def value_container(value):
    """The distributed container of a component variable, else `value` itself."""
    container = getattr(value, "_distributed_container", None)
    return value if container is None else container


def resolve_watched(variable):
    """Seed 2: the container in its own replica context, every component otherwise."""
    container = value_container(variable)
    if not isinstance(container, DistributedVariable):
        return (variable,)
    if _local_index(container) is not None and context.update_index() is None:
        return (container,)
    return container.values


def select_replica(replica_id, structure):
    """The replica's part of a nest: PerReplica/Mirrored leaves give their `replica_id` value."""
    def pick(x):
        if isinstance(x, DistributedValues) and not isinstance(x, DistributedVariable):
            return x.values[replica_id]
        return x
    return nest.map_structure(pick, structure)


def regroup(per_replica_structures):
    """Groups per-replica nests into one nest with PerReplica leaves (identical leaves kept)."""
    flats = [nest.flatten(s) for s in per_replica_structures]
    grouped = []
    for leaves in zip(*flats):
        first = leaves[0]
        grouped.append(first if all(x is first for x in leaves) else PerReplica(leaves))
    return nest.pack_sequence_as(per_replica_structures[0], grouped)
