"""Attacks in the idioms of real training scripts (Hugging Face, torchtitan, timm): torch state dicts of
modules with non-persistent buffers, torch schedulers and optimizers through `from_torch`. References: plain
torch on one device, float64, or torch's own behaviour for the same call."""
import dataclasses
import types

import numpy as np
import pytest
import torch
from torch import nn

import dtape
import dtape.keras.callbacks

f64 = torch.float64


class _Rotary(nn.Module):
    """A layer with a buffer torch does not save: a rotary embedding's `inv_freq` (Hugging Face's Llama
    registers it with persistent=False), beside a saved one."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4, dtype=f64)
        self.register_buffer("inv_freq", torch.linspace(1.0, 2.0, 4, dtype=f64), persistent=False)
        self.register_buffer("scale", torch.full((4,), 0.5, dtype=f64))

    def forward(self, x):
        return self.proj(x) * torch.cos(self.inv_freq) * self.scale


def _model():
    return nn.Sequential(_Rotary(), nn.Tanh(), nn.Linear(4, 2, dtype=f64))


def test_state_dicts_leave_out_non_persistent_buffers_as_torch():
    """`tm.state_dict()` has the names of `module.state_dict()`, so it loads into a torch module (strict), and
    `tm.load_state_dict(module.state_dict())` loads; a non-persistent name is unexpected, as in torch."""
    torch.manual_seed(0)
    net, fresh = _model(), _model()
    tm = dtape.layers.TorchModule(net)
    x = torch.randn(3, 4, dtype=f64, generator=torch.Generator().manual_seed(1))
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_sum(tm(x) ** 2)
    dtape.optimizers.SGD(0.1).apply_gradients(zip(tape.gradient(loss, tm.trainable_variables),
                                                  tm.trainable_variables))
    assert sorted(tm.state_dict()) == sorted(net.state_dict())
    fresh.load_state_dict(tm.state_dict())
    torch.testing.assert_close(fresh(x), net(x), rtol=0, atol=0)

    other = _model()
    with torch.no_grad():
        other[0].inv_freq.mul_(3.0)  # not saved: loading leaves the wrapped module's own value
    assert tuple(tm.load_state_dict(other.state_dict())) == ([], [])
    other[0].inv_freq.copy_(net[0].inv_freq)
    torch.testing.assert_close(tm(x).torch(), other(x), rtol=0, atol=0)

    saved = {**other.state_dict(), "0.inv_freq": torch.zeros(4, dtype=f64)}
    with pytest.raises(RuntimeError, match=r"unexpected keys \['0.inv_freq'\]"):
        tm.load_state_dict(saved)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        other.load_state_dict(saved)  # torch says the same
    assert tuple(tm.load_state_dict(saved, strict=False)) == ([], ["0.inv_freq"])
    torch.testing.assert_close(net[0].inv_freq, torch.linspace(1.0, 2.0, 4, dtype=f64), rtol=0, atol=0)


@pytest.mark.parametrize("record", [True, False], ids=["in_a_tape", "no_tape"])
def test_backward_and_autograd_grad_on_a_dtape_loss_raise_naming_the_tape(record):
    """A ported torch loop's `loss.backward()` (or torch.autograd.grad) on a dtape loss raised torch's "element
    0 of tensors does not require grad"; it names the tape instead. The tape's gradients stay torch's."""
    torch.manual_seed(0)
    net = nn.Linear(4, 2, dtype=f64)
    tm = dtape.layers.TorchModule(net)
    x = torch.randn(8, 4, dtype=f64, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 2, dtype=f64, generator=torch.Generator().manual_seed(2))
    with dtape.GradientTape(persistent=True) as tape:
        recorded = nn.functional.mse_loss(tm(x), y)
    loss = recorded if record else nn.functional.mse_loss(tm(x), y)
    with pytest.raises(RuntimeError, match=r"loss.backward\(\) on dtape tensors.*tape.gradient\(loss"):
        loss.backward()
    with pytest.raises(RuntimeError, match=r"torch.autograd.grad on dtape tensors.*GradientTape"):
        torch.autograd.grad(loss, list(net.parameters()))
    with pytest.raises(RuntimeError, match=r"torch.autograd.backward on dtape tensors"):
        torch.autograd.backward([loss])
    assert net.weight.grad is None
    expected = torch.autograd.grad(nn.functional.mse_loss(net(x), y), list(net.parameters()))
    for got, want in zip(tape.gradient(recorded, tm.trainable_variables), expected):
        torch.testing.assert_close(got.torch(), want, rtol=1e-12, atol=1e-14)


@dataclasses.dataclass
class _Output:
    loss: torch.Tensor
    logits: torch.Tensor


class _Classifier(nn.Module):
    """A forward returning its loss with the logits (Hugging Face's `outputs.loss`), as a dict or a dataclass."""

    def __init__(self, dataclass):
        super().__init__()
        self.lin, self.dataclass = nn.Linear(4, 3, dtype=f64), dataclass

    def forward(self, x, labels):
        logits = self.lin(x)
        loss = nn.functional.cross_entropy(logits, labels)
        return _Output(loss, logits) if self.dataclass else {"loss": loss, "logits": logits}


def test_a_torch_tensor_as_gradient_target_is_refused_naming_the_cause():
    """A dataclass output keeps torch tensors (documented), so its loss is no tape's target: the error says a
    torch.Tensor was given and why (it said "got Tensor"); the dict form gives torch's gradients."""
    x = torch.randn(8, 4, dtype=f64, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    torch.manual_seed(0)
    net = _Classifier(dataclass=True)
    tm = dtape.layers.TorchModule(net)
    with dtape.GradientTape() as tape:
        out = tm(x, labels=labels)
    with pytest.raises(ValueError, match=r"got a torch.Tensor: torch code.*dataclass.*tm.trainable_variables"):
        tape.gradient(out.loss, tm.trainable_variables)
    net.dataclass = False
    with dtape.GradientTape() as tape:
        loss = tm(x, labels=labels)["loss"]
    expected = torch.autograd.grad(nn.functional.cross_entropy(net.lin(x), labels), list(net.parameters()))
    for got, want in zip(tape.gradient(loss, tm.trainable_variables), expected):
        torch.testing.assert_close(got.torch(), want, rtol=1e-12, atol=1e-14)


class _Outer(nn.Module):
    """A torch module whose forward calls `inner` (a torch module, or a TorchModule) between its own layers."""

    def __init__(self, inner):
        super().__init__()
        self.pre, self.post = nn.Linear(4, 4, dtype=f64), nn.Linear(4, 2, dtype=f64)
        self.inner = inner

    def forward(self, x):
        return self.post(torch.tanh(self.inner(torch.tanh(self.pre(x)))))


def test_a_torch_module_called_inside_another_wrapped_forward_is_refused_when_recorded():
    """The outer module's parameters got None (its graph was cut at the inner dtape call), silently; now the
    recorded call raises naming the fix, which (the inner torch module as a submodule) gives torch's gradients.
    With the outer module frozen, or with no tape, the nested call still runs."""
    x = torch.randn(8, 4, dtype=f64, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    inner_net = nn.Linear(4, 4, dtype=f64)
    ref = _Outer(inner_net)
    names = [n for n, _ in ref.named_parameters()]
    expected = dict(zip(names, torch.autograd.grad(ref(x).square().sum(), list(ref.parameters()))))

    inner = dtape.layers.TorchModule(inner_net)
    outer_net = _Outer(None)
    outer_net.pre, outer_net.post = ref.pre, ref.post
    object.__setattr__(outer_net, "inner", inner)  # a TorchModule is no nn.Module: a plain attribute
    outer = dtape.layers.TorchModule(outer_net)
    with dtape.GradientTape() as tape:
        with pytest.raises(TypeError, match=r"inside the forward of another TorchModule \(_Outer\).*submodule"):
            outer(x)
    torch.testing.assert_close(outer(x).torch(), ref(x), rtol=0, atol=0)  # no tape: runs, as before

    for p in outer_net.parameters():
        p.requires_grad_(False)
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_sum(dtape.square(outer(x)))
    for got, name in zip(tape.gradient(loss, inner.trainable_variables), ["inner.weight", "inner.bias"]):
        torch.testing.assert_close(got.torch(), expected[name], rtol=1e-12, atol=1e-14)
    for p in outer_net.parameters():
        p.requires_grad_(True)

    whole = dtape.layers.TorchModule(ref)  # the fix: the inner torch module as a submodule
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_sum(dtape.square(whole(x)))
    for got, name in zip(tape.gradient(loss, whole.trainable_variables), names):
        torch.testing.assert_close(got.torch(), expected[name], rtol=1e-12, atol=1e-14)


def _two_groups(net):
    """Fine-tuning's groups: the backbone at 1/100 of the head's rate."""
    return torch.optim.SGD([{"params": net[0].parameters(), "lr": 1e-3}, {"params": net[2].parameters()}], lr=0.1)


def test_keras_reduce_lr_on_plateau_scales_every_group_of_a_torch_optimizer_as_torch_s():
    """dtape.keras.callbacks.ReduceLROnPlateau sets `learning_rate` to lr * factor; with from_torch's groups it set
    every group to the first group's new rate (the head's 0.1 became 5e-4, silently). Each group is scaled
    now, as torch's ReduceLROnPlateau does, and the next step equals torch's."""
    torch.manual_seed(0)
    ref, net = _model(), _model()
    net.load_state_dict(ref.state_dict())
    ref_opt = _two_groups(ref)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(ref_opt, patience=0, factor=0.5)
    tm = dtape.layers.TorchModule(net)
    opt = dtape.optimizers.from_torch(_two_groups(net))
    callback = dtape.keras.callbacks.ReduceLROnPlateau(monitor="loss", patience=0, factor=0.5)
    callback.set_model(types.SimpleNamespace(optimizer=opt))
    callback.on_train_begin()
    for epoch, loss in enumerate([1.0, 2.0, 3.0]):   # no improvement after the first: two reductions
        plateau.step(loss)
        callback.on_epoch_end(epoch, {"loss": loss})
    assert [g["lr"] for g in opt.torch_optimizer.param_groups] == [g["lr"] for g in ref_opt.param_groups] \
        == [2.5e-4, 0.025]

    x = torch.randn(3, 4, dtype=f64, generator=torch.Generator().manual_seed(1))
    ref(x).square().sum().backward()
    ref_opt.step()
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_sum(dtape.square(tm(x)))
    opt.apply_gradients(zip(tape.gradient(loss, tm.trainable_variables), tm.trainable_variables))
    for got, want in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
