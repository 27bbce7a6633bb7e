"""Reading the registry's op samples: the tensor inputs of a sample, flat, and back (shared by the gradient
and forward-mode tests)."""


def flat_inputs(opdef, args):
    """The tensor inputs of a sample, flat (list-input ops expand their list)."""
    return list(args[0]) if opdef.list_input else list(args[:opdef.n_in])


def pack_inputs(opdef, args, inputs):
    """The sample's arguments with its tensor inputs replaced by `inputs` (flat, as `flat_inputs` gives)."""
    if opdef.list_input:
        return (list(inputs),) + tuple(args[1:])
    return tuple(inputs) + tuple(args[opdef.n_in:])


def as_tuple(out):
    """An op's output(s) as a tuple."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)
