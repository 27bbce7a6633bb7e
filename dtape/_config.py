"""DTAPE_* environment settings, read once at import and validated.

Process-wide, read-only after import. Stdlib only (layer 0).
"""
import math
import numbers
import os
import threading

_VALID_FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")


def validate_timeout(value, source="timeout"):
    """Seconds to wait on a replica, as a float: finite and greater than zero.

    Every wait in dtape has a timeout, so there is no "wait forever": NaN,
    zero, negative numbers and infinity are rejected (use a large finite
    number, e.g. 86400, for a very slow step). Used for both the strategy's
    `timeout=` argument and DTAPE_DISTRIBUTE_TIMEOUT.

    Args:
      value: a real number (int, float, numpy integer or floating; not bool).
      source: what the value came from, for the message (e.g. "timeout=").

    Raises:
      TypeError: if `value` is not a real number.
      ValueError: if it is NaN, <= 0, infinite or above threading.TIMEOUT_MAX.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy numbers register as Real
        raise TypeError(f"{source} must be a number of seconds, got {type(value).__name__} {value!r}")
    value = float(value)
    if math.isnan(value) or value <= 0:
        raise ValueError(f"{source} is {value!r}; it must be a positive number of seconds, e.g. 300")
    if value > threading.TIMEOUT_MAX:  # includes infinity
        raise ValueError(f"{source} is {value!r}; every wait needs a finite timeout (at most "
                         f"{threading.TIMEOUT_MAX:.3g} s): use a large finite number, e.g. 86400")
    return value


def _read_timeout(name, default):
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; set it to seconds, e.g. {name}=300") from None
    return validate_timeout(value, f"{name}={raw!r}")


def _read_choice(name, default, choices):
    raw = os.environ.get(name, default)
    if raw not in choices:
        raise ValueError(f"{name}={raw!r} is not valid; choose one of {', '.join(choices)}")
    return raw


# Seconds any replica thread, merge_call rendezvous or collective waits before
# failing with a TimeoutError (never a silent hang).
DISTRIBUTE_TIMEOUT_S = _read_timeout("DTAPE_DISTRIBUTE_TIMEOUT", 300.0)

# Default dtype for Python floats given to dtape.constant / convert_to_tensor.
DEFAULT_FLOAT_DTYPE = _read_choice("DTAPE_DEFAULT_FLOAT_DTYPE", "float32", _VALID_FLOAT_DTYPES)

# Whether MultiWorkerMirroredStrategy checks, before every collective, that every worker
# entered the same one (sequence number, kind, caller, shape, dtype). "0" turns the check
# off (benchmarks only; then a mismatch may pair wrong or abort). Must be the same on every worker.
CHECK_COLLECTIVES = _read_choice("DTAPE_CHECK_COLLECTIVES", "1", ("0", "1")) == "1"
