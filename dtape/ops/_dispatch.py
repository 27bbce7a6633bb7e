"""torch interop: `__torch_function__`, the autograd fallback, and operators.

A torch function called on dtape tensors runs the registered op for it
(TORCH_TABLE) or, with no registered gradient, the fallback: the function on
the raw tensors, run under torch's autograd when a tape records it; the
record keeps torch's graph and its backward asks `torch.autograd.grad` for
the vector-Jacobian product (the forward never runs twice). A recorded
backward walk takes that product with `create_graph=True` and records it in
turn, so fallback derivatives compose to any order.
A random function (dropout, attention with dropout) runs on a private
stream seeded from the calling replica's generator, so replicas draw
reproducibly whatever the thread schedule.
"""
import gc
import itertools
import operator
import sys
import sysconfig
import threading

import torch
import torch.nn.functional as F
from torch.autograd.graph import _engine_run_backward
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import CheckpointFunction

from dtape import random as _random
from dtape import tape as _tp
from dtape.ops._registry import TORCH_TABLE, Tensor, check_no_autograd_input
from dtape.tensor import is_variable


_REENTRANT_CHECKPOINT = CheckpointFunction._backward_cls  # the node reentrant torch.utils.checkpoint leaves
# CPython counts a reference to a Python-defined class per live instance, and torch's node of a reentrant
# checkpoint holds its Python instance: a count no higher than with no instance alive means no graph holds
# one, and the walk skips the search (a Python pass over every node of a kept graph, each step). A
# free-threaded build counts a class's references per thread, with its GIL on or off (PYTHON_GIL=1, or an
# extension module that turned it on): it always searches.
_COUNTS_INSTANCES = hasattr(sys, "getrefcount") and not sysconfig.get_config_var("Py_GIL_DISABLED")
_IDLE_COUNT_TRIES = 8


def _idle_checkpoint_refs():
    """The class's reference count less one per instance alive now: a node alive at import (a graph made
    before, or one in a reference cycle) would otherwise count as idle, and its freeing at the moment a
    tape's node is made would leave the count at that idle one: no search, and torch.autograd.grad fails."""
    for _ in range(_IDLE_COUNT_TRIES):  # another thread may make or free a node between the two counts
        refs = sys.getrefcount(_REENTRANT_CHECKPOINT)
        alive = sum(type(r) is _REENTRANT_CHECKPOINT for r in gc.get_referrers(_REENTRANT_CHECKPOINT))
        if sys.getrefcount(_REENTRANT_CHECKPOINT) == refs:
            return refs - alive
    return 0  # never steady: every count is above it, so the walk always searches


_checkpoint_refs_idle = [_idle_checkpoint_refs() if _COUNTS_INSTANCES else 0]


def _is_diff(t):
    return t.dtype.is_floating_point or t.dtype.is_complex


class TorchFallback(_tp.RecordOp):
    """Record op for a torch function without a registered gradient: it keeps torch's own autograd graph.

    When a tape records the call, the function runs once on detached
    aliases of its floating inputs that require grad (`leaves`), so torch
    builds its autograd graph during the forward; the record keeps the
    outputs that carry it (`outs`) and saves no tensor of its own: memory is
    what torch's graph saves, and autocast, views and torch's in-place checks
    (the aliases share the inputs' version counters) mean what they mean in
    torch. The backward asks torch once for the vector-Jacobian product of
    the inputs the walk needs. A recorded walk (higher order) asks with
    `create_graph=True` and records that call as one more op over torch's
    graph (inputs and upstream gradients), so derivatives compose to any
    order without running the forward again.
    """

    __slots__ = ("name", "func", "spec", "leaves", "positions", "seed", "graph_in", "outs", "in_ids", "shared")
    saves_inputs = False   # torch's graph holds what the backward reads
    saves_outputs = False
    raw_saved = True       # nothing saved to rebuild: the rule reads only torch's graph

    def __init__(self, func, spec, leaves, positions, seed=None):
        name = getattr(func, "__name__", None)  # repr only without one (getattr's default is always built)
        self.name = repr(func) if name is None else name
        self.func = func
        self.spec = spec
        self.leaves = leaves          # flat args/kwargs with tensors replaced by None
        self.positions = positions    # where the tensor inputs go in `leaves`
        self.seed = seed              # random functions: (seed, devices) of their private stream
        self.graph_in = None          # per input: the alias that requires grad (None: not differentiable)
        self.outs = None              # per recorded output: the torch output carrying the graph, or None
        self.in_ids = None            # the inputs' tensor ids (a higher-order record connects to them)
        self.shared = False           # recorded on more than one tape: each walk keeps the graph

    def call_raw(self, tensors):
        leaves = list(self.leaves)
        for pos, t in zip(self.positions, tensors):
            leaves[pos] = t
        args, kwargs = unflatten_args(leaves, self.spec)
        if self.seed is None:
            return self.func(*args, **kwargs)
        with _seeded(*self.seed):
            return self.func(*args, **kwargs)

    def call_graph(self, tensors, differentiable=None):
        """Runs the function on aliases of `tensors` that require grad (floating ones; of those, where
        `differentiable` is given, the ones it marks True); returns its output (with grad_fn)."""
        self.graph_in = [t.detach().requires_grad_() if t.dtype.is_floating_point or t.dtype.is_complex else None
                         for t in tensors]  # _is_diff, inline: a wrapped module has one input per parameter
        if differentiable is not None:
            self.graph_in = [g if d else None for g, d in zip(self.graph_in, differentiable)]
        with torch.enable_grad():
            return self.call_raw([t if g is None else g for t, g in zip(tensors, self.graph_in)])

    def backward(self, dys, outputs, inputs, attrs, raw, needs):
        return graph_vjp(self, dys, raw, needs)

    def recorded_again(self):
        self.shared = True


def graph_vjp(op, dys, raw, needs):
    """Input gradients from the torch graph an op kept (`op.graph_in`, `op.outs`, `op.in_ids`, `op.shared`).

    One `torch.autograd.grad` call over the outputs that carry a graph and
    the inputs the walk needs. It frees torch's graph as it goes when this is
    the only walk that will read it (the last walk of the one tape that
    recorded the op), else keeps it. On a recorded walk the call builds the
    gradient's own graph and is recorded as a `_GraphGrad` op.
    """
    n = len(op.graph_in)
    pairs = [(o, dy) for o, dy in zip(op.outs, dys) if o is not None and dy is not None]
    wrt = [k for k in range(n) if needs[k] and op.graph_in[k] is not None]
    if not pairs or not wrt:
        return (None,) * n
    if not raw:
        return _recorded_vjp(op, pairs, wrt, n)
    outs = [o for o, _ in pairs]
    grad_outs = [dy if dy.dtype == o.dtype else dy.to(o.dtype) for o, dy in pairs]
    retain = op.shared or not _tp.walk_frees()
    leaves = [op.graph_in[k] for k in wrt]
    try:
        if _may_hold_reentrant_checkpoint() and _has_reentrant_checkpoint(outs):
            grads = _grads_by_backward(outs, leaves, grad_outs, retain)
        else:
            grads = _grad(outs, leaves, grad_outs, retain)
    except RuntimeError as e:
        raise _named(e, op) from e
    if not retain:
        op.outs = op.graph_in = None  # torch freed the graph: nothing else may ask it
    full = [None] * n
    for k, g in zip(wrt, grads):
        full[k] = g
    return tuple(full)


_next_edges = operator.attrgetter("next_functions")
_edge_node = operator.itemgetter(0)


def _may_hold_reentrant_checkpoint():
    """False if no reentrant `torch.utils.checkpoint` node is alive in this process (so none is in any graph);
    True if one may be (the count is only ever higher than the idle one: a reference held elsewhere, say)."""
    if not _COUNTS_INSTANCES:
        return True
    refs = sys.getrefcount(_REENTRANT_CHECKPOINT)
    if refs < _checkpoint_refs_idle[0]:  # a reference held at import was dropped since: the idle count is lower
        _checkpoint_refs_idle[0] = refs
    return refs > _checkpoint_refs_idle[0]


def _has_reentrant_checkpoint(outs):
    """True if torch's graph behind `outs` holds a reentrant `torch.utils.checkpoint` node.

    Such a node refuses `torch.autograd.grad` (it only runs under a plain
    `backward()`), so the walk must take that path; the search is over the
    op's own graph, which ends at its private input aliases. It runs on every
    walk of a kept graph (a whole module's, for a TorchModule), so it goes
    breadth first a level at a time, each level's nodes, types and edges
    gathered by builtins (a few calls a level, not a few per node: a small
    GPT's graph is ~100 nodes in ~20 levels); each node is visited once.
    """
    seen = {None}  # an edge to an input that needs no gradient has no node
    level = {o.grad_fn for o in outs} - seen
    while level:
        if _REENTRANT_CHECKPOINT in set(map(type, level)):
            return True
        seen |= level
        level = set(map(_edge_node, itertools.chain.from_iterable(map(_next_edges, level))))
        level -= seen
    return False


_PLAIN = frozenset([torch.Tensor])


def _grad(outs, leaves, grad_outs, retain):
    """`torch.autograd.grad(outs, leaves, grad_outs, allow_unused=True, retain_graph=retain)`, straight to
    torch's engine (as `grad` calls it) when its Python-side work is a no-op: plain tensors (no
    `__torch_function__` override), each upstream gradient of its output's shape and dtype (what `grad`
    checks; callers convert the dtype), not while dynamo traces. `grad`'s per-tensor checks cost more
    Python calls than a small graph's whole backward."""
    if set(map(type, outs)) <= _PLAIN and set(map(type, leaves)) <= _PLAIN and not torch.compiler.is_compiling():
        for o, g in zip(outs, grad_outs):
            if o.shape != g.shape or o.dtype != g.dtype or o.is_nested:
                break
        else:
            return _engine_run_backward(tuple(outs), tuple(grad_outs), retain, False, tuple(leaves), True,
                                        accumulate_grad=False)
    return torch.autograd.grad(outs, leaves, grad_outs, allow_unused=True, retain_graph=retain)


def _grads_by_backward(outs, leaves, grad_outs, retain):
    """The gradients of `leaves` (private aliases) by a plain `backward()`, read from their `.grad`."""
    for leaf in leaves:
        leaf.grad = None
    torch.autograd.backward(outs, grad_outs, retain_graph=retain)
    grads = tuple(leaf.grad for leaf in leaves)
    for leaf in leaves:
        leaf.grad = None
    return grads


def _named(error, op):
    """torch's error from the backward of a kept graph, naming the dtape op (torch names only its own node)."""
    if "modified by an inplace operation" in str(error):
        return RuntimeError(f"a tensor saved for the gradient of op {op.name!r} was modified by an in-place "
                            "operation after the op ran, so its gradient cannot be computed: write into a copy "
                            f"(t.torch().clone()) or run the op after the in-place write (torch: {error})")
    return RuntimeError(f"the gradient of op {op.name!r} (through torch.autograd) failed: {error}")


class _GraphGrad(_tp.RecordOp):
    """Record op for a vector-Jacobian product taken from a kept torch graph with `create_graph=True`.

    Its inputs are the original op's inputs (the graph's aliases) and the
    upstream gradients; its outputs the input gradients, which carry torch's
    graph of the product: its own backward is the same kind of call.
    """

    __slots__ = ("name", "graph_in", "outs", "in_ids", "shared")
    saves_inputs = False
    saves_outputs = False
    raw_saved = True

    def __init__(self, name, graph_in, outs, in_ids):
        self.name = f"grad_{name}"
        self.graph_in, self.outs, self.in_ids, self.shared = graph_in, outs, in_ids, True

    def backward(self, dys, outputs, inputs, attrs, raw, needs):
        return graph_vjp(self, dys, raw, needs)

    def recorded_again(self):
        self.shared = True


def _recorded_vjp(op, pairs, wrt, n):
    """The vector-Jacobian product on dtape.Tensors, recorded (as `_GraphGrad`) for a higher derivative."""
    dy_leaves = [dy._t.detach().requires_grad_() if _is_diff(dy._t) else dy._t for _, dy in pairs]
    outs = [o for o, _ in pairs]
    grad_outs = [d if d.dtype == o.dtype else d.to(o.dtype) for o, d in zip(outs, dy_leaves)]
    with torch.enable_grad():
        try:
            grads = torch.autograd.grad(outs, [op.graph_in[k] for k in wrt], grad_outs, allow_unused=True,
                                        create_graph=True, retain_graph=True)
        except RuntimeError as e:
            raise _named(e, op) from e
    full = [None] * n
    results, graph_outs = [], []
    for k, g in zip(wrt, grads):
        if g is not None:
            full[k] = Tensor(g.detach())
            results.append(full[k])
            graph_outs.append(g if g.requires_grad else None)
    if results and any(o is not None for o in graph_outs):
        # every input of the graph, not only those differentiated now: dy @ W.T, the input gradient of a
        # linear map, depends on W
        kept = [k for k in range(n) if op.graph_in[k] is not None]
        graph_in = [op.graph_in[k] for k in kept] + dy_leaves
        in_ids = tuple(op.in_ids[k] for k in kept) + tuple(dy._id for _, dy in pairs)
        ins = tuple(_tp.rebuild(g.detach(), i) for g, i in zip(graph_in, in_ids))
        grad_op = _GraphGrad(op.name, [g if g.requires_grad else None for g in graph_in], graph_outs, in_ids)
        _tp.record(grad_op, in_ids, ins, tuple(results), None)
    return tuple(full)


def _unwrap_leaves(flat):
    """(leaves with each tensor replaced by None, the Tensors, their positions); a variable leaf is read
    (recorded) into a Tensor. Comprehensions: no call per Tensor leaf (a wrapped module has one per
    parameter)."""
    flat = [leaf if type(leaf) in _LEAF_TYPES or not is_variable(leaf) else leaf._dtape_read() for leaf in flat]
    positions = [i for i, leaf in enumerate(flat) if type(leaf) is Tensor]
    return [None if type(leaf) is Tensor else leaf for leaf in flat], [flat[i] for i in positions], positions


# Torch functions that draw from torch's global generators. Each call runs on
# a private stream seeded from the calling replica's generator (dtape.random),
# so replicas draw reproducibly whatever the thread schedule (torch's global
# generator is shared by the replica threads).
_RANDOM_FNS = frozenset([
    F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
    F.rrelu, F.gumbel_softmax, F.multi_head_attention_forward, F.scaled_dot_product_attention,
    torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout, torch.rrelu,
    torch.bernoulli, torch.Tensor.bernoulli, torch.rand_like, torch.randn_like, torch.randint_like,
    torch.normal, torch.poisson, torch.multinomial, torch.Tensor.multinomial,
    torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu,  # nn.LSTM/GRU/RNN: dropout between layers
    # masks a forward draws itself (AWD-LSTM's locked dropout: `x.new_empty(...).bernoulli_(1 - p)`)
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.Tensor.bernoulli_, torch.Tensor.uniform_,
    torch.Tensor.normal_, torch.Tensor.random_, torch.Tensor.exponential_, torch.Tensor.geometric_,
    torch.Tensor.cauchy_, torch.Tensor.log_normal_])
# The recurrent kernels of nn.LSTM, nn.GRU and nn.RNN (`_VF.lstm`, ...): their dropout between layers draws
# from torch's generator inside the kernel.
_RNN_FNS = frozenset([torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu])
# Random functions that draw nothing when called with a zero probability (or, for dropout, not training):
# func -> (position and name of the probability, position and name of the training flag or None).
_PROBABILITY_ARGS = {F.scaled_dot_product_attention: ((4, "dropout_p"), None)}
_PROBABILITY_ARGS.update({fn: ((1, "p"), (2, "training")) for fn in (
    F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout)})
_PROBABILITY_ARGS.update({fn: ((1, "p"), (2, "train")) for fn in (
    torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout)})


def _draws(func, args, kwargs):
    """False when random function `func` draws nothing from a generator for these arguments: attention
    with dropout_p=0 (nanoGPT's default), dropout with p=0 or outside training, which torch runs
    without a draw; then no private stream is seeded (a seeded stream costs a generator fork)."""
    if kwargs.get("generator") is not None:  # the caller's own generator draws: no stream to seed
        return False
    if func in _RNN_FNS:
        return _rnn_draws(args)
    spec = _PROBABILITY_ARGS.get(func)
    if spec is None:
        return True
    (p_pos, p_name), training = spec
    p = kwargs.get(p_name, args[p_pos] if len(args) > p_pos else None)
    if p is None:  # the function's default probability (dropout's 0.5; attention's is given above as 0)
        p = 0.0 if func is F.scaled_dot_product_attention else 0.5
    if training is not None:
        t_pos, t_name = training
        if not kwargs.get(t_name, args[t_pos] if len(args) > t_pos else True):
            return False
    return isinstance(p, torch.Tensor) or p != 0


def _rnn_draws(args):
    """Whether a recurrent kernel draws: dropout > 0 between layers (num_layers > 1) in training. Its
    overloads: (input, hx, params, has_biases, num_layers, dropout, train, ...) and, for packed sequences,
    (data, batch_sizes, hx, params, has_biases, num_layers, dropout, train, ...)."""
    k = 4 if isinstance(args[3], bool) else 5  # position of num_layers: args[3] is has_biases or params
    if len(args) < k + 3:
        return True
    num_layers, p, train = args[k], args[k + 1], args[k + 2]
    return bool(train) and num_layers > 1 and p != 0


# Held while a seeded stream is installed in torch's (process-global) generators.
_rng_lock = threading.RLock()


def _new_seed(tensors):
    """(seed, cuda device indices) for a random function's private stream."""
    return _new_raw_seed([t._t for t in tensors])


def _new_raw_seed(tensors, device=None):
    """`device`: a factory's (`torch.rand(..., device=...)`), which draws on it from no input tensor."""
    device = next((t.device for t in tensors), None) if device is None else torch.device(device)
    gen = _random.get_generator(device)
    seed = int(torch.randint(0, 2**62, (), generator=gen, device=gen.device))
    cuda = {t.device.index or 0 for t in tensors if t.device.type == "cuda"}
    if device is not None and device.type == "cuda":
        cuda.add(device.index if device.index is not None else torch.cuda.current_device())
    return seed, tuple(sorted(cuda))


class SeededRandomFunctions(TorchFunctionMode):
    """Thread-local (torch's mode stack): torch's random functions on plain tensors draw from private
    streams seeded from this thread's `dtape.random` generator, as the fallback runs them on dtape
    tensors (a wrapped module's forward runs on plain tensors); every other function runs as is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _RANDOM_FNS or not _draws(func, args, kwargs):
            return func(*args, **kwargs)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        with _seeded(*_new_raw_seed(tensors, kwargs.get("device"))):
            return func(*args, **kwargs)


class _seeded:
    """Runs a block with torch's CPU (and listed CUDA) generators seeded by `seed`; restores them after."""

    def __init__(self, seed, cuda_devices):
        self.seed, self.cuda = seed, cuda_devices

    def __enter__(self):
        _rng_lock.acquire()
        self._fork = torch.random.fork_rng(devices=list(self.cuda))
        self._fork.__enter__()
        torch.default_generator.manual_seed(self.seed)
        for i in self.cuda:
            torch.cuda.default_generators[i].manual_seed(self.seed)

    def __exit__(self, *exc):
        try:
            return self._fork.__exit__(*exc)
        finally:
            _rng_lock.release()


class ReplicaStream:
    """Runs a block with torch's default generator of `generator`'s device (the CPU's, or that CUDA device's)
    drawing `generator`'s own stream: its state is installed there first and copied back after (the draws
    advance `generator`, as a draw from it would), and torch's generator gets its own state back.

    For a replica that is the only one of its process (a MultiWorkerMirroredStrategy worker's, a one-device
    MirroredStrategy's): a wrapped module's forward then draws every random number from the replica's
    generator with no interception of its torch calls (`SeededRandomFunctions` costs Python work on each).
    Held under `_rng_lock`, as every seeded stream, so another thread's seeded draw waits for the block.
    """

    def __init__(self, generator):
        self.generator = generator
        device = generator.device
        self.torch_generator = torch.default_generator if device.type == "cpu" else \
            torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]

    def __enter__(self):
        # nested (a wrapped module called in another's forward): the stream is installed already; installing
        # the generator's stale state again would redraw the outer forward's numbers
        self.nested = _random.live_generator(self.generator) is not None
        if self.nested:
            return
        _rng_lock.acquire()
        try:
            self.saved = self.torch_generator.get_state()
            self.torch_generator.set_state(self.generator.get_state())
            # dtape.random's draws in the block (they ask for `generator`) continue the same stream
            self.live = _random.live_stream((self.generator, self.torch_generator))
            self.live.__enter__()
        except BaseException:
            _rng_lock.release()
            raise

    def __exit__(self, *exc):
        if self.nested:
            return
        try:
            self.live.__exit__(*exc)
            self.generator.set_state(self.torch_generator.get_state())
            self.torch_generator.set_state(self.saved)
        finally:
            _rng_lock.release()


def call_fallback(func, args, kwargs):
    """Runs torch `func` on dtape tensors; when a tape records it, through torch's autograd (see TorchFallback).

    `inplace=True` (torch.nn.functional, e.g. from `nn.Dropout(inplace=True)`)
    runs out of place: dtape tensors are immutable, and callers use the result.
    An output that torch's graph does not connect to an input (`.detach()`,
    `.data`, `x.new_zeros(...)`, integer results) is a constant.
    """
    name = getattr(func, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):
        raise TypeError(f"torch.{name} modifies its input in place; dtape.Tensor is immutable. "
                        f"Use the out-of-place torch.{name[:-1]} instead")
    if kwargs.get("inplace") is True:  # torch.nn.functional's `inplace=`: immutable inputs, return the result
        kwargs = dict(kwargs, inplace=False)
    flat, spec = flatten_args(args, kwargs)
    leaves, tensors, positions = _unwrap_leaves(flat)
    seed = _new_seed(tensors) if func in _RANDOM_FNS and _draws(func, args, kwargs) else None
    op = TorchFallback(func, spec, tuple(leaves), tuple(positions), seed)
    raws = [t._t for t in tensors]
    n_tapes = _recording_count(tensors) if _tp.active_tapes and tensors else 0
    if _tp.active_tapes:
        _check_leaves(leaves)
    if n_tapes and _any_diff(raws):
        out = _call_graph(op, tensors, raws)
    else:
        n_tapes, out = 0, op.call_raw(raws)
    single = type(out) is torch.Tensor  # the common output: one tensor, no pytree walk
    out_leaves, out_spec = ([out], None) if single else pytree.tree_flatten(out)
    wrapped = [_output(o, n_tapes) if isinstance(o, torch.Tensor) else o for o in out_leaves]
    if n_tapes:
        outs = [o if o.requires_grad else None for o in out_leaves if isinstance(o, torch.Tensor)]
        # not `outs.count(None)`: that compares each tensor with None through torch's `__eq__` (~20 us each)
        if any([o is not None for o in outs]):
            op.outs, op.in_ids, op.shared = outs, tuple([t._id for t in tensors]), n_tapes > 1
            _tp.record(op, op.in_ids, tuple(tensors), tuple([w for w in wrapped if type(w) is Tensor]), None)
    return wrapped[0] if single else pytree.tree_unflatten(wrapped, out_spec)


def _check_leaves(leaves):
    """A torch tensor argument in torch's autograd (`F.linear(h, emb.weight)` with a wrapped module's
    parameter) would be a constant to the tapes: `check_no_autograd_input`. A loop: runs on taped calls."""
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            check_no_autograd_input(leaf)


# torch's refusal of `requires_grad` on an input it has no derivative for (F.cross_entropy's class `weight`)
_NO_DERIVATIVE = "is not differentiable with respect to argument"


def _call_graph(op, tensors, raws):
    """`op.call_graph(raws)`; where torch has no derivative for one of the floating inputs, again with only
    those a recording tape watches requiring grad (the others constants, as torch takes them).

    A function marked `rerun_safe = False` (a wrapped module's forward, whose buffer updates a second run
    would repeat) is not run again: torch's error stands.
    """
    try:
        return op.call_graph(raws)
    except RuntimeError as e:
        if _NO_DERIVATIVE not in str(e) or not getattr(op.func, "rerun_safe", True):
            raise
        error = e
    watched = [tape._watched for tape in _tp.recording_tapes()]
    try:
        return op.call_graph(raws, [any(t._id in w for w in watched) for t in tensors])
    except RuntimeError as e:
        if _NO_DERIVATIVE not in str(e):
            raise
    raise RuntimeError(f"torch.{op.name} has no derivative for one of its inputs that a tape watches ({error}); "
                       "pass that input as a constant (a tensor no tape watches, or .detach())") from error


def _any_diff(raws):
    for t in raws:  # a loop, not any(genexpr): this runs on every recorded fallback call
        if t.dtype.is_floating_point or t.dtype.is_complex:
            return True
    return False


# Argument types pytree always treats as leaves: positional arguments of only these need no pytree walk.
_LEAF_TYPES = frozenset([Tensor, torch.Tensor, torch.nn.Parameter, int, float, bool, complex, str, type(None),
                         torch.dtype, torch.device, torch.memory_format])


def flatten_args(args, kwargs):
    """(leaves, spec) of (args, kwargs), for `unflatten_args`: spec None for positional leaves only, a
    tuple (number of positional arguments, keyword names) when every argument is a leaf (torch.nn.functional
    passes all its keywords to `__torch_function__`), else pytree's (leaves as pytree gives them)."""
    for a in args:
        if type(a) not in _LEAF_TYPES:
            break
    else:
        if not kwargs:
            return list(args), None
        for a in kwargs.values():
            if type(a) not in _LEAF_TYPES:
                break
        else:
            return [*args, *kwargs.values()], (len(args), tuple(kwargs))
    return pytree.tree_flatten((args, kwargs))


def unflatten_args(leaves, spec):
    """(args, kwargs) from `flatten_args`' leaves (possibly replaced) and spec."""
    if spec is None:
        return leaves, {}
    if type(spec) is tuple:
        n = spec[0]
        return leaves[:n], dict(zip(spec[1], leaves[n:]))
    return pytree.tree_unflatten(leaves, spec)


# torch functions whose result torch's autograd treats as a constant (no grad_fn): `.detach()`,
# `.data` and the `new_*` / `*_like` factories. They run on the values and are never recorded, so a
# gradient never flows through them (and the walk never asks torch for one).
_CONSTANT_FNS = frozenset([
    torch.Tensor.detach, torch.detach, torch.Tensor.data.__get__, torch.Tensor.new_zeros, torch.Tensor.new_ones,
    torch.Tensor.new_full, torch.Tensor.new_empty, torch.Tensor.new_empty_strided, torch.Tensor.new_tensor,
    torch.empty_like, torch.full_like])


def _call_constant(func, args, kwargs):
    """Runs `func` on the raw values of dtape tensors and variables; wraps its tensors, unrecorded."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    with _tp.stop_recording():  # a variable's value is read, not recorded: the result is a constant
        leaves, tensors, positions = _unwrap_leaves(flat)
    for pos, t in zip(positions, tensors):
        leaves[pos] = t._t
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    return pytree.tree_map_only(torch.Tensor, Tensor, func(*args, **kwargs))


def _recording_count(tensors):
    """How many tapes recording on this thread watch one of `tensors` (each would record the call)."""
    n = 0
    for tape in _tp.recording_tapes():  # loops, not generators: this runs on every fallback call
        watched = tape._watched
        for t in tensors:
            if t._id in watched:
                n += 1
                break
    return n


def _output(o, graphed):
    """A torch output as a dtape.Tensor: without torch's graph (the record keeps it), so user code on
    `.torch()` builds none."""
    return Tensor(o.detach() if graphed and o.requires_grad else o)


def _torch_function(cls, func, types, args=(), kwargs=None):
    if kwargs and kwargs.get("out") is not None:
        _refuse_out(func)
    handler = TORCH_TABLE.get(func)
    if handler is not None:  # no in-place function has one: the common calls skip the check below
        return handler(*args, **(kwargs or {}))
    if args and _writes_torch_tensors(func, args[0]):
        return _write_torch_tensors(func, args, kwargs or {})
    if func in _CONSTANT_FNS:
        return _call_constant(func, args, kwargs or {})
    return call_fallback(func, args, kwargs or {})


def _writes_torch_tensors(func, target):
    """Whether `func` is an in-place torch function (`add_`, `copy_`, `_foreach_add_`) whose target, its
    first argument, is a torch.Tensor or a list of them: the dtape tensors among its arguments are only read
    (the word_language_model example's manual SGD, `p.data.add_(grad, alpha=-lr)`)."""
    name = getattr(func, "__name__", "")
    if not name.endswith("_") or name.endswith("__"):
        return False
    if isinstance(target, (list, tuple)):
        return bool(target) and all(isinstance(t, torch.Tensor) for t in target)
    return isinstance(target, torch.Tensor)


def _write_torch_tensors(func, args, kwargs):
    """Runs an in-place `func` on its torch.Tensor target with the values of the dtape arguments, as torch
    under `no_grad` would (a torch tensor's write is no tape's record), and returns torch's result.

    Raises:
      TypeError: a tape recording on this thread watches a dtape argument (a Variable, or a watched tensor):
        its gradient through the written torch tensor would be lost silently.
    """
    name = getattr(func, "__name__", repr(func))
    flat, spec = pytree.tree_flatten((args, kwargs))
    watched = [leaf for leaf in flat if type(leaf) is Tensor]
    if _tp.recording_tapes() and (_recording_count(watched) or any(is_variable(leaf) for leaf in flat)):
        raise TypeError(f"torch {name} writes a dtape tensor's value into a torch.Tensor while a tape records: "
                        f"no tape records a torch tensor's in-place write, so the gradient would be lost; "
                        f"compute the new value out of place (a recorded dtape.Tensor), or make the write after "
                        f"the tape (or inside tape.stop_recording())")
    with _tp.stop_recording():  # a variable's value is read, not recorded
        leaves, tensors, positions = _unwrap_leaves(flat)
    for pos, t in zip(positions, tensors):
        leaves[pos] = t._t
    args, kwargs = pytree.tree_unflatten(leaves, spec)
    return func(*args, **kwargs)


def _refuse_out(func):
    """`out=` would write into a tensor that records may have saved: dtape tensors are immutable."""
    name = getattr(func, "__name__", repr(func))
    raise TypeError(f"torch.{name}(..., out=...) is not supported with dtape tensors: dtape tensors are "
                    f"immutable (a recorded op may have saved the one you would overwrite); use the "
                    f"returned value instead: y = torch.{name}(...)")


# Tensor's value protocol (defined in dtape/tensor.py) that variables forward after a read.
_VALUE_DUNDERS = ("__float__", "__int__", "__index__", "__bool__", "__len__", "__iter__")
# Tensor's protocol written on `self.torch()` (no recorded read): variables get the same functions.
_SHARED_DUNDERS = ("__format__", "__array_ufunc__", "__array_function__", "__dlpack__", "__dlpack_device__")


def install_operators(ops):
    """Installs Python operators and `__torch_function__` on Tensor (the one operator table)."""
    Tensor.__torch_function__ = classmethod(_torch_function)
    table = {}
    binary = {"add": ops.add, "sub": ops.subtract, "mul": ops.multiply, "truediv": ops.divide,
              "floordiv": ops.floordiv, "mod": ops.floormod, "pow": ops.pow, "matmul": ops.matmul}
    for name, fn in binary.items():
        table[f"__{name}__"] = fn  # the op itself: `x * y` is `multiply(x, y)`, one Python call
        table[f"__r{name}__"] = _rmethod(fn)
    for name, fn in {"lt": ops.less, "le": ops.less_equal, "gt": ops.greater, "ge": ops.greater_equal}.items():
        table[f"__{name}__"] = _method(fn)
    table["__eq__"] = _equality(ops.equal, False)
    table["__ne__"] = _equality(ops.not_equal, True)
    table["__neg__"] = lambda self: ops.negative(self)
    table["__pos__"] = lambda self: self
    table["__abs__"] = lambda self: ops.abs(self)
    table["__invert__"] = lambda self: ops.math_ops.invert_(self)
    for name, fn in {"and": ops.math_ops.and_, "or": ops.math_ops.or_, "xor": ops.math_ops.xor_}.items():
        table[f"__{name}__"] = fn
        table[f"__r{name}__"] = fn  # commutative: the tensor stays first, so a Python scalar takes its dtype
    table["__getitem__"] = lambda self, key: ops.getitem(self, key)
    for name, fn in table.items():
        setattr(Tensor, name, fn)
    Tensor._operator_names = tuple(table) + _VALUE_DUNDERS + _SHARED_DUNDERS
    Tensor.__getattr__ = _torch_attribute


def install_variable_operators(cls):
    """Gives a variable class (one with `_dtape_read()`) every Tensor operator and torch interop.

    Each operator reads the variable (a recorded read that notifies the
    tapes) and applies Tensor's own operator, so Tensor and variables share
    one table; the `_SHARED_DUNDERS` (f-string format, numpy ufuncs, DLPack)
    are Tensor's own functions, which use only `.torch()` and so record no
    read. `cls._dtape_variable` marks the class for `tensor.is_variable`.
    """
    for name in Tensor._operator_names:
        setattr(cls, name, _delegate(name))
    cls.__torch_function__ = classmethod(_torch_function)
    cls.__getattr__ = _variable_attribute
    cls.grad = property(_no_grad_attribute, doc="Always raises AttributeError: see NO_GRAD_MESSAGE.")
    cls._dtape_variable = True


def _variable_attribute(self, name):
    """torch.Tensor's methods and properties on a variable (`v.view(2, 2)`, `v.sum()`, `v.item()`, `v.T`).

    Called only for names the variable class lacks: reads the variable (a
    recorded read, as every operator) and answers as `Tensor` does, so a
    variable has the torch methods a dtape.Tensor has. Private names and
    the names dtape duck-types on are never forwarded, so `hasattr` checks
    and half-built objects raise AttributeError at once.
    """
    if name.startswith("_") or name in _NOT_FORWARDED or getattr(torch.Tensor, name, None) is None:
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
    return _torch_attribute(self._dtape_read(), name)


def _delegate(name):
    tensor_method = getattr(Tensor, name)
    if name in _SHARED_DUNDERS:
        return tensor_method

    def method(self, *args):
        return tensor_method(self._dtape_read(), *args)
    method.__name__ = name
    return method


# Names dtape duck-types on (variables' `.values`, `.name`): never answered from torch.Tensor.
_NOT_FORWARDED = frozenset({"values", "name"})


# `.grad`: torch.nn.utils.clip_grad_norm_ (and code like it) reads `p.grad` of each tensor it is given and skips
# None; answering torch's None would make it clip nothing and return 0, silently.
NO_GRAD_MESSAGE = (
    "dtape tensors and variables have no .grad: a gradient is the value tape.gradient returns (so "
    "torch.nn.utils.clip_grad_norm_ on them would find no gradient and clip nothing). Clip the summed gradients "
    "with the optimizer's global_clipnorm= (dtape.optimizers.from_torch(torch_optimizer, global_clipnorm=max_norm) "
    "uses clip_grad_norm_'s formula), or clip the values: dtape.clip_by_global_norm(grads, max_norm)")


def _no_grad_attribute(self):
    raise AttributeError(NO_GRAD_MESSAGE)


# autograd's entry points on dtape tensors (a ported `loss.backward()`): their values carry no autograd graph
# (the tapes hold the records), so torch's own error would be "element 0 of tensors does not require grad".
NO_BACKWARD_MESSAGE = (
    "{name} on dtape tensors: dtape takes gradients with a tape, not autograd (a dtape tensor carries no "
    "autograd graph, and a wrapped module's parameters get no .grad). Record the loss in "
    "`with dtape.GradientTape() as tape:` and take grads = tape.gradient(loss, model.trainable_variables), then "
    "optimizer.apply_gradients(zip(grads, model.trainable_variables)) (a torch optimizer: "
    "dtape.optimizers.from_torch(torch_optimizer))")


def _refuse_autograd(name):
    def refuse(*args, **kwargs):
        raise RuntimeError(NO_BACKWARD_MESSAGE.format(name=name))
    return refuse


for _fn, _name in ((torch.Tensor.backward, "loss.backward()"), (torch.autograd.backward, "torch.autograd.backward"),
                   (torch.autograd.grad, "torch.autograd.grad")):
    TORCH_TABLE[_fn] = _refuse_autograd(_name)


def _torch_attribute(self, name):
    """torch.Tensor's methods and properties on a dtape.Tensor (`x.dim()`, `x.view(...)`, `x.T`).

    Called only for names Tensor lacks; the call runs through
    `__torch_function__`, so it is recorded like `torch.<name>(x)`. This is
    what lets torch.nn module code (`input.dim()`, `x.transpose(0, 1)`) run
    on dtape tensors. Private names and in-place methods are not forwarded
    (in-place methods raise TypeError when called: Tensor is immutable).
    """
    if name == "grad":
        _no_grad_attribute(self)
    attr = None if name.startswith("_") or name in _NOT_FORWARDED else getattr(torch.Tensor, name, None)
    if attr is None:
        raise AttributeError(f"'dtape.Tensor' object has no attribute {name!r}")
    if isinstance(attr, (property, type(torch.Tensor.T))):  # a property: read it now
        return _torch_function(Tensor, attr.__get__, (Tensor,), (self,))
    if not callable(attr):
        raise AttributeError(f"'dtape.Tensor' object has no attribute {name!r}")
    return lambda *args, **kwargs: _torch_function(Tensor, attr, (Tensor,), (self,) + args, kwargs)


def _method(fn):
    def method(self, other):
        return fn(self, other)
    return method


def _equality(fn, if_none):
    """`x == y` / `x != y` as TF 2's Tensor: elementwise, but None compares unequal (`if_none`, a Python bool)
    instead of raising, so `x in (None, y)` and `x == None` work as in TF."""
    def method(self, other):
        if other is None:
            return if_none
        return fn(self, other)
    return method


def _rmethod(fn):
    def method(self, other):
        return fn(other, self)
    return method


__all__ = []
