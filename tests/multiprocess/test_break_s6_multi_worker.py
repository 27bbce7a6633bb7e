"""A worker's wrapped forward (its process's only replica) drawing through torch's default generator, and a
wrapped module with tied, frozen and unused parameters trained with GradientSync and clipped gradients, on
2 torchrun workers (tests/multiprocess/worker_break_s6.py, gloo). References: plain torch from the replica
generator's state; plain torch in float64 on the whole batch."""

import numpy as np
import pytest
import torch
from torch import nn

import _launch
from _tied_frozen import TiedFrozenUnused

f64 = torch.float64


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return _launch.run_ranks(tmp_path_factory.mktemp("break_s6"), "worker_break_s6.py", timeout=200)


@pytest.mark.multiprocess
def test_a_workers_forward_draws_one_stream_for_torch_dtape_random_and_an_inner_wrapped_module(ranks):
    """torch.rand, dtape.random.uniform, the inner module's dropout and torch.rand continue one stream, as
    plain torch from the replica generator's state (dtape's draw used to repeat torch.rand's first 4 numbers,
    the inner module's mask the outer forward's first draws)."""
    for r, res in enumerate(ranks):
        got = res["draws"].get("value", res["draws"])
        assert "outs" in got, got
        inner = nn.Sequential(nn.Linear(2, 16), nn.Dropout(0.5))
        inner.load_state_dict({k: torch.tensor(v) for k, v in got["inner"].items()})
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(torch.tensor(got["before"], dtype=torch.uint8))
            want = [torch.rand(4), torch.rand(4), inner(torch.ones(1, 2)).detach(), torch.rand(4)]
            advanced = torch.get_rng_state().tolist()
        for k, (g, w) in enumerate(zip(got["outs"], want)):
            np.testing.assert_array_equal(np.array(g, dtype=np.float32), w.numpy(), err_msg=f"rank {r}, draw {k}")
        assert got["after"] == advanced and got["torch_unchanged"], f"rank {r}"
    assert ranks[0]["draws"]["value"]["outs"][0] != ranks[1]["draws"]["value"]["outs"][0]  # each its own stream


@pytest.mark.multiprocess
def test_tied_frozen_unused_module_with_clipped_reversed_gradients_trains_as_torch(ranks):
    torch.manual_seed(0)
    ref = TiedFrozenUnused().double()
    params = [p for p in ref.parameters() if p.requires_grad]
    for k in range(3):
        x = torch.randn(4, 3, dtype=f64, generator=torch.Generator().manual_seed(k))
        total = [torch.zeros_like(p) for p in params]
        for part in (x[:2], x[2:]):   # each worker's half, clipped on its own, then summed
            grads = torch.autograd.grad(ref(part).square().sum(), params, allow_unused=True)
            grads = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]
            norm = torch.sqrt(sum((g ** 2).sum() for g in grads)).item()
            total = [t + g * min(1.0, 1.0 / norm) for t, g in zip(total, grads)]
        with torch.no_grad():
            for p, g in zip(params, total):
                p -= 0.05 * g
    want = dict(ref.named_parameters(remove_duplicate=False))
    for r, res in enumerate(ranks):
        got = res["train"].get("value", res["train"])
        assert "a.weight" in got, got
        for name, value in got.items():
            np.testing.assert_allclose(np.array(value), want[name].detach().numpy(), rtol=1e-11, atol=1e-13,
                                       err_msg=f"{name}, rank {r}")
