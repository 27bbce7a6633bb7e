"""Checkpoints: save/restore variables, modules and optimizers to one file, safely and atomically.

A variable passed as `name` is stored under the key `name`; a module's or an
optimizer's variables under `name/0`, `name/1`, ... in their stable order,
each with its `.name` (for a distributed variable, the container's name);
an optimizer's learning-rate variable under its own key `name.learning_rate`
(files without it restore the rest and leave the rate as it is).
Variables are recognised by `dtape.tensor.is_variable`; a distributed
variable also has a `.values` tuple of components (its logical value is saved: a MirroredVariable's primary, a
SyncOnReadVariable's aggregate; restore assigns every component); a
container has a `variables()` method or a `.variables` attribute. An object
with `state_dict()` and `load_state_dict()` that offers no variables (a torch
optimizer or lr scheduler), or that says so with `_checkpoint_by_state_dict`
(a `dtape.optimizers.from_torch` optimizer), is stored as its state dict, as
plain data (the header's `dtape.states` names those entries), and restored
with `load_state_dict`.

File format: a safetensors file (an 8-byte header length, a JSON header, raw
tensor bytes) whose `__metadata__` holds the format tag, the stored objects
and variable names, the plain data as a JSON tree, `dtape.slots` (for each
optimizer offering `_checkpoint_slots`, each slot's entry, the key of its
variable and its slot name: slots are restored through their variable, as
TF's object graph links slot -> optimizer + variable; files without it, and
optimizers saved without their variables, match slots by position), and a SHA-256 of the whole
file (computed with the digest's own 64 hex digits set to "0"). Loading
checks the checksum before it uses anything, so a flipped bit is refused
instead of loading different weights.

Why safetensors and not `torch.load(weights_only=True)`: a checksum is not a
signature (whoever can write the file can write a matching checksum), so the
reader itself must be unable to run code. safetensors parsing is a JSON
header plus byte copies: no object is ever constructed from the file.
`weights_only=True` is still an unpickler restricted by an allow-list; it
has had bypasses (CVE-2025-32434 ran code in torch <= 2.5.1) and loading
numpy arrays with it means allow-listing numpy internals. The files are also
readable by any safetensors tool.

Plain data (`save(path, step=3, metrics={...})`): None, bool, int, float,
str, lists, tuples and dicts of them (dict keys: str, int, float, bool,
None, tuples of these), torch tensors (any dense strided dtype safetensors
knows, e.g. the uint8 RNG state, int64) and numpy arrays of bool/int/uint/
float/complex dtypes. They come back with their types: tensors as CPU torch
tensors (detached), arrays as numpy arrays (native byte order), tuples as
tuples; numpy scalars (`np.float64(0.5)`) come back as Python scalars.
Anything else is a TypeError at save time naming the key.

`Checkpoint(**objects)` is TF's object: `save(prefix)` numbers files with
its `save_counter`, `restore` returns a load status, and values of variables
that do not exist yet wait in `dtape._restore_hooks` until a layer's build or
an optimizer's step creates them (a custom Module that creates variables in
its own `__call__` does not notify: call it once before restoring).
`CheckpointManager` lives in `dtape.checkpoint_management` (as in TF) and is
also `dtape.checkpoint.CheckpointManager`.

Source: tf.train.Checkpoint (save / restore), by key instead of object graph;
tf.train.CheckpointManager and tf.train.latest_checkpoint.
"""
import hashlib
import hmac
import json
import os
import re
import secrets
import stat
import struct
import warnings
import weakref

import numpy as np
import safetensors
import safetensors.torch
import torch

from dtape import _restore_hooks
from dtape import distribute
from dtape import tape as _tp
from dtape.module import default_name_part
from dtape.distribute import SyncOnReadVariable, collective_ops
from dtape.tensor import Tensor, is_variable
from dtape.variables import Variable, VariableAggregation

__all__ = ["save", "restore", "read", "CheckpointError", "Checkpoint", "CheckpointLoadStatus",
           "InitializationOnlyStatus", "CheckpointManager", "latest_checkpoint", "record_latest",
           "remove_checkpoint"]

_FORMAT = "dtape.checkpoint/2"
_DATA_PREFIX = "__data__/"
_SHA_KEY = "dtape.sha256"
_ZERO_DIGEST = "0" * 64


class CheckpointError(ValueError):
    """A checkpoint file is missing, unreadable, corrupt or not a dtape checkpoint.

    The message names the file. Raised by `read` and `restore` for every such
    file, whatever went wrong (truncated, empty, random bytes, a flipped bit,
    a pickle, a directory, no file at all).
    """


# -- objects -> keys ------------------------------------------------------------

def _variables_of(obj):
    """The variables of a module/optimizer matched by position (an optimizer's `_checkpoint_variables`: its
    learning rate is a child entry, see `_with_children`), or None when `obj` has none to offer."""
    found = getattr(obj, "_checkpoint_variables", None) if not is_variable(obj) else None
    found = found if callable(found) else getattr(obj, "variables", None)
    if found is None:
        return None
    if callable(found):
        found = found()
    return list(found)


def _with_children(objects):
    """(`objects` plus each object's children, the names of those children).

    An optimizer's learning-rate variable (`_checkpoint_children`) is its own
    entry `<name>.learning_rate`, not one of `<name>/i`: files written before
    it was saved lack it, and restoring one of them leaves the rate as it is
    instead of shifting the positions of `iterations` and the slots.
    """
    out, optional = dict(objects), set()
    for name, obj in objects.items():
        children = getattr(obj, "_checkpoint_children", None)
        if is_variable(obj) or not callable(children) or _has_state_dict(obj):
            continue
        for child, var in children().items():
            out[f"{name}.{child}"] = var
            optional.add(f"{name}.{child}")
    return out, optional


def _has_state_dict(obj):
    """True for an object saved by its `state_dict()` and restored by `load_state_dict(...)`: one with both
    methods that offers no dtape variables (a torch optimizer or lr scheduler, a torch module), or one that
    says so (`_checkpoint_by_state_dict`: a `dtape.optimizers.from_torch` optimizer, whose state is torch's)."""
    if is_variable(obj) or not (callable(getattr(obj, "state_dict", None))
                                and callable(getattr(obj, "load_state_dict", None))):
        return False
    return bool(getattr(obj, "_checkpoint_by_state_dict", False)) or getattr(obj, "variables", None) is None


def _named_variables(name, obj):
    """[(key, variable)] for one keyword argument of save/restore, or None for plain data."""
    if is_variable(obj):
        return [(name, obj)]
    found = _variables_of(obj)
    if found is None:
        return None
    return [(f"{name}/{i}", v) for i, v in enumerate(found)]


def _components(var):
    """The components of a distributed variable (duck-typed `.values` tuple), else (var,)."""
    components = getattr(var, "values", None)
    return components if isinstance(components, tuple) and components else (var,)


def _saved_value(var):
    """The logical value of `var` as a detached CPU tensor.

    A MirroredVariable's is its primary component; a SyncOnReadVariable's is
    its cross-replica read, the aggregate of the components (as TF saves it).
    """
    with _tp.stop_recording():
        value = var._dtape_read().torch()
    dtype = getattr(var, "dtype", value.dtype)      # a MEAN of int components reads as float
    return value.detach().to("cpu", dtype, copy=True).contiguous()


def _assign_all(var, value):
    """Assigns `value` to every component of `var` so that its logical value becomes `value`.

    A SUM SyncOnReadVariable gets `value` on its primary and zeros on the
    other components: their sum is `value` exactly, for any dtype (TF writes
    `value / n` to each, which rounds for floats and truncates for ints).
    """
    components = _components(var)
    if isinstance(var, SyncOnReadVariable) and var.aggregation == VariableAggregation.SUM:
        rest = (torch.zeros_like(value),) * (len(components) - 1)
        if not _extended_of(var).should_checkpoint:   # another worker holds the primary: its sum is `value`
            value = torch.zeros_like(value)
    else:
        rest = (value,) * (len(components) - 1)
    for component, part in zip(components, (value,) + rest):
        component.assign(part)


def _extended_of(var):
    """The StrategyExtended of a distributed variable's strategy (duck-typed), else the current one's."""
    strategy = getattr(var, "distribute_strategy", None) or distribute.get_strategy()
    return _ExtendedView(strategy.extended)


class _ExtendedView:
    """What checkpoint asks a strategy (TF: StrategyExtended.should_checkpoint): defaults for single-process ones."""

    def __init__(self, extended):
        self._extended = extended

    @property
    def should_checkpoint(self):
        return getattr(self._extended, "should_checkpoint", True)

    def write(self, write):
        """Runs `write()`: on the chief only, the others waiting at a barrier, if the strategy coordinates workers."""
        chief_write = getattr(self._extended, "_chief_write", None)
        return write() if chief_write is None else chief_write(write)


def _writer(pairs):
    """The strategy view that decides who writes: that of the first distributed variable, else the current one."""
    for _, var in pairs:
        if getattr(var, "distribute_strategy", None) is not None:
            return _extended_of(var)
    return _ExtendedView(distribute.get_strategy().extended)


def _var_name(var, key):
    name = getattr(var, "name", None)
    return name if isinstance(name, str) else key


def _check_name(name):
    if "/" in name or name.startswith("__"):
        raise ValueError(f"checkpoint object name {name!r} may not contain '/' or start with '__'")


# -- plain data <-> JSON tree -----------------------------------------------------

_SCALAR_TAGS = {"none": type(None), "bool": bool, "int": int, "float": float, "str": str}


def _encode(value, where, tensors, active):
    """`value` as a JSON-able tagged tree; tensors/arrays go to `tensors` under `__data__/i` keys."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return [kind.__name__ if value is not None else "none", value]
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return _encode(value.item(), where, tensors, active)
    if isinstance(value, torch.Tensor):
        return ["tensor", _add_tensor(_data_tensor(value, where), tensors)]
    if kind is np.ndarray:
        return ["ndarray", _add_tensor(_array_tensor(value, where), tensors)]
    if kind in (list, tuple, dict):
        if id(value) in active:
            raise TypeError(f"checkpoint data {where} contains itself; only trees of plain data can be saved")
        active.add(id(value))
        try:
            return _encode_container(value, where, tensors, active)
        finally:
            active.discard(id(value))
    hint = "; pass t.torch() or t.numpy()" if isinstance(value, Tensor) else ""
    raise TypeError(f"checkpoint data {where} is a {kind.__module__}.{kind.__qualname__}; only None, bool, int, "
                    f"float, str, lists/tuples/dicts of them, torch tensors and numpy arrays can be saved{hint}")


def _encode_container(value, where, tensors, active):
    if isinstance(value, dict):
        items = []
        for k, v in value.items():
            key = _encode(k, f"{where} key {k!r}", tensors, active)
            if not _is_plain_key(key):
                raise TypeError(f"checkpoint data {where} has a key of type {type(k).__name__}; "
                                f"dict keys must be str, int, float, bool, None or tuples of them")
            items.append([key, _encode(v, f"{where}[{k!r}]", tensors, active)])
        return ["dict", items]
    return [type(value).__name__, [_encode(v, f"{where}[{i}]", tensors, active) for i, v in enumerate(value)]]


def _is_plain_key(node):
    """True for an encoded scalar or tuple of them (no tensor, array, list or dict)."""
    tag, payload = node
    return tag in _SCALAR_TAGS or (tag == "tuple" and all(_is_plain_key(n) for n in payload))


def _add_tensor(t, tensors):
    key = f"{_DATA_PREFIX}{len(tensors)}"
    tensors[key] = t
    return key


def _data_tensor(value, where):
    if value.layout != torch.strided or value.is_quantized or value.device.type == "meta":
        raise TypeError(f"checkpoint data {where}: only dense tensors can be saved, got layout {value.layout} "
                        f"on {value.device}{' (quantized)' if value.is_quantized else ''}")
    return value.detach().resolve_conj().resolve_neg().to("cpu", copy=True).contiguous()


def _array_tensor(value, where):
    if value.dtype.kind not in "biufc":
        raise TypeError(f"checkpoint data {where}: numpy arrays of dtype {value.dtype} cannot be saved "
                        f"(bool, int, uint, float and complex dtypes can)")
    native = np.ascontiguousarray(value.astype(value.dtype.newbyteorder("="), copy=False))
    try:
        return torch.from_numpy(native).clone()
    except TypeError as e:
        raise TypeError(f"checkpoint data {where}: numpy dtype {value.dtype} has no torch dtype ({e})") from None


def _decode(node, tensors, path):
    """Inverse of `_encode`; anything malformed is a CheckpointError."""
    try:
        tag, payload = node
        if tag in _SCALAR_TAGS and type(payload) is _SCALAR_TAGS[tag]:
            return payload
        if tag == "tensor":
            return tensors[payload]
        if tag == "ndarray":
            return tensors[payload].numpy()
        if tag in ("list", "tuple"):
            items = [_decode(item, tensors, path) for item in payload]
            return items if tag == "list" else tuple(items)
        if tag == "dict":
            return {_decode(k, tensors, path): _decode(v, tensors, path) for k, v in payload}
    except CheckpointError:
        raise
    except (TypeError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {path!r} is corrupt: malformed data entry ({type(e).__name__}: {e})")
    raise CheckpointError(f"checkpoint {path!r} is corrupt: malformed data entry {node!r:.80}")


# -- save -----------------------------------------------------------------------

@collective_ops.labelled("checkpoint.save")   # under MultiWorkerMirroredStrategy its collectives are named after it
def save(path, **objects):
    """Saves `objects` to the file `path`, atomically (a reader never sees a partial file).

    Args:
      path: file path (str or os.PathLike); its folder must exist. An
        existing file is replaced. The new file gets the mode the umask gives
        (0o644 under umask 0o022). Temporary files `.<name>.<pid>.<hex>.tmp`
        left in the folder by a killed save of the same path are removed
        (those of a process still running are kept).
      **objects: name -> variable, module, optimizer (anything with a
        `variables()` method or `.variables` attribute), an object saved by
        its `state_dict()` (see the module docstring: a torch optimizer or
        lr scheduler, a `from_torch` optimizer), or plain data (see the
        module docstring) returned by `restore` / `read`. Names may not
        contain '/' or start with '__'.

    Returns:
      str: `path`.

    Raises:
      TypeError: plain data of another type (the message names the key).
      ValueError: a bad object name.
      OSError: the file could not be written; an existing file is then left
        as it was.

    Call it in the cross-replica context (outside `strategy.run`). Under
    MultiWorkerMirroredStrategy every worker calls it (as in TF): every
    worker reads the values (a SyncOnReadVariable's read is a collective),
    rank 0 writes, the others wait at a barrier until the file is complete
    and raise OSError if rank 0 failed to write it. The strategy is that of
    the first distributed variable saved, else the current one.
    Source: tf.train.Checkpoint.write.

    Example:
      >>> dtape.checkpoint.save("/tmp/ckpt", model=model, optimizer=opt, step=10)
    """
    return save_objects(path, objects)


def save_objects(path, objects, make_folder=False, after=None, waiting=None):
    """`save(path, **objects)` with the objects as a dict; the folder is created first if `make_folder`.

    `after()` runs where the file is written (rank 0 under
    MultiWorkerMirroredStrategy), once it is in place and before the other
    workers go on (CheckpointManager deletes old checkpoints there).
    `waiting`: name -> `_Waiting` of a restore whose values still wait for
    that object's variables; they are written in their place, so a save
    between a restore and the first step loses nothing.
    Returns `path` (str).
    """
    path = os.fspath(path)
    objects = _with_children(objects)[0]
    tensors, stored, data, every, states, slots, pairs_of = {}, {}, {}, [], [], {}, {}
    for name, obj in objects.items():
        _check_name(name)
        if _has_state_dict(obj):
            data[name] = _encode(obj.state_dict(), f"{name!r} (its state_dict())", tensors, set())
            states.append(name)
            continue
        pairs = _named_variables(name, obj)
        if pairs is None:
            data[name] = _encode(obj, repr(name), tensors, set())
            continue
        stored[name] = [[key, _var_name(var, key)] for key, var in pairs]
        every += pairs
        pairs_of[name] = pairs
        for key, var in pairs:
            tensors[key] = _saved_value(var)
    keys = _keys_by_identity(every)
    for name, pairs in pairs_of.items():
        rows = _slot_rows(objects[name], pairs, keys)
        if waiting and name in waiting:
            stored[name], rows = waiting[name].merged(name, stored[name], rows, tensors)
        if rows is not None:
            slots[name] = rows
    def write():
        if make_folder and os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        _write_atomically(path, _serialize(tensors, stored, data, states, slots))
        if after is not None:
            after()
    _writer(every).write(write)
    return path


def _identity(var):
    """What stays the same for a variable across containers and reads: its (primary) component's id."""
    return id(_components(var)[0])


def _keys_by_identity(pairs):
    """_identity(variable) -> [its checkpoint keys], in the order of `pairs`."""
    keys = {}
    for key, var in pairs:
        keys.setdefault(_identity(var), []).append(key)
    return keys


def _slots_of(obj):
    """{id(slot variable): (its variable, slot name)} of an optimizer (`_checkpoint_slots`), else None."""
    found = getattr(obj, "_checkpoint_slots", None)
    return found() if callable(found) and not is_variable(obj) else None


def _slot_rows(obj, pairs, keys):
    """[[entry key, key of the slot's variable, slot name]] for each slot of an optimizer among `pairs` (the
    file's `dtape.slots`); None for an object without slots, and for an optimizer saved without some of its
    slots' variables (its slots are then matched by position, as in files without the table)."""
    slots = _slots_of(obj)
    if slots is None:
        return None
    rows = []
    for key, var in pairs:
        if id(var) in slots:
            primary, slot_name = slots[id(var)]
            if _identity(primary) not in keys:
                return None
            rows.append([key, keys[_identity(primary)][0], slot_name])
    return rows


def _with_waiting(name, entries, waiting, tensors):
    """An object's entries with the values still waiting for its variables put where they were in the file
    restored (after the variables that exist, before the `tail`), renumbered; `tensors` is updated."""
    head = len(entries) - waiting.tail
    if head != waiting.done:    # variables made without announcing them: the positions are unknown
        return entries
    rows = [(n, tensors[k]) for k, n in entries[:head]]
    rows += [(n, waiting.tensors[k]) for k, n in waiting._waiting()]
    rows += [(n, tensors[k]) for k, n in entries[head:]]
    out = []
    for i, (stored_name, value) in enumerate(rows):
        tensors[f"{name}/{i}"] = value
        out.append([f"{name}/{i}", stored_name])
    return out


def _serialize(tensors, stored, data, states=(), slots=None):
    """The file's bytes: safetensors with our metadata, the checksum filled in last."""
    metadata = {"dtape.format": _FORMAT, "dtape.objects": json.dumps(stored), "dtape.data": json.dumps(data),
                _SHA_KEY: _ZERO_DIGEST}
    if states:  # names of `data` entries that are objects' state dicts (absent: none, as older files)
        metadata["dtape.states"] = json.dumps(list(states))
    if slots:   # optimizer name -> its slots' variables (absent in older files: slots matched by position)
        metadata["dtape.slots"] = json.dumps(slots)
    try:
        payload = bytearray(safetensors.torch.save(tensors, metadata=metadata))
    except (ValueError, TypeError, safetensors.SafetensorError) as e:
        raise TypeError(f"checkpoint: a tensor cannot be stored in the safetensors format: {e}") from None
    start = _digest_offset(payload, _ZERO_DIGEST)
    if start is None:       # safetensors changed how it writes metadata: fail loudly, never write unchecked
        raise RuntimeError("checkpoint: the checksum field was not found once in the safetensors header")
    payload[start:start + 64] = hashlib.sha256(payload).hexdigest().encode()
    return bytes(payload)


def _digest_offset(payload, digest):
    """Offset of the 64 digest characters in the header, or None unless found exactly once."""
    header_end = 8 + struct.unpack("<Q", bytes(payload[:8]))[0]
    field = f'"{_SHA_KEY}":"{digest}"'.encode()
    at = payload.find(field, 8, header_end)
    if at < 0 or payload.find(field, at + 1, header_end) >= 0:
        return None
    return at + len(field) - 65


def _temporary_pattern(base):
    # `.<base>.<pid>.<hex>.tmp` (this version) or mkstemp's `.<base>.<8 chars>.tmp` (the previous one).
    return re.compile(rf"^\.{re.escape(base)}\.(?:(\d+)\.[0-9a-f]+|[a-z0-9_]{{8}})\.tmp$")


def _process_alive(pid):
    """Whether process `pid` may still be writing (True when unsure)."""
    if pid == os.getpid() or os.name != "posix":
        return True             # this process: another thread is saving now; Windows: os.kill would kill
    try:
        os.kill(pid, 0)         # signal 0: existence check only
    except ProcessLookupError:
        return False
    except OSError:
        return True             # e.g. another user's process
    return True


def _remove_stale_temporaries(folder, base):
    """Removes temporary files of earlier saves of `base` whose process is gone (a killed save)."""
    pattern = _temporary_pattern(base)
    for entry in os.listdir(folder):
        match = pattern.match(entry)
        if match and not (match.group(1) and _process_alive(int(match.group(1)))):
            try:
                os.remove(os.path.join(folder, entry))
            except FileNotFoundError:
                pass            # removed by a concurrent save


def _create_temporary(folder, base):
    """Opens a new temporary file; mode 0o666 lets the umask decide (mkstemp would force 0o600)."""
    while True:
        tmp = os.path.join(folder, f".{base}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
        try:
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        except FileExistsError:
            continue


def _write_atomically(path, payload):
    folder, base = os.path.split(os.path.abspath(path))
    _remove_stale_temporaries(folder, base)
    tmp, fd = _create_temporary(folder, base)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    _fsync_folder(folder)


def _fsync_folder(folder):
    """Makes the rename durable (POSIX); a no-op where folders cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- load -----------------------------------------------------------------------

_MAX_HEADER = 100_000_000  # bytes; safetensors refuses longer headers too


def _read_bytes(path):
    """The whole file, once it is known to be a regular file whose header length fits in it.

    Opened without blocking and checked with fstat (not stat, then open: the
    path could change in between): a FIFO would block the reader forever and a
    device such as /dev/zero would be read until memory runs out.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path!r} is missing: no such file") from None
    except IsADirectoryError:
        raise CheckpointError(f"checkpoint {path!r} is a directory, not a dtape checkpoint file") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {path!r} cannot be read: {e}") from None
    try:
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(f.fileno())
            if stat.S_ISDIR(mode.st_mode):
                raise CheckpointError(f"checkpoint {path!r} is a directory, not a dtape checkpoint file")
            if not stat.S_ISREG(mode.st_mode):
                raise CheckpointError(f"checkpoint {path!r} is not a regular file ({_file_kind(mode.st_mode)}); "
                                      "give the path of a file written by dtape.checkpoint.save")
            size = mode.st_size
            head = f.read(8)
            header = struct.unpack("<Q", head)[0] if len(head) == 8 else 0   # shorter: _parse_header says why
            if len(head) == 8 and header > min(size - 8, _MAX_HEADER):
                raise _not_ours(path, f"its header length field says {header} bytes, but the file has {size} "
                                      f"bytes{' (the limit is 100 MB)' if header > _MAX_HEADER else ''}")
            described = _described_size(f.read(header)) if len(head) == 8 else None
            if described is not None and described != size:
                raise _not_ours(path, f"its header describes a file of {described} bytes, but the file has {size} "
                                      "bytes (truncated, appended to, or a crafted header)")
            f.seek(len(head))
            rest = f.read(size - len(head) + 1)   # one byte more: a file that grew meanwhile is refused below
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(f"checkpoint {path!r} cannot be read: {e}") from None
    if len(head) + len(rest) != size:
        raise CheckpointError(f"checkpoint {path!r} changed while it was read ({size} bytes before, "
                              f"{len(head) + len(rest)} read); read it again once it is complete")
    return head + rest


def _described_size(header):
    """The file size a safetensors JSON header describes (8 + header + the end of the last tensor's bytes), or
    None when it does not parse (_parse_header then says what is wrong)."""
    try:
        entries = json.loads(header)
        ends = [entry["data_offsets"][1] for key, entry in entries.items() if key != "__metadata__"]
        end = max(ends, default=0)
        return 8 + len(header) + end if type(end) is int else None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError):
        return None


def _file_kind(mode):
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a plain file")


def _not_ours(path, why):
    return CheckpointError(f"checkpoint {path!r} is corrupt or not a dtape checkpoint: {why}")


def _parse_header(path, raw):
    """The metadata dict of `raw` after checking the format tag and the checksum."""
    size = struct.unpack("<Q", raw[:8])[0] if len(raw) >= 8 else None
    try:
        if size is None or size > len(raw) - 8:
            raise ValueError(f"a file of {len(raw)} bytes has no room for its header")
        metadata = json.loads(raw[8:8 + size])["__metadata__"]
        version = metadata["dtape.format"]
    except RecursionError:      # json's C decoder recurses per nesting level
        raise _not_ours(path, "its JSON header is nested too deeply") from None
    except Exception as e:      # any other parse failure: still this file's problem, never ours
        raise _not_ours(path, _why_not_ours(raw, e)) from None
    if version != _FORMAT:
        raise _not_ours(path, f"format {version!r}, expected {_FORMAT!r}")
    _verify_checksum(path, raw, metadata.get(_SHA_KEY))
    return metadata


def _why_not_ours(raw, error):
    if not raw:
        return "the file is empty"
    if raw[:2] == b"PK" or raw[:1] == b"\x80":
        return ("it looks like a torch.save/pickle file; dtape never loads pickles, since loading one can run "
                "code (re-save it with this version from a trusted process)")
    return f"no dtape header ({type(error).__name__}: {error})"


def _verify_checksum(path, raw, digest):
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise CheckpointError(f"checkpoint {path!r} is corrupt: malformed checksum field")
    start = _digest_offset(raw, digest)
    if start is None:
        raise CheckpointError(f"checkpoint {path!r} is corrupt: checksum field not found once in the header")
    zeroed = bytearray(raw)
    zeroed[start:start + 64] = _ZERO_DIGEST.encode()
    if not hmac.compare_digest(hashlib.sha256(zeroed).hexdigest(), digest):
        raise CheckpointError(f"checkpoint {path!r} is corrupt: its SHA-256 does not match its contents "
                              f"(a changed or damaged file); refusing to load it")


def _load(path):
    """(tensors, stored objects, plain data) of the checkpoint at `path`, all verified."""
    return _load_all(path)[:3]


def _load_all(path):
    """`_load(path)`, the names of the data entries that are objects' state dicts, and the slot table."""
    path = os.fspath(path)
    raw = _read_bytes(path)
    metadata = _parse_header(path, raw)
    try:
        tensors = safetensors.torch.load(raw)
        stored = json.loads(metadata["dtape.objects"])
        data = json.loads(metadata["dtape.data"])
        data = {name: _decode(node, tensors, path) for name, node in data.items()}
        _check_stored(path, stored, tensors)
        states = json.loads(metadata.get("dtape.states", "[]"))
        if not (isinstance(states, list) and all(isinstance(n, str) and n in data for n in states)):
            raise ValueError(f"state dict names {states!r:.80} are not all data entries")
        slots = _checked_slots(json.loads(metadata.get("dtape.slots", "{}")), stored)
    except CheckpointError:
        raise
    except Exception as e:     # a checksummed but inconsistent file: crafted, or a bug
        raise CheckpointError(f"checkpoint {path!r} is corrupt: {type(e).__name__}: {e}") from None
    return tensors, stored, data, states, slots


def _checked_slots(slots, stored):
    """The file's `dtape.slots` (optimizer name -> [[entry key, key of its variable or None, slot name]]) once
    every row names an entry of that optimizer; raises ValueError otherwise."""
    if not isinstance(slots, dict):
        raise ValueError("the slot table is not a JSON object")
    for name, rows in slots.items():
        keys = {key for key, _ in stored[name]}
        for row in rows if isinstance(rows, list) else [None]:
            if not (isinstance(row, list) and len(row) == 3 and row[0] in keys and isinstance(row[2], str)
                    and (row[1] is None or isinstance(row[1], str))):
                raise ValueError(f"bad slot row {row!r:.80} for {name!r}")
    return slots


def _check_stored(path, stored, tensors):
    for name, pairs in stored.items():
        for key, var_name in pairs:
            if not (isinstance(key, str) and isinstance(var_name, str) and key in tensors):
                raise CheckpointError(f"checkpoint {path!r} is corrupt: bad entry {key!r} for {name!r}")


def read(path):
    """Loads the checkpoint at `path` without restoring anything.

    Args:
      path: a file written by `save` (str or os.PathLike).

    Returns:
      dict: each variable's value under its key (`name` or `name/i`), a CPU
      torch.Tensor of the saved dtype and shape, and the plain data under its
      own name (types as in the module docstring).

    Raises:
      CheckpointError: the file is missing, unreadable, corrupt (checksum) or
        not a dtape checkpoint; no code from the file ever runs.

    Source: tf.train.load_checkpoint (a reader, by key).
    """
    tensors, stored, data = _load(path)
    out = {key: tensors[key] for pairs in stored.values() for key, _ in pairs}
    out.update(data)
    return out


# -- restore --------------------------------------------------------------------

@collective_ops.labelled("checkpoint.restore")
def restore(path, *, strict=True, **objects):
    """Restores the variables of `objects` from `path`, all or nothing.

    Each variable is matched by position within its object (`name/0`,
    `name/1`, ...) and checked against the stored one:
      * names: the stored `.name` must equal the variable's, except for
        default names, whose numbers depend on what else the process
        created. A '/'-separated name component is a default name when it
        is `Variable_<n>` or a module name that `dtape.module.unique_name`
        gives (`dense`, `dense_<n>`, for a base already used in this
        process); every other component is user-chosen and must match
        exactly (`w_1` never matches `w_2`). Default names match by the
        rank of their number among those of the same base within the
        object: saved `dense`, `dense_1` match `dense_2`, `dense_3` in that
        order (a second instance of the same model), but not `dense_3`,
        `dense_2` (reordered layers would get each other's weights), and
        `Variable_7` matches `Variable_3` when each is the first unnamed
        variable of its object. With `strict=False` names may differ
        (restore by position);
      * an optimizer's slots, when the file records their variables, are
        matched through their variable's key instead (the slot of `w`
        takes the value saved for `w`'s slot of that name, whatever order
        `build` created them in); every slot must find its value;
      * shape and dtype must be equal (no cast; as TF's restore, which
        refuses a dtype mismatch), whatever `strict` is.

    Args:
      path: a file written by `save` (str or os.PathLike).
      strict: if True (default), a renamed or reordered variable is an error.
      **objects: name -> variable, module or optimizer, as given to `save`.
        An optimizer must already have its slot variables (restore after
        `optimizer.build(variables)` or one `apply_gradients`). For a
        distributed variable every component is assigned. An object saved by
        its state dict gets `load_state_dict(saved)` (before any variable is
        assigned; a torch optimizer needs no step first).

    Returns:
      dict of the plain data stored in the file (name -> value; state dicts
      of objects are not included).

    Raises:
      CheckpointError: the file is missing, unreadable, corrupt or not a
        dtape checkpoint.
      ValueError: a name is missing from the file, a module/optimizer has a
        different number of variables, or a variable's name (strict),
        shape or dtype differs; nothing is assigned then. (A state dict that
        `load_state_dict` refuses raises its error, before any variable is
        assigned.)
      TypeError: an object is plain data, not a variable/module/optimizer.

    Call it in the cross-replica context (outside `strategy.run`). Under
    MultiWorkerMirroredStrategy every worker restores from the same file
    (the folder must be visible to all of them).
    Source: tf.train.Checkpoint.restore.
    """
    tensors, stored, data, states, slots = _load_all(path)
    path = os.fspath(path)
    plan, loads, pairs_of = [], [], {}
    objects, optional = _with_children(objects)
    for name, obj in list(objects.items()):
        if name in optional and name not in stored:   # an older file: the learning rate stays as it is
            del objects[name]
            continue
        _check_name(name)
        if _has_state_dict(obj):
            if name not in states:
                raise ValueError(f"restore: no state dict {name!r} in checkpoint {path}; it holds state dicts "
                                 f"{sorted(states)}, variables for {sorted(stored)} and data "
                                 f"{sorted(set(data) - set(states))}")
            loads.append((obj, data[name]))
            continue
        pairs_of[name] = _named_variables(name, obj)
        if pairs_of[name] is None:
            raise TypeError(f"restore: {name!r} is a {type(obj).__name__}, not a variable, module or optimizer; "
                            f"plain data comes back in restore()'s return value")
    keys = _keys_by_identity(pair for pairs in pairs_of.values() for pair in pairs)
    for name, pairs in pairs_of.items():
        by_slot = (objects[name], slots[name], keys) if name in slots and _slots_of(objects[name]) else None
        plan += _plan_restore(path, name, pairs, stored, tensors, data, strict, by_slot)
    for obj, state in loads:  # before any variable is assigned: a state dict that does not fit raises first
        obj.load_state_dict(state)
    for var, value in plan:
        _assign_all(var, value)
    return {name: value for name, value in data.items() if name not in states}


def _slot_plan_all(path, name, obj, pairs, entries, rows, keys, tensors):
    """`_by_slot`'s plan when it matches every variable and every entry of the optimizer, else ValueError."""
    plan, missing, left = _by_slot(path, name, obj, pairs, entries, rows, keys, tensors)
    if missing or left:
        raise ValueError(f"restore: the slots of {name!r} do not match checkpoint {path} by variable: "
                         f"{missing or 'none'} have no saved value, saved values {[k for k, _ in left] or 'none'} "
                         f"belong to no slot here (variables missing from this restore, or slots of other "
                         f"variables: restore the model's variables together with the optimizer, and build the "
                         f"optimizer for the same variables)")
    return plan


def _by_slot(path, name, obj, pairs, entries, rows, keys, tensors):
    """Matches an optimizer's variables with a file that records each slot's variable (`dtape.slots`).

    A slot takes the saved value of the same slot name whose variable is
    stored under a key the slot's variable has now (TF matches slot ->
    optimizer + variable in its object graph); the other variables
    (`iterations`, a loss scale) match the other entries by position, names
    checked. Returns (plan [(variable, value)], descriptions of slots with no
    saved value, saved slot entries [[key, name]] no slot takes yet).
    Raises ValueError: a different number of non-slot variables, a name,
    shape or dtype that differs.
    """
    slots, row_of = _slots_of(obj), {key: (pk, sn) for key, pk, sn in rows}
    fixed = [(key, var) for key, var in pairs if id(var) not in slots]
    fixed_entries = [entry for entry in entries if entry[0] not in row_of]
    if len(fixed) != len(fixed_entries):
        raise ValueError(f"restore: {name!r} has {len(fixed)} variables besides its slots but checkpoint {path} "
                         f"holds {len(fixed_entries)} (a different optimizer)")
    _check_names(path, name, fixed, fixed_entries, hint="")
    plan = [(var, _checked_value(path, key, var, stored_name, tensors[entry]))
            for (key, var), (entry, stored_name) in zip(fixed, fixed_entries)]
    found, missing, left = _slot_plan(path, slots, pairs, [e for e in entries if e[0] in row_of], row_of, keys,
                                      tensors)
    return plan + found, missing, left


def _slot_plan(path, slots, pairs, entries, row_of, keys, tensors):
    """(plan, slots with no saved value, saved entries no slot takes): each slot among `pairs` (`slots`: as
    `_slots_of`) takes the entry whose row (`row_of`: entry key -> (key of its variable, slot name)) names its
    slot name and a key its variable has now (`keys`: as `_keys_by_identity`)."""
    saved = {row_of[key]: (key, stored_name) for key, stored_name in entries if row_of[key][0] is not None}
    plan, missing, taken = [], [], set()
    for key, var in pairs:
        if id(var) not in slots:
            continue
        primary, slot_name = slots[id(var)]
        entry = next((saved[(k, slot_name)] for k in keys.get(_identity(primary), ()) if (k, slot_name) in saved),
                     None)
        if entry is None:
            missing.append(f"{key} ({_var_name(var, key)!r})")
            continue
        taken.add(entry[0])
        plan.append((var, _checked_value(path, key, var, entry[1], tensors[entry[0]])))
    return plan, missing, [entry for entry in entries if entry[0] not in taken]


def _plan_restore(path, name, pairs, stored, tensors, data, strict, by_slot=None):
    """[(variable, value)] for one object; `by_slot`: (optimizer, its slot rows, keys by identity) when the
    file says which variable each of its slots belongs to (then slots match by variable, not position)."""
    entries = stored.get(name)
    if entries is None:
        raise ValueError(f"restore: no {name!r} in checkpoint {path}; it holds variables for "
                         f"{sorted(stored)} and data {sorted(data)}")
    if [k for k, _ in pairs] != [k for k, _ in entries]:
        raise ValueError(f"restore: {name!r} has {len(pairs)} variables but checkpoint {path} holds {len(entries)} "
                         f"for it (an optimizer creates its slots on first use: build or apply it before restore)")
    if by_slot is not None:
        obj, rows, keys = by_slot
        return _slot_plan_all(path, name, obj, pairs, entries, rows, keys, tensors)
    if strict:
        _check_names(path, name, pairs, entries)
    plan = []
    for (key, var), (_, stored_name) in zip(pairs, entries):
        plan.append((var, _checked_value(path, key, var, stored_name, tensors[key])))
    return plan


def _canonical_names(names):
    """`names` with each default-name component renumbered by the rank of its number among those of its
    base in `names` (dense_2, dense_3 -> dense#0, dense#1); user-chosen components are kept as they are."""
    split = [[(part, default_name_part(part)) for part in name.split("/")] for name in names]
    numbers = {}
    for parts in split:
        for _, auto in parts:
            if auto is not None:
                numbers.setdefault(auto[0], set()).add(auto[1])
    rank = {base: {n: i for i, n in enumerate(sorted(ns))} for base, ns in numbers.items()}
    return ["/".join(part if auto is None else f"{auto[0]}#{rank[auto[0]][auto[1]]}" for part, auto in parts)
            for parts in split]


def _check_names(path, name, pairs, entries, hint=" Pass strict=False to restore by position."):
    names = [_var_name(var, key) for key, var in pairs]
    stored = [stored_name for _, stored_name in entries]
    wrong = [f"{key}: checkpoint has {old!r}, variable is {new!r}"
             for (key, _), old, new, old_c, new_c in zip(pairs, stored, names, _canonical_names(stored),
                                                        _canonical_names(names))
             if old_c != new_c]
    if wrong:
        raise ValueError(f"restore: variable names of {name!r} differ from checkpoint {path} (renamed or reordered "
                         f"variables; default names are compared by their order within {name!r}): "
                         + "; ".join(wrong) + "." + hint)


def _checked_value(path, key, var, stored_name, value):
    what = f"{key} ({_var_name(var, key)!r}, stored as {stored_name!r})"
    if tuple(value.shape) != tuple(var.shape):
        raise ValueError(f"restore: shape mismatch for {what}: checkpoint {path} has {tuple(value.shape)}, "
                         f"variable has {tuple(var.shape)}")
    if value.dtype != var.dtype:
        raise ValueError(f"restore: dtype mismatch for {what}: checkpoint {path} has {value.dtype}, variable has "
                         f"{var.dtype} (no cast, as TF; cast the variable or re-save)")
    return value


# -- tf.train.Checkpoint ----------------------------------------------------------

_COUNTER = "save_counter"


class Checkpoint:
    """Groups variables, modules and optimizers to save and restore together, as tf.train.Checkpoint.

    Args:
      root: optional; an object saved under the name `root` (TF's
        `Checkpoint(model)`), also `ckpt.root`.
      **objects: name -> variable, module, optimizer (anything with a
        `variables()` method or `.variables` attribute), an object saved by
        its `state_dict()` (a torch optimizer or lr scheduler, a `from_torch`
        optimizer), None (nothing saved) or a list, tuple or dict of these
        (entries `name.0`, `name.key`, ...). Each is also an attribute
        (`ckpt.model`); assigning a new attribute adds an object. Names may
        not contain '/', start with '_' or be `save_counter`.

    Raises:
      TypeError: plain data (an int, a tensor, a dataset iterator): it could
        not be restored in place; keep a counter in a `dtape.Variable`.
      ValueError: a bad name.

    The file is that of `save(path, **objects)` plus `save_counter`, so
    `dtape.checkpoint.restore`/`read` read it too. Restoring matches each
    object's variables by position and checks names (default names by
    order), shapes and dtypes as `restore` does. Values for variables that
    do not exist yet (an optimizer's slots and `iterations` before its first
    step, a layer's before its first call) wait and are assigned when they
    are created, before they are used (TF's deferred restoration): restore,
    then train one step, gives the uninterrupted run's next step; a save
    before that step writes the waiting values in their place. (Only
    layer builds and optimizer steps say they created variables: a custom
    Module creating variables in its own `__call__` is called once first.)
    An optimizer's slots are matched through the key of their variable
    when the file records it (see the module docstring), so the first step
    may create them in any order or only some of them.
    Source: tf.train.Checkpoint (by key and position; slots through their
    variable's key, as its object graph links them).

    Example:
      >>> ckpt = dtape.checkpoint.Checkpoint(model=model, optimizer=opt)
      >>> path = ckpt.save("/tmp/run/ckpt")        # /tmp/run/ckpt-1
      >>> ckpt.restore(path).assert_consumed()
    """

    def __init__(self, root=None, **objects):
        object.__setattr__(self, "_objects", {})
        object.__setattr__(self, "_save_counter", None)
        # The warning about values not restored comes once this Checkpoint and the statuses of its restores are
        # all dropped (`ckpt.restore(path).expect_partial()` drops a temporary Checkpoint first).
        tracker, outcomes = _Tracker(), []
        object.__setattr__(self, "_tracker", tracker)
        object.__setattr__(self, "_outcomes", outcomes)
        weakref.finalize(tracker, _warn_unrestored, outcomes).atexit = False
        for name, obj in (({"root": root} if root is not None else {}) | objects).items():
            setattr(self, name, obj)

    def __setattr__(self, name, value):
        if name.startswith("_") or name == _COUNTER:
            raise ValueError(f"Checkpoint object name {name!r} is reserved (names starting with '_' and "
                             f"'save_counter', the Checkpoint's own counter)")
        _check_name(name)
        _entries(name, value)     # raises for a value that cannot be restored in place
        self._objects[name] = value

    def __getattr__(self, name):
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"Checkpoint has no object {name!r} (it has {sorted(objects)})")

    @property
    def save_counter(self):
        """Number of `save` calls (an int64 variable, saved and restored with the checkpoint; 0 at first)."""
        if self._save_counter is None:
            with _tp.stop_recording():
                counter = Variable(torch.tensor(0, dtype=torch.int64), trainable=False, name=_COUNTER)
            object.__setattr__(self, "_save_counter", counter)
        return self._save_counter

    def write(self, file_prefix):
        """Writes the objects (and `save_counter`) to exactly `file_prefix`; no number, no counter change.

        Args:
          file_prefix: file path (str or os.PathLike); its folder is created.

        Returns:
          str: the path written.

        Raises: as `dtape.checkpoint.save`. Every worker calls it (rank 0
        writes). Source: tf.train.Checkpoint.write.
        """
        return self.write_then(file_prefix)

    def write_then(self, file_prefix, after=None):
        """`write`, then `after()` where the file was written (rank 0), before the others go on."""
        objects = {**self._flat(), _COUNTER: self.save_counter}
        return save_objects(file_prefix, objects, make_folder=True, after=after,
                            waiting=_still_waiting(self._outcomes, objects))

    def save(self, file_prefix):
        """Adds 1 to `save_counter` and writes `<file_prefix>-<save_counter>`.

        Args:
          file_prefix: path prefix (str or os.PathLike); its folder is created.

        Returns:
          str: the path written, for `restore` (`.../ckpt-3`).

        Raises: as `write`. The file is found by
        `dtape.checkpoint.latest_checkpoint(folder, basename)`.
        Source: tf.train.Checkpoint.save.
        """
        with _tp.stop_recording():
            self.save_counter.assign_add(1)
        return self.write(f"{os.fspath(file_prefix)}-{int(self.save_counter.numpy())}")

    def restore(self, save_path):
        """Restores the objects (and `save_counter`) from `save_path`; None restores nothing.

        Args:
          save_path: a path returned by `save` or `write`, or None (e.g. the
            `latest_checkpoint` of a first run).

        Returns:
          CheckpointLoadStatus (`assert_consumed`, `assert_existing_objects_matched`,
          `expect_partial`), or for None an InitializationOnlyStatus.

        Raises:
          CheckpointError: the file is missing, unreadable or corrupt.
          ValueError: a variable's name, shape or dtype differs from the
            file's, or an object has more variables than the file holds for
            it; nothing is assigned then. A deferred value that does not fit
            the variable later created raises the same error from the step
            or call that creates it, before the variable is used.

        Variables present now are assigned now (every component of a
        distributed variable); values of variables not created yet wait for
        them. An object missing from the file, and entries of the file no
        object takes, are reported by the status (a warning when the
        Checkpoint is dropped, unless `expect_partial()`).
        Call it in the cross-replica context; every worker restores.
        Source: tf.train.Checkpoint.restore.
        """
        if save_path is None:
            return InitializationOnlyStatus()
        return self._restore(save_path, {**self._flat(), _COUNTER: self.save_counter})

    def read(self, save_path):
        """`restore` without `save_counter` (a file from `write`; the counter keeps its value).

        Source: tf.train.Checkpoint.read.
        """
        return self._restore(save_path, self._flat())

    def _flat(self):
        return {key: obj for name, value in self._objects.items() for key, obj in _entries(name, value).items()}

    def _restore(self, save_path, objects):
        outcome = _restore_objects(save_path, objects)
        self._outcomes.append(outcome)
        return CheckpointLoadStatus(outcome, self._tracker)


def _restore_objects(path, objects):
    """Assigns what exists now, registers what waits; returns the _Outcome."""
    tensors, stored, data, states, slots = _load_all(path)
    path = os.fspath(path)
    plan, loads, waiting, missing, matched = [], [], [], [], False
    objects, optional = _with_children(objects)
    objects = {name: obj for name, obj in objects.items() if name in stored or name not in optional}
    keys = _current_keys(objects)
    for name, obj in objects.items():
        if _has_state_dict(obj):
            if name in states:
                loads.append((obj, data[name]))
                matched = True
            else:
                missing.append(f"{name} (its state dict)")
            continue
        pairs = _named_variables(name, obj)
        if name not in stored:
            if name != _COUNTER:
                described = [f"{key} ({_var_name(var, key)!r})" for key, var in pairs]
                missing += described or [f"{name} (no variables yet)"]
            continue
        entries = stored[name]
        matched = matched or name != _COUNTER
        if name in slots and _slots_of(obj) is not None:
            now, unmatched, left = _by_slot(path, name, obj, pairs, entries, slots[name], keys, tensors)
            plan, missing = plan + now, missing + unmatched
            if left:
                waiting.append(_WaitingSlots(path, name, obj, left, slots[name], tensors, objects))
            continue
        _refuse_ambiguous_slots(path, name, obj, pairs, entries)
        tail = _tail(path, name, pairs, entries)
        plan += _planned(path, name, pairs, entries, tensors, tail, range(len(pairs)))
        if len(pairs) < len(entries):
            waiting.append(_Waiting(path, name, obj, entries, tensors, len(pairs) - tail, tail))
    for obj, state in loads:
        obj.load_state_dict(state)
    for var, value in plan:
        _assign_all(var, value)
    for w in waiting:
        _restore_hooks.wait(w)
    unused = sorted(n for n in set(stored) | set(data) if n not in objects and n != _COUNTER)
    return _Outcome(path, unused, missing, waiting, matched=matched)


def _current_keys(objects):
    """_identity(variable) -> [its keys] over the variables `objects` have now (state-dict objects have none)."""
    pairs = (pair for name, obj in objects.items() if not _has_state_dict(obj)
             for pair in _named_variables(name, obj) or ())
    return _keys_by_identity(pairs)


def _refuse_ambiguous_slots(path, name, obj, pairs, entries):
    """Raises ValueError when a file without a slot table (an older dtape's) would give an optimizer's slots
    values by position while only some of them exist and their names cannot tell whose they are.

    With every slot present the position rule is checked by names (default
    names by the order their variables were created); with only some, the
    ranks of default names shift and one variable's moments would go to
    another's slots.
    """
    slots = _slots_of(obj)
    present = [_var_name(var, key) for key, var in pairs if id(var) in (slots or ())]
    if not present or len(pairs) >= len(entries):
        return
    if any(default_name_part(part) for n in present for part in n.split("/")[1:]):
        raise ValueError(
            f"restore: checkpoint {path} does not record which variable each slot of {name!r} belongs to (written "
            f"by an older dtape), and only {len(pairs)} of its {len(entries)} variables exist now, with default "
            f"names that cannot tell whose values are whose ({present[:4]}); create every slot first, "
            f"`{name}.build(model.trainable_variables)`, then restore (or restore before the first step and "
            f"build before it), and save again to record it")


def _still_waiting(outcomes, objects):
    """name -> the `_Waiting` of the latest restore whose values still wait for `objects[name]`'s variables."""
    found = {}
    for outcome in outcomes:
        for w in outcome.waiting:
            if w.pending and objects.get(w.name) is w._obj():
                found[w.name] = w
    return found


def _matched(entries, n, tail):
    """The stored entries that `n` variables match: the first `n - tail` and the last `tail`."""
    return entries[:n - tail] + entries[len(entries) - tail:]


def _tail(path, name, pairs, entries):
    """How many of an object's last variables match the last stored entries, when it has fewer than stored.

    Variables appear at the end (a lazily built model, an optimizer's slots)
    or before a fixed tail (a LossScaleOptimizer's slots come before its loss
    scale and counter): the smallest tail whose names match is taken, 0 first.
    Raises ValueError (the names of the plain prefix) when none does.
    """
    if len(pairs) > len(entries):
        raise ValueError(f"restore: {name!r} has {len(pairs)} variables but checkpoint {path} holds {len(entries)} "
                         f"for it (a different model or optimizer)")
    names = _canonical_names([_var_name(var, key) for key, var in pairs])
    for tail in range(len(pairs) + 1 if len(pairs) < len(entries) else 1):
        if _canonical_names([n for _, n in _matched(entries, len(pairs), tail)]) == names:
            return tail
    _check_names(path, name, pairs, entries[:len(pairs)], hint="")
    return 0


def _planned(path, name, pairs, entries, tensors, tail, positions):
    """[(variable, value)] for the `positions` of `pairs`, matched as `_matched` says (names, shapes checked)."""
    matched = _matched(entries, len(pairs), tail)
    _check_names(path, name, pairs, matched, hint="")
    return [(pairs[i][1], _checked_value(path, pairs[i][0], pairs[i][1], matched[i][1], tensors[matched[i][0]]))
            for i in positions]


class _Waiting:
    """The stored values of one object whose variables do not all exist yet, assigned as they appear.

    Called by `dtape._restore_hooks.variables_created(owner)`; returns True once
    every value is assigned or the object is gone. The entries `done` up to
    `len(entries) - tail` wait (see `_tail`).
    """

    def __init__(self, path, name, obj, entries, tensors, done, tail):
        self.path, self.name, self.entries, self.done, self.tail = path, name, entries, done, tail
        self.tensors = {key: tensors[key] for key, _ in self._waiting()}
        try:
            self._obj = weakref.ref(obj)
        except TypeError:
            self._obj = lambda: obj

    def _waiting(self):
        return self.entries[self.done:len(self.entries) - self.tail]

    @property
    def pending(self):
        """Keys still waiting for their variable."""
        return [key for key, _ in self._waiting()] if self._obj() is not None else []

    def __call__(self, owner):
        obj = self._obj()
        if obj is None:
            return True
        pairs = _named_variables(self.name, obj)
        if len(pairs) - self.tail > self.done:
            announced = {id(v) for v in _variables_of(owner) or ()}
            if any(id(var) not in announced for _, var in pairs[self.done:len(pairs) - self.tail]):
                raise RuntimeError(
                    f"checkpoint {self.path}: {self.name!r} created variables without a layer build announcing "
                    f"them (a Module creating variables in its own __call__?), so they may have been used before "
                    f"their restored values arrived; call it once before restoring")
            ctx = distribute.get_replica_context()
            if ctx is not None and ctx.num_replicas_in_sync > 1:
                # A layer built inside strategy.run is built by every replica thread, each of which gets here:
                # one merge_call assigns every component while all replicas wait, before any uses them.
                ctx.merge_call(lambda _strategy: self._assign(obj))
            else:
                self._assign(obj)
        return not self._waiting()

    def merged(self, name, entries, rows, tensors):
        """(entries, slot rows) of a save of the object: the waiting values where they were in the file restored;
        no slot rows then (that file had none: positions keep their meaning)."""
        out = _with_waiting(name, entries, self, tensors)
        return out, rows if out is entries else None

    def _assign(self, obj):
        pairs = _named_variables(self.name, obj)
        _refuse_ambiguous_slots(self.path, self.name, obj, pairs, self.entries)
        head = len(pairs) - self.tail
        if head <= self.done:
            return
        if head > len(self.entries) - self.tail:
            raise ValueError(f"restore: {self.name!r} now has {len(pairs)} variables but checkpoint {self.path} "
                             f"holds {len(self.entries)} for it (a different model or optimizer)")
        for var, value in _planned(self.path, self.name, pairs, self.entries, self.tensors, self.tail,
                                   range(self.done, head)):
            _assign_all(var, value)
        for key, _ in self.entries[self.done:head]:
            del self.tensors[key]
        self.done = head


class _WaitingSlots:
    """Saved slot values of an optimizer waiting for their slots, each for the slot of its own variable.

    Called as `_Waiting`; a slot takes the value saved for its slot name and
    its variable (by the variable's key among the objects restored with the
    optimizer, looked up when the slot appears: a layer built later counts).
    """

    def __init__(self, path, name, obj, left, rows, tensors, objects):
        self.path, self.name, self.left = path, name, [list(entry) for entry in left]
        self.rows = {key: (pk, sn) for key, pk, sn in rows}
        self.tensors = {key: tensors[key] for key, _ in self.left}
        self._obj, self._objects = _weak(obj), {n: _weak(o) for n, o in objects.items()}
        self._seen = self._slot_ids(obj)    # slots present at restore: they took their values then

    @property
    def pending(self):
        """Keys still waiting for their slot."""
        return [key for key, _ in self.left] if self._obj() is not None else []

    def __call__(self, owner):
        obj = self._obj()
        if obj is None:
            return True
        if self._slot_ids(obj) <= self._seen:     # no new slot (another object announced its variables)
            return False
        ctx = distribute.get_replica_context()
        if ctx is not None and ctx.num_replicas_in_sync > 1:    # one assignment while every replica waits
            ctx.merge_call(lambda _strategy: self._assign(obj, owner))
        else:
            self._assign(obj, owner)
        return not self.left

    def _assign(self, obj, owner):
        objects = {n: o for n, ref in self._objects.items() if (o := ref()) is not None}
        plan, _, left = _slot_plan(self.path, _slots_of(obj), _named_variables(self.name, obj), self.left,
                                   self.rows, _current_keys(objects), self.tensors)
        self._seen = self._slot_ids(obj)
        if not plan:
            return
        announced = {id(v) for v in _variables_of(owner) or ()}
        if any(id(var) not in announced for var, _ in plan):
            raise RuntimeError(f"checkpoint {self.path}: slots of {self.name!r} appeared without their optimizer "
                               f"announcing them, so they may have been used before their restored values arrived")
        for var, value in plan:
            _assign_all(var, value)
        self.left = left
        self.tensors = {key: self.tensors[key] for key, _ in left}

    def _slot_ids(self, obj):
        """Never-reused ids (`Variable._id`) of the optimizer's slots now."""
        slots = _slots_of(obj)
        return {getattr(_components(var)[0], "_id", id(var)) for _, var in _named_variables(self.name, obj)
                if id(var) in slots}

    def merged(self, name, entries, rows, tensors):
        """(entries, slot rows) of a save of the optimizer: the waiting values added after its variables."""
        entries, rows = [list(e) for e in entries], list(rows or [])
        for i, (key, stored_name) in enumerate(self.left, start=len(entries)):
            tensors[f"{name}/{i}"] = self.tensors[key]
            entries.append([f"{name}/{i}", stored_name])
            rows.append([f"{name}/{i}", *self.rows[key]])
        return entries, rows


def _weak(obj):
    """A weak reference to `obj`, or a callable returning it where it takes none."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _entries(name, value):
    """{entry name: object} for one Checkpoint attribute: nothing for None, one entry per element of a list,
    tuple or dict of objects (`nets.0`, `nets.gen`, as TF tracks nested structures), else the object itself."""
    if value is None:
        return {}
    if isinstance(value, (list, tuple, dict)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        out = {}
        for key, item in items:
            _check_name(f"{key}")
            out.update(_entries(f"{name}.{key}", item))
        return out
    if isinstance(value, Checkpoint):
        # TF's hand-built object graph (Checkpoint(l1=Checkpoint(bias=v))): ours matches top-level names by position
        raise TypeError(f"Checkpoint: {name!r} is a Checkpoint; a Checkpoint inside a Checkpoint (TF's hand-built "
                        f"object graph, to restore single variables) is not supported: dtape matches each top-level "
                        f"object's variables by position. Restore into the real objects (Checkpoint(net=net)) or read "
                        f"one value with dtape.checkpoint.read(path)[key] (keys like 'net/0')")
    if not (_has_state_dict(value) or _named_variables(name, value) is not None):
        raise TypeError(f"Checkpoint: {name!r} is a {type(value).__name__}, not a variable, module, optimizer or "
                        f"object with state_dict()/load_state_dict() (plain data cannot be restored in place: keep "
                        f"a counter in a dtape.Variable; dtape.checkpoint.save stores plain data)")
    return {name: value}


class _Tracker:
    """Referenced by a Checkpoint and its statuses: when it dies, all of them are gone."""


def _warn_unrestored(outcomes):
    problems = [p for outcome in outcomes if not outcome.partial_expected for p in outcome.unresolved()]
    if problems:
        warnings.warn(f"a Checkpoint was dropped with values not restored ({'; '.join(problems)}); call "
                      f"expect_partial() on the restore status if this is intended", stacklevel=2)


class _Outcome:
    """What one restore matched and left; read by its status and by the warning when it is all dropped."""

    def __init__(self, path, unused, missing, waiting, matched):
        self.path, self.unused, self.missing, self.waiting, self.matched = path, unused, missing, waiting, matched
        self.partial_expected = False

    def unresolved(self):
        """Descriptions of what is not restored now: file entries no object took, variables absent from the
        file, values still waiting for their variables (list of str; empty when all matched)."""
        out = [f"checkpoint entries matched by no object: {self.unused}"] if self.unused else []
        if self.missing:
            out.append(f"variables not in the checkpoint: {self.missing}")
        pending = [key for w in self.waiting for key in w.pending]
        if pending:
            out.append(f"values waiting for variables not created yet (an optimizer's first step or a layer's "
                       f"first call creates them): {pending}")
        return out


class CheckpointLoadStatus:
    """What a `Checkpoint.restore` matched; the assertions check it when called (deferred values count).

    Source: TF's CheckpointLoadStatus.
    """

    def __init__(self, outcome, tracker):
        self._outcome, self._tracker = outcome, tracker

    def unresolved(self):
        """Descriptions of what is not restored now: file entries no object took, variables absent from the
        file, values still waiting for their variables (list of str; empty when all matched)."""
        return self._outcome.unresolved()

    def assert_consumed(self):
        """Raises AssertionError unless every file entry and every object's variable was matched and no
        value still waits for its variable; returns self."""
        problems = self.unresolved()
        if problems:
            raise AssertionError(f"checkpoint {self._outcome.path}: " + "; ".join(problems))
        return self

    def assert_existing_objects_matched(self):
        """Raises AssertionError if a variable that exists now got no value from the file; returns self
        (file entries no object took, and values waiting for variables, are allowed)."""
        if self._outcome.missing:
            raise AssertionError(f"checkpoint {self._outcome.path}: variables not in the checkpoint: "
                                 f"{self._outcome.missing}")
        return self

    def assert_nontrivial_match(self):
        """Raises AssertionError if nothing but `save_counter` was matched; returns self."""
        if not self._outcome.matched:
            raise AssertionError(f"checkpoint {self._outcome.path}: nothing in it matched the Checkpoint's objects")
        return self

    def expect_partial(self):
        """Silences the warning about values not restored when the Checkpoint is dropped; returns self."""
        self._outcome.partial_expected = True
        return self

    def run_restore_ops(self, session=None):
        """Does nothing: values are assigned by `restore` or when their variables are created (TF 2)."""

    def initialize_or_restore(self, session=None):
        """Does nothing: values are assigned by `restore` or when their variables are created (TF 2)."""


class InitializationOnlyStatus:
    """The status of `Checkpoint.restore(None)`: nothing was restored; the assertions raise.

    Source: TF's InitializationOnlyStatus.
    """

    def assert_consumed(self):
        raise AssertionError("No checkpoint specified (save_path=None); nothing is being restored.")

    assert_existing_objects_matched = assert_nontrivial_match = assert_consumed

    def expect_partial(self):
        """Returns self."""
        return self

    def run_restore_ops(self, session=None):
        """Does nothing."""

    def initialize_or_restore(self, session=None):
        """Does nothing: the objects keep their initial values."""


# -- numbered checkpoints ---------------------------------------------------------

def numbered_checkpoints(directory, checkpoint_name):
    """[(number, path)] of `<checkpoint_name>-<n>` files in `directory`, by number; [] if it is missing."""
    return sorted((number, path) for name, number, path in _numbered_files(directory) if name == checkpoint_name)


def _numbered_files(directory):
    """(prefix, number, path) of every `<prefix>-<n>` entry of `directory` (not hidden); [] if it is missing."""
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise CheckpointError(f"checkpoint directory {directory!r} is a file, not a directory") from None
    return [(m.group(1), int(m.group(2)), os.path.join(directory, e)) for e in entries
            if (m := _NUMBERED_FILE.match(e))]


_NUMBERED_FILE = re.compile(r"^([^.].*)-(\d+)$")


def latest_checkpoint(directory, checkpoint_name=None):
    """The path of the newest checkpoint in `directory`.

    Args:
      directory: folder (str or os.PathLike), as given to `CheckpointManager`
        or the folder of `Checkpoint.save`'s prefix or of ModelCheckpoint's
        / `save_weights`' paths.
      checkpoint_name: the prefix of numbered files `<checkpoint_name>-<n>`;
        the highest number is returned. None (default): the newest of
        * the one prefix of the `<prefix>-<n>` files there ("ckpt" when
          several include it), so `Checkpoint.save(folder + "/model")` is
          found as TF finds it, and
        * the file last written by `ModelCheckpoint` or `Model.save_weights`
          (any name, e.g. "weights.03-0.52"), which the folder's state file
          `checkpoint` records, as TF's state file does; it is the newest
          unless a numbered file was saved after it.

    Returns:
      str or None: the path, or None when there is none (or no folder).

    Raises:
      CheckpointError: `directory` is a file; with `checkpoint_name=None`,
        numbered files of several prefixes (none "ckpt"): pass the name.

    Source: tf.train.latest_checkpoint (which reads TF's state file; here the
    folder is listed, numbers order the numbered checkpoints, and the state
    file records only what ModelCheckpoint / save_weights wrote).
    """
    directory = os.fspath(directory)
    if checkpoint_name is not None:
        found = numbered_checkpoints(directory, checkpoint_name)
        return found[-1][1] if found else None
    numbered = _newest_numbered(directory)
    recorded = _read_state(directory)
    if recorded is None or not os.path.exists(os.path.join(directory, recorded["latest"])):
        return numbered
    if numbered is not None and os.path.basename(numbered) != recorded["numbered_then"]:
        return numbered     # a numbered checkpoint was saved after the recorded file
    return os.path.join(directory, recorded["latest"])


def _newest_numbered(directory):
    """The highest-numbered `<prefix>-<n>` of the folder's one prefix ("ckpt" among several), or None."""
    prefixes = sorted({name for name, _, _ in _numbered_files(directory)})
    if len(prefixes) > 1 and "ckpt" not in prefixes:
        raise CheckpointError(f"checkpoint directory {directory!r} holds numbered files of several prefixes "
                              f"{prefixes}; pass checkpoint_name= to choose one")
    found = numbered_checkpoints(directory, "ckpt" if len(prefixes) != 1 else prefixes[0])
    return found[-1][1] if found else None


STATE_FILE = "checkpoint"   # TF's name for the folder's state file


def record_latest(path):
    """Notes `path` as its folder's newest checkpoint, for `latest_checkpoint(folder)` (ModelCheckpoint and
    `Model.save_weights` call it where the file was written: rank 0 under MultiWorkerMirroredStrategy).

    The folder's state file `checkpoint` (JSON, replaced atomically) holds
    the file's name and the newest numbered checkpoint at that moment.
    Raises ValueError for a checkpoint named `checkpoint` (the state file's name).
    Source: TF's update_checkpoint_state, called by Model.save_weights.
    """
    path = check_not_state_file(path)
    folder, name = os.path.split(path)
    try:
        numbered = _newest_numbered(folder or ".")
    except CheckpointError:   # several prefixes: latest_checkpoint(folder) then asks for a name anyway
        numbered = None
    state = {"latest": name, "numbered_then": None if numbered is None else os.path.basename(numbered)}
    _write_atomically(os.path.join(folder, STATE_FILE), json.dumps(state).encode())


def check_not_state_file(path):
    """`path` (str); ValueError when its file name is that of the folder's state file, `checkpoint`."""
    path = os.fspath(path)
    if os.path.basename(path) == STATE_FILE:
        raise ValueError(f"a checkpoint may not be named {STATE_FILE!r} (the folder's state file, which "
                         f"latest_checkpoint reads); choose another file name than {path!r}")
    return path


def _read_state(directory):
    """The state file's {"latest", "numbered_then"}, or None when there is none or it is not ours."""
    try:
        with open(os.path.join(directory, STATE_FILE)) as f:
            state = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or not isinstance(state.get("latest"), str):
        return None
    return state


def remove_checkpoint(path, strategy=None, folder_too=False):
    """Deletes the checkpoint file `path` where checkpoints are written (rank 0 under
    MultiWorkerMirroredStrategy; every worker calls it and waits until it is gone). A missing file is no error.

    `strategy`: the one whose workers take part (default: the current one).
    `folder_too`: also remove the file's folder when nothing else is left in it.
    """
    path = os.fspath(path)

    def remove():
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        if folder_too:
            try:
                os.rmdir(os.path.dirname(path) or ".")
            except OSError:
                pass     # not empty (other files) or already gone
    _ExtendedView((strategy or distribute.get_strategy()).extended).write(remove)
