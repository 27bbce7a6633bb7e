"""A torch tensor in torch's autograd given to a dtape op without a gradient rule while a tape records: no
tape records that op, so no gradient is lost and the tensor is the constant the code asks for.

Source of the idioms: `tf.stop_gradient` on a value meant as a constant (a frozen temperature, a target
network's output), accuracy as `equal(argmax(logits), labels)` on a torch model's output (Keras' metrics).
"""
import torch
import torch.nn.functional as F

import dtape

D = torch.float64


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).to(D)


def _x():
    return torch.randn(5, 3, dtype=D, generator=torch.Generator().manual_seed(1))


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
