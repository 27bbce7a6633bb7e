"""Torch functions without a dtape rule and wrapped modules are differentiated through the autograd graph
torch built in the forward (no second forward; memory is torch's), records keep their autocast state, and
TorchModule is a view of its module. Everything is compared with plain torch autograd."""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import dtape
from dtape import distribute as ds

f64 = torch.float64

# Matmul-class aten kernels (forward and backward): what a second forward would repeat.
MATMUL_CLASS = frozenset([
    "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "linear_backward", "convolution", "convolution_backward",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_attention_math"])


class CountOps(TorchDispatchMode):
    """Counts aten ops by name (those in `names`) while active on this thread."""

    def __init__(self, names):
        super().__init__()
        self.names, self.counts = names, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.names:
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self):
        return sum(self.counts.values())


class MLP(nn.Module):
    def __init__(self, d_in=8, width=16, d_out=4):
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(d_in, width), nn.Linear(width, width), nn.Linear(width, d_out)

    def forward(self, x):
        return self.out(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention (scaled_dot_product_attention), GELU MLP."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyGPT(nn.Module):
    """GPT-shaped: token + position embeddings, blocks, final norm, head tied to the token embedding."""

    def __init__(self, vocab=50, width=64, context=64, heads=2, layers=2):
        super().__init__()
        self.vocab = vocab
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.tok.weight = self.head.weight

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, self.vocab), targets.view(-1))


def _seeded(make, seed=0):
    torch.manual_seed(seed)
    return make()


def _mlp_case():
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    return MLP, (x,), lambda out: (out * out).sum()


def _gpt_case(width=64, context=64):
    idx = torch.randint(0, 50, (4, context), generator=torch.Generator().manual_seed(1))
    return (lambda: TinyGPT(width=width, context=context)), (idx, torch.roll(idx, -1, 1)), lambda out: out


# -- 1. one forward: matmul-class kernels of a training step ----------------------------------------

@pytest.mark.parametrize("case", [_mlp_case, _gpt_case], ids=["mlp", "gpt"])
def test_torch_module_step_runs_the_matmul_kernels_of_torch_autograd(case):
    make, inputs, loss_fn = case()
    module = _seeded(make)
    with CountOps(MATMUL_CLASS) as torch_ops:
        torch.autograd.grad(loss_fn(module(*inputs)), list(module.parameters()))
    tm = dtape.layers.TorchModule(_seeded(make))
    with CountOps(MATMUL_CLASS) as dtape_ops:
        with dtape.GradientTape() as tape:
            loss = loss_fn(tm(*inputs))
        grads = tape.gradient(loss, tm.trainable_variables)
    assert all(g is not None for g in grads)
    assert torch_ops.total > 0
    assert dtape_ops.total <= 1.05 * torch_ops.total, (dtape_ops.counts, torch_ops.counts)


def test_a_fallback_runs_its_forward_once_and_its_gradient_is_torchs():
    x = torch.rand(5, dtype=f64) + 0.5
    with CountOps({"lgamma", "digamma"}) as ops:
        xd = dtape.constant(x)
        with dtape.GradientTape() as tape:
            tape.watch(xd)
            y = dtape.reduce_sum(torch.lgamma(xd) * xd)
        g = tape.gradient(y, xd)
    assert ops.counts == {"lgamma": 1, "digamma": 1}      # the re-run path ran lgamma twice
    xt = x.clone().requires_grad_()
    expected, = torch.autograd.grad((torch.lgamma(xt) * xt).sum(), xt)
    torch.testing.assert_close(g.torch(), expected, rtol=1e-13, atol=0)


def test_fallback_saves_what_torch_saves():
    """Bytes saved for the backward: the tensors torch's graph packs (saved_tensors_hooks) plus what the
    tape keeps; for a chain of fallback functions both equal plain torch's."""
    x = torch.rand(1000, dtype=f64) + 0.5

    def chain(z):
        return torch.special.i0(torch.lgamma(torch.cumsum(z, 0)))

    def saved_bytes(fn):
        seen = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn()
        return sum(seen.values()), out
    xt = x.clone().requires_grad_()
    torch_bytes, _ = saved_bytes(lambda: chain(xt))
    xd = dtape.constant(x)
    with dtape.GradientTape() as tape:
        tape.watch(xd)
        dtape_bytes, out = saved_bytes(lambda: chain(xd))
        total = dtape.reduce_sum(out)
    assert torch_bytes > 0 and dtape_bytes == torch_bytes
    assert tape.nbytes() == 0                              # nothing saved twice
    assert not out.torch().requires_grad                   # the user's tensor carries no graph
    expected, = torch.autograd.grad(chain(xt).sum(), xt)
    torch.testing.assert_close(tape.gradient(total, xd).torch(), expected, rtol=1e-12, atol=0)


def test_kept_graph_serves_every_walk_that_may_read_it():
    x = torch.rand(4, dtype=f64) + 0.5
    xt = x.clone().requires_grad_()
    expected, = torch.autograd.grad(torch.lgamma(xt).sum(), xt)
    xd = dtape.constant(x)
    with dtape.GradientTape(persistent=True) as tape:      # persistent: walked twice
        tape.watch(xd)
        y = dtape.reduce_sum(torch.lgamma(xd))
    for _ in range(2):
        torch.testing.assert_close(tape.gradient(y, xd).torch(), expected, rtol=1e-13, atol=0)
    with dtape.GradientTape() as tape:                     # a jacobian walks once per row
        tape.watch(xd)
        y = torch.lgamma(xd)
    torch.testing.assert_close(tape.jacobian(y, xd).torch(), torch.diag(expected), rtol=1e-13, atol=0)
    with dtape.GradientTape() as outer:                    # both tapes record it; the inner walks it first
        outer.watch(xd)
        with dtape.GradientTape() as inner:
            inner.watch(xd)
            y = dtape.reduce_sum(torch.lgamma(xd))
        with outer.stop_recording():
            g_inner = inner.gradient(y, xd)
    g_outer = outer.gradient(y, xd)
    torch.testing.assert_close(g_inner.torch(), expected, rtol=1e-13, atol=0)
    torch.testing.assert_close(g_outer.torch(), expected, rtol=1e-13, atol=0)


def test_higher_orders_through_a_fallback_reuse_the_forward_graph():
    x = torch.rand(3, dtype=f64) + 0.5
    xt = x.clone().requires_grad_()
    g1, = torch.autograd.grad(torch.lgamma(xt).sum(), xt, create_graph=True)
    g2, = torch.autograd.grad(g1.sum(), xt, create_graph=True)
    g3, = torch.autograd.grad(g2.sum(), xt)
    xd = dtape.constant(x)
    with CountOps({"lgamma"}) as ops:
        with dtape.GradientTape() as t3:
            t3.watch(xd)
            with dtape.GradientTape() as t2:
                t2.watch(xd)
                with dtape.GradientTape() as t1:
                    t1.watch(xd)
                    y = dtape.reduce_sum(torch.lgamma(xd))
                d1 = t1.gradient(y, xd)
                s1 = dtape.reduce_sum(d1)
            d2 = t2.gradient(s1, xd)
            s2 = dtape.reduce_sum(d2)
        d3 = t3.gradient(s2, xd)
    assert ops.counts == {"lgamma": 1}
    for got, want in ((d1, g1), (d2, g2), (d3, g3)):
        torch.testing.assert_close(got.torch(), want.detach(), rtol=1e-12, atol=0)


def test_torch_module_higher_order_gradient_penalty_matches_torch():
    module = _seeded(lambda: nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))).double()
    x = torch.randn(4, 3, dtype=f64, generator=torch.Generator().manual_seed(2))
    ref = copy.deepcopy(module)
    xt = x.clone().requires_grad_()
    dx, = torch.autograd.grad(ref(xt).sum(), xt, create_graph=True)
    expected = torch.autograd.grad((dx ** 2).sum(), list(ref.parameters()), allow_unused=True)
    tm = dtape.layers.TorchModule(module)
    xd = dtape.constant(x)
    with dtape.GradientTape() as outer:
        with dtape.GradientTape() as inner:
            inner.watch(xd)
            y = dtape.reduce_sum(tm(xd))
        penalty = dtape.reduce_sum(inner.gradient(y, xd) ** 2)
    got = outer.gradient(penalty, tm.trainable_variables)
    assert expected[-1] is None and got[-1] is None        # the last bias does not move the input gradient
    for g, e in zip(got[:-1], expected[:-1]):
        torch.testing.assert_close(g.torch(), e, rtol=1e-10, atol=1e-12)


# -- 3. autocast: torch autocast's gradients, inside or outside the block ----------------------------

def _autocast_grads(fn, w0, x, dtype, inside):
    w = dtape.Variable(w0)
    with dtape.GradientTape() as tape:
        with torch.autocast("cpu", dtype=dtype):
            y = fn(dtape.constant(x), w)
            loss = dtape.reduce_sum(dtape.sin(y) * 3.0)
            if inside:
                g = tape.gradient(loss, w)
    if not inside:
        g = tape.gradient(loss, w)
    return y, g


@pytest.mark.parametrize("inside", [True, False], ids=["inside", "outside"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("op", ["dtape.matmul", "torch.matmul", "F.linear"])
def test_autocast_gradients_equal_torch_inside_or_outside_the_block(op, dtype, inside):
    gen = torch.Generator().manual_seed(3)
    w0, x = torch.randn(6, 5, generator=gen), torch.randn(4, 6, generator=gen)
    fn = {"dtape.matmul": lambda a, b: dtape.matmul(a, b),
          "torch.matmul": lambda a, b: torch.matmul(a, b),            # dtape's rule through __torch_function__
          "F.linear": lambda a, b: F.linear(a, b.read_value().T)}[op]  # no dtape rule: the fallback
    y, g = _autocast_grads(fn, w0, x, dtype, inside)
    wt = w0.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        yt = x @ wt if op != "F.linear" else F.linear(x, wt.T)
        loss = (torch.sin(yt) * 3.0).sum()
    expected, = torch.autograd.grad(loss, wt)
    assert y.dtype == yt.dtype == dtype                    # autocast did narrow the forward
    assert g.dtype == torch.float32
    torch.testing.assert_close(g.torch(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("inside", [True, False], ids=["inside", "outside"])
def test_autocast_input_gradients_come_back_in_the_inputs_dtype_before_summing(inside):
    """A float32 activation feeding two autocast matmuls: torch casts it once per use, and each cast's
    backward returns a float32 gradient, summed in float32 (a bfloat16 sum would differ)."""
    gen = torch.Generator().manual_seed(7)
    v0, x, w1, w2 = torch.randn(6, generator=gen), torch.randn(4, 6, generator=gen), \
        torch.randn(6, 5, generator=gen), torch.randn(6, 5, generator=gen)
    v = dtape.Variable(v0)
    with dtape.GradientTape() as tape:
        a = dtape.sin(dtape.constant(x) * v)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = dtape.reduce_sum(dtape.matmul(a, dtape.constant(w1)) * dtape.matmul(a, dtape.constant(w2)))
            if inside:
                g = tape.gradient(loss, v)
    if not inside:
        g = tape.gradient(loss, v)
    vt = v0.clone().requires_grad_()
    at = torch.sin(x * vt)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, = torch.autograd.grad(((at @ w1) * (at @ w2)).sum(), vt)
    torch.testing.assert_close(g.torch(), expected, rtol=0, atol=0)


def test_torch_module_under_autocast_gradient_after_the_block_equals_torch():
    module = _seeded(MLP)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(4))
    ref = copy.deepcopy(module)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ref(x).float().pow(2).sum()
    expected = torch.autograd.grad(loss, list(ref.parameters()))
    tm = dtape.layers.TorchModule(module)
    with dtape.GradientTape() as tape:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = dtape.reduce_sum(dtape.cast(tm(x), "float32") ** 2)
    got = tape.gradient(loss, tm.trainable_variables)     # nanoGPT's pattern: backward after the block
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.torch(), e, rtol=0, atol=0)


# -- 4. TorchModule is a view of its module ----------------------------------------------------------

@pytest.mark.parametrize("case", [lambda: (MLP, (torch.randn(16, 8, generator=torch.Generator().manual_seed(5)),),
                                           lambda out: (out * out).mean()),
                                  lambda: _gpt_case(width=16, context=8)], ids=["mlp", "gpt"])
def test_training_the_wrapper_trains_the_module_like_plain_torch(case):
    make, inputs, loss_fn = case()
    ref = _seeded(make).double()
    module = _seeded(make).double()
    inputs = tuple(i.double() if i.is_floating_point() else i for i in inputs)
    torch_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    tm = dtape.layers.TorchModule(module)
    opt = dtape.optimizers.SGD(0.05)
    assert list(tm.parameters()) == list(module.parameters())
    assert [n for n, _ in tm.named_parameters()] == [n for n, _ in module.named_parameters()]
    torch_losses, dtape_losses = [], []
    for _ in range(20):
        torch_opt.zero_grad()
        loss = loss_fn(ref(*inputs))
        loss.backward()
        torch_opt.step()
        torch_losses.append(loss.item())
        with dtape.GradientTape() as tape:
            loss = loss_fn(tm(*inputs))
        opt.apply_gradients(zip(tape.gradient(loss, tm.trainable_variables), tm.trainable_variables))
        dtape_losses.append(float(loss))
    np.testing.assert_allclose(dtape_losses, torch_losses, rtol=1e-6)
    assert torch_losses[-1] < torch_losses[0]
    for (name, p), q in zip(module.named_parameters(), ref.parameters()):   # the module itself was trained
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-9, msg=name)
    for var, p in zip(tm.trainable_variables, module.parameters()):
        assert var.torch().data_ptr() == p.data_ptr()     # still one storage after the updates


def test_state_dicts_in_torch_format_both_ways():
    module = _seeded(lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    tm = dtape.layers.TorchModule(module)
    other = _seeded(lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), seed=9)
    result = tm.load_state_dict(other.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    for name, value in other.state_dict().items():
        assert torch.equal(tm.state_dict()[name], value), name
        assert torch.equal(module.state_dict()[name], value), name  # the module sees the load
    partial = {k: v for k, v in other.state_dict().items() if k != "1.running_var"}
    with pytest.raises(RuntimeError, match=r"missing keys \['1.running_var'\]"):
        tm.load_state_dict(dict(partial, extra=torch.zeros(1)))
    result = tm.load_state_dict(dict(partial, extra=torch.zeros(1)), strict=False)
    assert result.missing_keys == ["1.running_var"] and result.unexpected_keys == ["extra"]
    with pytest.raises(RuntimeError, match=r"size mismatch \(0.weight: got \(2, 3\)"):
        tm.load_state_dict(dict(other.state_dict(), **{"0.weight": torch.zeros(2, 3)}))


def test_a_module_on_another_device_or_dtype_moves_onto_the_variables():
    module = _seeded(lambda: nn.Linear(3, 2))
    with ds.OneDeviceStrategy("cpu").scope():
        with dtape.variable_creator_scope(lambda next_creator, **kw: next_creator(**dict(kw, dtype=f64))):
            tm = dtape.layers.TorchModule(module)
    assert module.weight.dtype == f64 and module.weight.data_ptr() == tm.trainable_variables[0].torch().data_ptr()
    tm.trainable_variables[0].assign(torch.ones(2, 3, dtype=f64))
    assert torch.equal(module.weight.detach(), torch.ones(2, 3, dtype=f64))


@pytest.mark.parametrize("where", ["submodule", "whole"])
def test_a_compiled_module_trains_with_one_compilation(where):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    module = _seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)))
    ref = copy.deepcopy(module)
    if where == "submodule":
        module[0] = torch.compile(module[0])
    else:
        module = torch.compile(module)
    tm = dtape.layers.TorchModule(module)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(8))
    for step in range(4):                                   # both modes, twice: the compiled code is reused
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(tm(x, training=bool(step % 2)) ** 2)
        grads = tape.gradient(loss, tm.trainable_variables)
    expected = torch.autograd.grad((ref(x) ** 2).sum(), list(ref.parameters()))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g.torch(), e, rtol=1e-5, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["recompiles"]


@pytest.mark.parametrize("sync", ["mean", "broadcast"])
def test_batchnorm_buffers_mean_or_replica_zeros_under_mirrored(sync):
    module = _seeded(lambda: nn.BatchNorm1d(3, momentum=0.5)).double()
    halves = [copy.deepcopy(module).train() for _ in range(2)]
    x = torch.randn(8, 3, dtype=f64, generator=torch.Generator().manual_seed(6))
    with ds.MirroredStrategy(["cpu:0", "cpu:1"], timeout=30) as strategy:
        with strategy.scope():
            tm = dtape.layers.TorchModule(module, sync_buffers=sync)
        for batch in strategy.experimental_distribute_dataset([x]):
            strategy.run(lambda b: tm(b, training=True), args=(batch,))
    for half, part in zip(halves, (x[:4], x[4:])):
        half(part)
    for name in ("running_mean", "running_var"):
        first, second = (getattr(h, name) for h in halves)
        expected = (first + second) / 2 if sync == "mean" else first
        for component in tm._buffers[name].values:
            torch.testing.assert_close(component.torch(), expected, rtol=1e-12, atol=0)
        torch.testing.assert_close(getattr(module, name), expected, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="sync_buffers='first'.*'broadcast'"):
        dtape.layers.TorchModule(nn.BatchNorm1d(2), sync_buffers="first")


def test_dropout_inside_a_wrapped_module_draws_from_the_threads_dtape_generator():
    """A replica's dropout masks come from its own generator (replicas draw reproducibly whatever the
    thread schedule), not from torch's global one, which the call leaves as it was."""
    tm = dtape.layers.TorchModule(_seeded(lambda: nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5))))
    x = torch.randn(4, 8)

    def masks(torch_seed):
        torch.manual_seed(torch_seed)
        with dtape.random.generator_scope(torch.Generator().manual_seed(11)):
            out = tm(x, training=True)
        return out.torch() == 0, torch.get_rng_state()
    (m1, state1), (m2, _) = masks(0), masks(99)
    assert 0.2 < m1.float().mean() < 0.8
    assert torch.equal(m1, m2)
    torch.manual_seed(0)
    assert torch.equal(state1, torch.get_rng_state())


def _rng_state(device):
    return torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state(device)


def _one_replica_masks(seed, device):
    """A wrapped Linear + Dropout called twice on a one-device MirroredStrategy's replica (the only replica of
    the process, as a MultiWorkerMirroredStrategy worker's): (its outputs, the replica generator's state before
    and after, torch's generator state of the device before and after)."""
    module = _seeded(lambda: nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5))).to(device)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2)).to(device)
    with ds.MirroredStrategy([f"{device}:0"], seed=seed, timeout=30) as strategy:
        with strategy.scope():
            tm = dtape.layers.TorchModule(module)
        generator = strategy.replica_generator(0)
        before, torch_before = generator.get_state(), _rng_state(device)
        outs = [strategy.run(lambda: tm(x, training=True)).torch() for _ in range(2)]
        return module, x, outs, (before, generator.get_state()), (torch_before, _rng_state(device))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_dropout_in_the_only_replica_of_a_process_draws_the_replica_generators_stream(device):
    """The replica generator's own stream, drawn through torch's default generator of its device: the masks
    are plain torch's from the replica generator's state, the replica generator advances by those draws (the
    next call draws new masks), torch's own generator is left as it was; the same seed gives the same masks."""
    module, x, outs, (before, after), (torch_before, torch_after) = _one_replica_masks(5, device)
    with torch.random.fork_rng(devices=[0] if device == "cuda" else []):
        if device == "cpu":
            torch.set_rng_state(before)
        else:
            torch.cuda.set_rng_state(before, device)
        expected = [module(x).detach() for _ in range(2)]
        advanced = _rng_state(device)
    for got, want in zip(outs, expected):
        assert torch.equal(got, want)
    assert 0.2 < (outs[0] == 0).float().mean() < 0.8 and not torch.equal(outs[0] == 0, outs[1] == 0)
    assert torch.equal(after, advanced) and not torch.equal(after, before)
    assert torch.equal(torch_after, torch_before)
    again = _one_replica_masks(5, device)[2]
    assert all(torch.equal(a, b) for a, b in zip(again, outs))
    assert not torch.equal(_one_replica_masks(6, device)[2][0], outs[0])


def test_a_fallback_in_a_dtape_function_serves_the_walks_of_every_tape_after_splicing():
    """A recorded walk splices the function body's records onto the outer tape: the fallback's graph,
    first walked (and freed) by that non-persistent tape, is also walked through the function's op."""
    x0 = torch.rand(3, dtype=f64) + 0.5
    f = dtape.function(lambda z: torch.lgamma(z) * z)
    x = dtape.constant(x0)
    with dtape.GradientTape() as t2:
        t2.watch(x)
        with dtape.GradientTape() as t1:
            t1.watch(x)
            y = dtape.reduce_sum(f(x))
        d1 = t1.gradient(y, x)
        s = dtape.reduce_sum(d1 * y)
    d2 = t2.gradient(s, x)
    xt = x0.clone().requires_grad_()
    yt = (torch.lgamma(xt) * xt).sum()
    g1, = torch.autograd.grad(yt, xt, create_graph=True)
    g2, = torch.autograd.grad((g1 * yt).sum(), xt)
    torch.testing.assert_close(d2.torch(), g2, rtol=1e-12, atol=0)


def test_fallback_arguments_flat_nested_and_keyword_give_torch_s_values_and_gradients():
    """The fallback passes positional leaf arguments (tensors, numbers, None, dtypes) through as they are
    and flattens the rest (lists, keywords) with pytree: each form gives torch's value and gradient."""
    x0 = torch.randn(3, 4, dtype=torch.float64)
    w0 = torch.randn(3, 4, dtype=torch.float64)
    cases = [lambda x, w: torch.lerp(x, x * w, 0.25),                      # positional: tensors, a number
             lambda x, w: torch.lerp(x, w, 0.25),                          # a variable (read first)
             lambda x, w: F.softplus(x * w, 2.0, 0.5),                    # positional numbers
             lambda x, w: torch.cumprod(x, 1, dtype=None),                # a keyword
             lambda x, w: F.pad(x * w, [1, 2], "constant", 0.5),          # a list argument (pytree path)
             lambda x, w: torch.addcmul(x, x, w, value=0.5),              # tensors and a keyword
             lambda x, w: torch.logcumsumexp(torch.hypot(x, w), 0)]       # chained
    for fn in cases:
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        expected = fn(x, w)
        seed = torch.randn_like(expected)
        grads = torch.autograd.grad(expected, [x, w], seed, allow_unused=True)
        dx, dw = dtape.constant(x0), dtape.Variable(w0)
        with dtape.GradientTape() as tape:
            tape.watch(dx)
            out = fn(dx, dw)
            loss = dtape.reduce_sum(out * dtape.constant(seed))
        got = tape.gradient(loss, [dx, dw])
        np.testing.assert_allclose(out.numpy(), expected.detach().numpy(), rtol=1e-12, atol=1e-12)
        for g, e in zip(got, grads):
            if e is None:
                assert g is None
            else:
                np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-12, atol=1e-12)
