"""Tensors in Python as TF's: sizes from tensors, numpy functions, & | ^ ~, __index__, and TF's op names.

Gradients of the new ops (norm, pad, linspace, band_part) are also in the
registry tests (tests/test_op_gradients.py: finite differences, second
order, special points against TF's composite in torch); here they are
checked against torch.autograd of independent torch programs in float64.
"""
import inspect

import numpy as np
import pytest
import torch

import dtape
from tests._strategies import mirrored

D = torch.float64


def _grad(fn, *xs):
    """dtape's gradient of sum(fn(*xs) * cot) w.r.t. float64 torch inputs `xs`; cot fixed by the output shape."""
    srcs = [dtape.constant(x) for x in xs]
    with dtape.GradientTape() as tape:
        tape.watch(srcs)
        y = fn(*srcs)
    cot = _cot(tuple(y.shape))
    return y.torch(), [g.torch() for g in tape.gradient(y, srcs, output_gradients=dtape.constant(cot))]


def _torch_grad(fn, *xs):
    ts = [x.clone().requires_grad_() for x in xs]
    y = fn(*ts)
    return y.detach(), list(torch.autograd.grad(y, ts, _cot(tuple(y.shape))))


def _cot(shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=D)


# -- sizes given as 0-d integer tensors -------------------------------------------
N = dtape.constant(3)
G = dtape.constant([1.0, 2.0, 3.0])

SIZE_CASES = {
    "reshape": (lambda: dtape.reshape(G, [N, 1]), (3, 1)),
    "reshape_shape_of": (lambda: dtape.reshape(G, dtape.shape(dtape.zeros([1, 3]))), (1, 3)),
    "torch_reshape": (lambda: torch.reshape(G, (N, 1)), (3, 1)),
    "broadcast_to": (lambda: dtape.broadcast_to(G, [dtape.constant(2, dtype=dtape.int32), N]), (2, 3)),
    "one_hot": (lambda: dtape.one_hot(dtape.constant([0, 2]), N), (2, 3)),
    "zeros": (lambda: dtape.zeros([N, 2]), (3, 2)),
    "zeros_scalar": (lambda: dtape.zeros(N), (3,)),
    "ones_shape_of": (lambda: dtape.ones(dtape.shape(dtape.zeros([2, 3]))), (2, 3)),
    "fill": (lambda: dtape.fill([N], 7.0), (3,)),
    "range": (lambda: dtape.range(N), (3,)),
    "tile": (lambda: dtape.tile(G, [N]), (9,)),
    "split": (lambda: dtape.split(G, N)[0], (1,)),
    "slice": (lambda: G[:dtape.constant(2)], (2,)),
    "eye": (lambda: dtape.eye(N, batch_shape=[dtape.constant(2)]), (2, 3, 3)),
    "random_normal": (lambda: dtape.random.normal(dtape.shape(dtape.zeros([2, 4]))), (2, 4)),
    "random_uniform": (lambda: dtape.random.uniform([N, dtape.constant(2)]), (3, 2)),
    "dropout_noise_shape": (lambda: dtape.nn.dropout(dtape.ones([3, 2]), 0.5, noise_shape=[N, 1]), (3, 2)),
    "variable_size": (lambda: dtape.reshape(G, [dtape.Variable(3, trainable=False), 1]), (3, 1)),
    "linspace": (lambda: dtape.linspace(0.0, 1.0, N), (3,)),
    "band_part": (lambda: dtape.linalg.band_part(dtape.ones([3, 3]), N - 4, dtape.constant(0)), (3, 3)),
}


@pytest.mark.parametrize("name", sorted(SIZE_CASES))
def test_size_argument_takes_0d_integer_tensor(name):
    fn, shape = SIZE_CASES[name]
    assert tuple(fn().shape) == shape


def test_size_tensor_values_are_the_int_ones():
    np.testing.assert_array_equal(dtape.one_hot(dtape.constant([0, 2]), N).numpy(), np.eye(3, dtype=np.float32)[[0, 2]])
    np.testing.assert_array_equal(dtape.reshape(G, [N, 1]).numpy(), [[1.0], [2.0], [3.0]])
    np.testing.assert_array_equal(dtape.tile(G, [dtape.constant(2)]).numpy(), [1, 2, 3, 1, 2, 3])
    np.testing.assert_array_equal(G[dtape.constant(1):].numpy(), [2.0, 3.0])
    assert float(G[dtape.constant(2)]) == 3.0


def test_reshape_to_a_tensor_size_is_recorded_with_its_gradient():
    x = dtape.constant([[1.0, 2.0, 3.0]])
    n = dtape.shape(x)[1]
    with dtape.GradientTape() as tape:
        tape.watch(x)
        y = dtape.reduce_sum(dtape.reshape(x, [n, 1]) * dtape.constant([[1.0], [2.0], [3.0]]))
    np.testing.assert_array_equal(tape.gradient(y, x).numpy(), [[1.0, 2.0, 3.0]])


def test_range_takes_the_dtype_of_its_tensor_arguments():
    assert dtape.range(dtape.constant(4, dtype=dtape.int32)).dtype == torch.int32  # TF: int32 from tf.shape
    assert dtape.range(dtape.shape(dtape.zeros([5]))[0]).dtype == torch.int32
    assert dtape.range(4).dtype == torch.int64
    assert dtape.range(0.5, dtape.constant(3)).dtype == torch.float32
    np.testing.assert_array_equal(dtape.range(dtape.constant(1), dtape.constant(7), dtape.constant(2)).numpy(), [1, 3, 5])


@pytest.mark.parametrize("bad,error,words", [
    (dtape.constant(3.0), TypeError, "integer"), (dtape.constant(True), TypeError, "integer"),
    (dtape.constant([[1, 2]]), TypeError, "0-d"), (2.5, TypeError, "integer"), (True, TypeError, "integer")])
def test_a_size_that_is_not_an_integer_is_refused_with_a_message(bad, error, words):
    with pytest.raises(error, match=words):
        dtape.reshape(G, [bad, -1])


def test_a_shape_tensor_of_rank_two_or_float_is_refused():
    with pytest.raises(ValueError, match="1-D"):
        dtape.zeros(dtape.constant([[2, 3]]))
    with pytest.raises(TypeError, match="integer dtype"):
        dtape.zeros(dtape.constant([2.0, 3.0]))
    with pytest.raises(TypeError, match=r"for one dimension write \[n\]"):
        dtape.reshape(G, 3)


# -- negative slice steps (TF's guide: rank_1_tensor[::-1]) ------------------------------
REVERSING_KEYS = [np.s_[::-1], np.s_[:, ::-1], np.s_[..., ::-2], np.s_[1, None, 2:0:-1, ::-1], np.s_[0, :, ::-1],
                  np.s_[::-1, 1], np.s_[::-1, ..., ::-3], np.s_[None, ::-1, None, 1:, ::-1], np.s_[-1::-1, 0, 3:0:-2],
                  np.s_[5:-9:-1, :0:-1]]


@pytest.mark.parametrize("k", range(len(REVERSING_KEYS)))
def test_negative_slice_steps_select_as_numpy_with_torch_autograd_gradient(k):
    key = REVERSING_KEYS[k]
    a = np.arange(24.0).reshape(2, 3, 4)
    got, (g,) = _grad(lambda t: t[key], torch.from_numpy(a))
    np.testing.assert_array_equal(got.numpy(), a[key])
    index = torch.from_numpy(np.arange(24).reshape(2, 3, 4)[key].copy())  # numpy's positions, as a gather
    want, (want_g,) = _torch_grad(lambda t: torch.reshape(t, (-1,))[index], torch.from_numpy(a))
    torch.testing.assert_close(g, want_g, rtol=0, atol=0)


def test_negative_step_with_a_tensor_size_and_with_an_index_tensor():
    r = dtape.constant([0, 1, 1, 2, 3, 5, 8, 13, 21, 34])
    assert r[::-1].numpy().tolist() == [34, 21, 13, 8, 5, 3, 2, 1, 1, 0]
    assert r[dtape.constant(4):dtape.constant(0):-2].numpy().tolist() == [3, 1]
    with pytest.raises(IndexError, match="two steps"):
        dtape.zeros([2, 3])[[0, 1], ::-1]


# -- __index__ ------------------------------------------------------------------
def test_index_takes_0d_integer_tensors_only():
    assert [10, 20, 30][dtape.constant(1)] == 20
    assert list(range(dtape.constant(3, dtype=dtape.int32))) == [0, 1, 2]
    for bad in (dtape.constant(1.0), dtape.constant([1]), dtape.constant(True)):
        with pytest.raises(TypeError, match="0-d integer"):
            [10, 20, 30][bad]


# -- numpy functions on tensors ----------------------------------------------------
X = np.array([[1.0, 5.0, 2.0], [4.0, -1.0, 3.0]], dtype=np.float32)

NP_FUNCTIONS = {
    "mean_axis0": lambda a: np.mean(a, axis=0), "sum": np.sum, "sum_axis1": lambda a: np.sum(a, axis=1),
    "std": np.std, "std_axis0": lambda a: np.std(a, axis=0), "max_axis1": lambda a: np.max(a, axis=1),
    "max": np.max, "min_keepdims": lambda a: np.min(a, axis=0, keepdims=True), "argmax": lambda a: np.argmax(a, 1),
    "concatenate": lambda a: np.concatenate([a, a], axis=0), "where": lambda a: np.where(a > 2, a, 0.0),
    "clip": lambda a: np.clip(a, 0.0, 3.0), "round": lambda a: np.round(a / 3, 2), "sort": lambda a: np.sort(a),
}


@pytest.mark.parametrize("name", sorted(NP_FUNCTIONS))
def test_numpy_function_on_tensor_returns_numpy_result(name):
    fn = NP_FUNCTIONS[name]
    for value in (dtape.constant(X), dtape.Variable(X)):
        got = fn(value)
        assert not isinstance(got, dtape.Tensor)
        assert isinstance(got, (np.ndarray, np.generic))
        np.testing.assert_array_equal(got, fn(X))


def test_numpy_function_inside_a_tape_gives_numpy_and_no_record():
    x = dtape.constant(X)
    with dtape.GradientTape() as tape:
        tape.watch(x)
        m = np.mean(x, axis=0)
        y = dtape.reduce_sum(x * dtape.constant(m))
    assert isinstance(m, np.ndarray)  # TF: numpy results, no gradient through them
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), np.broadcast_to(X.mean(0), X.shape))


def test_numpy_functions_cannot_write_into_a_tensor():
    x = dtape.constant(X)
    view = np.reshape(x, (6,))
    with pytest.raises(ValueError, match="read-only"):
        view[0] = 100.0
    with pytest.raises(ValueError, match="read-only"):
        np.copyto(x, 0.0)
    with pytest.raises(ValueError, match="read-only"):
        np.put(x, [0], [9.0])
    np.testing.assert_array_equal(x.numpy(), X)


# -- & | ^ ~ --------------------------------------------------------------------------
A = np.array([True, False, True, False])
B = np.array([True, True, False, False])


@pytest.mark.parametrize("op", ["and", "or", "xor"])
def test_logic_operators_on_bool_tensors_match_numpy(op):
    fn = {"and": lambda a, b: a & b, "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b}[op]
    a, b = dtape.constant(A), dtape.constant(B)
    want = fn(A, B)
    for got in (fn(a, b), fn(a, B), fn(A, b), fn(dtape.Variable(A, trainable=False), b)):
        assert isinstance(got, dtape.Tensor) and got.dtype == torch.bool
        np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(fn(a, True).numpy(), fn(A, True))
    np.testing.assert_array_equal(fn(False, a).numpy(), fn(False, A))


def test_invert_is_logical_not_on_bool_and_bitwise_on_integers():
    np.testing.assert_array_equal((~dtape.constant(A)).numpy(), ~A)
    ints = np.array([5, 0, -3], dtype=np.int32)
    got = ~dtape.constant(ints)
    assert got.dtype == torch.int32
    np.testing.assert_array_equal(got.numpy(), ~ints)  # [-6, -1, 2]; logical_not would give [0, 1, 0]


def test_bitwise_operators_on_integer_tensors_keep_the_dtype():
    ints = np.array([5, 6, 12], dtype=np.int32)
    t = dtape.constant(ints)
    for got, want in ((t & 4, ints & 4), (3 | t, 3 | ints), (t ^ t, ints ^ ints), (t & dtape.constant(ints), ints)):
        assert got.dtype == torch.int32
        np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize("left,right,words", [
    (dtape.constant([1.0, 2.0]), dtape.constant([1.0, 0.0]), "bool tensors"),
    (dtape.constant([True]), dtape.constant([1]), "two bool tensors"),
    (dtape.constant([True]), 1, "two bool tensors"), (dtape.constant([1]), True, "two bool tensors")])
def test_logic_operator_on_floats_or_mixed_kinds_is_refused(left, right, words):
    with pytest.raises(TypeError, match=words):
        left & right
    with pytest.raises(TypeError, match=words):
        right | left


def test_logical_xor_op():
    np.testing.assert_array_equal(dtape.math.logical_xor(dtape.constant(A), dtape.constant(B)).numpy(), A ^ B)
    np.testing.assert_array_equal(dtape.math.logical_xor(True, dtape.constant(B)).numpy(), True ^ B)


# -- shape, size, rank, newaxis, eye -------------------------------------------------------
def test_shape_size_rank_are_int32_tensors_as_tf():
    x = dtape.zeros([2, 3, 4])
    s = dtape.shape(x)
    assert isinstance(s, dtape.Tensor) and s.dtype == torch.int32 and s.numpy().tolist() == [2, 3, 4]
    assert dtape.shape(x, out_type=dtape.int64).dtype == torch.int64
    assert dtape.size(x).dtype == torch.int32 and int(dtape.size(x)) == 24 and dtape.size(x).ndim == 0
    assert dtape.rank(x).dtype == torch.int32 and int(dtape.rank(x)) == 3
    assert dtape.shape(dtape.Variable([1.0, 2.0])).numpy().tolist() == [2]
    assert dtape.shape([[1, 2, 3]]).numpy().tolist() == [1, 3]


def test_newaxis_inserts_a_dimension():
    assert dtape.newaxis is None
    seq = dtape.constant([[7, 6, 0], [1, 0, 0]])
    mask = dtape.cast(dtape.math.equal(seq, 0), dtape.float32)[:, dtape.newaxis, dtape.newaxis, :]
    assert tuple(mask.shape) == (2, 1, 1, 3)


def test_eye_with_columns_and_batch_shape():
    np.testing.assert_array_equal(dtape.eye(2, 3).numpy(), np.eye(2, 3, dtype=np.float32))
    e = dtape.eye(2, batch_shape=[3], dtype=dtape.float64)
    assert e.dtype == torch.float64 and tuple(e.shape) == (3, 2, 2)
    np.testing.assert_array_equal(e.numpy(), np.broadcast_to(np.eye(2), (3, 2, 2)))


# -- pad ------------------------------------------------------------------------------------
def _index_pad(x, paddings, mode):
    """pad as a gather from x at numpy's padded index map: an independent torch program for autograd."""
    idx = np.pad(np.arange(x.numel()).reshape(tuple(x.shape)), paddings, mode=mode.lower())
    return torch.reshape(x, (-1,))[torch.from_numpy(idx)]


@pytest.mark.parametrize("mode,paddings", [("REFLECT", [[2, 1], [3, 0]]), ("SYMMETRIC", [[3, 3], [1, 4]]),
                                           ("reflect", [[0, 0], [3, 3]]), ("Symmetric", [[1, 0], [0, 0]])])
def test_pad_mirror_modes_value_and_gradient_match_torch_autograd(mode, paddings):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0), dtype=D)
    got, got_g = _grad(lambda t: dtape.pad(t, paddings, mode=mode), x)
    want, want_g = _torch_grad(lambda t: _index_pad(t, paddings, mode), x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_g[0], want_g[0], rtol=1e-12, atol=1e-12)


def test_pad_constant_value_and_gradient_match_torch():
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(1), dtype=D)
    pads = dtape.constant([[1, 0], [2, 1]])  # paddings as an integer tensor
    got, got_g = _grad(lambda t: dtape.pad(t, pads, constant_values=-1.5), x)
    want, want_g = _torch_grad(lambda t: torch.nn.functional.pad(t, (2, 1, 1, 0), value=-1.5), x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_g[0], want_g[0], rtol=0, atol=0)


@pytest.mark.parametrize("paddings,mode,error,words", [
    ([[3, 0]], "REFLECT", ValueError, "at most 2"), ([[0, 4]], "SYMMETRIC", ValueError, "at most 3"),
    ([[1, 1], [0, 0]], "CONSTANT", ValueError, r"\[1, 2\]"), ([[-1, 0]], "CONSTANT", ValueError, "non-negative"),
    ([[1, 1]], "WRAP", ValueError, "CONSTANT"), ([1, 1], "CONSTANT", ValueError, r"\[rank, 2\]")])
def test_pad_refuses_bad_paddings_and_modes(paddings, mode, error, words):
    with pytest.raises(error, match=words):
        dtape.pad(dtape.constant([1.0, 2.0, 3.0]), paddings, mode=mode)


# -- linspace ----------------------------------------------------------------------------------
@pytest.mark.parametrize("num", [0, 1, 2, 5])
def test_linspace_is_inclusive_and_matches_numpy(num):
    np.testing.assert_allclose(dtape.linspace(-1.0, 3.0, num).numpy(), np.linspace(-1.0, 3.0, num, dtype=np.float32))
    assert dtape.linspace(-1.0, 3.0, num).dtype == torch.float32
    assert dtape.linspace(0, 10, num).dtype == torch.float64  # integer inputs divide to float64, as TF


def test_linspace_of_tensors_along_an_axis_value_and_gradient_match_torch_autograd():
    start = torch.randn(3, generator=torch.Generator().manual_seed(2), dtype=D)
    stop = torch.randn(2, 1, generator=torch.Generator().manual_seed(4), dtype=D)

    def reference(a, b):  # torch's form: a (1 - w) + b w with w = i / (num - 1), broadcast, new last axis
        w = torch.arange(4, dtype=D) / 3
        a, b = torch.broadcast_tensors(a, b)
        return a[..., None] * (1 - w) + b[..., None] * w

    got, got_g = _grad(lambda a, b: dtape.linspace(a, b, 4, axis=-1), start, stop)
    want, want_g = _torch_grad(reference, start, stop)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for g, w in zip(got_g, want_g):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got.numpy(), np.linspace(start.numpy(), stop.numpy(), 4, axis=-1), rtol=1e-12)


# -- norm -----------------------------------------------------------------------------------------
NORM_CASES = [({}, lambda t: torch.linalg.vector_norm(t)), ({"axis": 1}, lambda t: torch.linalg.vector_norm(t, dim=1)),
              ({"ord": 1, "axis": 0}, lambda t: torch.linalg.vector_norm(t, 1, dim=0)),
              ({"ord": np.inf, "axis": -1, "keepdims": True}, lambda t: torch.linalg.vector_norm(t, np.inf, -1, True)),
              ({"ord": 3}, lambda t: torch.linalg.vector_norm(t, 3)),
              ({"ord": "fro", "axis": [0, 1]}, lambda t: torch.linalg.matrix_norm(t, "fro")),
              ({"ord": 1, "axis": (0, 1)}, lambda t: torch.linalg.matrix_norm(t, 1)),
              ({"ord": np.inf, "axis": (0, 1)}, lambda t: torch.linalg.matrix_norm(t, np.inf)),
              ({"ord": 2, "axis": (-2, -1)}, lambda t: torch.linalg.matrix_norm(t, 2))]


@pytest.mark.parametrize("k", range(len(NORM_CASES)))
def test_norm_value_and_gradient_match_torch_autograd(k):
    kwargs, reference = NORM_CASES[k]
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(k), dtype=D)
    got, got_g = _grad(lambda t: dtape.linalg.norm(t, **kwargs), x)
    want, want_g = _torch_grad(reference, x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_g[0], want_g[0], rtol=1e-10, atol=1e-12)


def test_norm_gradient_at_zero_is_tfs_nan_for_2_norm_and_zero_for_1_norm():
    zero = torch.zeros(3, dtype=D)
    _, (g2,) = _grad(dtape.norm, zero)
    assert torch.isnan(g2).all()  # TF: sqrt(sum(x * x)) differentiated at 0 (torch.linalg.norm would give 0)
    _, (g1,) = _grad(lambda t: dtape.norm(t, ord=1), zero)
    np.testing.assert_array_equal(g1.numpy(), [0.0, 0.0, 0.0])
    _, (want,) = _torch_grad(lambda t: torch.sqrt(torch.sum(t * t)), zero)  # TF's composite under torch
    assert torch.isnan(want).all()


def test_norm_inf_ties_share_the_gradient_as_tf():
    x = torch.tensor([3.0, -3.0, 1.0], dtype=D)
    y, (g,) = _grad(lambda t: dtape.norm(t, ord=np.inf), x)
    _, (want,) = _torch_grad(lambda t: torch.amax(torch.abs(t)), x)
    torch.testing.assert_close(g, want, rtol=0, atol=0)
    assert float(y) == 3.0 and g[0] == -g[1] != 0 and g[2] == 0


@pytest.mark.parametrize("kwargs,words", [({"ord": "fro"}, "for matrices"), ({"ord": 0}, "positive"),
                                          ({"ord": 3, "axis": (0, 1)}, "matrix norm"),
                                          ({"axis": (0, 0)}, "distinct"), ({"axis": (0, 1, 2)}, "pair")])
def test_norm_refuses_what_tf_refuses(kwargs, words):
    with pytest.raises(ValueError, match=words):
        dtape.norm(dtape.zeros([2, 3, 4]), **kwargs)


# -- band_part -------------------------------------------------------------------------------------
def test_band_part_causal_mask_and_gradient_match_torch_tril():
    x = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(5), dtype=D)
    got, got_g = _grad(lambda t: dtape.linalg.band_part(t, -1, 0), x)
    want, want_g = _torch_grad(torch.tril, x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_g[0], want_g[0], rtol=0, atol=0)
    _, (band_g,) = _grad(lambda t: dtape.linalg.band_part(t, 1, 2), x)
    _, (want_band,) = _torch_grad(lambda t: torch.triu(torch.tril(t, 2), -1), x)
    torch.testing.assert_close(band_g, want_band, rtol=0, atol=0)


# -- the names: dtape.math, dtape.linalg, dtape.nn -------------------------------------------------------
# tf.math's names for ops dtape has (TF 2.x), as a ported script spells them.
TF_MATH = """abs add add_n argmax argmin cos divide equal exp floordiv floormod greater greater_equal less
less_equal log log1p log_softmax logical_and logical_not logical_or logical_xor maximum minimum multiply negative
not_equal pow reduce_logsumexp reduce_max reduce_mean reduce_min reduce_prod reduce_sum rsqrt sigmoid sign sin
softmax softplus sqrt square subtract tanh""".split()
TF_LINALG = "band_part einsum eye global_norm matmul norm solve".split()


@pytest.mark.parametrize("name", TF_MATH)
def test_dtape_math_name_is_the_op_itself(name):
    assert name in dtape.math.__all__
    same = getattr(dtape, name, None) or getattr(dtape.nn, name)
    assert getattr(dtape.math, name) is same


@pytest.mark.parametrize("name", TF_LINALG)
def test_dtape_linalg_name_is_the_op_itself(name):
    assert name in dtape.linalg.__all__
    assert name in ("band_part", "solve") or getattr(dtape.linalg, name) is getattr(dtape, name)


def test_namespaces_import_with_from_statements():
    from dtape.linalg import band_part, matmul  # noqa: F401
    from dtape.math import log1p, reduce_sum  # noqa: F401
    assert reduce_sum is dtape.reduce_sum and set(dtape.math.__all__) == set(TF_MATH)
    assert set(dtape.linalg.__all__) == set(TF_LINALG)


def test_nn_sigmoid_tanh_leaky_relu_are_the_ops():
    assert dtape.nn.sigmoid is dtape.sigmoid and dtape.nn.tanh is dtape.tanh
    x = dtape.constant([-2.0, 0.5])
    np.testing.assert_allclose(dtape.nn.leaky_relu(x, alpha=0.1).numpy(), [-0.2, 0.5])


def test_transformer_tutorial_masks_and_positional_slice_port_literally():
    """The masking and positional-encoding lines of TF's Transformer tutorial, with dtape for tf."""
    seq = dtape.constant([[7, 6, 0, 0], [1, 2, 3, 0]])
    padding_mask = dtape.cast(dtape.math.equal(seq, 0), dtape.float32)[:, dtape.newaxis, dtape.newaxis, :]
    look_ahead = 1 - dtape.linalg.band_part(dtape.ones((4, 4)), -1, 0)
    combined = dtape.maximum(padding_mask, look_ahead)
    np.testing.assert_array_equal(combined.numpy()[1, 0], np.maximum(np.triu(np.ones((4, 4)), 1), [0, 0, 0, 1]))
    pos_encoding = dtape.constant(np.arange(40, dtype=np.float32).reshape(1, 10, 4))
    x = dtape.zeros([2, 4, 4])
    length = dtape.shape(x)[1]
    x = x + pos_encoding[dtape.newaxis, 0, :length, :]
    assert tuple(x.shape) == (2, 4, 4) and float(x[1, 3, 0]) == 12.0
    match = (seq == seq) & (seq != 0)
    assert float(dtape.reduce_sum(dtape.cast(match, dtape.float32)) / dtape.reduce_sum(dtape.cast(seq != 0, dtape.float32))) == 1.0


@pytest.mark.usefixtures("closes_strategies")
def test_random_set_seed_repeats_draws_initializers_and_strategy_generators():
    def draws():
        dtape.random.set_seed(1234)
        layer = dtape.keras.layers.Dense(3)
        layer.build([None, 2])
        strategy = mirrored(2)
        per = strategy.run(lambda: dtape.random.uniform([2]))
        rep = [t.numpy() for t in strategy.experimental_local_results(per)]
        return [dtape.random.normal([4]).numpy(), layer.kernel.numpy()] + rep
    first, second = draws(), draws()
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first[2], first[3])                      # replicas still draw apart
    dtape.random.set_seed(5)
    a = dtape.random.normal([4]).numpy()
    torch.manual_seed(5)
    np.testing.assert_array_equal(a, torch.randn(4).numpy())           # it is torch's global seed
    with pytest.raises(TypeError, match="seed must be an int"):
        dtape.random.set_seed(1.5)


def test_every_tf_op_takes_tfs_name_argument_and_ignores_it():
    # TF ops all take `name=` (the autodiff guide writes tf.constant(3.0, name="x3")); eager TF ignores it
    public = [n for n in dtape.ops.__all__ if callable(getattr(dtape, n)) and n not in ("getitem", "to_device")]
    public += [f"nn.{n}" for n in ("dropout", "embedding_lookup", "relu", "softmax")]
    for n in public:
        fn = dtape.nn if n.startswith("nn.") else dtape
        fn = getattr(fn, n.split(".")[-1])
        assert "name" in inspect.signature(fn).parameters, n
    x = dtape.constant([[1.0, 2.0], [3.0, 4.0]], name="x")
    v = dtape.Variable(3.0, name="x0")
    with dtape.GradientTape() as tape:
        y = dtape.reduce_sum(dtape.matmul(x, x, name="m") * v, axis=0, name="s")
        z = dtape.add_n([y, dtape.zeros([2], name="z")], name="a") + dtape.nn.relu(y, name="r")
    assert z.numpy().tolist() == [2 * 3.0 * 22.0, 2 * 3.0 * 32.0]
    assert float(tape.gradient(z, v)) == 2 * (22.0 + 32.0)
    assert dtape.convert_to_tensor([1, 2], name="c").numpy().tolist() == [1, 2]
    assert int(dtape.size(x, name="n")) == 4 and dtape.range(3, name="r").numpy().tolist() == [0, 1, 2]


@pytest.mark.parametrize("adjoint", [False, True])
def test_linalg_solve_value_and_gradient_match_torch_autograd(adjoint):
    # the advanced-autodiff guide's Newton step: solve(hessian + eps * I, gradient), batched here too
    g = torch.Generator().manual_seed(4)
    a = torch.randn(2, 4, 4, generator=g, dtype=D) + 4 * torch.eye(4, dtype=D)
    b = torch.randn(2, 4, 3, generator=g, dtype=D)
    got, got_g = _grad(lambda m, r: dtape.linalg.solve(m, r, adjoint=adjoint), a, b)
    want, want_g = _torch_grad(lambda m, r: torch.linalg.solve(m.mT if adjoint else m, r), a, b)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for x, y in zip(got_g, want_g):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"solve: matrix must be \[\.\.\., m, m\].*\(2, 4, 4\) and \(4, 3\)"):
        dtape.linalg.solve(dtape.constant(a), dtape.constant(b[0]))
