"""Variables: creator stack, assignment, reads and their gradients."""
import threading

import numpy as np
import pytest
import torch

import dtape

D = torch.float64


def test_variable_creator_scope_nested_innermost_runs_first():
    calls = []

    def creator(tag):
        def create(next_creator, **kwargs):
            calls.append(tag)
            return next_creator(**kwargs)
        return create

    with dtape.variable_creator_scope(creator("outer")):
        with dtape.variable_creator_scope(creator("inner")):
            v = dtape.Variable(1.0)
        w = dtape.Variable(2.0)
    u = dtape.Variable(3.0)
    assert calls == ["inner", "outer", "outer"]
    assert isinstance(v, dtape.Variable) and float(w) == 2.0 and float(u) == 3.0


def test_variable_creator_scope_can_replace_kwargs():
    def double_init(next_creator, **kwargs):
        kwargs["initial_value"] = kwargs["initial_value"] * 2
        kwargs["trainable"] = False
        return next_creator(**kwargs)

    with dtape.variable_creator_scope(double_init):
        v = dtape.Variable(torch.tensor([1.0, 2.0], dtype=D))
    torch.testing.assert_close(v.torch(), torch.tensor([2.0, 4.0], dtype=D))
    assert not v.trainable


def test_variable_creator_scope_restored_on_exception():
    def boom(next_creator, **kwargs):
        raise KeyError("nope")

    with pytest.raises(KeyError):
        with dtape.variable_creator_scope(boom):
            dtape.Variable(1.0)
    assert float(dtape.Variable(5.0)) == 5.0


def test_variable_assign_methods_return_variable_and_update():
    v = dtape.Variable(torch.tensor([1.0, 2.0], dtype=D))
    assert v.assign([3.0, 4.0]) is v
    assert v.assign_add(dtape.constant([1.0, 1.0], dtype=D)) is v
    assert v.assign_sub(torch.tensor([0.5, 0.5], dtype=D)) is v
    torch.testing.assert_close(v.torch(), torch.tensor([3.5, 4.5], dtype=D))
    assert v.dtype == D


def test_variable_read_before_assign_keeps_old_value():
    v = dtape.Variable(torch.tensor([1.0, 2.0], dtype=D))
    before = v.read_value()
    v.assign_add([10.0, 10.0])
    v.assign([7.0, 7.0])
    torch.testing.assert_close(before.torch(), torch.tensor([1.0, 2.0], dtype=D))
    torch.testing.assert_close(v.read_value().torch(), torch.tensor([7.0, 7.0], dtype=D))


@pytest.mark.parametrize("method", ["assign", "assign_add", "assign_sub"])
def test_variable_assign_writes_in_place_when_nothing_else_holds_the_tensor(method):
    # The optimizers' rule, for assign*: no new weights per manual `w.assign_sub(lr * g)` step,
    # and the same bits as the copying form.
    gen = torch.Generator().manual_seed(0)
    old, delta = torch.randn(3, 4, generator=gen), torch.randn(4, generator=gen)   # delta broadcast over rows
    v = dtape.Variable(old)
    ptr = v.torch().data_ptr()
    getattr(v, method)(dtape.constant(delta))
    want = {"assign": delta.expand(3, 4), "assign_add": old + delta, "assign_sub": old - delta}[method]
    assert torch.equal(v.torch(), want) and v.dtype == torch.float32
    assert v.torch().data_ptr() == ptr


@pytest.mark.parametrize("hold", ["read_value", "torch", "torch_view", "numpy"])
def test_variable_assign_sub_leaves_a_value_taken_before_unchanged(hold):
    v = dtape.Variable(torch.tensor([1.0, 2.0], dtype=D))
    taken = {"read_value": lambda: v.read_value(), "torch": v.torch, "torch_view": lambda: v.torch()[1:],
             "numpy": v.numpy}[hold]()
    copy = np.array(taken.numpy() if isinstance(taken, (dtape.Tensor, torch.Tensor)) else taken)
    v.assign_sub([0.5, 0.5])
    v.assign_add([0.25, 0.25])
    v.assign([9.0, 9.0])
    now = taken.numpy() if isinstance(taken, (dtape.Tensor, torch.Tensor)) else taken
    np.testing.assert_array_equal(now, copy)
    assert v.numpy().tolist() == [9.0, 9.0]


def test_variable_assign_sub_keeps_gradients_through_earlier_reads():
    # The reads' tensors are held only by the tape's records (the read Tensors are dropped): writing
    # the variable in place would change what sin's and mul's rules read.
    x0 = torch.tensor([0.3, -1.2], dtype=D)
    v = dtape.Variable(x0)
    with dtape.GradientTape(persistent=True) as tape:
        y = dtape.reduce_sum(dtape.sin(v) + v * v)
    for _ in range(3):
        v.assign_sub([0.5, 0.5])
    assert v.numpy().tolist() == (x0 - 1.5).tolist()
    ref = x0.clone().requires_grad_()
    (torch.sin(ref) + ref * ref).sum().backward()
    torch.testing.assert_close(tape.gradient(y, v).torch(), ref.grad, rtol=1e-15, atol=0)
    with dtape.GradientTape() as outer:    # second order through a read taken before the write
        with dtape.GradientTape() as inner:
            z = dtape.reduce_sum(v * v * v)
        g = inner.gradient(z, v)
        v.assign_add([1.0, 1.0])
    torch.testing.assert_close(outer.gradient(g, v).torch(), 6 * (x0 - 1.5), rtol=1e-15, atol=0)


def test_variable_made_under_inference_mode_takes_assign_and_optimizer_writes_outside_it():
    # torch refuses in-place writes to an inference tensor outside inference mode: those go on a copy.
    with torch.inference_mode():
        v = dtape.Variable(torch.tensor([1.0, 2.0], dtype=D))
    v.assign_sub([1.0, 1.0])
    with torch.inference_mode():
        w = dtape.Variable(torch.tensor([1.0, 2.0], dtype=D))
    dtape.optimizers.SGD(0.5).apply_gradients([(dtape.constant([1.0, 1.0], dtype=D), w)])
    assert v.numpy().tolist() == [0.0, 1.0] and w.numpy().tolist() == [0.5, 1.5]


def test_variable_assign_shape_mismatch_raises_value_error():
    v = dtape.Variable(torch.zeros(3, dtype=D), name="w")
    with pytest.raises(ValueError, match=r"'w'.*\(2,\).*\(3,\)"):
        v.assign(torch.zeros(2, dtype=D))


def test_variable_non_trainable_not_auto_watched():
    v = dtape.Variable(2.0, trainable=False)
    w = dtape.Variable(3.0)
    with dtape.GradientTape(persistent=True) as t:
        y = v * w
    assert t.watched_variables() == (w,)
    assert t.gradient(y, v) is None
    assert float(t.gradient(y, w)) == 2.0


def test_variable_non_trainable_explicit_watch_gets_gradient():
    v = dtape.Variable(2.0, trainable=False)
    with dtape.GradientTape() as t:
        t.watch(v)
        y = v * v * v
    assert float(t.gradient(y, v)) == 12.0


def test_on_read_variable_defaults_to_not_trainable_as_tf():
    """tf.Variable: trainable defaults to True unless synchronization is ON_READ; explicit True stays."""
    on_read = dtape.VariableSynchronization.ON_READ
    sum_ = dtape.VariableAggregation.SUM
    strategy = dtape.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        m_default = dtape.Variable([1.0, -2.0])
        s_default = dtape.Variable([1.0, -2.0], synchronization=on_read, aggregation=sum_)
        s_trainable = dtape.Variable([1.0, -2.0], synchronization=on_read, aggregation=sum_, trainable=True)
    made_in_run = []
    strategy.run(lambda: made_in_run.append(  # created inside run: one merge_call makes it for all replicas
        dtape.Variable(3.0, synchronization=on_read, aggregation=sum_)))
    plain = [dtape.Variable(2.0, synchronization=on_read), dtape.Variable(2.0, synchronization=on_read,
                                                                           trainable=True),
             dtape.Variable(2.0), dtape.Variable(2.0, synchronization=None)]
    assert [v.trainable for v in plain] == [False, True, True, True]
    assert (m_default.trainable, s_default.trainable, s_trainable.trainable) == (True, False, True)
    assert [c.trainable for c in s_default.values] == [False, False]
    assert [c.trainable for c in s_trainable.values] == [True, True]
    assert made_in_run[0] is made_in_run[1] and made_in_run[0].trainable is False
    module = dtape.Module()
    module.vs = [m_default, s_default, s_trainable, plain[0], plain[1]]
    assert list(module.trainable_variables) == [m_default, s_trainable, plain[1]]
    with dtape.GradientTape(persistent=True) as t:  # not trainable: not watched automatically
        y = plain[0] * plain[1]
    assert t.watched_variables() == (plain[1],)
    assert t.gradient(y, plain[0]) is None and float(t.gradient(y, plain[1])) == 2.0
    with pytest.raises(ValueError, match="invalid variable synchronization 'on_read'"):
        dtape.Variable(1.0, synchronization="on_read")


def test_variable_in_operators_gradient_vs_torch():
    vt = torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=D)
    v = dtape.Variable(vt)
    with dtape.GradientTape() as t:
        y = dtape.reduce_sum((2.0 - v) * v / 4.0 + v @ v + v ** 2 + (-v)[0] + abs(v)[1])
    vr = vt.clone().requires_grad_()
    expected, = torch.autograd.grad(((2.0 - vr) * vr / 4.0 + vr @ vr + vr ** 2 + (-vr)[0] + vr.abs()[1]).sum(), vr)
    torch.testing.assert_close(t.gradient(y, v).torch(), expected)


def test_variable_in_torch_functions_gradient_vs_torch():
    vt = torch.tensor([0.2, -0.7, 1.1], dtype=D)
    v = dtape.Variable(vt)
    with dtape.GradientTape() as t:
        y = torch.sum(torch.tanh(v) * torch.nn.functional.softplus(v))
    assert isinstance(y, dtape.Tensor)
    vr = vt.clone().requires_grad_()
    expected, = torch.autograd.grad(torch.sum(torch.tanh(vr) * torch.nn.functional.softplus(vr)), vr)
    torch.testing.assert_close(t.gradient(y, v).torch(), expected)


def test_variable_gradient_sums_over_reads():
    v = dtape.Variable(torch.tensor(3.0, dtype=D))
    with dtape.GradientTape() as t:
        y = v.read_value() * 2.0 + v.value() * v
    assert float(t.gradient(y, v)) == 2.0 + 6.0


def test_variable_initial_value_callable_and_dtype():
    v = dtape.Variable(lambda: torch.ones(2), dtype=D, name="ones")
    assert v.dtype == D and v.name == "ones" and v.shape == (2,)
    with pytest.raises(ValueError, match="initial_value"):
        dtape.Variable()


# -- atomic writes ---------------------------------------------


def _run_threads(target, n_threads, timeout=30):
    threads = [threading.Thread(target=target) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a writer thread did not finish"


@pytest.mark.parametrize("method, sign", [("assign_add", 1.0), ("assign_sub", -1.0)])
def test_variable_concurrent_assign_add_sub_lose_no_update(fast_switching, method, sign):
    v = dtape.Variable(0.0)
    n = 4000

    def work():
        write = getattr(v, method)
        for _ in range(n):
            write(1.0)
    _run_threads(work, 4)
    assert float(v) == sign * 4 * n


def test_variable_update_value_is_the_locked_write_path():
    v = dtape.Variable(torch.tensor([1.0, 2.0], dtype=D), name="w")
    out = v._update_value(lambda old: old * 2)
    torch.testing.assert_close(v.torch(), torch.tensor([2.0, 4.0], dtype=D))
    assert out is v.torch()
    v._update_value(lambda old: torch.ones(2, dtype=torch.float32))  # cast to the variable's dtype
    assert v.dtype == D
    with pytest.raises(ValueError, match=r"'w'.*\(3,\).*\(2,\)"):
        v._update_value(lambda old: torch.zeros(3, dtype=D))
    assert v._lock.acquire(timeout=1)  # released after the error
    v._lock.release()


# -- a variable as the gradient target -------------------------
def test_gradient_of_variable_wrt_itself_is_one():
    v = dtape.Variable(torch.tensor([2.0, -1.0], dtype=D))
    w = dtape.Variable(3.0)
    with dtape.GradientTape(persistent=True) as tape:
        y = v * 3.0
    torch.testing.assert_close(tape.gradient(v, v).torch(), torch.ones(2, dtype=D))
    torch.testing.assert_close(tape.gradient([v, y], v).torch(), torch.full((2,), 4.0, dtype=D))
    assert tape.gradient(w, v) is None
    torch.testing.assert_close(tape.jacobian(v, v).torch(), torch.eye(2, dtype=D))


def test_gradient_of_max_of_variables_picks_the_largest():
    a, b, c = dtape.Variable(1.0), dtape.Variable(3.0), dtape.Variable(2.0)
    with dtape.GradientTape() as tape:
        top = max([a, b, c])
    grads = tape.gradient(top, [a, b, c])
    assert grads[0] is None and grads[2] is None
    assert float(grads[1]) == 1.0


def test_variables_share_tensors_operator_table():
    """One operator table: every Tensor operator exists on every variable class and reads first."""
    strategy = dtape.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        mirrored = dtape.Variable([1.0, -2.0])
        on_read = dtape.Variable([1.0, -2.0], synchronization=dtape.VariableSynchronization.ON_READ,
                                 aggregation=dtape.VariableAggregation.ONLY_FIRST_REPLICA, trainable=True)
    plain = dtape.Variable([1.0, -2.0])
    t = dtape.constant([1.0, -2.0])
    for v in (plain, mirrored, on_read):
        for name in dtape.Tensor._operator_names:
            assert getattr(type(v), name) is not getattr(object, name, None), (type(v).__name__, name)
        np.testing.assert_array_equal((v == t).numpy(), [True, True])
        np.testing.assert_array_equal((v != 1.0).numpy(), [False, True])
        np.testing.assert_array_equal((~(v > 0.0)).numpy(), [False, True])
        assert [float(x) for x in v] == [1.0, -2.0]
        with dtape.GradientTape() as tape:
            y = dtape.reduce_sum(-v * abs(v))
        assert tape.gradient(y, v) is not None
    strategy.close()
