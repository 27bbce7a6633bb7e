"""GradientTape and the backward walk (imperative_grad).

Source: tf.GradientTape / tensorflow/python/eager/backprop.py, with seed 2's
distribution-aware sources: a variable source is expanded through the tape's
watched-variable resolver and the gradients of its components are summed.
"""
import enum
import warnings

import torch

from dtape import nest, ops
from dtape import tape as _tp
from dtape.tensor import Tensor, convert_to_tensor


class UnconnectedGradients(enum.Enum):
    """What `gradient()` returns for a source the target does not depend on. Source: tf.UnconnectedGradients."""

    NONE = "none"
    ZERO = "zero"


def _is_variable(x):
    return hasattr(x, "_handle") and hasattr(x, "_dtape_read")


def _source_handles(source):
    """Concrete (id-bearing) objects a source stands for: one per component."""
    if _is_variable(source):
        return [v._handle() for v in _tp._resolve_watched(source)]
    return [source]


def _diff_dtype(dtype):
    return dtype.is_floating_point or dtype.is_complex


def _prune(records, target_ids, source_ids):
    """Records on a path from a source to a target, in recording order."""
    reach = set(source_ids)
    forward = []
    for rec in records:
        for i in rec[1]:
            if i in reach:
                reach.update(rec[2])
                forward.append(rec)
                break
    needed = set(target_ids)
    kept = []
    for rec in reversed(forward):
        for o in rec[2]:
            if o in needed:
                needed.update(i for i in rec[1] if i is not None)
                kept.append(rec)
                break
    return kept  # reverse recording order


def _unbroadcast(g, shape, rec, argnum):
    gshape = g.shape
    if gshape == shape:
        return g
    lead = len(gshape) - len(shape)
    if lead < 0 or any(s != 1 and s != gs for s, gs in zip(shape, gshape[lead:])):
        raise ValueError(f"gradient of op {rec[0].name!r} for input {argnum} has shape {tuple(gshape)}, "
                         f"which does not reduce to the input's shape {tuple(shape)}; the gradient rule is wrong")
    dims = list(range(lead)) + [lead + i for i, s in enumerate(shape) if s == 1 and gshape[lead + i] != 1]
    if dims:
        g = torch.sum(g, dim=dims, keepdim=True)
    return torch.reshape(g, tuple(shape)) if lead else g


def _zeros_for(t, raw):
    z = torch.zeros_like(t._t)
    return z if raw else Tensor(z)


def _gather_multi(rec, grads, keep, raw):
    """Output gradients of a multi-output record (None if no output got one)."""
    dys = [grads.get(i) if i in keep else grads.pop(i, None) for i in rec[2]]
    if all(d is None for d in dys):
        return None
    return tuple(_zeros_for(o, raw) if d is None else d for d, o in zip(dys, rec[4]))


def _walk(records, grads, keep, raw):
    """Reverse walk: calls each record's backward once its outputs' gradients are summed."""
    for rec in records:
        op, in_ids, out_ids, inputs, outputs, attrs = rec
        if len(out_ids) == 1:
            i = out_ids[0]
            g = grads.get(i) if i in keep else grads.pop(i, None)
            if g is None:
                continue
            dys = (g,)
        else:
            dys = _gather_multi(rec, grads, keep, raw)
            if dys is None:
                continue
        in_grads = op.backward(dys, outputs, inputs, attrs, raw)
        for argnum, i in enumerate(in_ids):
            g = in_grads[argnum]
            if g is None or i is None:
                continue
            shape = inputs[argnum].shape
            if g.shape != shape:
                g = _unbroadcast(g, shape, rec, argnum)
            prev = grads.get(i)
            grads[i] = g if prev is None else prev + g


def imperative_grad(tape, targets, sources, output_gradients=None):
    """Gradients of the sum of `targets` w.r.t. `sources` from `tape`'s records.

    Args:
      tape: a `dtape.tape.Tape`.
      targets: flat list of Tensors.
      sources: flat list of Tensors or concrete variables (with `_id`).
      output_gradients: flat list (None entries allowed) of Tensors matching targets.

    Returns:
      A list with a gradient (dtape.Tensor) or None per source.
    """
    raw = not _tp.could_possibly_record()
    source_ids = [s._id for s in sources]
    target_ids = [t._id for t in targets]
    grads = {}
    for t, dy in zip(targets, output_gradients or [None] * len(targets)):
        dy = Tensor(torch.ones_like(t._t)) if dy is None else convert_to_tensor(dy)
        dy = dy._t if raw else dy
        prev = grads.get(t._id)
        grads[t._id] = dy if prev is None else prev + dy
    keep = set(source_ids)
    _walk(_prune(tape.records(), target_ids, source_ids), grads, keep, raw)
    out = [grads.get(i) for i in source_ids]
    return [Tensor(g) if raw and g is not None else g for g in out]


class GradientTape:
    """Records operations for automatic differentiation (TF 2 semantics).

    Args:
      persistent: allow more than one `gradient()`/`jacobian()` call.
      watch_accessed_variables: watch every trainable variable read while active.

    Ops run on any thread are recorded while the tape is active, when an
    input is watched (the set of tapes is process-global). Under a strategy,
    a watched `MirroredVariable` is its container in a replica context and
    its components in the cross-replica context (seed 2).

    Source: tf.GradientTape.

    Example:
      >>> x = dtape.constant(3.0)
      >>> with dtape.GradientTape() as tape:
      ...     tape.watch(x)
      ...     y = x * x
      >>> float(tape.gradient(y, x))
      6.0
    """

    def __init__(self, persistent=False, watch_accessed_variables=True):
        self._persistent = persistent
        self._watch_accessed_variables = watch_accessed_variables
        self._tape = None
        self._recording = False
        self._used = False

    def __enter__(self):
        self._tape = _tp.push_new_tape(self._persistent, self._watch_accessed_variables)
        self._recording = True
        return self

    def __exit__(self, *exc):
        if self._recording:
            _tp.pop_tape(self._tape)
            self._recording = False
        return False

    def _require_tape(self, what):
        if self._tape is None:
            raise RuntimeError(f"GradientTape.{what}() needs the tape to be entered first: "
                               f"use `with dtape.GradientTape() as tape:`")

    def watch(self, tensor):
        """Watches a Tensor, a Variable, or a nest of them.

        Raises:
          ValueError: for objects that are neither tensors nor variables.
        """
        self._require_tape("watch")
        for t in nest.flatten(tensor):
            if _is_variable(t):
                _tp.watch_variable(self._tape, t)
            elif isinstance(t, Tensor):
                if not _diff_dtype(t.dtype):
                    warnings.warn(f"GradientTape.watch: tensor of dtype {t.dtype} cannot have a gradient; "
                                  "watch a floating tensor instead", stacklevel=2)
                _tp.watch(self._tape, t)
            else:
                raise ValueError(f"GradientTape.watch: expected a dtape.Tensor or Variable, got "
                                 f"{type(t).__name__}; wrap values with dtape.constant first")

    def watched_variables(self):
        """Variables watched so far, in first-watch order, no duplicates."""
        return () if self._tape is None else self._tape.watched_variables()

    def reset(self):
        """Forgets everything recorded and watched; recording continues."""
        self._require_tape("reset")
        self._tape.reset()
        self._used = False

    def stop_recording(self):
        """Context manager that pauses this tape on the current thread only.

        Raises:
          RuntimeError: if the tape is not recording.
        """
        if not self._recording:
            raise RuntimeError("GradientTape.stop_recording(): the tape is not recording; "
                               "call it inside the tape's `with` block")
        return _tp.pause_tape(self._tape)

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=UnconnectedGradients.NONE):
        """Gradient of `target` (summed over its elements) w.r.t. `sources`.

        Args:
          target: Tensor or nest of Tensors (each floating).
          sources: Tensor, Variable, or nest of them.
          output_gradients: optional nest like `target`: the upstream gradients.
          unconnected_gradients: `UnconnectedGradients.NONE` (None) or `.ZERO`.

        Returns:
          A nest like `sources`; each entry has its source's shape, dtype and
          device, or is None (unconnected, or integer/bool source).

        Raises:
          RuntimeError: on a second call of a non-persistent tape, or before
            the tape was entered.
        """
        self._require_tape("gradient")
        if self._used and not self._persistent:
            raise RuntimeError("A non-persistent GradientTape can only be used to compute one set of "
                               "gradients (or jacobians); create it with persistent=True to call "
                               "gradient() more than once")
        if self._recording and not self._persistent:
            _tp.pop_tape(self._tape)
            self._recording = False
        self._used = True
        flat_targets = [_as_target(t) for t in nest.flatten(target)]
        flat_sources = nest.flatten(sources)
        flat_dys = None if output_gradients is None else nest.flatten(output_gradients)
        grads = self._gradients(flat_targets, flat_sources, flat_dys, unconnected_gradients)
        if not self._persistent:
            self._tape.release()
        return nest.pack_sequence_as(sources, grads)

    def _gradients(self, targets, sources, dys, unconnected):
        targets = [t for t in targets if _check_dtype(t, "target")]
        expanded = [_source_handles(s) for s in sources]
        flat = [h for hs in expanded for h in hs]
        raw = imperative_grad(self._tape, targets, flat, dys) if targets else [None] * len(flat)
        out, pos = [], 0
        for src, hs in zip(sources, expanded):
            parts = [g for g in raw[pos:pos + len(hs)] if g is not None]
            pos += len(hs)
            out.append(_finish(src, parts, unconnected))
        return out

    def jacobian(self, target, sources, unconnected_gradients=UnconnectedGradients.NONE):
        """Full Jacobian: for each source, a tensor [*target.shape, *source.shape]. Source: tf.GradientTape.jacobian."""
        return _jacobian(self, target, sources, unconnected_gradients, batch=False)

    def batch_jacobian(self, target, source, unconnected_gradients=UnconnectedGradients.NONE):
        """Per-example Jacobian: target [b, y...], source [b, x...] -> [b, y..., x...].

        Assumes example i of target depends only on example i of source.
        Source: tf.GradientTape.batch_jacobian.
        """
        return _jacobian(self, target, source, unconnected_gradients, batch=True)


def _as_target(t):
    if _is_variable(t):
        return t._dtape_read()
    if not isinstance(t, Tensor):
        raise ValueError(f"gradient target must be a dtape.Tensor, got {type(t).__name__}")
    return t


def _check_dtype(t, role):
    if _diff_dtype(t.dtype):
        return True
    warnings.warn(f"The dtype of the {role} tensor must be floating (e.g. float32) to get a gradient; "
                  f"got {t.dtype}, which gets None", stacklevel=4)
    return False


def _finish(src, parts, unconnected):
    dtype = src.dtype
    if not _diff_dtype(dtype):
        warnings.warn(f"The dtype of the source tensor must be floating (e.g. float32) to get a gradient; "
                      f"got {dtype}, which gets None", stacklevel=4)
        return None
    if parts:
        g = parts[0]
        for p in parts[1:]:
            g = g + p
        return g
    if unconnected is UnconnectedGradients.ZERO or unconnected == "zero":
        return Tensor(torch.zeros(tuple(src.shape), dtype=dtype, device=src.device))
    return None


def _jacobian(tape, target, sources, unconnected, batch):
    """Row-by-row Jacobian through repeated persistent gradient calls."""
    if not tape._persistent:
        raise RuntimeError("jacobian needs GradientTape(persistent=True) (it calls gradient() once per output element)")
    target = _as_target(target)
    flat_sources = nest.flatten(sources)
    n = target.shape[0] if batch else target.torch().numel()
    inner = tuple(target.shape[1:]) if batch else ()
    rows = []
    per = int(torch.tensor(inner).prod()) if inner else 1
    for k in range(per if batch else n):
        seed = torch.zeros(target.shape if not batch else (n, per), dtype=target.dtype, device=target.device)
        if batch:
            seed[:, k] = 1
        else:
            seed.view(-1)[k] = 1
        rows.append(tape.gradient(target, flat_sources, output_gradients=Tensor(seed.reshape(target.shape)),
                                  unconnected_gradients=unconnected))
    out = []
    for j, src in enumerate(flat_sources):
        col = [r[j] for r in rows]
        if all(c is None for c in col):
            out.append(None)
            continue
        col = [c if c is not None else Tensor(torch.zeros(tuple(src.shape), dtype=src.dtype)) for c in col]
        st = ops.stack(col, axis=1 if batch else 0)
        shape = ((n,) + inner + tuple(src.shape[1:])) if batch else (tuple(target.shape) + tuple(src.shape))
        out.append(ops.reshape(st, shape))
    return out if isinstance(sources, (list, tuple)) else out[0]
