"""The tape module (seed 1): process-global tape set, per-thread stop flag, thread safety."""
import threading

import pytest
import torch

import dtape
from dtape import tape as tp

D = torch.float64
TIMEOUT = 60


def _run_threads(targets):
    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT)
        assert not t.is_alive(), "worker thread did not finish in time"


def _grad(tape, target, source):
    from dtape.backprop import tape_gradients
    return tape_gradients(tape, [target], [source])[0]


def test_tape_main_thread_records_worker_thread_ops_gradient_correct():
    x = dtape.constant([1.0, -2.0, 3.0], dtype=D)
    out = {}
    with dtape.GradientTape() as tape:
        tape.watch(x)
        _run_threads([lambda: out.setdefault("y", dtape.reduce_sum(dtape.sin(x) * x))])
    g = tape.gradient(out["y"], x)
    xt = x.torch()
    torch.testing.assert_close(g.torch(), torch.cos(xt) * xt + torch.sin(xt))


def test_stop_recording_one_thread_other_thread_keeps_recording():
    x = dtape.constant([1.0, 2.0], dtype=D)
    stopped_in, go, out = threading.Event(), threading.Event(), {}

    def paused():
        with dtape.stop_recording():
            stopped_in.set()
            assert go.wait(TIMEOUT)
            out["p"] = x * 5.0

    def recording():
        assert stopped_in.wait(TIMEOUT)
        out["r"] = x * 3.0
        go.set()

    with dtape.GradientTape(persistent=True) as tape:
        tape.watch(x)
        _run_threads([paused, recording])
    records = tape._tape.records()
    assert len(records) == 1
    assert records[0][2] == (out["r"]._id,)
    torch.testing.assert_close(tape.gradient(out["r"], x).torch(), torch.full((2,), 3.0, dtype=D))
    assert tape.gradient(out["p"], x) is None


def test_pop_tape_outer_before_inner_both_correct():
    x = dtape.constant([0.5, 2.0], dtype=D)
    outer = tp.push_new_tape(persistent=True)
    inner = tp.push_new_tape(persistent=True)
    try:
        tp.watch(outer, x)
        tp.watch(inner, x)
        y = x * x
    finally:
        tp.pop_tape(outer)
        z = y * 3.0  # recorded on the inner tape only
        tp.pop_tape(inner)
    assert outer not in tp._tape_set and inner not in tp._tape_set
    torch.testing.assert_close(_grad(outer, y, x).torch(), 2 * x.torch())
    torch.testing.assert_close(_grad(inner, z, x).torch(), 6 * x.torch())
    assert _grad(outer, z, x) is None


def test_stop_recording_nests_and_restores_on_exception():
    x = dtape.constant(2.0, dtype=D)
    with dtape.GradientTape(persistent=True) as tape:
        tape.watch(x)
        with dtape.stop_recording():
            with dtape.stop_recording():
                pass
            assert not tp.could_possibly_record()  # inner exit keeps the outer stop
            a = x * 2.0
        with pytest.raises(KeyError):
            with dtape.stop_recording():
                raise KeyError("boom")
        assert tp.could_possibly_record()
        b = x * 3.0
    assert tape.gradient(a, x) is None
    assert float(tape.gradient(b, x)) == 3.0


def test_stop_recording_flag_is_per_thread():
    seen = {}
    with dtape.GradientTape():
        with dtape.stop_recording():
            _run_threads([lambda: seen.setdefault("worker", tp.could_possibly_record())])
            seen["main"] = tp.could_possibly_record()
    assert seen == {"worker": True, "main": False}


def test_gradient_tape_stop_recording_pauses_only_that_tape_on_this_thread():
    x = dtape.constant(1.5, dtype=D)
    out = {}
    with dtape.GradientTape(persistent=True) as outer:
        outer.watch(x)
        with dtape.GradientTape(persistent=True) as inner:
            inner.watch(x)
            with inner.stop_recording():
                y = x * x
                _run_threads([lambda: out.setdefault("w", x * 4.0)])
    assert float(outer.gradient(y, x)) == 3.0
    assert inner.gradient(y, x) is None
    assert float(inner.gradient(out["w"], x)) == 4.0


def test_record_operation_seed_api_backward_gets_dtape_tensors():
    x = dtape.constant([1.0, 2.0], dtype=D)
    seen = []

    def backward(dy):
        seen.append(type(dy))
        return dy * 7.0

    with dtape.GradientTape() as tape:
        tape.watch(x)
        y = dtape.Tensor(x.torch() * 7.0)
        tp.record_operation("Times7", [y], [x], backward)
    g = tape.gradient(y, x)
    assert seen == [dtape.Tensor]
    torch.testing.assert_close(g.torch(), torch.full((2,), 7.0, dtype=D))


def test_should_record_only_for_watched_tensors():
    x, other = dtape.constant(1.0), dtape.constant(2.0)
    with dtape.GradientTape() as tape:
        tape.watch(x)
        assert tp.should_record([x])
        assert not tp.should_record([other])
        with dtape.stop_recording():
            assert not tp.should_record([x])
    assert not tp.should_record([x])
