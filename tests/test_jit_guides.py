"""TF's tf.function guides ported to dtape.function(jit_compile=True), each against the same code eager.

Sources: "Better performance with tf.function" (tracing rules, variables
created once, `tf.Module` methods, input_signature with None dims),
"Introduction to graphs and tf.function" (nested functions) and Keras'
"Writing a training loop from scratch" (compiled train_step/test_step with
dropout, a learning-rate schedule, clipping and metrics). Graphs run with
backend=None (the traced graph itself) to keep the tests fast.
"""
import numpy as np
import pytest
import torch

import dtape
from dtape import keras

D = torch.float64


def _jit(fn=None, **kw):
    return dtape.function(fn, jit_compile=True, backend=None, **kw)


def test_a_compiled_function_calls_another_inline():
    # the graphs guide's outer_function calling a tf.function inner_function
    inner = _jit(lambda x, y, b: dtape.matmul(x, y) + b)

    @_jit
    def outer(x):
        return inner(x, dtape.constant([[2.0], [3.0]]), dtape.constant(4.0))

    assert outer(dtape.constant([[1.0, 2.0]])).numpy().tolist() == [[12.0]]
    assert outer(dtape.constant([[3.0, 1.0]])).numpy().tolist() == [[13.0]]
    assert outer.trace_count == 1 and inner.trace_count == 0  # inlined in outer's graph


def test_a_compiled_method_keeps_its_traces_per_instance():
    # the guide's Count(tf.Module) with a variable created once inside a @tf.function __call__
    class Count(dtape.Module):
        def __init__(self, step):
            super().__init__()
            self.count, self.step = None, step

        @_jit
        def __call__(self):
            if self.count is None:
                self.count = dtape.Variable(0)
            return self.count.assign_add(self.step)

    a, b = Count(1), Count(10)
    assert [int(a()) for _ in range(3)] == [1, 2, 3]
    assert [int(b()) for _ in range(2)] == [10, 20]
    assert int(a()) == 4 and Count.__call__.__get__(a).trace_count == 1


def test_a_body_creating_a_variable_on_every_call_raises_as_tf():
    def accumulate(x):
        v = dtape.Variable(0.0)
        v.assign_add(x)
        return v.read_value()
    eager = dtape.function(accumulate)
    assert [float(eager(dtape.constant(2.0))) for _ in range(3)] == [2.0, 2.0, 2.0]
    compiled = _jit(accumulate)  # it would return 2, 4, 6: one variable kept across calls
    with pytest.raises(ValueError, match="creates a variable again on a later trace"):
        compiled(dtape.constant(2.0))

    # from a value computed in the body: the first call runs eagerly, the next may not create one again
    compiled = _jit(lambda x: dtape.Variable(dtape.zeros_like(x)) + x)
    assert float(compiled(dtape.constant(2.0))) == 2.0
    with pytest.raises(ValueError, match="creates a variable again on a later trace"):
        compiled(dtape.constant(2.0))


def test_torch_tensor_arguments_and_results():
    f = _jit(lambda x: (x * x, torch.relu(x).sum()))
    for k in (3.0, -4.0):
        sq, s = f(torch.full((2,), k))
        assert type(sq) is torch.Tensor and type(s) is torch.Tensor  # graph values, never the trace's fakes
        assert sq.tolist() == [k * k, k * k] and float(s) == max(k, 0) * 2
    assert f.trace_count == 1
