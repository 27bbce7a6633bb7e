"""Sample inputs for the registry-driven gradient test (float64, CPU).

Each sampler takes a torch.Generator and returns a list of `(args, attrs)`;
tensor arguments are float64 torch tensors, attrs a dict.
"""
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
