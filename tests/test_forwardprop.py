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
import warnings

import pytest
import torch

import dtape
from dtape import autodiff
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


def _flat(opdef, args):
    return list(args[0]) if opdef.list_input else list(args[:opdef.n_in])


def _pack(opdef, args, inputs):
    if opdef.list_input:
        return (list(inputs),) + tuple(args[1:])
    return tuple(inputs) + tuple(args[opdef.n_in:])


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


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
    if opdef.name == "conv2d":
        # torch's backward of slow_conv2d refuses a one-channel filter ("grad_weight must be contiguous"):
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
