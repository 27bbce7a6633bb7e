"""Model.save / keras.models.load_model / to_json / model_from_json: the rebuilt model gives the same outputs and
variables; under MirroredStrategy's scope it is made of MirroredVariables; custom layers and subclassed models
load through custom_objects; bad files and unknown classes give clear errors."""
import json
import zipfile

import numpy as np
import pytest

import dtape
from dtape import keras
from dtape.distribute import MirroredVariable
from tests._strategies import mirrored

pytestmark = pytest.mark.usefixtures("closes_strategies")

RNG = np.random.default_rng(5)
X = RNG.normal(size=(6, 5)).astype(np.float32)
IDS = np.array([[1, 2, 0], [3, 0, 0], [4, 4, 4], [2, 1, 0], [1, 0, 0], [3, 3, 0]])


def _functional():
    """Two inputs, a shared layer, a mask from Embedding(mask_zero), Concatenate, Dropout, BatchNormalization."""
    dense_in = keras.Input(shape=(5,), name="features")
    ids = keras.Input(shape=(3,), dtype="int64", name="ids")
    shared = keras.layers.Dense(4, activation="tanh", seed=1)
    a = shared(dense_in)
    b = shared(keras.layers.Dense(5, seed=2)(dense_in))
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(5, 4, mask_zero=True, seed=3)(ids))
    h = keras.layers.Concatenate()([a, b, pooled])
    h = keras.layers.BatchNormalization()(keras.layers.Dropout(0.3)(h))
    return keras.Model([dense_in, ids], keras.layers.Dense(2, seed=4, kernel_regularizer="l2")(h))


def _sequential():
    return keras.Sequential([keras.layers.Conv2D(3, 2, activation="relu", input_shape=(4, 4, 1), seed=1),
                             keras.layers.MaxPooling2D(), keras.layers.Flatten(), keras.layers.Dense(2, seed=2)])


class Scale(keras.layers.Layer):
    """A user's layer with its own constructor argument and weight (no get_config written: the default)."""

    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def build(self, input_shape):
        self.w = self.add_weight("w", shape=(input_shape[-1],), initializer="ones")

    def call(self, x):
        return x * self.w * self.factor


class Subclassed(keras.Model):
    def __init__(self, units=3, name=None):
        super().__init__(name=name)
        self.hidden, self.scale = keras.layers.Dense(units, activation="relu", seed=7), Scale(2.0)
        self.out = keras.layers.Dense(1, seed=8)

    def call(self, x, training=None):
        return self.out(self.scale(self.hidden(x)))


def _perturb(model):
    """Variables away from their initial values (ones, zeros), so a load that skipped them would show."""
    for i, v in enumerate(model.variables):
        v.assign(v.numpy() + 0.1 * (i + 1))


def _same_variables(a, b):
    assert [tuple(v.shape) for v in a.variables] == [tuple(v.shape) for v in b.variables]
    for u, v in zip(a.variables, b.variables):
        np.testing.assert_array_equal(u.numpy(), v.numpy())


def test_functional_round_trip(tmp_path):
    model = _functional()
    _perturb(model)
    path = model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(path)
    _same_variables(model, loaded)
    np.testing.assert_array_equal(loaded([X, IDS]).numpy(), model([X, IDS]).numpy())
    assert [l.name for l in loaded.layers] == [l.name for l in model.layers]
    assert loaded.output_shape == (None, 2) and len(loaded.losses) == len(model.losses) == 1  # the regularizer
    with zipfile.ZipFile(path) as z:
        assert sorted(z.namelist()) == ["config.json", "metadata.json", "model.weights.safetensors"]


def test_sequential_round_trip_and_training_continues(tmp_path):
    model = _sequential()
    _perturb(model)
    model.save(tmp_path / "s.keras")
    loaded = keras.models.load_model(tmp_path / "s.keras")
    images = RNG.normal(size=(4, 4, 4, 1)).astype(np.float32)
    np.testing.assert_array_equal(loaded(images).numpy(), model(images).numpy())
    loaded.compile("sgd", "mse")
    assert np.isfinite(loaded.fit(images, np.zeros((4, 2), np.float32), verbose=0).history["loss"][0])


def test_custom_layer_and_subclassed_model_with_custom_objects(tmp_path):
    model = Subclassed(units=4)
    model.build((None, 5))
    _perturb(model)
    model.save(tmp_path / "c.keras")
    with pytest.raises(ValueError, match="pass it in custom_objects"):
        keras.models.load_model(tmp_path / "c.keras")
    loaded = keras.models.load_model(tmp_path / "c.keras", custom_objects={"Subclassed": Subclassed})
    assert isinstance(loaded, Subclassed) and loaded.scale.factor == 2.0
    np.testing.assert_allclose(loaded(X).numpy(), model(X).numpy(), rtol=1e-6)
    inputs = keras.Input(shape=(5,))
    functional = keras.Model(inputs, Scale(3.0)(inputs))
    _perturb(functional)
    functional.save(tmp_path / "f.keras")
    again = keras.models.load_model(tmp_path / "f.keras", custom_objects={"Scale": Scale})
    np.testing.assert_allclose(again(X).numpy(), X * (1.1 * 3.0), rtol=1e-6)


def test_load_under_strategy_scope_gives_mirrored_variables(tmp_path):
    model = _functional()
    _perturb(model)
    model.save(tmp_path / "m.keras")
    strategy = mirrored(2)
    with strategy.scope():
        replicated = keras.models.load_model(tmp_path / "m.keras")
    assert replicated.variables and all(isinstance(v, MirroredVariable) for v in replicated.variables)
    _same_variables(model, replicated)
    replicated.compile("sgd", "mse")
    np.testing.assert_allclose(replicated.predict([X, IDS], batch_size=4), model([X, IDS]).numpy(), rtol=1e-6)


def test_to_json_and_model_from_json():
    model = _functional()
    text = model.to_json()
    assert json.loads(text)["class_name"] == "Functional"
    fresh = keras.models.model_from_json(text)
    assert [tuple(v.shape) for v in fresh.variables] == [tuple(v.shape) for v in model.variables]
    assert fresh([X, IDS]).shape == (6, 2)


def test_errors(tmp_path):
    (tmp_path / "not.keras").write_text("hello")
    with pytest.raises(ValueError, match="not a model saved by Model.save"):
        keras.models.load_model(tmp_path / "not.keras")
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="not built"):
        unbuilt.save(tmp_path / "u.keras")
    inputs = keras.Input(shape=(5,))
    odd = keras.Model(inputs, keras.layers.Dense(2, kernel_initializer=lambda shape, dtype, gen=None:
                                                 dtape.zeros(shape).torch())(inputs))
    with pytest.raises(TypeError, match="layer 'dense.*kernel_initializer|cannot save layer"):
        odd.save(tmp_path / "o.keras")
    _functional().save(tmp_path / "m.keras")
    with pytest.raises(FileExistsError):
        _functional().save(tmp_path / "m.keras", overwrite=False)


def squared(x):
    return x ** 2


@keras.saving.register_keras_serializable(package="tests")
class Wrapper(keras.layers.Layer):
    """Keras's save guide's pattern: a sublayer argument serialized with serialize_keras_object."""

    def __init__(self, sublayer, **kwargs):
        super().__init__(**kwargs)
        self.sublayer = sublayer

    def call(self, x):
        return self.sublayer(x)

    def get_config(self):
        return {**super().get_config(), "sublayer": keras.saving.serialize_keras_object(self.sublayer)}

    @classmethod
    def from_config(cls, config):
        return cls(keras.saving.deserialize_keras_object(config.pop("sublayer")), **config)


@keras.saving.register_keras_serializable(package="tests")
class Stack(keras.Model):
    def __init__(self, hidden_units, **kwargs):
        super().__init__(**kwargs)
        self.hidden_units = hidden_units
        self.dense_layers = [keras.layers.Dense(u, seed=i) for i, u in enumerate(hidden_units)]

    def call(self, inputs):
        for layer in self.dense_layers:
            inputs = layer(inputs)
        return inputs

    def get_config(self):
        return {"hidden_units": self.hidden_units}


def test_registered_objects_and_functions_as_the_save_guide_writes_them(tmp_path):
    assert keras.saving.load_model is keras.models.load_model is dtape.models.load_model
    assert keras.saving.register_keras_serializable is dtape.saving.register_keras_serializable
    inputs = keras.Input(shape=(4,))
    hidden = Wrapper(keras.layers.Dense(8, activation=squared, seed=3))(inputs)
    model = keras.Model(inputs, Stack([6, 2])(hidden))
    _perturb(model)
    model.save(tmp_path / "g.keras")
    with pytest.raises(ValueError, match="unknown class 'squared'"):  # a plain function: by custom_objects
        keras.saving.load_model(tmp_path / "g.keras")
    loaded = keras.saving.load_model(tmp_path / "g.keras", custom_objects={"squared": squared})
    x = RNG.normal(size=(3, 4)).astype(np.float32)
    np.testing.assert_allclose(loaded(x).numpy(), model(x).numpy(), rtol=1e-6)
    assert loaded.layers[1].sublayer.activation is squared and loaded.layers[2].hidden_units == [6, 2]
    _same_variables(model, loaded)


def test_constructor_arguments_are_not_children():
    # a layer given to a constructor but not kept as an attribute does not join the walk (its variables stay its own)
    class Uses(keras.layers.Layer):
        def __init__(self, template, **kwargs):
            super().__init__(**kwargs)
            self.units = template.units

    template = keras.layers.Dense(3)
    template.build((None, 2))
    layer = Uses(template)
    assert layer.get_config()["template"] is template and len(layer.variables) == 0 and len(layer.submodules) == 0


class Temperature(keras.layers.Layer):
    """A layer with a 0-d weight (a learned temperature)."""

    def build(self, input_shape):
        self.t = self.add_weight("t", shape=(), initializer="ones")

    def call(self, x):
        return x / self.t


def test_a_0d_variable_is_saved_and_loaded_as_0d(tmp_path):
    inputs = keras.Input(shape=(5,))
    model = keras.Model(inputs, Temperature()(inputs))
    model.layers[-1].t.assign(2.5)
    model.save(tmp_path / "t.keras")
    loaded = keras.models.load_model(tmp_path / "t.keras", custom_objects={"Temperature": Temperature})
    assert loaded.layers[-1].t.shape == () and loaded.layers[-1].t.numpy() == np.float32(2.5)
    np.testing.assert_array_equal(loaded.predict(X, verbose=0), X / np.float32(2.5))
