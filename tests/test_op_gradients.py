"""Registry-driven gradient test: every OpDef with a rule, each sample, vs torch.autograd (float64).

First order: `tape.gradient` with a random cotangent against `torch.autograd.grad`
of the op's forward. Second order: nested tapes differentiate <grads, v>
again, against torch's double backward (create_graph=True).
"""
import pytest
import torch

import dtape
from dtape.ops import REGISTRY

TOL = {torch.float64: dict(rtol=1e-9, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-6)}


def _cases():
    for opdef in REGISTRY:
        if opdef.grad_fn is None or opdef.samples is None:
            continue
        for i, (args, attrs) in enumerate(opdef.samples(torch.Generator().manual_seed(0))):
            yield pytest.param(opdef, args, attrs, id=f"{opdef.name}-{i}")


CASES = list(_cases())


def _is_diff(x):
    return isinstance(x, torch.Tensor) and x.dtype.is_floating_point


def _flat_inputs(opdef, args):
    """The tensor inputs of a sample, flat (list-input ops expand their list)."""
    return list(args[0]) if opdef.list_input else list(args[:opdef.n_in])


def _pack(opdef, args, inputs):
    """Sample args with the tensor inputs replaced by `inputs`."""
    if opdef.list_input:
        return (list(inputs),) + tuple(args[1:])
    return tuple(inputs) + tuple(args[opdef.n_in:])


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _cotangents(outs, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(tuple(o.shape), generator=gen, dtype=torch.float64).to(o.dtype) for o in outs]


def _dtape_run(opdef, args, attrs, inputs):
    return _as_tuple(opdef.fn(*_pack(opdef, args, inputs), **attrs))


def _torch_run(opdef, args, attrs, inputs):
    return _as_tuple(opdef.forward(*_pack(opdef, args, inputs), **attrs))


def _diff_outputs(outs):
    return [o for o in outs if (o.dtype if isinstance(o, torch.Tensor) else o.dtype).is_floating_point]


def _torch_grads(outs, xs, cots, create_graph=False):
    pairs = [(o, c) for o, c in zip(outs, cots) if o.requires_grad]
    if not pairs:
        return [None] * len(xs)
    return list(torch.autograd.grad([o for o, _ in pairs], xs, [c for _, c in pairs],
                                    allow_unused=True, create_graph=create_graph))


def _assert_grads(got, want, xs, what):
    for k, (g, w, x) in enumerate(zip(got, want, xs)):
        g = torch.zeros_like(x) if g is None else (g.torch() if isinstance(g, dtape.Tensor) else g)
        w = torch.zeros_like(x) if w is None else w
        torch.testing.assert_close(g, w.detach(), **TOL[g.dtype], msg=lambda m: f"{what}, input {k}: {m}")


def _diff_positions(opdef, args):
    return [k for k, x in enumerate(_flat_inputs(opdef, args)) if _is_diff(x)]


@pytest.mark.parametrize("opdef,args,attrs", CASES)
def test_op_gradient_first_order_matches_torch_autograd(opdef, args, attrs):
    flat = _flat_inputs(opdef, args)
    pos = _diff_positions(opdef, args)
    xs = [dtape.constant(x) if isinstance(x, torch.Tensor) else x for x in flat]
    with dtape.GradientTape() as tape:
        for k in pos:
            tape.watch(xs[k])
        outs = _dtape_run(opdef, args, attrs, xs)
    outs = _diff_outputs(outs)
    cots = _cotangents(outs, 1)
    got = tape.gradient(list(outs), [xs[k] for k in pos], output_gradients=[dtape.constant(c) for c in cots])

    ts = [x.clone().requires_grad_() if k in pos else x for k, x in enumerate(flat)]
    touts = _diff_outputs(_torch_run(opdef, args, attrs, ts))
    for o, t in zip(outs, touts):
        torch.testing.assert_close(o.torch(), t.detach(), **TOL[o.dtype])
    want = _torch_grads(touts, [ts[k] for k in pos], cots)
    _assert_grads(got, want, [flat[k] for k in pos], f"{opdef.name} first order")


@pytest.mark.parametrize("opdef,args,attrs", CASES)
def test_op_gradient_second_order_matches_torch_double_backward(opdef, args, attrs):
    if not opdef.second_order:
        pytest.skip(f"{opdef.name} declares second_order=False; its gradient is not differentiable again")
    flat = _flat_inputs(opdef, args)
    pos = _diff_positions(opdef, args)
    xs = [dtape.constant(x) if isinstance(x, torch.Tensor) else x for x in flat]
    srcs = [xs[k] for k in pos]
    with dtape.GradientTape() as outer:
        outer.watch(srcs)
        with dtape.GradientTape() as inner:
            inner.watch(srcs)
            outs = _diff_outputs(_dtape_run(opdef, args, attrs, xs))
        cots = _cotangents(outs, 1)
        grads = inner.gradient(list(outs), srcs, output_gradients=[dtape.constant(c) for c in cots])
        vs = _cotangents([flat[k] for k in pos], 2)
        terms = [dtape.reduce_sum(g * dtape.constant(v)) for g, v in zip(grads, vs) if g is not None]
        total = dtape.add_n(terms) if len(terms) > 1 else (terms[0] if terms else None)
    got = outer.gradient(total, srcs) if total is not None else [None] * len(srcs)

    ts = [x.clone().requires_grad_() if k in pos else x for k, x in enumerate(flat)]
    touts = _diff_outputs(_torch_run(opdef, args, attrs, ts))
    tgrads = _torch_grads(touts, [ts[k] for k in pos], cots, create_graph=True)
    tsum = sum((torch.sum(g * v) for g, v in zip(tgrads, vs) if g is not None and g.requires_grad),
               torch.zeros((), dtype=torch.float64))
    want = _torch_grads([tsum], [ts[k] for k in pos], [torch.ones((), dtype=torch.float64)])
    _assert_grads(got, want, [flat[k] for k in pos], f"{opdef.name} second order")


def _first_cases():
    seen = set()
    for case in CASES:
        opdef = case.values[0]
        if opdef not in seen:
            seen.add(opdef)
            yield pytest.param(*case.values, id=opdef.name)


@pytest.mark.parametrize("opdef,args,attrs", list(_first_cases()))
def test_op_forward_torch_gradcheck_passes(opdef, args, attrs):
    flat = _flat_inputs(opdef, args)
    pos = _diff_positions(opdef, args)

    def fn(*diff):
        inputs = list(flat)
        for k, d in zip(pos, diff):
            inputs[k] = d
        return tuple(o for o in _torch_run(opdef, args, attrs, inputs) if o.dtype.is_floating_point)

    diff = [flat[k].clone().requires_grad_() for k in pos]
    if any(o.dtype != torch.float64 for o in fn(*diff)):
        pytest.skip(f"{opdef.name}: float32 output, too coarse for finite differences")
    assert torch.autograd.gradcheck(fn, diff, eps=1e-6, atol=1e-5)
