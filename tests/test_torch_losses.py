"""`F.cross_entropy`, `F.nll_loss`, `F.log_softmax` and `Tensor.view` / `Tensor.reshape` on dtape tensors.

With class indices (the language-model and classifier case) they run dtape ops over torch's own kernels
(log_softmax, nll_loss_forward / nll_loss_backward, _log_softmax_backward_data), so values and gradients are
torch's bit for bit and the walk makes no autograd engine call; every other form (class weights, label
smoothing, probabilities, more dimensions, autocast, `view(dtype)`) still runs through the autograd fallback
and equals torch too. Breaks these tests catch: the nll rule without its ignore mask (the ignored rows get
gradient), the mean's division dropped, view's gradient not reshaped back.
"""
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dtape
from dtape.ops import _dispatch

f64 = torch.float64


def _dtape_loss(fn, x, target, **kwargs):
    """(loss, d loss / d x) through a tape; a [N] loss ("none") is summed with weights 1..N first."""
    xv = dtape.Variable(x.clone())
    with dtape.GradientTape() as tape:
        loss = fn(xv * 1.0, dtape.constant(target), **kwargs)
        total = dtape.reduce_sum(loss * _weights(loss.shape, x.dtype)) if loss.ndim else loss
    return loss.torch(), tape.gradient(total, xv).torch()


def _torch_loss(fn, x, target, **kwargs):
    xt = x.clone().requires_grad_()
    loss = fn(xt * 1.0, target, **kwargs)
    total = (loss * _weights(loss.shape, x.dtype)).sum() if loss.ndim else loss
    grad, = torch.autograd.grad(total, xt)
    return loss.detach(), grad


def _weights(shape, dtype):
    return torch.arange(1, 1 + shape.numel(), dtype=dtype).reshape(shape) if len(shape) else torch.tensor(1, dtype=dtype)


def _targets(n, classes, ignored=(), ignore_index=-100):
    target = torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(n + classes))
    target[list(ignored)] = ignore_index
    return target


CASES = [  # (logits shape, target, ignore_index)
    ((6, 5), _targets(6, 5), -100),
    ((6, 5), _targets(6, 5, ignored=(1, 4)), -100),
    ((6, 5), _targets(6, 5, ignored=(0, 1, 2, 3, 4, 5)), -100),   # every example ignored: the mean is NaN
    ((6, 5), _targets(6, 5, ignored=(2,), ignore_index=0), 0),     # a real class ignored (padding id 0)
    ((6, 1), torch.zeros(6, dtype=torch.long), -100),               # one class
    ((0, 5), torch.zeros(0, dtype=torch.long), -100),               # empty batch
    ((5,), torch.tensor(3), -100),                                  # one example, no batch dimension
    ((5,), torch.tensor(-100), -100),
]


@pytest.mark.parametrize("fn", [F.cross_entropy, F.nll_loss], ids=["cross_entropy", "nll_loss"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape,target,ignore_index", CASES)
def test_class_index_losses_are_torchs_bit_for_bit(fn, reduction, shape, target, ignore_index):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    x[..., 0] = 0.0 if x.shape[-1] > 1 else x[..., 0]   # ties with the other classes' zeros below
    if x.ndim == 2 and x.shape[0] > 1 and x.shape[1] > 1:
        x[1, 1] = 0.0
    kwargs = dict(reduction=reduction, ignore_index=ignore_index)
    loss, grad = _dtape_loss(fn, x, target, **kwargs)
    expected_loss, expected_grad = _torch_loss(fn, x, target, **kwargs)
    assert torch.equal(loss, expected_loss) or torch.equal(loss.isnan(), expected_loss.isnan()) and \
        torch.equal(loss.nan_to_num(), expected_loss.nan_to_num())
    assert torch.equal(grad, expected_grad)


def test_nan_and_infinite_logits_give_torchs_values_and_gradients():
    x = torch.tensor([[float("nan"), 0.0, 1.0], [float("inf"), 0.0, 1.0], [-float("inf"), 2.0, 1.0]])
    target = torch.tensor([1, 0, 2])
    loss, grad = _dtape_loss(F.cross_entropy, x, target, reduction="none")
    expected_loss, expected_grad = _torch_loss(F.cross_entropy, x, target, reduction="none")
    torch.testing.assert_close(loss, expected_loss, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(grad, expected_grad, equal_nan=True, rtol=0, atol=0)


def _no_engine_call(monkeypatch):
    calls = []
    real = _dispatch.graph_vjp
    monkeypatch.setattr(_dispatch, "graph_vjp", lambda *a: calls.append(a[0].name) or real(*a))
    return calls


def test_the_walk_through_the_loss_asks_torch_autograd_nothing(monkeypatch):
    calls = _no_engine_call(monkeypatch)
    w = dtape.Variable(torch.randn(4, 8, 5))
    target = dtape.constant(torch.randint(0, 5, (4, 8)))
    with dtape.GradientTape() as tape:
        logits = w * 2.0
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), target.view(-1), ignore_index=-1) + \
            F.nll_loss(F.log_softmax(logits.reshape(32, 5), dim=-1), target.reshape(-1), reduction="sum") + \
            dtape.reduce_sum(torch.log_softmax(logits, 2)) + dtape.reduce_sum(logits.log_softmax(-1))
    assert tape.gradient(loss, w) is not None
    assert calls == []


def test_float64_gradients_and_second_order_equal_torch_autograd():
    x0 = torch.randn(5, 4, dtype=f64, generator=torch.Generator().manual_seed(3))
    target = torch.tensor([0, 3, -100, 3, 1])
    xv = dtape.Variable(x0.clone())
    with dtape.GradientTape() as outer:
        with dtape.GradientTape() as inner:
            loss = F.cross_entropy(xv * 1.0, dtape.constant(target))
        g = inner.gradient(loss, xv)
        penalty = dtape.reduce_sum(g * g * torch.arange(20, dtype=f64).reshape(5, 4))
    hess_v = outer.gradient(penalty, xv)
    xt = x0.clone().requires_grad_()
    gt, = torch.autograd.grad(F.cross_entropy(xt, target), xt, create_graph=True)
    expected, = torch.autograd.grad((gt * gt * torch.arange(20, dtype=f64).reshape(5, 4)).sum(), xt)
    torch.testing.assert_close(g.torch(), gt.detach(), rtol=1e-14, atol=0)
    torch.testing.assert_close(hess_v.torch(), expected, rtol=1e-12, atol=1e-15)


def test_forward_mode_through_cross_entropy_equals_torch_func_jvp():
    x0 = torch.randn(3, 4, dtype=f64, generator=torch.Generator().manual_seed(4))
    v = torch.randn(3, 4, dtype=f64, generator=torch.Generator().manual_seed(5))
    target = torch.tensor([1, -100, 2])
    x = dtape.constant(x0)
    with dtape.autodiff.ForwardAccumulator(x, dtape.constant(v)) as acc:
        loss = F.cross_entropy(x, dtape.constant(target), reduction="sum")
    _, expected = torch.func.jvp(lambda t: F.cross_entropy(t, target, reduction="sum"), (x0,), (v,))
    torch.testing.assert_close(acc.jvp(loss).torch(), expected, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("kwargs,shape,target", [
    (dict(weight=torch.tensor([1.0, 2.0, 0.5])), (4, 3), torch.tensor([0, 1, 2, 1])),
    (dict(label_smoothing=0.1), (4, 3), torch.tensor([0, 1, 2, 1])),
    (dict(), (2, 3, 4), torch.tensor([[0, 1, 2, 1], [2, 2, 0, 1]])),            # [N, C, d]
    (dict(), (4, 3), torch.softmax(torch.randn(4, 3, generator=torch.Generator().manual_seed(6)), -1)),
], ids=["weight", "label_smoothing", "spatial", "probabilities"])
def test_other_forms_go_through_the_fallback_and_equal_torch(kwargs, shape, target):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    loss, grad = _dtape_loss(F.cross_entropy, x, target, **kwargs)
    expected_loss, expected_grad = _torch_loss(F.cross_entropy, x, target, **kwargs)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("inside", [True, False], ids=["gradient inside", "gradient outside"])
def test_autocast_cross_entropy_gradient_equals_torch(inside):
    w0 = torch.randn(8, 5, generator=torch.Generator().manual_seed(8))
    x0 = torch.randn(6, 8, generator=torch.Generator().manual_seed(9))
    target = torch.tensor([0, 4, 1, 1, 3, 2])
    w, x = dtape.Variable(w0.clone()), dtape.constant(x0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with dtape.GradientTape() as tape:
            loss = F.cross_entropy(torch.matmul(x, w), dtape.constant(target))
        if inside:
            g = tape.gradient(loss, w)
    if not inside:
        g = tape.gradient(loss, w)
    wt = w0.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_loss = F.cross_entropy(x0 @ wt, target)
    expected, = torch.autograd.grad(expected_loss, wt)
    assert loss.dtype == expected_loss.dtype == torch.float32
    torch.testing.assert_close(g.torch(), expected, rtol=0, atol=0)


def test_bad_targets_and_reductions_raise_torchs_errors():
    x = dtape.constant(torch.randn(3, 4))
    with pytest.raises(IndexError, match="out of bounds"):
        F.cross_entropy(x, dtape.constant(torch.tensor([0, 4, 1])))
    with pytest.raises(ValueError, match="is not a valid value for reduction"):
        F.cross_entropy(x, dtape.constant(torch.tensor([0, 1, 1])), reduction="avg")
    with pytest.raises(RuntimeError, match="Long"):
        F.nll_loss(x, dtape.constant(torch.tensor([0, 1, 1], dtype=torch.int32)))


def test_view_and_reshape_methods_gradients_sizes_and_torchs_errors(monkeypatch):
    calls = _no_engine_call(monkeypatch)
    x0 = torch.randn(4, 6, dtype=f64)
    xv = dtape.Variable(x0.clone())
    weights = torch.arange(24, dtype=f64)
    with dtape.GradientTape() as tape:
        y = xv.view(2, 12) * 1.0
        z = (dtape.reduce_sum(y.view((-1,)) * weights) + dtape.reduce_sum(xv.reshape(3, dtape.constant(8)).view(24))
             + dtape.reduce_sum(y.reshape((24,)) * weights))
    g = tape.gradient(z, xv)
    torch.testing.assert_close(g.torch(), (2 * weights + 1).reshape(4, 6), rtol=0, atol=0)
    assert calls == []
    with pytest.raises(RuntimeError, match="reshape"):
        dtape.constant(torch.randn(4, 6).t()).view(24)     # a transposed input: torch refuses the view
    assert dtape.constant(torch.zeros(2, 2)).view(torch.int32).dtype == torch.int32   # bits as another dtype


def test_log_softmax_without_dim_keeps_torchs_warning_and_value():
    x0 = torch.randn(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = F.log_softmax(dtape.constant(x0))
    assert any("Implicit dimension" in str(w.message) for w in caught)
    assert torch.equal(out.torch(), F.log_softmax(x0, dim=1))


@pytest.mark.parametrize("fn", [F.cross_entropy, F.nll_loss], ids=["cross_entropy", "nll_loss"])
def test_a_target_of_another_batch_size_raises_torchs_value_error(fn):
    logits, target = torch.randn(6, 5), torch.zeros(5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"Expected input batch_size \(6\) to match target batch_size \(5\)"):
        fn(logits, target)
    with pytest.raises(ValueError, match=r"Expected input batch_size \(6\) to match target batch_size \(5\)"):
        fn(dtape.constant(logits), dtape.constant(target))


def test_log_softmax_dim_out_of_range_raises_torchs_error():
    with pytest.raises(IndexError, match="Dimension out of range"):
        F.log_softmax(dtape.constant(torch.randn(2, 3, 4)), 3)


@pytest.mark.parametrize("ignore_index", [dtape.constant(4), torch.tensor(4)], ids=["dtape", "torch"])
def test_ignore_index_given_as_a_tensor_gives_torchs_gradient(ignore_index):
    x0 = torch.randn(4, 5, dtype=f64, generator=torch.Generator().manual_seed(10))
    target = torch.tensor([1, 0, 4, 2])
    for fn in (F.cross_entropy, lambda x, y, **kw: F.nll_loss(F.log_softmax(x, dim=1), y, **kw)):
        loss, grad = _dtape_loss(fn, x0, target, ignore_index=ignore_index)
        expected_loss, expected_grad = _torch_loss(fn, x0, target, ignore_index=4)
        assert torch.equal(loss, expected_loss) and torch.equal(grad, expected_grad)


def test_view_sizes_one_by_one_of_any_integer_type_and_no_tensor_as_a_shape():
    x0 = torch.randn(4, 5)
    x = dtape.constant(x0)
    for size in (np.int64(20), torch.tensor(20), dtape.constant(20)):
        assert x.view(size).shape == x.reshape(size).shape == (20,)
        assert x.view(size, 1).shape == (20, 1)
    with pytest.raises(TypeError):
        x0.view(torch.tensor([5, 4]))   # torch takes no tensor as a whole shape: neither does dtape's view
    with pytest.raises(TypeError):
        x.view(torch.tensor([5, 4]))
