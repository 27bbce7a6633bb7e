"""dtape.checkpoint: round trips, all-or-nothing restore, atomic writes, clear errors."""
import os

import numpy as np
import pytest
import torch

import dtape
from dtape import checkpoint, layers


def _model(seed):
    return layers.Sequential([layers.Dense(4, "relu", input_dim=3, seed=seed), layers.Dense(2, input_dim=4, seed=seed + 1)])


class _FakeOptimizer:
    """Duck-typed optimizer: state through a `variables()` method."""

    def __init__(self, value):
        self.iterations = dtape.Variable(torch.tensor(value))
        self.slot = dtape.Variable(np.full((2,), float(value), np.float32))

    def variables(self):
        return [self.iterations, self.slot]


class _FakeMirrored:
    """Duck-typed distributed variable: components in `.values`."""

    def __init__(self, value, n=2):
        self.values = tuple(dtape.Variable(value) for _ in range(n))
        self.shape = self.values[0].shape
        self.name = "mirrored"

    def _dtape_read(self):
        return self.values[0].read_value()

    def _handle(self):
        return self


def test_save_restore_round_trip_module_optimizer_variable_and_data(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    src, dst = _model(0), _model(10)
    v = dtape.Variable([1.0, 2.0])
    checkpoint.save(path, model=src, optimizer=_FakeOptimizer(7), v=v, step=12, note={"a": [1, 2]})
    opt, w = _FakeOptimizer(0), dtape.Variable([0.0, 0.0])
    data = checkpoint.restore(path, model=dst, optimizer=opt, v=w)
    for a, b in zip(src.variables, dst.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert int(opt.iterations.numpy()) == 7 and opt.slot.numpy().tolist() == [7.0, 7.0]
    assert w.numpy().tolist() == [1.0, 2.0]
    assert data == {"step": 12, "note": {"a": [1, 2]}}


def test_save_keeps_dtype(tmp_path):
    path = str(tmp_path / "c.pt")
    checkpoint.save(path, v=dtape.Variable(torch.arange(3, dtype=torch.float64)))
    assert checkpoint.read(path)["v"].dtype == torch.float64


def test_distributed_variable_saves_primary_restores_every_component(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    src = _FakeMirrored([1.0, 2.0])
    src.values[1].assign([9.0, 9.0])   # only the primary is saved
    checkpoint.save(path, v=src)
    dst = _FakeMirrored([0.0, 0.0], n=3)
    checkpoint.restore(path, v=dst)
    assert [c.numpy().tolist() for c in dst.values] == [[1.0, 2.0]] * 3


def test_restore_shape_mismatch_raises_and_assigns_nothing(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    checkpoint.save(path, a=dtape.Variable([1.0]), b=dtape.Variable([1.0, 2.0]))
    a, b = dtape.Variable([5.0]), dtape.Variable([5.0, 5.0, 5.0])
    with pytest.raises(ValueError, match=r"shape mismatch for b.*\(2,\).*\(3,\)"):
        checkpoint.restore(path, a=a, b=b)
    assert a.numpy().tolist() == [5.0]


def test_restore_missing_name_raises_naming_it(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    checkpoint.save(path, model=_model(0))
    with pytest.raises(ValueError, match="no 'optimizer' in checkpoint.*'model'"):
        checkpoint.restore(path, optimizer=_FakeOptimizer(0))


def test_restore_variable_count_mismatch_raises(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    checkpoint.save(path, model=_model(0))
    other = layers.Sequential([layers.Dense(4, input_dim=3)])
    with pytest.raises(ValueError, match="2 variables but checkpoint"):
        checkpoint.restore(path, model=other)


def test_save_failure_leaves_no_partial_file_and_keeps_old(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt.pt")
    checkpoint.save(path, v=dtape.Variable([1.0]))

    def broken_save(obj, f):
        f.write(b"partial bytes")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(path, v=dtape.Variable([2.0]))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["ckpt.pt"]
    assert checkpoint.read(path)["v"].tolist() == [1.0]


def test_save_new_file_failure_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "save", lambda obj, f: (f.write(b"x"), 1 / 0))
    with pytest.raises(ZeroDivisionError):
        checkpoint.save(str(tmp_path / "new.pt"), v=dtape.Variable([2.0]))
    assert os.listdir(tmp_path) == []


def test_read_rejects_foreign_file(tmp_path):
    path = str(tmp_path / "other.pt")
    torch.save({"x": torch.zeros(1)}, path)
    with pytest.raises(ValueError, match="not a dtape checkpoint"):
        checkpoint.read(path)


def test_save_with_real_optimizer_round_trip(tmp_path):
    optimizers = pytest.importorskip("dtape.optimizers")
    path = str(tmp_path / "ckpt.pt")
    model, opt = _model(0), optimizers.Adam(0.01)
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_sum(model(np.ones((2, 3), np.float32)) ** 2)
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    checkpoint.save(path, model=model, optimizer=opt)
    model2, opt2 = _model(5), optimizers.Adam(0.01)
    opt2.apply_gradients([(dtape.zeros_like(v), v) for v in model2.trainable_variables])
    checkpoint.restore(path, model=model2, optimizer=opt2)
    for a, b in zip(opt.variables(), opt2.variables()):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
