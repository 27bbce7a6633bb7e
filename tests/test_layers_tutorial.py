"""The layers TF's tutorials use (DCGAN, Transformer, text classification), checked against torch and
finite differences in float64: Conv2DTranspose, Conv1D, LeakyReLU, ReLU, Add, Multiply, Concatenate,
Permute, UpSampling2D, GlobalAveragePooling1D, Embedding(mask_zero=True) with masks through
Sequential and functional models, MultiHeadAttention."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dtape
from dtape import keras

L = dtape.layers
D = torch.float64


@pytest.fixture(autouse=True)
def _float64_layers():
    """Layers cast floating inputs to their dtype (Keras): float64 throughout, as the finite differences need."""
    dtape.mixed_precision.set_global_policy("float64")
    yield
    dtape.mixed_precision.set_global_policy("float32")


def _t(*shape, seed=0):
    return torch.randn(*shape, dtype=D, generator=torch.Generator().manual_seed(seed))


def _grads_match_finite_differences(fn, inputs, variables=(), eps=1e-6):
    """dtape's gradients of <w, fn(inputs)> (w fixed random) for each input and variable, against central
    differences of the same sum in float64."""
    xs = [dtape.constant(x) for x in inputs]
    with dtape.GradientTape() as tape:
        for x in xs:
            tape.watch(x)
        y = fn(*xs)
        w = _t(*tuple(y.shape), seed=99)
        loss = dtape.reduce_sum(y * dtape.constant(w))
    got = tape.gradient(loss, xs + list(variables))

    def value():
        with dtape.stop_recording():
            return float((fn(*[dtape.constant(x) for x in inputs]).torch() * w).sum())

    def numeric(get, put):
        base = get().clone()
        flat, out = base.reshape(-1), torch.zeros(base.numel(), dtype=D)
        for i in range(base.numel()):
            for sign in (1, -1):
                pert = flat.clone()
                pert[i] += sign * eps
                put(pert.reshape(base.shape))
                out[i] += sign * value() / (2 * eps)
        put(base)
        return out.reshape(base.shape)

    for i, x in enumerate(inputs):
        want = numeric(lambda: inputs[i], lambda v: inputs.__setitem__(i, v))
        torch.testing.assert_close(got[i].torch(), want, rtol=1e-5, atol=1e-6)
    for k, var in enumerate(variables):
        want = numeric(lambda: var.torch(), lambda v: var.assign(dtape.constant(v)))
        torch.testing.assert_close(got[len(inputs) + k].torch(), want, rtol=1e-5, atol=1e-6)


# -- Conv2DTranspose -----------------------------------------------------------------

@pytest.mark.parametrize("k,s,padding,hw,want", [(5, 2, "same", (3, 4), (6, 8)),     # DCGAN's generator
                                                 (3, 2, "valid", (3, 4), (7, 9)),
                                                 (1, 2, "valid", (3, 3), (6, 6)),    # kernel < strides
                                                 (4, 1, "same", (3, 3), (3, 3))])
def test_conv2d_transpose_shapes_and_values_match_torch_cropped_as_tf(k, s, padding, hw, want):
    layer = L.Conv2DTranspose(3, k, strides=s, padding=padding, dtype=D, seed=0)
    x = _t(2, *hw, 2)
    y = layer(x)
    assert tuple(y.shape) == (2, *want, 3) and layer.compute_output_shape((None, *hw, 2)) == (None, *want, 3)
    assert tuple(layer.kernel.shape) == (k, k, 3, 2)               # Keras's order: (kh, kw, filters, in)
    full = F.conv_transpose2d(x.permute(0, 3, 1, 2), layer.kernel.torch().permute(3, 2, 0, 1), stride=s)
    total = [max(k - s, 0)] * 2 if padding == "same" else [0, 0]   # TF: SAME pads k - s, the extra after
    full = F.pad(full, (0, max(want[1] - full.shape[3], 0), 0, max(want[0] - full.shape[2], 0)))
    top, left = total[0] // 2, total[1] // 2
    ref = full[:, :, top:top + want[0], left:left + want[1]].permute(0, 2, 3, 1) + layer.bias.torch()
    torch.testing.assert_close(y.torch(), ref)


def test_conv2d_transpose_output_padding_follows_keras_formula():
    layer = L.Conv2DTranspose(2, 3, strides=2, padding="same", output_padding=1, dtype=D)
    assert tuple(layer(_t(1, 4, 4, 1)).shape) == (1, 8, 8, 2)      # (4 - 1) * 2 + 3 - 2 * 1 + 1
    with pytest.raises(ValueError, match="smaller than the strides"):
        L.Conv2DTranspose(2, 3, strides=2, output_padding=2)


def test_conv2d_transpose_gradients_match_finite_differences():
    layer = L.Conv2DTranspose(2, 3, strides=2, padding="same", activation="tanh", dtype=D, seed=1)
    layer.build((None, 3, 3, 2))
    layer.bias.assign(dtape.constant(_t(2, seed=5)))
    _grads_match_finite_differences(layer, [_t(1, 3, 3, 2)], layer.trainable_variables)


# -- Conv1D ---------------------------------------------------------------------------

@pytest.mark.parametrize("padding,dilation", [("valid", 1), ("same", 1), ("causal", 2)])
def test_conv1d_matches_torch_conv1d(padding, dilation):
    layer = L.Conv1D(3, 3, padding=padding, dilation_rate=dilation, dtype=D, seed=0)
    x = _t(2, 7, 4)
    y = layer(x)
    w = layer.kernel.torch().permute(2, 1, 0)                      # [k, in, out] -> [out, in, k]
    pad = {"valid": (0, 0), "same": (1, 1), "causal": (2 * dilation, 0)}[padding]
    ref = F.conv1d(F.pad(x.permute(0, 2, 1), pad), w, dilation=dilation).permute(0, 2, 1) + layer.bias.torch()
    torch.testing.assert_close(y.torch(), ref)
    assert layer.compute_output_shape((None, 7, 4)) == (None, ref.shape[1], 3)


def test_conv1d_causal_output_sees_only_the_past():
    layer = L.Conv1D(2, 3, padding="causal", dtype=D, seed=0)
    x = _t(1, 6, 2)
    later = x.clone()
    later[:, 4:] += 1.0
    torch.testing.assert_close(layer(x).torch()[:, :4], layer(later).torch()[:, :4])


def test_conv1d_gradients_match_finite_differences():
    layer = L.Conv1D(2, 3, strides=2, padding="same", dtype=D, seed=2)
    layer.build((None, 5, 2))
    _grads_match_finite_differences(layer, [_t(2, 5, 2)], layer.trainable_variables)


# -- activations ---------------------------------------------------------------------------

def test_leaky_relu_default_slope_is_keras_and_alpha_is_its_keras2_name():
    x = _t(3, 4)
    torch.testing.assert_close(L.LeakyReLU()(x).torch(), F.leaky_relu(x, 0.3))
    torch.testing.assert_close(L.LeakyReLU(alpha=0.2)(x).torch(), F.leaky_relu(x, 0.2))
    with pytest.raises(ValueError, match="not both"):
        L.LeakyReLU(negative_slope=0.1, alpha=0.2)


def test_relu_options_follow_keras_formula():
    x = torch.tensor([-2.0, -0.5, 0.2, 0.7, 1.5, 3.0], dtype=D)
    got = L.ReLU(max_value=2.0, negative_slope=0.1, threshold=0.5)(x).torch()
    want = torch.where(x >= 2.0, 2.0, torch.where(x >= 0.5, x, 0.1 * (x - 0.5)))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(L.ReLU()(x).torch(), torch.relu(x))
    torch.testing.assert_close(L.ReLU(max_value=1.0)(x).torch(), torch.clamp(x, 0, 1))


def test_relu_and_leaky_relu_gradients_match_finite_differences():
    x = torch.tensor([[-2.0, -0.4, 0.3, 0.9, 1.6, 3.1]], dtype=D)  # away from the kinks
    _grads_match_finite_differences(L.ReLU(max_value=2.0, negative_slope=0.1, threshold=0.5), [x])
    _grads_match_finite_differences(L.LeakyReLU(0.2), [x])


# -- merging -------------------------------------------------------------------------------

def test_add_multiply_concatenate_values_and_shapes():
    a, b, c = _t(2, 3, 4), _t(2, 3, 4, seed=1), _t(2, 3, 2, seed=2)
    torch.testing.assert_close(L.Add()([a, b, a]).torch(), a + b + a)
    torch.testing.assert_close(L.Multiply()([a, b]).torch(), a * b)
    torch.testing.assert_close(L.Concatenate()([a, c]).torch(), torch.cat([a, c], -1))
    torch.testing.assert_close(L.Concatenate(axis=1)([a, b]).torch(), torch.cat([a, b], 1))
    x, y = keras.Input((3, 4)), keras.Input((3, 2))
    assert L.Concatenate()([x, y]).shape == (None, 3, 6)
    with pytest.raises(ValueError, match="list of tensors"):
        L.Add()(a)


def test_merge_gradients_match_finite_differences():
    a, b = _t(2, 3), _t(2, 3, seed=1)
    _grads_match_finite_differences(lambda x, y: L.Multiply()([x, L.Add()([x, y])]), [a, b])
    _grads_match_finite_differences(lambda x, y: L.Concatenate(axis=0)([x, y * y]), [a, b])


def test_merge_masks_and_keras_concatenate_masks():
    a = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    b = torch.tensor([[1, 0, 1]], dtype=torch.bool)
    x = [dtape.constant(_t(1, 3, 2)), dtape.constant(_t(1, 3, 2))]
    ma, mb = dtape.constant(a), dtape.constant(b)
    assert L.Add().compute_mask(x, [ma, mb]).torch().tolist() == [[True, False, False]]
    assert L.Add().compute_mask(x, [ma, None]).torch().tolist() == [[True, True, False]]
    assert L.Concatenate().compute_mask(x, [ma, mb]).torch().tolist() == [[True, False, False]]
    assert L.Concatenate(axis=1).compute_mask(x, [ma, None]).torch().tolist() == [[True, True, False] + [True] * 3]
    assert L.Add().compute_mask(x, None) is None


# -- reshaping ----------------------------------------------------------------------------

def test_permute_matches_torch_and_checks_dims():
    x = _t(2, 3, 4, 5)
    torch.testing.assert_close(L.Permute((3, 1, 2))(x).torch(), x.permute(0, 3, 1, 2))
    assert L.Permute((2, 1)).compute_output_shape((None, 3, 4)) == (None, 4, 3)
    with pytest.raises(ValueError, match="permutation"):
        L.Permute((0, 1))


def test_upsampling2d_matches_torch_nearest_and_its_gradient_sums_the_copies():
    x = _t(2, 3, 4, 2)
    y = L.UpSampling2D((2, 3))(x)
    ref = F.interpolate(x.permute(0, 3, 1, 2), scale_factor=(2, 3), mode="nearest").permute(0, 2, 3, 1)
    torch.testing.assert_close(y.torch(), ref)
    _grads_match_finite_differences(L.UpSampling2D(), [_t(1, 2, 2, 1)])
    with pytest.raises(ValueError, match="nearest"):
        L.UpSampling2D(interpolation="bilinear")


# -- masking: Embedding(mask_zero) -> GlobalAveragePooling1D -----------------------------------

def _masked_mean(emb, ids):
    keep = (ids != 0).to(D)[..., None]
    return (emb[ids] * keep).sum(1) / keep.sum(1)


def test_global_average_pooling1d_mask_averages_kept_steps_and_gradients_match():
    x, mask = _t(2, 4, 3), torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    got = L.GlobalAveragePooling1D()(x, mask=dtape.constant(mask)).torch()
    torch.testing.assert_close(got, (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True))
    torch.testing.assert_close(L.GlobalAveragePooling1D()(x).torch(), x.mean(1))
    assert L.GlobalAveragePooling1D(keepdims=True).compute_output_shape((None, 4, 3)) == (None, 1, 3)
    _grads_match_finite_differences(lambda t: L.GlobalAveragePooling1D()(t, mask=dtape.constant(mask)), [x])


def test_embedding_mask_zero_flows_through_sequential_and_functional_models():
    ids = torch.tensor([[3, 1, 0, 0], [2, 2, 4, 0]])
    emb = L.Embedding(5, 3, mask_zero=True, dtype=D, seed=0)
    assert emb.compute_mask(ids).torch().tolist() == [[True, True, False, False], [True, True, True, False]]
    assert L.Embedding(5, 3).compute_mask(ids) is None
    want = _masked_mean(emb.embeddings.torch(), ids)
    seq = L.Sequential([emb, L.Dropout(0.5), L.GlobalAveragePooling1D()])
    torch.testing.assert_close(seq(ids).torch(), want)
    inp = keras.Input((None,), dtype="int64")
    model = keras.Model(inp, L.GlobalAveragePooling1D()(L.ReLU(max_value=100.0)(emb(inp))))
    torch.testing.assert_close(model(ids).torch(), _masked_mean(torch.clamp(emb.embeddings.torch(), 0, 100), ids))
    # padding ids are ignored: other padding lengths give the same vectors
    torch.testing.assert_close(seq(torch.tensor([[3, 1, 0, 0, 0, 0]])).torch(), want[:1])


# -- MultiHeadAttention ----------------------------------------------------------------

def _torch_mha(mha, e):
    """torch.nn.MultiheadAttention holding `mha`'s weights (embed_dim e = num_heads * key_dim)."""
    ref = torch.nn.MultiheadAttention(e, mha.num_heads, batch_first=True, dtype=D)
    v = [w.torch() for w in mha.trainable_variables]
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([v[0].reshape(e, e).T, v[2].reshape(e, e).T, v[4].reshape(e, e).T]))
        ref.in_proj_bias.copy_(torch.cat([v[1].reshape(e), v[3].reshape(e), v[5].reshape(e)]))
        ref.out_proj.weight.copy_(v[6].reshape(e, e).T)
        ref.out_proj.bias.copy_(v[7])
    return ref


def test_multi_head_attention_matches_torch_with_causal_and_padding_masks():
    mha = L.MultiHeadAttention(num_heads=2, key_dim=3, seed=0)
    mha.build((None, 4, 6))
    q, kv = _t(2, 4, 6), _t(2, 5, 6, seed=1)
    for w in mha.trainable_variables:  # nonzero biases
        w.assign(dtape.constant(_t(*tuple(w.shape), seed=len(w.name))))
    pad = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    out, scores = mha(query=q, value=kv, value_mask=pad, use_causal_mask=True, return_attention_scores=True)
    assert tuple(out.shape) == (2, 4, 6) and tuple(scores.shape) == (2, 2, 4, 5)
    ref = _torch_mha(mha, 6)
    causal = torch.ones(4, 5, dtype=torch.bool).tril().logical_not()
    want, want_scores = ref(q, kv, kv, key_padding_mask=~pad, attn_mask=causal, average_attn_weights=False)
    torch.testing.assert_close(out.torch(), want)
    torch.testing.assert_close(scores.torch(), want_scores)
    assert float(scores.torch()[0, :, :, 3:].abs().max()) < 1e-12     # padded keys get no attention
    # key given apart from value, and an explicit attention_mask [batch, T, S], ANDed
    key = _t(2, 5, 6, seed=2)
    allowed = torch.rand(2, 4, 5, generator=torch.Generator().manual_seed(3)) > 0.3
    allowed[:, :, 0] = True
    got = mha(q, kv, key=key, attention_mask=allowed)
    want, _ = ref(q, key, kv, attn_mask=(~allowed).repeat_interleave(2, dim=0))
    torch.testing.assert_close(got.torch(), want)


def test_multi_head_attention_output_shape_value_dim_and_functional_self_attention_mask():
    mha = L.MultiHeadAttention(num_heads=3, key_dim=2, value_dim=4, output_shape=5)
    out = mha(_t(2, 4, 6), _t(2, 7, 3))
    assert tuple(out.shape) == (2, 4, 5)
    assert [tuple(w.shape) for w in mha.trainable_variables] == [(6, 3, 2), (3, 2), (3, 3, 2), (3, 2), (3, 3, 4),
                                                                  (3, 4), (3, 4, 5), (5,)]
    # Embedding(mask_zero) -> self-attention: padding ids are neither queried nor attended (Keras's implicit masks)
    ids = keras.Input((None,), dtype="int64")
    emb = L.Embedding(7, 4, mask_zero=True, seed=1)
    att = L.MultiHeadAttention(2, 2, seed=2)
    x = emb(ids)
    y = att(x, x)
    assert y.shape == (None, None, 4)
    model = keras.Model(ids, L.GlobalAveragePooling1D()(y))
    short, padded = torch.tensor([[3, 5, 2]]), torch.tensor([[3, 5, 2, 0, 0]])
    torch.testing.assert_close(model(padded).torch(), model(short).torch())
    with pytest.raises(ValueError, match="value"):
        att(_t(1, 2, 4))


def test_multi_head_attention_gradients_match_finite_differences():
    mha = L.MultiHeadAttention(num_heads=2, key_dim=2, seed=4)
    mha.build((None, 2, 4))
    mha(_t(1, 2, 4), _t(1, 3, 4))
    for w in mha.trainable_variables:
        w.assign(dtape.constant(_t(*tuple(w.shape), seed=len(w.name)) * 0.5))
    keep = dtape.constant(torch.tensor([[True, True, False]]))
    _grads_match_finite_differences(lambda q, v: mha(q, v, value_mask=keep, use_causal_mask=True),
                                    [_t(1, 2, 4), _t(1, 3, 4, seed=1)], mha.trainable_variables)


def test_multi_head_attention_propagated_mask_is_the_query_and_self_attention_value_mask():
    mha = L.MultiHeadAttention(num_heads=2, key_dim=2, seed=5)
    x, m = _t(1, 4, 4), dtape.constant(torch.tensor([[True, True, True, False]]))
    out, scores = mha(x, x, mask=m, return_attention_scores=True)
    want, want_scores = mha(x, x, query_mask=m, value_mask=m, return_attention_scores=True)
    torch.testing.assert_close(out.torch(), want.torch())
    torch.testing.assert_close(scores.torch(), want_scores.torch())
    assert float(scores.torch()[0, :, :3, 3].abs().max()) < 1e-12        # kept queries skip the padded key
    # the padded query has every key masked: -1e9 on each score (Keras), so in float32 its probabilities are uniform
    mha32 = L.MultiHeadAttention(num_heads=2, key_dim=2, seed=5, dtype="float32")
    _, scores32 = mha32(x.float(), x.float(), mask=m, return_attention_scores=True)
    torch.testing.assert_close(scores32.torch()[0, :, 3], torch.full((2, 4), 0.25))


def test_transformer_tutorial_masked_loss_matches_torch_ignore_index_with_gradients():
    """TF's Transformer tutorial: Embedding(mask_zero=True) -> self-attention -> Add -> LayerNormalization -> Dense,
    and its masked_loss (reduction="none", times label != 0, over the count of kept labels), against torch's cross
    entropy with ignore_index=0 on the same logits, the gradient with respect to the logits included."""
    ids = keras.Input((None,), dtype="int64")
    h = L.Embedding(6, 4, mask_zero=True, seed=0)(ids)
    h = L.LayerNormalization()(L.Add()([h, L.MultiHeadAttention(2, 2, seed=1)(h, h)]))
    model = keras.Model(ids, L.Dense(6, seed=2)(h))
    tokens = torch.tensor([[1, 4, 2, 0, 0], [3, 5, 5, 2, 0]])
    labels = torch.tensor([[4, 2, 5, 0, 0], [5, 5, 2, 1, 0]])
    loss_object = dtape.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    logits = model(tokens)
    with dtape.GradientTape() as tape:
        tape.watch(logits)
        mask = dtape.cast(dtape.not_equal(dtape.constant(labels), 0), logits.dtype)
        loss = dtape.reduce_sum(loss_object(labels, logits) * mask) / dtape.reduce_sum(mask)
    got = tape.gradient(loss, logits)
    ref_logits = logits.torch().clone().requires_grad_(True)
    want = F.cross_entropy(ref_logits.reshape(-1, 6), labels.reshape(-1), ignore_index=0)
    want.backward()
    torch.testing.assert_close(loss.torch(), want.detach())
    torch.testing.assert_close(got.torch(), ref_logits.grad)
    # padding does not change the kept positions' logits: the mask reached attention (no causal mask here)
    torch.testing.assert_close(model(tokens[:1, :3]).torch(), logits.torch()[:1, :3])


def test_dcgan_tutorial_generator_and_discriminator_build_with_keras_shapes():
    """TF's DCGAN tutorial's two models, as written there (Sequential, input_shape on the first layer)."""
    generator = L.Sequential([
        L.Dense(7 * 7 * 256, use_bias=False, input_shape=(100,)), L.BatchNormalization(), L.LeakyReLU(),
        L.Reshape((7, 7, 256)),
        L.Conv2DTranspose(128, (5, 5), strides=(1, 1), padding="same", use_bias=False),
        L.BatchNormalization(), L.LeakyReLU(),
        L.Conv2DTranspose(64, (5, 5), strides=(2, 2), padding="same", use_bias=False),
        L.BatchNormalization(), L.LeakyReLU(),
        L.Conv2DTranspose(1, (5, 5), strides=(2, 2), padding="same", use_bias=False, activation="tanh")])
    assert generator.output_shape == (None, 28, 28, 1)              # known at construction, as Keras
    discriminator = L.Sequential([
        L.Conv2D(64, (5, 5), strides=(2, 2), padding="same", input_shape=[28, 28, 1]), L.LeakyReLU(),
        L.Dropout(0.3), L.Conv2D(128, (5, 5), strides=(2, 2), padding="same"), L.LeakyReLU(), L.Dropout(0.3),
        L.Flatten(), L.Dense(1)])
    images = generator(_t(2, 100), training=False)
    assert tuple(images.shape) == (2, 28, 28, 1) and float(dtape.reduce_max(dtape.abs(images))) <= 1.0
    assert tuple(discriminator(images).shape) == (2, 1)


def test_transformer_tutorial_cross_attention_layer_with_keyword_calls():
    """TF's Transformer tutorial's CrossAttention: mha(query=, key=, value=, return_attention_scores=True)
    inside a custom layer, then Add and LayerNormalization."""
    class CrossAttention(L.Layer):
        def __init__(self, **kwargs):
            super().__init__()
            self.mha = L.MultiHeadAttention(**kwargs)
            self.layernorm = L.LayerNormalization()
            self.add = L.Add()

        def call(self, x, context):
            attn_output, attn_scores = self.mha(query=x, key=context, value=context, return_attention_scores=True)
            self.last_attn_scores = attn_scores
            return self.layernorm(self.add([x, attn_output]))

    layer = CrossAttention(num_heads=2, key_dim=4)
    out = layer(_t(3, 5, 8), _t(3, 7, 8, seed=1))
    assert tuple(out.shape) == (3, 5, 8) and tuple(layer.last_attn_scores.shape) == (3, 2, 5, 7)
    torch.testing.assert_close(dtape.reduce_sum(layer.last_attn_scores, axis=-1).torch(), torch.ones(3, 2, 5, dtype=D))
    assert len(layer.trainable_variables) == 10                        # 8 attention + gamma, beta


def test_multi_head_attention_restored_before_its_first_call_and_without_biases(tmp_path):
    """Its variables are made by the first call (they need the value's size): a checkpoint restored before
    fills them then (deferred restoration), as for layers built by their first call."""
    q, kv = _t(1, 3, 4), _t(1, 2, 5, seed=1)
    trained = L.MultiHeadAttention(2, 3, seed=0)
    want = trained(q, kv)
    path = dtape.train.Checkpoint(layer=trained).save(str(tmp_path / "ckpt"))
    fresh = L.MultiHeadAttention(2, 3, seed=7)
    ckpt = dtape.train.Checkpoint(layer=fresh)       # kept alive until the values are in
    ckpt.restore(path)
    torch.testing.assert_close(fresh(q, kv).torch(), want.torch())
    del ckpt
    plain = L.MultiHeadAttention(2, 3, use_bias=False)
    plain(q, kv)
    assert [tuple(w.shape) for w in plain.trainable_variables] == [(4, 2, 3), (5, 2, 3), (5, 2, 3), (2, 3, 4)]


def test_global_max_pooling1d_values_shapes_and_gradient():
    x = _t(2, 4, 3)
    torch.testing.assert_close(L.GlobalMaxPooling1D()(x).torch(), x.amax(1))
    torch.testing.assert_close(L.GlobalMaxPooling1D(keepdims=True)(x).torch(), x.amax(1, keepdim=True))
    _grads_match_finite_differences(L.GlobalMaxPooling1D(), [x])
    with pytest.raises(ValueError, match="rank 3"):
        L.GlobalMaxPooling1D()(_t(2, 3))


@pytest.mark.parametrize("make,shapes", [
    (lambda: L.Conv2DTranspose(3, 3, strides=2, padding="same", dtype="mixed_bfloat16"), [(2, 4, 4, 2)]),
    (lambda: L.Conv1D(3, 3, padding="causal", dtype="mixed_bfloat16"), [(2, 5, 2)]),
    (lambda: L.MultiHeadAttention(2, 3, dtype="mixed_bfloat16"), [(2, 4, 6), (2, 5, 6)])])
def test_new_layers_under_a_mixed_policy_compute_in_bfloat16_and_keep_float32_variables(make, shapes):
    layer = make()
    with dtape.GradientTape() as tape:
        y = layer(*[torch.randn(*s) for s in shapes])
        loss = dtape.reduce_sum(dtape.cast(y, torch.float32))
    grads = tape.gradient(loss, layer.trainable_variables)
    assert y.dtype == torch.bfloat16
    assert all(v.dtype == torch.float32 and g.dtype == torch.float32 for v, g in zip(layer.trainable_variables, grads))
