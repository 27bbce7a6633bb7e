"""Sample inputs for the registry-driven gradient test (float64, CPU).

Each sampler takes a torch.Generator and returns a list of `(args, attrs)`;
tensor arguments are float64 torch tensors, attrs a dict.
"""
import math

import torch

SHAPES_BINARY = [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 4), (3, 1)), ((), (2, 3)), ((2, 3), ())]


def randn(rng, *shape):
    return torch.randn(shape, generator=rng, dtype=torch.float64)


def positive(rng, *shape):
    return torch.rand(shape, generator=rng, dtype=torch.float64) + 0.5


def away_from_zero(rng, *shape):
    x = randn(rng, *shape)
    return x + 0.3 * torch.sign(x)


def unary(rng):
    return [((away_from_zero(rng, 3, 4),), {}), ((randn(rng, 2, 3, 2),), {})]


def unary_positive(rng):
    return [((positive(rng, 3, 4),), {})]


def binary(rng):
    return [((randn(rng, *a), randn(rng, *b)), {}) for a, b in SHAPES_BINARY]


def binary_distinct(rng):
    """Broadcasting pairs whose elements never tie (for max/min-like ops)."""
    out = []
    for a, b in SHAPES_BINARY:
        x = randn(rng, *a)
        out.append(((x, randn(rng, *b) + 0.05), {}))
    return out


def binary_positive(rng):
    return [((positive(rng, *a), positive(rng, *b)), {}) for a, b in SHAPES_BINARY]


def reduction(rng):
    x = away_from_zero(rng, 2, 3, 4)
    return [((x,), {}), ((x,), {"axis": 1}), ((x,), {"axis": (0, 2), "keepdims": True}),
            ((x,), {"axis": -1, "keepdims": False}), ((x,), {"axis": ()})]


class Special(tuple):
    """A sample at a special point: `(args, attrs)` (it unpacks as any sample) and `what` it probes.

    Ties, zeros, NaN and crossed bounds are where rules go wrong silently,
    and where finite differences do not hold (a kink, a NaN): the registry
    test compares these with torch.autograd's own rule at the same point.
    """

    def __new__(cls, args, attrs, what):
        self = super().__new__(cls, (args, attrs))
        self.what = what
        return self


def tensor(*values):
    return torch.tensor(values, dtype=torch.float64)


def extremes_special(rng):
    """Ties (two-, three- and four-way, for max and min) and NaN for reduce_max/min."""
    ties = torch.stack([tensor(3.0, 1.0, 3.0, 1.0), tensor(2.0, 2.0, 2.0, 2.0), tensor(-1.0, 0.5, 0.5, 0.5)])
    nan = torch.stack([tensor(0.5, math.nan, -1.0, 2.0), tensor(1.0, 0.0, 1.0, -1.0)])
    return [Special((ties,), {}, "ties"), Special((ties,), {"axis": 1}, "ties"),
            Special((ties,), {"axis": 0, "keepdims": True}, "ties"),
            Special((nan,), {"axis": -1}, "nan"), Special((nan,), {}, "nan")]
