"""Observability: check numerics, check_mirrored, torch.profiler ranges."""
import gc

import pytest
import torch

import dtape
from dtape import debugging
from dtape.distribute import MirroredStrategy
from dtape.ops import REGISTRY
from dtape.ops._registry import OpDef

InvalidArgumentError = debugging.InvalidArgumentError


@pytest.fixture
def check_numerics():
    debugging.enable_check_numerics()
    try:
        yield
    finally:
        debugging.disable_check_numerics()


def test_op_output_with_nan_raises_naming_the_op(check_numerics):
    x = dtape.constant([1.0, -1.0, 4.0])
    assert dtape.sqrt(dtape.constant([4.0])).numpy().tolist() == [2.0]  # finite: passes through
    with pytest.raises(InvalidArgumentError, match=r"Tensor had NaN values.*op 'log'.*\[Op:log\]") as info:
        dtape.log(x)
    assert (info.value.op_name, info.value.kind, info.value.index) == ("log", "output", 0)
    assert isinstance(info.value, ValueError)
    with pytest.raises(InvalidArgumentError, match=r"Tensor had Inf values.*op 'divide'"):
        x / 0.0


def test_torch_function_through_the_fallback_is_checked(check_numerics):
    x = dtape.constant([0.0, 0.5])
    with pytest.raises(InvalidArgumentError, match=r"Inf values.*op 'special_logit'"):
        torch.special.logit(x)


def test_gradient_with_inf_raises_naming_the_op(check_numerics):
    x = dtape.constant([0.0, 1.0])
    with dtape.GradientTape() as tape:
        tape.watch(x)
        y = dtape.reduce_sum(dtape.sqrt(x))  # sqrt(0) is finite; its gradient 1 / (2 sqrt(0)) is not
    with pytest.raises(InvalidArgumentError, match=r"Tensor had Inf values: gradient for input 0 of op 'sqrt'"):
        tape.gradient(y, x)


def test_check_numerics_raises_from_replica_threads(check_numerics):
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"], timeout=5)
    with pytest.raises(InvalidArgumentError, match="op 'log'"):
        strategy.run(lambda: dtape.log(dtape.constant([-1.0])))


def test_disabled_is_the_default_and_restores_the_original_functions():
    forwards = [opdef.fn.__closure__[opdef.fn.__code__.co_freevars.index("fwd")].cell_contents for opdef in REGISTRY]
    backward = OpDef.backward
    assert not debugging.is_check_numerics_enabled()
    assert all(f is opdef.forward for f, opdef in zip(forwards, REGISTRY))
    debugging.enable_check_numerics()
    debugging.enable_check_numerics()  # idempotent
    try:
        assert OpDef.backward is not backward
    finally:
        debugging.disable_check_numerics()
    debugging.disable_check_numerics()
    assert OpDef.backward is backward
    assert all(opdef.fn.__closure__[opdef.fn.__code__.co_freevars.index("fwd")].cell_contents is opdef.forward
               for opdef in REGISTRY)
    assert float(dtape.reduce_sum(dtape.log(dtape.constant([-1.0, 1.0]))).numpy() != 0.0)  # NaN passes when off


def test_check_mirrored_names_the_first_variable_and_replica_that_differ():
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])
    with strategy.scope():
        a = dtape.Variable([1.0, float("nan")], name="a")
        b = dtape.Variable([[1.0, 2.0]], name="b")
        c = dtape.Variable([3.0], name="c")
    assert strategy.extended.check_mirrored() == 3  # NaNs in the same places count as identical
    b.values[2].assign([[1.0, 2.5]])  # bypasses the strategy
    c.values[1].assign([0.0])
    with pytest.raises(ValueError, match=r"MirroredVariable 'b': replica 2's component.*max \|difference\| 0.5"):
        strategy.extended.check_mirrored()
    b.values[2].assign([[1.0, 2.0]])
    with pytest.raises(ValueError, match=r"MirroredVariable 'c': replica 1's"):
        strategy.extended.check_mirrored()
    del c
    gc.collect()
    assert strategy.extended.check_mirrored() == 2  # the registry holds its variables weakly
    assert a.values[0].numpy()[0] == 1.0


def test_gradient_walk_and_collectives_are_named_profiler_ranges():
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        v = dtape.Variable([1.0, 2.0])
    x = dtape.constant([3.0, 4.0])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with dtape.GradientTape() as tape:
            y = strategy.reduce("SUM", strategy.run(lambda: dtape.reduce_sum(v * x)))
        g = tape.gradient(y, v)
        strategy.run(lambda: dtape.distribute.get_replica_context().all_reduce("SUM", x * 1.0))
    names = {e.key for e in prof.key_averages()}
    assert {"dtape.gradient", "dtape.all_reduce", "dtape.broadcast"} <= names
    assert g.numpy().tolist() == [6.0, 8.0]


def test_replica_gradient_walks_show_when_the_profiler_records_all_threads():
    strategy = MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        v = dtape.Variable([1.0, 2.0])

    def step():
        with dtape.GradientTape() as tape:
            y = dtape.reduce_sum(v * v)
        return tape.gradient(y, v)
    config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=config) as prof:
        grads = strategy.experimental_local_results(strategy.run(step))
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("dtape.gradient") == 2  # one walk per replica thread
    assert [g.numpy().tolist() for g in grads] == [[2.0, 4.0], [2.0, 4.0]]
