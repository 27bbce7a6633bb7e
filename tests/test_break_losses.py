"""Attempts to break the loss path (Tensor.view / reshape, log_softmax, cross_entropy and nll_loss with class
indices as dtape ops over torch's kernels) from outside, in combinations test_torch_losses.py and
test_port_losses.py do not cover: compiled steps with symbolic sizes, gradients w.r.t. intermediates,
second order with a non-constant upstream, forward mode, paused recording, replica threads forced to
interleave, dtypes and edge values, Variables and mixed torch/dtape arguments, Model.fit with a custom loss.
Every case compares with torch.autograd (float64 where tolerances are needed).
"""
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dtape
import dtape.distribute
import dtape.keras
import dtape.layers
import dtape.optimizers

f64 = torch.float64
C = 5


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread (restored after): tiny tensors on a loaded 2-core machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _seeded(*shape, seed=0, dtype=f64):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def _same(a, b):
    """Equal bit for bit, NaNs in the same places, same dtype."""
    return a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def _close(a, b, rtol=1e-12, atol=1e-14):
    return torch.equal(a.isnan(), b.isnan()) and torch.allclose(a.nan_to_num(), b.nan_to_num(), rtol=rtol, atol=atol)


W0 = _seeded(2, 3, C)
Y0 = torch.tensor([[1, -1, 4], [0, 2, 2]])


def _torch_step():
    w = W0.clone().requires_grad_()
    loss = F.cross_entropy((w * 2).view(-1, C), Y0.view(-1), ignore_index=-1)
    return loss.detach(), torch.autograd.grad(loss, w)[0]


SIZES = {
    "ints": lambda logits, y: (logits.view(-1, C), y.view(-1)),
    "x.shape": lambda logits, y: (logits.view(logits.shape[0] * logits.shape[1], logits.shape[-1]),
                                  y.view(y.shape[0] * y.shape[1])),
    "dtape.shape[i]": lambda logits, y: (logits.view(-1, dtape.shape(logits)[2]),
                                         y.reshape(dtape.shape(y)[0], -1).view(-1)),
}


@pytest.mark.parametrize("sizes", SIZES.values(), ids=SIZES.keys())
@pytest.mark.parametrize("mode", ["eager", "function", "jit"])
def test_nanogpt_step_in_compiled_and_plain_functions_equals_torch(sizes, mode):
    w = dtape.Variable(W0.clone())

    def step(y):
        with dtape.GradientTape() as tape:
            logits, flat = sizes(w * 2.0, y)
            loss = F.cross_entropy(logits, flat, ignore_index=-1)
        return loss, tape.gradient(loss, w)

    if mode != "eager":
        step = dtape.function(step, **(dict(jit_compile=True, backend=None) if mode == "jit" else {}))
    expected_loss, expected_grad = _torch_step()
    for _ in range(2):   # the second call runs the stored trace
        loss, grad = step(dtape.constant(Y0))
        assert torch.equal(loss.torch(), expected_loss) and torch.equal(grad.torch(), expected_grad)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_compiled_step_with_symbolic_batch_follows_each_size(reduction):
    w = dtape.Variable(_seeded(C, C))

    @dtape.function(jit_compile=True, backend=None,
                    input_signature=[dtape.TensorSpec([None, C], f64), dtape.TensorSpec([None], torch.int64)])
    def step(x, y):
        with dtape.GradientTape() as tape:
            logits = dtape.matmul(x, w).view(x.shape[0], -1)
            loss = F.cross_entropy(logits.view(-1, C), y.view(dtape.shape(y)[0]), ignore_index=-1,
                                   reduction=reduction)
            total = dtape.reduce_sum(loss)
        return loss, tape.gradient(total, w)

    for n, ignored in ((4, 1), (6, 0), (3, 3), (7, 2)):   # (3, 3): every target ignored, the mean is NaN
        x, y = _seeded(n, C, seed=n), torch.randint(0, C, (n,), generator=torch.Generator().manual_seed(n))
        y[:ignored] = -1
        wt = _seeded(C, C).requires_grad_()
        expected = F.cross_entropy(x @ wt, y, ignore_index=-1, reduction=reduction)
        expected_grad, = torch.autograd.grad(expected.sum(), wt)
        loss, grad = step(dtape.constant(x), dtape.constant(y))
        assert _close(loss.torch(), expected.detach()) and _close(grad.torch(), expected_grad)
    assert step.trace_count == 1


def test_compiled_loss_called_under_an_outer_tape():
    w = dtape.Variable(_seeded(C, C))
    loss_of = dtape.function(lambda x, y: F.cross_entropy(dtape.matmul(x, w).view(-1, C), y.view(-1), ignore_index=-1),
                             jit_compile=True, backend=None)
    x, y = _seeded(4, C, seed=1), torch.tensor([0, -1, 3, 4])
    with dtape.GradientTape() as tape:
        loss = loss_of(dtape.constant(x), dtape.constant(y))
    wt = _seeded(C, C).requires_grad_()
    expected, = torch.autograd.grad(F.cross_entropy(x @ wt, y, ignore_index=-1), wt)
    assert _close(tape.gradient(loss, w).torch(), expected)


def _torch_intermediate_grads(x0, target):
    xt = x0.clone().requires_grad_()
    viewed = xt.view(-1, C)
    log_probs = F.log_softmax(viewed, dim=1)
    viewed.retain_grad()
    log_probs.retain_grad()
    F.nll_loss(log_probs, target, reduction="sum").backward()
    return xt.grad, viewed.grad, log_probs.grad


@pytest.mark.parametrize("jit", [False, True])
def test_gradients_wrt_watched_intermediates_on_a_persistent_tape(jit):
    def grads(x, target):
        with dtape.GradientTape(persistent=True) as tape:
            tape.watch(x)
            viewed = x.view(-1, C)
            tape.watch(viewed)
            log_probs = F.log_softmax(viewed, dim=1)
            tape.watch(log_probs)
            loss = F.nll_loss(log_probs, target, reduction="sum")
        first = (tape.gradient(loss, x), tape.gradient(loss, viewed), tape.gradient(loss, log_probs))
        return first + (tape.gradient(loss, viewed),)   # asked twice

    if jit:
        grads = dtape.function(grads, jit_compile=True, backend=None)
    x0, target = _seeded(2, 2 * C), torch.tensor([0, 4, 2, -100])
    gx, gv, glp, gv_again = grads(dtape.constant(x0), dtape.constant(target))
    ex, ev, elp = _torch_intermediate_grads(x0, target)
    assert torch.equal(gx.torch(), ex) and torch.equal(gv.torch(), ev) and torch.equal(glp.torch(), elp)
    assert torch.equal(gv_again.torch(), ev)


def _second_order(x0, target, loss_fn, **kwargs):
    """(gradient, gradient of a weighted square of it) with an upstream that depends on x: dtape and torch."""
    weights = torch.arange(x0.numel(), dtype=f64).reshape(x0.shape)
    xv = dtape.Variable(x0.clone())
    with dtape.GradientTape() as outer:
        with dtape.GradientTape() as inner:
            total = dtape.reduce_sum(loss_fn(xv.view(-1).reshape(x0.shape), dtape.constant(target), **kwargs)
                                     * dtape.reduce_sum(xv * xv))
        g = inner.gradient(total, xv)
        penalty = dtape.reduce_sum(g * g * weights)
    xt = x0.clone().requires_grad_()
    gt, = torch.autograd.grad((loss_fn(xt, target, **kwargs) * (xt * xt).sum()).sum(), xt, create_graph=True)
    ht, = torch.autograd.grad((gt * gt * weights).sum(), xt)
    return (g.torch(), outer.gradient(penalty, xv).torch()), (gt.detach(), ht)


def _nll_of_log_softmax(x, target, **kwargs):
    return F.nll_loss(torch.log_softmax(x, 1 if x.ndim == 2 else 0), target, **kwargs)


X = _seeded(4, C, seed=2)
SECOND_ORDER = {
    "ce": (X, torch.tensor([1, -100, 4, 2]), {}),
    "ce uint8 valid class ignored": (X, torch.tensor([1, 0, 4, 2], dtype=torch.uint8), dict(ignore_index=4)),
    "ce uint8 255 ignored": (X, torch.tensor([1, 255, 4, 255], dtype=torch.uint8), dict(ignore_index=255)),
    "ce [C] 0-d target": (X[0], torch.tensor(3), {}),
    "ce [C] ignored": (X[0], torch.tensor(3), dict(ignore_index=3)),
    "ce N=0": (torch.zeros(0, C, dtype=f64), torch.zeros(0, dtype=torch.long), {}),
    "ce all ignored": (X, torch.full((4,), -100), {}),
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("x0,target,kwargs", SECOND_ORDER.values(), ids=SECOND_ORDER.keys())
def test_second_order_with_a_non_constant_upstream_equals_torch(x0, target, kwargs, reduction):
    got, expected = _second_order(x0, target, F.cross_entropy, reduction=reduction, **kwargs)
    assert _close(got[0], expected[0], 1e-13, 1e-15) and _close(got[1], expected[1], 1e-11, 1e-13)


def test_second_order_of_nll_over_log_softmax_with_a_valid_class_ignored():
    got, expected = _second_order(X, torch.tensor([1, 0, 4, 2]), _nll_of_log_softmax, ignore_index=4)
    assert _close(got[0], expected[0], 1e-13, 1e-15) and _close(got[1], expected[1], 1e-11, 1e-13)


def test_second_order_inside_a_compiled_function():
    w = dtape.Variable(_seeded(C, C))

    @dtape.function(jit_compile=True, backend=None)
    def hessian_term(x, y):
        with dtape.GradientTape() as outer:
            with dtape.GradientTape() as inner:
                losses = F.cross_entropy(dtape.matmul(x, w).view(-1, C), y, reduction="none")
                total = dtape.reduce_sum(losses * dtape.reduce_sum(w * w))
            g = inner.gradient(total, w)
            penalty = dtape.reduce_sum(g * g)
        return outer.gradient(penalty, w)

    x, y = _seeded(3, C, seed=3), torch.tensor([1, -100, 2])
    wt = _seeded(C, C).requires_grad_()
    gt, = torch.autograd.grad((F.cross_entropy(x @ wt, y, reduction="none") * (wt * wt).sum()).sum(), wt,
                              create_graph=True)
    expected, = torch.autograd.grad((gt * gt).sum(), wt)
    assert _close(hessian_term(dtape.constant(x), dtape.constant(y)).torch(), expected, 1e-11, 1e-14)


FORWARD = {
    "int64": (X, torch.tensor([1, -100, 4, 2]), {}),
    "uint8 valid class ignored": (X, torch.tensor([1, 0, 4, 2], dtype=torch.uint8), dict(ignore_index=4)),
    "[C]": (X[0], torch.tensor(3), {}),
    "all ignored": (X, torch.full((4,), -100), {}),
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("x0,target,kwargs", FORWARD.values(), ids=FORWARD.keys())
def test_forward_accumulator_through_view_and_cross_entropy(x0, target, kwargs, reduction):
    tangent = _seeded(x0.numel(), seed=9)
    flat = dtape.constant(x0.reshape(-1))
    with dtape.autodiff.ForwardAccumulator(flat, dtape.constant(tangent)) as acc:
        loss = F.cross_entropy(flat.view(x0.shape), dtape.constant(target), reduction=reduction, **kwargs)
        nll = F.nll_loss(flat.reshape(x0.shape).log_softmax(-1), dtape.constant(target), reduction=reduction,
                         **kwargs)
    _, expected = torch.func.jvp(lambda t: F.cross_entropy(t.view(x0.shape), target, reduction=reduction, **kwargs),
                                 (x0.reshape(-1),), (tangent,))
    assert _close(acc.jvp(loss).torch(), expected, 1e-13, 1e-15) and _close(acc.jvp(nll).torch(), expected, 1e-13, 1e-15)


def test_forward_over_back_hessian_vector_product():
    xv, v, target = dtape.Variable(X.clone()), _seeded(4, C, seed=5), torch.tensor([1, -100, 4, 2])
    with dtape.autodiff.ForwardAccumulator(xv, dtape.constant(v)) as acc:
        with dtape.GradientTape() as tape:
            loss = F.cross_entropy(xv.view(-1).view(4, C), dtape.constant(target))
        grad = tape.gradient(loss, xv)
    _, expected = torch.func.jvp(torch.func.grad(lambda u: F.cross_entropy(u, target)), (X,), (v,))
    assert _close(acc.jvp(grad).torch(), expected, 1e-12, 1e-15)


def test_paused_recording_gives_no_gradient_and_torchs_value():
    xv, target = dtape.Variable(X.clone()), dtape.constant(torch.tensor([1, -100, 4, 2]))
    with dtape.GradientTape(persistent=True) as tape:
        logits = xv * 1.0
        with tape.stop_recording():
            paused = F.cross_entropy(logits.view(4, C), target)
        with torch.no_grad():
            no_grad = F.cross_entropy(logits.view(-1, C), target)
        with dtape.stop_recording():
            nll = F.nll_loss(F.log_softmax(logits.reshape(4, C), 1), target)
    expected = F.cross_entropy(X, target.torch())
    for loss in (paused, no_grad, nll):
        assert torch.equal(loss.torch(), expected)
        assert tape.gradient(loss, xv) is None
        zero = tape.gradient(loss, xv, unconnected_gradients=dtape.UnconnectedGradients.ZERO)
        assert torch.equal(zero.torch(), torch.zeros_like(X))


MIRROR_X, MIRROR_Y = _seeded(8, 6, seed=3), torch.tensor([0, -1, 4, 2, 1, 3, -1, 0])


def _mirrored_run(strategy, jit):
    """Three SGD steps of a replica loss (cross_entropy + nll over log_softmax, summed / global batch)."""
    with strategy.scope():
        w = dtape.Variable(_seeded(6, C, seed=4))
        opt = dtape.optimizers.SGD(0.1)

    def step(x, y):
        with dtape.GradientTape() as tape:
            logits = dtape.matmul(x, w).view(-1, 1, C).reshape(-1, C)
            loss = (F.cross_entropy(logits, y.view(-1), ignore_index=-1, reduction="sum")
                    + F.nll_loss(F.log_softmax(logits, dim=-1), y, ignore_index=-1, reduction="sum")) / 8.0
        opt.apply_gradients([(tape.gradient(loss, w), w)])
        return loss

    step = dtape.function(step, jit_compile=True, backend=None) if jit else step
    losses = [float(strategy.reduce("SUM", strategy.run(step, args=batch), axis=None))
              for _ in range(3) for batch in strategy.experimental_distribute_dataset([(MIRROR_X, MIRROR_Y)])]
    return np.array(losses), w.numpy().copy()


def _torch_mirrored_reference():
    w, losses = _seeded(6, C, seed=4), []
    for _ in range(3):
        w.requires_grad_()
        logits = MIRROR_X @ w
        loss = (F.cross_entropy(logits, MIRROR_Y, ignore_index=-1, reduction="sum")
                + F.nll_loss(F.log_softmax(logits, -1), MIRROR_Y, ignore_index=-1, reduction="sum")) / 8.0
        grad, = torch.autograd.grad(loss, w)
        losses.append(loss.item())
        w = (w - 0.1 * grad).detach()
    return np.array(losses), w.numpy()


@pytest.fixture
def forced_interleaving():
    """Python switches threads every microsecond, so replica threads interleave inside the ops."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_mirrored_replicas_interleaved_equal_one_device_and_torch(jit, forced_interleaving):
    expected_losses, expected_w = _torch_mirrored_reference()
    one = _mirrored_run(dtape.distribute.OneDeviceStrategy("cpu"), jit)
    with dtape.distribute.MirroredStrategy(devices=["cpu:0", "cpu:1"]) as strategy:
        two = _mirrored_run(strategy, jit)
    for losses, w in (one, two):
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-13, atol=0)
        np.testing.assert_allclose(w, expected_w, rtol=1e-12, atol=1e-15)


def _outcome(fn):
    """("ok", (loss, grad)) or ("error", exception type)."""
    try:
        return "ok", fn()
    except Exception as e:   # the type is compared with torch's
        return "error", type(e)


def _dtape_case(fn, x, target, wrap_target=True, variable=False, **kwargs):
    xv = dtape.Variable(x.clone())
    with dtape.GradientTape() as tape:
        loss = fn(xv if variable else xv * 1.0, dtape.constant(target) if wrap_target else target, **kwargs)
        total = dtape.reduce_sum(loss * torch.arange(1, 1 + loss.numel(), dtype=loss.dtype).reshape(loss.shape))
    return loss.torch(), tape.gradient(total, xv).torch()


def _torch_case(fn, x, target, variable=False, **kwargs):
    xt = x.clone().requires_grad_()
    loss = fn(xt if variable else xt * 1.0, target, **kwargs)
    total = (loss * torch.arange(1, 1 + loss.numel(), dtype=loss.dtype).reshape(loss.shape)).sum()
    return loss.detach(), torch.autograd.grad(total, xt)[0]


def _assert_as_torch(fn, x, target, wrap_target=True, variable=False, **kwargs):
    got = _outcome(lambda: _dtape_case(fn, x, target, wrap_target, variable, **kwargs))
    expected = _outcome(lambda: _torch_case(fn, x, target, variable, **kwargs))
    assert got[0] == expected[0], (got, expected)
    if got[0] == "error":
        assert got[1] is expected[1]
    else:
        assert _same(got[1][0], expected[1][0]) and _same(got[1][1], expected[1][1])


T = torch.tensor([1, 0, 4, 2])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("fn", [F.cross_entropy, _nll_of_log_softmax], ids=["cross_entropy", "nll(log_softmax)"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, f64])
def test_logit_dtypes_bit_for_bit(dtype, fn, reduction):
    _assert_as_torch(fn, _seeded(4, C, seed=6, dtype=dtype), T, reduction=reduction)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.bool])
@pytest.mark.parametrize("fn", [F.cross_entropy, F.nll_loss], ids=["cross_entropy", "nll_loss"])
def test_target_dtypes_work_or_raise_as_torch(fn, dtype):
    _assert_as_torch(fn, X, T.to(dtype))


NINF = torch.tensor([[-float("inf")] * 3, [0.0, 1.0, 2.0]], dtype=f64)
NAN = torch.tensor([[float("nan"), 0.0, 1.0], [0.0, 1.0, 2.0]], dtype=f64)
BIG = torch.tensor([[1e30, 0.0, -1e30], [1e30, 1e30, 0.0], [-1e30, -1e30, -1e30]], dtype=f64)
EDGES = {
    "uint8 valid class ignored": (X, T.to(torch.uint8), dict(ignore_index=4, reduction="none")),
    "int64 class 0 ignored": (X, T, dict(ignore_index=0)),
    "ignore_index 0-d torch tensor": (X, T, dict(ignore_index=torch.tensor(4))),
    "N=0": (torch.zeros(0, C, dtype=f64), torch.zeros(0, dtype=torch.long), {}),
    "N=0 none": (torch.zeros(0, C, dtype=f64), torch.zeros(0, dtype=torch.long), dict(reduction="none")),
    "C=1": (_seeded(3, 1), torch.zeros(3, dtype=torch.long), {}),
    "C=0": (torch.zeros(3, 0, dtype=f64), torch.zeros(3, dtype=torch.long), {}),
    "[C] uint8 0-d target": (X[0], torch.tensor(2, dtype=torch.uint8), {}),
    "1e30 f64": (BIG, torch.tensor([1, 0, 2]), dict(reduction="none")),
    "1e30 f32": (BIG.float(), torch.tensor([1, 0, 2]), dict(reduction="none")),
    "-inf row none": (NINF, torch.tensor([1, 0]), dict(reduction="none")),
    "-inf row mean": (NINF, torch.tensor([1, 0]), {}),
    "-inf row ignored": (NINF, torch.tensor([-100, 0]), {}),
    "nan row ignored": (NAN, torch.tensor([-100, 0]), {}),
    "nan sum": (NAN, torch.tensor([2, 0]), dict(reduction="sum")),
    "target out of range": (X, torch.tensor([0, 5, 1, 1]), {}),
    "negative target not ignored": (X, torch.tensor([0, -2, 1, 1]), {}),
    "[N, 1] target": (X, T[:, None], {}),
}


@pytest.mark.parametrize("x,target,kwargs", EDGES.values(), ids=EDGES.keys())
def test_edge_values_and_targets_as_torch(x, target, kwargs):
    _assert_as_torch(F.cross_entropy, x, target, **kwargs)


METHODS = {
    "cross_entropy": lambda a, b: F.cross_entropy(a, b),
    "nll_loss none": lambda a, b: F.nll_loss(a, b, reduction="none"),
    "log_softmax": lambda a, b: F.log_softmax(a, 1),
    "view chain": lambda a, b: F.cross_entropy(a.view(2, 10).view(-1, C), b),
    "reshape chain": lambda a, b: F.cross_entropy(a.reshape(20).reshape((4, C)), b),
    "view torch.Size": lambda a, b: F.cross_entropy(a.view(-1).view(torch.Size([4, C])), b),
    "view list": lambda a, b: F.cross_entropy(a.view(-1).view([4, C]), b),
    "view size=": lambda a, b: F.cross_entropy(a.view(-1).view(size=(4, C)), b),
    "reshape shape=": lambda a, b: F.cross_entropy(a.reshape(-1).reshape(shape=(4, C)), b),
    "log_softmax forms": lambda a, b: F.log_softmax(a, dim=-2) + torch.log_softmax(a, 1, dtype=f64)
    + a.log_softmax(dim=0) + F.log_softmax(a, np.int64(1)),
}


@pytest.mark.parametrize("variable", [True, False], ids=["on a Variable", "on a Tensor"])
@pytest.mark.parametrize("fn", METHODS.values(), ids=METHODS.keys())
def test_methods_on_variables_and_tensors_as_torch(fn, variable):
    _assert_as_torch(fn, X, T, variable=variable)


def test_dtape_logits_with_a_torch_target():
    _assert_as_torch(F.cross_entropy, X, torch.tensor([1, -100, 4, 2]), wrap_target=False)


def test_torch_logits_with_a_dtape_target():
    xt = X.clone().requires_grad_()
    loss = F.cross_entropy(xt * 1.0, dtape.constant(T))
    value = loss.torch() if isinstance(loss, dtape.Tensor) else loss.detach()
    assert torch.equal(value, F.cross_entropy(X, T))


def test_logits_read_out_as_torch_have_no_tape_gradient():
    # .torch() leaves the tape: the loss of the raw tensor is not connected to the variable (TF's None)
    xv = dtape.Variable(X.clone())
    with dtape.GradientTape() as tape:
        loss = F.cross_entropy((xv * 1.0).torch(), dtape.constant(T))
    assert tape.gradient(loss, xv) is None


def _fit_history(loss, images, labels, w0):
    model = dtape.keras.Sequential([dtape.layers.Dense(4)])
    model.build((None, 6))
    for v, value in zip(model.trainable_variables, w0):
        v.assign(value)
    model.compile(optimizer=dtape.optimizers.SGD(0.1), loss=loss)
    history = model.fit(images.numpy(), labels.numpy(), batch_size=8, epochs=1, shuffle=False, verbose=0)
    return history.history["loss"][0], [v.numpy() for v in model.trainable_variables]


def _torch_sgd(images, labels, w0):
    kernel, bias, losses = torch.tensor(w0[0]), torch.tensor(w0[1]), []
    for i in range(0, len(images), 8):
        kernel.requires_grad_(), bias.requires_grad_()
        loss = F.cross_entropy(images[i:i + 8] @ kernel + bias, labels[i:i + 8])
        gk, gb = torch.autograd.grad(loss, [kernel, bias])
        losses.append(loss.item())
        kernel, bias = (kernel - 0.1 * gk).detach(), (bias - 0.1 * gb).detach()
    return np.mean(losses), [kernel.numpy(), bias.numpy()]


FIT_LOSSES = {
    "per-example": lambda yt, yp: F.cross_entropy(yp.view(-1, 4), dtape.cast(yt, torch.int64).view(-1),
                                                  reduction="none"),
    "batch mean": lambda yt, yp: F.cross_entropy(yp, dtape.cast(yt, torch.int64)),
}


@pytest.mark.parametrize("loss", FIT_LOSSES.values(), ids=FIT_LOSSES.keys())
def test_model_fit_with_a_cross_entropy_loss_function_equals_torch_sgd(loss):
    images, labels = _seeded(32, 6, seed=7, dtype=torch.float32), torch.randint(0, 4, (32,),
                                                                               generator=torch.Generator().manual_seed(7))
    w0 = [_seeded(6, 4, seed=8, dtype=torch.float32).numpy(), np.zeros(4, np.float32)]
    got_loss, got_w = _fit_history(loss, images, labels, w0)
    expected_loss, expected_w = _torch_sgd(images, labels, w0)
    assert got_loss == pytest.approx(expected_loss, rel=1e-6)
    for got, expected in zip(got_w, expected_w):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_recompute_grad_body_with_view_and_cross_entropy():
    target = torch.tensor([1, -100, 4, 2])
    body = dtape.recompute_grad(lambda x: F.cross_entropy(x.view(-1).view(4, C), dtape.constant(target),
                                                          reduction="none"))
    xv, weights = dtape.Variable(X.clone()), torch.arange(4, dtype=f64)
    with dtape.GradientTape() as tape:
        total = dtape.reduce_sum(body(xv * 1.0) * weights)
    xt = X.clone().requires_grad_()
    expected, = torch.autograd.grad((F.cross_entropy(xt, target, reduction="none") * weights).sum(), xt)
    assert torch.equal(tape.gradient(total, xv).torch(), expected)
