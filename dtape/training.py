"""Keras's training API for `dtape.models.Model`: `compile`, `fit`, `evaluate`, `predict`, `train_step`, `test_step`.

`Trainer` is the mixin `Model` inherits. The steps are written with
`dtape.GradientTape` as Keras 2's `train_step` is written with
`tf.GradientTape`, so a subclass overrides `train_step(data)` /
`test_step(data)` exactly as in TF's "Customizing what happens in fit" guide.

Under a strategy (the model built inside `strategy.scope()`, or `fit`
called inside one) each global batch is split over the replicas
(`strategy.experimental_distribute_dataset`), `train_step` runs in
`strategy.run`, and the compiled loss is the per-example losses summed and
divided by the ACTUAL global batch size (`dtape.nn.compute_average_loss`,
as TF's LossesContainer; uneven last batches included), so every step's
loss and update equal one device's and the custom loop's. Gradients are
all-reduced during the backward walk (`GradientSync`). Under
`MultiWorkerMirroredStrategy` only rank 0 prints.
Source: tf.keras.Model (TF 2 / Keras 2 engine/training.py, compile_utils.py).
"""
import math
import threading
import warnings
import weakref

import numpy as np
import torch
from tqdm.auto import tqdm

from dtape import callbacks as _callbacks
from dtape import checkpoint as _checkpoint
from dtape import distribute
from dtape import losses as _losses
from dtape import metrics as _metrics
from dtape import nest
from dtape import nn as _nn
from dtape import optimizers as _optimizers
from dtape import tape as _tp
from dtape.backprop import GradientTape
from dtape.ops import array_ops as _array_ops
from dtape.ops import math_ops as _math
from dtape.tensor import Tensor, convert_to_tensor, is_variable

__all__ = ["Trainer", "unpack_x_y_sample_weight"]

_OPTIMIZERS = {"adam": _optimizers.Adam, "sgd": _optimizers.SGD, "rmsprop": _optimizers.RMSprop,
               "adagrad": _optimizers.Adagrad, "adamw": _optimizers.AdamW}
_LOSSES = {"sparse_categorical_crossentropy": _losses.sparse_categorical_crossentropy,
           "categorical_crossentropy": _losses.categorical_crossentropy,
           "binary_crossentropy": _losses.binary_crossentropy,
           "mse": _losses.mean_squared_error, "mean_squared_error": _losses.mean_squared_error,
           "mae": _losses.mean_absolute_error, "mean_absolute_error": _losses.mean_absolute_error}


def unpack_x_y_sample_weight(data):
    """`(x, y, sample_weight)` from a batch given as `x`, `(x,)`, `(x, y)` or `(x, y, sample_weight)`.

    Source: tf.keras.utils.unpack_x_y_sample_weight.
    """
    if isinstance(data, list):
        data = tuple(data)
    if not isinstance(data, tuple):
        return data, None, None
    if len(data) == 1:
        return data[0], None, None
    if len(data) == 2:
        return data[0], data[1], None
    if len(data) == 3:
        return data
    raise ValueError(f"a batch must be x, (x,), (x, y) or (x, y, sample_weight); got a tuple of {len(data)}")


def _optimizer(opt):
    if isinstance(opt, str):
        if opt.lower() not in _OPTIMIZERS:
            raise ValueError(f"unknown optimizer {opt!r}; use one of {sorted(_OPTIMIZERS)} or an optimizer object")
        return _OPTIMIZERS[opt.lower()]()
    if not isinstance(opt, _optimizers.Optimizer):
        raise TypeError(f"compile: optimizer must be a dtape optimizer or its Keras name, got {type(opt).__name__}")
    return opt


def _loss_fn(loss):
    if isinstance(loss, str):
        if loss not in _LOSSES:
            raise ValueError(f"unknown loss {loss!r}; use one of {sorted(_LOSSES)}, a dtape.losses.Loss or a "
                             "function (y_true, y_pred) -> per-example losses")
        return _LOSSES[loss]
    if loss is not None and not callable(loss):
        raise TypeError(f"compile: loss must be a loss object, a function or a Keras name, got {loss!r}")
    return loss


def _metric(metric):
    """A Metric from a metric object, a function or a Keras name ("accuracy" chooses, on each update, binary,
    sparse or categorical accuracy from the shapes, as Keras does; other names via `dtape.metrics.get`)."""
    if isinstance(metric, _metrics.Metric):
        return metric
    if metric in ("accuracy", "acc"):
        return _metrics.MeanMetricWrapper(_metrics.keras_accuracy, name=metric)
    if isinstance(metric, str):
        return _metrics.get(metric)
    if callable(metric):
        return _metrics.MeanMetricWrapper(metric)
    raise TypeError(f"compile: a metric must be a dtape.metrics.Metric, a function or a Keras name, got {metric!r}")


def _per_example(loss, y_true, y_pred):
    """The per-example losses of a loss object (any reduction but "sum") or function."""
    y_true = _rank_matched(y_true, y_pred)
    if isinstance(loss, _losses.Loss):
        return loss.call(y_true, y_pred)
    return loss(y_true, y_pred)


def _batch_loss(loss, sample_weight, strategy):
    """A loss function that returned one value for the batch (TF's Transformer tutorial's masked_loss: a sum
    over the kept tokens divided by their count) has reduced it itself: Keras takes it as it is (its mean over
    the "batch" of one value) and, under a strategy, divides it by the number of replicas, so the summed
    gradients are the replicas' mean. Returns (the loss to differentiate, the value for the loss tracker)."""
    if sample_weight is not None:
        raise ValueError("the compiled loss function returned one value for the whole batch, so sample_weight "
                         "cannot weigh its examples; return the per-example losses [batch, ...] instead")
    return loss / float(strategy.num_replicas_in_sync), loss


def _rank_matched(y_true, y_pred):
    """`y_true` [n] for `y_pred` [n, 1] becomes [n, 1] (and [n, 1] for [n] loses its axis), as Keras's
    compiled loss matches them (squeeze_or_expand_dimensions): 0/1 labels as a vector with one sigmoid unit
    gave one scalar for the whole batch instead of a loss per example."""
    if y_true is None or not isinstance(y_pred, Tensor) or nest.is_nested(y_true):
        return y_true
    y_true = convert_to_tensor(y_true)
    if y_pred.ndim - y_true.ndim == 1 and y_pred.shape[-1] == 1:
        return _array_ops.expand_dims(y_true, -1)
    if y_true.ndim - y_pred.ndim == 1 and y_true.shape[-1] == 1:
        return _array_ops.squeeze(y_true, -1)
    return y_true


def _rows(t):
    return int(t.shape[0]) if t.ndim else 1


_output_masks = threading.local()  # per replica thread: the last model call's outputs (weakly) and their masks


def _as_tensor(x):
    return x if isinstance(x, Tensor) or is_variable(x) else convert_to_tensor(x)


def _mask_of(y_pred):
    """The Keras mask the last model call on this thread gave the output `y_pred` (None if it has none)."""
    for ref, mask in getattr(_output_masks, "pairs", ()):
        if ref() is y_pred:
            return mask
    return None


def _masked_weight(mask, sample_weight, per_example):
    """The mask (cast to the losses' dtype, ranks matched as Keras) times the sample weight, if any."""
    mask = _array_ops.cast(_as_tensor(mask), per_example.dtype)
    return mask if sample_weight is None else _nn.scale_losses_by_sample_weight(mask, sample_weight)


def _global_sum(value):
    """`value` summed over the replicas in sync (a collective under a strategy: every replica calls it)."""
    ctx = distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return value
    with _tp.stop_recording():
        return ctx.all_reduce("SUM", value)


def _per_row(t):
    """The number of losses per example ([batch, steps] losses: steps)."""
    n = 1
    for d in t.shape[1:]:
        n *= int(d)
    return n


def _reduced_loss(loss, y, y_pred, sample_weight, compiled):
    """One loss over this replica's batch, reduced as Keras over the global batch (see `_compiled_loss`):
    (the value to differentiate, this replica's mean for the tracker, its number of rows)."""
    per_example = _per_example(loss, y, y_pred)
    if per_example.ndim == 0:
        data, mean_local = _batch_loss(per_example, sample_weight, compiled.strategy)
        return data, mean_local, 1
    local, mask = _rows(per_example), _mask_of(y_pred)
    if mask is not None:
        sample_weight = _masked_weight(mask, sample_weight, per_example)
    if isinstance(loss, _losses.Loss) and loss.reduction == "sum":
        data = _math.reduce_sum(_nn.scale_losses_by_sample_weight(per_example, sample_weight))
        return data, data / float(max(local, 1)), local
    if mask is None:
        data = _nn.compute_average_loss(per_example, sample_weight=sample_weight,
                                        global_batch_size=compiled.global_batch or local)
        data = data / float(_per_row(per_example)) if _per_row(per_example) != 1 else data
    else:
        unmasked = _global_sum(_math.reduce_sum(_masked_weight(mask, None, per_example)))
        weighted = _math.reduce_sum(_nn.scale_losses_by_sample_weight(per_example, sample_weight))
        data = weighted / _math.maximum(unmasked, 1.0)
    # A replica whose slice of a short last batch is empty has data 0 and weighs 0 in the tracker: 0, not 0 / 0
    # (a NaN that the tracker's weighted sum kept: the epoch's loss was logged as nan).
    return data, data * float(compiled.global_batch or local) / float(max(local, 1)), local


def _output_names(model):
    """The output layers' names of a functional model (Keras's `output_names`), else None."""
    outputs = getattr(model, "outputs", None) if getattr(model, "_graph", None) is not None else None
    return None if outputs is None else [t.node.layer.name for t in outputs]


def _per_output(value, names, what):
    """A list (one entry per output) or a dict keyed by output names, as a list in the outputs' order."""
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ValueError(f"compile: {what} keys {unknown} are not output names; the outputs are {names}")
        return [value.get(n) for n in names]
    if len(value) != len(names):
        raise ValueError(f"compile: {len(value)} {what} for {len(names)} outputs {names}; give one per output "
                         "(None for none) or a dict keyed by output name")
    return list(value)


def _target(y, index, names):
    """The targets of output `index`: y[index] from a list/tuple, y[name] from a dict."""
    if isinstance(y, dict):
        return y[names[index]]
    return nest.flatten(y)[index] if nest.is_nested(y) else y


class _PerOutput:
    """The losses of a model with several outputs: one per output (or None), weights, "<output>_loss" trackers."""

    def __init__(self, losses, weights, names):
        self.losses, self.weights, self.names = losses, weights, names
        self.trackers = [None if l is None else _metrics.Mean(name=f"{n}_loss") for l, n in zip(losses, names)]

    def total(self, model, y, y_pred, sample_weight, compiled):
        flat = nest.flatten(y_pred)
        if len(flat) != len(self.losses):
            raise ValueError(f"{model.name}: {len(flat)} outputs for {len(self.losses)} compiled losses")
        data = mean = None
        local = 0
        for i, (loss, weight, tracker) in enumerate(zip(self.losses, self.weights, self.trackers)):
            if loss is None:
                continue
            value, mean_i, local = _reduced_loss(loss, _target(y, i, self.names), flat[i], sample_weight, compiled)
            tracker.update_state(mean_i, sample_weight=float(local))
            data = value * weight if data is None else data + value * weight
            mean = mean_i * weight if mean is None else mean + mean_i * weight
        return data, mean, local


def _loss_spec(loss, loss_weights, names):
    """The compiled loss: one loss (a single output), or a `_PerOutput` for several outputs / a list or dict."""
    several = names is not None and len(names) > 1
    if not several and not isinstance(loss, (list, tuple, dict)):
        if loss_weights is not None:
            raise ValueError("compile: loss_weights is for a model with several outputs")
        return _loss_fn(loss)
    if names is None:
        raise ValueError("compile: a list or dict of losses needs a functional model with several outputs")
    if loss is None:
        return None
    losses = _per_output(loss, names, "losses") if isinstance(loss, (list, tuple, dict)) else [loss] * len(names)
    weights = [1.0] * len(names) if loss_weights is None else _per_output(loss_weights, names, "loss_weights")
    return _PerOutput([None if l is None else _loss_fn(l) for l in losses],
                      [1.0 if w is None else float(w) for w in weights], names)


def _metrics_spec(metrics, names):
    """The compiled metrics and, for each, the output it reads (None: the whole y / y_pred)."""
    metrics = metrics or []
    several = names is not None and len(names) > 1
    if not several:
        return [_metric(m) for m in metrics], [None] * len(metrics)
    if isinstance(metrics, dict) or (metrics and all(isinstance(m, (list, tuple)) for m in metrics)):
        per = _per_output(metrics, names, "metric lists")
    else:
        if any(isinstance(m, _metrics.Metric) for m in metrics):
            raise ValueError("compile: with several outputs give metric objects per output (a list of lists or "
                             "a dict keyed by output name); names in a flat list apply to every output")
        per = [list(metrics)] * len(names)
    made, outputs = [], []
    for index, (name, group) in enumerate(zip(names, per)):
        for m in [] if group is None else (group if isinstance(group, (list, tuple)) else [group]):
            metric = _metric(m)
            metric._name = f"{name}_{metric.name}"  # Keras prefixes each output's metrics with its name
            made.append(metric)
            outputs.append(index)
    return made, outputs


class _Compiled:
    """What `compile` set (held outside the module walk: the optimizer and metrics are not the model's variables)."""

    def __init__(self, optimizer, loss, metrics, strategy, loss_tracker):
        self.optimizer, self.loss, self.metrics, self.strategy = optimizer, loss, metrics, strategy
        self.loss_tracker = loss_tracker
        self.global_batch = None  # set by the loop before each distributed step
        self.sync = distribute.GradientSync() if strategy.num_replicas_in_sync > 1 else None


class _CompiledMetrics:
    def __init__(self, metrics, outputs=None, names=None):
        self.metrics, self.outputs, self.names = metrics, outputs or [None] * len(metrics), names

    def update_state(self, y_true, y_pred, sample_weight=None):
        for m, index in zip(self.metrics, self.outputs):
            if index is None:
                m.update_state(_labels_ranked(y_true, y_pred), y_pred, sample_weight=sample_weight)
                continue
            out = nest.flatten(y_pred)[index]
            weight = sample_weight
            mask = _mask_of(out)
            if mask is not None:
                weight = _masked_weight(mask, sample_weight, _as_tensor(out))
            m.update_state(_labels_ranked(_target(y_true, index, self.names), out), out, sample_weight=weight)


def _labels_ranked(y_true, y_pred):
    """Labels [n] for outputs [n, 1] become [n, 1], as Keras 2's compiled metrics match them
    (compile_utils.match_dtype_and_rank): 0/1 labels as a vector with one sigmoid unit otherwise made
    "accuracy" one value per batch (the epoch's accuracy a mean over batches, not examples; nan for a
    replica's empty slice; a crash with sample weights)."""
    if y_true is None or nest.is_nested(y_true) or not isinstance(y_pred, Tensor):
        return y_true
    y_true = _as_tensor(y_true)
    if y_true.ndim == 1 and y_pred.ndim == 2 and y_pred.shape[-1] == 1:
        return _array_ops.expand_dims(y_true, -1)
    return y_true


class Trainer:
    """The mixin `Model` inherits: compile / fit / evaluate / predict (see the module docstring)."""

    stop_training = False
    optimizer = None  # set by compile

    # -- compile ---------------------------------------------------------------------
    def compile(self, optimizer="rmsprop", loss=None, metrics=None, loss_weights=None):
        """Configures training: the optimizer, the loss and the metrics.

        Args:
          optimizer: a dtape optimizer, or "adam", "sgd", "rmsprop", "adagrad", "adamw" (defaults).
          loss: a `dtape.losses.Loss` (any reduction: the per-example losses
            are reduced by the global batch), a function `(y_true, y_pred)`
            returning per-example losses (or one value for the batch: used as
            it is, divided by the replicas, as Keras), a Keras name ("mse",
            "sparse_categorical_crossentropy", ...), or None when a custom
            `train_step` computes its own.
          metrics: a list of `dtape.metrics.Metric`, functions or names
            ("accuracy": sparse categorical accuracy with a sparse loss).
            A functional model with several outputs takes, as Keras, a list
            of losses (one per output, None for none) or a dict keyed by the
            output layers' names, `loss_weights` (list or dict; the loss is
            the weighted sum, each output's also logged as
            "<output>_loss"), and metrics as a list of lists or a dict of
            lists per output (logged as "<output>_<metric>"); one loss or a
            flat list of metric names applies to every output.

        The strategy is the one of the current scope, else the one the
        model's variables were made in. Metrics are made in its scope.
        Raises ValueError / TypeError for unknown names or wrong types.
        Source: tf.keras.Model.compile.
        """
        strategy = self._strategy()
        names = _output_names(self)
        with strategy.scope():
            loss = _loss_spec(loss, loss_weights, names)
            made, outputs = _metrics_spec(metrics, names)
            tracker = _metrics.Mean(name="loss")
        vars(self)["_compiled"] = _Compiled(_optimizer(optimizer), loss, made, strategy, tracker)
        vars(self)["_compiled"].metric_outputs = outputs
        self.optimizer = vars(self)["_compiled"].optimizer  # a plain attribute, as Keras's (not a Module: not walked)

    def _strategy(self):
        if distribute.has_strategy():
            return distribute.get_strategy()
        for v in self.variables if self.built else ():
            s = getattr(v, "_distribute_strategy", None)
            if s is not None:
                return s
        return distribute.get_strategy()

    def _check_compiled(self, what):
        if "_compiled" not in vars(self):
            raise RuntimeError(f"{self.name}: call compile(optimizer, loss, metrics) before {what}")
        return vars(self)["_compiled"]

    @property
    def distribute_strategy(self):
        """The strategy `fit` runs under (the compile-time one). Source: tf.keras.Model.distribute_strategy."""
        return self._check_compiled("distribute_strategy").strategy

    @property
    def metrics(self):
        """The metrics reset every epoch and reported: the loss tracker ("loss", when a loss is compiled),
        then the compiled metrics. Override it (with `train_step`) to report your own.

        Source: tf.keras.Model.metrics."""
        compiled = vars(self).get("_compiled")
        if compiled is None:
            return []
        trackers = [compiled.loss_tracker] if compiled.loss is not None else []
        if isinstance(compiled.loss, _PerOutput):
            trackers += [t for t in compiled.loss.trackers if t is not None]
        return trackers + list(compiled.metrics)

    @property
    def metrics_names(self):
        return [m.name for m in self.metrics]

    def save_weights(self, filepath):
        """Writes the model's variables to the checkpoint prefix `filepath` (`dtape.checkpoint.Checkpoint(model=self)`,
        as ModelCheckpoint(save_weights_only=True) does) and records it as the folder's newest for
        `dtape.train.latest_checkpoint(folder)`. Returns the path. Source: tf.keras.Model.save_weights."""
        path = _checkpoint.check_not_state_file(filepath)
        return _checkpoint.Checkpoint(model=self).write_then(path, after=lambda: _checkpoint.record_latest(path))

    def load_weights(self, filepath):
        """Reads variables written by `save_weights` / ModelCheckpoint into this model (built first: variables
        created later are filled when made). Returns the load status. Source: tf.keras.Model.load_weights."""
        return _checkpoint.Checkpoint(model=self).read(filepath)

    # -- the steps -------------------------------------------------------------------
    def note_output_masks(self, outputs, masks):
        """Records, for this thread, the Keras masks of a call's outputs (a list of tensors and a list of masks or
        None): `compute_loss` and `compute_metrics` find the mask of the `y_pred` they get here (Keras keeps it
        on the tensor as `_keras_mask`)."""
        _output_masks.pairs = [(weakref.ref(o), m) for o, m in zip(outputs, masks)
                               if m is not None and isinstance(o, Tensor)]

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
        """The step's loss: the compiled per-example losses summed over this replica's batch, divided by the
        global batch; plus `self.losses` (scaled by the replicas); the loss tracker is updated (global mean).

        Returns a scalar Tensor to differentiate. Source: tf.keras.Model.compute_loss.
        """
        return self._compiled_loss(y, y_pred, sample_weight, self.losses)

    @property
    def compiled_loss(self):
        """Keras 2's `compiled_loss(y_true, y_pred, sample_weight=None, regularization_losses=None)`: the
        compiled loss as `compute_loss` reduces it, plus the given regularization losses (custom train_steps)."""
        self._check_compiled("compiled_loss")
        return lambda y_true, y_pred, sample_weight=None, regularization_losses=None: self._compiled_loss(
            y_true, y_pred, sample_weight, list(regularization_losses or []))

    @property
    def compiled_metrics(self):
        """Keras 2's `compiled_metrics`: `update_state(y_true, y_pred, sample_weight=None)` on the compiled metrics."""
        compiled = self._check_compiled("compiled_metrics")
        return _CompiledMetrics(compiled.metrics, getattr(compiled, "metric_outputs", None), _output_names(self))

    def _compiled_loss(self, y, y_pred, sample_weight, reg):
        """Keras's reduction over the global batch: sum(losses * weight) / (global batch * losses per example),
        or, for an output carrying a Keras mask, / the global number of unmasked losses (the mask is a sample
        weight; Keras 3 and 2.11+ divide by the unmasked count, per replica: here over all replicas, so a
        strategy's loss equals one device's)."""
        compiled = self._check_compiled("compute_loss")
        if compiled.loss is None:
            raise ValueError(f"{self.name}: no loss was compiled; pass loss= to compile or override train_step")
        if isinstance(compiled.loss, _PerOutput):
            data, mean_local, local = compiled.loss.total(self, y, y_pred, sample_weight, compiled)
        else:
            data, mean_local, local = _reduced_loss(compiled.loss, y, y_pred, sample_weight, compiled)
        if reg:
            reg_total = _math.add_n(reg)
            data, mean_local = data + _nn.scale_regularization_loss(reg_total), mean_local + reg_total
        compiled.loss_tracker.update_state(mean_local, sample_weight=float(local))
        return data

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        """Updates the compiled metrics and returns `{name: result}` for every metric; an output's Keras mask
        multiplies the sample weight (masked positions do not count). Source: Keras 2."""
        mask = None if nest.is_nested(y_pred) else _mask_of(y_pred)
        if mask is not None:
            sample_weight = _masked_weight(mask, sample_weight, _as_tensor(y_pred))
        self.compiled_metrics.update_state(y, y_pred, sample_weight)
        return {m.name: m.result() for m in self.metrics}

    def train_step(self, data):
        """One training step on a batch (a replica's part under a strategy); returns `{name: value}`.

        Forward with training=True under a `GradientTape`, `compute_loss`,
        `optimizer.minimize(loss, trainable_variables, tape=tape)` (a
        LossScaleOptimizer: the scaled loss's gradients, unscaled, applied), then the metrics. Override it for custom training (GANs, ...). Source: tf.keras.Model.train_step.
        """
        x, y, sample_weight = unpack_x_y_sample_weight(data)
        scales = hasattr(self.optimizer, "get_scaled_loss")  # a LossScaleOptimizer: Keras scales for the user
        with GradientTape(gradient_sync=None if scales else vars(self)["_compiled"].sync) as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x, y, y_pred, sample_weight)
            scaled = self.optimizer.get_scaled_loss(loss) if scales else loss
        if scales:
            variables = self.trainable_variables
            grads = self.optimizer.get_unscaled_gradients(tape.gradient(scaled, variables))
            self.optimizer.apply_gradients(zip(grads, variables))
        else:
            self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
        return self.compute_metrics(x, y, y_pred, sample_weight)

    def test_step(self, data):
        """One evaluation step: forward with training=False, loss and metrics. Source: tf.keras.Model.test_step."""
        x, y, sample_weight = unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        if vars(self)["_compiled"].loss is not None:
            self.compute_loss(x, y, y_pred, sample_weight)
        return self.compute_metrics(x, y, y_pred, sample_weight)

    def predict_step(self, data):
        """The model's output on a batch's x (training=False). Source: tf.keras.Model.predict_step."""
        x, _, _ = unpack_x_y_sample_weight(data)
        return self(x, training=False)

    # -- the loops -------------------------------------------------------------------
    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose=1, callbacks=None, validation_split=0.0,
            validation_data=None, shuffle=True, class_weight=None, sample_weight=None, initial_epoch=0,
            steps_per_epoch=None, validation_steps=None, validation_batch_size=None, validation_freq=1):
        """Trains for `epochs` epochs; returns the `History` callback (`history.history[name]` per epoch).

        Args:
          x: numpy arrays / tensors (a list or dict of them for several
            inputs), with `y`; or an iterable of `(x, y)` / `(x, y,
            sample_weight)` batches (a list, a generator-making object, a
            torch DataLoader); then `y` and `batch_size` must be None.
          y: targets, with array `x`.
          batch_size: the GLOBAL batch (default 32), array inputs only; the last batch may be smaller.
          epochs, initial_epoch: train epochs `initial_epoch .. epochs - 1`.
          verbose: 1 a progress bar per epoch (tqdm), 2 one line per epoch, 0 silent.
          callbacks: `dtape.keras.callbacks.Callback`s.
          validation_split: a float in [0, 1): the last examples of the arrays
            x, y (and sample_weight), from index `floor(n * (1 - split))` on,
            are held out before any shuffling (never trained on) and
            evaluated as `validation_data` would be (Keras's rule; ignored
            when validation_data is given). Arrays only: ValueError for a
            dataset, for a split outside [0, 1), and when it would leave no
            example on one side.
          validation_data: `(x_val, y_val)` or `(x_val, y_val, val_sample_weight)`
            arrays, or an iterable of batches; evaluated after each epoch,
            reported as `val_<name>`.
          shuffle: array inputs only: a new order every epoch (numpy's global RNG, as Keras).
          class_weight: `{class index: weight}`; each example's loss and
            metrics are weighted by its class's weight (the class is `y`, or
            `argmax(y)` for one-hot targets), times its `sample_weight` if
            given. Every class in `y` must have a weight.
          sample_weight: array-like of one weight per example (shape
            [n] or [n, 1], or [n, timesteps] for per-timestep losses), sliced with
            `x` and `y`: the per-example losses are multiplied by it, then
            summed and divided by the number of examples of the global batch
            (Keras's weighting, `dtape.nn.scale_losses_by_sample_weight`); the
            metrics get it as their `sample_weight`. Arrays only (a dataset
            gives `(x, y, sample_weight)` batches).
          steps_per_epoch: each epoch takes the next this many batches of
            the ongoing pass over the data; a new pass (a new shuffle) starts
            when one is exhausted, and a pass running out mid-epoch ends
            that epoch with a UserWarning, as Keras 2 and 3. Arrays without
            `batch_size` then get batches of ceil(n / steps_per_epoch).
          validation_split: a fraction in [0, 1) of array data held out for
            validation: the LAST examples of `x`, `y` (and `sample_weight`),
            taken before any shuffling, as Keras; ignored when
            `validation_data` is given.
          validation_steps: at most this many validation batches per evaluation.
          validation_batch_size: the validation arrays' batch (default `batch_size`).
          validation_freq: validate after every `validation_freq`-th epoch (an
            int), or after the epochs (1-based) in a list, as Keras.

        Raises:
          RuntimeError: before `compile`.
          ValueError: arrays of different lengths (x, y, sample_weight); `y`,
            `batch_size` or `sample_weight` with a dataset; a class without a
            `class_weight`; a `steps_per_epoch` that is not a positive int.
        A `BackupAndRestore` callback may make fit start at a later epoch
        and batch (the ones its backup recorded) instead of `initial_epoch`.
        Source: tf.keras.Model.fit.
        """
        self._check_compiled("fit")
        if validation_split and validation_data is None:
            (x, y, sample_weight), validation_data = _split_off_validation(x, y, sample_weight, validation_split)
        data = _Data(x, y, batch_size, shuffle, sample_weight, class_weight, _positive(steps_per_epoch))
        val = None
        if validation_data is not None:
            val_x, val_y, val_sw = _val_xy(validation_data)
            val = _Data(val_x, val_y, None if _is_dataset(val_x) else (validation_batch_size or batch_size), False,
                        val_sw)
        validates = _validation_epochs(validation_freq)
        vars(self)["history"] = history = _callbacks.History()
        cbs = _callbacks.CallbackList(list(callbacks or []) + [history], model=self, verbose=verbose,
                                      epochs=epochs, steps=_steps(data, steps_per_epoch))
        self.stop_training = False
        vars(self)["_fit_data"], logs = data, {}
        cbs.on_train_begin()
        resume = vars(self).pop("_resume", None)
        first = initial_epoch if resume is None else max(initial_epoch, resume.epoch)
        for epoch in range(first, epochs):
            mid_epoch = resume is not None and epoch == resume.epoch and resume.batch > 0
            if not mid_epoch:   # resumed mid-epoch: the metrics hold the epoch's restored running state
                self._reset_metrics()
            data.resume = resume if resume is not None and epoch == resume.epoch and resume.continues() else None
            cbs.on_epoch_begin(epoch)
            logs = self._run_epoch(data, self.train_step, cbs, "train", steps_per_epoch,
                                   self._progress(verbose, data, steps_per_epoch, f"Epoch {epoch + 1}/{epochs}",
                                                  resume.batch if mid_epoch else 0))
            if val is not None and validates(epoch + 1):
                val_logs = self._evaluate_data(val, cbs, validation_steps)
                logs.update({"val_" + k: v for k, v in val_logs.items()})
            cbs.on_epoch_end(epoch, logs)
            if verbose == 2 and self._prints():
                print(f"Epoch {epoch + 1}/{epochs} - " + " - ".join(f"{k}: {v:.4f}" for k, v in logs.items()))
            if self.stop_training:
                break
        cbs.on_train_end(logs)
        vars(self).pop("_fit_data", None)   # the arrays are not held after fit
        return history

    def _resume_fit(self, epoch, batch, order_state, after_skip):
        """Makes the next fit (this one, when called from `on_train_begin`) start at `epoch`, batch `batch`.

        `order_state`: the random states the ongoing pass's data order was
        drawn from and its `pass_done` batches drawn (`_fit_order_state()`
        when it was saved); those batches are drawn again in that order and
        skipped (the epoch's first `batch` ones without `pass_done`), then
        `after_skip()` runs (BackupAndRestore sets the random states of the
        moment of its backup there). With `batch == 0` the epoch starts as usual.
        """
        vars(self)["_resume"] = _Resume(int(epoch), int(batch), order_state, after_skip)

    def _fit_order_state(self):
        """The random states this epoch's data order was drawn from (numpy's, torch's, the loader's generators)."""
        data = vars(self).get("_fit_data")
        return None if data is None else data.position()

    def evaluate(self, x=None, y=None, batch_size=None, verbose=0, callbacks=None, sample_weight=None,
                 return_dict=False, steps=None):
        """The loss and metrics over the data (one pass, training=False): a float, or a list of floats in
        `metrics_names` order, or a dict with return_dict.

        `sample_weight`: one weight per example of the arrays `x`, `y`, as in `fit`; `steps`: at most this many
        batches (an endless dataset needs it).
        Source: tf.keras.Model.evaluate."""
        self._check_compiled("evaluate")
        cbs = _callbacks.CallbackList(list(callbacks or []), model=self, verbose=verbose)
        logs = self._evaluate_data(_Data(x, y, batch_size, False, sample_weight), cbs, steps)
        if return_dict:
            return logs
        values = [logs[m.name] for m in self.metrics if m.name in logs]
        return values[0] if len(values) == 1 else values

    def _evaluate_data(self, data, cbs, steps=None):
        self._reset_metrics()
        cbs.on_test_begin()
        logs = self._run_epoch(data, self.test_step, cbs, "test", steps, None)
        cbs.on_test_end(logs)
        return logs

    def predict(self, x, batch_size=None, verbose=0, callbacks=None, steps=None):
        """The model's outputs on `x` (arrays or a dataset of batches), batches concatenated: a numpy array
        (or a nest of them); `steps`: at most this many batches. Source: tf.keras.Model.predict."""
        strategy = self._strategy()
        data = _Data(x, None, batch_size, False)
        cbs = _callbacks.CallbackList(list(callbacks or []), model=self, verbose=verbose)
        cbs.on_predict_begin()
        outs = []
        for step, batch in enumerate(data.batches(strategy)):
            if steps is not None and step >= steps:
                break
            cbs.on_predict_batch_begin(step)
            out = strategy.run(self.predict_step, (batch,))
            outs.append(nest.map_structure(lambda v: strategy.gather(v, axis=0).numpy(), out))  # all workers' rows
            cbs.on_predict_batch_end(step, {"outputs": outs[-1]})
        cbs.on_predict_end()
        if not outs:
            raise ValueError(f"{self.name}.predict: the data gave no batch")
        return nest.map_structure(lambda *parts: np.concatenate(parts), *outs)

    def _run_epoch(self, data, step_fn, cbs, mode, steps, bar):
        compiled = vars(self)["_compiled"]
        strategy, skip = compiled.strategy, (data.resume.batch if data.resume is not None else 0)
        logs = {m.name: float(m.result()) for m in self.metrics} if skip else {}  # a backup after the last batch
        for step, (batch, global_n) in enumerate(zip(data.batches(strategy), data.sizes()), start=skip):
            if steps is not None and step >= steps:
                break
            getattr(cbs, f"on_{mode}_batch_begin")(step)
            compiled.global_batch = global_n
            out = strategy.run(step_fn, (batch,))
            logs = self._logs(out)
            getattr(cbs, f"on_{mode}_batch_end")(step, logs)
            if bar is not None:
                bar.update(1)
                bar.set_postfix({k: f"{v:.4f}" for k, v in logs.items()}, refresh=False)
            if mode == "train" and self.stop_training:
                break
        # compute_loss called after fit/evaluate (a custom loop, a check) divides by its own batch, not the
        # last global batch of the loop (9 examples were divided by the last batch's 1)
        compiled.global_batch = None
        if bar is not None:
            bar.close()
        return logs

    def _logs(self, out):
        """A step's logs as floats: the metrics read over every replica, other values from the first."""
        out = dict(out or {})
        logs = {m.name: float(m.result()) for m in self.metrics if m.name in out}  # Keras's order
        logs.update({k: _first_float(v) for k, v in out.items() if k not in logs})
        return logs

    def _reset_metrics(self):
        for m in self.metrics:
            m.reset_state()

    def reset_metrics(self):
        """Resets every metric in `metrics`. Source: tf.keras.Model.reset_metrics."""
        self._reset_metrics()

    def _prints(self):
        return getattr(vars(self)["_compiled"].strategy.extended, "should_checkpoint", True)

    def _progress(self, verbose, data, steps, desc, done=0):
        if verbose != 1 or not self._prints():
            return None
        total = _steps(data, steps)
        return tqdm(total=total, initial=done, desc=desc, unit="step", leave=True)


class _Resume:
    """Where a resumed fit starts (see `Trainer._resume_fit`)."""

    def __init__(self, epoch, batch, order_state, after_skip):
        self.epoch, self.batch, self.order_state, self.after_skip = epoch, batch, order_state, after_skip

    def continues(self):
        """Whether the resumed epoch continues a pass: mid-epoch, or (with steps_per_epoch) mid-pass."""
        return self.batch > 0 or bool(self.order_state and self.order_state.get("pass_done"))


def _split_off_validation(x, y, sample_weight, split):
    """((x, y, sample_weight) to train on, (x, y, sample_weight) to validate on): the arrays' examples from
    `floor(n * (1 - split))` on are validated on, as Keras's train_validation_split takes them before fit
    shuffles."""
    if not (isinstance(split, (int, float)) and 0.0 <= split < 1.0):
        raise ValueError(f"fit: validation_split must be a float in [0, 1), got {split!r}")
    if _is_dataset(x):
        raise ValueError("fit: validation_split is only supported for arrays and tensors (x, y), not for a dataset "
                         "of batches or a DataLoader (their length and order are unknown up front); pass "
                         "validation_data=... instead")
    arrays = [None if part is None else nest.map_structure(_array, part) for part in (x, y, sample_weight)]
    n = len(nest.flatten(arrays[0])[0])
    at = int(math.floor(n * (1.0 - split)))
    if at in (0, n):
        raise ValueError(f"fit: the training data has {n} examples, too few to split by validation_split={split} "
                         f"(it would leave {at} to train on and {n - at} to validate on); give more data or another "
                         f"validation_split")
    def part(rows):
        return tuple(None if a is None else nest.map_structure(lambda t: t[rows], a) for a in arrays)
    return part(slice(None, at)), part(slice(at, None))


def _val_xy(validation_data):
    """(x, y, sample_weight) of `validation_data`: a 2- or 3-tuple of arrays, or a dataset of batches."""
    # A tuple is (x_val, y_val[, sample_weight]) as in Keras, also when x_val is itself a tuple of several inputs'
    # arrays (which would look like a tuple of (x, y) batches); a dataset of batches is a list or an iterable.
    if isinstance(validation_data, tuple) and len(validation_data) in (2, 3):
        return validation_data[0], validation_data[1], (validation_data[2] if len(validation_data) == 3 else None)
    return validation_data, None, None


def _validation_epochs(freq):
    """Whether to validate after epoch `n` (1-based): every `freq`-th epoch, or those in a list (Keras)."""
    if isinstance(freq, (list, tuple, set)):
        chosen = {int(e) for e in freq}
        return lambda n: n in chosen
    if type(freq) is not int or freq < 1:
        raise ValueError(f"validation_freq must be a positive int or a list of epochs, got {freq!r}")
    return lambda n: n % freq == 0


def _is_dataset(x):
    """An iterable of batches rather than arrays (not a tensor, array, list/tuple/dict of arrays)."""
    if isinstance(x, (np.ndarray, torch.Tensor, Tensor, dict)) or is_variable(x):
        return False
    if isinstance(x, (list, tuple)):  # a list of (x, y) batches; else several inputs' arrays
        return bool(x) and isinstance(x[0], tuple)
    return hasattr(x, "__iter__")


_END = object()
_RAN_OUT = ("Your input ran out of data after {n} batches, before the epoch's {steps} steps (steps_per_epoch): "
            "the epoch ends here and the next one starts a new pass over the data (as Keras). Make sure the "
            "data gives at least steps_per_epoch * epochs batches, or lower steps_per_epoch.")


def _positive(steps):
    if steps is None:
        return None
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps_per_epoch must be a positive int (or None for one pass per epoch), got {steps!r}")
    return int(steps)


def _steps(data, steps):
    n = data.num_batches()
    return n if steps is None else (steps if n is None else min(n, steps))


def _first_float(v):
    if isinstance(v, distribute.PerReplica):
        v = v.values[0]
    try:
        return float(v.numpy() if hasattr(v, "numpy") else v)
    except (TypeError, ValueError):
        return v


class _Data:
    """The batches of `fit`/`evaluate`/`predict`: arrays sliced into global batches, or a dataset as given.

    `order_state` is the random state each epoch's order was drawn from
    (set as the epoch's iteration starts); with `resume` set, the epoch's
    order is drawn again from the resume's state and its first batches are
    skipped (BackupAndRestore).
    """

    def __init__(self, x, y, batch_size, shuffle, sample_weight=None, class_weight=None, steps=None):
        if x is None:
            raise ValueError("no data: pass x (arrays, tensors or a dataset of batches)")
        self.dataset, self.resume, self.order_state = _is_dataset(x), None, None
        self.steps, self._pass, self.pass_done = steps, None, 0
        self.class_weight = _class_weights(class_weight)
        if self.dataset:
            if y is not None or batch_size is not None or sample_weight is not None:
                raise ValueError("with a dataset of batches (an iterable / DataLoader) give neither y nor batch_size "
                                 "(nor sample_weight): the batches are used as they come ((x, y, sample_weight) "
                                 "batches carry their weights)")
            self.x = x
            return
        self.x, self.y = nest.map_structure(_array, x), (None if y is None else nest.map_structure(_array, y))
        self.sw = None if sample_weight is None else _array(sample_weight)
        if self.sw is not None and self.y is None:
            raise ValueError("sample_weight needs targets y: it weighs each example's loss")
        arrays = nest.flatten([self.x] + ([] if self.y is None else [self.y]))
        lengths = {len(a) for a in arrays + ([] if self.sw is None else [self.sw])}
        if len(lengths) != 1:
            raise ValueError(f"x, y and sample_weight have different numbers of examples: {sorted(lengths)}")
        self.n, self.shuffle = lengths.pop(), shuffle
        # Keras: without a batch_size, steps_per_epoch batches cover the arrays once (else batches of 32)
        self.batch_size = int(batch_size or (-(-self.n // steps) if steps else 32))
        self._order = np.arange(self.n)

    def num_batches(self):
        if not self.dataset:
            return -(-self.n // self.batch_size)
        try:
            return len(self.x)
        except TypeError:
            return None

    def _global_batches(self):
        """One epoch's global batches: a whole pass, or with `steps` the next `steps` batches of the ongoing
        pass (Keras 2 and 3 continue the iterator across epochs and start a new pass when it is exhausted)."""
        resume, taken = self.resume, 0
        if resume is not None:       # the pass is drawn again from its states, its done batches skipped
            _set_order_state(self.x if self.dataset else None, resume.order_state)
            self._start_pass(resume.order_state.get("pass_done", resume.batch))
            taken = resume.batch
            resume.after_skip()
        elif self._pass is None or self.steps is None:
            self._start_pass(0)
        n = self.num_batches()
        while self.steps is None or taken < self.steps:
            batch = _END if n is not None and self.pass_done >= n else next(self._pass, _END)
            if batch is _END:
                self._pass = None
                if self.steps is not None:
                    warnings.warn(_RAN_OUT.format(steps=self.steps, n=self.pass_done), stacklevel=4)
                return
            self.pass_done, taken = self.pass_done + 1, taken + 1
            yield batch
        if n is not None and self.pass_done >= n:
            self._pass = None          # exhausted: the next epoch starts a new pass (a new shuffle)

    def _start_pass(self, skip):
        """A new pass over the data, its order drawn now (the states kept in `order_state`), `skip` batches
        drawn and dropped."""
        self.order_state = _order_state(self.x if self.dataset else None)
        self._pass = self._dataset_batches(skip) if self.dataset else self._array_batches(skip)
        self.pass_done = skip

    def position(self):
        """The order state of the ongoing pass and how many of its batches were drawn (BackupAndRestore);
        None between passes (the next epoch draws a new order from the random states of that moment)."""
        if self._pass is None or self.order_state is None:
            return None
        return dict(self.order_state, pass_done=self.pass_done)

    def _dataset_batches(self, skip):
        batches = iter(self.x)
        for _ in range(skip):       # drawn again in the same order, not trained on
            next(batches, None)
        return (_weighted(batch, self.class_weight) for batch in batches)

    def _array_batches(self, skip):
        if self.shuffle:
            self._order = np.random.permutation(self.n)
        return (self._slice(self._order[start:start + self.batch_size])
                for start in range(skip * self.batch_size, self.n, self.batch_size))

    def _slice(self, idx):
        x = nest.map_structure(lambda a: a[idx], self.x)
        if self.y is None:
            return (x,)  # as Keras packs it: a list of several inputs alone would unpack as (x, y)
        batch = (x, nest.map_structure(lambda a: a[idx], self.y)) + (() if self.sw is None else (self.sw[idx],))
        return _weighted(batch, self.class_weight)

    def batches(self, strategy):
        self._sizes = []
        source = _Sized(self._global_batches(), self._sizes)
        if strategy.num_replicas_in_sync == 1 and not distribute.has_strategy():
            return iter(source)
        return iter(strategy.experimental_distribute_dataset(source))

    def sizes(self):
        while True:
            yield self._sizes.pop(0) if self._sizes else None


def _loader_generators(dataset):
    """The torch.Generators a DataLoader draws its order from besides torch's default one (its own, its sampler's)."""
    found = [getattr(dataset, "generator", None), getattr(getattr(dataset, "sampler", None), "generator", None)]
    return [g for g in found if isinstance(g, torch.Generator)]


def _order_state(dataset):
    """The random states a data order is drawn from: numpy's global RNG (fit's shuffle), torch's default
    generator (a DataLoader's shuffle without a generator) and the loader's own generators."""
    return {"numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "loader": [g.get_state() for g in _loader_generators(dataset)]}


def _set_order_state(dataset, state):
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    generators = _loader_generators(dataset)
    if len(generators) != len(state["loader"]):
        raise ValueError(f"the backup's data order was drawn with {len(state['loader'])} DataLoader generator(s), "
                         f"this data has {len(generators)}: resume with the same data pipeline")
    for g, saved in zip(generators, state["loader"]):
        g.set_state(saved)


def _class_weights(class_weight):
    if class_weight is None:
        return None
    if not isinstance(class_weight, dict) or not class_weight:
        raise ValueError(f"class_weight must be a non-empty dict {{class index: weight}}, got {class_weight!r}; "
                         "for an array of weights per class (sklearn's compute_class_weight) pass "
                         "dict(enumerate(weights))")
    top = max(int(k) for k in class_weight)
    table = np.full(top + 1, np.nan, np.float32)
    for k, w in class_weight.items():
        table[int(k)] = float(w)
    return table


def _weighted(batch, table):
    """A batch with its class weights multiplied into its sample weights (Keras's class_weight)."""
    if table is None:
        return batch
    x, y, sw = unpack_x_y_sample_weight(batch)
    if y is None or nest.flatten(y)[0] is not y:
        raise ValueError("class_weight needs a single target y per batch")
    labels = _array(y)
    labels = labels.argmax(-1) if labels.ndim > 1 and labels.shape[-1] > 1 else labels.reshape(len(labels))
    labels = labels.astype(np.int64)
    if labels.min(initial=0) < 0 or labels.max(initial=0) >= len(table) or np.isnan(table[labels]).any():
        missing = sorted({int(c) for c in labels if c < 0 or c >= len(table) or np.isnan(table[c])})
        raise ValueError(f"class_weight has no weight for the classes {missing} found in y; give every class one")
    weights = table[labels]
    if sw is not None:   # per-timestep weights [n, T] get one class weight per example
        sw = _array(sw).astype(np.float32)
        weights = sw * weights.reshape((-1,) + (1,) * (sw.ndim - 1))
    return x, y, weights


class _Sized:
    """Passes global batches through, noting each one's number of examples (the global batch size)."""

    def __init__(self, batches, sizes):
        self._batches, self._sizes = batches, sizes

    def __iter__(self):
        for batch in self._batches:
            x, _, _ = unpack_x_y_sample_weight(batch)
            self._sizes.append(_rows(nest.flatten(x)[0]) if hasattr(nest.flatten(x)[0], "shape")
                               else len(nest.flatten(x)[0]))
            yield batch


def _array(a):
    if isinstance(a, Tensor) or is_variable(a):
        return a.numpy()
    if isinstance(a, torch.Tensor):
        return a.detach().cpu().numpy()
    a = np.asarray(a)
    # Keras's array adapter converts float64 numpy data (`x / 255.0`) to floatx, float32: float32 layers under a
    # strategy would otherwise get float64 batches ("expected scalar type Double but found Float").
    return a.astype(np.float32) if a.dtype == np.float64 else a

