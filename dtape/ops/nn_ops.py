"""Neural-network ops, exported as `dtape.nn` (TF names and arguments; NHWC conv).

One block per op: forward on torch tensors, then its gradient rule written
with torch functions and operators (recorded through `__torch_function__`
when an outer tape records the backward pass, so second order works).
"""
import math

import torch
import torch.nn.functional as F
from torch.nn._reduction import get_enum

from dtape import random as _random
from dtape._sizes import shape_values
from dtape.ops import _samples as S
from dtape.ops._axes import canonical_axis
from dtape.ops._dispatch import call_fallback
from dtape.ops._registry import TORCH_TABLE, defop, kernel_value
from dtape.ops.array_ops import gather, one_hot
from dtape.ops.math_ops import reduction_axes, expand_back, multiply, mixed_dtype_message, at_b, as_dy_dtype
from dtape.tensor import Tensor, convert_to_tensor

__all__ = ["relu", "relu6", "leaky_relu", "elu", "gelu", "silu", "softplus", "softmax", "log_softmax",
           "sparse_softmax_cross_entropy_with_logits", "softmax_cross_entropy_with_logits",
           "sigmoid_cross_entropy_with_logits", "l2_loss", "dropout", "conv2d", "conv2d_transpose", "bias_add", "moments", "layer_norm", "xw_plus_b",
           "embedding_lookup"]


def _unary_nn(rng):
    return [((S.away_from_zero(rng, 3, 4),), {}), ((S.away_from_zero(rng, 2, 3, 2) * 4,), {})]


# -- activations --------------------------------------------------------------
@defop(torch_fns=(torch.relu, torch.Tensor.relu, (F.relu, lambda input, inplace=False: relu(input))),
       samples=_unary_nn, saves="output")
def relu(features):
    """max(features, 0) elementwise; floating tensor, any shape -> same. Source: tf.nn.relu."""
    return torch.relu(features)


@relu.grad
def _(dy, ans, features):
    if isinstance(dy, torch.Tensor):  # raw walk: torch's fused kernel
        return torch.ops.aten.threshold_backward.default(dy, ans, 0)
    return torch.where(ans > 0, dy, 0.0)


@relu.jvp
def _(dx, ans, features):
    return torch.where(ans > 0, dx, 0.0)


@defop(torch_fns=((F.relu6, lambda input, inplace=False: relu6(input)),), samples=_unary_nn, saves="inputs")
def relu6(features):
    """min(max(features, 0), 6) elementwise; any shape -> same. Source: tf.nn.relu6."""
    return torch.clamp(features, 0.0, 6.0)


@relu6.grad
def _(dy, ans, features):
    return torch.where(torch.logical_and(features > 0, features < 6), dy, 0.0)


@defop(samples=lambda rng: [((S.away_from_zero(rng, 3, 4),), {}), ((S.away_from_zero(rng, 5),), {"alpha": 0.1})], saves="inputs")
def leaky_relu(features, alpha=0.2):
    """features if features > 0 else alpha * features; any shape -> same. Source: tf.nn.leaky_relu."""
    return torch.where(features > 0, features, features * alpha)


@leaky_relu.grad
def _(dy, ans, features, alpha=0.2):
    return torch.where(features > 0, dy, dy * alpha)


@defop(samples=_unary_nn)
def elu(features):
    """features if > 0 else exp(features) - 1; any shape -> same. Source: tf.nn.elu."""
    return F.elu(features)


@elu.grad
def _(dy, ans, features):
    return torch.where(features > 0, dy, dy * (ans + 1))


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_torch(input, approximate="none"):  # noqa: A002 - torch's name
    return gelu(input, approximate=approximate == "tanh")


@defop(torch_fns=((F.gelu, _gelu_torch),),
       samples=lambda rng: [((S.randn(rng, 3, 4),), {}), ((S.randn(rng, 3, 4),), {"approximate": True})], saves="inputs")
def gelu(features, approximate=False):
    """Gaussian error linear unit x * Phi(x) (tanh approximation if `approximate`).

    Args:
      features: floating tensor, any shape.
      approximate: use 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).

    Returns:
      Same shape and dtype. Source: tf.nn.gelu.
    """
    return F.gelu(features, approximate="tanh" if approximate else "none")


@gelu.grad
def _(dy, ans, features, approximate=False):
    x = features
    how = "tanh" if approximate else "none"
    if isinstance(dy, torch.Tensor):  # raw walk: torch's fused kernel
        return torch.ops.aten.gelu_backward.default(dy, x, approximate=how)
    # recorded walk: the kernel's bits (a walk's result must not depend on whether a tape records it)
    value = torch.ops.aten.gelu_backward.default(dy.torch(), x.torch(), approximate=how)
    if approximate:
        t = torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))
        d = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * x * x)
        return kernel_value(dy * d, value)
    cdf = 0.5 * (1 + torch.erf(x * (1 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * x * x) * (1 / math.sqrt(2 * math.pi))
    return kernel_value(dy * (cdf + x * pdf), value)


@defop(torch_fns=((F.silu, lambda input, inplace=False: silu(input)),), samples=_unary_nn, saves="inputs")
def silu(features):
    """features * sigmoid(features) (swish); any shape -> same. Source: tf.nn.silu."""
    return F.silu(features)


@silu.grad
def _(dy, ans, features):
    s = torch.sigmoid(features)
    return dy * s * (1 + features * (1 - s))


@defop(samples=_unary_nn, saves="inputs")
def softplus(features):
    """log(1 + exp(features)), computed stably; any shape -> same. Source: tf.math.softplus."""
    return torch.logaddexp(features, torch.zeros_like(features))


@softplus.grad
def _(dy, ans, features):
    return dy * torch.sigmoid(features)


def _softmax_samples(rng):
    return [((S.randn(rng, 3, 5),), {}), ((S.randn(rng, 2, 4, 3),), {"axis": 1})]


@defop(samples=_softmax_samples, saves="output")
def softmax(logits, axis=-1):
    """exp(logits) / sum(exp(logits), axis); floating, any shape -> same. Source: tf.nn.softmax."""
    return torch.softmax(logits, dim=canonical_axis(axis, logits.ndim, "softmax"))


@softmax.grad
def _(dy, ans, logits, axis=-1):
    axis = canonical_axis(axis, ans.ndim, "softmax")
    if isinstance(dy, torch.Tensor):  # raw walk: torch's fused kernel
        return torch._softmax_backward_data(dy, ans, axis, ans.dtype)
    return kernel_value(ans * (dy - torch.sum(dy * ans, dim=axis, keepdim=True)),
                        torch._softmax_backward_data(dy.torch(), ans.torch(), axis, ans.dtype))


@softmax.jvp
def _(dx, ans, logits, axis=-1):
    axis = canonical_axis(axis, ans.ndim, "softmax")
    return ans * (dx - torch.sum(dx * ans, dim=axis, keepdim=True))


@defop(samples=_softmax_samples, saves="output")
def log_softmax(logits, axis=-1):
    """logits - logsumexp(logits, axis); floating, any shape -> same. Source: tf.nn.log_softmax."""
    return torch.log_softmax(logits, dim=canonical_axis(axis, logits.ndim, "log_softmax"))


@log_softmax.grad
def _(dy, ans, logits, axis=-1):
    axis = canonical_axis(axis, ans.ndim, "log_softmax")
    if isinstance(dy, torch.Tensor):  # raw walk: torch's fused kernel
        return torch._log_softmax_backward_data(dy, ans, axis, ans.dtype)
    return kernel_value(dy - torch.exp(ans) * torch.sum(dy, dim=axis, keepdim=True),
                        torch._log_softmax_backward_data(dy.torch(), ans.torch(), axis, ans.dtype))


def _torch_log_softmax(func):
    """`func` (F.log_softmax, torch.log_softmax, Tensor.log_softmax) on dtape tensors: the `log_softmax` op
    over an int `dim`; other calls (no dim: torch's deprecated implicit choice; a dtype) through the autograd
    fallback. F.log_softmax hands over every keyword it has (`dim`, `_stacklevel`, `dtype`)."""
    def call(input, dim=None, *args, **kwargs):
        if args or kwargs.get("dtype") is not None or type(dim) is not int or type(input) is not Tensor \
                or not -input._t.ndim <= dim < input._t.ndim:   # (torch's own error for a dim out of range)
            return call_fallback(func, (input, dim, *args), kwargs)
        return log_softmax(input, axis=dim)
    return call


for _fn in (F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax):
    TORCH_TABLE[_fn] = _torch_log_softmax(_fn)


# -- losses -------------------------------------------------------------------
def _sparse_xent_samples(rng):
    return [((torch.tensor([0, 3, 1]), S.randn(rng, 3, 4)), {}),
            ((torch.tensor([[2, 0], [1, 1]]), S.randn(rng, 2, 2, 3)), {})]


def _check_class_ids(labels, what):
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"{what} has dtype {labels.dtype}, expected an integer dtype (int32 or int64) of class ids: "
                        "a float label would be truncated to a class silently; cast integer-valued labels with "
                        "dtape.cast(labels, 'int64'), or use softmax_cross_entropy_with_logits for soft labels")


@defop(n_in=2, samples=_sparse_xent_samples, saves="inputs")
def sparse_softmax_cross_entropy_with_logits(labels, logits):
    """Per-example softmax cross-entropy against integer class labels.

    Args:
      labels: int tensor [d...] with values in [0, num_classes).
      logits: floating tensor [d..., num_classes].

    Returns:
      Losses [d...], logits' dtype. No gradient flows to `labels`.

    Raises:
      TypeError: labels of a floating, complex or bool dtype (a label 1.7
        would silently become class 1).

    Source: tf.nn.sparse_softmax_cross_entropy_with_logits.
    """
    _check_class_ids(labels, "sparse_softmax_cross_entropy_with_logits: labels")
    logp = torch.log_softmax(logits, dim=-1)
    return -torch.squeeze(torch.gather(logp, -1, torch.unsqueeze(labels.long(), -1)), -1)


@sparse_softmax_cross_entropy_with_logits.grad
def _(dy, ans, labels, logits):
    if isinstance(dy, torch.Tensor):  # raw walk: softmax, minus 1 at the label (p - 1, as p - one_hot), times dy
        g = torch.softmax(logits, dim=-1)
        index = torch.unsqueeze(labels.long(), -1)
        g.scatter_add_(-1, index, torch.full(index.shape, -1.0, dtype=g.dtype, device=g.device))
        return None, g.mul_(torch.unsqueeze(dy, -1))
    hot = one_hot.any(labels, logits.shape[-1], dtype=logits.dtype)
    return None, torch.unsqueeze(dy, -1) * (softmax.any(logits) - hot)


def _xent_samples(rng):
    labels = torch.softmax(S.randn(rng, 3, 4), dim=-1)
    return [((labels, S.randn(rng, 3, 4)), {}), ((S.positive(rng, 4, 2), S.randn(rng, 4, 2)), {"axis": 0})]


@defop(n_in=2, samples=_xent_samples, saves="inputs")
def softmax_cross_entropy_with_logits(labels, logits, axis=-1):
    """Softmax cross-entropy -sum(labels * log_softmax(logits), axis) per example.

    Args:
      labels: floating tensor, logits' shape; each row a probability distribution.
      logits: floating tensor [..., num_classes, ...] (classes at `axis`).
      axis: the class dimension.

    Returns:
      Losses: logits' shape without `axis`. Both inputs get gradients.

    Source: tf.nn.softmax_cross_entropy_with_logits (v2).
    """
    axis = canonical_axis(axis, logits.ndim, "softmax_cross_entropy_with_logits")
    return -torch.sum(labels * torch.log_softmax(logits, dim=axis), dim=axis)


@softmax_cross_entropy_with_logits.grad
def _(dy, ans, labels, logits, axis=-1):
    axis = canonical_axis(axis, logits.ndim, "softmax_cross_entropy_with_logits")
    dy = torch.unsqueeze(dy, axis)
    total = torch.sum(labels, dim=axis, keepdim=True)
    return -dy * log_softmax.any(logits, axis=axis), dy * (softmax.any(logits, axis=axis) * total - labels)


def _nll_samples(rng):
    target = torch.tensor([0, 3, 1, 3])
    return [((S.randn(rng, 4, 4), target), {}), ((S.randn(rng, 4, 4), target), {"reduction": "sum"}),
            ((S.randn(rng, 4, 4), target), {"reduction": "none", "ignore_index": 3}),
            ((S.randn(rng, 4, 4), target), {"ignore_index": 1})]


@defop(n_in=2, samples=_nll_samples, saves="inputs")
def nll_loss(log_probs, target, reduction="mean", ignore_index=-100):
    """torch's negative log-likelihood loss without class weights: -log_probs[i, target[i]] per example.

    Args:
      log_probs: floating tensor [N, C] or [C] (log-probabilities, e.g. a
        log_softmax over dim 1; any values are taken as they are).
      target: int64 (or uint8, as torch) tensor [N] or [] of class indices in [0, C), or
        `ignore_index` (that example counts nothing, not even in the mean).
      reduction: "mean" (the sum over the examples not ignored divided by
        their count: NaN when every one is ignored, as torch), "sum" or "none".
      ignore_index: a class index that is skipped.

    Returns:
      A 0-d tensor of log_probs' dtype, or [N] with reduction "none". No
      gradient flows to `target`.

    Raises (torch's errors and messages):
      IndexError: a target out of range that is not `ignore_index`.
      RuntimeError: a target dtype torch refuses (int32, bool, floating).
      ValueError: an unknown reduction; a target of another batch size.

    Forward and gradient run torch's own kernels (F.nll_loss's entry point,
    then `aten::nll_loss_forward`; `aten::nll_loss_backward`), so values and
    gradients are torch's, bit for bit. Not exported: it is what `F.nll_loss` and `F.cross_entropy` run on
    dtape tensors. Source: torch.nn.functional.nll_loss.
    """
    # torch's entry point (F.nll_loss's): it checks the batch sizes first (ValueError), then aten::nll_loss_forward
    return torch._C._nn.nll_loss_nd(log_probs, target, None, get_enum(reduction), ignore_index)


@nll_loss.grad
def _(dy, ans, log_probs, target, reduction="mean", ignore_index=-100):
    if isinstance(dy, torch.Tensor):  # raw walk: torch's kernel
        return _nll_backward(dy, log_probs, target, reduction, ignore_index), None
    kept = torch.where(target != ignore_index, target, -1)   # -1: a one-hot row of zeros
    hot = one_hot.any(kept, log_probs.shape[-1], dtype=log_probs.dtype)
    raw = (log_probs.torch(), target.torch(), reduction, ignore_index)
    total = _nll_total(*raw)
    scale = dy / total if reduction == "mean" else dy
    composite = -hot * (torch.unsqueeze(scale, -1) if reduction == "none" else scale)
    value = _nll_backward(dy.torch(), *raw, total=total)
    return kernel_value(composite, value), None


def _nll_total(log_probs, target, reduction, ignore_index):
    """torch's total weight of the examples not ignored (their count, in log_probs' dtype)."""
    return torch.ops.aten.nll_loss_forward.default(log_probs, target, None, get_enum(reduction), ignore_index)[1]


def _nll_backward(dy, log_probs, target, reduction, ignore_index, total=None):
    """aten::nll_loss_backward with torch's total weight (`total`, or computed here)."""
    if total is None:
        total = _nll_total(log_probs, target, reduction, ignore_index)
    return torch.ops.aten.nll_loss_backward.default(dy, log_probs, target, None, get_enum(reduction), ignore_index, total)


def _class_indices(input, target, ignore_index, weight=None, size_average=None, reduce=None, label_smoothing=0.0):
    """Whether an F.nll_loss / F.cross_entropy call is the case the `nll_loss` op covers: a dtape.Tensor input
    [N, C] or [C], integer class indices of one rank less, a Python int ignore_index, no class weights, no
    label smoothing, no legacy size_average/reduce, outside torch.autocast (whose casts of the fused loss the
    op does not mirror)."""
    return (type(input) is Tensor and input._t.ndim in (1, 2) and type(ignore_index) is int and weight is None
            and size_average is None
            and reduce is None and label_smoothing == 0.0 and isinstance(target, (Tensor, torch.Tensor))
            and not target.dtype.is_floating_point and target.ndim == input._t.ndim - 1
            and not torch._C._is_any_autocast_enabled())


def _torch_nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                    reduction="mean"):
    """`F.nll_loss` on dtape tensors: the `nll_loss` op where it covers the call, else the autograd fallback."""
    if _class_indices(input, target, ignore_index, weight, size_average, reduce):
        return nll_loss(input, target, reduction=reduction, ignore_index=ignore_index)
    return call_fallback(F.nll_loss, (input, target), dict(weight=weight, size_average=size_average,
                                                          ignore_index=ignore_index, reduce=reduce,
                                                          reduction=reduction))


def _torch_cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                         reduction="mean", label_smoothing=0.0):
    """`F.cross_entropy` on dtape tensors: with class indices, as torch computes it, `log_softmax` over the
    class dimension then `nll_loss` (the same kernels forward and backward, no autograd engine call); other
    cases (class probabilities, weights, smoothing, more dimensions, autocast) through the autograd fallback."""
    if _class_indices(input, target, ignore_index, weight, size_average, reduce, label_smoothing):
        return nll_loss(log_softmax(input, axis=1 if input._t.ndim == 2 else 0), target, reduction=reduction,
                        ignore_index=ignore_index)
    return call_fallback(F.cross_entropy, (input, target), dict(
        weight=weight, size_average=size_average, ignore_index=ignore_index, reduce=reduce, reduction=reduction,
        label_smoothing=label_smoothing))


TORCH_TABLE[F.nll_loss] = _torch_nll_loss
TORCH_TABLE[F.cross_entropy] = _torch_cross_entropy


def _sigmoid_xent_samples(rng):
    return [((torch.rand(3, 4, generator=rng, dtype=torch.float64), S.randn(rng, 3, 4) * 3), {})]


@defop(n_in=2, samples=_sigmoid_xent_samples, saves="inputs")
def sigmoid_cross_entropy_with_logits(labels, logits):
    """Elementwise logistic loss max(x, 0) - x * z + log(1 + exp(-|x|)), x=logits, z=labels.

    Args:
      labels: floating tensor in [0, 1], logits' shape.
      logits: floating tensor, any shape.

    Returns:
      Same shape and dtype. Both inputs get gradients.

    Source: tf.nn.sigmoid_cross_entropy_with_logits.
    """
    return torch.clamp(logits, min=0) - logits * labels + torch.log1p(torch.exp(-torch.abs(logits)))


@sigmoid_cross_entropy_with_logits.grad
def _(dy, ans, labels, logits):
    return -dy * logits, dy * (torch.sigmoid(logits) - labels)


@defop(samples=lambda rng: [((S.randn(rng, 3, 4),), {})], saves="inputs")
def l2_loss(t):
    """sum(t ** 2) / 2; floating tensor, any shape -> scalar. Source: tf.nn.l2_loss."""
    return torch.sum(t * t) / 2


@l2_loss.grad
def _(dy, ans, t):
    return dy * t


def dropout(x, rate, noise_shape=None, seed=None, name=None):
    """Zeroes each element with probability `rate`, scales kept ones by 1 / (1 - rate).

    The mask is sampled here and enters as a constant input of one
    multiplication, so the gradient (dy * mask) reuses it.

    Args:
      x: floating tensor, any shape.
      rate: drop probability in [0, 1).
      noise_shape: shape broadcastable to x.shape (shared mask along size-1 dims).
      seed: int, seeds a private generator: the same mask on every call (stateless,
        like tf.random.stateless_*; TF 2 op seeds give a new mask per call); default: the
        current replica's generator (`dtape.random`), torch's default outside replicas.

    Returns:
      x's shape and dtype.

    Raises:
      ValueError: for a rate outside [0, 1).

    Source: tf.nn.dropout.
    """
    x = convert_to_tensor(x)
    if not 0 <= float(rate) < 1:
        raise ValueError(f"dropout: rate must be in [0, 1), got {rate}")
    shape = tuple(x.shape) if noise_shape is None else shape_values(noise_shape, "dropout", "noise_shape")
    if seed is not None:
        gen = torch.Generator(device=x.device).manual_seed(int(seed))
        keep = _random.raw_uniform(shape, None, x.device, gen) >= float(rate)
        mask = keep.to(x.dtype) / (1 - float(rate))
    else:
        mask = _random.bernoulli_mask(shape, 1 - float(rate), x.dtype, x.device)
    return multiply(x, Tensor(mask))


# -- conv2d -------------------------------------------------------------------
def _pair_arg(v, data_format, name):
    """TF strides/dilations (int, or 1, 2 or 4 ints) -> (h, w)."""
    if v is None:
        return (1, 1)
    v = [int(v)] if isinstance(v, int) else [int(s) for s in v]
    if len(v) == 4:
        return (v[1], v[2]) if data_format == "NHWC" else (v[2], v[3])
    if len(v) in (1, 2):
        return (v[0], v[-1])
    raise ValueError(f"conv2d: {name} must be an int or a list of 1, 2 or 4 ints, got {v}")


def _pads(in_hw, k_hw, strides, dilations, padding, data_format):
    """(left, right, top, bottom) padding, TF's SAME arithmetic (extra row/col after)."""
    if isinstance(padding, str):
        if padding.upper() == "VALID":
            return (0, 0, 0, 0)
        if padding.upper() != "SAME":
            raise ValueError(f"conv2d: padding must be 'SAME', 'VALID' or explicit pairs, got {padding!r}")
        pads = []
        for n, k, s, d in zip(in_hw, k_hw, strides, dilations):
            total = max((-(-n // s) - 1) * s + (k - 1) * d + 1 - n, 0)
            pads.append((total // 2, total - total // 2))
        return pads[1] + pads[0]
    pairs = [tuple(int(p) for p in pair) for pair in padding]
    hw = pairs[1:3] if data_format == "NHWC" else pairs[2:4]
    return hw[1] + hw[0]


def _conv_layout(input, filters, strides, padding, data_format, dilations):  # noqa: A002
    """NCHW padded input, OIHW filters and the torch conv arguments."""
    x = torch.permute(input, (0, 3, 1, 2)) if data_format == "NHWC" else input
    w = torch.permute(filters, (3, 2, 0, 1))
    s = _pair_arg(strides, data_format, "strides")
    d = _pair_arg(dilations, data_format, "dilations")
    pads = _pads(tuple(x.shape[2:]), tuple(w.shape[2:]), s, d, padding, data_format)
    return x, w, s, d, pads


def _conv_samples(rng):
    return [((S.randn(rng, 2, 5, 5, 3), S.randn(rng, 3, 3, 3, 2)), {"strides": 1, "padding": "SAME"}),
            ((S.randn(rng, 1, 6, 7, 2), S.randn(rng, 2, 3, 2, 3)), {"strides": [1, 2, 2, 1], "padding": "SAME"}),
            ((S.randn(rng, 1, 7, 6, 2), S.randn(rng, 3, 2, 2, 2)), {"strides": 2, "padding": "VALID",
                                                                    "dilations": [1, 1]}),
            ((S.randn(rng, 1, 7, 7, 1), S.randn(rng, 2, 2, 1, 2)), {"strides": 1, "padding": "SAME",
                                                                    "dilations": 2}),
            ((S.randn(rng, 1, 2, 5, 5), S.randn(rng, 3, 3, 2, 2)), {"strides": 2, "padding": "SAME",
                                                                    "data_format": "NCHW"}),
            # one output channel: its OIHW filter view has channels-last strides (torch's kernel refused it)
            ((S.randn(rng, 2, 5, 4, 3), S.randn(rng, 3, 2, 3, 1)), {"strides": 1, "padding": "SAME"})]


@defop(n_in=2, samples=_conv_samples, saves="inputs")
def conv2d(input, filters, strides, padding, data_format="NHWC", dilations=None):  # noqa: A002
    """2-D convolution (cross-correlation), TF layout and padding.

    Args:
      input: floating tensor [batch, h, w, in] (NHWC) or [batch, in, h, w] (NCHW).
      filters: [kh, kw, in, out], input's dtype.
      strides: int, or 1, 2 or 4 ints ([1, sh, sw, 1] for NHWC).
      padding: "SAME" (output ceil(h / sh); asymmetric padding puts the extra
        row/column after, as TF), "VALID", or explicit [[0, 0], [t, b], [l, r], [0, 0]].
      data_format: "NHWC" or "NCHW".
      dilations: like strides (default 1).

    Returns:
      [batch, oh, ow, out] (NHWC) or [batch, out, oh, ow], input's dtype.

    Source: tf.nn.conv2d.
    """
    x, w, s, d, pads = _conv_layout(input, filters, strides, padding, data_format, dilations)
    y = F.conv2d(F.pad(x, pads), w, stride=s, dilation=d)
    return torch.permute(y, (0, 2, 3, 1)) if data_format == "NHWC" else y


@conv2d.grad
def _(dy, ans, input, filters, strides, padding, data_format="NHWC", dilations=None,  # noqa: A002
      needs=(True, True)):
    """Image and filter gradients, each only when `needs` asks for it (the first layer's image needs none).

    On the raw walk (torch tensors) torch's own backward kernel computes them
    (`aten.convolution_backward` with an output mask); when a tape records
    the walk, they have the same kernel's bits and the derivatives of
    composite ops (a transposed convolution, a convolution over the batch).
    """
    if isinstance(dy, torch.Tensor):
        return _conv_grads_raw(dy, input, filters, strides, padding, data_format, dilations, needs)
    # recorded walk: the raw walk's bits (a walk's result must not depend on whether a tape records it)
    kx, kw = _conv_grads_raw(dy.torch(), input.torch(), filters.torch(), strides, padding, data_format, dilations,
                             needs)
    x, w, s, d, pads = _conv_layout(input, filters, strides, padding, data_format, dilations)
    g = torch.permute(dy, (0, 3, 1, 2)) if data_format == "NHWC" else dy
    gx = gw = None
    if needs[0]:
        gx = _conv_grad_input(g, x, w, s, d, pads)
        gx = kernel_value(torch.permute(gx, (0, 2, 3, 1)) if data_format == "NHWC" else gx, kx)
    if needs[1]:
        gw = kernel_value(_conv_grad_filter(g, x, w, s, d, pads, filters), kw)
    return gx, gw


def _conv_grads_raw(dy, input, filters, strides, padding, data_format, dilations, needs):  # noqa: A002
    """conv2d's gradients on torch tensors, from torch's backward kernel (image in `data_format`)."""
    x, w, s, d, pads = _conv_layout(input, filters, strides, padding, data_format, dilations)
    g = torch.permute(dy, (0, 3, 1, 2)) if data_format == "NHWC" else dy
    gx, gw = _conv_grads_kernel(g, x, w, s, d, pads, needs)
    if gx is not None and data_format == "NHWC":
        gx = torch.permute(gx, (0, 2, 3, 1))
    return gx, gw


def _conv_grads_kernel(g, x, w, s, d, pads, needs):
    """(image grad NCHW, filter grad [kh, kw, in, out]) from torch's backward kernel; None where not needed."""
    if x.shape[0] == 0:  # empty batch: no work, zero gradients of the right shapes
        return (torch.zeros_like(x) if needs[0] else None), \
            (torch.zeros(_filter_shape(w), dtype=w.dtype, device=w.device) if needs[1] else None)
    if x.dtype != g.dtype or w.dtype != g.dtype:  # autocast ran the forward in g's dtype: do the same
        x, w = x.to(g.dtype), w.to(g.dtype)
    if w.shape[0] == 1:  # the OIHW view of [kh, kw, in, 1] filters has channels-last strides, for which
        w = w.contiguous()  # torch makes a channels-last grad_weight that its CPU kernel then refuses
    symmetric = pads[0] == pads[1] and pads[2] == pads[3]
    xp = x if symmetric else F.pad(x, pads)
    conv_pad = (pads[2], pads[0]) if symmetric else (0, 0)
    gx, gw, _ = _convolution_backward(g, xp, w, s, conv_pad, d, needs)
    if gx is not None and not symmetric:
        gx = gx[:, :, pads[2]:xp.shape[2] - pads[3], pads[0]:xp.shape[3] - pads[1]]
    if gw is not None:
        gw = torch.permute(gw, (2, 3, 1, 0))  # OIHW -> [kh, kw, in, out]
    return gx, gw


def _convolution_backward(g, x, w, stride, padding, dilation, needs):
    """torch's convolution backward kernel on torch tensors: (grad input, grad weight, None)."""
    return torch.ops.aten.convolution_backward.default(g, x, w, None, list(stride), list(padding), list(dilation),
                                               False, [0, 0], 1, [bool(needs[0]), bool(needs[1]), False])


def _filter_shape(w):
    return (w.shape[2], w.shape[3], w.shape[1], w.shape[0])


def _conv_grad_input(g, x, w, s, d, pads):
    """Differentiable image gradient (NCHW): a transposed convolution, cropped to the unpadded image."""
    return _conv_transpose_nchw(g, tuple(x.shape[2:]), w, s, d, pads)


def _conv_transpose_nchw(g, hw, w, s, d, pads):
    """The transpose of conv2d (OIHW w, `pads` around an image of size `hw`) applied to g: NCHW, size `hw`."""
    if g.shape[0] == 0:  # empty batch: torch's transposed kernel refuses some (1x1 filters, strides)
        return torch.zeros((0, w.shape[1]) + tuple(hw), dtype=g.dtype, device=g.device)
    hp, wp = hw[0] + pads[2] + pads[3], hw[1] + pads[0] + pads[1]
    out_pad = [n - ((o - 1) * st + (k - 1) * dl + 1) for n, o, st, k, dl in
               zip((hp, wp), g.shape[2:], s, w.shape[2:], d)]
    gx = F.conv_transpose2d(g, w, stride=s, dilation=d, output_padding=tuple(out_pad))
    return gx[:, :, pads[2]:hp - pads[3], pads[0]:wp - pads[1]]


def _conv_grad_filter(g, x, w, s, d, pads, filters):
    """Differentiable filter gradient [kh, kw, in, out]: a convolution over the batch dimension."""
    if x.shape[0] == 0:  # empty batch: torch's conv over a zero-size "channel" dim loses `out`
        return torch.zeros_like(filters)
    xp = F.pad(x, pads)
    kh, kw = w.shape[2], w.shape[3]
    gw = F.conv2d(torch.transpose(xp, 0, 1), torch.transpose(g, 0, 1), stride=d, dilation=s)
    return torch.permute(gw[:, :, :kh, :kw], (2, 3, 0, 1))      # [in, out, kh, kw] -> [kh, kw, in, out]


def _conv_transpose_samples(rng):
    return [((S.randn(rng, 2, 3, 3, 2), S.randn(rng, 3, 3, 4, 2)), {"output_shape": [2, 6, 6, 4], "strides": 2}),
            ((S.randn(rng, 1, 3, 4, 2), S.randn(rng, 2, 3, 3, 2)), {"output_shape": [1, 7, 9, 3], "strides": 2,
                                                                    "padding": "VALID"}),
            ((S.randn(rng, 1, 4, 4, 2), S.randn(rng, 1, 1, 2, 2)), {"output_shape": [1, 8, 8, 2], "strides": 2}),
            ((S.randn(rng, 2, 2, 3, 3), S.randn(rng, 3, 3, 2, 2)), {"output_shape": [2, 2, 5, 6], "strides": 2,
                                                                    "data_format": "NCHW"})]


def _conv_transpose_layout(input, filters, output_shape, strides, padding, data_format, dilations):  # noqa: A002
    """NCHW input, OIHW filters of the conv2d it transposes, and that conv2d's strides, dilations, padding."""
    out = shape_values(output_shape, "conv2d_transpose")
    if len(out) != 4:
        raise ValueError(f"conv2d_transpose: output_shape must have 4 sizes, got {out}")
    hw = (out[1], out[2]) if data_format == "NHWC" else (out[2], out[3])
    x = torch.permute(input, (0, 3, 1, 2)) if data_format == "NHWC" else input
    w = torch.permute(filters, (3, 2, 0, 1))
    s = _pair_arg(strides, data_format, "strides")
    d = _pair_arg(dilations, data_format, "dilations")
    return x, w, s, d, hw, _pads(hw, tuple(w.shape[2:]), s, d, padding, data_format)


@defop(n_in=2, samples=_conv_transpose_samples, saves="inputs")
def conv2d_transpose(input, filters, output_shape, strides, padding="SAME", data_format="NHWC",  # noqa: A002
                     dilations=None):
    """The transpose (adjoint) of `conv2d`: the gradient of conv2d with respect to its image.

    Args:
      input: floating tensor [batch, h, w, in] (NHWC) or [batch, in, h, w] (NCHW).
      filters: [kh, kw, out, in] (TF's order: output channels before input channels), input's dtype.
      output_shape: 4 sizes, the output's shape: the image shape of the conv2d
        (same strides, padding, dilations) that maps it back to `input`'s shape.
      strides, padding, data_format, dilations: as `conv2d` ("SAME" pads as TF,
        the extra row/column after).

    Returns:
      output_shape, input's dtype and device.

    Raises:
      ValueError: an output_shape of other than 4 sizes; torch's error when
        output_shape does not map back to input's shape.
    Source: tf.nn.conv2d_transpose.
    """
    x, w, s, d, hw, pads = _conv_transpose_layout(input, filters, output_shape, strides, padding, data_format,
                                                  dilations)
    y = _conv_transpose_nchw(x, hw, w, s, d, pads)
    return torch.permute(y, (0, 2, 3, 1)) if data_format == "NHWC" else y


@conv2d_transpose.grad
def _(dy, ans, input, filters, output_shape, strides, padding="SAME", data_format="NHWC",  # noqa: A002
      dilations=None, needs=(True, True)):
    """Image gradient: conv2d of dy (the adjoint of the adjoint); filter gradient: conv2d's filter gradient
    with dy as its image and the input as its output's cotangent. Torch functions on either walk, so a
    recorded walk has the raw walk's bits and is differentiable again."""
    x, w, s, d, hw, pads = _conv_transpose_layout(input, filters, output_shape, strides, padding, data_format,
                                                  dilations)
    g = torch.permute(dy, (0, 3, 1, 2)) if data_format == "NHWC" else dy
    gx = gw = None
    if needs[0]:  # an empty batch: zeros (torch's kernel refuses some empty convolutions, as above)
        gx = F.conv2d(F.pad(g, pads), w, stride=s, dilation=d) if g.shape[0] else torch.zeros_like(x)
        gx = torch.permute(gx, (0, 2, 3, 1)) if data_format == "NHWC" else gx
    if needs[1]:
        gw = _conv_grad_filter(x, g, w, s, d, pads, filters)
    return gx, gw


# -- bias, moments, embeddings ------------------------------------------------
def _xw_plus_b_samples(rng):
    return [((S.randn(rng, 3, 4), S.randn(rng, 4, 2), S.randn(rng, 2)), {}),
            ((S.randn(rng, 3, 5, 4), S.randn(rng, 4, 2), S.randn(rng, 2)), {})]


@defop(n_in=3, samples=_xw_plus_b_samples, saves="inputs")
def xw_plus_b(x, weights, biases):
    """x @ weights + biases in one fused kernel (`torch.addmm`): what `layers.Dense` computes.

    Args:
      x: floating tensor [..., in] (TF's takes [batch, in] only; leading
        dimensions here are folded into rows, as Keras' Dense does); any device.
      weights: [in, out], x's dtype and device.
      biases: [out].

    Returns:
      [..., out].

    Raises:
      TypeError: operands of different dtypes (the message names the cast).
      ValueError: a 0-d x.
    Source: tf.compat.v1.nn.xw_plus_b.
    """
    try:
        if _autocast_on(x.device):  # the product in low precision, the bias added after (as matmul + bias)
            return torch.matmul(x, weights) + biases
        if x.ndim == 2:
            return torch.addmm(biases, x, weights)
        if x.ndim == 0:  # x.shape[-1] below would be an IndexError naming nothing
            raise ValueError(f"xw_plus_b: x is a scalar (0-d); give it shape [..., in], here [..., {weights.shape[0]}]")
        # rows folded inside the op: one record, not a reshape on each side (a transformer's Dense layers)
        return torch.addmm(biases, x.reshape(-1, x.shape[-1]), weights).view(x.shape[:-1] + weights.shape[1:])
    except RuntimeError:  # dtypes checked only on failure: the fast path stays one torch call
        if x.dtype != weights.dtype:
            raise TypeError(mixed_dtype_message(x.dtype, weights.dtype)) from None
        if biases.dtype != x.dtype:
            raise TypeError(f"xw_plus_b: x and weights are {x.dtype} but biases are {biases.dtype}; "
                            f"cast the biases: dtape.cast(biases, {x.dtype})") from None
        raise


def _autocast_on(device):
    try:
        return torch.is_autocast_enabled(device.type)
    except TypeError:  # torch < 2.4: one function per device type
        return torch.is_autocast_cpu_enabled() if device.type == "cpu" else torch.is_autocast_enabled()


@xw_plus_b.grad
def _(dy, ans, x, weights, biases, needs=(True, True, True)):
    if isinstance(dy, torch.Tensor):  # raw walk: autocast may have mixed the operands' dtypes
        x, weights = as_dy_dtype(dy, x, needs[1]), as_dy_dtype(dy, weights, needs[0])
    gx = torch.matmul(dy, torch.transpose(weights, 0, 1)) if needs[0] else None
    if dy.ndim != 2:  # [..., out]: the weights' and biases' gradients sum over every leading row
        x, dy = torch.reshape(x, (-1, x.shape[-1])), torch.reshape(dy, (-1, dy.shape[-1]))
    gw = at_b(x, dy) if needs[1] else None
    return gx, gw, (torch.sum(dy, dim=0) if needs[2] else None)


def _bias_samples(rng):
    return [((S.randn(rng, 2, 3, 4), S.randn(rng, 4)), {}),
            ((S.randn(rng, 2, 3, 4, 2), S.randn(rng, 3)), {"data_format": "NCHW"})]


@defop(n_in=2, samples=_bias_samples, saves="none")
def bias_add(value, bias, data_format="NHWC"):
    """value + bias along the channel dimension.

    Args:
      value: floating tensor [batch, ..., channels] (N...C) or [batch, channels, ...] (NC...).
      bias: [channels], value's dtype.
      data_format: "NHWC" (channels last, any "N...C") or "NCHW" (any "NC...").

    Returns:
      value's shape and dtype. Source: tf.nn.bias_add.
    """
    if data_format.startswith("NC"):
        bias = torch.reshape(bias, (-1,) + (1,) * (value.ndim - 2))
    return value + bias


@bias_add.grad
def _(dy, ans, value, bias, data_format="NHWC"):
    if data_format.startswith("NC"):
        return dy, torch.sum(dy, dim=(0,) + tuple(range(2, len(value.shape))))
    return dy, dy


@bias_add.jvp
def _(t, ans, value, bias, data_format="NHWC"):
    if t[1] is None:
        return t[0]
    return bias_add(torch.zeros_like(ans) if t[0] is None else t[0], t[1], data_format)


def _moments_samples(rng):
    return [((S.randn(rng, 3, 4),), {"axes": [0]}), ((S.randn(rng, 3, 2),), {"axes": []}),
            ((S.randn(rng, 2, 3, 4),), {"axes": [0, 2], "keepdims": True}),
            ((S.randn(rng, 2, 3),), {"axes": -1})]


@defop(multi_output=True, samples=_moments_samples)
def moments(x, axes, keepdims=False):
    """Mean and (population) variance of `x` over `axes`.

    Args:
      x: floating tensor, any shape.
      axes: int or list of ints (negative counts from the end).
      keepdims: keep reduced dimensions with size 1.

    Returns:
      (mean, variance), each x's shape without (or with size-1) `axes`.

    Source: tf.nn.moments.
    """
    dims = reduction_axes(x.ndim, axes, "moments")
    if not dims:  # no axis: mean x, variance 0 (torch.mean(dim=()) would reduce every axis)
        return x.clone(), torch.zeros_like(x)
    mean = torch.mean(x, dim=dims, keepdim=True)
    var = torch.mean(torch.square(x - mean), dim=dims, keepdim=keepdims)
    return (mean if keepdims else torch.squeeze(mean, dims)), var


@moments.grad
def _(dys, ans, x, axes, keepdims=False):
    dmean, dvar = dys
    dims = reduction_axes(x.ndim, axes)
    count = 1
    for a in dims:
        count *= x.shape[a]
    mean = expand_back(ans[0], x, axes, keepdims)
    centred = x - mean
    return (expand_back(dmean, x, axes, keepdims) + expand_back(dvar, x, axes, keepdims) * 2 * centred) / count


def _layer_norm_samples(rng):
    return [((S.randn(rng, 3, 4), S.randn(rng, 4), S.randn(rng, 4)), {}),
            ((S.randn(rng, 2, 3, 5), S.randn(rng, 5), S.randn(rng, 5)), {"epsilon": 0.1})]


@defop(n_in=3, samples=_layer_norm_samples, saves="inputs", stash=True)
def layer_norm(x, gamma, beta, epsilon=1e-3):
    """Normalises the last axis: `gamma * (x - mean) / sqrt(var + epsilon) + beta` (population variance).

    Args:
      x: floating tensor [..., d]; any device.
      gamma, beta: [d], x's dtype and device.
      epsilon: added to the variance.

    Returns:
      x's shape and dtype. One fused torch kernel each way (`torch.native_layer_norm`
      and its backward on the raw walk). Source: tf.keras.layers.LayerNormalization(axis=-1).

    Raises:
      TypeError: gamma/beta of another dtype than x (float32 ones with a
        half-precision x are fine).
    """
    try:
        y, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), gamma, beta, epsilon)
        return y, (mean, rstd)  # the statistics go to the record: the rule's kernel takes them (as torch saves them)
    except RuntimeError:  # dtypes checked only on failure (half x with float32 gamma/beta is fine)
        if gamma.dtype != beta.dtype or gamma.dtype not in (x.dtype, torch.float32):
            raise TypeError(f"layer_norm: x is {x.dtype}, gamma {gamma.dtype}, beta {beta.dtype}; give gamma "
                            f"and beta x's dtype: dtape.cast(gamma, {x.dtype})") from None
        raise


@layer_norm.grad
def _(dy, ans, x, gamma, beta, epsilon=1e-3, needs=(True, True, True), stash=None):
    if isinstance(dy, torch.Tensor):  # raw walk: torch's fused kernel, with the forward's mean and 1/std
        return _layer_norm_kernel(dy, x, gamma, beta, epsilon, needs, stash)
    # recorded walk: the kernel's bits (a walk's result must not depend on whether a tape records it)
    values = _layer_norm_kernel(dy.torch(), x.torch(), gamma.torch(), beta.torch(), epsilon, needs, stash)
    centred = x - torch.mean(x, dim=-1, keepdim=True)
    rstd = torch.rsqrt(torch.mean(centred * centred, dim=-1, keepdim=True) + epsilon)
    xhat = centred * rstd
    g = dy * gamma
    d = x.shape[-1]
    grads = (lambda: rstd * (g - torch.mean(g, dim=-1, keepdim=True) - xhat * torch.mean(g * xhat, dim=-1, keepdim=True)),
             lambda: torch.sum(torch.reshape(dy * xhat, (-1, d)), dim=0),
             lambda: torch.sum(torch.reshape(dy, (-1, d)), dim=0))
    return tuple(kernel_value(f(), v) if need else None for f, v, need in zip(grads, values, needs))


def _layer_norm_kernel(dy, x, gamma, beta, epsilon, needs, stash):
    """(dx, dgamma, dbeta) from torch's kernel on torch tensors, with the forward's mean and 1/std."""
    shape = (x.shape[-1],)
    mean, rstd = stash if stash is not None else torch.native_layer_norm(x, shape, gamma, beta, epsilon)[1:]
    # dy in x's dtype: the walk widens a half-precision dy next to float32 weights (autocast)
    return torch.ops.aten.native_layer_norm_backward.default(dy.to(x.dtype), x, shape, mean, rstd, gamma, beta, list(needs))


def embedding_lookup(params, ids, max_norm=None, name=None):
    """Rows of `params` at `ids` (tf.gather on axis 0).

    Args:
      params: tensor [vocab, dims...], or a list holding one such tensor.
      ids: int tensor [i...] with values in [0, vocab).
      max_norm: unsupported (must be None).

    Returns:
      [i..., dims...], params' dtype.

    Raises:
      NotImplementedError: for sharded params (a list of several) or max_norm.

    Source: tf.nn.embedding_lookup.
    """
    if isinstance(params, (list, tuple)):
        if len(params) != 1:
            raise NotImplementedError("embedding_lookup: sharded params (a list of several tensors) are not "
                                      "supported; concatenate them with dtape.concat first")
        params = params[0]
    if max_norm is not None:
        raise NotImplementedError("embedding_lookup: max_norm is not supported")
    return gather(params, ids, axis=0)
