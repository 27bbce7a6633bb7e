"""Mixed precision: dtype policies, dynamic loss scaling (`LossScaleOptimizer`) and `torch.autocast` with dtape.

Policies, as Keras's: `set_global_policy("mixed_float16")` (or
"mixed_bfloat16", or back to "float32") before the model is made, or a
layer's `dtype="mixed_float16"`: its variables are float32, its floating
inputs are cast to float16 (bfloat16) and, inside its `call`, its variables
are read in that dtype, so it computes and returns float16 while its
gradients and updates stay float32. LayerNormalization and
BatchNormalization keep float32 parameters and statistics and return the
input's dtype. Give the output layer `dtype="float32"` (its 16-bit inputs are
cast up) for a float32 softmax and loss, and wrap the optimizer in
`LossScaleOptimizer` under mixed_float16 (float16's range is small).

Autocast: run the forward pass under `torch.autocast` as in PyTorch; the
tape records the ops autocast lowers (matmul, conv2d, ... in float16 or
bfloat16), and `tape.gradient` (inside or outside the autocast block)
returns every gradient in its source's dtype, so float32 variables get
float32 gradients and the optimizer updates them in float32:

    with dtape.GradientTape() as tape:
        with torch.autocast("cuda", dtype=torch.float16):   # or ("cpu", dtype=torch.bfloat16)
            logits = model(x)
        loss = dtape.reduce_mean(loss_fn(y, dtape.cast(logits, torch.float32)))
        scaled = opt.get_scaled_loss(loss)                   # float16 needs loss scaling
    grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
    opt.apply_gradients(zip(grads, model.trainable_variables))

Replica threads of `MirroredStrategy.run` inherit the caller's autocast
state. bfloat16 has float32's range and normally needs no loss scaling;
float16 does.
Source: tf.keras.mixed_precision (LossScaleOptimizer), torch.autocast.
"""
import functools
import math

import torch

from dtape import distribute
from dtape._policy import Policy, global_policy, set_global_policy
from dtape import tape as _tp
from dtape.optimizers import Optimizer
from dtape.tensor import Tensor, convert_to_tensor, is_tracing, is_variable

__all__ = ["LossScaleOptimizer", "Policy", "set_global_policy", "global_policy"]


class LossScaleOptimizer(Optimizer):
    """Wraps an optimizer with (dynamic) loss scaling.

    `get_scaled_loss(loss)` multiplies the loss by the scale;
    `get_unscaled_gradients(grads)` divides the gradients by it; then
    `apply_gradients` (after the cross-replica aggregation, so every replica
    decides alike) checks that every gradient is finite:
      * finite: the inner optimizer applies them (its clipping included);
        with dynamic scaling, after `dynamic_growth_steps` finite steps in a
        row the scale doubles (if the doubled scale is finite);
      * not finite: the step is skipped (the variables and slots keep their
        values; `iterations` still counts it, as TF), the scale halves
        (never below 1) and the count of good steps restarts.

    Args:
      inner_optimizer: the Optimizer to wrap.
      dynamic: adjust the scale (True) or keep `initial_scale` fixed.
      initial_scale: starting scale (default 2**15 when dynamic).
      dynamic_growth_steps: finite steps before the scale doubles (default 2000).

    Create it inside `strategy.scope()` under a strategy: the scale and the
    counter are variables mirrored like the model's (and saved by
    `dtape.checkpoint` with the optimizer's `variables()`).

    Raises:
      TypeError: inner_optimizer is not a dtape Optimizer.
      ValueError: a non-positive scale or growth step count; dynamic=False
        without initial_scale.

    Source: tf.keras.mixed_precision.LossScaleOptimizer (TF 2 API: the user
    unscales with get_unscaled_gradients).
    """

    def __init__(self, inner_optimizer, dynamic=True, initial_scale=None, dynamic_growth_steps=None):
        if not isinstance(inner_optimizer, Optimizer) or isinstance(inner_optimizer, LossScaleOptimizer):
            raise TypeError(f"LossScaleOptimizer wraps a dtape optimizer (SGD, Adam, ...), got "
                            f"{type(inner_optimizer).__name__}")
        if not dynamic and initial_scale is None:
            raise ValueError("initial_scale must be given when dynamic=False")
        if dynamic_growth_steps is not None and not dynamic:
            raise ValueError("dynamic_growth_steps applies only to dynamic=True")
        scale = 2.0 ** 15 if initial_scale is None else float(initial_scale)
        if not scale > 0 or not math.isfinite(scale):
            raise ValueError(f"initial_scale must be a finite number > 0, got {initial_scale!r}")
        growth = 2000 if dynamic_growth_steps is None else int(dynamic_growth_steps)
        if growth < 1:
            raise ValueError(f"dynamic_growth_steps must be >= 1, got {dynamic_growth_steps!r}")
        self._inner = inner_optimizer
        self.name = f"LossScaleOptimizer/{inner_optimizer.name}"
        self.dynamic, self.initial_scale, self.dynamic_growth_steps = bool(dynamic), scale, growth
        self._loss_scale = self._make_variable(scale, torch.float32, None, "loss_scale")
        self._counter = self._make_variable(0, torch.int64, None, "dynamic_counter")

    # -- delegation -------------------------------------------------------------
    @property
    def inner_optimizer(self):
        return self._inner

    @property
    def iterations(self):
        return self._inner.iterations

    @property
    def learning_rate(self):
        return self._inner.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        self._inner.learning_rate = value

    def build(self, var_list):
        """The inner optimizer's slots (see Optimizer.build)."""
        return self._inner.build(var_list)

    def variables(self):
        """The inner optimizer's variables, then the loss scale and the dynamic counter."""
        return self._inner.variables() + [self._loss_scale, self._counter]

    def _checkpoint_variables(self):
        """What a checkpoint matches by position (see Optimizer._checkpoint_variables)."""
        return self._inner._checkpoint_variables() + [self._loss_scale, self._counter]

    def _checkpoint_children(self):
        """The inner optimizer's learning-rate variable (see Optimizer._checkpoint_children)."""
        return self._inner._checkpoint_children()

    def _checkpoint_slots(self):
        """The inner optimizer's slots and their variables (see Optimizer._checkpoint_slots)."""
        return self._inner._checkpoint_slots()

    # -- scaling ----------------------------------------------------------------
    @property
    def loss_scale(self):
        """The current loss scale as a float32 scalar Tensor."""
        return Tensor(self._loss_scale.torch().clone())

    @property
    def dynamic_counter(self):
        """Finite steps since the scale last changed (an int64 scalar Tensor)."""
        return Tensor(self._counter.torch().clone())

    def _scale_like(self, x):
        return Tensor(self._loss_scale.torch().to(dtype=x.dtype, device=x.device))

    def get_scaled_loss(self, loss):
        """`loss * loss_scale` (a callable loss gives a callable). Same dtype and device as loss."""
        if callable(loss):
            return lambda: self.get_scaled_loss(loss())
        loss = convert_to_tensor(loss) if not is_variable(loss) else loss._dtape_read()
        return loss * self._scale_like(loss)

    def get_unscaled_gradients(self, grads):
        """Each gradient times `1 / loss_scale` (None stays None); same dtypes and devices."""
        out = []
        for g in grads:
            if g is None:
                out.append(None)
                continue
            g = convert_to_tensor(g)
            recip = Tensor((1.0 / self._loss_scale.torch()).to(dtype=g.dtype, device=g.device))
            out.append(g * recip)
        return out

    # -- the step -----------------------------------------------------------------
    def _distributed_apply(self, strategy, pairs):
        """Cross-replica, gradients aggregated: apply if all finite, then update the scale.

        Eager: one host read decides. While tracing (a compiled step) there is
        no host decision: the inner update runs and each value it wrote keeps
        its new value only where the gradients were finite (torch.where over
        the variables and the slots), as a graph conditional would.
        """
        if is_tracing():
            return self._traced_apply(strategy, pairs)
        finite = _all_finite([g for g, _ in pairs])
        with _tp.stop_recording():
            if finite:
                self._inner._distributed_apply(strategy, pairs)
            else:
                self._inner.iterations.assign_add(1)
            if self.dynamic:
                self._update_scale(finite)
        return self.iterations

    def _traced_apply(self, strategy, pairs):
        finite = _finite_flag([g for g, _ in pairs])
        with _tp.stop_recording():
            self._inner.build([v for _, v in pairs])  # the slots exist before their values are kept
            written = _components([v for _, v in pairs] + self._inner._checkpoint_variables()[1:])  # slots: not iterations
            before = [c.torch() for c in written]  # held: the update then writes copies, these stay intact
            self._inner._distributed_apply(strategy, pairs)
            for c, old in zip(written, before):
                c._update_value(functools.partial(_keep_if, finite, old), "loss-scale skip")
            if self.dynamic:
                self._update_scale(finite)
        return self.iterations

    def _update_scale(self, finite):
        """Halves the scale (not below 1) after a non-finite step, doubles it after `dynamic_growth_steps`
        finite ones (if finite): torch ops on the scale and counter variables, no host read."""
        scale = self._loss_scale.read_value().torch()
        count = self._counter.read_value().torch() + 1
        finite = torch.as_tensor(finite).to(scale.device)
        grown = (count >= self.dynamic_growth_steps).to(scale.device)
        doubled = scale * 2.0
        kept = torch.where(grown & torch.isfinite(doubled), doubled, scale)
        self._loss_scale.assign(torch.where(finite, kept, torch.clamp(scale / 2.0, min=1.0)))
        self._counter.assign(torch.where(finite.to(count.device) & ~grown.to(count.device), count,
                                         torch.zeros_like(count)))


def _keep_if(finite, old, current):
    return torch.where(finite.to(current.device), current, old)


def _components(variables):
    out = []
    for v in variables:
        out.extend(v.values if isinstance(v, distribute.DistributedValues) else (v,))
    return out


def _finite_flag(grads):
    """A bool scalar tensor: every (first copy of an aggregated) floating gradient is finite (one decision
    for all replicas)."""
    checks = []
    for g in grads:
        if isinstance(g, distribute.DistributedValues):
            g = g.values[0]
        t = convert_to_tensor(g).torch()
        if t.is_floating_point() or t.is_complex():
            checks.append(torch.isfinite(t).all().to("cpu"))
    return torch.stack(checks).all() if checks else torch.tensor(True)


def _all_finite(grads):
    """The one host decision of an eager step (see `_finite_flag`)."""
    return bool(_finite_flag(grads))
