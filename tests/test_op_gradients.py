"""Registry-driven op tests: every OpDef with samples, float64.

* Forward: the op's value against an independent reference written here.
* First order: `GradientTape.gradient` (dtape's own rule, on the raw fast
  path and on the recorded path) against central finite differences of
  <cotangent, forward>.
* Second order (ops claiming `second_order`): nested tapes give H v for the
  Hessian H of <cotangent, forward>; central differences of dtape's first
  order gradient along v give H v too (H is symmetric).
* Empty batch: a leading dimension of 0 gives gradients of the right
  (empty) shape without error.
* Python scalars on either side of every elementwise binary op.
* Samples at special points (`_samples.Special`: ties, zeros, NaN, crossed
  bounds), where finite differences do not hold: first order against
  torch.autograd's own rule for the same point (TORCH_ORACLES).
"""
import warnings

import numpy as np
import pytest
import torch

import dtape
from tests._op_samples import as_tuple as _as_tuple, flat_inputs as _flat, pack_inputs as _pack
from dtape.ops import REGISTRY
from dtape.ops._samples import Special

D = torch.float64
EPS = 1e-6
FD_TOL = dict(rtol=1e-5, atol=1e-6)


def _cases(pred=lambda op: True):
    for opdef in REGISTRY:
        if opdef.grad_fn is None or opdef.samples is None or not pred(opdef):
            continue
        for i, sample in enumerate(opdef.samples(torch.Generator().manual_seed(0))):
            args, attrs = sample
            what = sample.what if isinstance(sample, Special) else None
            yield pytest.param(opdef, args, attrs, what, id=f"{opdef.name}-{i}" + (f"-{what}" if what else ""))


CASES = list(_cases())
SMOOTH_CASES = [c for c in CASES if c.values[3] is None]
SPECIAL_CASES = [c for c in CASES if c.values[3] is not None]


# -- helpers ------------------------------------------------------------------
def _is_diff(x):
    return isinstance(x, torch.Tensor) and x.dtype.is_floating_point


def _diff_positions(opdef, args):
    return [k for k, x in enumerate(_flat(opdef, args)) if _is_diff(x)]


def _float_outs(outs):
    return [o for o in outs if o.dtype.is_floating_point]


def _torch_forward(opdef, args, attrs, flat):
    """The op's forward on plain torch tensors (no tape involved): float outputs."""
    out = opdef.forward(*_pack(opdef, args, flat), **attrs)
    return _float_outs(_as_tuple(out[0] if opdef.stash else out))  # a stash (layer_norm's statistics) is not an output


def _cotangents(outs, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(tuple(o.shape), generator=gen, dtype=D).to(o.dtype) for o in outs]


def _dtape_gradient(opdef, args, attrs, flat, cots, pos, recorded=False):
    """dtape's gradient of <cots, op(flat)> w.r.t. the inputs at `pos` (torch tensors, zeros for None).

    `recorded=True` runs the backward walk while another tape records, so
    the rules run on dtape tensors (the path higher order uses).
    """
    xs = [dtape.constant(x) if isinstance(x, torch.Tensor) else x for x in flat]
    srcs = [xs[k] for k in pos]
    with dtape.GradientTape() as tape:
        tape.watch(srcs)
        outs = _float_outs(_as_tuple(opdef.fn(*_pack(opdef, args, xs), **attrs)))
    dys = [dtape.constant(c) for c in cots]
    if recorded:
        with dtape.GradientTape() as other:
            other.watch(dtape.constant(0.0))
            grads = tape.gradient(outs, srcs, output_gradients=dys)
    else:
        grads = tape.gradient(outs, srcs, output_gradients=dys)
    return [torch.zeros_like(flat[k]) if g is None else g.torch() for g, k in zip(grads, pos)]


def _phi(opdef, args, attrs, flat, cots):
    outs = _torch_forward(opdef, args, attrs, flat)
    return sum(float(torch.sum(o.to(D) * c.to(D))) for o, c in zip(outs, cots))


def _finite_difference_gradient(opdef, args, attrs, flat, cots, pos, eps):
    grads = []
    for k in pos:
        g = torch.zeros_like(flat[k], dtype=D)
        for i in range(flat[k].numel()):
            values = []
            for sign in (1.0, -1.0):
                x = flat[k].clone()
                x.view(-1)[i] += sign * eps
                values.append(_phi(opdef, args, attrs, flat[:k] + [x] + flat[k + 1:], cots))
            g.view(-1)[i] = (values[0] - values[1]) / (2 * eps)
        grads.append(g)
    return grads


def _fd_setup(opdef, args, attrs):
    flat = _flat(opdef, args)
    pos = _diff_positions(opdef, args)
    outs = _torch_forward(opdef, args, attrs, flat)
    cots = _cotangents(outs, 1)
    coarse = any(o.dtype != D for o in outs)  # float32 output (cast): wider steps and tolerance
    return flat, pos, cots, coarse


# -- first and second order ---------------------------------------------------
@pytest.mark.parametrize("opdef,args,attrs,what", SMOOTH_CASES)
def test_op_gradient_matches_finite_differences(opdef, args, attrs, what):
    flat, pos, cots, coarse = _fd_setup(opdef, args, attrs)
    want = _finite_difference_gradient(opdef, args, attrs, flat, cots, pos, 1e-2 if coarse else EPS)
    tol = dict(rtol=1e-3, atol=1e-3) if coarse else FD_TOL
    for path in ("raw", "recorded"):
        got = _dtape_gradient(opdef, args, attrs, flat, cots, pos, recorded=path == "recorded")
        for k, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g.to(D), w, **tol, msg=lambda m: f"{opdef.name} ({path} walk) input {pos[k]}: {m}")


def _hessian_vector_dtape(opdef, args, attrs, flat, cots, pos, vs):
    xs = [dtape.constant(x) if isinstance(x, torch.Tensor) else x for x in flat]
    srcs = [xs[k] for k in pos]
    with dtape.GradientTape() as outer:
        outer.watch(srcs)
        with dtape.GradientTape() as inner:
            inner.watch(srcs)
            outs = _float_outs(_as_tuple(opdef.fn(*_pack(opdef, args, xs), **attrs)))
        grads = inner.gradient(outs, srcs, output_gradients=[dtape.constant(c) for c in cots])
        terms = [dtape.reduce_sum(dtape.cast(g, D) * dtape.constant(v)) for g, v in zip(grads, vs)
                 if g is not None]
        total = dtape.add_n(terms) if len(terms) > 1 else (terms[0] if terms else None)
    hv = outer.gradient(total, srcs) if total is not None else [None] * len(srcs)
    return [torch.zeros_like(flat[k]) if h is None else h.torch() for h, k in zip(hv, pos)]


@pytest.mark.parametrize("opdef,args,attrs,what", [c for c in _cases(lambda op: op.second_order) if c.values[3] is None])
def test_op_second_order_matches_finite_differences_of_dtape_gradient(opdef, args, attrs, what):
    flat, pos, cots, coarse = _fd_setup(opdef, args, attrs)
    vs = _cotangents([flat[k] for k in pos], 2)
    got = _hessian_vector_dtape(opdef, args, attrs, flat, cots, pos, vs)
    eps = 1e-2 if coarse else 1e-5

    def shifted(sign):
        moved = list(flat)
        for k, v in zip(pos, vs):
            moved[k] = flat[k] + sign * eps * v
        return _dtape_gradient(opdef, args, attrs, moved, cots, pos)

    want = [(a - b) / (2 * eps) for a, b in zip(shifted(1.0), shifted(-1.0))]
    tol = dict(rtol=1e-3, atol=1e-3) if coarse else FD_TOL
    for k, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g.to(D), w.to(D), **tol, msg=lambda m: f"{opdef.name} H v, input {pos[k]}: {m}")


# -- special points against torch.autograd ---------------------------------------
def _as_t(v):
    return torch.as_tensor(v, dtype=D)


def _extreme(fn):
    return lambda x, axis=None, keepdims=False: fn(x, dim=() if axis is None else axis, keepdim=keepdims)


# torch functions with the op's meaning at its special samples (reduce_max over axis=None is amax over dim=()).
def _tf_norm(tensor, ord="euclidean", axis=None, keepdims=None):
    """TF's norm as TF writes it (linalg_ops.norm: a composite of sqrt, sum, abs, max, pow), in torch."""
    matrix = isinstance(axis, (tuple, list))
    ax = tuple(range(tensor.ndim)) if axis is None else (tuple(axis) if matrix else (axis,))
    if ord in ("fro", "euclidean", 2) and not (matrix and ord == 2):
        r = torch.sqrt(torch.sum(tensor * tensor, dim=ax, keepdim=True))
    elif ord == 1:
        r = torch.sum(torch.abs(tensor), dim=ax[0] if matrix else ax, keepdim=True)
        r = torch.amax(r, dim=ax[1], keepdim=True) if matrix else r
    elif ord == np.inf:
        r = torch.sum(torch.abs(tensor), dim=ax[1], keepdim=True) if matrix else torch.abs(tensor)
        r = torch.amax(r, dim=ax[0] if matrix else ax, keepdim=True)
    else:
        r = torch.pow(torch.sum(torch.pow(torch.abs(tensor), ord), dim=ax, keepdim=True), 1.0 / ord)
    return r if keepdims else torch.reshape(r, [s for i, s in enumerate(r.shape) if i not in [a % tensor.ndim for a in ax]])


TORCH_ORACLES = {
    "reduce_max": _extreme(torch.amax), "reduce_min": _extreme(torch.amin),
    "clip_by_value": lambda t, lo, hi: torch.clamp(t, _as_t(lo), _as_t(hi)),
    "pow": torch.pow, "abs": torch.abs, "norm": _tf_norm,
}


def test_every_op_with_special_samples_has_a_torch_oracle():
    missing = {c.values[0].name for c in SPECIAL_CASES} - set(TORCH_ORACLES)
    assert not missing, f"add a torch function for the special samples of {sorted(missing)} to TORCH_ORACLES"


def _torch_gradient(opdef, args, attrs, flat, cots, pos):
    xs = [x.clone().requires_grad_() if k in pos else x for k, x in enumerate(flat)]
    outs = _as_tuple(TORCH_ORACLES[opdef.name](*_pack(opdef, args, xs), **attrs))
    total = sum(torch.sum(o * c) for o, c in zip(outs, cots))
    grads = torch.autograd.grad(total, [xs[k] for k in pos], allow_unused=True)
    return [torch.zeros_like(flat[k]) if g is None else g for g, k in zip(grads, pos)]


@pytest.mark.parametrize("opdef,args,attrs,what", SPECIAL_CASES)
def test_op_gradient_at_special_point_matches_torch_autograd(opdef, args, attrs, what):
    flat, pos, cots, _ = _fd_setup(opdef, args, attrs)
    want = _torch_gradient(opdef, args, attrs, flat, cots, pos)
    for path in ("raw", "recorded"):
        got = _dtape_gradient(opdef, args, attrs, flat, cots, pos, recorded=path == "recorded")
        for k, (g, w) in enumerate(zip(got, want)):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, equal_nan=True,
                                       msg=lambda m: f"{opdef.name} at {what} ({path} walk) input {pos[k]}: {m}")


# -- forward values against independent references ----------------------------
def _np(x):
    return x.numpy() if isinstance(x, torch.Tensor) else x


def reduction_axes(ndim, axis):
    if axis is None:
        return tuple(range(ndim))
    return tuple(a % ndim for a in ((axis,) if isinstance(axis, int) else axis))


def _reduce(np_fn):
    return lambda x, axis=None, keepdims=False: np_fn(_np(x), axis=reduction_axes(x.ndim, axis), keepdims=keepdims)


def _logsumexp(x, axis=None, keepdims=False):
    a = _np(x)
    ax = reduction_axes(x.ndim, axis)
    return np.log(np.sum(np.exp(a), axis=ax, keepdims=keepdims))


def _matmul(a, b, transpose_a=False, transpose_b=False):
    a, b = _np(a), _np(b)
    return np.matmul(np.swapaxes(a, -1, -2) if transpose_a else a, np.swapaxes(b, -1, -2) if transpose_b else b)


def _softmax(x, axis=-1):
    e = np.exp(_np(x) - np.max(_np(x), axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def _gather(params, indices, axis=None, batch_dims=0):
    p, i = _np(params), _np(indices)
    axis = batch_dims if axis is None else axis % p.ndim
    if batch_dims == 0:
        return np.take(p, i, axis=axis)
    return np.stack([_gather(pp, ii, axis - 1, batch_dims - 1) for pp, ii in zip(p, i)])


def _gather_nd(params, indices, batch_dims=0):
    p, i = _np(params), _np(indices)
    if batch_dims:
        return np.stack([_gather_nd(pp, ii, batch_dims - 1) for pp, ii in zip(p, i)])
    return np.stack([p[tuple(row)] for row in i.reshape(-1, i.shape[-1])]).reshape(i.shape[:-1] + p.shape[i.shape[-1]:])


def _conv2d(x, w, strides, padding, data_format="NHWC", dilations=None):
    """Direct loops with TF's SAME arithmetic (pad_total = max((ceil(n/s)-1)*s + (k-1)*d + 1 - n, 0))."""
    x, w = _np(x), _np(w)
    if data_format == "NCHW":
        x = x.transpose(0, 2, 3, 1)

    def pair(v):
        v = [1] if v is None else ([v] if isinstance(v, int) else list(v))
        return ((v[1], v[2]) if data_format == "NHWC" else (v[2], v[3])) if len(v) == 4 else (v[0], v[-1])

    s, d = pair(strides), pair(dilations)
    kh, kw = w.shape[:2]
    pads = []
    for n, k, st, dl in zip(x.shape[1:3], (kh, kw), s, d):
        total = max((-(-n // st) - 1) * st + (k - 1) * dl + 1 - n, 0) if padding == "SAME" else 0
        pads.append((total // 2, total - total // 2))
    xp = np.pad(x, ((0, 0), pads[0], pads[1], (0, 0)))
    oh = (xp.shape[1] - (kh - 1) * d[0] - 1) // s[0] + 1
    ow = (xp.shape[2] - (kw - 1) * d[1] - 1) // s[1] + 1
    out = np.zeros((x.shape[0], oh, ow, w.shape[3]))
    for i in range(oh):
        for j in range(ow):
            patch = xp[:, i * s[0]:i * s[0] + (kh - 1) * d[0] + 1:d[0], j * s[1]:j * s[1] + (kw - 1) * d[1] + 1:d[1], :]
            out[:, i, j, :] = np.einsum("bhwc,hwco->bo", patch, w)
    return out.transpose(0, 3, 1, 2) if data_format == "NCHW" else out


def _conv2d_transpose(x, w, output_shape, strides, padding="SAME", data_format="NHWC", dilations=None):
    """Scatter loops: each input pixel adds its filter-weighted window into the padded output (TF's SAME
    pads of the conv2d whose image is output_shape), then the padding is cut off."""
    x, w = _np(x), _np(w)
    out_shape = list(output_shape)
    if data_format == "NCHW":
        x, out_shape = x.transpose(0, 2, 3, 1), [out_shape[0], out_shape[2], out_shape[3], out_shape[1]]
    s = (strides, strides) if isinstance(strides, int) else tuple(strides)[-2:]
    d = (1, 1) if dilations is None else ((dilations, dilations) if isinstance(dilations, int) else dilations)
    kh, kw = w.shape[:2]
    pads = []
    for n, k, st, dl in zip(out_shape[1:3], (kh, kw), s, d):
        total = max((-(-n // st) - 1) * st + (k - 1) * dl + 1 - n, 0) if padding == "SAME" else 0
        pads.append((total // 2, total - total // 2))
    big = np.zeros((x.shape[0], out_shape[1] + sum(pads[0]) + kh * d[0], out_shape[2] + sum(pads[1]) + kw * d[1],
                    w.shape[2]))
    for i in range(x.shape[1]):
        for j in range(x.shape[2]):
            for a in range(kh):
                for b in range(kw):
                    big[:, i * s[0] + a * d[0], j * s[1] + b * d[1], :] += x[:, i, j, :] @ w[a, b].T
    out = big[:, pads[0][0]:pads[0][0] + out_shape[1], pads[1][0]:pads[1][0] + out_shape[2], :]
    return out.transpose(0, 3, 1, 2) if data_format == "NCHW" else out


def _split(value, num_or_size_splits, axis=0):
    v = _np(value)
    n = v.shape[axis]
    if isinstance(num_or_size_splits, int):
        return np.split(v, num_or_size_splits, axis=axis)
    sizes = list(num_or_size_splits)
    if -1 in sizes:
        sizes[sizes.index(-1)] = n - (sum(sizes) + 1)
    return np.split(v, np.cumsum(sizes)[:-1], axis=axis)


def _squeeze(x, axis=None):
    return np.squeeze(_np(x)) if axis is None else np.squeeze(_np(x), axis=axis)


def _moments(x, axes, keepdims=False):
    ax = reduction_axes(x.ndim, axes)
    return np.mean(_np(x), axis=ax, keepdims=keepdims), np.var(_np(x), axis=ax, keepdims=keepdims)


def _bias_add(value, bias, data_format="NHWC"):
    b = _np(bias)
    if data_format.startswith("NC"):
        b = b.reshape((-1,) + (1,) * (value.ndim - 2))
    return _np(value) + b


def _layer_norm(x, gamma, beta, epsilon=1e-3):
    a = _np(x)
    return (a - a.mean(-1, keepdims=True)) / np.sqrt(a.var(-1, keepdims=True) + epsilon) * _np(gamma) + _np(beta)


def _sigmoid(x):
    return 1 / (1 + np.exp(-_np(x)))


def _gelu(x, approximate=False):
    a = _np(x)
    if approximate:
        return 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a ** 3)))
    from math import erf
    return 0.5 * a * (1 + np.vectorize(erf)(a / np.sqrt(2)))


def _log_softmax(x, axis=-1):
    return np.log(_softmax(x, axis))


def _np_norm(tensor, ord="euclidean", axis=None, keepdims=None):
    """tf.norm's documented meaning in numpy: axis None is the flattened vector; a pair is a matrix norm."""
    a = _np(tensor)
    if isinstance(axis, (tuple, list)):
        m = np.moveaxis(a, [x % a.ndim for x in axis], [-2, -1])
        r = np.linalg.norm(m, ord="fro" if ord == "euclidean" else ord, axis=(-2, -1))
        return np.expand_dims(r, tuple(sorted(x % a.ndim for x in axis))) if keepdims else r
    p = 2 if ord == "euclidean" else ord
    if axis is None:
        r = np.linalg.norm(a.reshape(-1), p)
        return np.reshape(r, (1,) * a.ndim) if keepdims else r
    return np.linalg.norm(a, p, axis=axis, keepdims=bool(keepdims))


def _np_pad(tensor, paddings, mode="CONSTANT", constant_values=0):
    extra = {"constant_values": constant_values} if mode.upper() == "CONSTANT" else {}
    return np.pad(_np(tensor), paddings, mode=mode.lower(), **extra)


def _nll_loss(log_probs, target, reduction="mean", ignore_index=-100):
    """torch's nll_loss in numpy: -log_probs at each kept target; mean over the kept examples."""
    lp, tg = np.atleast_2d(_np(log_probs)), np.atleast_1d(_np(target))
    kept = tg != ignore_index
    picked = -lp[np.arange(len(tg)), np.where(kept, tg, 0)] * kept
    if reduction == "none":
        return picked.reshape(np.shape(_np(target)))
    return picked.sum() / (kept.sum() if reduction == "mean" else 1)


REFERENCES = {
    "add": lambda x, y: _np(x) + _np(y), "subtract": lambda x, y: _np(x) - _np(y),
    "multiply": lambda x, y: _np(x) * _np(y), "divide": lambda x, y: _np(x) / _np(y),
    "floormod": lambda x, y: np.mod(_np(x), _np(y)), "negative": lambda x: -_np(x),
    "abs": lambda x: np.abs(_np(x)), "sign": lambda x: np.sign(_np(x)),
    "pow": lambda x, y: np.power(_np(x), _np(y)), "square": lambda x: _np(x) * _np(x),
    "sqrt": lambda x: np.sqrt(_np(x)), "rsqrt": lambda x: 1 / np.sqrt(_np(x)),
    "exp": lambda x: np.exp(_np(x)), "log": lambda x: np.log(_np(x)), "log1p": lambda x: np.log1p(_np(x)),
    "sin": lambda x: np.sin(_np(x)), "cos": lambda x: np.cos(_np(x)), "tanh": lambda x: np.tanh(_np(x)),
    "sigmoid": _sigmoid, "maximum": lambda x, y: np.maximum(_np(x), _np(y)),
    "minimum": lambda x, y: np.minimum(_np(x), _np(y)),
    "clip_by_value": lambda t, lo, hi: np.minimum(np.maximum(_np(t), _np(lo)), _np(hi)),
    "matmul": _matmul,
    "einsum": lambda inputs, equation: np.einsum(equation, *[_np(x) for x in inputs]),
    "add_n": lambda inputs: sum(_np(x) for x in inputs),
    "reduce_sum": _reduce(np.sum), "reduce_mean": _reduce(np.mean), "reduce_max": _reduce(np.max),
    "reduce_min": _reduce(np.min), "reduce_prod": _reduce(np.prod), "reduce_logsumexp": _logsumexp,
    "reshape": lambda t, shape: np.reshape(_np(t), shape), "view": lambda tensor, shape: np.reshape(_np(tensor), shape),
    "transpose": lambda a, perm=None: np.transpose(_np(a), perm),
    "expand_dims": lambda x, axis: np.expand_dims(_np(x), axis), "squeeze": _squeeze,
    "concat": lambda values, axis: np.concatenate([_np(v) for v in values], axis=axis),
    "stack": lambda values, axis=0: np.stack([_np(v) for v in values], axis=axis),
    "broadcast_to": lambda x, shape: np.broadcast_to(_np(x), shape),
    "where": lambda c, x, y: np.where(_np(c), _np(x), _np(y)),
    "cast": lambda x, dtype: _np(x).astype(np.float32 if dtype == torch.float32 else np.float64),
    "identity": _np, "getitem": lambda t, key: _np(t)[tuple(_np(k) for k in key)],
    "split": _split, "tile": lambda x, multiples: np.tile(_np(x), multiples),
    "gather": _gather, "gather_nd": _gather_nd,
    "fill": lambda value, dims: np.full(dims, _np(value)),
    "relu": lambda x: np.maximum(_np(x), 0), "relu6": lambda x: np.clip(_np(x), 0, 6),
    "leaky_relu": lambda x, alpha=0.2: np.where(_np(x) > 0, _np(x), alpha * _np(x)),
    "elu": lambda x: np.where(_np(x) > 0, _np(x), np.exp(_np(x)) - 1), "gelu": _gelu,
    "silu": lambda x: _np(x) * _sigmoid(x), "softplus": lambda x: np.log1p(np.exp(_np(x))),
    "softmax": _softmax, "log_softmax": _log_softmax,
    "sparse_softmax_cross_entropy_with_logits": lambda labels, logits: -np.take_along_axis(
        _log_softmax(logits), _np(labels)[..., None], axis=-1)[..., 0],
    "nll_loss": _nll_loss,
    "softmax_cross_entropy_with_logits": lambda labels, logits, axis=-1: -np.sum(
        _np(labels) * _log_softmax(logits, axis), axis=axis),
    "sigmoid_cross_entropy_with_logits": lambda labels, logits: -_np(labels) * np.log(_sigmoid(logits))
    - (1 - _np(labels)) * np.log(1 - _sigmoid(logits)),
    "l2_loss": lambda t: np.sum(_np(t) ** 2) / 2, "conv2d": _conv2d, "conv2d_transpose": _conv2d_transpose, "bias_add": _bias_add, "layer_norm": _layer_norm,
    "xw_plus_b": lambda x, w, b: _np(x) @ _np(w) + _np(b),
    "moments": _moments, "copy_to_device": lambda x, device: _np(x),
    "norm": _np_norm, "pad": _np_pad,
    "band_part": lambda input, num_lower, num_upper: np.where(  # noqa: A006
        ((num_lower < 0) | (np.subtract.outer(np.arange(input.shape[-2]), np.arange(input.shape[-1])) <= num_lower))
        & ((num_upper < 0) | (np.subtract.outer(np.arange(input.shape[-1]), np.arange(input.shape[-2])).T <= num_upper)),
        _np(input), 0.0),
    "linspace": lambda start, stop, num, axis=0: np.linspace(_np(start), _np(stop), num, axis=axis),
    "solve": lambda matrix, rhs, adjoint=False: np.linalg.solve(
        np.swapaxes(_np(matrix), -1, -2) if adjoint else _np(matrix), _np(rhs)),
}
# Transposes of gather/getitem: their values are the gradients of their primal
# op, which the finite-difference test above checks.
NO_REFERENCE = {"getitem_grad", "gather_grad", "gather_nd_grad"}


def test_every_op_with_samples_has_a_forward_reference():
    names = {op.name for op in REGISTRY if op.samples is not None}
    missing = names - set(REFERENCES) - NO_REFERENCE
    assert not missing, f"add an independent forward reference for {sorted(missing)} to REFERENCES"


@pytest.mark.parametrize("opdef,args,attrs,what", [c for c in CASES if c.values[0].name in REFERENCES])
def test_op_forward_matches_independent_reference(opdef, args, attrs, what):
    xs = [dtape.constant(x) if isinstance(x, torch.Tensor) else x for x in _flat(opdef, args)]
    got = _as_tuple(opdef.fn(*_pack(opdef, args, xs), **attrs))
    want = REFERENCES[opdef.name](*args, **attrs)
    want = tuple(want) if isinstance(want, (tuple, list)) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), np.asarray(w), rtol=1e-6 if g.dtype == torch.float32 else 1e-10,
                                   atol=1e-12, err_msg=opdef.name)


# -- empty batches ------------------------------------------------------------
def _slice0(x):
    return x[:0]


def _default_empty(opdef, args, attrs):
    """Leading dim 0 on the inputs whose dim 0 is the batch of the first highest-rank input."""
    flat = _flat(opdef, args)
    ranked = [x for x in flat if isinstance(x, torch.Tensor) and x.ndim > 0]
    if not ranked:
        return None
    lead = max(ranked, key=lambda x: x.ndim).shape[0]
    new = [_slice0(x) if isinstance(x, torch.Tensor) and x.ndim > 0 and x.shape[0] == lead else x for x in flat]
    return _pack(opdef, args, new), attrs


def _gather_empty(opdef, args, attrs):
    params, indices = args[:2]
    bd = attrs.get("batch_dims", 0)
    return (_slice0(params) if bd else params, _slice0(indices)) + tuple(args[2:]), attrs


def _gather_grad_empty(opdef, args, attrs):
    dy, indices = args[:2]
    shape = tuple(attrs["shape"])
    if attrs.get("batch_dims", 0):
        shape = (0,) + shape[1:]
    return (_slice0(dy), _slice0(indices)), dict(attrs, shape=shape)


EMPTY_BATCH = {  # ops whose batch is not simply the leading dim of their largest inputs
    "gather": _gather_empty, "gather_nd": _gather_empty, "gather_grad": _gather_grad_empty,
    "broadcast_to": lambda op, args, attrs: ((_slice0(args[0]),), dict(attrs, shape=(2, 0, 1))),
    "fill": lambda op, args, attrs: (args, dict(attrs, dims=(0,) + tuple(attrs["dims"][1:]))),
    "getitem_grad": lambda op, args, attrs: ((_slice0(args[0]),), dict(attrs, shape=(1,) + tuple(attrs["shape"][1:]))),
    "reshape": lambda op, args, attrs: ((_slice0(args[0]),), dict(attrs, shape=(0, 2, 3))),
    "view": lambda op, args, attrs: ((_slice0(args[0]),), dict(attrs, shape=(0, 2, 3))),
    # mirror padding of an empty dimension is refused (TF): pad the other dimensions only
    "pad": lambda op, args, attrs: ((_slice0(args[0]),), dict(attrs, paddings=[[0, 0]] + list(attrs["paddings"][1:]))),
    # a matrix's rows are not a batch: an empty batch of matrices and right-hand sides
    "solve": lambda op, args, attrs: (tuple(_slice0(a if a.ndim > 2 else a[None]) for a in args), attrs),
}


@pytest.mark.parametrize("opdef,args,attrs,what", CASES)
def test_op_gradient_on_empty_batch_has_source_shape(opdef, args, attrs, what):
    made = EMPTY_BATCH.get(opdef.name, _default_empty)(opdef, args, attrs)
    if made is None:
        pytest.skip(f"{opdef.name}: no batched input in this sample")
    args, attrs = made
    flat = _flat(opdef, args)
    pos = _diff_positions(opdef, args)
    xs = [dtape.constant(x) if isinstance(x, torch.Tensor) else x for x in flat]
    srcs = [xs[k] for k in pos]
    with dtape.GradientTape() as tape:
        tape.watch(srcs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # mean of an empty tensor
            outs = _float_outs(_as_tuple(opdef.fn(*_pack(opdef, args, xs), **attrs)))
    assert any(t.shape.numel() == 0 for t in outs + [x for x in xs if isinstance(x, dtape.Tensor)])
    cots = [dtape.constant(c) for c in _cotangents([o.torch() for o in outs], 1)]
    grads = tape.gradient(outs, srcs, output_gradients=cots, unconnected_gradients=dtape.UnconnectedGradients.ZERO)
    for s, g in zip(srcs, grads):
        assert g.shape == s.shape and g.dtype == s.dtype, f"{opdef.name}: {tuple(g.shape)} for {tuple(s.shape)}"
        assert torch.isfinite(g.torch()).all()


# -- Python scalars on either side of binary ops ------------------------------
def _scalar_cases():
    """Samples of binary ops where one input is 0-d: that input becomes a Python float."""
    for opdef in REGISTRY:
        if opdef.n_in != 2 or opdef.list_input or opdef.samples is None:
            continue
        for i, (args, attrs) in enumerate(opdef.samples(torch.Generator().manual_seed(0))):
            for k in (0, 1):
                if _is_diff(args[k]) and args[k].ndim == 0 and isinstance(args[1 - k], torch.Tensor):
                    yield pytest.param(opdef, args, attrs, k, id=f"{opdef.name}-{i}-scalar{k}")


SCALAR_CASES = list(_scalar_cases())


def test_scalar_cases_cover_both_sides_of_every_elementwise_binary_op():
    sides = {(c.values[0].name, c.values[3]) for c in SCALAR_CASES}
    for name in ("add", "subtract", "multiply", "divide", "floormod", "pow", "maximum", "minimum"):
        assert (name, 0) in sides and (name, 1) in sides, f"{name}: no sample with a 0-d input on each side"


@pytest.mark.parametrize("opdef,args,attrs,k", SCALAR_CASES)
def test_binary_op_python_scalar_either_side_matches_0d_tensor(opdef, args, attrs, k):
    other = dtape.constant(args[1 - k])
    scalar = float(args[k])
    inputs = [None, None]
    inputs[k], inputs[1 - k] = scalar, other
    with dtape.GradientTape() as tape:
        tape.watch(other)
        y = opdef.fn(*inputs, **attrs)
    g = tape.gradient(y, other)
    full = [None, None]
    full[k], full[1 - k] = dtape.constant(args[k]), dtape.constant(args[1 - k])
    with dtape.GradientTape() as tape2:
        tape2.watch(full[1 - k])
        want = opdef.fn(*full, **attrs)
    torch.testing.assert_close(y.torch(), want.torch(), rtol=1e-12, atol=0)
    torch.testing.assert_close(g.torch(), tape2.gradient(want, full[1 - k]).torch(), rtol=1e-12, atol=0)


NO_GRAD_BINARY = ["floordiv", "less", "less_equal", "greater", "greater_equal", "equal", "not_equal",
                  "logical_and", "logical_or"]


@pytest.mark.parametrize("name", NO_GRAD_BINARY)
def test_binary_op_without_gradient_takes_python_scalar_either_side(name):
    fn = getattr(dtape, name, None) or getattr(dtape.ops.math_ops, name)
    logical = name.startswith("logical")
    t = torch.tensor([True, False, True]) if logical else torch.tensor([-1.5, 0.5, 2.0], dtype=D)
    s = True if logical else 0.5
    ref = {"floordiv": lambda a, b: torch.div(a, b, rounding_mode="floor"), "less": torch.lt,
           "less_equal": torch.le, "greater": torch.gt, "greater_equal": torch.ge, "equal": torch.eq,
           "not_equal": torch.ne, "logical_and": torch.logical_and, "logical_or": torch.logical_or}[name]
    st = torch.tensor(s, dtype=t.dtype)
    assert torch.equal(fn(s, dtape.constant(t)).torch(), ref(st, t))
    assert torch.equal(fn(dtape.constant(t), s).torch(), ref(t, st))


def test_minimum_maximum_scalar_first_as_in_the_issue():
    t = dtape.constant([-1.0, 0.5, 2.0])
    np.testing.assert_array_equal(dtape.minimum(1.0, t).numpy(), [-1.0, 0.5, 1.0])
    np.testing.assert_array_equal(dtape.maximum(0.0, t).numpy(), [0.0, 0.5, 2.0])
    assert dtape.maximum(0.0, t).dtype == torch.float32
    assert dtape.maximum(0.5, dtape.constant([1, 0])).dtype == torch.float32  # torch's scalar promotion


# -- gradient dtype -----------------------------------------------------------
def test_gradient_has_source_dtype_under_autocast_bfloat16():
    v = dtape.Variable(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))
    x = dtape.constant(torch.randn(2, 4, generator=torch.Generator().manual_seed(1)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with dtape.GradientTape() as tape:
            tape.watch(x)
            y = dtape.reduce_sum(dtape.matmul(x, v))
        assert y.dtype == torch.bfloat16  # autocast did run the matmul in bfloat16
        gv, gx = tape.gradient(y, [v, x])
    assert gv.dtype == torch.float32 and gx.dtype == torch.float32
    want = torch.sum(x.torch(), dim=0, keepdim=True).T.expand(4, 3)
    torch.testing.assert_close(gv.torch(), want, rtol=2e-2, atol=2e-2)


def test_second_order_gradient_has_source_dtype_under_autocast():
    x = dtape.constant(torch.tensor([[0.5, -1.0], [2.0, 1.5]]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with dtape.GradientTape() as outer:
            outer.watch(x)
            with dtape.GradientTape() as inner:
                inner.watch(x)
                y = dtape.reduce_sum(dtape.matmul(x, x))
            g = inner.gradient(y, x)
            assert g.dtype == torch.float32
            s = dtape.reduce_sum(g * g)
        h = outer.gradient(s, x)
    assert h.dtype == torch.float32


@pytest.mark.parametrize("case", ["x_weights", "bias", "layer_norm"])
def test_fused_dense_and_layer_norm_name_the_mixed_dtype(case):
    x32, w64 = dtape.constant(torch.ones(2, 3)), dtape.constant(torch.ones(3, 4, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"float64.*cast|cast.*float64|dtape.cast"):
        if case == "x_weights":
            dtape.nn.xw_plus_b(x32, w64, dtape.constant(torch.ones(4, dtype=torch.float64)))
        elif case == "bias":
            dtape.nn.xw_plus_b(x32, dtape.constant(torch.ones(3, 4)), dtape.constant(torch.ones(4, dtype=torch.float64)))
        else:
            dtape.nn.layer_norm(x32, dtape.constant(torch.ones(3, dtype=torch.float64)),
                                dtape.constant(torch.zeros(3, dtype=torch.float64)))


def test_fused_dense_refuses_a_scalar_x_with_a_message():
    """xw_plus_b folds x's leading dimensions into rows: a 0-d x has no [in] axis (it gave a bare IndexError)."""
    w, b = dtape.constant(torch.ones(3, 4)), dtape.constant(torch.zeros(4))
    with pytest.raises(ValueError, match=r"xw_plus_b: x is a scalar \(0-d\).*\[\.\.\., 3\]"):
        dtape.nn.xw_plus_b(dtape.constant(1.0), w, b)


# -- weight gradients with few output columns (computed transposed on the CPU) ----------------
@pytest.mark.parametrize("op", ["matmul", "xw_plus_b", "batched_matmul"])
@pytest.mark.parametrize("n", [2, 10, 16])
def test_skinny_weight_gradient_matches_torch_autograd(op, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(96, 300, dtype=torch.float64, generator=g)
    w = torch.randn(300, n, dtype=torch.float64, generator=g)
    b = torch.randn(n, dtype=torch.float64, generator=g)
    dy = torch.randn(96, n, dtype=torch.float64, generator=g)
    if op == "batched_matmul":
        x, dy = x.reshape(4, 24, 300), dy.reshape(4, 24, n)
    dx, dw, db = (dtape.constant(t) for t in (x, w, b))
    with dtape.GradientTape() as tape:
        tape.watch([dx, dw, db])
        y = dtape.nn.xw_plus_b(dx, dw, db) if op == "xw_plus_b" else dtape.matmul(dx, dw)
        loss = dtape.reduce_sum(y * dtape.constant(dy))
    gx, gw = tape.gradient(loss, [dx, dw])
    tx, tw = x.clone().requires_grad_(), w.clone().requires_grad_()
    want_x, want_w = torch.autograd.grad(((tx @ tw) * dy).sum(), [tx, tw])
    torch.testing.assert_close(gw.torch(), want_w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx.torch(), want_x, rtol=1e-12, atol=1e-12)
    assert gw.torch().is_contiguous()


def test_abs_of_complex_gradient_matches_torch_autograd():
    g = torch.Generator().manual_seed(3)
    z = torch.complex(torch.randn(5, dtype=torch.float64, generator=g), torch.randn(5, dtype=torch.float64, generator=g))
    z[2] = 0
    w = torch.randn(5, dtype=torch.float64, generator=g)
    dz = dtape.constant(z)
    with dtape.GradientTape() as tape:
        tape.watch(dz)
        loss = dtape.reduce_sum(dtape.abs(dz) * dtape.constant(w))
    got = tape.gradient(loss, dz)
    tz = z.clone().requires_grad_()
    (want,) = torch.autograd.grad((torch.abs(tz) * w).sum(), [tz])
    torch.testing.assert_close(got.torch(), want, rtol=1e-12, atol=1e-12)


# -- complex gradients: torch's (and TF's) convention, dy times the conjugate derivative -------
def _complex(g, *shape):
    return torch.complex(torch.randn(*shape, dtype=torch.float64, generator=g),
                         torch.randn(*shape, dtype=torch.float64, generator=g))


_COMPLEX_CASES = {  # ns: torch or dtape (the same names)
    "mul": lambda z, w, r, ns: z * w,
    "div": lambda z, w, r, ns: z / w,
    "matmul": lambda z, w, r, ns: ns.matmul(z, w),
    "real_times_complex": lambda z, w, r, ns: r * z,            # the real input gets the real part
    "sum_reshape_transpose": lambda z, w, r, ns: ns.matmul(z, w).T.reshape(-1)[:5] * w[0, 0],
    "abs_squared": lambda z, w, r, ns: ns.abs(z) * ns.abs(z * w),
    "cast_real_to_complex": lambda z, w, r, ns: z * (r * r).to(torch.complex128),
    "exp_sin_cos": lambda z, w, r, ns: ns.exp(z * 0.3) * ns.sin(w * 0.5) + ns.cos(z * 0.4),
    "log_sqrt_rsqrt": lambda z, w, r, ns: ns.log(z * w) + ns.sqrt(z) * ns.rsqrt(w),
    "tanh_sigmoid_square": lambda z, w, r, ns: ns.tanh(z * 0.3) * ns.sigmoid(w * 0.2) + ns.square(z),
    "log1p": lambda z, w, r, ns: ns.log1p(z * 0.5) * w,
    # second order walks the reductions' recorded rules (broadcast_to, reshape) with complex gradients
    "reduce_sum_mean_axis": lambda z, w, r, ns: (
        (z * w).sum(0) * w.mean() if ns is torch else dtape.reduce_sum(z * w, axis=0) * dtape.reduce_mean(w)),
}


@pytest.mark.parametrize("case", sorted(_COMPLEX_CASES))
def test_complex_gradients_match_torch_autograd_first_and_second_order(case):
    g = torch.Generator().manual_seed(7)
    z0, w0, r0 = _complex(g, 3, 3), _complex(g, 3, 3), torch.randn(3, 3, dtype=torch.float64, generator=g)
    f = _COMPLEX_CASES[case]

    def loss_of(out, tmod):  # a real loss: |out|^2 summed
        return tmod.real(out * out.conj()).sum() if tmod is torch else dtape.reduce_sum(
            dtape.abs(out) * dtape.abs(out))
    tz, tw, tr = (t.clone().requires_grad_() for t in (z0, w0, r0))
    tl = loss_of(f(tz, tw, tr, torch), torch)
    t_first = torch.autograd.grad(tl, [tz, tw, tr], create_graph=True, allow_unused=True)
    t_second = torch.autograd.grad(sum((q * q.conj()).real.sum() for q in t_first if q is not None), [tz, tw, tr],
                                   allow_unused=True)
    dz, dw, dr = (dtape.constant(t) for t in (z0, w0, r0))
    with dtape.GradientTape() as outer:
        outer.watch([dz, dw, dr])
        with dtape.GradientTape() as inner:
            inner.watch([dz, dw, dr])
            dl = loss_of(f(dz, dw, dr, dtape), dtape)
        d_first = inner.gradient(dl, [dz, dw, dr])
        s = dtape.add_n([dtape.reduce_sum(dtape.abs(q) * dtape.abs(q)) for q in d_first if q is not None])
    d_second = outer.gradient(s, [dz, dw, dr])
    torch.testing.assert_close(float(dl), float(tl.detach()), rtol=1e-12, atol=0)
    for got, want in list(zip(d_first, t_first)) + list(zip(d_second, t_second)):
        if want is None:
            assert got is None or torch.count_nonzero(got.torch()) == 0
        else:
            assert got.dtype == want.dtype
            torch.testing.assert_close(got.torch(), want.detach(), rtol=1e-9, atol=1e-12)


def test_complex_gradient_through_an_op_with_a_real_only_rule_is_refused():
    z = dtape.constant(torch.tensor([1 + 2j, 3 - 1j]))
    with dtape.GradientTape() as tape:
        tape.watch(z)
        loss = dtape.reduce_sum(dtape.abs(dtape.nn.softplus(z)))
    with pytest.raises(NotImplementedError, match=r"softplus for complex values.*multiply"):
        tape.gradient(loss, z)


def test_global_norm_and_norm_clipping_of_complex_tensors_use_the_modulus():
    # The norm of a complex tensor is sqrt(sum |t|^2) (torch.linalg.vector_norm, clip_grad_norm_):
    # global_norm used to cast to real (dropping the imaginary part: 3 for [3+4j]) and clip_by_norm
    # failed in `greater` on a complex sum.
    g = torch.Generator().manual_seed(11)
    a, b = _complex(g, 2, 3), torch.randn(4, dtype=torch.float64, generator=g)
    want_norm = torch.sqrt((a.abs() ** 2).sum() + (b ** 2).sum())
    norm = dtape.global_norm([dtape.constant(a), dtape.constant(b)])
    assert norm.dtype == torch.float64
    torch.testing.assert_close(norm.torch(), want_norm, rtol=1e-12, atol=0)
    assert float(dtape.global_norm([dtape.constant(torch.tensor([3 + 4j], dtype=torch.complex64))])) == 5.0
    (ca, cb), _ = dtape.clip_by_global_norm([dtape.constant(a), dtape.constant(b)], 1.0)
    assert ca.dtype == torch.complex128
    torch.testing.assert_close(ca.torch(), a / want_norm, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(cb.torch(), b / want_norm, rtol=1e-12, atol=1e-15)
    clipped = dtape.clip_by_norm(dtape.constant(a), 1.0, axes=[1])
    torch.testing.assert_close(clipped.torch(), a / torch.linalg.vector_norm(a, dim=1, keepdim=True),
                               rtol=1e-12, atol=1e-15)


def test_output_gradients_real_for_a_complex_target_or_complex_for_a_real_one_are_refused():
    # A real upstream gradient for a complex target skipped every conjugation (dy * w instead of
    # dy * conj(w)); a complex one for a real target kept only its real part. torch refuses both.
    z = dtape.constant(torch.tensor([1 + 2j, 3 - 1j]))
    r = dtape.constant([1.0, 2.0])
    with dtape.GradientTape(persistent=True) as tape:
        tape.watch([z, r])
        y = z * dtape.constant(torch.tensor([2 - 1j, 1j]))
        q = r * r
    with pytest.raises(TypeError, match=r"output_gradients.*float64.*complex64"):
        tape.gradient(y, z, output_gradients=dtape.ones((2,), dtype=torch.float64))
    with pytest.raises(TypeError, match=r"output_gradients.*complex64.*float32"):
        tape.gradient(q, r, output_gradients=dtape.constant(torch.tensor([1j, 1j])))
    got = tape.gradient(y, z, output_gradients=dtape.constant(torch.tensor([1 + 0j, 1 + 0j])))
    torch.testing.assert_close(got.torch(), torch.tensor([2 + 1j, -1j]))
