"""CUDA checks: run where a GPU is present, skipped cleanly (marker `gpu`) elsewhere."""
import pytest
import torch

import dtape
from dtape import distribute as ds

pytestmark = pytest.mark.gpu


def test_gradient_cuda_tensors_stay_on_device_and_match_autograd():
    x = torch.randn(8, 4, dtype=torch.float64, device="cuda:0")
    w = torch.randn(4, 3, dtype=torch.float64, device="cuda:0")
    dx, dw = dtape.constant(x), dtape.constant(w)
    with dtape.GradientTape() as tape:
        tape.watch([dx, dw])
        y = dtape.reduce_sum(dtape.tanh(dtape.matmul(dx, dw)))
    gx, gw = tape.gradient(y, [dx, dw])
    assert gx.device.type == "cuda" and gw.device.type == "cuda"
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ex, ew = torch.autograd.grad(torch.tanh(xr @ wr).sum(), [xr, wr])
    torch.testing.assert_close(gx.torch(), ex)
    torch.testing.assert_close(gw.torch(), ew)


def test_mirrored_strategy_on_gpus_keeps_components_identical():
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    strategy = ds.MirroredStrategy(devices, timeout=60)
    with strategy.scope():
        w = dtape.Variable(torch.ones(4, 1))
        opt = dtape.optimizers.SGD(0.1)
    x = torch.arange(4.0 * len(devices) * 2).reshape(-1, 4)

    def step(xb):
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(dtape.matmul(xb, w)) / float(x.shape[0])
        opt.apply_gradients([(tape.gradient(loss, w), w)])
        return loss
    (batch,) = list(strategy.experimental_distribute_dataset([x]))
    strategy.run(step, args=(batch,))
    first = w.values[0].torch().cpu()
    for c in w.values:
        assert c.device == torch.device(c.device) and torch.equal(c.torch().cpu(), first)
    expected = torch.ones(4, 1) - 0.1 * x.mean(0, keepdim=True).T
    torch.testing.assert_close(first, expected)


def test_gather_rows_gradient_with_cpu_ids_into_a_cuda_table_matches_autograd():
    """Rows of a CUDA table at CPU ids (a CPU dataset's batch): the gradient's index_add needs them on the GPU."""
    p0 = torch.randn(5, 3, dtype=torch.float64, device="cuda:0")
    ids = torch.tensor([[1, -1], [1, 0]])
    w = torch.randn(2, 2, 3, dtype=torch.float64, device="cuda:0")
    p = dtape.Variable(p0)
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_sum(dtape.gather(p, ids) * w)
    g = tape.gradient(loss, p)
    tp = p0.clone().requires_grad_()
    (want,) = torch.autograd.grad((tp[ids.cuda()] * w).sum(), tp)
    assert g.device.type == "cuda"
    torch.testing.assert_close(g.torch(), want, rtol=1e-12, atol=1e-12)
