"""Torch tensors in torch's autograd (a wrapped module's parameters, torch code over them) entering dtape ops
while a tape records: refused, never a constant with the gradient of that use silently missing.

Source of the idioms: an L2 penalty over `model.parameters()` in the loss (PyTorch forums' weight decay by
hand), a tied output projection `F.linear(h, wte.weight)` (GPT-2 style heads), CLIP's `logit_scale.exp()`.
Not refused: a torch tensor given to an op without a gradient rule (`tf.stop_gradient` of a value meant as
a constant, accuracy as `equal(argmax(logits), labels)`), and a torch module left unwrapped (PyTorch's FGSM
tutorial's classifier), a constant function as in torch.
"""
import pytest
import torch
import torch.nn.functional as F

import dtape

D = torch.float64


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).to(D)


def _x():
    return torch.randn(5, 3, dtype=D, generator=torch.Generator().manual_seed(1))


PENALTIES = {
    "l2 over net.parameters(), dtape first": lambda net, out: dtape.reduce_sum(out) + 1e-2 * sum(
        p.pow(2).sum() for p in net.parameters()),
    "l2 over net.parameters(), torch first": lambda net, out: 1e-2 * sum(
        p.pow(2).sum() for p in net.parameters()) + dtape.reduce_sum(out),
    "tied projection F.linear(h, weight)": lambda net, out: dtape.reduce_sum(F.linear(out, net[2].weight.T)),
    "a parameter in a dtape function": lambda net, out: dtape.reduce_sum(out) + dtape.reduce_sum(net[0].weight),
    "add_n": lambda net, out: dtape.add_n([dtape.reduce_sum(out), net[0].bias.sum()]),
    "a torch function without a dtape rule": lambda net, out: dtape.reduce_sum(torch.cdist(out, net[2].weight.T)),
    "logit scale": lambda net, out: dtape.reduce_sum(out) * net[0].bias.exp().sum(),
}


@pytest.mark.parametrize("use", PENALTIES)
def test_a_torch_tensor_in_autograd_entering_a_taped_computation_raises(use):
    net = _net()
    tm = dtape.layers.TorchModule(net)
    x = dtape.constant(_x())
    with pytest.raises(TypeError, match=r"requires grad .* entered a dtape op while a GradientTape records.*"
                                        r"tm.trainable_variables"):
        with dtape.GradientTape():
            PENALTIES[use](net, tm(x))


def test_the_penalty_over_the_variables_equals_torch_autograd():
    net = _net()
    tm = dtape.layers.TorchModule(net)
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_sum(tm(dtape.constant(_x())) ** 2) + 1e-2 * dtape.add_n(
            [dtape.reduce_sum(v ** 2) for v in tm.trainable_variables])
    got = tape.gradient(loss, tm.trainable_variables)
    ref = _net()
    want_loss = (ref(_x()) ** 2).sum() + 1e-2 * sum(p.pow(2).sum() for p in ref.parameters())
    want = torch.autograd.grad(want_loss, list(ref.parameters()))
    assert float(loss) == pytest.approx(want_loss.item(), rel=1e-12)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.torch(), w, rtol=1e-12, atol=1e-12)


def test_without_a_tape_detached_or_under_no_grad_it_is_a_value():
    net = _net()
    tm = dtape.layers.TorchModule(net)
    x = dtape.constant(_x())
    want = float(net(_x()).sum() + net[0].weight.sum())
    assert float(dtape.reduce_sum(tm(x)) + dtape.reduce_sum(net[0].weight)) == pytest.approx(want, rel=1e-12)
    with dtape.GradientTape(persistent=True) as tape:
        loss = dtape.reduce_sum(tm(x)) + dtape.reduce_sum(net[0].weight.detach())
        with torch.no_grad():
            loss_ng = dtape.reduce_sum(net[0].weight)
    assert float(loss) == pytest.approx(want, rel=1e-12) and tape.gradient(loss_ng, tm.trainable_variables[0]) is None
    (g,) = tape.gradient(loss, tm.trainable_variables[:1])
    ref = _net()
    want_g = torch.autograd.grad(ref(_x()).sum(), [ref[0].weight])[0]
    torch.testing.assert_close(g.torch(), want_g, rtol=1e-12, atol=1e-12)


def test_stop_gradient_of_a_parameter_in_a_tape_is_its_detached_value():
    net = _net()
    tm = dtape.layers.TorchModule(net)
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_sum(tm(dtape.constant(_x())) * dtape.stop_gradient(net[2].bias))
    got = tape.gradient(loss, tm.trainable_variables)
    ref = _net()
    want_loss = (ref(_x()) * ref[2].bias.detach()).sum()
    want = torch.autograd.grad(want_loss, list(ref.parameters()))
    assert abs(float(loss) - want_loss.item()) <= 1e-12 * abs(want_loss.item())
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.as_tensor(g.numpy()), w, rtol=1e-12, atol=1e-15)


def test_accuracy_of_a_torch_output_in_a_tape_equals_torch():
    net = _net()
    labels = torch.tensor([0, 1, 1, 0, 1])
    with dtape.GradientTape():
        logits = net(_x())  # a torch model's output, in torch's autograd
        hits = dtape.equal(dtape.argmax(logits, axis=1), dtape.constant(labels))
        acc = dtape.reduce_mean(dtape.cast(hits, D))
    want = (net(_x()).argmax(1) == labels).to(D).mean()
    assert float(acc) == want.item()


def test_an_unwrapped_torch_classifier_under_a_tape_is_a_constant_function_as_in_torch():
    model = _net().eval()  # PyTorch's FGSM tutorial: a pretrained classifier, parameters not frozen
    x, labels = dtape.constant(_x()), torch.tensor([0, 1, 0, 1, 1])
    with dtape.GradientTape() as tape:
        tape.watch(x)
        loss = dtape.reduce_mean(dtape.keras.losses.sparse_categorical_crossentropy(
            dtape.constant(labels), model(x), from_logits=True))
    got = tape.gradient(loss, x)
    ref_x = _x().requires_grad_()
    want_loss = F.cross_entropy(_net()(ref_x), labels)
    want, = torch.autograd.grad(want_loss, ref_x)
    assert abs(float(loss) - want_loss.item()) <= 1e-12
    torch.testing.assert_close(torch.as_tensor(got.numpy()), want, rtol=1e-12, atol=1e-15)
