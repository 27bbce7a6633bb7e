"""`dtape.keras`: the `tf.keras`-shaped namespace over dtape's own objects.

`import dtape.keras as keras` (or `from dtape import keras`) ports a TF 2
script's `tf.keras.*` lines: `keras.layers.Dense`, `keras.Sequential`,
`keras.optimizers.Adam`, `keras.optimizers.schedules.ExponentialDecay`,
`keras.losses`, `keras.metrics`, `keras.mixed_precision`,
`keras.regularizers`, `keras.initializers`, `keras.activations`, `keras.backend` (get_value, set_value), each also
importable with `from dtape.keras.<module> import <name>`.

Names, not copies: every object here is the one defined elsewhere in dtape
(`dtape.keras.layers.Dense is dtape.layers.Dense`), so a layer, optimizer or
loss made through either name is the same class, trained, checkpointed and
distributed the same way. Nothing in dtape imports this package (it is the
top layer of pyproject.toml's import contract).

`keras.saving` (and `keras.models.load_model`, `Model.save`) is `dtape.saving`'s
whole-model archive (config JSON and safetensors weights).

`keras.Model` (functional: `keras.Model(inputs, outputs)` over
`keras.Input(shape=...)`; or subclassed) and `keras.Input` are
`dtape.models`'s, also under `keras.models`.

`keras.Model` trains with `compile`/`fit`/`evaluate`/`predict` (`dtape.training`,
distributed under `strategy.scope()`), with `keras.callbacks` (`dtape.callbacks`:
History, EarlyStopping, LearningRateScheduler, ReduceLROnPlateau, CSVLogger,
ModelCheckpoint, BackupAndRestore, TensorBoard, custom Callbacks). `keras.Sequential` is
`dtape.models.Sequential` (a model: it has `fit`), which extends the layer
`dtape.layers.Sequential` (`keras.layers.Sequential`).
Source: tf.keras (TF 2) / Keras 3 module layout.
"""
from dtape.keras import activations, backend, callbacks, initializers, layers, losses, metrics, mixed_precision, models, \
    optimizers, regularizers, saving
from dtape.models import Input, Model, Sequential

__all__ = ["activations", "backend", "callbacks", "initializers", "layers", "losses", "metrics", "mixed_precision", "models",
           "optimizers", "regularizers", "saving", "Input", "Model", "Sequential"]
