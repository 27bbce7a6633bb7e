"""dtape.optimizers.from_torch: a torch.optim optimizer behind dtape's apply_gradients.

The reference in each test is the same model trained by plain single-process torch (autograd, the
same torch optimizer class, `clip_grad_norm_`, the same scheduler), never dtape's own formulas.
"""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import _gpt
import dtape
import dtape.distribute as ds
from _gpt import CONTEXT, GLOBAL_BATCH, VOCAB
from _gpt import batches as _batches, make_adamw as _make_adamw, make_sgd as _make_sgd, torch_run as _torch_run
from _strategies import mirrored


def _tensors(tm):
    """The torch tensors of a TorchModule's trainable variables, in a torch optimizer's order."""
    params = getattr(tm, "parameters", None)
    if callable(params):
        return list(params())
    return [v.torch() for v in tm.trainable_variables]


def _setup(strategy, model, make_optimizer, steps, clip):
    """TorchModule of `model` under `strategy`, a torch optimizer over its variables' tensors (with its
    scheduler) and from_torch of it."""
    with strategy.scope():
        tm = dtape.layers.TorchModule(model)
    torch_opt, sched = make_optimizer(_tensors(tm), steps)
    return tm, torch_opt, sched, dtape.optimizers.from_torch(torch_opt, global_clipnorm=clip)


def _train(strategy, tm, opt, sched, batches):
    """Per-step global losses: each replica's share of the mean cross entropy over the global batch."""
    variables = tm.trainable_variables
    tokens = GLOBAL_BATCH * CONTEXT

    def step(x, y):
        with dtape.GradientTape(gradient_sync=ds.GradientSync()) as tape:
            logits = tm(x)
            loss = F.cross_entropy(logits.view(-1, VOCAB), y.view(-1), reduction="sum") / tokens
        opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    losses = []
    for x, y in strategy.experimental_distribute_dataset(batches):
        losses.append(float(strategy.reduce(ds.ReduceOp.SUM, strategy.run(step, args=(x, y)))))
        sched.step()
    return losses


def _dtape_run(strategy, model, make_optimizer, batches, clip):
    """Per-step global losses of the same training under `strategy` through TorchModule + from_torch."""
    tm, torch_opt, sched, opt = _setup(strategy, model, make_optimizer, len(batches), clip)
    return _train(strategy, tm, opt, sched, batches), tm, opt, torch_opt


def _memory(tm):
    return [c.torch().data_ptr() for v in tm.trainable_variables for c in getattr(v, "values", (v,))]


def _assert_components_equal(tm):
    for var in tm.trainable_variables:
        comps = getattr(var, "values", (var,))
        for c in comps[1:]:
            assert torch.equal(c.torch(), comps[0].torch()), var.name


GPT_STEPS = 100


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (restored after): on a loaded machine torch's thread pool makes this
    small model's single-process run 20-100x slower, and the test is not about threads."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.mark.usefixtures("closes_strategies", "one_thread")
def test_gpt_adamw_two_groups_warmup_cosine_clip_mirrored_equals_torch():
    batches = _batches(GPT_STEPS)
    model = _gpt.seeded_gpt()
    ref, norms, ref_opt = _torch_run(copy.deepcopy(model), _make_adamw, batches, clip=1.0)
    assert min(norms) < 1.0 < max(norms)  # the clip was active on some steps and not on others
    got, tm, opt, torch_opt = _dtape_run(mirrored(2), copy.deepcopy(model), _make_adamw, batches, clip=1.0)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    assert ref[-1] < 0.6 * ref[0]
    _assert_components_equal(tm)
    # the user's torch optimizer carried the schedule and the state, as in the torch run
    assert [g["lr"] for g in torch_opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    assert torch_opt.state_dict()["state"][0]["step"] == GPT_STEPS


@pytest.mark.usefixtures("closes_strategies", "one_thread")
@pytest.mark.parametrize("replicas", [1, 2])
def test_sgd_momentum_across_a_steplr_drop_equals_torch(replicas):
    """torch's SGD (momentum buffer times the new lr after the drop, weight decay added to the gradient)."""
    batches = _batches(12, seed=1)
    model = _gpt.seeded_gpt(1)
    ref, _, ref_opt = _torch_run(copy.deepcopy(model), _make_sgd, batches, clip=None)
    strategy = mirrored(2) if replicas == 2 else ds.OneDeviceStrategy("cpu")
    tm, torch_opt, sched, opt = _setup(strategy, copy.deepcopy(model), _make_sgd, len(batches), None)
    got = _train(strategy, tm, opt, sched, batches[:1])
    memory = _memory(tm)
    got += _train(strategy, tm, opt, sched, batches[1:])
    assert _memory(tm) == memory  # every step wrote the weights in place (torch's optimizer holding them or not)
    if replicas == 1:
        assert got == ref  # the same kernels on the same gradients: bit for bit
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    assert torch_opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == pytest.approx(0.0005)  # dropped twice (12 steps, step_size 6)
    _assert_components_equal(tm)
    assert ref[-1] < ref[0]


@pytest.mark.usefixtures("closes_strategies", "one_thread")
def test_checkpoint_resume_is_bit_exact_under_mirrored(tmp_path):
    """dtape.checkpoint saves the torch optimizer's state (and the scheduler's) with the model; a fresh model,
    optimizer and scheduler restored from it continue exactly as the uninterrupted run."""
    steps, half = 8, 4
    batches = _batches(steps, seed=2)
    model = _gpt.seeded_gpt(2)
    strategy = mirrored(2)
    tm, _, sched, opt = _setup(strategy, copy.deepcopy(model), _make_adamw, steps, 1.0)
    full = _train(strategy, tm, opt, sched, batches)

    tm, torch_opt, sched, opt = _setup(strategy, copy.deepcopy(model), _make_adamw, steps, 1.0)
    first = _train(strategy, tm, opt, sched, batches[:half])
    path = tmp_path / "ckpt"
    dtape.checkpoint.save(path, model=tm, optimizer=opt, scheduler=sched, step=half)
    saved_exp_avg = torch_opt.state_dict()["state"][0]["exp_avg"].clone()

    tm2, torch_opt2, sched2, opt2 = _setup(strategy, _gpt.seeded_gpt(3), _make_adamw, steps, 1.0)  # other weights
    data = dtape.checkpoint.restore(path, model=tm2, optimizer=opt2, scheduler=sched2)
    assert data == {"step": half}
    assert int(opt2.iterations.numpy()) == half
    assert torch.equal(torch_opt2.state_dict()["state"][0]["exp_avg"], saved_exp_avg)
    assert [g["lr"] for g in torch_opt2.param_groups] == [g["lr"] for g in torch_opt.param_groups]
    rest = _train(strategy, tm2, opt2, sched2, batches[half:])
    assert first + rest == full
    _assert_components_equal(tm2)
    # into objects that have stepped (the replicas' private optimizer copies exist and are ahead): they take
    # the restored state too
    dtape.checkpoint.restore(path, model=tm2, optimizer=opt2, scheduler=sched2)
    assert _train(strategy, tm2, opt2, sched2, batches[half:]) == rest
    _assert_components_equal(tm2)


@pytest.mark.usefixtures("one_thread")
def test_state_dict_is_torch_s_and_moves_between_dtape_and_torch():
    """`state_dict()` is the torch optimizer's: loaded into a plain torch optimizer (with the weights), torch
    continues the dtape run exactly; and back."""
    batches = _batches(6, seed=3)
    model = _gpt.seeded_gpt(4)
    strategy = ds.OneDeviceStrategy("cpu")
    tm, torch_opt, sched, opt = _setup(strategy, copy.deepcopy(model), _make_sgd, 6, None)
    _train(strategy, tm, opt, sched, batches[:3])
    state = opt.state_dict()
    assert state["iterations"] == 3 and set(state["state"][0]) == {"momentum_buffer"}

    ref = copy.deepcopy(model)
    named = dict(ref.named_parameters())
    with torch.no_grad():
        for v in tm.trainable_variables:
            named[v.name.split("/", 1)[1]].copy_(v.torch())
    ref_opt, ref_sched = _make_sgd([named[v.name.split("/", 1)[1]] for v in tm.trainable_variables], 6)
    ref_opt.load_state_dict(copy.deepcopy(state))  # torch's state_dict shares its tensors, as torch's does
    ref_sched.load_state_dict(sched.state_dict())
    expected = []
    for x, y in batches[3:]:
        ref_opt.zero_grad()
        loss = F.cross_entropy(ref(x).view(-1, VOCAB), y.view(-1))
        loss.backward()
        ref_opt.step()
        ref_sched.step()
        expected.append(loss.item())
    assert _train(strategy, tm, opt, sched, batches[3:]) == expected

    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # torch's own dict (no iterations): iterations stays
    assert int(opt.iterations.numpy()) == 6
    for a, b in zip(torch_opt.state.values(), ref_opt.state.values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])


def test_errors_name_the_cause_and_the_fix():
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        dtape.optimizers.from_torch(dtape.optimizers.SGD(0.1))
    v = dtape.Variable(torch.ones(3), name="w")
    other = torch.ones(3)   # a copy, not the variable's tensor
    opt = dtape.optimizers.from_torch(torch.optim.SGD([other], lr=0.1))
    with pytest.raises(ValueError, match=r"'w' \[3\] are not parameters of the torch optimizer.*v.torch\(\)"):
        opt.apply_gradients([(dtape.ones([3]), v)])
    opt = dtape.optimizers.from_torch(torch.optim.SGD([v.torch()], lr=0.1))
    with pytest.raises(ValueError, match="listed twice"):
        opt.apply_gradients([(dtape.ones([3]), v), (dtape.ones([3]), v)])
    with pytest.raises(ValueError, match="global_clipnorm must be a finite float > 0"):
        dtape.optimizers.from_torch(torch.optim.SGD([v.torch()], lr=0.1), global_clipnorm=0.0)
    opt.apply_gradients([(dtape.ones([3]), v)])
    np.testing.assert_allclose(v.numpy(), [0.9, 0.9, 0.9], rtol=1e-6)


def test_clip_grad_norm_on_dtape_gradients_raises_naming_global_clipnorm():
    v = dtape.Variable(torch.ones(3))
    with dtape.GradientTape() as tape:
        loss = dtape.reduce_sum(v * v * 10.0)
    grads = tape.gradient(loss, [v])
    for given in (grads, [v]):   # the gradients, or the variables as if they were torch parameters
        with pytest.raises(AttributeError, match="global_clipnorm"):
            torch.nn.utils.clip_grad_norm_(given, 1.0)
    assert getattr(grads[0], "grad", None) is None   # getattr with a default still answers


def test_global_clipnorm_is_torch_s_clip_grad_norm():
    """The summed gradient is clipped with clip_grad_norm_'s formula (max_norm / (norm + 1e-6)), then stepped."""
    ws = [dtape.Variable(torch.tensor([3.0, 4.0])), dtape.Variable(torch.tensor([12.0]))]
    opt = dtape.optimizers.from_torch(torch.optim.SGD([w.torch() for w in ws], lr=1.0), global_clipnorm=1.0)
    grads = [dtape.constant([3.0, 4.0]), dtape.constant([12.0])]   # global norm 13
    ref = [torch.tensor([3.0, 4.0], requires_grad=True), torch.tensor([12.0], requires_grad=True)]
    for p, g in zip(ref, grads):
        p.grad = g.torch().clone()
    torch.nn.utils.clip_grad_norm_(ref, 1.0)
    with torch.no_grad():
        expected = [p - p.grad for p in ref]
    opt.apply_gradients(zip(grads, ws))
    for w, e in zip(ws, expected):
        assert torch.equal(w.torch(), e)
    np.testing.assert_allclose(grads[0].numpy(), [3.0, 4.0])  # the caller's gradients are not modified


class _GradScalingSGD(torch.optim.SGD):
    """SGD that halves each `.grad` in place before its step (torch optimizers may write their gradients)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.5)
        return super().step(closure)


@pytest.mark.usefixtures("closes_strategies")
@pytest.mark.parametrize("sync", [True, False], ids=["gradient_sync", "plain_tape"])
def test_each_replica_s_optimizer_gets_its_own_gradient_tensors(sync):
    """A step that writes `.grad` on one replica index never changes the gradient another index steps with."""
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(5))

    def run(strategy):
        with strategy.scope():
            w = dtape.Variable(torch.ones(3, 2), name="w")
        opt = dtape.optimizers.from_torch(_GradScalingSGD([w.torch()], lr=0.1))

        def step(xb):
            with dtape.GradientTape(gradient_sync=ds.GradientSync() if sync else None) as tape:
                loss = dtape.reduce_sum(dtape.matmul(xb, w) ** 2)
            grad = tape.gradient(loss, w)
            before = grad.torch().clone()
            opt.apply_gradients([(grad, w)])
            assert torch.equal(grad.torch(), before)  # dtape gradients stay immutable
        for xb in strategy.experimental_distribute_dataset([x] * 2):
            strategy.run(step, args=(xb,))
        return w
    expected = run(ds.OneDeviceStrategy("cpu")).torch()
    w = run(mirrored(2))
    for c in w.values:
        torch.testing.assert_close(c.torch(), expected, rtol=1e-6, atol=0)


def test_checkpoint_stores_objects_with_a_state_dict(tmp_path):
    v = dtape.Variable(torch.ones(2), name="v")
    torch_opt = torch.optim.SGD([v.torch()], lr=0.5, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=1, gamma=0.5)
    opt = dtape.optimizers.from_torch(torch_opt)
    opt.apply_gradients([(dtape.ones([2]), v)])
    sched.step()
    path = tmp_path / "ckpt"
    dtape.checkpoint.save(path, v=v, optimizer=opt, scheduler=sched, step=1)
    stored = dtape.checkpoint.read(path)
    assert torch.equal(stored["optimizer"]["state"][0]["momentum_buffer"], torch.ones(2))
    assert stored["optimizer"]["param_groups"][0]["lr"] == 0.25 and stored["scheduler"]["last_epoch"] == 1
    # a plain torch optimizer and scheduler restore from it too (torch ignores the extra `iterations`)
    other = torch.optim.SGD([torch.zeros(2)], lr=0.1, momentum=0.9)
    other_sched = torch.optim.lr_scheduler.StepLR(other, step_size=1, gamma=0.5)
    assert dtape.checkpoint.restore(path, optimizer=other, scheduler=other_sched) == {"step": 1}
    assert other.param_groups[0]["lr"] == 0.25 and other_sched.last_epoch == 1
    assert torch.equal(other.state_dict()["state"][0]["momentum_buffer"], torch.ones(2))
    with pytest.raises(ValueError, match="no state dict 'sched' in checkpoint"):
        dtape.checkpoint.restore(path, sched=sched)


def _saved_torch_sgd(tmp_path, shapes):
    """Variables w1, w2 of `shapes`, one momentum SGD step through from_torch, saved; returns the path."""
    w1, w2 = (dtape.Variable(torch.ones(s), name=n) for n, s in zip(("w1", "w2"), shapes))
    opt = dtape.optimizers.from_torch(torch.optim.SGD([w1.torch(), w2.torch()], lr=0.1, momentum=0.9))
    opt.apply_gradients([(dtape.ones(shapes[0]), w1), (2 * dtape.ones(shapes[1]), w2)])
    return dtape.checkpoint.save(tmp_path / "ckpt", w1=w1, w2=w2, optimizer=opt)


@pytest.mark.parametrize("when", ["before the first step", "after the first step"])
def test_torch_state_restored_into_parameters_listed_in_another_order_raises(tmp_path, when):
    """torch's state dict is keyed by position in param_groups: a resumed run listing w2 before w1 would give
    w2 w1's momentum. Same shapes: the variable names saved with the state refuse it (at the first step when the
    variables are matched then, else at restore, before torch loads anything); other shapes: restore refuses.
    Broken on purpose: without the name check the step ran with the momenta swapped; without the shape check
    torch loaded the (2,) momentum for the (3,) parameter without a word."""
    path = _saved_torch_sgd(tmp_path, [(2,), (2,)])
    w1, w2 = dtape.Variable(torch.ones(2), name="w1"), dtape.Variable(torch.ones(2), name="w2")
    opt = dtape.optimizers.from_torch(torch.optim.SGD([w2.torch(), w1.torch()], lr=0.1, momentum=0.9))
    pairs = [(dtape.ones([2]), w1), (dtape.ones([2]), w2)]
    if when == "after the first step":
        opt.apply_gradients(pairs)
        with pytest.raises(ValueError, match=r"parameter (0|1) of group 0 was saved for variable 'w(1|2)', but 'w(2|1)' is there now"):
            dtape.checkpoint.restore(path, optimizer=opt)
        assert opt.torch_optimizer.state_dict()["state"][0]["momentum_buffer"].tolist() == [1.0, 1.0]  # unchanged
    else:
        dtape.checkpoint.restore(path, optimizer=opt)
        with pytest.raises(ValueError, match=r"parameter (0|1) of group 0 was saved for variable 'w(1|2)', but 'w(2|1)' is there now"):
            opt.apply_gradients(pairs)
        assert w1.numpy().tolist() == [1.0, 1.0] and w2.numpy().tolist() == [1.0, 1.0]
    path = _saved_torch_sgd(tmp_path, [(2,), (3,)])
    w1, w2 = dtape.Variable(torch.ones(2), name="w1"), dtape.Variable(torch.ones(3), name="w2")
    opt = dtape.optimizers.from_torch(torch.optim.SGD([w2.torch(), w1.torch()], lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match=r"parameter 0 of group 0 has shape \(3,\) here but \(2,\) in the saved"):
        dtape.checkpoint.restore(path, optimizer=opt)
    assert opt.torch_optimizer.state_dict()["state"] == {}


def test_torch_state_restored_in_the_same_order_continues_the_run(tmp_path):
    """The checks let the ordinary resume through: default-numbered names (another TorchModule number) agree."""
    def make():
        tm = dtape.layers.TorchModule(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)))
        with torch.no_grad():
            for i, v in enumerate(tm.trainable_variables):
                v.assign(torch.full(tuple(v.shape), 0.1 * (i + 1)))
        opt = dtape.optimizers.from_torch(torch.optim.SGD(tm.parameters(), lr=0.1, momentum=0.9))
        return tm, opt

    def step(tm, opt):
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(tm(dtape.ones([1, 2])) ** 2)
        opt.apply_gradients(zip(tape.gradient(loss, tm.trainable_variables), tm.trainable_variables))
    tm, opt = make()
    step(tm, opt)
    path = dtape.checkpoint.save(tmp_path / "ckpt", model=tm, optimizer=opt)
    step(tm, opt)
    tm2, opt2 = make()
    assert tm2.name != tm.name
    dtape.checkpoint.restore(path, model=tm2, optimizer=opt2)
    step(tm2, opt2)
    for a, b in zip(tm.variables, tm2.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


class _FailingSGD(torch.optim.SGD):
    fail = False

    def step(self, closure=None):
        if self.fail:
            raise RuntimeError("step failed")
        return super().step(closure)


def test_update_that_copies_a_held_tensor_moves_torch_s_state_with_it():
    """A read held across a step makes the update write a copy (dtape tensors are immutable): the torch
    optimizer must then hold the copy, with its momentum; after a step that fails on a copy it must hold
    the variable's unchanged tensor, with its state; and the run must go on equal to torch's."""
    torch.manual_seed(0)
    w0, x = torch.randn(3, 4, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    ref = w0.clone().requires_grad_()
    ref_opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9)
    var = dtape.Variable(w0.clone())
    opt = dtape.optimizers.from_torch(_FailingSGD([var.torch()], lr=0.1, momentum=0.9))
    for step in range(5):
        with dtape.GradientTape() as tape:
            loss = dtape.reduce_sum(dtape.square(dtape.constant(x) @ var))
        grad = tape.gradient(loss, var)
        held = (var.read_value(), var.numpy()) if step in (1, 2) else None  # held: the update writes a copy
        before = var.torch().data_ptr()
        opt.torch_optimizer.fail = step == 2
        if step == 2:
            with pytest.raises(RuntimeError, match="step failed"):
                opt.apply_gradients([(grad, var)])
        else:
            opt.apply_gradients([(grad, var)])
            ref_opt.zero_grad()
            (x @ ref).square().sum().backward()
            ref_opt.step()
        if step < 2:  # (later, the failed step's traceback may hold the tensor: the updates copy)
            assert (var.torch().data_ptr() == before) == (step == 0)
        param = opt.torch_optimizer.param_groups[0]["params"][0]
        assert param is var.torch() and "momentum_buffer" in opt.torch_optimizer.state[param]
        np.testing.assert_allclose(var.numpy(), ref.detach().numpy(), rtol=1e-12, atol=1e-12)
        if held is not None:
            np.testing.assert_array_equal(held[0].numpy(), held[1])  # the held read kept its value


def _changing_steps(strategy, shared):
    """A run whose apply_gradients calls change what an update over a list of variables may keep between
    steps: the list in another order, a shorter list, a scheduler's lr drop, a parameter group added, a held
    read that makes the update copy a variable's tensor. Each step's gradients are torch autograd's of the
    reference, given as dtape constants (halved on each of 2 replicas: the sum is exact), so every step must
    equal torch's AdamW step (with clip_grad_norm_) bit for bit. Returns (dtape's values, torch's) per step."""
    g = torch.Generator().manual_seed(3)
    w1, w2, b, c = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((3, 4), (4, 2), (2,), (2,)))
    x = torch.randn(5, 3, generator=g, dtype=torch.float64)
    ref = [t.clone().requires_grad_() for t in (w1, w2, b, c)]
    with strategy.scope():
        if shared:  # a TorchModule's variables share their storage with the module's parameters
            module = torch.nn.ParameterList([torch.nn.Parameter(t.clone()) for t in (w1, w2, b, c)])
            variables = dtape.layers.TorchModule(module).trainable_variables
        else:
            variables = [dtape.Variable(t.clone(), name=f"v{k}") for k, t in enumerate((w1, w2, b, c))]
    ref_opt = torch.optim.AdamW(ref[:3], lr=0.1, weight_decay=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    torch_opt = torch.optim.AdamW([v.torch() for v in variables[:3]], lr=0.1, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=1, gamma=0.5)
    opt = dtape.optimizers.from_torch(torch_opt, global_clipnorm=0.5)
    replicas = strategy.num_replicas_in_sync
    got, want, held = [], [], []
    for step, order in enumerate([[0, 1, 2], [2, 1, 0], [1, 0], [0, 1, 2], [3, 0, 1, 2], [0, 1, 2, 3]]):
        if step == 3:  # the learning rate a scheduler sets
            sched.step()
            ref_sched.step()
        if step == 4:  # a parameter group added after from_torch, with a variable none of the lists had
            torch_opt.add_param_group({"params": [variables[3].torch()], "weight_decay": 0.0})
            ref_opt.add_param_group({"params": [ref[3]], "weight_decay": 0.0})
        if step == 5:  # a read held across the step: a variable that owns its tensor gets a new one
            held.append(variables[0].read_value())
        ref_opt.zero_grad(set_to_none=True)
        (torch.tanh(x @ ref[0]) @ ref[1] + ref[2] + ref[3]).square().sum().backward()
        for k in set(range(4)) - set(order):
            ref[k].grad = None
        grads = {k: ref[k].grad.clone() for k in order}

        def replica_step():
            pairs = [(dtape.constant(grads[k] / replicas), variables[k]) for k in order]
            before = [p[0].torch().clone() for p in pairs]
            opt.apply_gradients(pairs)
            for (mine, _), kept in zip(pairs, before):
                assert torch.equal(mine.torch(), kept)  # the clipped `.grad` buffers are copies: gradients intact
        strategy.run(replica_step)
        torch.nn.utils.clip_grad_norm_([ref[k] for k in order], 0.5)
        ref_opt.step()
        got.append([[comp.torch().clone() for comp in getattr(v, "values", (v,))] for v in variables])
        want.append([t.detach().clone() for t in ref])
    return got, want


@pytest.mark.usefixtures("closes_strategies", "one_thread")
@pytest.mark.parametrize("shared", [True, False], ids=["torch_module", "variables"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_what_an_update_keeps_between_steps_follows_the_variables_and_the_torch_optimizer(replicas, shared):
    strategy = mirrored(2) if replicas == 2 else ds.get_strategy()
    got, want = _changing_steps(strategy, shared)
    for step, (values, expected) in enumerate(zip(got, want)):
        for k, (comps, ref) in enumerate(zip(values, expected)):
            for comp in comps:  # every replica's component: the one torch step's values, bit for bit
                assert torch.equal(comp, ref), (step, k)
