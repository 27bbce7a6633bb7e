"""Cross-replica reductions as torch custom ops, so a traced or compiled replica step holds each as one op.

`torch.ops.dtape.all_reduce_sum(t)` (also `all_reduce_sum(t)` here) is the
SUM of `t` over the replicas of the calling thread's replica context: what
`ReplicaContext.all_reduce(SUM, t)` computes, through the strategy's own
flat all-reduce (`StrategyExtended._all_reduce_flat`: MirroredStrategy's
thread rendezvous, MultiWorkerMirroredStrategy's torch.distributed
all_reduce with its failure detection and timeouts). Its fake (meta)
implementation only gives the shape, dtype and device of `t`, so
`make_fx` / `torch.compile` trace through it as a single node; the
reduction itself runs when the graph runs, on the replica's thread or
worker, so every replica must run the graph (it is a collective).

`reduce_gradients(grads)` is the traceable counterpart of the gradient
reduction in `Optimizer.apply_gradients`: one flat all-reduce per dtype and
device (a bucket), the results in the gradients' shapes. It is split in two
ops, `torch.ops.dtape.all_reduce_start(tensors) -> token` (launches the
strategy's asynchronous flat all-reduce, `_all_reduce_flat_async`, and
returns at once) and `torch.ops.dtape.all_reduce_wait(token, tensors)`
(waits for it, with the strategy's timeout), so that `overlap_reductions`, a
pass over the traced graph, can re-bucket the gradients in the order the
walk produces them (GradientSync's caps) and move each start right after its
last gradient and each wait right before the first use of its sums: the
all-reduces then run while the rest of the walk does.
Source: torch.library.custom_op (torch's functional collectives take the
same route: a custom op with a fake implementation, and a separate wait op,
`_c10d_functional.all_reduce` / `wait_tensor`); DDP's readiness buckets.
"""
import itertools
import operator
from typing import List, Optional

import torch

from dtape import _jit
from dtape.distribute import context
from dtape.distribute.cross_device_ops import DoneHandle
from dtape.distribute.gradient_sync import DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_CAP_MB, plan_buckets
from dtape.distribute.reduce_util import ReduceOp

__all__ = ["all_reduce_sum", "all_reduce_start", "all_reduce_wait", "reduce_gradients", "overlap_reductions"]


@torch.library.custom_op("dtape::all_reduce_sum", mutates_args=())
def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """The SUM of `t` over the replicas of the current replica context (a new tensor, `t`'s shape, dtype and
    device; float16/bfloat16 accumulate in float32, as the strategy's all-reduce).

    Outside a replica context, or with one replica in sync, a copy of `t`.
    Every replica must call it, in the same order, with the same shape and
    dtype (it is a collective); a missing replica makes the others fail
    after the strategy's timeout, naming it, as every dtape collective.

    Raises:
      TypeError: `t` is not floating point (the strategies reduce floats).
    """
    if not t.is_floating_point():
        raise TypeError(f"dtape.all_reduce_sum reduces floating tensors, got {t.dtype}; cast it first "
                        "(e.g. t.to(torch.float32))")
    rctx = context.get_replica_context()
    if rctx is None or rctx.num_replicas_in_sync == 1:
        return t.clone()
    (total,) = rctx.strategy.extended._all_reduce_flat(ReduceOp.SUM, [t.detach().reshape(-1)])
    # a fresh tensor per replica: the result may be written in place by this replica's graph
    return total.reshape(t.shape).to(t.device).clone()


@all_reduce_sum.register_fake
def _(t):
    if not t.is_floating_point():
        raise TypeError(f"dtape.all_reduce_sum reduces floating tensors, got {t.dtype}")
    return torch.empty_like(t)


def _all_reduce_sum_backward(ctx, grad):
    return all_reduce_sum(grad)  # the transpose of a SUM over replicas is a SUM (jax.lax.psum's)


all_reduce_sum.register_autograd(_all_reduce_sum_backward)


# token -> pending handle of the all-reduces launched by `all_reduce_start` and not yet waited
# for; process-wide (the replica threads of a MirroredStrategy run one compiled graph at once), the tokens
# unique (itertools.count's next is atomic under the GIL)
_PENDING = {}
_TOKENS = itertools.count(1)


def _check_bucket(tensors, op):
    if not tensors:
        raise ValueError(f"dtape.{op} needs at least one tensor")
    first = tensors[0]
    for t in tensors:
        if not t.is_floating_point():
            raise TypeError(f"dtape.{op} reduces floating tensors, got {t.dtype}; cast it first "
                            "(e.g. t.to(torch.float32))")
        if t.dtype != first.dtype or t.device != first.device:
            raise ValueError(f"dtape.{op} takes one bucket: tensors of one dtype and device, got {first.dtype} "
                             f"on {first.device} and {t.dtype} on {t.device}; call it once per dtype and device")


# Tagged nondeterministic_seeded: the tag of ops whose place in the program matters (random draws), which
# torch's passes neither merge (CSE) nor move towards their consumers (inductor's reorder_for_locality would
# otherwise pull each launch down to its wait, after the walk, undoing `overlap_reductions`).
@torch.library.custom_op("dtape::all_reduce_start", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def all_reduce_start(tensors: List[torch.Tensor]) -> torch.Tensor:
    """Launches the SUM over the replicas of `tensors` (one bucket: one dtype and device, flattened into one
    buffer) and returns at once a token (an int64 scalar on the CPU) for `all_reduce_wait`.

    A collective, as `all_reduce_sum`: every replica launches the same
    buckets in the same order, and waits for each token exactly once.

    Raises:
      TypeError: a tensor is not floating point. ValueError: no tensors, or several dtypes or devices.
    """
    _check_bucket(tensors, "all_reduce_start")
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    rctx = context.get_replica_context()
    if rctx is None or rctx.num_replicas_in_sync == 1:
        handle = DoneHandle([flat])
    else:  # the buffer is ours: the strategy may reduce it in place
        handle = rctx.strategy.extended._all_reduce_flat_async(ReduceOp.SUM, [flat], scratch=True)
    token = next(_TOKENS)
    _PENDING[token] = handle
    return torch.tensor(token, dtype=torch.int64)


@all_reduce_start.register_fake
def _(tensors):
    _check_bucket(tensors, "all_reduce_start")
    return torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("dtape::all_reduce_wait", mutates_args=())
def all_reduce_wait(token: torch.Tensor, dims: List[int], ranks: List[int], dtype: torch.dtype,
                    device: torch.device, not_before: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """Waits for the all-reduce `token` launched (`all_reduce_start(tensors)`); returns the sums, new tensors
    shaped as `tensors` (given as `ranks`, each tensor's number of dims, and `dims`, all their sizes in a
    row: `bucket_layout(tensors)`), of `dtype` on `device`.

    `not_before` is not read: an input that makes a compiled graph compute it
    before this wait (the scheduler would otherwise move a wait up to its start).

    Raises:
      KeyError: `token` was not launched on this process, or was waited for already.
      TimeoutError (after the strategy's timeout) or the failing replica's error, as every dtape collective.
    """
    handle = _PENDING.pop(int(token), None)
    if handle is None:
        raise KeyError(f"dtape.all_reduce_wait: no all-reduce in flight for token {int(token)}; wait once for "
                       "each token all_reduce_start returned, on the process that launched it")
    (total,) = handle.wait()  # the strategy's timeout and failure reports (its handles' default)
    shapes = _shapes(dims, ranks)
    pieces = torch.split(total, [_numel(s) for s in shapes])
    # fresh tensors: the pieces share one buffer (and, across CPU replica threads, one sum)
    return [p.reshape(s).to(device, dtype).clone() for p, s in zip(pieces, shapes)]


@all_reduce_wait.register_fake
def _(token, dims, ranks, dtype, device, not_before=None):
    return [torch.empty(s, dtype=dtype, device=device) for s in _shapes(dims, ranks)]


def bucket_layout(tensors):
    """(dims, ranks, dtype, device) of `tensors` (one bucket), the arguments of `all_reduce_wait` after the token."""
    return ([d for t in tensors for d in t.shape], [t.dim() for t in tensors], tensors[0].dtype, tensors[0].device)


def _shapes(dims, ranks):
    it = iter(dims)
    return [[next(it) for _ in range(r)] for r in ranks]


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def reduce_gradients(grads):
    """[SUM over replicas of each gradient] (torch tensors or None), one `all_reduce_start` and
    `all_reduce_wait` per bucket of one dtype and device; None stays None. Traceable: the graph holds one
    pair of ops per bucket, which `overlap_reductions` may split and move."""
    buckets = {}
    for k, g in enumerate(grads):
        if g is not None:
            buckets.setdefault((g.dtype, g.device), []).append(k)
    out = list(grads)
    for members in buckets.values():
        bucket = [grads[k] for k in members]
        for k, total in zip(members, all_reduce_wait(all_reduce_start(bucket), *bucket_layout(bucket))):
            out[k] = total
    return out


_START = torch.ops.dtape.all_reduce_start.default
_WAIT = torch.ops.dtape.all_reduce_wait.default


def overlap_reductions(graph_module, bucket_cap_mb=None, first_bucket_cap_mb=None):
    """Re-buckets and moves the traced gradient all-reduces of `graph_module` (a torch.fx.GraphModule from
    make_fx) so that they overlap the rest of the walk; returns the number of buckets made (0: none).

    Each `all_reduce_start`/`all_reduce_wait` pair is replaced by buckets of
    its tensors in the order the graph produces them (their readiness in
    the walk), capped as GradientSync's (`bucket_cap_mb`, default 25;
    `first_bucket_cap_mb`, default 1, so the first goes out early); each
    bucket's start is placed right after its last tensor is computed and its
    wait right before the first op using one of its sums, taking the last
    start's token (launched after the walk's last gradient) as `not_before`,
    so that a compiler's scheduler moves no wait up into the walk or before
    a launch, where it would block them. The buckets are
    a function of the graph alone, so every replica running it launches the
    same all-reduces in the same order. The sums are the same numbers
    (a SUM of each element, in another flat layout).
    """
    cap = float(DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * 2 ** 20
    first = float(DEFAULT_FIRST_BUCKET_CAP_MB if first_bucket_cap_mb is None else first_bucket_cap_mb) * 2 ** 20
    graph = graph_module.graph
    pairs = [(n.args[0], n) for n in graph.nodes if n.target is _WAIT and _movable(n)]
    made = 0
    for start, wait in pairs:
        order = {n: i for i, n in enumerate(graph.nodes)}
        made += _split_pair(graph, order, start, wait, cap, first)
    if pairs:
        graph.lint()
        graph_module.recompile()
    return made


def _movable(wait):
    """Whether `wait` is a wait of its own start's tensors whose sums are only indexed (the traced form)."""
    start = wait.args[0]
    return (getattr(start, "target", None) is _START and len(start.users) == 1
            and all(u.target is operator.getitem for u in wait.users))


def _split_pair(graph, order, start, wait, cap, first_cap):
    tensors = list(start.args[0])
    picks = {u.args[1]: u for u in wait.users}  # index -> the getitem node of that sum
    ready = sorted(range(len(tensors)), key=lambda k: order[tensors[k]])
    items = [(k, tuple(tensors[k].meta["val"].shape), tensors[k].meta["val"].dtype,
              tensors[k].meta["val"].device) for k in ready]
    buckets = plan_buckets(items, cap, first_cap)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    starts = []
    for bucket in buckets:
        inputs = [tensors[m[0]] for m in bucket.members]
        with graph.inserting_after(max(inputs, key=order.get)):
            starts.append(graph.call_function(_START, (inputs,)))
    for bucket, new_start in zip(buckets, starts):
        members = [m[0] for m in bucket.members]
        users = [u for k in members if k in picks for u in picks[k].users]
        with graph.inserting_before(min(users, key=order.get) if users else output):
            # after the last launch (itself after the walk's last gradient), so that no wait blocks a launch
            new_wait = graph.call_function(_WAIT, (new_start, *bucket_layout([tensors[k].meta["val"] for k in members]),
                                                   starts[-1]))
            for j, k in enumerate(members):
                if k in picks:
                    picks[k].replace_all_uses_with(graph.call_function(operator.getitem, (new_wait, j)))
    for node in list(picks.values()) + [wait, start]:
        graph.erase_node(node)
    return len(buckets)


# The pass every compiled step graph goes through (dtape._jit.GRAPH_PASSES); OVERLAP = False keeps the traced
# buckets where apply_gradients made them (after the whole walk), e.g. to measure what the overlap gives.
OVERLAP = True
OVERLAP_BUCKET_CAP_MB = DEFAULT_BUCKET_CAP_MB
OVERLAP_FIRST_BUCKET_CAP_MB = DEFAULT_FIRST_BUCKET_CAP_MB


def _overlap_pass(graph_module):
    if OVERLAP:
        overlap_reductions(graph_module, OVERLAP_BUCKET_CAP_MB, OVERLAP_FIRST_BUCKET_CAP_MB)


_jit.GRAPH_PASSES.append(_overlap_pass)
