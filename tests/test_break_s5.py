"""Attacks on this session's additions, used as a PyTorch user would use them: a TorchModule following its
module (re-tied weights, two wrappers of one module, torch writes in the idioms of real init code and training
loops), reentrant checkpoints on some calls only, wrong upstream gradients, profiled runs that raise, and a
replacement made by one replica only. References: plain torch in float64 on one device, or the expected error."""
import threading

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import dtape
from dtape import distribute as ds
from _strategies import mirrored

pytestmark = pytest.mark.usefixtures("closes_strategies")
f64 = torch.float64


def _batch(step, shape=(4, 3)):
    return torch.randn(*shape, dtype=f64, generator=torch.Generator().manual_seed(step))


def _strategy(kind):
    return mirrored(2) if kind == "mirrored" else ds.OneDeviceStrategy("cpu")


def _train(strategy, tm, opt, batches, after_apply=None):
    """Sum-of-squares steps; `after_apply()` runs in every replica after apply_gradients (a torch loop's code)."""
    def step(x):
        variables = tm.trainable_variables
        with dtape.GradientTape(gradient_sync=ds.GradientSync()) as tape:
            loss = dtape.reduce_sum(dtape.square(tm(x)))
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        if after_apply is not None:
            after_apply()
    for b in batches:
        for x in strategy.experimental_distribute_dataset([b.numpy()]):
            strategy.run(step, args=(x,))


def _torch_train(model, opt, batches, after_apply=None):
    for b in batches:
        opt.zero_grad()
        model(b).square().sum().backward()
        opt.step()
        if after_apply is not None:
            after_apply()


def _assert_replicas(tm, ref):
    """Every component of every Variable equals plain torch's parameter of the same name."""
    want = dict(ref.named_parameters(remove_duplicate=False))
    for name, var in tm._params.items():
        for k, c in enumerate(getattr(var, "values", (var,))):
            np.testing.assert_allclose(c.torch().numpy(), want[name].detach().numpy(), rtol=1e-11, atol=1e-13,
                                       err_msg=f"{name}, replica {k}")


class TiedLM(nn.Module):
    """nanoGPT's weight tying: lm_head.weight is wte.weight."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(5, 3)
        self.lm_head = nn.Linear(3, 5, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        return self.lm_head(torch.tanh(self.wte(idx)))


def _retie(model):
    torch.manual_seed(3)
    model.wte = nn.Embedding(5, 3).double()
    model.lm_head.weight = model.wte.weight


@pytest.mark.parametrize("kind", ["one", "mirrored"])
def test_tied_weights_replaced_and_retied_after_wrapping_train_as_one_parameter(kind):
    idx = [torch.tensor([[0, 1, 2, 3], [4, 3, 2, 1]]), torch.tensor([[1, 1, 0, 4], [2, 3, 0, 0]])]
    torch.manual_seed(0)
    ref = TiedLM().double()
    _retie(ref)
    _torch_train(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), idx)

    torch.manual_seed(0)
    model = TiedLM().double()
    strategy = _strategy(kind)
    with strategy.scope():
        tm = dtape.layers.TorchModule(model)
        opt = dtape.optimizers.SGD(0.1, momentum=0.9)
    _retie(model)
    _train(strategy, tm, opt, idx)
    assert len(tm.trainable_variables) == 1 and tm._params["wte.weight"] is tm._params["lm_head.weight"]
    assert model.lm_head.weight is model.wte.weight
    _assert_replicas(tm, ref)


def test_one_module_wrapped_twice_sums_both_uses_as_torch():
    """Two TorchModules of one module: their Variables are views of the same tensors; the gradients of both
    uses applied one after the other give torch's single step over the summed gradient (plain SGD)."""
    torch.manual_seed(0)
    ref = nn.Linear(3, 2).double()
    model = nn.Linear(3, 2).double()
    model.load_state_dict(ref.state_dict())
    x = _batch(0)
    (ref(x).square().sum() + ref(x).sum()).backward()
    with torch.no_grad():
        for p in ref.parameters():
            p.sub_(0.1 * p.grad)

    first, second = dtape.layers.TorchModule(model), dtape.layers.TorchModule(model)
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_sum(dtape.square(first(x))) + dtape.reduce_sum(second(x))
    variables = [*first.trainable_variables, *second.trainable_variables]
    dtape.optimizers.SGD(0.1).apply_gradients(zip(tape.gradient(loss, variables), variables))
    for a, b in zip(model.parameters(), ref.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-12, atol=1e-14)


def test_init_through_data_between_steps_reaches_every_replica():
    """The init idiom of Hugging Face's and older torch code, in place through `.data`, between two steps."""
    torch.manual_seed(0)
    ref = nn.Linear(3, 2).double()
    model = nn.Linear(3, 2).double()
    model.load_state_dict(ref.state_dict())

    def init(m):
        torch.manual_seed(7)
        m.weight.data.normal_(mean=0.0, std=0.02)
        m.bias.data.zero_()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _torch_train(ref, ref_opt, [_batch(0)])
    init(ref)
    _torch_train(ref, ref_opt, [_batch(1)])

    strategy = mirrored(2)
    with strategy.scope():
        tm = dtape.layers.TorchModule(model)
        opt = dtape.optimizers.SGD(0.1)
    _train(strategy, tm, opt, [_batch(0)])
    init(model)
    _train(strategy, tm, opt, [_batch(1)])
    _assert_replicas(tm, ref)


@pytest.mark.parametrize("optimizer", ["dtape", "from_torch"])
def test_torch_write_by_every_replica_inside_the_step_is_torch_s_or_refused(optimizer):
    torch.manual_seed(0)
    ref = nn.Linear(3, 2).double()
    model = nn.Linear(3, 2).double()
    model.load_state_dict(ref.state_dict())

    def decay(m):
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(0.9)
    batches = [_batch(0), _batch(1)]
    _torch_train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), batches, lambda: decay(ref))

    strategy = mirrored(2)
    with strategy.scope():
        tm = dtape.layers.TorchModule(model)
        opt = dtape.optimizers.SGD(0.1) if optimizer == "dtape" else \
            dtape.optimizers.from_torch(torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        _train(strategy, tm, opt, batches, lambda: decay(model))
    except ValueError as e:  # a refusal naming the write is a correct answer too
        assert "strategy.run" in str(e), e
        return
    _assert_replicas(tm, ref)


def test_replacement_made_by_one_replica_only_raises_naming_merge_call_instead_of_hanging():
    """Replica 0 replaces the head after replica 1 has called the module: replica 0 rebuilds the Variables in
    a merge_call that replica 1 never makes (it is in the gradients' all-reduce); the strategy's timeout ends
    it with an error naming both places, not a hang."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    strategy = ds.MirroredStrategy(["cpu:0", "cpu:1"], timeout=5)
    try:
        with strategy.scope():
            tm = dtape.layers.TorchModule(model)
            opt = dtape.optimizers.SGD(0.1)
        called = threading.Event()

        def step(x):
            rid = ds.get_replica_context().replica_id_in_sync_group
            if rid == 0:
                assert called.wait(30)
                model[2] = nn.Linear(4, 2).double()
            variables = tm.trainable_variables
            with dtape.GradientTape() as tape:
                loss = dtape.reduce_sum(dtape.square(tm(x)))
            if rid == 1:
                called.set()
            opt.apply_gradients(zip(tape.gradient(loss, variables), variables))

        with pytest.raises(TimeoutError, match=r"replicas \[0\] are waiting in merge_call"):
            for x in strategy.experimental_distribute_dataset([_batch(0).numpy()]):
                strategy.run(step, args=(x,))
    finally:
        strategy.close()


class _SometimesCheckpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.reentrant = nn.Linear(3, 3), nn.Linear(3, 2), False

    def forward(self, x):
        inner = lambda t: torch.tanh(self.a(t))  # noqa: E731
        h = checkpoint(inner, x, use_reentrant=True) if self.reentrant else inner(x)
        return self.b(h)


def test_reentrant_checkpoint_on_some_calls_only_gives_torch_s_gradients():
    torch.manual_seed(0)
    model = _SometimesCheckpointed().double()
    tm = dtape.layers.TorchModule(model)
    x = _batch(0)
    for reentrant in (False, True, False, True):
        model.reentrant = reentrant
        xd = dtape.constant(x.numpy())
        with dtape.GradientTape() as tape:
            tape.watch(xd)
            loss = dtape.reduce_sum(dtape.square(tm(xd)))
        got = tape.gradient(loss, [xd, *tm.trainable_variables])
        model.zero_grad()
        xr = x.clone().requires_grad_()
        model(xr).square().sum().backward()
        want = [xr.grad, *[p.grad for p in model.parameters()]]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.torch().numpy(), w.numpy(), rtol=1e-12, atol=1e-14, err_msg=str(reentrant))


@pytest.mark.parametrize("shape", [(4, 2), (2,), (1, 1)])
def test_upstream_gradient_of_broadcastable_wrong_shape_is_refused(shape):
    """torch's engine would sum a larger broadcastable upstream gradient down to the output's shape; the
    fallback's direct engine call must keep autograd.grad's shape check."""
    torch.manual_seed(0)
    tm = dtape.layers.TorchModule(nn.Linear(3, 2).double())
    w = dtape.Variable(np.ones(3))
    with dtape.GradientTape() as tape:
        y = tm(dtape.reshape(w, (1, 3)))
    with pytest.raises(RuntimeError, match=r"Mismatch in shape"):
        tape.gradient(y, w, output_gradients=dtape.constant(np.ones(shape)))


def test_profiled_run_that_raises_in_one_replica_leaves_the_next_profile_and_autocast_right():
    strategy = mirrored(2)
    x = dtape.constant(np.ones((2, 2), np.float32))

    def failing(t):
        out = dtape.matmul(t, t)
        if ds.get_replica_context().replica_id_in_sync_group == 1:
            raise ValueError("boom in replica 1")
        return out

    def marked(t):
        with torch.profiler.record_function("attack_mark"):
            return dtape.matmul(t, t)

    with pytest.raises(ValueError, match="boom in replica 1"):
        with torch.profiler.profile():
            strategy.run(failing, args=(x,))
    with torch.profiler.profile(record_shapes=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            profiled = strategy.run(marked, args=(x,))
    marks = [e for e in prof.events() if e.name == "attack_mark"]
    assert len(marks) == 2 and len({e.thread for e in marks}) == 2
    assert [v.dtype for v in profiled.values] == [dtape.bfloat16] * 2
    plain = strategy.run(marked, args=(x,))  # no profiler, no autocast: float32, nothing recorded anywhere
    assert [v.dtype for v in plain.values] == [dtape.float32] * 2
    np.testing.assert_array_equal(plain.values[1].numpy(), np.full((2, 2), 2.0, np.float32))


@pytest.mark.parametrize("how", ["none", "del"])
@pytest.mark.parametrize("kind", ["one", "mirrored"])
def test_parameter_removed_after_wrapping_is_refused_not_used_stale(kind, how):
    """`layer.bias = None` (or `del layer.bias`) registers nothing, so torch's hooks never tell the TorchModule;
    the forward used to put the old bias back in the call's copy of the module and train it, silently."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    strategy = _strategy(kind)
    with strategy.scope():
        tm = dtape.layers.TorchModule(model)
        opt = dtape.optimizers.SGD(0.1)
    if how == "none":
        model[2].bias = None
    else:
        del model[2].bias
    with pytest.raises(ValueError, match=r"parameter '2\.bias' was removed from the module after wrapping"):
        _train(strategy, tm, opt, [_batch(0)])
    if how == "del":  # Linear's forward then fails in torch itself (no attribute 'bias')
        return
    # wrapped again, it trains as torch without the bias
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    ref[2].bias = None
    _torch_train(ref, torch.optim.SGD(ref.parameters(), lr=0.1), [_batch(0), _batch(1)])
    with strategy.scope():
        tm = dtape.layers.TorchModule(model)
        opt = dtape.optimizers.SGD(0.1)
    _train(strategy, tm, opt, [_batch(0), _batch(1)])
    assert len(tm.trainable_variables) == 3
    _assert_replicas(tm, ref)


def test_parameter_removed_after_a_compiled_trace_is_refused_or_followed():
    """A compiled step traced with the bias, then `bias = None`: the next call refuses (or follows), never
    replays the traced bias."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    tm = dtape.layers.TorchModule(model)
    opt = dtape.optimizers.SGD(0.1)

    @dtape.function(jit_compile=True)
    def step(x):
        variables = tm.trainable_variables
        with dtape.GradientTape() as tape:
            out = tm(x)
            loss = dtape.reduce_sum(dtape.square(out))
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return out

    for k in range(3):  # traced, then replayed
        step(dtape.constant(_batch(0).numpy()))
    model[2].bias = None
    x = _batch(1)
    want = model(x).detach().numpy()
    try:
        got = step(dtape.constant(x.numpy()))
    except ValueError as e:
        assert "'2.bias' was removed" in str(e), e
        print("refused")
        return
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-14)
