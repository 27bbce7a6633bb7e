"""Carries a default (thread-local) `torch.profiler` into MirroredStrategy's replica threads.

A default `torch.profiler.profile()` keeps its state and its op callbacks in
the C++ thread-local state of the thread that started it: the debug info
chain (the profiler's state) and the RecordFunction callbacks. torch's own
threads (autograd engine, `at::launch`) carry them with `at::ThreadLocalState`,
but torch binds no Python name for it. `_csrc/thread_state.cpp` captures those
two pieces on the caller thread and installs them on a replica thread for the
length of its job, then gives the replica thread its own back; nothing else
(grad mode, autocast, mode stacks, saved-tensor hooks) is carried, so a
profiled run computes what an unprofiled one does.

The helper is a plain C library (no Python headers) built on first need by
`torch.utils.cpp_extension.load` (its on-disk cache, build lock and build
directory, `TORCH_EXTENSIONS_DIR` honoured; needs a C++ compiler and ninja) and
called through ctypes. A build that fails is not retried in this process; the
caller then warns, naming the reason.

Source: torch's `at::ThreadLocalState` / `ThreadLocalStateGuard`
(ATen/ThreadLocalState.h), which copy the same two pieces among the rest.
"""
import contextlib
import ctypes
import os
import re
import sys
import sysconfig
import threading
import time
import weakref

import torch
from torch.utils import cpp_extension

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_csrc", "thread_state.cpp")
_NAME = "dtape_thread_state"
# How long to wait for another process's build lock before giving up. A build
# takes seconds to a minute on a loaded machine; a lock older than this was
# left by a build killed midway, and torch's own wait for it never ends.
LOCK_WAIT_S = 600.0
_LOCK_POLL_S = 0.1
_MAX_REASON_CHARS = 1500

_build_lock = threading.Lock()
_built = {"lib": None, "error": None}


class CapturedProfiler:
    """A thread's profiler state (its debug info chain and RecordFunction callbacks), freed with this object."""

    __slots__ = ("_lib", "_ptr", "__weakref__")

    def __init__(self, lib, ptr):
        self._lib, self._ptr = lib, ptr
        weakref.finalize(self, lib.dtape_thread_state_free, ptr)

    @contextlib.contextmanager
    def entered(self):
        """Installs the captured state on the current thread; on leaving (exceptions too) restores the thread's own."""
        guard = self._lib.dtape_thread_state_enter(self._ptr)
        try:
            yield
        finally:
            if guard:  # NULL only if the C++ side could not allocate: that job is simply not profiled
                self._lib.dtape_thread_state_exit(guard)


def capture():
    """The calling thread's profiler state, to enter on other threads.

    Returns:
      (CapturedProfiler, None), or (None, reason) when the helper library
      could not be built or loaded (`reason` says why: no compiler, no ninja,
      a stale build lock...).
    """
    lib, error = library()
    if lib is None:
        return None, error
    ptr = lib.dtape_thread_state_capture()
    if not ptr:
        return None, "capturing the profiler state failed (out of memory)"
    return CapturedProfiler(lib, ptr), None


def library():
    """(the ctypes library, None) once built and loaded, else (None, reason); built at most once per process."""
    with _build_lock:
        if _built["lib"] is None and _built["error"] is None:
            try:
                _built["lib"] = _load()
            except Exception as e:  # noqa: BLE001 - any build failure falls back to a warning naming it
                _built["error"] = _reason(e)
    return _built["lib"], _built["error"]


def _load():
    build_dir = _build_directory()
    os.makedirs(build_dir, exist_ok=True)
    _wait_for_build_lock(os.path.join(build_dir, "lock"))
    with _ninja_on_path():
        path = cpp_extension.load(_NAME, [_SOURCE], extra_cflags=["-O2"], build_directory=build_dir,
                                  is_python_module=False, verbose=False)
    return _declare(ctypes.CDLL(path))


def _ninja_wheel_bin():
    """The environment's scripts folder if the `ninja` wheel (a dependency) put its binary there, else None."""
    scripts = sysconfig.get_path("scripts")
    return scripts if scripts and os.path.isfile(os.path.join(scripts, "ninja")) else None


@contextlib.contextmanager
def _ninja_on_path():
    """Puts the ninja wheel's binary first on PATH for the build: a virtual environment's Python run without
    activating it (`.venv/bin/python`) has the wheel but not its `bin` on PATH, and torch runs `ninja` by name."""
    bin_dir = _ninja_wheel_bin()
    old = os.environ.get("PATH")
    if bin_dir:
        os.environ["PATH"] = bin_dir + os.pathsep + (old or "")
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old


def _build_directory():
    """Under torch's extension root (`TORCH_EXTENSIONS_DIR`, else torch's default), one per Python and torch
    version: the library links against this torch's libraries."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    version = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
    return os.path.join(root, re.sub(r"[^\w.-]", "_", version), _NAME)


def _declare(lib):
    for name, restype, argtypes in (("capture", ctypes.c_void_p, []),
                                    ("enter", ctypes.c_void_p, [ctypes.c_void_p]),
                                    ("exit", None, [ctypes.c_void_p]),
                                    ("free", None, [ctypes.c_void_p])):
        fn = getattr(lib, "dtape_thread_state_" + name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def _wait_for_build_lock(lock_path):
    """Waits, bounded, while another process builds (torch's FileBaton would wait on a stale lock forever)."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while os.path.exists(lock_path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the build lock {lock_path} has existed for over {LOCK_WAIT_S:.0f} s; a build "
                               "killed midway leaves it behind: delete it and run again")
        time.sleep(_LOCK_POLL_S)


def _reason(e):
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= _MAX_REASON_CHARS else text[:_MAX_REASON_CHARS] + " ..."


__all__ = ["CapturedProfiler", "capture", "library", "LOCK_WAIT_S"]
