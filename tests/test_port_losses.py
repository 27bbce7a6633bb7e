"""Porting public PyTorch training loops to dtape with the loss computed outside the module, as a user would.

Two idioms are followed (our own code, written in their style):

* pytorch/examples' MNIST loop: a small conv net (conv, conv, max-pool, dropout, two linears) trained
  with `F.nll_loss`, `torch.optim.Adadelta(lr=1.0)` and `StepLR(step_size=1, gamma=0.7)` stepped per
  epoch; here on scikit-learn's bundled 8x8 digits, the module returning logits (loss
  `F.nll_loss(F.log_softmax(out, dim=1), y)`) or log-probabilities (loss `F.nll_loss(out, y)`).
* nanoGPT's loss: `F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)`
  on a tiny GPT-shaped module, with AdamW over decay / no-decay parameter groups.

dtape runs the loss after the module's call as its own ops over torch's kernels, so per-step losses and
final parameters must be torch's bit for bit; the forms that still go through the autograd fallback
(label smoothing, class weights, [N, C, T] inputs, autocast) must equal torch too. The last tests are what
a user porting such code may try by mistake: each must fail (or work) exactly as in torch.
"""
import contextlib
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import dtape
import dtape.distribute
import dtape.layers
import dtape.optimizers
from dtape.ops import _dispatch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread (restored after): on a loaded 2-core machine torch's thread pool makes these
    small models' runs 10-40x slower, and nothing here is about threads."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


class DigitsNet(nn.Module):
    """pytorch/examples' MNIST Net shrunk for 8x8 digits: [N, 1, 8, 8] -> [N, 10] logits or log-probs."""

    def __init__(self, log_probs):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(32, 16)
        self.fc2 = nn.Linear(16, 10)
        self.log_probs = log_probs

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = self.dropout2(F.relu(self.fc1(torch.flatten(self.dropout1(x), 1))))
        x = self.fc2(x)
        return F.log_softmax(x, dim=1) if self.log_probs else x


STEPS, STEPS_PER_EPOCH = 20, 4


@functools.lru_cache(maxsize=None)
def _digits():
    """The first 320 digits as float32 [320, 1, 8, 8] in [0, 1] and int64 labels."""
    digits = load_digits()
    return (torch.tensor(digits.images[:320, None] / 16.0, dtype=torch.float32),
            torch.tensor(digits.target[:320], dtype=torch.long))


def _digit_batches():
    images, labels = _digits()
    return [(images[16 * i:16 * i + 16], labels[16 * i:16 * i + 16]) for i in range(STEPS)]


def _digits_loss(out, y, log_probs):
    return F.nll_loss(out, y) if log_probs else F.nll_loss(F.log_softmax(out, dim=1), y)


def _adadelta_with_steplr(params):
    opt = torch.optim.Adadelta(params, lr=1.0)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)


@functools.lru_cache(maxsize=None)
def _torch_digits_run(log_probs):
    """Plain torch: (per-step losses [STEPS], final state_dict)."""
    torch.manual_seed(1)
    net = DigitsNet(log_probs)
    opt, sched = _adadelta_with_steplr(net.parameters())
    torch.manual_seed(2)   # the dropout masks
    losses = []
    for i, (x, y) in enumerate(_digit_batches()):
        opt.zero_grad()
        loss = _digits_loss(net(x), y, log_probs)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        if i % STEPS_PER_EPOCH == STEPS_PER_EPOCH - 1:
            sched.step()
    return torch.stack(losses), net.state_dict()


def _dtape_digits_run(log_probs):
    torch.manual_seed(1)
    net = DigitsNet(log_probs)
    model = dtape.layers.TorchModule(net)
    torch_opt, sched = _adadelta_with_steplr(model.parameters())
    opt = dtape.optimizers.from_torch(torch_opt)
    torch.manual_seed(2)   # outside any strategy the forward draws torch's own generator
    losses = []
    for i, (x, y) in enumerate(_digit_batches()):
        with dtape.GradientTape() as tape:
            loss = _digits_loss(model(x, training=True), y, log_probs)
        assert isinstance(loss, dtape.Tensor)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        losses.append(loss.torch())
        if i % STEPS_PER_EPOCH == STEPS_PER_EPOCH - 1:
            sched.step()
    assert torch_opt.param_groups[0]["lr"] == pytest.approx(0.7 ** (STEPS // STEPS_PER_EPOCH))
    return torch.stack(losses), net.state_dict()


def _assert_same_run(got, expected):
    """Per-step losses and every final parameter and buffer, bit for bit."""
    (losses, state), (expected_losses, expected_state) = got, expected
    assert torch.equal(losses, expected_losses), (losses - expected_losses).abs().max()
    assert state.keys() == expected_state.keys()
    for name in state:
        assert torch.equal(state[name], expected_state[name]), name


def _count_engine_calls(monkeypatch):
    """The ops whose gradient the tape's walk asks torch's autograd engine for."""
    calls = []
    real = _dispatch.graph_vjp
    monkeypatch.setattr(_dispatch, "graph_vjp", lambda *a: calls.append(a[0].name) or real(*a))
    return calls


@pytest.mark.parametrize("log_probs", [False, True], ids=["logits, log_softmax outside", "log-probs out"])
def test_mnist_style_loop_is_torchs_bit_for_bit(log_probs, monkeypatch):
    calls = _count_engine_calls(monkeypatch)
    got = _dtape_digits_run(log_probs)
    _assert_same_run(got, _torch_digits_run(log_probs))
    assert len(calls) == STEPS and len(set(calls)) == 1   # only the module's own graph, once a step


def test_both_mnist_loss_idioms_train_alike():
    # log_softmax inside the module (torch's graph) or outside (dtape's op): one and the same run
    _assert_same_run(_dtape_digits_run(False), _torch_digits_run(True))


V, T, E, HEADS = 13, 8, 16, 2


class TinyBlock(nn.Module):
    """A pre-norm transformer block in nanoGPT's layout (fused qkv, causal SDPA, 4x MLP)."""

    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(E), nn.LayerNorm(E)
        self.c_attn, self.c_proj = nn.Linear(E, 3 * E), nn.Linear(E, E)
        self.c_fc, self.mlp_proj = nn.Linear(E, 4 * E), nn.Linear(4 * E, E)

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(self.ln_1(x)).split(E, dim=2)
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """[B, T] int64 token ids -> [B, T, V] logits; tied input/output embeddings as nanoGPT."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, E), nn.Embedding(T, E)
        self.h = nn.ModuleList([TinyBlock(), TinyBlock()])
        self.ln_f = nn.LayerNorm(E)
        self.lm_head = nn.Linear(E, V, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1)))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def nanogpt_loss(logits, targets):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def _adamw(params):
    """nanoGPT's configure_optimizers groups: weight decay on tensors of 2+ dims only."""
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.99))


def _token_batches(steps, batch=4):
    """Next token = token + 1 (learnable); the last two targets of every row are -1 (ignored)."""
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        x = torch.randint(0, V, (batch, T), generator=gen)
        y = (x + 1) % V
        y[:, -2:] = -1
        batches.append((x, y))
    return batches


def _torch_gpt_run(loss_fn, steps, dtype=torch.float32, ctx=None):
    torch.manual_seed(0)
    net = TinyGPT().to(dtype)
    opt = _adamw(net.parameters())
    losses = []
    for x, y in _token_batches(steps):
        opt.zero_grad()
        with ctx() if ctx else contextlib.nullcontext():
            loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), net.state_dict()


def _dtape_gpt_run(loss_fn, steps, dtype=torch.float32, ctx=None, wrap_targets=True):
    torch.manual_seed(0)
    net = TinyGPT().to(dtype)
    model = dtape.layers.TorchModule(net)
    opt = dtape.optimizers.from_torch(_adamw(model.parameters()))
    losses = []
    for x, y in _token_batches(steps):
        with ctx() if ctx else contextlib.nullcontext():   # nanoGPT's `with ctx:` around forward and loss only
            with dtape.GradientTape() as tape:
                loss = loss_fn(model(x, training=True), dtape.constant(y) if wrap_targets else y)
        grads = tape.gradient(loss, model.trainable_variables)   # outside the autocast block
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(loss.torch())
    return torch.stack(losses), net.state_dict()


@pytest.mark.parametrize("wrap_targets", [True, False], ids=["dtape targets", "torch targets"])
def test_nanogpt_style_loss_is_torchs_bit_for_bit(wrap_targets, monkeypatch):
    calls = _count_engine_calls(monkeypatch)
    got = _dtape_gpt_run(nanogpt_loss, 20, wrap_targets=wrap_targets)
    expected = _torch_gpt_run(nanogpt_loss, 20)
    _assert_same_run(got, expected)
    assert calls == ["TinyGPT"] * 20
    assert got[0][-1] < got[0][0] - 0.1   # it learns the +1 rule


def _smoothed(logits, y):
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1, label_smoothing=0.1)


def _weighted(logits, y):
    weight = torch.linspace(0.5, 1.5, V, dtype=logits.dtype)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), weight=weight, ignore_index=-1)


def _channels_second(logits, y):
    return F.cross_entropy(logits.transpose(1, 2), y, ignore_index=-1)   # [N, C, T] with [N, T]


@pytest.mark.parametrize("loss_fn", [_smoothed, _weighted, _channels_second],
                         ids=["label_smoothing", "class weight", "[N, C, T]"])
def test_fallback_forms_train_as_torch(loss_fn, monkeypatch):
    # float64: these run through the autograd fallback; close to torch is the claim (they come out equal)
    calls = _count_engine_calls(monkeypatch)
    losses, state = _dtape_gpt_run(loss_fn, 6, dtype=torch.float64)
    assert calls.count("cross_entropy") == 6   # the loss's gradient came from torch's engine
    expected_losses, expected_state = _torch_gpt_run(loss_fn, 6, dtype=torch.float64)
    torch.testing.assert_close(losses, expected_losses, rtol=1e-12, atol=1e-12)
    for name in state:
        torch.testing.assert_close(state[name], expected_state[name], rtol=1e-10, atol=1e-12)


def _bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_autocast_bf16_forward_and_loss_gradient_outside_as_nanogpt(monkeypatch):
    calls = _count_engine_calls(monkeypatch)
    ctx = _bf16_autocast
    losses, state = _dtape_gpt_run(nanogpt_loss, 6, ctx=ctx)
    assert calls.count("cross_entropy") == 6   # under autocast the loss takes the fallback
    expected_losses, expected_state = _torch_gpt_run(nanogpt_loss, 6, ctx=ctx)
    assert losses.dtype == torch.float32   # autocast runs cross_entropy in float32
    torch.testing.assert_close(losses, expected_losses, rtol=0, atol=0)
    for name in state:
        assert state[name].dtype == torch.float32
        torch.testing.assert_close(state[name], expected_state[name], rtol=0, atol=0)


def _raised(fn):
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value)


def test_view_of_non_contiguous_logits_raises_torchs_error():
    logits = torch.randn(2, 3, 5)
    message = "view size is not compatible with input tensor's size and stride"
    expected = _raised(lambda: logits.transpose(1, 2).view(-1, 3))
    assert message in expected[1]
    assert _raised(lambda: dtape.constant(logits).transpose(1, 2).view(-1, 3)) == expected
    v = dtape.Variable(logits.clone())
    with dtape.GradientTape():
        assert _raised(lambda: v.transpose(1, 2).view(-1, 3)) == expected
        assert v.transpose(1, 2).reshape(-1, 3).shape == (10, 3)   # what torch's message suggests


@pytest.mark.parametrize("fn", [F.cross_entropy, F.nll_loss], ids=["cross_entropy", "nll_loss"])
@pytest.mark.parametrize("target,kwargs", [
    (torch.tensor([0, 1, 2, 3], dtype=torch.int32), {}),
    (torch.tensor([0, 1, 2, 4]), {}),
    (torch.tensor([0, -1, 2, 3]), {}),                        # -1 without ignore_index=-1
    (torch.tensor([0, 1, 2, 3]), {"reduction": "avg"}),
    (torch.tensor([0, 1, 2, 3]).double(), {}),
], ids=["int32", "out of range", "-1 not ignored", "reduction avg", "float indices"])
def test_mistakes_raise_torchs_error(fn, target, kwargs):
    logits = torch.randn(4, 4)
    expected = _raised(lambda: fn(logits, target, **kwargs))
    assert _raised(lambda: fn(dtape.constant(logits), dtape.constant(target), **kwargs)) == expected
    assert _raised(lambda: fn(dtape.constant(logits), target, **kwargs)) == expected


def test_uint8_targets_work_as_in_torch():
    logits, target = torch.randn(4, 4, dtype=torch.float64), torch.tensor([0, 3, 2, 3], dtype=torch.uint8)
    xv = dtape.Variable(logits.clone())
    with dtape.GradientTape() as tape:
        loss = F.cross_entropy(xv * 1.0, target)
    xt = logits.clone().requires_grad_()
    expected = F.cross_entropy(xt, target)
    assert torch.equal(loss.torch(), expected.detach())
    assert torch.equal(tape.gradient(loss, xv).torch(), torch.autograd.grad(expected, xt)[0])


def test_view_as_another_dtype_reads_the_bits_and_has_no_gradient():
    x = torch.randn(2, 4)
    assert torch.equal(dtape.constant(x).view(torch.float16).torch(), x.view(torch.float16))
    v = dtape.Variable(x.clone())
    with dtape.GradientTape() as tape:
        halves = v.view(torch.float16)
        total = dtape.reduce_sum(dtape.cast(halves, torch.float32))
    assert halves.dtype == torch.float16 and halves.shape == (2, 8)
    assert tape.gradient(total, v) is None   # torch: x.view(float16).requires_grad is False
    assert not x.requires_grad_().view(torch.float16).requires_grad


def test_view_sizes_from_0d_dtape_tensors_and_on_a_variable():
    x0 = torch.randn(4, 6, dtype=torch.float64)
    v = dtape.Variable(x0.clone())
    weights = torch.arange(24, dtype=torch.float64)
    with dtape.GradientTape() as tape:
        rows = dtape.shape(v)[0]                      # a 0-d int tensor, as in TF
        flat = v.view(rows * 6)                       # .view on the Variable itself
        pairs = v.view(dtape.constant(12), -1)
        loss = dtape.reduce_sum(flat * weights) + dtape.reduce_sum(pairs ** 2)
    assert pairs.shape == (12, 2) and torch.equal(pairs.torch(), x0.view(12, 2))
    grad = tape.gradient(loss, v).torch()
    assert torch.equal(grad, weights.view(4, 6) + 2 * x0)
    assert _raised(lambda: v.view(dtape.constant(7), -1)) == _raised(lambda: x0.view(7, -1))


GLOBAL_BATCH = 16


def _classifier_batches():
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(GLOBAL_BATCH, 8, dtype=torch.float64, generator=gen),
             torch.randint(0, 5, (GLOBAL_BATCH,), generator=gen)) for _ in range(5)]


def _train_classifier(strategy, replica_loss):
    """Per-step losses (summed over replicas) and final weights of an MLP trained with from_torch(AdamW)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5)).double()
    with strategy.scope():
        model = dtape.layers.TorchModule(net)
        opt = dtape.optimizers.from_torch(torch.optim.AdamW(model.parameters(), lr=1e-2))

    def replica_step(x, y):
        with dtape.GradientTape() as tape:
            loss = replica_loss(model(x, training=True), y)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    losses = []
    for x, y in strategy.experimental_distribute_dataset(_classifier_batches()):
        losses.append(float(strategy.reduce("SUM", strategy.run(replica_step, args=(x, y)), axis=None)))
    return np.array(losses), [v.numpy().copy() for v in model.trainable_variables]


def _sum_over_global_batch(logits, y):
    return F.cross_entropy(logits, y, reduction="sum") / GLOBAL_BATCH


def _compute_average_loss(logits, y):
    return dtape.nn.compute_average_loss(F.cross_entropy(logits, y, reduction="none"))


@pytest.mark.parametrize("replica_loss", [_sum_over_global_batch, _compute_average_loss],
                         ids=["sum / global batch", "compute_average_loss"])
def test_mirrored_replica_cross_entropy_matches_one_device(replica_loss):
    one_losses, one_weights = _train_classifier(dtape.distribute.OneDeviceStrategy("cpu"), _sum_over_global_batch)
    with dtape.distribute.MirroredStrategy(devices=["cpu:0", "cpu:1"]) as strategy:
        losses, weights = _train_classifier(strategy, replica_loss)
    np.testing.assert_allclose(losses, one_losses, rtol=1e-13, atol=0)
    for got, expected in zip(weights, one_weights):
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14)


def _uneven_token_batches():
    """Like _token_batches, but the first row (replica 0's half) ignores 3 + i more targets at step i."""
    batches = []
    for i, (x, y) in enumerate(_token_batches(5)):
        y[0, :3 + i] = -1
        batches.append((x, y))
    return batches


def _global_token_mean(logits, y):
    """nanoGPT's mean over the targets not ignored, across replicas: the summed loss over the global count."""
    flat = y.view(-1)
    count = dtape.reduce_sum(dtape.cast(flat != -1, torch.float64))
    total = dtape.distribute.get_replica_context().all_reduce("SUM", count)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), flat, ignore_index=-1, reduction="sum") / total


def _train_gpt_under(strategy):
    torch.manual_seed(0)
    net = TinyGPT().double()
    with strategy.scope():
        model = dtape.layers.TorchModule(net)
        opt = dtape.optimizers.from_torch(_adamw(model.parameters()))

    def replica_step(x, y):
        with dtape.GradientTape() as tape:
            loss = _global_token_mean(model(x, training=True), y)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        return loss

    losses = [float(strategy.reduce("SUM", strategy.run(replica_step, args=batch), axis=None))
              for batch in strategy.experimental_distribute_dataset(_uneven_token_batches())]
    return np.array(losses), [v.numpy().copy() for v in model.trainable_variables]


def test_mirrored_nanogpt_loss_with_ignored_targets_matches_torch_on_one_device():
    # with ignore_index the mean's divisor is the global count of kept targets, not the batch size
    with dtape.distribute.MirroredStrategy(devices=["cpu:0", "cpu:1"]) as strategy:
        losses, weights = _train_gpt_under(strategy)
    torch.manual_seed(0)
    net = TinyGPT().double()
    opt = _adamw(net.parameters())
    expected = []
    for x, y in _uneven_token_batches():
        opt.zero_grad()
        loss = nanogpt_loss(net(x), y)
        loss.backward()
        opt.step()
        expected.append(loss.item())
    np.testing.assert_allclose(losses, expected, rtol=1e-13, atol=0)
    for got, param in zip(weights, net.parameters()):   # Adam's first steps amplify rounding: 1e-11 seen
        np.testing.assert_allclose(got, param.detach().numpy(), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("criterion", [nn.CrossEntropyLoss(ignore_index=-1), nn.NLLLoss(ignore_index=-1),
                                       nn.CrossEntropyLoss(reduction="sum")], ids=["CE", "NLL", "CE sum"])
def test_loss_modules_on_dtape_tensors_take_the_same_path(criterion, monkeypatch):
    calls = _count_engine_calls(monkeypatch)
    x0 = torch.randn(6, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    target = torch.tensor([0, 4, -1, 2, 3, 1]) if criterion.ignore_index == -1 else torch.tensor([0, 4, 1, 2, 3, 1])
    v = dtape.Variable(x0.clone())
    with dtape.GradientTape() as tape:
        loss = criterion(v * 1.0, target)
    xt = x0.clone().requires_grad_()
    expected = criterion(xt * 1.0, target)
    assert torch.equal(loss.torch(), expected.detach())
    assert torch.equal(tape.gradient(loss, v).torch(), torch.autograd.grad(expected, xt)[0])
    assert calls == [] and loss.item() == expected.item()


def test_mnist_style_evaluation_idioms():
    torch.manual_seed(1)
    net = DigitsNet(log_probs=True)
    model = dtape.layers.TorchModule(net)
    images, labels = _digits()
    with torch.no_grad():
        output = model(images[:64], training=False)
        test_loss = F.nll_loss(output, labels[:64], reduction="sum").item()
        pred = output.argmax(dim=1, keepdim=True)
        correct = pred.eq(labels[:64].view_as(pred)).sum().item()
        net.eval()
        expected = net(images[:64])
    assert test_loss == F.nll_loss(expected, labels[:64], reduction="sum").item()
    assert correct == expected.argmax(dim=1, keepdim=True).eq(labels[:64].view(64, 1)).sum().item()


def test_view_size_edge_cases_as_torch():
    x = torch.randn(4, 6)
    assert dtape.constant(x).view(np.int64(3), -1).shape == x.view(np.int64(3), -1).shape == (3, 8)
    empty = torch.zeros(0, 5)
    assert _raised(lambda: dtape.constant(empty).view(0, -1)) == _raised(lambda: empty.view(0, -1))
    assert dtape.constant(empty).view(-1, 5).shape == (0, 5)
    assert _raised(lambda: dtape.constant(x).view(-1, -1)) == _raised(lambda: x.view(-1, -1))


def _weighted_total(loss):
    """A [N] loss summed with weights 1..N (so each row's gradient differs); a 0-d loss as it is."""
    if not loss.ndim:
        return loss
    weights = torch.arange(1, loss.numel() + 1, dtype=loss.dtype)
    return dtape.reduce_sum(loss * weights) if isinstance(loss, dtape.Tensor) else (loss * weights).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("loss_of", [
    lambda z: F.cross_entropy(z[:, -1, :], torch.tensor([1, 5, 0])),                    # last position, strided
    lambda z: F.cross_entropy(z[0].t(), torch.tensor([0, 5, 2, 3, 4, 5, 1]), reduction="none"),   # transposed
    lambda z: F.cross_entropy(z[0, :1].expand(5, 7), torch.tensor([0, 1, 2, 3, 4])),     # stride 0
    lambda z: F.nll_loss(F.log_softmax(z.transpose(1, 2).reshape(-1, 7), 1), torch.arange(18) % 7,
                         reduction="sum"),
    lambda z: F.cross_entropy(z[1, 2], torch.tensor(3)),                                 # [C] and a 0-d target
], ids=["last position", "transposed", "expanded", "log_softmax then nll", "one example"])
def test_strided_and_half_logits_are_torchs_bit_for_bit(loss_of, dtype):
    base = torch.randn(3, 6, 7, generator=torch.Generator().manual_seed(0)).to(dtype)
    v = dtape.Variable(base.clone())
    with dtape.GradientTape() as tape:
        loss = loss_of(v * 1.0)
        total = _weighted_total(loss)
    grad = tape.gradient(total, v)
    xt = base.clone().requires_grad_()
    expected = loss_of(xt * 1.0)
    expected_grad, = torch.autograd.grad(_weighted_total(expected), xt)
    assert torch.equal(loss.torch(), expected.detach()) and torch.equal(grad.torch(), expected_grad)
