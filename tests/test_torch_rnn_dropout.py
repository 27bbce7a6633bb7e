"""nn.LSTM / nn.GRU / nn.RNN dropout between layers under MirroredStrategy replicas.

The recurrent kernels (`_VF.lstm`, ...) draw their masks inside the kernel from
torch's global generator; the replicas' forwards run at once on threads, so
those draws were neither the replica's stream nor reproducible (the
word_language_model example's 2-layer LSTM with dropout, ported). They now run
on a private stream seeded from the replica's generator, as F.dropout does.
"""
import pytest
import torch
from torch import nn

import _strategies
import dtape

pytestmark = pytest.mark.usefixtures("closes_strategies")


def _replica_outputs(make_rnn, seed):
    torch.manual_seed(0)
    rnn = make_rnn()
    strategy = _strategies.mirrored(2)
    for i in range(2):
        strategy.replica_generator(i).manual_seed(seed + i)
    with strategy.scope():
        tm = dtape.layers.TorchModule(rnn)
    x = torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(1))
    halves = strategy.experimental_distribute_values_from_function(
        lambda ctx: x[:, 2 * ctx.replica_id_in_sync_group:2 * ctx.replica_id_in_sync_group + 2])
    before = torch.get_rng_state()
    out = strategy.run(lambda h: tm(h, training=True)[0], args=(halves,))
    assert torch.equal(torch.get_rng_state(), before)  # torch's own generator drew nothing
    return rnn, x, [o.torch() for o in strategy.experimental_local_results(out)]


@pytest.mark.parametrize("make_rnn", [lambda: nn.LSTM(3, 6, 2, dropout=0.5), lambda: nn.GRU(3, 6, 3, dropout=0.4),
                                      lambda: nn.RNN(3, 6, 2, dropout=0.5, nonlinearity="relu")])
def test_rnn_dropout_draws_the_replica_stream(make_rnn):
    rnn, x, outs = _replica_outputs(make_rnn, seed=11)
    for i, out in enumerate(outs):
        gen = torch.Generator().manual_seed(11 + i)  # the replica's generator: one draw seeds the call's stream
        torch.manual_seed(int(torch.randint(0, 2**62, (), generator=gen)))
        expected, _ = rnn(x[:, 2 * i:2 * i + 2])
        torch.testing.assert_close(out, expected.detach(), rtol=1e-6, atol=1e-7)  # the same masks
    assert not torch.equal(outs[0], rnn.eval()(x[:, :2])[0].detach())  # masks were drawn
    _, _, again = _replica_outputs(make_rnn, seed=11)
    assert all(torch.equal(a, b) for a, b in zip(outs, again))


def test_one_layer_or_eval_rnn_takes_no_seed():
    _, x, outs = _replica_outputs(lambda: nn.LSTM(3, 6, 1), seed=3)
    strategy = _strategies.mirrored(2)
    states = [g.get_state() for g in (strategy.replica_generator(0), strategy.replica_generator(1))]
    with strategy.scope():
        tm = dtape.layers.TorchModule(nn.LSTM(3, 6, 2, dropout=0.5))
    strategy.run(lambda: tm(x[:, :2], training=False))
    assert all(torch.equal(g.get_state(), s)
               for g, s in zip((strategy.replica_generator(0), strategy.replica_generator(1)), states))


class _LockedDropout(nn.Module):
    """AWD-LSTM's dropout: one mask per sequence, drawn by the forward itself."""

    def __init__(self, draw):
        super().__init__()
        self.draw = draw

    def forward(self, x):
        return x * self.draw(x)


_MASKS = [lambda x: x.new_empty(1, *x.shape[1:]).bernoulli_(0.5) * 2.0,
          lambda x: (torch.rand(1, *x.shape[1:]) < 0.5).float() * 2.0,
          lambda x: torch.randn(1, *x.shape[1:], device=x.device)]


@pytest.mark.parametrize("draw", _MASKS)
def test_masks_a_forward_draws_itself_take_the_replica_stream(draw):
    _, x, outs = _replica_outputs(lambda: _LockedDropout(draw), seed=5)
    for i, out in enumerate(outs):
        gen = torch.Generator().manual_seed(5 + i)
        torch.manual_seed(int(torch.randint(0, 2**62, (), generator=gen)))
        half = x[:, 2 * i:2 * i + 2]
        torch.testing.assert_close(out, (half * draw(half))[0], rtol=0, atol=0)  # _replica_outputs takes [0]
    _, _, again = _replica_outputs(lambda: _LockedDropout(draw), seed=5)
    assert all(torch.equal(a, b) for a, b in zip(outs, again))


def test_a_draw_from_the_callers_generator_takes_no_seed():
    strategy = _strategies.mirrored(2)
    state = strategy.replica_generator(0).get_state()
    with strategy.scope():
        tm = dtape.layers.TorchModule(_LockedDropout(
            lambda x: torch.rand(x.shape, generator=torch.Generator().manual_seed(0))))
    out = strategy.experimental_local_results(strategy.run(lambda: tm(torch.ones(2, 3))))
    torch.testing.assert_close(out[0].torch(), torch.rand(2, 3, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(strategy.replica_generator(0).get_state(), state)
