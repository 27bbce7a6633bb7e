"""Gradient rules skip the input gradients no source needs.

Each test counts the expensive gradient computations (by wrapping the helper
that does them) and checks the gradients against torch.autograd in float64.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F

import dtape
from dtape.ops import array_ops, math_ops, nn_ops

D = torch.float64


def _counting(monkeypatch, module, name):
    calls = []
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)
    monkeypatch.setattr(module, name, wrapper)
    return calls


def _cnn_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 6, 2, generator=g, dtype=D)
    k1 = torch.randn(3, 3, 2, 3, generator=g, dtype=D)
    k2 = torch.randn(2, 2, 3, 2, generator=g, dtype=D)
    return x, k1, k2


def _cnn_dtape(x, k1, k2):
    h = dtape.tanh(dtape.nn.conv2d(x, k1, strides=1, padding="SAME"))        # first layer: image not needed
    return dtape.reduce_sum(dtape.square(dtape.nn.conv2d(h, k2, strides=2, padding="SAME")))


def _cnn_torch(x, k1, k2):
    def conv(x, k, stride, pads):
        y = F.conv2d(F.pad(x.permute(0, 3, 1, 2), pads), k.permute(3, 2, 0, 1), stride=stride)
        return y.permute(0, 2, 3, 1)
    h = torch.tanh(conv(x, k1, 1, (1, 1, 1, 1)))
    return torch.sum(conv(h, k2, 2, (0, 0, 0, 0)) ** 2)  # 6x6, k=2, s=2: SAME needs no padding


@pytest.mark.parametrize("recorded", [False, True], ids=["raw", "recorded"])
def test_conv2d_skips_the_first_layers_image_gradient(monkeypatch, recorded):
    kernel_masks = _counting(monkeypatch, nn_ops, "_convolution_backward")
    image_grads = _counting(monkeypatch, nn_ops, "_conv_grad_input")
    x, k1, k2 = _cnn_data()
    v1, v2 = dtape.Variable(k1), dtape.Variable(k2)
    with dtape.GradientTape() as tape:
        loss = _cnn_dtape(dtape.constant(x), v1, v2)
    if recorded:  # another tape records the walk: the rules run on dtape tensors (composite ops)
        with dtape.GradientTape() as outer:
            outer.watch([v1, v2])  # watches what the walk reads, so the walk is recorded (not raw)
            grads = tape.gradient(loss, [v1, v2])
        assert len(image_grads) == 1  # only the second layer's image gradient
    else:
        grads = tape.gradient(loss, [v1, v2])
        assert image_grads == []
    # the kernel runs on both walks (a recorded walk takes its bits), each time with the first layer's image off
    masks = [args[-1] for args in kernel_masks]
    assert [tuple(bool(n) for n in m) for m in masks] == [(True, True), (False, True)]
    t1, t2 = k1.clone().requires_grad_(), k2.clone().requires_grad_()
    ref = torch.autograd.grad(_cnn_torch(x, t1, t2), [t1, t2])
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g.torch(), r, rtol=1e-12, atol=1e-12)


def test_conv2d_rule_with_the_kernel_is_differentiable_again():
    """Second order: the rule run under an outer tape (composite ops) gives H v as torch's double backward."""
    x, k1, k2 = _cnn_data()
    v1 = dtape.Variable(k1)
    direction = torch.linspace(-1.0, 1.0, k1.numel(), dtype=D).reshape(k1.shape)
    with dtape.GradientTape() as outer:
        with dtape.GradientTape() as inner:
            loss = _cnn_dtape(dtape.constant(x), v1, dtape.constant(k2))
        g = inner.gradient(loss, v1)
        gv = dtape.reduce_sum(g * dtape.constant(direction))
    hv = outer.gradient(gv, v1)
    t1 = k1.clone().requires_grad_()
    (tg,) = torch.autograd.grad(_cnn_torch(x, t1, k2), [t1], create_graph=True)
    (ref,) = torch.autograd.grad(torch.sum(tg * direction), [t1])
    torch.testing.assert_close(hv.torch(), ref, rtol=1e-10, atol=1e-10)


def test_einsum_computes_only_the_needed_operand_gradients(monkeypatch):
    calls = _counting(monkeypatch, math_ops, "_einsum_operand_grad")
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 4, generator=g, dtype=D), torch.randn(4, 5, generator=g, dtype=D)
    da, db = dtape.constant(a), dtape.constant(b)
    with dtape.GradientTape() as tape:
        tape.watch(db)
        y = dtape.reduce_sum(dtape.tanh(dtape.einsum("ij,jk->ik", da, db)))
    (gb,) = tape.gradient(y, [db])
    assert [args[2] for args in calls] == [1]  # operand index 1 only
    tb = b.clone().requires_grad_()
    (ref,) = torch.autograd.grad(torch.tanh(torch.einsum("ij,jk->ik", a, tb)).sum(), [tb])
    torch.testing.assert_close(gb.torch(), ref, rtol=1e-12, atol=1e-12)


def test_embedding_lookup_gradient_is_skipped_when_params_are_not_needed(monkeypatch):
    calls = []
    original = array_ops._gather_grad.any
    monkeypatch.setattr(array_ops._gather_grad, "any", lambda *a, **k: calls.append(a) or original(*a, **k))
    table = torch.arange(12, dtype=D).reshape(4, 3)
    ids = dtape.constant(torch.tensor([[0, 2], [2, 3]]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # watching and differentiating integer ids warns (they get None)
        with dtape.GradientTape() as tape:
            tape.watch(ids)
            y = dtape.reduce_sum(dtape.nn.embedding_lookup(dtape.constant(table), ids))
        assert tape.gradient(y, ids) is None
    assert calls == []
    # with the table as source the rule runs, repeated ids accumulate
    v = dtape.Variable(table)
    with dtape.GradientTape() as tape:
        y = dtape.reduce_sum(dtape.nn.embedding_lookup(v, ids) * 2.0)
    g = tape.gradient(y, v)
    assert len(calls) == 1
    tv = table.clone().requires_grad_()
    (ref,) = torch.autograd.grad((F.embedding(ids.torch(), tv) * 2.0).sum(), [tv])
    torch.testing.assert_close(g.torch(), ref, rtol=0, atol=0)


def test_torch_bmm_is_matmul_and_skips_the_unwatched_batch(monkeypatch):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(2, 3, 4, generator=g, dtype=D), torch.randn(2, 4, 5, generator=g, dtype=D)
    da, db = dtape.constant(a), dtape.constant(b)
    with dtape.GradientTape() as tape:
        tape.watch(db)
        y = dtape.reduce_sum(torch.bmm(da, db) ** 2)
    products = _counting(monkeypatch, torch, "matmul")
    (gb,) = tape.gradient(y, [db])
    assert len(products) == 1  # matmul's rule, b's gradient only (the autograd fallback calls no torch.matmul)
    tb = b.clone().requires_grad_()
    (ref,) = torch.autograd.grad((torch.bmm(a, tb) ** 2).sum(), [tb])
    torch.testing.assert_close(gb.torch(), ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="3-D"):
        torch.bmm(dtape.constant(a[0]), db)


@pytest.mark.parametrize("walk_inside_autocast", [True, False])
def test_conv2d_kernel_gradient_after_a_bfloat16_autocast_forward(walk_inside_autocast):
    g = torch.Generator().manual_seed(3)
    x, k = torch.randn(2, 5, 5, 3, generator=g), torch.randn(3, 3, 3, 4, generator=g)
    dx, v = dtape.constant(x), dtape.Variable(k)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with dtape.GradientTape() as tape:
            tape.watch(dx)
            y = dtape.reduce_sum(dtape.square(dtape.nn.conv2d(dx, v, strides=1, padding="SAME")))
        if walk_inside_autocast:
            gx, gk = tape.gradient(y, [dx, v])
    if not walk_inside_autocast:
        gx, gk = tape.gradient(y, [dx, v])
    tx, tk = x.clone().requires_grad_(), k.clone().requires_grad_()
    ty = F.conv2d(F.pad(tx.permute(0, 3, 1, 2), (1, 1, 1, 1)), tk.permute(3, 2, 0, 1))
    rx, rk = torch.autograd.grad((ty ** 2).sum(), [tx, tk])
    assert gx.dtype == gk.dtype == torch.float32
    torch.testing.assert_close(gx.torch(), rx, rtol=0.05, atol=0.5)  # bfloat16 forward and walk
    torch.testing.assert_close(gk.torch(), rk, rtol=0.05, atol=0.5)


class _AtenCounts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops run inside the block, by overload packet name ('mul', 'neg', ...)."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_arithmetic_with_a_constant_computes_no_gradient_for_the_constant():
    g = torch.Generator().manual_seed(0)
    x0, c0 = torch.randn(3, 4, generator=g, dtype=D), torch.randn(3, 4, generator=g, dtype=D)
    x, c = dtape.Variable(x0), dtape.constant(c0)
    with dtape.GradientTape() as tape:
        y = dtape.reduce_sum((x * c) / 3.0 - c)
    with _AtenCounts() as seen:
        got = tape.gradient(y, x)
    tx = x0.clone().requires_grad_()
    want, = torch.autograd.grad(torch.sum((tx * c0) / 3.0 - c0), tx)
    torch.testing.assert_close(got.torch(), want, rtol=1e-12, atol=0)
    # dy * c for x, dy / 3 for the product; nothing for c (a constant) or for 3.0 (a Python number)
    assert seen.counts.get("mul", 0) == 1 and seen.counts.get("div", 0) == 1, seen.counts
    assert seen.counts.get("neg", 0) == 0, seen.counts


def test_transpose_materialises_above_two_dimensions_so_batched_matmuls_copy_nothing():
    g = torch.Generator().manual_seed(0)
    x0, y0 = torch.randn(2, 5, 3, 4, generator=g, dtype=D), torch.randn(2, 5, 3, 4, generator=g, dtype=D)
    m = dtape.constant(torch.randn(3, 4, dtype=D))
    assert dtape.transpose(m).torch().data_ptr() == m.torch().data_ptr()  # 2-D: a view
    x, y = dtape.constant(x0), dtape.constant(y0)
    with dtape.GradientTape() as tape:
        tape.watch([x, y])
        q, k = dtape.transpose(x, [0, 2, 1, 3]), dtape.transpose(y, [0, 2, 1, 3])
        assert q.torch().is_contiguous() and k.torch().is_contiguous()
        scores = dtape.matmul(q, k, transpose_b=True)
        loss = dtape.reduce_sum(scores * scores)
    with _AtenCounts() as seen:
        got = tape.gradient(loss, [x, y])
    # the two transposes' gradients are laid out once each; matmul's rule copies neither operand
    assert seen.counts.get("clone", 0) == 2, seen.counts
    tx, ty = x0.clone().requires_grad_(), y0.clone().requires_grad_()
    s = tx.permute(0, 2, 1, 3) @ ty.permute(0, 2, 1, 3).transpose(-1, -2)
    want = torch.autograd.grad(torch.sum(s * s), [tx, ty])
    for a, b in zip(got, want):
        torch.testing.assert_close(a.torch(), b, rtol=1e-12, atol=1e-12)


def test_layer_norm_walk_reuses_the_forwards_statistics():
    """The record keeps native_layer_norm's mean and 1/std (as torch saves them): the walk runs only the
    backward kernel, no second normalisation, and the gradients are torch's."""
    g = torch.Generator().manual_seed(0)
    x0, w0, b0 = (torch.randn(*s, generator=g, dtype=D) for s in ((2, 5, 4), (4,), (4,)))
    x, w, b = dtape.constant(x0), dtape.Variable(w0), dtape.Variable(b0)
    with dtape.GradientTape() as tape:
        tape.watch(x)
        y = dtape.reduce_sum(dtape.sin(dtape.nn.layer_norm(x, w, b, epsilon=1e-3)))
    with _AtenCounts() as seen:
        got = tape.gradient(y, [x, w, b])
    assert seen.counts.get("native_layer_norm", 0) == 0, seen.counts
    assert seen.counts.get("native_layer_norm_backward", 0) == 1, seen.counts
    tx, tw, tb = (t.clone().requires_grad_() for t in (x0, w0, b0))
    want = torch.autograd.grad(torch.sin(F.layer_norm(tx, (4,), tw, tb, eps=1e-3)).sum(), [tx, tw, tb])
    for a, ref in zip(got, want):
        torch.testing.assert_close(a.torch(), ref, rtol=1e-12, atol=1e-12)
