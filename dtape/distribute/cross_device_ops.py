"""Reductions across replica devices inside one process.

Reductions are dtape ops (add_n, a device copy, casts), so a tape that
watches the replicas' values records them. Every value is moved to the
destination device explicitly (`copy_to_device`) before it is summed; sums
run in replica order on the destination device, so every replica receives
bit-identical results; float16/bfloat16 values are summed in float32 and
cast back, so a reduction overflows only when its result does.
`ThreadCollectives` is MirroredStrategy's flat all-reduce among its replica
threads (the engine behind `StrategyExtended._all_reduce_flat_async`):
launches are matched by order, the last replica to arrive sums.
Source: tensorflow/python/distribute/cross_device_ops.py.
"""
import threading

import torch

from dtape import ops
from dtape.backprop import profile_range
from dtape.distribute.interrupts import StepAborted
from dtape.distribute.reduce_util import ReduceOp
from dtape.ops.array_ops import copy_to_device, to_device
from dtape.tensor import convert_to_tensor, normalize_device


def on_device(value, device):
    return to_device(convert_to_tensor(value), device)


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def accumulation_dtype(dtype):
    """The dtype a reduction of `dtype` values accumulates in: float32 for float16/bfloat16."""
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def widen(value):
    """`value` cast to its accumulation dtype (a recorded cast), or unchanged."""
    acc = accumulation_dtype(value.dtype)
    return value if acc == value.dtype else ops.cast(value, acc)


def narrow(value, dtype):
    """`value` cast back to `dtype` after accumulating (a recorded cast), or unchanged."""
    return value if value.dtype == dtype else ops.cast(value, dtype)


def reduce_values(reduce_op, values, device=None):
    """Reduces one tensor per replica to one tensor on `device` (default: the first value's).

    Args:
      reduce_op: ReduceOp.SUM or ReduceOp.MEAN.
      values: sequence of same-shape tensors (any devices); each is copied
        to `device` first. float16/bfloat16 accumulate in float32.

    Returns:
      A new Tensor on `device`, of the values' dtype.

    Raises:
      ValueError: for an empty sequence or mismatched shapes.

    Shows in torch.profiler traces as the range "dtape.all_reduce".
    """
    if not values:
        raise ValueError("reduce_values: no values to reduce")
    with profile_range("dtape.all_reduce"):  # every collective's reduction: a named range
        return _reduce_values(reduce_op, [convert_to_tensor(v) for v in values], device)


def _reduce_values(reduce_op, values, device):
    shapes = {tuple(v.shape) for v in values}
    if len(shapes) > 1:
        raise ValueError(f"cannot reduce values of different shapes across replicas: {sorted(shapes)}; "
                         "every replica must produce the same shape")
    device = values[0].device if device is None else normalize_device(device)
    dtype = values[0].dtype
    values = [widen(on_device(v, device)) for v in values]
    total = ops.add_n(values) if len(values) > 1 else ops.identity(values[0])
    if reduce_op == ReduceOp.MEAN:
        total = total / len(values)
    return narrow(total, dtype)


def reduce_non_distributed_value(reduce_op, value, num_replicas):
    """Reduces a value that is not distributed (the same object on every replica, or a plain tensor).

    MEAN (or a single replica) gives the value itself; SUM over more than
    one replica is ambiguous (was it one value, or one per replica?) and
    raises, as TF's `reduce_non_distributed_value`.

    Returns:
      The value as a Tensor.

    Raises:
      ValueError: for SUM over more than one replica, naming the fixes.
    """
    if reduce_op == ReduceOp.MEAN or num_replicas == 1:
        return convert_to_tensor(value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        described = f"a {type(value).__name__} of shape {tuple(value.shape)} and dtype {value.dtype}"
    else:
        described = f"{type(value).__name__} {value!r:.40}"
    raise ValueError(
        f"cannot reduce a non-distributed value ({described}) with ReduceOp.SUM over {num_replicas} replicas: "
        "it is the same object on every replica (e.g. a tensor created outside the replica function), so "
        "its sum is ambiguous. Return or pass a per-replica value (a tensor computed inside the replica "
        "function), reduce with ReduceOp.MEAN to get the value itself, or multiply it by "
        "num_replicas_in_sync yourself")


def broadcast(value, devices):
    """One Tensor per device, each a distinct object: an identity on the value's own device, a copy elsewhere."""
    value = convert_to_tensor(value)
    if len(devices) == 1 and devices[0] == value.device:  # one replica on the value's device (an optimizer step)
        return (ops.identity(value),)
    out = []
    with profile_range("dtape.broadcast"):
        for d in devices:
            d = normalize_device(d)
            out.append(ops.identity(value) if value.device == d else copy_to_device(value, d))
    return tuple(out)


# -- flat all-reduce among replica threads (MirroredStrategy's collective engine) ----------
def fold_sum(tensors, device):
    """Sum of torch tensors on `device`, in list order, widened (as `reduce_values` and add_n: bit-identical)."""
    total = None
    for t in tensors:
        t = t.to(device)
        t = t.to(accumulation_dtype(t.dtype))
        total = t if total is None else total + t
    return total


def _same_memory(a, b):
    """True for two CPU devices ("cpu:0", "cpu:1" are one memory): the replicas share the
    (immutable) result instead of a copy each."""
    return a.type == "cpu" and b.type == "cpu"


class DoneHandle:
    """A handle whose result is already there (one replica: nothing to wait for)."""

    __slots__ = ("_result",)

    def __init__(self, result):
        self._result = list(result)

    def done(self):
        return True

    def wait(self, timeout=None):
        return self._result


class _Slot:
    """One collective in flight: every replica's contribution, then every replica's result."""

    __slots__ = ("seq", "parts", "arrived", "reduce_op", "tags", "result", "error", "finished")

    def __init__(self, seq, n):
        self.seq = seq
        self.parts = [None] * n
        self.arrived = 0
        self.reduce_op = [None] * n
        self.tags = [None] * n
        self.result = None
        self.error = None
        self.finished = False


class ThreadCollectiveHandle:
    """An all-reduce launched by one replica thread; `wait` gives this replica's results."""

    __slots__ = ("_group", "_slot", "_replica")

    def __init__(self, group, slot, replica_id):
        self._group, self._slot, self._replica = group, slot, replica_id

    def done(self):
        return self._slot.finished

    def wait(self, timeout=None):
        """This replica's reduced tensors (a list like the launched one, on this replica's device).

        Raises:
          The collective's error (mismatched contributions: ValueError);
          StepAborted if another replica failed or the step timed out (the
          step's TimeoutError, raised by `run`, names the replicas that never
          launched); TimeoutError after `timeout` (default: the strategy's
          timeout) plus the strategy's timeout seconds if the step's
          coordinator has not ended the step by then.
        """
        return self._group.wait(self._slot, self._replica, timeout)


class ThreadCollectives:
    """Flat all-reduce among the replica threads of one `MirroredStrategy.run` step.

    Replica r's k-th launch is matched with every other replica's k-th
    launch (as torch.distributed matches calls by order). The last replica
    to arrive sums the contributions on the first device, in replica order,
    widened (float16/bfloat16 in float32), so every replica gets bit-identical
    values equal to `reduce_values`; the others do not block at launch. Waits
    share the step coordinator's condition, so a replica that fails wakes
    every waiter (StepAborted) instead of leaving it to time out.
    """

    def __init__(self, coordinator, devices):
        self._coord = coordinator
        self._cond = coordinator.cond
        self._n = coordinator.n
        self._devices = tuple(normalize_device(d) for d in devices)
        self._seq = [0] * self._n
        self._slots = {}

    def launch(self, replica_id, reduce_op, tensors, tag=None):
        """Contributes `tensors` (torch tensors) as replica `replica_id`; returns a ThreadCollectiveHandle.

        `tag`: None, or what the caller's contribution stands for, with a method `mismatch(tags)` (every
        replica's tag, this one first) -> an error message or None: checked before the sum, so that every
        replica raises that ValueError and nothing is summed (gradient buckets: which variable is where).
        """
        with self._coord.shielded(replica_id):
            return self._launch(replica_id, reduce_op, tensors, tag)

    def _launch(self, replica_id, reduce_op, tensors, tag=None):
        with self._cond:
            if self._coord.aborted:  # an abandoned replica still running: it must not complete a collective
                raise StepAborted(f"replica {replica_id}: step aborted before this all-reduce")
            seq = self._seq[replica_id]
            self._seq[replica_id] = seq + 1
            slot = self._slots.get(seq)
            if slot is None:
                slot = self._slots[seq] = _Slot(seq, self._n)
            slot.parts[replica_id] = list(tensors)
            slot.reduce_op[replica_id] = reduce_op
            slot.tags[replica_id] = tag
            slot.arrived += 1
            last = slot.arrived == self._n
            if last:
                del self._slots[seq]
        if last:  # reduce outside the lock: other replicas keep launching and walking
            try:
                result, error = self._reduce(seq, slot), None
            except Exception as e:  # noqa: BLE001 - handed to every waiting replica
                result, error = None, e
            with self._cond:
                slot.result, slot.error, slot.finished = result, error, True
                self._cond.notify_all()
        return ThreadCollectiveHandle(self, slot, replica_id)

    def _reduce(self, seq, slot):
        _check_same_collective(seq, slot)
        out = [[] for _ in range(self._n)]
        for k in range(len(slot.parts[0])):
            column = [slot.parts[r][k] for r in range(self._n)]
            total = fold_sum(column, self._devices[0])
            if slot.reduce_op[0] == ReduceOp.MEAN:
                total = total / self._n
            total = total.to(column[0].dtype)
            for r in range(self._n):
                dev = self._devices[r]
                out[r].append(total if r == 0 and total.device == dev or _same_memory(total.device, dev)
                              else total.to(dev, copy=True))
        return out

    def wait(self, slot, replica_id, timeout):
        with self._coord.shielded(replica_id):
            return self._wait(slot, replica_id, timeout)

    def _wait(self, slot, replica_id, timeout):
        coord = self._coord
        timeout = coord.timeout if timeout is None else timeout

        def ended():
            return slot.finished or coord.aborted or any(e is not None for e in coord.errors)
        with self._cond:
            coord.in_collective[replica_id] = slot.seq  # the step's timeout names who waits where
            try:
                ok = self._cond.wait_for(ended, timeout)
                if not ok:
                    # The step's coordinator times out too and names the replicas that never launched; its
                    # verdict is the step's error. This replica times out on its own only if it gets none.
                    ok = self._cond.wait_for(ended, coord.timeout)
            finally:
                coord.in_collective.pop(replica_id, None)
            if slot.finished:
                if slot.error is not None:
                    raise slot.error
                return slot.result[replica_id]
        if ok:
            raise StepAborted(f"replica {replica_id}: step aborted while waiting for an all-reduce")
        missing = [r for r in range(self._n) if slot.parts[r] is None]
        raise TimeoutError(f"replica {replica_id} waited {timeout + coord.timeout:g} s for all-reduce #{slot.seq} "
                           f"that replicas {missing} never launched; every replica must make the same collective "
                           "calls in the same order (the same tape.gradient sources and apply_gradients var_list)")


def _check_same_collective(seq, slot):
    message = slot.tags[0].mismatch(slot.tags) if slot.tags[0] is not None else None
    if message is not None:
        raise ValueError(message)
    sigs = [(op, tuple((t.numel(), t.dtype) for t in parts)) for op, parts in zip(slot.reduce_op, slot.parts)]
    if any(s != sigs[0] for s in sigs[1:]):
        described = "; ".join(f"replica {r}: {s[0].name} of {list(s[1])}" for r, s in enumerate(sigs))
        raise ValueError(f"all-reduce #{seq} got different contributions from the replicas ({described}); "
                         "every replica must make the same collective calls in the same order, with the same "
                         "sizes (the same tape.gradient sources and apply_gradients var_list)")


# A plain lock, not the step's Condition: `with` on a Condition runs Python code after acquiring, where an
# asynchronous abort of the replica could land with the lock held.
_collectives_lock = threading.Lock()


def thread_collectives(coordinator, devices):
    """The ThreadCollectives of one `run` step: made on first use, kept on the step's coordinator
    (`coordinator.collectives`), which drops it when the step ends."""
    with _collectives_lock:
        if coordinator.collectives is None:
            coordinator.collectives = ThreadCollectives(coordinator, devices)
        return coordinator.collectives


__all__ = ["reduce_values", "reduce_non_distributed_value", "broadcast", "copy_to_device", "widen", "narrow",
           "accumulation_dtype", "fold_sum", "DoneHandle", "ThreadCollectives", "thread_collectives"]
