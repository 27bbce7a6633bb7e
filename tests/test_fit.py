"""Model.compile / fit / evaluate / predict and the callbacks, against a hand-written GradientTape loop."""
import csv
import glob
import os

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import dtape
from dtape import keras
from tests._strategies import mirrored

pytestmark = pytest.mark.usefixtures("closes_strategies")

RNG = np.random.default_rng(7)
X = RNG.normal(size=(71, 5)).astype(np.float32)  # batches of 32, 32, 7: the last one splits 4 / 3 over two replicas
Y = RNG.integers(0, 3, 71)


def _mlp(seed=1):
    inputs = keras.Input(shape=(5,))
    hidden = keras.layers.Dense(8, activation="relu", seed=seed)(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, seed=seed + 1)(hidden))


def _loss():
    return dtape.losses.SparseCategoricalCrossentropy(from_logits=True)


def _custom_loop(epochs, lr=0.5):
    """The per-step losses and final variables of the plain loop: one device, mean loss per batch, SGD."""
    model, opt = _mlp(), dtape.optimizers.SGD(lr)
    loss_fn = dtape.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    losses = []
    for _ in range(epochs):
        for start in range(0, len(X), 32):
            xb, yb = dtape.constant(X[start:start + 32]), dtape.constant(Y[start:start + 32])
            with dtape.GradientTape() as tape:
                loss = dtape.reduce_mean(loss_fn(yb, model(xb, training=True)))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            losses.append((float(loss), len(xb)))
    return losses, [v.numpy() for v in model.trainable_variables]


class Record(dtape.keras.callbacks.Callback):
    """Every hook called, in order, and the batch logs."""

    def __init__(self):
        super().__init__()
        self.calls, self.batch_losses, self.epoch_weights = [], [], []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            self.calls.append(name)
        return super().__getattribute__(name)

    def on_train_batch_end(self, batch, logs=None):
        self.batch_losses.append(logs["loss"])

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_weights.append([v.numpy().copy() for v in self.model.trainable_variables])


def _running_means(losses, epochs):
    """Keras's batch logs: the epoch's mean so far, each step weighted by its batch size."""
    out, per_epoch = [], len(losses) // epochs
    for e in range(epochs):
        total = count = 0.0
        for loss, n in losses[e * per_epoch:(e + 1) * per_epoch]:
            total, count = total + loss * n, count + n
            out.append(total / count)
    return out


@pytest.mark.parametrize("replicas", [1, 2])
def test_fit_gives_the_custom_loops_losses_and_variables(replicas):
    ref_losses, ref_vars = _custom_loop(epochs=2)
    strategy = mirrored(replicas) if replicas > 1 else None
    if strategy is None:
        model = _mlp()
        model.compile(dtape.optimizers.SGD(0.5), _loss(), metrics=["accuracy"])
    else:
        with strategy.scope():
            model = _mlp()
            model.compile(dtape.optimizers.SGD(0.5), _loss(), metrics=["accuracy"])
    record = Record()
    history = model.fit(X, Y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[record])
    np.testing.assert_allclose(record.batch_losses, _running_means(ref_losses, 2), rtol=1e-6)
    assert len(record.batch_losses) == 6
    for got, want in zip(model.trainable_variables, ref_vars):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-7)
    assert history.history["loss"] == [record.batch_losses[2], record.batch_losses[5]]
    assert history.epoch == [0, 1] and set(history.history) == {"loss", "accuracy"}


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_dataset_of_batches_and_a_dataloader_train_as_the_arrays(replicas):
    ref_losses, ref_vars = _custom_loop(epochs=1)
    strategy = mirrored(replicas) if replicas > 1 else dtape.distribute.get_strategy()
    batches = [(X[s:s + 32], Y[s:s + 32]) for s in range(0, 71, 32)]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.tensor(X), torch.tensor(Y)),
                                         batch_size=32, shuffle=False)
    for data in (batches, loader):
        with strategy.scope():
            model = _mlp()
            model.compile(dtape.optimizers.SGD(0.5), _loss())
        history = model.fit(data, epochs=1, verbose=0)
        np.testing.assert_allclose(history.history["loss"], _running_means(ref_losses, 1)[-1:], rtol=1e-6)
        for got, want in zip(model.trainable_variables, ref_vars):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="give neither y nor batch_size"):
        model.fit(batches, Y, verbose=0)


@pytest.mark.parametrize("replicas", [1, 2])
def test_evaluate_and_predict_values(replicas):
    strategy = mirrored(replicas) if replicas > 1 else dtape.distribute.get_strategy()
    with strategy.scope():
        model = _mlp()
        model.compile("sgd", _loss(), metrics=["accuracy"])
    logits = _mlp()(X).numpy()  # the same seeds: the same variables
    np.testing.assert_allclose(model.predict(X, batch_size=32), logits, rtol=1e-6, atol=1e-7)
    per_example = torch.nn.functional.cross_entropy(torch.tensor(logits, dtype=torch.float64), torch.tensor(Y),
                                                    reduction="none").numpy()
    loss, acc = model.evaluate(X, Y, batch_size=32)
    np.testing.assert_allclose(loss, per_example.mean(), rtol=1e-6)
    assert acc == pytest.approx(np.mean(logits.argmax(-1) == Y), abs=1e-7)
    assert model.evaluate(X, Y, batch_size=32, return_dict=True) == {"loss": loss, "accuracy": acc}


def test_a_custom_train_step_is_used():
    class Custom(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1, seed=3)
            self.tracker = dtape.metrics.Mean(name="half_loss")
            self.steps = 0

        def call(self, x, training=None):
            return self.dense(x)

        @property
        def metrics(self):
            return [self.tracker]

        def train_step(self, data):
            x, y = data
            self.steps += 1
            with dtape.GradientTape() as tape:
                loss = dtape.reduce_mean(dtape.square(self(x, training=True)[:, 0] - y)) / 2
            self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
            self.tracker.update_state(loss)
            return {"half_loss": self.tracker.result(), "steps": self.steps}

    model = Custom()
    model.compile(optimizer=dtape.optimizers.SGD(0.1))
    yf = X[:, 0] * 2.0
    history = model.fit(X, yf, batch_size=71, epochs=3, verbose=0)
    assert model.steps == 3 and history.history["steps"] == [1.0, 2.0, 3.0]
    losses = history.history["half_loss"]
    assert losses[2] < losses[1] < losses[0]
    w = model.dense.kernel.numpy()  # one step by hand from the first epoch's loss: it decreased as SGD says
    assert np.isfinite(w).all()


def test_compile_with_strings():
    model = _mlp()
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    assert isinstance(model.optimizer, dtape.optimizers.Adam) and model.optimizer.learning_rate == 1e-3
    yf = RNG.normal(size=(71, 3)).astype(np.float32)
    before = model(X).numpy()
    logs = model.evaluate(X, yf, batch_size=71, return_dict=True)
    np.testing.assert_allclose(logs["loss"], np.mean((before - yf) ** 2), rtol=1e-6)
    np.testing.assert_allclose(logs["mae"], np.mean(np.abs(before - yf)), rtol=1e-6)
    history = model.fit(X, yf, batch_size=71, epochs=2, verbose=0)
    np.testing.assert_allclose(history.history["loss"][0], logs["loss"], rtol=1e-6)
    assert history.history["loss"][1] < history.history["loss"][0]
    model.compile("sgd", "sparse_categorical_crossentropy", ["accuracy"])
    acc = model.metrics[1]  # Keras's "accuracy": sparse here from the shapes (labels of lower rank)
    acc.update_state([2, 0], [[0.1, 0.2, 0.7], [0.5, 0.4, 0.1]])
    assert acc.name == "accuracy" and float(acc.result()) == 1.0
    with pytest.raises(ValueError, match="unknown optimizer 'adamm'"):
        model.compile("adamm", "mse")
    with pytest.raises(ValueError, match="unknown loss 'mse2'"):
        model.compile("adam", "mse2")
    with pytest.raises(RuntimeError, match="call compile"):
        _mlp().fit(X, Y, verbose=0)


class Script(dtape.keras.callbacks.Callback):
    """Puts scripted values into the epoch logs under `key` (callbacks after it see them)."""

    def __init__(self, key, values):
        super().__init__()
        self.key, self.values = key, list(values)

    def on_epoch_end(self, epoch, logs=None):
        logs[self.key] = self.values[epoch]


def _compiled(lr=0.5):
    model = _mlp()
    model.compile(dtape.optimizers.SGD(lr), _loss())
    return model


def test_early_stopping_stops_at_the_right_epoch_and_restores_the_best_weights():
    model, record = _compiled(), Record()
    stop = keras.callbacks.EarlyStopping(monitor="score", patience=2, restore_best_weights=True)
    script = Script("score", [5.0, 4.0, 4.5, 4.6, 1.0, 0.5])
    history = model.fit(X, Y, epochs=6, verbose=0, shuffle=False, callbacks=[record, script, stop])
    assert history.epoch == [0, 1, 2, 3] and stop.stopped_epoch == 3 and stop.best_epoch == 1
    for got, want in zip(model.trainable_variables, record.epoch_weights[1]):
        np.testing.assert_array_equal(got.numpy(), want)
    assert np.abs(record.epoch_weights[3][0] - record.epoch_weights[1][0]).max() > 1e-4
    with pytest.raises(KeyError, match="'val_loss' is not in the logs"):
        _compiled().fit(X, Y, epochs=1, verbose=0, callbacks=[keras.callbacks.EarlyStopping()])


def test_learning_rate_scheduler_sets_the_rate_used_by_each_epoch():
    model = _compiled()
    seen = []

    class LR(dtape.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate))  # a variable, as Keras 3: read its value

    sched = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.1 * (epoch + 1))
    history = model.fit(X, Y, batch_size=71, epochs=3, verbose=0, callbacks=[sched, LR()])
    assert seen == pytest.approx([0.1, 0.2, 0.3]) and history.history["lr"] == pytest.approx([0.1, 0.2, 0.3])
    one_arg = keras.callbacks.LearningRateScheduler(lambda epoch: 0.01)
    model.fit(X, Y, batch_size=71, epochs=1, verbose=0, callbacks=[one_arg])
    assert float(model.optimizer.learning_rate) == 0.01


def test_reduce_lr_on_plateau():
    model = _compiled(lr=1.0)
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="score", factor=0.5, patience=2)
    history = model.fit(X, Y, batch_size=71, epochs=6, verbose=0,
                        callbacks=[Script("score", [3.0, 2.0, 2.0, 2.0, 2.0, 2.0]), plateau])
    # no improvement at epochs 2 and 3: halved after epoch 3; again after two more (4, 5)
    assert history.history["lr"] == [1.0, 1.0, 1.0, 1.0, 0.5, 0.5]
    assert float(model.optimizer.learning_rate) == 0.25


def test_csv_logger_writes_one_row_per_epoch(tmp_path):
    path = tmp_path / "log.csv"
    history = _compiled().fit(X, Y, epochs=2, verbose=0, validation_data=(X, Y),
                              callbacks=[keras.callbacks.CSVLogger(path)])
    rows = list(csv.reader(open(path)))
    assert rows[0] == ["epoch", "loss", "val_loss"]
    assert [int(r[0]) for r in rows[1:]] == [0, 1]
    np.testing.assert_allclose([[float(v) for v in r[1:]] for r in rows[1:]],
                               np.array([history.history["loss"], history.history["val_loss"]]).T, rtol=1e-6)
    _compiled().fit(X, Y, epochs=1, verbose=0, callbacks=[keras.callbacks.CSVLogger(path, append=True)])
    assert len(list(csv.reader(open(path)))) == 4  # one row more, no second header


def test_model_checkpoint_best_only_writes_on_improvement(tmp_path):
    model, record = _compiled(), Record()
    ckpt = keras.callbacks.ModelCheckpoint(str(tmp_path / "w-{epoch:02d}"), monitor="score", save_best_only=True,
                                           save_weights_only=True)
    model.fit(X, Y, epochs=4, verbose=0, callbacks=[record, Script("score", [3.0, 2.0, 2.5, 1.0]), ckpt])
    assert ckpt.saved == [str(tmp_path / f"w-{e:02d}") for e in (1, 2, 4)]
    assert sorted({os.path.basename(p).split(".")[0] for p in glob.glob(str(tmp_path / "w-*"))}) == \
        ["w-01", "w-02", "w-04"]
    fresh = _mlp(seed=20)
    fresh.load_weights(ckpt.saved[1])
    for got, want in zip(fresh.trainable_variables, record.epoch_weights[1]):
        np.testing.assert_array_equal(got.numpy(), want)
    model.save_weights(str(tmp_path / "last"))
    fresh.load_weights(str(tmp_path / "last"))
    for got, want in zip(fresh.trainable_variables, model.trainable_variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_tensorboard_writes_epoch_scalars(tmp_path):
    history = _compiled().fit(X, Y, epochs=2, verbose=0, validation_data=(X, Y),
                              callbacks=[keras.callbacks.TensorBoard(log_dir=tmp_path)])
    for which, key in (("train", "loss"), ("validation", "val_loss")):
        assert glob.glob(str(tmp_path / which / "events.out.tfevents.*"))
        acc = EventAccumulator(str(tmp_path / which))
        acc.Reload()
        events = acc.Scalars("epoch_loss")
        assert [e.step for e in events] == [0, 1]
        np.testing.assert_allclose([e.value for e in events], history.history[key], rtol=1e-6)


def test_custom_callback_hooks_come_in_keras_order():
    model, record = _compiled(), Record()
    model.fit(X[:64], Y[:64], batch_size=32, epochs=1, verbose=0, validation_data=(X[:32], Y[:32]),
              callbacks=[record])
    assert record.model is model and record.params == {"verbose": 0, "epochs": 1, "steps": 2}
    assert record.calls == ["on_train_begin", "on_epoch_begin",
                            "on_train_batch_begin", "on_train_batch_end", "on_train_batch_begin",
                            "on_train_batch_end", "on_test_begin", "on_test_batch_begin", "on_test_batch_end",
                            "on_test_end", "on_epoch_end", "on_train_end"]
    record.calls.clear()
    model.predict(X[:40], batch_size=32, callbacks=[record])
    assert record.calls == ["on_predict_begin", "on_predict_batch_begin", "on_predict_batch_end",
                            "on_predict_batch_begin", "on_predict_batch_end", "on_predict_end"]


def test_verbose_prints_a_line_per_epoch_or_a_bar(capsys):
    _compiled().fit(X, Y, epochs=2, verbose=2)
    out = capsys.readouterr()
    assert out.out.count("Epoch 1/2 - loss: ") == 1 and "Epoch 2/2 - loss: " in out.out
    _compiled().fit(X, Y, epochs=1, verbose=1)
    assert "3/3" in capsys.readouterr().err
    _compiled().fit(X, Y, epochs=1, verbose=0)
    assert capsys.readouterr() == ("", "")


def test_the_keras_2_custom_train_step_idiom_matches_the_built_in_step():
    class Idiom(keras.Model):
        def train_step(self, data):
            x, y = data
            with dtape.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compiled_loss(y, y_pred, regularization_losses=self.losses)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            self.compiled_metrics.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

    strategy = mirrored(2)
    histories = []
    for cls in (keras.Model, Idiom):
        with strategy.scope():
            base = _mlp()
            model = cls(base.input, base.output)
            model.compile(dtape.optimizers.SGD(0.5), _loss(), metrics=["accuracy"])
        histories.append(model.fit(X, Y, batch_size=32, epochs=2, shuffle=False, verbose=0).history)
    assert histories[0] == histories[1] and set(histories[0]) == {"loss", "accuracy"}
    assert min(histories[1]["accuracy"]) > 0.2  # updated by compiled_metrics
    ref_losses, _ = _custom_loop(epochs=2)
    np.testing.assert_allclose(histories[1]["loss"], _running_means(ref_losses, 2)[2::3], rtol=1e-6)


class _NotChief:
    """The default strategy as seen by a worker that does not checkpoint (rank > 0 under torchrun)."""

    def __init__(self, strategy):
        self._strategy = strategy
        self.extended = type("Extended", (), {"should_checkpoint": False})()

    def __getattr__(self, name):
        return getattr(self._strategy, name)


def test_only_the_worker_that_checkpoints_prints_and_writes(capsys, tmp_path):
    model = _compiled()
    compiled = vars(model)["_compiled"]
    compiled.strategy = _NotChief(compiled.strategy)
    path = tmp_path / "log.csv"
    history = model.fit(X, Y, epochs=2, verbose=2, callbacks=[keras.callbacks.CSVLogger(path),
                                                             keras.callbacks.TensorBoard(tmp_path / "tb")])
    model.fit(X, Y, epochs=1, verbose=1)
    assert capsys.readouterr() == ("", "") and len(history.history["loss"]) == 2
    assert not path.exists() and not (tmp_path / "tb").exists()


def test_compile_adds_no_variables_to_the_model():
    model = _mlp()
    before = [id(v) for v in model.variables]
    model.compile("adam", _loss(), metrics=["accuracy"])
    model.fit(X, Y, epochs=1, verbose=0)
    assert [id(v) for v in model.variables] == before and len(before) == 4


@pytest.mark.parametrize("replicas", [1, 2])
def test_sequential_fits_as_the_functional_model(replicas):
    ref_losses, ref_vars = _custom_loop(epochs=2)
    strategy = mirrored(replicas) if replicas > 1 else dtape.distribute.get_strategy()
    with strategy.scope():
        model = keras.Sequential([keras.layers.Dense(8, activation="relu", seed=1, input_shape=(5,)),
                                  keras.layers.Dense(3, seed=2)])
        model.compile(dtape.optimizers.SGD(0.5), _loss())
    history = model.fit(X, Y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], _running_means(ref_losses, 2)[2::3], rtol=1e-6)
    for got, want in zip(model.trainable_variables, ref_vars):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_loss_scale_optimizer_is_scaled_and_unscaled_by_fit(replicas):
    ref_losses, ref_vars = _custom_loop(epochs=1)
    strategy = mirrored(replicas) if replicas > 1 else dtape.distribute.get_strategy()
    with strategy.scope():
        model = _mlp()
        opt = dtape.mixed_precision.LossScaleOptimizer(dtape.optimizers.SGD(0.5), dynamic=False, initial_scale=1024)
        model.compile(opt, _loss())
    history = model.fit(X, Y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], _running_means(ref_losses, 1)[-1:], rtol=1e-6)
    for got, want in zip(model.trainable_variables, ref_vars):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def test_sample_weight_with_a_trailing_axis_weighs_each_example_once():
    # Keras users pass weights as [batch, 1]; times [batch] per-example losses that broadcast to a
    # [batch, batch] grid (fit reported 5.53 for a true 0.27, and the gradients were off)
    x = np.array([[1.0], [2.0], [3.0], [4.0]], np.float32)
    y = np.array([[1.0], [1.0], [2.0], [5.0]], np.float32)
    sw = np.array([[1.0], [0.0], [2.0], [0.5]], np.float32)
    model = keras.Sequential([keras.layers.Dense(1, input_shape=(1,), kernel_initializer="ones",
                                                 bias_initializer="zeros")])
    model.compile(keras.optimizers.SGD(0.0), keras.losses.MeanSquaredError())
    history = model.fit([(x, y, sw)], epochs=1, verbose=0)
    expected = float((((x - y) ** 2).reshape(-1) * sw.reshape(-1)).sum() / 4.0)    # 2.125
    assert history.history["loss"][-1] == pytest.approx(expected, rel=1e-6)
    weighted = dtape.nn.compute_average_loss(dtape.constant((x - y).reshape(-1) ** 2), sample_weight=sw,
                                             global_batch_size=4)
    assert float(weighted) == pytest.approx(expected, rel=1e-6)


def _masked_loss(label, pred):
    """TF's Transformer tutorial's loss: one value for the batch, the mean over the tokens whose label is not 0."""
    per_token = dtape.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")(label, pred)
    mask = dtape.cast(label != 0, per_token.dtype)
    return dtape.reduce_sum(per_token * mask) / dtape.reduce_sum(mask)


def _token_model():
    ids = keras.Input((None,), dtype="int64")
    return keras.Model(ids, keras.layers.Dense(4, seed=3)(keras.layers.Embedding(4, 3, mask_zero=True, seed=2)(ids)))


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_loss_function_returning_the_batchs_loss_trains_as_keras_takes_it(replicas):
    """Keras uses such a value as it is and, under a strategy, divides it by the replicas (the summed gradients are
    the mean of the replicas' losses' gradients): the update and the logged loss equal that plain loop's."""
    x = np.array([[1, 2, 0], [3, 1, 2], [2, 0, 0], [1, 1, 3]])
    y = np.array([[2, 0, 0], [1, 2, 3], [3, 0, 0], [2, 3, 1]])
    ref = _token_model()
    parts = [slice(0, 4)] if replicas == 1 else [slice(0, 2), slice(2, 4)]
    with dtape.GradientTape() as tape:
        losses = [_masked_loss(dtape.constant(y[p]), ref(x[p])) for p in parts]
        loss = dtape.add_n(losses) / float(len(parts))
    dtape.optimizers.SGD(0.5).apply_gradients(zip(tape.gradient(loss, ref.trainable_variables),
                                                  ref.trainable_variables))
    strategy = mirrored(replicas) if replicas > 1 else dtape.distribute.get_strategy()
    with strategy.scope():
        model = _token_model()
        model.compile(dtape.optimizers.SGD(0.5), loss=_masked_loss)
    history = model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    for got, want in zip(model.trainable_variables, ref.trainable_variables):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(history.history["loss"][0], float(loss), rtol=1e-6)
    with pytest.raises(ValueError, match="per-example losses"):
        model.fit([(x, y, np.ones(4, np.float32))], epochs=1, verbose=0)


def test_validation_data_for_a_model_with_two_inputs_is_the_keras_tuple():
    """validation_data=((x1, x2), y): a tuple is (x_val, y_val) as in Keras, though its first item is a tuple too."""
    a, b = keras.Input((5,)), keras.Input((5,))
    model = keras.Model([a, b], keras.layers.Dense(3, seed=1)(keras.layers.Concatenate()([a, b])))
    model.compile("sgd", loss=_loss())
    history = model.fit((X, X), Y, epochs=1, verbose=0, validation_data=((X, X), Y))
    np.testing.assert_allclose(history.history["val_loss"][0], model.evaluate((X, X), Y), rtol=1e-6)


@pytest.mark.parametrize("pack", [tuple, list])
def test_predict_gives_a_two_input_model_both_inputs(pack):
    """model.predict((x1, x2)) / predict([x1, x2]): the inputs, not an (x, y) pair (Keras packs x alone as (x,))."""
    a, b = keras.Input((5,)), keras.Input((5,))
    model = keras.Model([a, b], keras.layers.Concatenate()([a, b]))
    got = model.predict(pack([X, 2 * X]), batch_size=32)
    np.testing.assert_array_equal(got, np.concatenate([X, 2 * X], -1))


@pytest.mark.parametrize("replicas", [1, 2])
def test_validation_split_holds_out_the_last_examples_before_shuffling(replicas):
    # Keras: the last floor-complement of 71 * 0.2 (71 - floor(56.8) = 15 examples) is held out before fit shuffles;
    # the same fit with validation_data=(X[56:], Y[56:]) gives the same losses, bit for bit
    weights = np.linspace(0.5, 2.0, 71).astype(np.float32)
    histories = []
    for split in (True, False):
        strategy = mirrored(replicas) if replicas > 1 else dtape.distribute.get_strategy()
        with strategy.scope():
            model = _mlp()
            model.compile(keras.optimizers.SGD(0.3), _loss(), metrics=["accuracy"])
        np.random.seed(5)
        if split:
            history = model.fit(X, Y, batch_size=16, epochs=2, verbose=0, sample_weight=weights,
                                validation_split=0.2)
        else:
            history = model.fit(X[:56], Y[:56], batch_size=16, epochs=2, verbose=0, sample_weight=weights[:56],
                                validation_data=(X[56:], Y[56:], weights[56:]))
        histories.append(history.history)
    assert histories[0] == histories[1]
    assert set(histories[0]) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert histories[0]["val_loss"][0] != histories[0]["loss"][0]


def test_validation_split_of_several_inputs_and_its_errors():
    a, b = keras.Input((5,)), keras.Input((5,))
    model = keras.Model([a, b], keras.layers.Dense(3, seed=1)(keras.layers.Concatenate()([a, b])))
    model.compile(keras.optimizers.SGD(0.0), loss=_loss())
    history = model.fit([X, 2 * X], Y, epochs=1, verbose=0, validation_split=0.5)    # 35 train, 36 validate
    np.testing.assert_allclose(history.history["val_loss"][0], model.evaluate([X[35:], 2 * X[35:]], Y[35:]),
                               rtol=1e-6)
    with pytest.raises(ValueError, match="only supported for arrays.*validation_data"):
        model.fit([((X[:8], X[:8]), Y[:8])], epochs=1, verbose=0, validation_split=0.2)
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match=r"validation_split must be a float in \[0, 1\)"):
            model.fit([X, X], Y, verbose=0, validation_split=bad)
    with pytest.raises(ValueError, match="1 examples, too few to split by validation_split=0.2"):
        model.fit([X[:1], X[:1]], Y[:1], verbose=0, validation_split=0.2)
