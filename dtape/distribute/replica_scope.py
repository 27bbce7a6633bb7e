"""Everything a replica thread enters, so that a replica runs like its caller.

A replica of `MirroredStrategy.run` runs on its own thread. Thread-local
state does not cross threads by itself, so each replica job enters:

  * its device: `dtape.device(device)` (tensor factories, conversions and
    `dtape.random` place new tensors there) and, for a CUDA device, torch's
    current CUDA device;
  * its random generator: `dtape.random.generator_scope(gen)` with the
    replica's own `torch.Generator` (one per replica, on its device, made
    once per strategy from the strategy seed and the replica id);
  * the caller's thread-local torch state, captured on the caller thread by
    `capture_caller_state()` when `run` is called: grad mode, inference
    mode and autocast (enabled, dtype, cache) for the CPU and CUDA, and a
    default torch profiler running on the caller (`profiler_threads`).
    torch's default dtype is process-global, so replicas see it as is;
  * the run's token (`dtape.tape.replica_run_scope`), one per `run` call:
    a tape opened inside one replica does not watch the variable reads of
    the sibling replicas of the same call, while every other tape (the
    caller's, another thread's) does, as for reads on any thread.

Source: DESIGN.md "A replica runs like its caller"; the per-replica
generators follow tf.random.Generator.split (one independent stream per
replica, derived from one seed).
"""
import contextlib
import warnings

import numpy as np
import torch

from dtape import _call_context
from dtape import tape as _tp
from dtape.distribute import profiler_threads
from dtape.random import generator_scope
from dtape.tensor import device as device_scope
from dtape.tensor import normalize_device

_AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")
# True on the thread that started a thread-local (default) torch.profiler; False elsewhere and for a
# profiler recording all threads (its state is process-global: every thread is recorded already).
_profiler_enabled = torch._C._autograd._profiler_enabled
_PROFILER_WARNING = (
    "torch.profiler.profile() with its default settings records only the thread that started it, and its "
    "state could not be carried into this strategy's replica threads ({reason}), so their ops are not in the "
    "trace; to see them, record every thread: "
    "torch.profiler.profile(..., experimental_config=torch._C._profiler._ExperimentalConfig("
    "profile_all_threads=True))")
_MAX_SEED = 2**63 - 1


class ReplicaGenerator(torch.Generator):
    """A `torch.Generator` that knows which replica it serves.

    `replica_id` lets code below `dtape.distribute` (e.g. a seeded
    `layers.Dropout`) derive per-replica streams from the generator that
    `dtape.random.get_generator()` returns, without importing this package.
    `alone_in_process`: no other replica of the process draws while this one
    runs (a MultiWorkerMirroredStrategy worker's, a one-device strategy's), so
    a TorchModule's forward draws this generator's stream through torch's
    default generator (`ops._dispatch.ReplicaStream`) instead of intercepting
    every torch call.
    """

    def __new__(cls, device, replica_id, alone_in_process=False):
        gen = super().__new__(cls, device=device)  # torch.Generator takes its device in __new__
        gen.replica_id = replica_id
        # the only replica of its process (a worker's, a one-device strategy's): no other replica draws while it
        # runs, so a wrapped module's forward may draw its stream through torch's default generator
        gen.alone_in_process = alone_in_process
        return gen

    def __init__(self, device, replica_id, alone_in_process=False):  # everything is set in __new__
        pass


def derive_seed(seed, replica_id):
    """A 63-bit seed for stream `replica_id` of `seed` (well mixed: nearby inputs give unrelated seeds)."""
    return int(np.random.SeedSequence([int(seed), int(replica_id)]).generate_state(1, np.uint64)[0]) & _MAX_SEED


def check_seed(seed):
    """`seed` as an int in [0, 2**63 - 1]; None draws one from torch's default CPU generator.

    Raises:
      TypeError: a seed that is not an int.
      ValueError: a negative or too large seed.
    """
    if seed is None:
        return int(torch.randint(0, _MAX_SEED, (), generator=torch.default_generator))
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"strategy seed must be an int or None, got {type(seed).__name__} {seed!r}")
    if not 0 <= int(seed) <= _MAX_SEED:
        raise ValueError(f"strategy seed must be in [0, 2**63 - 1], got {seed}")
    return int(seed)


class ReplicaGenerators:
    """One generator per replica, on the replica's device, seeded by `derive_seed(seed, replica_id)`.

    Made once per strategy and reused across steps (never re-seeded), so a
    replica's draws depend only on the seed, its id and its own past draws.
    """

    def __init__(self, devices, seed):
        self.seed = seed
        self._generators = tuple(
            _seeded(ReplicaGenerator(normalize_device(d), i, len(devices) == 1), derive_seed(seed, i))
            for i, d in enumerate(devices))

    def __getitem__(self, replica_id):
        return self._generators[replica_id]

    def get_state(self):
        """[uint8 CPU tensor] per replica (copies; torch.Generator.get_state)."""
        return [g.get_state() for g in self._generators]

    def set_state(self, states):
        """Restores every replica's generator from `get_state()`'s list; all or nothing.

        Raises:
          TypeError: `states` is not a list/tuple of uint8 torch tensors.
          ValueError: wrong number of states, or a state that does not fit its
            replica's generator (e.g. saved on other devices); no generator is changed.
        """
        if not isinstance(states, (list, tuple)):
            raise TypeError(f"set_rng_state expects a list of uint8 tensors (from get_rng_state), "
                            f"got {type(states).__name__}")
        if len(states) != len(self._generators):
            raise ValueError(f"set_rng_state got {len(states)} states for {len(self._generators)} replicas; "
                             "restore states saved from a strategy with the same devices")
        for i, s in enumerate(states):
            if not isinstance(s, torch.Tensor) or s.dtype != torch.uint8:
                raise TypeError(f"set_rng_state: state {i} must be a uint8 torch.Tensor (from get_rng_state), "
                                f"got {type(s).__name__} {getattr(s, 'dtype', '')}")
        previous = self.get_state()
        for i, (g, s) in enumerate(zip(self._generators, states)):
            try:
                g.set_state(own_copy(s))
            except (RuntimeError, ValueError, TypeError) as e:
                for g0, s0 in zip(self._generators, previous):
                    g0.set_state(s0)
                raise ValueError(f"set_rng_state: state {i} ({s.numel()} bytes) does not fit replica {i}'s "
                                 f"generator on {g.device} (saved from a strategy on other devices?): {e}") from None


def own_copy(state):
    """A CPU copy of `state` with storage of its own: torch's Generator.set_state crashes the process (SIGSEGV)
    on a view into a larger storage, e.g. one row of a gathered or stacked tensor."""
    return state.detach().to("cpu", copy=True)


def _seeded(gen, seed):
    gen.manual_seed(seed)
    return gen


class CallerState:
    """The caller thread's thread-local torch state, to be re-entered on each replica thread."""

    __slots__ = ("grad_enabled", "inference", "autocast", "run", "training", "profiler")

    def __init__(self, grad_enabled, inference, autocast, run=None, training=None, profiler=None):
        self.grad_enabled = grad_enabled
        self.inference = inference
        self.autocast = autocast  # ((device_type, dtype, cache_enabled), ...) for enabled types
        self.run = run if run is not None else object()  # this run call's token (replica_run_scope)
        self.training = training  # the layer-call mode (call context) in progress where run was called
        self.profiler = profiler  # the caller's default profiler (profiler_threads.CapturedProfiler), or None

    def enter(self, stack):
        """Enters this state on the current thread, on `stack` (a contextlib.ExitStack)."""
        if self.profiler is not None:  # first, so it is left last: the job's every op is recorded
            stack.enter_context(self.profiler.entered())
        if self.inference:
            stack.enter_context(torch.inference_mode(True))
        else:
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
        for device_type, dtype, cache in self.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=True, cache_enabled=cache))
        stack.enter_context(_tp.replica_run_scope(self.run))
        # The caller's mode, restored on leaving: a long-lived replica thread keeps no previous step's mode.
        stack.enter_context(_call_context.training_scope(self.training))


def capture_caller_state():
    """Captures the calling thread's grad mode, inference mode, autocast settings and layer-call
    `training` mode (so `strategy.run` called inside `model(x, training=True)` trains); a new run token.

    Call it once per `strategy.run` call: its replicas share the token.

    A default `torch.profiler.profile()` running on the caller
    (`torch._C._autograd._profiler_enabled()` is True only on the thread that
    started it) is captured too, so the replicas' ops and ranges are in its
    trace; only the profiler's own state crosses (`profiler_threads`), so a
    profiled run computes what an unprofiled one does. If dtape's small C++
    helper for that cannot be built (no compiler or ninja), a warning names
    the reason and the replica threads are not recorded. A profiler that
    records every thread (`profile_all_threads=True`) needs nothing carried.
    """
    return CallerState(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), _caller_autocast(), object(),
                       _call_context.current_training(), _caller_profiler())


def _caller_autocast():
    cache = torch.is_autocast_cache_enabled()
    return tuple((t, torch.get_autocast_dtype(t), cache)
                 for t in _AUTOCAST_DEVICE_TYPES if torch.is_autocast_enabled(t))


def _caller_profiler():
    """The calling thread's default profiler, captured for the replicas; None when none runs here."""
    if not _profiler_enabled():
        return None
    profiler, reason = profiler_threads.capture()
    if profiler is None:
        warnings.warn(_PROFILER_WARNING.format(reason=reason), UserWarning, stacklevel=5)
    return profiler


@contextlib.contextmanager
def replica_scope(strategy, replica_id, caller):
    """Enters, on the current (replica) thread, replica `replica_id`'s device and generator and `caller`'s state."""
    device = normalize_device(strategy.extended.worker_devices[replica_id])
    with contextlib.ExitStack() as stack:
        stack.enter_context(device_scope(device))
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
        stack.enter_context(generator_scope(strategy.replica_generator(replica_id)))
        caller.enter(stack)
        yield


__all__ = ["replica_scope", "capture_caller_state", "CallerState", "ReplicaGenerators", "ReplicaGenerator",
           "derive_seed", "check_seed"]
