"""dtape's MultiWorkerMirroredStrategy against torch DistributedDataParallel, under torchrun (gloo).

One MLP training step (784-1024-1024-10, SGD, global batch 256; dtape's
layers.Dense against torch.nn.Linear), and the charlm step (the 2-layer
transformer of scripts/tasks/charlm.py, Adam, 32 sequences; DDP runs the same
transformer as a torch.nn.Module), and the GPT-shaped torch.nn.Module of
scripts/tasks/torch_gpt.py (GPT_SHAPE, 32 sequences, AdamW in nanoGPT's two parameter groups) through
dtape.layers.TorchModule and dtape.optimizers.from_torch against the same module under DDP; in the GPT
launch rank 0 also runs the step under MirroredStrategy with 2 CPU replicas (threads of its one
process) while the other ranks wait, so that case takes its turns with the others too. All with the
same initial weights and the same global batches: each of W workers takes
its slice of every global batch, dtape sums the per-worker gradients of a
loss divided by the global batch size (TF semantics), DDP averages the
gradients of per-worker mean losses; both give the one-device update. The
first-step losses are checked equal.

  python scripts/bench_multiworker.py [--steps 60] [--repeat 3] [--gpt-only] [--gpt-alone PAIRS] [--jit-only]
                                     [--json PATH]

`--gpt-alone PAIRS` runs only the GPT step with each side alone in launches of its own (see `measure_alone`):
interleaved in one launch, the cases share each worker's glibc heap (where its trimming lands, and the page
faults that follow, depends on the other cases' allocations) and gloo's threads, while a training script runs
one library. A launch builds only dtape's step with GradientSync (the DDP launch does not import dtape) and
times it as the interleaved launches do; the launches come in PAIRS pairs, one per side, the side that goes
first alternating between pairs, and each pair gives dtape/DDP of its step medians and of rank 0's CPU time
per step, printed per pair and as the median (with the range) over the pairs. (scripts/bench.py --gpt-only
runs it besides the interleaved launch.)

`--jit-only` runs only the compiled-step launch instead (see "compiled steps" below): the charlm replica
step as dtape.function(jit_compile=True) (inductor) under MultiWorkerMirroredStrategy on 2 workers, and
under MirroredStrategy with 2 CPU replicas in rank 0's process, against torch.compile(DDP(module)) and
DDP(torch.compile(module)) with opt.step compiled too, dtape's eager step and eager DDP, taking turns as
below; each case's first call (trace + compile, in seconds, with inductor's on-disk cache hits) is
reported apart from the step times.

(`scripts/bench.py` runs it too, as its case (i).)

runs `torchrun --standalone --nproc-per-node W` for the MLP at W = 1 and 2
and charlm and the GPT at W = 2, with this checkout's dtape. Inside one launch the cases
(dtape with GradientSync: the all-reduce overlapped with the walk, as in
scripts/train.py's step and in DDP; dtape without it: apply_gradients
reduces after the walk; and DDP) share the process group and
take turns, BLOCK (6) steps at a time (the order rotating every turn; a
training loop's consecutive steps, whose collectives repeat), so every ratio
compares steps taken under the same machine load; on a shared, noisy
machine, separate launches for dtape and DDP gave ratios that moved by 0.3
between runs. Times are medians of per-step wall times on rank 0 after
warm-up, each step between two barriers. It prints dtape/DDP at 2 workers,
2 workers / 1 worker, the share of the all-reduce hidden behind the walk
(1 - (extra time apply_gradients spends at 2 workers with GradientSync) /
(the same without)), and rank 0's phase times per step: dtape's forward,
gradient walk and apply_gradients (all-reduce wait + update), DDP's forward,
backward (with its all-reduce) and optimizer.step; and each step's CPU time
on rank 0 (the process's, its communication threads included: with one
core per worker the step is CPU-bound, and this is the steadier measure).
The launches are repeated `--repeat` times; each ratio is given as the
median over the sets, with its range.
Under the hood it re-runs itself with `--worker`.
"""
import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SIZES = (784, 1024, 1024, 10)
GLOBAL_BATCH = 256
CHARLM_BATCH = 32  # sequences of 64 characters per global batch (charlm's default batch size)
# The GPT-shaped torch.nn.Module (scripts/tasks/torch_gpt.py) in nanoGPT's shape at the size of the
# charlm step: vocabulary (65, Shakespeare's characters), context, width, heads, layers; sequences per global batch.
GPT_SHAPE = dict(vocab=65, context=64, width=64, heads=2, layers=2)
GPT_BATCH = 32
# Consecutive steps each case takes in its turn: a training loop's steps follow one another, so its collectives
# repeat step after step (dtape's collective checks learn that pattern: a step's loss reduction announces the next
# step's gradient bucket, see dtape.distribute.collective_ops); cases alternating every step would break it.
BLOCK = 6
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _init(torch):
    g = torch.Generator().manual_seed(0)
    params = []
    for fan_in, fan_out in zip(SIZES[:-1], SIZES[1:]):
        params += [torch.randn(fan_in, fan_out, generator=g) * fan_in ** -0.5, torch.zeros(fan_out)]
    data = torch.randn(4, GLOBAL_BATCH, SIZES[0], generator=g)
    labels = torch.randint(0, SIZES[-1], (4, GLOBAL_BATCH), generator=g)
    return params, data, labels


def _slice(rank, world, batch):
    per = batch // world
    return slice(rank * per, (rank + 1) * per)


class _Phases:
    """Per-step wall times of named phases; `medians()` after warm-up (the first fifth dropped)."""

    def __init__(self, *names):
        self.times = {n: [] for n in names}

    def __call__(self, name):
        return _Timer(self.times[name])

    def medians(self):
        return {f"{k}_s": statistics.median(v[len(v) // 5:]) for k, v in self.times.items() if v}


class _Timer:
    def __init__(self, out):
        self.out = out

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self.out.append(time.perf_counter() - self.t0)


# -- DDP ----------------------------------------------------------------------------------
def _ddp_case(model, opt, loss_fn, world):
    """(step(k), phases) for DDP: forward, backward (with the bucketed all-reduce), optimizer step."""
    import torch.distributed as dist
    phases = _Phases("forward", "backward", "optimizer")

    def step(k):
        opt.zero_grad(set_to_none=True)
        with phases("forward"):
            loss = loss_fn(k)
        with phases("backward"):
            loss.backward()
        with phases("optimizer"):
            opt.step()
        loss = loss.detach() / world
        dist.all_reduce(loss)
        return float(loss)
    return step, phases


def _mlp_ddp(rank, world, lr):
    import torch
    import torch.nn.functional as F
    params, data, labels = _init(torch)
    layers = []
    for i in range(0, len(params), 2):
        lin = torch.nn.Linear(SIZES[i // 2], SIZES[i // 2 + 1])
        with torch.no_grad():
            lin.weight.copy_(params[i].T)
            lin.bias.copy_(params[i + 1])
        layers += [lin, torch.nn.ReLU()]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers[:-1]))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    part = _slice(rank, world, GLOBAL_BATCH)
    return _ddp_case(model, opt, lambda k: F.cross_entropy(model(data[k % 4, part]), labels[k % 4, part]), world)


def _charlm_ddp(rank, world, lr):
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, HERE)
    from bench import _TorchCharLM
    charlm, data, labels = _charlm(torch)
    values = [v.torch().clone() for v in charlm.build_model(0).trainable_variables]  # the same initial weights
    model = torch.nn.parallel.DistributedDataParallel(_TorchCharLM(values, charlm))
    opt = torch.optim.Adam(model.parameters(), lr=lr, eps=1e-7)
    part = _slice(rank, world, CHARLM_BATCH)

    def loss_fn(k):
        logits = model(data[k % 4, part])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[k % 4, part].reshape(-1))
    return _ddp_case(model, opt, loss_fn, world)


def _gpt(torch):
    """The GPT model (seeded), its AdamW (nanoGPT's groups and betas) and 4 global batches [4, GPT_BATCH, context]."""
    sys.path.insert(0, HERE)
    from tasks import torch_gpt
    torch.manual_seed(0)
    model = torch_gpt.GPT(**GPT_SHAPE)
    pairs = torch_gpt.counting_batches(4, GPT_BATCH, GPT_SHAPE["context"], GPT_SHAPE["vocab"])
    data, labels = torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])

    def make_adamw(params):
        return torch.optim.AdamW(torch_gpt.adamw_groups(list(params)), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    return model, make_adamw, data, labels


def _gpt_ddp(rank, world, lr):
    import torch
    import torch.nn.functional as F
    module, make_adamw, data, labels = _gpt(torch)
    model = torch.nn.parallel.DistributedDataParallel(module)
    opt = make_adamw(model.parameters())
    part = _slice(rank, world, GPT_BATCH)

    def loss_fn(k):
        logits = model(data[k % 4, part])
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels[k % 4, part].reshape(-1))
    return _ddp_case(model, opt, loss_fn, world)


def _gpt_dtape_step(tm, make_adamw, sync):
    """(replica step(x, y) -> its share of the global mean loss, the variables) of the GPT through TorchModule
    and from_torch(AdamW): the sum over the replica's tokens divided by the global batch's tokens."""
    import torch.nn.functional as F
    import dtape
    opt = dtape.optimizers.from_torch(make_adamw(tm.parameters()))
    variables = tm.trainable_variables
    tokens = GPT_BATCH * GPT_SHAPE["context"]

    def loss_fn(x, y):
        logits = tm(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1), reduction="sum") / tokens
    return variables, opt, loss_fn


def _gpt_dtape(strategy, rank, world, lr, sync):
    import dtape
    import torch
    module, make_adamw, data, labels = _gpt(torch)
    with strategy.scope():
        tm = dtape.layers.TorchModule(module)
    variables, opt, loss_fn = _gpt_dtape_step(tm, make_adamw, sync)
    part = _slice(rank, world, GPT_BATCH)

    def batch(k):
        return dtape.constant(data[k % 4, part]), dtape.constant(labels[k % 4, part])
    return _dtape_case(strategy, variables, opt, loss_fn, batch, sync)


def _gpt_mirrored(replicas):
    """The same GPT step under MirroredStrategy with `replicas` CPU replicas in this one process (threads)."""
    import dtape
    import torch
    module, make_adamw, data, labels = _gpt(torch)
    strategy = dtape.distribute.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        tm = dtape.layers.TorchModule(module)
    variables, opt, loss_fn = _gpt_dtape_step(tm, make_adamw, True)
    parts = [_slice(i, replicas, GPT_BATCH) for i in range(replicas)]
    shards = [[(dtape.constant(data[k, p]), dtape.constant(labels[k, p])) for p in parts] for k in range(4)]
    step_k = [0]

    def loss_of_replica():
        x, y = shards[step_k[0] % 4][dtape.distribute.get_replica_context().replica_id_in_sync_group]
        return loss_fn(x, y)
    step, phases = _dtape_case(strategy, variables, opt, loss_of_replica, lambda k: (), True)

    def run(k):
        step_k[0] = k
        return step(k)
    return run, phases


# -- dtape --------------------------------------------------------------------------------
def _dtape_case(strategy, variables, opt, loss_fn, batch, sync):
    """(step(k), phases) for dtape: forward, gradient walk, apply_gradients (all-reduce wait + update)."""
    import dtape
    gradient_sync = dtape.distribute.GradientSync() if sync else None
    phases = _Phases("forward", "walk", "apply")

    def replica_step(*inputs):
        with phases("forward"), dtape.GradientTape(gradient_sync=gradient_sync) as tape:
            loss = loss_fn(*inputs)
        with phases("walk"):
            grads = tape.gradient(loss, variables)
        with phases("apply"):
            opt.apply_gradients(zip(grads, variables))
        return loss

    def step(k):
        loss = strategy.run(replica_step, args=batch(k))
        return float(strategy.reduce(dtape.distribute.ReduceOp.SUM, loss, axis=None).torch())
    return step, phases


def _mlp_dtape(strategy, rank, world, lr, sync):
    """The MLP as `dtape.layers.Dense` layers (DDP's side uses torch.nn.Linear), with the same weights."""
    import torch
    import dtape
    params, data, labels = _init(torch)
    with strategy.scope():
        layers = [dtape.layers.Dense(n, activation="relu" if i + 2 < len(SIZES) else None, input_dim=m)
                  for i, (m, n) in enumerate(zip(SIZES[:-1], SIZES[1:]))]
        for k, layer in enumerate(layers):
            layer.kernel.assign(params[2 * k])
            layer.bias.assign(params[2 * k + 1])
        opt = dtape.optimizers.SGD(lr)
    variables = [v for layer in layers for v in layer.trainable_variables]
    part = _slice(rank, world, GLOBAL_BATCH)

    def loss_fn(x, y):
        h = x
        for layer in layers:
            h = layer(h)
        return dtape.reduce_sum(dtape.nn.sparse_softmax_cross_entropy_with_logits(y, h)) / GLOBAL_BATCH

    def batch(k):
        return dtape.constant(data[k % 4, part]), dtape.constant(labels[k % 4, part])
    return _dtape_case(strategy, variables, opt, loss_fn, batch, sync)


def _charlm(torch):
    sys.path.insert(0, HERE)
    from tasks import charlm
    data = charlm.load_data(0)
    x = torch.as_tensor(data["x_train"][:4 * CHARLM_BATCH]).reshape(4, CHARLM_BATCH, -1)
    y = torch.as_tensor(data["y_train"][:4 * CHARLM_BATCH]).reshape(4, CHARLM_BATCH, -1)
    return charlm, x, y


def _charlm_dtape(strategy, rank, world, lr, sync):
    import torch
    import dtape
    charlm, data, labels = _charlm(torch)
    with strategy.scope():
        model = charlm.build_model(0)
        opt = dtape.optimizers.Adam(lr)
    variables = list(model.trainable_variables)
    part = _slice(rank, world, CHARLM_BATCH)

    def loss_fn(x, y):
        return dtape.reduce_sum(charlm.per_example_loss(model, x, y)) / CHARLM_BATCH

    def batch(k):
        return dtape.constant(data[k % 4, part]), dtape.constant(labels[k % 4, part])
    return _dtape_case(strategy, variables, opt, loss_fn, batch, sync)


# -- compiled steps: dtape.function(jit_compile=True) against DDP over a compiled module ---------------------
# The charlm step compiled three ways in one launch (the "charlm_jit" launch), each taking its turns with
# dtape's eager step under the same strategy and with DDP (eager, and over torch.compile):
#   jit:          the replica step (forward, tape.gradient, Adam) as dtape.function(jit_compile=True) inside
#                 MultiWorkerMirroredStrategy.run; apply_gradients traced in the replica all-reduces the
#                 gradients with torch.ops.dtape.all_reduce_sum when the graph runs (after the walk: no overlap).
#   mirrored_jit: the same compiled step under MirroredStrategy(["cpu:0", "cpu:1"]) in rank 0's process
#                 (two replica threads, one graph), while the other ranks wait.
#   ddp_compiled: torch.compile(DDP(module)) (torch's documented order: DDP wrapped first, so that dynamo's
#                 DDPOptimizer can split the graph at DDP's buckets) with opt.step in a torch.compile of its own.
#   ddp_over_compiled: DDP(torch.compile(module)), the other order, with the same compiled opt.step: DDP's
#                 hooks see the gradients only when the whole compiled backward has run (charlm's gradients fill
#                 one 25 MB bucket anyway, so neither order overlaps the all-reduce with the backward here).
JIT_BACKEND = "inductor"


def _charlm_jit_step(charlm, model, opt, backend):
    """The compiled replica step: its share (sum / global batch, TF semantics) of the global mean loss."""
    import dtape
    variables = list(model.trainable_variables)

    def replica_step(x, y):
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(charlm.per_example_loss(model, x, y)) / CHARLM_BATCH
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss
    return dtape.function(replica_step, jit_compile=True, backend=backend)


def _charlm_jit_dtape(strategy, rank, world, lr, backend):
    import torch
    import dtape
    charlm, data, labels = _charlm(torch)
    with strategy.scope():
        model = charlm.build_model(0)
        opt = dtape.optimizers.Adam(lr)
        opt.build(model.trainable_variables)  # the slots before the trace: the first call compiles once
    f = _charlm_jit_step(charlm, model, opt, backend)
    part = _slice(rank, world, CHARLM_BATCH)
    batches = [(dtape.constant(data[k, part]), dtape.constant(labels[k, part])) for k in range(4)]

    def step(k):
        loss = strategy.run(f, args=batches[k % 4])
        return float(strategy.reduce(dtape.distribute.ReduceOp.SUM, loss, axis=None).torch())
    step.function = f
    return step, _Phases()


def _charlm_jit_mirrored(replicas, lr, backend):
    """The compiled step under MirroredStrategy with `replicas` CPU replicas (threads of this process)."""
    import torch
    import dtape
    charlm, data, labels = _charlm(torch)
    strategy = dtape.distribute.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    with strategy.scope():
        model = charlm.build_model(0)
        opt = dtape.optimizers.Adam(lr)
        opt.build(model.trainable_variables)
    f = _charlm_jit_step(charlm, model, opt, backend)

    def per_replica(array, k):
        parts = [dtape.constant(array[k, _slice(i, replicas, CHARLM_BATCH)]) for i in range(replicas)]
        return strategy.experimental_distribute_values_from_function(lambda ctx: parts[ctx.replica_id_in_sync_group])
    batches = [(per_replica(data, k), per_replica(labels, k)) for k in range(4)]

    def step(k):
        loss = strategy.run(f, args=batches[k % 4])
        return float(strategy.reduce(dtape.distribute.ReduceOp.SUM, loss, axis=None).torch())
    step.function = f
    return step, _Phases()


def _charlm_ddp_compiled(rank, world, lr, compile_inside=False):
    """DDP over torch.compile: torch.compile(DDP(module)) (compile_inside: DDP(torch.compile(module))), and
    torch.optim.Adam's step compiled on its own."""
    import types
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, HERE)
    from bench import _TorchCharLM
    charlm, data, labels = _charlm(torch)
    values = [v.torch().clone() for v in charlm.build_model(0).trainable_variables]
    module = _TorchCharLM(values, charlm)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.compile(module) if compile_inside else module)
    model = ddp if compile_inside else torch.compile(ddp)
    opt = torch.optim.Adam(ddp.parameters(), lr=lr, eps=1e-7)
    part = _slice(rank, world, CHARLM_BATCH)

    def loss_fn(k):
        logits = model(data[k % 4, part])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[k % 4, part].reshape(-1))
    return _ddp_case(model, types.SimpleNamespace(zero_grad=opt.zero_grad, step=torch.compile(opt.step)), loss_fn,
                     world)


def _jit_cases(strategy, rank, world, lr, backend=JIT_BACKEND):
    """The "charlm_jit" launch's cases (see above), with dtape's eager step (with GradientSync and without)
    and eager DDP for reference."""
    cases = {"jit": _charlm_jit_dtape(strategy, rank, world, lr, backend),
             "dtape": _charlm_dtape(strategy, rank, world, lr, False),
             "dtape_sync": _charlm_dtape(strategy, rank, world, lr, True),
             "ddp": _charlm_ddp(rank, world, lr),
             "ddp_compiled": _charlm_ddp_compiled(rank, world, lr),
             "ddp_over_compiled": _charlm_ddp_compiled(rank, world, lr, compile_inside=True)}
    cases["mirrored_jit"] = _charlm_jit_mirrored(world, lr, backend) if rank == 0 else (lambda k: float("nan"),
                                                                                         _Phases())
    return cases


def _compile_counters():
    """torch's compile counters so far: graphs dynamo compiled, inductor's FX-graph cache and AOTAutograd's
    cache hits and misses (a cache hit: the compiled code came from the on-disk cache of an earlier process)."""
    from torch._dynamo.utils import counters
    return {"dynamo_graphs": counters["stats"]["unique_graphs"],
            "fxgraph_hit": counters["inductor"]["fxgraph_cache_hit"],
            "fxgraph_miss": counters["inductor"]["fxgraph_cache_miss"],
            "aot_hit": counters["aot_autograd"]["autograd_cache_hit"],
            "aot_miss": counters["aot_autograd"]["autograd_cache_miss"]}


def _first_calls(cases):
    """{name: (first loss, seconds of the first call (trace + compile), compile counters it added)}."""
    out = {}
    for name, (step, _) in cases.items():
        before, t0 = _compile_counters(), time.perf_counter()
        loss = step(0)
        seconds = time.perf_counter() - t0
        out[name] = (loss, seconds, {k: v - before[k] for k, v in _compile_counters().items()})
    return out


# -- one launch: the cases take turns ------------------------------------------------------
def _worker(model, steps, side=None):
    """Runs `model`'s cases ("mlp", "charlm", "gpt", "charlm_jit", see `_cases`) step by step in turn; with model
    "gpt_alone" only the GPT case `side` (GPT_ALONE_SIDES), the other side neither built nor imported; with
    "gpt_counted" that case's steps for scripts/bench_instructions.py --workers (`counted`)."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if model == "gpt_counted":
        counted(_gpt_alone_cases(side, rank, world)[side][0], steps)
        out = {}
    else:
        cases = _gpt_alone_cases(side, rank, world) if model == "gpt_alone" else _cases(model, rank, world)
        out = _timed(cases, steps)
        out["dtape_file"] = getattr(sys.modules.get("dtape"), "__file__", None)  # None: DDP alone never imports dtape
    dist.barrier()
    dist.destroy_process_group()  # ours to close: left to interpreter exit, gloo's threads may abort it
    return out


# Steps a counted worker takes before callgrind starts counting (imports, first calls, the layout learned).
COUNTED_WARMUP = 4


def counted(step, steps, warmup=COUNTED_WARMUP):
    """`step(k)` for `warmup` steps, then `steps` more inside one `functools.reduce` call: the only code that
    callgrind's `--toggle-collect=functools_reduce` counts (scripts/bench_instructions.py)."""
    for k in range(warmup):
        step(k)

    def measured(acc, _):
        for k in range(steps):
            step(warmup + k)
        return acc
    functools.reduce(measured, [0, 1])


def worker_pythonpath():
    """PYTHONPATH for a worker run from scripts/: this checkout first, or it would import whatever dtape is
    installed (e.g. another checkout's), not this one."""
    return os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)


def _strategy():
    import dtape
    return dtape.distribute.MultiWorkerMirroredStrategy()  # on the existing group


def _cases(model, rank, world):
    """{name: (step(k), phases)}: dtape, dtape+GradientSync and DDP on `model` (the MLP, charlm or the GPT, which
    adds "mirrored": rank 0 alone runs it under MirroredStrategy, the others wait), or the compiled-step cases."""
    strategy = _strategy()
    lr = 1e-3 if model in ("charlm", "charlm_jit") else 0.01
    if model == "charlm_jit":
        return _jit_cases(strategy, rank, world, lr)
    make_dtape, make_ddp = {"charlm": (_charlm_dtape, _charlm_ddp), "gpt": (_gpt_dtape, _gpt_ddp)}.get(
        model, (_mlp_dtape, _mlp_ddp))
    cases = {"dtape": make_dtape(strategy, rank, world, lr, False),
             "dtape_sync": make_dtape(strategy, rank, world, lr, True),
             "ddp": make_ddp(rank, world, lr)}
    if model == "gpt":  # rank 0 alone runs the GPT under MirroredStrategy (world CPU replicas); the others wait
        cases["mirrored"] = _gpt_mirrored(world) if rank == 0 else (lambda k: float("nan"), _Phases())
    return cases


# The two sides of the "gpt_alone" launches (`measure_alone`): dtape with GradientSync (train.py's step) and DDP.
GPT_ALONE_SIDES = ("dtape_sync", "ddp")


def _gpt_alone_cases(side, rank, world):
    """{side: (step(k), phases)}: the GPT step of one side alone in this launch; "ddp" does not import dtape."""
    if side == "ddp":
        return {"ddp": _gpt_ddp(rank, world, 0.01)}
    return {"dtape_sync": _gpt_dtape(_strategy(), rank, world, 0.01, True)}


def _timed(cases, steps):
    """{name: rank 0's result}: each case's first call, then `steps` steps of each, the cases taking turns BLOCK
    steps at a time, each step between two barriers; medians after warm-up (the first fifth dropped)."""
    import torch.distributed as dist
    names = list(cases)
    calls = _first_calls(cases)
    compiled = _compile_counters()
    times, cpu = {name: [] for name in names}, {name: [] for name in names}
    for k in range(1, steps + 1, BLOCK):
        b = k // BLOCK
        for name in names[b % len(names):] + names[:b % len(names)]:  # rotate: no case always goes first
            for j in range(k, min(k + BLOCK, steps + 1)):
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                cases[name][0](j)
                cpu[name].append(time.process_time() - c0)  # this process, its communication threads included
                dist.barrier()
                times[name].append(time.perf_counter() - t0)
    out = {name: _result(cases[name], calls[name], times[name], cpu[name], steps) for name in names}
    # compiles during the timed steps (0: every step reused the graphs compiled by the first calls)
    out["compiles_after_first_calls"] = {k: v - compiled[k] for k, v in _compile_counters().items()}
    return out


def _result(case, call, times, cpu, steps):
    """One case's result: first loss, step and CPU-time medians, phase medians, first call (and traces)."""
    out = {"first_loss": call[0], "step_s": statistics.median(times[steps // 5:]),
           "cpu_s": statistics.median(cpu[steps // 5:])}
    out.update(case[1].medians())
    out.update(first_call_s=call[1], first_call_compiles=call[2])
    function = getattr(case[0], "function", None)
    if function is not None:  # a compiled dtape step: traced once, its graph reused by every later step
        out.update(traces=function.trace_count, trace_s=sum(function.trace_seconds))
    return out


def _launch(model, world, steps, env=None, side=None):
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               __file__, "--worker", model, "--steps", str(steps), "--out", out.name]
        cmd += ["--side", side] if side else []
        env = dict(os.environ, **(env or {}), OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // world)),
                   PYTHONPATH=worker_pythonpath())
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, timeout=900)
        return json.load(open(out.name))


def _hidden_share(mlp1, mlp2):
    """1 - (apply_gradients' extra time at 2 workers with GradientSync) / (the same without)."""
    exposed_sync = max(mlp2["dtape_sync"]["apply_s"] - mlp1["dtape"]["apply_s"], 0.0)
    exposed = mlp2["dtape"]["apply_s"] - mlp1["dtape"]["apply_s"]
    return min(max(1 - exposed_sync / exposed, 0.0), 1.0) if exposed > 0 else float("nan")


def _report(res):
    for key, r in res.items():
        print(f"{key:20s} first loss {r['first_loss']:.7f}  step {r['step_s'] * 1e3:6.2f} ms  cpu {r['cpu_s'] * 1e3:6.2f}"
              "  " + "  ".join(f"{p} {r[p + '_s'] * 1e3:5.2f}" for p in ("forward", "walk", "apply", "backward",
                                                                      "optimizer") if p + "_s" in r)
              + (f"  first call {r['first_call_s']:.1f} s" if "first_call_s" in r else "")
              + (f"  |first loss - DDP compiled's| {r['first_loss_diff']:.1e}" if "first_loss_diff" in r else ""))


def _ratios(runs):
    """The ratios of one set of launches (see the module docstring)."""
    res = {f"{m}_{case}_{w}": r for (m, w), cases in runs.items() for case, r in cases.items()}
    for m in ("mlp", "charlm"):
        for case in ("dtape", "dtape_sync"):
            assert abs(res[f"{m}_{case}_2"]["first_loss"] - res[f"{m}_ddp_2"]["first_loss"]) < 1e-5, \
                f"{m}: {case} and DDP disagree"
    step = {k: r["step_s"] for k, r in res.items()}
    cpu = {k: r["cpu_s"] for k, r in res.items()}
    # the headline is train.py's step: GradientSync overlaps the all-reduce with the walk, as DDP does
    return res, {"mlp dtape/ddp at 2 workers": step["mlp_dtape_sync_2"] / step["mlp_ddp_2"],
                 "charlm dtape/ddp at 2 workers": step["charlm_dtape_sync_2"] / step["charlm_ddp_2"],
                 "mlp dtape, no overlap/ddp": step["mlp_dtape_2"] / step["mlp_ddp_2"],
                 "charlm dtape, no overlap/ddp": step["charlm_dtape_2"] / step["charlm_ddp_2"],
                 "mlp cpu time dtape/ddp": cpu["mlp_dtape_sync_2"] / cpu["mlp_ddp_2"],
                 "charlm cpu time dtape/ddp": cpu["charlm_dtape_sync_2"] / cpu["charlm_ddp_2"],
                 "communication hidden (share)": _hidden_share(runs[("mlp", 1)], runs[("mlp", 2)]),
                 "mlp dtape/ddp at 1 worker": step["mlp_dtape_1"] / step["mlp_ddp_1"],
                 "dtape 2 workers / 1 worker": step["mlp_dtape_sync_2"] / step["mlp_dtape_1"],
                 "ddp 2 workers / 1 worker": step["mlp_ddp_2"] / step["mlp_ddp_1"]}


def _gpt_ratios(runs):
    """The GPT launch's ratios: dtape (MultiWorkerMirroredStrategy with GradientSync, and without) and
    MirroredStrategy (2 CPU replicas in rank 0's process) against DDP, all taking turns in one launch."""
    cases = runs[("gpt", 2)]
    res = {f"gpt_{case}_2": r for case, r in cases.items()}
    for case in ("dtape", "dtape_sync", "mirrored"):
        assert abs(cases[case]["first_loss"] - cases["ddp"]["first_loss"]) < 1e-5, f"gpt: {case} and DDP disagree"
    step = {case: r["step_s"] for case, r in cases.items()}
    cpu = {case: r["cpu_s"] for case, r in cases.items()}
    return res, {"gpt dtape/ddp at 2 workers": step["dtape_sync"] / step["ddp"],
                 "gpt dtape, no overlap/ddp": step["dtape"] / step["ddp"],
                 "gpt mirrored 2 replicas/ddp": step["mirrored"] / step["ddp"],
                 "gpt cpu time dtape/ddp": cpu["dtape_sync"] / cpu["ddp"]}


def _jit_ratios(runs):
    """The "charlm_jit" launch's ratios: the compiled replica step under MultiWorkerMirroredStrategy and under
    MirroredStrategy (2 CPU replicas in rank 0's process) against DDP over a compiled module, and against
    dtape's eager step and eager DDP; all taking turns in one launch. The first-step losses must agree to
    float32 rounding (JIT_LOSS_TOLERANCE, relative: summation orders differ between the graphs and eager)."""
    cases = runs[("charlm_jit", 2)]
    res = {f"charlm_jit_{case}_2": r for case, r in cases.items()}
    reference = cases["ddp_compiled"]["first_loss"]
    for case in cases:
        diff = abs(cases[case]["first_loss"] - reference)
        assert diff < JIT_LOSS_TOLERANCE * abs(reference), \
            f"charlm: {case} and DDP over torch.compile disagree on the first loss ({diff:.1e})"
        cases[case]["first_loss_diff"] = diff
    step = {case: r["step_s"] for case, r in cases.items()}
    cpu = {case: r["cpu_s"] for case, r in cases.items()}
    return res, {"charlm jit/ddp compiled": step["jit"] / step["ddp_compiled"],
                 "charlm jit/dtape eager": step["jit"] / step["dtape"],
                 "charlm jit/dtape eager+sync": step["jit"] / step["dtape_sync"],
                 "charlm jit/ddp eager": step["jit"] / step["ddp"],
                 "charlm mirrored jit/ddp compiled": step["mirrored_jit"] / step["ddp_compiled"],
                 "charlm jit/DDP(compiled module)": step["jit"] / step["ddp_over_compiled"],
                 "charlm ddp compiled/ddp eager": step["ddp_compiled"] / step["ddp"],
                 "charlm cpu time jit/ddp compiled": cpu["jit"] / cpu["ddp_compiled"]}


JIT_LOSS_TOLERANCE = 1e-6
# (model, workers) of each launch of a set: the MLP at 1 and 2 workers, charlm and the GPT at 2
LAUNCHES = (("mlp", 1), ("mlp", 2), ("charlm", 2), ("gpt", 2))
JIT_LAUNCHES = (("charlm_jit", 2),)  # --jit-only: the compiled steps (not in LAUNCHES: each compiles for minutes)


def _set_ratios(runs):
    res, ratios = {}, {}
    if ("mlp", 1) in runs:
        res, ratios = _ratios(runs)
    if ("gpt", 2) in runs:
        gpt_res, gpt_ratios = _gpt_ratios(runs)
        res.update(gpt_res)
        ratios.update(gpt_ratios)
    if ("charlm_jit", 2) in runs:
        jit_res, jit_ratios = _jit_ratios(runs)
        res.update(jit_res)
        ratios.update(jit_ratios)
    return res, ratios


def measure(steps=60, repeat=3, verbose=True, launches=LAUNCHES, env=None):
    """`repeat` sets of `launches` (see LAUNCHES), the workers' environment updated by `env`; returns
    {"runs": [{"results", "ratios"} per set], "ratios": {name: (median, min, max) over the sets}}."""
    sets = []
    for i in range(repeat):
        runs = {(m, w): _launch(m, w, steps, env) for m, w in launches}
        files = {cases.pop("dtape_file") for cases in runs.values()}
        later = {f"{m}_{w}": cases.pop("compiles_after_first_calls") for (m, w), cases in runs.items()}
        res, ratios = _set_ratios(runs)
        sets.append({"results": res, "ratios": ratios, "dtape": sorted(files), "compiles_after_first_calls": later})
        if verbose:
            print(f"-- set {i + 1} of {repeat} (dtape imported by the workers: {', '.join(files)})")
            _report(res)
            _report_compiles(res, later)
            print("   " + "   ".join(f"{k} {v:.2f}" for k, v in ratios.items()))
    return {"runs": sets, "ratios": _summary(sets)}


def _summary(runs):
    """{name: (median, min, max)} of each ratio over `runs` (dicts with "ratios")."""
    return {k: (statistics.median(r["ratios"][k] for r in runs), min(r["ratios"][k] for r in runs),
                max(r["ratios"][k] for r in runs)) for k in runs[0]["ratios"]}


# -- (i)'s GPT step with each side alone in its own launches ----------------------------------
# Interleaved in one launch the cases share each worker's glibc heap (where its trimming lands, and the page
# faults that follow, depends on the other cases' allocations too) and gloo's threads; a training script runs one
# library. Here each side has launches of its own, taken in pairs (one launch per side, the side that goes first
# alternating between pairs, so both see the same machine load); a launch's heap layout still moves its steps,
# so the ratio is given per pair and as the median over the pairs.
def measure_alone(pairs=7, steps=60, verbose=True):
    """`pairs` pairs of "gpt_alone" launches (2 workers, `steps` steps each, GPT_ALONE_SIDES); prints each pair's
    ratios, then their medians and ranges. Returns {"pairs": [{"first", "results", "ratios"} per pair],
    "ratios": {name: (median, min, max) over the pairs}, "dtape": [the dtape files the dtape workers imported]}."""
    runs, files = [], set()
    for i in range(pairs):
        order = GPT_ALONE_SIDES if i % 2 == 0 else GPT_ALONE_SIDES[::-1]
        launches = {side: _launch("gpt_alone", 2, steps, side=side) for side in order}
        files.add(launches["dtape_sync"]["dtape_file"])
        res = {f"gpt_{side}_2": launches[side][side] for side in GPT_ALONE_SIDES}
        runs.append({"first": order[0], "results": res, "ratios": _alone_ratios(launches)})
        _report_alone_pair(i, pairs, runs[-1], verbose)
    summary = _summary(runs)
    print_summary(summary, pairs, f"pair(s) of launches, each side alone (dtape imported: {', '.join(files)})")
    return {"pairs": runs, "ratios": summary, "dtape": sorted(files)}


def _alone_ratios(launches):
    """One pair's ratios: dtape with GradientSync over DDP, step wall time and rank 0's CPU time (medians)."""
    d, t = launches["dtape_sync"]["dtape_sync"], launches["ddp"]["ddp"]
    assert abs(d["first_loss"] - t["first_loss"]) < 1e-5, "gpt, each side alone: dtape and DDP disagree"
    return {"gpt alone dtape/ddp at 2 workers": d["step_s"] / t["step_s"],
            "gpt alone cpu time dtape/ddp": d["cpu_s"] / t["cpu_s"]}


def _report_alone_pair(i, pairs, run, verbose):
    d, t = run["results"]["gpt_dtape_sync_2"], run["results"]["gpt_ddp_2"]
    print(f"-- pair {i + 1} of {pairs} ({run['first']} first): dtape/ddp {d['step_s'] / t['step_s']:.3f} "
          f"(dtape {d['step_s'] * 1e3:.2f} ms, ddp {t['step_s'] * 1e3:.2f} ms), cpu time dtape/ddp "
          f"{d['cpu_s'] / t['cpu_s']:.3f} (dtape {d['cpu_s'] * 1e3:.2f} ms, ddp {t['cpu_s'] * 1e3:.2f} ms)")
    if verbose:
        _report(run["results"])


def _report_compiles(res, later):
    """What each first call compiled, and whether it came from the on-disk caches of an earlier launch."""
    for key, r in res.items():
        c = r.get("first_call_compiles", {})
        if c.get("dynamo_graphs") or c.get("fxgraph_hit") or c.get("fxgraph_miss"):
            print(f"{key:20s} first call compiled {c['dynamo_graphs']} dynamo graph(s); inductor FX-graph cache "
                  f"{c['fxgraph_hit']} hit(s) / {c['fxgraph_miss']} miss(es), AOTAutograd cache {c['aot_hit']} / "
                  f"{c['aot_miss']}" + (f"; dtape traces {r['traces']} ({r['trace_s']:.1f} s of the first call)"
                                        if "traces" in r else ""))
    for launch, c in later.items():
        if any(c.values()):
            print(f"{launch}: compiled again during the timed steps: {c}")


def print_summary(summary, repeat, what="set(s) of launches"):
    print(f"ratios over {repeat} {what}: median (min - max)")
    for k, (med, lo, hi) in summary.items():
        print(f"  {k:32s} {med:.2f}x  ({lo:.2f} - {hi:.2f})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeat", type=int, default=3, help="sets of launches; ratios are given as their median")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--gpt-only", action="store_true", help="only the GPT launch (dtape, MirroredStrategy, DDP)")
    ap.add_argument("--gpt-alone", type=int, metavar="PAIRS",
                    help="only the GPT step with each side alone in its own launches, as a training script runs one "
                         "library (interleaved in one launch the sides share each worker's glibc heap and gloo's "
                         "threads): PAIRS pairs of launches (one of dtape with GradientSync, one of DDP, the first "
                         "alternating), the ratio per pair and its median over the pairs")
    ap.add_argument("--jit-only", action="store_true",
                    help="only the compiled-step launch: the charlm step as dtape.function(jit_compile=True) under "
                         "MultiWorkerMirroredStrategy and MirroredStrategy vs DDP over torch.compile")
    ap.add_argument("--worker", choices=["mlp", "charlm", "gpt", "charlm_jit", "gpt_alone", "gpt_counted"],
                    help=argparse.SUPPRESS)
    ap.add_argument("--side", choices=GPT_ALONE_SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        result = _worker(args.worker, args.steps, args.side)
        if int(os.environ.get("RANK", "0")) == 0 and args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)
        sys.stdout.flush()
        sys.stderr.flush()
        # The group is destroyed and the result written. Interpreter teardown after a torch.distributed run
        # aborts now and then ("terminate called without an active exception", SIGABRT: ~1 launch in 15
        # here, with a DDP-only worker too), which would fail the launch after the measurement; skip it.
        os._exit(0)
    if args.steps < 5 or args.repeat < 1 or (args.gpt_alone is not None and args.gpt_alone < 1):
        ap.error("--steps must be at least 5, --repeat and --gpt-alone at least 1")
    load = os.getloadavg()
    if args.gpt_alone:
        out = measure_alone(args.gpt_alone, args.steps)
    else:
        launches = (("gpt", 2),) if args.gpt_only else (JIT_LAUNCHES if args.jit_only else LAUNCHES)
        out = measure(args.steps, args.repeat, launches=launches)
        print_summary(out["ratios"], args.repeat)
    print(f"load average at start {load}, at end {os.getloadavg()}")
    if args.json:
        out["loadavg"] = os.getloadavg()
        out["loadavg_start"] = load
        json.dump(out, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
