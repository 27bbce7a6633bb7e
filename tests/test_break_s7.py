"""Breaking the `.data` follow of a TorchModule under MirroredStrategy (`_Follow.untracked`): writes through
`.data` move no version counter, so the module's tensor (replica 0's component) is compared by value with
another replica's. Each case against plain torch on one device, float64, the same schedule."""
import numpy as np
import pytest
import torch

import dtape
from dtape import distribute as ds
from _strategies import mirrored
from test_torch_module_follow import _Dtape, _assert_close, _assert_view, _batch, _net, _torch_steps

pytestmark = pytest.mark.usefixtures("closes_strategies")
f64 = torch.float64


class _Run(_Dtape):
    def __init__(self, model, strategy, **kwargs):  # TorchModule's keyword arguments too
        self.model, self.strategy = model, strategy
        with strategy.scope():
            self.tm = dtape.layers.TorchModule(model, **kwargs)


def _sgd(run, **kw):
    with run.strategy.scope():
        return dtape.optimizers.SGD(0.05, **kw)


def test_data_write_after_tm_load_state_dict_reaches_every_replica():
    """`tm.load_state_dict` writes every component through dtape; a `.data` write to a tensor no step writes
    (an eval-mode BatchNorm buffer, a frozen parameter) one step later was never compared again."""
    state = {k: v + 0.25 for k, v in _net(5).state_dict().items()}

    def write(model):
        model.norm.running_var.data.mul_(2.0)
        model.body.bias.data.fill_(0.3)
    ref = _net()
    ref.body.bias.requires_grad_(False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    ref.load_state_dict(state)
    want = _torch_steps(ref, ref_opt, 0, 1)
    write(ref)
    want += _torch_steps(ref, ref_opt, 1, 2)

    run = _Dtape(_net(), mirrored(2))
    run.model.body.bias.requires_grad_(False)
    opt = _sgd(run)
    run.tm.load_state_dict(state)
    got = run.steps(opt, 0, 1)
    write(run.model)
    got += run.steps(opt, 1, 2)
    _assert_close(got, want)


def test_dtape_assign_then_data_write_in_the_same_gap_reaches_every_replica():
    """`var.assign` (every component) then `p.data.mul_` before the next step: replica 0 holds the product."""
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    want = _torch_steps(ref, ref_opt, 0, 1)
    with torch.no_grad():
        ref.fc.bias.fill_(0.5)
    ref.fc.bias.data.mul_(3.0)
    want += _torch_steps(ref, ref_opt, 1, 2)

    run = _Dtape(_net(), mirrored(2))
    opt = _sgd(run, momentum=0.9)
    got = run.steps(opt, 0, 1)
    run.tm._params["fc.bias"].assign(torch.full((2,), 0.5, dtype=f64))
    run.model.fc.bias.data.mul_(3.0)
    got += run.steps(opt, 1, 2)
    _assert_close(got, want)


def _step(tm, opt):
    def step(x):
        variables = tm.trainable_variables
        with dtape.GradientTape(gradient_sync=ds.GradientSync()) as tape:
            loss = dtape.reduce_sum(dtape.square(tm(x)))
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    return step


def test_a_component_written_on_its_own_stays_its_own_through_training_steps():
    """`values[1].assign(b)` is not compared (documented: kept, as TF keeps it); the steps' updates then write
    both components alike, which must not make the next run copy replica 0's over it."""
    run = _Dtape(_net(), mirrored(2))
    opt = _sgd(run)
    var = run.tm._params["fc.bias"]
    var.values[1].assign(torch.full((2,), 0.5, dtype=f64))
    gap = []
    for i in range(3):
        for x in run.strategy.experimental_distribute_dataset([_batch(i).numpy()]):
            run.strategy.run(_step(run.tm, opt), args=(x,))
        gap.append(var.values[1].numpy() - var.values[0].numpy())
    assert np.abs(gap[0]).min() > 0.1
    assert all(np.abs(g).min() > 0.1 for g in gap[1:])


class _Reciprocal(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(2, dtype=f64))
        self.register_buffer("shift", torch.zeros(2, dtype=f64))

    def forward(self, x):
        return x / self.scale + self.shift


def test_a_data_write_of_minus_zero_or_nan_is_followed_by_its_bits():
    """`.data` turns 0.0 into -0.0 (1/w: -inf in torch): torch.equal calls them equal, so replica 1 kept
    +inf; a NaN is copied once, not again at every step (NaN != NaN)."""
    model, strategy = _Reciprocal().eval(), mirrored(2)
    with strategy.scope():
        tm = dtape.layers.TorchModule(model)
    x = torch.ones(1, 2, dtype=f64)
    model.scale.data[0] = 0.0
    strategy.run(lambda: tm(x))
    model.scale.data[0] = -0.0
    model.shift.data[1] = float("nan")
    outs = strategy.experimental_local_results(strategy.run(lambda: tm(x)))
    want = model(x).detach()
    assert want[0, 0].item() == float("-inf")
    for out in outs:
        np.testing.assert_array_equal(out.numpy(), want.numpy())
    versions = [c._t._version for c in tm._buffers["shift"].values]
    strategy.run(lambda: tm(x))
    assert [c._t._version for c in tm._buffers["shift"].values] == versions


@pytest.mark.parametrize("sync", ["mean", "broadcast"])
def test_data_write_to_training_batchnorm_buffers_equals_the_same_write_under_no_grad(sync):
    """BatchNorm in training mode (each step writes its running stats on every replica, combined as
    `sync_buffers` says): a `.data` write between steps trains as the same write made under no_grad
    (followed by its version counter), bit for bit."""
    def write(model, through_data):
        gen = torch.Generator().manual_seed(1)
        if through_data:
            model.norm.running_mean.data.add_(1.0)
            model.fc.weight.data.normal_(generator=gen)
        else:
            with torch.no_grad():
                model.norm.running_mean.add_(1.0)
                model.fc.weight.normal_(generator=gen)

    def train(through_data):
        model, strategy = _net().train(), mirrored(2)
        run = _Run(model, strategy, sync_buffers=sync)
        opt = _sgd(run, momentum=0.9)
        out = run.steps(opt, 0, 2)
        write(model, through_data)
        return out + run.steps(opt, 2, 2)
    got, want = train(True), train(False)
    for a, b in zip(got, want):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


class _Tied(torch.nn.Module):
    """GPT-2's tied embedding and head (one Parameter, two names)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5, 3)
        self.mix = torch.nn.Linear(3, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mix(self.emb(x).sum(1))))


def test_tied_weight_data_write_with_a_no_grad_write_in_the_same_gap_trains_as_torch_adamw():
    """HF's `_init_weights` on the tied weight (through `.data`) plus a no_grad write of another parameter,
    one gap; from_torch(AdamW) as the torch reference's optimizer."""
    def make():
        torch.manual_seed(0)
        return _Tied().double()

    def write(model):
        model.head.weight.data.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            model.mix.bias.mul_(-2.0)
    xs = [torch.randint(0, 5, (4, 2), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    ref = make()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    model, strategy = make(), mirrored(2)
    with strategy.scope():
        tm = dtape.layers.TorchModule(model)
    opt = dtape.optimizers.from_torch(torch.optim.AdamW(tm.parameters(), lr=0.01))
    for i, x in enumerate(xs):
        if i == 2:
            write(ref)
            write(model)
        ref_opt.zero_grad()
        ref(x).square().sum().backward()
        ref_opt.step()
        for part in strategy.experimental_distribute_dataset([x.numpy()]):
            strategy.run(_step(tm, opt), args=(part,))
        _assert_view(tm)
        _assert_close([list(model.state_dict().values())], [list(ref.state_dict().values())])


def test_tm_load_state_dict_after_a_component_written_on_its_own_follows_data_writes_again():
    """`values[1].assign(b)` leaves its view unnoted; `tm.load_state_dict` makes every component equal
    again, so a later `.data` write to that tensor (an eval-mode buffer no step writes) is followed."""
    state = {k: v + 0.25 for k, v in _net(5).state_dict().items()}
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    ref.load_state_dict(state)
    ref.norm.running_var.data.mul_(2.0)
    want = _torch_steps(ref, ref_opt, 0, 2)

    run = _Dtape(_net(), mirrored(2))
    opt = _sgd(run)
    run.tm._buffers["norm.running_var"].values[1].assign(torch.full((4,), 9.0, dtype=f64))
    run.strategy.run(lambda: None)
    run.tm.load_state_dict(state)
    run.model.norm.running_var.data.mul_(2.0)
    _assert_close(run.steps(opt, 0, 2), want)
