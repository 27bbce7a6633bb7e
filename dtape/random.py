"""Random numbers from the current replica's generator.

Each thread may install its own `torch.Generator` (`generator_scope`); a
strategy gives every replica thread one, on its device, seeded from the
strategy's seed and the replica id, so replicas never share random state and
identically seeded runs draw identical numbers whatever the thread schedule.
Outside any scope torch's default generator for the device is used (seeded
by `torch.manual_seed`).

Source: tf.random (uniform, normal, categorical) and the per-replica
`tf.random.Generator` / `split` model of tf.distribute.
"""
import threading

import torch

from dtape._local import ThreadLocalScope
from dtape._sizes import shape_values
from dtape.tensor import DEFAULT_FLOAT_DTYPE, Tensor, as_dtype, convert_to_tensor, default_device


class _GeneratorState(threading.local):
    """Per-thread generator (None: torch's default generator of the device)."""

    generator = None
    live = None   # (generator, torch's default generator holding its state) inside `live_stream`


_gen_state = _GeneratorState()


class generator_scope(ThreadLocalScope):
    """Thread-local: draws on this thread use `generator` (a torch.Generator) inside the block."""

    __slots__ = ()
    _state = _gen_state
    _attr = "generator"


class live_stream(ThreadLocalScope):
    """Thread-local: inside the block torch's default generator `(generator, torch_generator)[1]` holds
    `generator`'s state (`ops._dispatch.ReplicaStream`), so draws that would use `generator` use it instead
    (the generator's own state is stale until it is copied back)."""

    __slots__ = ()
    _state = _gen_state
    _attr = "live"


def live_generator(generator):
    """The torch generator holding `generator`'s stream on this thread (inside `live_stream`), else None."""
    live = _gen_state.live
    return live[1] if live is not None and live[0] is generator else None


def stream_owner(generator):
    """The generator whose stream `generator` draws on this thread: the replica's generator for torch's default
    one inside `live_stream`, else `generator` itself (its `replica_id` is the replica's)."""
    live = _gen_state.live
    return live[0] if live is not None and live[1] is generator else generator


def has_thread_generator():
    """True inside a `generator_scope` (every replica thread of a strategy): this thread draws from its own
    generator, not from torch's default ones."""
    return _gen_state.generator is not None


def thread_generator():
    """This thread's own generator (a replica's: the innermost `generator_scope`'s), or None."""
    return _gen_state.generator


def get_generator(device=None):
    """The generator random ops use on this thread for `device` (default: the scope's device).

    The thread's own generator (a replica's) when its device type matches
    (torch's default generator while it holds the replica's stream, in a lone
    replica's wrapped-module forward), else torch's default generator of that
    device.
    """
    device = default_device(device)
    gen = _gen_state.generator
    if gen is not None and gen.device.type == device.type:
        held = live_generator(gen)  # inside a lone replica's forward torch's generator holds the live state
        return gen if held is None else held
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


def _dtype(dtype):
    return DEFAULT_FLOAT_DTYPE if dtype is None else as_dtype(dtype)


def _shape(shape):
    return shape_values(shape, "dtape.random", scalar=True)


def _seeded(seed, device):
    if seed is None:
        return get_generator(device)
    return torch.Generator(device=device).manual_seed(int(seed))


def uniform(shape, minval=0.0, maxval=1.0, dtype=None, seed=None, device=None):
    """Samples from U[minval, maxval).

    Args:
      shape: output shape (ints).
      minval, maxval: Python numbers, the range.
      dtype: floating torch dtype (default float32).
      seed: int: a private generator seeded with it, so every call with this seed
        draws the same numbers (stateless, like tf.random.stateless_uniform; TF 2's
        op seeds instead give a new draw per call). None: the replica's generator.
      device: default the current `dtape.device` scope's, else the CPU.

    Returns:
      A Tensor of `shape` and `dtype` on `device` (never recorded: no gradient).

    Source: tf.random.uniform.
    """
    device = default_device(device)
    t = raw_uniform(_shape(shape), _dtype(dtype), device, _seeded(seed, device))
    return Tensor(t * (maxval - minval) + minval)


def normal(shape, mean=0.0, stddev=1.0, dtype=None, seed=None, device=None):
    """Samples from N(mean, stddev^2).

    Args: as `uniform`. Returns: a Tensor of `shape` and `dtype` on `device`.
    Source: tf.random.normal.
    """
    device = default_device(device)
    # torch.randn's draws, as torch.randn runs them; unlike torch.randn with a generator, this traces with the
    # symbolic sizes of a compiled function's None dims
    t = torch.empty(_shape(shape), dtype=_dtype(dtype), device=device).normal_(generator=_seeded(seed, device))
    return Tensor(t * stddev + mean)


def categorical(logits, num_samples, dtype=torch.int64, seed=None):
    """Draws class indices from the unnormalised log-probabilities `logits`.

    Args:
      logits: [batch, num_classes] floating tensor.
      num_samples: samples per row.
      dtype: integer dtype of the result (default int64).
      seed: int: stateless, the same draw on every call (see `uniform`); None: the replica's generator.

    Returns:
      [batch, num_samples] Tensor of `dtype` on logits' device.

    Source: tf.random.categorical.
    """
    logits = convert_to_tensor(logits).torch()
    if logits.dim() != 2:
        raise ValueError(f"categorical: logits must be [batch, num_classes], got shape {tuple(logits.shape)}")
    probs = torch.softmax(logits.to(torch.float64), dim=-1)
    out = torch.multinomial(probs, int(num_samples), replacement=True,
                            generator=_seeded(seed, logits.device))
    return Tensor(out.to(as_dtype(dtype)))


def set_seed(seed):
    """Seeds the global random state: torch's default generators on every device (`torch.manual_seed`).

    Draws outside a strategy, layer initializers and every strategy built afterwards (its replica
    generators are seeded from the default generator when no `seed=` is given) then repeat from run to
    run. Replica generators of a strategy that already exists are not re-seeded (give it `seed=`).

    Args:
      seed: int in [0, 2**63 - 1].

    Raises:
      TypeError: if `seed` is not an int (a 0-d integer tensor is accepted).

    Source: tf.random.set_seed (global seed; TF's per-op seeds map to the `seed=` arguments above).
    """
    if isinstance(seed, Tensor):
        seed = seed.torch().item()
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"set_seed: seed must be an int, got {type(seed).__name__}")
    torch.manual_seed(seed)


def raw_uniform(shape, dtype, device, generator):
    """torch.rand's draws (a raw torch tensor) as `empty().uniform_()`, which is what torch.rand runs and,
    unlike torch.rand with a generator, traces with the symbolic sizes of a compiled function's None dims."""
    return torch.empty(shape, dtype=dtype, device=device).uniform_(0, 1, generator=generator)


def bernoulli_mask(shape, keep_prob, dtype, device):
    """A raw torch mask of `shape`: 1/keep_prob with probability keep_prob, else 0 (dropout's)."""
    keep = raw_uniform(_shape(shape), None, device, get_generator(device)) < keep_prob
    return keep.to(dtype) / keep_prob


__all__ = ["uniform", "normal", "categorical", "set_seed", "get_generator", "generator_scope", "has_thread_generator",
           "thread_generator"]
