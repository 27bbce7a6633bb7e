"""Tape memory: what records save, trace deletion, the per-walk fast path, GC objects."""
import gc
import threading

import pytest
import torch

import dtape
from dtape import backprop

D = torch.float64
TIMEOUT = 5


def _c(v):
    return dtape.constant(torch.as_tensor(v, dtype=D))


def _x():
    return _c(torch.linspace(-1.0, 1.0, 16).reshape(4, 4))  # 128 bytes


def test_records_save_only_what_each_rule_reads():
    x, w = _x(), _c(torch.full((4, 4), 0.5))
    with dtape.GradientTape(persistent=True) as t:
        t.watch([x, w])
        a = x + w                       # no tensors
        b = dtape.reshape(dtape.transpose(a - w), (16,))  # no tensors
        assert t.num_records() == 4 and t.nbytes() == 0
        c = dtape.exp(b)                # its output only
        assert t.nbytes() == c.torch().untyped_storage().nbytes() == 128
        d = c * x.torch().reshape(16)   # both inputs: c (already saved) and a constant
        assert t.num_records() == 6 and t.nbytes() == 256
        e = dtape.tanh(d) + dtape.nn.relu(d) + dtape.sigmoid(d)  # three outputs
        assert t.nbytes() == 256 + 3 * 128
    records = {}
    for r in t._tape.records():
        records.setdefault(r[0].name, r)  # the first of each op
    placeholder = records["add"][3][0]  # kept as metadata: a zero tensor owning one element, same id
    assert placeholder.torch().untyped_storage().nbytes() == 8 and placeholder.shape == (4, 4)
    assert placeholder._id == x._id
    assert records["exp"][4][0].torch() is c.torch() and records["exp"][4][0]._id == c._id
    g = t.gradient(e, x)
    xt = x.torch().clone().requires_grad_()
    ct = torch.exp(torch.reshape(torch.transpose(xt + 0.5 - 0.5, 0, 1), (16,)))
    dt = ct * xt.detach().reshape(16)
    torch.autograd.backward(torch.tanh(dt) + torch.relu(dt) + torch.sigmoid(dt), torch.ones(16, dtype=D))
    torch.testing.assert_close(g.torch(), xt.grad)


def test_shared_storage_counts_once():
    x = _x()
    with dtape.GradientTape() as t:
        t.watch(x)
        y = x * x
        z = y * dtape.reshape(x, (4, 4))  # a view of x's storage: not counted again
    assert t.nbytes() == 2 * 128 and t.num_records() == 3
    t.gradient(z, x)


def test_persistent_tape_over_10000_steps_keeps_records_and_bytes_flat():
    x = _x()
    with dtape.GradientTape(persistent=True) as t:
        t.watch(x)
        for step in range(10_000):
            y = dtape.tanh(x * 2.0) + float(step)  # the previous y (and its intermediates) die here
            if step == 10:
                counts = (t.num_records(), t.nbytes())
        assert (t.num_records(), t.nbytes()) == counts == (3, 2 * 128)  # x * 2 keeps x; tanh its output
    torch.testing.assert_close(t.gradient(y, x).torch(), 2 * (1 - torch.tanh(2 * x.torch()) ** 2))


def test_dead_intermediates_on_the_path_to_a_live_target_stay():
    x = _x()
    with dtape.GradientTape(persistent=True) as t:
        t.watch(x)
        y = x
        for _ in range(20):
            y = dtape.sin(y) * 1.5  # every intermediate Tensor dies, the chain to y is needed
        dead = dtape.exp(x)
        del dead                # nothing uses it: deleted
    assert t.num_records() == 40
    xt = x.torch().clone().requires_grad_()
    yt = xt
    for _ in range(20):
        yt = torch.sin(yt) * 1.5
    torch.testing.assert_close(t.gradient(y, x).torch(), torch.autograd.grad(yt.sum(), xt)[0])


def test_multi_output_record_stays_while_any_output_lives():
    x = _c(torch.arange(6.0))
    with dtape.GradientTape(persistent=True) as t:
        t.watch(x)
        a, b = dtape.split(x * 1.0, 2)
        del a
        assert t.num_records() == 2
        torch.testing.assert_close(t.gradient(b, x).torch(), torch.tensor([0, 0, 0, 1, 1, 1], dtype=D))
        del b
        assert t.num_records() == 0 and t.nbytes() == 0


def test_non_persistent_tape_frees_everything_at_its_gradient():
    x = _x()
    with dtape.GradientTape() as t:
        t.watch(x)
        h = dtape.exp(x) * x
        loss = dtape.reduce_sum(h)
    import weakref
    saved = weakref.ref(t._tape.records()[0][4][0].torch())  # exp's saved output (h and x keep none of it)
    assert t.num_records() == 3 and t.nbytes() == 2 * 128
    t.gradient(loss, x)
    assert t.num_records() == 0 and t.nbytes() == 0
    gc.collect()
    assert saved() is None


def test_non_persistent_walk_frees_each_records_saved_tensors_once_used():
    """Peak memory falls during the walk (as torch frees saved tensors without retain_graph)."""
    import weakref
    seen = []

    @dtape.custom_gradient
    def probe(v):
        def grad(dy):
            seen.append(ref())  # exp's saved output, whose record the walk processed just before
            return dy
        return dtape.identity(v), grad

    for persistent in (False, True):
        x = _x()
        with dtape.GradientTape(persistent=persistent) as t:
            t.watch(x)
            e = dtape.exp(probe(x) * 2.0)
            ref = weakref.ref(e.torch())
            loss = dtape.reduce_sum(e * 3.0)
            del e
        g = t.gradient(loss, x)
        torch.testing.assert_close(g.torch(), 6.0 * torch.exp(2.0 * x.torch()))
    assert seen[0] is None, "the non-persistent walk kept exp's saved output after using it"
    assert seen[1] is not None, "a persistent tape must keep its records for the next gradient()"


def test_tracked_objects_per_recorded_op_stay_few():
    """Records allocate at most ~one GC-tracked object per op beyond the saved tensors (point 5)."""
    x, w, b = _x(), _x(), _x()
    n = 3000
    with dtape.GradientTape() as t:
        t.watch([x, w, b])
        y = x
        gc.collect()
        before = len(gc.get_objects())
        for i in range(n):
            k = i % 3
            y = y * w if k == 0 else (y + b if k == 1 else dtape.tanh(y))
        gc.collect()
        per_op = (len(gc.get_objects()) - before) / n
    assert t.num_records() == n
    # one record per op (its saved entries in its own slots), and a torch tensor per tanh (its output;
    # the mul after it saves that same tensor)
    assert per_op <= 1.4, per_op
    t.gradient(y, x)


def test_walk_is_raw_with_an_unrelated_tape_on_another_thread_or_not_watching():
    x = _x()
    opened, done = threading.Event(), threading.Event()

    def other():
        with dtape.GradientTape() as other_tape:
            other_tape.watch(_x())
            opened.set()
            done.wait(TIMEOUT)

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    try:
        assert opened.wait(TIMEOUT)
        with dtape.GradientTape() as unrelated:
            unrelated.watch(_x())  # recording on this thread, watching nothing the walk reads
            with dtape.GradientTape() as t:
                t.watch(x)
                y = dtape.tanh(x) * x
            g = t.gradient(y, x)
            assert backprop.walk_info.last_raw is True
        assert unrelated.num_records() == 0
    finally:
        done.set()
        thread.join(TIMEOUT)
    xt = x.torch()
    torch.testing.assert_close(g.torch(), (1 - torch.tanh(xt) ** 2) * xt + torch.tanh(xt))


@pytest.mark.parametrize("persistent_inner", [False, True])
def test_nested_tape_watching_the_walk_records_it_for_higher_order(persistent_inner):
    x = _x()
    with dtape.GradientTape() as outer:
        outer.watch(x)
        with dtape.GradientTape(persistent=persistent_inner) as inner:
            inner.watch(x)
            y = dtape.tanh(x) * x
        g = inner.gradient(y, x)
        assert backprop.walk_info.last_raw is False
    gg = outer.gradient(g, x)
    xt = x.torch().clone().requires_grad_()
    (gt,) = torch.autograd.grad((torch.tanh(xt) * xt).sum(), xt, create_graph=True)
    torch.testing.assert_close(gg.torch(), torch.autograd.grad(gt.sum(), xt)[0])


def test_matmul_keeps_both_inputs_so_a_partner_watched_later_gets_its_gradient():
    # What a record keeps must not depend on what was watched when the op ran: `w` is kept although
    # only `x` was watched then, so watching `w` afterwards gives its gradient (it gave None).
    x, w = _c(torch.randn(8, 16, generator=torch.Generator().manual_seed(0))), _c(torch.ones(16, 4))
    with dtape.GradientTape(persistent=True) as t:
        t.watch(x)
        y = dtape.matmul(x, w)
        assert t.nbytes() == x.torch().untyped_storage().nbytes() + w.torch().untyped_storage().nbytes()
        t.watch(w)
    torch.testing.assert_close(t.gradient(y, x).torch(), torch.full((8, 16), 4.0, dtype=D))
    torch.testing.assert_close(t.gradient(y, w).torch(), x.torch().sum(0)[:, None].expand(16, 4))


def test_divide_keeps_both_tensors_and_nothing_for_a_number_denominator():
    x, s = _c(torch.linspace(1.0, 2.0, 64).reshape(8, 8)), _c(torch.full((8, 8), 4.0))
    with dtape.GradientTape(persistent=True) as t:
        t.watch(x)
        y = x / 3.0                 # scores / scale: nothing kept (a number never asks for its gradient)
        assert t.nbytes() == 0
        z = x / s                   # s not watched yet: both kept (s may be watched later)
        assert t.nbytes() == x.torch().untyped_storage().nbytes() + s.torch().untyped_storage().nbytes()
        t.watch(s)
    torch.testing.assert_close(t.gradient(y, x).torch(), torch.full((8, 8), 1 / 3.0, dtype=D))
    torch.testing.assert_close(t.gradient(z, x).torch(), torch.full((8, 8), 0.25, dtype=D))
    torch.testing.assert_close(t.gradient(z, s).torch(), -x.torch() / 16.0)  # None before


def test_a_partner_watched_after_the_op_gets_the_gradient_torch_gives():
    """`t.watch(q)` after `p * q`, `p / q` or `matmul(p, q)` ran: q's gradient as torch.autograd's."""
    gen = torch.Generator().manual_seed(3)
    p0, q0 = torch.randn(3, 3, generator=gen, dtype=D), torch.rand(3, 3, generator=gen, dtype=D) + 0.5
    for f, ref in ((lambda p, q: p * q, torch.mul), (lambda p, q: p / q, torch.div),
                   (dtape.matmul, torch.matmul)):
        p, q = _c(p0), _c(q0)
        with dtape.GradientTape() as t:
            t.watch(p)
            y = f(p, q)
            t.watch(q)
        qt = q0.clone().requires_grad_()
        expected, = torch.autograd.grad(ref(p0, qt).sum(), qt)
        torch.testing.assert_close(t.gradient(y, q).torch(), expected)


def test_raw_walk_accumulates_gradients_in_place_but_never_into_a_tensor_it_does_not_own():
    """Sums of gradients reuse the walk's own buffer (torch's accumulation); a user's output gradient,
    a saved tensor or a broadcast view is never written."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    n = 128  # 16,384 elements: smaller sums get a new buffer (cheaper than the checks)
    x0 = torch.linspace(-1.0, 1.0, n * n, dtype=D).reshape(n, n)
    x = _c(x0)
    with dtape.GradientTape() as t:
        t.watch(x)
        z = x * 2.0                 # processed second: its gradient adds into the first term
        y = dtape.identity(x)       # processed first: its gradient is the caller's tensor itself
    du, dv = _c(torch.full((n, n), 3.0, dtype=D)), _c(torch.full((n, n), 5.0, dtype=D))
    g = t.gradient([y, z], x, output_gradients=[du, dv])
    assert torch.equal(du.torch(), torch.full((n, n), 3.0, dtype=D)), "the caller's output gradient was written"
    assert torch.equal(g.torch(), torch.full((n, n), 13.0, dtype=D))
    with dtape.GradientTape() as t:
        t.watch(x)
        loss = dtape.reduce_sum(x * 2.0 + x * 3.0 + dtape.tanh(x))
    with Ops() as seen:
        g = t.gradient(loss, x)
    tx = x0.clone().requires_grad_()
    want, = torch.autograd.grad(torch.sum(tx * 2.0 + tx * 3.0 + torch.tanh(tx)), tx)
    torch.testing.assert_close(g.torch(), want, rtol=1e-12, atol=0)
    assert seen.names.count("add_") == 2 and seen.names.count("add") == 0, seen.names


def test_raw_walk_never_accumulates_into_memory_a_gradient_rule_borrowed_from_numpy():
    """A custom gradient made from the user's numpy array (dtape.from_dlpack: dtape never writes to it)."""
    import numpy as np
    user = np.full(1 << 14, 10.0)  # large enough for in-place sums

    @dtape.custom_gradient
    def f(x):
        def grad(dy):
            return dtape.from_dlpack(user)
        return x * 1.0, grad

    x = _c(torch.ones(1 << 14))
    with dtape.GradientTape() as t:
        t.watch(x)
        a = x * 5.0                     # processed after f's rule: adds into f's gradient
        y = dtape.reduce_sum(a) + dtape.reduce_sum(f(x))
    assert (t.gradient(y, x).numpy() == 15.0).all()
    assert (user == 10.0).all()


def test_nbytes_counts_the_statistics_a_layer_norm_record_keeps():
    """layer_norm's record keeps native_layer_norm's mean and 1/std (its attrs) beside its inputs: nbytes counts them."""
    x = dtape.constant(torch.randn(6, 4, dtype=D))
    gamma, beta = _c(torch.ones(4)), _c(torch.zeros(4))
    with dtape.GradientTape() as t:
        t.watch(x)
        y = dtape.nn.layer_norm(x, gamma, beta)
        inputs = 6 * 4 * 8 + 2 * 4 * 8
        assert t.nbytes() == inputs + 2 * 6 * 8  # mean and 1/std: one float64 per row each
    assert t.gradient(y, x).shape == (6, 4)
