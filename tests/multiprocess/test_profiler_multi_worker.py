"""A default torch.profiler.profile() around MultiWorkerMirroredStrategy.run: the replica runs on the worker's
own thread, so its ops and dtape's named ranges are in that thread's trace (tests/multiprocess/worker_profiler.py)."""
import pytest

import _launch

N_BUCKETS = 4


@pytest.mark.multiprocess
def test_default_profiler_shows_the_named_ranges_on_each_worker(tmp_path):
    ranks = _launch.run_ranks(tmp_path, "worker_profiler.py", timeout=300)
    for seen in ranks:
        threads = seen["threads"]
        (main,) = threads["test.main"]
        assert threads["aten::addmm"] and set(threads["aten::addmm"]) == {main}  # the forward, on this thread
        assert threads["dtape.gradient"] == [main]
        assert threads["dtape.all_reduce"] == [main] * N_BUCKETS  # one per bucket, as DDP's one per bucket
        assert threads["dtape.apply_gradients"] == [main]
    assert ranks[0]["weights"] == ranks[1]["weights"]
