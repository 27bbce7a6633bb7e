"""dtape.layers.TorchModule: torch.nn modules trained with dtape (gradients vs torch.autograd, buffers,
strategies, checkpoints), the torch.Tensor methods dtape tensors forward, and docs/torch_interop.md."""
import copy
import doctest
import pathlib
import re
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dtape
from dtape import distribute as ds

DEVICES = ["cpu:0", "cpu:1"]
DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "torch_interop.md"
f64 = torch.float64


class SmallCNN(nn.Module):
    """A torchvision-style CNN: features (conv, [batchnorm], relu, pool) then a classifier."""

    def __init__(self, batchnorm=True, classes=5):
        super().__init__()
        norm = nn.BatchNorm2d if batchnorm else (lambda c: nn.Identity())
        self.features = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), norm(4), nn.ReLU(inplace=True), nn.MaxPool2d(2),
            nn.Conv2d(4, 6, 3, padding=1), norm(6), nn.ELU(inplace=True), nn.AdaptiveAvgPool2d((2, 2)))
        self.classifier = nn.Sequential(nn.Dropout(0.0), nn.Linear(24, classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


def _seeded(make, seed=0):
    torch.manual_seed(seed)
    return make()


def _tel(dropout=0.0, **kw):
    return nn.TransformerEncoderLayer(8, 2, 16, dropout=dropout, batch_first=True, **kw)


def _torch_grads(module, x, training=True):
    """(loss, parameter grads, input grad) of sum(module(x)**2) by torch.autograd on a copy of `module`."""
    ref = copy.deepcopy(module).train(training)
    x = x.clone().requires_grad_()
    loss = (ref(x) ** 2).sum()
    grads = torch.autograd.grad(loss, list(ref.parameters()) + [x])
    return loss.item(), grads[:-1], grads[-1], ref


def _dtape_grads(tm, x, training=True):
    x = dtape.constant(x)
    with dtape.GradientTape() as tape:
        tape.watch(x)
        out = tm(x, training=training)
        loss = dtape.reduce_sum(out * out)
    grads = tape.gradient(loss, list(tm.trainable_variables) + [x])
    return float(loss), grads[:-1], grads[-1]


@pytest.mark.parametrize("make, shape, training", [
    (lambda: SmallCNN(), (3, 1, 8, 8), True),
    (lambda: _tel(), (2, 5, 8), True),
    (lambda: _tel(dropout=0.5), (2, 5, 8), False),
    (lambda: _tel(norm_first=True, activation="gelu"), (2, 5, 8), True),
], ids=["cnn_batchnorm", "transformer_encoder_layer", "transformer_eval", "transformer_norm_first_gelu"])
def test_gradients_equal_torch_autograd(make, shape, training):
    module = _seeded(make).double()
    x = torch.randn(shape, dtype=f64)
    ref_loss, ref_grads, ref_dx, ref = _torch_grads(module, x, training)
    tm = dtape.layers.TorchModule(module)
    loss, grads, dx = _dtape_grads(tm, x, training)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    assert len(grads) == len(ref_grads) == len(list(module.parameters()))
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dx.numpy(), ref_dx.numpy(), rtol=1e-10, atol=1e-12)
    for name, value in tm.state_dict().items():  # buffers (BatchNorm running stats) as torch updated them
        assert torch.equal(value, ref.state_dict()[name].detach()), name


def test_embedding_layernorm_tied_weights_gradients():
    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(7, 4)
            self.norm = nn.LayerNorm(4)
            self.head = nn.Linear(4, 7, bias=False)
            self.head.weight = self.embed.weight           # tied, as in language models

        def forward(self, ids):
            return self.head(self.norm(self.embed(ids)))

    module = _seeded(TiedLM).double()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    ref = copy.deepcopy(module)
    (ref(ids) ** 2).sum().backward()
    tm = dtape.layers.TorchModule(module)
    assert tm._params["embed.weight"] is tm._params["head.weight"]
    assert len(tm.trainable_variables) == 3                  # embed (tied with head), norm.weight, norm.bias
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_sum(tm(ids) ** 2)
    grads = tape.gradient(loss, tm.trainable_variables)
    for g, p in zip(grads, ref.parameters()):                 # same order: named_parameters, tied once
        np.testing.assert_allclose(g.numpy(), p.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_variables_names_and_trainability():
    module = _seeded(SmallCNN)
    module.classifier[1].bias.requires_grad_(False)
    tm = dtape.layers.TorchModule(module, name="cnn")
    names = [v.name for v in tm.variables]
    assert names == [f"cnn/{n}" for n, _ in module.named_parameters()] + \
        [f"cnn/{n}" for n, _ in module.named_buffers()]
    assert [v.name for v in tm.trainable_variables] == \
        [f"cnn/{n}" for n, p in module.named_parameters() if p.requires_grad]
    assert {v.name.split(".")[-1] for v in tm.non_trainable_variables} == \
        {"bias", "running_mean", "running_var", "num_batches_tracked"}
    assert tm.variables[0].dtype == torch.float32 and tm._buffers["features.1.num_batches_tracked"].dtype == torch.int64
    assert isinstance(tm, dtape.Module)


def test_buffers_written_back_in_training_only_and_eval_uses_them():
    bn = _seeded(lambda: nn.BatchNorm2d(3)).double()
    ref = copy.deepcopy(bn)
    tm = dtape.layers.TorchModule(bn)
    for _ in range(2):
        x = torch.randn(4, 3, 2, 2, dtype=f64)
        ref.train()(x)
        tm(x, training=True)
    before = tm.state_dict()
    assert int(before["num_batches_tracked"]) == 2
    for name, value in ref.state_dict().items():
        assert torch.equal(before[name], value), name
    x = torch.randn(4, 3, 2, 2, dtype=f64)
    np.testing.assert_allclose(tm(x, training=False).numpy(), ref.eval()(x).detach().numpy(), rtol=1e-12)
    after = tm.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)   # eval: no update
    assert bn.training                                               # its mode is never flipped
    for name, value in bn.state_dict().items():                      # a view: the module holds the updates
        assert torch.equal(value, after[name]), name


def test_training_default_follows_module_mode_without_changing_it():
    module = _seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=0.0)))
    tm = dtape.layers.TorchModule(module)
    x = torch.randn(6, 4)
    module.eval()
    np.testing.assert_allclose(tm(x).numpy(), module(x).detach().numpy(), rtol=1e-6)
    module.train()
    np.testing.assert_allclose(tm(x).numpy(), module(x).detach().numpy(), rtol=1e-6)
    tm(x, training=False)
    assert module.training and module[1].training




def test_concurrent_calls_in_both_modes_do_not_interfere(fast_switching):
    # momentum=0: running stats stay (0, 1), so each mode has one fixed expected output.
    module = _seeded(lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=0.0)))
    tm = dtape.layers.TorchModule(module)
    x = torch.randn(6, 4)
    expected = {mode: module.train(mode)(x).detach() for mode in (True, False)}
    errors = []

    def worker(mode):
        for _ in range(200):
            got = tm(x, training=mode).torch()
            if not torch.allclose(got, expected[mode], rtol=1e-6, atol=1e-7):
                errors.append(mode)
    threads = [threading.Thread(target=worker, args=(m,)) for m in (True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def _train(strategy, make, xs, ys, steps=3, lr=0.1):
    """Per-step global losses of SGD on mean squared error; the global batch is split across replicas."""
    module = _seeded(make).double()
    with strategy.scope():
        tm = dtape.layers.TorchModule(module)
        opt = dtape.optimizers.SGD(lr)
    n = xs.shape[0]

    def step(x, y):
        with dtape.GradientTape() as tape:
            err = tm(x, training=True) - y
            loss = dtape.reduce_sum(err * err) / float(n)
        opt.apply_gradients(zip(tape.gradient(loss, tm.trainable_variables), tm.trainable_variables))
        return loss
    losses = []
    for x, y in strategy.experimental_distribute_dataset([(xs, ys)] * steps):
        losses.append(float(strategy.reduce(ds.ReduceOp.SUM, strategy.run(step, args=(x, y)))))
    return losses, tm


@pytest.mark.parametrize("make, xshape, yshape", [
    (lambda: SmallCNN(batchnorm=False), (8, 1, 8, 8), (8, 5)),
    (lambda: _tel(), (8, 5, 8), (8, 5, 8)),
], ids=["cnn", "transformer_encoder_layer"])
def test_mirrored_training_matches_one_device(make, xshape, yshape, fast_switching):
    gen = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(xshape, generator=gen, dtype=f64), torch.randn(yshape, generator=gen, dtype=f64)
    ref, _ = _train(ds.OneDeviceStrategy("cpu"), make, xs, ys)
    got, tm = _train(ds.MirroredStrategy(DEVICES, timeout=30), make, xs, ys)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    assert ref[-1] < ref[0]
    for var in tm.variables:
        assert isinstance(var, ds.MirroredVariable)
        a, b = var.values
        assert torch.equal(a.torch(), b.torch()), var.name


def test_mirrored_batchnorm_buffers_average_the_replicas():
    module = _seeded(lambda: nn.BatchNorm1d(3, momentum=0.5)).double()
    original = copy.deepcopy(module)          # the wrapper trains `module` itself
    x = torch.randn(8, 3, dtype=f64)
    strategy = ds.MirroredStrategy(DEVICES, timeout=30)
    with strategy.scope():
        tm = dtape.layers.TorchModule(module)
    for batch in strategy.experimental_distribute_dataset([x]):
        strategy.run(lambda b: tm(b, training=True), args=(batch,))
    module = original
    halves = [copy.deepcopy(module).train() for _ in range(2)]
    for half, part in zip(halves, (x[:4], x[4:])):
        half(part)
    for name in ("running_mean", "running_var"):
        var = tm._buffers[name]
        assert var.aggregation == dtape.VariableAggregation.MEAN
        expected = (getattr(halves[0], name) + getattr(halves[1], name)) / 2
        for component in var.values:
            np.testing.assert_allclose(component.numpy(), expected.numpy(), rtol=1e-12)
    one_device = copy.deepcopy(module).train()
    one_device(x)   # the mean of the replicas' running_mean updates is the global-batch update
    np.testing.assert_allclose(tm._buffers["running_mean"].numpy(), one_device.running_mean.numpy(), rtol=1e-12)
    assert [int(c.numpy()) for c in tm._buffers["num_batches_tracked"].values] == [1, 1]


def test_checkpoint_roundtrip_and_state_dict(tmp_path):
    module = _seeded(SmallCNN)
    tm = dtape.layers.TorchModule(module)
    x = torch.randn(2, 1, 8, 8)
    tm(x, training=True)                                   # move the running stats
    path = tmp_path / "ckpt"
    dtape.checkpoint.save(path, model=tm)
    saved = tm.state_dict()
    for var in tm.trainable_variables:
        var.assign_add(dtape.ones_like(var.read_value()))
    fresh = dtape.layers.TorchModule(_seeded(SmallCNN, seed=5))
    for target in (tm, fresh):
        dtape.checkpoint.restore(path, model=target)
        got = target.state_dict()
        assert all(torch.equal(got[k], saved[k]) for k in saved)
    clone = _seeded(SmallCNN, seed=7)
    clone.load_state_dict(fresh.state_dict())              # back to a plain torch module
    np.testing.assert_allclose(clone.eval()(x).detach().numpy(), tm(x, training=False).numpy(), rtol=1e-6)


def test_nested_outputs_and_inputs():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.register_buffer("scale", torch.tensor(2.0))

        def forward(self, inputs, shift=0.0):
            y = self.lin(inputs["x"]) + shift
            return {"y": y, "parts": (y * self.scale, self.scale + 1)}

    tm = dtape.layers.TorchModule(_seeded(Two))
    out = tm({"x": np.ones((1, 3), np.float32)}, shift=dtape.constant(1.0))
    assert all(type(t) is dtape.Tensor for t in (out["y"], *out["parts"]))
    np.testing.assert_allclose(out["parts"][0].numpy(), 2 * out["y"].numpy())
    assert float(out["parts"][1]) == 3.0


@pytest.mark.filterwarnings("ignore:`torch.jit.script.*is deprecated:DeprecationWarning")
def test_unsupported_modules_raise_clear_errors():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        dtape.layers.TorchModule(lambda x: x)
    with pytest.raises(TypeError, match="ScriptModule"):
        dtape.layers.TorchModule(torch.jit.script(nn.Linear(2, 2)))
    param = nn.Linear(2, 2)
    torch.nn.utils.parametrize.register_parametrization(param, "weight", nn.Identity())
    with pytest.raises(TypeError, match="parametrizations"):
        dtape.layers.TorchModule(nn.Sequential(param))
    hooked = nn.Sequential(nn.Linear(2, 2))
    tm = dtape.layers.TorchModule(hooked)
    handle = hooked[0].register_forward_hook(lambda m, i, o: o)
    with pytest.raises(NotImplementedError, match="hooks"):
        tm(torch.ones(1, 2))
    handle.remove()
    assert tm(torch.ones(1, 2)).shape == (1, 2)

    class Mutates(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def forward(self, x):
            self.w.mul_(2)
            return x * self.w
    with pytest.raises(TypeError, match="in place"):
        dtape.layers.TorchModule(Mutates())(torch.ones(2))

    class ReplacesData(nn.Module):  # a VQ-VAE codebook's EMA update, made in forward through `.data = `
        def __init__(self):
            super().__init__()
            self.codebook = nn.Parameter(torch.ones(2), requires_grad=False)

        def forward(self, x):
            self.codebook.data = self.codebook.data * 0.5
            return x * self.codebook
    wrapped = dtape.layers.TorchModule(ReplacesData())
    with pytest.raises(TypeError, match="through `.data`"):  # its update would be lost silently, step after step
        wrapped(torch.ones(2))
    assert torch.equal(wrapped.module.codebook.detach(), torch.ones(2))


# -- interop fixes: torch.Tensor methods on dtape tensors, seeded random fallbacks ----------------

def test_torch_tensor_methods_and_properties_are_recorded():
    x = dtape.constant(torch.randn(2, 3, dtype=f64))
    with dtape.GradientTape() as tape:
        tape.watch(x)
        assert x.dim() == 2 and x.size(1) == 3 and x.is_nested is False
        y = x.view(3, 2).transpose(0, 1).contiguous().T.sum()
    assert type(y) is dtape.Tensor
    np.testing.assert_array_equal(tape.gradient(y, x).numpy(), np.ones((2, 3)))
    with pytest.raises(TypeError, match="in place"):
        x.add_(1)
    for name in ("values", "name", "_private", "no_such_method"):
        assert not hasattr(x, name)


@pytest.mark.parametrize("inplace", [False, True])
def test_dropout_through_torch_gets_the_forward_mask(inplace):
    x = dtape.constant(torch.randn(500, dtype=f64))
    with dtape.GradientTape() as tape:
        tape.watch(x)
        t = torch.tanh(x)                   # its gradient reads its output, which must stay intact
        y = F.dropout(t, 0.5, training=True, inplace=inplace)
        total = dtape.reduce_sum(y)
    kept = (y.torch() != 0).to(f64)
    assert 100 < kept.sum() < 400
    assert torch.equal(t.torch(), torch.tanh(x.torch()))
    expected = 2 * kept * (1 - torch.tanh(x.torch()) ** 2)
    np.testing.assert_allclose(tape.gradient(total, x).numpy(), expected.numpy(), rtol=1e-12)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_transformer_with_dropout_gradient_matches_finite_differences(device):
    """Attention dropout runs inside one fallback op (multi_head_attention_forward): its backward
    re-runs it, which must replay the forward's random stream. With torch.manual_seed before each
    forward the masks are fixed, so central differences check the gradient."""
    tm = dtape.layers.TorchModule(_seeded(lambda: _tel(dropout=0.3)).double().to(device))
    x = dtape.constant(torch.randn(2, 5, 8, dtype=f64, device=device))

    def loss_fn():
        torch.manual_seed(123)
        out = tm(x, training=True)
        return dtape.reduce_sum(out * out)
    with dtape.GradientTape() as tape:
        loss = loss_fn()
    grads = tape.gradient(loss, tm.trainable_variables)
    gen = torch.Generator().manual_seed(3)
    dirs = [torch.randn(v.shape, generator=gen, dtype=f64).to(device) for v in tm.trainable_variables]
    eps = 1e-6

    def shifted(sign):
        for v, d in zip(tm.trainable_variables, dirs):
            v.assign_add(sign * eps * d)
        value = float(loss_fn())
        for v, d in zip(tm.trainable_variables, dirs):
            v.assign_sub(sign * eps * d)
        return value
    numeric = (shifted(1) - shifted(-1)) / (2 * eps)
    analytic = sum(float((g.torch() * d).sum()) for g, d in zip(grads, dirs))
    assert analytic == pytest.approx(numeric, rel=1e-6)


# -- docs/torch_interop.md: every python block runs ----------------------------------------------

def _doc_blocks():
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


def test_docstring_example_runs():
    import dtape.torch_module
    result = doctest.testmod(dtape.torch_module, extraglobs={"dtape": dtape, "torch": torch})
    assert result.attempted >= 3 and result.failed == 0


def test_docs_examples_run():
    blocks = _doc_blocks()
    assert len(blocks) >= 2
    namespace = {}
    for block in blocks:                     # blocks share one namespace, in order, as a reader runs them
        exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102 (our own docs)


def test_gradients_through_nested_args_kwargs_and_flat_args_equal_torch():
    """The forward's arguments reach it flattened and rebuilt (nested containers, keywords, non-tensor
    leaves, or only positional tensors): values and gradients (parameters, tensor arguments) are torch's."""
    class Mix(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, inputs, k, shift=None, scale=1.0):
            h = self.lin(inputs["x"]) * scale + inputs["parts"][1]
            return (h[:, :k] + (0.0 if shift is None else shift)).sum()

    module = _seeded(Mix).double()
    x, part, shift = (torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64),
                      torch.randn(4, 1, dtype=torch.float64))
    tm = dtape.layers.TorchModule(module)
    calls = [(lambda m, a, b, s: m({"x": a, "parts": [a, b]}, 1, shift=s, scale=2.0)),
             (lambda m, a, b, s: m({"x": a, "parts": (a, b)}, 2, s)),
             (lambda m, a, b, s: m({"x": a, "parts": [b, b]}, 2))]
    class Flat(nn.Module):  # positional tensors only
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, a, b, c):
            return (self.lin(a) * b + c).sum()

    flat = _seeded(Flat).double()
    flat_tm = dtape.layers.TorchModule(flat)
    calls.append(lambda m, a, b, s: (flat if m is module else flat_tm)(a, b, s))
    for call in calls:
        leaves = [t.clone().requires_grad_() for t in (x, part, shift)]
        expected = call(module, *leaves)
        ours = flat_tm if call is calls[-1] else tm
        grads = torch.autograd.grad(expected, [*ours.module.parameters(), *leaves], allow_unused=True)
        inputs = [dtape.constant(t) for t in (x, part, shift)]
        with dtape.GradientTape() as tape:
            tape.watch(inputs)
            out = call(tm, *inputs)
        got = tape.gradient(out, [*ours.trainable_variables, *inputs])
        assert float(out) == pytest.approx(expected.item(), rel=1e-12)
        for g, e in zip(got, grads):
            if e is None or not e.abs().sum():
                assert g is None or not g.numpy().any()
            else:
                np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-12, atol=1e-12)
