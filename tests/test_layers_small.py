"""Small layers of TF's tutorials: Lambda, Rescaling, Softmax, ZeroPadding2D (values, gradients against finite
differences in float64, configs), and keras.backend.get_value / set_value."""
import numpy as np
import pytest
import torch

import dtape
from dtape import keras
from tests.test_layers_tutorial import _float64_layers, _grads_match_finite_differences, _t  # noqa: F401

L = dtape.layers


def _roundtrip(layer):
    return type(layer).from_config(layer.get_config())


def test_rescaling_values_uint8_images_and_gradient():
    x = np.array([[0, 51, 255]], np.uint8)
    np.testing.assert_allclose(L.Rescaling(1.0 / 127.5, offset=-1.0)(x).numpy(), [[-1.0, -0.6, 1.0]], atol=1e-12)
    per_channel = L.Rescaling([1.0, 2.0, 3.0], offset=[0.0, 1.0, 2.0])
    np.testing.assert_allclose(per_channel(np.ones((2, 3))).numpy(), [[1.0, 3.0, 5.0]] * 2)
    _grads_match_finite_differences(L.Rescaling(0.5, offset=0.25), [_t(2, 3)])
    again = _roundtrip(L.Rescaling(0.5, offset=0.25, name="r"))
    assert (again.scale, again.offset, again.name) == (0.5, 0.25, "r")


def test_softmax_axis_values_and_gradient():
    x = _t(2, 3, 4)
    for axis in (-1, 1):
        torch.testing.assert_close(L.Softmax(axis=axis)(x).torch(), torch.softmax(x, dim=axis))
    _grads_match_finite_differences(L.Softmax(axis=1), [x])
    assert _roundtrip(L.Softmax(axis=1)).axis == 1
    with pytest.raises(ValueError, match="axis must be an int"):
        L.Softmax(axis=(1, 2))


@pytest.mark.parametrize("padding, want", [(1, ((1, 1), (1, 1))), ((2, 1), ((2, 2), (1, 1))),
                                           (((1, 0), (0, 2)), ((1, 0), (0, 2)))])
def test_zero_padding2d_forms_values_and_gradient(padding, want):
    x = _t(2, 3, 4, 2)
    layer = L.ZeroPadding2D(padding)
    (top, bottom), (left, right) = want
    torch.testing.assert_close(layer(x).torch(), torch.nn.functional.pad(x, (0, 0, left, right, top, bottom)))
    assert layer.compute_output_shape((None, 3, 4, 2)) == (None, 3 + top + bottom, 4 + left + right, 2)
    _grads_match_finite_differences(layer, [x])
    assert _roundtrip(layer).padding == want


def test_zero_padding2d_refuses_bad_padding():
    for bad in (-1, (1, 2, 3), ((1, -1), (0, 0)), "same"):
        with pytest.raises(ValueError, match="ZeroPadding2D padding must be"):
            L.ZeroPadding2D(bad)


def test_lambda_calls_its_function_with_arguments_in_a_functional_model_and_its_gradient():
    layer = L.Lambda(lambda v, power: v ** power, arguments={"power": 3})
    _grads_match_finite_differences(layer, [_t(2, 3)])
    inputs = keras.Input(shape=(3,))
    model = keras.Model(inputs, L.Lambda(lambda v: dtape.reduce_sum(v, axis=1, keepdims=True))(inputs))
    assert model.output_shape == (None, 1)
    np.testing.assert_allclose(model(np.array([[1.0, 2.0, 3.0]])).numpy(), [[6.0]])
    assert L.Lambda(lambda v: v, output_shape=(5,)).compute_output_shape((None, 4)) == (None, 5)
    config = L.Lambda(np.abs, arguments={"out": None}).get_config()
    assert config["function"] is np.abs and config["arguments"] == {"out": None}
    with pytest.raises(TypeError, match="callable"):
        L.Lambda(3)


def test_backend_get_value_and_set_value_read_and_assign_a_learning_rate():
    # TF's callbacks guide's LR scheduler: get_value(optimizer.learning_rate), set_value(..., new_lr)
    opt = keras.optimizers.SGD(0.1)
    assert keras.backend.get_value(opt.learning_rate) == pytest.approx(0.1)
    keras.backend.set_value(opt.learning_rate, 0.05)
    assert keras.backend.get_value(opt.learning_rate) == pytest.approx(0.05)
    v = dtape.Variable(np.ones((2, 2)))
    keras.backend.set_value(v, np.full((2, 2), 3.0))
    np.testing.assert_array_equal(keras.backend.get_value(v), np.full((2, 2), 3.0))
    assert keras.backend.get_value(2.5) == 2.5
    with pytest.raises(TypeError, match="set_value needs a variable"):
        keras.backend.set_value(np.ones(2), 1.0)


def test_the_keras_names_are_dtapes_objects():
    assert keras.backend.get_value is dtape.variables.get_value and keras.backend.set_value is dtape.variables.set_value
    for name in ("Lambda", "Rescaling", "Softmax", "ZeroPadding2D"):
        assert getattr(keras.layers, name) is getattr(dtape.layers, name)


def test_a_saved_model_with_the_layers_reloads_with_the_same_outputs(tmp_path):
    inputs = keras.Input(shape=(3, 3, 2))
    h = L.ZeroPadding2D(((1, 0), (0, 2)))(L.Rescaling(1.0 / 255, offset=-0.5)(inputs))
    outputs = L.Softmax(axis=1)(L.Dense(4)(L.Flatten()(h)))
    model = keras.Model(inputs, outputs)
    x = np.arange(36, dtype=np.float64).reshape(2, 3, 3, 2)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    np.testing.assert_array_equal(loaded(x).numpy(), model(x).numpy())
    assert [type(layer).__name__ for layer in loaded.layers][1:4] == ["Rescaling", "ZeroPadding2D", "Flatten"]
