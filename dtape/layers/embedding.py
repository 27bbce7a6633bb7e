"""Embedding: integer ids to vectors. Source: tf.keras.layers.Embedding."""
import torch

from dtape import nn as _nn
from dtape.ops import math_ops as _math
from dtape.tensor import Tensor, convert_to_tensor
from dtape.layers.base import Layer


class Embedding(Layer):
    """Lookup table: integer ids [...] -> vectors [..., output_dim].

    Args:
      input_dim: vocabulary size.
      output_dim: vector size.
      embeddings_initializer: name or callable (default "random_uniform", as Keras).
      embeddings_regularizer: None, "l1"/"l2" or a callable (penalty in `losses`).
      mask_zero: id 0 is padding: `compute_mask(ids)` is `ids != 0` ([...],
        bool), and a functional or Sequential model passes it on to the
        layers after (Keras's masking), e.g. a masked GlobalAveragePooling1D
        or MultiHeadAttention. id 0 still has a row, so input_dim counts it.
      input_length: accepted for Keras 2 code; unused.
      name, dtype, seed, input_shape, activity_regularizer: see `Layer`.

    Variables: `embeddings` [input_dim, output_dim], created at construction.
    Source: tf.keras.layers.Embedding.
    """

    _input_dtype = torch.int64

    def __init__(self, input_dim, output_dim, embeddings_initializer="random_uniform", name=None,
                 dtype=None, seed=None, embeddings_regularizer=None, activity_regularizer=None,
                 input_shape=None, mask_zero=False, input_length=None):
        super().__init__(name=name, dtype=dtype, seed=seed, input_shape=input_shape,
                         activity_regularizer=activity_regularizer)
        self.input_dim, self.output_dim = int(input_dim), int(output_dim)
        self.mask_zero, self.input_length = bool(mask_zero), input_length
        self.embeddings = self.add_weight("embeddings", (self.input_dim, self.output_dim),
                                          embeddings_initializer, regularizer=embeddings_regularizer)
        self.built = True

    def _convert_input(self, ids):
        return ids if isinstance(ids, Tensor) else convert_to_tensor(ids, dtype=torch.int64)

    def compute_mask(self, inputs, mask=None):
        """`inputs != 0` with mask_zero=True, else None. Source: tf.keras.layers.Embedding.compute_mask."""
        if not self.mask_zero:
            return None
        return _math.not_equal(self._convert_input(inputs), 0)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.output_dim,)

    def call(self, ids):
        return _nn.embedding_lookup(self.embeddings, ids)
