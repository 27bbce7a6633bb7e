"""Property tests (hypothesis): random programs of registered ops, random thread schedules.

* Random DAGs of elementwise, broadcasting and reduction ops on random
  broadcast-compatible float64 shapes: dtape's first and second order
  gradients equal torch.autograd's of the same program written in torch.
* Random thread schedules (`interleaved` with a drawn seed) with random
  stop-recording sections: threads run
  ops on a tensor one tape watches; the gradient and the number of records
  are exactly those of the ops that were recorded (known in closed form).
"""
import threading
import time

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import dtape

from _interleave import interleaved

D = torch.float64
TIMEOUT = 5
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])

# name -> (dtape function, torch function); composites keep inputs in the op's domain.
UNARY = {
    "tanh": (dtape.tanh, torch.tanh), "sin": (dtape.sin, torch.sin), "cos": (dtape.cos, torch.cos),
    "sigmoid": (dtape.sigmoid, torch.sigmoid), "square": (dtape.square, torch.square),
    "negative": (dtape.negative, torch.neg), "exp": (dtape.exp, torch.exp),
    "softplus": (dtape.nn.softplus, F.softplus), "elu": (dtape.nn.elu, F.elu),
    "log1p_sq": (lambda x: dtape.log1p(dtape.square(x)), lambda x: torch.log1p(x * x)),
    "sqrt_sq1": (lambda x: dtape.sqrt(dtape.square(x) + 1.0), lambda x: torch.sqrt(x * x + 1.0)),
    "rsqrt_sq1": (lambda x: dtape.rsqrt(1.0 + dtape.square(x)), lambda x: torch.rsqrt(1.0 + x * x)),
}
BINARY = {
    "add": (dtape.add, torch.add), "subtract": (dtape.subtract, torch.sub),
    "multiply": (dtape.multiply, torch.mul), "maximum": (dtape.maximum, torch.maximum),
    "minimum": (dtape.minimum, torch.minimum),
    "divide_safe": (lambda a, b: dtape.divide(a, dtape.square(b) + 1.0), lambda a, b: a / (b * b + 1.0)),
    "pow_safe": (lambda a, b: dtape.pow(dtape.square(a) + 0.5, dtape.tanh(b)),
                 lambda a, b: torch.pow(a * a + 0.5, torch.tanh(b))),
}
REDUCE = {
    "reduce_sum": (dtape.reduce_sum, torch.sum), "reduce_mean": (dtape.reduce_mean, torch.mean),
    "reduce_max": (dtape.reduce_max, torch.amax), "reduce_min": (dtape.reduce_min, torch.amin),
    "reduce_logsumexp": (dtape.reduce_logsumexp, torch.logsumexp),
    "reduce_prod": (dtape.reduce_prod, None),
}


def _torch_reduce(name, x, axes, keepdims):
    if name == "reduce_prod":
        out = x
        for a in sorted(axes, reverse=True):
            out = torch.prod(out, dim=a, keepdim=True)
        return out if keepdims else out.reshape([s for i, s in enumerate(x.shape) if i not in axes])
    return REDUCE[name][1](x, dim=axes, keepdim=keepdims)


@st.composite
def programs(draw):
    """(input shapes, steps): steps refer to earlier nodes by index; all shapes broadcast to `base`."""
    base = draw(st.lists(st.integers(1, 3), max_size=3))
    n_in = draw(st.integers(1, 3))
    shapes = []
    for _ in range(n_in):
        drop = draw(st.integers(0, len(base)))
        shapes.append(tuple(1 if draw(st.booleans()) else d for d in base[drop:]))
    ranks = [len(s) for s in shapes]
    steps = []
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["u", "b", "b", "r"]))
        i = draw(st.integers(0, len(ranks) - 1))
        if kind == "u":
            steps.append(("u", draw(st.sampled_from(sorted(UNARY))), i))
            ranks.append(ranks[i])
        elif kind == "b":
            j = draw(st.integers(0, len(ranks) - 1))
            steps.append(("b", draw(st.sampled_from(sorted(BINARY))), i, j))
            ranks.append(max(ranks[i], ranks[j]))
        else:
            r = ranks[i]
            how = draw(st.sampled_from(["all", "leading", "any"]))
            keepdims = draw(st.booleans()) if how != "any" else True
            if how == "all":
                axis = None
            elif how == "leading":  # removing leading dims keeps right-aligned broadcasting
                axis = tuple(range(draw(st.integers(0, r)))) if r else None
            else:
                axis = tuple(sorted(draw(st.sets(st.integers(0, max(r - 1, 0)), max_size=r)))) if r else None
            steps.append(("r", draw(st.sampled_from(sorted(REDUCE))), i, axis, keepdims))
            ranks.append(r if keepdims else (0 if axis is None else r - len(axis)))
    return shapes, steps, draw(st.integers(0, 2 ** 31 - 1))


def _run_program(steps, inputs, weights, lib):
    """Evaluates the program with dtape ('d') or torch ('t') ops; returns sum_k <w_k, node_k>."""
    nodes = list(inputs)
    for step in steps:
        if step[0] == "u":
            nodes.append(UNARY[step[1]][lib == "t"](nodes[step[2]]))
        elif step[0] == "b":
            nodes.append(BINARY[step[1]][lib == "t"](nodes[step[2]], nodes[step[3]]))
        else:
            _, name, i, axis, keepdims = step
            x = nodes[i]
            if lib == "d":
                nodes.append(REDUCE[name][0](x, axis=axis, keepdims=keepdims))
            else:
                axes = tuple(range(x.ndim)) if axis is None else axis
                nodes.append(_torch_reduce(name, x, axes, keepdims) if axes else x.clone())
    terms = []
    for node, w in zip(nodes[len(inputs):], weights):
        if lib == "d":
            terms.append(dtape.reduce_sum(node * dtape.constant(w)))
        else:
            terms.append(torch.sum(node * w))
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total, nodes


def _setup(shapes, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.rand(s, generator=gen, dtype=D) * 3 - 1.5 for s in shapes]
    # Values of the torch run give each node's shape for its weight.
    _, nodes = _run_program(steps, xs, [torch.zeros(())] * len(steps), "t")
    assume(all(torch.isfinite(n).all() and n.abs().max() < 1e6 for n in nodes if n.numel()))
    weights = [torch.randn(tuple(n.shape), generator=gen, dtype=D) for n in nodes[len(xs):]]
    vs = [torch.randn(s, generator=gen, dtype=D) for s in shapes]
    return xs, weights, vs


def _close(got, want, xs, what):
    for k, (g, w, x) in enumerate(zip(got, want, xs)):
        g = torch.zeros_like(x) if g is None else (g.torch() if isinstance(g, dtape.Tensor) else g)
        w = torch.zeros_like(x) if w is None else w.detach()
        scale = 1.0 + float(w.abs().max()) if w.numel() else 1.0
        torch.testing.assert_close(g, w, rtol=1e-7, atol=1e-9 * scale, msg=lambda m: f"{what} input {k}: {m}")


@settings(max_examples=40, **SETTINGS)
@given(programs())
def test_random_dag_first_order_matches_torch_autograd(program):
    shapes, steps, seed = program
    xs, weights, _ = _setup(shapes, steps, seed)
    srcs = [dtape.constant(x) for x in xs]
    with dtape.GradientTape() as tape:
        tape.watch(srcs)
        total, _ = _run_program(steps, srcs, weights, "d")
    got = tape.gradient(total, srcs)
    ts = [x.clone().requires_grad_() for x in xs]
    want_total, _ = _run_program(steps, ts, weights, "t")
    torch.testing.assert_close(total.torch(), want_total.detach(), rtol=1e-10, atol=1e-10)
    want = torch.autograd.grad(want_total, ts, allow_unused=True)
    _close(got, want, xs, f"first order of {steps}")


@settings(max_examples=30, **SETTINGS)
@given(programs())
def test_random_dag_second_order_matches_torch_double_backward(program):
    shapes, steps, seed = program
    xs, weights, vs = _setup(shapes, steps, seed)
    srcs = [dtape.constant(x) for x in xs]
    with dtape.GradientTape() as outer:
        outer.watch(srcs)
        with dtape.GradientTape() as inner:
            inner.watch(srcs)
            total, _ = _run_program(steps, srcs, weights, "d")
        grads = inner.gradient(total, srcs)
        terms = [dtape.reduce_sum(g * dtape.constant(v)) for g, v in zip(grads, vs) if g is not None]
        s = dtape.add_n(terms) if len(terms) > 1 else (terms[0] if terms else None)
    got = outer.gradient(s, srcs) if s is not None else [None] * len(srcs)
    ts = [x.clone().requires_grad_() for x in xs]
    want_total, _ = _run_program(steps, ts, weights, "t")
    tgrads = torch.autograd.grad(want_total, ts, allow_unused=True, create_graph=True)
    ts_terms = [torch.sum(g * v) for g, v in zip(tgrads, vs) if g is not None and g.requires_grad]
    if not ts_terms:
        want = [None] * len(ts)
    else:
        want = torch.autograd.grad(sum(ts_terms), ts, allow_unused=True)
    _close(got, want, xs, f"second order of {steps}")


@st.composite
def tied_reductions(draw):
    """(values, axis, keepdims): values from a few levels (many ties), sometimes a NaN."""
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    n = 1
    for d in shape:
        n *= d
    levels = st.sampled_from([-1.0, 0.0, 0.5, 2.0] + ([float("nan")] if draw(st.booleans()) else []))
    values = torch.tensor(draw(st.lists(levels, min_size=n, max_size=n)), dtype=D).reshape(shape)
    axes = draw(st.one_of(st.none(), st.sets(st.integers(-len(shape), len(shape) - 1), min_size=1)))
    if axes is not None and len({a % len(shape) for a in axes}) != len(axes):
        axes = tuple(sorted({a % len(shape) for a in axes}))
    return values, (None if axes is None else tuple(axes)), draw(st.booleans())


@settings(max_examples=60, **SETTINGS)
@given(tied_reductions(), st.sampled_from(["reduce_max", "reduce_min"]))
def test_reduce_max_min_with_ties_and_nan_match_torch_autograd(case, name):
    """Tied extremes share dy equally and a NaN extreme gives its slice NaN gradients, as torch.amax/amin."""
    x0, axis, keepdims = case
    mine, ref = REDUCE[name]
    x = dtape.constant(x0)
    with dtape.GradientTape() as tape:
        tape.watch(x)
        y = mine(x, axis=axis, keepdims=keepdims)
    w = torch.randn(tuple(y.shape), generator=torch.Generator().manual_seed(0), dtype=D)
    got = tape.gradient(y, x, output_gradients=dtape.constant(w))
    tx = x0.clone().requires_grad_()
    ty = ref(tx, dim=() if axis is None else axis, keepdim=keepdims)
    (want,) = torch.autograd.grad(ty, tx, w)
    torch.testing.assert_close(y.torch(), ty.detach(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got.torch(), want, rtol=1e-12, atol=1e-12, equal_nan=True)


# -- threads and stop_recording -----------------------------------------------
RECORD, STOP_ALL, PAUSE_TAPE = 0, 1, 2

thread_plans = st.lists(
    st.lists(st.tuples(st.sampled_from([RECORD, STOP_ALL, PAUSE_TAPE]), st.integers(-2, 2),
                       st.integers(-3, 3), st.booleans()), min_size=1, max_size=10),
    min_size=2, max_size=4)


def _expected(plan):
    """(d y/d x, number of records) of one thread's chain y <- y * c + x * d, starting at y = x."""
    deriv, connected, records = 1, True, 0
    for mode, c, d, _ in plan:
        if mode != RECORD:
            deriv, connected = 0, False
            continue
        records += 3 if connected else 2  # y * c only when y is watched; x * d and the add always
        deriv, connected = deriv * c + d, True
    return deriv, records


@settings(max_examples=30, **SETTINGS)
@given(thread_plans, st.integers(0, 2 ** 31 - 1), st.sampled_from([0.0, 0.2, 0.5]))
def test_threads_with_random_stop_recording_sections_record_exactly_their_recorded_ops(plans, schedule, p_yield):
    x = dtape.constant([1.0, -2.0, 0.5], dtype=D)
    start = threading.Barrier(len(plans), timeout=TIMEOUT)
    results, errors = [None] * len(plans), []

    kept = []

    def work(k, tape):
        try:
            start.wait()
            y = x
            for mode, c, d, yield_first in plans[k]:
                if yield_first:
                    time.sleep(0)
                section = {RECORD: None, STOP_ALL: dtape.stop_recording(), PAUSE_TAPE: tape.stop_recording()}[mode]
                if section is None:
                    y = y * float(c) + x * float(d)
                else:
                    with section:
                        y = y * float(c) + x * float(d)
                kept.append(y)  # alive: the tape keeps the records of live tensors only (trace deletion)
            results[k] = y
        except BaseException as e:  # reported on the main thread
            errors.append(e)

    with dtape.GradientTape(persistent=True) as tape:
        tape.watch(x)
        with interleaved(schedule, p_yield):  # a random (replayable) schedule
            threads = [threading.Thread(target=work, args=(k, tape), daemon=True) for k in range(len(plans))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=TIMEOUT)
                assert not t.is_alive(), "worker thread did not finish in time"
    assert not errors, errors[0]
    expected = [_expected(p) for p in plans]
    assert tape._tape.num_records() == sum(n for _, n in expected)
    g = tape.gradient(results, x, unconnected_gradients=dtape.UnconnectedGradients.ZERO)
    assert torch.equal(g.torch(), torch.full((3,), float(sum(d for d, _ in expected)), dtype=D))
