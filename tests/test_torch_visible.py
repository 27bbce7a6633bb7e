"""dtape seen from torch: profiler ranges and replica threads, torch's tensor methods on variables,
and the torch idioms that take dtape tensors (a GradScaler-style scale, .item() for logging)."""
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import _strategies
import dtape

pytestmark = pytest.mark.usefixtures("closes_strategies")
CPU = [torch.profiler.ProfilerActivity.CPU]
ALL_THREADS = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)


def _train_step(net, opt, x):
    def step():
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(net(x) ** 2)
        grads = tape.gradient(loss, net.trainable_variables)
        opt.apply_gradients(zip(grads, net.trainable_variables))
        return loss
    return step


def _mirrored_model():
    strategy = _strategies.mirrored(2)
    with strategy.scope():
        torch.manual_seed(0)
        net = dtape.layers.TorchModule(nn.Linear(4, 3))
        opt = dtape.optimizers.SGD(0.1)
    return strategy, net, opt


def test_profiler_recording_all_threads_shows_replica_ops_and_named_ranges():
    strategy, net, opt = _mirrored_model()
    x = dtape.constant(np.ones((2, 4), np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a profiler that records every thread gets no warning
        with torch.profiler.profile(activities=CPU, experimental_config=ALL_THREADS) as prof:
            strategy.run(_train_step(net, opt, x))
    counts = {e.key: e.count for e in prof.key_averages()}
    # per replica: one walk, one bucket's all-reduce (two parameters, one bucket), one optimizer update
    assert counts.get("dtape.gradient") == 2
    assert counts.get("dtape.all_reduce") == 2
    assert counts.get("dtape.apply_gradients") == 2
    threads = {e.thread for e in prof.events() if e.name == "aten::addmm"}
    assert len(threads) == 2, threads  # the forward's matmul ran on both replica threads


def test_default_profiler_records_replica_threads_without_a_warning():
    """strategy.run carries a default profiler's thread-local state into its replica threads
    (tests/distribute/test_profiler_threads.py checks it in depth)."""
    strategy, net, opt = _mirrored_model()
    x = dtape.constant(np.ones((2, 4), np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.profiler.profile(activities=CPU) as prof:
            strategy.run(_train_step(net, opt, x))
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("dtape.gradient") == 2 and counts.get("dtape.apply_gradients") == 2
    assert len({e.thread for e in prof.events() if e.name == "aten::addmm"}) == 2


def test_profiler_ranges_of_a_single_process_step():
    torch.manual_seed(0)
    net = dtape.layers.TorchModule(nn.Linear(4, 3))
    opt = dtape.optimizers.SGD(0.1)
    x = dtape.constant(np.ones((2, 4), np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.profiler.profile(activities=CPU) as prof:
            _train_step(net, opt, x)()
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("dtape.gradient") == 1 and counts.get("dtape.apply_gradients") == 1
    assert counts.get("aten::addmm", 0) >= 1


# -- torch.Tensor methods on variables ---------------------------------------------------------------

def test_variable_has_the_tensor_methods():
    values = [[1.0, -2.0], [3.0, 0.5]]
    v = dtape.Variable(values, dtype=torch.float64)
    ref = torch.tensor(values, dtype=torch.float64, requires_grad=True)

    def f(t):
        return ((t.view(4) * t.reshape(1, 4)).sum() + t.to(torch.float32).double().sum() * t.mean()
                + t.t().abs().sum() + t.T[0].sum() + t.clone().pow(3).sum())
    with dtape.GradientTape() as tape:
        y = f(v)
    (expected,) = torch.autograd.grad(f(ref), [ref])
    np.testing.assert_allclose(float(y), f(ref).item(), rtol=1e-12)
    np.testing.assert_allclose(tape.gradient(y, v).numpy(), expected.numpy(), rtol=1e-12)
    assert v.size() == torch.Size([2, 2]) and v.dim() == 2 and v.numel() == 4
    assert v.tolist() == values and dtape.Variable(2.5).item() == 2.5
    assert isinstance(v.sum(), dtape.Tensor) and v.to(torch.float32).dtype == torch.float32


# torch.Tensor methods as nanoGPT / pytorch/examples call them, with their arguments: (name, args).
_DIFFERENTIABLE_METHODS = [
    ("view", (6,)), ("view", (3, -1)), ("reshape", (1, 6)), ("sum", ()), ("sum", (1,)), ("mean", (0,)),
    ("t", ()), ("transpose", (0, 1)), ("permute", (1, 0)), ("flatten", ()), ("unsqueeze", (0,)),
    ("squeeze", ()), ("expand", (2, 2, 3)), ("repeat", (2, 1)), ("contiguous", ()), ("clone", ()),
    ("to", (torch.float32,)), ("double", ()), ("float", ()), ("abs", ()), ("pow", (2,)), ("exp", ()),
    ("softmax", (-1,)), ("log_softmax", (-1,)), ("masked_fill", (torch.tensor([[True, False, False]]), 0.0)),
    ("clamp", (-1.0, 1.0)), ("norm", ()), ("max", ()), ("amax", (1,)), ("cumsum", (1,)), ("prod", ()),
    ("matmul", (torch.ones(3, 2, dtype=torch.float64),)), ("narrow", (1, 0, 2)), ("select", (0, 1)),
    ("flip", (0,)), ("roll", (1, 1)), ("tanh", ()), ("relu", ()), ("sigmoid", ()), ("square", ()),
]
_VALUE_METHODS = [
    ("size", ()), ("size", (1,)), ("dim", ()), ("numel", ()), ("nelement", ()), ("tolist", ()),
    ("is_floating_point", ()), ("is_contiguous", ()), ("element_size", ()), ("stride", ()), ("argmax", ()),
    ("isfinite", ()), ("eq", (0.5,)), ("all", ()), ("any", ()), ("long", ()), ("bool", ()),
]
_PROPERTIES = ["shape", "dtype", "device", "ndim", "T", "mT", "is_cuda", "layout", "requires_grad"]


def _values(x):
    return x.numpy() if isinstance(x, dtape.Tensor) else x


@pytest.mark.parametrize("name,args", _DIFFERENTIABLE_METHODS, ids=[n for n, _ in _DIFFERENTIABLE_METHODS])
def test_variable_tensor_method_gives_tensors_value_and_torchs_gradient(name, args):
    values = [[0.5, -1.5, 2.0], [3.0, -0.25, 1.0]]
    v = dtape.Variable(values, dtype=torch.float64)
    t = dtape.constant(values, dtype=torch.float64)
    ref = torch.tensor(values, dtype=torch.float64, requires_grad=True)
    with dtape.GradientTape() as tape:
        y = getattr(v, name)(*args)
        total = dtape.reduce_sum(y * y)  # a non-uniform upstream gradient
    expected = getattr(ref, name)(*args)
    (ref_grad,) = torch.autograd.grad((expected * expected).sum(), [ref])
    assert isinstance(y, dtape.Tensor)
    np.testing.assert_allclose(y.numpy(), getattr(t, name)(*args).numpy(), rtol=0, atol=0)
    np.testing.assert_allclose(y.numpy(), expected.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(tape.gradient(total, v).numpy(), ref_grad.numpy(), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name,args", _VALUE_METHODS, ids=[n for n, _ in _VALUE_METHODS])
def test_variable_tensor_method_answers_as_the_tensor(name, args):
    values = [[0.5, -1.5, 2.0], [3.0, -0.25, 1.0]]
    v = dtape.Variable(values, dtype=torch.float64)
    t = dtape.constant(values, dtype=torch.float64)
    got, want = getattr(v, name)(*args), getattr(t, name)(*args)
    assert type(got) is type(want)
    np.testing.assert_array_equal(_values(got), _values(want))
    np.testing.assert_array_equal(_values(got), _values(getattr(torch.tensor(values, dtype=torch.float64), name)(*args)))


@pytest.mark.parametrize("name", _PROPERTIES)
def test_variable_tensor_property_answers_as_the_tensor(name):
    values = [[0.5, -1.5, 2.0], [3.0, -0.25, 1.0]]
    v = dtape.Variable(values, dtype=torch.float64)
    t = dtape.constant(values, dtype=torch.float64)
    got, want = getattr(v, name), getattr(t, name)
    assert type(got) is type(want)
    np.testing.assert_array_equal(_values(got), _values(want))


def test_variable_attribute_errors_stay_attribute_errors():
    v = dtape.Variable([1.0])
    for name in ("_no_such", "no_such_method", "values"):
        with pytest.raises(AttributeError, match=name):
            getattr(v, name)
    assert not hasattr(v, "values")  # dtape duck-types distributed values on `.values`


def test_mirrored_variable_has_the_tensor_methods():
    strategy = _strategies.mirrored(2)
    with strategy.scope():
        v = dtape.Variable([1.0, 2.0])
    sums = strategy.experimental_local_results(strategy.run(lambda: v.view(2, 1).sum() * 1.0))
    assert [float(s) for s in sums] == [3.0, 3.0]
    assert v.size() == torch.Size([2]) and v.tolist() == [1.0, 2.0]


# -- torch idioms that take dtape tensors --------------------------------------------------------------

class StyleScaler:
    """A loss scaler written as torch.amp.GradScaler.scale is, for torch tensors."""

    def __init__(self, init_scale=2.0 ** 16):
        self.init_scale, self._scale = init_scale, None

    def scale(self, outputs):
        if self._scale is None:
            self._scale = torch.full((), self.init_scale, dtype=torch.float32, device=outputs.device)
        return outputs * self._scale.to(device=outputs.device, non_blocking=True)


def test_gradscaler_style_scale_of_a_dtape_loss():
    v = dtape.Variable([1.0, -2.0, 3.0])
    scaler = StyleScaler()
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_sum(v * v)
        scaled = scaler.scale(loss)
    assert isinstance(scaled, dtape.Tensor) and float(scaled) == 14.0 * 2 ** 16
    np.testing.assert_array_equal(tape.gradient(scaled, v).numpy(), np.array([2.0, -4.0, 6.0]) * 2 ** 16)


def test_torch_amp_gradscaler_scale_and_torch_tensor_of_a_list_say_what_to_do():
    """Both take only torch.Tensor instances (isinstance checks in torch; a dtape tensor wraps one): the
    error names the replacement."""
    loss = dtape.reduce_sum(dtape.constant([1.0, 2.0]))
    with pytest.raises(TypeError, match=r"loss \* scaler.get_scale\(\)"):
        torch.amp.GradScaler("cpu").scale(loss)
    with pytest.raises(TypeError, match=r"torch.stack"):
        torch.tensor([loss, loss])
    stacked = torch.stack([loss, loss * 2])
    assert isinstance(stacked, dtape.Tensor) and stacked.numpy().tolist() == [3.0, 6.0]
    assert torch.tensor([float(loss), loss.item()]).tolist() == [3.0, 3.0]
    assert torch.tensor(loss).item() == 3.0  # one 0-d tensor: read through DLPack


def test_tensorboard_logging_of_dtape_values(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter
    loss = dtape.reduce_sum(dtape.constant([1.0, 2.0]))
    v = dtape.Variable([[1.0, 2.0], [3.0, 4.0]])
    with SummaryWriter(str(tmp_path)) as writer:
        writer.add_scalar("loss", loss.item(), 0)
        writer.add_histogram("v", v.numpy(), 0)
        writer.add_scalar("v_sum", v.sum().item(), 0)
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())


# -- random functions in a wrapped module or on dtape tensors ---------------------------------------------

def _draw_count(fn):
    """Whether fn() drew from this thread's dtape generator (its state moved)."""
    gen = torch.Generator().manual_seed(5)
    before = gen.get_state()
    with dtape.random.generator_scope(gen):
        fn()
    return not torch.equal(before, gen.get_state())


def test_random_functions_that_draw_nothing_take_no_seed_from_the_replicas_generator():
    """Attention without dropout (nanoGPT's default) and dropout with p=0 or outside training draw nothing in
    torch, so they seed no private stream; with a probability they do."""
    q = dtape.constant(torch.randn(1, 2, 4, 8))
    x = dtape.constant(torch.randn(16))
    assert not _draw_count(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert not _draw_count(lambda: F.scaled_dot_product_attention(q, q, q, None, 0.0))
    assert not _draw_count(lambda: F.dropout(x, 0.5, training=False))
    assert not _draw_count(lambda: F.dropout(x, p=0.0))
    assert not _draw_count(lambda: nn.Dropout(0.3).eval()(x))
    assert _draw_count(lambda: F.scaled_dot_product_attention(q, q, q, dropout_p=0.5))
    assert _draw_count(lambda: F.dropout(x, 0.5))
    assert _draw_count(lambda: nn.Dropout(0.3)(x))
    # inside a wrapped module's forward, run on a replica (a thread with its own generator)
    attention = dtape.layers.TorchModule(_Attention())
    assert not _draw_count(lambda: attention(q, training=True))
    assert _draw_count(lambda: attention(q, 0.5, training=True))


class _Attention(nn.Module):
    def forward(self, q, dropout_p=0.0):
        return F.scaled_dot_product_attention(q, q, q, dropout_p=dropout_p, is_causal=True)


def test_dropout_in_a_wrapped_module_outside_any_replica_draws_as_plain_torch():
    """No thread generator (no strategy, no generator_scope): torch's random functions inside the module
    draw from torch's own generator, as the same module in plain torch, and the forward runs uncounted."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5))
    tm = dtape.layers.TorchModule(module)
    x = torch.randn(4, 8)
    torch.manual_seed(3)
    got = tm(x, training=True).torch()
    torch.manual_seed(3)
    expected = module(x)
    assert torch.equal(got, expected.detach())
    assert 0.2 < (got == 0).float().mean() < 0.8
