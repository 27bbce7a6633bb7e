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
device (a bucket), the results split back to the gradients' shapes.
Source: torch.library.custom_op (torch's functional collectives take the
same route: a custom op with a fake implementation).
"""
import torch

from dtape.distribute import context
from dtape.distribute.reduce_util import ReduceOp

__all__ = ["all_reduce_sum", "reduce_gradients"]


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


def reduce_gradients(grads):
    """[SUM over replicas of each gradient] (torch tensors or None), one `all_reduce_sum` per bucket of one
    dtype and device; None stays None. Traceable: the graph holds one op per bucket."""
    buckets = {}
    for k, g in enumerate(grads):
        if g is not None:
            buckets.setdefault((g.dtype, g.device), []).append(k)
    out = list(grads)
    for members in buckets.values():
        flat = torch.cat([grads[k].reshape(-1) for k in members])
        total = all_reduce_sum(flat)
        for k, piece in zip(members, torch.split(total, [grads[k].numel() for k in members])):
            out[k] = piece.reshape(grads[k].shape)
    return out
