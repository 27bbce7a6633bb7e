"""Compiled replica steps under MultiWorkerMirroredStrategy: 2 torchrun workers (gloo, 127.0.0.1) run
`dtape.function(step, jit_compile=True)` inside `strategy.run` (tests/multiprocess/worker_jit.py); the graph
all-reduces the gradients with `torch.ops.dtape.all_reduce_start`/`all_reduce_wait` across the processes
(launched during the walk), and the per-step losses
and weights equal the eager step's. Every wait has a timeout (collectives 60 s, the run 420 s)."""

import numpy as np
import pytest

import _launch

STEPS = 20


@pytest.mark.multiprocess
def test_compiled_replica_step_on_two_workers_equals_eager(tmp_path):
    ranks = _launch.run_ranks(tmp_path, "worker_jit.py", STEPS, timeout=420)
    for seen in ranks:
        for name in ("sgd", "adam", "sgd_buckets"):
            run = seen[name]
            assert len(run["compiled"]) == STEPS
            np.testing.assert_allclose(run["compiled"], run["eager"], rtol=1e-5 if name == "adam" else 1e-6)
            np.testing.assert_allclose(run["weights"], run["weights_eager"], rtol=1e-5, atol=1e-6)
            # one bucket (every gradient in one all-reduce), or three with small caps
            assert run["traces"] == 1 and run["reductions"] == (3 if name == "sgd_buckets" else 1)
            assert run["compiled"][-1] < run["compiled"][0]
            rel = np.max(np.abs(np.subtract(run["compiled"], run["eager"])) / np.abs(run["eager"]))
            print(f"{name}: compiled vs eager losses, max relative difference {rel:.2e}")
    for name in ("sgd", "adam", "sgd_buckets"):   # the workers agree: the same global losses and weights
        assert ranks[0][name]["compiled"] == ranks[1][name]["compiled"]
        assert ranks[0][name]["weights"] == ranks[1][name]["weights"]


TUTORIAL_STEPS = 10


@pytest.mark.multiprocess
def test_tf_tutorial_form_compiled_around_strategy_run_on_two_workers_equals_eager_and_one_device(tmp_path):
    """TF's tutorial form: the compiled function around strategy.run and strategy.reduce, and the loop over
    experimental_distribute_dataset inside it. The trace stops at strategy.run (or the dataset's iteration,
    before its per-epoch data check, a collective), the body runs eagerly, and train_step runs compiled
    (aot_eager): its Python ran for the first call (the optimizer is not built, as in TF's tutorial: the
    stopped trace, then eagerly, making the slots) and once more, for the trace."""
    ranks = _launch.run_ranks(tmp_path, "worker_jit.py", TUTORIAL_STEPS, "tutorial", timeout=300)
    for seen in ranks:
        reference = seen["eager"]
        assert reference["train_step_runs"] == TUTORIAL_STEPS
        for form, reached in (("compiled", "MultiWorkerMirroredStrategy.run"),
                              ("epoch", "iteration of a distributed dataset")):
            run = seen[form]
            np.testing.assert_allclose(run["losses"], reference["losses"], rtol=1e-5)
            np.testing.assert_allclose(run["losses"], seen["one_device"]["losses"], rtol=1e-5)
            for got, want, alone in zip(run["weights"], reference["weights"], seen["one_device"]["weights"]):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
                np.testing.assert_allclose(got, alone, rtol=1e-5, atol=1e-6)
            assert reached in run["reason"] and run["outer_traces"] == 0
            assert run["replica_traces"] == [1] and run["backends"] == ["aot_eager"]
            assert run["train_step_runs"] == 3
    for form in ("compiled", "epoch"):
        assert ranks[0][form]["losses"] == ranks[1][form]["losses"]
