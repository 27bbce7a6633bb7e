"""A default torch.profiler.profile() around MirroredStrategy.run records the replica threads: the caller's
profiler state is carried into them for the run (dtape/distribute/profiler_threads.py), and nothing else is.

The first test to profile a run builds the small C++ helper (seconds to a minute on a loaded machine,
cached on disk after): no timing is asserted anywhere here.
"""
import pathlib
import threading
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import dtape
from dtape.distribute import GradientSync, PerReplica, profiler_threads

from _strategies import mirrored

pytestmark = pytest.mark.usefixtures("closes_strategies")
CPU = [torch.profiler.ProfilerActivity.CPU]
TINY_MB = 1e-9  # every variable in a bucket of its own: 4 buckets for 2 Linear layers
N_VARS = 4
RANGES = ("dtape.gradient", "dtape.all_reduce", "dtape.apply_gradients")


def _setup():
    strategy = mirrored(2)
    with strategy.scope():
        torch.manual_seed(0)
        net = dtape.layers.TorchModule(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)))
        opt = dtape.optimizers.SGD(0.1, momentum=0.9)
    return strategy, net, opt


def _inputs():
    rng = np.random.default_rng(0)
    return PerReplica(tuple(dtape.constant(rng.standard_normal((5, 4)).astype(np.float32)) for _ in range(2)))


def _train_step(net, opt):
    sync = GradientSync(bucket_cap_mb=TINY_MB, first_bucket_cap_mb=TINY_MB)

    def step(x):
        with dtape.GradientTape(gradient_sync=sync) as tape:
            loss = dtape.reduce_sum(net(x) ** 2)
        grads = tape.gradient(loss, net.trainable_variables)
        opt.apply_gradients(zip(grads, net.trainable_variables))
        return loss, grads, torch.is_grad_enabled(), net(x).dtype
    return step


def _main_thread_id(prof):
    (tid,) = {e.thread for e in prof.events() if e.name == "test.main"}
    return tid


def _profiled_step(strategy, step, xs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the profiler is carried: no warning that replicas go unrecorded
        with torch.profiler.profile(activities=CPU) as prof:
            with torch.profiler.record_function("test.main"):  # marks the caller's thread id in the trace
                pass
            result = strategy.run(step, args=(xs,))
    return result, prof


def test_default_profiler_records_both_replica_threads_and_the_named_ranges():
    strategy, net, opt = _setup()
    step, xs = _train_step(net, opt), _inputs()
    for _ in range(2):  # a second profile records each op once more, never twice (no callback left behind)
        _, prof = _profiled_step(strategy, step, xs)
        main = _main_thread_id(prof)
        mm_threads = {e.thread for e in prof.events() if e.name == "aten::addmm"}
        assert len(mm_threads) == 2 and main not in mm_threads, (main, mm_threads)  # both replicas' forward
        for name in RANGES:
            threads = [e.thread for e in prof.events() if e.name == name]
            per_replica = N_VARS if name == "dtape.all_reduce" else 1  # one all-reduce per bucket
            assert sorted(threads) == sorted(list(mm_threads) * per_replica), (name, threads, mm_threads)


def _bits(t):
    """A torch tensor's exact bits (bfloat16 included, which numpy has no type for)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def _run_steps(profiled, context, steps=3):
    """Per-step losses and gradients of both replicas, then the weights; the replicas' grad modes and dtypes."""
    strategy, net, opt = _setup()
    step, xs = _train_step(net, opt), _inputs()
    values, seen = [], set()
    for _ in range(steps):
        with context():
            if profiled:
                result, prof = _profiled_step(strategy, step, xs)
                assert len({e.thread for e in prof.events() if e.name == "aten::addmm"}) == 2
            else:
                result = strategy.run(step, args=(xs,))
        loss, grads, grad_mode, dtype = result
        values += [t.torch() for t in strategy.experimental_local_results(loss)]
        values += [t.torch() for g in grads for t in strategy.experimental_local_results(g)]
        seen |= {(m, d) for m in strategy.experimental_local_results(grad_mode)
                 for d in strategy.experimental_local_results(dtype)}
    return values + [v.torch() for v in net.trainable_variables], seen


@pytest.mark.parametrize("context, dtype", [
    (torch.enable_grad, torch.float32),
    (lambda: torch.autocast("cpu", dtype=torch.bfloat16), torch.bfloat16),
])
def test_profiled_training_equals_unprofiled_bit_for_bit(context, dtype):
    plain, plain_seen = _run_steps(False, context)
    profiled, seen = _run_steps(True, context)
    assert len(plain) == len(profiled) == 3 * (2 + 2 * N_VARS) + N_VARS
    for a, b in zip(plain, profiled):
        assert a.dtype == b.dtype and _bits(a) == _bits(b)
    assert seen == plain_seen == {(True, dtype)}


def _forward_state(strategy, net):
    """fn(x) for strategy.run: net(x); `per_replica(result)` gives [(y, grad mode, y's dtype, profiler on)] of
    each replica thread, in replica order."""
    seen = {}

    def forward(x):
        y = net(x)
        replica = dtape.distribute.get_replica_context().replica_id_in_sync_group
        seen[replica] = (torch.is_grad_enabled(), y.dtype, torch._C._autograd._profiler_enabled())
        return y

    def per_replica(result):
        ys = strategy.experimental_local_results(result)
        return [(y,) + seen.pop(r) for r, y in enumerate(ys)]
    return forward, per_replica


@pytest.mark.parametrize("context, grad_mode, dtype", [
    (torch.no_grad, False, torch.float32),
    (lambda: torch.autocast("cpu", dtype=torch.bfloat16), True, torch.bfloat16),
])
def test_profiled_replicas_see_the_callers_grad_mode_and_autocast_as_unprofiled(context, grad_mode, dtype):
    strategy, net, _ = _setup()
    (forward, per_replica), xs = _forward_state(strategy, net), _inputs()
    with context():
        plain = per_replica(strategy.run(forward, args=(xs,)))
        with torch.profiler.profile(activities=CPU) as prof:
            profiled = per_replica(strategy.run(forward, args=(xs,)))
    assert len({e.thread for e in prof.events() if e.name == "aten::addmm"}) == 2
    for (y0, mode0, dtype0, on0), (y1, mode1, dtype1, on1) in zip(plain, profiled):
        assert (mode0, dtype0) == (mode1, dtype1) == (grad_mode, dtype)
        assert not on0 and on1  # the profiler is on in the replica thread only while a profiled run lasts
        assert y0.dtype == y1.dtype and _bits(y0.torch()) == _bits(y1.torch())


def test_replica_threads_get_their_own_state_back_after_a_profiled_run_even_one_that_raises():
    strategy, net, _ = _setup()
    (forward, per_replica), xs = _forward_state(strategy, net), _inputs()

    def fails(x):
        net(x)
        raise ValueError("replica failure")
    with torch.profiler.profile(activities=CPU):
        strategy.run(forward, args=(xs,))
        with pytest.raises(ValueError, match="replica failure"):
            strategy.run(fails, args=(xs,))
    # the same replica threads, unprofiled now: the profiler's state left them with the runs, grad mode as ever
    for _, mode, _, on in per_replica(strategy.run(forward, args=(xs,))):
        assert mode is True and on is False
    with torch.no_grad():
        assert [(mode, on) for _, mode, _, on in per_replica(strategy.run(forward, args=(xs,)))] == [(False, False)] * 2


def test_a_failed_build_falls_back_to_the_warning_naming_the_reason(monkeypatch, tmp_path):
    """No ninja (or no compiler): the run still works, unprofiled on the replicas, and says why."""
    _unbuilt_library(monkeypatch, tmp_path)
    monkeypatch.setenv("PATH", "/nonexistent")  # torch's cpp_extension finds no ninja
    monkeypatch.setattr(profiler_threads, "_ninja_wheel_bin", lambda: None)  # nor the ninja wheel's binary
    strategy, net, _ = _setup()
    (forward, per_replica), xs = _forward_state(strategy, net), _inputs()
    with pytest.warns(UserWarning, match=r"could not be carried .*Ninja is required.*profile_all_threads=True"):
        with torch.profiler.profile(activities=CPU) as prof:
            results = per_replica(strategy.run(forward, args=(xs,)))
    assert [on for *_, on in results] == [False, False]
    assert not [e for e in prof.events() if e.name == "aten::addmm"]  # the replicas' forward is not recorded


def _unbuilt_library(monkeypatch, tmp_path):
    """A library this process has not built (torch skips rebuilding one it built) in an empty build root."""
    monkeypatch.setattr(profiler_threads, "_built", {"lib": None, "error": None})
    monkeypatch.setattr(profiler_threads, "_NAME", "dtape_thread_state_unbuilt")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))


def test_a_build_lock_left_by_a_killed_build_gives_up_after_the_wait_naming_the_file(monkeypatch, tmp_path):
    """torch's own wait for another process's build lock never ends; dtape's is bounded (LOCK_WAIT_S)."""
    _unbuilt_library(monkeypatch, tmp_path)
    monkeypatch.setattr(profiler_threads, "LOCK_WAIT_S", 0.5)
    lock = pathlib.Path(profiler_threads._build_directory(), "lock")  # under tmp_path
    lock.parent.mkdir(parents=True)
    lock.touch()
    got = []
    waiter = threading.Thread(target=lambda: got.append(profiler_threads.library()), daemon=True)
    waiter.start()
    waiter.join(timeout=120)  # generous: only a wait that never ends fails here
    assert got, "library() still waits on the stale lock"
    lib, reason = got[0]
    assert lib is None and "build lock" in reason and str(lock) in reason and "delete it" in reason


def test_scheduled_profiler_as_training_scripts_use_it_records_the_active_steps_of_both_replicas(tmp_path):
    """The tutorials' idiom: schedule(wait, warmup, active), a trace handler, shapes, memory and Python stacks,
    prof.start() / prof.step() / prof.stop() around the loop. Each run carries the profiler as it is at that
    step: nothing in the wait and warmup steps, both replicas in the active ones."""
    strategy, net, opt = _setup()
    step, xs = _train_step(net, opt), _inputs()
    traces = []

    def on_trace_ready(prof):
        traces.append([(e.name, e.thread) for e in prof.events() if e.name in RANGES + ("test.main",)])
        torch.profiler.tensorboard_trace_handler(str(tmp_path))(prof)
    prof = torch.profiler.profile(activities=CPU, schedule=torch.profiler.schedule(wait=1, warmup=1, active=2),
                                  on_trace_ready=on_trace_ready, record_shapes=True, profile_memory=True,
                                  with_stack=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*replica threads")  # dtape's (torch warns of its own here)
        prof.start()
        for _ in range(5):
            with torch.profiler.record_function("test.main"):
                pass
            strategy.run(step, args=(xs,))
            prof.step()
        prof.stop()
    assert len(traces) == 1 and list(tmp_path.glob("*.pt.trace.json"))
    names = [name for name, _ in traces[0]]
    assert names.count("test.main") == 2  # the two active steps
    assert names.count("dtape.gradient") == 4 and names.count("dtape.apply_gradients") == 4  # 2 steps x 2 replicas
    assert names.count("dtape.all_reduce") == 4 * N_VARS
    main = {t for name, t in traces[0] if name == "test.main"}
    replicas = {t for name, t in traces[0] if name == "dtape.gradient"}
    assert len(replicas) == 2 and not replicas & main
