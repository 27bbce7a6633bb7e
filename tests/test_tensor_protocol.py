"""Tensors and variables behave like numbers and arrays.

f-string formatting, numpy arrays on the left of operators (recorded, so
gradients flow), dtype names and `as_dtype`, repr of bfloat16/float16,
the mixed-dtype matmul message, and DLPack.
"""
import operator

import numpy as np
import pytest
import torch

import dtape

F64 = torch.float64


@pytest.fixture(scope="module")
def strategy():
    return dtape.distribute.MirroredStrategy(["cpu:0", "cpu:1"])


def _variables(strategy, value, **kw):
    """A plain, a mirrored and a sync-on-read variable holding `value`."""
    with strategy.scope():
        mirrored = dtape.Variable(value, **kw)
        on_read = dtape.Variable(value, synchronization=dtape.VariableSynchronization.ON_READ,
                                 aggregation=dtape.VariableAggregation.ONLY_FIRST_REPLICA, **kw)
    return [dtape.Variable(value, **kw), mirrored, on_read]


# -- __format__ -----------------------------------------------------------------
def test_format_spec_on_scalar_tensors_and_variables(strategy):
    loss = dtape.constant(1.23456)
    assert f"{loss:.4f}" == "1.2346"
    assert f"{loss:>10.2e}" == "  1.23e+00"
    assert f"{dtape.constant(0.1)}" == "0.1"          # numpy's shortest digits, not 0.10000000149...
    assert f"{dtape.constant(7):03d}" == "007"
    assert f"{dtape.constant(True)}" == "True"
    assert f"{dtape.cast(dtape.constant(0.5), 'bfloat16'):.3f}" == "0.500"
    for v in _variables(strategy, 2.5):
        assert f"{v:.2f}" == "2.50", type(v).__name__
        assert f"loss={v:6.1f}" == "loss=   2.5"


def test_format_spec_on_a_non_scalar_says_what_to_do():
    x = dtape.constant([1.0, 2.0])
    with pytest.raises(TypeError, match=r"'.2f' needs a 0-d .*shape \(2,\)"):
        f"{x:.2f}"
    assert f"{x}" == repr(x)  # no spec: the repr, as str()


def test_format_does_not_record_a_read():
    v = dtape.Variable(3.0)
    with dtape.GradientTape() as tape:
        f"{v:.1f}"
    assert tape.watched_variables() == ()


# -- numpy on the left ---------------------------------------------------------
_BINARY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
           "**": operator.pow, "@": operator.matmul}


def _left_operand(op):
    rng = np.random.default_rng(0)
    return rng.uniform(0.5, 2.0, size=(3, 2) if op == "@" else (2,))


@pytest.mark.parametrize("op", list(_BINARY))
def test_numpy_array_on_the_left_is_recorded_and_matches_autograd(op, strategy):
    fn = _BINARY[op]
    a = _left_operand(op)
    w0 = np.array([[0.7], [1.3]]) if op == "@" else np.array([0.7, 1.3])
    expected = torch.tensor(w0, dtype=F64, requires_grad=True)
    fn(torch.tensor(a), expected).sum().backward()
    for w in _variables(strategy, torch.tensor(w0)) + [dtape.constant(w0)]:
        with dtape.GradientTape() as tape:
            tape.watch(w)
            y = fn(a, w)
            loss = dtape.reduce_sum(y)
        assert type(y) is dtape.Tensor, (op, type(w).__name__, type(y))
        np.testing.assert_allclose(y.numpy(), fn(a, w0), rtol=1e-12)
        np.testing.assert_allclose(tape.gradient(loss, w).numpy(), expected.grad.numpy(), rtol=1e-12)


def test_numpy_float64_array_times_float32_variable():
    """numpy's default float64 on the left: torch promotion, gradient back in the variable's dtype."""
    w = dtape.Variable([1.0, 2.0])
    with dtape.GradientTape() as tape:
        y = np.array([3.0, 4.0]) * w
        loss = dtape.reduce_sum(y)
    assert type(y) is dtape.Tensor and y.dtype == F64
    grad = tape.gradient(loss, w)
    assert grad.dtype == torch.float32
    np.testing.assert_array_equal(grad.numpy(), [3.0, 4.0])


def test_numpy_array_on_the_left_inside_strategy_run(strategy):
    with strategy.scope():
        w = dtape.Variable([1.0, 2.0])
    a = np.array([3.0, 4.0], np.float32)

    def step():
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(a * w)
        return tape.gradient(loss, w)
    for g in strategy.run(step).values:
        np.testing.assert_array_equal(g.numpy(), [3.0, 4.0])


@pytest.mark.parametrize("op, expected", [(operator.lt, [True, False, False]), (operator.le, [True, True, False]),
                                          (operator.gt, [False, False, True]), (operator.ge, [False, True, True]),
                                          (operator.eq, [False, True, False]), (operator.ne, [True, False, True])])
def test_numpy_array_on_the_left_of_a_comparison(op, expected):
    a = np.array([0.0, 1.0, 2.0], dtype=np.float32)
    for x in (dtape.constant([1.0, 1.0, 1.0]), dtape.Variable([1.0, 1.0, 1.0])):
        out = op(a, x)
        assert type(out) is dtape.Tensor and out.dtype == torch.bool
        np.testing.assert_array_equal(out.numpy(), expected)


def test_comparing_with_none_is_unequal_as_tfs_tensors(strategy):
    """TF 2's Tensor.__eq__ returns False for None (and __ne__ True), so `x == None` and `x in (None,)` work.
    Broken on purpose: with `__eq__`/`__ne__` as plain `equal`/`not_equal` they raised TypeError ("equal()
    missing its tensor argument 'y'")."""
    for x in (dtape.constant([1.0, 2.0]), *_variables(strategy, [1.0, 2.0])):
        assert (x == None) is False and (x != None) is True     # noqa: E711 - the operators are under test
        assert (None == x) is False and (None != x) is True     # noqa: E711
        assert x not in (None,) and dtape.constant(3) in (None, 3)
        np.testing.assert_array_equal((x == [1.0, 3.0]).numpy(), [True, False])
        np.testing.assert_array_equal((x != [1.0, 3.0]).numpy(), [False, True])


def test_numpy_scalars_and_ufunc_calls_are_recorded():
    w = dtape.Variable([1.0, 2.0])
    with dtape.GradientTape(persistent=True) as tape:
        ys = [np.float32(3.0) * w, np.multiply(np.array([2.0, 5.0], np.float32), w), np.negative(w)]
        losses = [dtape.reduce_sum(y) for y in ys]
    for y, loss, g in zip(ys, losses, ([3.0, 3.0], [2.0, 5.0], [-1.0, -1.0])):
        assert type(y) is dtape.Tensor
        np.testing.assert_array_equal(tape.gradient(loss, w).numpy(), g)


def test_other_ufuncs_give_numpy_values_and_out_is_refused():
    """Non-operator ufuncs run numpy on the values (as on torch and tf tensors); out= cannot write a tensor."""
    x = dtape.constant([0.0, 1.0])
    out = np.exp(x)
    assert type(out) is np.ndarray
    np.testing.assert_allclose(out, np.exp([0.0, 1.0]), rtol=1e-6)
    assert float(np.add.reduce(x)) == 1.0
    with pytest.raises(TypeError, match="immutable"):
        np.add(np.ones(2, np.float32), 1.0, out=x)
    buf = np.zeros(2, np.float32)
    np.add(x, 1.0, out=buf)  # out= a numpy array: numpy's own ufunc
    np.testing.assert_array_equal(buf, [1.0, 2.0])


def test_asarray_still_works_for_tensors_and_variables(strategy):
    t = dtape.constant([1.5, 2.5])
    for x in [t] + _variables(strategy, [1.5, 2.5]):
        arr = np.asarray(x)
        assert type(arr) is np.ndarray and arr.dtype == np.float32
        np.testing.assert_array_equal(arr, [1.5, 2.5])
        assert np.asarray(x, dtype=np.float64).dtype == np.float64
        np.testing.assert_allclose(x, [1.5, 2.5])


def test_numpy_is_a_copy_so_a_write_changes_no_gradient():
    """tf EagerTensor.numpy() copies: the tape saved the tensor's memory for the gradient (it read
    [200, 4, 6] after `x.numpy()[0] = 100`)."""
    x = dtape.constant([1.0, 2.0, 3.0], dtype="float64")
    with dtape.GradientTape() as tape:
        tape.watch(x)
        y = dtape.reduce_sum(x * x)
    arr = x.numpy()
    assert arr.flags.writeable
    arr[0] = 100.0
    np.testing.assert_array_equal(x.numpy(), [1.0, 2.0, 3.0])
    tx = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    expected, = torch.autograd.grad((tx * tx).sum(), tx)
    np.testing.assert_array_equal(tape.gradient(y, x).numpy(), expected.numpy())  # [2, 4, 6]


def test_numpy_of_a_variable_is_a_copy_in_either_context(strategy):
    """A write into `.numpy()` changes no variable, and no single component of a distributed one."""
    for v in _variables(strategy, [1.5, 2.5]):
        v.numpy()[0] = 9.0
        np.testing.assert_array_equal(v.numpy(), [1.5, 2.5])
        for component in getattr(v, "values", (v,)):
            np.testing.assert_array_equal(component.torch().numpy(), [1.5, 2.5])

    with strategy.scope():
        mv = dtape.Variable([1.5, 2.5])

    def write():
        mv.numpy()[0] = 9.0
        return mv.read_value()

    for value in strategy.experimental_local_results(strategy.run(write)):
        np.testing.assert_array_equal(value.numpy(), [1.5, 2.5])


def test_asarray_is_a_read_only_view_and_copy_true_a_writable_copy(strategy):
    """np.asarray stays zero-copy on the CPU, but a write raises instead of changing an immutable value
    (numpy 2 `__array__(dtype, copy)`: copy=True a writable copy, copy=False refuses a conversion)."""
    t = dtape.constant([1.5, 2.5])
    for x in [t] + _variables(strategy, [1.5, 2.5]):
        arr = np.asarray(x)
        assert not arr.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            arr[0] = 9.0
        with pytest.raises(ValueError, match="read-only"):
            np.asarray(x, dtype=np.float64)[0] = 9.0
        assert np.asarray(x, copy=False).flags.writeable is False
        with pytest.raises(ValueError, match="needs a copy; pass copy=None or True"):
            np.asarray(x, dtype=np.float64, copy=False)
        for copied in (np.asarray(x, copy=True), np.array(x), x.__array__(copy=True),
                       np.asarray(x, dtype=np.float64, copy=True)):
            assert copied.flags.writeable
            copied[0] = 9.0
        np.testing.assert_array_equal(x.numpy(), [1.5, 2.5])
    host = t.torch().numpy()
    assert np.shares_memory(np.asarray(t), host) and not np.shares_memory(np.array(t), host)
    assert not np.shares_memory(t.numpy(), host)


def test_variables_share_tensors_protocol_functions(strategy):
    """One table: variables get Tensor's own __format__/__array_ufunc__/__dlpack__ functions."""
    for v in _variables(strategy, 1.0):
        for name in ("__format__", "__array_ufunc__", "__dlpack__", "__dlpack_device__"):
            assert name in dtape.Tensor._operator_names
            assert getattr(type(v), name) is getattr(dtape.Tensor, name), (type(v).__name__, name)


# -- dtypes ------------------------------------------------------------------------
_NAMES = ["float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool",
          "complex64"]


@pytest.mark.parametrize("name", _NAMES)
def test_dtype_names_are_torch_dtypes_and_as_dtype_accepts_every_spelling(name):
    dt = getattr(torch, name)
    assert getattr(dtape, name) is dt
    assert dtape.as_dtype(name) is dt
    assert dtape.as_dtype(dt) is dt
    assert dtape.as_dtype(f"torch.{name}") is dt
    if name != "bfloat16":
        assert dtape.as_dtype(np.dtype(name)) is dt
        assert dtape.as_dtype(np.dtype(name).type) is dt


def test_as_dtype_python_types_aliases_and_errors():
    assert dtape.as_dtype(float) is torch.float32 and dtape.as_dtype(int) is torch.int64
    assert dtape.as_dtype(bool) is torch.bool and dtape.as_dtype(None) is None
    assert dtape.as_dtype("double") is F64 and dtape.as_dtype("half") is torch.float16
    assert dtape.as_dtype("float") is torch.float32  # TF's and torch's meaning, not numpy's float64
    with pytest.raises(ValueError, match=r"unknown dtype name 'float65'; valid names: float16, bfloat16"):
        dtape.as_dtype("float65")
    with pytest.raises(TypeError, match="not a dtype"):
        dtape.as_dtype([1, 2])
    with pytest.raises(ValueError, match="unknown dtype name 'cpu'"):
        dtape.cast(dtape.constant(1.0), "cpu")


_MAKERS = {
    "constant": lambda d: dtape.constant([1.0, 2.0], dtype=d),
    "convert_to_tensor": lambda d: dtape.convert_to_tensor([1.0, 2.0], dtype=d),
    "cast": lambda d: dtape.cast(dtape.constant([1.0, 2.0]), d),
    "zeros": lambda d: dtape.zeros([2], dtype=d),
    "ones": lambda d: dtape.ones([2], dtype=d),
    "zeros_like": lambda d: dtape.zeros_like(dtape.constant([1, 2]), dtype=d),
    "ones_like": lambda d: dtape.ones_like(dtape.constant([1, 2]), dtype=d),
    "range": lambda d: dtape.range(3, dtype=d),
    "one_hot": lambda d: dtape.one_hot(dtape.constant([0, 1]), 3, dtype=d),
    "Variable": lambda d: dtape.Variable([1.0, 2.0], dtype=d),
    "random.uniform": lambda d: dtape.random.uniform([2], dtype=d, seed=1),
    "random.normal": lambda d: dtape.random.normal([2], dtype=d, seed=1),
}


@pytest.mark.parametrize("maker", list(_MAKERS))
@pytest.mark.parametrize("spelling", ["float64", np.float64, np.dtype("float64"), dtape.float64])
def test_every_dtype_argument_accepts_names_and_numpy_dtypes(maker, spelling):
    assert _MAKERS[maker](spelling).dtype == F64


def test_string_dtypes_for_integer_results():
    assert dtape.random.categorical(dtape.constant([[0.0, 1.0]]), 2, dtype="int32", seed=1).dtype == torch.int32
    assert dtape.cast(dtape.constant([1.7]), "int32").dtype == torch.int32
    assert dtape.convert_to_tensor(dtape.constant(1.0), dtype="float32").dtype == torch.float32
    with pytest.raises(ValueError, match="requested torch.float64"):
        dtape.convert_to_tensor(dtape.constant(1.0), dtype="float64")


def test_cast_by_name_passes_the_gradient_back():
    x = dtape.constant([1.0, 2.0])
    with dtape.GradientTape(persistent=True) as tape:
        tape.watch(x)
        y = dtape.reduce_sum(dtape.cast(x, "float64") ** 2)
        z = dtape.reduce_sum(dtape.cast(dtape.cast(x, "int32"), "float32"))
    grad = tape.gradient(y, x)
    assert grad.dtype == torch.float32
    np.testing.assert_array_equal(grad.numpy(), [2.0, 4.0])
    assert tape.gradient(z, x) is None  # through an integer cast: no gradient


# -- repr of dtypes numpy lacks ---------------------------------------------------
@pytest.mark.parametrize("name", ["bfloat16", "float16"])
def test_repr_and_print_of_half_precision_tensors_and_variables(name, strategy, capsys):
    dt = getattr(torch, name)
    t = dtape.constant([1.5, -2.0], dtype=name)
    assert repr(t) == (f"<dtape.Tensor: shape=(2,), dtype=torch.{name}, device=cpu, "
                       f"numpy=array([ 1.5, -2. ], dtype={name})>")
    print(t)
    assert f"dtype={name})" in capsys.readouterr().out
    for v in _variables(strategy, [1.5, -2.0], dtype=dt):
        assert f"dtype=torch.{name}" in repr(v) and f"array([ 1.5, -2. ], dtype={name})" in repr(v)
        print(v)
    assert repr(dtape.constant(0.25, dtype=name)).endswith(f"numpy=array(0.25, dtype={name})>")


def test_numpy_of_bfloat16_says_to_cast_first():
    with pytest.raises(TypeError, match=r"numpy has no torch.bfloat16.*dtape.cast\(x, dtape.float32\)"):
        dtape.constant([1.0], dtype="bfloat16").numpy()


# -- matmul of two dtypes ---------------------------------------------------------
def test_mixed_dtype_matmul_names_both_dtypes_and_the_cast():
    a, b = dtape.ones([2, 2]), dtape.ones([2, 2], dtype="float64")
    msg = r"matmul: a is torch.float32 and b is torch.float64; .*dtape.cast\(b, torch.float32\)"
    with pytest.raises(TypeError, match=msg):
        dtape.matmul(a, b)
    with pytest.raises(TypeError, match=msg):
        a @ b
    with pytest.raises(TypeError, match=r"a is torch.int64 and b is torch.float32; .*dtape.cast\(a, torch.float32\)"):
        dtape.matmul(dtape.ones([2, 2], dtype="int64"), a)
    np.testing.assert_array_equal(dtape.matmul(a, dtape.cast(b, dtape.float32)).numpy(), np.full((2, 2), 2.0))


# -- DLPack ---------------------------------------------------------------------
def test_dlpack_export_shares_memory_with_numpy_and_torch():
    t = dtape.constant([1.0, 2.0, 3.0])
    assert t.__dlpack_device__() == t.torch().__dlpack_device__()
    arr = np.from_dlpack(t)
    tt = torch.from_dlpack(t)
    np.testing.assert_array_equal(arr, [1.0, 2.0, 3.0])
    assert tt.data_ptr() == t.torch().data_ptr()
    assert arr.__array_interface__["data"][0] == t.torch().data_ptr()


def test_from_dlpack_round_trips_and_shares_memory(strategy):
    arr = np.arange(4.0)
    t = dtape.from_dlpack(arr)
    assert type(t) is dtape.Tensor and t.dtype == F64 and t.shape == (4,)
    arr[0] = 42.0  # shared memory: the tensor sees the write (documented)
    assert float(t[0]) == 42.0
    np.testing.assert_array_equal(np.from_dlpack(t), arr)

    src = torch.tensor([1.0, 2.0], requires_grad=True)
    u = dtape.from_dlpack(src)
    assert u.torch().data_ptr() == src.data_ptr() and not u.torch().requires_grad

    b = dtape.from_dlpack(dtape.constant([0.5, 1.5], dtype="bfloat16"))
    assert b.dtype == torch.bfloat16 and repr(b).endswith("dtype=bfloat16)>")

    for v in _variables(strategy, [1.0, 2.0]):
        got = dtape.from_dlpack(v)
        assert got.torch().data_ptr() == v.torch().data_ptr(), type(v).__name__
        np.testing.assert_array_equal(np.from_dlpack(v), [1.0, 2.0])


@pytest.mark.gpu
def test_dlpack_on_cuda_keeps_the_device():
    t = dtape.constant([1.0, 2.0], device="cuda:0")
    assert t.__dlpack_device__()[0] == 2  # kDLCUDA
    u = dtape.from_dlpack(t)
    assert u.device == t.device and u.torch().data_ptr() == t.torch().data_ptr()
    assert f"{dtape.reduce_sum(t):.1f}" == "3.0"
    assert repr(dtape.cast(t, "bfloat16")).endswith("dtype=bfloat16)>")


def test_numpy_of_a_0d_value_is_a_numpy_scalar_as_tf(strategy):
    """TF's EagerTensor.numpy() of a 0-d value is a numpy scalar: `round(opt.lr.numpy(), 5)` and the
    f-string / float idioms of TF code work (a 0-d ndarray has no __round__); arrays stay arrays."""
    values = [dtape.constant(1.23456789), dtape.optimizers.SGD(0.0123456).learning_rate,
              *_variables(strategy, 1.23456789)]
    for v in values:
        got = v.numpy()
        assert type(got) is (np.float64 if v.dtype == torch.float64 else np.float32) and got.shape == ()
        assert round(got, 5) == round(float(got), 5) and isinstance(round(got, 5), float | np.floating)
        assert f"{got:.3f}" == f"{float(got):.3f}"
    assert round(dtape.constant(1.23456789).numpy(), 5) == np.float32(1.23457)
    assert round(dtape.optimizers.SGD(0.0123456).learning_rate.numpy(), 5) == 0.01235
    assert type(dtape.constant(3).numpy()) is np.int64 and dtape.constant(True).numpy() is np.True_
    assert type(dtape.constant([1.0]).numpy()) is np.ndarray and dtape.constant([1.0]).numpy().shape == (1,)
    assert type(np.asarray(dtape.constant(2.0))) is np.ndarray    # the array protocol still gives an array
