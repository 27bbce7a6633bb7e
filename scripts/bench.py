"""dtape vs plain torch.autograd: op-chain overhead, an MLP and a CNN training step; tape counts.

Runs each case INTERLEAVED in one process (dtape and torch alternate, the one
that goes first alternates too) and reports medians; gc stays enabled, so GC
costs are part of the times. `--counts` prints only the deterministic
counts (records per replica tape, records with unrelated threads, Python
calls per op with a variable operand).

Cases: (a) 1,000/10,000/100,000-op chains, (b) the MLP step written by hand
and with layers, (c) a CNN step, (e) 2 CPU replicas / 1 replica on the same
global batch (and plain torch in 2 threads / 1), (f) bytes the tape holds for
one MLP step vs what torch autograd saves (saved_tensors_hooks), (g) RSS
growth over 200 MLP steps (each variant in a fresh process; resident size
after glibc's malloc_trim: live memory, not the allocator's cache), (h) the
charlm step vs the same transformer as a torch.nn.Module with torch.optim.Adam,
(i) on the CPU, 2 torchrun workers (gloo) with dtape's MultiWorkerMirroredStrategy
against 2 with torch DistributedDataParallel, for the MLP and charlm steps
(scripts/bench_multiworker.py: 2 workers / 1, the share of communication hidden; and the
GPT of scripts/tasks/torch_gpt.py through TorchModule + from_torch(AdamW): 2 workers against DDP, and
MirroredStrategy with 2 CPU replicas in one process against the same DDP run, all in one launch; with
--gpt-only also that GPT step with each side alone in torchrun launches of its own, as a training script runs
one library, pairs of launches taking turns (7 pairs, --quick 2: see multiworker_alone_case), besides the
interleaved launch: interleaved, the sides share each worker's glibc heap and gloo's threads, as in (j)),
(j) that GPT step (one intra-op thread) against plain torch with the same AdamW: first with each side alone in
a process of its own, a pair of processes taking turns on one core (9 pairs: see gpt_alone_rows), then
interleaved in one process with each side's minor page faults per step, then interleaved again in a child
process whose glibc keeps its heap (fixed malloc thresholds, both sides alike: see gpt_fixed_heap_rows).
(k) the cost of checking every collective's signature across the 2 workers (check on / off:
one-element reductions and the MLP step with GradientSync; scripts/bench_collective_check.py).
(l) `--jit-only`: compiled steps, dtape.function(jit_compile=True, inductor), against eager dtape, torch
autograd and (charlm) torch.compile of the same torch.nn.Module with opt.step compiled too; first-call
(trace + compile) seconds apart from the interleaved medians; then (unless --no-multiworker) the compiled
step under strategies (`--jit-strategies` runs only that): the charlm replica step compiled in 2 torchrun
workers (MultiWorkerMirroredStrategy) and in 2 MirroredStrategy CPU replicas, against DDP over a compiled
module (scripts/bench_multiworker.py --jit-only).

  python scripts/bench.py [--device cpu|cuda] [--quick] [--counts] [--no-multiworker] [--gpt-only] [--jit-only]
                          [--jit-strategies] [--json PATH]
"""
import argparse
import copy
import ctypes
import gc
import json
import math
import os
import platform
import resource
import select
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.nn.functional as F

# This checkout's dtape, not an installed one (python puts scripts/ first on sys.path).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dtape  # noqa: E402

import bench_collective_check  # noqa: E402  (scripts/, beside this file)
import bench_multiworker  # noqa: E402


def timer(device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run(fn):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0
    return run


def interleave(run, fn_dtape, fn_torch, reps, warmup, summary=statistics.median):
    """`summary` (default: the median) of `run(fn)` for each side, the two taken in turn (which goes first
    alternating), after `warmup` calls of each."""
    for _ in range(warmup):
        fn_dtape(), fn_torch()
    td, tt = [], []
    for r in range(reps):
        if r % 2:
            tt.append(run(fn_torch)); td.append(run(fn_dtape))
        else:
            td.append(run(fn_dtape)); tt.append(run(fn_torch))
    return summary(td), summary(tt)


def _check_first_loss(what, ld, lt):
    """Prints both first-step losses and fails if dtape's and torch's disagree (the cases must compute the same)."""
    print(f"{what} first-step loss: dtape {ld:.7f}  torch {lt:.7f}  |diff| {abs(ld - lt):.1e}")
    assert abs(ld - lt) < 1e-5 * max(1.0, abs(lt)), f"dtape and torch {what} steps disagree"


# -- (a) a chain of N small ops ------------------------------------------------
def chain_case(n, device):
    g = torch.Generator().manual_seed(0)
    x0, w0, b0 = (torch.randn(4, 4, generator=g).to(device) for _ in range(3))
    dx, dw, db = (dtape.constant(v) for v in (x0, w0, b0))
    tx, tw, tb = (v.clone().requires_grad_() for v in (x0, w0, b0))

    def run_dtape():
        with dtape.GradientTape() as tape:
            tape.watch([dx, dw, db])
            y = dx
            for i in range(n):
                k = i % 3
                y = y * dw if k == 0 else (y + db if k == 1 else dtape.tanh(y))
            loss = dtape.reduce_sum(y)  # inside the tape, or it is not recorded (TF semantics)
        return tape.gradient(loss, [dx, dw, db])

    def run_torch():
        y = tx
        for i in range(n):
            k = i % 3
            y = y * tw if k == 0 else (y + tb if k == 1 else torch.tanh(y))
        return torch.autograd.grad(y.sum(), [tx, tw, tb])

    err = max((a.torch() - b).abs().max().item() for a, b in zip(run_dtape(), run_torch()))
    return run_dtape, run_torch, f"max |grad diff| {err:.1e}"


# -- (b) MLP training step -----------------------------------------------------
def _mlp_setup(sizes, batch, device="cpu"):
    """The MLP cases' seeded start: weights [W1, b1, W2, b2, ...] (W [in, out] scaled by fan_in ** -0.5,
    b zeros), data [batch, sizes[0]] and int64 labels [batch], on `device`; the same in every case."""
    g = torch.Generator().manual_seed(0)
    init = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        init += [torch.randn(fan_in, fan_out, generator=g) * fan_in ** -0.5, torch.zeros(fan_out)]
    data = torch.randn(batch, sizes[0], generator=g)
    labels = torch.randint(0, sizes[-1], (batch,), generator=g)
    return [p.to(device) for p in init], data.to(device), labels.to(device)


def _dtape_logits(h, params):
    """The MLP forward on dtape: x @ W + b per layer, relu between layers."""
    for i in range(0, len(params), 2):
        h = dtape.matmul(h, params[i]) + params[i + 1]
        if i + 2 < len(params):
            h = dtape.nn.relu(h)
    return h


def _torch_logits(h, params):
    """The same forward in plain torch."""
    for i in range(0, len(params), 2):
        h = h @ params[i] + params[i + 1]
        if i + 2 < len(params):
            h = torch.relu(h)
    return h


def mlp_case(device, sizes=(784, 1024, 1024, 10), batch=256, lr=0.01):
    init, data, labels = _mlp_setup(sizes, batch, device)

    dvars = [dtape.Variable(p) for p in init]
    dx, dy = dtape.constant(data), dtape.constant(labels)
    opt = dtape.optimizers.SGD(lr)
    tparams = [p.clone().requires_grad_() for p in init]

    def run_dtape():
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_mean(dtape.nn.sparse_softmax_cross_entropy_with_logits(dy, _dtape_logits(dx, dvars)))
        grads = tape.gradient(loss, dvars)
        opt.apply_gradients(zip(grads, dvars))
        return loss

    def run_torch():
        loss = F.cross_entropy(_torch_logits(data, tparams), labels)
        grads = torch.autograd.grad(loss, tparams)
        with torch.no_grad():
            for p, gr in zip(tparams, grads):
                p.sub_(lr * gr)
        return loss

    ld, lt = float(run_dtape()), run_torch().item()
    _check_first_loss("MLP", ld, lt)

    def check():
        return max((v.torch() - p.detach()).abs().max().item() for v, p in zip(dvars, tparams))
    return run_dtape, run_torch, check


# -- (c) a small CNN step (conv2d gradients: torch's kernels, no image gradient for layer 1) --
def cnn_case(device, batch=32, lr=0.01):
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 3, 1, 16), (16,), (3, 3, 16, 32), (32,), (7 * 7 * 32, 10), (10,)]
    init = [(torch.randn(*s, generator=g) * 0.1).to(device) for s in shapes]
    data = torch.randn(batch, 28, 28, 1, generator=g).to(device)
    labels = torch.randint(0, 10, (batch,), generator=g).to(device)
    dvars = [dtape.Variable(p) for p in init]
    dx, dy = dtape.constant(data), dtape.constant(labels)
    opt = dtape.optimizers.SGD(lr)
    tparams = [p.clone().requires_grad_() for p in init]

    def run_dtape():
        with dtape.GradientTape() as tape:
            h = dx
            for i in (0, 2):
                h = dtape.nn.relu(dtape.nn.conv2d(h, dvars[i], strides=2, padding="SAME") + dvars[i + 1])
            logits = dtape.matmul(dtape.reshape(h, (batch, -1)), dvars[4]) + dvars[5]
            loss = dtape.reduce_mean(dtape.nn.sparse_softmax_cross_entropy_with_logits(dy, logits))
        opt.apply_gradients(zip(tape.gradient(loss, dvars), dvars))
        return loss

    def run_torch():
        h = data.permute(0, 3, 1, 2)
        for i in (0, 2):  # SAME with stride 2 on even sizes, k=3: pad 0 before, 1 after
            h = F.conv2d(F.pad(h, (0, 1, 0, 1)), tparams[i].permute(3, 2, 0, 1), stride=2)
            h = torch.relu(h + tparams[i + 1].reshape(1, -1, 1, 1))
        logits = h.permute(0, 2, 3, 1).reshape(batch, -1) @ tparams[4] + tparams[5]
        loss = F.cross_entropy(logits, labels)
        grads = torch.autograd.grad(loss, tparams)
        with torch.no_grad():
            for p, gr in zip(tparams, grads):
                p.sub_(lr * gr)
        return loss

    ld, lt = float(run_dtape()), run_torch().item()
    _check_first_loss("CNN", ld, lt)
    return run_dtape, run_torch


# -- (b2) the same MLP written with layers (dtape.layers.Dense vs torch.nn.Linear) ---------
def mlp_layers_case(device, sizes=(784, 1024, 1024, 10), batch=256, lr=0.01):
    g = torch.Generator().manual_seed(0)
    data = torch.randn(batch, sizes[0], generator=g).to(device)
    labels = torch.randint(0, sizes[-1], (batch,), generator=g).to(device)
    dense = [dtape.layers.Dense(n, activation="relu" if i + 2 < len(sizes) else None, input_dim=m, seed=i)
             for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:]))]
    dvars = [v for layer in dense for v in layer.trainable_variables]
    linears = [torch.nn.Linear(m, n) for m, n in zip(sizes[:-1], sizes[1:])]
    with torch.no_grad():
        for layer, lin in zip(dense, linears):
            lin.weight.copy_(layer.kernel.torch().T)
            lin.bias.copy_(layer.bias.torch())
    net = torch.nn.Sequential(*[m for lin in linears for m in (lin, torch.nn.ReLU())][:-1]).to(device)
    dx, dy = dtape.constant(data), dtape.constant(labels)
    dopt, topt = dtape.optimizers.SGD(lr), torch.optim.SGD(net.parameters(), lr=lr)

    def forward_dtape():
        h = dx
        for layer in dense:
            h = layer(h)
        return dtape.reduce_mean(dtape.nn.sparse_softmax_cross_entropy_with_logits(dy, h))

    def run_dtape():
        with dtape.GradientTape() as tape:
            loss = forward_dtape()
        dopt.apply_gradients(zip(tape.gradient(loss, dvars), dvars))
        return loss

    def run_torch():
        topt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(data), labels)
        loss.backward()
        topt.step()
        return loss

    ld, lt = float(run_dtape()), run_torch().item()
    _check_first_loss("MLP (layers)", ld, lt)
    return run_dtape, run_torch


# -- (e) replicas: 2 CPU replicas vs 1 on the same global batch ------------------------------
def replica_case(n_replicas, sizes=(784, 1024, 1024, 10), batch=256, lr=0.01):
    """A MirroredStrategy MLP step on `n_replicas` CPU devices; each replica takes batch / n examples."""
    init, data, labels = _mlp_setup(sizes, batch)
    strategy = dtape.distribute.MirroredStrategy(devices=[f"cpu:{i}" for i in range(n_replicas)])
    with strategy.scope():
        dvars = [dtape.Variable(p) for p in init]
        opt = dtape.optimizers.SGD(lr)
    per = batch // n_replicas
    shards = [(dtape.constant(data[i * per:(i + 1) * per]), dtape.constant(labels[i * per:(i + 1) * per]))
              for i in range(n_replicas)]

    def replica_step():
        x, y = shards[dtape.distribute.get_replica_context().replica_id_in_sync_group]
        with dtape.GradientTape() as tape:
            per_example = dtape.nn.sparse_softmax_cross_entropy_with_logits(y, _dtape_logits(x, dvars))
            loss = dtape.reduce_sum(per_example) / batch
        opt.apply_gradients(zip(tape.gradient(loss, dvars), dvars))
        return loss

    def run():
        return strategy.run(replica_step)
    return run


def torch_threads_case(n_threads, sizes=(784, 1024, 1024, 10), batch=256):
    """Plain torch forward+backward of the same MLP split over n threads (the reference for (e))."""
    init, data, labels = _mlp_setup(sizes, batch)
    params = [p.requires_grad_() for p in init]
    per = batch // n_threads

    def work(i):
        h = _torch_logits(data[i * per:(i + 1) * per], params)
        torch.autograd.grad(F.cross_entropy(h, labels[i * per:(i + 1) * per]), params)

    def run():
        if n_threads == 1:
            return work(0)
        threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    return run


# -- (f) memory the tape holds for one MLP step vs what torch autograd saves -------------------
def _storage_bytes(tensors):
    seen = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[(t.device, st.data_ptr())] = st.nbytes()
    return sum(seen.values())


def memory_case(device, sizes=(784, 1024, 1024, 10), batch=256):
    """(dtape tape.nbytes(), records, torch saved bytes) for one forward of the MLP step."""
    init, data, labels = _mlp_setup(sizes, batch, device)
    dvars = [dtape.Variable(p) for p in init]
    with dtape.GradientTape() as tape:
        h = _dtape_logits(dtape.constant(data), dvars)
        loss = dtape.reduce_mean(dtape.nn.sparse_softmax_cross_entropy_with_logits(dtape.constant(labels), h))
    if hasattr(tape, "nbytes"):
        d_bytes, d_records = tape.nbytes(), tape.num_records()
    else:  # a dtape without GradientTape.nbytes (older versions): the records' inputs and outputs
        recs = tape._tape.records()
        d_bytes = _storage_bytes([x.torch() for r in recs for x in list(r[3]) + list(r[4])
                                  if isinstance(x, dtape.Tensor)])
        d_records = len(recs)
    tape.gradient(loss, dvars)
    saved = []
    tparams = [p.clone().requires_grad_() for p in init]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = F.cross_entropy(_torch_logits(data, tparams), labels)
    t_bytes = _storage_bytes(saved)
    torch.autograd.grad(loss, tparams)
    return d_bytes, d_records, t_bytes


# -- (g) RSS growth over 200 MLP steps, each variant in a fresh process ----------------------------
def _rss_bytes():
    """Resident bytes after giving the allocator's free pages back (glibc `malloc_trim`): what is
    live, not what malloc keeps cached from the last step (that moved by ~10 MiB from run to run)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the plain resident size
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_child(variant, steps=200):
    """Runs `steps` MLP steps of one variant (dtape|torch)-(manual|layers); prints the RSS growth.

    Measured from after the case's setup (which ran one step to check the
    first-step loss) to after the steps: the step's working set, allocator
    caching and any leak.
    """
    lib, style = variant.split("-")
    device = torch.device("cpu")
    fd, ft = (mlp_case(device) if style == "manual" else mlp_layers_case(device))[:2]
    fn = fd if lib == "dtape" else ft
    start = _rss_bytes()  # after the weights and data exist, before the first timed step
    for _ in range(steps):
        fn()
    print(f"RSS_GROWTH {_rss_bytes() - start}")


def rss_growth(variant):
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--rss-child", variant],
                         capture_output=True, text=True, timeout=900, check=True).stdout
    return int(next(line for line in out.splitlines() if line.startswith("RSS_GROWTH")).split()[1])


# -- (h) charlm training step vs the same transformer as a torch.nn.Module + torch.optim.Adam -------
def charlm_case(device, batch=32, seed=0):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tasks import charlm
    data = charlm.load_data(seed)
    x_np, y_np = data["x_train"][:batch], data["y_train"][:batch]
    with dtape.device(str(device)):
        model = charlm.build_model(seed)
    dvars = list(model.trainable_variables)
    opt = dtape.optimizers.Adam(1e-3)
    dx = dtape.constant(torch.as_tensor(x_np, device=device))
    dy = dtape.constant(torch.as_tensor(y_np, device=device))
    net = _TorchCharLM([v.torch().clone() for v in dvars], charlm).to(device)
    topt = torch.optim.Adam(net.parameters(), lr=1e-3, eps=1e-7)
    tx, ty = torch.as_tensor(x_np, device=device), torch.as_tensor(y_np, device=device)

    def run_dtape():
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_mean(charlm.per_example_loss(model, dx, dy))
        opt.apply_gradients(zip(tape.gradient(loss, dvars), dvars))
        return loss

    def run_torch():
        topt.zero_grad(set_to_none=True)
        logits = net(tx)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ty.reshape(-1))
        loss.backward()
        topt.step()
        return loss

    ld, lt = float(run_dtape()), run_torch().item()
    _check_first_loss("charlm", ld, lt)
    return run_dtape, run_torch


class _TorchCharLM(torch.nn.Module):
    """charlm's CharTransformer in plain torch, from dtape's variables (in `trainable_variables` order)."""

    def __init__(self, values, charlm):
        super().__init__()
        self.params = torch.nn.ParameterList([torch.nn.Parameter(v) for v in values])
        self.c = charlm

    def forward(self, ids):
        p = iter(self.params)
        c = self.c
        b, t = ids.shape
        tokens, positions = next(p), next(p)
        h = tokens[ids] + positions[torch.arange(t, device=ids.device)]
        mask = torch.triu(torch.full((t, t), -1e9, device=ids.device), diagonal=1)
        hd = c.WIDTH // c.HEADS
        for _ in range(c.DEPTH):
            g1, b1, wqkv, bqkv, wo, bo, g2, b2, w1, bb1, w2, bb2 = (next(p) for _ in range(12))
            a = F.layer_norm(h, (c.WIDTH,), g1, b1, eps=1e-3)
            q, k, v = ((z.reshape(b, t, c.HEADS, hd).permute(0, 2, 1, 3)) for z in (a @ wqkv + bqkv).split(c.WIDTH, -1))
            w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(hd) + mask, dim=-1)
            h = h + ((w @ v).permute(0, 2, 1, 3).reshape(b, t, c.WIDTH) @ wo + bo)
            a = F.layer_norm(h, (c.WIDTH,), g2, b2, eps=1e-3)
            h = h + (F.gelu(a @ w1 + bb1) @ w2 + bb2)
        g, bb, wh, bh = next(p), next(p), next(p), next(p)
        return F.layer_norm(h, (c.WIDTH,), g, bb, eps=1e-3) @ wh + bh


# -- (l) compiled steps: dtape.function(jit_compile=True) vs eager dtape, torch autograd and torch.compile --------
def interleave_many(run, fns, reps, warmup):
    """Medians of `fns` (a dict name -> fn) timed in turn, the order rotated every repetition."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    names = list(fns)
    times = {name: [] for name in names}
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(run(fns[name]))
    return {name: statistics.median(t) for name, t in times.items()}


def _first_call(run, fn):
    """Seconds of the first call (a compiled function traces and compiles in it)."""
    return run(fn)


def jit_charlm_fns(device, batch=32, seed=0):
    """charlm's step (forward, gradient, Adam) four ways, from the same start; and the first-call seconds."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tasks import charlm
    data = charlm.load_data(seed)
    x_np, y_np = data["x_train"][:batch], data["y_train"][:batch]
    tx, ty = torch.as_tensor(x_np, device=device), torch.as_tensor(y_np, device=device)
    dx, dy = dtape.constant(tx), dtape.constant(ty)

    def dtape_step():
        with dtape.device(str(device)):
            model = charlm.build_model(seed)
        opt = dtape.optimizers.Adam(1e-3)
        opt.build(model.trainable_variables)  # slots before the trace: the first compiled call compiles

        def step(x, y):
            with dtape.GradientTape() as tape:
                loss = dtape.reduce_mean(charlm.per_example_loss(model, x, y))
            variables = model.trainable_variables
            opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
            return loss
        return step, model
    eager, model = dtape_step()
    compiled = dtape.function(dtape_step()[0], jit_compile=True)
    values = [v.torch().clone() for v in model.trainable_variables]

    def torch_step(net, opt_step, forward):
        def step():
            net.zero_grad(set_to_none=True)
            logits = forward(tx)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ty.reshape(-1))
            loss.backward()
            opt_step()
            return loss
        return step
    net = _TorchCharLM([v.clone() for v in values], charlm).to(device)
    fused = torch.optim.Adam(net.parameters(), lr=1e-3, eps=1e-7, fused=True)
    # torch's "compiling the optimizer" recipe: the module compiled, opt.step in a compiled function of its own
    cnet = _TorchCharLM([v.clone() for v in values], charlm).to(device)
    copt = torch.optim.Adam(cnet.parameters(), lr=1e-3, eps=1e-7)
    fns = {"dtape compiled": lambda: compiled(dx, dy), "dtape eager": lambda: eager(dx, dy),
           "torch autograd + fused Adam": torch_step(net, fused.step, net),
           "torch.compile module + opt.step": torch_step(cnet, torch.compile(copt.step), torch.compile(cnet))}
    return fns


def jit_chain_fns(n=1_000):
    """The 1,000-op chain's gradient (case (a)) compiled, eager and in torch autograd."""
    run_eager, run_torch, _ = chain_case(n, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    x0, w0, b0 = (dtape.constant(torch.randn(4, 4, generator=g)) for _ in range(3))

    def chain(x, w, b):
        with dtape.GradientTape() as tape:
            tape.watch([x, w, b])
            y = x
            for i in range(n):
                k = i % 3
                y = y * w if k == 0 else (y + b if k == 1 else dtape.tanh(y))
            loss = dtape.reduce_sum(y)
        return tape.gradient(loss, [x, w, b])
    compiled = dtape.function(chain, jit_compile=True)

    def run_compiled():
        grads = compiled(x0, w0, b0)
        if not checked:  # the first call (trace + compile) also checks the gradients
            checked.append(max((a.torch() - b).abs().max().item() for a, b in zip(grads, run_torch())))
            print(f"chain N={n:,} compiled: max |grad diff| vs torch {checked[0]:.1e}")
        return grads
    checked = []
    return {"dtape compiled": run_compiled, "dtape eager": run_eager, "torch autograd": run_torch}


def jit_mlp_fns(sizes=(64, 128, 10), batch=64, lr=0.1):
    """The digits-sized MLP step (64-128-10, SGD) compiled, eager and in torch autograd."""
    init, data, labels = _mlp_setup(sizes, batch)
    run_torch = mlp_case(torch.device("cpu"), sizes, batch, lr)[1]

    def dtape_step():
        dvars = [dtape.Variable(p.clone()) for p in init]
        opt = dtape.optimizers.SGD(lr)

        def step(x, y):
            with dtape.GradientTape() as tape:
                loss = dtape.reduce_mean(dtape.nn.sparse_softmax_cross_entropy_with_logits(y, _dtape_logits(x, dvars)))
            opt.apply_gradients(zip(tape.gradient(loss, dvars), dvars))
            return loss
        return step
    dx, dy = dtape.constant(data), dtape.constant(labels)
    eager, compiled = dtape_step(), dtape.function(dtape_step(), jit_compile=True)
    return {"dtape compiled": lambda: compiled(dx, dy), "dtape eager": lambda: eager(dx, dy),
            "torch autograd": run_torch}


def jit_only(run, args, load):
    """`--jit-only`: case (l), compiled dtape steps against eager dtape, torch autograd and torch.compile."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    q = args.quick
    result = {}
    for case, make, reps in (("charlm step (Adam), batch 32", lambda: jit_charlm_fns(torch.device(args.device)),
                              7 if q else 21),
                             ("digits-sized MLP step 64-128-10 (SGD), batch 64", jit_mlp_fns, 11 if q else 41),
                             ("chain N=1,000, gradient", jit_chain_fns, 7 if q else 31)):
        fns = make()
        first = {name: _first_call(run, fn) for name, fn in fns.items()}
        medians = interleave_many(run, fns, reps, 2)
        result[case] = {"first_call_s": first, "median_s": medians, "reps": reps}
        compiled = medians["dtape compiled"]
        print(f"(l) {case} ({reps} reps, medians after the first call):")
        for name, t in medians.items():
            print(f"    {name:34s} {t * 1e3:9.3f} ms   compiled / this {compiled / t:5.2f}   "
                  f"first call {first[name]:7.2f} s")
    strategies = None if args.no_multiworker or args.device != "cpu" else jit_strategies_case(args.quick)
    load_end = os.getloadavg()
    print(f"load average at start {load}, at end {load_end}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_start": load, "load_end": load_end, "jit": result, "jit_strategies": strategies}, f,
                      indent=2)


def jit_strategies_case(quick):
    """(l) under strategies: scripts/bench_multiworker.py's compiled-step launch (2 sets of 30 steps; --quick:
    1 of 12): the charlm replica step compiled under MultiWorkerMirroredStrategy (2 torchrun workers, gloo)
    and MirroredStrategy (2 CPU replicas in rank 0), against DDP over torch.compile and the eager steps."""
    repeat, steps = (1, 12) if quick else (2, 30)
    print(f"(l) compiled charlm replica step under strategies vs DDP over torch.compile: {repeat} set(s) of "
          f"{steps} steps (first calls: trace + compile, apart)")
    out = bench_multiworker.measure(steps, repeat, launches=bench_multiworker.JIT_LAUNCHES)
    bench_multiworker.print_summary(out["ratios"], repeat)
    return out


def jit_strategies_only(args, load):
    """`--jit-strategies`: only the compiled steps under strategies, with the machine's load before and after."""
    out = jit_strategies_case(args.quick)
    load_end = os.getloadavg()
    print(f"load average at start {load}, at end {load_end}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_start": load, "load_end": load_end, "jit_strategies": out}, f, indent=2)


# -- (j) the GPT-shaped torch.nn.Module through TorchModule + from_torch(AdamW) vs plain torch ----------
def gpt_case(device):
    """One training step of scripts/tasks/torch_gpt.py's GPT (bench_multiworker.GPT_SHAPE, 32 sequences):
    dtape.layers.TorchModule with dtape.optimizers.from_torch(torch.optim.AdamW) against the same module
    copy with the same AdamW (nanoGPT's two parameter groups) in plain torch, on the same batches."""
    run_dtape, run_torch = gpt_step("dtape", device), gpt_step("torch", device)
    ld, lt = float(run_dtape()), run_torch().item()
    _check_first_loss("GPT", ld, lt)
    return run_dtape, run_torch


def gpt_step(side, device):
    """`gpt_case`'s step of one side ("dtape" or "torch") alone: the same seeded weights and batches whichever
    side is built, so each side can also run in a process of its own (`gpt_alone_rows`)."""
    module, make_adamw, data, labels = bench_multiworker._gpt(torch)
    data, labels = data.to(device), labels.to(device)
    return (_gpt_dtape_step if side == "dtape" else _gpt_torch_step)(module.to(device), make_adamw, data, labels)


def _gpt_dtape_step(module, make_adamw, data, labels):
    tm = dtape.layers.TorchModule(module)
    dopt = dtape.optimizers.from_torch(make_adamw(tm.parameters()))
    dvars = tm.trainable_variables
    batches = [(dtape.constant(data[k]), dtape.constant(labels[k])) for k in range(len(data))]
    step = [0]

    def run_dtape():
        x, y = batches[step[0] % len(batches)]
        step[0] += 1
        with dtape.GradientTape() as tape:
            logits = tm(x)
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))
        dopt.apply_gradients(zip(tape.gradient(loss, dvars), dvars))
        return loss
    return run_dtape


def _gpt_torch_step(net, make_adamw, data, labels):
    topt = make_adamw(net.parameters())
    step = [0]

    def run_torch():
        k = step[0] % len(data)
        step[0] += 1
        topt.zero_grad(set_to_none=True)
        logits = net(data[k])
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels[k].view(-1))
        loss.backward()
        topt.step()
        return loss
    return run_torch


def _cpu_time(fn):
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def _minor_faults(fn):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def gpt_rows(run, quick):
    """(j), with one intra-op thread on both sides (as each torchrun worker of (i) has)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fd, ft = gpt_case(torch.device("cpu"))
        reps = 9 if quick else 121  # ~50 ms steps: many repetitions are cheap, and steady the medians
        rows = [("(j) GPT step, TorchModule+from_torch(AdamW), 1 thread", *interleave(run, fd, ft, reps, 3), reps)]
        # the process's CPU time per step (one thread): steadier than wall time on a loaded machine
        rows.append(("(j) the same, CPU time", *interleave(_cpu_time, fd, ft, reps, 1), reps))
        # where glibc's heap trimming lands (which step frees into the top of the heap past its threshold, and
        # which grows it again) moves with the shared heap's layout; a step that pays it spends ms in the kernel
        faults = interleave(_minor_faults, fd, ft, reps, 0, summary=statistics.mean)
        print(f"(j) minor page faults per step, mean of {reps} interleaved steps: dtape {faults[0]:.0f}, "
              f"torch {faults[1]:.0f} (glibc returning heap to the system and taking it back: ~1,000 a step "
              "cost ~3 ms)")
        return rows
    finally:
        torch.set_num_threads(threads)


# glibc's malloc tunables (read at process start): fixed thresholds, which also stop glibc moving them as it
# frees, so the heap is neither handed back to the system nor taken again from step to step.
FIXED_HEAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**30)}


def gpt_fixed_heap_rows(quick):
    """(j) again in a child process whose glibc keeps its heap (FIXED_HEAP_ENV, on both sides alike): the
    same steps without the page faults that glibc's trimming puts on whichever step it lands; PyTorch's CPU
    tuning guide advises an allocator that keeps its memory (jemalloc, tcmalloc) for the same reason."""
    cmd = [sys.executable, os.path.abspath(__file__), "--gpt-heap-child"] + (["--quick"] if quick else [])
    out = subprocess.run(cmd, env=dict(os.environ, **FIXED_HEAP_ENV), check=True, capture_output=True, text=True,
                         timeout=1800).stdout
    *notes, last = out.strip().splitlines()
    for line in notes:
        print(f"[glibc heap kept] {line}")
    rows = json.loads(last)
    return [(f"{name} [glibc heap kept]", d, t, r) for name, d, t, r in rows]


# Each side of (j) alone in a process of its own, the two processes taking turns: ALONE_BLOCK steps at a time
# (the first of each turn, after the other process ran, not counted), the side that starts alternating.
ALONE_BLOCK = 7
ALONE_TIMEOUT_S = 600
ALONE_SIDES = ("dtape", "torch")


def gpt_alone_rows(quick):
    """(j) with each side alone in a process of its own, as a training script runs one library.

    Interleaved in one process the two steps share glibc's heap: where its
    trimming lands (a step that frees the top of the heap past the threshold
    hands it back, the next step faults ~1,000 pages back in, ~3 ms) depends
    on the other side's allocations too. Here each side has its own heap,
    and the two processes take turns, so both see the same machine load.
    A process's heap layout still decides whether its steps fault, and
    where its pages land in physical memory how often its working set (a few
    MB, about the caches' size) conflicts in them, so the measurement runs
    `pairs` pairs of fresh processes; the ratio of each pair's medians is
    printed with their median and range, the rows give the medians of every
    pair's steps pooled. Both processes of a pair run on one core (the next
    pair on the next core), as they take turns anyway: on this 2-core VM the
    two cores can differ by up to ~20% for minutes (two torch processes, one
    per core, once gave 0.81), which is the machine, not either library.
    Which side starts first alternates from pair to pair too.
    """
    pairs, turns = (1, 4) if quick else (9, 14)
    steps = {side: [] for side in ALONE_SIDES}
    ratios = []
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [-1]  # -1: not pinned (macOS)
    for i in range(pairs):
        pair = _alone_pair(turns, cores[i % len(cores)], ALONE_SIDES if i % 2 == 0 else ALONE_SIDES[::-1])
        for side, rows in pair.items():
            steps[side] += rows
        ratios.append(statistics.median(r[0] for r in pair["dtape"]) / statistics.median(r[0] for r in pair["torch"]))
        faults = {side: statistics.median(r[2] for r in rows) for side, rows in pair.items()}
        print(f"(j) alone, a pair of processes: dtape/torch {ratios[-1]:.3f}, minor page faults per step (median) "
              f"dtape {faults['dtape']:.0f}, torch {faults['torch']:.0f}")
    print(f"(j) alone: dtape/torch per pair of processes, median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}) over {pairs} pair(s)")
    n = len(steps["dtape"])
    med = {side: [statistics.median(r[i] for r in rows) for i in range(2)] for side, rows in steps.items()}
    name = f"(j) GPT step, each side alone in its process ({pairs} pair(s))"
    return [(name, med["dtape"][0], med["torch"][0], n), (f"{name}, CPU time", med["dtape"][1], med["torch"][1], n)]


def _alone_pair(turns, core, order):
    """{side: [(wall s, CPU s, minor faults) per counted step]} of one pair of `--gpt-alone-child` processes,
    both on CPU `core`, started and taking turns in `order` (the reverse on odd turns)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--gpt-alone-child"]
    procs = {side: subprocess.Popen(cmd + [side, "--core", str(core)], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True)
             for side in order}
    try:
        out = {side: [] for side in procs}
        for turn in range(turns):
            for side in (order if turn % 2 == 0 else order[::-1]):
                out[side] += _alone_turn(procs[side], side)[1:]
        return out
    finally:
        for p in procs.values():
            p.stdin.close()
        for p in procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def _alone_turn(proc, side):
    proc.stdin.write(f"{ALONE_BLOCK}\n")
    proc.stdin.flush()
    if not select.select([proc.stdout], [], [], ALONE_TIMEOUT_S)[0]:
        raise TimeoutError(f"the {side} process of (j) alone gave no steps in {ALONE_TIMEOUT_S} s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the {side} process of (j) alone exited (code {proc.wait(timeout=60)})")
    return json.loads(line)


def gpt_alone_child(side, core):
    """`--gpt-alone-child SIDE --core K`: builds only SIDE's step (one intra-op thread, on CPU K if K >= 0); for each
    line N on stdin runs N steps and prints their [wall s, CPU s, minor faults] as one JSON line."""
    if core >= 0:
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    step = gpt_step(side, torch.device("cpu"))
    for _ in range(3):
        step()
    for line in sys.stdin:
        rows = []
        for _ in range(int(line)):
            faults, cpu, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time(), time.perf_counter()
            step()
            rows.append((time.perf_counter() - t0, time.process_time() - cpu,
                         resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults))
        print(json.dumps(rows), flush=True)


# -- (i) 2 torchrun workers: dtape against DistributedDataParallel ---------------------
def multiworker_case(quick, launches=None, env=None, label=""):
    """scripts/bench_multiworker.py's launches (3 sets of 60 steps; --quick: 1 of 20), the workers' environment
    updated by `env`; prints its ratios."""
    repeat, steps = (1, 20) if quick else (3, 60)
    print(f"(i) 2 torchrun workers (gloo), dtape vs DistributedDataParallel{label}: {repeat} set(s) of {steps} steps")
    out = bench_multiworker.measure(steps, repeat, verbose=False, launches=launches or bench_multiworker.LAUNCHES,
                                    env=env)
    bench_multiworker.print_summary(out["ratios"], repeat)
    return out


def multiworker_alone_case(quick):
    """(i)'s GPT step with each side alone in torchrun launches of its own (bench_multiworker.measure_alone:
    7 pairs of launches of 60 steps; --quick: 2 pairs of 20), for the reason of (j)'s `gpt_alone_rows`: in one
    launch the sides share each worker's glibc heap and gloo's threads. Prints each pair's ratios and their
    median (min - max)."""
    pairs, steps = (2, 20) if quick else (7, 60)
    print(f"(i) GPT, each side alone in its own launches of 2 torchrun workers (gloo): {pairs} pair(s) of "
          f"launches of {steps} steps")
    return bench_multiworker.measure_alone(pairs, steps, verbose=False)


# -- (k) the collective signature check, on and off -----------------------------------
def collective_check_case(quick):
    """scripts/bench_collective_check.py's launch (40 turns; --quick: 10); prints its table."""
    print("(k) the collective signature check on 2 torchrun workers (gloo), on vs off:")
    res = bench_collective_check.measure(10 if quick else 40)
    bench_collective_check.print_table(res)
    return res


# -- (d) counts: tape scope and Python calls per variable read -----------------------------
def count_calls(fn):
    """Python function calls (sys.setprofile 'call' events, this thread) made by fn(), fn itself included."""
    n = [0]

    def prof(frame, event, arg):
        if event == "call":
            n[0] += 1
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n[0]


def calls_variable_op():
    """Calls for `v * x` (v a Variable the recording tape already watches)."""
    v, x = dtape.Variable(torch.ones(3)), dtape.constant(torch.ones(3))
    with dtape.GradientTape():
        v * x
        v * x
        return count_calls(lambda: v * x)


def calls_mirrored_op():
    """Calls for `v * x` on each replica thread (v a MirroredVariable, a tape open in each replica)."""
    strategy = dtape.distribute.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        v = dtape.Variable(torch.ones(3))
    x = dtape.constant(torch.ones(3))

    def step():
        with dtape.GradientTape():
            v * x
            v * x
            return count_calls(lambda: v * x)
    return _ints_per_replica(strategy, step)


def records_per_replica_tape(n):
    """Records on each replica's own tape for one small step, all replicas inside their tapes at once."""
    strategy = dtape.distribute.MirroredStrategy(devices=[f"cpu:{i}" for i in range(n)])
    with strategy.scope():
        w, b = dtape.Variable(torch.ones(4, 3)), dtape.Variable(torch.zeros(3))
    x = dtape.constant(torch.ones(2, 4))
    barrier = threading.Barrier(n, timeout=30)

    def step():
        with dtape.GradientTape() as tape:
            barrier.wait()
            h = dtape.nn.relu(dtape.matmul(x, w) + b)
            loss = dtape.reduce_mean(h * h)
            barrier.wait()
        records = tape._tape.num_records()
        tape.gradient(loss, [w, b])
        return records
    return _ints_per_replica(strategy, step)


def _ints_per_replica(strategy, step):
    """Runs `step` (returning an int) on every replica; the ints in replica order."""
    out = strategy.run(lambda: dtape.constant(step()))  # a tensor: a distinct object per replica
    return [int(t) for t in strategy.experimental_local_results(out)]


def records_with_unrelated_threads(n_threads=32, iters=200):
    """Records on one tape (16 ops of its own) while n_threads - 1 other threads read the same variables."""
    vs = [dtape.Variable(torch.ones(4)) for _ in range(4)]
    start, done = threading.Event(), threading.Barrier(n_threads, timeout=60)

    def other():
        start.wait(30)
        for _ in range(iters):
            for v in vs:
                v * 2.0 + 1.0
        done.wait()
    threads = [threading.Thread(target=other, daemon=True) for _ in range(n_threads - 1)]
    for t in threads:
        t.start()
    with dtape.GradientTape() as tape:
        start.set()
        y = vs[0] * vs[1]
        for _ in range(4):
            y = dtape.tanh(y) + vs[2]
        dtape.reduce_sum(y)
        done.wait()
    for t in threads:
        t.join(30)
    return tape._tape.num_records()


def counts():
    out = {"calls_variable_op": calls_variable_op(), "calls_mirrored_op": calls_mirrored_op()}
    for n in (1, 2, 4):
        out[f"records_per_replica_tape_{n}"] = records_per_replica_tape(n)
    out["records_32_threads"] = records_with_unrelated_threads()
    for k, v in out.items():
        print(f"{k:32s} {v}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--counts", action="store_true", help="only the record and call counts")
    ap.add_argument("--no-multiworker", action="store_true", help="skip case (i), the torchrun launches")
    ap.add_argument("--gpt-only", action="store_true",
                    help="only the GPT cases: (j), and (i)'s GPT step (2 workers vs DDP: each side alone in pairs of "
                         "launches, then interleaved in one launch with MirroredStrategy vs DDP)")
    ap.add_argument("--jit-only", action="store_true",
                    help="only case (l): compiled dtape steps (charlm, MLP, 1,000-op chain) vs eager dtape, torch "
                         "autograd and torch.compile, with first-call (trace + compile) times")
    ap.add_argument("--jit-strategies", action="store_true",
                    help="only (l)'s compiled charlm replica step in 2 torchrun workers and 2 MirroredStrategy "
                         "replicas vs DDP over torch.compile (also run by --jit-only unless --no-multiworker)")
    ap.add_argument("--rss-child", metavar="VARIANT", help=argparse.SUPPRESS)
    ap.add_argument("--gpt-heap-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--gpt-alone-child", choices=ALONE_SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--core", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.gpt_alone_child:
        return gpt_alone_child(args.gpt_alone_child, args.core)
    if args.gpt_heap_child:
        return print(json.dumps(gpt_rows(timer(torch.device("cpu")), args.quick)))
    if args.rss_child:
        torch.set_num_threads(os.cpu_count())
        return rss_child(args.rss_child)
    if args.counts:
        result = counts()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return
    device = torch.device(args.device)
    threads = os.cpu_count()
    torch.set_num_threads(threads)
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"dtape from {os.path.dirname(dtape.__file__)}; torch {torch.__version__}, Python {platform.python_version()}, device {device}, "
          f"torch.set_num_threads({threads}), load average at start {load}")
    run = timer(device)
    q = args.quick
    rows = []  # (name, dtape seconds, torch seconds, reps)
    cpu = device.type == "cpu"
    if args.gpt_only:
        return gpt_only(run, args, load)
    if args.jit_only:
        return jit_only(run, args, load)
    if args.jit_strategies:
        return jit_strategies_only(args, load)

    chains = ((1_000, 7 if q else 31, 2 if q else 5), (10_000, 3 if q else 11, 1 if q else 2),
              (100_000, 1 if q else 5, 1))
    for n, reps, warm in chains if cpu else ():
        fd, ft, note = chain_case(n, device)
        print(f"chain N={n:,}: {note}")
        d, t = interleave(run, fd, ft, reps, warm)
        rows.append((f"(a) chain N={n:,} (per op: {d / n * 1e6:.1f} / {t / n * 1e6:.1f} us)", d, t, reps))

    fd, ft, check = mlp_case(device)
    reps = 7 if q else 41
    rows.append(("(b) MLP step manual", *interleave(run, fd, ft, reps, 3 if q else 5), reps))
    print(f"MLP weights after all steps: max |dtape - torch| {check():.1e}")
    fd, ft = mlp_layers_case(device)
    rows.append(("(b) MLP step layers", *interleave(run, fd, ft, reps, 3 if q else 5), reps))

    fd, ft = charlm_case(device)
    reps = 7 if q else 31
    rows.append(("(h) charlm step (Adam) vs torch.nn.Module", *interleave(run, fd, ft, reps, 3 if q else 5), reps))
    if cpu:
        rows += gpt_alone_rows(q) + gpt_rows(run, q) + gpt_fixed_heap_rows(q)

    extra = {}
    if cpu:
        fd, ft = cnn_case(device)
        rows.append(("(c) CNN step 2 conv + dense, b=32", *interleave(run, fd, ft, reps, 3 if q else 5), reps))
        reps = 7 if q else 21
        two, one = interleave(run, replica_case(2), replica_case(1), reps, 3)
        t2, t1 = interleave(run, torch_threads_case(2), torch_threads_case(1), reps, 3)
        extra["replicas_2_over_1"] = two / one
        extra["torch_threads_2_over_1"] = t2 / t1
        print(f"(e) 2 replicas / 1 replica, global batch 256: {two * 1e3:.1f} / {one * 1e3:.1f} ms = {two / one:.2f}"
              f"   (plain torch in 2 threads / 1: {t2 / t1:.2f})")
    d_bytes, d_records, t_bytes = memory_case(device)
    extra.update(tape_bytes=d_bytes, tape_records=d_records, torch_saved_bytes=t_bytes)
    print(f"(f) MLP step memory: tape holds {d_bytes / 2**20:.2f} MiB in {d_records} records; torch autograd "
          f"saves {t_bytes / 2**20:.2f} MiB (saved_tensors_hooks): {d_bytes / t_bytes:.2f}x")
    if cpu:
        for style in ("manual", "layers"):
            gd, gt = rss_growth(f"dtape-{style}"), rss_growth(f"torch-{style}")
            extra[f"rss_growth_{style}"] = (gd, gt)
            if max(gd, gt) < 2**20:
                verdict = "both under 1 MiB: no growth to compare"
            else:
                verdict = f"{gd / gt:.2f}x" if gt > 0 else "torch did not grow"
            print(f"(g) RSS growth over 200 MLP steps ({style}), after malloc_trim: dtape {gd / 2**10:.0f} KiB, "
                  f"torch {gt / 2**10:.0f} KiB ({verdict})")
    count_results = counts() if cpu else {}

    print(f"\n{'case':58s} {'dtape (ms)':>11s} {'torch (ms)':>11s} {'ratio':>7s} {'reps':>5s}")
    for name, d, t, r in rows:
        print(f"{name:58s} {d * 1e3:11.3f} {t * 1e3:11.3f} {d / t:7.2f} {r:5d}")
    if cpu and not args.no_multiworker:  # after the table: its launches take a while
        print()
        extra["multiworker"] = multiworker_case(q)
        print()
        extra["collective_check"] = collective_check_case(q)
    load_end = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"load average at end {load_end}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "threads": threads, "torch": torch.__version__,
                       "load_start": load, "load_end": load_end,
                       "results": [dict(case=n, dtape_s=d, torch_s=t, ratio=d / t, reps=r)
                                   for n, d, t, r in rows], "extra": extra, "counts": count_results}, f, indent=2)


def gpt_only(run, args, load):
    """`--gpt-only`: case (j) and the GPT step of (i) (each side alone in pairs of launches, then interleaved in
    one launch, and again with glibc's heap kept), with the machine's load before and after."""
    rows = gpt_alone_rows(args.quick) + gpt_rows(run, args.quick) + gpt_fixed_heap_rows(args.quick)
    for name, d, t, r in rows:
        print(f"{name}: dtape {d * 1e3:.2f} ms, torch {t * 1e3:.2f} ms, {d / t:.3f}x ({r} reps, medians)")
    multi = kept = alone = None
    if not args.no_multiworker:
        alone = multiworker_alone_case(args.quick)
        multi = multiworker_case(args.quick, launches=(("gpt", 2),))
        kept = multiworker_case(args.quick, launches=(("gpt", 2),), env=FIXED_HEAP_ENV, label=" [glibc heap kept]")
    load_end = os.getloadavg()
    print(f"load average at start {load}, at end {load_end}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_start": load, "load_end": load_end, "multiworker_alone": alone, "multiworker": multi,
                       "multiworker_heap_kept": kept,
                       "results": [dict(case=n, dtape_s=d, torch_s=t, ratio=d / t, reps=r) for n, d, t, r in rows]},
                      f, indent=2)


if __name__ == "__main__":
    main()
