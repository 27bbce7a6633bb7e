"""Nested structures: flatten, pack_sequence_as, map_structure.

Structures are lists, tuples, namedtuples and dicts (dict leaves in sorted key
order, as tf.nest). Everything else is a leaf. Source: tf.nest.
"""


def _is_namedtuple(x):
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def is_nested(x):
    """True for list, tuple (namedtuple included) and dict."""
    return isinstance(x, (list, tuple, dict))


def _children(x):
    if isinstance(x, dict):
        return [x[k] for k in sorted(x)]
    return list(x)


def flatten(structure):
    """Returns the leaves of `structure` as a flat list, depth first."""
    if not is_nested(structure):
        return [structure]
    out = []
    for child in _children(structure):
        out.extend(flatten(child))
    return out


def _rebuild(template, children):
    if isinstance(template, dict):
        keys = sorted(template)
        return type(template)((k, children[i]) for i, k in enumerate(keys))
    if _is_namedtuple(template):
        return type(template)(*children)
    return type(template)(children)


def _pack(template, leaves, pos):
    if not is_nested(template):
        return leaves[pos], pos + 1
    children = []
    for child in _children(template):
        value, pos = _pack(child, leaves, pos)
        children.append(value)
    return _rebuild(template, children), pos


def pack_sequence_as(structure, flat_sequence):
    """Packs `flat_sequence` into the shape of `structure`.

    Raises:
      ValueError: if the number of leaves differs from `structure`'s.
    """
    flat_sequence = list(flat_sequence)
    expected = len(flatten(structure))
    if expected != len(flat_sequence):
        raise ValueError(f"structure has {expected} leaves but {len(flat_sequence)} values were given")
    return _pack(structure, flat_sequence, 0)[0]


def map_structure(fn, *structures):
    """Applies `fn` leaf-wise over structures of identical shape."""
    flats = [flatten(s) for s in structures]
    if len({len(f) for f in flats}) > 1:
        raise ValueError("map_structure: structures have different numbers of leaves")
    return pack_sequence_as(structures[0], [fn(*xs) for xs in zip(*flats)])
