"""Dropout, with per-replica random streams. Source: tf.keras.layers.Dropout."""
import threading

import numpy as np
import torch

from dtape import _keras_tensor
from dtape import _call_context
from dtape import nn as _nn
from dtape import random as _random
from dtape.tensor import Tensor, convert_to_tensor, is_variable
from dtape.layers.base import Layer


class Dropout(Layer):
    """Zeroes a fraction `rate` of inputs during training, scaling the rest by 1/(1-rate).

    Args:
      rate: float in [0, 1).
      name: see `Layer`.
      seed: None (default): the mask draws from the current replica's
        generator (`dtape.random.get_generator`: one per replica under a
        strategy, saved by `strategy.get_rng_state()`; torch's default
        generator outside replicas). An int: the layer draws from its own
        stateful generators: outside replicas one seeded with `seed` (per
        device); on replica i of a strategy one seeded from (seed, i), so
        replicas never share (or race on) one generator and each replica's
        masks are reproducible. These layer-owned streams are not part of
        the strategy's RNG state: for a bit-exact resume use seed=None.

    Shapes: x any shape -> the same shape and dtype. Identity unless called
    with `training=True`, or with `training` left None inside a layer call
    made with `training=True` (Keras's call context; see `Layer.__call__`).
    Source: tf.keras.layers.Dropout (per-replica streams: tf.random.Generator.split).
    """

    supports_masking = True  # elementwise along the steps: a mask passes through (Keras)

    def __init__(self, rate, name=None, seed=None):
        super().__init__(name=name, seed=seed)
        if not 0.0 <= float(rate) < 1.0:
            raise ValueError(f"Dropout rate must be in [0, 1), got {rate!r}")
        self.rate = float(rate)
        self.seed = None if seed is None else int(seed)
        self._streams = {}  # (replica id or None, device) -> torch.Generator; only with a seed
        self._streams_lock = threading.Lock()
        self.built = True

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)

    def __call__(self, x, training=None):
        if isinstance(x, _keras_tensor.KerasTensor):  # functional API: record, compute nothing
            return _keras_tensor.record_call(self, (x,), {} if training is None else {"training": training})
        x = x if isinstance(x, Tensor) or is_variable(x) else convert_to_tensor(x)
        if not _call_context.resolve_training(training, False) or self.rate == 0.0:
            return x
        if self.seed is None:
            return _nn.dropout(x, self.rate)
        keep = _random.raw_uniform(tuple(x.shape), None, x.device, self._stream(x.device)) >= self.rate
        return x * Tensor(keep.to(x.dtype) / (1.0 - self.rate))

    def _stream(self, device):
        """This layer's generator for the current replica (None outside replicas) on `device`."""
        # (the replica's generator: torch's default one holds its stream in a lone replica's wrapped forward)
        replica_id = getattr(_random.stream_owner(_random.get_generator(device)), "replica_id", None)
        key = (replica_id, device)
        with self._streams_lock:
            gen = self._streams.get(key)
            if gen is None:
                seed = self.seed if replica_id is None else _derive_seed(self.seed, replica_id)
                gen = self._streams[key] = torch.Generator(device=device).manual_seed(seed)
        return gen


def _derive_seed(seed, replica_id):
    """A well-mixed 63-bit seed for replica `replica_id`'s stream of `seed`."""
    ss = np.random.SeedSequence([seed & (2**64 - 1), int(replica_id), 0x64726F70])  # domain tag: "drop"
    return int(ss.generate_state(1, np.uint64)[0]) & (2**63 - 1)


# -- pooling, reshaping ---------------------------------------------------------
