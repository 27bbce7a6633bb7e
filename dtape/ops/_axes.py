"""Axis arguments of the TF-named ops: one reading, one range check, one message.

TF accepts an axis as a Python int, a numpy integer or an integer tensor
(0-d, or 1-d for the ops that take several), and refuses one outside the
tensor's dimensions. torch wraps some (gather's `axis % rank`) and reports
others in its own words, so every axis-taking op reads its axes here.
"""
import operator

import numpy as np
import torch

from dtape.tensor import Tensor, is_variable

__all__ = ["AxisError", "axis_values", "canonical_axis", "reduction_axes", "permutation"]


class AxisError(ValueError, IndexError):
    """An axis outside a tensor's dimensions (numpy's AxisError: both a ValueError, as TF's
    InvalidArgumentError is one, and the IndexError torch raises)."""


def _as_int(a, op, what):
    if isinstance(a, (bool, np.bool_)):  # True is an int to Python, never an axis to TF
        raise TypeError(f"{op}: {what} must be an integer, got {a!r}")
    try:
        return operator.index(a)
    except TypeError:
        raise TypeError(f"{op}: {what} must be an integer (Python or numpy int, or an integer tensor), "
                        f"got {type(a).__name__} {a!r:.60}") from None


def axis_values(axis, op, what="axis"):
    """`axis` as a Python int, or a tuple of them for a sequence or a 1-d tensor.

    Accepts Python and numpy integers, sequences of them, numpy arrays and
    torch or dtape integer tensors (variables are read).
    """
    if is_variable(axis):
        axis = axis._dtape_read()
    if isinstance(axis, Tensor):
        axis = axis.torch()
    if isinstance(axis, (torch.Tensor, np.ndarray)):
        integer = (not axis.dtype.is_floating_point and not axis.dtype.is_complex and axis.dtype != torch.bool
                   if isinstance(axis, torch.Tensor) else axis.dtype.kind in "iu")
        if not integer:
            raise TypeError(f"{op}: {what} must be of an integer dtype, got {axis.dtype}")
        if axis.ndim > 1:
            raise ValueError(f"{op}: {what} must be a scalar or a 1-D list of ints, got shape {tuple(axis.shape)}")
        axis = axis.tolist()
        return axis if isinstance(axis, int) else tuple(int(a) for a in axis)
    if isinstance(axis, (list, tuple)):
        return tuple(_as_int(a, op, what) for a in axis)
    return _as_int(axis, op, what)


def canonical_axis(axis, ndim, op, what="axis", inserts=False):
    """One axis of a tensor of `ndim` dimensions as an int in [0, rank).

    rank is ndim, or ndim + 1 for ops inserting a dimension at the axis
    (expand_dims, stack, one_hot: -1 is the new last one).

    Raises:
      AxisError: an axis outside [-rank, rank) (none for a 0-d tensor, as TF); TypeError: not an integer.
    """
    rank = ndim + 1 if inserts else ndim
    a = axis_values(axis, op, what)
    if isinstance(a, tuple):
        raise TypeError(f"{op}: {what} must be a single integer, got {axis!r:.60}")
    if not -rank <= a < rank:
        raise AxisError(f"{op}: {what} {a} is out of range for a tensor of rank {ndim}; "
                        + (f"{what} must be in [{-rank}, {rank - 1}]" if rank else "a 0-d tensor has no axis"))
    return a % rank


def reduction_axes(ndim, axis, op="reduce"):
    """`axis` (None, int, sequence or integer tensor; negative counts from the end) as sorted non-negative axes.

    A 0-d tensor has no axis to reduce (TF: "Invalid reduction dimension (0
    for input with 0 dimension(s))"); torch would take 0 and -1.

    Raises:
      AxisError: an axis outside [-ndim, ndim), or one named twice (TF:
        "Axes contains duplicate dimension").
    """
    if axis is None:
        return tuple(range(ndim))
    axes = axis_values(axis, op)
    axes = (axes,) if isinstance(axes, int) else axes
    for a in axes:
        if not -ndim <= a < ndim:
            raise AxisError(f"{op}: axis {a} is out of range for a tensor of rank {ndim}; "
                            + (f"axes must be in [{-ndim}, {ndim - 1}]" if ndim else
                               "a 0-d tensor has no axis to reduce (pass axis=None or axis=[])"))
    canon = [a % ndim for a in axes]
    if len(set(canon)) != len(canon):
        raise AxisError(f"{op}: axes {list(axes)} contain a duplicate dimension (for a tensor of rank {ndim}, "
                        f"axis a and a - {ndim} are the same); name each axis once")
    return tuple(sorted(canon))


def permutation(perm, ndim, op="transpose"):
    """`perm` as a list of non-negative ints, checked to be a permutation of range(ndim)."""
    p = axis_values(perm, op, "perm")
    p = [p] if isinstance(p, int) else list(p)
    if len(p) != ndim:
        raise ValueError(f"{op}: perm {p} has {len(p)} entries for a tensor of rank {ndim}; give one per dimension")
    for a in p:
        if not -ndim <= a < ndim:
            raise AxisError(f"{op}: perm entry {a} is out of range for a tensor of rank {ndim}; "
                            f"entries must be in [{-ndim}, {ndim - 1}]")
    canon = [a % ndim for a in p]
    if sorted(canon) != list(range(ndim)):
        raise ValueError(f"{op}: perm {p} is not a permutation of the dimensions 0..{ndim - 1}; "
                         "name each dimension once")
    return canon
