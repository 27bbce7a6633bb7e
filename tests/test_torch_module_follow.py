"""A TorchModule is a view that follows its module: a submodule or parameter replaced after wrapping (the
fine-tuning recipe `model.fc = nn.Linear(...)`) becomes its Variables, and under MirroredStrategy a write made
through torch (torch.nn.init, module.load_state_dict, an in-place op under no_grad) reaches every replica.
References: the same schedule of replacements and writes run by plain torch on one device, in float64."""
import numpy as np
import pytest
import torch
from torch import nn

import dtape
from dtape import distribute as ds
from dtape import torch_module
from _strategies import mirrored

pytestmark = pytest.mark.usefixtures("closes_strategies")
f64 = torch.float64


class Net(nn.Module):
    """body -> BatchNorm (run in eval mode: its buffers are used, not updated) -> tanh -> fc."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(torch.tanh(self.norm(self.body(x))))


def _net(seed=0):
    torch.manual_seed(seed)
    net = Net().double().eval()
    with torch.no_grad():  # buffers away from their defaults: a stale copy shows in the loss
        net.norm.running_mean.copy_(torch.linspace(-0.5, 0.5, 4))
        net.norm.running_var.copy_(torch.linspace(0.5, 2.0, 4))
    return net


def _batch(step):
    return torch.randn(6, 3, dtype=f64, generator=torch.Generator().manual_seed(step))


def _replace(model, seed=1):
    """torchvision's fine-tuning recipe (a new head), and a parameter slot given a new Parameter."""
    torch.manual_seed(seed)
    model.fc = nn.Linear(4, 2).double()
    model.body.weight = nn.Parameter(torch.randn(4, 3, dtype=f64))


def _write(model, kind, state):
    """A write made through torch on the wrapped module itself, outside dtape."""
    if kind == "init":
        torch.manual_seed(7)
        nn.init.normal_(model.fc.weight)
        nn.init.zeros_(model.body.bias)
    elif kind == "load_state_dict":
        model.load_state_dict(state)  # parameters and BatchNorm buffers, in place
    elif kind == "through_data":  # Hugging Face's _init_weights: `.data` moves no version counter of the tensor's
        torch.manual_seed(7)
        model.fc.weight.data.normal_(mean=0.0, std=0.5)
        model.body.bias.data.zero_()
        model.norm.running_var.data.mul_(2.0)
    else:
        with torch.no_grad():
            model.body.weight.mul_(0.5)
            model.norm.running_var.mul_(2.0)


def _strategy(kind):
    return mirrored(2) if kind == "mirrored" else ds.OneDeviceStrategy("cpu")


def _torch_steps(model, opt, first, n):
    out = []
    for step in range(first, first + n):
        opt.zero_grad()
        model(_batch(step)).square().sum().backward()
        opt.step()
        out.append([t.detach().clone() for t in model.state_dict().values()])
    return out


class _Dtape:
    """TorchModule training under `strategy`: sum-of-squares loss, gradients summed over the replicas (the
    global batch's, as torch's); each step lists `trainable_variables` afresh, as a Keras train_step does."""

    def __init__(self, model, strategy):
        self.model, self.strategy = model, strategy
        with strategy.scope():
            self.tm = dtape.layers.TorchModule(model)

    def steps(self, opt, first, n):
        def step(x):
            variables = self.tm.trainable_variables
            with dtape.GradientTape(gradient_sync=ds.GradientSync()) as tape:
                loss = dtape.reduce_sum(dtape.square(self.tm(x)))
            opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        out = []
        for i in range(first, first + n):
            for x in self.strategy.experimental_distribute_dataset([_batch(i).numpy()]):
                self.strategy.run(step, args=(x,))
            out.append([t.detach().clone() for t in self.model.state_dict().values()])
            _assert_view(self.tm)
        return out


def _assert_view(tm):
    """Every replica's component equals the module's own tensor (the view's truth), name by name."""
    own = dict(tm.module.named_parameters(remove_duplicate=False))
    own.update(tm.module.named_buffers(remove_duplicate=False))
    assert len(own) == len(tm._params) + len(tm._buffers)
    for name, var in {**tm._params, **tm._buffers}.items():
        for c in getattr(var, "values", (var,)):
            assert torch.equal(c.torch(), own[name].detach()), (name, c.name)


def _assert_close(got, ref):
    assert len(got) == len(ref)
    for k, (a, b) in enumerate(zip(got, ref)):
        for x, y in zip(a, b):
            np.testing.assert_allclose(x.numpy(), y.numpy(), rtol=1e-11, atol=1e-13, err_msg=f"step {k}")


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "from_torch_adam"])
@pytest.mark.parametrize("kind", ["one", "mirrored"])
def test_replaced_after_wrapping_becomes_the_variables_and_trains_as_torch(kind, optimizer):
    ref = _net()
    _replace(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9) if optimizer == "sgd_momentum" else \
        torch.optim.Adam(ref.parameters(), lr=0.05)
    want = _torch_steps(ref, ref_opt, 0, 3)

    run = _Dtape(_net(), _strategy(kind))
    old = {v.name: v for v in run.tm.trainable_variables}
    _replace(run.model)  # after wrapping
    if optimizer == "sgd_momentum":
        with run.strategy.scope():
            opt = dtape.optimizers.SGD(0.05, momentum=0.9)
    else:  # built over the module's parameters as they are now, as the torch recipe does
        opt = dtape.optimizers.from_torch(torch.optim.Adam(run.tm.parameters(), lr=0.05))
    new = {v.name: v for v in run.tm.trainable_variables}
    assert list(new) == list(old)  # the same torch names, in named_parameters() order
    changed = {n for n in new if new[n] is not old[n]}
    assert changed == {f"{run.tm.name}/{n}" for n in ("body.weight", "fc.weight", "fc.bias")}
    if kind == "mirrored":
        assert all(isinstance(new[n], ds.MirroredVariable) for n in changed)
    _assert_view(run.tm)
    _assert_close(run.steps(opt, 0, 3), want)


@pytest.mark.parametrize("kind", ["one", "mirrored"])
def test_head_replaced_between_steps_is_followed_inside_the_step(kind):
    """Replaced between two steps: under MirroredStrategy the change is first seen inside strategy.run, where
    the replicas make the new MirroredVariables in one merge_call; plain SGD, as a rebuilt torch SGD."""
    ref = _net()
    want = _torch_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), 0, 2)
    _replace(ref, seed=3)
    want += _torch_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1), 2, 2)

    run = _Dtape(_net(), _strategy(kind))
    with run.strategy.scope():
        opt = dtape.optimizers.SGD(0.1)
    got = run.steps(opt, 0, 2)
    _replace(run.model, seed=3)
    got += run.steps(opt, 2, 2)
    _assert_close(got, want)
    # a module built elsewhere moves torch's registration count: one walk, the same Variables
    before = list(run.tm.variables)
    nn.Linear(2, 2)
    assert all(a is b for a, b in zip(run.tm.variables, before)) and len(run.tm.variables) == len(before)


@pytest.mark.parametrize("write", ["init", "load_state_dict", "no_grad_mul", "through_data"])
@pytest.mark.parametrize("kind", ["one", "mirrored"])
def test_torch_side_write_reaches_every_replica_and_trains_as_torch(kind, write):
    """The module is the view's truth: a write to it through torch, between steps, is what every replica
    computes with next (parameters and buffers), with dtape's optimizers (SGD with momentum, Keras's
    formula, which equals torch's at a constant learning rate)."""
    state = {k: v + 0.25 for k, v in _net(5).state_dict().items()}
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    want = _torch_steps(ref, ref_opt, 0, 2)
    _write(ref, write, state)
    want += _torch_steps(ref, ref_opt, 2, 3)

    run = _Dtape(_net(), _strategy(kind))
    with run.strategy.scope():
        opt = dtape.optimizers.SGD(0.05, momentum=0.9)
    got = run.steps(opt, 0, 2)
    _write(run.model, write, state)
    got += run.steps(opt, 2, 3)
    _assert_close(got, want)


def test_torch_write_then_a_dtape_write_before_the_next_call_keeps_the_module_s_value():
    """`p.mul_(0.5)` through torch, then `var.assign_add(1)` through dtape (every component): replica 0's
    component (the module) holds 0.5 p + 1, replica 1's p + 1 until the next call copies the module's value."""
    model = nn.Linear(2, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[2.0, 4.0]]))
    strategy = mirrored(2)
    with strategy.scope():
        tm = dtape.layers.TorchModule(model)
    (var,) = tm.trainable_variables
    with torch.no_grad():
        model.weight.mul_(0.5)
    var.assign_add([[1.0, 1.0]])
    out = strategy.run(lambda: tm(torch.ones(1, 2, dtype=f64)))
    assert [float(t.numpy().item()) for t in strategy.experimental_local_results(out)] == [5.0, 5.0]
    assert [c.numpy().tolist() for c in var.values] == [[[2.0, 3.0]], [[2.0, 3.0]]]


class Tiny(nn.Module):
    """Position embedding, a causal-mask buffer (nanoGPT's shapes) and a Sequential classifier (VGG's)."""

    def __init__(self):
        super().__init__()
        self.wpe = nn.Embedding(8, 3)
        self.register_buffer("mask", torch.tril(torch.ones(8, 8)))
        self.classifier = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 5))

    def forward(self, x):
        t = x.shape[1]
        mask = self.mask[:t, :t]
        return self.classifier((mask / mask.sum(-1, keepdim=True)) @ (x + self.wpe.weight[:t]))


def _recipes(model):
    """Feature extraction (freeze all, new head through Sequential's __setitem__), then nanoGPT's
    crop_block_size (a parameter and a buffer replaced by slices of themselves)."""
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(4)
    model.classifier[2] = nn.Linear(4, 2).double()
    model.wpe.weight = nn.Parameter(model.wpe.weight[:4])
    model.mask = model.mask[:4, :4]


@pytest.mark.parametrize("kind", ["one", "mirrored"])
def test_fine_tuning_and_crop_recipes_after_wrapping_train_as_torch(kind):
    def make():
        torch.manual_seed(0)
        return Tiny().double()
    xs = [torch.randn(2, 4, 3, dtype=f64, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ref = make()
    _recipes(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    want = []
    for x in xs:
        ref_opt.zero_grad()
        ref(x).square().sum().backward()
        ref_opt.step()
        want.append([t.detach().clone() for t in ref.state_dict().values()])

    model, strategy = make(), _strategy(kind)
    with strategy.scope():
        tm = dtape.layers.TorchModule(model)
    _recipes(model)
    opt = dtape.optimizers.from_torch(torch.optim.SGD(tm.parameters(), lr=0.1, momentum=0.9))
    names = [v.name.split("/", 1)[1] for v in tm.trainable_variables]
    assert names == ["wpe.weight", "classifier.2.weight", "classifier.2.bias"]
    assert tuple(tm.state_dict()["mask"].shape) == (4, 4)

    def step(x):
        variables = tm.trainable_variables
        with dtape.GradientTape(gradient_sync=ds.GradientSync()) as tape:
            loss = dtape.reduce_sum(dtape.square(tm(x)))
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    got = []
    for x in xs:
        for part in strategy.experimental_distribute_dataset([x.numpy()]):
            strategy.run(step, args=(part,))
        got.append([t.detach().clone() for t in model.state_dict().values()])
        _assert_view(tm)
    _assert_close(got, want)


def test_torch_side_write_reaches_every_replica_of_a_compiled_step():
    """A compiled step replays its graph without calling the wrapper: the write is copied at strategy.run."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    strategy = mirrored(2)
    with strategy.scope():
        tm = dtape.layers.TorchModule(model)
    x = torch.randn(4, 3, dtype=f64)

    @dtape.function(jit_compile=True)
    def outputs(x):
        return tm(x)
    strategy.run(outputs, args=(x,))
    with torch.no_grad():
        model.weight.mul_(-2.0)
        model.bias.add_(1.0)
    got = strategy.experimental_local_results(strategy.run(outputs, args=(x,)))
    for y in got:
        np.testing.assert_allclose(y.numpy(), model(x).detach().numpy(), rtol=1e-12)


def test_module_grown_after_wrapping_is_followed_inside_strategy_run():
    """Wrapped with nothing mirrored yet, the layer appended after wrapping is first seen inside
    strategy.run: the replicas make its MirroredVariables in one merge_call, then train as torch."""
    ref = nn.Sequential()
    torch.manual_seed(2)
    ref.append(nn.Linear(3, 2).double())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model, strategy = nn.Sequential(), mirrored(2)
    with strategy.scope():
        tm = dtape.layers.TorchModule(model)
        opt = dtape.optimizers.SGD(0.1)
    torch.manual_seed(2)
    model.append(nn.Linear(3, 2).double())  # Sequential.append: add_module

    def step(x):
        with dtape.GradientTape(gradient_sync=ds.GradientSync()) as tape:
            loss = dtape.reduce_sum(dtape.square(tm(x)))
        variables = tm.trainable_variables
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
    for i in range(2):
        x = _batch(i)
        ref_opt.zero_grad()
        ref(x).square().sum().backward()
        ref_opt.step()
        for part in strategy.experimental_distribute_dataset([x.numpy()]):
            strategy.run(step, args=(part,))
        _assert_view(tm)
        _assert_close([list(model.state_dict().values())], [list(ref.state_dict().values())])
    assert all(isinstance(v, ds.MirroredVariable) for v in tm.trainable_variables)


@pytest.mark.parametrize("kind", ["one_device", "mirrored"])
def test_compiled_step_traced_before_a_replacement_retraces_and_trains_the_new_parameters(kind):
    """A graph traced with the old Variables would keep reading and training them (the new head silently
    untrained): the compiled step retraces once the module's parameters are replaced."""
    ref = _net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    want = _torch_steps(ref, ref_opt, 0, 2)
    _replace(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    want += _torch_steps(ref, ref_opt, 2, 2)

    model, strategy = _net(), _strategy(kind)
    run = _Dtape(model, strategy)
    with strategy.scope():
        opt = dtape.optimizers.SGD(0.05)

    @dtape.function(jit_compile=True, backend="aot_eager")
    def step(x):
        variables = run.tm.trainable_variables
        with dtape.GradientTape() as tape:  # apply_gradients all-reduces inside the graph
            loss = dtape.reduce_sum(dtape.square(run.tm(x)))
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

    got = []
    for i in range(4):
        if i == 2:
            _replace(model)
        for x in strategy.experimental_distribute_dataset([_batch(i).numpy()]):
            strategy.run(step, args=(x,))
        got.append([t.detach().clone() for t in model.state_dict().values()])
        _assert_view(run.tm)
    _assert_close(got, want)
    assert step.experimental_get_tracing_count() == 2


def test_a_write_through_data_after_wrapping_before_the_first_step_reaches_every_replica():
    """Wrapped, then initialized through `.data` (a model's own init after construction), then trained with
    from_torch(Adam): every replica starts from the written values, as plain torch does."""
    def init(model):
        torch.manual_seed(3)
        for p in model.parameters():
            p.data.uniform_(-0.3, 0.3)
    ref = _net()
    init(ref)
    want = _torch_steps(ref, torch.optim.Adam(ref.parameters(), lr=0.01), 0, 3)
    run = _Dtape(_net(), mirrored(2))
    init(run.model)
    opt = dtape.optimizers.from_torch(torch.optim.Adam(run.tm.parameters(), lr=0.01))
    _assert_close(run.steps(opt, 0, 3), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool,
                                   torch.complex128, torch.uint8])
def test_bit_sums_tell_a_changed_tensor_from_an_equal_one(dtype):
    """The cross-device compare of the `.data` check: equal tensors (also non-contiguous, 0-d, empty) give
    equal sums; one changed element changes the sum."""
    base = (torch.arange(24, dtype=torch.float64).reshape(4, 6) * 0.37).to(dtype)
    cases = [base, base.t(), base[1], base[0, 0], base[:0]]
    assert torch_module._bit_sums(cases) == torch_module._bit_sums([c.clone() for c in cases])
    changed = base.clone()
    changed[2, 3] = ~changed[2, 3] if dtype is torch.bool else changed[2, 3] + 1
    assert changed[2, 3] != base[2, 3]
    assert torch_module._bit_sums([changed])[0] != torch_module._bit_sums([base])[0]


@pytest.mark.parametrize("replace", ["data_assign", "double", "to_copy"])
@pytest.mark.parametrize("kind", ["one", "mirrored"])
def test_a_parameter_tensor_replaced_after_wrapping_is_refused_not_trained_silently(kind, replace):
    """`p.data = t` (loading pretrained embeddings), `module.double()`, `module.to(...)` swap a parameter's
    storage without a hook: the Variable would keep training the old memory while the module holds the new
    one. The next call (eager or compiled) raises naming the parameter; a write in place is followed."""
    model = Net().float().eval()
    strategy = _strategy(kind)
    with strategy.scope():
        tm = dtape.layers.TorchModule(model)
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(1))
    step = dtape.function(lambda: tm(x), jit_compile=True)
    strategy.run(step)  # traced before the replacement: its replay must not train the old memory either
    if replace == "data_assign":
        model.fc.weight.data = torch.ones(2, 4)
    elif replace == "double":
        model.double()  # refused before any kernel sees float32 inputs with float64 weights
    else:  # a copy of each parameter (what `.to(other device)` does), here to another memory format's twin
        for p in model.parameters():
            p.data = p.data.clone()
    for call in (lambda: strategy.run(step), lambda: strategy.run(lambda: tm(x))):
        with pytest.raises(ValueError, match="was replaced after wrapping"):
            call()


def test_a_parameter_loaded_in_place_through_data_after_wrapping_trains_on_one_device():
    """The in-place form of the same load (`p.data.copy_(t)`) is the module's own storage: the Variable holds it."""
    model = _net()
    tm = dtape.layers.TorchModule(model)
    model.fc.weight.data.copy_(torch.ones(2, 4, dtype=f64))
    assert torch.equal(tm._params["fc.weight"].torch(), torch.ones(2, 4, dtype=f64))
    out = tm(torch.ones(1, 3, dtype=f64)).torch()
    assert torch.equal(out, model(torch.ones(1, 3, dtype=f64)).detach())
