"""DTAPE_* environment settings, read once at import and validated.

Process-wide, read-only after import. Stdlib only (layer 0).
"""
import os

_VALID_FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")


def _read_float(name, default):
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; set it to seconds, e.g. {name}=300") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be a positive number of seconds")
    return value


def _read_choice(name, default, choices):
    raw = os.environ.get(name, default)
    if raw not in choices:
        raise ValueError(f"{name}={raw!r} is not valid; choose one of {', '.join(choices)}")
    return raw


# Seconds any replica thread, merge_call rendezvous or collective waits before
# failing with a TimeoutError (never a silent hang).
DISTRIBUTE_TIMEOUT_S = _read_float("DTAPE_DISTRIBUTE_TIMEOUT", 300.0)

# Default dtype for Python floats given to dtape.constant / convert_to_tensor.
DEFAULT_FLOAT_DTYPE = _read_choice("DTAPE_DEFAULT_FLOAT_DTYPE", "float32", _VALID_FLOAT_DTYPES)
