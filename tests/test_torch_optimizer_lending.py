"""from_torch lends the gradients given to apply_gradients as `.grad` when the torch optimizer's step only
reads them (torch's Adam, AdamW, SGD without nesterov), and gives a private copy otherwise: the gradients
passed in stay unwritten either way, and the update equals torch's own step with the same gradients."""
import pytest
import torch

import dtape


def _problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(4, 3, generator=g, dtype=torch.float64)
    b0 = torch.randn(3, generator=g, dtype=torch.float64)
    grads = [[torch.randn(4, 3, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)]
             for _ in range(3)]
    return w0, b0, grads


def _torch_reference(make, w0, b0, grads):
    """Plain torch: the same optimizer over copies of the values, each step's gradients as `.grad`."""
    params = [w0.clone(), b0.clone()]
    opt = make(params)
    for gs in grads:
        for p, gr in zip(params, gs):
            p.grad = gr.clone()
        opt.step()
    return params


def _dtape_run(make, w0, b0, grads, hook=None):
    w, b = dtape.Variable(w0.clone(), name="w"), dtape.Variable(b0.clone(), name="b")
    torch_opt = make([w.torch(), b.torch()])
    seen = []
    torch_opt.register_step_pre_hook(
        lambda o, a, k: seen.append([p.grad.data_ptr() for group in o.param_groups for p in group["params"]]))
    if hook is not None:
        torch_opt.register_step_pre_hook(hook)
    opt = dtape.optimizers.from_torch(torch_opt)
    given = []
    for gs in grads:
        step = [dtape.constant(gr.clone()) for gr in gs]
        before = [s.torch().clone() for s in step]
        opt.apply_gradients(zip(step, [w, b]))
        given.append([s.torch().data_ptr() for s in step])
        for s, was in zip(step, before):
            assert torch.equal(s.torch(), was)  # dtape gradients stay immutable
    return (w, b), seen, given


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1),
    lambda ps: torch.optim.Adam(ps, lr=0.1, weight_decay=0.1, maximize=True, foreach=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=True),
], ids=["adamw", "adam_foreach_maximize", "sgd_momentum_foreach"])
def test_a_step_that_only_reads_its_gradients_gets_the_given_ones_and_equals_torch(make):
    w0, b0, grads = _problem()
    (w, b), seen, given = _dtape_run(make, w0, b0, grads)
    assert seen == given  # each step's `.grad` tensors are the gradients passed in: no copy
    ref = _torch_reference(make, w0, b0, grads)
    assert torch.equal(w.torch(), ref[0]) and torch.equal(b.torch(), ref[1])


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, foreach=False),
    lambda ps: torch.optim.RMSprop(ps, lr=0.01),
    # nanoGPT's configure_optimizers passes fused=True where torch has it (on CUDA): dtape assumes nothing of
    # what a fused kernel does with `.grad`, so it gets copies
    lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
], ids=["sgd_nesterov_foreach", "sgd_nesterov", "rmsprop", "adamw_fused"])
def test_a_step_that_may_write_its_gradients_gets_copies_and_equals_torch(make):
    """SGD's foreach nesterov step adds the momentum into `.grad` in place: given the caller's gradients it
    would change them (and the next index or step would read the changed values)."""
    w0, b0, grads = _problem(1)
    (w, b), seen, given = _dtape_run(make, w0, b0, grads)
    assert all(not set(s) & set(g) for s, g in zip(seen, given))
    ref = _torch_reference(make, w0, b0, grads)
    assert torch.equal(w.torch(), ref[0]) and torch.equal(b.torch(), ref[1])


class _TwoParams(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
        self.v = torch.nn.Parameter(torch.tensor([10.0, 20.0], dtype=torch.float64))


def _two_variables(kind):
    if kind == "torch_module":  # the variables share their module's memory: always written in place
        tm = dtape.layers.TorchModule(_TwoParams())
        by_name = {v.name.split("/")[-1].split(":")[0]: v for v in tm.trainable_variables}
        return by_name["w"], by_name["v"]
    return (dtape.Variable(torch.tensor([1.0, 2.0], dtype=torch.float64), name="w"),
            dtape.Variable(torch.tensor([10.0, 20.0], dtype=torch.float64), name="v"))


@pytest.mark.parametrize("kind", ["torch_module", "variable"])
def test_a_gradient_in_the_memory_of_a_variable_the_step_writes_is_read_as_it_was(kind):
    """A gradient passed through from a variable's own value (`output_gradients=w`) must be read as it stood
    when apply_gradients was called, not as that variable's update left it."""
    w, v = _two_variables(kind)
    opt = dtape.optimizers.from_torch(torch.optim.SGD([w.torch(), v.torch()], lr=0.5))
    with dtape.GradientTape() as tape:
        tape.watch(w)
        y = dtape.identity(w)
    g_v = tape.gradient(y, w, output_gradients=w)  # w's own tensor, passed through
    assert g_v.torch().data_ptr() == w.torch().data_ptr()
    opt.apply_gradients([(dtape.constant(torch.tensor([4.0, 6.0], dtype=torch.float64)), w), (g_v, v)])
    assert w.torch().tolist() == [-1.0, -1.0]  # 1 - 0.5 * 4, 2 - 0.5 * 6
    assert v.torch().tolist() == [9.5, 19.0]  # 10 - 0.5 * 1, 20 - 0.5 * 2: w as it was, not as updated


def test_a_lent_gradient_written_during_the_step_raises_instead_of_changing_the_callers_gradient():
    def halve(opt, args, kwargs):
        for group in opt.param_groups:
            for p in group["params"]:
                p.grad.mul_(0.5)
    w0, b0, grads = _problem(2)
    with pytest.raises(RuntimeError, match="wrote the gradients given to apply_gradients in place"):
        _dtape_run(lambda ps: torch.optim.AdamW(ps, lr=0.1), w0, b0, grads, hook=halve)
