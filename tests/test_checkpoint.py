"""dtape.checkpoint: round trips, safe loading, corruption, names, atomic writes, CheckpointManager."""
import math
import os
import pickle
import random
import subprocess
import sys
import threading

import numpy as np
import pytest
import safetensors.torch
import torch

import dtape
from dtape import checkpoint, layers
from dtape import distribute as ds
from dtape.checkpoint import CheckpointError, CheckpointManager

DEVICES = ["cpu:0", "cpu:1"]


def _model(seed):
    return layers.Sequential([layers.Dense(4, "relu", input_dim=3, seed=seed), layers.Dense(2, input_dim=4, seed=seed + 1)])


class _FakeOptimizer:
    """Duck-typed optimizer: state through a `variables()` method."""

    def __init__(self, value):
        self.iterations = dtape.Variable(torch.tensor(value), name="opt/iterations")
        self.slot = dtape.Variable(np.full((2,), float(value), np.float32), name="opt/slot")

    def variables(self):
        return [self.iterations, self.slot]


class _Container:
    """Duck-typed container: state through a `.variables` attribute."""

    def __init__(self, *variables):
        self.variables = list(variables)


def _same(a, b):
    """Deep equality that also requires equal types (tensors: dtype, shape and bits)."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype == torch.bool
                                                                            else a, b.view(torch.uint8) if b.dtype == torch.bool else b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b and (not isinstance(a, float) or math.copysign(1, a) == math.copysign(1, b))


# -- round trips ------------------------------------------------------------------

def test_save_restore_round_trip_module_optimizer_variable_and_data(tmp_path):
    path = str(tmp_path / "ckpt")
    src, dst = _model(0), _model(10)
    assert src.variables[0].name != dst.variables[0].name      # dense/kernel vs dense_2/kernel: both match
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
    path = str(tmp_path / "c")
    checkpoint.save(path, v=dtape.Variable(torch.arange(3, dtype=torch.float64)))
    assert checkpoint.read(path)["v"].dtype == torch.float64


def test_plain_data_round_trips_with_types(tmp_path):
    path = tmp_path / "c"
    rng = torch.get_rng_state()
    data = {
        "none": None, "flag": True, "big": 2 ** 70, "neg": -3, "half": 0.5, "nan": float("nan"),
        "inf": float("-inf"), "negzero": -0.0, "text": "héllo \"quoted\" / slash",
        "nested": {"list": [1, [2.5, "x"]], "tuple": (1, (2, None)), 3: "int key", (1, "a"): "tuple key",
                   None: 0, 1.5: "float key", False: "bool key"},
        "rng": rng, "int64": torch.tensor([1, -2 ** 62]), "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "bools": torch.tensor([True, False]), "empty": torch.zeros(0, 3), "scalar": torch.tensor(7.0),
        "noncontig": torch.arange(6.0).reshape(2, 3).t(), "grad": torch.ones(2, requires_grad=True),
        "array": np.arange(6, dtype=np.float32).reshape(2, 3), "iarray": np.array([1, 2], np.int64),
        "barray": np.array([True, False]), "bigendian": np.array([1.0, 2.0], ">f8"),
        "npscalar": np.float64(0.25), "npint": np.int32(4),
    }
    checkpoint.save(path, meta=data)                  # os.PathLike path too
    got = checkpoint.read(path)["meta"]
    expected = dict(data, noncontig=data["noncontig"].contiguous(), grad=torch.ones(2),
                    bigendian=np.array([1.0, 2.0]), npscalar=0.25, npint=4)
    _same(got, expected)
    assert got["rng"].dtype == torch.uint8 and torch.equal(got["rng"], rng)
    assert all(t.device.type == "cpu" for t in (got["rng"], got["int64"]))
    torch.set_rng_state(got["rng"])                   # usable as an RNG state


class _Opaque:
    pass


@pytest.mark.parametrize("value, where", [
    (_Opaque(), "'meta'"),
    ({"a": [1, {2, 3}]}, "'meta'['a'][1]"),
    ({"x": dtape.constant(1.0)}, "'meta'['x']"),
    ({"f": len}, "'meta'['f']"),
    (np.array(["a"], dtype=object), "'meta'"),
    (np.array(["ab"]), "'meta'"),
    ({torch.zeros(1): 1}, "'meta' has a key of type Tensor"),
    (torch.zeros(2, 2).to_sparse(), "'meta'"),
    ({"od": __import__("collections").OrderedDict(a=1)}, "'meta'['od']"),
], ids=["object", "set", "dtape_tensor", "function", "object_array", "str_array", "tensor_key", "sparse",
        "ordered_dict"])
def test_save_rejects_other_data_naming_the_key(tmp_path, value, where):
    path = tmp_path / "c"
    with pytest.raises(TypeError, match="checkpoint data " + __import__("re").escape(where)):
        checkpoint.save(path, v=dtape.Variable(1.0), meta=value)
    assert os.listdir(tmp_path) == []


def test_save_rejects_self_containing_data(tmp_path):
    loop = [1]
    loop.append(loop)
    with pytest.raises(TypeError, match=r"'meta'\[1\] contains itself"):
        checkpoint.save(tmp_path / "c", meta=loop)


# -- safe loading -----------------------------------------------------------------

class _CreatesMarker:
    """Unpickling this calls open(marker, "w"): code from the file running."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("writer", ["torch_save", "pickle"])
def test_pickle_file_is_refused_without_running_code(tmp_path, writer):
    path, marker = str(tmp_path / "ckpt"), str(tmp_path / "code_ran")
    payload = {"__format__": "dtape.checkpoint/1", "x": _CreatesMarker(marker)}
    if writer == "torch_save":
        torch.save(payload, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(payload, f)
    for load in (checkpoint.read, lambda p: checkpoint.restore(p, v=dtape.Variable(1.0))):
        try:
            load(path)
            error = None
        except Exception as e:      # noqa: BLE001 (the type is asserted below, after the marker)
            error = e
        assert not os.path.exists(marker), "loading the checkpoint ran code from the file"
        assert isinstance(error, CheckpointError) and "pickle" in str(error) and path in str(error)


def test_checksummed_but_inconsistent_files_are_refused(tmp_path):
    """A checksum is no signature: a crafted file with a valid checksum must still load nothing odd."""
    cases = {
        "missing_tensor": ({}, {}, {"x": ["tensor", "__data__/0"]}),
        "bad_tag": ({}, {}, {"x": ["pickle", "cos\nsystem"]}),
        "bad_scalar": ({}, {}, {"x": ["int", "3"]}),
        "bad_object": ({}, {"v": [["v", 3]]}, {}),
        "object_without_tensor": ({}, {"v": [["v", "v"]]}, {}),
    }
    for name, (tensors, stored, data) in cases.items():
        path = str(tmp_path / name)
        with open(path, "wb") as f:
            f.write(checkpoint._serialize(tensors, stored, data))
        with pytest.raises(CheckpointError, match="corrupt"):
            checkpoint.read(path)


def test_a_checksummed_but_inconsistent_slot_table_is_refused(tmp_path):
    """The optimizer slot table names entries of its optimizer; anything else is a corrupt file. Broken on
    purpose: without the table check every one of these files was read as sound."""
    tensors = {"opt/0": torch.zeros(()), "v": torch.zeros(2)}
    stored = {"opt": [["opt/0", "Adam/iterations"]], "v": [["v", "v"]]}
    for slots in ({"opt": [["v", "v", "m"]]}, {"opt": [["opt/0", 3, "m"]]}, {"other": []}, {"opt": "x"},
                  {"opt": [["opt/0"]]}):
        path = str(tmp_path / "f")
        with open(path, "wb") as f:
            f.write(checkpoint._serialize(tensors, stored, {}, (), slots))
        with pytest.raises(CheckpointError, match="corrupt"):
            checkpoint.read(path)


def _flip_bits(path, raw, count, seed):
    """Writes `count` copies of `raw` with one random bit flipped each; returns the refused count."""
    rnd, refused = random.Random(seed), 0
    for _ in range(count):
        offset, bit = rnd.randrange(len(raw)), rnd.randrange(8)
        flipped = bytearray(raw)
        flipped[offset] ^= 1 << bit
        with open(path, "wb") as f:
            f.write(flipped)
        try:
            checkpoint.read(path)
        except CheckpointError:
            refused += 1
    return refused


def test_single_bit_flips_anywhere_are_refused(tmp_path):
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, model=_model(0), step=3, rng=torch.get_rng_state()[:64], note="x")
    with open(path, "rb") as f:
        raw = f.read()
    assert _flip_bits(path, raw, 200, seed=0) == 200
    with open(path, "wb") as f:
        f.write(raw)
    assert checkpoint.read(path)["step"] == 3         # the unflipped file still loads


def _write(content):
    def make(path):
        data = content(path) if callable(content) else content
        with open(path, "wb") as f:
            f.write(data)
    return make


def _valid_bytes(path):
    checkpoint.save(path, v=dtape.Variable(torch.arange(8.0)), step=1)
    with open(path, "rb") as f:
        return f.read()


def _framed(header):
    """A file of just `header` behind its 8-byte little-endian length (the safetensors framing)."""
    return len(header).to_bytes(8, "little") + header


def _header_end(raw):
    return 8 + int.from_bytes(raw[:8], "little")


@pytest.mark.parametrize("make, words", [
    (lambda p: None, "missing"),
    (_write(b""), "empty"),
    (os.mkdir, "directory"),
    (_write(random.Random(1).randbytes(4096)), "corrupt or not a dtape checkpoint"),
    (_write(b"\x00" * 64), "corrupt or not a dtape checkpoint"),
    (_write(lambda p: _valid_bytes(p)[:1]), "corrupt or not a dtape checkpoint"),
    (_write(lambda p: _valid_bytes(p)[:8]), "corrupt or not a dtape checkpoint"),
    (_write(lambda p: _valid_bytes(p)[:40]), "corrupt or not a dtape checkpoint"),
    (_write(lambda p: (r := _valid_bytes(p))[:_header_end(r)]), "corrupt"),
    (_write(lambda p: (r := _valid_bytes(p))[:len(r) // 2]), "corrupt"),
    (_write(lambda p: _valid_bytes(p)[:-1]), "corrupt"),
    (_write(lambda p: _valid_bytes(p) + b"\x00"), "corrupt"),
    (_write(safetensors.torch.save({"x": torch.zeros(2)})), "not a dtape checkpoint"),
    (_write(safetensors.torch.save({"x": torch.zeros(2)}, metadata={"dtape.format": "dtape.checkpoint/9"})),
     "not a dtape checkpoint"),
    (_write(_framed(b'{"__metadata__":{"dtape.format":"dtape.checkpoint/2"},"x":' + b"[" * 100_000
                    + b"]" * 100_000 + b"}")), "nested too deeply"),
    (_write(_framed(b'{"__metadata__":' + b"[" * 100_000 + b"]" * 100_000 + b"}")), "nested too deeply"),
    (_write(_framed(b'{"__metadata__":"dtape.checkpoint/2"}')), "not a dtape checkpoint"),
], ids=["missing", "empty", "directory", "random", "zeros", "trunc1", "trunc8", "trunc40", "trunc_header",
        "trunc_half", "trunc_last", "appended", "foreign_safetensors", "other_version", "deep_header",
        "deep_metadata", "metadata_not_a_dict"])
def test_unreadable_files_raise_one_error_naming_the_file(tmp_path, make, words):
    path = str(tmp_path / "ckpt")
    make(path)
    for load in (checkpoint.read, lambda p: checkpoint.restore(p, v=dtape.Variable(torch.zeros(8)))):
        with pytest.raises(CheckpointError, match=words) as info:
            load(path)
        assert path in str(info.value)
    assert issubclass(CheckpointError, ValueError) and "CheckpointError" in checkpoint.__all__



@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_device_is_refused_before_anything_is_read():
    """/dev/zero never ends: reading it until the header says stop ran the machine out of memory."""
    for load in (checkpoint.read, checkpoint.restore):
        with pytest.raises(CheckpointError, match=r"'/dev/zero' is not a regular file \(a character device\)"):
            load("/dev/zero")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_is_refused_instead_of_blocking(tmp_path):
    path = str(tmp_path / "fifo")
    os.mkfifo(path)
    outcome = []
    reader = threading.Thread(target=lambda: outcome.append(_error_of(checkpoint.read, path)), daemon=True)
    reader.start()
    reader.join(timeout=30)
    if reader.is_alive():       # blocked in open(): a writer releases it, so the test fails instead of hanging
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=30)
        pytest.fail("reading a FIFO blocked until a writer opened it")
    assert isinstance(outcome[0], CheckpointError) and "is not a regular file (a FIFO)" in str(outcome[0])
    assert path in str(outcome[0])


def _error_of(load, path):
    try:
        load(path)
    except Exception as e:  # noqa: BLE001 - returned for the test to check
        return e
    return None


def _bytes_read():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts reads with /proc/self/io")
@pytest.mark.parametrize("extra, words", [
    (256 << 20, "its header describes a file of"),       # a valid file with 256 MB (sparse) appended
    (None, "its header length field says"),             # a header length of 2**62 bytes
])
def test_a_size_that_disagrees_with_the_header_is_refused_before_the_file_is_read(tmp_path, extra, words):
    path = str(tmp_path / "ckpt")
    raw = _valid_bytes(path)
    if extra is None:
        with open(path, "wb") as f:
            f.write((2 ** 62).to_bytes(8, "little") + raw[8:])
        size = len(raw)
    else:
        size = len(raw) + extra
        os.truncate(path, size)
    before = _bytes_read()
    error = _error_of(checkpoint.read, path)
    assert isinstance(error, CheckpointError) and words in str(error) and path in str(error), error
    assert f"the file has {size} bytes" in str(error)
    assert _bytes_read() - before < len(raw) + (1 << 20)     # the header, not the 256 MB


# -- restore checks ---------------------------------------------------------------

def test_restore_renamed_variable_is_an_error_unless_not_strict(tmp_path):
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, v=dtape.Variable([1.0], name="weights"))
    target = dtape.Variable([5.0], name="bias")
    with pytest.raises(ValueError, match=r"checkpoint has 'weights', variable is 'bias'.*strict=False"):
        checkpoint.restore(path, v=target)
    assert target.numpy().tolist() == [5.0]
    checkpoint.restore(path, strict=False, v=target)
    assert target.numpy().tolist() == [1.0]


def test_restore_reordered_variables_is_an_error_unless_not_strict(tmp_path):
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, c=_Container(dtape.Variable([1.0], name="a"), dtape.Variable([2.0], name="b")))
    a, b = dtape.Variable([0.0], name="a"), dtape.Variable([0.0], name="b")
    with pytest.raises(ValueError, match=r"c/0: checkpoint has 'a', variable is 'b'; c/1: checkpoint has 'b', "
                                         r"variable is 'a'"):
        checkpoint.restore(path, c=_Container(b, a))
    assert a.numpy().tolist() == [0.0] and b.numpy().tolist() == [0.0]
    checkpoint.restore(path, strict=False, c=_Container(b, a))      # by position
    assert b.numpy().tolist() == [1.0] and a.numpy().tolist() == [2.0]


class _Model(dtape.Module):
    def __init__(self, parts):
        super().__init__()
        self.parts = parts


def test_strict_restore_refuses_reordered_default_named_layers(tmp_path):
    """Default names (dense, dense_1, ...) match by the order of their numbers within the object."""
    path = str(tmp_path / "ckpt")
    saved = [layers.Dense(4, input_dim=4, seed=i) for i in range(2)]               # dense_a < dense_b
    checkpoint.save(path, m=_Model(saved))
    first, second = (layers.Dense(4, input_dim=4, seed=9) for _ in range(2))      # new, higher numbers
    assert first.name != saved[0].name
    before = [v.numpy().copy() for v in first.variables + second.variables]
    with pytest.raises(ValueError, match=rf"m/0: checkpoint has '{saved[0].name}/kernel', variable is "
                                         rf"'{second.name}/kernel'.*strict=False"):
        checkpoint.restore(path, m=_Model([second, first]))
    for v, b in zip(first.variables + second.variables, before):                  # nothing assigned
        np.testing.assert_array_equal(v.numpy(), b)
    checkpoint.restore(path, m=_Model([first, second]))                           # a second instance: same order
    for old, new in zip(_Model(saved).variables, _Model([first, second]).variables):
        np.testing.assert_array_equal(old.numpy(), new.numpy())


def test_strict_restore_compares_user_chosen_names_exactly(tmp_path):
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, m=_Container(dtape.Variable(1.0, name="w_1"), dtape.Variable(2.0, name="w_2")),
                    v=dtape.Variable(3.0, name="w_1"), u=_Container(dtape.Variable(4.0), dtape.Variable(5.0)))
    a, b = dtape.Variable(0.0, name="w_2"), dtape.Variable(0.0, name="w_1")
    with pytest.raises(ValueError, match=r"m/0: checkpoint has 'w_1', variable is 'w_2'; "
                                         r"m/1: checkpoint has 'w_2', variable is 'w_1'"):
        checkpoint.restore(path, m=_Container(a, b))
    with pytest.raises(ValueError, match=r"v: checkpoint has 'w_1', variable is 'w_2'"):
        checkpoint.restore(path, v=a)                                             # renamed, not reordered
    assert float(a) == 0.0 and float(b) == 0.0
    x, y = dtape.Variable(0.0), dtape.Variable(0.0)                               # Variable_<n>: by order
    with pytest.raises(ValueError, match=rf"u/0: checkpoint has 'Variable_\d+', variable is '{y.name}'"):
        checkpoint.restore(path, u=_Container(y, x))
    checkpoint.restore(path, u=_Container(x, y))
    assert (float(x), float(y)) == (4.0, 5.0)


def test_restore_dtype_mismatch_raises_and_assigns_nothing(tmp_path):
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, a=dtape.Variable([1.0]), b=dtape.Variable(torch.tensor([2.0], dtype=torch.float64)))
    a, b = dtape.Variable([5.0]), dtape.Variable([5.0])
    for strict in (True, False):
        with pytest.raises(ValueError, match=r"dtype mismatch for b.*torch.float64.*torch.float32"):
            checkpoint.restore(path, strict=strict, a=a, b=b)
    assert a.numpy().tolist() == [5.0] and b.numpy().tolist() == [5.0]


def test_restore_shape_mismatch_raises_and_assigns_nothing(tmp_path):
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, a=dtape.Variable([1.0]), b=dtape.Variable([1.0, 2.0]))
    a, b = dtape.Variable([5.0]), dtape.Variable([5.0, 5.0, 5.0])
    with pytest.raises(ValueError, match=r"shape mismatch for b.*\(2,\).*\(3,\)"):
        checkpoint.restore(path, a=a, b=b)
    assert a.numpy().tolist() == [5.0]


def test_restore_missing_name_raises_naming_it(tmp_path):
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, model=_model(0))
    with pytest.raises(ValueError, match="no 'optimizer' in checkpoint.*'model'"):
        checkpoint.restore(path, optimizer=_FakeOptimizer(0))


def test_restore_variable_count_mismatch_raises(tmp_path):
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, model=_model(0))
    other = layers.Sequential([layers.Dense(4, input_dim=3)])
    with pytest.raises(ValueError, match="2 variables but checkpoint"):
        checkpoint.restore(path, model=other)


def test_save_with_real_optimizer_round_trip(tmp_path):
    path = str(tmp_path / "ckpt")
    model, opt = _model(0), dtape.optimizers.Adam(0.01)
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_sum(model(np.ones((2, 3), np.float32)) ** 2)
    opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    checkpoint.save(path, model=model, optimizer=opt)
    model2, opt2 = _model(5), dtape.optimizers.Adam(0.01)
    opt2.build(model2.trainable_variables)
    checkpoint.restore(path, model=model2, optimizer=opt2)
    for a, b in zip(opt.variables(), opt2.variables()):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a.numpy(), b.numpy())


# -- distributed variables --------------------------------------------------------

def _mirrored_state(strategy, seed):
    with strategy.scope():
        model, opt = _model(seed), dtape.optimizers.Adam(0.1)
        counter = dtape.Variable(0.0, name="counter", synchronization=ds.VariableSynchronization.ON_READ,
                                 aggregation=ds.VariableAggregation.SUM)
    return model, opt, counter


def _mirrored_step(strategy, model, opt, x):
    def step(batch):
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(model(batch) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    for batch in strategy.experimental_distribute_dataset([x]):
        strategy.run(step, args=(batch,))


def _components_equal(var, expected):
    for component in var.values:
        np.testing.assert_array_equal(component.numpy(), expected)


@pytest.mark.parametrize("devices", [DEVICES, ["cpu:0", "cpu:1", "cpu:2"]], ids=["same", "three_replicas"])
def test_mirrored_model_optimizer_and_sync_on_read_restore_into_fresh_strategy(tmp_path, devices):
    path, x = str(tmp_path / "ckpt"), np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    strategies = [ds.MirroredStrategy(DEVICES, timeout=30), ds.MirroredStrategy(devices, timeout=30)]
    try:
        model, opt, counter = _mirrored_state(strategies[0], 0)
        _mirrored_step(strategies[0], model, opt, x)
        strategies[0].run(lambda: counter.assign_add(float(ds.get_replica_context().replica_id_in_sync_group + 1)))
        assert float(counter.read_value()) == 3.0 and len(opt.variables()) == 10  # with learning_rate
        checkpoint.save(path, model=model, optimizer=opt, counter=counter)

        model2, opt2, counter2 = _mirrored_state(strategies[1], 7)
        with strategies[1].scope():
            opt2.build(model2.trainable_variables)
        checkpoint.restore(path, model=model2, optimizer=opt2, counter=counter2)
        for src, dst in zip(list(model.variables) + opt.variables(), list(model2.variables) + opt2.variables()):
            _components_equal(src, src.values[0].numpy())
            _components_equal(dst, src.values[0].numpy())
        assert int(opt2.iterations.numpy()) == 1
        assert float(counter2.read_value()) == 3.0      # the aggregate, not one replica's share
        for strategy, m, o in ((strategies[0], model, opt), (strategies[1], model2, opt2)):
            _mirrored_step(strategy, m, o, x)           # the restored run continues identically
        for src, dst in zip(model.variables, model2.variables):
            np.testing.assert_allclose(dst.values[-1].numpy(), src.values[0].numpy(), rtol=1e-6, atol=1e-7)
        with strategies[1].scope():
            renamed = dtape.Variable(0.0, name="other")
        with pytest.raises(ValueError, match="checkpoint has 'counter', variable is 'other'"):
            checkpoint.restore(path, counter=renamed)
    finally:
        for strategy in strategies:
            getattr(strategy, "close", lambda: None)()


# -- atomic writes, leftovers, file mode ---------------------------------------------

def test_save_failure_leaves_no_partial_file_and_keeps_old(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, v=dtape.Variable([1.0]))

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(path, v=dtape.Variable([2.0]))
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["ckpt"]
    assert checkpoint.read(path)["v"].tolist() == [1.0]


def test_save_new_file_failure_creates_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "replace", lambda a, b: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        checkpoint.save(str(tmp_path / "new"), v=dtape.Variable([2.0]))
    assert os.listdir(tmp_path) == []


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


def test_save_removes_leftover_temporaries_of_killed_saves(tmp_path):
    names = {"dead": f".ckpt.{_dead_pid()}.0a1b2c3d4e5f.tmp", "old_mkstemp": ".ckpt.k3j_x9q2.tmp",
             "live_this_process": f".ckpt.{os.getpid()}.00ff00ff00ff.tmp", "other_file": f".ckpt2.{_dead_pid()}.ab.tmp",
             "unrelated": ".ckpt.notes", "prefix_only": "ckpt.1.tmp"}
    for name in names.values():
        (tmp_path / name).write_bytes(b"partial")
    checkpoint.save(tmp_path / "ckpt", v=dtape.Variable([1.0]))
    kept = set(os.listdir(tmp_path))
    assert names["dead"] not in kept and names["old_mkstemp"] not in kept
    assert kept == {"ckpt", names["live_this_process"], names["other_file"], names["unrelated"], names["prefix_only"]}


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_saved_file_gets_the_mode_the_umask_gives(tmp_path, umask, mode):
    path = tmp_path / "ckpt"
    path.write_bytes(b"old")
    os.chmod(path, 0o600)
    old = os.umask(umask)
    try:
        checkpoint.save(path, v=dtape.Variable([1.0]))
        checkpoint.save(tmp_path / "new", v=dtape.Variable([1.0]))
    finally:
        os.umask(old)
    assert oct(os.stat(path).st_mode & 0o777) == oct(mode)
    assert oct(os.stat(tmp_path / "new").st_mode & 0o777) == oct(mode)


# -- CheckpointManager --------------------------------------------------------------

def test_manager_numbers_keeps_max_and_deletes_oldest(tmp_path):
    folder = tmp_path / "run"                           # created by the first save
    manager = CheckpointManager(folder, max_to_keep=2)
    assert manager.checkpoints == [] and manager.latest_checkpoint is None
    assert checkpoint.latest_checkpoint(folder) is None
    paths = [manager.save(v=dtape.Variable([float(i)]), step=i) for i in range(1, 4)]
    assert paths == [os.path.join(str(folder), f"ckpt-{i}") for i in (1, 2, 3)]
    assert manager.checkpoints == paths[1:] and sorted(os.listdir(folder)) == ["ckpt-2", "ckpt-3"]
    assert manager.latest_checkpoint == checkpoint.latest_checkpoint(str(folder)) == paths[2]
    assert checkpoint.read(manager.latest_checkpoint)["step"] == 3
    target = dtape.Variable([0.0])
    checkpoint.restore(manager.latest_checkpoint, v=target)
    assert target.numpy().tolist() == [3.0]


def test_manager_explicit_numbers_and_their_errors(tmp_path):
    manager = CheckpointManager(tmp_path, max_to_keep=None)
    assert manager.save(checkpoint_number=10, v=dtape.Variable([1.0])).endswith("ckpt-10")
    assert manager.save(v=dtape.Variable([2.0])).endswith("ckpt-11")
    assert manager.save(checkpoint_number=np.int64(11), v=dtape.Variable([3.0])).endswith("ckpt-11")  # overwrite
    assert checkpoint.read(manager.latest_checkpoint)["v"].tolist() == [3.0]
    with pytest.raises(ValueError, match="checkpoint_number 5 is below the latest kept checkpoint number 11"):
        manager.save(checkpoint_number=5, v=dtape.Variable([0.0]))
    for bad in (True, 1.0, "12"):
        with pytest.raises(TypeError, match="checkpoint_number must be an int"):
            manager.save(checkpoint_number=bad, v=dtape.Variable([0.0]))
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-10", "ckpt-11"]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_manager_rejects_bad_max_to_keep(tmp_path, bad):
    with pytest.raises(ValueError, match="max_to_keep must be a positive int or None"):
        CheckpointManager(tmp_path, max_to_keep=bad)


def test_manager_sees_earlier_files_and_ignores_others(tmp_path):
    for name in ["ckpt-1", "ckpt-2", "ckpt-10", "ckpt-3", "ckpt-x", "ckpt-4.bak", "other-99", ".ckpt-5.1.ab.tmp"]:
        (tmp_path / name).write_bytes(b"")
    manager = CheckpointManager(str(tmp_path), max_to_keep=2, checkpoint_name="ckpt")
    assert [os.path.basename(p) for p in manager.checkpoints] == ["ckpt-1", "ckpt-2", "ckpt-3", "ckpt-10"]
    assert manager.save(v=dtape.Variable([1.0])).endswith("ckpt-11")
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt-10", "ckpt-11", "ckpt-x", "ckpt-4.bak", "other-99",
                                                   ".ckpt-5.1.ab.tmp"])
    assert checkpoint.latest_checkpoint(tmp_path, "other").endswith("other-99")
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(CheckpointError, match="is a file, not a directory"):
        checkpoint.latest_checkpoint(tmp_path / "file")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_and_mixed_device_variables_round_trip(tmp_path):
    path = str(tmp_path / "ckpt")
    v = dtape.Variable(torch.arange(4.0, device="cuda:0"))
    strategy = ds.MirroredStrategy(["cpu:0", "cuda:0"], timeout=30)
    try:
        with strategy.scope():
            w = dtape.Variable(torch.arange(3.0))
        checkpoint.save(path, v=v, w=w)
        assert checkpoint.read(path)["v"].device.type == "cpu"
        v2 = dtape.Variable(torch.zeros(4, device="cuda:0"))
        with strategy.scope():
            w2 = dtape.Variable(torch.zeros(3))
        checkpoint.restore(path, v=v2, w=w2)
        assert v2.torch().device.type == "cuda" and v2.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]
        assert [c.torch().device.type for c in w2.values] == ["cpu", "cuda"]
        _components_equal(w2, [0.0, 1.0, 2.0])
    finally:
        getattr(strategy, "close", lambda: None)()
