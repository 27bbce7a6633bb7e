"""TorchModule: train an existing `torch.nn.Module` with dtape.

The module's parameters become trainable dtape Variables and its buffers
non-trainable ones (created through the variable-creator stack, so under
`strategy.scope()` they are MirroredVariables), over the module's own storage.
A call runs the module's own `forward` on a private shallow copy of the
module tree whose parameter slots hold the variables' current values (this
replica's), as `torch.func.functional_call` substitutes parameters. The
whole forward is one torch function to the tapes: the autograd fallback runs
it once, on plain torch tensors, under torch's autograd when a tape records
it, and records it as one op whose gradient is one `torch.autograd.grad`
over the graph torch built. The shared module object is never modified (no
swapped parameters, no flipped train/eval mode), so replica threads can call
the same TorchModule at once.

Source: torch.func.functional_call (parameter substitution); Keras 3's
`keras.layers.TorchModuleWrapper` is the analogous Keras API.
"""
import itertools
import sys
import threading
import weakref

import torch

from dtape import _call_context
from dtape import _replica_info
from dtape import random as _random
from dtape import tape as _tp
from dtape.module import Module
from dtape.ops._dispatch import ReplicaStream, SeededRandomFunctions, call_fallback, flatten_args, unflatten_args
from dtape.tensor import Tensor, convert_to_tensor, is_variable
from dtape.variables import (Variable, VariableAggregation, current_creator_stack, read_values,
                             set_creator_stack, share_storage, tracing_body)

# How replicas' buffer updates are combined (`sync_buffers=`): the mean, or replica 0's (DDP's broadcast_buffers).
_BUFFER_SYNC = {"mean": VariableAggregation.MEAN, "broadcast": VariableAggregation.ONLY_FIRST_REPLICA}

__all__ = ["TorchModule", "check_torch_writes_in_run", "follow_torch_writes"]


class TorchModule(Module):
    """A `torch.nn.Module` as a dtape Module: its parameters and buffers are dtape Variables.

    Parameters become trainable Variables (`trainable=p.requires_grad`,
    followed afterwards: freezing a parameter with `p.requires_grad_(False)`
    after wrapping, as for fine-tuning, makes its Variable, every component,
    non-trainable at the next call or `trainable_variables`, so tapes do not
    watch it, its gradient is None as torch's `p.grad` and optimizers leave
    it; `requires_grad_(True)` trains it again), buffers non-trainable ones, named `<name>/<torch name>` (e.g.
    `torch_module/features.0.weight`), in `named_parameters()` then
    `named_buffers()` order; tied parameters share one Variable. They are
    created now, through the variable-creator stack: build the TorchModule
    inside `strategy.scope()` to get MirroredVariables.

    The wrapper is a view of the module: each Variable (under a strategy,
    its replica-0 component; under MultiWorkerMirroredStrategy, this
    worker's) and the module's parameter or buffer are one storage, so
    training the Variables trains the module itself (`module.weight`
    changes with each optimizer step), and `parameters()` /
    `named_parameters()` are the module's own, for a torch optimizer
    (`dtape.optimizers.from_torch`). A tensor on another device or dtype
    than its Variable (a strategy placing replica 0 elsewhere) is moved onto
    the Variable's storage (`param.data`). Writes to these Variables are in
    place: a read taken before an update sees the new value, as with torch's
    parameters.

    The view follows the module. A submodule, parameter or buffer registered
    after wrapping (`model.fc = nn.Linear(512, 10)`, `model.head.weight =
    nn.Parameter(...)`) gets a new Variable at the next call or
    `trainable_variables`, made as at wrap time (under a strategy, mirrored;
    inside `strategy.run`, in one merge_call); torch's global registration
    hooks move a counter each call compares. Under MirroredStrategy a write
    made through torch between steps (`torch.nn.init.*_`,
    `module.load_state_dict`, an in-place op under `torch.no_grad()`) changes
    replica 0's component, the module's storage; the next `strategy.run`
    copies it to the other replicas first (`follow_torch_writes`).

    Calling it runs `module.forward(*args, **kwargs)` once, on torch
    tensors, with the variables' current values substituted, and records it
    as one op on the active tapes; `tape.gradient` with respect to
    `trainable_variables` is torch.autograd's gradient of the module, from
    the graph torch built in the forward (autocast, `torch.no_grad()`,
    `.detach()` inside the forward mean what they mean in torch). Torch's
    random functions in it draw from the replica's `dtape.random` generator
    (replica threads of one process: on streams seeded from it, call by call;
    the only replica of its process, e.g. a MultiWorkerMirroredStrategy
    worker's: its own stream, through torch's default generator).

    Buffers (e.g. BatchNorm's `running_mean`, `running_var`,
    `num_batches_tracked`) are constants for differentiation, as in
    PyTorch. The forward sees a private copy of each buffer; after a
    training-mode call every buffer is written back to its Variable (changed
    or not), after an eval-mode call those the forward replaced or modified
    in place from Python. Under a strategy each replica computes its own update;
    floating buffers are created with `VariableAggregation.MEAN`, so the
    replicas' updates are averaged (one merge_call per updated buffer, as
    Keras' BatchNormalization averages its moving statistics; for
    `running_mean` with equal replica batches this equals the one-device
    update, `running_var` averages per-replica variances), and other buffers
    with `ONLY_FIRST_REPLICA` (replica 0's value, e.g. the step counter).
    `sync_buffers="broadcast"` gives floating buffers replica 0's value too
    (after each update every replica holds replica 0's statistics, as DDP's
    default `broadcast_buffers=True`). Every replica must update the same
    buffers in the same order.

    A `torch.compile`d module or submodule trains too: its compiled forward
    runs on the call's copy of the original module (one compilation).

    Not supported (each raises where it can be detected): forward hooks,
    pre-hooks and backward hooks on any submodule (NotImplementedError at
    call); parametrizations (`torch.nn.utils.parametrize`) and
    `torch.jit.ScriptModule`s (TypeError at construction); parameters
    modified in place inside `forward` (TypeError: dtape tensors are
    immutable); tensors held outside registered parameters/buffers (plain
    Python lists of modules, tensor attributes) are constants to dtape.
    Outputs: nests (tuple, list, dict, namedtuple) of tensors come back with
    each torch.Tensor leaf as a dtape Tensor; other objects (e.g. dataclass
    outputs) are returned as the forward made them.

    Args:
      module: the torch.nn.Module to wrap (any device and dtype; variables
        keep each tensor's dtype and device, a strategy places them on its
        replica devices).
      name: module name (default `torch_module`, made unique).
      sync_buffers: how replicas' updates of floating buffers (BatchNorm's
        running statistics) combine under a strategy: "mean" (default, the
        mean of the replicas' updates) or "broadcast" (replica 0's, DDP's
        `broadcast_buffers`).

    Call args:
      *args, **kwargs: the forward's arguments. dtape Tensors, Variables
        (read), torch.Tensors and numpy arrays anywhere in them become dtape
        Tensors; other values pass through.
      training: True runs the forward as after `module.train()`, False as
        after `module.eval()`, for this call only; None (default) takes the
        mode of the enclosing layer call (e.g. `model(x, training=True)`,
        Keras's call context), and outside any uses the wrapped module's own
        current mode (`module.training`).

    Returns:
      The forward's output, torch.Tensor leaves as dtape Tensors.

    Raises:
      TypeError: `module` is not a torch.nn.Module, is scripted or
        parametrized; a forward modifies a parameter in place; or the call
        is made inside another TorchModule's forward that a tape records
        (the outer parameters would get no gradient).
      ValueError: `sync_buffers` is neither "mean" nor "broadcast".
      NotImplementedError: a submodule has hooks.
      ValueError: a forward sets a buffer to None or changes its shape.

    Source: torch.func.functional_call; Keras 3 `TorchModuleWrapper`.

    Example:
      >>> net = dtape.layers.TorchModule(torch.nn.Linear(3, 2))
      >>> [tuple(v.shape) for v in net.trainable_variables]
      [(2, 3), (2,)]
      >>> with dtape.GradientTape() as tape:
      ...     loss = dtape.reduce_sum(net(dtape.ones([4, 3])))
      >>> [tuple(g.shape) for g in tape.gradient(loss, net.trainable_variables)]
      [(2, 3), (2,)]
    """

    def __init__(self, module, name=None, sync_buffers="mean"):
        _check_module(module)
        generation = _watch_registrations()  # before the walk: a change during it is followed at the next call
        if sync_buffers not in _BUFFER_SYNC:
            raise ValueError(f"TorchModule(sync_buffers={sync_buffers!r}): use 'mean' (the replicas' updates "
                             "averaged) or 'broadcast' (replica 0's, as DDP's broadcast_buffers)")
        super().__init__(name=name)
        self.module = module  # not walked for variables (not a dtape Module)
        self._params = _variables(self.name, module.named_parameters(remove_duplicate=False), _param_var)
        self._slots = _param_slots(self._params)
        self._unique = _unique(self._params.values())
        self._requires_grad = _RequiresGrad(module, self._params)
        aggregation = _BUFFER_SYNC[sync_buffers]
        self._buffers = _variables(self.name, module.named_buffers(remove_duplicate=False),
                                   lambda b, name: _buffer_var(b, name, aggregation))
        self._follow = _Follow(generation, current_creator_stack(), aggregation, module, self._params, self._buffers)
        self._view_version = 0
        self._mark_views()
        self._note_replicas()

    def __call__(self, *args, training=None, **kwargs):
        _check_not_nested(self)
        self._follow_registrations()
        training = _call_context.resolve_training(training, None)
        mode = self.module.training if training is None else training
        shadow = _shadow(self.module, mode)
        scratch = _buffer_values(self._buffers)
        before = {n: (scratch[id(v)], scratch[id(v)]._version) for n, v in self._buffers.items()}
        _install(shadow, self._buffers, scratch, "_buffers")
        self._requires_grad.refresh()  # the registrations were followed above
        self._requires_grad.check_storage()
        # recorded reads: the op's first inputs; each once (a tied Variable's gradient sums its uses), all
        # read at once (`read_values`: one record for the module's parameters, not one per parameter)
        values = read_values(self._unique)
        # One flat tuple (parameter values, then the arguments' leaves) for the fallback: it flattens and
        # rebuilds its arguments on every call, and pytree walks a nested list value by value.
        leaves, spec = flatten_args(args, kwargs)
        run = _ForwardCall(shadow, self._slots, len(values), spec)
        out = call_fallback(run, (*values, *[_as_input(x) for x in leaves]), {})
        self._write_back(shadow, before, mode)
        return out

    def _write_back(self, shadow, before, training):
        """Assigns buffers to their Variables: all after a training call, else those the forward changed.

        Kernels such as batch_norm update running statistics in place without
        moving the tensor's version counter, so a training call writes every
        buffer back (the same writes, in the same order, on every replica);
        an eval call writes those replaced or modified in place by Python code.
        """
        written = set()
        for name, (old, version) in before.items():
            owner, leaf = _owner(shadow, name)
            new = owner._buffers.get(leaf)
            var = self._buffers[name]
            if id(var) in written or not training and new is old and new._version == version:
                continue
            written.add(id(var))
            if not isinstance(new, torch.Tensor) or new.shape != old.shape:
                raise ValueError(f"{self.name}: forward replaced buffer {name!r} of shape {tuple(old.shape)} by "
                                 f"{_describe(new)}; a TorchModule's buffers keep their shape and cannot be removed")
            var.assign(new)

    def _refresh_trainable(self):
        """Each parameter's Variable (every component) takes `trainable` = the parameter's current
        `requires_grad`: torch's freezing (`p.requires_grad_(False)`) after wrapping, or unfreezing, means
        here what it means in torch (no gradient, the optimizer leaves it), through TF's rule that a tape
        does not watch a non-trainable variable. Called by `trainable_variables` (a call refreshes too)."""
        self._follow_registrations()
        self._requires_grad.refresh()

    def parameters(self, recurse=True):
        """The wrapped module's parameters (`module.parameters()`): the trainable Variables' own storage."""
        return self.module.parameters(recurse)

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        """The wrapped module's `named_parameters()` (the torch names of the Variables)."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def load_state_dict(self, state_dict, strict=True):
        """Assigns a torch state dict (`module.state_dict()`, a checkpoint's) to the Variables, all replicas.

        Args:
          state_dict: dict torch name -> tensor (torch, numpy or dtape).
          strict: as torch's: every name of the module's `state_dict()`
            present and no other (buffers registered with
            `persistent=False` are not in it, as in torch: such a name is
            unexpected, and the buffer keeps its value).

        Returns:
          torch's `(missing_keys, unexpected_keys)` named tuple.

        Raises:
          RuntimeError: with `strict`, missing or unexpected names; a tensor
            whose shape differs from its parameter's (nothing is assigned then).
        """
        self._follow_module()
        variables = {**self._params, **_persistent(self._buffers, self.module)}
        missing = [n for n in variables if n not in state_dict]
        unexpected = [n for n in state_dict if n not in variables]
        bad = [f"{n}: got {tuple(state_dict[n].shape)}, the module has {tuple(v.shape)}"
               for n, v in variables.items() if n in state_dict and tuple(state_dict[n].shape) != tuple(v.shape)]
        problems = ([f"missing keys {missing}", f"unexpected keys {unexpected}"] if strict else []) + \
            ([f"size mismatch ({'; '.join(bad)})"] if bad else [])
        problems = [p for p in problems if not p.endswith("[]")]
        if problems:
            raise RuntimeError(f"{self.name}.load_state_dict: {', '.join(problems)}; load a state dict of the "
                               "same architecture, or pass strict=False to skip missing and unexpected names")
        with _tp.stop_recording():
            for name, var in variables.items():
                if name in state_dict:
                    var.assign(state_dict[name])
        if self._follow.firsts is not None:  # every component now holds the loaded value
            self._follow.note_equal([var for name, var in variables.items() if name in state_dict])
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)

    def state_dict(self):
        """The variables' current values as a torch state dict: `module.load_state_dict(m.state_dict())`.

        Returns:
          dict name -> detached torch.Tensor copy (the names of the wrapped
          module's `state_dict`: tied names included, buffers registered with
          `persistent=False` left out; a MirroredVariable gives its primary
          component, read in the cross-replica context).
        """
        self._follow_module()
        with _tp.stop_recording():
            return {name: var._dtape_read().torch().detach().clone()
                    for name, var in {**self._params, **_persistent(self._buffers, self.module)}.items()}

    # -- the view follows its module -------------------------------------------------------------------
    def _follow_module(self):
        """Makes the Variables follow the module before they are used: parameters, buffers or submodules
        registered since the last look (`model.fc = nn.Linear(...)`) get Variables (`_follow_structure`; a
        call does this part only); under a strategy, a parameter or buffer that torch code wrote in place
        (`torch.nn.init.*_`, `module.load_state_dict`) reaches the other replicas' components
        (`_Follow.sync`; `follow_torch_writes` before each `MirroredStrategy.run`)."""
        self._follow_registrations()
        follow = self._follow
        if follow.firsts is not None and (follow.written() or follow.untracked()):
            follow.sync()

    def _follow_registrations(self):
        """One integer compare: when torch registered a parameter, buffer or submodule anywhere since the
        last look, `_follow_structure`."""
        if self._follow.generation != _registrations.generation:
            self._follow_structure()

    def _follow_structure(self):
        """Walks the module when torch registered a parameter, buffer or submodule anywhere since the last
        look; if its tensors changed, makes the Variables again (`_rebuild`). Inside `strategy.run` every
        replica gets here (none has noted the change yet): one merge_call makes them once, for all."""
        follow, generation = self._follow, _registrations.generation
        _check_module(self.module)
        if follow.same(self.module):
            follow.generation = generation
        elif _replica_info.has_strategy() and not _replica_info.in_cross_replica_context():
            _replica_info.replica_context().merge_call(_rebuild_in_merge, args=(self,))
        else:
            self._rebuild()

    def _rebuild(self):
        """Variables for the module's parameters and buffers as they are now: a tensor seen before keeps its
        Variable, a new one gets a new Variable made as at wrap time (through the creator stack of then: under
        a strategy, a MirroredVariable); the Variables of tensors gone are dropped."""
        follow, generation = self._follow, _registrations.generation
        known = follow.known(self._params, self._buffers)
        with set_creator_stack(follow.creators), _tp.stop_recording():
            params = _variables(self.name, self.module.named_parameters(remove_duplicate=False), _param_var, known)
            buffers = _variables(self.name, self.module.named_buffers(remove_duplicate=False),
                                 lambda b, name: _buffer_var(b, name, follow.aggregation), known)
        self._slots = _param_slots(params)
        self._unique = _unique(params.values())
        self._requires_grad = _RequiresGrad(self.module, params)
        self._params, self._buffers = params, buffers
        follow.reset(generation, self.module, params, buffers)
        self._view_version += 1
        self._mark_views()
        self._note_replicas()

    def view_version(self):
        """A number that changes whenever the Variables are made again because the module's tensors changed
        (follows the module first). Compiled functions guard on it: a graph traced with the old Variables
        would silently keep training them."""
        self._follow_registrations()
        removed = self._follow.removed()
        if removed is not None:  # a replay would still use (and train) the removed parameter's Variable
            raise _removed_error(*_split_name(removed))
        self._requires_grad.check_storage()
        return self._view_version

    def _mark_views(self):
        owner = weakref.WeakMethod(self.view_version)
        for var in _unique((*self._params.values(), *self._buffers.values())):
            var._view_of = owner  # `_jit` guards its graphs on the owner's `view_version`

    def _note_replicas(self):
        if self._follow.firsts is not None:
            _with_replicas[id(self)] = self


# -- construction ------------------------------------------------------------------

def _check_module(module):
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"TorchModule wraps a torch.nn.Module, got {type(module).__name__}")
    if isinstance(module, torch.jit.ScriptModule):
        raise TypeError("TorchModule cannot wrap a torch.jit.ScriptModule (its forward is TorchScript, which "
                        "dtape tensors cannot enter); wrap the original Python module")
    for name, sub in module.named_modules():
        if torch.nn.utils.parametrize.is_parametrized(sub):
            raise TypeError(f"TorchModule: submodule {name or type(module).__name__!r} has parametrizations "
                            "(torch.nn.utils.parametrize), which are not supported; remove them with "
                            "parametrize.remove_parametrizations(..., leave_parametrized=True) first")


def _variables(prefix, named_tensors, make, known=None):
    """{torch name: Variable}, each a view of its tensor (`_share`); names of one tensor (tied weights) share one.
    `known`: id(tensor) -> its Variable already made (kept), filled with the new ones."""
    by_tensor, out = {} if known is None else known, {}
    for name, t in named_tensors:
        var = by_tensor.get(id(t))
        if var is None:
            var = by_tensor[id(t)] = make(t, f"{prefix}/{name}")
            _share(var, t)
        out[name] = var
    return out


def _share(var, t):
    """Makes the module's tensor `t` and `var`'s first component one storage (its value: rank 0's, under
    MultiWorkerMirroredStrategy); `t` moves onto the component's storage if their device or dtype differ."""
    component = var.values[0] if hasattr(var, "values") else var
    with _tp.stop_recording(), torch.no_grad():
        if t.device == component.device and t.dtype == component.dtype:
            share_storage(component, t.detach())
        else:
            share_storage(component, component.torch())
            t.data = component.torch()


class _RequiresGrad:
    """The module's distinct parameters and their Variables' components, whose `_trainable` follows each
    parameter's `requires_grad` (`refresh`). A plain object: the module walk does not list the components."""

    __slots__ = ("params", "components", "flags", "names", "storage")

    def __init__(self, module, params):
        by_name = dict(module.named_parameters(remove_duplicate=False))
        self.params, self.components, self.names, seen = [], [], [], set()
        for name, var in params.items():
            if id(var) not in seen:
                seen.add(id(var))
                self.params.append(by_name[name])
                self.names.append(name)
                self.components.append(tuple(getattr(var, "values", (var,))))
                var._requires_grad_of = by_name[name]  # compiled functions guard on it (`_jit`), as torch.compile
                by_name[name]._dtape_wrapped = True  # its torch uses under a tape are refused (`_registry`)
        self.flags = [c[0]._trainable for c in self.components]
        # each parameter's memory is its Variable's first component's, for good (dtape writes it in place)
        self.storage = [c[0]._t.data_ptr() for c in self.components]

    def check_storage(self):
        """Raises ValueError if a parameter's tensor was replaced under it since wrapping (`p.data = t`,
        `module.to(...)`, `.double()`, `.cuda()`: torch swaps the storage and calls no hook): its Variable
        would go on training the old memory while the module holds the new one. One list comparison."""
        now = [p.data_ptr() for p in self.params]
        if now != self.storage:
            name = next(n for n, a, b in zip(self.names, now, self.storage) if a != b)
            raise ValueError(
                f"TorchModule: the tensor of parameter {name!r} was replaced after wrapping (`p.data = t`, "
                "`module.to(...)`, `.double()`, `.cuda()`; torch announces these to no hook), so its Variable "
                "holds the old memory and would train it while the module holds the new one; move or convert "
                "the module before wrapping it (or wrap it again), and load values in place "
                "(`p.data.copy_(t)`, or `p.copy_(t)` under torch.no_grad())")

    def refresh(self):
        """One list comparison when nothing changed. The flags are noted after the components are set: a
        replica calling meanwhile sets them itself, so no replica reads before its components follow."""
        flags = [p.requires_grad for p in self.params]
        if flags != self.flags:
            for comps, want in zip(self.components, flags):
                for c in comps:
                    c._trainable = want
            self.flags = flags


def _param_var(p, name):
    return Variable(p.detach().clone(), trainable=p.requires_grad, name=name)


def _persistent(buffers, module):
    """The entries of `buffers` ({torch name: Variable}) that torch's `state_dict` holds: not the buffers
    registered with `persistent=False` (a rotary embedding's `inv_freq`, a causal mask), which torch neither
    saves nor loads, so a state dict of the module has no such name."""
    skip = {f"{prefix}.{name}" if prefix else name
            for prefix, m in module.named_modules(remove_duplicate=False) for name in m._non_persistent_buffers_set}
    return {name: var for name, var in buffers.items() if name not in skip} if skip else buffers


def _buffer_var(b, name, aggregation):
    # Integer buffers (counters) take replica 0's value; floating ones as `sync_buffers` says.
    aggregation = aggregation if b.is_floating_point() else VariableAggregation.ONLY_FIRST_REPLICA
    return Variable(b.detach().clone(), trainable=False, name=name, aggregation=aggregation)


# -- calls -----------------------------------------------------------------------------

def _shadow(module, training):
    """A shallow copy of the module tree with private parameter/buffer/submodule dicts and mode `training`.

    The forward runs on it, so the shared module is never modified (thread
    safe: replicas call the same TorchModule at once).
    """
    return _copy_tree(module, training, _compiled_type())


def _copy_tree(module, training, compiled):
    if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or \
            module._backward_pre_hooks:
        raise NotImplementedError(f"TorchModule: {type(module).__name__} has forward or backward hooks, which are "
                                  "not supported (they would see dtape tensors and never get torch gradients); "
                                  "remove them (handle.remove()) or do their work after the call")
    copy = object.__new__(type(module))
    state = copy.__dict__
    state.update(module.__dict__)
    state["_parameters"] = dict(module._parameters)
    state["_buffers"] = dict(module._buffers)
    modules = state["_modules"] = {}
    state["training"] = training
    children = module._modules  # keys, not items(): no call per submodule on every call
    for k in children:
        m = children[k]
        modules[k] = None if m is None else _copy_tree(m, training, compiled)
    if compiled is not None and isinstance(module, compiled):  # its compiled forward must call the copy
        state["_orig_mod"] = modules["_orig_mod"]
        copy._initialize()
    return copy


def _compiled_type():
    """torch.compile's OptimizedModule class, or None before dynamo is loaded (importing it costs seconds:
    no module is compiled until then)."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    return None if dynamo is None else dynamo.OptimizedModule


def _owner(root, name):
    path, leaf = _split_name(name)
    for part in path:
        root = root._modules[part]
    return root, leaf


def _split_name(name):
    """("a.b.weight") -> (("a", "b"), "weight"): the submodule path and the slot of a torch name."""
    *path, leaf = name.split(".")
    return tuple(path), leaf


def _install_parameters(shadow, slots, values):
    """Puts `values[k]` in the shadow's parameter slot of each (path, name, k) of `slots`."""
    owners = {(): shadow}
    for path, leaf, k in slots:
        owner = owners[path] if path in owners else None  # no call per parameter
        if owner is None:
            owner = shadow
            for part in path:
                owner = owner._modules[part]
            owners[path] = owner
        slot = owner._parameters
        if leaf not in slot or slot[leaf] is None:  # torch calls no hook for a removal: never a stale value
            raise _removed_error(path, leaf)
        slot[leaf] = values[k]


def _removed_error(path, leaf):
    name = ".".join((*path, leaf))
    return ValueError(f"TorchModule: parameter {name!r} was removed from the module after wrapping (set to None "
                      "or deleted), which torch announces to no hook, so the TorchModule would still use its "
                      "Variable; wrap the module again (dtape.layers.TorchModule(module)) after removing it")


def _install(shadow, variables, values, slot):
    for name, var in variables.items():
        owner, leaf = _owner(shadow, name)
        getattr(owner, slot)[leaf] = values[id(var)]


def _param_slots(params):
    """[(submodule path, slot name, k)] per torch name: its value is that of the k-th distinct Variable."""
    index = {}
    for var in params.values():
        index.setdefault(id(var), len(index))
    return [(*_split_name(name), index[id(var)]) for name, var in params.items()]


def _unique(variables):
    """The distinct Variables of `variables`, in first-seen order (tied weights once)."""
    return list({id(var): var for var in variables}.values())


def _buffer_values(buffers):
    """id(var) -> a private torch copy of its value (constant; the forward may update it in place)."""
    values = {}
    with _tp.stop_recording():
        for var in buffers.values():
            if id(var) not in values:
                values[id(var)] = var._dtape_read().torch().clone()
    return values


class _ForwardCall:
    """The whole forward as one torch function of (parameter values..., the arguments' pytree leaves...):
    the fallback runs it once on plain tensors (under torch's autograd when a tape records it) and
    records it as one op, so its gradient is one `torch.autograd.grad` over the graph torch built, and
    everything inside the forward (autocast, no_grad, detach, in-place ops on activations) means what it
    means in torch."""

    # Not run a second time by the fallback (`_call_graph`): its buffer updates would be applied twice.
    rerun_safe = False

    def __init__(self, shadow, slots, n_values, spec):
        self.shadow, self.slots, self.n_values, self.spec = shadow, slots, n_values, spec
        self.__name__ = type(shadow).__name__

    def __call__(self, *flat):
        values = flat[:self.n_values]
        _install_parameters(self.shadow, self.slots, values)
        args, kwargs = unflatten_args(list(flat[self.n_values:]), self.spec)
        versions = [v._version for v in values]
        storage = [v.data_ptr() for v in values]  # `p.data = t` swaps it and moves no version counter
        _forwards.stack.append((self.shadow, values))
        try:
            out = self._forward(args, kwargs)
        except RuntimeError as e:
            if "leaf Variable that requires grad is being used in an in-place operation" in str(e):
                raise _in_place_error(self.shadow) from e
            raise
        finally:
            _forwards.stack.pop()
        if [v._version for v in values] != versions or [v.data_ptr() for v in values] != storage:
            raise _in_place_error(self.shadow)
        return out

    def _forward(self, args, kwargs):
        # A thread with its own generator (a replica) draws from it; without one, torch's random functions
        # draw from torch's own generators, as in plain torch, and the forward runs without the
        # interception (a TorchFunctionMode costs Python work on every torch call: ~7% of a small GPT's forward).
        generator = _random.thread_generator()
        if generator is None:
            return self.shadow(*args, **kwargs)
        if getattr(generator, "alone_in_process", False) and not tracing_body():
            # no other replica of this process draws meanwhile: torch's generator draws the replica's stream
            with ReplicaStream(generator):
                return self.shadow(*args, **kwargs)
        with SeededRandomFunctions():  # replica threads run forwards at once: each random call seeded apart
            return self.shadow(*args, **kwargs)


class _Forwards(threading.local):
    """The wrapped forwards running on this thread, innermost last: (the module copy, its parameter values)."""

    def __init__(self):
        self.stack = []


_forwards = _Forwards()


def _check_not_nested(torch_module):
    """Raises TypeError when `torch_module` is called inside another TorchModule's forward that a tape records
    (its parameter values require grad): torch's graph of that forward cannot pass through a dtape call (the
    inner call takes its input as a constant, and the outer layers after it see dtape tensors, so their
    parameters are constants too), so the outer module's parameters would get no gradient, silently."""
    if not _forwards.stack:
        return
    outer, values = _forwards.stack[-1]
    if any(v.requires_grad for v in values):
        raise TypeError(
            f"{torch_module.name} ({type(torch_module.module).__name__}) was called inside the forward of another "
            f"TorchModule ({type(outer).__name__}) that a tape records: the outer module's parameters would get no "
            "gradient (torch's autograd graph of its forward does not pass through a dtape call). Make the inner "
            "torch module a submodule of the outer one (wrap only the outer), or call the TorchModules one after "
            "the other from dtape code")


def _in_place_error(module):
    return TypeError(f"TorchModule: {type(module).__name__}.forward modifies a parameter in place (or through "
                     "`.data`); a TorchModule's parameters are its Variables' values, changed only by assignments "
                     "and optimizers (dtape tensors are immutable in a forward): compute a new tensor instead, and "
                     "keep state the forward updates (an EMA codebook) in a buffer")


def _as_input(x):
    if isinstance(x, (Tensor, torch.Tensor)) or is_variable(x) or hasattr(x, "__array_interface__"):
        return convert_to_tensor(x)
    return x


def _describe(x):
    return f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)


# -- following the module ------------------------------------------------------------------------

class _Registrations:
    """A number that moves whenever torch registers a parameter, buffer or submodule on any module
    (`module.fc = ...`, `module.weight = nn.Parameter(...)`, `register_buffer`; torch's global registration
    hooks, installed by the first TorchModule): a TorchModule whose noted number differs walks its module
    again. One compare per call; a module built anywhere costs each TorchModule one walk."""

    generation = 0


_registrations = _Registrations()
_generations = itertools.count(1)
_hooks_lock = threading.Lock()
_hook_handles = []


def _registered(module, name, value):
    _registrations.generation = next(_generations)  # a fresh number: a racing bump never restores an old one


def _watch_registrations():
    """Installs torch's global registration hooks once; returns the current generation."""
    with _hooks_lock:
        if not _hook_handles:
            mm = torch.nn.modules.module
            _hook_handles.extend([mm.register_module_module_registration_hook(_registered),
                                  mm.register_module_parameter_registration_hook(_registered),
                                  mm.register_module_buffer_registration_hook(_registered)])
    return _registrations.generation


# TorchModules whose Variables have components on several replicas of this process (weak)
_with_replicas = weakref.WeakValueDictionary()


def follow_torch_writes():
    """Copies what torch code wrote in place into a TorchModule's module (`torch.nn.init.*_`,
    `module.load_state_dict`, `p.mul_` under no_grad, `p.data.normal_()`: replica 0's components, the module's
    own storage) into the other replicas' components; new parameters and submodules get their Variables too.
    Called by `MirroredStrategy.run` before the replicas start, in the cross-replica context: each Variable's
    version counter against dtape's last write, and (for writes through `.data`, which move no version
    counter) its value against another replica's component (`_Follow.untracked`)."""
    for torch_module in list(_with_replicas.values()):
        torch_module._follow_module()
        torch_module._follow.mark()


def check_torch_writes_in_run():
    """Raises if torch code inside the `MirroredStrategy.run` that just ended wrote a TorchModule's module
    tensors in place (`p.mul_` under no_grad, `nn.init.*_`): they are replica 0's components, shared by every
    replica's thread, so a write made by each replica lands on them once per replica (a decay applied twice)
    while the other components miss it. Called by `run` after the replicas finish; dtape's own writes
    (assign, optimizers, from_torch) note their versions and pass.

    Raises:
      ValueError: naming the module's tensors written and where to write instead.
    """
    for torch_module in list(_with_replicas.values()):
        follow = torch_module._follow
        if follow.firsts is None:
            continue
        written = follow.written()
        follow.note_run()
        if written:
            names = [follow.views[k][0].name for k in written]
            raise ValueError(
                f"torch code inside strategy.run wrote {names} in place (an in-place op on the wrapped module's "
                "tensors, e.g. p.mul_ under torch.no_grad): under MirroredStrategy they are replica 0's "
                "components, written once per replica that ran it, while the other replicas' components "
                "missed it. Write them between steps, outside strategy.run (the next run copies the module's "
                "values to every replica), or through dtape in the step (var.assign, an optimizer). The next "
                "strategy.run gives every replica the module's values as they are now")


def _rebuild_in_merge(strategy, torch_module):
    torch_module._rebuild()


class _Follow:
    """What a TorchModule last saw of its module: the registration generation, the (name, tensor) pairs of
    its parameters and buffers, and under a strategy each mirrored Variable's components (`views`), whose
    first (replica 0's) is the module's own tensor (`firsts`). A plain object: the module walk skips it."""

    __slots__ = ("generation", "creators", "aggregation", "tensors", "views", "firsts", "lock", "slots", "noted",
                 "marked")

    def __init__(self, generation, creators, aggregation, module, params, buffers):
        self.creators, self.aggregation, self.lock = creators, aggregation, threading.Lock()
        self.reset(generation, module, params, buffers)

    def reset(self, generation, module, params, buffers):
        self.tensors = _named_tensors(module)
        self.views = [tuple(v.values) for v in _unique((*params.values(), *buffers.values())) if len(getattr(v, "values", ())) > 1]
        self.firsts = [comps[0] for comps in self.views] or None  # None: nothing to copy (one replica here)
        self.noted, self.marked = _states(self.views), None
        self.generation = generation
        # (owner's parameter dict, slot, torch name) of each parameter: a removal registers nothing
        self.slots = [(m._parameters, leaf, f"{prefix}.{leaf}" if prefix else leaf)
                      for prefix, m in module.named_modules(remove_duplicate=False)
                      for leaf, p in m._parameters.items() if p is not None]

    def removed(self):
        """The torch name of a parameter set to None or deleted since the last walk, or None."""
        for params, leaf, name in self.slots:
            if params.get(leaf) is None:
                return name
        return None

    def same(self, module):
        now = _named_tensors(module)
        return len(now) == len(self.tensors) and \
            all(a == b and s is t for (a, s), (b, t) in zip(now, self.tensors))

    def known(self, params, buffers):
        """id(module tensor) -> its Variable, for the tensors seen last (kept alive by `tensors` meanwhile)."""
        variables = {**params, **{f"buffer:{n}": v for n, v in buffers.items()}}
        return {id(t): variables[n] for n, t in self.tensors}

    def written(self):
        """Indices into `views` of the Variables whose module tensor torch code wrote since dtape's last write
        (its version counter moved past the one dtape noted: `Variable._own_version`)."""
        return [k for k, c in enumerate(self.firsts) if c._t._version != c._own_version]

    # Each view's components as (id of its tensor, version) when they were last known equal (`noted`): at
    # creation, after a copy, after a step that wrote them all alike. Since then, components that moved all
    # together (dtape's writes to the whole variable: assign, load_state_dict, an optimizer) or not at all are
    # compared: a difference is a write to replica 0's that moved no version counter. A view where only some
    # moved (a component written on its own) is noted None: not compared until a copy, as TF keeps it.
    def mark(self):
        """At the start of a step: the components as they stand (`note_run` tells which the step writes)."""
        self.marked = _states(self.views)

    def note_run(self):
        """At the end of a step: a view whose components the step wrote alike (dtape's updates write every
        replica's) or left alone is noted as it stands; one written in part stays unnoted."""
        if self.marked is None:
            return
        self.noted = [s if n is not None and _alike(s, m) else None
                      for s, m, n in zip(_states(self.views), self.marked, self.noted)]
        self.marked = None

    def note_equal(self, variables):
        """After dtape assigned each of `variables` one value on every component: their views are noted (one
        with a component written on its own before is compared again)."""
        firsts = {id(v.values[0]) for v in variables if len(getattr(v, "values", ())) > 1}
        for k, comps in enumerate(self.views):
            if id(comps[0]) in firsts:
                self.noted[k] = _state(comps)

    def untracked(self):
        """Indices into `views` of the Variables whose module tensor was written without moving its version
        counter (through `p.data`: Hugging Face's `_init_weights`, older torch init code): it differs from
        replica 1's component, with the components moved alike since the last note (a component written on its
        own, e.g. `var.values[1].assign(...)`, makes its view unnoted: its difference is that write's)."""
        pairs = []
        for k, (comps, noted) in enumerate(zip(self.views, self.noted)):
            if noted is not None and not _alike(_state(comps), noted):
                self.noted[k] = noted = None
            if noted is not None:
                pairs.append((k, comps[0]._t, comps[1]._t))
        return [k for (k, _, _), same in zip(pairs, _same_values([(a, b) for _, a, b in pairs])) if not same]

    def sync(self):
        """Copies each written module tensor (replica 0's component: the view's truth) into the other
        replicas' components, then notes its version as seen. Replica threads may notice one write at once:
        under the lock, the first copies and the others find nothing left."""
        with self.lock, _tp.stop_recording():
            for k in sorted({*self.written(), *self.untracked()}):
                first, *others = self.views[k]
                for c in others:
                    c.assign(first._t)
                first._own_version = first._t._version
                self.noted[k] = _state(self.views[k])


def _state(components):
    """Each component's (id of its tensor, version): what any write by dtape or torch moves."""
    return [(id(c._t), c._t._version) for c in components]


def _states(views):
    return [_state(comps) for comps in views]


def _alike(now, then):
    """Whether the components (states as `_states` gives them) moved all together or not at all."""
    moved = [a != b for a, b in zip(now, then)]
    return all(moved) or not any(moved)


def _same_values(pairs):
    """Whether each (a, b) of `pairs` holds the same bits (a NaN equals itself, -0.0 differs from 0.0, as a
    `.data` write can make them): `torch.equal` of the bit patterns where both are on one device; across
    devices, the int64 sums of their bit patterns, read to the host once per device (a copy of every
    parameter to another device per step would cost more than the step's collectives)."""
    out = [_equal_bits(a, b) if a.device == b.device else None for a, b in pairs]
    cross = [j for j, same in enumerate(out) if same is None]
    if cross:
        left = _bit_sums([pairs[j][0] for j in cross])
        right = _bit_sums([pairs[j][1] for j in cross])
        for j, x, y in zip(cross, left, right):
            out[j] = x == y
    return out


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t):
    """`t`'s items read as integers of their size (a view: no copy, any layout); complex128's as two int64."""
    size = t.element_size()
    if size == 16:  # no 16-byte integer: a size-changing view needs a contiguous last dimension
        return t.detach().reshape(-1).view(torch.int64)
    return t.detach().view(_INT_OF_SIZE[size])


def _equal_bits(a, b):
    """Whether `a` and `b` (one device, the same shape: components of one variable) hold the same bits."""
    return torch.equal(_bits(a), _bits(b))


def _bit_sums(tensors):
    """[int]: each tensor's bit patterns (its items read as integers of their size) summed in int64 on its
    device, one host read per device."""
    by_device = {}
    for j, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(j)
    out = [None] * len(tensors)
    for js in by_device.values():
        sums = torch.stack([_bits(tensors[j]).sum(dtype=torch.int64) for j in js]).tolist()
        for j, v in zip(js, sums):
            out[j] = v
    return out


def _named_tensors(module):
    """[(name, tensor)]: the parameters' then the buffers' (prefixed `buffer:`), duplicates (tied) included."""
    return [*module.named_parameters(remove_duplicate=False),
            *((f"buffer:{n}", b) for n, b in module.named_buffers(remove_duplicate=False))]
