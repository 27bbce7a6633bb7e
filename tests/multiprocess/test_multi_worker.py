"""MultiWorkerMirroredStrategy: the API on two torchrun workers (gloo, 127.0.0.1), and in-process checks.

The two-worker checks run tests/multiprocess/worker_api.py once and compare
what every rank saw with values computed here on one device.
"""
import json
import os

import numpy as np
import pytest
import torch

import dtape
import dtape.distribute as dd
from dtape.distribute import collective_ops, replica_scope
from dtape.distribute.input_lib import split_sizes

import _launch


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("api")
    args = _launch.torchrun_args(out / "logs") + [os.path.join(_launch.HERE, "worker_api.py"), str(out)]
    rc, output, _ = _launch.run(args, _launch.worker_env())
    logs = _launch.rank_logs(out / "logs")
    assert rc == 0, f"torchrun failed ({rc}):\n{output[-3000:]}\n{logs}"
    seen = []
    for r in range(2):
        with open(out / f"rank{r}.json") as f:
            seen.append(json.load(f))
    return seen




@pytest.mark.multiprocess
def test_variables_created_in_scope_start_from_rank0_despite_different_seeds(ranks):
    # Each rank seeded torch with 1000 + rank before creating them: equal only through the broadcast.
    assert ranks[0]["v"] == ranks[1]["v"] and ranks[0]["kernel"] == ranks[1]["kernel"]
    torch.manual_seed(1001)
    assert torch.randn(3).tolist() != ranks[1]["v"]   # what rank 1 would have had on its own


@pytest.mark.multiprocess
def test_replica_ids_and_task_ids_are_the_ranks(ranks):
    for r, seen in enumerate(ranks):
        assert (seen["rid"], seen["task_id"], seen["num_replicas"], seen["backend"]) == (r, r, 2, "gloo")
        assert seen["local_results"] == 1


@pytest.mark.multiprocess
def test_tfs_attributes_and_guards_on_every_worker(ranks):
    for r, seen in enumerate(ranks):
        assert seen["values_from_function"] == [r, 2]
        assert seen["should_checkpoint"] == [r == 0, r == 0]
        assert "cannot be called in cross-replica context" in seen["cross_replica_apply"]
        assert seen["unchanged_after_cross_replica_apply"]
        assert "2 replicas in sync" in seen["batch_mean_loss"] and "compute_average_loss" in seen["batch_mean_loss"]


@pytest.mark.multiprocess
def test_dropout_in_a_wrapped_module_draws_each_workers_own_replica_stream(ranks):
    """Each worker is its process's only replica: a wrapped module's dropout draws that worker's replica
    generator's stream (seeded from the strategy's seed and the rank): plain torch's masks from its state,
    the generator advanced by them, torch's own generator untouched; so the workers' masks differ."""
    for r, seen in enumerate(ranks):
        state = torch.tensor(seen["dropout_state"], dtype=torch.uint8)
        assert torch.equal(state, torch.Generator().manual_seed(replica_scope.derive_seed(7, r)).get_state())
        with torch.random.fork_rng():
            torch.set_rng_state(state)
            expected = [torch.nn.functional.dropout(torch.ones(64), 0.5).tolist() for _ in range(2)]
            advanced = torch.get_rng_state().tolist()
        assert seen["dropout_masks"] == expected and expected[0] != expected[1]
        assert seen["dropout_after"] == advanced
        assert seen["torch_rng_unchanged"]
    assert ranks[0]["dropout_masks"] != ranks[1]["dropout_masks"]


@pytest.mark.multiprocess
def test_collectives_reduce_and_gather_across_workers(ranks):
    for seen in ranks:     # rank r contributes r + 1
        assert seen["all_reduce_sum"] == 3.0 and seen["all_reduce_mean"] == 1.5
        assert seen["reduce_sum"] == 3.0 and seen["reduce_mean"] == 1.5
        assert seen["merged"] == 30.0                       # merge_fn's reduce is a collective
        assert seen["all_gather"] == [0.0, 1.0, 1.0]        # uneven: rank r gives r + 1 copies of r
        assert seen["gather"] == [0, 1, 1]
        assert seen["counter"] == 3.0                       # SyncOnRead SUM read across workers


@pytest.mark.multiprocess
def test_input_gives_each_worker_its_split_of_every_global_batch(ranks):
    rows = np.arange(10, dtype=np.float32).reshape(5, 2)
    sizes = split_sizes(5, 2)
    assert ranks[0]["numpy_slice"] == [rows[:sizes[0]].tolist()]
    assert ranks[1]["numpy_slice"] == [rows[sizes[0]:].tolist()]
    assert ranks[0]["nest_slice"] == [{"a": [0, 1], "b": [1.0, 1.0]}] and ranks[1]["nest_slice"] == [{"a": [2], "b": [1.0]}]
    assert ranks[0]["loader_slices"] == [[[0.0, 1.0], [0, 1]], [[4.0, 5.0], [4, 5]]]
    assert ranks[1]["loader_slices"] == [[[2.0, 3.0], [2, 3]], [[6.0, 7.0], [6, 7]]]
    for r, seen in enumerate(ranks):
        assert seen["input_contexts"] == [[2, r, 4]] and seen["from_function"] == [[r] * 4]


@pytest.mark.multiprocess
def test_training_steps_equal_one_device_on_the_global_batch(ranks):
    kernel = torch.tensor(ranks[0]["kernel"], requires_grad=True)
    bias = torch.zeros(2, requires_grad=True)
    xs = torch.linspace(-1, 1, 12).reshape(4, 3)
    ys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.5, -0.5]])
    velocity = [torch.zeros_like(kernel), torch.zeros_like(bias)]
    losses = []
    for _ in range(2):   # SGD(0.5, momentum=0.9), Keras formulas, on the whole batch
        loss = ((xs @ kernel + bias - ys) ** 2).sum() / 4.0
        losses.append(loss.item())
        grads = torch.autograd.grad(loss, [kernel, bias])
        with torch.no_grad():
            for p, g, vel in zip([kernel, bias], grads, velocity):
                vel.mul_(0.9).add_(g, alpha=-0.5)
                p.add_(vel)
    for seen in ranks:
        np.testing.assert_allclose(seen["losses"], losses, rtol=1e-5)
        np.testing.assert_allclose(seen["trained_kernel"], kernel.detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
def test_checkpoint_rank0_writes_every_rank_restores(ranks):
    for seen in ranks:
        assert seen["ckpt_exists_after_save"]            # visible to rank 1 once save returned: the barrier
        assert seen["restored_equal"]
        assert seen["counter_after_assign_restore"] == 3.0   # SUM over workers restored, not doubled


# -- in-process (one worker, no torchrun) ---------------------------------------------

def test_single_worker_without_torchrun_env_runs_the_api():
    strategy = dd.MultiWorkerMirroredStrategy(seed=3)
    assert strategy.num_replicas_in_sync == 1 and strategy.cluster_resolver.task_id == 0
    assert strategy.extended.should_checkpoint
    with strategy.scope():
        v = dtape.Variable([1.0, 2.0])

    def fn():
        ctx = dd.get_replica_context()
        return ctx.all_reduce("SUM", v * 2), ctx.replica_id_in_sync_group

    total, rid = strategy.run(fn)
    assert rid == 0 and total.numpy().tolist() == [2.0, 4.0]
    assert float(strategy.reduce("MEAN", dtape.constant([1.0, 3.0]), axis=0)) == 2.0


def test_resolver_partial_torchrun_env_raises_naming_missing():
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        dd.TorchrunClusterResolver.from_environment({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"})
    r = dd.TorchrunClusterResolver.from_environment({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                                                     "MASTER_ADDR": "h", "MASTER_PORT": "5"})
    assert (r.task_type, r.task_id, r.num_workers, r.local_rank) == ("worker", 1, 2, 1)


def test_communication_options_validates():
    with pytest.raises(ValueError, match="timeout_seconds"):
        dd.CommunicationOptions(timeout_seconds=0)
    with pytest.raises(ValueError, match="implementation"):
        dd.CommunicationOptions(implementation="mpi")
    assert dd.CommunicationOptions(5, "NCCL").implementation == "nccl"


@pytest.mark.parametrize("bad, error", [(float("inf"), ValueError), (float("nan"), ValueError), (-1.0, ValueError),
                                        (0.0, ValueError), ("10", TypeError)])
def test_communication_options_refuses_a_timeout_that_is_not_finite_and_positive(bad, error):
    # infinity was accepted here and failed only at the first collective, with an OverflowError
    with pytest.raises(error, match=r"CommunicationOptions\(timeout_seconds=...\)"):
        dd.CommunicationOptions(timeout_seconds=bad)
    assert dd.CommunicationOptions(timeout_seconds=86400).timeout_seconds == 86400.0


def test_peer_exception_keeps_builtin_type_and_names_rank():
    try:
        raise ZeroDivisionError("boom")
    except ZeroDivisionError as e:
        payload = collective_ops.error_payload(e, 3, 4)
    err = collective_ops.peer_exception(json.loads(json.dumps(payload)), 0, "all_reduce #2")
    assert type(err) is ZeroDivisionError and str(err) == "boom"
    assert "rank 3 of 4" in err.__notes__[0] and "all_reduce #2" in err.__notes__[0]
    try:
        raise KeyError("missing")
    except KeyError as e:
        err = collective_ops.peer_exception(collective_ops.error_payload(e, 1, 2), 0, "x")
    assert type(err) is KeyError and err.args == ("missing",)
    payload.update(module="nowhere.mod", type="Odd")
    assert isinstance(collective_ops.peer_exception(payload, 0, "x"), dd.WorkerError)


def test_input_context_rejects_bad_pipeline_id():
    with pytest.raises(ValueError, match="input_pipeline_id"):
        dd.InputContext(2, 2, 2)


def test_mirrored_distribute_dataset_splits_dataloader_batches():
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(10.0), torch.arange(10)),
                                         batch_size=5)
    strategy = dd.MirroredStrategy(["cpu:0", "cpu:1"])
    batches = list(strategy.experimental_distribute_dataset(loader))
    assert len(batches) == len(strategy.experimental_distribute_dataset(loader)) == 2
    x, y = batches[1]
    assert [t.numpy().tolist() for t in x.values] == [[5.0, 6.0, 7.0], [8.0, 9.0]]
    assert [t.numpy().tolist() for t in y.values] == [[5, 6, 7], [8, 9]]


def test_distribute_dataset_rejects_non_iterable():
    with pytest.raises(TypeError, match="iterable of batches"):
        dd.MultiWorkerMirroredStrategy().experimental_distribute_dataset(3)
