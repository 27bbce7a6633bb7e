"""dtape.function(jit_compile=True): the body traced once per signature into one graph and compiled.

Values and variable writes equal the eager body's (digits and charlm train
steps included), variables are graph inputs, TF's retracing rules and
warning, input_signature and reduce_retracing, trace-time errors naming the
user's line, gradients through a compiled call on an outer tape, dropout
following the caller's generator, and far fewer Python calls than eager.
Most tests use backend="eager" or "aot_eager" or None (the traced graph
itself): inductor compiles take long on a small CPU box; one test uses it.
"""
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import dtape
from dtape import _jit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from tasks import charlm, digits  # noqa: E402

D = torch.float64


def _sgd_body(w, b):
    def body(x, lr):
        with dtape.GradientTape() as tape:
            y = dtape.reduce_sum(dtape.tanh(dtape.matmul(x, w) + b) ** 2)
        gw, gb = tape.gradient(y, [w, b])
        w.assign_sub(lr * gw)
        b.assign_sub(lr * gb)
        return y
    return body


def _vars():
    return (dtape.Variable(torch.tensor([[1.0, 2.0], [3.0, -4.0]], dtype=D)),
            dtype_var([0.5, -0.5]))


def dtype_var(values):
    return dtape.Variable(torch.tensor(values, dtype=D))


def test_train_step_values_and_writes_equal_eager():
    x = dtape.constant(np.array([[1.0, -1.0], [0.5, 0.25]]))
    runs = []
    for jit in (False, True):
        w, b = _vars()
        body = _sgd_body(w, b)
        f = dtape.function(body, jit_compile=True, backend="eager") if jit else body
        losses = [f(x, 0.1).numpy() for _ in range(3)]
        runs.append((losses, w.numpy(), b.numpy()))
        if jit:
            assert f.trace_count == 1
    for eager, compiled in zip(*runs):
        np.testing.assert_allclose(compiled, eager, rtol=1e-12)


def test_variables_are_graph_inputs_not_constants():
    v = dtape.Variable(2.0)
    f = dtape.function(lambda x: x * v, jit_compile=True, backend=None)
    assert float(f(dtape.constant(3.0))) == 6.0
    v.assign(5.0)  # between calls: the graph must read the new value
    assert float(f(dtape.constant(3.0))) == 15.0
    assert f.trace_count == 1


def test_reads_after_a_write_in_the_body_see_it_and_writes_apply_after_the_call():
    v = dtape.Variable(1.0)

    def body(x):
        v.assign_add(x)
        return v * 10.0
    f = dtape.function(body, jit_compile=True, backend=None)
    assert float(f(dtape.constant(2.0))) == 30.0
    assert float(v) == 3.0
    assert float(f(dtape.constant(2.0))) == 50.0
    assert float(v) == 5.0


def test_reads_taken_before_the_call_keep_their_value():
    v = dtape.Variable([1.0, 2.0])
    before = v.read_value()
    def body():
        v.assign_sub([1.0, 1.0])
    f = dtape.function(body, jit_compile=True, backend=None)
    assert f() is None
    np.testing.assert_array_equal(before.numpy(), [1.0, 2.0])
    np.testing.assert_array_equal(v.numpy(), [0.0, 1.0])


def _expect_error_at(fn, marker, *args):
    """Calls `fn`; asserts OperatorNotAllowedInGraphError naming this file and the line holding `marker`."""
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if marker in text and "_expect_error_at" not in text)
    with pytest.raises(_jit.OperatorNotAllowedInGraphError) as info:
        fn(*args)
    assert f"{__file__}:{line}:" in str(info.value)
    assert "jit_compile=False" in str(info.value) and "dtape.where" in str(info.value)
    return str(info.value)


def test_python_control_flow_on_a_tensor_raises_at_trace_time_naming_the_line():
    def body(x):
        if dtape.reduce_sum(x) > 0:  # marker-if
            return x
        return -x
    f = dtape.function(body, jit_compile=True, backend=None)
    _expect_error_at(f, "# marker-if", dtape.constant([1.0]))


def test_host_reads_raise_at_trace_time_naming_the_line():
    f = dtape.function(lambda x: x * float(x[0]), jit_compile=True, backend=None)  # marker-float
    _expect_error_at(f, "# marker-float", dtape.constant([1.0]))
    g = dtape.function(lambda x: x * x.numpy()[0], jit_compile=True, backend=None)  # marker-numpy
    message = _expect_error_at(g, "# marker-numpy", dtape.constant([1.0]))
    assert ".numpy()" in message


def test_retracing_follows_tf_rules_and_warns_after_five_traces():
    f = dtape.function(lambda x, k: x * k, jit_compile=True, backend=None)
    f(dtape.ones([2]), 3)
    f(dtape.ones([2]), 3)  # same signature: no trace
    assert f.trace_count == 1
    f(dtape.ones([2]), 4)  # a Python value is part of the signature
    f(dtape.ones([2], dtype=D), 3)  # so is the dtype
    assert f.trace_count == 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f(dtape.ones([3]), 3)
        assert not caught
        f(dtape.ones([4]), 3)
    assert f.trace_count == 5
    (w,) = caught
    assert "triggered retracing" in str(w.message) and "<lambda>'" in str(w.message)
    assert "reduce_retracing=True" in str(w.message) and "[[4]]" in str(w.message)
    assert np.array_equal(f(dtape.ones([4]), 3).numpy(), [3.0] * 4)


def test_reduce_retracing_generalises_shapes():
    f = dtape.function(lambda x: dtape.reduce_sum(x * 2.0, axis=0), jit_compile=True, backend=None,
                       reduce_retracing=True)
    for n in range(1, 6):
        out = f(dtape.ones([n, 2]))
        np.testing.assert_array_equal(out.numpy(), [2.0 * n] * 2)
    assert f.trace_count == 2  # the second shape makes the batch dimension symbolic


def test_input_signature_traces_once_and_rejects_other_inputs():
    f = dtape.function(lambda x: dtape.reduce_sum(x, axis=0), jit_compile=True, backend=None,
                       input_signature=[dtape.TensorSpec([None, 2], dtape.float32)])
    for n in (1, 3, 5):
        np.testing.assert_array_equal(f(dtape.ones([n, 2])).numpy(), [n, n])
    assert f.trace_count == 1
    with pytest.raises(ValueError, match="do not match input_signature"):
        f(dtape.ones([3, 3]))
    with pytest.raises(ValueError, match="do not match input_signature"):
        f(dtape.ones([3, 2], dtype=D))


def test_outer_tape_gradients_equal_eager_float64():
    w = dtape.Variable(torch.tensor([[0.3, -0.2], [0.1, 0.4]], dtype=D))
    frozen = dtape.Variable(torch.tensor(1.5, dtype=D), trainable=False)

    def body(x, y):
        return dtape.reduce_sum(dtape.tanh(dtape.matmul(x, w)) * y) * frozen, x * 2.0
    results = []
    for fn in (body, dtape.function(body, jit_compile=True, backend="eager")):
        x = dtape.constant(np.array([[1.0, 2.0], [3.0, -1.0]]))
        y = dtape.constant(np.array([[0.5, 1.0], [-2.0, 0.25]]))
        with dtape.GradientTape(persistent=True) as tape:
            tape.watch([x, y])
            s, d = fn(x, y)
            total = s + dtape.reduce_sum(d * d)
        results.append([g.numpy() for g in tape.gradient(total, [x, y, w])] + [total.numpy()])
    for eager, compiled in zip(*results):
        np.testing.assert_allclose(compiled, eager, rtol=1e-6, atol=1e-12)


def test_outer_tape_second_order_raises_clearly():
    f = dtape.function(lambda x: x * x * x, jit_compile=True, backend=None)
    x = dtape.constant(2.0)
    with dtape.GradientTape() as outer:
        outer.watch(x)
        with dtape.GradientTape() as inner:
            inner.watch(x)
            y = f(x)
        with pytest.raises(RuntimeError, match="second-order gradient through compiled"):
            inner.gradient(y, x)


def test_variables_are_created_on_the_first_trace_only():
    layer = dtape.layers.Dense(3, seed=1)
    f = dtape.function(lambda x: layer(x), jit_compile=True, backend=None)
    out = f(dtape.ones([2, 4]))  # built lazily inside the first trace, for real
    assert len(layer.trainable_variables) == 2
    np.testing.assert_allclose(out.numpy(), layer(dtape.ones([2, 4])).numpy(), rtol=1e-6)
    f(dtape.ones([5, 4]))
    assert len(layer.trainable_variables) == 2

    # a body creating a variable on every call raises on its first call, as TF's (traced twice then)
    g = dtape.function(lambda x: dtape.Variable(1.0) * x, jit_compile=True, backend=None)
    with pytest.raises(ValueError, match="creates a variable again on a later trace"):
        g(dtape.ones([2]))


def test_variable_from_a_traced_value_makes_the_first_call_eager():
    state = {}

    def body(x):
        if "acc" not in state:  # a slot made from a tensor of the body, as an optimizer's
            state["acc"] = dtape.Variable(dtape.zeros_like(x), trainable=False)
        state["acc"].assign_add(x)
        return state["acc"] * 1.0
    f = dtape.function(body, jit_compile=True, backend=None)
    np.testing.assert_array_equal(f(dtape.ones([2])).numpy(), [1.0, 1.0])
    assert f.trace_count == 0
    np.testing.assert_array_equal(f(dtape.ones([2])).numpy(), [2.0, 2.0])
    assert f.trace_count == 1


def _digits_run(jit, steps, dropout, backend, seed=0):
    data = digits.load_data(0)
    torch.manual_seed(seed)
    model = digits.build_model(0, dropout=dropout)
    variables = model.trainable_variables
    momenta = [dtape.Variable(dtape.zeros_like(v), trainable=False) for v in variables]

    def step(x, y):
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_mean(digits.per_example_loss(model, x, y))
        grads = tape.gradient(loss, variables)
        for v, m, g in zip(variables, momenta, grads):  # SGD with momentum
            m.assign(0.9 * m + g)
            v.assign_sub(0.1 * m)
        return loss
    f = dtape.function(step, jit_compile=True, backend=backend) if jit else step
    losses = []
    for i in range(steps):
        batch = slice(16 * i, 16 * (i + 1))
        losses.append(float(f(dtape.constant(data["x_train"][batch]), dtape.constant(data["y_train"][batch]))))
    return np.array(losses), [v.numpy() for v in variables], f


def test_digits_train_step_with_dropout_equals_eager_and_follows_the_seed():
    eager = _digits_run(False, 20, 0.3, None)
    compiled = _digits_run(True, 20, 0.3, None)  # aot_eager too: equal, but its compile is minutes on a loaded box
    np.testing.assert_allclose(compiled[0], eager[0], rtol=1e-5)
    for a, b in zip(compiled[1], eager[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert compiled[2].trace_count == 1
    other_seed = _digits_run(True, 3, 0.3, None, seed=1)
    assert not np.allclose(other_seed[0], compiled[0][:3])  # dropout draws from the caller's generator


@pytest.mark.slow
def test_charlm_train_step_with_adam_schedule_and_clipping_equals_eager():
    data = charlm.load_data(0)
    runs = []
    for jit in (False, True):
        torch.manual_seed(0)
        model = charlm.build_model(0, dropout=0.1)
        model(data["x_train"][:1, :8])
        variables = model.trainable_variables
        ms = [dtape.Variable(dtape.zeros_like(v), trainable=False) for v in variables]
        vs = [dtape.Variable(dtape.zeros_like(v), trainable=False) for v in variables]
        iterations = dtape.Variable(0.0, trainable=False)

        def step(x, y):
            with dtape.GradientTape() as tape:
                loss = dtape.reduce_mean(charlm.per_example_loss(model, x, y))
            grads, _ = dtape.clip_by_global_norm(tape.gradient(loss, variables), 1.0)
            iterations.assign_add(1.0)
            lr = 3e-3 * dtape.minimum(1.0, iterations / 10.0)  # warm-up schedule, a tensor of the step
            c1, c2 = 1.0 - 0.9 ** iterations, 1.0 - 0.999 ** iterations
            for v, m, s, g in zip(variables, ms, vs, grads):  # Adam
                m.assign(0.9 * m + 0.1 * g)
                s.assign(0.999 * s + 0.001 * g * g)
                v.assign_sub(lr * (m / c1) / (dtape.sqrt(s / c2) + 1e-7))
            return loss
        f = dtape.function(step, jit_compile=True, backend=None) if jit else step
        losses = [float(f(dtape.constant(data["x_train"][2 * i:2 * i + 2, :16]),
                          dtape.constant(data["y_train"][2 * i:2 * i + 2, :16]))) for i in range(20)]
        runs.append((np.array(losses), [v.numpy() for v in variables]))
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-5)
    for a, b in zip(runs[1][1], runs[0][1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _python_calls(fn, *args):
    count = [0]

    def profile(frame, event, arg):
        if event == "call":
            count[0] += 1
    sys.setprofile(profile)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return count[0]


def test_inductor_step_equals_eager_with_a_fraction_of_the_python_calls():
    data = digits.load_data(0)
    x, y = dtape.constant(data["x_train"][:16]), dtape.constant(data["y_train"][:16])
    counts, losses = [], []
    for jit in (False, True):
        model = digits.build_model(0)
        variables = model.trainable_variables

        def step(x, y):
            with dtape.GradientTape() as tape:
                loss = dtape.reduce_mean(digits.per_example_loss(model, x, y))
            for v, g in zip(variables, tape.gradient(loss, variables)):
                v.assign_sub(0.1 * g)
            return loss
        f = dtape.function(step, jit_compile=True) if jit else step  # the default backend: inductor
        losses.append([float(f(x, y)) for _ in range(3)])
        counts.append(_python_calls(f, x, y))
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    assert counts[1] < 0.35 * counts[0], counts



def test_cpu_inductor_graphs_run_the_cpp_wrapper_unless_the_options_choose():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")

    def options(device, **kwargs):
        return _jit._device_options(dtape.function(lambda x: x, jit_compile=True, **kwargs), device)
    assert options(cpu) == {"options": {"fallback_random": True, "cpp_wrapper": True}}
    assert options(cpu, compile_options={"options": {"cpp_wrapper": False}})["options"]["cpp_wrapper"] is False
    assert options(cpu, compile_options={"mode": "max-autotune-no-cudagraphs"}) == {
        "mode": "max-autotune-no-cudagraphs"}
    assert options(cuda) == {"options": {"fallback_random": True}}
    assert options(cpu, backend="aot_eager") == {}


def test_inductor_cpp_wrapper_step_with_dropout_equals_eager():
    eager = _digits_run(False, 4, 0.3, None)
    compiled = _digits_run(True, 4, 0.3, "inductor")  # on the CPU: the C++ wrapper
    np.testing.assert_allclose(compiled[0], eager[0], rtol=1e-5)
    for a, b in zip(compiled[1], eager[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)

def _digits_optimizer_run(jit, make_optimizer, steps):
    data = digits.load_data(0)
    torch.manual_seed(0)
    model = digits.build_model(0, dropout=0.2)
    optimizer = make_optimizer()

    def step(x, y):
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_mean(digits.per_example_loss(model, x, y))
        variables = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss
    f = dtape.function(step, jit_compile=True, backend=None) if jit else step
    losses = [float(f(dtape.constant(data["x_train"][16 * i:16 * (i + 1)]),
                      dtape.constant(data["y_train"][16 * i:16 * (i + 1)]))) for i in range(steps)]
    return np.array(losses), [v.numpy() for v in model.trainable_variables], int(optimizer.iterations.numpy())


@pytest.mark.skipif(not hasattr(dtape.optimizers.Optimizer, "_step_count"),
                    reason="the optimizers read their step count on the host (int(iterations.numpy())) "
                           "until the traceable optimizers are merged")
@pytest.mark.parametrize("make_optimizer", [
    lambda: dtape.optimizers.SGD(0.1, momentum=0.9),
    lambda: dtape.optimizers.Adam(dtape.optimizers.schedules.ExponentialDecay(1e-2, 5, 0.5), clipnorm=1.0),
], ids=["sgd_momentum", "adam_schedule_clipnorm"])
def test_digits_step_with_an_optimizer_equals_eager(make_optimizer):
    eager = _digits_optimizer_run(False, make_optimizer, 20)
    compiled = _digits_optimizer_run(True, make_optimizer, 20)
    np.testing.assert_allclose(compiled[0], eager[0], rtol=1e-5)
    for a, b in zip(compiled[1], eager[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert compiled[2] == eager[2] == 20


# -- writes into the variables' own buffers ------------------------------------------------------------------
def _adam_like_body(w, m):
    def body(x):
        with dtape.GradientTape() as tape:
            y = dtape.reduce_sum(dtape.tanh(dtape.matmul(x, w)) ** 2)
        g = tape.gradient(y, w)
        m.assign(0.9 * m + 0.1 * g)
        w.assign_sub(0.1 * m)
        return y
    return body


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_writes_go_into_the_variables_buffers_and_equal_eager_float64(backend):
    x = dtape.constant(np.array([[1.0, -1.0], [0.5, 0.25]]))
    runs = []
    for jit in (False, True):
        w, m = _vars()[0], dtype_var([[0.0, 0.0], [0.0, 0.0]])
        f = _adam_like_body(w, m)
        f = dtape.function(f, jit_compile=True, backend=backend) if jit else f
        f(x)
        buffers = [w.torch().data_ptr(), m.torch().data_ptr()]
        losses = [f(x).numpy() for _ in range(3)]
        runs.append((losses, w.numpy(), m.numpy()))
        if jit:  # nothing else held them: written in place, as eager's optimizers do
            assert f._concrete and next(iter(f._concrete.values()))[0]._targets is not None
            assert [w.torch().data_ptr(), m.torch().data_ptr()] == buffers
    for eager, compiled in zip(*runs):
        np.testing.assert_allclose(compiled, eager, rtol=1e-12)


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_a_value_taken_before_a_compiled_step_keeps_its_value(backend):
    w, m = _vars()[0], dtype_var([[0.0, 0.0], [0.0, 0.0]])
    f = dtape.function(_adam_like_body(w, m), jit_compile=True, backend=backend)
    x = dtape.constant(np.array([[1.0, -1.0], [0.5, 0.25]]))
    f(x)
    before_w, before_m = w.value(), m.read_value()
    kept = [before_w.numpy().copy(), before_m.numpy().copy()]
    f(x)
    np.testing.assert_array_equal(before_w.numpy(), kept[0])
    np.testing.assert_array_equal(before_m.numpy(), kept[1])
    assert not np.array_equal(w.numpy(), kept[0]) and not np.array_equal(m.numpy(), kept[1])


def test_a_storage_shared_with_its_owner_gets_the_compiled_write():
    owner = torch.zeros(2, dtype=D)
    v = dtape.Variable(torch.tensor([1.0, 2.0], dtype=D))
    dtape.variables.share_storage(v, owner)  # the owner's tensor now holds the variable's value

    def body(x):
        v.assign_add(x)
    f = dtape.function(body, jit_compile=True, backend="aot_eager")
    f(dtape.constant(np.array([0.5, -1.0])))
    np.testing.assert_array_equal(owner.numpy(), [1.5, 1.0])
    assert v.torch() is owner


def test_outer_tape_gradient_of_a_step_writing_what_it_reads_uses_the_values_before_the_write():
    results = []
    for jit in (False, True):
        w = dtape.Variable(torch.tensor([[0.3, -0.2], [0.1, 0.4]], dtype=D))

        def body(x):
            y = dtape.reduce_sum(dtape.tanh(dtape.matmul(x, w)))
            w.assign_sub(0.5 * w)
            return y
        fn = dtape.function(body, jit_compile=True, backend="aot_eager") if jit else body
        x = dtape.constant(np.array([[1.0, 2.0], [3.0, -1.0]]))
        with dtape.GradientTape() as tape:
            tape.watch(x)
            y = fn(x)
        results.append([g.numpy() for g in tape.gradient(y, [x, w])] + [w.numpy()])
    for eager, compiled in zip(*results):
        np.testing.assert_allclose(compiled, eager, rtol=1e-12)
