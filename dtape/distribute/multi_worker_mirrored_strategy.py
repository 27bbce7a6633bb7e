"""MultiWorkerMirroredStrategy: one replica per process, synchronised over torch.distributed.

Under `torchrun` every process is one worker and one replica
(`replica_id_in_sync_group` = its rank, `num_replicas_in_sync` = the world
size), on `cuda:LOCAL_RANK` when that GPU exists, else on the CPU; gloo
on the CPU and NCCL on CUDA (overridable). The API and tape semantics are
MirroredStrategy's; what differs is where the other replicas are:

* `run(fn)` calls fn inline, on the calling thread, in this worker's replica
  context, device and random generator; it returns this worker's value (a
  plain value, as TF does with one local replica), and `strategy.reduce`
  of it reduces across every worker.
* `ReplicaContext.merge_call(merge_fn)` runs merge_fn locally with this
  worker's values (tensors arrive as one-element PerReplica values); every
  reduction or gather inside it is a collective across the workers.
* Variables created in `scope()` (or inside `run`) have one component, on
  this worker's device, and start from rank 0's value (a broadcast), so they
  start identical whatever each worker's seed.
* `optimizer.apply_gradients` sums the gradients across the workers through
  `extended.batch_reduce_to`: one all-reduce per dtype, not per variable.

Failures: see `collective_ops` (an exception on one worker fails every
worker's step within the timeout, naming the failing rank). After a failure
the process group is unusable: restart the workers (torchrun --max-restarts).

Source: tf.distribute.MultiWorkerMirroredStrategy (CollectiveAllReduceStrategy).
"""
import atexit
import datetime
import itertools
import os
import sys
import time

import torch
import torch.distributed as dist

from dtape import _config, _jit
from dtape._notes import add_note
from dtape import tape as _tp
from dtape.distribute import collective_ops, context, cross_device_ops, input_lib, replica_scope
from dtape.distribute.distribute_lib import ReplicaContext, Strategy, StrategyExtended, check_reduce_op
from dtape.distribute.reduce_util import ReduceOp
from dtape.distribute.values import (DistributedValues, Mirrored, MirroredVariable, PerReplica, SyncOnReadVariable,
                                     map_leaves, split_sum, select_replica)
from dtape.random import generator_scope
from dtape.tensor import Tensor, convert_to_tensor, normalize_device
from dtape.tensor import device as device_scope
from dtape.variables import Variable, VariableAggregation, VariableSynchronization

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# Process-wide count of strategies made here: part of the store prefix, so two
# strategies in one process (tests) never read each other's keys. Same order on every worker.
_instances = itertools.count()
_excepthook_installed = False  # process-wide; sys.excepthook is chained once


class TorchrunClusterResolver:
    """Who this worker is, read from torchrun's environment (TF: cluster_resolver).

    Attributes:
      task_type: "worker" (TF's name for every member of the group).
      task_id, rank: this worker's rank in [0, world_size).
      world_size, num_workers: the number of workers.
      local_rank: this worker's index on its machine (its GPU index).
      master_addr, master_port: the rendezvous endpoint (None for an
        existing or single-process group).
      restart_count: torchrun's restart round (TORCHELASTIC_RESTART_COUNT).

    Source: tf.distribute.cluster_resolver.TFConfigClusterResolver (task_type, task_id).
    """

    def __init__(self, rank, world_size, local_rank=0, master_addr=None, master_port=None, restart_count=0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.rank = self.task_id = int(rank)
        self.world_size = self.num_workers = int(world_size)
        self.local_rank = int(local_rank)
        self.master_addr, self.master_port = master_addr, master_port
        self.restart_count = int(restart_count)
        self.task_type = "worker"

    @classmethod
    def from_environment(cls, environ=None):
        """Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (set by torchrun).

        With none of them set: a single worker (rank 0 of 1), as TF's
        strategy without TF_CONFIG.

        Raises:
          ValueError: some but not all of them are set, or one is not an integer.
        """
        env = os.environ if environ is None else environ
        present = [k for k in _TORCHRUN_VARS if k in env]
        if not present:
            return cls(0, 1)
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise ValueError(f"MultiWorkerMirroredStrategy: {present} are set but {missing} are not; "
                             "launch the script with torchrun (which sets them all) or unset them")
        try:
            return cls(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                       env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))
        except ValueError as e:
            raise ValueError(f"MultiWorkerMirroredStrategy: bad torchrun environment: {e}") from None

    def __repr__(self):
        return f"TorchrunClusterResolver(rank={self.rank}, world_size={self.world_size}, local_rank={self.local_rank})"


class CommunicationOptions:
    """How workers communicate. Source: tf.distribute.experimental.CommunicationOptions.

    Args:
      timeout_seconds: seconds a collective (or a peer's failure report) may
        take before TimeoutError; None: DTAPE_DISTRIBUTE_TIMEOUT (300).
      implementation: "gloo", "nccl", a `CommunicationImplementation`
        (AUTO: from the device; RING: gloo; NCCL), or None to choose from
        the device (NCCL for CUDA, gloo for the CPU).

    Raises:
      ValueError: a timeout that is not a finite positive number (NaN,
        zero, negative, infinite), or an unknown implementation.
      TypeError: a timeout that is not a number.
    """

    def __init__(self, timeout_seconds=None, implementation=None):
        if timeout_seconds is not None:  # here, not at the first collective (infinity: an OverflowError there)
            timeout_seconds = _config.validate_timeout(timeout_seconds, "CommunicationOptions(timeout_seconds=...)")
        impl = None if implementation is None else str(getattr(implementation, "name", implementation)).lower()
        impl = "gloo" if impl == "ring" else impl  # TF's CommunicationImplementation.RING: the CPU ring, gloo here
        if impl not in (None, "gloo", "nccl", "auto"):
            raise ValueError(f"implementation must be 'gloo', 'nccl', a CommunicationImplementation (AUTO, RING, "
                             f"NCCL) or None, got {implementation!r}")
        self.timeout_seconds = None if timeout_seconds is None else float(timeout_seconds)
        self.implementation = None if impl == "auto" else impl


def _worker_device(device, local_rank):
    if device is not None:
        return normalize_device(device)
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        return torch.device(f"cuda:{local_rank}")
    return torch.device("cpu")


# Seconds workers wait for each other to start (imports, data loading differ per process); at
# least this, or the collective timeout if larger. Collectives themselves use the timeout.
JOIN_TIMEOUT_S = 300.0


def _wait_for_peers(store, key, world_size, timeout):
    """Waits until all `world_size` workers have reached this point (a counter in the store).

    Raises:
      TimeoutError: naming how many workers arrived within `timeout` seconds.
    """
    arrived = store.add(key, 1)
    deadline = time.monotonic() + timeout
    while arrived < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {arrived} of {world_size} workers started within {timeout:g} s; check that "
                               "every rank was launched (torchrun --nnodes/--nproc-per-node) and can reach "
                               "MASTER_ADDR:MASTER_PORT")
        time.sleep(0.05)
        arrived = store.add(key, 0)


def _join_group(resolver, backend, timeout):
    """(store, group) of the process group: the existing one, or one made from torchrun's env."""
    # Ours fires first, with a better message; gloo's follows soon after, so a process that
    # exits after a timeout is not held at teardown by the collective that never finished.
    pg_timeout = datetime.timedelta(seconds=timeout + 2)
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (resolver.rank, resolver.world_size):
            raise ValueError(f"the existing process group is rank {dist.get_rank()} of {dist.get_world_size()}, "
                             f"but {resolver} was given")
        return dist.distributed_c10d._get_default_store(), None
    if resolver.world_size == 1 and resolver.master_addr is None:
        store = dist.HashStore()
    else:
        os.environ.setdefault("MASTER_ADDR", str(resolver.master_addr))
        os.environ.setdefault("MASTER_PORT", str(resolver.master_port))
        store, _, _ = next(dist.rendezvous("env://", rank=resolver.rank, world_size=resolver.world_size,
                                           timeout=datetime.timedelta(seconds=timeout)))
    # torchrun's store outlives a restart: a fresh prefix per round, or gloo would dial the dead round's peers
    _wait_for_peers(store, f"dtape_join/{resolver.restart_count}", resolver.world_size, max(timeout, JOIN_TIMEOUT_S))
    dist.init_process_group(backend, store=dist.PrefixStore(f"dtape_pg/{resolver.restart_count}", store),
                            rank=resolver.rank, world_size=resolver.world_size, timeout=pg_timeout)
    atexit.register(_shutdown_group)
    return store, None


def _shutdown_group():
    """At exit after a clean run: waits for the peers, then destroys the group we made.

    The wait is Communicator.exit_barrier (through the store, never a
    collective, so it cannot pair with a peer's reduction); a peer still
    waiting in a collective gets an error naming this rank instead.

    Left to interpreter teardown, gloo's threads can abort the process
    ("terminate called without an active exception") after a clean run.
    After a failure the group is left alone (destroying it would wait on the
    collective that failed); see Communicator.leave_after_failure.
    """
    comm = collective_ops.active_or_none()
    if comm is None or not dist.is_initialized():
        return
    if comm._failed is not None:
        comm.leave_after_failure()
        return
    try:
        together = comm.exit_barrier()
    except Exception:  # noqa: BLE001 - exiting anyway; the peers report their own failure
        return
    if not together:
        comm.leave_after_failure()
        return
    dist.destroy_process_group()


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism across processes: one replica per worker, over torch.distributed.

    Args:
      cluster_resolver: a TorchrunClusterResolver; default: from torchrun's
        environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT);
        none of them set: a single worker. If torch.distributed is already
        initialised, its process group is used (its rank and size must match).
      communication_options: CommunicationOptions (timeout, gloo/NCCL).
      device: this worker's device; default cuda:LOCAL_RANK if it exists,
        else the CPU.
      seed: int seeding this worker's random generator (derived from (seed,
        rank), as MirroredStrategy's replicas); None: drawn on rank 0 and
        broadcast.

    Every worker must make the strategy, create the same variables in the
    same order, and call `run`, `reduce`, `gather`, checkpoint saves and
    cross-replica reads of SyncOnReadVariables in the same order: each is
    a collective. Each collective's signature (number, kind, the dtape call,
    dtype, shape) is compared across the workers before it runs: workers
    that differ (e.g. `if rank == 0: dtape.checkpoint.save(...)`) raise
    `CollectiveMismatchError` on every worker naming each worker's call,
    never a wrong value (`collective_ops`; DTAPE_CHECK_COLLECTIVES=0 turns
    the check off, on every worker).

    Raises:
      ValueError: a partial torchrun environment, bad options, or an existing
        process group that disagrees with the resolver.

    Example (run with `torchrun --nproc-per-node 2 script.py`):
      >>> strategy = dtape.distribute.MultiWorkerMirroredStrategy()
      >>> with strategy.scope():
      ...     v = dtape.Variable(1.0)                     # identical on every worker
      >>> loss = strategy.run(lambda: v * 2)            # this worker's value
      >>> strategy.reduce("SUM", loss)                  # 2.0 * world size, on every worker
    """

    def __init__(self, cluster_resolver=None, communication_options=None, device=None, seed=None):
        resolver = cluster_resolver or TorchrunClusterResolver.from_environment()
        options = communication_options or CommunicationOptions()
        dev = _worker_device(device, resolver.local_rank)
        backend = options.implementation or ("nccl" if dev.type == "cuda" else "gloo")
        self._timeout = options.timeout_seconds or _config.DISTRIBUTE_TIMEOUT_S
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        store, group = _join_group(resolver, backend, self._timeout)
        super().__init__(_WorkerExtended(self, str(dev), resolver))
        self._resolver, self._device, self._backend = resolver, dev, backend
        comm_device = dev if backend == "nccl" else torch.device("cpu")
        prefix = f"dtape/{resolver.restart_count}/{next(_instances)}/"
        self._comm = collective_ops.Communicator(resolver.rank, resolver.world_size, store, self._timeout,
                                                 comm_device, prefix, group)
        collective_ops.set_active(self._comm)
        _install_excepthook()
        seed = self._shared_seed(seed)
        self._generator = replica_scope.ReplicaGenerator(dev, resolver.rank, alone_in_process=True)
        self._generator.manual_seed(replica_scope.derive_seed(seed, resolver.rank))

    def _shared_seed(self, seed):
        if seed is not None:
            return replica_scope.check_seed(seed)
        drawn = torch.tensor([replica_scope.check_seed(None)], dtype=torch.int64)
        return int(self._comm.broadcast(drawn, 0, label="MultiWorkerMirroredStrategy()")[0])  # also the start-up barrier: every pid is registered

    # -- identity -------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self):
        """The number of workers (one replica each)."""
        return self._resolver.world_size

    @property
    def cluster_resolver(self):
        """This worker's TorchrunClusterResolver (`.task_type`, `.task_id` = rank, `.num_workers`)."""
        return self._resolver

    @property
    def communicator(self):
        """The collective_ops.Communicator this strategy's reductions use."""
        return self._comm

    @property
    def backend(self):
        """"gloo" or "nccl"."""
        return self._backend

    # -- random state -----------------------------------------------------------------
    def replica_generator(self, replica_id=None):
        """This worker's torch.Generator (on its device; seeded from (seed, rank))."""
        return self._generator

    def get_rng_state(self):
        """Every worker's generator state, in rank order (uint8 CPU tensors); a collective (call on every worker)."""
        state = self._generator.get_state()
        return list(self._comm.all_gather(state, label="get_rng_state").unbind(0))

    def set_rng_state(self, states):
        """Restores this worker's generator from `get_rng_state()`'s list (its rank's entry).

        Raises:
          TypeError: not a list of uint8 tensors.
          ValueError: a list saved with another number of workers.
        """
        if not isinstance(states, (list, tuple)) or not all(
                isinstance(s, torch.Tensor) and s.dtype == torch.uint8 for s in states):
            raise TypeError("set_rng_state expects the list of uint8 tensors get_rng_state returned")
        if len(states) != self.num_replicas_in_sync:
            raise ValueError(f"set_rng_state got {len(states)} states for {self.num_replicas_in_sync} workers; "
                             "restore states saved with the same number of workers")
        self._generator.set_state(replica_scope.own_copy(states[self._resolver.rank]))   # not a view: see own_copy

    # -- variables --------------------------------------------------------------------
    def _create_variable(self, next_creator, **kwargs):
        """One component on this worker's device, set to rank 0's value (a broadcast: every worker calls it)."""
        init = kwargs["initial_value"]
        if callable(init):
            with _tp.stop_recording():
                init = init()
        name = kwargs.get("name") or "Variable"
        component = next_creator(**dict(kwargs, initial_value=init, device=self._device,
                                         name=f"{name}/replica_{self._resolver.rank}"))
        with _tp.stop_recording():
            component.assign(self._comm.broadcast(component.torch(), 0, label="variable creation"))
        sync = kwargs.get("synchronization")
        cls = _WorkerSyncOnReadVariable if sync == VariableSynchronization.ON_READ else _WorkerMirroredVariable
        return cls(self, [component], kwargs.get("aggregation"))

    # -- steps ------------------------------------------------------------------------
    def run(self, fn, args=(), kwargs=None):
        """Runs `fn(*args, **kwargs)` once, inline, as this worker's replica.

        Legal in the cross-replica context (or outside any scope). PerReplica
        arguments give their local value.

        Returns:
          fn's result: this worker's replica value (reduce it across workers
          with `strategy.reduce`).

        Raises:
          fn's exception, with a note naming this rank, after publishing it so
          that every peer's step fails too (any BaseException: `sys.exit()`
          and KeyboardInterrupt as well; peers raise WorkerError for those);
          a peer's exception (its type, a note naming its rank) if a peer
          failed; TimeoutError.
        """
        if context.get_replica_context() is not None and context.has_strategy():
            raise RuntimeError("strategy.run was called inside a replica context; call it from the "
                               "cross-replica context (outside strategy.run)")
        # in a compiled function: its trace stops and its body runs eagerly, running `fn` compiled
        fn = _jit.replica_function(fn, "MultiWorkerMirroredStrategy.run")
        rctx = _WorkerReplicaContext(self, self._resolver.rank)
        args, kwargs = select_replica(0, args), select_replica(0, kwargs or {})
        with self.scope(), self._replica_scope(), context.enter_mode(self, rctx):
            try:
                return fn(*args, **kwargs)
            except BaseException as e:  # sys.exit() and Ctrl-C too: a peer must never wait for this step
                self._report(e)
                raise

    def _replica_scope(self):
        return _ReplicaScope(self._device, self._generator)

    def _report(self, e):
        if not getattr(e, "_dtape_from_peer", False) and not isinstance(e, (collective_ops.PeerFailure,
                                                                               TimeoutError)):
            if not getattr(e, "_dtape_noted", False):
                add_note(e, f"(raised on worker rank {self._resolver.rank} of {self._resolver.world_size})")
                e._dtape_noted = True
            self._comm.publish_error(e)

    def reduce(self, reduce_op, value, axis=None, weights=None):
        """Reduces this worker's value with every other worker's (a collective).

        Args:
          reduce_op: ReduceOp.SUM or ReduceOp.MEAN (or "SUM"/"MEAN").
          value: what `run` returned (a tensor, number, or PerReplica), the
            same shape on every worker (except along `axis`).
          axis: None, or an axis (or axes) to reduce as well; MEAN over an
            axis divides by the examples of every worker (uneven ok).
          weights: MEAN only, axis None: this worker's weight (e.g. its
            example count); the result is sum_r(w_r v_r) / sum_r(w_r).

        Returns:
          A dtape.Tensor on this worker's device (float16/bfloat16
          accumulated in float32), identical on every worker. Not recorded
          on tapes.
        """
        with collective_ops.labelled("strategy.reduce"):
            return self._reduce_across(check_reduce_op(reduce_op), value, axis, weights)

    def _reduce_across(self, reduce_op, value, axis, weights):
        if weights is not None:  # this worker's weight: sum_r(w_r v_r) / sum_r(w_r) across workers
            return self._weighted_mean(reduce_op, value, axis, weights)
        if axis is None:
            return self._extended._reduce(reduce_op, value)
        local = _local_tensor(value)
        axes = (axis,) if isinstance(axis, int) else tuple(axis)
        wide = _widen(local.torch())
        part = wide.sum(dim=axes)
        count = 1
        for a in axes:
            count *= local.shape[a]
        buf = self._comm.all_reduce(torch.cat([part.flatten(), part.new_tensor([count])]))
        total = buf[:-1].reshape(part.shape)
        if reduce_op == ReduceOp.MEAN:
            total = total / torch.clamp(buf[-1], min=1)
        return Tensor(total.to(local.dtype))

    def gather(self, value, axis):
        """Every worker's value concatenated along `axis`, in rank order (sizes along `axis` may differ).

        Returns:
          A dtape.Tensor on this worker's device, identical on every worker.

        Raises:
          ValueError: a scalar value (nothing to concatenate along).
        """
        local = _local_tensor(value, concat_axis=axis)
        if local.ndim == 0:
            raise ValueError("gather needs values with at least one dimension; got a scalar")
        moved = torch.movedim(local.torch(), axis, 0)
        return Tensor(torch.movedim(self._comm.all_gather_uneven(moved, label="strategy.gather"), 0, axis))

    def experimental_distribute_dataset(self, dataset):
        """This worker's slice of every global batch of `dataset` (the split MirroredStrategy uses).

        `dataset`: any iterable of global batches (tensors, numpy arrays, nests
        of them, a torch DataLoader); every worker must iterate the same
        global batches. Batch i gives worker r examples
        [sum(sizes[:r]), sum(sizes[:r+1])) with sizes = input_lib.split_sizes(n, world).

        Each iteration (epoch) starts with one all-gather of a fingerprint of
        the first global batch (`input_lib.check_same_global_batch`): workers
        holding different batches (a DataLoader left with a DistributedSampler,
        shuffles seeded per rank) raise ValueError on every worker. For
        per-worker data use `distribute_datasets_from_function` (not checked).
        """
        return input_lib.WorkerDataset(dataset, self._resolver.rank, self.num_replicas_in_sync, self._device,
                                       comm=self._comm)

    def distribute_datasets_from_function(self, dataset_fn):
        """`dataset_fn(InputContext(world, rank, world))`: this worker's own dataset, batches on its device."""
        n = self.num_replicas_in_sync
        ctx = input_lib.InputContext(n, self._resolver.rank, n)
        return input_lib.WorkerDataset(dataset_fn(ctx), 0, 1, self._device)


class _ReplicaScope:
    """Thread-local: this worker's device (dtape and CUDA) and random generator, as a replica thread enters."""

    def __init__(self, device, generator):
        self._device, self._generator = device, generator

    def __enter__(self):
        self._scopes = [device_scope(self._device), generator_scope(self._generator)]
        if self._device.type == "cuda":
            self._scopes.append(torch.cuda.device(self._device))
        for s in self._scopes:
            s.__enter__()
        return self

    def __exit__(self, *exc):
        for s in reversed(self._scopes):
            s.__exit__(*exc)
        return False


class _WorkerReplicaContext(ReplicaContext):
    """The replica context of one worker: merge_call runs locally, reductions are collectives."""

    @property
    def devices(self):
        return tuple(self._strategy.extended.worker_devices)

    def merge_call(self, merge_fn, args=(), kwargs=None):
        """Runs `merge_fn(strategy, *args, **kwargs)` on this worker, in the cross-replica context.

        Tensors in the arguments arrive as one-element PerReplica values
        (this worker's part); reductions and gathers of them inside merge_fn
        are collectives, so every worker must make the same merge_call.
        Returns this worker's part of the result.
        """
        if self._strategy.num_replicas_in_sync > 1:
            context.refuse_merge_call_in_traced_body(merge_fn)
        args, kwargs = _as_worker_values(args), _as_worker_values(kwargs or {})
        with context.enter_mode(self._strategy, None), _tp.stop_recording():
            return select_replica(0, merge_fn(self._strategy, *args, **kwargs))


def _as_worker_values(structure):
    def wrap(x):
        if isinstance(x, (Tensor, torch.Tensor)) and not isinstance(x, Variable):
            return PerReplica((x,))
        return x
    return map_leaves(wrap, structure)


class _WorkerExtended(StrategyExtended):
    """Reductions across workers (collectives); the devices are this worker's one device."""

    def __init__(self, strategy, device, resolver):
        super().__init__(strategy, (device,))
        self._resolver = resolver

    @property
    def should_checkpoint(self):
        """True on the worker that writes checkpoints (rank 0). Source: TF StrategyExtended.should_checkpoint."""
        return self._resolver.rank == 0

    @property
    def should_save_summary(self):
        """True on the worker that writes summaries, metrics and plots (rank 0)."""
        return self._resolver.rank == 0

    def _chief_write(self, write):
        """Runs `write()` on rank 0; every worker waits for it and raises if it failed (checkpoint hook)."""
        error = None
        if self.should_checkpoint:
            try:
                write()
            except Exception as e:  # noqa: BLE001 - re-raised below, after telling the peers
                error = e
        status = self._strategy._comm.all_reduce(torch.tensor([0.0 if error is None else 1.0]),
                                                 label="checkpoint.save")
        if error is not None:
            raise error
        if status[0] > 0:
            raise OSError("rank 0 failed to write the checkpoint; see rank 0's error")

    def _reduce(self, reduce_op, value):
        """This worker's value reduced with every worker's: a Tensor on this worker's device."""
        local = _local_tensor(value)
        n_local = len(value.values) if isinstance(value, DistributedValues) else 1
        total = self._strategy._comm.all_reduce(_widen(local.torch()))
        if reduce_op == ReduceOp.MEAN:
            total = total / (n_local * self._strategy.num_replicas_in_sync)
        return Tensor(total.to(local.dtype))

    _flat_buckets = True  # one collective per gradient bucket: fewer, larger messages

    _announces = True  # _all_reduce_flat_async takes `announce`: one check for a step's buckets

    def _all_reduce_flat_async(self, reduce_op, tensors, scratch=False, announce=None, announced=False, tag=None,
                               flagged=False):
        """Launches one all-reduce per tensor across the workers (async_op); returns a handle at once.

        StrategyExtended's flat interface (gradient buckets, collectives on the
        tape): 1-D tensors on this worker's device, the same sizes on every
        worker, launched in the same order; float16/bfloat16 accumulate in
        float32. `handle.wait()` fails fast naming a failed rank, as every
        collective. `scratch=True` (tensors given away, e.g. gradient
        buckets): reduced in place, saving a copy of every bucket.
        `announce` [(dtype, numel)], `announced`, `flagged`: one tensor, as
        Communicator.all_reduce_async's (the next flat launches are checked
        with this one's signatures; a flagged one may be announced by the
        collective before it, see collective_ops). `tag`: a gradient bucket's sources; the
        signature of each bucket that is checked carries its `digest` (the
        sources' names and shapes by position), so workers that passed
        tape.gradient different variables at some position raise
        CollectiveMismatchError before any value is summed.
        """
        comm = self._strategy._comm
        sources = tag.digest if tag is not None and not announced else 0  # announced: the first one carried it
        if announce:
            announce = [(cross_device_ops.accumulation_dtype(dtype), numel) for dtype, numel in announce]
        pending = []
        for t in tensors:
            wide = _widen(t)
            # a widened copy is ours to reduce in place; the caller's tensor only if given away
            pending.append(comm.all_reduce_async(wide, scratch=scratch or wide is not t, announce=announce,
                                                 announced=announced, sources=sources, flagged=flagged))
        scale = 1.0 / self._strategy.num_replicas_in_sync if reduce_op == ReduceOp.MEAN else None
        return _FlatHandle(pending, tensors, scale)

    def batch_reduce_to(self, reduce_op, value_destination_pairs):
        """Reduces many values with one all-reduce per accumulation dtype (flattened, concatenated).

        Returns:
          [Mirrored] in the input order (None for a None value).
        """
        reduce_op = check_reduce_op(reduce_op)
        locals_ = [None if v is None else _local_tensor(v) for v, _ in value_destination_pairs]
        if self._strategy.num_replicas_in_sync == 1:  # one worker: its values are the sums and the means
            return [None if t is None else Mirrored((t,)) for t in locals_]
        out = [None] * len(locals_)
        by_dtype = {}
        for i, t in enumerate(locals_):
            if t is not None:
                by_dtype.setdefault(cross_device_ops.accumulation_dtype(t.dtype), []).append(i)
        scale = 1.0 / self._strategy.num_replicas_in_sync if reduce_op == ReduceOp.MEAN else None
        for dtype, idx in by_dtype.items():
            flat = torch.cat([locals_[i].torch().to(self._torch_devices[0], dtype).flatten() for i in idx])
            flat = self._strategy._comm.all_reduce(flat, label="strategy.extended.batch_reduce_to")
            if scale is not None:
                flat = flat * scale
            for i, part in zip(idx, flat.split([locals_[i].torch().numel() for i in idx])):
                out[i] = Mirrored((Tensor(part.view(locals_[i].shape).to(locals_[i].dtype)),))
        return out


class _FlatHandle:
    """Pending all-reduces of one flat launch: `wait()` gives the results in the tensors' dtypes and devices."""

    def __init__(self, pending, tensors, scale):
        self._pending, self._tensors, self._scale, self._result = pending, tensors, scale, None

    def done(self):
        return self._result is not None

    def wait(self, timeout=None):
        if self._result is None:
            out = [p.wait() for p in self._pending]
            if self._scale is not None:
                out = [o * self._scale for o in out]
            self._result = [o.to(t.device, t.dtype) for o, t in zip(out, self._tensors)]
        return self._result


def _widen(t):
    return t.to(cross_device_ops.accumulation_dtype(t.dtype))


def _local_tensor(value, concat_axis=None):
    """This worker's part of `value` as one Tensor (several local values: summed, or concatenated)."""
    if isinstance(value, DistributedValues):
        parts = [convert_to_tensor(v) for v in value.values]
        if len(parts) == 1:
            return parts[0]
        if concat_axis is not None:
            return Tensor(torch.cat([p.torch() for p in parts], dim=concat_axis))
        return Tensor(torch.stack([p.torch() for p in parts]).sum(0))
    return convert_to_tensor(value)


class _WorkerMirroredVariable(MirroredVariable):
    """A MirroredVariable with this worker's one component; replica-context writes reduce across workers."""

    def _component(self):
        return self._values[0]

    @classmethod
    def _handles_of(cls, variables):
        return [v._values[0] for v in variables]  # `_component()` of each

    def _write_from_replica(self, method, value):
        if self._aggregation == VariableAggregation.ONLY_FIRST_REPLICA:
            strategy = self._distribute_strategy
            value = Tensor(strategy._comm.broadcast(convert_to_tensor(value).torch(), 0,
                                                    label="ONLY_FIRST_REPLICA variable write"))
            with context.enter_mode(strategy, None):
                return self._write_all(method, value)
        return super()._write_from_replica(method, value)


class _WorkerSyncOnReadVariable(SyncOnReadVariable):
    """A SyncOnReadVariable with this worker's one component; cross-replica reads are collectives.

    The logical value is the aggregate over the workers (SUM: the sum of
    every worker's component; MEAN: their mean). A cross-replica
    `assign(x)` with SUM writes x / world_size on every worker (integers:
    the remainder on rank 0), so the read gives x.
    """

    def _component(self):
        return self._values[0]

    @classmethod
    def _handles_of(cls, variables):
        return [v._values[0] for v in variables]  # `_component()` of each

    def _aggregate(self, comps):
        if self._aggregation in (VariableAggregation.ONLY_FIRST_REPLICA, VariableAggregation.NONE):
            return comps[0]
        op = ReduceOp.MEAN if self._aggregation == VariableAggregation.MEAN else ReduceOp.SUM
        with collective_ops.labelled("SyncOnReadVariable read"):
            return self._distribute_strategy.extended._reduce(op, convert_to_tensor(comps[0]))

    def _write(self, method, value):
        strategy = self._distribute_strategy
        if context.get_replica_context() is not None and context.get_replica_context().strategy is strategy:
            getattr(self._values[0], method)(value)
            return self
        if isinstance(value, DistributedValues):
            part = value.values[0]
        elif self._aggregation == VariableAggregation.SUM:
            rank = strategy.cluster_resolver.rank
            part = split_sum(self._values[0]._coerce(value, method), strategy.num_replicas_in_sync)[rank]
        else:
            part = value
        getattr(self._values[0], method)(part)
        return self


def _install_excepthook():
    """Chains sys.excepthook once: an uncaught exception on a worker is published before the process exits."""
    global _excepthook_installed
    if _excepthook_installed:
        return
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        try:
            comm = collective_ops.active_or_none()
            if comm is not None:   # any uncaught exception, Ctrl-C's KeyboardInterrupt included
                if not getattr(exc, "_dtape_from_peer", False):
                    comm.publish_error(exc)
        finally:
            previous(exc_type, exc, tb)
    sys.excepthook = hook
    _excepthook_installed = True


__all__ = ["MultiWorkerMirroredStrategy", "CommunicationOptions", "TorchrunClusterResolver"]
