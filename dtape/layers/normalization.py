"""Normalization layers: LayerNormalization, BatchNormalization (synchronized across replicas).

Source: tf.keras.layers (keras/layers/normalization).
"""
import math

import torch

from dtape import _replica_info
from dtape import nn as _nn
from dtape import tape as _tp
from dtape.custom_gradient import custom_gradient
from dtape.ops import array_ops as _array
from dtape.ops import math_ops as _math
from dtape.tensor import Tensor
from dtape.variables import VariableAggregation
from dtape.layers.base import Layer, last_dim


class LayerNormalization(Layer):
    """Normalises the last axis: `gamma * (x - mean) / sqrt(var + epsilon) + beta`.

    Args:
      epsilon: added to the variance.
      input_dim: size d of the last axis; when given, the variables are created now.
      name, dtype, seed: see `Layer`.

    Variables: `gamma` [d] (ones), `beta` [d] (zeros).
    Shapes: x [..., d] -> [..., d].
    Source: tf.keras.layers.LayerNormalization(axis=-1).
    """

    supports_masking = True  # elementwise along the steps: a mask passes through (Keras)

    _autocast = False  # a mixed policy keeps gamma and beta in float32: 16-bit inputs, float32 statistics

    def __init__(self, epsilon=1e-3, input_dim=None, name=None, dtype=None, seed=None, input_shape=None):
        super().__init__(name=name, dtype=dtype, seed=seed, input_shape=input_shape)
        self.epsilon = float(epsilon)
        if input_dim is not None:
            self._maybe_build((None, int(input_dim)))

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def build(self, input_shape):
        d = last_dim(input_shape, self)
        self.gamma = self.add_weight("gamma", (d,), "ones")
        self.beta = self.add_weight("beta", (d,), "zeros")

    def call(self, x):
        return _nn.layer_norm(x, self.gamma, self.beta, epsilon=self.epsilon)


def _local_moments(x, axes):
    """Mean and (population) variance of x over `axes`, and the example count (a Python int).

    An empty x (count 0) gets zeros, not NaN: its output is empty anyway, and
    finite statistics keep its gradient contributions (to gamma, beta) zero.
    """
    count = math.prod(x.shape[a] for a in axes)
    if count == 0:
        zeros = Tensor(torch.zeros([x.shape[a] for a in range(x.ndim) if a not in axes], dtype=x.dtype,
                                   device=x.device))
        return zeros, zeros, 0
    mean, var = _nn.moments(x, axes)
    return mean, var, count


def _sync_moments(x, axes, ctx):
    """Mean and (population) variance of x over `axes` and over every replica's x (one all-reduce), and the count.

    Keras 3's synchronized formula: sums of x and x^2 and the count are
    all-reduced (SUM), mean = sum / count, var = max(sum_sq / count - mean^2, 0).
    The gradient is exact for the global batch: each replica's cotangents of
    mean and var are all-reduced too (the transpose of the all-reduce), so
    summing the replicas' gradients equals one device on the whole batch.
    Every replica must then compute gradients (tape.gradient) in step.
    A replica with an empty batch adds zeros; an empty global batch gives
    mean = var = 0 (count 0), not NaN. The count is a Python int on one
    replica, else the all-reduced scalar Tensor (identical on every replica).
    """
    replicas = 1 if ctx is None else ctx.num_replicas_in_sync
    counted = []

    @custom_gradient
    def moments(x):
        count = float(math.prod(x.shape[a] for a in axes))
        sums = [_math.reduce_sum(x, axis=axes), _math.reduce_sum(x * x, axis=axes),
                Tensor(torch.tensor(count, dtype=x.dtype, device=x.device))]
        if replicas > 1:
            sums = ctx.all_reduce("sum", sums)
        counted.append(sums[2] if replicas > 1 else int(count))
        total = _math.maximum(sums[2], 1.0)  # an empty global batch: zeros, not 0 / 0
        mean = sums[0] / total
        var = _math.maximum(sums[1] / total - mean * mean, 0.0)

        def grad(dmean, dvar):
            if replicas > 1:
                dmean, dvar = ctx.all_reduce("sum", [dmean, dvar])
            return (dmean + 2.0 * dvar * (x - mean)) / total
        return (mean, var), grad
    mean, var = moments(x)
    return mean, var, counted[0]


class BatchNormalization(Layer):
    """Normalises with batch statistics in training and moving statistics in inference.

    training=True: mean, var = moments of x over every axis but `axis`
    (population variance); y = gamma * (x - mean) / sqrt(var + epsilon) + beta;
    moving_mean = momentum * moving_mean + (1 - momentum) * mean, likewise
    moving_variance with var (Keras: the biased variance; torch's BatchNorm
    uses the unbiased one and momentum = 1 - Keras momentum).
    training=False: the moving statistics instead of the batch's.
    A frozen layer (`trainable = False`) runs as with training=False
    whatever `training` is, and leaves its moving statistics (Keras 2 / TF 2).

    Under a strategy: with synchronized=True the statistics are those of the
    global batch (sums all-reduced across replicas, as PyTorch's
    SyncBatchNorm), so 2 replicas compute what one device computes on the
    whole batch, gradients included (every replica must call tape.gradient
    in step). With synchronized=False each replica uses its own batch. The
    moving statistics are non-trainable variables with aggregation MEAN,
    updated with the same value on every replica so the mirrored copies stay
    identical: the global batch's statistics (synchronized=True), or the
    replicas' statistics weighted by their example counts (False; the
    moving mean is then the global batch's mean).
    An empty batch (API.md: a short or empty last batch on some replicas)
    gives an empty output, zero gradients to gamma and beta, and no NaN; it
    adds nothing to the moving statistics, which stay unchanged when the
    whole (global) batch is empty.

    Args:
      axis: the feature axis (default -1, channels last).
      momentum: of the moving statistics (0.99).
      epsilon: added to the variance (1e-3).
      center, scale: use beta / gamma.
      beta_initializer, gamma_initializer, moving_mean_initializer,
        moving_variance_initializer: names or callables.
      synchronized: batch statistics across replicas (Keras 3 name).
      name, dtype, seed, input_shape: see `Layer`.

    Variables: `gamma`, `beta` [d] (trainable), `moving_mean`,
    `moving_variance` [d] (non-trainable). Shapes: x [..., d, ...] -> same.
    Source: tf.keras.layers.BatchNormalization (Keras 3, synchronized=).
    """

    _autocast = False  # a mixed policy keeps gamma, beta and the moving statistics in float32, as Keras

    def __init__(self, axis=-1, momentum=0.99, epsilon=1e-3, center=True, scale=True, beta_initializer="zeros",
                 gamma_initializer="ones", moving_mean_initializer="zeros", moving_variance_initializer="ones",
                 synchronized=False, name=None, dtype=None, seed=None, input_shape=None,
                 beta_regularizer=None, gamma_regularizer=None):
        super().__init__(name=name, dtype=dtype, seed=seed, input_shape=input_shape)
        self.axis, self.momentum, self.epsilon = int(axis), float(momentum), float(epsilon)
        if not 0.0 <= self.momentum <= 1.0 or not self.epsilon > 0:
            raise ValueError(f"BatchNormalization needs 0 <= momentum <= 1 and epsilon > 0, got "
                             f"momentum={momentum}, epsilon={epsilon}")
        self.center, self.scale, self.synchronized = bool(center), bool(scale), bool(synchronized)
        self._inits = (beta_initializer, gamma_initializer, moving_mean_initializer, moving_variance_initializer)
        self._regs = (beta_regularizer, gamma_regularizer)

    def _feature_axis(self, rank):
        axis = self.axis + rank if self.axis < 0 else self.axis
        if not 0 <= axis < rank:
            raise ValueError(f"{self.name}: axis {self.axis} is out of range for inputs of rank {rank}")
        return axis

    def build(self, input_shape):
        axis = self._feature_axis(len(input_shape))
        d = input_shape[axis]
        if d is None:
            raise ValueError(f"{self.name}: the feature axis {self.axis} must be known, got shape {input_shape}")
        beta_init, gamma_init, mean_init, var_init = self._inits
        if self.scale:
            self.gamma = self.add_weight("gamma", (d,), gamma_init, regularizer=self._regs[1])
        if self.center:
            self.beta = self.add_weight("beta", (d,), beta_init, regularizer=self._regs[0])
        self.moving_mean = self.add_weight("moving_mean", (d,), mean_init, trainable=False,
                                           aggregation=VariableAggregation.MEAN)
        self.moving_variance = self.add_weight("moving_variance", (d,), var_init, trainable=False,
                                               aggregation=VariableAggregation.MEAN)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def call(self, x, training=False):
        in_dtype = x.dtype
        if in_dtype in (torch.float16, torch.bfloat16):  # statistics of 16-bit inputs in float32 (Keras)
            x = _array.cast(x, torch.float32)
        rank = x.ndim
        axis = self._feature_axis(rank)
        axes = [a for a in range(rank) if a != axis]
        if training and self.trainable:  # frozen: inference mode even in training (Keras 2 / TF 2)
            ctx = _replica_info.replica_context()
            if self.synchronized:
                mean, var, count = _sync_moments(x, axes, ctx)
            else:
                mean, var, count = _local_moments(x, axes)
            self._update_moving(mean, var, count, ctx)
        else:
            mean, var = self.moving_mean, self.moving_variance
        shape = [1] * rank
        shape[axis] = -1
        inv = _math.rsqrt(_array.reshape(var, shape) + self.epsilon)
        if self.scale:
            inv = inv * _array.reshape(self.gamma, shape)
        y = (x - _array.reshape(mean, shape)) * inv
        y = y + _array.reshape(self.beta, shape) if self.center else y
        return y if x.dtype == in_dtype else _array.cast(y, in_dtype)  # 16-bit in: 16-bit out

    def _update_moving(self, mean, var, count, ctx):
        """moving = momentum * moving + (1 - momentum) * stat, each replica weighted by its example count.

        `count` is this replica's (synchronized=False) or the global batch's
        (synchronized=True, stats already global) number of examples. Across
        replicas, synchronized=False all-reduces (SUM) count * stat and count,
        so the update uses the count-weighted mean of the replicas' statistics
        (an empty replica adds nothing) and every replica writes the same value.
        No examples in total: no update (skipped at once when the count is a
        Python number, else the update keeps the old value, so every replica
        still makes the same assign calls).
        """
        with _tp.stop_recording():
            dtype = self.moving_mean.dtype
            mean, var = mean.torch().to(dtype), var.torch().to(dtype)
            replicas = 1 if ctx is None else ctx.num_replicas_in_sync
            count = count.torch() if isinstance(count, Tensor) else count
            if not self.synchronized and replicas > 1:
                n = torch.tensor(float(count), dtype=dtype, device=mean.device)
                sums = ctx.all_reduce("sum", [Tensor(mean * n), Tensor(var * n), Tensor(n)])
                count = sums[2].torch()
                mean, var = (t.torch() / torch.clamp(count, min=1.0) for t in sums[:2])
            if isinstance(count, (int, float)) and count == 0:
                return
            m = self.momentum
            for moving, batch in ((self.moving_mean, mean), (self.moving_variance, var)):
                old = moving.torch()
                new = old * m + batch.to(old.device) * (1.0 - m)
                if isinstance(count, torch.Tensor):
                    new = torch.where(count.to(old.device) > 0, new, old)
                moving.assign(Tensor(new))
