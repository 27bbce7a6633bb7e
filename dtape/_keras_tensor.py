"""Symbolic tensors of Keras's functional API: what `Input` returns, and what a layer called on one returns.

A `KerasTensor` holds a shape (None for unknown sizes, the batch first), a
torch dtype and the `Node` that produced it: the layer and the arguments of
the call (themselves KerasTensors, nested, or constants). Calling a layer on
one computes nothing: `record_call` builds the layer from the symbolic
shapes, finds the output shapes by running it once on zeros (tape stopped,
no torch graph, inference mode) and returns new KerasTensors. `dtape.models`
replays the recorded nodes on real tensors.
Below `dtape.layers` in the import contract: layers call in, it knows no layer class.
Source: keras.src.backend.common.keras_tensor.KerasTensor (Keras 3) / TF 2's KerasTensor.
"""
import torch

from dtape import _call_context
from dtape import nest
from dtape import tape as _tp
from dtape.tensor import Tensor, as_dtype

__all__ = ["KerasTensor", "Node", "holds_symbolic", "record_call", "source_node"]


class Node:
    """One recorded layer call: `layer(*args, **kwargs)` produced `outputs` (a KerasTensor or a structure of them)."""

    __slots__ = ("layer", "args", "kwargs", "outputs")

    def __init__(self, layer, args, kwargs, outputs=None):
        self.layer, self.args, self.kwargs, self.outputs = layer, tuple(args), dict(kwargs), outputs

    @property
    def inputs(self):
        """The KerasTensors among the call's arguments, in argument order."""
        return [t for t in nest.flatten([list(self.args), self.kwargs]) if isinstance(t, KerasTensor)]


class KerasTensor:
    """A placeholder for a batch of tensors in a functional model: `shape` (tuple, None unknown), `dtype`, `node`.

    It has no value: arithmetic on it raises TypeError (wrap the computation
    in a layer). Source: keras.KerasTensor.
    """

    __slots__ = ("shape", "dtype", "name", "node")

    def __init__(self, shape, dtype=torch.float32, name=None, node=None):
        self.shape = tuple(None if d is None else int(d) for d in shape)
        self.dtype = as_dtype(dtype)
        self.name, self.node = name, node

    @property
    def ndim(self):
        return len(self.shape)

    def __repr__(self):
        dtype = str(self.dtype).removeprefix("torch.")
        return f"<KerasTensor shape={self.shape}, dtype={dtype}, name={self.name}>"

    def _no_value(self, *args, **kwargs):
        raise TypeError(f"{self!r} is symbolic (a functional-model placeholder) and has no value: apply layers "
                        "to it, and put other computations inside a layer's call()")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _no_value
    __matmul__ = __rmatmul__ = __pow__ = __neg__ = __getitem__ = __bool__ = __array__ = __float__ = _no_value


def source_node(layer, shape, dtype, name):
    """The node of an input layer (no arguments) and its KerasTensor, `shape` with the batch first."""
    node = Node(layer, (), {})
    node.outputs = KerasTensor(shape, dtype, name=name, node=node)
    return node.outputs


def _has_symbolic(value):
    if isinstance(value, KerasTensor):
        return True
    return isinstance(value, (list, tuple, dict)) and any(isinstance(t, KerasTensor) for t in nest.flatten(value))


def holds_symbolic(args, kwargs, *more):
    """True when a KerasTensor is among a call's arguments (`args`, `kwargs`' values, `more`; top level or
    inside lists/tuples/dicts). Plain loops: it runs on every layer call."""
    for group in (args, more, kwargs.values() if kwargs else ()):
        for value in group:
            if _has_symbolic(value):
                return True
    return False


def _shape_of(value):
    return value.shape if isinstance(value, KerasTensor) else tuple(getattr(value, "shape", ()))


def record_call(layer, args, kwargs):
    """`layer(*args, **kwargs)` on symbolic inputs: builds the layer, returns the outputs' KerasTensors.

    The layer is built from the first argument's shape(s) (as a real call
    builds it). Output shapes come from running the layer on zeros where
    each unknown size is 2, then 3: a dimension that differs between the two
    runs is unknown (None), the others are fixed.
    """
    first = args[0]
    layer._maybe_build(nest.map_structure(_shape_of, first) if nest.is_nested(first) else _shape_of(first))
    node = Node(layer, args, kwargs)
    flat_in = [t for t in nest.flatten([list(args), kwargs]) if isinstance(t, KerasTensor)]
    sizes = (2, 3) if any(d is None for t in flat_in for d in t.shape) else (2,)
    probes = [_probe(layer, args, kwargs, size) for size in sizes]
    runs = [nest.flatten(out) for out in probes]
    outputs = [_output_tensor(node, [run[i] for run in runs], i) for i in range(len(runs[0]))]
    node.outputs = nest.pack_sequence_as(probes[0], outputs)
    if isinstance(node.outputs, KerasTensor):
        layer._output_shape = node.outputs.shape
    return node.outputs


def _output_tensor(node, values, index):
    if not hasattr(values[0], "shape"):
        return values[0]  # a constant output (not a tensor) stays as it is
    shape = tuple(d if all(v.shape[i] == d for v in values) else None for i, d in enumerate(values[0].shape))
    return KerasTensor(shape, values[0].dtype, name=f"{node.layer.name}/output_{index}", node=node)


def _zeros(t, size, device):
    # Unknown sizes after the batch probe at 16 / 17, not 2 / 3: a Conv1D(kernel_size=3, "valid") on sequences of
    # unknown length (Input(shape=(None, 10))) needs at least 3 steps.
    shape = tuple((size if i == 0 else size + _STEPS_EXTRA) if d is None else d for i, d in enumerate(t.shape))
    fill = torch.ones if t.dtype == torch.bool else torch.zeros  # a boolean mask: all kept
    return Tensor(fill(shape, dtype=t.dtype, device=device))


_STEPS_EXTRA = 14


def _probe(layer, args, kwargs, size):
    """Runs `layer` once on zeros for the KerasTensors (unknown sizes `size`), unrecorded, in inference mode."""
    device = next((v.device for v in layer.variables), None)
    concrete = nest.map_structure(lambda t: _zeros(t, size, device) if isinstance(t, KerasTensor) else t,
                                  [list(args), {k: v for k, v in kwargs.items() if k != "training"}])
    with _tp.stop_recording(), torch.no_grad(), _call_context.training_scope(False):
        out = layer(*concrete[0], **concrete[1])
    layer._clear_losses()  # an activity regularizer's value on zeros is not a loss of the model
    return out
