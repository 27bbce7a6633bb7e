"""Learning-rate schedules: ExponentialDecay, CosineDecay (with warm-up), PiecewiseConstantDecay.

A schedule is called with the optimizer's step (its `iterations` before the
update) and returns the learning rate: a Python float for a Python (or
numpy) number, and for a tensor step (what an optimizer passes while a
compiled step is traced) a float64 scalar torch.Tensor computed with torch
ops on its device, never read on the host, so the schedule is part of the
graph. Both give the same value up to float64 rounding. Pass one as
`learning_rate=` to any optimizer; also reachable as
`dtape.optimizers.schedules`.
Source: tf.keras.optimizers.schedules (Keras 3 formulas).
"""
import math

import torch

__all__ = ["LearningRateSchedule", "ExponentialDecay", "CosineDecay", "PiecewiseConstantDecay"]


def _positive(value, what):
    value = float(value)
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}")
    return value


def _step(step):
    """A Python float step, or a tensor step (torch or dtape) as a float64 torch scalar (no host read)."""
    if hasattr(step, "torch"):
        step = step.torch()
    if isinstance(step, torch.Tensor):
        return step.to(torch.float64)
    return float(step.numpy()) if hasattr(step, "numpy") else float(step)


def _floor(x):
    return torch.floor(x) if isinstance(x, torch.Tensor) else math.floor(x)


def _cos(x):
    return torch.cos(x) if isinstance(x, torch.Tensor) else math.cos(x)


def _minimum(x, bound):
    return torch.clamp(x, max=bound) if isinstance(x, torch.Tensor) else min(x, bound)


class LearningRateSchedule:
    """Base class: `__call__(step) -> float` (a float64 scalar tensor for a tensor step: see the module
    docstring; a subclass traced in a compiled step must compute with torch ops on it, not read it).
    Source: tf.keras.optimizers.schedules.LearningRateSchedule."""

    def __call__(self, step):
        raise NotImplementedError(f"{type(self).__name__} must define __call__(step)")

    def get_config(self):
        return {}


class ExponentialDecay(LearningRateSchedule):
    """`initial_learning_rate * decay_rate ** (step / decay_steps)` (the exponent floored if `staircase`).

    Args:
      initial_learning_rate: float.
      decay_steps: number > 0.
      decay_rate: float.
      staircase: decay in whole intervals of decay_steps.

    Source: tf.keras.optimizers.schedules.ExponentialDecay.
    """

    def __init__(self, initial_learning_rate, decay_steps, decay_rate, staircase=False, name="ExponentialDecay"):
        self.initial_learning_rate = float(initial_learning_rate)
        self.decay_steps = _positive(decay_steps, "decay_steps")
        self.decay_rate = float(decay_rate)
        self.staircase = bool(staircase)
        self.name = name

    def __call__(self, step):
        p = _step(step) / self.decay_steps
        if self.staircase:
            p = _floor(p)
        return self.initial_learning_rate * self.decay_rate ** p


class CosineDecay(LearningRateSchedule):
    """Optional linear warm-up, then cosine decay to `alpha` times the peak.

    Without warmup_target: `lr0 * ((1 - alpha) * 0.5 * (1 + cos(pi * min(step, decay_steps) / decay_steps)) + alpha)`.
    With warmup_target: for step < warmup_steps, linear from
    `initial_learning_rate` to `warmup_target`; then the cosine decay of
    `warmup_target` over `step - warmup_steps` (step capped at
    decay_steps + warmup_steps).

    Args:
      initial_learning_rate: float (the start of warm-up, or the peak without it).
      decay_steps: number > 0 of decay steps (after warm-up).
      alpha: the floor, as a fraction of the peak.
      warmup_target: the peak reached after warm-up, or None for no warm-up.
      warmup_steps: number of warm-up steps (>= 0).

    Source: tf.keras.optimizers.schedules.CosineDecay (Keras 3).
    """

    def __init__(self, initial_learning_rate, decay_steps, alpha=0.0, name="CosineDecay", warmup_target=None,
                 warmup_steps=0):
        self.initial_learning_rate = float(initial_learning_rate)
        self.decay_steps = _positive(decay_steps, "decay_steps")
        self.alpha = float(alpha)
        self.warmup_target = None if warmup_target is None else float(warmup_target)
        self.warmup_steps = float(warmup_steps)
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps!r}")
        self.name = name

    def _decay(self, step, peak):
        cosine = 0.5 * (1.0 + _cos(math.pi * step / self.decay_steps))
        return peak * ((1.0 - self.alpha) * cosine + self.alpha)

    def __call__(self, step):
        step = _step(step)
        if self.warmup_target is None:
            return self._decay(_minimum(step, self.decay_steps), self.initial_learning_rate)
        step = _minimum(step, self.decay_steps + self.warmup_steps)
        decayed = self._decay(step - self.warmup_steps, self.warmup_target)
        if not self.warmup_steps:
            return decayed
        delta = self.warmup_target - self.initial_learning_rate
        warm = delta * step / self.warmup_steps + self.initial_learning_rate
        if isinstance(step, torch.Tensor):  # both branches computed, one selected: no host decision
            return torch.where(step < self.warmup_steps, warm, decayed)
        return warm if step < self.warmup_steps else decayed


class PiecewiseConstantDecay(LearningRateSchedule):
    """`values[0]` while step <= boundaries[0], `values[i]` while boundaries[i-1] < step <= boundaries[i],
    `values[-1]` after the last boundary.

    Args:
      boundaries: increasing list of n step numbers.
      values: list of n + 1 floats.

    Raises:
      ValueError: len(values) != len(boundaries) + 1, or boundaries not increasing.

    Source: tf.keras.optimizers.schedules.PiecewiseConstantDecay.
    """

    def __init__(self, boundaries, values, name="PiecewiseConstant"):
        self.boundaries = [float(b) for b in boundaries]
        self.values = [float(v) for v in values]
        if len(self.values) != len(self.boundaries) + 1:
            raise ValueError(f"The length of boundaries should be 1 less than the length of values: got "
                             f"{len(self.boundaries)} boundaries and {len(self.values)} values")
        if any(b >= c for b, c in zip(self.boundaries, self.boundaries[1:])):
            raise ValueError(f"boundaries must be strictly increasing, got {list(boundaries)}")
        self.name = name

    def __call__(self, step):
        step = _step(step)
        if isinstance(step, torch.Tensor):  # selected from the last interval down: no host decision
            out = torch.full_like(step, self.values[-1])
            for boundary, value in reversed(list(zip(self.boundaries, self.values))):
                out = torch.where(step <= boundary, torch.full_like(step, value), out)
            return out
        for boundary, value in zip(self.boundaries, self.values):
            if step <= boundary:
                return value
        return self.values[-1]
