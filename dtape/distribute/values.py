"""Distributed values and variables, and the tape's watched-variable resolver.

Source: tensorflow/python/distribute/values.py. Seed 2: in a replica context
a watched distributed variable is its container; in the cross-replica
context it is every component.
"""
import itertools
import threading
import weakref

import torch

from dtape import nest
from dtape import tape as _tp
from dtape.distribute import context, cross_device_ops
from dtape.distribute.interrupts import uninterrupted
from dtape.distribute.reduce_util import ReduceOp
from dtape.tensor import Tensor, convert_to_tensor, numpy_array, numpy_value
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
    mode = context.current_mode()  # one lookup: every read of a distributed variable comes here
    if mode.update_index is not None:
        return mode.update_index
    rctx = mode.replica_context
    if rctx is not None and rctx._strategy is container._distribute_strategy:
        return rctx._replica_id
    return None


# Process-wide: strategy -> {creation number: live distributed variable} (weak on both sides), for
# `extended.check_mirrored()`; mutated under _live_lock.
_live = weakref.WeakKeyDictionary()
_live_lock = threading.Lock()
_live_counter = itertools.count()


def live_variables(strategy):
    """The distributed variables of `strategy` still alive, in creation order."""
    with _live_lock:
        table = _live.get(strategy)
        items = sorted(table.items()) if table is not None else []
    return [v for _, v in items]


# strategy -> {name: how many distributed variables of that name it has created}, for `_name_ordinal`
_name_counts = weakref.WeakKeyDictionary()


def _register(strategy, variable):
    name = variable.name
    with _live_lock:
        table = _live.get(strategy)
        if table is None:
            table = _live[strategy] = weakref.WeakValueDictionary()
        table[next(_live_counter)] = variable
        counts = _name_counts.setdefault(strategy, {})
        variable._name_ordinal = counts.get(name, 0)
        counts[name] = variable._name_ordinal + 1


class DistributedVariable(DistributedValues):
    """A variable with one component Variable per replica device.

    `_name_ordinal`: how many variables of the same name the strategy created
    before this one (0 for a name met first). With the name, it tells apart
    variables that share a name (two unnamed ones are both "Variable" under
    MultiWorkerMirroredStrategy; explicit names may repeat), as TF's name
    scopes number them ("dense/kernel", "dense_1/kernel"), and is the same on
    every worker that creates its variables in the same order (as SPMD
    programs do): gradient buckets' cross-worker signatures carry it.
    """

    def __init__(self, strategy, components, aggregation):
        super().__init__(components)
        self._distribute_strategy = strategy
        self._aggregation = aggregation
        # Makes a write of several components one step: two threads writing every component
        # can otherwise interleave per component and leave them different. Taken before any
        # component's own lock, never while waiting for other replicas (merge_call happens outside).
        self._write_lock = threading.RLock()
        for c in components:
            c._distributed_container = self
        _register(strategy, self)

    # identity ---------------------------------------------------------------
    def _component(self):
        idx = _local_index(self)
        return self._values[0 if idx is None else idx]

    def _handle(self):
        return self._component()

    @classmethod
    def _handles_of(cls, variables):
        """`[v._handle() for v in variables]` for variables of this class, with this thread's mode looked up
        once (a wrapped module reads all its parameters at once, every call)."""
        if cls._component is not DistributedVariable._component:  # a subclass's own rule
            return [v._component() for v in variables]
        mode = context.current_mode()
        if mode.update_index is not None:
            return [v._values[mode.update_index] for v in variables]
        rctx = mode.replica_context
        if rctx is None:
            return [v._values[0] for v in variables]
        strategy, replica = rctx._strategy, rctx._replica_id
        return [v._values[replica if v._distribute_strategy is strategy else 0] for v in variables]

    # never its own handle (a component is): `tape.gradient` resolves such sources per list
    _handle_is_self = False

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

    def _host_value(self):
        """The value a host read (numpy, torch, __array__) sees: this replica's component, or the
        primary one in the cross-replica context (SyncOnReadVariable aggregates instead)."""
        return self._component().torch()

    def numpy(self):
        """The value as a writable numpy copy (cross-replica: the logical value, as `read_value()`);
        not recorded. Writing it changes no component (use `assign`); 0-d: a numpy scalar, as TF's."""
        return numpy_value(self._host_value())

    def torch(self):
        """The value as a torch.Tensor (cross-replica: the logical value); not recorded."""
        return self._host_value()

    def __array__(self, dtype=None, copy=None):
        return numpy_array(self._host_value(), dtype, copy)

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
    component, as one atomic step (concurrent writers from several threads
    leave the components equal: one writer's value); in a replica context
    they go through the variable's aggregation (NONE is an error).
    Source: tf.distribute MirroredVariable.
    """

    # A read is its handle's (`_component()`) read: `variables.read_values` reads the component itself.
    _reads_handle = True

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
        with self._write_lock, uninterrupted():  # Ctrl-C cannot leave the components different
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
        return ctx.merge_call(_merge_write, args=(self, method, replica_operand(value)))


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

    Replica context: reads and writes use this replica's component.
    Cross-replica context (TF's on_read_* rules):
      * read (`read_value`, `numpy`, `float`, ...): SUM adds the components,
        MEAN averages them (both on the primary device, float16/bfloat16
        accumulated in float32); ONLY_FIRST_REPLICA and NONE give the primary.
      * `assign(x)`: SUM writes x / num_replicas to each component (integer
        dtypes: the remainder goes to the primary) so the read gives x;
        other aggregations write x to each component.
      * `assign_add(d)` / `assign_sub(d)`: the logical value changes by d:
        SUM adds d / num_replicas to each component (where TF raises),
        other aggregations add d to each component.
      A PerReplica/Mirrored value gives each component its own part, as is.

    Source: tf.distribute SyncOnReadVariable (values_util.on_read_assign_*_cross_replica).
    """

    def read_value(self):
        if _local_index(self) is not None:
            return self._component().read_value()
        return self._aggregate([c.read_value() for c in self._values])

    value = read_value
    _dtape_read = read_value

    def _aggregate(self, comps):
        if self._aggregation in (VariableAggregation.ONLY_FIRST_REPLICA, VariableAggregation.NONE):
            return comps[0]
        op = ReduceOp.MEAN if self._aggregation == VariableAggregation.MEAN else ReduceOp.SUM
        return cross_device_ops.reduce_values(op, comps, self._values[0].device)

    def _host_value(self):
        if _local_index(self) is not None:
            return self._component().torch()
        with _tp.stop_recording():
            return self._aggregate([Tensor(c.torch()) for c in self._values]).torch()

    def _write(self, method, value):
        """Replica context: this replica's component; cross-replica: see the class docstring."""
        idx = _local_index(self)
        if idx is not None:
            getattr(self._values[idx], method)(value)
            return self
        if isinstance(value, DistributedValues):
            parts = value.values
        elif self._aggregation == VariableAggregation.SUM:
            parts = split_sum(self._values[0]._coerce(value, method), len(self._values))
        else:
            parts = (value,) * len(self._values)
        with self._write_lock, uninterrupted():
            for c, part in zip(self._values, parts):
                getattr(c, method)(part)
        return self


def split_sum(t, n):
    """n torch tensors whose sum is `t`: t / n each (integers: floor, remainder on the first)."""
    if t.is_floating_point() or t.is_complex():
        return (t / n,) * n
    q = torch.div(t, n, rounding_mode="floor")
    return (t - q * (n - 1),) + (q,) * (n - 1)


def replica_operand(value):
    """A replica's operand for a collective or an aggregated write, as a value of its own.

    Tensors and PerReplica/Mirrored values are kept as they are (a tensor
    shared by every replica stays one object: a non-distributed value);
    Python and numpy numbers and variables (distributed ones included)
    become a new Tensor on this replica (a variable: a recorded read of its
    local component), so `all_reduce(SUM, 1.0)` sums one 1.0 per replica
    whatever CPython's caching of constants makes identical.
    """
    if value is None or isinstance(value, Tensor):
        return value
    if isinstance(value, DistributedValues) and not isinstance(value, DistributedVariable):
        return value
    return convert_to_tensor(value)


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


def resolve_watched_all(variables):
    """(`[resolve_watched(v) for v in variables]`, each watched variable's concrete handle, a tuple per variable)
    with this thread's mode looked up once: the tape's list form of the resolver (`tape.resolve_watched_all`),
    for the dozens of variables a wrapped module reads and `tape.gradient` resolves on every step. Decided per
    class, not per variable (a module's variables are one or two classes): containers, plain variables (with
    `_distributed_container`: a component names its container), other variables."""
    mode = context.current_mode()
    rctx = mode.replica_context if mode.update_index is None else None
    strategy = None if rctx is None else rctx._strategy
    kinds = {kind: (_KIND_CONTAINER if issubclass(kind, DistributedVariable) else
                    _KIND_PLAIN if hasattr(kind, "_distributed_container") else _KIND_OTHER,
                    vars(kind).get("_handle_is_self", False)) for kind in set(map(type, variables))}
    if strategy is not None and kinds and all([k is not _KIND_OTHER for k, _ in kinds.values()]):
        local = _resolved_locally(variables, kinds, strategy)
        if local is not None:
            return local
    if len(kinds) == 1 and next(iter(kinds.values())) == (_KIND_PLAIN, True) and \
            all([v._distributed_container is None for v in variables]):
        # plain variables outside any container (a wrapped module's, off any strategy): each is itself
        alone = [(v,) for v in variables]
        return alone, list(alone)
    watched, handles = [], []
    for v in variables:
        w, h = _resolved(v, kinds[type(v)], strategy)
        watched.append(w)
        handles.append(h)
    return watched, handles


def _resolved_locally(variables, kinds, strategy):
    """A training step's case, per list: containers (`tape.gradient`'s sources) or their components (a
    module's reads) all in a replica context of their `strategy`, each watching its container, whose handle
    is this replica's component; None when some variable is not such."""
    containers = [v if kinds[type(v)][0] is _KIND_CONTAINER else v._distributed_container for v in variables]
    if not all([c is not None and c._distribute_strategy is strategy for c in containers]):
        return None
    classes = set(map(type, containers))
    comps = classes.pop()._handles_of(containers) if len(classes) == 1 else [c._component() for c in containers]
    return [(c,) for c in containers], [(h,) for h in comps]


def _resolved(v, kind, strategy):
    """(resolve_watched(v), their handles), `kind` = (v's class kind, whether its handle is itself), `strategy`
    that of the replica context (None: cross-replica or inside an update)."""
    kind, own = kind
    if kind is _KIND_CONTAINER:
        container = v
    elif kind is _KIND_PLAIN:  # a component's container (set by DistributedVariable only), else None
        container = v._distributed_container
    else:
        container = value_container(v)
        container = container if container is not v and isinstance(container, DistributedVariable) else None
    if container is None:
        return (v,), (v if own else v._handle(),)
    comps = container._values
    if container._distribute_strategy is strategy:  # its own replica context: the container
        # its handle, `container._component()`: one component (a worker's) is it, whatever the replica id
        return (container,), (comps[0] if len(comps) == 1 else container._component(),)
    # cross-replica (or another strategy's replica context, or an update): every component
    return comps, tuple([c if vars(type(c)).get("_handle_is_self", False) else c._handle() for c in comps])


_KIND_CONTAINER, _KIND_PLAIN, _KIND_OTHER = "container", "plain", "other"


def select_replica(replica_id, structure):
    """The replica's part of a nest: PerReplica/Mirrored leaves give their `replica_id` value."""
    def pick(x):
        if isinstance(x, DistributedValues) and not isinstance(x, DistributedVariable):
            return x.values[replica_id]
        return x
    return map_leaves(pick, structure)


def map_leaves(fn, structure):
    """`nest.map_structure(fn, structure)` for one structure, in one recursive pass.

    Same result (lists, tuples, namedtuples and dicts rebuilt as their type,
    dicts in sorted key order); it skips map_structure's flatten-then-pack,
    which every `run`, `merge_call` and update pays on its arguments.
    """
    if not nest.is_nested(structure):
        return fn(structure)
    if isinstance(structure, dict):
        return type(structure)((k, map_leaves(fn, structure[k])) for k in sorted(structure))
    children = [map_leaves(fn, x) for x in structure]
    if isinstance(structure, tuple) and hasattr(type(structure), "_fields"):  # namedtuple
        return type(structure)(*children)
    return type(structure)(children)


def regroup(per_replica_structures):
    """Groups per-replica nests into one nest with PerReplica leaves.

    A leaf that is the same object on every replica (a value captured from
    outside the replica function, a string, None) is kept as that one
    object: a non-distributed value, as TF's regroup. Reductions treat it
    as such: SUM over more than one replica raises ValueError, MEAN
    returns it (`cross_device_ops.reduce_non_distributed_value`), so a
    result never silently depends on object identity.

    Raises:
      ValueError: if the replicas' nests have different structures.
    """
    flats = [nest.flatten(s) for s in per_replica_structures]
    if len({len(f) for f in flats}) > 1:
        raise ValueError(f"replicas gave nests of different structures ({[len(f) for f in flats]} leaves); "
                         "every replica must pass the same structure to merge_call / return it from run")
    grouped = []
    for leaves in zip(*flats):
        first = leaves[0]
        grouped.append(first if all(x is first for x in leaves) else PerReplica(leaves))
    return nest.pack_sequence_as(per_replica_structures[0], grouped)
