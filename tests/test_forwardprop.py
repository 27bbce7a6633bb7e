"""Forward mode (`dtape.autodiff.ForwardAccumulator`): every registry op against torch.func.jvp in float64,
nesting with GradientTape both ways against torch.autograd.functional.hvp, and TF's accumulator semantics.

Per registry op and sample (the samples tests/test_op_gradients.py uses):

* the op's tangent against `torch.func.jvp` of its forward, through its
  explicit rule when it has one and through the rule derived from its
  gradient rule (always);
* forward-over-back (`acc.jvp(tape.gradient(...))`) and back-over-forward
  (`tape.gradient(acc.jvp(...))`): both give H v for the Hessian H of
  <cotangent, forward>, against `torch.autograd.functional.hvp`.
"""
import pathlib
import re
import threading

import pytest
import torch

import dtape
from _op_samples import as_tuple as _as_tuple, flat_inputs as _flat, pack_inputs as _pack
from _strategies import mirrored
from dtape.ops import REGISTRY
from dtape.ops._samples import Special

D = torch.float64
TOL = dict(rtol=1e-7, atol=1e-9)
ForwardAccumulator = dtape.autodiff.ForwardAccumulator


def _cases():
    for opdef in REGISTRY:
        if opdef.grad_fn is None or opdef.samples is None:
            continue
        for i, sample in enumerate(opdef.samples(torch.Generator().manual_seed(0))):
            if isinstance(sample, Special):  # ties, kinks: torch's forward rule may pick another one-sided value
                continue
            args, attrs = sample
            yield pytest.param(opdef, args, attrs, id=f"{opdef.name}-{i}")


CASES = list(_cases())
OPS_CHECKED = sorted({c.values[0].name for c in CASES})


def _positions(flat):
    return [k for k, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.dtype.is_floating_point]


def _randn_like(xs, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(tuple(x.shape), generator=gen, dtype=D).to(x.dtype) for x in xs]


def _torch_fn(opdef, args, attrs, flat, pos):
    """The op's forward on torch tensors as a function of the floating inputs at `pos`: its float outputs."""
    def fn(*diff):
        xs = list(flat)
        for k, d in zip(pos, diff):
            xs[k] = d
        out = opdef.forward(*_pack(opdef, args, xs), **attrs)
        out = out[0] if opdef.stash else out
        return tuple(o for o in _as_tuple(out) if o.dtype.is_floating_point)
    return fn


def _dtape_jvp(opdef, args, attrs, flat, pos, vs):
    xs = [dtape.constant(x) if isinstance(x, torch.Tensor) else x for x in flat]
    with ForwardAccumulator([xs[k] for k in pos], [dtape.constant(v) for v in vs]) as acc:
        outs = [o for o in _as_tuple(opdef.fn(*_pack(opdef, args, xs), **attrs)) if o.dtype.is_floating_point]
    return [acc.jvp(o, unconnected_gradients="zero").torch() for o in outs]


@pytest.mark.parametrize("opdef,args,attrs", CASES)
def test_op_jvp_matches_torch_func_jvp(opdef, args, attrs, monkeypatch):
    flat = _flat(opdef, args)
    pos = _positions(flat)
    vs = _randn_like([flat[k] for k in pos], 3)
    _, want = torch.func.jvp(_torch_fn(opdef, args, attrs, flat, pos), tuple(flat[k] for k in pos), tuple(vs))
    paths = ["explicit", "derived"] if opdef.jvp_fn is not None else ["derived"]
    for path in paths:
        if path == "derived":
            monkeypatch.setattr(opdef, "jvp_fn", None)
        got = _dtape_jvp(opdef, args, attrs, flat, pos, vs)
        assert len(got) == len(want)
        for k, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g, w, **TOL, msg=lambda m: f"{opdef.name} ({path} rule) output {k}: {m}")


def _torch_hvp(opdef, args, attrs, flat, pos, cots, vs):
    fn = _torch_fn(opdef, args, attrs, flat, pos)

    def phi(*diff):
        return sum(torch.sum(o.to(D) * c.to(D)) for o, c in zip(fn(*diff), cots))
    primals = tuple(flat[k] for k in pos)
    if opdef.name in ("conv2d", "conv2d_transpose"):
        # torch's backward of slow_conv2d refuses a one-channel filter ("grad_weight must be contiguous"), and
        # its double backward of a transposed convolution refuses output_padding:
        # H v as the forward-mode Jacobian of the directional derivative <grad phi, v> (forward over forward)
        def directional(*p):
            return torch.func.jvp(phi, p, tuple(vs))[1]
        return torch.func.jacfwd(directional, argnums=tuple(range(len(pos))))(*primals)
    return torch.autograd.functional.hvp(phi, primals, tuple(vs))[1]


def _forward_over_back(opdef, args, attrs, flat, pos, cots, vs):
    xs = [dtape.constant(x) if isinstance(x, torch.Tensor) else x for x in flat]
    srcs = [xs[k] for k in pos]
    with ForwardAccumulator(srcs, [dtape.constant(v) for v in vs]) as acc:
        with dtape.GradientTape() as tape:
            tape.watch(srcs)
            outs = [o for o in _as_tuple(opdef.fn(*_pack(opdef, args, xs), **attrs)) if o.dtype.is_floating_point]
        grads = tape.gradient(outs, srcs, output_gradients=[dtape.constant(c) for c in cots],
                              unconnected_gradients="zero")
    return [acc.jvp(g, unconnected_gradients="zero").torch() for g in grads]


def _back_over_forward(opdef, args, attrs, flat, pos, cots, vs):
    xs = [dtape.constant(x) if isinstance(x, torch.Tensor) else x for x in flat]
    srcs = [xs[k] for k in pos]
    with dtape.GradientTape() as tape:
        tape.watch(srcs)
        with ForwardAccumulator(srcs, [dtape.constant(v) for v in vs]) as acc:
            outs = [o for o in _as_tuple(opdef.fn(*_pack(opdef, args, xs), **attrs)) if o.dtype.is_floating_point]
        jvps = [acc.jvp(o, unconnected_gradients="zero") for o in outs]
    grads = tape.gradient(jvps, srcs, output_gradients=[dtape.constant(c) for c in cots],
                          unconnected_gradients="zero")
    return [g.torch() for g in grads]


@pytest.mark.parametrize("opdef,args,attrs", CASES)
def test_op_hessian_vector_products_both_nestings_match_torch(opdef, args, attrs):
    flat = _flat(opdef, args)
    pos = _positions(flat)
    outs = _torch_fn(opdef, args, attrs, flat, pos)(*[flat[k] for k in pos])
    cots = _randn_like(outs, 1)
    vs = _randn_like([flat[k] for k in pos], 2)
    want = _torch_hvp(opdef, args, attrs, flat, pos, cots, vs)
    for name, how in (("forward-over-back", _forward_over_back), ("back-over-forward", _back_over_forward)):
        got = how(opdef, args, attrs, flat, pos, cots, vs)
        for k, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g.to(D), w.to(D), **TOL, msg=lambda m: f"{opdef.name} {name} input {k}: {m}")


def test_every_differentiable_registry_op_is_checked():
    differentiable = sorted(o.name for o in REGISTRY if o.grad_fn is not None)
    assert OPS_CHECKED == differentiable
    assert len(OPS_CHECKED) >= 69


# -- Python scalars on either side of a binary op --------------------------------
def _scalar_cases():
    for opdef in REGISTRY:
        if opdef.n_in != 2 or opdef.list_input or opdef.samples is None or opdef.grad_fn is None:
            continue
        for i, (args, attrs) in enumerate(opdef.samples(torch.Generator().manual_seed(0))):
            for k in (0, 1):
                if isinstance(args[1 - k], torch.Tensor) and isinstance(args[k], torch.Tensor) and args[k].ndim == 0:
                    yield pytest.param(opdef, args, attrs, k, id=f"{opdef.name}-{i}-scalar{k}")


@pytest.mark.parametrize("opdef,args,attrs,k", list(_scalar_cases()))
def test_binary_op_with_a_python_scalar_has_the_tensor_sides_tangent(opdef, args, attrs, k):
    other = 1 - k
    x, v = args[other], _randn_like([args[other]], 4)[0]
    scalar = float(args[k])

    def fn(t):
        pair = [None, None]
        pair[k], pair[other] = torch.tensor(scalar, dtype=D), t
        return opdef.forward(*pair, **attrs)
    _, want = torch.func.jvp(fn, (x,), (v,))
    xt = dtape.constant(x)
    with ForwardAccumulator(xt, dtape.constant(v)) as acc:
        pair = [None, None]
        pair[k], pair[other] = scalar, xt
        y = opdef.fn(*pair, **attrs)
    torch.testing.assert_close(acc.jvp(y).torch(), want, **TOL)


# -- TF's documented behaviour -----------------------------------------------------
def test_forward_over_back_hessian_vector_product_of_tfs_docstring():
    v = dtape.Variable([1.0, 2.0])
    with ForwardAccumulator(v, dtape.constant([1.0, 0.0])) as acc:
        with dtape.GradientTape() as tape:
            y = dtape.reduce_sum(v ** 3.0)
        backward = tape.gradient(y, v)
    assert backward.numpy().tolist() == [3.0, 12.0]
    assert acc.jvp(backward).numpy().tolist() == [6.0, 0.0]


def test_nested_accumulators_give_second_order_from_the_outer_one_only():
    primal = dtape.constant(1.1, dtype=D)
    with ForwardAccumulator(primal, dtape.constant(1.0, dtype=D)) as outer:
        with ForwardAccumulator(primal, dtape.constant(1.0, dtype=D)) as inner:
            primal_out = primal ** dtape.constant(3.5, dtype=D)
    inner_jvp = inner.jvp(primal_out)
    assert float(inner_jvp) == pytest.approx(3.5 * 1.1 ** 2.5, rel=1e-12)
    assert float(outer.jvp(inner_jvp)) == pytest.approx(3.5 * 2.5 * 1.1 ** 1.5, rel=1e-12)
    # strict nesting: the inner accumulator did not see the outer one's tangent computation
    assert float(outer.jvp(primal_out)) == pytest.approx(3.5 * 1.1 ** 2.5, rel=1e-12)
    assert inner.jvp(outer.jvp(primal_out)) is None


def _mlp(x, w1, w2):
    return dtape.reduce_sum(dtape.tanh(dtape.matmul(dtape.tanh(dtape.matmul(x, w1)), w2)) ** 2.0)


def _mlp_torch(x, w1, w2):
    return torch.sum(torch.tanh(torch.tanh(x @ w1) @ w2) ** 2)


def _mlp_data():
    gen = torch.Generator().manual_seed(7)
    x, w1, w2 = (torch.randn(s, generator=gen, dtype=D) for s in ((4, 3), (3, 5), (5, 2)))
    v1, v2 = (torch.randn(s, generator=gen, dtype=D) for s in ((3, 5), (5, 2)))
    return x, w1, w2, v1, v2


def test_hessian_vector_product_of_a_network_both_nestings_and_variables_match_torch():
    x, w1, w2, v1, v2 = _mlp_data()
    _, want = torch.autograd.functional.hvp(lambda a, b: _mlp_torch(x, a, b), (w1, w2), (v1, v2))
    w1v, w2v = dtape.Variable(w1), dtape.Variable(w2)
    # forward over back: the intermediates die before the walk, which reads them back from the tape
    with ForwardAccumulator([w1v, w2v], [dtape.constant(v1), dtape.constant(v2)]) as acc:
        with dtape.GradientTape() as tape:
            loss = _mlp(dtape.constant(x), w1v, w2v)
        grads = tape.gradient(loss, [w1v, w2v])
    for g, w in zip(acc.jvp(grads), want):
        torch.testing.assert_close(g.torch(), w, **TOL)
    # back over forward
    with dtape.GradientTape() as tape:
        with ForwardAccumulator([w1v, w2v], [dtape.constant(v1), dtape.constant(v2)]) as acc:
            loss = _mlp(dtape.constant(x), w1v, w2v)
        jvp = acc.jvp(loss)
    for g, w in zip(tape.gradient(jvp, [w1v, w2v]), want):
        torch.testing.assert_close(g.torch(), w, **TOL)
    _, want_jvp = torch.func.jvp(lambda a, b: _mlp_torch(x, a, b), (w1, w2), (v1, v2))
    torch.testing.assert_close(jvp.torch(), want_jvp, **TOL)


def test_kernel_columns_by_forward_mode_equal_the_gradient():
    """TF's docstring: a Jacobian with one row, column by column in forward mode, equals the gradient."""
    x = dtape.constant([[2.0, 3.0], [1.0, 4.0]], dtype=D)
    targets = dtape.constant([[1.0], [-1.0]], dtype=D)
    kernel = dtape.Variable(torch.tensor([[0.3], [-0.2]], dtype=D))
    bias = dtape.Variable(torch.tensor([0.1], dtype=D))

    def loss_fn():
        return dtape.reduce_sum((dtape.matmul(x, kernel) + bias - targets) ** 2.0)
    columns = []
    for e in ([[1.0], [0.0]], [[0.0], [1.0]]):
        with ForwardAccumulator(kernel, dtape.constant(e, dtype=D)) as acc:
            columns.append(float(acc.jvp(loss_fn())))
    with ForwardAccumulator(bias, dtape.constant([1.0], dtype=D)) as acc:
        bias_fprop = float(acc.jvp(loss_fn()))
    with dtape.GradientTape() as tape:
        loss = loss_fn()
    kernel_grad, bias_grad = tape.gradient(loss, (kernel, bias))
    assert kernel_grad.numpy().ravel().tolist() == pytest.approx(columns, rel=1e-12)
    assert float(bias_grad[0]) == pytest.approx(bias_fprop, rel=1e-12)


def test_jvp_of_unconnected_targets_and_after_the_block():
    x, z = dtape.constant([1.0, 2.0]), dtape.constant([5.0, 6.0])
    with ForwardAccumulator(x, dtape.constant([1.0, 1.0])) as acc:
        y = x * 3.0
        w = z * 2.0  # does not depend on x
        n = dtape.argmax(y)  # integer: no tangent
    after = x * 4.0  # the accumulator is no longer active
    assert acc.jvp(y).numpy().tolist() == [3.0, 3.0]
    assert acc.jvp(w) is None and acc.jvp(n) is None and acc.jvp(after) is None
    assert acc.jvp(w, unconnected_gradients=dtape.UnconnectedGradients.ZERO).numpy().tolist() == [0.0, 0.0]
    assert acc.jvp({"a": [y, w]}, unconnected_gradients="zero")["a"][1].numpy().tolist() == [0.0, 0.0]
    assert acc.jvp(x).numpy().tolist() == [1.0, 1.0]  # a primal's own tangent


def test_watch_adds_to_a_tangent_and_bad_arguments_say_what_is_wrong():
    x = dtape.constant([1.0, 2.0])
    acc = ForwardAccumulator(x, dtape.constant([1.0, 0.0]))
    acc.watch(x, [0.0, 2.0])
    with acc:
        y = x * x
    assert acc.jvp(y).numpy().tolist() == [2.0, 8.0]
    with pytest.raises(ValueError, match="more than once"):
        ForwardAccumulator([x, x], [dtape.constant([1.0, 0.0])] * 2)
    with pytest.raises(ValueError, match="shape"):
        ForwardAccumulator(x, dtape.constant([1.0, 0.0, 3.0]))
    with pytest.raises(ValueError, match="1 primals but 2 tangents"):
        ForwardAccumulator([x], [dtape.constant([1.0, 0.0])] * 2)
    with pytest.raises(TypeError, match="dtape.Tensor or Variable"):
        ForwardAccumulator(torch.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match="already recording"):
        with acc:
            with acc:
                pass


def test_no_grad_and_stop_recording_accumulate_nothing():
    x = dtape.constant([1.0, 2.0])
    with ForwardAccumulator(x, dtape.constant([1.0, 1.0])) as acc:
        with torch.no_grad():
            a = x * 2.0
        with dtape.stop_recording():
            b = x * 2.0
        c = x * 2.0
    assert acc.jvp(a) is None and acc.jvp(b) is None
    assert acc.jvp(c).numpy().tolist() == [2.0, 2.0]


def test_tangents_of_dead_tensors_are_dropped():
    x = dtape.constant(torch.ones(1000))
    with ForwardAccumulator(x, dtape.constant(torch.ones(1000))) as acc:
        for _ in range(50):
            y = dtape.exp(x) * 2.0
    del y
    # bounded (100 tangents were computed): x's, and those of the last values the loop left (dropped at the next op)
    assert len(acc._tape.tangents) <= 4


def test_torch_functions_without_a_dtape_op_both_nestings():
    """torch.atan and torch.special.erf have no dtape op: the fallback's kept autograd graph gives their tangents."""
    gen = torch.Generator().manual_seed(3)
    x, v = torch.randn(5, generator=gen, dtype=D), torch.randn(5, generator=gen, dtype=D)

    def f(t):
        return torch.sum(torch.atan(t) * torch.special.erf(t))
    _, want = torch.func.jvp(f, (x,), (v,))
    _, want_hvp = torch.autograd.functional.hvp(f, x, v)
    xt = dtape.constant(x)
    with ForwardAccumulator(xt, dtape.constant(v)) as acc:  # no tape: the accumulator alone keeps the graph
        y = f(xt)
    torch.testing.assert_close(acc.jvp(y).torch(), want, **TOL)
    with ForwardAccumulator(xt, dtape.constant(v)) as acc:
        with dtape.GradientTape() as tape:
            tape.watch(xt)
            y = f(xt)
        g = tape.gradient(y, xt)
    torch.testing.assert_close(acc.jvp(y).torch(), want, **TOL)
    torch.testing.assert_close(acc.jvp(g).torch(), want_hvp, **TOL)
    with dtape.GradientTape() as tape:
        tape.watch(xt)
        with ForwardAccumulator(xt, dtape.constant(v)) as acc:
            y = f(xt)
        j = acc.jvp(y)
    torch.testing.assert_close(tape.gradient(j, xt).torch(), want_hvp, **TOL)


def test_dtape_function_custom_gradient_and_recompute_grad_inside_an_accumulator():
    x, w1, w2, v1, v2 = _mlp_data()
    _, want = torch.autograd.functional.hvp(lambda a, b: _mlp_torch(x, a, b), (w1, w2), (v1, v2))
    _, want_jvp = torch.func.jvp(lambda a, b: _mlp_torch(x, a, b), (w1, w2), (v1, v2))
    for wrap in (dtape.function, dtape.recompute_grad):
        fn = wrap(_mlp)
        w1t, w2t = dtape.constant(w1), dtape.constant(w2)
        with ForwardAccumulator([w1t, w2t], [dtape.constant(v1), dtape.constant(v2)]) as acc:
            with dtape.GradientTape() as tape:
                tape.watch([w1t, w2t])
                loss = fn(dtape.constant(x), w1t, w2t)
            grads = tape.gradient(loss, [w1t, w2t])
        torch.testing.assert_close(acc.jvp(loss).torch(), want_jvp, **TOL)
        for g, w in zip(acc.jvp(grads), want):
            torch.testing.assert_close(g.torch(), w, **TOL)

    @dtape.custom_gradient
    def log1pexp(t):
        e = dtape.exp(t)

        def grad(upstream):
            return upstream * (1 - 1 / (1 + e))
        return dtape.log(1 + e), grad
    t = dtape.constant([0.5, 100.0], dtype=D)
    with ForwardAccumulator(t, dtape.constant([1.0, 1.0], dtype=D)) as acc:
        y = log1pexp(t)
    # the tangent comes from the custom gradient (stable at 100, where the plain formula's would be too)
    torch.testing.assert_close(acc.jvp(y).torch(), torch.sigmoid(t.torch()), **TOL)


def test_complex_values_through_a_derived_rule_are_refused():
    x = dtape.constant(torch.tensor([1.0 + 2.0j, 0.5 - 1.0j], dtype=torch.complex128))
    with ForwardAccumulator(x, dtape.constant(torch.ones(2, dtype=torch.complex128))) as acc:
        y = x * x  # an explicit rule: holomorphic, fine
        with pytest.raises(NotImplementedError, match="complex"):
            dtape.reduce_prod(y)
    torch.testing.assert_close(acc.jvp(y).torch(), 2 * x.torch())


def test_a_function_recorded_before_the_accumulator_is_walked_as_eager_code_is():
    """Accumulator around the walk only (strict nesting): the forward's intermediates have no tangent, in
    eager code and through a dtape.function alike (its records replayed for the walk are no ops to it)."""
    x, w1, w2, v1, v2 = _mlp_data()
    results = []
    for fn in (_mlp, dtape.function(_mlp)):
        w1t, w2t = dtape.constant(w1), dtape.constant(w2)
        with dtape.GradientTape(persistent=True) as tape:
            tape.watch([w1t, w2t])
            loss = fn(dtape.constant(x), w1t, w2t)
        with ForwardAccumulator([w1t, w2t], [dtape.constant(v1), dtape.constant(v2)]) as acc:
            grads = tape.gradient(loss, [w1t, w2t])
        results.append([acc.jvp(g, unconnected_gradients="zero").torch() for g in grads])
    for eager, function in zip(*results):
        torch.testing.assert_close(function, eager, **TOL)


def test_api_docs_list_exactly_the_ops_with_explicit_rules():
    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    m = re.search(r"for (\d+) registered ops:\s*(.*?); plus variable reads", text, re.S)
    listed = sorted(n.strip() for n in m.group(2).split(","))
    explicit = sorted(o.name for o in REGISTRY if o.jvp_fn is not None)
    assert listed == explicit and int(m.group(1)) == len(explicit)
    m = re.search(r"with a gradient\s*\((\d+): (.*?)\)", text, re.S)
    derived = sorted(o.name for o in REGISTRY if o.jvp_fn is None and o.grad_fn is not None)
    assert sorted(n.strip() for n in m.group(2).split(",")) == derived and int(m.group(1)) == len(derived)


def _finite_difference_hvp(loss_of, variables, vectors, eps=1e-5):
    """Central differences of the tape gradient along `vectors` (float64 variables, restored after)."""
    def grads(sign):
        for var, v in zip(variables, vectors):
            var.assign_add(sign * eps * v)
        with dtape.GradientTape() as tape:
            loss = loss_of()
        out = [g.torch().clone() for g in tape.gradient(loss, variables)]
        for var, v in zip(variables, vectors):
            var.assign_add(-sign * eps * v)
        return out
    return [(a - b) / (2 * eps) for a, b in zip(grads(1.0), grads(-1.0))]


def test_tfs_resnet_hvp_idiom_on_a_layers_model():
    """TF's eager/benchmarks/resnet50/hvp_test.py: the trainable variables as primals, a model called with
    training=True (batch statistics) inside, `grad_tape.gradient(acc.jvp(loss), variables)`."""
    model = dtape.layers.Sequential([dtape.layers.Conv2D(3, 3, dtype=D),
                                     dtape.layers.BatchNormalization(dtype=D),
                                     dtape.layers.Flatten(), dtape.layers.Dense(4, activation="tanh", dtype=D),
                                     dtape.layers.Dense(2, dtype=D)])
    gen = torch.Generator().manual_seed(5)
    images = dtape.constant(torch.randn(3, 6, 6, 2, generator=gen, dtype=D))
    labels = dtape.one_hot(dtape.constant([0, 1, 1]), 2, dtype=D)
    model(images, training=True)
    variables = model.trainable_variables
    vector = [torch.randn(tuple(v.shape), generator=gen, dtype=D) for v in variables]

    def loss_of():
        logits = model(images, training=True)
        return dtape.reduce_mean(dtape.nn.softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    with dtape.GradientTape() as grad_tape:
        grad_tape.watch(variables)
        with ForwardAccumulator(primals=tuple(variables), tangents=tuple(dtape.constant(v) for v in vector)) as acc:
            loss = loss_of()
    back_over_forward = grad_tape.gradient(acc.jvp(loss), variables)
    with ForwardAccumulator(variables, [dtape.constant(v) for v in vector]) as acc:
        with dtape.GradientTape() as tape:
            loss = loss_of()
        forward_over_back = acc.jvp(tape.gradient(loss, variables))
    want = _finite_difference_hvp(loss_of, variables, vector)
    for a, b, w in zip(back_over_forward, forward_over_back, want):
        torch.testing.assert_close(a.torch(), w, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(b.torch(), a.torch(), **TOL)


def test_empty_tensors_get_empty_tangents():
    """TF's forwardprop_test pushes a zero-size tensor through Add."""
    x = dtape.zeros([0])
    with ForwardAccumulator(x, dtape.ones_like(x)) as acc:
        y = x + x
        z = dtape.reduce_prod(dtape.exp(x) * x, axis=0, keepdims=True)  # a derived rule on an empty input
    assert tuple(acc.jvp(y).shape) == (0,)
    assert acc.jvp(z).numpy().tolist() == [0.0]


def test_a_broadcast_input_alone_gives_a_tangent_of_the_outputs_shape():
    x, y = dtape.constant([[1.0], [2.0], [3.0]]), dtape.constant(torch.ones(3, 4))
    with ForwardAccumulator(x, dtape.constant([[1.0], [2.0], [3.0]])) as acc:
        out = x + y  # only x has a tangent: add's rule returns it as is
        prod = dtape.cast(x, dtape.float64) * 2.0
    assert acc.jvp(out).numpy().tolist() == [[1.0] * 4, [2.0] * 4, [3.0] * 4]
    assert acc.jvp(prod).dtype == dtape.float64


def test_ops_on_another_thread_are_followed_as_tapes_record_them():
    x = dtape.constant([1.0, 2.0])
    out = {}
    with ForwardAccumulator(x, dtape.constant([1.0, 1.0])) as acc:
        worker = threading.Thread(target=lambda: out.setdefault("y", dtape.exp(x)))
        worker.start()
        worker.join(timeout=60)
        assert not worker.is_alive()
    torch.testing.assert_close(acc.jvp(out["y"]).torch(), torch.exp(x.torch()))


@pytest.mark.usefixtures("closes_strategies")
def test_a_mirrored_variable_as_primal_in_both_contexts_and_record_operation():
    strategy = mirrored(2)
    with strategy.scope():
        v = dtape.Variable([1.0, 2.0])
    with ForwardAccumulator(v, dtape.constant([1.0, 0.5])) as acc:  # cross-replica: every component
        y = dtape.reduce_sum(v * v)
    assert float(acc.jvp(y)) == 4.0

    def step():
        with ForwardAccumulator(v, dtape.constant([1.0, 0.5])) as acc:  # replica: this replica's component
            y = dtape.reduce_sum(v * v)
        return acc.jvp(y)
    assert [float(t) for t in strategy.experimental_local_results(strategy.run(step))] == [4.0, 4.0]
    x = dtape.constant([1.0, 2.0])
    with ForwardAccumulator(x, dtape.constant([1.0, 1.0])) as acc:  # a seed-API op: derived from its function
        y = dtape.constant(x.torch() ** 2)
        dtape.tape.record_operation("square", [y], [x], lambda dy: dy * 2.0 * x)
    assert acc.jvp(y).numpy().tolist() == [2.0, 4.0]
