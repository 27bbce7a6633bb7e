"""torch's grad mode is the thread's stop flag; `.detach()`, `.data` and the `new_*` factories are constants.

Every gradient is compared with torch.autograd's on the same float64 computation, inside a tape and inside a
wrapped module (dtape.layers.TorchModule).
"""
import copy
import threading

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import dtape

f64 = torch.float64
X = [1.0, -3.0, 2.0, 0.5]

# Each way torch turns grad mode off on the calling thread.
GRAD_OFF = {
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
    "set_grad_enabled_false": lambda: torch.set_grad_enabled(False),
}


def _normalised_square(h, off):
    """sum((h / max|h|)**2) with the scale computed under `off()`: a constant in torch."""
    with off():
        scale = h.abs().max()
    # clone: torch's autograd refuses to save an inference tensor (dtape would accept it)
    return ((h / scale.clone()) ** 2).sum()


def _torch_grad(fn, x):
    xt = torch.tensor(x, dtype=f64, requires_grad=True)
    (g,) = torch.autograd.grad(fn(xt * 2), [xt])
    return g.numpy()


@pytest.mark.parametrize("mode", sorted(GRAD_OFF))
def test_grad_mode_off_makes_a_constant_inside_a_tape(mode):
    off = GRAD_OFF[mode]
    x = dtape.constant(X, dtype=f64)
    with dtape.GradientTape() as tape:
        tape.watch(x)
        y = _normalised_square(x * 2, off)
    expected = _torch_grad(lambda h: _normalised_square(h, off), X)
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), expected, rtol=1e-12)
    # differentiating the scale too gives another gradient: the test tells the two apart
    assert not np.allclose(expected, _torch_grad(lambda h: ((h / h.abs().max()) ** 2).sum(), X))


@pytest.mark.parametrize("mode", sorted(GRAD_OFF))
def test_nothing_is_recorded_or_watched_with_grad_mode_off(mode):
    x = dtape.constant(X, dtype=f64)
    v = dtape.Variable(X, dtype=f64)
    with dtape.GradientTape(persistent=True) as tape:
        tape.watch(x)
        with GRAD_OFF[mode]():
            y = dtape.reduce_sum(x * v)   # reads v: not watched, not recorded
        z = dtape.reduce_sum(x * 3)
    assert tape.gradient(y, [x, v]) == [None, None]
    assert tape.watched_variables() == ()
    np.testing.assert_array_equal(tape.gradient(z, x).numpy(), [3.0] * 4)


def test_variable_read_under_no_grad_is_a_constant():
    v = dtape.Variable(X, dtype=f64)
    with dtape.GradientTape() as tape:
        with torch.no_grad():
            c = v * 2
        y = dtape.reduce_sum(v * c)
    vt = torch.tensor(X, dtype=f64, requires_grad=True)
    with torch.no_grad():
        ct = vt * 2
    (expected,) = torch.autograd.grad((vt * ct).sum(), [vt])
    np.testing.assert_allclose(tape.gradient(y, v).numpy(), expected.numpy(), rtol=1e-12)


def test_grad_mode_is_per_thread(fast_switching):
    """Another thread inside no_grad stops only itself: this thread keeps recording into the same tape."""
    x = dtape.constant(X, dtype=f64)
    inside, done = threading.Event(), threading.Event()
    results = {}

    def other():
        with torch.no_grad():
            inside.set()
            results["other"] = dtape.reduce_sum(x * 5)  # not recorded: this thread's grad mode is off
            done.wait(timeout=30)

    with dtape.GradientTape(persistent=True) as tape:
        tape.watch(x)
        worker = threading.Thread(target=other)
        worker.start()
        assert inside.wait(timeout=30)
        y = dtape.reduce_sum(x * x)  # recorded: this thread's grad mode is on
        done.set()
        worker.join(timeout=30)
    assert not worker.is_alive()
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), 2 * np.array(X))
    assert tape.gradient(results["other"], x) is None


def test_nested_tapes_under_no_grad_do_not_record_the_walk():
    """Higher order: the walk is recorded when grad mode is on, and not under no_grad (the stop flag)."""
    x = dtape.constant(X, dtype=f64)
    for off, expected in ((False, 6 * np.array(X)), (True, None)):
        with dtape.GradientTape() as outer:
            outer.watch(x)
            with dtape.GradientTape() as inner:
                inner.watch(x)
                y = dtape.reduce_sum(x ** 3)
            if off:
                with torch.no_grad():
                    g = inner.gradient(y, x)
            else:
                g = inner.gradient(y, x)
        np.testing.assert_allclose(g.numpy(), 3 * np.array(X) ** 2)
        gg = outer.gradient(g, x)
        if expected is None:
            assert gg is None
        else:
            np.testing.assert_allclose(gg.numpy(), expected)


def test_recompute_grad_walk_started_under_no_grad():
    """The walk's private re-run records on its own tape whatever the caller's grad mode."""
    w = dtape.Variable([[0.5, -1.0], [2.0, 0.25]], dtype=f64)
    block = dtape.recompute_grad(lambda h: dtape.tanh(dtape.matmul(h, w)))
    x = dtape.constant([[1.0, 2.0], [-1.0, 0.5]], dtype=f64)
    with dtape.GradientTape() as tape:
        tape.watch(x)
        y = dtape.reduce_sum(block(x) ** 2)
    with torch.no_grad():
        gx, gw = tape.gradient(y, [x, w])
    xt = torch.tensor([[1.0, 2.0], [-1.0, 0.5]], dtype=f64, requires_grad=True)
    wt = torch.tensor([[0.5, -1.0], [2.0, 0.25]], dtype=f64, requires_grad=True)
    ex, ew = torch.autograd.grad((torch.tanh(xt @ wt) ** 2).sum(), [xt, wt])
    np.testing.assert_allclose(gx.numpy(), ex.numpy(), rtol=1e-12)
    np.testing.assert_allclose(gw.numpy(), ew.numpy(), rtol=1e-12)


def test_optimizer_update_under_no_grad():
    """torch users step optimizers under no_grad: the update is the same."""
    results = []
    for off in (False, True):
        v = dtape.Variable([1.0, 2.0], dtype=f64)
        opt = dtape.optimizers.SGD(0.5, momentum=0.9)
        for _ in range(2):
            with dtape.GradientTape() as tape:
                loss = dtape.reduce_sum(v * v)
            grads = tape.gradient(loss, [v])
            if off:
                with torch.no_grad():
                    opt.apply_gradients(zip(grads, [v]))
            else:
                opt.apply_gradients(zip(grads, [v]))
        results.append(v.numpy())
    np.testing.assert_array_equal(results[0], results[1])
    # v <- v - 0.5 m, m <- 0.9 m + 2v: after two steps v = 0 then v = -0.9 * v0
    np.testing.assert_allclose(results[1], [-0.9, -1.8])


def test_inference_tensor_used_in_a_recorded_op():
    """A tensor made under inference_mode has no version counter: recording an op that saves it works."""
    x = dtape.constant(X, dtype=f64)
    with torch.inference_mode():
        c = x * 2
    v = dtape.Variable(X, dtype=f64)
    with dtape.GradientTape() as tape:
        y = dtape.reduce_sum(v * c)
    np.testing.assert_allclose(tape.gradient(y, v).numpy(), 2 * np.array(X))


def test_dtape_function_under_no_grad_is_a_plain_call():
    v = dtape.Variable(X, dtype=f64)
    f = dtape.function(lambda a: dtape.reduce_sum(a * v))
    x = dtape.constant(X, dtype=f64)
    with dtape.GradientTape(persistent=True) as tape:
        tape.watch(x)
        with torch.no_grad():
            y0 = f(x)
        y1 = f(x)
    assert float(y0) == float(y1)
    assert tape.gradient(y0, [x, v]) == [None, None]
    np.testing.assert_allclose(tape.gradient(y1, x).numpy(), X)


# -- constants: .detach(), .data, new_* --------------------------------------------------------------

CONSTANT_IDIOMS = {
    "detach": lambda h: h.detach(),
    "data": lambda h: h.data,
    "new_zeros": lambda h: h.new_zeros(h.shape) + 1.5,
    "new_ones": lambda h: h.new_ones(h.shape),
    "new_full": lambda h: h.new_full(tuple(h.shape), 2.5),
    "new_empty": lambda h: torch.ones_like(h.new_empty(h.shape)),  # its values are arbitrary
    "new_tensor": lambda h: h.new_tensor([1.0, 2.0, 3.0, 4.0]),
    "full_like": lambda h: torch.full_like(h, 3.0),
    "torch.detach": lambda h: torch.detach(h),
}


def _with_constant(h, make):
    c = make(h)
    return (h * h * c).sum() + (h * h).sum()


@pytest.mark.parametrize("idiom", sorted(CONSTANT_IDIOMS))
def test_constants_inside_a_tape(idiom):
    make = CONSTANT_IDIOMS[idiom]
    x = dtape.constant(X, dtype=f64)
    with dtape.GradientTape(persistent=True) as tape:
        tape.watch(x)
        h = x * 2
        c = make(h)
        y = _with_constant(h, make)
    expected = _torch_grad(lambda h: _with_constant(h, make), X)
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), expected, rtol=1e-12)
    assert tape.gradient(dtape.convert_to_tensor(c), x) is None  # not recorded: unconnected


def test_new_empty_is_not_recorded():
    x = dtape.constant(X, dtype=f64)
    with dtape.GradientTape(persistent=True) as tape:
        tape.watch(x)
        h = x * 2
        made = [h.new_empty((2, 2)), h.new_empty_strided((2, 2), (2, 1)), torch.empty_like(h)]
    assert [tape.gradient(m, x) for m in made] == [None, None, None]
    assert [(tuple(m.shape), m.dtype) for m in made] == [((2, 2), f64), ((2, 2), f64), ((4,), f64)]


def test_detach_of_a_variable_is_a_constant():
    v = dtape.Variable(X, dtype=f64)
    with dtape.GradientTape() as tape:
        y = dtape.reduce_sum(v * torch.detach(v))
    np.testing.assert_allclose(tape.gradient(y, v).numpy(), X)


# -- inside a wrapped module ---------------------------------------------------------------------------

class Scaled(nn.Module):
    """A torch module using each idiom in its forward."""

    def __init__(self, idiom):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)
        self.idiom = idiom

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.idiom in GRAD_OFF:
            with GRAD_OFF[self.idiom]():
                scale = h.abs().max()
            h = h / scale.clone()
        elif self.idiom == "detach_mean":
            h = h - h.mean(0, keepdim=True).detach()
        elif self.idiom == "data":
            h = h * h.data
        elif self.idiom == "new_zeros":
            h = h + h.new_zeros(h.shape[1:]) + h.new_ones(()) * h.new_tensor(0.5)
        elif self.idiom == "new_full":
            h = h * h.new_full((1, h.shape[1]), 2.0)
        return self.out(h)


MODULE_IDIOMS = sorted(GRAD_OFF) + ["detach_mean", "data", "new_zeros", "new_full"]


@pytest.mark.parametrize("idiom", MODULE_IDIOMS)
def test_idioms_inside_a_wrapped_module(idiom):
    torch.manual_seed(0)
    module = Scaled(idiom).to(f64)
    x = torch.randn(3, 4, dtype=f64)
    ref = copy.deepcopy(module)
    xt = x.clone().requires_grad_()
    loss = (ref(xt) ** 2).sum()
    expected = torch.autograd.grad(loss, list(ref.parameters()) + [xt])
    tm = dtape.layers.TorchModule(module)
    xd = dtape.constant(x)
    with dtape.GradientTape() as tape:
        tape.watch(xd)
        y = dtape.reduce_sum(tm(xd) ** 2)
    grads = tape.gradient(y, list(tm.trainable_variables) + [xd])
    np.testing.assert_allclose(float(y), loss.item(), rtol=1e-12)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-10, atol=1e-12)


def test_no_grad_module_call_records_nothing():
    """A wrapped module called under no_grad (evaluation) is not recorded."""
    tm = dtape.layers.TorchModule(nn.Linear(4, 2).to(f64))
    x = dtape.constant(np.ones((2, 4)), dtype=f64)
    with dtape.GradientTape() as tape:
        with torch.no_grad():
            y = dtape.reduce_sum(tm(x))
    assert tape.watched_variables() == ()
    assert tape.gradient(y, list(tm.trainable_variables)) == [None, None]


# -- torch.utils.checkpoint ------------------------------------------------------------------------------

class Checkpointed(nn.Module):
    """Two blocks, the first under torch.utils.checkpoint (nanoGPT-style activation checkpointing)."""

    def __init__(self, reentrant):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 4))
        self.head = nn.Linear(4, 2)
        self.reentrant = reentrant

    def forward(self, x):
        h = x + checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(torch.tanh(h))


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")  # torch's, on dtape inputs
@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_inside_a_wrapped_module(reentrant):
    torch.manual_seed(0)
    module = Checkpointed(reentrant).to(f64)
    x = torch.randn(3, 4, dtype=f64)
    ref = copy.deepcopy(module)
    xt = x.clone().requires_grad_()
    loss = (ref(xt) ** 2).sum()
    loss.backward()  # reentrant checkpoint refuses torch.autograd.grad
    expected = [p.grad for p in ref.parameters()] + [xt.grad]
    tm = dtape.layers.TorchModule(module)
    xd = dtape.constant(x)
    with dtape.GradientTape() as tape:
        tape.watch(xd)
        y = dtape.reduce_sum(tm(xd) ** 2)
    grads = tape.gradient(y, list(tm.trainable_variables) + [xd])
    assert len(grads) == len(expected) == 7
    for g, e in zip(grads, expected):
        assert g is not None
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")  # torch's, on dtape inputs
@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_of_dtape_ops_inside_a_tape(reentrant):
    w = dtape.Variable([[0.5, -1.0], [2.0, 0.25]], dtype=f64)
    x = dtape.constant([[1.0, 2.0], [-1.0, 0.5]], dtype=f64)
    with dtape.GradientTape() as tape:
        tape.watch(x)
        h = checkpoint(lambda a: torch.tanh(a @ w), x, use_reentrant=reentrant)
        y = dtape.reduce_sum(h ** 2)
    gx, gw = tape.gradient(y, [x, w])
    xt = torch.tensor([[1.0, 2.0], [-1.0, 0.5]], dtype=f64, requires_grad=True)
    wt = torch.tensor([[0.5, -1.0], [2.0, 0.25]], dtype=f64, requires_grad=True)
    (torch.tanh(xt @ wt) ** 2).sum().backward()
    np.testing.assert_allclose(gx.numpy(), xt.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(gw.numpy(), wt.grad.numpy(), rtol=1e-12)
