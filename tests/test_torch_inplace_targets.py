"""In-place torch functions whose target is a torch.Tensor and whose other arguments are dtape tensors.

pytorch/examples' word_language_model updates its parameters by hand,
`p.data.add_(p.grad, alpha=-lr)`; ported to a tape, the gradient is the
dtape.Tensor that `tape.gradient` returns. Such a call writes a torch tensor
and only reads the dtape one, so it runs as in torch; it raised "dtape.Tensor
is immutable" (the dtape tensor is not the one written).
"""
import pytest
import torch
from torch import nn
import torch.nn.functional as F

import dtape


class _CharLM(nn.Module):
    def __init__(self, ntoken=11, nhid=6):
        super().__init__()
        self.ntoken = ntoken
        self.encoder = nn.Embedding(ntoken, nhid)
        self.rnn = nn.LSTM(nhid, nhid, 2)
        self.decoder = nn.Linear(nhid, ntoken)

    def forward(self, x, hidden):
        out, hidden = self.rnn(self.encoder(x), hidden)
        return F.log_softmax(self.decoder(out).view(-1, self.ntoken), dim=1), hidden


def _batches():
    data = torch.randint(0, 11, (13, 4), generator=torch.Generator().manual_seed(1))
    return [(data[i:i + 4], data[i + 1:i + 5].reshape(-1)) for i in range(0, 12, 4)]


def _zero_hidden():
    return (torch.zeros(2, 4, 6), torch.zeros(2, 4, 6))


def _train_torch(net, lr):
    hidden, losses = _zero_hidden(), []
    for x, y in _batches():
        net.zero_grad()
        hidden = tuple(h.detach() for h in hidden)  # truncated BPTT (repackage_hidden)
        out, hidden = net(x, hidden)
        loss = F.nll_loss(out, y)
        loss.backward()
        for p in net.parameters():
            p.data.add_(p.grad, alpha=-lr)
        losses.append(loss.item())
    return losses


def _train_dtape(net, lr, update):
    tm = dtape.layers.TorchModule(net)
    hidden, losses = _zero_hidden(), []
    for x, y in _batches():
        hidden = tuple(h.detach() for h in hidden)
        with dtape.GradientTape() as tape:
            out, hidden = tm(x, hidden)
            loss = F.nll_loss(out, y)
        update(list(net.parameters()), tape.gradient(loss, tm.trainable_variables), lr)
        losses.append(loss.item())
    return losses


def _data_add(params, grads, lr):
    for p, g in zip(params, grads):
        p.data.add_(g, alpha=-lr)


def _no_grad_foreach(params, grads, lr):
    with torch.no_grad():
        torch._foreach_add_(params, grads, alpha=-lr)


@pytest.mark.parametrize("update", [_data_add, _no_grad_foreach])
def test_manual_sgd_on_tape_gradients_trains_as_plain_torch(update):
    torch.manual_seed(0)
    net = _CharLM()
    twin = _CharLM()
    twin.load_state_dict(net.state_dict())
    expected = _train_torch(twin, lr=0.5)
    losses = _train_dtape(net, 0.5, update)
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=0)
    for (name, p), q in zip(net.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7, msg=name)
    assert expected[-1] != expected[0]  # the weights moved


def test_torch_target_reads_a_variable_value():
    var = dtape.Variable(torch.tensor([1.0, -2.0]))
    buf = torch.zeros(2)
    assert buf.copy_(var) is buf  # torch's result: the written tensor itself
    torch.testing.assert_close(buf, torch.tensor([1.0, -2.0]))


def test_write_of_a_watched_value_into_a_torch_tensor_in_a_tape_raises():
    x = dtape.constant([1.0, 2.0])
    buf = torch.zeros(2)
    with dtape.GradientTape() as tape:
        tape.watch(x)
        with pytest.raises(TypeError, match="gradient would be lost"):
            buf.add_(x * 3.0)
        buf.add_(dtape.constant([1.0, 1.0]))  # a value no tape watches: written
        with tape.stop_recording():
            buf.add_(x)
    torch.testing.assert_close(buf, torch.tensor([2.0, 3.0]))


def test_an_in_place_method_on_a_dtape_tensor_still_raises():
    with pytest.raises(TypeError, match="immutable"):
        dtape.constant([1.0]).add_(torch.ones(1))


def test_torch_parameters_as_sources_or_target_name_the_wrapper():
    net = nn.Linear(3, 1)
    tm = dtape.layers.TorchModule(net)
    with dtape.GradientTape(persistent=True) as tape:
        loss = dtape.reduce_sum(tm(torch.ones(2, 3)))
        torch_loss = net(torch.ones(2, 3)).sum()  # the module called directly
    with pytest.raises(ValueError, match="trainable_variables"):
        tape.gradient(loss, net.parameters())
    with pytest.raises(ValueError, match="trainable_variables"):
        tape.gradient(loss, [net.weight])
    with pytest.raises(ValueError, match="instead of its dtape.layers.TorchModule wrapper"):
        tape.gradient(torch_loss, tm.trainable_variables)


def _repackage_hidden(h):
    """word_language_model's: detach a tensor, recurse into anything else."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(_repackage_hidden(v) for v in h)


def test_repackage_hidden_of_dtape_tensors_says_what_to_do():
    _, hidden = dtape.layers.TorchModule(nn.LSTM(3, 4))(torch.randn(2, 1, 3))
    with pytest.raises(TypeError, match=r"isinstance\(x, \(torch.Tensor, dtape.Tensor\)\)"):
        _repackage_hidden(hidden)
    detached = dtape.nest.map_structure(dtape.stop_gradient, hidden)
    assert [tuple(h.shape) for h in detached] == [(1, 1, 4), (1, 1, 4)]
