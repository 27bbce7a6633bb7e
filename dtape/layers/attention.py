"""MultiHeadAttention with Keras's signature, masks and shapes. Source: tf.keras.layers.MultiHeadAttention."""
import math

import torch

from dtape import _restore_hooks
from dtape import nn as _nn
from dtape import regularizers as _regularizers
from dtape.ops import array_ops as _array
from dtape.ops import math_ops as _math
from dtape.tensor import Tensor, convert_to_tensor
from dtape.layers.base import Layer


def _large_negative(dtype):
    """What a masked score gets added (Keras): -1e9, or -3e4 where float16 cannot hold -1e9."""
    return -3e4 if dtype == torch.float16 else -1e9


class MultiHeadAttention(Layer):
    """Multi-head (scaled dot-product) attention of `query` over `value` (keys: `key`, default `value`).

    Per head: q = query @ Wq + bq, k = key @ Wk + bk, v = value @ Wv + bv;
    scores = softmax(q k^T / sqrt(key_dim)) with masked positions given
    -1e9 before the softmax (Keras); each head's scores @ v, joined and
    projected by Wo + bo.

    Args:
      num_heads: number of heads.
      key_dim: size of each head's query and key.
      value_dim: size of each head's value (default key_dim).
      dropout: rate of dropout on the attention probabilities (training only).
      use_bias: biases on the four projections.
      output_shape: the last dimension of the output (default the query's).
      attention_axes: None only (attention over the steps axis).
      kernel_initializer, bias_initializer, kernel_regularizer, bias_regularizer,
        activity_regularizer, name, dtype, seed: see `Dense` and `Layer`.

    Call: `mha(query, value, key=None, query_mask=None, value_mask=None,
    key_mask=None, attention_mask=None, return_attention_scores=False,
    training=None, use_causal_mask=False)`; query and value also by keyword
    (`mha(query=x, value=ctx)`, as TF's Transformer tutorial).
      query [batch, T, dim], value [batch, S, dim_v], key [batch, S, dim_k].
      query_mask [batch, T], value_mask / key_mask [batch, S]: bool, True =
        kept. In a functional or Sequential model the query's propagated mask
        (e.g. from `Embedding(mask_zero=True)`) is the query_mask, and the
        value_mask too when value is the query (self-attention), as Keras's
        implicit masks.
      attention_mask [batch, T, S] bool (True = may attend), ANDed with the
        above and, with use_causal_mask=True, with the lower triangle
        (query step t sees value steps <= t).
    Returns [batch, T, output_shape] (query's dtype), and with
    return_attention_scores=True also the probabilities [batch, num_heads, T, S]
    (before dropout). A query step whose every key is masked gets -1e9 on
    every score (Keras): uniform probabilities in float32 (float64 still
    tells the scores apart). The output keeps the query's mask.

    Variables (Keras's order and shapes): query/key/value kernels
    [dim, num_heads, key_dim or value_dim] and biases [num_heads, key_dim or
    value_dim], output kernel [num_heads, value_dim, output_shape] and bias
    [output_shape]; built by the first call.
    Raises:
      ValueError: inputs not of rank 3, attention_axes given, a missing value.
    Source: tf.keras.layers.MultiHeadAttention.
    """

    supports_masking = True

    def __init__(self, num_heads, key_dim, value_dim=None, dropout=0.0, use_bias=True, output_shape=None,
                 attention_axes=None, kernel_initializer="glorot_uniform", bias_initializer="zeros",
                 kernel_regularizer=None, bias_regularizer=None, activity_regularizer=None, name=None, dtype=None,
                 seed=None):
        super().__init__(name=name, dtype=dtype, seed=seed, activity_regularizer=activity_regularizer)
        if attention_axes is not None:
            raise ValueError("MultiHeadAttention supports attention_axes=None only (attention over axis 1 of "
                             "[batch, steps, features] inputs)")
        self.num_heads, self.key_dim = int(num_heads), int(key_dim)
        self.value_dim = self.key_dim if value_dim is None else int(value_dim)
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"MultiHeadAttention dropout must be in [0, 1), got {dropout!r}")
        self.dropout, self.use_bias = float(dropout), bool(use_bias)
        if isinstance(output_shape, (tuple, list)):
            if len(output_shape) != 1:
                raise ValueError(f"MultiHeadAttention output_shape must be an int or a 1-tuple, got {output_shape!r}")
            output_shape = output_shape[0]
        self._out_dim = None if output_shape is None else int(output_shape)
        self.kernel_initializer, self.bias_initializer = kernel_initializer, bias_initializer
        self.kernel_regularizer = _regularizers.get(kernel_regularizer)
        self.bias_regularizer = _regularizers.get(bias_regularizer)
        self._projections = None

    def __call__(self, *args, **kwargs):
        if not args and "query" in kwargs:  # mha(query=x, value=y, key=z): Keras's keyword form
            args = (kwargs.pop("query"),) + ((kwargs.pop("value"),) if "value" in kwargs else ())
        return super().__call__(*args, **kwargs)

    def _weights(self, name, shape, bias_shape):
        kernel = self.add_weight(f"{name}/kernel", shape, self.kernel_initializer,
                                 regularizer=self.kernel_regularizer)
        bias = self.add_weight(f"{name}/bias", bias_shape, self.bias_initializer,
                               regularizer=self.bias_regularizer) if self.use_bias else None
        return kernel, bias

    def _build_projections(self, query_dim, value_dim, key_dim):
        """The four projections' variables, created by the first call (they need the value's and key's sizes)."""
        heads, out = self.num_heads, self._out_dim or query_dim
        self._projections = {
            "query": self._weights("query", (query_dim, heads, self.key_dim), (heads, self.key_dim)),
            "key": self._weights("key", (key_dim, heads, self.key_dim), (heads, self.key_dim)),
            "value": self._weights("value", (value_dim, heads, self.value_dim), (heads, self.value_dim)),
            "attention_output": self._weights("attention_output", (heads, self.value_dim, out), (out,)),
        }
        _restore_hooks.variables_created(self)   # a checkpoint restored before this first call fills them now

    def _project(self, name, x, equation):
        kernel, bias = self._projections[name]
        y = _math.einsum(equation, x, kernel)
        return y if bias is None else y + bias

    def compute_output_shape(self, input_shape):
        return None  # depends on the value's shape too: found by running the layer

    def call(self, query, value=None, key=None, query_mask=None, value_mask=None, key_mask=None,
             attention_mask=None, return_attention_scores=False, training=None, use_causal_mask=False, mask=None):
        if value is None:
            raise ValueError(f"{self.name}: MultiHeadAttention needs a value: mha(query, value) or "
                             "mha(query=x, value=y) (self-attention: mha(x, x))")
        self_attention = _same_tensor(value, query)
        value = value if isinstance(value, Tensor) else convert_to_tensor(value, dtype=query.dtype)
        key = value if key is None else (key if isinstance(key, Tensor) else convert_to_tensor(key, dtype=query.dtype))
        for what, t in (("query", query), ("value", value), ("key", key)):
            if t.ndim != 3:
                raise ValueError(f"{self.name}: {what} must be [batch, steps, features], got shape {tuple(t.shape)}")
        if self._projections is None:
            self._build_projections(query.shape[-1], value.shape[-1], key.shape[-1])
        if query_mask is None:
            query_mask = mask
        if value_mask is None and self_attention:
            value_mask = mask
        q = self._project("query", query, "btd,dnh->btnh") * (1.0 / math.sqrt(self.key_dim))
        k = self._project("key", key, "bsd,dnh->bsnh")
        v = self._project("value", value, "bsd,dnh->bsnh")
        scores = _math.einsum("bsnh,btnh->bnts", k, q)
        allowed = self._attention_mask(query, value, query_mask, value_mask, key_mask, attention_mask,
                                       use_causal_mask)
        if allowed is not None:  # [batch, T, S] -> [batch, 1, T, S]: every head
            blocked = 1.0 - _array.cast(_array.expand_dims(allowed, 1), scores.dtype)
            scores = scores + blocked * _large_negative(scores.dtype)
        probs = _nn.softmax(scores, axis=-1)
        dropped = _nn.dropout(probs, self.dropout) if training and self.dropout > 0 else probs
        out = self._project("attention_output", _math.einsum("bnts,bsnh->btnh", dropped, v), "btnh,nhd->btd")
        return (out, probs) if return_attention_scores else out

    def _attention_mask(self, query, value, query_mask, value_mask, key_mask, attention_mask, use_causal_mask):
        """The AND of every given mask as [batch or 1, T, S] bool (Keras's _compute_attention_mask), or None."""
        parts = []
        if query_mask is not None:
            parts.append(_array.expand_dims(_bool(query_mask), -1))
        for m in (value_mask, key_mask):
            if m is not None:
                parts.append(_array.expand_dims(_bool(m), -2))
        if use_causal_mask:
            t, s = query.shape[1], value.shape[1]
            parts.append(Tensor(torch.ones((1, t, s), dtype=torch.bool, device=query.device).tril()))
        if attention_mask is not None:
            parts.append(_bool(attention_mask))
        if not parts:
            return None
        allowed = parts[0]
        for p in parts[1:]:
            allowed = _math.logical_and(allowed, p)
        return allowed


def _same_tensor(a, b):
    """a and b are one tensor (self-attention), also when each was wrapped apart from the same torch tensor."""
    if a is b:
        return True
    if not (isinstance(a, Tensor) and isinstance(b, Tensor)):
        return False
    ta, tb = a.torch(), b.torch()
    return ta.data_ptr() == tb.data_ptr() and ta.shape == tb.shape and ta.stride() == tb.stride() \
        and ta.dtype == tb.dtype


def _bool(mask):
    mask = mask if isinstance(mask, Tensor) else convert_to_tensor(mask)
    return mask if mask.dtype == torch.bool else _math.not_equal(mask, 0)
