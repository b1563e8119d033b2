"""glibc malloc settings for a serving process, applied in the process itself.

A prefill step allocates and frees hundreds of MiB of activations on the
engine's step thread. With glibc's defaults much of that memory goes back to
the OS when the step frees it (a thread's arena unmaps its emptied heaps; an
arena trims a free top above a threshold that follows the largest block freed
so far; blocks above the mmap threshold are unmapped on free) and the next
step faults every page in again: ~82,000 minor faults per 2048-token step,
which took 412 ms alone and 630-810 ms in the server (docs/benchmarks.md).
Per-thread arenas also let RSS creep over hours of mixed load ("Soak").

``tune_malloc`` sets, through ``mallopt``, before the model loads:
- ``M_ARENA_MAX`` = 1: every thread allocates from the main arena (the brk
  heap). A second arena (``MALLOC_ARENA_MAX=2``, what scripts/run.sh and the
  image once set) serves the step thread from 64 MiB heaps of its own, and
  glibc unmaps such a heap whenever it empties, whatever the trim threshold
  says: a long-running server's step thread mapped and unmapped heaps around
  every prefill step (42,000-81,000 minor faults per 2048-token step against
  ~11,500, its new KV blocks, with one arena; the notebook that docs/benchmarks.md was until 2026-12-06, session 13).
  Python's small objects come from its own allocator, so the one lock is
  rarely contended;
- ``M_MMAP_THRESHOLD`` = 32 MiB: blocks below it come from the arenas (and are
  reused), not from a fresh mapping each time;
- ``M_TRIM_THRESHOLD`` = 1 GiB: an arena keeps up to that much free memory at
  its top instead of returning it after every step.
The cost: up to the trim threshold of freed memory stays resident after a large
step (the next one reuses it). A setting the user made wins: with any
``MALLOC_*`` variable glibc reads, a ``glibc.malloc`` tunable in
``GLIBC_TUNABLES``, or another allocator in ``LD_PRELOAD`` (tcmalloc,
jemalloc) nothing is changed. On a C library other than glibc nothing is
changed either. Whatever happened is one line of the load log.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Mapping

log = logging.getLogger("baton.backend")

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

SETTINGS = ((M_ARENA_MAX, "arena_max", 1),
            (M_MMAP_THRESHOLD, "mmap_threshold", 32 << 20),
            (M_TRIM_THRESHOLD, "trim_threshold", 1 << 30))

# The variables glibc's malloc reads at start (besides GLIBC_TUNABLES).
_GLIBC_MALLOC_VARIABLES = ("MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST", "MALLOC_MMAP_THRESHOLD_",
                           "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
                           "MALLOC_PERTURB_", "MALLOC_CHECK_")

_applied: str | None = None


def user_setting(environ: Mapping[str, str]) -> str | None:
    """The user's own malloc setting, in words, if the environment holds one."""
    for name in _GLIBC_MALLOC_VARIABLES:
        if environ.get(name, "") != "":
            return f"{name}={environ[name]}"
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return f"GLIBC_TUNABLES={environ['GLIBC_TUNABLES']}"
    preload = environ.get("LD_PRELOAD", "")
    if "malloc" in preload or "jemalloc" in preload:
        return f"LD_PRELOAD={preload}"
    return None


def _glibc():
    """The process's C library if it is glibc, else None."""
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return libc


def tune_malloc(environ: Mapping[str, str] | None = None) -> str:
    """Apply SETTINGS once per process (later calls repeat the first answer);
    returns what was done, in words, and logs it."""
    global _applied
    if _applied is not None:
        return _applied
    environ = os.environ if environ is None else environ
    own = user_setting(environ)
    libc = None if own else _glibc()
    if own:
        text = f"malloc: left as the environment sets it ({own})"
    elif libc is None:
        text = "malloc: not glibc; allocator settings left alone"
    else:
        done = [f"{name} {value}" for param, name, value in SETTINGS
                if libc.mallopt(param, value) == 1]
        text = ("malloc: glibc " + libc.gnu_get_libc_version().decode() + ", "
                + (", ".join(done) if done else "mallopt refused every setting"))
    log.info("%s", text)
    _applied = text
    return text
